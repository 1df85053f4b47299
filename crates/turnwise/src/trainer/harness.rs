//! The harness rollout backend: an agent program of the user's plays each episode, and the
//! trainer trains on what the policy server recorded of its requests.
//!
//! The trainer serves its current policy on loopback with `turnwise serve`, started through the
//! installed [`crate::rollout::host::PolicyHost`] from the warm-started weights and reloaded after
//! every optimizer step as the remote backend's servers are ([`Harness::sync`]). Per episode it
//! registers a session with the episode's seed (`POST /v1/sessions`: request k of the session
//! samples with `turn_seed(seed, k)`, what the built-in rollout draws for turn k), runs
//! `rollout.harness.command` with the task, the session id and the server's URL in its environment
//! (at most `workers` at once, each within `timeout_secs`, its process group killed beyond), then
//! takes the session's records (`DELETE /v1/sessions/{id}`) and reconstructs them
//! ([`crate::rollout::session::reconstruct`]): each run of requests that extend one another
//! token-exactly is one trajectory, with the tokens between completions as observation tokens
//! (mask 0). A history the program re-rendered starts a new trajectory, trained as its own sample
//! with the episode's reward.
//!
//! The turns' records (parsed actions, format verdicts, searches, anchor states) come from
//! replaying the turns' text through the task's environment, so every reward, estimator and
//! information-gain probe reads a harness episode as it reads a built-in one. An episode whose
//! program crashes, times out, never calls the model, gives no reward when it must, or exceeds
//! the response budget fails: it is counted (`harness/failed/*`), left out of the batch, and
//! a step where more than `max_failed_share` of the episodes failed stops with an error naming
//! them.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use serde_json::{Value, json};
use turnwise_core::metric_keys as mk;
use turnwise_core::trajectory::{
    AgentSegment, EnvSegment, FinishReason, Segment, Trajectory, TurnAction, TurnRecord,
};
use turnwise_env::env::Environment;
use turnwise_env::server::BackgroundServer;
use turnwise_model::tokenizer::TextTokenizer;

use crate::config::{HarnessConfig, HarnessReward, RemoteConfig};
use crate::rollout::host::{HostOptions, PolicyHost, ServedPolicy};
use crate::rollout::session::{SessionRecord, TracePiece, TraceSegment, reconstruct};
use crate::rollout::{Decoding, Episode, EpisodeSpec, TurnControl, record_step};

/// The name the served policy answers to (`TURNWISE_MODEL`).
pub const SERVED_NAME: &str = "turnwise-policy";

/// Most bytes of a program's standard error kept for error messages (its end).
const STDERR_TAIL: usize = 2048;
/// Most bytes of a program's standard output read (its reward line is the last line).
const STDOUT_MAX: usize = 1 << 20;

/// The policy server a harness run trains through, once started.
struct Served {
    server: Box<dyn ServedPolicy>,
    sync: crate::rollout::remote::RemoteBackend,
    version: u64,
}

/// The harness backend of a run: its settings, the policy server (started at the first
/// [`Harness::sync`]) and, for the search task, a retrieval server for the programs.
pub struct Harness {
    config: HarnessConfig,
    host: std::sync::Arc<dyn PolicyHost>,
    served: Mutex<Option<Served>>,
    retriever: Option<BackgroundServer>,
    client: reqwest::blocking::Client,
    /// A folder this backend created for weights written outside a run (`turnwise eval`, a
    /// test); removed when the backend is dropped.
    scratch: Mutex<Option<std::path::PathBuf>>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(dir) = self.scratch.get_mut().ok().and_then(Option::take) {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

impl std::fmt::Debug for Harness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Harness")
            .field("command", &self.config.command)
            .field("url", &self.url())
            .finish()
    }
}

/// Why an episode failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum FailureKind {
    /// The program exited with a non-zero status or was killed by a signal.
    Crash,
    /// The program ran past `timeout_secs`.
    Timeout,
    /// The program never called the model in its session.
    NoCalls,
    /// `reward = "program"` and its output had no `{"reward": x}` line.
    NoReward,
    /// A reconstructed trajectory exceeds the response budget or the model's positions.
    OverBudget,
}

impl FailureKind {
    /// The metric name of the kind.
    pub fn name(self) -> &'static str {
        match self {
            FailureKind::Crash => "crash",
            FailureKind::Timeout => "timeout",
            FailureKind::NoCalls => "no_calls",
            FailureKind::NoReward => "no_reward",
            FailureKind::OverBudget => "over_budget",
        }
    }
}

/// A failed episode: which, why, and what its program said.
#[derive(Debug, Clone)]
pub struct Failure {
    /// The episode's id.
    pub episode: String,
    /// Why it failed.
    pub kind: FailureKind,
    /// The detail (exit status, the end of its standard error, the budget exceeded).
    pub detail: String,
}

/// What the harness did in one rollout, for the step's metrics.
#[derive(Debug, Clone, Default)]
pub struct HarnessStats {
    /// Episodes run.
    pub episodes: usize,
    /// Failed episodes, in the order of the specs.
    pub failures: Vec<Failure>,
    /// Trajectories reconstructed (more than the episodes when programs re-render histories).
    pub segments: usize,
    /// Model requests (records) of the successful episodes.
    pub records: usize,
    /// Records that were not their session's first.
    pub followups: usize,
    /// Of those, records that continued their trajectory.
    pub appended: usize,
    /// Records whose prompt was spliced onto the session's ids.
    pub spliced: usize,
    /// Records whose plain re-tokenisation would have drifted.
    pub retokenization_differs: usize,
    /// Completions offered tools, per turn position of their trajectory: (offered, with a
    /// parsed call).
    pub tool_turns: BTreeMap<usize, (usize, usize)>,
    /// Seconds the programs ran, each.
    pub program_seconds: Vec<f64>,
}

impl HarnessStats {
    /// Episodes that failed.
    pub fn failed(&self) -> usize {
        self.failures.len()
    }

    /// The share of tool-offered completions that yielded a parsed call, `None` when no
    /// completion was offered tools.
    pub fn tool_parse_rate(&self) -> Option<f64> {
        let (offered, parsed) = self
            .tool_turns
            .values()
            .fold((0, 0), |(o, p), (a, b)| (o + a, p + b));
        (offered > 0).then(|| parsed as f64 / offered as f64)
    }

    /// Adds a later round's counts.
    pub fn merge(&mut self, other: HarnessStats) {
        self.episodes += other.episodes;
        self.failures.extend(other.failures);
        self.segments += other.segments;
        self.records += other.records;
        self.followups += other.followups;
        self.appended += other.appended;
        self.spliced += other.spliced;
        self.retokenization_differs += other.retokenization_differs;
        for (turn, (o, p)) in other.tool_turns {
            let e = self.tool_turns.entry(turn).or_default();
            e.0 += o;
            e.1 += p;
        }
        self.program_seconds.extend(other.program_seconds);
    }

    /// The `harness/*` metrics.
    pub fn metrics(&self) -> BTreeMap<String, f64> {
        let mut m = BTreeMap::new();
        m.insert(mk::harness::EPISODES.into(), self.episodes as f64);
        m.insert(mk::harness::FAILED.into(), self.failed() as f64);
        for kind in [
            FailureKind::Crash,
            FailureKind::Timeout,
            FailureKind::NoCalls,
            FailureKind::NoReward,
            FailureKind::OverBudget,
        ] {
            let n = self.failures.iter().filter(|f| f.kind == kind).count();
            m.insert(format!("harness/failed/{}", kind.name()), n as f64);
        }
        m.insert(mk::harness::SEGMENTS.into(), self.segments as f64);
        m.insert(mk::harness::REQUESTS.into(), self.records as f64);
        if self.followups > 0 {
            m.insert(
                mk::harness::APPEND_RATE.into(),
                self.appended as f64 / self.followups as f64,
            );
        }
        m.insert(mk::harness::SPLICED.into(), self.spliced as f64);
        m.insert(
            mk::harness::RETOKENIZATION_DIFFERS.into(),
            self.retokenization_differs as f64,
        );
        if !self.program_seconds.is_empty() {
            let n = self.program_seconds.len() as f64;
            m.insert(
                mk::harness::PROGRAM_SECONDS_MEAN.into(),
                self.program_seconds.iter().sum::<f64>() / n,
            );
            m.insert(
                mk::harness::PROGRAM_SECONDS_MAX.into(),
                self.program_seconds.iter().copied().fold(0.0, f64::max),
            );
        }
        if let Some(rate) = self.tool_parse_rate() {
            m.insert(mk::harness::TOOL_CALLS_PARSE_RATE.into(), rate);
            for (turn, (offered, parsed)) in &self.tool_turns {
                m.insert(
                    format!("harness/tool_calls/parse_rate/turn_{turn}"),
                    *parsed as f64 / *offered as f64,
                );
            }
        }
        m
    }
}

/// One harness rollout: the episodes (one per reconstructed trajectory of each successful
/// program), which spec each came from, and the program's reward when it gave one.
#[derive(Debug, Default)]
pub struct HarnessRollout {
    /// Episodes, grouped by spec in the specs' order.
    pub episodes: Vec<Episode>,
    /// The spec index of each episode.
    pub sources: Vec<usize>,
    /// The program's reward of each episode (`reward = "program"`), else `None`.
    pub program_rewards: Vec<Option<f64>>,
    /// Whether each episode is the last trajectory of its program (the one with its answer).
    pub is_final: Vec<bool>,
    /// What happened.
    pub stats: HarnessStats,
}

/// What a harness rollout needs of the trainer.
pub struct HarnessContext<'a> {
    /// The policy's tokenizer (turn texts, the prompt's text).
    pub tokenizer: &'a TextTokenizer,
    /// The task's environment, to replay the turns' text into records.
    pub env: &'a dyn Fn() -> Result<Box<dyn Environment>>,
    /// Decoding settings the program is told to use.
    pub decoding: &'a Decoding,
    /// Texts that end a turn (`TURNWISE_STOP`): the turn-end tags and the closing texts that
    /// are not single tokens.
    pub stop_strings: Vec<String>,
    /// Token ids that end a turn (`TURNWISE_STOP_TOKEN_IDS`): the turn-end tags that are single
    /// tokens and end-of-text.
    pub stop_ids: &'a [u32],
    /// The task's turn limit (`TURNWISE_MAX_TURNS`).
    pub max_turns: usize,
    /// The retriever's top-k (`TURNWISE_TOPK`).
    pub topk: usize,
    /// The task's agent format (`TURNWISE_FORMAT`: `search_r1`, `boxed`, `t2po`, `verifiers`).
    pub format: String,
    /// The split the episodes come from (`TURNWISE_SPLIT`).
    pub split: &'a str,
    /// The model's position limit: a trajectory longer than it fails.
    pub max_positions: usize,
}

/// What one episode's program did: how it ended, its session's records, and the reward it
/// reported to the server (`POST /v1/sessions/{id}/reward`), if any.
type Outcome = (ProgramRun, Vec<SessionRecord>, Option<f64>);

/// How a program ended.
#[derive(Debug)]
struct ProgramRun {
    /// `Ok(code)` when it exited, `Err(description)` when killed or not started.
    status: std::result::Result<i32, String>,
    timed_out: bool,
    stdout: String,
    stderr_tail: String,
    seconds: f64,
}

impl Harness {
    /// The backend of `config`; `retriever` (the search task's) is served on loopback for the
    /// programs (`TURNWISE_RETRIEVER_URL`).
    pub fn new(
        config: &HarnessConfig,
        retriever: Option<std::sync::Arc<dyn turnwise_env::search::Retriever>>,
    ) -> Result<Self> {
        let host = crate::rollout::host::installed("the harness backend")?;
        let retriever = match retriever {
            Some(r) => Some(
                BackgroundServer::start(
                    r,
                    turnwise_env::server::ServerConfig::with_addr(std::net::SocketAddr::from((
                        [127, 0, 0, 1],
                        0,
                    ))),
                )
                .context("starting the retrieval server of the harness programs")?,
            ),
            None => None,
        };
        let client = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(60))
            .no_proxy()
            .build()
            .context("building the harness's HTTP client")?;
        Ok(Self {
            config: config.clone(),
            host,
            served: Mutex::new(None),
            retriever,
            client,
            scratch: Mutex::new(None),
        })
    }

    /// A folder of this backend's own for weights written outside a run's directory: created
    /// (new, under the system's temporary folder) the first time, removed with the backend.
    pub fn scratch_dir(&self) -> Result<std::path::PathBuf> {
        let mut scratch = self.scratch.lock().expect("harness lock");
        if let Some(d) = scratch.as_ref() {
            return Ok(d.clone());
        }
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let dir =
            std::env::temp_dir().join(format!("turnwise-harness-{}-{nanos}", std::process::id()));
        // `create_dir`, not `create_dir_all`: a folder that exists is not ours to fill or remove.
        std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
        *scratch = Some(dir.clone());
        Ok(dir)
    }

    /// The policy server's base URL, once started.
    pub fn url(&self) -> Option<String> {
        self.served
            .lock()
            .expect("harness lock")
            .as_ref()
            .map(|s| s.server.url())
    }

    /// The weight version the server holds.
    pub fn synced_version(&self) -> Option<u64> {
        self.served
            .lock()
            .expect("harness lock")
            .as_ref()
            .map(|s| s.version)
    }

    /// Serves the weights in `folder` (a Hugging Face folder the trainer wrote) as `version`:
    /// starts the server the first time, reloads it after.
    pub fn sync(&self, folder: &Path, version: u64) -> Result<()> {
        let mut served = self.served.lock().expect("harness lock");
        match served.as_mut() {
            Some(s) => {
                s.sync.sync(folder, version)?;
                s.version = version;
            }
            None => {
                let model = self
                    .host
                    .load(folder)
                    .with_context(|| format!("loading {} to serve", folder.display()))?;
                let options = HostOptions {
                    name: SERVED_NAME.into(),
                    weight_version: Some(version.to_string()),
                };
                let server = model
                    .start(&options)
                    .context("starting the harness's policy server")?;
                let sync = crate::rollout::remote::RemoteBackend::connect(&RemoteConfig {
                    urls: vec![server.url()],
                    timeout_secs: 600.0,
                    ..RemoteConfig::default()
                })?;
                tracing::info!(url = %server.url(), "harness policy server started");
                *served = Some(Served {
                    server,
                    sync,
                    version,
                });
            }
        }
        Ok(())
    }

    /// Runs the program once per spec and reconstructs what it did.
    pub fn run(&self, specs: &[EpisodeSpec], cx: &HarnessContext<'_>) -> Result<HarnessRollout> {
        let base = self.url().ok_or_else(|| {
            anyhow!("the harness's policy server is not started (no weights were synced)")
        })?;
        let envs = specs
            .iter()
            .map(|spec| self.program_env(&base, spec, cx))
            .collect::<Result<Vec<_>>>()?;
        let outcomes = self.run_programs(&base, specs, &envs)?;
        let mut out = HarnessRollout::default();
        out.stats.episodes = specs.len();
        for (i, outcome) in outcomes.into_iter().enumerate() {
            self.add_outcome(i, &specs[i], outcome, cx, &mut out)?;
        }
        self.check_failures(specs.len(), &out.stats, out.episodes.is_empty())?;
        self.check_tool_parse_rate(&out.stats)?;
        Ok(out)
    }

    /// Runs the program of every spec (`envs[i]` is spec `i`'s environment), at most `workers`
    /// at once; after the first error no other program starts, and that error is returned.
    fn run_programs(
        &self,
        base: &str,
        specs: &[EpisodeSpec],
        envs: &[Vec<(&'static str, String)>],
    ) -> Result<Vec<Outcome>> {
        let next = AtomicUsize::new(0);
        let outcomes: Mutex<Vec<Option<Outcome>>> =
            Mutex::new((0..specs.len()).map(|_| None).collect());
        let first_error: Mutex<Option<anyhow::Error>> = Mutex::new(None);
        std::thread::scope(|scope| {
            for _ in 0..self.config.workers.min(specs.len()) {
                scope.spawn(|| {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= specs.len() || first_error.lock().expect("lock").is_some() {
                            break;
                        }
                        match self.run_one(base, &specs[i], &envs[i]) {
                            Ok(out) => outcomes.lock().expect("lock")[i] = Some(out),
                            Err(e) => {
                                first_error.lock().expect("lock").get_or_insert(e);
                            }
                        }
                    }
                });
            }
        });
        if let Some(e) = first_error.into_inner().expect("lock") {
            return Err(e);
        }
        Ok(outcomes
            .into_inner()
            .expect("lock")
            .into_iter()
            .map(|o| o.expect("every spec ran"))
            .collect())
    }

    /// Adds what the program of `spec` (spec `i`) did to `out`: its trajectories as episodes,
    /// or the failure that leaves them out.
    fn add_outcome(
        &self,
        i: usize,
        spec: &EpisodeSpec,
        (run, records, posted): Outcome,
        cx: &HarnessContext<'_>,
        out: &mut HarnessRollout,
    ) -> Result<()> {
        out.stats.program_seconds.push(run.seconds);
        let reward = match self.program_verdict(spec, &run, &records, posted) {
            Ok(reward) => reward,
            Err(failure) => {
                out.stats.failures.push(failure);
                return Ok(());
            }
        };
        let segments = reconstruct(&records);
        let built = match build_segments(&segments, &records, spec, cx)? {
            Ok(built) => built,
            Err(detail) => {
                out.stats.failures.push(Failure {
                    episode: spec.id.clone(),
                    kind: FailureKind::OverBudget,
                    detail,
                });
                return Ok(());
            }
        };
        count_records(&records, &segments, &mut out.stats);
        let n = built.len();
        for (k, ep) in built.into_iter().enumerate() {
            out.episodes.push(ep);
            out.sources.push(i);
            out.program_rewards.push(reward);
            out.is_final.push(k + 1 == n);
        }
        Ok(())
    }

    /// How the program of `spec` ended: its reward (`reward = "program"`; `None` for the task's
    /// reward), or why the episode failed (it timed out, crashed, never called the model, or
    /// gave no reward when it must).
    fn program_verdict(
        &self,
        spec: &EpisodeSpec,
        run: &ProgramRun,
        records: &[SessionRecord],
        posted: Option<f64>,
    ) -> std::result::Result<Option<f64>, Failure> {
        let fail = |kind, detail: String| Failure {
            episode: spec.id.clone(),
            kind,
            detail,
        };
        if run.timed_out {
            return Err(fail(
                FailureKind::Timeout,
                format!(
                    "ran past rollout.harness.timeout_secs = {} and was killed{}",
                    self.config.timeout_secs,
                    tail_note(&run.stderr_tail)
                ),
            ));
        }
        match &run.status {
            Ok(0) => {}
            Ok(code) => {
                return Err(fail(
                    FailureKind::Crash,
                    format!("exited with status {code}{}", tail_note(&run.stderr_tail)),
                ));
            }
            Err(what) => {
                return Err(fail(
                    FailureKind::Crash,
                    format!("{what}{}", tail_note(&run.stderr_tail)),
                ));
            }
        }
        if records.is_empty() {
            return Err(fail(
                FailureKind::NoCalls,
                format!(
                    "never called the model in session {:?} (send the header X-Session-Id: \
                     $TURNWISE_SESSION_ID, or user = $TURNWISE_SESSION_ID, with every \
                     request to $OPENAI_BASE_URL)",
                    spec.id
                ),
            ));
        }
        match self.config.reward {
            HarnessReward::Task => Ok(None),
            HarnessReward::Program => match program_reward(&run.stdout).or(posted) {
                Some(r) => Ok(Some(r)),
                None => Err(fail(
                    FailureKind::NoReward,
                    "rollout.harness.reward = \"program\" but the last line of its \
                     standard output is not {\"reward\": <number>} and it posted none \
                     to $TURNWISE_BASE_URL/v1/sessions/$TURNWISE_SESSION_ID/reward"
                        .into(),
                )),
            },
        }
    }

    /// Stops the rollout when more than `max_failed_share` of its `specs` episodes failed, or
    /// every one did (`none_left`), naming the first failures; warns when some did.
    fn check_failures(&self, specs: usize, stats: &HarnessStats, none_left: bool) -> Result<()> {
        let failed = stats.failed();
        if failed > 0 {
            let share = failed as f64 / specs.max(1) as f64;
            let first = &stats.failures[0];
            tracing::warn!(
                failed,
                episodes = specs,
                first = %format!("{}: {} ({})", first.episode, first.kind.name(), first.detail),
                "harness episodes failed"
            );
            if share > self.config.max_failed_share || none_left {
                let list: Vec<String> = stats
                    .failures
                    .iter()
                    .take(3)
                    .map(|f| format!("{} ({}): {}", f.episode, f.kind.name(), f.detail))
                    .collect();
                bail!(
                    "{failed} of {specs} harness episodes failed, more than \
                     rollout.harness.max_failed_share = {}; the program is {:?}. First \
                     failures:\n  {}",
                    self.config.max_failed_share,
                    self.config.command,
                    list.join("\n  ")
                );
            }
        }
        Ok(())
    }

    /// Stops the rollout when the tool-call parser extracted a call from fewer of the
    /// completions offered tools than `min_tool_parse_rate`.
    fn check_tool_parse_rate(&self, stats: &HarnessStats) -> Result<()> {
        if self.config.min_tool_parse_rate > 0.0
            && let Some(rate) = stats.tool_parse_rate()
            && rate < self.config.min_tool_parse_rate
        {
            bail!(
                "the tool-call parser (format \"hermes\": <tool_call>{{\"name\": …, \
                 \"arguments\": {{…}}}}</tool_call>) extracted a call from {:.1} % of the \
                 completions offered tools, below rollout.harness.min_tool_parse_rate = {}: \
                 the model's tool-call format is not the one the server parses (check the chat \
                 template and the program's `tools`), or lower the floor",
                rate * 100.0,
                self.config.min_tool_parse_rate
            );
        }
        Ok(())
    }

    /// The environment the program of `spec` runs with.
    fn program_env(
        &self,
        base: &str,
        spec: &EpisodeSpec,
        cx: &HarnessContext<'_>,
    ) -> Result<Vec<(&'static str, String)>> {
        let prompt = cx
            .tokenizer
            .decode(&spec.prompt_ids, false)
            .context("decoding an episode's prompt")?;
        let d = cx.decoding;
        let mut env: Vec<(&'static str, String)> = vec![
            ("TURNWISE_BASE_URL", base.to_string()),
            ("OPENAI_BASE_URL", format!("{base}/v1")),
            ("OPENAI_API_KEY", "turnwise".into()),
            ("TURNWISE_SESSION_ID", session_id(&spec.id)),
            ("TURNWISE_MODEL", SERVED_NAME.into()),
            (
                "TURNWISE_QUESTION",
                spec.task.prompt.clone().unwrap_or_default(),
            ),
            ("TURNWISE_PROMPT", prompt),
            ("TURNWISE_TASK_ID", spec.task.id.clone()),
            ("TURNWISE_EPISODE_ID", spec.id.clone()),
            ("TURNWISE_SPLIT", cx.split.to_string()),
            ("TURNWISE_SEED", spec.seed.to_string()),
            ("TURNWISE_TEMPERATURE", d.temperature.to_string()),
            ("TURNWISE_TOP_P", d.top_p.to_string()),
            ("TURNWISE_TOP_K", d.top_k.to_string()),
            ("TURNWISE_MAX_TOKENS", d.max_turn_tokens.to_string()),
            (
                "TURNWISE_MAX_RESPONSE_TOKENS",
                d.max_response_tokens.to_string(),
            ),
            ("TURNWISE_MAX_TURNS", cx.max_turns.to_string()),
            ("TURNWISE_STOP", serde_json::to_string(&cx.stop_strings)?),
            (
                "TURNWISE_STOP_TOKEN_IDS",
                serde_json::to_string(cx.stop_ids)?,
            ),
            ("TURNWISE_TOPK", cx.topk.to_string()),
            ("TURNWISE_FORMAT", cx.format.clone()),
        ];
        if let Some(r) = &self.retriever {
            env.push(("TURNWISE_RETRIEVER_URL", format!("{}/retrieve", r.url())));
        }
        if self.config.reward == HarnessReward::Program {
            env.push((
                "TURNWISE_ANSWERS",
                serde_json::to_string(&spec.task.answers)?,
            ));
        }
        Ok(env)
    }

    /// Registers the session, runs the program, and takes the session's records.
    fn run_one(
        &self,
        base: &str,
        spec: &EpisodeSpec,
        env: &[(&'static str, String)],
    ) -> Result<Outcome> {
        let session = session_id(&spec.id);
        let r = self
            .client
            .post(format!("{base}/v1/sessions"))
            .json(&json!({"id": session, "seed": spec.seed}))
            .send()
            .with_context(|| format!("registering session {session} with {base}"))?;
        if !r.status().is_success() {
            bail!(
                "registering session {session}: {} {}",
                r.status(),
                r.text().unwrap_or_default()
            );
        }
        let run = run_program(
            &self.config.command,
            env,
            Duration::from_secs_f64(self.config.timeout_secs),
        );
        if let Err(what) = &run.status
            && what.starts_with("could not start")
        {
            bail!("rollout.harness.command {:?}: {what}", self.config.command);
        }
        let r = self
            .client
            .delete(format!("{base}/v1/sessions/{session}"))
            .send()
            .with_context(|| format!("taking the records of session {session}"))?;
        let (records, reward) = match r.status().as_u16() {
            404 => (Vec::new(), None),
            s if (200..300).contains(&s) => {
                let body: Value = r.json().context("reading a session's records")?;
                let records =
                    serde_json::from_value(body.get("records").cloned().unwrap_or(json!([])))
                        .context("parsing a session's records")?;
                (records, body.get("reward").and_then(Value::as_f64))
            }
            s => bail!(
                "taking the records of session {session}: {s} {}",
                r.text().unwrap_or_default()
            ),
        };
        Ok((run, records, reward))
    }
}

/// The episodes of one program's trajectories (`segments` of `records`): the first keeps the
/// spec's id, the others are `<id>-seg<k>`. `Ok(Err(detail))` when a trajectory exceeds the
/// response budget or the model's positions (no episode is built from it or after it).
fn build_segments(
    segments: &[TraceSegment],
    records: &[SessionRecord],
    spec: &EpisodeSpec,
    cx: &HarnessContext<'_>,
) -> Result<std::result::Result<Vec<Episode>, String>> {
    let mut built = Vec::with_capacity(segments.len());
    for (k, seg) in segments.iter().enumerate() {
        let id = match k {
            0 => spec.id.clone(),
            _ => format!("{}-seg{k}", spec.id),
        };
        let response: usize = seg.pieces.iter().map(|p| p.ids().len()).sum();
        if response > cx.decoding.max_response_tokens
            || seg.prompt_ids.len() + response > cx.max_positions
        {
            return Ok(Err(format!(
                "trajectory {k} has {} prompt and {response} response tokens: beyond \
                 rollout.max_response_tokens = {} or the model's {} positions",
                seg.prompt_ids.len(),
                cx.decoding.max_response_tokens,
                cx.max_positions
            )));
        }
        built.push(build_episode(seg, records, spec, id, cx)?);
    }
    Ok(Ok(built))
}

/// Adds one program's records and their trajectories to `stats`.
fn count_records(records: &[SessionRecord], segments: &[TraceSegment], stats: &mut HarnessStats) {
    stats.segments += segments.len();
    stats.records += records.len();
    stats.followups += records.len().saturating_sub(1);
    stats.appended += records.len() - segments.len();
    for r in records {
        if let Some(t) = &r.retokenization {
            stats.spliced += usize::from(t.spliced);
            stats.retokenization_differs += usize::from(t.differs);
        }
    }
    for seg in segments {
        let mut turn = 0;
        for p in &seg.pieces {
            if let TracePiece::Agent { record, .. } = p {
                if let Some(t) = &records[*record].tool_calls {
                    let e = stats.tool_turns.entry(turn).or_default();
                    e.0 += 1;
                    e.1 += usize::from(t.parsed > 0);
                }
                turn += 1;
            }
        }
    }
}

/// The session id of an episode (the server's alphabet: `[A-Za-z0-9._:-]`, at most 128).
fn session_id(episode: &str) -> String {
    let mut s: String = episode
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    s.truncate(120);
    format!("tw-{s}")
}

fn tail_note(stderr: &str) -> String {
    let t = stderr.trim();
    if t.is_empty() {
        String::new()
    } else {
        format!("; its standard error ends: {t}")
    }
}

/// `{"reward": x}` on the last non-empty line of `stdout`.
fn program_reward(stdout: &str) -> Option<f64> {
    let line = stdout.lines().rev().find(|l| !l.trim().is_empty())?;
    let v: Value = serde_json::from_str(line.trim()).ok()?;
    v.get("reward")?.as_f64().filter(|r| r.is_finite())
}

/// Runs `command` with `env` added, killing its process group after `timeout`.
fn run_program(command: &[String], env: &[(&str, String)], timeout: Duration) -> ProgramRun {
    use std::os::unix::process::CommandExt;
    let t0 = Instant::now();
    let mut cmd = Command::new(&command[0]);
    cmd.args(&command[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            return ProgramRun {
                status: Err(format!("could not start {:?}: {e}", command[0])),
                timed_out: false,
                stdout: String::new(),
                stderr_tail: String::new(),
                seconds: 0.0,
            };
        }
    };
    let pid = child.id();
    let mut stdout = child.stdout.take().expect("piped");
    let mut stderr = child.stderr.take().expect("piped");
    let out_reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = (&mut stdout).take(STDOUT_MAX as u64).read_to_end(&mut buf);
        // Drain the rest so the program never blocks on a full pipe.
        let _ = std::io::copy(&mut stdout, &mut std::io::sink());
        String::from_utf8_lossy(&buf).into_owned()
    });
    let err_reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = stderr.read_to_end(&mut buf);
        let start = buf.len().saturating_sub(STDERR_TAIL);
        String::from_utf8_lossy(&buf[start..]).into_owned()
    });
    let deadline = t0 + timeout;
    let mut timed_out = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Ok(s),
            Ok(None) if Instant::now() >= deadline => {
                timed_out = true;
                kill_group(pid);
                break child.wait();
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => break Err(e),
        }
    };
    // Children the program left behind may hold its pipes open: once it has exited, give them
    // until the deadline (at least a second), then end its process group. (The group id cannot
    // have been reused while such a member lives, so this never reaches a foreign process.)
    let grace = deadline.max(Instant::now() + Duration::from_secs(1));
    while !(out_reader.is_finished() && err_reader.is_finished()) {
        if Instant::now() >= grace {
            kill_group(pid);
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let stdout = out_reader.join().unwrap_or_default();
    let stderr_tail = err_reader.join().unwrap_or_default();
    let status = match status {
        Ok(s) => match s.code() {
            Some(c) => Ok(c),
            None => {
                use std::os::unix::process::ExitStatusExt;
                Err(format!(
                    "was killed by signal {}",
                    s.signal().map_or("?".into(), |n| n.to_string())
                ))
            }
        },
        Err(e) => Err(format!("could not be waited for: {e}")),
    };
    ProgramRun {
        status,
        timed_out,
        stdout,
        stderr_tail,
        seconds: t0.elapsed().as_secs_f64(),
    }
}

/// Sends SIGKILL to the process group `pgid` (the program and whatever it started).
fn kill_group(pgid: u32) {
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{pgid}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// The episode of one reconstructed trajectory: its tokens as recorded, its turns' records
/// from replaying their text through the task's environment.
fn build_episode(
    seg: &TraceSegment,
    records: &[SessionRecord],
    spec: &EpisodeSpec,
    id: String,
    cx: &HarnessContext<'_>,
) -> Result<Episode> {
    let mut env = (cx.env)()?;
    let first = env
        .reset(&spec.task)
        .with_context(|| format!("resetting the environment for {}", spec.task.id))?
        .text;
    let mut state = Some(first).filter(|o| spec.task.prompt.as_ref() != Some(o));
    // The program's own prompt (it may render the task otherwise than the trainer does).
    let mut traj = Trajectory {
        id,
        prompt_ids: seg.prompt_ids.clone(),
        ..spec.blank_trajectory()
    };
    let mut turn_texts: Vec<(String, Option<String>)> = Vec::new();
    let mut turn_control = Vec::new();
    let (mut env_return, mut won, mut answer) = (0.0, false, None);
    let mut obs_spans = Vec::new();
    let mut response = 0usize;
    let mut done = false;
    let mut last_finish = "stop";
    let mut env_observation: Option<String> = None;
    for piece in &seg.pieces {
        match piece {
            TracePiece::Agent {
                ids,
                logprobs,
                weight_version,
                record,
            } => {
                let turn = traj.turns.len();
                let text = cx
                    .tokenizer
                    .decode(ids, false)
                    .context("decoding a harness turn")?;
                let version = weight_version.parse::<u64>().ok();
                let mut seg = AgentSegment::new(turn, ids.clone(), logprobs.clone());
                seg.weight_version = version;
                traj.segments.push(Segment::Agent(seg));
                response += ids.len();
                last_finish = records[*record].finish.as_str();
                turn_control.push(TurnControl {
                    context_tokens: traj.prompt_ids.len() + response,
                    weight_version: version,
                    ..TurnControl::default()
                });
                if done {
                    // The program went on after the environment ended the episode.
                    traj.turns.push(TurnRecord {
                        index: turn,
                        action: TurnAction::Invalid {
                            reason: "a turn after the episode ended".into(),
                        },
                        format_ok: false,
                        observation: None,
                        searches_so_far: traj.turns.last().map_or(0, |t| t.searches_so_far),
                        env_reward: Some(0.0),
                        anchor: state.clone(),
                    });
                    turn_texts.push((text, None));
                    continue;
                }
                let step = env
                    .step(&text)
                    .with_context(|| format!("replaying turn {turn} of {}", spec.id))?;
                env_return += step.reward;
                won |= step.info.won;
                if step.done {
                    done = true;
                    traj.finish = if step.info.truncated {
                        FinishReason::TurnLimit
                    } else {
                        FinishReason::Answered
                    };
                }
                let stepped = record_step(&step, turn, &mut state);
                if stepped.answer.is_some() {
                    answer = stepped.answer;
                }
                env_observation = stepped.observation;
                traj.turns.push(stepped.record);
                turn_texts.push((text, None));
            }
            TracePiece::Observation { ids } => {
                // The environment's own text when the program appended exactly its tokens (what
                // the built-in rollout records), else the tokens' decoding.
                let text = match env_observation.take() {
                    Some(o) if cx.tokenizer.encode(&o).is_ok_and(|e| e == *ids) => o,
                    _ => cx
                        .tokenizer
                        .decode(ids, false)
                        .context("decoding a harness observation")?,
                };
                if let Some(last) = turn_texts.last_mut() {
                    last.1 = Some(text);
                }
                obs_spans.push(response..response + ids.len());
                response += ids.len();
                traj.segments
                    .push(Segment::Env(EnvSegment { ids: ids.clone() }));
            }
        }
    }
    if !done && last_finish == "length" {
        traj.finish = FinishReason::Length;
    }
    traj.validate()
        .with_context(|| format!("the trajectory reconstructed for {}", spec.id))?;
    Ok(Episode {
        trajectory: traj,
        turn_texts,
        env_return,
        won,
        answer,
        observation_spans: obs_spans,
        turn_control,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reward_is_the_last_non_empty_line() {
        assert_eq!(program_reward("log\n{\"reward\": 0.5}\n\n"), Some(0.5));
        assert_eq!(program_reward("{\"reward\": 1}\nlater\n"), None);
        assert_eq!(program_reward(""), None);
        assert_eq!(program_reward("{\"reward\": \"1\"}"), None);
    }

    #[test]
    fn session_ids_keep_to_the_servers_alphabet() {
        assert_eq!(session_id("s1-q 7/0"), "tw-s1-q_7_0");
        assert!(session_id(&"x".repeat(500)).len() <= 128);
    }

    #[test]
    fn a_program_past_its_timeout_is_killed_with_its_children() {
        let t0 = Instant::now();
        let run = run_program(
            &[
                "sh".into(),
                "-c".into(),
                "sleep 30 & sleep 30; echo never".into(),
            ],
            &[],
            Duration::from_millis(300),
        );
        assert!(run.timed_out);
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        assert!(!run.stdout.contains("never"));
    }

    #[test]
    fn a_crash_keeps_the_end_of_its_standard_error() {
        let run = run_program(
            &["sh".into(), "-c".into(), "echo boom >&2; exit 3".into()],
            &[],
            Duration::from_secs(10),
        );
        assert_eq!(run.status, Ok(3));
        assert_eq!(run.stderr_tail.trim(), "boom");
    }
}
