//! The sampler–trainer mismatch per turn (issue 30 item 6): every RL step logs
//! `rollout/logprob_mismatch/{abs_mean,abs_max,k3_mean}` and, per agent turn,
//! `rollout/logprob_mismatch/turn_{k}/{abs_mean,k3_mean}`, comparing the log-probs the rollout
//! recorded for its sampled tokens with the trainer's for the same tokens under the same
//! weights: the recomputation of an off-policy update (the preset's mini-batches), or the
//! on-policy update's own forward pass. The local engine samples what the trainer computes, so
//! the mismatch is rounding; a row compared with another row's log-probs would be far off.

mod common;

use std::collections::BTreeSet;

use turnwise::config::TrainConfig;
use turnwise::trainer::Trainer;

fn trainer(preset: &str, extra: &[&str]) -> Trainer {
    let mut sets = common::tiny_overrides();
    sets.extend(
        ["rollout.prompts_per_step=3", "rollout.group_size=2"]
            .into_iter()
            .chain(extra.iter().copied())
            .map(String::from),
    );
    let cfg = TrainConfig::resolve(Some(preset), None, &sets).unwrap();
    let mut t = Trainer::new(cfg).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    t.freeze_reference().unwrap();
    t
}

/// Two RL steps of `preset` (with `extra`): each logs the mismatch over the batch and for
/// every agent turn that has a loss token, and the local engine's mismatch is rounding.
fn check(preset: &str, extra: &[&str]) {
    let mut t = trainer(preset, extra);
    for step in 1..=2 {
        let out = t.rl_step().unwrap();
        let m = &out.metrics;
        let get = |k: &str| {
            *m.get(&format!("rollout/logprob_mismatch/{k}"))
                .unwrap_or_else(|| panic!("{preset} step {step}: no rollout/logprob_mismatch/{k}"))
        };
        let (abs_mean, abs_max, k3) = (get("abs_mean"), get("abs_max"), get("k3_mean"));
        assert!(
            abs_max < 1e-3 && abs_mean <= abs_max,
            "{preset} step {step}: |Δ log p| mean {abs_mean}, max {abs_max}"
        );
        assert!((0.0..1e-6).contains(&k3), "{preset} step {step}: k3 {k3}");
        // One pair of per-turn figures for every turn with a loss token in the batch.
        let turns: BTreeSet<i32> = out
            .episodes
            .iter()
            .flat_map(|e| {
                let f = e.trajectory.flatten(t.config.rollout.train_on_forced);
                f.loss_mask
                    .into_iter()
                    .zip(f.turn_id)
                    .filter(|&(mask, _)| mask > 0)
                    .map(|(_, turn)| turn)
                    .collect::<Vec<_>>()
            })
            .collect();
        assert!(turns.len() >= 2, "{preset}: single-turn batch {turns:?}");
        let logged: BTreeSet<i32> = m
            .keys()
            .filter_map(|k| {
                k.strip_prefix("rollout/logprob_mismatch/turn_")?
                    .strip_suffix("/abs_mean")?
                    .parse()
                    .ok()
            })
            .collect();
        assert_eq!(logged, turns, "{preset} step {step}");
        for k in &turns {
            let v = get(&format!("turn_{k}/abs_mean"));
            assert!(
                v <= abs_max,
                "{preset} step {step} turn {k}: {v} > {abs_max}"
            );
        }
    }
}

/// GRPO as shipped: mini-batches, so the trainer recomputes the behaviour log-probs.
#[test]
fn off_policy_updates_log_the_recomputation_against_the_sampler() {
    check("grpo", &[]);
}

/// One mini-batch of the whole batch and one epoch: no recomputation pass; the update's own
/// forward pass (the weights the rollout sampled from) is compared.
#[test]
fn on_policy_updates_log_their_forward_pass_against_the_sampler() {
    let cfg = TrainConfig::resolve(
        Some("grpo"),
        None,
        &[
            "optim.mini_batch_size=0".into(),
            "optim.ppo_epochs=1".into(),
        ],
    )
    .unwrap();
    assert_eq!((cfg.optim.mini_batch_size, cfg.optim.ppo_epochs), (0, 1));
    check("grpo", &["optim.mini_batch_size=0", "optim.ppo_epochs=1"]);
}

/// The trained weights, flattened in name order.
fn weights(t: &Trainer) -> Vec<f32> {
    let named: std::collections::BTreeMap<_, _> =
        turnwise_model::model::transformer::varmap_tensors(&t.varmap, true)
            .into_iter()
            .collect();
    named
        .into_values()
        .flat_map(|v| v.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect()
}

/// `optim.old_logprobs = "rollout"`: GRPO's mini-batched update takes the rollout's recorded
/// log-probs as its behaviour log-probs and skips the recomputation pass
/// (`timing_s/old_log_prob`, which the recomputing run logs, is absent; no mismatch is logged:
/// there is no trainer figure to compare with). The local engine records the trainer's
/// log-probs to rounding, so two steps move the weights as the recomputation does: the two
/// weight changes point the same way.
#[test]
fn rollout_old_logprobs_skip_the_recomputation_and_train_alike() {
    // The tiny model answers nothing right: DAPO's overlong penalty of its long responses
    // gives GRPO advantages (as in tests/kl_reward.rs).
    let shaped = "overlong_buffer.enable=true";
    let mut recompute = trainer("grpo", &[shaped]);
    let mut rollout = trainer("grpo", &[shaped, "optim.old_logprobs=\"rollout\""]);
    let start = weights(&recompute);
    assert_eq!(start, weights(&rollout), "the same warm start");
    for step in 1..=2 {
        let a = recompute.rl_step().unwrap();
        let b = rollout.rl_step().unwrap();
        assert!(
            a.metrics["actor/optimizer_steps"] >= 2.0,
            "an off-policy update"
        );
        assert!(
            a.metrics.contains_key("timing_s/old_log_prob"),
            "step {step}"
        );
        assert!(a.metrics.contains_key("rollout/logprob_mismatch/abs_mean"));
        assert!(
            !b.metrics.contains_key("timing_s/old_log_prob"),
            "step {step}: the rollout-log-prob run recomputed the behaviour log-probs"
        );
        assert!(
            !b.metrics
                .keys()
                .any(|k| k.starts_with("rollout/logprob_mismatch/")),
            "a rollout-log-prob update logs no mismatch"
        );
    }
    let (wa, wb) = (weights(&recompute), weights(&rollout));
    let da: Vec<f64> = wa
        .iter()
        .zip(&start)
        .map(|(w, s)| f64::from(w - s))
        .collect();
    let db: Vec<f64> = wb
        .iter()
        .zip(&start)
        .map(|(w, s)| f64::from(w - s))
        .collect();
    let dot: f64 = da.iter().zip(&db).map(|(x, y)| x * y).sum();
    let norm = |d: &[f64]| d.iter().map(|x| x * x).sum::<f64>().sqrt();
    assert!(norm(&da) > 0.0, "no update");
    let cos = dot / (norm(&da) * norm(&db));
    assert!(cos > 0.99, "weight changes point apart: cos {cos}");
}

/// `rollout.batch_invariant`: the trainer's rollouts (tokens and the log-probs they record) are
/// the same bits sampled on one thread and on two (one sampling shard, or two with other
/// batch-mates and padding), so a run's rollouts do not depend on the machine's cores. With
/// the default kernels they differ (checked, so the test cannot pass for want of a difference).
#[test]
fn batch_invariant_rollouts_do_not_depend_on_the_cores() {
    let rows = |t: &Trainer, threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| common::sampled_rows(t, 8))
            .into_iter()
            .map(|r| {
                let lps: Vec<u32> = r.sampled_logprobs.iter().map(|x| x.to_bits()).collect();
                (r.response, lps)
            })
            .collect::<Vec<_>>()
    };
    let invariant = trainer("grpo", &["rollout.batch_invariant=true"]);
    assert!(invariant.rollout_policy().model.is_batch_invariant());
    assert!(!invariant.sampler.is_batch_invariant());
    assert!(
        rows(&invariant, 1) == rows(&invariant, 2),
        "batch-invariant rollouts changed with the number of threads"
    );
    let fast = trainer("grpo", &[]);
    assert!(
        rows(&fast, 1) != rows(&fast, 2),
        "the default kernels sampled the same bits on 1 and 2 threads"
    );
}
