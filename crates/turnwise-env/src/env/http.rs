//! [`HttpEnv`]: an [`Environment`] whose episodes run on a remote server (WebShop, ALFWorld or any
//! environment wrapped in a small HTTP service).
//!
//! # Protocol (JSON over HTTP POST)
//!
//! Every request carries a `session` string chosen by the client (unique per [`HttpEnv`]), so
//! one server can host many concurrent episodes.
//!
//! `POST {base}/reset` with [`ResetRequest`]
//! `{"session": "…", "task": {"id": "…", "seed": 0, "prompt": "…", "answers": [], "params": {}}}`
//! (fields of [`Task`]; empty ones omitted) → [`ResetResponse`] `{"observation": "text"}`.
//!
//! `POST {base}/step` with [`StepRequest`] `{"session": "…", "action": "raw policy text"}` →
//! [`StepResponse`] `{"observation": "text", "reward": 0.0, "done": false, "info": {…}}`.
//! `info` is optional; its keys are those of [`StepInfo`] (all optional; `valid_action` and
//! `format_ok` default to `true`), unknown keys land in [`StepInfo::extra`].
//!
//! Errors are any non-2xx status; a JSON body `{"error": {"message": "…"}}` or `{"detail": …}`
//! is quoted in the resulting [`EnvError::Remote`].
//!
//! Retries: `reset` is retried on any transient failure (repeating a reset is harmless);
//! `step` changes server state, so it is retried only when the connection could not be made.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use super::{EnvError, Environment, Observation, StepInfo, StepResult, Task};
use crate::client::{ClientConfig, Idempotency, error_chain, join_url, post_json};

/// Body of `POST /reset`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResetRequest {
    /// Client-chosen episode session id.
    pub session: String,
    /// The task to start.
    pub task: Task,
}

/// Answer of `POST /reset`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResetResponse {
    /// The first observation text.
    pub observation: String,
}

/// Body of `POST /step`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRequest {
    /// Client-chosen episode session id (as given to `/reset`).
    pub session: String,
    /// The policy's raw turn text.
    pub action: String,
}

/// Answer of `POST /step`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepResponse {
    /// The next observation text.
    pub observation: String,
    /// The step's reward.
    pub reward: f64,
    /// Whether the episode is over.
    pub done: bool,
    /// Side information (optional in the JSON).
    #[serde(default)]
    pub info: StepInfo,
}

/// State of the current episode on the client side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Fresh,
    Running,
    Done,
}

/// An [`Environment`] served over HTTP (see the module docs for the protocol).
#[derive(Debug)]
pub struct HttpEnv {
    base_url: String,
    session: String,
    config: ClientConfig,
    client: reqwest::blocking::Client,
    phase: Phase,
}

impl HttpEnv {
    /// An adapter for the environment server at `base_url` with default timeouts and retries.
    pub fn new(base_url: &str) -> Result<Self, EnvError> {
        Self::with_config(base_url, ClientConfig::default())
    }

    /// An adapter for the environment server at `base_url` with the given timeouts and retries.
    pub fn with_config(base_url: &str, config: ClientConfig) -> Result<Self, EnvError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let remote = |message: String| EnvError::Remote {
            url: base_url.to_owned(),
            message,
        };
        if !(base_url.starts_with("http://") || base_url.starts_with("https://")) {
            return Err(remote(
                "base URL must start with http:// or https://".into(),
            ));
        }
        let client = config
            .build_client()
            .map_err(|e| remote(format!("cannot build HTTP client: {}", error_chain(&e))))?;
        let nonce = crate::client::random_nonce();
        let session = format!(
            "tw-{}-{}-{nonce:08x}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        Ok(Self {
            base_url: base_url.trim_end_matches('/').to_owned(),
            session,
            config,
            client,
            phase: Phase::Fresh,
        })
    }

    /// The session id sent with every request.
    pub fn session(&self) -> &str {
        &self.session
    }

    /// The server's base URL.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    fn post<T: Serialize, R: for<'de> Deserialize<'de>>(
        &self,
        path: &str,
        body: &T,
        idempotency: Idempotency,
        expected: &str,
    ) -> Result<R, EnvError> {
        let url = join_url(&self.base_url, path);
        let remote = |message: String| EnvError::Remote {
            url: url.clone(),
            message,
        };
        let body = serde_json::to_value(body)
            .map_err(|e| remote(format!("cannot encode request: {e}")))?;
        let value = post_json(
            &self.client,
            &url,
            &body,
            &[],
            &self.config.retry,
            idempotency,
        )
        .map_err(|f| remote(f.message))?;
        serde_json::from_value(value)
            .map_err(|e| remote(format!("malformed answer, expected {expected}: {e}")))
    }
}

impl Environment for HttpEnv {
    fn reset(&mut self, task: &Task) -> Result<Observation, EnvError> {
        self.phase = Phase::Fresh;
        let request = ResetRequest {
            session: self.session.clone(),
            task: task.clone(),
        };
        let answer: ResetResponse = self.post(
            "reset",
            &request,
            Idempotency::Idempotent,
            r#"{"observation": string}"#,
        )?;
        self.phase = Phase::Running;
        Ok(Observation::new(answer.observation))
    }

    fn step(&mut self, action_text: &str) -> Result<StepResult, EnvError> {
        match self.phase {
            Phase::Fresh => {
                return Err(EnvError::NotReset {
                    env: format!("HttpEnv({})", self.base_url),
                });
            }
            Phase::Done => {
                return Err(EnvError::EpisodeOver {
                    env: format!("HttpEnv({})", self.base_url),
                });
            }
            Phase::Running => {}
        }
        let request = StepRequest {
            session: self.session.clone(),
            action: action_text.to_owned(),
        };
        let answer: StepResponse = self.post(
            "step",
            &request,
            Idempotency::ConnectOnly,
            r#"{"observation": string, "reward": number, "done": bool, "info"?: object}"#,
        )?;
        if answer.done {
            self.phase = Phase::Done;
        }
        Ok(StepResult {
            observation: Observation::new(answer.observation),
            reward: answer.reward,
            done: answer.done,
            info: answer.info,
        })
    }
}
