//! Running a study: one run in this process ([`run_one`]), every run as child processes of
//! this binary, several at once ([`run_study`]), or as shell commands for a cluster scheduler
//! ([`plan`]). Each run is an ordinary run directory: a finished one (its `summary.json`) is
//! skipped, an unfinished one resumed, so a killed study picks up where it stopped.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::{RunId, Study};
use crate::pipeline::RunOptions;

/// The environment variable a study's child process reads its parent's process id from: the
/// child stops when that parent is gone (a killed `study run`), so that no orphan keeps
/// writing a run the next `study run` resumes.
pub const PARENT_ENV: &str = "TURNWISE_STUDY_PARENT";

/// What [`run_one`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunOutcome {
    /// The run had finished before; nothing was done.
    AlreadyFinished,
    /// The run was started from its beginning and finished.
    Ran,
    /// An unfinished run was resumed and finished.
    Resumed,
}

/// Runs `run` of the study (validated, its directory `out` prepared) in this process: skipped
/// when finished, resumed when started, else started. An arm needs its warm start finished.
pub fn run_one(study: &Study, out: &Path, run: &RunId, quiet: bool) -> Result<RunOutcome> {
    if let Ok(parent) = std::env::var(PARENT_ENV)
        && let Ok(parent) = parent.parse::<u32>()
    {
        watch_parent(parent);
    }
    let dir = run.dir(out);
    if run.finished(out) {
        if !quiet {
            println!("{} is finished ({})", run.label(), dir.display());
        }
        return Ok(RunOutcome::AlreadyFinished);
    }
    if let Some(dep) = study.dependency(run) {
        let ws = dep.dir(out);
        if !dep.finished(out) {
            bail!(
                "{} needs the run {}, which has not finished ({} has no summary.json): run \
                 `turnwise study run-one {} --out {} --run {}` first",
                run.label(),
                dep.label(),
                ws.display(),
                study.path.display(),
                out.display(),
                dep.label()
            );
        }
    }
    if let RunId::Audit(name) = run {
        let a = study
            .audit(name)
            .expect("a run of the study names its audit");
        let read = study
            .dependency(run)
            .expect("an audit reads a run")
            .dir(out);
        let request = a.request();
        let source = crate::checkpoints::EvalSource {
            run: Some(&read),
            checkpoint: None,
            preset: None,
            config: None,
            sets: &[],
        };
        // An audit killed before its report was written left at most its manifest: redone.
        let (report, _) = crate::audit::audit_into(&source, &request, &dir, true)
            .with_context(|| format!("running {}", run.label()))?;
        if !quiet {
            println!(
                "{}: {} turns audited, realised decision density {:.2} ({})",
                run.label(),
                report.turns,
                report.realised_density,
                dir.display()
            );
        }
        return Ok(RunOutcome::Ran);
    }
    if dir.join("config.toml").is_file() {
        crate::pipeline::resume(&dir, quiet)
            .with_context(|| format!("resuming {}", run.label()))?;
        return Ok(RunOutcome::Resumed);
    }
    let cfg = study.config_of(run, out)?;
    // A folder left by a run killed before its config was written holds at most its marker.
    let overwrite = dir.exists();
    crate::pipeline::run(
        cfg,
        &RunOptions {
            dir: dir.clone(),
            quiet,
        },
        overwrite,
    )
    .with_context(|| format!("running {}", run.label()))?;
    Ok(RunOutcome::Ran)
}

/// Exits this process (status 143) once its parent `parent` is gone.
fn watch_parent(parent: u32) {
    #[cfg(unix)]
    std::thread::spawn(move || {
        loop {
            if std::os::unix::process::parent_id() != parent {
                eprintln!(
                    "the study process {parent} is gone; stopping this run (resume it with `turnwise study run`)"
                );
                std::process::exit(143);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    #[cfg(not(unix))]
    let _ = parent;
}

/// Single-quotes `s` for a POSIX shell when it holds anything but safe characters.
fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:+@%,".contains(&b))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// The shell command that runs `run` ([`run_one`] through `turnwise study run-one`).
pub fn command_line(exe: &Path, study: &Study, out: &Path, run: &RunId) -> String {
    format!(
        "{} study run-one {} --out {} --run {}",
        shell_quote(&exe.to_string_lossy()),
        shell_quote(&study.path.to_string_lossy()),
        shell_quote(&out.to_string_lossy()),
        shell_quote(&run.label())
    )
}

/// Which runs [`plan`] prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Every run, in two commented stages.
    All,
    /// The warm starts only (the first stage), one command a line.
    Warm,
    /// The arm × seed runs only (the second stage), one command a line.
    Runs,
    /// The audits only (the third stage), one command a line.
    Audits,
}

/// The commands of a study, one a line, for a scheduler over a shared directory: the warm
/// starts (stage 1) must finish before the runs (stage 2) start. With [`Stage::All`] each stage
/// is headed by a `#` comment; a single stage prints commands only (for `parallel`, or
/// `sed -n "${SLURM_ARRAY_TASK_ID}p"`). Each command skips a finished run and resumes an
/// unfinished one.
pub fn plan(exe: &Path, study: &Study, out: &Path, stage: Stage) -> String {
    let runs = study.runs();
    let warm: Vec<&RunId> = runs
        .iter()
        .filter(|r| matches!(r, RunId::Warm(_)))
        .collect();
    let arms: Vec<&RunId> = runs
        .iter()
        .filter(|r| matches!(r, RunId::Arm(..)))
        .collect();
    let audits: Vec<&RunId> = runs
        .iter()
        .filter(|r| matches!(r, RunId::Audit(_)))
        .collect();
    let mut s = String::new();
    if stage == Stage::All {
        let _ = writeln!(
            s,
            "# study {:?}: {}, then {} ({} arms x {} seeds); a finished run is skipped, an \
             unfinished one resumed",
            study.file.name,
            crate::pipeline::count(warm.len() as u64, "warm start", "warm starts"),
            crate::pipeline::count(arms.len() as u64, "run", "runs"),
            study.file.arms.len(),
            study.file.seeds.len()
        );
        let _ = writeln!(
            s,
            "# stage 1 (warm starts): every stage-2 run needs its warm start finished"
        );
    }
    if matches!(stage, Stage::All | Stage::Warm) {
        for r in &warm {
            let _ = writeln!(s, "{}", command_line(exe, study, out, r));
        }
    }
    if stage == Stage::All {
        let _ = writeln!(s, "# stage 2 (arm x seed runs), after stage 1");
    }
    if matches!(stage, Stage::All | Stage::Runs) {
        for r in &arms {
            let _ = writeln!(s, "{}", command_line(exe, study, out, r));
        }
    }
    if stage == Stage::All && !audits.is_empty() {
        let _ = writeln!(
            s,
            "# stage 3 (replay audits of finished runs), after the runs they read"
        );
    }
    if matches!(stage, Stage::All | Stage::Audits) {
        for r in &audits {
            let _ = writeln!(s, "{}", command_line(exe, study, out, r));
        }
    }
    s
}

/// How `study run` ran.
#[derive(Debug, Clone)]
pub struct StudyRunOptions {
    /// Runs at once.
    pub jobs: usize,
    /// Cores to share between them (each child gets `cores / jobs` matmul threads).
    pub cores: usize,
    /// The binary to spawn.
    pub exe: PathBuf,
    /// Fewer progress lines.
    pub quiet: bool,
}

/// A run's state in the scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Waiting,
    Running,
    Done,
    Failed(String),
}

/// Runs every run of the study not finished yet as a child process of `opts.exe`
/// (`study run-one`), `opts.jobs` at once, warm starts before the arms that need them, each
/// logging to `logs/<run>.log` (appended). Prints a line as each run starts and ends (k of n,
/// elapsed time). A failed run is reported with its log and the others go on (the arms of a
/// failed warm start are not started); the error at the end names every failure.
pub fn run_study(study: &Study, out: &Path, opts: &StudyRunOptions) -> Result<()> {
    let runs = study.runs();
    let total = runs.len();
    let jobs = opts.jobs.max(1);
    let threads = (opts.cores / jobs).max(1);
    let t0 = Instant::now();
    std::fs::create_dir_all(out.join("logs"))
        .with_context(|| format!("creating {}", out.join("logs").display()))?;
    let states: Vec<State> = runs
        .iter()
        .map(|r| {
            if r.finished(out) {
                State::Done
            } else {
                State::Waiting
            }
        })
        .collect();
    let already = states.iter().filter(|s| **s == State::Done).count();
    println!(
        "study {:?}: {total} runs ({already} finished already), {jobs} at once with {threads} \
         thread{} each, in {}",
        study.file.name,
        if threads == 1 { "" } else { "s" },
        out.display()
    );
    let shared = Mutex::new((states, already));
    let wake = Condvar::new();
    let elapsed = |t: Instant| {
        let s = t.elapsed().as_secs();
        format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
    };
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| {
                loop {
                    // Pick the first waiting run whose warm start is done; fail those whose
                    // warm start failed; stop when nothing is waiting.
                    let picked = pick_run(study, &runs, &shared, &wake);
                    let Some(i) = picked else { return };
                    let run = &runs[i];
                    let log = run.log(out);
                    if !opts.quiet {
                        println!(
                            "start {} (log {}) [{} elapsed]",
                            run.label(),
                            log.display(),
                            elapsed(t0)
                        );
                    }
                    let t = Instant::now();
                    let result = spawn_run(study, out, run, &log, threads, &opts.exe);
                    let mut g = shared.lock().unwrap_or_else(|e| e.into_inner());
                    g.1 += 1;
                    let k = g.1;
                    match result {
                        Ok(()) => {
                            g.0[i] = State::Done;
                            println!(
                                "[{k}/{total}] {} finished in {:.0} s [{} elapsed]",
                                run.label(),
                                t.elapsed().as_secs_f64(),
                                elapsed(t0)
                            );
                        }
                        Err(e) => {
                            let why = format!("{e:#}; log: {}", log.display());
                            println!("[{k}/{total}] {} FAILED: {why}", run.label());
                            g.0[i] = State::Failed(why);
                        }
                    }
                    wake.notify_all();
                }
            });
        }
    });
    let (states, _) = shared.into_inner().unwrap_or_else(|e| e.into_inner());
    report_end(study, &runs, &states, &elapsed(t0))
}

/// Prints how the study's runs ended (`took`: the study's elapsed time) and fails naming every
/// failed run.
fn report_end(study: &Study, runs: &[RunId], states: &[State], took: &str) -> Result<()> {
    let total = runs.len();
    let failed: Vec<String> = runs
        .iter()
        .zip(states)
        .filter_map(|(r, s)| match s {
            State::Failed(why) => Some(format!("{} ({why})", r.label())),
            _ => None,
        })
        .collect();
    let done = states.iter().filter(|s| **s == State::Done).count();
    println!(
        "study {:?}: {done} of {total} runs finished, {} failed, in {}",
        study.file.name,
        failed.len(),
        took
    );
    if !failed.is_empty() {
        bail!(
            "{} of {total} runs failed: {}",
            failed.len(),
            failed.join("; ")
        );
    }
    Ok(())
}

/// Picks the first waiting run whose warm start is done, marking it running; fails those whose
/// warm start failed; waits while runs are running; `None` when nothing is waiting.
fn pick_run(
    study: &Study,
    runs: &[RunId],
    shared: &Mutex<(Vec<State>, usize)>,
    wake: &Condvar,
) -> Option<usize> {
    let total = runs.len();
    let index_of = |r: &RunId| runs.iter().position(|x| x == r);
    let mut g = shared.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let mut pick = None;
        let mut waiting = false;
        for (i, run) in runs.iter().enumerate() {
            if g.0[i] != State::Waiting {
                continue;
            }
            let dep = study.dependency(run).and_then(|d| index_of(&d));
            match dep.map(|d| g.0[d].clone()) {
                Some(State::Failed(_)) => {
                    let why = format!(
                        "not started: the run it needs, {}, failed",
                        study.dependency(run).map(|d| d.label()).unwrap_or_default()
                    );
                    g.0[i] = State::Failed(why.clone());
                    g.1 += 1;
                    println!("[{}/{total}] {} {why}", g.1, run.label());
                }
                None | Some(State::Done) => {
                    pick = Some(i);
                    break;
                }
                _ => waiting = true,
            }
        }
        if let Some(i) = pick {
            g.0[i] = State::Running;
            return Some(i);
        }
        if !waiting {
            wake.notify_all();
            return None;
        }
        g = wake.wait(g).unwrap_or_else(|e| e.into_inner());
    }
}

/// Runs `run` as `exe study run-one …` with `threads` matmul threads, its output appended to
/// `log`; `Err` names the exit status.
fn spawn_run(
    study: &Study,
    out: &Path,
    run: &RunId,
    log: &Path,
    threads: usize,
    exe: &Path,
) -> Result<()> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening the log {}", log.display()))?;
    let err = file
        .try_clone()
        .with_context(|| format!("opening the log {}", log.display()))?;
    let status = std::process::Command::new(exe)
        .args(["study", "run-one"])
        .arg(&study.path)
        .arg("--out")
        .arg(out)
        .arg("--run")
        .arg(run.label())
        .env("RAYON_NUM_THREADS", threads.to_string())
        .env(PARENT_ENV, std::process::id().to_string())
        .stdin(std::process::Stdio::null())
        .stdout(file)
        .stderr(err)
        .status()
        .with_context(|| format!("starting {}", exe.display()))?;
    if !status.success() {
        bail!("exited with {status}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_quoting() {
        assert_eq!(shell_quote("/a/b-c_d.toml"), "/a/b-c_d.toml");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote(""), "''");
    }

    #[test]
    fn run_labels_round_trip() {
        for r in [RunId::Warm("boxed".into()), RunId::Arm("st-ppo".into(), 2)] {
            assert_eq!(RunId::parse(&r.label()), Some(r));
        }
        assert_eq!(RunId::parse("grpo"), None);
        assert_eq!(RunId::parse("grpo/seed-x"), None);
    }
}
