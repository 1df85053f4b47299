//! LLM-as-judge rewards over an OpenAI-compatible chat-completions endpoint.
//!
//! Two rubrics from turn-level-rewards.md App. C.3 (spec §2.4):
//!
//! - **outcome** ([`LlmJudge::outcome`]): 1.0 if the final `<answer>` matches the ground truth
//!   (and has at most 5 tokens), else 0.0;
//! - **per turn** ([`LlmJudge::turn_scores`]): final turn −1 (bad format), 0.2 (format ok, wrong
//!   answer) or 1 (correct); intermediate turn = format (+0.1 / −0.2) + information (+0.3 if the
//!   retrieved `<information>` helps towards the ground truth, else 0) − 0.1 × (searches from
//!   turn 1 through this turn).
//!
//! The judge's free-text reply is parsed robustly ([`parse_outcome_score`],
//! [`parse_turn_scores`]): the last `<score>…</score>` block if there is one, else the whole
//! reply; numbers may carry markdown or extra words around them.
//!
//! Two ways to ask for the per-turn scores ([`JudgeMode`]):
//!
//! - **free**: one request per trajectory; the reply is free text, parsed as above. A small
//!   model often writes no usable `<score>` block (SmolLM2-135M echoes the prompt).
//! - **choice**: one request per turn, with vLLM's extensions: the rubric prompt as the user
//!   message, then an assistant message holding the score block so far
//!   (`<score>\nTurn1: 0.1\n…Turn{k}: `, [`score_prefill`]) continued by the model
//!   (`continue_final_message: true`, `add_generation_prompt: false`) under
//!   `guided_choice` = the scores the rubric can give that turn ([`turn_score_choices`]). The
//!   reply is always one of them, and still the model's own pick. Needs a server with those
//!   extensions (vLLM, `turnwise serve`).
//!
//! Requests go to `POST {base_url}/chat/completions` with
//! `{"model", "messages", "temperature", "max_tokens"}` (plus the extensions above in choice
//! mode) and read `choices[0].message.content`.
//! The API key is read once from the environment variable named by
//! [`JudgeConfig::api_key_env`] and sent as `Authorization: Bearer …`; it is never logged,
//! never written to the cache and never part of an error message or `Debug` output.
//!
//! Transient failures are retried with backoff ([`crate::client::RetryPolicy`]). With
//! [`JudgeConfig::cache_dir`] set, every reply is stored on disk under a hash of the request
//! (model, messages, sampling settings), so re-judging the same trajectory costs nothing.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::client::{ClientConfig, Idempotency, error_chain, join_url, post_json};

/// How [`LlmJudge::turn_scores`] asks for the per-turn scores (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JudgeMode {
    /// One request per trajectory; the free-text reply is parsed.
    #[default]
    Free,
    /// One request per turn, the reply constrained to the rubric's possible scores
    /// (`guided_choice` after a prefilled score block, `continue_final_message`).
    Choice,
}

/// Settings of an [`LlmJudge`].
#[derive(Debug, Clone, PartialEq)]
pub struct JudgeConfig {
    /// Base URL of the OpenAI-compatible API, e.g. `http://127.0.0.1:8000/v1`.
    pub base_url: String,
    /// Model name sent in each request.
    pub model: String,
    /// Name of the environment variable holding the API key (`None`: no key is sent).
    pub api_key_env: Option<String>,
    /// Timeouts and retries.
    pub client: ClientConfig,
    /// Directory of the on-disk reply cache (`None`: no cache). Created if missing.
    pub cache_dir: Option<PathBuf>,
    /// Sampling temperature. Default 0.
    pub temperature: f64,
    /// Reply token limit, if any. Default 1024.
    pub max_tokens: Option<u32>,
    /// How per-turn scores are asked for. Default [`JudgeMode::Free`].
    pub mode: JudgeMode,
}

impl JudgeConfig {
    /// A config for `model` at `base_url` with defaults elsewhere (no key, no cache).
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            model: model.into(),
            api_key_env: None,
            client: ClientConfig::default(),
            cache_dir: None,
            temperature: 0.0,
            max_tokens: Some(1024),
            mode: JudgeMode::Free,
        }
    }
}

/// Error of the LLM judge.
#[derive(Debug, thiserror::Error)]
pub enum JudgeError {
    /// The environment variable that should hold the API key is unset or not UTF-8.
    #[error("judge API key: environment variable {var} is not set")]
    MissingApiKey {
        /// The variable's name.
        var: String,
    },
    /// The configuration is unusable.
    #[error("judge config {field}: {message}")]
    Config {
        /// The offending field.
        field: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// The endpoint failed, timed out or answered malformed data.
    #[error("judge endpoint {url}: {message}")]
    Remote {
        /// Endpoint URL.
        url: String,
        /// What went wrong.
        message: String,
    },
    /// The judge's reply holds no usable score.
    #[error("cannot parse judge score ({expected}) from reply: {reply:?}")]
    Unparsable {
        /// What was looked for.
        expected: String,
        /// The reply (truncated to 300 characters).
        reply: String,
    },
    /// The cache directory could not be read or written.
    #[error("judge cache {path}: {cause}")]
    Cache {
        /// File or directory.
        path: PathBuf,
        /// Underlying I/O error.
        cause: std::io::Error,
    },
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `"system"`, `"user"` or `"assistant"`.
    pub role: String,
    /// Message text.
    pub content: String,
}

impl ChatMessage {
    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        Self {
            role: "system".into(),
            content: content.into(),
        }
    }

    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self {
            role: "user".into(),
            content: content.into(),
        }
    }

    /// An assistant message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self {
            role: "assistant".into(),
            content: content.into(),
        }
    }
}

/// A client of an OpenAI-compatible endpoint that scores trajectories with the App. C.3 rubrics.
pub struct LlmJudge {
    config: JudgeConfig,
    url: String,
    api_key: Option<String>,
    client: reqwest::blocking::Client,
    /// Chat requests sent to the endpoint (cache hits excluded; a retried request counts once).
    requests: AtomicUsize,
    /// Chat requests answered from the cache.
    cache_hits: AtomicUsize,
}

impl std::fmt::Debug for LlmJudge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlmJudge")
            .field("url", &self.url)
            .field("model", &self.config.model)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("cache_dir", &self.config.cache_dir)
            .finish()
    }
}

/// Stable 128-bit FNV-1a hash (not cryptographic; cache entries also store the request and are
/// compared on read, so a collision cannot return a wrong reply).
fn fnv1a_128(bytes: &[u8]) -> u128 {
    const OFFSET: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
    const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013b;
    bytes
        .iter()
        .fold(OFFSET, |h, &b| (h ^ b as u128).wrapping_mul(PRIME))
}

fn truncate(text: &str, n: usize) -> String {
    let mut out: String = text.chars().take(n).collect();
    if out.len() < text.len() {
        out.push('…');
    }
    out
}

impl LlmJudge {
    /// Builds a judge, reading the API key from `config.api_key_env` if set.
    pub fn new(config: JudgeConfig) -> Result<Self, JudgeError> {
        let api_key = match &config.api_key_env {
            None => None,
            Some(var) => Some(
                std::env::var(var)
                    .ok()
                    .filter(|k| !k.is_empty())
                    .ok_or_else(|| JudgeError::MissingApiKey { var: var.clone() })?,
            ),
        };
        if !(config.base_url.starts_with("http://") || config.base_url.starts_with("https://")) {
            return Err(JudgeError::Config {
                field: "base_url",
                message: format!(
                    "must start with http:// or https://, got {:?}",
                    config.base_url
                ),
            });
        }
        if config.model.is_empty() {
            return Err(JudgeError::Config {
                field: "model",
                message: "must not be empty".into(),
            });
        }
        let client = config
            .client
            .build_client()
            .map_err(|e| JudgeError::Config {
                field: "client",
                message: format!("cannot build HTTP client: {}", error_chain(&e)),
            })?;
        if let Some(dir) = &config.cache_dir {
            std::fs::create_dir_all(dir).map_err(|cause| JudgeError::Cache {
                path: dir.clone(),
                cause,
            })?;
        }
        Ok(Self {
            url: join_url(&config.base_url, "chat/completions"),
            config,
            api_key,
            client,
            requests: AtomicUsize::new(0),
            cache_hits: AtomicUsize::new(0),
        })
    }

    /// The chat-completions endpoint URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// How per-turn scores are asked for.
    pub fn mode(&self) -> JudgeMode {
        self.config.mode
    }

    /// Chat requests sent to the endpoint so far (answers from the cache excluded; a request
    /// retried after a transient failure counts once).
    pub fn requests_sent(&self) -> usize {
        self.requests.load(Ordering::Relaxed)
    }

    /// Chat requests answered from the cache so far.
    pub fn cache_hits(&self) -> usize {
        self.cache_hits.load(Ordering::Relaxed)
    }

    fn request_body(&self, messages: &[ChatMessage]) -> Value {
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| json!({"role": m.role, "content": m.content}))
            .collect();
        let mut body = json!({
            "model": self.config.model,
            "messages": messages,
            "temperature": self.config.temperature,
        });
        if let Some(n) = self.config.max_tokens {
            body["max_tokens"] = json!(n);
        }
        body
    }

    fn cache_path(&self, body: &Value) -> Option<PathBuf> {
        let dir = self.config.cache_dir.as_ref()?;
        let key = fnv1a_128(body.to_string().as_bytes());
        Some(dir.join(format!("{key:032x}.json")))
    }

    fn read_cache(path: &Path, body: &Value) -> Result<Option<String>, JudgeError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(cause) => {
                return Err(JudgeError::Cache {
                    path: path.to_owned(),
                    cause,
                });
            }
        };
        // A corrupt or colliding entry is ignored (and overwritten after the next request).
        let Ok(entry) = serde_json::from_str::<Value>(&text) else {
            return Ok(None);
        };
        if entry.get("request") != Some(body) {
            return Ok(None);
        }
        Ok(entry
            .get("content")
            .and_then(Value::as_str)
            .map(str::to_owned))
    }

    fn write_cache(path: &Path, body: &Value, content: &str) -> Result<(), JudgeError> {
        let entry = json!({"request": body, "content": content});
        // One temporary file per write: concurrent requests for the same entry (identical
        // rollouts judged together) must not rename each other's file away.
        static WRITES: AtomicUsize = AtomicUsize::new(0);
        let n = WRITES.fetch_add(1, Ordering::Relaxed);
        let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
        let io = |cause| JudgeError::Cache {
            path: path.to_owned(),
            cause,
        };
        std::fs::write(&tmp, entry.to_string()).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// Sends `messages` and returns the reply text (from the cache when possible).
    pub fn chat(&self, messages: &[ChatMessage]) -> Result<String, JudgeError> {
        self.chat_with(messages, &serde_json::Map::new())
    }

    /// [`LlmJudge::chat`] with extra request fields (e.g. vLLM's `guided_choice`), which are
    /// part of the cache key; they may not replace `model` or `messages`.
    pub fn chat_with(
        &self,
        messages: &[ChatMessage],
        extra: &serde_json::Map<String, Value>,
    ) -> Result<String, JudgeError> {
        let mut body = self.request_body(messages);
        for (k, v) in extra {
            if k != "model" && k != "messages" {
                body[k] = v.clone();
            }
        }
        let cache = self.cache_path(&body);
        if let Some(path) = &cache
            && let Some(content) = Self::read_cache(path, &body)?
        {
            tracing::debug!(path = %path.display(), "judge cache hit");
            self.cache_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(content);
        }
        self.requests.fetch_add(1, Ordering::Relaxed);
        let remote = |message: String| JudgeError::Remote {
            url: self.url.clone(),
            message,
        };
        let headers: Vec<(&str, String)> = self
            .api_key
            .iter()
            .map(|k| ("authorization", format!("Bearer {k}")))
            .collect();
        let answer = post_json(
            &self.client,
            &self.url,
            &body,
            &headers,
            &self.config.client.retry,
            Idempotency::Idempotent,
        )
        .map_err(|f| remote(f.message))?;
        let content = answer
            .pointer("/choices/0/message/content")
            .and_then(Value::as_str)
            .ok_or_else(|| {
                remote(format!(
                    "malformed answer, expected choices[0].message.content: {}",
                    truncate(&answer.to_string(), 300)
                ))
            })?
            .to_owned();
        if let Some(path) = &cache {
            Self::write_cache(path, &body, &content)?;
        }
        Ok(content)
    }

    /// Outcome-level score (1.0 or 0.0) of a multi-turn response.
    pub fn outcome(
        &self,
        question: &str,
        ground_truth: &[String],
        turns: &[String],
    ) -> Result<f64, JudgeError> {
        let reply = self.chat(&[ChatMessage::user(outcome_prompt(
            question,
            ground_truth,
            turns,
        ))])?;
        parse_outcome_score(&reply)
    }

    /// Per-turn scores (one per turn, in order) of a multi-turn response, asked for as
    /// [`JudgeConfig::mode`] says.
    pub fn turn_scores(
        &self,
        question: &str,
        ground_truth: &[String],
        turns: &[String],
    ) -> Result<Vec<f64>, JudgeError> {
        let prompt = turn_prompt(question, ground_truth, turns);
        match self.config.mode {
            JudgeMode::Free => {
                let reply = self.chat(&[ChatMessage::user(prompt)])?;
                parse_turn_scores(&reply, turns.len())
            }
            JudgeMode::Choice => self.turn_scores_by_choice(&prompt, turns.len(), turns.len()),
        }
    }

    /// The scores of the intermediate turns only (every turn but the last, in order) of a
    /// multi-turn response: the judge reads the whole response with the per-turn rubric, as in
    /// [`LlmJudge::turn_scores`], but the final turn's score is not asked for (in
    /// [`JudgeMode::Choice`], no request for it) or is dropped (in [`JudgeMode::Free`], where
    /// the reply must still score every turn to parse). A response of one turn has none: no
    /// request is sent and the result is empty.
    pub fn intermediate_turn_scores(
        &self,
        question: &str,
        ground_truth: &[String],
        turns: &[String],
    ) -> Result<Vec<f64>, JudgeError> {
        let n = turns.len();
        if n <= 1 {
            return Ok(Vec::new());
        }
        let prompt = turn_prompt(question, ground_truth, turns);
        match self.config.mode {
            JudgeMode::Free => {
                let reply = self.chat(&[ChatMessage::user(prompt)])?;
                let mut scores = parse_turn_scores(&reply, n)?;
                scores.truncate(n - 1);
                Ok(scores)
            }
            JudgeMode::Choice => self.turn_scores_by_choice(&prompt, n, n - 1),
        }
    }

    /// [`JudgeMode::Choice`]: turn by turn, the model continues the score block so far with
    /// one of the rubric's scores for that turn; turns 1 to `upto` of the `n`.
    fn turn_scores_by_choice(
        &self,
        prompt: &str,
        n: usize,
        upto: usize,
    ) -> Result<Vec<f64>, JudgeError> {
        let mut picked: Vec<String> = Vec::with_capacity(upto);
        let mut scores = Vec::with_capacity(upto);
        for k in 1..=upto.min(n) {
            let choices = turn_score_choices(k, n);
            let mut extra = serde_json::Map::new();
            extra.insert("continue_final_message".into(), json!(true));
            extra.insert("add_generation_prompt".into(), json!(false));
            extra.insert("guided_choice".into(), json!(choices));
            let reply = self.chat_with(
                &[
                    ChatMessage::user(prompt),
                    ChatMessage::assistant(score_prefill(&picked)),
                ],
                &extra,
            )?;
            let value = reply.trim();
            let score = choices
                .iter()
                .find(|c| c.as_str() == value)
                .and_then(|c| c.parse::<f64>().ok())
                .ok_or_else(|| JudgeError::Unparsable {
                    expected: format!("Turn{k} as one of {}", choices.join(", ")),
                    reply: truncate(&reply, 300),
                })?;
            picked.push(value.to_string());
            scores.push(score);
        }
        Ok(scores)
    }
}

/// The start of the judge's answer in [`JudgeMode::Choice`] before turn `picked.len() + 1`'s
/// score: `<score>\nTurn1: {picked[0]}\n…Turn{k}: ` (the rubric's output format).
pub fn score_prefill(picked: &[String]) -> String {
    let mut out = String::from("<score>\n");
    for (i, s) in picked.iter().enumerate() {
        out.push_str(&format!("Turn{}: {s}\n", i + 1));
    }
    out.push_str(&format!("Turn{}: ", picked.len() + 1));
    out
}

/// A score in tenths written as the rubric's `X.X` (`-0.3`, `0.0`, `1.0`).
fn tenths(t: i32) -> String {
    let sign = if t < 0 { "-" } else { "" };
    format!("{sign}{}.{}", t.abs() / 10, t.abs() % 10)
}

/// The scores the rubric can give turn `k` (1-based) of `n`, as `X.X` strings: the final turn
/// −1.0, 0.2 or 1.0; an intermediate turn format (+0.1 / −0.2) + information (0 / +0.3)
/// − 0.1 × searches from turn 1 through turn `k` (0 to `k`, one per turn), kept within the
/// rubric's range [−1.0, 1.0]; from the highest to the lowest.
pub fn turn_score_choices(k: usize, n: usize) -> Vec<String> {
    if k == n {
        return ["-1.0", "0.2", "1.0"].map(String::from).to_vec();
    }
    let mut t: Vec<i32> = Vec::new();
    for format in [1, -2] {
        for info in [0, 3] {
            for searches in 0..=k as i32 {
                t.push((format + info - searches).clamp(-10, 10));
            }
        }
    }
    t.sort_unstable_by(|a, b| b.cmp(a));
    t.dedup();
    t.into_iter().map(tenths).collect()
}

fn evaluation_data(question: &str, ground_truth: &[String], turns: &[String]) -> String {
    let mut out = String::from("## EVALUATION DATA\n\n### User prompt\n");
    out.push_str(question);
    out.push_str("\n\n### Multi-turn response\n");
    for (i, t) in turns.iter().enumerate() {
        out.push_str(&format!("Turn{}:\n{}\n\n", i + 1, t));
    }
    out.push_str("### Ground truth\n");
    out.push_str(&ground_truth.join(" | "));
    out.push_str("\n\n## Your Evaluation\n");
    out
}

/// The outcome-level judge prompt (App. C.3): score 1.0 if the `<answer>` matches the ground
/// truth and has at most 5 tokens, else 0.0.
pub fn outcome_prompt(question: &str, ground_truth: &[String], turns: &[String]) -> String {
    format!(
        "You are an expert evaluator for multi-turn search-augmented reasoning systems. Given a \
user prompt, ground truth answer, and multi-turn generated response, determine whether the final \
answer matches the ground truth.

## EVALUATION TASK
Evaluate whether the multi-turn response provides a correct final answer that matches the ground \
truth.

## SCORING CRITERIA
Score 1.0 (Correct):
- The answer within <answer></answer> tags matches the ground truth.
Score 0.0 (Incorrect):
- No <answer></answer> tags found, or
- The answer within <answer></answer> tags does not match the ground truth, or
- The answer in <answer> tag exceeds 5 tokens.

## OUTPUT FORMAT
<reasoning> Your step-by-step reasoning about whether the answer matches the ground truth \
</reasoning>
<score> 1.0 or 0.0 </score>

REQUIREMENTS:
- First provide reasoning, then the score.
- Score must be exactly 1.0 or 0.0.

{}",
        evaluation_data(question, ground_truth, turns)
    )
}

/// The turn-level judge prompt (App. C.3): final turn −1 / 0.2 / 1, intermediate turns
/// format (+0.1/−0.2) + information (+0.3/0) − 0.1 × searches so far.
pub fn turn_prompt(question: &str, ground_truth: &[String], turns: &[String]) -> String {
    let lines: String = (1..=turns.len())
        .map(|i| format!("Turn{i}: X.X\n"))
        .collect();
    format!(
        "You are an expert evaluator for multi-turn search-augmented reasoning systems. Given a \
user prompt, ground truth answer, and multi-turn generated response, evaluate each turn's \
effectiveness and compliance.

## EVALUATION TASK
Assess each turn's format compliance, content quality, and contribution toward the ground truth \
answer.

## SCORING CRITERIA
FINAL TURN (Last Turn) - Score Range: [-1.0 to 1.0]
Format Compliance: required <think>...</think><answer>...</answer> (tags only, once each, in \
order); the answer in the <answer> tag must not exceed 5 tokens.
Answer Correctness: correct and complete answer in the <answer> tag that matches the ground truth.
Scoring Rules:
- If format is incorrect: Final Turn Score = -1.0
- If format is correct, answer is incorrect: Final Turn Score = 0.2
- If format is correct, answer is correct: Final Turn Score = 1.0

INTERMEDIATE TURNS - Score Range: [-1.0 to 1.0]
Format Compliance: required <think>...</think><search>...</search> \
<information>...</information> (tags only, once each, in order)
- Correct format: +0.1
- Incorrect format: -0.2
Information Quality:
- Relevant information in the <information> tag that helps toward the ground truth answer (e.g., \
the ground truth exists in the retrieved result): +0.3
- Irrelevant or unhelpful information: +0.0
Search Efficiency Penalty:
- Number of searches = total count of <search> tags across all turns from Turn 1 up to and \
including the current turn
- Search penalty = Number of searches x (-0.1)
Intermediate Turn Score = Format Compliance + Information Quality + Search Penalty

## OUTPUT FORMAT
Provide your evaluation using ONLY these XML tags:
<reasoning>
Systematically evaluate each turn: check format compliance, assess content quality, calculate \
scores with clear explanations
</reasoning>
<score>
{lines}</score>

{}",
        evaluation_data(question, ground_truth, turns)
    )
}

/// The text to search for scores: the content of the last `<score>…</score>` block, else the
/// whole reply.
fn score_region(reply: &str) -> &str {
    if let Some(open) = reply.rfind("<score>") {
        let start = open + "<score>".len();
        let end = reply[start..]
            .find("</score>")
            .map_or(reply.len(), |e| start + e);
        return &reply[start..end];
    }
    reply
}

/// Numbers (`-?digits[.digits]`) in `text` with their byte offsets.
fn numbers(text: &str) -> Vec<(usize, f64)> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i].is_ascii_digit() {
            let neg = i > 0 && (bytes[i - 1] == b'-' || text[..i].ends_with('−'));
            let start = i;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                i += 1;
            }
            if i + 1 < bytes.len() && bytes[i] == b'.' && bytes[i + 1].is_ascii_digit() {
                i += 1;
                while i < bytes.len() && bytes[i].is_ascii_digit() {
                    i += 1;
                }
            }
            if let Ok(v) = text[start..i].parse::<f64>() {
                out.push((start, if neg { -v } else { v }));
            }
        } else {
            i += 1;
        }
    }
    out
}

/// Parses an outcome score (1.0 or 0.0) from a judge reply: the first number equal to 0 or 1
/// in the last `<score>` block (or, without one, the last such number in the reply).
pub fn parse_outcome_score(reply: &str) -> Result<f64, JudgeError> {
    let has_block = reply.contains("<score>");
    let region = score_region(reply);
    let candidates: Vec<f64> = numbers(region)
        .into_iter()
        .map(|(_, v)| v)
        .filter(|v| *v == 0.0 || *v == 1.0)
        .collect();
    let pick = if has_block {
        candidates.first()
    } else {
        candidates.last()
    };
    pick.copied().ok_or_else(|| JudgeError::Unparsable {
        expected: "outcome score 1.0 or 0.0".into(),
        reply: truncate(reply, 300),
    })
}

/// Parses `n_turns` per-turn scores from a judge reply: lines like `Turn2: -0.3` (any case,
/// optional space, `:` or `=`), in the last `<score>` block or else anywhere in the reply.
/// Scores are clamped to `[-1, 1]`; a later duplicate of a turn overrides an earlier one.
pub fn parse_turn_scores(reply: &str, n_turns: usize) -> Result<Vec<f64>, JudgeError> {
    let region = score_region(reply);
    let lower = region.to_ascii_lowercase();
    let mut scores: Vec<Option<f64>> = vec![None; n_turns];
    let mut from = 0;
    while let Some(p) = lower[from..].find("turn") {
        let mut i = from + p + 4;
        from = i;
        let bytes = lower.as_bytes();
        while i < bytes.len() && (bytes[i] == b' ' || bytes[i] == b'_') {
            i += 1;
        }
        let digits_start = i;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        let Ok(turn) = lower[digits_start..i].parse::<usize>() else {
            continue;
        };
        let rest = &region[i..];
        let trimmed = rest.trim_start_matches([' ', '*']);
        let Some(after_sep) = trimmed
            .strip_prefix(':')
            .or_else(|| trimmed.strip_prefix('='))
        else {
            continue;
        };
        let after_sep = after_sep.trim_start_matches([' ', '*']);
        // The value must start right after the separator (sign allowed).
        let value = numbers(after_sep).into_iter().find(|(off, _)| {
            let prefix = &after_sep[..*off];
            prefix.is_empty() || prefix == "-" || prefix == "+" || prefix == "−"
        });
        if let Some((_, v)) = value
            && (1..=n_turns).contains(&turn)
        {
            scores[turn - 1] = Some(v.clamp(-1.0, 1.0));
        }
    }
    let missing: Vec<String> = scores
        .iter()
        .enumerate()
        .filter(|(_, s)| s.is_none())
        .map(|(i, _)| format!("Turn{}", i + 1))
        .collect();
    if !missing.is_empty() {
        return Err(JudgeError::Unparsable {
            expected: format!("{n_turns} turn scores; missing {}", missing.join(", ")),
            reply: truncate(reply, 300),
        });
    }
    Ok(scores.into_iter().flatten().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_scores_parse_from_free_text() {
        let ok = |t: &str| parse_outcome_score(t).unwrap();
        assert_eq!(
            ok("<reasoning>2 of 3</reasoning>\n<score> 1.0 </score>"),
            1.0
        );
        assert_eq!(
            ok("<reasoning>Turn 1 ok</reasoning><score>0.0</score>"),
            0.0
        );
        assert_eq!(ok("<score>**1**</score>"), 1.0);
        assert_eq!(ok("The answer is wrong. Final score: 0"), 0.0);
        assert_eq!(ok("Paris has 2 million people... Score: 1.0"), 1.0);
        assert!(parse_outcome_score("<score>maybe</score>").is_err());
        assert!(parse_outcome_score("no idea").is_err());
    }

    #[test]
    fn turn_scores_parse_from_free_text() {
        let reply = "<reasoning>Turn1: format ok, 1 search</reasoning>\n<score>\nTurn1: 0.0\n\
                     Turn 2 = **0.2**\nturn3: -0.5\nTurn4: 1.0\n</score>";
        assert_eq!(
            parse_turn_scores(reply, 4).unwrap(),
            vec![0.0, 0.2, -0.5, 1.0]
        );
        // No score block: parse anywhere, clamp out-of-range values.
        assert_eq!(
            parse_turn_scores("Turn1: 3.5, Turn2: −0.2", 2).unwrap(),
            vec![1.0, -0.2]
        );
        let err = parse_turn_scores("<score>Turn1: 0.1</score>", 3)
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing Turn2, Turn3"), "{err}");
    }

    #[test]
    fn prompts_carry_the_rubric_and_data() {
        let turns = vec![
            "<think>a</think><search>q</search><information>x</information>".to_string(),
            "<think>b</think><answer>Paris</answer>".to_string(),
        ];
        let p = turn_prompt("Capital of France?", &["Paris".into()], &turns);
        assert!(p.contains("Turn1: X.X\nTurn2: X.X\n</score>"));
        assert!(p.contains("Search penalty = Number of searches x (-0.1)"));
        assert!(p.contains("Turn2:\n<think>b</think>"));
        let p = outcome_prompt("Capital of France?", &["Paris".into()], &turns);
        assert!(p.contains("exceeds 5 tokens") && p.contains("### Ground truth\nParis"));
    }

    #[test]
    fn choice_mode_asks_for_the_rubrics_scores() {
        assert_eq!(turn_score_choices(3, 3), vec!["-1.0", "0.2", "1.0"]);
        // Turn 1: format ±, information 0/0.3, 0 or 1 search.
        assert_eq!(
            turn_score_choices(1, 3),
            vec!["0.4", "0.3", "0.1", "0.0", "-0.2", "-0.3"]
        );
        let t2 = turn_score_choices(2, 3);
        assert_eq!(t2.first().unwrap(), "0.4");
        assert_eq!(t2.last().unwrap(), "-0.4");
        assert!(t2.contains(&"0.2".to_string()) && !t2.contains(&"-0.0".to_string()));
        // Far into a long episode the range stops at -1.0.
        assert_eq!(turn_score_choices(12, 13).last().unwrap(), "-1.0");
        assert_eq!(score_prefill(&[]), "<score>\nTurn1: ");
        assert_eq!(
            score_prefill(&["0.1".into(), "-0.2".into()]),
            "<score>\nTurn1: 0.1\nTurn2: -0.2\nTurn3: "
        );
        // The prefilled block with the last score parses like a free reply.
        let done = format!("{}0.2\n</score>", score_prefill(&["0.1".into()]));
        assert_eq!(parse_turn_scores(&done, 2).unwrap(), vec![0.1, 0.2]);
    }

    #[test]
    fn hash_is_stable() {
        assert_eq!(fnv1a_128(b""), 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d);
        assert_ne!(fnv1a_128(b"a"), fnv1a_128(b"b"));
        // FNV-1a 128 of "a" (reference value).
        assert_eq!(fnv1a_128(b"a"), 0xd228_cb69_6f1a_8caf_7891_2b70_4e4a_8964);
    }
}
