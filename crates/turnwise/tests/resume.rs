//! A killed-and-resumed run matches an uninterrupted one bit for bit.

mod common;

use std::path::Path;

use turnwise::config::TrainConfig;
use turnwise::pipeline::{RunOptions, resume, run};

#[test]
fn a_killed_and_resumed_run_matches_an_uninterrupted_one() {
    let tmp = tempfile::tempdir().unwrap();
    let mut sets = common::tiny_overrides();
    sets.extend(
        [
            "run.steps=4",
            "run.save_every=2",
            "run.keep_checkpoints=3",
            "eval.questions=3",
        ]
        .map(String::from),
    );
    let cfg = TrainConfig::resolve(Some("grpo"), None, &sets).unwrap();
    let a = tmp.path().join("a");
    run(
        cfg,
        &RunOptions {
            dir: a.clone(),
            quiet: true,
        },
        false,
    )
    .unwrap();
    assert!(a.join("checkpoints/step-00004/COMPLETE").is_file());
    assert!(a.join("report.md").is_file());

    // "Kill" after step 2: the step-4 checkpoint never completed and later metrics lines and
    // samples exist past the last checkpoint.
    let b = tmp.path().join("b");
    common::copy_dir(&a, &b);
    std::fs::remove_file(b.join("checkpoints/step-00004/COMPLETE")).unwrap();
    resume(&b, true).unwrap();

    let wa = std::fs::read(a.join("checkpoints/step-00004/model.safetensors")).unwrap();
    let wb = std::fs::read(b.join("checkpoints/step-00004/model.safetensors")).unwrap();
    assert!(
        wa == wb,
        "resumed weights differ from the uninterrupted run"
    );
    let oa = std::fs::read(a.join("checkpoints/step-00004/optimizer.safetensors")).unwrap();
    let ob = std::fs::read(b.join("checkpoints/step-00004/optimizer.safetensors")).unwrap();
    assert!(oa == ob, "resumed optimizer state differs");
    let (la, lb) = (
        common::phase_lines(&a.join("metrics.jsonl"), "train"),
        common::phase_lines(&b.join("metrics.jsonl"), "train"),
    );
    assert_eq!(la.len(), 4);
    assert_eq!(la, lb, "metrics of the resumed run differ");
}

#[test]
fn a_killed_and_resumed_ppo_run_matches_an_uninterrupted_one_critic_included() {
    let tmp = tempfile::tempdir().unwrap();
    // The critic trains from the first step (warm-up 1: the actor waits one step, so the
    // resumed steps cross the warm-up boundary's state too).
    let (a, b) = common::run_and_resume("ppo", &["critic.warmup_updates=1"], tmp.path());
    let ck = |run: &Path, step: &str, file: &str| {
        std::fs::read(run.join("checkpoints").join(step).join(file))
            .unwrap_or_else(|e| panic!("{}/{step}/{file}: {e}", run.display()))
    };
    for file in [
        "model.safetensors",
        "optimizer.safetensors",
        "critic.safetensors",
        "critic_optimizer.safetensors",
        "trainer_state.json",
    ] {
        assert!(
            ck(&a, "step-00004", file) == ck(&b, "step-00004", file),
            "{file} of the resumed run differs from the uninterrupted run"
        );
    }
    // The critic did train between the two checkpoints, so the comparison above means something.
    assert!(
        ck(&a, "step-00002", "critic.safetensors") != ck(&a, "step-00004", "critic.safetensors"),
        "the critic did not change between steps 2 and 4"
    );
    let state: serde_json::Value =
        serde_json::from_slice(&ck(&a, "step-00004", "trainer_state.json")).unwrap();
    // 4 steps × 2 critic mini-batches (the preset's structure at the tiny batch of 6 rows).
    assert_eq!(state["extra"]["critic_optimizer_steps"].as_u64(), Some(8));
    let (la, lb) = (
        common::phase_lines(&a.join("metrics.jsonl"), "train"),
        common::phase_lines(&b.join("metrics.jsonl"), "train"),
    );
    assert_eq!(la.len(), 4);
    assert!(
        la.iter().all(|l| l.get("critic/vf_loss").is_some()),
        "{la:?}"
    );
    assert_eq!(la, lb, "metrics of the resumed run differ");
}
