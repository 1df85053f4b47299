//! A killed-and-resumed run matches an uninterrupted one bit for bit.

mod common;

use std::path::Path;

use turnwise::config::TrainConfig;
use turnwise::pipeline::{RunOptions, resume, run};

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}

fn train_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["phase"] == "train")
        .map(|mut v| {
            let o = v.as_object_mut().unwrap();
            o.retain(|k, _| !k.starts_with("timing_s/") && k != "time");
            v
        })
        .collect()
}

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
    copy_dir(&a, &b);
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
        train_lines(&a.join("metrics.jsonl")),
        train_lines(&b.join("metrics.jsonl")),
    );
    assert_eq!(la.len(), 4);
    assert_eq!(la, lb, "metrics of the resumed run differ");
}
