//! T2PO format penalty (spec §2.6, §9 item 10) [PAPER t2po.md App. B.2; CODE T2PO scripts +
//! verl-agent `apply_invalid_action_penalty`].
//!
//! - Paper placement: if the strict validator `V_strict` fails, `r ← r − λ_fmt` on the final
//!   task reward (λ_fmt = 0.1).
//! - Code placement: every step sample whose action is invalid (`is_action_valid = 0`) has
//!   `invalid_action_penalty_coef = 0.1` subtracted from its own reward.

use serde::{Deserialize, Serialize};

use super::text::em;
use crate::grammar::t2po::{self, TargetScript};
use crate::grammar::{Action, Format, parse_turn, rules};

/// λ_fmt = `invalid_action_penalty_coef` = 0.1.
pub const T2PO_FORMAT_PENALTY: f64 = 0.1;

/// Where the T2PO format penalty goes (§9 item 10).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PenaltyPlacement {
    /// Paper: subtract λ once from the final (last-step) reward if any step fails `V_strict`.
    FinalReward,
    /// Code [REC, what the published runs used]: subtract λ from each step whose action is
    /// invalid (`is_action_valid = 0`).
    #[default]
    PerInvalidStep,
}

/// Applies the penalty to per-step rewards. `step_ok[k]` is the verdict the placement uses
/// (`V_strict` for [`PenaltyPlacement::FinalReward`], `is_action_valid` for
/// [`PenaltyPlacement::PerInvalidStep`]). Slices of different lengths are zipped (the shorter
/// length wins); an empty input gives an empty output.
pub fn apply_format_penalty(
    step_rewards: &[f64],
    step_ok: &[bool],
    lambda: f64,
    placement: PenaltyPlacement,
) -> Vec<f64> {
    let n = step_rewards.len().min(step_ok.len());
    let mut out = step_rewards[..n].to_vec();
    match placement {
        PenaltyPlacement::FinalReward => {
            if step_ok[..n].iter().any(|ok| !ok)
                && let Some(last) = out.last_mut()
            {
                *last -= lambda;
            }
        }
        PenaltyPlacement::PerInvalidStep => {
            for (r, ok) in out.iter_mut().zip(step_ok) {
                if !ok {
                    *r -= lambda;
                }
            }
        }
    }
    out
}

/// Settings of the T2PO search-environment reward.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct T2poRewardConfig {
    /// λ_fmt, default 0.1.
    pub lambda_fmt: f64,
    /// Paper or code placement.
    pub placement: PenaltyPlacement,
    /// Target language of `V_strict`.
    pub script: TargetScript,
}

impl Default for T2poRewardConfig {
    fn default() -> Self {
        Self {
            lambda_fmt: T2PO_FORMAT_PENALTY,
            placement: PenaltyPlacement::default(),
            script: TargetScript::default(),
        }
    }
}

/// Per-step rewards of a T2PO search episode given each step's output text.
///
/// Environment reward (search env): the step whose action is an answer ends the episode and
/// gets the §2.1 EM of that answer; every other step gets 0. The format penalty is then applied
/// per `cfg.placement`, with `V_strict` ([`t2po::v_strict`]) or `is_action_valid`
/// ([`t2po::project_search_action`] on the `<action>` payload) as the step verdict.
pub fn step_rewards<S: AsRef<str>>(
    steps: &[&str],
    golds: &[S],
    cfg: &T2poRewardConfig,
) -> Vec<f64> {
    let (env, ok) = step_parts(steps, golds, cfg);
    apply_format_penalty(&env, &ok, cfg.lambda_fmt, cfg.placement)
}

/// The two parts of [`step_rewards`]: the environment reward of every step (EM on the answer
/// step, 0 elsewhere) and the step verdict the placement uses.
fn step_parts<S: AsRef<str>>(
    steps: &[&str],
    golds: &[S],
    cfg: &T2poRewardConfig,
) -> (Vec<f64>, Vec<bool>) {
    let mut env = Vec::with_capacity(steps.len());
    let mut ok = Vec::with_capacity(steps.len());
    for s in steps {
        let p = t2po::parse_turn(s, cfg.script);
        env.push(match &p.action {
            Action::Answer { text } => em(text, golds),
            _ => 0.0,
        });
        let rule = match cfg.placement {
            PenaltyPlacement::FinalReward => rules::T2PO_STRICT,
            PenaltyPlacement::PerInvalidStep => rules::ACTION_VALID,
        };
        ok.push(p.verdict.passed(rule).unwrap_or(false));
    }
    (env, ok)
}

/// The format penalty each step of a T2PO search episode received in [`step_rewards`] (λ on
/// every invalid step for [`PenaltyPlacement::PerInvalidStep`]; λ on the last step when any
/// step fails `V_strict` for [`PenaltyPlacement::FinalReward`]; 0 elsewhere). The trainer uses
/// it to lower the episode score of only the invalid step's sample (verl-agent, spec §2.6).
pub fn step_penalties<S: AsRef<str>>(
    steps: &[&str],
    golds: &[S],
    cfg: &T2poRewardConfig,
) -> Vec<f64> {
    let (env, ok) = step_parts(steps, golds, cfg);
    let penalised = apply_format_penalty(&env, &ok, cfg.lambda_fmt, cfg.placement);
    env.iter().zip(&penalised).map(|(e, p)| e - p).collect()
}

/// `true` when a step output passes `V_strict` with the default target script (a shortcut for
/// [`parse_turn`]`(Format::T2po, …)`).
pub fn passes_strict(step: &str) -> bool {
    parse_turn(Format::T2po, step)
        .verdict
        .passed(rules::T2PO_STRICT)
        == Some(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{TOL, assert_all_close};

    /// §2.6, both placements on env rewards [0, 0, 1] with step 2 invalid:
    /// paper → only the final reward drops by 0.1: [0, 0, 0.9];
    /// code  → the invalid step drops by 0.1: [0, −0.1, 1].
    #[test]
    fn spec_2_6_penalty_placements() {
        let env = [0.0, 0.0, 1.0];
        let ok = [true, false, true];
        assert_all_close(
            &apply_format_penalty(&env, &ok, 0.1, PenaltyPlacement::FinalReward),
            &[0.0, 0.0, 0.9],
            TOL,
            "paper",
        );
        assert_all_close(
            &apply_format_penalty(&env, &ok, 0.1, PenaltyPlacement::PerInvalidStep),
            &[0.0, -0.1, 1.0],
            TOL,
            "code",
        );
        assert_all_close(
            &apply_format_penalty(&env, &[true; 3], 0.1, PenaltyPlacement::FinalReward),
            &env,
            TOL,
            "clean",
        );
    }

    /// A three-step episode from text: step 1 strict-valid search; step 2 has both tags
    /// (is_action_valid = 0, V_strict passes since it checks only the outer tags); step 3
    /// answers correctly but with text outside the tags (V_strict = 0, action valid).
    /// Env rewards [0, 0, 1]. Paper: V_strict fails on step 3 → [0, 0, 0.9].
    /// Code: step 2 invalid → [0, −0.1, 1].
    #[test]
    fn spec_2_6_episode_from_text() {
        let steps = [
            "<think>a</think>\n<action><search>q</search></action>",
            "<think>b</think><action><search>q</search><answer>x</answer></action>",
            "ok <think>c</think><action><answer>Paris</answer></action>",
        ];
        let paper = T2poRewardConfig {
            placement: PenaltyPlacement::FinalReward,
            ..Default::default()
        };
        assert_all_close(
            &step_rewards(&steps, &["Paris"], &paper),
            &[0.0, 0.0, 0.9],
            TOL,
            "paper",
        );
        let code = T2poRewardConfig::default();
        assert_all_close(
            &step_rewards(&steps, &["Paris"], &code),
            &[0.0, -0.1, 1.0],
            TOL,
            "code",
        );
        assert!(passes_strict(steps[0]));
        assert!(!passes_strict(steps[2]));
    }
}
