//! The decoder-only transformer (Qwen2 / Qwen3 / Llama), built only from differentiable ops.
//!
//! RMSNorm, attention (flash-style tiles, no `T × T` scores) and rotate-half RoPE are the fused
//! ops of [`crate::model::ops`], each with a hand-written backward. So every weight receives a gradient
//! when the model is built from `Var`s (see `weights::init_varmap` and
//! [`Transformer::from_varmap`]), and the same struct built from detached tensors
//! ([`Transformer::detached_from_varmap`]) samples without recording a graph.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;

use crate::error::{ModelError, Result};
use crate::model::cache::KvCache;
use crate::model::config::ModelConfig;
use crate::model::lora::{LoraConfig, LoraDropout};
use crate::model::ops;

/// A dense layer `y = x Wᵀ + b` with Hugging Face weight layout `[out, in]`, optionally with a
/// LoRA adapter (`+ s · B A dropout(x)`).
#[derive(Debug, Clone)]
struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
    lora: Option<Adapter>,
}

/// A LoRA adapter on a [`Linear`]: `a: [rank, in]`, `b: [out, rank]`, `scale = alpha / rank`,
/// dropout on its input in training forwards.
#[derive(Debug, Clone)]
struct Adapter {
    a: Tensor,
    b: Tensor,
    scale: f64,
    dropout: Option<LoraDropout>,
}

impl Adapter {
    /// `s · (dropout(x) Aᵀ) Bᵀ` for `x: [rows, in]`.
    fn delta(&self, x: &Tensor) -> Result<Tensor> {
        let x = match &self.dropout {
            Some(d) => d.apply(x)?,
            None => x.clone(),
        };
        // Batch-invariant sampling: both products by the few-row kernel (`gemm`'s sums depend
        // on the number of rows).
        if ops::batch_invariant()
            && let Some(h) = ops::infer::linear(&x, &self.a, usize::MAX)?
            && let Some(y) = ops::infer::linear(&h, &self.b, usize::MAX)?
        {
            return Ok((y * self.scale)?);
        }
        Ok((x.matmul(&self.a.t()?)?.matmul(&self.b.t()?)? * self.scale)?)
    }
}

impl Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(Self::forward_many(&[self], x)?.remove(0))
    }

    /// Several layers on the same input (e.g. q, k and v): when sampling on detached weights,
    /// one pass of the few-row kernel for all of them; otherwise each layer on its own.
    fn forward_many(layers: &[&Self], x: &Tensor) -> Result<Vec<Tensor>> {
        let dims = x.dims().to_vec();
        let (in_dim, lead) = match dims.split_last() {
            Some((last, lead)) => (*last, lead.to_vec()),
            None => {
                return Err(ModelError::invalid_input(
                    "x",
                    "scalar input to a linear layer",
                ));
            }
        };
        let rows: usize = lead.iter().product();
        let x = x.reshape((rows, in_dim))?;
        let weights: Vec<&Tensor> = layers.iter().map(|l| &l.weight).collect();
        // Sampling on detached weights: a few rows by the weight read in place (no packing).
        let ys = match ops::infer::linear_many(&x, &weights, ops::infer::LINEAR_MAX_ROWS)? {
            Some(ys) => ys,
            None => weights
                .iter()
                .map(|w| ops::linear::linear(&x, w))
                .collect::<candle_core::Result<Vec<_>>>()?,
        };
        layers
            .iter()
            .zip(ys)
            .map(|(l, y)| {
                let y = match &l.lora {
                    Some(a) => (y + a.delta(&x)?)?,
                    None => y,
                };
                let y = match &l.bias {
                    Some(b) => y.broadcast_add(b)?,
                    None => y,
                };
                let mut out_shape = lead.clone();
                out_shape.push(l.weight.dim(0)?);
                Ok(y.reshape(out_shape)?)
            })
            .collect()
    }
}

/// RMSNorm over the last dimension: `x / sqrt(mean(x²) + eps) * w` (the fused
/// [`ops::rms_norm`], computed in f32 for half-precision inputs).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(ops::rms_norm(x, weight, eps)?)
}

/// Rotary embedding (rotate-half form) of `x: [B, H, T, D]` (any strides) with
/// `cos, sin: [B, 1, T, D]`; the fused [`ops::rope`]. The result is contiguous.
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    Ok(ops::rope(x, cos, sin)?)
}

/// Which keys the queries of one forward see, for every layer: the rule as data (the fused
/// attention's input) and, only where the composed attention runs, its `[B, 1, T, total]` bias.
struct AttentionMask {
    vis: ops::KeyVisibility,
    /// `None`: the fused kernel runs, and no `T × T` bias is ever built.
    bias: Option<Tensor>,
    /// `Some`: the batch's padded query positions are left out of every position-wise op.
    ragged: Option<Ragged>,
}

/// A padded batch's real positions. The position-wise parts of a layer (norms, projections,
/// the MLP, the residual stream) run on the real positions alone, packed `[1, R, ·]`; only the
/// attention itself runs in the padded `[B, T, ·]` layout (keys, values and the cache).
/// Exact: those parts read no other position, and the padded positions' outputs are never
/// read (attention masks their keys). Saves their share of every projection's work, forward
/// and backward, in a batch of rows of different lengths.
#[derive(Debug, Clone)]
struct Ragged {
    /// Flat indices `row · T + t` of the real positions.
    idx: Tensor,
    batch: usize,
    len: usize,
}

impl Ragged {
    /// The real positions of `vis`'s queries, or `None` when fewer than one in 16 is padding
    /// (the gathers would cost about what they save).
    fn of(vis: &ops::KeyVisibility, device: &Device) -> Result<Option<Self>> {
        let (batch, len) = (vis.batch(), vis.queries());
        let real = vis.real_queries();
        if real.is_empty() || (batch * len - real.len()) * 16 < batch * len {
            return Ok(None);
        }
        let n = real.len();
        Ok(Some(Self {
            idx: Tensor::from_vec(real, n, device)?,
            batch,
            len,
        }))
    }

    /// `[B, T, w]` → the real positions `[1, R, w]`.
    fn gather(&self, y: &Tensor) -> Result<Tensor> {
        let w = y.dim(candle_core::D::Minus1)?;
        let r = self.idx.dim(0)?;
        Ok(y.reshape((self.batch * self.len, w))?
            .index_select(&self.idx, 0)?
            .reshape((1, r, w))?)
    }

    /// The real positions `[1, R, w]` → `[B, T, w]`, zeros at the padded positions.
    fn scatter(&self, y: &Tensor) -> Result<Tensor> {
        let (_, r, w) = y.dims3()?;
        Ok(
            Tensor::zeros((self.batch * self.len, w), y.dtype(), y.device())?
                .index_add(&self.idx, &y.reshape((r, w))?, 0)?
                .reshape((self.batch, self.len, w))?,
        )
    }
}

#[derive(Debug, Clone)]
struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    eps: f64,
}

impl Attention {
    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &AttentionMask,
        cache: Option<(&mut KvCache, usize)>,
    ) -> Result<Tensor> {
        // `x` holds the real positions only under a ragged mask (see `Ragged`).
        let (b, t) = match &mask.ragged {
            Some(r) => (r.batch, r.len),
            None => {
                let (b, t, _) = x.dims3()?;
                (b, t)
            }
        };
        let d = self.head_dim;
        // [B, T, heads·D] → [B, T, heads, D]; the per-head norm runs on this contiguous layout
        // and RoPE reads it transposed to [B, heads, T, D], writing a contiguous result.
        let heads = |y: Tensor, n: usize, norm: &Option<Tensor>| -> Result<Tensor> {
            let y = y.reshape((b, t, n, d))?;
            Ok(match norm {
                Some(w) => rms_norm(&y, w, self.eps)?,
                None => y,
            })
        };
        let [q, k, v]: [Tensor; 3] =
            Linear::forward_many(&[&self.q_proj, &self.k_proj, &self.v_proj], x)?
                .try_into()
                .expect("three projections");
        let [q, k, v] = match &mask.ragged {
            Some(r) => [r.scatter(&q)?, r.scatter(&k)?, r.scatter(&v)?],
            None => [q, k, v],
        };
        let q = heads(q, self.num_heads, &self.q_norm)?;
        let k = heads(k, self.num_kv_heads, &self.k_norm)?;
        let v = v.reshape((b, t, self.num_kv_heads, d))?;
        // The 1/sqrt(D) scale is folded into q (T·D values instead of T·T_total scores).
        let scale = 1.0 / (d as f64).sqrt();
        let q = (apply_rope(&q.transpose(1, 2)?, cos, sin)? * scale)?;
        let k = apply_rope(&k.transpose(1, 2)?, cos, sin)?;
        let v = v.transpose(1, 2)?.contiguous()?;
        let (k, v, shared) = match cache {
            Some((c, layer)) => {
                let (k, v) = c.append(layer, &k, &v)?;
                (k, v, c.shared_keys(layer))
            }
            None => (k, v, Vec::new()),
        };
        // Grouped-query attention without repeating keys and values: the query heads sharing a
        // key head are stacked along the query axis, [B, H, T, D] → [B, KV, G·T, D] (head
        // h = kv·G + g reads key head h / G, as in Hugging Face's repeat_kv).
        let groups = self.num_heads / self.num_kv_heads;
        let q = q.reshape((b, self.num_kv_heads, groups * t, d))?;
        // [B, T, H, D]: the fused tiles (no [B, KV, G·T, T_total] scores), or scores, masked
        // softmax and product.
        let invariant = ops::batch_invariant()
            && q.dtype() == DType::F32
            && q.device().is_cpu()
            && ![&q, &k, &v].iter().any(|x| x.track_op());
        let out = match &mask.bias {
            _ if invariant => ops::invariant::attention(&q, &k, &v, &mask.vis, &shared)?,
            _ if !shared.is_empty() => {
                ops::attention::attention_with_shared(&q, &k, &v, &mask.vis, &shared)?
            }
            None => ops::attention(&q, &k, &v, &mask.vis)?,
            Some(bias) => ops::attention_composed(&q, &k, &v, bias)?,
        };
        let out = out.reshape((b, t, self.num_heads * d))?;
        let out = match &mask.ragged {
            Some(r) => r.gather(&out)?,
            None => out,
        };
        self.o_proj.forward(&out)
    }
}

#[derive(Debug, Clone)]
struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let [g, u]: [Tensor; 2] = Linear::forward_many(&[&self.gate, &self.up], x)?
            .try_into()
            .expect("two projections");
        let h = ops::swiglu(&g, &u)?;
        self.down.forward(&h)
    }
}

#[derive(Debug, Clone)]
struct Layer {
    input_norm: Tensor,
    attn: Attention,
    post_norm: Tensor,
    mlp: Mlp,
}

/// A decoder-only transformer with Hugging Face parameter names.
///
/// The struct only holds tensors: it is as trainable as the tensors it was built from.
#[derive(Debug, Clone)]
pub struct Transformer {
    config: ModelConfig,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Option<Tensor>,
    inv_freq: Vec<f64>,
    /// Run every forward batch-invariant ([`Self::with_batch_invariant`]).
    batch_invariant: bool,
}

impl Transformer {
    /// Builds the model from named tensors (Hugging Face names), checking that every tensor the
    /// config needs is present with the right shape. Extra tensors are ignored. `source_desc`
    /// names where the tensors came from, for error messages.
    pub fn from_tensors(
        config: &ModelConfig,
        tensors: &HashMap<String, Tensor>,
        source_desc: &str,
    ) -> Result<Self> {
        config.validate()?;
        let shapes: HashMap<String, Vec<usize>> = config.parameter_shapes().into_iter().collect();
        let get = |name: &str| -> Result<Tensor> {
            let t = tensors.get(name).ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
                source_desc: source_desc.to_string(),
            })?;
            let expected = &shapes[name];
            if t.dims() != expected.as_slice() {
                return Err(ModelError::ShapeMismatch {
                    name: name.to_string(),
                    expected: expected.clone(),
                    found: t.dims().to_vec(),
                });
            }
            Ok(t.clone())
        };
        let linear = |prefix: &str, bias: bool| -> Result<Linear> {
            Ok(Linear {
                weight: get(&format!("{prefix}.weight"))?,
                bias: if bias {
                    Some(get(&format!("{prefix}.bias"))?)
                } else {
                    None
                },
                lora: None,
            })
        };
        let embed = get("model.embed_tokens.weight")?;
        let dtype = embed.dtype();
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let ab = config.attention_bias;
            let attn = Attention {
                q_proj: linear(&format!("{p}.self_attn.q_proj"), ab)?,
                k_proj: linear(&format!("{p}.self_attn.k_proj"), ab)?,
                v_proj: linear(&format!("{p}.self_attn.v_proj"), ab)?,
                o_proj: linear(&format!("{p}.self_attn.o_proj"), false)?,
                q_norm: if config.qk_norm {
                    Some(get(&format!("{p}.self_attn.q_norm.weight"))?)
                } else {
                    None
                },
                k_norm: if config.qk_norm {
                    Some(get(&format!("{p}.self_attn.k_norm.weight"))?)
                } else {
                    None
                },
                num_heads: config.num_attention_heads,
                num_kv_heads: config.num_key_value_heads,
                head_dim: config.head_dim,
                eps: config.rms_norm_eps,
            };
            layers.push(Layer {
                input_norm: get(&format!("{p}.input_layernorm.weight"))?,
                attn,
                post_norm: get(&format!("{p}.post_attention_layernorm.weight"))?,
                mlp: Mlp {
                    gate: linear(&format!("{p}.mlp.gate_proj"), false)?,
                    up: linear(&format!("{p}.mlp.up_proj"), false)?,
                    down: linear(&format!("{p}.mlp.down_proj"), false)?,
                },
            });
        }
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(get("lm_head.weight")?)
        };
        let model = Self {
            config: config.clone(),
            norm: get("model.norm.weight")?,
            embed,
            layers,
            lm_head,
            batch_invariant: false,
            inv_freq: (0..config.head_dim / 2)
                .map(|i| {
                    1.0 / config
                        .rope_theta
                        .powf(2.0 * i as f64 / config.head_dim as f64)
                })
                .collect(),
        };
        for (name, t) in tensors {
            if shapes.contains_key(name) && t.dtype() != dtype {
                return Err(ModelError::invalid_input(
                    name.clone(),
                    format!(
                        "dtype {:?} differs from the embedding's {:?}",
                        t.dtype(),
                        dtype
                    ),
                ));
            }
        }
        Ok(model)
    }

    /// Builds a trainable model whose tensors are the `Var`s of `varmap` (gradients flow to them).
    pub fn from_varmap(config: &ModelConfig, varmap: &VarMap) -> Result<Self> {
        Self::from_tensors(config, &varmap_tensors(varmap, false), "the VarMap")
    }

    /// Builds a graph-free view of `varmap` for sampling: the tensors share storage with the
    /// `Var`s (no copy, in-place optimizer updates stay visible) but record no graph.
    pub fn detached_from_varmap(config: &ModelConfig, varmap: &VarMap) -> Result<Self> {
        Self::from_tensors(config, &varmap_tensors(varmap, true), "the VarMap")
    }

    /// Puts LoRA adapters on the layers `lora` targets: `adapters` holds every tensor of
    /// [`LoraConfig::adapter_shapes`] (extra tensors are ignored), `dropout` (training forwards
    /// only) applies to the adapters' input. The model is as trainable as the adapters are: build
    /// it from detached base weights and the adapters' `Var`s to train the adapters alone.
    pub fn with_lora(
        mut self,
        lora: &LoraConfig,
        adapters: &HashMap<String, Tensor>,
        dropout: Option<LoraDropout>,
    ) -> Result<Self> {
        lora.validate()?;
        let shapes: HashMap<String, Vec<usize>> =
            lora.adapter_shapes(&self.config).into_iter().collect();
        let dtype = self.dtype();
        let get = |name: String| -> Result<Tensor> {
            let t = adapters
                .get(&name)
                .ok_or_else(|| ModelError::MissingTensor {
                    name: name.clone(),
                    source_desc: "the LoRA adapters".into(),
                })?;
            if t.dims() != shapes[&name].as_slice() {
                return Err(ModelError::ShapeMismatch {
                    expected: shapes[&name].clone(),
                    found: t.dims().to_vec(),
                    name,
                });
            }
            if t.dtype() != dtype {
                return Err(ModelError::invalid_input(
                    name,
                    format!("dtype {:?} differs from the model's {:?}", t.dtype(), dtype),
                ));
            }
            Ok(t.clone())
        };
        let dropout = dropout.filter(|d| d.p() > 0.0);
        for (i, layer) in self.layers.iter_mut().enumerate() {
            let a = &mut layer.attn;
            let m = &mut layer.mlp;
            for (name, block, linear) in [
                ("q_proj", "self_attn", &mut a.q_proj),
                ("k_proj", "self_attn", &mut a.k_proj),
                ("v_proj", "self_attn", &mut a.v_proj),
                ("o_proj", "self_attn", &mut a.o_proj),
                ("gate_proj", "mlp", &mut m.gate),
                ("up_proj", "mlp", &mut m.up),
                ("down_proj", "mlp", &mut m.down),
            ] {
                linear.lora = if lora.targets(name) && lora.transforms_layer(i) {
                    let p = format!("model.layers.{i}.{block}.{name}");
                    Some(Adapter {
                        a: get(format!("{p}.lora_A.weight"))?,
                        b: get(format!("{p}.lora_B.weight"))?,
                        scale: lora.scaling(),
                        dropout: dropout.clone(),
                    })
                } else {
                    None
                };
            }
        }
        Ok(self)
    }

    /// A model whose only trainable tensors are LoRA adapters: the base weights are detached
    /// views of `base` (frozen, shared, no gradient is computed for them) and the adapters the
    /// `Var`s of `adapters` (see [`crate::model::lora::init_adapters`]).
    pub fn lora_from_varmaps(
        config: &ModelConfig,
        base: &VarMap,
        lora: &LoraConfig,
        adapters: &VarMap,
        dropout: Option<LoraDropout>,
    ) -> Result<Self> {
        Self::from_tensors(config, &varmap_tensors(base, true), "the VarMap")?.with_lora(
            lora,
            &varmap_tensors(adapters, false),
            dropout,
        )
    }

    /// The graph-free counterpart of [`Transformer::lora_from_varmaps`] for sampling: base and
    /// adapters are detached views (no copy; optimizer updates of the adapters stay visible), and
    /// there is no dropout.
    pub fn lora_detached_from_varmaps(
        config: &ModelConfig,
        base: &VarMap,
        lora: &LoraConfig,
        adapters: &VarMap,
    ) -> Result<Self> {
        Self::from_tensors(config, &varmap_tensors(base, true), "the VarMap")?.with_lora(
            lora,
            &varmap_tensors(adapters, true),
            None,
        )
    }

    /// Whether any layer carries a LoRA adapter.
    pub fn has_lora(&self) -> bool {
        self.linears().any(|x| x.lora.is_some())
    }

    /// Whether a training forward draws LoRA dropout masks. Their stream is one sequence (a
    /// shared call counter), so forwards that run concurrently would draw in an order that
    /// depends on thread timing: such a model must run its training forwards one at a time.
    pub fn draws_dropout(&self) -> bool {
        self.linears()
            .any(|x| x.lora.as_ref().is_some_and(|a| a.dropout.is_some()))
    }

    /// Every linear layer of the decoder layers.
    fn linears(&self) -> impl Iterator<Item = &Linear> {
        self.layers.iter().flat_map(|l| {
            [
                &l.attn.q_proj,
                &l.attn.k_proj,
                &l.attn.v_proj,
                &l.attn.o_proj,
                &l.mlp.gate,
                &l.mlp.up,
                &l.mlp.down,
            ]
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        self.embed.device()
    }

    /// The weights' dtype.
    pub fn dtype(&self) -> DType {
        self.embed.dtype()
    }

    /// Whether a forward pass records an autograd graph (built from `Var`s or from tensors
    /// that are themselves results of tracked ops, base weights or LoRA adapters).
    pub fn tracks_gradients(&self) -> bool {
        self.embed.track_op()
            || self
                .linears()
                .any(|x| x.lora.as_ref().is_some_and(|a| a.a.track_op()))
    }

    /// Logits `[B, T, V]` for token ids `ids: [B, T]`.
    ///
    /// * `positions: [B, T]` — rotary position of every token, per row (for a left-padded row,
    ///   its first real token has position 0); any integer or float dtype.
    /// * `key_mask: [B, T_total]` — 1 for real tokens, 0 for padding, over the cached tokens
    ///   followed by the new ones (`T_total = cache.seq_len() + T`); any dtype.
    /// * `cache` — the caller's [`KvCache`]; the new keys and values are appended to it.
    pub fn forward(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        key_mask: &Tensor,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let h = self.forward_hidden(ids, positions, key_mask, cache)?;
        self.logits(&h)
    }

    /// Logits `[T, V]` of one unpadded sequence `ids` (positions `0..T`, no cache): what a
    /// reference implementation's forward of the same ids gives.
    pub fn forward_sequence(&self, ids: &[u32]) -> Result<Tensor> {
        let n = ids.len();
        let device = self.device();
        let t = |v: Vec<u32>| Tensor::from_vec(v, (1, n), device);
        let logits = self.forward(
            &t(ids.to_vec())?,
            &t((0..n as u32).collect())?,
            &t(vec![1; n])?,
            None,
        )?;
        Ok(logits.squeeze(0)?)
    }

    /// Final hidden states `[B, T, hidden]` (after the last norm); see [`Transformer::forward`].
    pub fn forward_hidden(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        key_mask: &Tensor,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let on = self.batch_invariant || ops::batch_invariant();
        ops::with_batch_invariant(on, || {
            self.forward_hidden_inner(ids, positions, key_mask, cache)
        })
    }

    fn forward_hidden_inner(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        key_mask: &Tensor,
        mut cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let (b, t) = ids.dims2().map_err(|_| {
            ModelError::invalid_input("ids", format!("expected [B, T], got {:?}", ids.dims()))
        })?;
        if positions.dims() != [b, t] {
            return Err(ModelError::invalid_input(
                "positions",
                format!("expected [{b}, {t}], got {:?}", positions.dims()),
            ));
        }
        let past = match cache.as_deref() {
            Some(c) => {
                if c.num_layers() != self.layers.len() {
                    return Err(ModelError::invalid_input(
                        "cache",
                        format!(
                            "built for {} layers, model has {}",
                            c.num_layers(),
                            self.layers.len()
                        ),
                    ));
                }
                if let Some(cb) = c.batch_size()
                    && cb != b
                {
                    return Err(ModelError::invalid_input(
                        "cache",
                        format!("holds {cb} rows, ids has {b}"),
                    ));
                }
                c.seq_len()
            }
            None => 0,
        };
        let total = past + t;
        if key_mask.dims() != [b, total] {
            return Err(ModelError::invalid_input(
                "key_mask",
                format!(
                    "expected [B, cached + T] = [{b}, {total}], got {:?}",
                    key_mask.dims()
                ),
            ));
        }
        let device = self.device().clone();
        let dtype = self.dtype();
        let (cos, sin) = self.rope_tables(positions, &device, dtype)?;
        let vis = ops::KeyVisibility::new(key_mask, past)?;
        let bias = if ops::attention::fused_attention_wanted(&device, dtype) {
            None
        } else {
            Some(vis.bias(dtype, &device)?)
        };
        // LoRA dropout draws its masks per padded row and position: such a model runs padded.
        let ragged = if self.draws_dropout() {
            None
        } else {
            Ragged::of(&vis, &device)?
        };
        let ids_flat = ids.flatten_all()?.to_dtype(DType::U32)?;
        let h = self.config.hidden_size;
        let mut x = match &ragged {
            Some(r) => self
                .embed
                .index_select(&ids_flat.index_select(&r.idx, 0)?, 0)?
                .reshape((1, r.idx.dim(0)?, h))?,
            None => self.embed.index_select(&ids_flat, 0)?.reshape((b, t, h))?,
        };
        let mask = AttentionMask { vis, bias, ragged };
        let eps = self.config.rms_norm_eps;
        for (i, layer) in self.layers.iter().enumerate() {
            let slot = cache.as_deref_mut().map(|c| (c, i));
            let h = rms_norm(&x, &layer.input_norm, eps)?;
            let a = layer.attn.forward(&h, &cos, &sin, &mask, slot)?;
            x = (x + a)?;
            let h = rms_norm(&x, &layer.post_norm, eps)?;
            x = (&x + layer.mlp.forward(&h)?)?;
        }
        let out = rms_norm(&x, &self.norm, eps)?;
        match &mask.ragged {
            Some(r) => r.scatter(&out),
            None => Ok(out),
        }
    }

    /// This model (sharing its tensors) with every detached forward batch-invariant when `on`
    /// ([`ops::with_batch_invariant`]): [`Self::forward_hidden`] and [`Self::logits`] give each
    /// position the same bits whatever else the batch holds, on whichever thread they run (the
    /// sampling shards of a rollout, for one). Forwards that track gradients are unaffected.
    pub fn with_batch_invariant(mut self, on: bool) -> Self {
        self.batch_invariant = on;
        self
    }

    /// Whether [`Self::with_batch_invariant`] turned batch-invariant forwards on.
    pub fn is_batch_invariant(&self) -> bool {
        self.batch_invariant
    }

    /// Projects hidden states `[.., hidden]` to vocabulary logits `[.., V]`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let on = self.batch_invariant || ops::batch_invariant();
        ops::with_batch_invariant(on, || self.logits_inner(hidden))
    }

    fn logits_inner(&self, hidden: &Tensor) -> Result<Tensor> {
        let w = self.lm_head.as_ref().unwrap_or(&self.embed);
        Linear {
            weight: w.clone(),
            bias: None,
            lora: None,
        }
        .forward(hidden)
    }

    /// The output projection `[V, hidden]`: `lm_head.weight`, or the embedding when tied.
    pub fn head_weight(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Log-probabilities of `targets` and entropies of `softmax(scale · logits)`, where the
    /// logits are [`Self::logits`] of `hidden: [.., hidden]` and `targets` has `hidden`'s leading
    /// dims. On `f32`/`f64` CPU tensors whose logits would be large
    /// ([`super::ops::head::fused_head_wanted`]) this is the fused output head
    /// ([`super::ops::head_logprobs_entropy`]: chunks of the vocabulary, the logits never
    /// materialised, forward or backward); otherwise the logits, then
    /// [`super::ops::token_logprobs_entropy`].
    pub fn head_logprobs_entropy(
        &self,
        hidden: &Tensor,
        targets: &Tensor,
        scale: f64,
    ) -> Result<(Tensor, Tensor)> {
        let w = self.head_weight();
        let rows = hidden.elem_count() / self.config.hidden_size.max(1);
        let fused = super::ops::fused_on(hidden.device())
            && matches!(hidden.dtype(), DType::F32 | DType::F64)
            && w.dtype() == hidden.dtype()
            && super::ops::head::fused_head_wanted(rows, w.dims2()?.0);
        if fused {
            return Ok(super::ops::head_logprobs_entropy(
                hidden, w, targets, scale,
            )?);
        }
        let logits = self.logits(hidden)?;
        let logits = if scale == 1.0 {
            logits
        } else {
            logits.affine(scale, 0.0)?
        };
        Ok(super::ops::token_logprobs_entropy(&logits, targets)?)
    }

    /// [`Self::head_logprobs_entropy`] at the positions `keep` marks only (one flag per entry of
    /// `targets`, row-major): the output head and the log-softmax run on those positions alone,
    /// and both outputs are 0 elsewhere (with no gradient there). Equal to
    /// [`Self::head_logprobs_entropy`] at the kept positions; a pass whose observation tokens
    /// and padding need no log-prob saves their share of the head's forward and backward.
    pub fn head_logprobs_entropy_at(
        &self,
        hidden: &Tensor,
        targets: &Tensor,
        scale: f64,
        keep: &[bool],
    ) -> Result<(Tensor, Tensor)> {
        let n = targets.elem_count();
        if keep.len() != n {
            return Err(ModelError::invalid_input(
                "keep",
                format!(
                    "{} flags for {n} target positions ({:?})",
                    keep.len(),
                    targets.dims()
                ),
            ));
        }
        if keep.iter().all(|&k| k) {
            return self.head_logprobs_entropy(hidden, targets, scale);
        }
        let h = self.config.hidden_size;
        if hidden.elem_count() != n * h {
            return Err(ModelError::invalid_input(
                "hidden",
                format!(
                    "expected {:?} × {h} hidden states, got {:?}",
                    targets.dims(),
                    hidden.dims()
                ),
            ));
        }
        let device = hidden.device();
        let dims = targets.dims().to_vec();
        let mut idx: Vec<u32> = (0..n as u32).filter(|&i| keep[i as usize]).collect();
        // Nothing kept: the head runs on one position, for the outputs' dtype (f32 for a half
        // model), and both come out 0.
        let none = idx.is_empty();
        if none {
            idx.push(0);
        }
        let k = idx.len();
        let sel = Tensor::from_vec(idx, k, device)?;
        let hk = hidden
            .reshape((n, h))?
            .index_select(&sel, 0)?
            .reshape((1, k, h))?;
        let tk = targets
            .flatten_all()?
            .index_select(&sel, 0)?
            .reshape((1, k))?;
        let (lp, ent) = self.head_logprobs_entropy(&hk, &tk, scale)?;
        if none {
            let z = Tensor::zeros(dims, lp.dtype(), device)?;
            return Ok((z.clone(), z));
        }
        let back = |t: Tensor| -> Result<Tensor> {
            Ok(Tensor::zeros(n, t.dtype(), device)?
                .index_add(&sel, &t.flatten_all()?, 0)?
                .reshape(dims.as_slice())?)
        };
        Ok((back(lp)?, back(ent)?))
    }

    /// `cos, sin: [B, 1, T, head_dim]` for per-row positions.
    fn rope_tables(
        &self,
        positions: &Tensor,
        device: &Device,
        dtype: DType,
    ) -> Result<(Tensor, Tensor)> {
        let pos = positions.to_dtype(DType::F64)?.to_vec2::<f64>()?;
        let (b, t) = (pos.len(), pos.first().map_or(0, Vec::len));
        let d = self.config.head_dim;
        let half = d / 2;
        let mut cos = Vec::with_capacity(b * t * d);
        let mut sin = Vec::with_capacity(b * t * d);
        for row in &pos {
            for &p in row {
                // The two halves repeat the same frequencies (rotate-half layout).
                for _ in 0..2 {
                    for &f in &self.inv_freq[..half] {
                        let a = p * f;
                        cos.push(a.cos());
                        sin.push(a.sin());
                    }
                }
            }
        }
        let mk = |v: Vec<f64>| -> Result<Tensor> {
            Ok(Tensor::from_vec(v, (b, 1, t, d), device)?.to_dtype(dtype)?)
        };
        Ok((mk(cos)?, mk(sin)?))
    }
}

/// The tensors of `varmap` by name, live (graph-tracked) or detached.
pub fn varmap_tensors(varmap: &VarMap, detach: bool) -> HashMap<String, Tensor> {
    let data = varmap.data().lock().unwrap_or_else(|e| e.into_inner());
    data.iter()
        .map(|(k, v)| {
            let t = if detach {
                v.as_detached_tensor()
            } else {
                v.as_tensor().clone()
            };
            (k.clone(), t)
        })
        .collect()
}
