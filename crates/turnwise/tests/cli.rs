//! The command line as a user meets it: a dry run of the config, refusals that name their
//! flag, no colour codes in pipes, one line per RL step in logs, `-q` quiet, errors printed once.

mod common;

use std::path::Path;
use std::process::{Command, Output};

fn turnwise(args: &[&str], cwd: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_turnwise"))
        .args(args)
        .current_dir(cwd)
        .env_remove("NO_COLOR")
        .env_remove("RUST_LOG")
        .output()
        .expect("the turnwise binary runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn config_prints_the_resolved_config_and_checks_it() {
    let tmp = tempfile::tempdir().unwrap();
    let out = turnwise(
        &["config", "--preset", "grpo", "--set", "optim.lr=2e-4"],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.starts_with("# resolved config of preset \"grpo\": 2 optimizer steps"));
    let table: toml::Table = stdout.parse().expect("the dry run prints TOML");
    assert_eq!(table["preset"].as_str(), Some("grpo"));
    assert_eq!(table["optim"]["lr"].as_float(), Some(2e-4));
    // One optimizer step (a single mini-batch of every rollout) is "1 optimizer step".
    let out = turnwise(
        &[
            "config",
            "--preset",
            "grpo",
            "--set",
            "optim.mini_batch_size=0",
        ],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).starts_with(
            "# resolved config of preset \"grpo\": 1 optimizer step per rollout batch"
        ),
        "{}",
        text(&out.stdout)
    );

    let out = turnwise(
        &["config", "--preset", "grpo", "--set", "optim.beta1=1.5"],
        tmp.path(),
    );
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("optim.beta1"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn config_refuses_what_the_estimator_refuses_and_lists_every_bad_key() {
    // GiGPO's and T2PO's estimator refuse a similarity threshold of 1 at their first advantage
    // step; `config` refuses it first, naming the key, through the estimator's own check.
    let tmp = tempfile::tempdir().unwrap();
    for preset in ["gigpo", "t2po"] {
        let out = turnwise(
            &[
                "config",
                "--preset",
                preset,
                "--set",
                "advantage.enable_similarity=true",
                "--set",
                "advantage.similarity_thresh=1.0",
            ],
            tmp.path(),
        );
        assert!(!out.status.success(), "{preset}");
        let err = text(&out.stderr);
        assert!(
            err.contains("config field `advantage.similarity_thresh`: must be in (0, 1)"),
            "{preset}: {err}"
        );
    }
    // Three bad keys in three sections: each on its own line, in one run.
    let out = turnwise(
        &[
            "config",
            "--preset",
            "grpo",
            "--set",
            "optim.beta1=1.5",
            "--set",
            "advantage.epsilon=-1",
            "--set",
            "rollout.group_size=0",
        ],
        tmp.path(),
    );
    assert!(!out.status.success());
    let err = text(&out.stderr);
    for key in ["optim.beta1", "advantage.epsilon", "rollout.group_size"] {
        assert_eq!(
            err.lines()
                .filter(|l| l.contains(&format!("config field `{key}`")))
                .count(),
            1,
            "{key}: {err}"
        );
    }
}

#[test]
fn config_makes_the_checks_that_need_the_task() {
    // The review's two settings that passed `config` and failed only after `--overwrite` had
    // deleted the old run.
    let tmp = tempfile::tempdir().unwrap();
    for (set, want) in [
        ("task.world.questions.train=0", "no demonstrations"),
        ("eval.base_shots=[5000]", "eval.base_shots = 5000"),
        ("model.init_from=\"/nonexistent/model\"", "does not exist"),
    ] {
        let out = turnwise(&["config", "--preset", "grpo", "--set", set], tmp.path());
        assert!(!out.status.success(), "{set}");
        assert!(
            text(&out.stderr).contains(want),
            "{set}: {}",
            text(&out.stderr)
        );
    }
}

#[test]
fn config_refuses_the_vocabulary_sizes_train_refuses() {
    // Review cli-as-a-user-3 m1: `config` passed `model.vocab_size=1`, which `train` refuses
    // when it trains the tokenizer. Both now give the same message, and `config` writes nothing.
    let tmp = tempfile::tempdir().unwrap();
    for sets in [
        &["model.vocab_size=1"][..],
        &["model.tokenizer=\"bpe\"", "model.vocab_size=100"][..],
    ] {
        let mut args = vec!["config", "--preset", "grpo"];
        for s in sets {
            args.extend(["--set", s]);
        }
        let config = turnwise(&args, tmp.path());
        assert!(!config.status.success(), "{sets:?}: config accepted it");
        let config_err = text(&config.stderr);
        assert!(config_err.contains("vocab_size"), "{sets:?}: {config_err}");
        assert!(
            std::fs::read_dir(tmp.path()).unwrap().next().is_none(),
            "config wrote a file"
        );

        args[0] = "train";
        args.extend(["--out", "run", "-q"]);
        let train = turnwise(&args, tmp.path());
        assert!(!train.status.success(), "{sets:?}: train accepted it");
        let train_err = text(&train.stderr);
        let message = config_err
            .lines()
            .find(|l| l.contains("vocab_size"))
            .unwrap();
        assert!(
            train_err.contains(message),
            "{sets:?}: config said {config_err:?}, train said {train_err:?}"
        );
        assert!(!tmp.path().join("run").exists(), "train wrote a run");
    }
}

#[test]
fn train_overwrite_never_deletes_a_project_folder() {
    // The review's reproduction: a folder with a config.toml that is not a run's.
    let tmp = tempfile::tempdir().unwrap();
    let proj = tmp.path().join("proj");
    std::fs::create_dir_all(proj.join("src")).unwrap();
    std::fs::write(proj.join("config.toml"), "baseURL=\"x\"\n").unwrap();
    std::fs::write(proj.join("thesis.tex"), "thesis").unwrap();
    std::fs::write(proj.join("src/main.py"), "code").unwrap();
    let out = turnwise(
        &[
            "train",
            "--preset",
            "grpo",
            "--set",
            "sft.steps=1",
            "--set",
            "run.steps=0",
            "--out",
            "proj",
            "--overwrite",
        ],
        tmp.path(),
    );
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains(".turnwise-run"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(proj.join("thesis.tex")).unwrap(),
        "thesis"
    );
    assert_eq!(
        std::fs::read_to_string(proj.join("src/main.py")).unwrap(),
        "code"
    );
    assert_eq!(
        std::fs::read_to_string(proj.join("config.toml")).unwrap(),
        "baseURL=\"x\"\n"
    );
}

#[test]
fn a_closed_stdout_ends_quietly() {
    // `turnwise presets | head -1`: the reader is gone before the first line is written.
    let tmp = tempfile::tempdir().unwrap();
    for args in [&["presets"][..], &["config", "--preset", "grpo"][..]] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_turnwise"))
            .args(args)
            .current_dir(tmp.path())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let err = text(&out.stderr);
        assert!(out.status.success(), "{args:?}: {:?} {err}", out.status);
        assert!(
            !err.contains("panicked") && !err.contains("Broken pipe"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn quickstart_refuses_an_existing_run_without_overwrite() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("runs/quickstart");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.toml"), "preset = \"grpo\"\n").unwrap();
    let out = turnwise(&["quickstart", "--out", "runs/quickstart"], tmp.path());
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("not empty") && err.contains("--overwrite"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("config.toml")).unwrap(),
        "preset = \"grpo\"\n"
    );
}

#[test]
fn an_io_error_names_its_cause_once() {
    let tmp = tempfile::tempdir().unwrap();
    let out = turnwise(
        &["train", "--config", "nope.toml", "--out", "r"],
        tmp.path(),
    );
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
}

/// The reports that print an error's causes (`{:#}`, as `resume` does for each checkpoint that
/// fails to load) print an I/O cause once: no error type both shows its source in its message
/// and returns it as `source()`.
#[test]
fn an_error_chain_prints_its_io_cause_once() {
    let missing = std::path::Path::new("/nonexistent/turnwise/run");
    for e in [
        anyhow::Error::new(turnwise::run::read_metrics(missing.join("metrics.jsonl")).unwrap_err()),
        anyhow::Error::new(
            turnwise::config::TrainConfig::resolve(None, Some(&missing.join("c.toml")), &[])
                .unwrap_err(),
        ),
        anyhow::Error::new(
            turnwise_model::checkpoint::load_checkpoint(
                missing,
                candle_core::DType::F32,
                &candle_core::Device::Cpu,
            )
            .unwrap_err(),
        ),
    ] {
        let chain = format!("{:#}", e.context("resuming"));
        assert_eq!(
            chain.matches("No such file or directory").count(),
            1,
            "{chain}"
        );
    }
}

/// No `thiserror` variant of the workspace prints a field that is also its `source()` (a field
/// named `source`, or marked `#[source]` or `#[from]`): the cause would be printed twice by
/// every report that walks the chain. The io::Error / serde_json::Error causes are kept in the
/// message, under another name.
#[test]
fn no_error_message_repeats_its_source() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut offenders = Vec::new();
    let mut stack = vec![root.clone()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            if p.is_dir() {
                if name != "target" && !name.starts_with('.') {
                    stack.push(p);
                }
                continue;
            }
            if !name.ends_with(".rs") || !p.components().any(|c| c.as_os_str() == "src") {
                continue;
            }
            let text = std::fs::read_to_string(&p).unwrap();
            let lines: Vec<&str> = text.lines().collect();
            for (i, line) in lines.iter().enumerate() {
                let Some(msg) = line.trim().strip_prefix("#[error(\"") else {
                    continue;
                };
                // The variant: its fields up to the closing `}` or `)` of the next lines.
                let body: Vec<&str> = lines[i + 1..]
                    .iter()
                    .take_while(|l| !l.trim().starts_with("#[error") && l.trim() != "}")
                    .take(12)
                    .copied()
                    .collect();
                let body = body.join("\n");
                let source_field = body.lines().any(|l| l.trim().starts_with("source:"))
                    || body.contains("#[source]");
                let prints_source = msg.contains("{source}") && source_field;
                let prints_from = msg.contains("{0}") && body.contains("#[from]");
                if prints_source || prints_from {
                    offenders.push(format!("{}:{}", p.display(), i + 1));
                }
            }
        }
    }
    assert!(offenders.is_empty(), "{offenders:#?}");
}

#[test]
fn logs_in_a_pipe_have_no_colour_and_one_line_per_rl_step_and_quiet_is_quiet() {
    let tmp = tempfile::tempdir().unwrap();
    let mut args: Vec<String> = ["train", "--preset", "grpo", "--out", "run"]
        .map(String::from)
        .to_vec();
    let mut sets = common::tiny_overrides();
    sets.extend(["run.steps=3", "eval.questions=2"].map(String::from));
    for s in &sets {
        args.push("--set".into());
        args.push(s.clone());
    }
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = turnwise(&refs, tmp.path());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(!err.contains('\u{1b}'), "colour codes in a pipe: {err}");
    for step in 1..=3 {
        let mark = format!("rl    {step}/3");
        assert_eq!(err.matches(&mark).count(), 1, "{mark}: {err}");
    }
    assert!(
        !err.contains("RL: 1/3"),
        "percent lines beside the step lines: {err}"
    );
    assert!(!err.contains("NaN"), "{err}");

    let mut quiet = refs.clone();
    quiet.insert(0, "-q");
    let q = quiet
        .iter()
        .position(|a| *a == "run")
        .expect("the out argument");
    quiet[q] = "run-quiet";
    let out = turnwise(&quiet, tmp.path());
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "", "-q printed to stdout");
    assert!(!text(&out.stderr).contains("INFO"), "{}", text(&out.stderr));
}

#[test]
fn eval_and_sft_check_their_arguments_before_working() {
    let tmp = tempfile::tempdir().unwrap();
    // No questions to evaluate is refused as such, before anything is loaded (it read "the test
    // split … has no questions to evaluate").
    let out = turnwise(
        &["eval", "--run", "no-such-run", "--questions", "0"],
        tmp.path(),
    );
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("--questions must be at least 1"), "{err}");
    // A negative temperature is a value, refused by name before anything is loaded.
    let out = turnwise(
        &["eval", "--run", "no-such-run", "--temperature", "-1"],
        tmp.path(),
    );
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("--temperature must be 0"), "{err}");
    // A dump path that cannot be written fails before the evaluation.
    let out = turnwise(
        &[
            "eval",
            "--run",
            "no-such-run",
            "--dump",
            "/nonexistent/dir/x.jsonl",
        ],
        tmp.path(),
    );
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("dump file"),
        "{}",
        text(&out.stderr)
    );
    // `sft --out` never writes into a foreign folder.
    let foreign = tmp.path().join("notes");
    std::fs::create_dir_all(&foreign).unwrap();
    std::fs::write(foreign.join("thesis.tex"), "precious").unwrap();
    let out = turnwise(&["sft", "--out", "notes"], tmp.path());
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--overwrite"),
        "{}",
        text(&out.stderr)
    );
    let out = turnwise(&["sft", "--out", "notes", "--overwrite"], tmp.path());
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("no model export"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(foreign.join("thesis.tex")).unwrap(),
        "precious"
    );
}

/// `cfg/tiny.toml` of the review: the tiny overrides as a config file.
fn tiny_config_file(dir: &Path) -> std::path::PathBuf {
    let mut text = String::new();
    for s in common::tiny_overrides() {
        let (k, v) = s.split_once('=').unwrap();
        text.push_str(&format!("{k} = {v}\n"));
    }
    let path = dir.join("tiny.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// `sft` takes `--config` as `train` does, and its progress ends in one "done"; a run of no RL
/// steps reports "RL 0 s", not "-0".
#[test]
fn sft_takes_a_config_file_and_the_summary_has_no_negative_zero() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config_file(tmp.path());
    let cfg = cfg.to_str().unwrap();
    let out = turnwise(&["sft", "--config", cfg, "--out", "model"], tmp.path());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(err.contains("warm start: 3/3 done, "), "{err}");
    assert!(!err.contains("done done"), "{err}");
    assert!(err.contains("3 steps in "), "{err}");
    assert!(tmp.path().join("model/config.json").is_file());
    // The file is applied over grpo's settings (the tiny model, not the preset's).
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tmp.path().join("model/config.json")).unwrap())
            .unwrap();
    assert_eq!(config["hidden_size"], 32, "{config}");

    let out = turnwise(
        &[
            "train",
            "--preset",
            "grpo",
            "--config",
            cfg,
            "--set",
            "run.steps=0",
            "--set",
            "eval.questions=2",
            "--out",
            "run",
        ],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains(", RL 0 s, "), "{stdout}");
    assert!(!stdout.contains("-0 s"), "{stdout}");
}

#[test]
fn data_world_writes_demonstrations_for_the_warm_start() {
    let tmp = tempfile::tempdir().unwrap();
    let out = turnwise(
        &["data", "world", "--out", "w", "--format", "boxed"],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let demos = std::fs::read_to_string(tmp.path().join("w/demonstrations.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(demos.lines().next().unwrap()).unwrap();
    assert!(
        first["prompt"].is_string() && first["segments"].is_array(),
        "{first}"
    );
    assert!(demos.contains("\\\\boxed{"), "boxed-format demonstrations");
    assert!(demos.lines().count() > 100);
}

#[test]
fn index_refuses_an_empty_corpus_and_warns_of_repeated_ids() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("empty.jsonl"), "").unwrap();
    let out = turnwise(
        &["index", "--corpus", "empty.jsonl", "--out", "i1"],
        tmp.path(),
    );
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("holds no documents"),
        "{}",
        text(&out.stderr)
    );
    std::fs::write(
        tmp.path().join("dup.jsonl"),
        "{\"id\": \"a\", \"contents\": \"one\"}\n{\"id\": \"a\", \"contents\": \"two\"}\n",
    )
    .unwrap();
    let out = turnwise(
        &["index", "--corpus", "dup.jsonl", "--out", "i2"],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("repeat an earlier id"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn a_warm_up_longer_than_its_phase_is_named_not_silent() {
    // cli-as-a-user-3 m2: `sft.warmup_steps = 50` with `sft.steps = 30` was accepted without a
    // word, and the warm start never reached its peak learning rate.
    let tmp = tempfile::tempdir().unwrap();
    let out = turnwise(
        &[
            "config",
            "--preset",
            "grpo",
            "--set",
            "sft.warmup_steps=50",
            "--set",
            "sft.steps=30",
            "--set",
            "optim.warmup_steps=5",
            "--set",
            "run.steps=4",
        ],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains(
            "sft.warmup_steps = 50 exceeds sft.steps = 30: the learning rate never reaches \
             sft.lr = 0.002 (the last step runs at 1.200e-3, 60 % of it); set sft.warmup_steps \
             to at most 30"
        ),
        "{err}"
    );
    assert!(
        err.contains("optim.warmup_steps = 5 exceeds run.steps = 4"),
        "{err}"
    );
    // A warm-up within its phase says nothing.
    let out = turnwise(
        &[
            "config",
            "--preset",
            "grpo",
            "--set",
            "sft.steps=30",
            "--set",
            "sft.warmup_steps=30",
        ],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        !text(&out.stderr).contains("warmup_steps"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn the_cuda_error_points_to_the_section_that_exists() {
    // cli-as-a-user-3 m10: the error (and docs/config.md) sent users to README, "Building with
    // CUDA", a section that is in docs/scaling.md.
    if turnwise_model::device::cuda_compiled() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = turnwise(
        &[
            "config",
            "--preset",
            "grpo",
            "--set",
            "model.device=\"cuda\"",
        ],
        tmp.path(),
    );
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("docs/scaling.md, \"Building with CUDA\""),
        "{err}"
    );
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let scaling = std::fs::read_to_string(root.join("docs/scaling.md")).unwrap();
    assert!(scaling.lines().any(|l| l == "## Building with CUDA"));
    let config = std::fs::read_to_string(root.join("docs/config.md")).unwrap();
    assert!(!config.contains("README, \"Building with CUDA\""));
    assert!(config.contains("docs/scaling.md, \"Building with CUDA\""));
}

#[test]
fn presets_lists_one_line_each_and_the_paragraphs_on_request() {
    // cli-as-a-user-3 m11: `turnwise presets` printed about 40 lines of paragraphs; a new user
    // wants README's one-line table, with the paragraphs under --verbose.
    let tmp = tempfile::tempdir().unwrap();
    let out = turnwise(&["presets"], tmp.path());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let listing = text(&out.stdout);
    let names: Vec<&str> = turnwise::config::presets::PRESETS
        .iter()
        .map(|(n, _)| *n)
        .chain(["quickstart"])
        .collect();
    // A header, one line per preset, a blank line and a hint.
    assert_eq!(listing.lines().count(), names.len() + 3, "{listing}");
    assert!(!listing.contains("paper:"), "{listing}");
    for name in &names {
        assert_eq!(
            listing
                .lines()
                .filter(|l| l.split_whitespace().next() == Some(name))
                .count(),
            1,
            "{name}: {listing}"
        );
    }
    // The lines are README's table of presets.
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md"))
            .unwrap();
    for (name, _) in turnwise::config::presets::PRESETS {
        let (method, what) = turnwise::config::presets::summary(name).unwrap();
        let (method, what) = (method.as_str(), what.as_str());
        assert!(
            readme.contains(&format!("| `{name}` | {method} | {what} |")),
            "README's table of presets lacks the row of {name} ({method} | {what})"
        );
        let line = listing
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap();
        assert!(line.contains(method) && line.ends_with(what), "{line}");
    }
    // --verbose: the paragraphs and papers of every preset; NAME: one preset's.
    let out = turnwise(&["presets", "--verbose"], tmp.path());
    let verbose = text(&out.stdout);
    assert!(out.status.success());
    assert!(verbose.contains("paper: DeepSeekMath"), "{verbose}");
    assert!(verbose.lines().count() > listing.lines().count());
    let out = turnwise(&["presets", "grpo"], tmp.path());
    let one = text(&out.stdout);
    assert!(out.status.success());
    assert!(one.starts_with("grpo         GRPO (DeepSeekMath"), "{one}");
    assert!(!one.contains("dr-grpo"), "{one}");
    let out = turnwise(&["presets", "nope"], tmp.path());
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("grpo"), "{}", text(&out.stderr));
}

/// The binary installs `turnwise serve` as the policy host at start: a harness run serves its
/// policy and gets as far as its programs (here they never call the model, so every episode
/// fails and the run stops naming them), never to "no policy host is installed".
#[test]
fn train_serves_the_harness_policy_through_the_installed_host() {
    let tmp = tempfile::tempdir().unwrap();
    let mut args: Vec<String> = ["train", "--preset", "grpo", "--out", "run"]
        .map(String::from)
        .to_vec();
    let mut sets = common::tiny_overrides();
    sets.extend(
        [
            "run.steps=1",
            "eval.questions=2",
            "rollout.backend=\"harness\"",
            "rollout.harness.command=[\"sh\", \"-c\", \"exit 0\"]",
        ]
        .map(String::from),
    );
    for s in &sets {
        args.push("--set".into());
        args.push(s.clone());
    }
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = turnwise(&refs, tmp.path());
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(!err.contains("no policy host"), "{err}");
    assert!(err.contains("harness episodes failed"), "{err}");
    assert!(err.contains("never called the model"), "{err}");
}
