//! LoRA adapters (Hu et al. 2021) on the linear layers of a [`crate::Transformer`], in PEFT's
//! conventions.
//!
//! An adapted layer computes `W x + s · B (A (dropout(x)))` with `s = alpha / rank`,
//! `A: [rank, in]` drawn as PEFT draws it (Kaiming-uniform with `a = √5`, i.e.
//! `U(−1/√in, 1/√in)`) and `B: [out, rank]` zero, so an untrained adapter leaves the model
//! exactly as it was. The base weights `W` are frozen: the trainer keeps them out of the
//! optimizer and builds the model from detached views of them, so the trained policy, the
//! sampler and the reference policy all share one copy.
//!
//! Adapter tensors are named after the layer they adapt, without PEFT's prefix:
//! `model.layers.{i}.self_attn.q_proj.lora_A.weight` (`[rank, in]`) and `….lora_B.weight`
//! (`[out, rank]`). [`save_peft_adapter`] writes them as PEFT does
//! (`adapter_model.safetensors` with the `base_model.model.` prefix, and `adapter_config.json`),
//! so `peft.PeftModel.from_pretrained(base, dir)` loads them; [`merge_adapters`] folds them into
//! the base weights (`W + s · B A`) for a plain Hugging Face export.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::error::{ModelError, Result};
use crate::model::config::ModelConfig;
use crate::model::weights::{load_safetensors, save_safetensors, set_mode_644};
use crate::rng::TurnRng;

/// The layers LoRA can adapt, by their Hugging Face module names.
pub const LORA_TARGETS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// PEFT's default targets for Llama and Qwen2 models (`q_proj` and `v_proj`).
pub const DEFAULT_TARGET_MODULES: [&str; 2] = ["q_proj", "v_proj"];

/// PEFT's default `lora_alpha`.
pub const DEFAULT_ALPHA: f64 = 8.0;

/// The adapter's configuration file in a PEFT adapter folder.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";

/// The adapter's weights file in a PEFT adapter folder.
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";

/// The prefix PEFT puts before the base model's parameter names (`PeftModel.base_model` is the
/// `LoraModel`, whose `.model` is the causal LM).
pub const PEFT_PREFIX: &str = "base_model.model.";

/// The hyper-parameters of LoRA adapters (PEFT's `LoraConfig` fields of the same meaning).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    /// Rank `r` of every adapter (at least 1).
    pub rank: usize,
    /// `lora_alpha`: the update is scaled by `alpha / rank`.
    pub alpha: f64,
    /// `lora_dropout`: dropout probability on the adapter's input, in training forwards only.
    pub dropout: f64,
    /// The adapted layers, by Hugging Face module name (a subset of [`LORA_TARGETS`]).
    pub target_modules: Vec<String>,
    /// PEFT's `layers_to_transform`: the indices of the decoder layers that get adapters
    /// (`None`: every layer). Adapting only the top layers also shortens the backward pass,
    /// which then stops at the lowest adapted layer.
    #[serde(default)]
    pub layers_to_transform: Option<Vec<usize>>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            rank: 8,
            alpha: DEFAULT_ALPHA,
            dropout: 0.0,
            target_modules: DEFAULT_TARGET_MODULES.map(String::from).to_vec(),
            layers_to_transform: None,
        }
    }
}

fn invalid(field: &str, reason: impl Into<String>) -> ModelError {
    ModelError::InvalidConfig {
        field: field.to_string(),
        reason: reason.into(),
    }
}

impl LoraConfig {
    /// Checks the settings; errors name the PEFT field (`r`, `lora_alpha`, `lora_dropout`,
    /// `target_modules`).
    pub fn validate(&self) -> Result<()> {
        if self.rank == 0 {
            return Err(invalid("r", "the rank must be at least 1"));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(invalid(
                "lora_alpha",
                format!("must be a positive number, got {}", self.alpha),
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(invalid(
                "lora_dropout",
                format!("must be in [0, 1), got {}", self.dropout),
            ));
        }
        if self.target_modules.is_empty() {
            return Err(invalid("target_modules", "names no layer"));
        }
        for (i, m) in self.target_modules.iter().enumerate() {
            if !LORA_TARGETS.contains(&m.as_str()) {
                return Err(invalid(
                    "target_modules",
                    format!("unknown module `{m}` (known: {})", LORA_TARGETS.join(", ")),
                ));
            }
            if self.target_modules[..i].contains(m) {
                return Err(invalid("target_modules", format!("`{m}` is named twice")));
            }
        }
        if let Some(layers) = &self.layers_to_transform {
            if layers.is_empty() {
                return Err(invalid("layers_to_transform", "names no layer"));
            }
            for (i, l) in layers.iter().enumerate() {
                if layers[..i].contains(l) {
                    return Err(invalid(
                        "layers_to_transform",
                        format!("layer {l} is named twice"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// [`LoraConfig::validate`], and every layer of `layers_to_transform` exists in `model`.
    pub fn validate_for(&self, model: &ModelConfig) -> Result<()> {
        self.validate()?;
        if let Some(l) = self
            .layers_to_transform
            .iter()
            .flatten()
            .find(|&&l| l >= model.num_hidden_layers)
        {
            return Err(invalid(
                "layers_to_transform",
                format!(
                    "layer {l} does not exist: the model has {} layers (0 to {})",
                    model.num_hidden_layers,
                    model.num_hidden_layers.saturating_sub(1)
                ),
            ));
        }
        Ok(())
    }

    /// Whether decoder layer `i` gets adapters.
    pub fn transforms_layer(&self, i: usize) -> bool {
        self.layers_to_transform
            .as_ref()
            .is_none_or(|l| l.contains(&i))
    }

    /// The scale `alpha / rank` of the adapters' output.
    pub fn scaling(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// Whether the layer named `module` (e.g. `q_proj`) is adapted.
    pub fn targets(&self, module: &str) -> bool {
        self.target_modules.iter().any(|m| m == module)
    }

    /// The adapted layers of `model`: `(prefix, out, in)` with `prefix` the Hugging Face name
    /// of the layer (`model.layers.0.self_attn.q_proj`), in layer order.
    pub fn adapted_layers(&self, model: &ModelConfig) -> Vec<(String, usize, usize)> {
        let shapes: HashMap<String, Vec<usize>> = model.parameter_shapes().into_iter().collect();
        let mut out = Vec::new();
        for i in (0..model.num_hidden_layers).filter(|&i| self.transforms_layer(i)) {
            for m in LORA_TARGETS {
                if !self.targets(m) {
                    continue;
                }
                let block = if matches!(m, "gate_proj" | "up_proj" | "down_proj") {
                    "mlp"
                } else {
                    "self_attn"
                };
                let prefix = format!("model.layers.{i}.{block}.{m}");
                let s = &shapes[&format!("{prefix}.weight")];
                out.push((prefix, s[0], s[1]));
            }
        }
        out
    }

    /// Every adapter tensor of `model` with its shape: `{prefix}.lora_A.weight: [rank, in]` and
    /// `{prefix}.lora_B.weight: [out, rank]`.
    pub fn adapter_shapes(&self, model: &ModelConfig) -> Vec<(String, Vec<usize>)> {
        self.adapted_layers(model)
            .into_iter()
            .flat_map(|(p, o, i)| {
                [
                    (format!("{p}.lora_A.weight"), vec![self.rank, i]),
                    (format!("{p}.lora_B.weight"), vec![o, self.rank]),
                ]
            })
            .collect()
    }

    /// The number of adapter parameters on `model`.
    pub fn num_parameters(&self, model: &ModelConfig) -> usize {
        self.adapted_layers(model)
            .iter()
            .map(|(_, o, i)| self.rank * (o + i))
            .sum()
    }

    /// PEFT's `adapter_config.json` for these adapters on the model `base_model_name_or_path`.
    pub fn to_peft_json(&self, base_model_name_or_path: Option<&str>) -> Value {
        json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model_name_or_path,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": self.target_modules,
            "bias": "none",
            "fan_in_fan_out": false,
            "inference_mode": true,
            "init_lora_weights": true,
            "use_rslora": false,
            "use_dora": false,
            "modules_to_save": null,
            "layers_to_transform": self.layers_to_transform,
            "layers_pattern": null,
            "rank_pattern": {},
            "alpha_pattern": {},
            "revision": null,
        })
    }

    /// Reads PEFT's `adapter_config.json` fields back; adapters this crate cannot apply
    /// (another PEFT type, biases, rsLoRA, DoRA, per-layer ranks) are errors naming the field.
    pub fn from_peft_json(v: &Value) -> Result<Self> {
        let field = |k: &str| v.get(k).filter(|x| !x.is_null());
        match field("peft_type").and_then(Value::as_str) {
            Some("LORA") => {}
            other => {
                return Err(invalid(
                    "peft_type",
                    format!("expected \"LORA\", got {other:?}"),
                ));
            }
        }
        for (k, ok) in [
            ("bias", field("bias").is_none_or(|b| b == "none")),
            (
                "use_rslora",
                field("use_rslora").is_none_or(|b| b.as_bool() == Some(false)),
            ),
            (
                "use_dora",
                field("use_dora").is_none_or(|b| b.as_bool() == Some(false)),
            ),
            (
                "fan_in_fan_out",
                field("fan_in_fan_out").is_none_or(|b| b.as_bool() == Some(false)),
            ),
            (
                "rank_pattern",
                field("rank_pattern").is_none_or(|p| p.as_object().is_some_and(|o| o.is_empty())),
            ),
            (
                "alpha_pattern",
                field("alpha_pattern").is_none_or(|p| p.as_object().is_some_and(|o| o.is_empty())),
            ),
        ] {
            if !ok {
                return Err(invalid(k, format!("unsupported value {}", v[k])));
            }
        }
        let rank = field("r")
            .and_then(Value::as_u64)
            .ok_or_else(|| invalid("r", "missing or not an integer"))? as usize;
        let alpha = field("lora_alpha")
            .and_then(Value::as_f64)
            .ok_or_else(|| invalid("lora_alpha", "missing or not a number"))?;
        let dropout = field("lora_dropout").and_then(Value::as_f64).unwrap_or(0.0);
        let target_modules = match field("target_modules") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|m| {
                    m.as_str()
                        .map(String::from)
                        .ok_or_else(|| invalid("target_modules", "holds a non-string"))
                })
                .collect::<Result<Vec<_>>>()?,
            Some(Value::String(s)) => {
                return Err(invalid(
                    "target_modules",
                    format!("a regular expression ({s:?}) is not supported; list the modules"),
                ));
            }
            _ => return Err(invalid("target_modules", "missing")),
        };
        let layers_to_transform = match field("layers_to_transform") {
            None => None,
            Some(Value::Array(a)) => Some(
                a.iter()
                    .map(|l| {
                        l.as_u64()
                            .map(|l| l as usize)
                            .ok_or_else(|| invalid("layers_to_transform", "holds a non-integer"))
                    })
                    .collect::<Result<Vec<_>>>()?,
            ),
            Some(Value::Number(n)) => Some(vec![
                n.as_u64()
                    .ok_or_else(|| invalid("layers_to_transform", "is not a layer index"))?
                    as usize,
            ]),
            Some(other) => {
                return Err(invalid(
                    "layers_to_transform",
                    format!("expected a list of layer indices, got {other}"),
                ));
            }
        };
        if let Some(p) = field("layers_pattern")
            && p != "layers"
            && p.as_array().is_none_or(|a| a.iter().any(|x| x != "layers"))
        {
            return Err(invalid(
                "layers_pattern",
                format!("unsupported value {p} (the decoder layers are `layers`)"),
            ));
        }
        let c = Self {
            rank,
            alpha,
            dropout,
            target_modules,
            layers_to_transform,
        };
        c.validate()?;
        Ok(c)
    }
}

/// Fresh adapters for `model` as a `VarMap` of `Var`s named as in [`LoraConfig::adapter_shapes`]:
/// every `A` ~ `U(−1/√in, 1/√in)` (PEFT's Kaiming-uniform with `a = √5`), every `B` zero, drawn
/// in sorted-name order from one [`TurnRng`] stream seeded with `seed`.
pub fn init_adapters(
    model: &ModelConfig,
    lora: &LoraConfig,
    dtype: DType,
    device: &Device,
    seed: u64,
) -> Result<VarMap> {
    lora.validate_for(model)?;
    let mut shapes = lora.adapter_shapes(model);
    shapes.sort();
    let mut rng = TurnRng::seed_from_u64(seed);
    let mut tensors = HashMap::new();
    for (name, shape) in shapes {
        let n: usize = shape.iter().product();
        let values: Vec<f64> = if name.ends_with("lora_A.weight") {
            let bound = 1.0 / (shape[1] as f64).sqrt();
            (0..n)
                .map(|_| (2.0 * rng.next_f64() - 1.0) * bound)
                .collect()
        } else {
            vec![0.0; n]
        };
        tensors.insert(
            name,
            Tensor::from_vec(values, shape, device)?.to_dtype(dtype)?,
        );
    }
    adapters_varmap(model, lora, &tensors, "fresh adapters")
}

/// A `VarMap` holding a copy of exactly the adapters `lora` puts on `model`, taken from
/// `tensors` (named as in [`LoraConfig::adapter_shapes`]); errors name any missing tensor or
/// shape mismatch, and any extra adapter tensor (one the config does not target).
pub fn adapters_varmap(
    model: &ModelConfig,
    lora: &LoraConfig,
    tensors: &HashMap<String, Tensor>,
    source_desc: &str,
) -> Result<VarMap> {
    let shapes = lora.adapter_shapes(model);
    if let Some(extra) = tensors
        .keys()
        .find(|k| !shapes.iter().any(|(n, _)| n == *k))
    {
        return Err(ModelError::invalid_input(
            extra.clone(),
            format!("{source_desc} holds an adapter the LoRA config does not target"),
        ));
    }
    crate::model::weights::varmap_of_shapes(shapes, tensors, source_desc)
}

/// The base weights with the adapters folded in: `W + (alpha / rank) · B A` for every adapted
/// layer (computed in `f64`, then stored in `W`'s dtype); every other tensor is shared with
/// `base`, not copied.
pub fn merge_adapters(
    model: &ModelConfig,
    lora: &LoraConfig,
    base: &HashMap<String, Tensor>,
    adapters: &HashMap<String, Tensor>,
) -> Result<HashMap<String, Tensor>> {
    let mut out = base.clone();
    let s = lora.scaling();
    for (prefix, _, _) in lora.adapted_layers(model) {
        let get = |name: String, map: &HashMap<String, Tensor>, what: &str| -> Result<Tensor> {
            map.get(&name)
                .cloned()
                .ok_or_else(|| ModelError::MissingTensor {
                    name,
                    source_desc: what.to_string(),
                })
        };
        let w = get(format!("{prefix}.weight"), base, "the base weights")?;
        let a = get(format!("{prefix}.lora_A.weight"), adapters, "the adapters")?;
        let b = get(format!("{prefix}.lora_B.weight"), adapters, "the adapters")?;
        let delta = (b.to_dtype(DType::F64)?.matmul(&a.to_dtype(DType::F64)?)? * s)?;
        let merged = (w.to_dtype(DType::F64)? + delta)?.to_dtype(w.dtype())?;
        out.insert(format!("{prefix}.weight"), merged);
    }
    Ok(out)
}

/// Writes a PEFT adapter folder `dir` (created if needed): `adapter_config.json` (see
/// [`LoraConfig::to_peft_json`]) and `adapter_model.safetensors` with PEFT's names
/// (`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`), both mode 0644.
pub fn save_peft_adapter(
    dir: impl AsRef<Path>,
    lora: &LoraConfig,
    adapters: &HashMap<String, Tensor>,
    base_model_name_or_path: Option<&str>,
) -> Result<()> {
    let dir = dir.as_ref();
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let cfg_path = dir.join(ADAPTER_CONFIG_FILE);
    let text = serde_json::to_string_pretty(&lora.to_peft_json(base_model_name_or_path)).map_err(
        |cause| ModelError::Json {
            what: cfg_path.display().to_string(),
            cause,
        },
    )?;
    std::fs::write(&cfg_path, format!("{text}\n")).map_err(|e| ModelError::io(&cfg_path, e))?;
    set_mode_644(&cfg_path)?;
    let named: HashMap<String, Tensor> = adapters
        .iter()
        .map(|(k, t)| (format!("{PEFT_PREFIX}{k}"), t.clone()))
        .collect();
    save_safetensors(&named, dir.join(ADAPTER_WEIGHTS_FILE))
}

/// Whether `dir` holds a PEFT adapter (an `adapter_config.json`).
pub fn is_adapter_folder(dir: impl AsRef<Path>) -> bool {
    dir.as_ref().join(ADAPTER_CONFIG_FILE).is_file()
}

/// Reads a PEFT adapter folder written by [`save_peft_adapter`] (or by PEFT for a Llama/Qwen
/// model): the config and the tensors under this crate's names (PEFT's prefix and the
/// adapter name `.default` that some versions insert are removed).
pub fn load_peft_adapter(
    dir: impl AsRef<Path>,
    dtype: DType,
    device: &Device,
) -> Result<(LoraConfig, HashMap<String, Tensor>)> {
    let dir = dir.as_ref();
    let cfg_path = dir.join(ADAPTER_CONFIG_FILE);
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| ModelError::io(&cfg_path, e))?;
    let v: Value = serde_json::from_str(&text).map_err(|cause| ModelError::Json {
        what: cfg_path.display().to_string(),
        cause,
    })?;
    let config = LoraConfig::from_peft_json(&v).map_err(|e| ModelError::Checkpoint {
        path: cfg_path.clone(),
        reason: e.to_string(),
    })?;
    let raw = load_safetensors(dir.join(ADAPTER_WEIGHTS_FILE), dtype, device)?;
    let tensors = raw
        .into_iter()
        .map(|(k, t)| {
            let k = k
                .strip_prefix(PEFT_PREFIX)
                .unwrap_or(&k)
                .replace(".default.", ".");
            (k, t)
        })
        .collect();
    Ok((config, tensors))
}

/// Dropout on the adapters' input for training forwards: every call draws a fresh mask from
/// `seed` and a call counter (shared by the clones of one dropout), so a run is reproducible and
/// a resumed run continues the sequence when the counter is restored ([`LoraDropout::calls`],
/// [`LoraDropout::set_calls`]).
#[derive(Debug, Clone)]
pub struct LoraDropout {
    p: f64,
    seed: u64,
    calls: Arc<AtomicU64>,
}

impl LoraDropout {
    /// Dropout with probability `p` (kept values are scaled by `1 / (1 − p)`).
    pub fn new(p: f64, seed: u64) -> Self {
        Self {
            p,
            seed,
            calls: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The dropout probability.
    pub fn p(&self) -> f64 {
        self.p
    }

    /// How many masks were drawn so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    /// Continues the mask sequence after `n` draws (a resumed run).
    pub fn set_calls(&self, n: u64) {
        self.calls.store(n, Ordering::SeqCst);
    }

    /// `x` with each value zeroed with probability `p` and the others scaled by `1 / (1 − p)`.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        if self.p <= 0.0 {
            return Ok(x.clone());
        }
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        let mut rng = TurnRng::seed_from_u64(self.seed).fork(call);
        let keep = 1.0 / (1.0 - self.p);
        let mask: Vec<f32> = (0..x.elem_count())
            .map(|_| {
                if rng.next_f64() < self.p {
                    0.0
                } else {
                    keep as f32
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, x.dims(), x.device())?.to_dtype(x.dtype())?;
        Ok((x * mask)?)
    }
}

#[cfg(test)]
#[path = "lora_tests.rs"]
mod tests;
