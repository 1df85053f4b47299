//! Row kernels built on `exp`, vectorised for the CPU's instruction set.
//!
//! The attention tiles' softmax rows, the log-softmax statistics of a row of logits, its
//! gradient, and the SwiGLU gate are one `exp` per element; with the C library's `expf` (a call per element) that call is most of the
//! kernel. For `f32` these kernels use [`exp_f32`], a branch-free polynomial the compiler
//! vectorises, in loops compiled for AVX-512 or AVX2 + FMA when the CPU has them (chosen at run
//! time by [`kernel_isa`], capped by `TURNWISE_KERNEL_ISA`), and for the baseline otherwise
//! (SSE2 on x86-64, NEON on aarch64). Sums run in 16 lanes of partial sums. `f64` keeps the
//! scalar library `exp` and sums in order, so the `f64` kernels stay the exact reference the
//! tests compare against.
//!
//! Each kernel is tested against the scalar formula on every instruction set the CPU running
//! the tests has (`tests` below).

use super::Real;
use super::infer::{KernelIsa, kernel_isa};

/// `exp(x)` for one `f32`, in operations the compiler vectorises (no call, no branch): Cephes'
/// `expf` (`x = n ln 2 + r`, a degree-7 polynomial for `e^r`, `2^n` built from its bits), within
/// 2 ulp of `f32::exp` for `x` in [−87, 88]; 0 below −87 (where `2^n` would be subnormal: the
/// value is below 1.7e-38, nothing next to a row's maximum, `e^0 = 1`); `e^88` above 88.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    const CUT: f32 = -87.0;
    // 1.5 · 2²³: adding and subtracting it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(CUT, 88.0);
    let t = xc * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = xc - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let p = ((((1.987_569_2e-4 * r + 1.398_2e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 0.166_666_65)
        * r
        + 0.5;
    let e = (p * r * r + r) + 1.0;
    // t's low mantissa bits hold n (|n| < 2²²): 2ⁿ's exponent field is n + 127.
    let ni = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let pow2 = f32::from_bits((ni.wrapping_add(127) as u32) << 23);
    if x < CUT { 0.0 } else { e * pow2 }
}

/// Defines `$name(isa, ..)`, which runs the `#[inline(always)]` function `$body` compiled for
/// AVX-512 or AVX2 + FMA as `isa` says (capped by what the CPU has), else for the baseline.
macro_rules! isa_kernel {
    ($(#[$m:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? => $body:ident) => {
        $(#[$m])*
        fn $name(isa: KernelIsa, $($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                match isa.min(KernelIsa::detected()) {
                    // SAFETY: the CPU has the features (`detected` checked them).
                    KernelIsa::Avx512 => return unsafe { avx512($($arg),*) },
                    // SAFETY: as above.
                    KernelIsa::Avx2 => return unsafe { avx2($($arg),*) },
                    KernelIsa::Portable => {}
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = isa;
            $body($($arg),*)
        }
    };
}
pub(super) use isa_kernel;

/// The float types with these kernels: `f32` vectorised, `f64` the scalar reference.
pub(crate) trait ExpKernels: Real {
    /// `row[j] = exp(row[j] − shift)`, exactly 0 where that underflows (masked keys, −∞,
    /// included); returns the row's sum. (The attention tiles' exponentials.)
    fn exp_row(row: &mut [Self], shift: Self) -> Self;

    /// `(Σ e^{z−m}, Σ e^{z−m}·(z−m))` over a row `z` with `m ≥ max z`.
    fn exp_sums(z: &[Self], m: Self) -> (Self, Self);

    /// The gradient of `gl·log p_t + ge·H` with respect to a row of logits, times `scale`,
    /// without the target's `gl` term (the caller adds it): `dst_j = (−gl·p_j − ge·p_j·(lp_j +
    /// h))·scale` with `lp_j = z_j − lse`, `p_j = e^{lp_j}`. Written into `dst` from `z`.
    #[allow(clippy::too_many_arguments)]
    fn logprob_grad(
        dst: &mut [Self],
        z: &[Self],
        lse: Self,
        gl: Self,
        ge: Self,
        h: Self,
        scale: Self,
    );

    /// [`ExpKernels::logprob_grad`] in place: `z` becomes the gradient.
    fn logprob_grad_in_place(z: &mut [Self], lse: Self, gl: Self, ge: Self, h: Self, scale: Self);

    /// The SwiGLU gate `y = silu(g)·u`, `silu(g) = g / (1 + e^{−g})`.
    fn swiglu(y: &mut [Self], g: &[Self], u: &[Self]);

    /// Its gradients: `dg = (dy·u)·(σ(g)(1 − silu(g)) + silu(g))`, `du = dy·silu(g)`, with
    /// `σ(g) = 1 / (e^{−g} + 1)`.
    fn swiglu_grad(dg: &mut [Self], du: &mut [Self], g: &[Self], u: &[Self], dy: &[Self]);
}

/// One element of [`ExpKernels::logprob_grad`], given the element's `exp`.
#[inline(always)]
fn grad_of<T: Real>(lp: T, p: T, gl: T, ge: T, h: T, scale: T) -> T {
    (-(gl * p) - ge * p * (lp + h)) * scale
}

/// One element of [`ExpKernels::swiglu_grad`] given `e = e^{−g}`: `(dg, du)`.
#[inline(always)]
fn swiglu_grad_of<T: Real>(g: T, u: T, dy: T, e: T) -> (T, T) {
    let s = T::ONE / (e + T::ONE);
    let silu = g / (T::ONE + e);
    ((dy * u) * (s * (T::ONE - silu) + silu), dy * silu)
}

impl ExpKernels for f64 {
    fn exp_row(row: &mut [f64], shift: f64) -> f64 {
        let mut sum = 0.0;
        for x in row {
            let e = *x - shift;
            // Below the underflow point exp is exactly 0: skip the call (masked keys).
            *x = if e < f64::EXP_UNDERFLOW { 0.0 } else { e.exp() };
            sum += *x;
        }
        sum
    }

    fn exp_sums(z: &[f64], m: f64) -> (f64, f64) {
        let (mut se, mut sez) = (0.0, 0.0);
        for &x in z {
            let d = x - m;
            let e = d.exp();
            se += e;
            sez += e * d;
        }
        (se, sez)
    }

    fn logprob_grad(dst: &mut [f64], z: &[f64], lse: f64, gl: f64, ge: f64, h: f64, scale: f64) {
        for (d, &x) in dst.iter_mut().zip(z) {
            let lp = x - lse;
            *d = grad_of(lp, lp.exp(), gl, ge, h, scale);
        }
    }

    fn logprob_grad_in_place(z: &mut [f64], lse: f64, gl: f64, ge: f64, h: f64, scale: f64) {
        for x in z {
            let lp = *x - lse;
            *x = grad_of(lp, lp.exp(), gl, ge, h, scale);
        }
    }

    fn swiglu(y: &mut [f64], g: &[f64], u: &[f64]) {
        for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
            *y = g / (1.0 + (-g).exp()) * u;
        }
    }

    fn swiglu_grad(dg: &mut [f64], du: &mut [f64], g: &[f64], u: &[f64], dy: &[f64]) {
        for j in 0..dg.len() {
            (dg[j], du[j]) = swiglu_grad_of(g[j], u[j], dy[j], (-g[j]).exp());
        }
    }
}

/// [`ExpKernels::exp_row`] for `f32`: 16 lanes of partial sums so that the loop vectorises.
#[inline(always)]
fn exp_row_body(row: &mut [f32], shift: f32) -> f32 {
    let mut acc = [0f32; 16];
    let mut chunks = row.chunks_exact_mut(16);
    for c in &mut chunks {
        for (a, x) in acc.iter_mut().zip(c.iter_mut()) {
            *x = exp_f32(*x - shift);
            *a += *x;
        }
    }
    let mut sum = 0f32;
    for x in chunks.into_remainder() {
        *x = exp_f32(*x - shift);
        sum += *x;
    }
    acc.iter().sum::<f32>() + sum
}

#[inline(always)]
fn exp_sums_body(z: &[f32], m: f32) -> (f32, f32) {
    let (mut se, mut sez) = ([0f32; 16], [0f32; 16]);
    let mut chunks = z.chunks_exact(16);
    for c in &mut chunks {
        for i in 0..16 {
            let d = c[i] - m;
            let e = exp_f32(d);
            se[i] += e;
            sez[i] += e * d;
        }
    }
    let (mut a, mut b) = (0f32, 0f32);
    for &x in chunks.remainder() {
        let d = x - m;
        let e = exp_f32(d);
        a += e;
        b += e * d;
    }
    (se.iter().sum::<f32>() + a, sez.iter().sum::<f32>() + b)
}

#[inline(always)]
fn logprob_grad_body(dst: &mut [f32], z: &[f32], lse: f32, gl: f32, ge: f32, h: f32, scale: f32) {
    for (d, &x) in dst.iter_mut().zip(z) {
        let lp = x - lse;
        *d = grad_of(lp, exp_f32(lp), gl, ge, h, scale);
    }
}

#[inline(always)]
fn logprob_grad_in_place_body(z: &mut [f32], lse: f32, gl: f32, ge: f32, h: f32, scale: f32) {
    for x in z {
        let lp = *x - lse;
        *x = grad_of(lp, exp_f32(lp), gl, ge, h, scale);
    }
}

#[inline(always)]
fn swiglu_body(y: &mut [f32], g: &[f32], u: &[f32]) {
    for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
        *y = g / (1.0 + exp_f32(-g)) * u;
    }
}

#[inline(always)]
fn swiglu_grad_body(dg: &mut [f32], du: &mut [f32], g: &[f32], u: &[f32], dy: &[f32]) {
    let n = dg
        .len()
        .min(du.len())
        .min(g.len())
        .min(u.len())
        .min(dy.len());
    let (dg, du, g, u, dy) = (&mut dg[..n], &mut du[..n], &g[..n], &u[..n], &dy[..n]);
    for j in 0..n {
        (dg[j], du[j]) = swiglu_grad_of(g[j], u[j], dy[j], exp_f32(-g[j]));
    }
}

isa_kernel!(fn exp_row_f32(row: &mut [f32], shift: f32) -> f32 => exp_row_body);
isa_kernel!(fn exp_sums_f32(z: &[f32], m: f32) -> (f32, f32) => exp_sums_body);
isa_kernel!(
    #[allow(clippy::too_many_arguments)]
    fn logprob_grad_f32(dst: &mut [f32], z: &[f32], lse: f32, gl: f32, ge: f32, h: f32, scale: f32)
        => logprob_grad_body
);
isa_kernel!(
    fn logprob_grad_in_place_f32(z: &mut [f32], lse: f32, gl: f32, ge: f32, h: f32, scale: f32)
        => logprob_grad_in_place_body
);
isa_kernel!(fn swiglu_f32(y: &mut [f32], g: &[f32], u: &[f32]) => swiglu_body);
isa_kernel!(
    fn swiglu_grad_f32(dg: &mut [f32], du: &mut [f32], g: &[f32], u: &[f32], dy: &[f32])
        => swiglu_grad_body
);

impl ExpKernels for f32 {
    fn exp_row(row: &mut [f32], shift: f32) -> f32 {
        exp_row_f32(kernel_isa(), row, shift)
    }

    fn exp_sums(z: &[f32], m: f32) -> (f32, f32) {
        exp_sums_f32(kernel_isa(), z, m)
    }

    fn logprob_grad(dst: &mut [f32], z: &[f32], lse: f32, gl: f32, ge: f32, h: f32, scale: f32) {
        logprob_grad_f32(kernel_isa(), dst, z, lse, gl, ge, h, scale);
    }

    fn logprob_grad_in_place(z: &mut [f32], lse: f32, gl: f32, ge: f32, h: f32, scale: f32) {
        logprob_grad_in_place_f32(kernel_isa(), z, lse, gl, ge, h, scale);
    }

    fn swiglu(y: &mut [f32], g: &[f32], u: &[f32]) {
        swiglu_f32(kernel_isa(), y, g, u);
    }

    fn swiglu_grad(dg: &mut [f32], du: &mut [f32], g: &[f32], u: &[f32], dy: &[f32]) {
        swiglu_grad_f32(kernel_isa(), dg, du, g, u, dy);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [−a, a), in `f32`.
    fn values(n: usize, seed: u64, a: f32) -> Vec<f32> {
        super::super::test_values(n, seed, a as f64)
            .into_iter()
            .map(|x| x as f32)
            .collect()
    }

    fn wide(x: &[f32]) -> Vec<f64> {
        x.iter().map(|&v| v as f64).collect()
    }

    /// Relative error of `got` against `want`, scaled by the largest `|want|`.
    fn rel_err(got: &[f32], want: &[f64]) -> f64 {
        let scale = want.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
        got.iter()
            .zip(want)
            .map(|(&g, w)| (g as f64 - w).abs() / scale)
            .fold(0.0, f64::max)
    }

    /// The vectorisable `exp` against `f32::exp` over its range (within 2 ulp, relative error
    /// 2.4e-7), 0 below −87 and for −∞, on every instruction set this CPU runs, with the row
    /// sums right.
    #[test]
    fn fast_exp_matches_the_standard_exp() {
        let xs: Vec<f32> = (0..200_001)
            .map(|i| -87.0 + 175.0 * i as f32 / 200_000.0)
            .chain([-87.5, -100.0, -1e9, f32::NEG_INFINITY, 0.0, -0.0])
            .collect();
        for isa in KernelIsa::supported() {
            let name = format!("{isa:?}");
            let kernel = |r: &mut [f32], s: f32| exp_row_f32(isa, r, s);
            let mut row = xs.clone();
            kernel(&mut row, 0.0);
            for (&x, &y) in xs.iter().zip(&row) {
                if x < -87.0 {
                    assert_eq!(y, 0.0, "{name}: exp({x}) must be 0");
                    continue;
                }
                let e = x.exp();
                let rel = ((y - e) / e).abs();
                assert!(
                    rel <= 2.4e-7,
                    "{name}: exp({x}) = {y}, std {e}, relative {rel:e}"
                );
            }
            // A softmax row (every value ≤ 0, shifted by 1.5): the sum.
            let mut soft: Vec<f32> = xs.iter().map(|&x| x.min(0.0) + 1.5).collect();
            let want: f64 = soft.iter().map(|&x| f64::from((x - 1.5).exp())).sum();
            let got = kernel(&mut soft, 1.5);
            let rel = (f64::from(got) - want).abs() / want;
            assert!(rel < 1e-5, "{name}: row sum off by {rel:e}");
        }
    }

    #[test]
    fn exp_f32_is_within_2_ulp_of_the_library_exp() {
        for i in -87_000..=88_000 {
            let x = i as f32 / 1000.0;
            let (got, want) = (exp_f32(x), x.exp());
            let ulp = (want.to_bits() as i64 - got.to_bits() as i64).abs();
            assert!(ulp <= 2, "exp({x}) = {got}, library {want}: {ulp} ulp");
        }
        assert_eq!(exp_f32(-87.5), 0.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert!(exp_f32(100.0).is_finite());
    }

    /// Every `f32` kernel against the `f64` scalar formula, on each instruction set this CPU has,
    /// at lengths that leave remainders after the 16 lanes. The model's own path (the widest
    /// set) is also run through the trait.
    #[test]
    fn the_f32_kernels_match_the_scalar_formulas_on_every_instruction_set() {
        let isas = KernelIsa::supported();
        for &n in &[1usize, 15, 16, 17, 1000, 4099] {
            let z = values(n, 1, 12.0);
            let m = super::super::max(&z);
            let g = values(n, 2, 9.0);
            let u = values(n, 3, 2.0);
            let dy = values(n, 4, 1.0);
            let (lse, gl, ge, h, sc) = (m + 2.5, 0.7f32, -0.3f32, 1.9f32, 1.25f32);
            // The f64 references.
            let (se64, sez64) = f64::exp_sums(&wide(&z), m as f64);
            let mut lg64 = vec![0f64; n];
            f64::logprob_grad(
                &mut lg64,
                &wide(&z),
                lse as f64,
                gl as f64,
                ge as f64,
                h as f64,
                sc as f64,
            );
            let mut y64 = vec![0f64; n];
            f64::swiglu(&mut y64, &wide(&g), &wide(&u));
            let (mut dg64, mut du64) = (vec![0f64; n], vec![0f64; n]);
            f64::swiglu_grad(&mut dg64, &mut du64, &wide(&g), &wide(&u), &wide(&dy));
            for &isa in &isas {
                let (se, sez) = exp_sums_f32(isa, &z, m);
                assert!(((se as f64 - se64) / se64).abs() < 1e-5, "{isa:?} n={n} Σe");
                assert!(
                    (sez as f64 - sez64).abs() < 1e-5 * se64.max(1.0),
                    "{isa:?} Σe·d"
                );
                let mut lg = vec![0f32; n];
                logprob_grad_f32(isa, &mut lg, &z, lse, gl, ge, h, sc);
                assert!(rel_err(&lg, &lg64) < 1e-5, "{isa:?} n={n} logprob_grad");
                let mut inplace = z.clone();
                logprob_grad_in_place_f32(isa, &mut inplace, lse, gl, ge, h, sc);
                assert_eq!(inplace, lg, "{isa:?} in place");
                let mut y = vec![0f32; n];
                swiglu_f32(isa, &mut y, &g, &u);
                assert!(rel_err(&y, &y64) < 1e-6, "{isa:?} n={n} swiglu");
                let (mut dg, mut du) = (vec![0f32; n], vec![0f32; n]);
                swiglu_grad_f32(isa, &mut dg, &mut du, &g, &u, &dy);
                assert!(rel_err(&dg, &dg64) < 1e-6, "{isa:?} n={n} swiglu dg");
                assert!(rel_err(&du, &du64) < 1e-6, "{isa:?} n={n} swiglu du");
            }
            assert_eq!(f32::exp_sums(&z, m), exp_sums_f32(kernel_isa(), &z, m));
        }
    }
}
