//! What the benches share: medians and running their PyTorch reference scripts.

use std::process::Command;

use serde_json::Value;

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
    let out = cmd
        .output()
        .map_err(|e| format!("running {script} with {python}: {e}"))?;
    last_json(script, &out)
}
