//! The GPU path against the CPU path, on whole models (forward, log-probs, entropies,
//! gradients, an AdamW step, sampling).
//!
//! On a CUDA device the fused CPU kernels of [`crate::model::ops`] are replaced by their
//! compositions of candle ops, and weights and activations are `bf16`
//! ([`crate::device::default_dtype`]) with `f32` optimizer state ([`crate::optim::AdamW`]).
//! The tests without `#[ignore]` check that recipe on the CPU, where it runs here: the
//! composed path ([`with_composed_ops`]) against the fused kernels in `f32`, and `bf16`
//! weights on the composed path against `f32`. The `#[ignore]`d ones run the same comparisons
//! on a CUDA device; they need a GPU and a build with the `cuda` feature (docs/scaling.md,
//! "Building with CUDA"):
//!
//! ```text
//! cargo test -p turnwise-model --features cuda --lib cuda_parity -- --ignored
//! ```
//!
//! Without a usable GPU they fail (they never pass vacuously).
//!
//! Tolerances (max abs difference of log-probs and entropies; gradients by their max abs
//! difference relative to the largest entry, or by cosine similarity for bf16):
//! - composed vs fused, `f32`: [`F32_FWD_TOL`], [`F32_GRAD_TOL`];
//! - `bf16` vs `f32`: [`BF16_FWD_TOL`], gradient cosine at least [`BF16_GRAD_COS`].

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

use crate::logprobs::logprobs_and_entropy;
use crate::model::ops::with_composed_ops;
use crate::model::weights::{convert_varmap, init_varmap, sorted_vars};
use crate::model::{ModelConfig, Transformer};
use crate::optim::{AdamW, AdamWConfig, Gradients};
use crate::sampling::{SamplingParams, generate};

/// Log-probs and entropies, `f32` composed vs fused (or CUDA vs CPU).
const F32_FWD_TOL: f64 = 1e-4;
/// Gradients, `f32`, relative to the largest gradient entry.
const F32_GRAD_TOL: f64 = 1e-3;
/// Log-probs and entropies (magnitudes about 4.5 here), `bf16` model vs `f32` model: bf16 keeps
/// 8 significant bits, about 0.4 % per rounding, over four layers of rounding.
const BF16_FWD_TOL: f64 = 0.15;
/// Cosine similarity of each parameter's gradient, `bf16` vs `f32`.
const BF16_GRAD_COS: f64 = 0.98;

/// The tiny configurations with a larger-than-default init (non-uniform attention).
fn configs() -> Vec<ModelConfig> {
    crate::model::tests::tiny_configs()
        .into_iter()
        .map(|mut c| {
            c.initializer_range = 0.2;
            c
        })
        .collect()
}

/// Two rows, the first left-padded by 2: `(ids, positions, key_mask, targets)` on `dev`.
fn batch(dev: &Device) -> [Tensor; 4] {
    let t = |v: [[u32; 6]; 2]| Tensor::new(&v, dev).unwrap();
    [
        t([[0, 0, 7, 3, 19, 4], [5, 11, 2, 8, 60, 1]]),
        t([[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]),
        t([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]),
        t([[0, 7, 3, 19, 4, 9], [11, 2, 8, 60, 1, 30]]),
    ]
}

/// What one path computes: log-probs and entropies of the real positions (`f32`, CPU) and each
/// parameter's gradient of a mixed objective (`f32`, CPU).
struct Run {
    logp: Vec<f32>,
    ent: Vec<f32>,
    grads: HashMap<String, Tensor>,
}

/// Copies the `f32` CPU `base` weights to `dtype` on `dev` and runs the batch forward and
/// backward there, with the fused CPU kernels (`composed: false`) or the compositions.
fn run(
    cfg: &ModelConfig,
    base: &candle_nn::VarMap,
    dev: &Device,
    dtype: DType,
    composed: bool,
) -> Run {
    let go = || {
        let vm = convert_varmap(cfg, base, dtype, dev).unwrap();
        let model = Transformer::from_varmap(cfg, &vm).unwrap();
        let [ids, pos, mask, targets] = batch(dev);
        let (logp, ent) = logprobs_and_entropy(&model, &ids, &pos, &mask, &targets).unwrap();
        let m = mask.to_dtype(logp.dtype()).unwrap();
        let w = Tensor::new(
            &[
                [0f32, 0., 1., -0.5, 0.7, 1.3],
                [0.4, 1.1, -0.9, 0.6, 0.2, 0.8],
            ],
            dev,
        )
        .unwrap()
        .to_dtype(logp.dtype())
        .unwrap();
        let loss = (((&logp * &w).unwrap() + (&ent * 0.3).unwrap()).unwrap() * &m)
            .unwrap()
            .sum_all()
            .unwrap();
        let store = loss.backward().unwrap();
        let grads = sorted_vars(&vm)
            .into_iter()
            .map(|(name, var)| {
                let g = store
                    .get(var.as_tensor())
                    .expect("every parameter has a gradient");
                (name, to_cpu_f32(g))
            })
            .collect();
        let real = |t: &Tensor| -> Vec<f32> {
            let v = to_cpu_f32(t)
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            // Row 0's first two positions are padding.
            v.into_iter()
                .enumerate()
                .filter(|(i, _)| *i >= 2)
                .map(|(_, x)| x)
                .collect()
        };
        Run {
            logp: real(&logp),
            ent: real(&ent),
            grads,
        }
    };
    if composed {
        with_composed_ops(go)
    } else {
        go()
    }
}

fn to_cpu_f32(t: &Tensor) -> Tensor {
    t.to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::from((x - y).abs()))
        .fold(0.0, f64::max)
}

/// `max |a − b| / max(1, max |b|)`.
fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    let scale = b
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
        .max(1.0);
    let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
    f64::from(d.to_scalar::<f32>().unwrap() / scale)
}

fn cosine(a: &Tensor, b: &Tensor) -> f64 {
    let dot = (a * b)
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let na = a
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
        .sqrt();
    let nb = b
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
        .sqrt();
    if na == 0.0 && nb == 0.0 {
        return 1.0;
    }
    f64::from(dot / (na * nb).max(f32::MIN_POSITIVE))
}

/// Asserts `got` matches the `f32` fused CPU reference `want` within the `f32` tolerances.
fn assert_close_f32(what: &str, got: &Run, want: &Run) {
    let fwd = max_abs_diff(&got.logp, &want.logp).max(max_abs_diff(&got.ent, &want.ent));
    assert!(
        fwd <= F32_FWD_TOL,
        "{what}: log-probs/entropies differ by {fwd:e}"
    );
    for (name, g) in &want.grads {
        let d = rel_diff(&got.grads[name], g);
        assert!(
            d <= F32_GRAD_TOL,
            "{what}: gradient of {name} differs by {d:e} (relative)"
        );
    }
}

/// Asserts the `bf16` run `got` matches the `f32` reference `want` within the bf16 tolerances.
fn assert_close_bf16(what: &str, got: &Run, want: &Run) {
    let fwd = max_abs_diff(&got.logp, &want.logp).max(max_abs_diff(&got.ent, &want.ent));
    assert!(
        fwd <= BF16_FWD_TOL,
        "{what}: log-probs/entropies differ by {fwd}"
    );
    for (name, g) in &want.grads {
        let c = cosine(&got.grads[name], g);
        assert!(
            c >= BF16_GRAD_COS,
            "{what}: gradient of {name} has cosine {c} to f32's"
        );
    }
}

#[test]
fn composed_ops_match_the_fused_cpu_kernels_on_whole_models() {
    for (i, cfg) in configs().iter().enumerate() {
        let base = init_varmap(cfg, DType::F32, &Device::Cpu, 40 + i as u64).unwrap();
        let fused = run(cfg, &base, &Device::Cpu, DType::F32, false);
        let composed = run(cfg, &base, &Device::Cpu, DType::F32, true);
        assert_close_f32(
            &format!("{:?} composed", cfg.architecture),
            &composed,
            &fused,
        );
    }
}

#[test]
fn bf16_weights_on_the_composed_path_track_f32() {
    for (i, cfg) in configs().iter().enumerate() {
        let base = init_varmap(cfg, DType::F32, &Device::Cpu, 50 + i as u64).unwrap();
        let reference = run(cfg, &base, &Device::Cpu, DType::F32, false);
        let bf16 = run(cfg, &base, &Device::Cpu, DType::BF16, true);
        assert_close_bf16(&format!("{:?} bf16", cfg.architecture), &bf16, &reference);
    }
}

/// Mean negative log-likelihood of `seq` under `model`.
fn nll(model: &Transformer, seq: &[u32]) -> Tensor {
    let dev = model.device();
    let t = seq.len() - 1;
    let ids = Tensor::new(&seq[..t], dev).unwrap().unsqueeze(0).unwrap();
    let targets = Tensor::new(&seq[1..], dev).unwrap().unsqueeze(0).unwrap();
    let pos = Tensor::arange(0u32, t as u32, dev)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let mask = Tensor::ones((1, t), DType::U32, dev).unwrap();
    let (logp, _) = logprobs_and_entropy(model, &ids, &pos, &mask, &targets).unwrap();
    logp.mean_all().unwrap().neg().unwrap()
}

/// Trains a tiny model in `dtype` on `dev` to memorise a sequence (40 AdamW steps); returns
/// the first and last loss. Asserts the optimizer state is `f32` for half-precision weights.
fn overfit(dev: &Device, dtype: DType) -> (f32, f32) {
    let cfg = ModelConfig::tiny_qwen2(96);
    let base = init_varmap(&cfg, DType::F32, &Device::Cpu, 0).unwrap();
    let vm = convert_varmap(&cfg, &base, dtype, dev).unwrap();
    let model = Transformer::from_varmap(&cfg, &vm).unwrap();
    let mut opt = AdamW::new(sorted_vars(&vm), AdamWConfig::default()).unwrap();
    let seq = crate::optim::tests::SEQ;
    let loss_of = |m: &Transformer| nll(m, &seq).to_dtype(DType::F32).unwrap();
    let first = loss_of(&model).to_scalar::<f32>().unwrap();
    for _ in 0..40 {
        let loss = loss_of(&model);
        let mut g = Gradients::from_grad_store(&loss.backward().unwrap(), opt.vars());
        assert!(g.clip_global_norm(1.0).unwrap().is_finite());
        opt.step(&g, 1e-2).unwrap();
    }
    for (name, t) in opt.state_tensors() {
        let want = match dtype {
            DType::BF16 | DType::F16 => DType::F32,
            d => d,
        };
        assert_eq!(t.dtype(), want, "{name}");
    }
    for (name, var) in opt.vars() {
        assert_eq!(var.dtype(), dtype, "{name}");
    }
    (first, loss_of(&model).to_scalar::<f32>().unwrap())
}

#[test]
fn bf16_training_with_f32_optimizer_state_learns_on_the_composed_path() {
    let (first, last) = with_composed_ops(|| overfit(&Device::Cpu, DType::BF16));
    assert!(first > 4.0, "initial loss {first} should be near ln 96");
    assert!(
        last < first / 10.0,
        "bf16 loss fell only from {first} to {last}"
    );
}

// ---- On a CUDA device (needs a GPU and `--features cuda`; run with `-- --ignored`). ----

fn cuda() -> Device {
    crate::device::pick_device("cuda:0").unwrap_or_else(|e| {
        panic!(
            "this test needs a CUDA GPU and a build with the `cuda` feature \
             (cargo test -p turnwise-model --features cuda --lib cuda_parity -- --ignored): {e}"
        )
    })
}

#[test]
#[ignore = "needs a CUDA GPU and --features cuda"]
fn cuda_f32_matches_the_fused_cpu_kernels() {
    let dev = cuda();
    for (i, cfg) in configs().iter().enumerate() {
        let base = init_varmap(cfg, DType::F32, &Device::Cpu, 40 + i as u64).unwrap();
        let cpu = run(cfg, &base, &Device::Cpu, DType::F32, false);
        let gpu = run(cfg, &base, &dev, DType::F32, false);
        assert_close_f32(&format!("{:?} cuda f32", cfg.architecture), &gpu, &cpu);
    }
}

#[test]
#[ignore = "needs a CUDA GPU and --features cuda"]
fn cuda_bf16_tracks_the_f32_cpu_model() {
    let dev = cuda();
    assert_eq!(crate::device::default_dtype(&dev), DType::BF16);
    for (i, cfg) in configs().iter().enumerate() {
        let base = init_varmap(cfg, DType::F32, &Device::Cpu, 50 + i as u64).unwrap();
        let cpu = run(cfg, &base, &Device::Cpu, DType::F32, false);
        let gpu = run(cfg, &base, &dev, DType::BF16, false);
        assert_close_bf16(&format!("{:?} cuda bf16", cfg.architecture), &gpu, &cpu);
    }
}

#[test]
#[ignore = "needs a CUDA GPU and --features cuda"]
fn cuda_bf16_training_with_f32_optimizer_state_learns() {
    let (first, last) = overfit(&cuda(), DType::BF16);
    assert!(first > 4.0, "initial loss {first} should be near ln 96");
    assert!(
        last < first / 10.0,
        "bf16 loss on CUDA fell only from {first} to {last}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU and --features cuda"]
fn cuda_sampling_matches_the_cpu() {
    let dev = cuda();
    let cfg = &configs()[0];
    let base = init_varmap(cfg, DType::F32, &Device::Cpu, 60).unwrap();
    let prompts = vec![vec![1u32, 2, 3], vec![9, 8, 7, 6, 5]];
    let params = SamplingParams {
        temperature: 0.0,
        max_new_tokens: 8,
        ..Default::default()
    };
    let sample = |dev: &Device, dtype: DType| {
        let vm = convert_varmap(cfg, &base, dtype, dev).unwrap();
        let model = Transformer::detached_from_varmap(cfg, &vm).unwrap();
        generate(&model, &prompts, &[0, 1], &params, None).unwrap()
    };
    let cpu = sample(&Device::Cpu, DType::F32);
    let gpu = sample(&dev, DType::F32);
    for (c, g) in cpu.iter().zip(&gpu) {
        // Greedy tokens agree unless two logits tie within f32 noise (unlikely at this init).
        assert_eq!(c.tokens, g.tokens);
        assert!(max_abs_diff(&c.logprobs, &g.logprobs) <= F32_FWD_TOL);
    }
    for c in sample(&dev, DType::BF16) {
        assert_eq!(c.tokens.len(), c.logprobs.len());
        assert!(c.logprobs.iter().all(|l| l.is_finite() && *l <= 0.0));
    }
}
