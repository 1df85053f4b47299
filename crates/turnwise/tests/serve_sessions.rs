//! Recorded sessions in `turnwise serve`, over real HTTP: a multi-turn chat that names its
//! session is recorded token-exactly, its prompts spliced onto what was sampled (so the session
//! reconstructs into one trajectory even where a plain re-tokenisation drifts), an edited
//! history starts a new segment, a registered seed draws what `turn_seed` draws, `--record-dir`
//! writes JSON lines that `turnwise traces check` counts. The model is the committed tiny GGUF
//! fixture (ChatML template).

mod common;

use serde_json::{Value, json};
use turnwise::rollout::turn_seed;
use turnwise::serve::session::{SessionRecord, TracePiece, TraceSegment};
use turnwise::serve::{PolicyServer, ServeConfig, load_served};

fn start_with(config: ServeConfig) -> PolicyServer {
    PolicyServer::start(
        load_served(&common::tiny_gguf()).unwrap(),
        &ServeConfig {
            addr: "127.0.0.1:0".parse().unwrap(),
            ..config
        },
    )
    .unwrap()
}

fn start() -> PolicyServer {
    start_with(ServeConfig::default())
}

fn post(url: &str, session: Option<&str>, body: &Value) -> (u16, Value) {
    let mut r = common::http_client().post(url).json(body);
    if let Some(s) = session {
        r = r.header("X-Session-Id", s);
    }
    common::send_json(r)
}

fn get(url: &str) -> (u16, Value) {
    common::send_json(common::http_client().get(url))
}

/// One chat turn's answer: content, completion ids, their log-probs, the prompt ids.
struct Turn {
    content: String,
    token_ids: Vec<u32>,
    logprobs: Vec<f32>,
    prompt_ids: Vec<u32>,
}

fn chat(base: &str, session: &str, messages: &[Value], seed: u64) -> Turn {
    let (status, v) = post(
        &format!("{base}/v1/chat/completions"),
        Some(session),
        &json!({"messages": messages, "max_tokens": 12, "temperature": 1.0, "seed": seed,
                "logprobs": true, "return_token_ids": true}),
    );
    assert_eq!(status, 200, "{v}");
    let c = &v["choices"][0];
    Turn {
        content: c["message"]["content"].as_str().unwrap().to_string(),
        token_ids: common::json_ids(&c["token_ids"]),
        logprobs: c["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["logprob"].as_f64().unwrap() as f32)
            .collect(),
        prompt_ids: common::json_ids(&v["prompt_token_ids"]),
    }
}

/// `turns` chat turns of an append-only conversation: each request's messages are the last
/// one's, the assistant's returned content and a new user message.
fn append_only_chat(base: &str, session: &str, turns: usize) -> (Vec<Value>, Vec<Turn>) {
    let mut messages = vec![
        json!({"role": "system", "content": "You are terse."}),
        json!({"role": "user", "content": "Say something."}),
    ];
    let mut answers = Vec::new();
    for k in 0..turns {
        let t = chat(base, session, &messages, 100 + k as u64);
        messages.push(json!({"role": "assistant", "content": t.content}));
        messages.push(json!({"role": "user", "content": format!("And then {k}?")}));
        answers.push(t);
    }
    (messages, answers)
}

/// `GET /v1/sessions/{id}`: the records and the segments.
fn session(base: &str, id: &str) -> (Vec<SessionRecord>, Vec<TraceSegment>) {
    let (status, v) = get(&format!("{base}/v1/sessions/{id}"));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["session"], id);
    (
        serde_json::from_value(v["records"].clone()).unwrap(),
        serde_json::from_value(v["segments"].clone()).unwrap(),
    )
}

#[test]
fn an_append_only_chat_session_is_one_trajectory_spliced_token_exactly() {
    let server = start();
    let base = server.url();
    let (_, answers) = append_only_chat(&base, "chat-1", 4);
    let (records, segments) = session(&base, "chat-1");
    assert_eq!(records.len(), 4);
    assert_eq!(segments.len(), 1, "{segments:?}");
    let seg = &segments[0];
    let last = records.last().unwrap();
    let mut context = last.prompt_ids.clone();
    context.extend_from_slice(&last.output_ids);
    assert_eq!(seg.context(), context);
    assert_eq!(seg.prompt_ids, answers[0].prompt_ids);
    assert_eq!(seg.turns(), 4);
    // Completions are each answer's ids and log-probs; observations exactly the ids between.
    let mut agent = 0;
    let mut before: Vec<u32> = seg.prompt_ids.clone();
    for p in &seg.pieces {
        match p {
            TracePiece::Agent {
                ids,
                logprobs,
                record,
                weight_version,
            } => {
                assert_eq!(*record, agent);
                assert_eq!(ids, &answers[agent].token_ids);
                assert_eq!(logprobs, &answers[agent].logprobs);
                assert_eq!(weight_version, "0");
                agent += 1;
            }
            TracePiece::Observation { ids } => {
                let next = &answers[agent].prompt_ids;
                assert_eq!(&next[..before.len()], &before[..]);
                assert_eq!(ids, &next[before.len()..].to_vec());
            }
        }
        before.extend_from_slice(p.ids());
    }
    assert_eq!(agent, 4);
    for (k, (r, a)) in records.iter().zip(&answers).enumerate() {
        assert_eq!(r.request, k);
        assert_eq!(r.choice, 0);
        assert_eq!(r.route, "/v1/chat/completions");
        assert_eq!(r.prompt_ids, a.prompt_ids, "the ids the answer reports");
        assert!(r.tool_calls.is_none());
        assert!(["stop", "length"].contains(&r.finish.as_str()));
    }
    let spliced = records
        .iter()
        .filter(|r| r.retokenization.unwrap().spliced)
        .count();
    assert_eq!(spliced, 3, "every request after the first extends the last");
    let differs = records
        .iter()
        .filter(|r| r.retokenization.unwrap().differs)
        .count();
    // The random model's completions do not survive a plain re-encoding of the rendered text:
    // without splicing those prompts would not extend the last one, and the session would
    // break into segments.
    assert!(differs >= 1, "no record's plain re-tokenisation differs");
    let (_, info) = get(&format!("{base}/get_server_info"));
    let s = &info["sessions"];
    assert_eq!(s["open"], 1);
    assert_eq!(s["recorded_requests"], 4);
    assert_eq!(s["spliced"], 3);
    assert_eq!(s["retokenization_differs"], differs);
    assert_eq!(s["evicted"], 0);
}

#[test]
fn editing_an_earlier_assistant_message_starts_a_new_segment() {
    let server = start();
    let base = server.url();
    let (mut messages, _) = append_only_chat(&base, "edit", 2);
    // The client rewrites the first assistant turn (a summary, a re-rendered history).
    messages[2]["content"] = json!("(edited by the client)");
    let t = chat(&base, "edit", &messages, 7);
    messages.push(json!({"role": "assistant", "content": t.content}));
    messages.push(json!({"role": "user", "content": "Go on."}));
    chat(&base, "edit", &messages, 8);
    let (records, segments) = session(&base, "edit");
    assert_eq!(records.len(), 4);
    let r2 = records[2].retokenization.unwrap();
    assert!(!r2.spliced && !r2.differs, "{r2:?}");
    assert!(records[3].retokenization.unwrap().spliced);
    assert_eq!(segments.len(), 2, "{segments:?}");
    assert_eq!(segments[0].turns(), 2);
    assert_eq!(segments[1].turns(), 2);
    assert_eq!(segments[1].prompt_ids, records[2].prompt_ids);
}

#[test]
fn a_registered_seed_draws_what_turn_seed_draws() {
    let server = start();
    let base = server.url();
    let gen_url = format!("{base}/generate");
    let (status, v) = post(
        &format!("{base}/v1/sessions"),
        None,
        &json!({"id": "seeded", "seed": 123}),
    );
    assert_eq!(status, 200, "{v}");
    let body = |seed: Option<u64>, n: usize| {
        let mut sp = json!({"max_new_tokens": 10, "temperature": 1.0, "n": n});
        if let Some(s) = seed {
            sp["sampling_seed"] = json!(s);
        }
        json!({"input_ids": [5, 17, 42, 99], "sampling_params": sp})
    };
    let outputs = |v: &Value| -> Vec<Vec<u32>> {
        match v {
            Value::Array(a) => a
                .iter()
                .map(|o| common::json_ids(&o["output_ids"]))
                .collect(),
            o => vec![common::json_ids(&o["output_ids"])],
        }
    };
    for (k, n) in [(0usize, 1usize), (1, 2), (2, 1)] {
        let (status, seeded) = post(&gen_url, Some("seeded"), &body(None, n));
        assert_eq!(status, 200, "{seeded}");
        let (status, plain) = post(&gen_url, None, &body(Some(turn_seed(123, k)), n));
        assert_eq!(status, 200, "{plain}");
        assert_eq!(outputs(&seeded), outputs(&plain), "request {k}");
    }
    let (records, segments) = session(&base, "seeded");
    assert_eq!(records.len(), 4);
    assert_eq!(
        records
            .iter()
            .map(|r| (r.request, r.choice))
            .collect::<Vec<_>>(),
        vec![(0, 0), (1, 0), (1, 1), (2, 0)]
    );
    assert!(records.iter().all(|r| r.retokenization.is_none()));
    // Every request repeats the same prompt: none extends the last one's completion.
    assert_eq!(segments.len(), 4);
    // A session with records cannot be registered again.
    let (status, v) = post(
        &format!("{base}/v1/sessions"),
        None,
        &json!({"id": "seeded", "seed": 1}),
    );
    assert_eq!(status, 409, "{v}");

    // On the OpenAI routes the `user` field names the session.
    let (status, _) = post(
        &format!("{base}/v1/sessions"),
        None,
        &json!({"id": "by-user", "seed": 5}),
    );
    assert_eq!(status, 200);
    let chat_url = format!("{base}/v1/chat/completions");
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let (status, a) = post(
        &chat_url,
        None,
        &json!({"messages": msgs, "max_tokens": 8, "user": "by-user",
                "return_token_ids": true}),
    );
    assert_eq!(status, 200, "{a}");
    let (_, b) = post(
        &chat_url,
        None,
        &json!({"messages": msgs, "max_tokens": 8, "seed": turn_seed(5, 0),
                "return_token_ids": true}),
    );
    assert_eq!(a["choices"][0]["token_ids"], b["choices"][0]["token_ids"]);
    let (records, _) = session(&base, "by-user");
    assert_eq!(records.len(), 1);
    assert_eq!(
        records[0].output_ids,
        common::json_ids(&a["choices"][0]["token_ids"])
    );
}

#[test]
fn text_completions_in_a_session_are_spliced_too() {
    let server = start();
    let base = server.url();
    let url = format!("{base}/v1/completions");
    let mut prompt = "Once upon a time".to_string();
    for k in 0..3 {
        let (status, v) = post(
            &url,
            Some("text"),
            &json!({"prompt": prompt, "max_tokens": 6, "seed": k, "return_token_ids": true,
                    "skip_special_tokens": false}),
        );
        assert_eq!(status, 200, "{v}");
        prompt.push_str(v["choices"][0]["text"].as_str().unwrap());
        prompt.push_str(" and then");
    }
    // Token-id prompts are recorded as given, never spliced.
    let (status, _) = post(
        &url,
        Some("text"),
        &json!({"prompt": [5, 6, 7], "max_tokens": 2}),
    );
    assert_eq!(status, 200);
    let (records, segments) = session(&base, "text");
    assert_eq!(records.len(), 4);
    let spliced: Vec<bool> = records
        .iter()
        .map(|r| r.retokenization.is_some_and(|t| t.spliced))
        .collect();
    assert_eq!(spliced, vec![false, true, true, false]);
    assert!(records[3].retokenization.is_none());
    assert_eq!(records[3].prompt_ids, vec![5, 6, 7]);
    assert_eq!(segments.len(), 2);
    assert_eq!(segments[0].turns(), 3);
}

#[test]
fn record_dir_writes_json_lines_that_traces_check_counts() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("records");
    let server = start_with(ServeConfig {
        record_dir: Some(dir.clone()),
        ..Default::default()
    });
    let base = server.url();
    append_only_chat(&base, "a", 3);
    for prompt in [[1u32, 2, 3], [4, 5, 6]] {
        let (status, v) = post(
            &format!("{base}/generate"),
            Some("b"),
            &json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": 3}}),
        );
        assert_eq!(status, 200, "{v}");
    }
    let (served, _) = session(&base, "a");
    let written = turnwise::serve::traces::read_session_file(&dir.join("a.jsonl")).unwrap();
    assert_eq!(written, served, "the file holds exactly what GET answers");
    let (_, info) = get(&format!("{base}/get_server_info"));
    assert_eq!(info["sessions"]["write_failures"], 0);
    drop(server);

    let report = turnwise::serve::traces::check_dir(&dir).unwrap();
    let t = &report.totals;
    assert_eq!(
        (t.sessions, t.requests, t.records, t.segments),
        (2, 5, 5, 3)
    );
    assert_eq!((t.appended, t.after_first), (2, 3));
    assert!((t.append_rate.unwrap() - 2.0 / 3.0).abs() < 1e-12);
    assert_eq!(t.spliced, 2);
    assert!(report.tool_calls.is_empty());

    let exe = env!("CARGO_BIN_EXE_turnwise");
    let out = std::process::Command::new(exe)
        .args(["traces", "check"])
        .arg(&dir)
        .arg("--json")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["totals"]["segments"], 3);
    assert_eq!(v["totals"]["sessions"], 2);
    assert_eq!(v["totals"]["appended"], 2);
    assert_eq!(v["sessions"][0]["session"], "a");
    let out = std::process::Command::new(exe)
        .args(["traces", "check"])
        .arg(&dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(text.contains("append rate: 66.7 %"), "{text}");
    assert!(text.contains("no tool calls offered"), "{text}");

    // A malformed line fails the check, naming the file and line.
    std::fs::write(dir.join("c.jsonl"), "{}\n").unwrap();
    let out = std::process::Command::new(exe)
        .args(["traces", "check"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("c.jsonl:1"));
}

#[test]
fn bad_session_ids_get_400_unknown_sessions_404_and_old_ones_are_evicted() {
    let server = start_with(ServeConfig {
        max_sessions: 2,
        ..Default::default()
    });
    let base = server.url();
    let gen_url = format!("{base}/generate");
    let body = json!({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}});
    for bad in ["has space", "a/b", &"x".repeat(129)] {
        let (status, v) = post(&gen_url, Some(bad), &body);
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["param"], "X-Session-Id");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .starts_with("X-Session-Id:")
        );
    }
    let (status, v) = post(
        &format!("{base}/v1/chat/completions"),
        None,
        &json!({"messages": [{"role": "user", "content": "hi"}], "user": "who@where",
                "max_tokens": 2}),
    );
    // OpenAI's `user` label that is not a session id names no session, as before.
    assert_eq!(status, 200, "{v}");
    let (status, _) = get(&format!("{base}/v1/sessions/who@where"));
    assert_ne!(status, 200);
    let (status, v) = post(&format!("{base}/v1/sessions"), None, &json!({"id": "a b"}));
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "id");
    let (status, v) = get(&format!("{base}/v1/sessions/never"));
    assert_eq!(status, 404, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("never"));
    // The 404 of an unknown route lists the session routes.
    let (status, v) = get(&format!("{base}/v1/nothing"));
    assert_eq!(status, 404);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/v1/sessions")
    );

    // A request without a session is not recorded.
    assert_eq!(post(&gen_url, None, &body).0, 200);
    let (_, info) = get(&format!("{base}/get_server_info"));
    assert_eq!(info["sessions"]["open"], 0);
    assert_eq!(info["sessions"]["recorded_requests"], 0);

    for s in ["s1", "s2", "s1", "s3"] {
        assert_eq!(post(&gen_url, Some(s), &body).0, 200);
    }
    // s2 was the least recently used.
    assert_eq!(get(&format!("{base}/v1/sessions/s2")).0, 404);
    assert_eq!(session(&base, "s1").0.len(), 2);
    let (_, info) = get(&format!("{base}/get_server_info"));
    assert_eq!(info["sessions"]["evicted"], 1);
    assert_eq!(info["sessions"]["open"], 2);
    // DELETE answers the session and forgets it.
    let r = common::http_client()
        .delete(format!("{base}/v1/sessions/s3"))
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let v: Value = r.json().unwrap();
    assert_eq!(v["records"].as_array().unwrap().len(), 1);
    assert_eq!(v["segments"].as_array().unwrap().len(), 1);
    assert_eq!(get(&format!("{base}/v1/sessions/s3")).0, 404);
}

#[test]
fn a_record_dir_that_cannot_be_written_is_counted_and_never_fails_a_request() {
    let tmp = tempfile::tempdir().unwrap();
    let not_a_dir = tmp.path().join("file");
    std::fs::write(&not_a_dir, "").unwrap();
    let server = start_with(ServeConfig {
        record_dir: Some(not_a_dir),
        ..Default::default()
    });
    let base = server.url();
    let body = json!({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}});
    for _ in 0..2 {
        let (status, v) = post(&format!("{base}/generate"), Some("w"), &body);
        assert_eq!(status, 200, "{v}");
    }
    let (_, info) = get(&format!("{base}/get_server_info"));
    assert_eq!(info["sessions"]["write_failures"], 2);
    assert_eq!(session(&base, "w").0.len(), 2, "still recorded in memory");
}
