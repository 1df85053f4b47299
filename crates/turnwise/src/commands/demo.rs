//! `turnwise demo`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use turnwise_env::client::HttpRetriever;
use turnwise_env::search::Retriever;
use turnwise_env::search::bm25::{Bm25BuildOptions, Bm25Index};
use turnwise_env::server::{BackgroundServer, ServerConfig};
use turnwise_env::world::oracle::{AgentFormat, Oracle, OracleConfig, OracleNoise};
use turnwise_env::world::{Split, World, WorldConfig};

/// Generate a multi-hop world, index it, serve it over HTTP on 127.0.0.1 and let the oracle
/// search agent answer its held-out questions through that server.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Seed of the world.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Held-out (test) questions to answer.
    #[arg(long, default_value_t = 100)]
    questions: usize,
    /// Probability that an oracle transcript carries an error.
    #[arg(long, default_value_t = 0.0)]
    noise: f64,
    /// Working directory for the corpus and the index.
    #[arg(long, default_value = "runs/demo")]
    dir: PathBuf,
}

/// Runs `turnwise demo`.
pub fn exec(args: Args) -> Result<()> {
    let Args {
        seed,
        questions,
        noise,
        dir,
    } = args;
    demo(seed, questions, noise, &dir)
}

/// The demo: world → index → HTTP server → oracle agent through the HTTP client → EM.
fn demo(seed: u64, questions: usize, noise: f64, dir: &Path) -> Result<()> {
    if !(0.0..=1.0).contains(&noise) {
        bail!("--noise must be in [0, 1], got {noise}");
    }
    let t0 = Instant::now();
    let world = World::generate(&WorldConfig {
        seed,
        ..WorldConfig::default()
    })
    .context("generating the world")?;
    let docs = world.documents();
    println!(
        "world: {} passages, {} questions ({} train / {} validation / {} test)",
        docs.len(),
        world.questions.len(),
        world.questions_in(Split::Train).count(),
        world.questions_in(Split::Validation).count(),
        world.questions_in(Split::Test).count()
    );
    let index_dir = dir.join(format!("index-seed{seed}"));
    let index = Bm25Index::open_or_build(&index_dir, || docs.clone(), &Bm25BuildOptions::default())
        .with_context(|| format!("building the index in {}", index_dir.display()))?;
    println!(
        "index: {} documents in {}",
        index.num_docs(),
        index_dir.display()
    );
    let server = BackgroundServer::start(
        Arc::new(index),
        ServerConfig::with_addr(SocketAddr::from(([127, 0, 0, 1], 0))),
    )
    .context("starting the retrieval server")?;
    println!("retrieval server: {}", server.url());
    let client = HttpRetriever::new(&server.url()).context("building the HTTP client")?;
    let test: Vec<_> = world.questions_in(Split::Test).take(questions).collect();
    let mut by_hops = std::collections::BTreeMap::<usize, (usize, usize)>::new();
    for format in [AgentFormat::SearchR1, AgentFormat::Boxed, AgentFormat::T2po] {
        let oracle = Oracle::new(
            &world,
            &client as &dyn Retriever,
            OracleConfig {
                format,
                noise: OracleNoise::uniform(noise),
                seed,
                ..OracleConfig::default()
            },
        );
        let mut correct = 0;
        let mut searches = 0;
        for (i, q) in test.iter().enumerate() {
            let transcript = oracle
                .answer(q)
                .with_context(|| format!("oracle on question {}", q.id))?;
            let em = transcript.exact_match(&q.golden_answers);
            correct += usize::from(em);
            searches += transcript.searches();
            if format == AgentFormat::SearchR1 {
                let e = by_hops.entry(q.hops()).or_default();
                e.0 += usize::from(em);
                e.1 += 1;
                if i == 0 {
                    println!("\nquestion: {}\n{}\n", q.text, transcript.render());
                }
            }
        }
        println!(
            "oracle {:<9} EM {:.3} ({correct}/{}), {:.2} searches per question",
            format!("{format:?}"),
            correct as f64 / test.len().max(1) as f64,
            test.len(),
            searches as f64 / test.len().max(1) as f64
        );
    }
    for (hops, (c, n)) in by_hops {
        println!("  {hops}-hop: EM {:.3} ({c}/{n})", c as f64 / n as f64);
    }
    server.shutdown().context("stopping the retrieval server")?;
    println!("done in {:.2} s", t0.elapsed().as_secs_f64());
    Ok(())
}
