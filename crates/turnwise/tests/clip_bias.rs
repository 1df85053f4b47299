//! Clipping-bias correction under micro-batching (spec §5.6): `C` and its 1/B, 1/|y| factors
//! are taken over the whole mini-batch, so the mini-batch gradient does not depend on how the
//! mini-batch is cut into micro-batches.

mod common;

use std::collections::BTreeMap;

use turnwise::config::TrainConfig;
use turnwise::trainer::Trainer;
use turnwise::update::{ActorUpdate, Row, logprobs_no_grad, minibatch_gradient};

/// Rows of a sampled batch with hand-set advantages, and behaviour log-probs pushed away from
/// the current policy's so that some ratios leave the clip range.
fn setup(preset: &str) -> (Trainer, Vec<Row>, Vec<Vec<f32>>) {
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
            let f = e.trajectory.flatten(false);
            Row::new(
                e.trajectory.prompt_ids.clone(),
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
            *x += match (i % 3, i % 2) {
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
        use_clip_scale: false,
        use_turn_id: true,
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
