//! `metrics.jsonl`: [`MetricsWriter`] appends one durable line per step and phase, and
//! [`read_metrics`] reads them back, tolerating a line torn by a kill.

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::dir::write_atomic;
use super::tensorboard::TensorBoardWriter;
use super::wandb::{FINISH_TIMEOUT, WandbSidecar, WandbStatus};
use super::{RunError, RunResult};

/// Keys every line has; metrics may not use them.
const RESERVED: [&str; 3] = ["step", "phase", "time"];

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricsRecord {
    /// The step (RL step, or warm-start step for the `sft` phase).
    pub step: u64,
    /// `train`, `eval`, `sft`, ... (`train` when the line has none).
    pub phase: String,
    /// Unix seconds when the line was written.
    pub time: Option<f64>,
    /// The numeric metrics; `None` for a value written as null (it was not finite). Booleans
    /// read as 0/1; strings and other values are left out.
    pub values: BTreeMap<String, Option<f64>>,
}

impl MetricsRecord {
    /// The finite value of `key`, if the line has one.
    pub fn get(&self, key: &str) -> Option<f64> {
        self.values
            .get(key)
            .copied()
            .flatten()
            .filter(|v| v.is_finite())
    }

    /// Parses one line; `Err` carries a message.
    fn parse(line: &str) -> Result<Self, String> {
        let value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
        let serde_json::Value::Object(obj) = value else {
            return Err("not a JSON object".into());
        };
        let step = match obj.get("step") {
            Some(serde_json::Value::Number(n)) => n
                .as_u64()
                .or_else(|| {
                    n.as_f64()
                        .filter(|f| *f >= 0.0 && f.fract() == 0.0 && *f < 2f64.powi(53))
                        .map(|f| f as u64)
                })
                .ok_or_else(|| format!("\"step\" is not a non-negative integer: {n}"))?,
            Some(other) => return Err(format!("\"step\" is not a number: {other}")),
            None => return Err("no \"step\"".into()),
        };
        let phase = match obj.get("phase") {
            Some(serde_json::Value::String(s)) => s.clone(),
            None | Some(serde_json::Value::Null) => "train".to_string(),
            Some(other) => return Err(format!("\"phase\" is not a string: {other}")),
        };
        let time = obj.get("time").and_then(serde_json::Value::as_f64);
        let mut values = BTreeMap::new();
        for (k, v) in obj {
            if RESERVED.contains(&k.as_str()) {
                continue;
            }
            let v = match v {
                serde_json::Value::Number(n) => n.as_f64(),
                serde_json::Value::Null => None,
                serde_json::Value::Bool(b) => Some(f64::from(u8::from(b))),
                _ => continue,
            };
            values.insert(k, v);
        }
        Ok(Self {
            step,
            phase,
            time,
            values,
        })
    }
}

/// The contents of a `metrics.jsonl` file, as read by [`read_metrics`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MetricsLog {
    /// The file.
    pub path: PathBuf,
    /// Its lines, in file order.
    pub records: Vec<MetricsRecord>,
    /// The line number (from 1) of a torn last line that was skipped, if any.
    pub torn_last_line: Option<usize>,
}

impl MetricsLog {
    /// A log made from records (for reports and plots of data not read from a file).
    pub fn from_records(records: Vec<MetricsRecord>) -> Self {
        Self {
            path: PathBuf::new(),
            records,
            torn_last_line: None,
        }
    }

    /// Every metric name that has at least one finite value.
    pub fn keys(&self) -> BTreeSet<&str> {
        self.records
            .iter()
            .flat_map(|r| r.values.iter())
            .filter(|(_, v)| v.is_some_and(f64::is_finite))
            .map(|(k, _)| k.as_str())
            .collect()
    }

    /// Whether some line has a finite value of `key`.
    pub fn has(&self, key: &str) -> bool {
        self.records.iter().any(|r| r.get(key).is_some())
    }

    /// The finite `(step, value)` points of `key`, in file order; null or missing values are
    /// skipped.
    pub fn series(&self, key: &str) -> Vec<(u64, f64)> {
        self.records
            .iter()
            .filter_map(|r| r.get(key).map(|v| (r.step, v)))
            .collect()
    }

    /// The lines of one phase.
    pub fn phase<'a>(&'a self, phase: &'a str) -> impl Iterator<Item = &'a MetricsRecord> + 'a {
        self.records.iter().filter(move |r| r.phase == phase)
    }
}

/// Splits file contents into `(line number, text)` of its non-blank lines.
fn lines(text: &str) -> Vec<(usize, &str)> {
    text.split('\n')
        .enumerate()
        .map(|(i, l)| (i + 1, l.strip_suffix('\r').unwrap_or(l)))
        .filter(|(_, l)| !l.trim().is_empty())
        .collect()
}

/// Reads a `metrics.jsonl` file. A last line that cannot be parsed (a write cut short by a
/// kill) is skipped with a warning and reported in [`MetricsLog::torn_last_line`]; a bad line
/// anywhere else is an error naming the file and the line.
pub fn read_metrics(path: impl AsRef<Path>) -> RunResult<MetricsLog> {
    let path = path.as_ref();
    let bytes = fs::read(path).map_err(RunError::io("read", path))?;
    let text = String::from_utf8_lossy(&bytes);
    let lines = lines(&text);
    let mut log = MetricsLog {
        path: path.to_path_buf(),
        ..MetricsLog::default()
    };
    let last = lines.len();
    for (i, (n, line)) in lines.into_iter().enumerate() {
        match MetricsRecord::parse(line) {
            Ok(r) => log.records.push(r),
            Err(message) if i + 1 == last => {
                tracing::warn!(
                    file = %path.display(),
                    line = n,
                    %message,
                    "skipping a torn last line of the metrics"
                );
                log.torn_last_line = Some(n);
            }
            Err(message) => {
                return Err(RunError::BadLine {
                    path: path.to_path_buf(),
                    line: n,
                    message,
                });
            }
        }
    }
    Ok(log)
}

/// Appends metrics lines `{"step": n, "phase": "...", "time": unix seconds, "metric": value,
/// ...}` to a file, each written whole, flushed and synced to disk before [`MetricsWriter::write`]
/// returns, so that a kill loses at most the line being written.
///
/// Each line can also go to TensorBoard event files ([`MetricsWriter::attach_tensorboard`]) and
/// to Weights & Biases ([`MetricsWriter::attach_wandb`]), with the same step, phase, time and
/// finite values.
#[derive(Debug)]
pub struct MetricsWriter {
    path: PathBuf,
    file: fs::File,
    warned: HashSet<String>,
    tensorboard: Option<TensorBoardWriter>,
    wandb: Option<WandbSidecar>,
}

/// How long a resumed run's W&B sidecar may take to accept the replayed log before lines are
/// dropped (see [`MetricsWriter::attach_wandb`]).
const REPLAY_PATIENCE: std::time::Duration = std::time::Duration::from_secs(120);

/// The finite values of a line as read back (what a tracker was sent when it was written).
fn finite_values(r: &MetricsRecord) -> BTreeMap<String, f64> {
    r.values
        .iter()
        .filter_map(|(k, v)| v.filter(|v| v.is_finite()).map(|v| (k.clone(), v)))
        .collect()
}

fn open_append(path: &Path) -> RunResult<fs::File> {
    fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(RunError::io("open for appending", path))
}

/// Cuts a last line that has no newline (a write cut short) off the file.
fn repair_tail(path: &Path) -> RunResult<()> {
    let mut f = match fs::OpenOptions::new().read(true).write(true).open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(RunError::io("open", path)(e)),
    };
    let len = f.metadata().map_err(RunError::io("inspect", path))?.len();
    if len == 0 {
        return Ok(());
    }
    let mut last = [0u8; 1];
    f.seek(SeekFrom::End(-1))
        .and_then(|_| f.read_exact(&mut last))
        .map_err(RunError::io("read", path))?;
    if last[0] == b'\n' {
        return Ok(());
    }
    let mut bytes = Vec::new();
    f.seek(SeekFrom::Start(0))
        .and_then(|_| f.read_to_end(&mut bytes))
        .map_err(RunError::io("read", path))?;
    let keep = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    tracing::warn!(
        file = %path.display(),
        bytes = bytes.len() - keep,
        "cutting a torn last line off the metrics"
    );
    f.set_len(keep as u64)
        .and_then(|_| f.sync_all())
        .map_err(RunError::io("truncate", path))
}

fn unix_now() -> f64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    (t * 1000.0).round() / 1000.0
}

impl MetricsWriter {
    /// Opens (or creates) `path` for appending. A torn last line left by a kill is cut off first,
    /// so the next line does not join it.
    pub fn open(path: impl Into<PathBuf>) -> RunResult<Self> {
        let path = path.into();
        // Inside a folder turnwise owns, only its own log is appended to; the log is recorded
        // as a growing file (crate::ownership).
        crate::ownership::may_write(&path)?;
        repair_tail(&path)?;
        let file = open_append(&path)?;
        crate::ownership::wrote_growing(&path)?;
        Ok(Self {
            path,
            file,
            warned: HashSet::new(),
            tensorboard: None,
            wandb: None,
        })
    }

    /// Mirrors the log into TensorBoard event files in `dir`: rewrites the folder from the lines
    /// the file holds now ([`TensorBoardWriter::rewrite`]; call it after any truncation for a
    /// resume) and appends every line written from now on. Returns the event file.
    pub fn attach_tensorboard(&mut self, dir: impl AsRef<Path>) -> RunResult<PathBuf> {
        let records = read_metrics(&self.path)?.records;
        let w = TensorBoardWriter::rewrite(dir, &records)?;
        let path = w.path().to_path_buf();
        self.tensorboard = Some(w);
        Ok(path)
    }

    /// Sends the log to Weights & Biases through `sidecar`: first every line the file holds
    /// now (a resumed run's W&B run starts with the whole truncated log, so it holds what
    /// `metrics.jsonl` holds), then every line written from now on. Never fails the run: a
    /// sidecar that dies is reported once and left behind.
    pub fn attach_wandb(&mut self, mut sidecar: WandbSidecar) -> RunResult<()> {
        let records = read_metrics(&self.path)?.records;
        let deadline = std::time::Instant::now() + REPLAY_PATIENCE;
        for r in &records {
            let patience = deadline.saturating_duration_since(std::time::Instant::now());
            sidecar.log_waiting(r.step, &r.phase, &finite_values(r), patience);
        }
        self.wandb = Some(sidecar);
        Ok(())
    }

    /// Ends the W&B run, if one is attached: closes the sidecar's input and waits for
    /// `wandb.finish` (three minutes at most). Returns its status; `Ok(None)` without a
    /// sidecar or when it had died before (reported then).
    pub fn finish_wandb(&mut self) -> RunResult<Option<WandbStatus>> {
        match self.wandb.take() {
            Some(mut w) => w.finish(FINISH_TIMEOUT),
            None => Ok(None),
        }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one line for `step` and `phase` with the current time. Metrics are written in
    /// name order (the last of duplicates wins); a non-finite value is written as null with a
    /// warning (once per metric name); a metric named `step`, `phase` or `time` is skipped with a
    /// warning.
    pub fn write<K, V>(
        &mut self,
        step: u64,
        phase: &str,
        metrics: impl IntoIterator<Item = (K, V)>,
    ) -> RunResult<()>
    where
        K: AsRef<str>,
        V: Borrow<f64>,
    {
        self.write_at(step, phase, unix_now(), metrics)
    }

    /// [`MetricsWriter::write`] with an explicit time (unix seconds).
    pub fn write_at<K, V>(
        &mut self,
        step: u64,
        phase: &str,
        time: f64,
        metrics: impl IntoIterator<Item = (K, V)>,
    ) -> RunResult<()>
    where
        K: AsRef<str>,
        V: Borrow<f64>,
    {
        let mut sorted: BTreeMap<String, f64> = metrics
            .into_iter()
            .map(|(k, v)| (k.as_ref().to_string(), *v.borrow()))
            .collect();
        let mut line = format!(
            "{{\"step\":{step},\"phase\":{},\"time\":{}",
            json_str(phase),
            number(time)
        );
        for (k, &v) in &sorted {
            if RESERVED.contains(&k.as_str()) {
                tracing::warn!(metric = %k, "a metric may not be named step, phase or time: skipped");
                continue;
            }
            if !v.is_finite() && self.warned.insert(k.clone()) {
                tracing::warn!(
                    metric = %k,
                    step,
                    value = %v,
                    "non-finite metric written as null (warned once per metric)"
                );
            }
            line.push(',');
            line.push_str(&json_str(k));
            line.push(':');
            line.push_str(&number(v));
        }
        line.push_str("}\n");
        self.file
            .write_all(line.as_bytes())
            .and_then(|_| self.file.flush())
            .and_then(|_| self.file.sync_data())
            .map_err(RunError::io("append to", &self.path))?;
        if self.tensorboard.is_some() || self.wandb.is_some() {
            // What the line holds as read back: finite values, reserved names left out.
            sorted.retain(|k, v| v.is_finite() && !RESERVED.contains(&k.as_str()));
            if let Some(tb) = &mut self.tensorboard {
                tb.write(step, phase, time, &sorted)?;
            }
            if let Some(w) = &mut self.wandb {
                w.log(step, phase, &sorted);
            }
        }
        Ok(())
    }

    /// Drops every line past `step`, whatever its phase, so that a run resumed from the
    /// checkpoint of `step` does not log those steps twice; a torn line is dropped too (and the
    /// TensorBoard files, when attached, are rewritten to match). Returns how many lines were
    /// dropped. Warm-start (`sft`) lines count their own steps: use
    /// [`MetricsWriter::truncate_phases_after`] to leave them alone.
    pub fn truncate_after(&mut self, step: u64) -> RunResult<usize> {
        self.truncate_where(step, |_| true)
    }

    /// [`MetricsWriter::truncate_after`] for the lines of the given phases only.
    pub fn truncate_phases_after(&mut self, step: u64, phases: &[&str]) -> RunResult<usize> {
        self.truncate_where(step, |p| phases.contains(&p))
    }

    fn truncate_where(&mut self, step: u64, phase: impl Fn(&str) -> bool) -> RunResult<usize> {
        self.retain(|r| !(r.step > step && phase(&r.phase)))
    }

    /// Keeps the lines for which `keep` is true and drops the others (and a torn last line),
    /// as [`MetricsWriter::truncate_after`] does; a missing file is left missing. Returns how
    /// many lines were dropped.
    pub fn retain(&mut self, keep: impl Fn(&MetricsRecord) -> bool) -> RunResult<usize> {
        if !self.path.exists() {
            return Ok(0);
        }
        let bytes = fs::read(&self.path).map_err(RunError::io("read", &self.path))?;
        let text = String::from_utf8_lossy(&bytes);
        let lines = lines(&text);
        let last = lines.len();
        let mut kept = String::new();
        let mut dropped = 0;
        for (i, (n, line)) in lines.into_iter().enumerate() {
            match MetricsRecord::parse(line) {
                Ok(r) if !keep(&r) => dropped += 1,
                Ok(_) => {
                    kept.push_str(line);
                    kept.push('\n');
                }
                Err(message) if i + 1 == last => {
                    tracing::warn!(file = %self.path.display(), line = n, %message, "dropping a torn last line");
                    dropped += 1;
                }
                Err(message) => {
                    return Err(RunError::BadLine {
                        path: self.path.clone(),
                        line: n,
                        message,
                    });
                }
            }
        }
        if dropped > 0 {
            write_atomic(&self.path, kept.as_bytes())?;
            // The rename replaced the file: append to the new one.
            self.file = open_append(&self.path)?;
            // TensorBoard follows the file (W&B cannot take logged lines back).
            if let Some(dir) = self
                .tensorboard
                .as_ref()
                .and_then(|tb| tb.path().parent().map(Path::to_path_buf))
            {
                self.attach_tensorboard(dir)?;
            }
            tracing::info!(file = %self.path.display(), dropped, "metrics truncated for resuming");
        }
        Ok(dropped)
    }
}

/// A finite number as JSON, anything else as null.
fn number(v: f64) -> String {
    serde_json::Number::from_f64(v).map_or_else(|| "null".to_string(), |n| n.to_string())
}

/// A string as JSON text.
fn json_str(s: &str) -> String {
    serde_json::Value::String(s.to_string()).to_string()
}

/// The change of EM between two evaluations of the same questions, with its paired standard
/// error: the standard error of the mean per-question difference `after − before`, which
/// counts only the questions whose outcome changed. Both evaluations' binomial errors (`em_se`)
/// treat them as independent samples; on shared questions most outcomes agree, and the paired
/// error is the one that measures the change.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PairedGain {
    /// Questions compared.
    pub n: usize,
    /// EM before.
    pub before: f64,
    /// EM after.
    pub after: f64,
    /// `after − before`.
    pub gain: f64,
    /// Standard error of `gain`: the sample standard deviation of the per-question
    /// differences over √n (0 with fewer than two questions).
    pub se: f64,
    /// Questions whose EM rose.
    pub improved: usize,
    /// Questions whose EM fell.
    pub regressed: usize,
}

impl PairedGain {
    /// The gain as metrics under `prefix` (`gain/<split>/<mode>`): `<prefix>/em` (the gain, not
    /// the EM after), `/se`, `/n`, `/improved` and `/regressed`. The EMs before and after are the
    /// evaluation lines' own and are not repeated.
    pub fn to_metrics(&self, prefix: &str) -> Vec<(String, f64)> {
        vec![
            (format!("{prefix}/em"), self.gain),
            (format!("{prefix}/se"), self.se),
            (format!("{prefix}/n"), self.n as f64),
            (format!("{prefix}/improved"), self.improved as f64),
            (format!("{prefix}/regressed"), self.regressed as f64),
        ]
    }

    /// Reads back what [`PairedGain::to_metrics`] wrote under `prefix`, looking keys up with
    /// `get`; `before` is the EM of the evaluation before (`after` is `before + gain`). `None`
    /// when the gain, its standard error or its count is missing; missing question counts read 0.
    pub fn from_metrics(
        prefix: &str,
        before: f64,
        get: impl Fn(&str) -> Option<f64>,
    ) -> Option<Self> {
        let f = |k: &str| get(&format!("{prefix}/{k}"));
        let (gain, se, n) = (f("em")?, f("se")?, f("n")?);
        Some(Self {
            n: n as usize,
            before,
            after: before + gain,
            gain,
            se,
            improved: f("improved").unwrap_or(0.0) as usize,
            regressed: f("regressed").unwrap_or(0.0) as usize,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(pairs: &[(&str, f64)]) -> BTreeMap<String, f64> {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn a_paired_gain_reads_back_from_its_metrics() {
        let g = PairedGain {
            n: 450,
            before: 0.5,
            after: 0.5 + 0.06,
            gain: 0.06,
            se: 0.017,
            improved: 40,
            regressed: 13,
        };
        let written: BTreeMap<String, f64> = g.to_metrics("gain/test/greedy").into_iter().collect();
        assert_eq!(written.len(), 5);
        let back =
            PairedGain::from_metrics("gain/test/greedy", 0.5, |k| written.get(k).copied()).unwrap();
        assert_eq!(back, g);
        // Another prefix, or a missing standard error, is no gain.
        assert!(
            PairedGain::from_metrics("gain/test/sampled", 0.5, |k| written.get(k).copied())
                .is_none()
        );
        let mut no_se = written.clone();
        no_se.remove("gain/test/greedy/se");
        assert!(
            PairedGain::from_metrics("gain/test/greedy", 0.5, |k| no_se.get(k).copied()).is_none()
        );
    }

    #[test]
    fn writes_one_object_per_line_with_nulls_for_non_finite() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("metrics.jsonl");
        let mut w = MetricsWriter::open(&path).unwrap();
        w.write(
            1,
            "train",
            &m(&[("actor/pg_loss", 0.5), ("actor/entropy", f64::NAN)]),
        )
        .unwrap();
        w.write(1, "eval", [("eval/greedy/em", 0.25), ("x", f64::INFINITY)])
            .unwrap();
        w.write(
            2,
            "train",
            vec![("step".to_string(), 3.0), ("a\"b".to_string(), -1.0)],
        )
        .unwrap();
        let text = fs::read_to_string(&path).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 3);
        assert!(text.starts_with("{\"step\":1,\"phase\":\"train\",\"time\":"));
        assert_eq!(lines[0]["actor/pg_loss"], 0.5);
        assert!(lines[0]["actor/entropy"].is_null());
        assert!(lines[0]["time"].as_f64().unwrap() > 1.6e9);
        assert_eq!(lines[1]["phase"], "eval");
        assert!(lines[1]["x"].is_null());
        assert_eq!(lines[2]["step"], 2, "a metric named step is skipped");
        assert_eq!(lines[2]["a\"b"], -1.0);

        let log = read_metrics(&path).unwrap();
        assert_eq!(log.records.len(), 3);
        assert_eq!(log.torn_last_line, None);
        assert_eq!(log.records[0].get("actor/pg_loss"), Some(0.5));
        assert_eq!(log.records[0].values["actor/entropy"], None);
        assert_eq!(log.records[0].get("actor/entropy"), None);
        assert_eq!(log.series("eval/greedy/em"), vec![(1, 0.25)]);
        assert!(log.has("actor/pg_loss") && !log.has("actor/entropy"));
        assert!(!log.keys().contains("x"));
        assert_eq!(log.phase("train").count(), 2);
    }

    #[test]
    fn reader_skips_a_torn_last_line_and_rejects_a_bad_middle_one() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("metrics.jsonl");
        fs::write(
            &path,
            "{\"step\":1,\"phase\":\"train\",\"r\":1.0}\n\n{\"step\":2,\"r\":2,\"s\":\"text\",\"ok\":true}\n{\"step\":3,\"phase\":\"tr",
        )
        .unwrap();
        let log = read_metrics(&path).unwrap();
        assert_eq!(log.records.len(), 2);
        assert_eq!(log.torn_last_line, Some(4));
        assert_eq!(log.records[1].phase, "train");
        assert_eq!(log.records[1].get("ok"), Some(1.0));
        assert!(!log.records[1].values.contains_key("s"));
        assert_eq!(log.series("r"), vec![(1, 1.0), (2, 2.0)]);

        fs::write(&path, "{\"step\":1}\n{oops}\n{\"step\":2}\n").unwrap();
        let err = read_metrics(&path).unwrap_err();
        assert!(matches!(err, RunError::BadLine { line: 2, .. }), "{err}");
        assert!(err.to_string().contains("metrics.jsonl:2"), "{err}");
        fs::write(&path, "{\"phase\":\"x\"}\n{\"step\":1}\n").unwrap();
        assert!(read_metrics(&path).is_err());
        let err = read_metrics(tmp.path().join("none.jsonl")).unwrap_err();
        assert!(err.to_string().contains("none.jsonl"), "{err}");
    }

    #[test]
    fn reopening_cuts_a_torn_tail_before_appending() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("metrics.jsonl");
        fs::write(&path, "{\"step\":1,\"a\":1}\n{\"step\":2,\"a\"").unwrap();
        let mut w = MetricsWriter::open(&path).unwrap();
        w.write(2, "train", [("a", 2.0)]).unwrap();
        let log = read_metrics(&path).unwrap();
        assert_eq!(log.torn_last_line, None);
        assert_eq!(log.series("a"), vec![(1, 1.0), (2, 2.0)]);
        // A file that is one torn line.
        fs::write(&path, "{\"st").unwrap();
        MetricsWriter::open(&path).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"");
    }

    #[test]
    fn truncate_after_drops_later_steps_and_keeps_appending() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("metrics.jsonl");
        let mut w = MetricsWriter::open(&path).unwrap();
        for s in [100, 200] {
            w.write(s, "sft", [("sft/loss", 1.0 / s as f64)]).unwrap();
        }
        for s in 1..=5 {
            w.write(s, "train", [("r", s as f64)]).unwrap();
            if s % 2 == 0 {
                w.write(s, "eval", [("eval/em", s as f64 / 10.0)]).unwrap();
            }
        }
        drop(w);
        // Killed while writing step 6.
        let mut f = fs::OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"{\"step\":6,\"pha").unwrap();
        drop(f);

        let mut w = MetricsWriter::open(&path).unwrap();
        // train 4, 5, eval 4 are dropped; sft lines are left alone.
        assert_eq!(w.truncate_phases_after(3, &["train", "eval"]).unwrap(), 3);
        w.write(4, "train", [("r", 40.0)]).unwrap();
        let log = read_metrics(&path).unwrap();
        assert_eq!(
            log.series("r"),
            vec![(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
        );
        assert_eq!(log.series("eval/em"), vec![(2, 0.2)]);
        assert_eq!(log.series("sft/loss").len(), 2);
        // Nothing to drop: the file is untouched.
        assert_eq!(w.truncate_phases_after(10, &["train", "eval"]).unwrap(), 0);
        // All phases: sft 100 and 200 go too.
        assert_eq!(w.truncate_after(2).unwrap(), 4);
        let log = read_metrics(&path).unwrap();
        assert_eq!(log.records.len(), 3);
        assert!(!path.with_extension("jsonl.tmp").exists());

        // With TensorBoard attached, its events follow the truncation.
        let tb = tmp.path().join("tb");
        w.attach_tensorboard(&tb).unwrap();
        w.write(3, "train", [("r", 30.0)]).unwrap();
        assert_eq!(w.truncate_after(2).unwrap(), 1);
        let files = super::super::tensorboard::event_files(&tb).unwrap();
        assert_eq!(files.len(), 1);
        let steps: Vec<i64> = super::super::tensorboard::read_event_file(&files[0])
            .unwrap()
            .iter()
            .skip(1)
            .map(|e| e.step)
            .collect();
        assert_eq!(steps, [1, 2, 2]);
    }
}
