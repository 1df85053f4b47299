//! `rollout.backend = "remote"` against `turnwise serve` on loopback: the same trajectories
//! as the local backend (token ids and log-probs), log-probs equal to the trainer's own
//! recomputation, servers that follow the trainer's weights after each sync, retries of a
//! server's 503s, and a clear error naming a server that died, with nothing written lost.

mod common;

use std::path::Path;

use turnwise::config::TrainConfig;
use turnwise::pipeline::{RunOptions, resume, run};
use turnwise::rollout::Episode;
use turnwise::serve::{PolicyServer, ServeConfig, load_served};
use turnwise::trainer::Trainer;
use turnwise::update::batch::Row;
use turnwise::update::logprobs_no_grad;

fn serve(folder: &Path, max_queue: usize) -> PolicyServer {
    let config = ServeConfig {
        addr: "127.0.0.1:0".parse().unwrap(),
        max_queue,
        ..Default::default()
    };
    PolicyServer::start(load_served(folder).unwrap(), &config).unwrap()
}

fn remote_sets(sets: &[String], urls: &[String]) -> Vec<String> {
    let mut s = sets.to_vec();
    s.push("rollout.backend=\"remote\"".into());
    let list: Vec<String> = urls.iter().map(|u| format!("\"{u}\"")).collect();
    s.push(format!("rollout.remote.urls=[{}]", list.join(", ")));
    s
}

fn warm(sets: &[String]) -> Trainer {
    warm_preset("grpo", sets)
}

fn warm_preset(preset: &str, sets: &[String]) -> Trainer {
    let mut t = Trainer::new(TrainConfig::resolve(Some(preset), None, sets).unwrap()).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    t.freeze_reference().unwrap();
    t
}

/// Asserts that two rollouts hold the same tokens and log-probs (1e-5), turn by turn.
fn assert_same_rollouts(local: &[Episode], remote: &[Episode], step: u64) {
    assert_eq!(local.len(), remote.len());
    for (a, b) in local.iter().zip(remote) {
        let (fa, fb) = (a.trajectory.flatten(false), b.trajectory.flatten(false));
        assert_eq!(fa.ids, fb.ids, "step {step}, {}", a.trajectory.id);
        assert_eq!(fa.turn_id, fb.turn_id);
        for (x, y) in fa.logprobs.iter().zip(&fb.logprobs) {
            assert!((x - y).abs() < 1e-5, "step {step}: log-prob {x} vs {y}");
        }
    }
}

#[test]
fn remote_rollouts_match_the_local_backend_and_follow_weight_syncs() {
    let tmp = tempfile::tempdir().unwrap();
    // MT-GRPO's turn rewards differ between rollouts of the barely trained model and the
    // learning rate is high, so every update moves the weights (a server that kept old
    // weights would be caught).
    let mut sets = common::tiny_overrides();
    sets.push("optim.lr=0.1".into());
    sets.push("optim.warmup_steps=0".into());
    let mut local = warm_preset("mt-grpo", &sets);
    let w0 = tmp.path().join("w0");
    local.export(&w0).unwrap();
    // Two servers: turns are spread over both, and both must follow the syncs.
    let servers = [serve(&w0, 1024), serve(&w0, 1024)];
    let urls: Vec<String> = servers.iter().map(PolicyServer::url).collect();
    let mut remote = warm_preset("mt-grpo", &remote_sets(&sets, &urls));
    let weights = tmp.path().join("weights");
    assert!(remote.sync_remote(&weights).unwrap().is_some());
    assert!(
        remote.sync_remote(&weights).unwrap().is_none(),
        "already synced"
    );
    for step in 0..2u64 {
        // The same seeds: the servers draw what the local engine draws (sampled, T = 1).
        let a = local.rl_step().unwrap();
        let b = remote.rl_step().unwrap();
        assert_same_rollouts(&a.episodes, &b.episodes, step);
        // Every turn records the weights it was generated with: the trainer's, not stale.
        for e in &b.episodes {
            for seg in e.trajectory.agent_segments() {
                assert_eq!(seg.weight_version, Some(step));
                assert!(seg.entropy.is_none(), "servers report no entropies");
            }
        }
        assert_eq!(b.metrics["rollout/weight_staleness/max"], 0.0);
        // The recorded log-probs are the trainer's own recomputation on the weights they
        // came from (before this step's update: the local trainer's reference copy is gone,
        // so recompute on a fresh load of the synced folder).
        let folder = weights.join(format!("step-{step:05}"));
        let m = turnwise::model_source::load_init_tensors(&folder)
            .unwrap()
            .1;
        let model = turnwise_model::model::Transformer::from_tensors(&m.config, &m.tensors, "sync")
            .unwrap();
        let rows: Vec<Row> = b
            .episodes
            .iter()
            .map(|e| Row::from_trajectory(&e.trajectory, false))
            .collect();
        let re = logprobs_no_grad(&model, &rows, 1.0, 64).unwrap();
        for (e, r) in b.episodes.iter().zip(&re) {
            let f = e.trajectory.flatten(false);
            for (k, (x, y)) in f.logprobs.iter().zip(r).enumerate() {
                if f.turn_id[k] >= 0 {
                    assert!(
                        (x - y).abs() < 1e-5,
                        "token {k}: served {x}, recomputed {y}"
                    );
                }
            }
        }
        // The weights moved since the step before: stale servers would have been caught.
        if step > 0 {
            let before = weights.join(format!("step-{:05}", step - 1));
            let m = turnwise::model_source::load_init_tensors(&before)
                .unwrap()
                .1;
            let old =
                turnwise_model::model::Transformer::from_tensors(&m.config, &m.tensors, "old")
                    .unwrap();
            let stale = logprobs_no_grad(&old, &rows, 1.0, 64).unwrap();
            let moved = stale
                .iter()
                .flatten()
                .zip(re.iter().flatten())
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                moved > 1e-4,
                "the update moved log-probs by {moved} only (10 × the tolerance)"
            );
        }
        // After the update the servers load the new weights (version step + 1).
        assert!(remote.sync_remote(&weights).unwrap().is_some());
    }
    let marked: Vec<_> = std::fs::read_dir(&weights)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("STABLE").is_file())
        .collect();
    assert_eq!(marked.len(), 2, "the last two weights folders are kept");
}

#[test]
fn a_busy_server_is_retried_and_a_dead_one_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let sets = common::tiny_overrides();
    let t = warm(&sets);
    let w0 = tmp.path().join("w0");
    t.export(&w0).unwrap();

    // A queue of 2 sequences against 6 concurrent turns: 503s, retried until served.
    let busy = serve(&w0, 2);
    let mut s = remote_sets(&sets, &[busy.url()]);
    s.push("rollout.remote.max_attempts=50".into());
    s.push("rollout.remote.sync_weights=false".into());
    let mut r = warm(&s);
    let out = r.rl_step().unwrap();
    assert_eq!(out.episodes.len(), 6);
    drop(busy);

    // A whole run through the pipeline, then its server dies: resuming names the server and
    // leaves every file of the run as it was.
    let server = serve(&w0, 1024);
    let url = server.url();
    let mut s = remote_sets(&sets, std::slice::from_ref(&url));
    s.push("rollout.remote.max_attempts=2".into());
    let cfg = TrainConfig::resolve(Some("grpo"), None, &s).unwrap();
    let dir = tmp.path().join("run");
    let opts = RunOptions {
        dir: dir.clone(),
        quiet: true,
    };
    run(cfg, &opts, false).unwrap();
    let metrics = std::fs::read(dir.join("metrics.jsonl")).unwrap();
    assert!(
        String::from_utf8_lossy(&metrics).contains("timing_s/weight_sync"),
        "weight syncs are timed"
    );
    assert!(dir.join("weights/step-00002/STABLE").is_file());
    drop(server);
    // Raise the step budget and resume: the server is gone.
    let config_path = dir.join("config.toml");
    let text = std::fs::read_to_string(&config_path).unwrap();
    std::fs::write(&config_path, text.replace("steps = 2", "steps = 3")).unwrap();
    let e = format!("{:#}", resume(&dir, true).unwrap_err());
    assert!(e.contains(&url), "{e}");
    assert_eq!(std::fs::read(dir.join("metrics.jsonl")).unwrap(), metrics);
    let ck = turnwise::run::RunDir::open(&dir)
        .unwrap()
        .checkpoint_path(2);
    assert!(ck.join("model.safetensors").is_file(), "{}", ck.display());

    // Mid-step: a trainer whose server dies between steps fails the next step with the
    // server's name and the attempts made.
    let server = serve(&w0, 1024);
    let url = server.url();
    let mut s = remote_sets(&sets, std::slice::from_ref(&url));
    s.push("rollout.remote.max_attempts=2".into());
    s.push("rollout.remote.sync_weights=false".into());
    let mut r = warm(&s);
    r.rl_step().unwrap();
    drop(server);
    let e = format!("{:#}", r.rl_step().err().unwrap());
    assert!(e.contains(&url), "{e}");
    assert!(e.contains("attempt 2 of 2"), "{e}");
}

#[test]
fn remote_settings_are_checked_by_name() {
    let sets = common::tiny_overrides();
    let cases = [
        ("rollout.remote.urls=[]", "rollout.remote.urls"),
        (
            "rollout.remote.urls=[\"localhost:1\"]",
            "rollout.remote.urls",
        ),
        (
            "rollout.strategy=\"tree\"\nrollout.group_size=8",
            "rollout.strategy",
        ),
        ("rollout.tti.enabled=true", "rollout.tti.enabled"),
        (
            "rollout.remote.protocol=\"vllm\"",
            "rollout.remote.sync_weights",
        ),
        (
            "rollout.remote.timeout_secs=0",
            "rollout.remote.timeout_secs",
        ),
    ];
    for (set, field) in cases {
        let mut s = sets.clone();
        s.push("rollout.backend=\"remote\"".into());
        if !set.starts_with("rollout.remote.urls") {
            s.push("rollout.remote.urls=[\"http://127.0.0.1:1\"]".into());
        }
        s.extend(set.lines().map(String::from));
        let e = TrainConfig::resolve(Some("grpo"), None, &s)
            .unwrap_err()
            .to_string();
        assert!(e.contains(field), "{set}: {e}");
    }
    // A server that is not there is named before anything runs.
    let mut s = sets.clone();
    s.push("rollout.backend=\"remote\"".into());
    s.push("rollout.remote.urls=[\"http://127.0.0.1:1\"]".into());
    let cfg = TrainConfig::resolve(Some("grpo"), None, &s).unwrap();
    let e = format!("{:#}", Trainer::new(cfg).err().unwrap());
    assert!(e.contains("http://127.0.0.1:1"), "{e}");
}

#[test]
fn vllm_servers_follow_the_policy_through_lora_adapters() {
    // vLLM cannot reload full weights over HTTP: a LoRA policy's servers load each step's
    // adapter (`/v1/load_lora_adapter`, which turnwise serve answers as vLLM does, merging it
    // into the base it started with) and the turns name it as their model.
    let tmp = tempfile::tempdir().unwrap();
    let mut sets = common::tiny_overrides();
    sets.extend(
        [
            // No warm start: the adapters start at B = 0, so the export is the frozen base.
            "sft.steps=0",
            "model.lora.rank=4",
            "model.lora.target_modules=[\"q_proj\", \"v_proj\", \"down_proj\"]",
            "optim.lr=0.1",
            "optim.warmup_steps=0",
        ]
        .map(String::from),
    );
    let mut local = warm_preset("mt-grpo", &sets);
    let base = tmp.path().join("base");
    local.export(&base).unwrap();
    let server = serve(&base, 1024);
    let mut rs = remote_sets(&sets, &[server.url()]);
    rs.push("rollout.remote.protocol=\"vllm\"".into());
    let mut remote = warm_preset("mt-grpo", &rs);
    let weights = tmp.path().join("weights");
    remote.sync_remote(&weights).unwrap();
    for step in 0..2u64 {
        let a = local.rl_step().unwrap();
        let b = remote.rl_step().unwrap();
        assert_same_rollouts(&a.episodes, &b.episodes, step);
        for e in &b.episodes {
            for seg in e.trajectory.agent_segments() {
                assert_eq!(seg.weight_version, Some(step));
            }
        }
        remote.sync_remote(&weights).unwrap();
    }
    let info: serde_json::Value =
        reqwest::blocking::get(format!("{}/get_server_info", server.url()))
            .unwrap()
            .json()
            .unwrap();
    assert_eq!(info["engine"]["reloads"], 3, "{info}");
    // Without LoRA a vLLM run cannot follow the policy: refused by name.
    let mut s = common::tiny_overrides();
    s.push("rollout.backend=\"remote\"".into());
    s.push("rollout.remote.urls=[\"http://127.0.0.1:1\"]".into());
    s.push("rollout.remote.protocol=\"vllm\"".into());
    let e = TrainConfig::resolve(Some("grpo"), None, &s)
        .unwrap_err()
        .to_string();
    assert!(e.contains("model.lora.rank"), "{e}");
}
