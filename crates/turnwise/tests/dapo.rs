//! DAPO (spec §2.7, §6.4): the group filter is off unless asked for, dynamic sampling refills
//! the batch from further generation rounds, and the overlong penalty shapes the scores.

mod common;

use turnwise::config::{TrainConfig, presets};
use turnwise::trainer::Trainer;
use turnwise_core::reward::{RewardInput, TurnText, overlong_penalty};

fn config(preset: &str, extra: &[&str]) -> TrainConfig {
    let mut sets = common::tiny_overrides();
    sets.extend(extra.iter().map(|s| s.to_string()));
    TrainConfig::resolve(Some(preset), None, &sets).unwrap()
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
}

/// With the filter on, every step trains on `prompts_per_step` informative groups when the
/// rounds allow it, refilling from further rounds when the first falls short; the batch
/// metrics say what happened. (The tiny model answers nothing right; the overlong penalty of
/// responses 119 or 120 tokens long makes some groups' scores differ and others tie.)
#[test]
fn dynamic_sampling_refills_the_batch() {
    let cfg = config(
        "dapo",
        &[
            "rollout.filter_zero_variance_groups=true",
            "rollout.max_num_gen_batches=4",
            "rollout.prompts_per_step=3",
            "rollout.group_size=2",
        ],
    );
    let (p, g) = (3.0, 2.0);
    let mut t = Trainer::new(cfg).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    t.freeze_reference().unwrap();
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
        // Only informative groups were kept: each kept group's scores differ.
        refilled += usize::from(rounds > 0.0);
    }
    assert!(refilled > 0, "no step needed a refill round");
    assert!(
        full > 0,
        "no step reached prompts_per_step informative groups"
    );
}

/// The filter keeps informative groups only and never a group whose scores tie (no IG, no
/// turn rewards with `grpo`).
#[test]
fn kept_groups_are_informative() {
    let cfg = config(
        "dapo",
        &[
            "rollout.filter_zero_variance_groups=true",
            "rollout.max_num_gen_batches=2",
            "rollout.prompts_per_step=4",
            "rollout.group_size=2",
        ],
    );
    let mut t = Trainer::new(cfg).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    t.freeze_reference().unwrap();
    let (mut dropped, mut kept) = (0usize, 0usize);
    for _ in 0..2 {
        let (all, selected, _) = t.sample_batch().unwrap();
        let sel = selected.expect("the filter is on");
        for grp in sel
            .groups
            .iter()
            .copied()
            .collect::<std::collections::BTreeSet<_>>()
        {
            let s: Vec<f64> = (0..sel.groups.len())
                .filter(|&i| sel.groups[i] == grp)
                .map(|i| sel.scores[i])
                .collect();
            assert!(s.iter().any(|&x| x != s[0]), "a tied group was kept: {s:?}");
        }
        assert!(sel.num_groups() <= all.num_groups());
        dropped += all.episodes.len() - sel.episodes.len();
        kept += sel.episodes.len();
    }
    assert!(dropped > 0, "the filter dropped nothing");
    assert!(kept > 0, "the filter kept nothing");
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
            .map(|q| turnwise::task::WorldTask::env_task(q).answers)
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
