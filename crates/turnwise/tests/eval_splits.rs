//! Evaluation names its split and is never pooled: a tiny run evaluates the test split before
//! and after RL and the validation split before, during and after, each with `n` equal to
//! `eval.questions`, in what it prints to summary.json, metrics.jsonl and report.md.

use turnwise::config::TrainConfig;
use turnwise::pipeline::{RunOptions, run};
use turnwise::run::{RunDir, read_metrics};
use turnwise::trainer::Trainer;
use turnwise::trainer::eval::{QuestionOutcome, paired_gain};
use turnwise_env::world::Split;

mod common;
use common::tiny_overrides;

const QUESTIONS: usize = 3;

#[test]
fn a_run_reports_each_split_with_its_own_n() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let mut sets = tiny_overrides();
    sets.extend([
        format!("eval.questions={QUESTIONS}"),
        "eval.every=1".into(),
        "run.steps=2".into(),
    ]);
    let cfg = TrainConfig::resolve(Some("grpo"), None, &sets).unwrap();
    let summary = run(
        cfg,
        &RunOptions {
            dir: dir.clone(),
            quiet: true,
        },
        false,
    )
    .unwrap();
    // The run's figures are on the test split; the validation ones are reported apart.
    let v = &summary.validation;
    for (split, r) in [
        ("test", &summary.before_greedy),
        ("test", &summary.before_sampled),
        ("test", &summary.after_greedy),
        ("test", &summary.after_sampled),
        ("validation", &v.before_greedy),
        ("validation", &v.before_sampled),
        ("validation", &v.after_greedy),
        ("validation", &v.after_sampled),
    ] {
        let r = r.as_ref().expect("evaluated");
        assert_eq!((r.split.as_str(), r.n), (split, QUESTIONS));
    }
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(json["before_greedy"]["split"], "test");
    assert_eq!(json["after_sampled"]["n"], QUESTIONS);
    assert_eq!(json["validation"]["after_greedy"]["split"], "validation");
    assert_eq!(json["validation"]["before_sampled"]["n"], QUESTIONS);

    // metrics.jsonl: every eval line is one split and one decoding mode, with its n.
    let run_dir = RunDir::open(&dir).unwrap();
    let log = read_metrics(run_dir.metrics_path()).unwrap();
    let mut seen: Vec<(u64, String)> = Vec::new();
    for r in log.phase("eval") {
        let prefixes: std::collections::BTreeSet<String> = r
            .values
            .keys()
            .filter(|k| k.starts_with("eval/"))
            .map(|k| k.split('/').take(3).collect::<Vec<_>>().join("/"))
            .collect();
        assert_eq!(
            prefixes.len(),
            1,
            "one split and mode per line: {prefixes:?}"
        );
        let prefix = prefixes.into_iter().next().unwrap();
        let n = r.get(&format!("{prefix}/n"));
        assert_eq!(n, Some(QUESTIONS as f64), "{prefix} at step {}", r.step);
        seen.push((r.step, prefix));
    }
    let expect = |steps: &[u64], prefix: &str| {
        for s in steps {
            assert!(
                seen.contains(&(*s, prefix.to_string())),
                "{prefix} at step {s}: {seen:?}"
            );
        }
        let n = seen.iter().filter(|(_, p)| p == prefix).count();
        assert_eq!(n, steps.len(), "{prefix}: {seen:?}");
    };
    // Test before and after RL only; validation before, at eval.every and after.
    expect(&[0, 2], "eval/test/greedy");
    expect(&[0, 2], "eval/test/sampled");
    expect(&[0, 1, 2], "eval/validation/greedy");
    expect(&[0, 1, 2], "eval/validation/sampled");

    // report.md has one table per split and mode, with n.
    let md = std::fs::read_to_string(run_dir.report_path()).unwrap();
    for title in [
        "### eval/test/greedy\n\nThe test split, greedy decoding",
        "### eval/validation/sampled\n\nThe validation split, sampled decoding",
    ] {
        assert!(md.contains(title), "{title}:\n{md}");
    }
    assert!(md.contains("| step | n | em |"), "{md}");
    assert!(md.contains(&format!("| 0 | {QUESTIONS} |")), "{md}");

    // Every evaluation keeps how each question went, and the gain from before to after RL is
    // the change on those same questions, with its paired standard error, per split and mode.
    for (split, steps) in [("test", &[0u64, 2][..]), ("validation", &[0, 1, 2])] {
        for mode in ["greedy", "sampled"] {
            for &step in steps {
                let kept: Vec<QuestionOutcome> =
                    run_dir.read_eval(split, mode, step).unwrap().unwrap();
                assert_eq!(kept.len(), QUESTIONS, "{split} {mode} {step}");
            }
            let key = format!("gain/{split}/{mode}");
            let g = summary.gains.get(&key).unwrap_or_else(|| panic!("{key}"));
            let before: Vec<QuestionOutcome> = run_dir.read_eval(split, mode, 0).unwrap().unwrap();
            let after: Vec<QuestionOutcome> = run_dir.read_eval(split, mode, 2).unwrap().unwrap();
            let expect = paired_gain(&before, &after).unwrap();
            assert_eq!(g.n, QUESTIONS);
            assert!((g.gain - expect.gain).abs() < 1e-12, "{key}");
            assert!((g.se - expect.se).abs() < 1e-12, "{key}");
            assert_eq!(
                (g.improved, g.regressed),
                (expect.improved, expect.regressed)
            );
            let (b, a) = match split {
                "test" if mode == "greedy" => (&summary.before_greedy, &summary.after_greedy),
                "test" => (&summary.before_sampled, &summary.after_sampled),
                _ if mode == "greedy" => (&v.before_greedy, &v.after_greedy),
                _ => (&v.before_sampled, &v.after_sampled),
            };
            let (b, a) = (b.as_ref().unwrap().em, a.as_ref().unwrap().em);
            assert!(
                (g.gain - (a - b)).abs() < 1e-12,
                "{key}: {} vs {a} - {b}",
                g.gain
            );
            assert_eq!(json["gains"][&key]["n"], QUESTIONS, "{key}");
        }
    }
    assert!(md.contains("## Gain from RL"), "{md}");
    assert!(
        md.contains(&format!("| test/greedy | {QUESTIONS} |")),
        "{md}"
    );
}

/// `Trainer::evaluate` asks exactly the first `n` questions of the one split it is given.
#[test]
fn evaluate_asks_the_first_n_questions_of_one_split() {
    let cfg = TrainConfig::resolve(Some("grpo"), None, &tiny_overrides()).unwrap();
    let mut t = Trainer::new(cfg).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    for split in [Split::Validation, Split::Test] {
        let (r, episodes) = t.evaluate_with_episodes(split, 5, 0.0, 0).unwrap();
        assert_eq!((r.split.as_str(), r.n), (split.name(), 5));
        let asked: Vec<&str> = episodes.iter().map(|e| e.question_id.as_str()).collect();
        let first: Vec<&str> = t
            .task
            .questions(split)
            .iter()
            .take(5)
            .map(|q| q.id.as_str())
            .collect();
        assert_eq!(asked, first);
        let m = r.to_metrics(&turnwise::trainer::eval::eval_prefix(split, "greedy"));
        assert_eq!(m[&format!("eval/{}/greedy/n", split.name())], 5.0);
    }
    // More questions than the split has: n is what was evaluated.
    let all = t.task.questions(Split::Test).len();
    let r = t.evaluate(Split::Test, all + 10, 0.0, 0).unwrap();
    assert_eq!(r.n, all);
}

/// `eval.samples = k`: k episodes a question, the first the one a one-sample evaluation draws
/// with the same seed, EM the mean over all of them (mean@k), pass@1 equal to it (EM is 0 or 1),
/// pass@k rising with k, and the per-question outcomes one per question.
#[test]
fn sampled_evaluation_draws_k_episodes_a_question() {
    use turnwise::trainer::eval::question_outcomes;
    let cfg = TrainConfig::resolve(Some("grpo"), None, &tiny_overrides()).unwrap();
    let mut t = Trainer::new(cfg).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    let (one, one_eps) = t.evaluate_samples(Split::Test, 4, 1.0, 7, 1).unwrap();
    let (r, eps) = t.evaluate_samples(Split::Test, 4, 1.0, 7, 4).unwrap();
    assert_eq!((r.n, r.samples, eps.len()), (4, 4, 16));
    assert!(one.pass_at.is_empty() && one.samples == 1);
    for (q, first) in one_eps.iter().enumerate() {
        let e = &eps[q * 4];
        assert_eq!(
            (e.question_id.as_str(), e.sample),
            (first.question_id.as_str(), 0)
        );
        // The same tokens (log-probs may differ in the last bit: another batch shape).
        let ids = |t: &turnwise_core::trajectory::Trajectory| {
            t.segments
                .iter()
                .map(|s| s.ids().to_vec())
                .collect::<Vec<_>>()
        };
        assert_eq!(ids(&e.trajectory), ids(&first.trajectory), "question {q}");
        assert_eq!(
            eps[q * 4 + 3].question_id,
            first.question_id,
            "a question's samples are consecutive"
        );
    }
    let mean = eps.iter().map(|e| e.em).sum::<f64>() / 16.0;
    assert!((r.em - mean).abs() < 1e-12);
    assert_eq!(r.pass_at.keys().copied().collect::<Vec<_>>(), vec![1, 2, 4]);
    assert!((r.pass_at[&1] - r.em).abs() < 1e-12);
    assert!(r.pass_at[&1] <= r.pass_at[&2] && r.pass_at[&2] <= r.pass_at[&4]);
    // pass@4 with 4 samples: the share of questions with at least one right episode.
    let any_right = eps
        .chunks(4)
        .filter(|c| c.iter().any(|e| e.em == 1.0))
        .count() as f64
        / 4.0;
    assert!((r.pass_at[&4] - any_right).abs() < 1e-12);
    let outcomes = question_outcomes(&eps);
    assert_eq!(outcomes.len(), 4);
    let m = r.to_metrics("eval/test/sampled");
    assert_eq!(m["eval/test/sampled/samples"], 4.0);
    assert_eq!(m["eval/test/sampled/mean@4"], r.em);
    assert_eq!(m["eval/test/sampled/pass@4"], r.pass_at[&4]);
    let back =
        turnwise::trainer::eval::EvalResult::from_metrics("test", "eval/test/sampled", |k| {
            m.get(k).copied()
        })
        .unwrap();
    assert_eq!((back.samples, back.pass_at.clone()), (4, r.pass_at.clone()));
    // Greedy decoding cannot draw several samples.
    let e = t.evaluate_samples(Split::Test, 4, 0.0, 7, 2).unwrap_err();
    assert!(e.to_string().contains("sampled decoding"), "{e}");
}

/// Evaluation shows the agent the context it trained on: with a memory window (GiGPO's and
/// T2PO's P = 4 turns) its later turns see only the last P turns, as in training rollouts. The
/// same seeds give the same first two turns (a window of 1 hides nothing before turn 2) and, in
/// some longer episode, another later turn; before this, evaluation always used the whole
/// history (watched red: identical episodes).
#[test]
fn evaluation_applies_the_memory_window() {
    let mut sets = tiny_overrides();
    sets.push("task.max_turns=6".into());
    let cfg = TrainConfig::resolve(Some("grpo"), None, &sets).unwrap();
    let mut t = Trainer::new(cfg).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    let turns = |e: &turnwise::trainer::eval::EvalEpisode| -> Vec<Vec<u32>> {
        e.trajectory
            .agent_segments()
            .map(|a| a.ids.clone())
            .collect()
    };
    let (_, full) = t.evaluate_samples(Split::Test, 8, 1.0, 3, 1).unwrap();
    t.config.rollout.memory_window = Some(1);
    let (_, windowed) = t.evaluate_samples(Split::Test, 8, 1.0, 3, 1).unwrap();
    let mut later_differs = false;
    for (a, b) in full.iter().zip(&windowed) {
        let (ta, tb) = (turns(a), turns(b));
        for k in 0..2.min(ta.len()).min(tb.len()) {
            assert_eq!(ta[k], tb[k], "{}: turn {k}", a.question_id);
        }
        later_differs |= ta.len() > 2 && ta != tb;
    }
    assert!(
        later_differs,
        "no episode's later turns changed under a window of 1: {:?}",
        full.iter()
            .map(|e| e.trajectory.num_turns())
            .collect::<Vec<_>>()
    );
}
