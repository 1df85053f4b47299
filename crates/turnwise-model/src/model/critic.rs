//! The critic (value model) for PPO-style estimators: the policy's transformer trunk with a
//! linear value head, laid out like Hugging Face's `*ForTokenClassification` with one label
//! (what verl's critic loads): `score.weight: [1, hidden]` and an optional `score.bias: [1]`.
//!
//! The trunk never needs `lm_head.weight`: it is built with tied embeddings and only its final
//! hidden states are used, so a critic made from an untied policy simply leaves the policy's
//! head out.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;

use crate::error::{ModelError, Result};
use crate::logprobs::{SharedRow, shared_prefix_hidden};
use crate::model::config::ModelConfig;
use crate::model::transformer::{Transformer, varmap_tensors};
use crate::model::weights::{init_varmap, varmap_from_tensors};
use crate::rng::TurnRng;

/// Hugging Face name of the value head's weight, `[1, hidden]`.
pub const SCORE_WEIGHT: &str = "score.weight";
/// Hugging Face name of the value head's bias, `[1]`.
pub const SCORE_BIAS: &str = "score.bias";

/// Mixed into the seed of the value head so that it does not repeat the trunk's draws.
const HEAD_SEED_SALT: u64 = 0x5C0E_4EAD_0000_0001;

/// The configuration the critic's trunk is built with: `config` with tied embeddings (the
/// trunk has no language-model head).
pub fn trunk_config(config: &ModelConfig) -> ModelConfig {
    let mut c = config.clone();
    c.tie_word_embeddings = true;
    c
}

/// A fresh critic `VarMap`: the trunk initialised like [`init_varmap`] from `seed`, plus the
/// value head (weight ~ N(0, `initializer_range`²), bias 0).
pub fn init_critic_varmap(
    config: &ModelConfig,
    dtype: DType,
    device: &Device,
    seed: u64,
) -> Result<VarMap> {
    let varmap = init_varmap(&trunk_config(config), dtype, device, seed)?;
    add_value_head(&varmap, config, seed)?;
    Ok(varmap)
}

/// A critic `VarMap` whose trunk is a copy of a policy's weights (`policy`: named tensors, e.g.
/// `varmap_tensors(&policy_varmap, true)` or loaded safetensors) and whose value head is fresh,
/// seeded by `seed`. The copy is independent of the policy: training one leaves the other alone.
pub fn critic_varmap_from_policy(
    config: &ModelConfig,
    policy: &HashMap<String, Tensor>,
    seed: u64,
) -> Result<VarMap> {
    let varmap = varmap_from_tensors(&trunk_config(config), policy, "the policy weights")?;
    add_value_head(&varmap, config, seed)?;
    Ok(varmap)
}

/// Adds a fresh value head (`score.weight`, `score.bias`) to `varmap`, in the dtype and on the
/// device of its embedding. Fails if the head is already there.
pub fn add_value_head(varmap: &VarMap, config: &ModelConfig, seed: u64) -> Result<()> {
    let mut data = varmap.data().lock().unwrap_or_else(|e| e.into_inner());
    if data.contains_key(SCORE_WEIGHT) {
        return Err(ModelError::invalid_input(
            "varmap",
            "already holds a value head (`score.weight`)",
        ));
    }
    let embed = data
        .get("model.embed_tokens.weight")
        .ok_or_else(|| ModelError::MissingTensor {
            name: "model.embed_tokens.weight".into(),
            source_desc: "the critic VarMap".into(),
        })?;
    let (dtype, device) = (embed.dtype(), embed.device().clone());
    let mut rng = TurnRng::seed_from_u64(seed ^ HEAD_SEED_SALT);
    let h = config.hidden_size;
    let w: Vec<f64> = (0..h)
        .map(|_| rng.normal() * config.initializer_range)
        .collect();
    let w = Tensor::from_vec(w, (1, h), &device)?.to_dtype(dtype)?;
    let b = Tensor::zeros(1, dtype, &device)?;
    data.insert(SCORE_WEIGHT.to_string(), Var::from_tensor(&w)?);
    data.insert(SCORE_BIAS.to_string(), Var::from_tensor(&b)?);
    Ok(())
}

/// A value model: transformer trunk and linear value head.
#[derive(Debug, Clone)]
pub struct Critic {
    trunk: Transformer,
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Critic {
    /// Builds the critic from named tensors (Hugging Face names): the trunk's tensors,
    /// `score.weight: [1, hidden]` and, if present, `score.bias: [1]`. `lm_head.weight` is not
    /// needed and ignored.
    pub fn from_tensors(
        config: &ModelConfig,
        tensors: &HashMap<String, Tensor>,
        source_desc: &str,
    ) -> Result<Self> {
        let trunk = Transformer::from_tensors(&trunk_config(config), tensors, source_desc)?;
        let h = config.hidden_size;
        let weight = tensors
            .get(SCORE_WEIGHT)
            .ok_or_else(|| ModelError::MissingTensor {
                name: SCORE_WEIGHT.into(),
                source_desc: source_desc.into(),
            })?
            .clone();
        if weight.dims() != [1, h] {
            return Err(ModelError::ShapeMismatch {
                name: SCORE_WEIGHT.into(),
                expected: vec![1, h],
                found: weight.dims().to_vec(),
            });
        }
        let bias = tensors.get(SCORE_BIAS).cloned();
        if let Some(b) = &bias
            && b.dims() != [1]
        {
            return Err(ModelError::ShapeMismatch {
                name: SCORE_BIAS.into(),
                expected: vec![1],
                found: b.dims().to_vec(),
            });
        }
        for (name, t) in [(SCORE_WEIGHT, Some(&weight)), (SCORE_BIAS, bias.as_ref())] {
            if let Some(t) = t
                && t.dtype() != trunk.dtype()
            {
                return Err(ModelError::invalid_input(
                    name,
                    format!(
                        "dtype {:?} differs from the trunk's {:?}",
                        t.dtype(),
                        trunk.dtype()
                    ),
                ));
            }
        }
        Ok(Self {
            trunk,
            weight,
            bias,
        })
    }

    /// A trainable critic over the `Var`s of `varmap` (see [`init_critic_varmap`]).
    pub fn from_varmap(config: &ModelConfig, varmap: &VarMap) -> Result<Self> {
        Self::from_tensors(config, &varmap_tensors(varmap, false), "the critic VarMap")
    }

    /// A graph-free view of `varmap` for computing values during rollouts.
    pub fn detached_from_varmap(config: &ModelConfig, varmap: &VarMap) -> Result<Self> {
        Self::from_tensors(config, &varmap_tensors(varmap, true), "the critic VarMap")
    }

    /// The trunk (a tied-embedding transformer whose logits are meaningless; use its hidden
    /// states).
    pub fn trunk(&self) -> &Transformer {
        &self.trunk
    }

    /// The configuration the trunk was built with (see [`trunk_config`]).
    pub fn config(&self) -> &ModelConfig {
        self.trunk.config()
    }

    /// Per-token values `[B, T]` (in the weights' dtype) for a padded batch: `ids`,
    /// `positions` and `key_mask` as in [`Transformer::forward`] (no cache). Positions whose
    /// `key_mask` is 0 get value 0, so they contribute nothing to a loss or its gradient.
    pub fn values(&self, ids: &Tensor, positions: &Tensor, key_mask: &Tensor) -> Result<Tensor> {
        let hidden = self.trunk.forward_hidden(ids, positions, key_mask, None)?;
        let v = self.value_head(&hidden)?;
        let (b, t) = v.dims2()?;
        let mask = key_mask.to_dtype(v.dtype())?;
        if mask.dims() != [b, t] {
            return Err(ModelError::invalid_input(
                "key_mask",
                format!("expected [{b}, {t}], got {:?}", mask.dims()),
            ));
        }
        Ok((v * mask)?)
    }

    /// The value head on final hidden states `[B, T, hidden]` of the trunk: values `[B, T]`
    /// (in the weights' dtype).
    pub fn value_head(&self, hidden: &Tensor) -> Result<Tensor> {
        let (b, t, h) = hidden.dims3()?;
        let v = hidden.reshape((b * t, h))?.matmul(&self.weight.t()?)?;
        let v = match &self.bias {
            Some(bias) => v.broadcast_add(bias)?,
            None => v,
        };
        Ok(v.reshape((b, t))?)
    }

    /// Values `[n, width]` of the states at each row's positions `from..from + len` (entries
    /// past a row's `len` are finite and meaningless), for rows in groups whose first
    /// `prefix_lens[g]` tokens are the same: each group's prefix runs through the trunk
    /// (forward and backward) once ([`crate::logprobs::shared_prefix_hidden`]). Equal to
    /// [`Critic::values`] at those positions to rounding.
    pub fn shared_prefix_values(
        &self,
        prefix_lens: &[usize],
        rows: &[SharedRow<'_>],
        width: usize,
    ) -> Result<Tensor> {
        let (hidden, _) = shared_prefix_hidden(&self.trunk, prefix_lens, rows, width)?;
        self.value_head(&hidden)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::weights::init_varmap;

    fn batch() -> (Tensor, Tensor, Tensor) {
        let d = &Device::Cpu;
        // Row 0 is left-padded by two tokens.
        let ids = Tensor::new(&[[0u32, 0, 5, 6, 7], [1, 2, 3, 4, 9]], d).unwrap();
        let pos = Tensor::new(&[[0u32, 0, 0, 1, 2], [0, 1, 2, 3, 4]], d).unwrap();
        let mask = Tensor::new(&[[0u32, 0, 1, 1, 1], [1, 1, 1, 1, 1]], d).unwrap();
        (ids, pos, mask)
    }

    fn cfg() -> ModelConfig {
        let mut c = ModelConfig::tiny_qwen2(64);
        c.initializer_range = 0.2;
        c
    }

    #[test]
    fn values_have_batch_shape_and_ignore_padding() {
        let cfg = cfg();
        let vm = init_critic_varmap(&cfg, DType::F64, &Device::Cpu, 3).unwrap();
        let critic = Critic::detached_from_varmap(&cfg, &vm).unwrap();
        let (ids, pos, mask) = batch();
        let v = critic.values(&ids, &pos, &mask).unwrap();
        assert_eq!(v.dims(), &[2, 5]);
        let rows = v.to_vec2::<f64>().unwrap();
        assert_eq!(&rows[0][..2], &[0.0, 0.0]);
        assert!(rows[1].iter().all(|x| *x != 0.0));
        // Different tokens under the padding change nothing.
        let ids2 = Tensor::new(&[[9u32, 8, 5, 6, 7], [1, 2, 3, 4, 9]], &Device::Cpu).unwrap();
        let v2 = critic.values(&ids2, &pos, &mask).unwrap();
        assert_eq!(v2.to_vec2::<f64>().unwrap(), rows);
        // The padded row equals the same sequence alone.
        let alone = critic
            .values(
                &Tensor::new(&[[5u32, 6, 7]], &Device::Cpu).unwrap(),
                &Tensor::new(&[[0u32, 1, 2]], &Device::Cpu).unwrap(),
                &Tensor::new(&[[1u32, 1, 1]], &Device::Cpu).unwrap(),
            )
            .unwrap()
            .to_vec2::<f64>()
            .unwrap();
        for (a, b) in alone[0].iter().zip(&rows[0][2..]) {
            assert!((a - b).abs() < 1e-9, "{a} vs {b}");
        }
        // Masked key dims must match.
        let bad = Tensor::new(&[[1u32, 1], [1, 1]], &Device::Cpu).unwrap();
        assert!(critic.values(&ids, &pos, &bad).is_err());
    }

    #[test]
    fn gradients_reach_the_head_and_the_trunk() {
        let cfg = cfg();
        let vm = init_critic_varmap(&cfg, DType::F32, &Device::Cpu, 4).unwrap();
        let critic = Critic::from_varmap(&cfg, &vm).unwrap();
        let (ids, pos, mask) = batch();
        let v = critic.values(&ids, &pos, &mask).unwrap();
        let target = Tensor::ones((2, 5), DType::F32, &Device::Cpu).unwrap();
        let loss = (v - target).unwrap().sqr().unwrap().sum_all().unwrap();
        let grads = loss.backward().unwrap();
        let data = vm.data().lock().unwrap();
        let mut missing = Vec::new();
        for (name, var) in data.iter() {
            match grads.get(var.as_tensor()) {
                Some(g) => {
                    let n = g
                        .sqr()
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .to_scalar::<f32>()
                        .unwrap();
                    if n == 0.0 {
                        missing.push(name.clone());
                    }
                }
                None => missing.push(name.clone()),
            }
        }
        assert!(missing.is_empty(), "no gradient for {missing:?}");
        assert!(data.contains_key(SCORE_WEIGHT) && data.contains_key(SCORE_BIAS));
        assert!(!data.contains_key("lm_head.weight"));
    }

    #[test]
    fn builds_from_a_policy_and_checks_shapes() {
        let mut cfg = cfg();
        cfg.tie_word_embeddings = false;
        let policy = init_varmap(&cfg, DType::F32, &Device::Cpu, 5).unwrap();
        let tensors = varmap_tensors(&policy, true);
        let vm = critic_varmap_from_policy(&cfg, &tensors, 6).unwrap();
        let critic = Critic::from_varmap(&cfg, &vm).unwrap();
        // The trunk is the policy's: same final hidden states (both through the trainable,
        // graph-recording path, so the same kernels run on both sides).
        let pol = Transformer::from_varmap(&cfg, &policy).unwrap();
        let (ids, pos, mask) = batch();
        let a = pol.forward_hidden(&ids, &pos, &mask, None).unwrap();
        let b = critic
            .trunk()
            .forward_hidden(&ids, &pos, &mask, None)
            .unwrap();
        let diff = (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert_eq!(diff, 0.0);
        // An independent copy: changing the critic leaves the policy alone.
        let data = vm.data().lock().unwrap();
        let e = &data["model.embed_tokens.weight"];
        e.set(&e.zeros_like().unwrap()).unwrap();
        let pol_e = tensors["model.embed_tokens.weight"]
            .abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(pol_e > 0.0);
        drop(data);
        assert!(add_value_head(&vm, &cfg, 1).is_err());

        // Missing or mis-shaped head.
        let mut t = varmap_tensors(&vm, true);
        t.insert(
            SCORE_WEIGHT.into(),
            Tensor::zeros((2, cfg.hidden_size), DType::F32, &Device::Cpu).unwrap(),
        );
        let err = Critic::from_tensors(&cfg, &t, "test").unwrap_err();
        assert!(err.to_string().contains(SCORE_WEIGHT), "{err}");
        t.remove(SCORE_WEIGHT);
        let err = Critic::from_tensors(&cfg, &t, "test").unwrap_err();
        assert!(err.to_string().contains("missing tensor"), "{err}");
        // Without a bias the head still works.
        let mut t = varmap_tensors(&vm, true);
        t.remove(SCORE_BIAS);
        let c = Critic::from_tensors(&cfg, &t, "test").unwrap();
        assert_eq!(c.values(&ids, &pos, &mask).unwrap().dims(), &[2, 5]);
    }
}
