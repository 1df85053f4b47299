//! The Parquet question and corpus readers ([`turnwise_env::corpus::read_qa`] and
//! [`turnwise_env::corpus::read_corpus`] on a `.parquet` file).
//!
//! Input: the bytes of the file, written to a temporary file (the readers take a path).
//! Invariants beyond "no panic": an `Ok` question file has the properties
//! [`super::qa_jsonl::check_questions`] checks; an error names the file.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use turnwise_env::corpus::{self, CorpusError};

/// A private folder for this process's temporary files (`/dev/shm` when there is one).
fn scratch() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let shm = std::path::Path::new("/dev/shm");
        let base = if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("turnwise-fuzz-parquet-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a scratch folder");
        dir
    })
}

/// One input (see the module docs).
pub fn run(data: &[u8]) {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let path = scratch().join(format!("q{}.parquet", n % 64));
    std::fs::write(&path, data).expect("write the input");
    match corpus::read_qa(&path) {
        Ok(questions) => super::qa_jsonl::check_questions(&questions),
        Err(e) => check_error(&e, &path),
    }
    match corpus::read_corpus(&path) {
        Ok(docs) => {
            for d in &docs {
                let (title, text) = corpus::split_contents(&d.contents);
                assert!(title.len() + text.len() <= d.contents.len());
            }
        }
        Err(e) => check_error(&e, &path),
    }
    let _ = std::fs::remove_file(&path);
}

fn check_error(e: &CorpusError, path: &std::path::Path) {
    let message = e.to_string();
    assert!(
        message.contains(&*path.to_string_lossy()),
        "the error does not name the file: {message}"
    );
}
