//! Clipping-bias correction (spec §5.6).
//!
//! - Under micro-batching: `C` and its 1/B, 1/|y| factors are taken over the whole mini-batch, so
//!   the mini-batch gradient does not depend on how the mini-batch is cut into micro-batches.
//! - At the presets' own update settings (grad clip 1.0, AdamW, lr, two mini-batches = two
//!   optimizer steps): the correction changes the weights (S-PPO against PPO, ST-PPO against
//!   Turn-PPO), a batch with more clipped off-policy mass moves the weights less, and no sample is
//!   ever up-weighted.

mod common;

use std::collections::BTreeMap;

use turnwise::config::TrainConfig;
use turnwise::trainer::Trainer;
use turnwise::update::{
    ActorUpdate, Row, UpdateStats, actor_update, logprobs_no_grad, minibatch_gradient,
};
use turnwise_model::model::transformer::varmap_tensors;

/// Rows of a sampled batch with hand-set advantages, and behaviour log-probs pushed away from
/// the current policy's so that some ratios leave the clip range.
fn setup(preset: &str) -> (Trainer, Vec<Row>, Vec<Vec<f32>>) {
    setup_shifted(preset, 1.0)
}

/// [`setup`] with the behaviour log-probs' shifts multiplied by `shift` (0: on-policy).
fn setup_shifted(preset: &str, shift: f32) -> (Trainer, Vec<Row>, Vec<Vec<f32>>) {
    let mut sets = common::tiny_overrides();
    sets.extend(["rollout.prompts_per_step=3", "rollout.group_size=2"].map(String::from));
    let cfg = TrainConfig::resolve(Some(preset), None, &sets).unwrap();
    let mut t = Trainer::new(cfg).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    t.freeze_reference().unwrap();
    let (all, _, _) = t.sample_batch().unwrap();
    let mut rows: Vec<Row> = all
        .episodes
        .iter()
        .map(|e| {
            let f = e.episode.trajectory.flatten(false);
            Row::new(
                e.episode.trajectory.prompt_ids.clone(),
                f.ids,
                f.loss_mask,
                f.turn_id,
            )
        })
        .collect();
    assert_eq!(rows.len(), 6);
    for (i, r) in rows.iter_mut().enumerate() {
        let a = if i % 2 == 0 { 1.0 } else { -0.5 };
        r.advantages = r.loss_mask.iter().map(|&m| a * f32::from(m)).collect();
    }
    // Rows 0, 1, 3, 4 move as a whole (the turn ratio leaves the clip range against the
    // advantage's sign: clipped); rows 2, 5 token by token (token ratios clipped here and there).
    let mut old = logprobs_no_grad(&t.sampler, &rows, 1.0, 64).unwrap();
    for (i, row) in old.iter_mut().enumerate() {
        for (k, x) in row.iter_mut().enumerate() {
            *x += shift
                * match (i % 3, i % 2) {
                    (2, _) => [0.6, -0.4, 0.05, -0.7][k % 4],
                    (_, 0) => -0.5,
                    _ => 0.5,
                };
        }
    }
    (t, rows, old)
}

/// Named gradient values and the metrics of one mini-batch.
type GradAndMetrics = (Vec<(String, Vec<f32>)>, BTreeMap<String, f64>);

fn gradient_and_metrics(
    t: &Trainer,
    rows: &[Row],
    old: &[Vec<f32>],
    micro: usize,
) -> GradAndMetrics {
    let upd = ActorUpdate {
        loss: &t.config.actor,
        temperature: 1.0,
        epochs: 1,
        mini_batch: 0,
        micro_batch: micro,
        lr: 1e-3,
        grad_clip: 1.0,
        rollout_is_cap: None,
        share_prefix: true,
    };
    let mb: Vec<usize> = (0..rows.len()).collect();
    let g = minibatch_gradient(
        &t.policy,
        t.optimizer.vars(),
        rows,
        &mb,
        Some(old),
        None,
        &upd,
    )
    .unwrap()
    .expect("finite loss");
    (common::sorted_values(&g.grads), g.metrics)
}

fn check(preset: &str) {
    let (t, rows, old) = setup(preset);
    let (whole, mw) = gradient_and_metrics(&t, &rows, &old, 0);
    let (halves, mh) = gradient_and_metrics(&t, &rows, &old, 3);
    let (thirds, mt) = gradient_and_metrics(&t, &rows, &old, 2);
    assert!(mw["actor/clip_bias_num_clipped"] > 0.0, "{mw:?}");
    assert!((mw["actor/clip_bias_scale"] - 1.0).abs() > 1e-3, "{mw:?}");
    for m in [&mh, &mt] {
        for k in [
            "actor/clip_bias_scale",
            "actor/clip_bias_norm",
            "actor/clip_bias_num_clipped",
            "actor/pg_loss",
        ] {
            let (a, b) = (mw[k], m[k]);
            assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "{k}: {a} vs {b}");
        }
    }
    let max = whole
        .iter()
        .flat_map(|(_, v)| v.iter().map(|x| x.abs()))
        .fold(0f32, f32::max);
    assert!(max > 0.0);
    for other in [&halves, &thirds] {
        assert_eq!(whole.len(), other.len());
        for ((k, a), (_, b)) in whole.iter().zip(other) {
            let diff = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(
                diff <= 1e-5 * max,
                "{preset}: gradient of {k} differs by {diff} (max |g| {max})"
            );
        }
    }
}

#[test]
fn s_ppo_minibatch_gradient_does_not_depend_on_micro_batches() {
    check("s-ppo");
}

#[test]
fn st_ppo_minibatch_gradient_does_not_depend_on_micro_batches() {
    check("st-ppo");
}

/// The policy's weights, by name.
fn weights(t: &Trainer) -> BTreeMap<String, Vec<f32>> {
    varmap_tensors(&t.varmap, true)
        .into_iter()
        .map(|(k, v)| (k, v.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

/// The trainer's actor update with the preset's own settings: its epochs, grad clip, lr and
/// AdamW, the batch cut into two mini-batches as every PPO-family preset cuts its 128 rollouts
/// into 64s (two optimizer steps, the second off-policy). Returns the weight change and stats.
fn preset_update(
    t: &mut Trainer,
    rows: &[Row],
    old: &[Vec<f32>],
) -> (BTreeMap<String, Vec<f32>>, UpdateStats) {
    let cfg = t.config.clone();
    assert_eq!(cfg.optim.grad_clip, 1.0, "the presets clip at 1.0");
    let upd = ActorUpdate {
        loss: &cfg.actor,
        temperature: cfg.rollout.temperature,
        epochs: cfg.optim.ppo_epochs,
        mini_batch: rows.len() / 2,
        micro_batch: 0,
        lr: cfg.optim.lr,
        grad_clip: cfg.optim.grad_clip,
        rollout_is_cap: None,
        share_prefix: true,
    };
    let before = weights(t);
    let mut order = |n: usize| (0..n).collect::<Vec<_>>();
    let stats = actor_update(
        &t.policy,
        &mut t.optimizer,
        rows,
        Some(old),
        None,
        &upd,
        &mut order,
    )
    .unwrap();
    assert_eq!(
        (stats.applied, stats.skipped),
        (2, 0),
        "two optimizer steps"
    );
    let delta = weights(t)
        .into_iter()
        .map(|(k, v)| {
            let d = v.iter().zip(&before[&k]).map(|(a, b)| a - b).collect();
            (k, d)
        })
        .collect();
    (delta, stats)
}

fn norm(d: &BTreeMap<String, Vec<f32>>) -> f64 {
    d.values()
        .flatten()
        .map(|x| f64::from(*x).powi(2))
        .sum::<f64>()
        .sqrt()
}

fn max_abs_diff(a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>) -> f32 {
    a.iter()
        .flat_map(|(k, v)| v.iter().zip(&b[k]).map(|(x, y)| (x - y).abs()))
        .fold(0.0, f32::max)
}

/// `method` and `base` (the same preset family without the correction) from the same warm start,
/// on the same rows and behaviour log-probs, with their own update settings: the weights after two
/// optimizer steps differ by more than a tenth of the largest weight change, and the method's
/// step scale is below 1.
fn correction_changes_the_weights(method: &str, base: &str) {
    let (mut tm, rows, old) = setup(method);
    let mut tb = Trainer::new(
        TrainConfig::resolve(Some(base), None, &{
            let mut sets = common::tiny_overrides();
            sets.extend(["rollout.prompts_per_step=3", "rollout.group_size=2"].map(String::from));
            sets
        })
        .unwrap(),
    )
    .unwrap();
    tb.warm_start(&mut |_, _, _| {}).unwrap();
    assert_eq!(
        max_abs_diff(&weights(&tm), &weights(&tb)),
        0.0,
        "{method} and {base} start from the same weights"
    );
    assert_eq!(
        tm.config.actor.policy.resolve().unwrap().agg_mode,
        tb.config.actor.policy.resolve().unwrap().agg_mode,
        "{method} and {base} aggregate alike, so the correction is their one difference"
    );
    let (dm, sm) = preset_update(&mut tm, &rows, &old);
    let (db, sb) = preset_update(&mut tb, &rows, &old);
    let largest = db
        .values()
        .flatten()
        .map(|x| x.abs())
        .fold(0.0f32, f32::max);
    let diff = max_abs_diff(&dm, &db);
    assert!(
        diff > 0.1 * largest,
        "{method}'s weights after two steps differ from {base}'s by {diff} (largest change \
         {largest}; grad norms {} vs {})",
        sm.metrics["actor/grad_norm"],
        sb.metrics["actor/grad_norm"]
    );
    let scale = sm.metrics["actor/clip_bias_scale"];
    assert!(
        scale < 0.99,
        "{method}: step scale {scale} (metrics {:?})",
        sm.metrics
    );
    assert!(sm.metrics["actor/clip_bias_num_clipped"] > 0.0);
}

#[test]
fn s_ppo_moves_other_weights_than_ppo_at_its_own_settings() {
    correction_changes_the_weights("s-ppo", "ppo");
}

#[test]
fn st_ppo_moves_other_weights_than_turn_ppo_at_its_own_settings() {
    correction_changes_the_weights("st-ppo", "turn-ppo");
}

/// More clipped off-policy mass (the same rows with behaviour log-probs further from the policy)
/// moves ST-PPO's weights less, while Turn-PPO (no correction) moves them about as much either
/// way; the step scale never exceeds 1.
#[test]
fn more_clipped_mass_moves_st_ppo_less() {
    let moved = |preset: &str, shift: f32| {
        let (mut t, rows, old) = setup_shifted(preset, shift);
        let (d, s) = preset_update(&mut t, &rows, &old);
        (norm(&d), s.metrics)
    };
    let (mild, m_mild) = moved("st-ppo", 0.3);
    let (strong, m_strong) = moved("st-ppo", 1.0);
    for m in [&m_mild, &m_strong] {
        assert!(m["actor/clip_bias_scale"] <= 1.0, "{m:?}");
    }
    assert!(
        m_strong["actor/clip_bias_num_clipped"] > m_mild["actor/clip_bias_num_clipped"],
        "the larger shift clips more tokens"
    );
    assert!(
        m_strong["actor/clip_bias_scale"] < m_mild["actor/clip_bias_scale"],
        "step scales {} (strong) vs {} (mild)",
        m_strong["actor/clip_bias_scale"],
        m_mild["actor/clip_bias_scale"]
    );
    let (base_mild, _) = moved("turn-ppo", 0.3);
    let (base_strong, _) = moved("turn-ppo", 1.0);
    let (ratio, base_ratio) = (strong / mild, base_strong / base_mild);
    assert!(
        ratio < 0.8 * base_ratio,
        "st-ppo moved {strong:.3e} (strong) vs {mild:.3e} (mild), ratio {ratio:.3}; turn-ppo's \
         ratio {base_ratio:.3}"
    );
}
