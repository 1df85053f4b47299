//! LoRA end to end: a tiny `turnwise train` run with `model.lora.rank = 4` trains the adapters
//! only (the base weights of every checkpoint are the same bytes), logs the trainable parameter
//! count, resumes exactly, and exports a merged model that computes what base + adapters do.

mod common;

use std::path::Path;

use candle_core::{DType, Device};
use turnwise::config::TrainConfig;
use turnwise::pipeline::{RunOptions, resume, run};
use turnwise_model::Transformer;
use turnwise_model::checkpoint::ADAPTER_DIR;
use turnwise_model::model::lora::{
    ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, load_peft_adapter, merge_adapters,
};
use turnwise_model::model::weights::{load_hf, load_safetensors};

fn lora_sets() -> Vec<String> {
    let mut sets = common::tiny_overrides();
    sets.extend(
        [
            "run.steps=4",
            "run.save_every=2",
            "run.keep_checkpoints=3",
            "eval.questions=3",
            "model.lora.rank=4",
            "model.lora.alpha=8",
            "model.lora.dropout=0.05",
            "model.lora.target_modules=[\"q_proj\", \"v_proj\", \"o_proj\", \"down_proj\"]",
            // LoRA learns with larger steps than full fine-tuning.
            "optim.lr=1e-2",
            "sft.lr=1e-2",
        ]
        .map(String::from),
    );
    sets
}

fn read(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Logits of `ids` from a checkpoint folder read as base + PEFT adapter.
fn lora_logits(ck: &Path, ids: &[u32]) -> Vec<f32> {
    let (cfg, base) = load_hf(ck, DType::F32, &Device::Cpu).unwrap();
    let (lc, ad) = load_peft_adapter(ck.join(ADAPTER_DIR), DType::F32, &Device::Cpu).unwrap();
    Transformer::from_tensors(&cfg, &base, "base")
        .unwrap()
        .with_lora(&lc, &ad, None)
        .unwrap()
        .forward_sequence(ids)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

#[test]
fn a_lora_run_trains_only_the_adapters_resumes_and_exports_merged() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = TrainConfig::resolve(Some("grpo"), None, &lora_sets()).unwrap();
    let a = tmp.path().join("a");
    run(
        cfg,
        &RunOptions {
            dir: a.clone(),
            quiet: true,
        },
        false,
    )
    .unwrap();
    let ck = |dir: &Path, step: u32| dir.join(format!("checkpoints/step-{step:05}"));

    // The trainable parameter count: the adapters' (rank 4 on q, v, o and down of 2 layers:
    // hidden 32, q 32, kv 16, intermediate 64), far below the model's.
    let timing = common::phase_lines(&a.join("metrics.jsonl"), "timing");
    let line = std::fs::read_to_string(a.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|v| v["phase"] == "timing")
        .unwrap();
    assert!(!timing.is_empty());
    let expected = 2 * 4 * ((32 + 32) + (32 + 16) + (32 + 32) + (64 + 32));
    assert_eq!(
        line["model/trainable_parameters"].as_f64(),
        Some(expected as f64)
    );
    let total = line["model/parameters"].as_f64().unwrap();
    assert!(total > 10.0 * expected as f64, "{total} parameters");
    // LoRA dropout draws a mask per row and position: no prefix is run once for several rows
    // (it would share one mask among them), although the G rollouts share their prompt.
    let rl = common::phase_lines(&a.join("metrics.jsonl"), "train");
    let shared: Vec<f64> = rl
        .iter()
        .filter_map(|v| v["actor/shared_prefix_tokens"].as_f64())
        .collect();
    assert!(!shared.is_empty(), "no RL step logged the shared tokens");
    assert!(shared.iter().all(|&x| x == 0.0), "{shared:?}");

    // The base weights are the same bytes in every checkpoint; the adapters moved (warm start,
    // then RL); the optimizer holds the adapters' moments only.
    let base0 = read(&ck(&a, 0).join("model.safetensors"));
    for step in [2, 4] {
        assert!(
            read(&ck(&a, step).join("model.safetensors")) == base0,
            "the base weights changed by step {step}"
        );
    }
    let adapters = |step| read(&ck(&a, step).join(ADAPTER_DIR).join(ADAPTER_WEIGHTS_FILE));
    assert!(
        adapters(0) != adapters(4),
        "the adapters did not move in RL"
    );
    let ad4 = load_safetensors(
        ck(&a, 4).join(ADAPTER_DIR).join(ADAPTER_WEIGHTS_FILE),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let zero_b = ad4
        .iter()
        .filter(|(k, t)| {
            k.contains("lora_B")
                && t.abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap()
                    == 0.0
        })
        .count();
    assert_eq!(zero_b, 0, "every B left zero");
    let opt = load_safetensors(
        ck(&a, 4).join("optimizer.safetensors"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    assert_eq!(opt.len(), 2 * ad4.len());
    assert!(opt.keys().all(|k| k.contains(".lora_")), "{:?}", opt.keys());
    let ac: serde_json::Value = serde_json::from_slice(&read(
        &ck(&a, 4).join(ADAPTER_DIR).join(ADAPTER_CONFIG_FILE),
    ))
    .unwrap();
    assert_eq!(ac["peft_type"], "LORA");
    assert_eq!(ac["r"], 4);
    // The training metrics move.
    let train = common::phase_lines(&a.join("metrics.jsonl"), "train");
    assert_eq!(train.len(), 4);
    assert!(
        train
            .windows(2)
            .any(|w| w[0]["actor/entropy"] != w[1]["actor/entropy"]),
        "{train:?}"
    );
    let sft = common::phase_lines(&a.join("metrics.jsonl"), "sft");
    assert!(!sft.is_empty());

    // The warm-started model (the KL reference a resume reloads) is merged, with its adapters.
    let ws = a.join(turnwise::pipeline::REFERENCE_DIR);
    assert!(ws.join(ADAPTER_DIR).join(ADAPTER_CONFIG_FILE).is_file());

    // Resume after a "kill" past step 2: the same adapters, optimizer state and metrics.
    let b = tmp.path().join("b");
    common::copy_dir(&a, &b);
    std::fs::remove_file(ck(&b, 4).join("COMPLETE")).unwrap();
    resume(&b, true).unwrap();
    for f in [
        format!("{ADAPTER_DIR}/{ADAPTER_WEIGHTS_FILE}"),
        "optimizer.safetensors".to_string(),
        "model.safetensors".to_string(),
    ] {
        assert!(
            read(&ck(&a, 4).join(&f)) == read(&ck(&b, 4).join(&f)),
            "{f} differs after resume"
        );
    }
    assert_eq!(
        common::phase_lines(&a.join("metrics.jsonl"), "train"),
        common::phase_lines(&b.join("metrics.jsonl"), "train"),
        "metrics of the resumed run differ"
    );

    // `turnwise export`: the merged model, a plain Hugging Face folder, with the adapters in
    // PEFT's layout beside it; its logits are base + adapters' within 1e-5 (f32 rounding of
    // the two orders of summation, see turnwise-model's lora tests).
    let out = tmp.path().join("export");
    turnwise::checkpoints::export_checkpoint(&a, None, &out, false).unwrap();
    assert!(
        !out.join(ADAPTER_CONFIG_FILE).exists(),
        "a plain model at the root"
    );
    assert!(out.join(ADAPTER_DIR).join(ADAPTER_WEIGHTS_FILE).is_file());
    let ids = [1u32, 5, 9, 2, 7, 3];
    let (mc, merged) = load_hf(&out, DType::F32, &Device::Cpu).unwrap();
    let exported = Transformer::from_tensors(&mc, &merged, "export")
        .unwrap()
        .forward_sequence(&ids)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let lora = lora_logits(&ck(&a, 4), &ids);
    let d = exported
        .iter()
        .zip(&lora)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(
        d <= 1e-5,
        "merged export differs from base + adapters by {d}"
    );
    let (_, base) = load_hf(ck(&a, 4), DType::F32, &Device::Cpu).unwrap();
    let (lc, ad) =
        load_peft_adapter(ck(&a, 4).join(ADAPTER_DIR), DType::F32, &Device::Cpu).unwrap();
    let remerged = merge_adapters(&mc, &lc, &base, &ad).unwrap();
    let w = "model.layers.1.self_attn.o_proj.weight";
    assert_ne!(
        base[w].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        merged[w].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        "the export is not the base"
    );
    assert_eq!(
        remerged[w].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        merged[w].flatten_all().unwrap().to_vec1::<f32>().unwrap()
    );
}

#[test]
fn a_lora_checkpoint_is_refused_by_a_full_fine_tuning_config() {
    let tmp = tempfile::tempdir().unwrap();
    let mut sets = lora_sets();
    sets.extend(["run.steps=0", "eval.greedy=false", "eval.sampled=false"].map(String::from));
    let cfg = TrainConfig::resolve(Some("grpo"), None, &sets).unwrap();
    let a = tmp.path().join("a");
    run(
        cfg.clone(),
        &RunOptions {
            dir: a.clone(),
            quiet: true,
        },
        false,
    )
    .unwrap();
    let mut full = cfg;
    full.model.lora.rank = 0;
    let ck = a.join("checkpoints/step-00000");
    let e = match turnwise::trainer::Trainer::load(full, &ck, None) {
        Ok(_) => panic!("a LoRA checkpoint loaded as full fine-tuning"),
        Err(e) => format!("{e:#}"),
    };
    assert!(e.contains("model.lora.rank"), "{e}");
}

/// Median seconds of one training step (forward, token log-probs, backward, AdamW) on
/// `batch` × `len` tokens, with the trained variables of `lora` (`None`: every weight).
fn step_seconds(
    cfg: &turnwise_model::ModelConfig,
    base: &candle_nn::VarMap,
    lora: Option<&turnwise_model::LoraConfig>,
    batch: usize,
    len: usize,
    steps: usize,
) -> (f64, usize) {
    use candle_core::Tensor;
    use turnwise_model::logprobs::logprobs_and_entropy;
    use turnwise_model::model::lora::init_adapters;
    use turnwise_model::model::weights::sorted_vars;
    use turnwise_model::optim::{AdamW, AdamWConfig, Gradients};
    let dev = Device::Cpu;
    let adapters = lora.map(|l| init_adapters(cfg, l, DType::F32, &dev, 1).unwrap());
    let (model, vars) = match (lora, &adapters) {
        (Some(l), Some(a)) => (
            Transformer::lora_from_varmaps(cfg, base, l, a, None).unwrap(),
            sorted_vars(a),
        ),
        _ => (
            Transformer::from_varmap(cfg, base).unwrap(),
            sorted_vars(base),
        ),
    };
    let trainable = vars.iter().map(|(_, v)| v.elem_count()).sum();
    let mut opt = AdamW::new(vars, AdamWConfig::default()).unwrap();
    let toks: Vec<u32> = (0..batch * (len + 1))
        .map(|i| ((i * 7919 + 13) % cfg.vocab_size) as u32)
        .collect();
    let all = Tensor::from_vec(toks, (batch, len + 1), &dev).unwrap();
    let ids = all.narrow(1, 0, len).unwrap();
    let targets = all.narrow(1, 1, len).unwrap();
    let pos = Tensor::arange(0u32, len as u32, &dev)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
        .repeat((batch, 1))
        .unwrap();
    let mask = Tensor::ones((batch, len), DType::U32, &dev).unwrap();
    let mut times = Vec::new();
    for step in 0..=steps {
        let t0 = std::time::Instant::now();
        let (logp, _) = logprobs_and_entropy(&model, &ids, &pos, &mask, &targets).unwrap();
        let loss = logp.mean_all().unwrap().neg().unwrap();
        let g = Gradients::from_grad_store(&loss.backward().unwrap(), opt.vars());
        opt.step(&g, 1e-4).unwrap();
        if step > 0 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], trainable)
}

/// Step time with and without LoRA on the tiny test model and (when the cache holds it) on
/// SmolLM2-135M-Instruct: prints the figures docs/results.md quotes. Timing only; run with
/// `cargo test --release -p turnwise --test lora -- --ignored --nocapture`.
#[test]
#[ignore = "timing, prints figures"]
fn lora_step_time() {
    use turnwise_model::LoraConfig;
    use turnwise_model::model::weights::init_varmap;
    let mut models = vec![(
        "tiny (hidden 32, 2 layers)".to_string(),
        turnwise::trainer::fresh_model_config(
            &TrainConfig::resolve(Some("grpo"), None, &common::tiny_overrides()).unwrap(),
            200,
        ),
        None,
        8,
        64,
        20,
    )];
    let cache = turnwise_env::corpus::wiki::default_cache_dir();
    let gguf = cache.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if gguf.is_file() {
        let m =
            turnwise::model_source::load_init_model(Path::new("smollm2-135m-instruct")).unwrap();
        models.push((
            "SmolLM2-135M".to_string(),
            m.config,
            Some(m.varmap),
            4,
            128,
            3,
        ));
    } else {
        eprintln!("SmolLM2 not cached in {}: tiny model only", cache.display());
    }
    for (name, cfg, base, batch, len, steps) in models {
        let base = base.unwrap_or_else(|| init_varmap(&cfg, DType::F32, &Device::Cpu, 0).unwrap());
        let rank8 = LoraConfig {
            rank: 8,
            ..LoraConfig::default()
        };
        let rank8_all = LoraConfig {
            target_modules: turnwise_model::model::lora::LORA_TARGETS
                .map(String::from)
                .to_vec(),
            ..rank8.clone()
        };
        for (what, lora) in [
            ("full fine-tuning", None),
            ("LoRA r=8 q,v", Some(&rank8)),
            ("LoRA r=8 all 7", Some(&rank8_all)),
        ] {
            let (s, n) = step_seconds(&cfg, &base, lora, batch, len, steps);
            eprintln!(
                "{name}: {what}: {n} trainable of {} parameters, {:.1} ms per step \
                 ({batch}×{len} tokens)",
                cfg.num_parameters(),
                s * 1e3
            );
        }
    }
}
