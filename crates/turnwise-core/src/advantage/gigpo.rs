//! §3.7 GiGPO step advantages \[CODE GIGPO `compute_gigpo_outcome_advantage`\] and the T2PO fusion
//! \[PAPER t2po.md §4.4, App. B.4\].
//!
//! One training sample per (trajectory, step); here a step is an agent turn of the rollout, so
//! `step_rewards` and `anchors` have one entry per turn and every turn's tokens get that step's
//! advantage:
//!
//! 1. Episode term (eq. 3): episode reward `s = Σ_k r_k`, normalized in the prompt group, with
//!    mean/std over all step samples (`cross_steps`, default) or over trajectories;
//!    `mean_std_norm` `(s − mean)/(std_u + ε)` or `mean_norm` `s − mean`; singleton: mean 0, std 1.
//! 2. Step returns (eq. 5): `R_k = Σ_{j≥k} γ^{j−k} r_j`, then minus step k's own penalty
//!    ([`Rollout::step_penalties`](super::Rollout), verl-agent's invalid-action penalty, which
//!    it takes off the discounted return of that step only).
//! 3. Anchor groups (eq. 6): identical anchors, or greedy clustering by
//!    `SequenceMatcher(None, anchor, representative).ratio() ≥ thresh`, within each anchor
//!    scope ([`Rollout::anchor_scopes`](super::Rollout), when given): steps of different scopes
//!    never share a group.
//! 4. Step term (eq. 7): same normalization of `R_k` within an anchor group; singleton → 0.
//! 5. Joint (eq. 8): `A = A_episode + w · A_step`.
//!
//! T2PO paper variant (`episode_term = "discounted_return"`, §9 item 9): the episode term
//! normalizes the discounted return `R(τ^k_i)` over the rollouts of the group that reach step k.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::range::{self, Range, RangeError};

use super::contract::{self, MetricDoc, Metrics, Needs, StepSamples};
use super::difflib::sequence_ratio;
use super::error::settings_result;
use super::input::{check_len, validate_common};
use super::kernels::{
    GroupNorm, Singleton, StdKind, discounted_suffix_sums, group_indices, normalize_by_key,
};
use super::output::turn_constant;
use super::{AdvantageBatch, AdvantageError, AdvantageOutput, Channel, Estimator};

/// GiGPO normalization mode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GigpoNorm {
    /// `(x − mean) / (std_u + ε)`.
    #[default]
    MeanStdNorm,
    /// `x − mean`.
    MeanNorm,
}

/// What the episode (outcome) term normalizes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EpisodeTerm {
    /// GiGPO code: the undiscounted episode reward `Σ_k r_k` (recommended, \[REC\]).
    #[default]
    EpisodeReward,
    /// T2PO paper: the discounted return at step k, normalized over the rollouts reaching k.
    DiscountedReturn,
}

macro_rules! gigpo_settings {
    ($(#[$meta:meta])* $name:ident, $est:literal, sim = $sim:expr, thresh = $thresh:expr, invalid = $inv:expr) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(default, deny_unknown_fields)]
        pub struct $name {
            /// Step discount γ (0.95).
            pub gamma: f64,
            /// Weight ω / `step_advantage_w` of the step term (1.0).
            pub step_advantage_w: f64,
            /// Normalization mode.
            pub mode: GigpoNorm,
            /// ε added to the std (1e-6).
            pub epsilon: f64,
            /// Episode mean/std over all step samples (`compute_mean_std_cross_steps`, true)
            /// or over trajectories.
            pub cross_steps: bool,
            /// Cluster anchors by similarity instead of identity.
            pub enable_similarity: bool,
            /// Similarity threshold in (0, 1).
            pub similarity_thresh: f64,
            /// Episode term variant.
            pub episode_term: EpisodeTerm,
            /// verl-agent's invalid-action penalty (`invalid_action_penalty_coef`): the trainer
            /// lowers the step reward and the episode score of every step sample whose action
            /// was invalid by this much (only that step's sample, spec §2.6, §10), through
            /// [`Rollout::step_rewards`](super::Rollout) and
            /// [`Rollout::step_scores`](super::Rollout).
            pub invalid_action_penalty: f64,
        }

        impl Default for $name {
            fn default() -> Self {
                Self {
                    gamma: 0.95,
                    step_advantage_w: 1.0,
                    mode: GigpoNorm::MeanStdNorm,
                    epsilon: 1e-6,
                    cross_steps: true,
                    enable_similarity: $sim,
                    similarity_thresh: $thresh,
                    episode_term: EpisodeTerm::EpisodeReward,
                    invalid_action_penalty: $inv,
                }
            }
        }

        impl Estimator for $name {
            fn name(&self) -> &'static str {
                $est
            }

            fn validate(&self) -> Result<(), AdvantageError> {
                let mut p = Vec::new();
                Range::UnitInterval.check(&mut p, "gamma", self.gamma);
                Range::StdEpsilon.check(&mut p, "epsilon", self.epsilon);
                check_similarity_thresh(&mut p, self.similarity_thresh);
                settings_result($est, p)
            }

            fn needs(&self) -> Needs {
                Needs {
                    step_rewards: true,
                    ..Needs::default()
                }
            }

            fn emits(&self) -> &'static [Channel] {
                &[Channel::StepGroup, Channel::StepGroupSize]
            }

            fn step_samples(&self) -> Option<StepSamples> {
                Some(StepSamples {
                    invalid_action_penalty: self.invalid_action_penalty,
                    similarity: self.enable_similarity.then_some(self.similarity_thresh),
                    pooled_step_scores: self.cross_steps
                        && self.episode_term == EpisodeTerm::EpisodeReward,
                })
            }

            fn metrics(&self, batch: &AdvantageBatch, _out: &AdvantageOutput) -> Metrics {
                contract::anchor_group_metrics(batch)
            }

            fn metric_docs(&self) -> &'static [MetricDoc] {
                &[
                    MetricDoc {
                        key: "gigpo/anchor_group/group_size/mean",
                        label: "anchor-group size",
                    },
                    MetricDoc {
                        key: "gigpo/anchor_group/singleton_share",
                        label: "anchor singletons",
                    },
                ]
            }

            fn estimate(&self, batch: &AdvantageBatch) -> Result<AdvantageOutput, AdvantageError> {
                self.validate()?;
                let s = GigpoSettings {
                    gamma: self.gamma,
                    step_advantage_w: self.step_advantage_w,
                    mode: self.mode,
                    epsilon: self.epsilon,
                    cross_steps: self.cross_steps,
                    similarity: self.enable_similarity.then_some(self.similarity_thresh),
                    episode_term: self.episode_term,
                };
                gigpo_estimate($est, batch, &s)
            }
        }
    };
}

gigpo_settings!(
    /// Settings of `gigpo` (verl-agent defaults: exact anchors, threshold 0.95 when enabled).
    GigpoConfig, "gigpo", sim = false, thresh = 0.95, invalid = 0.1
);
gigpo_settings!(
    /// Settings of `t2po` (T2PO search scripts: GiGPO with similarity grouping at 0.9, γ 0.95,
    /// `mean_std_norm`, ω = 1).
    /// T2PO's format penalty comes from its reward (`t2po_em`, spec §2.6), so the estimator's
    /// own invalid-action penalty defaults to 0 here.
    T2poConfig, "t2po", sim = true, thresh = 0.9, invalid = 0.0
);

/// `similarity_thresh` lies strictly between 0 and 1: a ratio of 0 would join every anchor to
/// the first cluster and one of 1 only identical anchors, which `enable_similarity = false` does
/// exactly. Checked whether or not similarity is on, as the field states its range.
fn check_similarity_thresh(problems: &mut Vec<RangeError>, t: f64) {
    range::check(
        problems,
        t > 0.0 && t < 1.0,
        "similarity_thresh",
        "in (0, 1), both ends excluded (set advantage.enable_similarity = false to match anchors \
         exactly)",
        t,
    );
}

struct GigpoSettings {
    gamma: f64,
    step_advantage_w: f64,
    mode: GigpoNorm,
    epsilon: f64,
    cross_steps: bool,
    similarity: Option<f64>,
    episode_term: EpisodeTerm,
}

impl GigpoSettings {
    fn norm(&self, singleton: Singleton) -> GroupNorm {
        GroupNorm {
            std: match self.mode {
                GigpoNorm::MeanStdNorm => Some(StdKind::Unbiased),
                GigpoNorm::MeanNorm => None,
            },
            epsilon: self.epsilon,
            singleton,
        }
    }
}

/// Anchor-state clusters of one prompt group (eq. 6), as cluster ids in first-appearance order.
/// `similarity = None`: identical anchors; `Some(thresh)`: each anchor joins the first cluster
/// whose representative (first member) `r` has `ratio(anchor, r) ≥ thresh`.
pub fn anchor_clusters(anchors: &[&str], similarity: Option<f64>) -> Vec<usize> {
    match similarity {
        None => {
            let mut ids: HashMap<&str, usize> = HashMap::new();
            anchors
                .iter()
                .map(|a| {
                    let next = ids.len();
                    *ids.entry(a).or_insert(next)
                })
                .collect()
        }
        Some(thresh) => {
            let mut reps: Vec<&str> = Vec::new();
            anchors
                .iter()
                .map(
                    |&a| match reps.iter().position(|r| sequence_ratio(a, r) >= thresh) {
                        Some(c) => c,
                        None => {
                            reps.push(a);
                            reps.len() - 1
                        }
                    },
                )
                .collect()
        }
    }
}

fn gigpo_estimate(
    name: &'static str,
    batch: &AdvantageBatch,
    s: &GigpoSettings,
) -> Result<AdvantageOutput, AdvantageError> {
    validate_common(name, batch)?;
    for (i, r) in batch.rollouts.iter().enumerate() {
        check_len(name, i, "step_rewards", r.step_rewards.len(), r.num_turns)?;
        check_len(name, i, "anchors", r.anchors.len(), r.num_turns)?;
        if !r.anchor_scopes.is_empty() {
            check_len(name, i, "anchor_scopes", r.anchor_scopes.len(), r.num_turns)?;
        }
        if let Some(v) = &r.step_scores {
            check_len(name, i, "step_scores", v.len(), r.num_turns)?;
        }
        if !r.step_penalties.is_empty() {
            check_len(
                name,
                i,
                "step_penalties",
                r.step_penalties.len(),
                r.num_turns,
            )?;
        }
    }
    // Episode score of step sample (i, k): `step_scores[k]`, default Σ_j r_j.
    let score = |i: usize, k: usize| -> f64 {
        let r = &batch.rollouts[i];
        match &r.step_scores {
            Some(v) => v[k],
            None => r.step_rewards.iter().sum(),
        }
    };
    // Step samples in trajectory-major order (verl-agent gathers them that way).
    let mut owner = Vec::new();
    let mut step = Vec::new();
    let mut returns = Vec::new();
    for (i, r) in batch.rollouts.iter().enumerate() {
        for (k, ret) in discounted_suffix_sums(&r.step_rewards, s.gamma)
            .into_iter()
            .enumerate()
        {
            owner.push(i);
            step.push(k);
            // After discounting: the penalty lowers this step's return only.
            returns.push(ret - r.step_penalties.get(k).copied().unwrap_or(0.0));
        }
    }
    let group = |j: usize| batch.rollouts[owner[j]].group;
    let n = owner.len();

    // Episode term.
    let ep_norm = s.norm(Singleton::MeanZeroStdOne);
    let episode: Vec<f64> = match (s.episode_term, s.cross_steps) {
        (EpisodeTerm::EpisodeReward, true) => {
            let scores: Vec<f64> = (0..n).map(|j| score(owner[j], step[j])).collect();
            let keys: Vec<usize> = (0..n).map(group).collect();
            normalize_by_key(&scores, &keys, |x| ep_norm.apply(x))
        }
        (EpisodeTerm::EpisodeReward, false) => {
            // Statistics over one score per trajectory (VERL-agent keeps the first sample it
            // meets of every trajectory); every sample is then normalized with its own score.
            let firsts: Vec<usize> = (0..n).filter(|&j| step[j] == 0).collect();
            let keys: Vec<usize> = firsts.iter().map(|&j| group(j)).collect();
            let mut stats = HashMap::new();
            for (g, idx) in group_indices(&keys) {
                let pool: Vec<f64> = idx.iter().map(|&f| score(owner[firsts[f]], 0)).collect();
                stats.insert(g, ep_norm.stats(&pool));
            }
            (0..n)
                .map(|j| ep_norm.normalize_with(score(owner[j], step[j]), stats[&group(j)]))
                .collect()
        }
        (EpisodeTerm::DiscountedReturn, _) => {
            let keys: Vec<(usize, usize)> = (0..n).map(|j| (group(j), step[j])).collect();
            normalize_by_key(&returns, &keys, |x| ep_norm.apply(x))
        }
    };

    // Step term: anchor clusters inside every prompt group and anchor scope.
    let mut cluster = vec![0usize; n];
    let scopes: Vec<(usize, &str)> = (0..n)
        .map(|j| {
            let r = &batch.rollouts[owner[j]];
            (
                group(j),
                r.anchor_scopes.get(step[j]).map_or("", String::as_str),
            )
        })
        .collect();
    for idx in group_indices(&scopes).into_values() {
        let anchors: Vec<&str> = idx
            .iter()
            .map(|&j| batch.rollouts[owner[j]].anchors[step[j]].as_str())
            .collect();
        for (&j, c) in idx.iter().zip(anchor_clusters(&anchors, s.similarity)) {
            cluster[j] = c;
        }
    }
    let keys: Vec<(usize, &str, usize)> = (0..n)
        .map(|j| (scopes[j].0, scopes[j].1, cluster[j]))
        .collect();
    let st_norm = s.norm(Singleton::Zero);
    let step_adv = normalize_by_key(&returns, &keys, |x| st_norm.apply(x));
    let (group_ids, group_sizes) = step_group_channels(&keys);

    let per_rollout = |values: &dyn Fn(usize) -> f64| {
        let mut per_turn: Vec<Vec<f64>> = batch
            .rollouts
            .iter()
            .map(|r| vec![0.0; r.num_turns])
            .collect();
        for j in 0..n {
            per_turn[owner[j]][step[j]] = values(j);
        }
        per_turn
    };
    let advantages = per_rollout(&|j| episode[j] + s.step_advantage_w * step_adv[j]);
    let ids = per_rollout(&|j| group_ids[j] as f64);
    let sizes = per_rollout(&|j| group_sizes[j] as f64);
    Ok(AdvantageOutput {
        estimator: name.to_string(),
        rollouts: batch
            .rollouts
            .iter()
            .zip(advantages)
            .zip(ids.into_iter().zip(sizes))
            .map(|((r, t), (id, size))| {
                let mut out = turn_constant(&r.turn_id, t);
                out.channels.insert(Channel::StepGroup, id);
                out.channels.insert(Channel::StepGroupSize, size);
                out
            })
            .collect(),
        trees: Vec::new(),
    })
}

/// The anchor group of every step sample (its key: prompt group, anchor scope, cluster), as
/// ([`Channel::StepGroup`]) the group's id, numbered in first appearance over `keys` (the step
/// samples in trajectory-major order), and ([`Channel::StepGroupSize`]) its size in step samples.
fn step_group_channels<K: Eq + std::hash::Hash + Copy>(keys: &[K]) -> (Vec<usize>, Vec<usize>) {
    let mut sizes: HashMap<K, usize> = HashMap::new();
    for &k in keys {
        *sizes.entry(k).or_default() += 1;
    }
    let mut ids: HashMap<K, usize> = HashMap::new();
    keys.iter()
        .map(|k| {
            let next = ids.len();
            (*ids.entry(*k).or_insert(next), sizes[k])
        })
        .unzip()
}

#[cfg(test)]
// The spec vectors (§3.7) contain 1/√2 − O(ε) written as 0.707106; keep them literal.
#[allow(clippy::approx_constant)]
mod tests {
    use super::*;
    use crate::advantage::Rollout;
    use crate::test_util::{TOL, assert_all_close};

    const INFO1: &str = "doc: Paris is capital of France";

    fn example() -> AdvantageBatch {
        let a = Rollout::new(0, vec![0, 0, -1, 1, -1, 2], 1.0).with_steps(
            vec![0.0, 0.0, 1.0],
            vec!["Q".into(), INFO1.into(), "doc: Eiffel tower 1889".into()],
        );
        let b = Rollout::new(0, vec![0, -1, 1, 1], 0.0)
            .with_steps(vec![0.0, 0.0], vec!["Q".into(), format!("{INFO1}.")]);
        AdvantageBatch::new(vec![a, b])
    }

    fn flat(out: &AdvantageOutput) -> Vec<f64> {
        out.rollouts.iter().flat_map(|r| r.turns.clone()).collect()
    }

    /// Per rollout, the (id, size) of each step's anchor group as the channels carry them.
    fn step_groups(out: &AdvantageOutput) -> Vec<Vec<(f64, f64)>> {
        out.rollouts
            .iter()
            .map(|r| {
                let ids = &r.channels[&Channel::StepGroup];
                let sizes = &r.channels[&Channel::StepGroupSize];
                ids.iter().copied().zip(sizes.iter().copied()).collect()
            })
            .collect()
    }

    #[test]
    fn the_anchor_groups_it_normalised_in_are_emitted_per_step() {
        // Exact anchors: "Q" is shared, the two INFO1 spellings are not.
        let exact = GigpoConfig::default().estimate(&example()).unwrap();
        assert_eq!(
            step_groups(&exact),
            [
                vec![(0.0, 2.0), (1.0, 1.0), (2.0, 1.0)],
                vec![(0.0, 2.0), (3.0, 1.0)]
            ]
        );
        // T2PO's similarity 0.9 joins INFO1 and "INFO1.", so the step term of those two steps
        // is normalised in a group of two (eq. 6).
        let similar = T2poConfig::default().estimate(&example()).unwrap();
        assert_eq!(
            step_groups(&similar),
            [
                vec![(0.0, 2.0), (1.0, 2.0), (2.0, 1.0)],
                vec![(0.0, 2.0), (1.0, 2.0)]
            ]
        );
        // Anchor scopes split a group: the same anchor in two scopes is two groups.
        let mut batch = example();
        batch.rollouts[0].anchor_scopes = vec!["a".into(); 3];
        batch.rollouts[1].anchor_scopes = vec!["b".into(); 2];
        let scoped = GigpoConfig::default().estimate(&batch).unwrap();
        assert_eq!(step_groups(&scoped)[1][0], (3.0, 1.0));
    }

    #[test]
    fn spec_3_7_exact_anchors() {
        let anchors = [
            "Q",
            INFO1,
            "doc: Eiffel tower 1889",
            "Q",
            "doc: Paris is capital of France.",
        ];
        assert_eq!(anchor_clusters(&anchors, None), vec![0, 1, 2, 0, 3]);
        let out = GigpoConfig::default().estimate(&example()).unwrap();
        assert_all_close(
            &flat(&out),
            &[1.437401, 0.730295, 0.730295, -1.802549, -1.095443],
            TOL,
            "joint (exact)",
        );
        // tokens: step advantages broadcast over each turn, observations 0
        let (x, y) = (1.437401, 0.730295);
        assert_all_close(
            &out.rollouts[0].tokens,
            &[x, x, 0.0, y, 0.0, y],
            TOL,
            "tokens",
        );
    }

    #[test]
    fn spec_3_7_step_and_episode_terms() {
        // ω = 0 leaves the episode term; the step term is the difference to the joint value.
        let ep = GigpoConfig {
            step_advantage_w: 0.0,
            ..GigpoConfig::default()
        };
        let e = flat(&ep.estimate(&example()).unwrap());
        assert_all_close(
            &e,
            &[0.730295, 0.730295, 0.730295, -1.095443, -1.095443],
            TOL,
            "episode",
        );
        let joint = flat(&GigpoConfig::default().estimate(&example()).unwrap());
        let step: Vec<f64> = joint.iter().zip(&e).map(|(j, e)| j - e).collect();
        assert_all_close(
            &step,
            &[0.707106, 0.0, 0.0, -0.707106, 0.0],
            TOL,
            "step (exact)",
        );
        let per_traj = GigpoConfig {
            step_advantage_w: 0.0,
            cross_steps: false,
            ..GigpoConfig::default()
        };
        let e = flat(&per_traj.estimate(&example()).unwrap());
        assert_all_close(
            &e,
            &[0.707106, 0.707106, 0.707106, -0.707106, -0.707106],
            TOL,
            "per-traj",
        );
    }

    #[test]
    fn spec_3_7_similarity_anchors() {
        let anchors = [
            "Q",
            INFO1,
            "doc: Eiffel tower 1889",
            "Q",
            "doc: Paris is capital of France.",
        ];
        assert_eq!(anchor_clusters(&anchors, Some(0.9)), vec![0, 1, 2, 0, 1]);
        let out = T2poConfig::default().estimate(&example()).unwrap();
        assert_all_close(
            &flat(&out),
            &[1.437401, 1.437401, 0.730295, -1.802549, -1.802549],
            TOL,
            "joint (similarity 0.9)",
        );
    }

    #[test]
    fn anchor_scopes_keep_groups_apart() {
        // The spec example with step 1 of `b` in another scope: its anchor (INFO1 + ".") no
        // longer joins step 1 of `a` under similarity, and with one scope per step index the
        // exact step-0 anchors `Q` still group (same scope). A scope on `a` only of the wrong
        // length is refused.
        let scoped = |mut batch: AdvantageBatch| {
            batch.rollouts[0].anchor_scopes = vec!["0".into(), "1".into(), "2".into()];
            batch.rollouts[1].anchor_scopes = vec!["0".into(), "1 after x".into()];
            batch
        };
        let out = flat(&T2poConfig::default().estimate(&scoped(example())).unwrap());
        // Exact-anchor values (the similarity group of steps 1 is split by the scopes).
        assert_all_close(
            &out,
            &[1.437401, 0.730295, 0.730295, -1.802549, -1.095443],
            TOL,
            "joint (similarity 0.9, scoped)",
        );
        let mut batch = example();
        batch.rollouts[0].anchor_scopes = vec!["0".into()];
        let err = GigpoConfig::default().estimate(&batch).unwrap_err();
        assert!(matches!(
            err,
            AdvantageError::LengthMismatch {
                rollout: 0,
                field: "anchor_scopes",
                ..
            }
        ));
    }

    #[test]
    fn t2po_paper_episode_term() {
        // Discounted returns per step: step 0 {0.9025, 0} → ±0.707106; step 1 {0.95, 0} →
        // ±0.707106; step 2 {1.0} singleton → 1.0 / (1 + ε).
        let cfg = T2poConfig {
            step_advantage_w: 0.0,
            episode_term: EpisodeTerm::DiscountedReturn,
            ..T2poConfig::default()
        };
        let e = flat(&cfg.estimate(&example()).unwrap());
        assert_all_close(
            &e,
            &[0.707106, 0.707106, 1.0, -0.707106, -0.707106],
            TOL,
            "paper",
        );
    }

    #[test]
    fn per_step_scores_override_episode_reward() {
        // Step 1 of trajectory b was invalid: only that sample's episode score drops by 0.1.
        let mut batch = example();
        batch.rollouts[1].step_scores = Some(vec![0.0, -0.1]);
        let cfg = GigpoConfig {
            step_advantage_w: 0.0,
            ..GigpoConfig::default()
        };
        let e = flat(&cfg.estimate(&batch).unwrap());
        let s = [1.0, 1.0, 1.0, 0.0, -0.1];
        let m = s.iter().sum::<f64>() / 5.0;
        let sd = (s.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / 4.0).sqrt();
        let exp: Vec<f64> = s.iter().map(|x| (x - m) / (sd + 1e-6)).collect();
        assert_all_close(&e, &exp, 1e-12, "penalized episode term");
    }

    /// The invalid-step penalty lowers only its own step's discounted return (verl-agent), not
    /// the earlier steps' returns: with a penalty of 0.5 on trajectory a's last step, step 0's
    /// return stays 0.9025 (subtracted before discounting it would be 0.9025 − 0.9025·0.5).
    #[test]
    fn step_penalties_apply_after_discounting() {
        let cfg = GigpoConfig {
            mode: GigpoNorm::MeanNorm,
            step_advantage_w: 1.0,
            ..GigpoConfig::default()
        };
        let mut batch = example();
        // Episode scores unchanged, so the episode term is the mean_norm_mode one.
        batch.rollouts[0].step_penalties = vec![0.0, 0.0, 0.5];
        let j = flat(&cfg.estimate(&batch).unwrap());
        // Step 0 group {0.9025, 0}: ±0.45125 as without a penalty; step 2 is a singleton.
        assert_all_close(
            &j,
            &[0.4 + 0.45125, 0.4, 0.4, -0.6 - 0.45125, -0.6],
            TOL,
            "penalty after discounting",
        );
        // A penalty on b's last step, with similarity grouping so that a's and b's step 1 share
        // a group (exact anchors make them singletons): b1's return is −0.5, a1's 0.95.
        let sim = GigpoConfig {
            enable_similarity: true,
            ..cfg
        };
        let mut batch = example();
        batch.rollouts[1].step_penalties = vec![0.0, 0.5];
        let j = flat(&sim.estimate(&batch).unwrap());
        // Step 0 {0.9025, 0} (b's step 0 keeps return 0), step 1 {0.95, −0.5}: ±0.725.
        assert_all_close(
            &j,
            &[
                0.4 + 0.45125,
                0.4 + 0.725,
                0.4,
                -0.6 - 0.45125,
                -0.6 - 0.725,
            ],
            TOL,
            "b's step 0 keeps its return",
        );
        batch.rollouts[1].step_penalties = vec![0.5];
        assert!(sim.estimate(&batch).is_err(), "one penalty per step");
    }

    #[test]
    fn mean_norm_mode() {
        let cfg = GigpoConfig {
            mode: GigpoNorm::MeanNorm,
            ..GigpoConfig::default()
        };
        // episode: s − 0.6; step (exact): group {0.9025, 0} centered ±0.45125, others 0.
        let j = flat(&cfg.estimate(&example()).unwrap());
        assert_all_close(
            &j,
            &[0.4 + 0.45125, 0.4, 0.4, -0.6 - 0.45125, -0.6],
            TOL,
            "mean_norm",
        );
    }

    #[test]
    fn inputs_checked() {
        let mut batch = example();
        batch.rollouts[1].anchors.pop();
        let err = GigpoConfig::default().estimate(&batch).unwrap_err();
        assert!(matches!(
            err,
            AdvantageError::LengthMismatch {
                rollout: 1,
                field: "anchors",
                ..
            }
        ));
        let cfg = T2poConfig {
            similarity_thresh: 1.0,
            ..T2poConfig::default()
        };
        assert!(matches!(
            cfg.estimate(&example()),
            Err(AdvantageError::InvalidSettings { .. })
        ));
    }
}
