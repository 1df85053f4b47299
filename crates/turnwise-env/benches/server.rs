//! Retrieval-server throughput: the BM25 server on loopback under concurrent clients.
//!
//! ```text
//! cargo bench -p turnwise-env --bench server -- [--clients 8,32] [--seconds 5]
//!     [--max-requests N] [--queries-per-request Q] [--topk K] [--corpus wiki|world]
//! ```
//!
//! Builds a BM25 index (tantivy) of the Wikipedia vital-article summaries (or of the default
//! generated world with `--corpus world`, or when the wiki package cannot be fetched), starts a
//! [`BackgroundServer`] on `127.0.0.1:0`, and for each client count `C` runs `C` concurrent
//! loopback clients (async reqwest, keep-alive connections, one tokio runtime with 2 worker
//! threads), each sending `POST /retrieve` requests (`Q` queries each, default 1, `topk` 3,
//! `return_scores: true`) back to back for `--seconds` seconds (default 5) or until
//! `--max-requests` requests in all (default 500,000). A request counts as an error unless it
//! answers 200 with one result list per query. Prints requests/s, queries/s, p50/p99/max latency
//! and the error count per client count, and exits non-zero if any request failed.
//!
//! Server and clients share the machine's cores, so the figures are a lower bound on what the
//! server alone sustains.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::{Duration, Instant};

use turnwise_env::corpus::{split_contents, wiki};
use turnwise_env::search::Document;
use turnwise_env::search::bm25::{Bm25BuildOptions, Bm25Index};
use turnwise_env::server::{BackgroundServer, ServerConfig};
use turnwise_env::world::rng::SplitMix64;
use turnwise_env::world::{World, WorldConfig};

struct Args {
    clients: Vec<usize>,
    seconds: f64,
    max_requests: usize,
    per_request: usize,
    topk: usize,
    corpus: String,
    dir: PathBuf,
}

fn parse_args() -> Args {
    let mut args = Args {
        clients: vec![8, 32],
        seconds: 5.0,
        max_requests: 500_000,
        per_request: 1,
        topk: 3,
        corpus: "wiki".into(),
        dir: std::env::temp_dir().join(format!("turnwise-server-bench-{}", std::process::id())),
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().unwrap_or_else(|| panic!("{name} needs a value"));
        match a.as_str() {
            "--clients" => {
                args.clients = value("--clients")
                    .split(',')
                    .map(|c| c.trim().parse().expect("client count"))
                    .collect()
            }
            "--seconds" => args.seconds = value("--seconds").parse().expect("seconds"),
            "--max-requests" => args.max_requests = value("--max-requests").parse().expect("N"),
            "--queries-per-request" => {
                args.per_request = value("--queries-per-request").parse().expect("Q")
            }
            "--topk" => args.topk = value("--topk").parse().expect("K"),
            "--corpus" => args.corpus = value("--corpus"),
            "--dir" => args.dir = PathBuf::from(value("--dir")),
            "--bench" => {} // passed by `cargo bench`
            other => eprintln!("ignoring argument {other}"),
        }
    }
    args
}

/// Five consecutive words of random documents (deterministic).
fn phrase_queries(docs: &[Document], n: usize, seed: u64) -> Vec<String> {
    let mut rng = SplitMix64::new(seed);
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let words: Vec<&str> = split_contents(&rng.pick(docs).contents)
            .1
            .split_whitespace()
            .collect();
        if words.len() >= 5 {
            let s = rng.below(words.len() - 4);
            out.push(words[s..s + 5].join(" "));
        }
    }
    out
}

fn corpus(args: &Args) -> (String, Vec<Document>, Vec<String>) {
    if args.corpus == "wiki" {
        match wiki::load_corpus(wiki::default_cache_dir()) {
            Ok(docs) => {
                let queries = phrase_queries(&docs, 4096, 1);
                return ("wiki".into(), docs, queries);
            }
            Err(e) => println!("wiki corpus unavailable ({e}); using the generated world"),
        }
    }
    let world = World::generate(&WorldConfig::default()).expect("world");
    let queries = world.questions.iter().map(|q| q.text.clone()).collect();
    ("world".into(), world.documents(), queries)
}

struct Run {
    clients: usize,
    requests: usize,
    errors: usize,
    secs: f64,
    latencies_us: Vec<u64>,
}

async fn client_loop(
    http: reqwest::Client,
    url: String,
    bodies: Arc<Vec<serde_json::Value>>,
    per_request: usize,
    deadline: Instant,
    budget: Arc<AtomicIsize>,
    start_at: usize,
) -> (Vec<u64>, usize) {
    let mut latencies = Vec::new();
    let mut errors = 0;
    let mut i = start_at;
    while Instant::now() < deadline && budget.fetch_sub(1, Ordering::Relaxed) > 0 {
        let body = &bodies[i % bodies.len()];
        i += 1;
        let t = Instant::now();
        let ok = match http.post(&url).json(body).send().await {
            Ok(resp) if resp.status().is_success() => {
                match resp.json::<serde_json::Value>().await {
                    Ok(v) => v["result"].as_array().map(|r| r.len()) == Some(per_request),
                    Err(_) => false,
                }
            }
            Ok(resp) => {
                let _ = resp.bytes().await;
                false
            }
            Err(_) => false,
        };
        latencies.push(t.elapsed().as_micros() as u64);
        if !ok {
            errors += 1;
        }
    }
    (latencies, errors)
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64 / 1000.0
}

fn main() {
    let args = parse_args();
    let (name, docs, queries) = corpus(&args);
    if args.dir.exists() {
        std::fs::remove_dir_all(&args.dir).expect("clear index dir");
    }
    let t = Instant::now();
    let index = Bm25Index::build(&args.dir, &docs, &Bm25BuildOptions::default()).expect("index");
    println!(
        "{name}: {} documents indexed in {:.2} s",
        docs.len(),
        t.elapsed().as_secs_f64()
    );
    let server = BackgroundServer::start(
        Arc::new(index),
        ServerConfig::with_addr("127.0.0.1:0".parse().unwrap()),
    )
    .expect("server");
    let url = format!("{}/retrieve", server.url());
    let bodies: Arc<Vec<serde_json::Value>> = Arc::new(
        queries
            .chunks(args.per_request)
            .filter(|c| c.len() == args.per_request)
            .map(|c| serde_json::json!({"queries": c, "topk": args.topk, "return_scores": true}))
            .collect(),
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();

    let mut runs = Vec::new();
    for &clients in &args.clients {
        // Warm-up: one request per client, also opens the keep-alive connections.
        rt.block_on(async {
            let mut tasks = Vec::new();
            for c in 0..clients {
                tasks.push(tokio::spawn(client_loop(
                    http.clone(),
                    url.clone(),
                    bodies.clone(),
                    args.per_request,
                    Instant::now() + Duration::from_secs(5),
                    Arc::new(AtomicIsize::new(1)),
                    c,
                )));
            }
            for t in tasks {
                t.await.unwrap();
            }
        });
        let budget = Arc::new(AtomicIsize::new(args.max_requests as isize));
        let start = Instant::now();
        let deadline = start + Duration::from_secs_f64(args.seconds);
        let results = rt.block_on(async {
            let mut tasks = Vec::new();
            for c in 0..clients {
                tasks.push(tokio::spawn(client_loop(
                    http.clone(),
                    url.clone(),
                    bodies.clone(),
                    args.per_request,
                    deadline,
                    budget.clone(),
                    c * 7919,
                )));
            }
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.unwrap());
            }
            out
        });
        let secs = start.elapsed().as_secs_f64();
        let mut latencies_us: Vec<u64> = results.iter().flat_map(|r| r.0.clone()).collect();
        latencies_us.sort_unstable();
        runs.push(Run {
            clients,
            requests: latencies_us.len(),
            errors: results.iter().map(|r| r.1).sum(),
            secs,
            latencies_us,
        });
    }
    server.shutdown().expect("server shutdown");
    let _ = std::fs::remove_dir_all(&args.dir);

    println!(
        "\nBM25 server on 127.0.0.1 ({name}, {} docs): {} quer{} per request, topk {}, {} s per \
         client count",
        docs.len(),
        args.per_request,
        if args.per_request == 1 { "y" } else { "ies" },
        args.topk,
        args.seconds
    );
    println!(
        "| clients | requests | requests/s | queries/s | p50 ms | p99 ms | max ms | errors | \
         req/s vs {} clients |",
        runs[0].clients
    );
    println!(
        "|--------:|---------:|-----------:|----------:|-------:|-------:|-------:|-------:|------------------:|"
    );
    let base = runs[0].requests as f64 / runs[0].secs;
    let mut errors = 0;
    for r in &runs {
        let rps = r.requests as f64 / r.secs;
        errors += r.errors;
        println!(
            "| {:>7} | {:>8} | {:>10.0} | {:>9.0} | {:>6.2} | {:>6.2} | {:>6.2} | {:>6} | {:>17.2}× |",
            r.clients,
            r.requests,
            rps,
            rps * args.per_request as f64,
            percentile(&r.latencies_us, 0.50),
            percentile(&r.latencies_us, 0.99),
            percentile(&r.latencies_us, 1.0),
            r.errors,
            rps / base
        );
    }
    if errors > 0 {
        eprintln!("{errors} requests failed");
        std::process::exit(1);
    }
}
