//! Agent tag grammars (turnwise-core `grammar`, spec §1.3) and rewards (`reward`, spec §2).

use pyo3::prelude::*;
use turnwise_core::grammar::t2po::TargetScript;
use turnwise_core::grammar::{self, Format, FormatViolation, boxed, mt_ppo, search_r1, t2po};
use turnwise_core::reward::{self, RewardConfig, RewardInput, TurnText};

use crate::error::{BindingError, Result, from_json, to_json};

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(formats, m)?)?;
    m.add_function(wrap_pyfunction!(validators, m)?)?;
    m.add_function(wrap_pyfunction!(reward_names, m)?)?;
    m.add_function(wrap_pyfunction!(parse_turn, m)?)?;
    m.add_function(wrap_pyfunction!(validate, m)?)?;
    m.add_function(wrap_pyfunction!(score, m)?)?;
    m.add_function(wrap_pyfunction!(normalize_answer, m)?)?;
    m.add_function(wrap_pyfunction!(em, m)?)?;
    m.add_function(wrap_pyfunction!(sub_em, m)?)?;
    m.add_function(wrap_pyfunction!(f1, m)?)?;
    m.add_function(wrap_pyfunction!(igpo_f1, m)?)?;
    Ok(())
}

/// The whole-response format validators [`validate`] knows, with what each checks.
const VALIDATORS: [(&str, &str); 6] = [
    (
        "search_r1_sequence",
        "Search-R1 `qa_em_format` state machine over the whole response (§2.4)",
    ),
    (
        "boxed_format",
        "A2TGPO/AT2PO `validate_format`: tags balanced and a boxed answer (§2.3)",
    ),
    ("boxed_tags", "A2TGPO/AT2PO tag balance only (§2.3)"),
    (
        "mt_ppo_final",
        "MT-PPO final-turn format: <think>…</think> then <answer>…</answer> (§2.4)",
    ),
    (
        "mt_ppo_intermediate",
        "MT-PPO intermediate-turn format: <think>…</think> then <search>…</search> (§2.4)",
    ),
    (
        "t2po_strict",
        "T2PO V_strict: one <think> then one <action>, no foreign script (§2.6)",
    ),
];

/// The agent format names (`search_r1`, `boxed`, `t2po`, `verifiers`).
#[pyfunction]
pub fn formats() -> Vec<&'static str> {
    Format::ALL.iter().map(|f| f.name()).collect()
}

/// The validator names of [`validate`] with a description of each.
#[pyfunction]
pub fn validators() -> Vec<(&'static str, &'static str)> {
    VALIDATORS.to_vec()
}

/// The reward names of [`score`].
#[pyfunction]
pub fn reward_names() -> Vec<&'static str> {
    RewardConfig::NAMES.to_vec()
}

fn format_of(name: &str) -> Result<Format> {
    name.parse()
        .map_err(|e: grammar::UnknownFormat| BindingError::invalid("format", e.to_string()))
}

fn script_of(name: Option<&str>) -> Result<TargetScript> {
    match name {
        None => Ok(TargetScript::default()),
        Some(s) => serde_json::from_value(serde_json::Value::String(s.to_owned())).map_err(|_| {
            BindingError::invalid(
                "script",
                format!("unknown target script {s:?}; known: any, english"),
            )
        }),
    }
}

/// Parses one agent turn in `format`; returns the `ParsedTurn` as JSON: `action` (`kind`
/// search/answer/invalid with its `query`/`text`/`reason`), `verdict.checks` (named format
/// checks, each with its violation or null) and `final_answer` (the EM string of an answer
/// turn). `script` (T2PO only: `english` default, or `any`) is the V_strict character check.
#[pyfunction]
#[pyo3(signature = (format, text, script=None))]
pub fn parse_turn(format: &str, text: &str, script: Option<&str>) -> PyResult<String> {
    let format = format_of(format)?;
    let parsed = match format {
        Format::T2po => t2po::parse_turn(text, script_of(script)?),
        other => {
            if script.is_some() {
                return Err(BindingError::invalid(
                    "script",
                    format!("applies to format t2po only, not {other}"),
                )
                .into());
            }
            grammar::parse_turn(other, text)
        }
    };
    Ok(to_json("parsed", &parsed)?)
}

/// Runs validator `rule` (see [`validators`]) on a whole response; `None` when it passes,
/// else `(reason, byte offset or None)`.
#[pyfunction]
#[pyo3(signature = (rule, text, script=None))]
pub fn validate(
    rule: &str,
    text: &str,
    script: Option<&str>,
) -> PyResult<Option<(String, Option<usize>)>> {
    let result: std::result::Result<(), FormatViolation> = match rule {
        "search_r1_sequence" => search_r1::validate_sequence(text),
        "boxed_format" => boxed::validate_format(text),
        "boxed_tags" => boxed::validate_tags(text),
        "mt_ppo_final" => mt_ppo::final_turn_format(text),
        "mt_ppo_intermediate" => mt_ppo::intermediate_turn_format(text),
        "t2po_strict" => t2po::v_strict(text, script_of(script)?),
        other => {
            let known: Vec<&str> = VALIDATORS.iter().map(|(n, _)| *n).collect();
            return Err(BindingError::invalid(
                "rule",
                format!("unknown validator {other:?}; known: {}", known.join(", ")),
            )
            .into());
        }
    };
    Ok(result.err().map(|v| (v.reason, v.at)))
}

/// Scores one rollout with the reward described by `reward` (JSON: `{"name": …, settings…}`);
/// `turns` are `(generated, observation or None)` pairs, `golds` the accepted answers. Returns
/// the `RewardOutput` as JSON (`score`, `turn_rewards`, `em`, `format_ok`, `reason`, `parts`).
#[pyfunction]
pub fn score(
    reward: &str,
    turns: Vec<(String, Option<String>)>,
    golds: Vec<String>,
) -> PyResult<String> {
    let cfg: RewardConfig = from_json("reward", reward)?;
    let turns: Vec<TurnText<'_>> = turns
        .iter()
        .map(|(g, o)| TurnText {
            generated: g,
            observation: o.as_deref(),
        })
        .collect();
    let input = RewardInput::from_turns(&turns, &golds);
    let out = cfg.score(&input).map_err(BindingError::from)?;
    Ok(to_json("output", &out)?)
}

/// §2.1 `normalize_answer` (lower case, no punctuation, no articles, single spaces).
#[pyfunction]
pub fn normalize_answer(text: &str) -> String {
    reward::normalize_answer(text)
}

/// §2.1 exact match: 1.0 when the normalized prediction equals a normalized gold.
#[pyfunction]
pub fn em(prediction: &str, golds: Vec<String>) -> f64 {
    reward::em(prediction, &golds)
}

/// §2.1 SubEM: 1.0 when a normalized gold occurs in the normalized prediction.
#[pyfunction]
pub fn sub_em(prediction: &str, golds: Vec<String>) -> f64 {
    reward::sub_em(prediction, &golds)
}

/// §2.2 SQuAD token F1, maximum over the golds.
#[pyfunction]
pub fn f1(prediction: &str, golds: Vec<String>) -> f64 {
    reward::squad_f1(prediction, &golds)
}

/// §2.2 IGPO's F1 variant (its own normalization), maximum over the golds.
#[pyfunction]
pub fn igpo_f1(prediction: &str, golds: Vec<String>) -> f64 {
    reward::igpo_f1(prediction, &golds)
}
