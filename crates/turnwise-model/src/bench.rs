//! Timing probes (ignored by default): `cargo test -p turnwise-model --release -- --ignored
//! --nocapture bench`. They print figures; they assert nothing about speed.

use std::time::Instant;

use candle_core::{DType, Device, Tensor};

use crate::logprobs::logprobs_and_entropy;
use crate::model::weights::{init_varmap, sorted_vars};
use crate::model::{ModelConfig, Transformer};
use crate::optim::{AdamW, AdamWConfig, Gradients};
use crate::sampling::{SamplingParams, generate};

fn config(hidden: usize, layers: usize, ffn: usize, vocab: usize) -> ModelConfig {
    let mut c = ModelConfig::tiny_qwen2(vocab);
    c.hidden_size = hidden;
    c.num_hidden_layers = layers;
    c.intermediate_size = ffn;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = hidden / 4;
    c
}

fn train_probe(name: &str, cfg: &ModelConfig, batch: usize, len: usize, steps: usize) {
    let dev = Device::Cpu;
    let vm = init_varmap(cfg, DType::F32, &dev, 0).unwrap();
    let model = Transformer::from_varmap(cfg, &vm).unwrap();
    let mut opt = AdamW::new(sorted_vars(&vm), AdamWConfig::default()).unwrap();
    let ids: Vec<u32> = (0..batch * len)
        .map(|i| (i * 7919 % cfg.vocab_size) as u32)
        .collect();
    let ids = Tensor::from_vec(ids, (batch, len), &dev).unwrap();
    let pos = Tensor::arange(0u32, len as u32, &dev)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
        .repeat((batch, 1))
        .unwrap();
    let mask = Tensor::ones((batch, len), DType::U32, &dev).unwrap();
    let mut best = f64::INFINITY;
    for _ in 0..steps {
        let t0 = Instant::now();
        let (lp, _) = logprobs_and_entropy(&model, &ids, &pos, &mask, &ids).unwrap();
        let loss = lp.mean_all().unwrap().neg().unwrap();
        let g = Gradients::from_grad_store(&loss.backward().unwrap(), opt.vars());
        let norm = g.global_norm().unwrap();
        opt.step_scaled(&g, 1e-3, Gradients::clip_factor(norm, 1.0))
            .unwrap();
        best = best.min(t0.elapsed().as_secs_f64());
    }
    println!(
        "{name}: {} params, train {batch}x{len}: {best:.3} s/step ({:.0} tok/s)",
        cfg.num_parameters(),
        (batch * len) as f64 / best
    );
}

fn sample_probe(name: &str, cfg: &ModelConfig, batch: usize, new: usize) {
    let vm = init_varmap(cfg, DType::F32, &Device::Cpu, 0).unwrap();
    let model = Transformer::detached_from_varmap(cfg, &vm).unwrap();
    let prompts: Vec<Vec<u32>> = (0..batch).map(|b| (0..32 + b as u32).collect()).collect();
    let seeds: Vec<u64> = (0..batch as u64).collect();
    let params = SamplingParams {
        max_new_tokens: new,
        ..Default::default()
    };
    let t0 = Instant::now();
    let out = generate(&model, &prompts, &seeds, &params, None).unwrap();
    let dt = t0.elapsed().as_secs_f64();
    let n: usize = out.iter().map(|c| c.tokens.len()).sum();
    println!(
        "{name}: sample batch {batch}: {:.0} tok/s ({n} tokens in {dt:.2} s)",
        n as f64 / dt
    );
}

#[test]
#[ignore = "timing probe"]
fn bench_quickstart_and_size_a() {
    let quick = config(128, 4, 384, 1300);
    train_probe("quickstart 0.92M", &quick, 16, 120, 4);
    sample_probe("quickstart 0.92M", &quick, 1, 128);
    sample_probe("quickstart 0.92M", &quick, 16, 128);
    let a = config(256, 4, 768, 4096);
    train_probe("size A", &a, 8, 256, 3);
    sample_probe("size A", &a, 1, 128);
    sample_probe("size A", &a, 8, 128);
}

#[test]
#[ignore = "timing probe"]
fn bench_decode_step_breakdown() {
    let cfg = config(256, 4, 768, 4096);
    let dev = Device::Cpu;
    let vm = init_varmap(&cfg, DType::F32, &dev, 0).unwrap();
    let model = Transformer::detached_from_varmap(&cfg, &vm).unwrap();
    let mut cache = crate::model::KvCache::new(cfg.num_hidden_layers);
    let ids = Tensor::new(&[[1u32]], &dev).unwrap();
    let n = 128;
    let t0 = Instant::now();
    for i in 0..n {
        let pos = Tensor::new(&[[i as u32]], &dev).unwrap();
        let mask = Tensor::ones((1, i + 1), DType::U32, &dev).unwrap();
        let h = model
            .forward_hidden(&ids, &pos, &mask, Some(&mut cache))
            .unwrap();
        let _ = model
            .logits(&h)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
    }
    let fwd = t0.elapsed().as_secs_f64() / n as f64;
    let logits: Vec<f32> = (0..4096).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut rng = crate::rng::TurnRng::seed_from_u64(0);
    let p = SamplingParams {
        top_p: 0.9,
        ..Default::default()
    };
    let t0 = Instant::now();
    for _ in 0..n {
        crate::sampling::sample_row(&logits, &p, &mut rng);
    }
    let smp = t0.elapsed().as_secs_f64() / n as f64;
    println!(
        "size A decode: forward {:.3} ms/token, sample_row {:.3} ms/token",
        fwd * 1e3,
        smp * 1e3
    );
}

#[test]
#[ignore = "timing probe"]
fn bench_matvec_layouts() {
    let dev = Device::Cpu;
    for (out, inp) in [(4096usize, 256usize), (768, 256), (256, 256)] {
        let w = Tensor::randn(0f32, 1.0, (out, inp), &dev).unwrap();
        let x = Tensor::randn(0f32, 1.0, (1, inp), &dev).unwrap();
        let n = 500;
        let t0 = Instant::now();
        for _ in 0..n {
            let _ = x.matmul(&w.t().unwrap()).unwrap();
        }
        let a = t0.elapsed().as_secs_f64() / n as f64;
        let t0 = Instant::now();
        for _ in 0..n {
            let _ = w
                .matmul(&x.t().unwrap())
                .unwrap()
                .t()
                .unwrap()
                .contiguous()
                .unwrap();
        }
        let b = t0.elapsed().as_secs_f64() / n as f64;
        println!(
            "matvec {out}x{inp}: x·Wᵀ {:.1} µs, (W·xᵀ)ᵀ {:.1} µs",
            a * 1e6,
            b * 1e6
        );
    }
}
