//! Hugging Face checkpoints in and out: prompt templates (built-in, Search-R1's instruction,
//! the data files' `prompt` field, a user template, the checkpoint's chat template), exporting
//! a run's checkpoint as a clean folder, and evaluating any checkpoint or exported folder.

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use candle_core::{DType, Device};
use serde_json::{Value, json};
use turnwise::checkpoints::{EvalSource, export_checkpoint, open_for_eval};
use turnwise::config::TrainConfig;
use turnwise::pipeline::{FIRST_PROMPT_FILE, RunOptions, run};
use turnwise::prompt::search_r1_prompt;
use turnwise::task::prompt_text;
use turnwise::trainer::Trainer;
use turnwise_env::world::Split;
use turnwise_model::model::weights::{load_safetensors, save_safetensors};

const CHATML: &str = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

fn chatml(user: &str) -> String {
    format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn prompt_templates_on_real_inputs() {
    let tmp = tempfile::tempdir().unwrap();
    let mut base_sets = common::tiny_overrides();
    base_sets.push("sft.steps=0".into());
    let base = TrainConfig::resolve(Some("grpo"), None, &base_sets).unwrap();
    let t = Trainer::new(base).unwrap();
    // The generated world with a fresh model: the built-in prompt, byte for byte, in every
    // split and in the oracle demonstrations.
    for split in Split::ALL {
        for q in t.task.questions(split) {
            assert_eq!(
                t.task.prompt(q).unwrap(),
                format!("<|im_start|> {} <|im_end|>", q.text)
            );
        }
    }
    for d in t.task.demonstrations(Split::Train, 0.0, 0).unwrap() {
        assert!(
            d.prompt.starts_with("<|im_start|> ") && d.prompt.ends_with(" <|im_end|>"),
            "{}",
            d.prompt
        );
    }

    // A tiny Hugging Face checkpoint whose tokenizer_config.json has a ChatML chat template.
    let hf = tmp.path().join("hf");
    t.export(&hf).unwrap();
    let tc_path = hf.join("tokenizer_config.json");
    let mut tc = read_json(&tc_path);
    tc["chat_template"] = json!(CHATML);
    tc["eos_token"] = json!("<|im_end|>");
    std::fs::write(&tc_path, tc.to_string()).unwrap();

    // Search-R1 files; the first training line carries a `prompt` field.
    let data = tmp.path().join("data");
    t.task
        .world
        .as_ref()
        .unwrap()
        .write_search_r1(&data)
        .unwrap();
    let train_path = data.join("train.jsonl");
    let text = std::fs::read_to_string(&train_path).unwrap();
    let mut lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let from_file = format!(
        "PROMPT FROM FILE: {}",
        lines[0]["question"].as_str().unwrap()
    );
    lines[0]["prompt"] = json!([{"role": "user", "content": from_file}]);
    lines[0]["data_source"] = json!("nq");
    let out: Vec<String> = lines.iter().map(Value::to_string).collect();
    std::fs::write(&train_path, out.join("\n") + "\n").unwrap();

    let mut sets = common::tiny_overrides();
    let p = |name: &str| data.join(name).display().to_string();
    sets.extend([
        format!("task.search_r1.train=\"{}\"", p("train.jsonl")),
        format!("task.search_r1.test=\"{}\"", p("test.jsonl")),
        format!("task.search_r1.corpus=\"{}\"", p("corpus.jsonl")),
        format!("model.init_from=\"{}\"", hf.display()),
        "sft.steps=0".into(),
    ]);
    let resolve = |extra: &[&str]| {
        let mut s = sets.clone();
        s.extend(extra.iter().map(|x| x.to_string()));
        TrainConfig::resolve(Some("grpo"), None, &s)
    };

    // auto: the data line's prompt, else Search-R1's instruction, through the chat template.
    let mut t = Trainer::new(resolve(&[]).unwrap()).unwrap();
    assert!(t.task.prompter().uses_chat_template());
    let train = t.task.questions(Split::Train);
    assert_eq!(t.task.prompt(train[0]).unwrap(), chatml(&from_file));
    let q1 = train[1];
    assert_eq!(
        t.task.prompt(q1).unwrap(),
        chatml(&search_r1_prompt(&q1.text))
    );
    assert!(
        t.task
            .prompt(q1)
            .unwrap()
            .contains("call a search engine by <search> query </search>")
    );
    // RL samples from those prompts.
    t.freeze_reference().unwrap();
    let step = t.rl_step().unwrap();
    assert!(!step.episodes.is_empty());
    for e in &step.episodes {
        let qid = e.trajectory.prompt_uid.split_once(':').unwrap().1;
        let q = t
            .task
            .questions(Split::Train)
            .into_iter()
            .find(|q| q.id == qid)
            .unwrap();
        let prompt = t.task.prompt(q).unwrap();
        assert!(prompt.starts_with("<|im_start|>user\n"), "{prompt}");
        assert_eq!(
            e.trajectory.prompt_ids,
            t.tokenizer.encode(&prompt).unwrap()
        );
    }

    // The chat template turned off: the built-in prompt (and the data line's text).
    let t = Trainer::new(resolve(&["task.prompt.chat_template=\"none\""]).unwrap()).unwrap();
    let train = t.task.questions(Split::Train);
    assert_eq!(t.task.prompt(train[0]).unwrap(), from_file);
    assert_eq!(
        t.task.prompt(train[1]).unwrap(),
        prompt_text(&train[1].text)
    );
    // Explicit Search-R1 template without the chat template.
    let t = Trainer::new(
        resolve(&[
            "task.prompt.template=\"search_r1\"",
            "task.prompt.chat_template=\"none\"",
        ])
        .unwrap(),
    )
    .unwrap();
    let train = t.task.questions(Split::Train);
    assert_eq!(
        t.task.prompt(train[0]).unwrap(),
        search_r1_prompt(&train[0].text)
    );
    // A user template, through the chat template.
    let t = Trainer::new(resolve(&["task.prompt.text=\"Q: {{ question }} A:\""]).unwrap()).unwrap();
    let q = t.task.questions(Split::Test)[0];
    assert_eq!(
        t.task.prompt(q).unwrap(),
        chatml(&format!("Q: {} A:", q.text))
    );
    // `data` needs the field on every line, and Search-R1 files.
    let e = Trainer::new(resolve(&["task.prompt.template=\"data\""]).unwrap())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("has no `prompt` field"), "{e}");
    let e = TrainConfig::resolve(
        Some("grpo"),
        None,
        &["task.prompt.template=\"data\"".to_string()],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("task.prompt.template"), "{e}");
    // A fresh model has no chat template to require.
    let mut s = base_sets.clone();
    s.push("task.prompt.chat_template=\"checkpoint\"".into());
    let e = Trainer::new(TrainConfig::resolve(Some("grpo"), None, &s).unwrap())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("chat_template"), "{e}");
}

fn files(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn export_and_evaluate_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let run_dir = tmp.path().join("run");
    let mut sets = common::tiny_overrides();
    sets.extend([
        "run.save_every=1".to_string(),
        "eval.questions=2".to_string(),
    ]);
    let cfg = TrainConfig::resolve(Some("grpo"), None, &sets).unwrap();
    run(
        cfg,
        &RunOptions {
            dir: run_dir.clone(),
            quiet: true,
        },
        false,
    )
    .unwrap();
    // The run records the first training question's prompt.
    let t = Trainer::new(TrainConfig::resolve(Some("grpo"), None, &sets).unwrap()).unwrap();
    let first = t.task.questions(Split::Train)[0];
    assert_eq!(
        std::fs::read_to_string(run_dir.join(FIRST_PROMPT_FILE)).unwrap(),
        prompt_text(&first.text)
    );

    // Export step 1: a clean folder with the same weights (and the manifest of what turnwise
    // wrote there, which `--overwrite` replaces by).
    let out = tmp.path().join("export");
    let ck = export_checkpoint(&run_dir, Some(1), &out, false).unwrap();
    assert_eq!(ck.step, 1);
    let expected: BTreeSet<String> = [
        turnwise::ownership::MANIFEST_FILE,
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "turnwise.toml",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    assert_eq!(files(&out), expected);
    let a = load_safetensors(ck.path.join("model.safetensors"), DType::F32, &Device::Cpu).unwrap();
    let mut b = load_safetensors(out.join("model.safetensors"), DType::F32, &Device::Cpu).unwrap();
    // A word-level tokenizer: the export is the Llama form, with zero o_proj biases.
    assert_eq!(read_json(&out.join("config.json"))["model_type"], "llama");
    let o_biases: Vec<String> = b
        .keys()
        .filter(|n| n.ends_with("self_attn.o_proj.bias"))
        .cloned()
        .collect();
    let layers = read_json(&out.join("config.json"))["num_hidden_layers"].as_u64();
    assert_eq!(
        Some(o_biases.len() as u64),
        layers,
        "one per layer: {o_biases:?}"
    );
    for name in o_biases {
        let v = b.remove(&name).unwrap().to_vec1::<f32>().unwrap();
        assert!(v.iter().all(|x| *x == 0.0), "{name}");
    }
    assert_eq!(a.len(), b.len());
    for (name, ta) in &a {
        let va = ta.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let vb = b[name].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(va, vb, "{name}");
    }
    // The run's checkpoints are complete Hugging Face folders too.
    let ck_files = files(&ck.path);
    for f in ["tokenizer_config.json", "generation_config.json"] {
        assert!(ck_files.contains(f), "{f} missing from {ck_files:?}");
    }
    assert!(read_json(&out.join("config.json"))["eos_token_id"].is_u64());

    // A non-empty folder is refused without --overwrite; the default is the latest step.
    let e = export_checkpoint(&run_dir, None, &out, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--overwrite"), "{e}");
    assert_eq!(
        export_checkpoint(&run_dir, None, &out, true).unwrap().step,
        2
    );
    let e = export_checkpoint(&run_dir, Some(7), &tmp.path().join("x"), false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("complete steps: 1, 2"), "{e}");
    // Step 0 has been rotated out of checkpoints/, but the run keeps the warm-started model.
    let e = export_checkpoint(&run_dir, Some(0), &tmp.path().join("x"), false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("complete steps: 1, 2") && e.contains("warm-start-model"),
        "{e}"
    );
    let e = export_checkpoint(&run_dir, None, &run_dir, true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("refusing"), "{e}");
    assert!(run_dir.join("config.toml").is_file());
    // --overwrite replaces an earlier export's files only: the user's own stay.
    std::fs::write(out.join("NOTES.md"), "mine").unwrap();
    export_checkpoint(&run_dir, Some(1), &out, true).unwrap();
    assert_eq!(
        std::fs::read_to_string(out.join("NOTES.md")).unwrap(),
        "mine"
    );
    assert!(out.join("model.safetensors").is_file());
    // ... and never writes into a folder that holds no export (the review's paper.tex).
    let paper = tmp.path().join("paper");
    std::fs::create_dir_all(&paper).unwrap();
    std::fs::write(paper.join("paper.tex"), "precious").unwrap();
    let e = format!(
        "{:#}",
        export_checkpoint(&run_dir, None, &paper, true).unwrap_err()
    );
    assert!(e.contains("no model export"), "{e}");
    assert_eq!(
        std::fs::read_to_string(paper.join("paper.tex")).unwrap(),
        "precious"
    );

    // Evaluate the run, the exported folder (same weights and prompts: same result), a named
    // checkpoint of the run and the warm-start export.
    let eval = |src: EvalSource<'_>| {
        let (t, what) = open_for_eval(&src).unwrap();
        (t.evaluate(Split::Test, 2, 0.0, 0).unwrap(), what, t.step)
    };
    let (r_run, what, step) = eval(EvalSource {
        run: Some(&run_dir),
        ..EvalSource::default()
    });
    assert!(
        what.contains("step-00002") && what.contains("RL step 2"),
        "{what}"
    );
    assert_eq!(step, 2);
    let (r_out, what, _) = eval(EvalSource {
        checkpoint: Some(&out),
        ..EvalSource::default()
    });
    assert!(what.contains("model folder"), "{what}");
    assert_eq!(r_run, r_out);
    let step1 = run_dir.join("checkpoints").join("step-00001");
    let (_, what, step) = eval(EvalSource {
        checkpoint: Some(&step1),
        ..EvalSource::default()
    });
    assert_eq!(step, 1, "{what}");
    let warm = run_dir.join("warm-start-model");
    let (r, _, _) = eval(EvalSource {
        checkpoint: Some(&warm),
        ..EvalSource::default()
    });
    assert_eq!(r.n, 2);

    // The binary: `eval --checkpoint` names what it evaluated on stderr; `export` refuses a
    // non-empty folder.
    let bin = env!("CARGO_BIN_EXE_turnwise");
    let o = std::process::Command::new(bin)
        .args(["-q", "eval", "--questions", "2", "--checkpoint"])
        .arg(&out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(stderr.contains("evaluating model folder"), "{stderr}");
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["n"], json!(2));
    let o = std::process::Command::new(bin)
        .arg("export")
        .arg(&run_dir)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--overwrite"));

    // A folder without a config needs --preset or --config.
    std::fs::remove_file(out.join("turnwise.toml")).unwrap();
    let e = open_for_eval(&EvalSource {
        checkpoint: Some(&out),
        ..EvalSource::default()
    })
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("--preset"), "{e}");
    let (r_preset, _, _) = eval(EvalSource {
        checkpoint: Some(&out),
        preset: Some("grpo"),
        sets: &sets,
        ..EvalSource::default()
    });
    assert_eq!(r_preset, r_run);

    // NaN weights: a clear error naming the file and the tensor.
    let path = out.join("model.safetensors");
    let mut w = load_safetensors(&path, DType::F32, &Device::Cpu).unwrap();
    let norm = w["model.norm.weight"].clone();
    let nan = (norm * f64::NAN).unwrap();
    w.insert("model.norm.weight".into(), nan);
    save_safetensors(&w, &path).unwrap();
    let e = format!(
        "{:#}",
        open_for_eval(&EvalSource {
            checkpoint: Some(&out),
            preset: Some("grpo"),
            sets: &sets,
            ..EvalSource::default()
        })
        .err()
        .unwrap()
    );
    assert!(
        e.contains("model.safetensors") && e.contains("`model.norm.weight` holds"),
        "{e}"
    );
}
