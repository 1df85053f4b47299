//! §3.8 Tree-GRPO (baseline) \[CODE TG verl/trainer/ppo/ray_trainer_ts.py `compute_advantage`\].
//!
//! Every rollout is a sampled leaf of a tree (`Rollout::tree`, a label unique within the prompt
//! group) and its score is its outcome. GRPO (`std_u + ε`, singleton raw) is applied over the
//! prompt group ("inter-tree") and/or over the tree ("intra-tree").

use serde::{Deserialize, Serialize};

use crate::range::Range;

use super::contract::Needs;
use super::error::settings_result;
use super::input::validate_common;
use super::kernels::{StdKind, group_indices, grpo_normalize, normalize_by_key};
use super::output::turn_constant;
use super::{AdvantageBatch, AdvantageError, AdvantageOutput, Estimator};

/// Which Tree-GRPO variant (`adv_estimator` in the reference code).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TreeGrpoMode {
    /// `tree`: GRPO over the prompt group + GRPO over the tree (used by the scripts).
    #[default]
    Tree,
    /// `tree_2norm`: GRPO over the prompt group, then GRPO of those values over the tree.
    #[serde(rename = "tree_2norm")]
    Tree2Norm,
    /// `tree_inner`: GRPO over the tree only (intra-tree ablation).
    TreeInner,
}

/// Settings of `tree_grpo`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TreeGrpoConfig {
    /// Variant.
    pub mode: TreeGrpoMode,
    /// ε added to `std_u` (1e-6).
    pub epsilon: f64,
}

impl Default for TreeGrpoConfig {
    fn default() -> Self {
        Self {
            mode: TreeGrpoMode::Tree,
            epsilon: 1e-6,
        }
    }
}

/// Tree-GRPO advantages of the leaves of one prompt group: `scores[i]` with tree label `trees[i]`.
pub fn tree_grpo_group(
    scores: &[f64],
    trees: &[usize],
    mode: TreeGrpoMode,
    epsilon: f64,
) -> Vec<f64> {
    let grpo = |s: &[f64]| grpo_normalize(s, StdKind::Unbiased, epsilon);
    match mode {
        TreeGrpoMode::Tree => {
            let inter = grpo(scores);
            let intra = normalize_by_key(scores, trees, grpo);
            inter.iter().zip(intra).map(|(a, b)| a + b).collect()
        }
        TreeGrpoMode::Tree2Norm => normalize_by_key(&grpo(scores), trees, grpo),
        TreeGrpoMode::TreeInner => normalize_by_key(scores, trees, grpo),
    }
}

impl Estimator for TreeGrpoConfig {
    fn name(&self) -> &'static str {
        "tree_grpo"
    }

    fn validate(&self) -> Result<(), AdvantageError> {
        let mut p = Vec::new();
        Range::StdEpsilon.check(&mut p, "epsilon", self.epsilon);
        settings_result("tree_grpo", p)
    }

    fn needs(&self) -> Needs {
        Needs {
            trees: true,
            ..Needs::default()
        }
    }

    fn estimate(&self, batch: &AdvantageBatch) -> Result<AdvantageOutput, AdvantageError> {
        let name = self.name();
        validate_common(name, batch)?;
        let mut trees = Vec::with_capacity(batch.rollouts.len());
        for (i, r) in batch.rollouts.iter().enumerate() {
            trees.push(r.tree.ok_or(AdvantageError::MissingInput {
                estimator: name,
                rollout: i,
                field: "tree",
            })?);
        }
        let keys: Vec<usize> = batch.rollouts.iter().map(|r| r.group).collect();
        let mut adv = vec![0.0; batch.rollouts.len()];
        for idx in group_indices(&keys).into_values() {
            let s: Vec<f64> = idx.iter().map(|&i| batch.rollouts[i].outcome).collect();
            let t: Vec<usize> = idx.iter().map(|&i| trees[i]).collect();
            for (&i, a) in idx
                .iter()
                .zip(tree_grpo_group(&s, &t, self.mode, self.epsilon))
            {
                adv[i] = a;
            }
        }
        Ok(AdvantageOutput {
            estimator: name.to_string(),
            rollouts: batch
                .rollouts
                .iter()
                .zip(adv)
                .map(|(r, a)| turn_constant(&r.turn_id, vec![a; r.num_turns]))
                .collect(),
            trees: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::advantage::Rollout;
    use crate::test_util::{TOL, assert_all_close};

    const SCORES: [f64; 6] = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0];
    const TREES: [usize; 6] = [0, 0, 0, 1, 1, 1];

    #[test]
    fn spec_3_8_tree_vector() {
        let inter = grpo_normalize(&SCORES, StdKind::Unbiased, 1e-6);
        let e = 0.912869;
        assert_all_close(&inter, &[e, -e, e, -e, -e, e], TOL, "inter");
        let intra = tree_grpo_group(&SCORES, &TREES, TreeGrpoMode::TreeInner, 1e-6);
        let (a, b) = (0.577349, 1.154699);
        assert_all_close(&intra, &[a, -b, a, -a, -a, b], TOL, "intra (tree_inner)");
        let sum = tree_grpo_group(&SCORES, &TREES, TreeGrpoMode::Tree, 1e-6);
        let (c, d) = (1.490219, 2.067568);
        assert_all_close(&sum, &[c, -d, c, -c, -c, d], TOL, "tree");
    }

    #[test]
    fn tree_2norm_and_inner_vectors() {
        // Computed by hand with Python (statistics.stdev, ε = 1e-6): re-normalizing the
        // inter-tree values per tree = intra normalization up to the ε scale:
        // tree_2norm = [0.577349721, -1.154699443, 0.577349721, -0.577349721, -0.577349721,
        // 1.154699443]; tree_inner = [0.577349269, -1.154698538, 0.577349269, -0.577349269,
        // -0.577349269, 1.154698538].
        let two = tree_grpo_group(&SCORES, &TREES, TreeGrpoMode::Tree2Norm, 1e-6);
        let (a, b) = (0.577349721, 1.154699443);
        assert_all_close(&two, &[a, -b, a, -a, -a, b], 1e-8, "tree_2norm");
        let inner = tree_grpo_group(&SCORES, &TREES, TreeGrpoMode::TreeInner, 1e-6);
        let (a, b) = (0.577349269, 1.154698538);
        assert_all_close(&inner, &[a, -b, a, -a, -a, b], 1e-8, "tree_inner");
    }

    #[test]
    fn estimator_needs_tree_ids() {
        let mut rollouts: Vec<Rollout> = SCORES
            .iter()
            .zip(TREES)
            .map(|(&s, t)| Rollout::new(0, vec![0, -1, 1], s).with_tree(t))
            .collect();
        let out = TreeGrpoConfig::default()
            .estimate(&AdvantageBatch::new(rollouts.clone()))
            .unwrap();
        assert_all_close(
            &out.rollouts[1].tokens,
            &[-2.067568, 0.0, -2.067568],
            TOL,
            "tokens",
        );
        rollouts[4].tree = None;
        let err = TreeGrpoConfig::default()
            .estimate(&AdvantageBatch::new(rollouts))
            .unwrap_err();
        assert!(matches!(
            err,
            AdvantageError::MissingInput {
                rollout: 4,
                field: "tree",
                ..
            }
        ));
    }
}
