//! The estimator registry: one shared signature, looked up by name (verl `core_algos` style).

use serde::{Deserialize, Serialize};

use super::channel::Channel;
use super::contract::{GroupSignal, KlPlacement, MetricDoc, Metrics, Needs, StepSamples};
use super::registered::{RegisteredEstimator, is_registered, registered};
use super::{
    A2tgpoConfig, AdvantageBatch, AdvantageError, AdvantageOutput, At2poConfig, DrGrpoConfig,
    GaeConfig, GigpoConfig, GrpoConfig, IgpoConfig, MtGrpoCodeConfig, MtGrpoConfig, RlooConfig,
    T2poConfig, TreeGrpoConfig,
};

/// An advantage estimator: its settings, run over a batch, and its contract with the trainer
/// (what it reads, what it implies, what it reports; [`super::contract`]).
///
/// Every per-estimator settings struct implements it, and so does [`AdvantageConfig`]. The
/// trainer, the config validator and the report read the declarations below and never test an
/// estimator's name: adding an estimator is its file, a registry row and a preset.
pub trait Estimator {
    /// Registry name (e.g. `"grpo"`).
    fn name(&self) -> &'static str;

    /// Checks that its settings lie in their ranges, reporting every one that does not under
    /// its field's name ([`AdvantageError::InvalidSettings`]; default: nothing to check). The
    /// config calls it (prefixing `advantage.`), and so does the estimator's own runtime check,
    /// so that both refuse the same values.
    fn validate(&self) -> Result<(), AdvantageError> {
        Ok(())
    }

    /// Computes the advantages of `batch`.
    fn estimate(&self, batch: &AdvantageBatch) -> Result<AdvantageOutput, AdvantageError>;

    /// The inputs it reads beyond prompt groups, turn ids and outcomes (default: none).
    fn needs(&self) -> Needs {
        Needs::default()
    }

    /// What makes a group of tied filter values informative for DAPO's filter (default: from
    /// [`Self::needs`]: critic values make every group informative, turn or step rewards make
    /// a group informative when they differ, otherwise nothing does).
    fn group_signal(&self) -> GroupSignal {
        let n = self.needs();
        if n.critic_values {
            GroupSignal::EveryGroup
        } else if n.turn_rewards {
            GroupSignal::TurnRewards
        } else if n.step_rewards {
            GroupSignal::StepRewards
        } else {
            GroupSignal::Outcome
        }
    }

    /// Whether DAPO's zero-variance group filter may drop groups before it (default: unless it
    /// reads trees, whose groups must stay whole).
    fn filterable(&self) -> bool {
        !self.needs().trees
    }

    /// Where KL in the reward is subtracted, if the estimator supports it (default: it does not).
    fn kl_placement(&self) -> Option<KlPlacement> {
        None
    }

    /// The channels its output carries beside the advantages
    /// ([`RolloutAdvantage::channels`](super::RolloutAdvantage::channels)), in [`Channel`]
    /// order: a loss may read only channels its estimator emits (default: none).
    fn emits(&self) -> &'static [Channel] {
        &[]
    }

    /// How it scores and groups step samples, for the estimators over step samples (GiGPO,
    /// T2PO; default: it has none).
    fn step_samples(&self) -> Option<StepSamples> {
        None
    }

    /// The metrics that show its defining mechanism at work on `batch` (spec §7).
    fn metrics(&self, _batch: &AdvantageBatch, _out: &AdvantageOutput) -> Metrics {
        Metrics::new()
    }

    /// The keys [`Self::metrics`] logs, with their report labels.
    fn metric_docs(&self) -> &'static [MetricDoc] {
        &[]
    }
}

/// Settings of any registered estimator, tagged by its name, e.g. in a preset TOML:
///
/// ```toml
/// [advantage]
/// estimator = "a2tgpo"
/// gamma = 1.0
/// clip_beta = 0.3
/// ```
///
/// Missing fields take the spec defaults; unknown fields are errors.
///
/// A built-in estimator is a variant here and a row of the `estimators!` invocation below (its
/// name, description and variant); an estimator of another crate is registered at run time
/// ([`register`](super::register)) and held as [`Self::Registered`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(remote = "Self", tag = "estimator", rename_all = "snake_case")]
pub enum AdvantageConfig {
    /// §3.1 GRPO.
    Grpo(GrpoConfig),
    /// §3.1 Dr.GRPO.
    DrGrpo(DrGrpoConfig),
    /// §3.1 RLOO.
    Rloo(RlooConfig),
    /// §3.2 MT-GRPO over K turns.
    MtGrpo(MtGrpoConfig),
    /// §3.2 two-turn MT-GRPO code variant.
    MtGrpoCode(MtGrpoCodeConfig),
    /// §3.3 GAE.
    Gae(GaeConfig),
    /// §3.4 IGPO.
    Igpo(IgpoConfig),
    /// §3.5 A2TGPO.
    A2tgpo(A2tgpoConfig),
    /// §3.6 AT2PO tree values.
    At2po(At2poConfig),
    /// §3.8 Tree-GRPO.
    TreeGrpo(TreeGrpoConfig),
    /// §3.7 GiGPO.
    Gigpo(GigpoConfig),
    /// §3.7 T2PO (GiGPO with T2PO defaults).
    T2po(T2poConfig),
    /// An estimator registered at run time ([`register`](super::register)), written like a
    /// built-in one: `estimator = "its_name"` and its settings beside.
    #[serde(skip)]
    Registered(RegisteredEstimator),
}

/// The registration rows of the built-in estimators: each names the estimator, describes it
/// and gives its [`AdvantageConfig`] variant, and generates its row of [`ESTIMATORS`] and its
/// dispatch (`AdvantageConfig::inner`).
macro_rules! estimators {
    ($($name:literal => $variant:ident, $doc:literal;)*) => {
        /// Registered estimator names, with the spec section of each.
        pub const ESTIMATORS: &[(&str, &str)] = &[$(($name, $doc)),*];

        impl AdvantageConfig {
            fn inner(&self) -> &dyn Estimator {
                match self {
                    $(AdvantageConfig::$variant(c) => c,)*
                    AdvantageConfig::Registered(r) => r.estimator(),
                }
            }
        }
    };
}

estimators! {
    "grpo" => Grpo, "§3.1 GRPO: (s − mean) / (std + ε) per prompt group";
    "dr_grpo" => DrGrpo, "§3.1 Dr.GRPO: s − mean";
    "rloo" => Rloo, "§3.1 RLOO: leave-one-out baseline";
    "mt_grpo" => MtGrpo, "§3.2 MT-GRPO: per-turn groups, summed future turn advantages";
    "mt_grpo_code" => MtGrpoCode, "§3.2 two-turn MT-GRPO (TRL/verifiers code)";
    "gae" => Gae, "§3.3 GAE with critic values (PPO, MT-PPO, ST-PPO)";
    "igpo" => Igpo, "§3.4 IGPO: information-gain turn rewards (paper or code form)";
    "a2tgpo" => A2tgpo, "§3.5 A2TGPO: turn-group IG normalization + variance rescaling + clip scale";
    "at2po" => At2po, "§3.6 AT2PO: tree node values and turn-wise credit";
    "tree_grpo" => TreeGrpo, "§3.8 Tree-GRPO: inter- and intra-tree GRPO";
    "gigpo" => Gigpo, "§3.7 GiGPO: episode + anchor-state step advantages";
    "t2po" => T2po, "§3.7 T2PO: GiGPO fusion with similarity anchors";
}

impl Serialize for AdvantageConfig {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            AdvantageConfig::Registered(r) => r.serialize(s),
            builtin => AdvantageConfig::serialize(builtin, s),
        }
    }
}

impl<'de> Deserialize<'de> for AdvantageConfig {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let map = serde_json::Map::<String, serde_json::Value>::deserialize(d)?;
        match map.get("estimator") {
            Some(serde_json::Value::String(name)) if is_registered(name) => {
                let name = name.clone();
                RegisteredEstimator::from_settings(&name, map)
                    .map(Self::Registered)
                    .map_err(D::Error::custom)
            }
            Some(serde_json::Value::String(name))
                if !registered().is_empty() && !ESTIMATORS.iter().any(|(n, _)| n == name) =>
            {
                Err(D::Error::custom(unknown(name)))
            }
            _ => AdvantageConfig::deserialize(serde_json::Value::Object(map))
                .map_err(D::Error::custom),
        }
    }
}

impl AdvantageConfig {
    /// The default settings of the estimator called `name`.
    pub fn default_for(name: &str) -> Result<Self, AdvantageError> {
        Self::from_settings(name, serde_json::Value::Object(Default::default()))
    }

    /// Settings of estimator `name` from a JSON object of its fields (missing fields take the
    /// defaults; an `estimator` field, if present, must equal `name`). A TOML table converts to
    /// this through serde.
    pub fn from_settings(name: &str, settings: serde_json::Value) -> Result<Self, AdvantageError> {
        if !ESTIMATORS.iter().any(|(n, _)| *n == name) && !is_registered(name) {
            return Err(unknown(name));
        }
        let mut map = match settings {
            serde_json::Value::Object(m) => m,
            serde_json::Value::Null => Default::default(),
            other => {
                return Err(AdvantageError::InvalidConfig {
                    estimator: name.to_string(),
                    message: format!("settings must be a table/object, got {other}"),
                });
            }
        };
        match map.get("estimator") {
            Some(serde_json::Value::String(s)) if s == name => {}
            None => {}
            Some(other) => {
                return Err(AdvantageError::InvalidConfig {
                    estimator: name.to_string(),
                    message: format!("settings name estimator {other}"),
                });
            }
        }
        map.insert(
            "estimator".into(),
            serde_json::Value::String(name.to_string()),
        );
        serde_json::from_value(serde_json::Value::Object(map)).map_err(|e| {
            AdvantageError::InvalidConfig {
                estimator: name.to_string(),
                message: e.to_string(),
            }
        })
    }
}

impl Estimator for AdvantageConfig {
    fn name(&self) -> &'static str {
        self.inner().name()
    }

    fn validate(&self) -> Result<(), AdvantageError> {
        self.inner().validate()
    }

    fn estimate(&self, batch: &AdvantageBatch) -> Result<AdvantageOutput, AdvantageError> {
        self.inner().estimate(batch)
    }

    fn needs(&self) -> Needs {
        self.inner().needs()
    }

    fn group_signal(&self) -> GroupSignal {
        self.inner().group_signal()
    }

    fn filterable(&self) -> bool {
        self.inner().filterable()
    }

    fn kl_placement(&self) -> Option<KlPlacement> {
        self.inner().kl_placement()
    }

    fn emits(&self) -> &'static [Channel] {
        self.inner().emits()
    }

    fn step_samples(&self) -> Option<StepSamples> {
        self.inner().step_samples()
    }

    fn metrics(&self, batch: &AdvantageBatch, out: &AdvantageOutput) -> Metrics {
        self.inner().metrics(batch, out)
    }

    fn metric_docs(&self) -> &'static [MetricDoc] {
        self.inner().metric_docs()
    }
}

/// The registered estimators that satisfy `pred`, with their default settings, in registry
/// order (e.g. those that support KL in the reward, for a config error that lists them).
pub fn estimators_where(pred: impl Fn(&AdvantageConfig) -> bool) -> Vec<&'static str> {
    all_names()
        .into_iter()
        .filter(|n| AdvantageConfig::default_for(n).is_ok_and(|c| pred(&c)))
        .collect()
}

pub(crate) fn unknown(name: &str) -> AdvantageError {
    AdvantageError::UnknownEstimator {
        name: name.to_string(),
        known: all_names().join(", "),
    }
}

/// The built-in estimators' names, then the registered ones'.
fn all_names() -> Vec<&'static str> {
    ESTIMATORS
        .iter()
        .copied()
        .chain(registered())
        .map(|(n, _)| n)
        .collect()
}

/// Runs the estimator described by `cfg` on `batch` (the one shared signature).
pub fn estimate(
    batch: &AdvantageBatch,
    cfg: &AdvantageConfig,
) -> Result<AdvantageOutput, AdvantageError> {
    cfg.estimate(batch)
}

/// Runs estimator `name` with its default settings.
pub fn estimate_by_name(
    batch: &AdvantageBatch,
    name: &str,
) -> Result<AdvantageOutput, AdvantageError> {
    AdvantageConfig::default_for(name)?.estimate(batch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::advantage::Rollout;
    use crate::advantage::kernels::StdKind;

    #[test]
    fn every_name_resolves_and_round_trips() {
        for (name, _) in ESTIMATORS {
            let cfg = AdvantageConfig::default_for(name).unwrap();
            assert_eq!(cfg.name(), *name);
            let json = serde_json::to_value(&cfg).unwrap();
            assert_eq!(json["estimator"], *name);
            let back: AdvantageConfig = serde_json::from_value(json).unwrap();
            assert_eq!(back, cfg);
        }
    }

    #[test]
    fn settings_override_defaults() {
        let cfg = AdvantageConfig::from_settings(
            "grpo",
            serde_json::json!({"std": "population", "epsilon": 1e-4}),
        )
        .unwrap();
        assert_eq!(
            cfg,
            AdvantageConfig::Grpo(GrpoConfig {
                std: StdKind::Population,
                epsilon: 1e-4
            })
        );
        let tagged: AdvantageConfig =
            serde_json::from_str(r#"{"estimator": "tree_grpo", "mode": "tree_2norm"}"#).unwrap();
        assert_eq!(tagged.name(), "tree_grpo");
    }

    #[test]
    fn unknown_name_and_fields_are_errors() {
        let err = AdvantageConfig::default_for("ppo2").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("`ppo2`") && msg.contains("a2tgpo"), "{msg}");
        let err =
            AdvantageConfig::from_settings("gae", serde_json::json!({"lambda": 0.9})).unwrap_err();
        assert!(
            matches!(err, AdvantageError::InvalidConfig { ref estimator, .. } if estimator == "gae")
        );
        assert!(err.to_string().contains("lambda"), "{err}");
        let err: Result<AdvantageConfig, _> =
            serde_json::from_str(r#"{"estimator": "grpo", "gamma": 1.0}"#);
        assert!(err.is_err());
    }

    #[test]
    fn estimate_by_name_dispatches() {
        let batch = AdvantageBatch::new(vec![
            Rollout::new(0, vec![0], 1.0),
            Rollout::new(0, vec![0], 0.0),
        ]);
        let out = estimate_by_name(&batch, "dr_grpo").unwrap();
        assert_eq!(out.estimator, "dr_grpo");
        assert_eq!(out.rollouts[0].tokens, vec![0.5]);
        let out = estimate(&batch, &AdvantageConfig::Rloo(RlooConfig {})).unwrap();
        assert_eq!(out.rollouts[1].tokens, vec![-1.0]);
    }
}
