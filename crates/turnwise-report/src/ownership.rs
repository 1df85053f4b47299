//! Ownership by manifest: turnwise deletes or replaces only what it wrote, by construction.
//!
//! Every folder a command creates for its output (a run directory, a model export, a generated
//! world) holds a manifest, [`MANIFEST_FILE`], that lists each path turnwise wrote there with
//! its kind and, for files, its length and SHA-256. The manifest is written only into a folder
//! the command created or found empty, atomically (a temporary file and a rename), and updated
//! as files are written: [`wrote`] after each file, [`wrote_growing`] for the files that grow
//! by appending (`metrics.jsonl`, TensorBoard event files), [`wrote_tree`] for a checkpoint
//! folder when its `COMPLETE` marker is written, [`staging`] for a folder being filled by a
//! writer that records nothing itself (a checkpoint being saved, the W&B sidecar's `wandb/`).
//!
//! Replacing (`--overwrite`) goes through [`Plan`]: it walks the folder and classifies every
//! path against the manifest. A file is removed only when its bytes are the ones recorded (a
//! growing file: when its first `len` bytes are); a directory only when everything in it is
//! removed. Anything else in the way (a file turnwise wrote that was edited since, a file
//! turnwise did not write inside a folder it made, or at one of the names the command is about
//! to write) makes the whole command refuse, naming each path, before anything is deleted.
//! Foreign entries that are not in the way stay where they are, named in a warning.
//!
//! The writers find the manifest of the folder they write into through a registry of the
//! [`Owner`]s alive in this process (one per folder a command holds), so that a file written
//! through the run directory's helpers is recorded without threading the owner through every
//! call. A path outside every registered folder is simply not recorded (a folder written by an
//! older turnwise, or a user's `--plots` folder).

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The manifest file at the top of every folder turnwise owns.
pub const MANIFEST_FILE: &str = ".turnwise-manifest.json";

/// The manifest's format version.
const FORMAT: u32 = 1;

/// What a folder turnwise owns holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A run directory (`train`, `quickstart`, `resume`).
    Run,
    /// A model export (`export`, `sft --out`).
    Export,
    /// A generated world (`data world`).
    World,
    /// A credit audit's report (`credit-audit --out`).
    Audit,
    /// A method comparison study (`study run`, `plan`, `run-one`, `report`): its own files;
    /// each run under it is a run directory with its own manifest.
    Study,
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Kind::Run => "run directory",
            Kind::Export => "model export",
            Kind::World => "world",
            Kind::Audit => "credit audit",
            Kind::Study => "study",
        })
    }
}

/// One path of a manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Entry {
    /// A file turnwise wrote whole: owned while it has exactly these bytes.
    File {
        /// Its length in bytes.
        len: u64,
        /// The SHA-256 of its bytes, in hex.
        sha256: String,
    },
    /// A file turnwise appends to: owned while its first `len` bytes are the ones recorded
    /// (what was appended after the last record, e.g. before a kill, is turnwise's too).
    Growing {
        /// How many bytes were recorded.
        len: u64,
        /// The SHA-256 of those bytes, in hex.
        sha256: String,
    },
    /// A folder turnwise made: removed only once everything in it is.
    Dir,
    /// A folder being filled by a writer that records nothing itself (a checkpoint being
    /// saved, `wandb/`): its contents are turnwise's as a whole.
    Staging,
}

/// The manifest file's contents.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Manifest {
    format: u32,
    kind: Kind,
    entries: BTreeMap<String, Entry>,
}

/// One path in the way of a command, and why it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    /// The path.
    pub path: PathBuf,
    /// Why it blocks the command.
    pub why: String,
}

/// Why a folder cannot be written or replaced.
#[derive(Debug, thiserror::Error)]
pub enum OwnershipError {
    /// An I/O operation failed.
    #[error("cannot {action} {}: {cause}", path.display())]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// What was being done.
        action: &'static str,
        /// The underlying error.
        cause: std::io::Error,
    },
    /// The manifest does not parse.
    #[error(
        "{} is not a turnwise manifest ({message}); nothing was changed. Move the folder's \
         contents aside by hand, or give another folder",
        path.display()
    )]
    BadManifest {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The folder holds what another command wrote.
    #[error(
        "{} holds a turnwise {found}, not a {wanted}; nothing was changed. Give another folder",
        path.display()
    )]
    WrongKind {
        /// The folder.
        path: PathBuf,
        /// What its manifest says it holds.
        found: Kind,
        /// What the command writes.
        wanted: Kind,
    },
    /// Paths turnwise did not write (or that changed since) are in the way.
    #[error(
        "refusing to {action} {}, because of {}: {}. Nothing was changed",
        path.display(),
        if conflicts.len() == 1 { "this path" } else { "these paths" },
        conflicts.iter().map(|c| format!("{} ({})", c.path.display(), c.why)).collect::<Vec<_>>().join("; ")
    )]
    InTheWay {
        /// The folder.
        path: PathBuf,
        /// What was to be done ("replace", "write into", "resume").
        action: &'static str,
        /// What blocks it.
        conflicts: Vec<Conflict>,
    },
}

impl OwnershipError {
    fn io<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> Self + 'a {
        move |cause| Self::Io {
            path: path.to_path_buf(),
            action,
            cause,
        }
    }
}

/// What a [`OwnershipError`]-returning function returns.
pub type OwnResult<T> = Result<T, OwnershipError>;

/// The hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// The hex SHA-256 of the first `len` bytes of `path`; `None` when it is shorter.
fn hash_prefix(path: &Path, len: u64) -> OwnResult<Option<String>> {
    let f = fs::File::open(path).map_err(OwnershipError::io("open", path))?;
    let mut reader = std::io::BufReader::new(f).take(len);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut n = 0u64;
    loop {
        let k = reader
            .read(&mut buf)
            .map_err(OwnershipError::io("read", path))?;
        if k == 0 {
            break;
        }
        hasher.update(&buf[..k]);
        n += k as u64;
    }
    Ok((n == len).then(|| hex(&hasher.finalize())))
}

/// The length and hex SHA-256 of the file `path`.
fn hash_file(path: &Path) -> OwnResult<(u64, String)> {
    let len = fs::metadata(path)
        .map_err(OwnershipError::io("inspect", path))?
        .len();
    let h = hash_prefix(path, len)?.ok_or_else(|| OwnershipError::Io {
        path: path.to_path_buf(),
        action: "hash",
        cause: std::io::Error::other("the file changed while it was read"),
    })?;
    Ok((len, h))
}

/// `path` relative to `root`, its components joined by `/`; `None` outside `root` (or `root`
/// itself).
fn relative(root: &Path, path: &Path) -> Option<String> {
    let rest = path.strip_prefix(root).ok()?;
    let parts: Vec<String> = rest
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    (!parts.is_empty()).then(|| parts.join("/"))
}

/// The folders turnwise holds in this process, so that writers find the manifest of the folder
/// they write into ([`wrote`]).
static REGISTRY: Mutex<Vec<Weak<Inner>>> = Mutex::new(Vec::new());

#[derive(Debug)]
struct Inner {
    root: PathBuf,
    manifest: Mutex<Manifest>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Ok(mut reg) = REGISTRY.lock() {
            reg.retain(|w| w.strong_count() > 0);
        }
    }
}

/// A folder turnwise owns, with its manifest; registered for [`wrote`] and the other recorders
/// as long as a clone lives.
#[derive(Debug, Clone)]
pub struct Owner(Arc<Inner>);

impl Owner {
    fn register(root: PathBuf, manifest: Manifest) -> Self {
        let inner = Arc::new(Inner {
            root,
            manifest: Mutex::new(manifest),
        });
        let mut reg = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
        reg.retain(|w| w.strong_count() > 0);
        reg.push(Arc::downgrade(&inner));
        Owner(inner)
    }

    /// Starts the manifest of `root`, a folder the caller created or found empty, and writes
    /// it.
    pub fn start(root: &Path, kind: Kind) -> OwnResult<Self> {
        let owner = Self::register(
            root.to_path_buf(),
            Manifest {
                format: FORMAT,
                kind,
                entries: BTreeMap::new(),
            },
        );
        owner.save()?;
        Ok(owner)
    }

    /// The manifest of `root` if it has one, checked to be of `kind`.
    pub fn load(root: &Path, kind: Kind) -> OwnResult<Option<Self>> {
        let path = root.join(MANIFEST_FILE);
        let text = match fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(OwnershipError::io("read", &path)(e)),
        };
        let manifest: Manifest =
            serde_json::from_str(&text).map_err(|e| OwnershipError::BadManifest {
                path: path.clone(),
                message: e.to_string(),
            })?;
        if manifest.format != FORMAT {
            return Err(OwnershipError::BadManifest {
                path,
                message: format!(
                    "format {} (this turnwise reads format {FORMAT})",
                    manifest.format
                ),
            });
        }
        if manifest.kind != kind {
            return Err(OwnershipError::WrongKind {
                path: root.to_path_buf(),
                found: manifest.kind,
                wanted: kind,
            });
        }
        Ok(Some(Self::register(root.to_path_buf(), manifest)))
    }

    /// The folder.
    pub fn root(&self) -> &Path {
        &self.0.root
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Manifest> {
        self.0.manifest.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Writes the manifest atomically.
    fn save(&self) -> OwnResult<()> {
        let text = serde_json::to_string_pretty(&*self.lock()).expect("a manifest serializes");
        let path = self.root().join(MANIFEST_FILE);
        let tmp = self.root().join(format!("{MANIFEST_FILE}.tmp"));
        let mut f = fs::File::create(&tmp).map_err(OwnershipError::io("create", &tmp))?;
        f.write_all(text.as_bytes())
            .and_then(|()| f.write_all(b"\n"))
            .map_err(OwnershipError::io("write", &tmp))?;
        drop(f);
        fs::rename(&tmp, &path).map_err(OwnershipError::io("rename into place", &path))
    }

    /// Records `entry` at `path` (and the folders between the root and it as [`Entry::Dir`]
    /// where they have no entry), dropping what was recorded under `path`.
    fn record(&self, path: &Path, entry: Entry) -> OwnResult<()> {
        let Some(rel) = relative(self.root(), path) else {
            return Ok(());
        };
        {
            let mut m = self.lock();
            let mut prefix = String::new();
            let parts: Vec<&str> = rel.split('/').collect();
            for part in &parts[..parts.len() - 1] {
                if !prefix.is_empty() {
                    prefix.push('/');
                }
                prefix.push_str(part);
                if matches!(m.entries.get(&prefix), Some(Entry::Staging)) {
                    // Inside a folder owned as a whole: nothing more to record.
                    return Ok(());
                }
                m.entries.entry(prefix.clone()).or_insert(Entry::Dir);
            }
            let under = format!("{rel}/");
            m.entries.retain(|k, _| !k.starts_with(&under));
            m.entries.insert(rel, entry);
        }
        self.save()
    }

    /// Records the file `path` with the bytes `bytes` it was just given (a growing file stays
    /// growing).
    pub fn note_bytes(&self, path: &Path, bytes: &[u8]) -> OwnResult<()> {
        let (len, sha256) = (bytes.len() as u64, sha256_hex(bytes));
        let growing = relative(self.root(), path).is_some_and(|rel| {
            matches!(self.lock().entries.get(&rel), Some(Entry::Growing { .. }))
        });
        self.record(
            path,
            if growing {
                Entry::Growing { len, sha256 }
            } else {
                Entry::File { len, sha256 }
            },
        )
    }

    /// Records the file `path` as it is now.
    pub fn note_file(&self, path: &Path) -> OwnResult<()> {
        let (len, sha256) = hash_file(path)?;
        self.record(path, Entry::File { len, sha256 })
    }

    /// Records the growing file `path` as it is now.
    pub fn note_growing(&self, path: &Path) -> OwnResult<()> {
        let (len, sha256) = hash_file(path)?;
        self.record(path, Entry::Growing { len, sha256 })
    }

    /// Records each growing file again as it is now, when what was recorded is still its
    /// beginning (a checkpoint is complete: the log up to it is the run's); one that no longer
    /// starts with what was recorded keeps its record, so that replacing the folder refuses it.
    pub fn refresh_growing(&self) -> OwnResult<()> {
        let growing: Vec<(String, u64, String)> = self
            .lock()
            .entries
            .iter()
            .filter_map(|(k, e)| match e {
                Entry::Growing { len, sha256 } => Some((k.clone(), *len, sha256.clone())),
                _ => None,
            })
            .collect();
        let mut changed = false;
        for (rel, len, sha256) in growing {
            let path = self.root().join(&rel);
            if !path.is_file() || hash_prefix(&path, len)?.as_deref() != Some(sha256.as_str()) {
                continue;
            }
            let (len, sha256) = hash_file(&path)?;
            self.lock()
                .entries
                .insert(rel, Entry::Growing { len, sha256 });
            changed = true;
        }
        if changed { self.save() } else { Ok(()) }
    }

    /// Records the folder `path` (made by turnwise).
    pub fn note_dir(&self, path: &Path) -> OwnResult<()> {
        let rel = relative(self.root(), path);
        if rel.is_some_and(|r| self.lock().entries.contains_key(&r)) {
            return Ok(());
        }
        self.record(path, Entry::Dir)
    }

    /// Records the folder `path` as one being filled as a whole ([`Entry::Staging`]).
    pub fn note_staging(&self, path: &Path) -> OwnResult<()> {
        self.record(path, Entry::Staging)
    }

    /// Records the folder `dir` and everything in it, file by file (a checkpoint once it is
    /// complete, an exported model).
    pub fn note_tree(&self, dir: &Path) -> OwnResult<()> {
        let mut found = Vec::new();
        collect_tree(dir, &mut found)?;
        let Some(rel) = relative(self.root(), dir) else {
            return Ok(());
        };
        {
            let mut m = self.lock();
            let under = format!("{rel}/");
            m.entries.retain(|k, _| !k.starts_with(&under));
            let mut prefix = String::new();
            for part in rel.split('/') {
                if !prefix.is_empty() {
                    prefix.push('/');
                }
                prefix.push_str(part);
                if prefix == rel {
                    m.entries.insert(prefix.clone(), Entry::Dir);
                } else {
                    m.entries.entry(prefix.clone()).or_insert(Entry::Dir);
                }
            }
            for (path, entry) in found {
                if let Some(r) = relative(self.root(), &path) {
                    m.entries.insert(r, entry);
                }
            }
        }
        self.save()
    }

    /// Forgets `path` and everything recorded under it (turnwise deleted it).
    pub fn forget(&self, path: &Path) -> OwnResult<()> {
        let Some(rel) = relative(self.root(), path) else {
            return Ok(());
        };
        {
            let mut m = self.lock();
            let under = format!("{rel}/");
            m.entries.retain(|k, _| k != &rel && !k.starts_with(&under));
        }
        self.save()
    }

    /// Moves what is recorded at `from` (and under it) to `to` (turnwise renamed it).
    pub fn rename(&self, from: &Path, to: &Path) -> OwnResult<()> {
        let (Some(a), Some(b)) = (relative(self.root(), from), relative(self.root(), to)) else {
            return Ok(());
        };
        {
            let mut m = self.lock();
            let under = format!("{a}/");
            let moved: Vec<(String, Entry)> = m
                .entries
                .iter()
                .filter(|(k, _)| **k == a || k.starts_with(&under))
                .map(|(k, v)| (format!("{b}{}", &k[a.len()..]), v.clone()))
                .collect();
            m.entries.retain(|k, _| k != &a && !k.starts_with(&under));
            m.entries.extend(moved);
        }
        self.save()
    }

    /// Forgets everything (after a [`Plan`] removed it).
    fn clear(&self) -> OwnResult<()> {
        self.lock().entries.clear();
        self.save()
    }

    /// How the manifest classifies `rel` (the path `path`, whose metadata is `meta`), hashing
    /// files when `deep`.
    fn classify(&self, rel: &str, path: &Path, meta: &fs::Metadata, deep: bool) -> Class {
        let entry = self.lock().entries.get(rel).cloned();
        match entry {
            None if self.is_own_temporary(rel) && meta.is_file() => Class::Owned,
            None => Class::Foreign,
            Some(Entry::File { len, sha256 }) => {
                if !meta.is_file() || meta.len() != len {
                    return Class::Changed(
                        "changed since turnwise wrote it: move or delete it by hand".into(),
                    );
                }
                if !deep {
                    return Class::Owned;
                }
                match hash_prefix(path, len) {
                    Ok(Some(h)) if h == sha256 => Class::Owned,
                    Ok(_) => Class::Changed(
                        "changed since turnwise wrote it: move or delete it by hand".into(),
                    ),
                    Err(e) => Class::Changed(e.to_string()),
                }
            }
            Some(Entry::Growing { len, sha256 }) => {
                if !meta.is_file() || meta.len() < len {
                    return Class::Changed(
                        "changed since turnwise wrote it: move or delete it by hand".into(),
                    );
                }
                if !deep {
                    return Class::Owned;
                }
                match hash_prefix(path, len) {
                    Ok(Some(h)) if h == sha256 => Class::Owned,
                    Ok(_) => Class::Changed(
                        "changed since turnwise wrote it: move or delete it by hand".into(),
                    ),
                    Err(e) => Class::Changed(e.to_string()),
                }
            }
            Some(Entry::Dir) if meta.is_dir() => Class::OwnedDir,
            Some(Entry::Staging) if meta.is_dir() => Class::OwnedTree,
            Some(_) => Class::Changed("not the folder turnwise made".into()),
        }
    }

    /// Whether `rel` is the temporary file of an atomic write turnwise made and did not finish
    /// (killed between writing and renaming): `X.tmp` beside a recorded `X`, or inside a
    /// folder turnwise made.
    fn is_own_temporary(&self, rel: &str) -> bool {
        let Some(stem) = rel.strip_suffix(".tmp") else {
            return false;
        };
        let m = self.lock();
        m.entries.contains_key(stem)
            || rel
                .rsplit_once('/')
                .is_some_and(|(parent, _)| matches!(m.entries.get(parent), Some(Entry::Dir)))
    }

    /// Checks that `path` (a file or a folder) is owned and, with `deep`, unchanged, so that
    /// it may be deleted; the error names what is not.
    pub fn check_removable(&self, path: &Path, deep: bool) -> OwnResult<()> {
        let Some(rel) = relative(self.root(), path) else {
            return Err(OwnershipError::InTheWay {
                path: path.to_path_buf(),
                action: "delete",
                conflicts: vec![Conflict {
                    path: path.to_path_buf(),
                    why: format!("outside {}", self.root().display()),
                }],
            });
        };
        let meta = match fs::symlink_metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(OwnershipError::io("inspect", path)(e)),
        };
        let mut plan = Plan::default();
        let class = self.classify(&rel, path, &meta, deep);
        plan.visit(path, &rel, class, true, &|r, p, m| {
            self.classify(r, p, m, deep)
        })?;
        if plan.conflicts.is_empty() {
            Ok(())
        } else {
            Err(OwnershipError::InTheWay {
                path: path.to_path_buf(),
                action: "delete",
                conflicts: plan.conflicts,
            })
        }
    }

    /// Deletes `path` (a file or a folder) if it is owned ([`Owner::check_removable`], by name
    /// and length, without hashing) and forgets it.
    pub fn remove(&self, path: &Path) -> OwnResult<()> {
        self.check_removable(path, false)?;
        remove_path(path)?;
        self.forget(path)
    }

    /// Whether `path` may be written: it does not exist, or it is recorded and unchanged (a
    /// growing file: it still starts with what was recorded), or it lies in a folder owned as
    /// a whole.
    pub fn check_writable(&self, path: &Path) -> OwnResult<()> {
        let Some(rel) = relative(self.root(), path) else {
            return Ok(());
        };
        let meta = match fs::symlink_metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(OwnershipError::io("inspect", path)(e)),
        };
        {
            let m = self.lock();
            let mut prefix = String::new();
            for part in rel.split('/') {
                if !prefix.is_empty() {
                    prefix.push('/');
                }
                prefix.push_str(part);
                if matches!(m.entries.get(&prefix), Some(Entry::Staging)) {
                    return Ok(());
                }
            }
        }
        let why = match self.classify(&rel, path, &meta, true) {
            Class::Owned | Class::OwnedDir => return Ok(()),
            Class::Changed(why) => why,
            _ => "it exists and turnwise did not write it: move or delete it by hand".into(),
        };
        Err(OwnershipError::InTheWay {
            path: self.root().to_path_buf(),
            action: "write into",
            conflicts: vec![Conflict {
                path: path.to_path_buf(),
                why,
            }],
        })
    }
}

/// Every file (with its entry) and folder under `dir`.
fn collect_tree(dir: &Path, out: &mut Vec<(PathBuf, Entry)>) -> OwnResult<()> {
    for e in fs::read_dir(dir).map_err(OwnershipError::io("list", dir))? {
        let e = e.map_err(OwnershipError::io("list", dir))?;
        let path = e.path();
        let meta = fs::symlink_metadata(&path).map_err(OwnershipError::io("inspect", &path))?;
        if meta.is_dir() {
            out.push((path.clone(), Entry::Dir));
            collect_tree(&path, out)?;
        } else if meta.is_file() {
            let (len, sha256) = hash_file(&path)?;
            out.push((path, Entry::File { len, sha256 }));
        }
    }
    Ok(())
}

/// Deletes a file, or a folder with its contents (a symlink is removed, not followed).
fn remove_path(path: &Path) -> OwnResult<()> {
    let meta = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(OwnershipError::io("inspect", path)(e)),
    };
    if meta.is_dir() {
        fs::remove_dir_all(path)
    } else {
        fs::remove_file(path)
    }
    .map_err(OwnershipError::io("remove", path))
}

/// How a path of a folder is treated when the folder is replaced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Class {
    /// A file turnwise wrote, unchanged: deleted.
    Owned,
    /// A folder turnwise made: its contents are classified, and it is deleted once empty.
    OwnedDir,
    /// A folder turnwise filled as a whole: deleted with its contents.
    OwnedTree,
    /// A path turnwise wrote that is not as it left it: blocks the command.
    Changed(String),
    /// A path turnwise did not write: kept, or blocks the command when it is in the way.
    Foreign,
}

/// What replacing a folder deletes, keeps and trips over ([`Plan::of_manifest`],
/// [`Plan::with`]).
#[derive(Debug, Default)]
pub struct Plan {
    files: Vec<PathBuf>,
    trees: Vec<PathBuf>,
    /// Owned folders, each after the ones inside it.
    dirs: Vec<PathBuf>,
    /// Top-level names turnwise did not write and that are not in the way.
    pub kept: Vec<String>,
    /// What blocks the command.
    pub conflicts: Vec<Conflict>,
}

/// The entries of `dir`, sorted by name.
fn sorted_entries(dir: &Path) -> OwnResult<Vec<(String, PathBuf, fs::Metadata)>> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).map_err(OwnershipError::io("list", dir))? {
        let e = e.map_err(OwnershipError::io("list", dir))?;
        let path = e.path();
        let meta = fs::symlink_metadata(&path).map_err(OwnershipError::io("inspect", &path))?;
        out.push((e.file_name().to_string_lossy().into_owned(), path, meta));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

type Classifier<'a> = dyn Fn(&str, &Path, &fs::Metadata) -> Class + 'a;

impl Plan {
    /// The plan of replacing `root` by the classification `classify` (of each path relative to
    /// `root`, `/`-separated): `in_the_way` are the top-level names the command writes, which a
    /// foreign entry may not hold; `skip` are top-level names left alone (the manifest, a lock
    /// file).
    pub fn with(
        root: &Path,
        in_the_way: &[&str],
        skip: &[&str],
        classify: &Classifier<'_>,
    ) -> OwnResult<Self> {
        let mut plan = Plan::default();
        for (name, path, meta) in sorted_entries(root)? {
            if name == MANIFEST_FILE
                || name == format!("{MANIFEST_FILE}.tmp")
                || skip.contains(&name.as_str())
            {
                continue;
            }
            let class = classify(&name, &path, &meta);
            if class == Class::Foreign && !in_the_way.contains(&name.as_str()) {
                plan.kept.push(name);
                continue;
            }
            plan.visit(&path, &name, class, true, classify)?;
        }
        Ok(plan)
    }

    /// The plan of replacing the folder of `owner` by its manifest, hashing every file.
    pub fn of_manifest(owner: &Owner, in_the_way: &[&str], skip: &[&str]) -> OwnResult<Self> {
        Self::with(owner.root(), in_the_way, skip, &|rel, path, meta| {
            owner.classify(rel, path, meta, true)
        })
    }

    fn visit(
        &mut self,
        path: &Path,
        rel: &str,
        class: Class,
        in_the_way: bool,
        classify: &Classifier<'_>,
    ) -> OwnResult<()> {
        match class {
            Class::Owned => self.files.push(path.to_path_buf()),
            Class::OwnedTree => self.trees.push(path.to_path_buf()),
            Class::OwnedDir => {
                for (name, child, meta) in sorted_entries(path)? {
                    let child_rel = format!("{rel}/{name}");
                    let class = classify(&child_rel, &child, &meta);
                    self.visit(&child, &child_rel, class, true, classify)?;
                }
                self.dirs.push(path.to_path_buf());
            }
            Class::Changed(why) => self.conflicts.push(Conflict {
                path: path.to_path_buf(),
                why,
            }),
            Class::Foreign if in_the_way => self.conflicts.push(Conflict {
                path: path.to_path_buf(),
                why: "turnwise did not write it: move or delete it by hand".into(),
            }),
            Class::Foreign => {}
        }
        Ok(())
    }

    /// Refuses (naming every conflict) unless nothing is in the way.
    pub fn check(&self, root: &Path) -> OwnResult<()> {
        if self.conflicts.is_empty() {
            return Ok(());
        }
        Err(OwnershipError::InTheWay {
            path: root.to_path_buf(),
            action: "replace",
            conflicts: self.conflicts.clone(),
        })
    }

    /// Deletes what the plan owns (files, whole folders, then the emptied folders, innermost
    /// first); refuses first when anything is in the way. Folders that are not empty after all
    /// (written meanwhile) are left, with a warning.
    pub fn execute(&self, root: &Path) -> OwnResult<()> {
        self.check(root)?;
        for p in &self.files {
            remove_path(p)?;
        }
        for p in &self.trees {
            remove_path(p)?;
        }
        for p in &self.dirs {
            if let Err(e) = fs::remove_dir(p)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(dir = %p.display(), "left in place ({e})");
            }
        }
        if !self.kept.is_empty() {
            tracing::warn!(
                dir = %root.display(),
                "kept what turnwise did not write: {}",
                self.kept.join(", ")
            );
        }
        Ok(())
    }
}

/// Replaces the owned folder of `owner`: deletes what its manifest lists, unchanged, and
/// nothing else, then empties the manifest; refuses, changing nothing, when anything is in the
/// way (see [`Plan`]).
pub fn replace(owner: &Owner, in_the_way: &[&str], skip: &[&str]) -> OwnResult<()> {
    let plan = Plan::of_manifest(owner, in_the_way, skip)?;
    plan.execute(owner.root())?;
    owner.clear()
}

/// The registered owner of the folder that holds `path` (the innermost one).
pub fn owner_of(path: &Path) -> Option<Owner> {
    let reg = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
    reg.iter()
        .filter_map(Weak::upgrade)
        .filter(|o| path.starts_with(&o.root) && path != o.root)
        .max_by_key(|o| o.root.components().count())
        .map(Owner)
}

/// `f` on the registered owner of the folder that holds `path`; `Ok` (nothing to record or
/// check) outside every owned folder.
fn in_owner(path: &Path, f: impl FnOnce(&Owner) -> OwnResult<()>) -> OwnResult<()> {
    owner_of(path).map_or(Ok(()), |o| f(&o))
}

/// Records that turnwise wrote `bytes` to `path` (no-op outside every owned folder).
pub fn wrote(path: &Path, bytes: &[u8]) -> OwnResult<()> {
    in_owner(path, |o| o.note_bytes(path, bytes))
}

/// Records the file `path` as it is now (no-op outside every owned folder).
pub fn wrote_file(path: &Path) -> OwnResult<()> {
    in_owner(path, |o| o.note_file(path))
}

/// Records the growing file `path` as it is now (no-op outside every owned folder).
pub fn wrote_growing(path: &Path) -> OwnResult<()> {
    in_owner(path, |o| o.note_growing(path))
}

/// Records the folder `dir` and everything in it (no-op outside every owned folder).
pub fn wrote_tree(dir: &Path) -> OwnResult<()> {
    in_owner(dir, |o| o.note_tree(dir))
}

/// Records the folder `dir` turnwise made (no-op outside every owned folder).
pub fn made_dir(dir: &Path) -> OwnResult<()> {
    in_owner(dir, |o| o.note_dir(dir))
}

/// Records `dir` as a folder being filled as a whole (no-op outside every owned folder).
pub fn staging(dir: &Path) -> OwnResult<()> {
    in_owner(dir, |o| o.note_staging(dir))
}

/// Checks that `path` may be written ([`Owner::check_writable`]; anything may be written
/// outside every owned folder).
pub fn may_write(path: &Path) -> OwnResult<()> {
    in_owner(path, |o| o.check_writable(path))
}

/// Checks that `path` may be deleted ([`Owner::check_removable`], by name and length), then
/// after the caller deleted it, [`removed`] forgets it. Outside every owned folder this is
/// `Ok` (a folder of an older turnwise, whose callers check names).
pub fn may_remove(path: &Path) -> OwnResult<()> {
    in_owner(path, |o| o.check_removable(path, false))
}

/// Forgets `path` after turnwise deleted it.
pub fn removed(path: &Path) -> OwnResult<()> {
    in_owner(path, |o| o.forget(path))
}

/// Moves the record of `from` to `to` after turnwise renamed it.
pub fn renamed(from: &Path, to: &Path) -> OwnResult<()> {
    in_owner(from, |o| o.rename(from, to))
}

/// Whether `dir` holds nothing but the names in `ignore`.
pub fn is_empty_but(dir: &Path, ignore: &[&str]) -> OwnResult<bool> {
    for e in fs::read_dir(dir).map_err(OwnershipError::io("list", dir))? {
        let e = e.map_err(OwnershipError::io("list", dir))?;
        if !ignore.contains(&e.file_name().to_string_lossy().as_ref()) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The entries of `names` that exist in `dir` (as anything, a dangling symlink included).
pub fn existing(dir: &Path, names: &[&str]) -> Vec<PathBuf> {
    names
        .iter()
        .map(|n| dir.join(n))
        .filter(|p| fs::symlink_metadata(p).is_ok())
        .collect()
}

/// Prepares `out` for a command that writes the top-level `names` there (a model export, a
/// world) and returns its owner, or `None` when it writes into a folder it may not own (a
/// non-empty one without a manifest, holding none of `names`, where `foreign_ok`).
///
/// - absent or empty: created, with a new manifest of `kind`;
/// - non-empty with a manifest of `kind`: without `overwrite`, refused when any of `names`
///   exists; with it, what the manifest lists is deleted ([`replace`], refused when anything
///   is in the way) once `clear_now` — else [`Prepared::clear`] does it later;
/// - non-empty without a manifest: refused, except (`foreign_ok`) when none of `names` exists.
///
/// `not_empty` is the message for a non-empty folder without `--overwrite`.
pub fn prepare(
    out: &Path,
    kind: Kind,
    names: &[&str],
    overwrite: bool,
    foreign_ok: bool,
) -> OwnResult<Prepared> {
    let refuse = |conflicts: Vec<PathBuf>, why: &str| OwnershipError::InTheWay {
        path: out.to_path_buf(),
        action: "write into",
        conflicts: conflicts
            .into_iter()
            .map(|path| Conflict {
                path,
                why: why.to_string(),
            })
            .collect(),
    };
    if !out.exists() || (out.is_dir() && is_empty_but(out, &[])?) {
        return Ok(Prepared {
            out: out.to_path_buf(),
            kind,
            owner: None,
            fresh: true,
            names: names.iter().map(|s| s.to_string()).collect(),
        });
    }
    if !out.is_dir() {
        return Err(OwnershipError::Io {
            path: out.to_path_buf(),
            action: "write into",
            cause: std::io::Error::other("it exists and is not a folder"),
        });
    }
    let there = existing(out, names);
    match Owner::load(out, kind)? {
        Some(owner) => {
            if !there.is_empty() {
                if !overwrite {
                    return Err(refuse(
                        there,
                        "written by turnwise; pass --overwrite to replace it",
                    ));
                }
                Plan::of_manifest(&owner, names, &[])?.check(out)?;
            }
            Ok(Prepared {
                out: out.to_path_buf(),
                kind,
                owner: Some(owner),
                fresh: false,
                names: names.iter().map(|s| s.to_string()).collect(),
            })
        }
        None => {
            if foreign_ok && there.is_empty() {
                return Ok(Prepared {
                    out: out.to_path_buf(),
                    kind,
                    owner: None,
                    fresh: false,
                    names: names.iter().map(|s| s.to_string()).collect(),
                });
            }
            if !overwrite && !foreign_ok {
                return Err(refuse(
                    vec![out.to_path_buf()],
                    "not empty (pass --overwrite to replace a turnwise output there)",
                ));
            }
            let mut conflicts = if foreign_ok { there } else { Vec::new() };
            if conflicts.is_empty() {
                conflicts.push(out.to_path_buf());
            }
            Err(refuse(
                conflicts,
                &format!(
                    "the folder holds no {MANIFEST_FILE}, so turnwise did not write it: move or \
                     delete it by hand{}",
                    if overwrite {
                        ""
                    } else {
                        " (--overwrite replaces only what turnwise wrote)"
                    }
                ),
            ))
        }
    }
}

/// A folder [`prepare`]d for a command's output.
#[derive(Debug)]
pub struct Prepared {
    out: PathBuf,
    kind: Kind,
    owner: Option<Owner>,
    fresh: bool,
    names: Vec<String>,
}

impl Prepared {
    /// Creates the folder when it is new and deletes the earlier output when it is replaced
    /// (checking again that nothing is in the way: the folder may have changed since
    /// [`prepare`]); returns the owner the command's writes are recorded in (`None` in a
    /// foreign folder).
    pub fn clear(self) -> OwnResult<Option<Owner>> {
        if self.fresh {
            fs::create_dir_all(&self.out).map_err(OwnershipError::io("create", &self.out))?;
            if !is_empty_but(&self.out, &[])? {
                // Someone wrote into it meanwhile: prepare again.
                return prepare(&self.out, self.kind, &self.names_ref(), false, false)?.clear();
            }
            return Ok(Some(Owner::start(&self.out, self.kind)?));
        }
        if let Some(owner) = &self.owner {
            let names = self.names_ref();
            if !existing(&self.out, &names).is_empty() {
                replace(owner, &names, &[])?;
            }
        }
        Ok(self.owner)
    }

    fn names_ref(&self) -> Vec<&str> {
        self.names.iter().map(String::as_str).collect()
    }
}

/// The top-level names in `dir` now (none when it does not exist), to tell afterwards what a
/// writer that records nothing itself added ([`note_new_outputs`]).
pub fn top_level_names(dir: &Path) -> std::collections::BTreeSet<String> {
    fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Records what a command wrote at the top of its owned folder: `names`, and every other
/// top-level entry that was not there before (`before`, from [`top_level_names`]).
pub fn note_new_outputs(
    owner: &Owner,
    names: &[&str],
    before: &std::collections::BTreeSet<String>,
) -> OwnResult<()> {
    let mut all: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    for n in top_level_names(owner.root()) {
        if !before.contains(&n) && n != MANIFEST_FILE && !all.contains(&n) {
            all.push(n);
        }
    }
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    note_outputs(owner, &all)
}

/// Records what a command wrote at the top-level `names` of its owned folder: each file, and
/// each folder with everything in it.
pub fn note_outputs(owner: &Owner, names: &[&str]) -> OwnResult<()> {
    for path in existing(owner.root(), names) {
        let meta = fs::symlink_metadata(&path).map_err(OwnershipError::io("inspect", &path))?;
        if meta.is_dir() {
            owner.note_tree(&path)?;
        } else if meta.is_file() {
            owner.note_file(&path)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owned_folder(root: &Path) -> Owner {
        fs::create_dir_all(root).unwrap();
        let o = Owner::start(root, Kind::Run).unwrap();
        fs::create_dir_all(root.join("checkpoints/step-00001/optim")).unwrap();
        fs::write(root.join("checkpoints/step-00001/model.bin"), b"w").unwrap();
        fs::write(root.join("checkpoints/step-00001/optim/s.bin"), b"s").unwrap();
        o.note_tree(&root.join("checkpoints/step-00001")).unwrap();
        fs::write(root.join("report.md"), b"# Run report").unwrap();
        o.note_bytes(&root.join("report.md"), b"# Run report")
            .unwrap();
        fs::write(root.join("metrics.jsonl"), b"{\"a\":1}\n").unwrap();
        o.note_growing(&root.join("metrics.jsonl")).unwrap();
        o
    }

    #[test]
    fn replace_deletes_what_is_owned_and_unchanged_only() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("r");
        let o = owned_folder(&root);
        // Appended after the record: still turnwise's.
        fs::OpenOptions::new()
            .append(true)
            .open(root.join("metrics.jsonl"))
            .unwrap()
            .write_all(b"{\"a\":2}\n")
            .unwrap();
        fs::write(root.join("NOTES.md"), b"mine").unwrap();
        replace(&o, &["report.md", "metrics.jsonl", "checkpoints"], &[]).unwrap();
        assert!(!root.join("checkpoints").exists());
        assert!(!root.join("report.md").exists() && !root.join("metrics.jsonl").exists());
        assert_eq!(fs::read(root.join("NOTES.md")).unwrap(), b"mine");
        let again = Owner::load(&root, Kind::Run).unwrap().unwrap();
        assert!(again.lock().entries.is_empty());
    }

    #[test]
    fn anything_in_the_way_refuses_before_anything_is_deleted() {
        let tmp = tempfile::tempdir().unwrap();
        // A foreign file inside an owned folder, an edited file, a foreign file at a name the
        // command writes, an edited growing file, a folder where a file was.
        type Spoil = fn(&Path);
        let cases: [(&str, Spoil); 5] = [
            ("checkpoints/step-00001/extra.txt", |r| {
                fs::write(r.join("checkpoints/step-00001/extra.txt"), b"x").unwrap()
            }),
            ("report.md", |r| {
                fs::write(r.join("report.md"), b"# Run reporT").unwrap()
            }),
            ("summary.json", |r| {
                fs::write(r.join("summary.json"), b"{}").unwrap()
            }),
            ("metrics.jsonl", |r| {
                fs::write(r.join("metrics.jsonl"), b"{\"b\":1}\n{\"a\":2}\n").unwrap()
            }),
            ("checkpoints/step-00001/model.bin", |r| {
                fs::remove_file(r.join("checkpoints/step-00001/model.bin")).unwrap();
                fs::create_dir(r.join("checkpoints/step-00001/model.bin")).unwrap();
            }),
        ];
        for (i, (name, spoil)) in cases.iter().enumerate() {
            let root = tmp.path().join(format!("r{i}"));
            let o = owned_folder(&root);
            spoil(&root);
            let err = replace(
                &o,
                &["report.md", "metrics.jsonl", "checkpoints", "summary.json"],
                &[],
            )
            .unwrap_err()
            .to_string();
            assert!(err.contains(name), "{name}: {err}");
            assert!(root.join("checkpoints/step-00001/optim/s.bin").is_file());
            assert!(root.join("report.md").is_file());
        }
    }

    #[test]
    fn records_follow_renames_removals_and_staging() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("r");
        let o = owned_folder(&root);
        let ck = root.join("checkpoints/step-00001");
        let aside = root.join("checkpoints/corrupt-step-00001");
        fs::rename(&ck, &aside).unwrap();
        renamed(&ck, &aside).unwrap();
        assert!(
            o.lock()
                .entries
                .contains_key("checkpoints/corrupt-step-00001/optim/s.bin")
        );
        let staged = root.join("checkpoints/step-00002");
        fs::create_dir_all(staged.join("deep")).unwrap();
        staging(&staged).unwrap();
        fs::write(staged.join("deep/x"), b"x").unwrap();
        may_write(&staged.join("deep/x")).unwrap();
        let foreign = root.join("checkpoints/other");
        fs::write(&foreign, b"mine").unwrap();
        assert!(may_write(&foreign).is_err());
        assert!(may_remove(&foreign).is_err());
        may_remove(&staged).unwrap();
        o.remove(&staged).unwrap();
        assert!(!staged.exists());
        // A folder holding a foreign file is not removed.
        let err = o.remove(&root.join("checkpoints")).unwrap_err().to_string();
        assert!(err.contains("checkpoints/other"), "{err}");
        assert_eq!(fs::read(&foreign).unwrap(), b"mine");
    }

    #[test]
    fn prepare_refuses_foreign_folders_and_targets() {
        let tmp = tempfile::tempdir().unwrap();
        let names = ["train.jsonl", "corpus.jsonl"];
        // A foreign folder holding a target: refused with or without --overwrite.
        let d = tmp.path().join("d");
        fs::create_dir(&d).unwrap();
        fs::write(d.join("train.jsonl"), b"mine").unwrap();
        for ow in [false, true] {
            let err = prepare(&d, Kind::World, &names, ow, true)
                .unwrap_err()
                .to_string();
            assert!(err.contains("train.jsonl"), "{err}");
        }
        // A foreign folder without targets: written into, without a manifest.
        let e = tmp.path().join("e");
        fs::create_dir(&e).unwrap();
        fs::write(e.join("other.txt"), b"mine").unwrap();
        let p = prepare(&e, Kind::World, &names, false, true).unwrap();
        assert!(p.clear().unwrap().is_none());
        assert!(!e.join(MANIFEST_FILE).exists());
        // A new folder: created with a manifest; its outputs are then replaced only with
        // --overwrite.
        let f = tmp.path().join("f");
        let o = prepare(&f, Kind::World, &names, false, true)
            .unwrap()
            .clear()
            .unwrap()
            .unwrap();
        fs::write(f.join("train.jsonl"), b"world").unwrap();
        note_outputs(&o, &names).unwrap();
        drop(o);
        assert!(prepare(&f, Kind::World, &names, false, true).is_err());
        let o = prepare(&f, Kind::World, &names, true, true)
            .unwrap()
            .clear()
            .unwrap()
            .unwrap();
        assert!(!f.join("train.jsonl").exists());
        drop(o);
        // Another kind's folder is refused.
        let err = prepare(&f, Kind::Export, &names, true, false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("world"), "{err}");
    }
}
