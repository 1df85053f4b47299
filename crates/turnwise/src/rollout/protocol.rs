//! Wire types of the policy server's routes (`turnwise serve`, which re-exports them as
//! `serve::protocol`), shared with its clients: the remote rollout backend parses SGLang's
//! `/generate` answers with [`GenerateOutput`].
//!
//! Field names follow SGLang's native API and OpenAI's (with vLLM's token-id extensions, its
//! chat-template flags `add_generation_prompt` / `continue_final_message`, and its structured
//! output by choice, `guided_choice` or `structured_outputs: {"choice": [...]}`);
//! ../shared/notes/inference-engines.md records both. Unknown request fields are ignored, as
//! the engines do; fields that change the meaning of a request and are not supported (`stream`,
//! `echo`, `min_p`, prompt log-probs) are refused with a 400 naming them.

use serde::{Deserialize, Serialize};

/// One value or a list of them (`"stop": "x"` or `"stop": ["x", "y"]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany<T> {
    /// A single value.
    One(T),
    /// A list.
    Many(Vec<T>),
}

impl<T> OneOrMany<T> {
    /// The values as a list.
    pub fn into_vec(self) -> Vec<T> {
        match self {
            Self::One(v) => vec![v],
            Self::Many(v) => v,
        }
    }
}

/// Prompt token ids: one prompt or a batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum IdsInput {
    /// One prompt.
    One(Vec<u32>),
    /// A batch of prompts.
    Batch(Vec<Vec<u32>>),
}

fn default_temperature() -> f64 {
    1.0
}
fn default_top_p() -> f64 {
    1.0
}
fn minus_one() -> i64 {
    -1
}
fn default_true() -> bool {
    true
}
fn default_n() -> usize {
    1
}

/// SGLang's `sampling_params`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SglSamplingParams {
    /// Most tokens generated (default 128).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_new_tokens: Option<usize>,
    /// Temperature; 0 is greedy.
    #[serde(default = "default_temperature")]
    pub temperature: f64,
    /// Nucleus mass (1 disables).
    #[serde(default = "default_top_p")]
    pub top_p: f64,
    /// Top-k (-1 or 0 disables).
    #[serde(default = "minus_one")]
    pub top_k: i64,
    /// Min-p (only 0 is supported).
    #[serde(default)]
    pub min_p: f64,
    /// Stop strings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<OneOrMany<String>>,
    /// Stop token ids (besides the model's EOS unless `ignore_eos`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stop_token_ids: Vec<u32>,
    /// Do not stop at the model's EOS tokens.
    #[serde(default)]
    pub ignore_eos: bool,
    /// Leave special tokens out of `text`.
    #[serde(default = "default_true")]
    pub skip_special_tokens: bool,
    /// Keep the matched stop string at the end of `text`.
    #[serde(default)]
    pub no_stop_trim: bool,
    /// Samples per prompt.
    #[serde(default = "default_n")]
    pub n: usize,
    /// Seed of the first sample (sample `i` uses `seed + i`); absent: the server picks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampling_seed: Option<u64>,
    /// Any other field: refused with a 400 unless it holds its neutral value
    /// ([`check_other_fields`]), so that nothing is silently ignored.
    #[serde(flatten, default, skip_serializing)]
    pub other: std::collections::BTreeMap<String, serde_json::Value>,
}

impl Default for SglSamplingParams {
    fn default() -> Self {
        Self {
            max_new_tokens: None,
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            min_p: 0.0,
            stop: None,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            skip_special_tokens: true,
            no_stop_trim: false,
            n: 1,
            sampling_seed: None,
            other: Default::default(),
        }
    }
}

/// `POST /generate` (SGLang's native API).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// Prompt text (one or a batch); give this or `input_ids`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<OneOrMany<String>>,
    /// Prompt token ids (one or a batch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_ids: Option<IdsInput>,
    /// How to sample.
    #[serde(default)]
    pub sampling_params: SglSamplingParams,
    /// Return `meta_info.output_token_logprobs`.
    #[serde(default)]
    pub return_logprob: bool,
    /// Most likely tokens per step in `meta_info.output_top_logprobs`.
    #[serde(default)]
    pub top_logprobs_num: usize,
    /// Where prompt log-probs start (-1: outputs only, the one value supported).
    #[serde(default = "minus_one")]
    pub logprob_start_len: i64,
    /// The caller's request id, echoed as `meta_info.id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rid: Option<serde_json::Value>,
    /// Streaming (not supported: must be false).
    #[serde(default)]
    pub stream: bool,
    /// Any other field: refused with a 400 unless it holds its neutral value
    /// ([`check_other_fields`]), so that nothing is silently ignored.
    #[serde(flatten, default, skip_serializing)]
    pub other: std::collections::BTreeMap<String, serde_json::Value>,
}

/// `meta_info.finish_reason`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SglFinishReason {
    /// `stop`, `length` or `abort`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The stop token id or stop string matched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matched: Option<serde_json::Value>,
    /// The length reached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub length: Option<usize>,
    /// Why it was aborted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// One `[log-prob, token id, text]` entry of SGLang's log-prob lists.
pub type SglLogprob = (f64, u32, Option<String>);

/// `meta_info` of a `/generate` answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SglMetaInfo {
    /// The request id.
    pub id: serde_json::Value,
    /// Why generation ended.
    pub finish_reason: SglFinishReason,
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Generated length.
    pub completion_tokens: usize,
    /// Prompt tokens served from a prefix cache (always 0 here).
    #[serde(default)]
    pub cached_tokens: usize,
    /// The weight version that generated the answer.
    #[serde(default)]
    pub weight_version: Option<String>,
    /// `[log-prob, id, text]` of every generated token (with `return_logprob`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_token_logprobs: Option<Vec<SglLogprob>>,
    /// The most likely tokens of every step (with `top_logprobs_num`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_top_logprobs: Option<Vec<Vec<SglLogprob>>>,
    /// Seconds from arrival to answer.
    #[serde(default)]
    pub e2e_latency: f64,
}

/// One answer of `/generate` (an object for one prompt and `n = 1`, else a list of them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateOutput {
    /// The generated text.
    pub text: String,
    /// The generated token ids.
    pub output_ids: Vec<u32>,
    /// Everything else.
    pub meta_info: SglMetaInfo,
}

/// `POST /update_weights_from_disk`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UpdateWeightsRequest {
    /// A Hugging Face folder (or GGUF file) of the same architecture.
    pub model_path: String,
    /// The version to report from now on (absent: the current one plus one when it is a
    /// number).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<String>,
    /// Abort the requests in flight instead of letting them finish first.
    #[serde(default)]
    pub abort_all_requests: bool,
    /// Accepted for compatibility; this server keeps no cache across requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flush_cache: Option<bool>,
}

/// The answer of `/update_weights_from_disk`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UpdateWeightsResponse {
    /// Whether the new weights are served.
    pub success: bool,
    /// What happened.
    pub message: String,
    /// Requests aborted to reload.
    #[serde(default)]
    pub num_paused_requests: usize,
}

/// vLLM's `structured_outputs` request field. Only `choice` is supported; any other kind
/// (`regex`, `json`, `grammar`, ...) is refused with a 400 naming it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StructuredOutputs {
    /// The output must be exactly one of these strings (as `guided_choice`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub choice: Option<Vec<String>>,
    /// Every other key, refused unless null or false.
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

/// The choice list of a request: `guided_choice`, or `structured_outputs.choice` (vLLM's newer
/// spelling); `Err` names the field at fault.
pub fn requested_choice(
    guided_choice: &Option<Vec<String>>,
    structured: &Option<StructuredOutputs>,
) -> Result<Option<Vec<String>>, (String, String)> {
    let from_structured = match structured {
        None => None,
        Some(s) => {
            if let Some((k, _)) = s.other.iter().find(|(_, v)| {
                !matches!(v, serde_json::Value::Null | serde_json::Value::Bool(false))
            }) {
                return Err((
                    format!("structured_outputs.{k}"),
                    "is not supported by turnwise serve (only `choice` is)".into(),
                ));
            }
            s.choice.clone()
        }
    };
    match (guided_choice, from_structured) {
        (Some(_), Some(_)) => Err((
            "guided_choice".into(),
            "give either guided_choice or structured_outputs.choice, not both".into(),
        )),
        (Some(g), None) => Ok(Some(g.clone())),
        (None, s) => Ok(s),
    }
}

/// A prompt of `/v1/completions`: text, token ids, or a batch of either.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    /// One text prompt.
    Text(String),
    /// One prompt of token ids.
    Ids(Vec<u32>),
    /// Several text prompts.
    Texts(Vec<String>),
    /// Several prompts of token ids.
    Batch(Vec<Vec<u32>>),
}

/// `POST /v1/completions` (OpenAI, with vLLM's extensions).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    /// Model name (any name is accepted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The prompt(s).
    pub prompt: PromptInput,
    /// Most tokens generated (default 16, as OpenAI's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
    /// Temperature (default 1; 0 is greedy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// Nucleus mass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    /// Top-k (-1 or 0 disables).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    /// Samples per prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<usize>,
    /// Stop strings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<OneOrMany<String>>,
    /// Stop token ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_token_ids: Option<Vec<u32>>,
    /// Seed of the first sample.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Return log-probs with this many alternatives per token (0: the sampled token only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<usize>,
    /// Echo the prompt (not supported: must be false).
    #[serde(default)]
    pub echo: bool,
    /// Do not stop at EOS.
    #[serde(default)]
    pub ignore_eos: bool,
    /// Leave special tokens out of the text (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_special_tokens: Option<bool>,
    /// Return `token_ids` and `prompt_token_ids` in each choice (vLLM).
    #[serde(default)]
    pub return_token_ids: bool,
    /// Name tokens `token_id:N` in the log-probs (vLLM).
    #[serde(default)]
    pub return_tokens_as_token_ids: bool,
    /// Keep the matched stop string in the text.
    #[serde(default)]
    pub include_stop_str_in_output: bool,
    /// vLLM's structured output by choice: the completion is exactly one of these strings
    /// (constrained decoding; log-probs are those of the constrained distribution).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guided_choice: Option<Vec<String>>,
    /// vLLM's newer spelling of structured outputs (`{"choice": [...]}` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub structured_outputs: Option<StructuredOutputs>,
    /// Streaming (not supported: must be false).
    #[serde(default)]
    pub stream: bool,
    /// Any other field: refused with a 400 unless it holds its neutral value
    /// ([`check_other_fields`]), so that nothing is silently ignored.
    #[serde(flatten, default, skip_serializing)]
    pub other: std::collections::BTreeMap<String, serde_json::Value>,
}

/// A message of `/v1/chat/completions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessageIn {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text (`null` or absent only on an assistant message, typically one with
    /// `tool_calls`).
    #[serde(default)]
    pub content: Option<String>,
    /// The calls an assistant message made (OpenAI's shape).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallIn>>,
    /// The call a `tool` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The tool's name, on a `tool` message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessageIn {
    /// A message with text and nothing else.
    pub fn text(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: Some(content.into()),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

/// One call of an assistant message's `tool_calls`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCallIn {
    /// The call's id (what a `tool` message's `tool_call_id` names).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `function`.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// The function called.
    pub function: FunctionCallIn,
}

/// The function of a [`ToolCallIn`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCallIn {
    /// Its name.
    pub name: String,
    /// Its arguments: a string holding a JSON object (OpenAI's shape), or the object itself.
    #[serde(default)]
    pub arguments: serde_json::Value,
}

/// `POST /v1/chat/completions` (OpenAI, with vLLM's token-id extension).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionRequest {
    /// Model name (any name is accepted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The conversation, rendered with the model's chat template.
    pub messages: Vec<ChatMessageIn>,
    /// Most tokens generated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
    /// Most tokens generated (OpenAI's newer name; wins over `max_tokens`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_completion_tokens: Option<usize>,
    /// Temperature (default 1; 0 is greedy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// Nucleus mass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    /// Top-k (-1 or 0 disables).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    /// Samples.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<usize>,
    /// Stop strings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<OneOrMany<String>>,
    /// Stop token ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_token_ids: Option<Vec<u32>>,
    /// Seed of the first sample.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Return log-probs.
    #[serde(default)]
    pub logprobs: bool,
    /// Alternatives per token in the log-probs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<usize>,
    /// Do not stop at EOS.
    #[serde(default)]
    pub ignore_eos: bool,
    /// Leave special tokens out of the text (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_special_tokens: Option<bool>,
    /// Return `token_ids` in each choice and `prompt_token_ids` (vLLM).
    #[serde(default)]
    pub return_token_ids: bool,
    /// Append the opening of an assistant turn to the rendered conversation (vLLM; default
    /// true).
    #[serde(default = "default_true")]
    pub add_generation_prompt: bool,
    /// Continue the final message, which must be the assistant's: the conversation is
    /// rendered without the generation prompt and without closing that message, so the model
    /// writes on from its last character (vLLM; needs `add_generation_prompt: false`).
    #[serde(default)]
    pub continue_final_message: bool,
    /// vLLM's structured output by choice: the reply is exactly one of these strings
    /// (constrained decoding; log-probs are those of the constrained distribution).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guided_choice: Option<Vec<String>>,
    /// vLLM's newer spelling of structured outputs (`{"choice": [...]}` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub structured_outputs: Option<StructuredOutputs>,
    /// Tools the model may call (OpenAI's `[{"type": "function", "function": {"name",
    /// "description"?, "parameters"?}}]`), rendered by the chat template; the completion's
    /// Hermes `<tool_call>` blocks come back as `tool_calls`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<serde_json::Value>,
    /// `"auto"` (the default when tools are given) or `"none"` (tools neither rendered nor
    /// parsed); `"required"` and a named function are refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<serde_json::Value>,
    /// Whether a completion may make several calls (true, the default, is what is done;
    /// false is refused when tools are used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    /// Streaming (not supported: must be false).
    #[serde(default)]
    pub stream: bool,
    /// Any other field: refused with a 400 unless it holds its neutral value
    /// ([`check_other_fields`]), so that nothing is silently ignored.
    #[serde(flatten, default, skip_serializing)]
    pub other: std::collections::BTreeMap<String, serde_json::Value>,
}

/// Fields of the OpenAI and SGLang APIs that only label a request (`user`, `metadata`, ...):
/// accepted whatever their value.
const LABELS: &[&str] = &[
    "user",
    "metadata",
    "store",
    "service_tier",
    "stream_options",
    "session_params",
];

/// Whether `value` is the neutral value of the field `key`: what the engines do when the field is
/// absent (no penalty, no bias, no minimum length, plain text, no tools).
fn is_neutral(key: &str, value: &serde_json::Value) -> bool {
    use serde_json::Value;
    match value {
        Value::Null => true,
        Value::Bool(b) => match key {
            "spaces_between_special_tokens" | "skip_special_tokens" => *b,
            _ => !*b,
        },
        Value::Number(n) => {
            let x = n.as_f64().unwrap_or(f64::NAN);
            match key {
                "repetition_penalty" | "length_penalty" | "best_of" => x == 1.0,
                _ => x == 0.0,
            }
        }
        Value::String(t) => match key {
            "response_format" => t == "text",
            "tool_choice" | "function_call" => t == "none",
            _ => t.is_empty(),
        },
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => match key {
            "response_format" => {
                o.len() == 1 && o.get("type").and_then(Value::as_str) == Some("text")
            }
            _ => o.is_empty(),
        },
    }
}

/// Refuses, as `(field, message)`, the first field of `other` (the fields a request type does not
/// implement) that is not a label and does not hold its neutral value: `logit_bias`, frequency,
/// presence and repetition penalties, `min_new_tokens`/`min_tokens`, `response_format`, `tools`,
/// ... would otherwise be accepted and silently ignored. `prefix` is the field's path
/// (`sampling_params.`).
pub fn check_other_fields(
    prefix: &str,
    other: &std::collections::BTreeMap<String, serde_json::Value>,
) -> Result<(), (String, String)> {
    for (key, value) in other {
        if LABELS.contains(&key.as_str()) || is_neutral(key, value) {
            continue;
        }
        return Err((
            format!("{prefix}{key}"),
            format!(
                "= {value} is not supported by turnwise serve (it would be ignored): leave it \
                 out, or at its neutral value"
            ),
        ));
    }
    Ok(())
}
