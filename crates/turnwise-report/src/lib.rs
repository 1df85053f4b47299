//! # turnwise-report
//!
//! The run directory a training run leaves on disk, and the tools that read it back: its files
//! and their ownership manifest ([`ownership`], [`run::RunDir`], [`run::MetricsWriter`],
//! [`run::SampleRecord`]), plots and the report ([`run::write_plots`], [`run::write_report`]),
//! TensorBoard event files ([`run::tensorboard`]), the Weights & Biases sidecar ([`run::wandb`]),
//! the sample viewer ([`run::view`]), run comparisons ([`run::compare_table`]) and the
//! statistics of a study's report ([`stats`]).
//!
//! Nothing here depends on training: the app crate (`turnwise`) re-exports these modules as
//! `turnwise::run` and `turnwise::ownership`.

pub mod ownership;
pub mod run;
pub mod stats;
