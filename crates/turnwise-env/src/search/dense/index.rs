//! A flat (exact) inner-product index over unit-norm passage embeddings, on disk and mapped.
//!
//! # Layout
//!
//! An index is a directory with three files:
//!
//! - [`EMBEDDINGS_FILE`]: a 64-byte header — magic `TWDENSE1`, format version (`u32`), `dim`
//!   (`u32`), row count (`u64`), zeros — then `count × dim` little-endian `f32`, row `i` being the
//!   embedding of document `i`. Reopening memory-maps it (memmap2); nothing is copied.
//! - [`DOCS_FILE`]: the documents as a Search-R1 corpus (`{"id", "contents"}` JSON lines), row
//!   order; read into memory when opened.
//! - [`MARKER_FILE`]: JSON `{format_version, num_docs, dim, model}`, written last, so its presence
//!   means the build completed.
//!
//! A document is embedded as `title + " " + text` ([`super::super::bm25_mem::indexed_text`], the
//! same text BM25 indexes).
//!
//! # Search
//!
//! Scores are inner products (= cosine similarities) computed by blocked matrix products
//! (`gemm`, runtime-dispatched SIMD) of the query batch against [`BLOCK_ROWS`] rows at a time,
//! keeping a top-k per query. Hits are sorted by descending score; equal scores rank in corpus
//! order. Results are exact and deterministic.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use serde::{Deserialize, Serialize};

use super::DenseError;
use super::encoder::{Embeddings, SentenceEncoder};
use crate::corpus::{read_corpus, write_corpus};
use crate::search::bm25_mem::indexed_text;
use crate::search::{Document, Hit, RetrievalError, Retriever};

/// The embedding matrix file.
pub const EMBEDDINGS_FILE: &str = "embeddings.f32";
/// The documents sidecar.
pub const DOCS_FILE: &str = "docs.jsonl";
/// The completion marker, written last.
pub const MARKER_FILE: &str = "turnwise-dense.json";
/// Magic bytes opening [`EMBEDDINGS_FILE`].
pub const MAGIC: &[u8; 8] = b"TWDENSE1";
/// Size of the header of [`EMBEDDINGS_FILE`] in bytes.
pub const HEADER_BYTES: usize = 64;
/// Document rows scored per matrix product.
pub const BLOCK_ROWS: usize = 4096;
const FORMAT_VERSION: u32 = 1;

/// Settings for building an index.
#[derive(Debug, Clone, PartialEq)]
pub struct DenseBuildOptions {
    /// Documents encoded per call to the encoder (bounds memory on big corpora). Default 4096.
    pub chunk_docs: usize,
}

impl Default for DenseBuildOptions {
    fn default() -> Self {
        DenseBuildOptions { chunk_docs: 4096 }
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Marker {
    format_version: u32,
    num_docs: u64,
    dim: u32,
    model: String,
}

/// A flat dense index: memory-mapped embeddings, documents in memory, and the encoder for
/// queries. Cheap to share between threads; implements [`Retriever`].
pub struct DenseIndex {
    dir: PathBuf,
    encoder: Arc<SentenceEncoder>,
    mmap: Mmap,
    docs: Vec<Document>,
    dim: usize,
}

impl std::fmt::Debug for DenseIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DenseIndex")
            .field("dir", &self.dir)
            .field("num_docs", &self.docs.len())
            .field("dim", &self.dim)
            .finish()
    }
}

fn model_name(encoder: &SentenceEncoder) -> String {
    encoder
        .model_dir()
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn header(dim: usize, count: usize) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[..8].copy_from_slice(MAGIC);
    h[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&(dim as u32).to_le_bytes());
    h[16..24].copy_from_slice(&(count as u64).to_le_bytes());
    h
}

fn write_rows(w: &mut impl Write, rows: &[f32]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(rows.len() * 4);
    for x in rows {
        buf.extend_from_slice(&x.to_le_bytes());
    }
    w.write_all(&buf)
}

impl DenseIndex {
    /// Encodes `docs` with `encoder`, writes the index into `dir` (created if missing; must not
    /// already hold a completed index: files of an interrupted build are replaced) and opens it.
    pub fn build(
        dir: impl AsRef<Path>,
        docs: &[Document],
        encoder: Arc<SentenceEncoder>,
        options: &DenseBuildOptions,
    ) -> Result<Self, DenseError> {
        let dir = dir.as_ref();
        let chunk = options.chunk_docs.max(1);
        Self::write_with(dir, docs, encoder.dim(), &model_name(&encoder), |w| {
            for part in docs.chunks(chunk) {
                let texts: Vec<String> = part.iter().map(indexed_text).collect();
                let emb = encoder.encode(&texts)?;
                write_rows(w, &emb.data).map_err(|e| DenseError::io(dir, e))?;
            }
            Ok(())
        })?;
        Self::open(dir, encoder)
    }

    /// Writes an index of `docs` with precomputed `embeddings` (row `i` for document `i`, unit
    /// norm for cosine scores) into `dir`, recording `model` as the encoder's name. Open it with
    /// [`Self::open`].
    pub fn write(
        dir: impl AsRef<Path>,
        docs: &[Document],
        embeddings: &Embeddings,
        model: &str,
    ) -> Result<(), DenseError> {
        let dir = dir.as_ref();
        if embeddings.len() != docs.len() || embeddings.data.len() != docs.len() * embeddings.dim {
            return Err(DenseError::format(
                dir,
                format!(
                    "{} documents but {} embedding values of width {}",
                    docs.len(),
                    embeddings.data.len(),
                    embeddings.dim
                ),
            ));
        }
        Self::write_with(dir, docs, embeddings.dim, model, |w| {
            write_rows(w, &embeddings.data).map_err(|e| DenseError::io(dir, e))
        })
    }

    fn write_with(
        dir: &Path,
        docs: &[Document],
        dim: usize,
        model: &str,
        rows: impl FnOnce(&mut BufWriter<File>) -> Result<(), DenseError>,
    ) -> Result<(), DenseError> {
        if dim == 0 || dim > u32::MAX as usize {
            return Err(DenseError::format(dir, format!("bad dimension {dim}")));
        }
        std::fs::create_dir_all(dir).map_err(|e| DenseError::io(dir, e))?;
        // A completed index is never overwritten; leftovers of an interrupted build (no marker)
        // are.
        if dir.join(MARKER_FILE).exists() {
            return Err(DenseError::format(
                dir,
                "directory already holds a dense index",
            ));
        }
        let emb_path = dir.join(EMBEDDINGS_FILE);
        let file = File::create(&emb_path).map_err(|e| DenseError::io(&emb_path, e))?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        w.write_all(&header(dim, docs.len()))
            .map_err(|e| DenseError::io(&emb_path, e))?;
        rows(&mut w)?;
        let file = w
            .into_inner()
            .map_err(|e| DenseError::io(&emb_path, e.into_error()))?;
        let expected = (HEADER_BYTES + docs.len() * dim * 4) as u64;
        let len = file
            .metadata()
            .map_err(|e| DenseError::io(&emb_path, e))?
            .len();
        if len != expected {
            return Err(DenseError::format(
                &emb_path,
                format!("wrote {len} bytes, expected {expected}"),
            ));
        }
        file.sync_all().map_err(|e| DenseError::io(&emb_path, e))?;
        write_corpus(dir.join(DOCS_FILE), docs).map_err(|e| DenseError::format(dir, e))?;
        let marker = Marker {
            format_version: FORMAT_VERSION,
            num_docs: docs.len() as u64,
            dim: dim as u32,
            model: model.to_string(),
        };
        let path = dir.join(MARKER_FILE);
        std::fs::write(
            &path,
            serde_json::to_vec(&marker).expect("marker serialises"),
        )
        .map_err(|e| DenseError::io(&path, e))
    }

    /// Opens a built index, mapping its embeddings; `encoder` (which must have the index's
    /// dimension) encodes the queries.
    pub fn open(dir: impl AsRef<Path>, encoder: Arc<SentenceEncoder>) -> Result<Self, DenseError> {
        if cfg!(target_endian = "big") {
            return Err(DenseError::format(
                dir.as_ref(),
                "dense indexes store little-endian f32 and need a little-endian machine",
            ));
        }
        let dir = dir.as_ref();
        let marker_path = dir.join(MARKER_FILE);
        let marker_text = std::fs::read_to_string(&marker_path).map_err(|e| {
            DenseError::format(dir, format!("no completed index ({MARKER_FILE}: {e})"))
        })?;
        let marker: Marker =
            serde_json::from_str(&marker_text).map_err(|e| DenseError::format(&marker_path, e))?;
        if marker.format_version != FORMAT_VERSION {
            return Err(DenseError::format(
                dir,
                format!(
                    "format version {} (this build reads {FORMAT_VERSION})",
                    marker.format_version
                ),
            ));
        }
        let dim = marker.dim as usize;
        if dim != encoder.dim() {
            return Err(DenseError::Dimension {
                expected: dim,
                got: encoder.dim(),
            });
        }
        if marker.model != model_name(&encoder) {
            tracing::warn!(index = %marker.model, encoder = %model_name(&encoder),
                "dense index was built with another encoder folder");
        }
        let emb_path = dir.join(EMBEDDINGS_FILE);
        let file = File::open(&emb_path).map_err(|e| DenseError::io(&emb_path, e))?;
        // SAFETY: the file is only read through this map; the index directory is written once
        // and never modified in place (a rebuild needs a fresh directory), so the contents do
        // not change under the map while it lives.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| DenseError::io(&emb_path, e))?;
        let count = marker.num_docs as usize;
        if mmap.len() != HEADER_BYTES + count * dim * 4 {
            return Err(DenseError::format(
                &emb_path,
                format!(
                    "{} bytes, expected {} for {count} rows of {dim}",
                    mmap.len(),
                    HEADER_BYTES + count * dim * 4
                ),
            ));
        }
        if mmap[..HEADER_BYTES] != header(dim, count) {
            return Err(DenseError::format(&emb_path, "bad header"));
        }
        if !(mmap.as_ptr() as usize + HEADER_BYTES).is_multiple_of(std::mem::align_of::<f32>()) {
            return Err(DenseError::format(&emb_path, "misaligned map"));
        }
        let docs = read_corpus(dir.join(DOCS_FILE)).map_err(|e| DenseError::format(dir, e))?;
        if docs.len() != count {
            return Err(DenseError::format(
                dir,
                format!("{} documents for {count} embeddings", docs.len()),
            ));
        }
        Ok(DenseIndex {
            dir: dir.to_path_buf(),
            encoder,
            mmap,
            docs,
            dim,
        })
    }

    /// The index directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The query encoder.
    pub fn encoder(&self) -> &Arc<SentenceEncoder> {
        &self.encoder
    }

    /// Number of documents.
    pub fn len(&self) -> usize {
        self.docs.len()
    }

    /// Whether the index holds no documents.
    pub fn is_empty(&self) -> bool {
        self.docs.is_empty()
    }

    /// Embedding width.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The documents, in row order.
    pub fn documents(&self) -> &[Document] {
        &self.docs
    }

    /// The embedding matrix, `len() × dim()` row-major, straight from the map.
    pub fn matrix(&self) -> &[f32] {
        let bytes = &self.mmap[HEADER_BYTES..];
        // SAFETY: `open` checked the length (a multiple of 4 bytes), the alignment of the start
        // and that the machine is little-endian (the file's byte order); any bit pattern is a
        // valid f32, and the slice borrows `self.mmap`.
        unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<f32>(), bytes.len() / 4) }
    }

    /// The embedding of document `i` (panics when out of range).
    pub fn embedding(&self, i: usize) -> &[f32] {
        &self.matrix()[i * self.dim..(i + 1) * self.dim]
    }

    /// Exact top-`k` rows for each query embedding: `(row, inner product)`, best first, equal
    /// scores in row order.
    pub fn search_embeddings(
        &self,
        queries: &Embeddings,
        k: usize,
    ) -> Result<Vec<Vec<(usize, f32)>>, DenseError> {
        if queries.dim != self.dim {
            return Err(DenseError::Dimension {
                expected: self.dim,
                got: queries.dim,
            });
        }
        Ok(flat_top_k(self.matrix(), self.dim, &queries.data, k))
    }

    /// Encodes `queries` and returns the top-`k` hits of each.
    pub fn search(&self, queries: &[String], k: usize) -> Result<Vec<Vec<Hit>>, DenseError> {
        let emb = self.encoder.encode(queries)?;
        let top = self.search_embeddings(&emb, k)?;
        Ok(top
            .into_iter()
            .map(|hits| {
                hits.into_iter()
                    .map(|(i, score)| Hit {
                        document: self.docs[i].clone(),
                        score,
                    })
                    .collect()
            })
            .collect())
    }
}

impl Retriever for DenseIndex {
    fn retrieve(&self, queries: &[String], k: usize) -> Result<Vec<Vec<Hit>>, RetrievalError> {
        self.search(queries, k)
            .map_err(|e| e.into_retrieval(&self.dir))
    }
}

/// Keeps the `k` best `(score, row)` pairs seen; rows arrive in increasing order, so a later
/// equal score never displaces an earlier row.
struct TopK {
    k: usize,
    items: Vec<(f32, usize)>,
    /// Index in `items` of the worst kept item, and its score.
    worst: (usize, f32),
}

impl TopK {
    fn new(k: usize) -> Self {
        TopK {
            k,
            items: Vec::with_capacity(k),
            worst: (0, f32::NEG_INFINITY),
        }
    }

    fn refresh_worst(&mut self) {
        let mut w = (0, f32::INFINITY);
        for (i, &(s, _)) in self.items.iter().enumerate() {
            // The worst is the lowest score, and among equal scores the latest row.
            if s < w.1 || (s == w.1 && self.items[i].1 > self.items[w.0].1) {
                w = (i, s);
            }
        }
        self.worst = w;
    }

    #[inline]
    fn push_block(&mut self, scores: &[f32], first_row: usize) {
        for (j, &s) in scores.iter().enumerate() {
            let s = if s.is_nan() { f32::NEG_INFINITY } else { s };
            if self.items.len() < self.k {
                self.items.push((s, first_row + j));
                if self.items.len() == self.k {
                    self.refresh_worst();
                }
            } else if s > self.worst.1 {
                self.items[self.worst.0] = (s, first_row + j);
                self.refresh_worst();
            }
        }
    }

    fn into_sorted(mut self) -> Vec<(usize, f32)> {
        self.items
            .sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        self.items.into_iter().map(|(s, i)| (i, s)).collect()
    }
}

/// Exact top-`k` by inner product of each query row (`queries`, row-major, width `dim`) against
/// every row of `matrix` (row-major, width `dim`).
pub fn flat_top_k(matrix: &[f32], dim: usize, queries: &[f32], k: usize) -> Vec<Vec<(usize, f32)>> {
    assert!(dim > 0 && matrix.len().is_multiple_of(dim) && queries.len().is_multiple_of(dim));
    let n = matrix.len() / dim;
    let m = queries.len() / dim;
    let k = k.min(n);
    let mut tops: Vec<TopK> = (0..m).map(|_| TopK::new(k)).collect();
    if k == 0 || m == 0 {
        return tops.into_iter().map(TopK::into_sorted).collect();
    }
    let mut scores = vec![0f32; m * BLOCK_ROWS.min(n)];
    let parallel = m * dim * BLOCK_ROWS.min(n) >= 1 << 21;
    for start in (0..n).step_by(BLOCK_ROWS) {
        let rows = BLOCK_ROWS.min(n - start);
        let block = &matrix[start * dim..(start + rows) * dim];
        let dst = &mut scores[..m * rows];
        // dst (m × rows, row-major) = queries (m × dim, row-major) · blockᵀ (dim × rows).
        // SAFETY: every pointer covers exactly the extents described by (m, rows, dim) and the
        // strides: dst has m·rows elements, queries m·dim, block rows·dim; dst does not alias
        // the inputs. `read_dst` is false, so dst's previous contents are ignored.
        unsafe {
            gemm::gemm(
                m,
                rows,
                dim,
                dst.as_mut_ptr(),
                1,
                rows as isize,
                false,
                queries.as_ptr(),
                1,
                dim as isize,
                block.as_ptr(),
                dim as isize,
                1,
                0.0f32,
                1.0f32,
                false,
                false,
                false,
                if parallel {
                    gemm::Parallelism::Rayon(0)
                } else {
                    gemm::Parallelism::None
                },
            );
        }
        for (q, top) in tops.iter_mut().enumerate() {
            top.push_block(&dst[q * rows..(q + 1) * rows], start);
        }
    }
    tops.into_iter().map(TopK::into_sorted).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(matrix: &[f32], dim: usize, q: &[f32], k: usize) -> Vec<(usize, f32)> {
        let mut all: Vec<(usize, f32)> = matrix
            .chunks(dim)
            .enumerate()
            .map(|(i, row)| (i, row.iter().zip(q).map(|(a, b)| a * b).sum()))
            .collect();
        all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        all.truncate(k);
        all
    }

    #[test]
    fn dense_flat_top_k_matches_naive_across_blocks() {
        let dim = 8;
        let n = BLOCK_ROWS + 123;
        let mut rng = crate::world::rng::SplitMix64::new(7);
        let mut unit = || (rng.below(2001) as f32 - 1000.0) / 1000.0;
        let matrix: Vec<f32> = (0..n * dim).map(|_| unit()).collect();
        let queries: Vec<f32> = (0..5 * dim).map(|_| unit()).collect();
        let got = flat_top_k(&matrix, dim, &queries, 10);
        for (qi, q) in queries.chunks(dim).enumerate() {
            let want = naive(&matrix, dim, q, 10);
            assert_eq!(got[qi].len(), 10);
            for (g, w) in got[qi].iter().zip(&want) {
                assert_eq!(g.0, w.0, "query {qi}: {:?} vs {:?}", got[qi], want);
                assert!((g.1 - w.1).abs() < 1e-4);
            }
        }
    }

    #[test]
    fn dense_flat_top_k_ties_in_row_order_and_small_k() {
        let dim = 2;
        let matrix = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0];
        let got = flat_top_k(&matrix, dim, &[1.0, 0.0], 2);
        assert_eq!(got, vec![vec![(0, 1.0), (2, 1.0)]]);
        assert_eq!(flat_top_k(&matrix, dim, &[1.0, 0.0], 0), vec![vec![]]);
        assert_eq!(flat_top_k(&matrix, dim, &[0.0, 1.0], 99).len(), 1);
        assert_eq!(flat_top_k(&matrix, dim, &[0.0, 1.0], 99)[0].len(), 4);
    }
}
