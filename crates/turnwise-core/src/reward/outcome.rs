//! Outcome rewards of a whole response (spec §2.1, §2.3, §2.4 last paragraph, §2.7).

use serde::{Deserialize, Serialize};

use super::text::{em, normalize_answer, squad_f1};
use crate::grammar::search_r1::{self, AnswerRule};
use crate::grammar::{FormatViolation, boxed};

/// Result of an outcome reward, with the pieces worth logging.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OutcomeScore {
    /// The reward placed on the last valid response token.
    pub score: f64,
    /// EM of the extracted answer (0 when none), for evaluation.
    pub em: f64,
    /// SQuAD F1 of the extracted answer (0 when none).
    pub f1: f64,
    /// The extracted answer string, if any.
    pub answer: Option<String>,
    /// `None` when the format was accepted, else why not.
    pub format_violation: Option<FormatViolation>,
}

impl OutcomeScore {
    fn format_failure(score: f64, v: FormatViolation) -> Self {
        Self {
            score,
            em: 0.0,
            f1: 0.0,
            answer: None,
            format_violation: Some(v),
        }
    }
}

// ------------------------------------------------------------------ §2.3 boxed EM + format

/// Settings of the A2TGPO/AT2PO boxed EM reward (spec §2.3).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BoxedEmConfig {
    /// Reward on format failure. Default −1 (\[REC\]: A2TGPO paper and ATPO code); the AT2PO
    /// paper says 0 (§9 item 3).
    pub format_failure: f64,
    /// Bonus added to F1 when the response used both `</search>` and `</python>`
    /// (ATPO multi-tool rule; irrelevant for search-only agents). Default 0.1.
    pub multi_tool_bonus: f64,
    /// Run [`boxed::validate_format`] first (training). `false` reproduces the reference's
    /// `is_validate=True` path, which skips it and only needs an extractable answer.
    pub check_format: bool,
}

impl Default for BoxedEmConfig {
    fn default() -> Self {
        Self {
            format_failure: -1.0,
            multi_tool_bonus: 0.1,
            check_format: true,
        }
    }
}

/// A2TGPO / AT2PO outcome reward [CODE ATPO deep_research_em.py `compute_score`] (spec §2.3):
///
/// 1. [`boxed::validate_format`] fails → `format_failure`;
/// 2. first `<answer>` block of the stripped response, then its last `\boxed{}`; failure →
///    `format_failure`;
/// 3. `f1 = squad_f1`, `em = EM`; `f1 > 0` and both `</search>` and `</python>` present →
///    `f1 + multi_tool_bonus`; else `f1 > 0` → `em`; else 0.
///
/// `response` is the decoded response with special tokens skipped.
pub fn boxed_em_reward<S: AsRef<str>>(
    response: &str,
    golds: &[S],
    cfg: &BoxedEmConfig,
) -> OutcomeScore {
    boxed_em_from(response, boxed::extract_answer_block(response), golds, cfg)
}

/// [`boxed_em_reward`] from its parts: `checked` is the text the format rule and the
/// multi-tool rule read, `block` the content of the answer block (`None`: no answer block).
/// [`super::RewardConfig::score`] passes the agent's text ([`super::RewardInput::format_view`])
/// and an answer block written inside one agent turn.
pub fn boxed_em_from<S: AsRef<str>>(
    checked: &str,
    block: Option<&str>,
    golds: &[S],
    cfg: &BoxedEmConfig,
) -> OutcomeScore {
    if cfg.check_format
        && let Err(v) = boxed::validate_format(checked)
    {
        return OutcomeScore::format_failure(cfg.format_failure, v);
    }
    let Some(block) = block else {
        return OutcomeScore::format_failure(
            cfg.format_failure,
            FormatViolation::new("cannot extract answer"),
        );
    };
    let Some(answer) = boxed::extract_boxed(block) else {
        return OutcomeScore::format_failure(
            cfg.format_failure,
            FormatViolation::new("no \\boxed{} answer"),
        );
    };
    let f1 = squad_f1(answer, golds);
    let em = em(answer, golds);
    let score = if f1 > 0.0 && checked.contains("</search>") && checked.contains("</python>") {
        f1 + cfg.multi_tool_bonus
    } else if f1 > 0.0 {
        em
    } else {
        0.0
    };
    OutcomeScore {
        score,
        em,
        f1,
        answer: Some(answer.to_owned()),
        format_violation: None,
    }
}

/// Settings of the `deep_research` F1 variant (spec §2.3, last paragraph).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeepResearchF1Config {
    /// Reward on format failure; default 0 (spec).
    pub format_failure: f64,
    /// Require and score the `\boxed{}` content; default `false` (spec). Note: the
    /// `deep_research.py` in the ATPO snapshot `98e60f6` does require `\boxed{}` and returns −1;
    /// `{format_failure: -1, require_boxed: true}` reproduces that file.
    pub require_boxed: bool,
    /// Multi-tool bonus, as in [`BoxedEmConfig::multi_tool_bonus`]; default 0.1.
    pub multi_tool_bonus: f64,
}

impl Default for DeepResearchF1Config {
    fn default() -> Self {
        Self {
            format_failure: 0.0,
            require_boxed: false,
            multi_tool_bonus: 0.1,
        }
    }
}

/// `deep_research` variant: same tag checks as §2.3 ([`boxed::validate_tags`], plus the boxed
/// requirement when `require_boxed`), answer = first `<answer>` block (stripped) or its last
/// `\boxed{}`, score = F1 (+ multi-tool bonus when both tools were used); F1 = 0 → 0.
pub fn deep_research_f1_reward<S: AsRef<str>>(
    response: &str,
    golds: &[S],
    cfg: &DeepResearchF1Config,
) -> OutcomeScore {
    deep_research_f1_from(response, boxed::extract_answer_block(response), golds, cfg)
}

/// [`deep_research_f1_reward`] from its parts, as [`boxed_em_from`].
pub fn deep_research_f1_from<S: AsRef<str>>(
    checked: &str,
    block: Option<&str>,
    golds: &[S],
    cfg: &DeepResearchF1Config,
) -> OutcomeScore {
    let check = if cfg.require_boxed {
        boxed::validate_format(checked)
    } else {
        boxed::validate_tags(checked)
    };
    if let Err(v) = check {
        return OutcomeScore::format_failure(cfg.format_failure, v);
    }
    let Some(block) = block else {
        return OutcomeScore::format_failure(
            cfg.format_failure,
            FormatViolation::new("cannot extract answer"),
        );
    };
    let answer = if cfg.require_boxed {
        match boxed::extract_boxed(block) {
            Some(a) => a,
            None => {
                return OutcomeScore::format_failure(
                    cfg.format_failure,
                    FormatViolation::new("no \\boxed{} answer"),
                );
            }
        }
    } else {
        crate::grammar::scan::py_strip(block)
    };
    let f1 = squad_f1(answer, golds);
    let score = if f1 > 0.0 && checked.contains("</search>") && checked.contains("</python>") {
        f1 + cfg.multi_tool_bonus
    } else {
        f1
    };
    OutcomeScore {
        score,
        em: em(answer, golds),
        f1,
        answer: Some(answer.to_owned()),
        format_violation: None,
    }
}

// ------------------------------------------------------------------ §2.1 Search-R1 EM

/// Search-R1 EM reward [CODE SR1 qa_em.py `compute_score_em`]: answer per `rule`
/// ([`search_r1::extract_answer`]); none → 0; EM → 1; else 0.
pub fn search_r1_em_reward<S: AsRef<str>>(
    response: &str,
    golds: &[S],
    rule: AnswerRule,
) -> OutcomeScore {
    search_r1_em_from(search_r1::extract_answer(response, rule), golds)
}

/// [`search_r1_em_reward`] of an already extracted answer (`None`: no answer, reward 0).
pub fn search_r1_em_from<S: AsRef<str>>(answer: Option<&str>, golds: &[S]) -> OutcomeScore {
    match answer {
        None => OutcomeScore::format_failure(0.0, FormatViolation::new("no <answer> block")),
        Some(a) => {
            let e = em(a, golds);
            OutcomeScore {
                score: e,
                em: e,
                f1: squad_f1(a, golds),
                answer: Some(a.to_owned()),
                format_violation: None,
            }
        }
    }
}

// ------------------------------------------------------------------ §2.4 Search-R1 format reward

/// Settings of Search-R1's format-aware reward (spec §2.4); defaults are the Tree-GRPO script
/// values `structure_format_score=0.2, final_format_score=0.1, retrieval_score=0`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SearchR1FormatConfig {
    /// Reward of a valid sequence with a wrong / missing answer (λ_f), 0.2.
    pub structure_format_score: f64,
    /// Reward of an invalid sequence with a wrong answer, 0.1.
    pub final_format_score: f64,
    /// Extra reward when a valid sequence retrieved a gold, 0.
    pub retrieval_score: f64,
    /// Reward of a correct answer in a valid sequence, 1.
    pub score: f64,
    /// Answer extraction rule, default [`AnswerRule::LastMatch`] for response-only text.
    pub answer_rule: AnswerRule,
}

impl Default for SearchR1FormatConfig {
    fn default() -> Self {
        Self {
            structure_format_score: 0.2,
            final_format_score: 0.1,
            retrieval_score: 0.0,
            score: 1.0,
            answer_rule: AnswerRule::LastMatch,
        }
    }
}

/// Search-R1 `is_retrieval_correct`: some normalized gold is a substring of some normalized
/// `<information>` block.
pub fn search_r1_retrieval_correct<S: AsRef<str>>(response: &str, golds: &[S]) -> bool {
    search_r1::information_blocks(response).iter().any(|info| {
        let info = normalize_answer(info);
        golds
            .iter()
            .any(|g| info.contains(&normalize_answer(g.as_ref())))
    })
}

/// Search-R1 format-aware EM reward [CODE SR1 qa_em_format.py `compute_score_em`] (spec §2.4):
///
/// | answer | valid sequence | reward |
/// |---|---|---|
/// | none | yes | `structure_format_score` (+ `retrieval_score` if a gold was retrieved) |
/// | none | no | 0 |
/// | EM | yes | `score` |
/// | EM | no | `score − structure_format_score` |
/// | wrong | yes | `structure_format_score` (+ `retrieval_score`) |
/// | wrong | no | `final_format_score` |
pub fn search_r1_format_reward<S: AsRef<str>>(
    response: &str,
    golds: &[S],
    cfg: &SearchR1FormatConfig,
) -> OutcomeScore {
    search_r1_format_from(
        response,
        search_r1_retrieval_correct(response, golds),
        search_r1::extract_answer(response, cfg.answer_rule),
        golds,
        cfg,
    )
}

/// [`search_r1_format_reward`] from its parts: `checked` is the text the sequence rule
/// ([`search_r1::validate_sequence`]) reads, `retrieved` whether some `<information>` block
/// held a gold, `answer` the extracted answer. [`super::RewardConfig::score`] passes the
/// agent's text ([`super::RewardInput::format_view`]), the observations' retrieval and an
/// answer written inside one agent turn.
pub fn search_r1_format_from<S: AsRef<str>>(
    checked: &str,
    retrieved: bool,
    answer: Option<&str>,
    golds: &[S],
    cfg: &SearchR1FormatConfig,
) -> OutcomeScore {
    let validity = search_r1::validate_sequence(checked);
    let valid = validity.is_ok();
    let retrieval = if valid && retrieved {
        cfg.retrieval_score
    } else {
        0.0
    };
    let (e, f1) = answer.map_or((0.0, 0.0), |a| (em(a, golds), squad_f1(a, golds)));
    let score = match (answer, e == 1.0, valid) {
        (None, _, true) => cfg.structure_format_score + retrieval,
        (None, _, false) => 0.0,
        (Some(_), true, true) => cfg.score,
        (Some(_), true, false) => cfg.score - cfg.structure_format_score,
        (Some(_), false, true) => cfg.structure_format_score + retrieval,
        (Some(_), false, false) => cfg.final_format_score,
    };
    OutcomeScore {
        score,
        em: e,
        f1,
        answer: answer.map(str::to_owned),
        format_violation: validity.err(),
    }
}

// ------------------------------------------------------------------ §2.7 DAPO overlong

/// DAPO overlong buffer settings (spec §2.7); defaults are the A2TGPO/AT2PO baseline
/// (`L_max = 6192`, `L_buf = 2000`, factor 1).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OverlongConfig {
    /// `L_max`, the maximum response length in tokens.
    pub max_len: usize,
    /// `L_buf`, the length of the linear penalty ramp before `L_max`.
    pub buffer_len: usize,
    /// Penalty at `L = L_max`.
    pub penalty_factor: f64,
}

impl Default for OverlongConfig {
    fn default() -> Self {
        Self {
            max_len: 6192,
            buffer_len: 2000,
            penalty_factor: 1.0,
        }
    }
}

/// DAPO overlong penalty [CODE ATPO verl/workers/reward_manager/dapo.py] (spec §2.7):
/// `min(−(L − (L_max − L_buf)) / L_buf · factor, 0)`, where `L` is the valid response length
/// (observation tokens included in multi-turn TITO). A zero buffer gives 0 (no ramp defined).
pub fn overlong_penalty(len: usize, cfg: &OverlongConfig) -> f64 {
    if cfg.buffer_len == 0 {
        return 0.0;
    }
    let expected = cfg.max_len as f64 - cfg.buffer_len as f64;
    let exceed = len as f64 - expected;
    (-exceed / cfg.buffer_len as f64 * cfg.penalty_factor).min(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{TOL, assert_close};

    const BEATLES: [&str; 1] = ["Beatles"];

    /// §2.3 table, the four responses with golds = ["Beatles"].
    #[test]
    fn spec_2_3_boxed_em_vectors() {
        let cfg = BoxedEmConfig::default();
        let cases = [
            (
                "<think>x</think><search>q</search> <result>\nr\n</result><think>y</think><answer>The answer is \\boxed{The Beatles}</answer>",
                1.0,
            ),
            ("<think>x</think><answer>Beatles</answer>", -1.0),
            (
                "<think>x</think><answer>\\boxed{Rolling Stones}</answer>",
                0.0,
            ),
            (
                "<think>x</think><search>q</search><think>y</think><answer>\\boxed{Beatles}</answer>",
                -1.0,
            ),
        ];
        for (response, want) in cases {
            assert_close(
                boxed_em_reward(response, &BEATLES, &cfg).score,
                want,
                TOL,
                response,
            );
        }
        // Paper value for AT2PO: format failure → 0.
        let paper = BoxedEmConfig {
            format_failure: 0.0,
            ..cfg
        };
        assert_close(
            boxed_em_reward(cases[1].0, &BEATLES, &paper).score,
            0.0,
            TOL,
            "AT2PO paper 0",
        );
    }

    /// §2.3 multi-tool rule: f1 > 0 with both `</search>` and `</python>` → f1 + 0.1.
    /// Answer "Beatles band" vs "Beatles": P = 1/2, R = 1 → F1 = 2/3, score = 2/3 + 0.1.
    #[test]
    fn spec_2_3_multi_tool_bonus() {
        let r = "<think>a</think><search>q</search> <result>\nr\n</result><python>1</python> <result>\n1\n</result>\
                 <think>b</think><answer>\\boxed{Beatles band}</answer>";
        let s = boxed_em_reward(r, &BEATLES, &BoxedEmConfig::default());
        assert_close(s.score, 2.0 / 3.0 + 0.1, TOL, "multi-tool bonus");
        assert_close(s.em, 0.0, TOL, "em");
        // Without python: f1 > 0 → em = 0.
        let r2 = "<think>a</think><answer>\\boxed{Beatles band}</answer>";
        assert_close(
            boxed_em_reward(r2, &BEATLES, &BoxedEmConfig::default()).score,
            0.0,
            TOL,
            "em path",
        );
    }

    /// §2.3 deep_research variant: no `\boxed{}`, failure → 0, score = F1.
    /// "Beatles band" vs "Beatles": F1 = 2/3 (see above).
    #[test]
    fn spec_2_3_deep_research_variant() {
        let cfg = DeepResearchF1Config::default();
        let r = "<think>x</think><answer>Beatles band</answer>";
        assert_close(
            deep_research_f1_reward(r, &BEATLES, &cfg).score,
            2.0 / 3.0,
            TOL,
            "f1 score",
        );
        assert_close(
            deep_research_f1_reward("<answer>Beatles</answer>", &BEATLES, &cfg).score,
            0.0,
            TOL,
            "no think",
        );
        let strict = DeepResearchF1Config {
            format_failure: -1.0,
            require_boxed: true,
            ..cfg
        };
        assert_close(
            deep_research_f1_reward(r, &BEATLES, &strict).score,
            -1.0,
            TOL,
            "snapshot file",
        );
    }

    /// §2.1 Search-R1 EM reward with both extraction rules.
    #[test]
    fn search_r1_em_reward_rules() {
        let r = "<think>x</think><answer>the Beatles.</answer>";
        assert_close(
            search_r1_em_reward(r, &BEATLES, AnswerRule::LastMatch).score,
            1.0,
            TOL,
            "last match",
        );
        assert_close(
            search_r1_em_reward(r, &BEATLES, AnswerRule::LastOfAtLeastTwo).score,
            0.0,
            TOL,
            ">=2 rule",
        );
    }

    /// §2.4 Search-R1 format reward, each branch with the default 0.2 / 0.1 / 0 and
    /// retrieval_score 0.1 where retrieval matters.
    #[test]
    fn spec_2_4_search_r1_format_reward() {
        let cfg = SearchR1FormatConfig::default();
        let valid_right = "<think>a</think><search>q</search>\n\n<information>Doc 1 The Beatles</information>\n\n<think>b</think><answer>Beatles</answer>";
        let valid_wrong = "<think>a</think><answer>Stones</answer>";
        let invalid_right = "<answer>Beatles</answer>";
        let invalid_wrong = "text <answer>Stones</answer>";
        let valid_none = "<think>a</think><search>q</search>\n\n<information>Beatles</information>\n\n<think>b</think><answer></answer>";
        let cases = [
            (valid_right, 1.0),
            (valid_wrong, 0.2),
            (invalid_right, 0.8),
            (invalid_wrong, 0.1),
            ("no answer at all", 0.0),
        ];
        for (r, want) in cases {
            assert_close(
                search_r1_format_reward(r, &BEATLES, &cfg).score,
                want,
                TOL,
                r,
            );
        }
        // Empty answer is an answer (wrong): valid → 0.2 + retrieval 0.1 (gold in <information>).
        let with_ret = SearchR1FormatConfig {
            retrieval_score: 0.1,
            ..cfg
        };
        assert_close(
            search_r1_format_reward(valid_none, &BEATLES, &with_ret).score,
            0.3,
            TOL,
            "retrieval",
        );
        // Valid but no answer at all cannot happen (the sequence must end in </answer>), so the
        // "none & valid" branch only fires with the ≥2-matches rule: 0.2.
        let two = SearchR1FormatConfig {
            answer_rule: AnswerRule::LastOfAtLeastTwo,
            ..cfg
        };
        assert_close(
            search_r1_format_reward(valid_wrong, &BEATLES, &two).score,
            0.2,
            TOL,
            "none valid",
        );
    }

    /// §2.7 vectors: L_max 6192, L_buf 2000, factor 1.
    #[test]
    fn spec_2_7_overlong_vectors() {
        let cfg = OverlongConfig::default();
        for (len, want) in [(4000, 0.0), (4192, 0.0), (5192, -0.5), (6192, -1.0)] {
            assert_close(
                overlong_penalty(len, &cfg),
                want,
                TOL,
                &format!("L = {len}"),
            );
        }
    }
}
