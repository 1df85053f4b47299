//! The warm start before RL: supervised fine-tuning on demonstrations (`[sft]`) and the
//! rejection-sampling fine-tuning of T2PO's cold start (`[rsft]`), with their checks.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::ConfigError;
use super::numbers::{check, positive, unit};

/// Supervised warm start on oracle demonstrations.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SftConfig {
    /// Optimizer steps (0 skips the warm start).
    pub steps: u64,
    /// Demonstrations per step.
    pub batch_size: usize,
    /// Peak learning rate. Range: > 0.
    pub lr: f64,
    /// Warm-up steps.
    pub warmup_steps: u64,
    /// Cosine floor as a fraction of the peak, in [0, 1].
    pub min_lr_ratio: f64,
    /// Probability that a demonstration carries one error (oracle noise).
    pub noise: f64,
    /// A JSON-lines file of demonstrations (`{"prompt": ..., "segments": [[text, is_agent]...]}`)
    /// instead of the oracle.
    pub demonstrations: Option<PathBuf>,
    /// Checkpoint the warm start every N steps and at its last step (the weights, its optimizer
    /// and data order, into `checkpoints/warm-start-step-N/`; only the newest is kept, and it is
    /// deleted once the RL checkpoint of step 0 is written), so that `turnwise resume` continues
    /// a warm start that was killed instead of redoing it. 0 turns it off. The default of 100
    /// loses at most about 50 s of the quickstart's warm start (1,100 steps of about 0.5 s on two
    /// CPU cores) for a save that takes a small fraction of that.
    pub save_every: u64,
}

impl Default for SftConfig {
    fn default() -> Self {
        Self {
            steps: 1200,
            batch_size: 16,
            lr: 2e-3,
            warmup_steps: 50,
            min_lr_ratio: 0.1,
            noise: 0.2,
            demonstrations: None,
            save_every: 100,
        }
    }
}

/// Rejection-sampling fine-tuning (RFT): T2PO's cold start (t2po.md App. B.1, spec §8.5). After
/// the supervised warm start, the current policy answers `questions` training questions
/// `rollouts_per_question` times each; the rollouts whose reward (the run's `reward`) is at or
/// above `threshold` are kept and the policy is fine-tuned on them (negative log-likelihood of the
/// agent tokens, the warm start's step) for `epochs` passes. Off by default; the `t2po` preset
/// turns it on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RsftConfig {
    /// Run the rejection-sampling fine-tuning after the warm start.
    pub enabled: bool,
    /// Training questions sampled (a seeded draw without replacement; capped at the size of the
    /// training split).
    pub questions: usize,
    /// Rollouts sampled per question.
    pub rollouts_per_question: usize,
    /// Sampling temperature of those rollouts.
    pub temperature: f64,
    /// Keep a rollout when its reward is at or above this value (`em` reward: 1 keeps the
    /// correct answers).
    pub threshold: f64,
    /// Passes over the kept rollouts (T2PO: at most 5, more degrades the subsequent RL).
    pub epochs: usize,
    /// Learning rate (constant).
    pub lr: f64,
    /// Kept rollouts per optimizer step.
    pub batch_size: usize,
}

impl Default for RsftConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            questions: 256,
            rollouts_per_question: 4,
            temperature: 1.0,
            threshold: 1.0,
            epochs: 1,
            lr: 5e-4,
            batch_size: 16,
        }
    }
}

impl SftConfig {
    /// Checks the learning rate and its cosine floor.
    pub(super) fn validate_ranges(&self) -> Result<(), ConfigError> {
        check(positive(self.lr), "sft.lr", "a positive number", self.lr)?;
        check(
            unit(self.min_lr_ratio),
            "sft.min_lr_ratio",
            "in [0, 1]",
            self.min_lr_ratio,
        )
    }

    /// Checks the demonstrations' noise and the batch size.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if !(0.0..=1.0).contains(&self.noise) {
            return Err(ConfigError::Invalid {
                field: "sft.noise",
                message: format!("must be in [0, 1], got {}", self.noise),
            });
        }
        if self.steps > 0 && self.batch_size == 0 {
            return Err(ConfigError::Invalid {
                field: "sft.batch_size",
                message: "must be at least 1".into(),
            });
        }
        Ok(())
    }
}

impl RsftConfig {
    /// Checks the learning rate.
    pub(super) fn validate_lr(&self) -> Result<(), ConfigError> {
        check(positive(self.lr), "rsft.lr", "a positive number", self.lr)
    }

    /// Checks the section (always, so that a typo is caught before it is turned on).
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        let c = self;
        if c.questions == 0 {
            return bad("rsft.questions", "must be at least 1".into());
        }
        if c.rollouts_per_question == 0 {
            return bad("rsft.rollouts_per_question", "must be at least 1".into());
        }
        if !(c.temperature > 0.0 && c.temperature.is_finite()) {
            return bad(
                "rsft.temperature",
                format!("must be positive for sampling, got {}", c.temperature),
            );
        }
        if !c.threshold.is_finite() {
            return bad(
                "rsft.threshold",
                format!("must be a finite reward value, got {}", c.threshold),
            );
        }
        if c.epochs == 0 {
            return bad("rsft.epochs", "must be at least 1".into());
        }
        if !(c.lr > 0.0 && c.lr.is_finite()) {
            return bad("rsft.lr", format!("must be positive, got {}", c.lr));
        }
        if c.batch_size == 0 {
            return bad("rsft.batch_size", "must be at least 1".into());
        }
        Ok(())
    }
}
