//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong in the embedded policy backend, each variant naming what failed
/// and where.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A tensor operation failed inside candle.
    #[error("tensor operation failed: {0}")]
    Candle(candle_core::Error),
    /// A file could not be read or written.
    #[error("i/o error on {path}: {cause}")]
    Io {
        /// The file or folder involved.
        path: PathBuf,
        /// The underlying error.
        cause: std::io::Error,
    },
    /// A JSON document could not be parsed or written.
    #[error("invalid JSON in {what}: {cause}")]
    Json {
        /// What was being parsed (usually a path).
        what: String,
        /// The underlying error.
        cause: serde_json::Error,
    },
    /// A model configuration field is missing or has an unusable value.
    #[error("invalid model config: field `{field}`: {reason}")]
    InvalidConfig {
        /// The config.json field at fault.
        field: String,
        /// Why the value is rejected.
        reason: String,
    },
    /// A tensor the model needs is absent from the weights.
    #[error("missing tensor `{name}` in {source_desc}")]
    MissingTensor {
        /// Hugging Face parameter name.
        name: String,
        /// Where it was looked for (a file, a folder, a VarMap).
        source_desc: String,
    },
    /// A tensor has a different shape than the config implies.
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?} from the config")]
    ShapeMismatch {
        /// Hugging Face parameter name.
        name: String,
        /// Shape implied by the config.
        expected: Vec<usize>,
        /// Shape found in the weights.
        found: Vec<usize>,
    },
    /// An argument to a model function has the wrong shape, dtype or value.
    #[error("invalid input `{arg}`: {reason}")]
    InvalidInput {
        /// The argument at fault.
        arg: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A checkpoint is incomplete or inconsistent with the objects it is loaded into.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The checkpoint file or folder.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A GGUF file could not be loaded (the error names the file).
    #[error(transparent)]
    Gguf(#[from] crate::checkpoint::gguf::GgufError),
    /// A tokenizer could not be built, trained, loaded, saved or run.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A weights file holds NaN or infinite values.
    #[error(
        "{path}: tensor `{tensor}` holds {count} NaN or infinite values (of {total}): the file \
         is corrupt or was written after training diverged"
    )]
    NonFinite {
        /// The safetensors file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// How many of its values are NaN or infinite.
        count: usize,
        /// How many values it has.
        total: usize,
    },
}

// The wrapped error is printed in the variant's message, so it is not also its `source()`: a
// report that walks the causes (`{:#}`, `turnwise`'s error line) would print it twice.
impl From<candle_core::Error> for ModelError {
    fn from(e: candle_core::Error) -> Self {
        Self::Candle(e)
    }
}

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, ModelError>;

impl ModelError {
    /// Builds an [`ModelError::InvalidInput`].
    pub fn invalid_input(arg: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::InvalidInput {
            arg: arg.into(),
            reason: reason.into(),
        }
    }

    /// Builds an [`ModelError::InvalidConfig`].
    pub fn invalid_config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::InvalidConfig {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// Wraps an I/O error with its path.
    pub fn io(path: impl Into<PathBuf>, cause: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            cause,
        }
    }
}
