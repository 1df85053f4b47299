//! # turnwise
//!
//! Multi-turn reinforcement learning for LLM agents: the trainer and its command-line tool.
//! The modules follow one training step down the pipeline:
//!
//! task ([`task`]) → environment (`turnwise_env`) → rollout ([`rollout`]) → reward
//! (`turnwise_core::reward`) → advantage ([`trainer::advantage`] over `turnwise_core::advantage`)
//! → loss and optimizer ([`update`] over `turnwise_model::loss`) → checkpoint and metrics
//! ([`trainer`]). [`config`] resolves presets and overrides; [`serve`] puts the policy behind
//! the HTTP APIs of the inference engines.

pub mod audit;
pub mod bench;
pub mod checkpoints;
pub mod config;
pub mod model_source;
pub use turnwise_report::ownership;
pub(crate) mod parallel;
pub mod pipeline;
pub mod prompt;
pub mod reward;
pub mod rollout;
pub mod run;
pub mod serve;
pub mod shard;
pub mod study;
pub mod task;
pub mod trainer;
pub mod update;
