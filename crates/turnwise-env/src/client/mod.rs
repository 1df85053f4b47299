//! Blocking HTTP client of a Search-R1-compatible retrieval server, as a [`Retriever`].
//!
//! [`HttpRetriever`] posts `{"queries", "topk", "return_scores": true}` to `{base}/retrieve`
//! (see [`crate::server`] for the protocol) and reads back `{"result": [[{"document", "score"}]]}`.
//! Servers that ignore `return_scores` and answer bare documents are accepted too; their hits get
//! score `0.0` and keep the server's order.
//!
//! Failures that may be transient (connection refused or reset, timeouts, HTTP 408/429/5xx) are
//! retried with exponential backoff and jitter ([`RetryPolicy`]); so the client rides out a
//! server restart. Client errors (other 4xx) and malformed answers are not retried. After the
//! last attempt the error is [`RetrievalError::Remote`] with the endpoint URL and the cause.
//!
//! The client is blocking (the rollout engine is synchronous). Like every
//! `reqwest::blocking` client it must not be called from inside an async task; use
//! `tokio::task::spawn_blocking` there.

mod retry;

use std::time::Duration;

use serde::Deserialize;
use serde_json::json;

pub use retry::RetryPolicy;
pub use retry::{Idempotency, PostFailure, error_chain, post_json};

use crate::search::{Document, Hit, RetrievalError, Retriever};

/// Timeouts and retries of an HTTP client.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientConfig {
    /// Limit for one whole request (connect, send, wait, read). Default 30 s.
    pub timeout: Duration,
    /// Limit for establishing the TCP connection. Default 5 s.
    pub connect_timeout: Duration,
    /// Retry policy for transient failures.
    pub retry: RetryPolicy,
    /// Whether to honour `HTTP_PROXY`/`HTTPS_PROXY`/`NO_PROXY`. Default `false`: retrieval and
    /// environment servers normally live on the local host or network, where a proxy is wrong.
    pub use_system_proxy: bool,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            retry: RetryPolicy::default(),
            use_system_proxy: false,
        }
    }
}

impl ClientConfig {
    /// Builds the underlying blocking reqwest client.
    pub fn build_client(&self) -> Result<reqwest::blocking::Client, reqwest::Error> {
        let mut builder = reqwest::blocking::Client::builder()
            .timeout(self.timeout)
            .connect_timeout(self.connect_timeout)
            .pool_idle_timeout(Duration::from_secs(30))
            .user_agent(concat!("turnwise-env/", env!("CARGO_PKG_VERSION")));
        if !self.use_system_proxy {
            builder = builder.no_proxy();
        }
        builder.build()
    }
}

/// A random 32-bit value (time-seeded), for session ids.
pub(crate) fn random_nonce() -> u32 {
    (retry::jitter_rng().next_u64() >> 32) as u32
}

/// Normalizes a base URL (`http://host:port`, with or without trailing slash or a path prefix)
/// and appends `path`.
pub fn join_url(base: &str, path: &str) -> String {
    format!(
        "{}/{}",
        base.trim_end_matches('/'),
        path.trim_start_matches('/')
    )
}

/// A [`Retriever`] that asks a remote retrieval server over HTTP.
#[derive(Debug, Clone)]
pub struct HttpRetriever {
    base_url: String,
    retrieve_url: String,
    config: ClientConfig,
    client: reqwest::blocking::Client,
}

/// One entry of a server answer: scored (`return_scores: true`) or a bare document.
#[derive(Deserialize)]
#[serde(untagged)]
enum Entry {
    Scored { document: Document, score: f32 },
    Bare(Document),
}

#[derive(Deserialize)]
struct RetrieveAnswer {
    result: Vec<Vec<Entry>>,
}

impl HttpRetriever {
    /// A client of the server at `base_url` (e.g. `http://127.0.0.1:8000`) with default
    /// timeouts and retries. Search-R1's own endpoint URL (`http://127.0.0.1:8000/retrieve`, its
    /// `retriever.url`) is accepted too and means the same server.
    pub fn new(base_url: &str) -> Result<Self, RetrievalError> {
        Self::with_config(base_url, ClientConfig::default())
    }

    /// A client of the server at `base_url` with the given timeouts and retries.
    pub fn with_config(base_url: &str, config: ClientConfig) -> Result<Self, RetrievalError> {
        let remote = |message: String| RetrievalError::Remote {
            url: base_url.to_owned(),
            message,
        };
        if !(base_url.starts_with("http://") || base_url.starts_with("https://")) {
            return Err(remote(
                "base URL must start with http:// or https://".into(),
            ));
        }
        let client = config
            .build_client()
            .map_err(|e| remote(format!("cannot build HTTP client: {}", error_chain(&e))))?;
        let base = base_url.trim_end_matches('/');
        let base = base.strip_suffix("/retrieve").unwrap_or(base);
        Ok(Self {
            base_url: base.to_owned(),
            retrieve_url: join_url(base, "retrieve"),
            config,
            client,
        })
    }

    /// The server's base URL.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// The client's settings.
    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    /// `GET {base}/health` once (no retry): the URL and the status the server answered; a
    /// connection that fails is an error.
    fn get_health(&self) -> Result<(String, reqwest::StatusCode), RetrievalError> {
        let url = join_url(&self.base_url, "health");
        let response = self
            .client
            .get(&url)
            .send()
            .map_err(|e| RetrievalError::Remote {
                url: url.clone(),
                message: error_chain(&e),
            })?;
        Ok((url, response.status()))
    }

    /// Checks `GET {base}/health` once (no retry); `Ok` when the server answers 2xx.
    pub fn health(&self) -> Result<(), RetrievalError> {
        let (url, status) = self.get_health()?;
        if status.is_success() {
            Ok(())
        } else {
            Err(RetrievalError::Remote {
                url,
                message: format!("HTTP {status}"),
            })
        }
    }
}

impl HttpRetriever {
    /// Checks once, before any search is needed, that a retrieval server answers at the base
    /// URL: `GET /health` (turnwise's server), or, where the server has no such route
    /// (Search-R1's reference server has only `/retrieve`: 404 or 405), one query through
    /// `POST /retrieve` whose answer must have Search-R1's shape. A refused connection or a
    /// timeout fails at once: the caller reports it at startup.
    pub fn check(&self) -> Result<(), RetrievalError> {
        let (url, status) = self.get_health()?;
        if status.is_success() {
            return Ok(());
        }
        if matches!(status.as_u16(), 404 | 405) {
            tracing::debug!(%url, %status, "no /health route; checking with one /retrieve query");
            let hits = self.retrieve(&["health check".to_owned()], 1)?;
            return match hits.len() {
                1 => Ok(()),
                n => Err(RetrievalError::Remote {
                    url: self.retrieve_url.clone(),
                    message: format!("malformed answer: {n} result lists for 1 query"),
                }),
            };
        }
        Err(RetrievalError::Remote {
            url,
            message: format!("HTTP {status}"),
        })
    }
}

impl Retriever for HttpRetriever {
    fn retrieve(&self, queries: &[String], k: usize) -> Result<Vec<Vec<Hit>>, RetrievalError> {
        if queries.is_empty() {
            return Ok(Vec::new());
        }
        if k == 0 {
            return Ok(vec![Vec::new(); queries.len()]);
        }
        let remote = |message: String| RetrievalError::Remote {
            url: self.retrieve_url.clone(),
            message,
        };
        let body = json!({"queries": queries, "topk": k, "return_scores": true});
        let value = post_json(
            &self.client,
            &self.retrieve_url,
            &body,
            &[],
            &self.config.retry,
            Idempotency::Idempotent,
        )
        .map_err(|f| remote(f.message))?;
        let answer: RetrieveAnswer = serde_json::from_value(value).map_err(|e| {
            remote(format!(
                "malformed answer, expected {{\"result\": [[{{\"document\": {{\"id\", \"contents\"}}, \"score\"}}]]}}: {e}"
            ))
        })?;
        if answer.result.len() != queries.len() {
            return Err(remote(format!(
                "malformed answer: {} result lists for {} queries",
                answer.result.len(),
                queries.len()
            )));
        }
        Ok(answer
            .result
            .into_iter()
            .map(|list| {
                list.into_iter()
                    .take(k)
                    .map(|entry| match entry {
                        Entry::Scored { document, score } => Hit { document, score },
                        Entry::Bare(document) => Hit {
                            document,
                            score: 0.0,
                        },
                    })
                    .collect()
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_joined() {
        assert_eq!(join_url("http://h:1/", "/retrieve"), "http://h:1/retrieve");
        assert_eq!(join_url("http://h:1/api", "step"), "http://h:1/api/step");
        assert!(matches!(
            HttpRetriever::new("localhost:8000"),
            Err(RetrievalError::Remote { .. })
        ));
        // Search-R1's endpoint URL names the same server as the base URL.
        for url in [
            "http://h:1",
            "http://h:1/",
            "http://h:1/retrieve",
            "http://h:1/retrieve/",
        ] {
            let c = HttpRetriever::new(url).unwrap();
            assert_eq!(
                (c.base_url(), c.retrieve_url.as_str()),
                ("http://h:1", "http://h:1/retrieve")
            );
        }
    }

    #[test]
    fn answers_with_and_without_scores_parse() {
        let scored: RetrieveAnswer = serde_json::from_str(
            r#"{"result": [[{"document": {"id": "1", "contents": "a"}, "score": 2.5}]]}"#,
        )
        .unwrap();
        assert!(matches!(&scored.result[0][0], Entry::Scored { score, .. } if *score == 2.5));
        let bare: RetrieveAnswer =
            serde_json::from_str(r#"{"result": [[{"id": "1", "contents": "a", "title": "t"}]]}"#)
                .unwrap();
        assert!(matches!(&bare.result[0][0], Entry::Bare(d) if d.id == "1"));
    }
}
