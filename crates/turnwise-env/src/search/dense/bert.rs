//! An inference-only BERT encoder on the CPU, as Hugging Face's `BertModel` (absolute position
//! embeddings, post-layer-norm blocks, exact GELU) followed by sentence-transformers' mean
//! pooling and L2 normalisation, in one fused `f32` pass per group of sequences.
//!
//! Weights are read from a `model.safetensors` with Hugging Face's names (`embeddings.*`,
//! `encoder.layer.{i}.*`, optionally prefixed with `bert.`) and packed once at load time for the
//! [`kernels`](super::kernels) matrix product: each layer's query, key and value projections as
//! one `(hidden, 3·hidden)` matrix with the attention scale `1/√head_dim` folded into the query
//! columns, the others as they are, every bias fused into its product.
//!
//! Sequences are never padded: a group's tokens are the rows of one `(tokens, hidden)` matrix,
//! every projection runs over all of them, and attention runs per sequence and head over that
//! sequence's own keys only (which is what an additive padding mask computes). A forward pass
//! splits its sequences into one group per thread (balanced by their cost), and each group runs
//! all layers on its thread with single-threaded kernels and its own buffers, so the threads
//! never wait on each other within the pass. Per layer and group: `qkv = x·Wqkv + b`; per
//! sequence and head `softmax(q·kᵀ)·v`; `x = LayerNorm(x + ctx·Wo + b)`;
//! `x = LayerNorm(x + GELU(x·Wi + b)·Wout + b)`.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde::Deserialize;

use super::DenseError;
use super::kernels::{self, Epilogue, Packed};

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

/// The tensors of a `model.safetensors`, looked up by Hugging Face name (with or without the
/// `bert.` prefix) and checked for shape.
pub(crate) struct Weights<'a> {
    tensors: HashMap<String, Tensor>,
    prefix: &'static str,
    path: &'a Path,
}

impl<'a> Weights<'a> {
    /// Reads a safetensors file.
    pub(crate) fn read(path: &'a Path) -> Result<Self, DenseError> {
        let tensors =
            candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| DenseError::Model {
                path: path.to_path_buf(),
                message: format!("cannot read safetensors: {e}"),
            })?;
        Ok(Self::from_tensors(tensors, path))
    }

    /// Tensors already in memory (`path` names them in errors).
    pub(crate) fn from_tensors(tensors: HashMap<String, Tensor>, path: &'a Path) -> Self {
        let prefix = if tensors.contains_key("bert.embeddings.word_embeddings.weight") {
            "bert."
        } else {
            ""
        };
        Weights {
            tensors,
            prefix,
            path,
        }
    }

    /// The tensor `name` as `f32`, which must have `shape`.
    pub(crate) fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor, DenseError> {
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

    /// The tensor `name` as row-major `f32` values.
    fn values(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, DenseError> {
        Ok(self.tensor(name, shape)?.flatten_all()?.to_vec1::<f32>()?)
    }

    /// `(weight [out, inp], bias [out])` of a dense layer.
    fn dense(
        &self,
        name: &str,
        out: usize,
        inp: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), DenseError> {
        Ok((
            self.values(&format!("{name}.weight"), &[out, inp])?,
            self.values(&format!("{name}.bias"), &[out])?,
        ))
    }

    fn linear(&self, name: &str, out: usize, inp: usize) -> Result<Packed, DenseError> {
        let (w, b) = self.dense(name, out, inp)?;
        Ok(Packed::from_weight(&w, out, inp, Some(&b), 1.0))
    }

    fn norm(&self, name: &str, dim: usize, eps: f64) -> Result<Norm, DenseError> {
        Ok(Norm {
            gamma: self.values(&format!("{name}.weight"), &[dim])?,
            beta: self.values(&format!("{name}.bias"), &[dim])?,
            eps: eps as f32,
        })
    }
}

/// LayerNorm's scale, shift and epsilon.
#[derive(Debug, Clone)]
struct Norm {
    gamma: Vec<f32>,
    beta: Vec<f32>,
    eps: f32,
}

#[derive(Debug, Clone)]
struct Layer {
    /// Query (pre-scaled), key and value projections: `(hidden, 3·hidden)`.
    qkv: Packed,
    attn_out: Packed,
    attn_norm: Norm,
    intermediate: Packed,
    output: Packed,
    output_norm: Norm,
}

/// BERT's embeddings and encoder layers, packed for the fused CPU forward pass.
#[derive(Debug, Clone)]
pub struct BertModel {
    config: BertConfig,
    /// `(vocab, hidden)`.
    word: Vec<f32>,
    /// Position embedding plus token type 0: `(max_positions, hidden)`.
    position_type0: Vec<f32>,
    emb_norm: Norm,
    layers: Vec<Layer>,
}

/// A thread's buffers for [`BertModel::forward_group`], kept between calls (so a forward pass
/// allocates nothing once its thread has seen a group as large): at most
/// [`MAX_GROUP_ROWS`] × `(4·hidden + intermediate)` floats plus one head's scores.
#[derive(Default)]
struct Scratch {
    /// Hidden states `(rows, hidden)`.
    x: Vec<f32>,
    /// `(rows, 3·hidden)`.
    qkv: Vec<f32>,
    /// Attention output `(rows, hidden)`.
    ctx: Vec<f32>,
    /// Each sub-layer's projection `(rows, hidden)`.
    tmp: Vec<f32>,
    /// `(rows, intermediate)`.
    inter: Vec<f32>,
    /// One head's `(seq, seq)` attention scores.
    scores: Vec<f32>,
    keys: Option<Packed>,
    values: Option<Packed>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// A group's rows (tokens) are kept at about this many or fewer (a longer sequence is a group
/// of its own): the buffers stay a few MB per thread, and the weights, streamed once per group
/// and layer, are still read about 500 times per load.
const MAX_GROUP_ROWS: usize = 512;

/// `v[..n]`, growing `v` first when it is shorter.
fn prefix(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

impl BertModel {
    /// Loads the weights from a safetensors file.
    pub fn load(config: BertConfig, weights: impl AsRef<Path>) -> Result<Self, DenseError> {
        Self::from_weights(config, &Weights::read(weights.as_ref())?)
    }

    pub(crate) fn from_weights(config: BertConfig, w: &Weights<'_>) -> Result<Self, DenseError> {
        let (h, eps) = (config.hidden_size, config.layer_norm_eps);
        let inter = config.intermediate_size;
        let hd = h / config.num_attention_heads;
        let word = w.values("embeddings.word_embeddings.weight", &[config.vocab_size, h])?;
        let mut position_type0 = w.values(
            "embeddings.position_embeddings.weight",
            &[config.max_position_embeddings, h],
        )?;
        let types = w.values(
            "embeddings.token_type_embeddings.weight",
            &[config.type_vocab_size, h],
        )?;
        if types.len() < h {
            return Err(DenseError::Model {
                path: w.path.to_path_buf(),
                message: "no token type embeddings".into(),
            });
        }
        for row in position_type0.chunks_exact_mut(h) {
            for (p, &t) in row.iter_mut().zip(&types[..h]) {
                *p += t;
            }
        }
        let emb_norm = w.norm("embeddings.LayerNorm", h, eps)?;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = format!("encoder.layer.{i}");
            let mut weight = Vec::with_capacity(3 * h * h);
            let mut bias = Vec::with_capacity(3 * h);
            for (part, s) in [("query", scale), ("key", 1.0), ("value", 1.0)] {
                let (pw, pb) = w.dense(&format!("{p}.attention.self.{part}"), h, h)?;
                weight.extend(pw.iter().map(|v| v * s));
                bias.extend(pb.iter().map(|v| v * s));
            }
            layers.push(Layer {
                qkv: Packed::from_weight(&weight, 3 * h, h, Some(&bias), 1.0),
                attn_out: w.linear(&format!("{p}.attention.output.dense"), h, h)?,
                attn_norm: w.norm(&format!("{p}.attention.output.LayerNorm"), h, eps)?,
                intermediate: w.linear(&format!("{p}.intermediate.dense"), inter, h)?,
                output: w.linear(&format!("{p}.output.dense"), h, inter)?,
                output_norm: w.norm(&format!("{p}.output.LayerNorm"), h, eps)?,
            });
        }
        Ok(BertModel {
            config,
            word,
            position_type0,
            emb_norm,
            layers,
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &BertConfig {
        &self.config
    }

    /// Mean-pooled, unit-norm embeddings `(seqs.len(), hidden)`, row-major, of token-id
    /// sequences (all token types 0). Each sequence must be at most `max_position_embeddings`
    /// long and hold ids below `vocab_size`; an empty sequence embeds as zeros (as a fully
    /// masked row does in sentence-transformers). The sequences are split into one group per
    /// rayon thread (see the module docs).
    pub fn embed(&self, seqs: &[&[u32]]) -> Result<Vec<f32>, DenseError> {
        self.embed_with(seqs, rayon::current_num_threads(), true)
    }

    /// [`Self::embed`] for `threads` threads (a multiple of `threads` groups of at most about
    /// [`MAX_GROUP_ROWS`] tokens), on the AVX2 kernels when `simd` (and the CPU has them), else
    /// on the portable ones.
    pub(crate) fn embed_with(
        &self,
        seqs: &[&[u32]],
        threads: usize,
        simd: bool,
    ) -> Result<Vec<f32>, DenseError> {
        self.check(seqs)?;
        let h = self.config.hidden_size;
        let threads = threads.max(1);
        let rows: usize = seqs.iter().map(|s| s.len()).sum();
        let groups = rows.div_ceil(MAX_GROUP_ROWS * threads).max(1) * threads;
        let ranges = split_groups(seqs, groups, 2 * h + self.config.intermediate_size);
        let parts: Vec<Vec<f32>> = if ranges.len() <= 1 {
            vec![self.group_embeddings(seqs, simd)]
        } else {
            use rayon::prelude::*;
            ranges
                .par_iter()
                .map(|r| self.group_embeddings(&seqs[r.clone()], simd))
                .collect()
        };
        Ok(parts.concat())
    }

    /// The last hidden states of every sequence's tokens, row after row, in one group.
    #[cfg(test)]
    pub(crate) fn hidden_rows(&self, seqs: &[&[u32]], simd: bool) -> Result<Vec<f32>, DenseError> {
        self.check(seqs)?;
        let rows: usize = seqs.iter().map(|s| s.len()).sum();
        let mut sc = Scratch::default();
        self.forward_group(seqs, simd, &mut sc);
        Ok(sc.x[..rows * self.config.hidden_size].to_vec())
    }

    fn check(&self, seqs: &[&[u32]]) -> Result<(), DenseError> {
        let c = &self.config;
        for seq in seqs {
            if seq.len() > c.max_position_embeddings {
                return Err(candle_core::Error::Msg(format!(
                    "sequence of {} tokens exceeds max_position_embeddings {}",
                    seq.len(),
                    c.max_position_embeddings
                ))
                .into());
            }
            if let Some(&id) = seq.iter().find(|&&id| id as usize >= c.vocab_size) {
                return Err(candle_core::Error::Msg(format!(
                    "token id {id} is outside the vocabulary of {}",
                    c.vocab_size
                ))
                .into());
            }
        }
        Ok(())
    }

    /// [`Self::forward_group`], then each sequence's mean over its tokens, scaled to unit L2
    /// norm (floored at `1e-12`, as `torch.nn.functional.normalize`).
    fn group_embeddings(&self, seqs: &[&[u32]], simd: bool) -> Vec<f32> {
        let h = self.config.hidden_size;
        let mut out = vec![0f32; seqs.len() * h];
        SCRATCH.with_borrow_mut(|sc| {
            self.forward_group(seqs, simd, sc);
            pool_normalize(seqs, &sc.x, h, &mut out);
        });
        out
    }
}

/// Each sequence's mean of its rows of `x` (`(tokens, h)`, the sequences' rows in order),
/// scaled to unit L2 norm (floored at `1e-12`), into the rows of `out`; empty sequences leave
/// their row at zero.
fn pool_normalize(seqs: &[&[u32]], x: &[f32], h: usize, out: &mut [f32]) {
    let mut row = 0;
    for (seq, dst) in seqs.iter().zip(out.chunks_exact_mut(h)) {
        let s = seq.len();
        if s == 0 {
            continue;
        }
        for xr in x[row * h..(row + s) * h].chunks_exact(h) {
            for (d, &v) in dst.iter_mut().zip(xr) {
                *d += v;
            }
        }
        row += s;
        let inv_count = 1.0 / s as f32;
        for d in dst.iter_mut() {
            *d *= inv_count;
        }
        let norm = dst.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
        for d in dst.iter_mut() {
            *d /= norm;
        }
    }
}

impl BertModel {
    /// The last hidden states `(tokens, hidden)` of the sequences' tokens into `sc.x`, on this
    /// thread.
    fn forward_group(&self, seqs: &[&[u32]], simd: bool, sc: &mut Scratch) {
        let c = &self.config;
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let heads = c.num_attention_heads;
        let hd = h / heads;
        let rows: usize = seqs.iter().map(|s| s.len()).sum();
        let longest = seqs.iter().map(|s| s.len()).max().unwrap_or(0);
        let x = prefix(&mut sc.x, rows * h);
        let qkv_all = prefix(&mut sc.qkv, rows * 3 * h);
        let ctx = prefix(&mut sc.ctx, rows * h);
        let tmp = prefix(&mut sc.tmp, rows * h);
        let inter_buf = prefix(&mut sc.inter, rows * inter);
        let scores_buf = prefix(&mut sc.scores, longest * longest);
        let keys = sc.keys.get_or_insert_with(Packed::empty);
        let values = sc.values.get_or_insert_with(Packed::empty);
        // Embeddings: word + position + token type 0, then LayerNorm.
        let mut r = 0;
        for seq in seqs {
            for (t, &id) in seq.iter().enumerate() {
                let id = id as usize;
                x[r * h..(r + 1) * h].copy_from_slice(&self.word[id * h..(id + 1) * h]);
                tmp[r * h..(r + 1) * h].copy_from_slice(&self.position_type0[t * h..(t + 1) * h]);
                r += 1;
            }
        }
        let n = &self.emb_norm;
        kernels::add_layer_norm(x, tmp, &n.gamma, &n.beta, n.eps, simd);
        for layer in &self.layers {
            kernels::matmul(x, h, rows, &layer.qkv, qkv_all, 3 * h, Epilogue::None, simd);
            let mut r0 = 0;
            for seq in seqs {
                let s = seq.len();
                if s == 0 {
                    continue;
                }
                let qkv = &qkv_all[r0 * 3 * h..(r0 + s) * 3 * h];
                for head in 0..heads {
                    let (q0, k0, v0) = (head * hd, h + head * hd, 2 * h + head * hd);
                    // scores = q·kᵀ (q pre-scaled), softmax over each sequence's own keys.
                    keys.repack_transposed(&qkv[k0..], s, hd, 3 * h);
                    let scores = &mut scores_buf[..s * s];
                    kernels::matmul(&qkv[q0..], 3 * h, s, keys, scores, s, Epilogue::None, simd);
                    for row in scores.chunks_exact_mut(s) {
                        kernels::softmax(row, simd);
                    }
                    // ctx[:, head] = probs·v.
                    values.repack_rows(&qkv[v0..], s, hd, 3 * h);
                    kernels::matmul(
                        scores,
                        s,
                        s,
                        values,
                        &mut ctx[r0 * h + head * hd..],
                        h,
                        Epilogue::None,
                        simd,
                    );
                }
                r0 += s;
            }
            kernels::matmul(ctx, h, rows, &layer.attn_out, tmp, h, Epilogue::None, simd);
            let n = &layer.attn_norm;
            kernels::add_layer_norm(x, tmp, &n.gamma, &n.beta, n.eps, simd);
            kernels::matmul(
                x,
                h,
                rows,
                &layer.intermediate,
                inter_buf,
                inter,
                Epilogue::Gelu,
                simd,
            );
            kernels::matmul(
                inter_buf,
                inter,
                rows,
                &layer.output,
                tmp,
                h,
                Epilogue::None,
                simd,
            );
            let n = &layer.output_norm;
            kernels::add_layer_norm(x, tmp, &n.gamma, &n.beta, n.eps, simd);
        }
    }
}

/// Splits `seqs` (in order) into at most `groups` contiguous non-empty ranges of about equal
/// cost (fewer when one sequence outweighs several shares): a
/// sequence of `s` tokens costs `s · (width + s)`: per token and layer the projections take
/// `2·hidden·width` multiply-adds (`width` = 2·hidden + intermediate) and attention `2·hidden·s`.
fn split_groups(seqs: &[&[u32]], groups: usize, width: usize) -> Vec<std::ops::Range<usize>> {
    let cost = |s: &&[u32]| (s.len() * (width + s.len())) as f64;
    let total: f64 = seqs.iter().map(cost).sum();
    let groups = groups.clamp(1, seqs.len().max(1));
    let mut ranges = Vec::with_capacity(groups);
    let (mut start, mut acc) = (0, 0.0);
    for (i, s) in seqs.iter().enumerate() {
        let c = cost(s);
        let g = ranges.len() + 1;
        let target = total * g as f64 / groups as f64;
        // Cut before this sequence when that lands nearer the group's share than after it.
        if g < groups && i > start && acc + c > target && acc + c - target > target - acc {
            ranges.push(start..i);
            start = i;
        }
        acc += c;
        let g = ranges.len() + 1;
        if g < groups && acc >= total * g as f64 / groups as f64 {
            ranges.push(start..i + 1);
            start = i + 1;
        }
    }
    if start < seqs.len() || ranges.is_empty() {
        ranges.push(start..seqs.len());
    }
    ranges
}

#[cfg(test)]
mod tests {
    use super::super::reference::ReferenceBert;
    use super::*;
    use crate::world::rng::SplitMix64;

    fn config(hidden: usize, heads: usize, intermediate: usize, layers: usize) -> BertConfig {
        BertConfig {
            vocab_size: 50,
            hidden_size: hidden,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            intermediate_size: intermediate,
            max_position_embeddings: 40,
            type_vocab_size: 2,
            layer_norm_eps: 1e-12,
            hidden_act: "gelu".into(),
            position_embedding_type: "absolute".into(),
        }
    }

    /// Random weights under Hugging Face's names (LayerNorm scales near 1).
    fn random_tensors(c: &BertConfig, seed: u64) -> HashMap<String, Tensor> {
        let mut rng = SplitMix64::new(seed);
        let mut out = HashMap::new();
        let mut put = |name: String, shape: &[usize], center: f32, spread: f32| {
            let n: usize = shape.iter().product();
            let v: Vec<f32> = (0..n)
                .map(|_| center + spread * (2.0 * rng.unit() as f32 - 1.0))
                .collect();
            out.insert(name, Tensor::from_vec(v, shape, &Device::Cpu).unwrap());
        };
        let (h, i) = (c.hidden_size, c.intermediate_size);
        put(
            "embeddings.word_embeddings.weight".into(),
            &[c.vocab_size, h],
            0.0,
            1.0,
        );
        let pos = "embeddings.position_embeddings.weight";
        put(pos.into(), &[c.max_position_embeddings, h], 0.0, 0.5);
        let types = "embeddings.token_type_embeddings.weight";
        put(types.into(), &[c.type_vocab_size, h], 0.0, 0.5);
        let mut norms = vec!["embeddings.LayerNorm".to_string()];
        for l in 0..c.num_hidden_layers {
            let p = format!("encoder.layer.{l}");
            let mut dense = |name: String, out: usize, inp: usize| {
                let spread = 2.0 / (inp as f32).sqrt();
                put(format!("{name}.weight"), &[out, inp], 0.0, spread);
                put(format!("{name}.bias"), &[out], 0.0, 0.3);
            };
            for part in ["query", "key", "value"] {
                dense(format!("{p}.attention.self.{part}"), h, h);
            }
            dense(format!("{p}.attention.output.dense"), h, h);
            dense(format!("{p}.intermediate.dense"), i, h);
            dense(format!("{p}.output.dense"), h, i);
            norms.push(format!("{p}.attention.output.LayerNorm"));
            norms.push(format!("{p}.output.LayerNorm"));
        }
        for name in norms {
            put(format!("{name}.weight"), &[h], 1.0, 0.2);
            put(format!("{name}.bias"), &[h], 0.0, 0.2);
        }
        out
    }

    fn models(c: &BertConfig, seed: u64) -> (BertModel, ReferenceBert) {
        let path = Path::new("random.safetensors");
        let w = Weights::from_tensors(random_tensors(c, seed), path);
        (
            BertModel::from_weights(c.clone(), &w).unwrap(),
            ReferenceBert::from_weights(c, &w).unwrap(),
        )
    }

    fn sequences(c: &BertConfig, lens: &[usize], seed: u64) -> Vec<Vec<u32>> {
        let mut rng = SplitMix64::new(seed);
        lens.iter()
            .map(|&n| (0..n).map(|_| rng.below(c.vocab_size) as u32).collect())
            .collect()
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    }

    /// The fused forward pass against the candle composition it replaced, on shapes that leave
    /// partial panels and vector tails everywhere (hidden 44, head 11, intermediate 400 with
    /// two blocks of `k`) and on whole ones (hidden 64, head 32), portable and AVX2 kernels, one
    /// group and several.
    #[test]
    fn dense_fused_bert_matches_candle_composition() {
        for (c, seed) in [(config(44, 4, 400, 2), 1), (config(64, 2, 128, 3), 2)] {
            let (fused, reference) = models(&c, seed);
            let owned = sequences(&c, &[13, 1, 40, 2, 7, 30, 5], seed + 10);
            let seqs: Vec<&[u32]> = owned.iter().map(Vec::as_slice).collect();
            let want_hidden = reference.hidden_rows(&seqs).unwrap();
            let want = reference.embed(&seqs).unwrap();
            for simd in [false, true] {
                let hidden = fused.hidden_rows(&seqs, simd).unwrap();
                let d = max_diff(&hidden, &want_hidden);
                assert!(d < 2e-5, "hidden {} simd {simd}: {d}", c.hidden_size);
                for threads in [1, 3, 20] {
                    let got = fused.embed_with(&seqs, threads, simd).unwrap();
                    let d = max_diff(&got, &want);
                    assert!(
                        d < 5e-6,
                        "embeddings {} simd {simd} threads {threads}: {d}",
                        c.hidden_size
                    );
                }
            }
        }
    }

    #[test]
    fn dense_fused_bert_checks_inputs_and_embeds_empty_as_zeros() {
        let c = config(44, 4, 64, 1);
        let (fused, _) = models(&c, 3);
        let long = vec![1u32; c.max_position_embeddings + 1];
        assert!(fused.embed(&[&long]).is_err());
        assert!(fused.embed(&[&[1, 50]]).is_err());
        assert!(fused.embed(&[]).unwrap().is_empty());
        let out = fused.embed(&[&[], &[3, 4]]).unwrap();
        assert!(out[..44].iter().all(|&v| v == 0.0));
        let norm: f32 = out[44..].iter().map(|v| v * v).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-6);
    }

    #[test]
    fn dense_groups_cover_in_order_and_balance_cost() {
        let owned: Vec<Vec<u32>> = [200, 150, 120, 100, 80, 60, 40, 30, 20, 10]
            .iter()
            .map(|&n| vec![0; n])
            .collect();
        let seqs: Vec<&[u32]> = owned.iter().map(Vec::as_slice).collect();
        for groups in [1, 2, 3, 4, 10, 50] {
            let ranges = split_groups(&seqs, groups, 1000);
            assert_eq!(ranges.len(), groups.min(seqs.len()));
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges.last().unwrap().end, seqs.len());
            assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
            assert!(ranges.iter().all(|r| !r.is_empty()));
        }
        let cost = |r: &std::ops::Range<usize>| -> usize {
            seqs[r.clone()]
                .iter()
                .map(|s| s.len() * (1000 + s.len()))
                .sum()
        };
        let two = split_groups(&seqs, 2, 1000);
        let (a, b) = (cost(&two[0]) as f64, cost(&two[1]) as f64);
        assert!((a / b - 1.0).abs() < 0.4, "{a} vs {b}");
        assert_eq!(split_groups(&[], 2, 1000), vec![0..0]);
    }

    /// The fused model against the candle composition on all-MiniLM-L6-v2 itself.
    #[test]
    fn dense_fused_minilm_matches_candle_composition() {
        let dir = super::super::model::model_dir(crate::corpus::wiki::default_cache_dir())
            .expect("all-MiniLM-L6-v2 in the turnwise cache");
        let config = BertConfig::from_file(dir.join("config.json")).unwrap();
        let path = dir.join("model.safetensors");
        let w = Weights::read(&path).unwrap();
        let fused = BertModel::from_weights(config.clone(), &w).unwrap();
        let reference = ReferenceBert::from_weights(&config, &w).unwrap();
        let owned: Vec<Vec<u32>> = vec![
            vec![101, 2073, 2001, 1062, 2953, 3567, 2243, 2141, 1029, 102],
            [101]
                .into_iter()
                .chain((0..120).map(|i| 1000 + 37 * i))
                .chain([102])
                .collect(),
            vec![101, 102],
        ];
        let seqs: Vec<&[u32]> = owned.iter().map(Vec::as_slice).collect();
        let want = reference.embed(&seqs).unwrap();
        for simd in [false, true] {
            let got = fused.embed_with(&seqs, 2, simd).unwrap();
            let d = max_diff(&got, &want);
            assert!(d < 2e-6, "simd {simd}: {d}");
        }
    }
}
