//! Creating, loading and saving model weights with Hugging Face names.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;

use crate::error::{ModelError, Result};
use crate::model::config::{Architecture, ModelConfig};
use crate::rng::TurnRng;

/// Whether a parameter is an RMSNorm weight (initialised to 1).
fn is_norm(name: &str) -> bool {
    name.ends_with("layernorm.weight") || name.ends_with("norm.weight")
}

/// A fresh `VarMap` holding every parameter of `config`, initialised from `seed`:
/// projection and embedding weights ~ N(0, `initializer_range`²), biases 0, norm weights 1
/// (the Hugging Face initialisation). Parameters are drawn in sorted-name order from one
/// [`TurnRng`] stream, so the same seed gives the same weights on every machine.
pub fn init_varmap(
    config: &ModelConfig,
    dtype: DType,
    device: &Device,
    seed: u64,
) -> Result<VarMap> {
    config.validate()?;
    let mut rng = TurnRng::seed_from_u64(seed);
    let mut tensors = HashMap::new();
    for (name, shape) in config.parameter_shapes() {
        let n: usize = shape.iter().product();
        let values: Vec<f64> = if is_norm(&name) {
            vec![1.0; n]
        } else if name.ends_with(".bias") {
            vec![0.0; n]
        } else {
            (0..n)
                .map(|_| rng.normal() * config.initializer_range)
                .collect()
        };
        let t = Tensor::from_vec(values, shape, device)?.to_dtype(dtype)?;
        tensors.insert(name, t);
    }
    varmap_from_tensors(config, &tensors, "fresh initialisation")
}

/// A `VarMap` holding a copy of exactly the parameters `config` needs, taken from `tensors`
/// (e.g. a loaded checkpoint), so that they can be trained. Errors name any missing tensor or
/// shape mismatch.
pub fn varmap_from_tensors(
    config: &ModelConfig,
    tensors: &HashMap<String, Tensor>,
    source_desc: &str,
) -> Result<VarMap> {
    varmap_of_shapes(config.parameter_shapes(), tensors, source_desc)
}

/// A `VarMap` holding a copy of each of `shapes` taken from `tensors`; errors name any missing
/// tensor (in `source_desc`) or shape mismatch.
pub fn varmap_of_shapes(
    shapes: Vec<(String, Vec<usize>)>,
    tensors: &HashMap<String, Tensor>,
    source_desc: &str,
) -> Result<VarMap> {
    let varmap = VarMap::new();
    {
        let mut data = varmap.data().lock().unwrap_or_else(|e| e.into_inner());
        for (name, shape) in shapes {
            let t = tensors
                .get(&name)
                .ok_or_else(|| ModelError::MissingTensor {
                    name: name.clone(),
                    source_desc: source_desc.to_string(),
                })?;
            if t.dims() != shape.as_slice() {
                return Err(ModelError::ShapeMismatch {
                    name,
                    expected: shape,
                    found: t.dims().to_vec(),
                });
            }
            // `Var::from_tensor` copies, so the Var never aliases the caller's tensor.
            let var = Var::from_tensor(&t.detach().contiguous()?)?;
            data.insert(name, var);
        }
    }
    Ok(varmap)
}

/// A copy of `varmap`'s parameters (those `config` needs) converted to `dtype` on `device`: e.g.
/// a CPU `f32` initialisation or checkpoint moved to a CUDA device in `bf16`
/// ([`crate::device::default_dtype`]).
pub fn convert_varmap(
    config: &ModelConfig,
    varmap: &VarMap,
    dtype: DType,
    device: &Device,
) -> Result<VarMap> {
    let mut tensors = HashMap::new();
    for (name, var) in sorted_vars(varmap) {
        let t = var.as_tensor().detach();
        let t = if t.dtype().is_float() {
            t.to_dtype(dtype)?
        } else {
            t
        };
        tensors.insert(name, t.to_device(device)?);
    }
    varmap_from_tensors(config, &tensors, "the converted model")
}

/// The `Var`s of a `VarMap`, sorted by name (a deterministic order for optimizers).
pub fn sorted_vars(varmap: &VarMap) -> Vec<(String, Var)> {
    let data = varmap.data().lock().unwrap_or_else(|e| e.into_inner());
    let mut vars: Vec<(String, Var)> = data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars
}

/// Writes named tensors as one safetensors file with the header metadata `{"format": "pt"}`
/// (which `transformers` before 4.48.2 requires), readable by everyone (mode 0644).
pub fn save_safetensors(tensors: &HashMap<String, Tensor>, path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    let contiguous: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(k, t)| Ok((k.clone(), t.detach().contiguous()?)))
        .collect::<Result<_>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(contiguous, Some(metadata), path).map_err(|e| {
        ModelError::Checkpoint {
            path: path.to_path_buf(),
            reason: format!("cannot write safetensors: {e}"),
        }
    })?;
    set_mode_644(path)
}

/// Makes a written file readable by everyone and writable by its owner (mode 0644), as every
/// file of an exported folder is: the safetensors writer creates files through a private
/// temporary file (mode 0600). A no-op off Unix.
pub fn set_mode_644(path: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644))
            .map_err(|e| ModelError::io(path, e))?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

/// Counts the NaN and infinite values of a floating-point tensor (0 for integer tensors).
pub(crate) fn non_finite_count(t: &Tensor) -> Result<usize> {
    Ok(match t.dtype() {
        DType::F64 => t
            .flatten_all()?
            .to_vec1::<f64>()?
            .iter()
            .filter(|x| !x.is_finite())
            .count(),
        d if d.is_float() => t
            .flatten_all()?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?
            .iter()
            .filter(|x| !x.is_finite())
            .count(),
        _ => 0,
    })
}

/// Reads one safetensors file, converting floating-point tensors to `dtype`. A tensor holding
/// NaN or infinite values is an error ([`ModelError::NonFinite`]) naming the file and the
/// tensor.
pub fn load_safetensors(
    path: impl AsRef<Path>,
    dtype: DType,
    device: &Device,
) -> Result<HashMap<String, Tensor>> {
    let path = path.as_ref();
    if !path.exists() {
        return Err(ModelError::io(
            path,
            std::io::Error::new(std::io::ErrorKind::NotFound, "file not found"),
        ));
    }
    let raw = candle_core::safetensors::load(path, device).map_err(|e| ModelError::Checkpoint {
        path: path.to_path_buf(),
        reason: format!("cannot read safetensors: {e}"),
    })?;
    raw.into_iter()
        .map(|(k, t)| {
            // Checked before any conversion, so a finite f64 beyond f32's range is not flagged.
            let count = non_finite_count(&t)?;
            if count > 0 {
                return Err(ModelError::NonFinite {
                    path: path.to_path_buf(),
                    total: t.elem_count(),
                    tensor: k,
                    count,
                });
            }
            let t = if t.dtype().is_float() && t.dtype() != dtype {
                t.to_dtype(dtype)?
            } else {
                t
            };
            Ok((k, t))
        })
        .collect()
}

/// Loads the weights of a Hugging Face model folder: `model.safetensors`, or the shards listed
/// in `model.safetensors.index.json`.
pub fn load_hf_weights(
    dir: impl AsRef<Path>,
    dtype: DType,
    device: &Device,
) -> Result<HashMap<String, Tensor>> {
    let dir = dir.as_ref();
    let single = dir.join("model.safetensors");
    if single.exists() {
        return load_safetensors(&single, dtype, device);
    }
    let index_path = dir.join("model.safetensors.index.json");
    if !index_path.exists() {
        return Err(ModelError::Checkpoint {
            path: dir.to_path_buf(),
            reason: "neither model.safetensors nor model.safetensors.index.json exists".into(),
        });
    }
    let text = std::fs::read_to_string(&index_path).map_err(|e| ModelError::io(&index_path, e))?;
    let index: serde_json::Value =
        serde_json::from_str(&text).map_err(|cause| ModelError::Json {
            what: index_path.display().to_string(),
            cause,
        })?;
    let map = index
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| ModelError::Checkpoint {
            path: index_path.clone(),
            reason: "no `weight_map` object".into(),
        })?;
    let shards: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
    let mut all = HashMap::new();
    for shard in shards {
        all.extend(load_safetensors(dir.join(shard), dtype, device)?);
    }
    for name in map.keys() {
        if !all.contains_key(name) {
            return Err(ModelError::MissingTensor {
                name: name.clone(),
                source_desc: format!("the shard that {} names", index_path.display()),
            });
        }
    }
    Ok(all)
}

/// Loads `config.json` and the weights of a Hugging Face model folder. Attention output
/// biases (`model.layers.N.self_attn.o_proj.bias`, which Llama and Qwen3 have when
/// `attention_bias = true`) must be zero, and are dropped: the attention here has none, so a
/// non-zero one is an error naming the tensor.
pub fn load_hf(
    dir: impl AsRef<Path>,
    dtype: DType,
    device: &Device,
) -> Result<(ModelConfig, HashMap<String, Tensor>)> {
    let dir = dir.as_ref();
    let config = ModelConfig::from_hf_file(dir.join("config.json"))?;
    let mut weights = load_hf_weights(dir, dtype, device)?;
    let mut o_biases: Vec<String> = weights
        .keys()
        .filter(|k| k.ends_with(O_PROJ_BIAS))
        .cloned()
        .collect();
    o_biases.sort();
    for name in o_biases {
        let t = &weights[&name];
        let non_zero = t
            .flatten_all()?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?
            .iter()
            .filter(|x| **x != 0.0)
            .count();
        if non_zero > 0 {
            return Err(ModelError::Checkpoint {
                path: dir.to_path_buf(),
                reason: format!(
                    "`{name}` holds {non_zero} non-zero values (of {}): attention output \
                     biases are not supported (only zero ones, which are dropped)",
                    t.elem_count()
                ),
            });
        }
        weights.remove(&name);
    }
    Ok((config, weights))
}

/// The name ending of an attention output projection's bias.
const O_PROJ_BIAS: &str = ".self_attn.o_proj.bias";

/// Writes a Hugging Face model folder (`config.json` + `model.safetensors`) from a `VarMap`,
/// loadable by [`load_hf`] and by `transformers`.
pub fn export_hf(dir: impl AsRef<Path>, config: &ModelConfig, varmap: &VarMap) -> Result<()> {
    export_hf_tensors(
        dir,
        config,
        &crate::model::transformer::varmap_tensors(varmap, true),
    )
}

/// [`export_hf`] from named tensors (e.g. base weights with LoRA adapters merged in); every
/// tensor of `tensors` is written, and for Llama with `attention_bias` zero o_proj biases
/// (transformers' Llama puts a bias there too; [`load_hf`] drops them).
pub fn export_hf_tensors(
    dir: impl AsRef<Path>,
    config: &ModelConfig,
    tensors: &HashMap<String, Tensor>,
) -> Result<()> {
    let dir = dir.as_ref();
    // transformers' Llama with `attention_bias` has a bias on o_proj as well: write it as zero.
    let mut with_o_bias;
    let tensors = if config.architecture == Architecture::Llama && config.attention_bias {
        with_o_bias = tensors.clone();
        for i in 0..config.num_hidden_layers {
            let p = format!("model.layers.{i}.self_attn");
            let like = tensors.get(&format!("{p}.q_proj.bias")).ok_or_else(|| {
                ModelError::MissingTensor {
                    name: format!("{p}.q_proj.bias"),
                    source_desc: "the weights to export".into(),
                }
            })?;
            let zeros = Tensor::zeros(config.hidden_size, like.dtype(), like.device())?;
            with_o_bias
                .entry(format!("{p}.o_proj.bias"))
                .or_insert(zeros);
        }
        &with_o_bias
    } else {
        tensors
    };
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let cfg_path = dir.join("config.json");
    let mut json = config.to_hf_json();
    if let Some(embed) = tensors.get("model.embed_tokens.weight") {
        let name = match embed.dtype() {
            DType::F64 => "float64",
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
            _ => "float32",
        };
        json["torch_dtype"] = serde_json::Value::String(name.into());
    }
    let text = serde_json::to_string_pretty(&json).map_err(|cause| ModelError::Json {
        what: cfg_path.display().to_string(),
        cause,
    })?;
    std::fs::write(&cfg_path, text).map_err(|e| ModelError::io(&cfg_path, e))?;
    set_mode_644(&cfg_path)?;
    save_safetensors(tensors, dir.join("model.safetensors"))
}
