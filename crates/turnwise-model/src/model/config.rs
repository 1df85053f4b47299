//! Model configuration, read from and written to Hugging Face `config.json`.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// The decoder families the embedded transformer implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    /// Qwen2 / Qwen2.5: bias on the q, k and v projections.
    Qwen2,
    /// Qwen3: RMSNorm on queries and keys per head, explicit `head_dim`, no projection bias.
    Qwen3,
    /// Llama 2/3 (without rope scaling): no bias.
    Llama,
}

impl Architecture {
    /// The Hugging Face `model_type` string.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Llama => "llama",
        }
    }

    /// The Hugging Face `architectures[0]` class name.
    pub fn class_name(self) -> &'static str {
        match self {
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
            Self::Llama => "LlamaForCausalLM",
        }
    }

    fn from_hf(model_type: Option<&str>, architectures: Option<&[String]>) -> Result<Self> {
        if let Some(mt) = model_type {
            return match mt {
                "qwen2" => Ok(Self::Qwen2),
                "qwen3" => Ok(Self::Qwen3),
                "llama" => Ok(Self::Llama),
                other => Err(ModelError::invalid_config(
                    "model_type",
                    format!("`{other}` is not supported (qwen2, qwen3, llama)"),
                )),
            };
        }
        match architectures.and_then(|a| a.first()).map(String::as_str) {
            Some("Qwen2ForCausalLM") => Ok(Self::Qwen2),
            Some("Qwen3ForCausalLM") => Ok(Self::Qwen3),
            Some("LlamaForCausalLM") => Ok(Self::Llama),
            Some(other) => Err(ModelError::invalid_config(
                "architectures",
                format!("`{other}` is not supported"),
            )),
            None => Err(ModelError::invalid_config(
                "model_type",
                "neither `model_type` nor `architectures` is given",
            )),
        }
    }
}

/// Resolved configuration of a decoder-only transformer (all defaults applied, validated).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Model family.
    pub architecture: Architecture,
    /// Residual stream width.
    pub hidden_size: usize,
    /// SwiGLU inner width.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Number of query heads.
    pub num_attention_heads: usize,
    /// Number of key/value heads (grouped-query attention when smaller than the query heads).
    pub num_key_value_heads: usize,
    /// Width of one attention head.
    pub head_dim: usize,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// Epsilon inside RMSNorm.
    pub rms_norm_eps: f64,
    /// Vocabulary size (rows of the embedding matrix).
    pub vocab_size: usize,
    /// Whether the output projection reuses the token embedding matrix.
    pub tie_word_embeddings: bool,
    /// Longest sequence the model is meant for.
    pub max_position_embeddings: usize,
    /// Bias on the q, k, v projections (Qwen2: true).
    pub attention_bias: bool,
    /// Per-head RMSNorm on queries and keys (Qwen3: true).
    pub qk_norm: bool,
    /// Standard deviation of the normal initialisation of fresh weights.
    pub initializer_range: f64,
}

/// The fields of a Hugging Face `config.json` that the loader reads; all optional so that
/// missing ones are reported by name.
#[derive(Debug, Clone, Default, Deserialize)]
struct HfConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rope_theta: Option<f64>,
    rms_norm_eps: Option<f64>,
    vocab_size: Option<usize>,
    tie_word_embeddings: Option<bool>,
    max_position_embeddings: Option<usize>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    hidden_act: Option<String>,
    rope_scaling: Option<serde_json::Value>,
    /// transformers ≥ 5 writes `{"rope_theta": .., "rope_type": ..}` here instead of a
    /// top-level `rope_theta`.
    rope_parameters: Option<serde_json::Value>,
    use_sliding_window: Option<bool>,
    initializer_range: Option<f64>,
}

fn required(v: Option<usize>, field: &str) -> Result<usize> {
    v.ok_or_else(|| ModelError::invalid_config(field, "missing"))
}

impl ModelConfig {
    /// Parses a Hugging Face `config.json` document (Qwen2, Qwen3 or Llama) and validates it.
    /// Llama with `attention_bias = true` is read as Qwen2: the two compute the same once the
    /// o_proj biases of such a Llama are zero, which [`crate::model::weights::load_hf`] checks.
    pub fn from_hf_json(json: &str) -> Result<Self> {
        let hf: HfConfig = serde_json::from_str(json).map_err(|cause| ModelError::Json {
            what: "config.json".into(),
            cause,
        })?;
        let architecture =
            Architecture::from_hf(hf.model_type.as_deref(), hf.architectures.as_deref())?;
        if let Some(act) = &hf.hidden_act
            && act != "silu"
        {
            return Err(ModelError::invalid_config(
                "hidden_act",
                format!("`{act}` is not supported (only silu)"),
            ));
        }
        if hf.mlp_bias == Some(true) {
            return Err(ModelError::invalid_config(
                "mlp_bias",
                "true is not supported",
            ));
        }
        if let Some(rs) = &hf.rope_scaling
            && !rs.is_null()
        {
            return Err(ModelError::invalid_config(
                "rope_scaling",
                "rope scaling is not supported",
            ));
        }
        if hf.use_sliding_window == Some(true) {
            return Err(ModelError::invalid_config(
                "use_sliding_window",
                "sliding-window attention is not supported",
            ));
        }
        let mut rope_theta = hf.rope_theta;
        if let Some(rp) = hf.rope_parameters.as_ref().filter(|v| !v.is_null()) {
            match rp.get("rope_type").and_then(|t| t.as_str()) {
                None | Some("default") => {}
                Some(other) => {
                    return Err(ModelError::invalid_config(
                        "rope_parameters.rope_type",
                        format!("`{other}` is not supported (only default)"),
                    ));
                }
            }
            if let Some(theta) = rp.get("rope_theta") {
                let theta = theta.as_f64().ok_or_else(|| {
                    ModelError::invalid_config("rope_parameters.rope_theta", "not a number")
                })?;
                rope_theta = Some(theta);
            }
        }
        let hidden_size = required(hf.hidden_size, "hidden_size")?;
        let num_attention_heads = required(hf.num_attention_heads, "num_attention_heads")?;
        let head_dim = match hf.head_dim {
            Some(d) => d,
            None if architecture == Architecture::Qwen3 => {
                return Err(ModelError::invalid_config(
                    "head_dim",
                    "missing (required for qwen3)",
                ));
            }
            None => {
                if num_attention_heads == 0 {
                    return Err(ModelError::invalid_config(
                        "num_attention_heads",
                        "must be > 0",
                    ));
                }
                hidden_size / num_attention_heads
            }
        };
        let attention_bias = hf
            .attention_bias
            .unwrap_or(architecture == Architecture::Qwen2);
        // Llama with `attention_bias` is Qwen2 (q/k/v biases) once its o_proj biases, which
        // `load_hf` requires to be zero, are dropped: turnwise writes Qwen2 models whose
        // tokenizer is not Qwen2's in that form (see `checkpoint::hf::export_model_config`),
        // and reads them back as what they were.
        let architecture = match architecture {
            Architecture::Llama if attention_bias => Architecture::Qwen2,
            other => other,
        };
        let cfg = Self {
            architecture,
            hidden_size,
            intermediate_size: required(hf.intermediate_size, "intermediate_size")?,
            num_hidden_layers: required(hf.num_hidden_layers, "num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: hf.num_key_value_heads.unwrap_or(num_attention_heads),
            head_dim,
            rope_theta: rope_theta.unwrap_or(10_000.0),
            rms_norm_eps: hf.rms_norm_eps.unwrap_or(1e-6),
            vocab_size: required(hf.vocab_size, "vocab_size")?,
            tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(false),
            max_position_embeddings: hf.max_position_embeddings.unwrap_or(32_768),
            attention_bias,
            qk_norm: architecture == Architecture::Qwen3,
            initializer_range: hf.initializer_range.unwrap_or(0.02),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads and parses `config.json` from a file.
    pub fn from_hf_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        Self::from_hf_json(&text).map_err(|e| match e {
            ModelError::Json { cause, .. } => ModelError::Json {
                what: path.display().to_string(),
                cause,
            },
            other => other,
        })
    }

    /// A Hugging Face `config.json` document describing this model, loadable by
    /// [`ModelConfig::from_hf_json`] and by `transformers`.
    pub fn to_hf_json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "architectures": [self.architecture.class_name()],
            "model_type": self.architecture.model_type(),
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "initializer_range": self.initializer_range,
            "torch_dtype": "float32",
        });
        if self.architecture == Architecture::Llama {
            v["attention_bias"] = serde_json::Value::Bool(self.attention_bias);
            v["mlp_bias"] = serde_json::Value::Bool(false);
        }
        if self.architecture == Architecture::Qwen3 {
            v["attention_bias"] = serde_json::Value::Bool(self.attention_bias);
        }
        v
    }

    /// Checks that every size is positive and that the head layout is consistent.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(ModelError::invalid_config(field, "must be > 0"));
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(ModelError::invalid_config(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads = {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(ModelError::invalid_config(
                "head_dim",
                format!("{} must be even for rotary embeddings", self.head_dim),
            ));
        }
        if !(self.rope_theta > 0.0 && self.rope_theta.is_finite()) {
            return Err(ModelError::invalid_config(
                "rope_theta",
                "must be a positive number",
            ));
        }
        if !(self.rms_norm_eps > 0.0 && self.rms_norm_eps.is_finite()) {
            return Err(ModelError::invalid_config(
                "rms_norm_eps",
                "must be a positive number",
            ));
        }
        if self.architecture != Architecture::Qwen3
            && self.head_dim * self.num_attention_heads != self.hidden_size
        {
            return Err(ModelError::invalid_config(
                "head_dim",
                format!(
                    "head_dim {} × num_attention_heads {} != hidden_size {}",
                    self.head_dim, self.num_attention_heads, self.hidden_size
                ),
            ));
        }
        Ok(())
    }

    /// A small Qwen2-style configuration, handy for tests and from-scratch training.
    pub fn tiny_qwen2(vocab_size: usize) -> Self {
        Self {
            architecture: Architecture::Qwen2,
            hidden_size: 32,
            intermediate_size: 64,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 8,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-6,
            vocab_size,
            tie_word_embeddings: true,
            max_position_embeddings: 512,
            attention_bias: true,
            qk_norm: false,
            initializer_range: 0.02,
        }
    }

    /// Every parameter name and shape of this model, in Hugging Face naming, sorted by name.
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let h = self.hidden_size;
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let mut out = vec![
            (
                "model.embed_tokens.weight".to_string(),
                vec![self.vocab_size, h],
            ),
            ("model.norm.weight".to_string(), vec![h]),
        ];
        if !self.tie_word_embeddings {
            out.push(("lm_head.weight".to_string(), vec![self.vocab_size, h]));
        }
        for i in 0..self.num_hidden_layers {
            let p = format!("model.layers.{i}");
            out.push((format!("{p}.input_layernorm.weight"), vec![h]));
            out.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
            out.push((format!("{p}.self_attn.q_proj.weight"), vec![q, h]));
            out.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h]));
            out.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h]));
            out.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
            if self.attention_bias {
                out.push((format!("{p}.self_attn.q_proj.bias"), vec![q]));
                out.push((format!("{p}.self_attn.k_proj.bias"), vec![kv]));
                out.push((format!("{p}.self_attn.v_proj.bias"), vec![kv]));
            }
            if self.qk_norm {
                out.push((format!("{p}.self_attn.q_norm.weight"), vec![self.head_dim]));
                out.push((format!("{p}.self_attn.k_norm.weight"), vec![self.head_dim]));
            }
            out.push((
                format!("{p}.mlp.gate_proj.weight"),
                vec![self.intermediate_size, h],
            ));
            out.push((
                format!("{p}.mlp.up_proj.weight"),
                vec![self.intermediate_size, h],
            ));
            out.push((
                format!("{p}.mlp.down_proj.weight"),
                vec![h, self.intermediate_size],
            ));
        }
        out.sort();
        out
    }

    /// Total number of scalar parameters.
    pub fn num_parameters(&self) -> usize {
        self.parameter_shapes()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_qwen2_qwen3_llama() {
        let qwen2 = r#"{"architectures":["Qwen2ForCausalLM"],"model_type":"qwen2","hidden_size":64,
            "intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,
            "num_key_value_heads":2,"rope_theta":1000000.0,"rms_norm_eps":1e-6,"vocab_size":100,
            "tie_word_embeddings":true,"max_position_embeddings":256,"hidden_act":"silu"}"#;
        let c = ModelConfig::from_hf_json(qwen2).unwrap();
        assert_eq!(c.architecture, Architecture::Qwen2);
        assert_eq!(c.head_dim, 16);
        assert!(c.attention_bias && !c.qk_norm && c.tie_word_embeddings);
        assert_eq!(c.rope_theta, 1e6);

        let qwen3 = r#"{"model_type":"qwen3","hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,
            "vocab_size":100,"attention_bias":false}"#;
        let c = ModelConfig::from_hf_json(qwen3).unwrap();
        assert_eq!(c.architecture, Architecture::Qwen3);
        assert_eq!(c.head_dim, 32);
        assert!(!c.attention_bias && c.qk_norm && !c.tie_word_embeddings);

        let llama = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,
            "intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,
            "vocab_size":100,"rope_scaling":null}"#;
        let c = ModelConfig::from_hf_json(llama).unwrap();
        assert_eq!(c.architecture, Architecture::Llama);
        assert_eq!(c.num_key_value_heads, 4);
        assert!(!c.attention_bias && !c.qk_norm);
        // Llama with q/k/v (and zero o_proj) biases computes as Qwen2 does.
        let biased = llama.replace("\"rope_scaling\":null", "\"attention_bias\":true");
        let c = ModelConfig::from_hf_json(&biased).unwrap();
        assert_eq!(c.architecture, Architecture::Qwen2);
        assert!(c.attention_bias && !c.qk_norm);
    }

    #[test]
    fn reads_transformers_v5_rope_parameters() {
        let v5 = r#"{"model_type":"qwen3","hidden_size":32,"intermediate_size":48,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,
            "vocab_size":64,"rope_parameters":{"rope_theta":1000000.0,"rope_type":"default"},
            "use_sliding_window":false,"sliding_window":null}"#;
        assert_eq!(ModelConfig::from_hf_json(v5).unwrap().rope_theta, 1e6);
        let yarn = v5.replace("\"default\"", "\"yarn\"");
        let e = ModelConfig::from_hf_json(&yarn).unwrap_err().to_string();
        assert!(e.contains("rope_parameters.rope_type"), "{e}");
        let sw = v5.replace(
            "\"use_sliding_window\":false",
            "\"use_sliding_window\":true",
        );
        let e = ModelConfig::from_hf_json(&sw).unwrap_err().to_string();
        assert!(e.contains("use_sliding_window"), "{e}");
    }

    #[test]
    fn errors_name_the_field() {
        let missing = r#"{"model_type":"qwen2","hidden_size":64,"num_hidden_layers":2,
            "num_attention_heads":4,"vocab_size":100}"#;
        let e = ModelConfig::from_hf_json(missing).unwrap_err().to_string();
        assert!(e.contains("intermediate_size"), "{e}");

        let bad_kv = r#"{"model_type":"llama","hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":3,"vocab_size":100}"#;
        let e = ModelConfig::from_hf_json(bad_kv).unwrap_err().to_string();
        assert!(e.contains("num_key_value_heads"), "{e}");

        let bad_type = r#"{"model_type":"gpt2"}"#;
        let e = ModelConfig::from_hf_json(bad_type).unwrap_err().to_string();
        assert!(e.contains("model_type"), "{e}");

        let scaling = r#"{"model_type":"llama","hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"vocab_size":100,
            "rope_scaling":{"type":"llama3"}}"#;
        let e = ModelConfig::from_hf_json(scaling).unwrap_err().to_string();
        assert!(e.contains("rope_scaling"), "{e}");
    }

    #[test]
    fn hf_json_round_trip() {
        for arch in [
            Architecture::Qwen2,
            Architecture::Qwen3,
            Architecture::Llama,
        ] {
            let mut c = ModelConfig::tiny_qwen2(50);
            c.architecture = arch;
            c.attention_bias = arch == Architecture::Qwen2;
            c.qk_norm = arch == Architecture::Qwen3;
            let back = ModelConfig::from_hf_json(&c.to_hf_json().to_string()).unwrap();
            assert_eq!(back, c);
        }
    }
}
