//! Advantage estimators (§3): plain functions over plain data, registered by name with one
//! shared signature (verl `core_algos` style).
//!
//! # Input
//! An [`AdvantageBatch`] holds [`Rollout`]s (any number of prompt groups) and, for AT2PO, the
//! [`RolloutTree`]s. A rollout carries its prompt `group`, per-response-token `turn_id`
//! (`-1` = observation; the loss mask is `turn_id >= 0`), `num_turns`, its `outcome`, and the
//! per-turn / per-token / per-step inputs that particular estimators need (see [`Rollout`]).
//!
//! # Running an estimator
//! ```
//! use turnwise_core::advantage::{AdvantageBatch, AdvantageConfig, Rollout, estimate};
//!
//! let batch = AdvantageBatch::new(vec![
//!     Rollout::new(0, vec![0, 0, -1, 1], 1.0).with_info_gain(vec![0.3]),
//!     Rollout::new(0, vec![0, -1, 1, 1], 0.0).with_info_gain(vec![0.1]),
//! ]);
//! let cfg = AdvantageConfig::from_settings("a2tgpo", serde_json::json!({"gamma": 1.0})).unwrap();
//! let out = estimate(&batch, &cfg).unwrap();
//! assert_eq!(out.rollouts[0].tokens.len(), 4);
//! ```
//!
//! # Output
//! [`AdvantageOutput`]: per rollout, per-token advantages aligned with `turn_id`, per-turn
//! advantages, GAE returns, and the channels the estimator emits beside them ([`Channel`], e.g.
//! A2TGPO's clip scale `c`, §5.5); per tree (AT2PO), node values and advantages.
//!
//! # Registry names
//! `grpo`, `dr_grpo`, `rloo`, `mt_grpo`, `mt_grpo_code`, `gae`, `igpo`, `a2tgpo`, `at2po`,
//! `tree_grpo`, `gigpo`, `t2po` (see [`ESTIMATORS`]).

mod a2tgpo;
mod channel;
pub mod contract;
mod difflib;
mod error;
mod gae;
mod gigpo;
mod grpo;
mod igpo;
mod input;
mod kernels;
mod mt_grpo;
mod output;
mod registered;
mod registry;
mod tree;
mod tree_grpo;

#[cfg(test)]
mod proptests;

pub use a2tgpo::{A2tgpoConfig, a2tgpo_clip_scale, a2tgpo_turn_advantages, turn_group_normalize};
pub use channel::{Channel, ChannelValues, Channels};
pub use contract::{GroupSignal, KlPlacement, MetricDoc, Metrics, Needs, StepSamples};
pub use difflib::{SequenceMatcher, sequence_ratio};
pub use error::AdvantageError;
pub use gae::{GaeConfig, gae_sequence, place_turn_rewards};
pub use gigpo::{EpisodeTerm, GigpoConfig, GigpoNorm, T2poConfig, anchor_clusters};
pub use grpo::{DrGrpoConfig, GrpoConfig, RlooConfig};
pub use igpo::{IgpoConfig, IgpoForm, igpo_code_group, igpo_paper_group};
pub use input::{AdvantageBatch, OBSERVATION, Rollout, RolloutTree, TreeNode};
pub use kernels::{
    GroupNorm, Singleton, StdKind, discounted_suffix_sums, dr_grpo_center, grpo_normalize,
    masked_whiten, mean, normalize_by_key, rloo, sigmoid, softmax, std_population, std_unbiased,
};
pub use mt_grpo::{
    MtGrpoCodeConfig, MtGrpoConfig, TurnGroupKey, mt_grpo_turn_advantages, role_group,
};
pub use output::{AdvantageOutput, RolloutAdvantage, TreeValues, broadcast_turns};
pub use registered::{RegisteredEstimator, Registrable, register, registered};
pub use registry::{
    AdvantageConfig, ESTIMATORS, Estimator, estimate, estimate_by_name, estimators_where,
};
pub use tree::{At2poConfig, NodeAdvMode, NodeValueMode, tree_node_advantages, tree_node_values};
pub use tree_grpo::{TreeGrpoConfig, TreeGrpoMode, tree_grpo_group};
