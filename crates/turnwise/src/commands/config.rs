//! `turnwise config`.

use std::path::PathBuf;

use anyhow::{Context, Result};

use super::common::resolve_train_config;

/// Print the resolved configuration of a preset, a config file and overrides, as a run
/// would store it in config.toml, without running anything (a dry run: every check a run
/// makes on its config is made).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Preset name (see `turnwise presets`).
    #[arg(long)]
    preset: Option<String>,
    /// A TOML config file applied over the preset.
    #[arg(long)]
    config: Option<PathBuf>,
    /// `key=value` overrides applied last.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
}

/// Runs `turnwise config`.
pub fn exec(args: Args) -> Result<()> {
    let Args {
        preset,
        config,
        sets,
    } = args;
    let cfg = resolve_train_config(preset.as_deref(), config.as_deref(), &sets)?;
    // The checks a run makes on its task before it touches its directory.
    let task = turnwise::task::TaskSet::build(&cfg.task).context("building the task")?;
    turnwise::pipeline::preflight(&cfg, &task)?;
    let (steps, off) = cfg.update_structure();
    println!(
        "# resolved config of preset {:?}: {} per rollout batch ({off} off-policy)",
        cfg.preset,
        turnwise::pipeline::count(steps as u64, "optimizer step", "optimizer steps")
    );
    print!("{}", cfg.to_toml());
    Ok(())
}
