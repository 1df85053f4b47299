//! AdamW with decoupled weight decay (Loshchilov & Hutter, 2019), updating `Var`s in place.

use std::collections::{BTreeMap, HashMap};

use candle_core::{Tensor, Var};
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

/// AdamW over named `Var`s. Moments are kept in the parameters' dtype; the step count is
/// global (a parameter without a gradient in some step is skipped and keeps its moments).
#[derive(Debug)]
pub struct AdamW {
    config: AdamWConfig,
    vars: Vec<(String, Var)>,
    moments: BTreeMap<String, (Tensor, Tensor)>,
    step: u64,
}

impl AdamW {
    /// A fresh optimizer (zero moments, step 0) over `vars`.
    pub fn new(vars: Vec<(String, Var)>, config: AdamWConfig) -> Result<Self> {
        let mut moments = BTreeMap::new();
        for (name, var) in &vars {
            let z = var.as_tensor().zeros_like()?;
            moments.insert(name.clone(), (z.clone(), z));
        }
        Ok(Self {
            config,
            vars,
            moments,
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
            let g = g.to_dtype(var.dtype())?;
            *m = (m.affine(c.beta1, 0.0)? + g.affine(1.0 - c.beta1, 0.0)?)?;
            *v = (v.affine(c.beta2, 0.0)? + g.sqr()?.affine(1.0 - c.beta2, 0.0)?)?;
            let denom = (v.sqrt()?.affine(1.0 / bc2.sqrt(), 0.0)? + c.eps)?;
            let update = (m.affine(lr / bc1, 0.0)? / denom)?;
            let p = var.as_tensor().detach();
            let decays = c.decay_vectors || p.rank() > 1;
            let p = if decays && c.weight_decay != 0.0 {
                p.affine(1.0 - lr * c.weight_decay, 0.0)?
            } else {
                p
            };
            var.set(&(p - update)?)?;
        }
        Ok(())
    }

    /// The moments as named tensors (`{name}.exp_avg`, `{name}.exp_avg_sq`), for checkpoints.
    pub fn state_tensors(&self) -> HashMap<String, Tensor> {
        let mut out = HashMap::new();
        for (name, (m, v)) in &self.moments {
            out.insert(format!("{name}.exp_avg"), m.clone());
            out.insert(format!("{name}.exp_avg_sq"), v.clone());
        }
        out
    }

    /// Restores moments and step count saved by [`AdamW::state_tensors`]; every parameter's
    /// moments must be present with the parameter's shape.
    pub fn load_state(&mut self, tensors: &HashMap<String, Tensor>, step: u64) -> Result<()> {
        for (name, var) in &self.vars {
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
                Ok(t.to_dtype(var.dtype())?)
            };
            let m = get("exp_avg")?;
            let v = get("exp_avg_sq")?;
            self.moments.insert(name.clone(), (m, v));
        }
        self.step = step;
        Ok(())
    }
}
