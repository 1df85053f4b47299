//! `turnwise quickstart`.

use std::path::PathBuf;

use anyhow::Result;
use turnwise::config::TrainConfig;
use turnwise::pipeline::RunOptions;

use super::common::print_summary;

/// The main job: generate a multi-hop world, warm-start a small model on oracle
/// demonstrations, train it with A2TGPO's advantage and turn clip (in Search-R1's format on
/// plain EM), and evaluate before and after on the test split.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Run directory.
    #[arg(long, default_value = "runs/quickstart")]
    out: PathBuf,
    /// Extra `key=value` overrides (e.g. `--set run.steps=20`).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Replace an existing run directory (without it, a non-empty `--out` is refused).
    #[arg(long)]
    overwrite: bool,
}

/// Runs `turnwise quickstart`.
pub fn exec(args: Args, quiet: bool) -> Result<()> {
    let Args {
        out,
        sets,
        overwrite,
    } = args;
    let cfg = TrainConfig::resolve(Some(turnwise::config::presets::QUICKSTART), None, &sets)?;
    for warning in cfg.schedule_warnings() {
        tracing::warn!("{warning}");
    }
    let summary = turnwise::pipeline::run(cfg, &RunOptions { dir: out, quiet }, overwrite)?;
    print_summary(&summary, quiet);
    Ok(())
}
