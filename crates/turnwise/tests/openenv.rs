//! Environments over HTTP with OpenEnv's protocol, end to end on loopback:
//!
//! - a guess-the-number environment written with openenv-core's server API
//!   (`tests/openenv/guess_env.py`, run with uvicorn) played by `task.env = "openenv"`: the
//!   agent's turns, the server's observations and rewards flow token-exactly through the
//!   rollout's bookkeeping, an evaluation and a one-step training run through the CLI;
//! - `turnwise serve-env` driven by openenv-core's own `GenericEnvClient` (and its `validate`
//!   check) on the search world and FrozenLake (`tests/openenv/drive_serve_env.py`);
//! - turnwise's client on turnwise's server: a game played over the protocol gives the native
//!   environment's observations and rewards, and the session's errors are clear.
//!
//! The Python parts need `openenv-core` (0.3; `.ci/run` installs it): without it they fail,
//! saying so.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use turnwise::config::TrainConfig;
use turnwise::task::TaskSet;
use turnwise::trainer::Trainer;
use turnwise_core::trajectory::{Segment, TurnAction};
use turnwise_env::env::openenv::{ActionText, OpenEnvSession, OpenEnvTimeouts, check_health};
use turnwise_env::env::{Environment, OpenEnvEnv, OpenEnvSettings, Task};
use turnwise_env::server::BackgroundServer;
use turnwise_env::server::openenv::{EnvServerConfig, router};
use turnwise_env::world::Split;

fn python() -> String {
    std::env::var("TURNWISE_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Fails (rather than skips) when openenv-core is missing: CI installs it.
fn require_openenv() {
    let out = Command::new(python())
        .args(["-c", "import openenv.core, uvicorn"])
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{} cannot import openenv-core: `pip install openenv-core==0.3.0` (.ci/run installs \
         it)\n{}",
        python(),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/openenv")
        .join(name)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A child process killed (and reaped) on drop.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `guess_env.py` on a free port, logging to `log`, once its `/health` answers.
fn start_guess_server(log: &Path) -> (Killed, String) {
    require_openenv();
    let port = free_port();
    let child = Command::new(python())
        .arg(script("guess_env.py"))
        .arg(port.to_string())
        .arg(log)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("python3 starts");
    let mut child = Killed(child);
    let url = format!("http://127.0.0.1:{port}");
    let t = Instant::now();
    // openenv-core imports gradio and fastmcp: its server takes seconds to start.
    while check_health(&url, Duration::from_secs(2)).is_err() {
        if let Some(status) = child.0.try_wait().unwrap() {
            panic!("guess_env.py exited with {status} before answering /health");
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "guess_env.py did not answer /health within 120 s"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    (child, url)
}

/// The tiny model, turn and episode settings of the OpenEnv task on `url`.
fn guess_sets(url: &str, send: &str) -> Vec<String> {
    [
        "task.env=\"openenv\"".to_string(),
        format!("task.openenv.url=\"{url}\""),
        "task.openenv.observation_fields=[\"prompt\"]".into(),
        "task.openenv.instructions=\"Think in <think> </think>, then guess one digit in <action> </action>.\"".into(),
        format!("task.openenv.send=\"{send}\""),
        "task.openenv.train=6".into(),
        "task.openenv.validation=2".into(),
        "task.openenv.test=3".into(),
        "task.openenv.success_reward=0.5".into(),
        "task.max_turns=3".into(),
        "model.vocab_size=600".into(),
        "model.hidden_size=32".into(),
        "model.num_layers=2".into(),
        "model.num_heads=4".into(),
        "model.num_kv_heads=2".into(),
        "model.intermediate_size=64".into(),
        "sft.steps=0".into(),
        "rollout.prompts_per_step=2".into(),
        "rollout.group_size=2".into(),
        "rollout.max_turn_tokens=12".into(),
        "rollout.max_response_tokens=300".into(),
        "optim.mini_batch_size=0".into(),
        "run.steps=1".into(),
        "eval.questions=3".into(),
    ]
    .to_vec()
}

/// The server's log lines of `kind` for `seed`, from line `from` on.
fn logged(log: &Path, from: usize, seed: u64) -> Vec<Value> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .skip(from)
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["kind"] == "step" && v["seed"] == seed)
        .collect()
}

fn log_len(log: &Path) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .count()
}

/// The decoded environment segments of an episode, in order.
fn env_segments(t: &Trainer, traj: &turnwise_core::trajectory::Trajectory) -> Vec<String> {
    traj.segments
        .iter()
        .filter_map(|s| match s {
            Segment::Env(e) => Some(t.tokenizer.decode(&e.ids, false).unwrap()),
            Segment::Agent(_) => None,
        })
        .collect()
}

fn wrapped(text: &str) -> String {
    format!("\n\n<information>{text}</information>\n\n")
}

#[test]
fn a_python_openenv_server_plays_through_rollouts_evaluation_and_training() {
    let tmp = tempfile::tempdir().unwrap();
    let log = tmp.path().join("guess.jsonl");
    let (_server, url) = start_guess_server(&log);

    // Turns of the agent format played through the rollout's bookkeeping.
    let cfg = TrainConfig::resolve(Some("grpo"), None, &guess_sets(&url, "action")).unwrap();
    assert_eq!(cfg.task.format, turnwise::config::AgentFormatName::T2po);
    let t = Trainer::new(cfg).unwrap();
    let q = t.task.questions(Split::Validation)[0].clone();
    // Validation episode 0 follows the 6 training seeds: seed 6, number (7·6 + 3) mod 10 = 5.
    assert_eq!((q.id.as_str(), q.seed), ("openenv-validation-0", 6));
    assert!(
        q.text
            .ends_with("Game 6: guess my number from 0 to 9 — you have 3 tries."),
        "{}",
        q.text
    );
    let from = log_len(&log);
    let ep = common::play_turns(
        &t,
        &q,
        &[
            "<think>start low</think><action> 2 </action>",
            "<think>no action in this turn</think>",
            "<think>it must be five</think><action>5</action>",
        ],
    );
    let sent = logged(&log, from, 6);
    // The turn without an action block was not sent.
    let messages: Vec<&str> = sent
        .iter()
        .map(|v| v["message"].as_str().unwrap())
        .collect();
    assert_eq!(messages, ["2", "5"]);
    assert_eq!(sent[0]["prompt"], "2 is too low.");
    // What the agent read is what the server sent, in the format's observation block; after the
    // invalid turn it reads the same observation again (the server's state did not change).
    let first = wrapped(sent[0]["prompt"].as_str().unwrap());
    assert_eq!(env_segments(&t, &ep.trajectory), [first.clone(), first]);
    let rewards: Vec<f64> = ep
        .trajectory
        .turns
        .iter()
        .map(|r| r.env_reward.unwrap())
        .collect();
    assert_eq!(rewards, [-0.125, 0.0, 1.0]);
    assert_eq!(sent[1]["reward"], 1.0);
    assert_eq!(sent[1]["done"], true);
    assert_eq!(ep.env_return, 0.875);
    assert!(ep.won, "a return of 0.875 reaches success_reward = 0.5");
    assert!(matches!(&ep.trajectory.turns[0].action, TurnAction::Move { action } if action == "2"));
    assert!(matches!(
        ep.trajectory.turns[1].action,
        TurnAction::Invalid { .. }
    ));
    assert!(!ep.trajectory.turns[1].format_ok && ep.trajectory.turns[0].format_ok);
    let score = t
        .task
        .score_episode(&t.config.reward, &ep, &q.golden_answers)
        .unwrap();
    assert_eq!((score.score, score.em), (0.875, 1.0));

    // An evaluation of the (untrained) policy sending whole turns: every turn reaches the
    // server, and every observation comes back token-exactly.
    let t =
        Trainer::new(TrainConfig::resolve(Some("grpo"), None, &guess_sets(&url, "text")).unwrap())
            .unwrap();
    let from = log_len(&log);
    let (r, episodes) = t.evaluate_samples(Split::Test, 3, 1.0, 0, 1).unwrap();
    assert_eq!((r.n, r.is_game()), (3, true));
    for e in &episodes {
        let j: u64 = e.question_id.rsplit('-').next().unwrap().parse().unwrap();
        let sent = logged(&log, from, 8 + j);
        let turns = &e.trajectory.turns;
        assert_eq!(sent.len(), turns.len(), "{}", e.question_id);
        for (k, (s, turn)) in sent.iter().zip(turns).enumerate() {
            assert_eq!(
                turn.env_reward,
                s["reward"].as_f64(),
                "{} turn {k}",
                e.question_id
            );
        }
        // Every observation but the last (which ends the episode) is in the trajectory.
        let expected: Vec<String> = sent[..sent.len() - 1]
            .iter()
            .map(|s| wrapped(s["prompt"].as_str().unwrap()))
            .collect();
        assert_eq!(
            env_segments(&t, &e.trajectory),
            expected,
            "{}",
            e.question_id
        );
        assert_eq!(sent.last().unwrap()["done"].as_bool(), Some(true));
    }

    // A one-step training run through the command line, evaluated before and after.
    let mut args: Vec<String> = ["train", "--preset", "grpo", "--out", "run"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    for s in guess_sets(&url, "text") {
        args.extend(["--set".to_string(), s]);
    }
    let out = common::turnwise_in(&args, tmp.path());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.lines().any(|l| l.starts_with("test success (n=3)")),
        "{stdout}"
    );
    let summary: Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("run/summary.json")).unwrap(),
    )
    .unwrap();
    for key in ["before_greedy", "after_greedy"] {
        assert!(summary[key]["success"].as_f64().is_some(), "{summary}");
    }
    // `turnwise eval` reads the run's config back: the same server, the held-out seeds.
    let args: Vec<String> = ["eval", "--run", "run", "--questions", "2"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let out = common::turnwise_in(&args, tmp.path());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (r["split"].as_str(), r["n"].as_u64()),
        (Some("test"), Some(2))
    );
    assert!(r["success"].as_f64().is_some(), "{r}");
}

#[test]
fn a_dead_or_wrong_server_is_refused_before_the_run_directory_is_touched() {
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let mut args: Vec<String> = ["train", "--preset", "grpo", "--out", "run"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    for s in guess_sets(&url, "action") {
        args.extend(["--set".to_string(), s]);
    }
    let out = common::turnwise_in(&args, tmp.path());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(&format!(
            "task.openenv.url = \"{url}\": no OpenEnv server answers there"
        )) && stderr.contains(&format!("{url}/health")),
        "{stderr}"
    );
    assert!(!tmp.path().join("run").exists());
    // Config errors name the key.
    let e = TrainConfig::resolve(Some("grpo"), None, &["task.env=\"openenv\"".into()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("task.openenv.url"), "{e}");
    let e = TrainConfig::resolve(Some("grpo"), None, &["task.openenv.train=3".into()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("task.openenv") && e.contains("task.env = \"search\""),
        "{e}"
    );
}

/// Tiny world and game settings for `serve-env`.
fn served_sets(env: &str) -> Vec<String> {
    let mut sets = common::tiny_overrides();
    sets.extend(
        [
            "task.game.train=4",
            "task.game.validation=2",
            "task.game.test=2",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    sets.push(format!("task.env=\"{env}\""));
    match env {
        "frozen_lake" => sets.push("task.max_turns=6".into()),
        // Search-R1's tags (the preset plays the boxed format).
        _ => sets.extend([
            "task.format=\"search_r1\"".into(),
            "reward.name=\"em\"".into(),
        ]),
    }
    sets
}

fn served_task(env: &str) -> TaskSet {
    let cfg = TrainConfig::resolve(Some("grpo"), None, &served_sets(env)).unwrap();
    TaskSet::build(&cfg.task).unwrap()
}

/// turnwise's client on turnwise's server: settings that pass turns and observations through
/// unchanged (the served environment parses the turn and wraps its own observations).
fn passthrough(url: &str, max_turns: usize) -> OpenEnvSettings {
    OpenEnvSettings {
        url: url.to_owned(),
        action_field: "message".into(),
        observation_fields: vec!["text".into()],
        reset_kwargs: serde_json::from_value(json!({"split": "test"})).unwrap(),
        seed_field: Some("index".into()),
        send: ActionText::Text,
        format: turnwise_core::grammar::Format::T2po,
        observation_template: "{observation}".into(),
        max_turns,
        success_reward: 1.0,
        timeouts: OpenEnvTimeouts::default(),
    }
}

#[test]
fn a_game_served_over_the_protocol_plays_as_the_native_environment() {
    let task = served_task("frozen_lake");
    let game = task.game.as_ref().unwrap();
    let maps: Vec<_> = game.maps(Split::Test).to_vec();
    let questions: Vec<String> = task
        .questions(Split::Test)
        .iter()
        .map(|q| q.text.clone())
        .collect();
    let native_task = served_task("frozen_lake");
    let source = turnwise::task::openenv::TaskEpisodes::new(task).unwrap();
    let server = BackgroundServer::start_router(
        "openenv",
        router(source.into_source(), EnvServerConfig::default()),
        "127.0.0.1:0".parse().unwrap(),
        Duration::from_secs(30),
    )
    .unwrap();
    let url = format!("http://{}", server.local_addr());
    check_health(&url, Duration::from_secs(5)).unwrap();
    let mut remote = OpenEnvEnv::new(passthrough(&url, 6)).unwrap();
    for (j, map) in maps.iter().enumerate() {
        // Reset by index: the question is the map's rules and board.
        let first = remote.reset(&Task::with_seed("x", j as u64)).unwrap();
        assert_eq!(first.text, questions[j]);
        let mut native = native_task.env().unwrap();
        native
            .reset(&TaskSet::env_task(native_task.questions(Split::Test)[j]))
            .unwrap();
        // A wrong move first (an invalid one), then the solver's moves.
        let mut turns = vec!["<think>hmm</think><action>jump</action>".to_string()];
        turns.extend(map.solution.iter().map(|d| d.to_action_text()));
        for turn in &turns {
            let a = remote.step(turn).unwrap();
            let b = native.step(turn).unwrap();
            assert_eq!(
                (&a.observation.text, a.reward, a.done),
                (&b.observation.text, b.reward, b.done)
            );
            // The server's verdict on the move travels in its observation.
            assert_eq!(
                a.info.extra["observation"]["valid_action"].as_bool(),
                Some(b.info.valid_action)
            );
            if a.done {
                assert!(a.info.won && b.info.won);
            }
        }
    }
    // The session's errors: a step before any reset, an index out of range, a bad split.
    let mut s = OpenEnvSession::connect(&url, OpenEnvTimeouts::default()).unwrap();
    let step = serde_json::from_value(json!({"message": "up"})).unwrap();
    let e = s.step(&step, "step 1").unwrap_err().to_string();
    assert!(
        e.contains("error EXECUTION_ERROR: step before reset"),
        "{e}"
    );
    let mut s = OpenEnvSession::connect(&url, OpenEnvTimeouts::default()).unwrap();
    let bad = serde_json::from_value(json!({"split": "test", "index": 9})).unwrap();
    let e = s.reset(&bad, "reset").unwrap_err().to_string();
    assert!(
        e.contains("VALIDATION_ERROR: index 9 is out of range: the test split has 2 episodes"),
        "{e}"
    );
    let mut s = OpenEnvSession::connect(&url, OpenEnvTimeouts::default()).unwrap();
    let bad = serde_json::from_value(json!({"split": "dev"})).unwrap();
    let e = s.reset(&bad, "reset").unwrap_err().to_string();
    assert!(
        e.contains("split must be train, validation or test, got \"dev\""),
        "{e}"
    );
    // The state of a session names its episode.
    let mut s = OpenEnvSession::connect(&url, OpenEnvTimeouts::default()).unwrap();
    s.reset(
        &serde_json::from_value(json!({"split": "validation", "seed": 3})).unwrap(),
        "reset",
    )
    .unwrap();
    let state = s.state().unwrap();
    assert_eq!(
        (
            state["split"].as_str(),
            state["index"].as_u64(),
            state["step_count"].as_u64()
        ),
        (Some("validation"), Some(1), Some(0))
    );
    // HTTP: /step is refused with why.
    let c = reqwest::blocking::Client::new();
    let r = c
        .post(format!("{url}/step"))
        .json(&json!({"action": {"message": "up"}}))
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    assert!(
        r.text()
            .unwrap()
            .contains("play episodes over the WebSocket session at /ws")
    );
}

/// Reads the `serving … on http://ADDR` line of a `turnwise serve-env` child.
fn served_url(child: &mut Child) -> String {
    let stdout = child.stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    line.split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no URL in {line:?}"))
        .to_owned()
}

fn serve_env(env: &str) -> (Killed, String) {
    let mut args: Vec<String> = [
        "--quiet",
        "serve-env",
        "--preset",
        "grpo",
        "--addr",
        "127.0.0.1:0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for s in served_sets(env) {
        args.extend(["--set".to_string(), s]);
    }
    let child = Command::new(env!("CARGO_BIN_EXE_turnwise"))
        .args(&args)
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut child = Killed(child);
    let url = served_url(&mut child.0);
    (child, url)
}

#[test]
fn openenv_clients_play_turnwise_serve_env() {
    require_openenv();
    let (_search, search_url) = serve_env("search");
    let (_lake, lake_url) = serve_env("frozen_lake");
    // What the Python client must see, from the same configs built here.
    let search = served_task("search");
    let q = search.questions(Split::Test)[0].clone();
    let lake = served_task("frozen_lake");
    let map = lake.game.as_ref().unwrap().maps(Split::Test)[0].clone();
    let spec = json!({
        "search": {
            "url": search_url,
            "question": q.text,
            "prompt": search.prompt(&q).unwrap(),
            "answer": format!("<think>I know it</think><answer>{}</answer>", q.golden_answers[0]),
            "search": "<think>look it up</think><search>capital</search>",
        },
        "game": {
            "url": lake_url,
            "question": lake.questions(Split::Test)[0].text,
            "moves": map.solution.iter().map(|d| d.to_action_text()).collect::<Vec<_>>(),
        },
    });
    let out = Command::new(python())
        .arg(script("drive_serve_env.py"))
        .arg(spec.to_string())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("validate passed"), "{stdout}");
    assert!(
        stdout.contains("search episodes ok") && stdout.contains("game episode ok"),
        "{stdout}"
    );
}

/// Review cli-as-a-user-3, M6: idle WebSocket sessions never timed out, so eight idle clients
/// locked `--max-sessions 8` out for good. A session that sends nothing for the idle timeout
/// is answered SESSION_TIMEOUT and closed, its capacity freed; one that keeps talking stays.
#[test]
fn idle_sessions_are_closed_and_their_capacity_freed() {
    let source = turnwise::task::openenv::TaskEpisodes::new(served_task("frozen_lake"))
        .unwrap()
        .into_source();
    let idle = Duration::from_secs(3);
    let app = router(
        source,
        EnvServerConfig {
            max_sessions: 2,
            idle_timeout: idle,
            ..Default::default()
        },
    );
    let server = BackgroundServer::start_router(
        "openenv",
        app,
        "127.0.0.1:0".parse().unwrap(),
        Duration::from_secs(30),
    )
    .unwrap();
    let url = server.url();
    let kwargs = json!({"split": "test", "index": 0})
        .as_object()
        .unwrap()
        .clone();
    let open = || {
        let mut s = OpenEnvSession::connect(&url, OpenEnvTimeouts::default()).unwrap();
        let r = s.reset(&kwargs, "reset");
        (s, r)
    };
    let (mut busy, r) = open();
    r.unwrap();
    let (mut quiet, r) = open();
    r.unwrap();
    // Both held: a third client is refused.
    let (_, r) = open();
    let err = r.unwrap_err().to_string();
    assert!(err.contains("CAPACITY_REACHED"), "{err}");
    // One session talks halfway through the timeout; the other stays silent past it.
    std::thread::sleep(idle / 2);
    busy.state().unwrap();
    std::thread::sleep(idle * 2 / 3);
    busy.state().expect("a session that talks is kept");
    let err = quiet.state().unwrap_err().to_string();
    assert!(
        err.contains("SESSION_TIMEOUT") && err.contains("--idle-timeout-secs"),
        "{err}"
    );
    // Its capacity is free again.
    let (mut fresh, r) = open();
    r.expect("the idle session's capacity was freed");
    fresh.close();
    busy.close();
    server.shutdown().unwrap();
}
