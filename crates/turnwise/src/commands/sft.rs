//! `turnwise sft`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use turnwise_env::world::Split;

use super::common::resolve_train_config;

/// Supervised warm start only: train a fresh model on oracle demonstrations (or a
/// demonstrations file via `--set sft.demonstrations=FILE`), then, with `--rejection` (or
/// when the preset enables `rsft`), the rejection-sampling fine-tuning on its own correct
/// rollouts, and export it as a Hugging Face folder (config.json, model.safetensors,
/// tokenizer.json).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Preset whose task, model and warm-start settings to use (grpo when neither it nor
    /// `--config` is given).
    #[arg(long)]
    preset: Option<String>,
    /// A TOML config file applied over the preset (as for `train`).
    #[arg(long)]
    config: Option<PathBuf>,
    /// `key=value` overrides.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Output folder.
    #[arg(long)]
    out: PathBuf,
    /// Follow the warm start with rejection-sampling fine-tuning (T2PO's RFT; settings
    /// under `rsft.*`, e.g. `--set rsft.threshold=1.0`). Same as `--set rsft.enabled=true`.
    #[arg(long)]
    rejection: bool,
    /// Replace an earlier export in `--out` (without it, a non-empty `--out` is refused;
    /// a folder that holds no model export is never replaced).
    #[arg(long)]
    overwrite: bool,
}

/// Runs `turnwise sft`.
pub fn exec(args: Args, quiet: bool) -> Result<()> {
    let Args {
        preset,
        config,
        mut sets,
        out,
        rejection,
        overwrite,
    } = args;
    // Checked before the warm start, not after it; cleared only once there is a model
    // to write.
    let prepared = turnwise::checkpoints::check_export_dir(&out, overwrite, &[])?;
    if rejection {
        sets.push("rsft.enabled=true".into());
    }
    let preset = match (&preset, &config) {
        (None, None) => Some("grpo"),
        _ => preset.as_deref(),
    };
    let cfg = resolve_train_config(preset, config.as_deref(), &sets)?;
    let steps = cfg.sft.steps;
    let mut trainer = turnwise::trainer::Trainer::new(cfg.clone())?;
    let bar = turnwise::run::Progress::new("warm start", steps, quiet);
    let t = Instant::now();
    trainer.warm_start(&mut |step, loss, _| {
        bar.set_position(step);
        bar.set_message(format!("loss {loss:.4}"));
    })?;
    bar.finish(format!(
        "{} in {:.0} s",
        turnwise::pipeline::count(steps, "step", "steps"),
        t.elapsed().as_secs_f64()
    ));
    if cfg.rsft.enabled {
        turnwise::pipeline::rejection_phase(&mut trainer, &cfg, None, quiet)?;
    }
    let r = trainer.evaluate(Split::Validation, 100, 0.0, 0)?;
    let owner = prepared.clear()?;
    let before = turnwise::ownership::top_level_names(&out);
    trainer.export(&out)?;
    turnwise::checkpoints::record_export(owner.as_ref(), &before)?;
    if !quiet {
        println!(
            "wrote {} (validation EM {:.1}% greedy on {})",
            out.display(),
            r.em * 100.0,
            turnwise::pipeline::count(r.n as u64, "question", "questions")
        );
    }
    Ok(())
}
