//! `turnwise view`: one RL step's sample episodes ([`SampleRecord`]s of `samples/step-N.jsonl`)
//! as a self-contained HTML page (inline CSS and JavaScript, no network), written to a file or
//! served on loopback.
//!
//! Per episode the page shows the decoded prompt, and per turn the agent's text as tokens
//! coloured by their advantage, log-prob or entropy (a tooltip gives each token's numbers), the
//! observation after it, and the turn's reward, advantage, information gain, clip scale,
//! clipped-token share and GiGPO step group; per episode its outcome reward, score, EM, finish
//! reason, answer and the prompt group it was normalised in (with the group's mean and std).
//! The episodes can be filtered by outcome (`#filter=correct|wrong`), by group (`#group=ID`)
//! and by text (`#q=TEXT`), and sorted by group, reward or advantage (`#sort=…`); the colour is
//! `#color=advantage|logprob|entropy`. The same keys work in the query string.
//!
//! A samples file written before the annotations existed shows what it has: the tokens with
//! their log-probs and entropies, decoded with the tokenizer of the run's latest checkpoint (or
//! as ids when there is none), without advantages, groups or clip state.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;
use turnwise_core::trajectory::{FinishReason, Segment, TurnAction};
use turnwise_model::tokenizer::TextTokenizer;

use super::{RunDir, RunError, SampleGroup, SampleRecord, StepGroup};

/// The page template; `__TITLE__` and `__DATA__` are filled in by [`render_page`].
const TEMPLATE: &str = include_str!("view.html");

/// What can go wrong while building or serving the viewer's page.
#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    /// A file of the run directory could not be read.
    #[error(transparent)]
    Run(#[from] RunError),
    /// The run has no samples file at all.
    #[error(
        "{} holds no samples/step-N.jsonl: the run has not finished an RL step yet (or \
         run.samples_per_step = 0)",
        path.display()
    )]
    NoSamples {
        /// The run directory.
        path: PathBuf,
    },
    /// The asked step has no samples file.
    #[error("{} has no samples of step {step} (steps with samples: {available})", path.display())]
    NoStep {
        /// The run directory.
        path: PathBuf,
        /// The step asked for.
        step: u64,
        /// The steps that have samples, listed.
        available: String,
    },
    /// A sample line's annotations do not fit its trajectory.
    #[error("{}: episode {episode}: {message}", path.display())]
    Inconsistent {
        /// The samples file.
        path: PathBuf,
        /// The episode's id.
        episode: String,
        /// What does not fit.
        message: String,
    },
    /// The page could not be written.
    #[error("cannot write {}: {cause}", path.display())]
    Write {
        /// The page's path.
        path: PathBuf,
        /// The underlying error.
        cause: std::io::Error,
    },
    /// The page's data could not be serialised.
    #[error("cannot serialise the page's data: {0}")]
    Serialize(serde_json::Error),
    /// The HTTP server could not start.
    #[error("cannot serve the viewer: {0}")]
    Serve(turnwise_env::server::ServerError),
}

// The wrapped error is printed in the variant's message, so it is not also its `source()`: a
// report that walks the causes (`{:#}`, `turnwise`'s error line) would print it twice.
impl From<serde_json::Error> for ViewError {
    fn from(e: serde_json::Error) -> Self {
        Self::Serialize(e)
    }
}

impl From<turnwise_env::server::ServerError> for ViewError {
    fn from(e: turnwise_env::server::ServerError) -> Self {
        Self::Serve(e)
    }
}

/// Result of the viewer's functions.
pub type ViewResult<T> = std::result::Result<T, ViewError>;

/// Everything the page shows, embedded in it as JSON.
#[derive(Debug, Clone, Serialize)]
pub struct PageData {
    /// The run directory's name.
    pub run: String,
    /// The run's preset (config.toml's `preset`).
    pub preset: Option<String>,
    /// The run's advantage estimator (config.toml's `advantage.estimator`).
    pub estimator: Option<String>,
    /// The step shown.
    pub step: u64,
    /// Every step with samples.
    pub steps: Vec<u64>,
    /// Whether the page is served (its step menu then reloads it at `?step=N`).
    pub served: bool,
    /// What the samples file lacks (old runs), said once.
    pub notes: Vec<String>,
    /// The episodes, in the file's order.
    pub episodes: Vec<EpisodeView>,
}

/// One episode of the page.
#[derive(Debug, Clone, Serialize)]
pub struct EpisodeView {
    /// Its position in the file.
    pub index: usize,
    /// The trajectory's id.
    pub id: String,
    /// The prompt's uid.
    pub prompt_uid: String,
    /// The decoded prompt.
    pub prompt: String,
    /// The prompt group its advantage was normalised in.
    pub group: Option<SampleGroup>,
    /// The outcome reward.
    pub reward: Option<f64>,
    /// The score the estimator read.
    pub score: Option<f64>,
    /// Exact match (a game's success).
    pub em: Option<f64>,
    /// Whether the episode counts as correct: its EM, or without one a positive reward.
    pub correct: Option<bool>,
    /// Why it ended (`answered`, `turn_limit`, `length`, `env_done`).
    pub finish: String,
    /// Whether its format was valid.
    pub format_ok: Option<bool>,
    /// Its final answer.
    pub answer: Option<String>,
    /// The gold answers.
    pub gold: Vec<String>,
    /// Whether the update trained on it.
    pub trained: Option<bool>,
    /// Its agent turns.
    pub turns: Vec<TurnView>,
}

/// One agent turn of the page.
#[derive(Debug, Clone, Serialize)]
pub struct TurnView {
    /// The turn's index (0-based).
    pub index: usize,
    /// What the turn did (`search: QUERY`, `answer: TEXT`, `move: up`, `invalid: REASON`).
    pub action: String,
    /// The agent's decoded text.
    pub text: String,
    /// The observation after the turn.
    pub observation: Option<String>,
    /// The turn's reward (turn-level rewards).
    pub reward: Option<f64>,
    /// The environment's step reward.
    pub env_reward: Option<f64>,
    /// The turn's advantage.
    pub advantage: Option<f64>,
    /// The information gain of the observation after it.
    pub info_gain: Option<f64>,
    /// The turn's value of each channel the estimator emitted, by channel key (A2TGPO's
    /// `normalized_info_gain` and `clip_scale`).
    pub channels: BTreeMap<&'static str, f64>,
    /// The share of its trained tokens' update passes that clipped them.
    pub clipped: Option<f64>,
    /// GiGPO's anchor group of the step.
    pub step_group: Option<StepGroup>,
    /// Its tokens.
    pub tokens: TokenColumns,
}

/// The agent tokens of one turn, column by column.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TokenColumns {
    /// Token ids.
    pub ids: Vec<u32>,
    /// The text each adds.
    pub text: Vec<String>,
    /// Advantages.
    pub adv: Option<Vec<f32>>,
    /// Sampling log-probs.
    pub logprob: Vec<f32>,
    /// Entropies.
    pub entropy: Option<Vec<f32>>,
    /// Shares of update passes that clipped each token.
    pub clipped: Option<Vec<f32>>,
    /// Forced tokens (empty when none was).
    pub forced: Vec<bool>,
}

/// The step to show: `step` when it has samples, else (`None`) the latest step with samples.
pub fn resolve_step(run: &RunDir, step: Option<u64>) -> ViewResult<(u64, Vec<u64>)> {
    let steps = run.sample_steps()?;
    let Some(&latest) = steps.last() else {
        return Err(ViewError::NoSamples {
            path: run.root().to_path_buf(),
        });
    };
    match step {
        None => Ok((latest, steps)),
        Some(s) if steps.contains(&s) => Ok((s, steps)),
        Some(s) => Err(ViewError::NoStep {
            path: run.root().to_path_buf(),
            step: s,
            available: list_steps(&steps),
        }),
    }
}

/// `1, 2, 5` (or `1, 2, …, 40` when long).
fn list_steps(steps: &[u64]) -> String {
    let all: Vec<String> = steps.iter().map(u64::to_string).collect();
    if all.len() <= 12 {
        return all.join(", ");
    }
    format!(
        "{}, …, {}",
        all[..3].join(", "),
        all[all.len() - 3..].join(", ")
    )
}

/// The page data of `step` (`None`: the latest with samples) of the run at `dir`.
pub fn page_data(dir: &Path, step: Option<u64>, served: bool) -> ViewResult<PageData> {
    let run = RunDir::open(dir)?;
    let (step, steps) = resolve_step(&run, step)?;
    let path = run.samples_path(step);
    let records = run.read_samples(step)?.unwrap_or_default();
    let config = run
        .read_config()
        .ok()
        .and_then(|t| t.parse::<toml::Table>().ok());
    let preset = config
        .as_ref()
        .and_then(|c| c.get("preset"))
        .and_then(|v| v.as_str())
        .map(String::from);
    let estimator = config
        .as_ref()
        .and_then(|c| c.get("advantage"))
        .and_then(|a| a.get("estimator"))
        .and_then(|v| v.as_str())
        .map(String::from);
    // Old lines carry no decoded text: decode with the run's tokenizer when it has one.
    let needs_text = records
        .iter()
        .any(|r| r.token_texts.is_empty() && r.trajectory.agent_token_count() > 0);
    let tokenizer = match needs_text {
        true => run_tokenizer(&run),
        false => None,
    };
    let mut notes = Vec::new();
    if needs_text {
        notes.push(match &tokenizer {
            Some(_) => "This samples file holds no decoded text: its tokens were decoded with the \
                        tokenizer of the run's latest checkpoint."
                .to_string(),
            None => "This samples file holds no decoded text and the run has no checkpoint \
                     tokenizer: tokens are shown as ids."
                .to_string(),
        });
    }
    if !records.is_empty() && records.iter().all(|r| r.advantages.is_none()) {
        notes.push(
            "No advantages recorded (samples written before turnwise saved them, or no episode \
             was trained on): colour by log-prob or entropy."
                .to_string(),
        );
    }
    let episodes = records
        .iter()
        .enumerate()
        .map(|(i, r)| episode_view(i, r, tokenizer.as_ref(), &path))
        .collect::<ViewResult<Vec<_>>>()?;
    let run_name = run
        .root()
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| run.root().display().to_string());
    Ok(PageData {
        run: run_name,
        preset,
        estimator,
        step,
        steps,
        served,
        notes,
        episodes,
    })
}

/// The tokenizer of the run's latest complete checkpoint, if it can be read.
fn run_tokenizer(run: &RunDir) -> Option<TextTokenizer> {
    let ck = run.latest_checkpoint().ok()??;
    match TextTokenizer::from_file(ck.path.join("tokenizer.json")) {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::warn!("cannot read the tokenizer of {}: {e}", ck.path.display());
            None
        }
    }
}

fn action_text(a: &TurnAction) -> String {
    match a {
        TurnAction::Search { query } => format!("search: {query}"),
        TurnAction::Answer { text } => format!("answer: {text}"),
        TurnAction::Move { action } => format!("move: {action}"),
        TurnAction::Invalid { reason } => format!("invalid: {reason}"),
    }
}

fn finish_text(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Answered => "answered",
        FinishReason::TurnLimit => "turn_limit",
        FinishReason::Length => "length",
        FinishReason::EnvDone => "env_done",
    }
}

/// One record as the page shows it; annotations whose lengths do not fit the trajectory are
/// an error naming the file and the episode.
fn episode_view(
    index: usize,
    r: &SampleRecord,
    tokenizer: Option<&TextTokenizer>,
    path: &Path,
) -> ViewResult<EpisodeView> {
    let t = &r.trajectory;
    check_annotations(r, path)?;
    let texts = token_texts(r, tokenizer);
    let mut turns = turn_views(r);
    let any_forced = fill_token_columns(r, &texts, &mut turns);
    finish_turns(&mut turns, any_forced);
    let prompt = match (&r.prompt_text, tokenizer) {
        (Some(p), _) => p.clone(),
        (None, Some(tok)) => tok
            .decode(&t.prompt_ids, false)
            .unwrap_or_else(|_| format!("{:?}", t.prompt_ids)),
        (None, None) => format!("{:?}", t.prompt_ids),
    };
    let reward = t.outcome_reward;
    Ok(EpisodeView {
        index,
        id: t.id.clone(),
        prompt_uid: t.prompt_uid.clone(),
        prompt,
        group: r.group.clone(),
        reward,
        score: r.score,
        em: r.em,
        correct: match r.em {
            Some(e) => Some(e > 0.0),
            None => reward.map(|x| x > 0.0),
        },
        finish: finish_text(t.finish).to_string(),
        format_ok: r.format_ok,
        answer: r.answer.clone(),
        gold: r.gold.clone(),
        trained: r.trained,
        turns,
    })
}

/// The record's trajectory is valid and its per-token annotations (advantages, clipped shares,
/// token texts) have one value per agent token; else an error naming the file and the episode.
fn check_annotations(r: &SampleRecord, path: &Path) -> ViewResult<()> {
    let t = &r.trajectory;
    let bad = |message: String| ViewError::Inconsistent {
        path: path.to_path_buf(),
        episode: t.id.clone(),
        message,
    };
    t.validate().map_err(|e| bad(e.to_string()))?;
    let n_tokens = t.agent_token_count();
    let per_token = |name: &str, v: &Option<Vec<f64>>| -> ViewResult<()> {
        match v {
            Some(v) if v.len() != n_tokens => Err(bad(format!(
                "{} {name} for {n_tokens} agent tokens",
                v.len()
            ))),
            _ => Ok(()),
        }
    };
    per_token("advantages", &r.advantages)?;
    per_token("clipped shares", &r.clipped)?;
    if !r.token_texts.is_empty() && r.token_texts.len() != n_tokens {
        return Err(bad(format!(
            "{} token texts for {n_tokens} agent tokens",
            r.token_texts.len()
        )));
    }
    Ok(())
}

/// The text of each agent token: recorded, decoded now, or the ids.
fn token_texts(r: &SampleRecord, tokenizer: Option<&TextTokenizer>) -> Vec<String> {
    if !r.token_texts.is_empty() {
        return r.token_texts.clone();
    }
    let mut out = Vec::with_capacity(r.trajectory.agent_token_count());
    for a in r.trajectory.agent_segments() {
        match tokenizer.map(|tok| tok.decode_pieces(&a.ids)) {
            Some(Ok(p)) => out.extend(p),
            _ => out.extend(a.ids.iter().map(|id| format!("⟨{id}⟩"))),
        }
    }
    out
}

/// One view per turn with its per-turn values, and empty token columns for the annotations the
/// record has.
fn turn_views(r: &SampleRecord) -> Vec<TurnView> {
    let t = &r.trajectory;
    (0..t.num_turns())
        .map(|k| {
            let rec = t.turns.get(k);
            let at = |v: &Option<Vec<f64>>| v.as_ref().and_then(|v| v.get(k).copied());
            TurnView {
                index: k,
                action: rec.map(|x| action_text(&x.action)).unwrap_or_default(),
                text: r
                    .turn_texts
                    .get(k)
                    .map(|x| x.agent.clone())
                    .unwrap_or_default(),
                observation: r
                    .turn_texts
                    .get(k)
                    .and_then(|x| x.observation.clone())
                    .or_else(|| rec.and_then(|x| x.observation.clone())),
                reward: t.turn_rewards.get(k).copied(),
                env_reward: rec.and_then(|x| x.env_reward),
                advantage: at(&r.turn_advantages),
                info_gain: at(&r.info_gain),
                channels: r
                    .channels
                    .iter()
                    .filter_map(|(c, v)| Some((c.key(), *v.get(k)?)))
                    .collect(),
                clipped: None,
                step_group: r.step_groups.as_ref().and_then(|v| v.get(k).cloned()),
                tokens: TokenColumns {
                    adv: r.advantages.as_ref().map(|_| Vec::new()),
                    entropy: Some(Vec::new()),
                    clipped: r.clipped.as_ref().map(|_| Vec::new()),
                    ..TokenColumns::default()
                },
            }
        })
        .collect()
}

/// Appends each agent token (id, text, log-prob, entropy, advantage, clipped share, forced) to
/// its turn's columns; returns, per turn, whether any of its tokens was forced.
fn fill_token_columns(r: &SampleRecord, texts: &[String], turns: &mut [TurnView]) -> Vec<bool> {
    let mut any_forced = vec![false; turns.len()];
    let mut k = 0usize;
    for seg in &r.trajectory.segments {
        let Segment::Agent(a) = seg else { continue };
        let turn = &mut turns[a.turn];
        let cols = &mut turn.tokens;
        for (j, &id) in a.ids.iter().enumerate() {
            cols.ids.push(id);
            cols.text.push(texts[k].clone());
            cols.logprob.push(a.logprobs.get(j).copied().unwrap_or(0.0));
            match (&mut cols.entropy, &a.entropy) {
                (Some(h), Some(e)) => h.push(e[j]),
                (slot, _) => *slot = None,
            }
            if let (Some(v), Some(src)) = (&mut cols.adv, &r.advantages) {
                v.push(src[k] as f32);
            }
            if let (Some(v), Some(src)) = (&mut cols.clipped, &r.clipped) {
                v.push(src[k] as f32);
            }
            let forced = a.is_forced(j);
            any_forced[a.turn] |= forced;
            cols.forced.push(forced);
            k += 1;
        }
    }
    any_forced
}

/// Per turn: the clipped share of its sampled tokens, no forced column when nothing was forced,
/// and the text of its tokens when no turn text was recorded.
fn finish_turns(turns: &mut [TurnView], any_forced: Vec<bool>) {
    for (turn, forced) in turns.iter_mut().zip(any_forced) {
        let cols = &mut turn.tokens;
        // The share of the turn's sampled tokens' update passes that clipped them.
        if let Some(c) = &cols.clipped {
            let sampled: Vec<f32> = c
                .iter()
                .zip(&cols.forced)
                .filter(|(_, f)| !**f)
                .map(|(&x, _)| x)
                .collect();
            if !sampled.is_empty() {
                turn.clipped = Some(f64::from(sampled.iter().sum::<f32>()) / sampled.len() as f64);
            }
        }
        if !forced {
            cols.forced.clear();
        }
        if turn.text.is_empty() {
            turn.text = cols.text.concat();
        }
    }
}

/// The page of `data`: the template with the data embedded as JSON (every `<` escaped, so no
/// text of an episode can close the script element).
pub fn render_page(data: &PageData) -> ViewResult<String> {
    let json = serde_json::to_string(data)?.replace('<', "\\u003c");
    let title = format!("{} · step {} · turnwise view", data.run, data.step);
    let title = title
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;");
    Ok(TEMPLATE
        .replacen("__TITLE__", &title, 1)
        .replacen("__DATA__", &json, 1))
}

/// The default page file of `step`: `<run>/view/step-N.html`.
pub fn default_page_path(dir: &Path, step: u64) -> PathBuf {
    dir.join(super::dir::VIEW)
        .join(format!("step-{step:05}.html"))
}

/// Writes the page of `step` (`None`: the latest step with samples) of the run at `dir` to
/// `out` (default [`default_page_path`]); returns the file and the step.
pub fn write_view(dir: &Path, step: Option<u64>, out: Option<&Path>) -> ViewResult<(PathBuf, u64)> {
    let data = page_data(dir, step, false)?;
    let html = render_page(&data)?;
    let path = match out {
        Some(p) => p.to_path_buf(),
        None => default_page_path(dir, data.step),
    };
    let write_err = |cause| ViewError::Write {
        path: path.clone(),
        cause,
    };
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(write_err)?;
    }
    crate::ownership::may_write(&path)
        .map_err(|e| write_err(std::io::Error::other(e.to_string())))?;
    std::fs::write(&path, html).map_err(write_err)?;
    Ok((path, data.step))
}

/// The viewer's routes: `GET /` answers the page of the latest step with samples, `GET
/// /?step=N` that of step N (read afresh on every request, so a running training's new steps
/// appear on reload); anything else is 404.
pub fn router(dir: PathBuf) -> axum::Router {
    use axum::extract::Query;
    use axum::http::{StatusCode, header};
    use axum::response::IntoResponse;
    let page = move |Query(q): Query<HashMap<String, String>>| {
        let dir = dir.clone();
        async move {
            let step = match q.get("step").map(|s| s.parse::<u64>()) {
                None => None,
                Some(Ok(s)) => Some(s),
                Some(Err(_)) => {
                    return (StatusCode::BAD_REQUEST, "step must be a whole number")
                        .into_response();
                }
            };
            let built = tokio::task::spawn_blocking(move || {
                page_data(&dir, step, true).and_then(|d| render_page(&d))
            })
            .await;
            match built {
                Ok(Ok(html)) => {
                    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], html).into_response()
                }
                Ok(Err(e @ ViewError::NoStep { .. }))
                | Ok(Err(e @ ViewError::NoSamples { .. })) => {
                    (StatusCode::NOT_FOUND, e.to_string()).into_response()
                }
                Ok(Err(e)) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
                Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
            }
        }
    };
    axum::Router::new().route("/", axum::routing::get(page))
}

/// How long a client may take to send a request's headers.
pub const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves the viewer of the run at `dir` on `addr` in the background (port 0: a free port);
/// the run must have samples. Dropping the server stops it.
pub fn serve_view(
    dir: &Path,
    addr: SocketAddr,
) -> ViewResult<turnwise_env::server::BackgroundServer> {
    resolve_step(&RunDir::open(dir)?, None)?;
    Ok(turnwise_env::server::BackgroundServer::start_router(
        "viewer",
        router(dir.to_path_buf()),
        addr,
        READ_TIMEOUT,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::TurnText;
    use turnwise_core::trajectory::{AgentSegment, EnvSegment, Trajectory, TurnRecord};

    fn record() -> SampleRecord {
        let mut t = Trajectory::new("ep-1", "q-7", vec![1, 2]);
        let mut a0 = AgentSegment::new(0, vec![5, 6, 7], vec![-0.1, -2.0, -0.3]);
        a0.entropy = Some(vec![0.5, 1.5, 0.2]);
        t.push(Segment::Agent(a0));
        t.push(Segment::Env(EnvSegment { ids: vec![9, 9] }));
        let mut a1 = AgentSegment::new(1, vec![8], vec![-0.4]);
        a1.entropy = Some(vec![0.1]);
        t.push(Segment::Agent(a1));
        for (i, action) in [
            TurnAction::Search {
                query: "who".into(),
            },
            TurnAction::Answer { text: "Bo".into() },
        ]
        .into_iter()
        .enumerate()
        {
            t.turns.push(TurnRecord {
                index: i,
                action,
                format_ok: true,
                observation: (i == 0).then(|| "<information>Bo</information>".into()),
                searches_so_far: 1,
                env_reward: None,
                anchor: None,
            });
        }
        t.outcome_reward = Some(1.0);
        let mut r = SampleRecord::new(t);
        r.prompt_text = Some("Who? </script><b>".into());
        r.turn_texts = vec![
            TurnText {
                agent: "<search>who</search>".into(),
                observation: Some("<information>Bo</information>".into()),
            },
            TurnText {
                agent: "<answer>Bo</answer>".into(),
                observation: None,
            },
        ];
        r.token_texts = vec![
            "<search>".into(),
            "who".into(),
            "</search>".into(),
            "Bo".into(),
        ];
        r.advantages = Some(vec![0.5, 0.5, 0.5, -0.25]);
        r.turn_advantages = Some(vec![0.5, -0.25]);
        r.info_gain = Some(vec![0.3]);
        r.clipped = Some(vec![0.0, 1.0, 0.0, 0.0]);
        r.em = Some(1.0);
        r.group = Some(SampleGroup {
            id: 0,
            size: 3,
            mean: 0.5,
            std: 0.5,
        });
        r
    }

    /// Tokens land in their turns with their numbers, the turn's clipped share is the mean of
    /// its tokens', the process turn gets its IG, and the page escapes every `<` of the data.
    #[test]
    fn episodes_are_laid_out_per_turn_and_the_page_is_safe() {
        let r = record();
        let ep = episode_view(0, &r, None, Path::new("s.jsonl")).unwrap();
        assert_eq!(ep.turns.len(), 2);
        let t0 = &ep.turns[0];
        assert_eq!(t0.tokens.ids, vec![5, 6, 7]);
        assert_eq!(t0.tokens.adv.as_deref(), Some(&[0.5f32, 0.5, 0.5][..]));
        assert_eq!(t0.tokens.entropy.as_deref(), Some(&[0.5f32, 1.5, 0.2][..]));
        assert!((t0.clipped.unwrap() - 1.0 / 3.0).abs() < 1e-6);
        assert_eq!((t0.info_gain, ep.turns[1].info_gain), (Some(0.3), None));
        assert_eq!(t0.action, "search: who");
        assert_eq!(ep.turns[1].tokens.text, vec!["Bo"]);
        assert_eq!(ep.turns[1].advantage, Some(-0.25));
        assert_eq!(ep.correct, Some(true));

        let mut wrong = r.clone();
        wrong.advantages = Some(vec![0.5]);
        let err = episode_view(0, &wrong, None, Path::new("s.jsonl"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("ep-1") && err.contains("1 advantages for 4"),
            "{err}"
        );

        // An old line: ids, log-probs and entropies only.
        let old = SampleRecord::new(r.trajectory.clone());
        let ep = episode_view(0, &old, None, Path::new("s.jsonl")).unwrap();
        assert_eq!(ep.turns[0].tokens.text[0], "⟨5⟩");
        assert!(ep.turns[0].tokens.adv.is_none() && ep.group.is_none());
        assert_eq!(
            ep.turns[0].observation.as_deref(),
            Some("<information>Bo</information>")
        );

        let data = PageData {
            run: "r<1>".into(),
            preset: Some("grpo".into()),
            estimator: Some("grpo".into()),
            step: 2,
            steps: vec![1, 2],
            served: false,
            notes: Vec::new(),
            episodes: vec![episode_view(0, &r, None, Path::new("s.jsonl")).unwrap()],
        };
        let html = render_page(&data).unwrap();
        let script = html.split("id=\"data\">").nth(1).unwrap();
        let json = script.split("</script>").next().unwrap();
        assert!(!json.contains('<'), "{json}");
        let back: serde_json::Value = serde_json::from_str(json).unwrap();
        assert_eq!(back["episodes"][0]["prompt"], "Who? </script><b>");
        assert!(html.contains("<title>r&lt;1&gt; · step 2"));
        assert_eq!(
            list_steps(&(1..=40).collect::<Vec<_>>()),
            "1, 2, 3, …, 38, 39, 40"
        );
    }
}
