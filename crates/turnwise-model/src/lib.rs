//! # turnwise-model
//!
//! The embedded policy backend: a trainable decoder-only transformer, tokenizers, the batched
//! sampling engine, every policy loss, the critic, the optimizer and checkpoints.
//!
//! Map of the crate:
//! - [`model`]: `ModelConfig` (Hugging Face `config.json`), the differentiable `Transformer`
//!   (Qwen2 / Qwen3 / Llama) with a caller-owned `KvCache`, and `model::weights` (seeded
//!   initialisation on a `VarMap`, loading single-file or sharded safetensors, export);
//! - [`logprobs`]: per-token log-probabilities and entropies over padded batches;
//! - [`optim`]: AdamW, global-norm clipping, gradient accumulation, learning-rate schedules;
//! - [`checkpoint`]: exact-resume checkpoints (weights, optimizer moments, step, RNG states);
//! - [`tokenizer`]: load or train (byte-level BPE, word-level) tokenizers with agent tags;
//! - [`sampling`]: batched, seeded sampling with a KV cache, stop tokens and strings;
//! - [`rng`]: the serialisable generator everything random draws from.
//!
//! A training step and a sample, end to end:
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use turnwise_model::logprobs::logprobs_and_entropy;
//! use turnwise_model::model::weights::{init_varmap, sorted_vars};
//! use turnwise_model::optim::{AdamW, AdamWConfig, Gradients};
//! use turnwise_model::sampling::{SamplingParams, generate};
//! use turnwise_model::{ModelConfig, Transformer};
//!
//! # fn main() -> turnwise_model::Result<()> {
//! let cfg = ModelConfig::tiny_qwen2(64);
//! let varmap = init_varmap(&cfg, DType::F32, &Device::Cpu, 42)?;
//! let policy = Transformer::from_varmap(&cfg, &varmap)?; // records gradients
//! let sampler = Transformer::detached_from_varmap(&cfg, &varmap)?; // no graph, shared storage
//!
//! // One row left-padded by one token: positions restart at its first real token.
//! let ids = Tensor::new(&[[0u32, 5, 6, 7], [1, 2, 3, 4]], &Device::Cpu)?;
//! let pos = Tensor::new(&[[0u32, 0, 1, 2], [0, 1, 2, 3]], &Device::Cpu)?;
//! let mask = Tensor::new(&[[0u32, 1, 1, 1], [1, 1, 1, 1]], &Device::Cpu)?;
//! let targets = Tensor::new(&[[5u32, 6, 7, 8], [2, 3, 4, 9]], &Device::Cpu)?;
//! let (logp, _entropy) = logprobs_and_entropy(&policy, &ids, &pos, &mask, &targets)?;
//! let loss = (logp * mask.to_dtype(DType::F32)?)?.sum_all()?.neg()?;
//!
//! let mut opt = AdamW::new(sorted_vars(&varmap), AdamWConfig::default())?;
//! let mut grads = Gradients::from_grad_store(&loss.backward()?, opt.vars());
//! let grad_norm = grads.clip_global_norm(1.0)?;
//! opt.step(&grads, 1e-3)?; // the sampler sees the new weights
//! assert!(grad_norm > 0.0);
//!
//! let params = SamplingParams { max_new_tokens: 4, ..Default::default() };
//! let out = generate(&sampler, &[vec![1, 2, 3], vec![4]], &[7, 8], &params, None)?;
//! assert_eq!(out[0].tokens.len(), 4);
//! # Ok(())
//! # }
//! ```
//!
//! Performance note: as a library this crate does not choose the global allocator; binaries
//! should set `mimalloc` (about 1.4× faster training on CPU, measured on this project's
//! machine), and should sample with `Transformer::detached_from_varmap`. Binaries should also
//! set `RAYON_NUM_THREADS` before any thread starts: without it candle 0.11.1 re-reads
//! `/proc/cpuinfo` on every CPU matmul to count cores (measured here: sampling the 0.92 M
//! quickstart model at batch 1 went from about 600 to 1,600 tokens/s with the variable set).

#[cfg(test)]
mod bench;
pub mod checkpoint;
#[cfg(test)]
mod cuda_parity;
pub mod device;
pub mod error;
pub mod logprobs;
pub mod loss;
pub mod model;
pub mod optim;
#[cfg(test)]
mod python_check;
pub mod rng;
pub mod sampling;
pub mod tokenizer;

pub use error::{ModelError, Result};
pub use model::{Architecture, KvCache, LoraConfig, LoraDropout, ModelConfig, Transformer};
