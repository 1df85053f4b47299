//! How a batch of rows is cut: into shards for data-parallel forward/backward passes on the
//! CPU's cores, and into groups of rows that share a prefix, which a pass runs once. The
//! training update (`update/`) and the information-gain probes (`rollout/info_gain.rs`) both
//! cut their batches here.
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
use turnwise_model::Transformer;

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

/// `idx` cut into at most `k` shards of balanced padded cost. `len(i)` is row `i`'s length; a
/// shard pads every row to its longest, so its cost is `rows × longest`. The rows are sorted by
/// length (stable) and cut into contiguous runs, the longest first, each as long as the
/// smallest bottleneck that `k` runs can meet allows: short rows share a shard and pad little,
/// and no shard waits on another much longer one.
pub fn shards_by_len(idx: &[usize], k: usize, len: impl Fn(usize) -> usize) -> Vec<Vec<usize>> {
    let k = k.max(1);
    let mut sorted = idx.to_vec();
    sorted.sort_by_key(|&i| len(i));
    let lens: Vec<usize> = sorted.iter().map(|&i| len(i).max(1)).collect();
    if k == 1 || sorted.len() <= 1 {
        return vec![sorted].into_iter().filter(|s| !s.is_empty()).collect();
    }
    // Greedy from the longest row: each run takes rows while rows × its longest ≤ `b`.
    let runs = |b: usize| -> Vec<std::ops::Range<usize>> {
        let mut out = Vec::new();
        let mut end = lens.len();
        while end > 0 {
            let longest = lens[end - 1];
            let take = (b / longest).max(1).min(end);
            out.push(end - take..end);
            end -= take;
        }
        out
    };
    let lo = fewest_runs_bound(
        lens[lens.len() - 1],
        lens[lens.len() - 1] * lens.len(),
        k,
        &runs,
    );
    let mut out: Vec<Vec<usize>> = runs(lo).into_iter().map(|r| sorted[r].to_vec()).collect();
    out.reverse();
    out
}

/// The smallest bound `b` in `lo..=hi` (`hi` feasible) for which `runs(b)`, a greedy cut whose
/// run count falls as `b` grows, needs at most `k` runs: a binary search.
fn fewest_runs_bound(
    mut lo: usize,
    mut hi: usize,
    k: usize,
    runs: &dyn Fn(usize) -> Vec<std::ops::Range<usize>>,
) -> usize {
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if runs(mid).len() <= k {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo
}

/// `idx`, in the order given, cut into at most `k` contiguous runs of balanced cost (`cost(i)`
/// per row; the largest run as small as `k` runs allow): the shards of a mini-batch whose
/// order keeps rows that share a prefix together (token order), so that each shard runs its
/// shared prefixes once.
pub fn shards_in_order(idx: &[usize], k: usize, cost: impl Fn(usize) -> usize) -> Vec<Vec<usize>> {
    let k = k.max(1);
    if idx.is_empty() {
        return Vec::new();
    }
    let costs: Vec<usize> = idx.iter().map(|&i| cost(i).max(1)).collect();
    // Greedy runs whose cost stays within `b`; the smallest `b` that needs at most `k` runs.
    let runs = |b: usize| -> Vec<std::ops::Range<usize>> {
        let mut out = Vec::new();
        let (mut start, mut sum) = (0, 0);
        for (j, &c) in costs.iter().enumerate() {
            if sum + c > b && j > start {
                out.push(start..j);
                (start, sum) = (j, 0);
            }
            sum += c;
        }
        out.push(start..costs.len());
        out
    };
    let lo = fewest_runs_bound(
        costs.iter().copied().max().unwrap_or(1),
        costs.iter().sum::<usize>(),
        k,
        &runs,
    );
    runs(lo).into_iter().map(|r| idx[r].to_vec()).collect()
}

/// How many shards the training forwards of `model` over `rows` rows are cut into:
/// [`shard_count`], or one when the model draws LoRA dropout masks (their stream is one
/// sequence; concurrent forwards would draw them in an order that depends on thread timing, and
/// a resumed run would not repeat the uninterrupted one).
pub fn training_shard_count(model: &Transformer, rows: usize) -> usize {
    if model.draws_dropout() {
        1
    } else {
        shard_count(model.device(), rows)
    }
}

/// `f` on each of `chunks`, concurrently when `k > 1` (a shard count: [`shard_count`] or
/// [`training_shard_count`]), one at a time otherwise; the results in chunk order.
pub fn map_chunks<C: Sync, T: Send>(
    k: usize,
    chunks: &[C],
    f: impl Fn(&C) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    if k <= 1 || chunks.len() <= 1 {
        return chunks.iter().map(&f).collect();
    }
    chunks.par_iter().map(&f).collect()
}

/// The shortest prefix that rows share for a pass (`update::pack`, the information-gain probes)
/// to compute it once: below it, the second forward call costs about what sharing saves.
pub const MIN_SHARED_PREFIX: usize = 8;

/// Rows of a packed batch whose first `len` tokens are the same.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixGroup {
    /// Length of the shared prefix (shorter than every row of the group).
    pub len: usize,
    /// The rows (indices into the batch), at least two.
    pub rows: Vec<usize>,
}

/// Groups of rows that share a prefix of at least `min_len` tokens, found greedily over the
/// rows in lexicographic order (so rows of one prompt, a tree's branches and one trajectory's
/// step samples are neighbours): a run of neighbours grows while the tokens it saves,
/// `(rows − 1) · shared`, do not shrink. A group's prefix is shorter than each of its rows.
pub fn prefix_groups(seqs: &[&[u32]], min_len: usize) -> Vec<PrefixGroup> {
    let mut order: Vec<usize> = (0..seqs.len()).collect();
    order.sort_by(|&a, &b| seqs[a].cmp(seqs[b]));
    let lcp = |a: &[u32], b: &[u32]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let mut groups = Vec::new();
    let close = |run: &mut Vec<usize>, c: usize, groups: &mut Vec<PrefixGroup>| {
        if run.len() >= 2 {
            groups.push(PrefixGroup {
                len: c,
                rows: std::mem::take(run),
            });
        }
        run.clear();
    };
    let mut run: Vec<usize> = Vec::new();
    let mut c = 0usize;
    for &r in &order {
        let own = seqs[r].len().saturating_sub(1);
        let Some(&prev) = run.last() else {
            run.push(r);
            c = own;
            continue;
        };
        let joined = c.min(lcp(seqs[prev], seqs[r])).min(own);
        let saves_before = (run.len() - 1) * c;
        if joined >= min_len.max(1) && run.len() * joined >= saves_before {
            run.push(r);
            c = joined;
        } else {
            close(&mut run, c, &mut groups);
            run.push(r);
            c = own;
        }
    }
    close(&mut run, c, &mut groups);
    for g in &mut groups {
        g.rows.sort_unstable();
    }
    groups
}
#[cfg(test)]
mod tests {
    use super::{PrefixGroup, prefix_groups, shards_by_len, shards_in_order};

    #[test]
    fn shards_in_order_keep_the_order_and_balance_cost() {
        let cost = [5, 5, 5, 5, 20, 1, 1, 1, 1, 1];
        let idx: Vec<usize> = (0..cost.len()).collect();
        let parts = shards_in_order(&idx, 2, |i| cost[i]);
        assert_eq!(parts, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7, 8, 9]]);
        let parts = shards_in_order(&idx, 3, |i| cost[i]);
        assert_eq!(parts.concat(), idx);
        assert!(parts.len() <= 3);
        let worst = parts
            .iter()
            .map(|p| p.iter().map(|&i| cost[i]).sum::<usize>())
            .max()
            .unwrap();
        assert_eq!(worst, 20);
        assert!(shards_in_order(&[], 2, |_| 1).is_empty());
        assert_eq!(shards_in_order(&[7, 3], 1, |_| 1), vec![vec![7, 3]]);
    }

    /// Padded cost of a shard: rows × longest.
    fn cost(s: &[usize], lens: &[usize]) -> usize {
        s.len() * s.iter().map(|&i| lens[i]).max().unwrap_or(0)
    }

    #[test]
    fn shards_cover_every_row_once_and_balance_padded_cost() {
        let lens = [120, 200, 130, 210, 125, 205, 118, 190, 122, 199];
        let idx: Vec<usize> = (0..lens.len()).collect();
        let parts = shards_by_len(&idx, 2, |i| lens[i]);
        assert_eq!(parts.len(), 2);
        let mut all: Vec<usize> = parts.iter().flatten().copied().collect();
        all.sort();
        assert_eq!(all, idx);
        // The short rows share a shard: it pads to 130, not 210.
        assert_eq!(parts[0].iter().map(|&i| lens[i]).max(), Some(130));
        // Alternating rows (sorted) pads both shards to about the longest row: 1025 and 1050.
        let worst = parts.iter().map(|s| cost(s, &lens)).max().unwrap();
        let padded: usize = parts.iter().map(|s| cost(s, &lens)).sum();
        assert!(worst <= 1050, "{worst}");
        assert!(padded < 1025 + 1050, "{padded}");
    }

    #[test]
    fn one_shard_per_row_at_most_and_empty_input() {
        let lens = [5, 5, 5];
        let parts = shards_by_len(&[0, 1, 2], 8, |i| lens[i]);
        assert_eq!(parts.iter().map(Vec::len).sum::<usize>(), 3);
        assert!(parts.len() <= 3);
        assert!(shards_by_len(&[], 2, |_| 1).is_empty());
        assert_eq!(
            shards_by_len(&[0, 1, 2], 1, |i| lens[i]),
            vec![vec![0, 1, 2]]
        );
    }

    /// Rows of one prompt group together; a tree's branches share more than the prompt; a run
    /// stops growing when a further row would save less than it costs; a prefix never swallows
    /// a whole row; short common prefixes are not worth a group.
    #[test]
    fn prefix_groups_find_rows_that_share_a_prefix() {
        let p: Vec<u32> = (100..110).collect();
        let q: Vec<u32> = (200..212).collect();
        let with = |base: &[u32], tail: &[u32]| -> Vec<u32> { [base, tail].concat() };
        let seqs = [
            with(&p, &[1, 2, 3]),         // 0: prompt p
            with(&q, &[7]),               // 1: prompt q
            with(&p, &[1, 2, 9, 9]),      // 2: p, shares "1 2" with row 0
            with(&q, &[8, 8]),            // 3: q
            vec![1, 2, 3],                // 4: alone
            with(&p, &[5]),               // 5: p
            with(&p[..3], &[50, 51, 52]), // 6: shares 3 tokens with p only
        ];
        let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
        let groups = prefix_groups(&refs, 8);
        assert_eq!(
            groups,
            vec![
                PrefixGroup {
                    len: 10,
                    rows: vec![0, 2, 5]
                },
                PrefixGroup {
                    len: 12,
                    rows: vec![1, 3]
                },
            ]
        );
        // Two branches of a tree share 12 tokens; a third row shares the 10-token prompt only:
        // 2 · 10 = 20 saved by all three against 12 by the pair, so all three.
        let tree = [
            with(&p, &[1, 2, 3, 4]),
            with(&p, &[1, 2, 5]),
            with(&p, &[6, 6]),
        ];
        let refs: Vec<&[u32]> = tree.iter().map(Vec::as_slice).collect();
        assert_eq!(
            prefix_groups(&refs, 8),
            vec![PrefixGroup {
                len: 10,
                rows: vec![0, 1, 2]
            }]
        );
        // A row that is the others' prefix: the shared part stops before its last token.
        let nested = [p.clone(), with(&p, &[1, 2])];
        let refs: Vec<&[u32]> = nested.iter().map(Vec::as_slice).collect();
        assert_eq!(
            prefix_groups(&refs, 8),
            vec![PrefixGroup {
                len: 9,
                rows: vec![0, 1]
            }]
        );
        assert!(prefix_groups(&refs, 10).is_empty());
        assert!(prefix_groups(&[], 8).is_empty());
    }
}
