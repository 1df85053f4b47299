//! Every preset runs two RL steps on a tiny model and world.

use turnwise::config::{TrainConfig, presets};
use turnwise::trainer::Trainer;

mod common;
use common::tiny_overrides;

#[test]
fn every_preset_runs_two_steps() {
    let mut failures = Vec::new();
    for name in presets::names() {
        let result = (|| -> anyhow::Result<()> {
            // Tree presets fix their episodes per prompt by the tree shape (validated against
            // rollout.group_size), so the tiny group size gives way to it.
            let mut sets = tiny_overrides();
            let shape = TrainConfig::resolve(Some(name), None, &[])?.rollout;
            if let Some(n) = shape.tree_leaves_per_prompt() {
                sets.push(format!("rollout.group_size={n}"));
            }
            let cfg = TrainConfig::resolve(Some(name), None, &sets)?;
            let mut t = Trainer::new(cfg)?;
            t.warm_start(&mut |_, loss, _| assert!(loss.is_finite()))?;
            t.freeze_reference()?;
            for _ in 0..2 {
                let out = t.rl_step()?;
                for (k, v) in &out.metrics {
                    anyhow::ensure!(!v.is_nan() || k.starts_with("actor/"), "{k} is NaN");
                }
                anyhow::ensure!(!out.episodes.is_empty(), "no episodes");
            }
            anyhow::ensure!(t.step == 2);
            Ok(())
        })();
        if let Err(e) = result {
            failures.push(format!("{name}: {e:#}"));
        }
    }
    assert!(
        failures.is_empty(),
        "presets failed:\n{}",
        failures.join("\n")
    );
}

/// The trainer's recomputed log-probs of the sampled tokens equal the sampler's (the response
/// columns of the packed batch line up with the tokens), so PPO ratios start at exactly 1.
#[test]
fn recomputed_logprobs_match_the_sampled_ones() {
    use turnwise::rollout::{EpisodeSpec, run_chains};
    use turnwise::task::{WorldTask, prompt_text};
    use turnwise::update::{Row, logprobs_no_grad};

    let cfg = TrainConfig::resolve(Some("grpo"), None, &tiny_overrides()).unwrap();
    let mut t = Trainer::new(cfg).unwrap();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    let qs = t.task.questions(turnwise_env::world::Split::Train);
    let specs: Vec<EpisodeSpec> = qs
        .iter()
        .take(6)
        .enumerate()
        .map(|(i, q)| EpisodeSpec {
            id: format!("e{i}"),
            prompt_uid: q.id.clone(),
            prompt_ids: t.tokenizer.encode(&prompt_text(&q.text)).unwrap(),
            task: WorldTask::env_task(q),
            seed: i as u64,
        })
        .collect();
    let policy = t.rollout_policy();
    let env = || Ok(Box::new(t.task.env()?) as Box<dyn turnwise_env::env::Environment>);
    let decoding = turnwise::rollout::Decoding {
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        max_turn_tokens: 12,
        max_response_tokens: 120,
    };
    let eps = run_chains(&policy, specs, &env, &decoding).unwrap();
    let rows: Vec<Row> = eps
        .iter()
        .map(|e| {
            let f = e.trajectory.flatten(true);
            Row::new(
                e.trajectory.prompt_ids.clone(),
                f.ids,
                f.loss_mask,
                f.turn_id,
            )
        })
        .collect();
    let lp = logprobs_no_grad(&t.sampler, &rows, 1.0, 4).unwrap();
    let mut checked = 0;
    for (e, l) in eps.iter().zip(&lp) {
        let f = e.trajectory.flatten(true);
        for (k, (&m, &recomputed)) in f.loss_mask.iter().zip(l.iter()).enumerate() {
            if m == 1 {
                assert!(
                    (f.logprobs[k] - recomputed).abs() < 1e-3,
                    "token {k} of {}: sampled {} vs recomputed {}",
                    e.trajectory.id,
                    f.logprobs[k],
                    recomputed
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 20);
}
