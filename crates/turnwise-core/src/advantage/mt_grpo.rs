//! §3.2 MT-GRPO (turn-level-rewards.md eq. 6–7, App. D eq. 11–13) and its two-turn code variant
//! \[CODE MT verifiers/trainers/mt_grpo_env_trainer.py `_assign_advantages`\].

use serde::{Deserialize, Serialize};

use crate::range::Range;

use super::contract::{self, MetricDoc, Metrics, Needs};
use super::error::settings_result;
use super::input::{check_len, validate_common};
use super::kernels::{GroupNorm, StdKind, normalize_by_key};
use super::output::turn_constant;
use super::{AdvantageBatch, AdvantageError, AdvantageOutput, Estimator};

/// How MT-GRPO forms the group of "G actions sampled at state `s_k`" for turn `k`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnGroupKey {
    /// Final and intermediate rewards in separate groups ([`role_group`]): every rollout's
    /// final reward `R^F` is normalised with the final rewards of all the prompt's rollouts,
    /// at whatever turn each one answered, and an intermediate reward `R^I` of turn `k` with
    /// those of the rollouts that also continue after turn `k`. So `R^F` is never normalised
    /// together with `R^I`, and every rollout's outcome is still compared with all the others'
    /// (with chains of different lengths; the paper's rollouts all have the same number of
    /// turns, where this equals [`TurnGroupKey::PromptTurn`]).
    #[default]
    PromptTurnRole,
    /// All rollouts of the prompt group that reach turn `k`, whatever the role of that turn
    /// (the spec's vector, which has equal turn counts; with chains of different lengths the
    /// group mixes final and intermediate rewards).
    PromptTurn,
    /// Prompt group, turn `k` and the rollout's `anchors[k]` (state id), for `G^{K−1}` trees
    /// where each state has its own G sampled actions.
    Anchor,
}

/// Settings of `mt_grpo` (K turns):
/// `A_{i,(k)} = (R_{i,k} − mean) / (std + ε)` per turn group, `Ā_{i,(k)} = Σ_{l≥k} A_{i,(l)}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MtGrpoConfig {
    /// Standard deviation kind (default unbiased, as the spec vector).
    pub std: StdKind,
    /// ε added to the std (paper eq. 6 has none; spec vector uses 1e-6).
    pub epsilon: f64,
    /// How turn groups are formed.
    pub state_key: TurnGroupKey,
}

impl Default for MtGrpoConfig {
    fn default() -> Self {
        Self {
            std: StdKind::Unbiased,
            epsilon: 1e-6,
            state_key: TurnGroupKey::PromptTurnRole,
        }
    }
}

/// Settings of `mt_grpo_code`, the two-turn TRL/verifiers variant: turn-0 tokens get
/// `A_out + c·A_turn`, later tokens `A_out`; a rollout without tool result (one turn) gets the
/// normalized combined reward.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MtGrpoCodeConfig {
    /// Standard deviation kind (code: torch `std`, unbiased).
    pub std: StdKind,
    /// ε added to the std (code: 1e-4).
    pub epsilon: f64,
    /// `turn_advantage_coef` c (default 1).
    pub turn_advantage_coef: f64,
}

impl Default for MtGrpoCodeConfig {
    fn default() -> Self {
        Self {
            std: StdKind::Unbiased,
            epsilon: 1e-4,
            turn_advantage_coef: 1.0,
        }
    }
}

/// The group of turn `k` of a rollout of prompt group `group` with `num_turns` turns under
/// [`TurnGroupKey::PromptTurnRole`]: `(group, None)` for its final turn, whichever turn that is
/// (the outcome group: all the prompt's rollouts), `(group, Some(k))` for an intermediate turn.
///
/// Keying the final turn by its index as well would split the outcome group by *when* each
/// rollout answered: a rollout that answered at turn 1 would be compared only with the others
/// that also answered at turn 1, never with those that searched first, so the choice between
/// answering and searching would get no signal (on the generated world the policy then
/// stopped searching: training EM fell from 0.35 to 0.22 and test EM by 3 points in 70 steps).
pub fn role_group(group: usize, k: usize, num_turns: usize) -> (usize, Option<usize>) {
    if k + 1 == num_turns {
        (group, None)
    } else {
        (group, Some(k))
    }
}

/// K-turn MT-GRPO for one group of rollouts with per-turn rewards `rewards[i][k]` (rollouts may
/// have different turn counts; turn `k`'s group is the rollouts that reach it). Returns the
/// per-turn advantages `A` (eq. 6) and the accumulated `Ā` (eq. 7).
pub fn mt_grpo_turn_advantages(
    rewards: &[Vec<f64>],
    std: StdKind,
    epsilon: f64,
) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let norm = GroupNorm::grpo(std, epsilon);
    let mut a: Vec<Vec<f64>> = rewards.iter().map(|r| vec![0.0; r.len()]).collect();
    let k_max = rewards.iter().map(Vec::len).max().unwrap_or(0);
    for k in 0..k_max {
        let members: Vec<usize> = (0..rewards.len())
            .filter(|&i| rewards[i].len() > k)
            .collect();
        let vals: Vec<f64> = members.iter().map(|&i| rewards[i][k]).collect();
        for (&i, v) in members.iter().zip(norm.apply(&vals)) {
            a[i][k] = v;
        }
    }
    let acc = a.iter().map(|ai| suffix_sum(ai)).collect();
    (a, acc)
}

fn suffix_sum(xs: &[f64]) -> Vec<f64> {
    super::kernels::discounted_suffix_sums(xs, 1.0)
}

impl Estimator for MtGrpoConfig {
    fn name(&self) -> &'static str {
        "mt_grpo"
    }

    fn validate(&self) -> Result<(), AdvantageError> {
        let mut p = Vec::new();
        Range::StdEpsilon.check(&mut p, "epsilon", self.epsilon);
        settings_result("mt_grpo", p)
    }

    fn needs(&self) -> Needs {
        Needs {
            turn_rewards: true,
            ..Needs::default()
        }
    }

    fn metrics(&self, batch: &AdvantageBatch, _out: &AdvantageOutput) -> Metrics {
        contract::mt_grpo_metrics(batch)
    }

    fn metric_docs(&self) -> &'static [MetricDoc] {
        &[
            MetricDoc {
                key: "mt_grpo/turn_group/group_size/mean",
                label: "MT-GRPO turn-group size",
            },
            MetricDoc {
                key: "mt_grpo/turn_group/singleton_share",
                label: "MT-GRPO singleton turns",
            },
        ]
    }

    fn estimate(&self, batch: &AdvantageBatch) -> Result<AdvantageOutput, AdvantageError> {
        let name = self.name();
        validate_common(name, batch)?;
        // Flatten (rollout, turn) pairs with their group key.
        let mut scores = Vec::new();
        let mut keys: Vec<(usize, Option<usize>, String)> = Vec::new();
        for (i, r) in batch.rollouts.iter().enumerate() {
            check_len(name, i, "turn_rewards", r.turn_rewards.len(), r.num_turns)?;
            if self.state_key == TurnGroupKey::Anchor {
                check_len(name, i, "anchors", r.anchors.len(), r.num_turns)?;
            }
            for k in 0..r.num_turns {
                scores.push(r.turn_rewards[k]);
                keys.push(match self.state_key {
                    TurnGroupKey::PromptTurn => (r.group, Some(k), String::new()),
                    TurnGroupKey::PromptTurnRole => {
                        let (g, k) = role_group(r.group, k, r.num_turns);
                        (g, k, String::new())
                    }
                    TurnGroupKey::Anchor => (r.group, Some(k), r.anchors[k].clone()),
                });
            }
        }
        let norm = GroupNorm::grpo(self.std, self.epsilon);
        let a = normalize_by_key(&scores, &keys, |s| norm.apply(s));
        let mut per_turn: Vec<Vec<f64>> = Vec::with_capacity(batch.rollouts.len());
        let mut pos = 0;
        for r in &batch.rollouts {
            per_turn.push(suffix_sum(&a[pos..pos + r.num_turns]));
            pos += r.num_turns;
        }
        Ok(AdvantageOutput {
            estimator: name.to_string(),
            rollouts: batch
                .rollouts
                .iter()
                .zip(per_turn)
                .map(|(r, t)| turn_constant(&r.turn_id, t))
                .collect(),
            trees: Vec::new(),
        })
    }
}

impl Estimator for MtGrpoCodeConfig {
    fn name(&self) -> &'static str {
        "mt_grpo_code"
    }

    fn validate(&self) -> Result<(), AdvantageError> {
        let mut p = Vec::new();
        Range::StdEpsilon.check(&mut p, "epsilon", self.epsilon);
        Range::NonNegative.check(&mut p, "turn_advantage_coef", self.turn_advantage_coef);
        settings_result("mt_grpo_code", p)
    }

    fn needs(&self) -> Needs {
        Needs {
            turn_rewards: true,
            ..Needs::default()
        }
    }

    fn metrics(&self, batch: &AdvantageBatch, out: &AdvantageOutput) -> Metrics {
        contract::mt_grpo_code_metrics(batch, out)
    }

    fn metric_docs(&self) -> &'static [MetricDoc] {
        &[
            MetricDoc {
                key: "mt_grpo/turn_credit/abs_mean",
                label: "MT-GRPO first-turn credit |c·A_turn|",
            },
            MetricDoc {
                key: "mt_grpo/no_tool_result_share",
                label: "MT-GRPO episodes without a tool result",
            },
        ]
    }

    fn estimate(&self, batch: &AdvantageBatch) -> Result<AdvantageOutput, AdvantageError> {
        let name = self.name();
        validate_common(name, batch)?;
        for (i, r) in batch.rollouts.iter().enumerate() {
            if r.turn_rewards.is_empty() {
                return Err(AdvantageError::MissingInput {
                    estimator: name,
                    rollout: i,
                    field: "turn_rewards",
                });
            }
        }
        let keys: Vec<usize> = batch.rollouts.iter().map(|r| r.group).collect();
        let norm = GroupNorm::grpo(self.std, self.epsilon);
        let n = |v: Vec<f64>| normalize_by_key(&v, &keys, |s| norm.apply(s));
        // A_turn: first-turn reward; A_out: outcome; combined: both (all over the same G rollouts).
        let a_turn = n(batch.rollouts.iter().map(|r| r.turn_rewards[0]).collect());
        let a_out = n(batch.rollouts.iter().map(|r| r.outcome).collect());
        let a_comb = n(batch
            .rollouts
            .iter()
            .map(|r| r.turn_rewards[0] + r.outcome)
            .collect());
        let c = self.turn_advantage_coef;
        let rollouts = batch
            .rollouts
            .iter()
            .enumerate()
            .map(|(i, r)| {
                // A rollout has a tool result iff its first turn is followed by another turn
                // (tokens before the `<result>` segment = turn 0).
                let turns = if r.num_turns >= 2 {
                    let mut t = vec![a_out[i]; r.num_turns];
                    t[0] = a_out[i] + c * a_turn[i];
                    t
                } else {
                    vec![a_comb[i]; r.num_turns]
                };
                turn_constant(&r.turn_id, turns)
            })
            .collect();
        Ok(AdvantageOutput {
            estimator: name.to_string(),
            rollouts,
            trees: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::advantage::Rollout;
    use crate::test_util::{TOL, assert_all_close};

    fn spec_rewards() -> Vec<Vec<f64>> {
        vec![
            vec![0.2, 0.5, 1.0],
            vec![0.2, 0.0, 0.0],
            vec![0.0, 0.5, 1.0],
        ]
    }

    #[test]
    fn spec_3_2_k_turn_vector() {
        let (a, acc) = mt_grpo_turn_advantages(&spec_rewards(), StdKind::Unbiased, 1e-6);
        let exp_a = [
            [0.577345, 0.577348, 0.577349],
            [0.577345, -1.154697, -1.154699],
            [-1.154691, 0.577348, 0.577349],
        ];
        let exp_acc = [
            [1.732043, 1.154698, 0.577349],
            [-1.73205, -2.309395, -1.154699],
            [7e-06, 1.154698, 0.577349],
        ];
        for i in 0..3 {
            assert_all_close(&a[i], &exp_a[i], TOL, &format!("A[{i}]"));
            assert_all_close(&acc[i], &exp_acc[i], TOL, &format!("Abar[{i}]"));
        }
    }

    #[test]
    fn spec_3_2_k_turn_estimator() {
        let rollouts = spec_rewards()
            .into_iter()
            .map(|r| Rollout::new(0, vec![0, -1, 1, -1, 2, 2], 0.0).with_turn_rewards(r))
            .collect();
        let out = MtGrpoConfig::default()
            .estimate(&AdvantageBatch::new(rollouts))
            .unwrap();
        assert_all_close(
            &out.rollouts[0].tokens,
            &[1.732043, 0.0, 1.154698, 0.0, 0.577349, 0.577349],
            TOL,
            "tokens",
        );
        assert_all_close(
            &out.rollouts[2].turns,
            &[7e-06, 1.154698, 0.577349],
            TOL,
            "turns",
        );
    }

    #[test]
    fn anchor_state_groups() {
        // Two states after turn 0 (`x`, `y`), each with its own pair of actions.
        let mk = |r: Vec<f64>, s: &str| {
            Rollout::with_turns(0, 2, 0.0)
                .with_turn_rewards(r)
                .with_steps(vec![], vec!["q".into(), s.into()])
        };
        let batch = AdvantageBatch::new(vec![
            mk(vec![1.0, 1.0], "x"),
            mk(vec![1.0, 0.0], "x"),
            mk(vec![0.0, 1.0], "y"),
            mk(vec![0.0, 1.0], "y"),
        ]);
        let cfg = MtGrpoConfig {
            state_key: TurnGroupKey::Anchor,
            ..MtGrpoConfig::default()
        };
        let out = cfg.estimate(&batch).unwrap();
        // turn 1 groups {1,0} → ±0.5 / (std_u + ε) = ±0.707106, {1,1} → 0
        let h = 0.5 / (0.5f64.sqrt() + 1e-6);
        assert_all_close(&out.rollouts[1].turns, &[0.866024 - h, -h], TOL, "r1");
        assert_all_close(&out.rollouts[3].turns, &[-0.866024, 0.0], TOL, "r3");
    }

    /// Review B 4.1: chains of different lengths. A = [0.3, 1.0] ends at turn 1, B =
    /// [0.0, −0.1, 0.2] continues, C = [0.3, 0.2] ends at turn 1. The default groups never mix
    /// B's intermediate −0.1 with A's and C's final rewards (`prompt_turn` does), and B's final
    /// reward, at turn 2, is normalised with A's and C's, at turn 1.
    #[test]
    fn final_and_intermediate_rewards_never_share_a_turn_group() {
        let mk = |r: Vec<f64>| Rollout::with_turns(0, r.len(), 0.0).with_turn_rewards(r);
        let batch = AdvantageBatch::new(vec![
            mk(vec![0.3, 1.0]),
            mk(vec![0.0, -0.1, 0.2]),
            mk(vec![0.3, 0.2]),
        ]);
        let out = MtGrpoConfig::default().estimate(&batch).unwrap();
        // Turn 0 (all intermediate): [0.3, 0, 0.3] → mean 0.2, std_u 0.173205.
        let t0 = |x: f64| (x - 0.2) / (0.03f64.sqrt() + 1e-6);
        // The finals {1.0, 0.2, 0.2} of all three, at turns 1, 2 and 1: mean 0.466667,
        // std_u 0.461880. B's −0.1 is alone in its turn-1 group: a singleton keeps its raw
        // reward. Ā sums the turn advantages from turn k on.
        let sd = (0.64f64 / 3.0).sqrt() + 1e-6;
        let (hi, lo) = ((1.0 - 0.4 - 0.2 / 3.0) / sd, (0.2 - 0.4 - 0.2 / 3.0) / sd);
        assert_all_close(&out.rollouts[0].turns, &[t0(0.3) + hi, hi], TOL, "A");
        assert_all_close(
            &out.rollouts[1].turns,
            &[t0(0.0) - 0.1 + lo, -0.1 + lo, lo],
            TOL,
            "B",
        );
        assert_all_close(&out.rollouts[2].turns, &[t0(0.3) + lo, lo], TOL, "C");
        let mixed = MtGrpoConfig {
            state_key: TurnGroupKey::PromptTurn,
            ..MtGrpoConfig::default()
        }
        .estimate(&batch)
        .unwrap();
        // There, B's final reward sits alone at turn 2 and keeps its raw 0.2.
        assert!((mixed.rollouts[1].turns[2] - 0.2).abs() < TOL);
        assert!((mixed.rollouts[1].turns[2] - out.rollouts[1].turns[2]).abs() > 0.5);
    }

    /// The choice between answering and searching gets a signal: with the same final reward,
    /// a rollout that searched and answered right is ahead of one that answered wrong at once,
    /// and vice versa; keyed by the answer's turn as well, each would sit alone in its final
    /// group and the two outcomes would never be compared.
    #[test]
    fn answering_at_once_is_compared_with_searching_first() {
        let mk = |r: Vec<f64>| Rollout::with_turns(0, r.len(), 0.0).with_turn_rewards(r);
        // Searched (intermediate 0.3), then right (1.0); answered at once, wrong (0.2).
        let batch = AdvantageBatch::new(vec![mk(vec![0.3, 1.0]), mk(vec![0.2])]);
        let out = MtGrpoConfig::default().estimate(&batch).unwrap();
        assert!(out.rollouts[0].turns[0] > 0.0 && out.rollouts[0].turns[1] > 0.0);
        assert!(
            out.rollouts[1].turns[0] < 0.0,
            "{:?}",
            out.rollouts[1].turns
        );
        let swapped = AdvantageBatch::new(vec![mk(vec![0.3, 0.2]), mk(vec![1.0])]);
        let out = MtGrpoConfig::default().estimate(&swapped).unwrap();
        assert!(out.rollouts[1].turns[0] > 0.0 && out.rollouts[0].turns[1] < 0.0);
    }

    #[test]
    fn two_turn_code_variant() {
        // Outcomes [1,0,0,1] → A_out = ±0.865875 (§3.1 MT-code vector); first-turn rewards
        // [0.7,0.7,0,0] → A_turn = ±0.35 / (std_u + 1e-4) = ±0.865811; rollout 3 has no tool
        // result → normalized combined reward.
        let batch = AdvantageBatch::new(vec![
            Rollout::new(0, vec![0, 0, -1, -1, 1], 1.0).with_turn_rewards(vec![0.7]),
            Rollout::new(0, vec![0, -1, 1, 1], 0.0).with_turn_rewards(vec![0.7]),
            Rollout::new(0, vec![0, -1, 1], 0.0).with_turn_rewards(vec![0.0]),
            Rollout::new(0, vec![0, 0], 1.0).with_turn_rewards(vec![0.0]),
        ]);
        let out = MtGrpoCodeConfig::default().estimate(&batch).unwrap();
        let (a, t) = (0.865875, 0.865811);
        assert_all_close(
            &out.rollouts[0].tokens,
            &[a + t, a + t, 0.0, 0.0, a],
            TOL,
            "r0",
        );
        assert_all_close(&out.rollouts[1].tokens, &[-a + t, 0.0, -a, -a], TOL, "r1");
        assert_all_close(&out.rollouts[2].tokens, &[-a - t, 0.0, -a], TOL, "r2");
        // combined scores [1.7, 0.7, 0, 1]: mean 0.85, std_u = sqrt(1.49 / 3)
        let comb = (1.0 - 0.85) / ((1.49f64 / 3.0).sqrt() + 1e-4);
        assert_all_close(&out.rollouts[3].tokens, &[comb, comb], TOL, "r3");
    }

    #[test]
    fn per_turn_lengths_checked() {
        let batch = AdvantageBatch::new(vec![
            Rollout::new(0, vec![0, -1, 1], 1.0).with_turn_rewards(vec![0.1]),
        ]);
        let err = MtGrpoConfig::default().estimate(&batch).unwrap_err();
        assert!(matches!(
            err,
            AdvantageError::LengthMismatch {
                rollout: 0,
                field: "turn_rewards",
                got: 1,
                expected: 2,
                ..
            }
        ));
    }
}
