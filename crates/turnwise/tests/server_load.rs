//! One load test per server over real HTTP, bounded in memory and time (review
//! ../shared/reviews/cli-as-a-user-3.md, M4-M7): the `turnwise` binary serves (with its own
//! allocator settings), concurrent clients send the worst requests its limits allow, and the
//! child's resident memory (`VmHWM`, `VmRSS` of /proc/PID/status) must stay under a stated
//! ceiling during the load and come back within a stated margin of its idle level after it.
//! Each test states its figures on stderr (`cargo test --test server_load -- --nocapture`).

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use serde_json::{Value, json};
use turnwise::model_source::load_init_tensors;
use turnwise_env::env::openenv::{OpenEnvSession, OpenEnvTimeouts};
use turnwise_model::checkpoint::export_hf_folder;
use turnwise_model::model::weights::init_varmap;

/// A `turnwise` server child, killed when dropped.
struct Server {
    child: Child,
    url: String,
}

impl Server {
    /// Runs `turnwise ARGS` and waits for the `http://…` line it prints once listening.
    fn start(args: &[String]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_turnwise"))
            .args(args)
            .env_remove("RUST_LOG")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let url = loop {
            let line = lines
                .next()
                .expect("the server exited before listening")
                .unwrap();
            if let Some(w) = line.split_whitespace().find(|w| w.starts_with("http://")) {
                break w.to_string();
            }
        };
        std::thread::spawn(move || for _ in lines {});
        Self { child, url }
    }

    /// A field of /proc/PID/status in bytes (`VmRSS`, `VmHWM`).
    fn status_bytes(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let line = status
            .lines()
            .find(|l| l.starts_with(field))
            .unwrap_or_else(|| panic!("no {field} in /proc/PID/status"));
        line.split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<u64>()
            .unwrap()
            * 1024
    }

    fn rss(&self) -> u64 {
        self.status_bytes("VmRSS:")
    }

    fn peak(&self) -> u64 {
        self.status_bytes("VmHWM:")
    }

    /// The resident memory once it settles: polls until it is within `margin` of `idle` or
    /// `patience` passes, returning the last reading.
    fn settled_rss(&self, idle: u64, margin: u64, patience: Duration) -> u64 {
        let t = Instant::now();
        loop {
            let rss = self.rss();
            if rss <= idle + margin || t.elapsed() > patience {
                return rss;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const MIB: u64 = 1 << 20;

fn client(timeout: Duration) -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .no_proxy()
        .timeout(timeout)
        .build()
        .unwrap()
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// Runs `clients` threads of `job(i)` at once; returns once all are done.
fn concurrently(clients: usize, job: impl Fn(usize) + Sync) {
    std::thread::scope(|s| {
        for i in 0..clients {
            let job = &job;
            s.spawn(move || job(i));
        }
    });
}

/// Prints and checks a load's memory figures: the server's peak RSS within `ceiling`, its RSS
/// back within 48 MiB of `idle` after the load (waiting up to 5 s for it), and the whole test
/// (started at `t0`) within 60 s.
fn check_load(server: &Server, what: &str, idle: u64, ceiling: u64, took: Duration, t0: Instant) {
    let peak = server.peak();
    let margin = 48 * MIB;
    let after = server.settled_rss(idle, margin, Duration::from_secs(5));
    eprintln!(
        "{what}: idle {} MiB, peak {} MiB (ceiling {} MiB), after {} MiB (idle + {} MiB \
         allowed), {:.1} s",
        idle / MIB,
        peak / MIB,
        ceiling / MIB,
        after / MIB,
        margin / MIB,
        took.as_secs_f64()
    );
    assert!(
        peak <= ceiling,
        "{what}: peak RSS {} MiB beyond the ceiling of {} MiB",
        peak / MIB,
        ceiling / MIB
    );
    assert!(
        after <= idle + margin,
        "{what}: RSS {} MiB after the load, not back within {} MiB of idle ({} MiB)",
        after / MIB,
        margin / MIB,
        idle / MIB
    );
    assert!(
        t0.elapsed() < Duration::from_secs(60),
        "the load test took {:.0} s",
        t0.elapsed().as_secs_f64()
    );
}

/// The committed tiny GGUF fixture's architecture with a 4,096-token context and fresh
/// weights, as a Hugging Face folder.
fn long_context_model(dir: &Path) -> PathBuf {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../turnwise-model/src/checkpoint/fixtures/gguf/tiny-llama.gguf");
    let (_, m) = load_init_tensors(&fixture).unwrap();
    let mut cfg = m.config.clone();
    cfg.max_position_embeddings = 4096;
    let varmap = init_varmap(&cfg, DType::F32, &Device::Cpu, 3).unwrap();
    let out = dir.join("long-context");
    export_hf_folder(&out, &cfg, &varmap, &m.tokenizer, &m.meta).unwrap();
    out
}

/// `turnwise serve` under a 256 MiB budget: 8 clients at once, each asking for 16 samples of
/// a 500-token prompt (the review's GRPO-style request) while two others send the largest
/// `guided_choice` the server takes. The peak stays under the budget plus the server's own
/// memory, and the memory held during the load is given back once it is idle.
#[test]
fn serve_under_load_stays_under_its_ceiling_and_returns_to_idle() {
    let t0 = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let model = long_context_model(tmp.path());
    let server = Server::start(&args(&[
        "serve",
        "--addr",
        "127.0.0.1:0",
        "--memory-budget-mb",
        "256",
        "--max-guided-choices",
        "64",
        "--max-guided-choice-bytes",
        "4096",
        "--model",
        model.to_str().unwrap(),
    ]));
    let http = client(Duration::from_secs(120));
    let url = format!("{}/v1/completions", server.url);
    // Warm up (the first request builds what every later one reuses), then measure idle.
    let r = http
        .post(&url)
        .json(&json!({"prompt": [5, 6, 7], "max_tokens": 2}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    std::thread::sleep(Duration::from_millis(1500));
    let idle = server.rss();
    let prefilled = || -> u64 {
        let v: Value = http
            .get(format!("{}/get_server_info", server.url))
            .send()
            .unwrap()
            .json()
            .unwrap();
        v["engine"]["prefill_tokens"].as_u64().unwrap()
    };
    let prefilled_before = prefilled();
    let prompt: Vec<u32> = (0..500u32).map(|i| (i * 13 + 5) % 290 + 4).collect();
    let choices: Vec<String> = (0..64).map(|i| format!("choice number {i:03}")).collect();
    let load = Instant::now();
    concurrently(10, |i| {
        let body = if i < 8 {
            json!({"prompt": prompt, "n": 16, "max_tokens": 16, "temperature": 1.0, "seed": i})
        } else {
            json!({"prompt": "Pick one.", "guided_choice": choices, "max_tokens": 16})
        };
        let r = http.post(&url).json(&body).send().unwrap();
        let status = r.status().as_u16();
        let v: Value = r.json().unwrap();
        assert_eq!(status, 200, "{v}");
    });
    let took = load.elapsed();
    // Each request's prompt was prefilled once, not once per sample (8 x 16 x 500 before).
    let grew = prefilled() - prefilled_before;
    eprintln!("serve: {grew} prompt tokens prefilled");
    assert!(grew < 8 * 2 * 500, "{grew} prompt tokens prefilled");
    check_load(
        &server,
        "serve: 8 x n=16 x 500 tokens + 2 guided_choice",
        idle,
        idle + 256 * MIB + 64 * MIB,
        took,
        t0,
    );
}

/// A corpus of `n` passages of about 700 bytes (Wikipedia's are about that long).
fn write_corpus(path: &Path, n: usize) {
    let words = [
        "river",
        "capital",
        "company",
        "born",
        "city",
        "mountain",
        "king",
        "war",
        "founded",
        "island",
        "music",
        "album",
        "novel",
        "university",
        "church",
        "railway",
        "empire",
        "language",
        "festival",
        "bridge",
    ];
    let mut out = String::new();
    for i in 0..n {
        let text: Vec<&str> = (0..100)
            .map(|j| words[(i * 7 + j * 3 + j / 5) % 20])
            .collect();
        out.push_str(
            &json!({"id": i.to_string(), "contents": format!("\"Doc {i}\"\n{}", text.join(" "))})
                .to_string(),
        );
        out.push('\n');
    }
    std::fs::write(path, out).unwrap();
}

/// `turnwise serve-retriever` with its default limits: 8 clients at once, each sending three
/// of the largest requests the limits allow (163 queries at top-k 100: 16,300 results of
/// about 700 bytes, 13 MB an answer), and the review's 8,192 × 100 request refused at once.
/// The peak stays under a stated ceiling and the memory comes back to idle.
#[test]
fn serve_retriever_under_load_stays_under_its_ceiling_and_returns_to_idle() {
    let t0 = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let corpus = tmp.path().join("corpus.jsonl");
    write_corpus(&corpus, 2_000);
    let index = tmp.path().join("index");
    let out = Command::new(env!("CARGO_BIN_EXE_turnwise"))
        .args(["index", "--corpus"])
        .arg(&corpus)
        .arg("--out")
        .arg(&index)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let server = Server::start(&args(&[
        "serve-retriever",
        "--addr",
        "127.0.0.1:0",
        "--index",
        index.to_str().unwrap(),
    ]));
    let http = client(Duration::from_secs(60));
    let url = format!("{}/retrieve", server.url);
    let r = http
        .post(&url)
        .json(&json!({"queries": ["river capital"], "topk": 3}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    std::thread::sleep(Duration::from_millis(1500));
    let idle = server.rss();
    // The review's request: refused at once, naming the flag.
    let t = Instant::now();
    let r = http
        .post(&url)
        .json(
            &json!({"queries": vec!["Rada Cradovel company born"; 8192], "topk": 100,
                      "return_scores": true}),
        )
        .send()
        .unwrap();
    assert_eq!(r.status(), 422);
    let v: Value = r.json().unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--max-results"),
        "{v}"
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    let load = Instant::now();
    concurrently(8, |i| {
        for k in 0..3 {
            let queries: Vec<String> = (0..163)
                .map(|q| {
                    format!(
                        "river capital company {} born",
                        (i * 1000 + k * 200 + q) % 97
                    )
                })
                .collect();
            let r = http
                .post(&url)
                .json(&json!({"queries": queries, "topk": 100, "return_scores": true}))
                .send()
                .unwrap();
            assert_eq!(r.status(), 200);
            let body = r.bytes().unwrap();
            assert!(body.len() > 5 << 20, "{} bytes", body.len());
        }
    });
    let took = load.elapsed();
    check_load(
        &server,
        "serve-retriever: 8 clients x 3 x (163 queries x top-k 100)",
        idle,
        idle + 512 * MIB,
        took,
        t0,
    );
}

/// `turnwise serve-env` with 8 sessions and an 8-second idle timeout: 8 clients at once each
/// send the largest step the server takes (a 15 MB turn), then 8 idle clients fill the server
/// and are closed by the timeout, after which a new client is served. (A message must arrive
/// whole within the timeout: eight 15 MB messages parsed at once by a debug build take a few
/// seconds, hence not a shorter one.) The peak stays under a
/// stated ceiling and the memory comes back to idle.
#[test]
fn serve_env_under_load_stays_under_its_ceiling_and_frees_idle_sessions() {
    let t0 = Instant::now();
    let mut list = args(&[
        "--quiet",
        "serve-env",
        "--preset",
        "grpo",
        "--addr",
        "127.0.0.1:0",
        "--max-sessions",
        "8",
        "--idle-timeout-secs",
        "8",
    ]);
    for s in common::tiny_overrides().into_iter().chain([
        "task.env=\"frozen_lake\"".to_string(),
        "task.max_turns=6".to_string(),
        "task.game.train=4".to_string(),
        "task.game.validation=2".to_string(),
        "task.game.test=2".to_string(),
    ]) {
        list.extend(["--set".to_string(), s]);
    }
    let server = Server::start(&list);
    let kwargs = json!({"split": "test", "index": 0})
        .as_object()
        .unwrap()
        .clone();
    let session = || {
        let mut s = OpenEnvSession::connect(&server.url, OpenEnvTimeouts::default()).unwrap();
        s.reset(&kwargs, "reset").unwrap();
        s
    };
    let mut warm = session();
    warm.close();
    std::thread::sleep(Duration::from_millis(1500));
    let idle = server.rss();
    let big = json!({"message": format!("<answer>{}</answer>", "left ".repeat(3_000_000))})
        .as_object()
        .unwrap()
        .clone();
    let load = Instant::now();
    concurrently(8, |_| {
        let mut s = session();
        s.step(&big, "a 15 MB step").unwrap();
        s.close();
    });
    // Eight idle sessions fill the server; the idle timeout frees them.
    let idle_sessions: Vec<OpenEnvSession> = (0..8).map(|_| session()).collect();
    let mut refused = OpenEnvSession::connect(&server.url, OpenEnvTimeouts::default()).unwrap();
    let err = refused.reset(&kwargs, "reset").unwrap_err().to_string();
    assert!(err.contains("CAPACITY_REACHED"), "{err}");
    std::thread::sleep(Duration::from_millis(9000));
    let mut fresh = session();
    fresh.close();
    drop(idle_sessions);
    let took = load.elapsed();
    check_load(
        &server,
        "serve-env: 8 x a 15 MB step, 8 idle sessions timed out",
        idle,
        idle + 512 * MIB,
        took,
        t0,
    );
}
