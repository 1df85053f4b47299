//! Search-R1 grammar (spec §1.3, §2.1, §2.4) [CODE SR1: search_r1/llm_agent/generation.py,
//! verl/utils/reward_score/qa_em.py, qa_em_format.py].
//!
//! One rollout: `<think>…</think><search>q</search>` → environment appends
//! `\n\n<information>…</information>\n\n` → … → `<think>…</think><answer>a</answer>`.
//! A turn without a `<search>`/`<answer>` block gets [`INVALID_ACTION_FEEDBACK`] and the rollout
//! continues.

use super::scan::{self, py_strip};
use super::{
    Action, FormatVerdict, FormatViolation, ParsedTurn, check_single_action, check_think,
    missing_action, rules,
};

/// Stop strings of a Search-R1 turn (kept in the output).
pub const STOP_STRINGS: [&str; 2] = ["</search>", "</answer>"];

/// Observation inserted (mask 0) after a turn with no valid action
/// [CODE SR1 generation.py `execute_predictions`], verbatim from spec §1.3.
pub const INVALID_ACTION_FEEDBACK: &str = "\nMy previous action is invalid. If I want to search, I should put the query between <search> and </search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. Let me try again.\n";

/// The observation text for retrieved passages:
/// `"\n\n<information>{passages.strip()}</information>\n\n"` [CODE SR1 generation.py].
pub fn format_observation(passages: &str) -> String {
    format!("\n\n<information>{}</information>\n\n", py_strip(passages))
}

/// Cuts a turn after its first `</search>`, or else after its first `</answer>`
/// [CODE SR1 generation.py `_postprocess_responses`]. Note the preference: any `</search>` wins
/// over an earlier `</answer>`, exactly as in the reference.
pub fn truncate_at_stop(text: &str) -> &str {
    for stop in STOP_STRINGS {
        if let Some(p) = text.find(stop) {
            return &text[..p + stop.len()];
        }
    }
    text
}

/// Parses one Search-R1 turn.
///
/// Action rule [CODE SR1 `postprocess_predictions`]: after [`truncate_at_stop`], the leftmost
/// match of `<(search|answer)>(.*?)</\1>` decides; its content is stripped. An empty query is
/// still a search (the reference sends it to the retriever) but fails the
/// [`rules::NON_EMPTY_QUERY`] check. No match → [`Action::Invalid`].
///
/// Verdict: [`rules::ACTION`], [`rules::NON_EMPTY_QUERY`] (searches only), [`rules::THINK`] (a
/// closed `<think>` before the action), [`rules::SINGLE_ACTION`] (on the untruncated text).
pub fn parse_turn(text: &str) -> ParsedTurn {
    let cut = truncate_at_stop(text);
    let search = scan::first_block(cut, "<search>", "</search>");
    let answer = scan::first_block(cut, "<answer>", "</answer>");
    let chosen = match (search, answer) {
        (Some(s), Some(a)) => Some(if s.start < a.start {
            (true, s)
        } else {
            (false, a)
        }),
        (Some(s), None) => Some((true, s)),
        (None, Some(a)) => Some((false, a)),
        (None, None) => None,
    };
    let mut verdict = FormatVerdict::default();
    let (action, final_answer, limit) = match chosen {
        Some((true, b)) => {
            verdict.push(rules::ACTION, Ok(()));
            let q = py_strip(b.content);
            verdict.push(
                rules::NON_EMPTY_QUERY,
                if q.is_empty() {
                    Err(FormatViolation::at("empty <search> query", b.start))
                } else {
                    Ok(())
                },
            );
            (
                Action::Search {
                    query: q.to_owned(),
                },
                None,
                b.start,
            )
        }
        Some((false, b)) => {
            verdict.push(rules::ACTION, Ok(()));
            let t = py_strip(b.content).to_owned();
            (Action::Answer { text: t.clone() }, Some(t), b.start)
        }
        None => {
            let v = missing_action(cut);
            verdict.push(rules::ACTION, Err(v.clone()));
            (Action::Invalid { reason: v.reason }, None, cut.len())
        }
    };
    verdict.push(rules::THINK, check_think(cut, limit));
    verdict.push(rules::SINGLE_ACTION, check_single_action(text));
    ParsedTurn {
        action,
        verdict,
        final_answer,
    }
}

/// Which `<answer>` match [`extract_answer`] returns (spec §2.1, §9 item 13).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AnswerRule {
    /// \[REC\] for response-only text: last match, `None` if there is none.
    #[default]
    LastMatch,
    /// Search-R1 code on prompt+response text (the prompt holds one example `<answer>`): last
    /// match, `None` if there are fewer than two matches.
    LastOfAtLeastTwo,
}

/// Search-R1 answer extraction: the (stripped) content of the last `<answer>(.*?)</answer>`
/// match (DOTALL), subject to `rule` [CODE SR1 qa_em.py `extract_solution`].
pub fn extract_answer(text: &str, rule: AnswerRule) -> Option<&str> {
    let all = scan::blocks(text, "<answer>", "</answer>");
    let min = match rule {
        AnswerRule::LastMatch => 1,
        AnswerRule::LastOfAtLeastTwo => 2,
    };
    if all.len() < min {
        return None;
    }
    all.last().map(|b| py_strip(b.content))
}

/// Stripped contents of every `<information>…</information>` block
/// [CODE SR1 qa_em_format.py `extract_information_blocks`].
pub fn information_blocks(text: &str) -> Vec<&str> {
    scan::blocks(text, "<information>", "</information>")
        .into_iter()
        .map(|b| py_strip(b.content))
        .collect()
}

const SEQ_TAGS: [&str; 4] = ["think", "search", "information", "answer"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Start,
    InThink,
    AfterThink,
    InSearch,
    AfterSearch,
    InInformation,
    Information,
    InAnswer,
    End,
}

impl State {
    fn name(self) -> &'static str {
        match self {
            State::Start => "start",
            State::InThink => "in_think",
            State::AfterThink => "after_think",
            State::InSearch => "in_search",
            State::AfterSearch => "after_search",
            State::InInformation => "in_information",
            State::Information => "information",
            State::InAnswer => "in_answer",
            State::End => "end",
        }
    }

    fn inside_tag(self) -> bool {
        matches!(
            self,
            State::InThink | State::InSearch | State::InInformation | State::InAnswer
        )
    }
}

/// Search-R1 whole-response format check [CODE SR1 qa_em_format.py `is_valid_sequence`]:
/// the response must be `think → (search → information → think)* → answer` with only
/// whitespace between tags.
///
/// Steps, as in the reference: (1) for each of `think`, `search`, `information`, `answer` the
/// number of opening and closing tags must be equal; (2) the text is split on those eight tags
/// and run through the state machine; non-whitespace text is allowed only inside a tag;
/// (3) the machine must end right after `</answer>` (trailing whitespace only).
///
/// `text` is the response only; the reference first skips everything up to
/// `<|im_start|>assistant` in prompt+response text.
pub fn validate_sequence(text: &str) -> Result<(), FormatViolation> {
    for tag in SEQ_TAGS {
        let open = scan::count(text, &format!("<{tag}>"));
        let close = scan::count(text, &format!("</{tag}>"));
        if open != close {
            return Err(FormatViolation::new(format!(
                "mismatch in {tag} tags: {open} opening vs {close} closing"
            )));
        }
    }
    let mut state = State::Start;
    let mut pos = 0;
    let check_text = |state: State, from: usize, to: usize| -> Result<(), FormatViolation> {
        let part = &text[from..to];
        if state.inside_tag() || py_strip(part).is_empty() {
            return Ok(());
        }
        let off = from + part.find(|c: char| !scan::py_is_space(c)).unwrap_or(0);
        Err(FormatViolation::at(
            format!("unexpected content between tags (state {})", state.name()),
            off,
        ))
    };
    for tok in scan::tag_tokens(text, &SEQ_TAGS) {
        check_text(state, pos, tok.start)?;
        pos = tok.end;
        state = match (tok.name, tok.closing, state) {
            ("think", false, State::Start | State::Information) => State::InThink,
            ("think", true, State::InThink) => State::AfterThink,
            ("search", false, State::AfterThink) => State::InSearch,
            ("search", true, State::InSearch) => State::AfterSearch,
            ("information", false, State::AfterSearch) => State::InInformation,
            ("information", true, State::InInformation) => State::Information,
            ("answer", false, State::AfterThink) => State::InAnswer,
            ("answer", true, State::InAnswer) => State::End,
            (name, closing, s) => {
                let slash = if closing { "/" } else { "" };
                return Err(FormatViolation::at(
                    format!("unexpected tag <{slash}{name}> in state {}", s.name()),
                    tok.start,
                ));
            }
        };
    }
    check_text(state, pos, text.len())?;
    if state != State::End {
        return Err(FormatViolation::new(format!(
            "incomplete sequence, ended in state {}",
            state.name()
        )));
    }
    Ok(())
}
