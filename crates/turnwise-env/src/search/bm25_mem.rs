//! A pure in-memory BM25 index for tiny corpora and tests.
//!
//! Scoring is Okapi BM25 with `k1 = 1.2`, `b = 0.75` and the **Lucene / tantivy IDF**
//! `ln(1 + (N − n + 0.5) / (n + 0.5))` (always positive), times `(k1 + 1)` as tantivy does:
//!
//! ```text
//! score(q, d) = Σ_{t ∈ q} idf(t) · tf(t,d) · (k1 + 1) / (tf(t,d) + k1 · (1 − b + b · |d| / avgdl))
//! ```
//!
//! Query terms are summed with repetition (a word twice in the query counts twice), as in
//! `rank_bm25`. Unlike `rank_bm25`'s `BM25Okapi` (IDF `ln((N − n + 0.5)/(n + 0.5))` with an
//! epsilon floor), the IDF never goes negative, so a term in more than half of the documents still
//! helps. Document lengths are exact (tantivy quantises them to one byte), so scores can differ
//! from [`super::bm25::Bm25Index`] in the last digits. Both index `title + " " + text` and use
//! [`tokenize`].

use std::collections::HashMap;

use super::{Document, Hit, RetrievalError, Retriever};
use crate::corpus::split_contents;

/// BM25 term-frequency saturation.
pub const K1: f32 = 1.2;
/// BM25 length normalisation.
pub const B: f32 = 0.75;
/// Tokens this long (in bytes) or longer are dropped, as tantivy's default tokenizer does.
pub const MAX_TOKEN_BYTES: usize = 40;

/// Tantivy's default tokenisation: split on every non-alphanumeric character (Unicode), lowercase,
/// drop tokens of [`MAX_TOKEN_BYTES`] bytes or more.
///
/// ```
/// assert_eq!(turnwise_env::search::bm25_mem::tokenize("Zorvak Telim's Corp!"),
///            vec!["zorvak", "telim", "s", "corp"]);
/// ```
pub fn tokenize(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|t| !t.is_empty() && t.len() < MAX_TOKEN_BYTES)
        .map(str::to_lowercase)
        .collect()
}

/// The text that BM25 indexes for a document: title and text joined by a space.
pub fn indexed_text(doc: &Document) -> String {
    let (title, text) = split_contents(&doc.contents);
    format!("{title} {text}")
}

/// In-memory inverted index with BM25 scoring (see the module docs for the exact formula).
#[derive(Debug, Clone)]
pub struct InMemoryBm25 {
    docs: Vec<Document>,
    doc_len: Vec<u32>,
    avgdl: f32,
    /// term → (document index, term frequency), sorted by document index.
    postings: HashMap<String, Vec<(u32, u32)>>,
}

impl InMemoryBm25 {
    /// Indexes the documents (title + text).
    pub fn new(docs: Vec<Document>) -> Self {
        let mut postings: HashMap<String, Vec<(u32, u32)>> = HashMap::new();
        let mut doc_len = Vec::with_capacity(docs.len());
        for (i, doc) in docs.iter().enumerate() {
            let tokens = tokenize(&indexed_text(doc));
            doc_len.push(tokens.len() as u32);
            let mut tf: HashMap<String, u32> = HashMap::new();
            for t in tokens {
                *tf.entry(t).or_insert(0) += 1;
            }
            for (t, n) in tf {
                postings.entry(t).or_default().push((i as u32, n));
            }
        }
        let total: u64 = doc_len.iter().map(|&l| u64::from(l)).sum();
        let avgdl = if docs.is_empty() {
            1.0
        } else {
            (total as f32 / docs.len() as f32).max(1e-6)
        };
        InMemoryBm25 {
            docs,
            doc_len,
            avgdl,
            postings,
        }
    }

    /// Number of indexed documents.
    pub fn len(&self) -> usize {
        self.docs.len()
    }

    /// Whether the index holds no documents.
    pub fn is_empty(&self) -> bool {
        self.docs.is_empty()
    }

    /// The Lucene-style IDF of a (lowercased) term; 0 for an unknown term.
    pub fn idf(&self, term: &str) -> f32 {
        let n = self.postings.get(term).map_or(0, Vec::len) as f32;
        if n == 0.0 {
            return 0.0;
        }
        let big_n = self.docs.len() as f32;
        (1.0 + (big_n - n + 0.5) / (n + 0.5)).ln()
    }

    /// Top `k` hits of one query, descending score, ties broken by document order; documents
    /// with score 0 are never returned.
    pub fn search(&self, query: &str, k: usize) -> Vec<Hit> {
        let mut scores: HashMap<u32, f32> = HashMap::new();
        for term in tokenize(query) {
            let Some(list) = self.postings.get(&term) else {
                continue;
            };
            let idf = self.idf(&term);
            for &(doc, tf) in list {
                let tf = tf as f32;
                let norm = K1 * (1.0 - B + B * self.doc_len[doc as usize] as f32 / self.avgdl);
                *scores.entry(doc).or_insert(0.0) += idf * tf * (K1 + 1.0) / (tf + norm);
            }
        }
        let mut ranked: Vec<(u32, f32)> = scores.into_iter().filter(|&(_, s)| s > 0.0).collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        ranked.truncate(k);
        ranked
            .into_iter()
            .map(|(doc, score)| Hit {
                document: self.docs[doc as usize].clone(),
                score,
            })
            .collect()
    }
}

impl Retriever for InMemoryBm25 {
    fn retrieve(&self, queries: &[String], k: usize) -> Result<Vec<Vec<Hit>>, RetrievalError> {
        Ok(queries.iter().map(|q| self.search(q, k)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::corpus::join_contents;

    fn doc(id: &str, title: &str, text: &str) -> Document {
        Document {
            id: id.into(),
            contents: join_contents(title, text),
        }
    }

    #[test]
    fn scores_match_hand_computation() {
        let index = InMemoryBm25::new(vec![
            doc("0", "Cat", "the cat sat"),
            doc("1", "Dog", "the dog ran far away"),
            doc("2", "Bird", "a bird"),
        ]);
        // Indexed lengths: 4, 6, 3 -> avgdl 13/3.
        let hits = index.search("cat", 10);
        assert_eq!(hits.len(), 1);
        let idf = (1.0f32 + (3.0 - 1.0 + 0.5) / 1.5).ln();
        let norm = K1 * (1.0 - B + B * 4.0 / (13.0 / 3.0));
        let expected = idf * 2.0 * (K1 + 1.0) / (2.0 + norm);
        assert!((hits[0].score - expected).abs() < 1e-5, "{hits:?}");
        // Unknown words, punctuation-only and empty queries give no hits, never an error.
        assert!(index.search("zebra", 3).is_empty());
        assert!(index.search("  !!! ", 3).is_empty());
        let out = index.retrieve(&["".into(), "the".into()], 5).unwrap();
        assert!(out[0].is_empty());
        assert_eq!(out[1].len(), 2);
        // The shorter document wins on an equal term frequency.
        assert_eq!(out[1][0].document.id, "0");
    }
}
