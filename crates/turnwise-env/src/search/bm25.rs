//! BM25 over a corpus with tantivy, indexed once on disk and reopened fast.
//!
//! The index is a directory holding a tantivy index and a marker file
//! ([`MARKER_FILE`], written last, so its presence means the build completed). Each document
//! stores its `id` and `contents` verbatim; the indexed field is `title + " " + text` (see
//! [`super::bm25_mem::indexed_text`]) tokenised by tantivy's default tokenizer (split on
//! non-alphanumeric characters, lowercase, drop tokens of 40 bytes or more; frequencies only, no
//! positions).
//!
//! Scoring is tantivy's BM25: `k1 = 1.2`, `b = 0.75`, Lucene IDF `ln(1 + (N − n + 0.5)/(n + 0.5))`,
//! document lengths quantised to one byte. Queries are never parsed as a query language: they are
//! tokenised with the same analyzer and turned into a disjunction of term queries (repeated words
//! count repeatedly), so any user text (quotes, colons, brackets, `AND`) is accepted; a query
//! without any token returns no hits. Hits with score 0 are dropped.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tantivy::collector::TopDocs;
use tantivy::query::{BooleanQuery, Occur, Query, TermQuery};
use tantivy::schema::{
    Field, IndexRecordOption, STORED, STRING, Schema, TextFieldIndexing, TextOptions, Value,
};
use tantivy::tokenizer::TextAnalyzer;
use tantivy::{DocAddress, Index, IndexReader, ReloadPolicy, TantivyDocument, Term};

use super::bm25_mem::indexed_text;
use super::{Document, Hit, RetrievalError, Retriever};

/// Name of the marker file written into the index directory once a build has completed.
pub const MARKER_FILE: &str = "turnwise-bm25.json";
const FORMAT_VERSION: u32 = 1;
const ID_FIELD: &str = "id";
const CONTENTS_FIELD: &str = "contents";
const BODY_FIELD: &str = "body";

/// Settings for building an index.
#[derive(Debug, Clone)]
pub struct Bm25BuildOptions {
    /// Indexing threads. Each thread fills its own segments and segments are merged at the end;
    /// with one thread (the default) documents keep the corpus order, so equal scores always rank
    /// in corpus order and results are reproducible across builds. More threads build faster on
    /// big corpora but may order tied documents differently from one build to the next.
    pub threads: usize,
    /// Total indexing memory budget in bytes (tantivy needs at least 15 MB per thread).
    pub memory_budget: usize,
}

impl Default for Bm25BuildOptions {
    fn default() -> Self {
        Bm25BuildOptions {
            threads: 1,
            memory_budget: 256_000_000,
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Marker {
    format_version: u32,
    num_docs: u64,
}

/// Indexes of at most this many documents keep the stored documents in memory after opening
/// (see [`Bm25Index::open_with_cache`]).
pub const DOC_CACHE_MAX_DOCS: u64 = 200_000;

/// A BM25 index on disk (tantivy). Cheap to share between threads; implements [`Retriever`].
pub struct Bm25Index {
    path: PathBuf,
    reader: IndexReader,
    /// Stored documents per segment, when cached in memory.
    cache: Option<Vec<Vec<Document>>>,
    analyzer: TextAnalyzer,
    id: Field,
    contents: Field,
    body: Field,
    num_docs: u64,
}

impl std::fmt::Debug for Bm25Index {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bm25Index")
            .field("path", &self.path)
            .field("num_docs", &self.num_docs)
            .finish()
    }
}

fn index_err(path: &Path, message: impl std::fmt::Display) -> RetrievalError {
    RetrievalError::Index {
        path: path.display().to_string(),
        message: message.to_string(),
    }
}

fn schema() -> Schema {
    let mut builder = Schema::builder();
    builder.add_text_field(ID_FIELD, STRING | STORED);
    builder.add_text_field(CONTENTS_FIELD, STORED);
    let body = TextOptions::default().set_indexing_options(
        TextFieldIndexing::default()
            .set_tokenizer("default")
            .set_index_option(IndexRecordOption::WithFreqs),
    );
    builder.add_text_field(BODY_FIELD, body);
    builder.build()
}

impl Bm25Index {
    /// Builds an index of `docs` in `dir` (created if missing; must not already hold an index)
    /// and opens it.
    pub fn build<'a>(
        dir: impl AsRef<Path>,
        docs: impl IntoIterator<Item = &'a Document>,
        options: &Bm25BuildOptions,
    ) -> Result<Self, RetrievalError> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|e| index_err(dir, e))?;
        if dir.join("meta.json").exists() || dir.join(MARKER_FILE).exists() {
            return Err(index_err(
                dir,
                "directory already holds an index; open it or remove it first",
            ));
        }
        let index = Index::create_in_dir(dir, schema()).map_err(|e| index_err(dir, e))?;
        let schema = index.schema();
        let field = |name| schema.get_field(name).expect("field of our schema");
        let (id, contents, body) = (field(ID_FIELD), field(CONTENTS_FIELD), field(BODY_FIELD));
        let threads = options.threads.max(1);
        let budget = options.memory_budget.max(15_000_000 * threads);
        let mut writer = index
            .writer_with_num_threads::<TantivyDocument>(threads, budget)
            .map_err(|e| index_err(dir, e))?;
        let mut num_docs = 0u64;
        for d in docs {
            let mut doc = TantivyDocument::default();
            doc.add_text(id, &d.id);
            doc.add_text(contents, &d.contents);
            doc.add_text(body, indexed_text(d));
            writer.add_document(doc).map_err(|e| index_err(dir, e))?;
            num_docs += 1;
        }
        writer.commit().map_err(|e| index_err(dir, e))?;
        let segments = index
            .searchable_segment_ids()
            .map_err(|e| index_err(dir, e))?;
        if segments.len() > 1 {
            writer
                .merge(&segments)
                .wait()
                .map_err(|e| index_err(dir, format!("merging segments: {e}")))?;
        }
        writer
            .wait_merging_threads()
            .map_err(|e| index_err(dir, e))?;
        let marker = Marker {
            format_version: FORMAT_VERSION,
            num_docs,
        };
        let marker_path = dir.join(MARKER_FILE);
        std::fs::write(
            &marker_path,
            serde_json::to_vec(&marker).expect("marker serialises"),
        )
        .map_err(|e| index_err(&marker_path, e))?;
        Self::open(dir)
    }

    /// Opens an index built by [`Bm25Index::build`]. Stored documents are kept in memory when
    /// the index has at most [`DOC_CACHE_MAX_DOCS`] documents (hits then skip the compressed
    /// document store); larger indexes read hits from disk.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, RetrievalError> {
        Self::open_with_cache(dir, None)
    }

    /// Opens an index, choosing whether stored documents are cached in memory (`None`: cache
    /// when the index has at most [`DOC_CACHE_MAX_DOCS`] documents).
    pub fn open_with_cache(
        dir: impl AsRef<Path>,
        cache_documents: Option<bool>,
    ) -> Result<Self, RetrievalError> {
        let dir = dir.as_ref();
        let marker_path = dir.join(MARKER_FILE);
        let marker_bytes = std::fs::read(&marker_path).map_err(|e| {
            index_err(
                dir,
                format!("not a complete turnwise BM25 index ({MARKER_FILE}: {e})"),
            )
        })?;
        let marker: Marker = serde_json::from_slice(&marker_bytes)
            .map_err(|e| index_err(&marker_path, format!("malformed marker: {e}")))?;
        if marker.format_version != FORMAT_VERSION {
            return Err(index_err(
                &marker_path,
                format!(
                    "format version {} (this build reads {FORMAT_VERSION}); rebuild the index",
                    marker.format_version
                ),
            ));
        }
        let index = Index::open_in_dir(dir).map_err(|e| index_err(dir, e))?;
        let schema = index.schema();
        let field = |name: &str| {
            schema
                .get_field(name)
                .map_err(|_| index_err(dir, format!("schema lacks field {name:?}")))
        };
        let (id, contents, body) = (field(ID_FIELD)?, field(CONTENTS_FIELD)?, field(BODY_FIELD)?);
        let analyzer = index
            .tokenizer_for_field(body)
            .map_err(|e| index_err(dir, e))?;
        let reader = index
            .reader_builder()
            .reload_policy(ReloadPolicy::Manual)
            .try_into()
            .map_err(|e| index_err(dir, e))?;
        let mut index = Bm25Index {
            path: dir.to_path_buf(),
            reader,
            cache: None,
            analyzer,
            id,
            contents,
            body,
            num_docs: marker.num_docs,
        };
        if cache_documents.unwrap_or(marker.num_docs <= DOC_CACHE_MAX_DOCS) {
            index.cache = Some(index.load_documents()?);
        }
        Ok(index)
    }

    /// Reads every stored document, per segment, in document order.
    fn load_documents(&self) -> Result<Vec<Vec<Document>>, RetrievalError> {
        let searcher = self.reader.searcher();
        let mut out = Vec::new();
        for (ord, segment) in searcher.segment_readers().iter().enumerate() {
            let mut docs = Vec::with_capacity(segment.max_doc() as usize);
            for doc_id in 0..segment.max_doc() {
                docs.push(self.fetch(&searcher, DocAddress::new(ord as u32, doc_id))?);
            }
            out.push(docs);
        }
        Ok(out)
    }

    fn fetch(
        &self,
        searcher: &tantivy::Searcher,
        addr: DocAddress,
    ) -> Result<Document, RetrievalError> {
        if let Some(cache) = &self.cache {
            return Ok(cache[addr.segment_ord as usize][addr.doc_id as usize].clone());
        }
        let doc: TantivyDocument = searcher
            .doc(addr)
            .map_err(|e| index_err(&self.path, format!("reading stored document: {e}")))?;
        let text = |f: Field| {
            doc.get_first(f)
                .and_then(|v| v.as_str())
                .unwrap_or_default()
                .to_string()
        };
        Ok(Document {
            id: text(self.id),
            contents: text(self.contents),
        })
    }

    /// Whether stored documents are cached in memory.
    pub fn caches_documents(&self) -> bool {
        self.cache.is_some()
    }

    /// Opens the index in `dir` if a complete one is there, else builds it from `docs()`.
    pub fn open_or_build<I, F>(
        dir: impl AsRef<Path>,
        docs: F,
        options: &Bm25BuildOptions,
    ) -> Result<Self, RetrievalError>
    where
        F: FnOnce() -> I,
        I: IntoIterator,
        I::Item: std::borrow::Borrow<Document>,
    {
        let dir = dir.as_ref();
        if dir.join(MARKER_FILE).is_file() {
            return Self::open(dir);
        }
        let owned: Vec<I::Item> = docs().into_iter().collect();
        Self::build(dir, owned.iter().map(std::borrow::Borrow::borrow), options)
    }

    /// The index directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of indexed documents.
    pub fn num_docs(&self) -> u64 {
        self.num_docs
    }

    fn query_for(&self, query: &str) -> Option<Box<dyn Query>> {
        let mut analyzer = self.analyzer.clone();
        let mut stream = analyzer.token_stream(query);
        let mut terms: Vec<Box<dyn Query>> = Vec::new();
        while stream.advance() {
            let term = Term::from_field_text(self.body, &stream.token().text);
            terms.push(Box::new(TermQuery::new(term, IndexRecordOption::WithFreqs)));
        }
        match terms.len() {
            0 => None,
            1 => terms.pop(),
            _ => Some(Box::new(BooleanQuery::new(
                terms.into_iter().map(|q| (Occur::Should, q)).collect(),
            ))),
        }
    }

    fn search_with(
        &self,
        searcher: &tantivy::Searcher,
        query: &str,
        k: usize,
    ) -> Result<Vec<Hit>, RetrievalError> {
        if k == 0 {
            return Ok(Vec::new());
        }
        let Some(q) = self.query_for(query) else {
            return Ok(Vec::new());
        };
        let top: Vec<(f32, DocAddress)> = searcher
            .search(&q, &TopDocs::with_limit(k).order_by_score())
            .map_err(|e| RetrievalError::BadQuery {
                query: query.to_string(),
                message: e.to_string(),
            })?;
        let mut hits = Vec::with_capacity(top.len());
        for (score, addr) in top {
            if score <= 0.0 {
                continue;
            }
            hits.push(Hit {
                document: self.fetch(searcher, addr)?,
                score,
            });
        }
        Ok(hits)
    }

    /// Top `k` hits for one query, by descending BM25 score (score-0 documents dropped).
    pub fn search(&self, query: &str, k: usize) -> Result<Vec<Hit>, RetrievalError> {
        self.search_with(&self.reader.searcher(), query, k)
    }
}

/// Batches of at least this many queries are split across threads.
const PARALLEL_BATCH: usize = 32;

impl Retriever for Bm25Index {
    /// Answers the batch; batches of 32 or more queries run on all available cores.
    fn retrieve(&self, queries: &[String], k: usize) -> Result<Vec<Vec<Hit>>, RetrievalError> {
        let searcher = self.reader.searcher();
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        if queries.len() < PARALLEL_BATCH || threads == 1 {
            return queries
                .iter()
                .map(|q| self.search_with(&searcher, q, k))
                .collect();
        }
        let chunk = queries.len().div_ceil(threads);
        let parts: Vec<Result<Vec<Vec<Hit>>, RetrievalError>> = std::thread::scope(|s| {
            let handles: Vec<_> = queries
                .chunks(chunk)
                .map(|part| {
                    let searcher = &searcher;
                    s.spawn(move || {
                        part.iter()
                            .map(|q| self.search_with(searcher, q, k))
                            .collect::<Result<Vec<_>, _>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("search thread panicked"))
                .collect()
        });
        let mut out = Vec::with_capacity(queries.len());
        for part in parts {
            out.extend(part?);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::corpus::join_contents;
    use crate::search::bm25_mem::InMemoryBm25;

    fn docs() -> Vec<Document> {
        [
            (
                "Paris",
                "Paris is the capital of France. Paris has the Louvre.",
            ),
            (
                "France",
                "France is a country in Europe. Its capital is Paris.",
            ),
            ("Berlin", "Berlin is the capital of Germany."),
            ("Rust", "Rust is a systems programming language."),
            (
                "Tantivy",
                "Tantivy is a search engine library written in Rust.",
            ),
        ]
        .iter()
        .enumerate()
        .map(|(i, (t, x))| Document {
            id: format!("d{i}"),
            contents: join_contents(t, x),
        })
        .collect()
    }

    #[test]
    fn build_search_reopen_and_agree_with_in_memory_bm25() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("idx");
        let corpus = docs();
        let opts = Bm25BuildOptions {
            threads: 2,
            memory_budget: 40_000_000,
        };
        let index = Bm25Index::build(&path, &corpus, &opts).unwrap();
        assert_eq!(index.num_docs(), 5);
        let queries: Vec<String> = [
            "capital of France",
            "rust search",
            "Paris",
            "what is tantivy?",
            "nothing-matches-xyzzy",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let first = index.retrieve(&queries, 3).unwrap();
        assert_eq!(first[0][0].document.id, "d0");
        assert_eq!(first[1][0].document.id, "d4");
        assert_eq!(first[3][0].document.id, "d4");
        assert!(first[4].is_empty());
        assert!(first.iter().flatten().all(|h| h.score > 0.0));
        for hits in &first {
            assert!(hits.windows(2).all(|w| w[0].score >= w[1].score));
            assert!(hits.len() <= 3);
        }
        assert_eq!(first[0][0].document, corpus[0]);

        // Same ranking as the in-memory implementation (scores differ only through tantivy's
        // one-byte length quantisation).
        let mem = InMemoryBm25::new(corpus.clone());
        let mem_hits = mem.retrieve(&queries, 3).unwrap();
        for (a, b) in first.iter().zip(&mem_hits) {
            let ids = |h: &Vec<Hit>| h.iter().map(|x| x.document.id.clone()).collect::<Vec<_>>();
            assert_eq!(ids(a), ids(b));
            for (x, y) in a.iter().zip(b) {
                assert!((x.score - y.score).abs() < 0.05 * y.score, "{x:?} vs {y:?}");
            }
        }

        // Building twice into the same directory is refused; reopening gives the same results.
        drop(index);
        assert!(Bm25Index::build(&path, &corpus, &opts).is_err());
        let reopened = Bm25Index::open(&path).unwrap();
        assert_eq!(reopened.retrieve(&queries, 3).unwrap(), first);
        let via = Bm25Index::open_or_build(&path, || -> Vec<Document> { panic!("rebuilt") }, &opts)
            .unwrap();
        assert_eq!(via.retrieve(&queries, 3).unwrap(), first);
        let uncached = Bm25Index::open_with_cache(&path, Some(false)).unwrap();
        assert!(reopened.caches_documents() && !uncached.caches_documents());
        assert_eq!(uncached.retrieve(&queries, 3).unwrap(), first);
    }

    #[test]
    fn arbitrary_user_text_never_errors() {
        let dir = tempfile::tempdir().unwrap();
        let index = Bm25Index::build(dir.path(), &docs(), &Bm25BuildOptions::default()).unwrap();
        let nasty = [
            "",
            "   ",
            "\"unbalanced",
            "title:Paris AND (",
            "+-!(){}[]^\"~*?:\\/ OR NOT",
            "Paris^3 Rust~2",
            "日本語 テキスト",
            &"a".repeat(10_000),
            "body:rust",
        ];
        for q in nasty {
            let hits = index.search(q, 3).unwrap();
            assert!(hits.iter().all(|h| h.score > 0.0), "{q}");
        }
        assert_eq!(index.search("body:rust", 3).unwrap()[0].document.id, "d3");
        assert!(index.search("Paris", 0).unwrap().is_empty());
        // A large batch goes through the threaded path and keeps the order.
        let batch: Vec<String> = (0..100)
            .map(|i| if i % 2 == 0 { "Berlin" } else { "Rust" }.to_string())
            .collect();
        let out = index.retrieve(&batch, 1).unwrap();
        assert_eq!(out.len(), 100);
        for (i, hits) in out.iter().enumerate() {
            assert_eq!(hits[0].document.id, if i % 2 == 0 { "d2" } else { "d3" });
        }
    }

    #[test]
    fn open_rejects_a_directory_without_index() {
        let dir = tempfile::tempdir().unwrap();
        let err = Bm25Index::open(dir.path()).unwrap_err();
        assert!(err.to_string().contains(MARKER_FILE), "{err}");
    }
}
