//! Loss aggregation modes (spec §5.7, verl `agg_loss`).
//!
//! Every mode is a weighted sum of the masked per-token losses with one weight per sequence:
//!
//! ```text
//! token-mean:               W_i = 1 / Σ_{i,t} m                       (global over the mini-batch)
//! seq-mean-token-sum:       W_i = 1 / #{i : Σ_t m > 0}
//! seq-mean-token-mean:      W_i = 1 / ((Σ_t m_i + 1e-8) · #{i : Σ_t m > 0})
//! seq-mean-token-sum-norm:  W_i = 1 / (K · #{i : Σ_t m > 0})          (Dr.GRPO; K = mask width)
//! loss = Σ_{i,t} W_i · m_{i,t} · l_{i,t}
//! ```
//!
//! Fully masked sequences are excluded from the `seq-mean-*` denominators and contribute 0 to
//! `token-mean` (§1.2). `seq-mean-token-sum-norm` is Dr.GRPO's `(1/G) Σ_i Σ_t l / K`: a mean
//! over sequences of their token sums, each divided by the constant K, as verl 0.9.1's `agg_loss`
//! and TRL's `dr_grpo` compute it (review E, R1: without the 1/B the gradient was about B times
//! a token-mean loss's and the grad clip bound on every step). The per-sequence weights are also what the clipping-bias correction and the
//! gradient property tests use: `∂loss/∂l_{i,t} = W_i · m_{i,t}`.

use std::fmt;
use std::str::FromStr;

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use super::{LossError, Result, finite_rows};

/// How per-token losses are reduced to one scalar (§5.7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum LossAggMode {
    /// Σ m·l / Σ m over the whole mini-batch (verl default; GRPO/PPO/DAPO).
    #[default]
    #[serde(rename = "token-mean")]
    TokenMean,
    /// Mean over non-empty sequences of Σ_t m·l.
    #[serde(rename = "seq-mean-token-sum")]
    SeqMeanTokenSum,
    /// Mean over non-empty sequences of Σ_t m·l / (Σ_t m + 1e-8) (GSPO, ATPO, A2TGPO, ST-PPO).
    #[serde(rename = "seq-mean-token-mean")]
    SeqMeanTokenMean,
    /// Mean over non-empty sequences of Σ_t m·l / K with a constant K (Dr.GRPO; K defaults to
    /// the mask width L).
    #[serde(rename = "seq-mean-token-sum-norm")]
    SeqMeanTokenSumNorm,
}

impl LossAggMode {
    /// The verl name of the mode.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::TokenMean => "token-mean",
            Self::SeqMeanTokenSum => "seq-mean-token-sum",
            Self::SeqMeanTokenMean => "seq-mean-token-mean",
            Self::SeqMeanTokenSumNorm => "seq-mean-token-sum-norm",
        }
    }
}

impl fmt::Display for LossAggMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for LossAggMode {
    type Err = LossError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "token-mean" => Ok(Self::TokenMean),
            "seq-mean-token-sum" => Ok(Self::SeqMeanTokenSum),
            "seq-mean-token-mean" => Ok(Self::SeqMeanTokenMean),
            "seq-mean-token-sum-norm" => Ok(Self::SeqMeanTokenSumNorm),
            other => Err(LossError::UnknownAggMode(other.to_string())),
        }
    }
}

/// Mini-batch totals for when one mini-batch is split into several micro-batches (gradient
/// accumulation): with them, summing the micro-batch losses gives exactly the mini-batch loss
/// (\[REC\] §5.7: global token-mean over the mini-batch, not per micro-batch).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AggDenominators {
    /// Σ loss_mask over the whole mini-batch (`token-mean`).
    pub tokens: f64,
    /// Number of sequences with at least one loss token in the mini-batch (`seq-mean-*`).
    pub sequences: f64,
}

/// Options of [`agg_loss`] beyond the mode.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AggOptions {
    /// K of `seq-mean-token-sum-norm` (verl `loss_scale_factor`); `None` = mask width L.
    pub norm_constant: Option<f64>,
    /// Mini-batch totals when aggregating one micro-batch; `None` = this tensor is the mini-batch.
    pub denominators: Option<AggDenominators>,
}

/// The per-sequence weights `W_i` of the module docs, from the mask rows.
pub(crate) fn agg_row_weights(
    mask: &[Vec<f64>],
    mode: LossAggMode,
    opts: &AggOptions,
) -> Result<Vec<f64>> {
    let width = mask.first().map_or(0, Vec::len);
    let row_tokens: Vec<f64> = mask.iter().map(|r| r.iter().sum()).collect();
    let local_tokens: f64 = row_tokens.iter().sum();
    let local_seqs = row_tokens.iter().filter(|&&n| n > 0.0).count() as f64;
    let (tokens, seqs) = match opts.denominators {
        Some(d) => (d.tokens, d.sequences),
        None => (local_tokens, local_seqs),
    };
    // An empty mini-batch has loss 0: any finite positive denominator does.
    let safe = |d: f64| if d > 0.0 { d } else { 1.0 };
    let w = match mode {
        LossAggMode::TokenMean => vec![1.0 / safe(tokens); mask.len()],
        LossAggMode::SeqMeanTokenSum => vec![1.0 / safe(seqs); mask.len()],
        LossAggMode::SeqMeanTokenMean => row_tokens
            .iter()
            .map(|&n| {
                if n > 0.0 {
                    1.0 / ((n + 1e-8) * safe(seqs))
                } else {
                    0.0
                }
            })
            .collect(),
        LossAggMode::SeqMeanTokenSumNorm => {
            let k = opts.norm_constant.unwrap_or(width as f64);
            if !(k > 0.0 && k.is_finite()) {
                return Err(LossError::InvalidConfig(format!(
                    "seq-mean-token-sum-norm needs a positive finite constant K, got {k}"
                )));
            }
            vec![1.0 / (k * safe(seqs)); mask.len()]
        }
    };
    Ok(w)
}

/// Σ_{i,t} W_i · m_{i,t} · l_{i,t} with per-row weights `w` (differentiable in `loss_mat`).
pub(crate) fn weighted_sum(
    loss_mat: &Tensor,
    mask: &Tensor,
    row_weights: &[f64],
    device: &Device,
) -> Result<Tensor> {
    let b = row_weights.len();
    let w = Tensor::from_vec(row_weights.to_vec(), (b, 1), device)?.to_dtype(loss_mat.dtype())?;
    let m = mask.to_dtype(loss_mat.dtype())?;
    Ok(loss_mat.mul(&m)?.broadcast_mul(&w)?.sum_all()?)
}

/// Aggregates a per-token loss matrix `loss_mat` [B, L] under `loss_mask` [B, L] (§5.7).
///
/// Differentiable in `loss_mat`; the mask is a constant. Errors on shape mismatch or non-finite
/// inputs.
pub fn agg_loss(
    loss_mat: &Tensor,
    loss_mask: &Tensor,
    mode: LossAggMode,
    opts: &AggOptions,
) -> Result<Tensor> {
    let name = "agg_loss";
    let lrows = finite_rows(name, "loss_mat", loss_mat, None)?;
    let dims = (lrows.len(), lrows.first().map_or(0, Vec::len));
    let mask = finite_rows(name, "loss_mask", loss_mask, Some(dims))?;
    let w = agg_row_weights(&mask, mode, opts)?;
    weighted_sum(loss_mat, &loss_mask.detach(), &w, loss_mat.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::test_util::{scalar, t2};

    /// §5.7 vector: L = [[1,1,1,·],[4,·,·,·]], masks [[1,1,1,0],[1,0,0,0]].
    fn vector() -> (Tensor, Tensor) {
        let l = t2(&[&[1.0, 1.0, 1.0, 9.0], &[4.0, 7.0, 7.0, 7.0]]);
        let m = t2(&[&[1.0, 1.0, 1.0, 0.0], &[1.0, 0.0, 0.0, 0.0]]);
        (l, m)
    }

    #[test]
    fn spec_5_7_all_modes() {
        let (l, m) = vector();
        let o = AggOptions::default();
        let cases = [
            (LossAggMode::TokenMean, 1.75),
            (LossAggMode::SeqMeanTokenSum, 3.5),
            (LossAggMode::SeqMeanTokenMean, 2.5),
            // Σ m·l = 7 over 2 sequences, K = the mask width 4.
            (LossAggMode::SeqMeanTokenSumNorm, 0.875),
        ];
        for (mode, want) in cases {
            let got = scalar(&agg_loss(&l, &m, mode, &o).unwrap());
            assert!((got - want).abs() < 1e-6, "{mode}: {got} vs {want}");
        }
        let k4 = AggOptions {
            norm_constant: Some(4.0),
            ..AggOptions::default()
        };
        let got = scalar(&agg_loss(&l, &m, LossAggMode::SeqMeanTokenSumNorm, &k4).unwrap());
        assert!((got - 0.875).abs() < 1e-6);
        let k7 = AggOptions {
            norm_constant: Some(7.0),
            ..AggOptions::default()
        };
        let got = scalar(&agg_loss(&l, &m, LossAggMode::SeqMeanTokenSumNorm, &k7).unwrap());
        assert!((got - 0.5).abs() < 1e-6, "1/G: {got}");
    }

    #[test]
    fn fully_masked_sequence_is_excluded() {
        // Third row has no loss token: seq-mean modes still average over 2 sequences.
        let l = t2(&[
            &[1.0, 1.0, 1.0, 9.0],
            &[4.0, 7.0, 7.0, 7.0],
            &[5.0, 5.0, 5.0, 5.0],
        ]);
        let m = t2(&[&[1.0, 1.0, 1.0, 0.0], &[1.0, 0.0, 0.0, 0.0], &[0.0; 4]]);
        let o = AggOptions::default();
        let sm = scalar(&agg_loss(&l, &m, LossAggMode::SeqMeanTokenMean, &o).unwrap());
        assert!((sm - 2.5).abs() < 1e-6);
        let ss = scalar(&agg_loss(&l, &m, LossAggMode::SeqMeanTokenSum, &o).unwrap());
        assert!((ss - 3.5).abs() < 1e-6);
        let tm = scalar(&agg_loss(&l, &m, LossAggMode::TokenMean, &o).unwrap());
        assert!((tm - 1.75).abs() < 1e-6);
        // An all-empty batch aggregates to 0, not NaN.
        let z = t2(&[&[0.0; 4]]);
        let e =
            scalar(&agg_loss(&t2(&[&[3.0; 4]]), &z, LossAggMode::SeqMeanTokenMean, &o).unwrap());
        assert_eq!(e, 0.0);
    }

    #[test]
    fn micro_batch_denominators_sum_to_mini_batch() {
        let (l, m) = vector();
        let d = AggOptions {
            denominators: Some(AggDenominators {
                tokens: 4.0,
                sequences: 2.0,
            }),
            ..AggOptions::default()
        };
        for mode in [LossAggMode::TokenMean, LossAggMode::SeqMeanTokenMean] {
            let full = scalar(&agg_loss(&l, &m, mode, &AggOptions::default()).unwrap());
            let a = scalar(
                &agg_loss(
                    &l.narrow(0, 0, 1).unwrap(),
                    &m.narrow(0, 0, 1).unwrap(),
                    mode,
                    &d,
                )
                .unwrap(),
            );
            let b = scalar(
                &agg_loss(
                    &l.narrow(0, 1, 1).unwrap(),
                    &m.narrow(0, 1, 1).unwrap(),
                    mode,
                    &d,
                )
                .unwrap(),
            );
            assert!((a + b - full).abs() < 1e-9, "{mode}");
        }
    }

    #[test]
    fn names_round_trip_and_unknown_errors() {
        for mode in [
            LossAggMode::TokenMean,
            LossAggMode::SeqMeanTokenSum,
            LossAggMode::SeqMeanTokenMean,
            LossAggMode::SeqMeanTokenSumNorm,
        ] {
            assert_eq!(mode.as_str().parse::<LossAggMode>().unwrap(), mode);
            let js = serde_json::to_string(&mode).unwrap();
            assert_eq!(serde_json::from_str::<LossAggMode>(&js).unwrap(), mode);
        }
        let err = "seq-mean".parse::<LossAggMode>().unwrap_err();
        assert!(err.to_string().contains("seq-mean"));
    }

    #[test]
    fn nan_input_is_named() {
        let (_, m) = vector();
        let l = t2(&[&[1.0, f64::NAN, 1.0, 0.0], &[4.0, 0.0, 0.0, 0.0]]);
        let err = agg_loss(&l, &m, LossAggMode::TokenMean, &AggOptions::default()).unwrap_err();
        assert!(matches!(err, LossError::NonFinite { ref tensor, .. } if tensor == "loss_mat"));
    }
}
