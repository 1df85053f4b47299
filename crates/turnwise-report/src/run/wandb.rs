//! Weights & Biases logging through a Python sidecar: `python3 -c <wandb_sidecar.py>` (the
//! script is embedded in the binary), fed one JSON line per metrics line on its stdin (the
//! protocol is described at the top of the script). The trainer never waits on it: lines go
//! through a bounded queue to a writer thread, and a sidecar that dies or stops reading is
//! reported once with a warning while the run goes on (`metrics.jsonl` and the TensorBoard
//! files keep everything).
//!
//! Tags are TensorBoard's ([`super::tensorboard::metric_tags`]); each phase has its own x axis in
//! W&B (`step/train`, `step/eval`, `step/sft`, ...), as warm-start and RL steps count apart.

use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::tensorboard::metric_tags;
use super::{RunError, RunResult};

/// The sidecar's Python source.
pub const SIDECAR_SCRIPT: &str = include_str!("wandb_sidecar.py");

/// How long `wandb.init` may take (it contacts the server when online).
const READY_TIMEOUT: Duration = Duration::from_secs(180);
/// How long `wandb.finish` may take at the end of a run (it uploads what is left when online).
pub const FINISH_TIMEOUT: Duration = Duration::from_secs(180);
/// Lines queued for a sidecar that is slow to read before further lines are dropped.
const QUEUE: usize = 10_000;
/// Lines of the sidecar's stderr kept to explain its death.
const TAIL: usize = 20;

/// The Python interpreter that runs the sidecar: `$TURNWISE_PYTHON`, else `python3`.
pub fn python() -> String {
    std::env::var("TURNWISE_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Checks that `python` runs and imports `wandb`; the error says how to get it.
pub fn check_wandb(python: &str) -> RunResult<()> {
    let why = match Command::new(python)
        .args(["-c", "import wandb"])
        .stdin(Stdio::null())
        .output()
    {
        Ok(o) if o.status.success() => return Ok(()),
        Ok(o) => String::from_utf8_lossy(&o.stderr)
            .lines()
            .last()
            .unwrap_or("")
            .trim()
            .to_string(),
        Err(e) => format!("cannot run it: {e}"),
    };
    Err(RunError::Tracking {
        message: format!(
            "logging to Weights & Biases needs the `wandb` Python package, and {python} cannot \
             import it ({why}): install it with `{python} -m pip install wandb`, or point \
             TURNWISE_PYTHON at a Python that has it"
        ),
    })
}

/// Whether the W&B run syncs as it goes or is kept on disk for `wandb sync`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WandbMode {
    /// Logs to the W&B server (offline when no API key is found).
    Online,
    /// Writes the run under `<dir>/wandb/offline-run-*` only.
    Offline,
}

/// The W&B run to start.
#[derive(Debug, Clone, serde::Serialize)]
pub struct WandbOptions {
    /// The Python interpreter ([`python`]); not sent to the sidecar.
    #[serde(skip)]
    pub python: String,
    /// Online or offline.
    pub mode: WandbMode,
    /// The W&B project.
    pub project: String,
    /// The W&B entity (user or team); the account's default when `None`.
    pub entity: Option<String>,
    /// The W&B run's display name.
    pub name: String,
    /// The W&B group: every process of one run (the run and its resumes) shares it.
    pub group: String,
    /// `train` for a new run, `resume` for a resumed one.
    pub job_type: String,
    /// Where wandb writes its `wandb/` folder (the run directory).
    pub dir: PathBuf,
    /// The run's configuration, shown as the W&B run's config.
    pub config: serde_json::Value,
}

/// What the sidecar said when its W&B run started or finished.
#[derive(Debug, Clone, PartialEq, Default, serde::Deserialize)]
pub struct WandbStatus {
    /// `online` or `offline` (what runs, which is offline when online had no API key).
    #[serde(default)]
    pub mode: String,
    /// Why an online run runs offline.
    #[serde(default)]
    pub reason: Option<String>,
    /// The run's page (online).
    #[serde(default)]
    pub url: Option<String>,
    /// The run's local folder (`.../wandb/offline-run-*` offline, which `wandb sync` uploads).
    #[serde(default)]
    pub dir: Option<String>,
}

/// A line the sidecar printed on stdout, or the end of its stdout.
enum Reply {
    Ready(WandbStatus),
    Finished(WandbStatus),
    Error(String),
    Closed,
}

fn parse_reply(line: &str) -> Option<Reply> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    let status = || serde_json::from_value::<WandbStatus>(v.clone()).unwrap_or_default();
    match v.get("event")?.as_str()? {
        "ready" => Some(Reply::Ready(status())),
        "finished" => Some(Reply::Finished(status())),
        "error" => Some(Reply::Error(
            v.get("message")
                .and_then(|m| m.as_str())
                .unwrap_or("unknown error")
                .to_string(),
        )),
        _ => None,
    }
}

/// State shared with the sidecar's threads.
#[derive(Debug, Default)]
struct Shared {
    /// The sidecar stopped reading (died, or its stdin broke).
    dead: AtomicBool,
    /// The death was reported.
    warned: AtomicBool,
    /// Lines were dropped because the queue was full (reported once).
    dropped: AtomicBool,
    /// The last lines of its stderr.
    tail: Mutex<VecDeque<String>>,
}

impl Shared {
    fn tail(&self) -> String {
        let tail = self.tail.lock().map(|t| t.clone()).unwrap_or_default();
        if tail.is_empty() {
            "it printed nothing".into()
        } else {
            format!(
                "its last messages: {}",
                tail.into_iter().collect::<Vec<_>>().join(" | ")
            )
        }
    }

    /// Marks the sidecar dead and warns once.
    fn died(&self, what: &str) {
        self.dead.store(true, Ordering::SeqCst);
        if !self.warned.swap(true, Ordering::SeqCst) {
            tracing::warn!(
                "the Weights & Biases sidecar {what} ({}); W&B gets no more of this run, and \
                 metrics.jsonl and the TensorBoard files keep every metric",
                self.tail()
            );
        }
    }
}

/// A running W&B sidecar (see the [module documentation](self)).
pub struct WandbSidecar {
    child: Child,
    queue: Option<SyncSender<String>>,
    writer: Option<JoinHandle<()>>,
    replies: Receiver<Reply>,
    shared: Arc<Shared>,
    status: WandbStatus,
    finished: bool,
}

impl std::fmt::Debug for WandbSidecar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WandbSidecar")
            .field("pid", &self.child.id())
            .field("status", &self.status)
            .field("dead", &self.shared.dead.load(Ordering::SeqCst))
            .finish()
    }
}

impl WandbSidecar {
    /// Starts the sidecar and waits until its `wandb.init` has returned. Fails, naming the
    /// cause, when the interpreter cannot run, cannot import `wandb`, or `wandb.init` fails or
    /// does not return within three minutes.
    pub fn start(opts: &WandbOptions) -> RunResult<Self> {
        let fail = |message: String| RunError::Tracking { message };
        let mut child = Command::new(&opts.python)
            .args(["-u", "-c", SIDECAR_SCRIPT])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                fail(format!(
                    "cannot start the Weights & Biases sidecar with {}: {e}",
                    opts.python
                ))
            })?;
        let shared = Arc::new(Shared::default());
        let (reply_tx, replies) = mpsc::channel();
        let stdout = child.stdout.take().expect("piped stdout");
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(reply) = parse_reply(&line) {
                    let _ = reply_tx.send(reply);
                }
            }
            let _ = reply_tx.send(Reply::Closed);
        });
        let stderr = child.stderr.take().expect("piped stderr");
        let s = Arc::clone(&shared);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                // wandb is chatty (a run summary at the end): its lines are debug output,
                // and the last ones explain a sidecar that died.
                tracing::debug!(target: "turnwise::wandb", "{line}");
                if let Ok(mut tail) = s.tail.lock() {
                    if tail.len() == TAIL {
                        tail.pop_front();
                    }
                    tail.push_back(line);
                }
            }
        });
        let mut stdin = child.stdin.take().expect("piped stdin");
        let settings = serde_json::to_string(opts).map_err(|cause| RunError::Serialize {
            path: opts.dir.clone(),
            cause,
        })?;
        // A sidecar that exits at once breaks the pipe: its reply says why.
        let _ = writeln!(stdin, "{settings}").and_then(|_| stdin.flush());
        let mut sidecar = Self {
            child,
            queue: None,
            writer: None,
            replies,
            shared,
            status: WandbStatus::default(),
            finished: false,
        };
        let failure = match sidecar.replies.recv_timeout(READY_TIMEOUT) {
            Ok(Reply::Ready(status)) => {
                sidecar.status = status;
                None
            }
            Ok(Reply::Error(message)) => Some(message),
            Ok(Reply::Finished(_) | Reply::Closed) => Some(format!(
                "it stopped before wandb.init returned ({})",
                sidecar.shared.tail()
            )),
            Err(_) => Some(format!(
                "wandb.init did not return within {} s ({})",
                READY_TIMEOUT.as_secs(),
                sidecar.shared.tail()
            )),
        };
        if let Some(message) = failure {
            sidecar.finished = true;
            let _ = sidecar.child.kill();
            let _ = sidecar.child.wait();
            return Err(fail(format!(
                "the Weights & Biases sidecar ({}) could not start its run: {message}",
                opts.python
            )));
        }
        let (tx, rx) = mpsc::sync_channel::<String>(QUEUE);
        let s = Arc::clone(&sidecar.shared);
        sidecar.writer = Some(std::thread::spawn(move || write_lines(stdin, rx, &s)));
        sidecar.queue = Some(tx);
        Ok(sidecar)
    }

    /// What the sidecar said when its run started: the mode that runs (`offline` with a
    /// reason when online was asked without credentials), the run's page and folder.
    pub fn status(&self) -> &WandbStatus {
        &self.status
    }

    /// Whether the sidecar is known to have stopped.
    pub fn is_dead(&self) -> bool {
        self.check_exit();
        self.shared.dead.load(Ordering::SeqCst)
    }

    /// Notices a sidecar that exited (its stdout closed) before it was asked to finish.
    fn check_exit(&self) {
        if self.finished || self.shared.dead.load(Ordering::SeqCst) {
            return;
        }
        loop {
            match self.replies.try_recv() {
                Ok(Reply::Closed) | Err(mpsc::TryRecvError::Disconnected) => {
                    self.shared.died("exited");
                    return;
                }
                Ok(_) => {}
                Err(mpsc::TryRecvError::Empty) => return,
            }
        }
    }

    /// Queues one metrics line (its finite values under [`metric_tags`]); never blocks. A dead
    /// sidecar is reported once and then ignored; when the sidecar falls [`QUEUE`] lines behind,
    /// further lines are dropped with one warning.
    pub fn log(&mut self, step: u64, phase: &str, values: &BTreeMap<String, f64>) {
        self.log_waiting(step, phase, values, Duration::ZERO);
    }

    /// [`WandbSidecar::log`], waiting up to `patience` for room in a full queue (replaying a
    /// long log at the start of a resumed run).
    pub fn log_waiting(
        &mut self,
        step: u64,
        phase: &str,
        values: &BTreeMap<String, f64>,
        patience: Duration,
    ) {
        if self.is_dead() {
            return;
        }
        let tagged: serde_json::Map<String, serde_json::Value> = metric_tags(phase, values)
            .into_iter()
            .filter_map(|(t, v)| serde_json::Number::from_f64(v).map(|n| (t, n.into())))
            .collect();
        if tagged.is_empty() {
            return;
        }
        let mut line =
            serde_json::json!({"step": step, "phase": phase, "values": tagged}).to_string();
        let Some(queue) = &self.queue else { return };
        let deadline = std::time::Instant::now() + patience;
        loop {
            match queue.try_send(line) {
                Ok(()) => return,
                Err(TrySendError::Full(l)) if std::time::Instant::now() < deadline => {
                    line = l;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => {
                    self.queue_failed(e);
                    return;
                }
            }
        }
    }

    fn queue_failed(&self, e: TrySendError<String>) {
        match e {
            TrySendError::Full(_) => {
                if !self.shared.dropped.swap(true, Ordering::SeqCst) {
                    tracing::warn!(
                        "the Weights & Biases sidecar is {QUEUE} metrics lines behind: lines \
                         are dropped for W&B until it catches up (metrics.jsonl and the \
                         TensorBoard files keep them)"
                    );
                }
            }
            TrySendError::Disconnected(_) => self.shared.died("stopped reading"),
        }
    }

    /// Closes the sidecar's input and waits up to `timeout` for `wandb.finish` (which uploads
    /// what is left when online). Returns the finished run's status; `Ok(None)` when the
    /// sidecar had died earlier (that was reported then) or this was called before; an error
    /// when it dies or times out now (it is killed then).
    pub fn finish(&mut self, timeout: Duration) -> RunResult<Option<WandbStatus>> {
        if self.finished {
            return Ok(None);
        }
        let was_dead = self.is_dead();
        self.finished = true;
        // Dropping the queue ends the writer thread once it has written what is queued, which
        // closes the sidecar's stdin. It is joined only after the wait below: a sidecar that
        // stopped reading keeps it blocked until the sidecar is killed.
        self.queue = None;
        let deadline = std::time::Instant::now() + timeout;
        let outcome = loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.replies.recv_timeout(left) {
                Ok(Reply::Finished(status)) => break Ok(status),
                Ok(Reply::Closed) | Err(RecvTimeoutError::Disconnected) => {
                    break Err("exited before wandb.finish returned".to_string());
                }
                Ok(Reply::Error(m)) => break Err(m),
                Ok(Reply::Ready(_)) => {}
                Err(RecvTimeoutError::Timeout) => {
                    break Err(format!(
                        "did not finish within {} s and was stopped",
                        timeout.as_secs()
                    ));
                }
            }
        };
        if outcome.is_err() {
            // Reported below: the writer thread's broken pipe is not reported again.
            self.shared.warned.store(true, Ordering::SeqCst);
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
        match outcome {
            Ok(status) => Ok(Some(status)),
            Err(_) if was_dead => Ok(None),
            Err(m) => Err(RunError::Tracking {
                message: format!(
                    "the Weights & Biases sidecar {m} ({}); metrics.jsonl and the TensorBoard \
                     files keep every metric",
                    self.shared.tail()
                ),
            }),
        }
    }
}

impl Drop for WandbSidecar {
    fn drop(&mut self) {
        if let Err(e) = self.finish(FINISH_TIMEOUT) {
            tracing::warn!("{e}");
        }
    }
}

/// The writer thread: sends each queued line to the sidecar; a broken pipe marks it dead.
/// Returns (closing the sidecar's stdin) when the queue is dropped or the pipe breaks.
fn write_lines(mut stdin: ChildStdin, rx: Receiver<String>, shared: &Shared) {
    for line in rx {
        if let Err(e) = writeln!(stdin, "{line}").and_then(|_| stdin.flush()) {
            shared.died(&format!("stopped reading its input ({e})"));
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// A stand-in for the `wandb` package: records every call as a JSON line in
    /// `$FAKE_WANDB_LOG`; `$FAKE_WANDB_DIE_AFTER=N` exits the process at the N+1-th `log`, and
    /// `$FAKE_WANDB_HANG=1` makes `log` never return.
    const FAKE_WANDB: &str = include_str!("../../tests/fake_wandb/wandb.py");

    /// A Python interpreter (a shell script around `python3`, or `$TURNWISE_PYTHON`) with the
    /// environment `env` (`NAME=value` words) and the fake `wandb` on its path; `-S` leaves the
    /// site packages out, so no real `wandb` is found either.
    fn python_with(dir: &Path, env: &str, no_site: bool) -> String {
        use std::os::unix::fs::PermissionsExt;
        let real = std::env::var("TURNWISE_PYTHON").unwrap_or_else(|_| "python3".into());
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let script = dir.join(format!("python-{}", N.fetch_add(1, Ordering::SeqCst)));
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\nexec env -u WANDB_API_KEY HOME='{}' {env} {real} {} \"$@\"\n",
                dir.display(),
                if no_site { "-S" } else { "" }
            ),
        )
        .unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        script.display().to_string()
    }

    fn fake(dir: &Path, extra: &str) -> (String, PathBuf) {
        let pkg = dir.join("fake");
        std::fs::create_dir_all(&pkg).unwrap();
        std::fs::write(pkg.join("wandb.py"), FAKE_WANDB).unwrap();
        let calls = dir.join("calls.jsonl");
        let env = format!(
            "PYTHONPATH='{}' FAKE_WANDB_LOG='{}' {extra}",
            pkg.display(),
            calls.display()
        );
        (python_with(dir, &env, true), calls)
    }

    fn options(python: String, dir: &Path, mode: WandbMode) -> WandbOptions {
        WandbOptions {
            python,
            mode,
            project: "proj".into(),
            entity: None,
            name: "run-a".into(),
            group: "run-a".into(),
            job_type: "train".into(),
            dir: dir.to_path_buf(),
            config: serde_json::json!({"seed": 7, "run": {"steps": 3}}),
        }
    }

    fn calls(path: &Path) -> Vec<serde_json::Value> {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    fn m(pairs: &[(&str, f64)]) -> BTreeMap<String, f64> {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn the_sidecar_logs_every_line_and_goes_offline_without_a_key() {
        let tmp = tempfile::tempdir().unwrap();
        let (python, log) = fake(tmp.path(), "");
        let mut w = WandbSidecar::start(&options(python, tmp.path(), WandbMode::Online)).unwrap();
        let status = w.status().clone();
        assert_eq!(status.mode, "offline", "{status:?}");
        assert!(
            status.reason.as_deref().unwrap().contains("WANDB_API_KEY"),
            "{status:?}"
        );
        assert!(status.dir.as_deref().unwrap().ends_with("offline-run-fake"));
        w.log(1, "train", &m(&[("actor/pg_loss", 0.5), ("x", f64::NAN)]));
        w.log(
            1,
            "eval",
            &m(&[("eval/test/greedy/em", 0.25), ("timing_s/eval", 2.0)]),
        );
        w.log(2, "train", &m(&[("actor/pg_loss", 0.25)]));
        w.log(2, "train", &m(&[("y", f64::INFINITY)]));
        let done = w.finish(Duration::from_secs(60)).unwrap().unwrap();
        assert_eq!(done.mode, "offline");
        assert!(!w.is_dead());

        let c = calls(&log);
        assert_eq!(c[0]["call"], "init");
        assert_eq!(c[0]["mode"], "offline");
        assert_eq!(
            (
                &c[0]["project"],
                &c[0]["name"],
                &c[0]["group"],
                &c[0]["job_type"]
            ),
            (
                &serde_json::json!("proj"),
                &serde_json::json!("run-a"),
                &serde_json::json!("run-a"),
                &serde_json::json!("train")
            )
        );
        assert!(c[0].get("entity").is_none(), "{}", c[0]);
        assert_eq!(c[0]["config"]["run"]["steps"], 3);
        let logs: Vec<&serde_json::Value> = c
            .iter()
            .filter(|x| x["call"] == "log")
            .map(|x| &x["data"])
            .collect();
        assert_eq!(
            logs,
            [
                &serde_json::json!({"actor/pg_loss": 0.5, "step/train": 1}),
                &serde_json::json!({"eval/test/greedy/em": 0.25,
                    "eval/test/greedy/timing_s/eval": 2.0, "step/eval": 1}),
                &serde_json::json!({"actor/pg_loss": 0.25, "step/train": 2}),
            ]
        );
        let defined: Vec<(String, Option<String>)> = c
            .iter()
            .filter(|x| x["call"] == "define_metric")
            .map(|x| {
                (
                    x["name"].as_str().unwrap().to_string(),
                    x["step_metric"].as_str().map(String::from),
                )
            })
            .collect();
        assert!(
            defined.contains(&("step/train".into(), None)),
            "{defined:?}"
        );
        assert!(
            defined.contains(&("eval/test/greedy/em".into(), Some("step/eval".into()))),
            "{defined:?}"
        );
        assert_eq!(c.last().unwrap()["call"], "finish");
        // Finishing again is a no-op.
        assert_eq!(w.finish(Duration::from_secs(1)).unwrap(), None);
    }

    #[test]
    fn an_api_key_keeps_it_online_and_offline_stays_offline() {
        let tmp = tempfile::tempdir().unwrap();
        let (python, log) = fake(tmp.path(), "WANDB_API_KEY=k");
        let w = WandbSidecar::start(&options(python, tmp.path(), WandbMode::Online)).unwrap();
        assert_eq!(w.status().mode, "online");
        assert_eq!(w.status().reason, None);
        assert_eq!(
            w.status().url.as_deref(),
            Some("https://wandb.invalid/fake")
        );
        drop(w);
        assert_eq!(
            calls(&log).last().unwrap()["call"],
            "finish",
            "drop finishes"
        );
        let (python, _) = fake(tmp.path(), "WANDB_API_KEY=k");
        let w = WandbSidecar::start(&options(python, tmp.path(), WandbMode::Offline)).unwrap();
        assert_eq!(w.status().mode, "offline");
        assert_eq!(w.status().reason, None);
    }

    #[test]
    fn a_missing_wandb_package_is_a_clear_error() {
        let tmp = tempfile::tempdir().unwrap();
        let python = python_with(tmp.path(), "", true);
        let err = check_wandb(&python).unwrap_err().to_string();
        assert!(
            err.contains("needs the `wandb` Python package")
                && err.contains("No module named 'wandb'")
                && err.contains("pip install wandb"),
            "{err}"
        );
        let err = WandbSidecar::start(&options(python, tmp.path(), WandbMode::Offline))
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot import wandb"), "{err}");
        let err = check_wandb("/nonexistent/python3").unwrap_err().to_string();
        assert!(err.contains("cannot run it"), "{err}");
        let (python, _) = fake(tmp.path(), "");
        check_wandb(&python).unwrap();
    }

    #[test]
    fn a_sidecar_that_dies_or_hangs_never_stops_the_run() {
        let tmp = tempfile::tempdir().unwrap();
        // Dies at its third line.
        let (python, log) = fake(tmp.path(), "FAKE_WANDB_DIE_AFTER=2");
        let mut w = WandbSidecar::start(&options(python, tmp.path(), WandbMode::Offline)).unwrap();
        let t0 = std::time::Instant::now();
        for s in 1..=2000 {
            w.log(s, "train", &m(&[("r", s as f64)]));
            if s == 3 {
                // Give it the time to die.
                for _ in 0..200 {
                    if w.is_dead() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                assert!(w.is_dead());
            }
        }
        assert_eq!(w.finish(Duration::from_secs(10)).unwrap(), None);
        assert!(t0.elapsed() < Duration::from_secs(20));
        let c = calls(&log);
        assert_eq!(c.iter().filter(|x| x["call"] == "log").count(), 2);

        // Stops reading: lines are dropped, never waited for, and finishing gives up.
        let (python, _) = fake(tmp.path(), "FAKE_WANDB_HANG=1");
        let mut w = WandbSidecar::start(&options(python, tmp.path(), WandbMode::Offline)).unwrap();
        let t0 = std::time::Instant::now();
        let big: BTreeMap<String, f64> = (0..20).map(|i| (format!("metric/{i}"), 0.5)).collect();
        for s in 1..=QUEUE as u64 + 2000 {
            w.log(s, "train", &big);
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
        let err = w.finish(Duration::from_secs(1)).unwrap_err().to_string();
        assert!(err.contains("did not finish within 1 s"), "{err}");
    }
}
