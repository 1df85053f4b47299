//! The encoder as it was before the fused kernels: BERT composed of candle ops (as Hugging
//! Face's `BertModel`: absolute position embeddings, post-layer-norm blocks, exact GELU), then
//! mean pooling and L2 normalisation. Kept only as the tests' reference for
//! [`super::bert::BertModel`].

use candle_core::{D, DType, Tensor};

use super::DenseError;
use super::bert::{BertConfig, Weights};

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

/// BERT's embeddings and encoder layers as candle tensors.
#[derive(Debug, Clone)]
pub struct ReferenceBert {
    config: BertConfig,
    word: Tensor,
    position: Tensor,
    token_type0: Tensor,
    emb_norm: LayerNorm,
    layers: Vec<Layer>,
}

impl ReferenceBert {
    /// The model from the same tensors as the fused [`super::bert::BertModel`].
    pub fn from_weights(config: &BertConfig, w: &Weights<'_>) -> Result<Self, DenseError> {
        let (h, eps) = (config.hidden_size, config.layer_norm_eps);
        let linear = |name: &str, out: usize, inp: usize| -> Result<Linear, DenseError> {
            Ok(Linear {
                weight_t: w
                    .tensor(&format!("{name}.weight"), &[out, inp])?
                    .t()?
                    .contiguous()?,
                bias: w.tensor(&format!("{name}.bias"), &[out])?,
            })
        };
        let norm = |name: &str| -> Result<LayerNorm, DenseError> {
            Ok(LayerNorm {
                weight: w.tensor(&format!("{name}.weight"), &[h])?,
                bias: w.tensor(&format!("{name}.bias"), &[h])?,
                eps: eps as f32,
            })
        };
        let word = w.tensor("embeddings.word_embeddings.weight", &[config.vocab_size, h])?;
        let position = w.tensor(
            "embeddings.position_embeddings.weight",
            &[config.max_position_embeddings, h],
        )?;
        let token_type0 = w
            .tensor(
                "embeddings.token_type_embeddings.weight",
                &[config.type_vocab_size, h],
            )?
            .get(0)?;
        let emb_norm = norm("embeddings.LayerNorm")?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = format!("encoder.layer.{i}");
            let q = linear(&format!("{p}.attention.self.query"), h, h)?;
            let k = linear(&format!("{p}.attention.self.key"), h, h)?;
            let v = linear(&format!("{p}.attention.self.value"), h, h)?;
            let qkv = Linear {
                weight_t: Tensor::cat(&[&q.weight_t, &k.weight_t, &v.weight_t], 1)?,
                bias: Tensor::cat(&[&q.bias, &k.bias, &v.bias], 0)?,
            };
            layers.push(Layer {
                qkv,
                attn_out: linear(&format!("{p}.attention.output.dense"), h, h)?,
                attn_norm: norm(&format!("{p}.attention.output.LayerNorm"))?,
                intermediate: linear(
                    &format!("{p}.intermediate.dense"),
                    config.intermediate_size,
                    h,
                )?,
                output: linear(&format!("{p}.output.dense"), h, config.intermediate_size)?,
                output_norm: norm(&format!("{p}.output.LayerNorm"))?,
            });
        }
        Ok(ReferenceBert {
            config: config.clone(),
            word,
            position,
            token_type0,
            emb_norm,
            layers,
        })
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

impl ReferenceBert {
    /// Pads `seqs` to the longest and runs [`Self::forward`]: the hidden states `(batch, seq,
    /// hidden)` and the mask.
    fn padded(&self, seqs: &[&[u32]]) -> candle_core::Result<(Tensor, Tensor, usize)> {
        let b = seqs.len();
        let s = seqs.iter().map(|x| x.len()).max().unwrap_or(0).max(1);
        let mut ids = vec![0u32; b * s];
        let mut mask = vec![0f32; b * s];
        for (r, seq) in seqs.iter().enumerate() {
            ids[r * s..r * s + seq.len()].copy_from_slice(seq);
            mask[r * s..r * s + seq.len()].fill(1.0);
        }
        let device = candle_core::Device::Cpu;
        let ids = Tensor::from_vec(ids, (b, s), &device)?;
        let mask = Tensor::from_vec(mask, (b, s), &device)?;
        Ok((self.forward(&ids, &mask)?, mask, s))
    }

    /// The hidden states of every sequence's tokens, row after row (padding dropped).
    pub fn hidden_rows(&self, seqs: &[&[u32]]) -> candle_core::Result<Vec<f32>> {
        let (hidden, _, s) = self.padded(seqs)?;
        let h = self.config.hidden_size;
        let all = hidden.flatten_all()?.to_vec1::<f32>()?;
        let mut out = Vec::new();
        for (r, seq) in seqs.iter().enumerate() {
            out.extend_from_slice(&all[r * s * h..(r * s + seq.len()) * h]);
        }
        Ok(out)
    }

    /// Mean-pooled, unit-norm embeddings of `seqs` in one padded batch, row after row.
    pub fn embed(&self, seqs: &[&[u32]]) -> candle_core::Result<Vec<f32>> {
        let (hidden, mask, _) = self.padded(seqs)?;
        mean_pool_normalize(&hidden, &mask)?
            .flatten_all()?
            .to_vec1::<f32>()
    }
}
