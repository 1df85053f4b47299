//! What several commands share: the checkpoint a command reads, the config of a preset and a
//! file, the run summary, the async runtime and the log output.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use turnwise::config::TrainConfig;
use turnwise_env::world::Split;

/// The checkpoint a command reads and the split it asks (`eval`, `credit-audit`): the latest
/// complete checkpoint of a run, or any checkpoint or Hugging Face folder with the task of its
/// run, its `turnwise.toml`, or `--preset`/`--config`.
#[derive(Debug, clap::Args)]
pub struct CheckpointArgs {
    /// The run directory: its latest complete checkpoint and its config (which says the task).
    #[arg(long, required_unless_present = "checkpoint")]
    run: Option<PathBuf>,
    /// A checkpoint folder or Hugging Face model folder. Its task comes from `--run`,
    /// `--preset`/`--config`, the folder's turnwise.toml or its run directory.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Preset giving the task of a folder that carries no config.
    #[arg(long)]
    preset: Option<String>,
    /// Config file giving the task of a folder that carries no config.
    #[arg(long)]
    config: Option<PathBuf>,
    /// `key=value` overrides (with `--preset` or `--config`).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// train, validation or test.
    #[arg(long, default_value = "test")]
    split: String,
}

impl CheckpointArgs {
    /// Where the checkpoint and its task come from.
    pub(super) fn source(&self) -> turnwise::checkpoints::EvalSource<'_> {
        turnwise::checkpoints::EvalSource {
            run: self.run.as_deref(),
            checkpoint: self.checkpoint.as_deref(),
            preset: self.preset.as_deref(),
            config: self.config.as_deref(),
            sets: &self.sets,
        }
    }

    /// `--split`, parsed.
    pub(super) fn split(&self) -> Result<Split> {
        Ok(match self.split.as_str() {
            "train" => Split::Train,
            "validation" => Split::Validation,
            "test" => Split::Test,
            other => bail!("--split must be train, validation or test, got {other:?}"),
        })
    }
}

/// Sets up `tracing` output on stderr (`RUST_LOG` overrides the level), coloured only when
/// stderr is a terminal and none of `NO_COLOR`, `CLICOLOR=0` or `TERM=dumb` asks otherwise.
pub fn init_logging(quiet: bool) {
    let default = if quiet { "warn" } else { "info" };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(use_colour(
            std::io::IsTerminal::is_terminal(&std::io::stderr()),
            |k| std::env::var(k).ok(),
        ))
        .init();
}

/// Whether to colour output on a stream (`is_terminal`), given the environment (`var`).
pub fn use_colour(is_terminal: bool, var: impl Fn(&str) -> Option<String>) -> bool {
    if var("NO_COLOR").is_some_and(|v| !v.is_empty()) {
        return false;
    }
    if var("CLICOLOR").as_deref() == Some("0") || var("TERM").as_deref() == Some("dumb") {
        return false;
    }
    is_terminal
}

/// The config of `train` and `config`: a preset, a config file or both, then the overrides.
pub(super) fn resolve_train_config(
    preset: Option<&str>,
    config: Option<&Path>,
    sets: &[String],
) -> Result<TrainConfig> {
    if preset.is_none() && config.is_none() {
        bail!("give --preset NAME or --config FILE (see `turnwise presets`)");
    }
    let cfg = TrainConfig::resolve(preset, config, sets)?;
    for warning in cfg.schedule_warnings() {
        tracing::warn!("{warning}");
    }
    Ok(cfg)
}

/// Prints a finished run's figures (`quickstart`, `train`, `resume`), unless `quiet`.
pub(super) fn print_summary(s: &turnwise::pipeline::RunSummary, quiet: bool) {
    if quiet {
        return;
    }
    let pct = |r: &Option<turnwise::trainer::eval::EvalResult>| {
        r.as_ref()
            .map(|r| format!("{:.1}% ± {:.1}", r.em * 100.0, r.em_se * 100.0))
            .unwrap_or_else(|| "-".into())
    };
    let n = [&s.after_greedy, &s.after_sampled, &s.before_greedy]
        .into_iter()
        .flatten()
        .map(|r| r.n)
        .next()
        .unwrap_or(0);
    for (k, r) in &s.base {
        println!(
            "starting model, {k}-shot: test EM greedy {} (n={})",
            pct(&Some(r.clone())),
            r.n
        );
    }
    let v = &s.validation;
    let game = [&s.after_greedy, &s.before_greedy]
        .into_iter()
        .flatten()
        .any(|r| r.is_game());
    // The change on the same questions, with its paired standard error.
    let gain = |key: &str| {
        s.gains
            .get(key)
            .map(|g| format!(" ({:+.1} ± {:.1} paired)", g.gain * 100.0, g.se * 100.0))
            .unwrap_or_default()
    };
    println!(
        "test {} (n={n}) greedy: {} -> {}{}; sampled: {} -> {}{}; validation greedy: {} -> {}{} (warm start {:.0} s, RL {:.0} s, total {:.0} s)",
        if game { "success" } else { "EM" },
        pct(&s.before_greedy),
        pct(&s.after_greedy),
        gain("gain/test/greedy"),
        pct(&s.before_sampled),
        pct(&s.after_sampled),
        gain("gain/test/sampled"),
        pct(&v.before_greedy),
        pct(&v.after_greedy),
        gain("gain/validation/greedy"),
        s.sft_seconds,
        s.rl_seconds,
        s.total_seconds
    );
}

/// The async runtime of the servers (`serve-retriever`, `serve-env`, `view --serve`).
pub(super) fn tokio_runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        // An idle blocking-pool thread exits after a second instead of ten: its allocator heap
        // holds what a large retrieval freed until it does (measured in tests/server_load.rs:
        // 93 MiB held for 10 s after a load, 40 MiB once the threads exit; idle is 30).
        .thread_keep_alive(Duration::from_secs(1))
        .build()
        .context("building the async runtime")
}

#[cfg(test)]
mod tests {
    use super::use_colour;

    #[test]
    fn colour_only_on_a_terminal_that_did_not_opt_out() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert!(use_colour(true, env(&[])));
        assert!(!use_colour(false, env(&[])));
        assert!(!use_colour(true, env(&[("NO_COLOR", "1")])));
        assert!(use_colour(true, env(&[("NO_COLOR", "")])));
        assert!(!use_colour(true, env(&[("CLICOLOR", "0")])));
        assert!(!use_colour(true, env(&[("TERM", "dumb")])));
        assert!(use_colour(true, env(&[("TERM", "xterm-256color")])));
    }
}
