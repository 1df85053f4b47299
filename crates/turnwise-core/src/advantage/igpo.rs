//! §3.4 IGPO (baseline): information-gain turn rewards.
//!
//! Rewards: `r_{i,t} = ig_{i,t}` for process turns `t < T_i − 1` (0-based), `r_{i,T_i−1} = R(τ_i)`.
//!
//! - Paper form (A2TGPO eq. 4–5, \[REC\]): z-normalize the pooled rewards of the prompt group
//!   (outcomes included, `std_p + ε`), then `Ã_{i,t} = Σ_{k≥t} γ^{k−t} r̃_{i,k}`, broadcast to the
//!   turn's tokens.
//! - Code form \[CODE IGPO core_algos.py `compute_grpo_outcome_advantage` (overridden)\]: raw IG
//!   on the last token of each turn, raw outcome on the last response token, reverse cumulative
//!   return along tokens, minus the per-token-position mean of the group (shorter rollouts count
//!   0 at padded positions); no std.

use serde::{Deserialize, Serialize};

use crate::range::Range;

use super::contract::{self, MetricDoc, Metrics, Needs};
use super::error::settings_result;
use super::input::{check_len, validate_common};
use super::kernels::{StdKind, discounted_suffix_sums, group_indices, mean};
use super::output::{first_token_per_turn, turn_constant};
use super::{AdvantageBatch, AdvantageError, AdvantageOutput, Estimator, RolloutAdvantage};

/// Which IGPO advantage to compute (§9 item 1).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IgpoForm {
    /// Pooled z-normalization incl. outcomes + discounted sum (recommended).
    #[default]
    Paper,
    /// Official code: per-token-position group baseline, no std.
    Code,
}

/// Settings of `igpo`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IgpoConfig {
    /// Paper or code form.
    pub form: IgpoForm,
    /// Discount γ (default 1; the code form's return is γ-discounted along tokens, 1 in the code).
    pub gamma: f64,
    /// Paper form: std kind of the pool (default population).
    pub std: StdKind,
    /// Paper form: ε added to the std (default 1e-6).
    pub epsilon: f64,
}

impl Default for IgpoConfig {
    fn default() -> Self {
        Self {
            form: IgpoForm::Paper,
            gamma: 1.0,
            std: StdKind::Population,
            epsilon: 1e-6,
        }
    }
}

/// Paper-form IGPO for one group: `rewards[i]` = `[ig_{i,0}, …, ig_{i,T_i−2}, R(τ_i)]`.
/// Returns the per-turn advantages `Ã_{i,t}`.
pub fn igpo_paper_group(
    rewards: &[Vec<f64>],
    std: StdKind,
    epsilon: f64,
    gamma: f64,
) -> Vec<Vec<f64>> {
    let pool: Vec<f64> = rewards.iter().flatten().copied().collect();
    let m = mean(&pool);
    let s = std.std(&pool);
    rewards
        .iter()
        .map(|r| {
            let z: Vec<f64> = r.iter().map(|x| (x - m) / (s + epsilon)).collect();
            discounted_suffix_sums(&z, gamma)
        })
        .collect()
}

/// Code-form IGPO for one group: per-rollout token rewards (rollouts may differ in length).
/// Returns per-token advantages `return_{i,p} − mean_j return_{j,p}` (`return_{j,p} = 0` past
/// rollout `j`'s end).
pub fn igpo_code_group(token_rewards: &[Vec<f64>], gamma: f64) -> Vec<Vec<f64>> {
    let returns: Vec<Vec<f64>> = token_rewards
        .iter()
        .map(|r| discounted_suffix_sums(r, gamma))
        .collect();
    let len = returns.iter().map(Vec::len).max().unwrap_or(0);
    let g = returns.len().max(1) as f64;
    let baseline: Vec<f64> = (0..len)
        .map(|p| returns.iter().filter_map(|r| r.get(p)).sum::<f64>() / g)
        .collect();
    returns
        .into_iter()
        .map(|r| r.iter().enumerate().map(|(p, x)| x - baseline[p]).collect())
        .collect()
}

impl Estimator for IgpoConfig {
    fn name(&self) -> &'static str {
        "igpo"
    }

    fn validate(&self) -> Result<(), AdvantageError> {
        let mut p = Vec::new();
        Range::UnitInterval.check(&mut p, "gamma", self.gamma);
        Range::StdEpsilon.check(&mut p, "epsilon", self.epsilon);
        settings_result("igpo", p)
    }

    fn needs(&self) -> Needs {
        Needs {
            info_gain: true,
            ..Needs::default()
        }
    }

    fn metrics(&self, batch: &AdvantageBatch, _out: &AdvantageOutput) -> Metrics {
        contract::info_gain_per_turn(&batch.rollouts)
    }

    fn metric_docs(&self) -> &'static [MetricDoc] {
        &contract::INFO_GAIN_DOCS
    }

    fn estimate(&self, batch: &AdvantageBatch) -> Result<AdvantageOutput, AdvantageError> {
        let name = self.name();
        validate_common(name, batch)?;
        for (i, r) in batch.rollouts.iter().enumerate() {
            if r.num_turns == 0 {
                return Err(AdvantageError::InvalidRollout {
                    estimator: name,
                    rollout: i,
                    message: "has no agent turn".to_string(),
                });
            }
            check_len(name, i, "info_gain", r.info_gain.len(), r.num_turns - 1)?;
        }
        let keys: Vec<usize> = batch.rollouts.iter().map(|r| r.group).collect();
        let mut out = vec![RolloutAdvantage::default(); batch.rollouts.len()];
        for members in group_indices(&keys).into_values() {
            match self.form {
                IgpoForm::Paper => {
                    let rewards: Vec<Vec<f64>> = members
                        .iter()
                        .map(|&i| {
                            let r = &batch.rollouts[i];
                            let mut v = r.info_gain.clone();
                            v.push(r.outcome);
                            v
                        })
                        .collect();
                    let adv = igpo_paper_group(&rewards, self.std, self.epsilon, self.gamma);
                    for (&i, a) in members.iter().zip(adv) {
                        out[i] = turn_constant(&batch.rollouts[i].turn_id, a);
                    }
                }
                IgpoForm::Code => {
                    let mut token_rewards = Vec::with_capacity(members.len());
                    for &i in &members {
                        let r = &batch.rollouts[i];
                        if r.turn_id.is_empty() {
                            return Err(AdvantageError::MissingInput {
                                estimator: name,
                                rollout: i,
                                field: "turn_id (the code form works on tokens)",
                            });
                        }
                        let mut tr = vec![0.0; r.turn_id.len()];
                        for (t, &ig) in r.info_gain.iter().enumerate() {
                            let p = r.last_token_of_turn(t).ok_or_else(|| {
                                AdvantageError::InvalidRollout {
                                    estimator: name,
                                    rollout: i,
                                    message: format!("process turn {t} has no token for its IG"),
                                }
                            })?;
                            tr[p] += ig;
                        }
                        *tr.last_mut().expect("non-empty") += r.outcome;
                        token_rewards.push(tr);
                    }
                    let adv = igpo_code_group(&token_rewards, self.gamma);
                    for (&i, a) in members.iter().zip(adv) {
                        let r = &batch.rollouts[i];
                        out[i] = RolloutAdvantage {
                            turns: first_token_per_turn(&r.turn_id, &a, r.num_turns),
                            tokens: a,
                            ..RolloutAdvantage::default()
                        };
                    }
                }
            }
        }
        Ok(AdvantageOutput {
            estimator: name.to_string(),
            rollouts: out,
            trees: Vec::new(),
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::advantage::Rollout;
    use crate::test_util::{TOL, assert_all_close};

    /// The A2TGPO worked example group (§3.5), shared with the IGPO paper-form vector.
    pub(crate) fn a2tgpo_example() -> AdvantageBatch {
        AdvantageBatch::new(vec![
            Rollout::with_turns(0, 3, 1.0).with_info_gain(vec![0.30, 0.20]),
            Rollout::with_turns(0, 2, 0.0).with_info_gain(vec![0.10]),
            Rollout::with_turns(0, 4, 1.0).with_info_gain(vec![0.25, -0.05, 0.10]),
            Rollout::with_turns(0, 1, -1.0),
        ])
    }

    /// The spec's paper-form vector was computed **without** ε (its own \[REC\] says ε = 1e-6,
    /// which moves the values by up to 5e-6), so it is checked with `epsilon = 0` at 1e-6 and with
    /// the default ε at 1e-5.
    #[test]
    fn spec_3_4_paper_form() {
        let cfg = IgpoConfig {
            epsilon: 0.0,
            ..IgpoConfig::default()
        };
        let out = cfg.estimate(&a2tgpo_example()).unwrap();
        let default = IgpoConfig::default().estimate(&a2tgpo_example()).unwrap();
        let exp: [&[f64]; 4] = [
            &[1.740828, 1.534924, 1.516205],
            &[-0.52412, -0.355653],
            &[1.010804, 0.898492, 1.347738, 1.516205],
            &[-2.227512],
        ];
        for (i, e) in exp.iter().enumerate() {
            assert_all_close(&out.rollouts[i].turns, e, TOL, &format!("rollout {i}"));
            assert_all_close(
                &default.rollouts[i].turns,
                e,
                1e-5,
                &format!("rollout {i}, ε"),
            );
        }
    }

    #[test]
    fn spec_3_4_code_form() {
        // A: 6 tokens, IG 0.3 at idx 1, F1 1.0 at idx 5; B: 4 tokens, IG 0.1 at idx 1, F1 0 at 3.
        let batch = AdvantageBatch::new(vec![
            Rollout::new(0, vec![0, 0, -1, -1, 1, 1], 1.0).with_info_gain(vec![0.3]),
            Rollout::new(0, vec![0, 0, -1, 1], 0.0).with_info_gain(vec![0.1]),
        ]);
        let cfg = IgpoConfig {
            form: IgpoForm::Code,
            ..IgpoConfig::default()
        };
        let out = cfg.estimate(&batch).unwrap();
        assert_all_close(
            &out.rollouts[0].tokens,
            &[0.6, 0.6, 0.5, 0.5, 0.5, 0.5],
            TOL,
            "A",
        );
        assert_all_close(&out.rollouts[1].tokens, &[-0.6, -0.6, -0.5, -0.5], TOL, "B");
    }

    #[test]
    fn info_gain_length_checked() {
        let batch = AdvantageBatch::new(vec![
            Rollout::with_turns(0, 3, 1.0).with_info_gain(vec![0.1]),
        ]);
        let err = IgpoConfig::default().estimate(&batch).unwrap_err();
        assert!(matches!(
            err,
            AdvantageError::LengthMismatch {
                field: "info_gain",
                got: 1,
                expected: 2,
                ..
            }
        ));
    }
}
