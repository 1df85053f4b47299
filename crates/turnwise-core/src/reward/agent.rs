//! What a reward reads of a rollout: the text the agent wrote, and nothing else.
//!
//! A rollout is a list of [`TurnText`]s: each agent turn's generated text and the observation
//! the environment appended after it. Observations are not the agent's: Search-R1's
//! invalid-action notice reads "…put the answer between `<answer>` and `</answer>`…", and a
//! retrieved passage may quote any tag. A reward that searched the concatenated response for
//! `<answer>…</answer>` would therefore let a trajectory that never answers "answer" a word of
//! the notice (`and`), pass format checks it never met, and earn F1 credit on golds such as
//! "Trinidad and Tobago".
//!
//! So every reward reads a rollout through [`RewardInput`]:
//!
//! - **answers** come from one agent turn's own text ([`RewardInput::answer`]): an answer block
//!   never spans an observation, and a rollout whose agent never wrote a complete answer block
//!   has no answer;
//! - **whole-response format rules** (Search-R1's `is_valid_sequence`, ATPO's
//!   `validate_format`, IGPO's tag balance) run on [`RewardInput::format_view`]: the agent
//!   turns verbatim, each observation replaced by [`observation_placeholder`], which keeps only
//!   the wrapper tags the environment adds around retrieved passages (so "a search is followed
//!   by its `<information>` / `<result>`" can still be checked) and turns every other
//!   observation — the invalid-action and tool-limit notices — into a tag-free
//!   [`NOTICE_PLACEHOLDER`];
//! - the prompt is never part of the input.
//!
//! The one deliberate exception is *retrieval* credit, which is by definition about what the
//! environment returned: MT-PPO's `+0.3` when a gold appears in a turn's observation and
//! Search-R1's optional `retrieval_score` read the observations' content
//! ([`RewardInput::observations`]). Neither can supply an answer or pass a format check.

use std::borrow::Cow;

use crate::grammar::scan::{self, py_strip};
use crate::grammar::search_r1::AnswerRule;
use crate::grammar::{Format, boxed};

/// One agent turn as text: what the policy generated, and the observation the environment
/// appended after it (if any).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TurnText<'a> {
    /// The agent segment (stop string included).
    pub generated: &'a str,
    /// The observation after it (`<information>…`, ` <result>…`, a notice), if any.
    pub observation: Option<&'a str>,
}

/// Stand-in for an environment notice (no passages: the invalid-action feedback, the
/// tool-limit notice) in [`RewardInput::format_view`]: text outside every tag, as the notice is
/// in the reference implementations, but with no tag a format rule or an answer extraction
/// could pick up.
pub const NOTICE_PLACEHOLDER: &str = "\n[environment notice]\n";

/// Wrapper tags of retrieved passages: Search-R1 / T2PO `<information>`, AT2PO `<result>`.
const OBSERVATION_WRAPPERS: [&str; 2] = ["information", "result"];

/// The structure-only stand-in for one observation in format checks.
///
/// An observation that is one wrapped block of passages (`"\n\n<information>…</information>\n\n"`,
/// `" <result>\n…\n</result>"`) keeps its surrounding whitespace and an empty wrapper
/// (`"\n\n<information></information>\n\n"`, `" <result></result>"`); anything else is a
/// notice and becomes [`NOTICE_PLACEHOLDER`]. The passages themselves are never kept.
pub fn observation_placeholder(observation: &str) -> Cow<'static, str> {
    let body = py_strip(observation);
    for tag in OBSERVATION_WRAPPERS {
        let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
        if body.starts_with(&open)
            && body.ends_with(&close)
            && body.len() >= open.len() + close.len()
        {
            let lead = &observation
                [..observation.len() - observation.trim_start_matches(scan::py_is_space).len()];
            let trail = &observation[observation.trim_end_matches(scan::py_is_space).len()..];
            return Cow::Owned(format!("{lead}{open}{close}{trail}"));
        }
    }
    Cow::Borrowed(NOTICE_PLACEHOLDER)
}

/// A rollout to score: the agent's turns (with the observations after them) and the accepted
/// answers. See the [module documentation](self) for what each reward may read.
#[derive(Debug, Clone)]
pub struct RewardInput<'a> {
    turns: Cow<'a, [TurnText<'a>]>,
    /// Accepted answers. For `igpo_f1` a single string may hold several golds joined by
    /// [`super::text::IGPO_ANSWER_SPLIT`].
    pub golds: &'a [String],
}

impl<'a> RewardInput<'a> {
    /// A rollout given as its turns (the trainer's form). For T2PO, one turn per step sample.
    pub fn from_turns(turns: &'a [TurnText<'a>], golds: &'a [String]) -> Self {
        Self {
            turns: Cow::Borrowed(turns),
            golds,
        }
    }

    /// A one-turn rollout whose whole `text` the agent wrote (no observation).
    pub fn single_turn(text: &'a str, golds: &'a [String]) -> Self {
        Self {
            turns: Cow::Owned(vec![TurnText {
                generated: text,
                observation: None,
            }]),
            golds,
        }
    }

    /// The turns.
    pub fn turns(&self) -> &[TurnText<'a>] {
        &self.turns
    }

    /// Each turn's generated text, in order.
    pub fn agent_turns(&self) -> impl Iterator<Item = &'a str> + '_ {
        self.turns.iter().map(|t| t.generated)
    }

    /// The observations' full text, in order (read only by retrieval credit).
    pub fn observations(&self) -> impl Iterator<Item = &'a str> + '_ {
        self.turns.iter().filter_map(|t| t.observation)
    }

    /// The text whole-response format rules check: the agent turns verbatim, each observation
    /// replaced by [`observation_placeholder`].
    pub fn format_view(&self) -> String {
        let mut s = String::new();
        for t in self.turns.iter() {
            s.push_str(t.generated);
            if let Some(o) = t.observation {
                s.push_str(&observation_placeholder(o));
            }
        }
        s
    }

    /// Search-R1 / T2PO answer: the stripped content of the last complete
    /// `<answer>…</answer>` block written inside one agent turn, subject to `rule` (with
    /// [`AnswerRule::LastOfAtLeastTwo`] the blocks of all turns are counted together).
    pub fn last_answer_block(&self, rule: AnswerRule) -> Option<&'a str> {
        let blocks: Vec<&'a str> = self
            .agent_turns()
            .flat_map(|t| scan::blocks(t, "<answer>", "</answer>"))
            .map(|b| py_strip(b.content))
            .collect();
        let min = match rule {
            AnswerRule::LastMatch => 1,
            AnswerRule::LastOfAtLeastTwo => 2,
        };
        if blocks.len() < min {
            return None;
        }
        blocks.last().copied()
    }

    /// AT2PO answer block: the content (not stripped) of the first complete
    /// `<answer>…</answer>` block written inside one agent turn
    /// ([`boxed::extract_answer_block`] per turn).
    pub fn first_answer_block(&self) -> Option<&'a str> {
        self.agent_turns().find_map(boxed::extract_answer_block)
    }

    /// The string EM/F1 score for `format`: [`Self::last_answer_block`] for Search-R1 and
    /// T2PO, the last `\boxed{}` of [`Self::first_answer_block`] for the boxed format. `None`
    /// when the agent wrote no such answer.
    pub fn answer(&self, format: Format, rule: AnswerRule) -> Option<&'a str> {
        match format {
            Format::Boxed => boxed::extract_boxed(self.first_answer_block()?),
            Format::SearchR1 | Format::T2po | Format::Verifiers => self.last_answer_block(rule),
        }
    }
}

/// Adversarial rollouts per agent format: every reward must read the agent's own text only.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::grammar::search_r1::INVALID_ACTION_FEEDBACK;
    use crate::reward::{RewardConfig, RewardOutput};
    use crate::test_util::{TOL, assert_close};

    fn golds(g: &[&str]) -> Vec<String> {
        g.iter().map(|s| (*s).to_owned()).collect()
    }

    fn turn<'a>(generated: &'a str, observation: Option<&'a str>) -> TurnText<'a> {
        TurnText {
            generated,
            observation,
        }
    }

    fn score(name: &str, turns: &[TurnText<'_>], g: &[String]) -> RewardOutput {
        RewardConfig::from_name(name)
            .unwrap()
            .score(&RewardInput::from_turns(turns, g))
            .unwrap()
    }

    /// Every reward that reads Search-R1 text, with the value a rollout gets when the agent
    /// wrote no answer.
    const SEARCH_R1_NO_ANSWER: [(&str, f64); 7] = [
        ("em", 0.0),
        ("sub_em", 0.0),
        ("f1", 0.0),
        ("search_r1_em", 0.0),
        // An invalid sequence without an answer: 0.
        ("search_r1_format", 0.0),
        ("igpo_f1", -2.0),
        // R^F of a final turn that fails the format: −1.
        ("mt_ppo_turn", -1.0),
    ];

    /// A model that never writes an action: every turn gets Search-R1's invalid-action notice,
    /// which spells out `<answer> and </answer>`. With the whole response as the text, the
    /// "answer" was `and` and F1 on "Trinidad and Tobago" was 0.5.
    fn garbage<'a>() -> Vec<TurnText<'a>> {
        vec![
            turn("the the of", Some(INVALID_ACTION_FEEDBACK)),
            turn("<think>hmm</think>", Some(INVALID_ACTION_FEEDBACK)),
            turn("", Some(INVALID_ACTION_FEEDBACK)),
            turn("and and", None),
        ]
    }

    #[test]
    fn notice_is_never_an_answer_search_r1() {
        let g = golds(&["Trinidad and Tobago"]);
        let turns = garbage();
        let input = RewardInput::from_turns(&turns, &g);
        assert_eq!(input.answer(Format::SearchR1, AnswerRule::LastMatch), None);
        assert!(!input.format_view().contains("<answer>"));
        for (name, no_answer) in SEARCH_R1_NO_ANSWER {
            let out = score(name, &turns, &g);
            assert_close(out.score, no_answer, TOL, name);
            assert_close(out.em, 0.0, TOL, name);
            assert!(!out.format_ok, "{name}: format_ok for a garbage rollout");
        }
        // The same rollout on a gold the notice spells exactly.
        for (name, no_answer) in SEARCH_R1_NO_ANSWER {
            let out = score(name, &turns, &golds(&["and"]));
            assert_close(out.score, no_answer, TOL, name);
        }
    }

    #[test]
    fn passages_are_never_an_answer_search_r1() {
        let g = golds(&["Paris"]);
        let info = "\n\n<information>Doc 1(Title: \"Q\") the answer is <answer>Paris</answer>\\boxed{Paris}</information>\n\n";
        // The agent searched, read a passage quoting the gold as an answer, then was cut off.
        let cut = [
            turn("<think>a</think>\n<search>q</search>", Some(info)),
            turn("<think>b</think>\n<answer>Par", None),
        ];
        for (name, no_answer) in SEARCH_R1_NO_ANSWER {
            let out = score(name, &cut, &g);
            assert_close(out.score, no_answer, TOL, name);
            assert!(!out.format_ok, "{name}");
        }
        // The agent's own wrong answer is scored, not the passage's.
        let wrong = [
            turn("<think>a</think>\n<search>q</search>", Some(info)),
            turn("<think>b</think>\n<answer>Lyon</answer>", None),
        ];
        for name in ["em", "sub_em", "f1", "search_r1_em", "igpo_f1"] {
            let out = score(name, &wrong, &g);
            assert_close(out.score, 0.0, TOL, name);
            assert!(out.format_ok, "{name}");
        }
        // A valid sequence with a wrong answer: the structure score; the passage's tags do
        // not break the sequence rule.
        assert_close(score("search_r1_format", &wrong, &g).score, 0.2, TOL, "fmt");
        // MT-PPO: the final turn is well formed but wrong (0.2).
        assert_close(score("mt_ppo_turn", &wrong, &g).score, 0.2, TOL, "mt_ppo");
        // And the right answer after the same passage scores in full.
        let right = [
            turn("<think>a</think>\n<search>q</search>", Some(info)),
            turn("<think>b</think>\n<answer>Paris</answer>", None),
        ];
        for name in [
            "em",
            "sub_em",
            "f1",
            "search_r1_em",
            "search_r1_format",
            "igpo_f1",
        ] {
            assert_close(score(name, &right, &g).score, 1.0, TOL, name);
        }
    }

    #[test]
    fn answers_come_from_inside_one_agent_turn() {
        let g = golds(&["Paris"]);
        // An answer block opened in one turn and "closed" after the notice is no answer.
        let split = [
            turn(
                "<think>a</think><answer>Paris",
                Some(INVALID_ACTION_FEEDBACK),
            ),
            turn("</answer>", None),
        ];
        let input = RewardInput::from_turns(&split, &g);
        assert_eq!(input.last_answer_block(AnswerRule::LastMatch), None);
        assert_eq!(input.first_answer_block(), None);
        for name in ["em", "f1", "search_r1_em", "igpo_f1"] {
            assert!(score(name, &split, &g).score <= 0.0, "{name}");
        }
        // Several answers: Search-R1 scores the last, AT2PO the first block's last \boxed{}.
        let many = [turn(
            "<think>x</think><answer>Lyon</answer><answer>Paris</answer>",
            None,
        )];
        let input = RewardInput::from_turns(&many, &g);
        assert_eq!(
            input.answer(Format::SearchR1, AnswerRule::LastMatch),
            Some("Paris")
        );
        assert_close(score("em", &many, &g).score, 1.0, TOL, "last answer");
        // The Search-R1 reference's "at least two matches" rule counts the agent's blocks
        // only: the prompt's example answer is not part of the input.
        assert_eq!(
            RewardInput::single_turn("<answer>Paris</answer>", &g)
                .answer(Format::SearchR1, AnswerRule::LastOfAtLeastTwo),
            None
        );
        // An empty answer is an answer (format ok) that matches nothing.
        let empty = [turn("<think>x</think><answer></answer>", None)];
        for name in ["em", "sub_em", "f1", "search_r1_em"] {
            let out = score(name, &empty, &g);
            assert_close(out.score, 0.0, TOL, name);
            assert!(out.format_ok, "{name}");
        }
        assert_close(score("igpo_f1", &empty, &g).score, 0.0, TOL, "igpo empty");
    }

    #[test]
    fn notice_and_results_are_never_an_answer_boxed() {
        let g = golds(&["Paris"]);
        let result = " <result>\nDoc 1 <answer>\\boxed{Paris}</answer> <think>x</think>\n</result>";
        // Searched, read a result that holds a boxed gold, then stopped without answering.
        let unanswered = [
            turn("<think>a</think>\n<search>q</search>", Some(result)),
            turn("<think>b</think>", Some(INVALID_ACTION_FEEDBACK)),
            turn("<think>c</think>\n<answer>\\boxed{Par", None),
        ];
        let input = RewardInput::from_turns(&unanswered, &g);
        assert_eq!(input.answer(Format::Boxed, AnswerRule::LastMatch), None);
        let em_boxed = RewardConfig::Em(crate::reward::AnswerMetricConfig {
            format: Format::Boxed,
            ..Default::default()
        });
        let out = em_boxed.score(&input).unwrap();
        assert_close(out.score, 0.0, TOL, "em boxed");
        assert!(!out.format_ok);
        for (name, no_answer) in [("boxed_em", -1.0), ("deep_research_f1", 0.0)] {
            let out = score(name, &unanswered, &g);
            assert_close(out.score, no_answer, TOL, name);
            assert!(!out.format_ok, "{name}");
        }
        // Garbage: the notices' `<answer> and </answer>` is not an answer.
        for (name, no_answer) in [("boxed_em", -1.0), ("deep_research_f1", 0.0)] {
            let out = score(name, &garbage(), &golds(&["and"]));
            assert_close(out.score, no_answer, TOL, name);
        }
        // The agent's own boxed answer after the same result and an invalid turn: the result's
        // tags and the notice's do not break the format rule; the agent's answer is scored.
        let answered = [
            turn("<think>a</think>\n<search>q</search>", Some(result)),
            turn("<think>b</think>", Some(INVALID_ACTION_FEEDBACK)),
            turn(
                "<think>c</think>\n<answer>It is \\boxed{Paris}</answer>",
                None,
            ),
        ];
        assert_close(score("boxed_em", &answered, &g).score, 1.0, TOL, "boxed ok");
        assert_close(
            em_boxed
                .score(&RewardInput::from_turns(&answered, &g))
                .unwrap()
                .score,
            1.0,
            TOL,
            "em boxed ok",
        );
        let wrong = [
            turn("<think>a</think>\n<search>q</search>", Some(result)),
            turn("<think>c</think>\n<answer>\\boxed{Lyon}</answer>", None),
        ];
        let out = score("boxed_em", &wrong, &g);
        assert_close(out.score, 0.0, TOL, "boxed wrong");
        assert!(out.format_ok);
        // A search the environment never answered is still a format failure (−1): the
        // placeholder keeps only real result wrappers.
        let unanswered_search = [
            turn(
                "<think>a</think>\n<search>q</search>",
                Some(INVALID_ACTION_FEEDBACK),
            ),
            turn("<think>c</think>\n<answer>\\boxed{Paris}</answer>", None),
        ];
        assert_close(
            score("boxed_em", &unanswered_search, &g).score,
            -1.0,
            TOL,
            "no result",
        );
        // Two answer blocks in the agent's text: the format rule rejects them.
        let two = [turn(
            "<think>c</think><answer>\\boxed{Paris}</answer><answer>\\boxed{Paris}</answer>",
            None,
        )];
        assert_close(score("boxed_em", &two, &g).score, -1.0, TOL, "two answers");
        // An empty boxed answer is well formed and wrong.
        let empty = [turn("<think>c</think><answer>\\boxed{}</answer>", None)];
        let out = score("boxed_em", &empty, &g);
        assert_close(out.score, 0.0, TOL, "empty boxed");
        assert!(out.format_ok);
    }

    #[test]
    fn observations_are_never_an_answer_t2po() {
        let g = golds(&["Paris"]);
        let info = "\n\n<information><action><answer>Paris</answer></action></information>\n\n";
        let steps = [
            turn(
                "<think>a</think><action><search>q</search></action>",
                Some(info),
            ),
            turn(
                "<think>b</think><action>look</action>",
                Some(INVALID_ACTION_FEEDBACK),
            ),
            turn("<think>c</think><action><answer>Par", None),
        ];
        let out = score("t2po_em", &steps, &g);
        // Steps: 0, −0.1 (invalid), −0.1 (truncated, invalid): the last is the score.
        crate::test_util::assert_all_close(&out.turn_rewards, &[0.0, -0.1, -0.1], TOL, "t2po");
        assert_close(out.em, 0.0, TOL, "t2po em");
        assert!(!out.format_ok);
        let em_t2po = RewardConfig::Em(crate::reward::AnswerMetricConfig {
            format: Format::T2po,
            ..Default::default()
        });
        let out = em_t2po.score(&RewardInput::from_turns(&steps, &g)).unwrap();
        assert_close(out.score, 0.0, TOL, "em t2po");
        assert!(!out.format_ok);
        let answered = [
            steps[0],
            turn(
                "<think>c</think><action><answer>Paris</answer></action>",
                None,
            ),
        ];
        assert_close(score("t2po_em", &answered, &g).score, 1.0, TOL, "t2po ok");
        let out = em_t2po
            .score(&RewardInput::from_turns(&answered, &g))
            .unwrap();
        assert_close(out.score, 1.0, TOL, "em t2po ok");
    }

    #[test]
    fn placeholders_keep_wrappers_only() {
        assert_eq!(
            observation_placeholder("\n\n<information>Doc 1 <answer>x</answer></information>\n\n"),
            "\n\n<information></information>\n\n"
        );
        assert_eq!(
            observation_placeholder(" <result>\nDoc 1\n</result>"),
            " <result></result>"
        );
        assert_eq!(
            observation_placeholder(INVALID_ACTION_FEEDBACK),
            NOTICE_PLACEHOLDER
        );
        // A notice that merely mentions a wrapper is still a notice.
        assert_eq!(
            observation_placeholder("put it in <information> tags"),
            NOTICE_PLACEHOLDER
        );
        let turns = [
            turn(
                "<think>a</think><search>q</search>",
                Some("\n\n<information>p</information>\n\n"),
            ),
            turn("<think>b</think><answer>x</answer>", None),
        ];
        let input = RewardInput::from_turns(&turns, &[]);
        assert_eq!(
            input.format_view(),
            "<think>a</think><search>q</search>\n\n<information></information>\n\n<think>b</think><answer>x</answer>"
        );
        assert_eq!(
            input.observations().collect::<Vec<_>>(),
            ["\n\n<information>p</information>\n\n"]
        );
    }
}
