//! Answer normalization and string metrics (spec §2.1, §2.2).
//!
//! - [`normalize_answer`], [`em`], [`sub_em`]: Search-R1 `qa_em.py` (identical in ATPO
//!   `deep_research_em.py`).
//! - [`squad_f1`]: ATPO `get_f1_score` (SQuAD token F1 with the yes/no/noanswer rule).
//! - [`igpo_f1`], [`igpo_em`], [`igpo_score`]: IGPO `info_gain.py` `compute_f1`
//!   (punctuation → space, no article removal, token *sets*, golds split on
//!   [`IGPO_ANSWER_SPLIT`]).

use std::collections::{HashMap, HashSet};
use std::sync::LazyLock;

use regex::Regex;
use serde::{Deserialize, Serialize};

use crate::grammar::scan::{self, py_split, py_strip};

/// `\b(a|an|the)\b` with Unicode word boundaries, like Python 3's `re` on `str`.
static ARTICLES: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\b(a|an|the)\b").expect("static regex is valid"));

/// Search-R1 answer normalization (spec §2.1):
/// `white_space_fix(remove_articles(remove_punc(lower(s))))`.
///
/// Punctuation (ASCII `string.punctuation`) is removed **before** articles, so `"the-end"`
/// becomes `"theend"`; articles are replaced by a space at word boundaries (`"theater"` is
/// untouched); whitespace runs collapse to one space.
pub fn normalize_answer(s: &str) -> String {
    let no_punc: String = s
        .to_lowercase()
        .chars()
        .filter(|c| !c.is_ascii_punctuation())
        .collect();
    let no_articles = ARTICLES.replace_all(&no_punc, " ");
    py_split(&no_articles).collect::<Vec<_>>().join(" ")
}

/// Exact match (spec §2.1): 1.0 if `normalize(pred) == normalize(g)` for some gold, else 0.0.
pub fn em<S: AsRef<str>>(pred: &str, golds: &[S]) -> f64 {
    let p = normalize_answer(pred);
    f64::from(u8::from(
        golds.iter().any(|g| normalize_answer(g.as_ref()) == p),
    ))
}

/// Substring exact match (spec §2.1): 1.0 if some normalized gold is a substring of the
/// normalized prediction.
pub fn sub_em<S: AsRef<str>>(pred: &str, golds: &[S]) -> f64 {
    let p = normalize_answer(pred);
    f64::from(u8::from(
        golds
            .iter()
            .any(|g| p.contains(&normalize_answer(g.as_ref()))),
    ))
}

/// The normalized answers that the SQuAD F1 rule treats as categorical.
const YES_NO: [&str; 3] = ["yes", "no", "noanswer"];

/// SQuAD-style token F1, max over golds [CODE ATPO `get_f1_score`] (spec §2.2).
///
/// Tokens are the whitespace split of [`normalize_answer`]; the overlap is a multiset
/// intersection; `F1 = 2PR / (P + R)`. A gold contributes 0 when either normalized side is
/// `yes`/`no`/`noanswer` and the two differ, or when nothing overlaps.
pub fn squad_f1<S: AsRef<str>>(pred: &str, golds: &[S]) -> f64 {
    let p = normalize_answer(pred);
    let p_tokens: Vec<&str> = py_split(&p).collect();
    let mut best: f64 = 0.0;
    for g in golds {
        let g = normalize_answer(g.as_ref());
        if (YES_NO.contains(&p.as_str()) || YES_NO.contains(&g.as_str())) && p != g {
            continue;
        }
        let g_tokens: Vec<&str> = py_split(&g).collect();
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for t in &g_tokens {
            *counts.entry(t).or_default() += 1;
        }
        let mut same = 0usize;
        for t in &p_tokens {
            if let Some(c) = counts.get_mut(t)
                && *c > 0
            {
                *c -= 1;
                same += 1;
            }
        }
        if same == 0 {
            continue;
        }
        let precision = same as f64 / p_tokens.len() as f64;
        let recall = same as f64 / g_tokens.len() as f64;
        best = best.max(2.0 * precision * recall / (precision + recall));
    }
    best
}

/// Separator of several golds in one IGPO ground-truth string.
pub const IGPO_ANSWER_SPLIT: &str = "<|answer_split|>";

/// Splits an IGPO ground-truth string into golds (on [`IGPO_ANSWER_SPLIT`]).
pub fn split_igpo_golds(ground_truth: &str) -> Vec<&str> {
    ground_truth.split(IGPO_ANSWER_SPLIT).collect()
}

/// IGPO `preprocess_text` after lowercasing: every ASCII punctuation character becomes a
/// space, whitespace runs collapse, ends are stripped.
pub fn igpo_normalize(s: &str) -> String {
    let spaced: String = s
        .to_lowercase()
        .chars()
        .map(|c| if c.is_ascii_punctuation() { ' ' } else { c })
        .collect();
    py_split(&spaced).collect::<Vec<_>>().join(" ")
}

/// IGPO token-set F1 between an answer and golds (spec §2.2): [`igpo_normalize`] both sides,
/// token **sets**, max F1 over golds; empty token sets contribute 0.
pub fn igpo_f1<S: AsRef<str>>(pred: &str, golds: &[S]) -> f64 {
    let p = igpo_normalize(pred);
    let p_set: HashSet<&str> = py_split(&p).collect();
    let mut best: f64 = 0.0;
    for g in golds {
        let g = igpo_normalize(g.as_ref());
        let g_set: HashSet<&str> = py_split(&g).collect();
        if p_set.is_empty() || g_set.is_empty() {
            continue;
        }
        let common = p_set.intersection(&g_set).count() as f64;
        let precision = common / p_set.len() as f64;
        let recall = common / g_set.len() as f64;
        if precision + recall > 0.0 {
            best = best.max(2.0 * precision * recall / (precision + recall));
        }
    }
    best
}

/// IGPO exact match: 1.0 if [`igpo_normalize`]d answer equals some normalized gold.
pub fn igpo_em<S: AsRef<str>>(pred: &str, golds: &[S]) -> f64 {
    let p = igpo_normalize(pred);
    f64::from(u8::from(
        golds.iter().any(|g| igpo_normalize(g.as_ref()) == p),
    ))
}

/// Which IGPO score [`igpo_score`] computes (IGPO `val_type`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IgpoMetric {
    /// Training reward `f1`: token-set F1, format failure → [`IGPO_FORMAT_FAILURE`].
    #[default]
    F1,
    /// `em`: exact match after normalization, format failure → [`IGPO_FORMAT_FAILURE`].
    Em,
    /// `noformatf1`: the F1 metric with format failure → 0.
    NoFormatF1,
}

/// IGPO training reward for a format failure.
pub const IGPO_FORMAT_FAILURE: f64 = -2.0;

/// IGPO `check_tags_balance`: for `code`, `tool_call`, `think`, `answer`, the numbers of
/// opening and closing tags are equal and, walking left to right, every opening tag has a
/// closing tag after it.
pub fn igpo_tags_balanced(text: &str) -> bool {
    ["code", "tool_call", "think", "answer"].iter().all(|tag| {
        let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
        if scan::count(text, &open) != scan::count(text, &close) {
            return false;
        }
        let mut from = 0;
        while let Some(start) = scan::find_from(text, &open, from) {
            match scan::find_from(text, &close, start) {
                Some(end) => from = end + 1,
                None => return false,
            }
        }
        true
    })
}

/// IGPO outcome score of a whole response [CODE IGPO `compute_f1`] (spec §2.2).
///
/// The response and `ground_truth` are lowercased; golds are split on
/// [`IGPO_ANSWER_SPLIT`]; unbalanced tags ([`igpo_tags_balanced`]) or no `<answer>` block is a
/// format failure (−2.0, or 0 for [`IgpoMetric::NoFormatF1`]); otherwise the first `<answer>`
/// block is scored by [`igpo_f1`] or [`igpo_em`].
pub fn igpo_score(response: &str, ground_truth: &str, metric: IgpoMetric) -> f64 {
    let lower = response.to_lowercase();
    let answer = scan::first_block(&lower, "<answer>", "</answer>").map(|b| b.content);
    igpo_score_from(&lower, answer, ground_truth, metric)
}

/// [`igpo_score`] from its parts: `checked` is the text the tag-balance rule reads, `answer`
/// the content of the first `<answer>` block (`None`: no answer block, a format failure).
/// [`super::RewardConfig::score`] passes the agent's text
/// ([`super::RewardInput::format_view`]) and a block written inside one agent turn.
pub fn igpo_score_from(
    checked: &str,
    answer: Option<&str>,
    ground_truth: &str,
    metric: IgpoMetric,
) -> f64 {
    let failure = match metric {
        IgpoMetric::NoFormatF1 => 0.0,
        IgpoMetric::F1 | IgpoMetric::Em => IGPO_FORMAT_FAILURE,
    };
    let ground_truth = ground_truth.to_lowercase();
    let golds = split_igpo_golds(&ground_truth);
    if !igpo_tags_balanced(&checked.to_lowercase()) {
        return failure;
    }
    let Some(answer) = answer else {
        return failure;
    };
    let answer = answer.to_lowercase();
    let answer = py_strip(&answer);
    match metric {
        IgpoMetric::Em => igpo_em(answer, &golds),
        IgpoMetric::F1 | IgpoMetric::NoFormatF1 => igpo_f1(answer, &golds),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{TOL, assert_close};
    use proptest::prelude::*;

    /// §2.1 table: normalization vectors.
    #[test]
    fn spec_2_1_normalize_vectors() {
        assert_eq!(normalize_answer("  The Eiffel   Tower! "), "eiffel tower");
        assert_eq!(normalize_answer("U.S. Army"), "us army");
        assert_eq!(
            normalize_answer("A Tale of Two Cities"),
            "tale of two cities"
        );
        assert_eq!(normalize_answer("theater"), "theater");
        // Order matters: punctuation first, so the article survives inside "theend".
        assert_eq!(normalize_answer("the-end"), "theend");
    }

    /// §2.1 table: EM vectors (and SubEM on the same inputs).
    #[test]
    fn spec_2_1_em_vectors() {
        assert_close(
            em("the Beatles.", &["Beatles", "The Fab Four"]),
            1.0,
            TOL,
            "EM the Beatles.",
        );
        assert_close(
            em("Beatles band", &["Beatles"]),
            0.0,
            TOL,
            "EM Beatles band",
        );
        assert_close(
            sub_em("Beatles band", &["Beatles"]),
            1.0,
            TOL,
            "SubEM Beatles band",
        );
        assert_close(sub_em("band", &["Beatles"]), 0.0, TOL, "SubEM band");
        assert_close(em("x", &[] as &[&str]), 0.0, TOL, "EM no golds");
    }

    /// §2.2: the four SQuAD-F1 vectors.
    #[test]
    fn spec_2_2_squad_f1_vectors() {
        assert_close(
            squad_f1("Peter Schmeichel goalkeeper", &["Peter Schmeichel"]),
            0.8,
            TOL,
            "f1 goalkeeper",
        );
        assert_close(squad_f1("no", &["yes"]), 0.0, TOL, "f1 no/yes");
        assert_close(squad_f1("yes it is", &["yes"]), 0.0, TOL, "f1 yes rule");
        assert_close(
            squad_f1("the cat the cat", &["cat"]),
            0.666667,
            TOL,
            "f1 cat cat",
        );
    }

    /// §2.2: the two IGPO-F1 vectors, with the SQuAD-F1 contrast values.
    #[test]
    fn spec_2_2_igpo_f1_vectors() {
        assert_close(
            igpo_f1("U.S. Army", &["US Army"]),
            0.4,
            TOL,
            "igpo U.S. Army",
        );
        assert_close(
            squad_f1("U.S. Army", &["US Army"]),
            1.0,
            TOL,
            "squad U.S. Army",
        );
        assert_close(
            igpo_f1("cat cat cat", &["cat dog"]),
            0.666667,
            TOL,
            "igpo cat",
        );
        assert_close(squad_f1("cat cat cat", &["cat dog"]), 0.4, TOL, "squad cat");
    }

    /// §2.2: IGPO response-level score with `<|answer_split|>` golds and the −2.0 / 0 format
    /// failure values.
    #[test]
    fn spec_2_2_igpo_score_format_rule() {
        let gt = "US Army<|answer_split|>United States Army";
        let ok = "<think>x</think><answer>The U.S. Army</answer>";
        // Pred set {the, u, s, army}. Gold "us army" → {us, army}: 1 common, P = 1/4, R = 1/2,
        // F1 = 1/3. Gold "united states army": P = 1/4, R = 1/3, F1 = 2/7. Max = 1/3.
        assert_close(
            igpo_score(ok, gt, IgpoMetric::F1),
            1.0 / 3.0,
            TOL,
            "igpo f1 response",
        );
        assert_close(
            igpo_score(
                "<think>x</think><answer>US ARMY</answer>",
                gt,
                IgpoMetric::Em,
            ),
            1.0,
            TOL,
            "igpo em",
        );
        let unbalanced = "<think>x<answer>US Army</answer>";
        assert_close(
            igpo_score(unbalanced, gt, IgpoMetric::F1),
            -2.0,
            TOL,
            "igpo unbalanced",
        );
        assert_close(
            igpo_score(unbalanced, gt, IgpoMetric::NoFormatF1),
            0.0,
            TOL,
            "noformatf1",
        );
        assert_close(
            igpo_score("<think>x</think>", gt, IgpoMetric::F1),
            -2.0,
            TOL,
            "igpo no answer",
        );
        assert!(!igpo_tags_balanced("</answer><answer>"));
    }

    fn word() -> impl Strategy<Value = String> {
        prop::sample::select(vec![
            "a", "the", "cat", "U.S.", "Army", "yes", "no", "é", "-", "x1", "The",
        ])
        .prop_map(str::to_owned)
    }

    fn phrase() -> impl Strategy<Value = String> {
        prop::collection::vec(word(), 0..6).prop_map(|w| w.join(" "))
    }

    proptest! {
        #[test]
        fn em_and_f1_ranges(p in phrase(), g in prop::collection::vec(phrase(), 0..3)) {
            let e = em(&p, &g);
            prop_assert!(e == 0.0 || e == 1.0);
            let f = squad_f1(&p, &g);
            prop_assert!((0.0..=1.0).contains(&f));
            let fi = igpo_f1(&p, &g);
            prop_assert!((0.0..=1.0).contains(&fi));
            if e == 1.0 {
                prop_assert_eq!(sub_em(&p, &g), 1.0);
            }
        }

        #[test]
        fn f1_of_self_is_one(p in phrase()) {
            prop_assume!(!normalize_answer(&p).is_empty());
            prop_assert!((squad_f1(&p, &[p.as_str()]) - 1.0).abs() <= TOL);
        }

        #[test]
        fn normalize_is_idempotent(s in any::<String>()) {
            let n = normalize_answer(&s);
            prop_assert_eq!(normalize_answer(&n), n.clone());
            let _ = igpo_score(&s, &s, IgpoMetric::F1);
        }
    }
}
