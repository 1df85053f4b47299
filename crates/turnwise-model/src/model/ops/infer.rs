//! Forward-only CPU kernel for sampling on detached weights: `x Wᵀ` for a few rows.
//!
//! While decoding, every linear layer multiplies a handful of rows (one per running sequence) by
//! a weight matrix. candle's matmul (the `gemm` crate) packs the weight into its panel layout on
//! every call, which for a few rows costs more than the multiplication: at batch 8 on size B,
//! packing was 55 % of sampling time. [`linear`] reads the weight rows in place (both operands
//! are rows of length `K`, so `y[i, j] = x[i] · w[j]`), four weight rows against four input rows
//! at a time with AVX-512 FMAs (16 lanes) or, on CPUs without AVX-512, against two input rows
//! with AVX2 FMAs (8 lanes; AVX2's 16 registers hold no more accumulators), the
//! weight streamed once per call and prefetched two column blocks ahead (decoding is bound by
//! that stream); [`kernel_isa`] picks the widest the CPU has at run time. (A
//! fused decoding attention kernel was measured too and lost to candle's batched matmuls: it
//! is not here.)
//!
//! It records no graph: the model routes here only when no input tracks gradients (sampling
//! on [`crate::Transformer::detached_from_varmap`] weights), on the CPU, in `f32`. Every other
//! case returns `None` and the caller uses the differentiable candle ops.

use candle_core::{DType, Layout, Storage, Tensor};

use super::dot;

/// Up to this many rows [`linear`] beats candle's matmul (measured with the `model` bench's
/// `TURNWISE_BENCH_FILTER=ops` on size-B shapes: 6.8× at 8 rows, 1.3× at 64, even near 128).
pub const LINEAR_MAX_ROWS: usize = 96;

/// The AVX2 kernel's own row limit. On a 2-core AVX2 CPU (AMD EPYC, Zen 3), against candle's
/// matmul (`gemm`'s AVX2 kernels, size-B shapes, the `model` bench's ops table) it measured
/// 1.2–2.0× at 8 rows and 0.98–1.05× at 32 (on an AVX-512 machine, whose `gemm` runs AVX-512,
/// with `TURNWISE_KERNEL_ISA=avx2`: 4.4–4.8× at 8 rows, 1.4–1.5× at 32, 0.9× at 64).
pub const AVX2_MAX_ROWS: usize = 32;

/// Below this many multiply-adds a kernel stays on the calling thread.
const PARALLEL_MIN_MACS: usize = 1 << 20;

/// The instruction set of the sampling kernels, narrowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum KernelIsa {
    /// No kernel: [`linear`] declines and the caller runs candle's matmul.
    Portable,
    /// AVX2 with FMA: 8 lanes.
    Avx2,
    /// AVX-512F: 16 lanes.
    Avx512,
}

impl KernelIsa {
    /// The widest set this CPU runs.
    pub fn detected() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Self::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Self::Avx2;
            }
        }
        Self::Portable
    }

    /// Every set this CPU runs, narrowest first (what the tests compare against the reference).
    pub fn supported() -> Vec<Self> {
        [Self::Portable, Self::Avx2, Self::Avx512]
            .into_iter()
            .filter(|&i| i <= Self::detected())
            .collect()
    }
}

/// The kernels' instruction set: the widest the CPU has (checked once), capped by
/// `TURNWISE_KERNEL_ISA` = `avx2` or `portable` (to measure or test a narrower path on a wider
/// CPU; any other value is ignored).
pub fn kernel_isa() -> KernelIsa {
    static ISA: std::sync::OnceLock<KernelIsa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        let cap = match std::env::var("TURNWISE_KERNEL_ISA").as_deref() {
            Ok("avx2") => KernelIsa::Avx2,
            Ok("portable") => KernelIsa::Portable,
            _ => KernelIsa::Avx512,
        };
        KernelIsa::detected().min(cap)
    })
}

/// Whether `t` is a graph-free `f32` CPU tensor.
fn plain_f32_cpu(t: &Tensor) -> bool {
    t.dtype() == DType::F32 && super::fused_on(t.device()) && !t.track_op()
}

/// The `f32` values of a contiguous CPU tensor's storage.
fn f32_slice<'a>(storage: &'a Storage, layout: &Layout) -> candle_core::Result<&'a [f32]> {
    let data = match storage {
        Storage::Cpu(cpu) => cpu.as_slice::<f32>()?,
        _ => candle_core::bail!("infer kernels run on CPU storage"),
    };
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("infer kernels need contiguous input"),
    }
}

/// `x Wᵀ` for `x: [M, K]` and `w: [N, K]` (Hugging Face layout), when `M <= max_rows`, the CPU
/// has AVX-512 or AVX2 ([`kernel_isa`]) and neither input tracks gradients (`f32`, CPU); `None`
/// otherwise.
pub fn linear(x: &Tensor, w: &Tensor, max_rows: usize) -> candle_core::Result<Option<Tensor>> {
    Ok(linear_many(x, &[w], max_rows)?.and_then(|mut ys| ys.pop()))
}

/// `x Wᵢᵀ` for several weights `Wᵢ: [Nᵢ, K]` sharing the input `x: [M, K]` (a layer's q, k and v
/// projections, or its gate and up projections), in one parallel pass: the threads split the
/// weights' columns together, so the layer pays one dispatch instead of one per weight. Same
/// conditions as [`linear`], for every weight; `None` otherwise.
pub fn linear_many(
    x: &Tensor,
    ws: &[&Tensor],
    max_rows: usize,
) -> candle_core::Result<Option<Vec<Tensor>>> {
    let Ok((m, k)) = x.dims2() else {
        return Ok(None);
    };
    let mut ns = Vec::with_capacity(ws.len());
    for w in ws {
        match w.dims2() {
            Ok((n, kw)) if kw == k && plain_f32_cpu(w) => ns.push(n),
            _ => return Ok(None),
        }
    }
    // Batch-invariant inference runs every row count here (the portable dot products on a
    // CPU without the kernels): `gemm`'s sums depend on the number of rows.
    let invariant = super::batch_invariant();
    let max_rows = match kernel_isa() {
        _ if invariant => usize::MAX,
        KernelIsa::Avx2 => max_rows.min(AVX2_MAX_ROWS),
        _ => max_rows,
    };
    if m == 0
        || m > max_rows
        || ws.is_empty()
        || (kernel_isa() == KernelIsa::Portable && !invariant)
        || !plain_f32_cpu(x)
    {
        return Ok(None);
    }
    let x = x.contiguous()?;
    let ws: Vec<Tensor> = ws
        .iter()
        .map(|w| w.contiguous())
        .collect::<candle_core::Result<_>>()?;
    let (xs, xl) = x.storage_and_layout();
    let guards: Vec<_> = ws.iter().map(|w| w.storage_and_layout()).collect();
    let slices = guards
        .iter()
        .map(|(s, l)| f32_slice(s, l))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let ys = matmul_xwt_many(f32_slice(&xs, xl)?, &slices, m, &ns, k, kernel_isa())?;
    ys.into_iter()
        .zip(&ns)
        .map(|(y, &n)| Tensor::from_vec(y, (m, n), x.device()))
        .collect::<candle_core::Result<Vec<_>>>()
        .map(Some)
}

/// `y[i, j] = x[i] · w[j]` for row-major `x: [m, k]`, `w: [n, k]`; `y: [m, n]`, with the tiles
/// of `isa` (the portable dot products for a set the CPU lacks).
#[cfg(test)]
pub(crate) fn matmul_xwt(
    x: &[f32],
    w: &[f32],
    m: usize,
    n: usize,
    k: usize,
    isa: KernelIsa,
) -> candle_core::Result<Vec<f32>> {
    Ok(matmul_xwt_many(x, &[w], m, &[n], k, isa)?.remove(0))
}

/// Columns `[j0, j1)` of `y = x wᵀ` (`y: [m, n]`) written by the `isa` kernel, the other
/// columns left as they are: what one thread of [`matmul_xwt_many`] runs on its block.
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_xwt_columns(
    x: &[f32],
    w: &[f32],
    m: usize,
    n: usize,
    k: usize,
    (j0, j1): (usize, usize),
    isa: KernelIsa,
    y: &mut [f32],
) {
    assert!(x.len() == m * k && w.len() == n * k && y.len() == m * n && j0 <= j1 && j1 <= n);
    // SAFETY: the lengths are checked above, and `y` is borrowed mutably for the whole call.
    unsafe { columns(x, w, m, n, k, j0, j1, SyncPtr(y.as_mut_ptr()), isa) };
}

/// [`matmul_xwt`] for several weights `ws[i]: [ns[i], k]`: one output `[m, ns[i]]` each. The
/// threads split the weights' columns, concatenated, into contiguous blocks of whole 4-row
/// weight tiles.
pub(crate) fn matmul_xwt_many(
    x: &[f32],
    ws: &[&[f32]],
    m: usize,
    ns: &[usize],
    k: usize,
    isa: KernelIsa,
) -> candle_core::Result<Vec<Vec<f32>>> {
    if ws.len() != ns.len() {
        candle_core::bail!(
            "matmul_xwt: {} weights, {} column counts",
            ws.len(),
            ns.len()
        );
    }
    for (w, &n) in ws.iter().zip(ns) {
        if x.len() != m * k || w.len() != n * k {
            candle_core::bail!(
                "matmul_xwt: x has {} values for [{m}, {k}], w {} for [{n}, {k}]",
                x.len(),
                w.len()
            );
        }
    }
    let mut ys: Vec<Vec<f32>> = ns.iter().map(|&n| vec![0f32; m * n]).collect();
    let outs: Vec<SyncPtr> = ys.iter_mut().map(|y| SyncPtr(y.as_mut_ptr())).collect();
    // Weight `i`'s columns start at `offsets[i]` of the concatenated column range.
    let offsets: Vec<usize> = ns
        .iter()
        .scan(0, |acc, &n| {
            let o = *acc;
            *acc += n;
            Some(o)
        })
        .collect();
    let total: usize = ns.iter().sum();
    let threads = if m * total * k >= PARALLEL_MIN_MACS {
        rayon::current_num_threads().min(total.div_ceil(4)).max(1)
    } else {
        1
    };
    // Column blocks of whole 4-row weight tiles, one per thread; each writes its own columns.
    let per = total.div_ceil(threads).div_ceil(4) * 4;
    let run = |c0: usize| {
        let c1 = (c0 + per).min(total);
        for (i, (&w, &n)) in ws.iter().zip(ns).enumerate() {
            let (j0, j1) = (c0.max(offsets[i]), c1.min(offsets[i] + n));
            if j0 < j1 {
                // SAFETY: column blocks are disjoint across tasks, and `ys` outlives the scope.
                unsafe {
                    columns(
                        x,
                        w,
                        m,
                        n,
                        k,
                        j0 - offsets[i],
                        j1 - offsets[i],
                        outs[i],
                        isa,
                    )
                };
            }
        }
    };
    if threads == 1 {
        run(0);
    } else {
        rayon::scope(|s| {
            for t in 1..threads {
                let run = &run;
                s.spawn(move |_| run(t * per));
            }
            run(0);
        });
    }
    Ok(ys)
}

/// `y = x wᵀ` (`x: [m, k]`, `w: [n, k]`, `y: [m, n]`, row-major) on the calling thread, with
/// the tiles of `isa`: each `y[i, j]` is the same fixed-order dot product of `x[i]` and `w[j]`
/// whatever `m`, `n` or the tile it falls in (what [`super::invariant::attention`] builds its
/// scores from).
pub(crate) fn xwt_into(
    x: &[f32],
    w: &[f32],
    (m, n, k): (usize, usize, usize),
    y: &mut [f32],
    isa: KernelIsa,
) {
    assert!(x.len() >= m * k && w.len() >= n * k && y.len() >= m * n);
    // SAFETY: the lengths are checked above, and `y` is borrowed mutably for the whole call.
    unsafe { columns(x, w, m, n, k, 0, n, SyncPtr(y.as_mut_ptr()), isa) };
}

/// A raw output pointer shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: tasks write disjoint elements only (see `matmul_xwt`).
unsafe impl Send for SyncPtr {}
// SAFETY: as above.
unsafe impl Sync for SyncPtr {}

/// Fills columns `[j0, j1)` of `y = x wᵀ`.
///
/// # Safety
/// `out` points to `m * n` floats; no other thread writes these columns concurrently.
#[allow(clippy::too_many_arguments)]
unsafe fn columns(
    x: &[f32],
    w: &[f32],
    m: usize,
    n: usize,
    k: usize,
    j0: usize,
    j1: usize,
    out: SyncPtr,
    isa: KernelIsa,
) {
    #[cfg(target_arch = "x86_64")]
    match isa.min(KernelIsa::detected()) {
        KernelIsa::Avx512 => {
            // SAFETY: the CPU has AVX-512F (checked above); the caller's contract covers `out`.
            unsafe { avx512::columns(x, w, m, n, k, j0, j1, out.0) };
            return;
        }
        KernelIsa::Avx2 => {
            // SAFETY: the CPU has AVX2 and FMA (checked above); as above for `out`.
            unsafe { avx2::columns(x, w, m, n, k, j0, j1, out.0) };
            return;
        }
        KernelIsa::Portable => {}
    }
    let _ = isa;
    for i in 0..m {
        let xr = &x[i * k..(i + 1) * k];
        for j in j0..j1 {
            // SAFETY: i < m, j < n, and this task owns column j.
            unsafe { *out.0.add(i * n + j) = dot(xr, &w[j * k..(j + 1) * k]) };
        }
    }
}

/// The `ROWS × 4` tiles of columns `[j0, j1)` of `y = x wᵀ` (`m` rows), each edge's rows and
/// columns one at a time, with the calling module's `tile::<R, C>` (the AVX-512 and AVX2 bodies
/// share it; a macro, so that each expands inside its own `#[target_feature]` function). `ROWS`
/// is the module's own: a tile's `ROWS × 4` accumulators and 4 weight vectors must fit the ISA's
/// registers (32 for AVX-512, 16 for AVX2), or the compiler spills accumulators to the stack in
/// the inner loop.
#[cfg(target_arch = "x86_64")]
macro_rules! tile_grid {
    ($tile:ident, $rows:expr, $x:expr, $w:expr, $m:expr, $n:expr, $k:expr, $j0:expr, $j1:expr, $out:expr) => {{
        let (x, w, m, n, k, j1, out) = ($x, $w, $m, $n, $k, $j1, $out);
        let mut j = $j0;
        while j < j1 {
            let cols = (j1 - j).min(4);
            let mut i = 0;
            while i < m {
                let rows = (m - i).min($rows);
                match (rows == $rows, cols == 4) {
                    (true, true) => $tile::<{ $rows }, 4>(x, w, n, k, i, j, out),
                    (true, false) => {
                        for jj in 0..cols {
                            $tile::<{ $rows }, 1>(x, w, n, k, i, j + jj, out);
                        }
                    }
                    (false, true) => {
                        for ii in 0..rows {
                            $tile::<1, 4>(x, w, n, k, i + ii, j, out);
                        }
                    }
                    (false, false) => {
                        for ii in 0..rows {
                            for jj in 0..cols {
                                $tile::<1, 1>(x, w, n, k, i + ii, j + jj, out);
                            }
                        }
                    }
                }
                i += rows;
            }
            j += cols;
        }
    }};
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// Input rows per tile: 16 accumulators and 4 weight vectors of the 32 registers.
    const ROWS: usize = 4;

    /// How far ahead of a tile's weight rows the tile prefetches, in weight rows: two column
    /// blocks of the grid's 4 rows (4 and 12 measured the same).
    const PREFETCH_AHEAD_ROWS: usize = 2 * 4;

    /// AVX-512 body of [`super::columns`]: tiles of 4 input rows × 4 weight rows, 16 lanes of
    /// `k` at a time (the tail through a masked load), the weight rows two column blocks ahead
    /// prefetched into L2.
    ///
    /// Each output is its own 16-lane accumulator, fused-multiply-added over `k` in order and
    /// summed by `_mm512_reduce_add_ps`'s tree (`reduce_4x4` does the same additions for a
    /// whole tile): the tiles, the loop and the prefetching leave every output's bits as they
    /// were (`infer_avx512_kernel_keeps_its_arithmetic_bit_for_bit`).
    ///
    /// # Safety
    /// The CPU has AVX-512F; `out` points to `m * n` floats and columns `[j0, j1)` are this
    /// call's alone.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn columns(
        x: &[f32],
        w: &[f32],
        m: usize,
        n: usize,
        k: usize,
        j0: usize,
        j1: usize,
        out: *mut f32,
    ) {
        // SAFETY: the caller's contract (bounds, CPU features, `out`) is `tile`'s.
        unsafe { tile_grid!(tile, ROWS, x, w, m, n, k, j0, j1, out) };
    }

    /// `[a₀..₈ + a₈..₁₆, b₀..₈ + b₈..₁₆]`: the first step of `_mm512_reduce_add_ps` for two
    /// vectors at once (the lower half the left operand, as there).
    #[inline(always)]
    unsafe fn add_halves(a: __m512, b: __m512) -> __m512 {
        // SAFETY: register-only intrinsics; the caller has AVX-512F.
        unsafe {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
            )
        }
    }

    /// The 16 sums of a 4 × 4 tile's accumulators, row `r` in 128-bit lane `r` (columns in
    /// order): `_mm512_reduce_add_ps` of each, with the same additions in the same operand
    /// order (lanes `l + 8` onto `l`, then `l + 4`, `l + 2`, `l + 1`), four outputs per vector
    /// instead of one: 30 shuffles and 15 additions for the tile, against 16 × 7.
    #[inline(always)]
    unsafe fn reduce_4x4(acc: &[[__m512; 4]; 4]) -> __m512 {
        // SAFETY: register-only intrinsics; the caller has AVX-512F.
        unsafe {
            // Per column c: 128-bit lane r holds row r's 4 partial sums (lanes l + 4 added).
            let quads = |c: usize| {
                let p = add_halves(acc[0][c], acc[1][c]);
                let q = add_halves(acc[2][c], acc[3][c]);
                _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0b10_00_10_00>(p, q),
                    _mm512_shuffle_f32x4::<0b11_01_11_01>(p, q),
                )
            };
            let (e0, e1, e2, e3) = (quads(0), quads(1), quads(2), quads(3));
            // Within each 128-bit lane: [l + 2 added for e_a, then for e_b].
            let pairs = |a: __m512, b: __m512| {
                _mm512_add_ps(
                    _mm512_shuffle_ps::<0b01_00_01_00>(a, b),
                    _mm512_shuffle_ps::<0b11_10_11_10>(a, b),
                )
            };
            let (g01, g23) = (pairs(e0, e1), pairs(e2, e3));
            _mm512_add_ps(
                _mm512_shuffle_ps::<0b10_00_10_00>(g01, g23),
                _mm512_shuffle_ps::<0b11_01_11_01>(g01, g23),
            )
        }
    }

    /// `R × C` dot products: rows `i..i+R` of `x` against rows `j..j+C` of `w`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const R: usize, const C: usize>(
        x: &[f32],
        w: &[f32],
        n: usize,
        k: usize,
        i: usize,
        j: usize,
        out: *mut f32,
    ) {
        // SAFETY (whole body): every pointer offset stays inside rows i..i+R of x and
        // j..j+C of w (length k each); the caller guarantees the bounds and AVX-512F.
        unsafe {
            let xp = x.as_ptr().add(i * k);
            let wp = w.as_ptr().add(j * k);
            let mut acc = [[_mm512_setzero_ps(); C]; R];
            let full = k - k % 16;
            // The weight rows two column blocks ahead (contiguous after these), one cache line
            // per 16 lanes, into L2 (`T1`): fetched while this block computes, so that the
            // memory stream never idles. With the unmasked loads and `reduce_4x4`, SmolLM2's
            // decode-step linears (the model bench's ops table) ran 1.3–1.4× as fast at 1 row,
            // 2.3–2.6× at 8, 1.8–1.9× at 16 and 1.4× at 64; into L1 (`T0`) the prefetch gained
            // only 0.93–1.28×. A prefetch does not fault, and `wrapping_add` keeps an address
            // past the weight's end defined.
            let next = wp.wrapping_add(PREFETCH_AHEAD_ROWS * k);
            let mut p = 0;
            while p < full {
                for c in 0..C {
                    _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(c * k + p).cast());
                }
                let mut wv = [_mm512_setzero_ps(); C];
                for (c, v) in wv.iter_mut().enumerate() {
                    *v = _mm512_loadu_ps(wp.add(c * k + p));
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let xv = _mm512_loadu_ps(xp.add(r * k + p));
                    for c in 0..C {
                        acc_r[c] = _mm512_fmadd_ps(xv, wv[c], acc_r[c]);
                    }
                }
                p += 16;
            }
            // The last k − full lanes; the others load zeros and add 0 · 0.
            if full < k {
                let mask = ((1u32 << (k - full)) - 1) as __mmask16;
                let mut wv = [_mm512_setzero_ps(); C];
                for (c, v) in wv.iter_mut().enumerate() {
                    *v = _mm512_maskz_loadu_ps(mask, wp.add(c * k + full));
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let xv = _mm512_maskz_loadu_ps(mask, xp.add(r * k + full));
                    for c in 0..C {
                        acc_r[c] = _mm512_fmadd_ps(xv, wv[c], acc_r[c]);
                    }
                }
            }
            if R == 4 && C == 4 {
                // `[[_; C]; R]` is `[[_; 4]; 4]` here (the same type, so the same layout).
                let s = reduce_4x4(&*acc.as_ptr().cast::<[[__m512; 4]; 4]>());
                _mm_storeu_ps(out.add(i * n + j), _mm512_extractf32x4_ps::<0>(s));
                _mm_storeu_ps(out.add((i + 1) * n + j), _mm512_extractf32x4_ps::<1>(s));
                _mm_storeu_ps(out.add((i + 2) * n + j), _mm512_extractf32x4_ps::<2>(s));
                _mm_storeu_ps(out.add((i + 3) * n + j), _mm512_extractf32x4_ps::<3>(s));
            } else {
                for (r, acc_r) in acc.iter().enumerate() {
                    for (c, a) in acc_r.iter().enumerate() {
                        *out.add((i + r) * n + j + c) = _mm512_reduce_add_ps(*a);
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Input rows per tile: 8 accumulators, 4 weight vectors and an input vector of the 16
    /// registers. Four rows (16 accumulators) spilled to the stack in the inner loop.
    const ROWS: usize = 2;

    /// How far ahead of a tile's weight rows the tile prefetches, in weight rows: two column
    /// blocks of the grid's 4 rows.
    const PREFETCH_AHEAD_ROWS: usize = 2 * 4;

    /// AVX2 + FMA body of [`super::columns`], for the CPUs without AVX-512 (most laptops and
    /// many servers): tiles of 2 input rows × 4 weight rows, 8 lanes of `k` at a time, the last
    /// `k mod 8` products added after the lanes are summed.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `out` points to `m * n` floats and columns `[j0, j1)` are this
    /// call's alone.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn columns(
        x: &[f32],
        w: &[f32],
        m: usize,
        n: usize,
        k: usize,
        j0: usize,
        j1: usize,
        out: *mut f32,
    ) {
        // SAFETY: the caller's contract (bounds, CPU features, `out`) is `tile`'s.
        unsafe { tile_grid!(tile, ROWS, x, w, m, n, k, j0, j1, out) };
    }

    /// The sum of the 8 lanes of `v`.
    #[inline(always)]
    unsafe fn sum8(v: __m256) -> f32 {
        // SAFETY: register-only intrinsics; the caller has AVX2.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
            _mm_cvtss_f32(s)
        }
    }

    /// `R × C` dot products: rows `i..i+R` of `x` against rows `j..j+C` of `w`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const R: usize, const C: usize>(
        x: &[f32],
        w: &[f32],
        n: usize,
        k: usize,
        i: usize,
        j: usize,
        out: *mut f32,
    ) {
        // SAFETY (whole body): every pointer offset stays inside rows i..i+R of x and
        // j..j+C of w (length k each); the caller guarantees the bounds, AVX2 and FMA.
        unsafe {
            let xp = x.as_ptr().add(i * k);
            let wp = w.as_ptr().add(j * k);
            let mut acc = [[_mm256_setzero_ps(); C]; R];
            let full = k - k % 8;
            // The weight rows two column blocks ahead (contiguous after these), one cache line
            // per 16 lanes: fetched while this block's later row tiles compute from cache, so
            // that the memory stream never idles (SmolLM2 decoding at batch 8: 1.1× with the
            // next block, 1.15× two ahead). A prefetch does not fault, and `wrapping_add` keeps
            // an address past the weight's end defined.
            let next = wp.wrapping_add(PREFETCH_AHEAD_ROWS * k);
            let mut p = 0;
            while p < full {
                if p % 16 == 0 {
                    for c in 0..C {
                        _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(c * k + p).cast());
                    }
                }
                let mut wv = [_mm256_setzero_ps(); C];
                for (c, v) in wv.iter_mut().enumerate() {
                    *v = _mm256_loadu_ps(wp.add(c * k + p));
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let xv = _mm256_loadu_ps(xp.add(r * k + p));
                    for c in 0..C {
                        acc_r[c] = _mm256_fmadd_ps(xv, wv[c], acc_r[c]);
                    }
                }
                p += 8;
            }
            for (r, acc_r) in acc.iter().enumerate() {
                for (c, a) in acc_r.iter().enumerate() {
                    let mut s = sum8(*a);
                    for q in full..k {
                        s += *xp.add(r * k + q) * *wp.add(c * k + q);
                    }
                    *out.add((i + r) * n + j + c) = s;
                }
            }
        }
    }
}
