//! The retrieval server and client over real HTTP on 127.0.0.1 (ephemeral ports): the
//! Search-R1 protocol, malformed and oversized requests, concurrent clients, and a server
//! restart under a live client.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use turnwise_env::client::{ClientConfig, HttpRetriever, RetryPolicy};
use turnwise_env::search::{Document, RetrievalError, Retriever};
use turnwise_env::server::{BackgroundServer, ServerConfig, TermOverlapRetriever};

fn corpus() -> Arc<TermOverlapRetriever> {
    let docs = [
        (
            "0",
            "Paris",
            "Paris is the capital and largest city of France.",
        ),
        ("1", "Berlin", "Berlin is the capital of Germany."),
        (
            "2",
            "Hamlet",
            "Hamlet is a tragedy written by William Shakespeare.",
        ),
        (
            "3",
            "Eiffel Tower",
            "The Eiffel Tower in Paris was completed in 1889.",
        ),
        (
            "4",
            "Rhine",
            "The Rhine flows through Germany and the Netherlands.",
        ),
    ];
    Arc::new(TermOverlapRetriever::new(
        docs.iter()
            .map(|(id, title, text)| Document {
                id: id.to_string(),
                contents: format!("\"{title}\"\n{text}"),
            })
            .collect(),
    ))
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

fn start(config: ServerConfig) -> BackgroundServer {
    BackgroundServer::start(corpus(), config).expect("server starts")
}

fn small_limits() -> ServerConfig {
    ServerConfig {
        max_body_bytes: 4096,
        max_queries: 16,
        max_topk: 10,
        ..ServerConfig::with_addr(loopback(0))
    }
}

fn fast_client(url: &str, attempts: u32) -> HttpRetriever {
    HttpRetriever::with_config(
        url,
        ClientConfig {
            timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_millis(500),
            retry: RetryPolicy {
                max_attempts: attempts,
                initial_backoff: Duration::from_millis(50),
                max_backoff: Duration::from_millis(200),
                multiplier: 2.0,
                jitter: 0.5,
            },
            use_system_proxy: false,
        },
    )
    .unwrap()
}

fn raw() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

/// POSTs `body` verbatim to `/retrieve`; returns status and parsed JSON body.
fn post_raw(server: &BackgroundServer, body: impl Into<reqwest::blocking::Body>) -> (u16, Value) {
    let response = raw()
        .post(format!("{}/retrieve", server.url()))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .unwrap();
    let status = response.status().as_u16();
    let text = response.text().unwrap();
    let value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("status {status}: body is not JSON ({e}): {text}"));
    (status, value)
}

#[test]
fn search_r1_protocol_with_and_without_scores() {
    let server = start(small_limits());
    assert!(server.local_addr().ip().is_loopback());
    assert_ne!(server.local_addr().port(), 0);

    let health: Value = raw()
        .get(format!("{}/health", server.url()))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(health, json!({"status": "ok"}));

    let body = json!({"queries": ["capital of Germany", "Shakespeare tragedy"], "topk": 2,
        "return_scores": true});
    let (status, v) = post_raw(&server, body.to_string());
    assert_eq!(status, 200, "{v}");
    let result = v["result"].as_array().unwrap();
    assert_eq!(result.len(), 2);
    assert_eq!(result[0].as_array().unwrap().len(), 2);
    assert_eq!(result[0][0]["document"]["id"], "1");
    assert_eq!(
        result[0][0]["document"]["contents"],
        "\"Berlin\"\nBerlin is the capital of Germany."
    );
    assert_eq!(result[0][0]["score"], 3.0);
    assert_eq!(result[1][0]["document"]["id"], "2");

    // Without scores, Search-R1 returns the bare documents.
    let body = json!({"queries": ["capital of Germany"], "topk": 1, "return_scores": false});
    let (status, v) = post_raw(&server, body.to_string());
    assert_eq!(status, 200);
    assert_eq!(
        v,
        json!({"result": [[{"id": "1", "contents": "\"Berlin\"\nBerlin is the capital of Germany."}]]})
    );

    // topk and return_scores are optional (default topk 3, no scores).
    let (status, v) = post_raw(&server, r#"{"queries": ["Paris"]}"#);
    assert_eq!(status, 200);
    let list = v["result"][0].as_array().unwrap();
    assert_eq!(list.len(), 2, "two documents mention Paris");
    assert!(
        list.iter()
            .all(|d| d.get("score").is_none() && d["id"].is_string())
    );

    // The client sees the same hits.
    let client = fast_client(&server.url(), 1);
    client.health().unwrap();
    let hits = client
        .retrieve(&["capital of Germany".into(), "Rhine".into()], 2)
        .unwrap();
    assert_eq!(hits.len(), 2);
    assert_eq!(hits[0][0].document.id, "1");
    assert_eq!(hits[0][0].score, 3.0);
    assert_eq!(hits[1][0].document.id, "4");
    server.shutdown().unwrap();
}

#[test]
fn malformed_requests_get_json_errors_naming_the_field() {
    let server = start(small_limits());
    let cases: Vec<(&str, String, u16, Option<&str>, &str)> = vec![
        (
            "bad JSON",
            "{\"queries\": [\"a\"".into(),
            400,
            None,
            "not valid JSON",
        ),
        ("not an object", "[1, 2]".into(), 400, None, "JSON object"),
        (
            "missing queries",
            r#"{"topk": 3}"#.into(),
            422,
            Some("queries"),
            "missing",
        ),
        (
            "queries not an array",
            r#"{"queries": "paris"}"#.into(),
            422,
            Some("queries"),
            "array",
        ),
        (
            "query not a string",
            r#"{"queries": ["paris", 7]}"#.into(),
            422,
            Some("queries[1]"),
            "string",
        ),
        (
            "empty queries",
            r#"{"queries": []}"#.into(),
            422,
            Some("queries"),
            "empty",
        ),
        (
            "topk 0",
            r#"{"queries": ["paris"], "topk": 0}"#.into(),
            422,
            Some("topk"),
            "at least 1",
        ),
        (
            "topk too large",
            r#"{"queries": ["paris"], "topk": 11}"#.into(),
            422,
            Some("topk"),
            "at most 10",
        ),
        (
            "topk negative",
            r#"{"queries": ["paris"], "topk": -2}"#.into(),
            422,
            Some("topk"),
            "positive",
        ),
        (
            "topk a string",
            r#"{"queries": ["paris"], "topk": "3"}"#.into(),
            422,
            Some("topk"),
            "string",
        ),
        (
            "return_scores not bool",
            r#"{"queries": ["paris"], "return_scores": 1}"#.into(),
            422,
            Some("return_scores"),
            "boolean",
        ),
        (
            "too many queries",
            json!({"queries": vec!["paris"; 17]}).to_string(),
            422,
            Some("queries"),
            "too many",
        ),
        (
            "retriever rejects query",
            r#"{"queries": ["?!"]}"#.into(),
            422,
            Some("queries"),
            "no searchable terms",
        ),
    ];
    for (name, body, want_status, want_field, want_text) in cases {
        let (status, v) = post_raw(&server, body);
        assert_eq!(status, want_status, "{name}: {v}");
        assert_eq!(v["error"]["status"], want_status, "{name}: {v}");
        assert_eq!(v["error"]["field"].as_str(), want_field, "{name}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(want_text), "{name}: {message}");
    }

    // Unknown paths answer JSON 404.
    let response = raw().get(format!("{}/nope", server.url())).send().unwrap();
    assert_eq!(response.status().as_u16(), 404);
    let v: Value = response.json().unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("/nope"));

    // A 4xx is not retried by the client and its message reaches the caller.
    let client = fast_client(&server.url(), 5);
    let started = Instant::now();
    let err = client.retrieve(&["?!".into()], 3).unwrap_err();
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "4xx must not be retried"
    );
    let text = err.to_string();
    assert!(
        text.contains("/retrieve") && text.contains("422") && text.contains("no searchable terms"),
        "{text}"
    );
    assert!(text.contains("attempt 1 of 5"), "{text}");
}

#[test]
fn oversized_bodies_get_413() {
    let server = start(small_limits());
    let big = json!({"queries": ["x".repeat(8000)]}).to_string();
    let (status, v) = post_raw(&server, big.clone());
    assert_eq!(status, 413, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("4096 bytes")
    );
    // Also without a Content-Length header (chunked body from a reader).
    let (status, _) = post_raw(
        &server,
        reqwest::blocking::Body::new(std::io::Cursor::new(big.into_bytes())),
    );
    assert_eq!(status, 413);
    // The server keeps serving afterwards.
    let (status, _) = post_raw(&server, r#"{"queries": ["Paris"]}"#);
    assert_eq!(status, 200);
}

#[test]
fn concurrent_clients_see_no_errors() {
    let server = start(ServerConfig::with_addr(loopback(0)));
    let client = fast_client(&server.url(), 2);
    let queries = [
        ("capital of Germany", "1"),
        ("Shakespeare", "2"),
        ("Eiffel 1889", "3"),
        ("Rhine Netherlands", "4"),
    ];
    let started = Instant::now();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..8)
            .map(|t| {
                let client = client.clone();
                scope.spawn(move || {
                    let mut errors = 0;
                    for i in 0..50 {
                        let (q, want) = queries[(t + i) % queries.len()];
                        match client.retrieve(&[q.to_string()], 3) {
                            Ok(hits) if hits[0][0].document.id == want => {}
                            Ok(hits) => panic!("{q}: wrong top hit {:?}", hits[0][0]),
                            Err(e) => {
                                eprintln!("{e}");
                                errors += 1;
                            }
                        }
                    }
                    errors
                })
            })
            .collect();
        let errors: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(errors, 0);
    });
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
fn client_survives_a_server_restart_and_fails_clearly_while_down() {
    let server = start(ServerConfig::with_addr(loopback(0)));
    let addr = server.local_addr();
    let url = server.url();
    let client = fast_client(&url, 4);
    let query = vec!["capital of Germany".to_string()];
    assert_eq!(client.retrieve(&query, 1).unwrap()[0][0].document.id, "1");

    server.shutdown().unwrap();

    // While down: every attempt is refused; the error names the URL and the cause, and comes
    // within the retry budget (3 sleeps of at most 50 + 100 + 200 ms).
    let started = Instant::now();
    let err = client.retrieve(&query, 1).unwrap_err();
    let elapsed = started.elapsed();
    assert!(elapsed < Duration::from_secs(3), "took {elapsed:?}");
    match &err {
        RetrievalError::Remote { url: u, message } => {
            assert_eq!(u, &format!("{url}/retrieve"));
            assert!(message.contains("cannot connect"), "{message}");
            assert!(message.contains("attempt 4 of 4"), "{message}");
        }
        other => panic!("expected Remote, got {other:?}"),
    }

    // Restart on the same port: the same client (with stale pooled connections) recovers.
    let server = start(ServerConfig::with_addr(addr));
    assert_eq!(server.local_addr(), addr);
    assert_eq!(client.retrieve(&query, 1).unwrap()[0][0].document.id, "1");
    server.shutdown().unwrap();

    // A restart while the client is retrying: the request succeeds once the server is back.
    let restarter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(150));
        start(ServerConfig::with_addr(addr))
    });
    let patient = fast_client(&url, 8);
    let hits = patient.retrieve(&query, 1).unwrap();
    assert_eq!(hits[0][0].document.id, "1");
    restarter.join().unwrap().shutdown().unwrap();
}

#[test]
fn binding_a_taken_port_fails_with_the_address() {
    let server = start(ServerConfig::with_addr(loopback(0)));
    let err = BackgroundServer::start(corpus(), ServerConfig::with_addr(server.local_addr()))
        .unwrap_err()
        .to_string();
    assert!(err.contains(&server.local_addr().to_string()), "{err}");
}
