//! `[task.openenv]`: the settings of an OpenEnv environment server as a task
//! ([`crate::task::openenv`] plays its episodes).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use turnwise_env::env::OpenEnvSettings;
use turnwise_env::env::openenv::{
    ActionText, OBSERVATION_PLACEHOLDER, OpenEnvTimeouts, default_observation_template,
};
use turnwise_env::world::Split;

use super::{ConfigError, TaskConfig, TaskEnv};

/// What of an agent turn is sent as the action (`task.openenv.send`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpenEnvSend {
    /// The content of the turn's action per the agent format: the `<action>…</action>` block
    /// (T2PO), the `<search>` query or the `<answer>` text (Search-R1, boxed, verifiers). A turn
    /// without one is an invalid action: it is not sent, the agent sees the last observation
    /// again, and the turn earns no reward.
    #[default]
    Action,
    /// The whole turn text, as generated (for servers that parse it themselves, such as
    /// `turnwise serve-env`).
    Text,
}

/// `[task.openenv]`: the OpenEnv server `task.env = "openenv"` plays on, and how its episodes,
/// actions and observations map onto turnwise's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OpenEnvConfig {
    /// The server's base URL (`http://127.0.0.1:8000`). Checked with `GET /health` when the
    /// task is built (before a run directory is touched); episodes run over its WebSocket
    /// session `/ws` (OpenEnv 0.3's HTTP `/reset` and `/step` are stateless).
    pub url: String,
    /// The action field the agent's text goes into (the server's action model, e.g.
    /// `message`).
    pub action_field: String,
    /// The observation fields the agent reads: one is shown as its text, several as
    /// `field: text` lines. Empty (the default): the observation's only field.
    pub observation_fields: Vec<String>,
    /// Reset keyword arguments sent with every reset (e.g. `{ difficulty = "easy" }`).
    pub reset: Map<String, Value>,
    /// The reset keyword argument that carries the episode's seed (`""`: none is sent, for
    /// servers whose reset takes no seed; their reset must then always start the same
    /// episode).
    pub seed_field: String,
    /// What of a turn is sent: `action` (the action block's content) or `text` (the whole turn).
    pub send: OpenEnvSend,
    /// How an observation appears in the agent's context, with `{observation}` where its text
    /// goes. Unset: the agent format's block (`\n\n<information>{observation}</information>\n\n`
    /// for `search_r1` and `t2po`, ` <result>\n{observation}\n</result>` for `boxed` and
    /// `verifiers`).
    pub observation_template: Option<String>,
    /// Text put before each episode's first observation in its question (the task's rules and
    /// the action format, for the prompt).
    pub instructions: String,
    /// Seed of the first training episode; the validation and test seeds follow the training
    /// ones ([`OpenEnvConfig::episode_seed`]).
    pub seed: u64,
    /// Training episodes (RL prompts).
    pub train: usize,
    /// Held-out validation episodes.
    pub validation: usize,
    /// Held-out test episodes.
    pub test: usize,
    /// An episode whose rewards sum to at least this is a success (the success rate of
    /// evaluation).
    pub success_reward: f64,
    /// Seconds one reset or step may take on the server before the episode fails.
    pub timeout_secs: f64,
    /// Seconds to connect (TCP and the WebSocket handshake) and to answer `/health`.
    pub connect_timeout_secs: f64,
}

impl Default for OpenEnvConfig {
    fn default() -> Self {
        Self {
            url: String::new(),
            action_field: "message".into(),
            observation_fields: Vec::new(),
            reset: Map::new(),
            seed_field: "seed".into(),
            send: OpenEnvSend::Action,
            observation_template: None,
            instructions: String::new(),
            seed: 0,
            train: 500,
            validation: 100,
            test: 100,
            success_reward: 1.0,
            timeout_secs: 60.0,
            connect_timeout_secs: 10.0,
        }
    }
}

impl OpenEnvConfig {
    /// The number of episodes of `split`.
    pub fn episodes(&self, split: Split) -> usize {
        match split {
            Split::Train => self.train,
            Split::Validation => self.validation,
            Split::Test => self.test,
        }
    }

    /// The reset seed of episode `j` of `split`: `seed + j` (training), `seed + train + j`
    /// (validation), `seed + train + validation + j` (test).
    pub fn episode_seed(&self, split: Split, j: usize) -> u64 {
        let before = match split {
            Split::Train => 0,
            Split::Validation => self.train,
            Split::Test => self.train + self.validation,
        };
        self.seed.wrapping_add((before + j) as u64)
    }

    /// Checks `[task.openenv]` against the rest of the task: set only with `task.env =
    /// "openenv"`, and then complete and consistent.
    pub fn validate(task: &TaskConfig, reward_is_em: bool) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        let o = &task.openenv;
        if task.env != TaskEnv::OpenEnv {
            if *o != Self::default() {
                return bad(
                    "task.openenv",
                    format!(
                        "is read only with task.env = \"openenv\", but task.env = \"{}\"",
                        task.env.name()
                    ),
                );
            }
            return Ok(());
        }
        if o.url.trim().is_empty() {
            return bad(
                "task.openenv.url",
                "task.env = \"openenv\" needs the server's URL, e.g. \"http://127.0.0.1:8000\""
                    .into(),
            );
        }
        if !(o.url.starts_with("http://") || o.url.starts_with("ws://")) {
            return bad(
                "task.openenv.url",
                format!(
                    "must start with http:// or ws:// (TLS is not supported), got {:?}",
                    o.url
                ),
            );
        }
        if o.action_field.trim().is_empty() {
            return bad(
                "task.openenv.action_field",
                "must name the server's action field (e.g. \"message\")".into(),
            );
        }
        if o.observation_fields.iter().any(|f| f.trim().is_empty()) {
            return bad(
                "task.openenv.observation_fields",
                "has an empty field name".into(),
            );
        }
        if !o.seed_field.is_empty() && o.reset.contains_key(&o.seed_field) {
            return bad(
                "task.openenv.reset",
                format!(
                    "sets {:?}, which task.openenv.seed_field sends per episode; remove it or \
                     set seed_field = \"\"",
                    o.seed_field
                ),
            );
        }
        if let Some(t) = &o.observation_template
            && !t.contains(OBSERVATION_PLACEHOLDER)
        {
            return bad(
                "task.openenv.observation_template",
                format!("must contain {OBSERVATION_PLACEHOLDER} where the observation goes"),
            );
        }
        if o.train == 0 {
            return bad("task.openenv.train", "must be at least 1".into());
        }
        if !o.success_reward.is_finite() {
            return bad("task.openenv.success_reward", "must be finite".into());
        }
        for (field, v) in [
            ("task.openenv.timeout_secs", o.timeout_secs),
            ("task.openenv.connect_timeout_secs", o.connect_timeout_secs),
        ] {
            if Duration::try_from_secs_f64(v).map_or(true, |d| d.is_zero()) {
                return bad(
                    field,
                    format!("must be a positive number of seconds, got {v}"),
                );
            }
        }
        if task.search_r1.is_some() || task.wiki.is_some() {
            return bad(
                if task.wiki.is_some() {
                    "task.wiki"
                } else {
                    "task.search_r1"
                },
                "task.env = \"openenv\" takes its episodes from the server; leave task.wiki and \
                 task.search_r1 unset"
                    .into(),
            );
        }
        if task.rl_subject_fraction > 0.0 {
            return bad(
                "task.rl_subject_fraction",
                "applies to the search world only, not to task.env = \"openenv\"".into(),
            );
        }
        if !reward_is_em {
            return bad(
                "reward.name",
                "an OpenEnv episode's reward is its return (the sum of the server's rewards): \
                 with task.env = \"openenv\" set reward.name = \"em\""
                    .into(),
            );
        }
        Ok(())
    }

    /// The client settings of `task`'s environment.
    pub fn settings(task: &TaskConfig) -> OpenEnvSettings {
        let o = &task.openenv;
        let format = task.format.grammar();
        OpenEnvSettings {
            url: o.url.trim().to_owned(),
            action_field: o.action_field.clone(),
            observation_fields: o.observation_fields.clone(),
            reset_kwargs: o.reset.clone(),
            seed_field: (!o.seed_field.is_empty()).then(|| o.seed_field.clone()),
            send: match o.send {
                OpenEnvSend::Action => ActionText::Action,
                OpenEnvSend::Text => ActionText::Text,
            },
            format,
            observation_template: o
                .observation_template
                .clone()
                .unwrap_or_else(|| default_observation_template(format).to_owned()),
            max_turns: task.max_turns,
            success_reward: o.success_reward,
            timeouts: OpenEnvTimeouts {
                connect: Duration::from_secs_f64(o.connect_timeout_secs),
                message: Duration::from_secs_f64(o.timeout_secs),
            },
        }
    }
}
