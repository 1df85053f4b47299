//! `turnwise runs`.

use std::path::PathBuf;

use anyhow::{Result, bail};

/// List the runs under a directory: preset, status, latest checkpoint, the last steps'
/// training EM and reward, test EM before and after, and when each last logged.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A run directory or a folder of them.
    #[arg(default_value = "runs")]
    dir: PathBuf,
}

/// Runs `turnwise runs`.
pub fn exec(args: Args) -> Result<()> {
    let Args { dir } = args;
    let dirs = turnwise::run::find_runs(&dir)?;
    if dirs.is_empty() {
        bail!(
            "no run directories (folders with a config.toml) under {}",
            dir.display()
        );
    }
    let mut infos = Vec::new();
    for d in dirs {
        match turnwise::run::RunInfo::read(&d) {
            Ok(i) => infos.push(i),
            Err(e) => tracing::warn!("skipping {}: {e}", d.display()),
        }
    }
    print!("{}", turnwise::run::runs_table(&infos));
    Ok(())
}
