//! Training and evaluation on Search-R1-format files (questions, corpus) with demonstrations
//! from a JSON-lines file, as a user brings NQ/HotpotQA-style data.

mod common;

use std::io::Write;
use std::sync::Arc;

use turnwise::config::TrainConfig;
use turnwise::task::{Demonstration, TaskSet};
use turnwise::trainer::Trainer;
use turnwise_env::world::Split;

#[test]
fn trains_on_search_r1_files_with_a_demonstrations_file() {
    let tmp = tempfile::tempdir().unwrap();
    // Make the files from a small world, then forget the world.
    let world_cfg = TrainConfig::resolve(Some("grpo"), None, &common::tiny_overrides()).unwrap();
    let task = TaskSet::build(&world_cfg.task).unwrap();
    let data = tmp.path().join("data");
    task.world.as_ref().unwrap().write_search_r1(&data).unwrap();
    let demos: Vec<Demonstration> = task.demonstrations(Split::Train, 0.0, 0).unwrap();
    let demo_path = tmp.path().join("demos.jsonl");
    let mut f = std::fs::File::create(&demo_path).unwrap();
    for d in &demos {
        writeln!(f, "{}", serde_json::to_string(d).unwrap()).unwrap();
    }
    drop(f);

    let mut sets = common::tiny_overrides();
    let p = |name: &str| data.join(name).display().to_string();
    sets.extend([
        format!("task.search_r1.train=\"{}\"", p("train.jsonl")),
        format!("task.search_r1.test=\"{}\"", p("test.jsonl")),
        format!("task.search_r1.corpus=\"{}\"", p("corpus.jsonl")),
        format!("sft.demonstrations=\"{}\"", demo_path.display()),
    ]);
    let cfg = TrainConfig::resolve(Some("grpo"), None, &sets).unwrap();
    let mut t = Trainer::new(cfg).unwrap();
    assert!(t.task.world.is_none());
    assert_eq!(
        t.task.questions(Split::Train).len(),
        task.questions(Split::Train).len()
    );
    t.warm_start(&mut |_, loss, _| assert!(loss.is_finite()))
        .unwrap();
    t.freeze_reference().unwrap();
    let out = t.rl_step().unwrap();
    assert_eq!(out.episodes.len(), 2 * 3);
    let r = t.evaluate(Split::Test, 4, 0.0, 0).unwrap();
    assert_eq!(r.n, 4);
    // Hop counts come from the files' metadata.
    assert!(r.em_by_hops.keys().all(|&h| (1..=4).contains(&h)));
    // The per-episode view agrees with the aggregate, question by question.
    let (r2, eps) = t.evaluate_with_episodes(Split::Test, 4, 0.0, 0).unwrap();
    assert_eq!(eps.len(), 4);
    assert!((eps.iter().map(|e| e.em).sum::<f64>() / 4.0 - r2.em).abs() < 1e-12);
    for e in &eps {
        assert!(!e.golden_answers.is_empty(), "{}", e.question_id);
        assert_eq!(e.em > 0.0, e.answer.is_some() && e.em == 1.0);
        assert!(e.text.contains("<search>") || e.text.contains("<answer>"));
        assert!(serde_json::to_string(e).unwrap().contains(&e.question_id));
    }

    // Without oracle demonstrations or a file, the warm start says what to do.
    let mut sets2 = common::tiny_overrides();
    sets2.push(format!("task.search_r1.train=\"{}\"", p("train.jsonl")));
    sets2.push(format!("task.search_r1.corpus=\"{}\"", p("corpus.jsonl")));
    let cfg = TrainConfig::resolve(Some("grpo"), None, &sets2).unwrap();
    let mut t = Trainer::new(cfg).unwrap();
    let e = t.warm_start(&mut |_, _, _| {}).unwrap_err().to_string();
    assert!(e.contains("sft.demonstrations"), "{e}");
}

/// Writes a tiny world's Search-R1 files into `dir` and returns the overrides naming `files`
/// (`train.jsonl`, `test.jsonl`, ...) as `task.search_r1.<key>`, plus `sft.steps=0`.
fn search_r1_sets(dir: &std::path::Path, files: &[(&str, &str)]) -> Vec<String> {
    let world_cfg = TrainConfig::resolve(Some("grpo"), None, &common::tiny_overrides()).unwrap();
    let task = TaskSet::build(&world_cfg.task).unwrap();
    task.world.as_ref().unwrap().write_search_r1(dir).unwrap();
    let mut sets = common::tiny_overrides();
    sets.push("sft.steps=0".into());
    for (key, file) in files {
        sets.push(format!(
            "task.search_r1.{key}=\"{}\"",
            dir.join(file).display()
        ));
    }
    sets
}

#[test]
fn corpus_and_retriever_url_together_are_a_config_error() {
    let sets = [
        "task.search_r1.train=\"train.jsonl\"".to_string(),
        "task.search_r1.corpus=\"corpus.jsonl\"".into(),
        "task.search_r1.retriever_url=\"http://127.0.0.1:8000\"".into(),
    ];
    let e = TrainConfig::resolve(Some("grpo"), None, &sets)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("task.search_r1.retriever_url") && e.contains("task.search_r1.corpus"),
        "{e}"
    );
}

#[test]
fn an_empty_question_file_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let sets = search_r1_sets(
        &data,
        &[("train", "empty.jsonl"), ("corpus", "corpus.jsonl")],
    );
    std::fs::write(data.join("empty.jsonl"), "").unwrap();
    let cfg = TrainConfig::resolve(Some("grpo"), None, &sets).unwrap();
    let e = format!(
        "{:#}",
        Trainer::new(cfg).err().expect("an empty train file fails")
    );
    assert!(
        e.contains(&format!(
            "no questions in {}",
            data.join("empty.jsonl").display()
        )) && e.contains("task.search_r1.train"),
        "{e}"
    );
    assert!(!e.contains("rl_subject_fraction"), "{e}");
}

#[test]
fn retriever_url_is_checked_at_startup_before_the_run_directory() {
    use turnwise_env::server::{BackgroundServer, ServerConfig};
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let mut sets = search_r1_sets(&data, &[("train", "train.jsonl"), ("test", "test.jsonl")]);

    // Nobody listens on the URL: `train` fails before creating the run directory, naming
    // the key and the URL.
    let dead = {
        let server =
            BackgroundServer::start(Arc::new(Empty), ServerConfig::with_addr(loopback0())).unwrap();
        server.url()
    };
    let mut dead_sets = sets.clone();
    dead_sets.push(format!("task.search_r1.retriever_url=\"{dead}\""));
    let cfg = TrainConfig::resolve(Some("grpo"), None, &dead_sets).unwrap();
    let run_dir = tmp.path().join("run");
    let e = format!(
        "{:#}",
        turnwise::pipeline::run(
            cfg.clone(),
            &turnwise::pipeline::RunOptions {
                dir: run_dir.clone(),
                quiet: true,
            },
            false,
        )
        .unwrap_err()
    );
    assert!(
        e.contains("task.search_r1.retriever_url") && e.contains(&dead),
        "{e}"
    );
    assert!(!run_dir.exists(), "the run directory was created");
    // Where the task is built (train, resume, eval, sft), the same check.
    let e = format!("{:#}", Trainer::new(cfg).err().expect("checked"));
    assert!(e.contains("task.search_r1.retriever_url"), "{e}");

    // A live server: the task is built and its searches go there.
    let docs = turnwise_env::corpus::read_corpus(data.join("corpus.jsonl")).unwrap();
    let server = BackgroundServer::start(
        Arc::new(turnwise_env::search::bm25_mem::InMemoryBm25::new(docs)),
        ServerConfig::with_addr(loopback0()),
    )
    .unwrap();
    sets.push(format!("task.search_r1.retriever_url=\"{}\"", server.url()));
    let cfg = TrainConfig::resolve(Some("grpo"), None, &sets).unwrap();
    let t = Trainer::new(cfg).unwrap();
    let q = &t.task.questions(Split::Train)[0].text;
    let hits = t
        .task
        .retriever
        .retrieve(std::slice::from_ref(q), 2)
        .unwrap();
    assert_eq!(hits.len(), 1);
}

#[test]
fn eval_of_a_split_without_questions_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let mut sets = search_r1_sets(
        &data,
        &[
            ("train", "train.jsonl"),
            ("test", "test.jsonl"),
            ("corpus", "corpus.jsonl"),
        ],
    );
    sets.extend(["run.steps=1".into(), "eval.questions=2".into()]);
    let cfg = TrainConfig::resolve(Some("grpo"), None, &sets).unwrap();
    let run_dir = tmp.path().join("run");
    turnwise::pipeline::run(
        cfg,
        &turnwise::pipeline::RunOptions {
            dir: run_dir.clone(),
            quiet: true,
        },
        false,
    )
    .unwrap();
    let eval = |split: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_turnwise"))
            .args(["-q", "eval", "--questions", "2", "--split", split, "--run"])
            .arg(&run_dir)
            .output()
            .unwrap()
    };
    let out = eval("validation");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "n=0 passed silently: {stderr}");
    assert!(
        stderr.contains("the validation split") && stderr.contains("has no questions"),
        "{stderr}"
    );
    let out = eval("test");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["n"], 2);
}

/// The question fixtures of turnwise-env (Parquet and `datasets` folders written by
/// `datasets`, pandas and pyarrow; tests/fixtures/questions/make_question_fixtures.py there).
fn question_fixtures() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../turnwise-env/tests/fixtures/questions")
}

#[test]
fn parquet_files_and_datasets_folders_give_the_questions_of_their_json_lines() {
    let fx = question_fixtures();
    // The corpus as Parquet too (pandas: integer ids, Search-R1's contents).
    let corpus = fx.join("corpus.parquet");
    let build = |train: &str, test: &str, extra: &[String]| {
        let mut sets = common::tiny_overrides();
        sets.extend([
            "sft.steps=0".to_string(),
            format!("task.search_r1.train=\"{}\"", fx.join(train).display()),
            format!("task.search_r1.test=\"{}\"", fx.join(test).display()),
            format!("task.search_r1.corpus=\"{}\"", corpus.display()),
        ]);
        sets.extend(extra.iter().cloned());
        Trainer::new(TrainConfig::resolve(Some("grpo"), None, &sets).unwrap())
    };
    let jsonl = build("nq_search/train.jsonl", "nq_search/test.jsonl", &[]).unwrap();
    // Search-R1's train.parquet (snappy, nested prompt and reward_model), and a DatasetDict
    // saved with save_to_disk for `test` (read at its test split).
    let parquet = build("nq_search/train.parquet", "hf_dataset_dict", &[]).unwrap();
    for split in [Split::Train, Split::Test] {
        let want = jsonl.task.questions(split);
        assert!(!want.is_empty());
        assert_eq!(parquet.task.questions(split), want, "{split:?}");
    }
    let q = parquet.task.questions(Split::Test)[0];
    assert_eq!(q.id, "test_0");
    assert_eq!(q.text, "when was the last time anyone was on the moon?");
    assert_eq!(q.golden_answers, ["14 December 1972 UTC", "December 1972"]);
    // The `prompt` column is the question's chat prompt (template auto: "data").
    let prompt = q.prompt.as_ref().expect("the prompt column");
    assert!(
        prompt[0]
            .content
            .ends_with("Question: when was the last time anyone was on the moon?\n")
    );
    let hits = parquet
        .task
        .retriever
        .retrieve(&["who wrote I will always love you".to_string()], 1)
        .unwrap();
    assert!(
        hits[0][0].document.contents.starts_with("\"Dolly Parton\""),
        "{hits:?}"
    );
    // Evaluation runs on them.
    let r = parquet.evaluate(Split::Test, 2, 0.0, 0).unwrap();
    assert_eq!(r.n, 2);

    // The verl columns alone (zstd), a two-shard `datasets` folder: the same training questions.
    for train in ["verl_columns_zstd.parquet", "hf_dataset"] {
        let t = build(train, "nq_search/test.parquet", &[]).unwrap();
        assert_eq!(
            t.task.questions(Split::Train),
            jsonl.task.questions(Split::Train),
            "{train}"
        );
    }

    // A DatasetDict without the split a key asks for: the error names the key and the splits.
    let e = format!(
        "{:#}",
        build(
            "nq_search/train.parquet",
            "nq_search/test.parquet",
            &[format!(
                "task.search_r1.validation=\"{}\"",
                fx.join("hf_dataset_dict").display()
            )],
        )
        .err()
        .expect("no validation split")
    );
    assert!(
        e.contains("task.search_r1.validation")
            && e.contains("a DatasetDict with the splits [train, test] and no validation split"),
        "{e}"
    );
}

/// A retriever with no documents (only its address matters here).
struct Empty;

impl turnwise_env::search::Retriever for Empty {
    fn retrieve(
        &self,
        q: &[String],
        _k: usize,
    ) -> Result<Vec<Vec<turnwise_env::search::Hit>>, turnwise_env::search::RetrievalError> {
        Ok(vec![Vec::new(); q.len()])
    }
}

fn loopback0() -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], 0))
}

/// Questions whose prompts leave no room for a response in the model's context are left out
/// and counted, as verl's `filter_overlong_prompts` does (cli-as-a-user-3.md M1: 3,000-word
/// questions with a 512-position model trained silently, every rollout ending at once); a file
/// of nothing else is refused, naming `model.max_position_embeddings`.
#[test]
fn questions_longer_than_the_context_are_left_out_and_counted() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let mut sets = search_r1_sets(
        &data,
        &[
            ("train", "train_long.jsonl"),
            ("test", "test.jsonl"),
            ("corpus", "corpus.jsonl"),
        ],
    );
    sets.push("model.max_position_embeddings=512".into());
    let train = std::fs::read_to_string(data.join("train.jsonl")).unwrap();
    let n = train.lines().count();
    let long = |i: usize| {
        let words = vec!["where is the capital city"; 600].join(" ");
        format!(
            "{{\"id\": \"long_{i}\", \"question\": \"{words}?\", \"golden_answers\": [\"Paris\"]}}\n"
        )
    };
    std::fs::write(
        data.join("train_long.jsonl"),
        format!("{}{train}{}", long(0), long(1)),
    )
    .unwrap();
    let cfg = TrainConfig::resolve(Some("grpo"), None, &sets).unwrap();
    let mut t = Trainer::new(cfg).unwrap();
    let train = t.task.questions(Split::Train);
    assert_eq!(train.len(), n);
    assert!(train.iter().all(|q| !q.id.starts_with("long_")));
    let d = t.task.dropped_prompts;
    assert_eq!((d[0].dropped, d[0].total), (2, n + 2));
    assert!(d[0].longest >= 512, "{d:?}");
    assert_eq!((d[2].dropped, d[2].total), (0, 8));
    let note = turnwise::trainer::overlong_prompts_note(&d, 512).unwrap();
    assert!(
        note.contains(&format!("2 of {} train", n + 2))
            && note.contains("model.max_position_embeddings = 512"),
        "{note}"
    );
    // Every prompt trained on leaves room for a response.
    t.freeze_reference().unwrap();
    let out = t.rl_step().unwrap();
    assert!(
        out.episodes
            .iter()
            .all(|e| e.trajectory.prompt_ids.len() + 1 < 512)
    );

    // Only overlong questions: refused before anything runs.
    std::fs::write(
        data.join("train_long.jsonl"),
        format!("{}{}", long(0), long(1)),
    )
    .unwrap();
    let cfg = TrainConfig::resolve(Some("grpo"), None, &sets).unwrap();
    let e = format!("{:#}", Trainer::new(cfg).err().expect("refused"));
    assert!(
        e.contains("every one of the 2 train questions' prompts")
            && e.contains("model.max_position_embeddings = 512"),
        "{e}"
    );
}

/// The probe's question files (cli-as-a-user-3.md M2, M3): an empty gold answer, one that
/// normalises to nothing, and empty or blank questions are refused when the task is built,
/// naming the file, the line and the field (an empty `<answer></answer>` would earn 1.0
/// against such a gold).
#[test]
fn empty_questions_and_golds_that_normalise_to_nothing_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let sets = search_r1_sets(&data, &[("train", "bad.jsonl"), ("corpus", "corpus.jsonl")]);
    let train = std::fs::read_to_string(data.join("train.jsonl")).unwrap();
    let n = train.lines().count();
    for (line, field) in [
        (
            r#"{"question": "who?", "golden_answers": [""]}"#,
            "golden_answers",
        ),
        (
            r#"{"question": "who?", "golden_answers": ["The"]}"#,
            "golden_answers",
        ),
        (
            r#"{"question": "", "golden_answers": ["Paris"]}"#,
            "question",
        ),
        (
            r#"{"question": "   ", "golden_answers": ["Paris"]}"#,
            "question",
        ),
    ] {
        let bad = data.join("bad.jsonl");
        std::fs::write(&bad, format!("{train}{line}\n")).unwrap();
        let cfg = TrainConfig::resolve(Some("grpo"), None, &sets).unwrap();
        let e = format!("{:#}", Trainer::new(cfg).err().expect("refused"));
        assert!(
            e.contains(&format!("{}:{}: \"{field}\": ", bad.display(), n + 1)),
            "{line}: {e}"
        );
    }
}
