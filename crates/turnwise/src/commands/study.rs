//! `turnwise study`: method comparison studies.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Subcommand;

/// `turnwise study ...`.
#[derive(Debug, Subcommand)]
pub enum StudyCommand {
    /// Run every run of a study not finished yet: the warm starts, then arm × seed, each an
    /// ordinary run directory under OUT (a finished run is skipped, an unfinished one resumed,
    /// so a killed study picks up where it stopped). A failed run is reported with its log and
    /// the others go on; the exit status is non-zero when any failed.
    Run {
        /// The study file (TOML).
        file: PathBuf,
        /// The study directory (new, empty, or holding this study).
        #[arg(long)]
        out: PathBuf,
        /// Runs at once; the machine's cores are split between them (RAYON_NUM_THREADS).
        #[arg(long, default_value_t = 1)]
        jobs: usize,
    },
    /// Print one shell command per run for a scheduler over a shared directory (GNU parallel,
    /// a Slurm job array): the warm starts (stage 1) before the arm × seed runs (stage 2), and
    /// the replay audits (`[[audit]]`, stage 3) after the runs they read.
    /// Validates the study and prepares OUT (study.toml, panel.json) first.
    Plan {
        /// The study file.
        file: PathBuf,
        /// The study directory.
        #[arg(long)]
        out: PathBuf,
        /// Only one stage's commands, without comments: `warm`, `runs` or `audits`.
        #[arg(long, value_parser = ["all", "warm", "runs", "audits"], default_value = "all")]
        stage: String,
    },
    /// Run one run of a study in this process (what `plan`'s commands and `run`'s children
    /// call): `warm/NAME`, `ARM/seed-S` or `audit/NAME`. Skips a finished run, resumes an
    /// unfinished one (an unfinished audit starts again).
    RunOne {
        /// The study file.
        file: PathBuf,
        /// The study directory.
        #[arg(long)]
        out: PathBuf,
        /// The run: `warm/NAME`, `ARM/seed-S` or `audit/NAME`.
        #[arg(long)]
        run: String,
    },
    /// Aggregate whatever runs of a study have finished into DIR/report.md (and report.json,
    /// plots/*.svg).
    Report {
        /// The study directory.
        dir: PathBuf,
    },
}

/// `turnwise study ...`.
pub fn exec(cmd: StudyCommand, quiet: bool) -> Result<()> {
    use turnwise::study::{Study, runner};
    let prepare = |file: &Path, out: &Path| -> Result<Study> {
        let study = Study::load(file)?;
        let panels = study.validate(out)?;
        study.prepare_dir(out, &panels)?;
        Ok(study)
    };
    let absolute = |p: &Path| std::path::absolute(p).with_context(|| p.display().to_string());
    match cmd {
        StudyCommand::Run { file, out, jobs } => {
            if jobs == 0 {
                bail!("--jobs must be at least 1");
            }
            let out = absolute(&out)?;
            let study = prepare(&file, &out)?;
            let opts = runner::StudyRunOptions {
                jobs,
                cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
                exe: std::env::current_exe().context("finding this binary")?,
                quiet,
            };
            runner::run_study(&study, &out, &opts)
        }
        StudyCommand::Plan { file, out, stage } => {
            let out = absolute(&out)?;
            let study = prepare(&file, &out)?;
            let stage = match stage.as_str() {
                "warm" => runner::Stage::Warm,
                "runs" => runner::Stage::Runs,
                "audits" => runner::Stage::Audits,
                _ => runner::Stage::All,
            };
            let exe = std::env::current_exe().context("finding this binary")?;
            print!("{}", runner::plan(&exe, &study, &out, stage));
            Ok(())
        }
        StudyCommand::RunOne { file, out, run } => {
            let out = absolute(&out)?;
            let study = prepare(&file, &out)?;
            let id = study.find_run(&run)?;
            runner::run_one(&study, &out, &id, quiet)?;
            Ok(())
        }
        StudyCommand::Report { dir } => {
            let study = Study::load(&dir.join(turnwise::study::STUDY_FILE))?;
            let path = turnwise::study::report::write_study_report(&study, &dir)?;
            if !quiet {
                println!("wrote {}", path.display());
            }
            Ok(())
        }
    }
}
