//! Two-turn MT-GRPO rewards (spec §2.5) [PAPER turn-level-rewards.md App. E.2; CODE MT:
//! verifiers/rubrics (tool_rubric.py, triviaqa_rubric.py) and the verifiers `XMLParser`].
//!
//! The rollout is a chat: assistant messages written with the fields `<reasoning>` and one of
//! `<tool>` / `<answer>` (XMLParser fields `["reasoning", ("tool", "answer")]`), user messages
//! carrying the tool output in `<result>…</result>`.
//!
//! | reward | level | max |
//! |---|---|---|
//! | [`tool_execution`] | turn | 0.2 |
//! | [`search_result_presence`] | turn | 0.5 |
//! | [`final_answer_presence`] | outcome | 0.5 |
//! | [`exact_match`] | outcome | 1.0 |
//! | [`xml_tag_usage`] | outcome | 0.2 |
//! | [`format_reward`] | outcome | 0.2 |
//!
//! Turn rewards sum to at most 0.7, outcome rewards to at most 1.9.

use serde::{Deserialize, Serialize};

use crate::grammar::scan::{self, py_strip};

/// Author of a chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The policy.
    Assistant,
    /// The environment (tool output) or the user.
    User,
}

/// One chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message<'a> {
    /// Who wrote it.
    pub role: Role,
    /// Its text.
    pub content: &'a str,
}

/// Field sets of the agent parser: `reasoning`, then `tool` or `answer`.
const FIELDS: [&[&str]; 2] = [&["reasoning"], &["tool", "answer"]];

/// verifiers `XMLParser.parse` for one tag: the first `<tag>\s*(.*?)\s*</tag>` (DOTALL),
/// stripped; `None` when absent. An empty field is `Some("")`.
pub fn parse_field<'a>(text: &'a str, tag: &str) -> Option<&'a str> {
    scan::first_block(text, &format!("<{tag}>"), &format!("</{tag}>")).map(|b| py_strip(b.content))
}

fn assistant<'a>(msgs: &'a [Message<'a>]) -> impl Iterator<Item = &'a Message<'a>> {
    msgs.iter().filter(|m| m.role == Role::Assistant)
}

/// Tool attempts: assistant messages with a parsable `<tool>` directly followed by a user
/// message; yields that user message's `<result>` field (`None` if it has none).
fn tool_results<'a>(msgs: &'a [Message<'a>]) -> impl Iterator<Item = Option<&'a str>> {
    msgs.windows(2)
        .filter(|w| {
            w[0].role == Role::Assistant
                && parse_field(w[0].content, "tool").is_some()
                && w[1].role == Role::User
        })
        .map(|w| parse_field(w[1].content, "result"))
}

/// Tool execution reward: `0.2 × successes / attempts`, 0 without attempts. A success is an
/// attempt whose `<result>` exists and does not start with `"Error:"`.
pub fn tool_execution(msgs: &[Message<'_>]) -> f64 {
    let (mut attempts, mut ok) = (0usize, 0usize);
    for r in tool_results(msgs) {
        attempts += 1;
        ok += usize::from(r.is_some_and(|r| !r.starts_with("Error:")));
    }
    if attempts == 0 {
        0.0
    } else {
        0.2 * ok as f64 / attempts as f64
    }
}

fn any_gold_in<S: AsRef<str>>(text: &str, golds: &[S]) -> bool {
    let hay = text.to_lowercase();
    golds
        .iter()
        .any(|g| hay.contains(&g.as_ref().to_lowercase()))
}

/// Search-result answer presence: 0.5 if some gold (lowercased) is a substring of the first
/// tool attempt's `<result>` (lowercased); 0 if there is none.
pub fn search_result_presence<S: AsRef<str>>(msgs: &[Message<'_>], golds: &[S]) -> f64 {
    match tool_results(msgs).flatten().next() {
        Some(r) if any_gold_in(r, golds) => 0.5,
        _ => 0.0,
    }
}

/// The last assistant `<answer>` field.
pub fn last_answer<'a>(msgs: &'a [Message<'a>]) -> Option<&'a str> {
    msgs.iter()
        .rev()
        .filter(|m| m.role == Role::Assistant)
        .find_map(|m| parse_field(m.content, "answer"))
}

/// Final answer presence: 0.5 if some gold (lowercased) is a substring of the last answer.
pub fn final_answer_presence<S: AsRef<str>>(msgs: &[Message<'_>], golds: &[S]) -> f64 {
    match last_answer(msgs) {
        Some(a) if any_gold_in(a, golds) => 0.5,
        _ => 0.0,
    }
}

/// Exact match: 1.0 if `answer.lower().strip() == gold.lower().strip()` for some gold (no
/// punctuation or article normalization).
pub fn exact_match<S: AsRef<str>>(msgs: &[Message<'_>], golds: &[S]) -> f64 {
    let Some(a) = last_answer(msgs) else {
        return 0.0;
    };
    let a = a.to_lowercase();
    let a = py_strip(&a);
    if golds
        .iter()
        .any(|g| py_strip(&g.as_ref().to_lowercase()) == a)
    {
        1.0
    } else {
        0.0
    }
}

/// XML tag usage: per assistant message, for every field tag that occurs (opening or closing),
/// add `1 − |count(<tag>) − 1| + 1 − |count(</tag>) − 1|` over 2 checks; message score =
/// sum / checks (0 with no tag); rollout = `max(0, 0.2 × mean over messages)`.
pub fn xml_tag_usage(msgs: &[Message<'_>]) -> f64 {
    let scores: Vec<f64> = assistant(msgs)
        .map(|m| {
            let (mut score, mut checks) = (0i64, 0i64);
            for tag in FIELDS.iter().flat_map(|f| f.iter()) {
                let open = scan::count(m.content, &format!("<{tag}>")) as i64;
                let close = scan::count(m.content, &format!("</{tag}>")) as i64;
                if open > 0 || close > 0 {
                    score += 1 - (open - 1).abs() + 1 - (close - 1).abs();
                    checks += 2;
                }
            }
            if checks > 0 {
                score as f64 / checks as f64
            } else {
                0.0
            }
        })
        .collect();
    if scores.is_empty() {
        return 0.0;
    }
    (0.2 * scores.iter().sum::<f64>() / scores.len() as f64).max(0.0)
}

/// Format reward: per assistant message
/// `0.4 · present_field_sets / 2` (only if some field parses) `+ 0.2` (proper spacing)
/// `+ 0.2` (stripped text starts with `<reasoning>`) `+ 0.2` (ends with `</tool>` or
/// `</answer>`); rollout = `0.2 ×` mean over messages.
///
/// A field set is present when one of its tags parses or merely occurs. The "proper spacing"
/// check of verifiers compares the stripped and unstripped parses, which use the same regex, so
/// it always passes; it is kept as a constant 0.2 to match the reference numbers.
pub fn format_reward(msgs: &[Message<'_>]) -> f64 {
    let scores: Vec<f64> = assistant(msgs)
        .map(|m| {
            let c = m.content;
            let mut any_parsed = false;
            let mut present = 0usize;
            for set in FIELDS {
                let mut set_present = false;
                for tag in set {
                    if parse_field(c, tag).is_some() {
                        any_parsed = true;
                        set_present = true;
                    } else if c.contains(&format!("<{tag}>")) || c.contains(&format!("</{tag}>")) {
                        set_present = true;
                    }
                }
                present += usize::from(set_present);
            }
            let stripped = py_strip(c);
            let mut s = 0.2; // proper spacing (always satisfied, see above)
            if any_parsed {
                s += 0.4 * present as f64 / FIELDS.len() as f64;
            }
            if FIELDS[0]
                .iter()
                .any(|t| stripped.starts_with(&format!("<{t}>")))
            {
                s += 0.2;
            }
            if FIELDS[1]
                .iter()
                .any(|t| stripped.ends_with(&format!("</{t}>")))
            {
                s += 0.2;
            }
            s
        })
        .collect();
    if scores.is_empty() {
        return 0.0;
    }
    0.2 * scores.iter().sum::<f64>() / scores.len() as f64
}

/// The names of the six rewards, as [`crate::reward::RewardOutput::parts`] lists them.
pub const PARTS: [&str; 6] = [
    "tool_execution",
    "search_result_presence",
    "final_answer_presence",
    "exact_match",
    "xml_tag_usage",
    "format",
];

/// All six rewards of one rollout.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TwoTurnRewards {
    /// [`tool_execution`].
    pub tool_execution: f64,
    /// [`search_result_presence`].
    pub search_result_presence: f64,
    /// [`final_answer_presence`].
    pub final_answer_presence: f64,
    /// [`exact_match`].
    pub exact_match: f64,
    /// [`xml_tag_usage`].
    pub xml_tag_usage: f64,
    /// [`format_reward`].
    pub format: f64,
}

impl TwoTurnRewards {
    /// The six rewards, named as in [`PARTS`].
    pub fn parts(&self) -> Vec<(&'static str, f64)> {
        PARTS
            .into_iter()
            .zip([
                self.tool_execution,
                self.search_result_presence,
                self.final_answer_presence,
                self.exact_match,
                self.xml_tag_usage,
                self.format,
            ])
            .collect()
    }

    /// Computes every reward.
    pub fn compute<S: AsRef<str>>(msgs: &[Message<'_>], golds: &[S]) -> Self {
        Self {
            tool_execution: tool_execution(msgs),
            search_result_presence: search_result_presence(msgs, golds),
            final_answer_presence: final_answer_presence(msgs, golds),
            exact_match: exact_match(msgs, golds),
            xml_tag_usage: xml_tag_usage(msgs),
            format: format_reward(msgs),
        }
    }

    /// Turn-level reward of the first turn (tool execution + search-result presence).
    pub fn turn_total(&self) -> f64 {
        self.tool_execution + self.search_result_presence
    }

    /// Outcome reward (answer presence + exact match + XML usage + format).
    pub fn outcome_total(&self) -> f64 {
        self.final_answer_presence + self.exact_match + self.xml_tag_usage + self.format
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{TOL, assert_close};

    fn a(content: &str) -> Message<'_> {
        Message {
            role: Role::Assistant,
            content,
        }
    }

    fn u(content: &str) -> Message<'_> {
        Message {
            role: Role::User,
            content,
        }
    }

    /// Perfect rollout, computed by hand:
    /// - tool execution: 1 attempt (msg 0 has <tool>, msg 1 is a user message), result
    ///   "John Wayne Gacy was …" does not start with "Error:" → 0.2 · 1/1 = 0.2;
    /// - search presence: "john wayne gacy" ⊂ lowercased result → 0.5;
    /// - answer presence: gold ⊂ "john wayne gacy" → 0.5; EM: equal after lower/strip → 1.0;
    /// - XML: msg 0 uses reasoning (1 open, 1 close → 2) and tool (→ 2): 4/4 = 1; msg 2 the
    ///   same with answer: 1; 0.2 · mean(1, 1) = 0.2;
    /// - format: each message has both field sets (0.4 · 2/2), spacing 0.2, starts with
    ///   <reasoning> 0.2, ends with </tool> or </answer> 0.2 → 1.0; 0.2 · 1.0 = 0.2.
    ///
    /// Totals: turn 0.7, outcome 1.9 (the maxima of §2.5).
    #[test]
    fn spec_2_5_perfect_rollout() {
        let msgs = [
            a(
                "<reasoning>\nNeed to search.\n</reasoning>\n<tool>\n{\"name\": \"wiki_search\", \"args\": {\"query\": \"Killer Clown\"}}\n</tool>",
            ),
            u("<result>\nJohn Wayne Gacy was an American serial killer.\n</result>"),
            a("<reasoning>\nIt is Gacy.\n</reasoning>\n<answer>\nJohn Wayne Gacy\n</answer>"),
        ];
        let r = TwoTurnRewards::compute(&msgs, &["John Wayne Gacy"]);
        assert_close(r.tool_execution, 0.2, TOL, "tool execution");
        assert_close(r.search_result_presence, 0.5, TOL, "search presence");
        assert_close(r.final_answer_presence, 0.5, TOL, "answer presence");
        assert_close(r.exact_match, 1.0, TOL, "exact match");
        assert_close(r.xml_tag_usage, 0.2, TOL, "xml");
        assert_close(r.format, 0.2, TOL, "format");
        assert_close(r.turn_total(), 0.7, TOL, "turn total");
        assert_close(r.outcome_total(), 1.9, TOL, "outcome total");
    }

    /// Flawed rollout, computed by hand (golds "John Wayne Gacy", "Gacy"):
    /// - tool execution: 1 attempt, result (stripped) "Error: Tool command not found" → 0/1 → 0.0;
    /// - search presence: neither gold ⊂ "error: tool command not found" → 0.0;
    /// - answer presence: "gacy" ⊂ "gacy" → 0.5; EM: "gacy" == "gacy" → 1.0;
    /// - XML: msg 0: reasoning 2 opens/2 closes → (1−1)+(1−1) = 0 over 2 checks, tool → 2 over
    ///   2 → 2/4 = 0.5; msg 2: answer → 2/2 = 1; 0.2 · mean(0.5, 1) = 0.15;
    /// - format: msg 0: both sets present 0.4, spacing 0.2, starts with <reasoning> 0.2, ends
    ///   with "trailing" 0 → 0.8; msg 2: only the answer set 0.4 · 1/2 = 0.2, spacing 0.2,
    ///   starts with "Final:" 0, ends with </answer> 0.2 → 0.6; 0.2 · mean(0.8, 0.6) = 0.14.
    #[test]
    fn spec_2_5_flawed_rollout() {
        let msgs = [
            a(
                "<reasoning>think</reasoning><reasoning>more</reasoning> <tool>{bad}</tool> trailing",
            ),
            u("<result>\nError: Tool command not found\n</result>"),
            a("Final: <answer>Gacy</answer>"),
        ];
        let r = TwoTurnRewards::compute(&msgs, &["John Wayne Gacy", "Gacy"]);
        assert_close(r.tool_execution, 0.0, TOL, "tool execution");
        assert_close(r.search_result_presence, 0.0, TOL, "search presence");
        assert_close(r.final_answer_presence, 0.5, TOL, "answer presence");
        assert_close(r.exact_match, 1.0, TOL, "exact match");
        assert_close(r.xml_tag_usage, 0.15, TOL, "xml");
        assert_close(r.format, 0.14, TOL, "format");
    }

    /// Edge cases, by hand:
    /// - no tool attempt (the only assistant message has no <tool>) → tool execution 0.0;
    /// - three <answer> blocks: (1−2)+(1−2) = −2 over 2 checks = −1 → 0.2 · −1 = −0.2,
    ///   floored at 0.0; first <answer> is "a" → EM vs "A " after lower/strip → 1.0;
    /// - a message with no tag at all: XML 0, format = spacing 0.2 only → 0.2 · 0.2 = 0.04;
    /// - 2 attempts, one "Error:" → 0.2 · 1/2 = 0.1, and search presence uses the first
    ///   result ("Error: …" lacks the gold) → 0.0.
    #[test]
    fn spec_2_5_edge_cases() {
        let triple = [a("<answer>a</answer><answer>b</answer><answer>c</answer>")];
        assert_close(tool_execution(&triple), 0.0, TOL, "no attempt");
        assert_close(xml_tag_usage(&triple), 0.0, TOL, "xml floor");
        assert_close(exact_match(&triple, &["A "]), 1.0, TOL, "lower/strip EM");
        assert_close(
            format_reward(&[a("plain text")]),
            0.04,
            TOL,
            "untagged format",
        );
        assert_close(xml_tag_usage(&[a("plain text")]), 0.0, TOL, "untagged xml");
        let two = [
            a("<reasoning>r</reasoning><tool>q</tool>"),
            u("<result>Error: bad</result>"),
            a("<reasoning>r</reasoning><tool>q2</tool>"),
            u("<result>Paris</result>"),
        ];
        assert_close(tool_execution(&two), 0.1, TOL, "half success");
        assert_close(
            search_result_presence(&two, &["Paris"]),
            0.0,
            TOL,
            "first result only",
        );
        assert_close(exact_match(&two, &["Paris"]), 0.0, TOL, "no answer");
    }
}
