//! Whole runs: warm start, evaluation before, RL steps with metrics, checkpoints and periodic
//! validation, evaluation after, report. The run's before/after figures are on the test split;
//! the validation split is evaluated before, during (`eval.every`) and after RL. Splits are
//! never pooled. `quickstart` is the same pipeline with the measured quickstart
//! settings (notes/quickstart-recipe.md).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use turnwise_core::metric_keys as mk;
use turnwise_env::world::Split;

use crate::config::TrainConfig;
use crate::run::wandb::{WandbOptions, WandbSidecar};
use crate::run::{MetricsRecord, MetricsWriter, PairedGain, Progress, RunDir, write_report};
use crate::task::TaskSet;
use crate::trainer::eval::{
    EvalEpisode, EvalResult, QuestionOutcome, eval_prefix, paired_gain, question_outcomes,
};
use crate::trainer::rejection::{RsftProgress, RsftReport};
use crate::trainer::{Trainer, WarmStartState};

pub use crate::config::presets::QUICKSTART_OVERRIDES;

/// How a run reports.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The run directory.
    pub dir: PathBuf,
    /// Print only warnings and the final summary.
    pub quiet: bool,
}

/// Greedy and sampled evaluations of one split before and after RL.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SplitEvaluations {
    /// Greedy evaluation of the warm-started model.
    pub before_greedy: Option<EvalResult>,
    /// Sampled evaluation of the warm-started model.
    pub before_sampled: Option<EvalResult>,
    /// Greedy evaluation after RL.
    pub after_greedy: Option<EvalResult>,
    /// Sampled evaluation after RL.
    pub after_sampled: Option<EvalResult>,
}

/// Evaluations before and after RL: the run's figures on the test split (each [`EvalResult`]
/// names its split and `n`), and the same on the validation split.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RunSummary {
    /// Greedy evaluation of the warm-started model on the test split.
    pub before_greedy: Option<EvalResult>,
    /// Sampled evaluation of the warm-started model on the test split.
    pub before_sampled: Option<EvalResult>,
    /// Greedy evaluation after RL on the test split.
    pub after_greedy: Option<EvalResult>,
    /// Sampled evaluation after RL on the test split.
    pub after_sampled: Option<EvalResult>,
    /// The same evaluations on the validation split (whose curve `eval.every` extends during
    /// RL); empty when the task has no validation questions.
    pub validation: SplitEvaluations,
    /// Greedy test evaluations of the starting model before the warm start, one per entry of
    /// `eval.base_shots`: `(shots, result)`.
    pub base: Vec<(usize, EvalResult)>,
    /// EM gains from before to after RL on the same questions, with their paired standard
    /// errors, keyed `gain/<split>/<mode>` (see [`PairedGain`]); a split or decoding that was
    /// not evaluated both times has none.
    pub gains: BTreeMap<String, PairedGain>,
    /// Seconds of the warm start (with the rejection-sampling fine-tuning when enabled).
    pub sft_seconds: f64,
    /// Seconds of the RL phase.
    pub rl_seconds: f64,
    /// Total seconds.
    pub total_seconds: f64,
}

fn say(quiet: bool, msg: impl AsRef<str>) {
    if !quiet {
        println!("{}", msg.as_ref());
    }
}

/// The line of the run's output that counts the questions left out for their overlong prompts
/// (the warning says why), when any was.
fn say_dropped_prompts(quiet: bool, trainer: &Trainer) {
    let d = &trainer.task.dropped_prompts;
    let dropped: usize = d.iter().map(|s| s.dropped).sum();
    if dropped > 0 {
        say(
            quiet,
            format!(
                "data: {dropped} of {} questions left out: their prompts leave no room for a \
                 response (model.max_position_embeddings = {})",
                d.iter().map(|s| s.total).sum::<usize>(),
                trainer.model_config.max_position_embeddings
            ),
        );
    }
}

fn eval_line(name: &str, r: &EvalResult) -> String {
    if let (Some(steps), Some(invalid)) = (r.steps_to_success, r.invalid_actions) {
        return format!(
            "{name:<22} {:<10} n={:<4} | success {:5.1}% ± {:.1} | {:.2} steps to success | \
             invalid actions {:5.1}% | format ok {:5.1}% | {:.2} turns, {:.0} tokens",
            r.split,
            r.n,
            r.em * 100.0,
            r.em_se * 100.0,
            steps,
            invalid * 100.0,
            r.format_ok * 100.0,
            r.turns,
            r.agent_tokens
        );
    }
    let hops: Vec<String> = r
        .em_by_hops
        .iter()
        .map(|(h, (e, n))| format!("{h}-hop {:.1}% (n={n})", e * 100.0))
        .collect();
    // The two-turn rubrics' turn-level parts: did the tool run, and was the gold in its result.
    let rubric = match (
        r.reward_parts.get("tool_execution"),
        r.reward_parts.get("search_result_presence"),
    ) {
        (Some(tool), Some(gold)) => format!(
            " | tool ran {:.1}%, gold in result {:.1}%",
            tool / 0.2 * 100.0,
            gold / 0.5 * 100.0
        ),
        _ => String::new(),
    };
    let pass: String = r
        .pass_at
        .iter()
        .map(|(k, v)| format!(" | pass@{k} {:.1}%", v * 100.0))
        .collect();
    let line = format!(
        "{name:<22} {:<10} n={:<4} | EM {:5.1}% ± {:.1} | F1 {:5.1}% | answered {:5.1}% | {:.2} searches, {:.2} turns, {:.0} tokens | {}",
        r.split,
        r.n,
        r.em * 100.0,
        r.em_se * 100.0,
        r.f1 * 100.0,
        r.answered * 100.0,
        r.tool_calls,
        r.turns,
        r.agent_tokens,
        hops.join(", ")
    );
    line + &pass + &rubric
}

/// Runs the whole pipeline of `cfg` in a new run directory `opts.dir` (an existing run
/// directory is replaced only when `overwrite`).
///
/// Everything that can fail on the configuration (the task, its files and retriever, the
/// tokenizer, the model) is built before the run directory is created or an old run in it is
/// deleted. The warm start is checkpointed every `sft.save_every` steps and at its end
/// (`checkpoints/warm-start-step-N/`, the newest kept), and the warm-started model is
/// checkpointed as step 0 after the evaluations before RL, so a killed run resumes without
/// redoing the warm start, or the part of it already done.
pub fn run(cfg: TrainConfig, opts: &RunOptions, overwrite: bool) -> Result<RunSummary> {
    let quiet = opts.quiet;
    let t_start = Instant::now();
    let trainer = Trainer::new(cfg.clone())?;
    preflight(&cfg, &trainer.task)?;
    let dir = RunDir::create(&opts.dir, overwrite)?;
    dir.write_config(&cfg.to_toml())?;
    say(quiet, format!("run directory: {}", opts.dir.display()));
    say_dropped_prompts(quiet, &trainer);
    let log = open_log(&dir, &cfg, None, quiet)?;
    run_from_start(trainer, &cfg, &dir, log, quiet, t_start)
}

/// The run in `dir` from its beginning, with the fresh `trainer` of `cfg` and its open `log`:
/// the starting model's evaluations, the warm start, and on ([`after_warm_start`]).
fn run_from_start(
    mut trainer: Trainer,
    cfg: &TrainConfig,
    dir: &RunDir,
    mut log: MetricsWriter,
    quiet: bool,
    t_start: Instant,
) -> Result<RunSummary> {
    if let Some((_, prompt)) = trainer.task.first_prompt()? {
        crate::run::write_atomic(&dir.root().join(FIRST_PROMPT_FILE), prompt.as_bytes())?;
    }
    let trainable = match &trainer.lora {
        Some(l) => format!(
            "{} trainable (LoRA rank {} on {})",
            trainer.num_trainable_parameters(),
            l.adapters.config.rank,
            l.adapters.config.target_modules.join(", ")
        ),
        None => "all trainable".to_string(),
    };
    say(
        quiet,
        format!(
            "model: {} parameters, {trainable}, vocabulary {}; preset {}",
            trainer.model_config.num_parameters(),
            trainer.tokenizer.vocab_size(),
            cfg.preset
        ),
    );

    // The starting model before any training, zero- and few-shot (`eval.base_shots`).
    // Its seconds are logged on its eval lines, not counted again as setup.
    let t_base = Instant::now();
    evaluate_base(&mut trainer, cfg, &mut log, quiet)?;
    let clock = PhaseClock {
        t_start,
        t_sft: Instant::now(),
        earlier_sft_seconds: 0.0,
        base_seconds: t_base.elapsed().as_secs_f64(),
    };
    warm_start_phase(&mut trainer, cfg, dir, &mut log, quiet, None, &clock)?;
    after_warm_start(trainer, cfg, dir, log, quiet, &clock)
}

/// When the phases of this process began, for the run's timing line.
struct PhaseClock {
    /// The process's start.
    t_start: Instant,
    /// The warm start's start (in this process).
    t_sft: Instant,
    /// Seconds of the warm start spent by earlier processes (a resumed warm start).
    earlier_sft_seconds: f64,
    /// Seconds of the starting model's evaluations (logged on their own lines).
    base_seconds: f64,
}

/// What a warm-start checkpoint keeps of the pipeline's own state, so that a resumed warm start
/// logs exactly what an uninterrupted one would.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct WarmStartLog {
    /// The losses of the steps after the last `sft` metrics line (as bits, to be exact).
    pending_loss_bits: Vec<u64>,
    /// Seconds the warm start had taken at the checkpoint, over every process.
    seconds: f64,
}

/// The warm start (`sft.steps` updates), from its beginning or from a warm-start checkpoint
/// (`from`): a progress bar, an `sft` metrics line every 2 % of the steps (the mean loss since
/// the last one), and a warm-start checkpoint every `sft.save_every` steps and at the last one,
/// written durably and marked complete before the older one is deleted.
fn warm_start_phase(
    trainer: &mut Trainer,
    cfg: &TrainConfig,
    dir: &RunDir,
    log: &mut MetricsWriter,
    quiet: bool,
    from: Option<(WarmStartState, WarmStartLog)>,
    clock: &PhaseClock,
) -> Result<()> {
    let total = cfg.sft.steps;
    if total == 0 {
        return Ok(());
    }
    let (from, mut recent) = match from {
        Some((state, l)) => (
            Some(state),
            l.pending_loss_bits
                .into_iter()
                .map(f64::from_bits)
                .collect(),
        ),
        None => (None, Vec::new()),
    };
    let start = from.as_ref().map_or(0, WarmStartState::step);
    let every = (total / 50).max(1);
    let save_every = cfg.sft.save_every;
    let bar = (start < total).then(|| Progress::new("warm start", total, quiet));
    if let Some(bar) = &bar {
        bar.set_position(start);
    }
    trainer.warm_start_with(from, &mut |s| {
        if let Some(bar) = &bar {
            bar.set_position(s.step);
        }
        if let Some(loss) = s.loss {
            recent.push(loss);
            if s.step.is_multiple_of(every) || s.step == total {
                let mean = recent.iter().sum::<f64>() / recent.len() as f64;
                recent.clear();
                if let Some(bar) = &bar {
                    bar.set_message(format!("loss {mean:.4}"));
                }
                let m = BTreeMap::from([
                    (mk::sft::LOSS.to_string(), mean),
                    (mk::sft::LR.to_string(), s.lr),
                ]);
                log.write(s.step, "sft", &m)?;
            }
        }
        if save_every > 0 && (s.step.is_multiple_of(save_every) || s.step == total) {
            let path = dir.begin_warm_start_checkpoint(s.step)?;
            let kept = WarmStartLog {
                pending_loss_bits: recent.iter().map(|l| l.to_bits()).collect(),
                seconds: clock.earlier_sft_seconds + clock.t_sft.elapsed().as_secs_f64(),
            };
            s.save(&path, serde_json::to_value(&kept)?)?;
            dir.mark_warm_start_complete(s.step)?;
            dir.prune_warm_start_checkpoints(Some(s.step))?;
        }
        Ok(())
    })?;
    if let Some(bar) = bar {
        let secs = clock.t_sft.elapsed().as_secs_f64();
        bar.finish(match start {
            0 => format!("{} in {secs:.0} s", count(total, "step", "steps")),
            _ => format!(
                "{} in {secs:.0} s after resuming at step {start}",
                count(total - start, "step", "steps")
            ),
        });
    }
    Ok(())
}

/// `1 step`, `2 steps`: `n` with the singular or the plural noun.
pub fn count(n: u64, singular: &str, plural: &str) -> String {
    format!("{n} {}", if n == 1 { singular } else { plural })
}

/// Everything after the warm start: the rejection-sampling fine-tuning (when on), the timing
/// line, the reference model (`warm-start-model/`), the evaluations before RL, the checkpoint of
/// step 0 (after which the warm-start checkpoints are deleted) and the RL phase.
fn after_warm_start(
    mut trainer: Trainer,
    cfg: &TrainConfig,
    dir: &RunDir,
    mut log: MetricsWriter,
    quiet: bool,
    clock: &PhaseClock,
) -> Result<RunSummary> {
    // Rejection-sampling fine-tuning (T2PO's RFT cold start) on the warm-started policy.
    if cfg.rsft.enabled {
        rejection_phase(&mut trainer, cfg, Some(&mut log), quiet)?;
    }
    let this_process = clock.t_sft.elapsed().as_secs_f64();
    let sft_seconds = clock.earlier_sft_seconds + this_process;
    log.write(
        0,
        TIMING_PHASE,
        &BTreeMap::from([
            (WARM_START_SECONDS.to_string(), sft_seconds),
            (
                SETUP_SECONDS.to_string(),
                clock.t_start.elapsed().as_secs_f64() - this_process - clock.base_seconds,
            ),
            (
                PARAMETERS.to_string(),
                trainer.model_config.num_parameters() as f64,
            ),
            (
                TRAINABLE_PARAMETERS.to_string(),
                trainer.num_trainable_parameters() as f64,
            ),
        ]),
    )?;
    // The warm-started weights: the KL reference, and what a resumed run reloads as reference.
    let reference = dir.root().join(REFERENCE_DIR);
    crate::ownership::staging(&reference)?;
    trainer.export(&reference)?;
    crate::ownership::wrote_tree(&reference)?;
    trainer.freeze_reference()?;
    // Remote rollouts: the servers evaluate and roll out the warm-started weights.
    crate::ownership::staging(&dir.root().join(WEIGHTS_DIR))?;
    trainer.sync_remote(&dir.root().join(WEIGHTS_DIR))?;
    calibrate_judge(&trainer, &mut log, quiet)?;
    evaluate(
        &trainer,
        cfg,
        "before RL",
        Split::Validation,
        dir,
        &mut log,
        quiet,
    )?;
    evaluate(
        &trainer,
        cfg,
        "before RL",
        Split::Test,
        dir,
        &mut log,
        quiet,
    )?;
    // Step 0: the warm-started policy with its fresh RL optimizer, so a resume never redoes
    // the warm start; the warm-start checkpoints are not needed any more.
    save_checkpoint(&trainer, cfg, dir)?;
    dir.prune_warm_start_checkpoints(None)?;
    rl_phase(&mut trainer, cfg, dir, &mut log, quiet)
}

/// The metrics phase of the judge's calibration line (step 0).
const JUDGE_CALIBRATION_PHASE: &str = "judge_calibration";

/// The judge's calibration against the rules before RL ([`Trainer::calibrate_judge`]): its
/// metrics are logged and its line printed, then a judge under `judge.min_rubric_agreement`
/// stops the run.
fn calibrate_judge(trainer: &Trainer, log: &mut MetricsWriter, quiet: bool) -> Result<()> {
    let (Some(c), Some(judge)) = (trainer.calibrate_judge()?, trainer.judge()) else {
        return Ok(());
    };
    log.write(0, JUDGE_CALIBRATION_PHASE, &c.metrics())?;
    say(quiet, c.line());
    judge.check_calibration(&c)
}

/// The checks of a run that need its task or the file system, made before the run directory is
/// created or an old run in it is deleted (and by `turnwise config`): the judge, when on, has an
/// endpoint ([`crate::config::JudgeSettings::require_endpoint`]), a fresh tokenizer's
/// `model.vocab_size` is large enough ([`TaskSet::check_vocab_size`]), `model.init_from` exists
/// (or is a packaged model's name), the warm start has demonstrations, every
/// `eval.base_shots` entry has that many training examples, and with `run.wandb` on, the
/// `wandb` Python package imports.
pub fn preflight(cfg: &TrainConfig, task: &TaskSet) -> Result<()> {
    cfg.judge.require_endpoint()?;
    if cfg.model.init_from.is_none() {
        task.check_vocab_size(cfg.model.tokenizer, cfg.model.vocab_size)?;
    }
    if let Some(p) = &cfg.model.init_from
        && !crate::model_source::is_model_name(&p.to_string_lossy())
        && !p.exists()
    {
        bail!("model.init_from: {} does not exist", p.display());
    }
    if cfg.sft.steps > 0 {
        let n = match &cfg.sft.demonstrations {
            Some(path) => crate::trainer::read_demonstrations(path)?.len(),
            None => task
                .demonstrations(Split::Train, cfg.sft.noise, cfg.seed)?
                .len(),
        };
        if n == 0 {
            bail!(
                "sft.steps = {} but there are no demonstrations to warm-start on ({}): set \
                 sft.steps = 0 or give the training split questions",
                cfg.sft.steps,
                match &cfg.sft.demonstrations {
                    Some(p) => format!("{} is empty", p.display()),
                    None => "the task's training split has none".to_string(),
                }
            );
        }
    }
    if cfg.run.wandb.mode().is_some() {
        crate::run::wandb::check_wandb(&crate::run::wandb::python()).context(WANDB_CONTEXT)?;
    }
    if !task.questions(Split::Test).is_empty() {
        for &k in &cfg.eval.base_shots {
            task.few_shot_examples(k)
                .with_context(|| format!("eval.base_shots = {k}"))?;
        }
    }
    Ok(())
}

/// The folder of a run where the weights for remote rollout servers are written
/// (`weights/step-N`, the last two kept).
pub const WEIGHTS_DIR: &str = "weights";

/// The metrics phase of the run's timing lines.
const TIMING_PHASE: &str = "timing";
/// Seconds of the warm start (and rejection fine-tuning), logged once at step 0.
const WARM_START_SECONDS: &str = mk::timing::WARM_START;
/// Seconds spent building the task, tokenizer and model before the warm start.
const SETUP_SECONDS: &str = mk::timing::SETUP;
/// The model's parameter count, logged on the step-0 timing line.
pub const PARAMETERS: &str = mk::perf::MODEL_PARAMETERS;
/// How many of them the optimizer trains (the LoRA adapters' with LoRA), on the same line.
pub const TRAINABLE_PARAMETERS: &str = mk::perf::MODEL_TRAINABLE_PARAMETERS;
/// Seconds of one evaluation (one split, one decoding), logged on its eval line.
const EVAL_SECONDS: &str = mk::timing::EVAL;

/// Writes the checkpoint of the trainer's step, marks it complete and prunes old ones.
fn save_checkpoint(trainer: &Trainer, cfg: &TrainConfig, dir: &RunDir) -> Result<()> {
    let path = dir.begin_checkpoint(trainer.step)?;
    trainer.save(&path)?;
    dir.mark_complete(trainer.step)?;
    dir.prune_checkpoints(cfg.run.keep_checkpoints)?;
    Ok(())
}

/// Rejection-sampling fine-tuning after the warm start ([`Trainer::rejection_finetune`]):
/// progress for the sampling and for the updates, a summary line on stdout (unless `quiet`)
/// and, with `log`, one `rsft` metrics line per update (`rsft/loss`, `rsft/lr`, `rsft/epoch`)
/// and a summary line (`rsft/kept_fraction`, ...; see [`RsftReport::to_metrics`]) at the last
/// update's step.
pub fn rejection_phase(
    trainer: &mut Trainer,
    cfg: &TrainConfig,
    mut log: Option<&mut MetricsWriter>,
    quiet: bool,
) -> Result<RsftReport> {
    let mut sample_bar: Option<Progress> = None;
    let mut train_bar: Option<Progress> = None;
    let mut write_err = None;
    let report = trainer.rejection_finetune(&mut |p| match p {
        RsftProgress::Sampled { done, total } => {
            sample_bar
                .get_or_insert_with(|| Progress::new("rsft sample", total as u64, quiet))
                .set_position(done as u64);
        }
        RsftProgress::Filtered {
            kept,
            sampled,
            steps,
        } => {
            if let Some(bar) = sample_bar.take() {
                bar.finish(format!("kept {kept}/{sampled}"));
            }
            if steps > 0 {
                train_bar = Some(Progress::new("rsft train", steps, quiet));
            }
        }
        RsftProgress::Step {
            step,
            epoch,
            loss,
            lr,
            ..
        } => {
            if let Some(bar) = &train_bar {
                bar.set_position(step);
                bar.set_message(format!("epoch {epoch} loss {loss:.4}"));
            }
            let m = BTreeMap::from([
                (mk::sft::RSFT_LOSS.to_string(), loss),
                (mk::sft::RSFT_LR.to_string(), lr),
                (mk::sft::RSFT_EPOCH.to_string(), epoch as f64),
            ]);
            if let Some(log) = log.as_deref_mut()
                && let Err(e) = log.write(step, "rsft", &m)
            {
                write_err.get_or_insert(e);
            }
        }
    })?;
    if let Some(bar) = train_bar {
        bar.finish(count(report.steps, "step", "steps"));
    }
    if let Some(e) = write_err {
        return Err(e.into());
    }
    if let Some(log) = log {
        log.write(report.steps, "rsft", &report.to_metrics())?;
    }
    let loss = match (report.epoch_loss.first(), report.epoch_loss.last()) {
        (Some(a), Some(b)) => format!(
            "loss {a:.4} -> {b:.4} over {}",
            count(report.epoch_loss.len() as u64, "epoch", "epochs")
        ),
        _ => "nothing to fine-tune on".into(),
    };
    let line = format!(
        "rejection fine-tuning: kept {}/{} rollouts ({:.1}%, {}/{} questions) at reward >= {}; {}, {loss} ({:.0} s sampling, {:.0} s training)",
        report.kept,
        report.sampled,
        report.kept_fraction * 100.0,
        report.questions_covered,
        report.questions,
        cfg.rsft.threshold,
        count(report.steps, "step", "steps"),
        report.sampling_seconds,
        report.training_seconds,
    );
    say(quiet, &line);
    tracing::debug!("{line}");
    Ok(report)
}

/// File (inside the run) holding the prompt of the first training question, as the model
/// sees it (`task.prompt`).
pub const FIRST_PROMPT_FILE: &str = "first_prompt.txt";

pub use crate::run::REFERENCE_DIR;

/// Continues a killed run from its latest complete checkpoint; a run killed before its first
/// checkpoint (the warm-started model, step 0) continues its warm start from its newest
/// warm-start checkpoint, or restarts the warm start when it has none. A checkpoint that cannot be loaded
/// (a torn or corrupt file, weights that are not finite) is set aside as
/// `checkpoints/corrupt-step-N/`, with a warning, and the one before it is used. Resuming a
/// finished run evaluates nothing again: it rewrites summary.json and report.md from the log.
pub fn resume(run_dir: &Path, quiet: bool) -> Result<RunSummary> {
    let dir = RunDir::open_locked(run_dir)?;
    let text = dir.read_config()?;
    let cfg = TrainConfig::from_table(
        text.parse::<toml::Table>()
            .with_context(|| format!("parsing {}", dir.config_path().display()))?,
    )?;
    let reference = dir.root().join(REFERENCE_DIR);
    // Rollout servers that are down stop the resume before any checkpoint is looked at.
    if cfg.rollout.backend == crate::config::RolloutBackend::Remote {
        crate::rollout::remote::RemoteBackend::connect(&cfg.rollout.remote)
            .context("rollout.backend = \"remote\"")?;
    }
    if cfg.run.wandb.mode().is_some() {
        crate::run::wandb::check_wandb(&crate::run::wandb::python()).context(WANDB_CONTEXT)?;
    }
    // Newest first; nothing is moved until one loads, so a resume that finds no loadable
    // checkpoint leaves the run exactly as it was.
    let complete: Vec<_> = dir
        .checkpoints()?
        .into_iter()
        .rev()
        .filter(|c| c.complete)
        .collect();
    let mut failed: Vec<(crate::run::Checkpoint, anyhow::Error)> = Vec::new();
    let mut loaded = None;
    for ck in complete {
        match Trainer::load(cfg.clone(), &ck.path, Some(&reference)) {
            Ok(t) => {
                loaded = Some((ck, t));
                break;
            }
            Err(e)
                if e.chain()
                    .any(|c| c.is::<crate::rollout::remote::ServerUnavailable>()) =>
            {
                return Err(e);
            }
            Err(e) => failed.push((ck, e)),
        }
    }
    let Some((ck, mut trainer)) = loaded else {
        if !failed.is_empty() {
            let list: Vec<String> = failed
                .iter()
                .map(|(c, e)| format!("{} ({e:#})", c.path.display()))
                .collect();
            bail!(
                "no checkpoint of {} loads, so it cannot be resumed; nothing was changed. \
                 Checkpoints tried, newest first: {}. Repair what is named (a checkpoint folder \
                 holds config.json, model.safetensors, tokenizer.json and the trainer state), or \
                 start the run over with `turnwise train --config {} --out {} --overwrite`",
                run_dir.display(),
                list.join("; "),
                dir.config_path().display(),
                run_dir.display()
            );
        }
        let aside = dir.set_aside_checkpoints()?;
        if !aside.is_empty() {
            bail!(
                "{} has no complete checkpoint, only ones an earlier resume set aside as \
                 unloadable ({}); nothing was changed. Repair one (rename it back to \
                 checkpoints/step-N), or start the run over with `turnwise train --config {} \
                 --out {} --overwrite`",
                run_dir.display(),
                aside
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                dir.config_path().display(),
                run_dir.display()
            );
        }
        return resume_before_rl(&dir, &cfg, quiet);
    };
    // Killed between the checkpoint of step 0 and the deletion of the warm start's.
    dir.prune_warm_start_checkpoints(None)?;
    for (bad, e) in &failed {
        let aside = dir.set_aside(bad)?;
        tracing::warn!(
            "the checkpoint {} cannot be loaded ({e:#}); it is set aside as {} and the run \
             resumes from the checkpoint before it",
            bad.path.display(),
            aside.display()
        );
    }
    if !dir.metrics_path().is_file() {
        tracing::warn!(
            "{} is missing: the metrics before step {} are lost, and the summary will lack the \
             evaluations before RL",
            dir.metrics_path().display(),
            ck.step
        );
    }
    let kept = dir.prepare_resume(&["train", "eval", GAIN_PHASE])?;
    debug_assert_eq!(kept.map(|c| c.step), Some(ck.step));
    if ck.step >= cfg.run.steps {
        say(
            quiet,
            format!("{} is finished (step {})", run_dir.display(), ck.step),
        );
    } else {
        say(
            quiet,
            format!("resuming {} from step {}", run_dir.display(), ck.step),
        );
    }
    let mut log = open_log(&dir, &cfg, Some(ck.step), quiet)?;
    rl_phase(&mut trainer, &cfg, &dir, &mut log, quiet)
}

/// Resumes a run that stopped before its first RL checkpoint (step 0): from its newest
/// warm-start checkpoint, continuing the warm start exactly where it was (or, when it was
/// complete, going on to the evaluations before RL); without one, the warm start starts over in
/// the same directory (nothing is deleted but the stopped attempt's metrics lines).
fn resume_before_rl(dir: &RunDir, cfg: &TrainConfig, quiet: bool) -> Result<RunSummary> {
    let t_start = Instant::now();
    let root = dir.root().display();
    let Some(ck) = dir.latest_warm_start_checkpoint()? else {
        let why = if cfg.sft.steps == 0 {
            "the run stopped in its evaluations before RL".to_string()
        } else if cfg.sft.save_every == 0 {
            "the run stopped in its warm start, whose checkpoints are off (sft.save_every = 0)"
                .to_string()
        } else {
            format!(
                "the run stopped in its warm start before its first warm-start checkpoint \
                 (sft.save_every = {})",
                cfg.sft.save_every
            )
        };
        say(
            quiet,
            match cfg.sft.steps {
                0 => format!("{root}: no checkpoint yet ({why}): starting the run over"),
                n => format!(
                    "{root}: no checkpoint yet ({why}): restarting the warm start from step 1/{n}"
                ),
            },
        );
        let trainer = Trainer::new(cfg.clone())?;
        preflight(cfg, &trainer.task)?;
        // The stopped attempt's lines are logged again (only the run's own log is cut).
        dir.check_metrics_rewritable()?;
        dir.metrics_writer()?.retain(|_| false)?;
        let log = open_log(dir, cfg, None, quiet)?;
        return run_from_start(trainer, cfg, dir, log, quiet, t_start);
    };
    let (mut trainer, state, kept) =
        Trainer::load_warm_start(cfg.clone(), &ck.path).with_context(|| {
            format!(
                "the warm-start checkpoint {} cannot be loaded, so the run cannot be resumed; \
                 nothing was changed. Delete it to redo the warm start from step 1, or start the \
                 run over with `turnwise train --config {} --out {root} --overwrite`",
                ck.path.display(),
                dir.config_path().display(),
            )
        })?;
    let kept: WarmStartLog = serde_json::from_value(kept).with_context(|| {
        format!(
            "{}: the warm-start checkpoint holds no state of the run's log",
            ck.path.display()
        )
    })?;
    let n = state.step();
    // The log keeps the starting model's evaluations and the warm start's lines up to the
    // checkpoint; what came after it is logged again.
    let base = format!("{}/", eval_prefix(Split::Test, "base_"));
    dir.check_metrics_rewritable()?;
    dir.metrics_writer()?
        .retain(|r| kept_at_warm_start_resume(r, n, &base))?;
    say(
        quiet,
        format!(
            "{root}: resuming the warm start at step {n}/{}",
            cfg.sft.steps
        ),
    );
    let mut log = open_log(dir, cfg, Some(0), quiet)?;
    let clock = PhaseClock {
        t_start,
        t_sft: Instant::now(),
        earlier_sft_seconds: kept.seconds,
        base_seconds: 0.0,
    };
    warm_start_phase(
        &mut trainer,
        cfg,
        dir,
        &mut log,
        quiet,
        Some((state, kept)),
        &clock,
    )?;
    after_warm_start(trainer, cfg, dir, log, quiet, &clock)
}

/// Whether a metrics line stays when the warm start resumes after its step `step`: the warm
/// start's own lines up to it and the starting model's evaluations (their keys start with
/// `base`), which came before the warm start.
fn kept_at_warm_start_resume(r: &MetricsRecord, step: u64, base: &str) -> bool {
    match r.phase.as_str() {
        "sft" => r.step <= step,
        "eval" => r.step == 0 && r.values.keys().any(|k| k.starts_with(base)),
        _ => false,
    }
}

/// Opens the run's metrics log with the trackers `cfg.run` asks for: TensorBoard event files
/// (`run.tensorboard`), rewritten from the log so that a resumed run's folder holds what
/// `metrics.jsonl` holds, and a Weights & Biases sidecar (`run.wandb`). Each process gets its
/// own W&B run in the group `run.wandb_name` (the run directory's name by default); a resumed
/// one (`resumed_at`: its checkpoint's step) is named `<name> (resumed at step N)` and starts
/// with the whole truncated log, so the newest W&B run of a group holds what `metrics.jsonl`
/// holds.
fn open_log(
    dir: &RunDir,
    cfg: &TrainConfig,
    resumed_at: Option<u64>,
    quiet: bool,
) -> Result<MetricsWriter> {
    let mut log = dir.metrics_writer()?;
    if cfg.run.tensorboard {
        let file = log.attach_tensorboard(dir.tensorboard_dir())?;
        tracing::debug!(file = %file.display(), "TensorBoard events");
    }
    let Some(mode) = cfg.run.wandb.mode() else {
        return Ok(log);
    };
    let root = std::fs::canonicalize(dir.root()).unwrap_or_else(|_| dir.root().to_path_buf());
    let group = cfg.run.wandb_name.clone().unwrap_or_else(|| {
        root.file_name()
            .map_or_else(|| "turnwise".into(), |n| n.to_string_lossy().into_owned())
    });
    let opts = WandbOptions {
        python: crate::run::wandb::python(),
        mode,
        project: cfg.run.wandb_project.clone(),
        entity: cfg.run.wandb_entity.clone(),
        name: match resumed_at {
            Some(step) => format!("{group} (resumed at step {step})"),
            None => group.clone(),
        },
        group,
        job_type: if resumed_at.is_some() {
            "resume"
        } else {
            "train"
        }
        .into(),
        dir: root,
        config: serde_json::to_value(cfg)?,
    };
    // The sidecar fills `wandb/` itself: the run owns it as a whole.
    crate::ownership::staging(&dir.root().join("wandb"))?;
    let sidecar = WandbSidecar::start(&opts).context(WANDB_CONTEXT)?;
    let status = sidecar.status();
    let place = status
        .dir
        .as_deref()
        .unwrap_or("the run directory's wandb/ folder");
    if let Some(reason) = &status.reason {
        tracing::warn!(
            "run.wandb = \"online\", but {reason}: the W&B run is kept offline in {place}; \
             upload it later with `wandb sync {place}`"
        );
    } else if status.mode == "offline" {
        say(
            quiet,
            format!("W&B offline run: {place} (upload it with `wandb sync {place}`)"),
        );
    } else if let Some(url) = &status.url {
        say(quiet, format!("W&B run: {url}"));
    }
    log.attach_wandb(sidecar)?;
    Ok(log)
}

/// The context of a W&B error.
const WANDB_CONTEXT: &str = "run.wandb asks for Weights & Biases logging (set run.wandb = \"off\" \
                             to train without it)";

/// Ends the run's W&B run, if any (waiting for `wandb.finish`), and says where it is; a sidecar
/// that fails now is a warning, not an error (the metrics are all in `metrics.jsonl`).
fn finish_tracking(log: &mut MetricsWriter, quiet: bool) {
    match log.finish_wandb() {
        Ok(Some(status)) => {
            if let Some(url) = status.url.filter(|_| status.mode == "online") {
                say(quiet, format!("W&B run: {url}"));
            } else if let Some(dir) = status.dir {
                say(
                    quiet,
                    format!("W&B offline run: {dir} (upload it with `wandb sync {dir}`)"),
                );
            }
        }
        Ok(None) => {}
        Err(e) => tracing::warn!("{e}"),
    }
}

/// Greedy and sampled evaluations (as `cfg.eval` asks) of the first `eval.questions` questions
/// of `split`, printed and logged at the trainer's step under `eval/<split>/<mode>/…`. A split
/// without questions is skipped with a warning.
fn evaluate(
    t: &Trainer,
    cfg: &TrainConfig,
    when: &str,
    split: Split,
    dir: &RunDir,
    log: &mut MetricsWriter,
    quiet: bool,
) -> Result<(Option<EvalResult>, Option<EvalResult>)> {
    if t.task.questions(split).is_empty() {
        tracing::warn!(
            "the {} split has no questions: the {when} evaluation on it is skipped",
            split.name()
        );
        return Ok((None, None));
    }
    let mut g = None;
    let mut s = None;
    if cfg.eval.greedy {
        let t0 = Instant::now();
        let (r, episodes) =
            t.evaluate_with_episodes(split, cfg.eval.questions, 0.0, cfg.seed ^ 0xe)?;
        write_outcomes(dir, split, "greedy", t.step, &episodes)?;
        say(quiet, eval_line(&format!("{when} greedy"), &r));
        let mut m = r.to_metrics(&eval_prefix(split, "greedy"));
        m.insert(EVAL_SECONDS.into(), t0.elapsed().as_secs_f64());
        log.write(t.step, "eval", &m)?;
        g = Some(r);
    }
    if cfg.eval.sampled {
        let t0 = Instant::now();
        let (r, episodes) = t.evaluate_samples(
            split,
            cfg.eval.questions,
            cfg.rollout.temperature,
            cfg.seed ^ 0xf,
            cfg.eval.samples,
        )?;
        write_outcomes(dir, split, "sampled", t.step, &episodes)?;
        let label = match cfg.eval.samples {
            1 => format!("{when} sampled T={}", cfg.rollout.temperature),
            k => format!("{when} sampled T={} mean@{k}", cfg.rollout.temperature),
        };
        say(quiet, eval_line(&label, &r));
        let mut m = r.to_metrics(&eval_prefix(split, "sampled"));
        m.insert(EVAL_SECONDS.into(), t0.elapsed().as_secs_f64());
        log.write(t.step, "eval", &m)?;
        s = Some(r);
    }
    Ok((g, s))
}

/// Keeps how each question of an evaluation went ([`RunDir::write_eval`]).
fn write_outcomes(
    dir: &RunDir,
    split: Split,
    mode: &str,
    step: u64,
    episodes: &[EvalEpisode],
) -> Result<()> {
    let outcomes: Vec<QuestionOutcome> = question_outcomes(episodes);
    dir.write_eval(split.name(), mode, step, &outcomes)?;
    Ok(())
}

/// The metrics phase of the gain lines.
const GAIN_PHASE: &str = "gain";

/// The metrics prefix of the gain of `split` with decoding `mode`: `gain/<split>/<mode>`.
pub fn gain_prefix(split: Split, mode: &str) -> String {
    format!("gain/{}/{mode}", split.name())
}

/// The EM gains from before RL (step 0) to `step` of every split and decoding both
/// evaluated ([`paired_gain`] of their `evals/` files), printed and logged as one `gain` line
/// at `step` (`gain/<split>/<mode>/{em,se,n,improved,regressed}`). An evaluation without its
/// file (a run resumed from before the files were kept) is skipped with a warning. A task scored
/// by its return (`game`: the games, OpenEnv) prints its success rate over episodes.
fn log_gains(
    dir: &RunDir,
    step: u64,
    log: &mut MetricsWriter,
    quiet: bool,
    game: bool,
) -> Result<BTreeMap<String, PairedGain>> {
    let mut gains = BTreeMap::new();
    let mut m = BTreeMap::new();
    for split in [Split::Validation, Split::Test] {
        for mode in ["greedy", "sampled"] {
            let read = |at| dir.read_eval::<QuestionOutcome>(split.name(), mode, at);
            let (before, after) = match (read(0)?, read(step)?) {
                (Some(b), Some(a)) => (b, a),
                (None, None) => continue,
                _ => {
                    tracing::warn!(
                        "the {} {mode} evaluation before or after RL kept no per-question \
                         file under {}: no paired gain for it",
                        split.name(),
                        dir.evals_dir().display()
                    );
                    continue;
                }
            };
            let g = paired_gain(&before, &after)
                .with_context(|| format!("the {} {mode} gain", split.name()))?;
            let prefix = gain_prefix(split, mode);
            m.extend(g.to_metrics(&prefix));
            say(quiet, gain_line(mode, split, &g, game));
            gains.insert(prefix, g);
        }
    }
    if !m.is_empty() {
        log.write(step, GAIN_PHASE, &m)?;
    }
    Ok(gains)
}

/// The printed line of the paired gain `g` of `split` with decoding `mode`: EM over questions,
/// or, for a task scored by its return (`game`), the success rate over episodes.
fn gain_line(mode: &str, split: Split, g: &PairedGain, game: bool) -> String {
    let (what, item, items) = match game {
        true => ("success", "episode", "episodes"),
        false => ("EM", "question", "questions"),
    };
    format!(
        "gain {mode:<7} {:<10} n={:<4} | {what} {:+.1} ± {:.1} points (paired: {} up, {} down; \
         {:.1} standard errors)",
        split.name(),
        g.n,
        g.gain * 100.0,
        g.se * 100.0,
        count(g.improved as u64, item, items),
        g.regressed,
        if g.se > 0.0 { g.gain / g.se } else { 0.0 },
    )
}

/// The mode name of the starting model's greedy evaluation with `shots` solved examples in the
/// prompt (`eval/test/base_{shots}shot/…`).
pub fn base_mode(shots: usize) -> String {
    format!("base_{shots}shot")
}

/// Greedy evaluations of the starting model (before the warm start) on the first
/// `eval.questions` test questions, once per entry of `eval.base_shots`: with that many of the
/// oracle's solved training questions shown before each question (0: zero-shot). Logged at
/// step 0 under `eval/test/base_{k}shot/…`; the prompts go back to zero-shot afterwards.
fn evaluate_base(
    t: &mut Trainer,
    cfg: &TrainConfig,
    log: &mut MetricsWriter,
    quiet: bool,
) -> Result<()> {
    if cfg.eval.base_shots.is_empty() {
        return Ok(());
    }
    if t.task.questions(Split::Test).is_empty() {
        tracing::warn!("the test split has no questions: eval.base_shots is skipped");
        return Ok(());
    }
    for &k in &cfg.eval.base_shots {
        let t0 = Instant::now();
        let examples = t
            .task
            .few_shot_examples(k)
            .context("eval.base_shots: the few-shot examples")?;
        t.task.set_examples(examples);
        let r = t.evaluate(Split::Test, cfg.eval.questions, 0.0, cfg.seed ^ 0xe);
        t.task.set_examples(Vec::new());
        let r = r?;
        say(
            quiet,
            eval_line(&format!("starting model {k}-shot greedy"), &r),
        );
        let mut m = r.to_metrics(&eval_prefix(Split::Test, &base_mode(k)));
        m.insert(EVAL_SECONDS.into(), t0.elapsed().as_secs_f64());
        log.write(0, "eval", &m)?;
    }
    Ok(())
}

/// The RL steps from the trainer's step to `run.steps`, each logged, sampled and (every
/// `run.save_every` and at the end) checkpointed; validation every `eval.every` steps and the
/// final evaluations of both splits happen before the checkpoint of their step, so that
/// everything logged at a step is on disk once its checkpoint is complete (a resumed run
/// truncates the log after its checkpoint's step and appends nothing twice). The summary is
/// read back from the log.
fn rl_phase(
    trainer: &mut Trainer,
    cfg: &TrainConfig,
    dir: &RunDir,
    log: &mut MetricsWriter,
    quiet: bool,
) -> Result<RunSummary> {
    let bar = Progress::per_step("RL", cfg.run.steps, quiet);
    bar.set_position(trainer.step);
    crate::ownership::staging(&dir.root().join(WEIGHTS_DIR))?;
    trainer.sync_remote(&dir.root().join(WEIGHTS_DIR))?;
    while trainer.step < cfg.run.steps {
        let mut out = trainer.rl_step()?;
        if let Some(secs) = trainer.sync_remote(&dir.root().join(WEIGHTS_DIR))? {
            out.metrics.insert(mk::timing::WEIGHT_SYNC.into(), secs);
        }
        let step = trainer.step;
        bar.set_position(step);
        log.write(step, "train", &out.metrics)?;
        dir.write_samples(step, &out.samples)?;
        let line = step_line(step, cfg.run.steps, &out.metrics);
        let em = out.metrics.get(mk::train::EM).copied().unwrap_or(f64::NAN);
        let what = if trainer.task.scored_by_return() {
            "success"
        } else {
            "em"
        };
        bar.set_message(format!("{what} {em:.3}"));
        bar.step_line(&line);
        let last = step == cfg.run.steps;
        if cfg.eval.every > 0 && step.is_multiple_of(cfg.eval.every) && !last {
            bar.suspend(|| {
                evaluate(
                    trainer,
                    cfg,
                    &format!("step {step}"),
                    Split::Validation,
                    dir,
                    log,
                    quiet,
                )
            })?;
        }
        if last {
            bar.finish(count(cfg.run.steps, "step", "steps"));
            evaluate(trainer, cfg, "after RL", Split::Validation, dir, log, quiet)?;
            evaluate(trainer, cfg, "after RL", Split::Test, dir, log, quiet)?;
            log_gains(dir, step, log, quiet, trainer.task.scored_by_return())?;
        }
        if (cfg.run.save_every > 0 && step.is_multiple_of(cfg.run.save_every)) || last {
            save_checkpoint(trainer, cfg, dir)?;
        }
    }
    let summary = summary_from_log(dir, cfg)?;
    // Atomic: a finished run is recognised by its summary (`runs`, `study run`), so a kill
    // while it is written must not leave a torn one.
    crate::run::write_atomic(
        &dir.root().join("summary.json"),
        serde_json::to_string_pretty(&summary)?.as_bytes(),
    )?;
    let report = write_report(dir)?;
    say(quiet, format!("report: {}", report.display()));
    finish_tracking(log, quiet);
    Ok(summary)
}

/// One RL step's line: score, EM (a game's success and invalid-action rates), kept rollouts,
/// the loss, clip fraction, entropy, gradient norm, length and timing. Metrics a step did not produce (no group carried signal, so no
/// update) are named as such rather than printed as NaN.
fn step_line(step: u64, steps: u64, m: &BTreeMap<String, f64>) -> String {
    let g = |k: &str| m.get(k).copied().filter(|v| v.is_finite());
    let f = |k: &str, prec: usize| match g(k) {
        Some(v) => format!("{v:.prec$}"),
        None => "-".into(),
    };
    let update = if g(mk::actor::PG_LOSS).is_some() {
        format!(
            "pg_loss {:+.4} clipfrac {} entropy {} grad {}",
            g(mk::actor::PG_LOSS).unwrap_or(0.0),
            f(mk::actor::PG_CLIPFRAC, 3),
            f(mk::actor::ENTROPY, 3),
            f(mk::actor::GRAD_NORM, 3),
        )
    } else {
        "no update (no group carried signal)".into()
    };
    // A game's EM is its success rate, shown with its invalid-action rate.
    let em = match g(mk::train::INVALID_ACTIONS) {
        Some(v) => format!("success {} invalid {v:.3}", f(mk::train::EM, 3)),
        None => format!("em {}", f(mk::train::EM, 3)),
    };
    format!(
        "rl {step:>4}/{steps} score {} {em} kept {} {update} len {} ({} s: gen {}, update {})",
        f(mk::critic::SCORE_MEAN, 3),
        f(mk::batch::KEPT_ROLLOUTS, 0),
        f(mk::length::RESPONSE_MEAN, 0),
        f(mk::timing::STEP, 1),
        f(mk::timing::GEN, 1),
        f(mk::timing::UPDATE, 1),
    )
}

/// The run's summary, read from its metrics log: the evaluations of each split at step 0
/// (before RL) and at `run.steps` (after), and the time spent (warm start, RL steps and
/// evaluations, summed over every process that worked on the run).
fn summary_from_log(dir: &RunDir, cfg: &TrainConfig) -> Result<RunSummary> {
    let log = crate::run::read_metrics(dir.metrics_path())?;
    let at = |step: u64, split: Split, mode: &str| -> Option<EvalResult> {
        let prefix = eval_prefix(split, mode);
        let key = format!("{prefix}/em");
        let mut rec = log
            .records
            .iter()
            .filter(|r| r.phase == "eval" && r.step == step && r.get(&key).is_some());
        // Before RL: the first line at step 0; after: the last line at the final step.
        let rec = if step == 0 {
            rec.next()
        } else {
            rec.next_back()
        }?;
        EvalResult::from_metrics(split.name(), &prefix, |k| rec.get(k))
    };
    let end = cfg.run.steps;
    // Folded from +0.0: `Iterator::sum` of no values is -0.0, printed "-0" (a run of 0 RL
    // steps said "RL -0 s").
    let sum = |phase: &str, key: &str| -> f64 {
        log.records
            .iter()
            .filter(|r| r.phase == phase)
            .filter_map(|r| r.get(key))
            .fold(0.0, |a, b| a + b)
    };
    // The gains of the final step's gain line.
    let mut gains = BTreeMap::new();
    if let Some(rec) = log
        .records
        .iter()
        .rfind(|r| r.phase == GAIN_PHASE && r.step == end)
    {
        for split in [Split::Validation, Split::Test] {
            for mode in ["greedy", "sampled"] {
                let prefix = gain_prefix(split, mode);
                let before = at(0, split, mode).map_or(f64::NAN, |r| r.em);
                let Some(g) = PairedGain::from_metrics(&prefix, before, |k| rec.get(k)) else {
                    continue;
                };
                gains.insert(prefix, g);
            }
        }
    }
    let sft_seconds = sum(TIMING_PHASE, WARM_START_SECONDS);
    let rl_seconds = sum("train", mk::timing::STEP);
    let total_seconds =
        sum(TIMING_PHASE, SETUP_SECONDS) + sft_seconds + rl_seconds + sum("eval", EVAL_SECONDS);
    Ok(RunSummary {
        before_greedy: at(0, Split::Test, "greedy"),
        before_sampled: at(0, Split::Test, "sampled"),
        after_greedy: at(end, Split::Test, "greedy"),
        after_sampled: at(end, Split::Test, "sampled"),
        validation: SplitEvaluations {
            before_greedy: at(0, Split::Validation, "greedy"),
            before_sampled: at(0, Split::Validation, "sampled"),
            after_greedy: at(end, Split::Validation, "greedy"),
            after_sampled: at(end, Split::Validation, "sampled"),
        },
        base: cfg
            .eval
            .base_shots
            .iter()
            .filter_map(|&k| Some((k, at(0, Split::Test, &base_mode(k))?)))
            .collect(),
        gains,
        sft_seconds,
        rl_seconds,
        total_seconds,
    })
}

#[cfg(test)]
mod tests {
    use super::QUICKSTART_OVERRIDES;
    use crate::config::TrainConfig;
    use turnwise_env::world::{Split, World};

    /// Counts agree with their nouns, and a game's gain line speaks of success over episodes
    /// (it read "EM … questions up" for games, "1 questions up" for one question).
    #[test]
    fn counts_agree_and_gain_lines_use_the_tasks_words() {
        use super::{count, gain_line};
        assert_eq!(count(1, "step", "steps"), "1 step");
        assert_eq!(count(0, "step", "steps"), "0 steps");
        assert_eq!(
            count(2, "optimizer step", "optimizer steps"),
            "2 optimizer steps"
        );
        let g = crate::run::PairedGain {
            n: 8,
            before: 0.25,
            after: 0.375,
            gain: 0.125,
            se: 0.05,
            improved: 1,
            regressed: 0,
        };
        let game = gain_line("greedy", Split::Test, &g, true);
        assert!(game.contains("| success +12.5 ± 5.0 points"), "{game}");
        assert!(game.contains("(paired: 1 episode up, 0 down;"), "{game}");
        assert!(!game.contains("EM") && !game.contains("question"), "{game}");
        let qa = gain_line("sampled", Split::Validation, &g, false);
        assert!(
            qa.contains("| EM +12.5 ± 5.0 points (paired: 1 question up"),
            "{qa}"
        );
    }

    /// The quickstart's overrides resolve on the a2tgpo preset, and its world names every
    /// held-out person with words that training questions also use.
    #[test]
    fn quickstart_overrides_resolve_to_a_copyable_world() {
        // `preset` is read-only for user overrides: the label is the one override left out.
        let sets: Vec<String> = QUICKSTART_OVERRIDES
            .iter()
            .filter(|s| !s.starts_with("preset="))
            .map(|s| s.to_string())
            .collect();
        let mut cfg = TrainConfig::resolve(Some("a2tgpo"), None, &sets).unwrap();
        assert_eq!(cfg.preset, "a2tgpo");
        cfg.preset = "quickstart".into();
        assert_eq!(
            cfg,
            TrainConfig::resolve(Some("quickstart"), None, &[]).unwrap()
        );
        assert_eq!(cfg.task.format, crate::config::AgentFormatName::SearchR1);
        assert_eq!(cfg.reward.name(), "em");
        assert_eq!(cfg.sft.steps, 1100);
        assert_eq!(cfg.run.steps, 70);
        assert_eq!(cfg.eval.questions, 800);
        assert_eq!(cfg.rollout.temperature, 1.0);
        let world_cfg = &cfg.task.world;
        assert_eq!(world_cfg.person_name_pool, 40);
        assert_eq!(cfg.task.rl_subject_fraction, 0.4);
        let world = World::generate(world_cfg).unwrap();
        // A quarter of the subjects ask the test questions, 5 % the validation ones: 800 test
        // questions, 702 of them distinct.
        let distinct = |s: Split| {
            let texts: std::collections::HashSet<&str> =
                world.questions_in(s).map(|q| q.text.as_str()).collect();
            (world.questions_in(s).count(), texts.len())
        };
        assert_eq!(distinct(Split::Test), (800, 702));
        assert_eq!(distinct(Split::Validation), (150, 138));
        let train_words: std::collections::HashSet<&str> = world
            .questions_in(Split::Train)
            .flat_map(|q| q.subject_name.split(' '))
            .collect();
        let persons = world
            .questions_in(Split::Test)
            .filter(|q| world.entities[q.subject].kind == turnwise_env::world::EntityKind::Person);
        for q in persons {
            for w in q.subject_name.split(' ') {
                assert!(train_words.contains(w), "{}", q.subject_name);
            }
        }
    }

    /// The quickstart's world before 2026-11-25 (held-out subjects halved between 450
    /// validation and 450 test questions; docs/results.md's earlier presets table was measured
    /// on it) is the quickstart with the split's four settings given back, as docs/results.md
    /// says.
    #[test]
    fn the_earlier_quickstart_split_is_four_overrides_away() {
        let resolve = |sets: &[String]| {
            TrainConfig::resolve(Some(crate::config::presets::QUICKSTART_BASE), None, sets)
                .unwrap()
                .task
                .world
        };
        let mut sets: Vec<String> = QUICKSTART_OVERRIDES
            .iter()
            .filter(|s| !s.starts_with("preset="))
            .map(|s| s.to_string())
            .collect();
        let now = World::generate(&resolve(&sets)).unwrap();
        sets.retain(|s| !s.starts_with("task.world.validation_fraction"));
        for s in [
            "task.world.questions.validation=450",
            "task.world.questions.test=450",
        ] {
            sets.push(s.into());
        }
        let halved = resolve(&sets);
        assert_eq!(halved.validation_fraction, None);
        let halved = World::generate(&halved).unwrap();
        sets.push("task.world.validation_fraction=0.15".into());
        let given_back = World::generate(&resolve(&sets)).unwrap();
        assert_eq!(halved.subject_split, given_back.subject_split);
        assert_eq!(halved.questions, given_back.questions);
        assert_ne!(now.subject_split, halved.subject_split);
    }
}
