//! `turnwise bench` runs end to end (quick, tiny model) and reports positive finite figures.

use std::process::Command;

fn turnwise() -> Command {
    Command::new(env!("CARGO_BIN_EXE_turnwise"))
}

fn positive(v: &serde_json::Value, what: &str) -> f64 {
    let x = v
        .as_f64()
        .unwrap_or_else(|| panic!("{what} is not a number: {v}"));
    assert!(x.is_finite() && x > 0.0, "{what} = {x}");
    x
}

#[test]
fn quick_bench_on_tiny_sizes_reports_positive_finite_figures() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("bench.json");
    let out = turnwise()
        .args(["-q", "bench", "--quick", "--sizes", "tiny", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("| tiny |"), "{stdout}");
    assert!(stdout.contains("BM25 queries/s"), "{stdout}");
    assert!(stdout.contains("server requests/s"), "{stdout}");

    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["mode"], "quick");
    let model = v["model"].as_array().unwrap();
    assert_eq!(model.len(), 1);
    let m = &model[0];
    assert_eq!(m["size"]["name"], "tiny");
    positive(&m["train_tokens_per_s"], "train tokens/s");
    let batches: Vec<u64> = m["sample"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            positive(&s["tokens_per_s"], "sample tokens/s");
            s["batch"].as_u64().unwrap()
        })
        .collect();
    assert_eq!(batches, [1, 8, 64]);
    let env = &v["env"];
    assert!(env["documents"].as_u64().unwrap() > 0);
    positive(&env["bm25_queries_per_s"], "BM25 queries/s");
    positive(&env["bm25_batch_queries_per_s"], "BM25 batch queries/s");
    let server = env["server"].as_array().unwrap();
    assert!(!server.is_empty());
    for s in server {
        positive(&s["requests_per_s"], "server requests/s");
        assert_eq!(s["errors"], 0, "{s}");
    }
}

#[test]
fn bench_options_are_checked() {
    let out = turnwise()
        .args(["-q", "bench", "--quick", "--sizes", "C", "--only", "model"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--sizes") && err.contains("A, B, Q or tiny"),
        "{err}"
    );

    let out = turnwise()
        .args(["-q", "bench", "--only", "gpu"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--only"));
}
