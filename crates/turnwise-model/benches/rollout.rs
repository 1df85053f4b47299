//! A multi-turn rollout, side by side with PyTorch + transformers `generate` re-reading each
//! turn's whole context, as Search-R1's rollout loop does.
//!
//! ```sh
//! cargo bench -p turnwise-model --bench rollout
//! ```
//!
//! E = G × R episodes (G prompts, R rollouts each, as a GRPO batch) of T turns: each starts from
//! its group's P-token prompt; each turn samples N tokens per episode (temperature 1, no stop
//! token, so every side does the same work), then the episode's context grows by the turn's
//! tokens and an O-token observation (a tool's answer) before the next turn. Defaults: 4 × 4
//! episodes, P = 300, T = 3, N = 64, O = 100 (`TURNWISE_ROLLOUT_SHAPE=G,R,P,T,N,O` sets them).
//! Three ways:
//!
//! - **cached** (turnwise's rollout): a group's prompt is prefilled once
//!   ([`turnwise_model::sampling::prefill_prefix`]) and every episode keeps its context's keys
//!   and values across turns ([`turnwise_model::sampling::generate_with_prefixes`]), so a turn
//!   prefills only its new observation;
//! - **re-prefill** (turnwise without the cache): every turn prefills each episode's whole
//!   context again ([`turnwise_model::sampling::generate`]);
//! - **PyTorch**: transformers' `generate` on the left-padded contexts each turn
//!   (`benches/rollout_torch.py`), when `$TURNWISE_BENCH_PYTHON` (default `python3`) can
//!   `import torch, transformers`.
//!
//! Model: SmolLM2-135M-Instruct from its GGUF file in the turnwise cache when it is there (the
//! `gguf` package loads it on the PyTorch side), else size C of `benches/model.rs` (SmolLM2's
//! shape, random weights). `TURNWISE_BENCH_QUICK=1`: one timed rollout after the warm-up (else
//! three). Threads as in `benches/model.rs`: `RAYON_NUM_THREADS` defaults to the core count,
//! `CANDLE_NUM_THREADS` to 1; PyTorch gets the same count. The bench re-executes itself with the
//! `turnwise` binary's allocator setting (`MIMALLOC_PURGE_DELAY=-1`).

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{DType, Device};
use turnwise_model::Transformer;
use turnwise_model::checkpoint::gguf::smollm2;
use turnwise_model::checkpoint::load_gguf;
use turnwise_model::model::weights::{init_varmap, varmap_from_tensors};
use turnwise_model::sampling::{
    PrefixKv, SamplingParams, generate, generate_with_prefixes, prefill_prefix,
};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The rollout's shape: groups, rollouts per group, prompt, turns, new tokens per turn and
/// observation tokens.
#[derive(Clone, Copy)]
struct Shape {
    groups: usize,
    rollouts: usize,
    prompt: usize,
    turns: usize,
    new: usize,
    obs: usize,
}

impl Shape {
    fn episodes(&self) -> usize {
        self.groups * self.rollouts
    }

    /// Longest context an episode reaches.
    fn max_context(&self) -> usize {
        self.prompt + self.turns * self.new + (self.turns - 1) * self.obs
    }

    /// Context tokens a rollout prefills when every turn re-reads its whole context.
    fn reprefill_tokens(&self) -> usize {
        (0..self.turns)
            .map(|t| self.prompt + t * (self.new + self.obs))
            .sum::<usize>()
            * self.episodes()
    }

    /// Context tokens a rollout prefills with the group's prompt once and the cache kept
    /// across turns: the prompt once per group (its last token per episode), then each turn's
    /// observation (and the last sampled token, whose keys the turn did not compute).
    fn cached_tokens(&self) -> usize {
        self.groups * (self.prompt - 1) + self.episodes() * (1 + (self.turns - 1) * (self.obs + 1))
    }
}

/// Group `g`'s prompt (the same ids as `rollout_torch.py`).
fn prompt_ids(g: usize, p: usize, vocab: usize) -> Vec<u32> {
    (0..p)
        .map(|i| ((g * 7919 + i * 131 + 13) % vocab) as u32)
        .collect()
}

/// Episode `e`'s observation after turn `t` (the same ids as `rollout_torch.py`).
fn observation_ids(e: usize, t: usize, o: usize, vocab: usize) -> Vec<u32> {
    (0..o)
        .map(|k| ((((e * 100 + t) * 1000 + k) * 104729 + 7) % vocab) as u32)
        .collect()
}

/// One rollout's seconds, the cache kept across turns or not; checks that every episode
/// sampled `new` tokens per turn.
fn rollout_seconds(model: &Transformer, s: Shape, cached: bool, rep: usize) -> f64 {
    let vocab = model.config().vocab_size;
    let params = SamplingParams {
        temperature: 1.0,
        max_new_tokens: s.new,
        ..Default::default()
    };
    let e = s.episodes();
    let t0 = Instant::now();
    let mut contexts: Vec<Vec<u32>> = (0..e)
        .map(|i| prompt_ids(i / s.rollouts, s.prompt, vocab))
        .collect();
    let mut kvs: Vec<Option<PrefixKv>> = if cached {
        let groups: Vec<Option<PrefixKv>> = (0..s.groups)
            .map(|g| {
                prefill_prefix(model, &prompt_ids(g, s.prompt, vocab)[..s.prompt - 1])
                    .expect("prefill")
            })
            .collect();
        (0..e).map(|i| groups[i / s.rollouts].clone()).collect()
    } else {
        vec![None; e]
    };
    for t in 0..s.turns {
        let seeds: Vec<u64> = (0..e).map(|i| (rep * 1000 + t * 100 + i) as u64).collect();
        let outs: Vec<Vec<u32>> = if cached {
            let budgets = vec![s.new; e];
            let res =
                generate_with_prefixes(model, &contexts, &kvs, &seeds, &params, &budgets, None)
                    .expect("generate");
            res.into_iter()
                .enumerate()
                .map(|(i, (c, kv))| {
                    kvs[i] = kv;
                    c.tokens
                })
                .collect()
        } else {
            generate(model, &contexts, &seeds, &params, None)
                .expect("generate")
                .into_iter()
                .map(|c| c.tokens)
                .collect()
        };
        for (i, (ctx, out)) in contexts.iter_mut().zip(outs).enumerate() {
            assert_eq!(out.len(), s.new, "episode {i} turn {t}: tokens sampled");
            ctx.extend(out);
            if t + 1 < s.turns {
                ctx.extend(observation_ids(i, t, s.obs, vocab));
            }
        }
    }
    t0.elapsed().as_secs_f64()
}

/// PyTorch's rollout seconds (median), or why there are none.
fn torch_seconds(s: Shape, reps: usize, smol: Option<&Path>) -> Result<(f64, String), String> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/rollout_torch.py");
    let mut args = vec![
        "--shape".to_string(),
        format!(
            "{},{},{},{},{},{}",
            s.groups, s.rollouts, s.prompt, s.turns, s.new, s.obs
        ),
        "--reps".into(),
        reps.to_string(),
    ];
    if let Some(p) = smol {
        args.push("--smollm2".into());
        args.push(p.display().to_string());
    }
    let v = common::run_python(script, &args)?;
    match v["seconds"].as_f64() {
        Some(x) => Ok((x, v["info"].as_str().unwrap_or("").to_string())),
        None => Err(format!(
            "{script}: {}",
            v["error"].as_str().unwrap_or("no figure")
        )),
    }
}

/// SmolLM2 from the cache (its path, config and weights), or size C of `benches/model.rs` with
/// random weights; the name of the row.
fn bench_model(max_context: usize) -> (String, Option<PathBuf>, Transformer) {
    let cache = turnwise_core::pip::default_cache_dir();
    if let Ok(path) = smollm2::gguf_path(&cache) {
        match load_gguf(&path, DType::F32, &Device::Cpu) {
            Ok((cfg, tensors)) => {
                let vm =
                    varmap_from_tensors(&cfg, &tensors, "the SmolLM2 GGUF file").expect("weights");
                let model = Transformer::detached_from_varmap(&cfg, &vm).expect("model");
                return ("SmolLM2".into(), Some(path), model);
            }
            Err(e) => println!("SmolLM2 not used: loading {}: {e}", path.display()),
        }
    } else {
        println!("SmolLM2 not used: no model in {}", cache.display());
    }
    let mut c = common::synthetic_config([576, 30, 9, 3, 1536, 49152]);
    c.max_position_embeddings = max_context.max(2048);
    let vm = init_varmap(&c, DType::F32, &Device::Cpu, 0).expect("init");
    let model = Transformer::detached_from_varmap(&c, &vm).expect("model");
    ("C (SmolLM2's shape, random weights)".into(), None, model)
}

fn main() {
    // What the `turnwise` binary runs with (mimalloc keeping freed pages, element-wise ops on
    // the calling thread).
    #[cfg(unix)]
    turnwise_model::device::reexec_with_fast_settings();
    common::thread_defaults();
    let s = common::shape_from_env(
        "TURNWISE_ROLLOUT_SHAPE",
        &[1, 1, 2, 1, 1, 0],
        "G,R,P,T,N,O with G, R, T, N ≥ 1, P ≥ 2",
    )
    .map_or(
        Shape {
            groups: 4,
            rollouts: 4,
            prompt: 300,
            turns: 3,
            new: 64,
            obs: 100,
        },
        |v| Shape {
            groups: v[0],
            rollouts: v[1],
            prompt: v[2],
            turns: v[3],
            new: v[4],
            obs: v[5],
        },
    );
    let quick = std::env::var("TURNWISE_BENCH_QUICK").is_ok_and(|v| v == "1");
    let reps = if quick { 1 } else { 3 };
    let (name, smol, model) = bench_model(s.max_context());
    println!(
        "{name}: {} episodes ({} prompts × {} rollouts), {}-token prompts, {} turns of {} sampled \
         tokens, {}-token observations; context tokens prefilled per rollout: {} re-reading, {} \
         cached ({:.1}× fewer); {} threads, {reps} timed rollouts",
        s.episodes(),
        s.groups,
        s.rollouts,
        s.prompt,
        s.turns,
        s.new,
        s.obs,
        s.reprefill_tokens(),
        s.cached_tokens(),
        s.reprefill_tokens() as f64 / s.cached_tokens() as f64,
        std::env::var("RAYON_NUM_THREADS").unwrap_or_default()
    );
    // `TURNWISE_BENCH_FILTER=cached` (or `re-prefill`): that way only, no PyTorch (profiling).
    let filter = std::env::var("TURNWISE_BENCH_FILTER").ok();
    let torch = match &filter {
        Some(f) => Err(format!("TURNWISE_BENCH_FILTER={f}")),
        None => torch_seconds(s, reps, smol.as_deref()),
    };
    let ways: Vec<(&str, bool)> = [("cached", true), ("re-prefill", false)]
        .into_iter()
        .filter(|(w, _)| filter.as_deref().is_none_or(|f| f == *w))
        .collect();
    let mut secs: HashMap<&str, f64> = HashMap::new();
    for &(way, cached) in &ways {
        // Warm-up: one turn of a smaller rollout (allocator, page faults, kernel dispatch).
        let warm = Shape {
            turns: 1,
            new: 4,
            ..s
        };
        rollout_seconds(&model, warm, cached, 99);
        let times: Vec<f64> = (0..reps)
            .map(|r| rollout_seconds(&model, s, cached, r))
            .collect();
        secs.insert(way, common::median(times));
    }
    let sampled = (s.episodes() * s.turns * s.new) as f64;
    println!("\n| way | s/rollout | sampled tokens/s | vs PyTorch generate |");
    println!("|---|---:|---:|---:|");
    let (torch_s, info) = match &torch {
        Ok((t, info)) => (Some(*t), info.clone()),
        Err(e) => (None, format!("no PyTorch figures: {e}")),
    };
    for &(way, _) in &ways {
        let x = secs[way];
        let ratio = torch_s.map_or("–".into(), |t| format!("{:.2}×", t / x));
        println!(
            "| turnwise, {way} | {x:.2} | {:.0} | {ratio} |",
            sampled / x
        );
    }
    if let Some(t) = torch_s {
        println!(
            "| PyTorch `generate`, re-prefill | {t:.2} | {:.0} | 1.00× |",
            sampled / t
        );
    }
    if let (Some(c), Some(r)) = (secs.get("cached"), secs.get("re-prefill")) {
        println!("\ncached vs re-prefill: {:.2}×", r / c);
    }
    println!("{info}");
}
