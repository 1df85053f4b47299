//! The sampler–trainer mismatch, per turn: how far the log-probs a rollout recorded when it
//! sampled its tokens are from the trainer's recomputation of the same tokens.
//!
//! Both should be the same distribution (the rollout weights, the same temperature). Where they
//! are not, the update's importance ratios start away from 1 before any optimizer step: a
//! different kernel or precision in the inference engine, a stale weight sync, a truncated
//! context. Per token `t` on the loss mask, with `δ_t = log π_train(y_t) − log π_sample(y_t)`:
//!
//! - `|δ_t|`, the absolute log-prob difference (verl's `training/rollout_probs_diff_*` compares
//!   the probabilities instead);
//! - `k3_t = exp(δ_t) − 1 − δ_t`, Schulman's low-variance estimator of KL(π_sample ‖ π_train)
//!   from tokens drawn by π_sample (≥ 0; verl's `low_var_kl` without its clamp).
//!
//! [`logprob_mismatch`] averages both over every loss token of a batch and over the tokens of
//! each agent turn (by turn index), so that a mismatch that grows with the context shows as a
//! trend over the turns.

use std::collections::BTreeMap;

/// One row's tokens: the sampled and recomputed log-probs, the loss mask and the turn ids, one
/// entry per response token.
#[derive(Debug, Clone, Copy)]
pub struct MismatchRow<'a> {
    /// Log-probs recorded at sampling.
    pub sampled: &'a [f32],
    /// The trainer's recomputed log-probs of the same tokens.
    pub recomputed: &'a [f32],
    /// Loss mask (1 = an agent token the loss trains on).
    pub loss_mask: &'a [u8],
    /// Agent-turn index per token (−1 on observation tokens).
    pub turn_id: &'a [i32],
}

/// Means of `|δ|` and `k3` over a set of tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MismatchMeans {
    /// Tokens averaged over.
    pub tokens: usize,
    /// Mean absolute log-prob difference.
    pub abs_mean: f64,
    /// Mean `k3` KL estimate.
    pub k3_mean: f64,
}

/// The mismatch of a batch: over every loss token, and per agent turn.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Mismatch {
    /// Over every loss token of the batch.
    pub all: MismatchMeans,
    /// The largest `|δ|` of the batch.
    pub abs_max: f64,
    /// Per agent-turn index: over the loss tokens of that turn in every row.
    pub per_turn: BTreeMap<i32, MismatchMeans>,
}

impl Mismatch {
    /// The metrics of one RL step under `prefix` (e.g. `rollout/logprob_mismatch`):
    /// `abs_mean`, `abs_max`, `k3_mean` and per turn `turn_{k}/abs_mean`, `turn_{k}/k3_mean`.
    /// Nothing for a batch without loss tokens.
    pub fn metrics(&self, prefix: &str) -> Vec<(String, f64)> {
        if self.all.tokens == 0 {
            return Vec::new();
        }
        let mut out = vec![
            (format!("{prefix}/abs_mean"), self.all.abs_mean),
            (format!("{prefix}/abs_max"), self.abs_max),
            (format!("{prefix}/k3_mean"), self.all.k3_mean),
        ];
        for (k, m) in &self.per_turn {
            out.push((format!("{prefix}/turn_{k}/abs_mean"), m.abs_mean));
            out.push((format!("{prefix}/turn_{k}/k3_mean"), m.k3_mean));
        }
        out
    }
}

/// A row whose per-token lists disagree in length.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "row {row}: {sampled} sampled log-probs, {recomputed} recomputed, {mask} mask entries and \
     {turns} turn ids: each needs one per response token"
)]
pub struct MismatchLengthError {
    /// Index of the row in the batch.
    pub row: usize,
    /// Sampled log-probs given.
    pub sampled: usize,
    /// Recomputed log-probs given.
    pub recomputed: usize,
    /// Mask entries given.
    pub mask: usize,
    /// Turn ids given.
    pub turns: usize,
}

/// The mismatch between the sampled and recomputed log-probs of `rows` (see the module
/// documentation), over their loss tokens. A non-finite log-prob on a loss token counts as
/// an infinite difference (it shows in `abs_max` and the means rather than vanishing).
pub fn logprob_mismatch(rows: &[MismatchRow<'_>]) -> Result<Mismatch, MismatchLengthError> {
    #[derive(Default)]
    struct Sum {
        n: usize,
        abs: f64,
        k3: f64,
    }
    impl Sum {
        fn add(&mut self, abs: f64, k3: f64) {
            self.n += 1;
            self.abs += abs;
            self.k3 += k3;
        }
        fn means(&self) -> MismatchMeans {
            let n = self.n.max(1) as f64;
            MismatchMeans {
                tokens: self.n,
                abs_mean: self.abs / n,
                k3_mean: self.k3 / n,
            }
        }
    }
    let mut all = Sum::default();
    let mut abs_max = 0f64;
    let mut per_turn: BTreeMap<i32, Sum> = BTreeMap::new();
    for (row, r) in rows.iter().enumerate() {
        let n = r.loss_mask.len();
        if r.sampled.len() != n || r.recomputed.len() != n || r.turn_id.len() != n {
            return Err(MismatchLengthError {
                row,
                sampled: r.sampled.len(),
                recomputed: r.recomputed.len(),
                mask: n,
                turns: r.turn_id.len(),
            });
        }
        for t in 0..n {
            if r.loss_mask[t] == 0 {
                continue;
            }
            let delta = f64::from(r.recomputed[t]) - f64::from(r.sampled[t]);
            let (abs, k3) = if delta.is_finite() {
                (delta.abs(), delta.exp() - 1.0 - delta)
            } else {
                (f64::INFINITY, f64::INFINITY)
            };
            abs_max = abs_max.max(abs);
            all.add(abs, k3);
            per_turn.entry(r.turn_id[t]).or_default().add(abs, k3);
        }
    }
    Ok(Mismatch {
        all: all.means(),
        abs_max,
        per_turn: per_turn.iter().map(|(&k, s)| (k, s.means())).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-computed: two rows, turns 0 and 1, an observation token and a masked-out agent
    /// token that must not count.
    #[test]
    fn means_per_batch_and_per_turn_by_hand() {
        let a = MismatchRow {
            sampled: &[-1.0, -2.0, 0.0, -0.5, -3.0],
            recomputed: &[-1.1, -2.0, 5.0, -0.25, -9.0],
            loss_mask: &[1, 1, 0, 1, 0],
            turn_id: &[0, 0, -1, 1, 1],
        };
        let b = MismatchRow {
            sampled: &[-0.7],
            recomputed: &[-0.5],
            loss_mask: &[1],
            turn_id: &[0],
        };
        let m = logprob_mismatch(&[a, b]).unwrap();
        let k3 = |d: f64| d.exp() - 1.0 - d;
        // δ on loss tokens: turn 0: −0.1, 0, +0.2; turn 1: +0.25.
        let d = [
            f64::from(-1.1f32) - f64::from(-1.0f32),
            0.0,
            f64::from(-0.5f32) - f64::from(-0.7f32),
            0.25,
        ];
        assert_eq!(m.all.tokens, 4);
        let abs_all = d.iter().map(|x| x.abs()).sum::<f64>() / 4.0;
        assert!((m.all.abs_mean - abs_all).abs() < 1e-12);
        let k3_all = d.iter().map(|&x| k3(x)).sum::<f64>() / 4.0;
        assert!((m.all.k3_mean - k3_all).abs() < 1e-12);
        assert!((m.abs_max - 0.25).abs() < 1e-12);
        let t0 = m.per_turn[&0];
        assert_eq!(t0.tokens, 3);
        assert!((t0.abs_mean - (d[0].abs() + d[2].abs()) / 3.0).abs() < 1e-12);
        assert!((t0.k3_mean - (k3(d[0]) + k3(d[2])) / 3.0).abs() < 1e-12);
        let t1 = m.per_turn[&1];
        assert_eq!(t1.tokens, 1);
        assert!((t1.k3_mean - k3(0.25)).abs() < 1e-12);
        assert!(
            !m.per_turn.contains_key(&-1),
            "observation tokens are not a turn"
        );
        let names: Vec<String> = m
            .metrics("rollout/logprob_mismatch")
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(
            names,
            [
                "rollout/logprob_mismatch/abs_mean",
                "rollout/logprob_mismatch/abs_max",
                "rollout/logprob_mismatch/k3_mean",
                "rollout/logprob_mismatch/turn_0/abs_mean",
                "rollout/logprob_mismatch/turn_0/k3_mean",
                "rollout/logprob_mismatch/turn_1/abs_mean",
                "rollout/logprob_mismatch/turn_1/k3_mean",
            ]
        );
    }

    /// Equal log-probs give zero mismatch; k3 is never negative.
    #[test]
    fn equal_logprobs_give_zero_and_k3_is_nonnegative() {
        let lp = [-0.3f32, -1.7, -0.01];
        let m = logprob_mismatch(&[MismatchRow {
            sampled: &lp,
            recomputed: &lp,
            loss_mask: &[1, 1, 1],
            turn_id: &[0, 1, 2],
        }])
        .unwrap();
        assert_eq!((m.all.abs_mean, m.all.k3_mean, m.abs_max), (0.0, 0.0, 0.0));
        for d in [-3.0f64, -0.5, -1e-4, 0.0, 1e-4, 0.5, 3.0] {
            let r = logprob_mismatch(&[MismatchRow {
                sampled: &[0.0],
                recomputed: &[d as f32],
                loss_mask: &[1],
                turn_id: &[0],
            }])
            .unwrap();
            assert!(r.all.k3_mean >= 0.0, "k3({d}) = {}", r.all.k3_mean);
        }
        assert!(logprob_mismatch(&[]).unwrap().metrics("p").is_empty());
    }

    #[test]
    fn a_length_mismatch_names_the_row() {
        let ok = MismatchRow {
            sampled: &[0.0],
            recomputed: &[0.0],
            loss_mask: &[1],
            turn_id: &[0],
        };
        let bad = MismatchRow {
            recomputed: &[0.0, 0.0],
            ..ok
        };
        let err = logprob_mismatch(&[ok, bad]).unwrap_err();
        assert_eq!(err.row, 1);
        assert!(
            err.to_string()
                .contains("row 1: 1 sampled log-probs, 2 recomputed")
        );
    }
}
