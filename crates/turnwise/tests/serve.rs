//! `turnwise serve` with a real HTTP client: SGLang's and OpenAI's shapes, token ids equal to
//! what the sampling engine draws alone, log-probs equal to a teacher-forced recomputation,
//! weight reloads, 32 concurrent clients, malformed input. The model is the committed tiny
//! GGUF fixture (Llama architecture, 301-token BPE vocabulary, ChatML template).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{D, Tensor};
use serde_json::{Value, json};
use turnwise::model_source::load_init_tensors;
use turnwise::serve::{PolicyServer, ServeConfig, load_served};
use turnwise_model::checkpoint::export_hf_folder;
use turnwise_model::model::Transformer;
use turnwise_model::model::weights::varmap_from_tensors;
use turnwise_model::sampling::{SamplingParams, generate};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../turnwise-model/src/checkpoint/fixtures/gguf/tiny-llama.gguf")
}

fn config(max_queue: usize) -> ServeConfig {
    ServeConfig {
        addr: "127.0.0.1:0".parse().unwrap(),
        max_queue,
        ..Default::default()
    }
}

fn start(max_queue: usize) -> PolicyServer {
    PolicyServer::start(load_served(&fixture()).unwrap(), &config(max_queue)).unwrap()
}

/// A server whose prefix cache holds `prefix_cache` bytes (0: none).
fn start_with(prefix_cache: u64) -> PolicyServer {
    let cfg = ServeConfig {
        prefix_cache,
        ..config(1024)
    };
    PolicyServer::start(load_served(&fixture()).unwrap(), &cfg).unwrap()
}

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(std::time::Duration::from_secs(120))
        .build()
        .unwrap()
}

fn post(url: &str, body: &Value) -> (u16, Value) {
    let r = client().post(url).json(body).send().unwrap();
    let status = r.status().as_u16();
    (status, r.json().unwrap())
}

fn post_raw(url: &str, body: &str) -> (u16, Value) {
    let r = client()
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().unwrap())
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Log-probs of `out` after `prompt` under `model` at `temperature` (1 when 0), teacher-forced.
fn recompute(model: &Transformer, prompt: &[u32], out: &[u32], temperature: f64) -> Vec<f32> {
    let all: Vec<u32> = prompt.iter().chain(out).copied().collect();
    let logits = model.forward_sequence(&all).unwrap();
    let t = if temperature > 0.0 { temperature } else { 1.0 };
    let lp = candle_nn::ops::log_softmax(&(logits / t).unwrap(), D::Minus1)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    (0..out.len())
        .map(|i| lp[prompt.len() + i - 1][out[i] as usize])
        .collect()
}

fn local_model() -> Transformer {
    let (_, m) = load_init_tensors(&fixture()).unwrap();
    Transformer::from_tensors(&m.config, &m.tensors, "fixture").unwrap()
}

const PROMPT: [u32; 6] = [5, 17, 42, 99, 7, 250];

#[test]
fn generate_returns_the_engines_tokens_and_recomputable_logprobs() {
    let server = start(1024);
    let url = format!("{}/generate", server.url());
    let model = local_model();
    for (temperature, top_p) in [(0.0, 1.0), (1.0, 1.0), (0.7, 0.9)] {
        let (status, v) = post(
            &url,
            &json!({"input_ids": PROMPT, "return_logprob": true,
                    "sampling_params": {"max_new_tokens": 24, "temperature": temperature,
                                        "top_p": top_p, "sampling_seed": 11, "ignore_eos": true}}),
        );
        assert_eq!(status, 200, "{v}");
        let out = ids(&v["output_ids"]);
        assert_eq!(out.len(), 24);
        let meta = &v["meta_info"];
        assert_eq!(meta["prompt_tokens"], 6);
        assert_eq!(meta["completion_tokens"], 24);
        assert_eq!(meta["finish_reason"]["type"], "length");
        assert_eq!(meta["weight_version"], "0");
        let lps: Vec<(f64, u32)> = meta["output_token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e[0].as_f64().unwrap(), e[1].as_u64().unwrap() as u32))
            .collect();
        // slime and AReaL read the ids from the log-prob entries: they must be the output ids.
        assert_eq!(lps.iter().map(|e| e.1).collect::<Vec<_>>(), out);

        // The same draw as the sampling engine alone, with the same seed.
        let params = SamplingParams {
            temperature,
            top_p,
            max_new_tokens: 24,
            ..Default::default()
        };
        let local = generate(&model, &[PROMPT.to_vec()], &[11], &params, None).unwrap();
        assert_eq!(local[0].tokens, out, "temperature {temperature}");

        // Log-probs as a trainer recomputes them (1e-5).
        let re = recompute(&model, &PROMPT, &out, temperature);
        for (i, ((lp, _), r)) in lps.iter().zip(&re).enumerate() {
            assert!(
                (*lp as f32 - r).abs() < 1e-5,
                "temperature {temperature}, token {i}: served {lp}, recomputed {r}"
            );
        }
    }
    // Batches and n: one answer per prompt × sample, in order; text prompts are tokenized.
    let (status, v) = post(
        &url,
        &json!({"input_ids": [PROMPT, [3, 4, 5]],
                "sampling_params": {"max_new_tokens": 4, "n": 2, "temperature": 0}}),
    );
    assert_eq!(status, 200, "{v}");
    let arr = v.as_array().unwrap();
    assert_eq!(arr.len(), 4);
    assert_eq!(arr[0]["meta_info"]["prompt_tokens"], 6);
    assert_eq!(arr[2]["meta_info"]["prompt_tokens"], 3);
    assert_eq!(
        arr[0]["output_ids"], arr[1]["output_ids"],
        "greedy samples agree"
    );
    let (status, v) = post(
        &url,
        &json!({"text": "hello", "sampling_params": {"max_new_tokens": 3}}),
    );
    assert_eq!(status, 200, "{v}");
    assert!(v["text"].is_string());
    server.shutdown().unwrap();
}

#[test]
fn openai_routes_answer_in_openai_shapes_with_token_ids() {
    let server = start(1024);
    let base = server.url();
    let model = local_model();
    let (status, v) = post(
        &format!("{base}/v1/completions"),
        &json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                "logprobs": 2, "return_token_ids": true, "ignore_eos": true}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "length");
    let out = ids(&c["token_ids"]);
    assert_eq!(ids(&c["prompt_token_ids"]), PROMPT.to_vec());
    let lps: Vec<f32> = c["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect();
    let re = recompute(&model, &PROMPT, &out, 0.0);
    for (a, b) in lps.iter().zip(&re) {
        assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    }
    assert_eq!(
        c["logprobs"]["top_logprobs"][0].as_object().unwrap().len(),
        2
    );
    assert_eq!(v["usage"]["completion_tokens"], 10);
    // vLLM's token naming.
    let (_, v) = post(
        &format!("{base}/v1/completions"),
        &json!({"prompt": PROMPT, "max_tokens": 3, "logprobs": 0,
                "return_tokens_as_token_ids": true}),
    );
    assert!(
        v["choices"][0]["logprobs"]["tokens"][0]
            .as_str()
            .unwrap()
            .starts_with("token_id:")
    );

    // Chat: the messages go through the GGUF's ChatML template.
    let (status, v) = post(
        &format!("{base}/v1/chat/completions"),
        &json!({"messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 8, "temperature": 0, "logprobs": true, "top_logprobs": 3,
                "return_token_ids": true}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    let c = &v["choices"][0];
    assert_eq!(c["message"]["role"], "assistant");
    assert!(c["message"]["content"].is_string());
    let prompt = ids(&v["prompt_token_ids"]);
    let m = load_init_tensors(&fixture()).unwrap().1;
    let im_start = m.tokenizer.token_to_id("<|im_start|>").unwrap();
    assert_eq!(prompt[0], im_start, "rendered with the chat template");
    let out = ids(&c["token_ids"]);
    let content = c["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), out.len());
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 3);
    let re = recompute(&model, &prompt, &out, 0.0);
    for (e, r) in content.iter().zip(&re) {
        assert!((e["logprob"].as_f64().unwrap() as f32 - r).abs() < 1e-5);
    }
    // A stop at the ChatML end token ends with finish_reason "stop" when it is generated.
    if c["finish_reason"] == "stop" {
        let im_end = m.tokenizer.token_to_id("<|im_end|>").unwrap();
        assert_eq!(*out.last().unwrap(), im_end);
    }

    let r = client().get(format!("{base}/v1/models")).send().unwrap();
    let v: Value = r.json().unwrap();
    assert_eq!(v["data"][0]["id"], server.name());
    assert_eq!(
        client()
            .get(format!("{base}/health"))
            .send()
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        client()
            .get(format!("{base}/health_generate"))
            .send()
            .unwrap()
            .status(),
        200
    );
    server.shutdown().unwrap();
}

/// The fixture with its final norm scaled: the same architecture, other answers.
fn perturbed_folder(dir: &Path) -> PathBuf {
    let (_, m) = load_init_tensors(&fixture()).unwrap();
    let mut tensors: HashMap<String, Tensor> = m.tensors.clone();
    for (name, t) in tensors.iter_mut() {
        if name.contains("mlp.down_proj") || name == "model.norm.weight" {
            *t = (t.clone() * -3.0).unwrap();
        }
    }
    let varmap = varmap_from_tensors(&m.config, &tensors, "perturbed").unwrap();
    let out = dir.join("step-1");
    export_hf_folder(&out, &m.config, &varmap, &m.tokenizer, &m.meta).unwrap();
    out
}

#[test]
fn weight_reload_changes_the_next_answer() {
    let tmp = tempfile::tempdir().unwrap();
    let server = start(1024);
    let base = server.url();
    let ask = || {
        let (status, v) = post(
            &format!("{base}/generate"),
            &json!({"input_ids": PROMPT, "return_logprob": true,
                    "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": true}}),
        );
        assert_eq!(status, 200, "{v}");
        v
    };
    let before = ask();
    let version = |b: &str| -> Value {
        client()
            .get(format!("{b}/get_weight_version"))
            .send()
            .unwrap()
            .json()
            .unwrap()
    };
    assert_eq!(version(&base)["weight_version"], "0");

    let folder = perturbed_folder(tmp.path());
    let (status, v) = post(
        &format!("{base}/update_weights_from_disk"),
        &json!({"model_path": folder, "weight_version": "step-1"}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["success"], true);
    assert_eq!(version(&base)["weight_version"], "step-1");
    let after = ask();
    assert_eq!(after["meta_info"]["weight_version"], "step-1");
    assert_ne!(
        before["output_ids"], after["output_ids"],
        "new weights, new answer"
    );
    // The new answer is the new weights' own greedy answer, with their log-probs.
    let (_, m) = load_init_tensors(&folder).unwrap();
    let new_model = Transformer::from_tensors(&m.config, &m.tensors, "new").unwrap();
    let out = ids(&after["output_ids"]);
    let local = generate(
        &new_model,
        &[PROMPT.to_vec()],
        &[0],
        &SamplingParams {
            temperature: 0.0,
            max_new_tokens: 12,
            ..Default::default()
        },
        None,
    )
    .unwrap();
    assert_eq!(local[0].tokens, out);

    // A folder that is not there, or of another architecture, is refused; the weights stay.
    let (status, v) = post(
        &format!("{base}/update_weights_from_disk"),
        &json!({"model_path": tmp.path().join("missing")}),
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["success"], false);
    assert!(
        v["message"].as_str().unwrap().contains("does not exist"),
        "{v}"
    );
    let qwen = fixture().with_file_name("tiny-qwen2.gguf");
    let (status, v) = post(
        &format!("{base}/update_weights_from_disk"),
        &json!({"model_path": qwen}),
    );
    assert_eq!(status, 400, "{v}");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("different architecture"),
        "{v}"
    );
    assert_eq!(version(&base)["weight_version"], "step-1");
    // Without a version, a numeric one counts up.
    let (status, _) = post(
        &format!("{base}/update_weights_from_disk"),
        &json!({"model_path": fixture()}),
    );
    assert_eq!(status, 200);
    assert_eq!(
        ask()["output_ids"],
        before["output_ids"],
        "back to the first weights"
    );
    server.shutdown().unwrap();
}

#[test]
fn thirty_two_concurrent_clients_share_the_batch_without_errors() {
    let server = start(1024);
    let url = format!("{}/generate", server.url());
    let body = |i: u64| {
        json!({"input_ids": [PROMPT[0], 10 + i as u32, 20, 30 + i as u32],
               "return_logprob": true,
               "sampling_params": {"max_new_tokens": 16, "temperature": 1.0,
                                   "sampling_seed": i, "ignore_eos": true}})
    };
    // Each client's answer alone (one at a time) ...
    let alone: Vec<Value> = (0..32).map(|i| post(&url, &body(i)).1).collect();
    // ... equals its answer among 32 concurrent clients (3 requests each).
    let handles: Vec<_> = (0..32u64)
        .map(|i| {
            let url = url.clone();
            let b = body(i);
            std::thread::spawn(move || {
                (0..3)
                    .map(|_| post(&url, &b))
                    .collect::<Vec<(u16, Value)>>()
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        for (status, v) in h.join().unwrap() {
            assert_eq!(status, 200, "client {i}: {v}");
            assert_eq!(v["output_ids"], alone[i]["output_ids"], "client {i}");
            let a = v["meta_info"]["output_token_logprobs"].as_array().unwrap();
            let b = alone[i]["meta_info"]["output_token_logprobs"]
                .as_array()
                .unwrap();
            for (x, y) in a.iter().zip(b) {
                assert!((x[0].as_f64().unwrap() - y[0].as_f64().unwrap()).abs() < 1e-5);
            }
        }
    }
    // The concurrent requests were decoded together, not one after another.
    let info: Value = client()
        .get(format!("{}/get_server_info", server.url()))
        .send()
        .unwrap()
        .json()
        .unwrap();
    let peak = info["engine"]["peak_batch"].as_u64().unwrap();
    assert!(peak >= 8, "largest batch {peak}: {info}");
    assert_eq!(info["engine"]["sequences"], 32 + 96);
    assert_eq!(info["in_flight"], 0);
    server.shutdown().unwrap();
}

#[test]
fn an_oversized_body_gets_a_json_413_naming_the_flag() {
    let cfg = ServeConfig {
        max_body_bytes: 2_000,
        ..config(8)
    };
    let server = PolicyServer::start(load_served(&fixture()).unwrap(), &cfg).unwrap();
    let url = format!("{}/v1/completions", server.url());
    let body = json!({"prompt": "a ".repeat(2_000)}).to_string();
    let (s, v) = post_raw(&url, &body);
    assert_eq!(s, 413, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("--max-body-bytes") && msg.contains("2000"),
        "{msg}"
    );
    // A body under the limit is served.
    let (s, v) = post(&url, &json!({"prompt": "a b", "max_tokens": 2}));
    assert_eq!(s, 200, "{v}");
    server.shutdown().unwrap();
}

#[test]
fn malformed_requests_get_4xx_naming_the_field() {
    let server = start(2);
    let base = server.url();
    let g = format!("{base}/generate");
    let cases: Vec<(&str, String, u16, &str)> = vec![
        (&g, "{not json".into(), 400, "body"),
        (
            &g,
            json!({"sampling_params": {}}).to_string(),
            400,
            "input_ids",
        ),
        (
            &g,
            json!({"input_ids": PROMPT, "sampling_params": {"temperature": -1}}).to_string(),
            400,
            "sampling_params.temperature",
        ),
        (
            &g,
            json!({"input_ids": PROMPT, "sampling_params": {"temperature": "hot"}}).to_string(),
            400,
            "sampling_params.temperature",
        ),
        (
            &g,
            json!({"input_ids": [1, 2, 999999]}).to_string(),
            400,
            "input_ids[2]",
        ),
        (&g, json!({"input_ids": []}).to_string(), 400, "input_ids"),
        (
            &g,
            json!({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}}).to_string(),
            400,
            "sampling_params.max_new_tokens",
        ),
        (
            &g,
            json!({"input_ids": PROMPT, "stream": true}).to_string(),
            400,
            "stream",
        ),
        (
            &g,
            json!({"input_ids": PROMPT, "sampling_params": {"top_p": 0}}).to_string(),
            400,
            "sampling_params.top_p",
        ),
        // More sequences than the queue ever holds (2): 400 naming the flag, not a 503 that
        // invites retries that can never succeed.
        (
            &g,
            json!({"input_ids": PROMPT, "sampling_params": {"n": 3}}).to_string(),
            400,
            "--max-queue",
        ),
    ];
    let c = format!("{base}/v1/completions");
    let ch = format!("{base}/v1/chat/completions");
    let more: Vec<(&str, String, u16, &str)> = vec![
        (&c, json!({"max_tokens": 3}).to_string(), 400, "prompt"),
        (
            &c,
            json!({"prompt": "x", "max_tokens": -3}).to_string(),
            400,
            "max_tokens",
        ),
        (
            &c,
            json!({"prompt": "x", "logprobs": 50}).to_string(),
            400,
            "logprobs",
        ),
        (&ch, json!({"messages": []}).to_string(), 400, "messages"),
        // Fields turnwise does not implement are refused by name, never silently ignored
        // (the review's logit_bias, penalties, response_format, tools, min_new_tokens).
        (
            &c,
            json!({"prompt": "x", "logit_bias": {"7": -100}}).to_string(),
            400,
            "logit_bias",
        ),
        (
            &c,
            json!({"prompt": "x", "frequency_penalty": 2}).to_string(),
            400,
            "frequency_penalty",
        ),
        (
            &ch,
            json!({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 2})
                .to_string(),
            400,
            "presence_penalty",
        ),
        (
            &ch,
            json!({"messages": [{"role": "user", "content": "hi"}],
                   "response_format": {"type": "json_object"}})
            .to_string(),
            400,
            "response_format",
        ),
        // Tools are rendered by the chat template (tests/serve_tools.rs); the fixture's
        // ChatML template has no tools block, so they are refused rather than ignored.
        (
            &ch,
            json!({"messages": [{"role": "user", "content": "hi"}],
                   "tools": [{"type": "function", "function": {"name": "f"}}]})
            .to_string(),
            400,
            "tools",
        ),
        (
            &g,
            json!({"input_ids": PROMPT, "sampling_params": {"repetition_penalty": 1.3}})
                .to_string(),
            400,
            "sampling_params.repetition_penalty",
        ),
        (
            &g,
            json!({"input_ids": PROMPT, "sampling_params": {"min_new_tokens": 4}}).to_string(),
            400,
            "sampling_params.min_new_tokens",
        ),
        (
            &ch,
            json!({"messages": [{"role": "wizard", "content": "hi"}]}).to_string(),
            400,
            "messages[0].role",
        ),
        (
            &ch,
            json!({"messages": [{"role": "user"}]}).to_string(),
            400,
            "messages[0]",
        ),
    ];
    for (url, body, status, field) in cases.into_iter().chain(more) {
        let (s, v) = post_raw(url, &body);
        assert_eq!(s, status, "{body} → {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(field), "{body}: {msg} should name {field}");
    }
    let r = client().get(format!("{base}/nope")).send().unwrap();
    assert_eq!(r.status(), 404);
    // A prompt longer than any context is refused before it is tokenized, by its length.
    let t0 = std::time::Instant::now();
    let (s, v) = post(&c, &json!({"prompt": "a ".repeat(200_000)}));
    assert_eq!(s, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.starts_with("prompt: is 400000 bytes"), "{msg}");
    assert!(t0.elapsed().as_secs_f64() < 5.0);
    // Neutral values and labels are accepted: they change nothing.
    let (s, v) = post(
        &c,
        &json!({"prompt": "x", "max_tokens": 2, "frequency_penalty": 0, "presence_penalty": 0.0,
                "logit_bias": {}, "user": "me", "best_of": 1}),
    );
    assert_eq!(s, 200, "{v}");
    let (s, v) = post(
        &ch,
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "response_format": {"type": "text"}, "tools": [], "tool_choice": "none"}),
    );
    assert_eq!(s, 200, "{v}");
    // The server still answers after all of that.
    let (s, _) = post(
        &g,
        &json!({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}),
    );
    assert_eq!(s, 200);
    server.shutdown().unwrap();
}

fn contents(v: &Value) -> Vec<String> {
    v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["message"]["content"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn guided_choice_answers_one_of_the_choices_and_greedy_picks_the_likeliest() {
    let server = start(1024);
    let base = server.url();
    let ch = format!("{base}/v1/chat/completions");
    let choices = ["-1.0", "0.2", "0.25", "1.0"];
    let mut seen = std::collections::BTreeSet::new();
    for temperature in [0.0, 0.5, 1.0, 1.5] {
        for seed in 0..4u64 {
            let (status, v) = post(
                &ch,
                &json!({"messages": [{"role": "user", "content": "Score it."}],
                        "guided_choice": choices, "temperature": temperature, "top_p": 0.95,
                        "seed": seed, "n": 6, "max_tokens": 16}),
            );
            assert_eq!(status, 200, "{v}");
            for (c, text) in v["choices"].as_array().unwrap().iter().zip(contents(&v)) {
                assert!(choices.contains(&text.as_str()), "{text:?}");
                assert_eq!(c["finish_reason"], "stop", "{c}");
                seen.insert(text);
            }
        }
    }
    assert!(seen.len() >= 2, "sampling explores the choices: {seen:?}");
    // vLLM's newer spelling, on /v1/completions too.
    let (status, v) = post(
        &format!("{base}/v1/completions"),
        &json!({"prompt": PROMPT, "structured_outputs": {"choice": choices},
                "temperature": 1.0, "n": 8, "seed": 3, "max_tokens": 16}),
    );
    assert_eq!(status, 200, "{v}");
    for c in v["choices"].as_array().unwrap() {
        assert!(choices.contains(&c["text"].as_str().unwrap()), "{c}");
    }

    // Greedy over single-token choices picks the choice of highest teacher-forced
    // probability, and reports its log-prob under the constrained distribution (the softmax
    // over the choices only).
    let served = load_served(&fixture()).unwrap();
    let tok = &served.tensors.tokenizer;
    let single: Vec<(String, u32)> = ["a", "e", "t", "7", "x", "Q"]
        .iter()
        .filter_map(|s| match tok.encode(s).unwrap().as_slice() {
            [id] => Some((s.to_string(), *id)),
            _ => None,
        })
        .collect();
    assert!(single.len() >= 4, "{single:?}");
    let names: Vec<&str> = single.iter().map(|(s, _)| s.as_str()).collect();
    let model = local_model();
    for prompt in [PROMPT.to_vec(), vec![9, 8, 7], vec![120, 3, 44, 200, 5]] {
        let (status, v) = post(
            &format!("{base}/v1/completions"),
            &json!({"prompt": prompt, "guided_choice": names, "temperature": 0,
                    "max_tokens": 4, "logprobs": 0, "return_token_ids": true}),
        );
        assert_eq!(status, 200, "{v}");
        let c = &v["choices"][0];
        let logits = model.forward_sequence(&prompt).unwrap();
        let last = logits
            .get(prompt.len() - 1)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let best = single
            .iter()
            .max_by(|a, b| last[a.1 as usize].total_cmp(&last[b.1 as usize]))
            .unwrap();
        assert_eq!(c["text"], best.0.as_str(), "{v}");
        assert_eq!(ids(&c["token_ids"]), vec![best.1]);
        let lse = single
            .iter()
            .map(|(_, t)| f64::from(last[*t as usize]))
            .fold(0.0, |acc, x| acc + x.exp())
            .ln();
        let want = f64::from(last[best.1 as usize]) - lse;
        let got = c["logprobs"]["token_logprobs"][0].as_f64().unwrap();
        assert!((got - want).abs() < 1e-4, "{got} vs {want}");
    }
    server.shutdown().unwrap();
}

#[test]
fn continue_final_message_continues_the_assistant_text() {
    let server = start(1024);
    let ch = format!("{}/v1/chat/completions", server.url());
    let served = load_served(&fixture()).unwrap();
    let tok = &served.tensors.tokenizer;
    let chat = served.tensors.meta.chat_template().unwrap().unwrap();
    let prefill = "<score>\nTurn1: ";
    let msgs = [
        turnwise_model::tokenizer::ChatMessage::new("user", "Rate the turns."),
        turnwise_model::tokenizer::ChatMessage::new("assistant", prefill),
    ];
    // The template rendered without the generation prompt, cut after the assistant's text.
    let closed = chat.render(&msgs, false).unwrap();
    let open = &closed[..closed.rfind(prefill).unwrap() + prefill.len()];
    assert!(closed.len() > open.len(), "the template closes the message");
    let body = json!({"messages": [{"role": "user", "content": "Rate the turns."},
                                   {"role": "assistant", "content": prefill}],
                      "continue_final_message": true, "add_generation_prompt": false,
                      "return_token_ids": true, "temperature": 0, "max_tokens": 5});
    let (status, v) = post(&ch, &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(ids(&v["prompt_token_ids"]), tok.encode(open).unwrap());
    // Without it the assistant message is closed and a new one opened.
    let mut plain = body.clone();
    plain
        .as_object_mut()
        .unwrap()
        .remove("continue_final_message");
    plain
        .as_object_mut()
        .unwrap()
        .remove("add_generation_prompt");
    let (_, p) = post(&ch, &plain);
    assert_eq!(
        ids(&p["prompt_token_ids"]),
        tok.encode(&chat.render(&msgs, true).unwrap()).unwrap()
    );
    // With guided_choice: the judge's request shape.
    let mut judged = body.clone();
    judged["guided_choice"] = json!(["-1.0", "0.2", "1.0"]);
    judged["temperature"] = json!(1.0);
    judged["n"] = json!(8);
    let (status, v) = post(&ch, &judged);
    assert_eq!(status, 200, "{v}");
    for text in contents(&v) {
        assert!(["-1.0", "0.2", "1.0"].contains(&text.as_str()), "{text:?}");
    }

    // Bad values: 400 naming the field.
    let user = json!([{"role": "user", "content": "hi"}]);
    let asst = json!([{"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "Turn1: "}]);
    let cases = [
        (
            json!({"messages": user, "continue_final_message": true,
                   "add_generation_prompt": false}),
            "continue_final_message",
        ),
        (
            json!({"messages": asst, "continue_final_message": true}),
            "continue_final_message",
        ),
        (
            json!({"messages": user, "guided_choice": []}),
            "guided_choice",
        ),
        (
            json!({"messages": user, "guided_choice": ["0.2", "0.2"]}),
            "guided_choice",
        ),
        (
            json!({"messages": user, "guided_choice": ["", "1"]}),
            "guided_choice",
        ),
        (
            json!({"messages": user, "guided_choice": "0.2"}),
            "guided_choice",
        ),
        (
            json!({"messages": user, "guided_choice": ["1"],
                   "structured_outputs": {"choice": ["2"]}}),
            "guided_choice",
        ),
        (
            json!({"messages": user, "structured_outputs": {"regex": "a+"}}),
            "structured_outputs.regex",
        ),
    ];
    for (body, field) in cases {
        let (s, v) = post(&ch, &body);
        assert_eq!(s, 400, "{body} → {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(field), "{body}: {msg} should name {field}");
    }
    // A choice no tokens spell: the fixture's byte-level vocabulary spells any text, so this
    // is checked on a word-level vocabulary in turnwise-model's choice tests.
    server.shutdown().unwrap();
}

/// The served model's context length (`/get_model_info`).
fn context_length(server: &PolicyServer) -> usize {
    let v: Value = client()
        .get(format!("{}/get_model_info", server.url()))
        .send()
        .unwrap()
        .json()
        .unwrap();
    v["max_context_length"].as_u64().unwrap() as usize
}

fn prefill_tokens(server: &PolicyServer) -> u64 {
    let v: Value = client()
        .get(format!("{}/get_server_info", server.url()))
        .send()
        .unwrap()
        .json()
        .unwrap();
    v["engine"]["prefill_tokens"].as_u64().unwrap()
}

/// A prompt of `n` token ids of the fixture's 301-token vocabulary.
fn long_prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 13 + 5) % 290 + 4).collect()
}

/// Review cli-as-a-user-3, M4: `n` samples of one prompt prefilled it `n` times
/// (`prefill_tokens` grew by 64 × 505). Now the prompt is prefilled once and its keys and
/// values shared; each sample prefills only the prompt's last token.
#[test]
fn n_samples_of_a_prompt_prefill_it_once() {
    // Without the prefix cache, which would serve the second route's prompt from the first's.
    let server = start_with(0);
    let p = long_prompt(200.min(context_length(&server) - 8));
    for (route, body) in [
        (
            "/v1/completions",
            json!({"prompt": p, "n": 8, "max_tokens": 3, "temperature": 1.0, "seed": 5}),
        ),
        (
            "/generate",
            json!({"input_ids": p, "sampling_params": {"n": 8, "max_new_tokens": 3,
                    "temperature": 1.0, "sampling_seed": 5}}),
        ),
    ] {
        let before = prefill_tokens(&server);
        let (s, v) = post(&format!("{}{route}", server.url()), &body);
        assert_eq!(s, 200, "{v}");
        let grew = prefill_tokens(&server) - before;
        eprintln!(
            "{route}: n = 8 of a {}-token prompt prefilled {grew} tokens",
            p.len()
        );
        assert_eq!(
            grew,
            (p.len() - 1 + 8) as u64,
            "{route}: the prompt once, then each sample's last prompt token"
        );
    }
    // Greedy samples of a shared prompt are the greedy answer of the prompt alone.
    let url = format!("{}/v1/completions", server.url());
    let (s, alone) = post(
        &url,
        &json!({"prompt": p, "max_tokens": 6, "temperature": 0, "return_token_ids": true}),
    );
    assert_eq!(s, 200, "{alone}");
    let (s, many) = post(
        &url,
        &json!({"prompt": p, "n": 4, "max_tokens": 6, "temperature": 0,
                "return_token_ids": true}),
    );
    assert_eq!(s, 200, "{many}");
    for c in many["choices"].as_array().unwrap() {
        assert_eq!(c["token_ids"], alone["choices"][0]["token_ids"], "{c}");
    }
    server.shutdown().unwrap();
}

/// Review cli-as-a-user-3, M7: `guided_choice` had no cap (20,000 choices never finished and
/// stalled every other request). A list beyond the server's limits is refused at once, naming
/// the field and the flag; one within them is served.
#[test]
fn guided_choice_beyond_the_limits_gets_a_400_naming_the_flag() {
    let cfg = ServeConfig {
        max_guided_choices: 16,
        max_guided_choice_bytes: 1_000,
        ..config(64)
    };
    let server = PolicyServer::start(load_served(&fixture()).unwrap(), &cfg).unwrap();
    let base = server.url();
    let many: Vec<String> = (0..17).map(|i| format!("c{i}")).collect();
    let long: Vec<String> = vec!["x".repeat(600), "y".repeat(600)];
    let chat = format!("{base}/v1/chat/completions");
    let comp = format!("{base}/v1/completions");
    let msgs = json!([{"role": "user", "content": "Pick."}]);
    for (url, body, flag) in [
        (
            &chat,
            json!({"messages": msgs, "guided_choice": many, "max_tokens": 4}),
            "--max-guided-choices",
        ),
        (
            &comp,
            json!({"prompt": "a", "structured_outputs": {"choice": many}, "max_tokens": 4}),
            "--max-guided-choices",
        ),
        (
            &chat,
            json!({"messages": msgs, "guided_choice": long, "max_tokens": 4}),
            "--max-guided-choice-bytes",
        ),
    ] {
        let t0 = std::time::Instant::now();
        let (s, v) = post(url, &body);
        assert_eq!(s, 400, "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(
            msg.starts_with("guided_choice:") && msg.contains(flag),
            "{msg} should name guided_choice and {flag}"
        );
        assert!(t0.elapsed().as_secs_f64() < 5.0, "refused at once");
    }
    // At the limits: served.
    let ok: Vec<String> = (0..16).map(|i| format!("c{i}")).collect();
    let (s, v) = post(
        &chat,
        &json!({"messages": msgs, "guided_choice": ok, "max_tokens": 8}),
    );
    assert_eq!(s, 200, "{v}");
    server.shutdown().unwrap();
}

/// Review cli-as-a-user-3, m9: `max_tokens = 1e9` was accepted (it generated until the
/// context was full). A prompt plus `max_tokens` beyond the context gets a 400 naming the
/// numbers, as vLLM and OpenAI answer; a request that gives no limit still gets an answer,
/// cut to what the context leaves.
#[test]
fn max_tokens_beyond_the_context_gets_a_400_and_an_omitted_one_fits() {
    let server = start(64);
    let base = server.url();
    let ctx = context_length(&server);
    let chat = format!("{base}/v1/chat/completions");
    let comp = format!("{base}/v1/completions");
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let p = long_prompt(ctx - 3);
    for (url, body, field) in [
        (
            &comp,
            json!({"prompt": [5, 6, 7], "max_tokens": 1_000_000_000u64}),
            "max_tokens",
        ),
        (&comp, json!({"prompt": p, "max_tokens": 4}), "max_tokens"),
        (
            &chat,
            json!({"messages": msgs, "max_completion_tokens": ctx}),
            "max_completion_tokens",
        ),
        (
            &chat,
            json!({"messages": msgs, "max_tokens": ctx}),
            "max_tokens",
        ),
        (
            &format!("{base}/generate"),
            json!({"input_ids": p, "sampling_params": {"max_new_tokens": 4}}),
            "sampling_params.max_new_tokens",
        ),
    ] {
        let (s, v) = post(url, &body);
        assert_eq!(s, 400, "{body} → {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(
            msg.starts_with(&format!("{field}:")) && msg.contains(&format!("context of {ctx}")),
            "{msg}"
        );
    }
    let (s, v) = post(&comp, &json!({"prompt": p, "max_tokens": 4}));
    let msg = v["error"]["message"].as_str().unwrap();
    assert_eq!(s, 400);
    assert!(
        msg.contains(&format!("{} prompt tokens + 4", ctx - 3)) && msg.contains("at most 3"),
        "{msg}"
    );
    // No limit given: the answer stops at the context.
    let (s, v) = post(
        &comp,
        &json!({"prompt": p, "ignore_eos": true, "return_token_ids": true}),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert!(
        v["usage"]["completion_tokens"].as_u64().unwrap() <= 3,
        "{v}"
    );
    // Exactly at the context: served.
    let (s, v) = post(
        &comp,
        &json!({"prompt": p, "max_tokens": 3, "ignore_eos": true}),
    );
    assert_eq!(s, 200, "{v}");
    server.shutdown().unwrap();
}

fn server_info(server: &PolicyServer) -> Value {
    client()
        .get(format!("{}/get_server_info", server.url()))
        .send()
        .unwrap()
        .json()
        .unwrap()
}

/// Greedy `/generate` of `prompt`: its output ids and log-probs.
fn greedy_ids(server: &PolicyServer, prompt: &[u32], max_new: usize) -> (Vec<u32>, Vec<f32>) {
    greedy_ids_at(&server.url(), prompt, max_new)
}

/// [`greedy_ids`] from the server at `url`.
fn greedy_ids_at(url: &str, prompt: &[u32], max_new: usize) -> (Vec<u32>, Vec<f32>) {
    let (status, v) = post(
        &format!("{url}/generate"),
        &json!({"input_ids": prompt, "return_logprob": true,
                "sampling_params": {"max_new_tokens": max_new, "temperature": 0,
                                    "ignore_eos": true}}),
    );
    assert_eq!(status, 200, "{v}");
    let lps = v["meta_info"]["output_token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e[0].as_f64().unwrap() as f32)
        .collect();
    (ids(&v["output_ids"]), lps)
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() < 1e-5, "{what}: {x} against {y}");
    }
}

/// Issue 51: a chat that resends its history re-prefilled all of it every turn. With the
/// prefix cache, each of a 4-turn chat's later turns (the previous prompt, its answer and a new
/// message) prefills only what the cache lacks: its new tokens and the partial 16-token block
/// before them. The answers are those of a server without the cache (greedy ids, log-probs
/// within 1e-5), and `/get_server_info` reports the hits.
#[test]
fn a_chats_later_turns_prefill_only_their_new_tokens() {
    let cached = start(1024);
    let cold = start_with(0);
    let mut prompt = long_prompt(60);
    for turn in 0..4 {
        let before = prefill_tokens(&cached);
        let (out, lps) = greedy_ids(&cached, &prompt, 8);
        let grew = prefill_tokens(&cached) - before;
        let (out0, lps0) = greedy_ids(&cold, &prompt, 8);
        assert_eq!(out, out0, "turn {turn}");
        assert_close(&lps, &lps0, &format!("turn {turn}"));
        if turn == 0 {
            assert_eq!(grew, prompt.len() as u64);
        } else {
            // The new message (5 tokens) and the last answer token (never run: it is the
            // answer's last), plus what of the last block before them was not whole.
            assert!(
                grew <= 5 + 1 + 15,
                "turn {turn}: prefilled {grew} of {}",
                prompt.len()
            );
        }
        eprintln!(
            "turn {turn}: {} prompt tokens, {grew} prefilled",
            prompt.len()
        );
        prompt.extend(out);
        prompt.extend((0..5).map(|i| 100 + 10 * turn + i));
    }
    let info = server_info(&cached);
    let pc = &info["prefix_cache"];
    assert_eq!(pc["lookups"], 4, "{info}");
    assert_eq!(pc["hits"], 3, "{info}");
    assert!(pc["hit_rate"].as_f64().unwrap() > 0.5, "{info}");
    assert!(pc["bytes"].as_u64().unwrap() > 0, "{info}");
    assert!(server_info(&cold)["prefix_cache"].is_null());
    cached.shutdown().unwrap();
    cold.shutdown().unwrap();
}

/// `--batch-invariant`: the 4-turn chat's answers from the prefix cache, with another client's
/// requests running beside them on the cached server, are a cacheless server's to the bit
/// (ids and log-probs, which the JSON writes exactly), although the cache prefills only the
/// new tokens.
#[test]
fn a_batch_invariant_servers_cached_answers_are_a_cold_prefills_bits() {
    let server = |prefix_cache: u64| {
        let cfg = ServeConfig {
            prefix_cache,
            batch_invariant: true,
            ..config(1024)
        };
        PolicyServer::start(load_served(&fixture()).unwrap(), &cfg).unwrap()
    };
    let (cached, cold) = (server(1 << 30), server(0));
    assert_eq!(server_info(&cached)["batch_invariant"], true);
    let plain = start_with(0);
    assert_eq!(server_info(&plain)["batch_invariant"], false);
    plain.shutdown().unwrap();
    let mut prompt = long_prompt(60);
    for turn in 0..4u32 {
        let before = prefill_tokens(&cached);
        let (out, lps) = std::thread::scope(|s| {
            // Another client's longer prompt shares the batch with the chat's turn.
            let url = cached.url();
            let other: Vec<u32> = (0..90 + turn).map(|i| (i * 7 + 11) % 290 + 4).collect();
            s.spawn(move || greedy_ids_at(&url, &other, 12));
            greedy_ids(&cached, &prompt, 8)
        });
        let grew = prefill_tokens(&cached) - before;
        let (out0, lps0) = greedy_ids(&cold, &prompt, 8);
        assert_eq!(out, out0, "turn {turn}");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&lps),
            bits(&lps0),
            "turn {turn}: log-probs {lps:?} against {lps0:?}"
        );
        if turn > 0 {
            // The chat's new tokens and the other client's prompt (its own blocks, cached
            // from the turn before, or not).
            let bound = 5 + 1 + 15 + 90 + turn as u64;
            assert!(grew <= bound, "turn {turn}: prefilled {grew}");
        }
        prompt.extend(out);
        prompt.extend((0..5).map(|i| 100 + 10 * turn + i));
    }
    assert!(
        server_info(&cached)["prefix_cache"]["hits"]
            .as_u64()
            .unwrap()
            >= 3
    );
    cached.shutdown().unwrap();
    cold.shutdown().unwrap();
}

/// A GRPO group sent as separate requests of one prompt (as TRL's and verl's server modes
/// may): the first prefills the prompt, the others only its last partial block.
#[test]
fn a_group_sent_as_separate_requests_prefills_its_prompt_once() {
    let server = start(1024);
    let p = long_prompt(100);
    let before = prefill_tokens(&server);
    let (first, _) = greedy_ids(&server, &p, 4);
    assert_eq!(prefill_tokens(&server) - before, 100);
    for _ in 0..3 {
        let before = prefill_tokens(&server);
        assert_eq!(greedy_ids(&server, &p, 4).0, first);
        // 96 of its 100 tokens are 6 whole blocks: the last 4 are prefilled again.
        assert_eq!(prefill_tokens(&server) - before, 4);
    }
    server.shutdown().unwrap();
}

/// Keys and values belong to the weights that computed them: after a reload the cache is
/// empty, so a prompt the old weights cached gets the new weights' own answer (that of a
/// server started on them), not one read from stale keys.
#[test]
fn a_weight_reload_empties_the_prefix_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let folder = perturbed_folder(tmp.path());
    let server = start(1024);
    let p = long_prompt(80);
    greedy_ids(&server, &p, 6);
    let (status, v) = post(
        &format!("{}/update_weights_from_disk", server.url()),
        &json!({"model_path": folder, "weight_version": "step-1"}),
    );
    assert_eq!(status, 200, "{v}");
    let before = prefill_tokens(&server);
    let (out, lps) = greedy_ids(&server, &p, 6);
    let fresh = PolicyServer::start(
        load_served(&folder).unwrap(),
        &ServeConfig {
            prefix_cache: 0,
            ..config(1024)
        },
    )
    .unwrap();
    let (out1, lps1) = greedy_ids(&fresh, &p, 6);
    assert_eq!(out, out1);
    assert_close(&lps, &lps1, "after the reload");
    assert_eq!(prefill_tokens(&server) - before, 80, "a cold prefill");
    let info = server_info(&server);
    assert_eq!(info["prefix_cache"]["invalidations"], 1, "{info}");
    server.shutdown().unwrap();
    fresh.shutdown().unwrap();
}

/// `--speculative-draft`: a prompt that repeats itself is continued by copying, so drafts are
/// made and accepted; the answers are those of the server without it (greedy ids, log-probs
/// within 1e-5; sampled ids with the same seed), also for the next turn, which starts from the
/// prefix cache's blocks of a speculative turn, and `/get_server_info` counts the drafts.
#[test]
fn speculative_decoding_keeps_the_answers_and_counts_its_drafts() {
    let plain = start_with(0);
    let spec = PolicyServer::start(
        load_served(&fixture()).unwrap(),
        &ServeConfig {
            speculative_draft: 4,
            ..config(1024)
        },
    )
    .unwrap();
    let unit: Vec<u32> = long_prompt(12);
    let p: Vec<u32> = unit.iter().cycle().take(60).copied().collect();
    let (a, la) = greedy_ids(&plain, &p, 24);
    let (b, lb) = greedy_ids(&spec, &p, 24);
    assert_eq!(a, b);
    assert_close(&la, &lb, "speculative greedy");
    // The next turn starts from the prefix cache's blocks of the speculative turn.
    let next: Vec<u32> = p.iter().chain(&a).chain(&unit[..7]).copied().collect();
    let before = prefill_tokens(&spec);
    let (a2, la2) = greedy_ids(&plain, &next, 16);
    let (b2, lb2) = greedy_ids(&spec, &next, 16);
    assert!(
        prefill_tokens(&spec) - before < 16 + 7 + 1,
        "the cache served the first turn"
    );
    assert_eq!(a2, b2);
    assert_close(&la2, &lb2, "the next turn");
    let body = json!({"input_ids": p, "sampling_params": {"n": 4, "max_new_tokens": 24,
                      "temperature": 1.0, "ignore_eos": true, "sampling_seed": 9}});
    let (_, sa) = post(&format!("{}/generate", plain.url()), &body);
    let (_, sb) = post(&format!("{}/generate", spec.url()), &body);
    for (x, y) in sa.as_array().unwrap().iter().zip(sb.as_array().unwrap()) {
        assert_eq!(x["output_ids"], y["output_ids"]);
    }
    let e = &server_info(&spec)["engine"];
    let (drafted, accepted) = (
        e["drafted_tokens"].as_u64().unwrap(),
        e["accepted_tokens"].as_u64().unwrap(),
    );
    eprintln!("drafted {drafted}, accepted {accepted}");
    assert!(accepted > 0 && drafted >= accepted, "{e}");
    assert_eq!(server_info(&plain)["engine"]["drafted_tokens"], 0);
    plain.shutdown().unwrap();
    spec.shutdown().unwrap();
}
