//! KL in the reward (spec §5.8): config → trainer → rewards before the estimator → metrics, and
//! the adaptive controller's β across a checkpoint.

mod common;

use std::path::Path;

use turnwise::config::TrainConfig;
use turnwise::pipeline::{RunOptions, resume, run};
use turnwise::trainer::Trainer;
use turnwise::trainer::advantage::{KlInReward, compute};
use turnwise::trainer::sampling::StepBatch;
use turnwise::update::{Row, logprobs_no_grad};
use turnwise_model::loss::KlEstimator;

fn config(preset: &str, extra: &[&str]) -> TrainConfig {
    let mut sets = common::tiny_overrides();
    sets.extend(extra.iter().map(|s| s.to_string()));
    TrainConfig::resolve(Some(preset), None, &sets).unwrap()
}

/// A trainer whose policy has moved away from its frozen reference (two RL steps), so that
/// behaviour and reference log-probs differ, and a fresh batch from it.
fn moved_trainer_and_batch(preset: &str, extra: &[&str]) -> (Trainer, StepBatch) {
    let mut t = Trainer::new(config(preset, extra)).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    t.freeze_reference().unwrap();
    for _ in 0..2 {
        t.rl_step().unwrap();
    }
    let (all, selected, _) = t.sample_batch().unwrap();
    assert!(selected.is_none(), "the group filter is off here");
    let rows = rows_of(&all);
    let old = logprobs_no_grad(&t.sampler, &rows, 1.0, 64).unwrap();
    let reference = logprobs_no_grad(t.reference.as_ref().unwrap(), &rows, 1.0, 64).unwrap();
    let moved = rows
        .iter()
        .zip(old.iter().zip(&reference))
        .flat_map(|(r, (o, f))| {
            r.loss_mask
                .iter()
                .zip(o.iter().zip(f))
                .filter(|(m, _)| **m > 0)
                .map(|(_, (o, f))| (o - f).abs())
        })
        .fold(0f32, f32::max);
    assert!(moved > 1e-4, "policy and reference still agree ({moved})");
    (t, all)
}

fn rows_of(b: &StepBatch) -> Vec<Row> {
    b.episodes
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
        .collect()
}

fn advantages(rows: &[Row]) -> Vec<Vec<f32>> {
    rows.iter().map(|r| r.advantages.clone()).collect()
}

/// GAE (the PPO family): KL in the reward changes the advantages of a fixed batch; β = 0
/// changes nothing.
#[test]
fn kl_in_reward_changes_gae_advantages_and_beta_zero_is_off() {
    let (t, b) = moved_trainer_and_batch("ppo", &[]);
    assert!(
        t.config.algorithm.use_kl_in_reward,
        "the ppo preset has KL in the reward"
    );
    let rows = rows_of(&b);
    let values = t.critic.as_ref().unwrap().values(&rows, 64, true).unwrap();
    let old = logprobs_no_grad(&t.sampler, &rows, 1.0, 64).unwrap();
    let reference = logprobs_no_grad(t.reference.as_ref().unwrap(), &rows, 1.0, 64).unwrap();
    let cfg = &t.config;
    let off = compute(cfg, &b.episodes, None, Some(&values), None).unwrap();
    let with = |beta: f64| {
        compute(
            cfg,
            &b.episodes,
            None,
            Some(&values),
            Some(&KlInReward {
                old_logp: &old,
                ref_logp: &reference,
                beta,
                estimator: KlEstimator::K1,
            }),
        )
        .unwrap()
    };
    let zero = with(0.0);
    assert_eq!(advantages(&zero.rows), advantages(&off.rows));
    let on = with(0.05);
    assert_ne!(advantages(&on.rows), advantages(&off.rows));
    let kl = on.reward_kl.expect("the KL is reported");
    assert!(kl.is_finite() && kl != 0.0, "{kl}");
    assert!(off.reward_kl.is_none());
    // The returns (the critic's targets) carry the penalty too.
    let returns = |r: &[Row]| r.iter().map(|r| r.returns.clone()).collect::<Vec<_>>();
    assert_ne!(returns(&on.rows), returns(&off.rows));
}

/// GRPO: the penalty is `β · Σ_t k1(old, ref)` over the rollout's loss tokens, subtracted from
/// its score (verl's GRPO scores the sum of the token-level rewards).
#[test]
fn kl_in_reward_lowers_grpo_scores_by_beta_times_summed_k1() {
    // The tiny model answers nothing right: the overlong penalty of its 119- or 120-token
    // responses gives GRPO advantages, so the policy leaves the reference.
    let (t, b) = moved_trainer_and_batch(
        "grpo",
        &[
            "algorithm.use_kl_in_reward=true",
            "overlong_buffer.enable=true",
        ],
    );
    let rows = rows_of(&b);
    let old = logprobs_no_grad(&t.sampler, &rows, 1.0, 64).unwrap();
    let reference = logprobs_no_grad(t.reference.as_ref().unwrap(), &rows, 1.0, 64).unwrap();
    let beta = 0.3;
    let on = compute(
        &t.config,
        &b.episodes,
        None,
        None,
        Some(&KlInReward {
            old_logp: &old,
            ref_logp: &reference,
            beta,
            estimator: KlEstimator::K1,
        }),
    )
    .unwrap();
    let shifted: Vec<f64> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let k1: f64 = r
                .loss_mask
                .iter()
                .enumerate()
                .filter(|(_, m)| **m > 0)
                .map(|(k, _)| f64::from(old[i][k]) - f64::from(reference[i][k]))
                .sum();
            b.episodes[i].score - beta * k1
        })
        .collect();
    let mut shifted_batch = b.episodes.clone();
    for (e, &s) in shifted_batch.iter_mut().zip(&shifted) {
        e.score = s;
    }
    let by_hand = compute(&t.config, &shifted_batch, None, None, None).unwrap();
    let plain = compute(&t.config, &b.episodes, None, None, None).unwrap();
    let (a, h) = (advantages(&on.rows), advantages(&by_hand.rows));
    for (x, y) in a.iter().flatten().zip(h.iter().flatten()) {
        assert!((x - y).abs() < 1e-5, "{x} vs {y}");
    }
    assert_ne!(a, advantages(&plain.rows));
}

/// The trainer applies it from config and logs verl's metrics; a fixed controller keeps β.
#[test]
fn trainer_logs_reward_kl_metrics() {
    let mut t = Trainer::new(config("ppo", &[])).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    t.freeze_reference().unwrap();
    for _ in 0..2 {
        let m = t.rl_step().unwrap().metrics;
        assert_eq!(
            m.get("actor/reward_kl_penalty_coeff"),
            Some(&0.001),
            "{m:?}"
        );
        assert!(m["actor/reward_kl_penalty"].is_finite());
    }
    // Off: no metric.
    let mut t = Trainer::new(config("ppo", &["algorithm.use_kl_in_reward=false"])).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    t.freeze_reference().unwrap();
    let m = t.rl_step().unwrap().metrics;
    assert!(!m.contains_key("actor/reward_kl_penalty"));
    // Without a reference model the step refuses to run.
    let mut t = Trainer::new(config("ppo", &[])).unwrap();
    t.freeze_reference().unwrap();
    t.reference = None;
    let err = t.rl_step().err().expect("no reference model");
    assert!(format!("{err:#}").contains("reference"), "{err:#}");
    // Estimators that do not read token or outcome rewards reject it.
    let sets: Vec<String> = ["algorithm.use_kl_in_reward=true".to_string()].to_vec();
    let e = TrainConfig::resolve(Some("gigpo"), None, &sets).unwrap_err();
    assert!(e.to_string().contains("algorithm.use_kl_in_reward"), "{e}");
}

/// An adaptive β moves every step and is restored exactly on resume; the critic's shuffled
/// mini-batches over two epochs resume exactly too. (Step 1's KL is 0, the policy being the
/// reference: β shrinks by the clipped error, 1 − 0.2 · 6 rollouts / horizon 10.)
#[test]
fn adaptive_beta_and_critic_minibatches_survive_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(
        "ppo",
        &[
            "algorithm.kl_ctrl.type=adaptive",
            "algorithm.kl_ctrl.target_kl=1e-6",
            "algorithm.kl_ctrl.horizon=10",
            "optim.ppo_epochs=2",
            "optim.mini_batch_size=3",
            "run.steps=4",
            "run.save_every=2",
            "run.keep_checkpoints=3",
            "eval.questions=3",
        ],
    );
    let a = tmp.path().join("a");
    let opts = |dir: &Path| RunOptions {
        dir: dir.to_path_buf(),
        quiet: true,
    };
    run(cfg, &opts(&a), false).unwrap();
    let b = tmp.path().join("b");
    common::copy_dir(&a, &b);
    let step4 = b.join("checkpoints/step-00004");
    std::fs::remove_file(step4.join("COMPLETE")).unwrap();
    for f in [
        "model.safetensors",
        "critic.safetensors",
        "trainer_state.json",
    ] {
        std::fs::remove_file(step4.join(f)).unwrap();
    }
    resume(&b, true).unwrap();
    for f in [
        "model.safetensors",
        "critic.safetensors",
        "critic_optimizer.safetensors",
        "trainer_state.json",
    ] {
        let read = |run: &Path| std::fs::read(run.join("checkpoints/step-00004").join(f)).unwrap();
        assert!(read(&a) == read(&b), "{f} differs after resume");
    }
    let (la, lb) = (
        common::phase_lines(&a.join("metrics.jsonl"), "train"),
        common::phase_lines(&b.join("metrics.jsonl"), "train"),
    );
    assert_eq!(la.len(), 4);
    assert_eq!(la, lb, "metrics of the resumed run differ");
    let betas: Vec<f64> = la
        .iter()
        .map(|l| l["actor/reward_kl_penalty_coeff"].as_f64().unwrap())
        .collect();
    assert_eq!(betas[0], 0.001);
    assert!(
        (betas[1] - 0.001 * (1.0 - 0.2 * 6.0 / 10.0)).abs() < 1e-15,
        "{betas:?}"
    );
    assert!(
        betas.windows(2).all(|w| w[1] != w[0]),
        "β did not move every step: {betas:?}"
    );
    let state: serde_json::Value = serde_json::from_slice(
        &std::fs::read(a.join("checkpoints/step-00004/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_ne!(state["extra"]["kl_ctrl_value"].as_f64().unwrap(), betas[3]);
    // Two epochs of two mini-batches per step: four critic updates a step.
    assert_eq!(state["extra"]["critic_optimizer_steps"].as_u64(), Some(16));
    assert!(la.iter().all(|l| l["critic/vf_explained_var"].is_number()));
}
