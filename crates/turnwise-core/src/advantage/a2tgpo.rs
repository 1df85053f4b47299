//! §3.5 A2TGPO advantage (a2tgpo.md §4, eq. 6–9) and §5.5 adaptive clip scale (eq. 10–12).
//!
//! 1. Turn groups `G_{q,t}`: the IG of process turn `t` of every rollout of the prompt that
//!    reaches it (`T_i > t`, 1-based; here 0-based `t < T_i − 1`).
//! 2. `îg = (ig − mean) / (std_p + ε)` when the group has ≥ 2 members, else 0 (eq. 7, 21).
//! 3. `D_{i,t} = Σ_{k≥t} γ^{k−t} îg_{i,k}`, `n_{i,t} = T_i − t` (1-based), process turns get
//!    `Â = D / √n + R̂_i`, the final turn `Â = R̂_i` (eq. 8–9); `R̂` = GRPO of the outcome
//!    (`std_u + 1e-6`, singleton raw, \[REC\]).
//! 4. Clip scale `c = 1 + β (2σ(îg) − 1)`, `c = 1` on the final turn (eq. 10).

use serde::{Deserialize, Serialize};

use super::channel::{Channel, Channels};
use crate::range::Range;

use super::contract::{self, MetricDoc, Metrics, Needs};
use super::error::settings_result;
use super::input::{check_len, validate_common};
use super::kernels::{
    GroupNorm, Singleton, StdKind, discounted_suffix_sums, mean, normalize_by_key, sigmoid,
};
use super::output::broadcast_turns;
use super::{AdvantageBatch, AdvantageError, AdvantageOutput, Estimator, RolloutAdvantage};

/// Settings of `a2tgpo`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct A2tgpoConfig {
    /// Discount γ of the IG accumulation (1.0 in the paper's experiments).
    pub gamma: f64,
    /// ε added to `std_p` of a turn group (\[UNVERIFIED/REC\] 1e-6).
    pub ig_epsilon: f64,
    /// Std kind of the turn-group normalization (eq. 21: population).
    pub ig_std: StdKind,
    /// Std kind of the outcome GRPO term `R̂` (\[REC\] unbiased, VERL).
    pub outcome_std: StdKind,
    /// ε of the outcome GRPO term (\[REC\] 1e-6).
    pub outcome_epsilon: f64,
    /// Divide the accumulated IG by `√n_{i,t}` (eq. 9, variance rescaling).
    pub variance_rescaling: bool,
    /// β of the adaptive clip scale (0.3).
    pub clip_beta: f64,
}

impl Default for A2tgpoConfig {
    fn default() -> Self {
        Self {
            gamma: 1.0,
            ig_epsilon: 1e-6,
            ig_std: StdKind::Population,
            outcome_std: StdKind::Unbiased,
            outcome_epsilon: 1e-6,
            variance_rescaling: true,
            clip_beta: 0.3,
        }
    }
}

/// §5.5 eq. 10: `c = 1 + β (2σ(îg) − 1)`, in `(1 − β, 1 + β)`.
pub fn a2tgpo_clip_scale(normalized_ig: f64, beta: f64) -> f64 {
    1.0 + beta * (2.0 * sigmoid(normalized_ig) - 1.0)
}

/// Normalization of one turn group (eq. 7): `(x − mean) / (std + ε)` for ≥ 2 members, 0 for one.
pub fn turn_group_normalize(ig: &[f64], std: StdKind, epsilon: f64) -> Vec<f64> {
    GroupNorm {
        std: Some(std),
        epsilon,
        singleton: Singleton::Zero,
    }
    .apply(ig)
}

/// Per-turn A2TGPO advantages of one rollout from its normalized IG (`T_i − 1` entries) and its
/// outcome term `R̂_i` (eq. 8–9); `T_i` entries.
pub fn a2tgpo_turn_advantages(
    normalized_ig: &[f64],
    outcome_adv: f64,
    gamma: f64,
    variance_rescaling: bool,
) -> Vec<f64> {
    let d = discounted_suffix_sums(normalized_ig, gamma);
    let p = normalized_ig.len();
    let mut out: Vec<f64> = d
        .iter()
        .enumerate()
        .map(|(t, &dt)| {
            let scale = if variance_rescaling {
                ((p - t) as f64).sqrt()
            } else {
                1.0
            };
            dt / scale + outcome_adv
        })
        .collect();
    out.push(outcome_adv);
    out
}

impl Estimator for A2tgpoConfig {
    fn name(&self) -> &'static str {
        "a2tgpo"
    }

    fn validate(&self) -> Result<(), AdvantageError> {
        let mut p = Vec::new();
        Range::UnitInterval.check(&mut p, "gamma", self.gamma);
        Range::StdEpsilon.check(&mut p, "ig_epsilon", self.ig_epsilon);
        Range::StdEpsilon.check(&mut p, "outcome_epsilon", self.outcome_epsilon);
        Range::NonNegative.check(&mut p, "clip_beta", self.clip_beta);
        settings_result("a2tgpo", p)
    }

    fn needs(&self) -> Needs {
        Needs {
            info_gain: true,
            ..Needs::default()
        }
    }

    fn emits(&self) -> &'static [Channel] {
        &[Channel::NormalizedInfoGain, Channel::ClipScale]
    }

    /// Its turn groups `G_{q,t}` (rollouts of prompt q with `T_i > t`, spec §3.5), the range
    /// of its clip scales and the information gain per turn.
    fn metrics(&self, batch: &AdvantageBatch, out: &AdvantageOutput) -> Metrics {
        let rs = &batch.rollouts;
        let mut m = contract::info_gain_per_turn(rs);
        m.extend(contract::group_stats(
            "a2tgpo/turn_group",
            rs.iter()
                .flat_map(|r| (0..r.num_turns.saturating_sub(1)).map(move |t| (r.group, t))),
        ));
        let scales: Vec<f64> = out
            .rollouts
            .iter()
            .filter_map(|o| o.channels.get(&Channel::ClipScale))
            .flatten()
            .copied()
            .collect();
        if !scales.is_empty() {
            m.insert(
                "a2tgpo/clip_scale/min".into(),
                scales.iter().copied().fold(f64::INFINITY, f64::min),
            );
            m.insert(
                "a2tgpo/clip_scale/max".into(),
                scales.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            );
            m.insert("a2tgpo/clip_scale/mean".into(), mean(&scales));
        }
        m
    }

    fn metric_docs(&self) -> &'static [MetricDoc] {
        const DOCS: [MetricDoc; 6] = [
            MetricDoc {
                key: "a2tgpo/clip_scale/min",
                label: "A2TGPO clip scale, min",
            },
            MetricDoc {
                key: "a2tgpo/clip_scale/max",
                label: "A2TGPO clip scale, max",
            },
            MetricDoc {
                key: "a2tgpo/turn_group/group_size/mean",
                label: "A2TGPO turn-group size",
            },
            MetricDoc {
                key: "a2tgpo/turn_group/singleton_share",
                label: "A2TGPO singleton turns",
            },
            contract::INFO_GAIN_DOCS[0],
            contract::INFO_GAIN_DOCS[1],
        ];
        &DOCS
    }

    fn estimate(&self, batch: &AdvantageBatch) -> Result<AdvantageOutput, AdvantageError> {
        let name = self.name();
        validate_common(name, batch)?;
        for (i, r) in batch.rollouts.iter().enumerate() {
            if r.num_turns == 0 {
                return Err(AdvantageError::InvalidRollout {
                    estimator: name,
                    rollout: i,
                    message: "has no agent turn".to_string(),
                });
            }
            check_len(name, i, "info_gain", r.info_gain.len(), r.num_turns - 1)?;
        }
        // R̂: per-prompt GRPO of the outcome.
        let groups: Vec<usize> = batch.rollouts.iter().map(|r| r.group).collect();
        let outcomes: Vec<f64> = batch.rollouts.iter().map(|r| r.outcome).collect();
        let out_norm = GroupNorm::grpo(self.outcome_std, self.outcome_epsilon);
        let r_hat = normalize_by_key(&outcomes, &groups, |s| out_norm.apply(s));
        // îg: turn groups keyed by (prompt, process turn).
        let mut ig = Vec::new();
        let mut keys = Vec::new();
        for r in &batch.rollouts {
            for (t, &v) in r.info_gain.iter().enumerate() {
                ig.push(v);
                keys.push((r.group, t));
            }
        }
        let ig_hat = normalize_by_key(&ig, &keys, |s| {
            turn_group_normalize(s, self.ig_std, self.ig_epsilon)
        });
        let mut pos = 0;
        let rollouts = batch
            .rollouts
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let p = r.info_gain.len();
                let nig = ig_hat[pos..pos + p].to_vec();
                pos += p;
                let turns =
                    a2tgpo_turn_advantages(&nig, r_hat[i], self.gamma, self.variance_rescaling);
                let mut clip: Vec<f64> = nig
                    .iter()
                    .map(|&g| a2tgpo_clip_scale(g, self.clip_beta))
                    .collect();
                clip.push(1.0);
                RolloutAdvantage {
                    tokens: broadcast_turns(&r.turn_id, &turns, 0.0),
                    turns,
                    returns: None,
                    channels: Channels::from([
                        (Channel::NormalizedInfoGain, nig),
                        (Channel::ClipScale, clip),
                    ]),
                }
            })
            .collect();
        Ok(AdvantageOutput {
            estimator: name.to_string(),
            rollouts,
            trees: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::advantage::Rollout;
    use crate::advantage::igpo::tests::a2tgpo_example;
    use crate::test_util::{TOL, assert_all_close, assert_close};

    #[test]
    fn spec_3_5_worked_example() {
        let out = A2tgpoConfig::default().estimate(&a2tgpo_example()).unwrap();
        let r_hat = [0.783349, -0.261116, 0.783349, -1.305581];
        let ig_hat: [&[f64]; 4] = [
            &[0.980569, 0.999992],
            &[-1.372797],
            &[0.392228, -0.999992, 0.0],
            &[],
        ];
        let adv: [&[f64]; 4] = [
            &[2.183817, 1.783341, 0.783349],
            &[-1.633913, -0.261116],
            &[0.432456, 0.076248, 0.783349, 0.783349],
            &[-1.305581],
        ];
        for i in 0..4 {
            let r = &out.rollouts[i];
            assert_close(*r.turns.last().unwrap(), r_hat[i], TOL, &format!("R̂[{i}]"));
            assert_all_close(
                &r.channels[&Channel::NormalizedInfoGain],
                ig_hat[i],
                TOL,
                &format!("îg[{i}]"),
            );
            assert_all_close(&r.turns, adv[i], TOL, &format!("Â[{i}]"));
        }
    }

    #[test]
    fn spec_5_5_clip_scale_in_example() {
        let out = A2tgpoConfig::default().estimate(&a2tgpo_example()).unwrap();
        let c: [&[f64]; 4] = [
            &[1.136333, 1.138634, 1.0],
            &[0.821301, 1.0],
            &[1.058091, 0.861366, 1.0, 1.0],
            &[1.0],
        ];
        for (i, (r, c)) in out.rollouts.iter().zip(c).enumerate() {
            assert_all_close(&r.channels[&Channel::ClipScale], c, TOL, &format!("c[{i}]"));
        }
    }

    #[test]
    fn spec_5_5_clip_scale_and_bounds() {
        for (g, c, lo, hi) in [
            (-2.0, 0.771522, 0.997685, 1.003086),
            (0.0, 1.0, 0.997, 1.004),
            (2.0, 1.228478, 0.996315, 1.004914),
        ] {
            let got = a2tgpo_clip_scale(g, 0.3);
            assert_close(got, c, TOL, &format!("c({g})"));
            assert_close(1.0 - got * 3e-3, lo, TOL, &format!("lower({g})"));
            assert_close(1.0 + got * 4e-3, hi, TOL, &format!("upper({g})"));
        }
    }

    #[test]
    fn tokens_follow_turns() {
        let batch = AdvantageBatch::new(vec![
            Rollout::new(0, vec![0, -1, 1], 1.0).with_info_gain(vec![0.2]),
            Rollout::new(0, vec![0, -1, 1], 0.0).with_info_gain(vec![0.1]),
        ]);
        let out = A2tgpoConfig::default().estimate(&batch).unwrap();
        let r = &out.rollouts[0];
        assert_all_close(&r.tokens, &[r.turns[0], 0.0, r.turns[1]], 1e-12, "tokens");
    }
}
