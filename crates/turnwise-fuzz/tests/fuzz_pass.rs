//! The short fuzz pass CI runs on the stable toolchain: every target replays its committed
//! corpus (`fuzz/corpus/<target>/`, minimised by `cargo fuzz cmin`), then mutates it at random
//! for `TURNWISE_FUZZ_SECONDS` seconds (default 20; 0 replays only) with its dictionary
//! (`fuzz/dict/<target>.dict`). A failing input is written to `fuzz-failures/` in the target
//! folder's `tmp/` and the test fails naming it; `TURNWISE_FUZZ_SEED` replays a pass's mutations.
//!
//! The long, coverage-guided runs use the cargo-fuzz package in `fuzz/` (README: "Fuzzing").

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use turnwise_fuzz::mutate::{Rng, mutate};

/// The most bytes this test process may hold at once (4 GiB): an input that makes a reader
/// allocate without bound (the qa_parquet target once took 24 GB and was killed by the OOM
/// killer) aborts the pass with "memory allocation of N bytes failed" instead of taking the
/// machine's memory; the input it ran on is in `fuzz-failures/<target>-current`.
const MEMORY_CAP: usize = 4 << 30;

/// The system allocator, refusing allocations beyond [`MEMORY_CAP`] live bytes.
struct Capped;

static LIVE: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call forwards to `System` with the same layout; the counter only decides
// whether to forward an allocation or report it failed (null), which GlobalAlloc allows.
unsafe impl GlobalAlloc for Capped {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size() > MEMORY_CAP {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's layout, as GlobalAlloc::alloc requires.
        let p = unsafe { System.alloc(layout) };
        if p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: `ptr` was allocated by `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Capped = Capped;

fn failures() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz-failures");
    std::fs::create_dir_all(&dir).expect("a folder for failing inputs");
    dir
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = repo().join("fuzz/corpus").join(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).expect("a corpus file"))
        })
        .collect()
}

/// Tokens of a libFuzzer dictionary (`"..."` lines with `\\`, `\"` and `\xNN` escapes).
fn dictionary(target: &str) -> Vec<Vec<u8>> {
    let path = repo().join("fuzz/dict").join(format!("{target}.dict"));
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Vec::new();
    };
    let mut tokens = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || !line.ends_with('"') {
            continue;
        }
        let Some(start) = line.find('"') else {
            continue;
        };
        let body = &line.as_bytes()[start + 1..line.len() - 1];
        let mut token = Vec::new();
        let mut i = 0;
        while i < body.len() {
            if body[i] == b'\\' && i + 1 < body.len() {
                if body[i + 1] == b'x' && i + 3 < body.len() {
                    let hex = std::str::from_utf8(&body[i + 2..i + 4]).unwrap_or("00");
                    token.push(u8::from_str_radix(hex, 16).unwrap_or(0));
                    i += 4;
                } else {
                    token.push(body[i + 1]);
                    i += 2;
                }
            } else {
                token.push(body[i]);
                i += 1;
            }
        }
        tokens.push(token);
    }
    tokens
}

fn check(target: &str, run: turnwise_fuzz::Target, input: &[u8], origin: &str) {
    // Kept until the next input: the one to replay when the process dies (out of memory).
    let _ = std::fs::write(failures().join(format!("{target}-current")), input);
    let result = std::panic::catch_unwind(|| run(input));
    if let Err(e) = result {
        let why = e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        let file = failures().join(format!("{target}-{:016x}", fnv(input)));
        std::fs::write(&file, input).expect("write the failing input");
        panic!(
            "fuzz target {target} failed on {origin} (saved as {}; replay with `cargo fuzz run \
             {target} {}` in the repository root): {why}",
            file.display(),
            file.display()
        );
    }
}

fn fnv(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn pass(target: &str) {
    let run = turnwise_fuzz::target(target).expect("a known target");
    let inputs = corpus(target);
    assert!(!inputs.is_empty(), "fuzz/corpus/{target} is empty");
    for (name, input) in &inputs {
        check(target, run, input, &format!("fuzz/corpus/{target}/{name}"));
    }
    let seconds: u64 = std::env::var("TURNWISE_FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let seed: u64 = std::env::var("TURNWISE_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    eprintln!("{target}: TURNWISE_FUZZ_SEED={seed}, {seconds} s");
    let dict = dictionary(target);
    let dict: Vec<&[u8]> = dict.iter().map(Vec::as_slice).collect();
    let mut rng = Rng::new(seed ^ fnv(target.as_bytes()));
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut n = 0u64;
    while Instant::now() < deadline {
        let a = &inputs[rng.below(inputs.len())].1;
        let b = &inputs[rng.below(inputs.len())].1;
        let input = mutate(&mut rng, a, b, &dict, 4096);
        check(
            target,
            run,
            &input,
            &format!("mutation {n} (TURNWISE_FUZZ_SEED={seed})"),
        );
        n += 1;
    }
    eprintln!(
        "{target}: {} corpus inputs replayed, {n} mutations in {seconds} s (seed {seed})",
        inputs.len()
    );
}

#[test]
fn tags() {
    pass("tags");
}

#[test]
fn qa_jsonl() {
    pass("qa_jsonl");
}

#[test]
fn qa_parquet() {
    pass("qa_parquet");
}

#[test]
fn serve_http() {
    pass("serve_http");
}

#[test]
fn serve_retriever() {
    pass("serve_retriever");
}

#[test]
fn serve_env() {
    pass("serve_env");
}

#[test]
fn chat_template() {
    pass("chat_template");
}

#[test]
fn every_target_has_a_test_a_cargo_fuzz_binary_and_a_corpus() {
    let root = repo();
    let manifest = std::fs::read_to_string(root.join("fuzz/Cargo.toml")).expect("fuzz/Cargo.toml");
    let this =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz_pass.rs"))
            .expect("this file");
    for (name, _) in turnwise_fuzz::TARGETS {
        assert!(
            manifest.contains(&format!("name = \"{name}\"")),
            "fuzz/Cargo.toml has no binary {name}"
        );
        assert!(
            root.join(format!("fuzz/fuzz_targets/{name}.rs")).is_file(),
            "no fuzz/fuzz_targets/{name}.rs"
        );
        assert!(
            this.contains(&format!("fn {name}()")),
            "tests/fuzz_pass.rs has no test {name}"
        );
        assert!(
            root.join("fuzz/corpus").join(name).is_dir(),
            "no corpus for {name}"
        );
    }
}
