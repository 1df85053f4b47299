//! `turnwise eval`.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};

use super::common::CheckpointArgs;

/// Evaluate a checkpoint on a split of its task: the latest complete checkpoint of a run
/// (`--run`), or any checkpoint or Hugging Face folder (`--checkpoint`, e.g. an `sft --out`
/// or `export` folder). Prints the checkpoint evaluated on stderr and the result as JSON.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: CheckpointArgs,
    /// Questions.
    #[arg(long, default_value_t = 300)]
    questions: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f64,
    /// Episodes per question (needs `--temperature` > 0): the figures become means over
    /// them (mean@k) and pass@k is reported for k = 1, 2, 4, … and this number.
    #[arg(long, default_value_t = 1)]
    samples: usize,
    /// Also write every evaluated episode (question, gold answers, answer, EM, decoded
    /// text, token-exact trajectory) to this JSON-lines file.
    #[arg(long)]
    dump: Option<PathBuf>,
}

/// Runs `turnwise eval`.
pub fn exec(args: Args) -> Result<()> {
    let Args {
        model,
        questions,
        temperature,
        samples,
        dump,
    } = args;
    // Checked before the model is loaded and the questions are answered.
    if !(temperature >= 0.0 && temperature.is_finite()) {
        bail!("--temperature must be 0 (greedy) or positive, got {temperature}");
    }
    if questions == 0 {
        bail!("--questions must be at least 1 (the number of questions to evaluate)");
    }
    if samples == 0 || (samples > 1 && temperature == 0.0) {
        bail!(
            "--samples must be 1, or more with --temperature above 0 (greedy decoding \
             draws the same episode every time), got {samples} at temperature \
             {temperature}"
        );
    }
    let split = model.split()?;
    let dump_file = dump
        .as_ref()
        .map(|path| {
            std::fs::File::create(path)
                .with_context(|| format!("creating the dump file {}", path.display()))
        })
        .transpose()?;
    let (trainer, what) = turnwise::checkpoints::open_for_eval(&model.source())?;
    eprintln!("evaluating {what}");
    let (r, episodes) = trainer.evaluate_samples(split, questions, temperature, 0, samples)?;
    if r.n == 0 {
        bail!(
            "the {} split of the task of {what} has no questions to evaluate",
            split.name()
        );
    }
    if let (Some(path), Some(mut file)) = (dump, dump_file) {
        use std::io::Write;
        let mut out = String::new();
        for e in &episodes {
            out.push_str(&serde_json::to_string(e)?);
            out.push('\n');
        }
        file.write_all(out.as_bytes())
            .with_context(|| format!("writing the episodes to {}", path.display()))?;
        eprintln!(
            "wrote {} to {}",
            turnwise::pipeline::count(episodes.len() as u64, "episode", "episodes"),
            path.display()
        );
    }
    println!("{}", serde_json::to_string_pretty(&r)?);
    Ok(())
}
