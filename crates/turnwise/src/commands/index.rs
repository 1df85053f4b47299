//! `turnwise index`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use turnwise_env::corpus::read_corpus;
use turnwise_env::search::bm25::{Bm25BuildOptions, Bm25Index};

/// Build a BM25 index of a Search-R1 corpus (JSON lines `{"id", "contents"}`).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The corpus file.
    #[arg(long)]
    corpus: PathBuf,
    /// Index directory (must not already hold an index).
    #[arg(long)]
    out: PathBuf,
}

/// Runs `turnwise index`.
pub fn exec(args: Args) -> Result<()> {
    let Args { corpus, out } = args;
    // The index's files go into a new or empty folder only, never among a user's.
    if out.exists() {
        if !out.is_dir() {
            bail!("{} exists and is not a folder", out.display());
        }
        if !turnwise::ownership::is_empty_but(&out, &[])? {
            bail!(
                "{} is not empty: give a new or empty folder for the index (it writes \
                 its files at the top of the folder)",
                out.display()
            );
        }
    }
    let docs =
        read_corpus(&corpus).with_context(|| format!("reading the corpus {}", corpus.display()))?;
    if docs.is_empty() {
        bail!("the corpus {} holds no documents", corpus.display());
    }
    let mut seen = std::collections::HashSet::new();
    let dups: Vec<&str> = docs
        .iter()
        .filter(|d| !seen.insert(d.id.as_str()))
        .map(|d| d.id.as_str())
        .collect();
    if !dups.is_empty() {
        tracing::warn!(
            "{} documents of {} repeat an earlier id (first: {:?}); searches return \
             each as its own passage",
            dups.len(),
            corpus.display(),
            dups[0]
        );
    }
    let t = Instant::now();
    let index = Bm25Index::build(&out, &docs, &Bm25BuildOptions::default())
        .with_context(|| format!("building the index in {}", out.display()))?;
    println!(
        "indexed {} documents into {} in {:.2} s",
        index.num_docs(),
        out.display(),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}
