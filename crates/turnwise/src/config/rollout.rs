//! The rollout stage (`[rollout]`): how episodes are sampled (chains or trees, T2PO's
//! thinking intervention and turn resampling, the memory window, DAPO's group filter) and where
//! (the local engine or remote servers), with its checks.

use serde::{Deserialize, Serialize};

use super::numbers::{check, non_negative};
use super::{AgentFormatName, ConfigError};

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
    /// `rollout::RolloutControl`). Evaluation applies it too: the agent is evaluated with the
    /// context it trained on.
    pub memory_window: Option<usize>,
    /// Sample the local rollouts (and evaluations) batch-invariant: every forward of the
    /// trainer's sampling engine computes each position from its own inputs and the keys it
    /// sees in a fixed order (`turnwise serve --batch-invariant`'s kernels), so a rollout's
    /// tokens and log-probs do not depend on the other rollouts it was batched with, on the
    /// number of sampling shards (the machine's cores) or on its group's shared prompt. A run
    /// then samples the same rollouts on a 2-core laptop and a 64-core server. Costs
    /// prefill speed (long prompts); the update's passes are unaffected. Default false.
    pub batch_invariant: bool,
    /// Where turns are generated: `local` (the trainer's own sampling engine, default) or
    /// `remote` (SGLang, vLLM or `turnwise serve` servers over HTTP; see [`RemoteConfig`]).
    pub backend: RolloutBackend,
    /// The inference servers of `backend = "remote"`.
    pub remote: RemoteConfig,
    /// The agent program of `backend = "harness"`.
    pub harness: HarnessConfig,
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
    /// An agent program of the user's (`rollout.harness`): the trainer serves its current policy
    /// on loopback (`turnwise serve`, recording sessions), runs the program once per episode,
    /// and trains on the token-exact trajectory the server recorded of its requests.
    Harness,
}

/// Where the reward of a harness episode comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HarnessReward {
    /// The task's own reward (`[reward]`) scores the reconstructed turns (default).
    #[default]
    Task,
    /// The program's: the last line of its standard output is `{"reward": x}`, or it posts
    /// `{"reward": x}` to `$TURNWISE_BASE_URL/v1/sessions/$TURNWISE_SESSION_ID/reward`; an
    /// episode with neither fails.
    Program,
}

/// Settings of the harness rollout backend (`rollout.harness`): the agent program the trainer
/// runs once per episode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HarnessConfig {
    /// The program and its arguments (`["python3", "agent.py"]`); relative paths are taken from
    /// the directory the trainer runs in. Each episode runs it with the task and the server in
    /// its environment: `TURNWISE_BASE_URL` (and `OPENAI_BASE_URL`, `…/v1`), `OPENAI_API_KEY`,
    /// `TURNWISE_SESSION_ID`, `TURNWISE_MODEL`, `TURNWISE_QUESTION`, `TURNWISE_PROMPT` (the
    /// task's rendered prompt), `TURNWISE_TASK_ID`, `TURNWISE_SPLIT`, `TURNWISE_SEED`,
    /// `TURNWISE_TEMPERATURE`, `TURNWISE_TOP_P`, `TURNWISE_MAX_TOKENS` (per turn),
    /// `TURNWISE_STOP` (a JSON list), `TURNWISE_MAX_TURNS` and, for the search task,
    /// `TURNWISE_RETRIEVER_URL` (Search-R1's `/retrieve`).
    pub command: Vec<String>,
    /// Most programs running at once (default 8).
    pub workers: usize,
    /// Seconds one episode's program may run; beyond it its process group is killed and the
    /// episode fails (default 120).
    pub timeout_secs: f64,
    /// Where rewards come from (default `task`).
    pub reward: HarnessReward,
    /// Largest share of a step's episodes that may fail (crash, time out, never call the model,
    /// exceed the response budget) before the step stops with an error naming them (default
    /// 0.5). Failed episodes are left out of the batch and counted.
    pub max_failed_share: f64,
    /// The tool-call parse rate below which the run stops (0, the default: never). Over a
    /// step's completions that were offered `tools`, the share of `<tool_call>` blocks that
    /// parsed; a run whose parser extracts nothing stops naming the format.
    pub min_tool_parse_rate: f64,
}

impl Default for HarnessConfig {
    fn default() -> Self {
        Self {
            command: Vec::new(),
            workers: 8,
            timeout_secs: 120.0,
            reward: HarnessReward::Task,
            max_failed_share: 0.5,
            min_tool_parse_rate: 0.0,
        }
    }
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
            batch_invariant: false,
            backend: RolloutBackend::Local,
            remote: RemoteConfig::default(),
            harness: HarnessConfig::default(),
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

    /// Checks the batch and sampling settings: prompts and group size, temperature, nucleus
    /// mass and the token limits.
    pub(super) fn validate_sampling(&self) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        let r = self;
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
        Ok(())
    }

    /// Checks the tree shape of tree strategies, and that `rollout.group_size` equals the leaves
    /// per prompt it produces (the trainer groups episodes by prompt with that size).
    pub(super) fn validate_tree_shape(&self) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        let r = self;
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

    /// Checks `rollout.tti` and `rollout.tds`.
    pub(super) fn validate_control(&self) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        let r = self;
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
        Ok(())
    }

    /// Checks that T2PO's rollout control (`rollout.tti`, `rollout.tds`,
    /// `rollout.memory_window`) is on for chain rollouts only.
    pub(super) fn validate_chain_only(&self) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        let r = self;
        let (tti, tds) = (&r.tti, &r.tds);
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
        Ok(())
    }

    /// Checks `rollout.remote` when `rollout.backend = "remote"`: the servers, the request
    /// limits, what needs the local engine, and that vLLM servers follow the policy through
    /// LoRA adapters (`lora_rank` is `model.lora.rank`) unless weights are not synced.
    pub(super) fn validate_remote(&self, lora_rank: usize) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        let r = self;
        let rc = &r.remote;
        match r.backend {
            RolloutBackend::Local => return Ok(()),
            RolloutBackend::Harness => return r.validate_harness(),
            RolloutBackend::Remote => {}
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
        if rc.protocol == RemoteProtocol::Vllm && rc.sync_weights && lora_rank == 0 {
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

    /// Checks `rollout.harness` when `rollout.backend = "harness"`: the program, its limits, and
    /// what needs control of generation, which an agent program keeps to itself.
    fn validate_harness(&self) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        let h = &self.harness;
        if h.command.first().is_none_or(|c| c.trim().is_empty()) {
            return bad(
                "rollout.harness.command",
                "rollout.backend = \"harness\" needs the agent program to run, e.g. \
                 command = [\"python3\", \"agent.py\"]"
                    .into(),
            );
        }
        if h.workers == 0 {
            return bad("rollout.harness.workers", "must be at least 1".into());
        }
        if !(h.timeout_secs > 0.0 && h.timeout_secs.is_finite()) {
            return bad(
                "rollout.harness.timeout_secs",
                format!("must be a positive number, got {}", h.timeout_secs),
            );
        }
        if !(0.0..=1.0).contains(&h.max_failed_share) {
            return bad(
                "rollout.harness.max_failed_share",
                format!("must be in [0, 1], got {}", h.max_failed_share),
            );
        }
        if !(0.0..=1.0).contains(&h.min_tool_parse_rate) {
            return bad(
                "rollout.harness.min_tool_parse_rate",
                format!("must be in [0, 1], got {}", h.min_tool_parse_rate),
            );
        }
        // What needs control of generation: the program owns its loop and its context.
        let controlled = [
            (
                "rollout.strategy",
                self.strategy != RolloutStrategy::Chain,
                "trees fork episodes mid-rollout",
            ),
            (
                "rollout.tti.enabled",
                self.tti.enabled,
                "the thinking intervention forces tokens while a turn is decoded",
            ),
            (
                "rollout.tds.enabled",
                self.tds.enabled,
                "turn resampling regenerates a turn before the environment sees it",
            ),
            (
                "rollout.memory_window",
                self.memory_window.is_some(),
                "the memory window chooses the context of each turn",
            ),
        ];
        if let Some((field, _, why)) = controlled.into_iter().find(|(_, on, _)| *on) {
            return bad(
                field,
                format!(
                    "needs control of generation ({why}), which an agent program keeps to \
                     itself: rollout.backend = \"harness\" trains chains of the program's own \
                     requests; use rollout.backend = \"local\" for this method"
                ),
            );
        }
        Ok(())
    }

    /// Checks that the AT2PO branching penalty is not negative.
    pub(super) fn validate_branch_penalty(&self) -> Result<(), ConfigError> {
        check(
            non_negative(self.tree_branch_penalty),
            "rollout.tree_branch_penalty",
            "a non-negative number",
            self.tree_branch_penalty,
        )
    }

    /// Checks that the group filter may generate at least one round.
    pub(super) fn validate_filter(&self) -> Result<(), ConfigError> {
        if self.filter_zero_variance_groups && self.max_num_gen_batches == 0 {
            return Err(ConfigError::Invalid {
                field: "rollout.max_num_gen_batches",
                message: "must be at least 1 (the rounds of generation a step may use)".into(),
            });
        }
        Ok(())
    }
}
