//! The information-gain probe pipeline (spec §4) end to end on a tiny model: episodes played
//! through the rollout's bookkeeping (`Episode::observation_spans`), probed by
//! `rollout::info_gain::probe`, against a direct computation of the gold answer's log-prob with
//! and without each observation through the model's own forward pass. The legitimate shapes (an
//! answered episode, one cut by the turn limit, one cut by the response length right after an
//! observation) give one gain per process turn; an episode whose observations do not line up
//! with its process turns is an error naming it, in the probe and in the advantage glue.

mod common;

use turnwise::config::TrainConfig;
use turnwise::rollout::info_gain::{InfoGainMismatch, probe, probe_suffix_text};
use turnwise::rollout::{Decoding, Episode, EpisodeSpec, EpisodeState};
use turnwise::task::{QaItem, TaskSet};
use turnwise::trainer::Trainer;
use turnwise::trainer::advantage::compute;
use turnwise_core::trajectory::{FinishReason, Segment};
use turnwise_env::world::Split;
use turnwise_model::sampling::{Completion, FinishReason as StopReason};

/// A tiny A2TGPO trainer warm-started for `sft_steps` steps. After 150 steps at lr 1e-2 the
/// gold answer's probability depends on the context (gains of 0.004 to 0.03, so a gain of 0,
/// or one taken at the wrong cut, is far from the truth at the tolerance 1e-5).
fn trainer(sft_steps: u64) -> Trainer {
    let mut sets = common::tiny_overrides();
    sets.extend([format!("sft.steps={sft_steps}"), "sft.lr=1e-2".to_string()]);
    let cfg = TrainConfig::resolve(Some("a2tgpo"), None, &sets).unwrap();
    let mut t = Trainer::new(cfg).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    t
}

/// The oracle's agent turns for training question `q` (tool calls, then the answer).
fn oracle(t: &Trainer, q: usize) -> Vec<String> {
    let demo = &t.task.demonstrations(Split::Train, 0.0, 0).unwrap()[q];
    let question = t.task.questions(Split::Train)[q];
    assert_eq!(demo.prompt, t.task.prompt(question).unwrap());
    demo.segments
        .iter()
        .filter(|(_, agent)| *agent)
        .map(|(s, _)| s.clone())
        .collect()
}

/// Plays `texts` as the agent's turns on training question `q` through the rollout's episode
/// bookkeeping, with response budget `max_response_tokens`; stops once the episode is done.
fn play(t: &Trainer, q: usize, id: &str, texts: &[String], max_response_tokens: usize) -> Episode {
    let q: &QaItem = t.task.questions(Split::Train)[q];
    let policy = t.rollout_policy();
    let decoding = Decoding {
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        max_turn_tokens: 64,
        max_response_tokens,
    };
    let spec = EpisodeSpec {
        id: id.to_string(),
        prompt_uid: q.id.clone(),
        prompt_ids: t.tokenizer.encode(&t.task.prompt(q).unwrap()).unwrap(),
        task: TaskSet::env_task(q),
        seed: 0,
    };
    let mut state = EpisodeState::start(spec, Box::new(t.task.env().unwrap())).unwrap();
    for text in texts {
        if state.is_done() {
            break;
        }
        let tokens = t.tokenizer.encode(text).unwrap();
        let n = tokens.len();
        let completion = Completion {
            tokens,
            logprobs: vec![-0.5; n],
            entropies: vec![0.5; n],
            top_logprobs: vec![Vec::new(); n],
            finish: StopReason::Length,
        };
        state.apply_turn(&policy, completion, &decoding).unwrap();
    }
    state.finish()
}

/// `p = exp(mean log π(gold | context, suffix before the gold))`, straight from the model's
/// logits on the unpadded probe (log-softmax in f64).
fn gold_probability(t: &Trainer, context: &[u32], gold: &str) -> f64 {
    let (before, after) = probe_suffix_text(t.config.task.format);
    let before = t.tokenizer.encode(before).unwrap();
    let gold = t.tokenizer.encode(gold).unwrap();
    let after = t.tokenizer.encode(after).unwrap();
    assert!(!gold.is_empty());
    let mut ids = context.to_vec();
    ids.extend(&before);
    let start = ids.len();
    ids.extend(&gold);
    ids.extend(&after);
    let logits = t
        .sampler
        .forward_sequence(&ids)
        .unwrap()
        .to_dtype(candle_core::DType::F32)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let mut sum = 0.0;
    for k in start..start + gold.len() {
        let row = &logits[k - 1];
        let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let lse = max
            + row
                .iter()
                .map(|&x| (x as f64 - max).exp())
                .sum::<f64>()
                .ln();
        sum += row[ids[k] as usize] as f64 - lse;
    }
    (sum / gold.len() as f64).exp()
}

/// The direct information gains of `ep`: per observation `o_t` (found from the trajectory's
/// segments, not from `observation_spans`), `p(after o_t) − p(before it)`; also checks that the
/// recorded observation spans are where those segments lie.
fn direct_gains(t: &Trainer, ep: &Episode, gold: &str) -> Vec<f64> {
    let traj = &ep.trajectory;
    let mut context = traj.prompt_ids.clone();
    let mut p = vec![gold_probability(t, &context, gold)];
    let mut observation = 0;
    for seg in &traj.segments {
        let start = context.len() - traj.prompt_ids.len();
        context.extend(seg.ids());
        if let Segment::Env(e) = seg {
            let span = &ep.observation_spans[observation];
            assert_eq!(
                *span,
                start..start + e.ids.len(),
                "{}: observation span",
                traj.id
            );
            observation += 1;
            p.push(gold_probability(t, &context, gold));
        }
    }
    assert_eq!(observation, ep.observation_spans.len());
    p.windows(2).map(|w| w[1] - w[0]).collect()
}

/// The batch: an answered episode (two tool calls), one cut by the turn limit, and one cut by
/// the response length right after the observation of its last turn.
fn episodes(t: &Trainer) -> (Vec<Episode>, Vec<String>) {
    let qs = t.task.questions(Split::Train);
    // A two-hop question: two searches, then the answer.
    let q = (0..qs.len())
        .find(|&i| oracle(t, i).len() == 3)
        .expect("a two-hop training question");
    let turns = oracle(t, q);
    let answered = play(t, q, "answered", &turns, 400);
    assert_eq!(answered.trajectory.finish, FinishReason::Answered);
    assert_eq!(answered.trajectory.num_turns(), 3);
    assert_eq!(answered.observation_spans.len(), 2);

    // The same search until the turn limit.
    let max_turns = t.config.task.max_turns;
    let searches = vec![turns[0].clone(); max_turns + 1];
    let limited = play(t, q, "turn-limit", &searches, 400);
    assert_eq!(limited.trajectory.finish, FinishReason::TurnLimit);
    assert_eq!(limited.trajectory.num_turns(), max_turns);
    assert_eq!(limited.observation_spans.len(), max_turns - 1);

    // Two searches with room for 4 tokens of the second one's result: the last turn is followed
    // by an observation (cut), so there is one more observation than process turns.
    let full = &answered.observation_spans[1];
    let room = full.start + 5;
    let cut = play(t, q, "length-cut", &turns[..2], room);
    assert_eq!(cut.trajectory.finish, FinishReason::Length);
    assert_eq!(cut.trajectory.num_turns(), 2);
    assert_eq!(cut.observation_spans.len(), 2);
    assert_eq!(cut.observation_spans[1].len(), 4);

    let gold = qs[q].golden_answers[0].clone();
    (vec![answered, limited, cut], vec![gold; 3])
}

#[test]
fn probe_gains_match_a_direct_computation_through_the_model() {
    let t = trainer(150);
    let (eps, golds) = episodes(&t);
    let got = probe(&t.sampler, &t.tokenizer, t.config.task.format, &eps, &golds).unwrap();
    assert_eq!(got.failures, 0);
    // One probe before any observation plus one after each.
    let observations: usize = eps.iter().map(|e| e.observation_spans.len()).sum();
    assert_eq!(got.probes, eps.len() + observations);
    let mut smallest = f64::INFINITY;
    for (ep, (gains, gold)) in eps.iter().zip(got.gains.iter().zip(&golds)) {
        let id = &ep.trajectory.id;
        let direct = direct_gains(&t, ep, gold);
        let process = ep.trajectory.num_turns() - 1;
        // One gain per process turn: the final turn's (after a length cut) is dropped.
        assert_eq!(gains.len(), process, "{id}: {gains:?}");
        for (k, (g, d)) in gains.iter().zip(&direct).enumerate() {
            assert!(
                (g - d).abs() < 1e-5,
                "{id}, turn {k}: probe {g}, direct {d}"
            );
            smallest = smallest.min(d.abs());
        }
    }
    // The comparison means something: every gain is far from 0 at this tolerance.
    assert!(smallest > 1e-4, "smallest |ig| {smallest}");
    // The estimator takes them as they are.
    let groups = vec![0; eps.len()];
    let scores = vec![1.0, 0.0, 0.0];
    let turn_rewards = vec![Vec::new(); eps.len()];
    compute(
        &t.config,
        &common::scored(&eps, &groups, &scores, &turn_rewards, Some(&got.gains)),
        None,
        None,
        None,
    )
    .unwrap();
}

#[test]
fn a_process_turn_without_observation_is_an_error_naming_the_episode() {
    // The shapes matter here, not the values.
    let t = trainer(3);
    let (eps, golds) = episodes(&t);
    // The answered episode without its second observation: turn 1 of 3 (a process turn) has
    // no observation, so no probe measures its gain.
    let mut broken = eps[0].clone();
    let second_env = broken
        .trajectory
        .segments
        .iter()
        .enumerate()
        .filter(|(_, s)| matches!(s, Segment::Env(_)))
        .map(|(i, _)| i)
        .nth(1)
        .unwrap();
    broken.trajectory.segments.remove(second_env);
    broken.observation_spans.pop();
    broken.trajectory.id = "broken".into();
    let batch = vec![eps[1].clone(), broken.clone()];
    let err = probe(
        &t.sampler,
        &t.tokenizer,
        t.config.task.format,
        &batch,
        &golds[..2],
    )
    .unwrap_err();
    let mismatch = err
        .downcast_ref::<InfoGainMismatch>()
        .unwrap_or_else(|| panic!("not a mismatch: {err:#}"));
    assert_eq!(
        *mismatch,
        InfoGainMismatch::MissingObservation {
            index: 1,
            id: "broken".into(),
            turn: 1,
            turns: 3,
        }
    );
    let text = err.to_string();
    assert!(
        text.contains("episode 1 (broken)") && text.contains("agent turn 1 of 3"),
        "{text}"
    );

    // Spans that are not the trajectory's observations.
    let mut spans = eps[0].clone();
    spans.observation_spans.pop();
    let err = probe(
        &t.sampler,
        &t.tokenizer,
        t.config.task.format,
        &[spans],
        &golds[..1],
    )
    .unwrap_err();
    assert!(
        matches!(
            err.downcast_ref::<InfoGainMismatch>(),
            Some(InfoGainMismatch::Spans {
                index: 0,
                spans: 1,
                segments: 2,
                ..
            })
        ),
        "{err:#}"
    );

    // A gain list that is not one per process turn reaches the advantage glue: an error naming
    // the episode, not a gain of 0 the turn groups would rank.
    let gains = vec![vec![0.1, -0.2], vec![0.3]];
    let batch = vec![eps[0].clone(), eps[1].clone()];
    let err = compute(
        &t.config,
        &common::scored(
            &batch,
            &[0, 0],
            &[1.0, 0.0],
            &[Vec::new(), Vec::new()],
            Some(&gains),
        ),
        None,
        None,
        None,
    )
    .err()
    .expect("a short gain list is an error");
    let text = format!("{err:#}");
    assert!(
        text.contains("episode 1 (turn-limit): 1 information gains for 4 agent turns (3 process"),
        "{text}"
    );
}
