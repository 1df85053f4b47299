//! Rollout-control rules that need no model (spec §6).
//!
//! These are the pure decisions the rollout engine asks for while it samples: which tree nodes to
//! fork (AT2PO entropy-guided expansion, Tree-GRPO random expansion, §6.1), when to cut a
//! reasoning span short (T2PO token-level thinking intervention, §6.2), whether to resample a turn
//! (T2PO turn-level dynamical sampling, §6.3), which prompt groups survive DAPO dynamic sampling
//! (§6.4) and which past turns a per-step prompt shows (T2PO/GiGPO memory window, §1.3).
//!
//! Everything here works on plain data (slices of `f64`, token ids, node indices), allocates
//! little, and can be driven token by token. Randomness comes from the small deterministic
//! [`SplitMix64`] generator so that a seeded run is reproducible without extra dependencies.

pub mod dynamic_sampling;
pub mod memory;
pub mod rng;
pub mod tds;
pub mod tree_expansion;
pub mod tti;

pub use dynamic_sampling::{GroupFilter, filter_groups, keep_group, population_std};
pub use memory::MemoryWindow;
pub use rng::SplitMix64;
pub use tds::{AttemptScore, TdsRule, TdsSettings, TdsTracker, turn_gap, turn_score};
pub use tree_expansion::{
    ExpansionMode, ExpansionTree, LeafBalance, NodeId, TreeExpansionSettings, TreeNode,
};
pub use tti::{OnlineSignal, RunningMinMax, TokenStats, TtiController, TtiSettings, TtiStep};

/// Errors raised by the rollout-control rules.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ControlError {
    /// A node index does not belong to the tree it was used with.
    #[error("tree node {id} does not exist (the tree has {len} nodes)")]
    UnknownNode {
        /// The offending index.
        id: usize,
        /// Number of nodes in the tree.
        len: usize,
    },
    /// A structural operation was asked of a node in the wrong state.
    #[error("invalid tree operation on node {id}: {reason}")]
    InvalidTreeOp {
        /// The node concerned.
        id: usize,
        /// What was wrong.
        reason: &'static str,
    },
    /// The leaf budget could not be met (no leaf to duplicate, or the only leaf is the root).
    #[error("cannot bring the tree to {target} leaves: {reason} (it has {have})")]
    LeafBudget {
        /// The requested number of leaves N.
        target: usize,
        /// Leaves present when the operation gave up.
        have: usize,
        /// Why.
        reason: &'static str,
    },
    /// Two parallel inputs have different lengths.
    #[error("length mismatch: {what} has {got} entries, expected {expected}")]
    LengthMismatch {
        /// Which input.
        what: &'static str,
        /// Its length.
        got: usize,
        /// The length it should have.
        expected: usize,
    },
    /// A row index does not belong to the batch a tracker was built for.
    #[error("row {row} does not exist (the batch has {rows} rows)")]
    UnknownRow {
        /// The offending row.
        row: usize,
        /// Rows of the batch.
        rows: usize,
    },
    /// A setting is out of its valid range.
    #[error("invalid setting {name}: {reason}")]
    InvalidSetting {
        /// Setting name as written in the config.
        name: &'static str,
        /// Why it is invalid.
        reason: &'static str,
    },
}

/// The `q`-quantile of sorted values by linear interpolation between order statistics (R's and
/// NumPy's default, type 7): position `q · (n − 1)`.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let pos = q.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let (i, frac) = (pos.floor() as usize, pos.fract());
    match sorted.get(i + 1) {
        Some(next) => sorted[i] + frac * (next - sorted[i]),
        None => sorted[i],
    }
}
