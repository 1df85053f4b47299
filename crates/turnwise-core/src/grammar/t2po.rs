//! T2PO / GiGPO (verl-agent) grammar (spec §1.3, §2.6)
//! [PAPER t2po.md App. B.2 eq. 12–13; CODE T2PO agent_system/environments/env_package/search/
//! projection.py (= verl-agent `search_projection`)].
//!
//! Each environment step is a separate sample whose output should be
//! `<think>…</think><action>…</action>`; in the search environment the action is one
//! `<search>q</search>` or `<answer>a</answer>` block.
//!
//! Two independent notions of "valid" exist and both are exposed:
//! - the paper's strict validator [`v_strict`] (penalty −λ_fmt on the final reward), with the
//!   relaxed parser [`relaxed_action`] used to still extract an action;
//! - the code's `is_action_valid` ([`project_search_action`]), penalized per invalid step.

use serde::{Deserialize, Serialize};

use super::scan::{self, py_strip};
use super::{Action, FormatVerdict, FormatViolation, ParsedTurn, check_think, rules};

/// Stop string of a T2PO step.
pub const STOP_STRINGS: [&str; 1] = ["</action>"];

/// What "non-target-language characters" means in `V_strict` [UNVERIFIED: the T2PO recipe code
/// is missing from the public snapshot].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TargetScript {
    /// No character check.
    Any,
    /// English target [REC default]: reject letters and punctuation of the scripts an English
    /// model typically drifts into (CJK ideographs and CJK/full-width punctuation, kana,
    /// Hangul, Cyrillic, Hebrew, Arabic, Devanagari, Thai). Latin with diacritics, Greek
    /// (math), digits, symbols and emoji are allowed.
    #[default]
    English,
}

impl TargetScript {
    /// Whether `c` is outside the target language.
    pub fn is_foreign(self, c: char) -> bool {
        match self {
            TargetScript::Any => false,
            TargetScript::English => matches!(c as u32,
                0x0400..=0x052F        // Cyrillic (+ supplement)
                | 0x0590..=0x05FF      // Hebrew
                | 0x0600..=0x06FF      // Arabic
                | 0x0900..=0x097F      // Devanagari
                | 0x0E00..=0x0E7F      // Thai
                | 0x1100..=0x11FF      // Hangul Jamo
                | 0x3000..=0x303F      // CJK symbols and punctuation
                | 0x3040..=0x30FF      // Hiragana, Katakana
                | 0x3130..=0x318F      // Hangul compatibility Jamo
                | 0x3400..=0x4DBF      // CJK extension A
                | 0x4E00..=0x9FFF      // CJK unified ideographs
                | 0xAC00..=0xD7AF      // Hangul syllables
                | 0xF900..=0xFAFF      // CJK compatibility ideographs
                | 0xFF00..=0xFFEF      // half-width and full-width forms
                | 0x20000..=0x2FA1F), // CJK extensions B.. and compatibility supplement
        }
    }
}

/// The strict validator `V_strict` (T2PO eq. 12): after stripping surrounding whitespace the
/// output is `<think>…</think>` + optional whitespace + `<action>…</action>`, with exactly one
/// opening and one closing tag per field, and no character outside the target language.
///
/// Whitespace between `</think>` and `<action>` is allowed because T2PO's own thinking
/// intervention injects `[</think>, \n, <action>]` (spec §6.2).
pub fn v_strict(text: &str, script: TargetScript) -> Result<(), FormatViolation> {
    for tag in ["<think>", "</think>", "<action>", "</action>"] {
        let n = scan::count(text, tag);
        if n != 1 {
            return Err(FormatViolation::new(format!(
                "{n} {tag} tags, expected exactly one"
            )));
        }
    }
    let lead = text.len() - text.trim_start_matches(scan::py_is_space).len();
    let body = py_strip(text);
    let (think_end, action_open) = (
        text.find("</think>").unwrap_or(0),
        text.find("<action>").unwrap_or(0),
    );
    if !body.starts_with("<think>") {
        return Err(FormatViolation::at(
            "output does not start with <think>",
            lead,
        ));
    }
    if !body.ends_with("</action>") {
        return Err(FormatViolation::new("output does not end with </action>"));
    }
    if think_end > action_open {
        return Err(FormatViolation::at("<action> before </think>", action_open));
    }
    let between = &text[think_end + "</think>".len()..action_open];
    if !py_strip(between).is_empty() {
        return Err(FormatViolation::at(
            "text between </think> and <action>",
            think_end + "</think>".len(),
        ));
    }
    if let Some((i, c)) = text.char_indices().find(|&(_, c)| script.is_foreign(c)) {
        return Err(FormatViolation::at(
            format!("non-target-language character {c:?}"),
            i,
        ));
    }
    Ok(())
}

/// The relaxed parser `V_relax` (T2PO eq. 13): the content of the first `<action>` field —
/// up to the next `</action>`, or to the end of the text when it is unclosed (truncated
/// output). `None` when there is no `<action>` tag.
pub fn relaxed_action(text: &str) -> Option<&str> {
    let open = text.find("<action>")?;
    let start = open + "<action>".len();
    let end = scan::find_from(text, "</action>", start).unwrap_or(text.len());
    Some(&text[start..end])
}

/// Result of [`project_search_action`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SearchProjection {
    /// The extracted action (`None` when no complete block exists).
    pub action: Option<Action>,
    /// `Ok` when `is_action_valid = 1`, else the reason.
    pub validity: Result<(), FormatViolation>,
}

/// verl-agent `search_projection` for one action text (spec §2.6), tags case-insensitive:
///
/// - extraction: cut after the first `</search>` (or, if absent, after the first `</answer>`);
///   take the first `<search>…</search>` block, else the first `<answer>…</answer>` block,
///   content stripped; neither → no action;
/// - `is_action_valid = 0` if no block was extracted, if both `<search>` and `<answer>` occur
///   in the original text, or if either occurs more than once. The extracted block is kept even
///   when invalid (the reference executes it and penalizes the step).
///
/// Case-insensitivity is ASCII only (Python's `re.IGNORECASE` also folds a few non-ASCII
/// look-alikes such as U+212A KELVIN SIGN; irrelevant for these tags in practice).
pub fn project_search_action(text: &str) -> SearchProjection {
    let lower = text.to_ascii_lowercase(); // same byte offsets as `text`
    let cut = ["</search>", "</answer>"]
        .iter()
        .find_map(|stop| lower.find(stop).map(|p| p + stop.len()))
        .unwrap_or(lower.len());
    let (lc, tc) = (&lower[..cut], &text[..cut]);
    let content = |b: scan::Block<'_>, open: &str, close: &str| {
        py_strip(&tc[b.start + open.len()..b.end - close.len()]).to_owned()
    };
    let action = if let Some(b) = scan::first_block(lc, "<search>", "</search>") {
        Some(Action::Search {
            query: content(b, "<search>", "</search>"),
        })
    } else {
        scan::first_block(lc, "<answer>", "</answer>").map(|b| Action::Answer {
            text: content(b, "<answer>", "</answer>"),
        })
    };
    let n_search = scan::count(&lower, "<search>");
    let n_answer = scan::count(&lower, "<answer>");
    let validity = if action.is_none() {
        Err(super::missing_action(&lower))
    } else if n_search > 0 && n_answer > 0 {
        Err(FormatViolation::new("both <search> and <answer> present"))
    } else if n_search > 1 {
        Err(FormatViolation::new(format!("{n_search} <search> blocks")))
    } else if n_answer > 1 {
        Err(FormatViolation::new(format!("{n_answer} <answer> blocks")))
    } else {
        Ok(())
    };
    SearchProjection { action, validity }
}

/// Parses one T2PO step output.
///
/// The payload is the relaxed `<action>` content when an `<action>` tag exists, else the whole
/// text (the verl-agent search prompt asks for `<search>`/`<answer>` right after `</think>`).
/// The action is the payload's [`project_search_action`] block, [`Action::Invalid`] if none.
///
/// Verdict: [`rules::T2PO_STRICT`], [`rules::T2PO_RELAXED`], [`rules::ACTION_VALID`],
/// [`rules::THINK`].
pub fn parse_turn(text: &str, script: TargetScript) -> ParsedTurn {
    let mut verdict = FormatVerdict::default();
    verdict.push(rules::T2PO_STRICT, v_strict(text, script));
    let relaxed = relaxed_action(text);
    verdict.push(
        rules::T2PO_RELAXED,
        relaxed
            .map(|_| ())
            .ok_or_else(|| FormatViolation::new("no <action> tag")),
    );
    let payload = relaxed.unwrap_or(text);
    let proj = project_search_action(payload);
    verdict.push(rules::ACTION_VALID, proj.validity.clone());
    let think_limit = text.find("<action>").unwrap_or(text.len());
    verdict.push(rules::THINK, check_think(text, think_limit));
    let action = proj.action.unwrap_or_else(|| Action::Invalid {
        reason: proj
            .validity
            .err()
            .map_or_else(|| "no action".to_owned(), |v| v.reason),
    });
    let final_answer = match &action {
        Action::Answer { text } => Some(text.clone()),
        _ => None,
    };
    ParsedTurn {
        action,
        verdict,
        final_answer,
    }
}
