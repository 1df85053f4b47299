//! The full actor objective (verl `dp_actor.update_policy`):
//!
//! ```text
//! loss = pg_loss − entropy_coeff · agg(H, mask) + kl_loss_coef · agg(k(logp, ref_logp), mask)
//! ```
//!
//! (§5.8 KL in the loss, §5.9 entropy bonus). Both regularizers use the policy loss's resolved
//! aggregation mode; the §5.6 clip-bias scale multiplies the policy-gradient term only.

use std::collections::BTreeMap;

use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use turnwise_core::metric_keys as mk;
use turnwise_core::range::{Range, RangeErrors};

use super::agg::AggOptions;
use super::entropy::entropy_bonus;
use super::kl::{KlPenalty, kl_loss};
use super::policy::{PolicyLossConfig, PolicyLossInput, PolicyLossMetrics, compute_policy_loss};
use super::{LossError, Result, finite_scalar};

/// Config of the actor objective (verl `actor` keys).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ActorLossConfig {
    /// The policy-gradient loss.
    pub policy: PolicyLossConfig,
    /// Add the KL term to the loss (default false).
    pub use_kl_loss: bool,
    /// KL coefficient (default 0.001, the GRPO baselines').
    pub kl_loss_coef: f64,
    /// KL estimator (default `low_var_kl`).
    pub kl_loss_type: KlPenalty,
    /// Entropy bonus coefficient (default 0; IGPO 0.001).
    pub entropy_coeff: f64,
}

impl Default for ActorLossConfig {
    fn default() -> Self {
        Self {
            policy: PolicyLossConfig::default(),
            use_kl_loss: false,
            kl_loss_coef: 0.001,
            kl_loss_type: KlPenalty::default(),
            entropy_coeff: 0.0,
        }
    }
}

impl ActorLossConfig {
    /// Checks that its numbers lie in their ranges, reporting every one that does not
    /// ([`LossError::InvalidSettings`], each under its field's name relative to `[actor]`): the
    /// coefficients `kl_loss_coef` and `entropy_coeff` at least 0; the clip ratios
    /// `policy.clip_ratio`, `policy.clip_ratio_low` and `policy.clip_ratio_high`, where set,
    /// above 0; the dual clip `policy.clip_ratio_c`, where set, above 1 (whether or not the
    /// loss uses it). [`PolicyLossConfig::resolve`] checks the resolved loss's own bounds.
    pub fn validate(&self) -> Result<()> {
        let mut p = Vec::new();
        Range::NonNegative.check(&mut p, "entropy_coeff", self.entropy_coeff);
        Range::NonNegative.check(&mut p, "kl_loss_coef", self.kl_loss_coef);
        let policy = &self.policy;
        for (field, value, range) in [
            ("policy.clip_ratio", policy.clip_ratio, Range::Positive),
            ("policy.clip_ratio_c", policy.clip_ratio_c, Range::AboveOne),
            (
                "policy.clip_ratio_high",
                policy.clip_ratio_high,
                Range::Positive,
            ),
            (
                "policy.clip_ratio_low",
                policy.clip_ratio_low,
                Range::Positive,
            ),
        ] {
            if let Some(x) = value {
                range.check(&mut p, field, x);
            }
        }
        RangeErrors::into_result(p).map_err(LossError::InvalidSettings)
    }
}

/// Inputs of the actor objective.
#[derive(Debug, Clone, Copy)]
pub struct ActorLossInput<'a> {
    /// The policy-loss tensors.
    pub policy: PolicyLossInput<'a>,
    /// Reference-policy log-probs [B, L] (needed with `use_kl_loss`).
    pub ref_logp: Option<&'a Tensor>,
    /// Per-token entropy [B, L] from [`super::entropy_from_logits`] (needed when
    /// `entropy_coeff != 0`; logged when given).
    pub entropy: Option<&'a Tensor>,
}

/// Diagnostics of the actor objective.
#[derive(Debug, Clone, PartialEq)]
pub struct ActorLossMetrics {
    /// Policy-loss diagnostics.
    pub policy: PolicyLossMetrics,
    /// `actor/kl_loss` (aggregated KL, before the coefficient).
    pub kl_loss: Option<f64>,
    /// `actor/kl_coef`.
    pub kl_coef: f64,
    /// `actor/entropy_agg`: the entropy aggregated as the loss aggregates (verl's
    /// `actor/entropy`, the value the entropy bonus scales).
    pub entropy: Option<f64>,
    /// `actor/entropy`: the mean entropy per loss-mask token, whatever the aggregation, so that
    /// runs with different `loss_agg_mode`s compare.
    pub entropy_token_mean: Option<f64>,
    /// Value of the total loss.
    pub total_loss: f64,
}

impl ActorLossMetrics {
    /// Metrics keyed by their logged names.
    pub fn to_map(&self) -> BTreeMap<String, f64> {
        let mut m = self.policy.to_map();
        if let Some(k) = self.kl_loss {
            m.insert(mk::actor::KL_LOSS.to_string(), k);
            m.insert(mk::actor::KL_COEF.to_string(), self.kl_coef);
        }
        if let Some(h) = self.entropy {
            m.insert(mk::actor::ENTROPY_AGG.to_string(), h);
        }
        if let Some(h) = self.entropy_token_mean {
            m.insert(mk::actor::ENTROPY.to_string(), h);
        }
        m.insert(mk::actor::LOSS.to_string(), self.total_loss);
        m
    }
}

/// Result of [`compute_actor_loss`].
#[derive(Debug, Clone)]
pub struct ActorLossOutput {
    /// Scalar total loss, differentiable w.r.t. `logp` (and the logits behind `entropy`).
    pub loss: Tensor,
    /// Diagnostics.
    pub metrics: ActorLossMetrics,
    /// Per row and token: the policy loss's PPO clip was active on a loss-mask token
    /// ([`super::policy::PolicyLossOutput::clipped`]).
    pub clipped: Vec<Vec<bool>>,
}

/// Computes `pg − entropy_coeff·H + kl_coef·KL` (§5.8, §5.9).
pub fn compute_actor_loss(
    input: &ActorLossInput<'_>,
    cfg: &ActorLossConfig,
) -> Result<ActorLossOutput> {
    let name = "actor_loss";
    let resolved = cfg.policy.resolve()?;
    let opts = AggOptions {
        norm_constant: resolved.loss_scale_factor,
        denominators: input.policy.denominators,
    };
    let mask = input.policy.loss_mask;

    let pg = compute_policy_loss(&input.policy, &cfg.policy)?;
    let mut loss = pg.loss.clone();

    // Entropy bonus: loss −= entropy_coeff · agg(H, mask).
    let entropy_token_mean = match input.entropy {
        Some(h) => Some(super::masked_mean_rows(
            &super::finite_rows(name, "entropy", h, None)?,
            &super::finite_rows(name, "loss_mask", mask, None)?,
        )),
        None => None,
    };
    let entropy = match input.entropy {
        Some(h) => {
            let bonus = entropy_bonus(h, mask, resolved.agg_mode, &opts)?;
            let value = finite_scalar("entropy_bonus", "entropy", &bonus)?;
            if cfg.entropy_coeff != 0.0 {
                loss = loss.sub(
                    &bonus
                        .affine(cfg.entropy_coeff, 0.0)?
                        .to_dtype(loss.dtype())?,
                )?;
            }
            Some(value)
        }
        None if cfg.entropy_coeff != 0.0 => {
            return Err(LossError::MissingInput {
                loss: name.to_string(),
                input: "entropy".to_string(),
                why: format!(
                    "entropy_coeff = {} needs per-token entropy",
                    cfg.entropy_coeff
                ),
            });
        }
        None => None,
    };

    // KL in the loss: loss += kl_loss_coef · agg(k(logp, ref), mask).
    let kl = if cfg.use_kl_loss {
        let ref_logp = input.ref_logp.ok_or_else(|| LossError::MissingInput {
            loss: name.to_string(),
            input: "ref_logp".to_string(),
            why: "use_kl_loss needs reference log-probs".to_string(),
        })?;
        let kl = kl_loss(
            input.policy.logp,
            ref_logp,
            mask,
            cfg.kl_loss_type,
            resolved.agg_mode,
            &opts,
        )?;
        let value = finite_scalar("kl_loss", "loss", &kl)?;
        loss = loss.add(&kl.affine(cfg.kl_loss_coef, 0.0)?)?;
        Some(value)
    } else {
        None
    };

    let total_loss = finite_scalar(name, "loss", &loss)?;
    Ok(ActorLossOutput {
        loss,
        clipped: pg.clipped,
        metrics: ActorLossMetrics {
            policy: pg.metrics,
            kl_loss: kl,
            kl_coef: cfg.kl_loss_coef,
            entropy,
            entropy_token_mean,
            total_loss,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::test_util::{scalar, t2};

    #[test]
    fn total_is_pg_minus_entropy_plus_kl() {
        let lp = t2(&[&[-1.0, -1.0]]);
        let old = lp.clone();
        let adv = t2(&[&[1.0, 1.0]]);
        let m = t2(&[&[1.0, 1.0]]);
        let rf = t2(&[&[-1.5, -1.5]]);
        let h = t2(&[&[2.0, 4.0]]);
        let cfg = ActorLossConfig {
            use_kl_loss: true,
            kl_loss_coef: 0.1,
            kl_loss_type: "kl".parse().unwrap(),
            entropy_coeff: 0.01,
            ..ActorLossConfig::default()
        };
        let input = ActorLossInput {
            policy: PolicyLossInput::new(&lp, &old, &adv, &m),
            ref_logp: Some(&rf),
            entropy: Some(&h),
        };
        let o = compute_actor_loss(&input, &cfg).unwrap();
        // pg = −1 (w ≡ 1), entropy 3, k1 0.5.
        assert!((scalar(&o.loss) - (-1.0 - 0.01 * 3.0 + 0.1 * 0.5)).abs() < 1e-12);
        assert_eq!(o.metrics.kl_loss, Some(0.5));
        assert_eq!(o.metrics.entropy, Some(3.0));
        let map = o.metrics.to_map();
        assert!(map.contains_key("actor/kl_loss") && map.contains_key("actor/entropy"));
        assert!(map.contains_key("actor/entropy_agg"));

        let no_ref = ActorLossInput {
            ref_logp: None,
            ..input
        };
        let err = compute_actor_loss(&no_ref, &cfg).unwrap_err();
        assert!(err.to_string().contains("ref_logp"));
        let parsed: ActorLossConfig =
            serde_json::from_str(r#"{"policy":{"policy_loss":"gspo_turn"},"use_kl_loss":true,"kl_loss_type":"low_var_kl"}"#).unwrap();
        assert_eq!(parsed.policy.policy_loss, "gspo_turn");
        assert!(serde_json::from_str::<ActorLossConfig>(r#"{"entropy_coef":0.1}"#).is_err());
    }

    /// `actor/entropy` is the mean per loss-mask token whatever the aggregation (review defect
    /// 22: dr-grpo's seq-mean-token-sum-norm and token-mean logged values an order of magnitude
    /// apart on identical rollouts); `actor/entropy_agg` keeps the aggregated value.
    #[test]
    fn entropy_is_the_token_mean_whatever_the_aggregation() {
        let lp = t2(&[&[-1.0, -1.0, -1.0], &[-1.0, -1.0, -1.0]]);
        let adv = t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 1.0]]);
        let m = t2(&[&[1.0, 1.0, 0.0], &[1.0, 0.0, 0.0]]);
        let h = t2(&[&[2.0, 4.0, 9.0], &[6.0, 9.0, 9.0]]);
        for (mode, agg) in [("token-mean", 4.0), ("seq-mean-token-sum", 6.0)] {
            let mut cfg = ActorLossConfig::default();
            cfg.policy.loss_agg_mode = Some(mode.parse().unwrap());
            let input = ActorLossInput {
                policy: PolicyLossInput::new(&lp, &lp, &adv, &m),
                ref_logp: None,
                entropy: Some(&h),
            };
            let map = compute_actor_loss(&input, &cfg).unwrap().metrics.to_map();
            // (2 + 4 + 6) / 3 masked tokens; the masked 9s never count.
            assert!(
                (map["actor/entropy"] - 4.0).abs() < 1e-12,
                "{mode}: {map:?}"
            );
            assert!(
                (map["actor/entropy_agg"] - agg).abs() < 1e-12,
                "{mode}: {map:?}"
            );
        }
    }
}
