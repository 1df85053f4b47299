//! Compatibility: a run directory written before issue 34's refactor
//! (`tests/fixtures/compat/a2tgpo-step2`, by commit 27c7878; its README says how) must stay
//! readable by every later version. Its config parses and resolves, `runs`, `report` and `view`
//! read its metrics and samples, its checkpoint holds the logged parameter count and evaluates
//! to the figures stored beside it, and `resume` continues it to the step the uninterrupted run
//! logged. Each test works on a copy in a temporary directory: the fixture is never written.
//!
//! `TURNWISE_BLESS=1` rewrites `expected/` from what the code computes now (for a change that
//! alters training or evaluation on purpose), with the class of CPU it ran on (`cpu-class`:
//! AVX-512 and AVX2 round a training step differently, so the resumed step is compared bit for
//! bit on that class and by shape on others); the fixture itself is never regenerated.

mod common;

use std::path::{Path, PathBuf};

use serde_json::Value;
use turnwise::config::TrainConfig;

/// The committed fixture: an A2TGPO run of 3 steps, killed after step 2.
fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/compat/a2tgpo-step2")
}

/// What today's code computes from the fixture (`TURNWISE_BLESS=1` rewrites it).
fn expected(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/compat/expected")
        .join(name)
}

fn bless() -> bool {
    std::env::var_os("TURNWISE_BLESS").is_some()
}

/// The class of CPU whose rounding a training step carries: the matrix products (the `gemm`
/// crate) and the sampling kernels pick AVX-512 or AVX2 code at run time, and the two sum in
/// other orders. A resumed training step equals the uninterrupted run's bit for bit on the
/// class of CPU it was recorded on (`expected/cpu-class`), not on another.
fn cpu_class() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return "x86_64-avx512".into();
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return "x86_64-avx2".into();
        }
    }
    std::env::consts::ARCH.into()
}

/// Whether the expected training figures were recorded on this class of CPU.
fn recorded_here() -> bool {
    std::fs::read_to_string(expected("cpu-class")).is_ok_and(|c| c.trim() == cpu_class())
}

/// `got` has `want`'s shape: the same keys at every level, and a finite number wherever `want`
/// has a number (what a resumed step must give on any CPU).
fn assert_same_shape(what: &str, got: &[Value], want: &[Value]) {
    fn walk(what: &str, g: &Value, w: &Value, path: &str) {
        match (g, w) {
            (Value::Object(a), Value::Object(b)) => {
                let (ka, kb): (Vec<_>, Vec<_>) = (a.keys().collect(), b.keys().collect());
                assert_eq!(ka, kb, "{what}: keys at {path:?}");
                for (k, v) in b {
                    walk(what, &a[k], v, &format!("{path}/{k}"));
                }
            }
            (Value::Number(a), Value::Number(_)) => {
                assert!(
                    a.as_f64().is_some_and(f64::is_finite),
                    "{what}: {path} = {a}"
                );
            }
            (Value::Array(a), Value::Array(b)) if path.ends_with("ids") => {
                assert!(!a.is_empty() || b.is_empty(), "{what}: {path} is empty");
            }
            _ => assert_eq!(
                std::mem::discriminant(g),
                std::mem::discriminant(w),
                "{what}: type at {path}"
            ),
        }
    }
    assert_eq!(got.len(), want.len(), "{what}: number of lines");
    for (g, w) in got.iter().zip(want) {
        walk(what, g, w, "");
    }
}

/// A copy of the fixture as `<tmp>/run` (the fixture is never written).
fn copy_of_fixture() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    common::copy_dir(&fixture(), &run);
    (tmp, run)
}

/// Runs `turnwise args…` in `cwd`; panics with its stderr when it fails. Returns stdout.
fn turnwise(args: &[&str], cwd: &Path) -> String {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let out = common::turnwise_in(&args, cwd);
    assert!(
        out.status.success(),
        "turnwise {} failed on the compatibility fixture:\n{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The JSON lines of `path`, each parsed.
fn json_lines(path: &Path) -> Vec<Value> {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    text.lines()
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("{} line {}: {e}", path.display(), i + 1))
        })
        .collect()
}

/// `v` without its wall-clock keys (`time`, `timing_s/*`, `perf/throughput`), which differ run
/// to run.
fn without_clock(mut v: Value) -> Value {
    if let Some(o) = v.as_object_mut() {
        o.retain(|k, _| !common::wall_clock(k));
    }
    v
}

/// The first place (`path`, got, want) where `got` and `want` differ, or `None`.
fn first_difference(got: &Value, want: &Value, path: &str) -> Option<(String, String, String)> {
    match (got, want) {
        (Value::Object(g), Value::Object(w)) => {
            for k in w.keys().chain(g.keys()) {
                let sub = format!("{path}/{k}");
                match (g.get(k), w.get(k)) {
                    (Some(a), Some(b)) => {
                        if let Some(d) = first_difference(a, b, &sub) {
                            return Some(d);
                        }
                    }
                    (a, b) => return Some((sub, format!("{a:?}"), format!("{b:?}"))),
                }
            }
            None
        }
        (Value::Array(g), Value::Array(w)) if g.len() == w.len() => g
            .iter()
            .zip(w)
            .enumerate()
            .find_map(|(i, (a, b))| first_difference(a, b, &format!("{path}[{i}]"))),
        // serde_json parses floats to within an ulp or two of the written value (without its
        // float_roundtrip feature), so a figure written, read and written again can move in its
        // last digit: equal within 4 ulps is the same figure.
        (Value::Number(g), Value::Number(w)) if g.is_f64() || w.is_f64() => {
            let (a, b) = (g.as_f64().unwrap(), w.as_f64().unwrap());
            let close = a == b || (a - b).abs() <= 4.0 * f64::EPSILON * a.abs().max(b.abs());
            (!close).then(|| (path.to_string(), got.to_string(), want.to_string()))
        }
        _ if got == want => None,
        _ => Some((path.to_string(), got.to_string(), want.to_string())),
    }
}

/// Asserts `got` equals `want` line by line, naming the first differing line and key.
fn assert_same_lines(what: &str, got: &[Value], want: &[Value]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if let Some((key, a, b)) = first_difference(g, w, "") {
            panic!("{what}: line {} differs at {key}: got {a}, want {b}", i + 1);
        }
    }
    assert_eq!(got.len(), want.len(), "{what}: number of lines");
}

/// The fixture's metrics line of `phase` at `step` whose keys start with `prefix`.
fn metrics_line(run: &Path, step: u64, phase: &str, prefix: &str) -> Value {
    json_lines(&run.join("metrics.jsonl"))
        .into_iter()
        .find(|v| {
            v["step"] == step
                && v["phase"] == phase
                && v.as_object().unwrap().keys().any(|k| k.starts_with(prefix))
        })
        .unwrap_or_else(|| panic!("no {phase} line with {prefix}* at step {step}"))
}

#[test]
fn its_config_parses_and_resolves() {
    let (_tmp, run) = copy_of_fixture();
    let text = std::fs::read_to_string(run.join("config.toml")).unwrap();
    let cfg = TrainConfig::from_table(text.parse::<toml::Table>().unwrap())
        .expect("the stored config.toml parses as resume reads it");
    assert_eq!(cfg.preset, "a2tgpo");
    assert_eq!(cfg.seed, 0);
    assert_eq!(cfg.run.steps, 3);
    assert_eq!(cfg.model.hidden_size, 32);
    assert_eq!(
        (cfg.rollout.prompts_per_step, cfg.rollout.group_size),
        (2, 8)
    );
    // 16 rollouts in mini-batches of 2: the preset's 8 optimizer steps per batch.
    assert_eq!(cfg.update_structure(), (8, 7));
    // The dry run makes every check a run makes on its config.
    let stdout = turnwise(
        &[
            "config",
            "--config",
            run.join("config.toml").to_str().unwrap(),
        ],
        &run,
    );
    assert!(
        stdout.starts_with(
            "# resolved config of preset \"a2tgpo\": 8 optimizer steps per rollout batch \
             (7 off-policy)"
        ),
        "{stdout}"
    );
}

#[test]
fn runs_report_and_view_read_its_metrics_and_samples() {
    let (tmp, run) = copy_of_fixture();

    // `runs`: a run stopped at step 2 of 3, its checkpoint, training figures of its last steps
    // and the test EM before RL.
    let listing = turnwise(&["runs", tmp.path().to_str().unwrap()], tmp.path());
    let row = listing
        .lines()
        .find(|l| l.contains("a2tgpo"))
        .unwrap_or_else(|| panic!("no a2tgpo row in\n{listing}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    for want in ["step", "2/3", "0.031", "-0.469", "12.5", "->", "-"] {
        assert!(cells.contains(&want), "{want:?} missing from {row:?}");
    }

    // `report`: report.md and the plots, from metrics.jsonl.
    turnwise(&["-q", "report", run.to_str().unwrap()], tmp.path());
    let report = std::fs::read_to_string(run.join("report.md")).unwrap();
    for want in [
        "59 metrics lines (eval ×6, sft ×50, timing ×1, train ×2).",
        "Last training step: 2.",
    ] {
        assert!(report.contains(want), "{want:?} missing from report.md");
    }
    let row = |key: &str| {
        report
            .lines()
            .find(|l| l.contains(&format!("`{key}`")))
            .unwrap_or_else(|| panic!("no {key} row in report.md"))
            .to_string()
    };
    let reward = row("critic/score/mean");
    assert!(
        reward.contains("-0.6875 (step 1)") && reward.contains("-0.2500 (step 2)"),
        "{reward}"
    );
    // A2TGPO's mechanism: its adaptive clip scale.
    let clip = row("a2tgpo/clip_scale/max");
    assert!(
        clip.contains("1.232 (step 1)") && clip.contains("1.219 (step 2)"),
        "{clip}"
    );
    assert!(run.join("plots/reward.svg").is_file());

    // The samples of step 2: four episodes of one prompt.
    let samples = json_lines(&run.join("samples/step-00002.jsonl"));
    let ids: Vec<&str> = samples.iter().map(|s| s["id"].as_str().unwrap()).collect();
    assert_eq!(
        ids,
        [
            "s2-train_18-0",
            "s2-train_18-1",
            "s2-train_18-2",
            "s2-train_18-3"
        ]
    );
    assert_eq!(
        samples[0]["prompt_text"],
        "<|im_start|> Which country was Nalekcor Linri born in? <|im_end|>"
    );
    assert_eq!(samples[0]["group"]["size"], 8);

    // `view`: the page of step 2 shows those episodes.
    let page = tmp.path().join("step-2.html");
    turnwise(
        &[
            "-q",
            "view",
            run.to_str().unwrap(),
            "--step",
            "2",
            "--out",
            page.to_str().unwrap(),
        ],
        tmp.path(),
    );
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(html.contains("Which country was Nalekcor Linri born in?"));
    for id in ids {
        assert!(html.contains(id), "{id} missing from the page");
    }
}

/// The number of parameters in a safetensors file, from its header.
fn safetensors_parameters(path: &Path) -> u64 {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(_, t)| {
            t["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .product::<u64>()
        })
        .sum()
}

#[test]
fn its_checkpoint_loads_and_evaluates_to_the_stored_figures() {
    let (tmp, run) = copy_of_fixture();
    let ck = run.join("checkpoints/step-00002");
    // The parameters the run logged, in the checkpoint's weights.
    let timing = metrics_line(&run, 0, "timing", "model/");
    assert_eq!(timing["model/parameters"], 22944.0);
    assert_eq!(safetensors_parameters(&ck.join("model.safetensors")), 22944);
    let state: Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join("trainer_state.json")).unwrap())
            .unwrap();
    assert_eq!(state["extra"]["rl_step"], 2);

    for split in ["validation", "test"] {
        let dump = tmp.path().join(format!("{split}.jsonl"));
        let stdout = turnwise(
            &[
                "-q",
                "eval",
                "--run",
                run.to_str().unwrap(),
                "--checkpoint",
                ck.to_str().unwrap(),
                "--split",
                split,
                "--questions",
                "8",
                "--dump",
                dump.to_str().unwrap(),
            ],
            tmp.path(),
        );
        let got: Value = serde_json::from_str(&stdout).expect("eval prints JSON");
        let path = expected(&format!("eval-{split}-greedy-step-00002.json"));
        if bless() {
            std::fs::write(&path, serde_json::to_string_pretty(&got).unwrap() + "\n").unwrap();
        }
        let want: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_same_lines(&format!("eval --split {split}"), &[got], &[want]);
        // The episodes' answers.
        let answers: Vec<Value> = json_lines(&dump)
            .iter()
            .map(|e| e["answer"].clone())
            .collect();
        assert_eq!(answers.len(), 8, "{split}: dumped episodes");
        if split == "validation" {
            // The run evaluated this checkpoint on the same questions at step 2.
            let logged: Vec<Value> =
                json_lines(&run.join("evals/validation-greedy-step-00002.jsonl"))
                    .iter()
                    .map(|e| e["answer"].clone())
                    .collect();
            assert_eq!(
                answers, logged,
                "greedy answers against the run's own at step 2"
            );
        }
    }
    // On the test split the checkpoint answers one question of eight (the figures are in the
    // expected file; this one is here to read).
    let test: Value = serde_json::from_str(
        &std::fs::read_to_string(expected("eval-test-greedy-step-00002.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(test["em"], 0.125);
}

#[test]
fn resume_continues_it_to_the_logged_step_3() {
    let (tmp, run) = copy_of_fixture();
    let before = json_lines(&run.join("metrics.jsonl"));
    assert_eq!(before.len(), 59);
    turnwise(&["-q", "resume", run.to_str().unwrap()], tmp.path());

    let after = json_lines(&run.join("metrics.jsonl"));
    assert!(after.len() > before.len(), "resume logged nothing");
    // What the run had logged stays as it was.
    assert_same_lines(
        "metrics.jsonl up to step 2",
        &after[..before.len()],
        &before,
    );
    // The train line carries verl's names (cli-as-a-user-3 m14): prompt lengths, the longest
    // and shortest response and the share at the budget, the rewards as the estimator gets
    // them, the throughput and the actor's update time.
    let train = after[before.len()..]
        .iter()
        .find(|l| l["phase"] == "train")
        .expect("the resumed train line");
    let f = |k: &str| {
        train[k]
            .as_f64()
            .unwrap_or_else(|| panic!("{k} missing from {train}"))
    };
    for key in [
        "prompt_length",
        "response_length",
        "critic/rewards",
        "critic/score",
    ] {
        assert!(
            f(&format!("{key}/min")) <= f(&format!("{key}/mean"))
                && f(&format!("{key}/mean")) <= f(&format!("{key}/max")),
            "{key}: {train}"
        );
    }
    assert!(f("prompt_length/min") > 0.0);
    assert!((0.0..=1.0).contains(&f("response_length/clip_ratio")));
    assert!(f("perf/throughput") > 0.0);
    assert!(f("timing_s/update_actor") <= f("timing_s/update"));
    let resumed: Vec<Value> = after[before.len()..]
        .iter()
        .cloned()
        .map(without_clock)
        .collect();
    let samples = json_lines(&run.join("samples/step-00003.jsonl"));
    if bless() {
        let lines = |v: &[Value]| -> String {
            v.iter()
                .map(|l| serde_json::to_string(l).unwrap() + "\n")
                .collect()
        };
        std::fs::write(expected("resumed-step-00003.jsonl"), lines(&resumed)).unwrap();
        std::fs::write(expected("samples-step-00003.jsonl"), lines(&samples)).unwrap();
        std::fs::write(expected("cpu-class"), cpu_class() + "\n").unwrap();
    }
    // Step 3 and the evaluations after RL, as the uninterrupted run logged them.
    let want: Vec<Value> = json_lines(&expected("resumed-step-00003.jsonl"))
        .into_iter()
        .map(without_clock)
        .collect();
    let phases: Vec<&str> = want.iter().map(|v| v["phase"].as_str().unwrap()).collect();
    assert_eq!(phases, ["train", "eval", "eval", "eval", "eval", "gain"]);
    let want_samples = json_lines(&expected("samples-step-00003.jsonl"));
    if recorded_here() {
        assert_same_lines("metrics.jsonl after resuming", &resumed, &want);
        assert_same_lines("samples/step-00003.jsonl", &samples, &want_samples);
    } else {
        // Another class of CPU rounds the step otherwise (and may sample other tokens from
        // there on): the resumed step still logs every figure, finite, and every sample.
        eprintln!(
            "expected/ was recorded on {}, this is {}: comparing the resumed step's shape only",
            std::fs::read_to_string(expected("cpu-class"))
                .unwrap_or_default()
                .trim(),
            cpu_class()
        );
        assert_same_shape("metrics.jsonl after resuming", &resumed, &want);
        assert_eq!(samples.len(), want_samples.len(), "samples of step 3");
    }
    assert!(run.join("checkpoints/step-00003/COMPLETE").is_file());
    assert!(run.join("summary.json").is_file());
}

#[test]
fn eval_warns_when_preset_or_config_change_the_checkpoints_world() {
    // Review cli-as-a-user-3 m6: `eval --checkpoint X --preset P` silently evaluated on P's
    // world instead of the one X was trained on.
    let (tmp, run) = copy_of_fixture();
    let ck = run.join("checkpoints/step-00002");
    let config = run.join("config.toml");
    let eval = |sets: &[&str]| {
        let mut args: Vec<String> = [
            "-q",
            "eval",
            "--checkpoint",
            ck.to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
            "--questions",
            "1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        for s in sets {
            args.extend(["--set".to_string(), s.to_string()]);
        }
        let out = common::turnwise_in(&args, tmp.path());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let same = eval(&[]);
    assert!(!same.contains("world"), "{same}");
    let other = eval(&["task.world.questions.test=4"]);
    assert!(
        other.contains("its world differs") && other.contains("task.world.questions.test"),
        "{other}"
    );
}
