//! LLM-judge turn rewards in training (`[judge]`): the judge's per-turn scores become the turn
//! rewards the step trains on, verdicts are cached, a failing judge falls back to the rules up to
//! `judge.max_failure_rate` of a round's rollouts and stops the run naming the judge and the rate
//! above it (or at once), and `judge.serve` serves a model inside the run whose
//! choice-mode verdicts (`guided_choice` after a prefilled score block) are the turn rewards.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::routing::post;
use serde_json::{Value, json};
use turnwise::config::TrainConfig;
use turnwise::trainer::Trainer;
use turnwise_env::server::BackgroundServer;

/// The verdict of the stand-in judge: 0.25 for every intermediate turn and 0.75 for the last
/// (values the rules never give: they move in steps of 0.1 and end in −1, 0.2 or 1).
fn verdict(n_turns: usize) -> String {
    let lines: String = (1..=n_turns)
        .map(|k| format!("Turn{k}: {}\n", if k == n_turns { "0.75" } else { "0.25" }))
        .collect();
    format!("The turns are fine.\n<score>\n{lines}</score>")
}

/// An OpenAI-compatible chat endpoint that answers the turn rubric with [`verdict`], counting
/// requests; every `fail_every`-th request (1: every one, 0: none) gets a 500 instead.
fn stand_in_judge(fail_every: usize) -> (BackgroundServer, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let h = Arc::clone(&hits);
    let app = Router::new().route(
        "/v1/chat/completions",
        post(move |axum::Json(body): axum::Json<Value>| {
            let h = Arc::clone(&h);
            async move {
                let k = h.fetch_add(1, Ordering::SeqCst) + 1;
                if fail_every > 0 && k.is_multiple_of(fail_every) {
                    return (
                        axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                        axum::Json(json!({"error": {"message": "judge exploded"}})),
                    );
                }
                let prompt = body["messages"][0]["content"].as_str().unwrap_or("");
                // The evaluation data lists the turns as "Turn1:", "Turn2:", ...
                let n = (1..)
                    .take_while(|k| prompt.contains(&format!("Turn{k}:\n")))
                    .count();
                (
                    axum::http::StatusCode::OK,
                    axum::Json(json!({"choices": [{"message": {
                        "role": "assistant", "content": verdict(n)}}]})),
                )
            }
        }),
    );
    let server = start_judge(app);
    (server, hits)
}

fn judged(extra: &[String]) -> Vec<String> {
    let mut s = common::tiny_overrides();
    s.push("judge.enabled=true".into());
    s.push("judge.max_attempts=1".into());
    s.extend(extra.iter().cloned());
    s
}

fn trainer(preset: &str, sets: &[String]) -> Trainer {
    let mut t = Trainer::new(TrainConfig::resolve(Some(preset), None, sets).unwrap()).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    t.freeze_reference().unwrap();
    t
}

/// The judge's scores become the intermediate turns' rewards; the final turn's reward R^F and
/// the rollout's score stay the rules' (the same step without the judge draws the same
/// rollouts); a one-turn rollout is not sent; verdicts are cached.
#[test]
fn judge_scores_are_the_turn_rewards_the_step_trains_on() {
    let tmp = tempfile::tempdir().unwrap();
    let (server, hits) = stand_in_judge(0);
    let cache = tmp.path().join("verdicts");
    let sets = judged(&[
        format!("judge.base_url=\"{}/v1\"", server.url()),
        format!("judge.cache_dir=\"{}\"", cache.display()),
    ]);
    let mut t = trainer("mt-ppo", &sets);
    let out = t.rl_step().unwrap();
    // Without the judge the same step draws the same rollouts, scored by the rules alone.
    let mut plain = common::tiny_overrides();
    plain.push("judge.enabled=false".into());
    let mut r = trainer("mt-ppo", &plain);
    let o = r.rl_step().unwrap();
    assert!(!o.metrics.contains_key("judge/episodes"));
    assert_eq!(out.episodes.len(), o.episodes.len());
    let multi = out
        .episodes
        .iter()
        .filter(|e| e.trajectory.num_turns() > 1)
        .count();
    assert!(multi > 0, "no rollout with an intermediate turn to judge");
    assert_eq!(
        hits.load(Ordering::SeqCst),
        multi,
        "one request per judged rollout"
    );
    assert_eq!(out.metrics["judge/failures"], 0.0, "{:?}", out.metrics);
    for (e, p) in out.episodes.iter().zip(&o.episodes) {
        assert_eq!(e.trajectory.id, p.trajectory.id);
        assert_eq!(e.response_text(), p.response_text(), "the same rollout");
        let n = e.trajectory.num_turns();
        let rules = &p.trajectory.turn_rewards;
        assert_eq!(e.trajectory.turn_rewards.len(), n);
        // The judge's 0.25 on every intermediate turn, the rules' R^F on the last (never the
        // judge's 0.75), and the rules' score.
        assert!(
            e.trajectory.turn_rewards[..n - 1]
                .iter()
                .all(|&x| x == 0.25),
            "{}: {:?}",
            e.trajectory.id,
            e.trajectory.turn_rewards
        );
        assert_eq!(
            e.trajectory.turn_rewards[n - 1],
            rules[n - 1],
            "R^F is the rules'"
        );
        assert!([-1.0, 0.2, 1.0].contains(&rules[n - 1]));
        assert_eq!(
            e.trajectory.outcome_reward, p.trajectory.outcome_reward,
            "{}: the outcome is the rules'",
            e.trajectory.id
        );
        assert!(
            p.trajectory
                .turn_rewards
                .iter()
                .all(|x| (x - 0.25).abs() > 1e-9 && (x - 0.75).abs() > 1e-9)
        );
    }
    let m = &out.metrics;
    assert_eq!(m["judge/episodes"], multi as f64);
    assert_eq!(
        m["judge/rubric_agreement"], 0.0,
        "the rules never give 0.25"
    );
    // The same rollouts again: answered from the cache, no request.
    let before = hits.load(Ordering::SeqCst);
    let judge = turnwise::trainer::judge::TurnJudge::start(&t.config.judge).unwrap();
    let questions = vec!["q".to_string(); 1];
    let golds = vec![vec!["a".to_string()]; 1];
    let ep = out
        .episodes
        .iter()
        .find(|e| e.trajectory.num_turns() > 1)
        .unwrap();
    let mut outs = vec![
        turnwise_core::reward::RewardOutput {
            score: 0.5,
            turn_rewards: vec![0.0; ep.trajectory.num_turns()],
            em: 0.0,
            format_ok: true,
            reason: String::new(),
            parts: Vec::new(),
        };
        1
    ];
    let eps = std::slice::from_ref(ep);
    judge.rescore(eps, &questions, &golds, &mut outs).unwrap();
    judge.rescore(eps, &questions, &golds, &mut outs).unwrap();
    assert_eq!(
        hits.load(Ordering::SeqCst),
        before + 1,
        "second verdict from the cache"
    );
    assert_eq!(outs[0].score, 0.5, "the score is left alone");
    assert_eq!(outs[0].turn_rewards.last(), Some(&0.0), "so is R^F");
}

/// A judge failing on every rollout stops the run at the default `judge.max_failure_rate`
/// (0.1), naming the judge and the rate, instead of training on the rules' rewards; a judge
/// failing on a third of them falls back to the rules under a limit of 0.5 (the failures
/// counted) and stops the run under the default; `judge.on_failure = "error"` stops at the
/// first failure.
#[test]
fn a_failing_judge_falls_back_to_the_rules_or_stops_the_run() {
    let (server, hits) = stand_in_judge(1);
    let url = format!("{}/v1", server.url());
    let mut t = trainer("mt-ppo", &judged(&[format!("judge.base_url=\"{url}\"")]));
    let e = format!("{:#}", t.rl_step().err().expect("the run stops"));
    // The rollouts with an intermediate turn, each sent once.
    let n = hits.load(Ordering::SeqCst);
    assert!(n >= 3, "{n} rollouts judged");
    for part in [
        url.as_str(),
        "\"turnwise\"",
        &format!("failed on {n} of {n} rollouts (100.0%)"),
        "judge.max_failure_rate = 0.1",
        "judge exploded",
    ] {
        assert!(e.contains(part), "{part:?} not in {e}");
    }

    // Every third request fails: a third of the judged rollouts (the same rollouts as above).
    let failed = n / 3;
    let (server, _) = stand_in_judge(3);
    let url = format!("{}/v1", server.url());
    let base = format!("judge.base_url=\"{url}\"");
    let mut t = trainer(
        "mt-ppo",
        &judged(&[base.clone(), "judge.max_failure_rate=0.5".into()]),
    );
    let out = t.rl_step().expect("under the limit the run goes on");
    assert_eq!(
        out.metrics["judge/failures"], failed as f64,
        "{:?}",
        out.metrics
    );
    assert!((out.metrics["judge/failure_rate"] - failed as f64 / n as f64).abs() < 1e-12);
    // The rollouts the judge scored train on its verdicts, the others on the rules'.
    let judged_eps = out
        .episodes
        .iter()
        .filter(|e| e.trajectory.turn_rewards.first() == Some(&0.25))
        .count();
    assert_eq!(judged_eps, n - failed);
    let mut t = trainer("mt-ppo", &judged(std::slice::from_ref(&base)));
    let e = format!("{:#}", t.rl_step().err().expect("above the default limit"));
    let rate = format!("{:.1}%", 100.0 * failed as f64 / n as f64);
    assert!(
        e.contains(&format!("failed on {failed} of {n} rollouts ({rate})")),
        "{e}"
    );

    let mut t = trainer(
        "mt-ppo",
        &judged(&[
            base,
            "judge.on_failure=\"error\"".into(),
            "judge.max_failure_rate=1".into(),
        ]),
    );
    let e = format!("{:#}", t.rl_step().err().unwrap());
    assert!(e.contains(&url) && e.contains("judge exploded"), "{e}");

    // The limit is checked by name.
    for bad in ["judge.max_failure_rate=1.5", "judge.max_failure_rate=-0.1"] {
        let e = TrainConfig::resolve(Some("mt-ppo"), None, &judged(&[bad.into()]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("judge.max_failure_rate"), "{bad}: {e}");
    }
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../turnwise-model/src/checkpoint/fixtures/gguf/tiny-llama.gguf")
}

/// The tiny GGUF fixture with its context length raised from 256 to 8192 tokens (its RoPE
/// positions are computed, not learned), so that the rubric prompt (a few thousand tokens of
/// its 301-token vocabulary) fits; the weights are the fixture's.
fn long_context_fixture(dir: &Path) -> PathBuf {
    let mut bytes = std::fs::read(fixture()).unwrap();
    let key = b"llama.context_length";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    assert_eq!(&bytes[at..at + 4], &4u32.to_le_bytes(), "a GGUF uint32");
    assert_eq!(&bytes[at + 4..at + 8], &256u32.to_le_bytes());
    bytes[at + 4..at + 8].copy_from_slice(&8192u32.to_le_bytes());
    let path = dir.join("tiny-llama-8k.gguf");
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn the_judge_preset_serves_its_judge_inside_the_run() {
    // mt-ppo-judge serves SmolLM2-135M-Instruct; here the tiny GGUF fixture stands in (the
    // preset test does the same). The preset asks in choice mode, so even a random 3-layer
    // model's verdicts parse: every rollout is judged, one request per turn.
    common::install_policy_host();
    let tmp = tempfile::tempdir().unwrap();
    let gguf = long_context_fixture(tmp.path());
    let sets = judged(&[format!("judge.serve=\"{}\"", gguf.display())]);
    let cfg = TrainConfig::resolve(Some("mt-ppo-judge"), None, &sets).unwrap();
    assert!(cfg.judge.enabled);
    assert_eq!(cfg.judge.mode, turnwise::config::JudgeMode::Choice);
    let mut t = trainer("mt-ppo-judge", &sets);
    let out = t.rl_step().unwrap();
    let (multi, inter) = intermediate_turns(&out.episodes);
    assert_eq!(out.metrics["judge/episodes"], multi as f64);
    assert_eq!(out.metrics["judge/failures"], 0.0, "{:?}", out.metrics);
    // One request per intermediate turn: the final turn is the rules'.
    assert_eq!(out.metrics["judge/requests"], inter as f64);
    assert!(out.metrics["timing_s/judge"] > 0.0);

    // The judge settings are checked by name.
    for (set, field) in [
        ("reward.name=\"em\"", "judge.enabled"),
        ("judge.concurrency=0", "judge.concurrency"),
        ("judge.timeout_secs=-1", "judge.timeout_secs"),
    ] {
        let mut s = judged(&[]);
        s.push(set.into());
        let e = TrainConfig::resolve(Some("mt-ppo"), None, &s)
            .unwrap_err()
            .to_string();
        assert!(e.contains(field), "{set}: {e}");
    }
}

/// The verdicts in a choice-mode cache: per rubric prompt (the user message), the scores
/// picked turn by turn, rebuilt from the prefilled score blocks and the replies.
fn cached_verdicts(dir: &Path) -> Vec<(String, Vec<String>)> {
    let mut by_prompt: std::collections::BTreeMap<String, Vec<Vec<String>>> = Default::default();
    for f in std::fs::read_dir(dir).unwrap() {
        let entry: Value =
            serde_json::from_str(&std::fs::read_to_string(f.unwrap().path()).unwrap()).unwrap();
        let req = &entry["request"];
        assert_eq!(req["continue_final_message"], true);
        assert_eq!(req["add_generation_prompt"], false);
        let prompt = req["messages"][0]["content"].as_str().unwrap().to_string();
        let prefill = req["messages"][1]["content"].as_str().unwrap();
        let reply = entry["content"].as_str().unwrap().to_string();
        let choices: Vec<&str> = req["guided_choice"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap())
            .collect();
        assert!(
            choices.contains(&reply.as_str()),
            "{reply:?} not in {choices:?}"
        );
        // "<score>\nTurn1: a\nTurn2: b\nTurn3: " → [a, b], then the reply.
        let mut picked: Vec<String> = prefill
            .strip_prefix("<score>\n")
            .unwrap()
            .lines()
            .filter_map(|l| l.split_once(": ").map(|(_, v)| v.to_string()))
            .filter(|v| !v.is_empty())
            .collect();
        picked.push(reply);
        by_prompt.entry(prompt).or_default().push(picked);
    }
    by_prompt
        .into_iter()
        .map(|(p, mut chains)| {
            chains.sort_by_key(Vec::len);
            let full = chains.last().unwrap().clone();
            for c in &chains {
                assert_eq!(&full[..c.len()], &c[..], "one chain per prompt");
            }
            (p, full)
        })
        .collect()
}

#[test]
fn a_served_judge_in_choice_mode_scores_the_turns_the_step_trains_on() {
    common::install_policy_host();
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("verdicts");
    let gguf = long_context_fixture(tmp.path());
    let served = [
        format!("judge.serve=\"{}\"", gguf.display()),
        "judge.model=\"tiny-judge\"".to_string(),
        format!("judge.cache_dir=\"{}\"", cache.display()),
    ];
    let mut sets = judged(&served);
    sets.push("judge.mode=\"choice\"".into());
    let mut t = trainer("mt-ppo", &sets);
    let mut agreement = Vec::new();
    for _step in 0..2 {
        let out = t.rl_step().unwrap();
        let m = &out.metrics;
        let (multi, inter) = intermediate_turns(&out.episodes);
        assert_eq!(m["judge/episodes"], multi as f64);
        assert_eq!(m["judge/failures"], 0.0, "every episode judged: {m:?}");
        assert_eq!(
            m["judge/requests"] + m["judge/cache_hits"],
            inter as f64,
            "one request per intermediate turn"
        );
        let verdicts = cached_verdicts(&cache);
        for e in out.episodes.iter().filter(|e| e.turn_texts.len() > 1) {
            let n = e.turn_texts.len();
            let block: String = e
                .turn_texts
                .iter()
                .enumerate()
                .map(|(k, (g, o))| format!("Turn{}:\n{g}{}\n\n", k + 1, o.as_deref().unwrap_or("")))
                .collect();
            let key = format!("### Multi-turn response\n{block}### Ground truth");
            let mine: Vec<Vec<f64>> = verdicts
                .iter()
                .filter(|(p, v)| p.contains(&key) && v.len() == n - 1)
                .map(|(_, v)| v.iter().map(|s| s.parse().unwrap()).collect())
                .collect();
            assert!(!mine.is_empty(), "no verdict for {}", e.trajectory.id);
            assert!(
                mine.contains(&e.trajectory.turn_rewards[..n - 1].to_vec()),
                "{}: trained on {:?}, the judge picked {mine:?}",
                e.trajectory.id,
                e.trajectory.turn_rewards
            );
        }
        agreement.push(m["judge/rubric_agreement"]);
    }
    assert!(
        agreement.iter().any(|&a| a < 1.0),
        "the judge differs from the rules somewhere: {agreement:?}"
    );

    // Ablation: the same run asking for free-text verdicts falls back to the rules (the same
    // prompt fits, as choice mode showed: what fails is parsing the random model's reply).
    let mut free = judged(&served[..2]);
    free.push("judge.mode=\"free\"".into());
    // Every rollout fails here: the limit is lifted so that the fallback can be seen.
    free.push("judge.max_failure_rate=1".into());
    free.push("judge.max_tokens=48".into());
    let mut t = trainer("mt-ppo", &free);
    let out = t.rl_step().unwrap();
    assert!(out.metrics["judge/failures"] > 0.0, "{:?}", out.metrics);
    let (multi, _) = intermediate_turns(&out.episodes);
    assert_eq!(out.metrics["judge/requests"], multi as f64);
}

/// The rollouts with an intermediate turn (what the judge is sent) and their intermediate turns.
fn intermediate_turns(episodes: &[turnwise::rollout::Episode]) -> (usize, usize) {
    let multi = episodes.iter().filter(|e| e.turn_texts.len() > 1).count();
    let inter = episodes
        .iter()
        .map(|e| e.turn_texts.len().saturating_sub(1))
        .sum();
    (multi, inter)
}

/// A judge answering from a table of rubric prompts (filled by the test): the scores listed
/// for the prompt's intermediate turns, 0.75 for its last; 0.25 on every intermediate turn of
/// a prompt not in the table. Counts requests.
type Table = Arc<std::sync::Mutex<std::collections::HashMap<String, Vec<f64>>>>;

fn table_judge() -> (BackgroundServer, Table, Arc<AtomicUsize>) {
    let table: Table = Default::default();
    let hits = Arc::new(AtomicUsize::new(0));
    let (t, h) = (Arc::clone(&table), Arc::clone(&hits));
    let app = Router::new().route(
        "/v1/chat/completions",
        post(move |axum::Json(body): axum::Json<Value>| {
            let (t, h) = (Arc::clone(&t), Arc::clone(&h));
            async move {
                h.fetch_add(1, Ordering::SeqCst);
                let prompt = body["messages"][0]["content"].as_str().unwrap_or("");
                let n = (1..)
                    .take_while(|k| prompt.contains(&format!("Turn{k}:\n")))
                    .count();
                let known = t.lock().unwrap().get(prompt).cloned();
                let lines: String = (1..=n)
                    .map(|k| {
                        let v = match (&known, k == n) {
                            (_, true) => 0.75,
                            (Some(s), false) => s[k - 1],
                            (None, false) => 0.25,
                        };
                        format!("Turn{k}: {v:.1}\n")
                    })
                    .collect();
                axum::Json(json!({"choices": [{"message": {
                    "role": "assistant", "content": format!("<score>\n{lines}</score>")}}]}))
            }
        }),
    );
    let server = start_judge(app);
    (server, table, hits)
}

/// The lines of `phase` in a run's metrics.
fn phase(dir: &Path, phase: &str) -> Vec<Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["phase"] == phase)
        .collect()
}

fn run(sets: &[String], dir: &Path) -> anyhow::Result<turnwise::pipeline::RunSummary> {
    let cfg = TrainConfig::resolve(Some("mt-ppo"), None, sets)?;
    let opts = turnwise::pipeline::RunOptions {
        dir: dir.to_path_buf(),
        quiet: true,
    };
    turnwise::pipeline::run(cfg, &opts, false)
}

/// Before RL the judge is calibrated on the warm-started policy's rollouts of validation
/// questions: a judge that never gives the rules' intermediate scores stops the run before its
/// first RL step, naming the judge, its agreement, the floor and the fix, with the calibration
/// logged; the same judge trains with the floor lowered to 0 explicitly; a judge that gives the
/// rules' scores on the calibration's turns passes the default floor and the run trains.
#[test]
fn the_judge_is_calibrated_against_the_rules_before_rl() {
    let tmp = tempfile::tempdir().unwrap();
    let (server, table, hits) = table_judge();
    let url = format!("{}/v1", server.url());
    let mut sets = judged(&[format!("judge.base_url=\"{url}\"")]);
    sets.push("run.steps=1".into());

    // The table is empty: 0.25 on every intermediate turn, which the rules never give.
    let dir = tmp.path().join("disagrees");
    let e = format!("{:#}", run(&sets, &dir).expect_err("stops before RL"));
    for part in [
        url.as_str(),
        "\"turnwise\"",
        "judge/calibration/rubric_agreement = 0.000",
        "under judge.min_rubric_agreement = 0.5",
        "the run stops before RL",
        "point judge.base_url at a stronger judge",
    ] {
        assert!(e.contains(part), "{part:?} not in {e}");
    }
    let cal = phase(&dir, "judge_calibration");
    assert_eq!(cal.len(), 1, "{cal:?}");
    assert_eq!(cal[0]["judge/calibration/rubric_agreement"], 0.0);
    let turns = cal[0]["judge/calibration/turns"].as_f64().unwrap();
    assert!(turns > 0.0, "{cal:?}");
    assert!(hits.load(Ordering::SeqCst) > 0);
    assert!(phase(&dir, "train").is_empty(), "no RL step");

    // The floor lowered explicitly: the same judge trains.
    let mut low = sets.clone();
    low.push("judge.min_rubric_agreement=0".into());
    let dir = tmp.path().join("floor-0");
    run(&low, &dir).expect("the floor at 0 never stops");
    assert_eq!(phase(&dir, "judge_calibration").len(), 1);
    assert_eq!(phase(&dir, "train").len(), 1);

    // A judge that agrees: the table holds the rules' scores of the calibration's rollouts (the
    // run draws the same ones from its seed after the same warm start).
    let cfg = TrainConfig::resolve(Some("mt-ppo"), None, &sets).unwrap();
    let mut t = Trainer::new(cfg).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    t.freeze_reference().unwrap();
    let r = t.calibration_rollouts().unwrap();
    for i in 0..r.episodes.len() {
        let turns: Vec<String> = r.episodes[i]
            .turn_texts
            .iter()
            .map(|(g, o)| format!("{g}{}", o.as_deref().unwrap_or("")))
            .collect();
        let prompt = turnwise_env::judge::turn_prompt(&r.questions[i], &r.golds[i], &turns);
        let scores = r.rules[i].turn_rewards.clone();
        table.lock().unwrap().insert(prompt, scores);
    }
    let dir = tmp.path().join("agrees");
    run(&sets, &dir).expect("an agreeing judge passes");
    let cal = phase(&dir, "judge_calibration");
    assert_eq!(cal[0]["judge/calibration/rubric_agreement"], 1.0, "{cal:?}");
    assert_eq!(cal[0]["judge/calibration/turns"].as_f64().unwrap(), turns);
    let train = phase(&dir, "train");
    assert_eq!(train.len(), 1);
    assert!(
        train[0]["judge/episodes"].as_f64().unwrap() > 0.0,
        "{train:?}"
    );
}

/// mt-ppo-judge ships no judge: its config resolves (so `turnwise config` can show it), but the
/// run refuses to start, naming `judge.base_url` and how to point it at a server; with a judge
/// endpoint it starts.
#[test]
fn the_judge_preset_refuses_to_start_without_a_judge() {
    let cfg = TrainConfig::resolve(Some("mt-ppo-judge"), None, &common::tiny_overrides()).unwrap();
    assert!(cfg.judge.enabled && cfg.judge.serve.is_none() && cfg.judge.base_url.is_empty());
    assert_eq!(cfg.judge.min_rubric_agreement, 0.5);
    let e = format!("{:#}", Trainer::new(cfg.clone()).err().expect("no judge"));
    for part in [
        "judge.base_url",
        "is not set",
        "turnwise serve --model DIR",
        "vllm serve MODEL",
        "judge.serve",
        "judge.min_rubric_agreement",
    ] {
        assert!(e.contains(part), "{part:?} not in {e}");
    }
    let tmp = tempfile::tempdir().unwrap();
    let opts = turnwise::pipeline::RunOptions {
        dir: tmp.path().join("run"),
        quiet: true,
    };
    let e = format!(
        "{:#}",
        turnwise::pipeline::run(cfg, &opts, false).unwrap_err()
    );
    assert!(e.contains("judge.base_url"), "{e}");
    assert!(
        !opts.dir.exists(),
        "refused before the run directory is made"
    );

    let (server, _) = stand_in_judge(0);
    let mut sets = common::tiny_overrides();
    sets.push(format!("judge.base_url=\"{}/v1\"", server.url()));
    let cfg = TrainConfig::resolve(Some("mt-ppo-judge"), None, &sets).unwrap();
    Trainer::new(cfg).expect("a named judge starts");
}

/// Serves a fake judge's router on a free local port.
fn start_judge(app: axum::Router) -> BackgroundServer {
    BackgroundServer::start_router(
        "judge",
        app,
        "127.0.0.1:0".parse().unwrap(),
        std::time::Duration::from_secs(30),
    )
    .unwrap()
}
