//! Truncated importance sampling over the sampler–trainer mismatch (`optim.rollout_is_cap`,
//! issue 30 item 6): each trained token's loss is weighted by `min(π_old / π_sampler, C)`.
//! The rows here carry recorded log-probs that differ from the trainer's as an inference
//! server's would (a fixed, token-varying offset), so the weights are far from 1 and some hit
//! the cap.

mod common;

use turnwise::config::TrainConfig;
use turnwise::trainer::Trainer;
use turnwise::update::Row;

const CAP: f64 = 2.0;

/// A briefly warm-started tiny GRPO trainer (no entropy or KL term, so that the whole loss is
/// the policy loss) and 8 fresh rollouts as rows with alternating advantages.
fn trainer_and_rows() -> (Trainer, Vec<Row>) {
    let mut ov = common::tiny_overrides();
    ov.extend(
        [
            "sft.steps=30",
            "actor.use_kl_loss=false",
            "actor.entropy_coeff=0",
        ]
        .map(String::from),
    );
    let cfg = TrainConfig::resolve(Some("grpo"), None, &ov).unwrap();
    let mut t = Trainer::new(cfg).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    let mut rows = common::sampled_rows(&t, 8);
    for (i, r) in rows.iter_mut().enumerate() {
        let a = if i % 2 == 0 { 1.3 } else { -0.7 };
        r.advantages = vec![a; r.response.len()];
    }
    (t, rows)
}

/// The recorded log-probs of a server whose numerics differ from the trainer's: the trainer's
/// `old` minus an offset in [−0.5, 1.5) that varies from token to token, so the ratios
/// `π_old / π_sampler` range over [e^−0.5, e^1.5) and some exceed the cap.
fn mismatched(rows: &mut [Row], old: &[Vec<f32>]) {
    for (i, (r, o)) in rows.iter_mut().zip(old).enumerate() {
        r.sampled_logprobs = o
            .iter()
            .enumerate()
            .map(|(t, &lp)| lp - (((i * 7 + t * 3) % 8) as f32 * 0.25 - 0.5))
            .collect();
    }
}

fn settings<'a>(
    t: &'a TrainConfig,
    mini_batch: usize,
    cap: Option<f64>,
) -> turnwise::update::ActorUpdate<'a> {
    turnwise::update::ActorUpdate {
        loss: &t.actor,
        temperature: 1.0,
        epochs: 1,
        mini_batch,
        micro_batch: 3,
        lr: t.optim.lr,
        grad_clip: t.optim.grad_clip,
        rollout_is_cap: cap,
        share_prefix: true,
    }
}

/// The mini-batch gradient with the weights is the gradient without them on advantages times
/// the weights, `min(exp(old − sampled), C)` computed here independently (a positive weight
/// scales a token's clipped loss whole); without the weights it is not; the logged mean
/// weight and capped share are those of the loss tokens.
#[test]
fn weights_multiply_each_tokens_loss() {
    use turnwise::update::{logprobs_no_grad, minibatch_gradient};

    let (t, mut rows) = trainer_and_rows();
    let old = logprobs_no_grad(&t.sampler, &rows, 1.0, 64).unwrap();
    mismatched(&mut rows, &old);
    let cfg = t.config.clone();
    let all: Vec<usize> = (0..rows.len()).collect();
    let vars = t.optimizer.vars();
    let grad = |rows: &[Row], cap: Option<f64>| {
        minibatch_gradient(
            &t.policy,
            vars,
            rows,
            &all,
            Some(&old),
            None,
            &settings(&cfg, 0, cap),
        )
        .unwrap()
        .expect("a finite gradient")
    };
    let with = grad(&rows, Some(CAP));

    let (mut sum, mut capped, mut n) = (0.0, 0.0, 0.0);
    let mut weighted = rows.clone();
    for (r, o) in weighted.iter_mut().zip(&old) {
        for (k, a) in r.advantages.iter_mut().enumerate() {
            let ratio = f64::from(o[k] - r.sampled_logprobs[k]).exp();
            let w = ratio.min(CAP);
            *a *= w as f32;
            let m = f64::from(r.loss_mask[k]);
            sum += m * w;
            capped += m * f64::from(u8::from(ratio > CAP));
            n += m;
        }
    }
    let want = grad(&weighted, None);
    let without = grad(&rows, None);

    let m = &with.metrics;
    assert!((m["actor/tis_weight_mean"] - sum / n).abs() < 1e-5, "{m:?}");
    assert!(
        (m["actor/tis_capped_frac"] - capped / n).abs() < 1e-9,
        "{m:?}"
    );
    assert!(
        capped > 0.0 && capped < n,
        "the cap binds on some tokens only"
    );
    let (g, w, u) = (
        common::sorted_values(&with.grads),
        common::sorted_values(&want.grads),
        common::sorted_values(&without.grads),
    );
    let (mut max_err, mut scale, mut moved) = (0f32, 0f32, 0f32);
    for (((name, a), (_, b)), (_, c)) in g.iter().zip(&w).zip(&u) {
        for ((x, y), z) in a.iter().zip(b).zip(c) {
            max_err = max_err.max((x - y).abs());
            scale = scale.max(y.abs());
            moved = moved.max((x - z).abs());
        }
        assert!(!a.is_empty(), "{name}");
    }
    assert!(
        max_err <= 1e-5 * scale.max(1.0),
        "max |Δg| {max_err} (scale {scale})"
    );
    assert!(
        moved > 1e-3 * scale,
        "the weights changed no gradient ({moved} vs {scale})"
    );
}

/// Two optimizer steps at the GRPO preset's own update settings (its learning rate, gradient
/// clip, AdamW, two mini-batches): with the server's mismatch the weights end elsewhere with
/// truncated importance sampling than without it (the token-varying weights change the
/// update's direction, which neither the clip nor Adam's scale invariance erases); with
/// recorded log-probs equal to the trainer's every weight is 1 and the update is the same.
#[test]
fn changes_the_update_at_the_presets_settings() {
    use turnwise::update::{actor_update, logprobs_no_grad};

    let weights = |t: &Trainer| -> Vec<f32> {
        let mut w: Vec<(String, Vec<f32>)> =
            turnwise_model::model::transformer::varmap_tensors(&t.varmap, true)
                .into_iter()
                .map(|(k, v)| (k, v.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
                .collect();
        w.sort_by(|a, b| a.0.cmp(&b.0));
        w.into_iter().flat_map(|(_, v)| v).collect()
    };
    let run = |mismatch: bool, cap: Option<f64>| -> (Vec<f32>, Vec<f32>) {
        let (mut t, mut rows) = trainer_and_rows();
        let before = weights(&t);
        let old = logprobs_no_grad(&t.sampler, &rows, 1.0, 64).unwrap();
        if mismatch {
            mismatched(&mut rows, &old);
        } else {
            for (r, o) in rows.iter_mut().zip(&old) {
                r.sampled_logprobs = o.clone();
            }
        }
        let cfg = t.config.clone();
        let upd = settings(&cfg, rows.len() / 2, cap);
        let mut order = |n: usize| (0..n).collect::<Vec<_>>();
        let stats = actor_update(
            &t.policy,
            &mut t.optimizer,
            &rows,
            Some(&old),
            None,
            &upd,
            &mut order,
        )
        .unwrap();
        assert_eq!((stats.applied, stats.skipped), (2, 0));
        (before, weights(&t))
    };
    let dist = |a: &[f32], b: &[f32]| -> f64 {
        a.iter()
            .zip(b)
            .map(|(x, y)| f64::from(x - y).powi(2))
            .sum::<f64>()
            .sqrt()
    };
    let (before, off) = run(true, None);
    let (_, on) = run(true, Some(CAP));
    let step = dist(&before, &off);
    assert!(step > 0.0, "the update moved nothing");
    assert!(
        dist(&off, &on) > 0.05 * step,
        "truncated IS moved the weights {} against a step of {step}",
        dist(&off, &on)
    );
    let (_, same_off) = run(false, None);
    let (_, same_on) = run(false, Some(CAP));
    assert!(
        dist(&same_off, &same_on) <= 1e-6 * step.max(1e-3),
        "weights of 1 changed the update by {}",
        dist(&same_off, &same_on)
    );
}

/// The setting in a training run: a step of the local engine logs weights of 1 (its recorded
/// log-probs are the trainer's, to rounding) and no capped token; a negative cap, and a cap with
/// behaviour log-probs taken from the rollout (every weight 1), are refused by name.
#[test]
fn a_run_logs_the_weights_and_bad_settings_are_refused() {
    let mut sets = common::tiny_overrides();
    sets.extend(
        [
            "rollout.prompts_per_step=3",
            "rollout.group_size=2",
            "optim.rollout_is_cap=2",
        ]
        .map(String::from),
    );
    let cfg = TrainConfig::resolve(Some("grpo"), None, &sets).unwrap();
    let (steps, off_policy) = cfg.update_structure();
    assert!(steps >= 2 && off_policy >= 1, "grpo's update is off-policy");
    let mut t = Trainer::new(cfg).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    t.freeze_reference().unwrap();
    let out = t.rl_step().unwrap();
    let m = &out.metrics;
    let mean = m["actor/tis_weight_mean"];
    assert!((mean - 1.0).abs() < 1e-3, "mean weight {mean}");
    assert_eq!(m["actor/tis_capped_frac"], 0.0);

    for (bad, want) in [
        (vec!["optim.rollout_is_cap=-1"], "optim.rollout_is_cap"),
        (
            vec!["optim.rollout_is_cap=2", "optim.old_logprobs=\"rollout\""],
            "optim.old_logprobs = \"recompute\"",
        ),
    ] {
        let mut s = common::tiny_overrides();
        s.extend(bad.iter().map(|x| x.to_string()));
        let err = TrainConfig::resolve(Some("grpo"), None, &s)
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "{bad:?}: {err}");
    }
}
