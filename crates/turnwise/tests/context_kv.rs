//! An episode keeps its context's keys and values across turns (issue 30 item 1): the next
//! turn prefills only its observation. Greedy turns give the same token ids and log-probs
//! within 1e-5 as turns that prefill the whole context again, on the local path of chains,
//! trees and evaluation ([`step_turn`]) and under the T2PO rollout control.

mod common;

use turnwise::config::{AgentFormatName, TrainConfig};
use turnwise::rollout::{
    Decoding, EpisodeSpec, EpisodeState, Policy, RolloutControl, RolloutStats, step_turn_with,
};
use turnwise::task::{WorldTask, prompt_text};
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
                task: WorldTask::env_task(q),
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
