//! KL penalty against a reference policy (spec §5.8, verl `kl_penalty`).
//!
//! ```text
//! k1 / "kl":          logp − ref_logp
//! "abs":              |logp − ref_logp|
//! k2 / "mse":         0.5 (logp − ref_logp)^2
//! k3 / "low_var_kl":  r = clamp(ref_logp − logp, ±20);  clamp(exp(r) − r − 1, −10, 10)
//! "<name>+":          value of <name>, gradient of k2 (straight-through)
//! ```
//!
//! Two uses: KL in the loss, `loss += kl_coef · agg(k(logp, ref), mask)` ([`kl_loss`], on
//! tensors), and KL in the reward, `token_reward −= β · k1(old_logp, ref_logp)` on loss tokens
//! ([`apply_kl_in_reward`], plain f64) with a fixed or adaptive controller for β.

use std::fmt;
use std::str::FromStr;

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use super::agg::{AggOptions, LossAggMode, agg_loss};
use super::{LossError, Result, check_finite_values, finite_rows};

/// The KL estimator (§5.8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KlEstimator {
    /// k1 = logp − ref_logp (`kl`, `k1`).
    K1,
    /// |logp − ref_logp| (`abs`).
    Abs,
    /// k2 = ½ (logp − ref_logp)² (`mse`, `k2`).
    K2,
    /// k3 = exp(r) − r − 1 with r = ref_logp − logp (`low_var_kl`, `k3`).
    K3,
}

impl KlEstimator {
    /// The value of the estimator on plain numbers (same clamps as the tensor form).
    pub fn value(self, logp: f64, ref_logp: f64) -> f64 {
        let d = logp - ref_logp;
        match self {
            Self::K1 => d,
            Self::Abs => d.abs(),
            Self::K2 => 0.5 * d * d,
            Self::K3 => {
                let r = (-d).clamp(-20.0, 20.0);
                (r.exp() - r - 1.0).clamp(-10.0, 10.0)
            }
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::K1 => "kl",
            Self::Abs => "abs",
            Self::K2 => "mse",
            Self::K3 => "low_var_kl",
        }
    }
}

/// A KL penalty: estimator plus the straight-through ("+") flag (§5.8). Parses and serializes as
/// its verl name (`"low_var_kl"`, `"k3+"`, …).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct KlPenalty {
    /// The estimator whose value is used.
    pub estimator: KlEstimator,
    /// `"<name>+"`: forward value of the estimator, gradient of k2.
    pub straight_through: bool,
}

impl KlPenalty {
    /// A penalty without straight-through.
    pub fn new(estimator: KlEstimator) -> Self {
        Self {
            estimator,
            straight_through: false,
        }
    }
}

impl Default for KlPenalty {
    /// `low_var_kl` (the GRPO baselines' choice, §5.8).
    fn default() -> Self {
        Self::new(KlEstimator::K3)
    }
}

impl FromStr for KlPenalty {
    type Err = LossError;

    fn from_str(s: &str) -> Result<Self> {
        let (base, straight_through) = match s.strip_suffix('+') {
            Some(b) => (b, true),
            None => (s, false),
        };
        let estimator = match base {
            "kl" | "k1" => KlEstimator::K1,
            "abs" => KlEstimator::Abs,
            "mse" | "k2" => KlEstimator::K2,
            "low_var_kl" | "k3" => KlEstimator::K3,
            _ => return Err(LossError::UnknownKlPenalty(s.to_string())),
        };
        Ok(Self {
            estimator,
            straight_through,
        })
    }
}

impl TryFrom<String> for KlPenalty {
    type Error = LossError;

    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl From<KlPenalty> for String {
    fn from(p: KlPenalty) -> Self {
        p.to_string()
    }
}

impl fmt::Display for KlPenalty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.estimator.name())?;
        if self.straight_through {
            f.write_str("+")
        } else {
            Ok(())
        }
    }
}

/// Per-token KL penalty [B, L] (§5.8); differentiable w.r.t. `logp`, `ref_logp` is a constant.
pub fn kl_penalty(logp: &Tensor, ref_logp: &Tensor, penalty: KlPenalty) -> Result<Tensor> {
    let diff = logp.sub(&ref_logp.detach().to_dtype(logp.dtype())?)?;
    let forward = match penalty.estimator {
        KlEstimator::K1 => diff.clone(),
        KlEstimator::Abs => diff.abs()?,
        KlEstimator::K2 => diff.sqr()?.affine(0.5, 0.0)?,
        KlEstimator::K3 => {
            // r = ref − logp, clamped to ±20 before exp; result clamped to [−10, 10]
            let r = diff.neg()?.clamp(-20.0, 20.0)?;
            r.exp()?.sub(&r)?.affine(1.0, -1.0)?.clamp(-10.0, 10.0)?
        }
    };
    if !penalty.straight_through || penalty.estimator == KlEstimator::K2 {
        return Ok(forward);
    }
    // Straight-through: k2 − sg[k2] + sg[forward]
    let k2 = diff.sqr()?.affine(0.5, 0.0)?;
    Ok(k2.sub(&k2.detach())?.add(&forward.detach())?)
}

/// KL in the loss: `agg(k(logp, ref), mask)` (§5.8); the caller multiplies by `kl_coef`.
///
/// Errors name `kl_loss` and the offending tensor on NaN/inf.
pub fn kl_loss(
    logp: &Tensor,
    ref_logp: &Tensor,
    loss_mask: &Tensor,
    penalty: KlPenalty,
    mode: LossAggMode,
    opts: &AggOptions,
) -> Result<Tensor> {
    let name = "kl_loss";
    let lp = finite_rows(name, "logp", logp, None)?;
    let dims = (lp.len(), lp.first().map_or(0, Vec::len));
    finite_rows(name, "ref_logp", ref_logp, Some(dims))?;
    finite_rows(name, "loss_mask", loss_mask, Some(dims))?;
    let k = kl_penalty(logp, ref_logp, penalty)?;
    let loss = agg_loss(&k, loss_mask, mode, opts)?;
    check_finite_values(
        name,
        "loss",
        loss.flatten_all()?
            .to_dtype(candle_core::DType::F64)?
            .to_vec1::<f64>()?
            .into_iter(),
    )?;
    Ok(loss)
}

/// KL in the reward (§5.8, PPO / Search-R1 style): `token_rewards[i][t] −= β · k(old, ref)` on
/// loss tokens. Returns the batch mean over non-empty sequences of the per-sequence masked-mean
/// KL (verl `actor/reward_kl_penalty`), the input of [`KlController::update`].
pub fn apply_kl_in_reward(
    token_rewards: &mut [Vec<f64>],
    old_logp: &[Vec<f64>],
    ref_logp: &[Vec<f64>],
    loss_mask: &[Vec<f64>],
    beta: f64,
    estimator: KlEstimator,
) -> Result<f64> {
    let name = "kl_in_reward";
    let b = token_rewards.len();
    if old_logp.len() != b || ref_logp.len() != b || loss_mask.len() != b {
        return Err(LossError::InvalidInput {
            loss: name.to_string(),
            msg: "token_rewards, old_logp, ref_logp and loss_mask need the same number of rows"
                .to_string(),
        });
    }
    for (tensor, rows) in [
        ("old_logp", old_logp),
        ("ref_logp", ref_logp),
        ("loss_mask", loss_mask),
    ] {
        check_finite_values(name, tensor, rows.iter().flatten().copied())?;
    }
    check_finite_values(name, "beta", std::iter::once(beta))?;
    let (mut total, mut n) = (0.0, 0usize);
    for i in 0..b {
        let l = token_rewards[i].len();
        if old_logp[i].len() != l || ref_logp[i].len() != l || loss_mask[i].len() != l {
            return Err(LossError::InvalidInput {
                loss: name.to_string(),
                msg: format!("row {i} lengths differ"),
            });
        }
        let (mut s, mut m) = (0.0, 0.0);
        for t in 0..l {
            let kl = estimator.value(old_logp[i][t], ref_logp[i][t]) * loss_mask[i][t];
            token_rewards[i][t] -= beta * kl;
            s += kl;
            m += loss_mask[i][t];
        }
        if m > 0.0 {
            total += s / m;
            n += 1;
        }
    }
    check_finite_values(
        name,
        "token_rewards",
        token_rewards.iter().flatten().copied(),
    )?;
    Ok(if n > 0 { total / n as f64 } else { 0.0 })
}

/// A fixed KL coefficient.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FixedKlController {
    /// β.
    pub value: f64,
}

/// Adaptive KL coefficient: `β ← β·(1 + clip(KL/target − 1, −0.2, 0.2)·n_steps/horizon)` (§5.8).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveKlController {
    /// Current β.
    pub value: f64,
    /// Target KL.
    pub target: f64,
    /// Horizon (in samples).
    pub horizon: f64,
}

impl AdaptiveKlController {
    /// One update with the observed KL over `n_steps` samples.
    pub fn update(&mut self, current_kl: f64, n_steps: usize) {
        let err = (current_kl / self.target - 1.0).clamp(-0.2, 0.2);
        self.value *= 1.0 + err * n_steps as f64 / self.horizon;
    }
}

/// A KL-coefficient controller for KL in the reward.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KlController {
    /// Constant β.
    Fixed(FixedKlController),
    /// Proportional controller towards a target KL.
    Adaptive(AdaptiveKlController),
}

impl KlController {
    /// The current β.
    pub fn value(&self) -> f64 {
        match self {
            Self::Fixed(c) => c.value,
            Self::Adaptive(c) => c.value,
        }
    }

    /// Updates β from the observed KL (no-op for a fixed controller).
    pub fn update(&mut self, current_kl: f64, n_steps: usize) {
        if let Self::Adaptive(c) = self {
            c.update(current_kl, n_steps);
        }
    }
}

/// Which controller (verl `algorithm.kl_ctrl.type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlControllerKind {
    /// Constant β.
    #[default]
    Fixed,
    /// Adaptive β.
    Adaptive,
}

/// Config of the KL-in-reward controller (verl `algorithm.kl_ctrl`; β = 0.001 per §5.8).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KlControllerConfig {
    /// Controller type.
    #[serde(rename = "type")]
    pub kind: KlControllerKind,
    /// Initial β.
    pub kl_coef: f64,
    /// Target KL (adaptive).
    pub target_kl: f64,
    /// Horizon (adaptive).
    pub horizon: f64,
}

impl Default for KlControllerConfig {
    fn default() -> Self {
        Self {
            kind: KlControllerKind::Fixed,
            kl_coef: 0.001,
            target_kl: 0.1,
            horizon: 10000.0,
        }
    }
}

impl KlControllerConfig {
    /// Builds the controller, validating values.
    pub fn build(&self) -> Result<KlController> {
        if !(self.kl_coef >= 0.0 && self.kl_coef.is_finite()) {
            return Err(LossError::InvalidConfig(format!(
                "kl_coef must be finite and ≥ 0, got {}",
                self.kl_coef
            )));
        }
        Ok(match self.kind {
            KlControllerKind::Fixed => KlController::Fixed(FixedKlController {
                value: self.kl_coef,
            }),
            KlControllerKind::Adaptive => {
                if !(self.target_kl > 0.0 && self.horizon > 0.0) {
                    return Err(LossError::InvalidConfig(
                        "adaptive KL controller needs target_kl > 0 and horizon > 0".to_string(),
                    ));
                }
                KlController::Adaptive(AdaptiveKlController {
                    value: self.kl_coef,
                    target: self.target_kl,
                    horizon: self.horizon,
                })
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::test_util::{assert_close, grad_rows, rows, scalar, t2, var2};

    fn value_and_grad(name: &str) -> (f64, f64) {
        let v = var2(&[&[-1.0]]);
        let k = kl_penalty(v.as_tensor(), &t2(&[&[-1.5]]), name.parse().unwrap()).unwrap();
        let val = rows(&k)[0][0];
        (val, grad_rows(&k.sum_all().unwrap(), &v)[0][0])
    }

    /// §5.8 vector: logp −1.0, ref −1.5 → k1 0.5, k2 0.125, k3 0.106531.
    #[test]
    fn spec_5_8_values() {
        assert!((value_and_grad("kl").0 - 0.5).abs() < 1e-6);
        assert!((value_and_grad("k1").0 - 0.5).abs() < 1e-6);
        assert!((value_and_grad("abs").0 - 0.5).abs() < 1e-6);
        assert!((value_and_grad("mse").0 - 0.125).abs() < 1e-6);
        assert!((value_and_grad("k2").0 - 0.125).abs() < 1e-6);
        assert!((value_and_grad("low_var_kl").0 - 0.106531).abs() < 1e-6);
        assert!((value_and_grad("k3").0 - 0.106531).abs() < 1e-6);
        assert!((KlEstimator::K3.value(-1.0, -1.5) - 0.106531).abs() < 1e-6);
    }

    #[test]
    fn spec_5_8_straight_through_gradients() {
        // k3: d/dlogp [exp(ref − logp) − (ref − logp) − 1] = 1 − exp(ref − logp) = 1 − e^{−0.5}.
        let (v, g) = value_and_grad("k3");
        assert!((v - 0.106531).abs() < 1e-6 && (g - (1.0 - (-0.5f64).exp())).abs() < 1e-9);
        // "k3+": value of k3, gradient of k2 = logp − ref = 0.5.
        let (v, g) = value_and_grad("k3+");
        assert!((v - 0.106531).abs() < 1e-6 && (g - 0.5).abs() < 1e-9);
        let (v, g) = value_and_grad("abs+");
        assert!((v - 0.5).abs() < 1e-9 && (g - 0.5).abs() < 1e-9);
        let (v, g) = value_and_grad("k1");
        assert!((v - 0.5).abs() < 1e-9 && (g - 1.0).abs() < 1e-9);
    }

    #[test]
    fn k3_clamps() {
        // ref − logp = 30 → clamp to 20 → exp(20) − 21 → clamp 10.
        // ref − logp = −30 → clamp to −20 → e^{−20} + 19 → clamp 10; −3 → e^{−3} + 2 (no clamp).
        let k = kl_penalty(
            &t2(&[&[-31.0, 0.0, 0.0]]),
            &t2(&[&[-1.0, -30.0, -3.0]]),
            "k3".parse().unwrap(),
        )
        .unwrap();
        assert_close(&rows(&k)[0], &[10.0, 10.0, (-3f64).exp() + 2.0], 1e-9);
    }

    #[test]
    fn names_parse_and_round_trip() {
        for s in ["kl", "abs", "mse", "low_var_kl", "kl+", "low_var_kl+"] {
            let p: KlPenalty = s.parse().unwrap();
            assert_eq!(p.to_string(), s);
            let js = serde_json::to_string(&p).unwrap();
            assert_eq!(serde_json::from_str::<KlPenalty>(&js).unwrap(), p);
        }
        assert!(
            "full"
                .parse::<KlPenalty>()
                .unwrap_err()
                .to_string()
                .contains("full")
        );
        assert!(serde_json::from_str::<KlPenalty>("\"k4\"").is_err());
    }

    #[test]
    fn kl_in_loss_aggregates() {
        let lp = t2(&[&[-1.0, -1.0, 5.0]]);
        let rf = t2(&[&[-1.5, -1.5, 0.0]]);
        let m = t2(&[&[1.0, 1.0, 0.0]]);
        let l = kl_loss(
            &lp,
            &rf,
            &m,
            "k1".parse().unwrap(),
            LossAggMode::TokenMean,
            &AggOptions::default(),
        )
        .unwrap();
        assert!((scalar(&l) - 0.5).abs() < 1e-9);
        let bad = t2(&[&[-1.5, f64::NAN, 0.0]]);
        let err = kl_loss(
            &lp,
            &bad,
            &m,
            KlPenalty::default(),
            LossAggMode::TokenMean,
            &AggOptions::default(),
        );
        assert!(err.unwrap_err().to_string().contains("ref_logp"));
    }

    #[test]
    fn kl_in_reward_and_controllers() {
        let mut r = vec![vec![0.0, 0.0, 1.0], vec![0.0, 0.0, 0.0]];
        let old = vec![vec![-1.0, -1.0, -1.0], vec![0.0; 3]];
        let rf = vec![vec![-1.5, -1.0, -1.0], vec![-9.0; 3]];
        let m = vec![vec![1.0, 1.0, 1.0], vec![0.0; 3]];
        let kl = apply_kl_in_reward(&mut r, &old, &rf, &m, 0.1, KlEstimator::K1).unwrap();
        assert_close(&r[0], &[-0.05, 0.0, 1.0], 1e-12);
        assert_close(&r[1], &[0.0; 3], 1e-12); // no loss token → untouched, not averaged
        assert!((kl - 0.5 / 3.0).abs() < 1e-12);

        let mut fixed = KlControllerConfig::default().build().unwrap();
        fixed.update(1.0, 512);
        assert_eq!(fixed.value(), 0.001);
        let cfg = KlControllerConfig {
            kind: KlControllerKind::Adaptive,
            ..KlControllerConfig::default()
        };
        let mut ad = cfg.build().unwrap();
        ad.update(0.2, 512); // KL/target − 1 = 1 → clipped to 0.2
        assert!((ad.value() - 0.001 * (1.0 + 0.2 * 512.0 / 10000.0)).abs() < 1e-15);
        ad.update(0.09, 100); // −0.1
        assert!((ad.value() - 0.001 * 1.01024 * (1.0 - 0.1 * 100.0 / 10000.0)).abs() < 1e-15);
        let parsed: KlControllerConfig =
            serde_json::from_str(r#"{"type":"adaptive","target_kl":0.05}"#).unwrap();
        assert_eq!(parsed.kind, KlControllerKind::Adaptive);
        assert!(serde_json::from_str::<KlControllerConfig>(r#"{"kl_coeff":0.1}"#).is_err());
    }
}
