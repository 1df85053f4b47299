//! Every preset runs two RL steps on a tiny model and world.

use turnwise::config::{TrainConfig, presets};
use turnwise::trainer::Trainer;

/// Overrides that shrink any preset to seconds.
pub fn tiny_overrides() -> Vec<String> {
    [
        "task.world.countries=4",
        "task.world.cities=8",
        "task.world.companies=6",
        "task.world.persons=16",
        "task.world.questions.train=40",
        "task.world.questions.validation=8",
        "task.world.questions.test=8",
        "model.hidden_size=32",
        "model.num_layers=2",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.intermediate_size=64",
        "sft.steps=3",
        "sft.batch_size=4",
        "rollout.prompts_per_step=2",
        "rollout.group_size=3",
        "rollout.max_turn_tokens=12",
        "rollout.max_response_tokens=120",
        "rollout.filter_zero_variance_groups=false",
        "run.steps=2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

#[test]
fn every_preset_runs_two_steps() {
    let mut failures = Vec::new();
    for name in presets::names() {
        let result = (|| -> anyhow::Result<()> {
            let cfg = TrainConfig::resolve(Some(name), None, &tiny_overrides())?;
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
