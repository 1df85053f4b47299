//! Tests of the transformer on tiny models built here.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

use super::weights::{export_hf, init_varmap, load_hf, load_hf_weights, save_safetensors};
use super::{Architecture, KvCache, ModelConfig, Transformer};
use crate::ModelError;

/// Tiny configs of all three families (GQA, tied and untied heads).
pub(crate) fn tiny_configs() -> Vec<ModelConfig> {
    let qwen2 = ModelConfig::tiny_qwen2(96);
    let mut qwen3 = ModelConfig::tiny_qwen2(96);
    qwen3.architecture = Architecture::Qwen3;
    qwen3.attention_bias = false;
    qwen3.qk_norm = true;
    qwen3.head_dim = 16; // Qwen3 allows head_dim × heads != hidden
    qwen3.tie_word_embeddings = false;
    let mut llama = ModelConfig::tiny_qwen2(96);
    llama.architecture = Architecture::Llama;
    llama.attention_bias = false;
    llama.num_key_value_heads = 4;
    llama.tie_word_embeddings = false;
    vec![qwen2, qwen3, llama]
}

/// A model with larger-than-default init, so that attention patterns are not uniform and
/// mistakes in masking or positions show in the logits.
pub(crate) fn model_for(
    cfg: &ModelConfig,
    dtype: DType,
    seed: u64,
) -> (candle_nn::VarMap, Transformer) {
    let mut cfg = cfg.clone();
    cfg.initializer_range = 0.2;
    let vm = init_varmap(&cfg, dtype, &Device::Cpu, seed).unwrap();
    let m = Transformer::from_varmap(&cfg, &vm).unwrap();
    (vm, m)
}

/// The largest absolute difference between two tensors of one shape.
pub(crate) fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

fn ids(rows: &[Vec<u32>]) -> Tensor {
    let t = rows[0].len();
    let flat: Vec<u32> = rows.iter().flatten().copied().collect();
    Tensor::from_vec(flat, (rows.len(), t), &Device::Cpu).unwrap()
}

#[test]
fn left_padded_row_matches_row_alone() {
    for cfg in tiny_configs() {
        let (_vm, model) = model_for(&cfg, DType::F32, 1);
        let seq = vec![5u32, 17, 3, 42, 8];
        let long = vec![9u32, 1, 2, 60, 7, 33, 70, 11];
        let pad = long.len() - seq.len();
        let mut padded = vec![0u32; pad];
        padded.extend(&seq);
        let batch_ids = ids(&[padded, long.clone()]);
        let mut pos0 = vec![0u32; pad];
        pos0.extend(0..seq.len() as u32);
        let pos = ids(&[pos0, (0..long.len() as u32).collect()]);
        let mut m0 = vec![0u32; pad];
        m0.extend(vec![1u32; seq.len()]);
        let mask = ids(&[m0, vec![1; long.len()]]);
        let out = model.forward(&batch_ids, &pos, &mask, None).unwrap();

        let alone_ids = ids(std::slice::from_ref(&seq));
        let alone_pos = ids(&[(0..seq.len() as u32).collect()]);
        let alone_mask = ids(&[vec![1; seq.len()]]);
        let alone = model
            .forward(&alone_ids, &alone_pos, &alone_mask, None)
            .unwrap();
        let row0 = out
            .narrow(0, 0, 1)
            .unwrap()
            .narrow(1, pad, seq.len())
            .unwrap();
        let d = max_abs_diff(&row0, &alone);
        assert!(
            d <= 1e-5,
            "{:?}: padded vs alone differ by {d}",
            cfg.architecture
        );

        let long_alone = model
            .forward(
                &ids(std::slice::from_ref(&long)),
                &ids(&[(0..long.len() as u32).collect()]),
                &ids(&[vec![1; long.len()]]),
                None,
            )
            .unwrap();
        let d = max_abs_diff(&out.narrow(0, 1, 1).unwrap(), &long_alone);
        assert!(d <= 1e-5, "{:?}: full row differs by {d}", cfg.architecture);
        assert!(
            out.flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .all(|x| x.is_finite())
        );
    }
}

#[test]
fn incremental_decoding_matches_full_forward() {
    for cfg in tiny_configs() {
        let (vm, _) = model_for(&cfg, DType::F32, 2);
        let mut cfg2 = cfg.clone();
        cfg2.initializer_range = 0.2;
        let model = Transformer::detached_from_varmap(&cfg2, &vm).unwrap();
        // Row 0 is left-padded by 2.
        let rows = [
            vec![0u32, 0, 4, 9, 13, 2, 77, 5],
            vec![8u32, 6, 30, 1, 2, 50, 3, 90],
        ];
        let pos = ids(&[vec![0, 0, 0, 1, 2, 3, 4, 5], (0..8).collect()]);
        let mask = ids(&[vec![0, 0, 1, 1, 1, 1, 1, 1], vec![1; 8]]);
        let all = ids(&rows);
        let full = model.forward(&all, &pos, &mask, None).unwrap();

        let mut cache = KvCache::new(cfg.num_hidden_layers);
        let prefill = 5;
        let mut pieces = vec![
            model
                .forward(
                    &all.narrow(1, 0, prefill).unwrap(),
                    &pos.narrow(1, 0, prefill).unwrap(),
                    &mask.narrow(1, 0, prefill).unwrap(),
                    Some(&mut cache),
                )
                .unwrap(),
        ];
        assert_eq!(cache.seq_len(), prefill);
        for t in prefill..8 {
            let step = model
                .forward(
                    &all.narrow(1, t, 1).unwrap(),
                    &pos.narrow(1, t, 1).unwrap(),
                    &mask.narrow(1, 0, t + 1).unwrap(),
                    Some(&mut cache),
                )
                .unwrap();
            pieces.push(step);
        }
        let inc = Tensor::cat(&pieces, 1).unwrap();
        let d = max_abs_diff(&inc, &full);
        assert!(
            d <= 1e-5,
            "{:?}: cached decoding differs by {d}",
            cfg.architecture
        );
        assert_eq!(cache.seq_len(), 8);

        // Dropping a row keeps the other row's continuation exact.
        let mut cache2 = KvCache::new(cfg.num_hidden_layers);
        model
            .forward(
                &all.narrow(1, 0, 7).unwrap(),
                &pos.narrow(1, 0, 7).unwrap(),
                &mask.narrow(1, 0, 7).unwrap(),
                Some(&mut cache2),
            )
            .unwrap();
        cache2
            .select_rows(&Tensor::new(&[1u32], &Device::Cpu).unwrap())
            .unwrap();
        let last = model
            .forward(
                &all.narrow(0, 1, 1).unwrap().narrow(1, 7, 1).unwrap(),
                &pos.narrow(0, 1, 1).unwrap().narrow(1, 7, 1).unwrap(),
                &mask.narrow(0, 1, 1).unwrap(),
                Some(&mut cache2),
            )
            .unwrap();
        let d = max_abs_diff(
            &last,
            &full.narrow(0, 1, 1).unwrap().narrow(1, 7, 1).unwrap(),
        );
        assert!(d <= 1e-5, "select_rows continuation differs by {d}");
    }
}

/// A cache with spare columns (written in place, regrown when full) gives the same logits as
/// one that concatenates on every step, through a prefill, regrowths and a row selection.
#[test]
fn reserved_cache_matches_concatenation() {
    for cfg in tiny_configs() {
        let (vm, _) = model_for(&cfg, DType::F32, 9);
        let mut cfg2 = cfg.clone();
        cfg2.initializer_range = 0.2;
        let model = Transformer::detached_from_varmap(&cfg2, &vm).unwrap();
        let t_all = 14;
        let rows: Vec<Vec<u32>> = (0..3u32)
            .map(|r| {
                (0..t_all as u32)
                    .map(|i| (7 * i + 13 * r + 1) % 60)
                    .collect()
            })
            .collect();
        let all = ids(&rows);
        let pos = ids(&vec![(0..t_all as u32).collect::<Vec<_>>(); 3]);
        let mask = ids(&vec![vec![1u32; t_all]; 3]);
        let mut exact = KvCache::new(cfg.num_hidden_layers);
        let mut spare = KvCache::with_reserve(cfg.num_hidden_layers, 3);
        let keep = Tensor::new(&[2u32, 0], &Device::Cpu).unwrap();
        let mut b = 3;
        let mut t0 = 0;
        for len in [4, 1, 1, 1, 1, 2, 1, 1, 1, 1] {
            if t0 == 8 {
                exact.select_rows(&keep).unwrap();
                spare.select_rows(&keep).unwrap();
                b = 2;
            }
            let pick = |x: &Tensor, cols: usize, from: usize| {
                let x = if b == 3 {
                    x.clone()
                } else {
                    x.index_select(&keep, 0).unwrap()
                };
                x.narrow(1, from, cols).unwrap()
            };
            let run = |c: &mut KvCache| {
                model
                    .forward(
                        &pick(&all, len, t0),
                        &pick(&pos, len, t0),
                        &pick(&mask, t0 + len, 0),
                        Some(c),
                    )
                    .unwrap()
            };
            let (a, s) = (run(&mut exact), run(&mut spare));
            let d = max_abs_diff(&a, &s);
            assert!(
                d <= 1e-6,
                "{:?}: reserved cache differs by {d} at {t0}",
                cfg.architecture
            );
            t0 += len;
            assert_eq!(spare.seq_len(), t0);
            assert_eq!(spare.batch_size(), Some(b));
        }
    }
}

/// The detached model runs the forward-only kernel of `ops::infer` (few-row linear layers);
/// the trainable one runs candle's differentiable matmul. Both must agree,
/// through a padded prefill and cached decoding steps.
#[test]
fn detached_kernels_match_the_differentiable_path() {
    for cfg in tiny_configs() {
        let (vm, tracked) = model_for(&cfg, DType::F32, 5);
        let mut cfg2 = cfg.clone();
        cfg2.initializer_range = 0.2;
        let detached = Transformer::detached_from_varmap(&cfg2, &vm).unwrap();
        assert!(tracked.tracks_gradients() && !detached.tracks_gradients());
        let rows = [
            vec![0u32, 0, 4, 9, 13, 2, 77],
            vec![8u32, 6, 30, 1, 2, 50, 3],
        ];
        let pos = ids(&[vec![0, 0, 0, 1, 2, 3, 4], (0..7).collect()]);
        let mask = ids(&[vec![0, 0, 1, 1, 1, 1, 1], vec![1; 7]]);
        let all = ids(&rows);
        let mut caches = [
            KvCache::new(cfg.num_hidden_layers),
            KvCache::new(cfg.num_hidden_layers),
        ];
        for (t0, len) in [(0, 5), (5, 1), (6, 1)] {
            let run = |m: &Transformer, c: &mut KvCache| {
                m.forward(
                    &all.narrow(1, t0, len).unwrap(),
                    &pos.narrow(1, t0, len).unwrap(),
                    &mask.narrow(1, 0, t0 + len).unwrap(),
                    Some(c),
                )
                .unwrap()
            };
            let [c0, c1] = &mut caches;
            let a = run(&tracked, c0);
            let b = run(&detached, c1);
            let d = max_abs_diff(&a, &b);
            assert!(
                d <= 1e-5,
                "{:?}: detached vs tracked differ by {d} at {t0}",
                cfg.architecture
            );
        }
    }
}

#[test]
fn save_load_round_trip_gives_identical_logits() {
    let dir = tempfile::tempdir().unwrap();
    let x = ids(&[vec![1u32, 2, 3, 4, 5, 6]]);
    let pos = ids(&[(0..6).collect()]);
    let mask = ids(&[vec![1; 6]]);
    for (i, cfg) in tiny_configs().into_iter().enumerate() {
        let (vm, model) = model_for(&cfg, DType::F32, 3);
        // Loaded weights record no graph, so compare with the detached view of the same
        // weights: the same kernels run on both sides and the logits agree bit for bit.
        let view = Transformer::detached_from_varmap(model.config(), &vm).unwrap();
        let before = view.forward(&x, &pos, &mask, None).unwrap();
        let folder = dir.path().join(format!("m{i}"));
        export_hf(&folder, model.config(), &vm).unwrap();
        let (cfg2, weights) = load_hf(&folder, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(&cfg2, model.config());
        let loaded = Transformer::from_tensors(&cfg2, &weights, "export").unwrap();
        let after = loaded.forward(&x, &pos, &mask, None).unwrap();
        assert_eq!(max_abs_diff(&before, &after), 0.0);

        // The same weights split over two shards with an index.
        let sharded = dir.path().join(format!("s{i}"));
        std::fs::create_dir_all(&sharded).unwrap();
        let mut a = HashMap::new();
        let mut b = HashMap::new();
        let mut map = serde_json::Map::new();
        for (k, t) in weights.iter() {
            let (shard, file) = if k.contains("layers.1") {
                (&mut b, "b.safetensors")
            } else {
                (&mut a, "a.safetensors")
            };
            shard.insert(k.clone(), t.clone());
            map.insert(k.clone(), serde_json::Value::String(file.into()));
        }
        save_safetensors(&a, sharded.join("a.safetensors")).unwrap();
        save_safetensors(&b, sharded.join("b.safetensors")).unwrap();
        let index = serde_json::json!({"metadata": {}, "weight_map": map});
        std::fs::write(
            sharded.join("model.safetensors.index.json"),
            index.to_string(),
        )
        .unwrap();
        let w2 = load_hf_weights(&sharded, DType::F32, &Device::Cpu).unwrap();
        let m2 = Transformer::from_tensors(&cfg2, &w2, "shards").unwrap();
        assert_eq!(
            max_abs_diff(&before, &m2.forward(&x, &pos, &mask, None).unwrap()),
            0.0
        );
    }
}

#[test]
fn loading_errors_name_the_tensor() {
    let cfg = ModelConfig::tiny_qwen2(64);
    let vm = init_varmap(&cfg, DType::F32, &Device::Cpu, 0).unwrap();
    let mut tensors = super::transformer::varmap_tensors(&vm, true);
    tensors.remove("model.layers.1.self_attn.k_proj.bias");
    let err = Transformer::from_tensors(&cfg, &tensors, "test.safetensors").unwrap_err();
    assert!(matches!(err, ModelError::MissingTensor { .. }));
    assert!(
        err.to_string()
            .contains("model.layers.1.self_attn.k_proj.bias"),
        "{err}"
    );
    assert!(err.to_string().contains("test.safetensors"), "{err}");

    let mut tensors = super::transformer::varmap_tensors(&vm, true);
    tensors.insert(
        "model.norm.weight".into(),
        Tensor::ones(31, DType::F32, &Device::Cpu).unwrap(),
    );
    let err = Transformer::from_tensors(&cfg, &tensors, "x").unwrap_err();
    assert!(err.to_string().contains("model.norm.weight"), "{err}");
    assert!(
        err.to_string().contains("[31]") && err.to_string().contains("[32]"),
        "{err}"
    );

    let dir = tempfile::tempdir().unwrap();
    let err = load_hf_weights(dir.path(), DType::F32, &Device::Cpu).unwrap_err();
    assert!(err.to_string().contains("model.safetensors"), "{err}");
}

#[test]
fn seeded_init_is_repeatable_and_detached_view_sees_updates() {
    let cfg = ModelConfig::tiny_qwen2(64);
    let a = init_varmap(&cfg, DType::F32, &Device::Cpu, 11).unwrap();
    let b = init_varmap(&cfg, DType::F32, &Device::Cpu, 11).unwrap();
    let ta = super::transformer::varmap_tensors(&a, true);
    let tb = super::transformer::varmap_tensors(&b, true);
    assert_eq!(ta.len(), cfg.parameter_shapes().len());
    for (k, t) in &ta {
        assert_eq!(max_abs_diff(t, &tb[k]), 0.0, "{k}");
    }
    // The detached view shares storage: a Var::set shows through.
    let detached = Transformer::detached_from_varmap(&cfg, &a).unwrap();
    let x = ids(&[vec![1u32, 2, 3]]);
    let pos = ids(&[vec![0, 1, 2]]);
    let mask = ids(&[vec![1, 1, 1]]);
    assert!(!detached.tracks_gradients());
    assert!(
        Transformer::from_varmap(&cfg, &a)
            .unwrap()
            .tracks_gradients()
    );
    let before = detached.forward(&x, &pos, &mask, None).unwrap();
    let vars = super::weights::sorted_vars(&a);
    let (_, norm) = vars.iter().find(|(n, _)| n == "model.norm.weight").unwrap();
    norm.set(&Tensor::full(2f32, 32, &Device::Cpu).unwrap())
        .unwrap();
    let after = detached.forward(&x, &pos, &mask, None).unwrap();
    assert!(max_abs_diff(&before, &after) > 1e-4);
    let grads = after.sum_all().unwrap().backward().unwrap();
    for (name, var) in &vars {
        assert!(
            grads.get(var.as_tensor()).is_none(),
            "detached view leaked a graph to {name}"
        );
    }
}

#[test]
fn half_precision_load_matches_f32() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_configs().remove(1); // Qwen3: q/k norms exercised in bf16 too
    let (vm, model) = model_for(&cfg, DType::F32, 8);
    export_hf(dir.path(), model.config(), &vm).unwrap();
    let (cfg2, w) = load_hf(dir.path(), DType::BF16, &Device::Cpu).unwrap();
    assert!(w.values().all(|t| t.dtype() == DType::BF16));
    let half = Transformer::from_tensors(&cfg2, &w, "bf16").unwrap();
    let x = ids(&[vec![3u32, 1, 4, 1, 5, 9]]);
    let pos = ids(&[(0..6).collect()]);
    let mask = ids(&[vec![1; 6]]);
    let a = model.forward(&x, &pos, &mask, None).unwrap();
    let b = half
        .forward(&x, &pos, &mask, None)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let scale = a
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap() as f64;
    let d = max_abs_diff(&a, &b);
    assert!(
        d < 0.05 * scale.max(1.0),
        "bf16 logits differ by {d} (scale {scale})"
    );
}

/// Logits against Hugging Face `transformers` on checkpoints it wrote (see
/// `fixtures/make_fixtures.py`): Qwen2 (qkv bias, tied), Qwen3 (q/k norm, head_dim ≠
/// hidden / heads, untied), Llama (no bias, MHA), one left-padded row with explicit positions.
#[test]
fn matches_hugging_face_reference() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/model/fixtures");
    for (name, arch) in [
        ("qwen2", Architecture::Qwen2),
        ("qwen3", Architecture::Qwen3),
        ("llama", Architecture::Llama),
    ] {
        let dir = root.join(name);
        let (cfg, weights) = load_hf(&dir, DType::F64, &Device::Cpu).unwrap();
        assert_eq!(cfg.architecture, arch);
        let model = Transformer::from_tensors(&cfg, &weights, name).unwrap();
        let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
        let exp: serde_json::Value = serde_json::from_str(&text).unwrap();
        let grid =
            |key: &str| -> Vec<Vec<u32>> { serde_json::from_value(exp[key].clone()).unwrap() };
        let (ids_v, mask_v, pos_v) = (grid("ids"), grid("mask"), grid("positions"));
        let logits: Vec<Vec<Option<Vec<f64>>>> =
            serde_json::from_value(exp["logits"].clone()).unwrap();
        let ours = model
            .forward(&ids(&ids_v), &ids(&pos_v), &ids(&mask_v), None)
            .unwrap()
            .to_vec3::<f64>()
            .unwrap();
        let mut worst = 0.0f64;
        for b in 0..ids_v.len() {
            for t in 0..ids_v[b].len() {
                // Padded query rows are undefined in both implementations (null in the fixture).
                let Some(reference) = &logits[b][t] else {
                    assert_eq!(mask_v[b][t], 0);
                    continue;
                };
                assert_eq!(reference.len(), cfg.vocab_size);
                for (x, y) in ours[b][t].iter().zip(reference) {
                    worst = worst.max((x - y).abs());
                }
            }
        }
        eprintln!("{name}: max |logit difference| vs transformers = {worst:e}");
        // HF computes the rotary tables in float32; everything else here is float64.
        assert!(
            worst < 1e-5,
            "{name}: max |logit difference| vs transformers = {worst:e}"
        );
    }
}

/// The fused attention (flash-style tiles, `ops::attention`) against the composed one (scores,
/// masked softmax, product; `with_composed_ops`) on whole tiny models in `f64`: logits and
/// every weight's gradient over a left-padded batch longer than two query tiles, and the logits
/// of a chunked prefill (a chunk over cached positions) followed by single-token decoding.
#[test]
fn fused_attention_matches_the_composed_attention_in_whole_models() {
    use super::ops::with_composed_ops;
    use super::weights::sorted_vars;
    let (t, pad) = (150usize, 70usize);
    let row0: Vec<u32> = (0..t)
        .map(|i| if i < pad { 0 } else { (i * 7 % 95 + 1) as u32 })
        .collect();
    let row1: Vec<u32> = (0..t).map(|i| (i * 13 % 96) as u32).collect();
    let all = ids(&[row0, row1]);
    let pos = ids(&[
        (0..t).map(|i| i.saturating_sub(pad) as u32).collect(),
        (0..t as u32).collect(),
    ]);
    let mask = ids(&[(0..t).map(|i| u32::from(i >= pad)).collect(), vec![1; t]]);
    for cfg in tiny_configs() {
        let (vm, model) = model_for(&cfg, DType::F64, 11);
        let vars = sorted_vars(&vm);
        let r = Tensor::randn(0f64, 1.0, (2, t, cfg.vocab_size), &Device::Cpu).unwrap();
        let run = || {
            let logits = model.forward(&all, &pos, &mask, None).unwrap();
            let grads = (&logits * &r)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let g: Vec<Tensor> = vars
                .iter()
                .map(|(_, v)| grads.get(v.as_tensor()).unwrap().clone())
                .collect();
            (logits, g)
        };
        let (fused, gf) = run();
        let (composed, gc) = with_composed_ops(run);
        let arch = cfg.architecture;
        let d = max_abs_diff(&fused, &composed);
        assert!(d < 1e-10, "{arch:?}: logits differ by {d:e}");
        for (i, (a, b)) in gf.iter().zip(&gc).enumerate() {
            let scale = max_abs_diff(b, &b.zeros_like().unwrap()).max(1.0);
            let d = max_abs_diff(a, b) / scale;
            let name = &vars[i].0;
            assert!(d < 1e-10, "{arch:?}: gradient of {name} differs by {d:e}");
        }
        // Chunked prefill (100, then 40 over the cache), then decoding one token at a time.
        let steps = |m: &Transformer| {
            let mut cache = KvCache::new(cfg.num_hidden_layers);
            let mut out = Vec::new();
            let mut t0 = 0;
            for len in [100, 40].into_iter().chain(std::iter::repeat_n(1, t - 140)) {
                out.push(
                    m.forward(
                        &all.narrow(1, t0, len).unwrap(),
                        &pos.narrow(1, t0, len).unwrap(),
                        &mask.narrow(1, 0, t0 + len).unwrap(),
                        Some(&mut cache),
                    )
                    .unwrap(),
                );
                t0 += len;
            }
            Tensor::cat(&out, 1).unwrap()
        };
        let a = steps(&model);
        let b = with_composed_ops(|| steps(&model));
        let d = max_abs_diff(&a, &b);
        assert!(d < 1e-10, "{arch:?}: cached logits differ by {d:e}");
        let d = max_abs_diff(&a, &fused);
        assert!(
            d < 1e-10,
            "{arch:?}: cached and full logits differ by {d:e}"
        );
    }
}

/// A batch padded on the left and on the right runs its position-wise ops on the real
/// positions only (`Ragged`): its final hidden states at the real positions, and every weight's
/// gradient of a weighted sum of them, equal those of each row run alone without padding (f64).
#[test]
fn ragged_batch_matches_rows_alone_forward_and_backward() {
    let rows: [&[u32]; 3] = [
        &[5, 17, 3, 42, 8],
        &[9, 1, 2, 60, 7, 33, 70, 11],
        &[4, 4, 90, 6],
    ];
    // Row 0 left-padded by 3, row 2 right-padded by 4.
    let left = [3usize, 0, 0];
    let t = 8;
    for cfg in tiny_configs() {
        let (vm, model) = model_for(&cfg, DType::F64, 3);
        let h = cfg.hidden_size;
        let weights = |row: usize, p: usize| {
            Tensor::arange(0f64, h as f64, &Device::Cpu)
                .unwrap()
                .affine(0.01 * (1 + row + p) as f64, -0.2)
                .unwrap()
        };
        let (mut ids_b, mut pos_b, mut mask_b) = (Vec::new(), Vec::new(), Vec::new());
        for (r, row) in rows.iter().enumerate() {
            let right = t - left[r] - row.len();
            ids_b.push([vec![0; left[r]], row.to_vec(), vec![0; right]].concat());
            pos_b.push(
                [
                    vec![0; left[r]],
                    (0..row.len() as u32).collect(),
                    vec![0; right],
                ]
                .concat(),
            );
            mask_b.push([vec![0; left[r]], vec![1; row.len()], vec![0; right]].concat());
        }
        let out = model
            .forward_hidden(&ids(&ids_b), &ids(&pos_b), &ids(&mask_b), None)
            .unwrap();
        let (mut obj, mut obj_alone) = (Vec::new(), Vec::new());
        for (r, row) in rows.iter().enumerate() {
            let n = row.len();
            let alone = model
                .forward_hidden(
                    &ids(&[row.to_vec()]),
                    &ids(&[(0..n as u32).collect()]),
                    &ids(&[vec![1; n]]),
                    None,
                )
                .unwrap();
            let mine = out.narrow(0, r, 1).unwrap().narrow(1, left[r], n).unwrap();
            let d = max_abs_diff(&mine, &alone);
            assert!(d < 1e-10, "{:?} row {r}: {d}", cfg.architecture);
            for p in 0..n {
                let w = weights(r, p);
                let at = |x: &Tensor| {
                    (x.narrow(1, p, 1).unwrap().flatten_all().unwrap() * &w)
                        .unwrap()
                        .sum_all()
                        .unwrap()
                };
                obj.push(at(&mine));
                obj_alone.push(at(&alone));
            }
        }
        let sum = |v: &[Tensor]| Tensor::stack(v, 0).unwrap().sum_all().unwrap();
        let g = sum(&obj).backward().unwrap();
        let g0 = sum(&obj_alone).backward().unwrap();
        for (name, var) in super::weights::sorted_vars(&vm) {
            // The output head is not in the objective: it has no gradient either way.
            match (g.get(var.as_tensor()), g0.get(var.as_tensor())) {
                (Some(a), Some(b)) => {
                    let d = max_abs_diff(a, b);
                    assert!(d < 1e-10, "{:?} {name}: {d}", cfg.architecture);
                }
                (None, None) => assert_eq!(name, "lm_head.weight"),
                _ => panic!("{:?} {name}: a gradient on one side only", cfg.architecture),
            }
        }
    }
}

/// `head_logprobs_entropy_at` with nothing kept gives zeros of the head's shape, and a keep
/// list of the wrong length is refused by name.
#[test]
fn the_head_at_no_position_is_zero_and_a_wrong_keep_list_is_refused() {
    let (_vm, model) = model_for(&tiny_configs()[0], DType::F32, 2);
    let ids3 = ids(&[vec![5, 17, 3]]);
    let hidden = model
        .forward_hidden(&ids3, &ids(&[vec![0, 1, 2]]), &ids(&[vec![1; 3]]), None)
        .unwrap();
    let (lp, ent) = model
        .head_logprobs_entropy_at(&hidden, &ids3, 1.0, &[false; 3])
        .unwrap();
    assert_eq!(lp.dims(), [1, 3]);
    assert_eq!(lp.to_vec2::<f32>().unwrap(), vec![vec![0.0; 3]]);
    assert_eq!(ent.to_vec2::<f32>().unwrap(), vec![vec![0.0; 3]]);
    let e = model
        .head_logprobs_entropy_at(&hidden, &ids3, 1.0, &[true; 2])
        .unwrap_err()
        .to_string();
    assert!(e.contains("keep") && e.contains("2 flags"), "{e}");
}
