//! Teacher-forced passes over sequences that share a prefix, the prefix computed once.
//!
//! The G rollouts of a prompt share the prompt; a tree's branches share their common turns;
//! verl-agent's step samples of one trajectory share its opening context. A padded batch runs
//! such a prefix G times forward and G times backward. [`Transformer::forward_hidden_shared`]
//! runs it once (batch 1), keeps its keys and values as graph nodes, and runs every row's own
//! continuation against them: attention reads the prefix's keys and values exactly as in the
//! padded pass, and the backward sums every row's gradient on them into the one prefix pass —
//! the same loss and the same gradients, for `(G − 1) · prefix` fewer token passes.

use candle_core::Tensor;

use crate::error::{ModelError, Result};
use crate::model::{KvCache, Transformer};

impl Transformer {
    /// Final hidden states of sequences that share prefixes, each prefix's forward pass
    /// computed once. `prefixes` are the shared prefixes (one per group); `suffixes[i] = (g, s)`
    /// is row `i`: the sequence `prefixes[g] ++ s`. Returns `(prefix [m, C, hidden], suffix
    /// [n, S, hidden])`, `C` the longest prefix (shorter ones left-padded) and `S` the longest
    /// suffix (shorter ones right-padded); hidden states at padded positions are finite and
    /// meaningless. [`shared_hidden_index`] says where position `p` of a row lies.
    ///
    /// Differentiable when the model tracks gradients: the prefixes' keys and values are graph
    /// nodes that every row of their group reads, so the backward accumulates the rows'
    /// gradients on them and runs each prefix's backward once. The result equals
    /// [`Transformer::forward_hidden`] over the whole sequences to rounding.
    pub fn forward_hidden_shared(
        &self,
        prefixes: &[&[u32]],
        suffixes: &[(usize, &[u32])],
    ) -> Result<(Tensor, Tensor)> {
        if prefixes.is_empty() || suffixes.is_empty() {
            return Err(ModelError::invalid_input(
                "shared prefixes",
                "needs at least one prefix and one row",
            ));
        }
        if let Some(g) = prefixes.iter().position(|p| p.is_empty()) {
            return Err(ModelError::invalid_input(
                "shared prefixes",
                format!("prefix {g} is empty"),
            ));
        }
        for (i, &(g, s)) in suffixes.iter().enumerate() {
            if g >= prefixes.len() || s.is_empty() {
                return Err(ModelError::invalid_input(
                    "shared prefixes",
                    format!(
                        "row {i}: needs a prefix among the {} given (has {g}) and a token after \
                         it (has {})",
                        prefixes.len(),
                        s.len()
                    ),
                ));
            }
        }
        let device = self.device();
        let m = prefixes.len();
        let c = prefixes.iter().map(|p| p.len()).max().unwrap_or(1);
        let n = suffixes.len();
        let s = suffixes.iter().map(|(_, x)| x.len()).max().unwrap_or(1);
        // The prefixes, once each (left-padded), into a cache that concatenates (so their keys
        // and values stay graph nodes rather than buffers written in place).
        let mut ids = vec![0u32; m * c];
        let mut pos = vec![0u32; m * c];
        let mut prefix_mask = vec![0u8; m * c];
        for (g, p) in prefixes.iter().enumerate() {
            let pad = c - p.len();
            ids[g * c + pad..(g + 1) * c].copy_from_slice(p);
            for (k, x) in pos[g * c + pad..(g + 1) * c].iter_mut().enumerate() {
                *x = k as u32;
            }
            prefix_mask[g * c + pad..(g + 1) * c].fill(1);
        }
        let mut cache = KvCache::new(self.config().num_hidden_layers);
        let h_prefix = self.forward_hidden(
            &Tensor::from_vec(ids, (m, c), device)?,
            &Tensor::from_vec(pos, (m, c), device)?,
            &Tensor::from_vec(prefix_mask.clone(), (m, c), device)?,
            Some(&mut cache),
        )?;
        // Every row reads its group's prefix keys and values (an index-select, whose backward
        // sums the rows' gradients).
        let group: Vec<u32> = suffixes.iter().map(|&(g, _)| g as u32).collect();
        cache.select_rows(&Tensor::from_vec(group, n, device)?)?;
        let mut ids = vec![0u32; n * s];
        let mut pos = vec![0u32; n * s];
        let mut mask = vec![0u8; n * (c + s)];
        for (i, &(g, suffix)) in suffixes.iter().enumerate() {
            let cg = prefixes[g].len();
            ids[i * s..i * s + suffix.len()].copy_from_slice(suffix);
            for (k, x) in pos[i * s..(i + 1) * s].iter_mut().enumerate() {
                *x = (cg + k) as u32;
            }
            let row = &mut mask[i * (c + s)..(i + 1) * (c + s)];
            row[..c].copy_from_slice(&prefix_mask[g * c..(g + 1) * c]);
            row[c..c + suffix.len()].fill(1);
        }
        let h_suffix = self.forward_hidden(
            &Tensor::from_vec(ids, (n, s), device)?,
            &Tensor::from_vec(pos, (n, s), device)?,
            &Tensor::from_vec(mask, (n, c + s), device)?,
            Some(&mut cache),
        )?;
        Ok((h_prefix, h_suffix))
    }
}

/// Where position `p` of a row of [`Transformer::forward_hidden_shared`] lies in its flat
/// hidden states `[m·C prefix rows; n·S suffix rows]` (the two results reshaped to rows and
/// concatenated): `row` is the row's index, `group` its prefix's and `prefix_len` that
/// prefix's length, `c` and `s` the padded prefix and suffix widths, `m` the prefix count.
pub fn shared_hidden_index(
    (m, c, s): (usize, usize, usize),
    group: usize,
    prefix_len: usize,
    row: usize,
    p: usize,
) -> usize {
    if p < prefix_len {
        group * c + (c - prefix_len) + p
    } else {
        m * c + row * s + (p - prefix_len)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use crate::model::tests::{max_abs_diff, model_for, tiny_configs};
    use crate::model::weights::sorted_vars;

    /// Two groups (prefixes of 7 and 3 tokens, so one is left-padded) of 3 and 2 rows against
    /// each whole sequence run alone: the hidden states at every position, and the gradient of
    /// a mix of them with respect to every weight (f64, so the only difference is rounding).
    #[test]
    fn shared_prefix_pass_equals_the_whole_sequences() {
        let prefixes: [&[u32]; 2] = [&[5, 17, 3, 42, 8, 9, 1], &[23, 6, 81]];
        let rows: [(usize, &[u32]); 5] = [
            (0, &[60, 7, 33]),
            (1, &[2, 90]),
            (0, &[2]),
            (0, &[11, 70, 4, 4, 29]),
            (1, &[61, 62, 63, 64, 65, 66, 67]),
        ];
        let dev = Device::Cpu;
        for cfg in tiny_configs() {
            let (vm, model) = model_for(&cfg, DType::F64, 3);
            let (hp, hs) = model.forward_hidden_shared(&prefixes, &rows).unwrap();
            let (m, c, h) = hp.dims3().unwrap();
            let s = hs.dim(1).unwrap();
            let flat = Tensor::cat(
                &[
                    hp.reshape((m * c, h)).unwrap(),
                    hs.reshape((rows.len() * s, h)).unwrap(),
                ],
                0,
            )
            .unwrap();
            let mut shared_obj = Vec::new();
            let mut alone_obj = Vec::new();
            for (i, &(g, suffix)) in rows.iter().enumerate() {
                let seq: Vec<u32> = prefixes[g].iter().chain(suffix).copied().collect();
                let n = seq.len();
                let idx: Vec<u32> = (0..n)
                    .map(|p| {
                        super::shared_hidden_index((m, c, s), g, prefixes[g].len(), i, p) as u32
                    })
                    .collect();
                let mine = flat
                    .index_select(&Tensor::new(idx, &dev).unwrap(), 0)
                    .unwrap();
                let t = |v: Vec<u32>| Tensor::from_vec(v, (1, n), &dev).unwrap();
                let alone = model
                    .forward_hidden(
                        &t(seq.clone()),
                        &t((0..n as u32).collect()),
                        &t(vec![1; n]),
                        None,
                    )
                    .unwrap()
                    .squeeze(0)
                    .unwrap();
                let d = max_abs_diff(&mine, &alone);
                assert!(d < 1e-10, "{:?} row {i}: {d}", cfg.architecture);
                // A weighted mix that differs per row and per position.
                let w = Tensor::arange(0.0f64, (n * h) as f64, &dev)
                    .unwrap()
                    .affine(0.37, 0.1)
                    .unwrap()
                    .sin()
                    .unwrap()
                    .affine(1.0 + i as f64, 0.0)
                    .unwrap()
                    .reshape((n, h))
                    .unwrap();
                shared_obj.push((mine * &w).unwrap().sum_all().unwrap());
                alone_obj.push((alone * &w).unwrap().sum_all().unwrap());
            }
            let total = |v: Vec<Tensor>| Tensor::stack(&v, 0).unwrap().sum_all().unwrap();
            let g_shared = total(shared_obj).backward().unwrap();
            let g_alone = total(alone_obj).backward().unwrap();
            for (name, var) in sorted_vars(&vm) {
                // The hidden states do not reach an untied output head.
                let (a, b) = match (g_shared.get(var.as_tensor()), g_alone.get(var.as_tensor())) {
                    (None, None) if name == "lm_head.weight" => continue,
                    (Some(a), Some(b)) => (a, b),
                    _ => panic!("{name}: a gradient on one side only"),
                };
                let d = max_abs_diff(a, b);
                assert!(d < 1e-10, "{:?} {name}: {d}", cfg.architecture);
            }
        }
    }

    #[test]
    fn bad_inputs_are_named() {
        let (_vm, model) = model_for(&tiny_configs()[0], DType::F32, 3);
        let e = model.forward_hidden_shared(&[], &[(0, &[1])]).unwrap_err();
        assert!(e.to_string().contains("at least one prefix"), "{e}");
        let e = model
            .forward_hidden_shared(&[&[]], &[(0, &[1])])
            .unwrap_err();
        assert!(e.to_string().contains("prefix 0 is empty"), "{e}");
        let e = model
            .forward_hidden_shared(&[&[1, 2]], &[(0, &[3]), (0, &[])])
            .unwrap_err();
        assert!(e.to_string().contains("row 1"), "{e}");
        let e = model
            .forward_hidden_shared(&[&[1, 2]], &[(1, &[3])])
            .unwrap_err();
        assert!(e.to_string().contains("row 0"), "{e}");
    }
}
