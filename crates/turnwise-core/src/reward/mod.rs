//! # Outcome and turn-level rewards (spec §2)
//!
//! Read top to bottom:
//!
//! - [`text`]: §2.1 `normalize_answer`, EM, SubEM; §2.2 SQuAD F1 and IGPO F1.
//! - [`outcome`]: whole-response rewards — §2.3 boxed EM + format (A2TGPO/AT2PO) and its
//!   `deep_research` F1 variant, §2.1 Search-R1 EM, §2.4 Search-R1 format-aware reward, §2.7
//!   DAPO overlong penalty.
//! - [`mt_ppo`]: §2.4 MT-PPO final and intermediate turn rewards.
//! - [`two_turn`]: §2.5 two-turn MT-GRPO rewards (verifiers rubrics).
//! - [`t2po`]: §2.6 T2PO format penalty, paper and code placements.
//! - [`agent`]: [`RewardInput`], the only view of a rollout a reward gets — answers from the
//!   agent's own turns, format rules on the agent's text with observations reduced to
//!   placeholders, never the prompt.
//! - This file: [`RewardConfig`], the serde-named choice of reward used by presets, and
//!   [`RewardConfig::score`], which scores one rollout given as a [`RewardInput`].

pub mod agent;
pub mod mt_ppo;
pub mod outcome;
pub mod t2po;
pub mod text;
pub mod two_turn;

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::grammar::Format;
use crate::grammar::search_r1::{self, AnswerRule};

pub use agent::{NOTICE_PLACEHOLDER, RewardInput, TurnText, observation_placeholder};
pub use outcome::{
    BoxedEmConfig, DeepResearchF1Config, OutcomeScore, OverlongConfig, SearchR1FormatConfig,
    overlong_penalty,
};
pub use text::{IgpoMetric, em, igpo_f1, normalize_answer, squad_f1, sub_em};

/// Errors of the reward module.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RewardError {
    /// A preset named a reward that does not exist.
    #[error("unknown reward {name:?}; known rewards: {}", RewardConfig::NAMES.join(", "))]
    UnknownReward {
        /// The name that was asked for.
        name: String,
    },
    /// A turn-level reward was given no turns.
    #[error("reward {reward:?} needs the rollout's turns (RewardInput::turns is empty)")]
    MissingTurns {
        /// The reward's name.
        reward: &'static str,
    },
    /// A numeric setting is out of range.
    #[error("invalid setting for reward {reward:?}: {detail}")]
    InvalidConfig {
        /// The reward's name.
        reward: &'static str,
        /// What is wrong.
        detail: String,
    },
}

/// The score of a rollout.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RewardOutput {
    /// Outcome reward placed on the last valid response token (for turn-level rewards: the
    /// final turn's reward, i.e. the last element of `turn_rewards`).
    pub score: f64,
    /// Per-turn rewards (one per agent turn / step sample); empty for outcome-only rewards.
    pub turn_rewards: Vec<f64>,
    /// EM of the extracted answer (evaluation metric, 0 when none).
    pub em: f64,
    /// Whether the reward's format rule accepted the response.
    pub format_ok: bool,
    /// Why the format was rejected, empty otherwise.
    pub reason: String,
    /// The named components of a reward made of several (the two-turn rubrics), for the
    /// training metrics (`reward/{name}`); empty for single-part rewards.
    pub parts: Vec<(&'static str, f64)>,
}

impl RewardOutput {
    fn from_outcome(s: OutcomeScore) -> Self {
        Self {
            score: s.score,
            turn_rewards: Vec::new(),
            em: s.em,
            format_ok: s.format_violation.is_none(),
            reason: s.format_violation.map(|v| v.reason).unwrap_or_default(),
            parts: Vec::new(),
        }
    }
}

/// Settings of the plain answer metrics (`em`, `sub_em`, `f1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AnswerMetricConfig {
    /// Agent format, which decides how the answer is extracted: Search-R1 and T2PO use the
    /// last `<answer>` block, boxed uses the first `<answer>` block's last `\boxed{}`.
    pub format: Format,
    /// Which `<answer>` match the Search-R1/T2PO extraction takes.
    pub answer_rule: AnswerRule,
}

impl Default for AnswerMetricConfig {
    fn default() -> Self {
        Self {
            format: Format::SearchR1,
            answer_rule: AnswerRule::LastMatch,
        }
    }
}

impl AnswerMetricConfig {
    /// The answer the agent wrote, extracted for this format ([`RewardInput::answer`]).
    pub fn extract<'t>(&self, input: &RewardInput<'t>) -> Option<&'t str> {
        input.answer(self.format, self.answer_rule)
    }
}

/// Settings of `search_r1_em`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SearchR1EmConfig {
    /// Which `<answer>` match is scored.
    pub answer_rule: AnswerRule,
}

/// Settings of `igpo_f1`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IgpoConfig {
    /// `f1` (training, −2.0 on format failure), `em`, or `no_format_f1` (metric, 0).
    pub metric: IgpoMetric,
}

/// Settings of `mt_grpo_two_turn` (the rubric weights are fixed by the reference rubrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TwoTurnConfig {
    /// The episode score is the outcome total (false, the default: MT-GRPO and the paper's
    /// outcome-only baseline GRPO-OR) or the turn-level plus outcome total (true: the paper's
    /// merged-reward baseline GRPO-MR, turn-level-rewards.md App. E.3). The turn rewards are
    /// `[turn-level total, outcome total]` either way.
    pub merge_turn_rewards: bool,
}

/// The per-step format penalties of a reward's step rewards ([`RewardConfig::step_penalties`]).
#[derive(Debug, Clone, PartialEq)]
pub struct StepPenalties {
    /// The penalty of each step (0 where the step was valid).
    pub penalties: Vec<f64>,
    /// Whether a penalty lowers only its own step sample's episode score.
    pub own_step_only: bool,
}

/// A reward, named as in presets. Serialized as a table with a `name` field and the
/// settings (`{"name": "boxed_em", "format_failure": 0.0}`); a bare string (`"boxed_em"`)
/// deserializes to the defaults.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(remote = "Self", tag = "name", rename_all = "snake_case")]
pub enum RewardConfig {
    /// §2.3 A2TGPO/AT2PO boxed EM + format ([`outcome::boxed_em_reward`]).
    BoxedEm(BoxedEmConfig),
    /// §2.3 `deep_research` F1 variant ([`outcome::deep_research_f1_reward`]).
    DeepResearchF1(DeepResearchF1Config),
    /// §2.1 Search-R1 EM ([`outcome::search_r1_em_reward`]).
    SearchR1Em(SearchR1EmConfig),
    /// §2.4 Search-R1 format-aware reward ([`outcome::search_r1_format_reward`]).
    SearchR1Format(SearchR1FormatConfig),
    /// §2.4 MT-PPO turn rewards ([`mt_ppo::turn_rewards`]); needs turns.
    MtPpoTurn(mt_ppo::MtPpoConfig),
    /// §2.5 two-turn MT-GRPO rewards ([`two_turn::TwoTurnRewards`]); needs turns. Turn rewards
    /// are `[turn-level total, outcome total]`.
    MtGrpoTwoTurn(TwoTurnConfig),
    /// §2.6 T2PO search-env EM with the format penalty ([`t2po::step_rewards`]); needs turns
    /// (one per step sample).
    T2poEm(t2po::T2poRewardConfig),
    /// §2.1 EM of the extracted answer.
    Em(AnswerMetricConfig),
    /// §2.1 SubEM of the extracted answer.
    SubEm(AnswerMetricConfig),
    /// §2.2 SQuAD F1 of the extracted answer.
    F1(AnswerMetricConfig),
    /// §2.2 IGPO F1 ([`text::igpo_score`]).
    IgpoF1(IgpoConfig),
}

impl RewardConfig {
    /// Every reward name, in declaration order.
    pub const NAMES: [&'static str; 11] = [
        "boxed_em",
        "deep_research_f1",
        "search_r1_em",
        "search_r1_format",
        "mt_ppo_turn",
        "mt_grpo_two_turn",
        "t2po_em",
        "em",
        "sub_em",
        "f1",
        "igpo_f1",
    ];

    /// The reward's name.
    pub fn name(&self) -> &'static str {
        match self {
            RewardConfig::BoxedEm(_) => "boxed_em",
            RewardConfig::DeepResearchF1(_) => "deep_research_f1",
            RewardConfig::SearchR1Em(_) => "search_r1_em",
            RewardConfig::SearchR1Format(_) => "search_r1_format",
            RewardConfig::MtPpoTurn(_) => "mt_ppo_turn",
            RewardConfig::MtGrpoTwoTurn(_) => "mt_grpo_two_turn",
            RewardConfig::T2poEm(_) => "t2po_em",
            RewardConfig::Em(_) => "em",
            RewardConfig::SubEm(_) => "sub_em",
            RewardConfig::F1(_) => "f1",
            RewardConfig::IgpoF1(_) => "igpo_f1",
        }
    }

    /// The reward `name` with default settings.
    pub fn from_name(name: &str) -> Result<Self, RewardError> {
        Ok(match name {
            "boxed_em" => RewardConfig::BoxedEm(BoxedEmConfig::default()),
            "deep_research_f1" => RewardConfig::DeepResearchF1(DeepResearchF1Config::default()),
            "search_r1_em" => RewardConfig::SearchR1Em(SearchR1EmConfig::default()),
            "search_r1_format" => RewardConfig::SearchR1Format(SearchR1FormatConfig::default()),
            "mt_ppo_turn" => RewardConfig::MtPpoTurn(mt_ppo::MtPpoConfig::default()),
            "mt_grpo_two_turn" => RewardConfig::MtGrpoTwoTurn(TwoTurnConfig::default()),
            "t2po_em" => RewardConfig::T2poEm(t2po::T2poRewardConfig::default()),
            "em" => RewardConfig::Em(AnswerMetricConfig::default()),
            "sub_em" => RewardConfig::SubEm(AnswerMetricConfig::default()),
            "f1" => RewardConfig::F1(AnswerMetricConfig::default()),
            "igpo_f1" => RewardConfig::IgpoF1(IgpoConfig::default()),
            _ => {
                return Err(RewardError::UnknownReward {
                    name: name.to_owned(),
                });
            }
        })
    }

    /// Checks that every numeric setting is finite (and the penalty non-negative).
    pub fn validate(&self) -> Result<(), RewardError> {
        let reward = self.name();
        let values: Vec<(&str, f64)> = match self {
            RewardConfig::BoxedEm(c) => vec![
                ("format_failure", c.format_failure),
                ("multi_tool_bonus", c.multi_tool_bonus),
            ],
            RewardConfig::DeepResearchF1(c) => vec![
                ("format_failure", c.format_failure),
                ("multi_tool_bonus", c.multi_tool_bonus),
            ],
            RewardConfig::SearchR1Format(c) => vec![
                ("structure_format_score", c.structure_format_score),
                ("final_format_score", c.final_format_score),
                ("retrieval_score", c.retrieval_score),
                ("score", c.score),
            ],
            RewardConfig::MtPpoTurn(c) => vec![
                ("final_correct", c.final_correct),
                ("final_format_only", c.final_format_only),
                ("final_format_failure", c.final_format_failure),
                ("retrieval", c.retrieval),
                ("format_ok", c.format_ok),
                ("format_bad", c.format_bad),
                ("lambda_search", c.lambda_search),
            ],
            RewardConfig::T2poEm(c) => {
                if c.lambda_fmt < 0.0 {
                    return Err(RewardError::InvalidConfig {
                        reward,
                        detail: format!("lambda_fmt = {} < 0", c.lambda_fmt),
                    });
                }
                vec![("lambda_fmt", c.lambda_fmt)]
            }
            _ => Vec::new(),
        };
        match values.into_iter().find(|(_, v)| !v.is_finite()) {
            Some((k, v)) => Err(RewardError::InvalidConfig {
                reward,
                detail: format!("{k} = {v} is not finite"),
            }),
            None => Ok(()),
        }
    }

    /// The agent formats whose answers and tags this reward reads correctly: the boxed
    /// rewards need [`Format::Boxed`] (the EM string is inside `\boxed{}`), Search-R1's format
    /// reward and MT-PPO's turn rubric need Search-R1 turns, `t2po_em` needs T2PO steps, and
    /// `em`/`sub_em`/`f1` read their own `format` setting (Search-R1 and T2PO share the plain
    /// `<answer>` block). Configs check it against the task's format.
    pub fn reads_format(&self, format: Format) -> bool {
        let plain = matches!(format, Format::SearchR1 | Format::T2po | Format::Verifiers);
        match self {
            RewardConfig::BoxedEm(_) | RewardConfig::DeepResearchF1(_) => format == Format::Boxed,
            RewardConfig::SearchR1Format(_) | RewardConfig::MtPpoTurn(_) => {
                format == Format::SearchR1
            }
            RewardConfig::T2poEm(_) => format == Format::T2po,
            RewardConfig::SearchR1Em(_) | RewardConfig::IgpoF1(_) => plain,
            RewardConfig::Em(c) | RewardConfig::SubEm(c) | RewardConfig::F1(c) => match c.format {
                Format::Boxed => format == Format::Boxed,
                Format::SearchR1 | Format::T2po | Format::Verifiers => plain,
            },
            // The verifiers rubric reads `<reasoning>`, `<tool>`, `<result>` and `<answer>`.
            RewardConfig::MtGrpoTwoTurn(_) => format == Format::Verifiers,
        }
    }

    /// The names of the parts [`RewardConfig::score`] reports in [`RewardOutput::parts`] (the
    /// two-turn rubrics); empty for a single-part reward.
    pub fn part_names(&self) -> &'static [&'static str] {
        match self {
            RewardConfig::MtGrpoTwoTurn(_) => &two_turn::PARTS,
            _ => &[],
        }
    }

    /// Whether its per-turn rewards ([`RewardOutput::turn_rewards`]) are step rewards, one per
    /// step sample, that replace the environment's for an estimator over step samples
    /// (`t2po_em`: EM minus each step's format penalty).
    pub fn gives_step_rewards(&self) -> bool {
        matches!(self, RewardConfig::T2poEm(_))
    }

    /// For a reward that [gives step rewards](Self::gives_step_rewards): the format penalty its
    /// step rewards took off each of the agent's steps `steps` (their generated texts), and
    /// whether each penalty lowers only its own step's episode score (T2PO's per-invalid-step
    /// placement, verl-agent) rather than the trajectory's. `None` for other rewards.
    pub fn step_penalties(&self, steps: &[&str]) -> Option<StepPenalties> {
        match self {
            RewardConfig::T2poEm(c) => Some(StepPenalties {
                penalties: t2po::step_penalties(steps, &[] as &[&str], c),
                own_step_only: c.placement == t2po::PenaltyPlacement::PerInvalidStep,
            }),
            _ => None,
        }
    }

    /// Whether its per-turn rewards follow MT-PPO's turn rubric, so that an LLM judge can
    /// rescore the turns in its place (`mt_ppo_turn`).
    pub fn turns_judgeable(&self) -> bool {
        matches!(self, RewardConfig::MtPpoTurn(_))
    }

    /// Whether it scores the search grammar's actions (`<search>`, `<answer>`) step by step, as
    /// `t2po_em`'s per-step format penalties do. A game's actions are moves and its reward is
    /// its return, so a game cannot use such a reward.
    pub fn scores_search_actions(&self) -> bool {
        matches!(self, RewardConfig::T2poEm(_))
    }

    /// Whether, on an environment that scores its own episodes (an OpenEnv server), it takes
    /// the environment's return as the episode's score (`em`).
    pub fn takes_environment_return(&self) -> bool {
        matches!(self, RewardConfig::Em(_))
    }

    /// Whether [`RewardConfig::score`] needs [`RewardInput::turns`].
    pub fn needs_turns(&self) -> bool {
        matches!(
            self,
            RewardConfig::MtPpoTurn(_) | RewardConfig::MtGrpoTwoTurn(_) | RewardConfig::T2poEm(_)
        )
    }

    /// Scores one rollout.
    pub fn score(&self, input: &RewardInput<'_>) -> Result<RewardOutput, RewardError> {
        self.validate()?;
        if self.needs_turns() && input.turns().is_empty() {
            return Err(RewardError::MissingTurns {
                reward: self.name(),
            });
        }
        let golds = input.golds;
        // Format rules read the agent's text with observations reduced to placeholders;
        // answers come from inside one agent turn (see `agent`).
        let view = input.format_view();
        let metric = |c: &AnswerMetricConfig, f: fn(&str, &[String]) -> f64| {
            let answer = c.extract(input);
            let value = answer.map_or(0.0, |a| f(a, golds));
            RewardOutput {
                score: value,
                turn_rewards: Vec::new(),
                em: answer.map_or(0.0, |a| em(a, golds)),
                format_ok: answer.is_some(),
                reason: if answer.is_some() {
                    String::new()
                } else {
                    "the agent wrote no <answer> block".to_owned()
                },
                parts: Vec::new(),
            }
        };
        Ok(match self {
            RewardConfig::BoxedEm(c) => RewardOutput::from_outcome(outcome::boxed_em_from(
                &view,
                input.first_answer_block(),
                golds,
                c,
            )),
            RewardConfig::DeepResearchF1(c) => RewardOutput::from_outcome(
                outcome::deep_research_f1_from(&view, input.first_answer_block(), golds, c),
            ),
            RewardConfig::SearchR1Em(c) => RewardOutput::from_outcome(outcome::search_r1_em_from(
                input.last_answer_block(c.answer_rule),
                golds,
            )),
            RewardConfig::SearchR1Format(c) => {
                // Retrieval credit reads what the environment returned (off by default).
                let observations: String = input.observations().collect();
                RewardOutput::from_outcome(outcome::search_r1_format_from(
                    &view,
                    outcome::search_r1_retrieval_correct(&observations, golds),
                    input.last_answer_block(c.answer_rule),
                    golds,
                    c,
                ))
            }
            RewardConfig::MtPpoTurn(c) => {
                let turn_rewards = mt_ppo::turn_rewards(input.turns(), golds, c);
                let last = input.turns().last().map_or("", |t| t.generated);
                let violation = crate::grammar::mt_ppo::final_turn_format(last).err();
                let em = search_r1::extract_answer(last, AnswerRule::LastMatch)
                    .map_or(0.0, |a| em(a, golds));
                RewardOutput {
                    score: turn_rewards.last().copied().unwrap_or(0.0),
                    turn_rewards,
                    em,
                    format_ok: violation.is_none(),
                    reason: violation.map(|v| v.reason).unwrap_or_default(),
                    parts: Vec::new(),
                }
            }
            RewardConfig::MtGrpoTwoTurn(c) => {
                let mut msgs = Vec::with_capacity(2 * input.turns().len());
                for t in input.turns() {
                    msgs.push(two_turn::Message {
                        role: two_turn::Role::Assistant,
                        content: t.generated,
                    });
                    if let Some(o) = t.observation {
                        msgs.push(two_turn::Message {
                            role: two_turn::Role::User,
                            content: o,
                        });
                    }
                }
                let r = two_turn::TwoTurnRewards::compute(&msgs, golds);
                RewardOutput {
                    score: if c.merge_turn_rewards {
                        r.turn_total() + r.outcome_total()
                    } else {
                        r.outcome_total()
                    },
                    turn_rewards: vec![r.turn_total(), r.outcome_total()],
                    em: r.exact_match,
                    // No binary format rule here: "ok" = maximal XML tag usage (every
                    // assistant message uses each of its tags exactly once).
                    format_ok: (r.xml_tag_usage - 0.2).abs() < 1e-12,
                    reason: String::new(),
                    parts: r.parts(),
                }
            }
            RewardConfig::T2poEm(c) => {
                let steps: Vec<&str> = input.agent_turns().collect();
                let turn_rewards = t2po::step_rewards(&steps, golds, c);
                let last =
                    crate::grammar::t2po::parse_turn(steps.last().copied().unwrap_or(""), c.script);
                let em = last.final_answer.as_deref().map_or(0.0, |a| em(a, golds));
                let format_ok = last.verdict.is_valid();
                RewardOutput {
                    score: turn_rewards.last().copied().unwrap_or(0.0),
                    turn_rewards,
                    em,
                    format_ok,
                    reason: last
                        .verdict
                        .first_failure()
                        .map(|v| v.reason.clone())
                        .unwrap_or_default(),
                    parts: Vec::new(),
                }
            }
            RewardConfig::Em(c) => metric(c, em::<String>),
            RewardConfig::SubEm(c) => metric(c, sub_em::<String>),
            RewardConfig::F1(c) => metric(c, squad_f1::<String>),
            RewardConfig::IgpoF1(c) => {
                let gt = golds.join(text::IGPO_ANSWER_SPLIT);
                // IGPO lowercases before looking for tags; the first block inside one turn.
                let lowered: Vec<String> = input.agent_turns().map(str::to_lowercase).collect();
                let answer = lowered.iter().find_map(|t| {
                    crate::grammar::scan::first_block(t, "<answer>", "</answer>").map(|b| b.content)
                });
                let score = text::igpo_score_from(&view, answer, &gt, c.metric);
                let balanced = text::igpo_tags_balanced(&view.to_lowercase());
                let format_ok = balanced && answer.is_some();
                RewardOutput {
                    score,
                    turn_rewards: Vec::new(),
                    em: text::igpo_score_from(&view, answer, &gt, IgpoMetric::Em).max(0.0),
                    format_ok,
                    reason: if format_ok {
                        String::new()
                    } else if !balanced {
                        "unbalanced tags".to_owned()
                    } else {
                        "the agent wrote no <answer> block".to_owned()
                    },
                    parts: Vec::new(),
                }
            }
        })
    }
}

impl Serialize for RewardConfig {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        RewardConfig::serialize(self, s)
    }
}

impl<'de> Deserialize<'de> for RewardConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct NameOrTable;
        impl<'de> Visitor<'de> for NameOrTable {
            type Value = RewardConfig;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a reward name or a table with a `name` field")
            }

            fn visit_str<E: de::Error>(self, s: &str) -> Result<RewardConfig, E> {
                RewardConfig::from_name(s).map_err(E::custom)
            }

            fn visit_map<A: MapAccess<'de>>(self, m: A) -> Result<RewardConfig, A::Error> {
                RewardConfig::deserialize(de::value::MapAccessDeserializer::new(m))
            }
        }
        d.deserialize_any(NameOrTable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{TOL, assert_all_close, assert_close};

    fn golds(g: &[&str]) -> Vec<String> {
        g.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn names_round_trip_and_unknown_name_error() {
        for name in RewardConfig::NAMES {
            let c = RewardConfig::from_name(name).unwrap();
            assert_eq!(c.name(), name);
            let json = serde_json::to_string(&c).unwrap();
            let back: RewardConfig = serde_json::from_str(&json).unwrap();
            assert_eq!(back, c, "{json}");
            let from_str: RewardConfig = serde_json::from_str(&format!("\"{name}\"")).unwrap();
            assert_eq!(from_str, c);
        }
        let err = RewardConfig::from_name("boxed").unwrap_err();
        assert!(
            err.to_string()
                .starts_with("unknown reward \"boxed\"; known rewards: boxed_em, "),
            "{err}"
        );
        let err = serde_json::from_str::<RewardConfig>("\"exact\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown reward \"exact\""), "{err}");
        let err = serde_json::from_str::<RewardConfig>(r#"{"name":"exact"}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown variant `exact`"), "{err}");
        let err = serde_json::from_str::<RewardConfig>(r#"{"name":"boxed_em","typo":1}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown field `typo`"), "{err}");
    }

    #[test]
    fn table_settings_override_defaults() {
        let c: RewardConfig =
            serde_json::from_str(r#"{"name":"boxed_em","format_failure":0.0}"#).unwrap();
        let RewardConfig::BoxedEm(b) = c else {
            panic!("{c:?}")
        };
        assert_close(b.format_failure, 0.0, TOL, "format_failure");
        assert_close(b.multi_tool_bonus, 0.1, TOL, "default bonus");
        let c: RewardConfig =
            serde_json::from_str(r#"{"name":"t2po_em","placement":"final_reward"}"#).unwrap();
        assert_eq!(
            c,
            RewardConfig::T2poEm(t2po::T2poRewardConfig {
                placement: t2po::PenaltyPlacement::FinalReward,
                ..Default::default()
            })
        );
    }

    #[test]
    fn score_dispatch() {
        let g = golds(&["Beatles"]);
        let r = "<think>x</think><answer>\\boxed{Rolling Stones}</answer>";
        let out = RewardConfig::from_name("boxed_em")
            .unwrap()
            .score(&RewardInput::single_turn(r, &g))
            .unwrap();
        assert_close(out.score, 0.0, TOL, "boxed_em wrong");
        assert!(out.format_ok);
        let out = RewardConfig::from_name("boxed_em")
            .unwrap()
            .score(&RewardInput::single_turn(
                "<think>x</think><answer>Beatles</answer>",
                &g,
            ))
            .unwrap();
        assert_close(out.score, -1.0, TOL, "boxed_em format");
        assert_eq!(out.reason, "answer is missing \\boxed{} format at byte 16");

        let f1 = RewardConfig::from_name("f1").unwrap();
        let out = f1
            .score(&RewardInput::single_turn(
                "<answer>Peter Schmeichel goalkeeper</answer>",
                &golds(&["Peter Schmeichel"]),
            ))
            .unwrap();
        assert_close(out.score, 0.8, TOL, "f1 via config");

        let igpo = RewardConfig::from_name("igpo_f1").unwrap();
        let out = igpo
            .score(&RewardInput::single_turn(
                "<answer>U.S. Army</answer>",
                &golds(&["US Army"]),
            ))
            .unwrap();
        assert_close(out.score, 0.4, TOL, "igpo via config");

        let mt = RewardConfig::from_name("mt_ppo_turn").unwrap();
        assert_eq!(
            mt.score(&RewardInput::from_turns(&[], &g)).unwrap_err(),
            RewardError::MissingTurns {
                reward: "mt_ppo_turn"
            }
        );
        let turns = [
            TurnText {
                generated: "<think>a</think><search>q</search>",
                observation: Some("<information>The Beatles</information>"),
            },
            TurnText {
                generated: "<think>b</think><answer>Beatles</answer>",
                observation: None,
            },
        ];
        let out = mt.score(&RewardInput::from_turns(&turns, &g)).unwrap();
        // Turn 1: +0.1 format, +0.3 retrieval, −0.1·1 search = 0.3; final: 1.0.
        assert_all_close(&out.turn_rewards, &[0.3, 1.0], TOL, "mt_ppo turns");
        assert_close(out.score, 1.0, TOL, "mt_ppo score");

        let bad = RewardConfig::BoxedEm(BoxedEmConfig {
            format_failure: f64::NAN,
            ..Default::default()
        });
        assert!(matches!(
            bad.score(&RewardInput::single_turn("", &g)),
            Err(RewardError::InvalidConfig { .. })
        ));
    }
}
