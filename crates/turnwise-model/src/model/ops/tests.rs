//! Each fused op against the composition of plain candle ops it replaces: forward within 1e-5,
//! gradients (candle autograd through the composition) within 1e-4 (relative to the largest
//! gradient entry when that exceeds 1), on random inputs with
//! padded and masked rows, in f32 and f64.

use candle_core::{DType, Device, Tensor, Var};

use super::logprob::token_logprobs_entropy_composed;
use super::rms_norm::rms_norm_composed;
use super::rope::rope_composed;
use super::softmax::masked_softmax_composed;
use super::*;

const FWD_TOL: f64 = 1e-5;
const BWD_TOL: f64 = 1e-4;

/// Deterministic values in about [-scale, scale].
fn rand(shape: &[usize], seed: u64, scale: f64, dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let v: Vec<f64> = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// Gradients of `Σ r ∘ f(vars)` for each var, `r` random.
fn grads_of(vars: &[&Var], f: impl Fn(&[Tensor]) -> Tensor, seed: u64) -> (Tensor, Vec<Tensor>) {
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts);
    let r = rand(y.dims(), seed, 1.0, y.dtype());
    let loss = (&y * r).unwrap().sum_all().unwrap();
    let g = loss.backward().unwrap();
    let gs = ts.iter().map(|t| g.get(t).unwrap().clone()).collect();
    (y, gs)
}

/// Checks `fused` against `reference` forward and backward with respect to `inputs`.
fn check(
    name: &str,
    inputs: &[Tensor],
    fused: impl Fn(&[Tensor]) -> Tensor,
    reference: impl Fn(&[Tensor]) -> Tensor,
) {
    let va: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let vb: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let (ya, ga) = grads_of(&va.iter().collect::<Vec<_>>(), fused, 7);
    let (yb, gb) = grads_of(&vb.iter().collect::<Vec<_>>(), reference, 7);
    let d = max_diff(&ya, &yb);
    assert!(d < FWD_TOL, "{name}: forward differs by {d:e}");
    for (i, (a, b)) in ga.iter().zip(&gb).enumerate() {
        // Absolute for gradients of order 1; relative to the largest entry above that (an
        // all-zero RMSNorm row has gradients of order 1/sqrt(eps) = 1000, where f32 rounding
        // alone is 1e-4).
        let scale = max_diff(b, &b.zeros_like().unwrap()).max(1.0);
        let d = max_diff(a, b) / scale;
        assert!(
            d < BWD_TOL,
            "{name}: gradient of input {i} differs by {d:e} (scaled)"
        );
    }
}

#[test]
fn rms_norm_matches_composition() {
    for dtype in [DType::F32, DType::F64] {
        for (shape, n) in [
            (vec![3usize, 5, 16], 16usize),
            (vec![2, 7, 3, 8], 8),
            (vec![70, 96], 96),
        ] {
            let mut x = rand(&shape, 1, 2.0, dtype);
            // A zero row (as padding may be) and a tiny one.
            let rows = x.elem_count() / n;
            let mut flat = x
                .flatten_all()
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            flat[..n].iter_mut().for_each(|v| *v = 0.0);
            flat[n..2 * n].iter_mut().for_each(|v| *v *= 1e-3);
            assert!(rows > 2);
            x = Tensor::from_vec(flat, shape.as_slice(), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let w = (rand(&[n], 2, 0.5, dtype) + 1.0).unwrap();
            check(
                &format!("rms_norm {dtype:?} {shape:?}"),
                &[x, w],
                |t| rms_norm(&t[0], &t[1], 1e-6).unwrap(),
                |t| rms_norm_composed(&t[0], &t[1], 1e-6).unwrap(),
            );
        }
    }
}

#[test]
fn rms_norm_large_input_runs_in_parallel_and_matches() {
    // Above the parallel threshold (rows split over threads, dw summed over blocks).
    let x = rand(&[600, 256], 3, 1.0, DType::F32);
    let w = rand(&[256], 4, 1.0, DType::F32);
    check(
        "rms_norm large",
        &[x, w],
        |t| rms_norm(&t[0], &t[1], 1e-6).unwrap(),
        |t| rms_norm_composed(&t[0], &t[1], 1e-6).unwrap(),
    );
}

/// An attention bias `[B, 1, T, K]`: causal over `past + T` keys, row 0 left-padded by `pad`.
fn attention_bias(b: usize, t: usize, past: usize, pad: usize, dtype: DType) -> Tensor {
    let k = past + t;
    let mut v = Vec::with_capacity(b * t * k);
    for row in 0..b {
        for i in 0..t {
            let qi = past + i;
            for j in 0..k {
                let real = !(row == 0 && j < pad);
                let visible = j == qi || (j < qi && real);
                v.push(if visible { 0.0 } else { -1e9 });
            }
        }
    }
    Tensor::from_vec(v, (b, 1, t, k), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

#[test]
fn masked_softmax_matches_composition() {
    for dtype in [DType::F32, DType::F64] {
        // (batch, heads stacked on the query axis, T, past)
        for (b, stack, t, past) in [(2usize, 4usize, 5usize, 0usize), (3, 2, 1, 6), (2, 1, 9, 3)] {
            let k = past + t;
            let x = rand(&[b, stack, t, k], 5, 4.0, dtype);
            let bias = attention_bias(b, t, past, 3, dtype);
            check(
                &format!("masked softmax {dtype:?} [{b}, {stack}, {t}, {k}]"),
                &[x],
                |ts| masked_softmax_last_dim(&ts[0], &bias).unwrap(),
                |ts| masked_softmax_composed(&ts[0], &bias).unwrap(),
            );
            // Grouped-query layout: [B, KV, G·T, K] with the same [B, 1, T, K] bias.
            let xg = rand(&[b, 2, 3 * t, k], 6, 4.0, dtype);
            check(
                &format!("masked softmax GQA {dtype:?}"),
                &[xg],
                |ts| masked_softmax_last_dim(&ts[0], &bias).unwrap(),
                |ts| {
                    let x5 = ts[0].reshape((b, 2, 3, t, k)).unwrap();
                    let y = x5.broadcast_add(&bias.unsqueeze(1).unwrap()).unwrap();
                    candle_nn::ops::softmax(&y, candle_core::D::Minus1)
                        .unwrap()
                        .reshape((b, 2, 3 * t, k))
                        .unwrap()
                },
            );
        }
    }
}

#[test]
fn softmax_matches_composition() {
    for dtype in [DType::F32, DType::F64] {
        for shape in [vec![4usize, 3, 10], vec![2, 300, 257]] {
            let x = rand(&shape, 8, 6.0, dtype);
            check(
                &format!("softmax {dtype:?} {shape:?}"),
                &[x],
                |t| softmax_last_dim(&t[0]).unwrap(),
                |t| candle_nn::ops::softmax(&t[0], candle_core::D::Minus1).unwrap(),
            );
        }
    }
}

/// `cos, sin: [B, 1, T, D]` for per-row positions, rotate-half layout.
fn rope_tables(pos: &[Vec<u32>], d: usize, dtype: DType) -> (Tensor, Tensor) {
    let (b, t) = (pos.len(), pos[0].len());
    let mut c = Vec::new();
    let mut s = Vec::new();
    for row in pos {
        for &p in row {
            for _ in 0..2 {
                for i in 0..d / 2 {
                    let a = p as f64 / 10_000f64.powf(2.0 * i as f64 / d as f64);
                    c.push(a.cos());
                    s.push(a.sin());
                }
            }
        }
    }
    let mk = |v: Vec<f64>| {
        Tensor::from_vec(v, (b, 1, t, d), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    };
    (mk(c), mk(s))
}

#[test]
fn rope_matches_composition() {
    for dtype in [DType::F32, DType::F64] {
        for (b, h, t, d) in [
            (2usize, 3usize, 5usize, 8usize),
            (1, 2, 1, 16),
            (3, 4, 40, 32),
        ] {
            // Row 0 left-padded by two (positions 0, 0, 0, 1, ...), the others offset.
            let pos: Vec<Vec<u32>> = (0..b)
                .map(|r| {
                    (0..t as u32)
                        .map(|i| {
                            if r == 0 {
                                i.saturating_sub(2)
                            } else {
                                i + 7 * r as u32
                            }
                        })
                        .collect()
                })
                .collect();
            let (cos, sin) = rope_tables(&pos, d, dtype);
            // x laid out [B, T, H, D] and viewed transposed, as in the model.
            let x = rand(&[b, t, h, d], 9, 1.5, dtype);
            check(
                &format!("rope {dtype:?} [{b}, {h}, {t}, {d}]"),
                &[x],
                |ts| rope(&ts[0].transpose(1, 2).unwrap(), &cos, &sin).unwrap(),
                |ts| rope_composed(&ts[0].transpose(1, 2).unwrap(), &cos, &sin).unwrap(),
            );
        }
    }
}

#[test]
fn rope_is_contiguous_and_rotation_preserves_norm() {
    let (cos, sin) = rope_tables(&[vec![3, 11]], 8, DType::F64);
    let x = rand(&[1, 2, 2, 8], 10, 1.0, DType::F64);
    let y = rope(&x.transpose(1, 2).unwrap(), &cos, &sin).unwrap();
    assert!(y.is_contiguous());
    let n = |t: &Tensor| {
        t.sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    assert!((n(&x) - n(&y)).abs() < 1e-12);
}

#[test]
fn token_logprobs_entropy_matches_composition() {
    for dtype in [DType::F32, DType::F64] {
        for (b, t, v) in [(2usize, 3usize, 11usize), (3, 70, 300)] {
            let x = rand(&[b, t, v], 11, 5.0, dtype);
            let tg: Vec<u32> = (0..b * t).map(|i| ((i * 37 + 5) % v) as u32).collect();
            let tg = Tensor::from_vec(tg, (b, t), &Device::Cpu).unwrap();
            for part in 0..2 {
                check(
                    &format!("logprob/entropy {dtype:?} [{b}, {t}, {v}] output {part}"),
                    std::slice::from_ref(&x),
                    |ts| {
                        let (l, e) = token_logprobs_entropy(&ts[0], &tg).unwrap();
                        Tensor::stack(&[l, e], 0).unwrap().get(part).unwrap()
                    },
                    |ts| {
                        let (l, e) = token_logprobs_entropy_composed(&ts[0], &tg).unwrap();
                        Tensor::stack(&[l, e], 0).unwrap().get(part).unwrap()
                    },
                );
            }
            // Both outputs in one objective.
            check(
                &format!("logprob+entropy {dtype:?}"),
                &[x],
                |ts| {
                    let (l, e) = token_logprobs_entropy(&ts[0], &tg).unwrap();
                    (l - (e * 0.3).unwrap()).unwrap()
                },
                |ts| {
                    let (l, e) = token_logprobs_entropy_composed(&ts[0], &tg).unwrap();
                    (l - (e * 0.3).unwrap()).unwrap()
                },
            );
        }
    }
}

#[test]
fn token_logprobs_entropy_rejects_out_of_range_targets() {
    let x = rand(&[1, 2, 5], 12, 1.0, DType::F32);
    let tg = Tensor::new(&[[1u32, 5]], &Device::Cpu).unwrap();
    assert!(token_logprobs_entropy(&x, &tg).is_err());
}

/// `x Wᵀ` by candle's matmul, the reference of the no-grad kernels.
fn matmul_t(x: &Tensor, w: &Tensor) -> Tensor {
    x.matmul(&w.t().unwrap()).unwrap()
}

#[test]
fn infer_linear_matches_matmul_on_every_tile_shape() {
    // Row and column counts around the tiles (4 × 4 on AVX-512, 2 × 4 on AVX2), K around the
    // 16- and 8-lane chunks.
    for &m in &[1usize, 3, 4, 5, 8, 13] {
        for &n in &[1usize, 4, 6, 33] {
            for &k in &[1usize, 15, 16, 17, 40] {
                let x = rand(&[m, k], (m * 100 + n * 10 + k) as u64, 2.0, DType::F32);
                let w = rand(&[n, k], (m + n * 7 + k * 13) as u64, 2.0, DType::F32);
                let want = matmul_t(&x, &w);
                let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let ws = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                for isa in infer::KernelIsa::supported() {
                    let y = infer::matmul_xwt(&xs, &ws, m, n, k, isa).unwrap();
                    let y = Tensor::from_vec(y, (m, n), &Device::Cpu).unwrap();
                    let d = max_diff(&y, &want);
                    assert!(d <= FWD_TOL * 10.0, "[{m},{k}]x[{n},{k}]ᵀ {isa:?}: {d}");
                }
                if let Some(y) = infer::linear(&x, &w, usize::MAX).unwrap() {
                    assert!(max_diff(&y, &want) <= FWD_TOL * 10.0);
                }
            }
        }
    }
    // Large enough to split over threads.
    let (m, n, k) = (32, 1000, 256);
    let x = rand(&[m, k], 1, 1.0, DType::F32);
    let w = rand(&[n, k], 2, 1.0, DType::F32);
    let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let ws = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for isa in infer::KernelIsa::supported() {
        let y = infer::matmul_xwt(&xs, &ws, m, n, k, isa).unwrap();
        let y = Tensor::from_vec(y, (m, n), &Device::Cpu).unwrap();
        assert!(max_diff(&y, &matmul_t(&x, &w)) <= 1e-4, "{isa:?}");
        assert!(infer::matmul_xwt(&xs, &ws, m, n, k + 1, isa).is_err());
    }
    // Every x86-64 CPU this runs on has AVX2 or better (the test machines do): the kernels are
    // exercised, not only the portable path.
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        assert!(infer::KernelIsa::supported().contains(&infer::KernelIsa::Avx2));
    }
}

/// Several weights in one pass: each output equals that weight's own pass bit for bit, with
/// column counts that put the threads' block boundaries inside and between weights.
#[test]
fn infer_linear_many_equals_one_weight_at_a_time() {
    for (m, ns) in [
        (9usize, vec![130usize, 7, 125]),
        (3, vec![5, 1]),
        (64, vec![512, 128, 128]),
    ] {
        let k = 512;
        let x = rand(&[m, k], m as u64, 1.0, DType::F32);
        let ws: Vec<Tensor> = ns
            .iter()
            .enumerate()
            .map(|(i, &n)| rand(&[n, k], 50 + i as u64, 1.0, DType::F32))
            .collect();
        let refs: Vec<&Tensor> = ws.iter().collect();
        let many = infer::linear_many(&x, &refs, usize::MAX).unwrap();
        let Some(many) = many else {
            // No AVX2 or AVX-512 here: both declined, the caller falls back to matmul.
            assert!(infer::linear(&x, &ws[0], usize::MAX).unwrap().is_none());
            continue;
        };
        for (w, y) in ws.iter().zip(&many) {
            let one = infer::linear(&x, w, usize::MAX).unwrap().unwrap();
            assert_eq!(max_diff(y, &one), 0.0, "m={m}, ns={ns:?}");
            assert!(max_diff(y, &matmul_t(&x, w)) <= 1e-4);
        }
    }
    // One unsuitable weight declines the whole call.
    let x = rand(&[4, 16], 3, 1.0, DType::F32);
    let (w, w_bad) = (
        rand(&[8, 16], 4, 1.0, DType::F32),
        rand(&[8, 15], 5, 1.0, DType::F32),
    );
    assert!(infer::linear_many(&x, &[&w, &w_bad], 32).unwrap().is_none());
}

#[test]
fn infer_linear_declines_what_it_does_not_cover() {
    let x = rand(&[4, 16], 3, 1.0, DType::F32);
    let w = rand(&[8, 16], 4, 1.0, DType::F32);
    // More rows than allowed, a graph to record, another dtype, mismatched K: the caller's
    // differentiable matmul runs instead.
    assert!(infer::linear(&x, &w, 3).unwrap().is_none());
    let v = Var::from_tensor(&w).unwrap();
    assert!(infer::linear(&x, v.as_tensor(), 32).unwrap().is_none());
    let x64 = x.to_dtype(DType::F64).unwrap();
    let w64 = w.to_dtype(DType::F64).unwrap();
    assert!(infer::linear(&x64, &w64, 32).unwrap().is_none());
    let w_bad = rand(&[8, 15], 5, 1.0, DType::F32);
    assert!(infer::linear(&x, &w_bad, 32).unwrap().is_none());
}

/// One output of the AVX-512 sampling kernel as it has always been computed (the arithmetic
/// every stored run's numbers depend on): 16 lane accumulators, each fused-multiply-added over
/// `p = 0, 16, 32, ..` in order (in the last chunk the lanes past `k` add `0 · 0`, as the
/// masked zeroing load gives), then `_mm512_reduce_add_ps`'s tree: lanes `l + 8` onto `l`,
/// then `l + 4`, `l + 2`, `l + 1`, the lower lane always the left operand.
fn lanes16_dot(x: &[f32], w: &[f32]) -> f32 {
    let k = x.len();
    let mut acc = [0f32; 16];
    let mut p = 0;
    while p < k {
        for (l, a) in acc.iter_mut().enumerate() {
            let (xv, wv) = if p + l < k {
                (x[p + l], w[p + l])
            } else {
                (0.0, 0.0)
            };
            *a = xv.mul_add(wv, *a);
        }
        p += 16;
    }
    let s8: [f32; 8] = std::array::from_fn(|l| acc[l] + acc[l + 8]);
    let s4: [f32; 4] = std::array::from_fn(|l| s8[l] + s8[l + 4]);
    let s2: [f32; 2] = std::array::from_fn(|l| s4[l] + s4[l + 2]);
    s2[0] + s2[1]
}

/// The AVX-512 kernel's outputs are bit for bit those of its original arithmetic
/// ([`lanes16_dot`]) whatever its tiles, loop order, prefetching or reduction: for every row
/// count of a decoding batch and around it (1..=17), `k` at SmolLM2's widths (576, 1536), one
/// chunk, a tail and below one chunk, column counts around the 4-column tiles and SmolLM2's,
/// over the whole matrix (the threads' split) and over column sub-ranges that start and end
/// inside and between tiles (one thread's block).
#[test]
fn infer_avx512_kernel_keeps_its_arithmetic_bit_for_bit() {
    if !infer::KernelIsa::supported().contains(&infer::KernelIsa::Avx512) {
        eprintln!("skipped: this CPU has no AVX-512");
        return;
    }
    let isa = infer::KernelIsa::Avx512;
    let vecs = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut cases: Vec<(usize, usize, usize)> = Vec::new();
    for m in 1..=17 {
        for k in [1, 16, 37, 576, 1536] {
            for n in (1..=9).chain([576]) {
                cases.push((m, n, k));
            }
        }
    }
    // The output head's shape at batch 1.
    cases.push((1, 49152, 576));
    for (m, n, k) in cases {
        let x = vecs(rand(&[m, k], (m * 31 + k) as u64, 2.0, DType::F32));
        let w = vecs(rand(&[n, k], (n * 17 + k * 3) as u64, 1.5, DType::F32));
        let want: Vec<u32> = (0..m * n)
            .map(|e| {
                let (i, j) = (e / n, e % n);
                lanes16_dot(&x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k]).to_bits()
            })
            .collect();
        let check = |y: &[f32], what: &str| {
            for (e, (a, b)) in y.iter().zip(&want).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    *b,
                    "[{m},{k}]x[{n},{k}]ᵀ {what}: y[{}, {}] = {a}, want {}",
                    e / n,
                    e % n,
                    f32::from_bits(*b)
                );
            }
        };
        check(&infer::matmul_xwt(&x, &w, m, n, k, isa).unwrap(), "whole");
        // Column blocks as threads get them: boundaries on and off the 4-column tiles.
        let (a, b) = (n / 3, (2 * n / 3 + 1).min(n));
        let mut y = vec![f32::NAN; m * n];
        for range in [(0, a), (a, b), (b, n)] {
            infer::matmul_xwt_columns(&x, &w, m, n, k, range, isa, &mut y);
        }
        check(&y, "in column blocks");
    }
}

/// The composed attention the fused kernel replaces, written out here: the scores `q kᵀ`, the
/// reference masked softmax ([`masked_softmax_composed`]) and the product with `v`, as
/// `[B, T, KV·G, D]`, with the bias built from the visibility rule directly.
fn attention_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &[Vec<u8>],
    past: usize,
) -> Tensor {
    let (b, kv, gt, d) = q.dims4().unwrap();
    let total = k.dims()[2];
    let t = total - past;
    let mut bias = Vec::with_capacity(b * t * total);
    for row in mask {
        for i in 0..t {
            let p = past + i;
            for (j, &m) in row.iter().enumerate() {
                let visible = j == p || (j < p && m != 0);
                bias.push(if visible { 0.0 } else { -1e9 });
            }
        }
    }
    let bias = Tensor::from_vec(bias, (b, 1, t, total), &Device::Cpu)
        .unwrap()
        .to_dtype(q.dtype())
        .unwrap();
    let scores = q.matmul(&k.t().unwrap()).unwrap();
    let probs = masked_softmax_composed(&scores, &bias).unwrap();
    probs
        .matmul(v)
        .unwrap()
        .reshape((b, gt / t * kv, t, d))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
}

/// Key masks of `b` rows over `total` keys: row 0 left-padded by `pad` (its first queries see
/// only themselves), row 1 with a hole of padding in the middle, the others all real.
fn key_masks(b: usize, total: usize, pad: usize) -> Vec<Vec<u8>> {
    (0..b)
        .map(|r| {
            (0..total)
                .map(|j| match r {
                    0 => u8::from(j >= pad),
                    1 => u8::from(!(total / 3..total / 3 + 5).contains(&j)),
                    _ => 1,
                })
                .collect()
        })
        .collect()
}

/// The fused attention against the composition (scores, masked softmax, product), forward and
/// the gradients of q, k and v: `f64` to 1e-10, `f32` to 1e-5 (gradients relative to the
/// largest entry above 1). Shapes: `G` = 1 and 3, `T` not a multiple of the tile, cached
/// positions (`past` > 0) with keys and values read as strided views of a larger cache buffer,
/// decoding (`T` = 1), left padding longer than a key block, a hole in a mask.
#[test]
fn flash_attention_matches_composition() {
    use super::attention::{BLOCK_K, BLOCK_Q, KeyVisibility, attention};
    // (batch, key heads, groups, T, past, head dim, left padding of row 0)
    let cases = [
        (
            2usize,
            2usize,
            3usize,
            2 * BLOCK_Q + 22,
            0usize,
            16usize,
            BLOCK_K + 9,
        ),
        (3, 1, 1, BLOCK_Q + 6, 37, 8, 50),
        (3, 2, 3, 1, 2 * BLOCK_K + 5, 16, 20),
        (2, 3, 3, 5, 130, 64, 3),
        (1, 1, 2, 40, 0, 4, 0),
    ];
    for (dtype, fwd_tol, bwd_tol) in [(DType::F64, 1e-10, 1e-10), (DType::F32, 1e-5, 1e-5)] {
        for (ci, &(b, kv, g, t, past, d, pad)) in cases.iter().enumerate() {
            let total = past + t;
            let seed = 100 + ci as u64;
            // Scaled queries and keys of a size that makes the softmax far from uniform.
            let q = rand(&[b, kv, g * t, d], seed, 1.5, dtype);
            // Keys and values inside a buffer with spare columns, as the KV cache holds them.
            let spare = if past > 0 { 11 } else { 0 };
            let kbuf = rand(&[b, kv, total + spare, d], seed + 1, 1.5, dtype);
            let vbuf = rand(&[b, kv, total + spare, d], seed + 2, 1.0, dtype);
            let mask = key_masks(b, total, pad);
            let flat: Vec<u8> = mask.iter().flatten().copied().collect();
            let vis = KeyVisibility::from_mask(flat, b, total, past).unwrap();
            let name = format!(
                "attention {dtype:?} case {ci} (B {b}, KV {kv}, G {g}, T {t}, past {past}, D {d})"
            );
            let vq = Var::from_tensor(&q).unwrap();
            let vk = Var::from_tensor(&kbuf).unwrap();
            let vv = Var::from_tensor(&vbuf).unwrap();
            let vq0 = Var::from_tensor(&q).unwrap();
            let vk0 = Var::from_tensor(&kbuf).unwrap();
            let vv0 = Var::from_tensor(&vbuf).unwrap();
            let keys = |x: &Tensor| x.narrow(2, 0, total).unwrap();
            let (ya, ga) = grads_of(
                &[&vq, &vk, &vv],
                |ts| attention(&ts[0], &keys(&ts[1]), &keys(&ts[2]), &vis).unwrap(),
                seed + 3,
            );
            let (yb, gb) = grads_of(
                &[&vq0, &vk0, &vv0],
                |ts| attention_reference(&ts[0], &keys(&ts[1]), &keys(&ts[2]), &mask, past),
                seed + 3,
            );
            assert!(ya.is_contiguous(), "{name}: output not contiguous");
            let e = max_diff(&ya, &yb);
            assert!(e < fwd_tol, "{name}: forward differs by {e:e}");
            for (what, a, bref) in [
                ("q", &ga[0], &gb[0]),
                ("k", &ga[1], &gb[1]),
                ("v", &ga[2], &gb[2]),
            ] {
                let scale = max_diff(bref, &bref.zeros_like().unwrap());
                assert!(scale > 0.0, "{name}: no gradient for {what}");
                let e = max_diff(a, bref) / scale.max(1.0);
                assert!(
                    e < bwd_tol,
                    "{name}: gradient of {what} differs by {e:e} (scaled)"
                );
            }
        }
    }
}

/// Rows whose every earlier key is padding see only themselves: their output is their own
/// value row, exactly, and nothing (output or gradient) is NaN.
#[test]
fn flash_attention_padded_rows_see_only_themselves() {
    use super::attention::{KeyVisibility, attention};
    let (b, kv, g, t, d, pad) = (1usize, 1usize, 2usize, 90usize, 8usize, 70usize);
    let q = Var::from_tensor(&rand(&[b, kv, g * t, d], 1, 2.0, DType::F64)).unwrap();
    let k = Var::from_tensor(&rand(&[b, kv, t, d], 2, 2.0, DType::F64)).unwrap();
    let v = Var::from_tensor(&rand(&[b, kv, t, d], 3, 1.0, DType::F64)).unwrap();
    let mask: Vec<u8> = (0..t).map(|j| u8::from(j >= pad)).collect();
    let vis = KeyVisibility::from_mask(mask, b, t, 0).unwrap();
    let y = attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), &vis).unwrap();
    // [T, heads, D] of the single batch row, and the values [T, D] of the single key head.
    let y0 = y.get(0).unwrap().to_vec3::<f64>().unwrap();
    let vv = v
        .as_tensor()
        .get(0)
        .unwrap()
        .get(0)
        .unwrap()
        .to_vec2::<f64>()
        .unwrap();
    for (i, heads) in y0.iter().enumerate() {
        for (gi, row) in heads.iter().enumerate() {
            assert!(row.iter().all(|x| x.is_finite()));
            if i < pad {
                assert_eq!(
                    row, &vv[i],
                    "padded query {i} (head {gi}) must see only itself"
                );
            }
        }
    }
    let grads = y.sum_all().unwrap().backward().unwrap();
    let dk = grads.get(k.as_tensor()).unwrap();
    assert!(
        dk.flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap()
            .iter()
            .all(|x| x.is_finite())
    );
}

/// Mismatched shapes and visibility rules are refused, not read out of bounds.
#[test]
fn flash_attention_refuses_mismatched_inputs() {
    use super::attention::{KeyVisibility, attention};
    let q = rand(&[1, 2, 6, 8], 1, 1.0, DType::F32);
    let k = rand(&[1, 2, 5, 8], 2, 1.0, DType::F32);
    let vis = KeyVisibility::from_mask(vec![1; 5], 1, 5, 2).unwrap();
    // 3 queries (5 keys, 2 cached), G = 2: fits.
    assert_eq!(attention(&q, &k, &k, &vis).unwrap().dims(), [1, 3, 4, 8]);
    // 4 queries do not divide the 6 stacked rows.
    let vis4 = KeyVisibility::from_mask(vec![1; 5], 1, 5, 1).unwrap();
    assert!(attention(&q, &k, &k, &vis4).is_err());
    // The rule covers another batch or key count.
    let vis_b = KeyVisibility::from_mask(vec![1; 10], 2, 5, 2).unwrap();
    assert!(attention(&q, &k, &k, &vis_b).is_err());
    // Keys and values of different lengths, or another head size.
    let v_short = rand(&[1, 2, 4, 8], 3, 1.0, DType::F32);
    assert!(attention(&q, &k, &v_short, &vis).is_err());
    let k_d = rand(&[1, 2, 5, 4], 4, 1.0, DType::F32);
    assert!(attention(&q, &k_d, &k_d, &vis).is_err());
    // A mask of the wrong size, or more cached positions than keys.
    assert!(KeyVisibility::from_mask(vec![1; 4], 1, 5, 0).is_err());
    assert!(KeyVisibility::from_mask(vec![1; 5], 1, 5, 6).is_err());
}

#[test]
fn swiglu_matches_composition() {
    for dtype in [DType::F32, DType::F64] {
        // Small, not a multiple of the kernel's 4096-element blocks, and above the parallel
        // threshold; gates up to ±30 reach both tails of the sigmoid.
        for (shape, scale) in [
            (vec![3usize, 5, 16], 3.0),
            (vec![7, 1000], 30.0),
            (vec![300, 257], 4.0),
        ] {
            let g = rand(&shape, 11, scale, dtype);
            let u = rand(&shape, 12, 2.0, dtype);
            check(
                &format!("swiglu {dtype:?} {shape:?}"),
                &[g, u],
                |t| swiglu(&t[0], &t[1]).unwrap(),
                |t| swiglu::swiglu_composed(&t[0], &t[1]).unwrap(),
            );
        }
    }
    // The composition's formulas in its order: in `f64` (the library `exp`, as candle's) the
    // same bits, forward and backward. (`f32` uses the vectorised `exp`: within rounding, above.)
    let (g, u) = (
        rand(&[300, 257], 13, 8.0, DType::F64),
        rand(&[300, 257], 14, 2.0, DType::F64),
    );
    let (ga, ua) = (Var::from_tensor(&g).unwrap(), Var::from_tensor(&u).unwrap());
    let (gb, ub) = (Var::from_tensor(&g).unwrap(), Var::from_tensor(&u).unwrap());
    let (ya, da) = grads_of(&[&ga, &ua], |t| swiglu(&t[0], &t[1]).unwrap(), 5);
    let (yb, db) = grads_of(
        &[&gb, &ub],
        |t| swiglu::swiglu_composed(&t[0], &t[1]).unwrap(),
        5,
    );
    assert_eq!(max_diff(&ya, &yb), 0.0, "forward");
    assert_eq!(max_diff(&da[0], &db[0]), 0.0, "gate gradient");
    assert_eq!(max_diff(&da[1], &db[1]), 0.0, "up gradient");
    let err = swiglu(
        &rand(&[2, 3], 1, 1.0, DType::F32),
        &rand(&[3, 2], 2, 1.0, DType::F32),
    )
    .unwrap_err();
    assert!(err.to_string().contains("differ in shape"), "{err}");
}

/// The trained and the frozen linear op against `x.matmul(&w.t())`: the same output and
/// gradients (the weight's layout is tested in `linear`).
#[test]
fn linear_matches_matmul_and_writes_the_weight_gradient_in_its_layout() {
    for dtype in [DType::F32, DType::F64] {
        let x = rand(&[37, 24], 21, 1.0, dtype);
        let w = rand(&[19, 24], 22, 1.0, dtype);
        check(
            &format!("linear {dtype:?}"),
            &[x.clone(), w.clone()],
            |t| linear::linear(&t[0], &t[1]).unwrap(),
            |t| t[0].matmul(&t[1].t().unwrap()).unwrap(),
        );
        let xv = Var::from_tensor(&x).unwrap();
        // A frozen weight: the input's gradient alone, the same as the matmul's.
        let frozen = w.detach();
        let (_, ga) = grads_of(&[&xv], |t| linear::linear(&t[0], &frozen).unwrap(), 4);
        let (_, gb) = grads_of(&[&xv], |t| t[0].matmul(&frozen.t().unwrap()).unwrap(), 4);
        assert!(max_diff(&ga[0], &gb[0]) < FWD_TOL);
    }
    let err = linear::linear(
        &Var::from_tensor(&rand(&[4, 5], 1, 1.0, DType::F32))
            .unwrap()
            .as_tensor()
            .clone(),
        &Var::from_tensor(&rand(&[3, 6], 2, 1.0, DType::F32))
            .unwrap()
            .as_tensor()
            .clone(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("against weight"), "{err}");
}

/// The kernels split their work by shape, not by thread count: the RMSNorm weight's gradient
/// (a sum of per-block partials) and the fused head's gradients have the same bits on one
/// rayon thread as on three, and the work is large enough to be split.
#[test]
fn kernel_results_do_not_depend_on_the_thread_count() {
    let (rows, n) = (600usize, 512usize);
    assert!(
        2 * rows * n >= 2 * super::PARALLEL_MIN_ELEMS,
        "too small to split"
    );
    let x = rand(&[rows, n], 31, 2.0, DType::F32);
    let w = (rand(&[n], 32, 0.5, DType::F32) + 1.0).unwrap();
    let (h, d, v) = (24usize, 40usize, 3 * head::CHUNK + 77);
    let hid = rand(&[h, d], 33, 1.0, DType::F32);
    let hw = rand(&[v, d], 34, 0.5, DType::F32);
    let tg = Tensor::from_vec(
        (0..h).map(|i| ((i * 997) % v) as u32).collect::<Vec<_>>(),
        h,
        &Device::Cpu,
    )
    .unwrap();
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let (xa, wa) = (Var::from_tensor(&x).unwrap(), Var::from_tensor(&w).unwrap());
            let (_, g) = grads_of(&[&xa, &wa], |t| rms_norm(&t[0], &t[1], 1e-6).unwrap(), 35);
            let (ha, hwa) = (
                Var::from_tensor(&hid).unwrap(),
                Var::from_tensor(&hw).unwrap(),
            );
            let (_, gh) = grads_of(
                &[&ha, &hwa],
                |t| {
                    let (lp, ent) = head::head_logprobs_entropy(&t[0], &t[1], &tg, 1.0).unwrap();
                    (lp + ent).unwrap()
                },
                36,
            );
            [&g[..], &gh[..]]
                .concat()
                .iter()
                .map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
                .collect::<Vec<_>>()
        })
    };
    let one = run(1);
    let three = run(3);
    for (i, (a, b)) in one.iter().zip(&three).enumerate() {
        assert!(
            a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits()),
            "gradient {i} differs between 1 and 3 threads"
        );
    }
}

/// Cascade attention (issue 51): the shared keys read once for every flagged row and merged by
/// log-sum-exps equal the shared keys copied into each row before its own, for decoding (one
/// query) and prefilling (several) over padded own keys, in f32 and f64, with one group or two
/// (of 150 and 40 keys, the first crossing key blocks); a row flagged by two groups is refused.
#[test]
fn attention_with_shared_keys_equals_them_copied_per_row() {
    use super::attention::{SharedKeys, attention_shared_materialised, attention_with_shared};
    let dev = Device::Cpu;
    let (b, kv, g, d) = (4, 2, 3, 8);
    let max_diff = |a: Tensor, b: &Tensor| crate::model::tests::max_abs_diff(&a, b);
    for (t, past) in [(1usize, 9usize), (5, 0), (3, 12)] {
        let total = past + t;
        let mut mask = Vec::new();
        for r in 0..b {
            // Row r's first r + 1 cached columns are padding (left-padded rows).
            mask.extend((0..total).map(|j| u8::from(j > r || j >= past)));
        }
        let vis = KeyVisibility::from_mask(mask, b, total, past).unwrap();
        for dtype in [DType::F32, DType::F64] {
            let randn = |shape: (usize, usize, usize, usize)| {
                Tensor::randn(0f32, 1.0, shape, &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
            };
            let q = (randn((b, kv, g * t, d)) * 0.5).unwrap();
            let (k, v) = (randn((b, kv, total, d)), randn((b, kv, total, d)));
            let group = |p: usize, flags: [bool; 4]| SharedKeys {
                k: randn((1, kv, p, d)),
                v: randn((1, kv, p, d)),
                rows: flags.to_vec().into(),
            };
            let (a, a2, none, all) = (
                [true, false, true, false],
                [false, false, false, true],
                [false; 4],
                [true; 4],
            );
            let cases = [
                vec![group(150, [true, false, true, true])],
                vec![group(150, none)],
                vec![group(150, all)],
                vec![group(150, a), group(40, a2)],
                vec![],
            ];
            let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
            for shared in &cases {
                let flags: Vec<_> = shared.iter().map(|s| s.rows.to_vec()).collect();
                let got = attention_with_shared(&q, &k, &v, &vis, shared).unwrap();
                let want = attention_shared_materialised(&q, &k, &v, &vis, shared).unwrap();
                let diff = max_diff(got, &want);
                assert!(diff < tol, "t {t}, {dtype:?}, {flags:?}: {diff}");
                if shared.iter().all(|s| !s.rows.iter().any(|&f| f)) {
                    let plain = attention(&q, &k, &v, &vis).unwrap();
                    assert!(max_diff(plain, &want) < tol, "{flags:?}: no row sees them");
                }
            }
            let twice = [group(150, a), group(40, [true, false, false, false])];
            let err = attention_with_shared(&q, &k, &v, &vis, &twice).unwrap_err();
            assert!(err.to_string().contains("row 0 is flagged by two"), "{err}");
        }
    }
}

/// The batch-invariant attention computes softmax attention: it equals the shared keys copied
/// into each row before its own and the fused kernel over them (f32, 1e-5), for decoding and
/// prefilling, over left-padded rows and a masked column inside a row (a rejected draft), with
/// no shared keys, one group or two; a padded query row gets zeros.
#[test]
fn invariant_attention_equals_the_reference() {
    use super::attention::{SharedKeys, attention_shared_materialised};
    let dev = Device::Cpu;
    let (b, kv, g, d) = (4, 2, 3, 16);
    for (t, past) in [(1usize, 9usize), (5, 0), (70, 12)] {
        let total = past + t;
        let mut mask = Vec::new();
        for r in 0..b {
            // Row r's first r + 1 cached columns are padding; row 1 has a masked cached
            // column at 4.
            let hole = |j: usize| r == 1 && j == 4 && j < past;
            mask.extend((0..total).map(|j| u8::from((j > r || j >= past) && !hole(j))));
        }
        let vis = KeyVisibility::from_mask(mask.clone(), b, total, past).unwrap();
        let randn =
            |shape: (usize, usize, usize, usize)| Tensor::randn(0f32, 1.0, shape, &dev).unwrap();
        let q = (randn((b, kv, g * t, d)) * 0.5).unwrap();
        let (k, v) = (randn((b, kv, total, d)), randn((b, kv, total, d)));
        let group = |p: usize, flags: [bool; 4]| SharedKeys {
            k: randn((1, kv, p, d)),
            v: randn((1, kv, p, d)),
            rows: flags.to_vec().into(),
        };
        let cases = [
            vec![],
            vec![group(150, [true, false, true, true])],
            vec![
                group(150, [true, false, true, false]),
                group(40, [false, false, false, true]),
            ],
        ];
        for shared in &cases {
            let got = super::invariant::attention(&q, &k, &v, &vis, shared).unwrap();
            let want = attention_shared_materialised(&q, &k, &v, &vis, shared).unwrap();
            let diff = crate::model::tests::max_abs_diff(&got, &want);
            assert!(diff < 1e-5, "t {t}, {} groups: {diff}", shared.len());
        }
    }
    // A padded query (its own column masked) gets zeros.
    let vis = KeyVisibility::from_mask(vec![1, 1, 0, 1, 1, 1], 2, 3, 1).unwrap();
    let q = Tensor::ones((2, 1, 2, 4), DType::F32, &dev).unwrap();
    let k = Tensor::ones((2, 1, 3, 4), DType::F32, &dev).unwrap();
    let got = super::invariant::attention(&q, &k, &k, &vis, &[]).unwrap();
    let rows = got.flatten_to(2).unwrap().to_vec2::<f32>().unwrap();
    assert_eq!(rows[1], vec![0.0; 4], "{rows:?}");
    assert_eq!(rows[0], vec![1.0; 4], "{rows:?}");
}
