//! Number checks shared by the sections: the range predicates their `validate` functions use,
//! and the one check that reads every number of a resolved config: each is finite (unless its
//! field allows infinity), and the numbers of the estimators', losses' and KL controller's own
//! settings (types of `turnwise-core` and `turnwise-model`, which `[advantage]`, `[actor]` and
//! `[algorithm]` hold) lie in the range [`super::update::NUMBER_RANGES`] states for their key.

use super::{ConfigError, TrainConfig};

/// `Err` naming `field` (`must be {what}, got {got}`) unless `ok`.
pub(super) fn check(
    ok: bool,
    field: &'static str,
    what: &str,
    got: f64,
) -> Result<(), ConfigError> {
    if ok {
        Ok(())
    } else {
        Err(ConfigError::Invalid {
            field,
            message: format!("must be {what}, got {got}"),
        })
    }
}

/// Finite and above 0.
pub(super) fn positive(x: f64) -> bool {
    x > 0.0 && x.is_finite()
}

/// Finite and at least 0.
pub(super) fn non_negative(x: f64) -> bool {
    x >= 0.0 && x.is_finite()
}

/// In [0, 1).
pub(super) fn unit_open(x: f64) -> bool {
    (0.0..1.0).contains(&x)
}

/// In [0, 1].
pub(super) fn unit(x: f64) -> bool {
    (0.0..=1.0).contains(&x)
}

/// The range one number must lie in, with the words its error gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NumberRange {
    /// In [0, 1] (discount factors).
    UnitInterval,
    /// Strictly between 0 and 1 (GiGPO's and T2PO's similarity threshold: the estimator refuses
    /// 0 and 1, so the config does too instead of passing them to the first advantage step).
    OpenUnitInterval,
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

impl NumberRange {
    /// Refuses `x` under `key` when it lies outside the range.
    fn check(self, key: &str, x: f64) -> Result<(), ConfigError> {
        let fail = |what: &str| {
            Err(ConfigError::Field {
                field: key.to_string(),
                message: format!("must be {what}, got {x}"),
            })
        };
        match self {
            NumberRange::UnitInterval if !(0.0..=1.0).contains(&x) => fail("in [0, 1]"),
            NumberRange::OpenUnitInterval if !(x > 0.0 && x < 1.0) => fail(
                "in (0, 1), both ends excluded (set advantage.enable_similarity = false to \
                 match anchors exactly)",
            ),
            NumberRange::NonNegative | NumberRange::StdEpsilon if x < 0.0 => {
                fail("a non-negative number")
            }
            NumberRange::StdEpsilon if x <= 0.0 => fail(
                "positive (it is added to a group's standard deviation, which is 0 when all \
                 its scores agree)",
            ),
            NumberRange::AboveOne if x <= 1.0 => {
                fail("above 1 (the dual clip bounds ratios of negative advantages)")
            }
            NumberRange::Positive if x <= 0.0 => fail("positive"),
            _ => Ok(()),
        }
    }
}

/// Every number of the resolved config, by dotted key in key order (the serialized tables'
/// order), checked: finite (only the keys of [`super::update::MAY_BE_INFINITE`] may be
/// infinite), then in the range [`super::update::NUMBER_RANGES`] gives its key, if any. The first
/// offence is reported under its key. Numbers inside arrays are not read.
pub(super) fn validate(cfg: &TrainConfig) -> Result<(), ConfigError> {
    fn walk(prefix: &str, v: &toml::Value) -> Result<(), ConfigError> {
        match v {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(&key, v)?;
                }
                Ok(())
            }
            toml::Value::Float(x) => check_number(prefix, *x),
            toml::Value::Integer(i) => check_number(prefix, *i as f64),
            _ => Ok(()),
        }
    }
    fn check_number(key: &str, x: f64) -> Result<(), ConfigError> {
        if x.is_nan() || (x.is_infinite() && !super::update::MAY_BE_INFINITE.contains(&key)) {
            return Err(ConfigError::Field {
                field: key.to_string(),
                message: format!("must be a finite number, got {x}"),
            });
        }
        match super::update::NUMBER_RANGES.iter().find(|(k, _)| *k == key) {
            Some((_, range)) => range.check(key, x),
            None => Ok(()),
        }
    }
    let v = toml::Value::try_from(cfg).map_err(|e| ConfigError::Parse {
        source_name: "resolved config".into(),
        message: e.to_string(),
    })?;
    walk("", &v)
}
