//! Hybrid ranking: fuse the results of a sparse retriever (BM25) and a dense one.
//!
//! [`HybridRetriever`] asks both retrievers for their top [`HybridOptions::depth`] hits (at
//! least `k`), merges them by document id and ranks by a fused score, with the dense side
//! weighted by `w = `[`HybridOptions::dense_weight`] and the sparse side by `1 − w`:
//!
//! - [`Fusion::Rrf`] (reciprocal-rank fusion, the default):
//!   `score = (1 − w) / (c + rank_sparse) + w / (c + rank_dense)`, ranks 1-based, a document
//!   missing from one list contributing 0 on that side (`c = 60` as in Cormack et al. 2009).
//! - [`Fusion::MinMax`] (normalised score fusion): each list's scores are min-max scaled to
//!   `[0, 1]` per query (all 1 when they are all equal), then
//!   `score = (1 − w) · sparse + w · dense`, missing contributing 0.
//!
//! `w = 0` ranks by the sparse retriever alone, `w = 1` by the dense one alone (on the merged
//! candidates). Equal fused scores rank by the rank on the heavier side (dense when `w ≥ 0.5`),
//! then on the other.

use std::collections::HashMap;
use std::sync::Arc;

use super::{Hit, RetrievalError, Retriever};

/// How the two ranked lists are combined.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fusion {
    /// Reciprocal-rank fusion with constant `c` (> 0).
    Rrf {
        /// Rank offset; 60 is the usual choice.
        c: f32,
    },
    /// Per-query min-max normalised score fusion.
    MinMax,
}

impl Default for Fusion {
    fn default() -> Self {
        Fusion::Rrf { c: 60.0 }
    }
}

/// Settings of a [`HybridRetriever`].
#[derive(Debug, Clone, PartialEq)]
pub struct HybridOptions {
    /// The fusion rule. Default RRF with `c = 60`.
    pub fusion: Fusion,
    /// Weight of the dense side in `[0, 1]` (the sparse side gets `1 − w`). Default 0.5.
    pub dense_weight: f32,
    /// Candidates fetched from each retriever per query (raised to `k` when smaller).
    /// Default 50.
    pub depth: usize,
}

impl Default for HybridOptions {
    fn default() -> Self {
        HybridOptions {
            fusion: Fusion::default(),
            dense_weight: 0.5,
            depth: 50,
        }
    }
}

/// Invalid [`HybridOptions`].
#[derive(Debug, thiserror::Error)]
#[error("bad hybrid options: {0}")]
pub struct HybridOptionsError(String);

/// A [`Retriever`] fusing a sparse and a dense retriever (see the module docs).
pub struct HybridRetriever {
    sparse: Arc<dyn Retriever>,
    dense: Arc<dyn Retriever>,
    options: HybridOptions,
}

impl std::fmt::Debug for HybridRetriever {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HybridRetriever")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

struct Candidate {
    hit: Hit,
    sparse_rank: Option<usize>,
    dense_rank: Option<usize>,
    score: f32,
}

impl HybridRetriever {
    /// Fuses `sparse` (e.g. a [`super::bm25::Bm25Index`]) and `dense` (e.g. a
    /// [`super::dense::DenseIndex`]). Fails when the weight is outside `[0, 1]`, the RRF
    /// constant is not positive or the depth is 0.
    pub fn new(
        sparse: Arc<dyn Retriever>,
        dense: Arc<dyn Retriever>,
        options: HybridOptions,
    ) -> Result<Self, HybridOptionsError> {
        if !(0.0..=1.0).contains(&options.dense_weight) {
            return Err(HybridOptionsError(format!(
                "dense_weight {} is not in [0, 1]",
                options.dense_weight
            )));
        }
        if let Fusion::Rrf { c } = options.fusion
            && !(c > 0.0 && c.is_finite())
        {
            return Err(HybridOptionsError(format!(
                "RRF constant {c} must be positive"
            )));
        }
        if options.depth == 0 {
            return Err(HybridOptionsError("depth must be positive".into()));
        }
        Ok(HybridRetriever {
            sparse,
            dense,
            options,
        })
    }

    /// The settings.
    pub fn options(&self) -> &HybridOptions {
        &self.options
    }

    /// Fuses one query's sparse and dense hit lists (each best first) into the top `k`.
    pub fn fuse(&self, sparse: Vec<Hit>, dense: Vec<Hit>, k: usize) -> Vec<Hit> {
        fuse(&self.options, sparse, dense, k)
    }
}

/// `(min, max)` of the scores, or `None` for an empty list.
fn min_max(hits: &[Hit]) -> Option<(f32, f32)> {
    hits.iter().map(|h| h.score).fold(None, |acc, s| match acc {
        None => Some((s, s)),
        Some((lo, hi)) => Some((lo.min(s), hi.max(s))),
    })
}

fn scaled(score: f32, range: Option<(f32, f32)>) -> f32 {
    match range {
        Some((lo, hi)) if hi > lo => (score - lo) / (hi - lo),
        _ => 1.0,
    }
}

/// Fuses one query's sparse and dense hit lists (each best first) into the top `k` under
/// `options` (see the module docs).
pub fn fuse(options: &HybridOptions, sparse: Vec<Hit>, dense: Vec<Hit>, k: usize) -> Vec<Hit> {
    let w = options.dense_weight;
    let (sparse_range, dense_range) = (min_max(&sparse), min_max(&dense));
    let mut by_id: HashMap<String, usize> = HashMap::new();
    let mut cands: Vec<Candidate> = Vec::with_capacity(sparse.len() + dense.len());
    for (side, list) in [(0, sparse), (1, dense)] {
        for (rank0, hit) in list.into_iter().enumerate() {
            let part = match options.fusion {
                Fusion::Rrf { c } => 1.0 / (c + (rank0 + 1) as f32),
                Fusion::MinMax => scaled(
                    hit.score,
                    if side == 0 { sparse_range } else { dense_range },
                ),
            } * if side == 0 { 1.0 - w } else { w };
            let slot = match by_id.get(&hit.document.id) {
                Some(&i) => i,
                None => {
                    by_id.insert(hit.document.id.clone(), cands.len());
                    cands.push(Candidate {
                        hit: hit.clone(),
                        sparse_rank: None,
                        dense_rank: None,
                        score: 0.0,
                    });
                    cands.len() - 1
                }
            };
            let c = &mut cands[slot];
            let rank = if side == 0 {
                &mut c.sparse_rank
            } else {
                &mut c.dense_rank
            };
            // A retriever listing a document twice counts only its best rank.
            if rank.is_none() {
                *rank = Some(rank0);
                c.score += part;
            }
        }
    }
    let rank = |r: Option<usize>| r.unwrap_or(usize::MAX);
    let dense_first = w >= 0.5;
    cands.sort_by(|a, b| {
        let (sa, sb) = (rank(a.sparse_rank), rank(b.sparse_rank));
        let (da, db) = (rank(a.dense_rank), rank(b.dense_rank));
        let ties = if dense_first {
            da.cmp(&db).then(sa.cmp(&sb))
        } else {
            sa.cmp(&sb).then(da.cmp(&db))
        };
        b.score.total_cmp(&a.score).then(ties)
    });
    cands
        .into_iter()
        .take(k)
        .map(|c| Hit {
            document: c.hit.document,
            score: c.score,
        })
        .collect()
}

impl Retriever for HybridRetriever {
    fn retrieve(&self, queries: &[String], k: usize) -> Result<Vec<Vec<Hit>>, RetrievalError> {
        let depth = self.options.depth.max(k);
        let sparse = self.sparse.retrieve(queries, depth)?;
        let dense = self.dense.retrieve(queries, depth)?;
        if sparse.len() != queries.len() || dense.len() != queries.len() {
            return Err(RetrievalError::Index {
                path: "hybrid".into(),
                message: format!(
                    "{} queries but {} sparse and {} dense result lists",
                    queries.len(),
                    sparse.len(),
                    dense.len()
                ),
            });
        }
        Ok(sparse
            .into_iter()
            .zip(dense)
            .map(|(s, d)| fuse(&self.options, s, d, k))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::search::Document;

    fn hit(id: &str, score: f32) -> Hit {
        Hit {
            document: Document {
                id: id.into(),
                contents: format!("\"{id}\"\ntext"),
            },
            score,
        }
    }

    fn ids(hits: &[Hit]) -> Vec<&str> {
        hits.iter().map(|h| h.document.id.as_str()).collect()
    }

    #[test]
    fn dense_hybrid_rrf_prefers_documents_in_both_lists() {
        let o = HybridOptions::default();
        let sparse = vec![hit("a", 9.0), hit("b", 5.0), hit("c", 1.0)];
        let dense = vec![hit("d", 0.9), hit("b", 0.8), hit("e", 0.1)];
        let fused = fuse(&o, sparse, dense, 5);
        // b is in both lists; a and d tie (rank 1 on one side), as do c and e (rank 3): the
        // dense side breaks ties at w = 0.5.
        assert_eq!(ids(&fused), ["b", "d", "a", "e", "c"]);
        let expect_b = 0.5 / 62.0 + 0.5 / 62.0;
        assert!((fused[0].score - expect_b).abs() < 1e-7);
        assert!((fused[1].score - 0.5 / 61.0).abs() < 1e-7);
    }

    #[test]
    fn dense_hybrid_weights_select_one_side() {
        let sparse = vec![hit("a", 9.0), hit("b", 5.0)];
        let dense = vec![hit("b", 0.9), hit("c", 0.8)];
        for fusion in [Fusion::Rrf { c: 60.0 }, Fusion::MinMax] {
            let only = |w: f32| HybridOptions {
                fusion,
                dense_weight: w,
                depth: 10,
            };
            assert_eq!(
                ids(&fuse(&only(0.0), sparse.clone(), dense.clone(), 2)),
                ["a", "b"]
            );
            assert_eq!(
                ids(&fuse(&only(1.0), sparse.clone(), dense.clone(), 2)),
                ["b", "c"]
            );
        }
    }

    #[test]
    fn dense_hybrid_minmax_scales_each_list() {
        let o = HybridOptions {
            fusion: Fusion::MinMax,
            dense_weight: 0.25,
            depth: 10,
        };
        let sparse = vec![hit("a", 10.0), hit("b", 6.0), hit("c", 2.0)];
        let dense = vec![hit("c", 0.7), hit("a", 0.5)];
        let fused = fuse(&o, sparse, dense, 3);
        // a: 0.75·1 + 0.25·0 = 0.75; b: 0.75·0.5 = 0.375; c: 0 + 0.25·1 = 0.25.
        assert_eq!(ids(&fused), ["a", "b", "c"]);
        assert!((fused[1].score - 0.375).abs() < 1e-6);
        assert!((fused[2].score - 0.25).abs() < 1e-6);
    }

    #[test]
    fn dense_hybrid_rejects_bad_options() {
        struct Empty;
        impl Retriever for Empty {
            fn retrieve(&self, q: &[String], _k: usize) -> Result<Vec<Vec<Hit>>, RetrievalError> {
                Ok(vec![Vec::new(); q.len()])
            }
        }
        let e: Arc<dyn Retriever> = Arc::new(Empty);
        let bad = [
            HybridOptions {
                dense_weight: 1.5,
                ..HybridOptions::default()
            },
            HybridOptions {
                fusion: Fusion::Rrf { c: 0.0 },
                ..HybridOptions::default()
            },
            HybridOptions {
                depth: 0,
                ..HybridOptions::default()
            },
        ];
        for o in bad {
            assert!(HybridRetriever::new(e.clone(), e.clone(), o).is_err());
        }
        let h = HybridRetriever::new(e.clone(), e, HybridOptions::default()).unwrap();
        assert_eq!(
            h.retrieve(&["q".into()], 3).unwrap(),
            vec![Vec::<Hit>::new()]
        );
    }
}
