//! The oracle agent: answers a world question by searching hop by hop and reading the passages,
//! producing a full agent transcript (think, action, observation per turn) for demonstrations.
//!
//! At each hop the oracle searches the exact name of the current entity, finds the retrieved
//! passage titled with that name and reads the object of the hop's relation from it (with
//! [`Relation::parse`]); the last object is the answer. It only knows the question's subject and
//! relation chain, never the intermediate answers, so it fails where retrieval fails.
//!
//! [`OracleNoise`] makes demonstrations imperfect: each transcript carries at most one error,
//! drawn with the given probabilities (whose sum must be at most 1) from a generator seeded by
//! the oracle seed and the question id, so a transcript is reproducible on its own.

use crate::search::format::{ObservationStyle, TextBudget, format_observation};
use crate::search::{Hit, RetrievalError, Retriever};

use super::rng::{SplitMix64, fnv1a};
use super::{EntityKind, Question, Relation, World};
use crate::corpus::split_contents;

/// The agent's output format (see the spec, §1.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum AgentFormat {
    /// Search-R1: `<think>…</think>\n<search>q</search>`, observation
    /// `\n\n<information>…</information>\n\n`, answer `<answer>a</answer>`.
    SearchR1,
    /// A2TGPO / AT2PO: `<think>…</think>\n<search>q</search>`, observation
    /// ` <result>\n…\n</result>`, answer `<answer>\boxed{a}</answer>`.
    Boxed,
    /// T2PO / GiGPO: `<think>…</think><action><search>q</search></action>` and
    /// `<think>…</think><action><answer>a</answer></action>`; observations as Search-R1's.
    T2po,
    /// MT-GRPO's two-turn task (verifiers): `<reasoning>…</reasoning>\n<tool>{json}</tool>`
    /// and `<reasoning>…</reasoning>\n<answer>a</answer>`; observations as the boxed format's.
    Verifiers,
}

impl AgentFormat {
    /// How this format wraps retrieved passages.
    pub fn observation_style(self) -> ObservationStyle {
        match self {
            AgentFormat::Boxed | AgentFormat::Verifiers => ObservationStyle::Result,
            AgentFormat::SearchR1 | AgentFormat::T2po => ObservationStyle::SearchR1,
        }
    }

    /// The text the agent writes for one turn.
    pub fn render_action(self, think: &str, action: &Action) -> String {
        let inner = match (self, action) {
            (AgentFormat::Verifiers, Action::Search(q)) => {
                turnwise_core::grammar::verifiers::tool_call(q)
            }
            (_, Action::Search(q)) => format!("<search>{q}</search>"),
            (AgentFormat::Boxed, Action::Answer(a)) => format!("<answer>\\boxed{{{a}}}</answer>"),
            (_, Action::Answer(a)) => format!("<answer>{a}</answer>"),
        };
        match self {
            AgentFormat::T2po => format!("<think>{think}</think><action>{inner}</action>"),
            AgentFormat::SearchR1 | AgentFormat::Boxed => {
                format!("<think>{think}</think>\n{inner}")
            }
            AgentFormat::Verifiers => format!("<reasoning>{think}</reasoning>\n{inner}"),
        }
    }
}

/// What the agent does in a turn.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Action {
    /// Search for a query.
    Search(String),
    /// Give the final answer.
    Answer(String),
}

/// One agent turn.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Turn {
    /// The reasoning text (inside `<think>`).
    pub think: String,
    /// The action taken.
    pub action: Action,
    /// The observation the environment returned (formatted for the transcript's format);
    /// `None` for the answer turn.
    pub observation: Option<String>,
}

/// The error injected into a transcript.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum NoiseEvent {
    /// At this hop (0-based) the agent searched another entity of the right kind.
    WrongQuery {
        /// The hop.
        hop: usize,
    },
    /// The agent answered with the bridge entity reached before this hop (≥ 1).
    PrematureAnswer {
        /// The hop that was not done.
        hop: usize,
    },
    /// The agent did not search at this hop and guessed its result.
    SkippedSearch {
        /// The hop.
        hop: usize,
    },
    /// All searches were right but the final answer is another entity of the answer's kind.
    WrongAnswer,
}

/// Probabilities of the errors a transcript may carry (at most one per transcript; the sum must
/// be at most 1). A premature answer needs at least two hops, so 1-hop questions never get one.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OracleNoise {
    /// Search a wrong entity at a random hop.
    pub wrong_query: f64,
    /// Answer with a bridge entity before the last hop.
    pub premature_answer: f64,
    /// Skip the search at a random hop and guess its result.
    pub skip_search: f64,
    /// Answer with a wrong entity after correct searches.
    pub wrong_answer: f64,
}

impl OracleNoise {
    /// No errors.
    pub fn none() -> Self {
        OracleNoise::default()
    }

    /// Errors with total probability `p`, split evenly over the four kinds.
    pub fn uniform(p: f64) -> Self {
        let q = p / 4.0;
        OracleNoise {
            wrong_query: q,
            premature_answer: q,
            skip_search: q,
            wrong_answer: q,
        }
    }

    fn total(&self) -> f64 {
        self.wrong_query + self.premature_answer + self.skip_search + self.wrong_answer
    }
}

/// Settings of the oracle.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OracleConfig {
    /// The output format.
    pub format: AgentFormat,
    /// Passages retrieved per search.
    pub top_k: usize,
    /// Bound on the words of an observation's passages (`None`: unbounded).
    pub max_observation_words: Option<usize>,
    /// Error probabilities.
    pub noise: OracleNoise,
    /// Seed of the noise.
    pub seed: u64,
}

impl Default for OracleConfig {
    fn default() -> Self {
        OracleConfig {
            format: AgentFormat::SearchR1,
            top_k: 3,
            max_observation_words: None,
            noise: OracleNoise::none(),
            seed: 0,
        }
    }
}

/// A full agent transcript for one question.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Transcript {
    /// The question id.
    pub question_id: String,
    /// The question text.
    pub question: String,
    /// The format the turns are rendered in.
    pub format: AgentFormat,
    /// The turns, the last one answering.
    pub turns: Vec<Turn>,
    /// The final answer.
    pub answer: String,
    /// The injected error, if any.
    pub noise: Option<NoiseEvent>,
}

impl Transcript {
    /// The response as alternating segments `(text, written_by_agent)`: each turn's action text
    /// (agent) followed by its observation (environment). Concatenated they give
    /// [`Transcript::render`]; the flag is the loss mask of the segment.
    pub fn segments(&self) -> Vec<(String, bool)> {
        let mut out = Vec::new();
        for t in &self.turns {
            out.push((self.format.render_action(&t.think, &t.action), true));
            if let Some(obs) = &t.observation {
                out.push((obs.clone(), false));
            }
        }
        out
    }

    /// The whole response text (agent turns and observations).
    pub fn render(&self) -> String {
        self.segments().into_iter().map(|(s, _)| s).collect()
    }

    /// Number of searches made.
    pub fn searches(&self) -> usize {
        self.turns
            .iter()
            .filter(|t| matches!(t.action, Action::Search(_)))
            .count()
    }

    /// Search-R1 exact match of the answer against `golden_answers` (spec §2.1, via
    /// [`turnwise_core::reward::em`]).
    pub fn exact_match(&self, golden_answers: &[String]) -> bool {
        turnwise_core::reward::em(&self.answer, golden_answers) > 0.0
    }
}

/// The oracle agent over a world and a retriever.
pub struct Oracle<'a> {
    world: &'a World,
    retriever: &'a dyn Retriever,
    config: OracleConfig,
}

impl<'a> Oracle<'a> {
    /// An oracle answering questions of `world` with `retriever`. Panics if the noise
    /// probabilities are negative or sum to more than 1.
    pub fn new(world: &'a World, retriever: &'a dyn Retriever, config: OracleConfig) -> Self {
        let n = &config.noise;
        assert!(
            [
                n.wrong_query,
                n.premature_answer,
                n.skip_search,
                n.wrong_answer
            ]
            .iter()
            .all(|p| *p >= 0.0)
                && n.total() <= 1.0 + 1e-9,
            "noise probabilities must be non-negative and sum to at most 1: {n:?}"
        );
        Oracle {
            world,
            retriever,
            config,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &OracleConfig {
        &self.config
    }

    fn draw_noise(&self, rng: &mut SplitMix64, hops: usize) -> Option<NoiseEvent> {
        let n = &self.config.noise;
        let u = rng.unit();
        let mut acc = n.wrong_query;
        if u < acc {
            return Some(NoiseEvent::WrongQuery {
                hop: rng.below(hops),
            });
        }
        acc += n.premature_answer;
        if u < acc {
            return (hops >= 2).then(|| NoiseEvent::PrematureAnswer {
                hop: 1 + rng.below(hops - 1),
            });
        }
        acc += n.skip_search;
        if u < acc {
            return Some(NoiseEvent::SkippedSearch {
                hop: rng.below(hops),
            });
        }
        acc += n.wrong_answer;
        (u < acc).then_some(NoiseEvent::WrongAnswer)
    }

    /// A random entity name of `kind` other than `not`.
    fn other_name(&self, rng: &mut SplitMix64, kind: EntityKind, not: &str) -> String {
        let ids = self.world.ids_of(kind);
        for _ in 0..16 {
            let name = &self.world.entities[*rng.pick(&ids)].name;
            if name != not {
                return name.clone();
            }
        }
        self.world.entities[ids[0]].name.clone()
    }

    fn search(&self, query: &str) -> Result<(Vec<Hit>, String), RetrievalError> {
        let hits = self
            .retriever
            .retrieve(&[query.to_string()], self.config.top_k)?
            .into_iter()
            .next()
            .unwrap_or_default();
        let budget = match self.config.max_observation_words {
            Some(n) => TextBudget::Words(n),
            None => TextBudget::Unlimited,
        };
        let obs = format_observation(&hits, self.config.format.observation_style(), &budget);
        Ok((hits, obs))
    }

    /// Answers one question, searching hop by hop.
    pub fn answer(&self, question: &Question) -> Result<Transcript, RetrievalError> {
        let mut rng = SplitMix64::new(self.config.seed ^ fnv1a(question.id.as_bytes()));
        let hops = question.hops();
        let noise = self.draw_noise(&mut rng, hops);
        let mut turns = Vec::new();
        let mut current = question.subject_name.clone();
        let mut lost = false;
        for (hop, &relation) in question.relations.iter().enumerate() {
            if noise == Some(NoiseEvent::PrematureAnswer { hop }) {
                break;
            }
            if noise == Some(NoiseEvent::SkippedSearch { hop }) {
                current = self.other_name(&mut rng, relation.object_kind(), "");
                continue;
            }
            let query = if noise == Some(NoiseEvent::WrongQuery { hop }) {
                self.other_name(&mut rng, relation.subject_kind(), &current)
            } else {
                current.clone()
            };
            let (hits, observation) = self.search(&query)?;
            turns.push(Turn {
                think: format!("I need to search for {query}."),
                action: Action::Search(query.clone()),
                observation: Some(observation),
            });
            match read_fact(&hits, &query, relation) {
                Some(object) => current = object,
                None => {
                    lost = true;
                    break;
                }
            }
        }
        let answer = if noise == Some(NoiseEvent::WrongAnswer) {
            let kind = question.relations[hops - 1].object_kind();
            self.other_name(&mut rng, kind, &current)
        } else {
            current
        };
        let think = if lost {
            "I could not find it, so I will answer with what I have.".to_string()
        } else {
            "I have found the answer.".to_string()
        };
        turns.push(Turn {
            think,
            action: Action::Answer(answer.clone()),
            observation: None,
        });
        Ok(Transcript {
            question_id: question.id.clone(),
            question: question.text.clone(),
            format: self.config.format,
            turns,
            answer,
            noise,
        })
    }
}

/// Reads `relation`'s object for `subject` from the hit titled `subject`, if any.
fn read_fact(hits: &[Hit], subject: &str, relation: Relation) -> Option<String> {
    hits.iter().find_map(|h| {
        let (title, text) = split_contents(&h.document.contents);
        (title == subject)
            .then(|| relation.parse(text, subject))
            .flatten()
            .map(str::to_string)
    })
}
