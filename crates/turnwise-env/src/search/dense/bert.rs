//! An inference-only BERT encoder in candle, as in Hugging Face's `BertModel` (absolute position
//! embeddings, post-layer-norm blocks, exact GELU), returning the last hidden states.
//!
//! Weights are read from a `model.safetensors` with Hugging Face's names (`embeddings.*`,
//! `encoder.layer.{i}.*`, optionally prefixed with `bert.`). The query, key and value projections
//! of each layer are fused into one matrix product at load time, and every projection runs on the
//! flattened `(batch · seq, hidden)` activations.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{D, DType, Device, Tensor};
use serde::Deserialize;

use super::DenseError;

/// The fields of a Hugging Face BERT `config.json` this encoder uses.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct BertConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Hidden size (the embedding dimension).
    pub hidden_size: usize,
    /// Number of encoder layers.
    pub num_hidden_layers: usize,
    /// Number of attention heads (divides `hidden_size`).
    pub num_attention_heads: usize,
    /// Width of the feed-forward layer.
    pub intermediate_size: usize,
    /// Longest sequence the position embeddings cover.
    pub max_position_embeddings: usize,
    /// Number of token types (segments).
    #[serde(default = "default_type_vocab_size")]
    pub type_vocab_size: usize,
    /// Layer-norm epsilon.
    #[serde(default = "default_layer_norm_eps")]
    pub layer_norm_eps: f64,
    /// Activation of the feed-forward layer; only `"gelu"` (exact, erf-based) is supported.
    #[serde(default = "default_hidden_act")]
    pub hidden_act: String,
    /// Position embedding kind; only `"absolute"` is supported.
    #[serde(default = "default_position_embedding_type")]
    pub position_embedding_type: String,
}

fn default_type_vocab_size() -> usize {
    2
}
fn default_layer_norm_eps() -> f64 {
    1e-12
}
fn default_hidden_act() -> String {
    "gelu".into()
}
fn default_position_embedding_type() -> String {
    "absolute".into()
}

impl BertConfig {
    /// Reads and checks a `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, DenseError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| DenseError::io(path, e))?;
        let config: BertConfig = serde_json::from_str(&text).map_err(|e| DenseError::Model {
            path: path.to_path_buf(),
            message: format!("bad config.json: {e}"),
        })?;
        config.validate().map_err(|message| DenseError::Model {
            path: path.to_path_buf(),
            message,
        })?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), String> {
        if self.hidden_size == 0
            || self.num_attention_heads == 0
            || !self.hidden_size.is_multiple_of(self.num_attention_heads)
        {
            return Err(format!(
                "hidden_size {} is not a positive multiple of num_attention_heads {}",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if self.hidden_act != "gelu" {
            return Err(format!("unsupported hidden_act {:?}", self.hidden_act));
        }
        if self.position_embedding_type != "absolute" {
            return Err(format!(
                "unsupported position_embedding_type {:?}",
                self.position_embedding_type
            ));
        }
        Ok(())
    }
}

/// A dense layer `y = x Wᵀ + b` with `Wᵀ` stored contiguous as `(in, out)`.
#[derive(Debug, Clone)]
struct Linear {
    weight_t: Tensor,
    bias: Tensor,
}

impl Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.matmul(&self.weight_t)?.broadcast_add(&self.bias)
    }
}

#[derive(Debug, Clone)]
struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f32,
}

impl LayerNorm {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        candle_nn::ops::layer_norm(x, &self.weight, &self.bias, self.eps)
    }
}

#[derive(Debug, Clone)]
struct Layer {
    qkv: Linear,
    attn_out: Linear,
    attn_norm: LayerNorm,
    intermediate: Linear,
    output: Linear,
    output_norm: LayerNorm,
}

/// BERT's embeddings and encoder layers, loaded for inference.
#[derive(Debug, Clone)]
pub struct BertModel {
    config: BertConfig,
    word: Tensor,
    position: Tensor,
    token_type0: Tensor,
    emb_norm: LayerNorm,
    layers: Vec<Layer>,
    device: Device,
}

struct Weights<'a> {
    tensors: HashMap<String, Tensor>,
    prefix: &'static str,
    path: &'a Path,
}

impl Weights<'_> {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor, DenseError> {
        let full = format!("{}{name}", self.prefix);
        let t = self.tensors.get(&full).ok_or_else(|| DenseError::Model {
            path: self.path.to_path_buf(),
            message: format!("missing tensor {full}"),
        })?;
        if t.dims() != shape {
            return Err(DenseError::Model {
                path: self.path.to_path_buf(),
                message: format!("tensor {full} has shape {:?}, expected {shape:?}", t.dims()),
            });
        }
        Ok(t.to_dtype(DType::F32)?)
    }

    fn linear(&self, name: &str, out: usize, inp: usize) -> Result<Linear, DenseError> {
        Ok(Linear {
            weight_t: self
                .get(&format!("{name}.weight"), &[out, inp])?
                .t()?
                .contiguous()?,
            bias: self.get(&format!("{name}.bias"), &[out])?,
        })
    }

    fn norm(&self, name: &str, dim: usize, eps: f64) -> Result<LayerNorm, DenseError> {
        Ok(LayerNorm {
            weight: self.get(&format!("{name}.weight"), &[dim])?,
            bias: self.get(&format!("{name}.bias"), &[dim])?,
            eps: eps as f32,
        })
    }
}

impl BertModel {
    /// Loads the weights from a safetensors file onto `device` (as `f32`).
    pub fn load(
        config: BertConfig,
        weights: impl AsRef<Path>,
        device: &Device,
    ) -> Result<Self, DenseError> {
        let path = weights.as_ref();
        let tensors =
            candle_core::safetensors::load(path, device).map_err(|e| DenseError::Model {
                path: path.to_path_buf(),
                message: format!("cannot read safetensors: {e}"),
            })?;
        let prefix = if tensors.contains_key("bert.embeddings.word_embeddings.weight") {
            "bert."
        } else {
            ""
        };
        let w = Weights {
            tensors,
            prefix,
            path,
        };
        let (h, eps) = (config.hidden_size, config.layer_norm_eps);
        let word = w.get("embeddings.word_embeddings.weight", &[config.vocab_size, h])?;
        let position = w.get(
            "embeddings.position_embeddings.weight",
            &[config.max_position_embeddings, h],
        )?;
        let token_type0 = w
            .get(
                "embeddings.token_type_embeddings.weight",
                &[config.type_vocab_size, h],
            )?
            .get(0)?;
        let emb_norm = w.norm("embeddings.LayerNorm", h, eps)?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = format!("encoder.layer.{i}");
            let q = w.linear(&format!("{p}.attention.self.query"), h, h)?;
            let k = w.linear(&format!("{p}.attention.self.key"), h, h)?;
            let v = w.linear(&format!("{p}.attention.self.value"), h, h)?;
            let qkv = Linear {
                weight_t: Tensor::cat(&[&q.weight_t, &k.weight_t, &v.weight_t], 1)?,
                bias: Tensor::cat(&[&q.bias, &k.bias, &v.bias], 0)?,
            };
            layers.push(Layer {
                qkv,
                attn_out: w.linear(&format!("{p}.attention.output.dense"), h, h)?,
                attn_norm: w.norm(&format!("{p}.attention.output.LayerNorm"), h, eps)?,
                intermediate: w.linear(
                    &format!("{p}.intermediate.dense"),
                    config.intermediate_size,
                    h,
                )?,
                output: w.linear(&format!("{p}.output.dense"), h, config.intermediate_size)?,
                output_norm: w.norm(&format!("{p}.output.LayerNorm"), h, eps)?,
            });
        }
        Ok(BertModel {
            config,
            word,
            position,
            token_type0,
            emb_norm,
            layers,
            device: device.clone(),
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &BertConfig {
        &self.config
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Last hidden states `(batch, seq, hidden)` for token ids `(batch, seq)` (`u32`) and an
    /// attention mask `(batch, seq)` (`f32`, 1 for real tokens, 0 for padding). All token types
    /// are 0. `seq` must not exceed `max_position_embeddings`.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let (b, s) = input_ids.dims2()?;
        let h = self.config.hidden_size;
        let heads = self.config.num_attention_heads;
        let hd = h / heads;
        if s > self.config.max_position_embeddings {
            candle_core::bail!(
                "sequence of {s} tokens exceeds max_position_embeddings {}",
                self.config.max_position_embeddings
            );
        }
        let ids = input_ids.flatten_all()?;
        let x = self.word.index_select(&ids, 0)?.reshape((b, s, h))?;
        let pos = self
            .position
            .narrow(0, 0, s)?
            .broadcast_add(&self.token_type0)?;
        let x = x.broadcast_add(&pos)?;
        let mut x = self.emb_norm.forward(&x.reshape((b * s, h))?)?;
        // Additive mask over keys: 0 for tokens, a large negative number for padding.
        let mask = ((attention_mask.to_dtype(DType::F32)? - 1.0)? * 1e30)?.reshape((b, 1, 1, s))?;
        let scale = 1.0 / (hd as f64).sqrt();
        for layer in &self.layers {
            let qkv = layer.qkv.forward(&x)?.reshape((b, s, 3, heads, hd))?;
            let q = (qkv
                .narrow(2, 0, 1)?
                .squeeze(2)?
                .transpose(1, 2)?
                .contiguous()?
                * scale)?;
            let k = qkv
                .narrow(2, 1, 1)?
                .squeeze(2)?
                .transpose(1, 2)?
                .contiguous()?;
            let v = qkv
                .narrow(2, 2, 1)?
                .squeeze(2)?
                .transpose(1, 2)?
                .contiguous()?;
            let scores = q.matmul(&k.t()?)?.broadcast_add(&mask)?;
            let probs = candle_nn::ops::softmax_last_dim(&scores)?;
            let ctx = probs
                .matmul(&v)?
                .transpose(1, 2)?
                .contiguous()?
                .reshape((b * s, h))?;
            let attn = layer.attn_out.forward(&ctx)?;
            x = layer.attn_norm.forward(&(attn + &x)?)?;
            let inter = layer.intermediate.forward(&x)?.gelu_erf()?;
            let out = layer.output.forward(&inter)?;
            x = layer.output_norm.forward(&(out + &x)?)?;
        }
        x.reshape((b, s, h))
    }
}

/// Mean of the hidden states `(batch, seq, hidden)` over the positions where `attention_mask`
/// `(batch, seq)` is 1, then each row scaled to unit L2 norm (norm floored at `1e-12`, as
/// `torch.nn.functional.normalize`). Returns `(batch, hidden)`.
pub fn mean_pool_normalize(
    hidden: &Tensor,
    attention_mask: &Tensor,
) -> candle_core::Result<Tensor> {
    let mask = attention_mask.to_dtype(DType::F32)?.unsqueeze(2)?;
    let summed = hidden.broadcast_mul(&mask)?.sum(1)?;
    let counts = mask.sum(1)?.clamp(1e-9, f64::INFINITY)?;
    let mean = summed.broadcast_div(&counts)?;
    let norm = mean
        .sqr()?
        .sum_keepdim(D::Minus1)?
        .sqrt()?
        .clamp(1e-12, f64::INFINITY)?;
    mean.broadcast_div(&norm)
}
