//! Every policy loss of multi-turn agentic RL on candle tensors (spec §5, §7).
//!
//! The losses follow the verl `core_algos` layout: a mini-batch of per-token tensors goes in
//! (`logp` [B, L] differentiable, `old_logp`, `advantages`, `loss_mask`, optionally `turn_id`,
//! the per-token channels the estimator emitted, such as A2TGPO's clip scales, reference
//! log-probs, critic values), a scalar differentiable loss tensor plus a struct of plain-number
//! metrics comes out. Policy losses are one registry table ([`LOSSES`], one row per loss with
//! every property the shared body reads) run through one signature ([`compute_policy_loss`],
//! [`PolicyLossKind::compute`]; names in [`POLICY_LOSS_NAMES`]).
//!
//! Module map (section numbers refer to `docs/algorithms.md` (in the repository root)):
//!
//! - [`agg`]: the four `loss_agg_mode`s (§5.7).
//! - [`policy`]: token PPO clip + dual clip (§5.1), decoupled clip (§5.2), GSPO (§5.3), turn ratios
//!   (§5.4), A2TGPO adaptive bounds (§5.5), the registry and its config.
//! - [`turns`]: turn delimitation (§1.2: explicit `turn_id`, mask-run fallback) and the
//!   `turn_kl_entropy` diagnostic (§7).
//! - [`clip_bias`]: the S-PPO / ST-PPO / S-GRPO clipping-bias correction (§5.6).
//! - [`kl`]: KL estimators k1/k2/k3/abs and their straight-through forms, KL in the loss and KL in
//!   the reward with fixed and adaptive controllers (§5.8).
//! - [`entropy`]: entropy from full logits and the entropy bonus (§5.9).
//! - [`value`]: the clipped critic loss and explained variance (§5.10, §7).
//! - [`actor`]: the full actor objective `pg − entropy bonus + KL` (§5.8, §5.9).
//!
//! Every entry point checks its inputs and its result for NaN/inf and returns
//! [`LossError::NonFinite`] naming the loss and the tensor, so the trainer never trains on (or
//! dies silently from) a poisoned batch.

pub mod actor;
pub mod agg;
pub mod clip_bias;
pub mod entropy;
pub mod kl;
pub mod policy;
pub mod turns;
pub mod value;

#[cfg(test)]
mod proptests;
#[cfg(test)]
pub(crate) mod test_util;

pub use actor::{
    ActorLossConfig, ActorLossInput, ActorLossMetrics, ActorLossOutput, compute_actor_loss,
};
pub use agg::{AggDenominators, AggOptions, LossAggMode, agg_loss};
pub use clip_bias::{
    ClipBiasConfig, ClipBiasRatio, ClipBiasResult, ClipBiasRule, ClipBiasScope, ClipBiasSpace,
    clip_bias_grad_norm,
};
pub use entropy::{entropy_bonus, entropy_from_logits};
pub use kl::{
    AdaptiveKlController, FixedKlController, KlController, KlControllerConfig, KlControllerKind,
    KlEstimator, KlPenalty, apply_kl_in_reward, kl_loss, kl_penalty,
};
pub use policy::{
    LOSSES, LossSpec, POLICY_LOSS_NAMES, PolicyLossConfig, PolicyLossInput, PolicyLossKind,
    PolicyLossMetrics, PolicyLossOutput, RatioForm, ResolvedPolicyLoss, compute_policy_loss,
};
pub use turns::{Turn, TurnRule, TurnSegments, turn_kl_entropy};
pub use value::{
    ValueLossConfig, ValueLossMetrics, ValueLossOutput, explained_variance, value_loss,
};

use candle_core::{DType, Tensor};

/// Errors of the loss module.
#[derive(Debug, thiserror::Error)]
pub enum LossError {
    /// A policy-loss name that is not in the registry.
    #[error("unknown policy loss {name:?}; known policy losses: {known}")]
    UnknownPolicyLoss {
        /// The name that was asked for.
        name: String,
        /// Comma-separated registry names.
        known: String,
    },
    /// A KL-penalty name that is not known (§5.8).
    #[error(
        "unknown KL penalty {0:?}; known: kl, k1, abs, mse, k2, low_var_kl, k3 (each optionally with a '+' suffix)"
    )]
    UnknownKlPenalty(String),
    /// A `loss_agg_mode` name that is not known (§5.7).
    #[error(
        "unknown loss_agg_mode {0:?}; known: token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm"
    )]
    UnknownAggMode(String),
    /// An input tensor or the resulting loss contains NaN or ±inf.
    #[error(
        "{loss}: tensor `{tensor}` contains {count} non-finite value(s) (NaN or inf) out of {total}"
    )]
    NonFinite {
        /// The loss being computed.
        loss: String,
        /// The offending tensor (an input name, or `loss` for the result).
        tensor: String,
        /// Number of non-finite entries.
        count: usize,
        /// Number of entries.
        total: usize,
    },
    /// An input tensor has the wrong shape.
    #[error("{loss}: tensor `{tensor}` has shape {got:?}, expected {expected}")]
    Shape {
        /// The loss being computed.
        loss: String,
        /// The offending tensor.
        tensor: String,
        /// Its shape.
        got: Vec<usize>,
        /// What was expected, in words.
        expected: String,
    },
    /// A required optional input was not given.
    #[error("{loss}: missing input `{input}` ({why})")]
    MissingInput {
        /// The loss being computed.
        loss: String,
        /// The missing input.
        input: String,
        /// Why it is needed.
        why: String,
    },
    /// Inputs are inconsistent in a way a shape check cannot see.
    #[error("{loss}: invalid input: {msg}")]
    InvalidInput {
        /// The loss being computed.
        loss: String,
        /// What is wrong.
        msg: String,
    },
    /// A configuration value is out of range.
    #[error("invalid loss config: {0}")]
    InvalidConfig(String),
    /// Settings out of their ranges ([`ActorLossConfig::validate`]), every one of them, each
    /// under its field's name relative to `[actor]` (`policy.clip_ratio`).
    #[error("invalid loss config: {0}")]
    InvalidSettings(turnwise_core::range::RangeErrors),
    /// An error from candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Result alias of the loss module.
pub type Result<T> = std::result::Result<T, LossError>;

/// Reads a 2-D tensor as f64 rows, checking its shape (`expected = Some((B, L))`) and that every
/// entry is finite.
pub(crate) fn finite_rows(
    loss: &str,
    name: &str,
    t: &Tensor,
    expected: Option<(usize, usize)>,
) -> Result<Vec<Vec<f64>>> {
    let dims = t.dims().to_vec();
    let ok = match expected {
        Some((b, l)) => dims == [b, l],
        None => dims.len() == 2,
    };
    if !ok {
        return Err(LossError::Shape {
            loss: loss.to_string(),
            tensor: name.to_string(),
            got: dims,
            expected: match expected {
                Some((b, l)) => format!("[{b}, {l}]"),
                None => "a 2-D tensor [B, L]".to_string(),
            },
        });
    }
    let rows = t.to_dtype(DType::F64)?.to_vec2::<f64>()?;
    check_finite_values(loss, name, rows.iter().flatten().copied())?;
    Ok(rows)
}

/// Fails with [`LossError::NonFinite`] if any value is NaN or ±inf.
pub(crate) fn check_finite_values(
    loss: &str,
    name: &str,
    values: impl Iterator<Item = f64>,
) -> Result<()> {
    let (mut count, mut total) = (0usize, 0usize);
    for v in values {
        total += 1;
        if !v.is_finite() {
            count += 1;
        }
    }
    if count > 0 {
        return Err(LossError::NonFinite {
            loss: loss.to_string(),
            tensor: name.to_string(),
            count,
            total,
        });
    }
    Ok(())
}

/// Reads a scalar (0-d or one-element) loss tensor and checks that it is finite.
pub(crate) fn finite_scalar(loss: &str, name: &str, t: &Tensor) -> Result<f64> {
    let v = t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    check_finite_values(loss, name, v.iter().copied())?;
    Ok(v.iter().sum())
}

/// Masked mean of `x` over `mask` rows (0 when the mask is empty), for diagnostics (§7).
pub(crate) fn masked_mean_rows(x: &[Vec<f64>], mask: &[Vec<f64>]) -> f64 {
    let (mut num, mut den) = (0.0, 0.0);
    for (xr, mr) in x.iter().zip(mask) {
        for (v, m) in xr.iter().zip(mr) {
            num += v * m;
            den += m;
        }
    }
    if den > 0.0 { num / den } else { 0.0 }
}
