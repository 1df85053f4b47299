//! Experiment tracking end to end through the `turnwise` binary: a tiny run leaves TensorBoard
//! event files holding every metrics line (the train metrics included) and logs every line to
//! Weights & Biases through the sidecar (a stand-in `wandb` module on `PYTHONPATH` records the
//! calls), offline with a warning when no API key is found; resuming it starts a new W&B run of
//! the same group with the whole log; and asking for W&B without the `wandb` package stops
//! before the run directory is touched.

mod common;

use std::path::Path;

use common::{event_scalars, metrics_as_scalars};

/// Records each call as a JSON line in `$FAKE_WANDB_LOG`.
const FAKE_WANDB: &str = include_str!("../../turnwise-report/tests/fake_wandb/wandb.py");

fn args(out: &Path, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = ["train", "--preset", "grpo", "--out"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    a.push(out.display().to_string());
    for s in common::tiny_overrides()
        .iter()
        .map(String::as_str)
        .chain(["eval.questions=3"])
        .chain(extra.iter().copied())
    {
        a.push("--set".into());
        a.push(s.into());
    }
    a
}

fn turnwise(args: &[String], env: &[(&str, &Path)]) -> std::process::Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_turnwise"));
    cmd.args(args)
        .env_remove("RUST_LOG")
        .env_remove("WANDB_API_KEY")
        .env_remove("TURNWISE_PYTHON");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("the turnwise binary runs")
}

fn calls(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn a_run_logs_to_tensorboard_and_wandb_and_a_resume_starts_a_new_wandb_run() {
    let tmp = tempfile::tempdir().unwrap();
    let fake = tmp.path().join("fake");
    std::fs::create_dir_all(&fake).unwrap();
    std::fs::write(fake.join("wandb.py"), FAKE_WANDB).unwrap();
    let record = tmp.path().join("calls.jsonl");
    let out = tmp.path().join("run");
    let env = [
        ("PYTHONPATH", fake.as_path()),
        ("FAKE_WANDB_LOG", record.as_path()),
        // No `wandb login` either.
        ("HOME", tmp.path()),
    ];
    let o = turnwise(
        &args(&out, &["run.wandb=online", "run.wandb_project=tw-test"]),
        &env,
    );
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(
        stderr.contains("no WANDB_API_KEY") && stderr.contains("wandb sync"),
        "the offline fallback is said: {stderr}"
    );

    // TensorBoard: one event file, the metrics lines in order, train metrics included.
    let scalars = event_scalars(&out);
    assert_eq!(scalars, metrics_as_scalars(&out));
    let train: Vec<i64> = scalars
        .iter()
        .filter(|s| s.1 == "actor/pg_loss")
        .map(|s| s.0)
        .collect();
    assert_eq!(train, [1, 2], "{scalars:?}");
    assert!(scalars.iter().any(|s| s.1 == "sft/loss"));
    assert!(scalars.iter().any(|s| s.1 == "eval/test/greedy/em"));

    // W&B: one offline run, every line logged with its phase's axis.
    let c = calls(&record);
    assert_eq!(c[0]["call"], "init");
    assert_eq!(c[0]["mode"], "offline");
    assert_eq!(c[0]["project"], "tw-test");
    assert_eq!(c[0]["name"], "run");
    assert_eq!(c[0]["group"], "run");
    assert_eq!(c[0]["job_type"], "train");
    assert_eq!(c[0]["config"]["preset"], "grpo");
    assert_eq!(c.last().unwrap()["call"], "finish");
    let logged: Vec<&serde_json::Value> = c
        .iter()
        .filter(|x| x["call"] == "log")
        .map(|x| &x["data"])
        .collect();
    let lines = turnwise::run::read_metrics(out.join("metrics.jsonl"))
        .unwrap()
        .records;
    assert_eq!(logged.len(), lines.len());
    let step2 = logged
        .iter()
        .find(|d| d["step/train"] == 2)
        .expect("train step 2 logged");
    let (_, _, v, _) = scalars
        .iter()
        .find(|s| s.0 == 2 && s.1 == "actor/pg_loss")
        .unwrap();
    assert_eq!(step2["actor/pg_loss"].as_f64().unwrap() as f32, *v);

    // Resuming the finished run: TensorBoard is rewritten with the same lines, and W&B gets a
    // new run in the same group holding the whole log.
    std::fs::remove_file(&record).unwrap();
    let o = turnwise(&["resume".to_string(), out.display().to_string()], &env);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(event_scalars(&out), scalars);
    let c = calls(&record);
    assert_eq!(c[0]["name"], "run (resumed at step 2)");
    assert_eq!(
        (&c[0]["group"], &c[0]["job_type"]),
        (&"run".into(), &"resume".into())
    );
    assert_eq!(c.iter().filter(|x| x["call"] == "log").count(), lines.len());

    // run.tensorboard = false writes no folder.
    let quiet = tmp.path().join("no-tb");
    let o = turnwise(
        &args(&quiet, &["run.tensorboard=false", "run.steps=1"]),
        &[],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!quiet.join("tensorboard").exists());
}

#[test]
fn wandb_without_its_package_stops_before_the_run_starts() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    // A Python without site packages: no `wandb`, whatever this machine has installed.
    let python = tmp.path().join("python-without-wandb");
    std::fs::write(&python, "#!/bin/sh\nexec python3 -S \"$@\"\n").unwrap();
    std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = tmp.path().join("run");
    let o = turnwise(
        &args(&out, &["run.wandb=offline"]),
        &[("TURNWISE_PYTHON", python.as_path())],
    );
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        stderr.contains("run.wandb")
            && stderr.contains("`wandb` Python package")
            && stderr.contains("No module named 'wandb'")
            && stderr.contains("pip install wandb"),
        "{stderr}"
    );
    assert!(!out.exists(), "the run directory was created");
}
