//! The actor loss differentiates like the policy gradient: at ratio 1 (fresh rollouts) the
//! PPO surrogate's gradient equals that of the advantage-weighted negative log-likelihood.

mod common;
use common::tiny_overrides;
use turnwise::config::TrainConfig;
use turnwise::trainer::Trainer;

/// A briefly warm-started tiny GRPO trainer and 8 fresh rollouts as rows with alternating
/// advantages (1.3, −0.7).
fn trainer_and_rows() -> (Trainer, Vec<turnwise::update::Row>) {
    let mut ov = tiny_overrides();
    ov.push("sft.steps=30".into());
    ov.push("actor.use_kl_loss=false".into());
    let cfg = TrainConfig::resolve(Some("grpo"), None, &ov).unwrap();
    let mut t = Trainer::new(cfg.clone()).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    let mut rows = common::sampled_rows(&t, 8);
    for (i, r) in rows.iter_mut().enumerate() {
        let a = if i % 2 == 0 { 1.3 } else { -0.7 };
        r.advantages = vec![a; r.response.len()];
    }
    (t, rows)
}

#[test]
fn actor_loss_gradient_equals_weighted_nll_gradient() {
    use turnwise::update::{Row, logprobs_no_grad, pack, response_logprobs};
    use turnwise_model::loss::actor::{ActorLossInput, compute_actor_loss};
    use turnwise_model::loss::policy::PolicyLossInput;

    let (t, rows) = trainer_and_rows();
    let cfg = t.config.clone();
    let old = logprobs_no_grad(&t.sampler, &rows, 1.0, 64).unwrap();
    let refs: Vec<&Row> = rows.iter().collect();
    let packed = pack(&refs, t.policy.device()).unwrap();
    let l = packed.response_width;
    let mut flat = vec![0f32; rows.len() * l];
    for (i, o) in old.iter().enumerate() {
        flat[i * l..i * l + o.len()].copy_from_slice(o);
    }
    let old_t = candle_core::Tensor::from_vec(flat, (rows.len(), l), t.policy.device()).unwrap();
    let (logp, ent) = response_logprobs(&t.policy, &packed, 1.0).unwrap();
    let pin = PolicyLossInput::new(&logp, &old_t, &packed.advantages, &packed.loss_mask);
    let input = ActorLossInput {
        policy: pin,
        ref_logp: None,
        entropy: Some(&ent),
    };
    let out = compute_actor_loss(&input, &cfg.actor).unwrap();
    let g1 = out.loss.backward().unwrap();
    // Reference: -sum(A * logp * mask) / sum(mask)
    let (logp2, _) = response_logprobs(&t.policy, &packed, 1.0).unwrap();
    let n = packed
        .loss_mask
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let l2 = ((logp2 * &packed.advantages).unwrap() * &packed.loss_mask)
        .unwrap()
        .sum_all()
        .unwrap()
        .neg()
        .unwrap()
        .affine(1.0 / n as f64, 0.0)
        .unwrap();
    let g2 = l2.backward().unwrap();
    for (name, var) in t.optimizer.vars() {
        let a = g1
            .get(var.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let b = g2
            .get(var.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let dot: f64 = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (*x as f64) * (*y as f64))
            .sum();
        let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        assert!(nb > 0.0, "{name} got no gradient");
        let cos = dot / (na * nb);
        assert!(cos > 1.0 - 1e-5, "{name}: cosine {cos}");
        assert!((na - nb).abs() <= 1e-4 * nb, "{name}: norms {na} vs {nb}");
    }
}

/// An on-policy update (one epoch, one mini-batch) that takes its behaviour log-probs from
/// its own forward pass gives the weights of one fed the trainer's recomputed log-probs, and
/// length-grouped micro-batches give the gradient of the whole batch; an off-policy update
/// without behaviour log-probs is refused.
#[test]
fn on_policy_shortcut_and_micro_batches_match_the_full_update() {
    use turnwise::update::{ActorUpdate, actor_update, is_on_policy, logprobs_no_grad};

    let weights = |t: &Trainer| -> Vec<f32> {
        t.optimizer
            .vars()
            .iter()
            .flat_map(|(_, v)| {
                v.as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            })
            .collect()
    };
    let run = |micro: usize, recompute: bool| -> Vec<f32> {
        let (mut t, rows) = trainer_and_rows();
        let cfg = t.config.clone();
        let upd = ActorUpdate {
            loss: &cfg.actor,
            temperature: 1.0,
            epochs: 1,
            mini_batch: 0,
            micro_batch: micro,
            lr: 1e-3,
            grad_clip: 1e9,
            rollout_is_cap: None,
            share_prefix: true,
        };
        assert!(is_on_policy(&upd, rows.len()));
        let old = recompute.then(|| logprobs_no_grad(&t.sampler, &rows, 1.0, 3).unwrap());
        let mut order = |n: usize| (0..n).rev().collect::<Vec<_>>();
        let stats = actor_update(
            &t.policy,
            &mut t.optimizer,
            &rows,
            old.as_deref(),
            None,
            &upd,
            &mut order,
        )
        .unwrap();
        assert_eq!((stats.applied, stats.skipped), (1, 0));
        weights(&t)
    };
    let (t0, rows) = trainer_and_rows();
    let before = weights(&t0);
    let full = run(0, true);
    let max_diff = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    };
    assert!(max_diff(&full, &before) > 1e-4, "the update moved nothing");
    for (micro, recompute) in [(0, false), (3, true), (3, false)] {
        let got = run(micro, recompute);
        let d = max_diff(&full, &got);
        assert!(
            d < 1e-5,
            "micro {micro}, recompute {recompute}: max diff {d}"
        );
    }

    // Two mini-batches: the second step is off-policy, so behaviour log-probs are required.
    let cfg = t0.config.clone();
    let upd = ActorUpdate {
        loss: &cfg.actor,
        temperature: 1.0,
        epochs: 1,
        mini_batch: rows.len() / 2,
        micro_batch: 0,
        lr: 1e-3,
        grad_clip: 1.0,
        rollout_is_cap: None,
        share_prefix: true,
    };
    assert!(!is_on_policy(&upd, rows.len()));
    let mut t = t0;
    let mut order = |n: usize| (0..n).collect::<Vec<_>>();
    let err = actor_update(
        &t.policy,
        &mut t.optimizer,
        &rows,
        None,
        None,
        &upd,
        &mut order,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("behaviour log-probs"), "{err}");
}

/// Every trained weight of `t`, flattened, by name.
fn weights(t: &Trainer) -> Vec<(String, Vec<f32>)> {
    let mut w: Vec<(String, Vec<f32>)> =
        turnwise_model::model::transformer::varmap_tensors(&t.varmap, true)
            .into_iter()
            .map(|(k, v)| (k, v.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
            .collect();
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

/// `optim.lr_schedule` reaches the optimizer: two tiny GRPO runs (one optimizer step a batch,
/// no weight decay) share their first step, where both rates are `optim.lr`; at the second a
/// linear decay to 0 over `run.steps = 2` halves the rate, so (same weights, same rollouts, same
/// gradients, same AdamW moments) the weights move half as far as under the constant rate. The
/// logged `actor/lr` is the rate used, and a cosine schedule with warm-up logs its curve.
#[test]
fn the_rl_learning_rate_schedule_changes_the_update() {
    let run = |sets: &[&str], steps: usize| {
        let mut ov = tiny_overrides();
        ov.extend(
            // An entropy bonus: a gradient whatever the tiny model's rewards.
            [
                "run.steps=2",
                "optim.weight_decay=0.0",
                "actor.entropy_coeff=0.01",
            ]
            .iter()
            .chain(sets)
            .map(|s| s.to_string()),
        );
        let cfg = TrainConfig::resolve(Some("grpo"), None, &ov).unwrap();
        let mut t = Trainer::new(cfg).unwrap();
        t.warm_start(&mut |_, _, _| {}).unwrap();
        t.freeze_reference().unwrap();
        let mut lrs = Vec::new();
        let mut snaps = vec![weights(&t)];
        for _ in 0..steps {
            lrs.push(t.rl_step().unwrap().metrics["actor/lr"]);
            snaps.push(weights(&t));
        }
        (lrs, snaps)
    };
    let (lr_c, w_c) = run(&[], 2);
    let (lr_l, w_l) = run(&["optim.lr_schedule=\"linear\""], 2);
    let lr = TrainConfig::default().optim.lr;
    assert_eq!(lr_c, vec![lr, lr]);
    assert_eq!(lr_l, vec![lr, lr * 0.5]);
    let dist = |a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]| {
        a.iter()
            .zip(b)
            .flat_map(|((_, x), (_, y))| x.iter().zip(y).map(|(p, q)| f64::from(p - q).powi(2)))
            .sum::<f64>()
            .sqrt()
    };
    assert_eq!(dist(&w_c[1], &w_l[1]), 0.0, "the first steps are the same");
    let ratio = dist(&w_l[2], &w_l[1]) / dist(&w_c[2], &w_c[1]);
    assert!((ratio - 0.5).abs() < 0.02, "second-step move ratio {ratio}");

    // Warm-up over 2 of 4 steps (lr/2, lr), then a cosine over the remaining 2 to a floor of
    // lr/10: progress 0 and 1/2.
    let (lr_cos, _) = run(
        &[
            "run.steps=4",
            "optim.lr_schedule=\"cosine\"",
            "optim.warmup_steps=2",
            "optim.min_lr_ratio=0.1",
        ],
        4,
    );
    let floor = lr * 0.1;
    let cos = |p: f64| floor + (lr - floor) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos());
    let expect = [lr * 0.5, lr, cos(0.0), cos(0.5)];
    for (got, want) in lr_cos.iter().zip(expect) {
        assert!((got - want).abs() < 1e-15, "{lr_cos:?} vs {expect:?}");
    }
}
