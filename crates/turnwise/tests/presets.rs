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
