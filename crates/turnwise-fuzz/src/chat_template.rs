//! The chat-template renderer ([`turnwise_model::tokenizer::ChatTemplate`], minijinja with
//! transformers' settings).
//!
//! Input: a byte choosing the mode, then NUL-separated pieces:
//! - even: a conversation (the pieces after the first alternate role, content) rendered by ChatML and by Qwen2.5's
//!   template (the one with tools). ChatML has an exact oracle: the rendering is the
//!   concatenation of `<|im_start|>{role}\n{content}<|im_end|>\n`, so each prefix of the
//!   conversation renders to a prefix of the whole (what token-in-token-out training needs),
//!   and `render_continuing_final` cuts the rendering right after the final content (with or
//!   without its trailing whitespace). Qwen2.5's
//!   rendering holds every user message's content.
//! - odd: the first piece is a `tokenizer_config.json` document, compiled; its
//!   template is rendered on the conversation when it has no loop or macro (`for`, `macro`,
//!   `call`: a template can loop without bound, by design, in minijinja as in transformers).
//!
//! Errors must be `Err`, never panics.

use turnwise_model::tokenizer::{ChatMessage, ChatTemplate};

/// The plain ChatML template (SmolLM2's, Qwen's without tools).
pub const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + \
     message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ \
     '<|im_start|>assistant\\n' }}{% endif %}";

/// Qwen2.5's template (with tools and tool calls).
pub const QWEN2: &str = include_str!("qwen2.jinja");

/// One input (see the module docs).
pub fn run(data: &[u8]) {
    let Some((&mode, data)) = data.split_first() else {
        return;
    };
    let pieces = crate::pieces(data);
    let (head, rest) = pieces
        .split_first()
        .expect("split yields at least one piece");
    let messages: Vec<ChatMessage> = rest
        .chunks(2)
        .map(|c| ChatMessage::new(c[0].clone(), c.get(1).cloned().unwrap_or_default()))
        .collect();
    if mode % 2 == 1 {
        fuzzed_config(head, &messages);
        return;
    }
    chatml(&messages);
    let qwen = ChatTemplate::new(QWEN2, None, Some("<|im_end|>".into())).expect("Qwen2.5 compiles");
    for gen_prompt in [false, true] {
        if let Ok(text) = qwen.render(&messages, gen_prompt) {
            for m in messages.iter().filter(|m| m.role == "user") {
                assert!(
                    text.contains(&m.content),
                    "Qwen2.5 left out the user message {:?}: {text:?}",
                    m.content
                );
            }
        }
    }
}

fn chatml(messages: &[ChatMessage]) {
    let t = ChatTemplate::new(CHATML, None, None).expect("ChatML compiles");
    let expected = |msgs: &[ChatMessage]| -> String {
        msgs.iter()
            .map(|m| format!("<|im_start|>{}\n{}<|im_end|>\n", m.role, m.content))
            .collect()
    };
    let whole = t
        .render(messages, false)
        .expect("ChatML renders any conversation");
    assert_eq!(whole, expected(messages), "ChatML rendering");
    let with_prompt = t.render(messages, true).expect("ChatML renders");
    assert_eq!(
        with_prompt,
        format!("{whole}<|im_start|>assistant\n"),
        "ChatML generation prompt"
    );
    for n in 0..messages.len() {
        let part = t.render(&messages[..n], false).expect("ChatML renders");
        assert!(whole.starts_with(&part), "ChatML is not incremental at {n}");
    }
    match t.render_continuing_final(messages) {
        Ok(cut) => {
            let last = messages.last().expect("Ok needs a final message");
            assert!(whole.starts_with(&cut), "continuing: not a prefix");
            // The final content, its trailing whitespace kept when the template wrote it
            // (render_continuing_final's rule, as transformers').
            assert!(
                cut.ends_with(last.content.trim_start()) || cut.ends_with(last.content.trim()),
                "continuing: {cut:?} does not end with the final content {:?}",
                last.content
            );
        }
        Err(_) => assert!(
            messages.last().is_none_or(|m| m.content.trim().is_empty()),
            "continuing the final message {:?} failed",
            messages.last()
        ),
    }
}

fn fuzzed_config(json: &str, messages: &[ChatMessage]) {
    let Ok(t) = ChatTemplate::from_tokenizer_config_json(json) else {
        return;
    };
    let source = serde_json::from_str::<serde_json::Value>(json)
        .ok()
        .map(|v| v["chat_template"].to_string())
        .unwrap_or_default();
    if ["for", "macro", "call"].iter().any(|k| source.contains(k)) {
        return;
    }
    for gen_prompt in [false, true] {
        let _ = t.render(messages, gen_prompt);
    }
    let _ = t.render_continuing_final(messages);
}
