//! The update stage: `[optim]`, `[critic]` and `[algorithm]` and the checks of these sections,
//! and the checks of `[advantage]` and `[actor]` (whose types live in `turnwise-core` and
//! `turnwise-model` and check their own ranges), under their dotted keys.

use serde::{Deserialize, Serialize};

use super::numbers::{check, non_negative, positive, unit, unit_open};
use turnwise_core::advantage::{AdvantageError, Estimator};
use turnwise_core::range::{Range, RangeErrors};
use turnwise_model::loss::LossError;

use super::{ConfigError, TrainConfig};

/// Optimizer and PPO-epoch settings of the RL phase.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimConfig {
    /// Peak learning rate: reached after `warmup_steps`, then held or decayed as
    /// `lr_schedule` says. Range: > 0.
    pub lr: f64,
    /// Warm-up RL steps: the rate rises linearly from `lr / warmup_steps` to `lr` (verl
    /// `actor.optim.lr_warmup_steps`).
    pub warmup_steps: u64,
    /// The rate after warm-up, per RL step (verl `actor.optim.warmup_style` /
    /// `lr_scheduler_type`, TRL `lr_scheduler_type`): `constant` (default), `linear` or
    /// `cosine` from `lr` down to `lr × min_lr_ratio` at the last step (`run.steps`).
    pub lr_schedule: turnwise_model::optim::DecayShape,
    /// Floor of a `linear` or `cosine` decay as a fraction of `lr` (verl `min_lr_ratio`), in
    /// [0, 1].
    pub min_lr_ratio: f64,
    /// AdamW β1, in [0, 1).
    pub beta1: f64,
    /// AdamW β2, in [0, 1).
    pub beta2: f64,
    /// Decoupled weight decay. Range: ≥ 0.
    pub weight_decay: f64,
    /// Global gradient-norm bound.
    pub grad_clip: f64,
    /// Passes over each rollout batch. Range: ≥ 1.
    pub ppo_epochs: usize,
    /// Rollouts per optimizer step (0: the whole batch).
    pub mini_batch_size: usize,
    /// Rollouts per forward/backward (gradient accumulation within a mini-batch; 0: the
    /// mini-batch).
    pub micro_batch_size: usize,
    /// Consecutive non-finite updates that stop the run. Range: ≥ 1.
    pub max_bad_updates: usize,
    /// What one training row is, and so what `mini_batch_size` and `micro_batch_size` count:
    /// `trajectory` (default: the prompt and the whole response) or `step` (verl-agent's: every
    /// environment step is its own row, the context its turn was sampled from, memory window
    /// included, plus that turn's tokens).
    pub samples: TrainSamples,
    /// Where the behaviour (old) log-probs of an update that needs them (several mini-batches
    /// or epochs, or KL in the reward) come from: `recompute` (default: one no-grad pass of the
    /// trainer over the batch with the rollout weights, verl's `compute_log_prob`) or `rollout`
    /// (the log-probs the rollout recorded while sampling, skipping that pass, as verl's
    /// rollout-correction bypass mode does). The local engine records what the trainer
    /// computes, to rounding (`rollout/logprob_mismatch/*`, which a `rollout` update does not
    /// log); with an inference server the importance ratios then carry its mismatch.
    pub old_logprobs: OldLogprobs,
    /// Truncated importance sampling over the sampler–trainer mismatch (Yao et al., 2025;
    /// verl's `algorithm.rollout_is_threshold` at token level): when positive, each trained
    /// token's loss is multiplied by the constant `min(π_old(y_t) / π_sampler(y_t), C)`, the
    /// trainer's behaviour probability (recomputed, `old_logprobs = "recompute"`) over the one the
    /// engine recorded while sampling, capped at this `C` (2 in the paper). For an inference
    /// server whose numerics differ from the trainer's; the local engine records what the
    /// trainer computes, so there the weights are 1 to rounding. Logged as
    /// `actor/tis_weight_mean` and `actor/tis_capped_frac`. 0 (default): off. Range: ≥ 0.
    pub rollout_is_cap: f64,
    /// Compute the prefixes that rows share once (default on): in the actor's update and the
    /// behaviour and reference log-prob passes, rows whose first tokens are the same (at least
    /// 8: the G rollouts of a prompt, a tree's branches, one trajectory's step samples, a
    /// prompt template) run those tokens forward and backward once, and their gradients on
    /// them are summed in that one pass. Exact to rounding; off only to measure what it saves.
    /// The mini-batches are then cut into micro-batches and shards in token order, so that rows
    /// sharing a prefix meet (on a CPU, one shard per core: a mini-batch of two rows on two
    /// cores runs one row per core and shares nothing). Logged as `actor/shared_prefix_tokens`
    /// (tokens per mini-batch run once instead of once per row) and `actor/shared_prefix_frac`
    /// (their share of the mini-batch's tokens). The warm start and the information-gain
    /// probes always share.
    pub share_prefix: bool,
}

/// Where an update's behaviour log-probs come from (`optim.old_logprobs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OldLogprobs {
    /// The trainer recomputes them with the rollout weights.
    #[default]
    Recompute,
    /// The log-probs the rollout recorded while sampling.
    Rollout,
}

/// What one training row is (`optim.samples`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrainSamples {
    /// One row per trajectory: the prompt, then every turn and observation (TITO).
    #[default]
    Trajectory,
    /// One row per environment step (verl-agent): the prompt plus the turns and observations the
    /// step's context held (the last `rollout.memory_window` turns, or all), then the step's own
    /// turn. Behaviour log-probs are those of exactly the context that was sampled from.
    Step,
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            lr: 2e-4,
            warmup_steps: 0,
            lr_schedule: turnwise_model::optim::DecayShape::Constant,
            min_lr_ratio: 0.0,
            beta1: 0.9,
            beta2: 0.95,
            weight_decay: 0.0,
            grad_clip: 1.0,
            ppo_epochs: 1,
            mini_batch_size: 0,
            micro_batch_size: 0,
            max_bad_updates: 3,
            samples: TrainSamples::Trajectory,
            old_logprobs: OldLogprobs::Recompute,
            rollout_is_cap: 0.0,
            share_prefix: true,
        }
    }
}

/// The PPO critic. It trains on the same batch as the actor, `optim.ppo_epochs` passes over it
/// in shuffled mini-batches of `optim.mini_batch_size` rollouts (the order drawn from the
/// trainer's generator), with the clipped value loss of spec §5.10.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CriticConfig {
    /// Train a critic (needed by `gae`).
    pub enabled: bool,
    /// Critic learning rate. Range: > 0.
    pub lr: f64,
    /// Value clip range (verl `cliprange_value`). Range: > 0.
    pub cliprange_value: f64,
    /// Critic warm-up updates before the actor trains.
    pub warmup_updates: u64,
    /// Decoupled weight decay of the critic's AdamW (its β1, β2 are `optim.beta1`,
    /// `optim.beta2`; verl `critic.optim.weight_decay`). Default 0, like `optim.weight_decay`.
    pub weight_decay: f64,
}

impl Default for CriticConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            lr: 1e-3,
            cliprange_value: 0.5,
            warmup_updates: 0,
            weight_decay: 0.0,
        }
    }
}

/// verl's `algorithm` keys beyond the estimator: KL in the reward (spec §5.8).
///
/// With `use_kl_in_reward` the trainer computes, for every trained rollout, the behaviour
/// log-probs (the rollout weights) and the frozen reference model's log-probs of the response
/// tokens, and subtracts `β · k(old, ref)` from each loss token's reward before the advantage
/// estimator (verl `apply_kl_penalty`): for `gae` from the token rewards (turn rewards and
/// outcome placed at their tokens, spec §3.3); for the outcome estimators `grpo`, `dr_grpo`
/// and `rloo` from the outcome score, summed over the rollout's tokens (verl's GRPO scores the
/// sum of the token-level rewards). Other estimators reject it (use `actor.use_kl_loss`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AlgorithmConfig {
    /// Subtract the KL penalty from the rewards (verl `algorithm.use_kl_in_reward`, default
    /// false).
    pub use_kl_in_reward: bool,
    /// Estimator of the per-token KL (verl `algorithm.kl_penalty`, default `kl` = k1 =
    /// `old_logp − ref_logp`; `abs`, `mse`, `low_var_kl` as in spec §5.8; a `+` suffix is
    /// accepted and ignored here, since a reward carries no gradient).
    pub kl_penalty: turnwise_model::loss::KlPenalty,
    /// The coefficient β and its controller (verl `algorithm.kl_ctrl`: `type = "fixed" |
    /// "adaptive"`, `kl_coef` (0.001), `target_kl` (0.1), `horizon` (10000 rollouts)). The
    /// adaptive controller's β is part of the checkpoint.
    pub kl_ctrl: turnwise_model::loss::kl::KlControllerConfig,
}

impl Default for AlgorithmConfig {
    fn default() -> Self {
        Self {
            use_kl_in_reward: false,
            kl_penalty: turnwise_model::loss::KlPenalty::new(turnwise_model::loss::KlEstimator::K1),
            kl_ctrl: turnwise_model::loss::kl::KlControllerConfig::default(),
        }
    }
}

/// The keys whose numbers may be infinite (`optim.grad_clip = inf`: no clipping); every other
/// number of a config must be finite ([`super::numbers::validate`]).
pub(super) const MAY_BE_INFINITE: &[&str] = &["optim.grad_clip"];

/// The range of each number of the KL controller's settings, by key (its type lives in
/// `turnwise-model`). [`super::numbers::validate`] checks them together with every other number
/// of the config. The estimators' and losses' settings check their own ranges
/// ([`TrainConfig::validate_parts`]).
pub(super) const NUMBER_RANGES: &[(&str, Range)] = &[
    ("algorithm.kl_ctrl.horizon", Range::NonNegative),
    ("algorithm.kl_ctrl.kl_coef", Range::NonNegative),
    ("algorithm.kl_ctrl.target_kl", Range::NonNegative),
];

impl OptimConfig {
    /// Checks the AdamW settings and `max_bad_updates`.
    pub(super) fn validate_ranges(&self) -> Result<(), ConfigError> {
        check(
            unit_open(self.beta1),
            "optim.beta1",
            "in [0, 1)",
            self.beta1,
        )?;
        check(
            unit_open(self.beta2),
            "optim.beta2",
            "in [0, 1)",
            self.beta2,
        )?;
        check(
            non_negative(self.weight_decay),
            "optim.weight_decay",
            "a non-negative number",
            self.weight_decay,
        )?;
        check(
            self.max_bad_updates >= 1,
            "optim.max_bad_updates",
            "at least 1",
            self.max_bad_updates as f64,
        )
    }

    /// Checks `min_lr_ratio`, the floor of the learning-rate decay.
    pub(super) fn validate_min_lr_ratio(&self) -> Result<(), ConfigError> {
        check(
            unit(self.min_lr_ratio),
            "optim.min_lr_ratio",
            "in [0, 1] (the decay's floor as a fraction of optim.lr)",
            self.min_lr_ratio,
        )
    }

    /// Checks the learning rate, the epochs and the gradient clip.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return bad("optim.lr", format!("must be positive, got {}", self.lr));
        }
        if self.ppo_epochs == 0 {
            return bad("optim.ppo_epochs", "must be at least 1".into());
        }
        if self.grad_clip.is_nan() || self.grad_clip <= 0.0 {
            return bad(
                "optim.grad_clip",
                format!("must be positive, got {}", self.grad_clip),
            );
        }
        check(
            non_negative(self.rollout_is_cap),
            "optim.rollout_is_cap",
            "a non-negative number (0: off)",
            self.rollout_is_cap,
        )?;
        if self.rollout_is_cap > 0.0 && self.old_logprobs == OldLogprobs::Rollout {
            return bad(
                "optim.rollout_is_cap",
                "truncated importance sampling weighs the trainer's recomputed behaviour \
                 log-probs against the sampler's, but optim.old_logprobs = \"rollout\" takes \
                 the sampler's as the behaviour log-probs, so every weight would be 1: set \
                 optim.old_logprobs = \"recompute\" or optim.rollout_is_cap = 0"
                    .into(),
            );
        }
        Ok(())
    }
}

impl CriticConfig {
    /// Checks the critic's learning rate, value clip and weight decay (whether or not it is on).
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        check(positive(self.lr), "critic.lr", "a positive number", self.lr)?;
        check(
            positive(self.cliprange_value),
            "critic.cliprange_value",
            "a positive number",
            self.cliprange_value,
        )?;
        check(
            non_negative(self.weight_decay),
            "critic.weight_decay",
            "a non-negative number",
            self.weight_decay,
        )
    }
}

impl TrainConfig {
    /// The number of optimizer steps one rollout batch of the nominal size
    /// (`rollout.prompts_per_step × rollout.group_size` rows) makes, and how many of them are
    /// off-policy: `(steps, off_policy_steps)`. With step samples (`optim.samples = "step"`)
    /// this is the least it makes: every rollout has at least one step, and a batch of K̂ steps
    /// per rollout makes about K̂ times as many.
    pub fn update_structure(&self) -> (usize, usize) {
        let rows = (self.rollout.prompts_per_step * self.rollout.group_size).max(1);
        let mini = match self.optim.mini_batch_size {
            0 => rows,
            m => m.min(rows),
        };
        let steps = rows.div_ceil(mini) * self.optim.ppo_epochs;
        (steps, steps - 1)
    }

    /// Checks that `[actor.policy]` names a known loss with valid settings.
    pub(super) fn validate_policy_loss(&self) -> Result<(), ConfigError> {
        self.actor
            .policy
            .resolve()
            .map_err(|e| ConfigError::Invalid {
                field: "actor.policy",
                message: e.to_string(),
            })?;
        Ok(())
    }

    /// The ranges the estimator and the loss state for their own settings
    /// ([`Estimator::validate`], [`turnwise_model::loss::ActorLossConfig::validate`]), every
    /// value out of range under its dotted key (`advantage.similarity_thresh`,
    /// `actor.policy.clip_ratio`).
    pub(super) fn validate_parts(&self) -> Vec<ConfigError> {
        let under = |section: &str, problems: RangeErrors| {
            problems
                .0
                .into_iter()
                .map(|p| ConfigError::Field {
                    field: format!("{section}.{}", p.field),
                    message: p.message,
                })
                .collect::<Vec<_>>()
        };
        let mut out = Vec::new();
        match self.advantage.validate() {
            Ok(()) => {}
            Err(AdvantageError::InvalidSettings { problems, .. }) => {
                out.extend(under("advantage", problems))
            }
            Err(e) => out.push(ConfigError::Invalid {
                field: "advantage",
                message: e.to_string(),
            }),
        }
        match self.actor.validate() {
            Ok(()) => {}
            Err(LossError::InvalidSettings(problems)) => out.extend(under("actor", problems)),
            Err(e) => out.push(ConfigError::Invalid {
                field: "actor",
                message: e.to_string(),
            }),
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use crate::config::TrainConfig;

    /// A loss reads only channels its estimator emits: A2TGPO's loss over GRPO's advantages is
    /// refused before anything runs, naming the channel and the estimator that emits it; over
    /// A2TGPO's own estimator it passes.
    #[test]
    fn a_loss_reading_a_channel_needs_an_estimator_that_emits_it() {
        let set = ["actor.policy.policy_loss=\"a2tgpo\"".to_string()];
        let err = TrainConfig::resolve(Some("grpo"), None, &set)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("actor.policy.policy_loss")
                && err.contains("`clip_scale` channel")
                && err.contains("use a2tgpo"),
            "{err}"
        );
        TrainConfig::resolve(Some("a2tgpo"), None, &set).unwrap();
    }
}
