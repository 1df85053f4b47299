//! [`RunDir`]: the layout of a run directory, its creation and resumption, and checkpoints.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::metrics::MetricsWriter;
use super::{RunError, RunResult};
use crate::ownership::{self, Class, Kind, MANIFEST_FILE, Owner, Plan};

/// Name of the marker file that makes a checkpoint directory complete.
pub const COMPLETE_MARKER: &str = "COMPLETE";

const CONFIG: &str = "config.toml";
const METRICS: &str = "metrics.jsonl";
const SAMPLES: &str = "samples";
const EVALS: &str = "evals";
const CHECKPOINTS: &str = "checkpoints";
const PLOTS: &str = "plots";
const REPORT: &str = "report.md";
/// The trajectory viewer's pages (`turnwise view`, [`super::view`]).
pub(super) const VIEW: &str = "view";
const TENSORBOARD: &str = "tensorboard";
/// What wandb writes under the run directory (`wandb.init(dir = <run>)`).
const WANDB: &str = "wandb";
/// The lock file: one process at a time writes a run directory.
pub const LOCK_FILE: &str = "run.lock";
/// The marker every run directory holds from its creation. Runs written since the ownership
/// manifest ([`crate::ownership`]) are replaced by their manifest; a run of an earlier
/// turnwise, with this marker and no manifest, by the names turnwise gives its files
/// ([`legacy_run_class`]).
pub const RUN_MARKER: &str = ".turnwise-run";
/// What a run writes at its top level: `--overwrite` refuses when one of these holds what the
/// run did not write (and keeps every other name). The pipeline's own names
/// (`summary.json`, `first_prompt.txt`, `warm-start-model`, `weights`) are listed here too; a
/// test checks them against the pipeline's constants.
pub const RUN_ENTRIES: &[&str] = &[
    CONFIG,
    METRICS,
    SAMPLES,
    EVALS,
    CHECKPOINTS,
    PLOTS,
    REPORT,
    VIEW,
    TENSORBOARD,
    WANDB,
    RUN_MARKER,
    "summary.json",
    "first_prompt.txt",
    "warm-start-model",
    "weights",
];
/// The prefix of the checkpoint folders `resume` sets aside when they cannot be loaded.
pub const CORRUPT_PREFIX: &str = "corrupt-step-";
/// The prefix of the warm start's checkpoint folders under `checkpoints/`
/// (`warm-start-step-00100`: after warm-start step 100).
pub const WARM_START_PREFIX: &str = "warm-start-";

/// How an earlier turnwise's run directory (it holds [`RUN_MARKER`] but no manifest) is
/// replaced: only the paths of turnwise's exact layout, with contents turnwise writes, are
/// deleted (`rel` is the path inside the run, `/`-separated). A `config.toml` with a `preset`
/// key, a `metrics.jsonl` whose every line has a `step` and a `phase`, a `report.md` that starts
/// with "# Run report", `summary.json`, `first_prompt.txt`; `checkpoints/step-N` and
/// `checkpoints/warm-start-step-N` holding [`COMPLETE_MARKER`], `corrupt-step-N` folders;
/// `samples/step-N.jsonl`, `evals/*-step-N.jsonl` (or gzipped), `plots/*.svg`,
/// `tensorboard/events.out.tfevents.*`, `view/step-N.html`; and the folders the pipeline fills
/// as a whole (`warm-start-model`, `weights`, `wandb`). Anything else inside those folders, or at
/// those names, is in the way: the overwrite refuses, naming it.
pub fn legacy_run_class(rel: &str, path: &Path, meta: &fs::Metadata) -> Class {
    let changed = |why: &str| Class::Changed(why.to_string());
    let (dir, name) = rel.rsplit_once('/').unwrap_or(("", rel));
    let file = meta.is_file();
    let folder = meta.is_dir() && !meta.is_symlink();
    match (dir, name) {
        ("", RUN_MARKER | "summary.json" | "first_prompt.txt") if file => Class::Owned,
        ("", CONFIG) if file => {
            let has_preset = fs::read_to_string(path)
                .ok()
                .and_then(|t| t.parse::<toml::Table>().ok())
                .is_some_and(|t| t.get("preset").is_some_and(|v| v.is_str()));
            if has_preset {
                Class::Owned
            } else {
                changed("not a run's config (no `preset` key)")
            }
        }
        ("", METRICS) if file => {
            let ok = fs::read_to_string(path).is_ok_and(|text| {
                text.lines().filter(|l| !l.trim().is_empty()).all(|l| {
                    serde_json::from_str::<serde_json::Value>(l).is_ok_and(|v| {
                        v.get("phase").is_some_and(|p| p.is_string())
                            && v.get("step").is_some_and(|s| s.is_u64())
                    })
                })
            });
            if ok {
                Class::Owned
            } else {
                changed("holds lines a run does not write (each has a `step` and a `phase`)")
            }
        }
        ("", REPORT) if file => {
            if fs::read_to_string(path).is_ok_and(|t| t.starts_with("# Run report")) {
                Class::Owned
            } else {
                changed("not a run's report")
            }
        }
        ("", SAMPLES | EVALS | PLOTS | TENSORBOARD | VIEW | CHECKPOINTS) if folder => {
            Class::OwnedDir
        }
        ("", "warm-start-model" | "weights" | WANDB) if folder => Class::OwnedTree,
        ("", n) if folder && n.starts_with(CORRUPT_PREFIX) => Class::OwnedTree,
        (CHECKPOINTS, n) if folder => {
            let step = n.strip_prefix(WARM_START_PREFIX).unwrap_or(n);
            let complete_step =
                parse_step(step, None).is_some() && path.join(COMPLETE_MARKER).is_file();
            if n.starts_with(CORRUPT_PREFIX) || complete_step {
                Class::OwnedTree
            } else {
                Class::Foreign
            }
        }
        (SAMPLES, n) if file && parse_jsonl_step(n).is_some() => Class::Owned,
        (EVALS, n)
            if file
                && n.find("step-")
                    .is_some_and(|i| parse_jsonl_step(&n[i..]).is_some()) =>
        {
            Class::Owned
        }
        (PLOTS, n) if file && n.ends_with(".svg") => Class::Owned,
        (TENSORBOARD, n) if file && n.starts_with("events.out.tfevents.") => Class::Owned,
        (VIEW, n) if file && parse_step(n, Some("html")).is_some() => Class::Owned,
        _ => Class::Foreign,
    }
}

/// One `checkpoints/step-N/` directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    /// The RL step it was saved at.
    pub step: u64,
    /// The directory.
    pub path: PathBuf,
    /// Whether its [`COMPLETE_MARKER`] exists (only complete checkpoints may be loaded).
    pub complete: bool,
}

/// A run directory (see the [module documentation](super) for its layout).
#[derive(Debug, Clone)]
pub struct RunDir {
    root: PathBuf,
    /// The held lock on [`LOCK_FILE`] (runs and resumes; readers hold none), released when the
    /// last clone is dropped.
    _lock: Option<std::sync::Arc<fs::File>>,
    /// The run's ownership manifest, where what this process writes is recorded (`None` for a
    /// reader, and for a run of an earlier turnwise, which has none).
    owner: Option<Owner>,
}

/// Takes the exclusive lock of the run directory `root` (creating [`LOCK_FILE`]) and writes
/// this process's id into it; another process holding it gives [`RunError::Locked`].
fn lock(root: &Path) -> RunResult<fs::File> {
    let path = root.join(LOCK_FILE);
    let mut f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(RunError::io("open the lock file", &path))?;
    match f.try_lock() {
        Ok(()) => {}
        Err(fs::TryLockError::WouldBlock) => {
            let holder = fs::read_to_string(&path)
                .ok()
                .and_then(|s| s.trim().parse::<u32>().ok())
                .map(|pid| format!(" (pid {pid})"))
                .unwrap_or_default();
            return Err(RunError::Locked {
                path: root.to_path_buf(),
                lock: path,
                holder,
            });
        }
        Err(fs::TryLockError::Error(e)) => return Err(RunError::io("lock", &path)(e)),
    }
    f.set_len(0).map_err(RunError::io("write", &path))?;
    write!(f, "{}", std::process::id()).map_err(RunError::io("write", &path))?;
    Ok(f)
}

/// `step-00042` (five digits at least, so that names sort like steps up to 99 999).
fn step_name(step: u64) -> String {
    format!("step-{step:05}")
}

/// The step of a `step-N` or `step-N.<ext>` name.
pub(super) fn parse_step(name: &str, ext: Option<&str>) -> Option<u64> {
    let rest = name.strip_prefix("step-")?;
    let digits = match ext {
        Some(ext) => rest.strip_suffix(ext)?.strip_suffix('.')?,
        None => rest,
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The step of a JSON-lines file name `step-N.jsonl` or its packed `step-N.jsonl.gz`.
pub(super) fn parse_jsonl_step(name: &str) -> Option<u64> {
    parse_step(name, Some("jsonl")).or_else(|| parse_step(name, Some("jsonl.gz")))
}

/// Flushes a directory entry (a rename or a new file) to disk; a no-op where directories cannot
/// be opened (Windows).
fn sync_dir(path: &Path) -> RunResult<()> {
    #[cfg(unix)]
    {
        fs::File::open(path)
            .and_then(|d| d.sync_all())
            .map_err(RunError::io("sync the directory", path))?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

/// `path` with `.gz` appended: where a packed run keeps a JSON-lines file gzipped (the
/// committed runs of a study, `docs/runs.md`: "Method comparison studies").
pub(crate) fn gzipped(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".gz");
    PathBuf::from(name)
}

/// The JSON lines of `path` (blank lines skipped), each parsed as a `T`, read from `path` or,
/// when only that exists, from its gzipped copy `path.gz` ([`gzipped`]); `None` when neither
/// exists. A line that does not parse is a [`RunError::BadLine`] whose message is `what`
/// followed by serde's.
pub fn read_json_lines<T: DeserializeOwned>(path: &Path, what: &str) -> RunResult<Option<Vec<T>>> {
    let (path, text) = if path.is_file() {
        let text = fs::read_to_string(path).map_err(RunError::io("read", path))?;
        (path.to_path_buf(), text)
    } else {
        let gz = gzipped(path);
        if !gz.is_file() {
            return Ok(None);
        }
        let file = fs::File::open(&gz).map_err(RunError::io("open", &gz))?;
        let mut text = String::new();
        std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(file), &mut text)
            .map_err(RunError::io("decompress", &gz))?;
        (gz, text)
    };
    let mut out = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        out.push(serde_json::from_str(line).map_err(|e| RunError::BadLine {
            path: path.clone(),
            line: i + 1,
            message: format!("{what}{e}"),
        })?);
    }
    Ok(Some(out))
}

/// Writes `items` to `path`, one JSON line each, atomically.
fn write_json_lines<T: Serialize>(path: &Path, items: &[T]) -> RunResult<()> {
    let mut buf = Vec::new();
    for item in items {
        serde_json::to_writer(&mut buf, item).map_err(|cause| RunError::Serialize {
            path: path.to_path_buf(),
            cause,
        })?;
        buf.push(b'\n');
    }
    write_atomic(path, &buf)
}

/// Deletes a checkpoint directory, its completion marker first, so that a crash midway never
/// leaves a half-deleted folder that looks complete.
fn remove_checkpoint(c: &Checkpoint) -> RunResult<()> {
    ownership::may_remove(&c.path)?;
    let marker = c.path.join(COMPLETE_MARKER);
    if c.complete {
        fs::remove_file(&marker).map_err(RunError::io("remove", &marker))?;
    }
    fs::remove_dir_all(&c.path).map_err(RunError::io("remove", &c.path))?;
    ownership::removed(&c.path)?;
    tracing::debug!(dir = %c.path.display(), "deleted an old checkpoint");
    Ok(())
}

/// Writes `bytes` to `path` through a temporary file and a rename, so that readers see either the
/// old file or the whole new one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> RunResult<()> {
    // Inside a folder turnwise owns, only what it wrote is replaced; what it writes is
    // recorded (crate::ownership).
    ownership::may_write(path)?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut f = fs::File::create(&tmp).map_err(RunError::io("create", &tmp))?;
    f.write_all(bytes).map_err(RunError::io("write", &tmp))?;
    f.sync_all().map_err(RunError::io("sync", &tmp))?;
    drop(f);
    fs::rename(&tmp, path).map_err(RunError::io("rename into place", path))?;
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        sync_dir(parent)?;
    }
    ownership::wrote(path, bytes)?;
    Ok(())
}

/// Syncs every file under `dir` to disk.
fn sync_tree(dir: &Path) -> RunResult<()> {
    for entry in fs::read_dir(dir).map_err(RunError::io("list", dir))? {
        let entry = entry.map_err(RunError::io("list", dir))?;
        let path = entry.path();
        let kind = entry.file_type().map_err(RunError::io("inspect", &path))?;
        if kind.is_dir() {
            sync_tree(&path)?;
        } else if kind.is_file() {
            fs::File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(RunError::io("sync", &path))?;
        }
    }
    sync_dir(dir)
}

/// Whether `path` holds nothing but (at most) a [`LOCK_FILE`] left by an earlier process.
fn is_empty_dir_but_lock(path: &Path) -> RunResult<bool> {
    for entry in fs::read_dir(path).map_err(RunError::io("list", path))? {
        let entry = entry.map_err(RunError::io("list", path))?;
        if entry.file_name() != LOCK_FILE {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Prepares the checkpoint folder `path` for writing ([`RunDir::begin_checkpoint`]).
fn begin_checkpoint_at(path: PathBuf) -> RunResult<PathBuf> {
    if path.join(COMPLETE_MARKER).exists() {
        return Err(RunError::CheckpointExists { path });
    }
    if path.exists() {
        ownership::may_remove(&path)?;
        tracing::warn!(dir = %path.display(), "deleting an incomplete checkpoint");
        fs::remove_dir_all(&path).map_err(RunError::io("remove", &path))?;
        ownership::removed(&path)?;
    }
    fs::create_dir_all(&path).map_err(RunError::io("create the directory", &path))?;
    // Filled by the trainer; recorded file by file once complete.
    ownership::staging(&path)?;
    Ok(path)
}

/// Marks the checkpoint folder `path` (of `step`) complete ([`RunDir::mark_complete`]).
fn mark_complete_at(path: &Path, step: u64) -> RunResult<()> {
    if !path.is_dir() {
        return Err(RunError::Io {
            cause: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "the checkpoint directory does not exist",
            ),
            path: path.to_path_buf(),
            action: "mark complete",
        });
    }
    sync_tree(path)?;
    let time = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    write_atomic(
        &path.join(COMPLETE_MARKER),
        format!("step = {step}\ntime = {time}\n").as_bytes(),
    )?;
    // The checkpoint is owned file by file from now on, and the log up to it with it.
    ownership::wrote_tree(path)?;
    if let Some(owner) = ownership::owner_of(path) {
        owner.refresh_growing()?;
    }
    Ok(())
}

impl RunDir {
    /// Creates a new run directory at `root` (and its parents), with empty `samples/`,
    /// `checkpoints/` and `plots/`, its [`RUN_MARKER`] and its ownership manifest
    /// ([`crate::ownership`]), where every file the run writes is recorded.
    ///
    /// An existing empty directory is used as it is. A non-empty one is refused with
    /// [`RunError::NotEmpty`], unless `overwrite` is set and it is a run directory: then what
    /// its manifest lists, unchanged, is deleted (a run of an earlier turnwise, with the marker
    /// and no manifest: only the paths of turnwise's layout, [`legacy_run_class`]), and nothing
    /// else; the user's own files stay, named in a warning. Anything in the way (a file the run
    /// wrote and the user edited since, a file the run did not write inside a folder it made
    /// or at a name it writes) makes it refuse, naming each, before anything is deleted. A
    /// folder with neither manifest nor marker is refused with [`RunError::NotARunDir`], so a
    /// mistyped path never deletes anything.
    ///
    /// The directory's lock ([`LOCK_FILE`]) is taken before anything in it is deleted, and held
    /// as long as the returned value (or a clone) lives: a run directory another process is
    /// writing is refused with [`RunError::Locked`].
    pub fn create(root: impl Into<PathBuf>, overwrite: bool) -> RunResult<Self> {
        let root = root.into();
        if root.exists() {
            if !root.is_dir() {
                return Err(RunError::NotADirectory { path: root });
            }
            if !is_empty_dir_but_lock(&root)? {
                if !overwrite {
                    return Err(RunError::NotEmpty { path: root });
                }
                let owner = Owner::load(&root, Kind::Run)?;
                if owner.is_none() && !root.join(RUN_MARKER).is_file() {
                    return Err(RunError::NotARunDir {
                        path: root,
                        reason: format!(
                            "it holds neither {MANIFEST_FILE} nor {RUN_MARKER}, so turnwise did \
                             not write it and nothing in it is deleted (a run of a turnwise \
                             from before the marker: delete it by hand)"
                        ),
                    });
                }
                let lock = lock(&root)?;
                tracing::warn!(dir = %root.display(), "overwriting the previous run");
                let owner = match owner {
                    Some(owner) => {
                        ownership::replace(&owner, RUN_ENTRIES, &[LOCK_FILE])?;
                        owner
                    }
                    None => {
                        Plan::with(&root, RUN_ENTRIES, &[LOCK_FILE], &legacy_run_class)?
                            .execute(&root)?;
                        Owner::start(&root, Kind::Run)?
                    }
                };
                let run = Self {
                    root,
                    _lock: Some(std::sync::Arc::new(lock)),
                    owner: Some(owner),
                };
                run.create_subdirs(true)?;
                return Ok(run);
            }
        } else {
            fs::create_dir_all(&root).map_err(RunError::io("create the directory", &root))?;
        }
        let lock = lock(&root)?;
        let owner = Owner::start(&root, Kind::Run)?;
        let run = Self {
            root,
            _lock: Some(std::sync::Arc::new(lock)),
            owner: Some(owner),
        };
        run.create_subdirs(true)?;
        Ok(run)
    }

    /// Opens an existing run directory to read it (`report`, `eval`, `runs`, `compare`),
    /// without its lock, since a run may be writing it, and without creating anything. It must
    /// hold `config.toml`.
    pub fn open(root: impl Into<PathBuf>) -> RunResult<Self> {
        Self::open_with(root.into(), false)
    }

    /// Whether a process holds the directory's lock ([`LOCK_FILE`]), i.e. a run or resume is
    /// writing it now. A missing lock file is free. The check takes a shared lock for an
    /// instant, which a run starting at that very moment would see as held.
    pub fn is_locked(&self) -> RunResult<bool> {
        let path = self.root.join(LOCK_FILE);
        let f = match fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(RunError::io("open the lock file", &path)(e)),
        };
        match f.try_lock_shared() {
            Ok(()) => Ok(false),
            Err(fs::TryLockError::WouldBlock) => Ok(true),
            Err(fs::TryLockError::Error(e)) => Err(RunError::io("test the lock", &path)(e)),
        }
    }

    /// Opens an existing run directory to resume it, taking its lock ([`RunError::Locked`] while
    /// another process holds it). It must hold `config.toml`; missing subdirectories are created.
    pub fn open_locked(root: impl Into<PathBuf>) -> RunResult<Self> {
        Self::open_with(root.into(), true)
    }

    fn open_with(root: PathBuf, locked: bool) -> RunResult<Self> {
        if !root.exists() {
            return Err(RunError::NotARunDir {
                path: root,
                reason: "it does not exist".into(),
            });
        }
        if !root.is_dir() {
            return Err(RunError::NotADirectory { path: root });
        }
        if !root.join(CONFIG).is_file() {
            return Err(RunError::NotARunDir {
                path: root,
                reason: "it has no config.toml".into(),
            });
        }
        if !locked {
            return Ok(Self {
                root,
                _lock: None,
                owner: None,
            });
        }
        // Only a folder turnwise made is written into: its manifest, or (a run of an earlier
        // turnwise) its marker, says so. Nothing is written before this check.
        let owner = Owner::load(&root, Kind::Run)?;
        if owner.is_none() && !root.join(RUN_MARKER).is_file() {
            return Err(RunError::NotARunDir {
                path: root,
                reason: format!(
                    "it holds neither {MANIFEST_FILE} nor {RUN_MARKER}, so it is not a run \
                     turnwise wrote (resume writes only into a run directory `turnwise train` \
                     created); nothing was changed"
                ),
            });
        }
        let lock = lock(&root)?;
        let run = Self {
            root,
            _lock: Some(std::sync::Arc::new(lock)),
            owner,
        };
        run.create_subdirs(false)?;
        Ok(run)
    }

    /// Makes the owned folder of a run that no process is writing this process's, so that
    /// what a reader command writes into it (`report`, `view`) is recorded in its manifest.
    /// A run being written keeps its own record (its process holds the manifest).
    pub fn adopt_manifest(&mut self) -> RunResult<()> {
        if self.owner.is_none() && !self.is_locked()? {
            self.owner = Owner::load(&self.root, Kind::Run)?;
        }
        Ok(())
    }

    /// The run's ownership manifest, when this process holds it.
    pub fn owner(&self) -> Option<&Owner> {
        self.owner.as_ref()
    }

    /// Checks that `metrics.jsonl` may be rewritten (a resume drops the lines past its
    /// checkpoint): it is the run's own log (its beginning as the manifest recorded it; in a
    /// run of an earlier turnwise, every line with a `step` and a `phase`). Refuses, naming it,
    /// otherwise.
    pub fn check_metrics_rewritable(&self) -> RunResult<()> {
        let path = self.metrics_path();
        if !path.exists() {
            return Ok(());
        }
        match &self.owner {
            Some(owner) => owner.check_removable(&path, true)?,
            None => {
                let meta = fs::symlink_metadata(&path).map_err(RunError::io("inspect", &path))?;
                if let Class::Changed(why) = legacy_run_class(METRICS, &path, &meta) {
                    return Err(crate::ownership::OwnershipError::InTheWay {
                        path: self.root.clone(),
                        action: "resume",
                        conflicts: vec![crate::ownership::Conflict { path, why }],
                    }
                    .into());
                }
            }
        }
        Ok(())
    }

    /// Creates the missing subfolders (recorded as the run's) and, for a new run (`marker`),
    /// the [`RUN_MARKER`]; a resume never writes the marker.
    fn create_subdirs(&self, marker: bool) -> RunResult<()> {
        for dir in [self.samples_dir(), self.checkpoints_dir(), self.plots_dir()] {
            if dir.is_dir() {
                continue;
            }
            fs::create_dir_all(&dir).map_err(RunError::io("create the directory", &dir))?;
            ownership::made_dir(&dir)?;
        }
        let path = self.root.join(RUN_MARKER);
        if marker && !path.is_file() {
            write_atomic(
                &path,
                b"a turnwise run directory: `turnwise train --overwrite` replaces what the run \
                  wrote here (listed in .turnwise-manifest.json), and nothing else\n",
            )?;
        }
        Ok(())
    }

    /// The entries of `checkpoints/` (none when it does not exist).
    fn checkpoint_entries(&self) -> RunResult<Vec<fs::DirEntry>> {
        let dir = self.checkpoints_dir();
        if !dir.is_dir() {
            return Ok(Vec::new());
        }
        fs::read_dir(&dir)
            .map_err(RunError::io("list", &dir))?
            .map(|e| e.map_err(RunError::io("list", &dir)))
            .collect()
    }

    /// The checkpoint folders an earlier resume set aside as unloadable
    /// (`checkpoints/corrupt-step-N…`), sorted.
    pub fn set_aside_checkpoints(&self) -> RunResult<Vec<PathBuf>> {
        let mut out = Vec::new();
        for entry in self.checkpoint_entries()? {
            if entry
                .file_name()
                .to_string_lossy()
                .starts_with(CORRUPT_PREFIX)
            {
                out.push(entry.path());
            }
        }
        out.sort();
        Ok(out)
    }

    /// Moves the unloadable checkpoint `ck` aside to `checkpoints/corrupt-step-N` (`…-2`, `…-3`
    /// when that name is taken: nothing is deleted) and returns where it went.
    pub fn set_aside(&self, ck: &Checkpoint) -> RunResult<PathBuf> {
        let base = format!("{CORRUPT_PREFIX}{:05}", ck.step);
        let mut aside = ck.path.with_file_name(&base);
        let mut n = 2;
        while aside.exists() {
            aside = ck.path.with_file_name(format!("{base}-{n}"));
            n += 1;
        }
        fs::rename(&ck.path, &aside).map_err(RunError::io("move aside", &ck.path))?;
        sync_dir(&self.checkpoints_dir())?;
        ownership::renamed(&ck.path, &aside)?;
        Ok(aside)
    }

    /// The run directory itself.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `config.toml`: the resolved configuration.
    pub fn config_path(&self) -> PathBuf {
        self.root.join(CONFIG)
    }

    /// `metrics.jsonl`.
    pub fn metrics_path(&self) -> PathBuf {
        self.root.join(METRICS)
    }

    /// `samples/`.
    pub fn samples_dir(&self) -> PathBuf {
        self.root.join(SAMPLES)
    }

    /// `samples/step-NNNNN.jsonl`: the trajectories of one step, one JSON object per line.
    pub fn samples_path(&self, step: u64) -> PathBuf {
        self.samples_dir()
            .join(format!("{}.jsonl", step_name(step)))
    }

    /// `checkpoints/`.
    pub fn checkpoints_dir(&self) -> PathBuf {
        self.root.join(CHECKPOINTS)
    }

    /// `checkpoints/step-NNNNN/`: where the checkpoint of `step` goes.
    pub fn checkpoint_path(&self, step: u64) -> PathBuf {
        self.checkpoints_dir().join(step_name(step))
    }

    /// `plots/`.
    pub fn plots_dir(&self) -> PathBuf {
        self.root.join(PLOTS)
    }

    /// `report.md`.
    pub fn report_path(&self) -> PathBuf {
        self.root.join(REPORT)
    }

    /// Writes the resolved configuration, once: writing the same text again is a no-op (a
    /// resumed run), other text is refused with [`RunError::ConfigChanged`].
    pub fn write_config(&self, text: &str) -> RunResult<()> {
        let path = self.config_path();
        if path.exists() {
            let old = fs::read_to_string(&path).map_err(RunError::io("read", &path))?;
            if old == text {
                return Ok(());
            }
            return Err(RunError::ConfigChanged { path });
        }
        write_atomic(&path, text.as_bytes())
    }

    /// Reads the resolved configuration back.
    pub fn read_config(&self) -> RunResult<String> {
        let path = self.config_path();
        fs::read_to_string(&path).map_err(RunError::io("read", &path))
    }

    /// `tensorboard/`: the TensorBoard event files of the metrics
    /// ([`MetricsWriter::attach_tensorboard`]).
    pub fn tensorboard_dir(&self) -> PathBuf {
        self.root.join(TENSORBOARD)
    }

    /// Opens `metrics.jsonl` for appending (see [`MetricsWriter::open`]).
    pub fn metrics_writer(&self) -> RunResult<MetricsWriter> {
        MetricsWriter::open(self.metrics_path())
    }

    /// Writes the samples of `step` (one JSON line per item) to [`RunDir::samples_path`],
    /// atomically; returns the path.
    pub fn write_samples<T: Serialize>(&self, step: u64, items: &[T]) -> RunResult<PathBuf> {
        let path = self.samples_path(step);
        write_json_lines(&path, items)?;
        Ok(path)
    }

    /// `evals/`.
    pub fn evals_dir(&self) -> PathBuf {
        self.root.join(EVALS)
    }

    /// `evals/<split>-<mode>-step-NNNNN.jsonl`: how each question of the evaluation of `split`
    /// with decoding `mode` (`greedy`, `sampled`) at `step` went, one JSON line per question.
    pub fn eval_path(&self, split: &str, mode: &str, step: u64) -> PathBuf {
        self.evals_dir()
            .join(format!("{split}-{mode}-{}.jsonl", step_name(step)))
    }

    /// Writes the per-question outcomes of an evaluation to [`RunDir::eval_path`], atomically;
    /// returns the path.
    pub fn write_eval<T: Serialize>(
        &self,
        split: &str,
        mode: &str,
        step: u64,
        items: &[T],
    ) -> RunResult<PathBuf> {
        let path = self.eval_path(split, mode, step);
        fs::create_dir_all(self.evals_dir())
            .map_err(RunError::io("create the directory", &self.evals_dir()))?;
        write_json_lines(&path, items)?;
        Ok(path)
    }

    /// Reads back what [`RunDir::write_eval`] wrote; `None` when that evaluation has no file (a
    /// run from before the file existed, or a split that was not evaluated).
    pub fn read_eval<T: DeserializeOwned>(
        &self,
        split: &str,
        mode: &str,
        step: u64,
    ) -> RunResult<Option<Vec<T>>> {
        read_json_lines(&self.eval_path(split, mode, step), "")
    }

    /// Deletes the sample and evaluation files of steps after `step` (a run resumed from the
    /// checkpoint of `step` writes them again); returns how many were deleted.
    pub fn remove_samples_after(&self, step: u64) -> RunResult<usize> {
        let mut removed = 0;
        for dir in [self.samples_dir(), self.evals_dir()] {
            if !dir.is_dir() {
                continue;
            }
            for entry in fs::read_dir(&dir).map_err(RunError::io("list", &dir))? {
                let path = entry.map_err(RunError::io("list", &dir))?.path();
                let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
                // `step-N.jsonl`, or an evaluation's `<split>-<mode>-step-N.jsonl` (or either gzipped).
                let name = name.find("step-").map_or(name, |i| &name[i..]);
                if parse_jsonl_step(name).is_some_and(|s| s > step) {
                    ownership::may_remove(&path)?;
                    fs::remove_file(&path).map_err(RunError::io("remove", &path))?;
                    ownership::removed(&path)?;
                    removed += 1;
                }
            }
        }
        Ok(removed)
    }

    /// Prepares `checkpoints/step-N/` for the caller to write into and returns it. A leftover
    /// incomplete directory of the same step (a save cut short) is deleted first; a complete one
    /// is refused with [`RunError::CheckpointExists`]. Call [`RunDir::mark_complete`] once every
    /// file is written.
    pub fn begin_checkpoint(&self, step: u64) -> RunResult<PathBuf> {
        begin_checkpoint_at(self.checkpoint_path(step))
    }

    /// Marks the checkpoint of `step` complete: syncs every file in it to disk, then writes the
    /// [`COMPLETE_MARKER`] through a temporary file and an atomic rename.
    pub fn mark_complete(&self, step: u64) -> RunResult<()> {
        mark_complete_at(&self.checkpoint_path(step), step)
    }

    /// `checkpoints/warm-start-step-NNNNN/`: where the warm-start checkpoint after warm-start
    /// step `step` goes.
    pub fn warm_start_checkpoint_path(&self, step: u64) -> PathBuf {
        self.checkpoints_dir()
            .join(format!("{WARM_START_PREFIX}{}", step_name(step)))
    }

    /// Every warm-start checkpoint folder, complete or not, by increasing warm-start step.
    pub fn warm_start_checkpoints(&self) -> RunResult<Vec<Checkpoint>> {
        let mut out = Vec::new();
        for entry in self.checkpoint_entries()? {
            let path = entry.path();
            let Some(step) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.strip_prefix(WARM_START_PREFIX))
                .and_then(|n| parse_step(n, None))
            else {
                continue;
            };
            if !path.is_dir() {
                continue;
            }
            let complete = path.join(COMPLETE_MARKER).is_file();
            out.push(Checkpoint {
                step,
                path,
                complete,
            });
        }
        out.sort_by_key(|c| c.step);
        Ok(out)
    }

    /// The complete warm-start checkpoint of the highest step, if any.
    pub fn latest_warm_start_checkpoint(&self) -> RunResult<Option<Checkpoint>> {
        Ok(self
            .warm_start_checkpoints()?
            .into_iter()
            .rev()
            .find(|c| c.complete))
    }

    /// [`RunDir::begin_checkpoint`] for the warm-start checkpoint after warm-start step `step`.
    pub fn begin_warm_start_checkpoint(&self, step: u64) -> RunResult<PathBuf> {
        begin_checkpoint_at(self.warm_start_checkpoint_path(step))
    }

    /// [`RunDir::mark_complete`] for the warm-start checkpoint of `step`.
    pub fn mark_warm_start_complete(&self, step: u64) -> RunResult<()> {
        mark_complete_at(&self.warm_start_checkpoint_path(step), step)
    }

    /// Deletes every warm-start checkpoint but the complete one of step `keep` (`None`: all of
    /// them, once the RL checkpoint of step 0 holds the warm-started model), each losing its
    /// marker first as in [`RunDir::prune_checkpoints`]. Returns the deleted directories.
    pub fn prune_warm_start_checkpoints(&self, keep: Option<u64>) -> RunResult<Vec<PathBuf>> {
        let mut removed = Vec::new();
        for c in self.warm_start_checkpoints()? {
            if c.complete && Some(c.step) == keep {
                continue;
            }
            remove_checkpoint(&c)?;
            removed.push(c.path);
        }
        Ok(removed)
    }

    /// Prepares a resumed run: finds the newest complete checkpoint and, if there is one, drops
    /// the metrics lines of `phases` past its step ([`MetricsWriter::truncate_phases_after`];
    /// pass e.g. `["train", "eval"]` and leave the warm-start `sft` lines alone) and the sample
    /// files past it. Returns the checkpoint to load; with none, nothing is changed.
    pub fn prepare_resume(&self, phases: &[&str]) -> RunResult<Option<Checkpoint>> {
        let Some(ck) = self.latest_checkpoint()? else {
            return Ok(None);
        };
        if self.metrics_path().exists() {
            self.check_metrics_rewritable()?;
            self.metrics_writer()?
                .truncate_phases_after(ck.step, phases)?;
        }
        self.remove_samples_after(ck.step)?;
        Ok(Some(ck))
    }

    /// Every `checkpoints/step-N/` directory, complete or not, by increasing step.
    pub fn checkpoints(&self) -> RunResult<Vec<Checkpoint>> {
        let mut out = Vec::new();
        for entry in self.checkpoint_entries()? {
            let path = entry.path();
            let Some(step) = entry.file_name().to_str().and_then(|n| parse_step(n, None)) else {
                continue;
            };
            if !path.is_dir() {
                continue;
            }
            let complete = path.join(COMPLETE_MARKER).is_file();
            out.push(Checkpoint {
                step,
                path,
                complete,
            });
        }
        out.sort_by_key(|c| c.step);
        Ok(out)
    }

    /// The complete checkpoint of the highest step, if any (incomplete ones are ignored).
    pub fn latest_checkpoint(&self) -> RunResult<Option<Checkpoint>> {
        Ok(self.checkpoints()?.into_iter().rev().find(|c| c.complete))
    }

    /// Keeps the `keep` newest complete checkpoints and deletes the older complete ones, and
    /// the incomplete ones older than the newest complete one (saves cut short). The newest
    /// complete checkpoint is never deleted (`keep` 0 counts as 1), nor any incomplete
    /// checkpoint newer than it (it may be being written). A deleted checkpoint loses its
    /// marker first, so one cut short while being deleted is never taken for complete.
    /// Returns the deleted directories.
    pub fn prune_checkpoints(&self, keep: usize) -> RunResult<Vec<PathBuf>> {
        let all = self.checkpoints()?;
        let Some(newest) = all.iter().rev().find(|c| c.complete).map(|c| c.step) else {
            return Ok(Vec::new());
        };
        let keep = keep.max(1);
        let n_complete = all.iter().filter(|c| c.complete).count();
        let mut to_drop = n_complete.saturating_sub(keep);
        let mut removed = Vec::new();
        for c in all {
            let drop = if c.complete {
                if to_drop > 0 && c.step != newest {
                    to_drop -= 1;
                    true
                } else {
                    false
                }
            } else {
                c.step < newest
            };
            if !drop {
                continue;
            }
            remove_checkpoint(&c)?;
            removed.push(c.path);
        }
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_ckpt(run: &RunDir, step: u64, complete: bool) -> PathBuf {
        let p = run.begin_checkpoint(step).unwrap();
        fs::write(p.join("model.safetensors"), b"weights").unwrap();
        fs::create_dir_all(p.join("optim")).unwrap();
        fs::write(p.join("optim/state.bin"), b"state").unwrap();
        if complete {
            run.mark_complete(step).unwrap();
        }
        p
    }

    fn steps(cs: &[Checkpoint]) -> Vec<(u64, bool)> {
        cs.iter().map(|c| (c.step, c.complete)).collect()
    }

    #[test]
    fn create_makes_the_layout() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("a/b/run");
        let run = RunDir::create(&root, false).unwrap();
        assert_eq!(run.root(), root);
        assert!(run.samples_dir().is_dir());
        assert!(run.checkpoints_dir().is_dir());
        assert!(run.plots_dir().is_dir());
        assert_eq!(run.config_path(), root.join("config.toml"));
        assert_eq!(run.metrics_path(), root.join("metrics.jsonl"));
        assert_eq!(run.report_path(), root.join("report.md"));
        assert_eq!(run.samples_path(7), root.join("samples/step-00007.jsonl"));
        assert_eq!(run.checkpoint_path(42), root.join("checkpoints/step-00042"));
        // An existing empty directory is fine.
        let empty = tmp.path().join("empty");
        fs::create_dir(&empty).unwrap();
        RunDir::create(&empty, false).unwrap();
    }

    #[test]
    fn create_refuses_a_non_empty_directory_unless_asked() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir::create(tmp.path().join("run"), false).unwrap();
        run.write_config("seed = 1\n").unwrap();
        write_ckpt(&run, 1, true);
        let err = RunDir::create(run.root(), false).unwrap_err();
        assert!(matches!(err, RunError::NotEmpty { .. }), "{err}");
        assert!(err.to_string().contains("run"), "{err}");
        // While the first holds the directory's lock, nobody replaces it.
        let err = RunDir::create(run.root(), true).unwrap_err();
        assert!(matches!(err, RunError::Locked { .. }), "{err}");
        assert!(
            err.to_string()
                .contains(&format!("pid {}", std::process::id())),
            "{err}"
        );
        assert!(run.config_path().exists());
        let root = run.root().to_path_buf();
        drop(run);
        let again = RunDir::create(&root, true).unwrap();
        assert!(!again.config_path().exists());
        assert!(again.checkpoints().unwrap().is_empty());
        assert!(again.plots_dir().is_dir());
    }

    #[test]
    fn overwrite_deletes_only_what_a_run_wrote() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir::create(tmp.path().join("run"), false).unwrap();
        run.write_config("preset = \"grpo\"\n").unwrap();
        write_ckpt(&run, 1, true);
        let aside = write_ckpt(&run, 3, true);
        let aside = run
            .set_aside(&Checkpoint {
                step: 3,
                path: aside,
                complete: true,
            })
            .unwrap();
        run.metrics_writer()
            .unwrap()
            .write(1, "train", [("r", 1.0)])
            .unwrap();
        fs::write(run.root().join("NOTES.md"), b"mine").unwrap();
        fs::create_dir(run.root().join("analysis")).unwrap();
        fs::write(run.root().join("analysis/plot.py"), b"mine too").unwrap();
        assert!(run.root().join(RUN_MARKER).is_file());
        let root = run.root().to_path_buf();
        drop(run);
        let again = RunDir::create(&root, true).unwrap();
        assert!(!again.config_path().exists());
        assert!(!again.metrics_path().exists());
        assert!(again.checkpoints().unwrap().is_empty());
        assert!(!aside.exists());
        assert_eq!(fs::read(root.join("NOTES.md")).unwrap(), b"mine");
        assert_eq!(
            fs::read(root.join("analysis/plot.py")).unwrap(),
            b"mine too"
        );
        assert!(root.join(RUN_MARKER).is_file());
    }

    #[test]
    fn overwrite_needs_a_manifest_or_an_earlier_runs_marker() {
        let tmp = tempfile::tempdir().unwrap();
        // The review's project folder: a config.toml that is not a run's.
        let proj = tmp.path().join("proj");
        fs::create_dir_all(proj.join("src")).unwrap();
        fs::write(proj.join("config.toml"), b"baseURL = \"x\"\n").unwrap();
        fs::write(proj.join("thesis.tex"), b"precious").unwrap();
        fs::write(proj.join("metrics.jsonl"), b"{}\n").unwrap();
        let err = RunDir::create(&proj, true).unwrap_err();
        assert!(matches!(err, RunError::NotARunDir { .. }), "{err}");
        assert!(err.to_string().contains(RUN_MARKER), "{err}");
        assert!(proj.join("thesis.tex").exists() && proj.join("config.toml").exists());
        // What the rule for runs written before the marker used to replace (cli-as-a-user-3
        // C2: a config.toml with `preset` beside another tool's checkpoints/) is refused, and
        // nothing is written into it.
        let old = tmp.path().join("old");
        fs::create_dir_all(old.join("checkpoints/global_step_100")).unwrap();
        fs::write(old.join("config.toml"), b"preset = \"grpo\"\nseed = 0\n").unwrap();
        let err = RunDir::create(&old, true).unwrap_err();
        assert!(matches!(err, RunError::NotARunDir { .. }), "{err}");
        assert!(old.join("checkpoints/global_step_100").is_dir());
        assert!(!old.join(LOCK_FILE).exists() && !old.join(MANIFEST_FILE).exists());
        // A run of an earlier turnwise (the marker, no manifest): turnwise's exact layout is
        // replaced, the rest kept; a foreign folder in checkpoints/ refuses the overwrite.
        let legacy = tmp.path().join("legacy");
        fs::create_dir_all(legacy.join("checkpoints/step-00002")).unwrap();
        fs::write(
            legacy.join("checkpoints/step-00002/COMPLETE"),
            b"step = 2\n",
        )
        .unwrap();
        fs::write(legacy.join(RUN_MARKER), b"x").unwrap();
        fs::write(legacy.join("config.toml"), b"preset = \"grpo\"\n").unwrap();
        fs::write(
            legacy.join("metrics.jsonl"),
            b"{\"step\":1,\"phase\":\"train\"}\n",
        )
        .unwrap();
        fs::write(legacy.join("NOTES.md"), b"mine").unwrap();
        fs::create_dir_all(legacy.join("checkpoints/global_step_100")).unwrap();
        let err = RunDir::create(&legacy, true).unwrap_err().to_string();
        assert!(err.contains("global_step_100"), "{err}");
        assert!(legacy.join("checkpoints/step-00002/COMPLETE").is_file());
        fs::remove_dir(legacy.join("checkpoints/global_step_100")).unwrap();
        let run = RunDir::create(&legacy, true).unwrap();
        assert!(!legacy.join("config.toml").exists() && !legacy.join("metrics.jsonl").exists());
        assert!(run.checkpoints().unwrap().is_empty());
        assert_eq!(fs::read(legacy.join("NOTES.md")).unwrap(), b"mine");
        assert!(legacy.join(MANIFEST_FILE).is_file() && legacy.join(RUN_MARKER).is_file());
    }

    #[test]
    fn resume_opens_only_a_run_turnwise_made_and_writes_no_marker() {
        let tmp = tempfile::tempdir().unwrap();
        let foreign = tmp.path().join("foreign");
        fs::create_dir_all(&foreign).unwrap();
        fs::write(foreign.join("config.toml"), b"preset = \"grpo\"\n").unwrap();
        let err = RunDir::open_locked(&foreign).unwrap_err();
        assert!(matches!(err, RunError::NotARunDir { .. }), "{err}");
        let names: Vec<_> = fs::read_dir(&foreign).unwrap().collect();
        assert_eq!(names.len(), 1, "{names:?}");
        // An earlier turnwise's run (marker, no manifest) resumes, and gets no manifest.
        fs::write(foreign.join(RUN_MARKER), b"x").unwrap();
        let run = RunDir::open_locked(&foreign).unwrap();
        assert!(run.owner().is_none() && !foreign.join(MANIFEST_FILE).exists());
        // Its metrics are cut only when every line is a run's.
        fs::write(run.metrics_path(), b"{\"step\":1,\"loss\":0.5}\n").unwrap();
        let err = run.check_metrics_rewritable().unwrap_err().to_string();
        assert!(err.contains("metrics.jsonl"), "{err}");
    }

    #[test]
    fn overwrite_never_deletes_a_foreign_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("home");
        fs::create_dir(&dir).unwrap();
        fs::write(dir.join("thesis.tex"), b"precious").unwrap();
        let err = RunDir::create(&dir, true).unwrap_err();
        assert!(matches!(err, RunError::NotARunDir { .. }), "{err}");
        assert!(dir.join("thesis.tex").exists());
        let file = tmp.path().join("file");
        fs::write(&file, b"x").unwrap();
        assert!(matches!(
            RunDir::create(&file, true).unwrap_err(),
            RunError::NotADirectory { .. }
        ));
    }

    #[test]
    fn open_needs_a_config() {
        let tmp = tempfile::tempdir().unwrap();
        let err = RunDir::open(tmp.path().join("missing")).unwrap_err();
        assert!(matches!(err, RunError::NotARunDir { .. }), "{err}");
        let err = RunDir::open(tmp.path()).unwrap_err();
        assert!(err.to_string().contains("config.toml"), "{err}");
        let run = RunDir::create(tmp.path().join("run"), false).unwrap();
        run.write_config("a = 1\n").unwrap();
        fs::remove_dir(run.plots_dir()).unwrap();
        // A reader opens it while the run holds it, and creates nothing.
        let reader = RunDir::open(run.root()).unwrap();
        assert!(!reader.plots_dir().exists());
        assert_eq!(reader.read_config().unwrap(), "a = 1\n");
        assert!(matches!(
            RunDir::open_locked(run.root()).unwrap_err(),
            RunError::Locked { .. }
        ));
        let root = run.root().to_path_buf();
        drop(run);
        let resumed = RunDir::open_locked(&root).unwrap();
        assert!(resumed.plots_dir().is_dir());
    }

    #[test]
    fn config_is_written_once() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir::create(tmp.path(), false).unwrap();
        run.write_config("lr = 1e-6\n").unwrap();
        run.write_config("lr = 1e-6\n").unwrap();
        let err = run.write_config("lr = 2e-6\n").unwrap_err();
        assert!(matches!(err, RunError::ConfigChanged { .. }), "{err}");
        assert_eq!(run.read_config().unwrap(), "lr = 1e-6\n");
        assert!(!tmp.path().join("config.toml.tmp").exists());
    }

    #[test]
    fn samples_are_json_lines_and_are_removed_after_a_step() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir::create(tmp.path(), false).unwrap();
        for step in 1..=4 {
            let items = vec![
                serde_json::json!({"id": format!("q{step}"), "tokens": [1, 2, 3]}),
                serde_json::json!({"id": "other"}),
            ];
            run.write_samples(step, &items).unwrap();
        }
        let text = fs::read_to_string(run.samples_path(2)).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["id"], "q2");
        fs::write(run.samples_dir().join("notes.txt"), b"keep").unwrap();
        assert_eq!(run.remove_samples_after(2).unwrap(), 2);
        assert!(run.samples_path(2).exists());
        assert!(!run.samples_path(3).exists());
        assert!(run.samples_dir().join("notes.txt").exists());
    }

    /// A packed run (its samples and evaluations gzipped, as a study's committed runs are) reads
    /// back exactly as the plain one: samples, the steps that have them, evaluations; a broken
    /// gzip file is an error naming it.
    #[test]
    fn gzipped_samples_and_evaluations_read_as_the_plain_files() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir::create(tmp.path(), false).unwrap();
        let items = |step: u64| vec![serde_json::json!({"id": format!("q{step}"), "r": 0.5})];
        for step in 1..=2 {
            run.write_samples(step, &items(step)).unwrap();
        }
        run.write_eval("test", "greedy", 2, &items(7)).unwrap();
        let pack = |path: PathBuf| {
            let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
            enc.write_all(&fs::read(&path).unwrap()).unwrap();
            fs::write(gzipped(&path), enc.finish().unwrap()).unwrap();
            fs::remove_file(&path).unwrap();
        };
        pack(run.samples_path(2));
        pack(run.eval_path("test", "greedy", 2));
        let read = |step| -> Vec<serde_json::Value> {
            read_json_lines(&run.samples_path(step), "")
                .unwrap()
                .unwrap()
        };
        assert_eq!(read(1), items(1));
        assert_eq!(read(2), items(2));
        assert_eq!(run.sample_steps().unwrap(), vec![1, 2]);
        let eval: Vec<serde_json::Value> = run.read_eval("test", "greedy", 2).unwrap().unwrap();
        assert_eq!(eval, items(7));
        fs::write(gzipped(&run.samples_path(2)), b"not gzip").unwrap();
        let err = read_json_lines::<serde_json::Value>(&run.samples_path(2), "")
            .unwrap_err()
            .to_string();
        assert!(err.contains("step-00002.jsonl.gz"), "{err}");
        // Packed by hand, the .gz files are not in the manifest: while the run holds it, they
        // are not deleted; a folder nobody holds is cleaned by name.
        assert!(run.remove_samples_after(1).is_err());
        run.write_config("a = 1\n").unwrap();
        let root = run.root().to_path_buf();
        drop(run);
        assert_eq!(
            RunDir::open(&root)
                .unwrap()
                .remove_samples_after(1)
                .unwrap(),
            2
        );
    }

    /// Evaluation files are named by split, mode and step, read back as written, and a resume
    /// drops those of later steps with the samples.
    #[test]
    fn eval_files_round_trip_and_rewind() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir::create(tmp.path(), false).unwrap();
        let none: Option<Vec<serde_json::Value>> = run.read_eval("test", "greedy", 0).unwrap();
        assert_eq!(none, None);
        for step in [0, 5] {
            let items = vec![serde_json::json!({"question_id": "test_0", "em": step as f64})];
            run.write_eval("test", "greedy", step, &items).unwrap();
            run.write_eval("validation", "sampled", step, &items)
                .unwrap();
        }
        assert!(
            run.eval_path("test", "greedy", 5)
                .ends_with("evals/test-greedy-step-00005.jsonl")
        );
        let back: Vec<serde_json::Value> = run.read_eval("test", "greedy", 5).unwrap().unwrap();
        assert_eq!(
            back,
            vec![serde_json::json!({"question_id": "test_0", "em": 5.0})]
        );
        fs::write(
            run.eval_path("test", "greedy", 0),
            b"{\"em\": 1}\nnot json\n",
        )
        .unwrap();
        let e = run
            .read_eval::<serde_json::Value>("test", "greedy", 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("test-greedy-step-00000.jsonl:2:"), "{e}");
        assert_eq!(run.remove_samples_after(2).unwrap(), 2);
        assert!(run.eval_path("validation", "sampled", 0).exists());
        assert!(!run.eval_path("validation", "sampled", 5).exists());
    }

    #[test]
    fn latest_checkpoint_is_the_newest_complete_one() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir::create(tmp.path(), false).unwrap();
        assert_eq!(run.latest_checkpoint().unwrap(), None);
        write_ckpt(&run, 5, true);
        write_ckpt(&run, 10, true);
        write_ckpt(&run, 15, false); // killed while saving
        fs::create_dir_all(run.checkpoints_dir().join("not-a-step")).unwrap();
        fs::write(run.checkpoints_dir().join("step-00020"), b"a file").unwrap();
        let all = run.checkpoints().unwrap();
        assert_eq!(steps(&all), vec![(5, true), (10, true), (15, false)]);
        let latest = run.latest_checkpoint().unwrap().unwrap();
        assert_eq!(latest.step, 10);
        assert_eq!(latest.path, run.checkpoint_path(10));
        let marker = fs::read_to_string(latest.path.join(COMPLETE_MARKER)).unwrap();
        assert!(marker.starts_with("step = 10\n"), "{marker}");
        assert!(!latest.path.join("COMPLETE.tmp").exists());
        // A wider number still parses.
        fs::create_dir_all(run.checkpoints_dir().join("step-123456")).unwrap();
        fs::write(
            run.checkpoints_dir()
                .join("step-123456")
                .join(COMPLETE_MARKER),
            b"",
        )
        .unwrap();
        assert_eq!(run.latest_checkpoint().unwrap().unwrap().step, 123_456);
    }

    #[test]
    fn begin_checkpoint_replaces_an_incomplete_one_and_refuses_a_complete_one() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir::create(tmp.path(), false).unwrap();
        let p = write_ckpt(&run, 3, false);
        fs::write(p.join("junk"), b"half").unwrap();
        let p2 = run.begin_checkpoint(3).unwrap();
        assert_eq!(p, p2);
        assert!(!p2.join("junk").exists());
        run.mark_complete(3).unwrap();
        let err = run.begin_checkpoint(3).unwrap_err();
        assert!(matches!(err, RunError::CheckpointExists { .. }), "{err}");
        let err = run.mark_complete(99).unwrap_err();
        assert!(err.to_string().contains("step-00099"), "{err}");
    }

    #[test]
    fn pruning_keeps_the_last_k_and_never_the_newest_complete() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir::create(tmp.path(), false).unwrap();
        for step in [2, 4, 6, 8] {
            write_ckpt(&run, step, true);
        }
        write_ckpt(&run, 5, false); // stale, older than the newest complete
        write_ckpt(&run, 10, false); // being written
        let removed = run.prune_checkpoints(2).unwrap();
        assert_eq!(
            removed,
            vec![
                run.checkpoint_path(2),
                run.checkpoint_path(4),
                run.checkpoint_path(5)
            ]
        );
        assert_eq!(
            steps(&run.checkpoints().unwrap()),
            vec![(6, true), (8, true), (10, false)]
        );
        // keep = 0 still keeps the newest complete one.
        run.prune_checkpoints(0).unwrap();
        assert_eq!(
            steps(&run.checkpoints().unwrap()),
            vec![(8, true), (10, false)]
        );
        assert!(run.checkpoint_path(8).join("optim/state.bin").exists());
        // Nothing complete: nothing is deleted.
        let tmp2 = tempfile::tempdir().unwrap();
        let run2 = RunDir::create(tmp2.path(), false).unwrap();
        write_ckpt(&run2, 1, false);
        assert!(run2.prune_checkpoints(1).unwrap().is_empty());
        assert_eq!(steps(&run2.checkpoints().unwrap()), vec![(1, false)]);
    }

    #[test]
    fn prepare_resume_rewinds_metrics_and_samples_to_the_checkpoint() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir::create(tmp.path(), false).unwrap();
        run.write_config("x = 1\n").unwrap();
        assert_eq!(run.prepare_resume(&["train"]).unwrap(), None);
        let mut w = run.metrics_writer().unwrap();
        w.write(500, "sft", [("sft/loss", 0.1)]).unwrap();
        for step in 1..=5 {
            w.write(step, "train", [("r", step as f64)]).unwrap();
            run.write_samples(step, &[step]).unwrap();
        }
        drop(w);
        write_ckpt(&run, 2, true);
        write_ckpt(&run, 4, false);
        let resumed = RunDir::open(run.root()).unwrap();
        let ck = resumed.prepare_resume(&["train", "eval"]).unwrap().unwrap();
        assert_eq!(ck.step, 2);
        let log = super::super::read_metrics(resumed.metrics_path()).unwrap();
        assert_eq!(log.series("r"), vec![(1, 1.0), (2, 2.0)]);
        assert_eq!(log.series("sft/loss"), vec![(500, 0.1)]);
        assert!(resumed.samples_path(2).exists() && !resumed.samples_path(3).exists());
    }

    #[test]
    fn step_names_parse() {
        assert_eq!(parse_step("step-00042", None), Some(42));
        assert_eq!(parse_step("step-7.jsonl", Some("jsonl")), Some(7));
        assert_eq!(parse_step("step-7.jsonl", None), None);
        assert_eq!(parse_step("step-", None), None);
        assert_eq!(parse_step("step-+1", None), None);
        assert_eq!(parse_step("step-1x.jsonl", Some("jsonl")), None);
        assert_eq!(step_name(3), "step-00003");
        assert_eq!(step_name(123_456), "step-123456");
    }
}
