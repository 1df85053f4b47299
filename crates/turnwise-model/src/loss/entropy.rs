//! Entropy from full logits and the entropy bonus (spec §5.9).
//!
//! ```text
//! H(π(·|s_t)) = logsumexp(z) − Σ_v softmax(z)_v · z_v
//! loss = pg_loss − entropy_coeff · agg(H, mask)
//! ```
//!
//! Built from differentiable candle ops only (no `softmax_last_dim`, which has no backward — see
//! `shared/notes/candle-on-this-machine.md`).

use candle_core::{D, Tensor};

use super::agg::{AggOptions, LossAggMode, agg_loss};
use super::{LossError, Result};

/// Per-token entropy [B, L] of the distributions given by `logits` [B, L, V]; differentiable.
///
/// Uses a detached row maximum for stability: `z = logits − sg[max]`, `H = log Σ e^z − Σ p z`.
pub fn entropy_from_logits(logits: &Tensor) -> Result<Tensor> {
    if logits.rank() != 3 {
        return Err(LossError::Shape {
            loss: "entropy".to_string(),
            tensor: "logits".to_string(),
            got: logits.dims().to_vec(),
            expected: "[B, L, V]".to_string(),
        });
    }
    let m = logits.max_keepdim(D::Minus1)?.detach();
    let z = logits.broadcast_sub(&m)?;
    let e = z.exp()?;
    let s = e.sum_keepdim(D::Minus1)?;
    let p = e.broadcast_div(&s)?;
    let lse = s.log()?.squeeze(D::Minus1)?;
    Ok(lse.sub(&p.mul(&z)?.sum(D::Minus1)?)?)
}

/// The entropy bonus `agg(H, mask)` (§5.9); the actor loss subtracts `entropy_coeff` times it.
pub fn entropy_bonus(
    entropy: &Tensor,
    loss_mask: &Tensor,
    mode: LossAggMode,
    opts: &AggOptions,
) -> Result<Tensor> {
    agg_loss(entropy, loss_mask, mode, opts).map_err(|e| match e {
        LossError::NonFinite {
            tensor,
            count,
            total,
            ..
        } => LossError::NonFinite {
            loss: "entropy_bonus".to_string(),
            tensor: if tensor == "loss_mat" {
                "entropy".to_string()
            } else {
                tensor
            },
            count,
            total,
        },
        other => other,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::test_util::{assert_close, rows, scalar, t2};
    use candle_core::{Device, Var};

    #[test]
    fn entropy_matches_closed_form_and_spec_6_2() {
        // Entropy of [0.7, 0.2, 0.05, 0.05] = 0.871133 (§6.2); shifting logits changes nothing.
        let p = [0.7f64, 0.2, 0.05, 0.05];
        let z: Vec<f64> = p.iter().map(|v| v.ln() + 3.0).collect();
        let uniform = vec![0.0; 4];
        let flat: Vec<f64> = z.iter().chain(&uniform).copied().collect();
        let logits = Tensor::from_vec(flat, (1, 2, 4), &Device::Cpu).unwrap();
        let h = entropy_from_logits(&logits).unwrap();
        assert_close(&rows(&h)[0], &[0.871133, 4f64.ln()], 1e-6);
    }

    #[test]
    fn entropy_gradient_matches_analytic() {
        // ∂H/∂z_j = −p_j (log p_j + H)
        let z = [0.3f64, -1.2, 2.0];
        let v = Var::from_tensor(&Tensor::from_vec(z.to_vec(), (1, 1, 3), &Device::Cpu).unwrap())
            .unwrap();
        let h = entropy_from_logits(v.as_tensor()).unwrap();
        let g = h.sum_all().unwrap().backward().unwrap();
        let got = g
            .get(v.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        let zs: f64 = z.iter().map(|v| v.exp()).sum();
        let p: Vec<f64> = z.iter().map(|v| v.exp() / zs).collect();
        let hv: f64 = -p.iter().map(|q| q * q.ln()).sum::<f64>();
        let want: Vec<f64> = p.iter().map(|q| -q * (q.ln() + hv)).collect();
        assert_close(&got, &want, 1e-9);
    }

    #[test]
    fn bonus_aggregates_masked_entropy() {
        let h = t2(&[&[1.0, 3.0, 100.0]]);
        let m = t2(&[&[1.0, 1.0, 0.0]]);
        let b = entropy_bonus(&h, &m, LossAggMode::TokenMean, &AggOptions::default()).unwrap();
        assert!((scalar(&b) - 2.0).abs() < 1e-12);
        let bad = t2(&[&[f64::NAN, 3.0, 1.0]]);
        let err =
            entropy_bonus(&bad, &m, LossAggMode::TokenMean, &AggOptions::default()).unwrap_err();
        assert!(err.to_string().contains("entropy_bonus") && err.to_string().contains("`entropy`"));
        assert!(entropy_from_logits(&h).is_err());
    }
}
