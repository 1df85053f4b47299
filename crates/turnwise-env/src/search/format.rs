//! Rendering retrieved passages as the observation text an agent format expects.
//!
//! Passages are rendered as Search-R1 does (`search_r1/llm_agent/generation.py`,
//! `_passages2string`): one line `Doc {i}(Title: {first line of contents}) {rest}` per hit, with
//! the first line kept verbatim (so wiki-18's quoted titles stay quoted). The block is then
//! wrapped per [`ObservationStyle`]:
//!
//! - [`ObservationStyle::SearchR1`]: `"\n\n<information>{passages}</information>\n\n"` (passages
//!   stripped of surrounding whitespace, as Search-R1 does);
//! - [`ObservationStyle::Result`] (A2TGPO / AT2PO): `" <result>\n{passages}\n</result>"`.
//!
//! A [`TextBudget`] bounds the passages text (not the tags): whole passages are kept while they
//! fit; the first one that does not fit is cut at a word boundary, and the rest are dropped.

use super::Hit;
use crate::corpus::raw_title_line;

/// How an observation is wrapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ObservationStyle {
    /// Search-R1: `\n\n<information>…</information>\n\n`.
    SearchR1,
    /// A2TGPO / AT2PO: ` <result>\n…\n</result>`.
    Result,
}

/// A bound on the length of the passages text.
#[derive(Clone, Copy)]
pub enum TextBudget<'a> {
    /// No bound.
    Unlimited,
    /// At most this many whitespace-separated words.
    Words(usize),
    /// At most `max` tokens as counted by `count` (for example a tokenizer's encode length).
    Tokens {
        /// Maximum number of tokens.
        max: usize,
        /// Counts the tokens of a text.
        count: &'a dyn Fn(&str) -> usize,
    },
}

impl std::fmt::Debug for TextBudget<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TextBudget::Unlimited => write!(f, "Unlimited"),
            TextBudget::Words(n) => write!(f, "Words({n})"),
            TextBudget::Tokens { max, .. } => write!(f, "Tokens {{ max: {max} }}"),
        }
    }
}

impl TextBudget<'_> {
    fn cost(&self, text: &str) -> usize {
        match self {
            TextBudget::Unlimited => 0,
            TextBudget::Words(_) => text.split_whitespace().count(),
            TextBudget::Tokens { count, .. } => count(text),
        }
    }

    fn limit(&self) -> usize {
        match self {
            TextBudget::Unlimited => usize::MAX,
            TextBudget::Words(n) => *n,
            TextBudget::Tokens { max, .. } => *max,
        }
    }
}

/// One passage line: `Doc {rank}(Title: {title line}) {text}` (rank is 1-based).
pub fn passage_line(rank: usize, hit: &Hit) -> String {
    let (title, text) = raw_title_line(&hit.document.contents);
    format!("Doc {rank}(Title: {title}) {text}")
}

/// The passages block: one [`passage_line`] per hit joined by newlines, cut to `budget`.
pub fn passages_text(hits: &[Hit], budget: &TextBudget<'_>) -> String {
    let mut out = String::new();
    for (i, hit) in hits.iter().enumerate() {
        let line = passage_line(i + 1, hit);
        let candidate = if out.is_empty() {
            line.clone()
        } else {
            format!("{out}\n{line}")
        };
        if budget.cost(&candidate) <= budget.limit() {
            out = candidate;
            continue;
        }
        // Keep the longest word prefix of this line that still fits (binary search).
        let words: Vec<&str> = line.split_whitespace().collect();
        let with_prefix = |n: usize| {
            let prefix = words[..n].join(" ");
            if out.is_empty() {
                prefix
            } else {
                format!("{out}\n{prefix}")
            }
        };
        let (mut lo, mut hi) = (0usize, words.len());
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if budget.cost(&with_prefix(mid)) <= budget.limit() {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        if lo > 0 {
            out = with_prefix(lo);
        }
        break;
    }
    out
}

/// The full observation for `hits` in `style`, passages cut to `budget`.
///
/// ```
/// use turnwise_env::search::{Document, Hit};
/// use turnwise_env::search::format::{format_observation, ObservationStyle, TextBudget};
/// let hits = vec![Hit {
///     document: Document { id: "0".into(), contents: "\"Paris\"\nParis is in France.".into() },
///     score: 1.0,
/// }];
/// assert_eq!(
///     format_observation(&hits, ObservationStyle::SearchR1, &TextBudget::Unlimited),
///     "\n\n<information>Doc 1(Title: \"Paris\") Paris is in France.</information>\n\n"
/// );
/// assert_eq!(
///     format_observation(&hits, ObservationStyle::Result, &TextBudget::Words(4)),
///     " <result>\nDoc 1(Title: \"Paris\") Paris\n</result>"
/// );
/// ```
pub fn format_observation(
    hits: &[Hit],
    style: ObservationStyle,
    budget: &TextBudget<'_>,
) -> String {
    let passages = passages_text(hits, budget);
    match style {
        ObservationStyle::SearchR1 => {
            format!("\n\n<information>{}</information>\n\n", passages.trim())
        }
        ObservationStyle::Result => format!(" <result>\n{passages}\n</result>"),
    }
}

/// The observation of routine turn `k` of `n` (1-based; `task.world.decision_density`): the
/// same text whatever the agent wrote, in the observation wrapper of `style`.
pub fn routine_observation(style: ObservationStyle, k: usize, n: usize) -> String {
    let text = format!("Doc 1(Title: Routine check) Routine check {k} of {n} is done.");
    match style {
        ObservationStyle::SearchR1 => format!("\n\n<information>{text}</information>\n\n"),
        ObservationStyle::Result => format!(" <result>\n{text}\n</result>"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::corpus::join_contents;
    use crate::search::Document;

    fn hit(title: &str, text: &str) -> Hit {
        Hit {
            document: Document {
                id: title.into(),
                contents: join_contents(title, text),
            },
            score: 1.0,
        }
    }

    #[test]
    fn search_r1_block_matches_reference_layout() {
        let hits = vec![hit("A", "alpha text"), hit("B", "beta text")];
        let obs = format_observation(&hits, ObservationStyle::SearchR1, &TextBudget::Unlimited);
        assert_eq!(
            obs,
            "\n\n<information>Doc 1(Title: \"A\") alpha text\nDoc 2(Title: \"B\") beta text</information>\n\n"
        );
        let empty = format_observation(&[], ObservationStyle::Result, &TextBudget::Unlimited);
        assert_eq!(empty, " <result>\n\n</result>");
    }

    #[test]
    fn budgets_cut_at_word_boundaries() {
        let hits = vec![hit("A", "one two three"), hit("B", "four five six seven")];
        // Line 1 has 6 words ("Doc", "1(Title:", "\"A\")", "one", "two", "three").
        assert_eq!(
            passages_text(&hits, &TextBudget::Words(6)),
            "Doc 1(Title: \"A\") one two three"
        );
        assert_eq!(
            passages_text(&hits, &TextBudget::Words(8)),
            "Doc 1(Title: \"A\") one two three\nDoc 2(Title:"
        );
        assert_eq!(passages_text(&hits, &TextBudget::Words(0)), "");
        // A character-count "tokenizer": never exceeds the budget.
        let chars = |s: &str| s.chars().count();
        for max in [0, 5, 20, 33, 40, 60, 1000] {
            let text = passages_text(&hits, &TextBudget::Tokens { max, count: &chars });
            assert!(text.chars().count() <= max, "{max}: {text:?}");
        }
        let all = passages_text(
            &hits,
            &TextBudget::Tokens {
                max: 1000,
                count: &chars,
            },
        );
        assert_eq!(all, passages_text(&hits, &TextBudget::Unlimited));
    }
}
