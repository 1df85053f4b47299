//! The run's bookkeeping: evaluation (`[eval]`) and the run itself (`[run]`: steps,
//! checkpoints, samples, tracking), with their checks.

use serde::{Deserialize, Serialize};

use super::ConfigError;
use super::numbers::check;

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
    pub fn mode(self) -> Option<turnwise_report::run::wandb::WandbMode> {
        match self {
            Self::Off => None,
            Self::Online => Some(turnwise_report::run::wandb::WandbMode::Online),
            Self::Offline => Some(turnwise_report::run::wandb::WandbMode::Offline),
        }
    }
}

impl RunConfig {
    /// Checks the W&B names: a project (and an entity, when set) of 1 to 128 characters
    /// without `/ \ # ? % :`, and a run name that is not empty when set.
    pub(super) fn validate_tracking(&self) -> Result<(), ConfigError> {
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

    /// Checks `keep_checkpoints`.
    pub(super) fn validate_checkpoints(&self) -> Result<(), ConfigError> {
        check(
            self.keep_checkpoints >= 1,
            "run.keep_checkpoints",
            "at least 1",
            self.keep_checkpoints as f64,
        )
    }
}

impl EvalConfig {
    /// Checks the questions and samples per evaluation.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let e = self;
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
        )
    }
}
