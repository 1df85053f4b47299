//! Rollouts: the policy acts in the environment turn by turn and every token is recorded as it
//! was sampled (token-in-token-out, spec §1.1).
//!
//! - [`run_chains`]: independent chains, batched across every live episode at each turn;
//! - [`tree`]: AT2PO entropy-guided and Tree-GRPO random tree rollouts (§6.1);
//! - [`info_gain`]: the IGPO / A2TGPO probes (§4), one batched teacher-forced pass.

pub mod info_gain;
pub mod tree;

use anyhow::{Context, Result};
use turnwise_core::trajectory::{
    AgentSegment, EnvSegment, FinishReason, Segment, Trajectory, TurnAction, TurnRecord,
};
use turnwise_env::env::{Environment, Task};
use turnwise_model::Transformer;
use turnwise_model::sampling::{FinishReason as StopReason, SamplingParams, generate};
use turnwise_model::tokenizer::TextTokenizer;

/// What the rollout engine needs of the policy.
pub struct Policy<'a> {
    /// Detached weights (no autograd graph) that see the latest optimizer step.
    pub model: &'a Transformer,
    /// Its tokenizer.
    pub tokenizer: &'a TextTokenizer,
    /// Tokens that end a turn.
    pub stop_ids: &'a [u32],
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
}

impl Episode {
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
}

/// A per-turn seed derived from the episode seed (splitmix64 of seed and turn).
pub fn turn_seed(seed: u64, turn: usize) -> u64 {
    let mut z = seed ^ (turn as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A live episode in the middle of a rollout: used by chains and by tree forks.
pub struct EpisodeState {
    live: Live,
}

impl EpisodeState {
    /// Resets `env` for `spec` and returns the episode at its first turn.
    pub fn start(spec: EpisodeSpec, mut env: Box<dyn Environment>) -> Result<Self> {
        env.reset(&spec.task)
            .with_context(|| format!("resetting the environment for {}", spec.task.id))?;
        let traj = Trajectory {
            id: spec.id.clone(),
            prompt_uid: spec.prompt_uid.clone(),
            prompt_ids: spec.prompt_ids.clone(),
            segments: Vec::new(),
            turns: Vec::new(),
            finish: FinishReason::Answered,
            outcome_reward: None,
            turn_rewards: Vec::new(),
        };
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
        let l = &mut self.live;
        let turn = l.traj.turns.len();
        let text = policy
            .tokenizer
            .decode(&completion.tokens, false)
            .context("decoding a turn")?;
        let context_full = completion.finish == StopReason::ContextFull;
        l.response.extend_from_slice(&completion.tokens);
        l.agent_end = l.response.len();
        l.last_logprobs = completion.logprobs.iter().map(|&x| f64::from(x)).collect();
        let mut seg = AgentSegment::new(turn, completion.tokens, completion.logprobs);
        seg.entropy = Some(completion.entropies);
        if completion.top_logprobs.iter().any(|t| !t.is_empty()) {
            seg.top_confidence = Some(
                completion
                    .top_logprobs
                    .iter()
                    .map(|t| {
                        if t.is_empty() {
                            0.0
                        } else {
                            t.iter().map(|(_, lp)| lp).sum::<f32>() / t.len() as f32
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
        let action = match (&step.info.action, &step.info.query) {
            (Some(a), _) if a == "answer" => {
                let ans = step
                    .info
                    .extra
                    .get("answer")
                    .and_then(|v| v.as_str())
                    .unwrap_or_default()
                    .to_string();
                l.answer = Some(ans.clone());
                TurnAction::Answer { text: ans }
            }
            (_, Some(q)) => TurnAction::Search { query: q.clone() },
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
        l.traj.turns.push(TurnRecord {
            index: turn,
            action,
            format_ok: step.info.format_ok,
            observation: step.info.retrieved.clone().or(observation.clone()),
            searches_so_far: step.info.searches_so_far,
            env_reward: Some(step.reward),
            anchor: Some(step.observation.text.clone()),
        });
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
        if let Some(obs) = observation {
            let mut ids = policy
                .tokenizer
                .encode(&obs)
                .context("encoding an observation")?;
            let room = decoding
                .max_response_tokens
                .saturating_sub(l.response.len() + 1);
            ids.truncate(room);
            let start = l.response.len();
            l.response.extend_from_slice(&ids);
            l.obs_spans.push(start..l.response.len());
            l.traj.segments.push(Segment::Env(EnvSegment { ids }));
        }
        // Out of response room (a turn cut by the length limit, or an observation that filled
        // the budget): the trajectory ends here.
        if context_full || l.response.len() + 1 >= decoding.max_response_tokens {
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
        }
    }
}

/// Generates the next turn of every state in `states` that is not done, in one batch.
pub fn step_turn(
    policy: &Policy<'_>,
    states: &mut [&mut EpisodeState],
    decoding: &Decoding,
) -> Result<()> {
    let active: Vec<usize> = (0..states.len())
        .filter(|&i| !states[i].is_done())
        .collect();
    if active.is_empty() {
        return Ok(());
    }
    let contexts: Vec<Vec<u32>> = active.iter().map(|&i| states[i].context()).collect();
    let seeds: Vec<u64> = active
        .iter()
        .map(|&i| turn_seed(states[i].seed(), states[i].turns()))
        .collect();
    // One budget for the batch: the turn limit, cut to the smallest remaining response room.
    let room = active
        .iter()
        .map(|&i| {
            decoding
                .max_response_tokens
                .saturating_sub(states[i].response_len())
        })
        .min()
        .unwrap_or(0)
        .max(1);
    let params = SamplingParams {
        temperature: decoding.temperature,
        top_p: decoding.top_p,
        top_k: decoding.top_k,
        max_new_tokens: decoding.max_turn_tokens.min(room),
        stop_token_ids: policy.stop_ids.to_vec(),
        stop_strings: Vec::new(),
        top_logprobs: 0,
    };
    let completions =
        generate(policy.model, &contexts, &seeds, &params, None).context("sampling a turn")?;
    for (&i, c) in active.iter().zip(completions) {
        states[i].apply_turn(policy, c, decoding)?;
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
    let mut states: Vec<EpisodeState> = specs
        .into_iter()
        .map(|s| EpisodeState::start(s, make_env()?))
        .collect::<Result<_>>()?;
    while states.iter().any(|s| !s.is_done()) {
        let mut refs: Vec<&mut EpisodeState> = states.iter_mut().collect();
        step_turn(policy, &mut refs, decoding)?;
    }
    Ok(states.into_iter().map(EpisodeState::finish).collect())
}
