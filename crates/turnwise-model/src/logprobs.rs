//! Per-token log-probabilities and entropies, differentiable with respect to every weight.

use candle_core::{D, Tensor};

use crate::error::{ModelError, Result};
use crate::model::Transformer;

/// `log_softmax` over the last dimension, from basic differentiable ops. The row maximum is
/// subtracted detached: it cancels mathematically, so the gradient is exact.
pub fn log_softmax(logits: &Tensor) -> Result<Tensor> {
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let z = logits.broadcast_sub(&max)?;
    let lse = z.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok(z.broadcast_sub(&lse)?)
}

/// Log-probability of `targets` and entropy of the distribution, from logits `[B, T, V]`.
/// `targets: [B, T]` (any integer dtype). Returns `(logp [B, T], entropy [B, T])`.
pub fn token_logprobs_and_entropy(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    let (b, t, _v) = logits.dims3()?;
    if targets.dims() != [b, t] {
        return Err(ModelError::invalid_input(
            "targets",
            format!("expected [{b}, {t}], got {:?}", targets.dims()),
        ));
    }
    // One fused pass over the logits forward and one backward (see `model::ops::logprob`).
    Ok(crate::model::ops::token_logprobs_entropy(logits, targets)?)
}

/// Runs `model` over a padded batch and returns, per position, the log-probability of
/// `targets` and the entropy of the next-token distribution: `(logp [B, T], entropy [B, T])`.
///
/// `input_ids`, `positions`, `targets: [B, T]`; `key_mask: [B, T]` (1 = real token). Usually
/// `targets[b, t] = input_ids[b, t + 1]`; values at padded or unused positions are meaningless
/// and are to be masked by the caller. Differentiable when `model` was built from `Var`s.
pub fn logprobs_and_entropy(
    model: &Transformer,
    input_ids: &Tensor,
    positions: &Tensor,
    key_mask: &Tensor,
    targets: &Tensor,
) -> Result<(Tensor, Tensor)> {
    logprobs_and_entropy_with_temperature(model, input_ids, positions, key_mask, targets, 1.0)
}

/// [`logprobs_and_entropy`] under a sampling temperature: the log-probabilities and entropies
/// of `softmax(logits / temperature)`, the distribution `sampling::generate` draws from (and
/// reports) at that temperature. `temperature` must be positive.
pub fn logprobs_and_entropy_with_temperature(
    model: &Transformer,
    input_ids: &Tensor,
    positions: &Tensor,
    key_mask: &Tensor,
    targets: &Tensor,
    temperature: f64,
) -> Result<(Tensor, Tensor)> {
    if !(temperature > 0.0 && temperature.is_finite()) {
        return Err(ModelError::invalid_input(
            "temperature",
            format!("{temperature} is not a positive number"),
        ));
    }
    let (b, t) = input_ids.dims2()?;
    if targets.dims() != [b, t] {
        return Err(ModelError::invalid_input(
            "targets",
            format!("expected [{b}, {t}], got {:?}", targets.dims()),
        ));
    }
    // The output head fused with the log-softmax (see `Transformer::head_logprobs_entropy`):
    // the [B, T, V] logits are never materialised on the CPU.
    let hidden = model.forward_hidden(input_ids, positions, key_mask, None)?;
    model.head_logprobs_entropy(&hidden, targets, 1.0 / temperature)
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use super::*;
    use crate::model::ModelConfig;
    use crate::model::tests::{max_abs_diff as max_abs, model_for, tiny_configs};
    use crate::model::weights::sorted_vars;

    fn batch() -> (Tensor, Tensor, Tensor, Tensor) {
        let dev = Device::Cpu;
        // Row 0 left-padded by 2.
        let ids = Tensor::new(&[[0u32, 0, 7, 3, 19, 4], [5, 11, 2, 8, 60, 1]], &dev).unwrap();
        let pos = Tensor::new(&[[0u32, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]], &dev).unwrap();
        let mask = Tensor::new(&[[0u32, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], &dev).unwrap();
        let targets = Tensor::new(&[[0u32, 7, 3, 19, 4, 9], [11, 2, 8, 60, 1, 30]], &dev).unwrap();
        (ids, pos, mask, targets)
    }

    /// A scalar objective mixing log-probs and entropies over real positions only.
    fn objective(model: &Transformer) -> Tensor {
        let (ids, pos, mask, targets) = batch();
        let (logp, ent) = logprobs_and_entropy(model, &ids, &pos, &mask, &targets).unwrap();
        mix(&logp, &ent)
    }

    /// [`objective`]'s mix of the batch's log-probs and entropies.
    fn mix(logp: &Tensor, ent: &Tensor) -> Tensor {
        let (_, _, mask, _) = batch();
        let m = mask.to_dtype(logp.dtype()).unwrap();
        let weights = Tensor::new(
            &[
                [0.0, 0.0, 1.0, -0.5, 0.7, 1.3],
                [0.4, 1.1, -0.9, 0.6, 0.2, 0.8],
            ],
            &Device::Cpu,
        )
        .unwrap()
        .to_dtype(logp.dtype())
        .unwrap();
        let a = (logp * &weights).unwrap();
        let b = (ent * 0.3).unwrap();
        ((a + b).unwrap() * m).unwrap().sum_all().unwrap()
    }

    /// The fused output head on a model's own final hidden states and head weight (tied to the
    /// embedding or not), at temperature 0.8: the log-probs, the entropies and every weight's
    /// gradient equal those of the materialised head the model uses at this size.
    #[test]
    fn fused_head_matches_the_materialised_head_on_a_model() {
        for cfg in tiny_configs() {
            let (vm, model) = model_for(&cfg, DType::F64, 6);
            let (ids, pos, mask, targets) = batch();
            let h = model.forward_hidden(&ids, &pos, &mask, None).unwrap();
            let (lp, ent) = crate::model::ops::head_logprobs_entropy(
                &h,
                model.head_weight(),
                &targets,
                1.0 / 0.8,
            )
            .unwrap();
            let (lp0, ent0) =
                logprobs_and_entropy_with_temperature(&model, &ids, &pos, &mask, &targets, 0.8)
                    .unwrap();
            assert!(max_abs(&lp, &lp0) < 1e-10 && max_abs(&ent, &ent0) < 1e-10);
            let g = mix(&lp, &ent).backward().unwrap();
            let g0 = mix(&lp0, &ent0).backward().unwrap();
            for (name, var) in sorted_vars(&vm) {
                let (a, b) = (g.get(var.as_tensor()), g0.get(var.as_tensor()));
                let (a, b) = (a.expect(&name), b.expect(&name));
                assert!(max_abs(a, b) < 1e-10, "{name}: {}", max_abs(a, b));
            }
        }
    }

    #[test]
    fn logprobs_match_softmax_and_entropy_is_bounded() {
        let cfg = ModelConfig::tiny_qwen2(96);
        let (_vm, model) = model_for(&cfg, DType::F64, 4);
        let (ids, pos, mask, targets) = batch();
        let (logp, ent) = logprobs_and_entropy(&model, &ids, &pos, &mask, &targets).unwrap();
        let logits = model.forward(&ids, &pos, &mask, None).unwrap();
        let l = logits.to_vec3::<f64>().unwrap();
        let lp = logp.to_vec2::<f64>().unwrap();
        let en = ent.to_vec2::<f64>().unwrap();
        let tg = targets.to_vec2::<u32>().unwrap();
        for b in 0..2 {
            for t in 0..6 {
                let row = &l[b][t];
                let z: f64 = row.iter().map(|x| x.exp()).sum();
                let p: Vec<f64> = row.iter().map(|x| x.exp() / z).collect();
                assert!((lp[b][t] - p[tg[b][t] as usize].ln()).abs() < 1e-10);
                let h: f64 = -p.iter().map(|q| q * q.ln()).sum::<f64>();
                assert!((en[b][t] - h).abs() < 1e-10);
                assert!(h > 0.0 && h <= (96f64).ln() + 1e-12);
            }
        }
    }

    /// Autograd against central finite differences on several parameters of a tiny f64 model.
    #[test]
    fn gradients_match_finite_differences() {
        for cfg in tiny_configs() {
            let (vm, model) = model_for(&cfg, DType::F64, 5);
            let grads = objective(&model).backward().unwrap();
            let vars = sorted_vars(&vm);
            let mut names = vec![
                "model.embed_tokens.weight",
                "model.layers.0.self_attn.q_proj.weight",
                "model.layers.1.self_attn.k_proj.weight",
                "model.layers.0.input_layernorm.weight",
                "model.layers.1.mlp.down_proj.weight",
                "model.norm.weight",
            ];
            if !cfg.tie_word_embeddings {
                names.push("lm_head.weight");
            }
            if cfg.attention_bias {
                names.push("model.layers.0.self_attn.v_proj.bias");
            }
            if cfg.qk_norm {
                names.push("model.layers.0.self_attn.q_norm.weight");
            }
            for name in names {
                let (_, var) = vars.iter().find(|(n, _)| n == name).unwrap();
                let g = grads
                    .get(var.as_tensor())
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap();
                let base = var
                    .as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap();
                let n = base.len();
                // Check a few elements spread over the tensor, including ones used by the batch
                // for the embedding (token 7 row) so the gradient is non-trivial.
                let picks: Vec<usize> = if name == "model.embed_tokens.weight" {
                    vec![
                        7 * cfg.hidden_size + 3,
                        19 * cfg.hidden_size + 10,
                        60 * cfg.hidden_size,
                    ]
                } else {
                    vec![0, n / 3, n - 1]
                };
                for i in picks {
                    let eps = 1e-5;
                    let f_at = |delta: f64| -> f64 {
                        let mut v = base.clone();
                        v[i] += delta;
                        set_var(var, &v);
                        let m = Transformer::from_varmap(&model_cfg(&cfg), &vm).unwrap();
                        objective(&m).to_scalar::<f64>().unwrap()
                    };
                    let fd = (f_at(eps) - f_at(-eps)) / (2.0 * eps);
                    set_var(var, &base);
                    let ad = g[i];
                    let rel = (ad - fd).abs() / ad.abs().max(fd.abs()).max(1e-6);
                    assert!(
                        rel < 1e-4,
                        "{:?} {name}[{i}]: autograd {ad:e} vs finite diff {fd:e} (rel {rel:e})",
                        cfg.architecture
                    );
                }
            }
        }
    }

    fn model_cfg(cfg: &ModelConfig) -> ModelConfig {
        let mut c = cfg.clone();
        c.initializer_range = 0.2;
        c
    }

    fn set_var(var: &Var, values: &[f64]) {
        let t = Tensor::from_vec(values.to_vec(), var.as_tensor().shape(), &Device::Cpu).unwrap();
        var.set(&t).unwrap();
    }

    #[test]
    fn every_var_gets_a_nonzero_gradient() {
        for cfg in tiny_configs() {
            let (vm, model) = model_for(&cfg, DType::F32, 6);
            let grads = objective(&model).backward().unwrap();
            let vars = sorted_vars(&vm);
            assert_eq!(vars.len(), cfg.parameter_shapes().len());
            for (name, var) in vars {
                let g = grads
                    .get(var.as_tensor())
                    .unwrap_or_else(|| panic!("{:?}: no gradient for {name}", cfg.architecture));
                let norm = g
                    .sqr()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                assert!(
                    norm > 0.0 && norm.is_finite(),
                    "{:?}: zero gradient for {name}",
                    cfg.architecture
                );
            }
        }
    }
}
