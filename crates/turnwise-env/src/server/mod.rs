//! HTTP retrieval server speaking Search-R1's protocol, serving any [`Retriever`].
//!
//! # Protocol
//!
//! `POST /retrieve` with a JSON body
//!
//! ```json
//! {"queries": ["who wrote hamlet", "capital of france"], "topk": 3, "return_scores": true}
//! ```
//!
//! answers `200` with one list per query, in query order, best hit first:
//!
//! ```json
//! {"result": [[{"document": {"id": "12", "contents": "\"Hamlet\"\n..."}, "score": 7.1}], [...]]}
//! ```
//!
//! With `"return_scores": false` (the default, as in Search-R1's `retrieval_server.py`), each
//! per-query list holds the bare documents instead: `{"result": [[{"id": "12", "contents": "..."}]]}`.
//! This mirrors Search-R1 exactly: its endpoint appends `{"document": doc, "score": s}` pairs when
//! scores are requested and the `doc` dicts themselves otherwise.
//!
//! `topk` may be omitted, `null` or `0`, in which case [`ServerConfig::default_topk`] is used
//! (Search-R1's server falls back to its `--topk` for any falsy `topk` the same way). An empty
//! `queries` list answers `{"result": []}`: Search-R1's trainer posts every turn's searches,
//! often none.
//!
//! One request may carry a whole turn of a trainer's searches: Search-R1 sends
//! `train_batch_size × n_agent` queries at once (2,560 with its defaults), so the default
//! [`ServerConfig::max_queries`] is 8,192 and [`ServerConfig::max_body_bytes`] 16 MiB.
//!
//! `GET /health` answers `{"status": "ok"}`.
//!
//! # Errors
//!
//! Every error is JSON: `{"error": {"status": 422, "field": "topk", "message": "..."}}`
//! (`field` is `null` when no single field is at fault).
//!
//! | Case | Status |
//! |---|---|
//! | body is not valid JSON, or not a JSON object | 400 |
//! | missing field, wrong type, `topk` negative, fractional or above [`ServerConfig::max_topk`], too many queries, query too long | 422 |
//! | queries × `topk` above [`ServerConfig::max_results`], or an answer growing past [`ServerConfig::max_response_bytes`] | 422 |
//! | body larger than [`ServerConfig::max_body_bytes`] | 413 |
//! | headers or body not received within [`ServerConfig::read_timeout`] | 408 (body) or connection closed (headers) |
//! | the retriever rejects a query ([`RetrievalError::BadQuery`]) | 422 |
//! | the retriever fails otherwise | 500 |
//! | too many requests already waiting for a retrieval slot | 503 |
//! | unknown path | 404 |
//!
//! Rejected requests are logged at debug level one by one (`RUST_LOG=turnwise_env=debug`), and
//! as one warning at most every ten seconds with the number rejected since the last.
//!
//! # Concurrency
//!
//! HTTP/1.1 with keep-alive. Retrieval runs on tokio's blocking pool (`spawn_blocking`), at most
//! [`ServerConfig::max_in_flight`] retrievals at once; further requests wait for a slot. A
//! connection that does not deliver a request's headers (or its body) within
//! [`ServerConfig::read_timeout`] is closed, so half-open clients are not held forever; the same
//! limit closes idle keep-alive connections.
//!
//! # Example
//!
//! ```no_run
//! use std::sync::Arc;
//! use turnwise_env::search::{Hit, RetrievalError, Retriever};
//! use turnwise_env::server::{BackgroundServer, ServerConfig};
//!
//! struct Empty;
//! impl Retriever for Empty {
//!     fn retrieve(&self, q: &[String], _k: usize) -> Result<Vec<Vec<Hit>>, RetrievalError> {
//!         Ok(vec![Vec::new(); q.len()])
//!     }
//! }
//!
//! let server = BackgroundServer::start(Arc::new(Empty), ServerConfig::default()).unwrap();
//! println!("serving on http://{}", server.local_addr());
//! server.shutdown().unwrap();
//! ```

pub mod openenv;

use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::{Semaphore, oneshot};

use crate::search::{Document, Hit, RetrievalError, Retriever};

/// Settings of a [`RetrievalServer`]: address, request limits, defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerConfig {
    /// Address to bind. Defaults to `127.0.0.1:8000`; use port 0 for an ephemeral port. Binding
    /// anything but a loopback address exposes the corpus to the network: only do it on purpose.
    /// [`resolve_addr`] turns `host:port` (e.g. `localhost:8000`) into one.
    pub addr: SocketAddr,
    /// Largest accepted request body in bytes (larger bodies get 413). Default 16 MiB: a whole
    /// turn of Search-R1 searches (2,560 queries of about 60 characters) is about 0.2 MB, and
    /// 16 MiB still admits 8,192 queries of 2,000 bytes.
    pub max_body_bytes: usize,
    /// Most queries in one request. Default 8,192 (Search-R1 sends `train_batch_size × n_agent`
    /// queries per turn, 2,560 with its defaults).
    pub max_queries: usize,
    /// Largest accepted `topk`. Default 100.
    pub max_topk: usize,
    /// Most results in one answer, queries × `topk` (422 beyond, naming `--max-results`): one
    /// request of 8,192 queries at top-k 100 took 1.7 GB and answered 153 MB. Default
    /// [`DEFAULT_MAX_RESULTS`].
    pub max_results: usize,
    /// Largest answer body in bytes (422 once the answer grows past it, naming
    /// `--max-response-bytes`; long passages make a few results large). Default
    /// [`DEFAULT_MAX_RESPONSE_BYTES`].
    pub max_response_bytes: usize,
    /// `topk` used when the request omits it (or sends `null` or 0). Default 3 (Search-R1's
    /// `--topk`).
    pub default_topk: usize,
    /// Longest accepted query, in characters. Default 4096.
    pub max_query_chars: usize,
    /// Most retrievals running at once on the blocking pool. Default 64.
    pub max_in_flight: usize,
    /// Most requests waiting for a retrieval slot before new ones get 503. Default 4096.
    pub max_queued: usize,
    /// Longest wait for a request's headers (from the moment the connection waits for the next
    /// request, so it also closes idle keep-alive connections) and, separately, for its body.
    /// A connection that misses it is closed (a late body is answered 408 first). Default 30 s.
    pub read_timeout: Duration,
}

/// Default [`ServerConfig::max_queries`].
pub const DEFAULT_MAX_QUERIES: usize = 8192;
/// Default [`ServerConfig::max_body_bytes`].
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 << 20;
/// Default [`ServerConfig::max_results`]: Search-R1's turn (2,560 queries at its top-k 3) six
/// times over, or 163 queries at top-k 100.
pub const DEFAULT_MAX_RESULTS: usize = 16_384;
/// Default [`ServerConfig::max_response_bytes`] (64 MiB: 16,384 passages of 4 KB).
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 64 << 20;
/// Default [`ServerConfig::read_timeout`].
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(30);

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            addr: SocketAddr::from((Ipv4Addr::LOCALHOST, 8000)),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_queries: DEFAULT_MAX_QUERIES,
            max_topk: 100,
            max_results: DEFAULT_MAX_RESULTS,
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            default_topk: 3,
            max_query_chars: 4096,
            max_in_flight: 64,
            max_queued: 4096,
            read_timeout: DEFAULT_READ_TIMEOUT,
        }
    }
}

impl ServerConfig {
    /// The default settings bound to `addr` (e.g. `127.0.0.1:0` in tests).
    pub fn with_addr(addr: SocketAddr) -> Self {
        Self {
            addr,
            ..Self::default()
        }
    }

    fn validate(&self) -> Result<(), ServerError> {
        let bad = |field: &'static str, message: String| ServerError::Config { field, message };
        if self.max_body_bytes == 0 {
            return Err(bad("max_body_bytes", "must be at least 1".into()));
        }
        if self.max_queries == 0 {
            return Err(bad("max_queries", "must be at least 1".into()));
        }
        if self.max_topk == 0 {
            return Err(bad("max_topk", "must be at least 1".into()));
        }
        if self.max_results == 0 {
            return Err(bad("max_results", "must be at least 1".into()));
        }
        if self.max_response_bytes == 0 {
            return Err(bad("max_response_bytes", "must be at least 1".into()));
        }
        if self.default_topk == 0 || self.default_topk > self.max_topk {
            return Err(bad(
                "default_topk",
                format!(
                    "must be in 1..={} (max_topk), got {}",
                    self.max_topk, self.default_topk
                ),
            ));
        }
        if self.max_in_flight == 0 {
            return Err(bad("max_in_flight", "must be at least 1".into()));
        }
        if self.read_timeout.is_zero() {
            return Err(bad("read_timeout", "must be positive".into()));
        }
        Ok(())
    }
}

/// Error starting or stopping a retrieval server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A [`ServerConfig`] field has an unusable value.
    #[error("invalid server config: {field} {message}")]
    Config {
        /// The offending field.
        field: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// A `host:port` address could not be resolved.
    #[error("cannot resolve the address {spec}: {message}")]
    Resolve {
        /// The address as given.
        spec: String,
        /// Why it cannot be resolved.
        message: String,
    },
    /// The address could not be bound.
    #[error("cannot bind the server to {addr}: {cause}")]
    Bind {
        /// Requested address.
        addr: SocketAddr,
        /// Underlying I/O error.
        cause: std::io::Error,
    },
    /// The runtime or server thread could not be started or panicked.
    #[error("server runtime on {addr}: {message}")]
    Runtime {
        /// Requested or bound address.
        addr: SocketAddr,
        /// What went wrong.
        message: String,
    },
}

/// Shared state of the axum handlers.
struct AppState {
    retriever: Arc<dyn Retriever>,
    config: ServerConfig,
    slots: Semaphore,
    waiting: AtomicUsize,
    rejections: RejectionLog,
}

impl AppState {
    /// Logs a rejected request: each at debug level, plus a rate-limited warning with the count.
    fn log_rejection(&self, e: &ApiError) {
        let field = e.field.as_deref().unwrap_or("-");
        tracing::debug!(status = %e.status, field = %field, message = %e.message,
            "rejected /retrieve request");
        if let Some(n) = self.rejections.record(Instant::now()) {
            tracing::warn!(
                rejected = n,
                latest_status = %e.status,
                latest_field = %field,
                latest_message = %e.message,
                "rejected {n} /retrieve request(s) since the last report \
                 (RUST_LOG=turnwise_env::server=debug logs each)"
            );
        }
    }
}

/// How often a warning about rejected requests may be logged.
const REJECTION_WARN_INTERVAL: Duration = Duration::from_secs(10);

/// Counts rejected requests and lets one warning through per interval, so a misbehaving
/// client cannot flood the log.
#[derive(Debug)]
struct RejectionLog {
    interval: Duration,
    /// When the last warning was let through, and the rejections since.
    state: std::sync::Mutex<(Option<Instant>, u64)>,
}

impl RejectionLog {
    fn new(interval: Duration) -> Self {
        Self {
            interval,
            state: std::sync::Mutex::new((None, 0)),
        }
    }

    /// Records one rejection at `now`. Returns the number of rejections to report (this one
    /// included) when a warning is due, `None` while the last one is more recent than the
    /// interval.
    fn record(&self, now: Instant) -> Option<u64> {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        state.1 += 1;
        match state.0 {
            Some(last) if now.saturating_duration_since(last) < self.interval => None,
            _ => {
                state.0 = Some(now);
                Some(std::mem::take(&mut state.1))
            }
        }
    }
}

/// Decrements the waiting-request counter when a request stops waiting (served or cancelled).
struct WaitGuard<'a>(&'a AtomicUsize);

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A JSON error response: `{"error": {"status", "field", "message"}}`.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    field: Option<String>,
    message: String,
    /// Close the connection after answering (the body was not read to its end).
    close: bool,
}

impl ApiError {
    fn new(status: StatusCode, field: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            status,
            field: field.map(str::to_owned),
            message: message.into(),
            close: false,
        }
    }

    fn closing(self) -> Self {
        Self {
            close: true,
            ..self
        }
    }

    fn invalid(field: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, Some(field), message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "error": {
                "status": self.status.as_u16(),
                "field": self.field,
                "message": self.message,
            }
        });
        let mut response = (self.status, axum::Json(body)).into_response();
        if self.close {
            response.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
        }
        response
    }
}

/// A validated `/retrieve` request.
#[derive(Debug)]
struct RetrieveRequest {
    queries: Vec<String>,
    topk: usize,
    return_scores: bool,
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Parses and validates a `/retrieve` body, naming the offending field on failure.
fn parse_request(body: &[u8], config: &ServerConfig) -> Result<RetrieveRequest, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            None,
            format!("request body is not valid JSON: {e}"),
        )
    })?;
    let Value::Object(obj) = value else {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            None,
            format!(
                "request body must be a JSON object with \"queries\", got {}",
                json_type(&value)
            ),
        ));
    };

    let queries = match obj.get("queries") {
        None => return Err(ApiError::invalid("queries", "missing required field")),
        Some(Value::Array(items)) => {
            if items.len() > config.max_queries {
                return Err(ApiError::invalid(
                    "queries",
                    format!(
                        "too many queries: {} (limit {}; raise it with `turnwise serve-retriever \
                         --max-queries N`, ServerConfig::max_queries)",
                        items.len(),
                        config.max_queries
                    ),
                ));
            }
            let mut queries = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let field = format!("queries[{i}]");
                let Value::String(q) = item else {
                    return Err(ApiError::invalid(
                        &field,
                        format!("must be a string, got {}", json_type(item)),
                    ));
                };
                let chars = q.chars().count();
                if chars > config.max_query_chars {
                    return Err(ApiError::invalid(
                        &field,
                        format!(
                            "query too long: {chars} characters (limit {})",
                            config.max_query_chars
                        ),
                    ));
                }
                queries.push(q.clone());
            }
            queries
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "queries",
                format!("must be an array of strings, got {}", json_type(other)),
            ));
        }
    };

    let topk = match obj.get("topk") {
        // Search-R1 falls back to its default for any falsy topk: absent, null or 0.
        None | Some(Value::Null) => config.default_topk,
        Some(Value::Number(n)) => match n.as_u64() {
            Some(0) => config.default_topk,
            Some(k) if k as usize > config.max_topk || k > usize::MAX as u64 => {
                return Err(ApiError::invalid(
                    "topk",
                    format!("must be at most {}, got {k}", config.max_topk),
                ));
            }
            Some(k) => k as usize,
            None => {
                return Err(ApiError::invalid(
                    "topk",
                    format!(
                        "must be an integer in 0..={} (0 for the default), got {n}",
                        config.max_topk
                    ),
                ));
            }
        },
        Some(other) => {
            return Err(ApiError::invalid(
                "topk",
                format!("must be an integer or null, got {}", json_type(other)),
            ));
        }
    };

    let return_scores = match obj.get("return_scores") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(ApiError::invalid(
                "return_scores",
                format!("must be a boolean, got {}", json_type(other)),
            ));
        }
    };

    let results = queries.len().saturating_mul(topk);
    if results > config.max_results {
        return Err(ApiError::invalid(
            "topk",
            format!(
                "{} queries × topk {topk} = {results} results, more than one answer may hold \
                 ({}; send fewer queries or a smaller topk, or raise the limit with `turnwise \
                 serve-retriever --max-results N`, ServerConfig::max_results)",
                queries.len(),
                config.max_results
            ),
        ));
    }

    Ok(RetrieveRequest {
        queries,
        topk,
        return_scores,
    })
}

/// A `Vec<u8>` that refuses to grow past `limit` bytes (the answer's size cap).
struct CappedBuffer {
    bytes: Vec<u8>,
    limit: usize,
}

impl std::io::Write for CappedBuffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len() + buf.len() > self.limit {
            return Err(std::io::Error::other("answer too large"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `{"result": lists}` as JSON bytes, or a 422 naming `--max-response-bytes` once it grows past
/// `limit`. Written straight from the hits, without a JSON tree in between.
fn answer_bytes<T: Serialize>(lists: &[Vec<T>], limit: usize) -> Result<Vec<u8>, ApiError> {
    #[derive(Serialize)]
    struct Answer<'a, T> {
        result: &'a [Vec<T>],
    }
    let mut out = CappedBuffer {
        bytes: Vec::new(),
        limit,
    };
    match serde_json::to_writer(&mut out, &Answer { result: lists }) {
        Ok(()) => Ok(out.bytes),
        Err(e) if e.is_io() => {
            let results: usize = lists.iter().map(Vec::len).sum();
            Err(ApiError::invalid(
                "topk",
                format!(
                    "the answer ({} queries, {results} results) grows past {limit} bytes \
                     (send fewer queries or a smaller topk, or raise the limit with `turnwise \
                     serve-retriever --max-response-bytes N`, ServerConfig::max_response_bytes)",
                    lists.len()
                ),
            ))
        }
        Err(e) => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            None,
            format!("encoding the answer: {e}"),
        )),
    }
}

/// One entry of a `return_scores: true` answer.
#[derive(Serialize)]
struct ScoredDocument {
    document: Document,
    score: f32,
}

async fn retrieve_handler(
    State(state): State<Arc<AppState>>,
    request: Request,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let body = read_body(&state, request).await?;
    let request = parse_request(&body, &state.config).inspect_err(|e| state.log_rejection(e))?;
    if request.queries.is_empty() {
        // Search-R1's trainer posts every turn, searches or not; its server answers this.
        return Ok(axum::Json(json!({ "result": [] })).into_response());
    }
    let _permit = acquire_slot(&state).await?;
    let (n_queries, topk, return_scores) =
        (request.queries.len(), request.topk, request.return_scores);
    let body = answer(&state, request).await?;
    tracing::debug!(
        queries = n_queries,
        topk,
        return_scores,
        elapsed_ms = started.elapsed().as_secs_f64() * 1e3,
        "served /retrieve"
    );
    Ok((
        [(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response())
}

/// The request's body, within the body limit and the read timeout (a declared length above
/// the limit is refused before any byte is read).
async fn read_body(state: &AppState, request: Request) -> Result<Bytes, ApiError> {
    let timeout = state.config.read_timeout;
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            None,
            format!(
                "request body exceeds the limit of {} bytes (raise it with `turnwise \
                 serve-retriever --max-body-bytes N`, ServerConfig::max_body_bytes)",
                state.config.max_body_bytes
            ),
        )
        .closing()
    };
    // A declared length above the limit is answered at once, not after waiting for a body
    // that will be refused anyway (or that never comes).
    let declared = request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > state.config.max_body_bytes as u64) {
        let e = too_large();
        state.log_rejection(&e);
        return Err(e);
    }
    match tokio::time::timeout(timeout, Bytes::from_request(request, &())).await {
        Ok(Ok(body)) => Ok(body),
        Ok(Err(rejection)) => {
            let status = rejection.status();
            let e = if status == StatusCode::PAYLOAD_TOO_LARGE {
                too_large()
            } else {
                ApiError::new(
                    status,
                    None,
                    format!("cannot read request body: {}", rejection.body_text()),
                )
            };
            state.log_rejection(&e);
            Err(e)
        }
        Err(_) => {
            let e = ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                None,
                format!(
                    "request body not received within {:.1} s (the server's read timeout)",
                    timeout.as_secs_f64()
                ),
            )
            .closing();
            state.log_rejection(&e);
            Err(e)
        }
    }
}

/// A slot among the server's `max_in_flight` retrievals, waiting for one when they are all
/// taken unless `max_queued` requests already wait.
async fn acquire_slot(state: &AppState) -> Result<tokio::sync::SemaphorePermit<'_>, ApiError> {
    match state.slots.try_acquire() {
        Ok(permit) => Ok(permit),
        Err(_) => {
            let waiting = state.waiting.fetch_add(1, Ordering::SeqCst);
            let _guard = WaitGuard(&state.waiting);
            if waiting >= state.config.max_queued {
                let e = ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    None,
                    format!("retrieval server overloaded: {waiting} requests already waiting"),
                );
                state.log_rejection(&e);
                return Err(e);
            }
            state.slots.acquire().await.map_err(|_| {
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    None,
                    "retrieval server is shutting down",
                )
            })
        }
    }
}

/// The retriever's answer to `request`, encoded within the response limit, on the blocking
/// pool (retrieval and encoding are both CPU work).
async fn answer(state: &AppState, request: RetrieveRequest) -> Result<Vec<u8>, ApiError> {
    let n_queries = request.queries.len();
    let topk = request.topk;
    let retriever = Arc::clone(&state.retriever);
    let RetrieveRequest {
        queries,
        return_scores,
        ..
    } = request;
    let limit = state.config.max_response_bytes;
    let answered = tokio::task::spawn_blocking(move || -> Result<Vec<u8>, AnswerError> {
        let hits = retriever
            .retrieve(&queries, topk)
            .map_err(AnswerError::Retrieval)?;
        drop(queries);
        if hits.len() != n_queries {
            return Err(AnswerError::Api(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                None,
                format!(
                    "retriever returned {} result lists for {n_queries} queries",
                    hits.len()
                ),
            )));
        }
        if return_scores {
            let lists: Vec<Vec<ScoredDocument>> = hits
                .into_iter()
                .map(|list| {
                    list.into_iter()
                        .take(topk)
                        .map(|Hit { document, score }| ScoredDocument { document, score })
                        .collect()
                })
                .collect();
            answer_bytes(&lists, limit).map_err(AnswerError::Api)
        } else {
            let lists: Vec<Vec<Document>> = hits
                .into_iter()
                .map(|list| list.into_iter().take(topk).map(|h| h.document).collect())
                .collect();
            answer_bytes(&lists, limit).map_err(AnswerError::Api)
        }
    })
    .await
    .map_err(|e| {
        tracing::error!(error = %e, "retriever panicked");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            None,
            format!("retriever panicked: {e}"),
        )
    })?;
    match answered {
        Ok(body) => Ok(body),
        Err(AnswerError::Retrieval(e @ RetrievalError::BadQuery { .. })) => {
            let e = ApiError::invalid("queries", e.to_string());
            state.log_rejection(&e);
            Err(e)
        }
        Err(AnswerError::Retrieval(e)) => {
            tracing::error!(error = %e, "retrieval failed");
            Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                None,
                e.to_string(),
            ))
        }
        Err(AnswerError::Api(e)) => {
            state.log_rejection(&e);
            Err(e)
        }
    }
}

/// Why an answer could not be made on the blocking pool.
enum AnswerError {
    /// The retriever failed.
    Retrieval(RetrievalError),
    /// Anything else, as its HTTP answer.
    Api(ApiError),
}

async fn health_handler() -> axum::Json<Value> {
    axum::Json(json!({"status": "ok"}))
}

async fn not_found_handler(uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        None,
        format!("no route for {uri}; use POST /retrieve or GET /health"),
    )
}

/// The retrieval server's routes, for embedding in another axum application.
pub struct RetrievalServer;

impl RetrievalServer {
    /// Builds the router (`POST /retrieve`, `GET /health`) serving `retriever` under `config`'s
    /// limits. `config.addr` is ignored here; see [`serve`] and [`BackgroundServer`].
    pub fn router(retriever: Arc<dyn Retriever>, config: ServerConfig) -> Router {
        let limit = config.max_body_bytes;
        let state = Arc::new(AppState {
            retriever,
            slots: Semaphore::new(config.max_in_flight),
            waiting: AtomicUsize::new(0),
            rejections: RejectionLog::new(REJECTION_WARN_INTERVAL),
            config,
        });
        Router::new()
            .route("/retrieve", post(retrieve_handler))
            .route("/health", get(health_handler))
            .fallback(not_found_handler)
            .layer(DefaultBodyLimit::max(limit))
            .with_state(state)
    }
}

/// Binds `addr` and returns the listener with its actual address (port 0 resolved).
async fn bind(addr: SocketAddr) -> Result<(tokio::net::TcpListener, SocketAddr), ServerError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|cause| ServerError::Bind { addr, cause })?;
    let addr = listener
        .local_addr()
        .map_err(|cause| ServerError::Bind { addr, cause })?;
    Ok((listener, addr))
}

/// Serves `retriever` on `config.addr` from inside a tokio runtime until `shutdown` resolves,
/// then finishes in-flight requests and returns. `on_bound` receives the bound address (useful
/// with port 0).
pub async fn serve(
    retriever: Arc<dyn Retriever>,
    config: ServerConfig,
    on_bound: impl FnOnce(SocketAddr),
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    config.validate()?;
    let (addr, read_timeout) = (config.addr, config.read_timeout);
    let app = RetrievalServer::router(retriever, config);
    serve_router("retrieval", app, addr, read_timeout, on_bound, shutdown).await
}

/// Serves any axum `app` on `addr` (HTTP/1.1, keep-alive, a header read timeout of
/// `read_timeout` per connection) until `shutdown` resolves, then finishes in-flight requests
/// and returns. `name` says which server it is in logs and errors; `on_bound` receives the bound
/// address. The retrieval server and the policy server (`turnwise serve`) both run on it.
pub async fn serve_router(
    name: &'static str,
    app: Router,
    addr: SocketAddr,
    read_timeout: Duration,
    on_bound: impl FnOnce(SocketAddr),
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let (listener, addr) = bind(addr).await?;
    if !addr.ip().is_loopback() {
        tracing::warn!(%addr, "{name} server bound to a non-loopback address");
    }
    tracing::info!(%addr, "{name} server listening");
    on_bound(addr);
    serve_connections(listener, app, read_timeout, shutdown).await;
    tracing::info!(%addr, "{name} server stopped");
    Ok(())
}

/// Accepts connections and serves `app` on each (HTTP/1.1) until `shutdown` resolves; then
/// stops accepting, lets every connection finish its request in flight and waits for them.
///
/// Unlike `axum::serve`, every connection gets a header read timeout (hyper's, which also
/// closes idle keep-alive connections); the body read timeout is the handler's.
async fn serve_connections(
    listener: tokio::net::TcpListener,
    app: Router,
    read_timeout: Duration,
    shutdown: impl Future<Output = ()>,
) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(read_timeout);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(());
    let mut connections = tokio::task::JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) if is_connection_error(&e) => continue,
                Err(e) => {
                    // Typically out of file descriptors: wait for connections to close.
                    tracing::error!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        while connections.try_join_next().is_some() {}
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(%peer, error = %e, "cannot set TCP_NODELAY");
        }
        // With upgrades: the OpenEnv server's `/ws` sessions (server/openenv.rs) are WebSockets.
        let connection = http
            .serve_connection(
                hyper_util::rt::TokioIo::new(stream),
                hyper_util::service::TowerToHyperService::new(app.clone()),
            )
            .with_upgrades();
        let mut stop = stop_rx.clone();
        connections.spawn(async move {
            let mut connection = std::pin::pin!(connection);
            let result = tokio::select! {
                result = connection.as_mut() => result,
                _ = stop.changed() => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(e) = result {
                tracing::debug!(%peer, error = %e, "connection closed");
            }
        });
    }
    drop(listener);
    drop(stop_rx);
    let _ = stop_tx.send(());
    while connections.join_next().await.is_some() {}
}

/// Accept errors that concern one connection only (the next accept may succeed at once).
fn is_connection_error(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}

/// Resolves `host:port` to the address to bind: an IP address as it is, a host name (such as
/// `localhost:8000`) to its first IPv4 address, or its first address when it has no IPv4 one
/// (IPv4 first, as uvicorn binds, so that clients of `127.0.0.1` reach a server started on
/// `localhost`).
pub fn resolve_addr(spec: &str) -> Result<SocketAddr, ServerError> {
    if let Ok(addr) = spec.parse() {
        return Ok(addr);
    }
    let failed = |message: String| ServerError::Resolve {
        spec: spec.to_owned(),
        message,
    };
    let addrs: Vec<SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(spec)
        .map_err(|e| failed(format!("{e} (expected HOST:PORT, e.g. 127.0.0.1:8000)")))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or_else(|| addrs.first())
        .copied()
        .ok_or_else(|| failed("the name has no addresses".into()))
}

/// A server (the retrieval server, or any router via [`BackgroundServer::start_router`])
/// running on its own thread and tokio runtime, for synchronous callers (the rollout engine,
/// tests). Dropping it shuts the server down and waits for it.
pub struct BackgroundServer {
    addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), ServerError>>>,
}

impl BackgroundServer {
    /// Binds `config.addr`, starts serving `retriever` in the background and returns once the
    /// socket is bound (so requests to [`Self::local_addr`] succeed immediately).
    pub fn start(retriever: Arc<dyn Retriever>, config: ServerConfig) -> Result<Self, ServerError> {
        config.validate()?;
        let (addr, read_timeout) = (config.addr, config.read_timeout);
        let app = RetrievalServer::router(retriever, config);
        Self::start_router("retrieval", app, addr, read_timeout)
    }

    /// Binds `addr`, starts serving any axum `app` in the background (see [`serve_router`]) and
    /// returns once the socket is bound.
    pub fn start_router(
        name: &'static str,
        app: Router,
        addr: SocketAddr,
        read_timeout: Duration,
    ) -> Result<Self, ServerError> {
        let requested = addr;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(format!("turnwise-{name}"))
            .enable_all()
            .build()
            .map_err(|e| ServerError::Runtime {
                addr: requested,
                message: format!("cannot build tokio runtime: {e}"),
            })?;
        let (bound_tx, bound_rx) = std::sync::mpsc::channel();
        let (shutdown_tx, shutdown_rx) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("turnwise-{name}-server"))
            .spawn(move || {
                runtime.block_on(async move {
                    let bound_err_tx = bound_tx.clone();
                    let result = serve_router(
                        name,
                        app,
                        addr,
                        read_timeout,
                        move |addr| {
                            let _ = bound_tx.send(Ok(addr));
                        },
                        async move {
                            let _ = shutdown_rx.await;
                        },
                    )
                    .await;
                    if let Err(ServerError::Bind { addr, cause }) = &result {
                        let _ = bound_err_tx.send(Err(ServerError::Bind {
                            addr: *addr,
                            cause: std::io::Error::new(cause.kind(), cause.to_string()),
                        }));
                    }
                    result
                })
            })
            .map_err(|e| ServerError::Runtime {
                addr: requested,
                message: format!("cannot spawn server thread: {e}"),
            })?;
        match bound_rx.recv_timeout(Duration::from_secs(30)) {
            Ok(Ok(addr)) => Ok(Self {
                addr,
                shutdown: Some(shutdown_tx),
                thread: Some(thread),
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                // The thread ended (or hung) without binding: report its own error if it has one.
                drop(shutdown_tx);
                match thread.join() {
                    Ok(Err(e)) => Err(e),
                    _ => Err(ServerError::Runtime {
                        addr: requested,
                        message: "server thread did not report a bound address".into(),
                    }),
                }
            }
        }
    }

    /// The bound address (with the actual port when the config asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ip:port`, the base URL a client should use.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting connections, lets in-flight requests finish, and waits for the server
    /// thread. Returns the server's error if it failed while running.
    pub fn shutdown(mut self) -> Result<(), ServerError> {
        self.stop()
    }

    fn stop(&mut self) -> Result<(), ServerError> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        match self.thread.take() {
            Some(thread) => thread.join().map_err(|_| ServerError::Runtime {
                addr: self.addr,
                message: "server thread panicked".into(),
            })?,
            None => Ok(()),
        }
    }
}

impl Drop for BackgroundServer {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::error!(error = %e, "server shutdown failed");
        }
    }
}

impl std::fmt::Debug for BackgroundServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackgroundServer")
            .field("addr", &self.addr)
            .field("running", &self.thread.is_some())
            .finish()
    }
}

/// A small in-memory retriever scoring documents by query-term overlap (count of distinct
/// lowercase alphanumeric query terms found in the document, ties broken by document order).
///
/// Not a search engine: it exists so the server, client and environments can be exercised and
/// demonstrated without building an index.
#[derive(Debug, Clone, Default)]
pub struct TermOverlapRetriever {
    docs: Vec<(Document, std::collections::HashSet<String>)>,
}

impl TermOverlapRetriever {
    /// Indexes `docs` (kept in order; earlier documents win ties).
    pub fn new(docs: Vec<Document>) -> Self {
        let docs = docs
            .into_iter()
            .map(|d| {
                let terms = terms(&d.contents).collect();
                (d, terms)
            })
            .collect();
        Self { docs }
    }
}

fn terms(text: &str) -> impl Iterator<Item = String> + '_ {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|t| !t.is_empty())
        .map(str::to_lowercase)
}

impl Retriever for TermOverlapRetriever {
    fn retrieve(&self, queries: &[String], k: usize) -> Result<Vec<Vec<Hit>>, RetrievalError> {
        queries
            .iter()
            .map(|q| {
                let query_terms: std::collections::HashSet<String> = terms(q).collect();
                if query_terms.is_empty() {
                    return Err(RetrievalError::BadQuery {
                        query: q.clone(),
                        message: "query has no searchable terms".into(),
                    });
                }
                let mut scored: Vec<(usize, usize)> = self
                    .docs
                    .iter()
                    .enumerate()
                    .map(|(i, (_, t))| (i, query_terms.iter().filter(|q| t.contains(*q)).count()))
                    .filter(|&(_, s)| s > 0)
                    .collect();
                scored.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
                Ok(scored
                    .into_iter()
                    .take(k)
                    .map(|(i, s)| Hit {
                        document: self.docs[i].0.clone(),
                        score: s as f32,
                    })
                    .collect())
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ServerConfig {
        ServerConfig {
            max_queries: 3,
            max_topk: 10,
            max_query_chars: 20,
            ..ServerConfig::default()
        }
    }

    fn err(body: &str) -> ApiError {
        parse_request(body.as_bytes(), &cfg()).unwrap_err()
    }

    #[test]
    fn parses_defaults_like_search_r1() {
        let r = parse_request(br#"{"queries": ["a b"]}"#, &cfg()).unwrap();
        assert_eq!(r.queries, vec!["a b".to_string()]);
        assert_eq!(r.topk, 3);
        assert!(!r.return_scores);
        let r = parse_request(
            br#"{"queries": ["x"], "topk": null, "return_scores": true}"#,
            &cfg(),
        )
        .unwrap();
        assert_eq!(r.topk, 3);
        assert!(r.return_scores);
        // Search-R1's server treats a falsy topk (0) as "the default".
        let r = parse_request(br#"{"queries": ["x"], "topk": 0}"#, &cfg()).unwrap();
        assert_eq!(r.topk, 3);
        // A turn without searches: an empty list is a valid request.
        let r = parse_request(br#"{"queries": [], "topk": 3}"#, &cfg()).unwrap();
        assert!(r.queries.is_empty());
    }

    #[test]
    fn errors_name_the_field() {
        assert_eq!(err("{").status, StatusCode::BAD_REQUEST);
        assert_eq!(err("[1]").status, StatusCode::BAD_REQUEST);
        let e = err(r#"{"topk": 3}"#);
        assert_eq!(
            (e.status, e.field.as_deref()),
            (StatusCode::UNPROCESSABLE_ENTITY, Some("queries"))
        );
        assert_eq!(err(r#"{"queries": "a"}"#).field.as_deref(), Some("queries"));
        assert_eq!(
            err(r#"{"queries": ["a", 3]}"#).field.as_deref(),
            Some("queries[1]")
        );
        assert_eq!(
            err(r#"{"queries": ["a","b","c","d"]}"#).field.as_deref(),
            Some("queries")
        );
        assert_eq!(
            err(r#"{"queries": ["aaaaaaaaaaaaaaaaaaaaaaaaa"]}"#)
                .field
                .as_deref(),
            Some("queries[0]")
        );
        for topk in ["11", "-1", "2.5", "\"3\"", "true", "[]"] {
            let e = err(&format!(r#"{{"queries": ["a"], "topk": {topk}}}"#));
            assert_eq!(e.field.as_deref(), Some("topk"), "topk {topk}");
        }
        let e = err(r#"{"queries": ["a"], "return_scores": "yes"}"#);
        assert_eq!(e.field.as_deref(), Some("return_scores"));
    }

    #[test]
    fn limit_errors_say_how_to_raise_the_limit() {
        let e = err(r#"{"queries": ["a","b","c","d"]}"#);
        assert!(
            e.message.contains("too many queries: 4 (limit 3"),
            "{}",
            e.message
        );
        assert!(e.message.contains("--max-queries"), "{}", e.message);
    }

    #[test]
    fn rejection_warnings_are_rate_limited() {
        let log = RejectionLog::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(log.record(t0), Some(1), "the first rejection warns at once");
        assert_eq!(log.record(t0 + Duration::from_secs(1)), None);
        assert_eq!(log.record(t0 + Duration::from_secs(9)), None);
        // The next warning counts the suppressed ones too.
        assert_eq!(log.record(t0 + Duration::from_secs(10)), Some(3));
        assert_eq!(log.record(t0 + Duration::from_secs(11)), None);
        assert_eq!(log.record(t0 + Duration::from_secs(25)), Some(2));
    }

    #[test]
    fn addresses_resolve_host_names() {
        assert_eq!(
            resolve_addr("127.0.0.1:8000").unwrap(),
            SocketAddr::from(([127, 0, 0, 1], 8000))
        );
        assert_eq!(resolve_addr("[::1]:0").unwrap().port(), 0);
        let local = resolve_addr("localhost:8123").unwrap();
        assert!(local.ip().is_loopback(), "{local}");
        assert_eq!(local.port(), 8123);
        for bad in ["localhost", "127.0.0.1", "no-such-host.invalid:80", ":80"] {
            let e = resolve_addr(bad).unwrap_err().to_string();
            assert!(e.contains(bad), "{e}");
        }
    }

    #[test]
    fn config_validation() {
        let c = ServerConfig {
            default_topk: 200,
            ..ServerConfig::default()
        };
        assert!(matches!(
            c.validate(),
            Err(ServerError::Config {
                field: "default_topk",
                ..
            })
        ));
        let c = ServerConfig {
            read_timeout: Duration::ZERO,
            ..ServerConfig::default()
        };
        assert!(matches!(
            c.validate(),
            Err(ServerError::Config {
                field: "read_timeout",
                ..
            })
        ));
        assert!(ServerConfig::default().validate().is_ok());
        assert!(ServerConfig::default().max_queries >= 2560);
        assert!(ServerConfig::default().addr.ip().is_loopback());
    }

    #[test]
    fn term_overlap_ranks_by_shared_terms() {
        let r = TermOverlapRetriever::new(vec![
            Document {
                id: "0".into(),
                contents: "\"Paris\"\nParis is the capital of France".into(),
            },
            Document {
                id: "1".into(),
                contents: "\"Berlin\"\nBerlin is the capital of Germany".into(),
            },
        ]);
        let hits = r
            .retrieve(&["capital of Germany".to_string()], 5)
            .unwrap()
            .remove(0);
        assert_eq!(hits.len(), 2);
        assert_eq!(hits[0].document.id, "1");
        assert_eq!(hits[0].score, 3.0);
        assert!(r.retrieve(&["?!".to_string()], 1).is_err());
    }
}
