//! Log-probability of a target token and entropy of the softmax, per row of logits.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, D, DType, Layout, Result, Shape, Tensor};

use super::simd::ExpKernels;
use super::{contiguous, fused_on, max, par_rows};

/// For logits `[.., V]` and integer `targets: [..]` (same leading dims): `(logp, entropy)`,
/// both `[..]`, where `logp = log_softmax(logits)[target]` and `entropy = −Σ p log p`. One
/// fused pass forward and one backward (gradient for the logits). `f16`/`bf16` logits are
/// computed in `f32` and give `f32` results (a bf16 log-probability keeps 8 bits, too few for
/// importance ratios). Off the CPU (or inside [`super::with_composed_ops`]) this is
/// [`token_logprobs_entropy_composed`].
pub fn token_logprobs_entropy(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    let dims = logits.dims();
    let Some((&v, lead)) = dims.split_last() else {
        candle_core::bail!("token_logprobs_entropy: scalar logits");
    };
    if targets.dims() != lead {
        candle_core::bail!(
            "token_logprobs_entropy: targets {:?} do not match logits {:?}",
            targets.dims(),
            dims
        );
    }
    let fused = fused_on(logits.device());
    match logits.dtype() {
        DType::F32 | DType::F64 if fused => {
            let rows = lead.iter().product::<usize>();
            let tg = targets.to_dtype(DType::U32)?.flatten_all()?.contiguous()?;
            let packed = logits
                .reshape((rows, v))?
                .contiguous()?
                .apply_op2(&tg, LogprobEntropy)?;
            let logp = packed.narrow(1, 0, 1)?.reshape(lead)?;
            let ent = packed.narrow(1, 1, 1)?.reshape(lead)?;
            Ok((logp, ent))
        }
        DType::F16 | DType::BF16 if fused => {
            token_logprobs_entropy(&logits.to_dtype(DType::F32)?, targets)
        }
        _ => token_logprobs_entropy_composed(logits, targets),
    }
}

/// [`token_logprobs_entropy`] composed from candle ops (log-softmax with the detached row
/// maximum, `gather`, `exp`, `sum`): its reference and fallback. Half-precision logits are
/// computed in `f32` and give `f32` results, as in [`token_logprobs_entropy`].
pub fn token_logprobs_entropy_composed(
    logits: &Tensor,
    targets: &Tensor,
) -> Result<(Tensor, Tensor)> {
    if matches!(logits.dtype(), DType::F16 | DType::BF16) {
        return token_logprobs_entropy_composed(&logits.to_dtype(DType::F32)?, targets);
    }
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let z = logits.broadcast_sub(&max)?;
    let lse = z.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let logp_all = z.broadcast_sub(&lse)?;
    let idx = targets
        .to_dtype(DType::U32)?
        .unsqueeze(D::Minus1)?
        .contiguous()?;
    let logp = logp_all.gather(&idx, D::Minus1)?.squeeze(D::Minus1)?;
    let entropy = (logp_all.exp()? * &logp_all)?.sum(D::Minus1)?.neg()?;
    Ok((logp, entropy))
}

/// `(logits [R, V], targets [R] u32) → [R, 2]`: log-prob of the target, entropy.
struct LogprobEntropy;

fn target_of(t: u32, v: usize) -> Result<usize> {
    let t = t as usize;
    if t >= v {
        candle_core::bail!("token_logprobs_entropy: target {t} >= vocabulary {v}");
    }
    Ok(t)
}

fn fwd<T: ExpKernels>(z: &[T], targets: &[u32], v: usize) -> Result<Vec<T>> {
    for &t in targets {
        target_of(t, v)?;
    }
    let mut out = vec![T::ZERO; targets.len() * 2];
    par_rows(&mut out, 2, z.len(), |r0, block| {
        for (i, o) in block.chunks_exact_mut(2).enumerate() {
            let r = r0 + i;
            let zr = &z[r * v..(r + 1) * v];
            let m = max(zr);
            // Σ e, Σ e·(z − m) with e = exp(z − m).
            let (se, sez) = T::exp_sums(zr, m);
            let log_se = se.ln();
            o[0] = zr[targets[r] as usize] - m - log_se;
            o[1] = log_se - sez / se;
        }
    });
    Ok(out)
}

impl CustomOp2 for LogprobEntropy {
    fn name(&self) -> &'static str {
        "turnwise-logprob-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, v) = l1.shape().dims2()?;
        let targets = match (s2, l2.contiguous_offsets()) {
            (CpuStorage::U32(t), Some((a, b))) => &t[a..b],
            _ => candle_core::bail!("token_logprobs_entropy: targets must be contiguous u32"),
        };
        let out = match s1.dtype() {
            DType::F32 => CpuStorage::F32(fwd(contiguous::<f32>(s1, l1, "logits")?, targets, v)?),
            DType::F64 => CpuStorage::F64(fwd(contiguous::<f64>(s1, l1, "logits")?, targets, v)?),
            dt => candle_core::bail!("token_logprobs_entropy: unsupported dtype {dt:?}"),
        };
        Ok((out, Shape::from((rows, 2))))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // [R, 4]: logp, entropy, d logp, d entropy.
        let aux = Tensor::cat(&[res, grad], 1)?.contiguous()?;
        let dz = logits
            .contiguous()?
            .apply_op3_no_bwd(targets, &aux, &LogprobEntropyBwd)?;
        Ok((Some(dz), None))
    }
}

/// Backward: `dz_j = gl·(δ_jt − p_j) − ge·p_j·(log p_j + H)`.
struct LogprobEntropyBwd;

fn bwd<T: ExpKernels>(z: &[T], targets: &[u32], aux: &[T], v: usize) -> Vec<T> {
    let mut dz = vec![T::ZERO; z.len()];
    par_rows(&mut dz, v, 2 * z.len(), |r0, block| {
        for (i, dr) in block.chunks_exact_mut(v).enumerate() {
            let r = r0 + i;
            let zr = &z[r * v..(r + 1) * v];
            let t = targets[r] as usize;
            let (logp_t, h, gl, ge) = (aux[4 * r], aux[4 * r + 1], aux[4 * r + 2], aux[4 * r + 3]);
            let lse = zr[t] - logp_t;
            T::logprob_grad(dr, zr, lse, gl, ge, h, T::ONE);
            dr[t] += gl;
        }
    });
    dz
}

impl CustomOp3 for LogprobEntropyBwd {
    fn name(&self) -> &'static str {
        "turnwise-logprob-entropy-bwd"
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
        let (_, v) = l1.shape().dims2()?;
        let targets = match (s2, l2.contiguous_offsets()) {
            (CpuStorage::U32(t), Some((a, b))) => &t[a..b],
            _ => candle_core::bail!("token_logprobs_entropy: targets must be contiguous u32"),
        };
        let out = match s1.dtype() {
            DType::F32 => CpuStorage::F32(bwd(
                contiguous::<f32>(s1, l1, "logits")?,
                targets,
                contiguous::<f32>(s3, l3, "aux")?,
                v,
            )),
            DType::F64 => CpuStorage::F64(bwd(
                contiguous::<f64>(s1, l1, "logits")?,
                targets,
                contiguous::<f64>(s3, l3, "aux")?,
                v,
            )),
            dt => candle_core::bail!("token_logprobs_entropy backward: unsupported dtype {dt:?}"),
        };
        Ok((out, l1.shape().clone()))
    }
}
