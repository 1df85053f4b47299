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
    /// Always take the composed tensor ops (the reference the fused CPU update is tested
    /// against; [`AdamW::with_composed_update`]).
    composed: bool,
    /// The fused update's buffer for a new parameter value.
    scratch: fused::Scratch,
}

/// The error of an update that made parameter `name` non-finite (`where_`: what was found so).
fn non_finite(name: &str, lr: f64, where_: &str) -> ModelError {
    ModelError::invalid_input(
        "lr",
        format!(
            "the update at learning rate {lr} made parameter {name} non-finite ({where_}; the \
             parameters before it in this step were updated, {name} and the rest were not)"
        ),
    )
}

/// The scalars of one parameter's update ([`AdamW::step`]).
#[derive(Debug, Clone, Copy)]
struct Coeffs {
    beta1: f64,
    beta2: f64,
    /// `1 / sqrt(1 − β2^t)`.
    inv_sqrt_bc2: f64,
    eps: f64,
    /// `lr / (1 − β1^t)`.
    step_size: f64,
    /// `1 − lr·wd` when the parameter decays.
    decay: Option<f64>,
    /// The factor the gradient is multiplied by first (a deferred clip; 1 for none).
    grad_scale: f64,
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
            let zeros = || var.as_tensor().zeros_like()?.to_dtype(sd);
            moments.insert(name.clone(), (zeros()?, zeros()?));
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
            composed: false,
            scratch: fused::Scratch::default(),
        })
    }

    /// The same optimizer updating through candle's composed tensor ops only (about 15 passes
    /// over each parameter, each allocating), never the fused CPU update: the reference the
    /// fused update is tested against, bit for bit.
    pub fn with_composed_update(mut self) -> Self {
        self.composed = true;
        self
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
        self.step_scaled(grads, lr, None)
    }

    /// Applies one update with learning rate `lr` to the gradients multiplied by `factor`
    /// (`None`: by 1), the same bits as `grads.scale(factor)` followed by [`AdamW::step`]: the
    /// fused update multiplies each gradient element as it reads it, so clipping costs no pass
    /// over the gradients (see [`Gradients::clip_factor`]).
    pub fn step_scaled(&mut self, grads: &Gradients, lr: f64, factor: Option<f64>) -> Result<()> {
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
            let master = self.masters.get_mut(name);
            let decays = c.decay_vectors || var.rank() > 1;
            let coeffs = Coeffs {
                beta1: c.beta1,
                beta2: c.beta2,
                inv_sqrt_bc2: 1.0 / bc2.sqrt(),
                eps: c.eps,
                step_size: lr / bc1,
                decay: (decays && c.weight_decay != 0.0).then_some(1.0 - lr * c.weight_decay),
                grad_scale: factor.unwrap_or(1.0),
            };
            // The fused update scales the gradient as it reads it.
            if master.is_none() && !self.composed {
                match fused::update(var.as_tensor(), g, m, v, &coeffs, &mut self.scratch)? {
                    fused::Outcome::Updated => continue,
                    fused::Outcome::NonFinite(i) => {
                        return Err(non_finite(name, lr, &format!("element {i}")));
                    }
                    fused::Outcome::NotApplicable => {}
                }
            }
            // Not fused: scale first, in the gradient's own dtype (as `Gradients::scale` does).
            let g = match factor {
                Some(f) => g.affine(f, 0.0)?,
                None => g.clone(),
            };
            let g = g.to_dtype(state_dtype(var.dtype()))?;
            *m = (m.affine(c.beta1, 0.0)? + g.affine(1.0 - c.beta1, 0.0)?)?;
            *v = (v.affine(c.beta2, 0.0)? + g.sqr()?.affine(1.0 - c.beta2, 0.0)?)?;
            let denom = (v.sqrt()?.affine(1.0 / bc2.sqrt(), 0.0)? + c.eps)?;
            let update = (m.affine(lr / bc1, 0.0)? / denom)?;
            let p = match &master {
                Some(p) => (*p).clone(),
                None => var.as_tensor().detach(),
            };
            let p = match coeffs.decay {
                Some(keep) => p.affine(keep, 0.0)?,
                None => p,
            };
            let p = (p - update)?;
            // An update that overflows (a learning rate far too large) must not be written: it
            // would surface steps later as an unrelated failure of sampling or the loss.
            let total = f64::from(p.sum_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()?);
            if !total.is_finite() {
                return Err(non_finite(name, lr, "its sum"));
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

/// The fused CPU update: one pass over each parameter, its gradient and its moments, with the
/// same floating-point operations in the same order as the composed tensor ops of
/// [`AdamW::step`] (bit for bit the same result) instead of about 15 passes that each allocate a
/// parameter-sized tensor. The moments are updated in their own memory and the new parameter is
/// written to a scratch buffer the optimizer keeps, then copied into the parameter only when
/// every element is finite. Nothing is allocated: fresh pages cost the kernel's zeroing, which
/// made a fused update that allocated its outputs slower than the composed ops. The threads of
/// rayon's pool split the elements.
pub(crate) mod fused {
    use std::cell::Cell;

    use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Storage, Tensor, WithDType};
    use rayon::prelude::*;

    use super::Coeffs;
    use crate::error::Result;

    /// Elements per task.
    const CHUNK: usize = 1 << 15;

    /// The optimizer's buffers for a new parameter value (grown to the largest parameter).
    #[derive(Debug, Default)]
    pub(super) struct Scratch {
        f32: Vec<f32>,
        f64: Vec<f64>,
    }

    /// A float the update runs in (`f32`, `f64`).
    trait Float: WithDType {
        fn sqrt(self) -> Self;
        fn finite(self) -> bool;
        fn scratch(s: &mut Scratch) -> &mut Vec<Self>;
        fn elements(s: &mut CpuStorage) -> Option<&mut Vec<Self>>;
    }

    macro_rules! float {
        ($t:ident, $variant:ident) => {
            impl Float for $t {
                fn sqrt(self) -> Self {
                    $t::sqrt(self)
                }
                fn finite(self) -> bool {
                    self.is_finite()
                }
                fn scratch(s: &mut Scratch) -> &mut Vec<Self> {
                    &mut s.$t
                }
                fn elements(s: &mut CpuStorage) -> Option<&mut Vec<Self>> {
                    match s {
                        CpuStorage::$variant(v) => Some(v),
                        _ => None,
                    }
                }
            }
        };
    }
    float!(f32, F32);
    float!(f64, F64);

    /// What [`update`] did.
    pub(super) enum Outcome {
        /// The fused update does not apply (not on the CPU, not `f32`/`f64`, a tensor not
        /// contiguous, or two of the tensors sharing memory): nothing was changed.
        NotApplicable,
        /// The moments and the parameter were updated.
        Updated,
        /// The moments were updated; element `.0` of the new parameter was not finite, so the
        /// parameter was not written (as the composed ops leave it).
        NonFinite(usize),
    }

    /// Updates parameter `p` and moments `m`, `v` (all of `p`'s dtype and shape) from gradient
    /// `g`, in place.
    pub(super) fn update(
        p: &Tensor,
        g: &Tensor,
        m: &Tensor,
        v: &Tensor,
        k: &Coeffs,
        scratch: &mut Scratch,
    ) -> Result<Outcome> {
        let all = [p, g, m, v];
        let unfit =
            |t: &&Tensor| !t.device().is_cpu() || !t.is_contiguous() || t.dtype() != p.dtype();
        if all.iter().any(unfit) || shares_memory(&all) {
            return Ok(Outcome::NotApplicable);
        }
        match p.dtype() {
            DType::F32 => typed::<f32>(p, g, m, v, k, f32::scratch(scratch)),
            DType::F64 => typed::<f64>(p, g, m, v, k, f64::scratch(scratch)),
            _ => Ok(Outcome::NotApplicable),
        }
    }

    /// Whether two of `ts` share their storage (a fresh optimizer's two moments once did).
    fn shares_memory(ts: &[&Tensor]) -> bool {
        let guards: Vec<_> = ts.iter().map(|t| t.storage_and_layout()).collect();
        let at: Vec<*const Storage> = guards.iter().map(|(s, _)| &**s as *const Storage).collect();
        (0..at.len()).any(|i| (i + 1..at.len()).any(|j| std::ptr::eq(at[i], at[j])))
    }

    /// The contiguous elements of a CPU tensor of `T` (`None`: another device or dtype, or not
    /// contiguous).
    pub(crate) fn slice<'a, T: WithDType>(s: &'a Storage, l: &Layout) -> Option<&'a [T]> {
        let Storage::Cpu(cpu) = s else {
            return None;
        };
        let (start, end) = l.contiguous_offsets()?;
        cpu.as_slice::<T>().ok().map(|x| &x[start..end])
    }

    /// The contiguous elements of a CPU storage of `T`, writable.
    fn slice_mut<'a, T: Float>(
        s: &'a mut CpuStorage,
        l: &Layout,
    ) -> candle_core::Result<&'a mut [T]> {
        let (start, end) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("adamw: not contiguous".into()))?;
        let v = T::elements(s).ok_or_else(|| candle_core::Error::Msg("adamw: dtype".into()))?;
        Ok(&mut v[start..end])
    }

    /// A raw slice carried through candle's in-place callbacks (valid while the callback that
    /// made it holds its tensor's write lock, or while `typed` borrows the scratch).
    #[derive(Clone, Copy)]
    struct Raw<T>(*mut T, usize);

    /// The first moment's callback: holds `m` write-locked, runs the second moment's.
    struct FirstMoment<'a, T> {
        v: &'a Tensor,
        p: &'a [T],
        g: &'a [T],
        out: Raw<T>,
        k: &'a Coeffs,
        bad: &'a Cell<Option<usize>>,
    }

    /// The second moment's callback: holds `v` write-locked, runs the kernel.
    struct SecondMoment<'a, T> {
        m: Raw<T>,
        p: &'a [T],
        g: &'a [T],
        out: Raw<T>,
        k: &'a Coeffs,
        bad: &'a Cell<Option<usize>>,
    }

    impl<T: Float> InplaceOp1 for FirstMoment<'_, T> {
        fn name(&self) -> &'static str {
            "adamw-first-moment"
        }
        fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
            let m = slice_mut::<T>(s, l)?;
            self.v.inplace_op1(&SecondMoment {
                m: Raw(m.as_mut_ptr(), m.len()),
                p: self.p,
                g: self.g,
                out: self.out,
                k: self.k,
                bad: self.bad,
            })
        }
    }

    impl<T: Float> InplaceOp1 for SecondMoment<'_, T> {
        fn name(&self) -> &'static str {
            "adamw-second-moment"
        }
        fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
            let v = slice_mut::<T>(s, l)?;
            // SAFETY: `m` is the first moment's elements, write-locked by the callback that runs
            // this one and touched by nothing else until it returns; `out` is the optimizer's
            // scratch, borrowed mutably by `typed` for the whole call. Both are `v.len()` long
            // (checked by `typed`) and neither overlaps `v`, `p` or `g` (`shares_memory`).
            let (m, out) = unsafe {
                (
                    std::slice::from_raw_parts_mut(self.m.0, self.m.1),
                    std::slice::from_raw_parts_mut(self.out.0, self.out.1),
                )
            };
            self.bad.set(kernel(self.p, self.g, m, v, out, self.k));
            Ok(())
        }
    }

    /// Copies the new parameter from the scratch into the parameter's memory.
    struct CopyIn<'a, T>(&'a [T]);

    impl<T: Float> InplaceOp1 for CopyIn<'_, T> {
        fn name(&self) -> &'static str {
            "adamw-copy-in"
        }
        fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
            slice_mut::<T>(s, l)?.copy_from_slice(self.0);
            Ok(())
        }
    }

    fn typed<T: Float>(
        p: &Tensor,
        g: &Tensor,
        m: &Tensor,
        v: &Tensor,
        k: &Coeffs,
        scratch: &mut Vec<T>,
    ) -> Result<Outcome> {
        let n = p.elem_count();
        if [g, m, v].iter().any(|t| t.elem_count() != n) {
            return Ok(Outcome::NotApplicable);
        }
        if scratch.len() < n {
            scratch.resize(n, T::zero());
        }
        let out = &mut scratch[..n];
        let bad = Cell::new(None);
        {
            let (ps, pl) = p.storage_and_layout();
            let (gs, gl) = g.storage_and_layout();
            let (Some(pv), Some(gv)) = (slice::<T>(&ps, pl), slice::<T>(&gs, gl)) else {
                return Ok(Outcome::NotApplicable);
            };
            m.inplace_op1(&FirstMoment {
                v,
                p: pv,
                g: gv,
                out: Raw(out.as_mut_ptr(), n),
                k,
                bad: &bad,
            })?;
        }
        if let Some(i) = bad.get() {
            return Ok(Outcome::NonFinite(i));
        }
        p.inplace_op1(&CopyIn(&*out))?;
        Ok(Outcome::Updated)
    }

    /// The update of one parameter: the moments in place, the new parameter into `out`; the
    /// index of the first non-finite element of the new parameter, if any.
    fn kernel<T: Float>(
        p: &[T],
        g: &[T],
        m: &mut [T],
        v: &mut [T],
        out: &mut [T],
        k: &Coeffs,
    ) -> Option<usize> {
        let c = |x: f64| T::from_f64(x);
        let s = Scalars {
            b1: c(k.beta1),
            ob1: c(1.0 - k.beta1),
            b2: c(k.beta2),
            ob2: c(1.0 - k.beta2),
            isb: c(k.inv_sqrt_bc2),
            eps: c(k.eps),
            size: c(k.step_size),
            keep: k.decay.map(c),
            gs: c(k.grad_scale),
        };
        let isa = crate::model::ops::infer::kernel_isa();
        out.par_chunks_mut(CHUNK)
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .enumerate()
            .map(|(ci, ((po, mo), vo))| {
                let at = ci * CHUNK;
                let (p, g) = (&p[at..at + po.len()], &g[at..at + po.len()]);
                let x = Slices {
                    p,
                    g,
                    m: mo,
                    v: vo,
                    out: &mut *po,
                };
                let finite = chunk_dispatch(isa, x, &s);
                if finite {
                    return None;
                }
                po.iter().position(|x| !x.finite()).map(|j| at + j)
            })
            .reduce(|| None, |a, b| a.into_iter().chain(b).min())
    }

    /// The update's scalars in the parameter's type.
    struct Scalars<T> {
        b1: T,
        ob1: T,
        b2: T,
        ob2: T,
        isb: T,
        eps: T,
        size: T,
        keep: Option<T>,
        /// The gradient's factor (1 when it has none): `affine(g, gs, 0)`.
        gs: T,
    }

    /// One chunk's slices: the parameter and gradient read, the moments and the new parameter
    /// written (all as long as `out`).
    struct Slices<'a, T> {
        p: &'a [T],
        g: &'a [T],
        m: &'a mut [T],
        v: &'a mut [T],
        out: &'a mut [T],
    }

    /// [`chunk`] compiled for the widest vector set the CPU has (the arithmetic is the same
    /// IEEE operations in every set, so the bits are too).
    fn chunk_dispatch<T: Float>(
        isa: crate::model::ops::infer::KernelIsa,
        x: Slices<'_, T>,
        s: &Scalars<T>,
    ) -> bool {
        use crate::model::ops::infer::KernelIsa;
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f")]
            fn avx512<T: Float>(x: Slices<'_, T>, s: &Scalars<T>) -> bool {
                chunk(x, s)
            }
            #[target_feature(enable = "avx2")]
            fn avx2<T: Float>(x: Slices<'_, T>, s: &Scalars<T>) -> bool {
                chunk(x, s)
            }
            match isa {
                // SAFETY: `kernel_isa` names a set only when the CPU has it.
                KernelIsa::Avx512 => return unsafe { avx512(x, s) },
                KernelIsa::Avx2 => return unsafe { avx2(x, s) },
                KernelIsa::Portable => {}
            }
        }
        let _ = isa;
        chunk(x, s)
    }

    /// One chunk of the update; whether every new parameter element is finite.
    #[inline(always)]
    fn chunk<T: Float>(x: Slices<'_, T>, s: &Scalars<T>) -> bool {
        let Slices { p, g, m, v, out } = x;
        let n = out.len();
        let (p, g, m, v) = (&p[..n], &g[..n], &mut m[..n], &mut v[..n]);
        let zero = T::zero();
        let one = T::from_f64(1.0);
        // No branch in the loop, so that it vectorises: the finite check is a running `and`.
        let mut finite = true;
        for i in 0..n {
            // The composed ops, one by one: `affine(x, a, b) = x * a + b`. The factor leaves the
            // gradient as it is at 1 (but a -0, which every use below rounds as +0).
            let gi = g[i] * s.gs + zero;
            let mi = (m[i] * s.b1 + zero) + (gi * s.ob1 + zero);
            let vi = (v[i] * s.b2 + zero) + ((gi * gi) * s.ob2 + zero);
            let denom = ((vi.sqrt() * s.isb + zero) * one) + s.eps;
            let update = (mi * s.size + zero) / denom;
            let pi = match s.keep {
                Some(keep) => p[i] * keep + zero,
                None => p[i],
            } - update;
            finite &= pi.finite();
            out[i] = pi;
            m[i] = mi;
            v[i] = vi;
        }
        finite
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use crate::model::ops::infer::KernelIsa;

        /// Every vector set this CPU runs gives the portable loop's bits, in `f32` and `f64`,
        /// and flags an overflowing element.
        #[test]
        fn every_vector_set_writes_the_portable_bits() {
            fn check<T: Float>() {
                let n = 1000;
                let x = |i: usize, a: f64| T::from_f64(((i * 7919 + 13) % 1000) as f64 * a - 0.3);
                let p: Vec<T> = (0..n).map(|i| x(i, 1e-3)).collect();
                let mut g: Vec<T> = (0..n).map(|i| x(i + 5, 2e-3)).collect();
                let mut m0: Vec<T> = (0..n).map(|i| x(i + 9, 1e-4)).collect();
                let mut v0: Vec<T> = (0..n).map(|i| x(i + 3, 1e-4) * x(i + 3, 1e-4)).collect();
                // Element 0 has |m̂| > √v̂, so a step size near the largest float overflows.
                (g[0], m0[0], v0[0]) = (T::from_f64(1.0), T::from_f64(1.0), T::zero());
                let run = |isa: KernelIsa, size: f64| {
                    let s = Scalars {
                        b1: T::from_f64(0.9),
                        ob1: T::from_f64(0.1),
                        b2: T::from_f64(0.95),
                        ob2: T::from_f64(0.05),
                        isb: T::from_f64(1.3),
                        eps: T::from_f64(1e-8),
                        size: T::from_f64(size),
                        keep: Some(T::from_f64(0.99)),
                        gs: T::from_f64(0.75),
                    };
                    let (mut m, mut v, mut out) = (m0.clone(), v0.clone(), vec![T::zero(); n]);
                    let x = Slices {
                        p: &p,
                        g: &g,
                        m: &mut m,
                        v: &mut v,
                        out: &mut out,
                    };
                    let finite = chunk_dispatch(isa, x, &s);
                    let bits =
                        |xs: &[T]| xs.iter().map(|x| x.to_f64().to_bits()).collect::<Vec<_>>();
                    (finite, bits(&out), bits(&m), bits(&v))
                };
                let portable = run(KernelIsa::Portable, 1e-3);
                assert!(portable.0);
                for isa in KernelIsa::supported() {
                    assert_eq!(run(isa, 1e-3), portable, "{isa:?}");
                    assert!(
                        !run(isa, f64::MAX).0,
                        "{isa:?}: an overflow must be flagged"
                    );
                }
            }
            check::<f32>();
            check::<f64>();
        }
    }
}
