//! The training configuration: one TOML document made of a preset, an optional user file and
//! `--set key=value` overrides, resolved into a [`TrainConfig`]. Unknown or ill-typed fields are
//! errors that name the field (its dotted path).
//!
//! A method is a preset (`presets/*.toml`, embedded in the binary): it names its rollout
//! strategy, reward, advantage estimator and loss, each a part other presets reuse
//! (design.md, spec §10).

pub mod presets;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use turnwise_core::advantage::AdvantageConfig;
use turnwise_core::reward::RewardConfig;
pub use turnwise_env::judge::JudgeMode;
use turnwise_env::world::WorldConfig;
use turnwise_model::loss::{ActorLossConfig, LossAggMode};

/// Error resolving a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A TOML document does not parse.
    #[error("{source_name}: {message}")]
    Parse {
        /// Where the document came from (preset name or file path).
        source_name: String,
        /// The parser's message (with line and column).
        message: String,
    },
    /// A `--set` override is malformed.
    #[error("--set {arg:?}: {message}")]
    Override {
        /// The override as given.
        arg: String,
        /// What is wrong.
        message: String,
    },
    /// A field is unknown, missing or has the wrong type.
    #[error("config field `{field}`: {message}")]
    Field {
        /// Dotted path of the field.
        field: String,
        /// The deserializer's message.
        message: String,
    },
    /// A value is out of range or inconsistent with another.
    #[error("config field `{field}`: {message}")]
    Invalid {
        /// Dotted path of the field.
        field: &'static str,
        /// What is wrong and what is allowed.
        message: String,
    },
    /// An unknown preset name.
    #[error("unknown preset {name:?}; known presets: {known}")]
    UnknownPreset {
        /// The name asked for.
        name: String,
        /// Every preset name.
        known: String,
    },
    /// A config file cannot be read.
    #[error("cannot read {path}: {cause}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        cause: std::io::Error,
    },
}

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
    /// [`crate::openenv_task`]): episodes by reset seed per split, the server's rewards, success
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
    pub openenv: crate::openenv_task::OpenEnvConfig,
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

/// Tokenizer built from scratch for a fresh model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizerKind {
    /// One token per word or punctuation mark (learns fastest, quickstart-recipe.md).
    WordLevel,
    /// Byte-level BPE.
    Bpe,
}

/// The floating-point type of the model's weights and activations (`model.dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelDType {
    /// `f32` on the CPU, `bf16` on a CUDA device (`turnwise_model::device::default_dtype`).
    Auto,
    /// 32-bit floats everywhere.
    F32,
    /// bfloat16 weights and activations; softmax, log-softmax and the RMS statistic run in
    /// `f32` inside, log-probs come out in `f32`, and AdamW keeps `f32` master weights and
    /// moments.
    Bf16,
}

impl ModelDType {
    /// The candle dtype on `device`.
    pub fn resolve(self, device: &candle_core::Device) -> candle_core::DType {
        match self {
            Self::Auto => turnwise_model::device::default_dtype(device),
            Self::F32 => candle_core::DType::F32,
            Self::Bf16 => candle_core::DType::BF16,
        }
    }
}

/// The policy model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSpec {
    /// A Hugging Face folder (config.json, *.safetensors, tokenizer.json), a GGUF file, or a
    /// packaged model's name (`smollm2-135m-instruct`, fetched into the cache directory) to start
    /// from instead of a fresh model (see [`crate::model_source`]).
    pub init_from: Option<PathBuf>,
    /// Tokenizer of a fresh model.
    pub tokenizer: TokenizerKind,
    /// Vocabulary bound of a fresh tokenizer.
    pub vocab_size: usize,
    /// Hidden size.
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention).
    pub num_kv_heads: usize,
    /// Feed-forward size.
    pub intermediate_size: usize,
    /// Longest sequence.
    pub max_position_embeddings: usize,
    /// LoRA fine-tuning (`model.lora.*`; off unless `rank` ≥ 1).
    pub lora: LoraSpec,
    /// Where the policy (and the reference policy and critic) live and run: `cpu` (the
    /// default), `cuda`, `cuda:N` (also `gpu`, `gpu:N`). A CUDA device needs a binary built
    /// with the `cuda` feature (README, "Building with CUDA"). Training, the warm start,
    /// evaluation and local rollouts all run there; checkpoints and exports are written the
    /// same way on every device and load on any.
    pub device: String,
    /// The weights' and activations' dtype: `auto` (`f32` on the CPU, `bf16` on CUDA), `f32`
    /// or `bf16` (see [`ModelDType`]).
    pub dtype: ModelDType,
}

/// LoRA fine-tuning of the policy (`[model.lora]`): the base weights are frozen and shared by the
/// trained policy, the sampler and the reference policy; only the adapters are trained (see
/// `turnwise_model::model::lora`). The defaults other than `rank` are PEFT's `LoraConfig`
/// defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraSpec {
    /// Rank `r` of every adapter; 0 (the default) turns LoRA off: full fine-tuning.
    pub rank: usize,
    /// `lora_alpha`: the adapters' output is scaled by `alpha / rank` (PEFT's default 8).
    pub alpha: f64,
    /// `lora_dropout`: dropout on the adapters' input in training forwards, in [0, 1).
    pub dropout: f64,
    /// The adapted layers by Hugging Face module name: any of `q_proj`, `k_proj`, `v_proj`,
    /// `o_proj`, `gate_proj`, `up_proj`, `down_proj` (PEFT's default for Llama and Qwen2:
    /// `q_proj` and `v_proj`).
    pub target_modules: Vec<String>,
    /// PEFT's `layers_to_transform`: the decoder layers (0-based) that get adapters; unset:
    /// every layer. Adapting the top layers only also cuts the backward pass short (it stops at
    /// the lowest adapted layer), what makes a 135 M model trainable on a CPU.
    pub layers_to_transform: Option<Vec<usize>>,
}

impl Default for LoraSpec {
    fn default() -> Self {
        let d = turnwise_model::LoraConfig::default();
        Self {
            rank: 0,
            alpha: d.alpha,
            dropout: d.dropout,
            target_modules: d.target_modules,
            layers_to_transform: None,
        }
    }
}

impl LoraSpec {
    /// The adapters' configuration, or `None` when LoRA is off (`rank` = 0).
    pub fn to_lora_config(&self) -> Option<turnwise_model::LoraConfig> {
        (self.rank > 0).then(|| turnwise_model::LoraConfig {
            rank: self.rank,
            alpha: self.alpha,
            dropout: self.dropout,
            target_modules: self.target_modules.clone(),
            layers_to_transform: self.layers_to_transform.clone(),
        })
    }
}

impl Default for ModelSpec {
    fn default() -> Self {
        // The 0.92 M-parameter model of quickstart-recipe.md.
        Self {
            init_from: None,
            tokenizer: TokenizerKind::WordLevel,
            vocab_size: 4096,
            hidden_size: 128,
            num_layers: 4,
            num_heads: 4,
            num_kv_heads: 2,
            intermediate_size: 384,
            max_position_embeddings: 512,
            lora: LoraSpec::default(),
            device: "cpu".into(),
            dtype: ModelDType::Auto,
        }
    }
}

/// Supervised warm start on oracle demonstrations.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SftConfig {
    /// Optimizer steps (0 skips the warm start).
    pub steps: u64,
    /// Demonstrations per step.
    pub batch_size: usize,
    /// Peak learning rate. Range: > 0.
    pub lr: f64,
    /// Warm-up steps.
    pub warmup_steps: u64,
    /// Cosine floor as a fraction of the peak, in [0, 1].
    pub min_lr_ratio: f64,
    /// Probability that a demonstration carries one error (oracle noise).
    pub noise: f64,
    /// A JSON-lines file of demonstrations (`{"prompt": ..., "segments": [[text, is_agent]...]}`)
    /// instead of the oracle.
    pub demonstrations: Option<PathBuf>,
    /// Checkpoint the warm start every N steps and at its last step (the weights, its optimizer
    /// and data order, into `checkpoints/warm-start-step-N/`; only the newest is kept, and it is
    /// deleted once the RL checkpoint of step 0 is written), so that `turnwise resume` continues
    /// a warm start that was killed instead of redoing it. 0 turns it off. The default of 100
    /// loses at most about 50 s of the quickstart's warm start (1,100 steps of about 0.5 s on two
    /// CPU cores) for a save that takes a small fraction of that.
    pub save_every: u64,
}

impl Default for SftConfig {
    fn default() -> Self {
        Self {
            steps: 1200,
            batch_size: 16,
            lr: 2e-3,
            warmup_steps: 50,
            min_lr_ratio: 0.1,
            noise: 0.2,
            demonstrations: None,
            save_every: 100,
        }
    }
}

/// Rejection-sampling fine-tuning (RFT): T2PO's cold start (t2po.md App. B.1, spec §8.5). After
/// the supervised warm start, the current policy answers `questions` training questions
/// `rollouts_per_question` times each; the rollouts whose reward (the run's `reward`) is at or
/// above `threshold` are kept and the policy is fine-tuned on them (negative log-likelihood of the
/// agent tokens, the warm start's step) for `epochs` passes. Off by default; the `t2po` preset
/// turns it on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RsftConfig {
    /// Run the rejection-sampling fine-tuning after the warm start.
    pub enabled: bool,
    /// Training questions sampled (a seeded draw without replacement; capped at the size of the
    /// training split).
    pub questions: usize,
    /// Rollouts sampled per question.
    pub rollouts_per_question: usize,
    /// Sampling temperature of those rollouts.
    pub temperature: f64,
    /// Keep a rollout when its reward is at or above this value (`em` reward: 1 keeps the
    /// correct answers).
    pub threshold: f64,
    /// Passes over the kept rollouts (T2PO: at most 5, more degrades the subsequent RL).
    pub epochs: usize,
    /// Learning rate (constant).
    pub lr: f64,
    /// Kept rollouts per optimizer step.
    pub batch_size: usize,
}

impl Default for RsftConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            questions: 256,
            rollouts_per_question: 4,
            temperature: 1.0,
            threshold: 1.0,
            epochs: 1,
            lr: 5e-4,
            batch_size: 16,
        }
    }
}

/// How rollouts are sampled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RolloutStrategy {
    /// G independent chains per prompt.
    Chain,
    /// AT2PO entropy-guided tree search (§6.1): top-K nodes by entropy with the branching
    /// penalty, each forked as a sibling that re-samples the node's turn.
    Tree,
    /// Tree-GRPO (§3.8, upstream `generation_ts.py`): nodes drawn uniformly at random, each
    /// continued by a new child after its action and observation; usually several trees per
    /// prompt (`tree_count`) with `tree_leaves` leaves sampled from each.
    RandomTree,
}

/// What DAPO's dynamic-sampling filter compares within a prompt group (spec §6.4; verl
/// `algorithm.filter_groups.metric`): a group is informative when these values differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FilterMetric {
    /// Accuracy: each episode's EM (a game's win), the outcome before any shaping (verl's
    /// `acc`, the DAPO recipe's choice).
    #[default]
    Acc,
    /// The reward's score (the judge's, when on), before DAPO's overlong penalty (verl's
    /// `score`).
    Score,
    /// The reward's score plus the overlong penalty: the score the estimator reads (verl's
    /// `seq_reward`).
    SeqReward,
}

/// Rollout settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RolloutConfig {
    /// Chain or tree.
    pub strategy: RolloutStrategy,
    /// Prompts per training step. Range: ≥ 1.
    pub prompts_per_step: usize,
    /// Rollouts per prompt (G). For tree strategies it must equal the leaves per prompt,
    /// `tree_count × tree_leaves` (with `tree_leaves` absent: `tree_count × (tree_initial_chains
    /// + tree_iterations × tree_forks)`); validation rejects a mismatch. Range: ≥ 1.
    pub group_size: usize,
    /// Sampling temperature. Range: > 0.
    pub temperature: f64,
    /// Nucleus sampling mass.
    pub top_p: f64,
    /// Top-k cut (0: none).
    pub top_k: usize,
    /// Most tokens the policy generates in one turn.
    pub max_turn_tokens: usize,
    /// Most response tokens (agent + observation) of a trajectory.
    pub max_response_tokens: usize,
    /// Tree: trees per prompt m (Tree-GRPO's `ts_m`; AT2PO grows one tree per prompt). Each
    /// tree is a separate Tree-GRPO label: its leaves form the intra-tree group.
    pub tree_count: usize,
    /// Tree: initial chains M started from each tree's root (AT2PO `initial_rollouts`;
    /// Tree-GRPO starts each tree from one chain).
    pub tree_initial_chains: usize,
    /// Tree: expansion iterations L (Tree-GRPO `ts_l`).
    pub tree_iterations: usize,
    /// Tree: nodes forked per tree per iteration K (AT2PO `beam_size`; Tree-GRPO `ts_n`).
    pub tree_forks: usize,
    /// Tree: leaves sampled per tree k, the others pruned (Tree-GRPO `ts_k`, upstream
    /// `sample_leaf`). Absent: every leaf is kept. Each chain ends in one leaf, so a tree has
    /// `tree_initial_chains + tree_iterations × tree_forks` leaves and `k` may not exceed that.
    pub tree_leaves: Option<usize>,
    /// Tree: branching penalty α of the AT2PO node score `H − α·(siblings − 1)` (§6.1; 0.05 as
    /// in the ATPO code).
    pub tree_branch_penalty: f64,
    /// Compute information-gain probes (IGPO, A2TGPO).
    pub info_gain: bool,
    /// DAPO dynamic sampling (spec §6.4), off by default (the `dapo` preset turns it on): a
    /// prompt group is *informative* when its values of `filter_metric` (default: accuracy)
    /// differ (population std > 0), when it holds
    /// a single rollout (DAPO keeps those), or when its per-turn rewards, environment step
    /// rewards or information gains differ from zero-signal (see
    /// `trainer::advantage::informative_groups`); only informative groups are trained on, and
    /// further generation rounds of `prompts_per_step` fresh prompts (fresh seeds) refill the
    /// batch until `prompts_per_step` informative groups are kept or `max_num_gen_batches`
    /// rounds were generated. Tree estimators (`at2po`, `tree_grpo`) are never filtered.
    pub filter_zero_variance_groups: bool,
    /// What the group filter compares within a prompt group (verl
    /// `algorithm.filter_groups.metric`): `acc` (default, the DAPO recipe's: each episode's EM,
    /// the outcome before any shaping), `score` (the reward's score before the overlong
    /// penalty) or `seq_reward` (the score plus the overlong penalty, which the estimator
    /// reads; an all-wrong group whose lengths differ then counts as informative).
    pub filter_metric: FilterMetric,
    /// Generation rounds per step at most when `filter_zero_variance_groups` is on (verl
    /// `algorithm.filter_groups.max_num_gen_batches`; default 3, the "generation batch 3×" of
    /// the DAPO baselines, spec §8.1). A step still short of `prompts_per_step` informative
    /// groups after the last round trains on the informative groups it has, with a warning
    /// (verl raises instead), and skips the update when it has none.
    pub max_num_gen_batches: usize,
    /// Train on tokens forced by the thinking intervention (default false: masked out).
    pub train_on_forced: bool,
    /// T2PO token-level thinking intervention (spec §6.2; chain rollouts only).
    pub tti: TtiConfig,
    /// T2PO turn-level dynamic resampling (spec §6.3; chain rollouts only).
    pub tds: TdsConfig,
    /// Memory window P (spec §1.3, §6.3): each turn is generated from the prompt plus the last P
    /// turns (agent tokens and their observations) instead of the whole history; absent = full
    /// history. Chain rollouts only. The training rows still hold the whole trajectory (see
    /// `rollout::RolloutControl`).
    pub memory_window: Option<usize>,
    /// Where turns are generated: `local` (the trainer's own sampling engine, default) or
    /// `remote` (SGLang, vLLM or `turnwise serve` servers over HTTP; see [`RemoteConfig`]).
    pub backend: RolloutBackend,
    /// The inference servers of `backend = "remote"`.
    pub remote: RemoteConfig,
}

/// Where rollout turns are generated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RolloutBackend {
    /// The trainer's own continuously batched sampling engine.
    #[default]
    Local,
    /// Inference servers over HTTP (`rollout.remote`): every turn is sent as token ids and the
    /// returned ids and log-probs are recorded as sampled; after each optimizer step the policy
    /// is written as a Hugging Face folder and the servers reload it.
    Remote,
}

/// The wire protocol of remote rollout servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RemoteProtocol {
    /// SGLang's native `/generate` and `/update_weights_from_disk` (also `turnwise serve`).
    #[default]
    Sglang,
    /// vLLM's OpenAI `/v1/completions` with token ids. Stock vLLM cannot reload full weights
    /// over HTTP: training with it syncs LoRA adapters (`model.lora.rank` ≥ 1; the servers load
    /// each step's adapter with `/v1/load_lora_adapter`), or sets `sync_weights = false` (the
    /// servers keep their weights: evaluation, or off-policy data collection).
    Vllm,
}

/// Settings of the remote rollout backend (`rollout.remote`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RemoteConfig {
    /// Base URLs of the servers (`http://host:port`); turns are spread over them in turn.
    pub urls: Vec<String>,
    /// Their protocol.
    pub protocol: RemoteProtocol,
    /// The `model` field sent to vLLM (absent: none is sent).
    pub model: Option<String>,
    /// Seconds one request may take before it counts as failed (default 300).
    pub timeout_secs: f64,
    /// Attempts per request, the first included: 5xx answers and transport errors are retried
    /// with backoff, 4xx answers never (default 3).
    pub max_attempts: u32,
    /// Most requests in flight at once, all servers together (default 64).
    pub concurrency: usize,
    /// Write the policy after each optimizer step and make the servers load it (default true).
    pub sync_weights: bool,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        Self {
            urls: Vec::new(),
            protocol: RemoteProtocol::Sglang,
            model: None,
            timeout_secs: 300.0,
            max_attempts: 3,
            concurrency: 64,
            sync_weights: true,
        }
    }
}

/// T2PO Token-level Thinking Intervention settings (spec §6.2, t2po.md §4.2, Alg. 1).
///
/// Per sampled token the rollout computes `M_t = α·H̃_t + (1 − α)(1 − C̃_t)` from the token's
/// entropy and top-j confidence (causal running min/max over the turn); once the mean of the
/// last `window + 1` variations `|M_t − M_{t−1}|` drops below `epsilon` at a position
/// `t > min_tokens`, or at `t ≥ max_tokens`, it forces the end-of-thinking queue (once per turn,
/// only inside the reasoning span). Everything but α is \[UNVERIFIED\] in the paper.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TtiConfig {
    /// Turn the intervention on.
    pub enabled: bool,
    /// Signal weight α (paper App. D.3: 0.4).
    pub alpha: f64,
    /// j of the top-j confidence `C_t` (\[REC\] 20).
    pub top_j: usize,
    /// Trailing window N: the stop rule averages N + 1 variations (default 2).
    pub window: usize,
    /// Tolerance ε on the window mean (default 0.05).
    pub epsilon: f64,
    /// L_min: the ε test applies only at token positions `t > min_tokens` (default 32).
    pub min_tokens: usize,
    /// L_max: thinking budget, the rule fires at `t ≥ max_tokens` (absent: no budget, as in
    /// T2PO's search script; WebShop/ALFWorld use 450).
    pub max_tokens: Option<usize>,
    /// Forced text queue, tokenised and emitted one token per step after the trigger (absent:
    /// the format's default — `["</think>", "\n", "<action>"]` (paper Alg. 1) for the T2PO
    /// format, `["</think>", "\n"]` (\[REC\] for search actions) otherwise). Entries that encode
    /// to no token (e.g. `"\n"` with a word-level tokenizer) are skipped.
    pub forced_queue: Option<Vec<String>>,
}

impl Default for TtiConfig {
    fn default() -> Self {
        let core = turnwise_core::control::TtiSettings::default();
        Self {
            enabled: false,
            alpha: core.alpha,
            top_j: core.top_j,
            window: core.window,
            epsilon: core.epsilon,
            min_tokens: core.min_len,
            max_tokens: core.max_len,
            forced_queue: None,
        }
    }
}

impl TtiConfig {
    /// The forced text queue for `format` (the configured one, or the format's default).
    pub fn queue_for(&self, format: AgentFormatName) -> Vec<String> {
        match (&self.forced_queue, format) {
            (Some(q), _) => q.clone(),
            (None, AgentFormatName::T2po) => {
                vec!["</think>".into(), "\n".into(), "<action>".into()]
            }
            (None, _) => vec!["</think>".into(), "\n".into()],
        }
    }

    /// The core controller settings (`train_on_forced` is the rollout's flag).
    pub fn to_settings(
        &self,
        format: AgentFormatName,
        train_on_forced: bool,
    ) -> turnwise_core::control::TtiSettings {
        turnwise_core::control::TtiSettings {
            enabled: self.enabled,
            alpha: self.alpha,
            top_j: self.top_j,
            window: self.window,
            epsilon: self.epsilon,
            min_len: self.min_tokens,
            max_len: self.max_tokens,
            forced_queue: self.queue_for(format),
            train_on_forced_tokens: train_on_forced,
        }
    }
}

/// T2PO Turn-level Dynamical Sampling settings (spec §6.3, t2po.md §4.3, Alg. 2).
///
/// After a turn is generated its score `Φ = exp(mean log max(M_t, 1e-8))` is compared with the
/// previous turn's final score; a turn whose gap `Γ` is below `eta` is regenerated from the same
/// state, at most `budget` times, and the last attempt is kept.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TdsConfig {
    /// Turn the resampling on.
    pub enabled: bool,
    /// `paper` (regenerate while `Γ < η`, default) or `code` (official code: `0 < Γ < η`, exact
    /// repeats exempt).
    pub rule: turnwise_core::control::TdsRule,
    /// Threshold η (T2PO code default 0.3).
    pub eta: f64,
    /// Regenerations allowed per turn, B_max (T2PO `algorithm.TDS.max_try` = 2).
    pub budget: usize,
}

impl Default for TdsConfig {
    fn default() -> Self {
        let core = turnwise_core::control::TdsSettings::default();
        Self {
            enabled: false,
            rule: turnwise_core::control::TdsRule::Paper,
            eta: core.eta,
            budget: core.max_try,
        }
    }
}

impl TdsConfig {
    /// The core settings.
    pub fn to_settings(&self) -> turnwise_core::control::TdsSettings {
        turnwise_core::control::TdsSettings {
            enabled: self.enabled,
            eta: self.eta,
            max_try: self.budget,
            rule: self.rule,
        }
    }
}

impl Default for RolloutConfig {
    fn default() -> Self {
        Self {
            strategy: RolloutStrategy::Chain,
            prompts_per_step: 16,
            group_size: 8,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_turn_tokens: 48,
            max_response_tokens: 400,
            tree_count: 1,
            tree_initial_chains: 2,
            tree_iterations: 2,
            tree_forks: 3,
            tree_leaves: None,
            tree_branch_penalty: turnwise_core::control::tree_expansion::AT2PO_BRANCH_PENALTY,
            info_gain: false,
            filter_zero_variance_groups: false,
            filter_metric: FilterMetric::Acc,
            max_num_gen_batches: 3,
            train_on_forced: false,
            tti: TtiConfig::default(),
            tds: TdsConfig::default(),
            memory_window: None,
            backend: RolloutBackend::Local,
            remote: RemoteConfig::default(),
        }
    }
}

impl RolloutConfig {
    /// Whether the strategy grows trees (`tree` or `random_tree`).
    pub fn is_tree(&self) -> bool {
        matches!(
            self.strategy,
            RolloutStrategy::Tree | RolloutStrategy::RandomTree
        )
    }

    /// The core's expansion settings of one tree: AT2PO (`tree`) selects by entropy and forks
    /// siblings; Tree-GRPO (`random_tree`) selects at random and continues children.
    pub fn tree_settings(&self) -> turnwise_core::control::TreeExpansionSettings {
        use turnwise_core::control::ExpansionMode;
        use turnwise_core::control::tree_expansion::ForkRule;
        let tree_grpo = self.strategy == RolloutStrategy::RandomTree;
        turnwise_core::control::TreeExpansionSettings {
            initial_rollouts: self.tree_initial_chains,
            expansion_iterations: self.tree_iterations,
            beam_size: self.tree_forks,
            branch_penalty: self.tree_branch_penalty,
            mode: if tree_grpo {
                ExpansionMode::Random
            } else {
                ExpansionMode::Entropy
            },
            fork: if tree_grpo {
                ForkRule::Child
            } else {
                ForkRule::Sibling
            },
        }
    }

    /// Leaves kept per tree: `tree_leaves`, or every leaf a tree grows (`M + L·K`).
    pub fn leaves_per_tree(&self) -> usize {
        self.tree_leaves
            .unwrap_or_else(|| self.tree_settings().samples_per_tree())
    }

    /// Episodes per prompt of a tree strategy (`tree_count × leaves_per_tree`); `None` for
    /// chains.
    pub fn tree_leaves_per_prompt(&self) -> Option<usize> {
        self.is_tree()
            .then(|| self.tree_count * self.leaves_per_tree())
    }
}

/// Optimizer and PPO-epoch settings of the RL phase.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimConfig {
    /// Peak learning rate: reached after `warmup_steps`, then held or decayed as
    /// `lr_schedule` says. Range: > 0.
    pub lr: f64,
    /// Warm-up RL steps: the rate rises linearly from `lr / warmup_steps` to `lr` (verl
    /// `actor.optim.lr_warmup_steps`).
    pub warmup_steps: u64,
    /// The rate after warm-up, per RL step (verl `actor.optim.warmup_style` /
    /// `lr_scheduler_type`, TRL `lr_scheduler_type`): `constant` (default), `linear` or
    /// `cosine` from `lr` down to `lr × min_lr_ratio` at the last step (`run.steps`).
    pub lr_schedule: turnwise_model::optim::DecayShape,
    /// Floor of a `linear` or `cosine` decay as a fraction of `lr` (verl `min_lr_ratio`), in
    /// [0, 1].
    pub min_lr_ratio: f64,
    /// AdamW β1, in [0, 1).
    pub beta1: f64,
    /// AdamW β2, in [0, 1).
    pub beta2: f64,
    /// Decoupled weight decay. Range: ≥ 0.
    pub weight_decay: f64,
    /// Global gradient-norm bound.
    pub grad_clip: f64,
    /// Passes over each rollout batch. Range: ≥ 1.
    pub ppo_epochs: usize,
    /// Rollouts per optimizer step (0: the whole batch).
    pub mini_batch_size: usize,
    /// Rollouts per forward/backward (gradient accumulation within a mini-batch; 0: the
    /// mini-batch).
    pub micro_batch_size: usize,
    /// Consecutive non-finite updates that stop the run. Range: ≥ 1.
    pub max_bad_updates: usize,
    /// What one training row is, and so what `mini_batch_size` and `micro_batch_size` count:
    /// `trajectory` (default: the prompt and the whole response) or `step` (verl-agent's: every
    /// environment step is its own row, the context its turn was sampled from, memory window
    /// included, plus that turn's tokens).
    pub samples: TrainSamples,
}

/// What one training row is (`optim.samples`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrainSamples {
    /// One row per trajectory: the prompt, then every turn and observation (TITO).
    #[default]
    Trajectory,
    /// One row per environment step (verl-agent): the prompt plus the turns and observations the
    /// step's context held (the last `rollout.memory_window` turns, or all), then the step's own
    /// turn. Behaviour log-probs are those of exactly the context that was sampled from.
    Step,
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            lr: 2e-4,
            warmup_steps: 0,
            lr_schedule: turnwise_model::optim::DecayShape::Constant,
            min_lr_ratio: 0.0,
            beta1: 0.9,
            beta2: 0.95,
            weight_decay: 0.0,
            grad_clip: 1.0,
            ppo_epochs: 1,
            mini_batch_size: 0,
            micro_batch_size: 0,
            max_bad_updates: 3,
            samples: TrainSamples::Trajectory,
        }
    }
}

/// The PPO critic. It trains on the same batch as the actor, `optim.ppo_epochs` passes over it
/// in shuffled mini-batches of `optim.mini_batch_size` rollouts (the order drawn from the
/// trainer's generator), with the clipped value loss of spec §5.10.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CriticConfig {
    /// Train a critic (needed by `gae`).
    pub enabled: bool,
    /// Critic learning rate. Range: > 0.
    pub lr: f64,
    /// Value clip range (verl `cliprange_value`). Range: > 0.
    pub cliprange_value: f64,
    /// Critic warm-up updates before the actor trains.
    pub warmup_updates: u64,
    /// Decoupled weight decay of the critic's AdamW (its β1, β2 are `optim.beta1`,
    /// `optim.beta2`; verl `critic.optim.weight_decay`). Default 0, like `optim.weight_decay`.
    pub weight_decay: f64,
}

impl Default for CriticConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            lr: 1e-3,
            cliprange_value: 0.5,
            warmup_updates: 0,
            weight_decay: 0.0,
        }
    }
}

/// verl's `algorithm` keys beyond the estimator: KL in the reward (spec §5.8).
///
/// With `use_kl_in_reward` the trainer computes, for every trained rollout, the behaviour
/// log-probs (the rollout weights) and the frozen reference model's log-probs of the response
/// tokens, and subtracts `β · k(old, ref)` from each loss token's reward before the advantage
/// estimator (verl `apply_kl_penalty`): for `gae` from the token rewards (turn rewards and
/// outcome placed at their tokens, spec §3.3); for the outcome estimators `grpo`, `dr_grpo`
/// and `rloo` from the outcome score, summed over the rollout's tokens (verl's GRPO scores the
/// sum of the token-level rewards). Other estimators reject it (use `actor.use_kl_loss`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AlgorithmConfig {
    /// Subtract the KL penalty from the rewards (verl `algorithm.use_kl_in_reward`, default
    /// false).
    pub use_kl_in_reward: bool,
    /// Estimator of the per-token KL (verl `algorithm.kl_penalty`, default `kl` = k1 =
    /// `old_logp − ref_logp`; `abs`, `mse`, `low_var_kl` as in spec §5.8; a `+` suffix is
    /// accepted and ignored here, since a reward carries no gradient).
    pub kl_penalty: turnwise_model::loss::KlPenalty,
    /// The coefficient β and its controller (verl `algorithm.kl_ctrl`: `type = "fixed" |
    /// "adaptive"`, `kl_coef` (0.001), `target_kl` (0.1), `horizon` (10000 rollouts)). The
    /// adaptive controller's β is part of the checkpoint.
    pub kl_ctrl: turnwise_model::loss::kl::KlControllerConfig,
}

impl Default for AlgorithmConfig {
    fn default() -> Self {
        Self {
            use_kl_in_reward: false,
            kl_penalty: turnwise_model::loss::KlPenalty::new(turnwise_model::loss::KlEstimator::K1),
            kl_ctrl: turnwise_model::loss::kl::KlControllerConfig::default(),
        }
    }
}

/// DAPO's overlong reward shaping (spec §2.7, verl `reward_model.overlong_buffer`): the trainer
/// adds `min(−(L − (L_max − L_buf)) / L_buf · penalty_factor, 0)` to each episode's score, where
/// `L` is the episode's response length in tokens (agent and observation tokens, as in
/// multi-turn TITO) and `L_max = rollout.max_response_tokens`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OverlongBufferConfig {
    /// Apply the penalty (default false; the `dapo` preset turns it on).
    pub enable: bool,
    /// `L_buf` in tokens. Absent: the DAPO baselines' ratio scaled to this run,
    /// `round(rollout.max_response_tokens · 2000 / 6192)` (spec §8.1: buffer 2000 for 6192-token
    /// responses).
    pub len: Option<usize>,
    /// Penalty at `L = L_max` (default 1.0).
    pub penalty_factor: f64,
}

impl Default for OverlongBufferConfig {
    fn default() -> Self {
        Self {
            enable: false,
            len: None,
            penalty_factor: 1.0,
        }
    }
}

impl OverlongBufferConfig {
    /// The core's settings for responses of at most `max_response_tokens` tokens.
    pub fn to_core(&self, max_response_tokens: usize) -> turnwise_core::reward::OverlongConfig {
        let scaled = (max_response_tokens as f64 * 2000.0 / 6192.0).round() as usize;
        turnwise_core::reward::OverlongConfig {
            max_len: max_response_tokens,
            buffer_len: self.len.unwrap_or(scaled),
            penalty_factor: self.penalty_factor,
        }
    }
}

/// Evaluation settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EvalConfig {
    /// Questions per evaluation, from the start of one split; splits are never pooled. Before
    /// and after RL the first `questions` test questions are evaluated (the run's reported
    /// figures) and as many validation questions; the periodic evaluations of `every` use the
    /// validation split. Each result is logged as `eval/<split>/<mode>/…` with its `n`.
    pub questions: usize,
    /// Evaluate the validation split every N RL steps (0: only before and after RL).
    pub every: u64,
    /// Greedy decoding.
    pub greedy: bool,
    /// Sampled decoding at the rollout temperature.
    pub sampled: bool,
    /// Episodes per question of the sampled evaluation (verl's `val_kwargs.n`). With k > 1
    /// every sampled figure is a mean over the k samples of every question (logged also as
    /// `eval/<split>/sampled/mean@k`) and pass@k is logged for k = 1, 2, 4, … and k itself
    /// (`…/pass@K`, the unbiased estimator of Chen et al. 2021). Greedy decoding is always one
    /// episode a question. Range 1..=1024.
    pub samples: usize,
    /// Evaluate the starting model before the warm start (greedy, test split), once per entry:
    /// with that many of the oracle's solved training questions shown in the prompt (`[0, 3]`:
    /// zero-shot and 3-shot). Logged as `eval/test/base_{k}shot/…`. Empty: no such evaluation.
    pub base_shots: Vec<usize>,
}

impl Default for EvalConfig {
    fn default() -> Self {
        Self {
            questions: 300,
            every: 0,
            greedy: true,
            sampled: true,
            samples: 1,
            base_shots: Vec::new(),
        }
    }
}

/// Run bookkeeping.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunConfig {
    /// RL steps.
    pub steps: u64,
    /// Checkpoint every N steps (and at the end).
    pub save_every: u64,
    /// Keep the last K checkpoints. Range: ≥ 1.
    pub keep_checkpoints: usize,
    /// Trajectories saved per step to `samples/`.
    pub samples_per_step: usize,
    /// Write every metrics line also as TensorBoard scalars to `<run>/tensorboard/`
    /// (`tensorboard --logdir <run>/tensorboard`; wandb up to 0.29 uploads the folder with
    /// `wandb sync <run>/tensorboard`).
    pub tensorboard: bool,
    /// Log every metrics line to Weights & Biases: `off`, `online` (offline, with a warning,
    /// when no `WANDB_API_KEY` or `wandb login` is found) or `offline` (kept under
    /// `<run>/wandb/` for `wandb sync`). Needs the `wandb` Python package in `python3` (or
    /// `$TURNWISE_PYTHON`); the run stops before it starts when that is missing.
    pub wandb: WandbSetting,
    /// The W&B project.
    pub wandb_project: String,
    /// The W&B entity (user or team); the account's default when unset.
    pub wandb_entity: Option<String>,
    /// The W&B run name (and group, shared by the run's resumes); the run directory's name
    /// when unset.
    pub wandb_name: Option<String>,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            steps: 40,
            save_every: 10,
            keep_checkpoints: 2,
            samples_per_step: 4,
            tensorboard: true,
            wandb: WandbSetting::Off,
            wandb_project: "turnwise".into(),
            wandb_entity: None,
            wandb_name: None,
        }
    }
}

/// Whether and how a run logs to Weights & Biases (`run.wandb`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WandbSetting {
    /// No W&B logging.
    #[default]
    Off,
    /// Sync to the W&B server as the run goes (offline when no API key is found).
    Online,
    /// Keep the W&B run on disk for `wandb sync`.
    Offline,
}

impl WandbSetting {
    /// The sidecar's mode, `None` when off.
    pub fn mode(self) -> Option<crate::run::wandb::WandbMode> {
        match self {
            Self::Off => None,
            Self::Online => Some(crate::run::wandb::WandbMode::Online),
            Self::Offline => Some(crate::run::wandb::WandbMode::Offline),
        }
    }
}

impl RunConfig {
    /// Checks the W&B names: a project (and an entity, when set) of 1 to 128 characters
    /// without `/ \ # ? % :`, and a run name that is not empty when set.
    fn validate_tracking(&self) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        let name_ok = |s: &str| {
            !s.trim().is_empty()
                && s.chars().count() <= 128
                && !s.contains(['/', '\\', '#', '?', '%', ':'])
        };
        if !name_ok(&self.wandb_project) {
            return bad(
                "run.wandb_project",
                format!(
                    "must be 1 to 128 characters without / \\ # ? % : (a W&B project name), got {:?}",
                    self.wandb_project
                ),
            );
        }
        if let Some(e) = &self.wandb_entity
            && !name_ok(e)
        {
            return bad(
                "run.wandb_entity",
                format!(
                    "must be 1 to 128 characters without / \\ # ? % : (a W&B user or team), got {e:?}; leave it out for the account's default"
                ),
            );
        }
        if let Some(n) = &self.wandb_name
            && n.trim().is_empty()
        {
            return bad(
                "run.wandb_name",
                "must not be empty (leave it out to use the run directory's name)".into(),
            );
        }
        Ok(())
    }
}

/// This machine's memory in bytes (`MemTotal` of /proc/meminfo); `None` where it cannot be read.
pub fn machine_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Policy losses whose defining mechanism is a clip on the ratio (token, sequence or turn) or
/// the clipping-bias correction: they are inert in an on-policy update.
pub fn kind_needs_off_policy(loss: &str) -> bool {
    matches!(
        loss,
        "a2tgpo" | "gspo" | "gspo_turn" | "dapo" | "s_ppo" | "st_ppo" | "s_grpo"
    )
}

/// Everything a training run needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// Preset name.
    pub preset: String,
    /// What the preset reproduces (paper, method).
    pub description: String,
    /// The papers the preset follows, each as "Title. Authors (year). arXiv:id" (read-only,
    /// like `description`; empty for a config that names no preset).
    pub papers: Vec<String>,
    /// Seed of every random choice of the run.
    pub seed: u64,
    /// Questions, corpus and environment.
    pub task: TaskConfig,
    /// The policy model.
    pub model: ModelSpec,
    /// Supervised warm start.
    pub sft: SftConfig,
    /// Rejection-sampling fine-tuning after the warm start (T2PO's RFT cold start).
    pub rsft: RsftConfig,
    /// Rollouts.
    pub rollout: RolloutConfig,
    /// The reward (by `name`, spec §2).
    pub reward: RewardConfig,
    /// The advantage estimator (by `estimator`, spec §3).
    pub advantage: AdvantageConfig,
    /// The actor objective (policy loss, KL, entropy; spec §5).
    pub actor: ActorLossConfig,
    /// KL in the reward (verl `algorithm` keys, spec §5.8).
    pub algorithm: AlgorithmConfig,
    /// DAPO overlong reward shaping (spec §2.7).
    pub overlong_buffer: OverlongBufferConfig,
    /// Optimizer.
    pub optim: OptimConfig,
    /// Critic (PPO family).
    pub critic: CriticConfig,
    /// Evaluation.
    pub eval: EvalConfig,
    /// Run bookkeeping.
    pub run: RunConfig,
    /// LLM-judge turn rewards (turn-level-rewards.md §5, App. C.3).
    pub judge: JudgeSettings,
}

/// What to do with an episode the judge could not score (the endpoint failed after its
/// retries, or the reply held no usable scores).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JudgeFailure {
    /// Score it with the verifiable rubric of `reward` instead (counted in `judge/failures`),
    /// up to `judge.max_failure_rate` of a round's rollouts.
    #[default]
    Rubric,
    /// Stop the step with the judge's error.
    Error,
}

/// LLM-judge turn rewards (`[judge]`): each rollout's turns are sent to an OpenAI-compatible
/// chat endpoint with the paper's per-turn rubric (turn-level-rewards.md App. C.3: final turn
/// −1 / 0.2 / 1, intermediate turns format ±, information +0.3, search cost), and the judge's
/// scores replace the verifiable turn rewards of `reward = "mt_ppo_turn"` (the same rubric,
/// computed by rules). EM and format metrics still come from the rules.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JudgeSettings {
    /// Turn the judge on.
    pub enabled: bool,
    /// A model to serve as the judge inside the run (`turnwise serve` on a free loopback
    /// port): a packaged model's name (`smollm2-135m-instruct`, the offline default), a GGUF
    /// file or a Hugging Face folder. Absent: ask `base_url`.
    pub serve: Option<String>,
    /// Base URL of the OpenAI-compatible API (`.../v1`) when `serve` is absent.
    pub base_url: String,
    /// The model name sent.
    pub model: String,
    /// Environment variable holding the API key (absent: none is sent).
    pub api_key_env: Option<String>,
    /// Seconds one judge request may take (default 120).
    pub timeout_secs: f64,
    /// Attempts per request, the first included (default 3).
    pub max_attempts: u32,
    /// Reply token limit (default 256).
    pub max_tokens: u32,
    /// Requests in flight at once (default 8).
    pub concurrency: usize,
    /// Directory of the verdict cache (absent: no cache): a rollout judged before is not sent
    /// again.
    pub cache_dir: Option<PathBuf>,
    /// What to do when the judge fails on a rollout.
    pub on_failure: JudgeFailure,
    /// The largest share of a generation round's rollouts (a step's, or one DAPO refill
    /// round's) the judge may fail on while `on_failure = "rubric"` scores them by the rules
    /// (default 0.1): above it the run stops with an error naming the judge and the rate, so
    /// that a broken judge cannot quietly turn a judged run into a rules-scored one. In
    /// 0 to 1: 1 never stops, 0 stops on the first failure.
    pub max_failure_rate: f64,
    /// How the scores are asked for: `"free"` (default: one request per rollout, the reply's
    /// `<score>` block parsed) or `"choice"` (one request per turn: the model continues a
    /// prefilled score block with one of the rubric's scores for that turn, vLLM's
    /// `guided_choice` with `continue_final_message`; every verdict parses, which a small judge
    /// needs; the endpoint must support those extensions, as vLLM and `turnwise serve` do).
    pub mode: JudgeMode,
}

impl Default for JudgeSettings {
    fn default() -> Self {
        Self {
            enabled: false,
            serve: None,
            base_url: "http://127.0.0.1:30000/v1".into(),
            model: "turnwise".into(),
            api_key_env: None,
            timeout_secs: 120.0,
            max_attempts: 3,
            max_tokens: 256,
            concurrency: 8,
            cache_dir: None,
            on_failure: JudgeFailure::Rubric,
            max_failure_rate: 0.1,
            mode: JudgeMode::Free,
        }
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            preset: "custom".into(),
            description: String::new(),
            papers: Vec::new(),
            seed: 0,
            task: TaskConfig::default(),
            model: ModelSpec::default(),
            sft: SftConfig::default(),
            rsft: RsftConfig::default(),
            rollout: RolloutConfig::default(),
            reward: RewardConfig::from_name("em").expect("em is a reward"),
            advantage: AdvantageConfig::default_for("grpo").expect("grpo is an estimator"),
            actor: ActorLossConfig::default(),
            algorithm: AlgorithmConfig::default(),
            overlong_buffer: OverlongBufferConfig::default(),
            optim: OptimConfig::default(),
            critic: CriticConfig::default(),
            eval: EvalConfig::default(),
            run: RunConfig::default(),
            judge: JudgeSettings::default(),
        }
    }
}

impl TrainConfig {
    /// Resolves preset `preset` (if any), then the settings of the chosen `task.env`
    /// ([`TaskEnv::overrides`] and the preset's `[for_env.<env>]` table), then `file` (if any),
    /// then each `key=value` of `sets` (dotted keys, TOML values; a bare word is a string), and
    /// validates the result.
    pub fn resolve(
        preset: Option<&str>,
        file: Option<&Path>,
        sets: &[String],
    ) -> Result<Self, ConfigError> {
        let (base, mut for_env) = Self::preset_layer(preset)?;
        let file_layer = file.map(Self::file_layer).transpose()?;
        // The user's layers: the config file, then each `--set`.
        let user = |doc: &mut toml::Table| -> Result<(), ConfigError> {
            if let Some(t) = &file_layer {
                merge(doc, t.clone());
            }
            sets.iter().try_for_each(|arg| {
                let key = arg.split_once('=').map_or(arg.as_str(), |(k, _)| k).trim();
                if matches!(key, "preset" | "description" | "papers") {
                    return Err(ConfigError::Override {
                        arg: arg.clone(),
                        message: format!(
                            "`{key}` is read-only: it records the preset the config came from \
                             (choose one with --preset NAME)"
                        ),
                    });
                }
                apply_override(doc, arg)
            })
        };
        // The environment decides a layer between the preset and the user's settings, and the
        // user's settings may choose the environment: merge them once to learn it.
        let mut probe = base.clone();
        user(&mut probe)?;
        let env = match probe.get("task").and_then(|t| t.get("env")) {
            None => TaskEnv::Search,
            Some(v) => v.clone().try_into().map_err(|_| ConfigError::Field {
                field: "task.env".into(),
                message: format!(
                    "unknown environment {v}; known: {}",
                    TaskEnv::ALL.map(TaskEnv::name).join(", ")
                ),
            })?,
        };
        let mut doc = base;
        for arg in env.overrides() {
            apply_override(&mut doc, arg)?;
        }
        if let Some(toml::Value::Table(t)) = for_env.remove(env.name()) {
            for arg in presets::flatten_overrides(&t) {
                apply_override(&mut doc, &arg)?;
            }
        }
        user(&mut doc)?;
        // Paths given with `--set` are relative to the working directory. Every path is stored
        // absolute, so `resume` and `eval` work from any directory.
        absolutize_paths(&mut doc, Path::new(""))?;
        let cfg = Self::from_table(doc)?;
        cfg.check_new_run_paths()?;
        Ok(cfg)
    }

    /// Checks made when a config is resolved for a new run (not when a run's own config.toml is
    /// read back): `model.init_from` is not empty. Whether it exists is checked before a run
    /// touches its directory and by `turnwise config` ([`crate::pipeline::preflight`]).
    fn check_new_run_paths(&self) -> Result<(), ConfigError> {
        if let Some(p) = &self.model.init_from {
            let s = p.to_string_lossy();
            if s.trim().is_empty() {
                return Err(ConfigError::Invalid {
                    field: "model.init_from",
                    message: "is empty: give a GGUF file, a Hugging Face folder, a checkpoint or \
                              a packaged model's name (smollm2-135m-instruct), or leave it out \
                              for a fresh model"
                        .into(),
                });
            }
        }
        Ok(())
    }

    /// The preset's layer (with the quickstart's overrides) and its `[for_env]` table (see
    /// [`presets::FOR_ENV`]); empty without a preset.
    fn preset_layer(preset: Option<&str>) -> Result<(toml::Table, toml::Table), ConfigError> {
        let (mut doc, mut for_env) = (toml::Table::new(), toml::Table::new());
        let Some(name) = preset else {
            return Ok((doc, for_env));
        };
        let base = if name == presets::QUICKSTART {
            presets::QUICKSTART_BASE
        } else {
            name
        };
        let mut table = parse_table(presets::get(base)?, &format!("preset {base}"))?;
        if let Some(v) = table.remove(presets::FOR_ENV) {
            for_env = presets::for_env_table(base, v)?;
        }
        merge(&mut doc, table);
        // The run records the preset it was made from (a file or `--set preset=…` may still
        // rename it).
        doc.insert("preset".into(), toml::Value::String(name.to_string()));
        if name == presets::QUICKSTART {
            for arg in presets::QUICKSTART_OVERRIDES {
                apply_override(&mut doc, arg)?;
            }
        }
        Ok((doc, for_env))
    }

    /// A config file as a layer, its paths made absolute relative to the file (wherever the
    /// command runs).
    fn file_layer(path: &Path) -> Result<toml::Table, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|cause| ConfigError::Io {
            path: path.to_path_buf(),
            cause,
        })?;
        let mut table = parse_table(&text, &path.display().to_string())?;
        absolutize_paths(&mut table, path.parent().unwrap_or(Path::new("")))?;
        Ok(table)
    }

    /// Deserializes a resolved TOML table, naming the offending field on error.
    pub fn from_table(doc: toml::Table) -> Result<Self, ConfigError> {
        let text = toml::to_string(&doc).map_err(|e| ConfigError::Parse {
            source_name: "resolved config".into(),
            message: e.to_string(),
        })?;
        let de = toml::Deserializer::parse(&text).map_err(|e| ConfigError::Parse {
            source_name: "resolved config".into(),
            message: e.to_string(),
        })?;
        let mut cfg: TrainConfig =
            serde_path_to_error::deserialize(de).map_err(|e| ConfigError::Field {
                field: e.path().to_string(),
                message: first_line(&e.inner().to_string()),
            })?;
        cfg.fill_implied();
        cfg.validate()?;
        Ok(cfg)
    }

    /// Fills the settings that others imply, so that the stored config says what runs:
    /// `seq-mean-token-sum-norm` (Dr.GRPO) without `actor.policy.loss_scale_factor` divides by
    /// the paper's constant, the maximum response length `rollout.max_response_tokens`, one
    /// number for the whole batch (not each micro-batch's or shard's padded width, which would
    /// bring back the length normalisation Dr.GRPO removes and make the gradient depend on the
    /// core count).
    fn fill_implied(&mut self) {
        let policy = &mut self.actor.policy;
        if policy.loss_scale_factor.is_none()
            && policy
                .resolve()
                .is_ok_and(|r| r.agg_mode == LossAggMode::SeqMeanTokenSumNorm)
        {
            policy.loss_scale_factor = Some(self.rollout.max_response_tokens as f64);
        }
    }

    /// The resolved config as TOML (what a run directory stores).
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("the config serializes to TOML")
    }

    /// The memory one RL step's rollouts need at least, in bytes: every sampled token keeps its
    /// id, log-prob and entropy (12 bytes) for `rollout.prompts_per_step × rollout.group_size`
    /// sequences of up to `rollout.max_response_tokens`, and a fresh model sampled locally adds
    /// its KV cache (keys and values of every layer, f32) over the whole context. A lower bound:
    /// activations, the model and the optimizer come on top.
    pub fn rollout_memory_floor(&self) -> u128 {
        let r = &self.rollout;
        let seqs = r.prompts_per_step as u128 * r.group_size as u128;
        let mut bytes = seqs * r.max_response_tokens as u128 * 12;
        let m = &self.model;
        if m.init_from.is_none() && r.backend == RolloutBackend::Local && m.num_heads > 0 {
            let head_dim = (m.hidden_size / m.num_heads) as u128;
            let per_token = 2 * m.num_layers as u128 * m.num_kv_heads as u128 * head_dim * 4;
            bytes += seqs * m.max_position_embeddings as u128 * per_token;
        }
        bytes
    }

    /// Refuses a batch whose [`TrainConfig::rollout_memory_floor`] exceeds `total` bytes (this
    /// machine's memory; `None` when it cannot be read, and then nothing is checked), naming the
    /// keys that size it.
    fn validate_memory(&self, total: Option<u64>) -> Result<(), ConfigError> {
        let Some(total) = total else { return Ok(()) };
        let need = self.rollout_memory_floor();
        if need > u128::from(total) {
            let gb = |b: u128| b as f64 / 1e9;
            return Err(ConfigError::Invalid {
                field: "rollout.group_size",
                message: format!(
                    "rollout.prompts_per_step × rollout.group_size = {} × {} sequences of up to \
                     {} tokens (rollout.max_response_tokens; model.max_position_embeddings {} for \
                     a fresh model's KV cache) need at least {:.1} GB, more than this machine's \
                     {:.1} GB of memory",
                    self.rollout.prompts_per_step,
                    self.rollout.group_size,
                    self.rollout.max_response_tokens,
                    self.model.max_position_embeddings,
                    gb(need),
                    gb(u128::from(total))
                ),
            });
        }
        Ok(())
    }

    /// Checks ranges and cross-field consistency.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        let r = &self.rollout;
        if r.prompts_per_step == 0 {
            return bad("rollout.prompts_per_step", "must be at least 1".into());
        }
        if r.group_size == 0 {
            return bad("rollout.group_size", "must be at least 1".into());
        }
        if !(r.temperature > 0.0 && r.temperature.is_finite()) {
            return bad(
                "rollout.temperature",
                format!("must be positive for RL sampling, got {}", r.temperature),
            );
        }
        if !(r.top_p > 0.0 && r.top_p <= 1.0) {
            return bad(
                "rollout.top_p",
                format!("must be in (0, 1], got {}", r.top_p),
            );
        }
        if r.max_turn_tokens == 0 || r.max_response_tokens < r.max_turn_tokens {
            return bad(
                "rollout.max_turn_tokens",
                "must be at least 1 and at most rollout.max_response_tokens".into(),
            );
        }
        self.validate_device()?;
        self.run.validate_tracking()?;
        self.validate_tree_shape()?;
        self.validate_rollout_control()?;
        self.validate_ranges()?;
        self.validate_numbers()?;
        if let Some(w) = &self.task.wiki {
            if self.task.search_r1.is_some() {
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
        if self.task.search_r1.is_none()
            && self.task.wiki.is_none()
            && let Err(turnwise_env::world::WorldError::Config { field, message }) =
                self.task.world.validate()
        {
            return Err(ConfigError::Field {
                field: format!("task.world.{field}"),
                message,
            });
        }
        if self.task.max_turns == 0 {
            return bad("task.max_turns", "must be at least 1".into());
        }
        if self.task.max_turns > r.max_response_tokens {
            return bad(
                "task.max_turns",
                format!(
                    "must be at most rollout.max_response_tokens ({}): every turn takes at least \
                     one token of the response, got {}",
                    r.max_response_tokens, self.task.max_turns
                ),
            );
        }
        self.validate_memory(machine_memory_bytes())?;
        self.validate_game()?;
        self.validate_two_turn()?;
        crate::openenv_task::OpenEnvConfig::validate(
            &self.task,
            matches!(self.reward, RewardConfig::Em(_)),
        )?;
        if self.task.topk == 0 {
            return bad("task.topk", "must be at least 1".into());
        }
        let f = self.task.rl_subject_fraction;
        if !(0.0..1.0).contains(&f) {
            return bad(
                "task.rl_subject_fraction",
                format!("must be in [0, 1), got {f}"),
            );
        }
        if f > 0.0 && (self.task.search_r1.is_some() || self.task.wiki.is_some()) {
            return bad(
                "task.rl_subject_fraction",
                "applies to the built-in world only; leave it 0 with task.search_r1".into(),
            );
        }
        if let Some(files) = &self.task.search_r1
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
        if let Err((field, message)) = self.task.prompt.validate() {
            return bad(field, message);
        }
        if self.task.prompt.template == crate::prompt::PromptTemplate::Data
            && self.task.search_r1.is_none()
        {
            return bad(
                "task.prompt.template",
                "\"data\" reads the `prompt` field of task.search_r1 files; the built-in world \
                 has none"
                    .into(),
            );
        }
        let o = &self.optim;
        if !(o.lr > 0.0 && o.lr.is_finite()) {
            return bad("optim.lr", format!("must be positive, got {}", o.lr));
        }
        if o.ppo_epochs == 0 {
            return bad("optim.ppo_epochs", "must be at least 1".into());
        }
        if o.grad_clip.is_nan() || o.grad_clip <= 0.0 {
            return bad(
                "optim.grad_clip",
                format!("must be positive, got {}", o.grad_clip),
            );
        }
        if !(0.0..=1.0).contains(&self.sft.noise) {
            return bad(
                "sft.noise",
                format!("must be in [0, 1], got {}", self.sft.noise),
            );
        }
        if self.sft.steps > 0 && self.sft.batch_size == 0 {
            return bad("sft.batch_size", "must be at least 1".into());
        }
        self.validate_rsft()?;
        let m = &self.model;
        if m.num_heads == 0 || m.num_kv_heads == 0 || !m.num_heads.is_multiple_of(m.num_kv_heads) {
            return bad(
                "model.num_kv_heads",
                format!(
                    "num_heads ({}) must be a positive multiple of num_kv_heads ({})",
                    m.num_heads, m.num_kv_heads
                ),
            );
        }
        if !m.hidden_size.is_multiple_of(m.num_heads) {
            return bad(
                "model.hidden_size",
                format!(
                    "must be divisible by num_heads ({}), got {}",
                    m.num_heads, m.hidden_size
                ),
            );
        }
        self.actor
            .policy
            .resolve()
            .map_err(|e| ConfigError::Invalid {
                field: "actor.policy",
                message: e.to_string(),
            })?;
        self.reward.validate().map_err(|e| ConfigError::Invalid {
            field: "reward",
            message: e.to_string(),
        })?;
        let format = self.task.format.grammar();
        if !self.reward.reads_format(format) {
            return bad(
                "reward",
                format!(
                    "the {} reward does not read the {format} agent format of task.format \
                     (boxed_em and deep_research_f1 need \"boxed\", search_r1_format and \
                     mt_ppo_turn \"search_r1\", t2po_em \"t2po\"; em, sub_em and f1 take \
                     reward.format)",
                    self.reward.name()
                ),
            );
        }
        let est = turnwise_core::advantage::Estimator::name(&self.advantage);
        if est == "gae" && !self.critic.enabled {
            return bad(
                "critic.enabled",
                "the gae estimator needs a critic: set critic.enabled = true".into(),
            );
        }
        if matches!(est, "igpo" | "a2tgpo") && !r.info_gain {
            return bad(
                "rollout.info_gain",
                format!(
                    "the {est} estimator needs information-gain probes: set rollout.info_gain = true"
                ),
            );
        }
        if matches!(est, "at2po" | "tree_grpo") && r.strategy == RolloutStrategy::Chain {
            return bad(
                "rollout.strategy",
                format!(
                    "the {est} estimator needs tree rollouts (strategy = \"tree\" or \"random_tree\")"
                ),
            );
        }
        // A loss whose defining mechanism is a clip (or the clipping-bias correction) needs
        // off-policy updates: with one epoch over one mini-batch every ratio is exactly 1 and
        // no clip can bind (review X1), so the method would silently train as plain PG.
        let kind = self
            .actor
            .policy
            .resolve()
            .map_err(|e| ConfigError::Invalid {
                field: "actor.policy",
                message: e.to_string(),
            })?
            .kind;
        let rows = r.prompts_per_step * r.group_size;
        if kind_needs_off_policy(kind.name())
            && o.ppo_epochs == 1
            && (o.mini_batch_size == 0 || o.mini_batch_size >= rows)
        {
            return bad(
                "optim.mini_batch_size",
                format!(
                    "the {} loss is defined by its clip, which cannot bind in an on-policy update \
                     (optim.ppo_epochs = 1 and one mini-batch of all {rows} rollouts): set \
                     optim.mini_batch_size below {rows} or optim.ppo_epochs above 1",
                    kind.name()
                ),
            );
        }
        if self.algorithm.use_kl_in_reward {
            if !matches!(est, "gae" | "grpo" | "dr_grpo" | "rloo") {
                return bad(
                    "algorithm.use_kl_in_reward",
                    format!(
                        "KL in the reward applies to the gae, grpo, dr_grpo and rloo estimators, \
                         not {est}; use actor.use_kl_loss"
                    ),
                );
            }
            self.algorithm
                .kl_ctrl
                .build()
                .map_err(|e| ConfigError::Invalid {
                    field: "algorithm.kl_ctrl",
                    message: e.to_string(),
                })?;
        }
        if r.filter_zero_variance_groups && r.max_num_gen_batches == 0 {
            return bad(
                "rollout.max_num_gen_batches",
                "must be at least 1 (the rounds of generation a step may use)".into(),
            );
        }
        let ob = &self.overlong_buffer;
        if ob.enable {
            if !(ob.penalty_factor >= 0.0 && ob.penalty_factor.is_finite()) {
                return bad(
                    "overlong_buffer.penalty_factor",
                    format!("must be a non-negative number, got {}", ob.penalty_factor),
                );
            }
            let len = ob.to_core(r.max_response_tokens).buffer_len;
            if len == 0 || len > r.max_response_tokens {
                return bad(
                    "overlong_buffer.len",
                    format!(
                        "must be in 1..=rollout.max_response_tokens ({}), got {len}",
                        r.max_response_tokens
                    ),
                );
            }
        }
        if self.actor.policy.policy_loss == "a2tgpo" && est != "a2tgpo" {
            return bad(
                "actor.policy.policy_loss",
                "the a2tgpo loss needs the a2tgpo estimator's clip scales".into(),
            );
        }
        Ok(())
    }

    /// The number of optimizer steps one rollout batch of the nominal size
    /// (`rollout.prompts_per_step × rollout.group_size` rows) makes, and how many of them are
    /// off-policy: `(steps, off_policy_steps)`. With step samples (`optim.samples = "step"`)
    /// this is the least it makes: every rollout has at least one step, and a batch of K̂ steps
    /// per rollout makes about K̂ times as many.
    pub fn update_structure(&self) -> (usize, usize) {
        let rows = (self.rollout.prompts_per_step * self.rollout.group_size).max(1);
        let mini = match self.optim.mini_batch_size {
            0 => rows,
            m => m.min(rows),
        };
        let steps = rows.div_ceil(mini) * self.optim.ppo_epochs;
        (steps, steps - 1)
    }

    /// Checks the tree shape of tree strategies, and that `rollout.group_size` equals the leaves
    /// per prompt it produces (the trainer groups episodes by prompt with that size).
    /// `task.env = "two_turn"`: the verifiers format, exactly one search turn and one answer
    /// turn (turn-level-rewards.md App. E).
    fn validate_two_turn(&self) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        let t = &self.task;
        if t.format == AgentFormatName::Verifiers && self.rollout.tti.enabled {
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
    fn validate_game(&self) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        let t = &self.task;
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
        if matches!(self.reward, RewardConfig::T2poEm(_)) {
            return bad(
                "reward.name",
                format!(
                    "t2po_em scores search actions (<search>, <answer>); a game's reward is its \
                     return: with task.env = \"{env}\" set reward.name = \"em\" and the \
                     invalid-move penalty advantage.invalid_action_penalty = 0.1"
                ),
            );
        }
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

    fn validate_tree_shape(&self) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        let r = &self.rollout;
        if !r.is_tree() {
            return Ok(());
        }
        if r.tree_initial_chains == 0 || r.tree_forks == 0 {
            return bad(
                "rollout.tree_initial_chains",
                "tree rollouts need at least one initial chain and one fork per iteration".into(),
            );
        }
        if r.tree_count == 0 {
            return bad("rollout.tree_count", "must be at least 1".into());
        }
        if !r.tree_branch_penalty.is_finite() {
            return bad(
                "rollout.tree_branch_penalty",
                format!("must be finite, got {}", r.tree_branch_penalty),
            );
        }
        let grown = r.tree_settings().samples_per_tree();
        if let Some(k) = r.tree_leaves
            && (k == 0 || k > grown)
        {
            return bad(
                "rollout.tree_leaves",
                format!(
                    "must be between 1 and the {grown} leaves each tree grows \
                     (rollout.tree_initial_chains + rollout.tree_iterations × rollout.tree_forks \
                     = {} + {} × {}), got {k}",
                    r.tree_initial_chains, r.tree_iterations, r.tree_forks
                ),
            );
        }
        let per_prompt = r.tree_count * r.leaves_per_tree();
        if r.group_size != per_prompt {
            let per_tree = match r.tree_leaves {
                Some(k) => format!("rollout.tree_leaves ({k})"),
                None => format!(
                    "(rollout.tree_initial_chains + rollout.tree_iterations × rollout.tree_forks \
                     = {} + {} × {})",
                    r.tree_initial_chains, r.tree_iterations, r.tree_forks
                ),
            };
            return bad(
                "rollout.group_size",
                format!(
                    "rollout.group_size ({}) must equal the leaves per prompt of the tree shape, \
                     rollout.tree_count ({}) × {per_tree} = {per_prompt}; set \
                     rollout.group_size = {per_prompt} or change the tree shape",
                    r.group_size, r.tree_count
                ),
            );
        }
        Ok(())
    }

    /// The checks that hold for every number of the resolved config by its name, wherever it
    /// sits (the estimators' and losses' own settings included): finite (only
    /// `optim.grad_clip` may be infinite), discount factors (`gamma`, `lam`) and similarity
    /// thresholds in [0, 1], epsilons, coefficients, `clip_beta`, `target_kl` and `horizon`
    /// not negative, clip ratios positive and the dual clip `clip_ratio_c` above 1. Each is
    /// reported under its dotted key.
    fn validate_numbers(&self) -> Result<(), ConfigError> {
        fn walk(prefix: &str, v: &toml::Value) -> Result<(), ConfigError> {
            match v {
                toml::Value::Table(t) => {
                    for (k, v) in t {
                        let key = if prefix.is_empty() {
                            k.clone()
                        } else {
                            format!("{prefix}.{k}")
                        };
                        walk(&key, v)?;
                    }
                    Ok(())
                }
                toml::Value::Float(x) => check_number(prefix, *x),
                toml::Value::Integer(i) => check_number(prefix, *i as f64),
                _ => Ok(()),
            }
        }
        fn check_number(key: &str, x: f64) -> Result<(), ConfigError> {
            let name = key.rsplit('.').next().unwrap_or(key);
            let fail = |what: &str| {
                Err(ConfigError::Field {
                    field: key.to_string(),
                    message: format!("must be {what}, got {x}"),
                })
            };
            if x.is_nan() || (x.is_infinite() && key != "optim.grad_clip") {
                return fail("a finite number");
            }
            if matches!(name, "gamma" | "lam" | "similarity_thresh") && !(0.0..=1.0).contains(&x) {
                return fail("in [0, 1]");
            }
            let non_negative = name.contains("epsilon")
                || name.ends_with("_coef")
                || name.ends_with("_coeff")
                || matches!(name, "clip_beta" | "target_kl" | "horizon");
            if non_negative && x < 0.0 {
                return fail("a non-negative number");
            }
            // The estimators' epsilons guard a division by a group's standard deviation, which
            // is 0 whenever every score of the group agrees: 0 gives NaN advantages.
            if key.starts_with("advantage.") && name.contains("epsilon") && x <= 0.0 {
                return fail(
                    "positive (it is added to a group's standard deviation, which is 0 when all \
                     its scores agree)",
                );
            }
            if name == "clip_ratio_c" && x <= 1.0 {
                return fail("above 1 (the dual clip bounds ratios of negative advantages)");
            }
            if name.starts_with("clip_ratio") && name != "clip_ratio_c" && x <= 0.0 {
                return fail("positive");
            }
            Ok(())
        }
        let v = toml::Value::try_from(self).map_err(|e| ConfigError::Parse {
            source_name: "resolved config".into(),
            message: e.to_string(),
        })?;
        walk("", &v)
    }

    /// Range checks of the numeric settings not checked elsewhere, each reported under its key.
    /// `model.device` names a device this binary can use (a CUDA device needs the `cuda`
    /// feature; whether the GPU exists is checked when the run creates it).
    fn validate_device(&self) -> Result<(), ConfigError> {
        let spec = turnwise_model::device::DeviceSpec::parse(&self.model.device).map_err(|e| {
            ConfigError::Invalid {
                field: "model.device",
                message: e.to_string(),
            }
        })?;
        if spec.is_cuda() && !turnwise_model::device::cuda_compiled() {
            return Err(ConfigError::Invalid {
                field: "model.device",
                message: format!(
                    "`{}` needs a CUDA device, but this turnwise was built without the `cuda` \
                     feature (cargo build --release -p turnwise --features cuda; README, \
                     \"Building with CUDA\")",
                    self.model.device
                ),
            });
        }
        Ok(())
    }

    /// The device `model.device` names, created, and the dtype `model.dtype` resolves to on it.
    pub fn placement(&self) -> Result<turnwise_model::device::Placement, ConfigError> {
        let invalid = |e: turnwise_model::ModelError| ConfigError::Invalid {
            field: "model.device",
            message: e.to_string(),
        };
        let device = turnwise_model::device::pick_device(&self.model.device).map_err(invalid)?;
        let dtype = self.model.dtype.resolve(&device);
        Ok(turnwise_model::device::Placement { device, dtype })
    }

    fn validate_ranges(&self) -> Result<(), ConfigError> {
        /// `Err` naming `field` unless `ok`.
        fn check(ok: bool, field: &'static str, what: &str, got: f64) -> Result<(), ConfigError> {
            if ok {
                Ok(())
            } else {
                Err(ConfigError::Invalid {
                    field,
                    message: format!("must be {what}, got {got}"),
                })
            }
        }
        let positive = |x: f64| x > 0.0 && x.is_finite();
        let non_negative = |x: f64| x >= 0.0 && x.is_finite();
        let unit_open = |x: f64| (0.0..1.0).contains(&x);
        let unit = |x: f64| (0.0..=1.0).contains(&x);
        let o = &self.optim;
        check(unit_open(o.beta1), "optim.beta1", "in [0, 1)", o.beta1)?;
        check(unit_open(o.beta2), "optim.beta2", "in [0, 1)", o.beta2)?;
        check(
            non_negative(o.weight_decay),
            "optim.weight_decay",
            "a non-negative number",
            o.weight_decay,
        )?;
        check(
            o.max_bad_updates >= 1,
            "optim.max_bad_updates",
            "at least 1",
            o.max_bad_updates as f64,
        )?;
        let c = &self.critic;
        check(positive(c.lr), "critic.lr", "a positive number", c.lr)?;
        check(
            positive(c.cliprange_value),
            "critic.cliprange_value",
            "a positive number",
            c.cliprange_value,
        )?;
        check(
            non_negative(c.weight_decay),
            "critic.weight_decay",
            "a non-negative number",
            c.weight_decay,
        )?;
        let s = &self.sft;
        check(positive(s.lr), "sft.lr", "a positive number", s.lr)?;
        check(
            unit(s.min_lr_ratio),
            "sft.min_lr_ratio",
            "in [0, 1]",
            s.min_lr_ratio,
        )?;
        check(
            positive(self.rsft.lr),
            "rsft.lr",
            "a positive number",
            self.rsft.lr,
        )?;
        let r = &self.rollout;
        check(
            non_negative(r.tree_branch_penalty),
            "rollout.tree_branch_penalty",
            "a non-negative number",
            r.tree_branch_penalty,
        )?;
        let m = &self.model;
        if m.init_from.is_none() {
            // A rank above the layers' width makes the adapters larger than the layer.
            let width = m.hidden_size.min(m.intermediate_size);
            if m.lora.rank > width {
                return Err(ConfigError::Invalid {
                    field: "model.lora.rank",
                    message: format!(
                        "must be at most the narrowest adapted width, min(model.hidden_size, \
                         model.intermediate_size) = {width}, got {}",
                        m.lora.rank
                    ),
                });
            }
            for (field, v) in [
                ("model.vocab_size", m.vocab_size),
                ("model.hidden_size", m.hidden_size),
                ("model.num_layers", m.num_layers),
                ("model.intermediate_size", m.intermediate_size),
            ] {
                check(v >= 1, field, "at least 1", v as f64)?;
            }
            // A prompt and a whole response must fit in the position table.
            if m.max_position_embeddings <= r.max_response_tokens {
                return Err(ConfigError::Invalid {
                    field: "model.max_position_embeddings",
                    message: format!(
                        "must exceed rollout.max_response_tokens ({}) to hold a prompt and a \
                         whole response, got {}",
                        r.max_response_tokens, m.max_position_embeddings
                    ),
                });
            }
        }
        // Checked whether or not LoRA is on, so that a typo is caught before it is turned on.
        let l = &m.lora;
        check(
            positive(l.alpha),
            "model.lora.alpha",
            "a positive number",
            l.alpha,
        )?;
        check(
            unit_open(l.dropout),
            "model.lora.dropout",
            "in [0, 1)",
            l.dropout,
        )?;
        let known = turnwise_model::model::lora::LORA_TARGETS;
        if l.target_modules.is_empty() {
            return Err(ConfigError::Invalid {
                field: "model.lora.target_modules",
                message: format!("must name at least one of {}", known.join(", ")),
            });
        }
        for (i, name) in l.target_modules.iter().enumerate() {
            if !known.contains(&name.as_str()) {
                return Err(ConfigError::Invalid {
                    field: "model.lora.target_modules",
                    message: format!(
                        "unknown module {name:?}; the adaptable ones are {}",
                        known.join(", ")
                    ),
                });
            }
            if l.target_modules[..i].contains(name) {
                return Err(ConfigError::Invalid {
                    field: "model.lora.target_modules",
                    message: format!("{name:?} is listed twice"),
                });
            }
        }
        if let Some(layers) = &l.layers_to_transform {
            if layers.is_empty() {
                return Err(ConfigError::Invalid {
                    field: "model.lora.layers_to_transform",
                    message: "names no layer (leave it unset to adapt every layer)".into(),
                });
            }
            if let Some((i, x)) = layers
                .iter()
                .enumerate()
                .find(|(i, x)| layers[..*i].contains(x))
            {
                return Err(ConfigError::Invalid {
                    field: "model.lora.layers_to_transform",
                    message: format!("layer {x} is listed twice (entry {i})"),
                });
            }
        }
        let t = &self.task;
        check(
            t.topk <= MAX_TOPK,
            "task.topk",
            &format!("at most {MAX_TOPK} (the retrieval server's limit)"),
            t.topk as f64,
        )?;
        if let Some(w) = t.max_observation_words {
            check(w >= 1, "task.max_observation_words", "at least 1", w as f64)?;
        }
        let e = &self.eval;
        if e.greedy || e.sampled || !e.base_shots.is_empty() {
            check(
                e.questions >= 1,
                "eval.questions",
                "at least 1 (or turn eval.greedy and eval.sampled off)",
                e.questions as f64,
            )?;
        }
        check(
            (1..=1024).contains(&e.samples),
            "eval.samples",
            "in 1..=1024 (episodes per question of the sampled evaluation)",
            e.samples as f64,
        )?;
        check(
            unit(o.min_lr_ratio),
            "optim.min_lr_ratio",
            "in [0, 1] (the decay's floor as a fraction of optim.lr)",
            o.min_lr_ratio,
        )?;
        check(
            self.run.keep_checkpoints >= 1,
            "run.keep_checkpoints",
            "at least 1",
            self.run.keep_checkpoints as f64,
        )?;
        Ok(())
    }

    /// Checks the `rsft` section (always, so that a typo is caught before it is turned on).
    fn validate_rsft(&self) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        let c = &self.rsft;
        if c.questions == 0 {
            return bad("rsft.questions", "must be at least 1".into());
        }
        if c.rollouts_per_question == 0 {
            return bad("rsft.rollouts_per_question", "must be at least 1".into());
        }
        if !(c.temperature > 0.0 && c.temperature.is_finite()) {
            return bad(
                "rsft.temperature",
                format!("must be positive for sampling, got {}", c.temperature),
            );
        }
        if !c.threshold.is_finite() {
            return bad(
                "rsft.threshold",
                format!("must be a finite reward value, got {}", c.threshold),
            );
        }
        if c.epochs == 0 {
            return bad("rsft.epochs", "must be at least 1".into());
        }
        if !(c.lr > 0.0 && c.lr.is_finite()) {
            return bad("rsft.lr", format!("must be positive, got {}", c.lr));
        }
        if c.batch_size == 0 {
            return bad("rsft.batch_size", "must be at least 1".into());
        }
        Ok(())
    }

    /// Checks `rollout.tti`, `rollout.tds` and `rollout.memory_window`.
    fn validate_rollout_control(&self) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        let r = &self.rollout;
        let tti = &r.tti;
        if !(0.0..=1.0).contains(&tti.alpha) {
            return bad(
                "rollout.tti.alpha",
                format!("must be in [0, 1], got {}", tti.alpha),
            );
        }
        if tti.top_j == 0 {
            return bad("rollout.tti.top_j", "must be at least 1".into());
        }
        if !(tti.epsilon >= 0.0 && tti.epsilon.is_finite()) {
            return bad(
                "rollout.tti.epsilon",
                format!("must be a non-negative number, got {}", tti.epsilon),
            );
        }
        if tti.max_tokens == Some(0) {
            return bad(
                "rollout.tti.max_tokens",
                "must be at least 1 when set".into(),
            );
        }
        if let Some(q) = &tti.forced_queue
            && (q.is_empty() || q[0].trim().is_empty())
        {
            return bad(
                "rollout.tti.forced_queue",
                "must start with the end-of-thinking text (e.g. \"</think>\")".into(),
            );
        }
        let tds = &r.tds;
        if !(tds.eta >= 0.0 && tds.eta.is_finite()) {
            return bad(
                "rollout.tds.eta",
                format!("must be a non-negative number, got {}", tds.eta),
            );
        }
        self.validate_samples()?;
        if r.strategy != RolloutStrategy::Chain {
            let on = [
                ("rollout.tti.enabled", tti.enabled),
                ("rollout.tds.enabled", tds.enabled),
                ("rollout.memory_window", r.memory_window.is_some()),
            ];
            if let Some((field, _)) = on.into_iter().find(|(_, on)| *on) {
                return bad(
                    field,
                    "T2PO rollout control applies to chain rollouts only \
                     (rollout.strategy = \"chain\")"
                        .into(),
                );
            }
        }
        self.validate_remote()?;
        self.validate_judge()
    }

    /// Checks `optim.samples` against the memory window and the parts that read whole rows.
    fn validate_samples(&self) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        match self.optim.samples {
            TrainSamples::Trajectory => {
                // The window drops turns once a turn has more than P turns before it.
                if let Some(p) = self.rollout.memory_window
                    && self.task.max_turns > p + 1
                {
                    return bad(
                        "rollout.memory_window",
                        format!(
                            "a window of {p} turns drops earlier turns from the context of turn \
                             {} onwards (task.max_turns = {}), but optim.samples = \
                             \"trajectory\" trains every turn on the whole history, which is not \
                             what it was sampled from; set optim.samples = \"step\" (each step \
                             trained on its own context), or a window of at least {} turns",
                            p + 2,
                            self.task.max_turns,
                            self.task.max_turns - 1
                        ),
                    );
                }
            }
            TrainSamples::Step => {
                if self.critic.enabled {
                    return bad(
                        "optim.samples",
                        "\"step\" rows are not supported with a critic (critic.enabled): its \
                         values and returns are per trajectory row"
                            .into(),
                    );
                }
                if self.algorithm.use_kl_in_reward {
                    return bad(
                        "optim.samples",
                        "\"step\" rows are not supported with KL in the reward \
                         (algorithm.use_kl_in_reward): use the KL loss (actor.use_kl_loss), as \
                         verl-agent does"
                            .into(),
                    );
                }
            }
        }
        Ok(())
    }

    fn validate_judge(&self) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        let j = &self.judge;
        if !j.enabled {
            return Ok(());
        }
        if !matches!(self.reward, RewardConfig::MtPpoTurn(_)) {
            return bad(
                "judge.enabled",
                format!(
                    "the judge scores turns with MT-PPO's rubric: it needs reward = \
                     \"mt_ppo_turn\", not {:?}",
                    self.reward.name()
                ),
            );
        }
        if j.serve.is_none()
            && !(j.base_url.starts_with("http://") || j.base_url.starts_with("https://"))
        {
            return bad(
                "judge.base_url",
                format!("{:?} is not an http:// or https:// URL", j.base_url),
            );
        }
        if j.model.is_empty() {
            return bad("judge.model", "must not be empty".into());
        }
        if !(j.timeout_secs > 0.0 && j.timeout_secs.is_finite()) {
            return bad(
                "judge.timeout_secs",
                format!("must be a positive number, got {}", j.timeout_secs),
            );
        }
        if j.max_attempts == 0 {
            return bad("judge.max_attempts", "must be at least 1".into());
        }
        if j.concurrency == 0 {
            return bad("judge.concurrency", "must be at least 1".into());
        }
        if j.max_tokens == 0 {
            return bad("judge.max_tokens", "must be at least 1".into());
        }
        if !(0.0..=1.0).contains(&j.max_failure_rate) {
            return bad(
                "judge.max_failure_rate",
                format!("must be in [0, 1], got {}", j.max_failure_rate),
            );
        }
        Ok(())
    }

    fn validate_remote(&self) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        let r = &self.rollout;
        let rc = &r.remote;
        if r.backend == RolloutBackend::Local {
            return Ok(());
        }
        if rc.urls.is_empty() {
            return bad(
                "rollout.remote.urls",
                "rollout.backend = \"remote\" needs at least one server URL".into(),
            );
        }
        if let Some(u) = rc
            .urls
            .iter()
            .find(|u| !(u.starts_with("http://") || u.starts_with("https://")))
        {
            return bad(
                "rollout.remote.urls",
                format!("{u:?} is not an http:// or https:// URL"),
            );
        }
        if !(rc.timeout_secs > 0.0 && rc.timeout_secs.is_finite()) {
            return bad(
                "rollout.remote.timeout_secs",
                format!("must be a positive number, got {}", rc.timeout_secs),
            );
        }
        if rc.max_attempts == 0 {
            return bad("rollout.remote.max_attempts", "must be at least 1".into());
        }
        if rc.concurrency == 0 {
            return bad("rollout.remote.concurrency", "must be at least 1".into());
        }
        // What needs the sampling engine itself (per-token hooks, forks, entropies).
        let local_only = [
            ("rollout.strategy", r.strategy != RolloutStrategy::Chain),
            ("rollout.tti.enabled", r.tti.enabled),
            ("rollout.tds.enabled", r.tds.enabled),
        ];
        if let Some((field, _)) = local_only.into_iter().find(|(_, on)| *on) {
            return bad(
                field,
                "needs the local sampling engine (per-token hooks, forks and entropies): \
                 rollout.backend = \"remote\" rolls out chains without thinking intervention \
                 or turn resampling"
                    .into(),
            );
        }
        if rc.protocol == RemoteProtocol::Vllm && rc.sync_weights && self.model.lora.rank == 0 {
            return bad(
                "rollout.remote.sync_weights",
                "stock vLLM cannot reload full weights over HTTP: vLLM servers follow the \
                 policy through LoRA adapters (set model.lora.rank; the servers run with \
                 --enable-lora and runtime LoRA updating), or use protocol = \"sglang\" \
                 (SGLang or turnwise serve), or set sync_weights = false to sample from the \
                 servers' own weights"
                    .into(),
            );
        }
        Ok(())
    }
}

/// The largest `task.topk`: the retrieval server's limit (`turnwise_env::server::ServerConfig`).
pub const MAX_TOPK: usize = 100;

/// The config keys that hold file paths (stored absolute by [`TrainConfig::resolve`]).
pub const PATH_KEYS: &[&str] = &[
    "task.search_r1.train",
    "task.search_r1.validation",
    "task.search_r1.test",
    "task.search_r1.corpus",
    "model.init_from",
    "sft.demonstrations",
    "judge.serve",
    "judge.cache_dir",
];

/// The table at the dotted path `path` in `doc`, if every part of it is a table.
fn subtable<'a>(doc: &'a mut toml::Table, path: &[&str]) -> Option<&'a mut toml::Table> {
    match path.split_first() {
        None => Some(doc),
        Some((first, rest)) => match doc.get_mut(*first) {
            Some(toml::Value::Table(t)) => subtable(t, rest),
            _ => None,
        },
    }
}

/// Makes every relative path of [`PATH_KEYS`] in `doc` absolute, relative to `base` (itself
/// taken relative to the working directory). Values that are not strings are left for the
/// deserializer to report.
pub fn absolutize_paths(doc: &mut toml::Table, base: &Path) -> Result<(), ConfigError> {
    for key in PATH_KEYS {
        let parts: Vec<&str> = key.split('.').collect();
        let (last, head) = parts.split_last().expect("a key has a name");
        let Some(table) = subtable(doc, head) else {
            continue;
        };
        let last = *last;
        let Some(toml::Value::String(s)) = table.get(last) else {
            continue;
        };
        let path = Path::new(s.as_str());
        if path.is_absolute() || s.is_empty() {
            continue;
        }
        // A packaged model's name is not a path (unless a folder of that name is there).
        if matches!(*key, "model.init_from" | "judge.serve")
            && crate::model_source::is_model_name(s)
            && !base.join(path).exists()
        {
            continue;
        }
        let abs = std::path::absolute(base.join(path)).map_err(|cause| ConfigError::Io {
            path: path.to_path_buf(),
            cause,
        })?;
        let abs = abs.to_str().ok_or_else(|| ConfigError::Invalid {
            field: key,
            message: format!("the path {} is not valid UTF-8", abs.display()),
        })?;
        table.insert(last.to_string(), toml::Value::String(abs.to_string()));
    }
    Ok(())
}

fn first_line(s: &str) -> String {
    s.lines()
        .rfind(|l| !l.trim().is_empty())
        .unwrap_or(s)
        .trim()
        .to_string()
}

fn parse_table(text: &str, source_name: &str) -> Result<toml::Table, ConfigError> {
    text.parse::<toml::Table>().map_err(|e| ConfigError::Parse {
        source_name: source_name.to_string(),
        message: e.to_string(),
    })
}

/// Deep-merges `top` into `base` (tables merge key by key; other values replace).
pub fn merge(base: &mut toml::Table, top: toml::Table) {
    for (k, v) in top {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(t)) => merge(b, t),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// Applies one `a.b.c=value` override. The value is parsed as TOML (`3`, `1e-4`, `true`,
/// `"text"`, `[1, 2]`); anything that does not parse is taken as a string.
pub fn apply_override(doc: &mut toml::Table, arg: &str) -> Result<(), ConfigError> {
    let err = |message: &str| ConfigError::Override {
        arg: arg.to_string(),
        message: message.to_string(),
    };
    let (key, raw) = arg
        .split_once('=')
        .ok_or_else(|| err("expected key=value, e.g. optim.lr=1e-4"))?;
    let key = key.trim();
    if key.is_empty() || key.split('.').any(|p| p.trim().is_empty()) {
        return Err(err("the key must be a dotted path like rollout.group_size"));
    }
    let raw = raw.trim();
    let value = match format!("v = {raw}").parse::<toml::Table>() {
        Ok(mut t) => t.remove("v").expect("parsed key"),
        Err(_) => toml::Value::String(raw.to_string()),
    };
    let parts: Vec<&str> = key.split('.').map(str::trim).collect();
    let mut table = doc;
    for p in &parts[..parts.len() - 1] {
        let entry = table
            .entry(p.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        table = match entry {
            toml::Value::Table(t) => t,
            _ => return Err(err(&format!("`{p}` is a value, not a table"))),
        };
    }
    // Switching the estimator or reward drops the previous one's settings.
    let last = parts[parts.len() - 1];
    if (last == "estimator" || last == "name") && table.get(last) != Some(&value) {
        table.clear();
    }
    // An inline table (`optim={lr=1e-4}`) sets those keys and keeps the table's others.
    match (table.get_mut(last), value) {
        (Some(toml::Value::Table(existing)), toml::Value::Table(top)) => merge(existing, top),
        (_, value) => {
            table.insert(last.to_string(), value);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
