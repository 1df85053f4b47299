//! Nothing is deleted or replaced that turnwise did not write: the repros of
//! cli-as-a-user-3.md (C1–C4, m12) through the real binary, and a property test that runs the
//! overwrite, resume, export and data commands over folders mixing turnwise's files with
//! random foreign ones and checks that no foreign byte changes.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::OnceLock;

use proptest::prelude::*;

fn tw(args: &[&str], cwd: &Path) -> Output {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    common::turnwise_in(&args, cwd)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `--set` overrides of a run of seconds.
fn tiny_sets() -> Vec<String> {
    let mut sets = common::tiny_overrides();
    sets.extend(["run.save_every=1", "eval.questions=3"].map(String::from));
    sets
}

/// `train`'s arguments for a tiny run (`extra` after the settings).
fn train_args(extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = ["train", "--preset", "grpo"].map(String::from).to_vec();
    for s in tiny_sets() {
        args.push("--set".into());
        args.push(s);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn run_cli(args: &[String], cwd: &Path) -> Output {
    common::turnwise_in(args, cwd)
}

/// Every file under `dir` (relative path, `/`-separated) with its bytes, and every folder
/// (with `None`).
fn snapshot(dir: &Path) -> BTreeMap<String, Option<Vec<u8>>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, Option<Vec<u8>>>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let rel = p
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            if e.file_type().unwrap().is_dir() {
                out.insert(rel, None);
                walk(root, &p, out);
            } else {
                out.insert(rel, Some(std::fs::read(&p).unwrap()));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

/// A tiny run, an export of it and a world, made once per test binary (copied by the tests).
struct Bases {
    run: PathBuf,
    export: PathBuf,
    world: PathBuf,
}

fn bases() -> &'static Bases {
    static BASES: OnceLock<Bases> = OnceLock::new();
    BASES.get_or_init(|| {
        let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
        // Bases of earlier test processes (an hour old at least) go.
        for e in std::fs::read_dir(tmp).into_iter().flatten().flatten() {
            let old = e
                .metadata()
                .ok()
                .and_then(|m| m.modified().ok())
                .is_some_and(|t| {
                    t.elapsed()
                        .is_ok_and(|d| d > std::time::Duration::from_secs(3600))
                });
            if old
                && e.file_name()
                    .to_string_lossy()
                    .starts_with("ownership-bases-")
            {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        let dir = tmp.join(format!("ownership-bases-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let out = run_cli(&train_args(&["--out", "run", "-q"]), &dir);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let out = tw(&["export", "run", "--out", "export"], &dir);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let out = tw(&["data", "world", "--out", "world", "-q"], &dir);
        assert!(out.status.success(), "{}", text(&out.stderr));
        Bases {
            run: dir.join("run"),
            export: dir.join("export"),
            world: dir.join("world"),
        }
    })
}

/// C1: `resume` on a folder that only holds a user's config, metrics and report changes
/// nothing and writes nothing (no marker, no lock, no run), however its metrics look.
#[test]
fn c1_resume_refuses_a_folder_turnwise_did_not_make() {
    let tmp = tempfile::tempdir().unwrap();
    let mut args: Vec<String> = ["config", "--preset", "grpo"].map(String::from).to_vec();
    for s in tiny_sets() {
        args.push("--set".into());
        args.push(s);
    }
    let config = run_cli(&args, tmp.path());
    assert!(config.status.success(), "{}", text(&config.stderr));
    for (name, metrics) in [
        (
            "foreign2",
            "{\"step\":1,\"loss\":0.5}\n{\"step\":2,\"loss\":0.4}\n",
        ),
        ("foreign", "{\"loss\":0.5}\n"),
    ] {
        let dir = tmp.path().join(name);
        write(&dir.join("config.toml"), &config.stdout);
        write(&dir.join("metrics.jsonl"), metrics.as_bytes());
        write(&dir.join("report.md"), b"mine\n");
        let before = snapshot(&dir);
        let out = tw(&["resume", name], tmp.path());
        let err = text(&out.stderr);
        assert!(
            !out.status.success(),
            "{name}: resumed a folder it did not make"
        );
        assert!(
            err.contains(name) && err.contains(".turnwise-manifest.json"),
            "{name}: {err}"
        );
        assert_eq!(snapshot(&dir), before, "{name}: {err}");
        // Nor does `--overwrite` then take it for a run.
        let out = run_cli(
            &train_args(&["--out", name, "--overwrite", "-q"]),
            tmp.path(),
        );
        assert!(!out.status.success());
        assert_eq!(snapshot(&dir), before, "{name}");
    }
}

/// C2: `train --overwrite` on a project folder holding `turnwise config`'s output beside
/// another tool's checkpoints/, wandb/, plots/, samples/, weights/ and report.md deletes
/// nothing.
#[test]
fn c2_overwrite_refuses_a_project_folder_with_another_tools_files() {
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("home");
    let config = tw(&["config", "--preset", "grpo"], tmp.path());
    assert!(config.status.success(), "{}", text(&config.stderr));
    write(&home.join("config.toml"), &config.stdout);
    write(
        &home.join("checkpoints/global_step_100/actor.pt"),
        b"verl weights",
    );
    write(&home.join("wandb/run-1/log"), b"wandb log");
    write(&home.join("plots/fig1.svg"), b"<svg/>");
    write(&home.join("samples/my.jsonl"), b"{}\n");
    write(&home.join("weights/w.bin"), b"w");
    write(&home.join("report.md"), b"thesis notes\n");
    write(&home.join("NOTES.md"), b"notes\n");
    let before = snapshot(&home);
    let out = run_cli(
        &train_args(&[
            "--config",
            "home/config.toml",
            "--out",
            "home",
            "--overwrite",
            "-q",
        ]),
        tmp.path(),
    );
    let err = text(&out.stderr);
    assert!(!out.status.success(), "replaced a folder it did not make");
    assert!(
        err.contains("home") && err.contains(".turnwise-run"),
        "{err}"
    );
    assert_eq!(snapshot(&home), before, "{err}");
}

/// C3: `export --overwrite` and `sft --out … --overwrite` into a folder that holds a user's
/// `turnwise.toml`, `config.json` and `adapter/` (no export turnwise made) delete nothing; an
/// export turnwise made is replaced, but not once the user edited one of its files.
#[test]
fn c3_export_overwrite_replaces_only_an_export_turnwise_made() {
    let b = bases();
    let tmp = tempfile::tempdir().unwrap();
    let proj = tmp.path().join("proj");
    write(&proj.join("adapter/adapter_config.json"), b"x\n");
    write(&proj.join("notes.md"), b"notes\n");
    write(&proj.join("turnwise.toml"), b"[optim]\nlr=1e-4\n");
    write(&proj.join("config.json"), b"{\"my\":\"own hf config\"}\n");
    let before = snapshot(&proj);
    let run = b.run.to_str().unwrap();
    let out = tw(&["export", run, "--out", "proj", "--overwrite"], tmp.path());
    let err = text(&out.stderr);
    assert!(!out.status.success(), "replaced a folder that is no export");
    assert!(err.contains("proj"), "{err}");
    assert_eq!(snapshot(&proj), before, "{err}");
    let out = run_cli(
        &train_args(&["--out", "proj", "--overwrite", "-q"])
            .into_iter()
            .map(|a| if a == "train" { "sft".into() } else { a })
            .collect::<Vec<_>>(),
        tmp.path(),
    );
    let err = text(&out.stderr);
    assert!(
        !out.status.success(),
        "sft replaced a folder that is no export"
    );
    assert_eq!(snapshot(&proj), before, "{err}");

    // An export turnwise made: refused without --overwrite, replaced with it (the user's own
    // file beside it kept), refused once one of its files was edited.
    common::copy_dir(&b.export, &tmp.path().join("exp"));
    let out = tw(&["export", run, "--out", "exp"], tmp.path());
    assert!(!out.status.success());
    write(&tmp.path().join("exp/mine.txt"), b"mine");
    let out = tw(&["export", run, "--out", "exp", "--overwrite"], tmp.path());
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        std::fs::read(tmp.path().join("exp/mine.txt")).unwrap(),
        b"mine"
    );
    assert!(tmp.path().join("exp/model.safetensors").is_file());
    write(&tmp.path().join("exp/config.json"), b"{\"edited\": true}\n");
    let before = snapshot(&tmp.path().join("exp"));
    let out = tw(&["export", run, "--out", "exp", "--overwrite"], tmp.path());
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("config.json"), "{err}");
    assert_eq!(snapshot(&tmp.path().join("exp")), before);
}

/// C4: `data world --out` refuses a folder that holds any of the files it writes (Search-R1's
/// own names), with or without `--overwrite` when turnwise did not write them; a world it
/// wrote is replaced only with `--overwrite`.
#[test]
fn c4_data_world_never_replaces_files_it_did_not_write() {
    let tmp = tempfile::tempdir().unwrap();
    let mydata = tmp.path().join("mydata");
    for f in ["train.jsonl", "test.jsonl", "corpus.jsonl"] {
        write(
            &mydata.join(f),
            format!("{{\"mine\": \"{f}\"}}\n").as_bytes(),
        );
    }
    let before = snapshot(&mydata);
    for extra in [None, Some("--overwrite")] {
        let mut args = vec!["data", "world", "--out", "mydata"];
        args.extend(extra);
        let out = tw(&args, tmp.path());
        let err = text(&out.stderr);
        assert!(
            !out.status.success(),
            "{extra:?}: overwrote the user's data"
        );
        assert!(err.contains("train.jsonl"), "{err}");
        assert_eq!(snapshot(&mydata), before, "{err}");
    }
    // A world turnwise wrote: refused without --overwrite, replaced with it.
    let out = tw(&["data", "world", "--out", "w", "-q"], tmp.path());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = tw(
        &["data", "world", "--out", "w", "--seed", "3", "-q"],
        tmp.path(),
    );
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--overwrite"),
        "{}",
        text(&out.stderr)
    );
    let out = tw(
        &[
            "data",
            "world",
            "--out",
            "w",
            "--seed",
            "3",
            "--overwrite",
            "-q",
        ],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    // `data wiki --out FILE` refuses an existing file without --overwrite (before fetching
    // anything).
    write(&tmp.path().join("wiki.jsonl"), b"mine\n");
    let out = tw(&["data", "wiki", "--out", "wiki.jsonl"], tmp.path());
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("wiki.jsonl") && err.contains("--overwrite"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(tmp.path().join("wiki.jsonl")).unwrap(),
        b"mine\n"
    );
    // A non-empty folder holding none of its files is written into, without a manifest.
    write(&tmp.path().join("w2/other.txt"), b"mine");
    let out = tw(&["data", "world", "--out", "w2", "-q"], tmp.path());
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(!tmp.path().join("w2/.turnwise-manifest.json").exists());
    assert_eq!(
        std::fs::read(tmp.path().join("w2/other.txt")).unwrap(),
        b"mine"
    );
}

/// m12: `index --out` refuses a non-empty folder (it would write its files among the user's).
#[test]
fn m12_index_refuses_a_non_empty_folder() {
    let b = bases();
    let tmp = tempfile::tempdir().unwrap();
    write(&tmp.path().join("mydir/notes.txt"), b"mine");
    let before = snapshot(&tmp.path().join("mydir"));
    let corpus = b.world.join("corpus.jsonl");
    let corpus = corpus.to_str().unwrap();
    let out = tw(&["index", "--corpus", corpus, "--out", "mydir"], tmp.path());
    let err = text(&out.stderr);
    assert!(!out.status.success(), "indexed into a non-empty folder");
    assert!(err.contains("mydir") && err.contains("not empty"), "{err}");
    assert_eq!(snapshot(&tmp.path().join("mydir")), before);
    let out = tw(&["index", "--corpus", corpus, "--out", "fresh"], tmp.path());
    assert!(out.status.success(), "{}", text(&out.stderr));
}

/// A run of an earlier turnwise (its `.turnwise-run` marker, no manifest) still resumes,
/// writing no manifest; its `--overwrite` deletes only turnwise's exact layout, and refuses,
/// naming it, a folder of another tool's inside `checkpoints/`.
#[test]
fn runs_of_earlier_versions_resume_and_are_replaced_by_their_layout() {
    let b = bases();
    let tmp = tempfile::tempdir().unwrap();
    let old = tmp.path().join("old");
    common::copy_dir(&b.run, &old);
    std::fs::remove_file(old.join(".turnwise-manifest.json")).unwrap();
    std::fs::remove_dir_all(old.join("checkpoints/step-00002")).unwrap();
    std::fs::remove_file(old.join("summary.json")).unwrap();
    write(&old.join("NOTES.md"), b"mine");
    let out = tw(&["resume", "old", "-q"], tmp.path());
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(old.join("summary.json").is_file());
    assert!(!old.join(".turnwise-manifest.json").exists());
    assert_eq!(std::fs::read(old.join("NOTES.md")).unwrap(), b"mine");

    write(&old.join("checkpoints/global_step_100/actor.pt"), b"verl");
    let before = snapshot(&old);
    let out = run_cli(
        &train_args(&["--out", "old", "--overwrite", "-q"]),
        tmp.path(),
    );
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("checkpoints/global_step_100"), "{err}");
    // Nothing changed but the lock file the refusal took.
    let mut after = snapshot(&old);
    after.insert("run.lock".into(), before["run.lock"].clone());
    assert_eq!(after, before, "{err}");

    std::fs::remove_dir_all(old.join("checkpoints/global_step_100")).unwrap();
    let out = run_cli(
        &train_args(&["--out", "old", "--overwrite", "-q"]),
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(std::fs::read(old.join("NOTES.md")).unwrap(), b"mine");
    assert!(old.join(".turnwise-manifest.json").is_file());
}

/// A study folder records what the study writes: `study report` replaces its own report, but
/// refuses, naming it, a report.md the user wrote over it.
#[test]
fn a_study_replaces_only_its_own_report() {
    let tmp = tempfile::tempdir().unwrap();
    let study = r#"
name = "tiny"
seeds = [0]
baseline = "grpo"
sets = ["task.world.countries=4", "task.world.cities=8", "task.world.companies=6",
  "task.world.persons=16", "task.world.questions.train=40",
  "task.world.questions.validation=8", "task.world.questions.test=8",
  "model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
  "model.intermediate_size=64"]
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
"#;
    write(&tmp.path().join("s.toml"), study.as_bytes());
    let out = tw(&["study", "plan", "s.toml", "--out", "st"], tmp.path());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let manifest = std::fs::read_to_string(tmp.path().join("st/.turnwise-manifest.json")).unwrap();
    assert!(
        manifest.contains("study.toml") && manifest.contains("panel.json"),
        "{manifest}"
    );
    for _ in 0..2 {
        let out = tw(&["study", "report", "st"], tmp.path());
        assert!(out.status.success(), "{}", text(&out.stderr));
    }
    write(&tmp.path().join("st/report.md"), b"my notes\n");
    let out = tw(&["study", "report", "st"], tmp.path());
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("report.md"), "{err}");
    assert_eq!(
        std::fs::read(tmp.path().join("st/report.md")).unwrap(),
        b"my notes\n"
    );
}

/// Names a user's files could have, turnwise's own among them.
const NAMES: &[&str] = &[
    "checkpoints",
    "metrics.jsonl",
    "report.md",
    "turnwise.toml",
    "config.json",
    "adapter",
    "step-00002",
    "train.jsonl",
    "samples",
    "plots",
    "notes.md",
    "tensorboard",
    "summary.json",
    "corpus.jsonl",
    "model.safetensors",
    "step-00001.jsonl",
    "world.json",
    "evals",
];

/// Adds the foreign files `files` (paths of 1–3 names, random bytes) to `dir` where the path is
/// free (a new file, possibly in new folders); returns those added.
fn add_foreign(dir: &Path, files: &[(Vec<usize>, Vec<u8>)]) -> BTreeMap<String, Vec<u8>> {
    let mut added = BTreeMap::new();
    for (parts, bytes) in files {
        let rel: Vec<&str> = parts.iter().map(|&i| NAMES[i]).collect();
        let path = rel.iter().fold(dir.to_path_buf(), |p, n| p.join(n));
        // Free: nothing there, and no file where a folder of the path would go.
        let mut blocked = path.exists();
        let mut p = dir.to_path_buf();
        for n in &rel[..rel.len() - 1] {
            p = p.join(n);
            blocked |= p.exists() && !p.is_dir();
        }
        if blocked {
            continue;
        }
        let mut content = b"foreign:".to_vec();
        content.extend(bytes);
        write(&path, &content);
        added.insert(rel.join("/"), content);
    }
    added
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    /// Over folders holding turnwise's files (a run, a run killed after step 1, an export, a
    /// world) and random foreign files, `train --overwrite`, `resume` (of a finished run, and of
    /// the killed one, which cuts its log and samples back to its checkpoint), `export
    /// --overwrite` and `data world` (with and without `--overwrite`) either succeed or refuse
    /// naming a path, and no foreign byte changes.
    #[test]
    fn no_foreign_byte_changes(
        command in 0..6usize,
        files in prop::collection::vec(
            (prop::collection::vec(0..NAMES.len(), 1..4), prop::collection::vec(any::<u8>(), 0..32)),
            1..6,
        ),
    ) {
        let b = bases();
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("t");
        let base = match command {
            0 | 1 | 5 => &b.run,
            2 => &b.export,
            _ => &b.world,
        };
        common::copy_dir(base, &target);
        if command == 5 {
            // Killed after the checkpoint of step 1: the resume redoes step 2.
            std::fs::remove_dir_all(target.join("checkpoints/step-00002")).unwrap();
            std::fs::remove_file(target.join("summary.json")).unwrap();
        }
        let foreign = add_foreign(&target, &files);
        let run = b.run.to_str().unwrap().to_string();
        let args: Vec<String> = match command {
            0 => train_args(&["--out", "t", "--overwrite", "-q"]),
            1 | 5 => vec!["resume".into(), "t".into(), "-q".into()],
            2 => vec!["export".into(), run, "--out".into(), "t".into(), "--overwrite".into()],
            3 => ["data", "world", "--out", "t", "--overwrite", "-q"].map(String::from).to_vec(),
            _ => ["data", "world", "--out", "t", "-q"].map(String::from).to_vec(),
        };
        let out = run_cli(&args, tmp.path());
        let err = text(&out.stderr);
        for (rel, bytes) in &foreign {
            let now = std::fs::read(target.join(rel)).ok();
            prop_assert_eq!(now.as_ref(), Some(bytes), "{} changed: {:?}\n{}", rel, args, err);
        }
        if !out.status.success() {
            prop_assert!(
                err.contains("refusing") && (foreign.keys().any(|rel| err.contains(rel.as_str())) || err.contains("t/")),
                "{:?} failed without naming a path: {}", args, err
            );
        } else if command == 5 {
            prop_assert!(target.join("summary.json").is_file());
        }
    }
}
