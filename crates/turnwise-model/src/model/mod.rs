//! The transformer: configuration, weights, the model itself and its key/value cache.

pub mod cache;
pub mod config;
pub mod critic;
pub mod lora;
pub mod ops;
pub mod prefix;
pub mod transformer;
pub mod weights;

pub use cache::KvCache;
pub use config::{Architecture, ModelConfig};
pub use critic::Critic;
pub use lora::{LoraConfig, LoraDropout};
pub use transformer::Transformer;

#[cfg(test)]
pub(crate) mod tests;
