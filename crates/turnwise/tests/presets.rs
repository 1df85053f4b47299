//! Every preset, with its own settings, on a tiny model and world from one shared warm start:
//! no metric is NaN and the metrics that show its mechanism show it at work.

use turnwise::config::{TrainConfig, presets};
use turnwise::trainer::Trainer;

mod common;
use common::tiny_overrides;

/// Room for whole turns: the tiny overrides' 12-token turns cut most boxed-format turns short,
/// so every outcome would be a format failure and no group would carry signal.
const ROOM: [&str; 2] = [
    "rollout.max_turn_tokens=48",
    "rollout.max_response_tokens=240",
];

/// One warm start per agent format, shared by every preset of that format (the quickstart's
/// arrangement: one warm start, every method trained from it), long enough that the tiny model
/// writes whole turns in the format and sometimes answers right, exported as a Hugging Face
/// folder. `preset` is the first preset of the format to ask for it (its task settings build
/// the demonstrations).
fn shared_warm_start(preset: &str) -> anyhow::Result<std::path::PathBuf> {
    use std::collections::BTreeMap;
    use std::sync::Mutex;
    static DIRS: Mutex<BTreeMap<String, tempfile::TempDir>> = Mutex::new(BTreeMap::new());
    let format = TrainConfig::resolve(Some(preset), None, &[])?.task.format;
    let key = format!("{format:?}");
    let mut dirs = DIRS.lock().unwrap();
    if let Some(d) = dirs.get(&key) {
        return Ok(d.path().to_path_buf());
    }
    let dir = tempfile::tempdir()?;
    let mut sets = tiny_overrides();
    sets.extend(ROOM.map(String::from));
    sets.extend(["sft.steps=300".to_string(), "sft.batch_size=8".to_string()]);
    // The warm start needs no judge (mt-ppo-judge would serve SmolLM2 for it).
    sets.push("judge.enabled=false".into());
    let cfg = TrainConfig::resolve(Some(preset), None, &sets)?;
    let mut t = Trainer::new(cfg)?;
    t.warm_start(&mut |_, loss, _| assert!(loss.is_finite()))?;
    t.export(dir.path())?;
    let path = dir.path().to_path_buf();
    dirs.insert(key, dir);
    Ok(path)
}

/// Metrics of `steps` RL steps of preset `name` with its own settings (tiny world and model,
/// the shared warm start of its agent format; tree presets keep their own group size), one map
/// per step. No metric may be NaN.
fn run_preset(
    name: &str,
    steps: usize,
) -> anyhow::Result<Vec<std::collections::BTreeMap<String, f64>>> {
    let mut sets = tiny_overrides();
    sets.extend(ROOM.map(String::from));
    if name == "mt-ppo-judge" {
        // SmolLM2 would judge in seconds per rollout: the tiny GGUF fixture stands in.
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../turnwise-model/src/checkpoint/fixtures/gguf/tiny-llama.gguf");
        sets.push(format!("judge.serve=\"{}\"", fixture.display()));
    }
    let shape = TrainConfig::resolve(Some(name), None, &[])?.rollout;
    if let Some(n) = shape.tree_leaves_per_prompt() {
        sets.push(format!("rollout.group_size={n}"));
    }
    sets.push(format!(
        "model.init_from=\"{}\"",
        shared_warm_start(name)?.display()
    ));
    sets.push("sft.steps=0".into());
    sets.push("rollout.prompts_per_step=3".into());
    sets.push("optim.lr=3e-3".into());
    let cfg = TrainConfig::resolve(Some(name), None, &sets)?;
    let mut t = Trainer::new(cfg)?;
    t.freeze_reference()?;
    let mut out = Vec::new();
    for _ in 0..steps {
        let o = t.rl_step()?;
        anyhow::ensure!(!o.episodes.is_empty(), "no episodes");
        for (k, v) in &o.metrics {
            anyhow::ensure!(!v.is_nan(), "{k} is NaN");
        }
        out.push(o.metrics);
    }
    Ok(out)
}

type Steps = [std::collections::BTreeMap<String, f64>];

/// `key` of step `m`, or an error naming the missing metric.
fn get(m: &std::collections::BTreeMap<String, f64>, key: &str) -> anyhow::Result<f64> {
    m.get(key)
        .copied()
        .ok_or_else(|| anyhow::anyhow!("metric {key} is missing"))
}

/// Some step satisfies `f` on `key`.
fn some(steps: &Steps, key: &str, f: impl Fn(f64) -> bool) -> anyhow::Result<()> {
    let v: Vec<f64> = steps
        .iter()
        .map(|m| get(m, key))
        .collect::<anyhow::Result<_>>()?;
    anyhow::ensure!(v.iter().any(|&x| f(x)), "no step shows it in {key}: {v:?}");
    Ok(())
}

/// Every step satisfies `f` on `key`.
fn every(steps: &Steps, key: &str, f: impl Fn(f64) -> bool) -> anyhow::Result<()> {
    let v: Vec<f64> = steps
        .iter()
        .map(|m| get(m, key))
        .collect::<anyhow::Result<_>>()?;
    anyhow::ensure!(v.iter().all(|&x| f(x)), "a step breaks it in {key}: {v:?}");
    Ok(())
}

/// The metrics that show each preset's defining mechanism at work on the tiny world, from the
/// warm start of its agent format, with whole turns: every preset gets groups that carry
/// signal, and every off-policy preset clips.
fn signature(name: &str, s: &Steps) -> anyhow::Result<()> {
    let pos = |x: f64| x > 0.0;
    // No preset but DAPO filters groups.
    if name != "dapo" {
        every(s, "batch/filtered_groups", |x| x == 0.0)?;
    }
    match name {
        "grpo" | "dr-grpo" | "rloo" | "gspo" | "s-grpo" => {
            // Outcome-only group advantages: some group carries signal, and its off-policy
            // mini-batches clip.
            some(s, "batch/informative_groups", pos)?;
            some(s, "actor/pg_clipfrac", pos)?;
            if name == "grpo" {
                every(s, "actor/kl_loss", |x| x >= 0.0)?;
            }
        }
        "dapo" => {
            // Dynamic sampling fills the batch with informative groups (the filter itself is
            // shown in tests/dapo.rs).
            every(s, "batch/informative_groups", |x| x == 3.0)?;
            some(s, "reward/overlong_penalty/mean", |x| x < 0.0)?;
            some(s, "actor/pg_clipfrac", pos)?;
        }
        "igpo" => {
            some(s, "info_gain/turn_0/mean", |x| x != 0.0)?;
            some(s, "actor/pg_clipfrac", pos)?;
        }
        "a2tgpo" => {
            some(s, "a2tgpo/clip_scale/max", |x| x > 1.0)?;
            some(s, "a2tgpo/clip_scale/min", |x| x < 1.0)?;
            some(s, "actor/pg_clipfrac_high", pos)?;
            some(s, "actor/pg_clipfrac_low", pos)?;
            every(s, "a2tgpo/turn_group/groups", pos)?;
        }
        "at2po" => {
            every(s, "tree/leaves", |x| x == 8.0)?;
            every(s, "tree/fork_entropy/mean", pos)?;
            some(s, "tree/node_value/abs_mean", pos)?;
            some(s, "actor/pg_clipfrac_low", pos)?;
        }
        "tree-grpo" => {
            every(s, "tree/leaves", |x| x == 6.0)?;
            every(s, "tree/labels_per_group", |x| x == 2.0)?;
            some(s, "actor/kl_loss", pos)?;
        }
        "ppo" | "turn-ppo" | "s-ppo" | "st-ppo" | "mt-ppo" => {
            every(s, "actor/reward_kl_penalty_coeff", |x| x == 0.001)?;
            some(s, "actor/reward_kl_penalty", pos)?;
            every(s, "critic/vf_explained_var", f64::is_finite)?;
            some(s, "actor/ppo_kl", |x| x != 0.0)?;
            some(s, "actor/pg_clipfrac", pos)?;
            if matches!(name, "s-ppo" | "st-ppo") {
                some(s, "actor/clip_bias_scale", |x| x != 1.0)?;
                some(s, "actor/clip_bias_num_clipped", pos)?;
            }
            if name == "mt-ppo" {
                some(s, "mt_ppo/turn_rewards_placed", pos)?;
            }
        }
        "mt-ppo-judge" => {
            // Judged by the tiny GGUF fixture (see run_preset): every rollout reaches the
            // served judge; the fixture's 256-token context cannot hold the rubric prompt, so
            // the rules score them (tests/judge_rewards.rs serves it with a longer context).
            every(s, "judge/episodes", pos)?;
            every(s, "critic/vf_explained_var", f64::is_finite)?;
        }
        "mt-grpo" => {
            every(s, "mt_grpo/turn_group/groups", pos)?;
            some(s, "actor/pg_clipfrac", pos)?;
        }
        "gigpo" | "t2po" => {
            every(s, "gigpo/anchor_group/groups", pos)?;
            some(s, "gigpo/anchor_group/singleton_share", |x| x < 1.0)?;
            some(s, "gigpo/penalised_steps", pos)?;
            if name == "t2po" {
                some(s, "rollout/tds_regenerations", pos)?;
            }
        }
        _ => {}
    }
    Ok(())
}

#[test]
fn every_preset_runs_with_its_own_settings() {
    let mut failures = Vec::new();
    for name in presets::names() {
        // The outcome-only group presets see tied outcomes in many steps of the tiny model:
        // they get more steps, so that some group carries signal on any machine's rounding.
        let steps = if matches!(name, "grpo" | "dr-grpo" | "rloo" | "gspo" | "s-grpo") {
            6
        } else {
            3
        };
        match run_preset(name, steps).and_then(|m| {
            if std::env::var_os("SIGNATURE_DUMP").is_some() {
                eprintln!("== {name}: {m:#?}");
            }
            signature(name, &m)
        }) {
            Ok(()) => {}
            Err(e) => failures.push(format!("{name}: {e:#}")),
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
