//! Checkpoints as a user handles them: exporting one checkpoint of a run as a clean Hugging
//! Face folder (`turnwise export`), and opening any checkpoint or exported folder for
//! evaluation (`turnwise eval --checkpoint`).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use candle_core::{DType, Device};
use turnwise_model::checkpoint::{ADAPTER_DIR, export_hf_folder_tensors};
use turnwise_model::model::lora::{is_adapter_folder, load_peft_adapter, merge_adapters};
use turnwise_model::model::weights::{load_hf, varmap_from_tensors};
use turnwise_model::tokenizer::TextTokenizer;

use crate::config::TrainConfig;
pub use crate::config::run_config;
use crate::ownership::{self, Prepared};
pub use crate::run::pick_checkpoint;
use crate::run::{Checkpoint, RunDir};
use crate::trainer::{
    EXPORT_CONFIG_FILE, Trainer, checkpoint_metadata, write_export_adapter, write_export_config,
};

/// What a model export writes at its top level (`turnwise export`, `turnwise sft --out`):
/// `--overwrite` replaces these and nothing else.
pub const EXPORT_ENTRIES: &[&str] = &[
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    EXPORT_CONFIG_FILE,
    ADAPTER_DIR,
];

/// Checks that `out` may receive a model export: absent, an empty directory, or, with
/// `overwrite`, an earlier turnwise export, recognised by its ownership manifest
/// ([`crate::ownership`]), whose files are all as the export wrote them and that holds none of
/// `keep` (the checkpoint exported, its run). Anything else is refused by name, so a mistyped
/// path (a project folder, a downloaded model, a folder that only holds a `turnwise.toml`) is
/// never written into. Nothing is deleted yet: [`Prepared::clear`] does it, once there is a
/// model to write.
pub fn check_export_dir(out: &Path, overwrite: bool, keep: &[&Path]) -> Result<Prepared> {
    if out.is_dir() && !overwrite && !ownership::is_empty_but(out, &[])? {
        bail!(
            "{} is not empty (pass --overwrite to replace the model turnwise exported there)",
            out.display()
        );
    }
    if out.is_dir()
        && overwrite
        && !ownership::is_empty_but(out, &[])?
        && !out.join(ownership::MANIFEST_FILE).exists()
    {
        bail!(
            "{} holds no model export turnwise made (no {}, which lists the files of every \
             export), so nothing in it is replaced; move or delete its contents by hand, or give \
             another --out",
            out.display(),
            ownership::MANIFEST_FILE
        );
    }
    if out.is_dir() {
        let out_abs = out
            .canonicalize()
            .with_context(|| format!("resolving {}", out.display()))?;
        for k in keep {
            if let Ok(k) = k.canonicalize()
                && k.starts_with(&out_abs)
            {
                bail!(
                    "refusing to replace {}: it holds {}",
                    out.display(),
                    k.display()
                );
            }
        }
    }
    Ok(ownership::prepare(
        out,
        ownership::Kind::Export,
        EXPORT_ENTRIES,
        overwrite,
        false,
    )?)
}

/// Records what an export wrote in the folder of `owner` ([`EXPORT_ENTRIES`], and whatever
/// else is new since `before`, e.g. a source model's extra tokenizer files) in its manifest.
pub fn record_export(
    owner: Option<&ownership::Owner>,
    before: &std::collections::BTreeSet<String>,
) -> Result<()> {
    if let Some(owner) = owner {
        ownership::note_new_outputs(owner, EXPORT_ENTRIES, before)?;
    }
    Ok(())
}

/// `turnwise export`: writes checkpoint `step` of `run` (default: the latest complete one) into
/// `out` as a clean Hugging Face folder: config.json, model.safetensors, tokenizer.json,
/// tokenizer_config.json, generation_config.json (and the source checkpoint's other tokenizer
/// files) with the run's config as `turnwise.toml`; no optimizer state, trainer state or
/// completion marker. Returns the checkpoint exported.
pub fn export_checkpoint(
    run: &Path,
    step: Option<u64>,
    out: &Path,
    overwrite: bool,
) -> Result<Checkpoint> {
    let dir = RunDir::open(run)?;
    let cfg = run_config(&dir)?;
    let ck = pick_checkpoint(&dir, step)?;
    let prepared = check_export_dir(out, overwrite, &[&ck.path, dir.root()])?;
    let (mc, tensors) = load_hf(&ck.path, DType::F32, &Device::Cpu)
        .with_context(|| format!("loading the checkpoint {}", ck.path.display()))?;
    // Checks the names and shapes of the weights.
    varmap_from_tensors(&mc, &tensors, &ck.path.display().to_string())?;
    // A LoRA checkpoint holds the frozen base and the adapters: the export is the merged model.
    let adapter_dir = ck.path.join(ADAPTER_DIR);
    let lora = match is_adapter_folder(&adapter_dir) {
        true => Some(
            load_peft_adapter(&adapter_dir, DType::F32, &Device::Cpu)
                .with_context(|| format!("loading the adapters {}", adapter_dir.display()))?,
        ),
        false => None,
    };
    let tensors = match &lora {
        Some((lc, adapters)) => merge_adapters(&mc, lc, &tensors, adapters)?,
        None => tensors,
    };
    let tokenizer = TextTokenizer::from_file(ck.path.join("tokenizer.json"))?;
    let meta = checkpoint_metadata(&ck.path, cfg.model.init_from.as_deref())?;
    let owner = prepared.clear()?;
    let before = ownership::top_level_names(out);
    export_hf_folder_tensors(out, &mc, &tensors, &tokenizer, &meta)
        .with_context(|| format!("exporting to {}", out.display()))?;
    if let Some((lc, adapters)) = &lora {
        write_export_adapter(out, lc, adapters, &cfg)?;
    }
    write_export_config(out, &cfg)?;
    record_export(owner.as_ref(), &before)?;
    Ok(ck)
}

/// What `turnwise eval` evaluates: a run (its latest complete checkpoint unless `checkpoint`
/// names one) or a checkpoint folder, with the config that says the task.
#[derive(Debug, Clone, Default)]
pub struct EvalSource<'a> {
    /// `--run DIR`.
    pub run: Option<&'a Path>,
    /// `--checkpoint PATH`: a checkpoint folder of a run, a Hugging Face folder (an `sft
    /// --out` or `turnwise export` folder, or any supported checkpoint), or a GGUF file.
    pub checkpoint: Option<&'a Path>,
    /// `--preset NAME`: the task of a folder that carries no config.
    pub preset: Option<&'a str>,
    /// `--config FILE`.
    pub config: Option<&'a Path>,
    /// `--set KEY=VALUE` (with `--preset` or `--config`).
    pub sets: &'a [String],
}

/// A config for `source`: `--run`'s, else `--preset`/`--config`, else the checkpoint folder's
/// `turnwise.toml`, else that of the run the checkpoint folder belongs to.
fn eval_config(source: &EvalSource<'_>) -> Result<TrainConfig> {
    let explicit = source.preset.is_some() || source.config.is_some();
    if !source.sets.is_empty() && !explicit {
        bail!("--set applies with --preset or --config");
    }
    if let Some(run) = source.run {
        if explicit {
            bail!("--run takes the run's own config: leave out --preset and --config");
        }
        return run_config(&RunDir::open(run)?);
    }
    if explicit {
        let cfg = TrainConfig::resolve(source.preset, source.config, source.sets)?;
        if let Some(ck) = source.checkpoint
            && let Ok(Some(own)) = checkpoint_config(ck)
        {
            let differing = crate::run::differing_world_keys(&[
                crate::run::world_settings(&cfg.to_toml())?,
                crate::run::world_settings(&own.to_toml())?,
            ]);
            if !differing.is_empty() {
                tracing::warn!(
                    "--preset/--config replace the config {} was trained with, and its world \
                     differs ({} differ): the questions are not the ones it was trained and \
                     evaluated on; leave out --preset and --config to use its own",
                    ck.display(),
                    differing.join(", ")
                );
            }
        }
        return Ok(cfg);
    }
    let Some(ck) = source.checkpoint else {
        bail!("give --run DIR or --checkpoint PATH");
    };
    if let Some(cfg) = checkpoint_config(ck)? {
        return Ok(cfg);
    }
    bail!(
        "{} has no {EXPORT_CONFIG_FILE} and is not inside a run directory: give --preset or \
         --config to say which task to evaluate on",
        ck.display()
    )
}

/// The config a checkpoint carries: its own [`EXPORT_CONFIG_FILE`] (an exported model), or
/// its run's config.toml (`checkpoints/step-NNNNN` inside a run directory); `None` without
/// either.
fn checkpoint_config(ck: &Path) -> Result<Option<TrainConfig>> {
    let own = ck.join(EXPORT_CONFIG_FILE);
    if own.is_file() {
        let text =
            std::fs::read_to_string(&own).with_context(|| format!("reading {}", own.display()))?;
        let table = text
            .parse::<toml::Table>()
            .with_context(|| format!("parsing {}", own.display()))?;
        return Ok(Some(TrainConfig::from_table(table)?));
    }
    if let Some(run) = ck.parent().and_then(Path::parent)
        && run.join("config.toml").is_file()
    {
        return Ok(Some(run_config(&RunDir::open(run)?)?));
    }
    Ok(None)
}

/// Opens what `source` names for evaluation; returns the trainer and a description of the
/// checkpoint (its path, and its step when it is a run's checkpoint).
pub fn open_for_eval(source: &EvalSource<'_>) -> Result<(Trainer, String)> {
    let mut cfg = eval_config(source)?;
    let path: PathBuf = match (source.checkpoint, source.run) {
        // A packaged model's name (`smollm2-135m-instruct`) as `serve --model` and
        // `model.init_from` take it.
        (Some(p), _) => {
            crate::model_source::resolve(p, &turnwise_env::corpus::wiki::default_cache_dir())?
        }
        (None, Some(run)) => {
            let ck = pick_checkpoint(&RunDir::open(run)?, None)
                .with_context(|| format!("{} has no checkpoint to evaluate", run.display()))?;
            ck.path
        }
        (None, None) => bail!("give --run DIR or --checkpoint PATH"),
    };
    let gguf = path.is_file() && turnwise_model::checkpoint::gguf::is_gguf_file(&path);
    if path.is_file() && !gguf {
        bail!("{}", crate::model_source::not_gguf(&path));
    }
    if !path.is_dir() && !gguf {
        bail!("{} is neither a directory nor a GGUF file", path.display());
    }
    if path.join("trainer_state.json").is_file() && path.join("optimizer.safetensors").is_file() {
        // A run's checkpoint: loaded as resuming would (prompts, chat template, step).
        let t = Trainer::load(cfg, &path, None)?;
        let desc = format!("checkpoint {} (RL step {})", path.display(), t.step);
        return Ok((t, desc));
    }
    // A Hugging Face folder or a GGUF file: the model of `model.init_from`, the task of the
    // config.
    cfg.model.init_from = Some(path.clone());
    let t = Trainer::new(cfg)?;
    let what = if gguf { "GGUF file" } else { "model folder" };
    Ok((t, format!("{what} {}", path.display())))
}
