//! Tool calls on `turnwise serve`'s `/v1/chat/completions` with a real HTTP client: `tools`
//! rendered by the chat template, assistant `tool_calls` and `tool` messages rendered back, the
//! completion's Hermes `<tool_call>` blocks parsed into `tool_calls` (forced with
//! `guided_choice`), and the 400s. The model is the committed tiny GGUF fixture (301-token
//! byte-level BPE vocabulary); its own ChatML template does not render tools, so most tests
//! serve it with a small ChatML template that does, shaped like Qwen2.5's.

mod common;

use common::TOOLS_TEMPLATE;
use serde_json::{Value, json};
use turnwise::serve::{PolicyServer, ServeConfig, ServedModel, load_served};

fn config() -> ServeConfig {
    ServeConfig {
        addr: "127.0.0.1:0".parse().unwrap(),
        ..Default::default()
    }
}

/// The fixture served with `template` as its chat template.
fn with_template(template: &str) -> ServedModel {
    let mut served = load_served(&common::tiny_gguf()).unwrap();
    let mut tc = served
        .tensors
        .meta
        .tokenizer_config
        .clone()
        .unwrap_or_else(|| json!({}));
    tc["chat_template"] = json!(template);
    served.tensors.meta.tokenizer_config = Some(tc);
    served
}

fn post(url: &str, body: &Value) -> (u16, Value) {
    common::send_json(common::http_client().post(url).json(body))
}

fn search_tool() -> Value {
    json!([{"type": "function", "function": {"name": "search"}}])
}

fn user() -> Value {
    json!([{"role": "user", "content": "Find x."}])
}

/// The prompt an answer was generated from, decoded with its special tokens.
fn prompt_text(v: &Value) -> String {
    let served = load_served(&common::tiny_gguf()).unwrap();
    served
        .tensors
        .tokenizer
        .decode(&common::json_ids(&v["prompt_token_ids"]), false)
        .unwrap()
}

#[test]
fn tools_are_rendered_and_tool_messages_round_trip() {
    let server = PolicyServer::start(with_template(TOOLS_TEMPLATE), &config()).unwrap();
    let ch = format!("{}/v1/chat/completions", server.url());
    // (a) The tools block is in the prompt; with tool_choice "none" it is not.
    let (s, v) = post(
        &ch,
        &json!({"messages": user(), "tools": search_tool(), "max_tokens": 1,
                "return_token_ids": true}),
    );
    assert_eq!(s, 200, "{v}");
    let text = prompt_text(&v);
    assert!(
        text.starts_with(
            "<|im_start|>system\n<tools>\n{\"function\": {\"name\": \"search\"}, \"type\": \
             \"function\"}\n</tools><|im_end|>\n<|im_start|>user\nFind x.<|im_end|>\n"
        ),
        "{text}"
    );
    assert!(v["choices"][0]["tool_call_parse"].is_object(), "{v}");
    let (s, v) = post(
        &ch,
        &json!({"messages": user(), "tools": search_tool(), "tool_choice": "none",
                "max_tokens": 1, "return_token_ids": true}),
    );
    assert_eq!(s, 200, "{v}");
    assert!(prompt_text(&v).starts_with("<|im_start|>user\n"), "{v}");
    assert!(v["choices"][0].get("tool_call_parse").is_none(), "{v}");

    // (c) An assistant message with tool_calls (content null, arguments a JSON string) and the
    // tool's answer render as the template writes them.
    let convo = json!([
        {"role": "user", "content": "Find x."},
        {"role": "assistant", "content": null,
         "tool_calls": [{"id": "call_0_0", "type": "function",
                         "function": {"name": "search", "arguments": "{\"query\": \"x\"}"}}]},
        {"role": "tool", "tool_call_id": "call_0_0", "name": "search", "content": "r1"},
    ]);
    let (s, v) = post(
        &ch,
        &json!({"messages": convo, "tools": search_tool(), "max_tokens": 1,
                "return_token_ids": true}),
    );
    assert_eq!(s, 200, "{v}");
    let text = prompt_text(&v);
    assert!(
        text.ends_with(
            "<|im_start|>assistant\n<tool_call>\n{\"name\": \"search\", \"arguments\": \
             {\"query\": \"x\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n\
             r1\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        ),
        "{text}"
    );
    // Arguments given as an object render the same; content absent is content null.
    let mut as_object = convo.clone();
    as_object[1].as_object_mut().unwrap().remove("content");
    as_object[1]["tool_calls"][0]["function"]["arguments"] = json!({"query": "x"});
    let (s, w) = post(
        &ch,
        &json!({"messages": as_object, "tools": search_tool(), "max_tokens": 1,
                "return_token_ids": true}),
    );
    assert_eq!(s, 200, "{w}");
    assert_eq!(w["prompt_token_ids"], v["prompt_token_ids"]);

    // continue_final_message renders the tools too, and leaves the assistant's text open.
    let (s, v) = post(
        &ch,
        &json!({"messages": [{"role": "user", "content": "Find x."},
                             {"role": "assistant", "content": "Let me"}],
                "tools": search_tool(), "continue_final_message": true,
                "add_generation_prompt": false, "max_tokens": 1, "return_token_ids": true}),
    );
    assert_eq!(s, 200, "{v}");
    let text = prompt_text(&v);
    assert!(text.starts_with("<|im_start|>system\n<tools>\n"), "{text}");
    assert!(text.ends_with("<|im_start|>assistant\nLet me"), "{text}");

    // Messages that cannot be rendered: 400 naming the field.
    let mut bad_args = convo.clone();
    bad_args[1]["tool_calls"][0]["function"]["arguments"] = json!("{\"query\": ");
    let mut user_calls = convo.clone();
    user_calls[0]["tool_calls"] = convo[1]["tool_calls"].clone();
    let mut no_name = convo.clone();
    no_name[1]["tool_calls"][0]["function"]
        .as_object_mut()
        .unwrap()
        .remove("name");
    for (messages, field) in [
        (bad_args, "messages[1].tool_calls[0].function.arguments"),
        (user_calls, "messages[0].tool_calls"),
        (no_name, "messages[1].tool_calls[0].function"),
        (json!([{"role": "tool"}]), "messages[0].content"),
    ] {
        let (s, v) = post(&ch, &json!({"messages": messages, "tools": search_tool()}));
        assert_eq!(s, 400, "{messages} → {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.starts_with(field), "{msg} should name {field}");
    }
    server.shutdown().unwrap();
}

#[test]
fn forced_completions_parse_into_tool_calls() {
    let server = PolicyServer::start(with_template(TOOLS_TEMPLATE), &config()).unwrap();
    let base = server.url();
    let ch = format!("{base}/v1/chat/completions");
    let call =
        "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"x\"}}\n</tool_call>";
    let forced = |choice: &str, extra: Value| {
        let mut body = json!({"messages": user(), "tools": search_tool(),
                              "guided_choice": [choice], "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (s, v) = post(&ch, &body);
        assert_eq!(s, 200, "{v}");
        v
    };
    // (d) A well-formed block: one call, its arguments a JSON string, finish_reason tool_calls.
    let v = forced(call, json!({}));
    let c = &v["choices"][0];
    let number = v["id"].as_str().unwrap().strip_prefix("chatcmpl-").unwrap();
    assert_eq!(c["finish_reason"], "tool_calls", "{v}");
    assert_eq!(c["message"]["content"], Value::Null, "{v}");
    let calls = c["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["id"], format!("call_{number}_0"));
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "search");
    let args: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"query": "x"}));
    assert_eq!(
        c["tool_call_parse"],
        json!({"format": "hermes", "blocks": 1, "parsed": 1})
    );

    // Text before the call is the content.
    let v = forced(&format!("Looking.\n{call}"), json!({}));
    let c = &v["choices"][0];
    assert_eq!(c["message"]["content"], "Looking.", "{v}");
    assert_eq!(c["message"]["tool_calls"][0]["function"]["name"], "search");

    // A malformed block: not a call, kept in the content, finish_reason stop.
    let bad = "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": }\n</tool_call>";
    let v = forced(bad, json!({}));
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "stop", "{v}");
    assert_eq!(c["message"]["content"], bad, "{v}");
    assert!(c["message"].get("tool_calls").is_none(), "{v}");
    assert_eq!(
        c["tool_call_parse"],
        json!({"format": "hermes", "blocks": 1, "parsed": 0})
    );

    // A block the length limit cuts: counted, not parsed, finish_reason length.
    let v = forced(call, json!({"max_tokens": 24}));
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "length", "{v}");
    assert!(c["message"].get("tool_calls").is_none(), "{v}");
    assert_eq!(c["tool_call_parse"]["blocks"], 1, "{v}");
    assert_eq!(c["tool_call_parse"]["parsed"], 0, "{v}");
    let cut = c["message"]["content"].as_str().unwrap();
    assert!(
        cut.starts_with("<tool_call>\n{") && call.starts_with(cut),
        "{v}"
    );

    // Without tools (or with tool_choice none) the same text is plain content.
    let mut plain = json!({"messages": user(), "guided_choice": [call], "temperature": 0});
    let (s, v) = post(&ch, &plain);
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], call, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert!(v["choices"][0].get("tool_call_parse").is_none(), "{v}");
    plain["tools"] = search_tool();
    plain["tool_choice"] = json!("none");
    let (s, v) = post(&ch, &plain);
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], call, "{v}");
    assert!(v["choices"][0].get("tool_call_parse").is_none(), "{v}");

    // A call followed by text, n choices; then the same ended by a stop string, which is cut
    // from the parsed text as from the content.
    let after = format!("{call} ok");
    let (s, v) = post(
        &ch,
        &json!({"messages": user(), "tools": search_tool(), "tool_choice": "auto",
                "guided_choice": [after], "n": 3}),
    );
    assert_eq!(s, 200, "{v}");
    let number = v["id"].as_str().unwrap().strip_prefix("chatcmpl-").unwrap();
    for (i, c) in v["choices"].as_array().unwrap().iter().enumerate() {
        assert_eq!(c["finish_reason"], "tool_calls", "{c}");
        assert_eq!(c["message"]["content"], "ok", "{c}");
        // Call ids count the request's calls across its choices.
        assert_eq!(
            c["message"]["tool_calls"][0]["id"],
            format!("call_{number}_{i}")
        );
    }
    let v = forced(&after, json!({"stop": [" ok"]}));
    let c = &v["choices"][0];
    assert_eq!(c["stop_reason"], " ok", "{v}");
    assert_eq!(c["finish_reason"], "tool_calls", "{v}");
    assert_eq!(c["message"]["content"], Value::Null, "{v}");
    assert_eq!(c["tool_call_parse"]["parsed"], 1, "{v}");

    // The server's counters: the 4 + 3 + 1 forced completions that offered tools (not the 2
    // without), each with one block, all but the malformed and the cut one parsed.
    let info: Value = common::http_client()
        .get(format!("{base}/get_server_info"))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(
        info["tool_calls"],
        json!({"format": "hermes", "completions": 8, "blocks": 8, "parsed": 6}),
        "{info}"
    );
    server.shutdown().unwrap();
}

#[test]
fn unsupported_tool_requests_get_a_400_naming_the_field() {
    // (b) The fixture's own ChatML template does not render tools.
    let server =
        PolicyServer::start(load_served(&common::tiny_gguf()).unwrap(), &config()).unwrap();
    let ch = format!("{}/v1/chat/completions", server.url());
    let (s, v) = post(&ch, &json!({"messages": user(), "tools": search_tool()}));
    assert_eq!(s, 400, "{v}");
    assert_eq!(
        v["error"]["message"],
        "tools: the served model's chat template does not render tools"
    );
    assert_eq!(v["error"]["param"], "tools");
    // Unless they are not used, and `tools: []` is no tools.
    for body in [
        json!({"messages": user(), "tools": search_tool(), "tool_choice": "none",
               "max_tokens": 1}),
        json!({"messages": user(), "tools": [], "max_tokens": 1}),
    ] {
        let (s, v) = post(&ch, &body);
        assert_eq!(s, 200, "{body} → {v}");
    }
    server.shutdown().unwrap();

    // (e) tool_choice "required" or a named function, malformed tools.
    let server = PolicyServer::start(with_template(TOOLS_TEMPLATE), &config()).unwrap();
    let ch = format!("{}/v1/chat/completions", server.url());
    let cases = [
        (
            json!({"messages": user(), "tools": search_tool(), "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            json!({"messages": user(), "tools": search_tool(),
                   "tool_choice": {"type": "function", "function": {"name": "search"}}}),
            "tool_choice",
        ),
        (
            json!({"messages": user(), "tool_choice": "auto"}),
            "tool_choice",
        ),
        (
            json!({"messages": user(), "tools": search_tool(), "parallel_tool_calls": false}),
            "parallel_tool_calls",
        ),
        (
            json!({"messages": user(),
                   "tools": [{"type": "function", "function": {"description": "d"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"messages": user(), "tools": [{"type": "code_interpreter"}]}),
            "tools[0].type",
        ),
        (json!({"messages": user(), "tools": {"a": 1}}), "tools"),
    ];
    for (body, field) in cases {
        let (s, v) = post(&ch, &body);
        assert_eq!(s, 400, "{body} → {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(
            msg.starts_with(&format!("{field}:")),
            "{body}: {msg} should name {field}"
        );
    }
    let (s, v) = post(
        &ch,
        &json!({"messages": user(), "tools": search_tool(), "tool_choice": "auto",
                "parallel_tool_calls": true, "max_tokens": 1}),
    );
    assert_eq!(s, 200, "{v}");
    server.shutdown().unwrap();
}
