//! `turnwise serve`: the policy over HTTP, in the wire formats of the inference engines the
//! field runs, so that anything that drives SGLang or vLLM (a remote rollout backend, an
//! LLM-judge reward, an evaluation harness) can drive a turnwise model.
//!
//! Routes ([`http`]):
//! - `POST /generate`: SGLang's native API, token ids in (`input_ids`) and out (`output_ids`,
//!   `meta_info.output_token_logprobs` as `[log-prob, id, null]`, `meta_info.weight_version`);
//! - `POST /v1/completions` and `POST /v1/chat/completions`: OpenAI's, with vLLM's
//!   `return_token_ids` and `return_tokens_as_token_ids`, structured output by choice
//!   (`guided_choice`, or `structured_outputs: {"choice": [...]}`: constrained decoding in the
//!   engine, [`turnwise_model::sampling::choice`]) and, on chat, `add_generation_prompt` /
//!   `continue_final_message` (the final assistant message is continued, not closed) and tool
//!   calls ([`tools`]: `tools` rendered by the chat template, Hermes `<tool_call>` blocks of the
//!   completion answered as `tool_calls`);
//! - `POST /update_weights_from_disk` (a Hugging Face folder of the same architecture, as a
//!   trainer writes after each step), `POST /v1/load_lora_adapter` (vLLM's: a PEFT adapter
//!   merged into the weights the server started with), `GET /get_weight_version`, `GET /health`,
//!   `GET /health_generate`, `GET /get_model_info`, `GET /v1/models`, and
//!   `GET /get_server_info` (queue and engine counters: steps, tokens, the largest batch,
//!   speculative drafts; the prefix cache's hits; tool-call parse counts);
//! - `POST /v1/sessions`, `GET` and `DELETE /v1/sessions/{id}`: recorded sessions
//!   ([`session`]): a request that names one (`X-Session-Id`, or `user` on the OpenAI routes) is
//!   recorded token-exactly, its rendered prompt spliced onto the session's last prompt and
//!   completion when it extends them, and `turnwise traces check` ([`traces`]) audits the
//!   records `--record-dir` wrote.
//!
//! Every request's sequences join one continuously batched [`SamplingEngine`] on the engine
//! thread ([`worker`]): concurrent clients share its batch. At most
//! [`ServeConfig::max_queue`] sequences wait or run; a request that would exceed it while others
//! run gets 503, one that alone exceeds it 400. A malformed request gets 400 naming the field
//! (`sampling_params.temperature: must be >= 0`), and so does a field turnwise does not
//! implement unless it holds its neutral value, a `max_tokens` that the prompt leaves no room
//! for in the context (naming the numbers; an omitted one is cut to what the context leaves),
//! and a `guided_choice` beyond [`ServeConfig::max_guided_choices`] or
//! [`ServeConfig::max_guided_choice_bytes`]. The `n` samples of a prompt prefill it once and
//! share its keys and values ([`EngineConfig::share_prompts`]), and a prefix cache keeps every
//! prompt's and answer's keys and values across requests ([`ServeConfig::prefix_cache`]): the
//! next turn of a chat prefills only what is new. `/get_server_info` reports its hit rate.
//!
//! Log-probs are those of the distribution each token was drawn from: the temperature-scaled
//! softmax before top-k/top-p truncation (temperature 1 when greedy), the log-probs a policy
//! loss recomputes. Under `guided_choice` they are those of the constrained distribution (the
//! same softmax over the allowed tokens only), which is what was sampled from. The server binds
//! 127.0.0.1 unless told otherwise.
//!
//! [`SamplingEngine`]: turnwise_model::sampling::SamplingEngine

pub(crate) mod http;
pub mod memory;
pub mod session;
pub mod tools;
pub mod traces;
pub use crate::rollout::protocol;
pub(crate) mod worker;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use turnwise_env::server::BackgroundServer;
use turnwise_model::ModelConfig;
use turnwise_model::device::Placement;
use turnwise_model::model::Transformer;
use turnwise_model::sampling::{EngineConfig, PrefixCacheConfig, SpeculativeConfig};

use crate::config::run_config;
use crate::model_source::checkpoint_metadata;
use crate::model_source::{ModelTensors, load_init_tensors};
use crate::rollout::host::{HostOptions, LoadedPolicy, PolicyHost, ServedPolicy};
use crate::run::RunDir;
use crate::run::pick_checkpoint;
use worker::{Shared, WorkerHandle};

/// Settings of `turnwise serve`.
#[derive(Debug, Clone, PartialEq)]
pub struct ServeConfig {
    /// Address to bind (default `127.0.0.1:30000`, SGLang's port; port 0 picks one).
    pub addr: SocketAddr,
    /// The model name answers carry and `/v1/models` lists (default: the model's file or
    /// folder name).
    pub name: Option<String>,
    /// Most sequences decoding at once.
    pub max_batch_size: usize,
    /// Most sequences waiting or running; beyond it requests get 503 (400 for a request that
    /// alone asks for more).
    pub max_queue: usize,
    /// Largest request body in bytes (413 beyond).
    pub max_body_bytes: usize,
    /// Header and body read timeout per connection.
    pub read_timeout: Duration,
    /// Bytes the key/value cache and the prefill's activations may take together
    /// ([`EngineConfig::memory_budget`]): requests beyond it wait for room, and one that alone
    /// can never fit gets a 400 naming `--memory-budget-mb`. Default: a quarter of the
    /// machine's memory ([`default_memory_budget`]).
    pub memory_budget: u64,
    /// Most prompt tokens of one sequence prefilled per engine step
    /// ([`EngineConfig::prefill_chunk`]; `0`: whole prompts at once).
    pub prefill_chunk: usize,
    /// Most bytes of keys and values kept across requests in the prefix cache
    /// ([`EngineConfig::prefix_cache`], `--prefix-cache-mb`; `0`: none): a request that begins
    /// like an earlier prompt or an earlier prompt and its answer (the next turn of a chat, a
    /// GRPO group sent as separate requests) prefills from its first uncached block. Counted in
    /// [`ServeConfig::memory_budget`], whose need evicts it first; emptied at every weight
    /// reload. Default [`DEFAULT_PREFIX_CACHE_BYTES`].
    pub prefix_cache: u64,
    /// Most tokens drafted per sequence and step by prompt lookup and verified in the same
    /// forward ([`EngineConfig::speculative`], `--speculative-draft`; `0`: off, the default):
    /// answers are unchanged (greedy identical, sampled from exactly the policy's distribution
    /// with the same draws), and a sequence that copies from its context (a passage's title,
    /// a query from the question) needs fewer forwards.
    pub speculative_draft: usize,
    /// Keep a prompt that several running sequences share (the `n` samples of a request) once
    /// in the batch and read its keys and values once per step for all of them
    /// ([`EngineConfig::shared_prefix_attention`], `--shared-prefix-attention`; on by default):
    /// answers equal those of a copy per sequence up to float rounding, and the batch holds one
    /// copy of the prompt instead of `n`.
    pub shared_prefix_attention: bool,
    /// Batch-invariant inference ([`EngineConfig::batch_invariant`], `--batch-invariant`; off
    /// by default): a request's logits, log-probs and tokens are the same bits whatever else
    /// the server is running, and a prompt served from the prefix cache gets the bits of a
    /// cold prefill. Long prompts prefill more slowly.
    pub batch_invariant: bool,
    /// The weight version reported until the first reload.
    pub weight_version: String,
    /// Where the served model lives (`--device`, `--dtype`); reloaded weights and merged LoRA
    /// adapters go there too.
    pub placement: Placement,
    /// Most `guided_choice` strings in one request (400 beyond, naming
    /// `--max-guided-choices`): each step of a constrained sequence checks every choice on the
    /// engine thread all requests share. Default [`DEFAULT_MAX_GUIDED_CHOICES`].
    pub max_guided_choices: usize,
    /// Most bytes of `guided_choice` strings in one request, all together (400 beyond, naming
    /// `--max-guided-choice-bytes`). Default [`DEFAULT_MAX_GUIDED_CHOICE_BYTES`].
    pub max_guided_choice_bytes: usize,
    /// Most recorded sessions held in memory (`--max-sessions`); a new one beyond evicts the
    /// least recently used. Default [`session::DEFAULT_MAX_SESSIONS`].
    pub max_sessions: usize,
    /// Where every session record is appended as a JSON line, `DIR/<session>.jsonl`
    /// (`--record-dir`; none by default).
    pub record_dir: Option<PathBuf>,
}

/// Default [`ServeConfig::prefix_cache`] (1 GiB).
pub const DEFAULT_PREFIX_CACHE_BYTES: u64 = 1 << 30;

/// Default [`ServeConfig::max_guided_choices`].
pub const DEFAULT_MAX_GUIDED_CHOICES: usize = 256;
/// Default [`ServeConfig::max_guided_choice_bytes`] (64 KiB).
pub const DEFAULT_MAX_GUIDED_CHOICE_BYTES: usize = 64 << 10;

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            addr: SocketAddr::from(([127, 0, 0, 1], 30000)),
            name: None,
            max_batch_size: 64,
            max_queue: 1024,
            max_body_bytes: 64 << 20,
            read_timeout: Duration::from_secs(30),
            memory_budget: default_memory_budget(),
            prefill_chunk: turnwise_model::sampling::DEFAULT_PREFILL_CHUNK,
            prefix_cache: DEFAULT_PREFIX_CACHE_BYTES,
            speculative_draft: 0,
            shared_prefix_attention: true,
            batch_invariant: false,
            weight_version: "0".into(),
            placement: Placement::cpu(),
            max_guided_choices: DEFAULT_MAX_GUIDED_CHOICES,
            max_guided_choice_bytes: DEFAULT_MAX_GUIDED_CHOICE_BYTES,
            max_sessions: session::DEFAULT_MAX_SESSIONS,
            record_dir: None,
        }
    }
}

/// The default memory budget of a policy server: a quarter of the machine's memory (its
/// `MemTotal`), leaving the rest to the trainer and the environment that share the host; 4 GiB
/// where the machine's memory cannot be read.
pub fn default_memory_budget() -> u64 {
    crate::config::machine_memory_bytes().map_or(4 << 30, |total| total / 4)
}

impl ServeConfig {
    fn validate(&self) -> Result<()> {
        if self.memory_budget == 0 {
            bail!("memory_budget must be at least 1 byte");
        }
        if self.max_batch_size == 0 {
            bail!("max_batch_size must be at least 1");
        }
        if self.max_queue == 0 {
            bail!("max_queue must be at least 1");
        }
        if self.max_body_bytes == 0 {
            bail!("max_body_bytes must be at least 1");
        }
        if self.read_timeout.is_zero() {
            bail!("read_timeout must be positive");
        }
        if self.max_guided_choices == 0 {
            bail!("max_guided_choices must be at least 1");
        }
        if self.max_guided_choice_bytes == 0 {
            bail!("max_guided_choice_bytes must be at least 1");
        }
        if self.max_sessions == 0 {
            bail!("max_sessions must be at least 1");
        }
        Ok(())
    }
}

/// A model to serve: a run directory (its latest complete checkpoint), a checkpoint or Hugging
/// Face folder, a GGUF file, or a packaged model's name (`smollm2-135m-instruct`).
pub struct ServedModel {
    /// What was loaded.
    pub path: PathBuf,
    /// Weights, tokenizer, metadata.
    pub tensors: ModelTensors,
}

/// Loads what `spec` names (see [`ServedModel`]).
pub fn load_served(spec: &Path) -> Result<ServedModel> {
    if spec.is_dir() && spec.join("config.toml").is_file() && spec.join("checkpoints").is_dir() {
        let run = RunDir::open(spec)?;
        let cfg = run_config(&run)?;
        let ck = pick_checkpoint(&run, None)?;
        let (path, mut tensors) = load_init_tensors(&ck.path)?;
        tensors.meta = checkpoint_metadata(&ck.path, cfg.model.init_from.as_deref())?;
        return Ok(ServedModel { path, tensors });
    }
    let (path, tensors) = load_init_tensors(spec)?;
    Ok(ServedModel { path, tensors })
}

/// Loads the weights of `path` for a reload; refuses a model whose configuration differs from
/// `config` (the one served).
pub fn load_weights(
    path: &Path,
    config: &ModelConfig,
    placement: &Placement,
) -> Result<(Transformer, PathBuf)> {
    if !path.exists() {
        bail!("{} does not exist", path.display());
    }
    let served = load_served(path)?;
    let new = &served.tensors.config;
    if new != config {
        bail!(
            "{} is a different architecture: {}",
            served.path.display(),
            config_difference(config, new)
        );
    }
    let model = Transformer::from_tensors(
        new,
        &placement.tensors(served.tensors.tensors)?,
        &served.path.display().to_string(),
    )?;
    Ok((model, served.path))
}

/// The fields where two model configurations differ, as `name: served → new`.
fn config_difference(a: &ModelConfig, b: &ModelConfig) -> String {
    let (va, vb) = (
        serde_json::to_value(a).unwrap_or_default(),
        serde_json::to_value(b).unwrap_or_default(),
    );
    let mut diffs = Vec::new();
    if let (Some(ma), Some(mb)) = (va.as_object(), vb.as_object()) {
        for (k, x) in ma {
            let y = mb.get(k).cloned().unwrap_or_default();
            if *x != y {
                diffs.push(format!("{k}: served {x}, new {y}"));
            }
        }
    }
    if diffs.is_empty() {
        "the configurations differ".into()
    } else {
        diffs.join(", ")
    }
}

/// The token ids that end a generation: the model's EOS (`eos_token` of its tokenizer config,
/// else `<|endoftext|>`), the ids of its `generation_config.json` `eos_token_id`, and
/// `<|im_end|>` when the chat template is ChatML.
pub fn eos_ids(m: &ModelTensors) -> Vec<u32> {
    let mut ids = Vec::new();
    let mut push = |id: Option<u32>| {
        if let Some(id) = id
            && !ids.contains(&id)
        {
            ids.push(id);
        }
    };
    push(
        m.meta
            .eos_token(&m.tokenizer)
            .and_then(|t| m.tokenizer.token_to_id(&t)),
    );
    if let Some(v) = m
        .meta
        .generation_config
        .as_ref()
        .and_then(|g| g.get("eos_token_id"))
    {
        match v {
            serde_json::Value::Number(n) => push(n.as_u64().map(|n| n as u32)),
            serde_json::Value::Array(a) => {
                for n in a {
                    push(n.as_u64().map(|n| n as u32));
                }
            }
            _ => {}
        }
    }
    if let Ok(Some(_)) = m.meta.chat_template() {
        push(m.tokenizer.token_to_id("<|im_end|>"));
    }
    ids
}

/// A policy server running in the background (its own threads), for tests and for the
/// trainer's own use. Dropping it stops it.
pub struct PolicyServer {
    server: Option<BackgroundServer>,
    engine: Option<std::thread::JoinHandle<()>>,
    name: String,
}

impl PolicyServer {
    /// Starts serving `model` under `config`; returns once the socket is bound.
    pub fn start(model: ServedModel, config: &ServeConfig) -> Result<Self> {
        let (app, engine) = build_app(model, config)?;
        let name = app.name.clone();
        let router = http::router(app, config.max_body_bytes);
        let server =
            BackgroundServer::start_router("policy", router, config.addr, config.read_timeout)
                .context("starting the policy server")?;
        Ok(Self {
            server: Some(server),
            engine: Some(engine),
            name,
        })
    }

    /// `http://ip:port`.
    pub fn url(&self) -> String {
        self.server
            .as_ref()
            .map(BackgroundServer::url)
            .unwrap_or_default()
    }

    /// The served model's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Stops accepting requests, finishes those in flight, stops the engine thread.
    pub fn shutdown(mut self) -> Result<()> {
        self.stop()
    }

    fn stop(&mut self) -> Result<()> {
        if let Some(s) = self.server.take() {
            s.shutdown()?;
        }
        if let Some(t) = self.engine.take() {
            t.join()
                .map_err(|_| anyhow::anyhow!("the engine thread panicked"))?;
        }
        Ok(())
    }
}

impl Drop for PolicyServer {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::error!(error = %e, "policy server shutdown failed");
        }
    }
}

/// `turnwise serve` as the trainer's [`PolicyHost`]: [`load_served`], then
/// [`PolicyServer::start`] on a free loopback port with the other settings at their defaults.
#[derive(Debug, Clone, Copy, Default)]
pub struct LocalHost;

impl PolicyHost for LocalHost {
    fn load(&self, spec: &Path) -> Result<Box<dyn LoadedPolicy>> {
        Ok(Box::new(load_served(spec)?))
    }
}

impl LoadedPolicy for ServedModel {
    fn start(self: Box<Self>, options: &HostOptions) -> Result<Box<dyn ServedPolicy>> {
        let defaults = ServeConfig::default();
        let config = ServeConfig {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            name: Some(options.name.clone()),
            weight_version: options
                .weight_version
                .clone()
                .unwrap_or(defaults.weight_version.clone()),
            ..defaults
        };
        Ok(Box::new(PolicyServer::start(*self, &config)?))
    }
}

impl ServedPolicy for PolicyServer {
    fn url(&self) -> String {
        PolicyServer::url(self)
    }
}

/// The handlers' state and the engine thread over `model`.
fn build_app(
    model: ServedModel,
    config: &ServeConfig,
) -> Result<(Arc<http::App>, std::thread::JoinHandle<()>)> {
    config.validate()?;
    let ServedModel { path, tensors } = model;
    let chat = tensors
        .meta
        .chat_template()
        .with_context(|| format!("reading the chat template of {}", path.display()))?;
    let eos_ids = eos_ids(&tensors);
    let transformer = Transformer::from_tensors(
        &tensors.config,
        &config.placement.tensors(tensors.tensors.clone())?,
        &path.display().to_string(),
    )?;
    tracing::info!(
        device = ?config.placement.device,
        dtype = ?config.placement.dtype,
        "serving on (--device, --dtype)"
    );
    let name = config.name.clone().unwrap_or_else(|| {
        path.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "turnwise".into())
    });
    let shared = Arc::new(
        Shared::new(
            config.weight_version.clone(),
            path.clone(),
            config.max_queue,
        )
        .with_memory(config.memory_budget, config.prefill_chunk)
        .with_batch_invariant(config.batch_invariant),
    );
    let (worker, engine) = WorkerHandle::spawn(
        transformer,
        tensors.tokenizer.clone(),
        EngineConfig {
            max_batch_size: config.max_batch_size,
            memory_budget: Some(config.memory_budget),
            prefill_chunk: config.prefill_chunk,
            // The `n` samples of a prompt (and identical prompts of one batch) prefill it once.
            share_prompts: true,
            prefix_cache: (config.prefix_cache > 0)
                .then(|| PrefixCacheConfig::with_max_bytes(config.prefix_cache)),
            speculative: (config.speculative_draft > 0).then(|| SpeculativeConfig {
                max_draft: config.speculative_draft,
                ..SpeculativeConfig::default()
            }),
            shared_prefix_attention: config.shared_prefix_attention,
            batch_invariant: config.batch_invariant,
        },
        Arc::clone(&shared),
    )
    .context("starting the engine thread")?;
    tracing::info!(
        model = %path.display(),
        params = tensors.config.num_parameters(),
        chat_template = chat.is_some(),
        eos = ?eos_ids,
        "serving"
    );
    let app = Arc::new(http::App {
        worker,
        shared,
        tokenizer: tensors.tokenizer,
        chat,
        eos_ids,
        config: tensors.config,
        name,
        seeds: AtomicU64::new(0x5eed),
        requests: AtomicU64::new(0),
        base: tensors.tensors,
        placement: config.placement.clone(),
        max_guided_choices: config.max_guided_choices,
        max_guided_choice_bytes: config.max_guided_choice_bytes,
        sessions: std::sync::Mutex::new(session::SessionStore::new(
            config.max_sessions,
            config.record_dir.clone(),
        )),
        tool_counters: Default::default(),
    });
    Ok((app, engine))
}

/// Serves `model` in the foreground until Ctrl-C; prints the address once bound.
pub fn serve_foreground(model: ServedModel, config: &ServeConfig) -> Result<()> {
    let (app, engine) = build_app(model, config)?;
    memory::release_when_idle();
    let router = http::router(app, config.max_body_bytes);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    runtime.block_on(turnwise_env::server::serve_router(
        "policy",
        router,
        config.addr,
        config.read_timeout,
        |addr| println!("turnwise serve: listening on http://{addr}"),
        async {
            let _ = tokio::signal::ctrl_c().await;
        },
    ))?;
    drop(runtime);
    let _ = engine.join();
    Ok(())
}
