//! `turnwise serve`: `POST /generate`, `/v1/completions` and `/v1/chat/completions` over real
//! HTTP, on a server of the committed tiny GGUF model (Llama architecture, ChatML template).
//!
//! Input: one byte choosing the route, then the body. Invariants beyond "no panic": the server
//! never answers 500 (an engine error on an accepted request); every body is JSON; an error
//! names what is wrong; a 200 has the route's shape (`choices` with text or a message,
//! `output_ids`).

use std::net::SocketAddr;
use std::sync::OnceLock;

use serde_json::Value;
use turnwise::serve::{PolicyServer, ServeConfig, load_served};

/// The routes, chosen by the input's first byte.
pub const ROUTES: [&str; 3] = ["/generate", "/v1/completions", "/v1/chat/completions"];

/// The tiny GGUF model the server serves.
pub fn fixture() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../turnwise-model/src/checkpoint/fixtures/gguf/tiny-llama.gguf")
}

fn server() -> SocketAddr {
    static SERVER: OnceLock<(PolicyServer, SocketAddr)> = OnceLock::new();
    SERVER
        .get_or_init(|| {
            let config = ServeConfig {
                addr: "127.0.0.1:0".parse().expect("an address"),
                // Small queues keep one input's work bounded (requests beyond get 400/503).
                max_batch_size: 8,
                max_queue: 16,
                memory_budget: 256 << 20,
                ..ServeConfig::default()
            };
            let served = load_served(&fixture()).expect("the tiny GGUF fixture loads");
            let server = PolicyServer::start(served, &config).expect("the server starts");
            let addr = server
                .url()
                .trim_start_matches("http://")
                .parse()
                .expect("the server's address");
            (server, addr)
        })
        .1
}

/// One input (see the module docs).
pub fn run(data: &[u8]) {
    let Some((&route, body)) = data.split_first() else {
        return;
    };
    let path = ROUTES[usize::from(route) % ROUTES.len()];
    let what = format!("POST {path}");
    let Some(v) = crate::http::post_checked(server(), path, body) else {
        return;
    };
    match path {
        "/generate" => {
            let answers = match &v {
                Value::Array(a) => a.clone(),
                one => vec![one.clone()],
            };
            assert!(!answers.is_empty(), "{what}: 200 with no answer");
            for a in &answers {
                assert!(a["text"].is_string(), "{what}: no text in {a}");
                assert!(a["output_ids"].is_array(), "{what}: no output_ids in {a}");
            }
        }
        _ => {
            let choices = v["choices"]
                .as_array()
                .unwrap_or_else(|| panic!("{what}: 200 without choices: {v}"));
            assert!(!choices.is_empty(), "{what}: 200 with no choice");
            for c in choices {
                let text = if path == "/v1/completions" {
                    &c["text"]
                } else {
                    &c["message"]["content"]
                };
                assert!(text.is_string(), "{what}: a choice without text: {c}");
                assert!(c["finish_reason"].is_string(), "{what}: {c}");
            }
        }
    }
}
