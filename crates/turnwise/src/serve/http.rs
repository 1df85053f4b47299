//! The policy server's routes: request parsing and validation, answers in SGLang's and
//! OpenAI's shapes. Generation itself happens on the engine thread ([`super::worker`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use turnwise_model::ModelConfig;
use turnwise_model::sampling::{SamplingParams, SequenceParams};
use turnwise_model::tokenizer::{ChatMessage, ChatTemplate, TextTokenizer};

use super::protocol::{
    ChatCompletionRequest, ChatMessageIn, CompletionRequest, GenerateOutput, GenerateRequest,
    IdsInput, OneOrMany, PromptInput, SglFinishReason, SglMetaInfo, UpdateWeightsRequest,
    UpdateWeightsResponse, requested_choice,
};
use super::session::{
    RegisterError, Retokenization, SessionRecord, SessionStore, ToolCallParse, check_session_id,
    reconstruct,
};
use super::tools::{self, ToolCounters};
use super::worker::{Finish, GenOutput, GenRequest, NewWeights, Shared, WorkerError, WorkerHandle};

/// Most samples per prompt (`n`).
pub const MAX_N: usize = 64;
/// Most alternatives per token in log-prob answers.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// What the handlers share.
pub struct App {
    /// The engine thread.
    pub worker: WorkerHandle,
    /// Queue and weight version.
    pub shared: Arc<Shared>,
    /// The served tokenizer.
    pub tokenizer: TextTokenizer,
    /// The served chat template, if the model has one.
    pub chat: Option<ChatTemplate>,
    /// Token ids that end a generation unless `ignore_eos`.
    pub eos_ids: Vec<u32>,
    /// The served model's configuration (reloads must match it).
    pub config: ModelConfig,
    /// The name `/v1/models` reports and answers carry.
    pub name: String,
    /// Seeds of requests that give none.
    pub seeds: AtomicU64,
    /// Request ids.
    pub requests: AtomicU64,
    /// The weights the server started with: a LoRA adapter loaded with
    /// `/v1/load_lora_adapter` is merged into these (vLLM's base model).
    pub base: std::collections::HashMap<String, candle_core::Tensor>,
    /// Where the served model lives (the server's `--device` and `--dtype`).
    pub placement: turnwise_model::device::Placement,
    /// Most `guided_choice` strings in one request (`--max-guided-choices`).
    pub max_guided_choices: usize,
    /// Most bytes of `guided_choice` strings in one request, all together
    /// (`--max-guided-choice-bytes`).
    pub max_guided_choice_bytes: usize,
    /// The recorded sessions (`X-Session-Id`, `user`).
    pub sessions: std::sync::Mutex<SessionStore>,
    /// Tool-call parsing counters (`/get_server_info`'s `tool_calls`).
    pub tool_counters: ToolCounters,
}

/// The header that names a request's session.
pub const SESSION_HEADER: &str = "x-session-id";

/// A JSON error answer: `{"error": {"message", "type", "param", "code"}}` (OpenAI's shape).
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    param: Option<String>,
    message: String,
}

impl ApiError {
    fn bad(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            param: Some(param.into()),
            message: message.into(),
        }
    }

    fn status(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            param: None,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.status.as_u16() {
            400..=499 => "invalid_request_error",
            503 => "overloaded_error",
            _ => "server_error",
        };
        let message = match &self.param {
            Some(p) => format!("{p}: {}", self.message),
            None => self.message.clone(),
        };
        let body = json!({"error": {
            "message": message,
            "type": kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }});
        (self.status, axum::Json(body)).into_response()
    }
}

impl From<WorkerError> for ApiError {
    fn from(e: WorkerError) -> Self {
        match e {
            WorkerError::Invalid { field, message } => Self::bad(field, message),
            WorkerError::Engine(m) => Self::status(StatusCode::INTERNAL_SERVER_ERROR, m),
            WorkerError::Stopped => {
                Self::status(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped")
            }
        }
    }
}

/// Parses a JSON body, naming the field at fault (`sampling_params.temperature: invalid type
/// ...`).
fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            ApiError::bad("body", format!("not valid JSON: {inner}"))
        } else if path == "." || path.is_empty() {
            ApiError::bad("body", inner.to_string())
        } else {
            ApiError::bad(path, inner.to_string())
        }
    })
}

/// The sampling settings common to every route, named as the route names them.
struct Sampling<'a> {
    prefix: &'a str,
    /// The request's token limit, or the route's default when it gives none.
    max_new_tokens: usize,
    /// Whether the request gave `max_new_tokens` (refused beyond the context) or the route's
    /// default stands (cut to what the context leaves).
    max_given: bool,
    max_name: &'a str,
    temperature: f64,
    top_p: f64,
    top_k: i64,
    stop: Vec<String>,
    stop_token_ids: Vec<u32>,
    ignore_eos: bool,
    top_logprobs: usize,
    top_logprobs_name: &'a str,
    n: usize,
    seed: Option<u64>,
    guided_choice: Option<Vec<String>>,
}

/// The sampling fields that `/v1/completions` and `/v1/chat/completions` share, as the request
/// gives them, beside the route's token limit and log-prob count: both routes' [`Sampling`]
/// comes from it (`From`), with OpenAI's defaults.
struct CommonSampling<'a> {
    /// The request's token limit, the field it is named by, and the route's default.
    max_tokens: (Option<usize>, &'a str, usize),
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    n: Option<usize>,
    stop: &'a [String],
    stop_token_ids: Option<&'a [u32]>,
    ignore_eos: bool,
    seed: Option<u64>,
    /// The alternatives asked for per token, and the field that asks.
    top_logprobs: (usize, &'a str),
    guided_choice: Option<Vec<String>>,
}

impl<'a> From<&CommonSampling<'a>> for Sampling<'a> {
    fn from(c: &CommonSampling<'a>) -> Self {
        let (max_tokens, max_name, default_max) = c.max_tokens;
        Sampling {
            prefix: "",
            max_new_tokens: max_tokens.unwrap_or(default_max),
            max_given: max_tokens.is_some(),
            max_name,
            temperature: c.temperature.unwrap_or(1.0),
            top_p: c.top_p.unwrap_or(1.0),
            top_k: c.top_k.unwrap_or(-1),
            stop: c.stop.to_vec(),
            stop_token_ids: c.stop_token_ids.map(<[u32]>::to_vec).unwrap_or_default(),
            ignore_eos: c.ignore_eos,
            top_logprobs: c.top_logprobs.0,
            top_logprobs_name: c.top_logprobs.1,
            n: c.n.unwrap_or(1),
            seed: c.seed,
            guided_choice: c.guided_choice.clone(),
        }
    }
}

impl App {
    fn field(prefix: &str, name: &str) -> String {
        format!("{prefix}{name}")
    }

    /// Checks one prompt's ids.
    fn check_prompt(&self, field: &str, ids: &[u32]) -> Result<(), ApiError> {
        if ids.is_empty() {
            return Err(ApiError::bad(field, "is empty"));
        }
        let vocab = self.config.vocab_size;
        if let Some((i, &t)) = ids.iter().enumerate().find(|(_, t)| **t as usize >= vocab) {
            return Err(ApiError::bad(
                format!("{field}[{i}]"),
                format!("token id {t} is not below the vocabulary size {vocab}"),
            ));
        }
        let max = self.config.max_position_embeddings;
        if ids.len() >= max {
            return Err(ApiError::bad(
                field,
                format!(
                    "{} tokens leave no room to generate (the model's context is {max})",
                    ids.len()
                ),
            ));
        }
        Ok(())
    }

    /// The engine's requests for `prompts` × `n` samples, validated.
    fn requests(
        &self,
        prompts: Vec<Vec<u32>>,
        s: &Sampling<'_>,
    ) -> Result<Vec<GenRequest>, ApiError> {
        let f = |name: &str| Self::field(s.prefix, name);
        if !(s.temperature.is_finite() && s.temperature >= 0.0) {
            return Err(ApiError::bad(f("temperature"), "must be >= 0 and finite"));
        }
        if !(s.top_p > 0.0 && s.top_p <= 1.0) {
            return Err(ApiError::bad(f("top_p"), "must be in (0, 1]"));
        }
        if s.top_k < -1 {
            return Err(ApiError::bad(
                f("top_k"),
                "must be -1 (off), 0 (off) or positive",
            ));
        }
        if s.max_new_tokens == 0 {
            return Err(ApiError::bad(f(s.max_name), "must be at least 1"));
        }
        if !(1..=MAX_N).contains(&s.n) {
            return Err(ApiError::bad(f("n"), format!("must be in 1..={MAX_N}")));
        }
        if s.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(ApiError::bad(
                f(s.top_logprobs_name),
                format!("must be at most {MAX_TOP_LOGPROBS}"),
            ));
        }
        if let Some(i) = s.stop.iter().position(String::is_empty) {
            return Err(ApiError::bad(format!("{}[{i}]", f("stop")), "is empty"));
        }
        if let Some(choices) = &s.guided_choice {
            self.check_choices(choices)?;
        }
        let context = self.config.max_position_embeddings;
        if s.max_given
            && let Some(longest) = prompts.iter().map(Vec::len).max()
            && longest + s.max_new_tokens > context
        {
            return Err(ApiError::bad(
                f(s.max_name),
                format!(
                    "{} prompt tokens + {} = {} exceed the model's context of {context} tokens: \
                     at most {} can be generated (omit {} to generate up to the context)",
                    longest,
                    s.max_new_tokens,
                    longest + s.max_new_tokens,
                    context.saturating_sub(longest),
                    s.max_name
                ),
            ));
        }
        let vocab = self.config.vocab_size;
        if let Some(&t) = s.stop_token_ids.iter().find(|t| **t as usize >= vocab) {
            return Err(ApiError::bad(
                f("stop_token_ids"),
                format!("token id {t} is not below the vocabulary size {vocab}"),
            ));
        }
        let mut stop_ids = s.stop_token_ids.clone();
        if !s.ignore_eos {
            for &e in &self.eos_ids {
                if !stop_ids.contains(&e) {
                    stop_ids.push(e);
                }
            }
        }
        let params = SequenceParams {
            sampling: SamplingParams {
                temperature: s.temperature,
                top_p: s.top_p,
                top_k: s.top_k.max(0) as usize,
                max_new_tokens: s.max_new_tokens,
                stop_token_ids: stop_ids,
                stop_strings: s.stop.clone(),
                top_logprobs: s.top_logprobs,
            },
            max_generated_tokens: None,
            max_len: None,
            confidence_top_j: 0,
            guided_choice: s.guided_choice.clone(),
            // A request is one turn: its cache is not copied out of the batch at the end.
            single_turn: true,
        };
        let base = s
            .seed
            .unwrap_or_else(|| self.seeds.fetch_add(s.n as u64, Ordering::Relaxed));
        let mut out = Vec::with_capacity(prompts.len() * s.n);
        for prompt in prompts {
            // A default limit is what the context leaves (vLLM's rule for an omitted max_tokens).
            let mut params = params.clone();
            params.sampling.max_new_tokens = s
                .max_new_tokens
                .min(context.saturating_sub(prompt.len()))
                .max(1);
            for i in 0..s.n {
                out.push(GenRequest {
                    prompt: prompt.clone(),
                    params: params.clone(),
                    seed: base.wrapping_add(i as u64),
                });
            }
        }
        Ok(out)
    }

    /// Refuses a `guided_choice` list beyond the server's limits: every step of a constrained
    /// sequence checks each choice, on the engine thread every request shares.
    fn check_choices(&self, choices: &[String]) -> Result<(), ApiError> {
        if choices.len() > self.max_guided_choices {
            return Err(ApiError::bad(
                "guided_choice",
                format!(
                    "{} choices, more than this server allows ({}; turnwise serve \
                     --max-guided-choices N)",
                    choices.len(),
                    self.max_guided_choices
                ),
            ));
        }
        let bytes: usize = choices.iter().map(String::len).sum();
        if bytes > self.max_guided_choice_bytes {
            return Err(ApiError::bad(
                "guided_choice",
                format!(
                    "the choices take {bytes} bytes together, more than this server allows \
                     ({}; turnwise serve --max-guided-choice-bytes N)",
                    self.max_guided_choice_bytes
                ),
            ));
        }
        Ok(())
    }

    /// Admits and runs `requests`.
    async fn run(&self, requests: Vec<GenRequest>) -> Result<Vec<GenOutput>, ApiError> {
        if requests.len() > self.shared.max_queue {
            return Err(ApiError::bad(
                "n",
                format!(
                    "the request asks for {} sequences (prompts × n), more than this server ever \
                     holds (--max-queue {}): split it",
                    requests.len(),
                    self.shared.max_queue
                ),
            ));
        }
        let Some(_admission) = self.shared.admit(requests.len()) else {
            return Err(ApiError::status(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "server overloaded: {} sequences in flight (the queue holds {}); retry later",
                    self.shared.in_flight(),
                    self.shared.max_queue
                ),
            ));
        };
        Ok(self.worker.generate(requests).await?)
    }

    fn encode(&self, field: &str, text: &str) -> Result<Vec<u32>, ApiError> {
        // Bounded before tokenizing: a 60 MB prompt took 14.8 GB and 72 s to be refused after.
        let max = self.config.max_position_embeddings;
        let max_bytes = max.saturating_mul(MAX_BYTES_PER_TOKEN);
        if text.len() > max_bytes {
            return Err(ApiError::bad(
                field,
                format!(
                    "is {} bytes: longer than any prompt that fits the model's context of {max} \
                     tokens ({max_bytes} bytes at {MAX_BYTES_PER_TOKEN} a token)",
                    text.len()
                ),
            ));
        }
        self.tokenizer
            .encode(text)
            .map_err(|e| ApiError::bad(field, format!("cannot tokenize: {e}")))
    }

    fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        self.tokenizer
            .decode(ids, skip_special)
            .unwrap_or_else(|e| format!("<undecodable: {e}>"))
    }

    /// The generated text: decoded, cut before the stop string that ended it unless `keep_stop`.
    fn text_of(
        &self,
        out: &GenOutput,
        stop: &[String],
        skip_special: bool,
        keep_stop: bool,
    ) -> String {
        self.cut_text(&out.tokens, &out.finish, stop, skip_special, keep_stop)
    }

    fn cut_text(
        &self,
        tokens: &[u32],
        finish: &Finish,
        stop: &[String],
        skip_special: bool,
        keep_stop: bool,
    ) -> String {
        let mut text = self.decode(tokens, skip_special);
        if let (Finish::StopString(i), false) = (finish, keep_stop)
            && let Some(s) = stop.get(*i)
            && let Some(pos) = text.find(s.as_str())
        {
            text.truncate(pos);
        }
        text
    }

    /// The text tool calls are parsed from: decoded with special tokens kept (Qwen's
    /// `<tool_call>` is one), without the stop token that ended it, cut before the stop string
    /// that ended it as [`App::text_of`] cuts the content.
    fn tool_text(&self, out: &GenOutput, stop: &[String]) -> String {
        let tokens = match out.finish {
            Finish::StopToken(_) => &out.tokens[..out.tokens.len().saturating_sub(1)],
            _ => &out.tokens[..],
        };
        self.cut_text(tokens, &out.finish, stop, false, false)
    }

    fn token_text(&self, id: u32, as_id: bool) -> String {
        if as_id {
            format!("token_id:{id}")
        } else {
            self.decode(&[id], false)
        }
    }

    fn request_id(&self, prefix: &str) -> String {
        format!("{prefix}-{}", self.requests.fetch_add(1, Ordering::Relaxed))
    }

    fn store(&self) -> std::sync::MutexGuard<'_, SessionStore> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The ids of a rendered prompt `text`. Outside a session: its plain encoding. In one, when
    /// `text` starts with the decoded text (special tokens kept) of the session's last prompt
    /// and completion, those ids followed by the encoding of the rest only (spliced, so that
    /// the prompt extends what was sampled token for token), else the plain encoding; with how
    /// it was tokenised.
    fn encode_in_session(
        &self,
        field: &str,
        text: &str,
        session: Option<&str>,
    ) -> Result<(Vec<u32>, Option<Retokenization>), ApiError> {
        let plain = self.encode(field, text)?;
        let Some(id) = session else {
            return Ok((plain, None));
        };
        let last = self.store().last_context(id);
        if let Some(last) = last {
            let decoded = self.decode(&last, false);
            if let Some(rest) = text.strip_prefix(decoded.as_str()) {
                let mut ids = last;
                ids.extend(self.encode(field, rest)?);
                let differs = ids != plain;
                return Ok((
                    ids,
                    Some(Retokenization {
                        spliced: true,
                        differs,
                    }),
                ));
            }
        }
        Ok((
            plain,
            Some(Retokenization {
                spliced: false,
                differs: false,
            }),
        ))
    }

    /// Admits and runs `requests`, recording their answers when the request names a session:
    /// the request takes the session's next index and, when the session was registered with a
    /// seed and the request gives none, choice `c` is drawn with `turn_seed(seed, index) + c`
    /// (what a request with `seed = turn_seed(seed, index)` draws). `prompts[i / n]` and
    /// `retokenization[i / n]` are those of output `i`.
    async fn run_session(
        &self,
        session: Option<&str>,
        route: &str,
        mut requests: Vec<GenRequest>,
        sampling: &Sampling<'_>,
        retokenization: &[Option<Retokenization>],
        tool_parse: Option<&(dyn Fn(&GenOutput) -> ToolCallParse + Sync)>,
    ) -> Result<Vec<GenOutput>, ApiError> {
        let Some(id) = session else {
            return self.run(requests).await;
        };
        let turn = self.store().begin(id);
        if sampling.seed.is_none()
            && let Some(base) = turn.seed
        {
            for (i, r) in requests.iter_mut().enumerate() {
                r.seed = base.wrapping_add((i % sampling.n) as u64);
            }
        }
        let prompts: Vec<Vec<u32>> = requests.iter().map(|r| r.prompt.clone()).collect();
        let mut pending = Pending {
            app: self,
            id,
            request: turn.request,
            done: false,
        };
        let outputs = self.run(requests).await?;
        let records = outputs
            .iter()
            .zip(prompts)
            .enumerate()
            .map(|(i, (o, prompt))| SessionRecord {
                session: id.to_string(),
                request: turn.request,
                choice: i,
                route: route.to_string(),
                prompt_ids: prompt,
                output_ids: o.tokens.clone(),
                logprobs: o.logprobs.clone(),
                weight_version: o.weight_version.clone(),
                finish: openai_finish(&o.finish).to_string(),
                retokenization: retokenization.get(i / sampling.n).copied().flatten(),
                tool_calls: tool_parse.map(|parse| parse(o)),
            })
            .collect();
        self.store().record(records);
        pending.done = true;
        Ok(outputs)
    }
}

/// A session request in flight: gives its index back when it fails or its client goes away
/// before anything is recorded ([`SessionStore::abandon`]).
struct Pending<'a> {
    app: &'a App,
    id: &'a str,
    request: usize,
    done: bool,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.app.store().abandon(self.id, self.request);
        }
    }
}

/// The session a request names: the `X-Session-Id` header, else (on the OpenAI routes) the
/// `user` field (an empty or null `user` names none). A malformed id gets a 400 naming the
/// header or field.
fn session_of(headers: &HeaderMap, user: Option<&Value>) -> Result<Option<String>, ApiError> {
    if let Some(h) = headers.get(SESSION_HEADER) {
        let id = h
            .to_str()
            .map_err(|_| ApiError::bad("X-Session-Id", "is not ASCII text"))?;
        check_session_id(id).map_err(|m| ApiError::bad("X-Session-Id", m))?;
        return Ok(Some(id.to_string()));
    }
    // OpenAI's `user` is an end-user label (an e-mail address is a fair one): only a value
    // that is a session id names a session; any other is the label it always was.
    match user {
        Some(Value::String(u)) if check_session_id(u).is_ok() => Ok(Some(u.clone())),
        Some(other) if !other.is_null() && other.as_str() != Some("") => {
            tracing::debug!(user = %other, "user is not a session id: not recorded");
            Ok(None)
        }
        _ => Ok(None),
    }
}

/// A 400 naming the first field of a request that turnwise does not implement and that is not
/// at its neutral value (see [`super::protocol::check_other_fields`]).
fn other_fields(
    prefix: &str,
    other: &std::collections::BTreeMap<String, serde_json::Value>,
) -> Result<(), ApiError> {
    super::protocol::check_other_fields(prefix, other).map_err(|(f, m)| ApiError::bad(f, m))
}

fn unsupported(field: &str, what: &str) -> ApiError {
    ApiError::bad(field, format!("{what} is not supported by turnwise serve"))
}

fn created() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `POST /generate` (SGLang).
async fn generate(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let t0 = Instant::now();
    let req: GenerateRequest = parse(&body)?;
    other_fields("", &req.other)?;
    let session = session_of(&headers, None)?;
    other_fields("sampling_params.", &req.sampling_params.other)?;
    if req.stream {
        return Err(unsupported("stream", "streaming"));
    }
    if req.logprob_start_len != -1 {
        return Err(unsupported(
            "logprob_start_len",
            "a value other than -1 (prompt log-probs)",
        ));
    }
    let sp = &req.sampling_params;
    if sp.min_p != 0.0 {
        return Err(unsupported("sampling_params.min_p", "min_p"));
    }
    let (prompts, batched) = generate_prompts(&app, &req)?;
    let stop = sp.stop.clone().map(OneOrMany::into_vec).unwrap_or_default();
    let sampling = Sampling {
        prefix: "sampling_params.",
        max_new_tokens: sp.max_new_tokens.unwrap_or(128),
        max_given: sp.max_new_tokens.is_some(),
        max_name: "max_new_tokens",
        temperature: sp.temperature,
        top_p: sp.top_p,
        top_k: sp.top_k,
        stop: stop.clone(),
        stop_token_ids: sp.stop_token_ids.clone(),
        ignore_eos: sp.ignore_eos,
        top_logprobs: req.top_logprobs_num,
        top_logprobs_name: "top_logprobs_num",
        n: sp.n,
        seed: sp.sampling_seed,
        guided_choice: None,
    };
    let requests = app.requests(prompts, &sampling)?;
    let outputs = app
        .run_session(
            session.as_deref(),
            "/generate",
            requests,
            &sampling,
            &[],
            None,
        )
        .await?;
    let latency = t0.elapsed().as_secs_f64();
    let rid = req
        .rid
        .clone()
        .unwrap_or_else(|| json!(app.request_id("gen")));
    let answers: Vec<GenerateOutput> = outputs
        .iter()
        .map(|o| generate_output(&app, &req, o, &stop, &rid, latency))
        .collect();
    let body = if !batched && sp.n == 1 {
        serde_json::to_value(&answers[0])
    } else {
        serde_json::to_value(&answers)
    }
    .map_err(|e| ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    Ok(axum::Json(body).into_response())
}

/// `/generate`'s prompts, from `input_ids` or `text` (one or a batch), checked against the
/// context; and whether the request was a batch.
fn generate_prompts(app: &App, req: &GenerateRequest) -> Result<(Vec<Vec<u32>>, bool), ApiError> {
    Ok(match (&req.input_ids, &req.text) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad(
                "input_ids",
                "give input_ids or text, not both",
            ));
        }
        (None, None) => {
            return Err(ApiError::bad(
                "input_ids",
                "missing: give input_ids or text",
            ));
        }
        (Some(IdsInput::One(ids)), None) => {
            app.check_prompt("input_ids", ids)?;
            (vec![ids.clone()], false)
        }
        (Some(IdsInput::Batch(b)), None) => {
            if b.is_empty() {
                return Err(ApiError::bad("input_ids", "is an empty batch"));
            }
            for (i, ids) in b.iter().enumerate() {
                app.check_prompt(&format!("input_ids[{i}]"), ids)?;
            }
            (b.clone(), true)
        }
        (None, Some(t)) => {
            let batched = matches!(t, OneOrMany::Many(_));
            let texts = t.clone().into_vec();
            if texts.is_empty() {
                return Err(ApiError::bad("text", "is an empty batch"));
            }
            let mut prompts = Vec::new();
            for (i, text) in texts.iter().enumerate() {
                let field = if batched {
                    format!("text[{i}]")
                } else {
                    "text".into()
                };
                let ids = app.encode(&field, text)?;
                app.check_prompt(&field, &ids)?;
                prompts.push(ids);
            }
            (prompts, batched)
        }
    })
}

/// SGLang's finish reason of `o`, whose stop strings are `stop`.
fn sgl_finish(o: &GenOutput, stop: &[String]) -> SglFinishReason {
    match &o.finish {
        Finish::StopToken(t) => SglFinishReason {
            kind: "stop".into(),
            matched: Some(json!(t)),
            length: None,
            message: None,
        },
        Finish::StopString(i) => SglFinishReason {
            kind: "stop".into(),
            matched: stop.get(*i).map(|s| json!(s)),
            length: None,
            message: None,
        },
        Finish::Length => SglFinishReason {
            kind: "length".into(),
            matched: None,
            length: Some(o.tokens.len()),
            message: None,
        },
        Finish::ChoiceComplete => SglFinishReason {
            kind: "stop".into(),
            matched: None,
            length: None,
            message: None,
        },
        Finish::Abort => SglFinishReason {
            kind: "abort".into(),
            matched: None,
            length: None,
            message: Some("aborted for a weight update".into()),
        },
    }
}

/// One `/generate` answer: `o`'s text and ids, and its meta info under request id `rid`.
fn generate_output(
    app: &App,
    req: &GenerateRequest,
    o: &GenOutput,
    stop: &[String],
    rid: &Value,
    latency: f64,
) -> GenerateOutput {
    let sp = &req.sampling_params;
    let lp = |pairs: &[(u32, f32)]| -> Vec<(f64, u32, Option<String>)> {
        pairs
            .iter()
            .map(|&(t, l)| (f64::from(l), t, None))
            .collect()
    };
    GenerateOutput {
        text: app.text_of(o, stop, sp.skip_special_tokens, sp.no_stop_trim),
        output_ids: o.tokens.clone(),
        meta_info: SglMetaInfo {
            id: rid.clone(),
            finish_reason: sgl_finish(o, stop),
            prompt_tokens: o.prompt_len,
            completion_tokens: o.tokens.len(),
            cached_tokens: 0,
            weight_version: Some(o.weight_version.clone()),
            output_token_logprobs: req.return_logprob.then(|| {
                o.tokens
                    .iter()
                    .zip(&o.logprobs)
                    .map(|(&t, &l)| (f64::from(l), t, None))
                    .collect()
            }),
            output_top_logprobs: (req.return_logprob && req.top_logprobs_num > 0)
                .then(|| o.top_logprobs.iter().map(|p| lp(p)).collect()),
            e2e_latency: latency,
        },
    }
}

fn usage(outputs: &[GenOutput]) -> Value {
    let prompt: usize = outputs.first().map_or(0, |o| o.prompt_len);
    let completion: usize = outputs.iter().map(|o| o.tokens.len()).sum();
    json!({"prompt_tokens": prompt, "completion_tokens": completion,
           "total_tokens": prompt + completion})
}

fn openai_finish(f: &Finish) -> &'static str {
    match f {
        Finish::StopToken(_) | Finish::StopString(_) | Finish::ChoiceComplete => "stop",
        Finish::Length => "length",
        Finish::Abort => "abort",
    }
}

fn stop_reason(f: &Finish, stop: &[String]) -> Value {
    match f {
        Finish::StopToken(t) => json!(t),
        Finish::StopString(i) => json!(stop.get(*i)),
        _ => Value::Null,
    }
}

/// `POST /v1/completions` (OpenAI, vLLM's token-id extensions).
async fn completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse(&body)?;
    other_fields("", &req.other)?;
    let session = session_of(&headers, req.other.get("user"))?;
    if req.stream {
        return Err(unsupported("stream", "streaming"));
    }
    if req.echo {
        return Err(unsupported("echo", "echo"));
    }
    let sid = session.as_deref();
    let (prompts, retokenization): (Vec<Vec<u32>>, Vec<Option<Retokenization>>) = match &req.prompt
    {
        PromptInput::Text(t) => {
            let (ids, r) = app.encode_in_session("prompt", t, sid)?;
            (vec![ids], vec![r])
        }
        PromptInput::Ids(ids) => (vec![ids.clone()], vec![None]),
        PromptInput::Texts(ts) => ts
            .iter()
            .enumerate()
            .map(|(i, t)| app.encode_in_session(&format!("prompt[{i}]"), t, sid))
            .collect::<Result<Vec<_>, _>>()?
            .into_iter()
            .unzip(),
        PromptInput::Batch(b) => (b.clone(), vec![None; b.len()]),
    };
    if prompts.is_empty() {
        return Err(ApiError::bad("prompt", "is empty"));
    }
    let single = prompts.len() == 1;
    for (i, p) in prompts.iter().enumerate() {
        let field = if single {
            "prompt".to_string()
        } else {
            format!("prompt[{i}]")
        };
        app.check_prompt(&field, p)?;
    }
    let stop = req
        .stop
        .clone()
        .map(OneOrMany::into_vec)
        .unwrap_or_default();
    let n = req.n.unwrap_or(1);
    let sampling = Sampling::from(&CommonSampling {
        max_tokens: (req.max_tokens, "max_tokens", 16),
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        n: req.n,
        stop: &stop,
        stop_token_ids: req.stop_token_ids.as_deref(),
        ignore_eos: req.ignore_eos,
        seed: req.seed,
        top_logprobs: (req.logprobs.unwrap_or(0), "logprobs"),
        guided_choice: requested_choice(&req.guided_choice, &req.structured_outputs)
            .map_err(|(f, m)| ApiError::bad(f, m))?,
    });
    let requests = app.requests(prompts.clone(), &sampling)?;
    let outputs = app
        .run_session(
            sid,
            "/v1/completions",
            requests,
            &sampling,
            &retokenization,
            None,
        )
        .await?;
    let skip = req.skip_special_tokens.unwrap_or(true);
    let choices: Vec<Value> = outputs
        .iter()
        .enumerate()
        .map(|(index, o)| {
            let text = app.text_of(o, &stop, skip, req.include_stop_str_in_output);
            let logprobs = req.logprobs.map(|k| {
                let tokens: Vec<String> = o
                    .tokens
                    .iter()
                    .map(|&t| app.token_text(t, req.return_tokens_as_token_ids))
                    .collect();
                let mut offsets = Vec::with_capacity(tokens.len());
                let mut at = 0usize;
                for t in &tokens {
                    offsets.push(at);
                    at += t.len();
                }
                let top: Value = if k > 0 {
                    json!(
                        o.top_logprobs
                            .iter()
                            .map(|pairs| {
                                pairs
                                    .iter()
                                    .map(|&(t, l)| {
                                        (
                                            app.token_text(t, req.return_tokens_as_token_ids),
                                            json!(l),
                                        )
                                    })
                                    .collect::<serde_json::Map<String, Value>>()
                            })
                            .collect::<Vec<_>>()
                    )
                } else {
                    Value::Null
                };
                json!({"tokens": tokens, "token_logprobs": o.logprobs, "top_logprobs": top,
                       "text_offset": offsets})
            });
            let mut c = json!({
                "index": index,
                "text": text,
                "finish_reason": openai_finish(&o.finish),
                "stop_reason": stop_reason(&o.finish, &stop),
                "logprobs": logprobs,
            });
            if req.return_token_ids {
                c["token_ids"] = json!(o.tokens);
                c["prompt_token_ids"] = json!(prompts[index / n]);
            }
            c
        })
        .collect();
    Ok(axum::Json(json!({
        "id": app.request_id("cmpl"),
        "object": "text_completion",
        "created": created(),
        "model": req.model.clone().unwrap_or_else(|| app.name.clone()),
        "choices": choices,
        "usage": usage(&outputs),
        "weight_version": outputs.first().map(|o| o.weight_version.clone()),
    }))
    .into_response())
}

/// `POST /v1/chat/completions` (OpenAI; the model's chat template renders the messages).
async fn chat_completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: ChatCompletionRequest = parse(&body)?;
    other_fields("", &req.other)?;
    let session = session_of(&headers, req.other.get("user"))?;
    if req.stream {
        return Err(unsupported("stream", "streaming"));
    }
    let (prompt, retokenization, use_tools) = chat_prompt(&app, &req, session.as_deref())?;
    let stop = req
        .stop
        .clone()
        .map(OneOrMany::into_vec)
        .unwrap_or_default();
    let top = req.top_logprobs.unwrap_or(0);
    if top > 0 && !req.logprobs {
        return Err(ApiError::bad("top_logprobs", "needs logprobs: true"));
    }
    let max_name = if req.max_completion_tokens.is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let sampling = Sampling::from(&CommonSampling {
        max_tokens: (req.max_completion_tokens.or(req.max_tokens), max_name, 512),
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        n: req.n,
        stop: &stop,
        stop_token_ids: req.stop_token_ids.as_deref(),
        ignore_eos: req.ignore_eos,
        seed: req.seed,
        top_logprobs: (top, "top_logprobs"),
        guided_choice: requested_choice(&req.guided_choice, &req.structured_outputs)
            .map_err(|(f, m)| ApiError::bad(f, m))?,
    });
    let requests = app.requests(vec![prompt.clone()], &sampling)?;
    let number = app.requests.fetch_add(1, Ordering::Relaxed);
    // What the tool-call parser finds in each choice goes into the session's records too.
    let parse_stats = |o: &GenOutput| tools::parse_hermes(&app.tool_text(o, &stop)).stats;
    let outputs = app
        .run_session(
            session.as_deref(),
            "/v1/chat/completions",
            requests,
            &sampling,
            &[retokenization],
            use_tools.then_some(&parse_stats as &(dyn Fn(&GenOutput) -> ToolCallParse + Sync)),
        )
        .await?;
    let skip = req.skip_special_tokens.unwrap_or(true);
    let mut calls_made = 0usize;
    let choices: Vec<Value> = outputs
        .iter()
        .enumerate()
        .map(|(index, o)| {
            let parse = use_tools.then(|| tools::parse_hermes(&app.tool_text(o, &stop)));
            let mut c = chat_choice(&app, &req, index, o, &stop, skip);
            if let Some(p) = parse {
                add_tool_calls(&app, &mut c, o, p, number, &mut calls_made);
            }
            if req.return_token_ids {
                c["token_ids"] = json!(o.tokens);
            }
            c
        })
        .collect();
    let mut answer = json!({
        "id": format!("chatcmpl-{number}"),
        "object": "chat.completion",
        "created": created(),
        "model": req.model.clone().unwrap_or_else(|| app.name.clone()),
        "choices": choices,
        "usage": usage(&outputs),
        "weight_version": outputs.first().map(|o| o.weight_version.clone()),
    });
    if req.return_token_ids {
        answer["prompt_token_ids"] = json!(prompt);
    }
    Ok(axum::Json(answer).into_response())
}

/// The prompt of a chat request: its messages checked and rendered by the served model's chat
/// template (with its `tools` when they are used), encoded in its session and checked against
/// the context; how it was tokenised; and whether the request uses tools.
fn chat_prompt(
    app: &App,
    req: &ChatCompletionRequest,
    session: Option<&str>,
) -> Result<(Vec<u32>, Option<Retokenization>, bool), ApiError> {
    let Some(chat) = &app.chat else {
        return Err(ApiError::bad(
            "messages",
            "the served model has no chat template; use /v1/completions or /generate",
        ));
    };
    let (messages, use_tools) = chat_request_messages(req)?;
    let render = |extra: &Value| {
        if req.continue_final_message {
            chat.render_continuing_final_with(&messages, extra)
                .map_err(|e| ApiError::bad("continue_final_message", e.to_string()))
        } else {
            chat.render_with(&messages, req.add_generation_prompt, extra)
                .map_err(|e| ApiError::bad("messages", e.to_string()))
        }
    };
    let rendered = if use_tools {
        let with = render(&json!({"tools": req.tools}))?;
        if with == render(&json!({}))? {
            return Err(ApiError::bad(
                "tools",
                "the served model's chat template does not render tools",
            ));
        }
        with
    } else {
        render(&json!({}))?
    };
    let (prompt, retokenization) = app.encode_in_session("messages", &rendered, session)?;
    app.check_prompt("messages", &prompt)?;
    Ok((prompt, retokenization, use_tools))
}

/// A chat request's messages, checked (non-empty, known roles, `tools` and `tool_choice`,
/// `parallel_tool_calls`, `continue_final_message`) and converted for the template; and
/// whether the request uses tools.
fn chat_request_messages(
    req: &ChatCompletionRequest,
) -> Result<(Vec<ChatMessage>, bool), ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::bad("messages", "is empty"));
    }
    if let Some(i) = req
        .messages
        .iter()
        .position(|m| !matches!(m.role.as_str(), "system" | "user" | "assistant" | "tool"))
    {
        return Err(ApiError::bad(
            format!("messages[{i}].role"),
            format!(
                "unknown role {:?} (system, user, assistant or tool)",
                req.messages[i].role
            ),
        ));
    }
    let messages = chat_messages(&req.messages)?;
    let offered = match &req.tools {
        None | Some(Value::Null) => false,
        Some(t) => !tools::check_tools(t)
            .map_err(|(f, m)| ApiError::bad(f, m))?
            .is_empty(),
    };
    let use_tools = tools::tools_wanted(req.tool_choice.as_ref(), offered)
        .map_err(|(f, m)| ApiError::bad(f, m))?;
    if use_tools && req.parallel_tool_calls == Some(false) {
        return Err(ApiError::bad(
            "parallel_tool_calls",
            "false is not supported by turnwise serve (every call a completion makes is \
             returned): leave it out or true",
        ));
    }
    if req.continue_final_message {
        if req.add_generation_prompt {
            return Err(ApiError::bad(
                "continue_final_message",
                "cannot be combined with add_generation_prompt: true (set it to false)",
            ));
        }
        let last = req.messages.last().expect("checked non-empty");
        if last.role != "assistant" {
            return Err(ApiError::bad(
                "continue_final_message",
                format!(
                    "the final message must be the assistant's to continue it, not the {}'s",
                    last.role
                ),
            ));
        }
    }
    Ok((messages, use_tools))
}

/// One choice of a chat answer: `o`'s message, finish and stop reasons, and its log-probs when
/// the request asked for them.
fn chat_choice(
    app: &App,
    req: &ChatCompletionRequest,
    index: usize,
    o: &GenOutput,
    stop: &[String],
    skip: bool,
) -> Value {
    let entry = |t: u32, l: f32| {
        let text = app.token_text(t, false);
        json!({"token": text, "logprob": l, "bytes": text.as_bytes()})
    };
    let logprobs = req.logprobs.then(|| {
        let content: Vec<Value> = o
            .tokens
            .iter()
            .zip(&o.logprobs)
            .enumerate()
            .map(|(i, (&t, &l))| {
                let mut e = entry(t, l);
                e["top_logprobs"] = json!(o.top_logprobs.get(i).map_or_else(Vec::new, |p| {
                    p.iter().map(|&(t, l)| entry(t, l)).collect::<Vec<_>>()
                }));
                e
            })
            .collect();
        json!({"content": content})
    });
    json!({
        "index": index,
        "message": {"role": "assistant", "content": app.text_of(o, stop, skip, false)},
        "finish_reason": openai_finish(&o.finish),
        "stop_reason": stop_reason(&o.finish, stop),
        "logprobs": logprobs,
    })
}

/// What the tool-call parser found in `o` (`p`) put into its choice `c`: the content without
/// the call blocks, the calls (numbered `call_<number>_<k>` across the request's choices from
/// `calls_made`), `tool_calls` as the finish reason of a completion that stopped after calls,
/// and the parse counts; counted in the server's tool counters.
fn add_tool_calls(
    app: &App,
    c: &mut Value,
    o: &GenOutput,
    p: tools::HermesParse,
    number: u64,
    calls_made: &mut usize,
) {
    app.tool_counters.add(&p.stats);
    if p.stats.blocks > 0 {
        c["message"]["content"] = json!(p.content);
    }
    if !p.calls.is_empty() {
        let calls: Vec<Value> = p
            .calls
            .iter()
            .map(|call| {
                *calls_made += 1;
                call.to_openai(&format!("call_{number}_{}", *calls_made - 1))
            })
            .collect();
        c["message"]["tool_calls"] = json!(calls);
        if matches!(
            o.finish,
            Finish::StopToken(_) | Finish::StopString(_) | Finish::ChoiceComplete
        ) {
            c["finish_reason"] = json!("tool_calls");
        }
    }
    c["tool_call_parse"] = json!(p.stats);
}

/// The template's messages for the request's: an assistant message may have no content (its
/// `tool_calls` then say what it did), whose arguments reach the template as JSON objects
/// (vLLM's rule: templates index and `tojson` them); a `tool` message's `tool_call_id` and
/// `name` are passed on.
fn chat_messages(messages: &[ChatMessageIn]) -> Result<Vec<ChatMessage>, ApiError> {
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let field = |f: &str| format!("messages[{i}]{f}");
        let content = match (&m.content, m.role.as_str()) {
            (Some(c), _) => c.clone(),
            (None, "assistant") => String::new(),
            (None, _) => {
                return Err(ApiError::bad(
                    field(".content"),
                    "missing (only an assistant message may have none)",
                ));
            }
        };
        let mut message = ChatMessage::new(m.role.clone(), content);
        if let Some(calls) = &m.tool_calls {
            if m.role != "assistant" {
                return Err(ApiError::bad(
                    field(".tool_calls"),
                    format!(
                        "only an assistant message makes tool calls, not a {}",
                        m.role
                    ),
                ));
            }
            let mut list = Vec::with_capacity(calls.len());
            for (j, call) in calls.iter().enumerate() {
                let f = |x: &str| field(&format!(".tool_calls[{j}]{x}"));
                if let Some(kind) = &call.kind
                    && kind != "function"
                {
                    return Err(ApiError::bad(
                        f(".type"),
                        format!("{kind:?}: only \"function\" calls are supported"),
                    ));
                }
                if call.function.name.is_empty() {
                    return Err(ApiError::bad(f(".function.name"), "is empty"));
                }
                let arguments = match &call.function.arguments {
                    Value::Null => json!({}),
                    Value::Object(_) => call.function.arguments.clone(),
                    Value::String(s) if s.trim().is_empty() => json!({}),
                    Value::String(s) => match serde_json::from_str::<Value>(s) {
                        Ok(v @ Value::Object(_)) => v,
                        _ => {
                            return Err(ApiError::bad(
                                f(".function.arguments"),
                                "must be a JSON object, or a string holding one",
                            ));
                        }
                    },
                    _ => {
                        return Err(ApiError::bad(
                            f(".function.arguments"),
                            "must be a JSON object, or a string holding one",
                        ));
                    }
                };
                let mut c = json!({"type": "function",
                                   "function": {"name": call.function.name,
                                                "arguments": arguments}});
                if let Some(id) = &call.id {
                    c["id"] = json!(id);
                }
                list.push(c);
            }
            message = message.with("tool_calls", Value::Array(list));
        }
        if let Some(id) = &m.tool_call_id {
            message = message.with("tool_call_id", json!(id));
        }
        if let Some(name) = &m.name {
            message = message.with("name", json!(name));
        }
        out.push(message);
    }
    Ok(out)
}

/// The version after `current` when a reload names none.
fn next_version(current: &str) -> String {
    match current.parse::<u64>() {
        Ok(n) => (n + 1).to_string(),
        Err(_) => format!("{current}+1"),
    }
}

/// `POST /update_weights_from_disk` (SGLang).
async fn update_weights(State(app): State<Arc<App>>, body: Bytes) -> Response {
    let req: UpdateWeightsRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let failed = |status: StatusCode, message: String| {
        tracing::warn!(%message, "weight update refused");
        (
            status,
            axum::Json(UpdateWeightsResponse {
                success: false,
                message,
                num_paused_requests: 0,
            }),
        )
            .into_response()
    };
    let path = std::path::PathBuf::from(&req.model_path);
    let (config, placement) = (app.config.clone(), app.placement.clone());
    let loaded =
        tokio::task::spawn_blocking(move || super::load_weights(&path, &config, &placement)).await;
    let (model, path) = match loaded {
        Ok(Ok(m)) => m,
        Ok(Err(e)) => return failed(StatusCode::BAD_REQUEST, format!("model_path: {e:#}")),
        Err(e) => return failed(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    };
    let version = req
        .weight_version
        .clone()
        .unwrap_or_else(|| next_version(&app.shared.version()));
    let weights = NewWeights {
        model,
        path,
        version,
    };
    match app.worker.reload(weights, req.abort_all_requests).await {
        Ok(done) => axum::Json(UpdateWeightsResponse {
            success: true,
            message: format!("weights updated to version {}", done.weight_version),
            num_paused_requests: done.aborted,
        })
        .into_response(),
        Err(e) => failed(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

/// `POST /v1/load_lora_adapter` (vLLM, with runtime LoRA updating): `{lora_name, lora_path}`,
/// a PEFT adapter folder for the base model the server started with. The adapter is merged into
/// those base weights and served from then on (one adapter at a time: requests are answered
/// with it whatever `model` they name); the weight version counts up. Answers plain text, as
/// vLLM does.
async fn load_lora_adapter(State(app): State<Arc<App>>, body: Bytes) -> Response {
    #[derive(serde::Deserialize)]
    struct LoadLora {
        lora_name: String,
        lora_path: String,
    }
    let req: LoadLora = match parse(&body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let path = std::path::PathBuf::from(&req.lora_path);
    let app2 = Arc::clone(&app);
    let merged = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let (lora, adapters) = turnwise_model::model::lora::load_peft_adapter(
            &path,
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        )?;
        let tensors = turnwise_model::model::lora::merge_adapters(
            &app2.config,
            &lora,
            &app2.base,
            &adapters,
        )?;
        let model = turnwise_model::model::Transformer::from_tensors(
            &app2.config,
            &app2.placement.tensors(tensors)?,
            &path.display().to_string(),
        )?;
        Ok((model, path))
    })
    .await;
    let (model, path) = match merged {
        Ok(Ok(m)) => m,
        Ok(Err(e)) => {
            return ApiError::bad("lora_path", format!("{e:#}")).into_response();
        }
        Err(e) => {
            return ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
                .into_response();
        }
    };
    let weights = NewWeights {
        model,
        path,
        version: next_version(&app.shared.version()),
    };
    match app.worker.reload(weights, false).await {
        Ok(_) => (
            StatusCode::OK,
            format!(
                "Success: LoRA adapter '{}' added successfully.",
                req.lora_name
            ),
        )
            .into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
}

async fn weight_version(State(app): State<Arc<App>>) -> axum::Json<Value> {
    axum::Json(json!({"weight_version": app.shared.version()}))
}

async fn health() -> StatusCode {
    StatusCode::OK
}

/// `GET /health_generate`: generates one token, so it fails when the engine does.
async fn health_generate(State(app): State<Arc<App>>) -> Result<StatusCode, ApiError> {
    let prompt = vec![app.eos_ids.first().copied().unwrap_or(0)];
    let sampling = Sampling {
        prefix: "",
        max_new_tokens: 1,
        max_given: false,
        max_name: "max_new_tokens",
        temperature: 0.0,
        top_p: 1.0,
        top_k: -1,
        stop: Vec::new(),
        stop_token_ids: Vec::new(),
        ignore_eos: true,
        top_logprobs: 0,
        top_logprobs_name: "top_logprobs",
        n: 1,
        seed: Some(0),
        guided_choice: None,
    };
    app.run(app.requests(vec![prompt], &sampling)?).await?;
    Ok(StatusCode::OK)
}

async fn model_info(State(app): State<Arc<App>>) -> axum::Json<Value> {
    let path = app
        .shared
        .model_path
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .display()
        .to_string();
    axum::Json(json!({
        "model_path": path,
        "tokenizer_path": path,
        "is_generation": true,
        "weight_version": app.shared.version(),
        "max_context_length": app.config.max_position_embeddings,
        "vocab_size": app.config.vocab_size,
        "has_chat_template": app.chat.is_some(),
    }))
}

async fn server_info(State(app): State<Arc<App>>) -> axum::Json<Value> {
    let engine = app.shared.counters();
    axum::Json(json!({
        "weight_version": app.shared.version(),
        "in_flight": app.shared.in_flight(),
        "max_queue": app.shared.max_queue,
        "memory_budget_bytes": app.shared.memory_budget,
        "prefill_chunk": app.shared.prefill_chunk,
        "batch_invariant": app.shared.batch_invariant,
        "engine": engine,
        "prefix_cache": engine.prefix_cache.map(|s| {
            let mut v = serde_json::to_value(s).unwrap_or_default();
            v["hit_rate"] = json!(s.hit_rate());
            v
        }),
        "sessions": app.store().counters(),
        "tool_calls": app.tool_counters.to_json(),
    }))
}

async fn models(State(app): State<Arc<App>>) -> axum::Json<Value> {
    axum::Json(json!({"object": "list", "data": [{
        "id": app.name,
        "object": "model",
        "created": 0,
        "owned_by": "turnwise",
        "max_model_len": app.config.max_position_embeddings,
    }]}))
}

/// `POST /v1/sessions`: `{"id", "seed"?}` registers a session, whose requests that give no seed
/// then draw choice `c` of request `k` with `turn_seed(seed, k) + c`. 409 when it already has
/// records.
async fn register_session(State(app): State<Arc<App>>, body: Bytes) -> Result<Response, ApiError> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Register {
        id: String,
        #[serde(default)]
        seed: Option<u64>,
    }
    let req: Register = parse(&body)?;
    check_session_id(&req.id).map_err(|m| ApiError::bad("id", m))?;
    match app.store().register(&req.id, req.seed) {
        Ok(()) => Ok(axum::Json(json!({"session": req.id, "seed": req.seed})).into_response()),
        Err(RegisterError::HasRecords(n)) => Err(ApiError::status(
            StatusCode::CONFLICT,
            format!(
                "session {:?} already has {n} records: register a session before its first \
                 request",
                req.id
            ),
        )),
    }
}

/// The answer of `GET` and `DELETE /v1/sessions/{id}`.
fn session_body(id: &str, records: &[SessionRecord], reward: Option<f64>) -> Response {
    axum::Json(json!({
        "session": id,
        "records": records,
        "segments": reconstruct(records),
        "reward": reward,
    }))
    .into_response()
}

/// `POST /v1/sessions/{id}/reward`: `{"reward": x}` (a finite number), the episode's reward as
/// the agent program reports it; `GET` and `DELETE` of the session return it. The session is
/// created when new.
async fn session_reward(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Reward {
        reward: f64,
    }
    check_session_id(&id).map_err(|m| ApiError::bad("id", m))?;
    let req: Reward = parse(&body)?;
    if !req.reward.is_finite() {
        return Err(ApiError::bad("reward", "must be a finite number"));
    }
    app.store().set_reward(&id, req.reward);
    Ok(axum::Json(json!({"session": id, "reward": req.reward})).into_response())
}

fn no_session(id: &str) -> ApiError {
    ApiError::status(
        StatusCode::NOT_FOUND,
        format!("no session {id:?} (never named, deleted, or evicted beyond --max-sessions)"),
    )
}

/// `GET /v1/sessions/{id}`: the session's records and their reconstruction into segments.
async fn get_session(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    check_session_id(&id).map_err(|m| ApiError::bad("id", m))?;
    let store = app.store();
    let records = store
        .records(&id)
        .map(<[SessionRecord]>::to_vec)
        .ok_or_else(|| no_session(&id))?;
    let reward = store.reward(&id);
    drop(store);
    Ok(session_body(&id, &records, reward))
}

/// `DELETE /v1/sessions/{id}`: as `GET`, and forgets the session.
async fn delete_session(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    check_session_id(&id).map_err(|m| ApiError::bad("id", m))?;
    let mut store = app.store();
    let reward = store.reward(&id);
    let records = store.remove(&id).ok_or_else(|| no_session(&id))?;
    drop(store);
    Ok(session_body(&id, &records, reward))
}

async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::status(
        StatusCode::NOT_FOUND,
        format!(
            "no route for {uri}; the routes are POST /generate, /v1/completions, \
             /v1/chat/completions, /update_weights_from_disk, /v1/load_lora_adapter, \
             /v1/sessions, GET /health, /health_generate, /get_weight_version, \
             /get_model_info, /get_server_info, /v1/models, GET or DELETE \
             /v1/sessions/{{id}} and POST /v1/sessions/{{id}}/reward"
        ),
    )
}

/// The longest text one token stands for, as far as the length check before tokenizing
/// assumes (a generous bound: BPE and word-level tokens are far shorter).
const MAX_BYTES_PER_TOKEN: usize = 64;

/// axum answers an over-long body with a plain-text 413: give it the API's JSON error shape,
/// naming the flag.
async fn json_413(max_body_bytes: usize, response: Response) -> Response {
    if response.status() != StatusCode::PAYLOAD_TOO_LARGE
        || response
            .headers()
            .get(axum::http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/json"))
    {
        return response;
    }
    ApiError::status(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("the request body is larger than {max_body_bytes} bytes (--max-body-bytes)"),
    )
    .into_response()
}

/// The router over `app`, refusing bodies over `max_body_bytes` (413).
pub fn router(app: Arc<App>, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/generate", post(generate))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/update_weights_from_disk", post(update_weights))
        .route("/v1/load_lora_adapter", post(load_lora_adapter))
        .route("/get_weight_version", get(weight_version))
        .route("/health", get(health))
        .route("/health_generate", get(health_generate))
        .route("/get_model_info", get(model_info))
        .route("/get_server_info", get(server_info))
        .route("/v1/models", get(models))
        .route("/v1/sessions", post(register_session))
        .route("/v1/sessions/{id}", get(get_session).delete(delete_session))
        .route("/v1/sessions/{id}/reward", post(session_reward))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(axum::middleware::map_response(move |r: Response| {
            json_413(max_body_bytes, r)
        }))
        .with_state(app)
}
