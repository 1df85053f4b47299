//! Ablations on one fixed batch: each method's defining component changes the update the
//! trainer makes. A batch of real rollouts on a tiny world is built once; the trainer's own glue
//! (`trainer::advantage::compute`) turns it into rows under a preset's config and under the
//! config with the component removed, and one `actor_update` (the trainer's update, with
//! behaviour log-probs that differ from the current policy so that clips bind) is applied to
//! identical copies of the warm-started weights. The two weight changes must differ; the same
//! config twice must give identical changes (so a difference is the component's doing).

use std::collections::BTreeMap;

use turnwise::config::TrainConfig;
use turnwise::rollout::{Decoding, Episode, EpisodeSpec, run_chains};
use turnwise::task::{TaskSet, prompt_text};
use turnwise::trainer::Trainer;
use turnwise::trainer::advantage::compute;
use turnwise::update::{ActorUpdate, actor_update, logprobs_no_grad};
use turnwise_model::model::transformer::varmap_tensors;

mod common;
use common::tiny_overrides;

/// A fixed batch: episodes with hand-set scores, turn rewards and information gains, so that
/// every estimator sees signal whatever the tiny model answered.
#[derive(Clone)]
struct Fixed {
    episodes: Vec<Episode>,
    groups: Vec<usize>,
    scores: Vec<f64>,
    turn_rewards: Vec<Vec<f64>>,
    info_gain: Vec<Vec<f64>>,
}

fn trainer(preset: &str, sets: &[&str]) -> Trainer {
    let mut o = tiny_overrides();
    o.extend(sets.iter().map(|s| s.to_string()));
    let cfg = TrainConfig::resolve(Some(preset), None, &o).unwrap();
    let mut t = Trainer::new(cfg).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    t.freeze_reference().unwrap();
    t
}

/// Two prompts × four rollouts of real episodes from `t`'s policy, with scores 1, 0, 1, 0 per
/// group, turn rewards `[0.1·k …, score]` and IG `0.2·(−1)^k` per process turn.
fn fixed_batch(t: &Trainer) -> Fixed {
    let qs = t.task.questions(turnwise_env::world::Split::Train);
    let mut specs = Vec::new();
    for (g, q) in qs.iter().take(2).enumerate() {
        for k in 0..4 {
            specs.push(EpisodeSpec {
                id: format!("e{g}-{k}"),
                prompt_uid: format!("{g}:{}", q.id),
                prompt_ids: t.tokenizer.encode(&prompt_text(&q.text)).unwrap(),
                task: TaskSet::env_task(q),
                seed: (g * 4 + k) as u64,
            });
        }
    }
    let env = || Ok(Box::new(t.task.env()?) as Box<dyn turnwise_env::env::Environment>);
    let decoding = Decoding {
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        max_turn_tokens: 12,
        max_response_tokens: 120,
    };
    let episodes = run_chains(&t.rollout_policy(), specs, &env, &decoding).unwrap();
    let n = episodes.len();
    let groups: Vec<usize> = (0..n).map(|i| i / 4).collect();
    let scores: Vec<f64> = (0..n).map(|i| if i % 2 == 0 { 1.0 } else { 0.0 }).collect();
    let turn_rewards = episodes
        .iter()
        .zip(&scores)
        .enumerate()
        .map(|(i, (e, &s))| {
            let k = e.trajectory.num_turns().max(1);
            let mut v: Vec<f64> = (0..k - 1).map(|j| 0.1 * ((i + j) % 3) as f64).collect();
            v.push(s);
            v
        })
        .collect();
    let info_gain = episodes
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let k = e.trajectory.num_turns().saturating_sub(1);
            (0..k)
                .map(|j| if (i + j) % 2 == 0 { 0.2 } else { -0.2 })
                .collect()
        })
        .collect();
    Fixed {
        episodes,
        groups,
        scores,
        turn_rewards,
        info_gain,
    }
}

/// What an update did: the gradient norm before clipping and the weight change.
struct Update {
    grad_norm: f64,
    delta: BTreeMap<String, Vec<f32>>,
}

/// One trainer update of `preset` with `sets` on the fixed batch. Behaviour log-probs are the
/// current ones shifted by one amount per pair of rows (scores alternate per row), so ratios
/// start away from 1 and clips bind on both sides.
fn update_delta(preset: &str, sets: &[&str], batch: &Fixed) -> Update {
    let mut t = trainer(preset, sets);
    let cfg = t.config.clone();
    let info_gain = cfg.rollout.info_gain.then_some(batch.info_gain.as_slice());
    let values: Option<Vec<Vec<f32>>> = t.critic.as_ref().map(|_| {
        batch
            .episodes
            .iter()
            .map(|e| vec![0.25f32; e.trajectory.flatten(true).ids.len()])
            .collect()
    });
    let adv = compute(
        &cfg,
        &common::scored(
            &batch.episodes,
            &batch.groups,
            &batch.scores,
            &batch.turn_rewards,
            info_gain,
        ),
        None,
        values.as_deref(),
        None,
    )
    .unwrap();
    let rows = adv.rows;
    let temperature = cfg.rollout.temperature;
    let mut old = logprobs_no_grad(&t.sampler, &rows, temperature, 64).unwrap();
    for (i, row) in old.iter_mut().enumerate() {
        // One shift per row, so token, turn and sequence ratios all leave 1.
        // Ratios past PPO's 0.2 clip on both sides, and ratios e^∓0.0032, e^+0.0042 that lie
        // outside A2TGPO's bounds 1 − 3e-3, 1 + 4e-3 at c = 1 and inside them at c > 1.1.
        // The large shifts vary along the row (×−0.5, ×0.5, ×1.5: mean ×0.5), so that a row is
        // clipped on some of its tokens and not others while its turn and sequence ratios
        // (e^∓0.15) stay inside PPO's band: the clipping-bias correction's per-sample weight
        // 1 − ρ_i then lies strictly between 0 and 1 on a row that has a gradient (a row
        // clipped on every token or on none has weight 0 or 1, and its gradient is the same
        // with or without the weight).
        let shift: f32 = [0.3, 0.0032, -0.3, -0.0042][(i / 2) % 4];
        for (j, x) in row.iter_mut().enumerate() {
            let along = if shift.abs() > 0.1 {
                [-0.5, 0.5, 1.5][j % 3]
            } else {
                1.0
            };
            *x += shift * along;
        }
    }
    let reference = match (&t.reference, cfg.actor.use_kl_loss) {
        (Some(m), true) => Some(logprobs_no_grad(m, &rows, temperature, 64).unwrap()),
        _ => None,
    };
    let upd = ActorUpdate {
        loss: &cfg.actor,
        temperature,
        epochs: 1,
        mini_batch: 0,
        micro_batch: 0,
        lr: 1e-2,
        grad_clip: 1e9,
        rollout_is_cap: None,
        share_prefix: true,
    };
    let before = varmap_tensors(&t.varmap, true);
    let before: BTreeMap<String, Vec<f32>> = before
        .into_iter()
        .map(|(k, v)| (k, v.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    let mut order = |n: usize| (0..n).collect::<Vec<_>>();
    let stats = actor_update(
        &t.policy,
        &mut t.optimizer,
        &rows,
        Some(&old),
        reference.as_deref(),
        &upd,
        &mut order,
    )
    .unwrap();
    assert_eq!(
        stats.applied, 1,
        "{preset} {sets:?}: the update was skipped"
    );
    let after = varmap_tensors(&t.varmap, true);
    let delta = after
        .into_iter()
        .map(|(k, v)| {
            let a = v.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let d = a.iter().zip(&before[&k]).map(|(x, y)| x - y).collect();
            (k, d)
        })
        .collect();
    Update {
        grad_norm: stats.metrics["actor/grad_norm"],
        delta,
    }
}

fn max_diff(a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>) -> f32 {
    a.iter()
        .flat_map(|(k, v)| v.iter().zip(&b[k]).map(|(x, y)| (x - y).abs()))
        .fold(0.0, f32::max)
}

/// `preset` with `sets` (the method) against `preset` with `ablated` on the batch changed by
/// `ablate_batch` (the component removed): the gradients differ (in norm, or in direction, which
/// shows in Adam's first step), and the method's own update is reproducible.
fn assert_component_matters(
    preset: &str,
    sets: &[&str],
    ablated: &[&str],
    ablate_batch: impl Fn(&mut Fixed),
) {
    let base = trainer(preset, sets);
    let batch = fixed_batch(&base);
    drop(base);
    let with = update_delta(preset, sets, &batch);
    let again = update_delta(preset, sets, &batch);
    assert_eq!(
        (max_diff(&with.delta, &again.delta), with.grad_norm),
        (0.0, again.grad_norm),
        "{preset}: the same update twice differs"
    );
    let mut changed = batch.clone();
    ablate_batch(&mut changed);
    let without = update_delta(preset, ablated, &changed);
    let d = max_diff(&with.delta, &without.delta);
    let rel = (with.grad_norm - without.grad_norm).abs() / with.grad_norm.max(1e-12);
    assert!(
        d > 1e-5 || rel > 1e-3,
        "{preset}: removing {ablated:?} does not change the gradient (max |Δw| difference {d}, \
         gradient norms {} vs {})",
        with.grad_norm,
        without.grad_norm
    );
}

#[test]
fn a2tgpo_adaptive_clip_beta_changes_the_update() {
    assert_component_matters("a2tgpo", &[], &["advantage.clip_beta=0.0"], |_| {});
}

#[test]
fn s_ppo_differs_from_ppo() {
    // S-PPO = PPO's token ratio and clip + the clipping-bias scale; PPO is the same preset
    // family without the scale.
    assert_component_matters(
        "s-ppo",
        &[],
        &["actor.policy.policy_loss=\"vanilla\""],
        |_| {},
    );
}

#[test]
fn st_ppo_differs_from_turn_ppo() {
    assert_component_matters(
        "st-ppo",
        &[],
        &["actor.policy.policy_loss=\"turn\""],
        |_| {},
    );
}

#[test]
fn s_grpo_differs_from_grpo_loss() {
    assert_component_matters(
        "s-grpo",
        &[],
        &["actor.policy.policy_loss=\"vanilla\""],
        |_| {},
    );
}

#[test]
fn mt_ppo_turn_rewards_change_the_update() {
    // Outcome only: the same GAE critic path with no turn rewards (the plain EM reward).
    assert_component_matters("mt-ppo", &[], &["reward.name=\"em\""], |b| {
        for t in &mut b.turn_rewards {
            t.clear();
        }
    });
}

/// Review B 3.1: MT-PPO places every intermediate reward at the end of its turn and the final
/// reward once: with zero values and γ = λ = 1 the return at the first response token is
/// `Σ R^I + R^F` (the final reward counted twice would add `R^F` again).
#[test]
fn mt_ppo_counts_the_final_reward_once() {
    let t = trainer("mt-ppo", &[]);
    let b = fixed_batch(&t);
    let values: Vec<Vec<f32>> = b
        .episodes
        .iter()
        .map(|e| vec![0.0; e.trajectory.flatten(true).ids.len()])
        .collect();
    let adv = compute(
        &t.config,
        &common::scored(&b.episodes, &b.groups, &b.scores, &b.turn_rewards, None),
        None,
        Some(&values),
        None,
    )
    .unwrap();
    let mut checked = 0;
    for ((row, tr), &score) in adv.rows.iter().zip(&b.turn_rewards).zip(&b.scores) {
        let first = row.loss_mask.iter().position(|&m| m > 0).unwrap();
        let expected: f64 = tr[..tr.len() - 1].iter().sum::<f64>() + score;
        assert!(
            (f64::from(row.returns[first]) - expected).abs() < 1e-5,
            "return {} vs Σ R^I + R^F = {expected}",
            row.returns[first]
        );
        checked += usize::from(score != 0.0);
    }
    assert!(checked > 0);
}

/// GiGPO's invalid-action penalty (spec §10, verl-agent): every step whose action was invalid
/// gets a penalty taken off its own discounted return (`step_penalties`, applied after
/// discounting: the step rewards stay the environment's) and off the episode score of its own
/// step sample; the valid steps of the same trajectory keep the episode score and no penalty.
#[test]
fn gigpo_penalises_only_the_invalid_steps() {
    use turnwise::trainer::advantage::{place_rewards, rollout_of};
    use turnwise_core::trajectory::TurnAction;
    let t = trainer("gigpo", &[]);
    let b = fixed_batch(&t);
    let mut invalid_seen = 0;
    for (e, &score) in b.episodes.iter().zip(&b.scores) {
        let mut r = rollout_of(e, 0, score, &[], None);
        let raw_steps = r.step_rewards.clone();
        let raw: f64 = raw_steps.iter().sum();
        let n = place_rewards(&t.config, e, &mut r).unwrap();
        let scores = r.step_scores.clone().expect("step scores are set");
        let mut count = 0;
        for (k, turn) in e.trajectory.turns.iter().enumerate() {
            let bad = matches!(turn.action, TurnAction::Invalid { .. });
            // The preset's penalty on search: verl-agent's search script's 0.01.
            let p = if bad { 0.01 } else { 0.0 };
            assert!((r.step_rewards[k] - raw_steps[k]).abs() < 1e-12);
            assert!((r.step_penalties[k] - p).abs() < 1e-12);
            assert!((scores[k] - (raw - p)).abs() < 1e-12);
            count += usize::from(bad);
        }
        assert_eq!(n, count);
        invalid_seen += count;
    }
    assert!(invalid_seen > 0, "the tiny model wrote no invalid step");
    // Switched off, nothing is penalised.
    let off = trainer("gigpo", &["advantage.invalid_action_penalty=0.0"]);
    let e = &b.episodes[0];
    let mut r = rollout_of(e, 0, 0.0, &[], None);
    assert_eq!(place_rewards(&off.config, e, &mut r).unwrap(), 0);
    assert!(r.step_scores.is_none());
}
