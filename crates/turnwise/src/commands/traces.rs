//! `turnwise traces`: the session records of `turnwise serve --record-dir`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Subcommand;

/// `turnwise traces ...`.
#[derive(Debug, Subcommand)]
pub enum TracesCommand {
    /// Reconstruct every session of DIR (`*.jsonl`, as `turnwise serve --record-dir` writes)
    /// and report sessions, requests, the append rate, segments, spliced prompts and re-tokenised
    /// drift, and the tool-call parse rate per turn position.
    Check {
        /// The record directory.
        dir: PathBuf,
        /// Print the report as one JSON object.
        #[arg(long)]
        json: bool,
    },
}

/// Runs `turnwise traces ...`.
pub fn exec(cmd: TracesCommand) -> Result<()> {
    match cmd {
        TracesCommand::Check { dir, json } => {
            let report = turnwise::serve::traces::check_dir(&dir)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", report.table());
            }
            Ok(())
        }
    }
}
