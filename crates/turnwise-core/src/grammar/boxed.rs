//! Boxed-answer grammar of A2TGPO / AT2PO (spec §1.3, §2.3)
//! [CODE ATPO: verl/utils/reward_score/deep_research_em.py; rollout
//! workers/rollout/vllm_rollout/vllm_rollout_with_tools_tree_offline.py].
//!
//! A rollout: `<think>…</think><search>q</search>` → tool output ` <result>\n…\n</result>`
//! (mask 0) → … → `<think>…</think><answer>… \boxed{X} …</answer>`; `X` is scored by EM.

use super::scan::{self, py_strip};
use super::{
    Action, FormatVerdict, FormatViolation, ParsedTurn, check_single_action, check_think,
    missing_action, rules,
};

/// Stop strings of an AT2PO turn (kept in the output).
pub const STOP_STRINGS: [&str; 2] = ["</search>", "</answer>"];

/// Text AT2PO appends (mask 0) inside the current node when the tool-call limit (6) is hit
/// [CODE ATPO rollout `_process_node_outputs`; spec §1.2].
pub const TOOL_LIMIT_NOTICE: &str = " I have reached the tool call limit and cannot make further tool calls. Let me provide the final answer based on the information I have gathered so far. \n\n";

/// The observation appended after a search: `" <result>\n{text}\n</result>"` (spec §1.1).
pub fn format_observation(text: &str) -> String {
    format!(" <result>\n{text}\n</result>")
}

/// Checks that `tool` blocks (`<search>`, `<python>`) are each followed, in order, by
/// `</tool>` < `<result>` < `</result>` — the loop of `validate_format`, including its use of
/// `find` from the previous `</result>`.
fn check_tool_result_order(text: &str, tool: &str) -> Result<(), FormatViolation> {
    let open = format!("<{tool}>");
    let close = format!("</{tool}>");
    let mut current = 0;
    while let Some(tool_pos) = scan::find_from(text, &open, current) {
        let result_pos = scan::find_from(text, "<result>", tool_pos);
        let tool_end = scan::find_from(text, &close, tool_pos);
        let result_end = result_pos.and_then(|r| scan::find_from(text, "</result>", r));
        let (Some(result_pos), Some(tool_end), Some(result_end)) =
            (result_pos, tool_end, result_end)
        else {
            return Err(FormatViolation::at(
                format!("{tool}/result tags are incomplete"),
                tool_pos,
            ));
        };
        if !(tool_pos < tool_end && tool_end < result_pos && result_pos < result_end) {
            return Err(FormatViolation::at(
                format!("{tool}/result tags are nested in the wrong order"),
                tool_pos,
            ));
        }
        current = result_end;
    }
    Ok(())
}

/// AT2PO / A2TGPO whole-response format check, step 1 of §2.3
/// [CODE ATPO deep_research_em.py `validate_format`], with the reference's reasons:
///
/// 1. `count(<think>) == count(</think>)` and both ≥ 1;
/// 2. exactly one `<answer>` and one `</answer>`;
/// 3. every `<search>` (and `<python>`) is followed in order by `</search>` < `<result>` <
///    `</result>`;
/// 4. `<answer>` precedes `</answer>`, and the answer span contains `\boxed{` and `}`.
pub fn validate_format(text: &str) -> Result<(), FormatViolation> {
    validate_tags(text)?;
    // Both answer tags exist exactly once (checked by `validate_tags`).
    let start = text.find("<answer>").unwrap_or(0);
    let end = text.find("</answer>").unwrap_or(0);
    let span = &text[start..end];
    if !span.contains("\\boxed{") || !span.contains('}') {
        return Err(FormatViolation::at(
            "answer is missing \\boxed{} format",
            start,
        ));
    }
    Ok(())
}

/// Steps 1–3 of [`validate_format`] plus "`<answer>` before `</answer>`", without the
/// `\boxed{}` requirement (used by the `deep_research` F1 variant, spec §2.3).
pub fn validate_tags(text: &str) -> Result<(), FormatViolation> {
    let n_think = scan::count(text, "<think>");
    let n_think_end = scan::count(text, "</think>");
    if n_think != n_think_end {
        return Err(FormatViolation::new(format!(
            "<think> </think> not paired ({n_think} vs {n_think_end})"
        )));
    }
    if n_think == 0 {
        return Err(FormatViolation::new("<think> or </think> not found"));
    }
    let n_answer = scan::count(text, "<answer>");
    let n_answer_end = scan::count(text, "</answer>");
    if n_answer != 1 || n_answer_end != 1 {
        return Err(FormatViolation::new(format!(
            "expected exactly one <answer> and one </answer>, found {n_answer} and {n_answer_end}"
        )));
    }
    check_tool_result_order(text, "search")?;
    check_tool_result_order(text, "python")?;
    // Both exist exactly once (checked above).
    let start = text.find("<answer>").unwrap_or(0);
    let end = text.find("</answer>").unwrap_or(0);
    if start > end {
        return Err(FormatViolation::at(
            "<answer> must be before </answer>",
            end,
        ));
    }
    Ok(())
}

/// Content of the first `<answer>(.*?)</answer>` of the stripped text (not itself stripped)
/// [CODE ATPO `extract_answer`].
pub fn extract_answer_block(text: &str) -> Option<&str> {
    scan::first_block(py_strip(text), "<answer>", "</answer>").map(|b| b.content)
}

/// The last boxed expression of `s`, wrapper included [CODE ATPO `last_boxed_only_string`]:
///
/// - if `s` contains `"\boxed "` (space form): `"\boxed "` + the text after the last
///   `"\boxed "` up to the first `$`;
/// - else from the last `\boxed` (or, if none, the last `\fbox`) up to the `}` that brings the
///   brace depth back to zero; `None` if it never does.
pub fn last_boxed_only(s: &str) -> Option<&str> {
    if let Some(p) = s.rfind("\\boxed ") {
        let rest = &s[p + "\\boxed ".len()..];
        let stop = rest.find('$').unwrap_or(rest.len());
        return Some(&s[p..p + "\\boxed ".len() + stop]);
    }
    let idx = s.rfind("\\boxed").or_else(|| s.rfind("\\fbox"))?;
    let mut depth: i64 = 0;
    for (i, b) in s.as_bytes()[idx..].iter().enumerate() {
        match b {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&s[idx..idx + i + 1]);
                }
            }
            _ => {}
        }
    }
    None
}

/// Strips the wrapper from the output of [`last_boxed_only`] [CODE ATPO `remove_boxed`]:
/// `"\boxed X"` → `X`, `"\boxed{X}"` → `X`. `None` where the reference raises (the wrapper is
/// not `\boxed{…}`).
///
/// \[REC\] `"\fbox{X}"` → `X`; the reference raises there (its `remove_boxed` only knows
/// `\boxed{`), which never changes the reward because `validate_format` already requires
/// `\boxed{` in the answer.
pub fn remove_boxed(s: &str) -> Option<&str> {
    if s.contains("\\boxed ") {
        return s.strip_prefix("\\boxed ");
    }
    s.strip_prefix("\\boxed{")
        .or_else(|| s.strip_prefix("\\fbox{"))?
        .strip_suffix('}')
}

/// `remove_boxed(last_boxed_only(s))`: the EM string of an answer span.
pub fn extract_boxed(s: &str) -> Option<&str> {
    remove_boxed(last_boxed_only(s)?)
}

/// Boxed answer of a whole response: first `<answer>` block, then its last `\boxed{}`
/// (step 2 of §2.3). Not stripped (the EM normalization ignores surrounding whitespace).
pub fn extract_answer(text: &str) -> Option<&str> {
    extract_boxed(extract_answer_block(text)?)
}

/// The query of the last `<search>…</search>` block: the text between the last `</search>` and
/// the last `<search>` before it, stripped. `None` if there is no such block or the query is
/// empty (AT2PO sends no empty query to the retriever).
pub fn extract_search_query(text: &str) -> Option<&str> {
    let close = text.rfind("</search>")?;
    let open = text[..close].rfind("<search>")?;
    let q = py_strip(&text[open + "<search>".len()..close]);
    (!q.is_empty()).then_some(q)
}

/// Parses one AT2PO turn.
///
/// The kind is decided by whichever complete block closes first — `<search>…</search>` or
/// `<answer>…</answer>` — which is where generation stops on [`STOP_STRINGS`]. A search uses
/// the last `<search>` opening before that `</search>` ([`extract_search_query`] rule); an empty
/// query is [`Action::Invalid`]. An answer keeps the first `<answer>` block; its `\boxed{}`
/// content goes to [`ParsedTurn::final_answer`] and to the [`rules::BOXED`] check.
pub fn parse_turn(text: &str) -> ParsedTurn {
    let search_close = text
        .find("</search>")
        .filter(|&c| text[..c].contains("<search>"));
    let answer = scan::first_block(text, "<answer>", "</answer>");
    let search_first = match (search_close, answer) {
        (Some(c), Some(a)) => Some(c + "</search>".len() <= a.end),
        (Some(_), None) => Some(true),
        (None, Some(_)) => Some(false),
        (None, None) => None,
    };
    let mut verdict = FormatVerdict::default();
    let (action, final_answer, limit) = match (search_first, search_close, answer) {
        (Some(true), Some(close), _) => {
            verdict.push(rules::ACTION, Ok(()));
            let open = text[..close].rfind("<search>").unwrap_or(0);
            let q = py_strip(&text[open + "<search>".len()..close]);
            if q.is_empty() {
                let v = FormatViolation::at("empty <search> query", open);
                verdict.push(rules::NON_EMPTY_QUERY, Err(v.clone()));
                (Action::Invalid { reason: v.reason }, None, open)
            } else {
                verdict.push(rules::NON_EMPTY_QUERY, Ok(()));
                (
                    Action::Search {
                        query: q.to_owned(),
                    },
                    None,
                    open,
                )
            }
        }
        (Some(false), _, Some(a)) => {
            verdict.push(rules::ACTION, Ok(()));
            let boxed = extract_boxed(a.content).map(str::to_owned);
            verdict.push(
                rules::BOXED,
                match boxed {
                    Some(_) => Ok(()),
                    None => Err(FormatViolation::at("answer is missing \\boxed{}", a.start)),
                },
            );
            (
                Action::Answer {
                    text: py_strip(a.content).to_owned(),
                },
                boxed,
                a.start,
            )
        }
        _ => {
            let v = missing_action(text);
            verdict.push(rules::ACTION, Err(v.clone()));
            (Action::Invalid { reason: v.reason }, None, text.len())
        }
    };
    verdict.push(rules::THINK, check_think(text, limit));
    verdict.push(rules::SINGLE_ACTION, check_single_action(text));
    ParsedTurn {
        action,
        verdict,
        final_answer,
    }
}
