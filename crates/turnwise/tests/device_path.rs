//! The device-agnostic path, on the CPU: what a GPU run executes. The fused CPU kernels are
//! turned off for this whole test binary (`TURNWISE_COMPOSED_OPS=1`, set before any model op),
//! so every op is the composition of candle ops that runs on CUDA, and the models are placed in
//! `bf16` (`model.dtype = "bf16"`, CUDA's default) with `f32` AdamW state. A whole run (warm
//! start, RL steps with rollouts, rewards, advantages, the loss and the update, checkpoints,
//! evaluation) goes through it, the PPO family's critic included, and a killed-and-resumed run
//! matches the uninterrupted one bit for bit: checkpoints hold `f32` weights and the optimizer's
//! `f32` master copies, so nothing is lost to the `bf16` rounding.

mod common;

use std::path::Path;

use turnwise::config::TrainConfig;

/// The dtype of every tensor of a safetensors file, by name.
fn dtypes(path: &Path) -> Vec<(String, String)> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| (k.clone(), v["dtype"].as_str().unwrap().to_string()))
        .collect()
}

/// The checks both presets share: f32 weights and master copies on disk, finite metrics, the
/// states in `moved` changed by RL steps 3 and 4, and the resumed run equal to the uninterrupted
/// one in `files` and its metrics.
fn assert_bf16_run(a: &Path, b: &Path, files: &[&str], moved: &[&str]) {
    let step2 = a.join("checkpoints/step-00002");
    let step4 = a.join("checkpoints/step-00004");
    // Weights are written in f32 whatever the device and dtype; the optimizer holds the f32
    // master copy of every bf16 weight besides its moments.
    for (name, dtype) in dtypes(&step4.join("model.safetensors")) {
        assert_eq!(dtype, "F32", "{name} is saved as {dtype}");
    }
    let opt = dtypes(&step4.join("optimizer.safetensors"));
    let masters = opt.iter().filter(|(k, _)| k.ends_with(".master")).count();
    let weights = dtypes(&step4.join("model.safetensors")).len();
    assert_eq!(masters, weights, "one f32 master copy per bf16 weight");
    assert!(opt.iter().all(|(_, d)| d == "F32"));
    let lines = common::phase_lines(&a.join("metrics.jsonl"), "train");
    assert_eq!(lines.len(), 4);
    // (A PPO critic's warm-up step makes no actor update: nothing to check there.)
    let updates = lines
        .iter()
        .filter(|l| l["actor/optimizer_steps"].as_f64() != Some(0.0));
    for l in updates {
        for key in ["actor/pg_loss", "actor/grad_norm"] {
            let v = l[key].as_f64().unwrap_or(f64::NAN);
            assert!(v.is_finite(), "{key} = {v} in {l}");
        }
    }
    // RL steps 3 and 4 changed these states (their f32 master weights and moments: two steps
    // at the presets' lr can move a tiny model's bf16 weights by less than their resolution).
    for f in moved {
        let s2 = std::fs::read(step2.join(f)).unwrap();
        let s4 = std::fs::read(step4.join(f)).unwrap();
        assert!(s2 != s4, "{f}: two bf16 RL steps left it unchanged");
    }
    if moved.contains(&"optimizer.safetensors") {
        let grad = |l: &serde_json::Value| l["actor/grad_norm"].as_f64().unwrap_or(0.0);
        assert!(
            lines.iter().any(|l| grad(l) > 0.0),
            "no bf16 actor gradient"
        );
    }
    // Killed after step 2 and resumed: bit for bit the uninterrupted run.
    for f in files {
        let fa = std::fs::read(step4.join(f)).unwrap();
        let fb = std::fs::read(b.join("checkpoints/step-00004").join(f)).unwrap();
        assert!(fa == fb, "{f} of the resumed bf16 run differs");
    }
    assert_eq!(
        lines,
        common::phase_lines(&b.join("metrics.jsonl"), "train"),
        "metrics of the resumed bf16 run differ"
    );
}

#[test]
fn bf16_runs_on_the_composed_path_train_save_and_resume_exactly() {
    // SAFETY: set before this binary's only test touches a model or starts a thread that reads
    // the environment; the kernels read the variable once.
    unsafe { std::env::set_var("TURNWISE_COMPOSED_OPS", "1") };
    let tmp = tempfile::tempdir().unwrap();

    // GRPO: rollouts, rewards, group advantages, the clipped loss, AdamW with f32 masters.
    let (a, b) =
        common::run_and_resume("grpo", &["model.dtype=\"bf16\""], &tmp.path().join("grpo"));
    // (The tiny warm start answers nothing right: GRPO's group advantages are 0 and nothing
    // moves, so only the path and the resume are checked; PPO's critic gives its actor a
    // signal below.)
    assert_bf16_run(&a, &b, &["model.safetensors", "optimizer.safetensors"], &[]);

    // PPO: the critic (its own bf16 trunk and head, f32 optimizer state) trains and resumes.
    let (a, b) = common::run_and_resume(
        "ppo",
        &["model.dtype=\"bf16\"", "critic.warmup_updates=1"],
        &tmp.path().join("ppo"),
    );
    assert_bf16_run(
        &a,
        &b,
        &[
            "model.safetensors",
            "optimizer.safetensors",
            "critic.safetensors",
            "critic_optimizer.safetensors",
        ],
        &["optimizer.safetensors", "critic_optimizer.safetensors"],
    );
    for (name, dtype) in dtypes(&a.join("checkpoints/step-00004/critic.safetensors")) {
        assert_eq!(dtype, "F32", "critic {name} is saved as {dtype}");
    }
}

#[test]
fn a_cuda_device_without_the_cuda_build_is_refused_by_name() {
    if turnwise_model::device::cuda_compiled() {
        return;
    }
    let mut sets = common::tiny_overrides();
    sets.push("model.device=\"cuda\"".into());
    let err = TrainConfig::resolve(Some("grpo"), None, &sets).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("model.device") && msg.contains("`cuda` feature"),
        "{msg}"
    );
    sets.pop();
    sets.push("model.device=\"tpu\"".into());
    let msg = TrainConfig::resolve(Some("grpo"), None, &sets)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("model.device") && msg.contains("tpu"), "{msg}");
}

#[test]
fn the_rl_optimizer_starts_from_the_warm_started_bf16_weights() {
    // The RL optimizer is built with the model, before the warm start trains the weights with
    // its own optimizer: its f32 master copies must follow, or its first step writes the
    // pre-warm-start weights back (a bf16 quickstart on a GPU reverted to its initialisation:
    // entropy near ln |V| from the first RL step on).
    let mut sets = common::tiny_overrides();
    sets.extend(["model.dtype=\"bf16\"", "sft.steps=20"].map(String::from));
    let cfg = TrainConfig::resolve(Some("grpo"), None, &sets).unwrap();
    let mut t = turnwise::trainer::Trainer::new(cfg).unwrap();
    let before: Vec<Vec<f32>> = t
        .trainable_vars()
        .iter()
        .map(|(_, v)| flat(v.as_tensor()))
        .collect();
    t.warm_start(&mut |_, _, _| {}).unwrap();
    let mut moved = 0;
    for ((name, var), b) in t.trainable_vars().iter().zip(&before) {
        assert_eq!(var.dtype(), candle_core::DType::BF16, "{name}");
        let master = t
            .optimizer
            .master(name)
            .unwrap_or_else(|| panic!("{name} has no master"));
        let rounded = flat(&master.to_dtype(candle_core::DType::BF16).unwrap());
        let weight = flat(var.as_tensor());
        let differ = rounded.iter().zip(&weight).filter(|(a, b)| a != b).count();
        assert_eq!(
            differ, 0,
            "{name}: {differ} master values are not the weight"
        );
        moved += usize::from(&flat(var.as_tensor()) != b);
    }
    assert!(moved > 0, "the warm start moved no weight");
}

/// A tensor's values as f32.
fn flat(t: &candle_core::Tensor) -> Vec<f32> {
    t.to_dtype(candle_core::DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}
