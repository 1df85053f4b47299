//! One GRPO group's training step with its shared prompt computed once, side by side with the
//! padded step and with PyTorch.
//!
//! ```sh
//! cargo bench -p turnwise-model --bench group
//! ```
//!
//! G rows share a P-token prompt, each with its own R-token response (default G = 8, P = 256,
//! R = 128; `TURNWISE_GROUP_SHAPE=G,P,R` sets them). One step: the log-probs and entropies of
//! the response tokens, loss = −mean log-prob − 0.001·mean entropy, backward, global-norm
//! clipping at 1, one AdamW step. Three ways:
//!
//! - **shared**: the prompt runs forward and backward once
//!   ([`turnwise_model::logprobs::shared_prefix_logprobs_entropy`], what the trainer runs with
//!   `optim.share_prefix`, its default);
//! - **padded**: every row runs whole (`forward_hidden` over G × (P + R) tokens, the output head on
//!   the response positions only);
//! - **PyTorch**: the padded step with transformers (`benches/group_torch.py`), when
//!   `$TURNWISE_BENCH_PYTHON` (default `python3`) can `import torch, transformers`.
//!
//! Rows: the synthetic sizes A and B of `benches/model.rs` (random weights) and SmolLM2-135M-Instruct
//! from its GGUF file in the turnwise cache when it is there. `TURNWISE_BENCH_QUICK=1`: one timed
//! step after the warm-up (else three). Threads as in `benches/model.rs`: `RAYON_NUM_THREADS`
//! defaults to the core count, `CANDLE_NUM_THREADS` to 1.

mod common;

use std::collections::HashMap;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use serde_json::Value;
use turnwise_model::checkpoint::gguf::smollm2;
use turnwise_model::checkpoint::load_gguf;
use turnwise_model::logprobs::{SharedRow, shared_prefix_logprobs_entropy};
use turnwise_model::model::weights::{init_varmap, sorted_vars, varmap_from_tensors};
use turnwise_model::optim::{AdamW, AdamWConfig, Gradients};
use turnwise_model::{ModelConfig, Transformer};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// A model of the bench: its name, config and pretrained weights (`None`: random, seed 0).
struct BenchModel {
    name: &'static str,
    cfg: ModelConfig,
    weights: Option<HashMap<String, Tensor>>,
}

impl BenchModel {
    fn synthetic(name: &'static str, dims: [usize; 6]) -> Self {
        Self {
            name,
            cfg: common::synthetic_config(dims),
            weights: None,
        }
    }

    fn varmap(&self) -> VarMap {
        match &self.weights {
            Some(t) => varmap_from_tensors(&self.cfg, t, "the SmolLM2 GGUF file").expect("weights"),
            None => init_varmap(&self.cfg, DType::F32, &Device::Cpu, 0).expect("init"),
        }
    }
}

/// The group's rows: the shared prompt, then each row's own response (the same ids as
/// `group_torch.py`).
fn group_rows(g: usize, p: usize, r: usize, vocab: usize) -> Vec<Vec<u32>> {
    let prompt: Vec<u32> = (0..p).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
    (0..g)
        .map(|b| {
            let resp = (0..r).map(|k| (((b * 1000 + k) * 104729 + 7) % vocab) as u32);
            prompt.iter().copied().chain(resp).collect()
        })
        .collect()
}

/// Median seconds of a training step over `steps` timed steps after one warm-up, the prompt
/// shared or not.
fn step_seconds(
    m: &BenchModel,
    (g, p, r): (usize, usize, usize),
    shared: bool,
    steps: usize,
) -> f64 {
    let dev = Device::Cpu;
    let vm = m.varmap();
    let model = Transformer::from_varmap(&m.cfg, &vm).expect("model");
    let mut opt = AdamW::new(sorted_vars(&vm), AdamWConfig::default()).expect("adamw");
    let rows = group_rows(g, p, r, m.cfg.vocab_size);
    let flat: Vec<u32> = rows.iter().flatten().copied().collect();
    let all = Tensor::from_vec(flat, (g, p + r), &dev).expect("ids");
    let ids = all.narrow(1, 0, p + r - 1).expect("ids");
    let targets = all.narrow(1, p, r).expect("targets");
    let pos = Tensor::arange(0u32, (p + r - 1) as u32, &dev)
        .and_then(|x| x.unsqueeze(0))
        .and_then(|x| x.repeat((g, 1)))
        .expect("positions");
    let mask = Tensor::ones((g, p + r - 1), DType::U8, &dev).expect("mask");
    let mut times = Vec::with_capacity(steps);
    for step in 0..=steps {
        let t0 = Instant::now();
        let (logp, ent) = if shared {
            let shared_rows: Vec<SharedRow<'_>> = rows
                .iter()
                .map(|seq| SharedRow {
                    seq,
                    group: 0,
                    from: p - 1,
                    len: r,
                    scored: None,
                })
                .collect();
            shared_prefix_logprobs_entropy(&model, &[p - 1], &shared_rows, r, 1.0).expect("shared")
        } else {
            let h = model
                .forward_hidden(&ids, &pos, &mask, None)
                .and_then(|h| Ok(h.narrow(1, p - 1, r)?))
                .expect("forward");
            model
                .head_logprobs_entropy(&h, &targets, 1.0)
                .expect("head")
        };
        let loss = (logp.mean_all().expect("mean").neg().expect("neg")
            - (ent.mean_all().expect("mean") * 1e-3).expect("scale"))
        .expect("loss");
        let t_fwd = t0.elapsed().as_secs_f64();
        let store = loss.backward().expect("backward");
        if std::env::var_os("TURNWISE_GROUP_PHASES").is_some() {
            eprintln!(
                "{} shared={shared}: forward {t_fwd:.3} s, backward {:.3} s",
                m.name,
                t0.elapsed().as_secs_f64() - t_fwd
            );
        }
        let grads = Gradients::from_grad_store(&store, opt.vars());
        let norm = grads.global_norm().expect("norm");
        opt.step_scaled(&grads, 1e-4, Gradients::clip_factor(norm, 1.0))
            .expect("step");
        if step > 0 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    common::median(times)
}

/// PyTorch's step seconds per row name, or why there are none.
fn torch_seconds(
    shape: (usize, usize, usize),
    steps: usize,
    smol: Option<&std::path::Path>,
) -> Result<(HashMap<String, f64>, String), String> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/group_torch.py");
    let mut args = vec![
        "--shape".to_string(),
        format!("{},{},{}", shape.0, shape.1, shape.2),
        "--steps".into(),
        steps.to_string(),
    ];
    if let Some(p) = smol {
        args.push("--smollm2".into());
        args.push(p.display().to_string());
    }
    let v = common::run_python(script, &args)?;
    let mut secs = HashMap::new();
    let mut info = v["info"].as_str().unwrap_or("").to_string();
    for (k, x) in v.as_object().into_iter().flatten() {
        if let Some(s) = x.as_f64() {
            secs.insert(k.clone(), s);
        } else if let Some(e) = x.get("error").and_then(Value::as_str) {
            info.push_str(&format!("; {k}: {e}"));
        }
    }
    Ok((secs, info))
}

fn main() {
    common::thread_defaults();
    let shape = common::shape_from_env(
        "TURNWISE_GROUP_SHAPE",
        &[1, 2, 1],
        "G,P,R with G ≥ 1, P ≥ 2, R ≥ 1",
    )
    .map_or((8, 256, 128), |v| (v[0], v[1], v[2]));
    let quick = std::env::var("TURNWISE_BENCH_QUICK").is_ok_and(|v| v == "1");
    let steps = if quick { 1 } else { 3 };
    let mut models = vec![
        BenchModel::synthetic("A", [256, 4, 4, 2, 768, 4096]),
        BenchModel::synthetic("B", [512, 8, 8, 2, 1536, 8192]),
    ];
    let cache = turnwise_core::pip::default_cache_dir();
    let smol_path = smollm2::gguf_path(&cache).ok();
    match &smol_path {
        Some(path) => match load_gguf(path, DType::F32, &Device::Cpu) {
            Ok((cfg, tensors)) => models.push(BenchModel {
                name: "SmolLM2",
                cfg,
                weights: Some(tensors),
            }),
            Err(e) => println!("SmolLM2 row skipped: loading {}: {e}", path.display()),
        },
        None => println!("SmolLM2 row skipped: no model in {}", cache.display()),
    }
    let (g, p, r) = shape;
    let padded_tokens = g * (p + r);
    let shared_tokens = p + g * r;
    println!(
        "group of {g} rows sharing a {p}-token prompt, {r}-token responses: {padded_tokens} \
         tokens padded, {shared_tokens} shared ({:.2}× fewer); {} threads, {steps} timed steps",
        padded_tokens as f64 / shared_tokens as f64,
        std::env::var("RAYON_NUM_THREADS").unwrap_or_default()
    );
    let torch = torch_seconds(shape, steps, smol_path.as_deref());
    let (torch_s, info) = match &torch {
        Ok((s, info)) => (s.clone(), info.clone()),
        Err(e) => (HashMap::new(), format!("no PyTorch figures: {e}")),
    };
    println!(
        "\n| model | shared s/step | padded s/step | shared vs padded | PyTorch s/step | shared vs PyTorch |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for m in &models {
        let s = step_seconds(m, shape, true, steps);
        let w = step_seconds(m, shape, false, steps);
        let (ts, ratio) = match torch_s.get(m.name) {
            Some(t) => (format!("{t:.3}"), format!("{:.2}×", t / s)),
            None => ("–".into(), "–".into()),
        };
        println!(
            "| {} | {s:.3} | {w:.3} | {:.2}× | {ts} | {ratio} |",
            m.name,
            w / s
        );
    }
    println!("\n{info}");
}
