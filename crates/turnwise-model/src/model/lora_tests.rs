//! LoRA: step 0 is the base model, training moves only the adapters, merging is exact, PEFT
//! loads the adapters with the same logits, checkpoints resume exactly.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;

use super::*;
use crate::checkpoint::{
    ADAPTER_DIR, Checkpoint, LoraAdapters, LoraParts, TrainerState, load_checkpoint,
    save_checkpoint_with_lora,
};
use crate::model::Transformer;
use crate::model::transformer::varmap_tensors;
use crate::model::weights::{export_hf_tensors, init_varmap, load_hf, sorted_vars};
use crate::optim::tests::{SEQ, nll};
use crate::optim::{AdamW, AdamWConfig, Gradients};

fn all_targets() -> LoraConfig {
    LoraConfig {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        target_modules: LORA_TARGETS.map(String::from).to_vec(),
        layers_to_transform: None,
    }
}

fn logits(model: &Transformer) -> Vec<f32> {
    model
        .forward_sequence(&SEQ)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// Overwrites every `B` with random values, as after training, so that the adapters matter.
fn randomize_b(adapters: &VarMap, seed: u64) {
    let mut rng = TurnRng::seed_from_u64(seed);
    for (name, var) in sorted_vars(adapters) {
        if name.ends_with("lora_B.weight") {
            let n = var.elem_count();
            let v: Vec<f32> = (0..n).map(|_| (rng.normal() * 0.2) as f32).collect();
            var.set(&Tensor::from_vec(v, var.shape(), &Device::Cpu).unwrap())
                .unwrap();
        }
    }
}

#[test]
fn lora_config_is_validated_with_the_field_named() {
    let ok = all_targets();
    ok.validate().unwrap();
    let bad = |f: fn(&mut LoraConfig), field: &str| {
        let mut c = all_targets();
        f(&mut c);
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains(&format!("`{field}`")), "{e}");
    };
    bad(|c| c.rank = 0, "r");
    bad(|c| c.alpha = 0.0, "lora_alpha");
    bad(|c| c.dropout = 1.0, "lora_dropout");
    bad(|c| c.target_modules.clear(), "target_modules");
    bad(|c| c.target_modules = vec!["qkv".into()], "target_modules");
    bad(
        |c| c.target_modules = vec!["q_proj".into(), "q_proj".into()],
        "target_modules",
    );
    // PEFT's JSON round-trips.
    let back = LoraConfig::from_peft_json(&ok.to_peft_json(Some("m"))).unwrap();
    assert_eq!(back, ok);
    let defaults = LoraConfig::default();
    assert_eq!(defaults.target_modules, ["q_proj", "v_proj"]);
    assert_eq!(defaults.alpha, 8.0);
}

#[test]
fn lora_parameter_count_and_shapes() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let lora = all_targets();
    let n: usize = lora
        .adapter_shapes(&cfg)
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    assert_eq!(n, lora.num_parameters(&cfg));
    let h = cfg.hidden_size;
    let q = cfg.num_attention_heads * cfg.head_dim;
    let kv = cfg.num_key_value_heads * cfg.head_dim;
    let i = cfg.intermediate_size;
    let per_layer = 4 * ((q + h) + 2 * (kv + h) + (h + q) + 2 * (i + h) + (h + i));
    assert_eq!(n, cfg.num_hidden_layers * per_layer);
    let shapes: HashMap<_, _> = lora.adapter_shapes(&cfg).into_iter().collect();
    assert_eq!(shapes["model.layers.0.mlp.down_proj.lora_A.weight"], [4, i]);
    assert_eq!(
        shapes["model.layers.1.self_attn.k_proj.lora_B.weight"],
        [kv, 4]
    );
}

/// (a) Fresh adapters (B = 0) leave the logits as the base model's: exactly in the sampler,
/// and to rounding in the trained model. (On a CPU with AVX-512, graph-free layers of up to
/// `LINEAR_MAX_ROWS` rows run the sampling kernel of `ops::infer`, whose sums round otherwise
/// than candle's matmul; the trained model's layers after the first adapter track gradients
/// and take the matmul. Without AVX-512 both take the matmul and agree exactly.)
#[test]
fn lora_step0_logits_equal_the_base_models() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let base = init_varmap(&cfg, DType::F32, &Device::Cpu, 3).unwrap();
    let lora = all_targets();
    let adapters = init_adapters(&cfg, &lora, DType::F32, &Device::Cpu, 5).unwrap();
    let plain = logits(&Transformer::detached_from_varmap(&cfg, &base).unwrap());
    let trained = Transformer::lora_from_varmaps(&cfg, &base, &lora, &adapters, None).unwrap();
    let sampler = Transformer::lora_detached_from_varmaps(&cfg, &base, &lora, &adapters).unwrap();
    assert!(trained.has_lora() && trained.tracks_gradients());
    assert!(sampler.has_lora() && !sampler.tracks_gradients());
    assert!(max_abs_diff(&logits(&trained), &plain) < 1e-5);
    assert_eq!(logits(&sampler), plain);
    // A is not zero: the adapters are live, only B starts at zero.
    let a = &varmap_tensors(&adapters, true)["model.layers.0.self_attn.q_proj.lora_A.weight"];
    let bound = 1.0 / (cfg.hidden_size as f32).sqrt();
    let v = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert!(v.iter().all(|x| x.abs() <= bound) && v.iter().any(|x| x.abs() > bound / 2.0));
}

/// (b) Training steps leave every base weight bit-identical and move the adapters; the sampler
/// (detached views) sees the moved adapters without any copy.
#[test]
fn lora_training_moves_only_the_adapters() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let base = init_varmap(&cfg, DType::F32, &Device::Cpu, 3).unwrap();
    let lora = LoraConfig {
        dropout: 0.1,
        ..all_targets()
    };
    let adapters = init_adapters(&cfg, &lora, DType::F32, &Device::Cpu, 5).unwrap();
    let before_base: HashMap<String, Vec<u32>> = varmap_tensors(&base, true)
        .iter()
        .map(|(k, t)| (k.clone(), bits(&t.copy().unwrap())))
        .collect();
    let before_adapters: HashMap<String, Vec<u32>> = varmap_tensors(&adapters, true)
        .iter()
        .map(|(k, t)| (k.clone(), bits(&t.copy().unwrap())))
        .collect();
    let dropout = LoraDropout::new(lora.dropout, 1);
    let model =
        Transformer::lora_from_varmaps(&cfg, &base, &lora, &adapters, Some(dropout.clone()))
            .unwrap();
    let sampler = Transformer::lora_detached_from_varmaps(&cfg, &base, &lora, &adapters).unwrap();
    let mut opt = AdamW::new(sorted_vars(&adapters), AdamWConfig::default()).unwrap();
    let first = nll(&model, &SEQ).to_scalar::<f32>().unwrap();
    let sampler_first = logits(&sampler);
    for _ in 0..10 {
        let loss = nll(&model, &SEQ);
        let store = loss.backward().unwrap();
        // No gradient reaches a base weight.
        for t in varmap_tensors(&base, false).values() {
            assert!(store.get(t).is_none());
        }
        let g = Gradients::from_grad_store(&store, opt.vars());
        assert_eq!(g.len(), lora.adapter_shapes(&cfg).len());
        opt.step(&g, 1e-2).unwrap();
    }
    assert!(dropout.calls() > 0, "dropout ran in the training forwards");
    for (name, t) in varmap_tensors(&base, true) {
        assert_eq!(bits(&t), before_base[&name], "base weight {name} changed");
    }
    let moved = varmap_tensors(&adapters, true)
        .iter()
        .filter(|(k, t)| bits(t) != before_adapters[*k])
        .count();
    assert_eq!(moved, before_adapters.len(), "every adapter moved");
    let last = nll(&model, &SEQ).to_scalar::<f32>().unwrap();
    assert!(last < first - 0.1, "the adapters learn: {first} → {last}");
    assert!(max_abs_diff(&logits(&sampler), &sampler_first) > 1e-3);
}

/// Dropout runs in training forwards only: two forwards of the trained model differ, the
/// sampler's do not, and without dropout the trained model equals the sampler (to rounding:
/// the two take different kernels on a CPU with AVX-512, as in the test above).
#[test]
fn lora_dropout_only_in_training_forwards() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let base = init_varmap(&cfg, DType::F32, &Device::Cpu, 3).unwrap();
    let lora = LoraConfig {
        dropout: 0.5,
        ..all_targets()
    };
    let adapters = init_adapters(&cfg, &lora, DType::F32, &Device::Cpu, 5).unwrap();
    randomize_b(&adapters, 2);
    let d = LoraDropout::new(0.5, 9);
    let trained =
        Transformer::lora_from_varmaps(&cfg, &base, &lora, &adapters, Some(d.clone())).unwrap();
    let sampler = Transformer::lora_detached_from_varmaps(&cfg, &base, &lora, &adapters).unwrap();
    assert!(max_abs_diff(&logits(&trained), &logits(&trained)) > 1e-4);
    assert_eq!(logits(&sampler), logits(&sampler));
    // The mask sequence is reproducible from the counter.
    d.set_calls(0);
    let a = logits(&trained);
    d.set_calls(0);
    assert_eq!(logits(&trained), a);
    let no_dropout = Transformer::lora_from_varmaps(&cfg, &base, &lora, &adapters, None).unwrap();
    assert!(max_abs_diff(&logits(&no_dropout), &logits(&sampler)) < 1e-5);
}

/// (c) The merged weights (`W + alpha/r · B A`), written as a Hugging Face folder and read
/// back, give the LoRA forward's logits within 1e-5. The two compute the same function with
/// different f32 rounding: `x (W + sBA)ᵀ` against `x Wᵀ + s (x Aᵀ) Bᵀ`, each product a sum of at
/// most 88 terms of size about 1, through 2 layers; the logits are O(1) and float32's relative
/// precision 6e-8, so differences of a few 1e-7 are expected and 1e-5 leaves margin while still
/// catching a wrong scale or transposition (those move logits by 1e-2 and more here).
#[test]
fn lora_merged_export_matches_the_lora_forward() {
    let mut cfg = ModelConfig::tiny_qwen2(96);
    cfg.initializer_range = 0.3;
    let base = init_varmap(&cfg, DType::F32, &Device::Cpu, 3).unwrap();
    let lora = all_targets();
    let adapters = init_adapters(&cfg, &lora, DType::F32, &Device::Cpu, 5).unwrap();
    randomize_b(&adapters, 2);
    let ours =
        logits(&Transformer::lora_detached_from_varmaps(&cfg, &base, &lora, &adapters).unwrap());
    let plain = logits(&Transformer::detached_from_varmap(&cfg, &base).unwrap());
    assert!(
        max_abs_diff(&ours, &plain) > 1e-2,
        "the adapters change the logits"
    );
    let merged = merge_adapters(
        &cfg,
        &lora,
        &varmap_tensors(&base, true),
        &varmap_tensors(&adapters, true),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    export_hf_tensors(dir.path(), &cfg, &merged).unwrap();
    let (cfg2, w) = load_hf(dir.path(), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(cfg2, cfg);
    assert!(!w.keys().any(|k| k.contains("lora")), "a plain model");
    let back = logits(&Transformer::from_tensors(&cfg2, &w, "merged").unwrap());
    let d = max_abs_diff(&back, &ours);
    eprintln!("merged vs LoRA forward: max |Δ logit| = {d:e}");
    assert!(d <= 1e-5, "merged logits differ by {d}");
}

/// The adapter folder has PEFT's layout and names, and reads back.
#[test]
fn lora_adapter_folder_has_pefts_layout() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let lora = LoraConfig::default();
    let adapters = init_adapters(&cfg, &lora, DType::F32, &Device::Cpu, 5).unwrap();
    let dir = tempfile::tempdir().unwrap();
    save_peft_adapter(
        dir.path(),
        &lora,
        &varmap_tensors(&adapters, true),
        Some("smollm2-135m-instruct"),
    )
    .unwrap();
    let v: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join(ADAPTER_CONFIG_FILE)).unwrap(),
    )
    .unwrap();
    assert_eq!(v["peft_type"], "LORA");
    assert_eq!(v["task_type"], "CAUSAL_LM");
    assert_eq!(v["r"], 8);
    assert_eq!(v["lora_alpha"], 8.0);
    assert_eq!(v["lora_dropout"], 0.0);
    assert_eq!(v["target_modules"], json!(["q_proj", "v_proj"]));
    assert_eq!(v["base_model_name_or_path"], "smollm2-135m-instruct");
    let raw = load_safetensors(
        dir.path().join(ADAPTER_WEIGHTS_FILE),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    assert_eq!(raw.len(), 2 * 2 * cfg.num_hidden_layers);
    for k in [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight",
    ] {
        assert!(raw.contains_key(k), "{k} in {:?}", raw.keys());
    }
    let (lc, t) = load_peft_adapter(dir.path(), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(lc, lora);
    let vm = adapters_varmap(&cfg, &lc, &t, "adapter").unwrap();
    assert_eq!(vm.all_vars().len(), 2 * 2 * cfg.num_hidden_layers);
}

/// A LoRA checkpoint (frozen base + PEFT adapter folder + the adapters' optimizer moments)
/// resumes bit-identically, dropout included.
#[test]
fn lora_checkpoint_resumes_bit_identically() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let lora = LoraConfig {
        dropout: 0.1,
        ..all_targets()
    };
    let train = |base: &VarMap, l: &LoraAdapters, opt: &mut AdamW, d: &LoraDropout, n: usize| {
        let m = Transformer::lora_from_varmaps(&cfg, base, &l.config, &l.adapters, Some(d.clone()))
            .unwrap();
        for _ in 0..n {
            let loss = nll(&m, &SEQ);
            let g = Gradients::from_grad_store(&loss.backward().unwrap(), opt.vars());
            opt.step(&g, 1e-2).unwrap();
        }
    };
    let fresh = || {
        let base = init_varmap(&cfg, DType::F32, &Device::Cpu, 3).unwrap();
        let adapters = init_adapters(&cfg, &lora, DType::F32, &Device::Cpu, 5).unwrap();
        let opt = AdamW::new(sorted_vars(&adapters), AdamWConfig::default()).unwrap();
        let l = LoraAdapters {
            config: lora.clone(),
            adapters,
        };
        (base, l, opt, LoraDropout::new(lora.dropout, 7))
    };
    let (base_a, l_a, mut opt_a, d_a) = fresh();
    train(&base_a, &l_a, &mut opt_a, &d_a, 6);

    let (base_b, l_b, mut opt_b, d_b) = fresh();
    train(&base_b, &l_b, &mut opt_b, &d_b, 3);
    let dir = tempfile::tempdir().unwrap();
    let mut state = TrainerState::for_optimizer(&opt_b);
    state.extra = json!({"lora_dropout_calls": d_b.calls()});
    let parts = LoraParts {
        lora: &l_b,
        base_model_name_or_path: Some("base"),
    };
    save_checkpoint_with_lora(dir.path(), &cfg, &base_b, Some(parts), &opt_b, &state).unwrap();
    assert!(
        dir.path()
            .join(ADAPTER_DIR)
            .join(ADAPTER_WEIGHTS_FILE)
            .is_file()
    );
    let moments = load_safetensors(
        dir.path().join("optimizer.safetensors"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    assert!(
        moments.keys().all(|k| k.contains("lora_")),
        "only adapter moments"
    );

    let Checkpoint {
        varmap: base_c,
        optimizer: mut opt_c,
        lora: l_c,
        state: st,
        ..
    } = load_checkpoint(dir.path(), DType::F32, &Device::Cpu).unwrap();
    let l_c = l_c.expect("a LoRA checkpoint");
    assert_eq!(l_c.config, lora);
    let d_c = LoraDropout::new(lora.dropout, 7);
    d_c.set_calls(st.extra["lora_dropout_calls"].as_u64().unwrap());
    train(&base_c, &l_c, &mut opt_c, &d_c, 3);
    for (name, t) in varmap_tensors(&l_a.adapters, true) {
        assert_eq!(
            bits(&t),
            bits(&varmap_tensors(&l_c.adapters, true)[&name]),
            "{name} differs after resume"
        );
    }
    for (name, t) in varmap_tensors(&base_a, true) {
        assert_eq!(
            bits(&t),
            bits(&varmap_tensors(&base_c, true)[&name]),
            "{name}"
        );
    }
}

/// The script [`peft_loads_the_adapters_with_the_same_logits`] runs: the base folder with the
/// adapter folder through `peft.PeftModel`, and the merged folder as a plain model.
const PEFT_SCRIPT: &str = r#"
import json, sys
import torch
from transformers import AutoModelForCausalLM
from peft import PeftModel
r = json.load(open(sys.argv[1]))
base = AutoModelForCausalLM.from_pretrained(r["base"], dtype=torch.float32).eval()
peft_model = PeftModel.from_pretrained(base, r["adapter"]).eval()
merged = AutoModelForCausalLM.from_pretrained(r["merged"], dtype=torch.float32).eval()
ids = torch.tensor([r["ids"]])
with torch.no_grad():
    out = {"peft": peft_model(ids).logits[0].tolist(), "merged": merged(ids).logits[0].tolist(),
           "peft_merged": peft_model.merge_and_unload()(ids).logits[0].tolist()}
json.dump(out, open(sys.argv[2], "w"))
"#;

/// (d) PEFT parity: our base export plus our adapter folder, loaded with `peft` on top of
/// `transformers`, give our LoRA forward's logits within 1e-4 (the tolerance of the plain
/// transformers parity test, `checkpoint::hf`: f32 on CPU, logits O(1), different kernels), as
/// do our merged export loaded as a plain model and PEFT's own `merge_and_unload`. Skipped, with
/// the reason printed, when `python3` (or `$TURNWISE_PYTHON`) cannot import peft, transformers
/// and torch.
#[test]
fn lora_peft_loads_the_adapters_with_the_same_logits() {
    peft_parity(None);
}

/// (d) with PEFT's `layers_to_transform`: adapters on the second decoder layer only.
#[test]
fn lora_peft_parity_with_layers_to_transform() {
    peft_parity(Some(vec![1]));
}

fn peft_parity(layers_to_transform: Option<Vec<usize>>) {
    use crate::model::weights::export_hf;
    use std::process::Command;

    let Some(python) = crate::python_check::python_with("peft, transformers, torch") else {
        return;
    };
    let mut cfg = ModelConfig::tiny_qwen2(96);
    cfg.initializer_range = 0.3;
    cfg.tie_word_embeddings = false;
    let base = init_varmap(&cfg, DType::F32, &Device::Cpu, 3).unwrap();
    let lora = LoraConfig {
        layers_to_transform,
        rank: 4,
        alpha: 12.0,
        dropout: 0.1,
        target_modules: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "down_proj",
        ]
        .map(String::from)
        .to_vec(),
    };
    let adapters = init_adapters(&cfg, &lora, DType::F32, &Device::Cpu, 5).unwrap();
    randomize_b(&adapters, 2);
    let ours = Transformer::lora_detached_from_varmaps(&cfg, &base, &lora, &adapters)
        .unwrap()
        .forward_sequence(&SEQ)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let (base_dir, adapter_dir, merged_dir) = (
        tmp.path().join("base"),
        tmp.path().join("adapter"),
        tmp.path().join("merged"),
    );
    export_hf(&base_dir, &cfg, &base).unwrap();
    let ad = varmap_tensors(&adapters, true);
    save_peft_adapter(&adapter_dir, &lora, &ad, base_dir.to_str()).unwrap();
    let merged = merge_adapters(&cfg, &lora, &varmap_tensors(&base, true), &ad).unwrap();
    export_hf_tensors(&merged_dir, &cfg, &merged).unwrap();
    let req = tmp.path().join("request.json");
    let res = tmp.path().join("result.json");
    let script = tmp.path().join("peft_check.py");
    std::fs::write(
        &req,
        json!({"base": base_dir, "adapter": adapter_dir, "merged": merged_dir, "ids": SEQ})
            .to_string(),
    )
    .unwrap();
    std::fs::write(&script, PEFT_SCRIPT).unwrap();
    let o = Command::new(&python)
        .arg(&script)
        .arg(&req)
        .arg(&res)
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "peft failed to load the adapters:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&res).unwrap()).unwrap();
    let plain = Transformer::detached_from_varmap(&cfg, &base)
        .unwrap()
        .forward_sequence(&SEQ)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let flat = |v: &[Vec<f32>]| v.concat();
    assert!(
        max_abs_diff(&flat(&plain), &flat(&ours)) > 1e-2,
        "the adapters change the logits"
    );
    for key in ["peft", "merged", "peft_merged"] {
        let theirs: Vec<Vec<f32>> = serde_json::from_value(r[key].clone()).unwrap();
        let d = max_abs_diff(&flat(&theirs), &flat(&ours));
        eprintln!("{key}: max |Δ logit| = {d:e}");
        assert!(d <= 1e-4, "{key}: logits differ by {d}");
    }
}

/// Batch-invariant sampling runs the adapters' products through the few-row kernel too: a
/// LoRA sampler's sampled sequence records the same bits with its 130-token prompt prefilled
/// whole and in chunks of 3 (red with the adapters left on `gemm`).
#[test]
fn batch_invariant_sampling_covers_the_adapters() {
    use crate::sampling::{EngineConfig, SamplingEngine, SamplingParams, SequenceParams};
    let cfg = ModelConfig::tiny_qwen2(96);
    let base = init_varmap(&cfg, DType::F32, &Device::Cpu, 3).unwrap();
    let lora = all_targets();
    let adapters = init_adapters(&cfg, &lora, DType::F32, &Device::Cpu, 5).unwrap();
    randomize_b(&adapters, 9);
    let sampler = Transformer::lora_detached_from_varmaps(&cfg, &base, &lora, &adapters).unwrap();
    let prompt: Vec<u32> = (0..130).map(|i| (i * 7 + 3) % 90 + 1).collect();
    let run = |chunk: usize| {
        let config = EngineConfig {
            batch_invariant: true,
            prefill_chunk: chunk,
            ..EngineConfig::default()
        };
        let mut eng = SamplingEngine::new(&sampler, None, config);
        let params = SequenceParams {
            sampling: SamplingParams {
                temperature: 1.0,
                max_new_tokens: 12,
                ..Default::default()
            },
            ..Default::default()
        };
        let id = eng.add_sequence(prompt.clone(), params, 4).unwrap();
        eng.run_until_stop(None).unwrap();
        let s = eng.sequence(id).unwrap();
        let lps: Vec<u32> = s.logprobs.iter().map(|x| x.to_bits()).collect();
        (s.tokens.clone(), lps)
    };
    assert_eq!(run(0), run(3));
}
