//! The run directory: everything a training run leaves on disk, and the tools that read it back.
//!
//! ```text
//! <run>/
//!   config.toml          the resolved configuration, written once ([`RunDir::write_config`])
//!   metrics.jsonl        one JSON object per line and per phase ([`MetricsWriter`], [`read_metrics`])
//!   samples/step-N.jsonl trajectories of step N, one JSON line each, decoded and annotated
//!                        ([`RunDir::samples_path`], [`SampleRecord`]; `turnwise view` shows them, [`view`])
//!   evals/<split>-<mode>-step-N.jsonl
//!                        how each question of an evaluation at step N went ([`RunDir::eval_path`])
//!   checkpoints/step-N/  written by the caller, complete once `COMPLETE` exists ([`RunDir::begin_checkpoint`])
//!   plots/*.svg          line charts of the main curves ([`write_plots`])
//!   report.md            first/last/best values, evaluations, plots, timing ([`write_report`])
//!   view/step-N.html     `turnwise view`'s page of step N's samples ([`view`])
//!   tensorboard/         TensorBoard event files of every metrics line ([`tensorboard`])
//!   wandb/               what wandb writes when the run logs to Weights & Biases ([`wandb`])
//!   run.lock             held (an OS file lock) by the one process that writes the run
//! ```
//!
//! Metric names follow verl (`actor/pg_loss`, `actor/pg_clipfrac`, `actor/ppo_kl`, `actor/entropy`,
//! `actor/grad_norm`, `critic/score/mean`, `critic/advantages/{mean,max,min}`,
//! `response_length/mean`, `timing_s/*`) and the diagnostics of spec §7; evaluations are logged as
//! `eval/<split>/<mode>/<metric>` (split `validation` or `test`, never pooled; `n` = questions)
//! with per-hop EM as `eval/<split>/<mode>/em/hop<N>`; the change from before to after RL on the
//! same questions, with its paired standard error, as `gain/<split>/<mode>/{em,se,n,improved,regressed}`.
//!
//! The app crate (`turnwise::run`) re-exports this module, and adds what depends on training:
//! picking a run's checkpoint and progress bars.

mod catalog;
mod dir;
mod metrics;
mod plots;
mod report;
mod samples;
mod svg;
pub mod tensorboard;
pub mod view;
pub mod wandb;

use std::path::{Path, PathBuf};

pub use catalog::{
    COMPARE_CHARTS, RunInfo, SUMMARY_KEYS, WORLD_KEYS, compare_charts, compare_table,
    differing_world_keys, find_runs, runs_table, world_settings, write_compare_charts,
};
pub use dir::read_json_lines;
pub use dir::write_atomic;
pub use dir::{
    COMPLETE_MARKER, Checkpoint, LOCK_FILE, RUN_ENTRIES, RUN_MARKER, RunDir, legacy_run_class,
};
pub use metrics::{MetricsLog, MetricsRecord, MetricsWriter, PairedGain, read_metrics};
pub use plots::{PlotFile, PlotSpec, SeriesSpec, default_plot_specs, plot_records, write_plots};
pub use report::{ReportInput, render_report, write_report};
pub use samples::{SampleGroup, SampleRecord, StepGroup, TurnText};
pub use svg::{LineChart, Series};

/// What went wrong with a file of the run directory, and which file.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// An I/O operation failed.
    #[error("cannot {action} {}: {cause}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What was being done ("create the directory", "append to", ...).
        action: &'static str,
        /// The underlying error.
        cause: std::io::Error,
    },
    /// A new run would overwrite a directory that already holds files.
    #[error(
        "the run directory {} is not empty (pass --overwrite to replace it, or `turnwise resume` it)",
        path.display()
    )]
    NotEmpty {
        /// The directory.
        path: PathBuf,
    },
    /// Another process holds the run directory's lock (a run or a resume in progress).
    #[error(
        "the run directory {} is in use by another turnwise process{holder} (its lock file {} is held)",
        path.display(), lock.display()
    )]
    Locked {
        /// The directory.
        path: PathBuf,
        /// The lock file.
        lock: PathBuf,
        /// ` (pid N)` when the holder wrote its process id, else empty.
        holder: String,
    },
    /// The path exists but is not a directory.
    #[error("{} exists and is not a directory", path.display())]
    NotADirectory {
        /// The path.
        path: PathBuf,
    },
    /// The directory does not look like a run directory (no `config.toml`).
    #[error("{} is not a run directory: {reason}", path.display())]
    NotARunDir {
        /// The directory.
        path: PathBuf,
        /// Why not.
        reason: String,
    },
    /// `config.toml` exists already with other contents (it is written once per run).
    #[error("{} exists already with another configuration", path.display())]
    ConfigChanged {
        /// The config file.
        path: PathBuf,
    },
    /// A complete checkpoint exists already for this step.
    #[error("the checkpoint {} exists already and is complete", path.display())]
    CheckpointExists {
        /// The checkpoint directory.
        path: PathBuf,
    },
    /// A line of a JSON-lines file is not what was expected.
    #[error("{}:{line}: {message}", path.display())]
    BadLine {
        /// The file.
        path: PathBuf,
        /// The line number, starting at 1.
        line: usize,
        /// What is wrong with it.
        message: String,
    },
    /// Experiment tracking (the Weights & Biases sidecar) failed; the message says why and what
    /// to do.
    #[error("{message}")]
    Tracking {
        /// What went wrong.
        message: String,
    },
    /// A path turnwise did not write (or that changed since) is in the way, or the ownership
    /// manifest cannot be read or written ([`crate::ownership`]).
    #[error(transparent)]
    Ownership(#[from] crate::ownership::OwnershipError),
    /// A value could not be serialized.
    #[error("cannot serialize a line for {}: {cause}", path.display())]
    Serialize {
        /// The file it was meant for.
        path: PathBuf,
        /// The underlying error.
        cause: serde_json::Error,
    },
}

impl RunError {
    /// Wraps an I/O error with the path and the action.
    pub(crate) fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.to_path_buf();
        move |cause| RunError::Io {
            path,
            action,
            cause,
        }
    }
}

/// Result of the run-directory functions.
pub type RunResult<T> = std::result::Result<T, RunError>;
