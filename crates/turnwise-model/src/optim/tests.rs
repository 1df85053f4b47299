//! Optimizer tests on tiny models.

use candle_core::{DType, Device, Tensor};

use super::*;
use crate::logprobs::logprobs_and_entropy;
use crate::model::weights::{init_varmap, sorted_vars};
use crate::model::{ModelConfig, Transformer};

/// Mean negative log-likelihood of a fixed 16-token sequence (next-token prediction).
pub(crate) fn nll(model: &Transformer, seq: &[u32]) -> Tensor {
    let dev = Device::Cpu;
    let t = seq.len() - 1;
    let ids = Tensor::from_vec(seq[..t].to_vec(), (1, t), &dev).unwrap();
    let targets = Tensor::from_vec(seq[1..].to_vec(), (1, t), &dev).unwrap();
    let pos = Tensor::arange(0u32, t as u32, &dev)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let mask = Tensor::ones((1, t), DType::U32, &dev).unwrap();
    let (logp, _) = logprobs_and_entropy(model, &ids, &pos, &mask, &targets).unwrap();
    logp.mean_all().unwrap().neg().unwrap()
}

pub(crate) const SEQ: [u32; 17] = [3, 41, 7, 7, 90, 12, 55, 3, 18, 64, 2, 77, 31, 9, 41, 60, 5];

#[test]
fn tiny_model_overfits_a_sequence() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let vm = init_varmap(&cfg, DType::F32, &Device::Cpu, 0).unwrap();
    let model = Transformer::from_varmap(&cfg, &vm).unwrap();
    let mut opt = AdamW::new(sorted_vars(&vm), AdamWConfig::default()).unwrap();
    let sched = LrSchedule {
        peak_lr: 1e-2,
        warmup_steps: 5,
        total_steps: 50,
        min_lr_ratio: 0.1,
        decay: DecayShape::Cosine,
    };
    let first = nll(&model, &SEQ).to_scalar::<f32>().unwrap();
    for step in 0..50 {
        let loss = nll(&model, &SEQ);
        let mut g = Gradients::from_grad_store(&loss.backward().unwrap(), opt.vars());
        let norm = g.clip_global_norm(1.0).unwrap();
        assert!(norm.is_finite());
        opt.step(&g, sched.lr_at(step)).unwrap();
    }
    let last = nll(&model, &SEQ).to_scalar::<f32>().unwrap();
    assert!(first > 4.0, "initial loss {first} should be near ln 96");
    assert!(last < first / 20.0, "loss fell only from {first} to {last}");
}

#[test]
fn accumulated_micro_batches_equal_the_full_batch_gradient() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let vm = init_varmap(&cfg, DType::F64, &Device::Cpu, 1).unwrap();
    let model = Transformer::from_varmap(&cfg, &vm).unwrap();
    let vars = sorted_vars(&vm);
    let a = &SEQ[..9];
    let b = &SEQ[8..];
    let full = ((nll(&model, a) + nll(&model, b)).unwrap() * 0.5).unwrap();
    let full = Gradients::from_grad_store(&full.backward().unwrap(), &vars);
    let mut acc = GradAccumulator::new();
    acc.add(&nll(&model, a).backward().unwrap(), &vars, 0.5)
        .unwrap();
    acc.add(&nll(&model, b).backward().unwrap(), &vars, 0.5)
        .unwrap();
    assert_eq!(acc.micro_batches(), 2);
    let sum = acc.take();
    assert_eq!(sum.len(), full.len());
    for (name, g) in full.iter() {
        let d = (g - sum.get(name).unwrap())
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        assert!(d < 1e-12, "{name}: {d}");
    }
}

#[test]
fn clipping_returns_the_pre_clip_norm() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let vm = init_varmap(&cfg, DType::F64, &Device::Cpu, 2).unwrap();
    let model = Transformer::from_varmap(&cfg, &vm).unwrap();
    let vars = sorted_vars(&vm);
    let mut g = Gradients::from_grad_store(&nll(&model, &SEQ).backward().unwrap(), &vars);
    let manual: f64 = g
        .iter()
        .map(|(_, t)| {
            t.sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
        })
        .sum::<f64>()
        .sqrt();
    let max = manual / 4.0;
    let pre = g.clip_global_norm(max).unwrap();
    assert!((pre - manual).abs() < 1e-12);
    assert!((g.global_norm().unwrap() - max).abs() < 1e-6 * max);
    // Below the threshold nothing changes.
    let before = g.global_norm().unwrap();
    assert_eq!(g.clip_global_norm(10.0 * max).unwrap(), before);
    assert_eq!(g.global_norm().unwrap(), before);
}

#[test]
fn adamw_matches_the_reference_update_and_skips_decay_on_vectors() {
    // One parameter matrix and one vector, one step, against the closed form.
    let dev = Device::Cpu;
    let w =
        candle_core::Var::from_tensor(&Tensor::new(&[[1.0f64, -2.0], [0.5, 3.0]], &dev).unwrap())
            .unwrap();
    let b = candle_core::Var::from_tensor(&Tensor::new(&[1.0f64, 1.0], &dev).unwrap()).unwrap();
    let vars = vec![("w".to_string(), w.clone()), ("b".to_string(), b.clone())];
    let cfg = AdamWConfig {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.5,
        decay_vectors: false,
    };
    let mut opt = AdamW::new(vars.clone(), cfg).unwrap();
    let loss = ((w.as_tensor().sqr().unwrap().sum_all().unwrap())
        + (b.as_tensor() * 3.0).unwrap().sum_all().unwrap())
    .unwrap();
    let g = Gradients::from_grad_store(&loss.backward().unwrap(), &vars);
    let lr = 0.1;
    opt.step(&g, lr).unwrap();
    // First step: m̂ = g, v̂ = g², update = lr · g / (|g| + eps) ≈ lr · sign(g).
    let w1 = w.as_tensor().to_vec2::<f64>().unwrap();
    let w0 = [[1.0, -2.0], [0.5, 3.0]];
    for i in 0..2 {
        for j in 0..2 {
            let p = w0[i][j];
            let g = 2.0 * p;
            let expect = p * (1.0 - lr * 0.5) - lr * g / (g.abs() + 1e-8);
            assert!(
                (w1[i][j] - expect).abs() < 1e-12,
                "{i},{j}: {} vs {expect}",
                w1[i][j]
            );
        }
    }
    let b1 = b.as_tensor().to_vec1::<f64>().unwrap();
    let expect = 1.0 - lr * 3.0 / (3.0 + 1e-8); // no decay on vectors
    assert!(b1.iter().all(|x| (x - expect).abs() < 1e-12), "{b1:?}");
    assert_eq!(opt.step_count(), 1);
}

#[test]
fn schedule_warms_up_and_decays_to_the_floor() {
    let s = LrSchedule {
        peak_lr: 1.0,
        warmup_steps: 4,
        total_steps: 14,
        min_lr_ratio: 0.1,
        decay: DecayShape::Cosine,
    };
    assert_eq!(s.lr_at(0), 0.25);
    assert_eq!(s.lr_at(3), 1.0);
    assert_eq!(s.lr_at(4), 1.0);
    assert!((s.lr_at(9) - 0.55).abs() < 1e-12);
    assert!((s.lr_at(14) - 0.1).abs() < 1e-12);
    assert!((s.lr_at(1000) - 0.1).abs() < 1e-12);
    let l = LrSchedule {
        decay: DecayShape::Linear,
        ..s.clone()
    };
    assert!((l.lr_at(9) - 0.55).abs() < 1e-12);
    assert!((l.lr_at(6) - (1.0 - 0.9 * 0.2)).abs() < 1e-12);
    let c = LrSchedule {
        decay: DecayShape::Constant,
        ..s.clone()
    };
    assert_eq!(c.lr_at(100), 1.0);
    assert!(s.validate().is_ok());
    assert!(
        LrSchedule {
            min_lr_ratio: 2.0,
            ..s
        }
        .validate()
        .is_err()
    );
}

#[test]
fn bf16_parameters_keep_f32_master_weights_and_moments() {
    use candle_core::Var;
    // Steps of about lr = 1e-4 are below bf16's resolution at 1.0 (2⁻⁷): without an f32 master
    // copy every update would round away and the weight would never move.
    let dev = Device::Cpu;
    let make = |dtype| {
        let var = Var::from_tensor(&Tensor::ones((3, 4), dtype, &dev).unwrap()).unwrap();
        let cfg = AdamWConfig {
            weight_decay: 0.0,
            ..AdamWConfig::default()
        };
        (
            var.clone(),
            AdamW::new(vec![("w".into(), var)], cfg).unwrap(),
        )
    };
    let (w32, mut opt32) = make(DType::F32);
    let (w16, mut opt16) = make(DType::BF16);
    // The gradient of Σ w / 2 is 1/2 everywhere, in the parameter's dtype.
    let grads_for = |opt: &AdamW| {
        let loss = (opt.vars()[0].1.as_tensor() * 0.5)
            .unwrap()
            .sum_all()
            .unwrap();
        Gradients::from_grad_store(&loss.backward().unwrap(), opt.vars())
    };
    for _ in 0..200 {
        let g = grads_for(&opt32);
        opt32.step(&g, 1e-4).unwrap();
        let g = grads_for(&opt16);
        opt16.step(&g, 1e-4).unwrap();
    }
    let want = w32.as_tensor().to_vec2::<f32>().unwrap()[0][0];
    assert!((want - 0.98).abs() < 1e-3, "f32 reference moved to {want}");
    let master = opt16.master("w").unwrap();
    assert_eq!(master.dtype(), DType::F32);
    let m = master.to_vec2::<f32>().unwrap()[0][0];
    assert!((m - want).abs() < 1e-5, "master {m} vs f32 {want}");
    // The bf16 weight is the master rounded to bf16.
    assert_eq!(w16.dtype(), DType::BF16);
    let got = w16
        .as_tensor()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap()[0][0];
    assert!(
        (got - want).abs() <= 2f32.powi(-8),
        "bf16 weight {got} vs f32 {want}"
    );
    assert!(opt32.master("w").is_none());
    // Moments and the master copy are saved in f32 and restored.
    let state = opt16.state_tensors();
    for key in ["w.exp_avg", "w.exp_avg_sq", "w.master"] {
        assert_eq!(state[key].dtype(), DType::F32, "{key}");
    }
    let (_, mut again) = make(DType::BF16);
    again.load_state(&state, opt16.step_count()).unwrap();
    let restored = again.master("w").unwrap().to_vec2::<f32>().unwrap()[0][0];
    assert_eq!(restored, m);
}

#[test]
fn master_copies_follow_weights_changed_by_another_optimizer_once_synced() {
    use candle_core::Var;
    // A bf16 weight trained by a first optimizer (a warm start), then by a second one built
    // before it (the RL optimizer): the second one's master copy still holds the value it was
    // built on, and its first step would write that back, undoing the warm start.
    let dev = Device::Cpu;
    let var = Var::from_tensor(&Tensor::ones((2, 2), DType::BF16, &dev).unwrap()).unwrap();
    let cfg = AdamWConfig {
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    let vars = vec![("w".to_string(), var.clone())];
    let mut rl = AdamW::new(vars.clone(), cfg.clone()).unwrap();
    let mut warm = AdamW::new(vars.clone(), cfg).unwrap();
    let grads = |opt: &AdamW| {
        let loss = (opt.vars()[0].1.as_tensor() * 0.5)
            .unwrap()
            .sum_all()
            .unwrap();
        Gradients::from_grad_store(&loss.backward().unwrap(), opt.vars())
    };
    // The warm start moves the weight from 1 to about 0.5 (lr 1e-2, 50 steps).
    for _ in 0..50 {
        let g = grads(&warm);
        warm.step(&g, 1e-2).unwrap();
    }
    let value = |v: &Var| {
        v.as_tensor()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap()[0][0]
    };
    let warmed = value(&var);
    assert!(
        (warmed - 0.5).abs() < 0.05,
        "warm start moved the weight to {warmed}"
    );
    let exact = warm.master("w").unwrap().to_vec2::<f32>().unwrap()[0][0];

    // Unsynced: one small RL step (lr 1e-4) writes the stale master (about 1) back.
    let state = rl.state_tensors();
    let g = grads(&rl);
    rl.step(&g, 1e-4).unwrap();
    assert!(
        value(&var) > 0.99,
        "the stale master was not written back: {}",
        value(&var)
    );

    // Synced from the warm start's optimizer: the RL step continues from its exact master.
    var.set(
        &Tensor::full(warmed, (2, 2), &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap(),
    )
    .unwrap();
    rl.load_state(&state, 0).unwrap();
    rl.sync_masters(Some(&warm)).unwrap();
    assert_eq!(
        rl.master("w").unwrap().to_vec2::<f32>().unwrap()[0][0],
        exact
    );
    let g = grads(&rl);
    rl.step(&g, 1e-4).unwrap();
    assert!(
        (value(&var) - warmed).abs() < 0.01,
        "synced step moved {warmed} to {}",
        value(&var)
    );
    // Synced from the weights alone (no source): the master is the current bf16 value.
    rl.sync_masters(None).unwrap();
    assert_eq!(
        rl.master("w").unwrap().to_vec2::<f32>().unwrap()[0][0],
        value(&var)
    );
}

#[test]
fn an_update_that_overflows_is_refused_and_not_written() {
    // The review's `optim.lr = 1e308`: the step would write infinite weights and the run would
    // fail steps later in sampling. The step refuses, naming the learning rate and the parameter.
    let dev = Device::Cpu;
    let w = candle_core::Var::from_tensor(&Tensor::new(&[1.0f32, -2.0], &dev).unwrap()).unwrap();
    let vars = vec![("w".to_string(), w.clone())];
    let mut opt = AdamW::new(vars.clone(), AdamWConfig::default()).unwrap();
    let loss = w.as_tensor().sqr().unwrap().sum_all().unwrap();
    let g = Gradients::from_grad_store(&loss.backward().unwrap(), &vars);
    let err = opt.step(&g, 1e308).unwrap_err().to_string();
    assert!(
        err.contains("lr") && err.contains("non-finite") && err.contains('w'),
        "{err}"
    );
    assert_eq!(w.as_tensor().to_vec1::<f32>().unwrap(), vec![1.0, -2.0]);
    // A sane step goes through.
    opt.step(&g, 1e-3).unwrap();
    assert!(w.as_tensor().to_vec1::<f32>().unwrap()[0] < 1.0);
}

/// The fused CPU update writes exactly (bit for bit) what the composed tensor ops write, over
/// three steps of the tiny model's real gradients plus a parameter longer than several of the
/// fused update's chunks, in `f32` and `f64`, with and without decay on vectors; and so does
/// the clip deferred into the update (`step_scaled`), fused or composed.
#[test]
fn the_fused_update_equals_the_composed_ops_bit_for_bit() {
    for dtype in [DType::F32, DType::F64] {
        for decay_vectors in [false, true] {
            let cfg = ModelConfig::tiny_qwen2(96);
            let dev = Device::Cpu;
            // `deferred`: the clip applied as the update reads the gradients (`step_scaled`).
            let run = |composed: bool, deferred: bool| -> Vec<Vec<f64>> {
                let vm = init_varmap(&cfg, dtype, &dev, 0).unwrap();
                let model = Transformer::from_varmap(&cfg, &vm).unwrap();
                let mut vars = sorted_vars(&vm);
                let long = Tensor::arange(0u32, 100_003, &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
                    .affine(1e-5, -0.5)
                    .unwrap();
                let long = candle_core::Var::from_tensor(&long).unwrap();
                vars.push(("long".into(), long.clone()));
                let opt_cfg = AdamWConfig {
                    decay_vectors,
                    ..AdamWConfig::default()
                };
                let mut opt = AdamW::new(vars.clone(), opt_cfg).unwrap();
                if composed {
                    opt = opt.with_composed_update();
                }
                for step in 0..3 {
                    let loss = (nll(&model, &SEQ).to_dtype(dtype).unwrap()
                        + long.as_tensor().sqr().unwrap().sum_all().unwrap())
                    .unwrap();
                    let mut g = Gradients::from_grad_store(&loss.backward().unwrap(), &vars);
                    let lr = 1e-2 * (step + 1) as f64;
                    if deferred {
                        let norm = g.global_norm().unwrap();
                        let factor = Gradients::clip_factor(norm, 1.0);
                        assert!(factor.is_some(), "the clip must act (norm {norm})");
                        opt.step_scaled(&g, lr, factor).unwrap();
                    } else {
                        g.clip_global_norm(1.0).unwrap();
                        opt.step(&g, lr).unwrap();
                    }
                }
                let mut out: Vec<Vec<f64>> =
                    vars.iter().map(|(_, v)| flat(v.as_tensor())).collect();
                for (_, t) in sorted(opt.state_tensors()) {
                    out.push(flat(&t));
                }
                out
            };
            let composed = run(true, false);
            for (fused, deferred) in [(true, false), (true, true), (false, true)] {
                let other = run(!fused, deferred);
                assert_eq!(other.len(), composed.len());
                for (i, (a, b)) in other.iter().zip(&composed).enumerate() {
                    let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(
                        same,
                        "{dtype:?}, decay_vectors {decay_vectors}, fused {fused}, clip \
                         deferred {deferred}: tensor {i} differs"
                    );
                }
            }
        }
    }
}

fn flat(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

fn sorted(m: std::collections::HashMap<String, Tensor>) -> Vec<(String, Tensor)> {
    let mut v: Vec<_> = m.into_iter().collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// The global norm read straight from the gradients' memory (eight lanes) equals the composed
/// in-order `to_dtype(F64).sqr().sum_all()` per gradient within the in-order sum's own error
/// bound (`n` units of rounding, relative), in `f32` and `f64`,
/// contiguous or not, at lengths with a remainder after the lanes; a strided view takes the
/// composed path itself (the same bits).
#[test]
fn the_sum_of_squares_equals_the_composed_ops() {
    let dev = Device::Cpu;
    for dtype in [DType::F32, DType::F64] {
        let t = Tensor::randn(0f32, 3.0, (301, 257), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        for x in [t.clone(), t.t().unwrap(), t.narrow(0, 5, 100).unwrap()] {
            let composed = x
                .to_dtype(DType::F64)
                .unwrap()
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap();
            let direct = grads::sum_of_squares(&x).unwrap();
            let rel = (direct - composed).abs() / composed;
            let bound = x.elem_count() as f64 * f64::EPSILON / 2.0;
            assert!(rel < bound, "{dtype:?} {:?}: {rel}", x.layout());
            if !x.is_contiguous() {
                assert_eq!(direct.to_bits(), composed.to_bits(), "{dtype:?} strided");
            }
        }
    }
}
