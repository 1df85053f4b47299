//! AdamW with decoupled weight decay (Loshchilov & Hutter, 2019), updating `Var`s in place.

use std::collections::{BTreeMap, HashMap};

use candle_core::{DType, Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};
use crate::optim::grads::Gradients;

/// AdamW hyper-parameters (the learning rate is passed per step, see `LrSchedule`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    /// Decay rate of the first moment.
    pub beta1: f64,
    /// Decay rate of the second moment.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay coefficient: `p ← p (1 − lr·wd)` before the Adam update.
    pub weight_decay: f64,
    /// Whether norm weights and biases are decayed too. Default `false`: parameters with at most
    /// one dimension (RMSNorm weights, biases) are not decayed, the usual practice for
    /// transformers; matrices (projections, embeddings) are.
    pub decay_vectors: bool,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            decay_vectors: false,
        }
    }
}

/// AdamW over named `Var`s. The step count is global (a parameter without a gradient in some
/// step is skipped and keeps its moments).
///
/// Mixed precision: for `f32`/`f64` parameters the moments are kept in the parameters' dtype.
/// For `bf16`/`f16` parameters (the weights and activations of a CUDA model) the optimizer
/// keeps an `f32` master copy of each parameter and `f32` moments, applies the update to the
/// master copy and writes it back rounded to the parameter's dtype, so that updates smaller
/// than the half type's resolution accumulate instead of rounding away.
#[derive(Debug)]
pub struct AdamW {
    config: AdamWConfig,
    vars: Vec<(String, Var)>,
    moments: BTreeMap<String, (Tensor, Tensor)>,
    /// `f32` master copies of the half-precision parameters.
    masters: BTreeMap<String, Tensor>,
    step: u64,
}

/// The dtype of the optimizer state of a `dtype` parameter: `f32` for half types.
pub fn state_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    }
}

impl AdamW {
    /// A fresh optimizer (zero moments, step 0) over `vars`.
    pub fn new(vars: Vec<(String, Var)>, config: AdamWConfig) -> Result<Self> {
        let mut moments = BTreeMap::new();
        let mut masters = BTreeMap::new();
        for (name, var) in &vars {
            let sd = state_dtype(var.dtype());
            let z = var.as_tensor().zeros_like()?.to_dtype(sd)?;
            moments.insert(name.clone(), (z.clone(), z));
            if sd != var.dtype() {
                masters.insert(name.clone(), var.as_tensor().detach().to_dtype(sd)?);
            }
        }
        Ok(Self {
            config,
            vars,
            moments,
            masters,
            step: 0,
        })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// Number of updates made so far.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// The parameters being optimised.
    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// Applies one update with learning rate `lr`.
    pub fn step(&mut self, grads: &Gradients, lr: f64) -> Result<()> {
        self.step += 1;
        let c = &self.config;
        let t = self.step as i32;
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2 = 1.0 - c.beta2.powi(t);
        for (name, var) in &self.vars {
            let Some(g) = grads.get(name) else {
                continue;
            };
            let (m, v) = self.moments.get_mut(name).ok_or_else(|| {
                ModelError::invalid_input("grads", format!("unknown parameter {name}"))
            })?;
            let g = g.to_dtype(state_dtype(var.dtype()))?;
            *m = (m.affine(c.beta1, 0.0)? + g.affine(1.0 - c.beta1, 0.0)?)?;
            *v = (v.affine(c.beta2, 0.0)? + g.sqr()?.affine(1.0 - c.beta2, 0.0)?)?;
            let denom = (v.sqrt()?.affine(1.0 / bc2.sqrt(), 0.0)? + c.eps)?;
            let update = (m.affine(lr / bc1, 0.0)? / denom)?;
            let master = self.masters.get_mut(name);
            let p = match &master {
                Some(p) => (*p).clone(),
                None => var.as_tensor().detach(),
            };
            let decays = c.decay_vectors || p.rank() > 1;
            let p = if decays && c.weight_decay != 0.0 {
                p.affine(1.0 - lr * c.weight_decay, 0.0)?
            } else {
                p
            };
            let p = (p - update)?;
            // An update that overflows (a learning rate far too large) must not be written: it
            // would surface steps later as an unrelated failure of sampling or the loss.
            let total = f64::from(p.sum_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()?);
            if !total.is_finite() {
                return Err(ModelError::invalid_input(
                    "lr",
                    format!(
                        "the update at learning rate {lr} made parameter {name} non-finite (the \
                         parameters before it in this step were updated, {name} and the rest \
                         were not)"
                    ),
                ));
            }
            match master {
                Some(slot) => {
                    var.set(&p.to_dtype(var.dtype())?)?;
                    *slot = p;
                }
                None => var.set(&p)?,
            }
        }
        Ok(())
    }

    /// Re-reads the `f32` master copies after the parameters were changed by something else
    /// (another optimizer's phase, a load): from `source`'s master copy of the same parameter
    /// when it has one (exact), else from the parameter's current value. Without it, the next
    /// [`AdamW::step`] would update the stale master and write it back, undoing that change
    /// (a `bf16` RL phase after a warm start with its own optimizer reverted the weights to
    /// their initialisation this way). A no-op for `f32`/`f64` parameters.
    pub fn sync_masters(&mut self, source: Option<&AdamW>) -> Result<()> {
        for (name, var) in &self.vars {
            let Some(slot) = self.masters.get_mut(name) else {
                continue;
            };
            *slot = match source.and_then(|s| s.masters.get(name)) {
                Some(m) if m.dims() == var.dims() => m.clone(),
                _ => var
                    .as_tensor()
                    .detach()
                    .to_dtype(state_dtype(var.dtype()))?,
            };
        }
        Ok(())
    }

    /// The `f32` master copy of a half-precision parameter (`None` for `f32`/`f64` ones, which
    /// are their own master).
    pub fn master(&self, name: &str) -> Option<&Tensor> {
        self.masters.get(name)
    }

    /// The moments as named tensors (`{name}.exp_avg`, `{name}.exp_avg_sq`), and the `f32`
    /// master copies of half-precision parameters (`{name}.master`), for checkpoints.
    pub fn state_tensors(&self) -> HashMap<String, Tensor> {
        let mut out = HashMap::new();
        for (name, (m, v)) in &self.moments {
            out.insert(format!("{name}.exp_avg"), m.clone());
            out.insert(format!("{name}.exp_avg_sq"), v.clone());
        }
        for (name, p) in &self.masters {
            out.insert(format!("{name}.master"), p.clone());
        }
        out
    }

    /// Restores moments and step count saved by [`AdamW::state_tensors`]; every parameter's
    /// moments must be present with the parameter's shape. A half-precision parameter's master
    /// copy is restored when saved, else taken from the parameter's current value.
    pub fn load_state(&mut self, tensors: &HashMap<String, Tensor>, step: u64) -> Result<()> {
        for (name, var) in &self.vars {
            let sd = state_dtype(var.dtype());
            let device = var.device();
            let get = |suffix: &str| -> Result<Tensor> {
                let key = format!("{name}.{suffix}");
                let t = tensors.get(&key).ok_or_else(|| ModelError::MissingTensor {
                    name: key.clone(),
                    source_desc: "the optimizer state".into(),
                })?;
                if t.dims() != var.dims() {
                    return Err(ModelError::ShapeMismatch {
                        name: key,
                        expected: var.dims().to_vec(),
                        found: t.dims().to_vec(),
                    });
                }
                Ok(t.to_dtype(sd)?.to_device(device)?)
            };
            let m = get("exp_avg")?;
            let v = get("exp_avg_sq")?;
            self.moments.insert(name.clone(), (m, v));
            if sd != var.dtype() {
                let master = match tensors.contains_key(&format!("{name}.master")) {
                    true => get("master")?,
                    false => var.as_tensor().detach().to_dtype(sd)?,
                };
                self.masters.insert(name.clone(), master);
            }
        }
        self.step = step;
        Ok(())
    }
}
