//! §3.3 GAE for PPO / MT-PPO / ST-PPO [CODE VERL `compute_gae_advantage_return`; old forks:
//! Search-R1 core_algos.py].
//!
//! ```text
//! δ_t = r_t + γ V_{t+1} − V_t,   A_t = δ_t + γ λ A_{t+1},   returns_t = A_t + V_t
//! ```

use serde::{Deserialize, Serialize};

use crate::range::Range;

use super::contract::{self, KlPlacement, MetricDoc, Metrics, Needs};
use super::error::settings_result;
use super::input::{check_len, validate_common};
use super::kernels::masked_whiten;
use super::output::first_token_per_turn;
use super::{
    AdvantageBatch, AdvantageError, AdvantageOutput, Estimator, Rollout, RolloutAdvantage,
};

/// Settings of `gae`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GaeConfig {
    /// Discount γ (1.0 in every PPO paper here).
    pub gamma: f64,
    /// GAE λ (1.0 in every PPO paper here).
    pub lam: f64,
    /// Current VERL: observation tokens are skipped (next value and running advantage carried
    /// through). `false` = old Search-R1/IGPO/ATPO forks: recursion over every position.
    pub skip_observations: bool,
    /// Batch-level `masked_whiten` of the advantages (VERL always whitens GAE advantages); the
    /// mask is the loss mask when skipping observations, all tokens (attention mask) otherwise.
    pub whiten: bool,
}

impl Default for GaeConfig {
    fn default() -> Self {
        Self {
            gamma: 1.0,
            lam: 1.0,
            skip_observations: true,
            whiten: true,
        }
    }
}

/// Token reward placement (turn-level-rewards.md eq. 10, §3.3 \[REC\]): `turn_rewards[k]` on the
/// last loss-mask token of turn `k`, the outcome on the last loss-mask token of the rollout.
/// Errors (as `message`) when a rewarded turn has no token.
pub fn place_turn_rewards(
    turn_id: &[i32],
    turn_rewards: &[f64],
    outcome: f64,
) -> Result<Vec<f64>, String> {
    let mut r = vec![0.0; turn_id.len()];
    for (k, &rk) in turn_rewards.iter().enumerate() {
        match turn_id.iter().rposition(|&t| t >= 0 && t as usize == k) {
            Some(p) => r[p] += rk,
            None if rk == 0.0 => {}
            None => return Err(format!("turn {k} has a turn reward but no agent token")),
        }
    }
    match turn_id.iter().rposition(|&t| t >= 0) {
        Some(p) => r[p] += outcome,
        None if outcome == 0.0 => {}
        None => return Err("no agent token to carry the outcome reward".to_string()),
    }
    Ok(r)
}

/// GAE over one sequence; returns `(advantages, returns)` (unwhitened). `mask[t]` = loss mask;
/// with `skip_observations`, masked positions carry the next value and running advantage
/// through unchanged (current VERL), otherwise they take part in the recursion (old forks).
/// `V` after the last position is 0.
pub fn gae_sequence(
    rewards: &[f64],
    values: &[f64],
    mask: &[bool],
    gamma: f64,
    lam: f64,
    skip_observations: bool,
) -> (Vec<f64>, Vec<f64>) {
    let n = rewards.len();
    let mut adv = vec![0.0; n];
    let mut next_value = 0.0;
    let mut last_gae = 0.0;
    for t in (0..n).rev() {
        let delta = rewards[t] + gamma * next_value - values[t];
        let gae_t = delta + gamma * lam * last_gae;
        if !skip_observations || mask[t] {
            next_value = values[t];
            last_gae = gae_t;
        }
        adv[t] = last_gae;
    }
    let returns = adv.iter().zip(values).map(|(a, v)| a + v).collect();
    (adv, returns)
}

fn token_rewards(name: &'static str, i: usize, r: &Rollout) -> Result<Vec<f64>, AdvantageError> {
    if let Some(tr) = &r.token_rewards {
        check_len(name, i, "token_rewards", tr.len(), r.turn_id.len())?;
        return Ok(tr.clone());
    }
    if !r.turn_rewards.is_empty() {
        check_len(name, i, "turn_rewards", r.turn_rewards.len(), r.num_turns)?;
    }
    place_turn_rewards(&r.turn_id, &r.turn_rewards, r.outcome).map_err(|message| {
        AdvantageError::InvalidRollout {
            estimator: name,
            rollout: i,
            message,
        }
    })
}

impl Estimator for GaeConfig {
    fn name(&self) -> &'static str {
        "gae"
    }

    fn validate(&self) -> Result<(), AdvantageError> {
        let mut p = Vec::new();
        Range::UnitInterval.check(&mut p, "gamma", self.gamma);
        Range::UnitInterval.check(&mut p, "lam", self.lam);
        settings_result("gae", p)
    }

    fn needs(&self) -> Needs {
        Needs {
            critic_values: true,
            final_reward_in_outcome: true,
            ..Needs::default()
        }
    }

    fn kl_placement(&self) -> Option<KlPlacement> {
        Some(KlPlacement::TokenRewards)
    }

    fn metrics(&self, batch: &AdvantageBatch, _out: &AdvantageOutput) -> Metrics {
        contract::gae_metrics(batch)
    }

    fn metric_docs(&self) -> &'static [MetricDoc] {
        &[MetricDoc {
            key: "mt_ppo/turn_rewards_placed",
            label: "MT-PPO turn rewards placed",
        }]
    }

    fn estimate(&self, batch: &AdvantageBatch) -> Result<AdvantageOutput, AdvantageError> {
        let name = self.name();
        validate_common(name, batch)?;
        let mut advs = Vec::with_capacity(batch.rollouts.len());
        let mut rets = Vec::with_capacity(batch.rollouts.len());
        for (i, r) in batch.rollouts.iter().enumerate() {
            let values = r.values.as_ref().ok_or(AdvantageError::MissingInput {
                estimator: name,
                rollout: i,
                field: "values",
            })?;
            check_len(name, i, "values", values.len(), r.turn_id.len())?;
            let rewards = token_rewards(name, i, r)?;
            let (a, ret) = gae_sequence(
                &rewards,
                values,
                &r.loss_mask(),
                self.gamma,
                self.lam,
                self.skip_observations,
            );
            advs.push(a);
            rets.push(ret);
        }
        if self.whiten {
            let flat: Vec<f64> = advs.iter().flatten().copied().collect();
            let mask: Vec<bool> = batch
                .rollouts
                .iter()
                .flat_map(|r| r.turn_id.iter().map(|&t| !self.skip_observations || t >= 0))
                .collect();
            let w = masked_whiten(&flat, &mask)?;
            let mut pos = 0;
            for a in &mut advs {
                let n = a.len();
                a.copy_from_slice(&w[pos..pos + n]);
                pos += n;
            }
        }
        let rollouts = batch
            .rollouts
            .iter()
            .zip(advs.into_iter().zip(rets))
            .map(|(r, (a, ret))| RolloutAdvantage {
                turns: first_token_per_turn(&r.turn_id, &a, r.num_turns),
                tokens: a,
                returns: Some(ret),
                ..RolloutAdvantage::default()
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
    use crate::test_util::{TOL, assert_all_close};

    const TURN_ID: [i32; 6] = [0, 0, -1, -1, 1, 1];
    const REWARDS: [f64; 6] = [0.0, 0.2, 0.0, 0.0, 0.0, 1.0];
    const VALUES: [f64; 6] = [0.5, 0.6, 0.9, 0.9, 0.7, 0.8];

    fn spec_rollout() -> Rollout {
        Rollout::new(0, TURN_ID.to_vec(), 1.0)
            .with_turn_rewards(vec![0.2, 0.0])
            .with_values(VALUES.to_vec())
    }

    fn run(cfg: GaeConfig) -> RolloutAdvantage {
        let out = cfg
            .estimate(&AdvantageBatch::new(vec![spec_rollout()]))
            .unwrap();
        out.rollouts.into_iter().next().unwrap()
    }

    #[test]
    fn spec_3_3_reward_placement() {
        let r = place_turn_rewards(&TURN_ID, &[0.2, 0.0], 1.0).unwrap();
        assert_all_close(&r, &REWARDS, 1e-12, "placed rewards");
    }

    #[test]
    fn spec_3_3_skip_masked_gamma_lambda_1() {
        let cfg = GaeConfig {
            whiten: false,
            ..GaeConfig::default()
        };
        let out = run(cfg);
        assert_all_close(&out.tokens, &[0.7, 0.6, 0.3, 0.3, 0.3, 0.2], TOL, "A");
        assert_all_close(
            out.returns.as_ref().unwrap(),
            &[1.2, 1.2, 1.2, 1.2, 1.0, 1.0],
            TOL,
            "R",
        );
        assert_all_close(&out.turns, &[0.7, 0.3], TOL, "turns");
    }

    #[test]
    fn spec_3_3_no_skip_gamma_lambda_1() {
        let mask: Vec<bool> = TURN_ID.iter().map(|&t| t >= 0).collect();
        let (a, _) = gae_sequence(&REWARDS, &VALUES, &mask, 1.0, 1.0, false);
        assert_all_close(&a, &[0.7, 0.6, 0.1, 0.1, 0.3, 0.2], TOL, "A no-skip");
    }

    #[test]
    fn spec_3_3_skip_masked_gamma_09_lambda_095() {
        let mask: Vec<bool> = TURN_ID.iter().map(|&t| t >= 0).collect();
        let (a, _) = gae_sequence(&REWARDS, &VALUES, &mask, 0.9, 0.95, true);
        assert_all_close(
            &a,
            &[0.376276, 0.393305, 0.191, 0.191, 0.191, 0.2],
            TOL,
            "A",
        );
    }

    #[test]
    fn spec_3_3_whitened() {
        let out = run(GaeConfig::default());
        assert_all_close(
            &out.tokens,
            &[1.05021, 0.630126, -0.630126, -0.630126, -0.630126, -1.05021],
            TOL,
            "whitened",
        );
        // returns are computed before whitening
        assert_all_close(
            out.returns.as_ref().unwrap(),
            &[1.2, 1.2, 1.2, 1.2, 1.0, 1.0],
            TOL,
            "R",
        );
    }

    #[test]
    fn missing_values_is_an_error() {
        let batch = AdvantageBatch::new(vec![spec_rollout(), Rollout::new(0, vec![0, 0], 1.0)]);
        let err = GaeConfig::default().estimate(&batch).unwrap_err();
        assert_eq!(
            err,
            AdvantageError::MissingInput {
                estimator: "gae",
                rollout: 1,
                field: "values"
            }
        );
        assert_eq!(
            err.to_string(),
            "advantage estimator `gae`: rollout 1 is missing `values`"
        );
    }

    #[test]
    fn whiten_single_token_is_an_error() {
        let batch = AdvantageBatch::new(vec![Rollout::new(0, vec![0], 1.0).with_values(vec![0.0])]);
        let err = GaeConfig::default().estimate(&batch).unwrap_err();
        assert_eq!(err, AdvantageError::WhitenTooFew { count: 1 });
    }

    #[test]
    fn explicit_token_rewards_length_checked() {
        let r = spec_rollout().with_token_rewards(vec![0.0; 5]);
        let err = GaeConfig::default()
            .estimate(&AdvantageBatch::new(vec![r]))
            .unwrap_err();
        assert!(matches!(
            err,
            AdvantageError::LengthMismatch {
                field: "token_rewards",
                ..
            }
        ));
    }
}
