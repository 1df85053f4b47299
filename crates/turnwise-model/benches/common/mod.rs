//! What the benches share: thread settings, synthetic model shapes, shapes read from the
//! environment, medians and running their PyTorch reference scripts.

use std::process::Command;

use serde_json::Value;
use turnwise_model::ModelConfig;

/// Before any thread starts: `RAYON_NUM_THREADS` defaults to the core count (matmuls; candle
/// re-reads /proc/cpuinfo on every matmul without it) and `CANDLE_NUM_THREADS` to 1
/// (element-wise ops on the calling thread: candle's pool spin-waits for descheduled workers on
/// a shared machine). A value already set is kept.
pub fn thread_defaults() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // SAFETY: called first in `main`, before any other thread exists.
    unsafe {
        if std::env::var_os("RAYON_NUM_THREADS").is_none() {
            std::env::set_var("RAYON_NUM_THREADS", cores.to_string());
        }
        if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
            std::env::set_var("CANDLE_NUM_THREADS", "1");
        }
    }
}

/// A Qwen2-style model of `[hidden, layers, heads, kv_heads, intermediate, vocab]` with a
/// 512-position context (the benches' synthetic sizes; random weights).
pub fn synthetic_config(dims: [usize; 6]) -> ModelConfig {
    let [hidden, layers, heads, kv_heads, intermediate, vocab] = dims;
    let mut c = ModelConfig::tiny_qwen2(vocab);
    c.hidden_size = hidden;
    c.num_hidden_layers = layers;
    c.num_attention_heads = heads;
    c.num_key_value_heads = kv_heads;
    c.head_dim = hidden / heads;
    c.intermediate_size = intermediate;
    c.max_position_embeddings = 512;
    c
}

/// The comma-separated numbers in the environment variable `var` (`None` when unset), at least
/// `min[i]` each and as many as `min` has; panics with `usage` otherwise.
#[allow(dead_code)] // not every bench reads a shape
pub fn shape_from_env(var: &str, min: &[usize], usage: &str) -> Option<Vec<usize>> {
    let v: Vec<usize> = std::env::var(var)
        .ok()?
        .split(',')
        .map(|x| {
            x.trim()
                .parse()
                .unwrap_or_else(|_| panic!("{var} is {usage}"))
        })
        .collect();
    assert!(
        v.len() == min.len() && v.iter().zip(min).all(|(x, m)| x >= m),
        "{var} is {usage}"
    );
    Some(v)
}

/// The median of `xs` (the mean of the middle two for an even count).
pub fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        0.5 * (xs[n / 2 - 1] + xs[n / 2])
    }
}

/// The last JSON line a child process printed, or why there is none.
pub fn last_json(what: &str, out: &std::process::Output) -> Result<Value, String> {
    if !out.status.success() {
        return Err(format!(
            "{what} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .ok_or_else(|| format!("{what} printed no JSON: {text}"))?;
    serde_json::from_str(line).map_err(|e| format!("{what} printed bad JSON ({e}): {line}"))
}

/// Runs the Python script `script` with `args` under `$TURNWISE_BENCH_PYTHON` (default
/// `python3`) and returns the last JSON line it printed. PyTorch waits passively for its
/// threads (`OMP_WAIT_POLICY=PASSIVE`, unless set): on a shared, oversubscribed machine
/// OpenMP's default spin-waiting makes it several times slower.
pub fn run_python(script: &str, args: &[String]) -> Result<Value, String> {
    let python = std::env::var("TURNWISE_BENCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut cmd = Command::new(&python);
    cmd.arg(script).args(args);
    if std::env::var_os("OMP_WAIT_POLICY").is_none() {
        cmd.env("OMP_WAIT_POLICY", "PASSIVE");
    }
    // `TURNWISE_KERNEL_ISA=avx2`: an AVX2 CPU's code path on both sides, so PyTorch's ATen,
    // MKL and oneDNN kernels are capped to AVX2 too (a value set already is kept).
    if std::env::var("TURNWISE_KERNEL_ISA").as_deref() == Ok("avx2") {
        for (k, v) in [
            ("ATEN_CPU_CAPABILITY", "avx2"),
            ("MKL_ENABLE_INSTRUCTIONS", "AVX2"),
            ("ONEDNN_MAX_CPU_ISA", "AVX2"),
        ] {
            if std::env::var_os(k).is_none() {
                cmd.env(k, v);
            }
        }
    }
    let out = cmd
        .output()
        .map_err(|e| format!("running {script} with {python}: {e}"))?;
    last_json(script, &out)
}
