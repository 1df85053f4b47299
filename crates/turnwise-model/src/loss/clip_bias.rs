//! Clipping-bias correction of S-PPO, ST-PPO and S-GRPO (spec §5.6, st-ppo.md §4.2 eq. 6–10).
//!
//! ```text
//! B^c = {t : (Â_t > 0 ∧ w_t > hi_t) ∨ (Â_t < 0 ∧ w_t < lo_t)}          clipping active
//! c_{i,t} = (1/B)·(1/|y_i|)·1[t ∈ B^c]·w_t·Â_t                          (all factors detached)
//! ```
//!
//! `w` is the token ratio (S-PPO, S-GRPO, and ST-PPO by default: st-ppo.md Alg. 1 computes "the
//! clipping-error norm" with token-level importance sampling) or the loss's own ratio
//! (`ratio = "loss"`: ST-PPO's turn ratio, eq. 7 read literally); `[lo_t, hi_t]` are the clip
//! bounds for that ratio. B is the number of non-empty sequences and |y_i| the loss-token count
//! of sequence i.
//!
//! Two rules turn `C` into the update:
//!
//! - **`downweight`** (default): turnwise's down-weighting reading of the paper's prose
//!   ("reweights each sampled generation according to its clipping error … downweights highly
//!   off-policy or risk-prone samples", §4.2), not eq. 7/8. Each sample's *clipping error* is
//!   the share of its importance-weighted advantage vector that lies outside the trust region,
//!   `ρ_i = ‖C_i‖₂ / ‖G_i‖₂ ∈ [0, 1]` with `G_i = (1/|y_i|)·w_t·Â_t` over all its loss tokens and
//!   `C_i` its clipped part; the sample's loss row is weighted by `s_i = 1 − ρ_i ≤ 1` (1 when
//!   nothing is clipped, 0 when all of it is), and nothing else is scaled: the trainer applies
//!   the gradient of `Σ_i s_i·loss_i` at the run's lr (see `turnwise::update`).
//!
//!   What survives AdamW (β1 0.9, β2 0.95): the *mix*. Within a mini-batch the weights set how
//!   much each sample pulls on the coordinates the samples share, so the update leans away from
//!   clipped samples. What does not: a *step size*. Adam divides each coordinate by its recent
//!   RMS and so cancels a factor constant over time (a weight on coordinates only its own
//!   sample reaches, or a common factor on every gradient); a mini-batch's mean weight `s̄`
//!   therefore does not make its step `s̄` times smaller. (Before issue 49 the trainer divided
//!   the gradient by `s̄` and stepped at `lr·s̄`, claiming a per-sample gradient `s_i·∇J_i`
//!   under AdamW; with β1 = 0.9 the moments carried the `÷ s̄` gradient into later full-lr
//!   steps, so that claim was false, and the scaling is gone.) `s̄` over the rows with
//!   `G_i ≠ 0` is logged as `actor/clip_bias_scale`.
//! - **`inverse_norm`**: eq. 7/8 literally: `scale = 1/‖C‖₂` (1 when ‖C‖₂ < τ, optionally capped at
//!   `max_scale`) multiplies the mini-batch loss. Kept to reproduce the formula; in training it is
//!   ≥ 1 (≈ B·|y| for one clipped token) and the gradient-norm clip plus Adam erase it (training-path
//!   review D, X1), so no preset uses it.
//!
//! \[UNVERIFIED\] the papers do not say what the norm is taken over; for `inverse_norm`, \[REC\]
//! mini-batch scope by default (eq. 7 literal), optional per-sample scope (each sample's loss
//! scaled by the inverse norm of its own components), and two spaces: `token` (default; `C` as
//! above) and `grad`: the norm of the parameter gradient of the clipped-token surrogate
//! `S(θ) = Σ_t c-weight_t·1[t∈B^c]·w_t(θ)·Â_t` ([`clip_bias_grad_norm`]), which costs one extra
//! backward pass through the model and needs the parameters (`PolicyLossInput::with_params`); it
//! supports the mini-batch scope only.

use candle_core::{DType, Tensor, Var};
use serde::{Deserialize, Serialize};

use super::{LossError, Result};

/// What one clipping-bias norm is taken over (§5.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClipBiasScope {
    /// One norm over all tokens of the mini-batch; one scale for the mini-batch loss (default).
    #[default]
    Minibatch,
    /// One norm and one scale per sample ("reweights each sampled generation").
    PerSample,
}

/// In which space `C` lives (§5.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClipBiasSpace {
    /// Token space: `C` indexed by tokens (Lemma 4.2 is stated for ∂J/∂log π).
    #[default]
    Token,
    /// Parameter-gradient space: ‖∇_θ S‖₂ of the clipped-token surrogate (one extra backward).
    Grad,
}

/// How the clipping error changes the update (§5.6; see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClipBiasRule {
    /// Per-sample loss weights `1 − ‖C_i‖/‖G_i‖ ≤ 1` (turnwise's reading; no step scaling).
    #[default]
    Downweight,
    /// The loss times `1/‖C‖₂` (eq. 7/8 literally; erased by a gradient-norm clip and Adam).
    InverseNorm,
}

/// Which importance ratio the clipping error is computed with (§5.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClipBiasRatio {
    /// The token ratio and the token clip bounds `[1 − ε_low, 1 + ε_high]` (st-ppo.md Alg. 1:
    /// "use token-level importance sampling to compute the clipping-error norm").
    #[default]
    Token,
    /// The ratio and bounds the loss clips (ST-PPO's turn ratio: eq. 7 read literally).
    Loss,
}

/// Configuration of the clipping-bias correction (§5.6).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClipBiasConfig {
    /// How the clipping error changes the update, default `downweight`.
    pub rule: ClipBiasRule,
    /// Which ratio the clipping error uses, default `token`.
    pub ratio: ClipBiasRatio,
    /// Norm scope (`clip_bias_norm_scope`) of `inverse_norm`, default `minibatch`.
    pub norm_scope: ClipBiasScope,
    /// Norm space (`clip_bias_norm_space`) of `inverse_norm`, default `token`.
    pub norm_space: ClipBiasSpace,
    /// Zero-clipping guard τ of `inverse_norm`: scale = 1 when ‖C‖₂ < τ (default 1e-8).
    pub tau: f64,
    /// Optional cap on the `inverse_norm` scale.
    pub max_scale: Option<f64>,
}

impl Default for ClipBiasConfig {
    fn default() -> Self {
        Self {
            rule: ClipBiasRule::Downweight,
            ratio: ClipBiasRatio::Token,
            norm_scope: ClipBiasScope::Minibatch,
            norm_space: ClipBiasSpace::Token,
            tau: 1e-8,
            max_scale: None,
        }
    }
}

impl ClipBiasConfig {
    /// Checks value ranges.
    pub fn validate(&self) -> Result<()> {
        if !(self.tau >= 0.0 && self.tau.is_finite()) {
            return Err(LossError::InvalidConfig(format!(
                "clip_bias.tau must be finite and ≥ 0, got {}",
                self.tau
            )));
        }
        if self.norm_space == ClipBiasSpace::Grad && self.norm_scope == ClipBiasScope::PerSample {
            return Err(LossError::InvalidConfig(
                "clip_bias: norm_space = grad supports norm_scope = minibatch only".to_string(),
            ));
        }
        if let Some(m) = self.max_scale
            && !(m > 0.0 && m.is_finite())
        {
            return Err(LossError::InvalidConfig(format!(
                "clip_bias.max_scale must be finite and > 0, got {m}"
            )));
        }
        if self.rule == ClipBiasRule::Downweight {
            let defaults = Self::default();
            let set = [
                ("norm_scope", self.norm_scope != defaults.norm_scope),
                ("norm_space", self.norm_space != defaults.norm_space),
                ("max_scale", self.max_scale.is_some()),
                ("tau", self.tau != defaults.tau),
            ];
            if let Some((key, _)) = set.iter().find(|(_, on)| *on) {
                return Err(LossError::InvalidConfig(format!(
                    "clip_bias.{key} applies to rule = \"inverse_norm\" only; \
                     rule = \"downweight\" weights each sample by 1 − ‖C_i‖/‖G_i‖"
                )));
            }
        }
        Ok(())
    }

    /// The scale for a norm: 1 below τ, else 1/norm, capped at `max_scale`.
    pub fn scale_of(&self, norm: f64) -> f64 {
        let s = if norm < self.tau { 1.0 } else { 1.0 / norm };
        match self.max_scale {
            Some(m) => s.min(m),
            None => s,
        }
    }
}

/// The clipping-bias vector, its norm and the resulting loss scale(s) (§5.6, §7).
#[derive(Debug, Clone, PartialEq)]
pub struct ClipBiasResult {
    /// Components `c_{i,t}` (0 on unclipped and non-loss tokens), [B, L].
    pub components: Vec<Vec<f64>>,
    /// ‖C‖₂ over the mini-batch (logged whatever the scope).
    pub norm: f64,
    /// Mini-batch scale (`minibatch` scope; 1 for `per_sample`).
    pub scale: f64,
    /// Per-sample scales (`per_sample` scope; all 1 for `minibatch`).
    pub sample_scales: Vec<f64>,
    /// Number of loss tokens in the clipped set B^c with a non-zero advantage.
    pub n_clipped: usize,
    /// Per-sample clipping errors `ρ_i = ‖C_i‖₂/‖G_i‖₂ ∈ [0, 1]` (0 for a sample without loss
    /// tokens or with a zero surrogate).
    pub sample_errors: Vec<f64>,
    /// Per sample: its surrogate `G_i` is non-zero (some loss token with `w·Â ≠ 0`), so its
    /// weight changes the gradient; false for a row of zero advantages or without loss tokens.
    pub sample_signal: Vec<bool>,
}

impl ClipBiasResult {
    /// The `downweight` rule's per-sample loss weights `s_i = 1 − ρ_i` (each in [0, 1]).
    pub fn sample_weights(&self) -> Vec<f64> {
        self.sample_errors.iter().map(|r| 1.0 - r).collect()
    }
}

/// Computes the clipping-bias correction from detached rows (§5.6).
///
/// `ratio` is the ratio the loss clips (token or turn ratio), `lo`/`hi` the per-token clip bounds.
pub fn clip_bias(
    ratio: &[Vec<f64>],
    adv: &[Vec<f64>],
    mask: &[Vec<f64>],
    lo: &[Vec<f64>],
    hi: &[Vec<f64>],
    cfg: &ClipBiasConfig,
) -> ClipBiasResult {
    let row_tokens: Vec<f64> = mask.iter().map(|r| r.iter().sum()).collect();
    let n_seq = row_tokens.iter().filter(|&&n| n > 0.0).count().max(1) as f64;
    let mut n_clipped = 0usize;
    let mut sample_errors = vec![0.0; mask.len()];
    let mut sample_signal = vec![false; mask.len()];
    // Per-sample components without the 1/B factor.
    let mut sample: Vec<Vec<f64>> = Vec::with_capacity(mask.len());
    for i in 0..mask.len() {
        let mut row = vec![0.0; mask[i].len()];
        // ‖G_i‖² (all loss tokens) and ‖C_i‖² (the clipped ones), without the 1/|y_i| factor,
        // which cancels in their ratio.
        let (mut all_sq, mut clipped_sq) = (0.0, 0.0);
        if row_tokens[i] > 0.0 {
            for t in 0..row.len() {
                if mask[i][t] <= 0.0 {
                    continue;
                }
                let (w, a) = (ratio[i][t], adv[i][t]);
                all_sq += (w * a).powi(2);
                let clipped = (a > 0.0 && w > hi[i][t]) || (a < 0.0 && w < lo[i][t]);
                if clipped {
                    n_clipped += 1;
                    clipped_sq += (w * a).powi(2);
                    row[t] = w * a / row_tokens[i];
                }
            }
        }
        if all_sq > 0.0 {
            sample_errors[i] = (clipped_sq / all_sq).sqrt().min(1.0);
            sample_signal[i] = true;
        }
        sample.push(row);
    }
    let components: Vec<Vec<f64>> = sample
        .iter()
        .map(|r| r.iter().map(|c| c / n_seq).collect())
        .collect();
    let norm = components
        .iter()
        .flatten()
        .map(|c| c * c)
        .sum::<f64>()
        .sqrt();
    let (scale, sample_scales) = match cfg.norm_scope {
        ClipBiasScope::Minibatch => (cfg.scale_of(norm), vec![1.0; mask.len()]),
        ClipBiasScope::PerSample => (
            1.0,
            sample
                .iter()
                .map(|r| cfg.scale_of(r.iter().map(|c| c * c).sum::<f64>().sqrt()))
                .collect(),
        ),
    };
    ClipBiasResult {
        components,
        norm,
        scale,
        sample_scales,
        n_clipped,
        sample_errors,
        sample_signal,
    }
}

/// ‖∇_θ S‖₂ for the clipped-token surrogate `S = Σ_{i,t} c_{i,t}/w_{i,t} · w_{i,t}(θ)`, i.e.
/// `Σ (1/B)(1/|y_i|)·1[clipped]·Â·w(θ)` with the detached weights of `result` (§5.6, grad space).
///
/// `ratio` is the differentiable ratio the loss clipped ([B, L]); `ratio_rows` its values. The
/// gradient is taken w.r.t. `params` (tensors of [`candle_core::Var`]s); parameters the surrogate
/// does not reach contribute 0.
pub fn clip_bias_grad_norm(
    ratio: &Tensor,
    ratio_rows: &[Vec<f64>],
    result: &ClipBiasResult,
    params: &[Var],
) -> Result<f64> {
    // Weight per token = c_{i,t} / w_{i,t} = (1/B)(1/|y_i|)·1[clipped]·Â (detached).
    let weights: Vec<f64> = result
        .components
        .iter()
        .zip(ratio_rows)
        .flat_map(|(c, w)| {
            c.iter()
                .zip(w)
                .map(|(c, w)| if *c == 0.0 { 0.0 } else { c / w })
        })
        .collect();
    let weights =
        Tensor::from_vec(weights, ratio.dims(), ratio.device())?.to_dtype(ratio.dtype())?;
    let surrogate = ratio.mul(&weights)?.sum_all()?;
    let grads = surrogate.backward()?;
    let mut sq = 0.0;
    for p in params {
        if let Some(g) = grads.get(p.as_tensor()) {
            sq += g
                .to_dtype(DType::F64)?
                .sqr()?
                .sum_all()?
                .to_scalar::<f64>()?;
        }
    }
    Ok(sq.sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::test_util::assert_close;

    type Rows = Vec<Vec<f64>>;

    /// §5.6 vector: logr [0.3, 0.0, −0.1, ·, ·, −0.4, 0.05], Â [1, 1, 1, ·, ·, −1, −1], ε = 0.2.
    fn spec_rows() -> (Rows, Rows, Rows) {
        let logr = vec![vec![0.3, 0.0, -0.1, 0.0, 0.0, -0.4, 0.05]];
        let adv = vec![vec![1.0, 1.0, 1.0, 0.0, 0.0, -1.0, -1.0]];
        let mask = vec![vec![1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]];
        (logr, adv, mask)
    }

    #[test]
    fn spec_5_6_token_space_vector() {
        let (logr, adv, mask) = spec_rows();
        let w: Vec<Vec<f64>> = logr
            .iter()
            .map(|r| r.iter().map(|v| v.exp()).collect())
            .collect();
        assert_close(
            &w[0],
            &[1.349859, 1.0, 0.904837, 1.0, 1.0, 0.67032, 1.051271],
            1e-6,
        );
        let lo = vec![vec![0.8; 7]];
        let hi = vec![vec![1.2; 7]];
        let r = clip_bias(&w, &adv, &mask, &lo, &hi, &ClipBiasConfig::default());
        assert_close(
            &r.components[0],
            &[0.269972, 0.0, 0.0, 0.0, 0.0, -0.134064, 0.0],
            1e-6,
        );
        assert!((r.norm - 0.301426).abs() < 1e-6);
        assert!((r.scale - 3.317559).abs() < 1e-6);
        assert_eq!(r.n_clipped, 2);
    }

    /// `downweight` on the §5.6 vector: ρ = ‖C‖/‖G‖ with G = w·Â/|y| over all 5 loss tokens
    /// (‖G‖² = 5.195349/25, ‖C‖² = 2.271448/25), so ρ = 0.661217 and the weight 0.338783; an
    /// unclipped copy keeps weight 1, a row without loss tokens error 0.
    #[test]
    fn downweight_sample_errors_on_the_spec_vector() {
        let (logr, adv, mask) = spec_rows();
        let w0: Vec<f64> = logr[0].iter().map(|v| v.exp()).collect();
        let w = vec![w0, vec![1.0; 7], vec![1.5; 7]];
        let adv = vec![adv[0].clone(), adv[0].clone(), adv[0].clone()];
        let mask = vec![mask[0].clone(), mask[0].clone(), vec![0.0; 7]];
        let (lo, hi) = (vec![vec![0.8; 7]; 3], vec![vec![1.2; 7]; 3]);
        let r = clip_bias(&w, &adv, &mask, &lo, &hi, &ClipBiasConfig::default());
        assert_close(&r.sample_errors, &[0.661217, 0.0, 0.0], 1e-6);
        assert_close(&r.sample_weights(), &[0.338783, 1.0, 1.0], 1e-6);
        assert_eq!(r.n_clipped, 2);
    }

    /// A zero advantage is never "clipped" (it adds nothing to C), so it is not counted.
    #[test]
    fn zero_advantage_tokens_are_not_counted_as_clipped() {
        let w = vec![vec![1.5, 1.5]];
        let adv = vec![vec![0.0, 1.0]];
        let mask = vec![vec![1.0, 1.0]];
        let (lo, hi) = (vec![vec![0.8; 2]], vec![vec![1.2; 2]]);
        let r = clip_bias(&w, &adv, &mask, &lo, &hi, &ClipBiasConfig::default());
        assert_eq!(r.n_clipped, 1);
        assert_close(&r.sample_errors, &[1.0], 1e-12);
    }

    #[test]
    fn downweight_refuses_the_inverse_norm_settings() {
        for bad in [
            ClipBiasConfig {
                max_scale: Some(2.0),
                ..ClipBiasConfig::default()
            },
            ClipBiasConfig {
                norm_scope: ClipBiasScope::PerSample,
                ..ClipBiasConfig::default()
            },
            ClipBiasConfig {
                tau: 1e-3,
                ..ClipBiasConfig::default()
            },
        ] {
            let e = bad.validate().unwrap_err().to_string();
            assert!(e.contains("inverse_norm"), "{e}");
            let ok = ClipBiasConfig {
                rule: ClipBiasRule::InverseNorm,
                ..bad
            };
            ok.validate().unwrap();
        }
    }

    #[test]
    fn zero_clip_guard_and_cap() {
        let (_, adv, mask) = spec_rows();
        let w = vec![vec![1.0; 7]];
        let lo = vec![vec![0.8; 7]];
        let hi = vec![vec![1.2; 7]];
        let r = clip_bias(&w, &adv, &mask, &lo, &hi, &ClipBiasConfig::default());
        assert_eq!((r.norm, r.scale, r.n_clipped), (0.0, 1.0, 0));
        let (logr, ..) = spec_rows();
        let w: Vec<Vec<f64>> = logr
            .iter()
            .map(|r| r.iter().map(|v| v.exp()).collect())
            .collect();
        let capped = ClipBiasConfig {
            max_scale: Some(2.0),
            ..ClipBiasConfig::default()
        };
        assert_eq!(clip_bias(&w, &adv, &mask, &lo, &hi, &capped).scale, 2.0);
        let big_tau = ClipBiasConfig {
            tau: 1.0,
            ..ClipBiasConfig::default()
        };
        assert_eq!(clip_bias(&w, &adv, &mask, &lo, &hi, &big_tau).scale, 1.0);
    }

    #[test]
    fn per_sample_scope() {
        // Two copies of the spec sequence plus one unclipped sequence.
        let (logr, adv, mask) = spec_rows();
        let w0: Vec<f64> = logr[0].iter().map(|v| v.exp()).collect();
        let w = vec![w0.clone(), w0, vec![1.0; 7]];
        let adv = vec![adv[0].clone(), adv[0].clone(), adv[0].clone()];
        let mask = vec![mask[0].clone(), mask[0].clone(), mask[0].clone()];
        let lo = vec![vec![0.8; 7]; 3];
        let hi = vec![vec![1.2; 7]; 3];
        let cfg = ClipBiasConfig {
            norm_scope: ClipBiasScope::PerSample,
            ..ClipBiasConfig::default()
        };
        let r = clip_bias(&w, &adv, &mask, &lo, &hi, &cfg);
        assert_close(&r.sample_scales, &[3.317559, 3.317559, 1.0], 1e-6);
        assert_eq!(r.scale, 1.0);
        // Mini-batch norm: components carry 1/B = 1/3.
        assert!((r.norm - 0.301426 * 2f64.sqrt() / 3.0).abs() < 1e-6);
    }

    #[test]
    fn config_serde_and_validation() {
        let c: ClipBiasConfig = serde_json::from_str(
            r#"{"rule":"inverse_norm","ratio":"loss","norm_scope":"per_sample","max_scale":10.0}"#,
        )
        .unwrap();
        assert_eq!(c.norm_scope, ClipBiasScope::PerSample);
        assert_eq!(
            (c.rule, c.ratio),
            (ClipBiasRule::InverseNorm, ClipBiasRatio::Loss)
        );
        c.validate().unwrap();
        let d: ClipBiasConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(
            (d.rule, d.ratio),
            (ClipBiasRule::Downweight, ClipBiasRatio::Token)
        );
        assert_eq!(c.tau, 1e-8);
        assert!(serde_json::from_str::<ClipBiasConfig>(r#"{"nope":1}"#).is_err());
        assert!(ClipBiasConfig { tau: -1.0, ..c }.validate().is_err());
        assert!(
            ClipBiasConfig {
                max_scale: Some(0.0),
                ..c
            }
            .validate()
            .is_err()
        );
    }
}
