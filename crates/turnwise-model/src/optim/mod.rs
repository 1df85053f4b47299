//! Training utilities: AdamW, gradient clipping and accumulation, learning-rate schedules.

pub mod adamw;
pub mod grads;
pub mod schedule;

pub use adamw::{AdamW, AdamWConfig};
pub use grads::{GradAccumulator, Gradients};
pub use schedule::{DecayShape, LrSchedule};

#[cfg(test)]
pub(crate) mod tests;
