//! Question files and corpora in Parquet and in Hugging Face `datasets` folders.
//!
//! [`super::read_qa_split`] and [`super::read_corpus`] come here for
//! - a **Parquet file** (a name ending in `.parquet`), as pandas, pyarrow, polars or
//!   `datasets` write it (snappy, zstd, gzip or lz4 compressed, or not at all);
//! - an **Arrow IPC file** (a name ending in `.arrow`, stream or file format), such as one shard
//!   of a `datasets` folder;
//! - a **`datasets` folder** (a directory): what `Dataset.save_to_disk` writes (`state.json`,
//!   `dataset_info.json` and `data-0000k-of-0000N.arrow` shards, Arrow IPC streams, read in the
//!   order `state.json` lists them), or what `DatasetDict.save_to_disk` writes
//!   (`dataset_dict.json` and one such folder per split). A `DatasetDict` is read at the split
//!   the caller asks for (`train`; `validation`, also found as `val`, `valid` or `dev`; `test`),
//!   or at its only split when it has one; otherwise the path must name a split's folder.
//!
//! Each row becomes a JSON object (strings, numbers, booleans, lists and structs; `null` for
//! nulls) and is then read exactly as a line of a JSON-lines file ([`super::read_qa_from`]):
//! Search-R1's / verl's preprocessed layout (`data_source`, `prompt`, `ability`,
//! `reward_model.ground_truth`, `extra_info`) and the raw layout (`id`, `question`,
//! `golden_answers`) both work, and a Parquet file reads as the JSON lines of its rows would.
//! Columns of other types (timestamps, binary, decimals ...) are left out of the questions'
//! metadata with a warning; a question, answer or id column of such a type is an error.
//!
//! Errors name the file (the shard, in a folder), the 0-based row (as `dataset[row]` and
//! `df.iloc[row]` count) and the column.

use std::fs::File;
use std::io::{BufReader, Read, Seek};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float16Type, Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type,
    UInt16Type, UInt32Type, UInt64Type,
};
use arrow_array::{Array, RecordBatch, RecordBatchReader};
use arrow_ipc::reader::{FileReader, StreamReader};
use arrow_schema::{DataType, SchemaRef};
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use serde_json::{Map, Value};

use super::{CorpusError, QaExample, RowError};
use crate::search::Document;

/// The columns whose values become a question's text, answers or id: one of an unsupported
/// type is an error rather than left out.
const QA_COLUMNS: &[&str] = &[
    "id",
    "question",
    "golden_answers",
    "answers",
    "answer",
    "prompt",
    "reward_model",
    "extra_info",
];

/// The names a `DatasetDict` split is looked up by (`validation` is often saved as `val` or
/// `dev`).
fn split_names(split: &str) -> Vec<&str> {
    match split {
        "validation" | "val" | "valid" | "dev" => vec!["validation", "val", "valid", "dev"],
        other => vec![other],
    }
}

/// Whether `path` is read by this module rather than as JSON lines: a directory, or a file
/// whose name ends in `.parquet` or `.arrow`.
pub fn is_tabular(path: &Path) -> bool {
    path.is_dir()
        || path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| e.eq_ignore_ascii_case("parquet") || e.eq_ignore_ascii_case("arrow"))
}

/// The record batches of one file, with the schema they share.
struct Part {
    file: PathBuf,
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
}

fn table_err(path: &Path, message: impl Into<String>) -> CorpusError {
    CorpusError::Table {
        path: path.to_path_buf(),
        row: None,
        column: None,
        message: message.into(),
    }
}

fn column_err(path: &Path, column: &str, message: impl Into<String>) -> CorpusError {
    CorpusError::Table {
        path: path.to_path_buf(),
        row: None,
        column: Some(column.to_string()),
        message: message.into(),
    }
}

/// Reads questions from a Parquet file, an Arrow file or a `datasets` folder; `split` picks a
/// `DatasetDict`'s split (see the module doc). Rows are read as JSON-lines QA lines are.
pub fn read_qa(path: &Path, split: Option<&str>) -> Result<Vec<QaExample>, CorpusError> {
    let (parts, stem) = read_parts(path, split, None)?;
    let mut out = Vec::new();
    let mut rows: std::collections::HashMap<String, (usize, usize)> = Default::default();
    for (part_no, part) in parts.iter().enumerate() {
        let schema = &part.schema;
        let mut keep = Vec::new();
        for (i, field) in schema.fields().iter().enumerate() {
            if supported(field.data_type()) {
                keep.push(i);
            } else if QA_COLUMNS.contains(&field.name().as_str()) {
                return Err(column_err(
                    &part.file,
                    field.name(),
                    format!(
                        "type {} is not supported (expected strings, numbers, booleans, lists \
                         and structs of them)",
                        field.data_type()
                    ),
                ));
            } else {
                tracing::warn!(
                    "{}: column {} (type {}) is left out of the questions' metadata",
                    part.file.display(),
                    field.name(),
                    field.data_type()
                );
            }
        }
        check_qa_columns(&part.file, schema)?;
        let mut row = 0;
        for batch in &part.batches {
            for r in 0..batch.num_rows() {
                let mut obj = Map::new();
                for &i in &keep {
                    obj.insert(
                        schema.field(i).name().clone(),
                        json_value(batch.column(i), r),
                    );
                }
                let n = out.len();
                let ex = super::qa_from_fields(obj, &stem, n).map_err(|e| CorpusError::Table {
                    path: part.file.clone(),
                    row: Some(row),
                    message: with_column_type(&e, schema),
                    column: Some(e.column),
                })?;
                if let Some((p, r)) = rows.insert(ex.id.clone(), (part_no, row)) {
                    let first = if p == part_no {
                        format!("row {r}")
                    } else {
                        format!("row {r} of {}", parts[p].file.display())
                    };
                    return Err(CorpusError::Table {
                        path: part.file.clone(),
                        row: Some(row),
                        column: Some("id".into()),
                        message: super::duplicate_id(&ex.id, &first),
                    });
                }
                out.push(ex);
                row += 1;
            }
        }
    }
    Ok(out)
}

/// `e`'s message, with the column's Arrow type when a value of a top-level column has the
/// wrong type.
fn with_column_type(e: &RowError, schema: &SchemaRef) -> String {
    match schema.field_with_name(&e.column) {
        Ok(f) if e.wrong_type => format!("{} (the column's type is {})", e.message, f.data_type()),
        _ => e.message.clone(),
    }
}

/// Fails, naming the columns there are, when no column can give the question or the answers.
fn check_qa_columns(file: &Path, schema: &SchemaRef) -> Result<(), CorpusError> {
    let has = |name: &str| schema.field_with_name(name).is_ok();
    let has_child = |name: &str, child: &str| {
        matches!(schema.field_with_name(name).map(|f| f.data_type()),
            Ok(DataType::Struct(fields)) if fields.iter().any(|f| f.name() == child))
    };
    let names = || {
        schema
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if !has("question") && !has_child("extra_info", "question") && !has("prompt") {
        return Err(column_err(
            file,
            "question",
            format!(
                "no column gives the question: expected `question`, `extra_info.question` or \
                 `prompt` (the columns are: {})",
                names()
            ),
        ));
    }
    if !["golden_answers", "answers", "answer"]
        .iter()
        .any(|c| has(c))
        && !has_child("reward_model", "ground_truth")
    {
        return Err(column_err(
            file,
            "golden_answers",
            format!(
                "no column gives the answers: expected `golden_answers` (or `answers`, \
                 `answer`) or `reward_model.ground_truth` (the columns are: {})",
                names()
            ),
        ));
    }
    Ok(())
}

/// Reads a corpus of `{id, contents}` rows (or `id`, `title` and `text`, joined as
/// [`super::join_contents`] does) from a Parquet file, an Arrow file or a `datasets` folder.
/// `id` may be a string or an integer.
pub fn read_corpus(path: &Path) -> Result<Vec<Document>, CorpusError> {
    let wanted = ["id", "contents", "title", "text"];
    let (parts, _) = read_parts(path, None, Some(&wanted))?;
    let mut docs = Vec::new();
    for part in &parts {
        let has = |n: &str| part.schema.field_with_name(n).is_ok();
        if !has("id") {
            return Err(column_err(&part.file, "id", "missing"));
        }
        let joined = has("title") && has("text");
        if !has("contents") && !joined {
            return Err(column_err(
                &part.file,
                "contents",
                "missing (a corpus has `id` and `contents`, or `id`, `title` and `text`)",
            ));
        }
        let mut first_row = 0;
        for batch in &part.batches {
            let col = |n: &str| batch.column_by_name(n);
            let string_at = |name: &str, r: usize| -> Result<String, CorpusError> {
                let col = col(name).expect("checked above");
                let err = |message: String| CorpusError::Table {
                    path: part.file.clone(),
                    row: Some(first_row + r),
                    column: Some(name.to_string()),
                    message,
                };
                if !supported(col.data_type()) {
                    return Err(err(format!(
                        "type {} is not supported (expected strings)",
                        col.data_type()
                    )));
                }
                match json_value(col, r) {
                    Value::String(s) => Ok(s),
                    Value::Number(n) if name == "id" => Ok(n.to_string()),
                    other => Err(err(format!(
                        "must be a string{}, found {other}",
                        if name == "id" { " or an integer" } else { "" }
                    ))),
                }
            };
            for r in 0..batch.num_rows() {
                let id = string_at("id", r)?;
                let contents = if has("contents") {
                    string_at("contents", r)?
                } else {
                    super::join_contents(&string_at("title", r)?, &string_at("text", r)?)
                };
                docs.push(Document { id, contents });
            }
            first_row += batch.num_rows();
        }
    }
    Ok(docs)
}

/// The files behind `path` read into record batches (only the `columns` that exist, when
/// given), and the name that default ids start with (the file stem, or the folder's name).
fn read_parts(
    path: &Path,
    split: Option<&str>,
    columns: Option<&[&str]>,
) -> Result<(Vec<Part>, String), CorpusError> {
    if path.is_dir() {
        let dir = dataset_folder(path, split)?;
        let stem = dir
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "qa".to_string());
        let parts = shard_files(&dir)?
            .iter()
            .map(|f| read_arrow(f, columns))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(first) = parts.first()
            && let Some(other) = parts
                .iter()
                .find(|p| p.schema.fields() != first.schema.fields())
        {
            return Err(table_err(
                &other.file,
                format!(
                    "its columns differ from those of {} (shards of one dataset share a schema)",
                    first.file.display()
                ),
            ));
        }
        return Ok((parts, stem));
    }
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "qa".to_string());
    let is_parquet = path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("parquet"));
    let part = if is_parquet {
        read_parquet(path, columns)?
    } else {
        read_arrow(path, columns)?
    };
    Ok((vec![part], stem))
}

/// The `Dataset` folder `path` stands for: `path` itself when it holds `state.json`, or the
/// split of the `DatasetDict` at `path` that `split` names.
fn dataset_folder(path: &Path, split: Option<&str>) -> Result<PathBuf, CorpusError> {
    let dict_file = path.join("dataset_dict.json");
    if !dict_file.is_file() {
        if path.join("state.json").is_file() {
            return Ok(path.to_path_buf());
        }
        return Err(table_err(
            path,
            "a directory, but not a Hugging Face `datasets` folder (it has neither \
             dataset_dict.json nor state.json, which Dataset.save_to_disk and \
             DatasetDict.save_to_disk write); name a .parquet or .jsonl file, or such a folder",
        ));
    }
    let text = std::fs::read_to_string(&dict_file).map_err(|e| CorpusError::io(&dict_file, e))?;
    #[derive(serde::Deserialize)]
    struct DictFile {
        splits: Vec<String>,
    }
    let dict: DictFile = serde_json::from_str(&text).map_err(|e| {
        table_err(
            &dict_file,
            format!("not a DatasetDict's dataset_dict.json ({{\"splits\": [...]}}): {e}"),
        )
    })?;
    let chosen = match split {
        Some(want) => {
            let names = split_names(want);
            names
                .iter()
                .find(|n| dict.splits.iter().any(|s| s == *n))
                .map(|n| n.to_string())
                .ok_or_else(|| {
                    table_err(
                        path,
                        format!(
                            "a DatasetDict with the splits [{}] and no {want} split (looked for \
                             {}); point the path at one split's folder, e.g. {}",
                            dict.splits.join(", "),
                            names.join(", "),
                            path.join(dict.splits.first().map_or("SPLIT", |s| s.as_str()))
                                .display()
                        ),
                    )
                })?
        }
        None => match dict.splits.as_slice() {
            [only] => only.clone(),
            _ => {
                return Err(table_err(
                    path,
                    format!(
                        "a DatasetDict with the splits [{}]: point the path at one split's \
                         folder, e.g. {}",
                        dict.splits.join(", "),
                        path.join(dict.splits.first().map_or("SPLIT", |s| s.as_str()))
                            .display()
                    ),
                ));
            }
        },
    };
    let dir = path.join(&chosen);
    if !dir.join("state.json").is_file() {
        return Err(table_err(
            &dir,
            format!(
                "the DatasetDict's split {chosen:?} has no folder with a state.json (was the \
                 folder copied in part?)"
            ),
        ));
    }
    Ok(dir)
}

/// The Arrow shards of the `Dataset` folder `dir`, in the order its `state.json` lists them
/// (`_data_files`), or every `*.arrow` file by name when it lists none.
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>, CorpusError> {
    let state_file = dir.join("state.json");
    let text = std::fs::read_to_string(&state_file).map_err(|e| CorpusError::io(&state_file, e))?;
    let state: Value = serde_json::from_str(&text)
        .map_err(|e| table_err(&state_file, format!("not JSON: {e}")))?;
    let listed = match state.get("_data_files") {
        Some(Value::Array(files)) => files
            .iter()
            .map(|f| match f.get("filename") {
                Some(Value::String(name)) => Ok(dir.join(name)),
                _ => Err(table_err(
                    &state_file,
                    format!("_data_files entries are {{\"filename\": ...}}, found {f}"),
                )),
            })
            .collect::<Result<Vec<_>, _>>()?,
        _ => Vec::new(),
    };
    let files = if listed.is_empty() {
        let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| CorpusError::io(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "arrow"))
            .collect();
        found.sort();
        found
    } else {
        listed
    };
    if files.is_empty() {
        return Err(table_err(dir, "a `datasets` folder without .arrow files"));
    }
    Ok(files)
}

/// Indices of the `columns` (those that exist) among `schema`'s fields; all when `None`.
fn projection(schema: &SchemaRef, columns: Option<&[&str]>) -> Option<Vec<usize>> {
    columns.map(|cols| {
        (0..schema.fields().len())
            .filter(|&i| cols.contains(&schema.field(i).name().as_str()))
            .collect()
    })
}

/// Reads a Parquet file. A corrupt footer that the `parquet` crate would panic on (a column
/// chunk with a negative offset or size: `ColumnChunkMetaData::byte_range` asserts) or read
/// without end (a row group with a negative row count) is refused first, and any other panic inside the reader becomes an error naming the file, so a damaged
/// file never aborts a run (found by the `qa_parquet` fuzz target).
fn read_parquet(path: &Path, columns: Option<&[&str]>) -> Result<Part, CorpusError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        read_parquet_unguarded(path, columns)
    }))
    .unwrap_or_else(|panic| {
        let why = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Err(table_err(
            path,
            format!("not a readable Parquet file: the reader failed on it ({why})"),
        ))
    })
}

fn read_parquet_unguarded(path: &Path, columns: Option<&[&str]>) -> Result<Part, CorpusError> {
    let file = File::open(path).map_err(|e| CorpusError::io(path, e))?;
    let builder = ParquetRecordBatchReaderBuilder::try_new(file)
        .map_err(|e| table_err(path, format!("not a readable Parquet file: {e}")))?;
    for (r, group) in builder.metadata().row_groups().iter().enumerate() {
        // A negative row count reads as an endless run of batches (24 GB before the OOM
        // killer, in the fuzzer), not as an error.
        if group.num_rows() < 0 {
            return Err(table_err(
                path,
                format!(
                    "not a readable Parquet file: row group {r} has a negative row count ({}) in \
                     the footer",
                    group.num_rows()
                ),
            ));
        }
        for column in group.columns() {
            let start = column
                .dictionary_page_offset()
                .unwrap_or(column.data_page_offset());
            if start < 0 || column.compressed_size() < 0 {
                return Err(table_err(
                    path,
                    format!(
                        "not a readable Parquet file: row group {r}, column {}: negative offset \
                         {start} or size {} in the footer",
                        column.column_path(),
                        column.compressed_size()
                    ),
                ));
            }
        }
    }
    let builder = match projection(builder.schema(), columns) {
        Some(idx) => {
            let mask = ProjectionMask::roots(builder.parquet_schema(), idx);
            builder.with_projection(mask)
        }
        None => builder,
    };
    let reader = builder
        .build()
        .map_err(|e| table_err(path, format!("cannot read the Parquet file: {e}")))?;
    let schema = reader.schema();
    let batches = reader
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| table_err(path, format!("cannot read the Parquet file: {e}")))?;
    Ok(Part {
        file: path.to_path_buf(),
        schema,
        batches,
    })
}

/// Reads an Arrow IPC file: the stream format (`datasets` shards) or the file format
/// (`ARROW1` magic), told apart by the first bytes.
fn read_arrow(path: &Path, columns: Option<&[&str]>) -> Result<Part, CorpusError> {
    let io = |e| CorpusError::io(path, e);
    let mut file = File::open(path).map_err(io)?;
    let mut magic = Vec::new();
    (&mut file).take(6).read_to_end(&mut magic).map_err(io)?;
    if magic.is_empty() {
        return Err(table_err(
            path,
            "an empty file (an Arrow IPC stream starts with its schema)",
        ));
    }
    file.rewind().map_err(io)?;
    let bad = |e: arrow_schema::ArrowError| {
        table_err(
            path,
            format!("not a readable Arrow IPC stream or file: {e}"),
        )
    };
    let reader: Box<dyn RecordBatchReader> = if magic == b"ARROW1" {
        Box::new(FileReader::try_new(BufReader::new(file), None).map_err(bad)?)
    } else {
        Box::new(StreamReader::try_new(BufReader::new(file), None).map_err(bad)?)
    };
    let mut schema = reader.schema();
    let mut batches = reader.collect::<Result<Vec<_>, _>>().map_err(bad)?;
    if let Some(idx) = projection(&schema, columns) {
        schema = Arc::new(schema.project(&idx).map_err(bad)?);
        batches = batches
            .iter()
            .map(|b| b.project(&idx))
            .collect::<Result<_, _>>()
            .map_err(bad)?;
    }
    Ok(Part {
        file: path.to_path_buf(),
        schema,
        batches,
    })
}

/// Whether [`json_value`] converts values of `dt`.
fn supported(dt: &DataType) -> bool {
    match dt {
        DataType::Null
        | DataType::Boolean
        | DataType::Int8
        | DataType::Int16
        | DataType::Int32
        | DataType::Int64
        | DataType::UInt8
        | DataType::UInt16
        | DataType::UInt32
        | DataType::UInt64
        | DataType::Float16
        | DataType::Float32
        | DataType::Float64
        | DataType::Utf8
        | DataType::LargeUtf8
        | DataType::Utf8View => true,
        DataType::List(f) | DataType::LargeList(f) | DataType::FixedSizeList(f, _) => {
            supported(f.data_type())
        }
        DataType::Struct(fields) => fields.iter().all(|f| supported(f.data_type())),
        DataType::Dictionary(_, v) => supported(v),
        _ => false,
    }
}

fn number<T: Into<serde_json::Number>>(v: T) -> Value {
    Value::Number(v.into())
}

fn float(v: f64) -> Value {
    serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number)
}

/// The value at `row` of `array` as JSON (a type that [`supported`] accepts; others are `null`).
fn json_value(array: &dyn Array, row: usize) -> Value {
    if array.is_null(row) {
        return Value::Null;
    }
    match array.data_type() {
        DataType::Boolean => Value::Bool(array.as_boolean().value(row)),
        DataType::Int8 => number(array.as_primitive::<Int8Type>().value(row)),
        DataType::Int16 => number(array.as_primitive::<Int16Type>().value(row)),
        DataType::Int32 => number(array.as_primitive::<Int32Type>().value(row)),
        DataType::Int64 => number(array.as_primitive::<Int64Type>().value(row)),
        DataType::UInt8 => number(array.as_primitive::<UInt8Type>().value(row)),
        DataType::UInt16 => number(array.as_primitive::<UInt16Type>().value(row)),
        DataType::UInt32 => number(array.as_primitive::<UInt32Type>().value(row)),
        DataType::UInt64 => number(array.as_primitive::<UInt64Type>().value(row)),
        DataType::Float16 => float(array.as_primitive::<Float16Type>().value(row).to_f64()),
        DataType::Float32 => float(f64::from(array.as_primitive::<Float32Type>().value(row))),
        DataType::Float64 => float(array.as_primitive::<Float64Type>().value(row)),
        DataType::Utf8 => Value::String(array.as_string::<i32>().value(row).to_string()),
        DataType::LargeUtf8 => Value::String(array.as_string::<i64>().value(row).to_string()),
        DataType::Utf8View => Value::String(array.as_string_view().value(row).to_string()),
        DataType::List(_) => list_value(array.as_list::<i32>().value(row).as_ref()),
        DataType::LargeList(_) => list_value(array.as_list::<i64>().value(row).as_ref()),
        DataType::FixedSizeList(..) => list_value(array.as_fixed_size_list().value(row).as_ref()),
        DataType::Struct(fields) => {
            let s = array.as_struct();
            Value::Object(
                fields
                    .iter()
                    .zip(s.columns())
                    .map(|(f, col)| (f.name().clone(), json_value(col.as_ref(), row)))
                    .collect(),
            )
        }
        DataType::Dictionary(..) => {
            let d = array.as_any_dictionary();
            match json_value(d.keys(), row).as_u64() {
                Some(k) => json_value(d.values().as_ref(), k as usize),
                None => Value::Null,
            }
        }
        _ => Value::Null,
    }
}

fn list_value(items: &dyn Array) -> Value {
    Value::Array((0..items.len()).map(|i| json_value(items, i)).collect())
}
