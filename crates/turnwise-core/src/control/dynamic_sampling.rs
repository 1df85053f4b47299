//! DAPO dynamic sampling (spec §6.4; DAPO recipe `dapo_ray_trainer.py`, verl-agent
//! `filter_group_data`).
//!
//! DAPO: per prompt uid, `std = population std` of a metric over the group's trajectories; keep
//! the group iff `std > 0` or it has a single trajectory ([`keep_group`], [`filter_groups`]).
//! Generation batches are accumulated until `train_batch_size` prompts are kept, then truncated
//! to `train_batch_size · n` trajectories; `max_num_gen_batches ≤ 0` means unlimited, otherwise
//! running out is an error ([`DynamicSamplingAccumulator`]).
//!
//! verl-agent (GiGPO + DAPO): contiguous groups of `group_n`; keep a group iff its rewards are not
//! all equal (`np.all(r == r[0])`); on the last try keep non-uniform groups first and fill up with
//! uniform ones in order ([`filter_groups_verl_agent`]).

use std::collections::HashMap;
use std::hash::Hash;

use serde::{Deserialize, Serialize};

use super::ControlError;

/// Which per-trajectory metric the DAPO filter looks at (`algorithm.filter_groups.metric`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DapoMetric {
    /// Accuracy (e.g. EM ∈ {0, 1}).
    Acc,
    /// Outcome score.
    Score,
    /// Σ of token-level scores (AEPO/ATPO scripts).
    #[default]
    SeqReward,
    /// Σ of token-level rewards after the KL penalty.
    SeqFinalReward,
}

impl DapoMetric {
    /// The metric's config name (`acc`, `score`, `seq_reward`, `seq_final_reward`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Acc => "acc",
            Self::Score => "score",
            Self::SeqReward => "seq_reward",
            Self::SeqFinalReward => "seq_final_reward",
        }
    }
}

/// Population standard deviation (numpy `np.std`); 0 for an empty slice and, exactly, for a slice
/// of identical values (\[REC\]: numpy can return ~1e-17 there through round-off in the mean, which
/// would wrongly keep a uniform group).
pub fn population_std(values: &[f64]) -> f64 {
    let Some(&first) = values.first() else {
        return 0.0;
    };
    if values.iter().all(|&v| v == first) {
        return 0.0;
    }
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    (values.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n).sqrt()
}

/// DAPO keep rule: `std > 0` or a single trajectory (an empty group is dropped).
pub fn keep_group(values: &[f64]) -> bool {
    values.len() == 1 || population_std(values) > 0.0
}

/// Result of filtering one generation batch.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GroupFilter<K> {
    /// Kept prompt uids in first-appearance order.
    pub kept_uids: Vec<K>,
    /// Indices of the kept trajectories, in batch order.
    pub kept_indices: Vec<usize>,
    /// Number of distinct prompts in the batch.
    pub total_prompts: usize,
}

/// Applies the DAPO keep rule per prompt uid (`uids[i]` and `values[i]` describe trajectory i).
pub fn filter_groups<K: Eq + Hash + Clone>(
    uids: &[K],
    values: &[f64],
) -> Result<GroupFilter<K>, ControlError> {
    if uids.len() != values.len() {
        return Err(ControlError::LengthMismatch {
            what: "values",
            got: values.len(),
            expected: uids.len(),
        });
    }
    let mut order: Vec<K> = Vec::new();
    let mut groups: HashMap<&K, Vec<f64>> = HashMap::new();
    for (u, &v) in uids.iter().zip(values) {
        groups
            .entry(u)
            .or_insert_with(|| {
                order.push(u.clone());
                Vec::new()
            })
            .push(v);
    }
    let keep: HashMap<&K, bool> = groups.iter().map(|(k, v)| (*k, keep_group(v))).collect();
    let kept_indices = uids
        .iter()
        .enumerate()
        .filter(|(_, u)| keep[u])
        .map(|(i, _)| i)
        .collect();
    let total_prompts = order.len();
    let kept_uids = order.into_iter().filter(|u| keep[u]).collect();
    Ok(GroupFilter {
        kept_uids,
        kept_indices,
        total_prompts,
    })
}

/// What the caller should do after [`DynamicSamplingAccumulator::push_batch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccumulatorStatus {
    /// Not enough prompts yet: generate another batch.
    NeedMore {
        /// Prompts kept so far.
        kept_prompts: usize,
    },
    /// Enough: train on these trajectories, `(generation batch index, index within it)`, already
    /// truncated to `train_batch_size · n`.
    Ready(Vec<(usize, usize)>),
}

/// DAPO's accumulate-until-enough loop, as bookkeeping over kept trajectory indices.
#[derive(Debug, Clone)]
pub struct DynamicSamplingAccumulator {
    train_batch_size: usize,
    n: usize,
    max_num_gen_batches: i64,
    num_gen_batches: usize,
    kept_prompts: usize,
    kept: Vec<(usize, usize)>,
}

impl DynamicSamplingAccumulator {
    /// `train_batch_size` prompts of `n` rollouts; `max_num_gen_batches ≤ 0` = unlimited.
    pub fn new(train_batch_size: usize, n: usize, max_num_gen_batches: i64) -> Self {
        Self {
            train_batch_size,
            n,
            max_num_gen_batches,
            num_gen_batches: 0,
            kept_prompts: 0,
            kept: Vec::new(),
        }
    }

    /// Generation batches consumed (metric `num_gen_batches`).
    pub fn num_gen_batches(&self) -> usize {
        self.num_gen_batches
    }

    /// Adds one filtered generation batch. Errors when the batch limit is reached without enough
    /// prompts (DAPO raises there).
    pub fn push_batch<K>(
        &mut self,
        filtered: &GroupFilter<K>,
    ) -> Result<AccumulatorStatus, ControlError> {
        let b = self.num_gen_batches;
        self.num_gen_batches += 1;
        self.kept_prompts += filtered.kept_uids.len();
        self.kept
            .extend(filtered.kept_indices.iter().map(|&i| (b, i)));
        if self.kept_prompts < self.train_batch_size {
            if self.max_num_gen_batches <= 0
                || (self.num_gen_batches as i64) < self.max_num_gen_batches
            {
                return Ok(AccumulatorStatus::NeedMore {
                    kept_prompts: self.kept_prompts,
                });
            }
            return Err(ControlError::TooManyGenBatches {
                num_gen_batches: self.num_gen_batches,
                max_num_gen_batches: self.max_num_gen_batches,
                kept_prompts: self.kept_prompts,
                needed_prompts: self.train_batch_size,
            });
        }
        let mut out = std::mem::take(&mut self.kept);
        out.truncate(self.train_batch_size * self.n);
        Ok(AccumulatorStatus::Ready(out))
    }
}

/// verl-agent `filter_group_data`: `rewards` holds contiguous groups of `group_n` episodes.
///
/// Regular try: keep every group whose rewards are not all equal (a singleton group counts as
/// uniform and is dropped — unlike DAPO). Last try: take `needed / group_n` groups, non-uniform
/// ones first, then uniform ones, each in batch order. Returns kept episode indices.
pub fn filter_groups_verl_agent(
    rewards: &[f64],
    group_n: usize,
    last_try: bool,
    needed: usize,
) -> Result<Vec<usize>, ControlError> {
    if group_n == 0 || !rewards.len().is_multiple_of(group_n) {
        return Err(ControlError::InvalidSetting {
            name: "group_n",
            reason: "must be ≥ 1 and divide the number of episodes",
        });
    }
    let uniform = |g: &[f64]| g.iter().all(|&r| r == g[0]);
    let groups: Vec<(usize, bool)> = rewards
        .chunks(group_n)
        .enumerate()
        .map(|(i, g)| (i, uniform(g)))
        .collect();
    let selected: Vec<usize> = if last_try {
        let take = needed / group_n;
        groups
            .iter()
            .filter(|g| !g.1)
            .chain(groups.iter().filter(|g| g.1))
            .take(take)
            .map(|g| g.0)
            .collect()
    } else {
        groups.iter().filter(|g| !g.1).map(|g| g.0).collect()
    };
    Ok(selected
        .into_iter()
        .flat_map(|g| g * group_n..(g + 1) * group_n)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn dapo_filter_hand_vector() {
        // Prompts a: [1, 0] (std 0.5, keep), b: [1, 1] (std 0, drop), c: [0.3] (singleton, keep),
        // d: [0.1, 0.1, 0.1] (uniform floats, drop).
        let uids = ["a", "b", "a", "c", "b", "d", "d", "d"];
        let vals = [1.0, 1.0, 0.0, 0.3, 1.0, 0.1, 0.1, 0.1];
        let f = filter_groups(&uids, &vals).unwrap();
        assert_eq!(f.kept_uids, vec!["a", "c"]);
        assert_eq!(f.kept_indices, vec![0, 2, 3]);
        assert_eq!(f.total_prompts, 4);
        assert!((population_std(&[1.0, 0.0]) - 0.5).abs() < 1e-12);
        assert_eq!(DapoMetric::SeqFinalReward.name(), "seq_final_reward");
        assert!(filter_groups(&uids, &vals[..3]).is_err());
    }

    #[test]
    fn accumulator_until_enough_then_truncate() {
        // Need 2 prompts × n = 2. Batch 0 keeps 1 prompt, batch 1 keeps 2 → 3 prompts, truncated
        // to the first 4 trajectories.
        let mut acc = DynamicSamplingAccumulator::new(2, 2, 0);
        let b0 = filter_groups(&[1, 1, 2, 2], &[1.0, 0.0, 1.0, 1.0]).unwrap();
        assert_eq!(
            acc.push_batch(&b0).unwrap(),
            AccumulatorStatus::NeedMore { kept_prompts: 1 }
        );
        let b1 = filter_groups(&[3, 3, 4, 4], &[0.0, 1.0, 1.0, 0.0]).unwrap();
        assert_eq!(
            acc.push_batch(&b1).unwrap(),
            AccumulatorStatus::Ready(vec![(0, 0), (0, 1), (1, 0), (1, 1)])
        );
        assert_eq!(acc.num_gen_batches(), 2);
    }

    #[test]
    fn accumulator_limit_raises() {
        let mut acc = DynamicSamplingAccumulator::new(2, 2, 2);
        let none = filter_groups(&[1, 1], &[1.0, 1.0]).unwrap();
        assert!(matches!(
            acc.push_batch(&none),
            Ok(AccumulatorStatus::NeedMore { .. })
        ));
        let err = acc.push_batch(&none).unwrap_err();
        assert!(matches!(
            err,
            ControlError::TooManyGenBatches {
                num_gen_batches: 2,
                ..
            }
        ));
        assert!(err.to_string().contains("max_num_gen_batches = 2"));
    }

    #[test]
    fn verl_agent_variant() {
        // Groups of 2: g0 [1,1] uniform, g1 [1,0], g2 [0,0] uniform, g3 [0,1].
        let r = [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0];
        assert_eq!(
            filter_groups_verl_agent(&r, 2, false, 0).unwrap(),
            vec![2, 3, 6, 7]
        );
        // Last try needing 6 episodes = 3 groups: g1, g3, then uniform g0.
        assert_eq!(
            filter_groups_verl_agent(&r, 2, true, 6).unwrap(),
            vec![2, 3, 6, 7, 0, 1]
        );
        assert_eq!(
            filter_groups_verl_agent(&r, 2, true, 2).unwrap(),
            vec![2, 3]
        );
        assert!(filter_groups_verl_agent(&r, 3, false, 0).is_err());
        // Singletons are uniform in verl-agent.
        assert!(
            filter_groups_verl_agent(&[1.0, 0.0], 1, false, 0)
                .unwrap()
                .is_empty()
        );
    }

    proptest! {
        #[test]
        fn never_keeps_zero_std_multi_group(vals in prop::collection::vec(prop::sample::select(vec![0.0, 0.1, 0.5, 1.0]), 1..40), groups in 1usize..6) {
            let uids: Vec<usize> = (0..vals.len()).map(|i| i % groups).collect();
            let f = filter_groups(&uids, &vals).unwrap();
            for u in &f.kept_uids {
                let g: Vec<f64> = uids.iter().zip(&vals).filter(|(x, _)| *x == u).map(|(_, v)| *v).collect();
                prop_assert!(g.len() == 1 || population_std(&g) > 0.0);
                prop_assert!(g.len() == 1 || g.iter().any(|&v| v != g[0]));
            }
        }
    }
}
