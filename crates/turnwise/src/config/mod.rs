//! The training configuration: one TOML document made of a preset, an optional user file and
//! `--set key=value` overrides, resolved into a [`TrainConfig`]. Unknown or ill-typed fields are
//! errors that name the field (its dotted path).
//!
//! A method is a preset (`presets/*.toml`, embedded in the binary): it names its rollout
//! strategy, reward, advantage estimator and loss, each a part other presets reuse
//! (design.md, spec §10).
//!
//! The sections follow the pipeline, one file each holding their structs and checks:
//! `task.rs` (`[task]`), `model.rs` (`[model]`), `warm_start.rs` (`[sft]`, `[rsft]`),
//! `rollout.rs` (`[rollout]`), `reward.rs` (`[overlong_buffer]`, `[judge]`; the reward itself is
//! a `turnwise-core` type), `update.rs` (`[optim]`, `[critic]`, `[algorithm]`, and the checks of
//! `[advantage]` and `[actor]`, `turnwise-core` and `turnwise-model` types) and `run.rs`
//! (`[eval]`, `[run]`). `overrides.rs` layers documents and applies `--set`; `numbers.rs` checks
//! every number once more: finite, and in the range stated for its key.

mod cross;
mod model;
mod numbers;
mod openenv;
mod overrides;
pub mod presets;
mod reward;
mod rollout;
mod run;
mod task;
mod update;
mod warm_start;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use turnwise_core::advantage::AdvantageConfig;
use turnwise_core::reward::RewardConfig;
pub use turnwise_env::judge::JudgeMode;
use turnwise_model::loss::{ActorLossConfig, LossAggMode};

pub use model::{LoraSpec, ModelDType, ModelSpec, TokenizerKind};
pub use openenv::{OpenEnvConfig, OpenEnvSend};
pub use overrides::{PATH_KEYS, absolutize_paths, apply_override, merge};
use overrides::{first_line, parse_table};
pub use reward::{JudgeFailure, JudgeSettings, OverlongBufferConfig};
pub use rollout::{
    FilterMetric, HarnessConfig, HarnessReward, RemoteConfig, RemoteProtocol, RolloutBackend,
    RolloutConfig, RolloutStrategy, TdsConfig, TtiConfig,
};
pub use run::{EvalConfig, RunConfig, WandbSetting};
pub use task::{AgentFormatName, GameConfig, MAX_TOPK, SearchR1Files, TaskConfig, TaskEnv};
pub use update::{AlgorithmConfig, CriticConfig, OldLogprobs, OptimConfig, TrainSamples};
pub use warm_start::{RsftConfig, SftConfig};

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
    /// Several values are wrong ([`TrainConfig::validate`] checks every section in one pass):
    /// each problem on its own line, one per key.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Several(Vec<ConfigError>),
}

impl ConfigError {
    /// The dotted key the error is about, where it names one.
    fn field(&self) -> Option<&str> {
        match self {
            ConfigError::Field { field, .. } => Some(field),
            ConfigError::Invalid { field, .. } => Some(field),
            _ => None,
        }
    }

    /// `Ok` without problems, the problem itself when there is one, else
    /// [`ConfigError::Several`] of them in the order found. A key reported twice (a value
    /// that is not finite is also out of its range) is reported once, by the first check that
    /// found it, and a section reported after one of its keys (`actor.policy` after
    /// `actor.policy.clip_ratio_c`, when the loss refuses what its range refused) is not
    /// reported again.
    fn all(problems: Vec<ConfigError>) -> Result<(), ConfigError> {
        let mut kept: Vec<ConfigError> = Vec::new();
        for p in problems {
            let reported = p.field().is_some_and(|f| {
                kept.iter()
                    .filter_map(ConfigError::field)
                    .any(|k| k == f || k.strip_prefix(f).is_some_and(|rest| rest.starts_with('.')))
            });
            if !reported {
                kept.push(p);
            }
        }
        match kept.len() {
            0 => Ok(()),
            1 => Err(kept.remove(0)),
            _ => Err(ConfigError::Several(kept)),
        }
    }
}
/// This machine's memory in bytes (`MemTotal` of /proc/meminfo); `None` where it cannot be read.
pub fn machine_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
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

    /// Settings that are valid but almost surely not meant, one sentence each: a warm-up longer
    /// than its phase (`sft.warmup_steps` > `sft.steps`, `optim.warmup_steps` > `run.steps`), so
    /// that the learning rate never reaches its peak. `train`, `quickstart` and `config` log them
    /// as warnings. They are not errors: the default `sft.warmup_steps` (50) exceeds the short
    /// warm starts of many configs and tests, and runs made before must still resume.
    pub fn schedule_warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut check =
            |warmup_key: &str, warmup: u64, steps_key: &str, steps: u64, lr_key: &str, lr: f64| {
                if steps > 0 && warmup > steps {
                    let last = lr * steps as f64 / warmup as f64;
                    out.push(format!(
                        "{warmup_key} = {warmup} exceeds {steps_key} = {steps}: the learning rate \
                     never reaches {lr_key} = {lr} (the last step runs at {last:.3e}, {:.0} % of \
                     it); set {warmup_key} to at most {steps}",
                        100.0 * steps as f64 / warmup as f64
                    ));
                }
            };
        check(
            "sft.warmup_steps",
            self.sft.warmup_steps,
            "sft.steps",
            self.sft.steps,
            "sft.lr",
            self.sft.lr,
        );
        check(
            "optim.warmup_steps",
            self.optim.warmup_steps,
            "run.steps",
            self.run.steps,
            "optim.lr",
            self.optim.lr,
        );
        out
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
        for key in presets::LISTING_KEYS {
            table.remove(key);
        }
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
        for key in presets::LISTING_KEYS {
            table.remove(key);
        }
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

    /// Checks every value in one pass and reports every problem at once
    /// ([`ConfigError::Several`], one line per key): every number is finite
    /// ([`numbers::validate`]); each section checks its own keys, beside its struct, where the
    /// parts of `turnwise-core` and `turnwise-model` check theirs (`[advantage]`, `[actor]`);
    /// the rules that tie sections together are in `cross.rs`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let max_response_tokens = self.rollout.max_response_tokens;
        let mut problems = numbers::validate(self);
        // [advantage], [actor]: the estimator's and the loss's own ranges.
        problems.extend(self.validate_parts());
        let sections = [
            // [task]
            self.task.validate_limits(),
            self.task.validate_source(max_response_tokens),
            self.task.validate(&self.reward, self.rollout.tti.enabled),
            // [model]
            self.model.validate_device(),
            self.model.validate_ranges(max_response_tokens),
            self.model.validate_heads(),
            // [sft], [rsft]
            self.sft.validate_ranges(),
            self.sft.validate(),
            self.rsft.validate_lr(),
            self.rsft.validate(),
            // [rollout]
            self.rollout.validate_sampling(),
            self.rollout.validate_tree_shape(),
            self.rollout.validate_control(),
            self.rollout.validate_chain_only(),
            self.rollout.validate_remote(self.model.lora.rank),
            self.rollout.validate_branch_penalty(),
            self.rollout.validate_filter(),
            // [reward], [overlong_buffer], [judge]
            self.validate_reward(),
            self.overlong_buffer.validate(max_response_tokens),
            self.judge.validate(&self.reward),
            // [actor]: the loss it names
            self.validate_policy_loss(),
            // [optim], [critic]
            self.optim.validate_ranges(),
            self.optim.validate_min_lr_ratio(),
            self.optim.validate(),
            self.critic.validate(),
            // [eval], [run]
            self.eval.validate(),
            self.run.validate_tracking(),
            self.run.validate_checkpoints(),
        ];
        problems.extend(sections.into_iter().filter_map(Result::err));
        problems.extend(self.validate_cross(machine_memory_bytes()));
        ConfigError::all(problems)
    }
}

/// The resolved config of run directory `dir` (its `config.toml`).
pub fn run_config(dir: &turnwise_report::run::RunDir) -> anyhow::Result<TrainConfig> {
    let text = dir.read_config()?;
    let table = anyhow::Context::with_context(text.parse::<toml::Table>(), || {
        format!("parsing {}", dir.config_path().display())
    })?;
    Ok(TrainConfig::from_table(table)?)
}

#[cfg(test)]
mod tests;
