//! `turnwise serve-env`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use turnwise_env::server::resolve_addr;

use super::common::{resolve_train_config, tokio_runtime};

/// Serve a task's environment (the search world, frozen_lake, sokoban, two_turn) with
/// OpenEnv's protocol: the WebSocket session `/ws` (reset with split and index or seed, step
/// with the agent's turn text in `message`), `/health`, `/schema`, `/metadata`, `/reset`,
/// `/state`, for OpenEnv clients (EnvClient, GenericEnvClient, TRL, AgileRL).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Preset whose task to serve (see `turnwise presets`).
    #[arg(long)]
    preset: Option<String>,
    /// A TOML config file applied over the preset.
    #[arg(long)]
    config: Option<PathBuf>,
    /// `key=value` overrides applied last (e.g. `--set task.env="frozen_lake"`).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Address to bind, HOST:PORT. Anything but loopback exposes the environment to the
    /// network.
    #[arg(long, default_value = "127.0.0.1:8000")]
    addr: String,
    /// Most WebSocket sessions (episodes played) at once.
    #[arg(long, default_value_t = 256)]
    max_sessions: usize,
    /// Seconds a WebSocket session may go without sending a message (pings do not count)
    /// before it is closed with SESSION_TIMEOUT and its capacity freed.
    #[arg(long, default_value_t = turnwise_env::server::openenv::DEFAULT_IDLE_TIMEOUT.as_secs_f64())]
    idle_timeout_secs: f64,
}

/// Runs `turnwise serve-env`.
pub fn exec(args: Args) -> Result<()> {
    let Args {
        preset,
        config,
        sets,
        addr,
        max_sessions,
        idle_timeout_secs,
    } = args;
    if max_sessions == 0 {
        bail!("--max-sessions must be at least 1");
    }
    let idle_timeout = Duration::try_from_secs_f64(idle_timeout_secs)
        .ok()
        .filter(|t| !t.is_zero())
        .with_context(|| {
            format!("--idle-timeout-secs must be positive, got {idle_timeout_secs}")
        })?;
    let addr = resolve_addr(&addr).context("--addr")?;
    let cfg = resolve_train_config(preset.as_deref(), config.as_deref(), &sets)?;
    let task = turnwise::task::TaskSet::build(&cfg.task).context("building the task")?;
    let source = turnwise::task::openenv::TaskEpisodes::new(task)?;
    let name = turnwise_env::server::openenv::EpisodeSource::name(&source);
    let app = turnwise_env::server::openenv::router(
        source.into_source(),
        turnwise_env::server::openenv::EnvServerConfig {
            max_sessions,
            idle_timeout,
            ..Default::default()
        },
    );
    turnwise::serve::memory::release_when_idle();
    let runtime = tokio_runtime()?;
    runtime
        .block_on(turnwise_env::server::serve_router(
            "openenv",
            app,
            addr,
            turnwise_env::server::DEFAULT_READ_TIMEOUT,
            |bound| {
                use std::io::Write;
                println!("serving {name} with OpenEnv's protocol on http://{bound} (Ctrl-C stops)");
                let _ = std::io::stdout().flush();
            },
            async {
                let _ = tokio::signal::ctrl_c().await;
            },
        ))
        .context("serving")?;
    Ok(())
}
