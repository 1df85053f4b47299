//! Retries with exponential backoff and jitter around blocking JSON POSTs, shared by the
//! retrieval client, the HTTP environment adapter and the judge client.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use turnwise_core::control::SplitMix64;

/// How often and how patiently to retry a failed request.
///
/// Attempt `i` (0-based) that fails with a retryable error is followed by a sleep of
/// `min(initial_backoff · multiplier^i, max_backoff)` scaled by a uniform jitter factor in
/// `[1 − jitter, 1]` ("equal jitter" when `jitter = 0.5`), so clients that failed together do
/// not retry in lockstep.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Total attempts, the first included (1 = no retry).
    pub max_attempts: u32,
    /// Sleep after the first failure, before jitter.
    pub initial_backoff: Duration,
    /// Upper bound of one sleep, before jitter.
    pub max_backoff: Duration,
    /// Growth factor of the sleep per failure.
    pub multiplier: f64,
    /// Fraction of each sleep that is randomized, in `[0, 1]`.
    pub jitter: f64,
}

impl Default for RetryPolicy {
    /// 5 attempts, 200 ms doubling to at most 5 s, half jitter (about 3 s worst case in sleeps).
    fn default() -> Self {
        Self {
            max_attempts: 5,
            initial_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(5),
            multiplier: 2.0,
            jitter: 0.5,
        }
    }
}

impl RetryPolicy {
    /// A policy with `max_attempts` attempts and a fixed-ratio backoff starting at `initial`.
    pub fn new(max_attempts: u32, initial: Duration) -> Self {
        Self {
            max_attempts,
            initial_backoff: initial,
            ..Self::default()
        }
    }

    /// The sleep after failed attempt `attempt` (0-based), before jitter.
    pub fn base_delay(&self, attempt: u32) -> Duration {
        let factor = self.multiplier.max(1.0).powi(attempt.min(64) as i32);
        let secs =
            (self.initial_backoff.as_secs_f64() * factor).min(self.max_backoff.as_secs_f64());
        Duration::from_secs_f64(secs.max(0.0))
    }

    /// The jittered sleep after failed attempt `attempt`, drawing from `rng`.
    pub fn delay(&self, attempt: u32, rng: &mut SplitMix64) -> Duration {
        let jitter = self.jitter.clamp(0.0, 1.0);
        let scale = 1.0 - jitter * rng.next_f64();
        self.base_delay(attempt).mul_f64(scale)
    }
}

/// A fresh, non-reproducible seed for backoff jitter (time and a process-wide counter).
pub(crate) fn jitter_rng() -> SplitMix64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    SplitMix64::new(nanos ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// Which failures a request may be retried after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Idempotency {
    /// Safe to repeat: retry on connection errors, timeouts, 408, 429 and 5xx.
    Idempotent,
    /// Not safe to repeat (it changes server state): retry only when the connection could not
    /// be made, i.e. the server cannot have seen the request.
    ConnectOnly,
}

/// The last failure of [`post_json`], as text naming the cause.
#[derive(Debug)]
pub struct PostFailure {
    /// What went wrong, with attempt count and elapsed time.
    pub message: String,
}

/// Formats an error and its `source()` chain as `"a: b: c"`.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cur = s.source();
    }
    out
}

/// Extracts a readable message from an error body (our servers' `{"error": {"message"}}`,
/// FastAPI's `{"detail"}`, OpenAI's `{"error": {"message"}}`), else the truncated body.
fn error_body_message(body: &str) -> String {
    if let Ok(v) = serde_json::from_str::<Value>(body) {
        if let Some(m) = v.pointer("/error/message").and_then(Value::as_str) {
            return match v.pointer("/error/field").and_then(Value::as_str) {
                Some(f) => format!("{f}: {m}"),
                None => m.to_owned(),
            };
        }
        if let Some(d) = v.get("detail") {
            return d.to_string();
        }
        if let Some(e) = v.get("error") {
            return e.to_string();
        }
    }
    let trimmed: String = body.chars().take(300).collect();
    if trimmed.len() < body.len() {
        format!("{trimmed}…")
    } else {
        trimmed
    }
}

/// POSTs `body` as JSON to `url` and parses the JSON answer, retrying per `policy`.
///
/// `headers` are extra `(name, value)` pairs (e.g. an authorization header; values are never
/// included in error messages).
pub fn post_json(
    client: &reqwest::blocking::Client,
    url: &str,
    body: &Value,
    headers: &[(&str, String)],
    policy: &RetryPolicy,
    idempotency: Idempotency,
) -> Result<Value, PostFailure> {
    let started = Instant::now();
    let attempts = policy.max_attempts.max(1);
    let mut rng = jitter_rng();
    let mut attempt = 0;
    loop {
        let mut request = client.post(url).json(body);
        for (name, value) in headers {
            request = request.header(*name, value);
        }
        let (message, retryable) = match request.send() {
            Ok(response) => {
                let status = response.status();
                match response.text() {
                    Ok(text) if status.is_success() => match serde_json::from_str(&text) {
                        Ok(v) => return Ok(v),
                        Err(e) => (
                            format!(
                                "answer is not valid JSON ({e}): {}",
                                error_body_message(&text)
                            ),
                            false,
                        ),
                    },
                    Ok(text) => {
                        let retryable = idempotency == Idempotency::Idempotent
                            && (status.is_server_error()
                                || status.as_u16() == 408
                                || status.as_u16() == 429);
                        (
                            format!("HTTP {status}: {}", error_body_message(&text)),
                            retryable,
                        )
                    }
                    Err(e) => (
                        format!("HTTP {status}, cannot read body: {}", error_chain(&e)),
                        idempotency == Idempotency::Idempotent,
                    ),
                }
            }
            Err(e) => {
                let retryable = match idempotency {
                    Idempotency::Idempotent => {
                        e.is_connect() || e.is_timeout() || e.is_request() || e.is_body()
                    }
                    Idempotency::ConnectOnly => e.is_connect(),
                };
                let kind = if e.is_timeout() {
                    "timed out"
                } else if e.is_connect() {
                    "cannot connect"
                } else {
                    "request failed"
                };
                (format!("{kind}: {}", error_chain(&e)), retryable)
            }
        };
        attempt += 1;
        if !retryable || attempt >= attempts {
            return Err(PostFailure {
                message: format!(
                    "{message} (attempt {attempt} of {attempts}, {:.2}s elapsed{})",
                    started.elapsed().as_secs_f64(),
                    if retryable { "" } else { ", not retryable" }
                ),
            });
        }
        let delay = policy.delay(attempt - 1, &mut rng);
        tracing::debug!(url, attempt, ?delay, %message, "request failed, retrying");
        std::thread::sleep(delay);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped() {
        let p = RetryPolicy {
            max_attempts: 10,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(500),
            multiplier: 2.0,
            jitter: 0.5,
        };
        assert_eq!(p.base_delay(0), Duration::from_millis(100));
        assert_eq!(p.base_delay(1), Duration::from_millis(200));
        assert_eq!(p.base_delay(2), Duration::from_millis(400));
        assert_eq!(p.base_delay(3), Duration::from_millis(500));
        assert_eq!(p.base_delay(60), Duration::from_millis(500));
        let mut rng = SplitMix64::new(7);
        for attempt in 0..6 {
            let d = p.delay(attempt, &mut rng);
            let base = p.base_delay(attempt);
            assert!(d <= base && d >= base / 2, "{d:?} vs {base:?}");
        }
    }

    #[test]
    fn error_bodies_are_summarized() {
        assert_eq!(
            error_body_message(r#"{"error": {"field": "topk", "message": "must be at least 1"}}"#),
            "topk: must be at least 1"
        );
        assert_eq!(error_body_message(r#"{"detail": "nope"}"#), "\"nope\"");
        assert_eq!(error_body_message("plain"), "plain");
    }
}
