//! The environment interface the trainer drives: a gym-like [`Environment`] trait with text
//! observations and text actions, and [`HttpEnv`], an adapter for environments served over HTTP.
//!
//! One episode is `reset(task)` followed by `step(action_text)` calls until
//! [`StepResult::done`]. `action_text` is the raw text the policy generated for the turn; the
//! environment parses it (tags, action words) and reports in [`StepInfo`] whether it was valid.
//!
//! Observations describe the state only (no step counter, no feedback about the previous
//! action), so revisiting a state yields the identical string: GiGPO's anchor-state grouping
//! (spec §3.7) groups steps by that string. Feedback goes to [`StepInfo`] instead.

mod http;
pub mod openenv;
mod search;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

pub use http::{HttpEnv, ResetRequest, ResetResponse, StepRequest, StepResponse};
pub use openenv::{OpenEnvEnv, OpenEnvSettings};
pub use search::{ROUTINE_TURNS_PARAM, SearchEnv, SearchEnvConfig};

/// What one episode is about: its id, a seed for generated content, and task data.
///
/// Games read only `seed` (and optional `params`); question-answering environments read
/// `prompt` and `answers`. Serialized as-is to HTTP environments.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Task {
    /// Task id (e.g. the prompt uid of a rollout group).
    pub id: String,
    /// Seed of anything generated for the episode (game maps).
    #[serde(default)]
    pub seed: u64,
    /// Task text (a question), if the environment needs one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// Golden answers, if any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub answers: Vec<String>,
    /// Environment-specific settings (e.g. `{"size": 6}`).
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub params: Map<String, Value>,
}

impl Task {
    /// A task with only an id and a seed (what the games need).
    pub fn with_seed(id: impl Into<String>, seed: u64) -> Self {
        Self {
            id: id.into(),
            seed,
            ..Self::default()
        }
    }
}

/// What the agent sees.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Observation {
    /// The observation text; identical for identical states.
    pub text: String,
}

impl Observation {
    /// An observation with this text.
    pub fn new(text: impl Into<String>) -> Self {
        Self { text: text.into() }
    }
}

/// Side information about one step, for rewards, penalties and diagnostics.
///
/// The default is a valid, well-formatted action with nothing else to report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepInfo {
    /// Whether the action could be parsed and applied. An invalid action leaves the state
    /// unchanged; the trainer applies the invalid-action penalty (spec §2.6, λ = 0.1).
    #[serde(default = "default_true")]
    pub valid_action: bool,
    /// Whether the output passed the strict format check (e.g. T2PO's
    /// `<think>…</think><action>…</action>`); a valid action can still be badly formatted.
    #[serde(default = "default_true")]
    pub format_ok: bool,
    /// Name of the tool the action called (e.g. `"search"`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_called: Option<String>,
    /// The parsed action (a move, an answer), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
    /// The search query, if the action was a search.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query: Option<String>,
    /// The retrieved text shown to the agent, if the action was a search.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retrieved: Option<String>,
    /// Number of searches in this episode so far, this step included.
    #[serde(default)]
    pub searches_so_far: usize,
    /// Whether the episode ended in success (game solved, answer correct).
    #[serde(default)]
    pub won: bool,
    /// Whether the episode was cut by the step limit rather than ended by the task.
    #[serde(default)]
    pub truncated: bool,
    /// Human-readable feedback about the step (why an action was invalid, what happened).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feedback: Option<String>,
    /// Any other environment-specific fields.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

fn default_true() -> bool {
    true
}

impl Default for StepInfo {
    fn default() -> Self {
        Self {
            valid_action: true,
            format_ok: true,
            tool_called: None,
            action: None,
            query: None,
            retrieved: None,
            searches_so_far: 0,
            won: false,
            truncated: false,
            feedback: None,
            extra: Map::new(),
        }
    }
}

/// The outcome of one [`Environment::step`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepResult {
    /// The observation after the step.
    pub observation: Observation,
    /// The step's reward.
    pub reward: f64,
    /// Whether the episode is over (success, failure or step limit).
    pub done: bool,
    /// Side information.
    pub info: StepInfo,
}

/// Error of an environment.
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    /// `step` was called before `reset`.
    #[error("{env}: step called before reset")]
    NotReset {
        /// Environment name.
        env: String,
    },
    /// `step` was called after the episode ended.
    #[error("{env}: step called after the episode ended (call reset)")]
    EpisodeOver {
        /// Environment name.
        env: String,
    },
    /// The task is unusable for this environment.
    #[error("{env}: bad task field {field}: {message}")]
    BadTask {
        /// Environment name.
        env: String,
        /// The offending task field (e.g. `params.size`).
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// A tool the environment calls (e.g. the retriever) failed.
    #[error("{env}: tool {tool} failed: {message}")]
    Tool {
        /// Environment name.
        env: String,
        /// Tool name (e.g. `search`).
        tool: String,
        /// What went wrong.
        message: String,
    },
    /// A remote environment failed, timed out or answered malformed data.
    #[error("environment server {url}: {message}")]
    Remote {
        /// Endpoint URL.
        url: String,
        /// What went wrong.
        message: String,
    },
}

/// A gym-like text environment: reset with a task, then step with the policy's raw text.
pub trait Environment: Send {
    /// Starts a new episode for `task` and returns the first observation.
    fn reset(&mut self, task: &Task) -> Result<Observation, EnvError>;

    /// Applies the policy's turn text and returns the next observation, reward and status.
    fn step(&mut self, action_text: &str) -> Result<StepResult, EnvError>;
}

impl<E: Environment + ?Sized> Environment for Box<E> {
    fn reset(&mut self, task: &Task) -> Result<Observation, EnvError> {
        (**self).reset(task)
    }

    fn step(&mut self, action_text: &str) -> Result<StepResult, EnvError> {
        (**self).step(action_text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_info_tolerates_partial_json_and_keeps_extra_fields() {
        let info: StepInfo = serde_json::from_str(r#"{"won": true, "task_score": 0.5}"#).unwrap();
        assert!(info.valid_action && info.format_ok && info.won);
        let default = StepInfo::default();
        assert!(default.valid_action && default.format_ok && !default.won);
        assert_eq!(info.extra["task_score"], 0.5);
        let back = serde_json::to_value(&info).unwrap();
        assert_eq!(back["task_score"], 0.5);
    }

    #[test]
    fn task_round_trips() {
        let mut task = Task::with_seed("t1", 9);
        task.params.insert("size".into(), 6.into());
        let text = serde_json::to_string(&task).unwrap();
        assert_eq!(serde_json::from_str::<Task>(&text).unwrap(), task);
        let minimal: Task = serde_json::from_str(r#"{"id": "x"}"#).unwrap();
        assert_eq!(minimal.seed, 0);
    }
}
