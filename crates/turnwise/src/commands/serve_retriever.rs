//! `turnwise serve-retriever`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use turnwise_env::search::bm25::Bm25Index;
use turnwise_env::server::{ServerConfig, resolve_addr, serve};

use super::common::tokio_runtime;

/// Serve a BM25 index with Search-R1's retrieval protocol (POST /retrieve, GET /health).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Index directory built by `turnwise index`.
    #[arg(long)]
    index: PathBuf,
    /// Address to bind, HOST:PORT (`localhost:8000` resolves to its first IPv4 address).
    /// Anything but loopback exposes the corpus to the network.
    #[arg(long, default_value = "127.0.0.1:8000")]
    addr: String,
    /// Default top-k when a request omits it (or sends null or 0).
    #[arg(long, default_value_t = 3)]
    topk: usize,
    /// Most queries in one request (Search-R1 sends a whole turn's searches at once:
    /// train_batch_size × n_agent, 2,560 with its defaults).
    #[arg(long, default_value_t = turnwise_env::server::DEFAULT_MAX_QUERIES)]
    max_queries: usize,
    /// Largest request body in bytes (default 16 MiB).
    #[arg(long, default_value_t = turnwise_env::server::DEFAULT_MAX_BODY_BYTES)]
    max_body_bytes: usize,
    /// Seconds a client may take to send a request's headers, and then its body, before
    /// the connection is closed.
    #[arg(long, default_value_t = turnwise_env::server::DEFAULT_READ_TIMEOUT.as_secs_f64())]
    read_timeout_secs: f64,
    /// Most results in one answer, queries × topk (422 beyond).
    #[arg(long, default_value_t = turnwise_env::server::DEFAULT_MAX_RESULTS)]
    max_results: usize,
    /// Largest answer in bytes (422 once an answer grows past it; default 64 MiB).
    #[arg(long, default_value_t = turnwise_env::server::DEFAULT_MAX_RESPONSE_BYTES)]
    max_response_bytes: usize,
}

/// Runs `turnwise serve-retriever`.
pub fn exec(args: Args) -> Result<()> {
    let Args {
        index,
        addr,
        topk,
        max_queries,
        max_body_bytes,
        read_timeout_secs,
        max_results,
        max_response_bytes,
    } = args;
    let addr = resolve_addr(&addr).context("--addr")?;
    let read_timeout = Duration::try_from_secs_f64(read_timeout_secs)
        .ok()
        .filter(|t| !t.is_zero())
        .with_context(|| {
            format!("--read-timeout-secs must be positive, got {read_timeout_secs}")
        })?;
    let index = Bm25Index::open(&index)
        .with_context(|| format!("opening the index {}", index.display()))?;
    let config = ServerConfig {
        addr,
        default_topk: topk,
        max_queries,
        max_body_bytes,
        read_timeout,
        max_results,
        max_response_bytes,
        ..ServerConfig::default()
    };
    if max_results == 0 || max_response_bytes == 0 {
        bail!("--max-results and --max-response-bytes must be at least 1");
    }
    turnwise::serve::memory::release_when_idle();
    let runtime = tokio_runtime()?;
    runtime
        .block_on(serve(
            Arc::new(index),
            config,
            |bound| println!("serving on http://{bound} (Ctrl-C stops)"),
            async {
                let _ = tokio::signal::ctrl_c().await;
            },
        ))
        .context("serving")?;
    Ok(())
}
