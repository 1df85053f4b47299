//! Rejection-sampling fine-tuning inside a whole run: the `t2po` preset's RFT stage runs after
//! the warm start and writes its metrics.

mod common;

use turnwise::config::TrainConfig;
use turnwise::pipeline::{RunOptions, run};

#[test]
fn a_t2po_run_fine_tunes_on_its_kept_rollouts_and_logs_it() {
    let tmp = tempfile::tempdir().unwrap();
    let mut sets = common::tiny_overrides();
    sets.extend(
        [
            "run.steps=1",
            "eval.questions=2",
            "rsft.questions=4",
            "rsft.rollouts_per_question=2",
            "rsft.batch_size=3",
            // The t2po reward (EM minus 0.1 per invalid step, read on the last step) lies in
            // [-0.1, 1]: every rollout is kept, so the fine-tuning runs.
            "rsft.threshold=-1.0",
        ]
        .map(String::from),
    );
    let cfg = TrainConfig::resolve(Some("t2po"), None, &sets).unwrap();
    assert!(cfg.rsft.enabled);
    assert_eq!(cfg.rsft.epochs, 2);
    let dir = tmp.path().join("run");
    run(
        cfg,
        &RunOptions {
            dir: dir.clone(),
            quiet: true,
        },
        false,
    )
    .unwrap();
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let rsft: Vec<&serde_json::Value> = lines.iter().filter(|v| v["phase"] == "rsft").collect();
    // 8 rollouts in batches of 3: 3 steps per epoch, 2 epochs, then the summary line.
    let steps: Vec<&&serde_json::Value> = rsft
        .iter()
        .filter(|v| v.get("rsft/loss").is_some())
        .collect();
    assert_eq!(steps.len(), 6, "{rsft:?}");
    assert!(steps.iter().all(|v| v["rsft/loss"].as_f64().unwrap() > 0.0));
    let summary = rsft
        .iter()
        .find(|v| v.get("rsft/kept_fraction").is_some())
        .expect("an rsft summary line");
    assert_eq!(summary["rsft/sampled"], 8.0);
    assert_eq!(summary["rsft/kept_fraction"], 1.0);
    assert_eq!(summary["rsft/steps"], 6.0);
    // The RFT comes before the evaluation of the warm-started model and the RL step.
    let first_rl = lines.iter().position(|v| v["phase"] == "train").unwrap();
    let last_rsft = lines.iter().rposition(|v| v["phase"] == "rsft").unwrap();
    assert!(last_rsft < first_rl);
}
