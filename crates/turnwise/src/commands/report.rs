//! `turnwise report`.

use std::path::PathBuf;

use anyhow::Result;

/// Rewrite the plots and report.md of a run from its metrics.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The run directory.
    dir: PathBuf,
}

/// Runs `turnwise report`.
pub fn exec(args: Args, quiet: bool) -> Result<()> {
    let Args { dir } = args;
    let mut run = turnwise::run::RunDir::open(&dir)?;
    // The new report.md is recorded as the run's (when no run is writing it).
    run.adopt_manifest()?;
    let path = turnwise::run::write_report(&run)?;
    if !quiet {
        println!("wrote {}", path.display());
    }
    Ok(())
}
