//! `turnwise view`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use turnwise_env::server::resolve_addr;

use super::common::tokio_runtime;

/// Show one RL step's sample episodes (samples/step-N.jsonl) as a self-contained HTML page:
/// per turn the decoded text, tokens coloured by advantage, log-prob or entropy, the
/// observation, reward, advantage, information gain, clip state and group; filters by
/// outcome, group and text. Writes the page, or serves it with `--serve`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The run directory.
    run: PathBuf,
    /// The RL step (default: the latest with samples).
    #[arg(long)]
    step: Option<u64>,
    /// The page to write (default: RUN/view/step-N.html).
    #[arg(long, conflicts_with = "serve")]
    out: Option<PathBuf>,
    /// Serve the page over HTTP instead, on HOST:PORT (default 127.0.0.1 with a free port),
    /// until Ctrl-C; `/?step=N` shows step N. Anything but loopback exposes the run.
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = "127.0.0.1:0")]
    serve: Option<String>,
}

/// Runs `turnwise view`.
pub fn exec(args: Args, quiet: bool) -> Result<()> {
    let Args {
        run,
        step,
        out,
        serve,
    } = args;
    view(&run, step, out.as_deref(), serve.as_deref(), quiet)
}

/// `turnwise view`: writes the page of a step, or serves the run's pages until Ctrl-C.
fn view(
    run: &Path,
    step: Option<u64>,
    out: Option<&Path>,
    serve: Option<&str>,
    quiet: bool,
) -> Result<()> {
    use turnwise::run::view;
    let Some(addr) = serve else {
        // The page written into the run's view/ is recorded as the run's (when no run is
        // writing it).
        let mut owned = turnwise::run::RunDir::open(run).ok();
        if let Some(r) = owned.as_mut().filter(|_| out.is_none()) {
            r.adopt_manifest()?;
        }
        let (path, step) = view::write_view(run, step, out)?;
        turnwise::ownership::wrote_file(&path)?;
        drop(owned);
        if !quiet {
            println!("wrote {} (step {step})", path.display());
        }
        return Ok(());
    };
    let addr = resolve_addr(addr).with_context(|| format!("--serve {addr}"))?;
    let (step, _) = view::resolve_step(&turnwise::run::RunDir::open(run)?, step)?;
    let runtime = tokio_runtime()?;
    runtime.block_on(turnwise_env::server::serve_router(
        "viewer",
        view::router(run.to_path_buf()),
        addr,
        view::READ_TIMEOUT,
        |addr| println!("turnwise view: serving step {step} of {} on http://{addr}/?step={step} (Ctrl-C stops)", run.display()),
        async {
            let _ = tokio::signal::ctrl_c().await;
        },
    ))?;
    Ok(())
}
