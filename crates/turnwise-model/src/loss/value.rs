//! PPO critic: clipped value loss (spec §5.10, verl `compute_value_loss`) and explained variance
//! (§7 `critic/vf_explained_var`).
//!
//! ```text
//! v_clip  = clip(v_pred, v_old − c_v, v_old + c_v),   c_v = cliprange_value = 0.5
//! vf_loss = 0.5 · agg( max((v_pred − R)², (v_clip − R)²), mask )
//! vf_clipfrac = masked_mean((v_clip − R)² > (v_pred − R)²)
//! ```
//!
//! `vf_clipfrac` counts a token only where the clip binds (`|v_pred − v_old| > c_v`), as the
//! formula does in exact arithmetic: elsewhere `v_old + (v_pred − v_old)` can differ from
//! `v_pred` by rounding, and verl's `torch.gt` then counts a tie as clipped or not by chance
//! (wherever the value has not moved from the rollout's, as in a first mini-batch).

use std::collections::BTreeMap;

use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use turnwise_core::metric_keys as mk;

use super::agg::{AggDenominators, AggOptions, LossAggMode, agg_row_weights, weighted_sum};
use super::{LossError, Result, finite_rows, finite_scalar, masked_mean_rows};

/// Config of the critic loss.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ValueLossConfig {
    /// c_v (default 0.5).
    pub cliprange_value: f64,
    /// Aggregation (default token-mean).
    pub loss_agg_mode: LossAggMode,
}

impl Default for ValueLossConfig {
    fn default() -> Self {
        Self {
            cliprange_value: 0.5,
            loss_agg_mode: LossAggMode::TokenMean,
        }
    }
}

/// Diagnostics of the critic loss.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ValueLossMetrics {
    /// `critic/vf_loss`.
    pub vf_loss: f64,
    /// `critic/vf_clipfrac`.
    pub vf_clipfrac: f64,
    /// `critic/vpred_mean`: masked mean of the predictions.
    pub vpred_mean: f64,
}

impl ValueLossMetrics {
    /// Metrics keyed by their logged names.
    pub fn to_map(&self) -> BTreeMap<String, f64> {
        BTreeMap::from([
            (mk::critic::VF_LOSS.to_string(), self.vf_loss),
            (mk::critic::VF_CLIPFRAC.to_string(), self.vf_clipfrac),
            (mk::critic::VPRED_MEAN.to_string(), self.vpred_mean),
        ])
    }
}

/// Result of [`value_loss`].
#[derive(Debug, Clone)]
pub struct ValueLossOutput {
    /// Scalar loss, differentiable w.r.t. `vpreds`.
    pub loss: Tensor,
    /// Diagnostics.
    pub metrics: ValueLossMetrics,
}

/// Clipped value loss (§5.10). `vpreds` [B, L] are the critic outputs already aligned to the
/// response tokens (value of the state before each token); `old_values`, `returns` are constants.
pub fn value_loss(
    vpreds: &Tensor,
    old_values: &Tensor,
    returns: &Tensor,
    loss_mask: &Tensor,
    cfg: &ValueLossConfig,
    denominators: Option<AggDenominators>,
) -> Result<ValueLossOutput> {
    let name = "value_loss";
    if !(cfg.cliprange_value >= 0.0 && cfg.cliprange_value.is_finite()) {
        return Err(LossError::InvalidConfig(format!(
            "cliprange_value must be finite and ≥ 0, got {}",
            cfg.cliprange_value
        )));
    }
    let v_rows = finite_rows(name, "vpreds", vpreds, None)?;
    let dims = (v_rows.len(), v_rows.first().map_or(0, Vec::len));
    let old_rows = finite_rows(name, "old_values", old_values, Some(dims))?;
    finite_rows(name, "returns", returns, Some(dims))?;
    let mask_rows = finite_rows(name, "loss_mask", loss_mask, Some(dims))?;
    let dtype = vpreds.dtype();
    let old = old_values.detach().to_dtype(dtype)?;
    let ret = returns.detach().to_dtype(dtype)?;
    let mask = loss_mask.detach().to_dtype(dtype)?;

    // v_clip = v_old + clip(v_pred − v_old, −c_v, c_v)
    let c = cfg.cliprange_value;
    let v_clip = old.add(&vpreds.sub(&old)?.clamp(-c, c)?)?;
    let e1 = vpreds.sub(&ret)?.sqr()?;
    let e2 = v_clip.sub(&ret)?.sqr()?;
    let per_token = e1.maximum(&e2)?;
    let opts = AggOptions {
        norm_constant: None,
        denominators,
    };
    let w = agg_row_weights(&mask_rows, cfg.loss_agg_mode, &opts)?;
    let loss = weighted_sum(&per_token, &mask, &w, vpreds.device())?.affine(0.5, 0.0)?;
    let vf_loss = finite_scalar(name, "loss", &loss)?;

    let (e1r, e2r) = (
        e1.to_dtype(candle_core::DType::F64)?.to_vec2::<f64>()?,
        e2.to_dtype(candle_core::DType::F64)?.to_vec2::<f64>()?,
    );
    let clipped: Vec<Vec<f64>> = (0..dims.0)
        .map(|i| {
            (0..dims.1)
                .map(|j| {
                    let binds = (v_rows[i][j] - old_rows[i][j]).abs() > c;
                    f64::from(u8::from(binds && e2r[i][j] > e1r[i][j]))
                })
                .collect()
        })
        .collect();
    Ok(ValueLossOutput {
        loss,
        metrics: ValueLossMetrics {
            vf_loss,
            vf_clipfrac: masked_mean_rows(&clipped, &mask_rows),
            vpred_mean: masked_mean_rows(&v_rows, &mask_rows),
        },
    })
}

/// `critic/vf_explained_var = 1 − Var(R − V) / (Var(R) + 1e-5)` over loss tokens, with unbiased
/// (n − 1) variances as `torch.var`. `None` with fewer than 2 loss tokens.
pub fn explained_variance(
    returns: &[Vec<f64>],
    values: &[Vec<f64>],
    loss_mask: &[Vec<f64>],
) -> Option<f64> {
    let mut r = Vec::new();
    let mut d = Vec::new();
    for ((rr, vr), mr) in returns.iter().zip(values).zip(loss_mask) {
        for ((&ret, &v), &m) in rr.iter().zip(vr).zip(mr) {
            if m > 0.0 {
                r.push(ret);
                d.push(ret - v);
            }
        }
    }
    if r.len() < 2 {
        return None;
    }
    let var = |x: &[f64]| {
        let mean = x.iter().sum::<f64>() / x.len() as f64;
        x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (x.len() - 1) as f64
    };
    Some(1.0 - var(&d) / (var(&r) + 1e-5))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::test_util::{grad_rows, scalar, t2, var2};

    /// §5.10 vectors: v_old 0.5, R 1.0: v_pred 1.2 → 0.02 (clipped); 0.3 → 0.245.
    #[test]
    fn spec_5_10_vectors() {
        let (old, ret, m) = (t2(&[&[0.5]]), t2(&[&[1.0]]), t2(&[&[1.0]]));
        let cfg = ValueLossConfig::default();
        let o = value_loss(&t2(&[&[1.2]]), &old, &ret, &m, &cfg, None).unwrap();
        assert!((scalar(&o.loss) - 0.02).abs() < 1e-6);
        assert_eq!(o.metrics.vf_clipfrac, 0.0); // (1.0 − R)² = 0 < 0.04: max picks the unclipped
        let o = value_loss(&t2(&[&[0.3]]), &old, &ret, &m, &cfg, None).unwrap();
        assert!((scalar(&o.loss) - 0.245).abs() < 1e-6);
        // Clip active: v_pred 1.2, R 3.0 → v_clip 1.0, (1.0 − 3)² = 4 > (1.2 − 3)² = 3.24.
        let o = value_loss(&t2(&[&[1.2]]), &old, &t2(&[&[3.0]]), &m, &cfg, None).unwrap();
        assert_eq!(o.metrics.vf_clipfrac, 1.0);
        assert!((scalar(&o.loss) - 0.5 * 4.0).abs() < 1e-9);
    }

    /// A value that moved less than the clip range is never counted as clipped, even where
    /// `v_old + (v_pred − v_old)` rounds away from `v_pred` (here to 0: v_pred 1e-20, v_old 0.3)
    /// and the "clipped" loss comes out larger; one that moved past it still is.
    #[test]
    fn clipfrac_counts_only_where_the_clip_binds() {
        let cfg = ValueLossConfig::default();
        let m = t2(&[&[1.0, 1.0]]);
        let o = value_loss(
            &t2(&[&[1e-20, 1.0]]),
            &t2(&[&[0.3, 0.3]]),
            &t2(&[&[2e-20, 2.0]]),
            &m,
            &cfg,
            None,
        )
        .unwrap();
        // Token 0: |Δ| = 0.3 ≤ 0.5, not clipped although (0 − 2e-20)² > (1e-20 − 2e-20)².
        // Token 1: |Δ| = 0.7 > 0.5, v_clip 0.8, (0.8 − 2)² = 1.44 > (1 − 2)² = 1: clipped.
        assert_eq!(o.metrics.vf_clipfrac, 0.5);
    }

    #[test]
    fn gradient_and_mask() {
        let v = var2(&[&[0.3, 9.0]]);
        let o = value_loss(
            v.as_tensor(),
            &t2(&[&[0.5, 0.0]]),
            &t2(&[&[1.0, 0.0]]),
            &t2(&[&[1.0, 0.0]]),
            &ValueLossConfig::default(),
            None,
        )
        .unwrap();
        assert!((scalar(&o.loss) - 0.245).abs() < 1e-9);
        let g = grad_rows(&o.loss, &v);
        // d/dv 0.5 (v − R)² = v − R = −0.7 (both branches equal → split, summed back).
        assert!((g[0][0] + 0.7).abs() < 1e-9 && g[0][1] == 0.0);
        let err = value_loss(
            &t2(&[&[f64::NAN]]),
            &t2(&[&[0.0]]),
            &t2(&[&[0.0]]),
            &t2(&[&[1.0]]),
            &ValueLossConfig::default(),
            None,
        )
        .unwrap_err();
        assert!(err.to_string().contains("vpreds"));
    }

    #[test]
    fn explained_variance_matches_definition() {
        let r = vec![vec![1.0, 2.0, 3.0, 100.0]];
        let v = vec![vec![1.0, 2.0, 3.0, 0.0]];
        let m = vec![vec![1.0, 1.0, 1.0, 0.0]];
        assert!((explained_variance(&r, &v, &m).unwrap() - 1.0).abs() < 1e-12);
        let zero = vec![vec![0.0; 4]];
        // V = 0: Var(R − V) = Var(R) = 1 → 1 − 1/(1 + 1e-5).
        assert!(
            (explained_variance(&r, &zero, &m).unwrap() - (1.0 - 1.0 / (1.0 + 1e-5))).abs() < 1e-12
        );
        assert_eq!(
            explained_variance(&r, &v, &[vec![1.0, 0.0, 0.0, 0.0]]),
            None
        );
        let c: ValueLossConfig = serde_json::from_str(r#"{"cliprange_value":0.2}"#).unwrap();
        assert_eq!(c.loss_agg_mode, LossAggMode::TokenMean);
        assert!(serde_json::from_str::<ValueLossConfig>(r#"{"clip":0.2}"#).is_err());
    }
}
