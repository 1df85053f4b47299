//! Training and evaluation on Search-R1-format files (questions, corpus) with demonstrations
//! from a JSON-lines file, as a user brings NQ/HotpotQA-style data.

mod common;

use std::io::Write;

use turnwise::config::TrainConfig;
use turnwise::task::{Demonstration, WorldTask};
use turnwise::trainer::Trainer;
use turnwise_env::world::Split;

#[test]
fn trains_on_search_r1_files_with_a_demonstrations_file() {
    let tmp = tempfile::tempdir().unwrap();
    // Make the files from a small world, then forget the world.
    let world_cfg = TrainConfig::resolve(Some("grpo"), None, &common::tiny_overrides()).unwrap();
    let task = WorldTask::build(&world_cfg.task).unwrap();
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
