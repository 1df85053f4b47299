//! The encoder's forward-only `f32` CPU kernels: a matrix product against weights packed once at
//! load time (bias and exact GELU fused into its epilogue), LayerNorm fused with the residual
//! add, the attention softmax, and the exponential and `erf` they need.
//!
//! With AVX2 and FMA (checked once at run time) the kernels use 256-bit intrinsics; elsewhere the
//! same arithmetic runs as portable loops. Every kernel has a `simd: bool` argument so the tests
//! can run both paths on one machine.
//!
//! The product `C = A·B` reads `A` row-major in place (any row stride) and `B` from a
//! [`Packed`] copy: panels of [`NR`] = 16 columns, each panel's `k` rows contiguous (16 floats a
//! row, the last panel zero-padded). The micro-kernel keeps a 6 × 16 tile of `C` in twelve
//! registers, broadcasting one `A` value per row and loading two vectors of the panel per step of
//! `k`: the panel (24 KiB at `k = 384`) stays in L1 while up to [`MR`] rows of `A` stream past.
//! `k` is split into blocks of [`KC`], so a panel block always fits L1.
//!
//! `GELU(x) = x/2 · (1 + erf(x/√2))` uses the Abramowitz–Stegun 7.1.26 `erf` (absolute error
//! below 1.5e-7), as PyTorch's vectorised CPU `erf` does.

/// Columns of a packed panel (two AVX vectors).
pub const NR: usize = 16;
/// Rows of the micro-kernel's tile.
pub const MR: usize = 6;
/// Depth of one block of `k`.
const KC: usize = 384;
/// Rows of `A` per block (96 × 384 floats, 144 KiB, stay in L2 while every panel passes).
const MC: usize = 96;

/// Whether the AVX2 + FMA kernels can run here (checked once).
pub fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// A `k × n` right-hand matrix in panels of [`NR`] columns (see the module docs), with an
/// optional bias of `n` values (zero-padded like the panels).
#[derive(Debug, Clone)]
pub struct Packed {
    /// Rows (the product's depth).
    pub k: usize,
    /// Columns.
    pub n: usize,
    data: Vec<f32>,
    bias: Option<Vec<f32>>,
}

impl Packed {
    /// Packs `B = Wᵀ` for a weight `w: [n, k]` (row-major, Hugging Face's `(out, in)` layout),
    /// scaling weight and bias by `scale` on the way (1.0: unchanged).
    pub fn from_weight(w: &[f32], n: usize, k: usize, bias: Option<&[f32]>, scale: f32) -> Self {
        assert_eq!(
            w.len(),
            n * k,
            "weight of {} values for [{n}, {k}]",
            w.len()
        );
        Self::build(k, n, |p, j| w[j * k + p] * scale, bias, scale)
    }

    /// Packs a row-major `b: [k, n]` with row stride `ld`.
    pub fn from_rows(b: &[f32], k: usize, n: usize, ld: usize) -> Self {
        Self::build(k, n, |p, j| b[p * ld + j], None, 1.0)
    }

    fn build(
        k: usize,
        n: usize,
        at: impl Fn(usize, usize) -> f32,
        bias: Option<&[f32]>,
        scale: f32,
    ) -> Self {
        let panels = n.div_ceil(NR);
        let mut data = vec![0f32; panels * k * NR];
        for (jp, panel) in data.chunks_exact_mut(k * NR).enumerate() {
            for (p, row) in panel.chunks_exact_mut(NR).enumerate() {
                for (c, v) in row.iter_mut().enumerate() {
                    let j = jp * NR + c;
                    if j < n {
                        *v = at(p, j);
                    }
                }
            }
        }
        let bias = bias.map(|b| {
            assert_eq!(b.len(), n, "bias of {} values for {n} columns", b.len());
            let mut padded = vec![0f32; panels * NR];
            for (d, &s) in padded.iter_mut().zip(b) {
                *d = s * scale;
            }
            padded
        });
        Packed { k, n, data, bias }
    }

    /// Repacks in place for a new `b: [k, n]` with row stride `ld` (the attention's keys and
    /// values, which change every call), reusing the allocation.
    pub fn repack_rows(&mut self, b: &[f32], k: usize, n: usize, ld: usize) {
        let panels = n.div_ceil(NR);
        self.k = k;
        self.n = n;
        self.bias = None;
        self.data.clear();
        self.data.resize(panels * k * NR, 0.0);
        for (jp, panel) in self.data.chunks_exact_mut(k * NR).enumerate() {
            let j0 = jp * NR;
            let w = (n - j0).min(NR);
            for (p, row) in panel.chunks_exact_mut(NR).enumerate() {
                row[..w].copy_from_slice(&b[p * ld + j0..p * ld + j0 + w]);
            }
        }
    }

    /// Packs the transpose of a row-major `x: [n, k]` with row stride `ld` (so `B = xᵀ`, as the
    /// attention's keys are used), reusing the allocation.
    pub fn repack_transposed(&mut self, x: &[f32], n: usize, k: usize, ld: usize) {
        let panels = n.div_ceil(NR);
        self.k = k;
        self.n = n;
        self.bias = None;
        self.data.clear();
        self.data.resize(panels * k * NR, 0.0);
        for (jp, panel) in self.data.chunks_exact_mut(k * NR).enumerate() {
            for c in 0..(n - jp * NR).min(NR) {
                let src = &x[(jp * NR + c) * ld..(jp * NR + c) * ld + k];
                for (p, &v) in src.iter().enumerate() {
                    panel[p * NR + c] = v;
                }
            }
        }
    }

    /// An empty packing, for [`Self::repack_rows`] and [`Self::repack_transposed`].
    pub fn empty() -> Self {
        Packed {
            k: 0,
            n: 0,
            data: Vec::new(),
            bias: None,
        }
    }

    fn panel(&self, jp: usize) -> &[f32] {
        &self.data[jp * self.k * NR..(jp + 1) * self.k * NR]
    }
}

/// What the product does after the last block of `k`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Epilogue {
    /// `C = A·B (+ bias)`.
    None,
    /// `C = GELU(A·B (+ bias))`.
    Gelu,
}

/// `C = A·B (+ bias)`, then the epilogue, for `A: [m, b.k]` (row stride `lda`) and
/// `C: [m, b.n]` (row stride `ldc`); single-threaded.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    a: &[f32],
    lda: usize,
    m: usize,
    b: &Packed,
    c: &mut [f32],
    ldc: usize,
    epilogue: Epilogue,
    simd: bool,
) {
    let (k, n) = (b.k, b.n);
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        lda >= k && ldc >= n,
        "strides {lda}, {ldc} for k {k}, n {n}"
    );
    assert!(a.len() >= (m - 1) * lda + k, "A too short");
    assert!(c.len() >= (m - 1) * ldc + n, "C too short");
    if k == 0 {
        for i in 0..m {
            for j in 0..n {
                let v = b.bias.as_ref().map_or(0.0, |bias| bias[j]);
                c[i * ldc + j] = if epilogue == Epilogue::Gelu {
                    gelu(v)
                } else {
                    v
                };
            }
        }
        return;
    }
    let simd = simd && has_avx2();
    let zeros = [0f32; NR];
    for i0 in (0..m).step_by(MC) {
        let i1 = (i0 + MC).min(m);
        for k0 in (0..k).step_by(KC) {
            let kc = KC.min(k - k0);
            let first = k0 == 0;
            let last = k0 + kc == k;
            for jp in 0..n.div_ceil(NR) {
                let j0 = jp * NR;
                let panel = &b.panel(jp)[k0 * NR..(k0 + kc) * NR];
                let bias: &[f32] = match (&b.bias, first) {
                    (Some(bias), true) => &bias[j0..j0 + NR],
                    _ => &zeros,
                };
                let tile = Tile {
                    kc,
                    panel,
                    bias,
                    accumulate: !first,
                    gelu: last && epilogue == Epilogue::Gelu,
                    cols: (n - j0).min(NR),
                };
                let mut i = i0;
                while i < i1 {
                    let rows = (i1 - i).min(MR);
                    tile.run(
                        rows,
                        &a[i * lda + k0..],
                        lda,
                        &mut c[i * ldc + j0..],
                        ldc,
                        simd,
                    );
                    i += rows;
                }
            }
        }
    }
}

/// One block of `k` against one panel.
struct Tile<'a> {
    kc: usize,
    panel: &'a [f32],
    /// [`NR`] values added at the start (zeros when accumulating).
    bias: &'a [f32],
    /// Add to `C`'s current values instead of overwriting them.
    accumulate: bool,
    gelu: bool,
    /// Columns of `C` written (`<= NR`).
    cols: usize,
}

impl Tile<'_> {
    /// `rows <= MR` rows: `a` starts at the first row's first value of this block, `c` at the
    /// first row's first column of this panel.
    fn run(&self, rows: usize, a: &[f32], lda: usize, c: &mut [f32], ldc: usize, simd: bool) {
        debug_assert!(a.len() >= (rows - 1) * lda + self.kc);
        debug_assert!(c.len() >= (rows - 1) * ldc + self.cols);
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: AVX2 and FMA are present (`simd` implies `has_avx2`); the slices cover
            // every row and column the kernel reads and writes (asserted by `matmul`).
            unsafe {
                match rows {
                    6 => avx2::tile::<6>(self, a, lda, c, ldc),
                    5 => avx2::tile::<5>(self, a, lda, c, ldc),
                    4 => avx2::tile::<4>(self, a, lda, c, ldc),
                    3 => avx2::tile::<3>(self, a, lda, c, ldc),
                    2 => avx2::tile::<2>(self, a, lda, c, ldc),
                    _ => avx2::tile::<1>(self, a, lda, c, ldc),
                }
            }
            return;
        }
        let _ = simd;
        for r in 0..rows {
            let mut acc = [0f32; NR];
            acc.copy_from_slice(self.bias);
            let ar = &a[r * lda..r * lda + self.kc];
            for (p, &av) in ar.iter().enumerate() {
                let br = &self.panel[p * NR..(p + 1) * NR];
                for (x, &bv) in acc.iter_mut().zip(br) {
                    *x += av * bv;
                }
            }
            let cr = &mut c[r * ldc..r * ldc + self.cols];
            for (dst, &v) in cr.iter_mut().zip(&acc) {
                let v = if self.accumulate { *dst + v } else { v };
                *dst = if self.gelu { gelu(v) } else { v };
            }
        }
    }
}

/// Constants of the Abramowitz–Stegun 7.1.26 `erf`.
const ERF_P: f32 = 0.327_591_1;
const ERF_A: [f32; 5] = [
    0.254_829_6,
    -0.284_496_74,
    1.421_413_8,
    -1.453_152,
    1.061_405_4,
];

/// `erf(x)` by Abramowitz–Stegun 7.1.26 (absolute error below 1.5e-7).
pub fn erf(x: f32) -> f32 {
    let ax = x.abs();
    let t = 1.0 / (ERF_P * ax + 1.0);
    let poly = (((ERF_A[4] * t + ERF_A[3]) * t + ERF_A[2]) * t + ERF_A[1]) * t + ERF_A[0];
    let r = 1.0 - poly * t * exp(-ax * ax);
    r.copysign(x)
}

/// Exact (erf-based) GELU.
pub fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// Constants of the Cephes `expf`: `exp(x) = 2^n · exp(r)`, `r = x − n·ln 2` in two parts, and
/// a degree-5 polynomial for `(exp(r) − 1 − r) / r²`.
const EXP_HI: f32 = 88.376_26;
const EXP_LO: f32 = -87.336_55;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// `exp(x)` to about 1 ulp (the Cephes polynomial the AVX2 kernels vectorise); 0 below
/// `-87.3`, where `f32` underflows to subnormals.
pub fn exp(x: f32) -> f32 {
    if x < EXP_LO {
        return 0.0;
    }
    let x = x.min(EXP_HI);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut y = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        y = y * r + c;
    }
    let y = (y * (r * r) + r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `x[r] = LayerNorm(x[r] + t[r]) · gamma + beta` for each row `r` of width `gamma.len()`
/// (two-pass mean and variance).
pub fn add_layer_norm(x: &mut [f32], t: &[f32], gamma: &[f32], beta: &[f32], eps: f32, simd: bool) {
    let h = gamma.len();
    assert!(h > 0 && beta.len() == h && x.len() == t.len() && x.len().is_multiple_of(h));
    #[cfg(target_arch = "x86_64")]
    if simd && has_avx2() {
        for (xr, tr) in x.chunks_exact_mut(h).zip(t.chunks_exact(h)) {
            // SAFETY: AVX2 and FMA are present; every slice has `h` values.
            unsafe { avx2::add_layer_norm_row(xr, tr, gamma, beta, eps) };
        }
        return;
    }
    let _ = simd;
    for (xr, tr) in x.chunks_exact_mut(h).zip(t.chunks_exact(h)) {
        for (v, &d) in xr.iter_mut().zip(tr) {
            *v += d;
        }
        let mean = xr.iter().sum::<f32>() / h as f32;
        let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / h as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for ((v, &g), &b) in xr.iter_mut().zip(gamma).zip(beta) {
            *v = (*v - mean) * inv * g + b;
        }
    }
}

/// Softmax of `row` in place.
pub fn softmax(row: &mut [f32], simd: bool) {
    if row.is_empty() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if simd && has_avx2() {
        // SAFETY: AVX2 and FMA are present.
        unsafe { avx2::softmax(row) };
        return;
    }
    let _ = simd;
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0.0;
    for v in row.iter_mut() {
        *v = exp(*v - m);
        s += *v;
    }
    let inv = 1.0 / s;
    for v in row.iter_mut() {
        *v *= inv;
    }
}

/// [`exp`] of each value (for the tests of the vectorised form).
#[cfg(test)]
pub fn exp_slice(x: &mut [f32], simd: bool) {
    #[cfg(target_arch = "x86_64")]
    if simd && has_avx2() {
        // SAFETY: AVX2 and FMA are present.
        unsafe { avx2::exp_slice(x) };
        return;
    }
    let _ = simd;
    for v in x {
        *v = exp(*v);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{ERF_A, ERF_P, EXP_HI, EXP_LO, EXP_POLY, LN2_HI, LN2_LO, NR, Tile};

    /// `exp` of 8 lanes (the Cephes polynomial of [`super::exp`]).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(unused_unsafe)] // register intrinsics need `unsafe` before Rust 1.87
    unsafe fn exp8(x: __m256) -> __m256 {
        // SAFETY (whole body): register arithmetic only; the caller has AVX2 and FMA.
        unsafe {
            let under = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_LO));
            let x = _mm256_min_ps(
                _mm256_max_ps(x, _mm256_set1_ps(EXP_LO)),
                _mm256_set1_ps(EXP_HI),
            );
            let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            );
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
            let mut y = _mm256_set1_ps(EXP_POLY[0]);
            for &c in &EXP_POLY[1..] {
                y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
            }
            let y = _mm256_add_ps(
                _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r),
                _mm256_set1_ps(1.0),
            );
            let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvtps_epi32(n),
                _mm256_set1_epi32(127),
            )));
            _mm256_andnot_ps(under, _mm256_mul_ps(y, pow2))
        }
    }

    /// Exact GELU of 8 lanes ([`super::gelu`]).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn gelu8(x: __m256) -> __m256 {
        // SAFETY (whole body): register arithmetic only; the caller has AVX2 and FMA.
        unsafe {
            let sign_mask = _mm256_set1_ps(-0.0);
            let z = _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::FRAC_1_SQRT_2));
            let az = _mm256_andnot_ps(sign_mask, z);
            let one = _mm256_set1_ps(1.0);
            let t = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(ERF_P), az, one));
            let mut poly = _mm256_set1_ps(ERF_A[4]);
            for &c in ERF_A[..4].iter().rev() {
                poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(c));
            }
            let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(az, az)));
            let r = _mm256_sub_ps(one, _mm256_mul_ps(_mm256_mul_ps(poly, t), e));
            let erf = _mm256_or_ps(r, _mm256_and_ps(sign_mask, z));
            _mm256_mul_ps(
                _mm256_mul_ps(_mm256_set1_ps(0.5), x),
                _mm256_add_ps(one, erf),
            )
        }
    }

    /// The micro-kernel: `R` rows × [`NR`] columns (see [`super::Tile::run`]).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile<const R: usize>(
        t: &Tile<'_>,
        a: &[f32],
        lda: usize,
        c: &mut [f32],
        ldc: usize,
    ) {
        // SAFETY (whole body): reads stay within rows 0..R of `a` (kc values each) and the
        // panel (kc × NR); writes within rows 0..R of `c` (`cols` values each): the caller
        // checked the lengths. AVX2 and FMA are enabled on this function.
        unsafe {
            let ap = a.as_ptr();
            let bp = t.panel.as_ptr();
            let b0 = _mm256_loadu_ps(t.bias.as_ptr());
            let b1 = _mm256_loadu_ps(t.bias.as_ptr().add(8));
            let mut acc0 = [b0; R];
            let mut acc1 = [b1; R];
            for p in 0..t.kc {
                let w0 = _mm256_loadu_ps(bp.add(p * NR));
                let w1 = _mm256_loadu_ps(bp.add(p * NR + 8));
                for r in 0..R {
                    let av = _mm256_broadcast_ss(&*ap.add(r * lda + p));
                    acc0[r] = _mm256_fmadd_ps(av, w0, acc0[r]);
                    acc1[r] = _mm256_fmadd_ps(av, w1, acc1[r]);
                }
            }
            let cp = c.as_mut_ptr();
            for r in 0..R {
                let mut v0 = acc0[r];
                let mut v1 = acc1[r];
                let dst = cp.add(r * ldc);
                if t.cols == NR {
                    if t.accumulate {
                        v0 = _mm256_add_ps(_mm256_loadu_ps(dst), v0);
                        v1 = _mm256_add_ps(_mm256_loadu_ps(dst.add(8)), v1);
                    }
                    if t.gelu {
                        v0 = gelu8(v0);
                        v1 = gelu8(v1);
                    }
                    _mm256_storeu_ps(dst, v0);
                    _mm256_storeu_ps(dst.add(8), v1);
                } else {
                    let mut buf = [0f32; NR];
                    _mm256_storeu_ps(buf.as_mut_ptr(), v0);
                    _mm256_storeu_ps(buf.as_mut_ptr().add(8), v1);
                    for (j, &v) in buf.iter().enumerate().take(t.cols) {
                        let v = if t.accumulate { *dst.add(j) + v } else { v };
                        *dst.add(j) = if t.gelu { super::gelu(v) } else { v };
                    }
                }
            }
        }
    }

    /// Horizontal sum of 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(unused_unsafe)] // register intrinsics need `unsafe` before Rust 1.87
    unsafe fn hsum(v: __m256) -> f32 {
        // SAFETY: register arithmetic only.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
            _mm_cvtss_f32(s)
        }
    }

    /// Horizontal max of 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(unused_unsafe)] // register intrinsics need `unsafe` before Rust 1.87
    unsafe fn hmax(v: __m256) -> f32 {
        // SAFETY: register arithmetic only.
        unsafe {
            let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_max_ss(s, _mm_shuffle_ps::<1>(s, s));
            _mm_cvtss_f32(s)
        }
    }

    /// One row of [`super::add_layer_norm`].
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn add_layer_norm_row(
        x: &mut [f32],
        t: &[f32],
        gamma: &[f32],
        beta: &[f32],
        eps: f32,
    ) {
        let h = x.len();
        let body = h / 8 * 8;
        // SAFETY (whole body): vector accesses cover [0, body) of slices of length h.
        unsafe {
            let (xp, tp) = (x.as_mut_ptr(), t.as_ptr());
            let mut s = _mm256_setzero_ps();
            let mut j = 0;
            while j < body {
                let v = _mm256_add_ps(_mm256_loadu_ps(xp.add(j)), _mm256_loadu_ps(tp.add(j)));
                _mm256_storeu_ps(xp.add(j), v);
                s = _mm256_add_ps(s, v);
                j += 8;
            }
            let mut sum = hsum(s);
            for j in body..h {
                x[j] += t[j];
                sum += x[j];
            }
            let mean = sum / h as f32;
            let mv = _mm256_set1_ps(mean);
            let mut q = _mm256_setzero_ps();
            let xp = x.as_mut_ptr();
            let mut j = 0;
            while j < body {
                let d = _mm256_sub_ps(_mm256_loadu_ps(xp.add(j)), mv);
                q = _mm256_fmadd_ps(d, d, q);
                j += 8;
            }
            let mut sq = hsum(q);
            for &v in &x[body..h] {
                sq += (v - mean) * (v - mean);
            }
            let inv = 1.0 / (sq / h as f32 + eps).sqrt();
            let iv = _mm256_set1_ps(inv);
            let (gp, bp) = (gamma.as_ptr(), beta.as_ptr());
            let mut j = 0;
            while j < body {
                let d = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(xp.add(j)), mv), iv);
                let y = _mm256_fmadd_ps(d, _mm256_loadu_ps(gp.add(j)), _mm256_loadu_ps(bp.add(j)));
                _mm256_storeu_ps(xp.add(j), y);
                j += 8;
            }
            for j in body..h {
                x[j] = (x[j] - mean) * inv * gamma[j] + beta[j];
            }
        }
    }

    /// [`super::softmax`] of one row.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn softmax(row: &mut [f32]) {
        let n = row.len();
        let body = n / 8 * 8;
        // SAFETY (whole body): vector accesses cover [0, body) of a slice of length n.
        unsafe {
            let p = row.as_mut_ptr();
            let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
            let mut j = 0;
            while j < body {
                mv = _mm256_max_ps(mv, _mm256_loadu_ps(p.add(j)));
                j += 8;
            }
            let mut m = hmax(mv);
            for &v in &row[body..] {
                m = m.max(v);
            }
            let mb = _mm256_set1_ps(m);
            let mut sv = _mm256_setzero_ps();
            let mut j = 0;
            while j < body {
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(j)), mb));
                _mm256_storeu_ps(p.add(j), e);
                sv = _mm256_add_ps(sv, e);
                j += 8;
            }
            let mut s = hsum(sv);
            for v in &mut row[body..] {
                *v = super::exp(*v - m);
                s += *v;
            }
            let inv = 1.0 / s;
            let iv = _mm256_set1_ps(inv);
            let p = row.as_mut_ptr();
            let mut j = 0;
            while j < body {
                _mm256_storeu_ps(p.add(j), _mm256_mul_ps(_mm256_loadu_ps(p.add(j)), iv));
                j += 8;
            }
            for v in &mut row[body..] {
                *v *= inv;
            }
        }
    }

    /// [`super::exp`] of each value.
    #[cfg(test)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_slice(x: &mut [f32]) {
        let body = x.len() / 8 * 8;
        // SAFETY: vector accesses cover [0, body).
        unsafe {
            let p = x.as_mut_ptr();
            let mut j = 0;
            while j < body {
                _mm256_storeu_ps(p.add(j), exp8(_mm256_loadu_ps(p.add(j))));
                j += 8;
            }
        }
        for v in &mut x[body..] {
            *v = super::exp(*v);
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;
    use crate::world::rng::SplitMix64;

    fn random(n: usize, spread: f32, rng: &mut SplitMix64) -> Vec<f32> {
        (0..n)
            .map(|_| spread * (2.0 * rng.unit() as f32 - 1.0))
            .collect()
    }

    fn modes() -> Vec<bool> {
        if has_avx2() {
            vec![false, true]
        } else {
            vec![false]
        }
    }

    /// `C = A·Wᵀ + b` (then GELU) against a naive `f64` product, with strides, partial panels,
    /// partial row tiles, several row blocks and several blocks of `k`.
    #[test]
    fn dense_kernel_matmul_matches_naive_product() {
        let mut rng = SplitMix64::new(7);
        for (m, k, n) in [
            (13, 400, 37),
            (1, 5, 16),
            (200, 40, 33),
            (7, 800, 48),
            (6, 16, 3),
        ] {
            let (lda, ldc) = (k + 3, n + 5);
            let a = random(m * lda, 1.0, &mut rng);
            let w = random(n * k, 1.0, &mut rng);
            let bias = random(n, 1.0, &mut rng);
            for with_bias in [false, true] {
                let packed = Packed::from_weight(&w, n, k, with_bias.then_some(&bias[..]), 1.0);
                for epilogue in [Epilogue::None, Epilogue::Gelu] {
                    for simd in modes() {
                        let mut c = vec![f32::NAN; m * ldc];
                        matmul(&a, lda, m, &packed, &mut c, ldc, epilogue, simd);
                        for i in 0..m {
                            for j in 0..n {
                                let mut want: f64 = if with_bias { bias[j] as f64 } else { 0.0 };
                                for p in 0..k {
                                    want += a[i * lda + p] as f64 * w[j * k + p] as f64;
                                }
                                let want = match epilogue {
                                    Epilogue::None => want,
                                    Epilogue::Gelu => gelu_f64(want),
                                };
                                let got = c[i * ldc + j] as f64;
                                assert!(
                                    (got - want).abs()
                                        < 1e-5 * (k as f64).sqrt() * want.abs().max(1.0),
                                    "({m},{k},{n}) [{i},{j}] {epilogue:?} simd {simd}: {got} vs {want}"
                                );
                            }
                            // Columns past n are untouched.
                            assert!(c[i * ldc + n..(i + 1) * ldc].iter().all(|v| v.is_nan()));
                        }
                    }
                }
            }
        }
    }

    /// The attention's packings: `Kᵀ` from rows and `V` from rows, against `from_weight`.
    #[test]
    fn dense_kernel_repacks_match_weight_packing() {
        let mut rng = SplitMix64::new(8);
        let (s, hd, ld) = (21, 11, 40);
        let x = random(s * ld, 1.0, &mut rng);
        let rows: Vec<f32> = (0..s)
            .flat_map(|r| x[r * ld..r * ld + hd].to_vec())
            .collect();
        let mut keys = Packed::empty();
        keys.repack_transposed(&x, s, hd, ld);
        // B = xᵀ (hd × s) is the weight x (s × hd) packed.
        assert_eq!(keys.data, Packed::from_weight(&rows, s, hd, None, 1.0).data);
        let mut values = Packed::empty();
        values.repack_rows(&x, s, hd, ld);
        let t: Vec<f32> = (0..hd)
            .flat_map(|j| (0..s).map(move |p| (p, j)))
            .map(|(p, j)| rows[p * hd + j])
            .collect();
        assert_eq!(values.data, Packed::from_weight(&t, hd, s, None, 1.0).data);
        assert_eq!(values.data, Packed::from_rows(&x, s, hd, ld).data);
    }

    fn erf_f64(x: f64) -> f64 {
        // erf by its Taylor series (|x| < 3) or continued fraction of erfc, to ~1e-12.
        if x.abs() < 3.0 {
            let mut term = x;
            let mut sum = x;
            for n in 1..200 {
                term *= -x * x / n as f64;
                sum += term / (2 * n + 1) as f64;
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        } else {
            let z = x.abs();
            let mut f = z;
            for n in (1..100).rev() {
                f = z + (n as f64 / 2.0) / f;
            }
            let erfc = (-z * z).exp() / (f * std::f64::consts::PI.sqrt());
            (1.0 - erfc).copysign(x)
        }
    }

    fn gelu_f64(x: f64) -> f64 {
        0.5 * x * (1.0 + erf_f64(x / std::f64::consts::SQRT_2))
    }

    /// GELU (portable, and the AVX2 epilogue through an identity product) against the exact
    /// erf form and candle's `gelu_erf`.
    #[test]
    fn dense_kernel_gelu_matches_exact_erf() {
        let xs: Vec<f32> = (-4000..=4000).map(|i| i as f32 * 0.0025).collect();
        let candle = Tensor::new(&xs[..], &Device::Cpu)
            .unwrap()
            .gelu_erf()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let mut eye = vec![0f32; NR * NR];
        for j in 0..NR {
            eye[j * NR + j] = 1.0;
        }
        let eye = Packed::from_weight(&eye, NR, NR, None, 1.0);
        let mut vectorised = vec![0f32; xs.len()];
        for simd in modes() {
            matmul(
                &xs,
                NR,
                xs.len() / NR,
                &eye,
                &mut vectorised,
                NR,
                Epilogue::Gelu,
                simd,
            );
            for (i, &x) in xs.iter().enumerate().take(xs.len() / NR * NR) {
                let want = gelu_f64(x as f64);
                for got in [gelu(x), vectorised[i]] {
                    let tol = 2e-7 * (x.abs() as f64).max(1.0);
                    assert!(
                        (got as f64 - want).abs() < tol,
                        "gelu({x}) = {got}, want {want}"
                    );
                    assert!((got - candle[i]).abs() < 4e-7 * x.abs().max(1.0));
                }
            }
        }
        for &x in &[-0.7f32, 0.0, 0.3, 2.5] {
            assert!(
                (erf(x) as f64 - erf_f64(x as f64)).abs() < 3e-7,
                "erf({x}) = {} vs {}",
                erf(x),
                erf_f64(x as f64)
            );
        }
    }

    #[test]
    fn dense_kernel_exp_is_accurate() {
        let xs: Vec<f32> = (-8800..=8800).map(|i| i as f32 * 0.01 + 0.003).collect();
        for simd in modes() {
            let mut y = xs.clone();
            exp_slice(&mut y, simd);
            for (&x, &got) in xs.iter().zip(&y) {
                if x < -87.3 {
                    assert!(got < 1e-37, "exp({x}) = {got}");
                    continue;
                }
                let want = (x as f64).exp();
                assert!(
                    ((got as f64 - want) / want).abs() < 3e-7,
                    "exp({x}) = {got}, want {want} (simd {simd})"
                );
            }
        }
        assert_eq!(exp(-1000.0), 0.0);
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn dense_kernel_softmax_matches_candle() {
        let mut rng = SplitMix64::new(9);
        for n in [1, 3, 8, 17, 40, 255] {
            let x = random(n, 20.0, &mut rng);
            let want =
                candle_nn::ops::softmax_last_dim(&Tensor::new(&x[..], &Device::Cpu).unwrap())
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
            for simd in modes() {
                let mut got = x.clone();
                softmax(&mut got, simd);
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        (g - w).abs() < 1e-6 * w.max(1e-3) * 10.0 + 1e-9,
                        "n {n}: {g} vs {w}"
                    );
                }
                assert!((got.iter().sum::<f32>() - 1.0).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn dense_kernel_add_layer_norm_matches_candle() {
        let mut rng = SplitMix64::new(10);
        for h in [44, 384, 5] {
            let rows = 9;
            let x = random(rows * h, 3.0, &mut rng)
                .iter()
                .map(|v| v + 1.5)
                .collect::<Vec<_>>();
            let t = random(rows * h, 2.0, &mut rng);
            let gamma = random(h, 1.0, &mut rng);
            let beta = random(h, 1.0, &mut rng);
            let sum: Vec<f32> = x.iter().zip(&t).map(|(a, b)| a + b).collect();
            let dev = Device::Cpu;
            let want = candle_nn::ops::layer_norm(
                &Tensor::from_vec(sum, (rows, h), &dev).unwrap(),
                &Tensor::new(&gamma[..], &dev).unwrap(),
                &Tensor::new(&beta[..], &dev).unwrap(),
                1e-12,
            )
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
            for simd in modes() {
                let mut got = x.clone();
                add_layer_norm(&mut got, &t, &gamma, &beta, 1e-12, simd);
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - w).abs() < 5e-6, "h {h} simd {simd}: {g} vs {w}");
                }
            }
        }
    }
}
