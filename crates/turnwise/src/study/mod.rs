//! Method comparison studies: arms (a preset and overrides) × seeds trained from shared warm
//! starts with one RL budget, evaluated on one fixed panel of test questions, and a report with
//! confidence intervals over seeds, paired differences against a baseline and the verdicts of
//! papers' claims.
//!
//! ```text
//! <study>/
//!   .turnwise-study       marker: the folder holds a study (`--out` of another study is refused)
//!   study.toml            the study file as given (a folder holding another study is refused)
//!   panel.json            the panel's question ids per warm start (the same for every arm)
//!   warm/<name>/          each warm start: an ordinary run directory with run.steps = 0
//!   runs/<arm>/seed-<s>/  each arm × seed: an ordinary run directory
//!   logs/<run>.log        what each run printed (appended to by every resume)
//!   report.md, plots/     `turnwise study report`
//! ```
//!
//! [`file`] reads and checks the study file, [`Study`] resolves each run's configuration,
//! [`runner`] runs them (in this process, several at once as child processes, or as shell
//! commands for a scheduler), [`stats`] holds the intervals and the bootstrap, and [`report`]
//! writes the report.

pub(crate) mod file;
pub mod report;
pub mod runner;
pub(crate) use turnwise_report::stats;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::config::{ConfigError, TrainConfig, presets};
use crate::task::TaskSet;
use turnwise_env::world::Split;

pub use file::{Arm, Audit, Budget, Claim, Metric, Panel, StudyFile, WarmStart};

/// The marker file of a study directory.
pub const STUDY_MARKER: &str = ".turnwise-study";
/// The study file's copy in a study directory.
pub const STUDY_FILE: &str = "study.toml";
/// The panel's question ids in a study directory.
pub const PANEL_FILE: &str = "panel.json";

/// What went wrong with a study, and where.
#[derive(Debug, thiserror::Error)]
pub enum StudyError {
    /// The study file is not TOML.
    #[error("{}: {message}", path.display())]
    Parse {
        /// The study file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A key of the study file is unknown, missing, ill-typed or wrong.
    #[error("{}: `{key}`: {message}", path.display())]
    Key {
        /// The study file.
        path: PathBuf,
        /// The key (`arm[2].preset`).
        key: String,
        /// What is wrong.
        message: String,
    },
    /// A run's configuration does not resolve or validate.
    #[error("{}: {what}: {cause}", path.display())]
    Config {
        /// The study file.
        path: PathBuf,
        /// Which run (`arm "igpo" (preset igpo)`).
        what: String,
        /// The configuration error (in the message, so not also returned as the source).
        cause: ConfigError,
    },
    /// A run's task cannot be built, or its checks fail.
    #[error("{}: {what}: {message}", path.display())]
    Task {
        /// The study file.
        path: PathBuf,
        /// Which run.
        what: String,
        /// What failed, with its causes.
        message: String,
    },
    /// The output folder holds another study, or something that is not a study.
    #[error("{}: {message}", dir.display())]
    Dir {
        /// The folder.
        dir: PathBuf,
        /// Why it is refused.
        message: String,
    },
    /// A run name given to `run-one` is not one of the study's.
    #[error("no run {name:?} in the study; its runs are {known}")]
    UnknownRun {
        /// The name given.
        name: String,
        /// The study's run names.
        known: String,
    },
    /// The study folder's ownership manifest cannot be read or written, or a path turnwise
    /// did not write is in the way ([`crate::ownership`]).
    #[error(transparent)]
    Ownership(#[from] crate::ownership::OwnershipError),
    /// An I/O operation failed.
    #[error("cannot {action} {}: {cause}", path.display())]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// What was being done.
        action: &'static str,
        /// The cause.
        cause: std::io::Error,
    },
}

impl StudyError {
    fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.to_path_buf();
        move |cause| StudyError::Io {
            path,
            action,
            cause,
        }
    }
}

/// `Err` with the known presets when `name` is not one (the quickstart's counts).
pub(crate) fn check_preset(name: &str) -> Result<(), String> {
    presets::get(if name == presets::QUICKSTART {
        presets::QUICKSTART_BASE
    } else {
        name
    })
    .map(|_| ())
    .map_err(|e| e.to_string())
}

/// One run of a study.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum RunId {
    /// A warm start, by name.
    Warm(String),
    /// An arm × seed.
    Arm(String, u64),
    /// A replay audit (`[[audit]]`), by name.
    Audit(String),
}

impl RunId {
    /// `warm/<name>` or `<arm>/seed-<s>`: the name `run-one --run` takes.
    pub fn label(&self) -> String {
        match self {
            RunId::Warm(w) => format!("warm/{w}"),
            RunId::Arm(a, s) => format!("{a}/seed-{s}"),
            RunId::Audit(a) => format!("audit/{a}"),
        }
    }

    /// Parses a [`label`](Self::label).
    pub fn parse(s: &str) -> Option<Self> {
        let (head, tail) = s.split_once('/')?;
        if head == "warm" {
            return Some(RunId::Warm(tail.to_string()));
        }
        if head == "audit" && !tail.starts_with("seed-") {
            return Some(RunId::Audit(tail.to_string()));
        }
        let seed = tail.strip_prefix("seed-")?.parse().ok()?;
        Some(RunId::Arm(head.to_string(), seed))
    }

    /// The run directory under the study directory `out`.
    pub fn dir(&self, out: &Path) -> PathBuf {
        match self {
            RunId::Warm(w) => out.join("warm").join(w),
            RunId::Arm(a, s) => out.join("runs").join(a).join(format!("seed-{s}")),
            RunId::Audit(a) => out.join("audit").join(a),
        }
    }

    /// The log file under the study directory `out`.
    pub fn log(&self, out: &Path) -> PathBuf {
        let name = match self {
            RunId::Warm(w) => format!("warm-{w}.log"),
            RunId::Arm(a, s) => format!("{a}-seed-{s}.log"),
            RunId::Audit(a) => format!("audit-{a}.log"),
        };
        out.join("logs").join(name)
    }
}

impl RunId {
    /// Whether it has finished under the study directory `out`: a run's `summary.json`
    /// ([`is_finished`]), an audit's `audit.json`.
    pub fn finished(&self, out: &Path) -> bool {
        match self {
            RunId::Audit(_) => std::fs::read(self.dir(out).join("audit.json"))
                .ok()
                .is_some_and(|b| {
                    serde_json::from_slice::<serde_json::Value>(&b).is_ok_and(|v| v.is_object())
                }),
            _ => is_finished(&self.dir(out)),
        }
    }
}

/// Whether the run directory `dir` holds a finished run: its `summary.json` is there and
/// parses (a run killed while writing it left a torn one; `resume` rewrites it from the log).
pub fn is_finished(dir: &Path) -> bool {
    std::fs::read(dir.join("summary.json"))
        .ok()
        .is_some_and(|b| {
            serde_json::from_slice::<serde_json::Value>(&b).is_ok_and(|v| v.is_object())
        })
}

/// The question ids of one panel: the first `panel.questions` test questions of a task.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PanelIds {
    /// The environment (`task.env`).
    pub environment: String,
    /// The split (always `test`).
    pub split: String,
    /// The question ids, in evaluation order.
    pub questions: Vec<String>,
    /// FNV-1a (64-bit, hex) of the questions' texts and accepted answers in order: ids repeat
    /// across worlds (`test_0`), so two panels are the same only when this is too.
    pub fingerprint: String,
}

/// FNV-1a of the panel questions' texts and answers ([`PanelIds::fingerprint`]).
fn fingerprint<'a>(questions: impl IntoIterator<Item = &'a crate::task::QaItem>) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |s: &str| {
        for b in s.bytes().chain([0xff]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for q in questions {
        eat(&q.id);
        eat(&q.text);
        q.golden_answers.iter().for_each(|a| eat(a));
    }
    format!("{h:016x}")
}

/// `panel.json`: the panels of a study, by warm start.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Panels {
    /// The file's format version.
    pub version: u32,
    /// The panel of the arms of each warm start.
    pub panels: BTreeMap<String, PanelIds>,
}

/// A study file read, checked and ready to resolve runs.
#[derive(Debug, Clone)]
pub struct Study {
    /// The study.
    pub file: StudyFile,
    /// The study file (absolute).
    pub path: PathBuf,
    /// Its text.
    pub text: String,
}

impl Study {
    /// Reads and [checks](StudyFile::check) the study file at `path`.
    pub fn load(path: &Path) -> Result<Self, StudyError> {
        let path = std::path::absolute(path).map_err(StudyError::io("resolve", path))?;
        let text = std::fs::read_to_string(&path).map_err(StudyError::io("read", &path))?;
        let file = StudyFile::parse(&text, &path)?;
        file.check(&path)?;
        Ok(Self { file, path, text })
    }

    /// The base config file, relative to the study file.
    fn base_config(&self) -> Option<PathBuf> {
        self.file
            .config
            .as_ref()
            .map(|c| self.path.parent().unwrap_or(Path::new("")).join(c))
    }

    /// The panel's `eval.*` settings.
    fn panel_sets(&self) -> Vec<String> {
        let p = &self.file.panel;
        vec![
            format!("eval.questions={}", p.questions),
            format!("eval.greedy={}", p.greedy),
            format!("eval.sampled={}", p.sampled),
            format!("eval.samples={}", p.samples),
            format!("eval.every={}", p.every),
        ]
    }

    fn config_error(&self, what: String) -> impl FnOnce(ConfigError) -> StudyError + '_ {
        move |cause| StudyError::Config {
            path: self.path.clone(),
            what,
            cause,
        }
    }

    /// Every run, warm starts first, then each arm's seeds in file order, then the audits.
    pub fn runs(&self) -> Vec<RunId> {
        let mut out: Vec<RunId> = self
            .file
            .warm_start
            .keys()
            .map(|w| RunId::Warm(w.clone()))
            .collect();
        for a in &self.file.arms {
            for &s in &self.file.seeds {
                out.push(RunId::Arm(a.name.clone(), s));
            }
        }
        out.extend(
            self.file
                .audits
                .iter()
                .map(|a| RunId::Audit(a.name.clone())),
        );
        out
    }

    /// The run named `label` ([`RunId::label`]).
    pub fn find_run(&self, label: &str) -> Result<RunId, StudyError> {
        let runs = self.runs();
        RunId::parse(label)
            .filter(|r| runs.contains(r))
            .ok_or_else(|| StudyError::UnknownRun {
                name: label.to_string(),
                known: runs.iter().map(RunId::label).collect::<Vec<_>>().join(", "),
            })
    }

    /// The run a run depends on: an arm's warm start, the run an audit reads (`None` for a
    /// warm start).
    pub fn dependency(&self, run: &RunId) -> Option<RunId> {
        match run {
            RunId::Warm(_) => None,
            RunId::Arm(a, _) => {
                let arm = self.file.arm(a)?;
                Some(RunId::Warm(self.file.warm_start_of(arm).to_string()))
            }
            RunId::Audit(a) => self.audit(a).and_then(|a| RunId::parse(&a.run)),
        }
    }

    /// The resolved configuration of the warm start `name`: its preset, the study's config
    /// file and `sets`, its `common` and `sets`, then `run.steps = 0`, its seed and the panel.
    pub fn warm_config(&self, name: &str) -> Result<TrainConfig, StudyError> {
        let w = &self.file.warm_start[name];
        let mut sets = self.file.sets.clone();
        sets.extend(w.common.iter().cloned());
        sets.extend(w.sets.iter().cloned());
        sets.push("run.steps=0".into());
        sets.push(format!("seed={}", w.seed));
        sets.extend(self.panel_sets());
        TrainConfig::resolve(Some(&w.preset), self.base_config().as_deref(), &sets)
            .map_err(self.config_error(format!("warm start {name:?} (preset {})", w.preset)))
    }

    /// The resolved configuration of `arm` with `seed`, starting from its warm start's model
    /// under the study directory `out`: its preset, the study's config file and `sets`, its
    /// warm start's `common`, its own `sets`, then the warm start, the seed, the budget and the
    /// panel.
    pub fn arm_config(&self, arm: &Arm, seed: u64, out: &Path) -> Result<TrainConfig, StudyError> {
        let ws = self.file.warm_start_of(arm);
        let w = &self.file.warm_start[ws];
        let model = RunId::Warm(ws.to_string())
            .dir(out)
            .join(crate::pipeline::REFERENCE_DIR);
        let model = std::path::absolute(&model).map_err(StudyError::io("resolve", &model))?;
        let mut sets = self.file.sets.clone();
        sets.extend(w.common.iter().cloned());
        sets.extend(arm.sets.iter().cloned());
        sets.push(format!(
            "model.init_from={}",
            toml::Value::String(model.to_string_lossy().into_owned())
        ));
        sets.push("sft.steps=0".into());
        sets.push(format!("seed={seed}"));
        let b = &self.file.budget;
        sets.push(format!("run.steps={}", b.steps));
        if let Some(v) = b.prompts_per_step {
            sets.push(format!("rollout.prompts_per_step={v}"));
        }
        if let Some(v) = b.group_size {
            sets.push(format!("rollout.group_size={v}"));
        }
        if let Some(v) = b.save_every {
            sets.push(format!("run.save_every={v}"));
        }
        sets.extend(self.panel_sets());
        TrainConfig::resolve(Some(&arm.preset), self.base_config().as_deref(), &sets)
            .map_err(self.config_error(format!("arm {:?} (preset {})", arm.name, arm.preset)))
    }

    /// The configuration of any run (an audit's: that of the run it reads).
    pub fn config_of(&self, run: &RunId, out: &Path) -> Result<TrainConfig, StudyError> {
        match run {
            RunId::Warm(w) => self.warm_config(w),
            RunId::Arm(a, s) => {
                let arm = self.file.arm(a).expect("a run of the study names its arm");
                self.arm_config(arm, *s, out)
            }
            RunId::Audit(_) => {
                let read = self
                    .dependency(run)
                    .expect("a checked study's audit names one of its runs");
                self.config_of(&read, out)
            }
        }
    }

    /// The audit named `name`.
    pub fn audit(&self, name: &str) -> Option<&file::Audit> {
        self.file.audits.iter().find(|a| a.name == name)
    }

    /// Resolves every run's configuration and checks it as `turnwise config` does (the task
    /// builds, the run's preflight passes; an arm's warm-start model need not exist yet),
    /// checks that every arm's task asks its warm start's panel, and that each claim's arms
    /// share a panel in the environment it names. Returns the panels ([`Panels`]).
    pub fn validate(&self, out: &Path) -> Result<Panels, StudyError> {
        let mut tasks: BTreeMap<String, PanelIds> = BTreeMap::new();
        let mut panel_of = |cfg: &TrainConfig, what: &str| -> Result<PanelIds, StudyError> {
            let task_err = |e: anyhow::Error| StudyError::Task {
                path: self.path.clone(),
                what: what.to_string(),
                message: format!("{e:#}"),
            };
            let key = toml::to_string(&cfg.task).unwrap_or_default();
            let task = match tasks.get(&key) {
                Some(p) if cfg.sft.steps == 0 => return Ok(p.clone()),
                _ => TaskSet::build(&cfg.task).map_err(task_err)?,
            };
            let mut check = cfg.clone();
            check.model.init_from = None;
            crate::pipeline::preflight(&check, &task).map_err(task_err)?;
            let qs: Vec<_> = task
                .questions(Split::Test)
                .into_iter()
                .take(self.file.panel.questions)
                .collect();
            let ids: Vec<String> = qs.iter().map(|q| q.id.clone()).collect();
            if ids.is_empty() {
                return Err(StudyError::Task {
                    path: self.path.clone(),
                    what: what.to_string(),
                    message: "the task has no test questions to evaluate".into(),
                });
            }
            let p = PanelIds {
                environment: cfg.task.env.name().to_string(),
                split: "test".into(),
                questions: ids,
                fingerprint: fingerprint(qs.iter().copied()),
            };
            tasks.insert(key, p.clone());
            Ok(p)
        };
        let mut panels = BTreeMap::new();
        for name in self.file.warm_start.keys() {
            let cfg = self.warm_config(name)?;
            let what = format!("warm start {name:?}");
            panels.insert(name.clone(), panel_of(&cfg, &what)?);
        }
        let first_seed = self.file.seeds[0];
        for arm in &self.file.arms {
            let cfg = self.arm_config(arm, first_seed, out)?;
            let what = format!("arm {:?} (preset {})", arm.name, arm.preset);
            let p = panel_of(&cfg, &what)?;
            let ws = self.file.warm_start_of(arm);
            if p != panels[ws] {
                return Err(StudyError::Task {
                    path: self.path.clone(),
                    what,
                    message: format!(
                        "its test questions ({} in {}) are not those of its warm start {ws:?} \
                         ({} in {}): the arm's overrides change the world or the environment; \
                         put such settings in [warm_start.{ws}] common",
                        p.questions.len(),
                        p.environment,
                        panels[ws].questions.len(),
                        panels[ws].environment
                    ),
                });
            }
        }
        self.check_comparable(&panels)?;
        Ok(Panels { version: 1, panels })
    }

    /// Each arm is evaluated on its baseline's questions, and each claim's two arms on the same
    /// questions in the environment the claim names (`panels`: each warm start's panel).
    fn check_comparable(&self, panels: &BTreeMap<String, PanelIds>) -> Result<(), StudyError> {
        let panel_of_arm = |name: &str| {
            let arm = self.file.arm(name).expect("checked");
            &panels[self.file.warm_start_of(arm)]
        };
        for arm in &self.file.arms {
            let base = self.file.baseline_of(arm);
            let (a, b) = (panel_of_arm(&arm.name), panel_of_arm(base));
            if a.questions != b.questions || a.fingerprint != b.fingerprint {
                let ws = self.file.warm_start_of(arm);
                return Err(StudyError::Key {
                    path: self.path.clone(),
                    key: format!("warm_start.{ws}.baseline"),
                    message: format!(
                        "the arm {:?} would be compared with the baseline {base:?}, which is \
                         evaluated on other questions ({} against {}); name an arm of the warm \
                         start {ws:?} as its baseline",
                        arm.name, a.environment, b.environment
                    ),
                });
            }
        }
        for (i, c) in self.file.claims.iter().enumerate() {
            let (b, t) = (panel_of_arm(&c.better), panel_of_arm(&c.than));
            let bad = |message: String| StudyError::Key {
                path: self.path.clone(),
                key: format!("claim[{i}]"),
                message,
            };
            if b.environment != c.environment || t.environment != c.environment {
                return Err(bad(format!(
                    "environment {:?}, but the arm {:?} runs in {:?} and {:?} in {:?}",
                    c.environment, c.better, b.environment, c.than, t.environment
                )));
            }
            if b.questions != t.questions || b.fingerprint != t.fingerprint {
                return Err(bad(format!(
                    "the arms {:?} and {:?} are evaluated on different questions (their warm \
                     starts' worlds differ), so they cannot be compared question by question",
                    c.better, c.than
                )));
            }
        }
        Ok(())
    }

    /// Prepares the study directory `out`: creates it, or accepts it when it holds this study
    /// (the same study file, compared after parsing); writes the marker, `study.toml` and
    /// `panel.json` when missing. A folder holding another study, a changed panel, or files
    /// that are not a study's are refused.
    pub fn prepare_dir(&self, out: &Path, panels: &Panels) -> Result<(), StudyError> {
        let refuse = |message: String| StudyError::Dir {
            dir: out.to_path_buf(),
            message,
        };
        let marker = out.join(STUDY_MARKER);
        let mut empty = true;
        if out.exists() {
            if !out.is_dir() {
                return Err(refuse("exists and is not a folder".into()));
            }
            empty = std::fs::read_dir(out)
                .map_err(StudyError::io("list", out))?
                .next()
                .is_none();
            if !empty && !marker.is_file() {
                return Err(refuse(format!(
                    "is not empty and holds no study (no {STUDY_MARKER}); give a new or empty \
                     folder"
                )));
            }
        }
        std::fs::create_dir_all(out).map_err(StudyError::io("create", out))?;
        // What the study writes here is recorded in its manifest: started in a folder it
        // created or found empty, kept (when there is one: studies of an earlier turnwise have
        // none) while the files below are written.
        let _owner = if empty {
            Some(crate::ownership::Owner::start(
                out,
                crate::ownership::Kind::Study,
            )?)
        } else {
            crate::ownership::Owner::load(out, crate::ownership::Kind::Study)?
        };
        let stored = out.join(STUDY_FILE);
        if stored.is_file() {
            let theirs = StudyFile::read(&stored)?;
            if theirs != self.file && theirs.without_audits() == self.file.without_audits() {
                // Audits read runs and change none: a study file that adds, removes or
                // changes audits takes over the folder's copy (finished audits are kept).
                write_new(&stored, self.text.as_bytes())?;
            } else if theirs != self.file {
                let table = |f: &StudyFile| {
                    toml::Value::try_from(f)
                        .ok()
                        .and_then(|v| v.as_table().cloned())
                        .unwrap_or_default()
                };
                let (a, b) = (table(&theirs), table(&self.file));
                let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
                let differ: Vec<&str> = keys
                    .into_iter()
                    .filter(|k| a.get(*k) != b.get(*k))
                    .map(String::as_str)
                    .collect();
                return Err(refuse(format!(
                    "holds the study {:?} ({}), which differs from {} (study {:?}) in {}; give \
                     another --out, or the study file it was started with",
                    theirs.name,
                    stored.display(),
                    self.path.display(),
                    self.file.name,
                    differ.join(", ")
                )));
            }
        } else {
            write_new(&stored, self.text.as_bytes())?;
        }
        let panel_path = out.join(PANEL_FILE);
        if panel_path.is_file() {
            let text = std::fs::read_to_string(&panel_path)
                .map_err(StudyError::io("read", &panel_path))?;
            let theirs: Panels = serde_json::from_str(&text)
                .map_err(|e| refuse(format!("{} does not parse: {e}", panel_path.display())))?;
            if &theirs != panels {
                return Err(refuse(format!(
                    "its panel ({}) is not the one the study's tasks ask now (the world, a \
                     preset's task or turnwise changed): the runs would not be comparable",
                    panel_path.display()
                )));
            }
        } else {
            let text = serde_json::to_string_pretty(panels).expect("panels serialize") + "\n";
            write_new(&panel_path, text.as_bytes())?;
        }
        if !marker.is_file() {
            write_new(
                &marker,
                format!("turnwise study {:?}\n", self.file.name).as_bytes(),
            )?;
        }
        Ok(())
    }
}

/// Writes `bytes` to `path` through a temporary file of this process and a rename, so that
/// processes preparing the same folder at once never see a partial file.
fn write_new(path: &Path, bytes: &[u8]) -> Result<(), StudyError> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    crate::ownership::may_write(path)?;
    std::fs::write(&tmp, bytes).map_err(StudyError::io("write", &tmp))?;
    std::fs::rename(&tmp, path).map_err(StudyError::io("rename into place", path))?;
    crate::ownership::wrote(path, bytes)?;
    Ok(())
}

/// Reads `panel.json` of the study directory `out`.
pub fn read_panels(out: &Path) -> Result<Panels, StudyError> {
    let path = out.join(PANEL_FILE);
    let text = std::fs::read_to_string(&path).map_err(StudyError::io("read", &path))?;
    serde_json::from_str(&text).map_err(|e| StudyError::Dir {
        dir: out.to_path_buf(),
        message: format!("{} does not parse: {e}", path.display()),
    })
}
