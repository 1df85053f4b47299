//! A new estimator needs only its file and one registration line (issue 53): the fixture's
//! estimator, registered here, is named in a config, validated, trained with and written to
//! the run's samples, metrics and config like a built-in one.

mod common;
#[path = "fixtures/estimators/fixed_baseline.rs"]
mod fixed_baseline;

use turnwise::config::TrainConfig;
use turnwise::pipeline::{RunOptions, run};
use turnwise::run::RunDir;

#[test]
fn an_estimator_of_a_test_fixture_trains_after_one_registration_line() {
    turnwise_core::advantage::register::<fixed_baseline::FixedBaseline>("outcome − baseline")
        .unwrap();

    let mut sets = common::tiny_overrides();
    sets.extend(
        [
            "run.steps=1",
            "run.samples_per_step=6",
            "eval.questions=2",
            "advantage.estimator=\"fixed_baseline\"",
            "advantage.baseline=0.25",
        ]
        .map(String::from),
    );
    let cfg = TrainConfig::resolve(Some("grpo"), None, &sets).unwrap();
    let bad: Vec<String> = sets
        .iter()
        .map(|s| s.replace("advantage.baseline=0.25", "advantage.baselin=0.25"))
        .collect();
    let err = TrainConfig::resolve(Some("grpo"), None, &bad)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("fixed_baseline") && err.contains("baselin"),
        "{err}"
    );

    let tmp = tempfile::tempdir().unwrap();
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
    let rd = RunDir::open(&dir).unwrap();
    let recs = rd.read_samples(1).unwrap().unwrap();
    assert_eq!(recs.len(), 6);
    for r in &recs {
        let want = r.score.expect("score") - 0.25;
        let adv = r.advantages.as_ref().expect("advantages");
        assert!(!adv.is_empty(), "{}", r.trajectory.id);
        for a in adv {
            assert!(
                (a - want).abs() < 1e-6,
                "{}: {a} vs {want}",
                r.trajectory.id
            );
        }
    }
    let metrics = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    assert!(
        metrics.contains("\"fixed_baseline/above_share\""),
        "{metrics}"
    );
    let config = std::fs::read_to_string(dir.join("config.toml")).unwrap();
    assert!(
        config.contains("estimator = \"fixed_baseline\"") && config.contains("baseline = 0.25"),
        "{config}"
    );
}
