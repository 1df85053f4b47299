//! A run never loses or hides work: the warm start is checkpointed as step 0, resuming keeps
//! the summary and appends nothing twice, a corrupt checkpoint falls back to the one before,
//! an existing run is replaced only when asked and only after the new config has been
//! checked, one process at a time holds a run directory, and `runs`/`compare` read runs back.

mod common;

use std::path::{Path, PathBuf};

use turnwise::config::TrainConfig;
use turnwise::pipeline::{RunOptions, resume, run};
use turnwise::run::{RunDir, RunInfo, compare_charts, compare_table, find_runs, runs_table};

/// summary.json without its timings.
fn summary(dir: &Path) -> serde_json::Value {
    let mut v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap();
    let o = v.as_object_mut().unwrap();
    o.retain(|k, _| !k.ends_with("_seconds"));
    v
}

fn tiny(preset: &str, extra: &[&str]) -> TrainConfig {
    let mut sets = common::tiny_overrides();
    sets.extend(
        [
            "run.steps=2",
            "run.save_every=1",
            "run.keep_checkpoints=5",
            "eval.questions=3",
        ]
        .map(String::from),
    );
    sets.extend(extra.iter().map(|s| s.to_string()));
    TrainConfig::resolve(Some(preset), None, &sets).unwrap()
}

fn opts(dir: &Path) -> RunOptions {
    RunOptions {
        dir: dir.to_path_buf(),
        quiet: true,
    }
}

fn file(dir: &Path, rel: &str) -> Vec<u8> {
    std::fs::read(dir.join(rel)).unwrap_or_else(|e| panic!("{}/{rel}: {e}", dir.display()))
}

#[test]
fn resumes_keep_the_warm_start_the_summary_and_the_log() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    run(tiny("grpo", &[]), &opts(&a), false).unwrap();

    // The run records its preset, and the warm-started model is checkpoint 0.
    let config = std::fs::read_to_string(a.join("config.toml")).unwrap();
    assert!(config.contains("preset = \"grpo\""), "{config}");
    assert!(a.join("checkpoints/step-00000/COMPLETE").is_file());
    let full = summary(&a);
    assert_eq!(full["before_greedy"]["n"], 3, "{full}");
    assert_eq!(full["after_greedy"]["n"], 3, "{full}");
    assert!(
        !full["before_greedy"]["em_by_hops"]
            .as_object()
            .unwrap()
            .is_empty(),
        "{full}"
    );
    let sft_lines = common::phase_lines(&a.join("metrics.jsonl"), "sft");
    assert!(!sft_lines.is_empty());

    // A kill after the warm start (no RL checkpoint yet): the resume starts from step 0, the
    // warm start is not redone, and everything matches the uninterrupted run.
    let b = tmp.path().join("b");
    common::copy_dir(&a, &b);
    for step in ["step-00001", "step-00002"] {
        std::fs::remove_dir_all(b.join("checkpoints").join(step)).unwrap();
    }
    std::fs::remove_file(b.join("summary.json")).unwrap();
    resume(&b, true).unwrap();
    assert_eq!(
        common::phase_lines(&b.join("metrics.jsonl"), "sft"),
        sft_lines
    );
    assert_eq!(
        common::phase_lines(&b.join("metrics.jsonl"), "timing").len(),
        1
    );
    assert_eq!(
        common::phase_lines(&b.join("metrics.jsonl"), "train"),
        common::phase_lines(&a.join("metrics.jsonl"), "train")
    );
    assert_eq!(
        common::phase_lines(&b.join("metrics.jsonl"), "eval"),
        common::phase_lines(&a.join("metrics.jsonl"), "eval")
    );
    assert!(
        file(&a, "checkpoints/step-00002/model.safetensors")
            == file(&b, "checkpoints/step-00002/model.safetensors"),
        "the run resumed from step 0 ends with other weights"
    );
    assert_eq!(summary(&b), full, "the resumed run's summary differs");
    // TensorBoard: each run holds one event file with every metrics line once (the resumed
    // run's was rewritten from its truncated log), the train metrics of both steps included.
    for run in [&a, &b] {
        let scalars = common::event_scalars(run);
        assert_eq!(scalars, common::metrics_as_scalars(run));
        let steps: Vec<i64> = scalars
            .iter()
            .filter(|s| s.1 == "actor/pg_loss")
            .map(|s| s.0)
            .collect();
        assert_eq!(steps, [1, 2]);
    }

    // Resuming a finished run evaluates and appends nothing.
    let log_before = file(&a, "metrics.jsonl");
    let summary_before = file(&a, "summary.json");
    resume(&a, true).unwrap();
    assert!(
        file(&a, "metrics.jsonl") == log_before,
        "resuming a finished run changed its log"
    );
    assert!(file(&a, "summary.json") == summary_before);

    // Extending a finished run: raise run.steps in its config and resume.
    let d = tmp.path().join("extended");
    common::copy_dir(&a, &d);
    let text = std::fs::read_to_string(d.join("config.toml")).unwrap();
    assert!(text.contains("\nsteps = 2\n"), "{text}");
    std::fs::write(
        d.join("config.toml"),
        text.replace("\nsteps = 2\n", "\nsteps = 3\n"),
    )
    .unwrap();
    resume(&d, true).unwrap();
    assert_eq!(
        common::phase_lines(&d.join("metrics.jsonl"), "train").len(),
        3
    );
    assert!(d.join("checkpoints/step-00003/COMPLETE").is_file());
    let extended = summary(&d);
    assert_eq!(extended["before_greedy"], full["before_greedy"]);
    assert_eq!(extended["after_greedy"]["n"], 3);
    std::fs::remove_dir_all(&d).unwrap();

    // A corrupt latest checkpoint: set aside, and the run resumes from the one before.
    let c = tmp.path().join("c");
    common::copy_dir(&a, &c);
    let weights = c.join("checkpoints/step-00002/model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..1000]).unwrap();
    std::fs::remove_file(c.join("summary.json")).unwrap();
    resume(&c, true).unwrap();
    assert!(c.join("checkpoints/corrupt-step-00002").is_dir());
    assert!(
        file(&a, "checkpoints/step-00002/model.safetensors")
            == file(&c, "checkpoints/step-00002/model.safetensors"),
        "the fallback resume ends with other weights"
    );
    assert_eq!(summary(&c), full);

    // An edited architecture is refused by key, not resumed with the checkpoint's shape.
    let e = tmp.path().join("arch");
    common::copy_dir(&a, &e);
    let text = std::fs::read_to_string(e.join("config.toml")).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with("num_layers = "))
        .expect("config.toml records model.num_layers")
        .to_string();
    let n_layers: usize = line["num_layers = ".len()..].trim().parse().unwrap();
    let edited = text.replace(&line, &format!("num_layers = {}", n_layers + 1));
    let edited = edited.replace("\nsteps = 2\n", "\nsteps = 3\n");
    std::fs::write(e.join("config.toml"), edited).unwrap();
    let err = format!("{:#}", resume(&e, true).unwrap_err());
    assert!(err.contains("model.num_layers"), "{err}");
    assert!(e.join("checkpoints/step-00002/COMPLETE").is_file());
    std::fs::remove_dir_all(&e).unwrap();

    // No checkpoint loads: the resume stops, naming them, and changes nothing (the review's
    // run lost its metrics, its set-aside folders and the user's notes to a silent restart).
    let n = tmp.path().join("n");
    common::copy_dir(&a, &n);
    for step in [0, 1, 2] {
        let w = n.join(format!("checkpoints/step-{step:05}/model.safetensors"));
        if w.is_file() {
            std::fs::write(&w, b"garbage").unwrap();
        }
    }
    std::fs::write(n.join("NOTES.md"), "mine").unwrap();
    let listing = |d: &Path| {
        let mut v: Vec<String> = walk(d);
        v.sort();
        v
    };
    let before = listing(&n);
    let metrics_before = file(&n, "metrics.jsonl");
    let err = format!("{:#}", resume(&n, true).unwrap_err());
    assert!(
        err.contains("no checkpoint of") && err.contains("nothing was changed"),
        "{err}"
    );
    assert!(
        err.contains("step-00002") && err.contains("--overwrite"),
        "{err}"
    );
    assert_eq!(listing(&n), before);
    assert!(file(&n, "metrics.jsonl") == metrics_before);
    // Set-aside folders alone (an earlier resume moved every checkpoint) stop it too.
    let ck = n.join("checkpoints");
    for e in std::fs::read_dir(&ck).unwrap() {
        let p = e.unwrap().path();
        let name = p
            .file_name()
            .unwrap()
            .to_string_lossy()
            .replace("step-", "corrupt-step-");
        std::fs::rename(&p, ck.join(name)).unwrap();
    }
    let err = format!("{:#}", resume(&n, true).unwrap_err());
    assert!(
        err.contains("set aside") && err.contains("corrupt-step-00002"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(n.join("NOTES.md")).unwrap(), "mine");
    std::fs::remove_dir_all(&n).unwrap();

    // `runs` and `compare` read the runs back.
    let found = find_runs(tmp.path()).unwrap();
    assert_eq!(found, vec![a.clone(), b.clone(), c.clone()]);
    let infos: Vec<RunInfo> = found.iter().map(|d| RunInfo::read(d).unwrap()).collect();
    for i in &infos {
        assert_eq!(i.preset, "grpo");
        assert!(i.finished);
        assert_eq!(
            (i.steps_done, i.steps_planned, i.checkpoint),
            (2, 2, Some(2))
        );
        assert!(i.test_em["greedy"].0.is_some() && i.test_em["greedy"].1.is_some());
    }
    let table = runs_table(&infos);
    assert_eq!(table.lines().count(), 4, "{table}");
    assert!(table.contains("finished"), "{table}");
    let mut cmp = compare_table(&infos);
    assert!(cmp.contains("| grpo | 2/2 | 3 |"), "{cmp}");
    assert!(
        cmp.contains("| test n |") && !cmp.contains("Note:"),
        "{cmp}"
    );
    // Runs evaluated on different numbers of test questions are flagged.
    let mut mixed = infos.clone();
    mixed[0].test_n = Some(800);
    cmp = compare_table(&mixed);
    assert!(
        cmp.contains("different numbers of test questions (3, 800)"),
        "{cmp}"
    );
    let charts = compare_charts(&infos);
    let train = charts
        .iter()
        .find(|(stem, _)| stem == "train_em")
        .expect("a training-EM chart");
    assert_eq!(train.1.series.len(), 3);
}

/// A non-empty directory that is not replaced: the old run's files are left as they were (a run
/// of an earlier turnwise: its marker, no manifest).
fn old_run(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join(".turnwise-run"), "a turnwise run directory\n").unwrap();
    std::fs::write(dir.join("config.toml"), "preset = \"old\"\n").unwrap();
    std::fs::write(dir.join("metrics.jsonl"), "{\"step\":1}\n").unwrap();
    dir.join("config.toml")
}

#[test]
fn an_existing_run_is_replaced_only_when_asked_and_only_by_a_valid_run() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("old");
    let config = old_run(&dir);

    // Not asked to overwrite.
    let err = run(tiny("grpo", &[]), &opts(&dir), false).unwrap_err();
    assert!(format!("{err:#}").contains("--overwrite"), "{err:#}");
    assert_eq!(
        std::fs::read_to_string(&config).unwrap(),
        "preset = \"old\"\n"
    );

    // Asked, but the new run fails its checks (a vocabulary too small for the tokenizer,
    // found only when the tokenizer is built): the old run is still there.
    let err = run(tiny("grpo", &["model.vocab_size=10"]), &opts(&dir), true).unwrap_err();
    assert!(format!("{err:#}").contains("model.vocab_size"), "{err:#}");
    assert_eq!(
        std::fs::read_to_string(&config).unwrap(),
        "preset = \"old\"\n"
    );

    // Checks that need the task (a warm start without demonstrations, more few-shot examples
    // than training questions) also come before the old run is touched; `turnwise config`
    // makes them too (tests/cli.rs).
    for set in ["task.world.questions.train=0", "eval.base_shots=[500]"] {
        let err = format!(
            "{:#}",
            run(tiny("grpo", &[set]), &opts(&dir), true).unwrap_err()
        );
        assert!(
            err.contains("no demonstrations") || err.contains("eval.base_shots = 500"),
            "{set}: {err}"
        );
        assert_eq!(
            std::fs::read_to_string(&config).unwrap(),
            "preset = \"old\"\n"
        );
    }

    // Another process (here: a held lock) writes the directory: neither a new run nor a
    // resume may touch it.
    let held = RunDir::open_locked(&dir).unwrap();
    let err = run(tiny("grpo", &[]), &opts(&dir), true).unwrap_err();
    assert!(format!("{err:#}").contains("in use"), "{err:#}");
    let err = resume(&dir, true).unwrap_err();
    assert!(format!("{err:#}").contains("in use"), "{err:#}");
    assert_eq!(
        std::fs::read_to_string(&config).unwrap(),
        "preset = \"old\"\n"
    );
    drop(held);
}

#[test]
fn a_critic_that_cannot_update_stops_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("critic");
    let cfg = tiny(
        "st-ppo",
        &["critic.lr=1e6", "run.steps=8", "optim.max_bad_updates=2"],
    );
    let err = run(cfg, &opts(&dir), false).unwrap_err();
    let msg = format!("{err:#}");
    assert!(msg.contains("critic.lr"), "{msg}");
    // The steps before the stop are on disk.
    assert!(!common::phase_lines(&dir.join("metrics.jsonl"), "train").is_empty());
}

/// Every file and folder under `dir`, relative to it.
fn walk(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            out.push(p.strip_prefix(dir).unwrap().display().to_string());
            if p.is_dir() {
                stack.push(p);
            }
        }
    }
    out
}

#[test]
fn runs_tells_a_live_run_from_a_stopped_one() {
    // Review cli-as-a-user-3 m4: a killed run was listed as `step 17/40`, like a live one.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("r");
    let run = RunDir::create(&dir, false).unwrap();
    run.write_config("preset = \"grpo\"\n\n[run]\nsteps = 40\n")
        .unwrap();
    std::fs::write(
        run.metrics_path(),
        "{\"step\":17,\"phase\":\"train\",\"time\":1795749476.0,\"train/em\":0.5}\n",
    )
    .unwrap();

    // This process holds the lock, as a live run does.
    let live = RunInfo::read(&dir).unwrap();
    assert!(live.live && !live.finished);
    let table = runs_table(&[live]);
    assert!(table.contains("running step 17/40"), "{table}");
    assert!(!table.contains("turnwise resume"), "{table}");

    // The process is gone (the lock is free) and there is no summary.json.
    drop(run);
    let stopped = RunInfo::read(&dir).unwrap();
    assert!(!stopped.live);
    let table = runs_table(&[stopped]);
    assert!(table.contains("stopped at step 17/40"), "{table}");
    assert!(
        table.contains(&format!("turnwise resume {}", dir.display())),
        "{table}"
    );

    // A finished run is finished whether or not its lock file is left.
    std::fs::write(dir.join("summary.json"), "{}").unwrap();
    let table = runs_table(&[RunInfo::read(&dir).unwrap()]);
    assert!(
        table.contains("finished") && !table.contains("turnwise resume"),
        "{table}"
    );
}

#[test]
fn compare_notes_runs_from_different_worlds() {
    // Review cli-as-a-user-3 m5: runs on different `task.world.seed` were set side by side
    // without a note (only differing test n was noted).
    let tmp = tempfile::tempdir().unwrap();
    let infos: Vec<RunInfo> = [("a", 0), ("b", 7), ("c", 0)]
        .iter()
        .map(|(name, seed)| {
            let dir = tmp.path().join(name);
            let run = RunDir::create(&dir, false).unwrap();
            run.write_config(&format!(
                "preset = \"grpo\"\n\n[run]\nsteps = 2\n\n[task]\nenv = \"search\"\ntopk = {}\n\n\
                 [task.world]\nseed = {seed}\n",
                if *name == "c" { 5 } else { 3 }
            ))
            .unwrap();
            drop(run);
            RunInfo::read(&dir).unwrap()
        })
        .collect();
    let same = compare_table(&[infos[0].clone(), infos[2].clone()]);
    assert!(!same.contains("Note:"), "topk is not the world: {same}");
    let cmp = compare_table(&infos);
    assert!(
        cmp.contains("different worlds") && cmp.contains("task.world.seed"),
        "{cmp}"
    );
    assert!(!cmp.contains("task.topk"), "{cmp}");
}
