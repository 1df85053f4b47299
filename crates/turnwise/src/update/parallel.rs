//! Data-parallel forward/backward passes on the CPU's cores.
//!
//! The policy of a small model spends most of a training step in candle's element-wise CPU
//! kernels, which run on the calling thread: one forward/backward over a batch keeps one core
//! busy however many there are. Cutting the rows into one shard per core and running each
//! shard's forward and backward on its own thread (the shards' losses already divided by the
//! whole batch's denominators) gives the same gradient, summed in shard order, in a fraction
//! of the time. On an accelerator the device runs one shard.

use anyhow::Result;
use candle_core::Device;
use rayon::prelude::*;

/// How many shards a batch of `rows` rows is cut into on `device`: one per thread of rayon's
/// pool (`RAYON_NUM_THREADS`, which the binary sets to the core count) on the CPU, never more
/// than the rows, and one on an accelerator.
pub fn shard_count(device: &Device, rows: usize) -> usize {
    if device.is_cpu() {
        rayon::current_num_threads().min(rows).max(1)
    } else {
        1
    }
}

/// `idx` cut into `k` shards of similar size and similar lengths: the i-th index goes to shard
/// `i mod k`, so when `idx` is sorted by length every shard pads to about the same width.
pub fn shards(idx: &[usize], k: usize) -> Vec<Vec<usize>> {
    let k = k.max(1);
    let mut out = vec![Vec::with_capacity(idx.len().div_ceil(k)); k];
    for (i, &r) in idx.iter().enumerate() {
        out[i % k].push(r);
    }
    out.retain(|s| !s.is_empty());
    out
}

/// `f` on each shard of `idx` ([`shards`], [`shard_count`] of them), concurrently; the results
/// in shard order.
pub fn shard_backward<T: Send>(
    device: &Device,
    idx: &[usize],
    f: impl Fn(&[usize]) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let parts = shards(idx, shard_count(device, idx.len()));
    if parts.len() <= 1 {
        return parts.iter().map(|s| f(s)).collect();
    }
    parts.par_iter().map(|s| f(s)).collect()
}

/// `f` on each of `chunks`, concurrently on the CPU (one at a time elsewhere); the results in
/// chunk order.
pub fn map_chunks<C: Sync, T: Send>(
    device: &Device,
    chunks: &[C],
    f: impl Fn(&C) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    if shard_count(device, chunks.len()) <= 1 {
        return chunks.iter().map(&f).collect();
    }
    chunks.par_iter().map(&f).collect()
}
