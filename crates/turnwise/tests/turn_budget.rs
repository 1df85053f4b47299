//! Per-episode turn budgets: each episode's turn may take `min(max_turn_tokens, room left in its
//! own response)` tokens, whatever the other episodes of the batch have used. A long episode
//! beside a fresh one must not cut the fresh one's turn: locally ([`step_turn`], the path of
//! chains, trees and evaluation), under the T2PO rollout control (the controlled engine) and on
//! the remote backend (`turnwise serve` on loopback, one `max_new_tokens` per request).

mod common;

use std::path::Path;

use turnwise::config::{AgentFormatName, TrainConfig};
use turnwise::rollout::{
    Decoding, EpisodeSpec, EpisodeState, Policy, RolloutControl, RolloutStats, step_turn,
    step_turn_with,
};
use turnwise::serve::{PolicyServer, ServeConfig, load_served};
use turnwise::task::{TaskSet, prompt_text};
use turnwise::trainer::Trainer;
use turnwise_env::world::Split;
use turnwise_model::sampling::{Completion, FinishReason};

/// Most tokens per turn in the test.
const MAX_TURN: usize = 16;
/// Response room the long episode has left when the batch steps.
const ROOM: usize = 3;

/// A tiny trainer of `preset` with its initial (untrained) weights: a near-uniform policy that
/// seldom samples a stop token, so a turn runs to its budget.
fn trainer(preset: &str, extra: &[String]) -> Trainer {
    let mut sets = common::tiny_overrides();
    sets.extend(extra.iter().cloned());
    Trainer::new(TrainConfig::resolve(Some(preset), None, &sets).unwrap()).unwrap()
}

fn decoding(max_response_tokens: usize) -> Decoding {
    Decoding {
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        max_turn_tokens: MAX_TURN,
        max_response_tokens,
    }
}

/// A fresh episode on training question `q`.
fn fresh(t: &Trainer, q: usize, seed: u64) -> EpisodeState {
    let qs = t.task.questions(Split::Train);
    let q = &qs[q];
    let spec = EpisodeSpec {
        id: format!("q{}-{seed}", q.id),
        prompt_uid: q.id.clone(),
        prompt_ids: t.tokenizer.encode(&prompt_text(&q.text)).unwrap(),
        task: TaskSet::env_task(q),
        seed,
    };
    EpisodeState::start(spec, Box::new(t.task.env().unwrap())).unwrap()
}

/// An episode that already took one long turn (an invalid action, answered with feedback), so
/// its response is much longer than a fresh one's.
fn long(t: &Trainer, policy: &Policy<'_>) -> EpisodeState {
    let mut s = fresh(t, 1, 77);
    let words = prompt_text(&t.task.questions(Split::Train)[0].text);
    let mut tokens = Vec::new();
    while tokens.len() < 60 {
        tokens.extend(t.tokenizer.encode(&words).unwrap());
    }
    let n = tokens.len();
    let turn = Completion {
        tokens,
        logprobs: vec![-1.0; n],
        entropies: vec![1.0; n],
        top_logprobs: vec![Vec::new(); n],
        finish: FinishReason::Length,
    };
    s.apply_turn(policy, turn, &decoding(10_000)).unwrap();
    assert!(!s.is_done());
    assert!(s.response_len() > n, "the feedback was appended");
    s
}

/// The tokens of the last agent turn of `s`.
fn last_turn(s: EpisodeState) -> Vec<u32> {
    s.finish()
        .trajectory
        .agent_segments()
        .last()
        .unwrap()
        .ids
        .clone()
}

/// Steps a fresh episode alone, then beside a long one whose response has only `ROOM` tokens
/// left (`step` generates one turn of the given states): the fresh episode's turn must be the
/// same tokens both times, and the long one's turn at most `ROOM` tokens.
fn check(
    t: &Trainer,
    policy: &Policy<'_>,
    step: &dyn Fn(&mut [&mut EpisodeState], &Decoding),
    label: &str,
) {
    let long_len = long(t, policy).response_len();
    let dec = decoding(long_len + ROOM);

    let mut alone = fresh(t, 0, 5);
    step(&mut [&mut alone], &dec);
    let alone = last_turn(alone);
    // Only a turn longer than the long episode's room can show a cut.
    assert!(
        alone.len() > ROOM,
        "{label}: the fresh episode's turn alone took {} tokens (≤ {ROOM}): nothing to cut",
        alone.len()
    );

    let mut l = long(t, policy);
    let mut f = fresh(t, 0, 5);
    step(&mut [&mut l, &mut f], &dec);
    let long_turn = last_turn(l);
    let beside = last_turn(f);
    assert!(
        long_turn.len() <= ROOM,
        "{label}: the long episode's turn took {} tokens with {ROOM} left",
        long_turn.len()
    );
    assert_eq!(
        beside.len(),
        alone.len(),
        "{label}: the fresh episode's turn took {} tokens beside a long episode with {ROOM} \
         tokens of room left, {} alone (another episode's length cut it)",
        beside.len(),
        alone.len()
    );
    assert_eq!(beside, alone, "{label}: the same turn, token for token");
}

#[test]
fn a_long_episode_does_not_cut_another_episodes_turn() {
    let t = trainer("grpo", &[]);
    let policy = t.rollout_policy();
    // The path of chains, tree frontiers and evaluation.
    check(
        &t,
        &policy,
        &|states, dec| step_turn(&policy, states, dec).unwrap(),
        "step_turn",
    );
}

#[test]
fn a_long_episode_does_not_cut_another_episodes_turn_under_rollout_control() {
    // The T2PO thinking intervention runs the turns on the controlled engine (`signal_turns`).
    let t = trainer("t2po", &[]);
    let mut r = t.config.rollout.clone();
    r.tds.enabled = false;
    r.memory_window = None;
    r.tti.enabled = true;
    let control = RolloutControl::from_config(&r, AgentFormatName::T2po, &t.tokenizer).unwrap();
    assert!(control.needs_signal());
    let policy = t.rollout_policy();
    check(
        &t,
        &policy,
        &|states, dec| {
            step_turn_with(
                &policy,
                states,
                dec,
                &control,
                None,
                &mut RolloutStats::default(),
            )
            .unwrap()
        },
        "rollout control",
    );
}

fn serve(folder: &Path) -> PolicyServer {
    let config = ServeConfig {
        addr: "127.0.0.1:0".parse().unwrap(),
        max_queue: 64,
        ..Default::default()
    };
    PolicyServer::start(load_served(folder).unwrap(), &config).unwrap()
}

#[test]
fn a_long_episode_does_not_cut_another_episodes_turn_on_the_remote_backend() {
    let tmp = tempfile::tempdir().unwrap();
    let local = trainer("grpo", &[]);
    let w0 = tmp.path().join("w0");
    local.export(&w0).unwrap();
    let server = serve(&w0);
    let t = trainer(
        "grpo",
        &[
            "rollout.backend=\"remote\"".into(),
            format!("rollout.remote.urls=[\"{}\"]", server.url()),
        ],
    );
    let policy = t.rollout_policy();
    assert!(policy.remote.is_some());
    check(
        &t,
        &policy,
        &|states, dec| step_turn(&policy, states, dec).unwrap(),
        "remote",
    );
}
