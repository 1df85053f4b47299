//! Tool calls on `/v1/chat/completions`: the request's `tools` and `tool_choice` checked, and
//! the calls a completion makes parsed out of its text.
//!
//! The format is Hermes's, as Qwen2.5/Qwen3 and NousResearch's Hermes models write it (vLLM's
//! `hermes` parser): a call is a block
//!
//! ```text
//! <tool_call>
//! {"name": "search", "arguments": {"query": "x"}}
//! </tool_call>
//! ```
//!
//! A block *parses* when its body (whitespace around it ignored) is one JSON object with a
//! string `name` and `arguments` that is an object (absent: `{}`). The body is read as one JSON
//! value first, so a JSON string that contains `</tool_call>` does not close the block; a body
//! that is not one JSON value followed by `</tool_call>` ends at the first `</tool_call>`
//! after the opening, and a block that never closes (cut by the length limit) runs to the end
//! of the text. Blocks that do not parse are counted ([`ToolCallParse::blocks`] −
//! [`ToolCallParse::parsed`]) and stay in the content, verbatim, with their tags.
//!
//! [`parse_hermes`] takes the completion decoded with special tokens kept (Qwen's
//! `<tool_call>` is an added token that skipping special tokens would delete), without the
//! stop token or stop string that ended it; a trainer can call it on the same text.

use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Map, Value, json};

use super::session::ToolCallParse;

/// The tag that opens a Hermes tool call.
pub const OPEN: &str = "<tool_call>";
/// The tag that closes a Hermes tool call.
pub const CLOSE: &str = "</tool_call>";

/// One parsed tool call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// The function's name.
    pub name: String,
    /// Its arguments (a JSON object).
    pub arguments: Map<String, Value>,
}

impl ToolCall {
    /// The call in OpenAI's shape: `{"id", "type": "function", "function": {"name",
    /// "arguments": "<the arguments as a JSON string>"}}`.
    pub fn to_openai(&self, id: &str) -> Value {
        json!({
            "id": id,
            "type": "function",
            "function": {
                "name": self.name,
                "arguments": Value::Object(self.arguments.clone()).to_string(),
            },
        })
    }
}

/// What [`parse_hermes`] found in one completion.
#[derive(Debug, Clone, PartialEq)]
pub struct HermesParse {
    /// The calls of the blocks that parsed, in order.
    pub calls: Vec<ToolCall>,
    /// The text outside the parsed blocks (blocks that did not parse stay in it), trimmed;
    /// `None` when nothing is left.
    pub content: Option<String>,
    /// Blocks opened and blocks parsed (`format: "hermes"`).
    pub stats: ToolCallParse,
}

/// Server-wide tool-call counters (`/get_server_info`'s `tool_calls`).
#[derive(Debug, Default)]
pub struct ToolCounters {
    completions: AtomicU64,
    blocks: AtomicU64,
    parsed: AtomicU64,
}

impl ToolCounters {
    /// Counts one completion of a request that offered tools.
    pub fn add(&self, stats: &ToolCallParse) {
        self.completions.fetch_add(1, Ordering::Relaxed);
        self.blocks
            .fetch_add(stats.blocks as u64, Ordering::Relaxed);
        self.parsed
            .fetch_add(stats.parsed as u64, Ordering::Relaxed);
    }

    /// `{"format": "hermes", "completions", "blocks", "parsed"}`.
    pub fn to_json(&self) -> Value {
        json!({
            "format": "hermes",
            "completions": self.completions.load(Ordering::Relaxed),
            "blocks": self.blocks.load(Ordering::Relaxed),
            "parsed": self.parsed.load(Ordering::Relaxed),
        })
    }
}

/// The call a block's body stands for, if it is one.
fn call_of(body: &Value) -> Option<ToolCall> {
    let obj = body.as_object()?;
    let name = obj.get("name")?.as_str()?.to_string();
    let arguments = match obj.get("arguments") {
        None => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(_) => return None,
    };
    Some(ToolCall { name, arguments })
}

/// Reads one JSON value at the start of `text` (after whitespace) followed by whitespace and
/// [`CLOSE`]: the value and the length of `text` up to the end of [`CLOSE`].
fn json_then_close(text: &str) -> Option<(Value, usize)> {
    let mut values = serde_json::Deserializer::from_str(text).into_iter::<Value>();
    let value = values.next()?.ok()?;
    let after = values.byte_offset();
    let rest = &text[after..];
    let trimmed = rest.trim_start();
    trimmed
        .starts_with(CLOSE)
        .then(|| (value, after + (rest.len() - trimmed.len()) + CLOSE.len()))
}

/// Parses the Hermes tool-call blocks of `text` (see the module's documentation for the rule).
pub fn parse_hermes(text: &str) -> HermesParse {
    let mut calls = Vec::new();
    let mut content = String::new();
    let mut blocks = 0;
    let mut at = 0;
    while let Some(found) = text[at..].find(OPEN) {
        let open = at + found;
        let body_at = open + OPEN.len();
        blocks += 1;
        content.push_str(&text[at..open]);
        if let Some((value, len)) = json_then_close(&text[body_at..])
            && let Some(call) = call_of(&value)
        {
            calls.push(call);
            at = body_at + len;
            continue;
        }
        // Not a call: the block stays in the content, up to its first closing tag (or the end).
        let end = text[body_at..]
            .find(CLOSE)
            .map_or(text.len(), |i| body_at + i + CLOSE.len());
        content.push_str(&text[open..end]);
        at = end;
    }
    content.push_str(&text[at..]);
    let content = content.trim();
    HermesParse {
        stats: ToolCallParse {
            format: "hermes".into(),
            blocks,
            parsed: calls.len(),
        },
        calls,
        content: (!content.is_empty()).then(|| content.to_string()),
    }
}

/// Whether the request's tools are used, as `tool_choice` says: `"auto"` (or absent, or
/// `null`) yes, `"none"` no; `"required"` and a named function are not supported. Errors are
/// `(field, message)`.
pub fn tools_wanted(
    tool_choice: Option<&Value>,
    has_tools: bool,
) -> Result<bool, (String, String)> {
    let bad = |m: String| Err(("tool_choice".to_string(), m));
    let auto = match tool_choice {
        None | Some(Value::Null) => true,
        Some(Value::String(s)) if s == "auto" => true,
        Some(Value::String(s)) if s == "none" => false,
        Some(Value::String(s)) if s == "required" => {
            return bad(
                "\"required\" is not supported by turnwise serve (the model is not forced to \
                 call a tool): use \"auto\" or \"none\""
                    .into(),
            );
        }
        Some(Value::Object(_)) => {
            return bad(
                "a named function is not supported by turnwise serve (the model is not forced \
                 to call it): use \"auto\" or \"none\""
                    .into(),
            );
        }
        Some(v) => return bad(format!("= {v}: must be \"auto\" or \"none\"")),
    };
    if auto && tool_choice.is_some_and(|v| !v.is_null()) && !has_tools {
        return bad("\"auto\" needs tools".into());
    }
    Ok(auto && has_tools)
}

/// Checks a request's `tools`: an array of `{"type": "function", "function": {"name",
/// "description"?, "parameters"?}}`. Errors are `(field, message)` naming the element's field.
pub fn check_tools(tools: &Value) -> Result<&[Value], (String, String)> {
    let Value::Array(list) = tools else {
        return Err((
            "tools".into(),
            "must be an array of {\"type\": \"function\", \"function\": {...}}".into(),
        ));
    };
    for (i, tool) in list.iter().enumerate() {
        let field = |f: &str| format!("tools[{i}]{f}");
        let Some(t) = tool.as_object() else {
            return Err((field(""), "must be an object".into()));
        };
        match t.get("type") {
            Some(Value::String(s)) if s == "function" => {}
            Some(v) => {
                return Err((
                    field(".type"),
                    format!("= {v}: only \"function\" tools are supported"),
                ));
            }
            None => return Err((field(".type"), "missing (\"function\")".into())),
        }
        let Some(f) = t.get("function").and_then(Value::as_object) else {
            return Err((
                field(".function"),
                "missing or not an object ({\"name\", \"description\"?, \"parameters\"?})".into(),
            ));
        };
        match f.get("name") {
            Some(Value::String(n)) if !n.is_empty() => {}
            Some(Value::String(_)) => return Err((field(".function.name"), "is empty".into())),
            Some(_) => return Err((field(".function.name"), "must be a string".into())),
            None => return Err((field(".function.name"), "missing".into())),
        }
        if let Some(d) = f.get("description")
            && !d.is_string()
            && !d.is_null()
        {
            return Err((field(".function.description"), "must be a string".into()));
        }
        if let Some(p) = f.get("parameters")
            && !p.is_object()
            && !p.is_null()
        {
            return Err((
                field(".function.parameters"),
                "must be an object (a JSON Schema)".into(),
            ));
        }
    }
    Ok(list)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(p: &HermesParse) -> (usize, usize) {
        (p.stats.blocks, p.stats.parsed)
    }

    #[test]
    fn one_call() {
        let p = parse_hermes(
            "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"x\"}}\n</tool_call>",
        );
        assert_eq!(stats(&p), (1, 1));
        assert_eq!(p.stats.format, "hermes");
        assert_eq!(p.calls[0].name, "search");
        assert_eq!(p.calls[0].arguments["query"], "x");
        assert_eq!(p.content, None);
        let o = p.calls[0].to_openai("call_1_0");
        assert_eq!(o["type"], "function");
        assert_eq!(o["function"]["arguments"], "{\"query\":\"x\"}");
    }

    #[test]
    fn two_calls_with_text_between() {
        let p = parse_hermes(
            "Let me look.\n<tool_call>{\"name\": \"a\", \"arguments\": {\"k\": 1}}</tool_call>\n\
             and also\n<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>\n",
        );
        assert_eq!(stats(&p), (2, 2));
        let names: Vec<_> = p.calls.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(p.content.as_deref(), Some("Let me look.\n\nand also"));
    }

    #[test]
    fn malformed_json_stays_in_the_content() {
        let text = "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"k\": }\n</tool_call>";
        let p = parse_hermes(text);
        assert_eq!(stats(&p), (1, 0));
        assert!(p.calls.is_empty());
        assert_eq!(p.content.as_deref(), Some(text));
        // A bad block then a good one: the good one still parses.
        let p = parse_hermes(&format!(
            "{text} then <tool_call>{{\"name\": \"b\"}}</tool_call>"
        ));
        assert_eq!(stats(&p), (2, 1));
        assert_eq!(p.calls[0].name, "b");
        assert_eq!(p.content.as_deref(), Some(format!("{text} then").as_str()));
    }

    #[test]
    fn a_body_without_a_string_name_or_with_non_object_arguments_is_not_a_call() {
        for body in [
            "{\"arguments\": {\"k\": 1}}",
            "{\"name\": 3}",
            "{\"name\": \"a\", \"arguments\": \"{}\"}",
            "[\"a\"]",
        ] {
            let p = parse_hermes(&format!("<tool_call>{body}</tool_call>"));
            assert_eq!(stats(&p), (1, 0), "{body}");
            assert_eq!(
                p.content,
                Some(format!("<tool_call>{body}</tool_call>")),
                "{body}"
            );
        }
    }

    #[test]
    fn an_unclosed_block_is_counted_and_kept() {
        let text = "ok <tool_call>\n{\"name\": \"a\", \"arguments\": {\"q\": \"lo";
        let p = parse_hermes(text);
        assert_eq!(stats(&p), (1, 0));
        assert_eq!(p.content.as_deref(), Some(text));
        // Complete JSON but no closing tag: not a call either.
        let p = parse_hermes("<tool_call>{\"name\": \"a\"}");
        assert_eq!(stats(&p), (1, 0));
    }

    #[test]
    fn no_block() {
        let p = parse_hermes("  just an answer \n");
        assert_eq!(stats(&p), (0, 0));
        assert!(p.calls.is_empty());
        assert_eq!(p.content.as_deref(), Some("just an answer"));
        assert_eq!(parse_hermes("").content, None);
    }

    #[test]
    fn absent_arguments_are_an_empty_object() {
        let p = parse_hermes("<tool_call>{\"name\": \"now\"}</tool_call>");
        assert_eq!(stats(&p), (1, 1));
        assert!(p.calls[0].arguments.is_empty());
        assert_eq!(p.calls[0].to_openai("c")["function"]["arguments"], "{}");
    }

    #[test]
    fn a_closing_tag_inside_a_json_string_does_not_close_the_block() {
        let p = parse_hermes(
            "<tool_call>{\"name\": \"echo\", \"arguments\": {\"s\": \"a </tool_call> {b}\", \
             \"n\": {\"m\": [1, {\"x\": \"}\"}]}}}</tool_call> done",
        );
        assert_eq!(stats(&p), (1, 1));
        assert_eq!(p.calls[0].arguments["s"], "a </tool_call> {b}");
        assert_eq!(p.calls[0].arguments["n"]["m"][1]["x"], "}");
        assert_eq!(p.content.as_deref(), Some("done"));
    }

    #[test]
    fn tool_choice_and_tools_are_checked() {
        assert_eq!(tools_wanted(None, true), Ok(true));
        assert_eq!(tools_wanted(Some(&json!("auto")), true), Ok(true));
        assert_eq!(tools_wanted(Some(&json!("none")), true), Ok(false));
        assert_eq!(tools_wanted(Some(&json!("none")), false), Ok(false));
        assert_eq!(tools_wanted(None, false), Ok(false));
        for bad in [
            json!("required"),
            json!({"type": "function", "function": {"name": "f"}}),
            json!("sometimes"),
        ] {
            let (field, msg) = tools_wanted(Some(&bad), true).unwrap_err();
            assert_eq!(field, "tool_choice", "{msg}");
        }
        assert!(tools_wanted(Some(&json!("auto")), false).is_err());

        let ok = json!([{"type": "function", "function": {"name": "f", "description": "d",
                                                          "parameters": {"type": "object"}}}]);
        assert_eq!(check_tools(&ok).unwrap().len(), 1);
        for (tools, field) in [
            (json!({"name": "f"}), "tools"),
            (json!([3]), "tools[0]"),
            (json!([{"function": {"name": "f"}}]), "tools[0].type"),
            (
                json!([{"type": "code", "function": {"name": "f"}}]),
                "tools[0].type",
            ),
            (json!([{"type": "function"}]), "tools[0].function"),
            (
                json!([{"type": "function", "function": {"name": "f"}},
                       {"type": "function", "function": {"description": "d"}}]),
                "tools[1].function.name",
            ),
            (
                json!([{"type": "function", "function": {"name": ""}}]),
                "tools[0].function.name",
            ),
            (
                json!([{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
                "tools[0].function.parameters",
            ),
            (
                json!([{"type": "function", "function": {"name": "f", "description": 1}}]),
                "tools[0].function.description",
            ),
        ] {
            assert_eq!(check_tools(&tools).unwrap_err().0, field, "{tools}");
        }
    }
}
