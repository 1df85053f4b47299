//! DAPO dynamic sampling's group filter (spec §6.4; DAPO recipe `dapo_ray_trainer.py`).
//!
//! DAPO: per prompt uid, `std = population std` of a metric over the group's trajectories; keep
//! the group iff `std > 0` or it has a single trajectory ([`keep_group`], [`filter_groups`]).
//! The accumulation of generation batches until enough prompts are kept lives in the trainer
//! (`turnwise::trainer::sampling`), which also counts turn, step and information-gain signals
//! as informative.

use std::collections::HashMap;
use std::hash::Hash;

use super::ControlError;

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
        assert!(filter_groups(&uids, &vals[..3]).is_err());
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
