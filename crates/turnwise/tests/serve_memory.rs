//! `turnwise serve` under a memory ceiling (review defects 1 and 7 of
//! ../shared/reviews/cli-as-a-user-2.md): the binary runs with its data segment limited
//! (`ulimit -d`), and a small request that asks for 64 long sequences at once is answered
//! within the `--memory-budget-mb` instead of taking the machine down; a sequence that alone
//! can never fit gets a 400 naming the flag; a long prompt's prefill stops at its next chunk
//! when the client goes away. The model is the committed tiny GGUF fixture's architecture with
//! a 4,096-token context. Without a budget, the fused attention answers the 64-sequence request
//! under the ceiling too; the composed attention (scores materialised) does not.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use serde_json::{Value, json};
use turnwise::model_source::load_init_tensors;
use turnwise_model::checkpoint::export_hf_folder;
use turnwise_model::model::weights::init_varmap;

/// The data-segment ceiling the server runs under (512 MiB). One prefill of the 64 × 500-token
/// request below without a budget materialises attention scores of 64 × 4 heads × 500² f32
/// (256 MB) in each layer, several such tensors at once.
const CEILING_KB: u64 = 512 << 10;

/// The fixture's architecture with a 4,096-token context and fresh weights, as an HF folder.
fn long_context_model(dir: &Path) -> PathBuf {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../turnwise-model/src/checkpoint/fixtures/gguf/tiny-llama.gguf");
    let (_, m) = load_init_tensors(&fixture).unwrap();
    let mut cfg = m.config.clone();
    cfg.max_position_embeddings = 4096;
    let varmap = init_varmap(&cfg, DType::F32, &Device::Cpu, 3).unwrap();
    let out = dir.join("long-context");
    export_hf_folder(&out, &cfg, &varmap, &m.tokenizer, &m.meta).unwrap();
    out
}

/// `turnwise serve` under the ceiling; its pid and URL.
struct Server {
    child: Child,
    url: String,
}

impl Server {
    fn start(model: &Path, flags: &[&str]) -> Self {
        Self::start_with_env(model, flags, &[])
    }

    /// [`Server::start`] with environment variables `env` set for the server.
    fn start_with_env(model: &Path, flags: &[&str], env: &[(&str, &str)]) -> Self {
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(format!("ulimit -d {CEILING_KB} && exec \"$0\" \"$@\""))
            .arg(env!("CARGO_BIN_EXE_turnwise"))
            .args(["serve", "--addr", "127.0.0.1:0", "--model"])
            .arg(model)
            .args(flags)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let url = loop {
            let line = lines
                .next()
                .expect("the server exited before listening")
                .unwrap();
            if let Some(rest) = line.split("listening on ").nth(1) {
                break rest.trim().to_string();
            }
        };
        // Keep draining stdout so the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Self { child, url }
    }

    /// Peak resident memory so far (`VmHWM`), in bytes.
    fn peak_rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
        line.split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<u64>()
            .unwrap()
            * 1024
    }

    fn info(&self) -> Value {
        client(60)
            .get(format!("{}/get_server_info", self.url))
            .send()
            .unwrap()
            .json()
            .unwrap()
    }

    /// POSTs `body` to `/v1/completions` with a client that gives up after `timeout`.
    fn complete(
        &self,
        body: &Value,
        timeout: Duration,
    ) -> reqwest::Result<reqwest::blocking::Response> {
        reqwest::blocking::Client::builder()
            .timeout(timeout)
            .build()
            .unwrap()
            .post(format!("{}/v1/completions", self.url))
            .json(body)
            .send()
    }

    fn prefill_tokens(&self) -> u64 {
        self.info()["engine"]["prefill_tokens"].as_u64().unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn client(timeout_secs: u64) -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(timeout_secs))
        .build()
        .unwrap()
}

/// A prompt of `n` token ids of the fixture's 301-token vocabulary.
fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 13 + 5) % 290 + 4).collect()
}

/// POSTs 64 sequences of 500 prompt tokens at once: 64 different prompts, so that each is
/// prefilled (the `n` samples of one prompt share one prefill since review
/// cli-as-a-user-3's M4; tests/serve.rs checks that).
fn sixty_four(server: &Server) -> reqwest::Result<reqwest::blocking::Response> {
    let prompts: Vec<Vec<u32>> = (0..64u32)
        .map(|k| prompt(500).into_iter().map(|t| (t + k) % 290 + 4).collect())
        .collect();
    server.complete(
        &json!({"prompt": prompts, "max_tokens": 4, "temperature": 0}),
        Duration::from_secs(600),
    )
}

#[test]
fn sixty_four_sequences_are_answered_within_the_budget_under_a_ceiling() {
    let tmp = tempfile::tempdir().unwrap();
    let model = long_context_model(tmp.path());
    let server = Server::start(&model, &["--memory-budget-mb", "64"]);
    let info = server.info();
    assert_eq!(info["memory_budget_bytes"], 64 << 20, "{info}");
    assert_eq!(info["prefill_chunk"], 512, "{info}");
    let rss_before = server.peak_rss();
    let t = Instant::now();
    let r = sixty_four(&server).expect("the server answers");
    let status = r.status().as_u16();
    let v: Value = r.json().unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 64);
    let peak = server.peak_rss();
    eprintln!(
        "64 x 500 prompt tokens in {:.1} s; peak RSS {} MiB (before the request {} MiB)",
        t.elapsed().as_secs_f64(),
        peak >> 20,
        rss_before >> 20
    );
    assert!(
        peak < rss_before + (64 << 20) + (64 << 20),
        "peak RSS {} MiB: beyond the budget plus the server's own memory",
        peak >> 20
    );
    let peak_batch = server.info()["engine"]["peak_batch"].as_u64().unwrap();
    eprintln!("peak batch {peak_batch}");
    assert!(
        peak_batch < 64,
        "the budget held rows back: peak batch {peak_batch}"
    );
    assert_eq!(server.prefill_tokens(), 64 * 500);

    // Without a budget, the fused attention (no T × T scores) answers the same request under
    // the ceiling as well: what the budget held back was mostly the scores.
    let unbounded = Server::start(&model, &["--memory-budget-mb", "100000"]);
    let r = sixty_four(&unbounded).expect("the unbudgeted server answers");
    assert_eq!(r.status().as_u16(), 200);
    eprintln!(
        "no budget, fused attention: peak RSS {} MiB",
        unbounded.peak_rss() >> 20
    );
    drop(unbounded);

    // The control: the composed attention (the scores materialised, as on a GPU or in half
    // precision) and a budget beyond the ceiling: the same request kills the server (what every
    // request did before the budget existed).
    let composed = Server::start_with_env(
        &model,
        &["--memory-budget-mb", "100000"],
        &[("TURNWISE_FUSED_ATTENTION", "0")],
    );
    let answer = sixty_four(&composed);
    // An answer leaves the server running (dropping it kills it): the control failed.
    assert!(
        answer.is_err(),
        "without a budget the composed attention should exceed the {} MiB ceiling",
        CEILING_KB >> 10
    );
    let mut composed = composed;
    let exit = composed.child.wait().unwrap();
    assert!(!exit.success(), "the server exited cleanly: {exit}");
}

#[test]
fn a_sequence_that_can_never_fit_gets_a_400_naming_the_budget() {
    let tmp = tempfile::tempdir().unwrap();
    let model = long_context_model(tmp.path());
    let server = Server::start(&model, &["--memory-budget-mb", "1"]);
    let r = server
        .complete(
            &json!({"prompt": prompt(3000), "max_tokens": 1}),
            Duration::from_secs(60),
        )
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let v: Value = r.json().unwrap();
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("--memory-budget-mb") && msg.contains("budget of 1 MiB"),
        "{msg}"
    );
    // What fits is served.
    let r = server
        .complete(
            &json!({"prompt": prompt(5), "max_tokens": 2}),
            Duration::from_secs(60),
        )
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
}

#[test]
fn a_long_prefill_stops_when_its_client_goes_away() {
    let tmp = tempfile::tempdir().unwrap();
    let model = long_context_model(tmp.path());
    let server = Server::start(&model, &["--prefill-chunk-tokens", "2"]);
    let before = server.prefill_tokens();
    let gone = server.complete(
        &json!({"prompt": prompt(4000), "max_tokens": 1}),
        Duration::from_millis(200),
    );
    assert!(gone.is_err(), "the client timed out");
    // The engine notices at its next step; then the count stays put.
    std::thread::sleep(Duration::from_millis(500));
    let after = server.prefill_tokens() - before;
    std::thread::sleep(Duration::from_millis(500));
    let later = server.prefill_tokens() - before;
    eprintln!("prefilled {after} of 4,000 prompt tokens before the client went away");
    assert_eq!(after, later, "the prefill went on after its client left");
    assert!(after < 4000, "the whole prompt was prefilled ({after})");
    // The server still answers.
    let r = server
        .complete(
            &json!({"prompt": prompt(5), "max_tokens": 2}),
            Duration::from_secs(60),
        )
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
}
