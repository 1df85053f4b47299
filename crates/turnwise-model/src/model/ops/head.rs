//! The fused output head: the sampled token's log-probability and the entropy of
//! `softmax(s · h Wᵀ)` straight from the final hidden states `h` and the output projection
//! `W`, without materialising the `[rows, V]` logits, forward and backward.
//!
//! The vocabulary is cut into chunks of [`CHUNK`] rows of `W`. Forward, each chunk's logits
//! (`rows × CHUNK`, one matrix product) give per-row partial statistics (the chunk's maximum,
//! `Σ e^{z−m}`, `Σ e^{z−m}(z−m)` and the target's logit if it falls in the chunk), merged into
//! the log-sum-exp, the log-probability and the entropy; the logits are dropped. Backward, each
//! chunk's logits are computed again and turned in place into the logits' gradient
//! (`gl·(δ_jt − p_j) − ge·p_j·(log p_j + H)`, times `s`), which two matrix products take to the
//! gradients of `h` (summed over chunks) and of the chunk's rows of `W`. Threads split the
//! vocabulary; memory is `threads × rows × CHUNK` instead of `rows × V` (for SmolLM2's 49,152
//! tokens, 24 times less at two threads), at the price of computing the logits twice.
//!
//! Like the other fused ops it serves `f32`/`f64` CPU tensors; elsewhere (CUDA, half types,
//! [`super::with_composed_ops`]) [`head_logprobs_entropy`] is the composition it replaces. The
//! model uses it when the logits would be large ([`fused_head_wanted`]): computing them twice
//! costs time, which only the memory saved pays for.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::simd::ExpKernels;
use super::{Real, contiguous, fused_on, logprob, par_rows};

/// Vocabulary rows per chunk: a chunk's logits for 512 rows take 4 MiB in `f32`.
pub const CHUNK: usize = 2048;

/// The logits (rows × vocabulary) from which the model's head is fused by default: 2²⁶, 256 MiB
/// in `f32`, which the materialised path holds about three times over (the logits, their
/// gradient, the log-prob op's output) in training. Below it, materialising is faster: the fused
/// head computes the logits twice, and measured 0.60–0.91× the materialised head's speed at
/// SmolLM2's training shapes (512 rows × 49,152, forward and backward, this 2-core AVX-512
/// machine, `cargo bench -p turnwise-model --bench model`, ops table; a whole SmolLM2 training
/// step 93 against 103 tokens/s).
pub const FUSED_HEAD_MIN_LOGITS: usize = 1 << 26;

/// Whether the model's head runs fused for `rows` hidden states and a vocabulary of `v`: when
/// the logits reach [`FUSED_HEAD_MIN_LOGITS`], or always / never under `TURNWISE_FUSED_HEAD` =
/// `1` / `0` (read once).
pub fn fused_head_wanted(rows: usize, v: usize) -> bool {
    static FORCED: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let forced = *FORCED.get_or_init(|| match std::env::var("TURNWISE_FUSED_HEAD").as_deref() {
        Ok("1") => Some(true),
        Ok("0") => Some(false),
        _ => None,
    });
    forced.unwrap_or(rows.saturating_mul(v) >= FUSED_HEAD_MIN_LOGITS)
}

/// `(logp, entropy)` of `targets` under `softmax(scale · hidden Wᵀ)`, for `hidden: [.., D]`,
/// `weight: [V, D]` and integer `targets: [..]` (the hidden states' leading dims), both results
/// shaped like `targets`. On `f32`/`f64` CPU tensors this never materialises the logits (see the
/// module); elsewhere it is `token_logprobs_entropy(scale · hidden Wᵀ, targets)` composed
/// from candle ops. Differentiable with respect to `hidden` and `weight`.
pub fn head_logprobs_entropy(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    scale: f64,
) -> Result<(Tensor, Tensor)> {
    let dims = hidden.dims();
    let Some((&d, lead)) = dims.split_last() else {
        candle_core::bail!("head_logprobs_entropy: scalar hidden states");
    };
    let (v, dw) = weight.dims2()?;
    if dw != d {
        candle_core::bail!(
            "head_logprobs_entropy: hidden size {d} does not match the weight's {:?}",
            weight.dims()
        );
    }
    if targets.dims() != lead {
        candle_core::bail!(
            "head_logprobs_entropy: targets {:?} do not match hidden states {:?}",
            targets.dims(),
            dims
        );
    }
    if !(scale.is_finite() && scale > 0.0) {
        candle_core::bail!("head_logprobs_entropy: scale {scale} is not a positive number");
    }
    let fused = fused_on(hidden.device())
        && matches!(hidden.dtype(), DType::F32 | DType::F64)
        && weight.dtype() == hidden.dtype();
    if !fused {
        return head_logprobs_entropy_composed(hidden, weight, targets, scale);
    }
    let rows = lead.iter().product::<usize>();
    let h = hidden.reshape((rows, d))?.contiguous()?;
    let tg = targets.to_dtype(DType::U32)?.flatten_all()?.contiguous()?;
    for &t in &tg.to_vec1::<u32>()? {
        if t as usize >= v {
            candle_core::bail!("head_logprobs_entropy: target {t} >= vocabulary {v}");
        }
    }
    let packed = h.apply_op3(&weight.contiguous()?, &tg, Head { scale })?;
    let logp = packed.narrow(1, 0, 1)?.reshape(lead)?;
    let ent = packed.narrow(1, 1, 1)?.reshape(lead)?;
    Ok((logp, ent))
}

/// [`head_logprobs_entropy`] composed from candle ops: the logits `scale · hidden Wᵀ`, then
/// [`logprob::token_logprobs_entropy`]. Its reference and fallback.
pub fn head_logprobs_entropy_composed(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    scale: f64,
) -> Result<(Tensor, Tensor)> {
    let logits = hidden.broadcast_matmul(&weight.t()?)?;
    let logits = if scale == 1.0 {
        logits
    } else {
        logits.affine(scale, 0.0)?
    };
    logprob::token_logprobs_entropy(&logits, targets)
}

/// `(hidden [R, D], weight [V, D], targets [R] u32) → [R, 3]`: log-prob of the target,
/// entropy, log-sum-exp of the scaled logits.
struct Head {
    scale: f64,
}

/// `dst[m, n] = scale · Σ_k a[m, k] b[n, k]` for row-major `a: [m, K]`, `b: [n, K]` (`a bᵀ`).
fn mul_abt<T: Real>(dst: &mut [T], a: &[T], b: &[T], m: usize, n: usize, k: usize, scale: T) {
    debug_assert!(dst.len() >= m * n && a.len() >= m * k && b.len() >= n * k);
    // SAFETY: the slices hold the extents read and written (checked above in debug builds and by
    // the callers' sizes), and `dst` does not alias `a` or `b`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            1,
            k as isize,
            b.as_ptr(),
            k as isize,
            1,
            T::ZERO,
            scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// `dst[m, n] (+)= Σ_k a[m, k] b[k, n]` for row-major `a: [m, K]`, `b: [K, n]` (`a b`), or, with
/// `a_transposed`, `a: [K, m]` read as its transpose (`aᵀ b`). Accumulates when `add`.
#[allow(clippy::too_many_arguments)]
fn mul_ab<T: Real>(
    dst: &mut [T],
    a: &[T],
    a_transposed: bool,
    b: &[T],
    (m, n, k): (usize, usize, usize),
    add: bool,
) {
    debug_assert!(dst.len() >= m * n && a.len() >= m * k && b.len() >= k * n);
    let (a_cs, a_rs) = if a_transposed {
        (m as isize, 1)
    } else {
        (1, k as isize)
    };
    // SAFETY: as in `mul_abt`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            add,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            1,
            n as isize,
            T::ONE,
            T::ONE,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// One row's statistics over a set of logits `z`: `m = max z`, `s = Σ e^{z−m}`,
/// `t = Σ e^{z−m}(z−m)`, and the target's logit when the set holds it.
#[derive(Debug, Clone, Copy)]
struct Stats {
    m: f64,
    s: f64,
    t: f64,
    target: Option<f64>,
}

impl Stats {
    const EMPTY: Self = Self {
        m: f64::NEG_INFINITY,
        s: 0.0,
        t: 0.0,
        target: None,
    };

    /// The statistics of the union of two disjoint sets.
    fn merge(self, o: Self) -> Self {
        if o.s == 0.0 {
            return Self {
                target: self.target.or(o.target),
                ..self
            };
        }
        if self.s == 0.0 {
            return Self {
                target: self.target.or(o.target),
                ..o
            };
        }
        let m = self.m.max(o.m);
        let (ea, eb) = ((self.m - m).exp(), (o.m - m).exp());
        Self {
            m,
            s: self.s * ea + o.s * eb,
            t: ea * (self.t + self.s * (self.m - m)) + eb * (o.t + o.s * (o.m - m)),
            target: self.target.or(o.target),
        }
    }
}

/// The vocabulary chunks `[start, end)` of a block of `W`'s rows starting at row `v0`.
fn chunks(v0: usize, n: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n.div_ceil(CHUNK)).map(move |c| (v0 + c * CHUNK, v0 + ((c + 1) * CHUNK).min(n)))
}

fn fwd<T: ExpKernels>(h: &[T], w: &[T], targets: &[u32], d: usize, scale: f64) -> Vec<T> {
    let rows = targets.len();
    let v = w.len() / d.max(1);
    // One entry per row of W, so that the threads split the vocabulary; each block returns its
    // rows' statistics.
    let mut unit = vec![(); v];
    let parts = par_rows(&mut unit, 1, 2 * rows * v * d, |v0, block| {
        let n = block.len();
        let mut z = vec![T::ZERO; rows * CHUNK.min(n)];
        let mut stats = vec![Stats::EMPTY; rows];
        for (c0, c1) in chunks(v0, n) {
            let cn = c1 - c0;
            mul_abt(&mut z, h, &w[c0 * d..c1 * d], rows, cn, d, T::of(scale));
            for (r, st) in stats.iter_mut().enumerate() {
                let zr = &z[r * cn..(r + 1) * cn];
                let m = super::max(zr);
                let (s, t) = T::exp_sums(zr, m);
                let tg = targets[r] as usize;
                let chunk = Stats {
                    m: m.to_f64(),
                    s: s.to_f64(),
                    t: t.to_f64(),
                    target: (c0..c1).contains(&tg).then(|| zr[tg - c0].to_f64()),
                };
                *st = st.merge(chunk);
            }
        }
        stats
    });
    let mut out = vec![T::ZERO; rows * 3];
    for (r, o) in out.chunks_exact_mut(3).enumerate() {
        let st = parts.iter().map(|p| p[r]).fold(Stats::EMPTY, Stats::merge);
        let log_s = st.s.ln();
        let lse = st.m + log_s;
        o[0] = T::of(st.target.unwrap_or(f64::NAN) - lse);
        o[1] = T::of(log_s - st.t / st.s);
        o[2] = T::of(lse);
    }
    out
}

impl CustomOp3 for Head {
    fn name(&self) -> &'static str {
        "turnwise-head-logprob-entropy"
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
        let (rows, d) = l1.shape().dims2()?;
        let targets = match (s3, l3.contiguous_offsets()) {
            (CpuStorage::U32(t), Some((a, b))) => &t[a..b],
            _ => candle_core::bail!("head_logprobs_entropy: targets must be contiguous u32"),
        };
        let out = match s1.dtype() {
            DType::F32 => CpuStorage::F32(fwd(
                contiguous::<f32>(s1, l1, "hidden")?,
                contiguous::<f32>(s2, l2, "weight")?,
                targets,
                d,
                self.scale,
            )),
            DType::F64 => CpuStorage::F64(fwd(
                contiguous::<f64>(s1, l1, "hidden")?,
                contiguous::<f64>(s2, l2, "weight")?,
                targets,
                d,
                self.scale,
            )),
            dt => candle_core::bail!("head_logprobs_entropy: unsupported dtype {dt:?}"),
        };
        Ok((out, Shape::from((rows, 3))))
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        targets: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let want_dh = hidden.track_op();
        let want_dw = weight.track_op();
        if !want_dh && !want_dw {
            return Ok((None, None, None));
        }
        let (rows, d) = hidden.dims2()?;
        let v = weight.dims2()?.0;
        // [R, 6]: logp, entropy, lse, d logp, d entropy, target.
        let aux = Tensor::cat(
            &[
                res,
                &grad.narrow(1, 0, 2)?,
                &targets.to_dtype(res.dtype())?.unsqueeze(1)?,
            ],
            1,
        )?
        .contiguous()?;
        let op = HeadBwd {
            scale: self.scale,
            want_dh,
            want_dw,
        };
        let flat = hidden.contiguous()?.apply_op3_no_bwd(weight, &aux, &op)?;
        let dh_len = if want_dh { rows * d } else { 0 };
        let dh = want_dh
            .then(|| flat.narrow(0, 0, dh_len)?.reshape((rows, d)))
            .transpose()?;
        let dw = want_dw
            .then(|| flat.narrow(0, dh_len, v * d)?.reshape((v, d)))
            .transpose()?;
        Ok((dh, dw, None))
    }
}

/// Backward of [`Head`]: `(hidden, weight, aux [R, 6]) → [dh (R·D, if wanted), dw (V·D, if
/// wanted)]` flattened.
struct HeadBwd {
    scale: f64,
    want_dh: bool,
    want_dw: bool,
}

fn bwd<T: ExpKernels>(h: &[T], w: &[T], aux: &[T], d: usize, op: &HeadBwd) -> Vec<T> {
    let rows = aux.len() / 6;
    let v = w.len() / d.max(1);
    let scale = T::of(op.scale);
    let mut dw = vec![T::ZERO; if op.want_dw { v * d } else { v }];
    let row_len = if op.want_dw { d } else { 1 };
    let parts = par_rows(&mut dw, row_len, 6 * rows * v * d, |v0, block| {
        let n = block.len() / row_len;
        let mut z = vec![T::ZERO; rows * CHUNK.min(n)];
        let mut dh = vec![T::ZERO; if op.want_dh { rows * d } else { 0 }];
        for (c0, c1) in chunks(v0, n) {
            let cn = c1 - c0;
            let wc = &w[c0 * d..c1 * d];
            mul_abt(&mut z, h, wc, rows, cn, d, scale);
            // z → d(loss)/d(h·w) for this chunk, in place.
            for r in 0..rows {
                let a = &aux[6 * r..6 * r + 6];
                let (ent, lse, gl, ge) = (a[1], a[2], a[3], a[4]);
                let tg = a[5].to_f64() as usize;
                let zr = &mut z[r * cn..(r + 1) * cn];
                T::logprob_grad_in_place(zr, lse, gl, ge, ent, scale);
                if (c0..c1).contains(&tg) {
                    zr[tg - c0] += gl * scale;
                }
            }
            if op.want_dw {
                let dst = &mut block[(c0 - v0) * d..(c1 - v0) * d];
                mul_ab(dst, &z, true, h, (cn, d, rows), false);
            }
            if op.want_dh {
                mul_ab(&mut dh, &z, false, wc, (rows, d, cn), true);
            }
        }
        dh
    });
    let mut out = Vec::with_capacity(
        if op.want_dh { rows * d } else { 0 } + if op.want_dw { v * d } else { 0 },
    );
    if op.want_dh {
        let mut dh = vec![T::ZERO; rows * d];
        for p in &parts {
            for (a, &b) in dh.iter_mut().zip(p) {
                *a += b;
            }
        }
        out.extend(dh);
    }
    if op.want_dw {
        out.extend(dw);
    }
    out
}

impl CustomOp3 for HeadBwd {
    fn name(&self) -> &'static str {
        "turnwise-head-logprob-entropy-bwd"
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
        let (rows, d) = l1.shape().dims2()?;
        let v = l2.shape().dims2()?.0;
        let n = if self.want_dh { rows * d } else { 0 } + if self.want_dw { v * d } else { 0 };
        let out = match s1.dtype() {
            DType::F32 => CpuStorage::F32(bwd(
                contiguous::<f32>(s1, l1, "hidden")?,
                contiguous::<f32>(s2, l2, "weight")?,
                contiguous::<f32>(s3, l3, "aux")?,
                d,
                self,
            )),
            DType::F64 => CpuStorage::F64(bwd(
                contiguous::<f64>(s1, l1, "hidden")?,
                contiguous::<f64>(s2, l2, "weight")?,
                contiguous::<f64>(s3, l3, "aux")?,
                d,
                self,
            )),
            dt => {
                candle_core::bail!("head_logprobs_entropy backward: unsupported dtype {dt:?}")
            }
        };
        Ok((out, Shape::from(n)))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    use super::super::test_values as values;

    /// Rows, hidden size and a vocabulary that is not a multiple of the chunk (several chunks,
    /// so the threads and the chunk merge both run), targets in every chunk.
    fn case(dtype: DType) -> (Var, Var, Tensor) {
        let (r, d, v) = (13, 24, 2 * CHUNK + 333);
        let dev = Device::Cpu;
        let h = Tensor::from_vec(values(r * d, 1, 1.0), (r, d), &dev).unwrap();
        let w = Tensor::from_vec(values(v * d, 2, 0.8), (v, d), &dev).unwrap();
        let targets: Vec<u32> = (0..r).map(|i| ((i * 977 + 5) % v) as u32).collect();
        let tg = Tensor::from_vec(targets, r, &dev).unwrap();
        (
            Var::from_tensor(&h.to_dtype(dtype).unwrap()).unwrap(),
            Var::from_tensor(&w.to_dtype(dtype).unwrap()).unwrap(),
            tg,
        )
    }

    /// A scalar mixing log-probs and entropies with per-row weights of both signs.
    fn objective(logp: &Tensor, ent: &Tensor) -> Tensor {
        let n = logp.dims1().unwrap();
        let a = Tensor::from_vec(values(n, 3, 1.0), n, logp.device())
            .unwrap()
            .to_dtype(logp.dtype())
            .unwrap();
        let b = Tensor::from_vec(values(n, 4, 1.0), n, logp.device())
            .unwrap()
            .to_dtype(logp.dtype())
            .unwrap();
        ((logp * a).unwrap() + (ent * b).unwrap())
            .unwrap()
            .sum_all()
            .unwrap()
    }

    fn flat(t: &Tensor) -> Vec<f64> {
        t.to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    fn max_err(a: &[f64], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max)
    }

    /// Fused against composed (materialised logits, candle's autograd): log-probs, entropies
    /// and the gradients of the hidden states and of the weight, at temperature 1 and 0.7, in
    /// `f64` (to 1e-10) and `f32` (to 1e-5).
    #[test]
    fn matches_the_composed_head_forward_and_backward() {
        for (dtype, tol) in [(DType::F64, 1e-10), (DType::F32, 1e-5)] {
            for scale in [1.0, 1.0 / 0.7] {
                let (h, w, tg) = case(dtype);
                let (lp, ent) = head_logprobs_entropy(&h, &w, &tg, scale).unwrap();
                let (lp0, ent0) = head_logprobs_entropy_composed(&h, &w, &tg, scale).unwrap();
                assert!(max_err(&flat(&lp), &flat(&lp0)) < tol, "{dtype:?} logp");
                assert!(
                    max_err(&flat(&ent), &flat(&ent0)) < tol,
                    "{dtype:?} entropy"
                );
                let g = objective(&lp, &ent).backward().unwrap();
                let g0 = objective(&lp0, &ent0).backward().unwrap();
                for (name, var) in [("hidden", &h), ("weight", &w)] {
                    let a = flat(g.get(var.as_tensor()).unwrap());
                    let b = flat(g0.get(var.as_tensor()).unwrap());
                    let scale_b = b.iter().fold(0.0f64, |m, x| m.max(x.abs()));
                    assert!(scale_b > 0.0, "{name}: no gradient");
                    let e = max_err(&a, &b);
                    assert!(e < tol * scale_b.max(1.0), "{dtype:?} {name}: max |Δ| {e}");
                }
            }
        }
    }

    /// A frozen weight (LoRA, or a detached model) gets no gradient and costs none; the hidden
    /// states' gradient is unchanged. Leading dimensions are kept.
    #[test]
    fn frozen_weight_and_batched_shapes() {
        let (h, w, tg) = case(DType::F32);
        let w_frozen = w.as_tensor().detach();
        let h3 = h.as_tensor().reshape((1, 13, 24)).unwrap();
        let tg2 = tg.reshape((1, 13)).unwrap();
        let (lp, ent) = head_logprobs_entropy(&h3, &w_frozen, &tg2, 1.0).unwrap();
        assert_eq!(lp.dims(), [1, 13]);
        let obj = objective(&lp.flatten_all().unwrap(), &ent.flatten_all().unwrap());
        let g = obj.backward().unwrap();
        assert!(g.get(&w_frozen).is_none());
        let (lp0, ent0) = head_logprobs_entropy_composed(&h, &w_frozen, &tg, 1.0).unwrap();
        let g0 = objective(&lp0, &ent0).backward().unwrap();
        let e = max_err(
            &flat(g.get(h.as_tensor()).unwrap()),
            &flat(g0.get(h.as_tensor()).unwrap()),
        );
        assert!(e < 1e-5, "hidden gradient {e}");
    }

    /// The model fuses its head from 2²⁶ logits on (unless `TURNWISE_FUSED_HEAD` says
    /// otherwise, which the test suite does not set).
    #[test]
    fn the_model_fuses_large_heads_only() {
        if std::env::var_os("TURNWISE_FUSED_HEAD").is_some() {
            return;
        }
        assert!(!fused_head_wanted(512, 49_152));
        assert!(fused_head_wanted(1366, 49_152));
        assert!(fused_head_wanted(FUSED_HEAD_MIN_LOGITS, 1));
        assert!(!fused_head_wanted(FUSED_HEAD_MIN_LOGITS - 1, 1));
    }

    #[test]
    fn bad_inputs_are_refused() {
        let (h, w, _) = case(DType::F32);
        let v = w.dims2().unwrap().0 as u32;
        let tg = Tensor::from_vec(vec![v; 13], 13, &Device::Cpu).unwrap();
        let e = head_logprobs_entropy(&h, &w, &tg, 1.0)
            .unwrap_err()
            .to_string();
        assert!(e.contains(">= vocabulary"), "{e}");
        let short = Tensor::zeros(12, DType::U32, &Device::Cpu).unwrap();
        assert!(head_logprobs_entropy(&h, &w, &short, 1.0).is_err());
        let ok = Tensor::zeros(13, DType::U32, &Device::Cpu).unwrap();
        assert!(head_logprobs_entropy(&h, &w, &ok, 0.0).is_err());
        let wrong_d = w.as_tensor().narrow(1, 0, 20).unwrap();
        assert!(head_logprobs_entropy(&h, &wrong_d, &ok, 1.0).is_err());
    }
}
