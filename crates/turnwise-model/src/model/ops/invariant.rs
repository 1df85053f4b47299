//! Batch-invariant attention for inference: every query's output is a fixed function of its own
//! query vector and of the keys and values it sees, in their order.
//!
//! The fused attention ([`super::attention()`]) computes the same thing, but its sums depend on
//! the call: `gemm` rounds a tile of 1, 3 or 64 query rows differently, the online softmax
//! splits a query's keys at 64-key blocks counted from the batch's first column (so a row's
//! left padding moves them), and the cascade ([`super::attention::attention_with_shared`])
//! merges a shared prompt's part by log-sum-exps. So a prompt prefilled whole and the same
//! prompt prefilled after a cached prefix, or beside other rows, differ in the last bits
//! (1e-6), and so do their sampled tokens once in a while.
//!
//! Here each query row's visible keys are listed in order, a shared prompt's first, then the
//! row's own real columns up to the query's (padding and masked columns skipped), and:
//! - each score is [`super::infer`]'s fixed-order dot product of the query and the key (the
//!   kernel's output for one pair does not depend on the tile it falls in);
//! - the softmax takes their maximum, [`super::simd::exp_f32`] of each score minus it, and
//!   their sum in list order;
//! - the output is `Σ pⱼ vⱼ` accumulated in list order (a multiply, then an add, per element),
//!   divided by the sum.
//!
//! Nothing depends on the batch's other rows, its padding, how many queries the call holds or
//! how a task splits them. It runs where [`super::batch_invariant`] is on (the sampling engine's
//! `batch_invariant` setting), forward only, `f32` on the CPU.

use candle_core::{Layout, Result, Storage, Tensor};
use rayon::prelude::*;

use super::attention::{KeyVisibility, SharedKeys};
use super::infer::{KernelIsa, kernel_isa, xwt_into};
use super::simd::exp_f32;

/// Query rows (of one batch row and key head) per task.
const TILE_Q: usize = 64;

/// Keys or values `[B, KV, n, D]` in their storage, rows of `D` contiguous and consecutive.
#[derive(Clone, Copy)]
struct HeadRows<'a> {
    data: &'a [f32],
    offset: usize,
    stride: [usize; 2],
    d: usize,
}

impl<'a> HeadRows<'a> {
    fn new(storage: &'a Storage, layout: &Layout, what: &str) -> Result<Self> {
        let data = match storage {
            Storage::Cpu(cpu) => cpu.as_slice::<f32>()?,
            _ => candle_core::bail!("invariant attention {what}: not on the CPU"),
        };
        let (dims, st) = (layout.dims(), layout.stride());
        if dims.len() != 4 || (dims[2] > 1 && st[2] != dims[3]) || (dims[3] > 1 && st[3] != 1) {
            candle_core::bail!("invariant attention {what}: rows must be contiguous");
        }
        Ok(Self {
            data,
            offset: layout.start_offset(),
            stride: [st[0], st[1]],
            d: dims[3],
        })
    }

    /// Rows `j0..j1` of head `h` of batch row `b`: `(j1 − j0) × D` values.
    fn rows(&self, b: usize, h: usize, j0: usize, j1: usize) -> &'a [f32] {
        let start = self.offset + b * self.stride[0] + h * self.stride[1] + j0 * self.d;
        &self.data[start..start + (j1 - j0) * self.d]
    }
}

/// Runs `tensor` made contiguous where its rows are not.
fn rows_contiguous(x: &Tensor) -> Result<Tensor> {
    let (dims, st) = (x.dims(), x.stride());
    let ok = dims.len() == 4 && (dims[2] <= 1 || st[2] == dims[3]) && (dims[3] <= 1 || st[3] == 1);
    if ok { Ok(x.clone()) } else { x.contiguous() }
}

/// One run of keys a query row may see: `len` rows of a key and a value head starting at
/// position `start` of the row's visible list.
struct Segment<'a> {
    start: usize,
    k: &'a [f32],
    v: &'a [f32],
}

/// Batch-invariant softmax attention, with [`super::attention::attention_with_shared`]'s
/// arguments and result: grouped queries `q: [B, KV, G·T, D]` (scaled by `1/√D`), keys and
/// values `k, v: [B, KV, total, D]`, the visibility rule `vis`, and keys that the rows `shared`
/// flags see before their own. Returns `[B, T, KV·G, D]`; a padded query (its own column
/// masked) gets zeros, which nothing reads. `f32` CPU tensors only.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    vis: &KeyVisibility,
    shared: &[SharedKeys],
) -> Result<Tensor> {
    let (b, kv, gt, d) = q.dims4()?;
    let (t, total, past) = (vis.queries(), vis.total(), vis.past());
    if t == 0 || gt % t != 0 || k.dims() != [b, kv, total, d] || v.dims() != k.dims() {
        candle_core::bail!(
            "invariant attention: q {:?}, k {:?}, v {:?} for {t} queries over {total} keys",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    let g = gt / t;
    // Each row's shared keys, if a group flags it.
    let mut group_of: Vec<Option<usize>> = vec![None; b];
    for (i, sh) in shared.iter().enumerate() {
        if sh.k.dims()[0] != 1 || sh.k.dims()[1] != kv || sh.k.dims()[3] != d {
            candle_core::bail!("invariant attention: shared keys {:?}", sh.k.dims());
        }
        for (r, &f) in sh.rows.iter().enumerate().take(b) {
            if f && group_of[r].replace(i).is_some() {
                candle_core::bail!("attention: batch row {r} is flagged by two shared groups");
            }
        }
    }
    let q = q.contiguous()?;
    let (k, v) = (rows_contiguous(k)?, rows_contiguous(v)?);
    let shared: Vec<(Tensor, Tensor)> = shared
        .iter()
        .map(|sh| Ok((rows_contiguous(&sh.k)?, rows_contiguous(&sh.v)?)))
        .collect::<Result<_>>()?;
    let (qg, kg, vg) = (
        q.storage_and_layout(),
        k.storage_and_layout(),
        v.storage_and_layout(),
    );
    let sg: Vec<_> = shared
        .iter()
        .map(|(a, b)| (a.storage_and_layout(), b.storage_and_layout()))
        .collect();
    let qs = match &*qg.0 {
        Storage::Cpu(cpu) => {
            let all = cpu.as_slice::<f32>()?;
            let o = qg.1.start_offset();
            &all[o..o + b * kv * gt * d]
        }
        _ => candle_core::bail!("invariant attention: q is not on the CPU"),
    };
    let (ks, vs) = (
        HeadRows::new(&kg.0, kg.1, "k")?,
        HeadRows::new(&vg.0, vg.1, "v")?,
    );
    let shared_rows: Vec<(HeadRows, HeadRows, usize)> = sg
        .iter()
        .zip(&shared)
        .map(|((a, bb), (sk, _))| {
            Ok((
                HeadRows::new(&a.0, a.1, "shared k")?,
                HeadRows::new(&bb.0, bb.1, "shared v")?,
                sk.dims()[2],
            ))
        })
        .collect::<Result<_>>()?;
    let isa = kernel_isa();
    let tiles = gt.div_ceil(TILE_Q);
    let tasks: Vec<(usize, usize, usize)> = (0..b)
        .flat_map(|r| (0..kv).flat_map(move |h| (0..tiles).map(move |c| (r, h, c))))
        .collect();
    let outs: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(r, h, c)| {
            // The row's visible list: its group's shared keys, then its real columns in order.
            let mut segs = Vec::new();
            let mut len = 0;
            if let Some(gi) = group_of[r] {
                let (sk, sv, p) = &shared_rows[gi];
                segs.push(Segment {
                    start: 0,
                    k: sk.rows(0, h, 0, *p),
                    v: sv.rows(0, h, 0, *p),
                });
                len = *p;
            }
            let shared_len = len;
            let mut j = 0;
            while j < total {
                if !vis.real(r, j) {
                    j += 1;
                    continue;
                }
                let j0 = j;
                while j < total && vis.real(r, j) {
                    j += 1;
                }
                segs.push(Segment {
                    start: len,
                    k: ks.rows(r, h, j0, j),
                    v: vs.rows(r, h, j0, j),
                });
                len += j - j0;
            }
            let rows = c * TILE_Q..((c + 1) * TILE_Q).min(gt);
            // How many of the list each query row sees (0: a padded query).
            let seen: Vec<usize> = rows
                .clone()
                .map(|gi| {
                    let col = past + gi % t;
                    if vis.real(r, col) {
                        shared_len + vis.real_before(r, col + 1)
                    } else {
                        0
                    }
                })
                .collect();
            let q0 = ((r * kv + h) * gt + rows.start) * d;
            let qt = &qs[q0..q0 + rows.len() * d];
            tile(qt, &segs, &seen, d, isa)
        })
        .collect();
    let mut out = vec![0f32; b * t * kv * g * d];
    for (&(r, h, c), o) in tasks.iter().zip(outs) {
        for (n, gi) in (c * TILE_Q..((c + 1) * TILE_Q).min(gt)).enumerate() {
            let (gg, i) = (gi / t, gi % t);
            let at = ((r * t + i) * kv * g + h * g + gg) * d;
            out[at..at + d].copy_from_slice(&o[n * d..(n + 1) * d]);
        }
    }
    drop((qg, kg, vg, sg));
    Tensor::from_vec(out, (b, t, kv * g, d), q.device())
}

/// The outputs `[rows, D]` of the query rows `q` (`rows × D`), row `i` seeing the first
/// `seen[i]` keys of the list `segs` describes.
fn tile(q: &[f32], segs: &[Segment], seen: &[usize], d: usize, isa: KernelIsa) -> Vec<f32> {
    let m = seen.len();
    let n = seen.iter().copied().max().unwrap_or(0);
    let mut out = vec![0f32; m * d];
    if n == 0 {
        return out;
    }
    // Scores `[m, n]`: each segment's keys against every query row, by the fixed-order kernel.
    let mut scores = vec![0f32; m * n];
    let mut part = Vec::new();
    for s in segs.iter().filter(|s| s.start < n) {
        let len = (s.k.len() / d).min(n - s.start);
        part.resize(m * len, 0.0);
        xwt_into(q, s.k, (m, len, d), &mut part, isa);
        for i in 0..m {
            scores[i * n + s.start..i * n + s.start + len]
                .copy_from_slice(&part[i * len..(i + 1) * len]);
        }
    }
    for i in 0..m {
        if seen[i] > 0 {
            softmax_values(
                &mut scores[i * n..i * n + seen[i]],
                segs,
                d,
                &mut out[i * d..(i + 1) * d],
                isa,
            );
        }
    }
    out
}

/// `o = Σⱼ softmax(s)ⱼ vⱼ` over the list's first `s.len()` values, in list order.
fn softmax_values(s: &mut [f32], segs: &[Segment], d: usize, o: &mut [f32], isa: KernelIsa) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        unsafe fn avx512(s: &mut [f32], segs: &[Segment], d: usize, o: &mut [f32]) {
            body(s, segs, d, o)
        }
        #[target_feature(enable = "avx2")]
        unsafe fn avx2(s: &mut [f32], segs: &[Segment], d: usize, o: &mut [f32]) {
            body(s, segs, d, o)
        }
        match isa.min(KernelIsa::detected()) {
            // SAFETY: the CPU has the features (`detected` checked them).
            KernelIsa::Avx512 => return unsafe { avx512(s, segs, d, o) },
            // SAFETY: as above.
            KernelIsa::Avx2 => return unsafe { avx2(s, segs, d, o) },
            KernelIsa::Portable => {}
        }
    }
    let _ = isa;
    body(s, segs, d, o)
}

/// [`softmax_values`]'s arithmetic (multiplies and adds, never fused, so any vector width
/// gives the same bits).
#[inline(always)]
fn body(s: &mut [f32], segs: &[Segment], d: usize, o: &mut [f32]) {
    let n = s.len();
    let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for x in s.iter_mut() {
        *x = exp_f32(*x - m);
        sum += *x;
    }
    o.fill(0.0);
    for seg in segs.iter().filter(|seg| seg.start < n) {
        let len = (seg.v.len() / d).min(n - seg.start);
        for (p, vj) in s[seg.start..seg.start + len]
            .iter()
            .zip(seg.v.chunks_exact(d))
        {
            for (a, &x) in o.iter_mut().zip(vj) {
                *a += *p * x;
            }
        }
    }
    let inv = 1.0 / sum;
    for a in o.iter_mut() {
        *a *= inv;
    }
}
