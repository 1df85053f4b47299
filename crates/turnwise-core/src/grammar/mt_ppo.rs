//! MT-PPO turn format rules (spec §2.4) [PAPER turn-level-rewards.md §5.2].
//!
//! - Final turn: "(1) only `<think>` and `<answer>` tags appear (no extra tags), (2) each tag
//!   appears exactly once, and (3) `<think>` precedes `<answer>`."
//! - Intermediate turn: "(1) only `<think>`, `<search>`, and `<information>` tags appear,
//!   (2) each tag appears exactly once, and (3) `<think>` precedes `<search>` and
//!   `<information>`."
//!
//! Interpretation \[REC\] (the MT-PPO code is not public): a "tag" is any XML-like token
//! `</?[A-Za-z][A-Za-z0-9_-]*>`; "each tag exactly once" means one opening and one closing tag
//! per field; the blocks must not overlap and appear in the listed order. The intermediate turn
//! text is the agent segment **followed by its observation** (the `<information>` block is
//! written by the environment).

use super::FormatViolation;
use super::scan;

/// Checks that `text` consists of exactly the blocks `fields`, once each, in this order.
fn exact_blocks(text: &str, fields: &[&str]) -> Result<(), FormatViolation> {
    let tags = scan::any_tags(text);
    if let Some(t) = tags.iter().find(|t| !fields.contains(&t.name)) {
        let slash = if t.closing { "/" } else { "" };
        return Err(FormatViolation::at(
            format!("unexpected tag <{slash}{}>", t.name),
            t.start,
        ));
    }
    let mut last_end = 0;
    for field in fields {
        let opens: Vec<_> = tags
            .iter()
            .filter(|t| t.name == *field && !t.closing)
            .collect();
        let closes: Vec<_> = tags
            .iter()
            .filter(|t| t.name == *field && t.closing)
            .collect();
        match (opens.len(), closes.len()) {
            (0, _) => return Err(FormatViolation::new(format!("missing <{field}>"))),
            (1, 0) => {
                return Err(FormatViolation::at(
                    format!("unclosed <{field}>"),
                    opens[0].start,
                ));
            }
            (1, 1) => {}
            (o, c) => {
                return Err(FormatViolation::new(format!(
                    "{o} <{field}> and {c} </{field}> tags, expected exactly one each"
                )));
            }
        }
        let (open, close) = (opens[0], closes[0]);
        if close.start < open.start {
            return Err(FormatViolation::at(
                format!("</{field}> before <{field}>"),
                close.start,
            ));
        }
        if open.start < last_end {
            return Err(FormatViolation::at(
                format!("<{field}> out of order"),
                open.start,
            ));
        }
        last_end = close.end;
    }
    Ok(())
}

/// Final-turn format `f_format` of MT-PPO: only `<think>…</think>` then `<answer>…</answer>`.
pub fn final_turn_format(text: &str) -> Result<(), FormatViolation> {
    exact_blocks(text, &["think", "answer"])
}

/// Intermediate-turn format of MT-PPO: only `<think>…</think>`, `<search>…</search>`,
/// `<information>…</information>`, once each, in this order (agent text + observation).
pub fn intermediate_turn_format(text: &str) -> Result<(), FormatViolation> {
    exact_blocks(text, &["think", "search", "information"])
}
