//! Chat templates: rendering a Hugging Face `tokenizer_config.json` `chat_template` (Jinja) with
//! [minijinja], and checking that a template renders conversations incrementally.
//!
//! The environment mimics the one `transformers` renders with: `trim_blocks` and
//! `lstrip_blocks` on, `raise_exception(msg)`, a `tojson` filter that writes like Python's
//! `json.dumps(ensure_ascii=False)` (`", "` and `": "` separators, `indent=` supported, no HTML
//! escaping), and the Python string and dict methods the Qwen2 / Qwen3 / Llama templates call
//! (`startswith`, `endswith`, `strip`, `lstrip`, `rstrip`, `split`, `upper`, `lower`, `replace`,
//! `items`, `keys`, `values`, `get`). Map keys are iterated in sorted order (minijinja's maps),
//! where Python keeps insertion order: `tools | tojson` can order keys differently from
//! `transformers`.
//!
//! Token-in-token-out training needs the rendering of the first `n` messages to be a token
//! prefix of the rendering of `n + 1` messages, so that a trajectory can be extended by
//! appending tokens. [`check_incremental`] verifies that for a conversation and names the
//! message where it breaks (Qwen3's template, for instance, drops earlier turns' thinking).

use std::collections::BTreeMap;
use std::path::Path;

use minijinja::value::{Kwargs, Serde, Value, ValueKind, from_args};
use minijinja::{Environment, Error, ErrorKind, State};
use serde::{Deserialize, Serialize};

use super::TextTokenizer;
use crate::error::{ModelError, Result};

const TEMPLATE_NAME: &str = "chat_template";

/// One chat message: `role`, `content` and any other fields a template reads (e.g.
/// `tool_calls`, `reasoning_content`), passed through as JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The message text.
    pub content: String,
    /// Extra fields, visible to the template as `message.<name>`.
    #[serde(flatten, default, skip_serializing_if = "BTreeMap::is_empty")]
    pub extra: BTreeMap<String, serde_json::Value>,
}

impl ChatMessage {
    /// A message with no extra fields.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            extra: BTreeMap::new(),
        }
    }

    /// Adds an extra field (builder style).
    pub fn with(mut self, key: impl Into<String>, value: serde_json::Value) -> Self {
        self.extra.insert(key.into(), value);
        self
    }
}

/// A compiled chat template with its special tokens.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

fn template_err(what: &str, e: Error) -> ModelError {
    // minijinja's Display omits the chain; include the detail and the location when known.
    let mut msg = format!("chat template: {what}: {e}");
    if let Some(line) = e.line() {
        msg.push_str(&format!(" (line {line})"));
    }
    ModelError::Tokenizer(msg)
}

impl ChatTemplate {
    /// Compiles `source` (Jinja); `bos_token` / `eos_token` are exposed to it under those names.
    pub fn new(
        source: impl Into<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self> {
        let mut env = Environment::new();
        let mut syntax = minijinja::syntax::SyntaxConfig::builder();
        syntax.trim_blocks(true).lstrip_blocks(true);
        env.set_syntax(
            syntax
                .build()
                .map_err(|e| template_err("syntax config", e))?,
        );
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.set_unknown_method_callback(python_method);
        env.add_template_owned(TEMPLATE_NAME, source.into())
            .map_err(|e| template_err("cannot compile", e))?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// Reads `chat_template`, `bos_token` and `eos_token` from a `tokenizer_config.json`
    /// document. `chat_template` may be a string or a list of `{name, template}` (the one named
    /// `default` is used); the tokens may be strings or `{"content": ...}` objects.
    pub fn from_tokenizer_config_json(json: &str) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(json).map_err(|e| ModelError::Json {
            what: "tokenizer_config.json".into(),
            cause: e,
        })?;
        let template = match v.get("chat_template") {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .ok_or_else(|| {
                    ModelError::Tokenizer(
                        "tokenizer_config.json: chat_template list has no `default` entry".into(),
                    )
                })?
                .to_string(),
            _ => {
                return Err(ModelError::Tokenizer(
                    "tokenizer_config.json has no `chat_template` string".into(),
                ));
            }
        };
        let token = |key: &str| -> Option<String> {
            match v.get(key)? {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Object(o) => o.get("content")?.as_str().map(String::from),
                _ => None,
            }
        };
        Self::new(template, token("bos_token"), token("eos_token"))
    }

    /// [`ChatTemplate::from_tokenizer_config_json`] on a file.
    pub fn from_tokenizer_config_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        Self::from_tokenizer_config_json(&text)
    }

    /// The BOS token given to the template, if any.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The EOS token given to the template, if any.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Renders `messages`; `add_generation_prompt` appends the opening of an assistant turn.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(
            messages,
            add_generation_prompt,
            &serde_json::Value::Object(Default::default()),
        )
    }

    /// [`ChatTemplate::render`] with extra template variables (a JSON object, e.g.
    /// `{"tools": [...], "enable_thinking": false}`), which may not override `messages`,
    /// `add_generation_prompt`, `bos_token` or `eos_token`.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Value,
    ) -> Result<String> {
        let mut ctx = match extra {
            serde_json::Value::Object(m) => m.clone(),
            serde_json::Value::Null => Default::default(),
            _ => {
                return Err(ModelError::invalid_input(
                    "extra",
                    "template variables must be a JSON object",
                ));
            }
        };
        let msgs = serde_json::to_value(messages).map_err(|e| ModelError::Json {
            what: "chat messages".into(),
            cause: e,
        })?;
        ctx.insert("messages".into(), msgs);
        ctx.insert(
            "add_generation_prompt".into(),
            serde_json::Value::Bool(add_generation_prompt),
        );
        for (k, t) in [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
        ] {
            if let Some(t) = t {
                ctx.insert(k.into(), serde_json::Value::String(t.clone()));
            }
        }
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| template_err("missing template", e))?;
        tmpl.render(Value::from(Serde(&ctx)))
            .map_err(|e| template_err("render failed", e))
    }

    /// Renders `messages` so that the model continues the final message (vLLM's and
    /// transformers' `continue_final_message`): rendered without the generation prompt, then
    /// cut right after the final message's content, so whatever the template writes to close
    /// that message is left out. As transformers does, the content is located by its last
    /// occurrence (trailing whitespace the template trimmed is left out too). Errors when the
    /// content is empty or the template does not reproduce it.
    pub fn render_continuing_final(&self, messages: &[ChatMessage]) -> Result<String> {
        self.render_continuing_final_with(messages, &serde_json::Value::Object(Default::default()))
    }

    /// [`ChatTemplate::render_continuing_final`] with extra template variables (as
    /// [`ChatTemplate::render_with`]).
    pub fn render_continuing_final_with(
        &self,
        messages: &[ChatMessage],
        extra: &serde_json::Value,
    ) -> Result<String> {
        let Some(last) = messages.last() else {
            return Err(ModelError::invalid_input("messages", "is empty"));
        };
        let content = last.content.as_str();
        if content.trim().is_empty() {
            return Err(ModelError::invalid_input(
                "messages",
                "the final message is empty: nothing to continue",
            ));
        }
        let rendered = self.render_with(messages, false, extra)?;
        let Some(at) = rendered.rfind(content.trim()) else {
            return Err(ModelError::invalid_input(
                "messages",
                "the chat template does not reproduce the final message's text",
            ));
        };
        let full = content.trim_start();
        let end = if rendered[at..].starts_with(full) {
            at + full.len()
        } else {
            at + content.trim().len()
        };
        Ok(rendered[..end].to_string())
    }

    /// Token ids of [`ChatTemplate::render`] (special tokens in the text map to their ids).
    pub fn encode(
        &self,
        tokenizer: &TextTokenizer,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        tokenizer.encode(&self.render(messages, add_generation_prompt)?)
    }
}

/// Checks that, for every `n` in `1..messages.len()`, the token ids of the rendering of
/// `messages[..n]` are a prefix of those of `messages[..n + 1]`. With
/// `generation_prompt_before_assistant`, a prefix followed by an assistant message is rendered
/// with `add_generation_prompt = true` (what the sampler saw before generating that message).
///
/// The error names the message whose addition breaks the prefix, the first differing token
/// position and the texts from there on.
pub fn check_incremental(
    template: &ChatTemplate,
    tokenizer: &TextTokenizer,
    messages: &[ChatMessage],
    generation_prompt_before_assistant: bool,
) -> Result<()> {
    for n in 1..messages.len() {
        let gen_prompt = generation_prompt_before_assistant && messages[n].role == "assistant";
        let short = template.encode(tokenizer, &messages[..n], gen_prompt)?;
        let long = template.encode(tokenizer, &messages[..=n], false)?;
        if long.starts_with(&short) {
            continue;
        }
        let at = short
            .iter()
            .zip(&long)
            .position(|(a, b)| a != b)
            .unwrap_or(short.len().min(long.len()));
        let tail = |ids: &[u32]| -> Result<String> {
            let end = (at + 12).min(ids.len());
            tokenizer.decode(&ids[at..end], false)
        };
        return Err(ModelError::Tokenizer(format!(
            "chat template is not incremental at message {n} (role `{}`): the {} tokens of \
             messages[..{n}]{} are not a prefix of the {} tokens of messages[..{}]; first \
             difference at token {at}: {:?} vs {:?}",
            messages[n].role,
            short.len(),
            if gen_prompt {
                " + generation prompt"
            } else {
                ""
            },
            long.len(),
            n + 1,
            tail(&short)?,
            tail(&long)?,
        )));
    }
    Ok(())
}

fn raise_exception(msg: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `json.dumps(value, ensure_ascii=False, indent=indent)`.
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value).map_err(|e| {
        Error::new(ErrorKind::InvalidOperation, "cannot serialize to JSON").with_source(e)
    })?;
    let mut out = Vec::new();
    let res = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let mut ser = serde_json::Serializer::with_formatter(
                &mut out,
                serde_json::ser::PrettyFormatter::with_indent(&pad),
            );
            serde::Serialize::serialize(&json, &mut ser)
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonFormatter);
            serde::Serialize::serialize(&json, &mut ser)
        }
    };
    res.map_err(|e| {
        Error::new(ErrorKind::InvalidOperation, "cannot serialize to JSON").with_source(e)
    })?;
    let text = String::from_utf8(out)
        .map_err(|_| Error::new(ErrorKind::InvalidOperation, "JSON output is not UTF-8"))?;
    Ok(Value::from_safe_string(text))
}

/// serde_json formatter with Python's default separators `", "` and `": "`.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// Python `str.strip`-family argument: `None` strips whitespace.
fn strip_with(s: &str, chars: Option<&str>, left: bool, right: bool) -> String {
    let matches = |c: char| match chars {
        Some(cs) => cs.contains(c),
        None => c.is_whitespace(),
    };
    let mut out = s;
    if left {
        out = out.trim_start_matches(matches);
    }
    if right {
        out = out.trim_end_matches(matches);
    }
    out.to_string()
}

/// The Python methods chat templates call on strings and dicts.
fn python_method(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> std::result::Result<Value, Error> {
    if let Some(s) = value.as_str() {
        match method {
            "startswith" | "endswith" => {
                let (prefix,): (Value,) = from_args(args)?;
                let test = |p: &str| {
                    if method == "startswith" {
                        s.starts_with(p)
                    } else {
                        s.ends_with(p)
                    }
                };
                // Python accepts a tuple of candidates.
                let hit = match prefix.as_str() {
                    Some(p) => test(p),
                    None => prefix.try_iter()?.any(|p| p.as_str().is_some_and(&test)),
                };
                return Ok(Value::from(hit));
            }
            "strip" | "lstrip" | "rstrip" => {
                let (chars,): (Option<String>,) = from_args(args)?;
                let (l, r) = match method {
                    "strip" => (true, true),
                    "lstrip" => (true, false),
                    _ => (false, true),
                };
                return Ok(Value::from(strip_with(s, chars.as_deref(), l, r)));
            }
            "split" => {
                let (sep, maxsplit): (Option<String>, Option<i64>) = from_args(args)?;
                let parts: Vec<String> = match (sep.as_deref(), maxsplit) {
                    (Some(sep), Some(m)) if m >= 0 => {
                        s.splitn(m as usize + 1, sep).map(String::from).collect()
                    }
                    (Some(sep), _) => s.split(sep).map(String::from).collect(),
                    (None, _) => s.split_whitespace().map(String::from).collect(),
                };
                return Ok(Value::from(parts));
            }
            "upper" => return Ok(Value::from(s.to_uppercase())),
            "lower" => return Ok(Value::from(s.to_lowercase())),
            "replace" => {
                let (old, new): (String, String) = from_args(args)?;
                return Ok(Value::from(s.replace(&old, &new)));
            }
            _ => {}
        }
    }
    if value.kind() == ValueKind::Map {
        match method {
            "items" => {
                let _: () = from_args(args)?;
                return state.apply_filter("items", std::slice::from_ref(value));
            }
            "keys" => {
                let _: () = from_args(args)?;
                return Ok(Value::from(value.try_iter()?.collect::<Vec<_>>()));
            }
            "values" => {
                let _: () = from_args(args)?;
                let vals = value
                    .try_iter()?
                    .map(|k| value.get_item(&k))
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                return Ok(Value::from(vals));
            }
            "get" => {
                let (key, default): (Value, Option<Value>) = from_args(args)?;
                let v = value.get_item(&key)?;
                return Ok(if v.is_undefined() {
                    default.unwrap_or(Value::from(()))
                } else {
                    v
                });
            }
            _ => {}
        }
    }
    Err(Error::from(ErrorKind::UnknownMethod))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::tokenizer::DEFAULT_SPECIAL_TOKENS;

    /// Qwen2.5-Instruct's chat template (tools, tool calls, grouped tool responses).
    const QWEN2_TEMPLATE: &str = r#"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"#;

    fn conversation() -> Vec<ChatMessage> {
        vec![
            ChatMessage::new("system", "Answer with search."),
            ChatMessage::new("user", "Who wrote Dune?"),
            ChatMessage::new(
                "assistant",
                "<think>look it up</think>\n<search>Dune author</search>",
            ),
            ChatMessage::new("user", "<information>Frank Herbert</information>"),
            ChatMessage::new("assistant", "<answer>Frank Herbert</answer>"),
        ]
    }

    fn tokenizer(texts: &[String]) -> TextTokenizer {
        TextTokenizer::train_byte_level_bpe(texts, 400, DEFAULT_SPECIAL_TOKENS).unwrap()
    }

    #[test]
    fn renders_the_qwen2_template() {
        let t = ChatTemplate::new(QWEN2_TEMPLATE, None, Some("<|im_end|>".into())).unwrap();
        let msgs = conversation();
        let text = t.render(&msgs[..2], true).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nAnswer with search.<|im_end|>\n<|im_start|>user\nWho wrote \
             Dune?<|im_end|>\n<|im_start|>assistant\n"
        );
        // Default system prompt, no generation prompt.
        let text = t.render(&msgs[1..2], false).unwrap();
        assert!(
            text.starts_with("<|im_start|>system\nYou are Qwen"),
            "{text}"
        );
        assert!(text.ends_with("Dune?<|im_end|>\n"), "{text}");

        // Tools, tool calls (tojson with Python separators, no HTML escaping) and tool turns.
        let tools = json!({"tools": [{"type": "function", "function": {"name": "search"}}]});
        let call = ChatMessage::new("assistant", "").with(
            "tool_calls",
            json!([{"function": {"name": "search", "arguments": {"q": "a<b", "k": 3}}}]),
        );
        let msgs = vec![
            ChatMessage::new("user", "hi"),
            call,
            ChatMessage::new("tool", "r1"),
            ChatMessage::new("tool", "r2"),
        ];
        let text = t.render_with(&msgs, false, &tools).unwrap();
        assert!(
            text.contains(
                "<tools>\n{\"function\": {\"name\": \"search\"}, \"type\": \"function\"}\n</tools>"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "<|im_start|>assistant\n<tool_call>\n{\"name\": \"search\", \"arguments\": \
                 {\"k\": 3, \"q\": \"a<b\"}}\n</tool_call><|im_end|>\n"
            ),
            "{text}"
        );
        assert!(
            text.ends_with(
                "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n\
                 </tool_response><|im_end|>\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn incremental_check_passes_and_names_the_breaking_turn() {
        let t = ChatTemplate::new(QWEN2_TEMPLATE, None, None).unwrap();
        let msgs = conversation();
        let full = t.render(&msgs, false).unwrap();
        let tok = tokenizer(&[full]);
        check_incremental(&t, &tok, &msgs, false).unwrap();
        check_incremental(&t, &tok, &msgs, true).unwrap();

        // Consecutive tool responses share one user turn: the first one's closing
        // `<|im_end|>` disappears when the second arrives.
        let msgs = vec![
            ChatMessage::new("user", "q"),
            ChatMessage::new("assistant", "<search>x</search>"),
            ChatMessage::new("tool", "r1"),
            ChatMessage::new("tool", "r2"),
        ];
        let tok = tokenizer(&[t.render(&msgs, false).unwrap()]);
        let err = check_incremental(&t, &tok, &msgs, false).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("not incremental at message 3 (role `tool`)"),
            "{msg}"
        );
        assert!(msg.contains("<|im_end|>"), "{msg}");
    }

    #[test]
    fn python_methods_namespaces_and_exceptions() {
        // The Qwen3 template's idioms.
        let src = r#"{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
{%- set index = (messages|length - 1) - loop.index0 %}
{%- if message.role == "user" and not message.content.startswith('<tool_response>') and ns.last_query_index == messages|length - 1 %}
{%- set ns.last_query_index = index %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.content is string %}{% set content = message.content %}{% else %}{% set content = '' %}{% endif %}
{%- if message.role == "assistant" and '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
[{{ loop.index0 }}>{{ ns.last_query_index }}|{{ reasoning.strip() }}|{{ content }}]
{%- else %}
[{{ message.role | upper }}:{{ content.strip('x') }}]
{%- endif %}
{%- endfor %}
{%- if enable_thinking is defined and enable_thinking is false %}<think>

</think>{% endif %}
{{- bos_token ~ '|' ~ eos_token }}
{%- if messages|length > 3 %}{{ raise_exception('too many messages') }}{% endif %}"#;
        let t = ChatTemplate::new(src, Some("<s>".into()), Some("</s>".into())).unwrap();
        let msgs = vec![
            ChatMessage::new("user", "xhix"),
            ChatMessage::new("assistant", "<think>\n  plan \n</think>\n\nok"),
            ChatMessage::new("user", "<tool_response>r</tool_response>"),
        ];
        let text = t
            .render_with(&msgs, false, &json!({"enable_thinking": false}))
            .unwrap();
        assert_eq!(
            text,
            "[USER:hi][1>0|plan|ok][USER:<tool_response>r</tool_response>]<think>\n\n</think><s>|</s>"
        );
        let mut four = msgs.clone();
        four.push(ChatMessage::new("user", "again"));
        let err = t.render(&four, false).unwrap_err().to_string();
        assert!(err.contains("too many messages"), "{err}");

        let e = ChatTemplate::new("{% if %}", None, None).unwrap_err();
        assert!(e.to_string().contains("cannot compile"), "{e}");
        // Dict methods and tojson(indent=...).
        let t = ChatTemplate::new(
            "{% for k, v in messages[0].meta.items() %}{{ k }}={{ v }};{% endfor %}\
             {{ messages[0].meta.get('zz', 'd') }}{{ messages[0].meta | tojson(indent=1) }}",
            None,
            None,
        )
        .unwrap();
        let m = ChatMessage::new("user", "").with("meta", json!({"a": 1, "b": "é"}));
        assert_eq!(
            t.render(&[m], false).unwrap(),
            "a=1;b=é;d{\n \"a\": 1,\n \"b\": \"é\"\n}"
        );
    }

    #[test]
    fn reads_tokenizer_config_json() {
        let cfg = json!({
            "bos_token": null,
            "eos_token": {"content": "<|im_end|>", "lstrip": false},
            "chat_template": QWEN2_TEMPLATE,
        });
        let t = ChatTemplate::from_tokenizer_config_json(&cfg.to_string()).unwrap();
        assert_eq!(t.eos_token(), Some("<|im_end|>"));
        assert_eq!(t.bos_token(), None);
        let listed = json!({
            "eos_token": "</s>",
            "chat_template": [
                {"name": "tool_use", "template": "T"},
                {"name": "default", "template": "D{{ eos_token }}"}
            ],
        });
        let t = ChatTemplate::from_tokenizer_config_json(&listed.to_string()).unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "D</s>");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer_config.json");
        std::fs::write(&path, cfg.to_string()).unwrap();
        assert!(ChatTemplate::from_tokenizer_config_file(&path).is_ok());
        let err = ChatTemplate::from_tokenizer_config_json("{}").unwrap_err();
        assert!(err.to_string().contains("chat_template"), "{err}");
    }
}
