//! Subcommands of the `turnwise` binary: one file per command, each holding its arguments
//! (`Args`, whose doc comment is the command's help) and what it runs (`exec`).

mod bench;
mod common;
mod compare;
mod config;
mod credit_audit;
mod data;
mod demo;
mod eval;
mod export;
mod index;
mod presets;
mod quickstart;
mod report;
mod resume;
mod runs;
mod serve;
mod serve_env;
mod serve_retriever;
mod sft;
mod study;
mod traces;
mod train;
mod view;

use anyhow::Result;
use clap::{Parser, Subcommand};

pub use common::init_logging;

/// Multi-turn reinforcement learning for LLM agents.
#[derive(Debug, Parser)]
#[command(name = "turnwise", version, about)]
pub struct Cli {
    /// Only print warnings and errors (for CI).
    #[arg(long, short, global = true)]
    pub quiet: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands (each variant's help is its arguments' doc comment).
#[derive(Debug, Subcommand)]
pub enum Command {
    Quickstart(quickstart::Args),
    Train(train::Args),
    Sft(sft::Args),
    Bench(bench::Args),
    Resume(resume::Args),
    Report(report::Args),
    View(view::Args),
    Eval(eval::Args),
    CreditAudit(credit_audit::Args),
    Export(export::Args),
    Presets(presets::Args),
    Config(config::Args),
    Runs(runs::Args),
    Compare(compare::Args),
    Demo(demo::Args),
    /// Fetch or generate corpora and question sets.
    #[command(subcommand)]
    Data(data::DataCommand),
    /// Method comparison studies: arms (a preset and overrides) × seeds from shared warm
    /// starts, one RL budget, one panel of test questions, and a report with 95 % intervals,
    /// paired differences and the verdicts of papers' claims (docs/runs.md: "Method comparison
    /// studies"; studies/paper-claims.toml).
    #[command(subcommand)]
    Study(study::StudyCommand),
    /// Session records written by `turnwise serve --record-dir` (docs/servers.md: "Recorded
    /// sessions").
    #[command(subcommand)]
    Traces(traces::TracesCommand),
    Index(index::Args),
    ServeRetriever(serve_retriever::Args),
    ServeEnv(serve_env::Args),
    Serve(serve::Args),
}

/// Runs one subcommand.
pub fn run(cli: Cli) -> Result<()> {
    let quiet = cli.quiet;
    match cli.command {
        Command::Quickstart(args) => quickstart::exec(args, quiet),
        Command::Train(args) => train::exec(args, quiet),
        Command::Sft(args) => sft::exec(args, quiet),
        Command::Bench(args) => bench::exec(args),
        Command::Resume(args) => resume::exec(args, quiet),
        Command::Report(args) => report::exec(args, quiet),
        Command::View(args) => view::exec(args, quiet),
        Command::Eval(args) => eval::exec(args),
        Command::CreditAudit(args) => credit_audit::exec(args),
        Command::Export(args) => export::exec(args),
        Command::Presets(args) => presets::exec(args),
        Command::Config(args) => config::exec(args),
        Command::Runs(args) => runs::exec(args),
        Command::Compare(args) => compare::exec(args, quiet),
        Command::Demo(args) => demo::exec(args),
        Command::Data(cmd) => data::exec(cmd, quiet),
        Command::Study(cmd) => study::exec(cmd, quiet),
        Command::Traces(cmd) => traces::exec(cmd),
        Command::Index(args) => index::exec(args),
        Command::ServeRetriever(args) => serve_retriever::exec(args),
        Command::ServeEnv(args) => serve_env::exec(args),
        Command::Serve(args) => serve::exec(args),
    }
}
