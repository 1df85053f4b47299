//! `turnwise export`.

use std::path::PathBuf;

use anyhow::Result;

/// Write one checkpoint of a run as a clean Hugging Face folder (config.json,
/// model.safetensors, tokenizer and generation configs; no optimizer or trainer state).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The run directory.
    run: PathBuf,
    /// RL step of the checkpoint (default: the latest complete one).
    #[arg(long)]
    step: Option<u64>,
    /// Output folder (must be empty or absent).
    #[arg(long)]
    out: PathBuf,
    /// Replace a non-empty output folder.
    #[arg(long)]
    overwrite: bool,
}

/// Runs `turnwise export`.
pub fn exec(args: Args) -> Result<()> {
    let Args {
        run,
        step,
        out,
        overwrite,
    } = args;
    let ck = turnwise::checkpoints::export_checkpoint(&run, step, &out, overwrite)?;
    println!(
        "exported {} (RL step {}) to {}",
        ck.path.display(),
        ck.step,
        out.display()
    );
    Ok(())
}
