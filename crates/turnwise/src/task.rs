//! Task source: the built-in multi-hop world, its search index, prompts, demonstrations and the
//! tokenizer a fresh model is built with.

use std::sync::Arc;

use anyhow::{Context, Result};
use turnwise_core::grammar::Format;
use turnwise_env::env::{SearchEnv, SearchEnvConfig, Task};
use turnwise_env::search::Retriever;
use turnwise_env::search::bm25_mem::InMemoryBm25;
use turnwise_env::world::oracle::{AgentFormat, Oracle, OracleConfig, OracleNoise};
use turnwise_env::world::{Question, Split, World};
use turnwise_model::tokenizer::{DEFAULT_SPECIAL_TOKENS, TextTokenizer};

use crate::config::{AgentFormatName, TaskConfig, TokenizerKind};

/// Tags beyond the model crate's defaults that must be single tokens (T2PO's action block).
pub const EXTRA_SPECIAL_TOKENS: &[&str] = &["<action>", "</action>"];

impl AgentFormatName {
    /// The core grammar.
    pub fn grammar(self) -> Format {
        match self {
            AgentFormatName::SearchR1 => Format::SearchR1,
            AgentFormatName::Boxed => Format::Boxed,
            AgentFormatName::T2po => Format::T2po,
        }
    }

    /// The oracle's rendering.
    pub fn oracle(self) -> AgentFormat {
        match self {
            AgentFormatName::SearchR1 => AgentFormat::SearchR1,
            AgentFormatName::Boxed => AgentFormat::Boxed,
            AgentFormatName::T2po => AgentFormat::T2po,
        }
    }
}

/// The prompt text of a question (the chat markers are single tokens).
pub fn prompt_text(question: &str) -> String {
    format!("<|im_start|> {question} <|im_end|>")
}

/// One supervised demonstration: a prompt and response segments `(text, written_by_agent)`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Demonstration {
    /// The prompt text.
    pub prompt: String,
    /// Response segments in order; agent segments are trained on.
    pub segments: Vec<(String, bool)>,
}

/// A demonstration as token ids: `ids` = prompt + response, `loss_mask[k]` = 1 where token `k`
/// was written by the agent. Each segment is tokenised on its own, exactly as rollouts do.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedDemo {
    /// All ids.
    pub ids: Vec<u32>,
    /// Per id: trained on.
    pub loss_mask: Vec<u8>,
}

/// The built-in task: a generated world, its search index and the environment settings.
pub struct WorldTask {
    /// The world.
    pub world: World,
    /// Search over its passages.
    pub retriever: Arc<dyn Retriever>,
    /// Settings.
    pub config: TaskConfig,
}

impl WorldTask {
    /// Generates the world of `config` and indexes it (BM25 in memory).
    pub fn build(config: &TaskConfig) -> Result<Self> {
        let world = World::generate(&config.world).context("generating the world")?;
        let retriever: Arc<dyn Retriever> = Arc::new(InMemoryBm25::new(world.documents()));
        Ok(Self {
            world,
            retriever,
            config: config.clone(),
        })
    }

    /// A fresh environment for one episode.
    pub fn env(&self) -> Result<SearchEnv> {
        SearchEnv::new(
            self.retriever.clone(),
            SearchEnvConfig {
                format: self.config.format.grammar(),
                topk: self.config.topk,
                max_turns: self.config.max_turns,
                max_observation_words: self.config.max_observation_words,
            },
        )
        .context("building the search environment")
    }

    /// Questions of one split.
    pub fn questions(&self, split: Split) -> Vec<&Question> {
        self.world.questions_in(split).collect()
    }

    /// The environment task of a question.
    pub fn env_task(question: &Question) -> Task {
        Task {
            id: question.id.clone(),
            prompt: Some(question.text.clone()),
            answers: question.golden_answers.clone(),
            ..Task::default()
        }
    }

    /// Oracle demonstrations for every question of `split`, with noise `noise`.
    pub fn demonstrations(
        &self,
        split: Split,
        noise: f64,
        seed: u64,
    ) -> Result<Vec<Demonstration>> {
        let oracle = Oracle::new(
            &self.world,
            self.retriever.as_ref(),
            OracleConfig {
                format: self.config.format.oracle(),
                top_k: self.config.topk,
                max_observation_words: self.config.max_observation_words,
                noise: OracleNoise::uniform(noise),
                seed,
            },
        );
        self.world
            .questions_in(split)
            .map(|q| {
                let t = oracle
                    .answer(q)
                    .with_context(|| format!("oracle on question {}", q.id))?;
                Ok(Demonstration {
                    prompt: prompt_text(&q.text),
                    segments: t.segments(),
                })
            })
            .collect()
    }

    /// Trains the tokenizer of a fresh model on the passages, the questions and the
    /// demonstrations (so every tag and think phrase is in the vocabulary).
    pub fn train_tokenizer(
        &self,
        kind: TokenizerKind,
        vocab_size: usize,
        demos: &[Demonstration],
    ) -> Result<TextTokenizer> {
        let mut corpus: Vec<String> = self
            .world
            .documents()
            .into_iter()
            .map(|d| d.contents)
            .collect();
        corpus.extend(self.world.questions.iter().map(|q| prompt_text(&q.text)));
        corpus.extend(
            demos
                .iter()
                .flat_map(|d| d.segments.iter().map(|(s, _)| s.clone())),
        );
        let specials: Vec<&str> = DEFAULT_SPECIAL_TOKENS
            .iter()
            .chain(EXTRA_SPECIAL_TOKENS)
            .copied()
            .collect();
        let tok = match kind {
            TokenizerKind::WordLevel => {
                TextTokenizer::train_word_level(&corpus, vocab_size, &specials)
            }
            TokenizerKind::Bpe => {
                TextTokenizer::train_byte_level_bpe(&corpus, vocab_size, &specials)
            }
        }
        .context("training the tokenizer")?;
        Ok(tok)
    }
}

/// Encodes a demonstration segment by segment.
pub fn encode_demo(tok: &TextTokenizer, demo: &Demonstration) -> Result<EncodedDemo> {
    let mut ids = tok.encode(&demo.prompt)?;
    let mut loss_mask = vec![0u8; ids.len()];
    for (text, agent) in &demo.segments {
        let seg = tok.encode(text)?;
        loss_mask.extend(std::iter::repeat_n(u8::from(*agent), seg.len()));
        ids.extend(seg);
    }
    Ok(EncodedDemo { ids, loss_mask })
}

/// Ids of the tokens that end an agent turn in `format` (the closing tag of a tool call or an
/// answer, or end of text) that exist in `tok`.
pub fn stop_token_ids(tok: &TextTokenizer, format: AgentFormatName) -> Vec<u32> {
    let tags: &[&str] = match format {
        AgentFormatName::T2po => &["</action>"],
        AgentFormatName::SearchR1 | AgentFormatName::Boxed => &["</search>", "</answer>"],
    };
    tags.iter()
        .copied()
        .chain([
            turnwise_model::tokenizer::END_OF_TEXT,
            turnwise_model::tokenizer::IM_END,
        ])
        .filter_map(|t| tok.token_to_id(t))
        .collect()
}
