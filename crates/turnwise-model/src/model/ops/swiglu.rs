//! The SwiGLU gate of a Llama MLP: `silu(g) ∘ u`.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::simd::ExpKernels;
use super::{contiguous, fused_on, par_rows};

/// `silu(g) ∘ u` (`silu(g) = g · σ(g)`) for `g` and `u` of one shape, as one fused op with a
/// hand-written backward: one pass forward and one backward, where the composition
/// `g.silu()? * u` runs candle's `silu` backward (six element-wise passes, each allocating)
/// and two products. It computes the composition's formulas in its order: in `f64` (the
/// library `exp`) forward and gradients are the same bits; in `f32` the `exp` is the vectorised
/// polynomial of [`super::simd`] (within 2 ulp), so they agree to rounding. `f16`/`bf16` run
/// in `f32`; off the CPU (or inside
/// [`super::with_composed_ops`]) this is [`swiglu_composed`].
pub fn swiglu(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    if g.shape() != u.shape() {
        candle_core::bail!(
            "swiglu: gate {:?} and up {:?} differ in shape",
            g.dims(),
            u.dims()
        );
    }
    let fused = fused_on(g.device());
    match g.dtype() {
        DType::F32 | DType::F64 if fused && u.dtype() == g.dtype() => {
            g.contiguous()?.apply_op2(&u.contiguous()?, SwiGlu)
        }
        DType::F16 | DType::BF16 if fused => {
            let y = swiglu(&g.to_dtype(DType::F32)?, &u.to_dtype(DType::F32)?)?;
            y.to_dtype(g.dtype())
        }
        _ => swiglu_composed(g, u),
    }
}

/// The same gate composed from candle ops: the reference for [`swiglu`] and its path off the
/// CPU.
pub fn swiglu_composed(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    g.silu()? * u
}

struct SwiGlu;

fn fwd<T: ExpKernels>(g: &[T], u: &[T]) -> Vec<T> {
    let mut y = vec![T::ZERO; g.len()];
    let row = g.len().clamp(1, 4096);
    par_rows(&mut y, row, g.len(), |r0, block| {
        let at = r0 * row;
        let (g, u) = (&g[at..at + block.len()], &u[at..at + block.len()]);
        T::swiglu(block, g, u);
    });
    y
}

/// `(g, u, dy) → [2n]`: `dg = (dy · u) · (σ(g) (1 − silu(g)) + silu(g))` then
/// `du = dy · silu(g)`, each product and sum in the order candle's backward of the composition
/// takes them (`σ(g) = 1 / (e^-g + 1)`): the same bits in `f64`.
fn bwd<T: ExpKernels>(g: &[T], u: &[T], dy: &[T]) -> Vec<T> {
    let n = g.len();
    let mut out = vec![T::ZERO; 2 * n];
    let (dg, du) = out.split_at_mut(n);
    let row = n.clamp(1, 4096);
    let mut chunks: Vec<_> = dg.chunks_mut(row).zip(du.chunks_mut(row)).collect();
    par_rows(&mut chunks, 1, 2 * n, |c0, block| {
        for (i, (dg, du)) in block.iter_mut().enumerate() {
            let at = (c0 + i) * row;
            let len = dg.len();
            let (g, u, dy) = (&g[at..at + len], &u[at..at + len], &dy[at..at + len]);
            T::swiglu_grad(dg, du, g, u, dy);
        }
    });
    out
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "turnwise-swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = match s1.dtype() {
            DType::F32 => CpuStorage::F32(fwd(
                contiguous::<f32>(s1, l1, "gate")?,
                contiguous::<f32>(s2, l2, "up")?,
            )),
            DType::F64 => CpuStorage::F64(fwd(
                contiguous::<f64>(s1, l1, "gate")?,
                contiguous::<f64>(s2, l2, "up")?,
            )),
            dt => candle_core::bail!("swiglu: unsupported dtype {dt:?}"),
        };
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        g: &Tensor,
        u: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let n = g.elem_count();
        let packed =
            g.contiguous()?
                .apply_op3_no_bwd(&u.contiguous()?, &grad.contiguous()?, &SwiGluBwd)?;
        let dg = packed.narrow(0, 0, n)?.reshape(g.shape())?;
        let du = packed.narrow(0, n, n)?.reshape(u.shape())?;
        Ok((Some(dg), Some(du)))
    }
}

/// Backward of [`SwiGlu`]: `(g, u, dy) → [2n]`, `dg` followed by `du`.
struct SwiGluBwd;

impl CustomOp3 for SwiGluBwd {
    fn name(&self) -> &'static str {
        "turnwise-swiglu-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let n = l1.shape().elem_count();
        let out = match s1.dtype() {
            DType::F32 => CpuStorage::F32(bwd(
                contiguous::<f32>(s1, l1, "gate")?,
                contiguous::<f32>(s2, l2, "up")?,
                contiguous::<f32>(s3, l3, "grad")?,
            )),
            DType::F64 => CpuStorage::F64(bwd(
                contiguous::<f64>(s1, l1, "gate")?,
                contiguous::<f64>(s2, l2, "up")?,
                contiguous::<f64>(s3, l3, "grad")?,
            )),
            dt => candle_core::bail!("swiglu backward: unsupported dtype {dt:?}"),
        };
        Ok((out, Shape::from(2 * n)))
    }
}
