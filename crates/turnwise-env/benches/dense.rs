//! Dense retrieval throughput against sentence-transformers, side by side from one run.
//!
//! ```text
//! cargo bench -p turnwise-env --bench dense -- [--dir DIR] [--passages N] [--queries N]
//!     [--rows R] [--threads T] [--python PY]
//! ```
//!
//! - **encode**: passages/s of all-MiniLM-L6-v2 on `N` passages (default 512: Wikipedia vital
//!   article summaries, `title + " " + text`, truncated at 256 tokens) in batches of 32, and the
//!   same for `N` short queries (five consecutive words of a summary);
//! - **search**: queries/s of exact top-10 inner-product search over an `R × 384` matrix
//!   (default 100,000 rows: the passage embeddings, each repeated with small noise and
//!   renormalised), memory-mapped from a [`DenseIndex`] on disk; one query at a time, and in
//!   batches of 100. Query embeddings are encoded once up front, so this times search only.
//!
//! Both sides use `T` threads (default 2: `RAYON_NUM_THREADS` here, `torch.set_num_threads`
//! there). The bench writes the texts, the matrix and the query vectors into `DIR` (default
//! `<temp>/turnwise-dense-bench`), runs `PY benches/dense_st.py DIR` (PY: `--python`, else
//! `$TURNWISE_ST_PYTHON`, else `python3`; it needs `sentence-transformers`), and prints both
//! sides, the ratio turnwise / sentence-transformers, the largest embedding difference and the
//! top-1 agreement. Without sentence-transformers it prints the turnwise figures alone.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use turnwise_env::corpus::{split_contents, wiki};
use turnwise_env::search::Document;
use turnwise_env::search::bm25_mem::indexed_text;
use turnwise_env::search::dense::{DenseIndex, Embeddings, SentenceEncoder};
use turnwise_env::world::rng::SplitMix64;
use turnwise_env::world::{World, WorldConfig};

const BATCH: usize = 32;
const K: usize = 10;
const SEARCH_BATCH: usize = 100;

struct Args {
    dir: PathBuf,
    passages: usize,
    queries: usize,
    rows: usize,
    threads: usize,
    python: String,
}

fn parse_args() -> Args {
    let mut args = Args {
        dir: std::env::temp_dir().join("turnwise-dense-bench"),
        passages: 512,
        queries: 512,
        rows: 100_000,
        threads: 2,
        python: std::env::var("TURNWISE_ST_PYTHON").unwrap_or_else(|_| "python3".into()),
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().unwrap_or_else(|| panic!("{name} needs a value"));
        match a.as_str() {
            "--dir" => args.dir = PathBuf::from(value("--dir")),
            "--passages" => args.passages = value("--passages").parse().expect("N"),
            "--queries" => args.queries = value("--queries").parse().expect("N"),
            "--rows" => args.rows = value("--rows").parse().expect("R"),
            "--threads" => args.threads = value("--threads").parse().expect("T"),
            "--python" => args.python = value("--python"),
            "--bench" => {} // passed by `cargo bench`
            other => eprintln!("ignoring argument {other}"),
        }
    }
    args
}

fn per_second(n: usize, secs: f64) -> f64 {
    n as f64 / secs.max(1e-9)
}

fn write_f32(path: &Path, data: &[f32]) {
    let mut bytes = Vec::with_capacity(data.len() * 4);
    for x in data {
        bytes.extend_from_slice(&x.to_le_bytes());
    }
    std::fs::write(path, bytes).expect("write f32 file");
}

fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .expect("read f32 file")
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn write_lines(path: &Path, texts: &[String]) {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    for t in texts {
        writeln!(f, "{}", serde_json::to_string(t).unwrap()).unwrap();
    }
}

/// Passages and phrase queries from the wiki corpus (or the default world when it is missing).
fn texts(args: &Args) -> (String, Vec<String>, Vec<String>) {
    let (name, docs): (&str, Vec<Document>) = match wiki::load_corpus(wiki::default_cache_dir()) {
        Ok(docs) => ("wiki", docs),
        Err(e) => {
            println!("wiki corpus unavailable ({e}); using the generated world");
            let world = World::generate(&WorldConfig::default()).expect("world");
            ("world", world.documents())
        }
    };
    let mut rng = SplitMix64::new(1);
    let mut order: Vec<usize> = (0..docs.len()).collect();
    rng.shuffle(&mut order);
    let passages: Vec<String> = order
        .iter()
        .cycle()
        .take(args.passages)
        .map(|&i| indexed_text(&docs[i]))
        .collect();
    let mut queries = Vec::with_capacity(args.queries);
    while queries.len() < args.queries {
        let words: Vec<&str> = split_contents(&rng.pick(&docs).contents)
            .1
            .split_whitespace()
            .collect();
        if words.len() >= 5 {
            let s = rng.below(words.len() - 4);
            queries.push(words[s..s + 5].join(" "));
        }
    }
    (name.to_string(), passages, queries)
}

/// `rows` unit vectors: the passage embeddings, repeated with Gaussian-ish noise.
fn search_matrix(passages: &Embeddings, rows: usize) -> Vec<f32> {
    let dim = passages.dim;
    let mut rng = SplitMix64::new(2);
    let mut out = Vec::with_capacity(rows * dim);
    for r in 0..rows {
        let base = passages.row(r % passages.len());
        let noise = if r < passages.len() { 0.0 } else { 0.03 };
        let row: Vec<f32> = base
            .iter()
            .map(|&x| x + noise * ((rng.unit() + rng.unit() + rng.unit()) as f32 - 1.5))
            .collect();
        let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt();
        out.extend(row.iter().map(|x| x / norm));
    }
    out
}

struct Side {
    encode_passages: f64,
    encode_queries: f64,
    search_single: f64,
    search_batch: f64,
}

fn main() {
    let args = parse_args();
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // SAFETY: single-threaded here: no other thread exists yet to read the environment.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", args.threads.to_string()) };
    }
    let threads: usize = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(args.threads);
    if args.dir.exists() {
        std::fs::remove_dir_all(&args.dir).expect("clear bench dir");
    }
    std::fs::create_dir_all(&args.dir).expect("create bench dir");
    println!("writing bench data to {}", args.dir.display());

    let encoder = Arc::new(SentenceEncoder::from_default_cache().expect("encoder"));
    let (corpus, passages, queries) = texts(&args);
    let mean_tokens = passages
        .iter()
        .map(|p| encoder.token_ids(p).unwrap().len())
        .sum::<usize>() as f64
        / passages.len() as f64;

    // Encoding.
    encoder
        .encode(&passages[..(2 * BATCH).min(passages.len())])
        .unwrap(); // warm-up
    let t = Instant::now();
    let pemb = encoder.encode(&passages).unwrap();
    let encode_passages = per_second(passages.len(), t.elapsed().as_secs_f64());
    let t = Instant::now();
    let qemb = encoder.encode(&queries).unwrap();
    let encode_queries = per_second(queries.len(), t.elapsed().as_secs_f64());

    // Search over a memory-mapped index.
    let matrix = search_matrix(&pemb, args.rows.max(pemb.len()));
    let rows = matrix.len() / pemb.dim;
    let docs: Vec<Document> = (0..rows)
        .map(|i| Document {
            id: i.to_string(),
            contents: String::new(),
        })
        .collect();
    let index_dir = args.dir.join("index");
    let emb = Embeddings {
        dim: pemb.dim,
        data: matrix,
    };
    DenseIndex::write(&index_dir, &docs, &emb, "bench").unwrap();
    let index = DenseIndex::open(&index_dir, encoder.clone()).unwrap();
    let n_single = queries.len();
    let one = |i: usize| Embeddings {
        dim: qemb.dim,
        data: qemb.row(i).to_vec(),
    };
    index.search_embeddings(&one(0), K).unwrap(); // warm-up (pages the map in)
    let t = Instant::now();
    for i in 0..n_single {
        std::hint::black_box(index.search_embeddings(&one(i), K).unwrap());
    }
    let search_single = per_second(n_single, t.elapsed().as_secs_f64());
    let t = Instant::now();
    let mut top1 = Vec::with_capacity(qemb.len());
    for chunk in qemb.data.chunks(SEARCH_BATCH * qemb.dim) {
        let part = Embeddings {
            dim: qemb.dim,
            data: chunk.to_vec(),
        };
        for hits in index.search_embeddings(&part, K).unwrap() {
            top1.push(hits[0].0);
        }
    }
    let search_batch = per_second(qemb.len(), t.elapsed().as_secs_f64());
    let ours = Side {
        encode_passages,
        encode_queries,
        search_single,
        search_batch,
    };

    // sentence-transformers on the same data.
    write_lines(&args.dir.join("passages.jsonl"), &passages);
    write_lines(&args.dir.join("queries.jsonl"), &queries);
    write_f32(&args.dir.join("matrix.f32"), &emb.data);
    write_f32(&args.dir.join("queries.f32"), &qemb.data);
    let meta = serde_json::json!({
        "model_dir": encoder.model_dir(),
        "dim": pemb.dim,
        "rows": rows,
        "k": K,
        "batch_size": BATCH,
        "search_batch": SEARCH_BATCH,
        "single_queries": n_single,
        "threads": threads,
    });
    std::fs::write(args.dir.join("meta.json"), meta.to_string()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/dense_st.py");
    let status = Command::new(&args.python)
        .arg(&script)
        .arg(&args.dir)
        .status();
    let theirs = match status {
        Ok(s) if s.success() => {
            let st: serde_json::Value =
                serde_json::from_slice(&std::fs::read(args.dir.join("st.json")).unwrap()).unwrap();
            let f = |key: &str| st[key].as_f64().unwrap_or(f64::NAN);
            let st_emb = read_f32(&args.dir.join("st_passages.f32"));
            let max_diff = st_emb
                .iter()
                .zip(&pemb.data)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            let agree = st["top1"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .zip(&top1)
                        .filter(|(x, y)| x.as_u64() == Some(**y as u64))
                        .count()
                })
                .unwrap_or(0);
            println!(
                "parity: max |turnwise − sentence-transformers| over {} passage embeddings = \
                 {max_diff:.2e}; top-1 search agreement {agree}/{}; {}",
                pemb.len(),
                top1.len(),
                st["versions"].as_str().unwrap_or("?")
            );
            Some(Side {
                encode_passages: f("encode_passages_per_s"),
                encode_queries: f("encode_queries_per_s"),
                search_single: f("search_single_qps"),
                search_batch: f("search_batch_qps"),
            })
        }
        Ok(s) => {
            println!("sentence-transformers side failed ({s}); run with --python PY");
            None
        }
        Err(e) => {
            println!(
                "cannot run {} ({e}); sentence-transformers side skipped",
                args.python
            );
            None
        }
    };

    println!(
        "\nall-MiniLM-L6-v2, {corpus} corpus, {threads} threads: {} passages (mean {mean_tokens:.0} \
         tokens), {} queries, search over {rows} × {} rows, top-{K}",
        passages.len(),
        queries.len(),
        pemb.dim
    );
    println!(
        "| {:<40} | {:>12} | {:>21} | {:>7} |",
        "measure", "turnwise", "sentence-transformers", "ratio"
    );
    println!("|{:-<42}|{:->14}|{:->23}|{:->9}|", "", "", "", "");
    let rows_out = [
        (
            format!("encode passages/s (batch {BATCH})"),
            ours.encode_passages,
            theirs.as_ref().map(|s| s.encode_passages),
        ),
        (
            format!("encode queries/s (batch {BATCH})"),
            ours.encode_queries,
            theirs.as_ref().map(|s| s.encode_queries),
        ),
        (
            "search queries/s (one at a time)".to_string(),
            ours.search_single,
            theirs.as_ref().map(|s| s.search_single),
        ),
        (
            format!("search queries/s (batches of {SEARCH_BATCH})"),
            ours.search_batch,
            theirs.as_ref().map(|s| s.search_batch),
        ),
    ];
    for (name, a, b) in rows_out {
        match b {
            Some(b) => println!("| {name:<40} | {a:>12.1} | {b:>21.1} | {:>6.2}× |", a / b),
            None => println!("| {name:<40} | {a:>12.1} | {:>21} | {:>7} |", "-", "-"),
        }
    }
}
