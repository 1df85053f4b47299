//! [`LlmJudge`] against a fake OpenAI-compatible chat-completions server on 127.0.0.1: both
//! rubrics, the API key from an environment variable (sent, never shown), retries, timeouts and
//! the on-disk cache.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};
use turnwise_env::client::{ClientConfig, RetryPolicy};
use turnwise_env::judge::{JudgeConfig, JudgeError, LlmJudge};

const KEY_VAR: &str = "TURNWISE_TEST_JUDGE_KEY";
const KEY: &str = "sk-test-secret-123";

/// Sets the key variable once, before any test of this binary touches the environment.
fn set_key() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: every test in this binary calls `set_key` first and `Once` blocks the others
        // until the write is done; nothing else in this process reads or writes the environment
        // concurrently (the HTTP clients are built with `no_proxy`).
        unsafe { std::env::set_var(KEY_VAR, KEY) };
    });
}

#[derive(Default)]
struct Fake {
    requests: AtomicUsize,
    failed_once: AtomicUsize,
}

async fn completions(
    State(fake): State<Arc<Fake>>,
    headers: HeaderMap,
    axum::Json(body): axum::Json<Value>,
) -> Response {
    fake.requests.fetch_add(1, Ordering::SeqCst);
    let auth = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if auth != format!("Bearer {KEY}") {
        return (
            StatusCode::UNAUTHORIZED,
            axum::Json(json!({"error": {"message": "invalid api key"}})),
        )
            .into_response();
    }
    assert_eq!(body["model"], "judge-model");
    let prompt = body["messages"][0]["content"].as_str().unwrap_or("");
    if prompt.contains("FAIL_ONCE") && fake.failed_once.fetch_add(1, Ordering::SeqCst) == 0 {
        return (StatusCode::SERVICE_UNAVAILABLE, "overloaded").into_response();
    }
    if prompt.contains("SLOW") {
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let content = if prompt.contains("Turn2: X.X") {
        "<reasoning>Turn1: good format, gold retrieved, 1 search: 0.1 + 0.3 - 0.1.\nTurn2: \
         correct.</reasoning>\n<score>\nTurn1: 0.3\nTurn2: 1.0\n</score>"
            .to_string()
    } else if prompt.contains("<answer>Paris</answer>") {
        "<reasoning>The answer Paris matches.</reasoning>\n<score> 1.0 </score>".to_string()
    } else if prompt.contains("GARBLE") {
        "I cannot decide.".to_string()
    } else {
        "<reasoning>Wrong city.</reasoning><score>0.0</score>".to_string()
    };
    axum::Json(json!({
        "id": "cmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
            "finish_reason": "stop"}]
    }))
    .into_response()
}

fn start_fake() -> (SocketAddr, Arc<Fake>) {
    let fake = Arc::new(Fake::default());
    let app = Router::new()
        .route("/v1/chat/completions", post(completions))
        .with_state(Arc::clone(&fake));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            axum::serve(listener, app).await.unwrap();
        });
    });
    (rx.recv().unwrap(), fake)
}

fn temp_dir(name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    std::env::temp_dir().join(format!(
        "turnwise-judge-{name}-{}-{nanos}",
        std::process::id()
    ))
}

fn config(addr: SocketAddr, cache: Option<PathBuf>) -> JudgeConfig {
    JudgeConfig {
        api_key_env: Some(KEY_VAR.into()),
        client: ClientConfig {
            timeout: Duration::from_millis(300),
            connect_timeout: Duration::from_millis(300),
            retry: RetryPolicy {
                max_attempts: 3,
                initial_backoff: Duration::from_millis(50),
                max_backoff: Duration::from_millis(100),
                multiplier: 2.0,
                jitter: 0.5,
            },
            use_system_proxy: false,
        },
        cache_dir: cache,
        ..JudgeConfig::new(format!("http://{addr}/v1"), "judge-model")
    }
}

fn turns(answer: &str) -> Vec<String> {
    vec![
        "<think>look up</think><search>capital of France</search>\
         <information>Doc 1(Title: Paris) Paris is the capital of France.</information>"
            .to_string(),
        format!("<think>found it</think><answer>{answer}</answer>"),
    ]
}

#[test]
fn rubrics_score_through_the_endpoint_and_the_key_stays_hidden() {
    set_key();
    let (addr, fake) = start_fake();
    let judge = LlmJudge::new(config(addr, None)).unwrap();
    let gold = vec!["Paris".to_string()];
    assert_eq!(
        judge
            .outcome("Capital of France?", &gold, &turns("Paris"))
            .unwrap(),
        1.0
    );
    assert_eq!(
        judge
            .outcome("Capital of France?", &gold, &turns("Lyon"))
            .unwrap(),
        0.0
    );
    assert_eq!(
        judge
            .turn_scores("Capital of France?", &gold, &turns("Paris"))
            .unwrap(),
        vec![0.3, 1.0]
    );
    assert_eq!(fake.requests.load(Ordering::SeqCst), 3);
    let shown = format!("{judge:?}");
    assert!(
        !shown.contains(KEY) && shown.contains("redacted"),
        "{shown}"
    );

    // A reply without a score is a clear error quoting the reply.
    let err = judge.outcome("GARBLE", &gold, &turns("x")).unwrap_err();
    assert!(
        matches!(&err, JudgeError::Unparsable { reply, .. } if reply.contains("cannot decide"))
    );

    // Wrong key: 401 is not retried, and the error does not contain the key.
    let mut bad = config(addr, None);
    bad.api_key_env = None;
    let before = fake.requests.load(Ordering::SeqCst);
    let err = LlmJudge::new(bad)
        .unwrap()
        .outcome("q", &gold, &turns("Paris"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("401") && err.contains("invalid api key"),
        "{err}"
    );
    assert!(!err.contains(KEY));
    assert_eq!(fake.requests.load(Ordering::SeqCst) - before, 1);

    // A named but unset variable is reported by name.
    let mut missing = config(addr, None);
    missing.api_key_env = Some("TURNWISE_TEST_JUDGE_KEY_UNSET".into());
    let err = LlmJudge::new(missing).unwrap_err().to_string();
    assert!(err.contains("TURNWISE_TEST_JUDGE_KEY_UNSET"), "{err}");
}

#[test]
fn transient_failures_are_retried_and_slow_replies_time_out() {
    set_key();
    let (addr, fake) = start_fake();
    let judge = LlmJudge::new(config(addr, None)).unwrap();
    let gold = vec!["Paris".to_string()];
    assert_eq!(
        judge.outcome("FAIL_ONCE", &gold, &turns("Paris")).unwrap(),
        1.0
    );
    assert_eq!(
        fake.requests.load(Ordering::SeqCst),
        2,
        "one 503, one success"
    );

    let started = Instant::now();
    let err = judge
        .outcome("SLOW", &gold, &turns("Paris"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("timed out") && err.contains("attempt 3 of 3"),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn replies_are_cached_on_disk_by_request() {
    set_key();
    let (addr, fake) = start_fake();
    let dir = temp_dir("cache");
    let judge = LlmJudge::new(config(addr, Some(dir.clone()))).unwrap();
    let gold = vec!["Paris".to_string()];
    assert_eq!(judge.outcome("q", &gold, &turns("Paris")).unwrap(), 1.0);
    assert_eq!(judge.outcome("q", &gold, &turns("Paris")).unwrap(), 1.0);
    assert_eq!(
        fake.requests.load(Ordering::SeqCst),
        1,
        "second call from cache"
    );
    // A different request misses; a fresh judge on the same directory hits.
    assert_eq!(judge.outcome("q", &gold, &turns("Lyon")).unwrap(), 0.0);
    assert_eq!(fake.requests.load(Ordering::SeqCst), 2);
    let again = LlmJudge::new(config(addr, Some(dir.clone()))).unwrap();
    assert_eq!(again.outcome("q", &gold, &turns("Lyon")).unwrap(), 0.0);
    assert_eq!(fake.requests.load(Ordering::SeqCst), 2);
    let files: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
    assert_eq!(files.len(), 2);
    for f in files {
        let text = std::fs::read_to_string(f.unwrap().path()).unwrap();
        assert!(!text.contains(KEY), "the key must not reach the cache");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
