//! # turnwise-core
//!
//! The algorithms of multi-turn agentic RL on plain data, with no tensor library.
//!
//! The modules follow the training pipeline:
//!
//! - [`trajectory`]: token-exact trajectories (prompt ids, agent turns with sampling statistics,
//!   environment observations), groups of rollouts and rollout trees, with JSON-lines round-trip.
//! - [`grammar`]: the three agent tag grammars (Search-R1, boxed-answer A2TGPO/AT2PO, T2PO) that
//!   turn raw model output into actions and format verdicts.
//! - [`reward`]: outcome and turn-level rewards (EM, F1, format rules, turn rewards, penalties).
//! - [`advantage`]: every advantage estimator behind one signature, looked up by name.
//! - [`control`]: rollout-control rules that need no model (tree node selection, thinking
//!   intervention, turn resampling, dynamic sampling).
//! - [`info_gain`]: per-turn information gain from answer log-probabilities.
//! - [`pip`]: packaged data and models fetched from PyPI into a cache.
//!
//! Formulas, defaults and test vectors follow `docs/algorithms.md` (in the repository root); section numbers in the
//! doc comments (e.g. "§3.5") refer to it.

pub mod advantage;
pub mod control;
pub mod grammar;
pub mod info_gain;
pub mod metric_keys;
pub mod pip;
pub mod range;
pub mod reward;
pub mod trajectory;

#[cfg(test)]
pub(crate) mod test_util;
