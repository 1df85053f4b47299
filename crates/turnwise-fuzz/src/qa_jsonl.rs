//! The JSON-lines question and corpus readers ([`turnwise_env::corpus::read_qa_from`],
//! [`turnwise_env::corpus::read_corpus_from`]).
//!
//! Input: the bytes of a file. Invariants beyond "no panic":
//! - an `Ok` question file holds only questions with text (not blank) and at least one gold
//!   answer, none of which normalises to the empty string (issue 50: an empty gold answer would
//!   reward an empty `<answer></answer>`);
//! - round trip: the questions written back with `write_qa`'s line format read back equal;
//! - an error names the file and a line inside it.

use std::path::Path;

use turnwise_env::corpus::{CorpusError, QaExample, read_corpus_from, read_qa_from};

/// The name the readers see (it makes default ids and error messages).
const NAME: &str = "fuzz.jsonl";

/// One input (see the module docs).
pub fn run(data: &[u8]) {
    let lines = data.split(|&b| b == b'\n').count();
    match read_qa_from(data, NAME) {
        Ok(questions) => {
            check_questions(&questions);
            let mut written = Vec::new();
            for q in &questions {
                serde_json::to_writer(&mut written, q).expect("a question serialises");
                written.push(b'\n');
            }
            let again = read_qa_from(written.as_slice(), NAME).unwrap_or_else(|e| {
                panic!(
                    "questions written back do not read: {e}\n{}",
                    String::from_utf8_lossy(&written)
                )
            });
            assert_eq!(again, questions, "write → read changed the questions");
        }
        Err(e) => check_error(&e, lines),
    }
    match read_corpus_from(data, NAME) {
        Ok(docs) => {
            for d in &docs {
                let (title, text) = turnwise_env::corpus::split_contents(&d.contents);
                assert!(title.len() + text.len() <= d.contents.len());
            }
        }
        Err(e) => check_error(&e, lines),
    }
}

/// The properties every question read without error has.
pub fn check_questions(questions: &[QaExample]) {
    for q in questions {
        assert!(!q.question.trim().is_empty(), "blank question {q:?}");
        assert!(!q.golden_answers.is_empty(), "no gold answer {q:?}");
        for a in &q.golden_answers {
            assert!(
                !turnwise_core::reward::normalize_answer(a).is_empty(),
                "gold answer {a:?} normalises to nothing: {q:?}"
            );
        }
    }
}

/// A JSON-lines error names the file and a line that exists.
fn check_error(e: &CorpusError, lines: usize) {
    match e {
        CorpusError::Parse {
            path,
            line,
            message,
        } => {
            assert_eq!(path, Path::new(NAME));
            assert!(
                (1..=lines).contains(line),
                "line {line} of {lines}: {message}"
            );
            assert!(!message.is_empty());
        }
        other => panic!("a JSON-lines reader gave a non-parse error: {other}"),
    }
}
