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

/// The file `rel` of the run `run`.
fn read(run: &Path, rel: &str) -> Vec<u8> {
    std::fs::read(run.join(rel)).unwrap_or_else(|e| panic!("{}/{rel}: {e}", run.display()))
}

/// The complete warm-start checkpoints of `run`, by step.
fn warm_start_steps(run: &Path) -> Vec<u64> {
    let mut steps: Vec<u64> = std::fs::read_dir(run.join("checkpoints"))
        .map(|d| {
            d.filter_map(|e| {
                let e = e.unwrap();
                let name = e.file_name().to_string_lossy().into_owned();
                let step = name.strip_prefix("warm-start-step-")?.parse().ok()?;
                e.path().join("COMPLETE").is_file().then_some(step)
            })
            .collect()
        })
        .unwrap_or_default();
    steps.sort();
    steps
}

/// `run` ended the same, bit for bit, as the uninterrupted run `a`: the warm-started model, the
/// checkpoints of steps 0 and 1, and every metrics line but the timings.
fn assert_same_run(a: &Path, run: &Path) {
    for rel in [
        "warm-start-model/model.safetensors",
        "checkpoints/step-00000/model.safetensors",
        "checkpoints/step-00000/optimizer.safetensors",
        "checkpoints/step-00001/model.safetensors",
        "checkpoints/step-00001/optimizer.safetensors",
    ] {
        assert!(
            read(a, rel) == read(run, rel),
            "{rel} of {} differs from the uninterrupted run's",
            run.display()
        );
    }
    for phase in ["sft", "eval", "train", "gain"] {
        let (la, lr) = (
            common::phase_lines(&a.join("metrics.jsonl"), phase),
            common::phase_lines(&run.join("metrics.jsonl"), phase),
        );
        assert!(!la.is_empty(), "{phase}");
        assert_eq!(la, lr, "the {phase} lines of {} differ", run.display());
    }
    assert_eq!(
        common::phase_lines(&run.join("metrics.jsonl"), "timing").len(),
        1
    );
    // The warm-start checkpoints are gone once the RL checkpoint of step 0 holds the model.
    assert_eq!(warm_start_steps(run), Vec::<u64>::new());
}

/// A run killed (SIGKILL) in its warm start resumes it from its newest warm-start checkpoint,
/// and one killed before its first warm-start checkpoint restarts the warm start in place,
/// without the alarming "overwriting the previous run": both end exactly as a run that was never
/// interrupted.
#[test]
fn a_run_killed_in_its_warm_start_resumes_it_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let mut sets = common::tiny_overrides();
    sets.extend(
        [
            // A metrics line every 2 steps and a checkpoint every 3: the checkpoints of odd steps
            // hold a loss not yet logged.
            "sft.steps=100",
            "sft.save_every=3",
            "run.steps=1",
            "eval.questions=3",
        ]
        .map(String::from),
    );
    let train = |out: &str| {
        let mut args: Vec<String> = ["train", "--preset", "grpo", "--out", out]
            .map(String::from)
            .to_vec();
        for s in &sets {
            args.extend(["--set".to_string(), s.clone()]);
        }
        args
    };
    let a = tmp.path().join("a");
    let out = common::turnwise_in(&train("a"), tmp.path());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The same run, killed as soon as its first warm-start checkpoint is complete.
    let b = tmp.path().join("b");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_turnwise"))
        .args(train("b"))
        .current_dir(tmp.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while warm_start_steps(&b).is_empty() {
        assert!(
            t0.elapsed().as_secs() < 120,
            "no warm-start checkpoint after 120 s"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before its first warm-start checkpoint"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let n = *warm_start_steps(&b).last().unwrap();
    assert!(
        n < 100 && !b.join("checkpoints/step-00000/COMPLETE").exists(),
        "the kill came after the warm start (checkpoint {n}); the test needs it inside"
    );
    // The same kill before any warm-start checkpoint: none left.
    let c = tmp.path().join("c");
    common::copy_dir(&b, &c);
    for step in warm_start_steps(&c) {
        std::fs::remove_dir_all(c.join(format!("checkpoints/warm-start-step-{step:05}"))).unwrap();
    }

    let out = common::turnwise_in(&["resume".into(), "b".into()], tmp.path());
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains(&format!("resuming the warm start at step {n}/100")),
        "{stdout}"
    );
    assert!(!stderr.contains("overwriting"), "{stderr}");
    assert_same_run(&a, &b);

    let out = common::turnwise_in(&["resume".into(), "c".into()], tmp.path());
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("restarting the warm start from step 1/100"),
        "{stdout}"
    );
    assert!(!stderr.contains("overwriting"), "{stderr}");
    assert_same_run(&a, &c);
}
