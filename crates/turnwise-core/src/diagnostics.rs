//! Diagnostics computed from trajectories and advantages (spec §7).
//!
//! Pure functions over plain slices. Each family has a value-level function (easy to test) and a
//! `*_metrics` function that returns the values under the names verl (and the papers' code) log
//! them with, e.g. `critic/advantages/max`, `actor/turn_kl_entropy`, as a [`Metrics`] map the
//! trainer can merge and write.
//!
//! Token-level inputs use the TITO layout of §1.1: per sequence a value slice, a `loss_mask`
//! (`true` = sampled by the policy) and optionally explicit `turn_ids` (−1 for observation
//! tokens); without turn ids turns are maximal runs of loss-masked tokens (§1.2).

use std::collections::BTreeMap;
use std::ops::Range;

/// Metric name → value, sorted by name.
pub type Metrics = BTreeMap<String, f64>;

/// Added to `Var(R)` in the explained-variance denominator (VERL).
pub const EXPLAINED_VAR_EPS: f64 = 1e-5;
/// Added inside the log of the turn-KL entropy (ATPO eq. 13 code).
pub const TURN_KL_LOG_EPS: f64 = 1e-10;

/// One sequence's token-level view.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenSeq<'a> {
    /// Per-token values (advantages, `logr`, …), one per response token.
    pub values: &'a [f64],
    /// Loss mask (`true` = policy-sampled token).
    pub loss_mask: &'a [bool],
    /// Explicit agent-turn index per token (−1 for observations); `None` → mask runs.
    pub turn_ids: Option<&'a [i32]>,
}

/// Turns of a loss mask as maximal runs of `true` (§1.2 canonical rule), as token ranges.
pub fn mask_runs(loss_mask: &[bool]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = None;
    for (i, &m) in loss_mask.iter().enumerate() {
        match (m, start) {
            (true, None) => start = Some(i),
            (false, Some(s)) => {
                out.push(s..i);
                start = None;
            }
            _ => {}
        }
    }
    if let Some(s) = start {
        out.push(s..loss_mask.len());
    }
    out
}

/// Turn position (0-based) of every loss-masked token; `None` for other tokens.
///
/// With explicit turn ids the position is the rank of the token's id among the distinct
/// non-negative ids of the sequence in order of appearance (so ids need not be contiguous);
/// otherwise the index of its mask run.
pub fn token_turn_positions(seq: &TokenSeq<'_>) -> Vec<Option<usize>> {
    let n = seq.loss_mask.len();
    let mut out = vec![None; n];
    match seq.turn_ids {
        Some(ids) => {
            let mut seen: Vec<i32> = Vec::new();
            for i in 0..n.min(ids.len()) {
                if !seq.loss_mask[i] || ids[i] < 0 {
                    continue;
                }
                let pos = match seen.iter().position(|&x| x == ids[i]) {
                    Some(p) => p,
                    None => {
                        seen.push(ids[i]);
                        seen.len() - 1
                    }
                };
                out[i] = Some(pos);
            }
        }
        None => {
            for (k, r) in mask_runs(seq.loss_mask).into_iter().enumerate() {
                for slot in &mut out[r] {
                    *slot = Some(k);
                }
            }
        }
    }
    out
}

/// Min / max / mean of a set of values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    /// Minimum.
    pub min: f64,
    /// Maximum.
    pub max: f64,
    /// Mean.
    pub mean: f64,
    /// Number of values.
    pub count: usize,
}

/// Accumulates a [`Summary`].
#[derive(Debug, Clone, Copy)]
struct Acc {
    min: f64,
    max: f64,
    sum: f64,
    n: usize,
}

impl Acc {
    fn new() -> Self {
        Self {
            min: f64::INFINITY,
            max: f64::NEG_INFINITY,
            sum: 0.0,
            n: 0,
        }
    }
    fn push(&mut self, x: f64) {
        self.min = self.min.min(x);
        self.max = self.max.max(x);
        self.sum += x;
        self.n += 1;
    }
    fn finish(&self) -> Option<Summary> {
        (self.n > 0).then(|| Summary {
            min: self.min,
            max: self.max,
            mean: self.sum / self.n as f64,
            count: self.n,
        })
    }
}

/// Summary of a plain list of values (`None` when empty).
pub fn summarize(values: &[f64]) -> Option<Summary> {
    let mut a = Acc::new();
    values.iter().for_each(|&x| a.push(x));
    a.finish()
}

/// Min / max / mean over the loss-masked tokens of all sequences (`None` if there is none).
pub fn masked_summary(seqs: &[TokenSeq<'_>]) -> Option<Summary> {
    let mut a = Acc::new();
    for s in seqs {
        for (&v, &m) in s.values.iter().zip(s.loss_mask) {
            if m {
                a.push(v);
            }
        }
    }
    a.finish()
}

/// `critic/advantages/{min,max,mean}` over loss-masked tokens (VERL; A2TGPO Fig. 5 envelope).
pub fn advantage_metrics(seqs: &[TokenSeq<'_>]) -> Metrics {
    let mut m = Metrics::new();
    if let Some(s) = masked_summary(seqs) {
        m.insert("critic/advantages/max".into(), s.max);
        m.insert("critic/advantages/min".into(), s.min);
        m.insert("critic/advantages/mean".into(), s.mean);
    }
    m
}

/// Advantage envelope per turn position: min / max / mean over the loss-masked tokens of turn k
/// of every sequence (A2TGPO Fig. 4/5). Entry k is `None` when no sequence has a turn k token.
pub fn advantage_envelope_by_turn(seqs: &[TokenSeq<'_>]) -> Vec<Option<Summary>> {
    let mut accs: Vec<Acc> = Vec::new();
    for s in seqs {
        for (i, pos) in token_turn_positions(s).into_iter().enumerate() {
            let Some(k) = pos else { continue };
            if accs.len() <= k {
                accs.resize(k + 1, Acc::new());
            }
            accs[k].push(s.values[i]);
        }
    }
    accs.iter().map(Acc::finish).collect()
}

/// [`advantage_envelope_by_turn`] as metrics `advantages_by_turn/turn_{k}/{min,max,mean}`
/// (k 1-based, as the papers number turns).
pub fn advantage_envelope_metrics(seqs: &[TokenSeq<'_>]) -> Metrics {
    let mut m = Metrics::new();
    for (k, s) in advantage_envelope_by_turn(seqs).into_iter().enumerate() {
        if let Some(s) = s {
            let t = k + 1;
            m.insert(format!("advantages_by_turn/turn_{t}/min"), s.min);
            m.insert(format!("advantages_by_turn/turn_{t}/max"), s.max);
            m.insert(format!("advantages_by_turn/turn_{t}/mean"), s.mean);
        }
    }
    m
}

/// Per-turn sums of `logr` over loss-masked tokens (the inputs of [`turn_kl_entropy`]).
pub fn turn_logr_sums(seq: &TokenSeq<'_>) -> Vec<f64> {
    let mut sums: Vec<f64> = Vec::new();
    for (i, pos) in token_turn_positions(seq).into_iter().enumerate() {
        let Some(k) = pos else { continue };
        if sums.len() <= k {
            sums.resize(k + 1, 0.0);
        }
        sums[k] += seq.values[i];
    }
    sums
}

/// ATPO turn-KL entropy of one sample (App. A eq. 13): `x_k = Σ_{turn k} logr / Σ_seq logr`,
/// `p = softmax(x)`, `H = −Σ p log(p + 1e-10)`, divided by `log K`.
///
/// One turn (or none) → `Some(0)`; `Σ_seq logr = 0` with ≥ 2 turns → `None` (sample skipped).
pub fn turn_kl_entropy(turn_logr_sums: &[f64]) -> Option<f64> {
    let k = turn_logr_sums.len();
    if k <= 1 {
        return Some(0.0);
    }
    let total: f64 = turn_logr_sums.iter().sum();
    if total == 0.0 {
        return None;
    }
    let x: Vec<f64> = turn_logr_sums.iter().map(|s| s / total).collect();
    let mx = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = x.iter().map(|v| (v - mx).exp()).sum();
    let h: f64 = x
        .iter()
        .map(|v| {
            let p = (v - mx).exp() / z;
            -p * (p + TURN_KL_LOG_EPS).ln()
        })
        .sum();
    Some(h / (k as f64).ln())
}

/// `actor/turn_kl_entropy` (batch mean over non-skipped samples) and `actor/single_turn_count`
/// (samples with ≤ 1 turn) from per-sample per-turn `logr` sums.
pub fn turn_kl_metrics<S: AsRef<[f64]>>(per_sample_turn_sums: &[S]) -> Metrics {
    let mut acc = Acc::new();
    let mut single = 0usize;
    for s in per_sample_turn_sums {
        let s = s.as_ref();
        if s.len() <= 1 {
            single += 1;
        }
        if let Some(h) = turn_kl_entropy(s) {
            acc.push(h);
        }
    }
    let mut m = Metrics::new();
    if let Some(s) = acc.finish() {
        m.insert("actor/turn_kl_entropy".into(), s.mean);
    }
    m.insert("actor/single_turn_count".into(), single as f64);
    m
}

/// Number of samples with at most one turn.
pub fn single_turn_count(turn_counts: &[usize]) -> usize {
    turn_counts.iter().filter(|&&t| t <= 1).count()
}

/// Unbiased (n − 1) variance, VERL `masked_var` default; `None` for fewer than 2 values.
fn unbiased_var(values: impl Iterator<Item = f64> + Clone) -> Option<f64> {
    let n = values.clone().count();
    if n < 2 {
        return None;
    }
    let mean = values.clone().sum::<f64>() / n as f64;
    Some(values.map(|v| (v - mean) * (v - mean)).sum::<f64>() / (n - 1) as f64)
}

/// `critic/vf_explained_var = 1 − Var(R − V)/(Var(R) + 1e-5)` over loss-masked tokens, with
/// VERL's unbiased masked variance. `None` with fewer than 2 masked tokens (VERL raises).
pub fn vf_explained_var(returns: &[f64], values: &[f64], mask: &[bool]) -> Option<f64> {
    let idx = || {
        mask.iter()
            .zip(returns.iter().zip(values))
            .filter(|(m, _)| **m)
            .map(|(_, rv)| rv)
    };
    let var_r = unbiased_var(idx().map(|(r, _)| *r))?;
    let var_d = unbiased_var(idx().map(|(r, v)| r - v))?;
    Some(1.0 - var_d / (var_r + EXPLAINED_VAR_EPS))
}

/// `response_length/{mean,max,min,clip_ratio}`; `clip_ratio` = fraction of responses at (or
/// beyond) `max_response_length`.
pub fn response_length_metrics(lengths: &[usize], max_response_length: usize) -> Metrics {
    let mut m = Metrics::new();
    let f: Vec<f64> = lengths.iter().map(|&l| l as f64).collect();
    if let Some(s) = summarize(&f) {
        m.insert("response_length/mean".into(), s.mean);
        m.insert("response_length/max".into(), s.max);
        m.insert("response_length/min".into(), s.min);
        let clipped = lengths
            .iter()
            .filter(|&&l| l >= max_response_length)
            .count();
        m.insert(
            "response_length/clip_ratio".into(),
            clipped as f64 / lengths.len() as f64,
        );
    }
    m
}

/// `state_tokens/coverage = Σ loss_mask / Σ attention` (Search-R1): the share of the valid
/// response tokens that were sampled by the policy. Each slice is one response's valid tokens.
pub fn state_token_coverage(loss_masks: &[&[bool]]) -> Option<f64> {
    let total: usize = loss_masks.iter().map(|m| m.len()).sum();
    let sampled: usize = loss_masks
        .iter()
        .map(|m| m.iter().filter(|&&b| b).count())
        .sum();
    (total > 0).then(|| sampled as f64 / total as f64)
}

/// `{prefix}/{min,max,mean}` of integer counts, e.g. `num_turns`, `tool_call_counts`.
pub fn count_metrics(prefix: &str, counts: &[usize]) -> Metrics {
    let f: Vec<f64> = counts.iter().map(|&c| c as f64).collect();
    let mut m = Metrics::new();
    if let Some(s) = summarize(&f) {
        m.insert(format!("{prefix}/min"), s.min);
        m.insert(format!("{prefix}/max"), s.max);
        m.insert(format!("{prefix}/mean"), s.mean);
    }
    m
}

/// Sorted, deduplicated token set (the representation [`jaccard`] expects).
pub fn token_set(ids: &[u32]) -> Vec<u32> {
    let mut v = ids.to_vec();
    v.sort_unstable();
    v.dedup();
    v
}

/// Jaccard similarity `|A ∩ B| / |A ∪ B|` of two sorted, deduplicated sets; 1 for two empty sets.
pub fn jaccard(a: &[u32], b: &[u32]) -> f64 {
    let (mut i, mut j, mut inter) = (0, 0, 0usize);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                inter += 1;
                i += 1;
                j += 1;
            }
        }
    }
    let union = a.len() + b.len() - inter;
    if union == 0 {
        1.0
    } else {
        inter as f64 / union as f64
    }
}

/// Mean pairwise context similarity of one prompt's rollouts (A2TGPO Fig. 1 / App. C.5).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ContextSimilarity {
    /// Mean Jaccard over pairs of turns at the same position in two different rollouts.
    pub intra_position: Option<f64>,
    /// Mean Jaccard over pairs of turns at different positions in two different rollouts.
    pub cross_position: Option<f64>,
    /// Number of same-position pairs.
    pub intra_pairs: usize,
    /// Number of cross-position pairs.
    pub cross_pairs: usize,
}

/// Context similarity over groups: `groups[g][r][t]` = token ids of turn t (think + query + tool
/// result) of rollout r of prompt g. Every unordered pair of distinct rollouts of the same prompt
/// contributes all its (turn a, turn b) pairs: same position → intra, else cross.
pub fn context_similarity(groups: &[Vec<Vec<Vec<u32>>>]) -> ContextSimilarity {
    let (mut intra, mut cross) = (Acc::new(), Acc::new());
    for g in groups {
        let sets: Vec<Vec<Vec<u32>>> = g
            .iter()
            .map(|r| r.iter().map(|t| token_set(t)).collect())
            .collect();
        for i in 0..sets.len() {
            for j in i + 1..sets.len() {
                for (a, sa) in sets[i].iter().enumerate() {
                    for (b, sb) in sets[j].iter().enumerate() {
                        let v = jaccard(sa, sb);
                        if a == b { intra.push(v) } else { cross.push(v) }
                    }
                }
            }
        }
    }
    ContextSimilarity {
        intra_position: intra.finish().map(|s| s.mean),
        cross_position: cross.finish().map(|s| s.mean),
        intra_pairs: intra.n,
        cross_pairs: cross.n,
    }
}

/// `context_similarity/{intra_position,cross_position}`.
pub fn context_similarity_metrics(groups: &[Vec<Vec<Vec<u32>>>]) -> Metrics {
    let c = context_similarity(groups);
    let mut m = Metrics::new();
    if let Some(v) = c.intra_position {
        m.insert("context_similarity/intra_position".into(), v);
    }
    if let Some(v) = c.cross_position {
        m.insert("context_similarity/cross_position".into(), v);
    }
    m
}

/// T2PO staleness (App. B.3 eq. 14): `δ = B_rollout · n · K̂ / B_update`, `ρ = δ/(1 + δ)`,
/// K̂ = mean turns per trajectory. Returns `(δ, ρ)`; `None` when `B_update = 0`.
pub fn staleness(
    b_rollout: usize,
    n: usize,
    mean_turns: f64,
    b_update: usize,
) -> Option<(f64, f64)> {
    if b_update == 0 {
        return None;
    }
    let d = b_rollout as f64 * n as f64 * mean_turns / b_update as f64;
    Some((d, d / (1.0 + d)))
}

/// `staleness/{delta,rho}`.
pub fn staleness_metrics(b_rollout: usize, n: usize, mean_turns: f64, b_update: usize) -> Metrics {
    let mut m = Metrics::new();
    if let Some((d, r)) = staleness(b_rollout, n, mean_turns, b_update) {
        m.insert("staleness/delta".into(), d);
        m.insert("staleness/rho".into(), r);
    }
    m
}

/// IG diagnostics (\[REC\] §7): `info_gain/probe_failures` and `info_gain/turn_{t}/mean` (mean raw
/// IG at process turn t, 1-based) from per-rollout IG lists.
pub fn info_gain_metrics<S: AsRef<[f64]>>(
    per_rollout_gains: &[S],
    probe_failures: usize,
) -> Metrics {
    let mut accs: Vec<Acc> = Vec::new();
    for g in per_rollout_gains {
        for (t, &v) in g.as_ref().iter().enumerate() {
            if accs.len() <= t {
                accs.resize(t + 1, Acc::new());
            }
            accs[t].push(v);
        }
    }
    let mut m = Metrics::new();
    m.insert("info_gain/probe_failures".into(), probe_failures as f64);
    for (t, a) in accs.iter().enumerate() {
        if let Some(s) = a.finish() {
            m.insert(format!("info_gain/turn_{}/mean", t + 1), s.mean);
        }
    }
    m
}

/// Rollout-control diagnostics (\[REC\] §7): TTI trigger rate and forced tokens, TDS
/// regenerations, DAPO batches and kept prompt fraction.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ControlStats {
    /// Generations monitored by TTI.
    pub tti_generations: usize,
    /// Generations in which TTI fired.
    pub tti_triggered: usize,
    /// Tokens forced by TTI.
    pub tti_forced_tokens: usize,
    /// Rows regenerated by TDS.
    pub tds_regenerations: usize,
    /// DAPO generation batches used.
    pub dapo_num_gen_batches: usize,
    /// Prompts kept by the DAPO filter.
    pub dapo_kept_prompts: usize,
    /// Prompts seen by the DAPO filter.
    pub dapo_total_prompts: usize,
}

/// [`ControlStats`] as metrics (`tti/*`, `tds/*`, `dapo/*`; rates only where defined).
pub fn control_metrics(s: &ControlStats) -> Metrics {
    let mut m = Metrics::new();
    if s.tti_generations > 0 {
        m.insert(
            "tti/trigger_rate".into(),
            s.tti_triggered as f64 / s.tti_generations as f64,
        );
        m.insert("tti/forced_tokens".into(), s.tti_forced_tokens as f64);
    }
    m.insert("tds/regenerations".into(), s.tds_regenerations as f64);
    if s.dapo_num_gen_batches > 0 {
        m.insert("dapo/num_gen_batches".into(), s.dapo_num_gen_batches as f64);
    }
    if s.dapo_total_prompts > 0 {
        m.insert(
            "dapo/kept_prompt_fraction".into(),
            s.dapo_kept_prompts as f64 / s.dapo_total_prompts as f64,
        );
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{TOL, assert_all_close, assert_close};
    use proptest::prelude::*;

    // Two sequences (hand-built):
    // A: values [0.5, 0.5, 9.0, 0.2], mask [1,1,0,1], turn ids [0,0,-1,1]
    // B: values [-1.0, 7.0, 7.0],     mask [1,0,0],   turn ids [0,-1,-1]
    const AV: [f64; 4] = [0.5, 0.5, 9.0, 0.2];
    const AM: [bool; 4] = [true, true, false, true];
    const AT: [i32; 4] = [0, 0, -1, 1];
    const BV: [f64; 3] = [-1.0, 7.0, 7.0];
    const BM: [bool; 3] = [true, false, false];
    const BT: [i32; 3] = [0, -1, -1];

    fn seqs(with_ids: bool) -> [TokenSeq<'static>; 2] {
        [
            TokenSeq {
                values: &AV,
                loss_mask: &AM,
                turn_ids: with_ids.then_some(&AT[..]),
            },
            TokenSeq {
                values: &BV,
                loss_mask: &BM,
                turn_ids: with_ids.then_some(&BT[..]),
            },
        ]
    }

    #[test]
    fn advantages_min_max_mean() {
        // Masked values {0.5, 0.5, 0.2, −1.0}: min −1, max 0.5, mean 0.2/4 = 0.05 (by hand).
        let m = advantage_metrics(&seqs(true));
        assert_close(m["critic/advantages/min"], -1.0, TOL, "min");
        assert_close(m["critic/advantages/max"], 0.5, TOL, "max");
        assert_close(m["critic/advantages/mean"], 0.05, TOL, "mean");
    }

    #[test]
    fn envelope_per_turn_position() {
        // Turn 1: {0.5, 0.5, −1} → min −1, max 0.5, mean 0; turn 2: {0.2}. Mask runs agree here.
        for ids in [true, false] {
            let e = advantage_envelope_by_turn(&seqs(ids));
            assert_eq!(e.len(), 2);
            let t1 = e[0].unwrap();
            assert_all_close(&[t1.min, t1.max, t1.mean], &[-1.0, 0.5, 0.0], TOL, "turn 1");
            assert_eq!(t1.count, 3);
            let t2 = e[1].unwrap();
            assert_all_close(&[t2.min, t2.max, t2.mean], &[0.2, 0.2, 0.2], TOL, "turn 2");
        }
        let m = advantage_envelope_metrics(&seqs(true));
        assert_close(m["advantages_by_turn/turn_2/mean"], 0.2, TOL, "metric");
    }

    #[test]
    fn spec_7_turn_kl_entropy() {
        assert_close(turn_kl_entropy(&[0.07, 0.01]).unwrap(), 0.905272, TOL, "H");
        assert_eq!(turn_kl_entropy(&[0.3]), Some(0.0));
        assert_eq!(turn_kl_entropy(&[0.05, -0.05]), None);
        // Batch: [0.905272, 0 (one turn)], third skipped → mean 0.452636; two samples ≤ 1 turn.
        let m = turn_kl_metrics(&[vec![0.07, 0.01], vec![0.2], vec![0.1, -0.1], vec![]]);
        assert_close(
            m["actor/turn_kl_entropy"],
            (0.905272 + 0.0 + 0.0) / 3.0,
            TOL,
            "mean",
        );
        assert_close(m["actor/single_turn_count"], 2.0, TOL, "single");
        assert_eq!(single_turn_count(&[0, 1, 2, 3]), 2);
        // Per-turn sums from tokens (§5.1 trajectory logr): turns (0,3) and (5,7).
        let logr = [0.10, -0.05, 0.02, 0.0, 0.0, 0.01, 0.00];
        let mask = [true, true, true, false, false, true, true];
        let s = turn_logr_sums(&TokenSeq {
            values: &logr,
            loss_mask: &mask,
            turn_ids: None,
        });
        assert_all_close(&s, &[0.07, 0.01], TOL, "turn sums");
    }

    #[test]
    fn explained_variance() {
        // R = [1,2,3,4], V = [1,2,3,3]: Var_u(R − V) = 0.25, Var_u(R) = 5/3 (by hand) →
        // 1 − 0.25/(5/3 + 1e-5) = 0.850001.
        let ev = vf_explained_var(
            &[1.0, 2.0, 3.0, 4.0, 100.0],
            &[1.0, 2.0, 3.0, 3.0, 0.0],
            &[true, true, true, true, false],
        )
        .unwrap();
        assert_close(ev, 1.0 - 0.25 / (5.0 / 3.0 + 1e-5), 1e-12, "explained var");
        assert_close(ev, 0.850001, TOL, "explained var rounded");
        assert_eq!(vf_explained_var(&[1.0], &[1.0], &[true]), None);
    }

    #[test]
    fn staleness_vector() {
        // B_rollout 256, n 5, K̂ 2.5, B_update 256 → δ = 12.5, ρ = 12.5/13.5 = 0.925926.
        let (d, r) = staleness(256, 5, 2.5, 256).unwrap();
        assert_close(d, 12.5, TOL, "delta");
        assert_close(r, 0.925926, TOL, "rho");
        assert!(staleness(1, 1, 1.0, 0).is_none());
        assert_eq!(staleness_metrics(256, 5, 2.5, 256).len(), 2);
    }

    #[test]
    fn context_similarity_vector() {
        // r1 = [{1,2,3}, {4,5}], r2 = [{1,2,4}, {5,6}] (by hand):
        // intra: J({1,2,3},{1,2,4}) = 2/4, J({4,5},{5,6}) = 1/3 → mean 0.416667;
        // cross: J({1,2,3},{5,6}) = 0, J({4,5},{1,2,4}) = 1/4 → mean 0.125.
        let g = vec![vec![
            vec![vec![1, 2, 3], vec![4, 5]],
            vec![vec![1, 2, 4, 4], vec![5, 6]],
        ]];
        let c = context_similarity(&g);
        assert_close(c.intra_position.unwrap(), 0.416667, TOL, "intra");
        assert_close(c.cross_position.unwrap(), 0.125, TOL, "cross");
        assert_eq!((c.intra_pairs, c.cross_pairs), (2, 2));
        assert_eq!(jaccard(&[], &[]), 1.0);
        assert_eq!(context_similarity_metrics(&g).len(), 2);
    }

    #[test]
    fn lengths_coverage_counts() {
        // Lengths [10, 20, 20, 5], max 20 → mean 13.75, max 20, min 5, clip 0.5.
        let m = response_length_metrics(&[10, 20, 20, 5], 20);
        assert_close(m["response_length/mean"], 13.75, TOL, "mean");
        assert_close(m["response_length/max"], 20.0, TOL, "max");
        assert_close(m["response_length/min"], 5.0, TOL, "min");
        assert_close(m["response_length/clip_ratio"], 0.5, TOL, "clip");
        // Coverage: 3 + 1 sampled of 4 + 3 tokens = 4/7.
        assert_close(
            state_token_coverage(&[&AM, &BM]).unwrap(),
            4.0 / 7.0,
            TOL,
            "coverage",
        );
        let c = count_metrics("num_turns", &[1, 2, 3, 2]);
        assert_close(c["num_turns/mean"], 2.0, TOL, "turns mean");
        assert_close(c["num_turns/max"], 3.0, TOL, "turns max");
        let t = count_metrics("tool_call_counts", &[0, 2]);
        assert_close(t["tool_call_counts/min"], 0.0, TOL, "calls min");
    }

    #[test]
    fn ig_and_control_metrics() {
        // IG lists [0.4, 0.2] and [0.0]: turn 1 mean 0.2, turn 2 mean 0.2.
        let m = info_gain_metrics(&[vec![0.4, 0.2], vec![0.0]], 1);
        assert_close(m["info_gain/turn_1/mean"], 0.2, TOL, "ig t1");
        assert_close(m["info_gain/turn_2/mean"], 0.2, TOL, "ig t2");
        assert_close(m["info_gain/probe_failures"], 1.0, TOL, "failures");
        let c = control_metrics(&ControlStats {
            tti_generations: 4,
            tti_triggered: 1,
            tti_forced_tokens: 2,
            tds_regenerations: 3,
            dapo_num_gen_batches: 2,
            dapo_kept_prompts: 6,
            dapo_total_prompts: 8,
        });
        assert_close(c["tti/trigger_rate"], 0.25, TOL, "tti rate");
        assert_close(c["dapo/kept_prompt_fraction"], 0.75, TOL, "kept");
    }

    proptest! {
        #[test]
        fn jaccard_bounded_and_symmetric(a in prop::collection::vec(0u32..20, 0..15), b in prop::collection::vec(0u32..20, 0..15)) {
            let (sa, sb) = (token_set(&a), token_set(&b));
            let x = jaccard(&sa, &sb);
            prop_assert!((0.0..=1.0).contains(&x));
            prop_assert_eq!(x, jaccard(&sb, &sa));
        }
    }
}
