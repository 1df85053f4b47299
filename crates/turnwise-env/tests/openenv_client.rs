//! The OpenEnv client's failures against scripted WebSocket servers on loopback: a dead server,
//! a server that is not OpenEnv, malformed answers, error answers, a full server and a server
//! that never answers. Each error must name the URL, the request and what went wrong.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};
use turnwise_env::env::openenv::{ActionText, OpenEnvSession, OpenEnvTimeouts, check_health};
use turnwise_env::env::{Environment, OpenEnvEnv, OpenEnvSettings, Task};

/// A WebSocket server accepting one connection and answering each message it reads with the
/// next of `answers` (`None`: read it and never answer).
fn scripted(answers: Vec<Option<String>>) -> (String, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let handle = std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut ws = tungstenite::accept(stream).unwrap();
        for answer in answers {
            if ws.read().is_err() {
                return;
            }
            match answer {
                Some(a) => {
                    if ws.send(tungstenite::Message::text(a)).is_err() {
                        return;
                    }
                }
                None => {
                    std::thread::sleep(Duration::from_secs(1));
                    return;
                }
            }
        }
    });
    (url, handle)
}

fn settings(url: &str) -> OpenEnvSettings {
    OpenEnvSettings {
        url: url.to_owned(),
        action_field: "message".into(),
        observation_fields: vec!["prompt".into()],
        reset_kwargs: Map::new(),
        seed_field: Some("seed".into()),
        send: ActionText::Text,
        format: turnwise_core::grammar::Format::T2po,
        observation_template: "[{observation}]".into(),
        max_turns: 4,
        success_reward: 1.0,
        timeouts: OpenEnvTimeouts {
            connect: Duration::from_secs(2),
            message: Duration::from_millis(400),
        },
    }
}

fn observation(prompt: &str, reward: Value, done: bool) -> Option<String> {
    Some(
        json!({"type": "observation", "data": {"observation": {"prompt": prompt}, "reward": reward, "done": done}})
            .to_string(),
    )
}

#[test]
fn a_dead_server_is_a_clear_error() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let e = OpenEnvSession::connect(&url, OpenEnvTimeouts::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("ws://127.0.0.1:{port}/ws"))
            && e.contains("cannot connect")
            && e.contains("is the environment server running?"),
        "{e}"
    );
    let e = check_health(&url, Duration::from_secs(2))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("{url}/health")) && e.contains("no OpenEnv server answers"),
        "{e}"
    );
    let mut env = OpenEnvEnv::new(settings(&url)).unwrap();
    let e = env
        .reset(&Task::with_seed("ep", 1))
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot connect"), "{e}");
}

#[test]
fn a_server_without_the_websocket_session_is_named() {
    // An HTTP server that answers everything 404 (an old or non-OpenEnv server).
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let h = std::thread::spawn(move || {
        for _ in 0..2 {
            let (mut s, _) = listener.accept().unwrap();
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let body = "{\"detail\":\"Not Found\"}";
            let _ = write!(
                s,
                "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    let e = OpenEnvSession::connect(&url, OpenEnvTimeouts::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("handshake was refused with HTTP 404") && e.contains("Not Found"),
        "{e}"
    );
    let e = check_health(&url, Duration::from_secs(2))
        .unwrap_err()
        .to_string();
    assert!(e.contains("HTTP 404"), "{e}");
    h.join().unwrap();
}

#[test]
fn malformed_answers_say_what_is_wrong_and_where() {
    // Not JSON at the reset.
    let (url, h) = scripted(vec![Some("<html>oops</html>".into())]);
    let mut env = OpenEnvEnv::new(settings(&url)).unwrap();
    let e = env
        .reset(&Task::with_seed("ep-7", 7))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!(
            "environment server {}/ws",
            url.replace("http", "ws")
        )) && e.contains("reset of episode ep-7 (seed = 7)")
            && e.contains("malformed answer (not JSON")
            && e.contains("<html>oops</html>"),
        "{e}"
    );
    h.join().unwrap();
    // A step answer whose observation is not an object, then a step after the failure.
    let (url, h) = scripted(vec![
        observation("Guess.", Value::Null, false),
        Some(
            json!({"type": "observation", "data": {"observation": "oops", "reward": 1.0}})
                .to_string(),
        ),
    ]);
    let mut env = OpenEnvEnv::new(settings(&url)).unwrap();
    assert_eq!(env.reset(&Task::with_seed("ep", 2)).unwrap().text, "Guess.");
    let e = env.step("3").unwrap_err().to_string();
    assert!(
        e.contains("step 1 of episode ep (seed 2)") && e.contains("\"observation\" is \"oops\""),
        "{e}"
    );
    let e = env.step("4").unwrap_err().to_string();
    assert!(
        e.contains("step 2 of episode ep (seed 2): the session is closed"),
        "{e}"
    );
    h.join().unwrap();
    // An answer of the wrong type, and a missing observation field.
    let (url, h) = scripted(vec![
        observation("Guess.", Value::Null, false),
        Some(json!({"type": "state", "data": {}}).to_string()),
    ]);
    let mut env = OpenEnvEnv::new(settings(&url)).unwrap();
    env.reset(&Task::with_seed("ep", 2)).unwrap();
    let e = env.step("3").unwrap_err().to_string();
    assert!(e.contains("expected {\"type\": \"observation\""), "{e}");
    h.join().unwrap();
    let (url, h) = scripted(vec![Some(
        json!({"type": "observation", "data": {"observation": {"board": "x"}}}).to_string(),
    )]);
    let mut env = OpenEnvEnv::new(settings(&url)).unwrap();
    let e = env
        .reset(&Task::with_seed("ep", 2))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no field \"prompt\"") && e.contains("it has: board"),
        "{e}"
    );
    h.join().unwrap();
}

#[test]
fn error_answers_are_quoted_with_their_code() {
    let (url, h) = scripted(vec![
        observation("Guess.", Value::Null, false),
        Some(
            json!({"type": "error", "data": {"message": "bad digit", "code": "EXECUTION_ERROR"}})
                .to_string(),
        ),
    ]);
    let mut env = OpenEnvEnv::new(settings(&url)).unwrap();
    env.reset(&Task::with_seed("ep", 5)).unwrap();
    let e = env.step("x").unwrap_err().to_string();
    assert!(
        e.contains(
            "step 1 of episode ep (seed 5): the server answered error EXECUTION_ERROR: bad digit"
        ),
        "{e}"
    );
    h.join().unwrap();
    // A full server (OpenEnv's default allows one session) says how to fix it.
    let (url, h) = scripted(vec![Some(
        json!({"type": "error", "data": {"message": "Server at capacity", "code": "CAPACITY_REACHED", "active_sessions": 1, "max_sessions": 1}})
            .to_string(),
    )]);
    let mut env = OpenEnvEnv::new(settings(&url)).unwrap();
    let e = env
        .reset(&Task::with_seed("ep", 5))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("CAPACITY_REACHED")
            && e.contains("allows 1 concurrent sessions")
            && e.contains("max_concurrent_envs"),
        "{e}"
    );
    h.join().unwrap();
}

#[test]
fn a_server_that_does_not_answer_times_out() {
    let (url, h) = scripted(vec![observation("Guess.", Value::Null, false), None]);
    let mut env = OpenEnvEnv::new(settings(&url)).unwrap();
    env.reset(&Task::with_seed("ep", 1)).unwrap();
    let t = Instant::now();
    let e = env.step("3").unwrap_err().to_string();
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    assert!(
        e.contains(
            "step 1 of episode ep (seed 1): no answer within 0.4 s (task.openenv.timeout_secs)"
        ),
        "{e}"
    );
    h.join().unwrap();
}

#[test]
fn rewards_done_and_success_follow_the_server() {
    let (url, h) = scripted(vec![
        observation("Guess.", Value::Null, false),
        observation("Too low.", json!(-0.25), false),
        observation("Right.", json!(1.5), true),
    ]);
    let mut env = OpenEnvEnv::new(settings(&url)).unwrap();
    env.reset(&Task::with_seed("ep", 1)).unwrap();
    let a = env.step("1").unwrap();
    assert_eq!(
        (a.observation.text.as_str(), a.reward, a.done),
        ("[Too low.]", -0.25, false)
    );
    let b = env.step("2").unwrap();
    assert_eq!((b.reward, b.done, b.info.won), (1.5, true, true));
    let e = env.step("3").unwrap_err().to_string();
    assert!(e.contains("after the episode ended"), "{e}");
    h.join().unwrap();
    // The turn limit cuts an episode the server has not ended.
    let (url, h) = scripted(vec![
        observation("Guess.", Value::Null, false),
        observation("No.", json!(0.0), false),
    ]);
    let mut s = settings(&url);
    s.max_turns = 1;
    let mut env = OpenEnvEnv::new(s).unwrap();
    env.reset(&Task::with_seed("ep", 1)).unwrap();
    let a = env.step("1").unwrap();
    assert!(a.done && a.info.truncated && !a.info.won);
    h.join().unwrap();
}
