//! The study file: what a method comparison trains ([`StudyFile`]), read from TOML with every
//! unknown or ill-typed key named, and checked as a whole ([`StudyFile::check`]) before
//! anything is resolved or run.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::StudyError;

/// A study: arms (a preset and overrides) × seeds, trained from shared warm starts with one RL
/// budget, evaluated on one panel of test questions, with the claims the report checks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StudyFile {
    /// The study's name (shown in the report and in the refusal of a directory holding
    /// another study).
    pub name: String,
    /// The RL seeds (`seed` of each run); every arm runs every seed.
    pub seeds: Vec<u64>,
    /// The arm every other arm is compared with (paired, on the same panel questions).
    pub baseline: String,
    /// A TOML config file applied over every run's preset (as `train --config`), relative to
    /// the study file.
    #[serde(default)]
    pub config: Option<PathBuf>,
    /// `key=value` overrides of every run (warm starts and arms), applied after `config`.
    #[serde(default)]
    pub sets: Vec<String>,
    /// The RL budget every arm gets.
    pub budget: Budget,
    /// The evaluation panel every run gets.
    #[serde(default)]
    pub panel: Panel,
    /// The warm starts by name (one per agent format and environment): each is trained once,
    /// and every arm that names it starts from its `warm-start-model/`.
    pub warm_start: BTreeMap<String, WarmStart>,
    /// The arms.
    #[serde(rename = "arm")]
    pub arms: Vec<Arm>,
    /// The claims the report checks.
    #[serde(rename = "claim", default)]
    pub claims: Vec<Claim>,
    /// Replay audits of some of the study's runs (`turnwise credit-audit` on each one's latest
    /// checkpoint), run after the runs they read; the report scores every estimator against
    /// each. They change no run, so they may be added to a study that has started.
    #[serde(rename = "audit", default, skip_serializing_if = "Vec::is_empty")]
    pub audits: Vec<Audit>,
}

/// A replay audit of one of the study's runs: [`crate::audit`] on the run's latest checkpoint
/// (a warm start's model, or an arm × seed run's last checkpoint, whose critic a PPO-family
/// run's audit reads), over the first `episodes` questions of the test split, written to
/// `audit/<name>/` in the study directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Audit {
    /// The audit's name (a folder name, as an arm's).
    pub name: String,
    /// The run it audits, as `run-one --run` names it: `warm/<name>` or `<arm>/seed-<s>`.
    pub run: String,
    /// Audited episodes (the first test questions; `--episodes`).
    #[serde(default = "default_audit_episodes")]
    pub episodes: usize,
    /// Episodes per question's group, the estimators' groups (`--group`); the run's
    /// `rollout.group_size` when unset.
    #[serde(default)]
    pub group: Option<usize>,
    /// Alternative turns sampled at each audited turn (`K`, `--alternatives`).
    #[serde(default = "default_audit_alternatives")]
    pub alternatives: usize,
    /// Continuations of the taken turn and of each alternative (`M`, `--rollouts`).
    #[serde(default = "default_audit_rollouts")]
    pub rollouts: usize,
    /// The seed of the panel's and the replay's sampling (`--seed`).
    #[serde(default)]
    pub seed: u64,
    /// Bootstrap resamples of the intervals (`--bootstrap`).
    #[serde(default = "default_audit_bootstrap")]
    pub bootstrap: usize,
}

impl Audit {
    /// What the audit asks of `credit-audit`: the first `episodes` test questions, the replay
    /// chunk left to the model (0).
    pub fn request(&self) -> crate::audit::AuditRequest {
        crate::audit::AuditRequest {
            split: turnwise_env::world::Split::Test,
            episodes: self.episodes,
            group: self.group,
            replay: crate::audit::replay::ReplaySettings {
                alternatives: self.alternatives,
                rollouts: self.rollouts,
                seed: self.seed,
                chunk: 0,
            },
            bootstrap: self.bootstrap,
        }
    }
}

fn default_audit_episodes() -> usize {
    16
}

fn default_audit_alternatives() -> usize {
    8
}

fn default_audit_rollouts() -> usize {
    4
}

fn default_audit_bootstrap() -> usize {
    1000
}

/// The RL budget of every arm.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    /// RL steps (`run.steps`).
    pub steps: u64,
    /// Prompts per RL step (`rollout.prompts_per_step`); the arm's preset's when unset.
    #[serde(default)]
    pub prompts_per_step: Option<usize>,
    /// Rollouts per prompt (`rollout.group_size`); the arm's preset's when unset (tree presets
    /// tie it to their tree's leaves).
    #[serde(default)]
    pub group_size: Option<usize>,
    /// Checkpoint every N steps (`run.save_every`); how much a killed run redoes.
    #[serde(default)]
    pub save_every: Option<u64>,
}

/// The evaluation panel: the first `questions` test questions of the arms' task, evaluated
/// before and after RL by every run in the same way.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Panel {
    /// Test questions (`eval.questions`).
    pub questions: usize,
    /// Greedy evaluation (`eval.greedy`).
    pub greedy: bool,
    /// Sampled evaluation at the rollout temperature (`eval.sampled`).
    pub sampled: bool,
    /// Episodes per question of the sampled evaluation (`eval.samples`).
    pub samples: usize,
    /// Validation evaluations every N RL steps for the learning curves (`eval.every`; 0: none).
    pub every: u64,
}

impl Default for Panel {
    fn default() -> Self {
        Self {
            questions: 300,
            greedy: true,
            sampled: true,
            samples: 1,
            every: 0,
        }
    }
}

/// One shared warm start: a run of `preset` with `run.steps = 0` whose `warm-start-model/`
/// the arms that name it start from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WarmStart {
    /// The preset whose task, agent format and warm-start recipe it uses.
    pub preset: String,
    /// The warm start's `seed`.
    #[serde(default)]
    pub seed: u64,
    /// Overrides of the warm start and of every arm that starts from it: the environment, the
    /// world and the model's shape, which must agree between the two.
    #[serde(default)]
    pub common: Vec<String>,
    /// Overrides of the warm start alone (`sft.steps`, `sft.lr`, ...).
    #[serde(default)]
    pub sets: Vec<String>,
    /// The baseline of the arms starting from this warm start, when not the study's (arms in
    /// another environment than the study's baseline).
    #[serde(default)]
    pub baseline: Option<String>,
}

/// One arm: a preset and its overrides, run once per seed from its warm start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Arm {
    /// The arm's name (a folder name: letters, digits, `-`, `_`, `.`).
    pub name: String,
    /// The preset (see `turnwise presets`).
    pub preset: String,
    /// The warm start it starts from (may be left out when the study has one).
    #[serde(default)]
    pub warm_start: Option<String>,
    /// Overrides of this arm.
    #[serde(default)]
    pub sets: Vec<String>,
}

/// A paper's claim as a direction: arm `better` beats arm `than` on `metric`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Claim {
    /// A short name.
    pub name: String,
    /// The paper (title, arXiv id).
    pub paper: String,
    /// The paper's stated effect, as text.
    pub effect: String,
    /// The arm claimed better.
    pub better: String,
    /// The arm claimed worse.
    pub than: String,
    /// The metric compared.
    pub metric: Metric,
    /// The environment the claim needs (`task.env` of both arms: search, two_turn,
    /// frozen_lake, sokoban).
    pub environment: String,
}

/// A per-question metric of the panel evaluations after RL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// Exact match (a game's success), greedy.
    EmGreedy,
    /// Exact match, sampled.
    EmSampled,
    /// Token F1, greedy.
    F1Greedy,
    /// Token F1, sampled.
    F1Sampled,
}

impl Metric {
    /// Every metric, in report order.
    pub const ALL: [Metric; 4] = [
        Metric::EmGreedy,
        Metric::F1Greedy,
        Metric::EmSampled,
        Metric::F1Sampled,
    ];

    /// The name used in study files (`em_greedy`).
    pub fn name(self) -> &'static str {
        match self {
            Metric::EmGreedy => "em_greedy",
            Metric::EmSampled => "em_sampled",
            Metric::F1Greedy => "f1_greedy",
            Metric::F1Sampled => "f1_sampled",
        }
    }

    /// The evaluation mode it reads (`greedy` or `sampled`).
    pub fn mode(self) -> &'static str {
        match self {
            Metric::EmGreedy | Metric::F1Greedy => "greedy",
            Metric::EmSampled | Metric::F1Sampled => "sampled",
        }
    }

    /// Whether it is token F1 (else EM).
    pub fn is_f1(self) -> bool {
        matches!(self, Metric::F1Greedy | Metric::F1Sampled)
    }
}

/// Keys a study sets on every run itself, and what sets them; an override of one is refused.
pub const STUDY_KEYS: &[(&str, &str)] = &[
    ("seed", "`seeds` (a warm start's own: its `seed`)"),
    ("model.init_from", "the arm's warm start"),
    ("sft.steps", "the warm start (arms start from its model)"),
    ("run.steps", "[budget] steps"),
    ("rollout.prompts_per_step", "[budget] prompts_per_step"),
    ("rollout.group_size", "[budget] group_size"),
    ("run.save_every", "[budget] save_every"),
    ("eval", "[panel]"),
];

/// The study key that `set` (a `key=value` override) would change, with what sets it, if any.
/// Budget keys the study leaves unset (`budget` says which) stay free.
fn study_key(set: &str, budget: &Budget) -> Option<(&'static str, &'static str)> {
    let key = set.split_once('=').map_or(set, |(k, _)| k).trim();
    STUDY_KEYS.iter().copied().find(|(k, _)| {
        let hit = key == *k || key.starts_with(&format!("{k}."));
        let free = match *k {
            "rollout.prompts_per_step" => budget.prompts_per_step.is_none(),
            "rollout.group_size" => budget.group_size.is_none(),
            "run.save_every" => budget.save_every.is_none(),
            _ => false,
        };
        hit && !free
    })
}

/// Whether `name` can name a folder: 1 to 64 of `A-Z a-z 0-9 - _ .`, not starting with `.`.
fn folder_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

impl StudyFile {
    /// Parses a study file's text (`source` names it in errors); unknown keys and wrong types
    /// are errors naming the key (`arm[2].preset`). Does not [`check`](Self::check) it.
    pub fn parse(text: &str, source: &Path) -> Result<Self, StudyError> {
        let de = toml::Deserializer::parse(text).map_err(|e| StudyError::Parse {
            path: source.to_path_buf(),
            message: e.to_string().trim().to_string(),
        })?;
        serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let message = e.inner().message().trim().to_string();
            StudyError::Key {
                path: source.to_path_buf(),
                key: if path == "." {
                    "(top level)".into()
                } else {
                    path
                },
                message,
            }
        })
    }

    /// Reads and parses a study file ([`parse`](Self::parse)).
    pub fn read(path: &Path) -> Result<Self, StudyError> {
        let text = std::fs::read_to_string(path).map_err(|cause| StudyError::Io {
            path: path.to_path_buf(),
            action: "read",
            cause,
        })?;
        Self::parse(&text, path)
    }

    /// Checks the study as a whole, naming the key of the first problem: names, seeds,
    /// presets, references between arms, warm starts, the baseline and the claims, and no
    /// override of a key the study sets itself ([`STUDY_KEYS`]). `source` names the file.
    pub fn check(&self, source: &Path) -> Result<(), StudyError> {
        self.check_basics(source)?;
        self.check_warm_starts(source)?;
        let names = self.check_arms(source)?;
        self.check_baselines(source, &names)?;
        self.check_claims(source, &names)?;
        self.check_audits(source, &names)
    }

    /// The study's name, seeds, budget and panel.
    fn check_basics(&self, source: &Path) -> Result<(), StudyError> {
        let bad = |key: String, message: String| StudyError::Key {
            path: source.to_path_buf(),
            key,
            message,
        };
        if self.name.trim().is_empty() {
            return Err(bad("name".into(), "must not be empty".into()));
        }
        if self.seeds.is_empty() {
            return Err(bad("seeds".into(), "must list at least one seed".into()));
        }
        let mut seen = BTreeSet::new();
        for (i, s) in self.seeds.iter().enumerate() {
            if !seen.insert(s) {
                return Err(bad(
                    format!("seeds[{i}]"),
                    format!("seed {s} is listed twice"),
                ));
            }
        }
        if self.budget.steps == 0 {
            return Err(bad("budget.steps".into(), "must be at least 1".into()));
        }
        for (key, v) in [
            ("budget.prompts_per_step", self.budget.prompts_per_step),
            ("budget.group_size", self.budget.group_size),
        ] {
            if v == Some(0) {
                return Err(bad(key.into(), "must be at least 1 (or left out)".into()));
            }
        }
        if self.panel.questions == 0 {
            return Err(bad("panel.questions".into(), "must be at least 1".into()));
        }
        if !self.panel.greedy && !self.panel.sampled {
            return Err(bad(
                "panel".into(),
                "evaluates nothing: set greedy or sampled (or both) to true".into(),
            ));
        }
        Ok(())
    }

    /// Each of `sets` (under `key`) is `key=value` and sets no key the study sets itself for
    /// `what`.
    fn check_sets(
        &self,
        source: &Path,
        key: &str,
        sets: &[String],
        what: &str,
    ) -> Result<(), StudyError> {
        let bad = |key: String, message: String| StudyError::Key {
            path: source.to_path_buf(),
            key,
            message,
        };
        for (i, s) in sets.iter().enumerate() {
            if !s.contains('=') {
                return Err(bad(
                    format!("{key}[{i}]"),
                    format!("{s:?} is not key=value (e.g. \"optim.lr=1e-4\")"),
                ));
            }
            if let Some((k, by)) = study_key(s, &self.budget) {
                return Err(bad(
                    format!("{key}[{i}]"),
                    format!("{s:?} sets `{k}`, which the study sets for {what} from {by}"),
                ));
            }
        }
        Ok(())
    }

    /// The study's own `sets`, and its warm starts: at least one, their names, presets and
    /// settings.
    fn check_warm_starts(&self, source: &Path) -> Result<(), StudyError> {
        let bad = |key: String, message: String| StudyError::Key {
            path: source.to_path_buf(),
            key,
            message,
        };
        self.check_sets(source, "sets", &self.sets, "every run")?;
        if self.warm_start.is_empty() {
            return Err(bad(
                "warm_start".into(),
                "the study needs at least one warm start ([warm_start.NAME] with its preset)"
                    .into(),
            ));
        }
        for (name, w) in &self.warm_start {
            let key = format!("warm_start.{name}");
            if !folder_name_ok(name) {
                return Err(bad(
                    key,
                    "the name must be 1 to 64 of A-Z a-z 0-9 - _ . (it names a folder)".into(),
                ));
            }
            super::check_preset(&w.preset).map_err(|m| bad(format!("{key}.preset"), m))?;
            self.check_sets(source, &format!("{key}.common"), &w.common, "every run")?;
            for (i, s) in w.sets.iter().enumerate() {
                let k = s.split_once('=').map_or(s.as_str(), |(k, _)| k).trim();
                if !s.contains('=') {
                    return Err(bad(
                        format!("{key}.sets[{i}]"),
                        format!("{s:?} is not key=value (e.g. \"sft.steps=400\")"),
                    ));
                }
                let by = match k {
                    "seed" => Some("its `seed`"),
                    "run.steps" => Some("run.steps = 0 (a warm start trains no RL)"),
                    _ if k == "eval" || k.starts_with("eval.") => Some("[panel]"),
                    _ => None,
                };
                if let Some(by) = by {
                    return Err(bad(
                        format!("{key}.sets[{i}]"),
                        format!(
                            "{s:?} sets `{k}`, which the study sets for a warm start from {by}"
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The arms: names (folder names, each once), presets, warm starts and settings; returns
    /// each arm's index by name.
    fn check_arms(&self, source: &Path) -> Result<BTreeMap<&str, usize>, StudyError> {
        let bad = |key: String, message: String| StudyError::Key {
            path: source.to_path_buf(),
            key,
            message,
        };
        let mut names = BTreeMap::new();
        for (i, a) in self.arms.iter().enumerate() {
            let key = format!("arm[{i}]");
            if !folder_name_ok(&a.name) {
                return Err(bad(
                    format!("{key}.name"),
                    format!(
                        "{:?}: the name must be 1 to 64 of A-Z a-z 0-9 - _ . (it names a folder)",
                        a.name
                    ),
                ));
            }
            if let Some(j) = names.insert(a.name.as_str(), i) {
                return Err(bad(
                    format!("{key}.name"),
                    format!(
                        "the arm {:?} is named twice (arm[{j}] and arm[{i}])",
                        a.name
                    ),
                ));
            }
            super::check_preset(&a.preset).map_err(|m| bad(format!("{key}.preset"), m))?;
            match &a.warm_start {
                Some(w) if !self.warm_start.contains_key(w) => {
                    return Err(bad(
                        format!("{key}.warm_start"),
                        format!(
                            "no warm start {w:?}; the study has {}",
                            self.warm_start_names()
                        ),
                    ));
                }
                None if self.warm_start.len() > 1 => {
                    return Err(bad(
                        format!("{key}.warm_start"),
                        format!(
                            "missing: the study has several warm starts ({}); name one",
                            self.warm_start_names()
                        ),
                    ));
                }
                _ => {}
            }
            self.check_sets(source, &format!("{key}.sets"), &a.sets, "every arm")?;
        }
        Ok(names)
    }

    /// At least one arm; the baseline, and each warm start's own baseline, is an arm (of that
    /// warm start).
    fn check_baselines(
        &self,
        source: &Path,
        names: &BTreeMap<&str, usize>,
    ) -> Result<(), StudyError> {
        let bad = |key: String, message: String| StudyError::Key {
            path: source.to_path_buf(),
            key,
            message,
        };
        if self.arms.is_empty() {
            return Err(bad(
                "arm".into(),
                "the study needs at least one [[arm]]".into(),
            ));
        }
        if !names.contains_key(self.baseline.as_str()) {
            return Err(bad(
                "baseline".into(),
                format!(
                    "no arm {:?}; the arms are {}",
                    self.baseline,
                    self.arm_list()
                ),
            ));
        }
        for (name, w) in &self.warm_start {
            if let Some(b) = &w.baseline {
                let Some(&i) = names.get(b.as_str()) else {
                    return Err(bad(
                        format!("warm_start.{name}.baseline"),
                        format!("no arm {b:?}; the arms are {}", self.arm_list()),
                    ));
                };
                if self.warm_start_of(&self.arms[i]) != name {
                    return Err(bad(
                        format!("warm_start.{name}.baseline"),
                        format!("the arm {b:?} does not start from the warm start {name:?}"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The arms' names, comma-separated (for errors naming an unknown arm).
    fn arm_list(&self) -> String {
        self.arms
            .iter()
            .map(|a| a.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The claims: names (each once) and the two different arms they compare.
    fn check_claims(&self, source: &Path, names: &BTreeMap<&str, usize>) -> Result<(), StudyError> {
        let bad = |key: String, message: String| StudyError::Key {
            path: source.to_path_buf(),
            key,
            message,
        };
        let mut claim_names = BTreeSet::new();
        for (i, c) in self.claims.iter().enumerate() {
            let key = format!("claim[{i}]");
            if c.name.trim().is_empty() {
                return Err(bad(format!("{key}.name"), "must not be empty".into()));
            }
            if !claim_names.insert(c.name.as_str()) {
                return Err(bad(
                    format!("{key}.name"),
                    format!("the claim {:?} is named twice", c.name),
                ));
            }
            for (field, arm) in [("better", &c.better), ("than", &c.than)] {
                if !names.contains_key(arm.as_str()) {
                    return Err(bad(
                        format!("{key}.{field}"),
                        format!("no arm {arm:?}; the arms are {}", self.arm_list()),
                    ));
                }
            }
            if c.better == c.than {
                return Err(bad(
                    format!("{key}.than"),
                    format!("compares the arm {:?} with itself", c.better),
                ));
            }
        }
        Ok(())
    }

    /// The audits: names (folder names, each once), the run each reads, and their settings.
    fn check_audits(&self, source: &Path, names: &BTreeMap<&str, usize>) -> Result<(), StudyError> {
        let bad = |key: String, message: String| StudyError::Key {
            path: source.to_path_buf(),
            key,
            message,
        };
        let mut audit_names = BTreeSet::new();
        for (i, a) in self.audits.iter().enumerate() {
            let key = format!("audit[{i}]");
            if !folder_name_ok(&a.name) {
                return Err(bad(
                    format!("{key}.name"),
                    format!(
                        "{:?} cannot name a folder (1 to 64 of A-Z a-z 0-9 - _ ., not starting \
                         with .)",
                        a.name
                    ),
                ));
            }
            if !audit_names.insert(a.name.as_str()) {
                return Err(bad(
                    format!("{key}.name"),
                    format!("the audit {:?} is named twice", a.name),
                ));
            }
            let known = match a.run.split_once('/') {
                Some(("warm", w)) => self.warm_start.contains_key(w),
                Some((arm, seed)) => {
                    names.contains_key(arm)
                        && seed
                            .strip_prefix("seed-")
                            .and_then(|s| s.parse::<u64>().ok())
                            .is_some_and(|s| self.seeds.contains(&s))
                }
                None => false,
            };
            if !known {
                return Err(bad(
                    format!("{key}.run"),
                    format!(
                        "no run {:?} in the study: give `warm/<warm start>` ({}) or \
                         `<arm>/seed-<seed>` (seeds {:?})",
                        a.run,
                        self.warm_start_names(),
                        self.seeds
                    ),
                ));
            }
            // The run's group size is not known before it resolves; the smallest valid one
            // checks everything else.
            let mut settings = a.request().settings(2);
            settings.replay.chunk = 1;
            if let Err(e) = settings.validate() {
                return Err(bad(key, format!("{e:#}")));
            }
        }
        Ok(())
    }

    /// The same study without its audits: what its runs depend on.
    pub fn without_audits(&self) -> Self {
        Self {
            audits: Vec::new(),
            ..self.clone()
        }
    }

    /// The warm starts' names, comma-separated.
    fn warm_start_names(&self) -> String {
        self.warm_start
            .keys()
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The name of the warm start `arm` starts from (its own, or the study's only one).
    pub fn warm_start_of<'a>(&'a self, arm: &'a Arm) -> &'a str {
        arm.warm_start.as_deref().unwrap_or_else(|| {
            self.warm_start
                .keys()
                .next()
                .map(String::as_str)
                .expect("a checked study has a warm start")
        })
    }

    /// The arm named `name`.
    pub fn arm(&self, name: &str) -> Option<&Arm> {
        self.arms.iter().find(|a| a.name == name)
    }

    /// The baseline of `arm`: its warm start's `baseline`, else the study's.
    pub fn baseline_of(&self, arm: &Arm) -> &str {
        self.warm_start
            .get(self.warm_start_of(arm))
            .and_then(|w| w.baseline.as_deref())
            .unwrap_or(&self.baseline)
    }
}
