//! Environments over HTTP with OpenEnv's protocol, both ways:
//!
//! - **client**: `task.env = "openenv"` plays the episodes of any OpenEnv server
//!   (`[task.openenv]`, [`OpenEnvConfig`]) through the same rollouts, presets and evaluation as
//!   the built-in environments ([`OpenEnvTask`], over [`turnwise_env::env::OpenEnvEnv`]);
//! - **server**: `turnwise serve-env` serves a turnwise task (the search world, a game, the
//!   two-turn task) to OpenEnv clients ([`TaskEpisodes`], over
//!   [`turnwise_env::server::openenv`]).
//!
//! # Episodes of an OpenEnv task
//!
//! Split `k` (train, validation, test) has `task.openenv.{train, validation, test}` episodes;
//! episode `j` of it is reset with the seed [`OpenEnvConfig::episode_seed`]: `seed + j` for
//! training, then the validation seeds, then the test seeds, so the three ranges never overlap
//! and evaluation is always on the same held-out seeds. When the task is built each episode is
//! reset once (over one session) and its first observation, after `task.openenv.instructions`,
//! becomes its question, hence its prompt; a rollout's reset must answer that same observation
//! again (the server's reset must be determined by its arguments).
//!
//! Each agent turn sends its action (the `<action>` block in the T2PO format; the query or the
//! answer in the others; or the whole turn with `send = "text"`) in the action field
//! `task.openenv.action_field`; the observation fields `task.openenv.observation_fields` come
//! back wrapped in `task.openenv.observation_template` (the agent format's observation block by
//! default) as the environment segment of the trajectory; the observation's `reward` is the
//! turn's reward and `done` ends the episode. The episode's reward is its return (the sum of
//! its turn rewards), and it is a success when that return reaches
//! `task.openenv.success_reward` (1 by default): evaluation reports the success rate, as for the
//! games.

use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, bail};
use turnwise_env::env::openenv::{OBSERVATION_PLACEHOLDER, check_health};
use turnwise_env::env::{Environment, OpenEnvEnv, OpenEnvSettings, Task};
use turnwise_env::server::openenv::{EpisodeSource, ServedEpisode};
use turnwise_env::world::Split;

use crate::config::{OpenEnvConfig, TaskConfig};
use crate::task::{QaItem, TaskSet};

/// The episodes of an OpenEnv server as a task: the questions of each split (the first
/// observations, fetched when the task is built) and fresh environments.
#[derive(Debug, Clone)]
pub struct OpenEnvTask {
    settings: OpenEnvSettings,
    questions: [Vec<QaItem>; 3],
}

impl OpenEnvTask {
    /// Checks the server (`GET /health`), then resets every episode of every split once over
    /// one session and keeps its first observation as its question.
    pub fn build(task: &TaskConfig) -> Result<Self> {
        let o = &task.openenv;
        let settings = OpenEnvConfig::settings(task);
        check_health(&settings.url, settings.timeouts.connect).with_context(|| {
            format!(
                "task.openenv.url = {:?}: no OpenEnv server answers there (start one, e.g. \
                 `uvicorn server.app:app --port 8000`, or `turnwise serve-env`, or fix the URL)",
                settings.url
            )
        })?;
        let mut env = OpenEnvEnv::new(settings.clone())
            .with_context(|| format!("task.openenv.url = {:?}", settings.url))?;
        let mut questions: [Vec<QaItem>; 3] = Default::default();
        for (k, split) in Split::ALL.into_iter().enumerate() {
            for j in 0..o.episodes(split) {
                let id = format!("openenv-{}-{j}", split.name());
                let seed = o.episode_seed(split, j);
                let (first, reply) = env
                    .reset_reply(&Task::with_seed(id.clone(), seed))
                    .with_context(|| format!("fetching the first observation of {id}"))?;
                if reply.done {
                    bail!(
                        "task.openenv: the server's reset of {id} (seed {seed}) answered \
                         done = true: the episode is over before the agent acts"
                    );
                }
                let text = if o.instructions.is_empty() {
                    first
                } else {
                    format!("{}\n{first}", o.instructions)
                };
                questions[k].push(QaItem {
                    id,
                    text,
                    golden_answers: Vec::new(),
                    hops: 0,
                    prompt: None,
                    seed,
                    routine_turns: 0,
                });
            }
        }
        tracing::info!(
            url = %settings.url,
            train = questions[0].len(),
            validation = questions[1].len(),
            test = questions[2].len(),
            "task.env = \"openenv\": first observations fetched"
        );
        Ok(Self {
            settings,
            questions,
        })
    }

    /// The questions of `split` (each carrying its episode's reset seed).
    pub fn questions(&self, split: Split) -> Vec<QaItem> {
        let k = Split::ALL
            .iter()
            .position(|&s| s == split)
            .expect("every split is in Split::ALL");
        self.questions[k].clone()
    }

    /// A fresh environment (one WebSocket session, opened at its first reset).
    pub fn env(&self) -> Result<OpenEnvEnv> {
        Ok(OpenEnvEnv::new(self.settings.clone())?)
    }

    /// The client settings.
    pub fn settings(&self) -> &OpenEnvSettings {
        &self.settings
    }

    /// Text of the observation template outside its placeholder (its tags), for a fresh
    /// tokenizer's vocabulary.
    pub fn template_text(&self) -> String {
        self.settings
            .observation_template
            .replace(OBSERVATION_PLACEHOLDER, " ")
    }
}

/// A turnwise task as the episodes of `turnwise serve-env`: the questions (or maps) of each
/// split, their prompts, and the task's environment.
pub struct TaskEpisodes {
    task: Mutex<TaskSet>,
    name: String,
    lens: [usize; 3],
}

impl TaskEpisodes {
    /// The episodes of `task` (its built-in environment: the search world, a game or the
    /// two-turn task).
    pub fn new(task: TaskSet) -> Result<Self> {
        if task.openenv.is_some() {
            bail!(
                "serve-env serves turnwise's own environments; task.env = \"openenv\" is \
                 already an OpenEnv server"
            );
        }
        let lens = Split::ALL.map(|s| task.questions(s).len());
        let name = format!("turnwise-{}", task.config.env.name());
        Ok(Self {
            task: Mutex::new(task),
            name,
            lens,
        })
    }

    fn task(&self) -> std::sync::MutexGuard<'_, TaskSet> {
        self.task
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Shares it for the server.
    pub fn into_source(self) -> Arc<dyn EpisodeSource> {
        Arc::new(self)
    }
}

impl EpisodeSource for TaskEpisodes {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn description(&self) -> String {
        let task = self.task();
        let c = &task.config;
        format!(
            "turnwise's {} environment in the {:?} agent format, at most {} turns; {} train, {} \
             validation and {} test episodes. Reset with split and index (or seed); each step's \
             action is the agent's whole turn text in `message`.",
            c.env.name(),
            c.format,
            c.max_turns,
            self.lens[0],
            self.lens[1],
            self.lens[2]
        )
    }

    fn len(&self, split: Split) -> usize {
        match split {
            Split::Train => self.lens[0],
            Split::Validation => self.lens[1],
            Split::Test => self.lens[2],
        }
    }

    fn episode(&self, split: Split, index: usize) -> Result<ServedEpisode, String> {
        let task = self.task();
        let questions = task.questions(split);
        let q = questions.get(index).ok_or_else(|| {
            format!(
                "index {index} is out of range: the {} split has {} episodes",
                split.name(),
                questions.len()
            )
        })?;
        let prompt = task.prompt(q).map_err(|e| format!("{e:#}"))?;
        Ok(ServedEpisode {
            task: TaskSet::env_task(q),
            text: q.text.clone(),
            prompt,
        })
    }

    fn new_env(&self) -> Result<Box<dyn Environment>, String> {
        self.task().env().map_err(|e| format!("{e:#}"))
    }
}
