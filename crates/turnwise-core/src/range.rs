//! The ranges of settings' numbers, checked by the part that owns the settings (an estimator's
//! [`Estimator::validate`](crate::advantage::Estimator::validate), a policy loss's settings in
//! `turnwise-model`), so that the config, the trainer and the Python package refuse the same
//! values with the same words. A part reports every setting out of range at once, each under its
//! field's name relative to the part (`gamma`); the config prefixes its section
//! (`advantage.gamma`).

use std::fmt;

/// One setting out of its range: the field (relative to the part that owns it) and what is wrong.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("`{field}` {message}")]
pub struct RangeError {
    /// The field, relative to its part (`similarity_thresh`, `policy.clip_ratio`).
    pub field: String,
    /// What is wrong and what is allowed (`must be in [0, 1], got 1.5`).
    pub message: String,
}

/// Every setting of one part that lies out of its range, in the part's field order (never empty
/// when returned as an error).
#[derive(Debug, Clone, PartialEq)]
pub struct RangeErrors(pub Vec<RangeError>);

impl fmt::Display for RangeErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl RangeErrors {
    /// `Ok` when `problems` is empty, else `Err` of them all.
    pub fn into_result(problems: Vec<RangeError>) -> Result<(), RangeErrors> {
        if problems.is_empty() {
            Ok(())
        } else {
            Err(RangeErrors(problems))
        }
    }
}

/// Adds a [`RangeError`] under `field` (`must be {what}, got {got}`) to `problems` unless `ok`.
pub fn check(problems: &mut Vec<RangeError>, ok: bool, field: &str, what: &str, got: f64) {
    if !ok {
        problems.push(RangeError {
            field: field.to_string(),
            message: format!("must be {what}, got {got}"),
        });
    }
}

/// The range one number must lie in, with the words its error gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Range {
    /// In [0, 1] (discount factors).
    UnitInterval,
    /// At least 0 (coefficients, KL targets and horizons, clip scales).
    NonNegative,
    /// Above 0: an estimator's ε added to a group's standard deviation, which is 0 whenever
    /// every score of the group agrees (0 gives NaN advantages). A negative value is refused as
    /// not non-negative, 0 as not positive.
    StdEpsilon,
    /// Above 0 (clip ratios).
    Positive,
    /// Above 1 (the dual clip `clip_ratio_c`).
    AboveOne,
}

impl Range {
    /// Adds a [`RangeError`] under `field` to `problems` when `x` lies outside the range. NaN
    /// passes the one-sided ranges (a config refuses it as not finite before).
    pub fn check(self, problems: &mut Vec<RangeError>, field: &str, x: f64) {
        let what = match self {
            Range::UnitInterval if !(0.0..=1.0).contains(&x) => "in [0, 1]",
            Range::NonNegative | Range::StdEpsilon if x < 0.0 => "a non-negative number",
            Range::StdEpsilon if x <= 0.0 => {
                "positive (it is added to a group's standard deviation, which is 0 when all its \
                 scores agree)"
            }
            Range::AboveOne if x <= 1.0 => {
                "above 1 (the dual clip bounds ratios of negative advantages)"
            }
            Range::Positive if x <= 0.0 => "positive",
            _ => return,
        };
        check(problems, false, field, what, x);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_range_refuses_outside_and_passes_inside_with_its_words() {
        let refused = |range: Range, x: f64| {
            let mut p = Vec::new();
            range.check(&mut p, "k", x);
            p.first().map(|e| e.to_string())
        };
        assert_eq!(
            refused(Range::UnitInterval, 1.5).as_deref(),
            Some("`k` must be in [0, 1], got 1.5")
        );
        assert_eq!(refused(Range::UnitInterval, 1.0), None);
        assert_eq!(
            refused(Range::NonNegative, -1.0).as_deref(),
            Some("`k` must be a non-negative number, got -1")
        );
        assert_eq!(refused(Range::NonNegative, 0.0), None);
        assert!(
            refused(Range::StdEpsilon, 0.0)
                .unwrap()
                .contains("positive (it is added")
        );
        assert!(
            refused(Range::StdEpsilon, -1.0)
                .unwrap()
                .contains("non-negative")
        );
        assert_eq!(refused(Range::StdEpsilon, 1e-9), None);
        assert!(
            refused(Range::Positive, 0.0)
                .unwrap()
                .contains("must be positive")
        );
        assert!(refused(Range::AboveOne, 1.0).unwrap().contains("above 1"));
        assert_eq!(refused(Range::AboveOne, 1.01), None);
    }

    #[test]
    fn every_problem_is_listed() {
        let mut p = Vec::new();
        Range::UnitInterval.check(&mut p, "gamma", 2.0);
        Range::StdEpsilon.check(&mut p, "epsilon", 0.0);
        let e = RangeErrors::into_result(p).unwrap_err().to_string();
        assert!(
            e.starts_with("`gamma` must be in [0, 1], got 2; `epsilon` must be positive"),
            "{e}"
        );
        assert_eq!(RangeErrors::into_result(Vec::new()), Ok(()));
    }

    /// Every estimator's defaults lie in their ranges; a GiGPO or T2PO threshold of 1 is refused
    /// by `validate` (through the registry) under its field, and `estimate` refuses it with the
    /// same error.
    #[test]
    fn estimators_check_their_settings_with_one_function() {
        use crate::advantage::{
            AdvantageBatch, AdvantageConfig, AdvantageError, ESTIMATORS, Estimator,
        };
        for (name, _) in ESTIMATORS {
            let cfg = AdvantageConfig::default_for(name).unwrap();
            assert_eq!(cfg.validate(), Ok(()), "{name}");
        }
        for name in ["gigpo", "t2po"] {
            let settings = serde_json::json!({"enable_similarity": true, "similarity_thresh": 1.0,
                "gamma": 2.0});
            let cfg = AdvantageConfig::from_settings(name, settings).unwrap();
            let err = cfg.validate().unwrap_err();
            let AdvantageError::InvalidSettings { problems, .. } = &err else {
                panic!("{name}: {err}");
            };
            let fields: Vec<&str> = problems.0.iter().map(|p| p.field.as_str()).collect();
            assert_eq!(fields, ["gamma", "similarity_thresh"], "{name}");
            assert_eq!(
                cfg.estimate(&AdvantageBatch::new(Vec::new())).unwrap_err(),
                err
            );
        }
    }
}
