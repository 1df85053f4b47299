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
    check_temperature(temperature)?;
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

/// A sampling temperature must be a positive number.
fn check_temperature(temperature: f64) -> Result<()> {
    if temperature > 0.0 && temperature.is_finite() {
        Ok(())
    } else {
        Err(ModelError::invalid_input(
            "temperature",
            format!("{temperature} is not a positive number"),
        ))
    }
}

/// One row of [`shared_prefix_logprobs_entropy`]: its whole token sequence, its group (whose
/// shared prefix the sequence starts with) and the positions `from..from + len` whose next
/// token's log-probability is wanted (position `p` predicts `seq[p + 1]`).
#[derive(Debug, Clone, Copy)]
pub struct SharedRow<'a> {
    /// The row's tokens, its group's prefix first.
    pub seq: &'a [u32],
    /// Index of the row's group.
    pub group: usize,
    /// First predicting position.
    pub from: usize,
    /// Number of predicting positions.
    pub len: usize,
    /// Per predicting position (`len` flags): whether its log-prob and entropy are wanted. The
    /// output head runs on those only and the others come out 0 (observation tokens, which
    /// nothing reads). `None`: every one.
    pub scored: Option<&'a [bool]>,
}

/// Log-probabilities and entropies (at `temperature`) of the next tokens at each row's
/// positions `from..from + len`, `[n, width]` each (entries past a row's `len` are finite and
/// meaningless), for rows in groups whose first `prefix_lens[g]` tokens are the same: each
/// group's prefix runs forward (and backward) once ([`Transformer::forward_hidden_shared`]),
/// and the output head runs only on the wanted positions. Equal to the padded pass over the
/// whole rows to rounding.
pub fn shared_prefix_logprobs_entropy(
    model: &Transformer,
    prefix_lens: &[usize],
    rows: &[SharedRow<'_>],
    width: usize,
    temperature: f64,
) -> Result<(Tensor, Tensor)> {
    check_temperature(temperature)?;
    let (hidden, targets) = shared_prefix_hidden(model, prefix_lens, rows, width)?;
    // The head runs on each row's wanted positions only (not on the padding past a row's
    // `len`, nor on positions its `scored` leaves out).
    let width = width.max(1);
    let mut keep = vec![false; rows.len() * width];
    for (i, r) in rows.iter().enumerate() {
        match r.scored {
            Some(s) if s.len() != r.len => {
                return Err(ModelError::invalid_input(
                    "rows",
                    format!("row {i}: {} scored flags for {} positions", s.len(), r.len),
                ));
            }
            Some(s) => keep[i * width..i * width + r.len].copy_from_slice(s),
            None => keep[i * width..i * width + r.len].fill(true),
        }
    }
    model.head_logprobs_entropy_at(&hidden, &targets, 1.0 / temperature, &keep)
}

/// The final hidden states `[n, width, hidden]` at each row's positions `from..from + len`
/// (entries past a row's `len` are finite and meaningless) and the next tokens there
/// `[n, width]`, for rows in groups whose first `prefix_lens[g]` tokens are the same: each
/// group's prefix runs forward (and backward) once ([`Transformer::forward_hidden_shared`]).
/// What [`shared_prefix_logprobs_entropy`] runs the output head on, and a critic its value
/// head.
pub fn shared_prefix_hidden(
    model: &Transformer,
    prefix_lens: &[usize],
    rows: &[SharedRow<'_>],
    width: usize,
) -> Result<(Tensor, Tensor)> {
    // Each group's prefix, from its first row.
    let mut prefixes: Vec<Option<&[u32]>> = vec![None; prefix_lens.len()];
    for (i, r) in rows.iter().enumerate() {
        let c = *prefix_lens.get(r.group).ok_or_else(|| {
            ModelError::invalid_input(
                "rows",
                format!("row {i}: group {} of {}", r.group, prefix_lens.len()),
            )
        })?;
        if r.seq.len() <= c {
            return Err(ModelError::invalid_input(
                "rows",
                format!(
                    "row {i} has {} tokens, no more than its group's {c}-token prefix",
                    r.seq.len()
                ),
            ));
        }
        let prefix = *prefixes[r.group].get_or_insert(&r.seq[..c]);
        if r.seq[..c] != *prefix {
            return Err(ModelError::invalid_input(
                "rows",
                format!(
                    "row {i} does not start with the {c}-token prefix of group {}",
                    r.group
                ),
            ));
        }
        if r.len > width || (r.len > 0 && r.from + r.len >= r.seq.len()) {
            return Err(ModelError::invalid_input(
                "rows",
                format!(
                    "row {i}: positions {}..{} need targets within its {} tokens and at most \
                     {width} positions",
                    r.from,
                    r.from + r.len,
                    r.seq.len()
                ),
            ));
        }
    }
    let prefixes: Vec<&[u32]> = prefixes
        .into_iter()
        .enumerate()
        .map(|(g, p)| {
            p.ok_or_else(|| ModelError::invalid_input("rows", format!("group {g} has no row")))
        })
        .collect::<Result<_>>()?;
    let suffixes: Vec<(usize, &[u32])> = rows
        .iter()
        .map(|r| (r.group, &r.seq[prefix_lens[r.group]..]))
        .collect();
    let (hp, hs) = model.forward_hidden_shared(&prefixes, &suffixes)?;
    let (m, c, h) = hp.dims3()?;
    let n = rows.len();
    let s = hs.dim(1)?;
    let width = width.max(1);
    let mut index = vec![0u32; n * width];
    let mut targets = vec![0u32; n * width];
    for (i, r) in rows.iter().enumerate() {
        for k in 0..r.len {
            let p = r.from + k;
            let at = crate::model::prefix::shared_hidden_index(
                (m, c, s),
                r.group,
                prefix_lens[r.group],
                i,
                p,
            );
            index[i * width + k] = at as u32;
            targets[i * width + k] = r.seq[p + 1];
        }
    }
    let flat = Tensor::cat(&[hp.reshape((m * c, h))?, hs.reshape((n * s, h))?], 0)?;
    let device = model.device();
    let hidden = flat
        .index_select(&Tensor::from_vec(index, n * width, device)?, 0)?
        .reshape((n, width, h))?;
    Ok((hidden, Tensor::from_vec(targets, (n, width), device)?))
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

    /// Two rows sharing a 5-token prefix and one with a 2-token prefix of its own, the wanted positions starting inside the prefix (a
    /// tree's shared turn) or after it: the log-probs, entropies and every weight's gradient of
    /// the shared pass equal those of the padded pass over the whole rows (f64).
    #[test]
    fn shared_prefix_logprobs_equal_the_padded_pass() {
        let seqs: [&[u32]; 3] = [
            &[4, 9, 2, 7, 7, 30, 31, 32],
            &[8, 1, 40, 41, 42, 43],
            &[4, 9, 2, 7, 7, 50, 51, 52, 53, 54],
        ];
        let groups = [0usize, 1, 0];
        let spans = [(3usize, 4usize), (1, 4), (2, 7)];
        let width = 7;
        let dev = Device::Cpu;
        for cfg in tiny_configs() {
            let (vm, model) = model_for(&cfg, DType::F64, 9);
            let rows: Vec<SharedRow<'_>> = seqs
                .iter()
                .zip(spans)
                .zip(groups)
                .map(|((&seq, (from, len)), group)| SharedRow {
                    seq,
                    group,
                    from,
                    len,
                    scored: None,
                })
                .collect();
            let (lp, ent) =
                shared_prefix_logprobs_entropy(&model, &[5, 2], &rows, width, 0.9).unwrap();
            // The padded pass: right-padded rows, positions from 0.
            let t = seqs.iter().map(|s| s.len()).max().unwrap();
            let mut ids = vec![0u32; 3 * t];
            let mut pos = vec![0u32; 3 * t];
            let mut mask = vec![0u32; 3 * t];
            let mut tg = vec![0u32; 3 * t];
            for (i, s) in seqs.iter().enumerate() {
                for (p, &x) in s.iter().enumerate() {
                    ids[i * t + p] = x;
                    pos[i * t + p] = p as u32;
                    mask[i * t + p] = 1;
                    if p > 0 {
                        tg[i * t + p - 1] = x;
                    }
                }
            }
            let m = |v: Vec<u32>| Tensor::from_vec(v, (3, t), &dev).unwrap();
            let (lp0, ent0) = logprobs_and_entropy_with_temperature(
                &model,
                &m(ids),
                &m(pos),
                &m(mask),
                &m(tg),
                0.9,
            )
            .unwrap();
            let mut weights = vec![0f64; 3 * width];
            let mut pick = vec![0u32; 3 * width];
            for (i, &(from, len)) in spans.iter().enumerate() {
                for k in 0..len {
                    weights[i * width + k] = 0.3 + 0.17 * (i * width + k) as f64;
                    pick[i * width + k] = (i * t + from + k) as u32;
                }
            }
            let w = Tensor::from_vec(weights, (3, width), &dev).unwrap();
            let pick = Tensor::from_vec(pick, 3 * width, &dev).unwrap();
            let gather = |x: &Tensor| {
                x.flatten_all()
                    .unwrap()
                    .index_select(&pick, 0)
                    .unwrap()
                    .reshape((3, width))
                    .unwrap()
            };
            let (lp0, ent0) = (gather(&lp0), gather(&ent0));
            let masked =
                |x: &Tensor| (x * &w.ne(0.0).unwrap().to_dtype(DType::F64).unwrap()).unwrap();
            assert!(max_abs(&masked(&lp), &masked(&lp0)) < 1e-10);
            assert!(max_abs(&masked(&ent), &masked(&ent0)) < 1e-10);
            let obj = |lp: &Tensor, ent: &Tensor| {
                ((lp + (ent * 0.5).unwrap()).unwrap() * &w)
                    .unwrap()
                    .sum_all()
                    .unwrap()
            };
            let g = obj(&lp, &ent).backward().unwrap();
            let g0 = obj(&lp0, &ent0).backward().unwrap();
            for (name, var) in sorted_vars(&vm) {
                let (a, b) = (g.get(var.as_tensor()), g0.get(var.as_tensor()));
                let (a, b) = (a.expect(&name), b.expect(&name));
                assert!(max_abs(a, b) < 1e-10, "{name}: {}", max_abs(a, b));
            }
            let bad = SharedRow {
                seq: &[4, 9, 3, 1, 1, 1],
                group: 0,
                from: 0,
                len: 1,
                scored: None,
            };
            let two = [rows[0], bad];
            let e = shared_prefix_logprobs_entropy(&model, &[5], &two, width, 1.0).unwrap_err();
            assert!(e.to_string().contains("row 1"), "{e}");
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
