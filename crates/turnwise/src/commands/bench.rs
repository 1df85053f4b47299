//! `turnwise bench`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// Measure throughput: model training and sampling tokens/s (sizes A and B), BM25 queries/s
/// and the retrieval server's requests/s on a generated world. Prints tables.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Fewer repetitions and shorter server runs (seconds, noisier figures).
    #[arg(long)]
    quick: bool,
    /// Measure only the model or only the environment (retrieval) part.
    #[arg(long, value_enum)]
    only: Option<BenchPart>,
    /// Model sizes, comma-separated: A (hidden 256, 4 layers), B (hidden 512, 8 layers), Q
    /// (the quickstart's model: hidden 128, 4 layers) or tiny (for tests).
    #[arg(long, value_delimiter = ',', default_value = "A,B")]
    sizes: Vec<String>,
    /// Also write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

/// Runs `turnwise bench`.
pub fn exec(args: Args) -> Result<()> {
    let Args {
        quick,
        only,
        sizes,
        json,
    } = args;
    bench(quick, only, &sizes, json.as_deref())
}

/// Which part of `turnwise bench` to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchPart {
    /// Model training and sampling throughput.
    Model,
    /// BM25 and retrieval-server throughput.
    Env,
}

/// `turnwise bench`: runs the measurements, prints the tables, writes the JSON.
fn bench(
    quick: bool,
    only: Option<BenchPart>,
    sizes: &[String],
    json: Option<&Path>,
) -> Result<()> {
    use turnwise::bench::{BenchOptions, ModelSize};
    let model = only != Some(BenchPart::Env);
    let opts = BenchOptions {
        quick,
        sizes: if model {
            if sizes.is_empty() {
                bail!("--sizes needs at least one of A, B, Q or tiny");
            }
            sizes
                .iter()
                .map(|s| ModelSize::named(s))
                .collect::<Result<_>>()
                .context("--sizes")?
        } else {
            Vec::new()
        },
        env: only != Some(BenchPart::Model),
        ..BenchOptions::full()
    };
    let report = turnwise::bench::run(&opts)?;
    println!("{}", report.table());
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
