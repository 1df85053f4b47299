//! Softmax over the last dimension, optionally after adding a broadcast additive mask.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, D, DType, Layout, Result, Shape, Tensor};

use super::{Real, contiguous, dot, fused_on, max, par_rows};

/// `softmax(x)` over the last dimension, one fused op with a hand-written backward. Off the CPU
/// (or for half types, or inside [`super::with_composed_ops`]) this is [`softmax_composed`].
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::F32 | DType::F64 if fused_on(x.device()) => x.contiguous()?.apply_op1(Softmax),
        _ => softmax_composed(x),
    }
}

/// `candle_nn::ops::softmax` over the last dimension, computed in `f32` for `f16`/`bf16` input
/// (a bf16 sum over a long row would keep 8 bits) and returned in the input's dtype: the
/// reference and fallback of [`softmax_last_dim`].
pub fn softmax_composed(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::F16 | DType::BF16 => {
            candle_nn::ops::softmax(&x.to_dtype(DType::F32)?, D::Minus1)?.to_dtype(x.dtype())
        }
        _ => candle_nn::ops::softmax(x, D::Minus1),
    }
}

/// `softmax(x + bias)` over the last dimension, with `bias` broadcast over rows as attention
/// masks are: `bias: [Bb, 1, Tb, K]` (or `[Bb, Tb, K]`) and `x: [Bb, .., M, K]` with `M` a
/// multiple of `Tb`; row `m` of `x` adds bias row `m mod Tb` of its batch entry. So `x` may be
/// `[B, H, T, K]` scores with a `[B, 1, T, K]` mask, or grouped-query scores `[B, KV, G·T, K]`.
///
/// The bias is a constant: it receives no gradient (a bias that tracks gradients is routed
/// through the composition [`masked_softmax_composed`] instead).
pub fn masked_softmax_last_dim(x: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let (bb, tb, k) = bias_dims(bias)?;
    let xd = x.dims();
    let ok = xd.len() >= 2
        && xd[0] == bb
        && xd[xd.len() - 1] == k
        && tb > 0
        && xd[xd.len() - 2].is_multiple_of(tb);
    if !ok {
        candle_core::bail!(
            "masked_softmax_last_dim: bias {:?} does not broadcast over x {:?}",
            bias.dims(),
            xd
        );
    }
    match x.dtype() {
        DType::F32 | DType::F64
            if fused_on(x.device()) && bias.dtype() == x.dtype() && !bias.track_op() =>
        {
            x.contiguous()?
                .apply_op2(&bias.contiguous()?, MaskedSoftmax { tb })
        }
        _ => masked_softmax_composed(x, bias),
    }
}

/// `[Bb, 1, Tb, K]` or `[Bb, Tb, K]` → `(Bb, Tb, K)`.
fn bias_dims(bias: &Tensor) -> Result<(usize, usize, usize)> {
    match *bias.dims() {
        [bb, 1, tb, k] | [bb, tb, k] => Ok((bb, tb, k)),
        ref d => candle_core::bail!("masked softmax: bias must be [B, 1, T, K], got {d:?}"),
    }
}

/// [`masked_softmax_last_dim`] composed from candle ops (`broadcast_add`, then
/// [`softmax_composed`], so in `f32` for half types): its reference and fallback.
pub fn masked_softmax_composed(x: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let (bb, tb, k) = bias_dims(bias)?;
    let xd = x.dims().to_vec();
    let rest: usize = xd[1..xd.len() - 1].iter().product::<usize>() / tb.max(1);
    let x5 = x.reshape((bb, rest, tb, k))?;
    let y = x5.broadcast_add(&bias.reshape((bb, 1, tb, k))?.to_dtype(x.dtype())?)?;
    softmax_composed(&y)?.reshape(xd)
}

/// Writes `softmax(x + b)` of one row into `y` (`b` empty: no bias).
#[inline]
fn softmax_row<T: Real>(x: &[T], b: &[T], y: &mut [T]) {
    if b.is_empty() {
        y.copy_from_slice(x);
    } else {
        for ((y, &x), &b) in y.iter_mut().zip(x).zip(b) {
            *y = x + b;
        }
    }
    let m = max(y);
    let cut = T::of(T::EXP_UNDERFLOW);
    let mut s = T::ZERO;
    for v in y.iter_mut() {
        let d = *v - m;
        // Below the underflow point exp is exactly 0: skip the call (masked keys).
        *v = if d < cut { T::ZERO } else { d.exp() };
        s += *v;
    }
    let inv = T::ONE / s;
    for v in y.iter_mut() {
        *v *= inv;
    }
}

fn fwd<T: Real>(x: &[T], bias: &[T], k: usize, tb: usize) -> Vec<T> {
    let mut y = vec![T::ZERO; x.len()];
    let bb = if bias.is_empty() {
        1
    } else {
        bias.len() / (tb * k)
    };
    let rows_per_batch = (x.len() / k.max(1)) / bb.max(1);
    par_rows(&mut y, k, 4 * x.len(), |r0, block| {
        for (i, yr) in block.chunks_exact_mut(k).enumerate() {
            let r = r0 + i;
            let xr = &x[r * k..(r + 1) * k];
            let br: &[T] = if bias.is_empty() {
                &[]
            } else {
                let b = r / rows_per_batch;
                let t = (r % rows_per_batch) % tb;
                &bias[(b * tb + t) * k..(b * tb + t + 1) * k]
            };
            softmax_row(xr, br, yr);
        }
    });
    y
}

fn run_fwd(
    x: &CpuStorage,
    xl: &Layout,
    bias: Option<(&CpuStorage, &Layout)>,
    tb: usize,
) -> Result<(CpuStorage, Shape)> {
    let shape = xl.shape().clone();
    let k = shape.dims().last().copied().unwrap_or(1);
    macro_rules! go {
        ($t:ty, $v:ident) => {{
            let xs = contiguous::<$t>(x, xl, "x")?;
            let bs = match bias {
                Some((s, l)) => contiguous::<$t>(s, l, "bias")?,
                None => &[],
            };
            CpuStorage::$v(fwd(xs, bs, k, tb))
        }};
    }
    let out = match x.dtype() {
        DType::F32 => go!(f32, F32),
        DType::F64 => go!(f64, F64),
        dt => candle_core::bail!("softmax: unsupported dtype {dt:?}"),
    };
    Ok((out, shape))
}

/// `dx = y ∘ (g − Σ g∘y)` for the softmax output `y` and its gradient `g`.
fn softmax_bwd(y: &Tensor, grad: &Tensor) -> Result<Tensor> {
    y.contiguous()?
        .apply_op2_no_bwd(&grad.contiguous()?, &SoftmaxBwd)
}

struct Softmax;

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        "turnwise-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        run_fwd(s, l, None, 1)
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(softmax_bwd(res, grad)?))
    }
}

struct MaskedSoftmax {
    tb: usize,
}

impl CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "turnwise-masked-softmax"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        run_fwd(s1, l1, Some((s2, l2)), self.tb)
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _bias: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(softmax_bwd(res, grad)?), None))
    }
}

struct SoftmaxBwd;

fn bwd<T: Real>(y: &[T], g: &[T], k: usize) -> Vec<T> {
    let mut dx = vec![T::ZERO; y.len()];
    par_rows(&mut dx, k, 2 * y.len(), |r0, block| {
        for (i, dr) in block.chunks_exact_mut(k).enumerate() {
            let r = r0 + i;
            let yr = &y[r * k..(r + 1) * k];
            let gr = &g[r * k..(r + 1) * k];
            let s = dot(yr, gr);
            for ((d, &y), &g) in dr.iter_mut().zip(yr).zip(gr) {
                *d = y * (g - s);
            }
        }
    });
    dx
}

impl CustomOp2 for SoftmaxBwd {
    fn name(&self) -> &'static str {
        "turnwise-softmax-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let shape = l1.shape().clone();
        let k = shape.dims().last().copied().unwrap_or(1);
        let out = match s1.dtype() {
            DType::F32 => CpuStorage::F32(bwd(
                contiguous::<f32>(s1, l1, "y")?,
                contiguous::<f32>(s2, l2, "grad")?,
                k,
            )),
            DType::F64 => CpuStorage::F64(bwd(
                contiguous::<f64>(s1, l1, "y")?,
                contiguous::<f64>(s2, l2, "grad")?,
                k,
            )),
            dt => candle_core::bail!("softmax backward: unsupported dtype {dt:?}"),
        };
        Ok((out, shape))
    }
}
