//! Errors of the advantage estimators.

/// Why an advantage estimator refused a batch or a configuration.
///
/// Every variant names the estimator, and where it applies the offending rollout (index into
/// [`AdvantageBatch::rollouts`](super::AdvantageBatch::rollouts)) or tree and the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AdvantageError {
    /// No estimator is registered under this name.
    #[error("unknown advantage estimator `{name}` (known estimators: {known})")]
    UnknownEstimator {
        /// The name that was asked for.
        name: String,
        /// Comma-separated list of the registered names.
        known: String,
    },
    /// The settings could not be parsed or are out of range.
    #[error("invalid settings for advantage estimator `{estimator}`: {message}")]
    InvalidConfig {
        /// Estimator name.
        estimator: String,
        /// What was wrong.
        message: String,
    },
    /// Settings out of their ranges ([`Estimator::validate`](super::Estimator::validate)), every
    /// one of them, each under its field's name.
    #[error("invalid settings for advantage estimator `{estimator}`: {problems}")]
    InvalidSettings {
        /// Estimator name.
        estimator: &'static str,
        /// Each setting out of range.
        problems: crate::range::RangeErrors,
    },
    /// A rollout lacks an input that this estimator needs (e.g. GAE without `values`).
    #[error("advantage estimator `{estimator}`: rollout {rollout} is missing `{field}`")]
    MissingInput {
        /// Estimator name.
        estimator: &'static str,
        /// Index of the rollout in the batch.
        rollout: usize,
        /// The missing field.
        field: &'static str,
    },
    /// A per-token, per-turn or per-step vector has the wrong length.
    #[error(
        "advantage estimator `{estimator}`: rollout {rollout}: `{field}` has length {got}, \
         expected {expected}"
    )]
    LengthMismatch {
        /// Estimator name.
        estimator: &'static str,
        /// Index of the rollout in the batch.
        rollout: usize,
        /// The field whose length is wrong.
        field: &'static str,
        /// Its length.
        got: usize,
        /// The length it must have.
        expected: usize,
    },
    /// A NaN or infinite input value.
    #[error(
        "advantage estimator `{estimator}`: rollout {rollout}: non-finite value {value} in \
         `{field}`"
    )]
    NonFinite {
        /// Estimator name.
        estimator: &'static str,
        /// Index of the rollout in the batch (for tree inputs: index of the tree).
        rollout: usize,
        /// The field holding the value.
        field: &'static str,
        /// The offending value.
        value: f64,
    },
    /// Any other inconsistency inside one rollout.
    #[error("advantage estimator `{estimator}`: rollout {rollout}: {message}")]
    InvalidRollout {
        /// Estimator name.
        estimator: &'static str,
        /// Index of the rollout in the batch.
        rollout: usize,
        /// What was wrong.
        message: String,
    },
    /// An inconsistency inside one rollout tree (AT2PO).
    #[error("advantage estimator `{estimator}`: tree {tree}: {message}")]
    InvalidTree {
        /// Estimator name.
        estimator: &'static str,
        /// Index of the tree in [`AdvantageBatch::trees`](super::AdvantageBatch::trees).
        tree: usize,
        /// What was wrong.
        message: String,
    },
    /// `masked_whiten` needs at least two masked elements (Bessel-corrected variance, §3.3).
    #[error("masked_whiten needs at least 2 masked elements, got {count}")]
    WhitenTooFew {
        /// Number of masked elements.
        count: usize,
    },
}

/// `Ok` when `problems` is empty, else [`AdvantageError::InvalidSettings`] of `estimator` listing
/// them all (what each estimator's [`Estimator::validate`](super::Estimator::validate) returns).
pub(crate) fn settings_result(
    estimator: &'static str,
    problems: Vec<crate::range::RangeError>,
) -> Result<(), AdvantageError> {
    crate::range::RangeErrors::into_result(problems).map_err(|problems| {
        AdvantageError::InvalidSettings {
            estimator,
            problems,
        }
    })
}
