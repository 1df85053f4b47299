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
use super::simd::{exp_f32, isa_kernel};

/// Query rows (of one batch row and key head) per task.
const TILE_Q: usize = 64;
/// Rows of one shared group per task: their queries read the group's keys and values once.
const SHARED_ROWS: usize = 8;

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

/// `x` itself where its rows of `D` are contiguous and consecutive, else a contiguous copy.
fn rows_contiguous(x: &Tensor) -> Result<Tensor> {
    let (dims, st) = (x.dims(), x.stride());
    let ok = dims.len() == 4 && (dims[2] <= 1 || st[2] == dims[3]) && (dims[3] <= 1 || st[3] == 1);
    if ok { Ok(x.clone()) } else { x.contiguous() }
}

/// One run of keys a query row may see: rows of a key and a value head (`k`, `v`, `D` values
/// each) that start at position `start` of the row's visible list.
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
    let [b, kv, g, t, total, d] = super::attention::dims(q, k, v, vis.queries())?;
    let (gt, past) = (g * t, vis.past());
    if vis.batch() != b || vis.total() != total {
        candle_core::bail!(
            "invariant attention: key visibility for [{}, {}], keys {:?}",
            vis.batch(),
            vis.total(),
            k.dims()
        );
    }
    // Each row's shared keys, if a group flags it.
    let group_of = super::attention::shared_groups(q, shared)?;
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
    // Each row's runs of real columns, in order: its own part of every visible list.
    let runs: Vec<Vec<(usize, usize)>> = (0..b)
        .map(|r| {
            let mut out = Vec::new();
            let mut j = 0;
            while j < total {
                let j0 = j;
                while j < total && vis.real(r, j) {
                    j += 1;
                }
                if j > j0 {
                    out.push((j0, j));
                } else {
                    j += 1;
                }
            }
            out
        })
        .collect();
    let isa = kernel_isa();
    let tiles = gt.div_ceil(TILE_Q);
    // Tasks: the rows a shared group flags, in chunks of `SHARED_ROWS` (their queries score
    // the group's keys in one product and read its values once per key); every other row
    // alone. Each for one key head and one tile of its queries.
    let mut sets: Vec<(Option<usize>, Vec<usize>)> = Vec::new();
    for (gi, _) in shared_rows.iter().enumerate() {
        let rows: Vec<usize> = (0..b).filter(|&r| group_of[r] == Some(gi)).collect();
        sets.extend(rows.chunks(SHARED_ROWS).map(|c| (Some(gi), c.to_vec())));
    }
    sets.extend(
        (0..b)
            .filter(|&r| group_of[r].is_none())
            .map(|r| (None, vec![r])),
    );
    let tasks: Vec<(usize, usize, usize)> = (0..sets.len())
        .flat_map(|si| (0..kv).flat_map(move |h| (0..tiles).map(move |c| (si, h, c))))
        .collect();
    let outs: Vec<Vec<Vec<f32>>> = tasks
        .par_iter()
        .map(|&(si, h, c)| {
            let (group, rows) = &sets[si];
            let sh = group.map(|gi| {
                let (sk, sv, p) = &shared_rows[gi];
                (sk.rows(0, h, 0, *p), sv.rows(0, h, 0, *p))
            });
            let shared_len = sh.map_or(0, |(k, _)| k.len() / d);
            let qrows = c * TILE_Q..((c + 1) * TILE_Q).min(gt);
            let queries: Vec<RowQueries> = rows
                .iter()
                .map(|&r| {
                    // The row's own real columns in order, after the shared keys.
                    let own = runs[r]
                        .iter()
                        .map(|&(j0, j1)| Segment {
                            start: shared_len + vis.real_in(r, 0, j0),
                            k: ks.rows(r, h, j0, j1),
                            v: vs.rows(r, h, j0, j1),
                        })
                        .collect();
                    // How many of the list each query row sees (0: a padded query).
                    let seen = qrows
                        .clone()
                        .map(|gi| {
                            let col = past + gi % t;
                            if vis.real(r, col) {
                                shared_len + vis.real_in(r, 0, col + 1)
                            } else {
                                0
                            }
                        })
                        .collect();
                    let q0 = ((r * kv + h) * gt + qrows.start) * d;
                    RowQueries {
                        q: &qs[q0..q0 + qrows.len() * d],
                        seen,
                        own,
                    }
                })
                .collect();
            block(&queries, sh, d, isa)
        })
        .collect();
    let mut out = vec![0f32; b * t * kv * g * d];
    for (&(si, h, c), os) in tasks.iter().zip(outs) {
        for (&r, o) in sets[si].1.iter().zip(os) {
            for (n, gi) in (c * TILE_Q..((c + 1) * TILE_Q).min(gt)).enumerate() {
                let (gg, i) = (gi / t, gi % t);
                let at = ((r * t + i) * kv * g + h * g + gg) * d;
                out[at..at + d].copy_from_slice(&o[n * d..(n + 1) * d]);
            }
        }
    }
    Tensor::from_vec(out, (b, t, kv * g, d), q.device())
}

/// One batch row's queries in a task: `q` (`rows × D`), how many of the row's visible list
/// each sees (`seen`, 0 for a padded query), and the row's own keys in the list (after the
/// shared keys, if any).
struct RowQueries<'a> {
    q: &'a [f32],
    seen: Vec<usize>,
    own: Vec<Segment<'a>>,
}

/// The outputs (`rows × D` each) of `rows`' queries, the rows all seeing `shared` (keys and
/// values, `P × D` each) first if given.
fn block(
    rows: &[RowQueries],
    shared: Option<(&[f32], &[f32])>,
    d: usize,
    isa: KernelIsa,
) -> Vec<Vec<f32>> {
    // Scores `[m, n]` per row, `n` the most any of its queries sees: each key against every
    // query, by the fixed-order kernel; the shared keys against all the rows' queries at once.
    let mut scores: Vec<(Vec<f32>, usize)> = rows
        .iter()
        .map(|r| {
            let n = r.seen.iter().copied().max().unwrap_or(0);
            (vec![0f32; r.seen.len() * n], n)
        })
        .collect();
    let mut part = Vec::new();
    if let Some((sk, _)) = shared {
        let p = sk.len() / d;
        let m: usize = rows.iter().map(|r| r.seen.len()).sum();
        let qs: Vec<f32> = rows.iter().flat_map(|r| r.q.iter().copied()).collect();
        part.resize(m * p, 0.0);
        xwt_into(&qs, sk, (m, p, d), &mut part, isa);
        let mut at = 0;
        for (r, (sc, n)) in rows.iter().zip(scores.iter_mut()) {
            let len = p.min(*n);
            for i in 0..r.seen.len() {
                sc[i * *n..i * *n + len].copy_from_slice(&part[(at + i) * p..(at + i) * p + len]);
            }
            at += r.seen.len();
        }
    }
    for (r, (sc, n)) in rows.iter().zip(scores.iter_mut()) {
        let m = r.seen.len();
        for s in r.own.iter().filter(|s| s.start < *n) {
            let len = (s.k.len() / d).min(*n - s.start);
            part.resize(m * len, 0.0);
            xwt_into(r.q, s.k, (m, len, d), &mut part, isa);
            for i in 0..m {
                sc[i * *n + s.start..i * *n + s.start + len]
                    .copy_from_slice(&part[i * len..(i + 1) * len]);
            }
        }
    }
    let mut outs: Vec<Vec<f32>> = rows.iter().map(|r| vec![0f32; r.seen.len() * d]).collect();
    softmax_values(isa, rows, &mut scores, shared.map(|(_, v)| v), d, &mut outs);
    outs
}

isa_kernel!(
    /// Each query's `o = Σⱼ softmax(s)ⱼ vⱼ` over the first `seen` entries of its visible list,
    /// in list order: `scores` holds the scores and becomes the unnormalised probabilities.
    fn softmax_values(
        rows: &[RowQueries],
        scores: &mut [(Vec<f32>, usize)],
        shared: Option<&[f32]>,
        d: usize,
        outs: &mut [Vec<f32>],
    ) => body
);

/// [`softmax_values`]'s arithmetic: multiplies and adds, never fused, so any vector width gives
/// the same bits; each output element sums its terms in list order (the shared values read
/// once for all the rows' queries, each query's terms still in order).
#[inline(always)]
fn body(
    rows: &[RowQueries],
    scores: &mut [(Vec<f32>, usize)],
    shared: Option<&[f32]>,
    d: usize,
    outs: &mut [Vec<f32>],
) {
    let mut sums: Vec<Vec<f32>> = Vec::with_capacity(rows.len());
    for (r, (sc, n)) in rows.iter().zip(scores.iter_mut()) {
        let mut row_sums = vec![0f32; r.seen.len()];
        for (i, &seen) in r.seen.iter().enumerate() {
            let s = &mut sc[i * *n..i * *n + seen];
            let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for x in s.iter_mut() {
                *x = exp_f32(*x - m);
                sum += *x;
            }
            row_sums[i] = sum;
        }
        sums.push(row_sums);
    }
    if let Some(sv) = shared {
        for (j, vj) in sv.chunks_exact(d).enumerate() {
            for ((r, (sc, n)), o) in rows.iter().zip(scores.iter()).zip(outs.iter_mut()) {
                for (i, &seen) in r.seen.iter().enumerate() {
                    if j < seen {
                        let p = sc[i * *n + j];
                        for (a, &x) in o[i * d..(i + 1) * d].iter_mut().zip(vj) {
                            *a += p * x;
                        }
                    }
                }
            }
        }
    }
    for ((r, (sc, n)), o) in rows.iter().zip(scores.iter()).zip(outs.iter_mut()) {
        for (i, &seen) in r.seen.iter().enumerate() {
            let oi = &mut o[i * d..(i + 1) * d];
            for seg in r.own.iter().filter(|seg| seg.start < seen) {
                let len = (seg.v.len() / d).min(seen - seg.start);
                let ps = &sc[i * *n + seg.start..i * *n + seg.start + len];
                for (p, vj) in ps.iter().zip(seg.v.chunks_exact(d)) {
                    for (a, &x) in oi.iter_mut().zip(vj) {
                        *a += *p * x;
                    }
                }
            }
        }
    }
    for ((r, o), row_sums) in rows.iter().zip(outs.iter_mut()).zip(&sums) {
        for (i, &seen) in r.seen.iter().enumerate() {
            if seen > 0 {
                let inv = 1.0 / row_sums[i];
                for a in o[i * d..(i + 1) * d].iter_mut() {
                    *a *= inv;
                }
            }
        }
    }
}
