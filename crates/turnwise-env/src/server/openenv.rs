//! turnwise's environments served with OpenEnv's protocol (`turnwise serve-env`), so that
//! OpenEnv clients (`EnvClient`, `GenericEnvClient`, TRL's and AgileRL's OpenEnv integrations)
//! can play them. The protocol is that of `openenv-core` 0.3 (see [`crate::env::openenv`] for
//! the client side).
//!
//! # Routes
//!
//! | route | answer |
//! |---|---|
//! | `GET /ws` | the WebSocket session: one environment per connection (below) |
//! | `GET /health` | `{"status": "healthy"}` |
//! | `GET /metadata` | `{"name", "description", "version"}` |
//! | `GET /schema` | the JSON schemas of the action, the observation and the state |
//! | `POST /reset` | one reset on a fresh environment (stateless, as in OpenEnv 0.3): `{"observation", "reward": null, "done": false}` |
//! | `POST /step` | 400: a step needs its episode, which only the `/ws` session keeps |
//! | `GET /state` | `{"episode_id": null, "step_count": 0}` (stateless) |
//! | `POST /mcp` | JSON-RPC 2.0: `tools/list` answers no tools (the environment is not an MCP one) |
//! | `GET /openapi.json` | the routes, for OpenEnv's `validate` |
//!
//! # Session (`/ws`)
//!
//! Messages are OpenEnv's: `{"type": "reset", "data": {…}}`, `{"type": "step", "data":
//! {"message": "…"}}`, `{"type": "state"}` and `{"type": "close"}`, answered with
//! `{"type": "observation", "data": {"observation": {…}, "reward": …, "done": …}}`,
//! `{"type": "state", "data": {…}}` or `{"type": "error", "data": {"message", "code"}}`.
//!
//! A reset picks the episode: `split` (`"train"`, `"validation"` or `"test"`, default
//! `"train"`) and `index` (the episode's position in the split), or `seed` (index = seed modulo
//! the split's size), or neither (a random episode); `episode_id` names it. The observation is
//! `{"text", "prompt", "question_id", "split", "index", "valid_action", "won", "truncated",
//! "feedback"}`: at the reset `text` is the question (a game's rules and board) and `prompt` the
//! whole prompt turnwise would give the model; after a step `text` is what the environment
//! shows the agent (the agent format's observation block, a game's board) and `prompt` is
//! empty. A step's action is `{"message": the agent's whole turn text}`; the environment parses
//! it with the agent format, as in turnwise's own rollouts. The step's `reward` is the
//! environment's (EM of an answer, a game's return).
//!
//! At most [`EnvServerConfig::max_sessions`] sessions run at once; a further connection is
//! answered `CAPACITY_REACHED` and closed. A session that sends no message for
//! [`EnvServerConfig::idle_timeout`] (pings do not count: a client library pings on its own
//! while its program hangs), or does not take an answer within it, is answered
//! `SESSION_TIMEOUT` and closed, and its capacity freed: a hung trainer, a half-open connection
//! or a client holding sessions it never uses cannot lock the server out.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::extract::State;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Map, Value, json};
use tokio::sync::Semaphore;

use crate::env::{Environment, StepResult, Task};
use crate::world::Split;

/// One episode a reset can start.
#[derive(Debug, Clone, PartialEq)]
pub struct ServedEpisode {
    /// The environment task (id, seed, question, golden answers).
    pub task: Task,
    /// The question the agent reads first (a game's rules and board).
    pub text: String,
    /// The whole prompt turnwise would give the model for it.
    pub prompt: String,
}

/// What `turnwise serve-env` serves: the episodes of each split and fresh environments.
pub trait EpisodeSource: Send + Sync + 'static {
    /// The environment's name (`/metadata`).
    fn name(&self) -> String;
    /// What it is (`/metadata`).
    fn description(&self) -> String;
    /// How many episodes `split` has.
    fn len(&self, split: Split) -> usize;
    /// Episode `index` of `split` (`index < len(split)`).
    fn episode(&self, split: Split, index: usize) -> Result<ServedEpisode, String>;
    /// A fresh environment (one per session).
    fn new_env(&self) -> Result<Box<dyn Environment>, String>;
}

/// Settings of the OpenEnv server.
#[derive(Debug, Clone, PartialEq)]
pub struct EnvServerConfig {
    /// Most WebSocket sessions at once. Default 256.
    pub max_sessions: usize,
    /// Largest WebSocket message in bytes. Default 16 MiB.
    pub max_message_bytes: usize,
    /// How long a session may go without sending a message (pings aside), or take to receive
    /// an answer, before it is closed and its capacity freed. Default
    /// [`DEFAULT_IDLE_TIMEOUT`].
    pub idle_timeout: std::time::Duration,
}

/// Default [`EnvServerConfig::idle_timeout`]: 10 minutes, longer than a trainer's generation
/// step between two actions of one episode on a CPU.
pub const DEFAULT_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

impl Default for EnvServerConfig {
    fn default() -> Self {
        Self {
            max_sessions: 256,
            max_message_bytes: 16 << 20,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
        }
    }
}

struct EnvState {
    source: Arc<dyn EpisodeSource>,
    config: EnvServerConfig,
    sessions: Arc<Semaphore>,
    counter: AtomicU64,
}

/// The router of an OpenEnv server of `source` (see the module docs).
pub fn router(source: Arc<dyn EpisodeSource>, config: EnvServerConfig) -> Router {
    let state = Arc::new(EnvState {
        sessions: Arc::new(Semaphore::new(config.max_sessions)),
        source,
        config,
        counter: AtomicU64::new(0),
    });
    Router::new()
        .route("/ws", get(ws_handler))
        .route(
            "/health",
            get(|| async { axum::Json(json!({"status": "healthy"})) }),
        )
        .route("/metadata", get(metadata_handler))
        .route("/schema", get(|| async { axum::Json(schemas()) }))
        .route("/reset", post(reset_handler))
        .route("/step", post(step_handler))
        .route(
            "/state",
            get(|| async { axum::Json(json!({"episode_id": null, "step_count": 0})) }),
        )
        .route("/mcp", post(mcp_handler))
        .route("/openapi.json", get(|| async { axum::Json(openapi()) }))
        .fallback(|uri: axum::http::Uri| async move {
            (
                StatusCode::NOT_FOUND,
                axum::Json(json!({"detail": format!(
                    "no route for {uri}; an OpenEnv server has /ws, /health, /schema, /metadata, \
                     /reset, /step, /state, /mcp"
                )})),
            )
        })
        .with_state(state)
}

async fn metadata_handler(State(state): State<Arc<EnvState>>) -> axum::Json<Value> {
    axum::Json(json!({
        "name": state.source.name(),
        "description": state.source.description(),
        "version": env!("CARGO_PKG_VERSION"),
        "author": "turnwise",
    }))
}

/// The JSON schemas of `/schema`.
fn schemas() -> Value {
    json!({
        "action": {
            "title": "TurnAction",
            "type": "object",
            "properties": {
                "message": {"type": "string", "description": "The agent's whole turn text"},
                "metadata": {"type": "object"}
            },
            "required": ["message"]
        },
        "observation": {
            "title": "TurnObservation",
            "type": "object",
            "properties": {
                "text": {"type": "string", "description": "The question at the reset, then what the environment shows the agent"},
                "prompt": {"type": "string", "description": "The whole prompt turnwise gives the model (at the reset only)"},
                "question_id": {"type": "string"},
                "split": {"type": "string", "enum": ["train", "validation", "test"]},
                "index": {"type": "integer"},
                "valid_action": {"type": "boolean"},
                "won": {"type": "boolean"},
                "truncated": {"type": "boolean"},
                "feedback": {"type": ["string", "null"]},
                "done": {"type": "boolean"},
                "reward": {"type": ["number", "null"]}
            }
        },
        "state": {
            "title": "State",
            "type": "object",
            "properties": {
                "episode_id": {"type": ["string", "null"]},
                "step_count": {"type": "integer", "minimum": 0},
                "question_id": {"type": ["string", "null"]},
                "split": {"type": ["string", "null"]},
                "index": {"type": ["integer", "null"]}
            }
        }
    })
}

/// A minimal OpenAPI document naming the routes (OpenEnv's `validate` reads its version and
/// paths).
fn openapi() -> Value {
    let op =
        |summary: &str| json!({"summary": summary, "responses": {"200": {"description": "OK"}}});
    json!({
        "openapi": "3.1.0",
        "info": {"title": "turnwise serve-env (OpenEnv protocol)", "version": "1.0.0"},
        "paths": {
            "/reset": {"post": op("Reset a fresh environment (stateless)")},
            "/step": {"post": op("Steps need the /ws session")},
            "/state": {"get": op("State of a fresh environment")},
            "/health": {"get": op("Health")},
            "/metadata": {"get": op("Environment metadata")},
            "/schema": {"get": op("Action, observation and state schemas")},
            "/mcp": {"post": op("JSON-RPC (no tools)")}
        }
    })
}

/// An error of a session message: OpenEnv's `{"type": "error", "data": {"message", "code"}}`.
#[derive(Debug)]
struct SessionError {
    code: &'static str,
    message: String,
}

impl SessionError {
    fn new(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    fn to_json(&self) -> Value {
        json!({"type": "error", "data": {"message": self.message, "code": self.code}})
    }
}

/// Which episode a reset asks for.
fn pick_episode(
    state: &EnvState,
    data: &Map<String, Value>,
) -> Result<(Split, usize, Option<String>), SessionError> {
    let invalid = |m: String| SessionError::new("VALIDATION_ERROR", m);
    let split = match data.get("split") {
        None | Some(Value::Null) => Split::Train,
        Some(Value::String(s)) => {
            Split::ALL
                .into_iter()
                .find(|x| x.name() == s)
                .ok_or_else(|| {
                    invalid(format!(
                        "split must be train, validation or test, got {s:?}"
                    ))
                })?
        }
        Some(other) => return Err(invalid(format!("split must be a string, got {other}"))),
    };
    let n = state.source.len(split);
    if n == 0 {
        return Err(SessionError::new(
            "EXECUTION_ERROR",
            format!("the {} split has no episodes", split.name()),
        ));
    }
    let int = |key: &str| -> Result<Option<u64>, SessionError> {
        match data.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| invalid(format!("{key} must be a non-negative integer, got {v}"))),
        }
    };
    let index = match (int("index")?, int("seed")?) {
        (Some(i), _) if i as usize >= n || i > usize::MAX as u64 => {
            return Err(invalid(format!(
                "index {i} is out of range: the {} split has {n} episodes",
                split.name()
            )));
        }
        (Some(i), _) => i as usize,
        (None, Some(seed)) => (seed % n as u64) as usize,
        (None, None) => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            let mut rng = turnwise_core::control::SplitMix64::new(
                nanos
                    ^ state
                        .counter
                        .fetch_add(1, Ordering::Relaxed)
                        .rotate_left(32),
            );
            rng.below(n)
        }
    };
    let episode_id = match data.get("episode_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(other) => return Err(invalid(format!("episode_id must be a string, got {other}"))),
    };
    Ok((split, index, episode_id))
}

/// The episode running in a session.
#[derive(Debug, Clone)]
struct Current {
    episode_id: String,
    question_id: String,
    split: Split,
    index: usize,
    steps: usize,
    done: bool,
}

fn observation_message(
    current: &Current,
    text: &str,
    prompt: &str,
    step: Option<&StepResult>,
) -> Value {
    let info = step.map(|s| &s.info);
    json!({
        "observation": {
            "text": text,
            "prompt": prompt,
            "question_id": current.question_id,
            "split": current.split.name(),
            "index": current.index,
            "valid_action": info.is_none_or(|i| i.valid_action),
            "won": info.is_some_and(|i| i.won),
            "truncated": info.is_some_and(|i| i.truncated),
            "feedback": info.and_then(|i| i.feedback.clone()),
        },
        "reward": step.map(|s| s.reward),
        "done": step.is_some_and(|s| s.done),
    })
}

/// Resets `env` (on the blocking pool) to the episode `data` asks for.
async fn reset_env(
    state: &Arc<EnvState>,
    env: Box<dyn Environment>,
    data: &Map<String, Value>,
) -> (
    Option<Box<dyn Environment>>,
    Result<(Current, Value), SessionError>,
) {
    let (split, index, episode_id) = match pick_episode(state, data) {
        Ok(p) => p,
        Err(e) => return (Some(env), Err(e)),
    };
    let episode = match state.source.episode(split, index) {
        Ok(e) => e,
        Err(m) => return (Some(env), Err(SessionError::new("EXECUTION_ERROR", m))),
    };
    let task = episode.task.clone();
    let joined = tokio::task::spawn_blocking(move || {
        let mut env = env;
        let r = env.reset(&task).map(|_| ());
        (env, r)
    })
    .await;
    let Ok((env, result)) = joined else {
        return (
            None,
            Err(SessionError::new(
                "SESSION_ERROR",
                "the environment's reset panicked",
            )),
        );
    };
    if let Err(e) = result {
        return (
            Some(env),
            Err(SessionError::new("EXECUTION_ERROR", e.to_string())),
        );
    }
    let n = state.counter.fetch_add(1, Ordering::Relaxed);
    let current = Current {
        episode_id: episode_id.unwrap_or_else(|| format!("{}-{n}", episode.task.id)),
        question_id: episode.task.id.clone(),
        split,
        index,
        steps: 0,
        done: false,
    };
    let message = observation_message(&current, &episode.text, &episode.prompt, None);
    (Some(env), Ok((current, message)))
}

async fn ws_handler(ws: WebSocketUpgrade, State(state): State<Arc<EnvState>>) -> Response {
    let max = state.config.max_message_bytes;
    ws.max_message_size(max)
        .on_upgrade(move |socket| session(socket, state))
}

/// Sends `value`; `false` when the connection failed or the client did not take it within
/// `timeout` (a client that stopped reading).
async fn send(socket: &mut WebSocket, value: &Value, timeout: std::time::Duration) -> bool {
    matches!(
        tokio::time::timeout(
            timeout,
            socket.send(Message::Text(value.to_string().into()))
        )
        .await,
        Ok(Ok(()))
    )
}

/// One WebSocket session: its own environment, until `close` or the connection ends.
async fn session(mut socket: WebSocket, state: Arc<EnvState>) {
    let idle = state.config.idle_timeout;
    let Some((_permit, mut env)) = open_session(&mut socket, &state).await else {
        let _ = tokio::time::timeout(idle, socket.send(Message::Close(None))).await;
        return;
    };
    let mut current: Option<Current> = None;
    // The idle deadline moves with each message, not with pings.
    let mut deadline = tokio::time::Instant::now() + idle;
    loop {
        let text = match next_text(&mut socket, deadline, idle).await {
            Received::Text(t) => t,
            Received::Skip => continue,
            Received::End => break,
        };
        deadline = tokio::time::Instant::now() + idle;
        let message: Value = match serde_json::from_str(&text) {
            Ok(v) => v,
            Err(e) => {
                let e = SessionError::new("INVALID_JSON", format!("Invalid JSON: {e}"));
                if !send(&mut socket, &e.to_json(), idle).await {
                    break;
                }
                continue;
            }
        };
        let kind = message.get("type").and_then(Value::as_str).unwrap_or("");
        let empty = Map::new();
        let data = message
            .get("data")
            .and_then(Value::as_object)
            .unwrap_or(&empty);
        let answer: Result<Value, SessionError> = match kind {
            "reset" => {
                let (back, result) = reset_env(&state, env, data).await;
                let Some(back) = back else {
                    let e = result.err().map_or(Value::Null, |e| e.to_json());
                    send(&mut socket, &e, idle).await;
                    break;
                };
                env = back;
                result.map(|(c, obs)| {
                    current = Some(c);
                    json!({"type": "observation", "data": obs})
                })
            }
            "step" => {
                let (back, answer) = step_env(env, current.as_mut(), data).await;
                let Some(back) = back else {
                    // The environment panicked and is gone: the session ends.
                    let e = answer.err().map_or(Value::Null, |e| e.to_json());
                    send(&mut socket, &e, idle).await;
                    break;
                };
                env = back;
                answer
            }
            "state" => Ok(json!({"type": "state", "data": state_data(current.as_ref())})),
            "close" => break,
            other => Err(SessionError::new(
                "UNKNOWN_TYPE",
                format!("Unknown message type: {other}"),
            )),
        };
        let reply = answer.unwrap_or_else(|e| e.to_json());
        if !send(&mut socket, &reply, idle).await {
            break;
        }
        deadline = tokio::time::Instant::now() + idle;
    }
    let _ = tokio::time::timeout(idle, socket.send(Message::Close(None))).await;
}

/// A session's slot and environment; `None`, after telling the client why, when the server is
/// at capacity or the factory failed (the caller closes the connection).
async fn open_session(
    socket: &mut WebSocket,
    state: &Arc<EnvState>,
) -> Option<(tokio::sync::OwnedSemaphorePermit, Box<dyn Environment>)> {
    let idle = state.config.idle_timeout;
    let Ok(permit) = state.sessions.clone().try_acquire_owned() else {
        let max = state.config.max_sessions;
        let e = json!({"type": "error", "data": {
            "message": format!("server at capacity: {max} sessions of {max} active"),
            "code": "CAPACITY_REACHED",
            "active_sessions": max,
            "max_sessions": max,
        }});
        send(socket, &e, idle).await;
        return None;
    };
    let source = Arc::clone(&state.source);
    let error = match tokio::task::spawn_blocking(move || source.new_env()).await {
        Ok(Ok(env)) => return Some((permit, env)),
        Ok(Err(m)) => SessionError::new("FACTORY_ERROR", m),
        Err(e) => SessionError::new("FACTORY_ERROR", format!("the factory panicked: {e}")),
    };
    send(socket, &error.to_json(), idle).await;
    None
}

/// What the next message of a session is.
enum Received {
    /// A text (or binary, read as UTF-8) message.
    Text(String),
    /// A ping or pong: nothing to answer.
    Skip,
    /// The connection closed, failed, or stayed idle past its deadline (the client was told).
    End,
}

/// The next message of `socket`, waiting until `deadline`.
async fn next_text(
    socket: &mut WebSocket,
    deadline: tokio::time::Instant,
    idle: std::time::Duration,
) -> Received {
    let received = match tokio::time::timeout_at(deadline, socket.recv()).await {
        Ok(Some(received)) => received,
        Ok(None) => return Received::End,
        Err(_) => {
            tracing::debug!(
                idle_secs = idle.as_secs_f64(),
                "closing an idle OpenEnv session"
            );
            let e = SessionError::new(
                "SESSION_TIMEOUT",
                format!(
                    "no message for {:.0} s: the session is closed and its capacity freed \
                     (turnwise serve-env --idle-timeout-secs)",
                    idle.as_secs_f64()
                ),
            );
            send(socket, &e.to_json(), idle).await;
            return Received::End;
        }
    };
    match received {
        Ok(Message::Text(t)) => Received::Text(t.as_str().to_owned()),
        Ok(Message::Binary(b)) => Received::Text(String::from_utf8_lossy(&b).into_owned()),
        Ok(Message::Ping(_) | Message::Pong(_)) => Received::Skip,
        Ok(Message::Close(_)) | Err(_) => Received::End,
    }
}

/// A `step` message: the episode's next turn on `env`, and the environment back (`None` when
/// its step panicked and it is gone).
async fn step_env(
    env: Box<dyn Environment>,
    current: Option<&mut Current>,
    data: &Map<String, Value>,
) -> (Option<Box<dyn Environment>>, Result<Value, SessionError>) {
    let turn = match data.get("message") {
        Some(Value::String(t)) => Ok(t.clone()),
        Some(other) => Err(SessionError::new(
            "VALIDATION_ERROR",
            format!("message must be a string, got {other}"),
        )),
        None => Err(SessionError::new(
            "VALIDATION_ERROR",
            "the action must be {\"message\": \"the agent's turn text\"}",
        )),
    };
    let refused = |m: &str| Err(SessionError::new("EXECUTION_ERROR", m));
    let (c, turn) = match (current, turn) {
        (None, _) => {
            return (
                Some(env),
                refused("step before reset: send {\"type\": \"reset\"} first"),
            );
        }
        (Some(c), _) if c.done => {
            return (
                Some(env),
                refused("the episode is over: send {\"type\": \"reset\"} for the next one"),
            );
        }
        (Some(_), Err(e)) => return (Some(env), Err(e)),
        (Some(c), Ok(turn)) => (c, turn),
    };
    let joined = tokio::task::spawn_blocking(move || {
        let mut env = env;
        let r = env.step(&turn);
        (env, r)
    })
    .await;
    let Ok((back, result)) = joined else {
        return (
            None,
            Err(SessionError::new(
                "SESSION_ERROR",
                "the environment's step panicked",
            )),
        );
    };
    let answer = result
        .map(|step| {
            c.steps += 1;
            c.done = step.done;
            let obs = observation_message(c, &step.observation.text, "", Some(&step));
            json!({"type": "observation", "data": obs})
        })
        .map_err(|e| SessionError::new("EXECUTION_ERROR", e.to_string()));
    (Some(back), answer)
}

/// The `data` of a `state` answer: the current episode's, or an empty one before any reset.
fn state_data(current: Option<&Current>) -> Value {
    match current {
        Some(c) => json!({
            "episode_id": c.episode_id,
            "step_count": c.steps,
            "question_id": c.question_id,
            "split": c.split.name(),
            "index": c.index,
            "done": c.done,
        }),
        None => json!({"episode_id": null, "step_count": 0}),
    }
}

/// `POST /reset`: one reset on a fresh environment, as OpenEnv 0.3's stateless HTTP route.
async fn reset_handler(State(state): State<Arc<EnvState>>, body: axum::body::Bytes) -> Response {
    let data: Map<String, Value> = if body.iter().all(u8::is_ascii_whitespace) {
        Map::new()
    } else {
        match serde_json::from_slice::<Value>(&body) {
            Ok(Value::Object(m)) => m,
            Ok(other) => {
                return detail(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    format!("the body must be a JSON object, got {other}"),
                );
            }
            Err(e) => return detail(StatusCode::BAD_REQUEST, format!("invalid JSON: {e}")),
        }
    };
    let source = Arc::clone(&state.source);
    let env = match tokio::task::spawn_blocking(move || source.new_env()).await {
        Ok(Ok(env)) => env,
        Ok(Err(m)) => return detail(StatusCode::INTERNAL_SERVER_ERROR, m),
        Err(e) => return detail(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    };
    match reset_env(&state, env, &data).await.1 {
        Ok((_, obs)) => axum::Json(obs).into_response(),
        Err(e) if e.code == "VALIDATION_ERROR" => {
            detail(StatusCode::UNPROCESSABLE_ENTITY, e.message)
        }
        Err(e) => detail(StatusCode::INTERNAL_SERVER_ERROR, e.message),
    }
}

/// `POST /step`: refused, with why (OpenEnv 0.3's HTTP step runs on a fresh environment, and
/// turnwise's environments have no episode before a reset).
async fn step_handler() -> Response {
    detail(
        StatusCode::BAD_REQUEST,
        "POST /step is stateless in OpenEnv's HTTP protocol (every request gets a fresh \
         environment) and a turnwise environment has no episode before its reset: play episodes \
         over the WebSocket session at /ws (openenv's EnvClient or GenericEnvClient)"
            .to_owned(),
    )
}

/// `POST /mcp`: JSON-RPC 2.0 with no tools.
async fn mcp_handler(body: axum::body::Bytes) -> axum::Json<Value> {
    let request: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return axum::Json(json!({"jsonrpc": "2.0", "id": null,
                "error": {"code": -32700, "message": format!("Parse error: {e}")}}));
        }
    };
    let id = request.get("id").cloned().unwrap_or(Value::Null);
    let answer = match request.get("method").and_then(Value::as_str) {
        Some("tools/list") => json!({"jsonrpc": "2.0", "id": id, "result": {"tools": []}}),
        Some(m) => json!({"jsonrpc": "2.0", "id": id,
            "error": {"code": -32601, "message": format!("Method not found: {m} (this environment has no MCP tools)")}}),
        None => json!({"jsonrpc": "2.0", "id": id,
            "error": {"code": -32600, "message": "Invalid request: no method"}}),
    };
    axum::Json(answer)
}

fn detail(status: StatusCode, message: String) -> Response {
    (status, axum::Json(json!({"detail": message}))).into_response()
}
