//! Turn delimitation for turn-level ratios (spec §1.2) and the `turn_kl_entropy` diagnostic (§7).
//!
//! \[REC\] §1.2: when the rollout carries an explicit per-token `turn_id` (agent-turn index, −1 on
//! observation tokens) a turn is the set of loss tokens sharing one id — an injected observation
//! inside a logical turn then does not split it. Without `turn_id`, the canonical rule applies: a
//! turn is a maximal run of consecutive `loss_mask == 1` tokens. Turns with zero loss tokens never
//! appear (they are skipped, as ATPO's `turn_length > 0` guard does). Which rule was used is
//! reported in the metrics.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{LossError, Result};

/// Which turn-delimitation rule produced a segmentation (§1.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnRule {
    /// Explicit per-token `turn_id` from the rollout (\[REC\]).
    ExplicitTurnId,
    /// Maximal runs of `loss_mask == 1` (canonical fallback).
    MaskRuns,
    /// One segment per sequence (GSPO, §5.3).
    WholeSequence,
}

/// One turn: the loss tokens of one agent turn of one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    /// Row (sequence) index in the mini-batch.
    pub row: usize,
    /// The `turn_id` (explicit rule) or the run's ordinal within the row (other rules).
    pub turn_id: i64,
    /// Column positions of the turn's loss tokens, ascending.
    pub positions: Vec<usize>,
}

/// A segmentation of the loss tokens of a [B, L] mini-batch into turns.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnSegments {
    /// The rule used.
    pub rule: TurnRule,
    /// All turns, row-major, in order of first token.
    pub turns: Vec<Turn>,
    /// Turn index (into `turns`) of every token, row-major over [B, L]; `None` for non-loss tokens.
    pub token_turn: Vec<Option<usize>>,
    /// Batch size B.
    pub batch: usize,
    /// Sequence length L.
    pub len: usize,
}

impl TurnSegments {
    /// Segments by explicit `turn_id` rows when given, else by mask runs (§1.2).
    ///
    /// Errors when a loss token carries a negative turn id (an observation id on a trained token).
    pub fn from_rows(loss: &str, mask: &[Vec<f64>], turn_id: Option<&[Vec<f64>]>) -> Result<Self> {
        let batch = mask.len();
        let len = mask.first().map_or(0, Vec::len);
        let mut turns = Vec::new();
        let mut token_turn = vec![None; batch * len];
        let rule = match turn_id {
            Some(ids) => {
                for (i, (mr, ir)) in mask.iter().zip(ids).enumerate() {
                    let mut by_id: BTreeMap<i64, Vec<usize>> = BTreeMap::new();
                    for (t, (&m, &id)) in mr.iter().zip(ir).enumerate() {
                        if m <= 0.0 {
                            continue;
                        }
                        if id < 0.0 || id.fract() != 0.0 {
                            return Err(LossError::InvalidInput {
                                loss: loss.to_string(),
                                msg: format!(
                                    "loss token ({i}, {t}) has turn_id {id}; loss tokens need a non-negative integer turn id"
                                ),
                            });
                        }
                        by_id.entry(id as i64).or_default().push(t);
                    }
                    let mut row_turns: Vec<(i64, Vec<usize>)> = by_id.into_iter().collect();
                    row_turns.sort_by_key(|(_, p)| p[0]);
                    for (id, positions) in row_turns {
                        for &t in &positions {
                            token_turn[i * len + t] = Some(turns.len());
                        }
                        turns.push(Turn {
                            row: i,
                            turn_id: id,
                            positions,
                        });
                    }
                }
                TurnRule::ExplicitTurnId
            }
            None => {
                for (i, mr) in mask.iter().enumerate() {
                    let mut ordinal = 0i64;
                    let mut current: Option<Vec<usize>> = None;
                    for (t, &m) in mr.iter().enumerate() {
                        if m > 0.0 {
                            current.get_or_insert_with(Vec::new).push(t);
                        } else if let Some(positions) = current.take() {
                            push_turn(&mut turns, &mut token_turn, len, i, ordinal, positions);
                            ordinal += 1;
                        }
                    }
                    if let Some(positions) = current.take() {
                        push_turn(&mut turns, &mut token_turn, len, i, ordinal, positions);
                    }
                }
                TurnRule::MaskRuns
            }
        };
        Ok(Self {
            rule,
            turns,
            token_turn,
            batch,
            len,
        })
    }

    /// One segment per non-empty sequence (GSPO's sequence ratio, §5.3).
    pub fn whole_sequences(mask: &[Vec<f64>]) -> Self {
        let batch = mask.len();
        let len = mask.first().map_or(0, Vec::len);
        let mut turns = Vec::new();
        let mut token_turn = vec![None; batch * len];
        for (i, mr) in mask.iter().enumerate() {
            let positions: Vec<usize> = (0..len).filter(|&t| mr[t] > 0.0).collect();
            if !positions.is_empty() {
                push_turn(&mut turns, &mut token_turn, len, i, 0, positions);
            }
        }
        Self {
            rule: TurnRule::WholeSequence,
            turns,
            token_turn,
            batch,
            len,
        }
    }
}

fn push_turn(
    turns: &mut Vec<Turn>,
    token_turn: &mut [Option<usize>],
    len: usize,
    row: usize,
    turn_id: i64,
    positions: Vec<usize>,
) {
    for &t in &positions {
        token_turn[row * len + t] = Some(turns.len());
    }
    turns.push(Turn {
        row,
        turn_id,
        positions,
    });
}

/// How far apart two f32 passes over the same weights put a token's log-prob (batched or
/// grouped otherwise): a log-ratio sum within this much per token of zero is zero.
pub const LOGR_ROUNDING: f64 = 1e-6;

/// `actor/turn_kl_entropy` and `actor/single_turn_count` (§7, ATPO App. A eq. 13).
///
/// Per sample: `x_k = Σ_{turn k} logr / Σ_seq logr` (sample skipped when `Σ_seq logr = 0`),
/// `p = softmax(x)`, `H = −Σ p log(p + 1e-10) / log K`; a sample with one turn scores 0. Returns the
/// mean over scored samples (`None` when none) and the number of samples with ≤ 1 turn.
///
/// `Σ_seq logr` within f32 rounding of zero ([`LOGR_ROUNDING`] per token) counts as zero: the
/// policy has not moved (the first mini-batch, whose behaviour log-probs come from another pass
/// over the same weights, batched otherwise), and `x` would be a ratio of rounding noise.
pub fn turn_kl_entropy(logr: &[Vec<f64>], segments: &TurnSegments) -> (Option<f64>, usize) {
    let mut per_row: Vec<Vec<f64>> = vec![Vec::new(); segments.batch];
    let mut tokens = vec![0usize; segments.batch];
    for turn in &segments.turns {
        let s: f64 = turn.positions.iter().map(|&t| logr[turn.row][t]).sum();
        per_row[turn.row].push(s);
        tokens[turn.row] += turn.positions.len();
    }
    let mut single = 0usize;
    let (mut total, mut n) = (0.0, 0usize);
    for (sums, tokens) in per_row.into_iter().zip(tokens) {
        let k = sums.len();
        if k <= 1 {
            single += 1;
            if k == 1 {
                n += 1; // one turn: entropy 0
            }
            continue;
        }
        let seq: f64 = sums.iter().sum();
        if seq.abs() <= LOGR_ROUNDING * tokens as f64 {
            continue;
        }
        let x: Vec<f64> = sums.iter().map(|s| s / seq).collect();
        let mx = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = x.iter().map(|v| (v - mx).exp()).collect();
        let z: f64 = e.iter().sum();
        let h: f64 = e.iter().map(|v| v / z).map(|p| -p * (p + 1e-10).ln()).sum();
        total += h / (k as f64).ln();
        n += 1;
    }
    ((n > 0).then(|| total / n as f64), single)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec_mask() -> Vec<Vec<f64>> {
        vec![vec![1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]]
    }

    #[test]
    fn mask_runs_give_spec_turns() {
        let s = TurnSegments::from_rows("t", &spec_mask(), None).unwrap();
        assert_eq!(s.rule, TurnRule::MaskRuns);
        let pos: Vec<_> = s.turns.iter().map(|t| t.positions.clone()).collect();
        assert_eq!(pos, vec![vec![0, 1, 2], vec![5, 6]]);
        assert_eq!(s.token_turn[3], None);
        assert_eq!(s.token_turn[6], Some(1));
    }

    #[test]
    fn explicit_turn_id_joins_split_turn_and_skips_empty_ids() {
        // An injected warning (mask 0) inside turn 0 does not split it; turn 1 has no loss token.
        let mask = vec![vec![1.0, 1.0, 0.0, 1.0, 0.0, 1.0]];
        let ids = vec![vec![0.0, 0.0, -1.0, 0.0, 1.0, 2.0]];
        let s = TurnSegments::from_rows("t", &mask, Some(&ids)).unwrap();
        assert_eq!(s.rule, TurnRule::ExplicitTurnId);
        let got: Vec<_> = s
            .turns
            .iter()
            .map(|t| (t.turn_id, t.positions.clone()))
            .collect();
        assert_eq!(got, vec![(0, vec![0, 1, 3]), (2, vec![5])]);
    }

    #[test]
    fn negative_turn_id_on_loss_token_is_an_error() {
        let err = TurnSegments::from_rows("turn", &[vec![1.0]], Some(&[vec![-1.0]])).unwrap_err();
        assert!(err.to_string().contains("turn_id"));
    }

    /// §7 vector: per-turn Σlogr = [0.07, 0.01] → 0.905272.
    #[test]
    fn spec_7_turn_kl_entropy() {
        let logr = vec![vec![0.10, -0.05, 0.02, 0.0, 0.0, 0.01, 0.00]];
        let s = TurnSegments::from_rows("t", &spec_mask(), None).unwrap();
        let (h, single) = turn_kl_entropy(&logr, &s);
        assert!((h.unwrap() - 0.905272).abs() < 1e-6);
        assert_eq!(single, 0);
        // One-turn sample scores 0 and counts as single-turn.
        let s1 = TurnSegments::from_rows("t", &[vec![1.0, 1.0]], None).unwrap();
        assert_eq!(turn_kl_entropy(&[vec![0.1, 0.2]], &s1), (Some(0.0), 1));
        // Log-ratios of rounding noise (an unmoved policy recomputed in another batch): the
        // sample is skipped, as for an exact zero, instead of scoring a ratio of noise.
        let noise = vec![vec![3e-7, -1e-7, 2e-7, 0.0, 0.0, -2e-7, 1e-7]];
        assert_eq!(turn_kl_entropy(&noise, &s), (None, 0));
    }
}
