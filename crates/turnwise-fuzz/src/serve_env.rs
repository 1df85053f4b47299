//! `turnwise serve-env` (the OpenEnv protocol): WebSocket messages of a session, and the bodies
//! of `POST /reset` and `POST /mcp`, over a real connection, on a tiny search world in the
//! `search_r1` format.
//!
//! Input: one byte choosing the mode, then:
//! - mode 0: WebSocket text messages separated by NUL bytes, sent in one session;
//! - mode 1: a `/reset` body; mode 2: a `/mcp` body.
//!
//! Invariants beyond "no panic": every message but `close` gets one JSON answer of type
//! `observation`, `state` or `error` (an error with a code and a message), and a session is
//! only closed by the server after an error or a `close`; HTTP answers are never 500 for a
//! malformed body, and are JSON.

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::Value;
use tungstenite::Message;
use turnwise::config::TrainConfig;
use turnwise::task::TaskSet;
use turnwise::task::openenv::TaskEpisodes;
use turnwise_env::server::BackgroundServer;
use turnwise_env::server::openenv::{EnvServerConfig, router};

/// The settings of the served task: a tiny world in Search-R1's format.
pub const SETS: [&str; 9] = [
    "task.world.countries=4",
    "task.world.cities=8",
    "task.world.companies=6",
    "task.world.persons=16",
    "task.world.questions.train=8",
    "task.world.questions.validation=4",
    "task.world.questions.test=4",
    "task.format=\"search_r1\"",
    "reward.name=\"em\"",
];

fn server() -> SocketAddr {
    static SERVER: OnceLock<BackgroundServer> = OnceLock::new();
    SERVER
        .get_or_init(|| {
            let sets: Vec<String> = SETS.iter().map(|s| s.to_string()).collect();
            let cfg = TrainConfig::resolve(Some("grpo"), None, &sets).expect("the task resolves");
            let task = TaskSet::build(&cfg.task).expect("the task builds");
            let source = TaskEpisodes::new(task).expect("the episodes");
            BackgroundServer::start_router(
                "openenv",
                router(source.into_source(), EnvServerConfig::default()),
                "127.0.0.1:0".parse().expect("an address"),
                Duration::from_secs(30),
            )
            .expect("the environment server starts")
        })
        .local_addr()
}

/// One input (see the module docs).
pub fn run(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    match mode % 3 {
        0 => session(rest),
        1 => http(rest, "/reset"),
        _ => http(rest, "/mcp"),
    }
}

fn http(body: &[u8], path: &str) {
    let what = format!("POST {path}");
    let Some(v) = crate::http::post_checked(server(), path, body) else {
        return;
    };
    if path == "/reset" {
        assert!(
            v["observation"]["text"].is_string(),
            "{what}: 200 without an observation: {v}"
        );
    } else {
        assert_eq!(v["jsonrpc"], "2.0", "{what}: {v}");
    }
}

fn session(messages: &[u8]) {
    let url = format!("ws://{}/ws", server());
    let (mut socket, _) = tungstenite::connect(&url).expect("a WebSocket session");
    if let tungstenite::stream::MaybeTlsStream::Plain(s) = socket.get_ref() {
        s.set_read_timeout(Some(Duration::from_secs(120)))
            .expect("a read timeout");
    }
    for text in crate::pieces(messages) {
        let closing = serde_json::from_str::<Value>(&text)
            .ok()
            .is_some_and(|v| v.get("type").and_then(Value::as_str) == Some("close"));
        socket
            .send(Message::text(text.clone()))
            .expect("send a message");
        if closing {
            return;
        }
        let reply = loop {
            match socket.read() {
                Ok(Message::Text(t)) => break t.as_str().to_owned(),
                Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_)) => continue,
                Ok(other) => panic!("{text:?}: the session answered {other:?}"),
                Err(e) => panic!("{text:?}: the session ended without an answer: {e}"),
            }
        };
        let v: Value = serde_json::from_str(&reply)
            .unwrap_or_else(|e| panic!("{text:?}: an answer that is not JSON ({e}): {reply}"));
        match v["type"].as_str() {
            Some("observation") => assert!(v["data"]["observation"]["text"].is_string(), "{v}"),
            Some("state") => assert!(v["data"].is_object(), "{v}"),
            Some("error") => {
                assert!(v["data"]["code"].is_string(), "{text:?}: {v}");
                assert!(v["data"]["message"].is_string(), "{text:?}: {v}");
            }
            _ => panic!("{text:?}: an answer of no known type: {v}"),
        }
    }
    let _ = socket.close(None);
    // Drain until the server's close, so sessions do not pile up past --max-sessions.
    while socket.read().is_ok() {}
}
