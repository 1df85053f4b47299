//! A client of OpenEnv environment servers (Hugging Face / Meta `openenv-core`): any environment
//! served with OpenEnv's protocol becomes an [`Environment`] ([`OpenEnvEnv`]).
//!
//! # Protocol (openenv-core 0.3)
//!
//! An OpenEnv server answers `GET /health` with `{"status": "healthy"}`, `GET /schema` with the
//! JSON schemas of its action, observation and state, and `POST /reset`, `POST /step` and
//! `GET /state` over plain HTTP. Those HTTP routes are **stateless** in 0.3: every request gets
//! a fresh environment that is closed after it (`http_server.py`, `reset_handler` and
//! `step_handler`), so an episode cannot be played over them. Episodes run over the WebSocket
//! session at `/ws`, which keeps one environment instance per connection, as OpenEnv's own
//! `EnvClient` does:
//!
//! - `{"type": "reset", "data": {"seed": 3, …}}` (reset keyword arguments) and
//!   `{"type": "step", "data": {"message": "…"}}` (the action's fields) are answered with
//!   `{"type": "observation", "data": {"observation": {…}, "reward": 1.0, "done": false}}`;
//! - `{"type": "state"}` with `{"type": "state", "data": {"episode_id": …, "step_count": …}}`;
//! - `{"type": "close"}` ends the session;
//! - a failure is answered `{"type": "error", "data": {"message": "…", "code": "…"}}` (codes
//!   `INVALID_JSON`, `UNKNOWN_TYPE`, `VALIDATION_ERROR`, `EXECUTION_ERROR`,
//!   `CAPACITY_REACHED`, `FACTORY_ERROR`, `SESSION_ERROR`; `turnwise serve-env` adds
//!   `SESSION_TIMEOUT` for a session idle past its `--idle-timeout-secs`).
//!
//! The observation's `reward` and `done` travel beside it (its `metadata` is not sent). The
//! server allows `max_concurrent_envs` sessions at once (1 by default): a rollout keeps one
//! session per live episode, so the server must allow as many as run at once.
//!
//! # The environment
//!
//! [`OpenEnvEnv`] resets its session with the configured keyword arguments plus the episode's
//! seed ([`Task::seed`]), sends each agent turn as an action (the action block's content per the
//! agent format, or the whole turn text, [`ActionText`]), and shows the agent the observation's
//! text fields wrapped per the agent format ([`OpenEnvSettings::observation_template`]). The
//! step's reward is the observation's `reward` (0 when `null`), `done` ends the episode, and the
//! episode counts as a success when the sum of its rewards reaches
//! [`OpenEnvSettings::success_reward`].
//!
//! Errors name the server's URL, the request (reset with its seed, step `k`) and what the server
//! said; every read and write has a timeout, and a dead server is an error at once (no retry: a
//! step changes the server's state).

use std::io::ErrorKind;
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use serde_json::{Map, Value, json};
use tungstenite::protocol::WebSocketConfig;
use tungstenite::{Message, WebSocket};
use turnwise_core::grammar::{Action, Format, parse_turn, t2po};

use super::{EnvError, Environment, Observation, StepInfo, StepResult, Task};
use crate::client::error_chain;

/// The placeholder of [`OpenEnvSettings::observation_template`] the observation text replaces.
pub const OBSERVATION_PLACEHOLDER: &str = "{observation}";

/// Timeouts of an OpenEnv client.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OpenEnvTimeouts {
    /// Limit for the TCP connection and the WebSocket handshake. Default 10 s (as `EnvClient`).
    pub connect: Duration,
    /// Limit for one answer (a reset or a step running on the server). Default 60 s (as
    /// `EnvClient`'s `message_timeout_s`).
    pub message: Duration,
}

impl Default for OpenEnvTimeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(10),
            message: Duration::from_secs(60),
        }
    }
}

/// One answer to a reset or a step.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenEnvReply {
    /// The observation's fields (without `reward`, `done` and `metadata`).
    pub observation: Map<String, Value>,
    /// The reward (`None` when the server sent `null` or nothing).
    pub reward: Option<f64>,
    /// Whether the episode is over.
    pub done: bool,
}

/// The base URL of an OpenEnv server (`http://host:port` or `ws://host:port`, with an optional
/// path prefix) as `(http base, ws endpoint, host, port)`. TLS is not supported.
fn parse_url(base_url: &str) -> Result<(String, String, String, u16), String> {
    let url = reqwest::Url::parse(base_url.trim())
        .map_err(|e| format!("not a URL ({e}); expected http://HOST:PORT"))?;
    let (http, ws) = match url.scheme() {
        "http" | "ws" => ("http", "ws"),
        "https" | "wss" => {
            return Err(format!(
                "{}:// is not supported (no TLS in this build); reach the server over \
                 http:// (e.g. through an SSH tunnel or a local proxy)",
                url.scheme()
            ));
        }
        other => {
            return Err(format!(
                "unknown scheme {other:?}; expected http:// or ws://"
            ));
        }
    };
    let host = url
        .host_str()
        .ok_or_else(|| "the URL has no host".to_owned())?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let port = url.port().unwrap_or(80);
    let path = url.path().trim_end_matches('/');
    let authority = match url.port() {
        Some(p) => format!("{}:{p}", url.host_str().unwrap_or_default()),
        None => url.host_str().unwrap_or_default().to_owned(),
    };
    Ok((
        format!("{http}://{authority}{path}"),
        format!("{ws}://{authority}{path}/ws"),
        host,
        port,
    ))
}

/// Checks that an OpenEnv server answers `GET {base_url}/health` with a 2xx status and
/// `{"status": "healthy"}` within `timeout`. A refused connection, a timeout, another status or
/// another body is an error naming the URL.
pub fn check_health(base_url: &str, timeout: Duration) -> Result<(), EnvError> {
    let (http, ..) = parse_url(base_url).map_err(|message| EnvError::Remote {
        url: base_url.to_owned(),
        message,
    })?;
    let url = format!("{http}/health");
    let remote = |message: String| EnvError::Remote {
        url: url.clone(),
        message,
    };
    let client = reqwest::blocking::Client::builder()
        .timeout(timeout)
        .connect_timeout(timeout)
        .no_proxy()
        .build()
        .map_err(|e| remote(format!("cannot build the HTTP client: {}", error_chain(&e))))?;
    let response = client.get(&url).send().map_err(|e| {
        remote(format!(
            "no OpenEnv server answers: {} (is it running?)",
            error_chain(&e)
        ))
    })?;
    let status = response.status();
    let body = response.text().unwrap_or_default();
    if !status.is_success() {
        return Err(remote(format!("HTTP {status}: {}", snippet(&body))));
    }
    let value: Value = serde_json::from_str(&body).map_err(|e| {
        remote(format!(
            "malformed answer (not JSON: {e}), expected {{\"status\": \"healthy\"}}: {}",
            snippet(&body)
        ))
    })?;
    match value.get("status").and_then(Value::as_str) {
        Some("healthy") => Ok(()),
        _ => Err(remote(format!(
            "the server is not healthy: expected {{\"status\": \"healthy\"}}, got {}",
            snippet(&body)
        ))),
    }
}

/// At most 300 characters of `text`, for error messages.
fn snippet(text: &str) -> String {
    const MAX: usize = 300;
    match text.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_owned(),
    }
}

/// One WebSocket session with an OpenEnv server (`/ws`): one environment instance on the
/// server, kept across resets and steps until the session is closed or dropped.
pub struct OpenEnvSession {
    base_url: String,
    ws_url: String,
    socket: Option<WebSocket<TcpStream>>,
    timeouts: OpenEnvTimeouts,
}

impl std::fmt::Debug for OpenEnvSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenEnvSession")
            .field("ws_url", &self.ws_url)
            .field("open", &self.socket.is_some())
            .finish()
    }
}

impl OpenEnvSession {
    /// Opens a session with the server at `base_url` (`http://HOST:PORT` or `ws://HOST:PORT`):
    /// connects to `{base_url}/ws` within `timeouts.connect`.
    pub fn connect(base_url: &str, timeouts: OpenEnvTimeouts) -> Result<Self, EnvError> {
        let (http, ws_url, host, port) =
            parse_url(base_url).map_err(|message| EnvError::Remote {
                url: base_url.to_owned(),
                message,
            })?;
        let remote = |message: String| EnvError::Remote {
            url: ws_url.clone(),
            message,
        };
        let addrs: Vec<_> = (host.as_str(), port)
            .to_socket_addrs()
            .map_err(|e| remote(format!("cannot resolve {host}:{port}: {e}")))?
            .collect();
        let mut last = None;
        let mut stream = None;
        for addr in &addrs {
            match TcpStream::connect_timeout(addr, timeouts.connect) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let stream = stream.ok_or_else(|| {
            remote(format!(
                "cannot connect: {} (is the environment server running?)",
                last.map_or_else(|| "no address".to_owned(), |e| e.to_string())
            ))
        })?;
        let _ = stream.set_nodelay(true);
        stream
            .set_read_timeout(Some(timeouts.connect))
            .and_then(|()| stream.set_write_timeout(Some(timeouts.connect)))
            .map_err(|e| remote(format!("cannot set socket timeouts: {e}")))?;
        let config = WebSocketConfig::default().max_message_size(Some(100 << 20));
        let (socket, _) = tungstenite::client::client_with_config(
            ws_url.as_str(),
            stream,
            Some(config),
        )
        .map_err(|e| match e {
            tungstenite::HandshakeError::Failure(tungstenite::Error::Http(response)) => {
                let body = response
                    .body()
                    .as_ref()
                    .map(|b| String::from_utf8_lossy(b).into_owned())
                    .unwrap_or_default();
                remote(format!(
                    "the WebSocket handshake was refused with HTTP {}{} (is this an OpenEnv \
                         server? its episodes run over the /ws session)",
                    response.status(),
                    if body.is_empty() {
                        String::new()
                    } else {
                        format!(": {}", snippet(&body))
                    }
                ))
            }
            tungstenite::HandshakeError::Failure(e) => remote(format!(
                "the WebSocket handshake failed: {}",
                describe_ws_error(&e, timeouts.connect)
            )),
            tungstenite::HandshakeError::Interrupted(_) => remote(format!(
                "the WebSocket handshake did not finish within {:.1} s",
                timeouts.connect.as_secs_f64()
            )),
        })?;
        socket
            .get_ref()
            .set_read_timeout(Some(timeouts.message))
            .and_then(|()| socket.get_ref().set_write_timeout(Some(timeouts.message)))
            .map_err(|e| remote(format!("cannot set socket timeouts: {e}")))?;
        Ok(Self {
            base_url: http,
            ws_url,
            socket: Some(socket),
            timeouts,
        })
    }

    /// The server's base URL (`http://…`).
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// Whether the session is still open (a failed exchange closes it).
    pub fn is_open(&self) -> bool {
        self.socket.is_some()
    }

    /// Starts an episode with the reset keyword arguments `kwargs` (e.g. `{"seed": 3}`).
    pub fn reset(
        &mut self,
        kwargs: &Map<String, Value>,
        what: &str,
    ) -> Result<OpenEnvReply, EnvError> {
        self.observation_exchange(json!({"type": "reset", "data": kwargs}), what)
    }

    /// Applies the action `action` (its fields, e.g. `{"message": "…"}`).
    pub fn step(
        &mut self,
        action: &Map<String, Value>,
        what: &str,
    ) -> Result<OpenEnvReply, EnvError> {
        self.observation_exchange(json!({"type": "step", "data": action}), what)
    }

    /// Sends `message` and reads an observation answer; a malformed one closes the session too.
    fn observation_exchange(
        &mut self,
        message: Value,
        what: &str,
    ) -> Result<OpenEnvReply, EnvError> {
        let data = self.exchange(message, "observation", what)?;
        parse_reply(data).map_err(|m| {
            if let Some(mut socket) = self.socket.take() {
                let _ = socket.close(None);
            }
            self.error(format!("{what}: malformed answer: {m}"))
        })
    }

    /// The environment's state (`{"episode_id": …, "step_count": …, …}`).
    pub fn state(&mut self) -> Result<Value, EnvError> {
        self.exchange(json!({"type": "state"}), "state", "state")
    }

    /// Ends the session, best effort: `{"type": "close"}`, after which the server closes the
    /// WebSocket (its close frame is answered); a server that does not within half a second is
    /// closed on.
    pub fn close(&mut self) {
        if let Some(mut socket) = self.socket.take() {
            if socket
                .send(Message::text(json!({"type": "close"}).to_string()))
                .is_err()
            {
                return;
            }
            let _ = socket
                .get_ref()
                .set_read_timeout(Some(Duration::from_millis(500)));
            for _ in 0..4 {
                match socket.read() {
                    // tungstenite answers the server's close frame by itself.
                    Ok(_) => continue,
                    Err(
                        tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed,
                    ) => {
                        return;
                    }
                    Err(_) => break,
                }
            }
            let _ = socket.close(None);
            let _ = socket.flush();
        }
    }

    fn error(&self, message: String) -> EnvError {
        EnvError::Remote {
            url: self.ws_url.clone(),
            message,
        }
    }

    /// Sends `message` and reads the answer's `data`, which must be of type `expected`. Any
    /// failure closes the session (its state on the server is unknown after it).
    fn exchange(&mut self, message: Value, expected: &str, what: &str) -> Result<Value, EnvError> {
        let result = self.exchange_inner(message, expected, what);
        if result.is_err()
            && let Some(mut socket) = self.socket.take()
        {
            let _ = socket.close(None);
        }
        result
    }

    fn exchange_inner(
        &mut self,
        message: Value,
        expected: &str,
        what: &str,
    ) -> Result<Value, EnvError> {
        let timeout = self.timeouts.message;
        let ws_url = self.ws_url.clone();
        let fail = |message: String| EnvError::Remote {
            url: ws_url.clone(),
            message,
        };
        let Some(socket) = self.socket.as_mut() else {
            return Err(fail(format!(
                "{what}: the session is closed (an earlier request on it failed)"
            )));
        };
        socket
            .send(Message::text(message.to_string()))
            .map_err(|e| {
                fail(format!(
                    "{what}: cannot send: {}",
                    describe_ws_error(&e, timeout)
                ))
            })?;
        let text = loop {
            match socket.read() {
                Ok(Message::Text(t)) => break t.as_str().to_owned(),
                Ok(Message::Binary(b)) => break String::from_utf8_lossy(&b).into_owned(),
                Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_)) => continue,
                Ok(Message::Close(frame)) => {
                    return Err(fail(format!(
                        "{what}: the server closed the session{}",
                        frame
                            .map(|f| format!(" ({}: {})", f.code, f.reason))
                            .unwrap_or_default()
                    )));
                }
                Err(e) => {
                    return Err(fail(format!("{what}: {}", describe_ws_error(&e, timeout))));
                }
            }
        };
        let value: Value = serde_json::from_str(&text).map_err(|e| {
            fail(format!(
                "{what}: malformed answer (not JSON: {e}): {}",
                snippet(&text)
            ))
        })?;
        let kind = value.get("type").and_then(Value::as_str);
        let data = value.get("data").cloned().unwrap_or(Value::Null);
        match kind {
            Some(k) if k == expected => Ok(data),
            Some("error") => {
                let message = data
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("(no message)");
                let code = data
                    .get("code")
                    .and_then(Value::as_str)
                    .unwrap_or("UNKNOWN");
                let hint = if code == "CAPACITY_REACHED" {
                    format!(
                        " (the server allows {} concurrent sessions; a rollout keeps one session \
                         per episode running at once, so start the server with \
                         max_concurrent_envs at least that many and SUPPORTS_CONCURRENT_SESSIONS \
                         = True)",
                        data.get("max_sessions")
                            .map_or_else(|| "few".to_owned(), Value::to_string)
                    )
                } else {
                    String::new()
                };
                Err(fail(format!(
                    "{what}: the server answered error {code}: {message}{hint}"
                )))
            }
            _ => Err(fail(format!(
                "{what}: malformed answer, expected {{\"type\": \"{expected}\", \"data\": …}}: {}",
                snippet(&text)
            ))),
        }
    }
}

impl Drop for OpenEnvSession {
    fn drop(&mut self) {
        self.close();
    }
}

/// A WebSocket error in words: timeouts say how long was waited.
fn describe_ws_error(e: &tungstenite::Error, timeout: Duration) -> String {
    match e {
        tungstenite::Error::Io(io)
            if matches!(io.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
        {
            format!(
                "no answer within {:.1} s (task.openenv.timeout_secs)",
                timeout.as_secs_f64()
            )
        }
        tungstenite::Error::Io(io) => format!("connection failed: {io}"),
        tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed => {
            "the server closed the connection".to_owned()
        }
        tungstenite::Error::Protocol(p) => {
            format!("WebSocket protocol error: {p} (the server closed the connection?)")
        }
        other => other.to_string(),
    }
}

/// `data` of an observation message as an [`OpenEnvReply`].
fn parse_reply(data: Value) -> Result<OpenEnvReply, String> {
    const SHAPE: &str = r#"{"observation": {…}, "reward": number or null, "done": bool}"#;
    let Value::Object(mut data) = data else {
        return Err(format!(
            "expected {SHAPE}, got {}",
            snippet(&data.to_string())
        ));
    };
    let observation = match data.remove("observation") {
        Some(Value::Object(o)) => o,
        other => {
            return Err(format!(
                "expected {SHAPE}; \"observation\" is {}",
                other.map_or_else(|| "missing".to_owned(), |v| snippet(&v.to_string()))
            ));
        }
    };
    let reward = match data.remove("reward") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => Some(f64::from(u8::from(b))),
        Some(Value::Number(n)) => n.as_f64(),
        Some(other) => {
            return Err(format!(
                "expected {SHAPE}; \"reward\" is {}",
                snippet(&other.to_string())
            ));
        }
    };
    if reward.is_some_and(|r| !r.is_finite()) {
        return Err(format!("\"reward\" is not finite: {reward:?}"));
    }
    let done = match data.remove("done") {
        None => false,
        Some(Value::Bool(b)) => b,
        Some(other) => {
            return Err(format!(
                "expected {SHAPE}; \"done\" is {}",
                snippet(&other.to_string())
            ));
        }
    };
    Ok(OpenEnvReply {
        observation,
        reward,
        done,
    })
}

/// What of an agent turn is sent as the action.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ActionText {
    /// The content of the turn's action per the agent format: the `<action>…</action>` block
    /// (T2PO), the `<search>` query or the `<answer>` text (Search-R1, boxed, verifiers). A turn
    /// without one is an invalid action and is not sent.
    #[default]
    Action,
    /// The whole turn text, as generated.
    Text,
}

/// How an [`OpenEnvEnv`] talks to its server and reads its answers.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenEnvSettings {
    /// The server's base URL (`http://HOST:PORT`).
    pub url: String,
    /// The action field the agent's text goes into (e.g. `message`).
    pub action_field: String,
    /// The observation fields the agent reads, in order: one field is shown as its text, several
    /// as `field: text` lines; empty means the observation's only field (an observation with
    /// several fields is then an error naming them).
    pub observation_fields: Vec<String>,
    /// Reset keyword arguments sent with every reset.
    pub reset_kwargs: Map<String, Value>,
    /// The reset keyword argument that carries the episode's seed ([`Task::seed`]); `None`
    /// sends none.
    pub seed_field: Option<String>,
    /// What of a turn is sent.
    pub send: ActionText,
    /// The agent format, to find a turn's action.
    pub format: Format,
    /// How a step's observation text appears in the agent's context: a template with
    /// [`OBSERVATION_PLACEHOLDER`] (e.g. `"\n\n<information>{observation}</information>\n\n"`).
    pub observation_template: String,
    /// Most steps per episode: the episode is cut (truncated) after them.
    pub max_turns: usize,
    /// An episode whose rewards sum to at least this is a success.
    pub success_reward: f64,
    /// Timeouts.
    pub timeouts: OpenEnvTimeouts,
}

/// The default observation template of an agent format: the search environment's wrappers
/// (`<information>` for Search-R1 and T2PO, `<result>` for boxed and verifiers).
pub fn default_observation_template(format: Format) -> &'static str {
    match format {
        Format::SearchR1 | Format::T2po => "\n\n<information>{observation}</information>\n\n",
        Format::Boxed | Format::Verifiers => " <result>\n{observation}\n</result>",
    }
}

/// The text the agent reads of an observation: the `fields` (all of the observation's when
/// empty and it has one field) as text.
pub fn observation_text(
    observation: &Map<String, Value>,
    fields: &[String],
) -> Result<String, String> {
    let as_text = |v: &Value| match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    if fields.is_empty() {
        return match observation.len() {
            1 => Ok(as_text(observation.values().next().expect("one field"))),
            0 => Err("the observation has no fields; nothing to show the agent".to_owned()),
            _ => Err(format!(
                "the observation has several fields ({}); name the ones the agent reads in \
                 task.openenv.observation_fields",
                observation.keys().cloned().collect::<Vec<_>>().join(", ")
            )),
        };
    }
    let mut parts = Vec::with_capacity(fields.len());
    for f in fields {
        let v = observation.get(f).ok_or_else(|| {
            format!(
                "the observation has no field {f:?} (task.openenv.observation_fields); it has: {}",
                observation.keys().cloned().collect::<Vec<_>>().join(", ")
            )
        })?;
        parts.push(if fields.len() == 1 {
            as_text(v)
        } else {
            format!("{f}: {}", as_text(v))
        });
    }
    Ok(parts.join("\n"))
}

/// The action of an agent turn under `send` and `format`, with whether the turn passed the
/// format's check; `Err(reason)` when the turn has no action.
pub fn turn_action(text: &str, send: ActionText, format: Format) -> (Result<String, String>, bool) {
    if format == Format::T2po {
        let format_ok = t2po::v_strict(text, t2po::TargetScript::default()).is_ok();
        if send == ActionText::Text {
            return (Ok(text.to_owned()), format_ok);
        }
        let action = text.find("<action>").and_then(|open| {
            let start = open + "<action>".len();
            text[start..]
                .find("</action>")
                .map(|len| text[start..start + len].trim())
        });
        return match action {
            Some(a) if !a.is_empty() => (Ok(a.to_owned()), format_ok),
            Some(_) => (Err("empty <action> block".to_owned()), false),
            None => (Err("no <action>…</action> block".to_owned()), false),
        };
    }
    let parsed = parse_turn(format, text);
    let format_ok = parsed.verdict.is_valid();
    if send == ActionText::Text {
        return (Ok(text.to_owned()), format_ok);
    }
    match parsed.action {
        Action::Search { query } => (Ok(query), format_ok),
        Action::Answer { text } => (Ok(parsed.final_answer.unwrap_or(text)), format_ok),
        Action::Invalid { reason } => (Err(reason), false),
    }
}

/// An episode's progress on the client side.
#[derive(Debug, Clone)]
struct Episode {
    id: String,
    seed: u64,
    steps: usize,
    reward: f64,
    /// The last observation text (unwrapped), shown again after an invalid action.
    last: String,
    done: bool,
}

/// An [`Environment`] played on an OpenEnv server over one WebSocket session (see the module
/// docs). The session is opened at the first reset and kept across episodes; a failed request
/// closes it and the next reset opens a new one.
#[derive(Debug)]
pub struct OpenEnvEnv {
    settings: OpenEnvSettings,
    session: Option<OpenEnvSession>,
    episode: Option<Episode>,
}

impl OpenEnvEnv {
    /// An environment on the server of `settings` (nothing is connected before the first reset).
    pub fn new(settings: OpenEnvSettings) -> Result<Self, EnvError> {
        parse_url(&settings.url).map_err(|message| EnvError::Remote {
            url: settings.url.clone(),
            message,
        })?;
        if !settings
            .observation_template
            .contains(OBSERVATION_PLACEHOLDER)
        {
            return Err(EnvError::BadTask {
                env: "OpenEnvEnv".into(),
                field: "observation_template".into(),
                message: format!("must contain {OBSERVATION_PLACEHOLDER}"),
            });
        }
        Ok(Self {
            settings,
            session: None,
            episode: None,
        })
    }

    /// The settings.
    pub fn settings(&self) -> &OpenEnvSettings {
        &self.settings
    }

    /// Resets the episode of `task` and returns the first observation's text and the raw reply.
    pub fn reset_reply(&mut self, task: &Task) -> Result<(String, OpenEnvReply), EnvError> {
        let mut kwargs = self.settings.reset_kwargs.clone();
        if let Some(field) = &self.settings.seed_field {
            kwargs.insert(field.clone(), task.seed.into());
        }
        let what = match &self.settings.seed_field {
            Some(f) => format!("reset of episode {} ({f} = {})", task.id, task.seed),
            None => format!("reset of episode {}", task.id),
        };
        self.episode = None;
        let session = match self.session.take() {
            Some(s) if s.is_open() => s,
            _ => OpenEnvSession::connect(&self.settings.url, self.settings.timeouts)?,
        };
        let session = self.session.insert(session);
        let reply = session.reset(&kwargs, &what)?;
        let text = observation_text(&reply.observation, &self.settings.observation_fields)
            .map_err(|m| session.error(format!("{what}: {m}")))?;
        self.episode = Some(Episode {
            id: task.id.clone(),
            seed: task.seed,
            steps: 0,
            reward: 0.0,
            last: text.clone(),
            done: reply.done,
        });
        Ok((text, reply))
    }

    fn wrap(&self, text: &str) -> String {
        self.settings
            .observation_template
            .replace(OBSERVATION_PLACEHOLDER, text)
    }
}

impl Environment for OpenEnvEnv {
    /// Starts an episode: resets the session with the reset arguments and the task's seed. When
    /// `task.prompt` is set (the question the prompt was made of, whose end is the first
    /// observation when the task was built), the first observation must still be its end: a
    /// server whose reset is not determined by its arguments would otherwise put the agent in
    /// another episode than its prompt shows.
    fn reset(&mut self, task: &Task) -> Result<Observation, EnvError> {
        let (text, _) = self.reset_reply(task)?;
        if let Some(prompt) = &task.prompt
            && !prompt.ends_with(text.trim())
        {
            self.episode = None;
            return Err(EnvError::Remote {
                url: self.settings.url.clone(),
                message: format!(
                    "reset of episode {} (seed {}) answered another first observation than when \
                     the task was built ({:?}, the question ends {:?}): the server's reset must \
                     be determined by its arguments (task.openenv.seed_field, \
                     task.openenv.reset)",
                    task.id,
                    task.seed,
                    snippet(&text),
                    {
                        let tail: Vec<char> = prompt.chars().rev().take(80).collect();
                        tail.into_iter().rev().collect::<String>()
                    }
                ),
            });
        }
        Ok(Observation::new(text))
    }

    fn step(&mut self, action_text: &str) -> Result<StepResult, EnvError> {
        let env = format!("OpenEnvEnv({})", self.settings.url);
        let Some(episode) = self.episode.as_mut() else {
            return Err(EnvError::NotReset { env });
        };
        if episode.done {
            return Err(EnvError::EpisodeOver { env });
        }
        episode.steps += 1;
        let (action, format_ok) =
            turn_action(action_text, self.settings.send, self.settings.format);
        let mut info = StepInfo {
            format_ok,
            ..StepInfo::default()
        };
        let (text, reward, mut done) = match action {
            Err(reason) => {
                // Not sent: the server's state is unchanged, and so is what the agent sees.
                info.valid_action = false;
                info.feedback = Some(reason);
                (episode.last.clone(), 0.0, false)
            }
            Ok(action) => {
                let what = format!(
                    "step {} of episode {} (seed {})",
                    episode.steps, episode.id, episode.seed
                );
                let session = self
                    .session
                    .as_mut()
                    .ok_or_else(|| EnvError::NotReset { env: env.clone() })?;
                let mut payload = Map::new();
                payload.insert(self.settings.action_field.clone(), action.clone().into());
                let reply = session.step(&payload, &what)?;
                let text = observation_text(&reply.observation, &self.settings.observation_fields)
                    .map_err(|m| session.error(format!("{what}: {m}")))?;
                info.action = Some(action);
                info.extra
                    .insert("observation".into(), Value::Object(reply.observation));
                (text, reply.reward.unwrap_or(0.0), reply.done)
            }
        };
        episode.reward += reward;
        episode.last = text.clone();
        if !done && episode.steps >= self.settings.max_turns {
            done = true;
            info.truncated = true;
        }
        episode.done = done;
        if done {
            info.won = episode.reward >= self.settings.success_reward;
        }
        let observation = Observation::new(self.wrap(&text));
        Ok(StepResult {
            observation,
            reward,
            done,
            info,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_map_to_the_websocket_endpoint() {
        let (http, ws, host, port) = parse_url("http://127.0.0.1:8000/").unwrap();
        assert_eq!(
            (http.as_str(), ws.as_str(), host.as_str(), port),
            (
                "http://127.0.0.1:8000",
                "ws://127.0.0.1:8000/ws",
                "127.0.0.1",
                8000
            )
        );
        let (http, ws, ..) = parse_url("ws://localhost:9/env").unwrap();
        assert_eq!(
            (http.as_str(), ws.as_str()),
            ("http://localhost:9/env", "ws://localhost:9/env/ws")
        );
        let e = parse_url("https://x.hf.space").unwrap_err();
        assert!(e.contains("https:// is not supported"), "{e}");
        assert!(parse_url("localhost:8000").is_err());
    }

    #[test]
    fn replies_parse_and_malformed_ones_say_what_is_wrong() {
        let r = parse_reply(json!({"observation": {"text": "hi"}, "reward": 0.5, "done": true}))
            .unwrap();
        assert_eq!((r.reward, r.done), (Some(0.5), true));
        let r = parse_reply(json!({"observation": {}, "reward": null})).unwrap();
        assert_eq!((r.reward, r.done), (None, false));
        let e = parse_reply(json!({"reward": 1.0})).unwrap_err();
        assert!(e.contains("\"observation\" is missing"), "{e}");
        let e = parse_reply(json!({"observation": {}, "reward": "high"})).unwrap_err();
        assert!(e.contains("\"reward\" is \"high\""), "{e}");
        let e = parse_reply(json!({"observation": {}, "done": 1})).unwrap_err();
        assert!(e.contains("\"done\" is 1"), "{e}");
    }

    #[test]
    fn observation_fields_become_text() {
        let obs: Map<String, Value> =
            serde_json::from_value(json!({"prompt": "guess", "tries": 3})).unwrap();
        assert_eq!(observation_text(&obs, &["prompt".into()]).unwrap(), "guess");
        assert_eq!(
            observation_text(&obs, &["prompt".into(), "tries".into()]).unwrap(),
            "prompt: guess\ntries: 3"
        );
        let e = observation_text(&obs, &[]).unwrap_err();
        assert!(e.contains("several fields (prompt, tries)"), "{e}");
        let e = observation_text(&obs, &["board".into()]).unwrap_err();
        assert!(e.contains("no field \"board\""), "{e}");
    }

    #[test]
    fn turn_actions_follow_the_agent_format() {
        let t = "<think>try 4</think><action> 4 </action>";
        assert_eq!(
            turn_action(t, ActionText::Action, Format::T2po),
            (Ok("4".into()), true)
        );
        assert_eq!(
            turn_action(t, ActionText::Text, Format::T2po),
            (Ok(t.into()), true)
        );
        let (a, ok) = turn_action("<think>x</think>", ActionText::Action, Format::T2po);
        assert!(a.is_err() && !ok);
        let (a, _) = turn_action(
            "<think>x</think><answer> Paris </answer>",
            ActionText::Action,
            Format::SearchR1,
        );
        assert_eq!(a, Ok("Paris".into()));
        let (a, _) = turn_action(
            "<think>x</think><search>capital</search>",
            ActionText::Action,
            Format::SearchR1,
        );
        assert_eq!(a, Ok("capital".into()));
    }
}
