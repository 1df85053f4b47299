//! Search over a corpus: the [`Retriever`] trait shared by in-process indexes (BM25, dense,
//! hybrid) and the HTTP client of a retrieval server.

pub mod bm25;
pub mod bm25_mem;
pub mod dense;
pub mod format;
pub mod hybrid;

use serde::{Deserialize, Serialize};

/// One corpus document in Search-R1's format: `contents` is `"Title"\ntext`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Document {
    /// Stable document id.
    pub id: String,
    /// `"Title"\ntext`, as in Search-R1's corpus JSON lines.
    pub contents: String,
}

/// One retrieved document with its score (higher is better).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hit {
    /// The retrieved document.
    pub document: Document,
    /// Retrieval score (BM25 score, inner product, or fused score).
    pub score: f32,
}

/// Error from a retriever.
#[derive(Debug, thiserror::Error)]
pub enum RetrievalError {
    /// The index could not be opened, built or read.
    #[error("index error at {path}: {message}")]
    Index {
        /// Index location.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// A query was rejected (empty, too long, unparsable).
    #[error("bad query {query:?}: {message}")]
    BadQuery {
        /// The offending query.
        query: String,
        /// Why it was rejected.
        message: String,
    },
    /// A remote retrieval server failed, timed out or answered malformed data.
    #[error("retrieval server {url}: {message}")]
    Remote {
        /// Server address.
        url: String,
        /// What went wrong.
        message: String,
    },
}

/// Anything that answers a batch of queries with the top-k documents of each.
pub trait Retriever: Send + Sync {
    /// Returns, for each query in order, up to `k` hits sorted by descending score.
    fn retrieve(&self, queries: &[String], k: usize) -> Result<Vec<Vec<Hit>>, RetrievalError>;
}
