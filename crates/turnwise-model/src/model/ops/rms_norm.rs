//! RMSNorm with weight over the last dimension: `y = x / sqrt(mean(x²) + eps) · w`.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, D, DType, Layout, Result, Shape, Tensor};

use super::{Real, contiguous, dot, fused_on, par_rows};

/// RMSNorm over the last dimension of `x` with weight `weight: [n]`, as one fused op with a
/// hand-written backward (gradients for `x` and `weight`). `f16`/`bf16` run in `f32`; off the CPU
/// (or inside [`super::with_composed_ops`]) this is [`rms_norm_composed`].
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let n = x.dim(D::Minus1)?;
    if weight.dims() != [n] {
        candle_core::bail!(
            "rms_norm: weight {:?} does not match the last dim {n}",
            weight.dims()
        );
    }
    let fused = fused_on(x.device());
    match x.dtype() {
        DType::F32 | DType::F64 if fused && weight.dtype() == x.dtype() => x
            .contiguous()?
            .apply_op2(&weight.contiguous()?, RmsNorm { eps }),
        DType::F16 | DType::BF16 if fused => {
            let y = rms_norm(&x.to_dtype(DType::F32)?, &weight.to_dtype(DType::F32)?, eps)?;
            y.to_dtype(x.dtype())
        }
        _ => rms_norm_composed(x, weight, eps),
    }
}

/// The same RMSNorm composed from basic candle ops (`sqr`, `mean`, `sqrt`, `div`, `mul`): the
/// reference for [`rms_norm`] and its fallback off the CPU.
pub fn rms_norm_composed(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let xf = match dtype {
        DType::F16 | DType::BF16 => x.to_dtype(DType::F32)?,
        _ => x.clone(),
    };
    let ms = xf.sqr()?.mean_keepdim(D::Minus1)?;
    let y = xf.broadcast_div(&(ms + eps)?.sqrt()?)?;
    y.to_dtype(dtype)?.broadcast_mul(weight)
}

struct RmsNorm {
    eps: f64,
}

#[inline]
fn inv_rms<T: Real>(x: &[T], eps: f64) -> T {
    let ms = dot(x, x) / T::of(x.len() as f64);
    T::ONE / (ms + T::of(eps)).sqrt()
}

fn fwd<T: Real>(x: &[T], w: &[T], eps: f64) -> Vec<T> {
    let n = w.len();
    let mut y = vec![T::ZERO; x.len()];
    par_rows(&mut y, n, x.len(), |r0, block| {
        for (i, yr) in block.chunks_exact_mut(n).enumerate() {
            let xr = &x[(r0 + i) * n..(r0 + i + 1) * n];
            let r = inv_rms(xr, eps);
            for ((y, &x), &w) in yr.iter_mut().zip(xr).zip(w) {
                *y = x * r * w;
            }
        }
    });
    y
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "turnwise-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let shape = l1.shape().clone();
        let out = match s1.dtype() {
            DType::F32 => CpuStorage::F32(fwd(
                contiguous::<f32>(s1, l1, "x")?,
                contiguous::<f32>(s2, l2, "weight")?,
                self.eps,
            )),
            DType::F64 => CpuStorage::F64(fwd(
                contiguous::<f64>(s1, l1, "x")?,
                contiguous::<f64>(s2, l2, "weight")?,
                self.eps,
            )),
            dt => candle_core::bail!("rms_norm: unsupported dtype {dt:?}"),
        };
        Ok((out, shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let n = w.elem_count();
        let rows = x.elem_count() / n.max(1);
        let packed = x.contiguous()?.apply_op3_no_bwd(
            &w.contiguous()?,
            &grad.contiguous()?,
            &RmsNormBwd { eps: self.eps },
        )?;
        let dx = packed.narrow(0, 0, rows)?.reshape(x.shape())?;
        let dw = packed.narrow(0, rows, 1)?.reshape(w.shape())?;
        Ok((Some(dx), Some(dw)))
    }
}

/// Backward of [`RmsNorm`]: `(x, w, g) → [rows + 1, n]`, the rows of `dx` followed by `dw`.
struct RmsNormBwd {
    eps: f64,
}

fn bwd<T: Real>(x: &[T], w: &[T], g: &[T], eps: f64) -> Vec<T> {
    let n = w.len();
    let rows = x.len() / n.max(1);
    let mut out = vec![T::ZERO; (rows + 1) * n];
    let (dx, dw) = out.split_at_mut(rows * n);
    let partials = par_rows(dx, n, 2 * x.len(), |r0, block| {
        let mut dw = vec![T::ZERO; n];
        for (i, dxr) in block.chunks_exact_mut(n).enumerate() {
            let row = r0 + i;
            let xr = &x[row * n..(row + 1) * n];
            let gr = &g[row * n..(row + 1) * n];
            let r = inv_rms(xr, eps);
            // d/dx of x·r·w: r·(g∘w) − x·r³·mean(g∘w∘x).
            let mut s = T::ZERO;
            for ((&g, &w), &x) in gr.iter().zip(w).zip(xr) {
                s += g * w * x;
            }
            let c = s / T::of(n as f64) * r * r * r;
            for j in 0..n {
                dxr[j] = r * gr[j] * w[j] - xr[j] * c;
                dw[j] += gr[j] * xr[j] * r;
            }
        }
        dw
    });
    for p in partials {
        for (d, v) in dw.iter_mut().zip(p) {
            *d += v;
        }
    }
    out
}

impl CustomOp3 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "turnwise-rms-norm-bwd"
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
        let n = l2.shape().elem_count();
        let rows = l1.shape().elem_count() / n.max(1);
        let out = match s1.dtype() {
            DType::F32 => CpuStorage::F32(bwd(
                contiguous::<f32>(s1, l1, "x")?,
                contiguous::<f32>(s2, l2, "weight")?,
                contiguous::<f32>(s3, l3, "grad")?,
                self.eps,
            )),
            DType::F64 => CpuStorage::F64(bwd(
                contiguous::<f64>(s1, l1, "x")?,
                contiguous::<f64>(s2, l2, "weight")?,
                contiguous::<f64>(s3, l3, "grad")?,
                self.eps,
            )),
            dt => candle_core::bail!("rms_norm backward: unsupported dtype {dt:?}"),
        };
        Ok((out, Shape::from((rows + 1, n))))
    }
}
