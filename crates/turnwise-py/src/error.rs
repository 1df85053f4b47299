//! The one error type of the bindings; every variant becomes a Python `ValueError`.

use pyo3::PyErr;
use pyo3::exceptions::PyValueError;
use turnwise_core::advantage::AdvantageError;
use turnwise_core::reward::RewardError;

/// Why a call from Python was refused. The message names the argument and what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum BindingError {
    /// An array has the wrong shape.
    #[error("`{arg}` has shape {got:?}, expected {expected}")]
    Shape {
        /// The argument.
        arg: &'static str,
        /// Its shape.
        got: Vec<usize>,
        /// What was expected, in words.
        expected: String,
    },
    /// A NaN or infinite value where a finite one is needed.
    #[error("`{arg}` holds a non-finite value ({value}) at index {index:?}")]
    NonFinite {
        /// The argument.
        arg: &'static str,
        /// Where the value is.
        index: Vec<usize>,
        /// The value.
        value: f64,
    },
    /// Any other invalid argument value.
    #[error("`{arg}`: {message}")]
    Invalid {
        /// The argument.
        arg: &'static str,
        /// What is wrong.
        message: String,
    },
    /// JSON that does not parse into what the argument must hold.
    #[error("`{arg}` is not valid here: {cause}")]
    Json {
        /// The argument.
        arg: &'static str,
        /// The parse error.
        cause: serde_json::Error,
    },
    /// An advantage estimator refused the batch or its settings.
    #[error(transparent)]
    Advantage(#[from] AdvantageError),
    /// A reward refused its settings or input.
    #[error(transparent)]
    Reward(#[from] RewardError),
}

impl BindingError {
    /// An [`BindingError::Invalid`] for `arg`.
    pub fn invalid(arg: &'static str, message: impl Into<String>) -> Self {
        Self::Invalid {
            arg,
            message: message.into(),
        }
    }
}

impl From<BindingError> for PyErr {
    fn from(e: BindingError) -> Self {
        PyValueError::new_err(e.to_string())
    }
}

/// Result alias of the bindings.
pub type Result<T> = std::result::Result<T, BindingError>;

/// Parses `text` (the JSON form of argument `arg`) into `T`.
pub fn from_json<T: serde::de::DeserializeOwned>(arg: &'static str, text: &str) -> Result<T> {
    serde_json::from_str(text).map_err(|cause| BindingError::Json { arg, cause })
}

/// Serializes a result for Python (`json.loads` on the other side).
pub fn to_json<T: serde::Serialize>(arg: &'static str, value: &T) -> Result<String> {
    serde_json::to_string(value).map_err(|cause| BindingError::Json { arg, cause })
}
