//! `turnwise study`: a tiny study (2 arms × 2 seeds from one warm start) runs to a report whose
//! numbers are those of the runs' eval files; a killed study resumes without redoing finished
//! runs; `study plan`'s commands run under GNU parallel; malformed study files are refused
//! naming the key; a study directory without its runs (as committed) refuses a report.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant, SystemTime};

/// A study of `grpo` and `dapo` on a tiny world and model, 2 seeds, 2 RL steps, 8 questions.
const TINY: &str = r#"
name = "tiny"
seeds = [0, 1]
baseline = "grpo"
sets = [
  "task.world.countries=4", "task.world.cities=8", "task.world.companies=6",
  "task.world.persons=16", "task.world.questions.train=40",
  "task.world.questions.validation=8", "task.world.questions.test=8",
  "model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
  "model.intermediate_size=64", "sft.batch_size=4", "rollout.max_turn_tokens=12",
  "rollout.max_response_tokens=120", "optim.mini_batch_size=3",
]

[budget]
steps = 2
prompts_per_step = 2
group_size = 3

[panel]
questions = 6

[warm_start.boxed]
preset = "grpo"
sets = ["sft.steps=3"]

[[arm]]
name = "grpo"
preset = "grpo"

[[arm]]
name = "dapo"
preset = "dapo"

[[claim]]
name = "dapo beats grpo"
paper = "DAPO (arXiv:2503.14476)"
effect = "+8 points"
better = "dapo"
than = "grpo"
metric = "em_greedy"
environment = "search"
"#;

fn turnwise(args: &[&str], cwd: &Path) -> Output {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    common::turnwise_in(&args, cwd)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "status {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

fn write_study(dir: &Path, body: &str) -> PathBuf {
    let path = dir.join("study.toml");
    std::fs::write(&path, body).unwrap();
    path
}

const RUNS: [&str; 4] = [
    "runs/grpo/seed-0",
    "runs/grpo/seed-1",
    "runs/dapo/seed-0",
    "runs/dapo/seed-1",
];

fn read_eval(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Mean and 95 % t-interval (df 1: t = 12.706) of two values.
fn t2(a: f64, b: f64) -> (f64, f64, f64) {
    let m = (a + b) / 2.0;
    let half = 12.706 * ((a - b).abs() / 2f64.sqrt()) / 2f64.sqrt();
    (m, m - half, m + half)
}

fn close(a: &serde_json::Value, b: f64) {
    let a = a.as_f64().unwrap_or_else(|| panic!("not a number: {a}"));
    assert!((a - b).abs() < 1e-9, "{a} != {b}");
}

#[test]
fn a_tiny_study_runs_to_a_report_of_its_runs_eval_files() {
    let tmp = tempfile::tempdir().unwrap();
    let file = write_study(tmp.path(), TINY);
    let t = Instant::now();
    let out = turnwise(
        &[
            "study",
            "run",
            file.to_str().unwrap(),
            "--out",
            "s",
            "--jobs",
            "2",
        ],
        tmp.path(),
    );
    let stdout = ok(&out);
    assert!(
        stdout.contains("5 runs (0 finished already), 2 at once"),
        "{stdout}"
    );
    assert!(stdout.contains("[5/5]"), "{stdout}");
    let s = tmp.path().join("s");
    for run in RUNS.iter().chain(&["warm/boxed"]) {
        assert!(
            s.join(run).join("summary.json").is_file(),
            "{run} did not finish"
        );
        let log = s.join("logs").join(format!(
            "{}.log",
            run.trim_start_matches("runs/").replace('/', "-")
        ));
        assert!(log.is_file(), "no log {}", log.display());
    }
    // Every arm run started from the warm start's model, with the study's seed, budget and panel.
    for (run, seed) in RUNS.iter().zip([0, 1, 0, 1]) {
        let cfg: toml::Table = std::fs::read_to_string(s.join(run).join("config.toml"))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(cfg["seed"].as_integer(), Some(seed));
        assert_eq!(cfg["run"]["steps"].as_integer(), Some(2));
        assert_eq!(cfg["eval"]["questions"].as_integer(), Some(6));
        assert_eq!(cfg["sft"]["steps"].as_integer(), Some(0));
        let init = cfg["model"]["init_from"].as_str().unwrap();
        assert_eq!(
            Path::new(init),
            s.join("warm/boxed/warm-start-model")
                .canonicalize()
                .unwrap()
        );
    }
    let panel: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(s.join("panel.json")).unwrap()).unwrap();
    let ids: Vec<&str> = panel["panels"]["boxed"]["questions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), 6);

    // The tiny model answers nothing, so plant known outcomes in the runs' eval files (the
    // panel's questions kept) and check the report against them.
    let pattern = |run: usize, q: usize, mode: usize| -> (f64, f64) {
        let em = f64::from(u8::from((run * 7 + q * 3 + mode).is_multiple_of(4)));
        (em, (em + ((run + q + mode) % 3) as f64 / 4.0).min(1.0))
    };
    for (r, run) in RUNS.iter().enumerate() {
        for (m, mode) in ["greedy", "sampled"].iter().enumerate() {
            let path = s
                .join(run)
                .join(format!("evals/test-{mode}-step-00002.jsonl"));
            let mut lines = read_eval(&path);
            assert_eq!(
                lines
                    .iter()
                    .map(|l| l["question_id"].as_str().unwrap())
                    .collect::<Vec<_>>(),
                ids,
                "{} holds the panel's questions in order",
                path.display()
            );
            for (q, l) in lines.iter_mut().enumerate() {
                let (em, f1) = pattern(r, q, m);
                l["em"] = em.into();
                l["f1"] = f1.into();
            }
            let body: String = lines.iter().map(|l| format!("{l}\n")).collect();
            std::fs::write(&path, body).unwrap();
        }
    }
    ok(&turnwise(&["study", "report", "s"], tmp.path()));
    let report = std::fs::read_to_string(s.join("report.md")).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(s.join("report.json")).unwrap()).unwrap();
    assert_eq!(json["finished"], 5);
    assert_eq!(json["bootstrap"], serde_json::json!([2000, 2000]));
    // Recompute every arm's figures from the eval files.
    let panel_mean = |run: &str, mode: &str, key: &str| -> Vec<f64> {
        let lines = read_eval(
            &s.join(run)
                .join(format!("evals/test-{mode}-step-00002.jsonl")),
        );
        lines.iter().map(|l| l[key].as_f64().unwrap()).collect()
    };
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    for (arm, runs) in [("grpo", [RUNS[0], RUNS[1]]), ("dapo", [RUNS[2], RUNS[3]])] {
        for (metric, mode, key) in [
            ("em_greedy", "greedy", "em"),
            ("f1_greedy", "greedy", "f1"),
            ("em_sampled", "sampled", "em"),
            ("f1_sampled", "sampled", "f1"),
        ] {
            let a = mean(&panel_mean(runs[0], mode, key));
            let b = mean(&panel_mean(runs[1], mode, key));
            let (m, lo, hi) = t2(a, b);
            let got = &json["arms"][arm][metric];
            close(&got["mean"], m);
            if a == b {
                close(&got["lo"], m);
            } else {
                close(&got["lo"], lo);
                close(&got["hi"], hi);
            }
            assert_eq!(got["n"], 2);
        }
    }
    // The paired difference dapo − grpo: the mean over seeds × questions of the differences.
    for (metric, mode, key) in [
        ("em_greedy", "greedy", "em"),
        ("f1_sampled", "sampled", "f1"),
    ] {
        let mut d = Vec::new();
        for (x, y) in [(RUNS[2], RUNS[0]), (RUNS[3], RUNS[1])] {
            let (a, b) = (panel_mean(x, mode, key), panel_mean(y, mode, key));
            d.extend(a.iter().zip(&b).map(|(p, q)| p - q));
        }
        let got = &json["vs_baseline"]["dapo"][metric];
        close(&got["mean"], mean(&d));
        let (lo, hi) = (got["lo"].as_f64().unwrap(), got["hi"].as_f64().unwrap());
        let (dmin, dmax) = d
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| {
                (a.min(x), b.max(x))
            });
        assert!(
            dmin <= lo && lo <= mean(&d) && mean(&d) <= hi && hi <= dmax,
            "{got}"
        );
    }
    let claim = &json["claims"]["dapo beats grpo"];
    let v = claim["verdict"].as_str().unwrap();
    let (lo, hi) = (
        claim["ours"]["lo"].as_f64().unwrap(),
        claim["ours"]["hi"].as_f64().unwrap(),
    );
    let want = if lo > 0.0 {
        "reproduced"
    } else if hi < 0.0 {
        "reversed"
    } else {
        "inconclusive"
    };
    assert_eq!(v, want);
    assert_eq!(
        claim["ours"]["mean"],
        json["vs_baseline"]["dapo"]["em_greedy"]["mean"]
    );
    for section in [
        "## Results per arm",
        "## Paired differences against the baseline",
        "## Claims",
        "| dapo beats grpo | DAPO (arXiv:2503.14476) | +8 points |",
        "## Learning curves",
        "## Cost per episode and wall time",
        "## Stability",
        "## Reasoning health per turn",
        "| `grpo` | 1 | 8 → 8 |",
        "2 of 2",
    ] {
        assert!(
            report.contains(section),
            "report.md lacks {section:?}:\n{report}"
        );
    }
    assert!(s.join("plots/boxed-reward.svg").is_file());
    assert!(report.contains("(plots/boxed-reward.svg)"));

    // A run whose evaluation asked other questions than the panel is refused, naming its file.
    let path = s.join(RUNS[1]).join("evals/test-greedy-step-00002.jsonl");
    let body = std::fs::read_to_string(&path)
        .unwrap()
        .replacen(ids[0], "test_99", 1);
    std::fs::write(&path, body).unwrap();
    let out = turnwise(&["study", "report", "s"], tmp.path());
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("test-greedy-step-00002.jsonl") && err.contains("panel"),
        "{err}"
    );
    eprintln!(
        "tiny study and report in {:.1} s",
        t.elapsed().as_secs_f64()
    );
}

fn mtime(p: &Path) -> SystemTime {
    std::fs::metadata(p).unwrap().modified().unwrap()
}

#[test]
fn a_killed_study_resumes_without_redoing_finished_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let file = write_study(tmp.path(), TINY);
    let s = tmp.path().join("s");
    let mut child = Command::new(env!("CARGO_BIN_EXE_turnwise"))
        .args([
            "study",
            "run",
            file.to_str().unwrap(),
            "--out",
            "s",
            "--jobs",
            "1",
        ])
        .current_dir(tmp.path())
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Kill the study as soon as its first arm run has finished.
    let first = s.join(RUNS[0]).join("summary.json");
    let t = Instant::now();
    let finished = |p: &Path| {
        std::fs::read(p)
            .ok()
            .is_some_and(|b| serde_json::from_slice::<serde_json::Value>(&b).is_ok())
    };
    while !finished(&first) {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the study ended before it was killed"
        );
        assert!(t.elapsed() < Duration::from_secs(120), "no run finished");
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let unfinished: Vec<&str> = RUNS
        .iter()
        .copied()
        .filter(|r| !s.join(r).join("summary.json").is_file())
        .collect();
    assert!(!unfinished.is_empty(), "every run finished before the kill");
    let kept = [s.join("warm/boxed"), s.join(RUNS[0])];
    let before: Vec<(SystemTime, String, SystemTime)> = kept
        .iter()
        .map(|d| {
            (
                mtime(&d.join("metrics.jsonl")),
                std::fs::read_to_string(d.join("metrics.jsonl")).unwrap(),
                mtime(&d.join("summary.json")),
            )
        })
        .collect();
    // The run it was in stops too (it watches its parent), leaving its lock free.
    std::thread::sleep(Duration::from_millis(600));
    let out = turnwise(
        &["study", "run", file.to_str().unwrap(), "--out", "s"],
        tmp.path(),
    );
    let stdout = ok(&out);
    assert!(stdout.contains("5 runs (2 finished already)"), "{stdout}");
    assert!(!stdout.contains("start warm/boxed"), "{stdout}");
    assert!(!stdout.contains(&format!("start {}", RUNS[0].trim_start_matches("runs/"))));
    for r in RUNS {
        assert!(
            s.join(r).join("summary.json").is_file(),
            "{r} did not finish"
        );
    }
    for (d, (m, text, sm)) in kept.iter().zip(before) {
        assert_eq!(
            mtime(&d.join("metrics.jsonl")),
            m,
            "{} was rewritten",
            d.display()
        );
        assert_eq!(
            std::fs::read_to_string(d.join("metrics.jsonl")).unwrap(),
            text
        );
        assert_eq!(mtime(&d.join("summary.json")), sm);
    }
    // Run again: nothing to do.
    let stdout = ok(&turnwise(
        &["study", "run", file.to_str().unwrap(), "--out", "s"],
        tmp.path(),
    ));
    assert!(
        stdout.contains("(5 finished already)") && !stdout.contains("start "),
        "{stdout}"
    );
}

#[test]
fn study_plan_commands_run_under_gnu_parallel() {
    let has_parallel = Command::new("parallel")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        has_parallel,
        "GNU parallel is not installed (`apt-get install parallel`; .ci/run installs it)"
    );
    let tmp = tempfile::tempdir().unwrap();
    let file = write_study(tmp.path(), TINY);
    let f = file.to_str().unwrap();
    let all = ok(&turnwise(&["study", "plan", f, "--out", "s"], tmp.path()));
    let warm = ok(&turnwise(
        &["study", "plan", f, "--out", "s", "--stage", "warm"],
        tmp.path(),
    ));
    let runs = ok(&turnwise(
        &["study", "plan", f, "--out", "s", "--stage", "runs"],
        tmp.path(),
    ));
    assert_eq!(warm.lines().count(), 1, "{warm}");
    assert_eq!(runs.lines().count(), 4, "{runs}");
    let commands: Vec<&str> = all.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(
        commands,
        warm.lines().chain(runs.lines()).collect::<Vec<_>>()
    );
    assert!(
        all.lines().next().unwrap().starts_with("# study \"tiny\""),
        "{all}"
    );
    assert!(
        warm.contains("study run-one") && warm.contains("--run warm/boxed"),
        "{warm}"
    );
    // An arm before its warm start is refused, naming what to run first.
    let out = Command::new("sh")
        .arg("-c")
        .arg(runs.lines().next().unwrap())
        .current_dir(tmp.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--run warm/boxed` first"),
        "{}",
        text(&out.stderr)
    );
    for stage in [&warm, &runs] {
        let mut p = Command::new("parallel")
            .args(["--will-cite", "--halt", "now,fail=1", "-j", "2"])
            .current_dir(tmp.path())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        p.stdin.take().unwrap().write_all(stage.as_bytes()).unwrap();
        let out = p.wait_with_output().unwrap();
        ok(&out);
    }
    let s = tmp.path().join("s");
    for r in RUNS.iter().chain(&["warm/boxed"]) {
        assert!(
            s.join(r).join("summary.json").is_file(),
            "{r} did not finish"
        );
    }
    // Run again, they skip.
    let out = Command::new("sh")
        .arg("-c")
        .arg(runs.lines().next().unwrap())
        .current_dir(tmp.path())
        .output()
        .unwrap();
    assert!(ok(&out).contains("is finished"));
    ok(&turnwise(&["study", "report", "s"], tmp.path()));
    assert!(s.join("report.md").is_file());
}

#[test]
fn malformed_study_files_are_refused_naming_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: Vec<(String, &[&str])> = vec![
        (
            TINY.replace("baseline = \"grpo\"", "baseline = \"grpo\"\ncolour = 1"),
            &["colour", "unknown field"],
        ),
        (
            TINY.replace("seeds = [0, 1]", "seeds = [0, 0]"),
            &["`seeds[1]`", "twice"],
        ),
        (
            TINY.replace("name = \"dapo\"", "name = \"grpo\""),
            &["`arm[1].name`", "named twice"],
        ),
        (
            TINY.replace("preset = \"dapo\"", "preset = \"dapoo\""),
            &["`arm[1].preset`", "unknown preset"],
        ),
        (
            TINY.replace("baseline = \"grpo\"", "baseline = \"ppo\""),
            &["`baseline`", "no arm \"ppo\""],
        ),
        (
            TINY.replace("better = \"dapo\"", "better = \"igpo\""),
            &["`claim[0].better`", "no arm \"igpo\""],
        ),
        (
            TINY.replace("metric = \"em_greedy\"", "metric = \"accuracy\""),
            &["claim[0].metric", "unknown variant"],
        ),
        (
            TINY.replace("environment = \"search\"", "environment = \"sokoban\""),
            &["`claim[0]`", "runs in \"search\""],
        ),
        (
            TINY.replace("steps = 2\n", "steps = \"two\"\n"),
            &["budget.steps", "invalid type"],
        ),
        (
            format!("{TINY}\n[[audit]]\nname = \"a\"\nrun = \"ppo/seed-0\"\n"),
            &["`audit[0].run`", "no run \"ppo/seed-0\""],
        ),
        (
            format!("{TINY}\n[[audit]]\nname = \"a\"\nrun = \"grpo/seed-7\"\n"),
            &["`audit[0].run`", "seeds [0, 1]"],
        ),
        (
            format!(
                "{TINY}\n[[audit]]\nname = \"a\"\nrun = \"warm/boxed\"\n\
                 [[audit]]\nname = \"a\"\nrun = \"grpo/seed-0\"\n"
            ),
            &["`audit[1].name`", "named twice"],
        ),
        (
            format!("{TINY}\n[[audit]]\nname = \"a\"\nrun = \"warm/boxed\"\nrollouts = 1\n"),
            &["`audit[0]`", "--rollouts must be at least 2"],
        ),
        (
            format!("{TINY}\n[[audit]]\nname = \"a\"\nrun = \"warm/boxed\"\nk = 3\n"),
            &["audit[0]", "unknown field"],
        ),
        (
            TINY.replace(
                "name = \"dapo\"\npreset = \"dapo\"",
                "name = \"dapo\"\npreset = \"dapo\"\nsets = [\"run.steps=9\"]",
            ),
            &["`arm[1].sets[0]`", "run.steps", "[budget] steps"],
        ),
        (
            TINY.replace(
                "name = \"dapo\"\npreset = \"dapo\"",
                "name = \"dapo\"\npreset = \"dapo\"\nwarm_start = \"search\"",
            ),
            &["`arm[1].warm_start`", "no warm start \"search\""],
        ),
        (
            TINY.replace(
                "name = \"dapo\"\npreset = \"dapo\"",
                "name = \"dapo\"\npreset = \"dapo\"\nsets = [\"optim.lr=-1\"]",
            ),
            &["arm \"dapo\" (preset dapo)", "optim.lr"],
        ),
        (
            TINY.replace(
                "name = \"dapo\"\npreset = \"dapo\"",
                "name = \"dapo\"\npreset = \"dapo\"\nsets = [\"task.world.seed=5\"]",
            ),
            &["arm \"dapo\"", "not those of its warm start \"boxed\""],
        ),
        (
            TINY.replace("[panel]\nquestions = 6", "[panel]\nquestions = 0"),
            &["`panel.questions`"],
        ),
        (
            // An arm on FrozenLake without a baseline of its own would pair with grpo's questions.
            TINY.replace("name = \"dapo\"\npreset = \"dapo\"", "name = \"dapo\"\npreset = \"dapo\"\nwarm_start = \"lake\"")
                .replace("name = \"grpo\"\npreset = \"grpo\"", "name = \"grpo\"\npreset = \"grpo\"\nwarm_start = \"boxed\"")
                .replace("[[claim]]", "[warm_start.lake]\npreset = \"gigpo\"\ncommon = [\"task.env=\\\"frozen_lake\\\"\", \"task.max_turns=6\", \"task.game.train=12\", \"task.game.test=6\"]\nsets = [\"sft.steps=3\"]\n\n[[claim]]")
                .replace("environment = \"search\"", "environment = \"search\"\n"),
            &["`warm_start.lake.baseline`", "evaluated on other questions"],
        ),
    ];
    for (i, (body, needles)) in cases.iter().enumerate() {
        let dir = tmp.path().join(format!("case{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        let file = write_study(&dir, body);
        let out = turnwise(
            &["study", "plan", file.to_str().unwrap(), "--out", "s"],
            &dir,
        );
        let err = text(&out.stderr);
        assert!(!out.status.success(), "case {i} was accepted");
        for n in *needles {
            assert!(err.contains(n), "case {i}: {n:?} not in {err}");
        }
        assert!(!dir.join("s").exists(), "case {i} created the study folder");
    }
    // A folder holding another study is refused, naming it; one holding other files too.
    let file = write_study(tmp.path(), TINY);
    ok(&turnwise(
        &["study", "plan", file.to_str().unwrap(), "--out", "s"],
        tmp.path(),
    ));
    let other = tmp.path().join("other.toml");
    std::fs::write(
        &other,
        TINY.replace("name = \"tiny\"", "name = \"tiny2\"")
            .replace("[0, 1]", "[0, 1, 2]"),
    )
    .unwrap();
    let out = turnwise(
        &["study", "plan", other.to_str().unwrap(), "--out", "s"],
        tmp.path(),
    );
    let err = text(&out.stderr);
    assert!(
        !out.status.success() && err.contains("holds the study \"tiny\""),
        "{err}"
    );
    std::fs::create_dir_all(tmp.path().join("busy")).unwrap();
    std::fs::write(tmp.path().join("busy/notes.txt"), "mine").unwrap();
    let out = turnwise(
        &["study", "plan", file.to_str().unwrap(), "--out", "busy"],
        tmp.path(),
    );
    assert!(!out.status.success() && text(&out.stderr).contains("holds no study"));
    // A run name that is not the study's.
    let out = turnwise(
        &[
            "study",
            "run-one",
            file.to_str().unwrap(),
            "--out",
            "s",
            "--run",
            "ppo/seed-0",
        ],
        tmp.path(),
    );
    assert!(
        text(&out.stderr).contains("no run \"ppo/seed-0\""),
        "{}",
        text(&out.stderr)
    );
}

/// Replay audits (`[[audit]]`) added to a study that has run: the study file with them takes
/// over the folder (any other change is still refused), `study run` runs only the audits, after
/// the runs they read, and the report scores every estimator against each, PPO's critic
/// included for a PPO run.
#[test]
fn audits_added_to_a_finished_study_run_and_reach_its_report() {
    let tmp = tempfile::tempdir().unwrap();
    let body = TINY
        .replace("seeds = [0, 1]", "seeds = [0]")
        .replace(
            "name = \"dapo\"\npreset = \"dapo\"",
            "name = \"ppo\"\npreset = \"ppo\"",
        )
        .replace("better = \"dapo\"", "better = \"ppo\"")
        .replace("steps = 2\n", "steps = 1\n");
    let file = write_study(tmp.path(), &body);
    let f = file.to_str().unwrap();
    ok(&turnwise(&["study", "run", f, "--out", "s"], tmp.path()));
    let audits = "\n[[audit]]\nname = \"warm\"\nrun = \"warm/boxed\"\nepisodes = 3\n\
                  alternatives = 2\nrollouts = 2\nbootstrap = 20\n\n\
                  [[audit]]\nname = \"ppo\"\nrun = \"ppo/seed-0\"\nepisodes = 3\n\
                  alternatives = 2\nrollouts = 2\nbootstrap = 20\n";
    let with = format!("{body}{audits}");
    // Another change than the audits is refused as before.
    write_study(tmp.path(), &with.replace("questions = 6", "questions = 5"));
    let out = turnwise(&["study", "run", f, "--out", "s"], tmp.path());
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("differs"),
        "{}",
        text(&out.stderr)
    );
    write_study(tmp.path(), &with);
    let plan = ok(&turnwise(&["study", "plan", f, "--out", "s"], tmp.path()));
    assert!(plan.contains("# stage 3"), "{plan}");
    let audit_lines: Vec<&str> = plan
        .lines()
        .filter(|l| l.contains("--run audit/"))
        .collect();
    assert_eq!(audit_lines.len(), 2, "{plan}");
    let only = ok(&turnwise(
        &["study", "plan", f, "--out", "s", "--stage", "audits"],
        tmp.path(),
    ));
    assert_eq!(only.lines().collect::<Vec<_>>(), audit_lines);
    let stdout = ok(&turnwise(&["study", "run", f, "--out", "s"], tmp.path()));
    assert!(stdout.contains("(3 finished already)"), "{stdout}");
    let s = tmp.path().join("s");
    for a in ["warm", "ppo"] {
        assert!(s.join("audit").join(a).join("audit.json").is_file(), "{a}");
    }
    assert!(
        std::fs::read_to_string(s.join("study.toml"))
            .unwrap()
            .contains("[[audit]]"),
        "the folder's study file took the audits"
    );
    ok(&turnwise(&["study", "report", "s"], tmp.path()));
    let report = std::fs::read_to_string(s.join("report.md")).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(s.join("report.json")).unwrap()).unwrap();
    // The audits are not counted among the trained runs.
    assert_eq!(
        (json["finished"].as_u64(), json["runs"].as_u64()),
        (Some(3), Some(3))
    );
    for section in [
        "## Turn credit against the replay oracle",
        "| `warm` | `warm/boxed` | 2 × 2 | 3 |",
        "| `ppo` | `ppo/seed-0` | 2 × 2 | 3 |",
        "Spearman's ρ of each estimator",
        "Sign agreement on the decisive turns",
        "- ppo left out: needs a trained critic",
        "shuffles of the estimator's advantages",
    ] {
        assert!(
            report.contains(section),
            "report.md lacks {section:?}:\n{report}"
        );
    }
    let a = &json["audits"];
    assert_eq!(a["warm"]["run"], "warm/boxed");
    assert!(a["warm"]["skipped"]["ppo"].is_string(), "{a}");
    for name in ["grpo", "gigpo", "random"] {
        assert!(a["warm"]["estimators"][name].is_object(), "{name}: {a}");
    }
    // The PPO run's audit reads its critic.
    assert!(a["ppo"]["estimators"]["ppo"].is_object(), "{a}");
    assert_eq!(a["ppo"]["stated_density"].as_f64(), Some(1.0));
    // Run again: nothing left to do.
    let again = ok(&turnwise(&["study", "run", f, "--out", "s"], tmp.path()));
    assert!(again.contains("(5 finished already)"), "{again}");
}

/// `study plan` of the shipped study file `studies/NAME` (which validates it): the plan and the
/// panels it wrote.
fn plan_shipped(name: &str) -> (String, serde_json::Value) {
    let tmp = tempfile::tempdir().unwrap();
    let file = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../studies")
        .join(name);
    let plan = ok(&turnwise(
        &["study", "plan", file.to_str().unwrap(), "--out", "s"],
        tmp.path(),
    ));
    let panels = std::fs::read_to_string(tmp.path().join("s/panel.json")).unwrap();
    (plan, serde_json::from_str(&panels).unwrap())
}

#[test]
fn the_shipped_paper_claims_study_resolves_and_validates() {
    let (plan, panels) = plan_shipped("paper-claims.toml");
    let commands: Vec<&str> = plan.lines().filter(|l| !l.starts_with('#')).collect();
    let warm = commands
        .iter()
        .filter(|l| l.contains("--run warm/"))
        .count();
    assert_eq!((warm, commands.len()), (6, 6 + 25 * 3), "{plan}");
    // The three search-world warm starts ask the same 800 questions, so their arms pair.
    let p = &panels["panels"];
    assert_eq!(p["boxed"]["questions"].as_array().unwrap().len(), 800);
    for ws in ["search_r1", "t2po"] {
        assert_eq!(p[ws]["fingerprint"], p["boxed"]["fingerprint"], "{ws}");
    }
    for (ws, env) in [
        ("two_turn", "two_turn"),
        ("frozen_lake", "frozen_lake"),
        ("sokoban", "sokoban"),
    ] {
        assert_eq!(p[ws]["environment"], env);
    }
}

/// The committed study directory `studies/paper-claims/` keeps its file, panel and report, not
/// its runs: `study report` on it refuses, naming the missing runs and the command that
/// reproduces them, and leaves the report as it is (it used to overwrite it with a report of 0
/// of 81 runs).
#[test]
fn the_committed_study_without_its_runs_refuses_a_report_naming_the_command() {
    let committed = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../studies/paper-claims");
    let tmp = tempfile::tempdir().unwrap();
    let s = tmp.path().join("paper-claims");
    std::fs::create_dir(&s).unwrap();
    for f in [
        "study.toml",
        "panel.json",
        ".turnwise-study",
        "report.md",
        "report.json",
    ] {
        std::fs::copy(committed.join(f), s.join(f)).unwrap();
    }
    let out = turnwise(&["study", "report", "paper-claims"], tmp.path());
    let err = text(&out.stderr);
    assert!(!out.status.success(), "study report succeeded:\n{err}");
    for want in [
        "paper-claims holds none of study \"paper-claims\"'s 81 runs",
        "(warm/boxed, warm/frozen_lake, warm/search_r1 and 78 more:",
        "reproduce the runs with `turnwise study run ",
        "study.toml --out paper-claims`",
    ] {
        assert!(err.contains(want), "{want:?} missing from:\n{err}");
    }
    for f in ["report.md", "report.json"] {
        assert_eq!(
            std::fs::read(s.join(f)).unwrap(),
            std::fs::read(committed.join(f)).unwrap(),
            "{f} was rewritten"
        );
    }
}

/// The shipped world pilot resolves and validates: three worlds, each its own warm start,
/// baseline and panel (three different question sets, so no claim pairs across worlds).
#[test]
fn the_shipped_world_pilot_resolves_and_validates() {
    let (plan, panels) = plan_shipped("world-pilot.toml");
    let commands: Vec<&str> = plan.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(commands.len(), 3 + 6 * 2, "{plan}");
    let p = &panels["panels"];
    let prints: std::collections::BTreeSet<String> = ["w12", "w14", "w24"]
        .iter()
        .map(|w| {
            assert_eq!(p[w]["questions"].as_array().unwrap().len(), 400, "{w}");
            p[w]["fingerprint"].to_string()
        })
        .collect();
    assert_eq!(prints.len(), 3, "{panels}");
}

/// The shipped credit-density study resolves and validates: three decision densities, each
/// its own warm start, baseline and panel; six arms each; an audit per density.
#[test]
fn the_shipped_credit_density_study_resolves_and_validates() {
    let (plan, panels) = plan_shipped("credit-density.toml");
    let commands: Vec<&str> = plan.lines().filter(|l| !l.starts_with('#')).collect();
    let audits = commands
        .iter()
        .filter(|l| l.contains("--run audit/"))
        .count();
    assert_eq!((commands.len(), audits), (3 + 18 * 3 + 3, 3), "{plan}");
    for w in ["rho-1", "rho-0.5", "rho-0.33"] {
        let q = &panels["panels"][w]["questions"];
        assert_eq!(q.as_array().unwrap().len(), 400, "{w}");
    }
}
