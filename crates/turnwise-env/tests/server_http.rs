//! The retrieval server and client over real HTTP on 127.0.0.1 (ephemeral ports): the
//! Search-R1 protocol and a replay of Search-R1's trainer traffic, malformed, oversized and
//! half-sent requests, concurrent clients, and a server restart under a live client.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
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
            "topk fractional",
            r#"{"queries": ["paris"], "topk": 2.5}"#.into(),
            422,
            Some("topk"),
            "integer",
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
            "integer",
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
            "too many queries: 17 (limit 16; raise it with `turnwise serve-retriever --max-queries N`",
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
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("limit of 4096 bytes") && message.contains("--max-body-bytes N"),
        "{message}"
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

/// Search-R1's `_batch_search` + `batch_search` (search_r1/llm_agent/generation.py), step for
/// step: one POST of the turn's queries with `topk` and `return_scores: true` on a kept-alive
/// session, then `resp.json()['result']`. Panics where the Python raises (no `result`).
fn search_r1_batch_search(
    session: &reqwest::blocking::Client,
    search_url: &str,
    payload: &Value,
) -> Vec<Value> {
    let response = session.post(search_url).json(payload).send().unwrap();
    let status = response.status().as_u16();
    let v: Value = response.json().unwrap();
    assert_eq!(status, 200, "{v}");
    match v.get("result") {
        Some(Value::Array(result)) => result.clone(),
        _ => panic!("KeyError: 'result' in {v}"),
    }
}

/// Search-R1's `_passages2string`: reads `doc_item['document']['contents']`, title = first line.
fn passages_to_string(entries: &[Value]) -> String {
    let mut out = String::new();
    for (idx, item) in entries.iter().enumerate() {
        let contents = item["document"]["contents"].as_str().expect("contents");
        let mut lines = contents.split('\n');
        let title = lines.next().unwrap_or_default();
        let text = lines.collect::<Vec<_>>().join("\n");
        out.push_str(&format!("Doc {}(Title: {title}) {text}\n", idx + 1));
    }
    out
}

fn keys(v: &Value) -> Vec<&str> {
    let mut k: Vec<&str> = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"))
        .keys()
        .map(String::as_str)
        .collect();
    k.sort_unstable();
    k
}

/// One `return_scores: true` entry: exactly `{"document": {"id", "contents"}, "score"}`.
fn assert_scored(entry: &Value) {
    assert_eq!(keys(entry), ["document", "score"], "{entry}");
    assert!(entry["score"].is_f64(), "{entry}");
    assert_eq!(keys(&entry["document"]), ["contents", "id"], "{entry}");
    assert!(entry["document"]["id"].is_string() && entry["document"]["contents"].is_string());
}

/// One `return_scores: false` entry: exactly the bare document `{"id", "contents"}`.
fn assert_bare(entry: &Value) {
    assert_eq!(keys(entry), ["contents", "id"], "{entry}");
}

/// The server's answer for `queries` must be the in-process retriever's, in query order.
fn assert_same_hits(result: &[Value], queries: &[String], topk: usize) {
    let want = corpus().retrieve(queries, topk).unwrap();
    assert_eq!(result.len(), want.len());
    for (i, (got, want)) in result.iter().zip(&want).enumerate() {
        let got = got.as_array().unwrap();
        assert_eq!(got.len(), want.len(), "query {i}: {}", queries[i]);
        for (g, w) in got.iter().zip(want) {
            assert_scored(g);
            assert_eq!(g["document"]["id"], w.document.id.as_str(), "query {i}");
            assert_eq!(g["document"]["contents"], w.document.contents.as_str());
            assert_eq!(g["score"].as_f64().unwrap(), f64::from(w.score));
        }
    }
}

/// Question-like queries of the lengths a Search-R1 policy writes between `<search>` tags.
const SEARCH_QUERIES: [&str; 6] = [
    "what is the capital of Germany Berlin",
    "who wrote the tragedy Hamlet",
    "when was the Eiffel Tower in Paris completed",
    "which countries does the Rhine river flow through",
    "largest city of France",
    "William Shakespeare plays tragedy Hamlet author birth year",
];

/// Replays the request sequence of Search-R1's trainer (`execute_predictions` →
/// `batch_search` each turn) against the real server over HTTP, and reads the answers the way
/// its client does.
#[test]
fn search_r1_trainer_traffic_replays() {
    let server = start(ServerConfig::with_addr(loopback(0)));
    let search_url = format!("{}/retrieve", server.url());
    // `requests.post` on one process: keep-alive connections, no proxy.
    let session = raw();

    // Turn 1: six rollouts (2 prompts × n_agent 3); five searched, one wrote an invalid action.
    let turn1: Vec<String> = SEARCH_QUERIES[..5].iter().map(|q| q.to_string()).collect();
    let payload = json!({"queries": turn1, "topk": 3, "return_scores": true});
    let result = search_r1_batch_search(&session, &search_url, &payload);
    assert_eq!(result.len(), 5, "one list per search, in order");
    assert_same_hits(&result, &turn1, 3);
    let first = passages_to_string(result[0].as_array().unwrap());
    assert!(
        first.starts_with("Doc 1(Title: \"Berlin\") Berlin is the capital of Germany.\n"),
        "{first}"
    );

    // Turn 2: every active rollout answered or was invalid; Search-R1 still posts the empty
    // list and indexes ['result'].
    let payload = json!({"queries": [], "topk": 3, "return_scores": true});
    let result = search_r1_batch_search(&session, &search_url, &payload);
    assert!(result.is_empty());

    // A whole turn at Search-R1's defaults: train_batch_size 512 × n_agent 5 = 2,560 queries
    // in one request.
    let batch: Vec<String> = (0..2560)
        .map(|i| format!("{} {i}", SEARCH_QUERIES[i % SEARCH_QUERIES.len()]))
        .collect();
    let payload = json!({"queries": batch, "topk": 3, "return_scores": true});
    let body_bytes = payload.to_string().len();
    let default_limit = ServerConfig::default().max_body_bytes;
    assert!(
        body_bytes * 16 < default_limit,
        "a realistic whole-turn body ({body_bytes} bytes) needs margin under the default \
         limit ({default_limit} bytes)"
    );
    let started = Instant::now();
    let result = search_r1_batch_search(&session, &search_url, &payload);
    eprintln!(
        "2,560-query turn: request body {body_bytes} bytes, answered in {:.1} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
    assert_eq!(result.len(), 2560);
    assert_same_hits(&result, &batch, 3);

    // A degenerate turn (an early policy rambling inside <search>): 2,560 queries of 1,500
    // characters still fit the default body limit.
    let long: Vec<String> = (0..2560)
        .map(|i| {
            let mut q = format!("{} {i} ", SEARCH_QUERIES[i % SEARCH_QUERIES.len()]);
            while q.len() < 1500 {
                q.push_str("and then the search continues ");
            }
            q.truncate(1500);
            q
        })
        .collect();
    let payload = json!({"queries": long, "topk": 3, "return_scores": true});
    assert!(payload.to_string().len() < default_limit);
    let result = search_r1_batch_search(&session, &search_url, &payload);
    assert_eq!(result.len(), 2560);
    assert_same_hits(&result[..6], &long[..6], 3);

    // topk omitted, null or 0: the server's default (3), as Search-R1's `if not request.topk`.
    let q = ["Paris Eiffel Tower France capital Berlin".to_string()];
    for topk in [None, Some(Value::Null), Some(json!(0))] {
        let mut payload = json!({"queries": q, "return_scores": true});
        if let Some(topk) = &topk {
            payload["topk"] = topk.clone();
        }
        let result = search_r1_batch_search(&session, &search_url, &payload);
        assert_eq!(result[0].as_array().unwrap().len(), 3, "topk {topk:?}");
        assert_same_hits(&result, &q, 3);
    }

    // return_scores false or omitted: per query the bare documents, same order.
    for payload in [
        json!({"queries": turn1, "topk": 2, "return_scores": false}),
        json!({"queries": turn1, "topk": 2}),
    ] {
        let result = search_r1_batch_search(&session, &search_url, &payload);
        let want = corpus().retrieve(&turn1, 2).unwrap();
        assert_eq!(result.len(), turn1.len());
        for (got, want) in result.iter().zip(&want) {
            let got = got.as_array().unwrap();
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(want) {
                assert_bare(g);
                assert_eq!(g["id"], w.document.id.as_str());
                assert_eq!(g["contents"], w.document.contents.as_str());
            }
        }
    }
    server.shutdown().unwrap();
}

/// Reads from `stream` until the server closes it; fails if it is still open after `patience`.
fn read_until_closed(stream: &mut TcpStream, patience: Duration) -> String {
    stream.set_read_timeout(Some(patience)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!(
                "the server still holds the connection after {patience:?} ({e}); read so far: {}",
                String::from_utf8_lossy(&got)
            ),
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

#[test]
fn half_sent_requests_time_out() {
    let timeout = Duration::from_millis(300);
    let server = start(ServerConfig {
        read_timeout: timeout,
        ..ServerConfig::with_addr(loopback(0))
    });
    let patience = Duration::from_secs(5);

    // Headers promise 1,000 bytes of body; 13 arrive. The server answers 408 and closes.
    let mut body_cut = TcpStream::connect(server.local_addr()).unwrap();
    let started = Instant::now();
    body_cut
        .write_all(
            b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              Content-Length: 1000\r\n\r\n{\"queries\": [",
        )
        .unwrap();
    let answer = read_until_closed(&mut body_cut, patience);
    let waited = started.elapsed();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("read timeout"), "{answer}");
    assert!(
        waited >= timeout && waited < patience,
        "closed after {waited:?}"
    );

    // A declared length above the limit gets its 413 at once, without waiting for the body
    // (the review's Content-Length 99999999999 with 2 bytes waited 30 s for a 408).
    let mut huge = TcpStream::connect(server.local_addr()).unwrap();
    let started = Instant::now();
    huge.write_all(
        b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 99999999999\r\n\r\n{}",
    )
    .unwrap();
    let answer = read_until_closed(&mut huge, patience);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("--max-body-bytes"), "{answer}");
    assert!(
        started.elapsed() < timeout,
        "answered after {:?}",
        started.elapsed()
    );

    // Headers cut off mid-way, and a connection that never sends anything: both closed.
    let mut head_cut = TcpStream::connect(server.local_addr()).unwrap();
    head_cut
        .write_all(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Le")
        .unwrap();
    let mut silent = TcpStream::connect(server.local_addr()).unwrap();
    let started = Instant::now();
    read_until_closed(&mut head_cut, patience);
    read_until_closed(&mut silent, patience);
    assert!(started.elapsed() < patience);

    // A keep-alive client is unaffected: requests on a reused connection within the timeout
    // succeed, and after an idle close the client reconnects.
    let session = raw();
    for pause in [Duration::ZERO, Duration::from_millis(100), 2 * timeout] {
        std::thread::sleep(pause);
        let response = session
            .post(format!("{}/retrieve", server.url()))
            .json(&json!({"queries": ["Paris"]}))
            .send()
            .unwrap();
        assert_eq!(response.status().as_u16(), 200);
    }
    server.shutdown().unwrap();
}

/// Serves `app` on an ephemeral loopback port in a background runtime (plain `axum::serve`,
/// standing in for a foreign server).
fn start_foreign(app: axum::Router) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            addr_tx.send(listener.local_addr().unwrap()).unwrap();
            axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stop_rx.await;
                })
                .await
                .unwrap();
        });
    });
    (addr_rx.recv().unwrap(), stop_tx)
}

#[test]
fn startup_check_accepts_our_server_and_a_retrieve_only_server_and_names_a_dead_one() {
    // turnwise's server: GET /health.
    let server = start(ServerConfig::with_addr(loopback(0)));
    fast_client(&server.url(), 1).check().unwrap();
    // Given as Search-R1's endpoint URL.
    fast_client(&format!("{}/retrieve", server.url()), 1)
        .check()
        .unwrap();

    // A server like Search-R1's reference: only POST /retrieve (GET /health is a 404).
    let only_retrieve = axum::Router::new().route_service(
        "/retrieve",
        turnwise_env::server::RetrievalServer::router(corpus(), ServerConfig::default())
            .into_service::<axum::body::Body>(),
    );
    let (addr, stop) = start_foreign(only_retrieve);
    let url = format!("http://{addr}");
    let health = raw().get(format!("{url}/health")).send().unwrap();
    assert_eq!(health.status().as_u16(), 404);
    fast_client(&url, 1).check().unwrap();
    let _ = stop.send(());

    // Something else entirely: /health 404 and /retrieve 404 too.
    let (addr, stop) = start_foreign(axum::Router::new());
    let err = fast_client(&format!("http://{addr}"), 1)
        .check()
        .unwrap_err()
        .to_string();
    assert!(err.contains("/retrieve") && err.contains("404"), "{err}");
    let _ = stop.send(());

    // Nobody listening: fails at once, naming the URL.
    let dead = server.url();
    server.shutdown().unwrap();
    let started = Instant::now();
    let err = fast_client(&dead, 5).check().unwrap_err().to_string();
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(
        err.contains(&format!("{dead}/health")) && err.contains("connect"),
        "{err}"
    );
}

/// Review cli-as-a-user-3, M5: one request within the limits (8,192 queries at top-k 100) took
/// 1.7 GB and answered 153 MB. Queries × top-k beyond the server's `max_results` gets a 422
/// naming the flag at once, and an answer growing past `max_response_bytes` too; what fits is
/// served.
#[test]
fn results_and_answer_bytes_are_capped_with_a_422_naming_the_flag() {
    // The review's request, against the default limits.
    let server = start(ServerConfig::with_addr(loopback(0)));
    let queries = vec!["Rada Cradovel company born"; 8192];
    let t0 = Instant::now();
    let (status, v) = post_raw(
        &server,
        json!({"queries": queries, "topk": 100, "return_scores": true}).to_string(),
    );
    assert_eq!(status, 422, "{v}");
    assert_eq!(v["error"]["field"], "topk", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("819200 results") && msg.contains("--max-results"),
        "{msg}"
    );
    assert!(t0.elapsed() < Duration::from_secs(5), "refused at once");
    // Within the default cap: served.
    let (status, v) = post_raw(
        &server,
        json!({"queries": vec!["capital"; 160], "topk": 100}).to_string(),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["result"].as_array().unwrap().len(), 160);
    server.shutdown().unwrap();

    // An answer that grows past the byte cap.
    let server = start(ServerConfig {
        max_response_bytes: 400,
        ..ServerConfig::with_addr(loopback(0))
    });
    let (status, v) = post_raw(
        &server,
        json!({"queries": ["capital", "Paris", "Germany"], "topk": 3, "return_scores": true})
            .to_string(),
    );
    assert_eq!(status, 422, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("400 bytes") && msg.contains("--max-response-bytes"),
        "{msg}"
    );
    let (status, v) = post_raw(
        &server,
        json!({"queries": ["Hamlet"], "topk": 1}).to_string(),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["result"][0][0]["id"], "2", "{v}");
    server.shutdown().unwrap();
}
