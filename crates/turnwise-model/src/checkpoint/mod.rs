//! Training checkpoints: weights (safetensors, Hugging Face names, with `config.json`),
//! optimizer moments (safetensors) and a JSON file with the step, schedule, RNG state and any
//! extra trainer metadata, so that a resumed run continues exactly.
//!
//! Layout of a checkpoint folder:
//! - `config.json`, `model.safetensors` — a Hugging Face model folder (see `weights::load_hf`);
//! - `optimizer.safetensors` — `{param}.exp_avg`, `{param}.exp_avg_sq`;
//! - `trainer_state.json` — [`TrainerState`];
//! - `adapter/` ([`ADAPTER_DIR`]), LoRA runs only — the adapters in PEFT's layout
//!   (`adapter_config.json`, `adapter_model.safetensors`; see [`crate::model::lora`]). The
//!   folder's `model.safetensors` then holds the frozen base weights, unmerged (so a resumed run
//!   continues on the exact same base), and the optimizer moments are the adapters'.
//!
//! [`hf`] completes a folder into what `transformers` loads (tokenizer and generation configs,
//! the source checkpoint's config fields); [`gguf`] loads llama.cpp GGUF files (weights,
//! tokenizer and chat template) as such a model.

pub mod gguf;
pub mod hf;

use std::path::Path;

use candle_core::{DType, Device};
use candle_nn::VarMap;
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};
use crate::model::ModelConfig;
use crate::model::lora::{
    LoraConfig, adapters_varmap, is_adapter_folder, load_peft_adapter, save_peft_adapter,
};
use crate::model::transformer::varmap_tensors;
use crate::model::weights::{
    export_hf, load_hf, load_safetensors, save_safetensors, sorted_vars, varmap_from_tensors,
};
use crate::optim::{AdamW, AdamWConfig, LrSchedule};

pub use gguf::{GgufCheckpoint, GgufError, load_gguf};
pub use hf::{HfMetadata, export_hf_folder, export_hf_folder_tensors, write_hf_metadata};

/// Version of the checkpoint layout written by this crate.
pub const CHECKPOINT_FORMAT_VERSION: u32 = 1;

/// Everything besides tensors needed to resume a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Layout version ([`CHECKPOINT_FORMAT_VERSION`]).
    pub format_version: u32,
    /// Optimizer updates made so far (also the schedule position).
    pub step: u64,
    /// Optimizer hyper-parameters.
    pub optimizer: AdamWConfig,
    /// Learning-rate schedule, if one drives the run.
    pub schedule: Option<LrSchedule>,
    /// Named RNG states (e.g. `"sampling"`, `"data"`) as `TurnRng::state()` words.
    pub rng_states: std::collections::BTreeMap<String, [u64; 4]>,
    /// Free-form trainer metadata (epoch, data cursor, metrics ...).
    pub extra: serde_json::Value,
}

impl TrainerState {
    /// A state for `optimizer` with no schedule, RNGs or extra data.
    pub fn for_optimizer(optimizer: &AdamW) -> Self {
        Self {
            format_version: CHECKPOINT_FORMAT_VERSION,
            step: optimizer.step_count(),
            optimizer: optimizer.config().clone(),
            schedule: None,
            rng_states: Default::default(),
            extra: serde_json::Value::Null,
        }
    }
}

/// The subfolder of a LoRA run's checkpoint (and export) that holds the adapters in PEFT's
/// layout.
pub const ADAPTER_DIR: &str = "adapter";

/// A checkpoint loaded into fresh training objects.
pub struct Checkpoint {
    /// The model configuration.
    pub config: ModelConfig,
    /// The model's weights: all trainable, or the frozen base of a LoRA run.
    pub varmap: VarMap,
    /// The optimizer over the trainable variables (`varmap`'s, or the LoRA adapters') with its
    /// moments and step restored.
    pub optimizer: AdamW,
    /// Step, schedule, RNG states and extra metadata.
    pub state: TrainerState,
    /// The LoRA adapters, for a checkpoint of a LoRA run (one with an [`ADAPTER_DIR`]).
    pub lora: Option<LoraAdapters>,
}

/// LoRA adapters with their configuration.
pub struct LoraAdapters {
    /// Rank, alpha, dropout and target modules.
    pub config: LoraConfig,
    /// The adapters' `Var`s, named as in [`LoraConfig::adapter_shapes`].
    pub adapters: VarMap,
}

impl std::fmt::Debug for LoraAdapters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoraAdapters")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// What a LoRA run's checkpoint holds besides the frozen base weights.
#[derive(Debug, Clone, Copy)]
pub struct LoraParts<'a> {
    /// The adapters and their configuration.
    pub lora: &'a LoraAdapters,
    /// `base_model_name_or_path` of `adapter_config.json`.
    pub base_model_name_or_path: Option<&'a str>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("config", &self.config)
            .field("optimizer", &self.optimizer)
            .field("state", &self.state)
            .field("lora", &self.lora)
            .finish_non_exhaustive()
    }
}

/// Writes a checkpoint folder (created if needed). `state.step` must equal the optimizer's
/// step count.
pub fn save_checkpoint(
    dir: impl AsRef<Path>,
    config: &ModelConfig,
    varmap: &VarMap,
    optimizer: &AdamW,
    state: &TrainerState,
) -> Result<()> {
    save_checkpoint_with_lora(dir, config, varmap, None, optimizer, state)
}

/// [`save_checkpoint`] of a LoRA run when `lora` is given: `varmap` holds the frozen base
/// weights (written as the folder's `model.safetensors`), the adapters go to [`ADAPTER_DIR`] in
/// PEFT's layout, and `optimizer` is the adapters' optimizer.
pub fn save_checkpoint_with_lora(
    dir: impl AsRef<Path>,
    config: &ModelConfig,
    varmap: &VarMap,
    lora: Option<LoraParts<'_>>,
    optimizer: &AdamW,
    state: &TrainerState,
) -> Result<()> {
    let dir = dir.as_ref();
    if state.step != optimizer.step_count() {
        return Err(ModelError::Checkpoint {
            path: dir.to_path_buf(),
            reason: format!(
                "trainer state step {} differs from the optimizer's {}",
                state.step,
                optimizer.step_count()
            ),
        });
    }
    export_hf(dir, config, varmap)?;
    if let Some(l) = lora {
        save_peft_adapter(
            dir.join(ADAPTER_DIR),
            &l.lora.config,
            &varmap_tensors(&l.lora.adapters, true),
            l.base_model_name_or_path,
        )?;
    }
    save_safetensors(
        &optimizer.state_tensors(),
        dir.join("optimizer.safetensors"),
    )?;
    let path = dir.join("trainer_state.json");
    let text = serde_json::to_string_pretty(state).map_err(|cause| ModelError::Json {
        what: path.display().to_string(),
        cause,
    })?;
    std::fs::write(&path, text).map_err(|e| ModelError::io(&path, e))
}

/// Loads a checkpoint folder written by [`save_checkpoint`] into fresh objects.
pub fn load_checkpoint(dir: impl AsRef<Path>, dtype: DType, device: &Device) -> Result<Checkpoint> {
    let dir = dir.as_ref();
    let (config, weights) = load_hf(dir, dtype, device)?;
    let varmap = varmap_from_tensors(
        &config,
        &weights,
        &dir.join("model.safetensors").display().to_string(),
    )?;
    let path = dir.join("trainer_state.json");
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
    let state: TrainerState = serde_json::from_str(&text).map_err(|cause| ModelError::Json {
        what: path.display().to_string(),
        cause,
    })?;
    if state.format_version != CHECKPOINT_FORMAT_VERSION {
        return Err(ModelError::Checkpoint {
            path,
            reason: format!(
                "format version {} is not {CHECKPOINT_FORMAT_VERSION}",
                state.format_version
            ),
        });
    }
    let adapter_dir = dir.join(ADAPTER_DIR);
    let lora = if is_adapter_folder(&adapter_dir) {
        let (lc, tensors) = load_peft_adapter(&adapter_dir, dtype, device)?;
        let adapters = adapters_varmap(&config, &lc, &tensors, &adapter_dir.display().to_string())?;
        Some(LoraAdapters {
            config: lc,
            adapters,
        })
    } else {
        None
    };
    let trainable = match &lora {
        Some(l) => sorted_vars(&l.adapters),
        None => sorted_vars(&varmap),
    };
    // Moments and master copies in the optimizer's state dtype (f32 for a bf16 model): read
    // in the weights' dtype they would lose what the master copies keep.
    let moments = load_safetensors(
        dir.join("optimizer.safetensors"),
        crate::optim::adamw::state_dtype(dtype),
        device,
    )?;
    let mut optimizer = AdamW::new(trainable, state.optimizer.clone())?;
    optimizer.load_state(&moments, state.step)?;
    Ok(Checkpoint {
        config,
        varmap,
        optimizer,
        state,
        lora,
    })
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::*;
    use crate::model::Transformer;
    use crate::model::transformer::varmap_tensors;
    use crate::model::weights::{init_varmap, load_hf};
    use crate::optim::tests::{SEQ, nll};
    use crate::optim::{DecayShape, Gradients};
    use crate::rng::TurnRng;

    fn schedule() -> LrSchedule {
        LrSchedule {
            peak_lr: 5e-3,
            warmup_steps: 3,
            total_steps: 8,
            min_lr_ratio: 0.1,
            decay: DecayShape::Cosine,
        }
    }

    /// Trains `n` steps; each step uses a random window of SEQ drawn from `rng`, so the RNG state
    /// matters for exact resumption.
    fn train(cfg: &ModelConfig, vm: &VarMap, opt: &mut AdamW, rng: &mut TurnRng, n: usize) {
        let model = Transformer::from_varmap(cfg, vm).unwrap();
        for _ in 0..n {
            let start = (rng.next_u64() % 4) as usize;
            let loss = nll(&model, &SEQ[start..start + 12]);
            let mut g = Gradients::from_grad_store(&loss.backward().unwrap(), opt.vars());
            g.clip_global_norm(1.0).unwrap();
            let lr = schedule().lr_at(opt.step_count());
            opt.step(&g, lr).unwrap();
        }
    }

    #[test]
    fn resume_is_bit_identical() {
        let cfg = ModelConfig::tiny_qwen2(96);
        let dev = Device::Cpu;
        // Uninterrupted: 8 steps.
        let vm_a = init_varmap(&cfg, DType::F32, &dev, 9).unwrap();
        let mut opt_a = AdamW::new(sorted_vars(&vm_a), AdamWConfig::default()).unwrap();
        let mut rng_a = TurnRng::seed_from_u64(3);
        train(&cfg, &vm_a, &mut opt_a, &mut rng_a, 8);

        // Interrupted: 4 steps, save, load into fresh objects, 4 more.
        let vm_b = init_varmap(&cfg, DType::F32, &dev, 9).unwrap();
        let mut opt_b = AdamW::new(sorted_vars(&vm_b), AdamWConfig::default()).unwrap();
        let mut rng_b = TurnRng::seed_from_u64(3);
        train(&cfg, &vm_b, &mut opt_b, &mut rng_b, 4);
        let dir = tempfile::tempdir().unwrap();
        let mut state = TrainerState::for_optimizer(&opt_b);
        state.schedule = Some(schedule());
        state.rng_states.insert("data".into(), rng_b.state());
        state.extra = serde_json::json!({"epoch": 0});
        save_checkpoint(dir.path(), &cfg, &vm_b, &opt_b, &state).unwrap();
        drop((vm_b, opt_b, rng_b));

        let ck = load_checkpoint(dir.path(), DType::F32, &dev).unwrap();
        assert_eq!(ck.state, state);
        assert_eq!(ck.config, cfg);
        let Checkpoint {
            varmap: vm_c,
            optimizer: mut opt_c,
            ..
        } = ck;
        let mut rng_c = TurnRng::from_state(state.rng_states["data"]);
        train(&cfg, &vm_c, &mut opt_c, &mut rng_c, 4);
        assert_eq!(opt_c.step_count(), 8);

        let a = varmap_tensors(&vm_a, true);
        let c = varmap_tensors(&vm_c, true);
        assert_eq!(a.len(), c.len());
        for (name, ta) in &a {
            let va = ta.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let vc = c[name].flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(
                va.iter().zip(&vc).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{name} differs after resume"
            );
        }
        let ma = opt_a.state_tensors();
        let mc = opt_c.state_tensors();
        for (name, t) in &ma {
            let d = (t - &mc[name])
                .unwrap()
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap();
            assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0, "{name}");
        }
    }

    #[test]
    fn exported_folder_loads_back_and_errors_are_clear() {
        let cfg = ModelConfig::tiny_qwen2(96);
        let dev = Device::Cpu;
        let vm = init_varmap(&cfg, DType::F32, &dev, 4).unwrap();
        let dir = tempfile::tempdir().unwrap();
        export_hf(dir.path(), &cfg, &vm).unwrap();
        let (cfg2, w) = load_hf(dir.path(), DType::F32, &dev).unwrap();
        assert_eq!(cfg2, cfg);
        let m1 = Transformer::detached_from_varmap(&cfg, &vm).unwrap();
        let m2 = Transformer::from_tensors(&cfg2, &w, "export").unwrap();
        let ids = Tensor::new(&[[1u32, 2, 3]], &dev).unwrap();
        let pos = Tensor::new(&[[0u32, 1, 2]], &dev).unwrap();
        let mask = Tensor::new(&[[1u32, 1, 1]], &dev).unwrap();
        let a = m1
            .forward(&ids, &pos, &mask, None)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let b = m2
            .forward(&ids, &pos, &mask, None)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(a, b);
        let text = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
        assert!(text.contains("Qwen2ForCausalLM"));

        // An export has no optimizer state: loading it as a checkpoint names the missing file.
        let err = load_checkpoint(dir.path(), DType::F32, &dev).unwrap_err();
        assert!(err.to_string().contains("trainer_state.json"), "{err}");

        // A mismatched step is refused.
        let opt = AdamW::new(sorted_vars(&vm), AdamWConfig::default()).unwrap();
        let mut st = TrainerState::for_optimizer(&opt);
        st.step = 3;
        let err = save_checkpoint(dir.path(), &cfg, &vm, &opt, &st).unwrap_err();
        assert!(err.to_string().contains("step"), "{err}");
    }
}
