//! [`HttpEnv`] against a tiny axum environment server on 127.0.0.1 speaking the documented
//! `/reset` + `/step` protocol: a counting game per session ("say inc until the counter reaches
//! the target").

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};
use turnwise_env::client::{ClientConfig, RetryPolicy};
use turnwise_env::env::{
    EnvError, Environment, HttpEnv, ResetRequest, StepRequest, StepResponse, Task,
};

#[derive(Default)]
struct Game {
    /// session → (counter, target)
    sessions: Mutex<HashMap<String, (u64, u64)>>,
    step_calls: AtomicUsize,
}

async fn reset(
    State(game): State<Arc<Game>>,
    axum::Json(req): axum::Json<ResetRequest>,
) -> Response {
    let target = req
        .task
        .params
        .get("target")
        .and_then(Value::as_u64)
        .unwrap_or(2);
    game.sessions
        .lock()
        .unwrap()
        .insert(req.session, (0, target));
    axum::Json(json!({"observation": format!("counter 0 of {target} ({})", req.task.id)}))
        .into_response()
}

async fn step(State(game): State<Arc<Game>>, axum::Json(req): axum::Json<StepRequest>) -> Response {
    game.step_calls.fetch_add(1, Ordering::SeqCst);
    if req.action == "explode" {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            axum::Json(json!({"error": {"message": "the game crashed"}})),
        )
            .into_response();
    }
    if req.action == "garble" {
        return axum::Json(json!({"observation": 3})).into_response();
    }
    let mut sessions = game.sessions.lock().unwrap();
    let Some((counter, target)) = sessions.get_mut(&req.session) else {
        return (
            StatusCode::NOT_FOUND,
            axum::Json(json!({"detail": format!("unknown session {}", req.session)})),
        )
            .into_response();
    };
    let valid = req.action.trim() == "inc";
    if valid {
        *counter += 1;
    }
    let done = *counter >= *target;
    let answer = StepResponse {
        observation: format!("counter {counter} of {target}"),
        reward: if done { 1.0 } else { 0.0 },
        done,
        info: serde_json::from_value(
            json!({"valid_action": valid, "won": done, "counter": *counter}),
        )
        .unwrap(),
    };
    axum::Json(answer).into_response()
}

/// Starts the game server on an ephemeral loopback port in a background runtime.
fn start_game() -> (SocketAddr, Arc<Game>, tokio::sync::oneshot::Sender<()>) {
    let game = Arc::new(Game::default());
    let app = Router::new()
        .route("/reset", post(reset))
        .route("/step", post(step))
        .with_state(Arc::clone(&game));
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
    (addr_rx.recv().unwrap(), game, stop_tx)
}

fn config(attempts: u32) -> ClientConfig {
    ClientConfig {
        timeout: Duration::from_secs(5),
        connect_timeout: Duration::from_millis(500),
        retry: RetryPolicy {
            max_attempts: attempts,
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_millis(100),
            multiplier: 2.0,
            jitter: 0.5,
        },
        use_system_proxy: false,
    }
}

fn task(target: u64) -> Task {
    let mut t = Task::with_seed("count", 0);
    t.params.insert("target".into(), json!(target));
    t
}

#[test]
fn episodes_run_over_http_with_independent_sessions() {
    let (addr, _game, stop) = start_game();
    let url = format!("http://{addr}");
    let mut a = HttpEnv::with_config(&url, config(3)).unwrap();
    let mut b = HttpEnv::with_config(&url, config(3)).unwrap();
    assert_ne!(a.session(), b.session());

    assert!(matches!(a.step("inc"), Err(EnvError::NotReset { .. })));

    assert_eq!(a.reset(&task(2)).unwrap().text, "counter 0 of 2 (count)");
    assert_eq!(b.reset(&task(5)).unwrap().text, "counter 0 of 5 (count)");

    let r = a.step("jump").unwrap();
    assert!(!r.info.valid_action && !r.done && r.reward == 0.0);
    assert_eq!(r.info.extra["counter"], 0);
    let r = a.step("inc").unwrap();
    assert_eq!(r.observation.text, "counter 1 of 2");
    let r = b.step("inc").unwrap();
    assert_eq!(
        r.observation.text, "counter 1 of 5",
        "sessions are independent"
    );
    let r = a.step("inc").unwrap();
    assert!(r.done && r.info.won && r.info.valid_action);
    assert_eq!(r.reward, 1.0);
    assert!(matches!(a.step("inc"), Err(EnvError::EpisodeOver { .. })));

    // A new episode on the same adapter.
    a.reset(&task(1)).unwrap();
    assert!(a.step("inc").unwrap().done);
    let _ = stop.send(());
}

#[test]
fn server_failures_are_reported_and_steps_are_not_replayed() {
    let (addr, game, stop) = start_game();
    let url = format!("http://{addr}");
    let mut env = HttpEnv::with_config(&url, config(4)).unwrap();
    env.reset(&task(3)).unwrap();

    let before = game.step_calls.load(Ordering::SeqCst);
    let err = env.step("explode").unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains(&format!("{url}/step")) && text.contains("the game crashed"),
        "{text}"
    );
    assert_eq!(
        game.step_calls.load(Ordering::SeqCst) - before,
        1,
        "a step the server saw must not be retried"
    );

    let err = env.step("garble").unwrap_err().to_string();
    assert!(err.contains("malformed answer"), "{err}");

    let _ = stop.send(());
    // Give the server a moment to close its listener, then the env fails within the retries.
    std::thread::sleep(Duration::from_millis(100));
    let started = std::time::Instant::now();
    let err = env.reset(&task(1)).unwrap_err().to_string();
    assert!(
        err.contains("cannot connect") && err.contains("attempt 4 of 4"),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(3));
}
