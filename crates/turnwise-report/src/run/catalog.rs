//! Many runs at once: [`find_runs`] and [`RunInfo`] behind `turnwise runs`, and
//! [`compare_table`] and [`compare_charts`] behind `turnwise compare`.
//!
//! Everything here only reads run directories (never their lock), so it works on runs in
//! progress.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::metrics::{MetricsLog, read_metrics};
use super::svg::{LineChart, Series};
use super::{RunDir, RunError, RunResult};

use turnwise_core::metric_keys as mk;

/// What `turnwise runs` shows of one run directory.
#[derive(Debug, Clone, PartialEq)]
pub struct RunInfo {
    /// The run directory.
    pub dir: PathBuf,
    /// The preset recorded in its config.toml.
    pub preset: String,
    /// `run.steps` of its config.
    pub steps_planned: u64,
    /// The last RL step logged.
    pub steps_done: u64,
    /// The newest complete checkpoint's step.
    pub checkpoint: Option<u64>,
    /// Whether summary.json exists (the run ended and wrote its summary).
    pub finished: bool,
    /// Whether a process holds its [`super::LOCK_FILE`] (a run or resume is writing it now);
    /// an unfinished run that is not live was stopped (killed, crashed or interrupted).
    pub live: bool,
    /// Unix seconds of the last metrics line.
    pub last_time: Option<f64>,
    /// Test-split EM `(before, after)` by decoding (`greedy`, `sampled`).
    pub test_em: BTreeMap<String, (Option<f64>, Option<f64>)>,
    /// Test questions of its last test evaluation (`eval/test/<mode>/n`, greedy before
    /// sampled); `None` when none was logged.
    pub test_n: Option<usize>,
    /// The mean of the last (up to) ten RL steps, per metric of [`SUMMARY_KEYS`].
    pub recent: BTreeMap<String, f64>,
    /// Seconds of RL steps logged (`timing_s/step` summed).
    pub rl_seconds: f64,
    /// The log itself, for charts.
    pub log: MetricsLog,
    /// The settings of its config that decide its questions ([`WORLD_KEYS`] of `[task]`),
    /// flattened to dotted keys (`task.world.seed`) with their TOML values.
    pub world: BTreeMap<String, String>,
}

/// The keys of `[task]` that decide a run's questions (the environment, the generated world,
/// the data files, the game maps, the OpenEnv server): runs that differ in one are not
/// evaluated on the same test questions.
pub const WORLD_KEYS: &[&str] = &["env", "world", "search_r1", "wiki", "game", "openenv"];

/// The world settings of a config's TOML text (see [`RunInfo::world`]).
pub fn world_settings(config_toml: &str) -> RunResult<BTreeMap<String, String>> {
    let table: toml::Table = config_toml.parse().map_err(|e| RunError::BadLine {
        path: "config".into(),
        line: 0,
        message: format!("not TOML: {e}"),
    })?;
    Ok(world_of(&table))
}

/// The world settings of a parsed config (see [`RunInfo::world`]).
fn world_of(table: &toml::Table) -> BTreeMap<String, String> {
    let mut world = BTreeMap::new();
    if let Some(task) = table.get("task").and_then(|t| t.as_table()) {
        for key in WORLD_KEYS {
            if let Some(v) = task.get(*key) {
                flatten(format!("task.{key}"), v, &mut world);
            }
        }
    }
    world
}

/// Adds `value` under `key` to `out`, tables flattened to dotted keys.
fn flatten(key: String, value: &toml::Value, out: &mut BTreeMap<String, String>) {
    match value {
        toml::Value::Table(t) => {
            for (k, v) in t {
                flatten(format!("{key}.{k}"), v, out);
            }
        }
        v => {
            out.insert(key, v.to_string());
        }
    }
}

/// The training metrics a listing or a comparison summarises (mean of the last ten steps).
pub const SUMMARY_KEYS: &[&str] = &[
    mk::train::EM,
    mk::critic::SCORE_MEAN,
    mk::actor::PG_CLIPFRAC,
    mk::actor::ENTROPY,
];

/// The charts of `turnwise compare`: `(file stem, title, metric)`, one curve per run.
pub const COMPARE_CHARTS: &[(&str, &str, &str)] = &[
    ("train_em", "training EM per RL step", mk::train::EM),
    ("score", "mean reward per RL step", mk::critic::SCORE_MEAN),
    (
        "clipfrac",
        "clipped fraction per RL step",
        mk::actor::PG_CLIPFRAC,
    ),
    ("entropy", "policy entropy per RL step", mk::actor::ENTROPY),
    (
        "validation_greedy_em",
        "validation greedy EM",
        mk::eval::VALIDATION_GREEDY_EM,
    ),
    ("test_greedy_em", "test greedy EM", mk::eval::TEST_GREEDY_EM),
];

/// The run directories at `root`: `root` itself when it is one (it holds `config.toml`), else
/// its subdirectories that are, two levels deep at most, sorted by path.
pub fn find_runs(root: &Path) -> RunResult<Vec<PathBuf>> {
    fn walk(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) -> RunResult<()> {
        if dir.join("config.toml").is_file() {
            out.push(dir.to_path_buf());
            return Ok(());
        }
        if depth == 0 {
            return Ok(());
        }
        let entries = std::fs::read_dir(dir).map_err(RunError::io("list", dir))?;
        for entry in entries {
            let path = entry.map_err(RunError::io("list", dir))?.path();
            if path.is_dir() {
                walk(&path, depth - 1, out)?;
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(root, 2, &mut out)?;
    out.sort();
    Ok(out)
}

impl RunInfo {
    /// Reads the run directory `dir` (its config, metrics, checkpoints and summary).
    pub fn read(dir: &Path) -> RunResult<Self> {
        let run = RunDir::open(dir)?;
        let config_text = run.read_config()?;
        let table: toml::Table = config_text.parse().map_err(|e| RunError::BadLine {
            path: run.config_path(),
            line: 0,
            message: format!("not TOML: {e}"),
        })?;
        let preset = table
            .get("preset")
            .and_then(|v| v.as_str())
            .unwrap_or("custom")
            .to_string();
        let steps_planned = table
            .get("run")
            .and_then(|r| r.get("steps"))
            .and_then(|s| s.as_integer())
            .and_then(|s| u64::try_from(s).ok())
            .unwrap_or(0);
        let log = if run.metrics_path().is_file() {
            read_metrics(run.metrics_path())?
        } else {
            MetricsLog::from_records(Vec::new())
        };
        let train: Vec<_> = log.phase("train").collect();
        let steps_done = train.iter().map(|r| r.step).max().unwrap_or(0);
        let mut recent = BTreeMap::new();
        let tail = &train[train.len().saturating_sub(10)..];
        for key in SUMMARY_KEYS {
            let vals: Vec<f64> = tail.iter().filter_map(|r| r.get(key)).collect();
            if !vals.is_empty() {
                recent.insert(
                    (*key).to_string(),
                    vals.iter().sum::<f64>() / vals.len() as f64,
                );
            }
        }
        // From +0.0: the `sum` of no steps is -0.0, printed "-0".
        let rl_seconds = train
            .iter()
            .filter_map(|r| r.get(mk::timing::STEP))
            .fold(0.0, |a, b| a + b);
        let mut test_em = BTreeMap::new();
        let test_n = ["greedy", "sampled"].iter().find_map(|mode| {
            let key = format!("eval/test/{mode}/n");
            log.phase("eval")
                .filter_map(|r| r.get(&key))
                .last()
                .map(|n| n as usize)
        });
        for mode in ["greedy", "sampled"] {
            let key = format!("eval/test/{mode}/em");
            let evals: Vec<_> = log
                .phase("eval")
                .filter_map(|r| r.get(&key).map(|v| (r.step, v)))
                .collect();
            let before = evals.iter().find(|(s, _)| *s == 0).map(|(_, v)| *v);
            let after = evals
                .iter()
                .rev()
                .find(|(s, _)| *s > 0 && *s == steps_planned)
                .map(|(_, v)| *v);
            if before.is_some() || after.is_some() {
                test_em.insert(mode.to_string(), (before, after));
            }
        }
        let world = world_of(&table);
        Ok(Self {
            dir: dir.to_path_buf(),
            preset,
            steps_planned,
            steps_done,
            checkpoint: run.latest_checkpoint()?.map(|c| c.step),
            finished: run.root().join("summary.json").is_file(),
            live: run.is_locked()?,
            last_time: log.records.iter().rev().find_map(|r| r.time),
            test_em,
            test_n,
            recent,
            rl_seconds,
            log,
            world,
        })
    }

    /// `finished`; `running step k/N` or `running warm start` while a process holds the
    /// lock; `stopped at step k/N` or `stopped in warm start` when none does and the run wrote
    /// no summary (killed, crashed or interrupted: `turnwise resume` continues it).
    pub fn status(&self) -> String {
        if self.finished {
            return "finished".into();
        }
        let state = if self.live { "running" } else { "stopped" };
        if self.steps_done > 0 || self.checkpoint.is_some() {
            let at = if self.live { "" } else { " at" };
            format!(
                "{state}{at} step {}/{}",
                self.steps_done, self.steps_planned
            )
        } else {
            let during = if self.live { "" } else { " in" };
            format!("{state}{during} warm start")
        }
    }

    /// Whether the run was stopped before it finished (see [`Self::status`]).
    pub fn stopped(&self) -> bool {
        !self.finished && !self.live
    }
}

fn pct(v: Option<f64>) -> String {
    v.map(|v| format!("{:.1}", v * 100.0))
        .unwrap_or_else(|| "-".into())
}

fn num(v: Option<&f64>, prec: usize) -> String {
    v.map(|v| format!("{v:.prec$}"))
        .unwrap_or_else(|| "-".into())
}

/// How long ago `time` (Unix seconds) was, as `12 s`, `5 min`, `3 h` or `2 d`.
fn age(time: Option<f64>, now: f64) -> String {
    let Some(t) = time else {
        return "-".into();
    };
    let s = (now - t).max(0.0);
    if s < 120.0 {
        format!("{s:.0} s")
    } else if s < 7200.0 {
        format!("{:.0} min", s / 60.0)
    } else if s < 172_800.0 {
        format!("{:.0} h", s / 3600.0)
    } else {
        format!("{:.0} d", s / 86_400.0)
    }
}

/// The `turnwise runs` table: one line per run with its preset, status, checkpoint, the last
/// ten steps' training EM and reward, test EM before → after, and when it last logged; then,
/// per stopped run, the `turnwise resume` command that continues it.
pub fn runs_table(runs: &[RunInfo]) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<32} {:<11} {:<24} {:>5} {:>8} {:>7} {:>15} {:>9}",
        "run", "preset", "status", "ckpt", "train em", "reward", "test greedy EM", "last log"
    );
    for r in runs {
        let (b, a) = r.test_em.get("greedy").copied().unwrap_or((None, None));
        let _ = writeln!(
            out,
            "{:<32} {:<11} {:<24} {:>5} {:>8} {:>7} {:>15} {:>9}",
            r.dir.display(),
            r.preset,
            r.status(),
            r.checkpoint
                .map(|c| c.to_string())
                .unwrap_or_else(|| "-".into()),
            num(r.recent.get(mk::train::EM), 3),
            num(r.recent.get(mk::critic::SCORE_MEAN), 3),
            format!("{} -> {}", pct(b), pct(a)),
            age(r.last_time, now),
        );
    }
    for r in runs.iter().filter(|r| r.stopped()) {
        let _ = writeln!(
            out,
            "{}: stopped (no process holds its {} and it wrote no summary.json); continue it \
             with `turnwise resume {}`",
            r.dir.display(),
            super::LOCK_FILE,
            r.dir.display()
        );
    }
    out
}

/// The `turnwise compare` table: per run, test EM before → after (greedy and sampled, in
/// percent), the mean of the last ten steps of each [`SUMMARY_KEYS`] metric, and RL seconds.
pub fn compare_table(runs: &[RunInfo]) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "| run | preset | steps | test n | test greedy EM | test sampled EM |"
    );
    for k in SUMMARY_KEYS {
        let _ = write!(out, " {k} (last 10) |");
    }
    let _ = writeln!(out, " RL s |");
    let _ = write!(out, "|---|---|---:|---:|---:|---:|");
    for _ in SUMMARY_KEYS {
        let _ = write!(out, "---:|");
    }
    let _ = writeln!(out, "---:|");
    for r in runs {
        let em = |mode: &str| {
            let (b, a) = r.test_em.get(mode).copied().unwrap_or((None, None));
            format!("{} -> {}", pct(b), pct(a))
        };
        let _ = write!(
            out,
            "| {} | {} | {}/{} | {} | {} | {} |",
            r.dir.display(),
            r.preset,
            r.steps_done,
            r.steps_planned,
            r.test_n.map_or_else(|| "-".to_owned(), |n| n.to_string()),
            em("greedy"),
            em("sampled")
        );
        for k in SUMMARY_KEYS {
            let _ = write!(out, " {} |", num(r.recent.get(*k), 3));
        }
        let _ = writeln!(out, " {:.0} |", r.rl_seconds);
    }
    let ns: std::collections::BTreeSet<usize> = runs.iter().filter_map(|r| r.test_n).collect();
    if ns.len() > 1 {
        let list: Vec<String> = ns.iter().map(|n| n.to_string()).collect();
        let _ = writeln!(
            out,
            "\nNote: these runs were evaluated on different numbers of test questions ({}): \
             their EMs are not on the same questions.",
            list.join(", ")
        );
    }
    let worlds: Vec<BTreeMap<String, String>> = runs.iter().map(|r| r.world.clone()).collect();
    let differing = differing_world_keys(&worlds);
    if !differing.is_empty() {
        let _ = writeln!(
            out,
            "\nNote: these runs come from different worlds ({} differ): their test questions are \
             not the same.",
            differing.join(", ")
        );
    }
    out
}

/// The dotted world keys ([`RunInfo::world`], [`world_settings`]) whose values (or presence)
/// differ between `worlds`.
pub fn differing_world_keys(worlds: &[BTreeMap<String, String>]) -> Vec<String> {
    let keys: std::collections::BTreeSet<&String> = worlds.iter().flat_map(|w| w.keys()).collect();
    keys.into_iter()
        .filter(|k| {
            let vals: std::collections::BTreeSet<Option<&String>> =
                worlds.iter().map(|w| w.get(*k)).collect();
            vals.len() > 1
        })
        .cloned()
        .collect()
}

/// One chart per [`COMPARE_CHARTS`] entry that some run logged, with a curve per run that
/// logged it (labelled by its directory name): `(file stem, chart)`.
pub fn compare_charts(runs: &[RunInfo]) -> Vec<(String, LineChart)> {
    let mut out = Vec::new();
    for (stem, title, key) in COMPARE_CHARTS {
        let mut chart = LineChart::new(*title).with_y_label(*key);
        for r in runs {
            let points: Vec<(f64, f64)> = r
                .log
                .series(key)
                .into_iter()
                .map(|(s, v)| (s as f64, v))
                .collect();
            if points.is_empty() {
                continue;
            }
            let label = r
                .dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| r.dir.display().to_string());
            chart = chart.with_series(Series::new(label, points));
        }
        if !chart.series.is_empty() {
            out.push(((*stem).to_string(), chart));
        }
    }
    out
}

/// Writes [`compare_charts`] as `DIR/<stem>.svg`; returns the files written.
pub fn write_compare_charts(runs: &[RunInfo], dir: &Path) -> RunResult<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(RunError::io("create the directory", dir))?;
    let mut written = Vec::new();
    for (stem, chart) in compare_charts(runs) {
        let path = dir.join(format!("{stem}.svg"));
        super::dir::write_atomic(&path, chart.to_svg().as_bytes())?;
        written.push(path);
    }
    Ok(written)
}
