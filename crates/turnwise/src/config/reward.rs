//! The reward stage beyond the reward itself (`[reward]`, a `turnwise-core` type, named by
//! `name`): DAPO's overlong shaping (`[overlong_buffer]`) and the LLM judge (`[judge]`), with
//! their checks.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use turnwise_core::reward::RewardConfig;
use turnwise_env::judge::JudgeMode;

use super::{ConfigError, TrainConfig};

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
/// scores of the intermediate turns replace the verifiable R^I_k of `reward = "mt_ppo_turn"`
/// (the same rubric, computed by rules). The outcome reward R^F (the last turn's reward and the
/// rollout's score) stays the rules' verifiable one, as in the paper's setup (spec §2.4); EM
/// and format metrics come from the rules too. Before RL the judge is calibrated against the
/// rules on held-out turns (`judge.calibration_questions`, `judge.min_rubric_agreement`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JudgeSettings {
    /// Turn the judge on.
    pub enabled: bool,
    /// A model to serve as the judge inside the run (`turnwise serve` on a free loopback
    /// port): a packaged model's name (`smollm2-135m-instruct`, the offline default), a GGUF
    /// file or a Hugging Face folder. Absent: ask `base_url`.
    pub serve: Option<String>,
    /// Base URL of the OpenAI-compatible API (`.../v1`) when `serve` is absent. Empty (as
    /// preset mt-ppo-judge ships it): no judge is named, and the run refuses to start until
    /// this names a server (`turnwise serve`, vLLM, any OpenAI-compatible endpoint) or
    /// `serve` names a model.
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
    /// `<score>` block parsed) or `"choice"` (one request per intermediate turn: the model
    /// continues a prefilled score block with one of the rubric's scores for that turn, vLLM's
    /// `guided_choice` with `continue_final_message`; every verdict parses, which a small judge
    /// needs; the endpoint must support those extensions, as vLLM and `turnwise serve` do).
    pub mode: JudgeMode,
    /// The judge's calibration before RL: the starting policy (after the warm start) rolls
    /// out this many validation questions (one rollout each, at `rollout.temperature`), and
    /// the judge and the rules score every intermediate turn of those rollouts. Default 32;
    /// 0 skips the calibration, which `min_rubric_agreement = 0` must then allow.
    pub calibration_questions: usize,
    /// The least agreement with the rules the judge must reach in its calibration before RL,
    /// in 0 to 1 (default 0.5): agreement is the share of the calibration rollouts'
    /// intermediate turns whose judge score equals the rules' R^I_k (to 1e-6; a turn of a
    /// rollout the judge could not score counts as disagreeing). Below it the run stops before
    /// RL with an error naming the judge, its agreement and this floor. 0 never stops (the
    /// calibration is still logged); a calibration with no intermediate turn stops a run whose
    /// floor is above 0.
    pub min_rubric_agreement: f64,
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
            calibration_questions: 32,
            min_rubric_agreement: 0.5,
        }
    }
}

impl OverlongBufferConfig {
    /// Checks the penalty and the buffer's length against `max_response_tokens` when the
    /// shaping is on.
    pub(super) fn validate(&self, max_response_tokens: usize) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        if self.enable {
            if !(self.penalty_factor >= 0.0 && self.penalty_factor.is_finite()) {
                return bad(
                    "overlong_buffer.penalty_factor",
                    format!("must be a non-negative number, got {}", self.penalty_factor),
                );
            }
            let len = self.to_core(max_response_tokens).buffer_len;
            if len == 0 || len > max_response_tokens {
                return bad(
                    "overlong_buffer.len",
                    format!(
                        "must be in 1..=rollout.max_response_tokens ({}), got {len}",
                        max_response_tokens
                    ),
                );
            }
        }
        Ok(())
    }
}

impl JudgeSettings {
    /// Checks the judge's settings when it is on: the reward it scores for, its endpoint, and
    /// its request limits.
    pub(super) fn validate(&self, reward: &RewardConfig) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        let j = self;
        if !j.enabled {
            return Ok(());
        }
        Self::validate_judge_reward(reward)?;
        if j.serve.is_none()
            && !j.base_url.is_empty()
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
        if !(0.0..=1.0).contains(&j.min_rubric_agreement) {
            return bad(
                "judge.min_rubric_agreement",
                format!("must be in [0, 1], got {}", j.min_rubric_agreement),
            );
        }
        if j.calibration_questions == 0 && j.min_rubric_agreement > 0.0 {
            return bad(
                "judge.calibration_questions",
                format!(
                    "0 skips the judge's calibration, but judge.min_rubric_agreement = {} needs \
                     it: give a number of validation questions, or set \
                     judge.min_rubric_agreement = 0 to train without the check",
                    j.min_rubric_agreement
                ),
            );
        }
        Ok(())
    }

    /// Checks that the judge is named when it is on: `judge.serve` (a model served inside the
    /// run) or a non-empty `judge.base_url`. Made when the run starts (its preflight and the
    /// trainer), not when the config resolves, so that `turnwise config` can still show a
    /// preset that ships without a judge.
    pub fn require_endpoint(&self) -> Result<(), ConfigError> {
        if self.enabled && self.serve.is_none() && self.base_url.is_empty() {
            return Err(ConfigError::Invalid {
                field: "judge.base_url",
                message: "is not set, and judge.serve is not either: this run's LLM judge has no \
                     endpoint. Serve a judge model behind an OpenAI-compatible API (e.g. \
                     `turnwise serve --model DIR --addr 127.0.0.1:8000 --name judge`, or vLLM's \
                     `vllm serve MODEL --port 8000`) and set judge.base_url = \
                     \"http://HOST:8000/v1\" and judge.model = its served name \
                     (judge.mode = \"choice\" needs vLLM's guided_choice, which both have); or set judge.serve = MODEL to serve one \
                     inside the run. Before RL the judge must agree with the rules on at least \
                     judge.min_rubric_agreement of held-out intermediate turns"
                    .into(),
            });
        }
        Ok(())
    }

    /// The judge scores turns with MT-PPO's rubric, so it needs a reward whose turns it can
    /// rescore ([`RewardConfig::turns_judgeable`]).
    fn validate_judge_reward(reward: &RewardConfig) -> Result<(), ConfigError> {
        if !reward.turns_judgeable() {
            return Err(ConfigError::Invalid {
                field: "judge.enabled",
                message: format!(
                    "the judge scores turns with MT-PPO's rubric: it needs a reward with MT-PPO's \
                     turn rewards (reward = \"mt_ppo_turn\"), not {:?}",
                    reward.name()
                ),
            });
        }
        Ok(())
    }
}

impl TrainConfig {
    /// Checks `[reward]`'s own settings and that it reads the agent format of `task.format`.
    pub(super) fn validate_reward(&self) -> Result<(), ConfigError> {
        self.reward.validate().map_err(|e| ConfigError::Invalid {
            field: "reward",
            message: e.to_string(),
        })?;
        let format = self.task.format.grammar();
        if !self.reward.reads_format(format) {
            return Err(ConfigError::Invalid {
                field: "reward",
                message: format!(
                    "the {} reward does not read the {format} agent format of task.format \
                     (boxed_em and deep_research_f1 need \"boxed\", search_r1_format and \
                     mt_ppo_turn \"search_r1\", t2po_em \"t2po\"; em, sub_em and f1 take \
                     reward.format)",
                    self.reward.name()
                ),
            });
        }
        Ok(())
    }
}
