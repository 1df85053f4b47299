//! Learning-rate schedules: linear warm-up, then cosine or linear decay to a floor.

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// Shape of the decay after warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DecayShape {
    /// Half-cosine from the peak to the floor.
    Cosine,
    /// Straight line from the peak to the floor.
    Linear,
    /// Stay at the peak.
    Constant,
}

/// Linear warm-up from `peak_lr / warmup_steps` to `peak_lr` over `warmup_steps` updates, then a
/// decay to `peak_lr × min_lr_ratio` at `total_steps`, constant afterwards.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    /// Learning rate at the end of warm-up.
    pub peak_lr: f64,
    /// Number of warm-up updates.
    pub warmup_steps: u64,
    /// Update index at which the floor is reached.
    pub total_steps: u64,
    /// Floor as a fraction of the peak (e.g. 0.1).
    pub min_lr_ratio: f64,
    /// Decay shape.
    pub decay: DecayShape,
}

impl LrSchedule {
    /// Checks the values.
    pub fn validate(&self) -> Result<()> {
        if !(self.peak_lr > 0.0 && self.peak_lr.is_finite()) {
            return Err(ModelError::invalid_input(
                "peak_lr",
                "must be a positive number",
            ));
        }
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            return Err(ModelError::invalid_input(
                "min_lr_ratio",
                "must be in [0, 1]",
            ));
        }
        Ok(())
    }

    /// The learning rate of update number `step` (0-based).
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.peak_lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let floor = self.peak_lr * self.min_lr_ratio;
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1);
        let progress = ((step - self.warmup_steps) as f64 / span as f64).min(1.0);
        match self.decay {
            DecayShape::Constant => self.peak_lr,
            DecayShape::Linear => self.peak_lr - (self.peak_lr - floor) * progress,
            DecayShape::Cosine => {
                floor
                    + (self.peak_lr - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}
