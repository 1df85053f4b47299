//! The oracle agent: answers a world question by searching hop by hop and reading the passages,
//! producing a full agent transcript (think, action, observation per turn) for demonstrations.
//!
//! At each hop the oracle searches the exact name of the current entity, finds the retrieved
//! passage titled with that name and reads the object of the hop's relation from it (with
//! [`Relation::parse`]); the last object is the answer. It only knows the question's subject and
//! relation chain, never the intermediate answers, so it fails where retrieval fails.
//!
//! How the oracle reasons is [`ThoughtStyle`] (the world's `thoughts` setting): one short
//! sentence per turn (the default), or a few sentences of reasoning per turn (what the question
//! asks, what the last passage said, what is still missing, a hedge, the plan), worded from a
//! generator seeded like the noise, so a transcript stays reproducible on its own.
//!
//! [`OracleNoise`] makes demonstrations imperfect: each transcript carries at most one error,
//! drawn with the given probabilities (whose sum must be at most 1) from a generator seeded by
//! the oracle seed and the question id, so a transcript is reproducible on its own.

use crate::search::format::{
    ObservationStyle, TextBudget, format_observation, routine_observation,
};
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

/// How long the oracle's thoughts (the text inside `<think>`) are.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum ThoughtStyle {
    /// One sentence per turn: `"I need to search for {q}."` and `"I have found the answer."`
    /// (reasoning spans of 6–9 word-level tokens, the opening tag included; the quickstart's
    /// world).
    #[default]
    Short,
    /// Several sentences per turn, about 20–40 word-level tokens: the first search restates
    /// what the question asks about, names the fact it needs and hedges before its plan; later
    /// searches restate the fact the last passage gave and the one still missing; the answer
    /// restates the last fact and concludes. Each sentence is one of a few wordings drawn per
    /// question, so a reasoning span mixes choice points with stretches a trained model writes
    /// with near certainty: what T2PO's thinking intervention (spec §6.2) is made to cut.
    Long,
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
        // Long thoughts draw their wording from a stream of their own, so the noise draws (and
        // the short style's transcripts) do not depend on the style.
        let mut long = (self.world.config.thoughts == ThoughtStyle::Long)
            .then(|| LongThoughts::new(self.config.seed, &question.id));
        let hops = question.hops();
        let noise = self.draw_noise(&mut rng, hops);
        let mut turns = Vec::new();
        // Routine turns first (`decision_density` < 1): any action is acknowledged alike.
        let routine = self.world.config.routine_turns(hops);
        for k in 1..=routine {
            turns.push(Turn {
                think: "This is a routine check.".into(),
                action: Action::Search("routine check".into()),
                observation: Some(routine_observation(
                    self.config.format.observation_style(),
                    k,
                    routine,
                )),
            });
        }
        let mut current = question.subject_name.clone();
        // The fact the last hop gave (read from a passage, or guessed by a skipped search), and
        // the hop whose fact could not be read.
        let mut last: Option<Fact> = None;
        let mut lost: Option<(Relation, String)> = None;
        for (hop, &relation) in question.relations.iter().enumerate() {
            if noise == Some(NoiseEvent::PrematureAnswer { hop }) {
                break;
            }
            if noise == Some(NoiseEvent::SkippedSearch { hop }) {
                let guess = self.other_name(&mut rng, relation.object_kind(), "");
                last = Some(Fact {
                    relation,
                    subject: std::mem::replace(&mut current, guess.clone()),
                    object: guess,
                    read: false,
                });
                continue;
            }
            let query = if noise == Some(NoiseEvent::WrongQuery { hop }) {
                self.other_name(&mut rng, relation.subject_kind(), &current)
            } else {
                current.clone()
            };
            let (hits, observation) = self.search(&query)?;
            let think = match (&mut long, &last) {
                (None, _) => format!("I need to search for {query}."),
                (Some(w), None) => w.first_search(&question.subject_name, relation, &query),
                (Some(w), Some(fact)) => w.next_search(fact, relation, &query),
            };
            turns.push(Turn {
                think,
                action: Action::Search(query.clone()),
                observation: Some(observation),
            });
            match read_fact(&hits, &query, relation) {
                Some(object) => {
                    current = object.clone();
                    last = Some(Fact {
                        relation,
                        subject: query,
                        object,
                        read: true,
                    });
                }
                None => {
                    lost = Some((relation, query));
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
        let think = match (&mut long, &lost) {
            (None, Some(_)) => {
                "I could not find it, so I will answer with what I have.".to_string()
            }
            (None, None) => "I have found the answer.".to_string(),
            (Some(w), Some((relation, query))) => w.lost_answer(*relation, query, &answer),
            (Some(w), None) => w.answer(last.as_ref(), &answer),
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

/// A fact one hop gave the oracle: `relation` of `subject` is `object`.
struct Fact {
    relation: Relation,
    subject: String,
    object: String,
    /// Read from a passage (`false`: guessed by a skipped search).
    read: bool,
}

/// The fact `relation` of `subject` as a noun phrase ("the city where Zorvak Telim was born").
fn fact_phrase(relation: Relation, subject: &str) -> String {
    match relation {
        Relation::InCountry => format!("the country that {subject} is located in"),
        Relation::Capital => format!("the capital of {subject}"),
        Relation::BornIn => format!("the city where {subject} was born"),
        Relation::WorksFor => format!("the company that {subject} works for"),
        Relation::FoundedBy => format!("the person who founded {subject}"),
        Relation::BasedIn => format!("the city where {subject} is based"),
    }
}

/// The passage's sentence of a fact, to follow "that" ("the capital of Quenor is Mirabel.").
fn fact_clause(fact: &Fact) -> String {
    let s = fact.relation.sentence(&fact.subject, &fact.object);
    match s.strip_prefix("The ") {
        Some(rest) => format!("the {rest}"),
        None => s,
    }
}

/// The wording of [`ThoughtStyle::Long`] thoughts for one transcript: every sentence is one of a
/// few fixed wordings, drawn from a generator seeded by the oracle seed and the question id.
struct LongThoughts {
    rng: SplitMix64,
}

impl LongThoughts {
    fn new(seed: u64, question_id: &str) -> Self {
        LongThoughts {
            rng: SplitMix64::new(seed ^ fnv1a(question_id.as_bytes()) ^ 0x7468_6f75_6768_7473),
        }
    }

    /// One of `wordings`, with `{}` replaced by `arg`.
    fn say(&mut self, wordings: &[&str], arg: &str) -> String {
        self.rng.pick(wordings).replace("{}", arg)
    }

    fn plan(&mut self, query: &str) -> String {
        self.say(
            &[
                "I will search for {}.",
                "Let me search for {}.",
                "So I will search for {}.",
            ],
            query,
        )
    }

    /// The first search: what the question is about, the fact it needs first, a hedge, the plan.
    fn first_search(&mut self, subject: &str, relation: Relation, query: &str) -> String {
        let about = self.say(
            &[
                "The question is about {}.",
                "This question asks about {}.",
                "The question names {}.",
            ],
            subject,
        );
        let need = self.say(
            &[
                "First I need {}.",
                "I need {} first.",
                "To start, I need {}.",
            ],
            &fact_phrase(relation, query),
        );
        let hedge = self.say(
            &[
                "I should not guess it.",
                "I am not sure of it.",
                "I cannot tell from memory.",
            ],
            "",
        );
        let plan = self.plan(query);
        format!("{about} {need} {hedge} {plan}")
    }

    /// A later search: the fact the last hop gave, the fact still missing, a hedge, the plan.
    fn next_search(&mut self, last: &Fact, relation: Relation, query: &str) -> String {
        let known = self.recall(last);
        let need = self.say(
            &["Now I need {}.", "Next I need {}.", "Then I need {}."],
            &fact_phrase(relation, query),
        );
        let hedge = self.say(
            &[
                "That passage does not say it.",
                "I have not seen it yet.",
                "I do not know it yet.",
            ],
            "",
        );
        let plan = self.plan(query);
        format!("{known} {need} {hedge} {plan}")
    }

    /// The last hop's fact, as read or as guessed.
    fn recall(&mut self, fact: &Fact) -> String {
        let wordings: &[&str] = if fact.read {
            &[
                "The passage says that {}",
                "From the passage, {}",
                "The passage tells me that {}",
            ]
        } else {
            &[
                "I will assume that {}",
                "I think that {}",
                "I guess that {}",
            ]
        };
        self.say(wordings, &fact_clause(fact))
    }

    /// The answer after the last hop: its fact, that nothing is missing, the answer.
    fn answer(&mut self, last: Option<&Fact>, answer: &str) -> String {
        let known = last.map(|f| self.recall(f) + " ").unwrap_or_default();
        let done = self.say(
            &[
                "That was the last fact the question needs.",
                "That is the last step of the question.",
                "Nothing else is missing now.",
            ],
            "",
        );
        let conclude = self.say(
            &[
                "So the answer is {}.",
                "The answer should be {}.",
                "So I will answer {}.",
            ],
            answer,
        );
        format!("{known}{done} {conclude}")
    }

    /// The answer when a hop's fact was not in the passages: what is missing, the fallback.
    fn lost_answer(&mut self, relation: Relation, query: &str, answer: &str) -> String {
        let missing = self.say(
            &[
                "The passages do not give {}.",
                "I could not find {} in the passages.",
                "No passage gives {}.",
            ],
            &fact_phrase(relation, query),
        );
        let fallback = self.say(
            &[
                "I will answer with what I have, {}.",
                "My best guess is what I have, {}.",
                "I can only answer with {}.",
            ],
            answer,
        );
        format!("{missing} {fallback}")
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
