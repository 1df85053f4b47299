//! Clipping-bias correction (spec §5.6).
//!
//! - Under micro-batching: `C` and its 1/B, 1/|y| factors are taken over the whole mini-batch, so
//!   the mini-batch gradient does not depend on how the mini-batch is cut into micro-batches.
//! - At the presets' own update settings (grad clip 1.0, AdamW, lr, two mini-batches = two
//!   optimizer steps), on rows with hand-set drift: the correction changes the weights (S-PPO
//!   against PPO, ST-PPO against Turn-PPO), and the trainer applies the weighted gradient at
//!   the preset's lr, with no step scaled by s̄.
//! - What AdamW (the crate's own, β1 0.9, β2 0.95) keeps of the weights: the mix of the samples'
//!   gradients, not a step size (a factor constant over time is cancelled; the old rule's lr·s̄
//!   is undone by the moments).
//! - In the paper's more off-policy setting (App. A.5: 1 on-policy + 3 off-policy mini-batches,
//!   the override each preset's description names), on the rollouts the trainer samples itself:
//!   the correction changes the weights exactly when an off-policy mini-batch clipped a token.
mod common;

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor, Var};
use turnwise::config::TrainConfig;
use turnwise::trainer::Trainer;
use turnwise::update::{
    ActorUpdate, Row, UpdateStats, actor_update, logprobs_no_grad, minibatch_gradient,
};
use turnwise_model::model::transformer::varmap_tensors;
use turnwise_model::optim::{AdamW, AdamWConfig, Gradients};

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

// --- What of the correction survives AdamW (§5.6), at the presets' optimizer settings. ---

/// The actor's AdamW as `preset` configures it: its β1, β2 and weight decay, with its lr and
/// grad clip (0.9, 0.95, 0, 2e-4, 1.0 for the PPO family).
fn preset_optimizer(preset: &str) -> (AdamWConfig, f64, f64) {
    let cfg = TrainConfig::resolve(Some(preset), None, &[]).unwrap();
    let o = &cfg.optim;
    assert_eq!(
        (o.beta1, o.beta2, o.grad_clip),
        (0.9, 0.95, 1.0),
        "{preset}"
    );
    let adamw = AdamWConfig {
        beta1: o.beta1,
        beta2: o.beta2,
        weight_decay: o.weight_decay,
        ..AdamWConfig::default()
    };
    (adamw, o.lr, o.grad_clip)
}

/// How a mini-batch's weighted gradient reaches the optimizer.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Applied {
    /// What `turnwise::update` does: the gradient of `Σ_i s_i·loss_i` at the preset's lr.
    Weights,
    /// The rule before issue 49: that gradient divided by `s̄` (before the norm clip), the step
    /// taken at `lr·s̄`.
    StepScaledByMean,
}

/// One mini-batch: per sample, its loss weight `s_i` and its gradient `g_i` (of a linear loss
/// `⟨g_i, θ⟩`, all samples with the same loss share).
type Samples = Vec<(f64, Vec<f32>)>;

/// θ's displacement from 0 after `rl_steps` batches of the mini-batches `mbs`, one AdamW step
/// each (the crate's own optimizer, fresh moments, the preset's settings), each mini-batch's
/// gradient `(1/n)·Σ_i s_i·g_i` applied as `rule` and clipped at the preset's grad clip as
/// the trainer clips it.
fn adamw_displacement(mbs: &[Samples], rl_steps: usize, rule: Applied) -> Vec<f64> {
    let (adamw, lr, clip) = preset_optimizer("st-ppo");
    let d = mbs[0][0].1.len();
    let theta = Var::from_tensor(&Tensor::zeros(d, DType::F32, &Device::Cpu).unwrap()).unwrap();
    let vars = vec![("theta".to_string(), theta.clone())];
    let mut opt = AdamW::new(vars.clone(), adamw).unwrap();
    for _ in 0..rl_steps {
        for mb in mbs {
            let n = mb.len() as f64;
            let mut g = vec![0f32; d];
            for (s, gi) in mb {
                for (a, b) in g.iter_mut().zip(gi) {
                    *a += (s / n) as f32 * b;
                }
            }
            let mean = mb.iter().map(|(s, _)| s).sum::<f64>() / n;
            let (divide, step_lr) = match rule {
                Applied::Weights => (1.0, lr),
                Applied::StepScaledByMean => (mean, lr * mean),
            };
            let g = Tensor::from_vec(g, d, &Device::Cpu)
                .unwrap()
                .affine(1.0 / divide, 0.0)
                .unwrap();
            let loss = theta.as_tensor().mul(&g).unwrap().sum_all().unwrap();
            let grads = Gradients::from_grad_store(&loss.backward().unwrap(), &vars);
            let norm = grads.global_norm().unwrap();
            assert!(
                norm < clip,
                "the clip binds at norm {norm}: pick smaller gradients"
            );
            opt.step_scaled(&grads, step_lr, Gradients::clip_factor(norm, clip))
                .unwrap();
        }
    }
    theta
        .as_tensor()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect()
}

/// `d` pseudo-random values in [−scale, scale] from `seed`.
fn noise(seed: u64, d: usize, scale: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..d)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            scale * ((x >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0)
        })
        .collect()
}

fn cosine(a: &[f64], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * f64::from(*y)).sum();
    let na = a.iter().map(|x| x * x).sum::<f64>().sqrt();
    let nb = b.iter().map(|y| f64::from(*y).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

fn l2(v: &[f64]) -> f64 {
    v.iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// What survives AdamW: the weights set the mix of the samples' gradients where they share
/// coordinates (every coordinate here, as in a dense network). Two samples a, b in the
/// off-policy mini-batch after an on-policy one, 20 RL steps at the presets' AdamW: the lower
/// b's weight, the less the weights move along b's gradient (the cosine falls step by step,
/// by more than 0.2 from s_b = 1 to 0), while a's pull grows.
#[test]
fn adamw_keeps_the_mix_the_sample_weights_set() {
    let d = 512;
    let (h, a, b) = (noise(1, d, 0.01), noise(2, d, 0.01), noise(3, d, 0.01));
    let run = |s_b: f64| {
        let mbs = vec![
            vec![(1.0, h.clone())],
            vec![(1.0, a.clone()), (s_b, b.clone())],
        ];
        adamw_displacement(&mbs, 20, Applied::Weights)
    };
    let weights = [1.0, 0.7, 0.4, 0.0];
    let along: Vec<(f64, f64)> = weights
        .iter()
        .map(|&s| {
            // The loss is minimised: a sample pulls the weights along −g.
            let pull: Vec<f64> = run(s).iter().map(|x| -x).collect();
            (cosine(&pull, &b), cosine(&pull, &a))
        })
        .collect();
    eprintln!("s_b {weights:?}: cos(−Δθ, g_b), cos(−Δθ, g_a) = {along:?}");
    for w in along.windows(2) {
        assert!(w[1].0 < w[0].0 - 0.03, "b's pull did not fall: {along:?}");
        assert!(w[1].1 > w[0].1, "a's pull did not grow: {along:?}");
    }
    assert!(along[0].0 - along[3].0 > 0.2, "{along:?}");
}

/// What AdamW cancels: a factor common to every gradient of the run (a uniform s on every
/// sample, every step) leaves the weights where they were without it (to 1e-4 of the move);
/// so does a weight constant over time on the coordinates only its sample reaches.
#[test]
fn adamw_cancels_a_factor_constant_over_time() {
    let d = 256;
    let (h, a, b) = (noise(4, d, 0.01), noise(5, d, 0.01), noise(6, d, 0.01));
    let run = |s: f64| {
        let mbs = vec![
            vec![(s, h.clone()), (s, a.clone())],
            vec![(s, a.clone()), (s, b.clone())],
        ];
        adamw_displacement(&mbs, 20, Applied::Weights)
    };
    let (full, half) = (run(1.0), run(0.5));
    let apart: Vec<f64> = full.iter().zip(&half).map(|(x, y)| x - y).collect();
    assert!(
        l2(&apart) < 1e-4 * l2(&full),
        "a common factor 0.5 moved the weights {:.3e} apart (move {:.3e})",
        l2(&apart),
        l2(&full)
    );
    // One coordinate that only one sample of the off-policy mini-batch reaches.
    let alone = |s: f64| {
        let mbs = vec![
            vec![(1.0, vec![0.0])],
            vec![(s, vec![0.05]), (1.0, vec![0.0])],
        ];
        adamw_displacement(&mbs, 20, Applied::Weights)[0]
    };
    let base = alone(1.0);
    for s in [0.5, 0.2] {
        let r = alone(s) / base;
        assert!((r - 1.0).abs() < 1e-3, "weight {s}: moved {r:.4} as far");
    }
}

/// The claim made before issue 49 and false under AdamW: that dividing the weighted gradient by
/// s̄ and stepping at lr·s̄ moves each sample's coordinates s_i as far (the effective per-sample
/// gradient s_i·∇loss_i). On a coordinate only one off-policy sample reaches (the review's
/// scalar case), with s̄ = 0.5 the weights move the same distance whatever the sample's own
/// weight (0.2, 0.5 or 1), and far more than half as far: β1 = 0.9 carries the gradient into
/// the later, full-lr steps. (A test asserting the old claim, a move of s_i, fails here.)
#[test]
fn a_step_size_factor_does_not_survive_adamw() {
    let alone = |s_i: f64, rule: Applied| {
        // The other sample's weight puts the mini-batch's mean at 0.5 (1 uncorrected).
        let other = if s_i == 1.0 && rule == Applied::Weights {
            1.0
        } else {
            1.0 - s_i
        };
        let mbs = vec![
            vec![(1.0, vec![0.0])],
            vec![(s_i, vec![0.05]), (other, vec![0.0])],
        ];
        adamw_displacement(&mbs, 20, rule)[0]
    };
    let uncorrected = alone(1.0, Applied::Weights);
    let moved: Vec<f64> = [0.2, 0.5, 1.0]
        .iter()
        .map(|&s| alone(s, Applied::StepScaledByMean) / uncorrected)
        .collect();
    eprintln!("old rule, s̄ = 0.5, s_i = 0.2 / 0.5 / 1: moved {moved:?} as far as uncorrected");
    for m in &moved {
        assert!((m - moved[0]).abs() < 1e-3, "{moved:?}");
        assert!(*m > 0.6, "moved {m}: the step factor held");
    }
}

// --- The paper's more off-policy setting (ST-PPO App. A.5: 1 on-policy + 3 off-policy). ---

/// The documented override of `preset`'s more off-policy variant, read from its description
/// (what `turnwise presets` prints): the `--set key=value` after "More off-policy variant".
fn variant_override(preset: &str) -> String {
    let cfg = TrainConfig::resolve(Some(preset), None, &[]).unwrap();
    let d = &cfg.description;
    let at = d
        .find("More off-policy variant")
        .unwrap_or_else(|| panic!("{preset}: no more off-policy variant in its description"));
    let rest = &d[at..];
    let set = rest.find("--set ").expect("a --set line") + "--set ".len();
    rest[set..].split_whitespace().next().unwrap().to_string()
}

/// The five PPO-family presets name the same override, and it gives the paper's structure:
/// 4 optimizer steps per batch of 128 rollouts, 3 of them off-policy; their shipped structure
/// stays 1 + 1.
#[test]
fn the_more_off_policy_variant_is_documented_for_the_ppo_family() {
    for preset in ["st-ppo", "s-ppo", "s-grpo", "turn-ppo", "ppo"] {
        let set = variant_override(preset);
        assert_eq!(set, "optim.mini_batch_size=32", "{preset}");
        let shipped = TrainConfig::resolve(Some(preset), None, &[]).unwrap();
        let variant = TrainConfig::resolve(Some(preset), None, &[set]).unwrap();
        let rows = shipped.rollout.prompts_per_step * shipped.rollout.group_size;
        assert_eq!(rows, 128, "{preset}");
        assert_eq!(shipped.update_structure(), (2, 1), "{preset} as shipped");
        assert_eq!(variant.update_structure(), (4, 3), "{preset}'s variant");
    }
}

/// `preset` in its more off-policy variant (the description's override), scaled only in world
/// and model: the tiny world and model of `common::tiny_overrides` with a 40-step warm start,
/// 2 prompts × the preset's own group size, and the mini-batch a quarter of that batch, so
/// that the update is the variant's 1 on-policy + 3 off-policy optimizer steps; the preset's
/// own lr, clip, epochs, loss and AdamW.
fn one_plus_three(preset: &str) -> Trainer {
    let full = TrainConfig::resolve(Some(preset), None, &[variant_override(preset)]).unwrap();
    assert_eq!(full.update_structure(), (4, 3));
    let g = full.rollout.group_size;
    let mut sets: Vec<String> = common::tiny_overrides()
        .into_iter()
        .filter(|s| {
            [
                "rollout.prompts_per_step=",
                "rollout.group_size=",
                "optim.mini_batch_size=",
                "sft.steps=",
            ]
            .iter()
            .all(|k| !s.starts_with(k))
        })
        .collect();
    sets.extend([
        "rollout.prompts_per_step=2".to_string(),
        format!("optim.mini_batch_size={}", 2 * g / 4),
        "sft.steps=40".to_string(),
    ]);
    let cfg = TrainConfig::resolve(Some(preset), None, &sets).unwrap();
    assert_eq!(
        cfg.update_structure(),
        (4, 3),
        "{preset}: 1 on-policy + 3 off-policy"
    );
    assert_eq!(
        (
            cfg.optim.lr,
            cfg.optim.grad_clip,
            cfg.optim.ppo_epochs,
            &cfg.actor
        ),
        (
            full.optim.lr,
            full.optim.grad_clip,
            full.optim.ppo_epochs,
            &full.actor
        ),
        "{preset}: its own update settings"
    );
    let mut t = Trainer::new(cfg).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    t.freeze_reference().unwrap();
    t
}

/// In the 1 + 3 setting, on the rollouts the trainer samples itself (no hand-set drift): the
/// method and its base start from the same weights and sample the same first batch; their
/// first mini-batch is on-policy and the same. RL steps run in lockstep until the method's
/// off-policy mini-batches clip a token with a non-zero advantage; until then the two are the
/// same to the bit (nothing to correct), and in that step the method's weights differ from
/// the base's. Returns the step, s̄ of its off-policy mini-batches and the weights' distance.
fn correction_acts_in_one_plus_three(method: &str, base: &str) -> (usize, f64, f32) {
    let (mut tm, mut tb) = (one_plus_three(method), one_plus_three(base));
    assert_eq!(
        max_abs_diff(&weights(&tm), &weights(&tb)),
        0.0,
        "{method} and {base} start from the same weights"
    );
    for step in 1..=6 {
        let before = weights(&tm);
        let (om, ob) = (tm.rl_step().unwrap(), tb.rl_step().unwrap());
        let clipped = om.metrics["actor/clip_bias_num_clipped"];
        let apart = max_abs_diff(&weights(&tm), &weights(&tb));
        let moved = max_abs_diff(&weights(&tm), &before);
        eprintln!(
            "{method} vs {base}, step {step}: clipped {clipped} (base {}), s̄ off-policy {:?}, \
             mb0 {:?}; weights {apart:.3e} apart, moved {moved:.3e}",
            ob.metrics["actor/clip_bias_num_clipped"],
            om.metrics.get("actor/clip_bias_scale_offpolicy"),
            om.metrics.get("actor/clip_bias_scale_mb0"),
        );
        assert_eq!(
            om.metrics["actor/clip_bias_scale_mb0"], 1.0,
            "the first mini-batch is on-policy"
        );
        if clipped == 0.0 {
            assert_eq!(
                apart, 0.0,
                "step {step}: nothing clipped, yet the weights differ"
            );
            continue;
        }
        let scale = om.metrics["actor/clip_bias_scale_offpolicy"];
        assert!(scale < 1.0 && scale > 0.0, "s̄ off-policy {scale}");
        assert!(
            apart > 0.0 && moved > 0.0,
            "step {step}: {clipped} clipped tokens, yet {method}'s weights equal {base}'s"
        );
        return (step, scale, apart);
    }
    panic!("{method}: no off-policy mini-batch clipped a token in 6 steps of the 1 + 3 setting");
}

#[test]
fn st_ppo_moves_other_weights_than_turn_ppo_in_the_one_plus_three_setting() {
    correction_acts_in_one_plus_three("st-ppo", "turn-ppo");
}

#[test]
fn s_ppo_moves_other_weights_than_ppo_in_the_one_plus_three_setting() {
    correction_acts_in_one_plus_three("s-ppo", "ppo");
}

/// The trainer applies the weighted gradient as it is: one mini-batch (clipped rows, s̄ < 1)
/// from a fresh AdamW moves each weight by `−lr·ĝ/(|ĝ| + ε)`, ĝ the mini-batch gradient after
/// the norm clip, at the preset's lr (no step scaled by s̄), and `actor/grad_norm` is that
/// gradient's norm before the clip.
#[test]
fn the_update_applies_the_weighted_gradient_at_the_preset_lr() {
    let (mut t, rows, old) = setup("st-ppo");
    assert_eq!(t.optimizer.step_count(), 0, "a fresh optimizer");
    let cfg = t.config.clone();
    let upd = ActorUpdate {
        loss: &cfg.actor,
        temperature: cfg.rollout.temperature,
        epochs: 1,
        mini_batch: 0,
        micro_batch: 0,
        lr: cfg.optim.lr,
        grad_clip: cfg.optim.grad_clip,
        rollout_is_cap: None,
        share_prefix: true,
    };
    let all: Vec<usize> = (0..rows.len()).collect();
    let g = minibatch_gradient(
        &t.policy,
        t.optimizer.vars(),
        &rows,
        &all,
        Some(&old),
        None,
        &upd,
    )
    .unwrap()
    .expect("finite loss");
    let s_bar = g.clip_bias_mean_weight.expect("downweight");
    assert!(s_bar < 0.9, "s̄ {s_bar}");
    let norm = g.grads.global_norm().unwrap();
    let clip = (cfg.optim.grad_clip / norm).min(1.0);
    let before = weights(&t);
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
    assert_eq!(stats.applied, 1);
    assert!((stats.metrics["actor/grad_norm"] - norm).abs() <= 1e-9 * norm);
    assert!((stats.metrics["actor/clip_bias_scale"] - s_bar).abs() < 1e-12);
    let after = weights(&t);
    let eps = AdamWConfig::default().eps;
    let (mut worst, mut checked) = (0f64, 0usize);
    for (name, grad) in g.grads.iter() {
        let grad = grad.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (b, a) = (&before[name], &after[name]);
        for ((gv, bv), av) in grad.iter().zip(b).zip(a) {
            let gc = f64::from(*gv) * clip;
            let want = -cfg.optim.lr * gc / (gc.abs() + eps);
            let got = f64::from(av - bv);
            worst = worst.max((got - want).abs());
            checked += 1;
        }
    }
    assert!(checked > 1000);
    // f32 weights near 1 resolve steps to about 1e-7; the lr is 2e-4, the old rule's step
    // lr·s̄ would be off by (1 − s̄)·lr ≥ 2e-5.
    assert!(
        worst < 0.05 * cfg.optim.lr,
        "a weight moved {worst:.3e} off −lr·sign(ĝ) (lr {}, s̄ {s_bar})",
        cfg.optim.lr
    );
}
