//! Number checks shared by the sections: the range predicates their `validate` functions use,
//! and the one check that reads every number of a resolved config: each is finite (unless its
//! field allows infinity), and the numbers of the KL controller's settings (a `turnwise-model`
//! type, which `[algorithm]` holds) lie in the range [`super::update::NUMBER_RANGES`] states for
//! their key. The estimators and losses check their own settings' ranges.

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

/// Every number of the resolved config, by dotted key in key order (the serialized tables'
/// order), checked: finite (only the keys of [`super::update::MAY_BE_INFINITE`] may be
/// infinite), then in the range [`super::update::NUMBER_RANGES`] gives its key, if any. Every
/// offence is reported, each under its key. Numbers inside arrays are not read.
pub(super) fn validate(cfg: &TrainConfig) -> Vec<ConfigError> {
    fn walk(prefix: &str, v: &toml::Value, out: &mut Vec<ConfigError>) {
        match v {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(&key, v, out);
                }
            }
            toml::Value::Float(x) => check_number(prefix, *x, out),
            toml::Value::Integer(i) => check_number(prefix, *i as f64, out),
            _ => {}
        }
    }
    fn check_number(key: &str, x: f64, out: &mut Vec<ConfigError>) {
        if x.is_nan() || (x.is_infinite() && !super::update::MAY_BE_INFINITE.contains(&key)) {
            out.push(ConfigError::Field {
                field: key.to_string(),
                message: format!("must be a finite number, got {x}"),
            });
            return;
        }
        if let Some((_, range)) = super::update::NUMBER_RANGES.iter().find(|(k, _)| *k == key) {
            let mut problems = Vec::new();
            range.check(&mut problems, key, x);
            out.extend(problems.into_iter().map(|p| ConfigError::Field {
                field: p.field,
                message: p.message,
            }));
        }
    }
    let mut out = Vec::new();
    match toml::Value::try_from(cfg) {
        Ok(v) => walk("", &v, &mut out),
        Err(e) => out.push(ConfigError::Parse {
            source_name: "resolved config".into(),
            message: e.to_string(),
        }),
    }
    out
}
