//! `turnwise compare`.

use std::path::PathBuf;

use anyhow::{Result, bail};

/// Set runs side by side: a table of their test EM and last training metrics, and, with
/// `--plots DIR`, one SVG chart per metric with a curve per run.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Run directories (or folders of them).
    #[arg(required = true)]
    runs: Vec<PathBuf>,
    /// Write the charts into this folder.
    #[arg(long)]
    plots: Option<PathBuf>,
}

/// Runs `turnwise compare`.
pub fn exec(args: Args, quiet: bool) -> Result<()> {
    let Args { runs, plots } = args;
    let mut infos = Vec::new();
    for r in &runs {
        let dirs = turnwise::run::find_runs(r)?;
        if dirs.is_empty() {
            bail!("{} is not a run directory and holds none", r.display());
        }
        for d in dirs {
            infos.push(turnwise::run::RunInfo::read(&d)?);
        }
    }
    print!("{}", turnwise::run::compare_table(&infos));
    if let Some(dir) = plots {
        let written = turnwise::run::write_compare_charts(&infos, &dir)?;
        if !quiet {
            for p in written {
                println!("wrote {}", p.display());
            }
        }
    }
    Ok(())
}
