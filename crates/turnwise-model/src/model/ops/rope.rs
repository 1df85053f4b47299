//! Rotary position embedding, rotate-half form, with per-row tables.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, D, DType, Layout, Result, Shape, Tensor};

use super::{Real, fused_on, par_rows};

/// `x·cos + rotate_half(x)·sin` for `x: [B, H, T, D]` (any strides, e.g. a transposed view) and
/// `cos, sin: [B or 1, 1 or H, T, D]`, where `rotate_half(x) = cat(−x[D/2..], x[..D/2])`. One
/// fused op with a hand-written backward for `x` (the tables are constants); the result is
/// contiguous. Odd `D`, half types, non-CPU devices and [`super::with_composed_ops`] use
/// [`rope_composed`].
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, h, t, d) = x.dims4()?;
    for (name, tab) in [("cos", cos), ("sin", sin)] {
        let (tb, th, tt, td) = tab.dims4()?;
        if !((tb == b || tb == 1) && (th == h || th == 1) && tt == t && td == d) {
            candle_core::bail!(
                "rope: {name} {:?} does not broadcast to x {:?}",
                tab.dims(),
                x.dims()
            );
        }
    }
    let fused = matches!(x.dtype(), DType::F32 | DType::F64)
        && fused_on(x.device())
        && d % 2 == 0
        && cos.dtype() == x.dtype()
        && sin.dtype() == x.dtype()
        && !cos.track_op()
        && !sin.track_op();
    if fused {
        x.apply_op3(cos, sin, Rope { inverse: false })
    } else {
        rope_composed(x, cos, sin)
    }
}

/// `cat(−x2, x1)` over the last dimension.
fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let x1 = x.narrow(D::Minus1, 0, d / 2)?;
    let x2 = x.narrow(D::Minus1, d / 2, d - d / 2)?;
    Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)
}

/// [`rope`] composed from candle ops: its reference and fallback.
pub fn rope_composed(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    x.broadcast_mul(cos)? + rotate_half(x)?.broadcast_mul(sin)?
}

/// The rotation (`inverse: false`) or its transpose (`inverse: true`, the backward pass).
struct Rope {
    inverse: bool,
}

/// Strides of a 4-d layout with broadcast (size-1) dimensions given stride 0.
fn strides4(l: &Layout) -> [usize; 4] {
    let (d, s) = (l.dims(), l.stride());
    std::array::from_fn(|i| if d[i] == 1 { 0 } else { s[i] })
}

fn kernel<T: Real>(
    (x, xl): (&[T], &Layout),
    (c, cl): (&[T], &Layout),
    (s, sl): (&[T], &Layout),
    inverse: bool,
) -> Vec<T> {
    let dims = xl.dims();
    let (hn, tn, dn) = (dims[1], dims[2], dims[3]);
    let half = dn / 2;
    let (xs, cs, ss) = (strides4(xl), strides4(cl), strides4(sl));
    let (xo, co, so) = (xl.start_offset(), cl.start_offset(), sl.start_offset());
    let n = xl.shape().elem_count();
    let mut out = vec![T::ZERO; n];
    par_rows(&mut out, dn, 2 * n, |r0, block| {
        for (i, yr) in block.chunks_exact_mut(dn).enumerate() {
            let r = r0 + i;
            let (b, h, t) = (r / (hn * tn), (r / tn) % hn, r % tn);
            let xb = xo + b * xs[0] + h * xs[1] + t * xs[2];
            let cb = co + b * cs[0] + h * cs[1] + t * cs[2];
            let sb = so + b * ss[0] + h * ss[1] + t * ss[2];
            let (y1, y2) = yr.split_at_mut(half);
            if xs[3] == 1 && cs[3] == 1 && ss[3] == 1 {
                let (x1, x2) = (&x[xb..xb + half], &x[xb + half..xb + dn]);
                let (c1, c2) = (&c[cb..cb + half], &c[cb + half..cb + dn]);
                let (s1, s2) = (&s[sb..sb + half], &s[sb + half..sb + dn]);
                for j in 0..half {
                    if inverse {
                        y1[j] = x1[j] * c1[j] + x2[j] * s2[j];
                        y2[j] = x2[j] * c2[j] - x1[j] * s1[j];
                    } else {
                        y1[j] = x1[j] * c1[j] - x2[j] * s1[j];
                        y2[j] = x2[j] * c2[j] + x1[j] * s2[j];
                    }
                }
            } else {
                for j in 0..half {
                    let (x1, x2) = (x[xb + j * xs[3]], x[xb + (j + half) * xs[3]]);
                    let (c1, c2) = (c[cb + j * cs[3]], c[cb + (j + half) * cs[3]]);
                    let (s1, s2) = (s[sb + j * ss[3]], s[sb + (j + half) * ss[3]]);
                    if inverse {
                        y1[j] = x1 * c1 + x2 * s2;
                        y2[j] = x2 * c2 - x1 * s1;
                    } else {
                        y1[j] = x1 * c1 - x2 * s1;
                        y2[j] = x2 * c2 + x1 * s2;
                    }
                }
            }
        }
    });
    out
}

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        if self.inverse {
            "turnwise-rope-bwd"
        } else {
            "turnwise-rope"
        }
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
        macro_rules! go {
            ($t:ty, $v:ident) => {{
                fn get(s: &CpuStorage) -> Result<&[$t]> {
                    <$t as Real>::slice(s)
                        .ok_or_else(|| candle_core::Error::Msg("rope: dtype mismatch".into()))
                }
                CpuStorage::$v(kernel(
                    (get(s1)?, l1),
                    (get(s2)?, l2),
                    (get(s3)?, l3),
                    self.inverse,
                ))
            }};
        }
        let out = match s1.dtype() {
            DType::F32 => go!(f32, F32),
            DType::F64 => go!(f64, F64),
            dt => candle_core::bail!("rope: unsupported dtype {dt:?}"),
        };
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dx = grad.apply_op3_no_bwd(
            cos,
            sin,
            &Rope {
                inverse: !self.inverse,
            },
        )?;
        Ok((Some(dx), None, None))
    }
}
