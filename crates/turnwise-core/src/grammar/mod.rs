//! # Agent tag grammars (spec §1.3, §2.1, §2.3–§2.6)
//!
//! Search agents write XML-like tags; the environment and the rewards need to know (a) which
//! action a turn takes and (b) whether the text follows the format the method rewards. Three
//! families exist (spec §1.3):
//!
//! | [`Format`] | agent tags | observation | final answer |
//! |---|---|---|---|
//! | [`Format::SearchR1`] (Search-R1, MT-PPO, ST-PPO, Tree-GRPO) | `<think>` `<search>` | `<information>…</information>` | `<answer>…</answer>` |
//! | [`Format::Boxed`] (A2TGPO, AT2PO) | `<think>` `<search>` | ` <result>\n…\n</result>` | `<answer>…\boxed{X}…</answer>` |
//! | [`Format::T2po`] (T2PO, GiGPO / verl-agent) | `<think>…</think><action>…</action>` | next prompt | `<answer>` inside the action |
//! | [`Format::Verifiers`] (MT-GRPO two-turn, verifiers) | `<reasoning>` `<tool>{json}</tool>` | ` <result>\n…\n</result>` | `<answer>…</answer>` |
//!
//! The module has two layers:
//!
//! 1. **Per-turn parsing** — [`parse_turn`] turns one agent turn into an [`Action`] plus a
//!    [`FormatVerdict`] (a list of named checks, each failing one carrying a reason such as
//!    `"2 <answer> blocks"` or `"unclosed <think> at byte 17"`). The action follows the
//!    reference code of each family (so the environment behaves like the paper's), the verdict
//!    is diagnostics on top.
//! 2. **Whole-response validators**, one per reward rule, in the submodules:
//!    [`search_r1::validate_sequence`] (Search-R1 `qa_em_format` state machine),
//!    [`boxed::validate_format`] (ATPO `deep_research_em.validate_format`),
//!    [`mt_ppo::final_turn_format`] / [`mt_ppo::intermediate_turn_format`] (§2.4),
//!    [`t2po::v_strict`] / [`t2po::relaxed_action`] / [`t2po::project_search_action`] (§2.6).
//!
//! Everything here is a linear scan over the text (see [`scan`]); no function panics or
//! backtracks on arbitrary input, which the property tests and the `tags` fuzz target (crates/turnwise-fuzz) check.

pub mod boxed;
pub mod mt_ppo;
pub mod scan;
pub mod search_r1;
pub mod t2po;
pub mod verifiers;

use serde::{Deserialize, Serialize};

/// The agent output formats: the three of spec §1.3 and the verifiers tool format of spec §2.5.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// Search-R1 family: `<think>`, `<search>q</search>`, observation
    /// `<information>…</information>`, final `<answer>…</answer>`.
    SearchR1,
    /// A2TGPO / AT2PO: `<think>`, `<search>`, observation ` <result>\n…\n</result>`, final
    /// `<answer>…\boxed{X}…</answer>` where `X` is the string scored by EM.
    Boxed,
    /// T2PO / GiGPO (verl-agent): `<think>…</think><action>…</action>` per step sample; in the
    /// search environment the action holds one `<search>` or `<answer>` block.
    T2po,
    /// MT-GRPO's two-turn task (turn-level-rewards.md App. E, verifiers):
    /// `<reasoning>…</reasoning>` then `<tool>{"name": …, "args": …}</tool>` or
    /// `<answer>…</answer>`; tool output ` <result>\n…\n</result>` ([`verifiers`]).
    Verifiers,
}

impl Format {
    /// Every format, in declaration order.
    pub const ALL: [Format; 4] = [
        Format::SearchR1,
        Format::Boxed,
        Format::T2po,
        Format::Verifiers,
    ];

    /// The name used in configs (`"search_r1"`, `"boxed"`, `"t2po"`).
    pub fn name(self) -> &'static str {
        match self {
            Format::SearchR1 => "search_r1",
            Format::Boxed => "boxed",
            Format::T2po => "t2po",
            Format::Verifiers => "verifiers",
        }
    }

    /// Stop strings for the generation of one agent turn (the closing tag of an action).
    ///
    /// Search-R1 and AT2PO stop at `</search>` / `</answer>` (the stop string is kept in the
    /// output); T2PO stops at `</action>`.
    pub fn stop_strings(self) -> &'static [&'static str] {
        match self {
            Format::SearchR1 => &search_r1::STOP_STRINGS,
            Format::Boxed => &boxed::STOP_STRINGS,
            Format::T2po => &t2po::STOP_STRINGS,
            Format::Verifiers => &verifiers::STOP_STRINGS,
        }
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Error of [`Format::from_str`](std::str::FromStr::from_str).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown agent format {0:?}; known formats: search_r1, boxed, t2po, verifiers")]
pub struct UnknownFormat(pub String);

impl std::str::FromStr for Format {
    type Err = UnknownFormat;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Format::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| UnknownFormat(s.to_owned()))
    }
}

/// What one agent turn asks the environment to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Action {
    /// Call the search tool with this query (already trimmed).
    Search {
        /// The query text.
        query: String,
    },
    /// Final answer: the content of the answer block (trimmed). For [`Format::Boxed`] the
    /// EM string is [`ParsedTurn::final_answer`] (the last `\boxed{}`), not this text.
    Answer {
        /// The answer block content.
        text: String,
    },
    /// No executable action; Search-R1 answers with [`search_r1::INVALID_ACTION_FEEDBACK`].
    Invalid {
        /// Why no action could be extracted.
        reason: String,
    },
}

impl Action {
    /// `true` for [`Action::Search`].
    pub fn is_search(&self) -> bool {
        matches!(self, Action::Search { .. })
    }

    /// `true` for [`Action::Answer`].
    pub fn is_answer(&self) -> bool {
        matches!(self, Action::Answer { .. })
    }

    /// `true` for [`Action::Invalid`].
    pub fn is_invalid(&self) -> bool {
        matches!(self, Action::Invalid { .. })
    }
}

/// Why a text fails a format rule. The reason names the offending tag and, where it helps,
/// the byte offset (e.g. `"unclosed <think> at byte 17"`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{reason}")]
pub struct FormatViolation {
    /// Human-readable reason.
    pub reason: String,
    /// Byte offset in the checked text the reason refers to, if any.
    pub at: Option<usize>,
}

impl FormatViolation {
    /// A violation without a position.
    pub fn new(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            at: None,
        }
    }

    /// A violation at byte `pos`; the reason gets the suffix `" at byte {pos}"`.
    pub fn at(reason: impl std::fmt::Display, pos: usize) -> Self {
        Self {
            reason: format!("{reason} at byte {pos}"),
            at: Some(pos),
        }
    }
}

/// Names of the checks that appear in a [`FormatVerdict`].
pub mod rules {
    /// A complete `<think>…</think>` block precedes the action.
    pub const THINK: &str = "think";
    /// A complete action block (`<search>` / `<answer>`) exists.
    pub const ACTION: &str = "action";
    /// At most one action block, and not both kinds.
    pub const SINGLE_ACTION: &str = "single_action";
    /// The search query is not empty (AT2PO).
    pub const NON_EMPTY_QUERY: &str = "non_empty_query";
    /// The answer block holds a `\boxed{}` answer (A2TGPO/AT2PO).
    pub const BOXED: &str = "boxed";
    /// T2PO strict validator `V_strict` (paper eq. 12).
    pub const T2PO_STRICT: &str = "t2po_strict";
    /// T2PO relaxed parser `V_relax` (paper eq. 13): an `<action>` tag exists.
    pub const T2PO_RELAXED: &str = "t2po_relaxed";
    /// verl-agent `search_projection` validity (`is_action_valid`, spec §2.6).
    pub const ACTION_VALID: &str = "action_valid";
    /// A complete `<reasoning>…</reasoning>` block precedes the action (verifiers format).
    pub const REASONING: &str = "reasoning";
    /// The `<tool>` call is JSON naming a known tool with its arguments (verifiers format).
    pub const TOOL_CALL: &str = "tool_call";
}

/// Outcome of one named format check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FormatCheck {
    /// Check name (one of [`rules`]).
    pub rule: &'static str,
    /// `None` when the check passed.
    pub violation: Option<FormatViolation>,
}

impl FormatCheck {
    /// A check from a validator result.
    pub fn new(rule: &'static str, result: Result<(), FormatViolation>) -> Self {
        Self {
            rule,
            violation: result.err(),
        }
    }

    /// Whether the check passed.
    pub fn passed(&self) -> bool {
        self.violation.is_none()
    }
}

/// Which format checks a turn passed or failed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct FormatVerdict {
    /// All checks, in the order they were run.
    pub checks: Vec<FormatCheck>,
}

impl FormatVerdict {
    /// Appends a check.
    pub fn push(&mut self, rule: &'static str, result: Result<(), FormatViolation>) {
        self.checks.push(FormatCheck::new(rule, result));
    }

    /// `true` when every check passed.
    pub fn is_valid(&self) -> bool {
        self.checks.iter().all(FormatCheck::passed)
    }

    /// The failed checks.
    pub fn failures(&self) -> impl Iterator<Item = &FormatCheck> {
        self.checks.iter().filter(|c| !c.passed())
    }

    /// The first failure's violation, if any.
    pub fn first_failure(&self) -> Option<&FormatViolation> {
        self.checks.iter().find_map(|c| c.violation.as_ref())
    }

    /// Result of the check named `rule` (`None` if it was not run).
    pub fn passed(&self, rule: &str) -> Option<bool> {
        self.checks
            .iter()
            .find(|c| c.rule == rule)
            .map(FormatCheck::passed)
    }
}

/// One parsed agent turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ParsedTurn {
    /// What the environment should do.
    pub action: Action,
    /// Format diagnostics for this turn.
    pub verdict: FormatVerdict,
    /// The string EM/F1 score for an answer turn: the answer block content for Search-R1 and
    /// T2PO, the last `\boxed{}` content for [`Format::Boxed`]. `None` for other turns or when
    /// the boxed answer cannot be extracted.
    pub final_answer: Option<String>,
}

/// Parses one agent turn (the text generated in one generation call, stop string included).
///
/// - [`Format::SearchR1`]: [`search_r1::parse_turn`] (Search-R1 `postprocess_predictions`).
/// - [`Format::Boxed`]: [`boxed::parse_turn`] (AT2PO: last `<search>` query, empty = invalid).
/// - [`Format::T2po`]: [`t2po::parse_turn`] (V_strict with [`t2po::TargetScript::English`],
///   relaxed `<action>`, verl-agent projection).
/// - [`Format::Verifiers`]: [`verifiers::parse_turn`] (verifiers `XMLParser` and `ToolEnv`).
pub fn parse_turn(format: Format, text: &str) -> ParsedTurn {
    match format {
        Format::SearchR1 => search_r1::parse_turn(text),
        Format::Boxed => boxed::parse_turn(text),
        Format::T2po => t2po::parse_turn(text, t2po::TargetScript::default()),
        Format::Verifiers => verifiers::parse_turn(text),
    }
}

/// Shared check: the first `<think>` is closed by a `</think>` that ends at or before `limit`
/// (the start of the action block, or the end of the text).
pub(crate) fn check_think(text: &str, limit: usize) -> Result<(), FormatViolation> {
    check_block_before(text, "think", limit)
}

/// The first `<tag>` is closed by a `</tag>` that ends at or before `limit` (the reasoning
/// block before the action: `think`, or the verifiers format's `reasoning`).
pub(crate) fn check_block_before(
    text: &str,
    tag: &str,
    limit: usize,
) -> Result<(), FormatViolation> {
    let (open_tag, close_tag) = (format!("<{tag}>"), format!("</{tag}>"));
    let Some(open) = text.find(&open_tag) else {
        return Err(FormatViolation::new(format!("missing {open_tag}")));
    };
    match scan::find_from(text, &close_tag, open + open_tag.len()) {
        Some(close) if close + close_tag.len() <= limit => Ok(()),
        Some(close) => Err(FormatViolation::at(
            format!("{close_tag} after the action"),
            close,
        )),
        None => Err(FormatViolation::at(format!("unclosed {open_tag}"), open)),
    }
}

/// Shared check: at most one `<search>`/`<answer>` opening tag and not both
/// (the verl-agent rule, here used as a diagnostic for every format).
pub(crate) fn check_single_action(text: &str) -> Result<(), FormatViolation> {
    let n_search = scan::count(text, "<search>");
    let n_answer = scan::count(text, "<answer>");
    if n_search > 0 && n_answer > 0 {
        return Err(FormatViolation::new("both <search> and <answer> present"));
    }
    if n_search > 1 {
        return Err(FormatViolation::new(format!("{n_search} <search> blocks")));
    }
    if n_answer > 1 {
        return Err(FormatViolation::new(format!("{n_answer} <answer> blocks")));
    }
    Ok(())
}

/// Shared reason for a turn without a complete `<search>`/`<answer>` block: names the first
/// unclosed action tag when there is one.
pub(crate) fn missing_action(text: &str) -> FormatViolation {
    missing_action_of(text, ["search", "answer"])
}

/// [`missing_action`] for the action tags `tags` (`["tool", "answer"]` in the verifiers format).
pub(crate) fn missing_action_of(text: &str, tags: [&str; 2]) -> FormatViolation {
    for tag in tags {
        let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
        if let Some(p) = text.find(&open)
            && scan::find_from(text, &close, p + open.len()).is_none()
        {
            return FormatViolation::at(format!("unclosed {open}"), p);
        }
    }
    FormatViolation::new(format!("no complete <{}> or <{}> block", tags[0], tags[1]))
}

#[cfg(test)]
mod tests;
