//! `rollout.backend = "harness"`: the trainer serves its policy, runs an agent program (a real
//! Python process over real HTTP) per episode, and trains on what its server recorded. The
//! worked example (examples/harness/search_agent.py, the `openai` client) gives exactly the
//! built-in search rollout's trajectories (ids, log-probs within 1e-5) on the same seeds;
//! programs that crash, hang or never call the model fail their episodes within the timeout
//! while the step goes on; a program that re-renders its history trains as separate samples;
//! what needs control of generation is refused by name.

mod common;

use std::path::{Path, PathBuf};
use std::time::Instant;

use turnwise::config::TrainConfig;
use turnwise::rollout::Episode;
use turnwise::trainer::Trainer;
use turnwise_env::world::Split;

fn example_agent() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/harness/search_agent.py")
}

/// The tiny search world (the presets' boxed format), with room for every turn's observation.
fn base_sets() -> Vec<String> {
    let mut s = common::tiny_overrides();
    s.push("rollout.max_response_tokens=400".into());
    s
}

fn with_harness(sets: &[String], command: &[&str], extra: &[&str]) -> Vec<String> {
    let mut s = sets.to_vec();
    s.push("rollout.backend=\"harness\"".into());
    let list: Vec<String> = command.iter().map(|c| format!("{c:?}")).collect();
    s.push(format!("rollout.harness.command=[{}]", list.join(", ")));
    s.extend(extra.iter().map(|e| e.to_string()));
    s
}

fn warm(preset: &str, sets: &[String]) -> Trainer {
    common::install_policy_host();
    let mut t = Trainer::new(TrainConfig::resolve(Some(preset), None, sets).unwrap()).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    t.freeze_reference().unwrap();
    t
}

fn assert_same_rollouts(local: &[Episode], harness: &[Episode], step: usize) {
    assert_eq!(local.len(), harness.len(), "step {step}");
    for (a, b) in local.iter().zip(harness) {
        assert_eq!(a.trajectory.id, b.trajectory.id);
        assert_eq!(a.trajectory.prompt_ids, b.trajectory.prompt_ids);
        let (fa, fb) = (a.trajectory.flatten(false), b.trajectory.flatten(false));
        assert_eq!(
            fa.ids, fb.ids,
            "step {step}, {}: the built-in rollout wrote {:?}, the program {:?}",
            a.trajectory.id, a.turn_texts, b.turn_texts
        );
        assert_eq!(fa.loss_mask, fb.loss_mask, "{}", a.trajectory.id);
        assert_eq!(fa.turn_id, fb.turn_id);
        for (x, y) in fa.logprobs.iter().zip(&fb.logprobs) {
            assert!((x - y).abs() < 1e-5, "step {step}: log-prob {x} vs {y}");
        }
        assert_eq!(
            a.trajectory.turns, b.trajectory.turns,
            "{}",
            a.trajectory.id
        );
        assert_eq!(a.trajectory.outcome_reward, b.trajectory.outcome_reward);
    }
}

#[test]
fn the_example_agent_trains_on_exactly_the_built_in_rollouts() {
    let tmp = tempfile::tempdir().unwrap();
    // A warm start long enough that the agent searches (the search path of the program runs).
    let mut sets = base_sets();
    sets.push("sft.steps=300".into());
    let agent = example_agent();
    let mut local = warm("grpo", &sets);
    let mut harness = warm(
        "grpo",
        &with_harness(&sets, &["python3", agent.to_str().unwrap()], &[]),
    );
    let weights = tmp.path().join("weights");
    let (mut turns, mut searches) = (0, 0);
    for step in 0..2 {
        assert!(harness.sync_remote(&weights).unwrap().is_some());
        let a = local.rl_step().unwrap();
        let b = harness.rl_step().unwrap();
        assert_same_rollouts(&a.episodes, &b.episodes, step);
        turns += b
            .episodes
            .iter()
            .map(|e| e.trajectory.turns.len())
            .sum::<usize>();
        searches += b
            .episodes
            .iter()
            .flat_map(|e| &e.trajectory.turns)
            .filter(|t| t.is_tool_call() && t.observation.is_some())
            .count();
        let m = &b.metrics;
        assert_eq!(m["harness/failed"], 0.0);
        assert_eq!(m["harness/segments"], m["harness/episodes"]);
        assert_eq!(m["harness/append_rate"], 1.0, "{m:?}");
        // The same update: the loss the harness trained on is the built-in one's.
        assert_eq!(a.metrics["actor/pg_loss"], m["actor/pg_loss"]);
    }
    assert!(
        turns > 12,
        "multi-turn episodes: {turns} turns in 12 episodes"
    );
    assert!(searches > 0, "the program searched: {searches} searches");
    // Evaluation runs the program too (greedy): the same episodes, the same scores. Nothing
    // synced the weights of the last update: the harness serves them itself (with the
    // server's stale weights the log-probs differed by 6e-4).
    let (a, ea) = local
        .evaluate_with_episodes(Split::Validation, 8, 0.0, 7)
        .unwrap();
    let (b, eb) = harness
        .evaluate_with_episodes(Split::Validation, 8, 0.0, 7)
        .unwrap();
    assert_eq!(a, b);
    assert!(
        a.turns > 1.0 && a.agent_tokens > 0.0,
        "multi-turn episodes: {a:?}"
    );
    // The same episodes: texts, answers, scores, token ids and log-probs (within 1e-5); the
    // server reports weight versions and no entropies.
    let (mut va, mut vb) = (
        serde_json::to_value(&ea).unwrap(),
        serde_json::to_value(&eb).unwrap(),
    );
    for (x, y) in va
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .zip(vb.as_array_mut().unwrap())
    {
        let (sa, sb) = (
            x["trajectory"]["segments"].as_array_mut().unwrap(),
            y["trajectory"]["segments"].as_array_mut().unwrap(),
        );
        assert_eq!(sa.len(), sb.len());
        for (p, q) in sa.iter_mut().zip(sb) {
            for v in [&mut *p, &mut *q] {
                let o = v.as_object_mut().unwrap();
                o.remove("entropy");
                o.remove("weight_version");
            }
            if let (Some(lp), Some(lq)) = (p.get("logprobs"), q.get("logprobs")) {
                for (a, b) in lp.as_array().unwrap().iter().zip(lq.as_array().unwrap()) {
                    let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
                    assert!((a - b).abs() < 1e-5, "evaluation log-prob {a} vs {b}");
                }
                p["logprobs"] = serde_json::Value::Null;
                q["logprobs"] = serde_json::Value::Null;
            }
        }
    }
    assert_eq!(va, vb);
}

#[test]
fn a2tgpo_probes_the_programs_turns_as_the_built_in_ones() {
    // A2TGPO's boxed format (observations in <result>); its information gain comes from the
    // trainer's own probes over the reconstructed turns.
    let tmp = tempfile::tempdir().unwrap();
    let mut sets = common::tiny_overrides();
    sets.push("rollout.max_response_tokens=400".into());
    sets.push("sft.steps=300".into());
    let agent = example_agent();
    let mut local = warm("a2tgpo", &sets);
    let mut harness = warm(
        "a2tgpo",
        &with_harness(&sets, &["python3", agent.to_str().unwrap()], &[]),
    );
    harness.sync_remote(&tmp.path().join("weights")).unwrap();
    let a = local.rl_step().unwrap();
    let b = harness.rl_step().unwrap();
    assert_same_rollouts(&a.episodes, &b.episodes, 0);
    let searched = b
        .episodes
        .iter()
        .flat_map(|e| &e.trajectory.turns)
        .any(|t| t.is_tool_call() && t.observation.is_some());
    assert!(searched, "the program searched");
    assert!(b.metrics["info_gain/probes"] > 0.0, "{:?}", b.metrics);
    assert_eq!(a.metrics["info_gain/probes"], b.metrics["info_gain/probes"]);
    assert_eq!(a.metrics["actor/pg_loss"], b.metrics["actor/pg_loss"]);
}

#[test]
fn failing_programs_fail_their_episodes_and_the_step_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let agent = example_agent();
    // Member 0 of each group crashes, member 1 hangs, member 2 plays the example.
    let script = format!(
        "case \"$TURNWISE_EPISODE_ID\" in \
           *-0) echo 'agent: no such tool' >&2; exit 3;; \
           *-1) sleep 600;; \
           *) exec python3 {} ;; esac",
        agent.display()
    );
    let sets = with_harness(
        &base_sets(),
        &["sh", "-c", &script],
        &[
            "rollout.harness.timeout_secs=20",
            "rollout.harness.max_failed_share=0.7",
        ],
    );
    let mut t = warm("grpo", &sets);
    t.sync_remote(&tmp.path().join("weights")).unwrap();
    let t0 = Instant::now();
    let out = t.rl_step().unwrap();
    assert!(
        t0.elapsed().as_secs() < 120,
        "the hung programs were killed at their timeout: {:?}",
        t0.elapsed()
    );
    let m = &out.metrics;
    assert_eq!(m["harness/episodes"], 6.0);
    assert_eq!(m["harness/failed/crash"], 2.0, "{m:?}");
    assert_eq!(m["harness/failed/timeout"], 2.0, "{m:?}");
    assert_eq!(
        out.episodes.len(),
        2,
        "the working programs' episodes trained"
    );

    // Programs that never call the model, then a step where every program fails: the error
    // names the command, the kind and the program's own words.
    let sets = with_harness(&base_sets(), &["sh", "-c", "exit 0"], &[]);
    let mut t = warm("grpo", &sets);
    t.sync_remote(&tmp.path().join("weights2")).unwrap();
    let e = format!("{:#}", t.rl_step().err().unwrap());
    assert!(e.contains("6 of 6 harness episodes failed"), "{e}");
    assert!(e.contains("no_calls"), "{e}");
    assert!(e.contains("X-Session-Id"), "{e}");
    let sets = with_harness(
        &base_sets(),
        &["sh", "-c", "echo 'agent: no such tool' >&2; exit 3"],
        &[],
    );
    let mut t = warm("grpo", &sets);
    t.sync_remote(&tmp.path().join("weights3")).unwrap();
    let e = format!("{:#}", t.rl_step().err().unwrap());
    assert!(e.contains("exited with status 3"), "{e}");
    assert!(e.contains("agent: no such tool"), "{e}");
}

#[test]
fn a_re_rendered_history_trains_as_separate_samples() {
    let tmp = tempfile::tempdir().unwrap();
    // Two completions per episode; the second request re-renders the history (the first
    // turn's text replaced by a summary), so it cannot extend the first.
    let script = r#"
import json, os, urllib.request
env = os.environ
def complete(prompt):
    body = json.dumps({"prompt": prompt, "max_tokens": 6, "temperature": 1.0,
                       "skip_special_tokens": False, "include_stop_str_in_output": True}).encode()
    req = urllib.request.Request(env["OPENAI_BASE_URL"] + "/completions", body,
        {"Content-Type": "application/json", "X-Session-Id": env["TURNWISE_SESSION_ID"]})
    return json.load(urllib.request.urlopen(req))["choices"][0]["text"]
first = complete(env["TURNWISE_PROMPT"])
complete(env["TURNWISE_PROMPT"] + "(summary of my first turn)")
if env["TURNWISE_EPISODE_ID"].endswith("-0"):
    # The reward over HTTP, to the server the program talks to.
    req = urllib.request.Request(
        env["TURNWISE_BASE_URL"] + "/v1/sessions/" + env["TURNWISE_SESSION_ID"] + "/reward",
        json.dumps({"reward": 0.75}).encode(), {"Content-Type": "application/json"})
    urllib.request.urlopen(req).read()
else:
    print(json.dumps({"reward": 0.25}))
"#;
    let sets = with_harness(
        &base_sets(),
        &["python3", "-c", script],
        &["rollout.harness.reward=\"program\""],
    );
    let mut t = warm("grpo", &sets);
    t.sync_remote(&tmp.path().join("weights")).unwrap();
    let out = t.rl_step().unwrap();
    let m = &out.metrics;
    assert_eq!(m["harness/segments"], 12.0, "{m:?}");
    assert_eq!(m["harness/append_rate"], 0.0);
    assert_eq!(out.episodes.len(), 12);
    for e in &out.episodes {
        assert_eq!(e.trajectory.turns.len(), 1);
        // Both trajectories of a program carry its reward, posted or printed.
        let posted = e.trajectory.id.ends_with("-0") || e.trajectory.id.ends_with("-0-seg1");
        let want = if posted { 0.75 } else { 0.25 };
        assert_eq!(
            e.trajectory.outcome_reward,
            Some(want),
            "{}",
            e.trajectory.id
        );
    }
}

#[test]
fn every_preset_that_needs_only_outcomes_and_turns_trains_through_the_harness() {
    let tmp = tempfile::tempdir().unwrap();
    let agent = example_agent();
    let sets = with_harness(&base_sets(), &["python3", agent.to_str().unwrap()], &[]);
    for preset in [
        "dr-grpo", "rloo", "dapo", "gspo", "ppo", "mt-grpo", "mt-ppo", "igpo", "s-grpo", "s-ppo",
        "st-ppo", "turn-ppo",
    ] {
        let mut t = warm(preset, &sets);
        t.sync_remote(&tmp.path().join(preset)).unwrap();
        let out = t.rl_step().unwrap_or_else(|e| panic!("{preset}: {e:#}"));
        let m = &out.metrics;
        assert_eq!(m["harness/failed"], 0.0, "{preset}");
        assert!(m["harness/requests"] >= 6.0, "{preset}: {m:?}");
        if m["batch/train_rows"] == 0.0 {
            // DAPO's dynamic sampling found no informative group in its refill rounds (which
            // ran the program again) and skipped the update.
            assert!(m["batch/refill_rounds"] >= 1.0, "{preset}: {m:?}");
            continue;
        }
        let loss = m.get("actor/pg_loss").or(m.get("actor/loss"));
        assert!(loss.is_some_and(|l| l.is_finite()), "{preset}: {m:?}");
    }
    // The presets whose method needs control of generation are refused, naming the setting.
    // (The tree presets with the tiny world's group size fitted to their tree shape.)
    for (preset, group, field) in [
        ("gigpo", 3, "rollout.memory_window"),
        ("t2po", 3, "rollout."),
        ("at2po", 8, "rollout.strategy"),
        ("tree-grpo", 6, "rollout.strategy"),
    ] {
        let mut s = sets.clone();
        s.push(format!("rollout.group_size={group}"));
        let e = format!(
            "{:#}",
            TrainConfig::resolve(Some(preset), None, &s).unwrap_err()
        );
        assert!(e.contains(field) && e.contains("harness"), "{preset}: {e}");
    }
}

#[test]
fn what_needs_control_of_generation_is_refused_by_name() {
    let sets = with_harness(&base_sets(), &["python3", "agent.py"], &[]);
    for (preset, extra, field) in [
        (
            "tree-grpo",
            vec!["rollout.group_size=6"],
            "rollout.strategy",
        ),
        (
            "grpo",
            vec!["rollout.tti.enabled=true"],
            "rollout.tti.enabled",
        ),
        (
            "grpo",
            vec!["rollout.tds.enabled=true"],
            "rollout.tds.enabled",
        ),
        (
            "grpo",
            vec!["rollout.memory_window=2"],
            "rollout.memory_window",
        ),
        (
            "grpo",
            vec!["rollout.harness.command=[]"],
            "rollout.harness.command",
        ),
    ] {
        let mut s = sets.clone();
        s.extend(extra.iter().map(|e| e.to_string()));
        let e = format!(
            "{:#}",
            TrainConfig::resolve(Some(preset), None, &s).unwrap_err()
        );
        assert!(e.contains(field), "{preset}: {e}");
    }
}

/// A Python agent that offers a `search` tool over the chat route (the `openai` client) and
/// calls it while the model asks for it; with `FORCE` set it constrains the reply to a
/// well-formed Hermes call (`guided_choice`), as a model that learned the format would write.
const TOOL_AGENT: &str = r#"
import json, os
from openai import OpenAI
env = os.environ
client = OpenAI(base_url=env["OPENAI_BASE_URL"], api_key=env["OPENAI_API_KEY"], max_retries=0,
                default_headers={"X-Session-Id": env["TURNWISE_SESSION_ID"]})
tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
call = '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'
messages = [{"role": "user", "content": env["TURNWISE_QUESTION"][:40]}]
for turn in range(int(env.get("TURNS", "2"))):
    extra = {"guided_choice": [call]} if env.get("FORCE") else {}
    m = client.chat.completions.create(model=env["TURNWISE_MODEL"], messages=messages,
        tools=tools, max_tokens=80, temperature=1.0, extra_body=extra).choices[0].message
    if not m.tool_calls:
        break
    messages.append(m.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "ok"})
"#;

#[test]
fn the_parse_rate_floor_stops_a_run_whose_parser_extracts_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    // The tiny GGUF fixture (a chat model) with a chat template that renders tools.
    let fixture = common::tiny_gguf();
    let mut sets = common::tiny_overrides();
    sets.push(format!("model.init_from=\"{}\"", fixture.display()));
    sets.push("sft.steps=0".into());
    sets.push("task.prompt.text=\"{{ question }}\"".into());
    sets.push("rollout.max_response_tokens=120".into());
    let hf = tmp.path().join("hf");
    Trainer::new(TrainConfig::resolve(Some("grpo"), None, &sets).unwrap())
        .unwrap()
        .export(&hf)
        .unwrap();
    let tc_path = hf.join("tokenizer_config.json");
    let mut tc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tc_path).unwrap()).unwrap();
    tc["chat_template"] = common::TOOLS_TEMPLATE.into();
    std::fs::write(&tc_path, tc.to_string()).unwrap();
    sets.retain(|s| !s.starts_with("model.init_from"));
    sets.push(format!("model.init_from=\"{}\"", hf.display()));
    let floor = ["rollout.harness.min_tool_parse_rate=0.5"];

    // The model never writes a call the parser can read: the run stops, naming the format.
    let mut t = warm(
        "grpo",
        &with_harness(&sets, &["python3", "-c", TOOL_AGENT], &floor),
    );
    t.sync_remote(&tmp.path().join("w1")).unwrap();
    let e = format!("{:#}", t.rl_step().err().unwrap());
    assert!(e.contains("hermes"), "{e}");
    assert!(e.contains("min_tool_parse_rate = 0.5"), "{e}");

    // The same agent with calls the parser reads: the step trains, and the rate is logged
    // per turn.
    // (One turn: a second prompt with the call and its answer would not fit the fixture's 256
    // positions.)
    let script =
        format!("import os; os.environ['FORCE'] = '1'; os.environ['TURNS'] = '1'\n{TOOL_AGENT}");
    let mut t = warm(
        "grpo",
        &with_harness(&sets, &["python3", "-c", &script], &floor),
    );
    t.sync_remote(&tmp.path().join("w2")).unwrap();
    let out = t.rl_step().unwrap();
    let m = &out.metrics;
    assert_eq!(m["harness/tool_calls/parse_rate"], 1.0, "{m:?}");
    assert_eq!(m["harness/tool_calls/parse_rate/turn_0"], 1.0);
    assert_eq!(m["harness/failed"], 0.0);
}
