//! Attention without the `T × T` score matrix: flash-attention-2 style tiles, forward and
//! backward, on the CPU.
//!
//! The composed attention ([`attention_composed`]) materialises the scores `q kᵀ`
//! (`[B, KV, G·T, T_total]`), their softmax and, training, both again as gradients: for one
//! 4,096-token sequence of SmolLM2-135M (9 heads) that is 9 × 4,096² floats, 604 MiB, per layer.
//! [`attention`] never holds more than a tile of them. For each (batch row, key head, block of
//! [`BLOCK_Q`] query positions, the `G` query heads that share the key head stacked) it walks the
//! key blocks of [`BLOCK_K`] keys up to the causal limit, skipping blocks that no query of the
//! tile may see (above the diagonal: half the work of a long prefill; all padding), and keeps a
//! running maximum and sum per row (the online softmax): `S = Q Kᵦᵀ` (one `gemm` into a tile
//! buffer), the mask, `P = exp(S − m)`, `O += P Vᵦ`. Each row's log-sum-exp is kept for the
//! backward, which is the standard FA2 one: `Dᵢ = rowsum(dO ∘ O)`, then per tile `S` and
//! `P = exp(S − lse)` again, `dV += Pᵀ dO`, `dP = dO Vᵦᵀ`, `dS = P ∘ (dP − Dᵢ)`, `dQ += dS Kᵦ`,
//! `dK += dSᵀ Q`. Memory is a few tiles per thread, plus, in the backward, per-chunk partial
//! `dK`/`dV` of the keys' size (no `T × T` buffer anywhere).
//!
//! Which keys a query sees is data, not a bias tensor: [`KeyVisibility`] holds the key mask and
//! the number of cached positions; query `i` (absolute position `past + i`) sees key `j` when
//! `j == past + i`, or `j < past + i` and key `j` is real. Every query sees itself, so every
//! row is finite (a padded query row sees only itself).
//!
//! The tiles run on rayon's pool, like candle's matrix products and the other kernels
//! (`RAYON_NUM_THREADS`), not on candle's element-wise `CANDLE_NUM_THREADS` threads: inside
//! the trainer's data-parallel shards (themselves rayon tasks) the pool is shared rather than
//! oversubscribed. The exponentials are [`super::simd`]'s. The split depends on the shapes only, never on the thread count, so the
//! result is the same on one thread as on several.
//!
//! Like the other fused ops it serves `f32`/`f64` CPU tensors; elsewhere (CUDA, half types,
//! [`super::with_composed_ops`]) the model runs [`attention_composed`].

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Storage, Tensor};
use rayon::prelude::*;

use super::simd::ExpKernels;
use super::{Real, contiguous, dot, fused_on};

/// Query positions per tile (times the `G` query heads sharing a key head: the tile's rows).
pub const BLOCK_Q: usize = 64;
/// Keys per tile.
pub const BLOCK_K: usize = 64;
/// Additive bias of a masked key in the composed path's bias. Finite so that no row is NaN.
const MASKED: f64 = -1e9;
/// Below this much work (multiply-adds of `q kᵀ`) the tiles run on the calling thread.
const PARALLEL_MIN_WORK: usize = 1 << 20;
/// The backward splits each (batch row, key head)'s query blocks into chunks so that there are
/// at least this many units of work (each chunk accumulates its own partial `dK`/`dV`).
const BWD_MIN_UNITS: usize = 8;

/// Which keys each query of an attention call sees: the key mask `[B, past + T]` (real tokens
/// and padding) and the number `past` of cached positions before the `T` new queries.
///
/// Query `i` (absolute position `past + i`) sees key `j` when `j == past + i`, or when
/// `j < past + i` and key `j` is real. Cheap to clone (the mask is shared).
#[derive(Debug, Clone)]
pub struct KeyVisibility {
    /// `[B, total]`: 1 for a real key, 0 for padding.
    mask: Arc<[u8]>,
    /// `[B, total + 1]`: running count of real keys (`prefix[j]` counts keys `< j`).
    prefix: Arc<[u32]>,
    batch: usize,
    total: usize,
    past: usize,
}

impl KeyVisibility {
    /// From a key mask `[B, total]` of any dtype (non-zero: a real token) and the number of
    /// cached positions `past` (`past <= total`; the queries are the last `total − past`).
    pub fn new(key_mask: &Tensor, past: usize) -> Result<Self> {
        let (batch, total) = key_mask.dims2()?;
        let rows = key_mask.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let flat: Vec<u8> = rows.iter().flatten().map(|&m| u8::from(m != 0.0)).collect();
        Self::from_mask(flat, batch, total, past)
    }

    /// From the mask's rows flattened (`batch × total` bytes, non-zero: a real key).
    pub fn from_mask(mask: Vec<u8>, batch: usize, total: usize, past: usize) -> Result<Self> {
        if mask.len() != batch * total || past > total {
            candle_core::bail!(
                "key visibility: {} mask bytes for [{batch}, {total}] with {past} cached",
                mask.len()
            );
        }
        let mut prefix = Vec::with_capacity(batch * (total + 1));
        for row in mask.chunks_exact(total.max(1)).take(batch) {
            let mut n = 0u32;
            prefix.push(0);
            for &m in row {
                n += u32::from(m != 0);
                prefix.push(n);
            }
        }
        if total == 0 {
            prefix.resize(batch, 0);
        }
        Ok(Self {
            mask: mask.into(),
            prefix: prefix.into(),
            batch,
            total,
            past,
        })
    }

    /// Batch rows.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Keys per row (cached and new).
    pub fn total(&self) -> usize {
        self.total
    }

    /// Cached positions before the queries.
    pub fn past(&self) -> usize {
        self.past
    }

    /// New positions (queries) per row.
    pub fn queries(&self) -> usize {
        self.total - self.past
    }

    /// The real queries (their key is not padding), as flat indices `row · queries + q` into
    /// the `[B, queries]` query grid, in order.
    pub fn real_queries(&self) -> Vec<u32> {
        let t = self.queries();
        (0..self.batch)
            .flat_map(|b| (0..t).map(move |q| (b, q)))
            .filter(|&(b, q)| self.real(b, self.past + q))
            .map(|(b, q)| (b * t + q) as u32)
            .collect()
    }

    /// Whether key `j` of batch row `b` is real (not padding).
    #[inline]
    pub(crate) fn real(&self, b: usize, j: usize) -> bool {
        self.mask[b * self.total + j] != 0
    }

    /// Whether query `p` (absolute position) of batch row `b` sees key `j`.
    #[inline]
    fn visible(&self, b: usize, p: usize, j: usize) -> bool {
        j == p || (j < p && self.mask[b * self.total + j] != 0)
    }

    /// Real keys of row `b` in `[j0, j1)`.
    #[inline]
    pub(crate) fn real_in(&self, b: usize, j0: usize, j1: usize) -> usize {
        if j1 <= j0 {
            return 0;
        }
        let p = &self.prefix[b * (self.total + 1)..];
        (p[j1] - p[j0]) as usize
    }

    /// Whether some query at absolute positions `[p0, p1)` of row `b` sees some key of
    /// `[j0, j1)`.
    #[inline]
    fn block_needed(&self, b: usize, (j0, j1): (usize, usize), (p0, p1): (usize, usize)) -> bool {
        let diagonal = j0 < p1 && p0 < j1;
        diagonal || self.real_in(b, j0, j1.min(p1.saturating_sub(1))) > 0
    }

    /// Whether every query at absolute positions `>= p0` of row `b` sees every key of
    /// `[j0, j1)` (no masking needed).
    #[inline]
    fn block_full(&self, b: usize, (j0, j1): (usize, usize), p0: usize) -> bool {
        j1 <= p0 && self.real_in(b, j0, j1) == j1 - j0
    }

    /// The additive bias `[B, 1, T, total]` the composed path adds to the scores (0 where
    /// visible, −1e9 where not).
    pub fn bias(&self, dtype: DType, device: &Device) -> Result<Tensor> {
        let t = self.queries();
        let mut bias = Vec::with_capacity(self.batch * t * self.total);
        for b in 0..self.batch {
            for i in 0..t {
                let p = self.past + i;
                for j in 0..self.total {
                    bias.push(if self.visible(b, p, j) {
                        0f32
                    } else {
                        MASKED as f32
                    });
                }
            }
        }
        Tensor::from_vec(bias, (self.batch, 1, t, self.total), device)?.to_dtype(dtype)
    }
}

/// Whether [`attention`] runs the fused kernel for `q` (else it is [`attention_composed`]):
/// `f32`/`f64` tensors on the CPU outside [`super::with_composed_ops`].
pub fn fused_attention_on(device: &Device, dtype: DType) -> bool {
    fused_on(device) && matches!(dtype, DType::F32 | DType::F64)
}

/// Whether the model runs the fused attention (else the composed one, with its
/// `[B, 1, T, total]` bias): where [`fused_attention_on`], unless `TURNWISE_FUSED_ATTENTION=0`
/// (read once) turns it off to measure the composed path.
///
/// Decoding (one new position per row) takes the fused kernel as well: at SmolLM2's shapes
/// (9/3 heads × 64, `cargo bench -p turnwise-model --bench model` with
/// `TURNWISE_BENCH_FILTER=attention`, this 2-core AVX-512 machine with a study running beside
/// it, 2026-11-27, four runs) it took 4.9–5.5 µs against the composed path's 6.3–7.0 for one
/// row over a context of 80, 38–43 against 43–49 for 8 rows, 338–443 against 339–430 for 64
/// rows (parity within the noise), 50–58 against 116–133 µs for one row over 1,024 and
/// 9.3–10.5 against 12.9–15.3 ms for 64 rows over 1,024; SmolLM2's whole sampling at batch 64
/// did not differ measurably (116–184 tokens/s either way). Two variants for decoding's few
/// rows were slower and dropped: plain loops instead of `gemm` (0.3–0.6×: this crate compiles
/// for baseline x86-64, `gemm` dispatches to AVX-512) and 512-key tiles (no gain over a context
/// of 80, half the speed over 1,024).
pub fn fused_attention_wanted(device: &Device, dtype: DType) -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("TURNWISE_FUSED_ATTENTION").as_deref() == Ok("0"));
    !off && fused_attention_on(device, dtype)
}

/// Checks the shapes of an attention call and returns `(B, KV, G, T, total, D)`.
pub(crate) fn dims(q: &Tensor, k: &Tensor, v: &Tensor, t: usize) -> Result<[usize; 6]> {
    let (b, kv, gt, d) = q.dims4()?;
    let (bk, kvk, total, dk) = k.dims4()?;
    if (bk, kvk, dk) != (b, kv, d) || v.dims() != k.dims() || t == 0 || !gt.is_multiple_of(t) {
        candle_core::bail!(
            "attention: q {:?}, k {:?}, v {:?} do not fit {t} queries",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    Ok([b, kv, gt / t, t, total, d])
}

/// Softmax attention of grouped queries `q: [B, KV, G·T, D]` (already scaled by `1/√D`; query
/// head `kv·G + g` is rows `g·T..(g+1)·T` of key head `kv`) over keys and values
/// `k, v: [B, KV, total, D]` (cached positions first; any strides with contiguous rows), with
/// the visibility rule `vis`. Returns the heads' outputs as `[B, T, KV·G, D]`, the layout the
/// output projection reads.
///
/// On `f32`/`f64` CPU tensors this is the tiled kernel of the module (no `T × T` scores,
/// differentiable with respect to `q`, `k` and `v`); elsewhere it is [`attention_composed`]
/// with `vis`'s bias.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, vis: &KeyVisibility) -> Result<Tensor> {
    let [b, kv, g, t, total, d] = dims(q, k, v, vis.queries())?;
    if vis.batch != b || vis.total != total {
        candle_core::bail!(
            "attention: key visibility for [{}, {}], keys {:?}",
            vis.batch,
            vis.total,
            k.dims()
        );
    }
    if !fused_attention_on(q.device(), q.dtype()) || k.dtype() != q.dtype() {
        return attention_composed(q, k, v, &vis.bias(q.dtype(), q.device())?);
    }
    let rows_ok = |x: &Tensor| x.stride()[3] == 1 || d == 1;
    let k = if rows_ok(k) {
        k.clone()
    } else {
        k.contiguous()?
    };
    let v = if rows_ok(v) {
        v.clone()
    } else {
        v.contiguous()?
    };
    let op = FlashAttention {
        vis: vis.clone(),
        dims: [b, kv, g, t, total, d],
        lse: Mutex::new(None),
    };
    q.contiguous()?.apply_op3(&k, &v, op)
}

/// [`attention`] composed from candle ops: the scores `q kᵀ` `[B, KV, G·T, total]`, the masked
/// softmax ([`super::masked_softmax_last_dim`] with `bias: [B, 1, T, total]`), the product with
/// `v`, and the transpose to `[B, T, KV·G, D]` (a view). The path off the CPU and for half
/// types, and the reference of the fused kernel.
pub fn attention_composed(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let t = bias.dims().get(2).copied().unwrap_or(0);
    let [b, kv, g, t, _, d] = dims(q, k, v, t)?;
    let scores = q.matmul(&k.t()?)?;
    let probs = super::masked_softmax_last_dim(&scores, bias)?;
    probs.matmul(v)?.reshape((b, kv * g, t, d))?.transpose(1, 2)
}

/// Keys and values that some rows of a batch share before their own (a prompt prefilled once
/// for several samples of it): `k`, `v: [1, KV, P, D]`, seen by every query of the rows that
/// `rows` flags (one flag per batch row). Cheap to clone.
#[derive(Debug, Clone)]
pub struct SharedKeys {
    /// `[1, KV, P, D]` keys (after RoPE).
    pub k: Tensor,
    /// `[1, KV, P, D]` values.
    pub v: Tensor,
    /// Which batch rows see them.
    pub rows: Arc<[bool]>,
}

/// [`attention`] for a batch some of whose rows see shared keys before their own `k`, `v`
/// (cascade attention): each of `shared`'s groups is seen by the rows it flags (a row by one
/// group at most). Equal to [`attention`] over the keys `[shared₁, shared₂, …, k]` (a group's
/// keys real for its rows, padding for the others, and `vis.past() + ΣP` cached positions),
/// without a copy of the shared keys per row. On the fused path (CPU, `f32`/`f64`, no input
/// tracking gradients) each key head's shared keys are read once for the queries of every row
/// of the group stacked, and each row's two parts are merged by their log-sum-exps; elsewhere
/// the shared keys are materialised per row ([`attention_shared_materialised`]).
pub fn attention_with_shared(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    vis: &KeyVisibility,
    shared: &[SharedKeys],
) -> Result<Tensor> {
    let [b, kv, g, t, total, d] = dims(q, k, v, vis.queries())?;
    shared_groups(q, shared)?;
    if vis.batch != b || vis.total != total {
        candle_core::bail!(
            "attention: key visibility for [{}, {}], keys {:?}",
            vis.batch,
            vis.total,
            k.dims()
        );
    }
    // The groups that some row sees and that hold keys.
    let shared: Vec<&SharedKeys> = shared
        .iter()
        .filter(|sh| sh.k.dims()[2] > 0 && sh.rows.iter().any(|&f| f))
        .collect();
    let tracked = [q, k, v].iter().any(|x| x.track_op())
        || shared.iter().any(|sh| sh.k.track_op() || sh.v.track_op());
    let same_dtype = [k, v].iter().all(|x| x.dtype() == q.dtype())
        && shared
            .iter()
            .all(|sh| sh.k.dtype() == q.dtype() && sh.v.dtype() == q.dtype());
    if tracked || !same_dtype || !fused_attention_on(q.device(), q.dtype()) {
        let owned: Vec<SharedKeys> = shared.into_iter().cloned().collect();
        return attention_shared_materialised(q, k, v, vis, &owned);
    }
    if shared.is_empty() {
        return attention(q, k, v, vis);
    }
    let geo = Geometry::of([b, kv, g, t, total, d], vis.past);
    let q = q.contiguous()?;
    let mut tensors = vec![&q, k, v];
    for sh in &shared {
        tensors.push(&sh.k);
        tensors.push(&sh.v);
    }
    let guards: Vec<_> = tensors.iter().map(|x| x.storage_and_layout()).collect();
    let cpu = cpu_storages(&guards, "attention")?;
    macro_rules! go {
        ($t:ty) => {{
            let qs = contiguous::<$t>(cpu[0].0, cpu[0].1, "attention q")?;
            let rows = |i: usize, what| Rows::<$t>::new(cpu[i].0, cpu[i].1, what);
            let (k, v) = (rows(1, "k")?, rows(2, "v")?);
            let (mut out, lse) = fwd(qs, &k, &v, vis, &geo);
            for (i, sh) in shared.iter().enumerate() {
                let (sk, sv) = (rows(3 + 2 * i, "shared k")?, rows(4 + 2 * i, "shared v")?);
                let flagged: Vec<usize> = (0..b).filter(|&r| sh.rows[r]).collect();
                let parts = shared_fwd(qs, &sk, &sv, sh.k.dims()[2], &flagged, &geo);
                merge_shared(&mut out, &lse, &parts, &flagged, &geo);
            }
            Tensor::from_vec(out, (b, t, kv * g, d), q.device())?
        }};
    }
    Ok(match q.dtype() {
        DType::F32 => go!(f32),
        DType::F64 => go!(f64),
        dt => candle_core::bail!("attention: unsupported dtype {dt:?}"),
    })
}

/// Checks `shared`'s groups against the queries `q: [B, KV, G·T, D]` (keys and values
/// `[1, KV, P, D]`, one flag per batch row, a row flagged by one group at most) and returns
/// the group that flags each batch row.
pub(crate) fn shared_groups(q: &Tensor, shared: &[SharedKeys]) -> Result<Vec<Option<usize>>> {
    let (b, kv, _, d) = q.dims4()?;
    let mut group_of = vec![None; b];
    for (i, sh) in shared.iter().enumerate() {
        let (sb, skv, _, sd) = sh.k.dims4()?;
        if (sb, skv, sd) != (1, kv, d) || sh.v.dims() != sh.k.dims() || sh.rows.len() != b {
            candle_core::bail!(
                "attention: shared keys {:?}, values {:?} for {} rows do not fit q {:?}",
                sh.k.dims(),
                sh.v.dims(),
                sh.rows.len(),
                q.dims()
            );
        }
        for (r, &f) in sh.rows.iter().enumerate() {
            if f && group_of[r].replace(i).is_some() {
                candle_core::bail!("attention: batch row {r} is flagged by two shared groups");
            }
        }
    }
    Ok(group_of)
}

/// The CPU storages and layouts behind `guards` (an error naming `what` for a tensor elsewhere).
fn cpu_storages<'a, G: std::ops::Deref<Target = Storage>>(
    guards: &'a [(G, &'a Layout)],
    what: &str,
) -> Result<Vec<(&'a CpuStorage, &'a Layout)>> {
    guards
        .iter()
        .map(|(s, l)| match &**s {
            Storage::Cpu(s) => Ok((s, *l)),
            _ => candle_core::bail!("{what}: a tensor is not on the CPU"),
        })
        .collect()
}

/// [`attention_with_shared`] by its definition: every group's shared keys and values copied
/// into every row before its own, real for the rows the group flags, and [`attention`] over
/// them. The path off the fused kernel (other devices, half types, gradients) and the
/// reference of the cascade.
pub fn attention_shared_materialised(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    vis: &KeyVisibility,
    shared: &[SharedKeys],
) -> Result<Tensor> {
    let (b, kv, d) = (vis.batch, k.dim(1)?, k.dim(3)?);
    let spread = |x: &Tensor| -> Result<Tensor> {
        let p = x.dim(2)?;
        x.broadcast_as((b, kv, p, d))?.contiguous()
    };
    let mut ks = Vec::with_capacity(shared.len() + 1);
    let mut vs = Vec::with_capacity(shared.len() + 1);
    for sh in shared {
        ks.push(spread(&sh.k)?);
        vs.push(spread(&sh.v)?);
    }
    ks.push(k.contiguous()?);
    vs.push(v.contiguous()?);
    let kf = Tensor::cat(&ks, 2)?;
    let vf = Tensor::cat(&vs, 2)?;
    let p: usize = shared.iter().map(|sh| sh.k.dims()[2]).sum();
    let total = p + vis.total;
    let mut mask = Vec::with_capacity(b * total);
    for r in 0..b {
        for sh in shared {
            mask.extend(std::iter::repeat_n(u8::from(sh.rows[r]), sh.k.dims()[2]));
        }
        mask.extend_from_slice(&vis.mask[r * vis.total..(r + 1) * vis.total]);
    }
    let vis = KeyVisibility::from_mask(mask, b, total, vis.past + p)?;
    if fused_attention_on(q.device(), q.dtype()) {
        attention(q, &kf, &vf, &vis)
    } else {
        attention_composed(q, &kf, &vf, &vis.bias(q.dtype(), q.device())?)
    }
}

/// Flagged batch rows per work item of [`shared_fwd`]: the stacked query rows of an item are
/// at most about this many (`G · T` per batch row).
const SHARED_ITEM_ROWS: usize = 96;
/// [`shared_fwd`] splits the flagged rows until there are at least this many items (key heads
/// × row chunks), so that decoding's few key heads keep the cores busy (3 heads of 16 rows on
/// two threads would leave one idle a third of the time). Shapes only, never the thread
/// count, decide the split.
const SHARED_MIN_ITEMS: usize = 4;

/// [`shared_fwd`]'s split: flagged rows per item and row chunks per key head, for `n` flagged
/// rows of `gt` query rows each and `kv` key heads.
fn shared_split(n: usize, gt: usize, kv: usize) -> (usize, usize) {
    let mut per = (SHARED_ITEM_ROWS / gt).max(1).min(n.max(1));
    while per > 1 && kv * n.div_ceil(per) < SHARED_MIN_ITEMS {
        per = per.div_ceil(2);
    }
    (per, n.div_ceil(per))
}

/// The shared keys' part of [`attention_with_shared`]: for each key head and chunk of the
/// flagged rows, their queries stacked (`(row, g, i)` order) against the shared keys, which
/// every query sees (online softmax over [`BLOCK_K`] key blocks). Returns per item (key head
/// `h`, flagged rows `f0..f1`, in `h`-major order) the normalised outputs `[rows, D]` and the
/// rows' log-sum-exps.
fn shared_fwd<T: ExpKernels>(
    q: &[T],
    k: &Rows<T>,
    v: &Rows<T>,
    p: usize,
    flagged: &[usize],
    geo: &Geometry,
) -> Vec<(Vec<T>, Vec<T>)> {
    let (gt, d) = (geo.g * geo.t, geo.d);
    let (per, chunks) = shared_split(flagged.len(), gt, geo.kv);
    let work = geo.kv * flagged.len() * gt * p * d;
    run_items(
        geo.kv * chunks,
        work >= PARALLEL_MIN_WORK,
        || {
            (
                vec![T::ZERO; per * gt * d],
                vec![T::ZERO; per * gt * BLOCK_K],
            )
        },
        |(qt, s), item| {
            let (h, c) = (item / chunks, item % chunks);
            let rows_of = &flagged[c * per..((c + 1) * per).min(flagged.len())];
            let rows = rows_of.len() * gt;
            for (n, &b) in rows_of.iter().enumerate() {
                let at = geo.row(b, h, 0, 0) * d;
                qt[n * gt * d..(n + 1) * gt * d].copy_from_slice(&q[at..at + gt * d]);
            }
            let qm = Mat::rows(&qt[..rows * d], d);
            let mut o = vec![T::ZERO; rows * d];
            let mut m = vec![T::NEG_INF; rows];
            let mut l = vec![T::ZERO; rows];
            for j0 in (0..p).step_by(BLOCK_K) {
                let j1 = (j0 + BLOCK_K).min(p);
                let nk = j1 - j0;
                let s = &mut s[..rows * nk];
                mm(s, nk, qm, k.block(0, h, j0, j1).t(), (rows, nk, d), false);
                softmax_block(s, nk, (&mut o, &mut m, &mut l), v.block(0, h, j0, j1), d);
            }
            finish_rows(&mut o, &mut m, &l, d);
            (o, m)
        },
    )
}

/// Merges [`shared_fwd`]'s parts into the flagged rows of the own keys' output `out`
/// (`[B, T, KV·G, D]`, log-sum-exps `lse: [B, KV, G·T]`): each row becomes the two parts
/// weighted by their shares of the total softmax mass.
fn merge_shared<T: ExpKernels>(
    out: &mut [T],
    lse: &[T],
    parts: &[(Vec<T>, Vec<T>)],
    flagged: &[usize],
    geo: &Geometry,
) {
    let (gt, d) = (geo.g * geo.t, geo.d);
    let (per, chunks) = shared_split(flagged.len(), gt, geo.kv);
    for (item, (o, m)) in parts.iter().enumerate() {
        let (h, c) = (item / chunks, item % chunks);
        let rows_of = &flagged[c * per..((c + 1) * per).min(flagged.len())];
        for (n, &b) in rows_of.iter().enumerate() {
            for g in 0..geo.g {
                for i in 0..geo.t {
                    let r = (n * geo.g + g) * geo.t + i;
                    let (lo, ls) = (lse[geo.row(b, h, g, i)], m[r]);
                    let top = if lo > ls { lo } else { ls };
                    let (wo, ws) = ((lo - top).exp(), (ls - top).exp());
                    let inv = T::ONE / (wo + ws);
                    let at = geo.out_at(b, h, g, i);
                    for (x, &y) in out[at..at + d].iter_mut().zip(&o[r * d..(r + 1) * d]) {
                        *x = (*x * wo + y * ws) * inv;
                    }
                }
            }
        }
    }
}

/// The fused op on `(q, k, v)`; keeps each row's log-sum-exp for the backward.
struct FlashAttention {
    vis: KeyVisibility,
    /// `[B, KV, G, T, total, D]`.
    dims: [usize; 6],
    /// `[B, KV, G·T]` log-sum-exps of the rows' scores, written by the forward.
    lse: Mutex<Option<CpuStorage>>,
}

/// A matrix inside a slice: element `(i, j)` at `rs·i + cs·j`.
#[derive(Clone, Copy)]
struct Mat<'a, T> {
    data: &'a [T],
    rs: usize,
    cs: usize,
}

impl<'a, T> Mat<'a, T> {
    fn rows(data: &'a [T], rs: usize) -> Self {
        Self { data, rs, cs: 1 }
    }

    fn t(self) -> Self {
        Self {
            data: self.data,
            rs: self.cs,
            cs: self.rs,
        }
    }

    /// Whether an `r × c` matrix fits in the slice.
    fn fits(&self, r: usize, c: usize) -> bool {
        r == 0 || c == 0 || (r - 1) * self.rs + (c - 1) * self.cs < self.data.len()
    }
}

/// `dst (+)= a b` for `a: m × k`, `b: k × n`, `dst: m × n` row-major with row stride `dst_rs`
/// (accumulates when `add`).
fn mm<T: Real>(
    dst: &mut [T],
    dst_rs: usize,
    a: Mat<T>,
    b: Mat<T>,
    (m, n, k): (usize, usize, usize),
    add: bool,
) {
    assert!(
        Mat::rows(&*dst, dst_rs).fits(m, n) && a.fits(m, k) && b.fits(k, n),
        "attention tile out of bounds"
    );
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: the extents read and written lie inside the slices (asserted above), and `dst` is
    // a unique borrow, so it aliases neither operand.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            add,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            T::ONE,
            T::ONE,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// Keys or values `[B, KV, total, D]` in their storage: rows contiguous, any other strides.
#[derive(Clone, Copy)]
struct Rows<'a, T> {
    data: &'a [T],
    offset: usize,
    stride: [usize; 3],
    d: usize,
}

impl<'a, T: Real> Rows<'a, T> {
    fn new(storage: &'a CpuStorage, layout: &Layout, what: &str) -> Result<Self> {
        let data = T::slice(storage)
            .ok_or_else(|| candle_core::Error::Msg(format!("attention {what}: dtype")))?;
        let (dims, st) = (layout.dims(), layout.stride());
        if dims.len() != 4 || (st[3] != 1 && dims[3] != 1) {
            candle_core::bail!("attention {what}: rows must be contiguous");
        }
        Ok(Self {
            data,
            offset: layout.start_offset(),
            stride: [st[0], st[1], st[2]],
            d: dims[3],
        })
    }

    /// Rows `j0..j1` of head `h` of batch row `b`, as an `(j1 − j0) × D` matrix.
    fn block(&self, b: usize, h: usize, j0: usize, j1: usize) -> Mat<'a, T> {
        let start = self.offset + b * self.stride[0] + h * self.stride[1] + j0 * self.stride[2];
        let len = if j1 > j0 {
            (j1 - j0 - 1) * self.stride[2] + self.d
        } else {
            0
        };
        Mat::rows(&self.data[start..start + len], self.stride[2])
    }
}

/// The shapes of one call, and its tiles.
#[derive(Clone, Copy)]
struct Geometry {
    b: usize,
    kv: usize,
    g: usize,
    t: usize,
    total: usize,
    d: usize,
    past: usize,
}

impl Geometry {
    fn of(dims: [usize; 6], past: usize) -> Self {
        let [b, kv, g, t, total, d] = dims;
        Self {
            b,
            kv,
            g,
            t,
            total,
            d,
            past,
        }
    }

    fn q_blocks(&self) -> usize {
        self.t.div_ceil(BLOCK_Q)
    }

    /// Query positions `[i0, i1)` of query block `qb`.
    fn q_range(&self, qb: usize) -> (usize, usize) {
        (qb * BLOCK_Q, ((qb + 1) * BLOCK_Q).min(self.t))
    }

    /// Index of row `(g, i)` of key head `h` of batch row `b` in `[B, KV, G·T]`.
    fn row(&self, b: usize, h: usize, g: usize, i: usize) -> usize {
        ((b * self.kv + h) * self.g + g) * self.t + i
    }

    /// Offset of query position `i`, head `h·G + g`, of batch row `b` in `[B, T, KV·G, D]`.
    fn out_at(&self, b: usize, h: usize, g: usize, i: usize) -> usize {
        ((b * self.t + i) * self.kv * self.g + h * self.g + g) * self.d
    }

    /// Multiply-adds of `q kᵀ` over the visible triangle: the work estimate.
    fn work(&self) -> usize {
        self.b * self.kv * self.g * self.t * (self.past + self.t.div_ceil(2)) * self.d
    }
}

/// The scratch buffers of one tile.
struct Tile<T> {
    /// `[G·BQ, D]` the tile's query rows.
    q: Vec<T>,
    /// `[G·BQ, BLOCK_K]` scores, then probabilities.
    s: Vec<T>,
    /// `[G·BQ, BLOCK_K]` the probabilities' gradient (backward).
    dp: Vec<T>,
}

impl<T: Real> Tile<T> {
    fn new(geo: &Geometry) -> Self {
        let rows = geo.g * BLOCK_Q.min(geo.t);
        Self {
            q: vec![T::ZERO; rows * geo.d],
            s: vec![T::ZERO; rows * BLOCK_K],
            dp: Vec::new(),
        }
    }
}

/// Copies rows `(g, i0..i1)` for every `g` of a `[.., G·T, D]` head into `dst` (`[G·n, D]`).
fn gather_q<T: Real>(dst: &mut [T], head: &[T], geo: &Geometry, (i0, i1): (usize, usize)) {
    let (n, d) = (i1 - i0, geo.d);
    for g in 0..geo.g {
        let src = &head[(g * geo.t + i0) * d..(g * geo.t + i1) * d];
        dst[g * n * d..(g + 1) * n * d].copy_from_slice(src);
    }
}

/// Copies rows `(g, i0..i1)` of key head `h` out of a `[B, T, KV·G, D]` tensor into `dst`.
fn gather_out<T: Real>(
    dst: &mut [T],
    src: &[T],
    geo: &Geometry,
    (b, h): (usize, usize),
    (i0, i1): (usize, usize),
) {
    let (n, d) = (i1 - i0, geo.d);
    for g in 0..geo.g {
        for i in i0..i1 {
            let at = geo.out_at(b, h, g, i);
            let r = g * n + (i - i0);
            dst[r * d..(r + 1) * d].copy_from_slice(&src[at..at + d]);
        }
    }
}

/// Applies the visibility rule to a score tile `s` (`[G·n, nk]`, keys `j0..`, query positions
/// `p0..p0 + n`): masked scores become −∞.
fn mask_tile<T: Real>(
    s: &mut [T],
    vis: &KeyVisibility,
    b: usize,
    (j0, nk): (usize, usize),
    (p0, n): (usize, usize),
) {
    for (r, row) in s.chunks_exact_mut(nk).enumerate() {
        let p = p0 + r % n;
        for (jj, x) in row.iter_mut().enumerate() {
            if !vis.visible(b, p, j0 + jj) {
                *x = T::NEG_INF;
            }
        }
    }
}

/// The key blocks `(j0, j1)` a tile of query positions `[p0, p1)` of row `b` needs.
fn key_blocks<'a>(
    vis: &'a KeyVisibility,
    b: usize,
    (p0, p1): (usize, usize),
) -> impl Iterator<Item = (usize, usize)> + 'a {
    (0..p1.div_ceil(BLOCK_K))
        .map(move |kb| (kb * BLOCK_K, ((kb + 1) * BLOCK_K).min(p1)))
        .filter(move |&blk| vis.block_needed(b, blk, (p0, p1)))
}

/// Runs `f(scratch, item)` for `0..n`, on rayon's pool when `parallel`; results in order.
fn run_items<S, R: Send>(
    n: usize,
    parallel: bool,
    init: impl Fn() -> S + Sync + Send,
    f: impl Fn(&mut S, usize) -> R + Sync + Send,
) -> Vec<R> {
    if parallel && n > 1 {
        // About 8 jobs per thread: fine enough to balance the causal tiles' unequal costs,
        // coarse enough that decoding's many tiny tiles do not pay a job each. (Which thread
        // runs an item never changes its result.)
        let per_job = (n / (8 * rayon::current_num_threads())).max(1);
        (0..n)
            .into_par_iter()
            .with_min_len(per_job)
            .map_init(init, f)
            .collect()
    } else {
        let mut s = init();
        (0..n).map(|i| f(&mut s, i)).collect()
    }
}

/// One forward tile: rows `(g, i0..i1)` of key head `h` of batch row `b`. Returns the output
/// rows `[G·n, D]` and their log-sum-exps `[G·n]`.
#[allow(clippy::too_many_arguments)]
fn fwd_tile<T: ExpKernels>(
    tile: &mut Tile<T>,
    q: &[T],
    k: &Rows<T>,
    v: &Rows<T>,
    vis: &KeyVisibility,
    geo: &Geometry,
    (b, h): (usize, usize),
    (i0, i1): (usize, usize),
) -> (Vec<T>, Vec<T>) {
    let (n, d) = (i1 - i0, geo.d);
    let rows = geo.g * n;
    let head = &q[geo.row(b, h, 0, 0) * d..geo.row(b, h, geo.g, 0) * d];
    gather_q(&mut tile.q, head, geo, (i0, i1));
    let qt = Mat::rows(&tile.q[..rows * d], d);
    let (p0, p1) = (geo.past + i0, geo.past + i1);
    let mut o = vec![T::ZERO; rows * d];
    let mut m = vec![T::NEG_INF; rows];
    let mut l = vec![T::ZERO; rows];
    for (j0, j1) in key_blocks(vis, b, (p0, p1)) {
        let nk = j1 - j0;
        let s = &mut tile.s[..rows * nk];
        let kb = k.block(b, h, j0, j1);
        mm(s, nk, qt, kb.t(), (rows, nk, d), false);
        if !vis.block_full(b, (j0, j1), p0) {
            mask_tile(s, vis, b, (j0, nk), (p0, n));
        }
        softmax_block(s, nk, (&mut o, &mut m, &mut l), v.block(b, h, j0, j1), d);
    }
    finish_rows(&mut o, &mut m, &l, d);
    (o, m)
}

/// The online softmax's step over one block of scores `s` (`rows × nk`): each row's scores
/// become `exp(s − m)` against its running maximum `m` (raised to the block's), and the row's
/// sum `l` and output `o` (`rows × d`) are rescaled to it. A row whose block is wholly masked
/// (−∞) becomes zeros and keeps its state. Then the block's values `vb` (`nk × d`) are added
/// to `o`, weighted by `s`.
fn softmax_block<T: ExpKernels>(
    s: &mut [T],
    nk: usize,
    (o, m, l): (&mut [T], &mut [T], &mut [T]),
    vb: Mat<T>,
    d: usize,
) {
    for (r, row) in s.chunks_exact_mut(nk).enumerate() {
        let mx = super::max(row);
        if mx == T::NEG_INF {
            row.fill(T::ZERO);
            continue;
        }
        let m_new = if m[r] > mx { m[r] } else { mx };
        let sum = T::exp_row(row, m_new);
        if m_new != m[r] {
            let alpha = (m[r] - m_new).exp();
            l[r] *= alpha;
            for x in &mut o[r * d..(r + 1) * d] {
                *x *= alpha;
            }
            m[r] = m_new;
        }
        l[r] += sum;
    }
    let rows = m.len();
    mm(o, d, Mat::rows(&*s, nk), vb, (rows, d, nk), true);
}

/// The online softmax's end: each output row `o` divided by its sum `l`, and `m` turned into
/// the row's log-sum-exp.
fn finish_rows<T: ExpKernels>(o: &mut [T], m: &mut [T], l: &[T], d: usize) {
    for (r, or) in o.chunks_exact_mut(d).enumerate() {
        let inv = T::ONE / l[r];
        for x in or {
            *x *= inv;
        }
        m[r] += l[r].ln();
    }
}

/// The forward: the output `[B, T, KV·G, D]` and the log-sum-exps `[B, KV, G·T]`.
fn fwd<T: ExpKernels>(
    q: &[T],
    k: &Rows<T>,
    v: &Rows<T>,
    vis: &KeyVisibility,
    geo: &Geometry,
) -> (Vec<T>, Vec<T>) {
    let nqb = geo.q_blocks();
    let items = geo.b * geo.kv * nqb;
    let tiles = run_items(
        items,
        geo.work() >= PARALLEL_MIN_WORK,
        || Tile::new(geo),
        |tile, item| {
            let (bh, qb) = (item / nqb, item % nqb);
            let (b, h) = (bh / geo.kv, bh % geo.kv);
            fwd_tile(tile, q, k, v, vis, geo, (b, h), geo.q_range(qb))
        },
    );
    let d = geo.d;
    let mut out = vec![T::ZERO; geo.b * geo.t * geo.kv * geo.g * d];
    let mut lse = vec![T::ZERO; geo.b * geo.kv * geo.g * geo.t];
    for (item, (o, m)) in tiles.into_iter().enumerate() {
        let (bh, qb) = (item / nqb, item % nqb);
        let (b, h) = (bh / geo.kv, bh % geo.kv);
        let (i0, i1) = geo.q_range(qb);
        let n = i1 - i0;
        for g in 0..geo.g {
            for i in i0..i1 {
                let r = g * n + (i - i0);
                let at = geo.out_at(b, h, g, i);
                out[at..at + d].copy_from_slice(&o[r * d..(r + 1) * d]);
                lse[geo.row(b, h, g, i)] = m[r];
            }
        }
    }
    (out, lse)
}

/// The backward's inputs, all in their storage.
struct BwdInputs<'a, T> {
    /// `[B, KV, G·T, D]`.
    q: &'a [T],
    k: Rows<'a, T>,
    v: Rows<'a, T>,
    /// `[B, T, KV·G, D]` the forward's output and its gradient.
    o: &'a [T],
    d_o: &'a [T],
    /// `[B, KV, G·T]`.
    lse: &'a [T],
}

/// What one backward unit (a chunk of one head's query blocks) returns: `dQ` tiles (in the
/// chunk's block order) and partial `dK`, `dV` over keys `0..kmax`.
struct BwdPart<T> {
    dq: Vec<Vec<T>>,
    dk: Vec<T>,
    dv: Vec<T>,
}

/// The query blocks of chunk `c` of `chunks`: every `chunks`-th block from `c` (interleaved, so
/// that causal costs balance).
fn chunk_blocks(nqb: usize, chunks: usize, c: usize) -> impl Iterator<Item = usize> {
    (c..nqb).step_by(chunks)
}

/// One backward unit: query blocks `chunk_blocks(.., c)` of key head `h` of batch row `b`.
fn bwd_unit<T: ExpKernels>(
    tile: &mut Tile<T>,
    x: &BwdInputs<T>,
    vis: &KeyVisibility,
    geo: &Geometry,
    (b, h): (usize, usize),
    (chunks, c): (usize, usize),
) -> BwdPart<T> {
    let d = geo.d;
    let nqb = geo.q_blocks();
    let kmax = chunk_blocks(nqb, chunks, c)
        .map(|qb| geo.past + geo.q_range(qb).1)
        .max()
        .unwrap_or(0);
    let mut dk = vec![T::ZERO; kmax * d];
    let mut dv = vec![T::ZERO; kmax * d];
    let mut dqs = Vec::new();
    let rows_max = geo.g * BLOCK_Q.min(geo.t);
    tile.dp.resize(rows_max * BLOCK_K, T::ZERO);
    let mut d_o = vec![T::ZERO; rows_max * d];
    let mut o = vec![T::ZERO; rows_max * d];
    let mut di = vec![T::ZERO; rows_max];
    let mut lse = vec![T::ZERO; rows_max];
    let head = &x.q[geo.row(b, h, 0, 0) * d..geo.row(b, h, geo.g, 0) * d];
    for qb in chunk_blocks(nqb, chunks, c) {
        let (i0, i1) = geo.q_range(qb);
        let n = i1 - i0;
        let rows = geo.g * n;
        gather_q(&mut tile.q, head, geo, (i0, i1));
        gather_out(&mut d_o, x.d_o, geo, (b, h), (i0, i1));
        gather_out(&mut o, x.o, geo, (b, h), (i0, i1));
        for g in 0..geo.g {
            for i in i0..i1 {
                let r = g * n + (i - i0);
                lse[r] = x.lse[geo.row(b, h, g, i)];
                di[r] = dot(&d_o[r * d..(r + 1) * d], &o[r * d..(r + 1) * d]);
            }
        }
        let qt = Mat::rows(&tile.q[..rows * d], d);
        let dot_t = Mat::rows(&d_o[..rows * d], d);
        let mut dq = vec![T::ZERO; rows * d];
        let (p0, p1) = (geo.past + i0, geo.past + i1);
        for (j0, j1) in key_blocks(vis, b, (p0, p1)) {
            let nk = j1 - j0;
            let (kb, vb) = (x.k.block(b, h, j0, j1), x.v.block(b, h, j0, j1));
            let s = &mut tile.s[..rows * nk];
            mm(s, nk, qt, kb.t(), (rows, nk, d), false);
            if !vis.block_full(b, (j0, j1), p0) {
                mask_tile(s, vis, b, (j0, nk), (p0, n));
            }
            for (r, row) in s.chunks_exact_mut(nk).enumerate() {
                T::exp_row(row, lse[r]);
            }
            // dV += Pᵀ dO.
            let p = Mat::rows(&*s, nk);
            mm(
                &mut dv[j0 * d..j1 * d],
                d,
                p.t(),
                dot_t,
                (nk, d, rows),
                true,
            );
            // dP = dO Vᵀ, then dS = P ∘ (dP − Dᵢ) in place.
            let dp = &mut tile.dp[..rows * nk];
            mm(dp, nk, dot_t, vb.t(), (rows, nk, d), false);
            for (r, (dr, pr)) in dp.chunks_exact_mut(nk).zip(s.chunks_exact(nk)).enumerate() {
                for (g, &p) in dr.iter_mut().zip(pr) {
                    *g = p * (*g - di[r]);
                }
            }
            let ds = Mat::rows(&*dp, nk);
            // dQ += dS K, dK += dSᵀ Q.
            mm(&mut dq, d, ds, kb, (rows, d, nk), true);
            mm(&mut dk[j0 * d..j1 * d], d, ds.t(), qt, (nk, d, rows), true);
        }
        dqs.push(dq);
    }
    BwdPart { dq: dqs, dk, dv }
}

/// The backward: `dq [B, KV, G·T, D]`, `dk`, `dv [B, KV, total, D]` (contiguous).
fn bwd<T: ExpKernels>(x: &BwdInputs<T>, vis: &KeyVisibility, geo: &Geometry) -> [Vec<T>; 3] {
    let nqb = geo.q_blocks();
    let heads = geo.b * geo.kv;
    let chunks = BWD_MIN_UNITS.div_ceil(heads.max(1)).clamp(1, nqb.max(1));
    let parts = run_items(
        heads * chunks,
        geo.work() >= PARALLEL_MIN_WORK / 2,
        || Tile::new(geo),
        |tile, item| {
            let (bh, c) = (item / chunks, item % chunks);
            bwd_unit(tile, x, vis, geo, (bh / geo.kv, bh % geo.kv), (chunks, c))
        },
    );
    let d = geo.d;
    let mut dq = vec![T::ZERO; geo.b * geo.kv * geo.g * geo.t * d];
    let mut dk = vec![T::ZERO; heads * geo.total * d];
    let mut dv = vec![T::ZERO; heads * geo.total * d];
    for (item, part) in parts.into_iter().enumerate() {
        let (bh, c) = (item / chunks, item % chunks);
        let (b, h) = (bh / geo.kv, bh % geo.kv);
        for (qb, tile) in chunk_blocks(nqb, chunks, c).zip(&part.dq) {
            let (i0, i1) = geo.q_range(qb);
            let n = i1 - i0;
            for g in 0..geo.g {
                let at = geo.row(b, h, g, i0) * d;
                dq[at..at + n * d].copy_from_slice(&tile[g * n * d..(g + 1) * n * d]);
            }
        }
        let base = bh * geo.total * d;
        for (dst, src) in [(&mut dk, &part.dk), (&mut dv, &part.dv)] {
            for (a, &s) in dst[base..base + src.len()].iter_mut().zip(src) {
                *a += s;
            }
        }
    }
    [dq, dk, dv]
}

impl CustomOp3 for FlashAttention {
    fn name(&self) -> &'static str {
        "turnwise-flash-attention"
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
        let geo = Geometry::of(self.dims, self.vis.past);
        macro_rules! go {
            ($t:ty, $variant:ident) => {{
                let q = contiguous::<$t>(s1, l1, "attention q")?;
                let k = Rows::<$t>::new(s2, l2, "k")?;
                let v = Rows::<$t>::new(s3, l3, "v")?;
                let (out, lse) = fwd(q, &k, &v, &self.vis, &geo);
                (CpuStorage::$variant(out), CpuStorage::$variant(lse))
            }};
        }
        let (out, lse) = match s1.dtype() {
            DType::F32 => go!(f32, F32),
            DType::F64 => go!(f64, F64),
            dt => candle_core::bail!("attention: unsupported dtype {dt:?}"),
        };
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = Some(lse);
        Ok((out, Shape::from((geo.b, geo.t, geo.kv * geo.g, geo.d))))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let geo = Geometry::of(self.dims, self.vis.past);
        let grad = grad.contiguous()?;
        let lse_guard = self.lse.lock().unwrap_or_else(|e| e.into_inner());
        let Some(lse) = lse_guard.as_ref() else {
            candle_core::bail!("attention backward before its forward");
        };
        let tensors = [q, k, v, res, &grad];
        let guards: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
        let cpu = cpu_storages(&guards, "attention backward")?;
        macro_rules! go {
            ($t:ty) => {{
                let x = BwdInputs {
                    q: contiguous::<$t>(cpu[0].0, cpu[0].1, "attention q")?,
                    k: Rows::<$t>::new(cpu[1].0, cpu[1].1, "k")?,
                    v: Rows::<$t>::new(cpu[2].0, cpu[2].1, "v")?,
                    o: contiguous::<$t>(cpu[3].0, cpu[3].1, "attention output")?,
                    d_o: contiguous::<$t>(cpu[4].0, cpu[4].1, "attention gradient")?,
                    lse: <$t as Real>::slice(lse).ok_or_else(|| {
                        candle_core::Error::Msg("attention log-sum-exp: dtype".into())
                    })?,
                };
                let [dq, dk, dv] = bwd(&x, &self.vis, &geo);
                let dev = q.device();
                [
                    Tensor::from_vec(dq, q.dims(), dev)?,
                    Tensor::from_vec(dk, k.dims(), dev)?,
                    Tensor::from_vec(dv, v.dims(), dev)?,
                ]
            }};
        }
        let [dq, dk, dv] = match q.dtype() {
            DType::F32 => go!(f32),
            DType::F64 => go!(f64),
            dt => candle_core::bail!("attention backward: unsupported dtype {dt:?}"),
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}
