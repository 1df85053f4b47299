//! Fused CPU kernels with hand-written backward passes, as candle custom ops.
//!
//! candle-nn's fused `rms_norm`, `softmax_last_dim` and `rope` have no backward pass, and the
//! differentiable compositions of basic ops they replace cost several passes over memory (and
//! several allocations) each, forward and backward. The ops here do one pass forward and one
//! backward:
//!
//! - [`rms_norm()`](rms_norm::rms_norm): RMSNorm with weight over the last dimension;
//! - [`softmax_last_dim()`](softmax::softmax_last_dim) and
//!   [`masked_softmax_last_dim()`](softmax::masked_softmax_last_dim): softmax over the last
//!   dimension, optionally after adding a broadcast additive mask (the attention bias);
//! - [`rope()`](rope::rope): rotate-half rotary embedding with per-row tables, reading strided
//!   input (so `[B, T, H, D] → [B, H, T, D]` transposes cost nothing extra);
//! - [`token_logprobs_entropy()`](logprob::token_logprobs_entropy): log-probability of a target
//!   token and entropy of the softmax, per row of logits;
//! - [`head_logprobs_entropy()`](head::head_logprobs_entropy): the same from the final hidden
//!   states and the output projection, in chunks of the vocabulary, never materialising the
//!   logits (the fused output head);
//! - [`swiglu()`](swiglu::swiglu): the Llama MLP's gate `silu(g) ∘ u`;
//! - [`attention()`](attention::attention): causal softmax attention with a key mask, in
//!   flash-attention tiles, never materialising the `T × T` scores (forward and backward).
//!
//! [`linear`] holds `x Wᵀ` with the backward a trainer needs: a trained weight's gradient
//! written in the weight's own layout (no transpose-copy), and for a frozen weight (LoRA
//! training) the input's gradient only.
//!
//! [`infer`] holds a forward-only kernel for sampling on detached weights (`x Wᵀ` for a few
//! rows without packing the weight), used only when nothing records a graph.
//!
//! Kernels run on `f32` and `f64`; `f16`/`bf16` inputs go through `f32`. Large inputs are split
//! into blocks that rayon's pool runs (the matrix products' threads, `RAYON_NUM_THREADS`); the
//! split depends on the shapes only, so the results do not depend on the thread count.
//! [`simd`] holds the `exp`-based row kernels, vectorised for the CPU's instruction set.
//!
//! Off the CPU (CUDA) every op is the equivalent composition of candle ops (`*_composed`),
//! which candle runs with its own GPU kernels and differentiates with its autograd:
//! candle-nn's fused CUDA `softmax_last_dim`, `rms_norm` and `rope` have no backward pass, so
//! they cannot stand in for training. The compositions compute softmax, log-softmax and the RMS
//! statistic in `f32` when the input is `f16`/`bf16`, so bf16 activations lose no more than
//! their own rounding. [`with_composed_ops`] (one thread) and `TURNWISE_COMPOSED_OPS=1` (the
//! whole process) route the CPU through the same compositions, so that path is tested here
//! against the fused kernels.

pub mod attention;
pub mod head;
pub mod infer;
pub mod invariant;
pub mod linear;
pub mod logprob;
pub mod rms_norm;
pub mod rope;
pub(crate) mod simd;
pub mod softmax;
pub mod swiglu;

#[cfg(test)]
mod tests;

use std::cell::Cell;
use std::ops::{Add, AddAssign, Div, Mul, MulAssign, Neg, Sub};
use std::sync::OnceLock;

use candle_core::{CpuStorage, Device, Layout, WithDType};

pub use attention::{KeyVisibility, SharedKeys, attention, attention_composed};
pub use head::head_logprobs_entropy;
pub use logprob::token_logprobs_entropy;
pub use rms_norm::rms_norm;
pub use rope::rope;
pub use softmax::{masked_softmax_last_dim, softmax_last_dim};
pub use swiglu::swiglu;

thread_local! {
    static FORCE_COMPOSED: Cell<bool> = const { Cell::new(false) };
    static BATCH_INVARIANT: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with batch-invariant inference set to `on` on this thread: while on, a detached
/// model's forward computes each position's outputs as a fixed function of that position's
/// own inputs and of the keys and values it sees, whatever else the call holds. Every linear
/// layer (the output head and LoRA adapters included) runs the few-row kernel of [`infer`],
/// whose output `y[i, j]` is one fixed-order dot product of `x[i]` and `w[j]` for any number of
/// rows, instead of `gemm` above [`infer::LINEAR_MAX_ROWS`] rows; attention runs
/// [`invariant::attention`], which sums each query's visible keys in their order, skipping
/// padding, whatever the batch's padding, chunking, companions or cascade. So a prompt
/// prefilled whole, in chunks, after a cached prefix, beside other rows or one token at a
/// time gives the same bits. The gradient-tracking (training) path ignores it. Nests;
/// restores the previous setting even if `f` panics.
pub fn with_batch_invariant<R>(on: bool, f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            BATCH_INVARIANT.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(BATCH_INVARIANT.with(|c| c.replace(on)));
    f()
}

/// Whether [`with_batch_invariant`] is on for this thread (and the fused CPU kernels are not
/// turned off: the composed ops have no invariant form).
pub fn batch_invariant() -> bool {
    BATCH_INVARIANT.with(Cell::get) && !FORCE_COMPOSED.with(Cell::get) && !composed_by_env()
}

/// Whether `TURNWISE_COMPOSED_OPS` (set to anything but `0` or empty) turns the fused CPU
/// kernels off for the whole process (read once).
fn composed_by_env() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("TURNWISE_COMPOSED_OPS").is_ok_and(|v| !v.is_empty() && v != "0")
    })
}

/// Whether the fused CPU kernels serve tensors on `device`: only on the CPU, and not inside
/// [`with_composed_ops`] or under `TURNWISE_COMPOSED_OPS=1`. Everywhere else the ops are their
/// candle compositions (the GPU path).
pub fn fused_on(device: &Device) -> bool {
    device.is_cpu() && !FORCE_COMPOSED.with(Cell::get) && !composed_by_env()
}

/// Runs `f` with the fused CPU kernels turned off on this thread: every op in this module (and
/// the forward-only [`infer`] kernel) takes the composition of candle ops that CUDA devices
/// use. The backward pass of a graph built inside `f` follows the ops recorded then. Nests;
/// restores the previous setting even if `f` panics.
pub fn with_composed_ops<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            FORCE_COMPOSED.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(FORCE_COMPOSED.with(|c| c.replace(true)));
    f()
}

/// The float types the kernels run on.
pub(crate) trait Real:
    WithDType
    + Copy
    + Send
    + Sync
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + MulAssign
{
    const ZERO: Self;
    const ONE: Self;
    const NEG_INF: Self;
    /// Below this, `exp` rounds to exactly 0.
    const EXP_UNDERFLOW: f64;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn of(x: f64) -> Self;
    /// The slice of this type inside `storage`, if it holds this type.
    fn slice(storage: &CpuStorage) -> Option<&[Self]>;
}

macro_rules! real {
    ($t:ty, $variant:ident, $under:expr) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INF: Self = <$t>::NEG_INFINITY;
            const EXP_UNDERFLOW: f64 = $under;
            #[inline(always)]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline(always)]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn of(x: f64) -> Self {
                x as $t
            }
            fn slice(storage: &CpuStorage) -> Option<&[Self]> {
                match storage {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
real!(f32, F32, -104.0);
real!(f64, F64, -746.0);

/// Dot product with eight independent accumulators.
#[inline]
pub(crate) fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [T::ZERO; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = T::ZERO;
    for (x, y) in ra.iter().zip(rb) {
        s += *x * *y;
    }
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + s
}

/// Maximum of a slice (`-inf` when empty).
#[inline]
pub(crate) fn max<T: Real>(xs: &[T]) -> T {
    let mut m = T::NEG_INF;
    for &x in xs {
        if x > m {
            m = x;
        }
    }
    m
}

/// Below this many elements of work a kernel stays on the calling thread, in one block.
const PARALLEL_MIN_ELEMS: usize = 1 << 16;

/// The most blocks a kernel is split into.
const MAX_BLOCKS: usize = 16;

/// Splits `dst` (rows of `row_len`) into contiguous blocks of whole rows and runs
/// `f(first_row, block)` on each, on rayon's pool when the work is large. Returns the per-block
/// results in order.
///
/// The number of blocks depends on the shapes only (one per [`PARALLEL_MIN_ELEMS`] of `work`,
/// at most [`MAX_BLOCKS`] and one a row), never on the thread count, so a kernel that sums
/// its blocks' partial results (the RMSNorm weight's gradient, the fused head's) gives the same
/// bits on one thread as on sixteen.
///
/// The pool is the one the matrix products run on (`RAYON_NUM_THREADS`, else all cores; not
/// `CANDLE_NUM_THREADS`, which sizes candle's own element-wise kernels and which the binary
/// keeps at one, see `device::reexec_with_fast_settings`): its workers have just finished the
/// product before an element-wise kernel and take the blocks at once, where threads spawned
/// per call cost their start and, with as many pool workers as cores, compete with them.
pub(crate) fn par_rows<T, R, F>(dst: &mut [T], row_len: usize, work: usize, f: F) -> Vec<R>
where
    T: Send,
    R: Send,
    F: Fn(usize, &mut [T]) -> R + Sync,
{
    use rayon::prelude::*;
    let rows = dst.len().checked_div(row_len).unwrap_or(0);
    let blocks = (work / PARALLEL_MIN_ELEMS)
        .clamp(1, MAX_BLOCKS)
        .min(rows.max(1));
    if blocks <= 1 {
        return vec![f(0, dst)];
    }
    let per = rows.div_ceil(blocks);
    dst.par_chunks_mut(per * row_len)
        .enumerate()
        .map(|(i, block)| f(i * per, block))
        .collect()
}

/// Deterministic pseudo-random values in [−a, a) (xorshift), for the kernels' tests.
#[cfg(test)]
pub(crate) fn test_values(n: usize, seed: u64, a: f64) -> Vec<f64> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * a
        })
        .collect()
}

/// The contiguous slice of `storage` described by `layout`, or an error naming `what`.
pub(crate) fn contiguous<'a, T: Real>(
    storage: &'a CpuStorage,
    layout: &Layout,
    what: &str,
) -> candle_core::Result<&'a [T]> {
    let data = T::slice(storage)
        .ok_or_else(|| candle_core::Error::Msg(format!("{what}: unexpected dtype")))?;
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("{what} has to be contiguous"),
    }
}
