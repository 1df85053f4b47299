//! Rollouts: the policy acts in the environment turn by turn and every token is recorded as it
//! was sampled (token-in-token-out, spec §1.1).
//!
//! - [`run_chains`]: independent chains, batched across every live episode at each turn;
//!   [`run_chains_with`] adds the T2PO rollout control of spec §6.2–§6.3 ([`RolloutControl`]:
//!   thinking intervention, turn-level resampling, memory window);
//! - [`tree`]: AT2PO entropy-guided and Tree-GRPO random tree rollouts (§6.1);
//! - [`info_gain`]: the IGPO / A2TGPO probes (§4), one batched teacher-forced pass;
//! - [`remote`]: chains whose turns inference servers generate (`rollout.backend = "remote"`).

pub mod host;
pub mod info_gain;
pub mod protocol;
pub(crate) mod remote;
pub mod session;
pub mod tree;

use std::collections::BTreeMap;

use anyhow::{Context, Result, anyhow, bail};
use turnwise_core::control::{AttemptScore, TdsSettings, TdsTracker, TtiController, TtiSettings};
use turnwise_core::metric_keys as mk;
use turnwise_core::trajectory::{
    AgentSegment, EnvSegment, FinishReason, Segment, Trajectory, TurnAction, TurnRecord,
};
use turnwise_env::env::{Environment, Task};
use turnwise_model::Transformer;
use turnwise_model::sampling::{
    Completion, EngineConfig, FinishReason as StopReason, PrefixKv, SamplingEngine, SamplingParams,
    SeqId, SeqStatus, Sequence, SequenceParams, TokenHook, TokenOrigin, generate_with_prefixes,
    generation_shards, prefill_prefix, sharded,
};
use turnwise_model::tokenizer::TextTokenizer;

use crate::config::{AgentFormatName, RolloutConfig};
use turnwise_core::control::quantile;

/// What the rollout engine needs of the policy.
pub struct Policy<'a> {
    /// Detached weights (no autograd graph) that see the latest optimizer step.
    pub model: &'a Transformer,
    /// Its tokenizer.
    pub tokenizer: &'a TextTokenizer,
    /// Tokens that end a turn.
    pub stop_ids: &'a [u32],
    /// Texts that end a turn (closing tags that are not single tokens of the tokenizer).
    pub stop_strings: &'a [String],
    /// Inference servers that generate the turns instead of `model` (chains without rollout
    /// control only).
    pub remote: Option<&'a remote::RemoteBackend>,
    /// The weight version the trainer holds (its step): a remote turn's staleness is this minus
    /// the version it was generated with.
    pub version: u64,
}

/// Decoding settings of a rollout phase.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoding {
    /// Temperature (0 = greedy).
    pub temperature: f64,
    /// Nucleus mass.
    pub top_p: f64,
    /// Top-k (0: off).
    pub top_k: usize,
    /// Most tokens per turn.
    pub max_turn_tokens: usize,
    /// Most response tokens per trajectory.
    pub max_response_tokens: usize,
}

/// One episode to roll out.
#[derive(Debug, Clone)]
pub struct EpisodeSpec {
    /// Trajectory id.
    pub id: String,
    /// Group (prompt) uid.
    pub prompt_uid: String,
    /// Prompt ids.
    pub prompt_ids: Vec<u32>,
    /// The environment task.
    pub task: Task,
    /// Seed of this episode's sampling.
    pub seed: u64,
}

impl EpisodeSpec {
    /// The episode's trajectory before its first turn: its prompt and nothing else.
    pub fn blank_trajectory(&self) -> Trajectory {
        Trajectory {
            id: self.id.clone(),
            prompt_uid: self.prompt_uid.clone(),
            prompt_ids: self.prompt_ids.clone(),
            segments: Vec::new(),
            turns: Vec::new(),
            finish: FinishReason::Answered,
            outcome_reward: None,
            turn_rewards: Vec::new(),
        }
    }
}

/// A finished episode: the token-exact trajectory plus what rewards read as text.
#[derive(Debug, Clone)]
pub struct Episode {
    /// The trajectory (env rewards per turn in its records).
    pub trajectory: Trajectory,
    /// Each turn's generated text and the observation after it.
    pub turn_texts: Vec<(String, Option<String>)>,
    /// Sum of environment rewards (EM for the search environment).
    pub env_return: f64,
    /// Whether the environment reported success.
    pub won: bool,
    /// The extracted final answer, if any.
    pub answer: Option<String>,
    /// Response-coordinate spans of the observations (for information-gain probes).
    pub observation_spans: Vec<std::ops::Range<usize>>,
    /// Per turn, what the T2PO rollout control did (context size, TTI trigger, TDS
    /// regenerations).
    pub turn_control: Vec<TurnControl>,
}

impl Episode {
    /// An episode of `spec` with no turns (an agent program that failed at evaluation).
    pub fn empty(spec: &EpisodeSpec) -> Self {
        Self {
            trajectory: spec.blank_trajectory(),
            turn_texts: Vec::new(),
            env_return: 0.0,
            won: false,
            answer: None,
            observation_spans: Vec::new(),
            turn_control: Vec::new(),
        }
    }

    /// The decoded response: agent turns and observations in order.
    pub fn response_text(&self) -> String {
        let mut s = String::new();
        for (g, o) in &self.turn_texts {
            s.push_str(g);
            if let Some(o) = o {
                s.push_str(o);
            }
        }
        s
    }
}

struct Live {
    spec: EpisodeSpec,
    env: Box<dyn Environment>,
    response: Vec<u32>,
    traj: Trajectory,
    turn_texts: Vec<(String, Option<String>)>,
    env_return: f64,
    won: bool,
    answer: Option<String>,
    obs_spans: Vec<std::ops::Range<usize>>,
    done: bool,
    agent_end: usize,
    last_logprobs: Vec<f64>,
    /// Response offset where each turn's agent tokens start.
    turn_starts: Vec<usize>,
    turn_control: Vec<TurnControl>,
    /// The state the next turn acts in, its GiGPO anchor (spec §3.7): the last observation,
    /// at first the environment's first one (a game's starting board); `None` while that is
    /// the task's question itself (the search world), which the prompt stands for.
    state: Option<String>,
    /// Keys and values of the context the last turn ended with (local sampling): the next turn
    /// prefills only what follows them (its observation), instead of the whole context.
    kv: Option<PrefixKv>,
}

/// A per-turn seed derived from the episode seed (splitmix64 of seed and turn).
pub fn turn_seed(seed: u64, turn: usize) -> u64 {
    let mut z = seed ^ (turn as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// What one environment step makes of an agent turn.
pub(crate) struct SteppedTurn {
    /// The turn's record (its parsed action, format verdict, observation, anchor state).
    pub record: TurnRecord,
    /// The answer the turn gave, if it answered.
    pub answer: Option<String>,
    /// The observation text the agent reads next (`None` when the episode ended or there is
    /// none).
    pub observation: Option<String>,
}

/// The record of turn `turn` from the environment's answer to it; `state` is the state the turn
/// acted in (its GiGPO anchor) and becomes the state the next turn acts in.
pub(crate) fn record_step(
    step: &turnwise_env::env::StepResult,
    turn: usize,
    state: &mut Option<String>,
) -> SteppedTurn {
    let mut answer = None;
    let action = match (&step.info.action, &step.info.query) {
        (Some(a), _) if a == "answer" => {
            let ans = step
                .info
                .extra
                .get("answer")
                .and_then(|v| v.as_str())
                .unwrap_or_default()
                .to_string();
            answer = Some(ans.clone());
            TurnAction::Answer { text: ans }
        }
        (_, Some(q)) => TurnAction::Search { query: q.clone() },
        // A game move the environment accepted (FrozenLake, Sokoban).
        (Some(a), None) if step.info.valid_action => TurnAction::Move { action: a.clone() },
        _ => TurnAction::Invalid {
            reason: step
                .info
                .feedback
                .clone()
                .unwrap_or_else(|| "invalid action".into()),
        },
    };
    let observation = (!step.done || !step.observation.text.is_empty())
        .then(|| step.observation.text.clone())
        .filter(|o| !o.is_empty() && !step.done);
    let record = TurnRecord {
        index: turn,
        action,
        format_ok: step.info.format_ok,
        observation: step.info.retrieved.clone().or(observation.clone()),
        searches_so_far: step.info.searches_so_far,
        env_reward: Some(step.reward),
        anchor: state.replace(step.observation.text.clone()),
    };
    SteppedTurn {
        record,
        answer,
        observation,
    }
}

/// A live episode in the middle of a rollout: used by chains and by tree forks.
pub struct EpisodeState {
    live: Live,
}

impl EpisodeState {
    /// Resets `env` for `spec` and returns the episode at its first turn.
    pub fn start(spec: EpisodeSpec, mut env: Box<dyn Environment>) -> Result<Self> {
        let first = env
            .reset(&spec.task)
            .with_context(|| format!("resetting the environment for {}", spec.task.id))?
            .text;
        let state = Some(first).filter(|o| spec.task.prompt.as_ref() != Some(o));
        let traj = spec.blank_trajectory();
        Ok(Self {
            live: Live {
                spec,
                env,
                response: Vec::new(),
                traj,
                turn_texts: Vec::new(),
                env_return: 0.0,
                won: false,
                answer: None,
                obs_spans: Vec::new(),
                done: false,
                agent_end: 0,
                last_logprobs: Vec::new(),
                turn_starts: Vec::new(),
                turn_control: Vec::new(),
                state,
                kv: None,
            },
        })
    }

    /// Whether the episode has ended.
    pub fn is_done(&self) -> bool {
        self.live.done
    }

    /// Number of turns taken.
    pub fn turns(&self) -> usize {
        self.live.traj.turns.len()
    }

    /// The full context (prompt + response so far).
    pub fn context(&self) -> Vec<u32> {
        let mut c = self.live.spec.prompt_ids.clone();
        c.extend_from_slice(&self.live.response);
        c
    }

    /// The context of the next turn under memory window `window` (spec §1.3, §6.3): the prompt
    /// plus the last P turns (each turn's agent tokens and the observation after it), or the
    /// full context when `window` is `None`. The flag says whether earlier turns were dropped.
    pub fn context_window(&self, window: Option<usize>) -> (Vec<u32>, bool) {
        let l = &self.live;
        let from = match window {
            Some(p) if l.turn_starts.len() > p => l
                .turn_starts
                .get(l.turn_starts.len() - p)
                .copied()
                .unwrap_or(l.response.len()),
            _ => 0,
        };
        let mut c = l.spec.prompt_ids.clone();
        c.extend_from_slice(&l.response[from..]);
        (c, from > 0)
    }

    /// The cached keys and values of the context the last turn ended with, if kept.
    pub fn context_kv(&self) -> Option<&PrefixKv> {
        self.live.kv.as_ref()
    }

    /// Forgets the cached context: the next turn prefills the whole context again.
    pub fn forget_context_kv(&mut self) {
        self.live.kv = None;
    }

    /// The environment task of the episode.
    pub fn task(&self) -> &Task {
        &self.live.spec.task
    }

    /// The episode's seed.
    pub fn seed(&self) -> u64 {
        self.live.spec.seed
    }

    /// Sets the seed (tree forks give each branch its own).
    pub fn set_seed(&mut self, seed: u64) {
        self.live.spec.seed = seed;
    }

    /// Sets the trajectory id.
    pub fn set_id(&mut self, id: String) {
        self.live.traj.id = id.clone();
        self.live.spec.id = id;
    }

    /// Response length right after the last agent turn (before its observation).
    pub fn agent_end(&self) -> usize {
        self.live.agent_end
    }

    /// Sampled log-probs of the last agent turn.
    pub fn last_turn_logprobs(&self) -> Vec<f64> {
        self.live.last_logprobs.clone()
    }

    /// Response tokens so far.
    pub fn response_len(&self) -> usize {
        self.live.response.len()
    }

    /// Applies one generated turn: records the agent segment, steps the environment and
    /// appends the observation tokens.
    pub fn apply_turn(
        &mut self,
        policy: &Policy<'_>,
        completion: turnwise_model::sampling::Completion,
        decoding: &Decoding,
    ) -> Result<()> {
        let control = TurnControl {
            context_tokens: self.live.spec.prompt_ids.len() + self.live.response.len(),
            ..TurnControl::default()
        };
        self.apply_turn_with(
            policy,
            completion,
            decoding,
            TurnExtras {
                forced: Vec::new(),
                confidences: None,
                control,
            },
        )
    }

    /// [`EpisodeState::apply_turn`] with the per-token forced flags, confidences and control
    /// record of a controlled generation.
    pub fn apply_turn_with(
        &mut self,
        policy: &Policy<'_>,
        completion: turnwise_model::sampling::Completion,
        decoding: &Decoding,
        extras: TurnExtras,
    ) -> Result<()> {
        let l = &mut self.live;
        let turn = l.traj.turns.len();
        if !extras.forced.is_empty() && extras.forced.len() != completion.tokens.len() {
            bail!(
                "turn {turn} of {}: {} forced flags for {} tokens",
                l.spec.id,
                extras.forced.len(),
                completion.tokens.len()
            );
        }
        l.turn_starts.push(l.response.len());
        let weight_version = extras.control.weight_version;
        l.turn_control.push(extras.control);
        let text = policy
            .tokenizer
            .decode(&completion.tokens, false)
            .context("decoding a turn")?;
        let context_full = completion.finish == StopReason::ContextFull;
        l.response.extend_from_slice(&completion.tokens);
        l.agent_end = l.response.len();
        l.last_logprobs = completion.logprobs.iter().map(|&x| f64::from(x)).collect();
        let mut seg = AgentSegment::new(turn, completion.tokens, completion.logprobs);
        // Remote servers report no entropies: the segment then has none rather than zeros.
        if !completion.entropies.is_empty() {
            seg.entropy = Some(completion.entropies);
        }
        seg.weight_version = weight_version;
        if extras.forced.iter().any(|&f| f) {
            seg.forced = extras.forced;
        }
        if let Some(c) = extras.confidences {
            seg.top_confidence = Some(c);
        } else if completion.top_logprobs.iter().any(|t| !t.is_empty()) {
            // C_t = −(1/j) Σ log p^(i) (spec §6.2; larger = more peaked).
            seg.top_confidence = Some(
                completion
                    .top_logprobs
                    .iter()
                    .map(|t| {
                        if t.is_empty() {
                            0.0
                        } else {
                            -t.iter().map(|(_, lp)| lp).sum::<f32>() / t.len() as f32
                        }
                    })
                    .collect(),
            );
        }
        l.traj.segments.push(Segment::Agent(seg));
        let step = l
            .env
            .step(&text)
            .with_context(|| format!("environment step of {}", l.spec.id))?;
        l.env_return += step.reward;
        l.won |= step.info.won;
        let stepped = record_step(&step, turn, &mut l.state);
        if let Some(ans) = stepped.answer {
            l.answer = Some(ans);
        }
        let observation = stepped.observation;
        l.traj.turns.push(stepped.record);
        l.turn_texts.push((text, observation.clone()));
        if step.done {
            l.traj.finish = if step.info.truncated {
                FinishReason::TurnLimit
            } else {
                FinishReason::Answered
            };
            l.done = true;
            return Ok(());
        }
        // A turn cut by the model's position limit ends the trajectory before its observation:
        // nothing may be appended past the positions the model has.
        if context_full {
            l.traj.finish = FinishReason::Length;
            l.done = true;
            return Ok(());
        }
        if let Some(obs) = observation {
            let mut ids = policy
                .tokenizer
                .encode(&obs)
                .context("encoding an observation")?;
            // Room left in the response budget and in the model's positions (one kept for the
            // next turn's first token).
            let positions_left = policy
                .model
                .config()
                .max_position_embeddings
                .saturating_sub(l.spec.prompt_ids.len() + l.response.len() + 1);
            let room = decoding
                .max_response_tokens
                .saturating_sub(l.response.len() + 1)
                .min(positions_left);
            ids.truncate(room);
            let start = l.response.len();
            l.response.extend_from_slice(&ids);
            l.obs_spans.push(start..l.response.len());
            l.traj.segments.push(Segment::Env(EnvSegment { ids }));
        }
        // Out of response room (a turn cut by the length limit, or an observation that filled
        // the budget): the trajectory ends here.
        let positions_used = l.spec.prompt_ids.len() + l.response.len();
        if l.response.len() + 1 >= decoding.max_response_tokens
            || positions_used + 1 >= policy.model.config().max_position_embeddings
        {
            l.traj.finish = FinishReason::Length;
            l.done = true;
        }
        Ok(())
    }

    /// A copy of this episode for a tree fork, with a fresh environment replaying its turns.
    pub fn fork(&self, policy: &Policy<'_>, env: Box<dyn Environment>) -> Result<Self> {
        let _ = policy;
        let mut env = env;
        env.reset(&self.live.spec.task)
            .context("resetting a forked environment")?;
        for (text, _) in &self.live.turn_texts {
            env.step(text).context("replaying a forked environment")?;
        }
        Ok(Self {
            live: Live {
                spec: self.live.spec.clone(),
                env,
                response: self.live.response.clone(),
                traj: self.live.traj.clone(),
                turn_texts: self.live.turn_texts.clone(),
                env_return: self.live.env_return,
                won: self.live.won,
                answer: self.live.answer.clone(),
                obs_spans: self.live.obs_spans.clone(),
                done: self.live.done,
                agent_end: self.live.agent_end,
                last_logprobs: self.live.last_logprobs.clone(),
                turn_starts: self.live.turn_starts.clone(),
                turn_control: self.live.turn_control.clone(),
                state: self.live.state.clone(),
                kv: self.live.kv.clone(),
            },
        })
    }

    /// The finished episode.
    pub fn finish(self) -> Episode {
        let l = self.live;
        Episode {
            trajectory: l.traj,
            turn_texts: l.turn_texts,
            env_return: l.env_return,
            won: l.won,
            answer: l.answer,
            observation_spans: l.obs_spans,
            turn_control: l.turn_control,
        }
    }
}

/// Text whose appearance ends a turn's reasoning span (spec §6.2: the intervention acts "only
/// while inside the reasoning span"): the end of thinking, or an action tag of any format (a turn
/// that starts acting without closing its thinking is no longer reasoning, so nothing is forced
/// into its action).
pub const REASONING_END_MARKERS: &[&str] = &["</think>", "<search>", "<answer>", "<action>"];

/// The T2PO rollout control of a run (spec §6.2, §6.3, §1.3), resolved from `[rollout]` by
/// [`RolloutControl::from_config`]. The default switches everything off, which samples exactly
/// as [`run_chains`] does.
///
/// - **Thinking intervention (TTI, §6.2).** Each turn is decoded through a [`TokenHook`]. For every
///   sampled token the hook feeds the entropy and top-j confidence the sampler reports for the
///   token's distribution (temperature-scaled, before top-k/top-p) to the core's
///   [`TtiController`], which computes `M_t` with a causal running min/max over the turn and
///   applies the stop rule (`t > L_min` and the mean of the last `N + 1` variations `< ε`, or
///   `t ≥ L_max`) once per turn, only while the reasoning span is open. Token positions `t` count
///   the turn's sampled tokens from 1 (the opening `<think>` is `t = 1`). The span closes when
///   the turn's text contains one of [`REASONING_END_MARKERS`]. When the rule fires at `t*`, the
///   forced queue (`forced_ids`) is emitted from `t* + 1` on, one token per step, with the logits
///   overwritten so the forced token has probability 1 (its recorded log-prob and entropy are 0).
///   Forced tokens are flagged in the trajectory ([`AgentSegment::forced`]) and get loss mask 0
///   unless `rollout.train_on_forced`.
/// - **Turn-level resampling (TDS, §6.3).** After a turn is generated (before the environment
///   sees it), its score `Φ` is the floored geometric mean of `M_t` over the turn's sampled tokens
///   (forced tokens excluded), with `H_t` and `C_t` normalised by a running min/max carried
///   across the episode's kept turns ([`TdsTracker::score`]; TTI's own `M_t` keeps its per-turn
///   min/max), and the core's [`TdsTracker`] compares it with the previous turn's final score of
///   the same episode (`Γ¹ = ∞`). Flagged turns are regenerated from the same context, all
///   flagged rows of the batch at once, with a fresh seed per attempt ([`attempt_seed`]), until
///   `Γ ≥ η` or `tds.max_try` regenerations; when the budget runs out the last attempt is kept.
/// - **Memory window P (§1.3, §6.3).** Each turn is generated from the prompt plus the last P turns
///   (agent tokens and the observation after each) instead of the whole history.
///
/// **What the training rows contain.** With `optim.samples = "trajectory"` the trainer builds one
/// row per trajectory: the prompt, then the whole response (every kept turn and observation,
/// TITO, spec §1.1), with loss mask 1 on sampled agent tokens (0 on observations and, by default,
/// on forced tokens); discarded TDS attempts never reach a row. A turn is then trained conditioned
/// on the full history, so a memory window that drops turns (`rollout/memory_truncated_turns`)
/// would train on another context than it sampled from: config validation refuses that
/// combination. With `optim.samples = "step"` (the gigpo and t2po presets, verl-agent's step
/// samples) each turn is its own row whose prompt is exactly the windowed context it was
/// generated from (`update::Row::step_samples`), so the recomputed π_θold is the sampling
/// distribution.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RolloutControl {
    /// Thinking-intervention settings (`tti.enabled` switches it on).
    pub tti: TtiSettings,
    /// The forced queue as token ids (empty when TTI is off).
    pub forced_ids: Vec<u32>,
    /// Turn-level resampling settings (`tds.enabled` switches it on).
    pub tds: TdsSettings,
    /// Memory window P (`None`: full history).
    pub memory_window: Option<usize>,
}

impl RolloutControl {
    /// Resolves `cfg.tti`, `cfg.tds` and `cfg.memory_window` for agent format `format`,
    /// tokenising the forced queue with `tokenizer`.
    pub fn from_config(
        cfg: &RolloutConfig,
        format: AgentFormatName,
        tokenizer: &TextTokenizer,
    ) -> Result<Self> {
        let tti = cfg.tti.to_settings(format, cfg.train_on_forced);
        tti.validate().map_err(|e| anyhow!("rollout.tti: {e}"))?;
        let tds = cfg.tds.to_settings();
        tds.validate().map_err(|e| anyhow!("rollout.tds: {e}"))?;
        let forced_ids = if tti.enabled {
            encode_forced_queue(tokenizer, &tti.forced_queue)?
        } else {
            Vec::new()
        };
        Ok(Self {
            tti,
            forced_ids,
            tds,
            memory_window: cfg.memory_window,
        })
    }

    /// Whether turns need the per-token signal `M_t` (TTI or TDS on).
    pub fn needs_signal(&self) -> bool {
        self.tti.enabled || self.tds.enabled
    }
}

/// Token ids of a forced text queue: each entry is encoded on its own and the ids concatenated;
/// entries that encode to no token (e.g. `"\n"` with a word-level tokenizer) are skipped. The first
/// entry (the end of thinking) must encode to at least one token, and no entry may encode to the
/// unknown token.
pub fn encode_forced_queue(tokenizer: &TextTokenizer, queue: &[String]) -> Result<Vec<u32>> {
    let unk = tokenizer.token_to_id(turnwise_model::tokenizer::UNK);
    let mut ids = Vec::new();
    for (i, text) in queue.iter().enumerate() {
        let enc = tokenizer
            .encode(text)
            .with_context(|| format!("encoding rollout.tti.forced_queue[{i}] = {text:?}"))?;
        if i == 0 && enc.is_empty() {
            bail!(
                "rollout.tti.forced_queue[0] = {text:?} encodes to no token; the queue must start \
                 with the end-of-thinking text"
            );
        }
        if unk.is_some_and(|u| enc.contains(&u)) {
            bail!(
                "rollout.tti.forced_queue[{i}] = {text:?} is not in the tokenizer's vocabulary \
                 (it encodes to the unknown token)"
            );
        }
        ids.extend(enc);
    }
    if ids.is_empty() {
        bail!("rollout.tti.forced_queue is empty");
    }
    Ok(ids)
}

/// The seed of TDS attempt `attempt` of a turn whose first attempt uses `base` (attempt 0 is
/// `base` itself, so a run without regeneration samples as before).
pub fn attempt_seed(base: u64, attempt: usize) -> u64 {
    if attempt == 0 {
        base
    } else {
        turn_seed(base ^ 0x7464_735f_7265_6765, attempt)
    }
}

/// What the rollout control did in one turn (one entry per turn of an [`Episode`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TurnControl {
    /// Tokens of the context the turn was generated from (prompt included).
    pub context_tokens: usize,
    /// Whether the memory window dropped earlier turns from that context.
    pub memory_truncated: bool,
    /// TTI trigger position `t*` (1-based over the turn's sampled tokens), if the rule fired.
    pub tti_trigger: Option<usize>,
    /// Tokens forced in the turn.
    pub forced_tokens: usize,
    /// TDS turn score `Φ` of the kept attempt (TDS on).
    pub turn_score: Option<f64>,
    /// TDS gap `Γ` of the turn's first attempt (TDS on, from the episode's second turn on).
    pub first_gap: Option<f64>,
    /// TDS gap `Γ` of the kept attempt (TDS on, from the episode's second turn on).
    pub kept_gap: Option<f64>,
    /// TDS regenerations before the kept attempt.
    pub regenerations: usize,
    /// The weight version a remote server generated the turn with (`None`: local, or the
    /// server did not say).
    pub weight_version: Option<u64>,
    /// Optimizer steps between those weights and the trainer's (remote turns).
    pub staleness: Option<u64>,
}

/// Per-token extras of a generated turn, for [`EpisodeState::apply_turn_with`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TurnExtras {
    /// Per token: forced by the thinking intervention (empty: none).
    pub forced: Vec<bool>,
    /// Per token: top-j confidence `C_t` (spec §6.2), when computed.
    pub confidences: Option<Vec<f32>>,
    /// The turn's control record.
    pub control: TurnControl,
}

/// Rollout-control totals of one batch of chains (the step's `rollout/*` metrics).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RolloutStats {
    /// Kept turns.
    pub turns: usize,
    /// Kept turns in which the thinking intervention fired.
    pub tti_triggered: usize,
    /// Forced tokens in kept turns.
    pub forced_tokens: usize,
    /// TDS regenerations, all turns together.
    pub tds_regenerations: usize,
    /// Kept turns regenerated at least once.
    pub tds_regenerated_turns: usize,
    /// Most regenerations of a single turn (never above the budget).
    pub tds_max_regenerations: usize,
    /// Tokens generated in discarded TDS attempts.
    pub tds_discarded_tokens: usize,
    /// Per eligible turn (one with a previous turn, so a finite `Γ`): `Γ` of its first attempt.
    pub tds_first_gaps: Vec<f64>,
    /// Per eligible turn: `Γ` of its kept attempt.
    pub tds_kept_gaps: Vec<f64>,
    /// Eligible turns accepted on their first draw (`Γ ≥ η` at once).
    pub tds_accepted_first: usize,
    /// Eligible turns regenerated `tds.max_try` times (the budget spent; the last draw kept).
    pub tds_budget_exhausted: usize,
    /// Turns whose context the memory window truncated.
    pub memory_truncated_turns: usize,
    /// Context tokens, all kept turns together.
    pub context_tokens: usize,
    /// Turns generated by remote servers that reported their weight version.
    pub versioned_turns: usize,
    /// Staleness (optimizer steps), those turns together.
    pub staleness_sum: u64,
    /// Largest staleness of a turn.
    pub staleness_max: u64,
    /// Context tokens whose keys and values came from a cache (the episode's last turn, or
    /// its group's shared prompt) instead of a prefill, all turns together.
    pub cached_context_tokens: usize,
}

impl RolloutStats {
    fn record(&mut self, c: &TurnControl) {
        self.turns += 1;
        self.tti_triggered += usize::from(c.tti_trigger.is_some());
        self.forced_tokens += c.forced_tokens;
        self.tds_regenerations += c.regenerations;
        self.tds_regenerated_turns += usize::from(c.regenerations > 0);
        self.tds_max_regenerations = self.tds_max_regenerations.max(c.regenerations);
        if let (Some(first), Some(kept)) = (c.first_gap, c.kept_gap) {
            self.tds_first_gaps.push(first);
            self.tds_kept_gaps.push(kept);
            self.tds_accepted_first += usize::from(c.regenerations == 0);
        }
        self.memory_truncated_turns += usize::from(c.memory_truncated);
        self.context_tokens += c.context_tokens;
        if let Some(st) = c.staleness {
            self.versioned_turns += 1;
            self.staleness_sum += st;
            self.staleness_max = self.staleness_max.max(st);
        }
    }

    /// Adds the totals of another batch (DAPO refill rounds of one step).
    pub fn merge(&mut self, other: &Self) {
        let Self {
            turns,
            tti_triggered,
            forced_tokens,
            tds_regenerations,
            tds_regenerated_turns,
            tds_max_regenerations,
            tds_discarded_tokens,
            tds_first_gaps,
            tds_kept_gaps,
            tds_accepted_first,
            tds_budget_exhausted,
            memory_truncated_turns,
            context_tokens,
            versioned_turns,
            staleness_sum,
            staleness_max,
            cached_context_tokens,
        } = other;
        self.turns += turns;
        self.tti_triggered += tti_triggered;
        self.forced_tokens += forced_tokens;
        self.tds_regenerations += tds_regenerations;
        self.tds_regenerated_turns += tds_regenerated_turns;
        self.tds_max_regenerations = self.tds_max_regenerations.max(*tds_max_regenerations);
        self.tds_discarded_tokens += tds_discarded_tokens;
        self.tds_first_gaps.extend_from_slice(tds_first_gaps);
        self.tds_kept_gaps.extend_from_slice(tds_kept_gaps);
        self.tds_accepted_first += tds_accepted_first;
        self.tds_budget_exhausted += tds_budget_exhausted;
        self.memory_truncated_turns += memory_truncated_turns;
        self.context_tokens += context_tokens;
        self.versioned_turns += versioned_turns;
        self.staleness_sum += staleness_sum;
        self.staleness_max = self.staleness_max.max(*staleness_max);
        self.cached_context_tokens += cached_context_tokens;
    }

    /// The `rollout/*` metrics of the controls that are on (none when all are off).
    ///
    /// TDS (spec §6.3), besides the regeneration counts: over the eligible turns (every turn
    /// but an episode's first, whose `Γ = ∞`), `rollout/tds_eligible_turns`; the 10 %, 50 % and
    /// 90 % quantiles of the first attempt's `Γ` (`rollout/tds_gap_p10`, `_p50`, `_p90`: the
    /// distribution η is calibrated against) and the median `Γ` of the kept attempts
    /// (`rollout/tds_kept_gap_p50`: above the first attempts' when TDS selects); the share
    /// accepted on the first draw (`rollout/tds_accepted_first_share`) and the share that spent
    /// the whole budget (`rollout/tds_budget_exhausted_share`). The quantiles are absent in a
    /// step without an eligible turn.
    pub fn metrics(&self, control: &RolloutControl) -> BTreeMap<String, f64> {
        let mut m = BTreeMap::new();
        let turns = self.turns.max(1) as f64;
        if control.tti.enabled {
            m.insert(mk::rollout::TTI_TRIGGERED.into(), self.tti_triggered as f64);
            m.insert(
                mk::rollout::TTI_TRIGGER_RATE.into(),
                self.tti_triggered as f64 / turns,
            );
            m.insert(mk::rollout::FORCED_TOKENS.into(), self.forced_tokens as f64);
        }
        if control.tds.enabled {
            m.insert(
                mk::rollout::TDS_REGENERATIONS.into(),
                self.tds_regenerations as f64,
            );
            m.insert(
                mk::rollout::TDS_REGENERATIONS_PER_TURN.into(),
                self.tds_regenerations as f64 / turns,
            );
            m.insert(
                mk::rollout::TDS_REGENERATED_TURNS.into(),
                self.tds_regenerated_turns as f64,
            );
            m.insert(
                mk::rollout::TDS_MAX_REGENERATIONS.into(),
                self.tds_max_regenerations as f64,
            );
            m.insert(
                mk::rollout::TDS_DISCARDED_TOKENS.into(),
                self.tds_discarded_tokens as f64,
            );
            let eligible = self.tds_first_gaps.len();
            m.insert(mk::rollout::TDS_ELIGIBLE_TURNS.into(), eligible as f64);
            if eligible > 0 {
                let share = |n: usize| n as f64 / eligible as f64;
                m.insert(
                    mk::rollout::TDS_ACCEPTED_FIRST_SHARE.into(),
                    share(self.tds_accepted_first),
                );
                m.insert(
                    mk::rollout::TDS_BUDGET_EXHAUSTED_SHARE.into(),
                    share(self.tds_budget_exhausted),
                );
                let sorted = |v: &[f64]| {
                    let mut v = v.to_vec();
                    v.sort_by(f64::total_cmp);
                    v
                };
                let first = sorted(&self.tds_first_gaps);
                for (key, q) in [
                    (mk::rollout::TDS_GAP_P10, 0.1),
                    (mk::rollout::TDS_GAP_P50, 0.5),
                    (mk::rollout::TDS_GAP_P90, 0.9),
                ] {
                    m.insert(key.into(), quantile(&first, q));
                }
                m.insert(
                    mk::rollout::TDS_KEPT_GAP_P50.into(),
                    quantile(&sorted(&self.tds_kept_gaps), 0.5),
                );
            }
        }
        if control.memory_window.is_some() {
            m.insert(
                mk::rollout::MEMORY_TRUNCATED_TURNS.into(),
                self.memory_truncated_turns as f64,
            );
            m.insert(
                mk::rollout::CONTEXT_TOKENS_MEAN.into(),
                self.context_tokens as f64 / turns,
            );
        }
        if self.cached_context_tokens > 0 {
            m.insert(
                mk::rollout::CACHED_CONTEXT_FRACTION.into(),
                self.cached_context_tokens as f64 / self.context_tokens.max(1) as f64,
            );
        }
        if self.versioned_turns > 0 {
            m.insert(
                mk::rollout::WEIGHT_STALENESS_MEAN.into(),
                self.staleness_sum as f64 / self.versioned_turns as f64,
            );
            m.insert(
                mk::rollout::WEIGHT_STALENESS_MAX.into(),
                self.staleness_max as f64,
            );
        }
        m
    }
}

/// Per-row state of a controlled generation: the turn's TTI controller and whether the
/// reasoning span is open. (TDS scores a turn afterwards, from its recorded entropies and
/// confidences, [`TdsTracker::score`].)
struct TurnMonitor {
    controller: TtiController,
    /// Turn tokens already looked at.
    seen: usize,
    span_open: bool,
}

impl TurnMonitor {
    fn new(control: &RolloutControl) -> Result<Self> {
        let controller = TtiController::new(control.tti.clone(), control.forced_ids.clone())
            .map_err(|e| anyhow!("rollout.tti: {e}"))?;
        Ok(Self {
            controller,
            seen: 0,
            span_open: control.tti.enabled,
        })
    }

    /// Looks at the turn tokens of `seq` not seen yet: closes the reasoning span at an end
    /// marker, then feeds each sampled token's entropy and confidence to the controller (forced
    /// tokens are not observed, spec §6.2 Alg. 1).
    fn observe_new(
        &mut self,
        seq: &Sequence,
        tokenizer: &TextTokenizer,
        marker_window: usize,
    ) -> Result<()> {
        let start = seq.turn_start;
        let n = seq.tokens.len().saturating_sub(start);
        while self.seen < n {
            let k = start + self.seen;
            self.seen += 1;
            if self.span_open {
                let from = (k + 1).saturating_sub(marker_window).max(start);
                let text = tokenizer
                    .decode(&seq.tokens[from..=k], false)
                    .context("decoding the reasoning span")?;
                if REASONING_END_MARKERS.iter().any(|m| text.contains(m)) {
                    self.span_open = false;
                    self.controller.end_reasoning();
                }
            }
            if seq.origins[k] == TokenOrigin::Sampled {
                self.controller
                    .observe(f64::from(seq.entropies[k]), f64::from(seq.confidences[k]));
            }
        }
        Ok(())
    }

    /// The turn ended: its last tokens still add to `M_t` but can trigger nothing.
    fn finish(&mut self, seq: &Sequence, tokenizer: &TextTokenizer) -> Result<()> {
        self.span_open = false;
        self.controller.end_reasoning();
        self.observe_new(seq, tokenizer, 0)
    }
}

/// The [`TokenHook`] of a controlled generation: row `i` is the engine's sequence `SeqId(i)`.
struct ControlHook<'a> {
    rows: Vec<TurnMonitor>,
    tokenizer: &'a TextTokenizer,
    /// Tokens decoded to look for an end marker (longest marker in bytes + 2: every token is at
    /// least one byte, plus a UTF-8 sequence split across tokens).
    marker_window: usize,
    /// The first error met inside the hook (reported after the run).
    error: Option<anyhow::Error>,
}

impl TokenHook for ControlHook<'_> {
    fn process(&mut self, seq: &Sequence, logits: &mut [f32]) -> Option<u32> {
        let row = self.rows.get_mut(usize::try_from(seq.id.0).ok()?)?;
        if let Err(e) = row.observe_new(seq, self.tokenizer, self.marker_window) {
            self.error.get_or_insert(e);
        }
        let tok = row.controller.next_forced()?;
        // p(forced) = 1 (t2po.md eq. 5): the recorded log-prob and entropy are 0.
        if let Some(slot) = usize::try_from(tok).ok().filter(|&t| t < logits.len()) {
            logits.fill(f32::NEG_INFINITY);
            logits[slot] = 0.0;
        }
        Some(tok)
    }
}

/// One generated turn and what the control observed in it.
struct TurnOutput {
    completion: Completion,
    forced: Vec<bool>,
    confidences: Option<Vec<f32>>,
    score: Option<f64>,
    tti_trigger: Option<usize>,
    weight_version: Option<u64>,
    /// Keys and values of the turn's whole context (local sampling).
    kv: Option<PrefixKv>,
}

/// Samples one turn per context, context `i` at most `budgets[i]` tokens (its own budget: no
/// other row's limits it). Without TTI or TDS this is exactly
/// [`turnwise_model::sampling::generate_with_budgets`], starting each row from its cached
/// context (`prefixes`, [`generate_with_prefixes`]) and returning the turn's context cache;
/// otherwise the turns run on a [`SamplingEngine`] with the control hook (same seeds, same
/// draws until the intervention fires).
fn generate_turns(
    policy: &Policy<'_>,
    contexts: &[Vec<u32>],
    prefixes: &[Option<PrefixKv>],
    seeds: &[u64],
    params: &SamplingParams,
    budgets: &[usize],
    control: &RolloutControl,
) -> Result<Vec<TurnOutput>> {
    if budgets.len() != contexts.len() {
        bail!(
            "{} turn budgets for {} contexts",
            budgets.len(),
            contexts.len()
        );
    }
    if let Some(remote) = policy.remote {
        if control.needs_signal() {
            bail!("the thinking intervention and turn resampling need the local sampling engine");
        }
        let context_len = policy.model.config().max_position_embeddings;
        let turns = remote.generate(contexts, seeds, params, budgets, context_len)?;
        return Ok(turns
            .into_iter()
            .map(|t| TurnOutput {
                completion: t.completion,
                forced: Vec::new(),
                confidences: None,
                score: None,
                tti_trigger: None,
                weight_version: t.weight_version,
                kv: None,
            })
            .collect());
    }
    if !control.needs_signal() {
        let completions = generate_with_prefixes(
            policy.model,
            contexts,
            prefixes,
            seeds,
            params,
            budgets,
            Some(policy.tokenizer),
        )
        .context("sampling a turn")?;
        return Ok(completions
            .into_iter()
            .map(|(completion, kv)| TurnOutput {
                completion,
                forced: Vec::new(),
                confidences: None,
                score: None,
                tti_trigger: None,
                weight_version: None,
                kv,
            })
            .collect());
    }
    // As in `generate`: on the CPU the rows are cut into one shard per thread, each on its own
    // engine. One engine for all rows would split every decode op across the threads, and
    // lock-step threads stall whenever another process takes a core (a T2PO step's generation
    // took 8x longer beside another run). A row's draws depend on its own seed only, beyond
    // the rounding of batched matmuls.
    let shards = generation_shards(policy.model, contexts.len());
    sharded(contexts.len(), shards, |rows| {
        let ctx: Vec<Vec<u32>> = rows.iter().map(|&i| contexts[i].clone()).collect();
        let sd: Vec<u64> = rows.iter().map(|&i| seeds[i]).collect();
        let bd: Vec<usize> = rows.iter().map(|&i| budgets[i]).collect();
        let pre: Vec<Option<PrefixKv>> = rows.iter().map(|&i| prefixes[i].clone()).collect();
        signal_turns(
            policy.model,
            policy.tokenizer,
            &ctx,
            &pre,
            &sd,
            params,
            &bd,
            control,
        )
    })
}

/// [`generate_turns`] under TTI or TDS on one [`SamplingEngine`]: every row's turn (row `i` at
/// most `budgets[i]` tokens) with the control hook, its confidences and its turn score.
#[allow(clippy::too_many_arguments)]
fn signal_turns(
    model: &Transformer,
    tokenizer: &TextTokenizer,
    contexts: &[Vec<u32>],
    prefixes: &[Option<PrefixKv>],
    seeds: &[u64],
    params: &SamplingParams,
    budgets: &[usize],
    control: &RolloutControl,
) -> Result<Vec<TurnOutput>> {
    let mut engine =
        SamplingEngine::new(model, Some(tokenizer), EngineConfig::with_max_batch_size(0));
    let seq_params = SequenceParams {
        sampling: params.clone(),
        max_generated_tokens: None,
        max_len: None,
        confidence_top_j: control.tti.top_j,
        guided_choice: None,
        single_turn: false,
    };
    let mut ids = Vec::with_capacity(contexts.len());
    let mut rows = Vec::with_capacity(contexts.len());
    for (i, (ctx, &seed)) in contexts.iter().zip(seeds).enumerate() {
        let mut sp = seq_params.clone();
        sp.sampling.max_new_tokens = sp.sampling.max_new_tokens.min(budgets[i]);
        let id = engine
            .add_sequence_with_prefix(ctx.clone(), sp, seed, prefixes[i].as_ref())
            .context("queueing a turn")?;
        if id != SeqId(i as u64) {
            bail!("the sampling engine numbered turn {i} as {id}");
        }
        ids.push(id);
        rows.push(TurnMonitor::new(control)?);
    }
    let marker_window = REASONING_END_MARKERS
        .iter()
        .map(|m| m.len())
        .max()
        .unwrap_or(0)
        + 2;
    let mut hook = ControlHook {
        rows,
        tokenizer,
        marker_window,
        error: None,
    };
    engine
        .run_until_stop(Some(&mut hook))
        .context("sampling a turn")?;
    if let Some(e) = hook.error.take() {
        return Err(e.context("thinking intervention"));
    }
    let mut out = Vec::with_capacity(ids.len());
    for (id, mut row) in ids.into_iter().zip(hook.rows) {
        let kv = engine.prefix_of(id);
        let seq = engine.remove(id).context("collecting a turn")?;
        row.finish(&seq, tokenizer)?;
        let start = seq.prompt_len;
        let finish = match &seq.status {
            SeqStatus::Paused(reason) => reason.finish_reason(),
            _ => StopReason::Length,
        };
        let forced: Vec<bool> = seq.origins[start..]
            .iter()
            .map(|o| *o == TokenOrigin::Forced)
            .collect();
        out.push(TurnOutput {
            completion: Completion {
                tokens: seq.tokens[start..].to_vec(),
                logprobs: seq.logprobs[start..].to_vec(),
                entropies: seq.entropies[start..].to_vec(),
                top_logprobs: seq.top_logprobs[start..].to_vec(),
                finish,
            },
            forced,
            confidences: Some(seq.confidences[start..].to_vec()),
            score: None,
            tti_trigger: row.controller.triggered_at(),
            weight_version: None,
            kv,
        });
    }
    Ok(out)
}

/// `(H_t, C_t)` of a turn's sampled tokens (forced tokens left out, spec §6.3), as the sampler
/// recorded them: TDS's input.
fn sampled_stats(out: &TurnOutput) -> impl Iterator<Item = (f64, f64)> + '_ {
    let conf = out.confidences.as_deref().unwrap_or(&[]);
    out.completion
        .entropies
        .iter()
        .zip(conf)
        .enumerate()
        .filter(|(k, _)| !out.forced.get(*k).copied().unwrap_or(false))
        .map(|(_, (&h, &c))| (f64::from(h), f64::from(c)))
}

/// Generates the next turn of every state in `states` that is not done, in one batch.
pub fn step_turn(
    policy: &Policy<'_>,
    states: &mut [&mut EpisodeState],
    decoding: &Decoding,
) -> Result<()> {
    step_turn_with(
        policy,
        states,
        decoding,
        &RolloutControl::default(),
        None,
        &mut RolloutStats::default(),
    )
}

/// [`step_turn`] under rollout control: windowed contexts, the thinking intervention, and TDS
/// regeneration of flagged turns before the environment sees them (`tds` tracks the previous
/// turn's final score per row of `states`; `None` disables TDS). Totals go to `stats`.
pub fn step_turn_with(
    policy: &Policy<'_>,
    states: &mut [&mut EpisodeState],
    decoding: &Decoding,
    control: &RolloutControl,
    tds: Option<&mut TdsTracker>,
    stats: &mut RolloutStats,
) -> Result<()> {
    let Some(batch) = TurnBatch::new(policy, states, decoding, control, stats)? else {
        return Ok(());
    };
    let mut outs = generate_turns(
        policy,
        &batch.contexts,
        &batch.prefixes,
        &batch.seeds,
        &batch.params,
        &batch.budgets,
        control,
    )?;
    let resampled = match tds.filter(|_| control.tds.enabled) {
        Some(tracker) => resample_flagged(
            policy,
            &batch,
            control,
            tracker,
            states.len(),
            &mut outs,
            stats,
        )?,
        None => TurnResampling::none(batch.active.len()),
    };
    apply_turns(policy, states, decoding, &batch, outs, &resampled, stats)
}

/// The generation inputs of one turn of the states that are not done ([`step_turn_with`]).
struct TurnBatch {
    /// Indices (into the states) of the states that are not done.
    active: Vec<usize>,
    /// Per active state: its context (windowed by the memory window).
    contexts: Vec<Vec<u32>>,
    /// Per active state: whether the memory window cut its context.
    truncated: Vec<bool>,
    /// Per active state: the turn's sampling seed.
    seeds: Vec<u64>,
    /// Per active state: the turn's token budget.
    budgets: Vec<usize>,
    /// The sampling parameters.
    params: SamplingParams,
    /// Per active state: its cached context (or a shared prompt's cache).
    prefixes: Vec<Option<PrefixKv>>,
}

impl TurnBatch {
    /// The inputs of the states of `states` that are not done (`None` when all are), taking
    /// each one's cached context; the cached tokens go to `stats`.
    fn new(
        policy: &Policy<'_>,
        states: &mut [&mut EpisodeState],
        decoding: &Decoding,
        control: &RolloutControl,
        stats: &mut RolloutStats,
    ) -> Result<Option<Self>> {
        let active: Vec<usize> = (0..states.len())
            .filter(|&i| !states[i].is_done())
            .collect();
        if active.is_empty() {
            return Ok(None);
        }
        let (contexts, truncated): (Vec<Vec<u32>>, Vec<bool>) = active
            .iter()
            .map(|&i| states[i].context_window(control.memory_window))
            .unzip();
        let seeds: Vec<u64> = active
            .iter()
            .map(|&i| turn_seed(states[i].seed(), states[i].turns()))
            .collect();
        // Each episode's own budget: the turn limit, cut to the response room that episode has
        // left (another episode's length never cuts its turn).
        let budgets: Vec<usize> = active
            .iter()
            .map(|&i| {
                let room = decoding
                    .max_response_tokens
                    .saturating_sub(states[i].response_len())
                    .max(1);
                decoding.max_turn_tokens.min(room)
            })
            .collect();
        let params = SamplingParams {
            temperature: decoding.temperature,
            top_p: decoding.top_p,
            top_k: decoding.top_k,
            max_new_tokens: decoding.max_turn_tokens,
            stop_token_ids: policy.stop_ids.to_vec(),
            stop_strings: policy.stop_strings.to_vec(),
            top_logprobs: 0,
        };
        // Each episode's cached context: the turn prefills only what follows it (the
        // observation).
        let mut prefixes: Vec<Option<PrefixKv>> =
            active.iter().map(|&i| states[i].live.kv.take()).collect();
        if policy.remote.is_none() {
            share_prompts(policy, &contexts, &mut prefixes)?;
            for (ctx, p) in contexts.iter().zip(&prefixes) {
                if let Some(p) = p {
                    let common = ctx
                        .iter()
                        .zip(p.tokens())
                        .take_while(|(a, b)| a == b)
                        .count();
                    stats.cached_context_tokens += common.min(ctx.len() - 1);
                }
            }
        }
        Ok(Some(Self {
            active,
            contexts,
            truncated,
            seeds,
            budgets,
            params,
            prefixes,
        }))
    }
}

/// What TDS did to each active row's turn ([`step_turn_with`]).
struct TurnResampling {
    /// Regenerations of the turn.
    regenerations: Vec<usize>,
    /// The gap of the first attempt and of the kept one (finite ones only).
    gaps: Vec<(Option<f64>, Option<f64>)>,
}

impl TurnResampling {
    /// No TDS: no regeneration, no gaps, for `n` rows.
    fn none(n: usize) -> Self {
        Self {
            regenerations: vec![0usize; n],
            gaps: vec![(None, None); n],
        }
    }
}

/// TDS: scores each active row's turn `outs`, regenerates the turns `tracker` flags (fresh
/// attempt seeds) until none is flagged, and records the kept scores (`rows` is the number of
/// states). The discarded tokens and exhausted budgets go to `stats`.
fn resample_flagged(
    policy: &Policy<'_>,
    batch: &TurnBatch,
    control: &RolloutControl,
    tracker: &mut TdsTracker,
    rows: usize,
    outs: &mut [TurnOutput],
    stats: &mut RolloutStats,
) -> Result<TurnResampling> {
    let active = &batch.active;
    let TurnResampling {
        mut regenerations,
        mut gaps,
    } = TurnResampling::none(active.len());
    let tds_err = |e| anyhow!("turn-level resampling: {e}");
    let score = |tracker: &TdsTracker, row: usize, out: &TurnOutput| {
        tracker
            .score(row, sampled_stats(out))
            .map_err(|e| anyhow!("turn-level resampling: {e}"))
    };
    let mut attempts: Vec<Option<AttemptScore>> = active
        .iter()
        .zip(outs.iter())
        .map(|(&i, o)| score(tracker, i, o))
        .collect::<Result<_>>()?;
    let finite = |g: f64| Some(g).filter(|g| g.is_finite());
    for (j, &i) in active.iter().enumerate() {
        gaps[j].0 = attempts[j]
            .as_ref()
            .and_then(|a| finite(tracker.gap(i, a.phi)));
    }
    let scores = |attempts: &[Option<AttemptScore>]| {
        let mut v = vec![None; rows];
        for (j, &i) in active.iter().enumerate() {
            v[i] = attempts[j].as_ref().map(|a| a.phi);
        }
        v
    };
    let mut attempt = 0usize;
    loop {
        let flags = tracker.flag(&scores(&attempts)).map_err(tds_err)?;
        let redo: Vec<usize> = (0..active.len()).filter(|&j| flags[active[j]]).collect();
        if redo.is_empty() {
            break;
        }
        attempt += 1;
        let ctx: Vec<Vec<u32>> = redo.iter().map(|&j| batch.contexts[j].clone()).collect();
        let sd: Vec<u64> = redo
            .iter()
            .map(|&j| attempt_seed(batch.seeds[j], attempt))
            .collect();
        let bd: Vec<usize> = redo.iter().map(|&j| batch.budgets[j]).collect();
        let pre: Vec<Option<PrefixKv>> = redo.iter().map(|&j| batch.prefixes[j].clone()).collect();
        let fresh = generate_turns(policy, &ctx, &pre, &sd, &batch.params, &bd, control)?;
        for (&j, o) in redo.iter().zip(fresh) {
            stats.tds_discarded_tokens += outs[j].completion.tokens.len();
            attempts[j] = score(tracker, active[j], &o)?;
            outs[j] = o;
            regenerations[j] += 1;
        }
        tracker.record_attempt(&flags);
    }
    for (j, &i) in active.iter().enumerate() {
        outs[j].score = attempts[j].as_ref().map(|a| a.phi);
        gaps[j].1 = attempts[j]
            .as_ref()
            .and_then(|a| finite(tracker.gap(i, a.phi)));
        if gaps[j].0.is_some() && gaps[j].1.is_some() && control.tds.max_try > 0 {
            stats.tds_budget_exhausted += usize::from(regenerations[j] == control.tds.max_try);
        }
    }
    let mut kept = vec![None; rows];
    for (j, &i) in active.iter().enumerate() {
        kept[i] = attempts[j].take();
    }
    tracker.finish_turn(&kept).map_err(tds_err)?;
    Ok(TurnResampling {
        regenerations,
        gaps,
    })
}

/// Applies each active row's turn `outs` to its state (with what the rollout control did,
/// also recorded in `stats`), keeping its cache for the next turn unless it is done.
fn apply_turns(
    policy: &Policy<'_>,
    states: &mut [&mut EpisodeState],
    decoding: &Decoding,
    batch: &TurnBatch,
    outs: Vec<TurnOutput>,
    resampled: &TurnResampling,
    stats: &mut RolloutStats,
) -> Result<()> {
    let (active, gaps) = (&batch.active, &resampled.gaps);
    for (j, out) in outs.into_iter().enumerate() {
        let record = TurnControl {
            context_tokens: batch.contexts[j].len(),
            memory_truncated: batch.truncated[j],
            tti_trigger: out.tti_trigger,
            forced_tokens: out.forced.iter().filter(|&&f| f).count(),
            turn_score: out.score,
            first_gap: gaps[j].0,
            kept_gap: gaps[j].1,
            regenerations: resampled.regenerations[j],
            weight_version: out.weight_version,
            staleness: out.weight_version.map(|v| policy.version.saturating_sub(v)),
        };
        stats.record(&record);
        let kv = out.kv;
        states[active[j]].apply_turn_with(
            policy,
            out.completion,
            decoding,
            TurnExtras {
                forced: out.forced,
                confidences: out.confidences,
                control: record,
            },
        )?;
        let st = &mut states[active[j]];
        st.live.kv = kv.filter(|_| !st.is_done());
    }
    Ok(())
}

/// A group's episodes start from the same context (their prompt): the rows without a cache
/// whose context another such row shares get one cache of it, prefilled once, so each row
/// prefills only the context's last token.
fn share_prompts(
    policy: &Policy<'_>,
    contexts: &[Vec<u32>],
    prefixes: &mut [Option<PrefixKv>],
) -> Result<()> {
    let mut rows: BTreeMap<&[u32], Vec<usize>> = BTreeMap::new();
    for (j, ctx) in contexts.iter().enumerate() {
        if prefixes[j].is_none() && ctx.len() > 1 {
            rows.entry(ctx.as_slice()).or_default().push(j);
        }
    }
    for (ctx, js) in rows.into_iter().filter(|(_, js)| js.len() > 1) {
        let kv = prefill_prefix(policy.model, &ctx[..ctx.len() - 1])
            .context("prefilling a shared prompt")?;
        for j in js {
            prefixes[j] = kv.clone();
        }
    }
    Ok(())
}

/// Rolls out every episode of `specs` to the end, all live episodes batched at each turn.
/// `make_env` builds a fresh environment per episode.
pub fn run_chains(
    policy: &Policy<'_>,
    specs: Vec<EpisodeSpec>,
    make_env: &dyn Fn() -> Result<Box<dyn Environment>>,
    decoding: &Decoding,
) -> Result<Vec<Episode>> {
    Ok(run_chains_with(
        policy,
        specs,
        make_env,
        decoding,
        &RolloutControl::default(),
    )?
    .episodes)
}

/// The result of [`run_chains_with`].
#[derive(Debug, Clone)]
pub struct ChainRollout {
    /// Finished episodes, in the order of the specs.
    pub episodes: Vec<Episode>,
    /// Rollout-control totals (see [`RolloutStats::metrics`]).
    pub stats: RolloutStats,
}

/// [`run_chains`] under the T2PO rollout control `control` (see [`RolloutControl`]).
pub fn run_chains_with(
    policy: &Policy<'_>,
    specs: Vec<EpisodeSpec>,
    make_env: &dyn Fn() -> Result<Box<dyn Environment>>,
    decoding: &Decoding,
    control: &RolloutControl,
) -> Result<ChainRollout> {
    let mut states: Vec<EpisodeState> = specs
        .into_iter()
        .map(|s| EpisodeState::start(s, make_env()?))
        .collect::<Result<_>>()?;
    let mut tracker = TdsTracker::new(control.tds.clone(), control.tti.alpha, states.len());
    let mut stats = RolloutStats::default();
    while states.iter().any(|s| !s.is_done()) {
        let mut refs: Vec<&mut EpisodeState> = states.iter_mut().collect();
        step_turn_with(
            policy,
            &mut refs,
            decoding,
            control,
            Some(&mut tracker),
            &mut stats,
        )?;
    }
    Ok(ChainRollout {
        episodes: states.into_iter().map(EpisodeState::finish).collect(),
        stats,
    })
}

/// An episode's turns as the rewards read them: each agent turn's generated text and the
/// observation after it. Never the prompt; rewards take answers and format verdicts from the
/// agent's text only ([`turnwise_core::reward::agent`]).
pub fn reward_turns(ep: &Episode) -> Vec<turnwise_core::reward::TurnText<'_>> {
    ep.turn_texts
        .iter()
        .map(|(g, o)| turnwise_core::reward::TurnText {
            generated: g,
            observation: o.as_deref(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use turnwise_model::tokenizer::DEFAULT_SPECIAL_TOKENS;

    /// Spec §6.2 worked example: per-token H and C.
    const H: [f64; 8] = [1.2, 2.0, 1.6, 1.7, 1.65, 1.66, 1.66, 1.67];
    const C: [f64; 8] = [5.0, 3.0, 4.0, 3.8, 3.9, 3.88, 3.87, 3.87];

    fn tokenizer() -> TextTokenizer {
        let corpus = ["alpha beta gamma delta <action> </action>"];
        let mut specials: Vec<&str> = DEFAULT_SPECIAL_TOKENS.to_vec();
        specials.extend(["<action>", "</action>"]);
        TextTokenizer::train_word_level(&corpus, 64, &specials).unwrap()
    }

    fn sequence(prompt: Vec<u32>) -> Sequence {
        let n = prompt.len();
        Sequence {
            id: SeqId(0),
            tokens: prompt,
            origins: vec![TokenOrigin::Prompt; n],
            logprobs: vec![0.0; n],
            entropies: vec![0.0; n],
            confidences: vec![0.0; n],
            top_logprobs: vec![Vec::new(); n],
            prompt_len: n,
            turn_start: n,
            turns: 1,
            status: SeqStatus::Running,
            params: SequenceParams::default(),
        }
    }

    fn push(seq: &mut Sequence, token: u32, origin: TokenOrigin, h: f64, c: f64) {
        seq.tokens.push(token);
        seq.origins.push(origin);
        seq.logprobs.push(0.0);
        seq.entropies.push(h as f32);
        seq.confidences.push(c as f32);
        seq.top_logprobs.push(Vec::new());
    }

    fn control(tok: &TextTokenizer, tti: TtiSettings) -> RolloutControl {
        let forced_ids = encode_forced_queue(tok, &tti.forced_queue).unwrap();
        RolloutControl {
            tti,
            forced_ids,
            ..RolloutControl::default()
        }
    }

    /// Drives the hook like the engine does: before each step the hook sees the sequence so far;
    /// a forced token is appended as forced, otherwise `sample(step)` gives the token and its
    /// (H, C). Returns the turn's tokens and origins.
    fn drive(
        tok: &TextTokenizer,
        control: &RolloutControl,
        steps: usize,
        sample: impl Fn(usize) -> (u32, f64, f64),
    ) -> (Sequence, TurnMonitor) {
        let mut hook = ControlHook {
            rows: vec![TurnMonitor::new(control).unwrap()],
            tokenizer: tok,
            marker_window: 12,
            error: None,
        };
        let vocab = tok.vocab_size();
        let mut seq = sequence(vec![tok.token_to_id("<|im_end|>").unwrap()]);
        let mut sampled = 0;
        for _ in 0..steps {
            let mut logits = vec![0.5f32; vocab];
            match hook.process(&seq, &mut logits) {
                Some(t) => {
                    // The forced token has probability 1.
                    assert_eq!(logits[t as usize], 0.0);
                    assert_eq!(
                        logits.iter().filter(|z| z.is_finite()).count(),
                        1,
                        "one-hot logits"
                    );
                    push(&mut seq, t, TokenOrigin::Forced, 0.0, 0.0);
                }
                None => {
                    assert!(logits.iter().all(|&z| z == 0.5), "logits untouched");
                    let (t, h, c) = sample(sampled);
                    sampled += 1;
                    push(&mut seq, t, TokenOrigin::Sampled, h, c);
                }
            }
        }
        assert!(hook.error.is_none());
        let mut row = hook.rows.pop().unwrap();
        row.finish(&seq, tok).unwrap();
        (seq, row)
    }

    fn example_settings() -> TtiSettings {
        TtiSettings {
            enabled: true,
            alpha: 0.4,
            window: 2,
            epsilon: 0.05,
            min_len: 3,
            max_len: None,
            forced_queue: vec!["</think>".into(), "\n".into(), "<action>".into()],
            ..TtiSettings::default()
        }
    }

    #[test]
    fn hook_reproduces_the_spec_6_2_worked_example() {
        let tok = tokenizer();
        let ctl = control(&tok, example_settings());
        let think = tok.token_to_id("<think>").unwrap();
        let word = tok.token_to_id("alpha").unwrap();
        // "\n" encodes to nothing with a word-level tokenizer: the queue is </think> <action>.
        let end = tok.token_to_id("</think>").unwrap();
        let action = tok.token_to_id("<action>").unwrap();
        assert_eq!(ctl.forced_ids, vec![end, action]);
        let (seq, row) = drive(&tok, &ctl, 12, |i| {
            let t = if i == 0 { think } else { word };
            (t, H[i % 8], C[i % 8])
        });
        let turn = &seq.tokens[seq.turn_start..];
        let origins = &seq.origins[seq.turn_start..];
        // t* = 7: tokens 1..=7 sampled, 8 and 9 forced (</think>, <action>), then sampling resumes.
        assert_eq!(row.controller.triggered_at(), Some(7));
        assert_eq!(&turn[7..9], &[end, action]);
        let forced: Vec<usize> = (0..turn.len())
            .filter(|&k| origins[k] == TokenOrigin::Forced)
            .collect();
        assert_eq!(forced, vec![7, 8]);
        // The M_t values of this spec vector are checked in turnwise-core's tti tests; TDS
        // scores turns from the recorded entropies and confidences (TdsTracker::score).
        assert_eq!(row.seen, 12);
    }

    #[test]
    fn no_forcing_after_the_model_closes_its_thinking_or_when_disabled() {
        let tok = tokenizer();
        let think = tok.token_to_id("<think>").unwrap();
        let end = tok.token_to_id("</think>").unwrap();
        let word = tok.token_to_id("beta").unwrap();
        // The budget L_max = 4 would fire at t = 4, but the model wrote </think> at t = 3.
        let budget = TtiSettings {
            min_len: 100,
            max_len: Some(4),
            ..example_settings()
        };
        let ctl = control(&tok, budget.clone());
        let (seq, row) = drive(&tok, &ctl, 10, |i| match i {
            0 => (think, 1.0, 1.0),
            2 => (end, 1.0, 1.0),
            _ => (word, 1.0 + i as f64, 1.0),
        });
        assert!(seq.origins.iter().all(|o| *o != TokenOrigin::Forced));
        assert_eq!(row.controller.triggered_at(), None);
        // A turn that starts acting (<action>) has no reasoning span left to cut.
        let action = tok.token_to_id("<action>").unwrap();
        let (seq, _) = drive(&tok, &ctl, 10, |i| match i {
            0 => (action, 1.0, 1.0),
            _ => (word, 1.0 + i as f64, 1.0),
        });
        assert!(seq.origins.iter().all(|o| *o != TokenOrigin::Forced));
        // Without the closing tag the budget fires at t = 4: tokens 5, 6 are forced.
        let (seq, row) = drive(&tok, &ctl, 10, |i| (word, 1.0 + i as f64, 1.0));
        assert_eq!(row.controller.triggered_at(), Some(4));
        let turn_origins = &seq.origins[seq.turn_start..];
        assert_eq!(turn_origins[4], TokenOrigin::Forced);
        assert_eq!(turn_origins[5], TokenOrigin::Forced);
        assert_eq!(
            turn_origins
                .iter()
                .filter(|o| **o == TokenOrigin::Forced)
                .count(),
            2,
            "one-time activation"
        );
        // Disabled: nothing is forced.
        let off = RolloutControl {
            tti: TtiSettings {
                enabled: false,
                ..budget
            },
            ..RolloutControl::default()
        };
        let (seq, row) = drive(&tok, &off, 10, |i| (word, 1.0 + i as f64, 1.0));
        assert!(seq.origins.iter().all(|o| *o != TokenOrigin::Forced));
        assert_eq!(row.controller.triggered_at(), None);
    }

    #[test]
    fn forced_queue_encoding() {
        let tok = tokenizer();
        let end = tok.token_to_id("</think>").unwrap();
        assert_eq!(
            encode_forced_queue(&tok, &["</think>".into(), "\n".into()]).unwrap(),
            vec![end]
        );
        let e = encode_forced_queue(&tok, &["\n".into(), "</think>".into()]).unwrap_err();
        assert!(e.to_string().contains("forced_queue[0]"), "{e}");
        let e = encode_forced_queue(&tok, &["</think>".into(), "zebra".into()]).unwrap_err();
        assert!(e.to_string().contains("unknown token"), "{e}");
        assert!(encode_forced_queue(&tok, &[]).is_err());
    }

    #[test]
    fn attempt_zero_keeps_the_turn_seed() {
        assert_eq!(attempt_seed(42, 0), 42);
        assert_ne!(attempt_seed(42, 1), 42);
        assert_ne!(attempt_seed(42, 1), attempt_seed(42, 2));
    }

    #[test]
    fn stats_metrics_only_for_enabled_controls() {
        let mut s = RolloutStats::default();
        s.record(&TurnControl {
            context_tokens: 10,
            memory_truncated: true,
            tti_trigger: Some(3),
            forced_tokens: 2,
            turn_score: Some(0.5),
            regenerations: 2,
            ..TurnControl::default()
        });
        s.record(&TurnControl::default());
        assert!(s.metrics(&RolloutControl::default()).is_empty());
        let on = RolloutControl {
            tti: TtiSettings {
                enabled: true,
                ..TtiSettings::default()
            },
            tds: TdsSettings {
                enabled: true,
                ..TdsSettings::default()
            },
            memory_window: Some(1),
            forced_ids: vec![1],
        };
        let m = s.metrics(&on);
        assert_eq!(m["rollout/tti_triggered"], 1.0);
        assert_eq!(m["rollout/tti_trigger_rate"], 0.5);
        assert_eq!(m["rollout/forced_tokens"], 2.0);
        assert_eq!(m["rollout/tds_regenerations"], 2.0);
        assert_eq!(m["rollout/tds_max_regenerations"], 2.0);
        assert_eq!(m["rollout/tds_regenerated_turns"], 1.0);
        assert_eq!(m["rollout/memory_truncated_turns"], 1.0);
        assert_eq!(m["rollout/context_tokens/mean"], 5.0);
    }
}
