//! DAPO (spec §2.7, §6.4): the group filter is off unless asked for and compares accuracy (as
//! verl's DAPO recipe), dynamic sampling refills the batch from further generation rounds, and
//! the overlong penalty shapes the scores.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use turnwise::config::{FilterMetric, TrainConfig, presets};
use turnwise::trainer::Trainer;
use turnwise::trainer::advantage::informative_groups;
use turnwise::trainer::sampling::{ScoredEpisode, StepBatch};
use turnwise_core::reward::{RewardInput, TurnText, overlong_penalty};

fn config(preset: &str, extra: &[&str]) -> TrainConfig {
    let mut sets = common::tiny_overrides();
    sets.extend(extra.iter().map(|s| s.to_string()));
    TrainConfig::resolve(Some(preset), None, &sets).unwrap()
}

/// Room for whole boxed-format turns (the tiny overrides' 12-token turns cut most short).
const ROOM: [&str; 2] = [
    "rollout.max_turn_tokens=48",
    "rollout.max_response_tokens=240",
];

/// One warm start, shared by the tests that need it, that answers some training questions right
/// and others wrong (a longer warm start on noise-free demonstrations: about one sampled answer
/// in five is right), exported as a Hugging Face folder.
fn sometimes_right_warm_start() -> std::path::PathBuf {
    use std::sync::Mutex;
    static DIR: Mutex<Option<tempfile::TempDir>> = Mutex::new(None);
    let mut dir = DIR.lock().unwrap();
    if dir.is_none() {
        let mut sets = ROOM.to_vec();
        sets.extend([
            "sft.steps=300",
            "sft.batch_size=8",
            "sft.lr=4e-3",
            "sft.noise=0",
        ]);
        let mut t = Trainer::new(config("dapo", &sets)).unwrap();
        t.warm_start(&mut |_, _, _| {}).unwrap();
        let d = tempfile::tempdir().unwrap();
        t.export(d.path()).unwrap();
        *dir = Some(d);
    }
    dir.as_ref().unwrap().path().to_path_buf()
}

/// A DAPO trainer from [`sometimes_right_warm_start`], with the filter on and an overlong
/// buffer over most of the response bound, so that nearly every response's score carries a
/// length penalty: groups tie in accuracy far more often than in score.
fn sometimes_right(extra: &[&str]) -> Trainer {
    let init = format!(
        "model.init_from=\"{}\"",
        sometimes_right_warm_start().display()
    );
    let mut sets = ROOM.to_vec();
    sets.extend([
        init.as_str(),
        "sft.steps=0",
        "overlong_buffer.len=200",
        "rollout.filter_zero_variance_groups=true",
    ]);
    sets.extend(extra);
    let mut t = Trainer::new(config("dapo", &sets)).unwrap();
    t.freeze_reference().unwrap();
    t
}

/// The episodes of each group of `b`, by group id.
fn by_group(b: &StepBatch) -> BTreeMap<usize, Vec<usize>> {
    let mut m: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, e) in b.episodes.iter().enumerate() {
        m.entry(e.group).or_default().push(i);
    }
    m
}

/// Whether `value` differs between the episodes `idx` of `b`.
fn differ(b: &StepBatch, value: impl Fn(&ScoredEpisode) -> f64, idx: &[usize]) -> bool {
    idx.iter()
        .any(|&i| value(&b.episodes[i]) != value(&b.episodes[idx[0]]))
}

#[test]
fn the_group_filter_is_on_in_the_dapo_preset_only() {
    for name in presets::names() {
        let cfg = TrainConfig::resolve(Some(name), None, &[]).unwrap();
        assert_eq!(
            cfg.rollout.filter_zero_variance_groups,
            name == "dapo",
            "{name}"
        );
        assert_eq!(cfg.overlong_buffer.enable, name == "dapo", "{name}");
    }
    let dapo = TrainConfig::resolve(Some("dapo"), None, &[]).unwrap();
    assert_eq!(dapo.rollout.max_num_gen_batches, 3);
    // The buffer scales with the response bound: 2000 of 6192 tokens (spec §8.1).
    let core = dapo
        .overlong_buffer
        .to_core(dapo.rollout.max_response_tokens);
    assert_eq!(core.max_len, 400);
    assert_eq!(core.buffer_len, 129);
    let bad = ["rollout.max_num_gen_batches=0".to_string()];
    assert!(TrainConfig::resolve(Some("dapo"), None, &bad).is_err());
    // The filter compares accuracy, as verl's DAPO recipe (filter_groups.metric = acc); the
    // score before or after the overlong penalty can be asked for.
    assert_eq!(dapo.rollout.filter_metric, FilterMetric::Acc);
    assert_eq!(
        TrainConfig::default().rollout.filter_metric,
        FilterMetric::Acc
    );
    for (name, metric) in [
        ("score", FilterMetric::Score),
        ("seq_reward", FilterMetric::SeqReward),
    ] {
        let set = [format!("rollout.filter_metric=\"{name}\"")];
        let cfg = TrainConfig::resolve(Some("dapo"), None, &set).unwrap();
        assert_eq!(cfg.rollout.filter_metric, metric);
    }
    let bad = ["rollout.filter_metric=\"length\"".to_string()];
    assert!(TrainConfig::resolve(Some("dapo"), None, &bad).is_err());
}

/// With the filter on, every step trains on `prompts_per_step` informative groups when the
/// rounds allow it, refilling from further rounds when the first falls short; the batch
/// metrics say what happened. (The warm start answers some questions right: groups of two
/// rollouts are informative when exactly one of them is.)
#[test]
fn dynamic_sampling_refills_the_batch() {
    let mut t = sometimes_right(&[
        "rollout.max_num_gen_batches=4",
        "rollout.prompts_per_step=3",
        "rollout.group_size=2",
    ]);
    let (p, g) = (3.0, 2.0);
    let (mut refilled, mut full) = (0, 0);
    for _ in 0..4 {
        let out = t.rl_step().unwrap();
        let m = &out.metrics;
        let (informative, rounds, filtered, kept) = (
            m["batch/informative_groups"],
            m["batch/refill_rounds"],
            m["batch/filtered_groups"],
            m["batch/kept_rollouts"],
        );
        // Every generated episode is reported, refill rounds included.
        assert_eq!(out.episodes.len() as f64, (rounds + 1.0) * p * g, "{m:?}");
        assert_eq!(informative + filtered, (rounds + 1.0) * p, "{m:?}");
        if informative >= p {
            assert_eq!(kept, p * g, "{m:?}");
            full += 1;
        } else {
            // Short after the bound: trains on what it has.
            assert_eq!(rounds, 3.0, "{m:?}");
            assert_eq!(kept, informative * g, "{m:?}");
        }
        refilled += usize::from(rounds > 0.0);
    }
    assert!(refilled > 0, "no step needed a refill round");
    assert!(
        full > 0,
        "no step reached prompts_per_step informative groups"
    );
}

/// On real rollouts the filter keeps exactly the groups whose accuracy differs (some right,
/// some wrong) and drops the others, among them all-wrong groups whose scores differ only by
/// their overlong penalties (their lengths), which the overlong-shaped score (verl's
/// `seq_reward`, `rollout.filter_metric = "seq_reward"`) would have kept.
#[test]
fn the_filter_keeps_mixed_accuracy_and_drops_length_noise() {
    let mut t = sometimes_right(&[
        "rollout.max_num_gen_batches=2",
        "rollout.prompts_per_step=4",
        "rollout.group_size=3",
    ]);
    let seq_reward = {
        let mut c = t.config.clone();
        c.rollout.filter_metric = FilterMetric::SeqReward;
        c
    };
    let (mut mixed, mut length_noise, mut all_right_or_wrong) = (0, 0, 0);
    for _ in 0..3 {
        let (all, selected, _) = t.sample_batch().unwrap();
        let sel = selected.expect("the filter is on");
        let kept: BTreeSet<usize> = sel.episodes.iter().map(|e| e.group).collect();
        let by_shaped = informative_groups(&seq_reward, &all.episodes);
        for (grp, idx) in by_group(&all) {
            let right_and_wrong = differ(&all, |e| e.em, &idx);
            if kept.contains(&grp) {
                assert!(right_and_wrong, "kept a group of tied accuracy: {idx:?}");
                mixed += 1;
                continue;
            }
            // Dropped: tied accuracy, or past the first prompts_per_step informative groups.
            if right_and_wrong {
                assert_eq!(kept.len(), 4, "group {grp} of mixed accuracy dropped");
                continue;
            }
            all_right_or_wrong += 1;
            let wrong = idx.iter().all(|&i| all.episodes[i].em == 0.0);
            let tied_reward = !differ(&all, |e| e.reward_score, &idx);
            if wrong && tied_reward && differ(&all, |e| e.score, &idx) {
                // All wrong, the same reward, lengths apart: only the overlong penalty
                // differs. The shaped score would call it informative; accuracy does not.
                assert!(by_shaped.contains(&grp));
                length_noise += 1;
            }
        }
    }
    assert!(mixed > 0, "no group of mixed accuracy was kept");
    assert!(all_right_or_wrong > 0, "no group of tied accuracy");
    assert!(
        length_noise > 0,
        "no all-wrong group whose scores differ only by length"
    );
}

/// The filter on accuracy, on rollouts played through the environment and scored as a step
/// scores them: a group with one right and one wrong answer is informative; all-wrong and
/// all-right groups whose lengths (so overlong penalties) differ are not, unless the filter is
/// asked to compare the overlong-shaped score.
#[test]
fn accuracy_decides_on_played_rollouts() {
    use turnwise_env::world::Split;
    let cfg = config(
        "dapo",
        &[
            "overlong_buffer.len=60",
            "rollout.filter_zero_variance_groups=true",
        ],
    );
    let t = Trainer::new(cfg).unwrap();
    let q = t.task.questions(Split::Train)[0];
    let gold = turnwise::task::TaskSet::env_task(q).answers;
    let answer = |text: &str, long: bool| {
        let thought = if long {
            [q.text.as_str(); 10].join(" ")
        } else {
            "I know it.".to_string()
        };
        format!("<think>{thought}</think><answer>\\boxed{{{text}}}</answer>")
    };
    let wrong_text = t
        .task
        .questions(Split::Train)
        .iter()
        .map(|o| turnwise::task::TaskSet::env_task(o).answers[0].clone())
        .find(|a| !gold.contains(a))
        .unwrap();
    let core = t
        .config
        .overlong_buffer
        .to_core(t.config.rollout.max_response_tokens);
    // (group, answer, long)
    let plan = [
        (0, gold[0].as_str(), false),
        (0, wrong_text.as_str(), false),
        (1, wrong_text.as_str(), false),
        (1, wrong_text.as_str(), true),
        (2, gold[0].as_str(), false),
        (2, gold[0].as_str(), true),
    ];
    let mut b: Vec<ScoredEpisode> = Vec::new();
    for (g, text, long) in plan {
        let ep = common::play_turns(&t, q, &[answer(text, long)]);
        let out = t.task.score_episode(&t.config.reward, &ep, &gold).unwrap();
        let penalty = overlong_penalty(ep.trajectory.response_len(), &core);
        let mut e = ScoredEpisode::new(ep, g, out.score + penalty, out.turn_rewards);
        e.em = out.em;
        e.reward_score = out.score;
        e.overlong = penalty;
        b.push(e);
    }
    let ems: Vec<f64> = b.iter().map(|e| e.em).collect();
    let reward_scores: Vec<f64> = b.iter().map(|e| e.reward_score).collect();
    let overlong: Vec<f64> = b.iter().map(|e| e.overlong).collect();
    assert_eq!(ems, [1.0, 0.0, 0.0, 0.0, 1.0, 1.0], "{reward_scores:?}");
    assert_eq!(reward_scores, ems, "every format passes");
    assert!(overlong[3] < 0.0 && overlong[5] < 0.0, "{overlong:?}");
    assert_eq!((overlong[2], overlong[4]), (0.0, 0.0));
    let keep = |metric: FilterMetric| {
        let mut cfg = t.config.clone();
        cfg.rollout.filter_metric = metric;
        informative_groups(&cfg, &b)
    };
    assert_eq!(keep(FilterMetric::Acc), BTreeSet::from([0]));
    assert_eq!(keep(FilterMetric::Score), BTreeSet::from([0]));
    assert_eq!(keep(FilterMetric::SeqReward), BTreeSet::from([0, 1, 2]));
}

/// Through the trainer's scoring: with the overlong penalty on, each long episode's score is
/// the reward's score plus exactly the penalty of its length and each short one's is the
/// reward's score; with it off, every score is the reward's.
#[test]
fn overlong_penalty_lowers_long_responses_only() {
    let make = |on: bool| {
        let on = format!("overlong_buffer.enable={on}");
        let cfg = config(
            "dapo",
            &[
                &on,
                "overlong_buffer.len=30",
                "rollout.filter_zero_variance_groups=false",
                "rollout.prompts_per_step=6",
                "rollout.group_size=2",
                "sft.steps=150",
            ],
        );
        let mut t = Trainer::new(cfg).unwrap();
        t.warm_start(&mut |_, _, _| {}).unwrap();
        t.freeze_reference().unwrap();
        t
    };
    // The reward's own score of an episode.
    let raw = |t: &Trainer, e: &turnwise::rollout::Episode| {
        let turns: Vec<TurnText<'_>> = e
            .turn_texts
            .iter()
            .map(|(g, o)| TurnText {
                generated: g,
                observation: o.as_deref(),
            })
            .collect();
        let golds = t
            .task
            .rl_questions()
            .iter()
            .find(|q| e.trajectory.id.contains(&format!("-{}-", q.id)))
            .map(|q| turnwise::task::TaskSet::env_task(q).answers)
            .unwrap();
        t.config
            .reward
            .score(&RewardInput::from_turns(&turns, &golds))
            .unwrap()
            .score
    };
    let mut on = make(true);
    let core = on
        .config
        .overlong_buffer
        .to_core(on.config.rollout.max_response_tokens);
    assert_eq!((core.max_len, core.buffer_len), (120, 30));
    let (mut long, mut short) = (0, 0);
    for _ in 0..4 {
        let out = on.rl_step().unwrap();
        let mut penalties = Vec::new();
        for e in &out.episodes {
            let (len, r) = (e.trajectory.response_len(), raw(&on, e));
            let score = e.trajectory.outcome_reward.unwrap();
            let p = overlong_penalty(len, &core);
            penalties.push(p);
            if len > 90 {
                long += 1;
                assert!(p < 0.0);
                assert!((score - (r + p)).abs() < 1e-12, "{score} vs {r} + {p}");
            } else {
                short += 1;
                assert_eq!(score, r, "a short response ({len} tokens) was penalised");
            }
        }
        let mean = penalties.iter().sum::<f64>() / penalties.len() as f64;
        assert!((out.metrics["reward/overlong_penalty/mean"] - mean).abs() < 1e-12);
        if long > 0 && short > 0 {
            break;
        }
    }
    assert!(long > 0 && short > 0, "long {long}, short {short}");
    let mut off = make(false);
    let out = off.rl_step().unwrap();
    assert!(
        out.episodes
            .iter()
            .any(|e| e.trajectory.response_len() > 90)
    );
    for e in &out.episodes {
        assert_eq!(e.trajectory.outcome_reward.unwrap(), raw(&off, e));
    }
    assert!(!out.metrics.contains_key("reward/overlong_penalty/mean"));
}

/// A step whose every group ties on the reward learns nothing, and says so
/// (cli-as-a-user-3.md m3: a tiny run with every group all −1 trained six steps at grad 0
/// without a word): its metrics carry `batch/zero_signal = 1` (with a warning naming the step),
/// and a step with signal has no such metric.
#[test]
fn a_step_whose_every_group_ties_is_reported() {
    // The probe's run: a fresh policy and no warm start, so every rollout fails alike.
    let mut t = Trainer::new(config("grpo", &["sft.steps=0"])).unwrap();
    t.freeze_reference().unwrap();
    let (all, selected, m) = t.sample_batch().unwrap();
    assert!(selected.is_none(), "grpo does not filter");
    for idx in by_group(&all).values() {
        assert!(!differ(&all, |e| e.score, idx), "a group with signal");
    }
    assert_eq!(m.get("batch/zero_signal"), Some(&1.0), "{m:?}");
    let out = t.rl_step().unwrap();
    assert_eq!(out.metrics.get("batch/zero_signal"), Some(&1.0));

    // A policy that is sometimes right: the filter keeps the groups that differ, and a step
    // is reported only when none of those it trains on differs in the score it reads.
    let mut t = sometimes_right(&["rollout.prompts_per_step=3", "rollout.group_size=2"]);
    let mut with_signal = 0;
    for _ in 0..3 {
        let (_, selected, m) = t.sample_batch().unwrap();
        let selected = selected.expect("the filter is on");
        let signal = by_group(&selected)
            .values()
            .any(|idx| differ(&selected, |e| e.score, idx));
        assert_eq!(m.contains_key("batch/zero_signal"), !signal, "{m:?}");
        with_signal += usize::from(signal);
    }
    assert!(with_signal > 0, "no step with signal to compare with");
}

/// A DAPO step whose filter keeps at most one mini-batch of rows trains one on-policy optimizer
/// step instead of the preset's structure (review E, P3: it used to do so without a word): its
/// metrics carry `actor/on_policy_fallback = 1` (with a warning naming the step and the counts),
/// and a step that keeps more rows has no such metric and its several optimizer steps.
#[test]
fn a_step_shrunk_to_one_on_policy_mini_batch_is_reported() {
    // A full batch is 4 groups of 3 rows in mini-batches of 6 (2 optimizer steps). Without a
    // refill a step trains on the 0-4 informative groups of one round; without the filter, on
    // all 4.
    let structure = [
        "rollout.prompts_per_step=4",
        "rollout.group_size=3",
        "optim.mini_batch_size=6",
    ];
    let mut shrunk_steps = 0;
    for filter in [true, false] {
        let mut sets = structure.to_vec();
        sets.push("rollout.max_num_gen_batches=1");
        if !filter {
            sets.push("rollout.filter_zero_variance_groups=false");
        }
        let mut t = sometimes_right(&sets);
        for _ in 0..3 {
            let out = t.rl_step().unwrap();
            let m = &out.metrics;
            let kept = if filter {
                m["batch/informative_groups"].min(4.0) as usize
            } else {
                4
            };
            let shrunk = kept > 0 && kept * 3 <= 6;
            assert_eq!(m.contains_key("actor/on_policy_fallback"), shrunk, "{m:?}");
            let steps = if shrunk { 1.0 } else { 2.0 };
            if kept > 0 {
                assert_eq!(m["actor/optimizer_steps"], steps, "{m:?}");
            }
            shrunk_steps += usize::from(shrunk);
        }
    }
    assert!(shrunk_steps > 0, "no step kept at most one mini-batch");
}
