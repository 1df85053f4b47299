//! `turnwise presets`.

use anyhow::Result;
use turnwise::config::TrainConfig;

/// List the presets: one line each (name, method, what it does); `--verbose` or a NAME
/// prints the full descriptions and the papers.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Only this preset, with its full description and papers.
    name: Option<String>,
    /// The full description and the papers of every preset.
    #[arg(long, short)]
    verbose: bool,
}

/// Runs `turnwise presets`.
pub fn exec(args: Args) -> Result<()> {
    let Args { name, verbose } = args;
    use turnwise::config::presets::{
        PRESETS, QUICKSTART, QUICKSTART_DESCRIPTION, QUICKSTART_SUMMARY, summary,
    };
    let paragraph = |name: &str| -> Result<()> {
        let cfg = TrainConfig::resolve(Some(name), None, &[])?;
        let description = if name == QUICKSTART {
            QUICKSTART_DESCRIPTION.to_string()
        } else {
            cfg.description.clone()
        };
        println!("{name:<12} {description}");
        for paper in &cfg.papers {
            println!("{:<12}   paper: {paper}", "");
        }
        Ok(())
    };
    if let Some(name) = name {
        return paragraph(&name);
    }
    if verbose {
        for (name, _) in PRESETS {
            paragraph(name)?;
        }
        return paragraph(QUICKSTART);
    }
    let mut rows: Vec<(&str, String, String)> = PRESETS
        .iter()
        .map(|&(name, _)| summary(name).map(|(method, what)| (name, method, what)))
        .collect::<Result<_, _>>()?;
    rows.push((
        QUICKSTART,
        QUICKSTART_SUMMARY.0.into(),
        QUICKSTART_SUMMARY.1.into(),
    ));
    let width = rows.iter().map(|r| r.1.chars().count()).max().unwrap_or(0);
    println!(
        "{:<12} {:<width$}  what it does",
        "preset", "method (paper)"
    );
    for (name, method, what) in rows {
        println!("{name:<12} {method:<width$}  {what}");
    }
    println!("\n`turnwise presets NAME` (or --verbose) prints the full description and papers");
    Ok(())
}
