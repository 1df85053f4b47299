//! Question files and corpora in Parquet and in Hugging Face `datasets` folders, as written by
//! `datasets` (Search-R1's nq_search.py), pandas and pyarrow: the committed files under
//! tests/fixtures/questions (made by make_question_fixtures.py there), and fresh ones when the
//! Python packages are importable.

use std::path::{Path, PathBuf};
use std::process::Command;

use turnwise_env::corpus::{QaExample, read_corpus, read_qa, read_qa_split};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/questions")
}

fn fx(name: &str) -> PathBuf {
    fixtures().join(name)
}

/// The training questions of the fixtures as Search-R1's nq_search.py leaves them (stripped,
/// ending in `?`), with their answers.
fn nq_train() -> Vec<(&'static str, &'static str, Vec<&'static str>)> {
    vec![
        (
            "train_0",
            "total number of death row inmates in the us?",
            vec!["2,718"],
        ),
        (
            "train_1",
            "who wrote the song I will always love you?",
            vec!["Dolly Parton"],
        ),
        (
            "train_2",
            "where is the Eiffel tower located?",
            vec!["Paris", "Paris, France"],
        ),
        (
            "train_3",
            "who is the author of « Les Misérables »?",
            vec!["Victor Hugo"],
        ),
    ]
}

fn summary(qa: &[QaExample]) -> Vec<(&str, &str, Vec<&str>)> {
    qa.iter()
        .map(|q| {
            (
                q.id.as_str(),
                q.question.as_str(),
                q.golden_answers.iter().map(String::as_str).collect(),
            )
        })
        .collect()
}

fn err(path: &Path) -> String {
    read_qa(path).expect_err("malformed input").to_string()
}

#[test]
fn search_r1_nq_search_parquet_reads_as_its_json_lines() {
    // Written as Search-R1 writes it: `datasets` map + to_parquet, snappy, nested structs.
    let parquet = read_qa(fx("nq_search/train.parquet")).unwrap();
    assert_eq!(summary(&parquet), nq_train());
    // Every field, metadata included, as the JSON lines of the same rows.
    assert_eq!(parquet, read_qa(fx("nq_search/train.jsonl")).unwrap());
    assert_eq!(
        read_qa(fx("nq_search/test.parquet")).unwrap(),
        read_qa(fx("nq_search/test.jsonl")).unwrap()
    );
    let q = &parquet[2];
    assert_eq!(q.metadata["data_source"], "nq");
    assert_eq!(q.metadata["ability"], "fact-reasoning");
    assert_eq!(q.metadata["extra_info"]["index"], 2);
    assert_eq!(
        q.metadata["reward_model"]["ground_truth"]["target"],
        serde_json::json!(["Paris", "Paris, France"])
    );
    let prompt = &q.metadata["prompt"];
    assert_eq!(prompt[0]["role"], "user");
    let content = prompt[0]["content"].as_str().unwrap();
    assert!(content.starts_with("Answer the given question. You must conduct reasoning"));
    assert!(content.ends_with("Question: where is the Eiffel tower located?\n"));
}

#[test]
fn verl_columns_alone_give_the_question_from_the_prompt_and_the_answers_from_the_target() {
    // Only data_source, prompt, ability, reward_model, extra_info (pyarrow, zstd): the question
    // is the text after the prompt's final "Question:", the answers reward_model.ground_truth
    // .target, the id {extra_info.split}_{extra_info.index}.
    let qa = read_qa(fx("verl_columns_zstd.parquet")).unwrap();
    assert_eq!(summary(&qa), nq_train());
    assert!(qa[0].metadata.get("question").is_none());
    assert_eq!(qa[0].metadata["prompt"][0]["role"], "user");
}

#[test]
fn raw_flashrag_parquet_and_verl_gsm8k_layouts() {
    // FlashRAG's raw layout, pandas (large_string columns), snappy: as the data has it.
    let raw = read_qa(fx("raw_nq.parquet")).unwrap();
    assert_eq!(raw.len(), 4);
    assert_eq!(raw[2].id, "train_2");
    assert_eq!(raw[2].question, "  where is the Eiffel tower located ");
    assert_eq!(raw[2].golden_answers, ["Paris", "Paris, France"]);
    assert!(raw[2].metadata.is_null());

    // verl's gsm8k layout (pandas, gzip): ground_truth a plain string, the question in
    // extra_info.
    let gsm8k = read_qa(fx("verl_gsm8k.parquet")).unwrap();
    assert_eq!(gsm8k.len(), 2);
    assert_eq!(gsm8k[1].id, "train_1");
    assert!(gsm8k[1].question.starts_with("Weng earns $12 an hour"));
    assert!(gsm8k[1].question.ends_with("How much did she earn?"));
    assert_eq!(gsm8k[1].golden_answers, ["10"]);
    assert_eq!(gsm8k[1].metadata["data_source"], "openai/gsm8k");
}

#[test]
fn datasets_folders_saved_with_save_to_disk() {
    let train_jsonl = read_qa(fx("nq_search/train.jsonl")).unwrap();
    let test_jsonl = read_qa(fx("nq_search/test.jsonl")).unwrap();
    // A Dataset in two shards (Arrow IPC streams), read in state.json's order.
    assert_eq!(read_qa(fx("hf_dataset")).unwrap(), train_jsonl);
    // One shard on its own.
    let shard = read_qa(fx("hf_dataset/data-00001-of-00002.arrow")).unwrap();
    assert_eq!(shard[..], train_jsonl[2..]);

    // A DatasetDict: the split asked for, or the split's folder.
    let dict = fx("hf_dataset_dict");
    assert_eq!(read_qa_split(&dict, Some("train")).unwrap(), train_jsonl);
    assert_eq!(read_qa_split(&dict, Some("test")).unwrap(), test_jsonl);
    assert_eq!(read_qa(dict.join("test")).unwrap(), test_jsonl);
    // No split named, or one the dict lacks: the error says which splits there are and what
    // to do.
    let e = read_qa(&dict).unwrap_err().to_string();
    assert_eq!(
        e,
        format!(
            "{}: a DatasetDict with the splits [train, test]: point the path at one split's \
             folder, e.g. {}",
            dict.display(),
            dict.join("train").display()
        )
    );
    let e = read_qa_split(&dict, Some("validation"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("a DatasetDict with the splits [train, test] and no validation split")
            && e.contains("looked for validation, val, valid, dev"),
        "{e}"
    );
    // A folder that is not a `datasets` folder.
    let e = read_qa(fx("bad")).unwrap_err().to_string();
    assert!(
        e.contains("not a Hugging Face `datasets` folder") && e.contains("state.json"),
        "{e}"
    );
}

#[test]
fn malformed_inputs_name_the_file_the_row_and_the_column() {
    let bad = fixtures().join("bad");
    let f = |n: &str| bad.join(n);
    // A missing column: no answers anywhere.
    assert_eq!(
        err(&f("no_answers.parquet")),
        format!(
            "{}: column golden_answers: no column gives the answers: expected `golden_answers` \
             (or `answers`, `answer`) or `reward_model.ground_truth` (the columns are: id, \
             question)",
            f("no_answers.parquet").display()
        )
    );
    // Wrong types: a number column for the question, a boolean ground truth.
    assert_eq!(
        err(&f("question_int.parquet")),
        format!(
            "{}: row 0, column question: must be a string, found 7 (the column's type is Int64)",
            f("question_int.parquet").display()
        )
    );
    assert_eq!(
        err(&f("ground_truth_bool.parquet")),
        format!(
            "{}: row 0, column reward_model.ground_truth: must be a string or a list of \
             strings, found true",
            f("ground_truth_bool.parquet").display()
        )
    );
    // A null in the third row.
    assert_eq!(
        err(&f("null_answers.parquet")),
        format!(
            "{}: row 2, column golden_answers: null (and no reward_model.ground_truth)",
            f("null_answers.parquet").display()
        )
    );
    // A schema and no rows reads as no questions (the task then names the empty file).
    assert!(read_qa(f("no_rows.parquet")).unwrap().is_empty());

    // Empty files and files that are not what their names say.
    let tmp = tempfile::tempdir().unwrap();
    let empty = tmp.path().join("empty.parquet");
    std::fs::write(&empty, b"").unwrap();
    let e = err(&empty);
    assert!(
        e.starts_with(&format!(
            "{}: not a readable Parquet file: ",
            empty.display()
        )),
        "{e}"
    );
    let text = tmp.path().join("text.parquet");
    std::fs::write(
        &text,
        "{\"question\": \"q\", \"golden_answers\": [\"a\"]}\n",
    )
    .unwrap();
    assert!(
        err(&text).starts_with(&format!("{}: not a readable Parquet file", text.display())),
        "{}",
        err(&text)
    );
    let empty_arrow = tmp.path().join("empty.arrow");
    std::fs::write(&empty_arrow, b"").unwrap();
    assert_eq!(
        err(&empty_arrow),
        format!(
            "{}: an empty file (an Arrow IPC stream starts with its schema)",
            empty_arrow.display()
        )
    );
    let parquet_as_arrow = tmp.path().join("train.arrow");
    std::fs::copy(fx("nq_search/train.parquet"), &parquet_as_arrow).unwrap();
    assert!(
        err(&parquet_as_arrow).starts_with(&format!(
            "{}: not a readable Arrow IPC stream or file",
            parquet_as_arrow.display()
        )),
        "{}",
        err(&parquet_as_arrow)
    );
    // A question file is not a corpus, and the error says what a corpus has.
    let e = read_corpus(fx("raw_nq.parquet")).unwrap_err().to_string();
    assert!(
        e.contains("raw_nq.parquet: column contents: missing (a corpus has `id` and `contents`"),
        "{e}"
    );
}

#[test]
fn corpora_in_parquet() {
    // Integer ids and Search-R1's contents (pandas), or FlashRAG's id/title/text (pyarrow).
    let docs = read_corpus(fx("corpus.parquet")).unwrap();
    assert_eq!(docs.len(), 3);
    assert_eq!(docs[2].id, "2");
    assert_eq!(
        turnwise_env::corpus::split_contents(&docs[2].contents),
        (
            "Les Misérables",
            "Les Misérables is a novel by Victor Hugo, published in 1862."
        )
    );
    assert_eq!(read_corpus(fx("corpus_title_text.parquet")).unwrap(), docs);
}

#[test]
fn whole_float_answers_read_as_integers() {
    // cli-as-a-user-3 m9: the Parquet float answer [2.0] became the gold "2.0", which the EM
    // normaliser turns into "20": an answer of 2 could never match it.
    let qa = read_qa(fx("float_answers.parquet")).unwrap();
    assert_eq!(qa[0].golden_answers, ["2"]);
    assert_eq!(qa[1].golden_answers, ["2.5", "1000"]);
    // The same numbers in JSON lines read the same.
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("numbers.jsonl");
    std::fs::write(
        &path,
        "{\"question\": \"two?\", \"golden_answers\": [2.0, 2, 2.5, -0.0]}\n\
         {\"question\": \"big?\", \"answer\": 1e300}\n",
    )
    .unwrap();
    let qa = read_qa(&path).unwrap();
    assert_eq!(qa[0].golden_answers, ["2", "2", "2.5", "0"]);
    assert_eq!(qa[1].golden_answers, ["1e+300"]);
}

#[test]
fn duplicate_question_ids_are_refused_naming_the_file_both_rows_and_the_id() {
    // cli-as-a-user-3 m8: a split of 4 rows all with id "same" was accepted, although evaluation
    // files and study panels are keyed by id.
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("dup_ids.jsonl");
    let rows: String = (0..4)
        .map(|i| {
            format!("{{\"id\": \"same\", \"question\": \"q{i}?\", \"golden_answers\": [\"x\"]}}\n")
        })
        .collect();
    std::fs::write(&path, rows).unwrap();
    let e = err(&path);
    assert!(
        e.starts_with(&format!(
            "{}:2: duplicate id \"same\": line 1 has it too; question ids key evaluation files",
            path.display()
        )),
        "{e}"
    );
    // A default id that repeats an explicit one is a duplicate too.
    std::fs::write(
        &path,
        "{\"question\": \"a?\", \"answer\": \"x\"}\n{\"id\": \"dup_ids_0\", \"question\": \"b?\", \"answer\": \"y\"}\n",
    )
    .unwrap();
    assert!(err(&path).contains(":2: duplicate id \"dup_ids_0\": line 1 has it too"));
    // Parquet: the file, the row and the first row.
    let bad = fx("bad/dup_ids.parquet");
    let e = err(&bad);
    assert!(
        e.starts_with(&format!(
            "{}: row 2, column id: duplicate id \"a\": row 0 has it too",
            bad.display()
        )),
        "{e}"
    );
}

#[test]
fn a_byte_order_mark_at_the_start_of_a_json_lines_file_is_skipped() {
    // cli-as-a-user-3 m7: a UTF-8 BOM (Windows tools, Excel) gave "invalid JSON: expected value
    // at line 1 column 1".
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("bom.jsonl");
    std::fs::write(
        &path,
        "\u{feff}{\"question\": \"who?\", \"golden_answers\": [\"Ada\"]}\r\n",
    )
    .unwrap();
    let qa = read_qa(&path).unwrap();
    assert_eq!(summary(&qa), [("bom_0", "who?", vec!["Ada"])]);
    let corpus = tmp.path().join("corpus.jsonl");
    std::fs::write(&corpus, "\u{feff}{\"id\": 1, \"contents\": \"T\\ntext\"}\n").unwrap();
    assert_eq!(read_corpus(&corpus).unwrap()[0].id, "1");
    // Only at the start: a BOM inside the file is still malformed JSON, named by its line.
    std::fs::write(
        &path,
        "{\"question\": \"a?\", \"answer\": \"x\"}\n\u{feff}{\"question\": \"b?\", \"answer\": \"y\"}\n",
    )
    .unwrap();
    assert!(err(&path).contains(":2: invalid JSON"), "{}", err(&path));
}

#[test]
fn a_parquet_footer_with_a_negative_column_offset_is_an_error_not_a_panic() {
    // Found by the qa_parquet fuzz target: the parquet crate asserts on a column chunk whose
    // offset or size is negative (`ColumnChunkMetaData::byte_range`), which aborted the run.
    // The input as the fuzzer wrote it (tests/fixtures/fuzz/, beside the generated fixtures).
    let bad = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/fuzz/qa_parquet-negative_offset.parquet");
    for e in [
        err(&bad),
        read_corpus(&bad).expect_err("a corrupt file").to_string(),
    ] {
        assert!(
            e.starts_with(&format!("{}: not a readable Parquet file", bad.display())),
            "{e}"
        );
    }
}

#[test]
fn a_parquet_row_group_with_a_negative_row_count_is_an_error_not_an_endless_read() {
    // Found by the qa_parquet fuzz target: a row group whose footer says -8 rows was read as
    // an endless run of batches (24 GB before the kernel's OOM killer stopped it).
    let bad = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/fuzz/qa_parquet-negative_row_count.parquet");
    let e = err(&bad);
    assert!(
        e.starts_with(&format!(
            "{}: not a readable Parquet file: row group 0 has a negative row count (-8)",
            bad.display()
        )),
        "{e}"
    );
}

/// The fixture files the fresh files are compared with, read as questions or as a corpus.
const QUESTION_FILES: &[&str] = &[
    "nq_search/train.parquet",
    "nq_search/test.parquet",
    "nq_search/train.jsonl",
    "verl_columns_zstd.parquet",
    "raw_nq.parquet",
    "verl_gsm8k.parquet",
    "hf_dataset",
    "hf_dataset_dict/train",
    "hf_dataset_dict/test",
    "bad/no_rows.parquet",
    "float_answers.parquet",
];
const BAD_FILES: &[&str] = &[
    "bad/no_answers.parquet",
    "bad/question_int.parquet",
    "bad/null_answers.parquet",
    "bad/ground_truth_bool.parquet",
    "bad/dup_ids.parquet",
];
const CORPUS_FILES: &[&str] = &["corpus.parquet", "corpus_title_text.parquet"];

#[test]
fn fresh_files_from_python_read_like_the_committed_ones() {
    let probe = Command::new("python3")
        .args(["-c", "import pyarrow, pandas, datasets"])
        .output();
    match probe {
        Ok(out) if out.status.success() => {}
        other => {
            let why = match other {
                Ok(out) => String::from_utf8_lossy(&out.stderr).trim().to_string(),
                Err(e) => format!("python3 does not run: {e}"),
            };
            // CI installs the packages (.ci/run): there, their absence is a failure.
            assert!(
                std::env::var_os("CI").is_none(),
                "CI needs pyarrow, pandas and datasets for this test: {why}"
            );
            eprintln!(
                "skipped: pyarrow, pandas and datasets are not importable ({why}); the \
                 committed fixtures are still read by the other tests"
            );
            return;
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new("python3")
        .arg(fx("make_question_fixtures.py"))
        .arg(tmp.path())
        .env("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "make_question_fixtures.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for name in QUESTION_FILES {
        assert_eq!(
            read_qa(tmp.path().join(name)).unwrap(),
            read_qa(fx(name)).unwrap(),
            "{name}"
        );
    }
    for name in BAD_FILES {
        let fresh = err(&tmp.path().join(name));
        let committed = err(&fx(name));
        assert_eq!(
            fresh.replace(&tmp.path().display().to_string(), "DIR"),
            committed.replace(&fixtures().display().to_string(), "DIR"),
        );
    }
    for name in CORPUS_FILES {
        assert_eq!(
            read_corpus(tmp.path().join(name)).unwrap(),
            read_corpus(fx(name)).unwrap(),
            "{name}"
        );
    }
    // The fixtures folder holds nothing the script does not write (a stale file would be
    // tested without being reproducible).
    let listing = |root: &Path| {
        let mut files = Vec::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else {
                    files.push(p.strip_prefix(root).unwrap().to_path_buf());
                }
            }
        }
        files.retain(|p| p.extension().is_none_or(|e| e != "py"));
        files.sort();
        files
    };
    assert_eq!(listing(tmp.path()), listing(&fixtures()));
}
