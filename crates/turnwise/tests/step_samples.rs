//! verl-agent's step samples (`optim.samples = "step"`, the gigpo and t2po presets): every
//! environment step is its own training row, the context its turn was sampled from (memory window
//! included) plus the turn. On Sokoban with 20 turns and the gigpo preset's window of 4, the
//! trainer's recomputed log-probs of the step rows equal the sampler's (the rows are what was
//! sampled), while whole-trajectory rows condition the late turns on history the sampler never
//! saw; a gigpo step trains on the step rows in mini-batches of step samples, several optimizer
//! steps a batch; and a window that truncates trajectory rows is refused by name.

mod common;

use turnwise::config::TrainConfig;
use turnwise::trainer::Trainer;
use turnwise::update::{Row, logprobs_no_grad};

/// Sokoban with 20 turns (the window of 4 drops turns from the 6th on), tiny model and batch.
fn sokoban(extra: &[&str]) -> Vec<String> {
    let mut sets: Vec<String> = [
        "task.env=\"sokoban\"",
        "task.max_turns=20",
        "task.game.train=12",
        "task.game.validation=3",
        "task.game.test=3",
        "model.hidden_size=32",
        "model.num_layers=2",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.intermediate_size=64",
        "sft.steps=20",
        "sft.batch_size=4",
        "rollout.prompts_per_step=2",
        "rollout.group_size=4",
        "rollout.max_turn_tokens=16",
        "rollout.max_response_tokens=400",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    sets.extend(extra.iter().map(|s| s.to_string()));
    sets
}

/// The largest |recomputed − sampled| log-prob over the loss tokens of `rows` (each row's
/// sampled log-probs in `sampled`, aligned with its response), and how many tokens it covered.
fn max_logprob_gap(t: &Trainer, rows: &[Row], sampled: &[Vec<f32>]) -> (f32, usize) {
    let recomputed = logprobs_no_grad(&t.sampler, rows, t.config.rollout.temperature, 16).unwrap();
    let mut gap = 0f32;
    let mut n = 0;
    for ((row, s), r) in rows.iter().zip(sampled).zip(&recomputed) {
        for ((&m, &s), &r) in row.loss_mask.iter().zip(s).zip(r) {
            if m == 1 {
                gap = gap.max((s - r).abs());
                n += 1;
            }
        }
    }
    (gap, n)
}

#[test]
fn step_rows_are_what_the_memory_window_sampled() {
    let cfg = TrainConfig::resolve(Some("gigpo"), None, &sokoban(&[])).unwrap();
    assert_eq!(cfg.rollout.memory_window, Some(4));
    let mut t = Trainer::new(cfg).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    let (all, _, metrics) = t.sample_batch().unwrap();
    let truncated = all
        .stats
        .metrics(
            &turnwise::rollout::RolloutControl::from_config(
                &t.config.rollout,
                t.config.task.format,
                &t.tokenizer,
            )
            .unwrap(),
        )
        .get("rollout/memory_truncated_turns")
        .copied()
        .unwrap_or(0.0);
    assert!(
        truncated > 0.0,
        "no turn had more than 4 turns before it (metrics {metrics:?})"
    );
    let mut step_rows = Vec::new();
    let mut step_sampled = Vec::new();
    let mut traj_rows = Vec::new();
    let mut traj_sampled = Vec::new();
    for e in &all.episodes {
        let flat = e.episode.trajectory.flatten(false);
        let row = Row::from_trajectory(&e.episode.trajectory, false);
        for (k, step) in row.step_samples(Some(4)).into_iter().enumerate() {
            // The step's tokens are the k-th turn's span of the flat response.
            let (start, end) = e.episode.trajectory.turn_spans()[k];
            assert_eq!(step.response, flat.ids[start..end]);
            step_sampled.push(flat.logprobs[start..end].to_vec());
            step_rows.push(step);
        }
        traj_sampled.push(flat.logprobs.clone());
        traj_rows.push(row);
    }
    assert!(step_rows.len() > traj_rows.len());
    let (gap, n) = max_logprob_gap(&t, &step_rows, &step_sampled);
    assert!(n > 50, "only {n} sampled tokens");
    assert!(
        gap < 1e-3,
        "step rows: recomputed log-probs differ from the sampled ones by {gap}"
    );
    // Whole-trajectory rows put the dropped turns back into the late turns' context.
    let (traj_gap, _) = max_logprob_gap(&t, &traj_rows, &traj_sampled);
    assert!(
        traj_gap > 5e-3 && traj_gap > 20.0 * gap,
        "trajectory rows matched the windowed sampling ({traj_gap}, step rows {gap}): the test \
         cannot tell"
    );
}

#[test]
fn a_gigpo_step_trains_on_step_samples_in_several_optimizer_steps() {
    // The preset's own mini-batch of 51 step samples, scaled with the batch: 8 rollouts of
    // 128 → 51·8/128 ≈ 3 step samples.
    let sets = sokoban(&["optim.mini_batch_size=3", "task.max_turns=6"]);
    let mut t = Trainer::new(TrainConfig::resolve(Some("gigpo"), None, &sets).unwrap()).unwrap();
    assert_eq!(t.config.optim.samples, turnwise::config::TrainSamples::Step);
    t.warm_start(&mut |_, _, _| {}).unwrap();
    t.freeze_reference().unwrap();
    let m = t.rl_step().unwrap().metrics;
    let (traj, rows) = (m["batch/trajectory_rows"], m["batch/train_rows"]);
    assert_eq!(traj, 8.0);
    assert!(rows > traj, "{rows} step rows from {traj} rollouts");
    assert_eq!(m["actor/optimizer_steps"], (rows / 3.0).ceil());
    // Behaviour log-probs from before the first optimizer step: the later mini-batches are
    // off-policy, so the mean KL between the behaviour and current policy is not zero.
    assert!(m["actor/ppo_kl"] != 0.0, "{m:?}");
    // verl-agent's search script's KL loss is off on games (preset for_env), on by default.
    assert!(!t.config.actor.use_kl_loss);
    let search = TrainConfig::resolve(Some("gigpo"), None, &common::tiny_overrides()).unwrap();
    assert!(search.actor.use_kl_loss && search.actor.kl_loss_coef == 0.001);
}

#[test]
fn trajectory_rows_under_a_truncating_window_are_refused() {
    let err = TrainConfig::resolve(
        Some("gigpo"),
        None,
        &sokoban(&["optim.samples=\"trajectory\""]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("rollout.memory_window") && err.contains("optim.samples"),
        "{err}"
    );
    // A window that never drops a turn is fine with trajectory rows.
    TrainConfig::resolve(
        Some("gigpo"),
        None,
        &sokoban(&["optim.samples=\"trajectory\"", "task.max_turns=5"]),
    )
    .unwrap();
}
