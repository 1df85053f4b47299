//! The PPO critic follows `optim.ppo_epochs` and `optim.mini_batch_size`, its configured weight
//! decay, and logs `critic/vf_explained_var`.

mod common;

use turnwise::config::TrainConfig;
use turnwise::trainer::Trainer;
use turnwise_model::model::transformer::varmap_tensors;

fn trainer(extra: &[&str]) -> Trainer {
    let mut sets = common::tiny_overrides();
    sets.extend(extra.iter().map(|s| s.to_string()));
    let cfg = TrainConfig::resolve(Some("ppo"), None, &sets).unwrap();
    let mut t = Trainer::new(cfg).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    t.freeze_reference().unwrap();
    t
}

fn critic_weights(t: &Trainer) -> Vec<f32> {
    let mut named: Vec<_> = varmap_tensors(t.critic.as_ref().unwrap().varmap(), true)
        .into_iter()
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
        .into_iter()
        .flat_map(|(_, v)| v.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect()
}

#[test]
fn critic_runs_epochs_of_minibatches_and_logs_explained_variance() {
    // 6 rows, mini-batches of 4 → 2 per epoch; 3 epochs → 6 critic updates per step.
    let mut t = trainer(&["optim.ppo_epochs=3", "optim.mini_batch_size=4"]);
    let m = t.rl_step().unwrap().metrics;
    assert_eq!(m["batch/kept_rollouts"], 6.0);
    assert_eq!(t.critic.as_ref().unwrap().optimizer_steps(), 6);
    let ev = m["critic/vf_explained_var"];
    assert!(ev.is_finite() && ev <= 1.0, "{ev}");
    assert!(m["critic/vf_loss"].is_finite());
    // The tiny settings' mini-batches of 3 (the preset's 2 optimizer steps per batch).
    let mut t = trainer(&[]);
    t.rl_step().unwrap();
    assert_eq!(t.critic.as_ref().unwrap().optimizer_steps(), 2);
}

#[test]
fn critic_weight_decay_is_the_configured_one() {
    let mut plain = trainer(&[]);
    let mut decayed = trainer(&["critic.weight_decay=0.5"]);
    assert_eq!(critic_weights(&plain), critic_weights(&decayed));
    plain.rl_step().unwrap();
    decayed.rl_step().unwrap();
    let (a, b) = (critic_weights(&plain), critic_weights(&decayed));
    let diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(diff > 0.0, "critic.weight_decay changed nothing");
}
