//! Fuzz targets of turnwise's parsers of untrusted input, as plain functions of a byte slice.
//!
//! Each target panics on a finding: a panic inside the code under test, or a broken invariant
//! (an `Ok` result that lacks its documented properties, a round trip that changes the value,
//! a server answering 500 or with a body that is not JSON). Two drivers run them:
//!
//! - the cargo-fuzz package in `fuzz/` (libFuzzer, coverage-guided; one binary per target, a
//!   nightly toolchain or `RUSTC_BOOTSTRAP=1`), which produced the counts in docs/results.md
//!   and the corpora committed under `fuzz/corpus/`;
//! - `tests/fuzz_pass.rs`, run by `cargo test` on the stable toolchain (and so by CI): it
//!   replays every committed corpus file and then mutates them at random for a bounded time
//!   ([`mutate`]).
//!
//! The targets ([`TARGETS`]):
//! - [`tags::run`]: every tag grammar (`search_r1`, `boxed`, `t2po`, `verifiers`), their
//!   validators and the rewards, with parse → render → parse round trips;
//! - [`qa_jsonl::run`]: the JSON-lines question and corpus readers, with a write → read round
//!   trip;
//! - [`qa_parquet::run`]: the Parquet question and corpus readers (the bytes as a `.parquet`
//!   file);
//! - [`serve_http::run`]: `turnwise serve`'s `/generate`, `/v1/completions` and
//!   `/v1/chat/completions` over real HTTP (the committed tiny GGUF model);
//! - [`serve_retriever::run`]: `turnwise serve-retriever`'s `/retrieve` over real HTTP;
//! - [`serve_env::run`]: `turnwise serve-env`'s WebSocket messages and `/reset`, `/mcp` bodies;
//! - [`chat_template::run`]: the chat-template renderer (fixed templates with fuzzed
//!   conversations, and fuzzed `tokenizer_config.json` documents).

pub mod chat_template;
pub mod http;
pub mod mutate;
pub mod qa_jsonl;
pub mod qa_parquet;
pub mod serve_env;
pub mod serve_http;
pub mod serve_retriever;
pub mod tags;

/// A fuzz target: one input, panics on a finding.
pub type Target = fn(&[u8]);

/// Every target by name (the names of `fuzz/fuzz_targets/*.rs` and `fuzz/corpus/*`).
pub const TARGETS: [(&str, Target); 7] = [
    ("tags", tags::run),
    ("qa_jsonl", qa_jsonl::run),
    ("qa_parquet", qa_parquet::run),
    ("serve_http", serve_http::run),
    ("serve_retriever", serve_retriever::run),
    ("serve_env", serve_env::run),
    ("chat_template", chat_template::run),
];

/// The target named `name`.
pub fn target(name: &str) -> Option<Target> {
    TARGETS.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
}

/// Splits `data` at NUL bytes into (lossy UTF-8) pieces: how targets take several strings from
/// one input.
pub fn pieces(data: &[u8]) -> Vec<String> {
    data.split(|&b| b == 0)
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .collect()
}
