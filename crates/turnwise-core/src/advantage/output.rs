//! The output of every estimator.

use serde::{Deserialize, Serialize};

use super::channel::Channels;

/// Advantages of one rollout.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RolloutAdvantage {
    /// One advantage per response token, aligned with [`Rollout::turn_id`](super::Rollout::turn_id).
    /// Only loss-mask positions (`turn_id >= 0`) matter; observation positions hold 0 unless the
    /// reference code writes a value there (GAE, IGPO code form, AT2PO), which the loss masks out.
    pub tokens: Vec<f64>,
    /// One advantage per agent turn (`num_turns` entries). For turn-constant estimators this is
    /// the value every token of the turn gets; for the token-varying ones (GAE, IGPO code form)
    /// it is the advantage at the turn's first token (0 for a turn without tokens).
    pub turns: Vec<f64>,
    /// GAE value targets `A + V` per token (before whitening); `None` for other estimators.
    pub returns: Option<Vec<f64>>,
    /// The per-method data the estimator emits beside the advantages (the channels of
    /// [`Estimator::emits`](super::Estimator::emits), e.g. A2TGPO's clip scale); empty for the
    /// estimators that emit none.
    #[serde(default, skip_serializing_if = "Channels::is_empty")]
    pub channels: Channels,
}

/// AT2PO values of one tree (§3.6), for logging and for rollouts that are not leaves.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TreeValues {
    /// `V(n)` per node (0 for nodes without a value, e.g. leaves without reward).
    pub values: Vec<f64>,
    /// `A(n)` per node under the configured advantage mode.
    pub advantages: Vec<f64>,
}

/// What an estimator returns: per-rollout advantages aligned with
/// [`AdvantageBatch::rollouts`](super::AdvantageBatch::rollouts).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AdvantageOutput {
    /// Registry name of the estimator that produced this output.
    pub estimator: String,
    /// Per-rollout advantages, in batch order.
    pub rollouts: Vec<RolloutAdvantage>,
    /// AT2PO: per-tree node values and advantages (aligned with
    /// [`AdvantageBatch::trees`](super::AdvantageBatch::trees)); empty otherwise.
    pub trees: Vec<TreeValues>,
}

/// Spreads per-turn values over tokens: token `k` gets `per_turn[turn_id[k]]`, observation
/// tokens (`turn_id < 0`) and turns beyond `per_turn` get `fill`.
pub fn broadcast_turns(turn_id: &[i32], per_turn: &[f64], fill: f64) -> Vec<f64> {
    turn_id
        .iter()
        .map(|&t| {
            if t < 0 {
                fill
            } else {
                per_turn.get(t as usize).copied().unwrap_or(fill)
            }
        })
        .collect()
}

/// Per-turn view of per-token values: the value at each turn's first token (0 for a turn with
/// no token).
pub(crate) fn first_token_per_turn(turn_id: &[i32], tokens: &[f64], num_turns: usize) -> Vec<f64> {
    let mut out = vec![0.0; num_turns];
    let mut seen = vec![false; num_turns];
    for (&t, &v) in turn_id.iter().zip(tokens) {
        if t >= 0 && (t as usize) < num_turns && !seen[t as usize] {
            seen[t as usize] = true;
            out[t as usize] = v;
        }
    }
    out
}

/// A turn-constant [`RolloutAdvantage`]: tokens from [`broadcast_turns`] (observations 0).
pub(crate) fn turn_constant(turn_id: &[i32], turns: Vec<f64>) -> RolloutAdvantage {
    RolloutAdvantage {
        tokens: broadcast_turns(turn_id, &turns, 0.0),
        turns,
        ..RolloutAdvantage::default()
    }
}
