//! The verifiers tool format of turn-level-rewards.md App. E (MT-GRPO's two-turn task, spec
//! §2.5) [CODE MT verifiers/envs/tool_env.py, verifiers/parsers XMLParser].
//!
//! An agent turn is `<reasoning>…</reasoning>` followed by either a tool call
//! `<tool>{"name": "search", "args": {"query": "…"}}</tool>` or a final `<answer>…</answer>`.
//! The environment answers a tool call with ` <result>\n…\n</result>`; a call it cannot run (not
//! JSON, no `name`, an unknown tool, a missing `query`) gets a result that starts with
//! `Error:`, which the tool-execution reward counts as a failed attempt. A turn with neither a
//! tool call nor an answer gets [`NO_ACTION_FEEDBACK`] (no `<result>` block: not a tool
//! attempt).
//!
//! Parsing follows verifiers' `XMLParser(fields=["reasoning", ("tool", "answer")])`: each field
//! is the first `<tag>\s*(.*?)\s*</tag>` match; an answer ends the episode even when the turn
//! also holds a tool call (the reference checks completion before it runs tools).

use super::scan::{self, py_strip};
use super::{Action, FormatVerdict, FormatViolation, ParsedTurn, rules};

/// Stop strings of a verifiers turn (kept in the output), as the reference samples with.
pub const STOP_STRINGS: [&str; 2] = ["</tool>", "</answer>"];

/// The one tool of the search task.
pub const TOOL_NAME: &str = "search";

/// What the environment says to a turn with neither a `<tool>` nor an `<answer>` block.
pub const NO_ACTION_FEEDBACK: &str =
    "\nError: no tool call and no answer found; write <tool>…</tool> or <answer>…</answer>.\n";

/// The opening of the JSON tool call up to the query, as demonstrations write it: a single
/// token of a fresh word-level tokenizer, which would otherwise split the JSON at every
/// punctuation mark and decode it with spaces inside the keys.
pub const TOOL_CALL_OPEN: &str = "{\"name\": \"search\", \"args\": {\"query\": \"";

/// The closing of the JSON tool call after the query (see [`TOOL_CALL_OPEN`]).
pub const TOOL_CALL_CLOSE: &str = "\"}}";

/// The text of a tool call searching for `query` (the JSON of [`TOOL_CALL_OPEN`], the query
/// escaped as a JSON string, [`TOOL_CALL_CLOSE`]).
pub fn tool_call(query: &str) -> String {
    let quoted = serde_json::to_string(query).expect("a string serializes");
    format!(
        "<tool>{TOOL_CALL_OPEN}{}{TOOL_CALL_CLOSE}</tool>",
        &quoted[1..quoted.len() - 1]
    )
}

/// verifiers `XMLParser.parse` for one tag: the first `<tag>\s*(.*?)\s*</tag>` (DOTALL),
/// stripped; `None` when absent.
pub fn field<'a>(text: &'a str, tag: &str) -> Option<&'a str> {
    scan::first_block(text, &format!("<{tag}>"), &format!("</{tag}>")).map(|b| py_strip(b.content))
}

/// The search query of a tool call's JSON, or the `Error:` text the environment answers with.
///
/// Keys and string values are compared after trimming whitespace, so that a word-level
/// tokenizer's decoding (which puts spaces around special tokens) does not turn a well-formed
/// call into an error; the query is trimmed.
pub fn tool_query(json: &str) -> Result<String, String> {
    let value: serde_json::Value = serde_json::from_str(json)
        .map_err(|e| format!("Error: the tool call is not valid JSON ({e})"))?;
    let serde_json::Value::Object(call) = value else {
        return Err("Error: the tool call must be a JSON object".into());
    };
    let get = |obj: &serde_json::Map<String, serde_json::Value>, key: &str| {
        obj.iter()
            .find(|(k, _)| k.trim() == key)
            .map(|(_, v)| v.clone())
    };
    let name = match get(&call, "name") {
        Some(serde_json::Value::String(n)) => n.trim().to_owned(),
        _ => return Err("Error: the tool call must name a tool (\"name\")".into()),
    };
    if name != TOOL_NAME {
        return Err(format!(
            "Error: unknown tool {name:?}; the only tool is {TOOL_NAME:?}"
        ));
    }
    let args = match get(&call, "args") {
        Some(serde_json::Value::Object(a)) => a,
        _ => return Err("Error: the tool call needs \"args\" with a \"query\"".into()),
    };
    match get(&args, "query") {
        Some(serde_json::Value::String(q)) if !q.trim().is_empty() => Ok(q.trim().to_owned()),
        Some(serde_json::Value::String(_)) => Err("Error: the search query is empty".into()),
        _ => Err("Error: the tool call needs a string argument \"query\"".into()),
    }
}

/// Parses one verifiers turn.
///
/// Action: an `<answer>` field → [`Action::Answer`]; else a `<tool>` field → [`Action::Search`]
/// when [`tool_query`] accepts its JSON, else [`Action::Invalid`] whose reason is the `Error:`
/// text; else [`Action::Invalid`] (no action).
///
/// Verdict: [`rules::REASONING`] (a complete `<reasoning>` block before the action),
/// [`rules::ACTION`], [`rules::TOOL_CALL`] (tool turns only) and [`rules::SINGLE_ACTION`] (each
/// of `<reasoning>`, `<tool>`, `<answer>` opened at most once, not both a tool call and an
/// answer).
pub fn parse_turn(text: &str) -> ParsedTurn {
    let mut verdict = FormatVerdict::default();
    let answer = scan::first_block(text, "<answer>", "</answer>");
    let tool = scan::first_block(text, "<tool>", "</tool>");
    let (action, final_answer, limit) = match (answer, tool) {
        (Some(a), _) => {
            verdict.push(rules::ACTION, Ok(()));
            let t = py_strip(a.content).to_owned();
            (Action::Answer { text: t.clone() }, Some(t), a.start)
        }
        (None, Some(t)) => {
            verdict.push(rules::ACTION, Ok(()));
            match tool_query(py_strip(t.content)) {
                Ok(query) => {
                    verdict.push(rules::TOOL_CALL, Ok(()));
                    (Action::Search { query }, None, t.start)
                }
                Err(reason) => {
                    verdict.push(rules::TOOL_CALL, Err(FormatViolation::at(&reason, t.start)));
                    (Action::Invalid { reason }, None, t.start)
                }
            }
        }
        (None, None) => {
            let v = super::missing_action_of(text, ["tool", "answer"]);
            verdict.push(rules::ACTION, Err(v.clone()));
            (Action::Invalid { reason: v.reason }, None, text.len())
        }
    };
    verdict.push(
        rules::REASONING,
        super::check_block_before(text, "reasoning", limit),
    );
    verdict.push(rules::SINGLE_ACTION, check_single(text));
    ParsedTurn {
        action,
        verdict,
        final_answer,
    }
}

/// Whether a turn wrote a complete `<tool>…</tool>` block (a tool attempt, answered inside
/// `<result>`).
pub fn has_tool_block(text: &str) -> bool {
    scan::first_block(text, "<tool>", "</tool>").is_some()
}

/// The observation after a turn the environment could not act on (`reason` from
/// [`parse_turn`]): a failed tool call is answered inside `<result>` (so the tool-execution
/// reward sees a failed attempt), a turn without a call gets [`NO_ACTION_FEEDBACK`].
pub fn invalid_observation(text: &str, reason: &str) -> String {
    if has_tool_block(text) {
        format!(" <result>\n{reason}\n</result>")
    } else {
        NO_ACTION_FEEDBACK.to_owned()
    }
}

fn check_single(text: &str) -> Result<(), FormatViolation> {
    for tag in ["<reasoning>", "<tool>", "<answer>"] {
        let n = scan::count(text, tag);
        if n > 1 {
            return Err(FormatViolation::new(format!("{n} {tag} blocks")));
        }
    }
    if text.contains("<tool>") && text.contains("<answer>") {
        return Err(FormatViolation::new("both <tool> and <answer> present"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_demonstrated_tool_call_searches() {
        let text = format!(
            "<reasoning>look it up</reasoning>\n{}",
            tool_call("capital of Oru")
        );
        let p = parse_turn(&text);
        assert_eq!(
            p.action,
            Action::Search {
                query: "capital of Oru".into()
            }
        );
        assert!(p.verdict.is_valid(), "{:?}", p.verdict);
        // Quotes and backslashes in a query survive the JSON round trip.
        let q = r#"the "Oru" \ river"#;
        let p = parse_turn(&tool_call(q));
        assert_eq!(p.action, Action::Search { query: q.into() });
    }

    #[test]
    fn word_level_decoding_with_spaces_still_parses() {
        // A word-level tokenizer decodes special tokens with spaces around them.
        let text = "<reasoning> x </reasoning> <tool> {\"name\": \"search\", \"args\": {\"query\": \" capital of Oru \"}} </tool>";
        assert_eq!(
            parse_turn(text).action,
            Action::Search {
                query: "capital of Oru".into()
            }
        );
        // Spaced keys as a split JSON would decode.
        assert_eq!(
            tool_query(r#"{" name ": " search ", " args ": {" query ": "x"}}"#),
            Ok("x".into())
        );
    }

    #[test]
    fn broken_calls_are_errors_answered_in_a_result() {
        for (json, needle) in [
            ("not json", "not valid JSON"),
            ("[1]", "JSON object"),
            (r#"{"args": {"query": "x"}}"#, "name a tool"),
            (
                r#"{"name": "wiki", "args": {"query": "x"}}"#,
                "unknown tool",
            ),
            (r#"{"name": "search"}"#, "\"args\""),
            (r#"{"name": "search", "args": {"q": "x"}}"#, "\"query\""),
            (r#"{"name": "search", "args": {"query": "  "}}"#, "empty"),
        ] {
            let text = format!("<reasoning>r</reasoning><tool>{json}</tool>");
            let p = parse_turn(&text);
            let Action::Invalid { reason } = &p.action else {
                panic!("{json}: {:?}", p.action)
            };
            assert!(
                reason.starts_with("Error:") && reason.contains(needle),
                "{reason}"
            );
            assert_eq!(p.verdict.passed(rules::TOOL_CALL), Some(false));
            let obs = invalid_observation(&text, reason);
            assert!(obs.starts_with(" <result>\nError:"), "{obs}");
        }
    }

    #[test]
    fn answers_win_and_missing_actions_are_named() {
        let p = parse_turn("<reasoning>r</reasoning><answer> Oru </answer>");
        assert_eq!(p.action, Action::Answer { text: "Oru".into() });
        assert_eq!(p.final_answer.as_deref(), Some("Oru"));
        assert!(p.verdict.is_valid());
        // A turn with both: the answer ends the episode (completion is checked first), and the
        // verdict names the double action.
        let both = format!(
            "<reasoning>r</reasoning>{}<answer>Oru</answer>",
            tool_call("q")
        );
        let p = parse_turn(&both);
        assert!(p.action.is_answer());
        assert_eq!(p.verdict.passed(rules::SINGLE_ACTION), Some(false));
        // Neither: not a tool attempt, so no <result>.
        let p = parse_turn("<reasoning>r</reasoning> just words");
        let Action::Invalid { reason } = &p.action else {
            panic!()
        };
        assert!(reason.contains("no complete <tool> or <answer>"));
        assert_eq!(
            invalid_observation("just words", reason),
            NO_ACTION_FEEDBACK
        );
        let p = parse_turn("<reasoning>r</reasoning><tool>{");
        assert!(
            matches!(&p.action, Action::Invalid { reason } if reason.contains("unclosed <tool>"))
        );
        // Missing or late reasoning fails its check only.
        let p = parse_turn("<answer>Oru</answer><reasoning>r</reasoning>");
        assert_eq!(p.verdict.passed(rules::REASONING), Some(false));
        assert_eq!(p.verdict.passed(rules::ACTION), Some(true));
    }
}
