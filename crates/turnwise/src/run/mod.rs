//! The run directory: everything a training run leaves on disk, and the tools that read it back.
//! They live in the `turnwise-report` crate (`turnwise_report::run`, `turnwise_report::ownership`),
//! which this module re-exports; what depends on training stays here: picking a run's
//! checkpoint ([`pick_checkpoint`]) and progress bars ([`Progress`]).
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
//! [`Progress`] draws progress bars on a terminal and logs a line every few percent elsewhere.

mod open;
mod progress;

pub use open::{REFERENCE_DIR, pick_checkpoint};
pub use progress::{Progress, ProgressMode};
pub(crate) use turnwise_report::run::wandb;
pub use turnwise_report::run::{
    COMPARE_CHARTS, RunInfo, SUMMARY_KEYS, WORLD_KEYS, compare_charts, compare_table,
    differing_world_keys, find_runs, runs_table, world_settings, write_compare_charts,
};
pub use turnwise_report::run::{
    COMPLETE_MARKER, Checkpoint, LOCK_FILE, RUN_MARKER, RunDir, legacy_run_class,
};
pub use turnwise_report::run::{LineChart, SampleGroup, SampleRecord, Series, StepGroup, TurnText};
pub use turnwise_report::run::{
    MetricsLog, MetricsRecord, MetricsWriter, PairedGain, read_metrics,
};
pub use turnwise_report::run::{
    PlotFile, PlotSpec, SeriesSpec, default_plot_specs, plot_records, write_plots,
};
pub use turnwise_report::run::{ReportInput, render_report, write_report};
pub use turnwise_report::run::{RunError, RunResult, tensorboard, view};
pub(crate) use turnwise_report::run::{read_json_lines, write_atomic};
