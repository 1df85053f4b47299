//! MT-PPO verifiable turn-level rewards (spec §2.4) [PAPER turn-level-rewards.md §5.2].
//!
//! ```text
//! R^F   = 1 if f_format and f_em;  0.2 if f_format only;  −1 if not f_format
//! R^I_k = R_retrieval (0.3 if a gold is in this turn's <information>, else 0)
//!       + R_format    (+0.1 if the turn is <think><search><information>, once each; else −0.2)
//!       + R_search    (−λ_s · n_search(≤ k), λ_s = 0.1)
//! ```
//!
//! Placement in the token reward vector (R^I at the end of turn k, R^F at the end) is done by
//! the advantage code (§3.3).

use serde::{Deserialize, Serialize};

use super::TurnText;
use super::text::em;
use crate::grammar::search_r1::{self, AnswerRule};
use crate::grammar::{Format, mt_ppo, parse_turn, scan};

/// Settings of the MT-PPO rewards; defaults are the paper's values (§2.4, §6.1 λ_s = 0.1).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MtPpoConfig {
    /// `R^F` for correct format and correct answer.
    pub final_correct: f64,
    /// `R^F` for correct format and wrong answer.
    pub final_format_only: f64,
    /// `R^F` for a format failure.
    pub final_format_failure: f64,
    /// `R_retrieval` when a gold appears in the turn's `<information>`.
    pub retrieval: f64,
    /// `R_format` for a correct intermediate turn.
    pub format_ok: f64,
    /// `R_format` for an incorrect intermediate turn.
    pub format_bad: f64,
    /// λ_s, the per-search penalty (times the cumulative search count).
    pub lambda_search: f64,
}

impl Default for MtPpoConfig {
    fn default() -> Self {
        Self {
            final_correct: 1.0,
            final_format_only: 0.2,
            final_format_failure: -1.0,
            retrieval: 0.3,
            format_ok: 0.1,
            format_bad: -0.2,
            lambda_search: 0.1,
        }
    }
}

/// Final-turn reward `R^F` from the two verdicts.
pub fn final_reward_from(format_ok: bool, em_ok: bool, cfg: &MtPpoConfig) -> f64 {
    match (format_ok, em_ok) {
        (true, true) => cfg.final_correct,
        (true, false) => cfg.final_format_only,
        (false, _) => cfg.final_format_failure,
    }
}

/// Final-turn reward `R^F` of the final agent turn text: `f_format` =
/// [`mt_ppo::final_turn_format`]; `f_em` = §2.1 EM of the last `<answer>` (\[REC\] for the
/// paper's "lowercasing and whitespace removal").
pub fn final_reward<S: AsRef<str>>(final_turn: &str, golds: &[S], cfg: &MtPpoConfig) -> f64 {
    let format_ok = mt_ppo::final_turn_format(final_turn).is_ok();
    let em_ok = search_r1::extract_answer(final_turn, AnswerRule::LastMatch)
        .is_some_and(|a| em(a, golds) == 1.0);
    final_reward_from(format_ok, em_ok, cfg)
}

/// The three parts of an intermediate reward, kept separate for logging.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct IntermediateReward {
    /// `R_retrieval`.
    pub retrieval: f64,
    /// `R_format`.
    pub format: f64,
    /// `R_search = −λ_s · n_search(≤ k)`.
    pub search: f64,
}

impl IntermediateReward {
    /// `R^I_k`, the sum of the parts.
    pub fn total(&self) -> f64 {
        self.retrieval + self.format + self.search
    }
}

/// Whether some gold appears, case-insensitively, in the `<information>` content of
/// `observation` (the whole observation when it has no `<information>` block).
pub fn retrieval_hit<S: AsRef<str>>(observation: &str, golds: &[S]) -> bool {
    let blocks = scan::blocks(observation, "<information>", "</information>");
    let hay = if blocks.is_empty() {
        observation.to_lowercase()
    } else {
        blocks
            .iter()
            .map(|b| b.content)
            .collect::<Vec<_>>()
            .join("\n")
            .to_lowercase()
    };
    golds
        .iter()
        .any(|g| hay.contains(&g.as_ref().to_lowercase()))
}

/// Intermediate reward `R^I_k` of one search turn from its parts: `format_ok` (the
/// [`mt_ppo::intermediate_turn_format`] verdict on agent text + observation), `retrieved`
/// ([`retrieval_hit`]) and the cumulative number of searches `n_search` up to this turn.
pub fn intermediate_reward_from(
    format_ok: bool,
    retrieved: bool,
    n_search: usize,
    cfg: &MtPpoConfig,
) -> IntermediateReward {
    IntermediateReward {
        retrieval: if retrieved { cfg.retrieval } else { 0.0 },
        format: if format_ok {
            cfg.format_ok
        } else {
            cfg.format_bad
        },
        search: -cfg.lambda_search * n_search as f64,
    }
}

/// Intermediate reward of one turn given its text: the format rule reads the agent segment
/// followed by the observation's [`observation_placeholder`](super::agent::observation_placeholder)
/// (its wrapper tags, no passages); the retrieval credit reads the observation.
pub fn intermediate_reward<S: AsRef<str>>(
    turn: &TurnText<'_>,
    golds: &[S],
    n_search: usize,
    cfg: &MtPpoConfig,
) -> IntermediateReward {
    // The format rule sees the agent's text and only the observation's wrapper tags; the
    // retrieval credit reads the passages (see `super::agent`).
    let placeholder = turn
        .observation
        .map(super::agent::observation_placeholder)
        .unwrap_or_default();
    let format_ok =
        mt_ppo::intermediate_turn_format(&format!("{}{placeholder}", turn.generated)).is_ok();
    let obs = turn.observation.unwrap_or("");
    intermediate_reward_from(format_ok, retrieval_hit(obs, golds), n_search, cfg)
}

/// Per-turn rewards of a rollout: `R^I_k` for every turn but the last (`n_search` counts the
/// turns so far whose Search-R1 action is a search), `R^F` for the last. Empty input → empty.
pub fn turn_rewards<S: AsRef<str>>(
    turns: &[TurnText<'_>],
    golds: &[S],
    cfg: &MtPpoConfig,
) -> Vec<f64> {
    let Some((last, inter)) = turns.split_last() else {
        return Vec::new();
    };
    let mut n_search = 0;
    let mut out = Vec::with_capacity(turns.len());
    for t in inter {
        n_search += usize::from(parse_turn(Format::SearchR1, t.generated).action.is_search());
        out.push(intermediate_reward(t, golds, n_search, cfg).total());
    }
    out.push(final_reward(last.generated, golds, cfg));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{TOL, assert_all_close, assert_close};

    /// §2.4 turn vectors (λ_s = 0.1), from the parts:
    /// turn 1: +0.1 (format) + 0 − 0.1·1 = 0.0; turn 2: +0.1 + 0.3 − 0.1·2 = 0.2;
    /// turn 3: −0.2 + 0 − 0.1·3 = −0.5.
    #[test]
    fn spec_2_4_intermediate_vectors_from_parts() {
        let cfg = MtPpoConfig::default();
        assert_close(
            intermediate_reward_from(true, false, 1, &cfg).total(),
            0.0,
            TOL,
            "turn 1",
        );
        assert_close(
            intermediate_reward_from(true, true, 2, &cfg).total(),
            0.2,
            TOL,
            "turn 2",
        );
        assert_close(
            intermediate_reward_from(false, false, 3, &cfg).total(),
            -0.5,
            TOL,
            "turn 3",
        );
    }

    /// §2.4 R^F vectors: 1.0 / 0.2 / −1.0.
    #[test]
    fn spec_2_4_final_vectors() {
        let cfg = MtPpoConfig::default();
        let g = ["Beatles"];
        assert_close(
            final_reward("<think>a</think><answer>The Beatles</answer>", &g, &cfg),
            1.0,
            TOL,
            "R^F em",
        );
        assert_close(
            final_reward("<think>a</think><answer>Stones</answer>", &g, &cfg),
            0.2,
            TOL,
            "R^F fmt",
        );
        assert_close(
            final_reward("<answer>Beatles</answer>", &g, &cfg),
            -1.0,
            TOL,
            "R^F bad",
        );
        assert_close(
            final_reward_from(false, true, &cfg),
            -1.0,
            TOL,
            "R^F bad but right",
        );
    }

    /// The same vectors from text: a 4-turn rollout whose turns 1–3 are the spec's cases
    /// (turn 3 searches without `<think>`), then a correct final answer.
    #[test]
    fn spec_2_4_rollout_from_text() {
        let obs1 = "\n\n<information>Doc 1(Title: Rock) a band</information>\n\n";
        let obs2 = "\n\n<information>Doc 1(Title: Beatles) the beatles were</information>\n\n";
        let obs3 = "\n\n<information>Doc 1(Title: x) y</information>\n\n";
        let turns = [
            TurnText {
                generated: "<think>a</think><search>q1</search>",
                observation: Some(obs1),
            },
            TurnText {
                generated: "<think>b</think><search>q2</search>",
                observation: Some(obs2),
            },
            TurnText {
                generated: "<search>q3</search>",
                observation: Some(obs3),
            },
            TurnText {
                generated: "<think>c</think><answer>Beatles</answer>",
                observation: None,
            },
        ];
        let got = turn_rewards(&turns, &["Beatles"], &MtPpoConfig::default());
        assert_all_close(&got, &[0.0, 0.2, -0.5, 1.0], TOL, "MT-PPO turn rewards");
        assert!(turn_rewards::<&str>(&[], &[], &MtPpoConfig::default()).is_empty());
    }
}
