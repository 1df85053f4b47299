//! `turnwise credit-audit`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, bail};

use super::common::CheckpointArgs;

/// Audit a checkpoint's turn credit against executed replays (docs/credit-audit.md): at
/// every turn of a panel of episodes, K alternative turns sampled from the exact state and
/// the taken turn and each alternative rolled forward M times to the end give the taken
/// turn's replay advantage; each estimator's per-turn advantage, computed in its own groups
/// as in training, is scored against it. Writes audit.md, audit.json and an SVG plot to
/// `--out`. Cost: episodes × turns × (K + 1) × M rollouts at most.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: CheckpointArgs,
    /// Audited episodes: one per question, the split's first questions.
    #[arg(long, default_value_t = 16)]
    episodes: usize,
    /// Episodes per question the estimators normalise over (default: the run's
    /// rollout.group_size).
    #[arg(long)]
    group: Option<usize>,
    /// Alternative turns sampled at each turn (K).
    #[arg(long, default_value_t = 4)]
    alternatives: usize,
    /// Continuations rolled from the taken turn and from each alternative (M).
    #[arg(long, default_value_t = 4)]
    rollouts: usize,
    /// Seed of the panel's and the replays' sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Bootstrap resamples of the intervals.
    #[arg(long, default_value_t = 1000)]
    bootstrap: usize,
    /// Continuations rolled at once (each holds its own keys and values). Default: as many
    /// as fit 2 GiB of key-value cache at the run's longest episode, 8 to 256.
    #[arg(long)]
    max_live: Option<usize>,
    /// Output folder (audit.md, audit.json, spearman_by_depth.svg): absent, empty, or
    /// without any of those files (then they are added beside the folder's own files).
    #[arg(long, default_value = "credit-audit")]
    out: PathBuf,
    /// Replace an earlier audit's files in `--out` (only what turnwise wrote there).
    #[arg(long)]
    overwrite: bool,
}

/// Runs `turnwise credit-audit`.
pub fn exec(args: Args) -> Result<()> {
    let Args {
        model,
        episodes,
        group,
        alternatives,
        rollouts,
        seed,
        bootstrap,
        max_live,
        out,
        overwrite,
    } = args;
    let split = model.split()?;
    if max_live == Some(0) {
        bail!("--max-live must be at least 1 (leave it out for the default)");
    }
    let request = turnwise::audit::AuditRequest {
        split,
        episodes,
        group,
        replay: turnwise::audit::replay::ReplaySettings {
            alternatives,
            rollouts,
            seed,
            chunk: max_live.unwrap_or(0),
        },
        bootstrap,
    };
    let t0 = Instant::now();
    let (report, _) = turnwise::audit::audit_into(&model.source(), &request, &out, overwrite)?;
    eprintln!(
        "audited {} turns of {} in {:.1} s: realised decision density {:.2}; wrote {}",
        report.turns,
        turnwise::pipeline::count(report.episodes as u64, "episode", "episodes"),
        t0.elapsed().as_secs_f64(),
        report.realised_density,
        out.display()
    );
    print!("{}", turnwise::audit::report::markdown(&report));
    Ok(())
}
