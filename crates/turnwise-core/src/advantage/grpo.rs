//! §3.1 outcome-level group baselines: GRPO, Dr.GRPO, RLOO \[CODE VERL core_algos.py\].
//!
//! The score of rollout `i` is its outcome `s_i = R(τ_i)`; every agent token of the rollout gets
//! the same advantage (observation tokens 0, as VERL multiplies by the response mask).

use serde::{Deserialize, Serialize};

use crate::range::Range;

use super::contract::KlPlacement;
use super::error::settings_result;
use super::input::validate_common;
use super::kernels::{StdKind, dr_grpo_center, grpo_normalize, normalize_by_key, rloo};
use super::output::turn_constant;
use super::{AdvantageBatch, AdvantageError, AdvantageOutput, Estimator};

/// Settings of `grpo`: `A_i = (s_i − mean_g) / (std_g + ε)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpoConfig {
    /// Standard deviation kind (VERL: unbiased).
    pub std: StdKind,
    /// ε added to the std (VERL 1e-6; turn-level-rewards.md MT code 1e-4).
    pub epsilon: f64,
}

impl Default for GrpoConfig {
    fn default() -> Self {
        Self {
            std: StdKind::Unbiased,
            epsilon: 1e-6,
        }
    }
}

/// Settings of `dr_grpo` (`A_i = s_i − mean_g`, VERL `norm_adv_by_std_in_grpo = False`): none.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DrGrpoConfig {}

/// Settings of `rloo` (`A_i = s_i − mean_{j≠i} s_j`): none.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RlooConfig {}

/// Applies a per-group kernel to the outcomes (groups = `Rollout::group`) and broadcasts.
pub(crate) fn outcome_estimator(
    name: &'static str,
    batch: &AdvantageBatch,
    kernel: impl Fn(&[f64]) -> Vec<f64>,
) -> Result<AdvantageOutput, AdvantageError> {
    validate_common(name, batch)?;
    let scores: Vec<f64> = batch.rollouts.iter().map(|r| r.outcome).collect();
    let keys: Vec<usize> = batch.rollouts.iter().map(|r| r.group).collect();
    let adv = normalize_by_key(&scores, &keys, kernel);
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

impl Estimator for GrpoConfig {
    fn name(&self) -> &'static str {
        "grpo"
    }

    fn validate(&self) -> Result<(), AdvantageError> {
        let mut p = Vec::new();
        Range::StdEpsilon.check(&mut p, "epsilon", self.epsilon);
        settings_result("grpo", p)
    }

    fn kl_placement(&self) -> Option<KlPlacement> {
        Some(KlPlacement::Outcome)
    }

    fn estimate(&self, batch: &AdvantageBatch) -> Result<AdvantageOutput, AdvantageError> {
        outcome_estimator(self.name(), batch, |s| {
            grpo_normalize(s, self.std, self.epsilon)
        })
    }
}

impl Estimator for DrGrpoConfig {
    fn name(&self) -> &'static str {
        "dr_grpo"
    }

    fn kl_placement(&self) -> Option<KlPlacement> {
        Some(KlPlacement::Outcome)
    }

    fn estimate(&self, batch: &AdvantageBatch) -> Result<AdvantageOutput, AdvantageError> {
        outcome_estimator(self.name(), batch, dr_grpo_center)
    }
}

impl Estimator for RlooConfig {
    fn name(&self) -> &'static str {
        "rloo"
    }

    fn kl_placement(&self) -> Option<KlPlacement> {
        Some(KlPlacement::Outcome)
    }

    fn estimate(&self, batch: &AdvantageBatch) -> Result<AdvantageOutput, AdvantageError> {
        outcome_estimator(self.name(), batch, rloo)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::advantage::Rollout;
    use crate::test_util::{TOL, assert_all_close};

    const S: [f64; 4] = [1.0, 0.0, 0.0, 1.0];

    #[test]
    fn spec_3_1_grpo_std_u() {
        let a = grpo_normalize(&S, StdKind::Unbiased, 1e-6);
        assert_all_close(&a, &[0.866024, -0.866024, -0.866024, 0.866024], TOL, "grpo");
    }

    #[test]
    fn spec_3_1_grpo_std_p() {
        let a = grpo_normalize(&S, StdKind::Population, 1e-6);
        assert_all_close(
            &a,
            &[0.999998, -0.999998, -0.999998, 0.999998],
            TOL,
            "grpo std_p",
        );
    }

    #[test]
    fn spec_3_1_grpo_all_equal_and_singleton() {
        let a = grpo_normalize(&[1.0; 4], StdKind::Unbiased, 1e-6);
        assert_all_close(&a, &[0.0; 4], TOL, "all equal");
        assert_all_close(
            &grpo_normalize(&[0.7], StdKind::Unbiased, 1e-6),
            &[0.7],
            TOL,
            "single",
        );
    }

    #[test]
    fn spec_3_1_grpo_mixed() {
        let a = grpo_normalize(&[1.0, -1.0, 0.0, 0.0], StdKind::Unbiased, 1e-6);
        assert_all_close(&a, &[1.224743, -1.224743, 0.0, 0.0], TOL, "grpo mixed");
    }

    #[test]
    fn spec_3_1_mt_code_epsilon() {
        let a = grpo_normalize(&S, StdKind::Unbiased, 1e-4);
        assert_all_close(
            &a,
            &[0.865875, -0.865875, -0.865875, 0.865875],
            TOL,
            "mt eps",
        );
    }

    #[test]
    fn spec_3_1_dr_grpo_and_rloo() {
        assert_all_close(&dr_grpo_center(&S), &[0.5, -0.5, -0.5, 0.5], TOL, "dr_grpo");
        let r = rloo(&S);
        assert_all_close(&r, &[0.666667, -0.666667, -0.666667, 0.666667], TOL, "rloo");
        assert_all_close(&rloo(&[0.7]), &[0.7], TOL, "rloo singleton");
    }

    #[test]
    fn grpo_estimator_groups_and_broadcast() {
        let batch = AdvantageBatch::new(vec![
            Rollout::new(0, vec![0, 0, -1, 1], 1.0),
            Rollout::new(0, vec![0], 0.0),
            Rollout::new(1, vec![0, 0], 0.7),
            Rollout::new(0, vec![0, -1, 1], 0.0),
            Rollout::new(0, vec![0], 1.0),
        ]);
        let out = GrpoConfig::default().estimate(&batch).unwrap();
        assert_eq!(out.estimator, "grpo");
        assert_all_close(
            &out.rollouts[0].tokens,
            &[0.866024, 0.866024, 0.0, 0.866024],
            TOL,
            "r0",
        );
        assert_all_close(&out.rollouts[1].tokens, &[-0.866024], TOL, "r1");
        assert_all_close(&out.rollouts[2].tokens, &[0.7, 0.7], TOL, "singleton group");
        assert_all_close(
            &out.rollouts[3].turns,
            &[-0.866024, -0.866024],
            TOL,
            "r3 turns",
        );
    }

    #[test]
    fn non_finite_outcome_names_rollout() {
        let batch = AdvantageBatch::new(vec![
            Rollout::new(0, vec![0], 1.0),
            Rollout::new(0, vec![0], f64::NAN),
        ]);
        let err = RlooConfig::default().estimate(&batch).unwrap_err();
        assert!(matches!(
            err,
            AdvantageError::NonFinite {
                rollout: 1,
                field: "outcome",
                ..
            }
        ));
        assert!(err.to_string().contains("rollout 1"), "{err}");
    }
}
