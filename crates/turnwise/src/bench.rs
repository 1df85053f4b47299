//! `turnwise bench`: the built-in throughput benchmark, for users without a Rust toolchain.
//!
//! - **Model** (per size): training tokens/s of one step on a batch of 8 × 256 tokens (forward,
//!   per-token log-probs and entropy, backward of `−mean log-prob − 0.001·mean entropy`,
//!   global-norm clipping and one AdamW update: what an RL update does), and sampling tokens/s at
//!   batch 1, 8 and 64 (16-token prompts, 64 new tokens at temperature 1, prefill included).
//!   Sizes A and B are the Qwen2-style shapes of `crates/turnwise-model/benches/model.rs`, which
//!   measures the same library calls side by side with PyTorch.
//! - **Environment**: BM25 queries/s of the tantivy index over a generated world (one query at a
//!   time on one thread, and one batch over all threads), and requests/s of the Search-R1
//!   retrieval server on loopback under 1 to 32 concurrent HTTP clients (one query per request,
//!   top-3), as `crates/turnwise-env/benches/{bm25,server}.rs` measure them.
//!
//! Figures are medians over repeated runs after a warm-up; `quick` runs fewer repetitions (and
//! shorter server runs) and is noisier. Everything runs on the CPU in f32, like training.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use candle_core::{DType, Device, Tensor};
use serde::Serialize;
use turnwise_env::client::HttpRetriever;
use turnwise_env::search::Retriever;
use turnwise_env::search::bm25::{Bm25BuildOptions, Bm25Index};
use turnwise_env::server::{BackgroundServer, ServerConfig};
use turnwise_env::world::{World, WorldConfig};
use turnwise_model::logprobs::logprobs_and_entropy;
use turnwise_model::model::weights::{init_varmap, sorted_vars};
use turnwise_model::optim::{AdamW, AdamWConfig, Gradients};
use turnwise_model::sampling::{SamplingParams, generate};
use turnwise_model::{ModelConfig, Transformer};

/// Rows of the training batch.
pub const TRAIN_BATCH: usize = 8;
/// Tokens per row of the training batch.
pub const TRAIN_LEN: usize = 256;
/// Prompt tokens per sampled row.
pub const PROMPT_LEN: usize = 16;
/// Tokens generated per sampled row.
pub const NEW_TOKENS: usize = 64;
/// Sampling batch sizes.
pub const SAMPLE_BATCHES: [usize; 3] = [1, 8, 64];
/// Passages returned per query.
pub const TOPK: usize = 3;

/// One model shape of the benchmark (Qwen2 layout, tied embeddings).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelSize {
    /// Name (`A`, `B`, `Q`, `tiny`).
    pub name: String,
    /// Hidden size.
    pub hidden: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Feed-forward size.
    pub intermediate: usize,
    /// Vocabulary.
    pub vocab: usize,
}

impl ModelSize {
    /// The named sizes: `A` (hidden 256, 4 layers, 4/2 heads, intermediate 768, vocab 4096),
    /// `B` (hidden 512, 8 layers, 8/2 heads, intermediate 1536, vocab 8192) and `tiny` (hidden
    /// 32, 2 layers, 4/2 heads, intermediate 64, vocab 256: seconds, for tests); `Q` is the
    /// quickstart's model (hidden 128, 4 layers, 4/2 heads, intermediate 384, vocab 467).
    pub fn named(name: &str) -> Result<Self> {
        let s = |name: &str, hidden, layers, heads, kv_heads, intermediate, vocab| Self {
            name: name.into(),
            hidden,
            layers,
            heads,
            kv_heads,
            intermediate,
            vocab,
        };
        Ok(match name.trim().to_ascii_lowercase().as_str() {
            "a" => s("A", 256, 4, 4, 2, 768, 4096),
            "b" => s("B", 512, 8, 8, 2, 1536, 8192),
            "q" => s("Q", 128, 4, 4, 2, 384, 467),
            "tiny" => s("tiny", 32, 2, 4, 2, 64, 256),
            _ => bail!("unknown model size {name:?}: expected A, B, Q or tiny"),
        })
    }

    /// The model configuration of this size.
    pub fn config(&self) -> ModelConfig {
        let mut c = ModelConfig::tiny_qwen2(self.vocab);
        c.hidden_size = self.hidden;
        c.num_hidden_layers = self.layers;
        c.num_attention_heads = self.heads;
        c.num_key_value_heads = self.kv_heads;
        c.head_dim = self.hidden / self.heads;
        c.intermediate_size = self.intermediate;
        c.max_position_embeddings = 512;
        c
    }
}

/// What to measure.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchOptions {
    /// Fewer repetitions and shorter server runs.
    pub quick: bool,
    /// Model sizes to measure (empty: skip the model part).
    pub sizes: Vec<ModelSize>,
    /// Measure BM25 and the retrieval server.
    pub env: bool,
    /// The world whose passages are indexed and whose questions are the queries.
    pub world: WorldConfig,
}

impl BenchOptions {
    /// Everything: sizes A and B, the environment on the default world, full repetitions.
    pub fn full() -> Self {
        Self {
            quick: false,
            sizes: vec![
                ModelSize::named("A").expect("size A"),
                ModelSize::named("B").expect("size B"),
            ],
            env: true,
            world: WorldConfig::default(),
        }
    }

    fn train_steps(&self) -> usize {
        if self.quick { 2 } else { 5 }
    }

    fn sample_reps(&self) -> usize {
        if self.quick { 1 } else { 3 }
    }

    fn bm25_queries(&self) -> usize {
        if self.quick { 500 } else { 5000 }
    }

    fn server_clients(&self) -> Vec<usize> {
        if self.quick {
            vec![1, 8]
        } else {
            vec![1, 8, 32]
        }
    }

    fn server_seconds(&self) -> f64 {
        if self.quick { 1.0 } else { 4.0 }
    }
}

/// Sampling throughput at one batch size.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SampleFigure {
    /// Rows sampled together.
    pub batch: usize,
    /// Generated tokens per second.
    pub tokens_per_s: f64,
}

/// The figures of one model size.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelFigures {
    /// The size.
    pub size: ModelSize,
    /// Parameters.
    pub parameters: usize,
    /// Training tokens per second (batch [`TRAIN_BATCH`] × [`TRAIN_LEN`]).
    pub train_tokens_per_s: f64,
    /// Median seconds of one training step.
    pub train_step_s: f64,
    /// Median seconds of the trainer's own step on the same batch as one shard on one thread.
    pub trainer_step_one_shard_s: f64,
    /// The same, its rows cut into one shard per core ([`Self::trainer_shards`]).
    pub trainer_step_sharded_s: f64,
    /// Shards of the sharded trainer step.
    pub trainer_shards: usize,
    /// Sampling throughput per batch size.
    pub sample: Vec<SampleFigure>,
}

/// The retrieval server under `clients` concurrent clients.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServerFigure {
    /// Concurrent clients.
    pub clients: usize,
    /// Requests answered in the timed window.
    pub requests: usize,
    /// Requests that failed.
    pub errors: usize,
    /// Answered requests per second.
    pub requests_per_s: f64,
    /// Median latency in milliseconds.
    pub p50_ms: f64,
    /// 99th-percentile latency in milliseconds.
    pub p99_ms: f64,
}

/// The environment figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EnvFigures {
    /// Passages indexed.
    pub documents: usize,
    /// Queries timed (question texts of the world).
    pub queries: usize,
    /// Passages per query.
    pub topk: usize,
    /// Seconds to build the BM25 index.
    pub index_build_s: f64,
    /// BM25 queries per second, one at a time on one thread.
    pub bm25_queries_per_s: f64,
    /// BM25 queries per second, all queries in one batch over every thread.
    pub bm25_batch_queries_per_s: f64,
    /// The HTTP retrieval server, per client count.
    pub server: Vec<ServerFigure>,
}

/// Everything one benchmark run measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BenchReport {
    /// `quick` or `full`.
    pub mode: String,
    /// Threads of the matrix products (`RAYON_NUM_THREADS`).
    pub matmul_threads: String,
    /// Threads of candle's element-wise kernels (`CANDLE_NUM_THREADS`).
    pub elementwise_threads: String,
    /// Logical cores of the machine.
    pub cores: usize,
    /// Per model size.
    pub model: Vec<ModelFigures>,
    /// The environment part, when measured.
    pub env: Option<EnvFigures>,
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        0.5 * (xs[n / 2 - 1] + xs[n / 2])
    }
}

/// Median seconds of one training step of `cfg` on [`TRAIN_BATCH`] × [`TRAIN_LEN`] tokens over
/// `steps` timed steps after one warm-up step.
pub fn train_step_seconds(cfg: &ModelConfig, steps: usize) -> Result<f64> {
    let dev = Device::Cpu;
    let vm = init_varmap(cfg, DType::F32, &dev, 0)?;
    let model = Transformer::from_varmap(cfg, &vm)?;
    let mut opt = AdamW::new(sorted_vars(&vm), AdamWConfig::default())?;
    let n = TRAIN_BATCH * (TRAIN_LEN + 1);
    let toks: Vec<u32> = (0..n)
        .map(|i| ((i * 7919 + 13) % cfg.vocab_size) as u32)
        .collect();
    let all = Tensor::from_vec(toks, (TRAIN_BATCH, TRAIN_LEN + 1), &dev)?;
    let ids = all.narrow(1, 0, TRAIN_LEN)?;
    let targets = all.narrow(1, 1, TRAIN_LEN)?;
    let pos = Tensor::arange(0u32, TRAIN_LEN as u32, &dev)?
        .unsqueeze(0)?
        .repeat((TRAIN_BATCH, 1))?;
    let mask = Tensor::ones((TRAIN_BATCH, TRAIN_LEN), DType::U32, &dev)?;
    let mut times = Vec::with_capacity(steps);
    for step in 0..=steps {
        let t0 = Instant::now();
        let (logp, ent) = logprobs_and_entropy(&model, &ids, &pos, &mask, &targets)?;
        let loss = (logp.mean_all()?.neg()? - (ent.mean_all()? * 1e-3)?)?;
        let value = f64::from(loss.to_scalar::<f32>()?);
        if !value.is_finite() {
            bail!("the benchmark's training loss is not finite ({value})");
        }
        let grads = Gradients::from_grad_store(&loss.backward()?, opt.vars());
        let norm = grads.global_norm()?;
        opt.step_scaled(&grads, 1e-4, Gradients::clip_factor(norm, 1.0))?;
        if step > 0 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(median(times))
}

/// Median seconds of one step of the trainer's own supervised update
/// ([`crate::update::sft_step`]) of `cfg` on [`TRAIN_BATCH`] rows of [`TRAIN_LEN`] tokens, over
/// `steps` timed steps after one warm-up step, on a pool of `threads` threads: the rows are cut
/// into one shard per thread ([`crate::shard`]), so `threads = 1` is the step without
/// data parallelism.
pub fn trainer_step_seconds(cfg: &ModelConfig, steps: usize, threads: usize) -> Result<f64> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
        .context("building the benchmark's thread pool")?;
    let dev = Device::Cpu;
    let vm = init_varmap(cfg, DType::F32, &dev, 0)?;
    let model = Transformer::from_varmap(cfg, &vm)?;
    let mut opt = AdamW::new(sorted_vars(&vm), AdamWConfig::default())?;
    let rows: Vec<crate::update::Row> = (0..TRAIN_BATCH)
        .map(|b| {
            let toks: Vec<u32> = (0..TRAIN_LEN)
                .map(|i| ((b * TRAIN_LEN + i) * 7919 % cfg.vocab_size) as u32)
                .collect();
            let (prompt, response) = toks.split_at(PROMPT_LEN);
            let n = response.len();
            crate::update::Row::new(prompt.to_vec(), response.to_vec(), vec![1; n], vec![0; n])
        })
        .collect();
    let refs: Vec<&crate::update::Row> = rows.iter().collect();
    let mut times = Vec::with_capacity(steps);
    for step in 0..=steps {
        let t0 = Instant::now();
        let out = pool.install(|| crate::update::sft_step(&model, &mut opt, &refs, 1e-4, 1.0))?;
        if out.is_none() {
            bail!("the benchmark's trainer step was not finite");
        }
        if step > 0 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(median(times))
}

/// Generated tokens per second of `cfg` at `batch` rows ([`PROMPT_LEN`]-token prompts,
/// [`NEW_TOKENS`] new tokens each): median over `reps` timed runs after one warm-up run.
pub fn sample_tokens_per_s(cfg: &ModelConfig, batch: usize, reps: usize) -> Result<f64> {
    let vm = init_varmap(cfg, DType::F32, &Device::Cpu, 0)?;
    let model = Transformer::detached_from_varmap(cfg, &vm)?;
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|b| {
            (0..PROMPT_LEN)
                .map(|i| ((b * 131 + i * 17 + 1) % cfg.vocab_size) as u32)
                .collect()
        })
        .collect();
    let seeds: Vec<u64> = (0..batch as u64).collect();
    let params = SamplingParams {
        temperature: 1.0,
        max_new_tokens: NEW_TOKENS,
        ..Default::default()
    };
    let mut rates = Vec::with_capacity(reps);
    for rep in 0..=reps {
        let t0 = Instant::now();
        let out = generate(&model, &prompts, &seeds, &params, None)?;
        let dt = t0.elapsed().as_secs_f64();
        let n: usize = out.iter().map(|c| c.tokens.len()).sum();
        if n == 0 {
            bail!("sampling generated no token");
        }
        if rep > 0 {
            rates.push(n as f64 / dt.max(1e-9));
        }
    }
    Ok(median(rates))
}

fn model_figures(size: &ModelSize, opts: &BenchOptions) -> Result<ModelFigures> {
    let cfg = size.config();
    cfg.validate()
        .with_context(|| format!("model size {}", size.name))?;
    let step = train_step_seconds(&cfg, opts.train_steps())
        .with_context(|| format!("training benchmark of size {}", size.name))?;
    let train = (TRAIN_BATCH * TRAIN_LEN) as f64 / step;
    tracing::info!(size = %size.name, tokens_per_s = train.round(), "training measured");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let trainer_step_one = trainer_step_seconds(&cfg, opts.train_steps(), 1)
        .with_context(|| format!("trainer-step benchmark of size {}", size.name))?;
    let trainer_step_sharded = trainer_step_seconds(&cfg, opts.train_steps(), cores)
        .with_context(|| format!("trainer-step benchmark of size {}", size.name))?;
    tracing::info!(
        size = %size.name,
        one_shard_s = trainer_step_one,
        sharded_s = trainer_step_sharded,
        "trainer step measured"
    );
    let mut sample = Vec::new();
    for &batch in &SAMPLE_BATCHES {
        let s = sample_tokens_per_s(&cfg, batch, opts.sample_reps()).with_context(|| {
            format!("sampling benchmark of size {} at batch {batch}", size.name)
        })?;
        tracing::info!(size = %size.name, batch, tokens_per_s = s.round(), "sampling measured");
        sample.push(SampleFigure {
            batch,
            tokens_per_s: s,
        });
    }
    Ok(ModelFigures {
        size: size.clone(),
        parameters: cfg.num_parameters(),
        train_tokens_per_s: train,
        train_step_s: step,
        trainer_step_one_shard_s: trainer_step_one,
        trainer_step_sharded_s: trainer_step_sharded,
        trainer_shards: cores.min(TRAIN_BATCH),
        sample,
    })
}

/// A temporary index directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Result<Self> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir =
            std::env::temp_dir().join(format!("turnwise-bench-{}-{nanos:09}", std::process::id()));
        if dir.exists() {
            std::fs::remove_dir_all(&dir).with_context(|| format!("clearing {}", dir.display()))?;
        }
        Ok(Self(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if self.0.exists()
            && let Err(e) = std::fs::remove_dir_all(&self.0)
        {
            tracing::warn!(dir = %self.0.display(), error = %e, "could not remove the bench index");
        }
    }
}

fn percentile_ms(sorted_us: &[u64], p: f64) -> f64 {
    if sorted_us.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted_us.len() as f64 - 1.0) * p).round() as usize;
    sorted_us[i] as f64 / 1000.0
}

/// `clients` threads, each with its own keep-alive HTTP client, send one-query requests back
/// to back for `seconds` (after one warm-up request each).
fn server_figure(
    url: &str,
    queries: &[String],
    clients: usize,
    seconds: f64,
) -> Result<ServerFigure> {
    let http: Vec<HttpRetriever> = (0..clients)
        .map(|_| HttpRetriever::new(url).context("building an HTTP client"))
        .collect::<Result<_>>()?;
    for (c, client) in http.iter().enumerate() {
        client
            .retrieve(std::slice::from_ref(&queries[c % queries.len()]), TOPK)
            .context("warm-up request to the retrieval server")?;
    }
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(seconds);
    let results: Vec<(Vec<u64>, usize)> = std::thread::scope(|s| {
        let handles: Vec<_> = http
            .iter()
            .enumerate()
            .map(|(c, client)| {
                s.spawn(move || {
                    let mut latencies = Vec::new();
                    let mut errors = 0;
                    let mut i = c * 7919;
                    while Instant::now() < deadline {
                        let q = std::slice::from_ref(&queries[i % queries.len()]);
                        i += 1;
                        let t = Instant::now();
                        match client.retrieve(q, TOPK) {
                            Ok(hits) if hits.len() == 1 => {
                                latencies.push(t.elapsed().as_micros() as u64)
                            }
                            _ => errors += 1,
                        }
                    }
                    (latencies, errors)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| (Vec::new(), usize::MAX)))
            .collect()
    });
    let secs = start.elapsed().as_secs_f64();
    if results.iter().any(|r| r.1 == usize::MAX) {
        bail!("a benchmark client thread panicked");
    }
    let mut lat: Vec<u64> = results.iter().flat_map(|r| r.0.iter().copied()).collect();
    lat.sort_unstable();
    let errors = results.iter().map(|r| r.1).sum();
    Ok(ServerFigure {
        clients,
        requests: lat.len(),
        errors,
        requests_per_s: lat.len() as f64 / secs,
        p50_ms: percentile_ms(&lat, 0.5),
        p99_ms: percentile_ms(&lat, 0.99),
    })
}

fn env_figures(opts: &BenchOptions) -> Result<EnvFigures> {
    let world = World::generate(&opts.world).context("generating the benchmark world")?;
    let docs = world.documents();
    if world.questions.is_empty() {
        bail!("the benchmark world has no questions to query with");
    }
    let queries: Vec<String> = world
        .questions
        .iter()
        .map(|q| q.text.clone())
        .cycle()
        .take(opts.bm25_queries())
        .collect();
    let dir = TempDir::new()?;
    let t = Instant::now();
    let index = Bm25Index::build(&dir.0, &docs, &Bm25BuildOptions::default())
        .with_context(|| format!("building the BM25 index in {}", dir.0.display()))?;
    let index_build_s = t.elapsed().as_secs_f64();

    // One query at a time on this thread, after a warm-up.
    for q in queries.iter().take(100) {
        index.search(q, TOPK)?;
    }
    let t = Instant::now();
    for q in &queries {
        std::hint::black_box(index.search(q, TOPK)?);
    }
    let single = queries.len() as f64 / t.elapsed().as_secs_f64().max(1e-9);
    tracing::info!(queries_per_s = single.round(), "BM25 measured (one thread)");
    let t = Instant::now();
    let batch = index.retrieve(&queries, TOPK)?;
    let batch_qps = queries.len() as f64 / t.elapsed().as_secs_f64().max(1e-9);
    if batch.len() != queries.len() {
        bail!("BM25 answered {} of {} queries", batch.len(), queries.len());
    }
    tracing::info!(queries_per_s = batch_qps.round(), "BM25 measured (batch)");

    let server = BackgroundServer::start(
        Arc::new(index),
        ServerConfig::with_addr(std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
    )
    .context("starting the retrieval server")?;
    let mut figures = Vec::new();
    for clients in opts.server_clients() {
        let f = server_figure(&server.url(), &queries, clients, opts.server_seconds())?;
        tracing::info!(
            clients,
            requests_per_s = f.requests_per_s.round(),
            errors = f.errors,
            "retrieval server measured"
        );
        figures.push(f);
    }
    server.shutdown().context("stopping the retrieval server")?;
    Ok(EnvFigures {
        documents: docs.len(),
        queries: queries.len(),
        topk: TOPK,
        index_build_s,
        bm25_queries_per_s: single,
        bm25_batch_queries_per_s: batch_qps,
        server: figures,
    })
}

/// Runs the benchmark.
pub fn run(opts: &BenchOptions) -> Result<BenchReport> {
    if opts.sizes.is_empty() && !opts.env {
        bail!("nothing to measure: no model size and no environment part");
    }
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| "unset".into());
    let mut report = BenchReport {
        mode: if opts.quick { "quick" } else { "full" }.into(),
        matmul_threads: var("RAYON_NUM_THREADS"),
        elementwise_threads: var("CANDLE_NUM_THREADS"),
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        model: Vec::new(),
        env: None,
    };
    for size in &opts.sizes {
        report.model.push(model_figures(size, opts)?);
    }
    if opts.env {
        report.env = Some(env_figures(opts)?);
    }
    Ok(report)
}

impl BenchReport {
    /// Every figure as `(name, value)`, for checks (`model/A/train_tokens_per_s`, ...).
    pub fn figures(&self) -> Vec<(String, f64)> {
        let mut out = Vec::new();
        for m in &self.model {
            let n = &m.size.name;
            out.push((
                format!("model/{n}/train_tokens_per_s"),
                m.train_tokens_per_s,
            ));
            out.push((
                format!("model/{n}/trainer_step_one_shard_s"),
                m.trainer_step_one_shard_s,
            ));
            out.push((
                format!("model/{n}/trainer_step_sharded_s"),
                m.trainer_step_sharded_s,
            ));
            for s in &m.sample {
                out.push((
                    format!("model/{n}/sample_{}_tokens_per_s", s.batch),
                    s.tokens_per_s,
                ));
            }
        }
        if let Some(e) = &self.env {
            out.push(("env/bm25_queries_per_s".into(), e.bm25_queries_per_s));
            out.push((
                "env/bm25_batch_queries_per_s".into(),
                e.bm25_batch_queries_per_s,
            ));
            for s in &e.server {
                out.push((
                    format!("env/server_{}_clients_requests_per_s", s.clients),
                    s.requests_per_s,
                ));
            }
        }
        out
    }

    /// The results as Markdown tables.
    pub fn table(&self) -> String {
        let mut t = format!(
            "turnwise bench ({} mode; CPU, f32; {} cores; RAYON_NUM_THREADS={} for matmuls, \
             CANDLE_NUM_THREADS={} for element-wise ops)\n",
            self.mode, self.cores, self.matmul_threads, self.elementwise_threads
        );
        if !self.model.is_empty() {
            t.push_str(&format!(
                "\n| model | shape (hidden/layers/heads/ffn/vocab) | parameters | train tok/s \
                 ({TRAIN_BATCH}×{TRAIN_LEN}) | step s | trainer step s, 1 shard → one per core |"
            ));
            for b in SAMPLE_BATCHES {
                t.push_str(&format!(" sample tok/s b={b} |"));
            }
            t.push_str("\n|---|---|---:|---:|---:|---:|");
            t.push_str(&"---:|".repeat(SAMPLE_BATCHES.len()));
            t.push('\n');
            for m in &self.model {
                let s = &m.size;
                t.push_str(&format!(
                    "| {} | {}/{}/{}:{}/{}/{} | {:.2} M | {:.0} | {:.3} |",
                    s.name,
                    s.hidden,
                    s.layers,
                    s.heads,
                    s.kv_heads,
                    s.intermediate,
                    s.vocab,
                    m.parameters as f64 / 1e6,
                    m.train_tokens_per_s,
                    m.train_step_s
                ));
                t.push_str(&format!(
                    " {:.3} → {:.3} ({} shards, {:.2}×) |",
                    m.trainer_step_one_shard_s,
                    m.trainer_step_sharded_s,
                    m.trainer_shards,
                    m.trainer_step_one_shard_s / m.trainer_step_sharded_s.max(1e-12)
                ));
                for f in &m.sample {
                    t.push_str(&format!(" {:.0} |", f.tokens_per_s));
                }
                t.push('\n');
            }
        }
        if let Some(e) = &self.env {
            t.push_str(&format!(
                "\n| retrieval (generated world: {} passages, {} queries, top-{}) | figure |\n|---|---:|\n",
                e.documents, e.queries, e.topk
            ));
            t.push_str(&format!(
                "| BM25 index build | {:.2} s |\n",
                e.index_build_s
            ));
            t.push_str(&format!(
                "| BM25 queries/s, one thread | {:.0} |\n",
                e.bm25_queries_per_s
            ));
            t.push_str(&format!(
                "| BM25 queries/s, one batch over all threads | {:.0} |\n",
                e.bm25_batch_queries_per_s
            ));
            for s in &e.server {
                t.push_str(&format!(
                    "| server requests/s, {} client{} (p50 {:.2} ms, p99 {:.2} ms{}) | {:.0} |\n",
                    s.clients,
                    if s.clients == 1 { "" } else { "s" },
                    s.p50_ms,
                    s.p99_ms,
                    if s.errors > 0 {
                        format!(", {} errors", s.errors)
                    } else {
                        String::new()
                    },
                    s.requests_per_s
                ));
            }
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_the_issue_and_unknown_names_are_refused() {
        let a = ModelSize::named("a").unwrap().config();
        assert_eq!(
            (
                a.hidden_size,
                a.num_hidden_layers,
                a.num_attention_heads,
                a.num_key_value_heads,
                a.intermediate_size,
                a.vocab_size
            ),
            (256, 4, 4, 2, 768, 4096)
        );
        let b = ModelSize::named("B").unwrap().config();
        assert_eq!(
            (
                b.hidden_size,
                b.num_hidden_layers,
                b.num_attention_heads,
                b.num_key_value_heads,
                b.intermediate_size,
                b.vocab_size
            ),
            (512, 8, 8, 2, 1536, 8192)
        );
        a.validate().unwrap();
        b.validate().unwrap();
        let err = ModelSize::named("C").unwrap_err().to_string();
        assert!(err.contains("A, B, Q or tiny"), "{err}");
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
