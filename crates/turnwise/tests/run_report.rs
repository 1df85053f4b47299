//! The run directory's tools checked against the app crate's own names and configs: the tests of
//! `turnwise-report` (`run::dir`, `run::report`) that need the pipeline's constants or a resolved
//! preset, which that crate cannot see.

use std::path::Path;

use turnwise::config::TrainConfig;
use turnwise::run::{MetricsLog, MetricsRecord, ReportInput, render_report};
use turnwise_report::run::RUN_ENTRIES;

/// The run's top-level names that the pipeline writes are among those `--overwrite` checks
/// (moved from turnwise-report's `run::dir` tests: it reads the app crate's constants).
#[test]
fn run_entries_name_what_the_pipeline_writes() {
    for name in [
        turnwise::pipeline::FIRST_PROMPT_FILE,
        turnwise::pipeline::REFERENCE_DIR,
        turnwise::pipeline::WEIGHTS_DIR,
        "summary.json",
    ] {
        assert!(RUN_ENTRIES.contains(&name), "{name}");
    }
}

/// The mechanism table lists only what the run's preset uses: grpo and a2tgpo log the
/// clipping-bias statistics and DAPO's dynamic-sampling counts too (the review's report of
/// a2tgpo showed "clipping-bias scale" and "refill rounds"), which a run that turns them on
/// shows.
#[test]
fn the_mechanism_table_shows_the_mechanisms_the_config_turns_on() {
    let record = |step: u64| MetricsRecord {
        step,
        phase: "train".into(),
        time: None,
        values: [
            ("train/em", 0.5),
            ("actor/clip_bias_scale", 1.0),
            ("actor/clip_bias_num_clipped", 0.0),
            ("batch/filtered_groups", 0.0),
            ("batch/refill_rounds", 0.0),
            ("a2tgpo/clip_scale/max", 1.1),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), Some(v)))
        .collect(),
    };
    let log = MetricsLog::from_records(vec![record(1), record(2)]);
    let md = |config: &str| {
        render_report(&ReportInput {
            title: "t",
            log: &log,
            config: Some(config),
            plots: &[],
            base: Path::new("."),
        })
    };
    let rows = [
        "clipping-bias scale",
        "clipping-bias clipped tokens",
        "filtered groups",
    ];
    for preset in ["grpo", "a2tgpo"] {
        let cfg = TrainConfig::resolve(Some(preset), None, &[]).unwrap();
        let text = md(&cfg.to_toml());
        for row in rows.iter().chain(&["refill rounds"]) {
            assert!(
                !text.contains(&format!("| {row} |")),
                "{preset}: {row}\n{text}"
            );
        }
        assert!(text.contains("| A2TGPO clip scale, max |"), "{text}");
    }
    let cfg = TrainConfig::resolve(Some("dapo"), None, &[]).unwrap();
    assert!(cfg.rollout.filter_zero_variance_groups);
    let text = md(&cfg.to_toml());
    assert!(text.contains("| refill rounds |"), "{text}");
    assert!(!text.contains("| clipping-bias scale |"), "{text}");
    let on = "[actor.policy]\nclip_bias = { rule = \"inverse_norm\" }\n";
    assert!(md(on).contains("| clipping-bias scale |"));
    // Without a config, what was logged decides.
    let bare = render_report(&ReportInput {
        title: "t",
        log: &log,
        config: None,
        plots: &[],
        base: Path::new("."),
    });
    assert!(bare.contains("| refill rounds |"), "{bare}");
}
