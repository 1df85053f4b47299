//! Estimators registered at run time (verl's `register_adv_est`): an estimator of the user's
//! own crate, or of a test fixture, is its file and one call of [`register`]. It is then named
//! in a config like a built-in one (`[advantage] estimator = "its_name"`, its settings beside),
//! validated by the same declarations ([`Estimator::needs`], [`Estimator::emits`], ...) and run
//! by the same trainer.

use std::any::TypeId;
use std::fmt;
use std::sync::{Arc, RwLock};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::{AdvantageError, ESTIMATORS, Estimator};

/// What an estimator needs to be registered: settings that read from and write to a config
/// table (unset fields take its [`Default`]), shareable across the trainer's threads.
pub trait Registrable:
    Estimator + Default + Serialize + DeserializeOwned + Send + Sync + 'static
{
}

impl<T: Estimator + Default + Serialize + DeserializeOwned + Send + Sync + 'static> Registrable
    for T
{
}

/// The shareable estimator behind a registered entry.
type Shared = Arc<dyn Estimator + Send + Sync>;

/// A settings table (with every default filled in).
type Settings = serde_json::Map<String, serde_json::Value>;

/// Builds an estimator and its canonical settings from a settings table.
type Build = fn(serde_json::Value) -> Result<(Shared, Settings), String>;

/// One registered estimator.
struct Entry {
    name: &'static str,
    doc: &'static str,
    type_id: TypeId,
    build: Build,
}

static REGISTERED: RwLock<Vec<Entry>> = RwLock::new(Vec::new());

fn build<T: Registrable>(settings: serde_json::Value) -> Result<(Shared, Settings), String> {
    let t: T = serde_json::from_value(settings).map_err(|e| e.to_string())?;
    let canonical = match serde_json::to_value(&t).map_err(|e| e.to_string())? {
        serde_json::Value::Object(m) => m,
        other => return Err(format!("its settings must be a table, got {other}")),
    };
    Ok((Arc::new(t), canonical))
}

/// Registers estimator `T` under its [`Estimator::name`], with a one-line description (what
/// `ESTIMATORS` holds for the built-in ones). Registering the same type again is a no-op; a
/// name that a built-in estimator or another type already has is an error.
pub fn register<T: Registrable>(doc: &'static str) -> Result<(), AdvantageError> {
    let name = T::default().name();
    let taken = |why: &str| AdvantageError::InvalidConfig {
        estimator: name.to_string(),
        message: format!("cannot register it: {why}"),
    };
    if ESTIMATORS.iter().any(|(n, _)| *n == name) {
        return Err(taken("a built-in estimator has that name"));
    }
    let mut reg = REGISTERED.write().unwrap_or_else(|e| e.into_inner());
    match reg.iter().find(|e| e.name == name) {
        Some(e) if e.type_id == TypeId::of::<T>() => Ok(()),
        Some(_) => Err(taken("another registered estimator has that name")),
        None => {
            reg.push(Entry {
                name,
                doc,
                type_id: TypeId::of::<T>(),
                build: build::<T>,
            });
            Ok(())
        }
    }
}

/// The registered estimators' names and descriptions, in registration order.
pub fn registered() -> Vec<(&'static str, &'static str)> {
    let reg = REGISTERED.read().unwrap_or_else(|e| e.into_inner());
    reg.iter().map(|e| (e.name, e.doc)).collect()
}

/// Whether `name` is a registered (not built-in) estimator.
pub(crate) fn is_registered(name: &str) -> bool {
    let reg = REGISTERED.read().unwrap_or_else(|e| e.into_inner());
    reg.iter().any(|e| e.name == name)
}

/// The settings of a registered estimator, as a config holds them
/// ([`AdvantageConfig::Registered`]): its name, its settings with every default filled in, and
/// the estimator they make.
#[derive(Clone)]
pub struct RegisteredEstimator {
    name: &'static str,
    settings: serde_json::Map<String, serde_json::Value>,
    estimator: Shared,
}

impl RegisteredEstimator {
    /// Settings of registered estimator `name` from a JSON object of its fields (an
    /// `estimator` key, if present, is ignored).
    pub fn from_settings(
        name: &str,
        mut settings: serde_json::Map<String, serde_json::Value>,
    ) -> Result<Self, AdvantageError> {
        settings.remove("estimator");
        let reg = REGISTERED.read().unwrap_or_else(|e| e.into_inner());
        let entry = reg
            .iter()
            .find(|e| e.name == name)
            .ok_or_else(|| super::registry::unknown(name))?;
        let (estimator, settings) =
            (entry.build)(serde_json::Value::Object(settings)).map_err(|message| {
                AdvantageError::InvalidConfig {
                    estimator: name.to_string(),
                    message,
                }
            })?;
        Ok(Self {
            name: entry.name,
            settings,
            estimator,
        })
    }

    /// The estimator.
    pub(crate) fn estimator(&self) -> &dyn Estimator {
        &*self.estimator
    }
}

impl fmt::Debug for RegisteredEstimator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegisteredEstimator")
            .field("name", &self.name)
            .field("settings", &self.settings)
            .finish()
    }
}

impl PartialEq for RegisteredEstimator {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name && self.settings == other.settings
    }
}

impl Serialize for RegisteredEstimator {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.settings.len() + 1))?;
        m.serialize_entry("estimator", self.name)?;
        for (k, v) in &self.settings {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

impl<'de> Deserialize<'de> for RegisteredEstimator {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let map = serde_json::Map::<String, serde_json::Value>::deserialize(d)?;
        let name = match map.get("estimator") {
            Some(serde_json::Value::String(s)) => s.clone(),
            _ => return Err(D::Error::missing_field("estimator")),
        };
        Self::from_settings(&name, map).map_err(D::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::advantage::AdvantageConfig;
    use crate::advantage::output::turn_constant;
    use crate::advantage::{AdvantageBatch, AdvantageOutput, Rollout};

    /// A two-line estimator: every turn gets the outcome times `scale`.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(default, deny_unknown_fields)]
    struct Scaled {
        scale: f64,
    }

    impl Default for Scaled {
        fn default() -> Self {
            Self { scale: 2.0 }
        }
    }

    impl Estimator for Scaled {
        fn name(&self) -> &'static str {
            "scaled_outcome"
        }

        fn estimate(&self, batch: &AdvantageBatch) -> Result<AdvantageOutput, AdvantageError> {
            Ok(AdvantageOutput {
                estimator: self.name().to_string(),
                rollouts: batch
                    .rollouts
                    .iter()
                    .map(|r| turn_constant(&r.turn_id, vec![r.outcome * self.scale; r.num_turns]))
                    .collect(),
                trees: Vec::new(),
            })
        }
    }

    #[test]
    fn a_registered_estimator_is_named_configured_and_run_like_a_built_in_one() {
        register::<Scaled>("outcome × scale").unwrap();
        register::<Scaled>("again").unwrap();
        assert!(registered().contains(&("scaled_outcome", "outcome × scale")));
        let cfg: AdvantageConfig =
            serde_json::from_str(r#"{"estimator": "scaled_outcome", "scale": 3.0}"#).unwrap();
        assert_eq!(cfg.name(), "scaled_outcome");
        let json = serde_json::to_string(&cfg).unwrap();
        assert_eq!(json, r#"{"estimator":"scaled_outcome","scale":3.0}"#);
        assert_eq!(serde_json::from_str::<AdvantageConfig>(&json).unwrap(), cfg);
        let out = cfg
            .estimate(&AdvantageBatch::new(vec![Rollout::new(
                0,
                vec![0, -1, 1],
                0.5,
            )]))
            .unwrap();
        assert_eq!(out.rollouts[0].tokens, [1.5, 0.0, 1.5]);
        let default = AdvantageConfig::default_for("scaled_outcome").unwrap();
        assert_eq!(serde_json::to_value(&default).unwrap()["scale"], 2.0);
        // Its own errors name it; the built-ins' errors stay theirs.
        let err = AdvantageConfig::from_settings("scaled_outcome", serde_json::json!({"scal": 1}))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("scaled_outcome") && err.contains("scal"),
            "{err}"
        );
        let err = serde_json::from_str::<AdvantageConfig>(r#"{"estimator": "gae", "lambda": 1}"#)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("unknown field `lambda`"), "{err}");
        let err = AdvantageConfig::default_for("nope")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("grpo") && err.contains("scaled_outcome"),
            "{err}"
        );
    }

    #[test]
    fn a_taken_name_is_refused() {
        #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
        struct Grpo2;
        impl Estimator for Grpo2 {
            fn name(&self) -> &'static str {
                "grpo"
            }
            fn estimate(&self, _: &AdvantageBatch) -> Result<AdvantageOutput, AdvantageError> {
                Ok(AdvantageOutput::default())
            }
        }
        let err = register::<Grpo2>("shadow").unwrap_err().to_string();
        assert!(err.contains("built-in"), "{err}");
    }
}
