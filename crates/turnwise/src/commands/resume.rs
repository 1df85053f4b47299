//! `turnwise resume`.

use std::path::PathBuf;

use anyhow::Result;

use super::common::print_summary;

/// Continue a killed run from its latest complete checkpoint.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The run directory.
    dir: PathBuf,
}

/// Runs `turnwise resume`.
pub fn exec(args: Args, quiet: bool) -> Result<()> {
    let Args { dir } = args;
    let summary = turnwise::pipeline::resume(&dir, quiet)?;
    print_summary(&summary, quiet);
    Ok(())
}
