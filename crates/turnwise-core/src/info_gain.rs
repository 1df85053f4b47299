//! Per-turn information gain (spec §4; A2TGPO eq. 2–3, IGPO).
//!
//! ```text
//! p_{i,t}  = exp( (1/L) Σ_j log π(a_j | q, τ_{i,≤t}, a_{<j}) )     a = ground-truth answer tokens
//! ig_{i,t} = p_{i,t} − p_{i,t−1}                                    p_{i,0}: query-only context
//! ```
//!
//! The log-probabilities come from one teacher-forced forward pass per *probe*: the context up to
//! and including observation `o_{i,t}` followed by a pseudo-response that states the ground truth.
//! This module builds the probes as token ids ([`build_probes`], TITO: no re-tokenisation; the
//! suffix is tokenised in three separate parts so the GT span is exact, \[REC\] §4) and turns the
//! GT log-probs into `p` and `ig` ([`info_gains`]).
//!
//! Edge cases:
//! - empty GT span (the GT tokenised to nothing): the probe is skipped, its IG terms are 0 and it
//!   counts as a probe failure (\[REC\] §4 item 5; IGPO would produce NaN);
//! - a rollout cut by the turn limit ends with a tool turn whose observation was appended: \[REC\]
//!   still probes after that last observation so its tool turn gets an IG
//!   ([`TruncatedRolloutRule::ProbeLastObservation`]); IGPO's code never does (§4 item 6).

use std::ops::Range;

use serde::{Deserialize, Serialize};

/// Errors of probe construction.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InfoGainError {
    /// An observation span lies outside the response or out of order.
    #[error(
        "observation {index} spans {start}..{end}, which is not inside the response (length \
         {response_len}) after the previous observation (ending at {prev_end})"
    )]
    BadObservation {
        /// Index of the observation (0-based).
        index: usize,
        /// Span start.
        start: usize,
        /// Span end (exclusive).
        end: usize,
        /// Response length.
        response_len: usize,
        /// End of the previous observation.
        prev_end: usize,
    },
    /// The probe would put the first GT token at position 0, where no log-prob exists.
    #[error(
        "the GT span would start at position 0 of the probe: prompt and suffix prefix are empty"
    )]
    GtAtStart,
}

/// How to treat a rollout that ended because the turn limit was reached right after a tool turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TruncatedRolloutRule {
    /// \[REC\] probe after the last observation too, so the last tool turn gets its IG.
    #[default]
    ProbeLastObservation,
    /// IGPO code: no probe after the last observation (its tool turn gets no IG).
    SkipLastObservation,
}

/// The pseudo-response appended to every probe, tokenised in three separate parts.
///
/// Default text for the boxed schema (\[REC\] §4):
/// `"\nNow there's enough information to answer\n</think>\n<answer>\\boxed{"` + GT + `"}</answer>"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeSuffix<'a> {
    /// Ids of the text before the ground truth.
    pub before_gt: &'a [u32],
    /// Ids of the ground truth (the scored tokens).
    pub gt: &'a [u32],
    /// Ids of the text after the ground truth.
    pub after_gt: &'a [u32],
}

/// Layout of one probe, without materialising its ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbePlan {
    /// Probe index t (0 = query only; t ≥ 1 = after observation `o_t`).
    pub index: usize,
    /// Response tokens kept in the context: `response_ids[..cut]`.
    pub cut: usize,
    /// Total probe length: `prompt + cut + |before| + |gt| + |after|`.
    pub len: usize,
    /// Positions of the GT tokens inside the probe ids: average the log-probs of these positions
    /// (the log-prob of position `k` is predicted from the logits at `k − 1`).
    pub gt_span: Range<usize>,
}

impl ProbePlan {
    /// Writes the probe ids into `out` (cleared first), reusing its allocation.
    pub fn write_ids(
        &self,
        prompt_ids: &[u32],
        response_ids: &[u32],
        suffix: &ProbeSuffix<'_>,
        out: &mut Vec<u32>,
    ) {
        out.clear();
        out.reserve(self.len);
        out.extend_from_slice(prompt_ids);
        out.extend_from_slice(&response_ids[..self.cut]);
        out.extend_from_slice(suffix.before_gt);
        out.extend_from_slice(suffix.gt);
        out.extend_from_slice(suffix.after_gt);
    }

    /// The probe ids as a new vector.
    pub fn ids(
        &self,
        prompt_ids: &[u32],
        response_ids: &[u32],
        suffix: &ProbeSuffix<'_>,
    ) -> Vec<u32> {
        let mut v = Vec::new();
        self.write_ids(prompt_ids, response_ids, suffix, &mut v);
        v
    }
}

/// Plans the probes of one rollout.
///
/// `observations` are the spans (response coordinates, in order) of the environment observations
/// `o_1 … o_m`. Probe 0 keeps the prompt only; probe t keeps `response[..end of o_t]`. When
/// `ended_by_turn_limit` is set and `rule` is [`TruncatedRolloutRule::SkipLastObservation`], the
/// probe after the last observation is dropped (IGPO behaviour).
pub fn build_probes(
    prompt_len: usize,
    response_len: usize,
    observations: &[Range<usize>],
    suffix: &ProbeSuffix<'_>,
    ended_by_turn_limit: bool,
    rule: TruncatedRolloutRule,
) -> Result<Vec<ProbePlan>, InfoGainError> {
    let mut prev_end = 0;
    for (index, o) in observations.iter().enumerate() {
        if o.start > o.end || o.end > response_len || o.start < prev_end {
            return Err(InfoGainError::BadObservation {
                index,
                start: o.start,
                end: o.end,
                response_len,
                prev_end,
            });
        }
        prev_end = o.end;
    }
    let mut n_obs = observations.len();
    if ended_by_turn_limit && rule == TruncatedRolloutRule::SkipLastObservation {
        n_obs = n_obs.saturating_sub(1);
    }
    let suffix_len = suffix.before_gt.len() + suffix.gt.len() + suffix.after_gt.len();
    let cuts = std::iter::once(0).chain(observations[..n_obs].iter().map(|o| o.end));
    cuts.enumerate()
        .map(|(index, cut)| {
            let gt_start = prompt_len + cut + suffix.before_gt.len();
            if gt_start == 0 && !suffix.gt.is_empty() {
                return Err(InfoGainError::GtAtStart);
            }
            Ok(ProbePlan {
                index,
                cut,
                len: prompt_len + cut + suffix_len,
                gt_span: gt_start..gt_start + suffix.gt.len(),
            })
        })
        .collect()
}

/// Builds probe ids for a whole rollout (convenience over [`build_probes`] + [`ProbePlan::ids`]).
pub fn build_probe_ids(
    prompt_ids: &[u32],
    response_ids: &[u32],
    observations: &[Range<usize>],
    suffix: &ProbeSuffix<'_>,
    ended_by_turn_limit: bool,
    rule: TruncatedRolloutRule,
) -> Result<Vec<(ProbePlan, Vec<u32>)>, InfoGainError> {
    let plans = build_probes(
        prompt_ids.len(),
        response_ids.len(),
        observations,
        suffix,
        ended_by_turn_limit,
        rule,
    )?;
    Ok(plans
        .into_iter()
        .map(|p| {
            let ids = p.ids(prompt_ids, response_ids, suffix);
            (p, ids)
        })
        .collect())
}

/// `p = exp(mean(log-probs))` of the GT tokens; `None` for an empty GT span.
pub fn answer_probability(gt_logprobs: &[f64]) -> Option<f64> {
    if gt_logprobs.is_empty() {
        return None;
    }
    Some((gt_logprobs.iter().sum::<f64>() / gt_logprobs.len() as f64).exp())
}

/// Probe probabilities and information gains of one rollout.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct InfoGain {
    /// `p_t` per probe (`None` where the GT span was empty).
    pub probabilities: Vec<Option<f64>>,
    /// `ig_t = p_t − p_{t−1}` for t = 1 … (#probes − 1); 0 where either probe failed.
    pub gains: Vec<f64>,
    /// Probes skipped because their GT span was empty (metric "IG probe failures").
    pub probe_failures: usize,
}

/// Computes `p_t` and `ig_t` from each probe's GT-token log-probs (probe 0 first).
pub fn info_gains<S: AsRef<[f64]>>(probe_gt_logprobs: &[S]) -> InfoGain {
    let probabilities: Vec<Option<f64>> = probe_gt_logprobs
        .iter()
        .map(|lp| answer_probability(lp.as_ref()))
        .collect();
    let probe_failures = probabilities.iter().filter(|p| p.is_none()).count();
    let gains = probabilities
        .windows(2)
        .map(|w| match (w[0], w[1]) {
            (Some(a), Some(b)) => b - a,
            _ => 0.0,
        })
        .collect();
    InfoGain {
        probabilities,
        gains,
        probe_failures,
    }
}

/// Extracts the GT log-probs of a probe from per-position log-probs of its ids
/// (`token_logprobs[k]` = log-prob of id `k`, as returned by a teacher-forced pass).
pub fn gt_logprobs<'a>(plan: &ProbePlan, token_logprobs: &'a [f64]) -> &'a [f64] {
    &token_logprobs[plan.gt_span.clone()]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{TOL, assert_all_close};

    #[test]
    fn spec_4_vector() {
        let ig = info_gains(&[vec![-2.0, -1.0], vec![-0.5, -0.3], vec![-0.1, -0.1]]);
        let p: Vec<f64> = ig.probabilities.iter().map(|p| p.unwrap()).collect();
        assert_all_close(&p, &[0.22313, 0.67032, 0.904837], TOL, "p");
        assert_all_close(&ig.gains, &[0.44719, 0.234517], TOL, "ig");
        assert_eq!(ig.probe_failures, 0);
    }

    #[test]
    fn empty_gt_span_is_skipped_and_counted() {
        let ig = info_gains(&[vec![-1.0], vec![], vec![-0.5]]);
        assert_eq!(ig.probe_failures, 1);
        assert_eq!(ig.gains, vec![0.0, 0.0]);
        assert!(info_gains::<Vec<f64>>(&[]).gains.is_empty());
    }

    #[test]
    fn probe_layout_ids_and_spans() {
        // prompt [1,2]; response: turn1 [10,11], obs1 [90,91], turn2 [12], obs2 [92], final [13].
        let prompt = [1, 2];
        let response = [10, 11, 90, 91, 12, 92, 13];
        let obs = [2..4, 5..6];
        let suffix = ProbeSuffix {
            before_gt: &[7, 8],
            gt: &[50, 51],
            after_gt: &[9],
        };
        let probes = build_probe_ids(
            &prompt,
            &response,
            &obs,
            &suffix,
            false,
            TruncatedRolloutRule::default(),
        )
        .unwrap();
        assert_eq!(probes.len(), 3);
        assert_eq!(probes[0].1, vec![1, 2, 7, 8, 50, 51, 9]);
        assert_eq!(probes[0].0.gt_span, 4..6);
        assert_eq!(probes[1].1, vec![1, 2, 10, 11, 90, 91, 7, 8, 50, 51, 9]);
        assert_eq!(probes[1].0.gt_span, 8..10);
        assert_eq!(probes[2].0.cut, 6);
        assert_eq!(probes[2].0.len, 2 + 6 + 5);
        for (plan, ids) in &probes {
            assert_eq!(&ids[plan.gt_span.clone()], &[50, 51]);
            assert_eq!(ids.len(), plan.len);
        }
        let lp: Vec<f64> = (0..11).map(|k| -(k as f64)).collect();
        assert_eq!(gt_logprobs(&probes[1].0, &lp), &[-8.0, -9.0]);
    }

    #[test]
    fn turn_limit_rule() {
        // Rollout cut by the turn limit: turn1, obs1, turn2, obs2 (no final answer).
        let obs = [2..4, 5..6];
        let suffix = ProbeSuffix {
            before_gt: &[7],
            gt: &[50],
            after_gt: &[],
        };
        let rec = build_probes(
            2,
            6,
            &obs,
            &suffix,
            true,
            TruncatedRolloutRule::ProbeLastObservation,
        )
        .unwrap();
        assert_eq!(rec.len(), 3, "IG for both tool turns");
        let igpo = build_probes(
            2,
            6,
            &obs,
            &suffix,
            true,
            TruncatedRolloutRule::SkipLastObservation,
        )
        .unwrap();
        assert_eq!(igpo.len(), 2, "IGPO drops the last tool turn's IG");
        assert!(build_probes(2, 5, &obs, &suffix, false, TruncatedRolloutRule::default()).is_err());
        assert!(
            build_probes(
                2,
                6,
                &[3..4, 2..3],
                &suffix,
                false,
                TruncatedRolloutRule::default()
            )
            .is_err()
        );
        let bare = ProbeSuffix {
            before_gt: &[],
            gt: &[5],
            after_gt: &[],
        };
        assert_eq!(
            build_probes(0, 0, &[], &bare, false, TruncatedRolloutRule::default()),
            Err(InfoGainError::GtAtStart)
        );
    }
}
