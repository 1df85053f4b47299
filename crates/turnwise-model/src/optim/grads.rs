//! Named gradients: extraction from a `GradStore`, global-norm clipping, micro-batch accumulation.

use std::collections::BTreeMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use crate::error::Result;

/// Gradients keyed by parameter name (detached tensors, no graph).
#[derive(Debug, Clone, Default)]
pub struct Gradients {
    grads: BTreeMap<String, Tensor>,
}

impl Gradients {
    /// Picks the gradients of `vars` out of a `GradStore`; parameters that received no gradient
    /// are absent.
    pub fn from_grad_store(store: &GradStore, vars: &[(String, Var)]) -> Self {
        let grads = vars
            .iter()
            .filter_map(|(name, var)| {
                store
                    .get(var.as_tensor())
                    .map(|g| (name.clone(), g.detach()))
            })
            .collect();
        Self { grads }
    }

    /// The gradient of one parameter.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.grads.get(name)
    }

    /// Number of parameters with a gradient.
    pub fn len(&self) -> usize {
        self.grads.len()
    }

    /// Whether no parameter has a gradient.
    pub fn is_empty(&self) -> bool {
        self.grads.is_empty()
    }

    /// `(name, gradient)` pairs in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Tensor)> {
        self.grads.iter()
    }

    /// Multiplies every gradient by `factor`.
    pub fn scale(&mut self, factor: f64) -> Result<()> {
        for g in self.grads.values_mut() {
            *g = g.affine(factor, 0.0)?;
        }
        Ok(())
    }

    /// The global L2 norm over all gradients (accumulated in f64).
    pub fn global_norm(&self) -> Result<f64> {
        let mut sq = 0.0f64;
        for g in self.grads.values() {
            sq += g
                .to_dtype(DType::F64)?
                .sqr()?
                .sum_all()?
                .to_scalar::<f64>()?;
        }
        Ok(sq.sqrt())
    }

    /// Clips the global norm to `max_norm` (scaling all gradients by `max_norm / norm` when the
    /// norm is larger) and returns the norm before clipping. A non-finite norm leaves the
    /// gradients untouched; the caller should skip that step.
    pub fn clip_global_norm(&mut self, max_norm: f64) -> Result<f64> {
        let norm = self.global_norm()?;
        if norm.is_finite() && norm > max_norm {
            self.scale(max_norm / (norm + 1e-6))?;
        }
        Ok(norm)
    }
}

/// Sums scaled gradients over micro-batches: `Σ scale_i · ∇loss_i`.
///
/// With `scale_i = 1 / num_micro_batches` (or each micro-batch's share of the tokens) the sum
/// equals the gradient of the whole mini-batch's loss. Gradients of `bf16`/`f16` parameters are
/// summed in `f32` (see [`crate::optim::adamw::state_dtype`]).
#[derive(Debug, Default)]
pub struct GradAccumulator {
    sum: Gradients,
    micro_batches: usize,
}

impl GradAccumulator {
    /// An empty accumulator.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `scale ×` the gradients of `vars` found in `store`.
    pub fn add(&mut self, store: &GradStore, vars: &[(String, Var)], scale: f64) -> Result<()> {
        for (name, var) in vars {
            let Some(g) = store.get(var.as_tensor()) else {
                continue;
            };
            let g = g
                .detach()
                .to_dtype(crate::optim::adamw::state_dtype(g.dtype()))?
                .affine(scale, 0.0)?;
            let entry = match self.sum.grads.remove(name) {
                Some(prev) => (prev + g)?,
                None => g,
            };
            self.sum.grads.insert(name.clone(), entry);
        }
        self.micro_batches += 1;
        Ok(())
    }

    /// Adds gradients already picked out of a `GradStore` (another accumulator's
    /// [`take`](Self::take), e.g. from a shard computed on another thread), counted as one
    /// micro-batch. Summing in a fixed order gives the same bits on every run.
    pub fn add_gradients(&mut self, grads: Gradients) -> Result<()> {
        for (name, g) in grads.grads {
            let entry = match self.sum.grads.remove(&name) {
                Some(prev) => (prev + g)?,
                None => g,
            };
            self.sum.grads.insert(name, entry);
        }
        self.micro_batches += 1;
        Ok(())
    }

    /// Number of micro-batches added so far.
    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    /// The accumulated gradients; the accumulator is left empty.
    pub fn take(&mut self) -> Gradients {
        self.micro_batches = 0;
        std::mem::take(&mut self.sum)
    }
}
