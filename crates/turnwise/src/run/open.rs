//! Opening a run directory as the commands that read one do (`turnwise eval --checkpoint`,
//! `turnwise serve --model`, `turnwise export`): one of its complete checkpoints (its resolved
//! config: [`crate::config::run_config`]).

use anyhow::{Result, bail};

use super::{Checkpoint, RunDir};

/// Directory (inside the run) of the warm-started weights.
pub const REFERENCE_DIR: &str = "warm-start-model";

/// The complete checkpoint of `run` at `step`, or its latest complete one.
pub fn pick_checkpoint(run: &RunDir, step: Option<u64>) -> Result<Checkpoint> {
    let complete: Vec<Checkpoint> = run
        .checkpoints()?
        .into_iter()
        .filter(|c| c.complete)
        .collect();
    let steps = || {
        let s: Vec<String> = complete.iter().map(|c| c.step.to_string()).collect();
        match s.is_empty() {
            true => "none".to_string(),
            false => s.join(", "),
        }
    };
    match step {
        Some(n) => match complete.iter().find(|c| c.step == n) {
            Some(c) => Ok(c.clone()),
            None => {
                // Step 0 (the warm-started model) is rotated out like the others, but the run
                // keeps it as a Hugging Face folder of its own.
                let reference = run.root().join(REFERENCE_DIR);
                let hint = match n == 0 && reference.join("config.json").is_file() {
                    true => format!(
                        "; the warm-started model of step 0 is kept in {}, a Hugging Face folder \
                         that `turnwise eval --checkpoint` and `turnwise serve --model` read as \
                         it is",
                        reference.display()
                    ),
                    false => String::new(),
                };
                bail!(
                    "{} has no complete checkpoint of step {n} (complete steps: {}){hint}",
                    run.root().display(),
                    steps()
                )
            }
        },
        None => match complete.iter().max_by_key(|c| c.step) {
            Some(c) => Ok(c.clone()),
            None => bail!("{} has no complete checkpoint", run.root().display()),
        },
    }
}
