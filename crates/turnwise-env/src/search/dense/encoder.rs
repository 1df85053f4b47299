//! The sentence encoder: tokenizer + [`BertModel`] + mean pooling + L2 normalisation, as
//! sentence-transformers' `all-MiniLM-L6-v2` pipeline (`Transformer → Pooling(mean) → Normalize`).
//!
//! [`SentenceEncoder::encode`] tokenises every text (truncated to
//! [`EncoderOptions::max_seq_length`] tokens including `[CLS]` and `[SEP]`), sorts the texts by
//! token count (as sentence-transformers does), runs the model on batches of
//! [`EncoderOptions::batch_size`] texts (unpadded: see [`super::bert`]), pools, normalises, and
//! returns the embeddings in the input order. A text's embedding does not depend on the batch
//! it is in beyond float rounding (about `1e-7`).

use std::path::{Path, PathBuf};

use tokenizers::{Tokenizer, TruncationParams, TruncationStrategy};

use super::DenseError;
use super::bert::{BertConfig, BertModel};
use super::model::model_dir;

/// Encoding settings.
#[derive(Debug, Clone, PartialEq)]
pub struct EncoderOptions {
    /// Longest input in tokens, `[CLS]` and `[SEP]` included; longer texts are truncated. `None`
    /// reads `max_seq_length` from the model folder's `sentence_bert_config.json` (256 for
    /// all-MiniLM-L6-v2), falling back to the model's `max_position_embeddings`.
    pub max_seq_length: Option<usize>,
    /// Texts per forward pass. Default 32 (sentence-transformers' default).
    pub batch_size: usize,
}

impl Default for EncoderOptions {
    fn default() -> Self {
        EncoderOptions {
            max_seq_length: None,
            batch_size: 32,
        }
    }
}

/// Row-major embeddings: `len()` rows of `dim` floats.
#[derive(Debug, Clone, PartialEq)]
pub struct Embeddings {
    /// Width of each row.
    pub dim: usize,
    /// `len() * dim` values, row after row.
    pub data: Vec<f32>,
}

impl Embeddings {
    /// Number of rows.
    pub fn len(&self) -> usize {
        self.data.len().checked_div(self.dim).unwrap_or(0)
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Row `i` (panics when out of range).
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.dim..(i + 1) * self.dim]
    }

    /// The rows in order.
    pub fn rows(&self) -> impl Iterator<Item = &[f32]> {
        self.data.chunks_exact(self.dim.max(1))
    }
}

/// all-MiniLM-L6-v2 (or any BERT sentence encoder with mean pooling) on the CPU.
/// Cheap to share between threads behind an `Arc`.
pub struct SentenceEncoder {
    model: BertModel,
    tokenizer: Tokenizer,
    max_seq_length: usize,
    batch_size: usize,
    dir: PathBuf,
}

impl std::fmt::Debug for SentenceEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentenceEncoder")
            .field("dir", &self.dir)
            .field("dim", &self.dim())
            .field("max_seq_length", &self.max_seq_length)
            .field("batch_size", &self.batch_size)
            .finish()
    }
}

#[derive(serde::Deserialize)]
struct SentenceBertConfig {
    max_seq_length: Option<usize>,
}

impl SentenceEncoder {
    /// Loads a Hugging Face model folder (`config.json`, `model.safetensors`, `tokenizer.json`,
    /// optionally `sentence_bert_config.json`).
    pub fn load(dir: impl AsRef<Path>, options: &EncoderOptions) -> Result<Self, DenseError> {
        let dir = dir.as_ref();
        let config = BertConfig::from_file(dir.join("config.json"))?;
        let max_positions = config.max_position_embeddings;
        let model = BertModel::load(config, dir.join("model.safetensors"))?;
        let st_config = dir.join("sentence_bert_config.json");
        let configured = match options.max_seq_length {
            Some(n) => Some(n),
            None if st_config.is_file() => {
                let text = std::fs::read_to_string(&st_config)
                    .map_err(|e| DenseError::io(&st_config, e))?;
                serde_json::from_str::<SentenceBertConfig>(&text)
                    .map_err(|e| DenseError::Model {
                        path: st_config.clone(),
                        message: e.to_string(),
                    })?
                    .max_seq_length
            }
            None => None,
        };
        let max_seq_length = configured.unwrap_or(max_positions).min(max_positions);
        if max_seq_length < 2 || options.batch_size == 0 {
            return Err(DenseError::Model {
                path: dir.to_path_buf(),
                message: format!(
                    "max_seq_length {max_seq_length} must be at least 2 and batch_size {} positive",
                    options.batch_size
                ),
            });
        }
        let tok_path = dir.join("tokenizer.json");
        let mut tokenizer = Tokenizer::from_file(&tok_path).map_err(|e| DenseError::Model {
            path: tok_path.clone(),
            message: format!("cannot load tokenizer: {e}"),
        })?;
        tokenizer
            .with_truncation(Some(TruncationParams {
                max_length: max_seq_length,
                strategy: TruncationStrategy::LongestFirst,
                ..TruncationParams::default()
            }))
            .map_err(|e| DenseError::Model {
                path: tok_path.clone(),
                message: format!("cannot set truncation: {e}"),
            })?;
        tokenizer.with_padding(None);
        Ok(SentenceEncoder {
            model,
            tokenizer,
            max_seq_length,
            batch_size: options.batch_size,
            dir: dir.to_path_buf(),
        })
    }

    /// Fetches the model into `cache_dir` if needed ([`model_dir`]) and loads it with the default
    /// options.
    pub fn from_cache(cache_dir: impl AsRef<Path>) -> Result<Self, DenseError> {
        let dir = model_dir(cache_dir)?;
        Self::load(dir, &EncoderOptions::default())
    }

    /// [`Self::from_cache`] on [`crate::corpus::wiki::default_cache_dir`] (`$TURNWISE_CACHE`,
    /// else `~/.cache/turnwise`).
    pub fn from_default_cache() -> Result<Self, DenseError> {
        Self::from_cache(crate::corpus::wiki::default_cache_dir())
    }

    /// Embedding width (384 for all-MiniLM-L6-v2).
    pub fn dim(&self) -> usize {
        self.model.config().hidden_size
    }

    /// Longest input in tokens.
    pub fn max_seq_length(&self) -> usize {
        self.max_seq_length
    }

    /// Texts per forward pass.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The model folder this encoder was loaded from.
    pub fn model_dir(&self) -> &Path {
        &self.dir
    }

    /// Token ids of `text` as the model sees them (`[CLS] … [SEP]`, truncated).
    pub fn token_ids(&self, text: &str) -> Result<Vec<u32>, DenseError> {
        let enc = self
            .tokenizer
            .encode_fast(text, true)
            .map_err(|e| DenseError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Unit-norm embeddings of `texts`, in order (see the module docs).
    pub fn encode<S: AsRef<str>>(&self, texts: &[S]) -> Result<Embeddings, DenseError> {
        let dim = self.dim();
        let inputs: Vec<&str> = texts.iter().map(AsRef::as_ref).collect();
        let encodings = self
            .tokenizer
            .encode_batch_fast(inputs, true)
            .map_err(|e| DenseError::Tokenizer(e.to_string()))?;
        let ids: Vec<&[u32]> = encodings.iter().map(|e| e.get_ids()).collect();
        let mut order: Vec<usize> = (0..ids.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(ids[i].len()));
        let mut data = vec![0f32; ids.len() * dim];
        for chunk in order.chunks(self.batch_size) {
            let batch: Vec<&[u32]> = chunk.iter().map(|&i| ids[i]).collect();
            let rows = self.model.embed(&batch)?;
            for (r, &i) in chunk.iter().enumerate() {
                data[i * dim..(i + 1) * dim].copy_from_slice(&rows[r * dim..(r + 1) * dim]);
            }
        }
        Ok(Embeddings { dim, data })
    }
}
