//! The rules that tie sections together, in one place: the training rows against the memory
//! window, the critic and KL in the reward (`optim.samples`); one step's rollouts against this
//! machine's memory; what the estimator and the loss declare they need against the rollout, the
//! critic and the update; the loss against the estimator it reads. Each section's own keys are
//! checked beside its struct.

use turnwise_core::advantage::{Estimator, estimators_where};
use turnwise_model::loss::policy::PolicyLossKind;

use super::{ConfigError, RolloutStrategy, TrainConfig, TrainSamples};

impl TrainConfig {
    /// Every cross-section rule, each reporting its first problem; `memory` is this machine's
    /// memory in bytes (`None`: not checked).
    pub(super) fn validate_cross(&self, memory: Option<u64>) -> Vec<ConfigError> {
        [
            self.validate_samples(),
            self.validate_memory(memory),
            self.validate_method_needs(),
            self.validate_loss_reads_estimator(),
        ]
        .into_iter()
        .filter_map(Result::err)
        .collect()
    }

    /// Checks `optim.samples` against the memory window and the parts that read whole rows.
    pub(super) fn validate_samples(&self) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        match self.optim.samples {
            TrainSamples::Trajectory => {
                // The window drops turns once a turn has more than P turns before it.
                if let Some(p) = self.rollout.memory_window
                    && self.task.max_turns > p + 1
                {
                    return bad(
                        "rollout.memory_window",
                        format!(
                            "a window of {p} turns drops earlier turns from the context of turn \
                             {} onwards (task.max_turns = {}), but optim.samples = \
                             \"trajectory\" trains every turn on the whole history, which is not \
                             what it was sampled from; set optim.samples = \"step\" (each step \
                             trained on its own context), or a window of at least {} turns",
                            p + 2,
                            self.task.max_turns,
                            self.task.max_turns - 1
                        ),
                    );
                }
            }
            TrainSamples::Step => {
                if self.critic.enabled {
                    return bad(
                        "optim.samples",
                        "\"step\" rows are not supported with a critic (critic.enabled): its \
                         values and returns are per trajectory row"
                            .into(),
                    );
                }
                if self.algorithm.use_kl_in_reward {
                    return bad(
                        "optim.samples",
                        "\"step\" rows are not supported with KL in the reward \
                         (algorithm.use_kl_in_reward): use the KL loss (actor.use_kl_loss), as \
                         verl-agent does"
                            .into(),
                    );
                }
            }
        }
        Ok(())
    }

    /// Refuses a batch whose [`TrainConfig::rollout_memory_floor`] exceeds `total` bytes (this
    /// machine's memory; `None` when it cannot be read, and then nothing is checked), naming the
    /// keys that size it.
    pub(super) fn validate_memory(&self, total: Option<u64>) -> Result<(), ConfigError> {
        let Some(total) = total else { return Ok(()) };
        let need = self.rollout_memory_floor();
        if need > u128::from(total) {
            let gb = |b: u128| b as f64 / 1e9;
            return Err(ConfigError::Invalid {
                field: "rollout.group_size",
                message: format!(
                    "rollout.prompts_per_step × rollout.group_size = {} × {} sequences of up to \
                     {} tokens (rollout.max_response_tokens; model.max_position_embeddings {} for \
                     a fresh model's KV cache) need at least {:.1} GB, more than this machine's \
                     {:.1} GB of memory",
                    self.rollout.prompts_per_step,
                    self.rollout.group_size,
                    self.rollout.max_response_tokens,
                    self.model.max_position_embeddings,
                    gb(need),
                    gb(u128::from(total))
                ),
            });
        }
        Ok(())
    }

    /// What the estimator and the loss declare they need: the estimator's inputs (a critic,
    /// information-gain probes, tree rollouts; [`Estimator::needs`]), off-policy updates for a
    /// loss defined by its clip ([`PolicyLossKind::defined_by_clip`]), an estimator that takes
    /// KL in the reward ([`Estimator::kl_placement`]) and the KL controller of
    /// `algorithm.use_kl_in_reward`.
    pub(super) fn validate_method_needs(&self) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        let r = &self.rollout;
        let o = &self.optim;
        let est = self.advantage.name();
        let needs = self.advantage.needs();
        if needs.critic_values && !self.critic.enabled {
            return bad(
                "critic.enabled",
                format!("the {est} estimator needs a critic: set critic.enabled = true"),
            );
        }
        if needs.info_gain && !r.info_gain {
            return bad(
                "rollout.info_gain",
                format!(
                    "the {est} estimator needs information-gain probes: set rollout.info_gain = true"
                ),
            );
        }
        if needs.trees && r.strategy == RolloutStrategy::Chain {
            return bad(
                "rollout.strategy",
                format!(
                    "the {est} estimator needs tree rollouts (strategy = \"tree\" or \"random_tree\")"
                ),
            );
        }
        // A loss whose defining mechanism is a clip (or the clipping-bias correction) needs
        // off-policy updates: with one epoch over one mini-batch every ratio is exactly 1 and
        // no clip can bind (review X1), so the method would silently train as plain PG.
        let kind = self
            .actor
            .policy
            .resolve()
            .map_err(|e| ConfigError::Invalid {
                field: "actor.policy",
                message: e.to_string(),
            })?
            .kind;
        let rows = r.prompts_per_step * r.group_size;
        if kind.defined_by_clip()
            && o.ppo_epochs == 1
            && (o.mini_batch_size == 0 || o.mini_batch_size >= rows)
        {
            return bad(
                "optim.mini_batch_size",
                format!(
                    "the {} loss is defined by its clip, which cannot bind in an on-policy update \
                     (optim.ppo_epochs = 1 and one mini-batch of all {rows} rollouts): set \
                     optim.mini_batch_size below {rows} or optim.ppo_epochs above 1",
                    kind.name()
                ),
            );
        }
        if self.algorithm.use_kl_in_reward {
            if self.advantage.kl_placement().is_none() {
                let takers = estimators_where(|e| e.kl_placement().is_some());
                return bad(
                    "algorithm.use_kl_in_reward",
                    format!(
                        "KL in the reward applies to the {} estimators, not {est}; use \
                         actor.use_kl_loss",
                        listing(&takers)
                    ),
                );
            }
            self.algorithm
                .kl_ctrl
                .build()
                .map_err(|e| ConfigError::Invalid {
                    field: "algorithm.kl_ctrl",
                    message: e.to_string(),
                })?;
        }
        Ok(())
    }

    /// A loss reads only channels its estimator emits ([`PolicyLossKind::reads`] ⊆
    /// [`Estimator::emits`]).
    pub(super) fn validate_loss_reads_estimator(&self) -> Result<(), ConfigError> {
        let Ok(kind) = self.actor.policy.policy_loss.parse::<PolicyLossKind>() else {
            return Ok(());
        };
        let emitted = self.advantage.emits();
        if let Some(&missing) = kind.reads().iter().find(|c| !emitted.contains(c)) {
            let emitters = estimators_where(|e| e.emits().contains(&missing));
            return Err(ConfigError::Invalid {
                field: "actor.policy.policy_loss",
                message: format!(
                    "the {kind} loss reads the `{missing}` channel, which the {} estimator does \
                     not emit (use {})",
                    self.advantage.name(),
                    emitters.join(" or ")
                ),
            });
        }
        Ok(())
    }
}

/// `a, b and c`.
fn listing(names: &[&str]) -> String {
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        Some((last, _)) => last.to_string(),
        None => String::new(),
    }
}
