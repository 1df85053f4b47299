//! An episode keeps its context's keys and values across turns (issue 30 item 1): the next
//! turn prefills only its observation. Greedy turns give the same token ids and log-probs
//! within 1e-5 as turns that prefill the whole context again, on the local path of chains,
//! trees and evaluation ([`step_turn`]) and under the T2PO rollout control.

mod common;

use turnwise::config::{AgentFormatName, TrainConfig};
use turnwise::rollout::{
    Decoding, EpisodeSpec, EpisodeState, Policy, RolloutControl, RolloutStats, step_turn_with,
};
use turnwise::task::{TaskSet, prompt_text};
use turnwise::trainer::Trainer;
use turnwise_env::world::Split;

fn trainer(preset: &str) -> Trainer {
    Trainer::new(TrainConfig::resolve(Some(preset), None, &common::tiny_overrides()).unwrap())
        .unwrap()
}

fn decoding() -> Decoding {
    Decoding {
        temperature: 0.0,
        top_p: 1.0,
        top_k: 0,
        max_turn_tokens: 12,
        max_response_tokens: 400,
    }
}

fn episodes(t: &Trainer) -> Vec<EpisodeState> {
    let qs = t.task.questions(Split::Train);
    (0..6)
        .map(|i| {
            let q = &qs[i % qs.len()];
            let spec = EpisodeSpec {
                id: format!("e{i}"),
                prompt_uid: q.id.clone(),
                prompt_ids: t.tokenizer.encode(&prompt_text(&q.text)).unwrap(),
                task: TaskSet::env_task(q),
                seed: i as u64,
            };
            EpisodeState::start(spec, Box::new(t.task.env().unwrap())).unwrap()
        })
        .collect()
}

/// Every agent turn's (ids, log-probs) of each episode after `turns` turns, with the cached
/// context kept (`reuse`) or forgotten before each turn; checks the cache after each turn.
fn roll(
    policy: &Policy<'_>,
    t: &Trainer,
    control: &RolloutControl,
    reuse: bool,
    turns: usize,
) -> Vec<Vec<(Vec<u32>, Vec<f64>)>> {
    let mut states = episodes(t);
    let mut cached_turns = 0;
    for _ in 0..turns {
        if !reuse {
            states.iter_mut().for_each(EpisodeState::forget_context_kv);
        }
        let mut refs: Vec<&mut EpisodeState> = states.iter_mut().collect();
        step_turn_with(
            policy,
            &mut refs,
            &decoding(),
            control,
            None,
            &mut RolloutStats::default(),
        )
        .unwrap();
        for s in &states {
            if s.is_done() {
                assert!(
                    s.context_kv().is_none(),
                    "a finished episode keeps no cache"
                );
                continue;
            }
            let kv = s
                .context_kv()
                .expect("a live episode keeps its context's cache");
            let context = s.context();
            assert!(
                context.starts_with(kv.tokens()) && kv.len() < context.len(),
                "the cache holds a prefix of the context ({} of {} tokens)",
                kv.len(),
                context.len()
            );
            cached_turns += 1;
        }
    }
    assert!(cached_turns > 0, "no episode lived past its first turn");
    states
        .into_iter()
        .map(|s| {
            s.finish()
                .trajectory
                .agent_segments()
                .map(|a| {
                    let lp = a.logprobs.iter().map(|&x| f64::from(x)).collect();
                    (a.ids.clone(), lp)
                })
                .collect()
        })
        .collect()
}

fn assert_same(a: &[Vec<(Vec<u32>, Vec<f64>)>], b: &[Vec<(Vec<u32>, Vec<f64>)>], label: &str) {
    let mut turns = 0;
    for (ea, eb) in a.iter().zip(b) {
        assert_eq!(ea.len(), eb.len(), "{label}: turns per episode");
        for ((ia, la), (ib, lb)) in ea.iter().zip(eb) {
            assert_eq!(ia, ib, "{label}: greedy ids");
            for (x, y) in la.iter().zip(lb) {
                assert!((x - y).abs() < 1e-5, "{label}: log-prob {x} against {y}");
            }
            turns += 1;
        }
    }
    assert!(
        turns > a.len(),
        "{label}: several turns per episode ({turns})"
    );
}

#[test]
fn turns_from_the_cached_context_equal_full_prefills() {
    let t = trainer("grpo");
    let policy = t.rollout_policy();
    let control = RolloutControl::default();
    let cached = roll(&policy, &t, &control, true, 3);
    let fresh = roll(&policy, &t, &control, false, 3);
    assert_same(&cached, &fresh, "step_turn");
}

#[test]
fn the_t2po_control_reuses_the_cached_context_too() {
    // The thinking intervention runs the turns on the controlled engine (`signal_turns`); no
    // memory window, so that every turn's context extends the last one's.
    let t = trainer("t2po");
    let mut r = t.config.rollout.clone();
    r.memory_window = None;
    r.tti.enabled = true;
    let control = RolloutControl::from_config(&r, AgentFormatName::T2po, &t.tokenizer).unwrap();
    assert!(control.needs_signal());
    let policy = t.rollout_policy();
    let cached = roll(&policy, &t, &control, true, 3);
    let fresh = roll(&policy, &t, &control, false, 3);
    assert_same(&cached, &fresh, "t2po control");
}

#[test]
fn a_group_prefills_its_shared_prompt_once() {
    let t = trainer("grpo");
    let policy = t.rollout_policy();
    let control = RolloutControl::default();
    let qs = t.task.questions(Split::Train);
    // Two groups: four episodes of question 0, three of question 1 (GRPO's rollouts of a
    // prompt), each with its own seed.
    let start = |q: usize, seed: u64| {
        let q = &qs[q];
        let spec = EpisodeSpec {
            id: format!("{}-{seed}", q.id),
            prompt_uid: q.id.clone(),
            prompt_ids: t.tokenizer.encode(&prompt_text(&q.text)).unwrap(),
            task: TaskSet::env_task(q),
            seed,
        };
        EpisodeState::start(spec, Box::new(t.task.env().unwrap())).unwrap()
    };
    let specs: Vec<(usize, u64)> = vec![(0, 1), (0, 2), (0, 3), (0, 4), (1, 5), (1, 6), (1, 7)];
    let first_turn = |batch: &mut [EpisodeState]| {
        let mut stats = RolloutStats::default();
        let mut refs: Vec<&mut EpisodeState> = batch.iter_mut().collect();
        step_turn_with(&policy, &mut refs, &decoding(), &control, None, &mut stats).unwrap();
        stats
    };
    let mut together: Vec<EpisodeState> = specs.iter().map(|&(q, s)| start(q, s)).collect();
    let prompt_len = |q: usize| t.tokenizer.encode(&prompt_text(&qs[q].text)).unwrap().len();
    let stats = first_turn(&mut together);
    // Every row of a group starts from the group's one prefill of its prompt (all but its last
    // token).
    let expected = 4 * (prompt_len(0) - 1) + 3 * (prompt_len(1) - 1);
    assert_eq!(
        stats.cached_context_tokens, expected,
        "prompt tokens served from the group's shared prefill"
    );
    let total = 4 * prompt_len(0) + 3 * prompt_len(1);
    let fraction = stats.metrics(&control)["rollout/cached_context_fraction"];
    assert!(
        (fraction - expected as f64 / total as f64).abs() < 1e-12,
        "{fraction}"
    );
    // Each episode alone (no group to share with) samples the same turn.
    let together: Vec<_> = together.into_iter().map(EpisodeState::finish).collect();
    for (k, &(q, s)) in specs.iter().enumerate() {
        let mut alone = vec![start(q, s)];
        assert_eq!(
            first_turn(&mut alone).cached_context_tokens,
            0,
            "nothing shared alone"
        );
        let a = alone.pop().unwrap().finish();
        let x = a.trajectory.agent_segments().next().unwrap();
        let y = together[k].trajectory.agent_segments().next().unwrap();
        assert_eq!(x.ids, y.ids, "episode {k}: greedy ids");
        for (u, v) in x.logprobs.iter().zip(&y.logprobs) {
            assert!(
                (u - v).abs() < 1e-5,
                "episode {k}: log-prob {u} against {v}"
            );
        }
    }
}
