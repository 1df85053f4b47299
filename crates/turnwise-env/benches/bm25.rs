//! BM25 throughput: queries per second of the tantivy index (and the in-memory one) on the
//! Wikipedia vital-article summaries and on the default generated world.
//!
//! ```text
//! cargo bench -p turnwise-env --bench bm25 -- [--dir DIR] [--queries N] [--k K]
//! python3 crates/turnwise-env/benches/bm25_rank_bm25.py DIR
//! ```
//!
//! The bench writes into `DIR` (default `<temp>/turnwise-bm25-bench`), per corpus: the corpus
//! (`{name}_corpus.jsonl`), the queries (`{name}_queries.txt`), its top-k ids
//! (`{name}_rust_topk.jsonl`) and its timings (`{name}_rust.json`), so the Python script can run
//! `rank_bm25` on exactly the same data and compare.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use turnwise_env::corpus::{split_contents, wiki, write_corpus};
use turnwise_env::search::bm25::{Bm25BuildOptions, Bm25Index};
use turnwise_env::search::bm25_mem::InMemoryBm25;
use turnwise_env::search::{Document, Retriever};
use turnwise_env::world::rng::SplitMix64;
use turnwise_env::world::{World, WorldConfig};

struct Args {
    dir: PathBuf,
    queries: usize,
    k: usize,
}

fn parse_args() -> Args {
    let mut args = Args {
        dir: std::env::temp_dir().join("turnwise-bm25-bench"),
        queries: 5000,
        k: 3,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--dir" => args.dir = PathBuf::from(it.next().expect("--dir DIR")),
            "--queries" => args.queries = it.next().expect("--queries N").parse().expect("N"),
            "--k" => args.k = it.next().expect("--k K").parse().expect("K"),
            "--bench" => {} // passed by `cargo bench`
            other => eprintln!("ignoring argument {other}"),
        }
    }
    args
}

/// Five consecutive words from random documents' texts (deterministic).
fn phrase_queries(docs: &[Document], n: usize, seed: u64) -> Vec<String> {
    let mut rng = SplitMix64::new(seed);
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let doc = rng.pick(docs);
        let words: Vec<&str> = split_contents(&doc.contents).1.split_whitespace().collect();
        if words.len() < 5 {
            continue;
        }
        let start = rng.below(words.len() - 4);
        out.push(words[start..start + 5].join(" "));
    }
    out
}

fn per_second(n: usize, secs: f64) -> f64 {
    n as f64 / secs.max(1e-9)
}

fn bench(name: &str, docs: &[Document], queries: &[String], args: &Args) {
    let dir = &args.dir;
    write_corpus(dir.join(format!("{name}_corpus.jsonl")), docs).expect("write corpus");
    let mut qf = std::fs::File::create(dir.join(format!("{name}_queries.txt"))).unwrap();
    for q in queries {
        writeln!(qf, "{}", q.replace('\n', " ")).unwrap();
    }

    let index_dir = dir.join(format!("{name}_index"));
    if index_dir.exists() {
        std::fs::remove_dir_all(&index_dir).unwrap();
    }
    let t = Instant::now();
    drop(Bm25Index::build(&index_dir, docs, &Bm25BuildOptions::default()).expect("build"));
    let build_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let index = Bm25Index::open(&index_dir).expect("open");
    let open_ms = t.elapsed().as_secs_f64() * 1e3;

    // Warm up, then one query at a time on one thread.
    for q in queries.iter().take(200) {
        index.search(q, args.k).unwrap();
    }
    let t = Instant::now();
    let mut topk = Vec::with_capacity(queries.len());
    for q in queries {
        topk.push(index.search(q, args.k).unwrap());
    }
    let single_qps = per_second(queries.len(), t.elapsed().as_secs_f64());

    let uncached = Bm25Index::open_with_cache(&index_dir, Some(false)).expect("open");
    let t = Instant::now();
    for q in queries {
        std::hint::black_box(uncached.search(q, args.k).unwrap());
    }
    let uncached_qps = per_second(queries.len(), t.elapsed().as_secs_f64());

    let t = Instant::now();
    let batch = index.retrieve(queries, args.k).unwrap();
    let batch_qps = per_second(queries.len(), t.elapsed().as_secs_f64());
    assert_eq!(batch, topk);

    let mem = InMemoryBm25::new(docs.to_vec());
    let n_mem = queries.len().min(2000);
    let t = Instant::now();
    for q in &queries[..n_mem] {
        std::hint::black_box(mem.search(q, args.k));
    }
    let mem_qps = per_second(n_mem, t.elapsed().as_secs_f64());

    let mut tf = std::fs::File::create(dir.join(format!("{name}_rust_topk.jsonl"))).unwrap();
    for hits in &topk {
        let ids: Vec<&str> = hits.iter().map(|h| h.document.id.as_str()).collect();
        writeln!(tf, "{}", serde_json::to_string(&ids).unwrap()).unwrap();
    }
    let summary = serde_json::json!({
        "corpus": name,
        "docs": docs.len(),
        "queries": queries.len(),
        "k": args.k,
        "build_s": build_s,
        "open_ms": open_ms,
        "tantivy_qps_1thread": single_qps,
        "tantivy_qps_batch_all_threads": batch_qps,
        "tantivy_qps_1thread_docs_from_disk": uncached_qps,
        "in_memory_qps_1thread": mem_qps,
    });
    std::fs::write(dir.join(format!("{name}_rust.json")), summary.to_string()).unwrap();
    println!(
        "{name}: {} docs, {} queries, top-{}: build {build_s:.2} s, reopen {open_ms:.1} ms, \
         tantivy {single_qps:.0} q/s (1 thread; {uncached_qps:.0} with documents read from \
         disk), {batch_qps:.0} q/s (batch, all threads), in-memory {mem_qps:.0} q/s",
        docs.len(),
        queries.len(),
        args.k
    );
}

fn main() {
    let args = parse_args();
    std::fs::create_dir_all(&args.dir).expect("create bench dir");
    println!("writing bench data to {}", args.dir.display());

    match wiki::load_corpus(wiki::default_cache_dir()) {
        Ok(docs) => {
            let queries = phrase_queries(&docs, args.queries, 1);
            bench("wiki", &docs, &queries, &args);
        }
        Err(e) => println!("wiki corpus skipped: {e}"),
    }

    let world = World::generate(&WorldConfig::default()).expect("world");
    let docs = world.documents();
    let queries: Vec<String> = world
        .questions
        .iter()
        .map(|q| q.text.clone())
        .cycle()
        .take(args.queries)
        .collect();
    bench("world", &docs, &queries, &args);
}
