//! Data parallelism on the CPU's cores (`turnwise::shard`): the warm start, the
//! actor's mini-batch gradient, the no-grad log-prob passes and batched sampling cut their rows
//! into one shard per thread of rayon's pool. Cut into one shard or several, the results must
//! agree to rounding: each shard's loss is divided by the whole batch's denominators, and the
//! shards' gradients are summed.

mod common;

use turnwise::config::TrainConfig;
use turnwise::trainer::Trainer;
use turnwise::update::{ActorUpdate, Row, logprobs_no_grad, minibatch_gradient};
use turnwise_model::sampling::{SamplingParams, generate};

/// `f` on a rayon pool of `threads` threads (so `shard_count` sees that many cores).
fn on_threads<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}

fn trainer(preset: &str) -> Trainer {
    let mut sets = common::tiny_overrides();
    sets.extend(
        [
            "rollout.prompts_per_step=3",
            "rollout.group_size=4",
            "sft.batch_size=8",
        ]
        .map(String::from),
    );
    Trainer::new(TrainConfig::resolve(Some(preset), None, &sets).unwrap()).unwrap()
}

fn weights(t: &Trainer) -> Vec<(String, Vec<f32>)> {
    let mut w: Vec<(String, Vec<f32>)> = t
        .trainable_vars()
        .into_iter()
        .map(|(k, v)| (k, v.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

fn max_abs_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|((ka, va), (kb, vb))| {
            assert_eq!(ka, kb);
            va.iter().zip(vb).map(|(x, y)| (x - y).abs())
        })
        .fold(0f32, f32::max)
}

/// The warm start's steps give the same weights on one thread and on three.
#[test]
fn warm_start_weights_do_not_depend_on_the_shards() {
    let mut one = trainer("grpo");
    let mut three = trainer("grpo");
    let before = weights(&one);
    let mut losses = [Vec::new(), Vec::new()];
    let [l1, l3] = &mut losses;
    on_threads(1, || one.warm_start(&mut |_, l, _| l1.push(l)).unwrap());
    on_threads(3, || three.warm_start(&mut |_, l, _| l3.push(l)).unwrap());
    assert_eq!(l1.len(), 3);
    for (a, b) in l1.iter().zip(l3.iter()) {
        assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "loss {a} vs {b}");
    }
    let (w1, w3) = (weights(&one), weights(&three));
    let moved = max_abs_diff(&before, &w1);
    assert!(moved > 1e-4, "the warm start moved the weights by {moved}");
    let d = max_abs_diff(&w1, &w3);
    assert!(d <= 1e-5, "weights differ by {d}");
}

/// Every preset's off-policy mini-batch gradient and its metrics agree on one thread and on
/// three; so do the no-grad log-probs. The shards must not compute on their own rows what spans
/// the mini-batch: the clipping-bias correction's step scale (S-PPO, ST-PPO, S-GRPO), the loss
/// denominators, and Dr.GRPO's constant K (the maximum response length, not a shard's padded
/// width: shards are length-sorted, so a width would weigh short rows up to several times more).
#[test]
fn minibatch_gradient_does_not_depend_on_the_shards() {
    let mut t = trainer("grpo");
    t.warm_start(&mut |_, _, _| {}).unwrap();
    let (all, _, _) = t.sample_batch().unwrap();
    let mut rows: Vec<Row> = all
        .episodes
        .iter()
        .map(|e| Row::from_trajectory(&e.episode.trajectory, false))
        .collect();
    assert_eq!(rows.len(), 12);
    for (i, r) in rows.iter_mut().enumerate() {
        // Responses of 20 to 119 tokens (the tiny model fills its 120-token budget), so that
        // length-sorted shards have different widths.
        let n = (20 + 9 * i).min(r.response.len());
        r.response.truncate(n);
        r.loss_mask.truncate(n);
        r.turn_id.truncate(n);
        let a = if i % 2 == 0 { 1.0 } else { -0.5 };
        r.advantages = r.loss_mask.iter().map(|&m| a * f32::from(m)).collect();
        r.returns.truncate(n);
        // A2TGPO's per-token clip scales, varied per row.
        let c = [0.8, 1.0, 1.2][i % 3];
        r.channels.insert(
            turnwise_core::advantage::Channel::ClipScale,
            r.loss_mask.iter().map(|_| c).collect(),
        );
    }
    let lens: Vec<usize> = rows.iter().map(|r| r.response.len()).collect();
    assert!(
        lens.iter().max() > lens.iter().min(),
        "rows of different lengths, so shards have different widths: {lens:?}"
    );
    let old1 = on_threads(1, || logprobs_no_grad(&t.sampler, &rows, 1.0, 64).unwrap());
    let old3 = on_threads(3, || logprobs_no_grad(&t.sampler, &rows, 1.0, 64).unwrap());
    for (a, b) in old1.iter().zip(&old3) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-5, "log-prob {x} vs {y}");
        }
    }
    // Push the behaviour log-probs away so that ratios leave the clip range.
    let old: Vec<Vec<f32>> = old1
        .iter()
        .enumerate()
        .map(|(i, r)| r.iter().map(|x| x + [0.5, -0.5, 0.3][i % 3]).collect())
        .collect();
    let mb: Vec<usize> = (0..rows.len()).collect();
    for preset in turnwise::config::presets::names() {
        // The preset's own loss; the tiny world's response budget (Dr.GRPO's K).
        let sets = ["rollout.max_response_tokens=120", "judge.enabled=false"].map(String::from);
        let cfg = TrainConfig::resolve(Some(preset), None, &sets).unwrap();
        let kind = cfg.actor.policy.resolve().unwrap().kind;
        let upd = ActorUpdate {
            loss: &cfg.actor,
            temperature: 1.0,
            epochs: 1,
            mini_batch: 0,
            micro_batch: 0,
            lr: 1e-3,
            grad_clip: 1.0,
            rollout_is_cap: None,
            share_prefix: true,
        };
        let grad = |threads| {
            on_threads(threads, || {
                let g = minibatch_gradient(
                    &t.policy,
                    t.optimizer.vars(),
                    &rows,
                    &mb,
                    Some(&old),
                    // The KL term's reference: the unshifted log-probs.
                    cfg.actor.use_kl_loss.then_some(old1.as_slice()),
                    &upd,
                )
                .unwrap()
                .unwrap_or_else(|| panic!("{preset}: the loss is not finite"));
                (
                    common::sorted_values(&g.grads),
                    g.metrics,
                    g.clip_bias_mean_weight.unwrap_or(1.0),
                )
            })
        };
        let ((g1, m1, s1), (g3, m3, s3)) = (grad(1), grad(3));
        if kind.implies_clip_bias() {
            assert!(m1["actor/clip_bias_num_clipped"] > 0.0, "{preset}: {m1:?}");
            assert!(s1 < 1.0, "{preset}: mean weight s̄ {s1}");
        }
        assert!(
            (s1 - s3).abs() <= 1e-6,
            "{preset}: mean weight s̄ {s1} vs {s3}"
        );
        for k in [
            "actor/clip_bias_scale",
            "actor/clip_bias_norm",
            "actor/clip_bias_num_clipped",
            "actor/pg_loss",
        ] {
            let (a, b) = (m1[k], m3[k]);
            assert!(
                (a - b).abs() <= 1e-5 * a.abs().max(1.0),
                "{preset}: {k}: {a} vs {b}"
            );
        }
        let max = g1
            .iter()
            .flat_map(|(_, v)| v.iter().map(|x| x.abs()))
            .fold(0f32, f32::max);
        assert!(max > 0.0, "{preset}: zero gradient");
        let d = max_abs_diff(&g1, &g3);
        assert!(
            d <= 1e-5 * max,
            "{preset}: gradients differ by {d} (max |g| {max})"
        );
    }
}

/// Batched sampling cut into shards draws the same tokens per row (each row has its own seed).
#[test]
fn sampling_does_not_depend_on_the_shards() {
    let t = trainer("grpo");
    let prompts: Vec<Vec<u32>> = (0..10u32).map(|i| vec![1, 5 + i, 9, 3 + i % 4]).collect();
    let seeds: Vec<u64> = (0..10).map(|i| 100 + i).collect();
    let params = SamplingParams {
        temperature: 1.0,
        max_new_tokens: 12,
        ..Default::default()
    };
    let run = |threads| {
        on_threads(threads, || {
            generate(&t.sampler, &prompts, &seeds, &params, None).unwrap()
        })
    };
    let (one, two) = (run(1), run(2));
    for (a, b) in one.iter().zip(&two) {
        assert_eq!(a.tokens, b.tokens);
        assert_eq!(a.finish, b.finish);
        for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
            assert!((x - y).abs() <= 1e-4, "{x} vs {y}");
        }
    }
}

/// A whole RL step (rollouts, information-gain probes or critic values, advantages, the actor's
/// off-policy mini-batches and the critic's) gives the same metrics and weights on one thread
/// and on three: A2TGPO (probes), PPO (critic) and T2PO (rollouts under the thinking
/// intervention and turn resampling, sampled on one engine per shard).
#[test]
fn an_rl_step_does_not_depend_on_the_shards() {
    for preset in ["a2tgpo", "ppo", "t2po"] {
        let step = |threads| {
            on_threads(threads, || {
                let mut t = trainer(preset);
                t.warm_start(&mut |_, _, _| {}).unwrap();
                t.freeze_reference().unwrap();
                let before = weights(&t);
                let out = t.rl_step().unwrap();
                (out.metrics, before, weights(&t))
            })
        };
        let ((m1, w0, w1), (m3, _, w3)) = (step(1), step(3));
        let mut compared = 0;
        for (k, a) in &m1 {
            // What the shared prefixes saved depends on the shards by design: rows sharing a
            // prefix run it once only when they meet in a shard.
            if common::wall_clock(k) || k.starts_with("actor/shared_prefix") || !a.is_finite() {
                continue;
            }
            let b = m3[k];
            assert!(
                (a - b).abs() <= 1e-4 * a.abs().max(1.0),
                "{preset}: {k} = {a} on one thread, {b} on three"
            );
            compared += 1;
        }
        assert!(compared > 10, "{preset}: {m1:?}");
        if preset == "ppo" {
            assert!(m1["critic/applied_updates"] > 0.0, "{m1:?}");
        } else if preset == "t2po" {
            assert!(m1["rollout/tds_regenerations"] > 0.0, "{m1:?}");
        } else {
            assert!(m1["info_gain/probes"] > 0.0, "{m1:?}");
        }
        // The weights against the step's own size (L2 over every weight): candle's matrix
        // products round by thread count (AVX-512 `gemm` put single weights of a2tgpo 2.4e-5
        // apart on a step of 4e-4: Adam's first step is about lr·g/(|g| + ε), so a gradient that
        // rounding moved near zero moves its weight by a share of lr); a shard lost or counted
        // twice changes the whole step by a share of itself.
        let l2 = |a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]| -> f64 {
            a.iter()
                .zip(b)
                .flat_map(|((_, x), (_, y))| x.iter().zip(y).map(|(p, q)| f64::from(p - q).powi(2)))
                .sum::<f64>()
                .sqrt()
        };
        let (step_size, d) = (l2(&w0, &w1), l2(&w1, &w3));
        assert!(step_size > 0.0, "{preset}: the step moved nothing");
        assert!(
            d <= 1e-2 * step_size,
            "{preset}: weights differ by {d} (L2) on one thread and three, against a step of \
             {step_size} (max single weight {})",
            max_abs_diff(&w1, &w3)
        );
        eprintln!("{preset}: |w1 − w3| = {d:.3e} against a step of {step_size:.3e}");
    }
}
