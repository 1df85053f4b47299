//! Whole runs: warm start, evaluation before, RL steps with metrics and checkpoints,
//! evaluation after, report. `quickstart` is the same pipeline with the measured quickstart
//! settings (notes/quickstart-recipe.md).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use turnwise_env::world::Split;

use crate::config::TrainConfig;
use crate::trainer::Trainer;
use crate::trainer::eval::EvalResult;

/// Overrides of the quickstart on top of the `a2tgpo` preset.
pub const QUICKSTART_OVERRIDES: &[&str] = &[
    "preset=\"quickstart\"",
    "sft.steps=1100",
    "sft.batch_size=16",
    "sft.lr=2e-3",
    "rollout.prompts_per_step=16",
    "rollout.group_size=8",
    "optim.lr=2e-4",
    "run.steps=40",
    "run.save_every=20",
    "eval.questions=300",
];

/// How a run reports.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The run directory.
    pub dir: PathBuf,
    /// Print only warnings and the final summary.
    pub quiet: bool,
}

/// Evaluations before and after RL.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RunSummary {
    /// Greedy evaluation of the warm-started model.
    pub before_greedy: Option<EvalResult>,
    /// Sampled evaluation of the warm-started model.
    pub before_sampled: Option<EvalResult>,
    /// Greedy evaluation after RL.
    pub after_greedy: Option<EvalResult>,
    /// Sampled evaluation after RL.
    pub after_sampled: Option<EvalResult>,
    /// Seconds of the warm start.
    pub sft_seconds: f64,
    /// Seconds of the RL phase.
    pub rl_seconds: f64,
    /// Total seconds.
    pub total_seconds: f64,
}

/// Appends JSON lines and flushes each.
pub struct MetricsLog {
    file: std::fs::File,
}

impl MetricsLog {
    /// Opens `path` for appending.
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        Ok(Self { file })
    }

    /// Writes one line `{"step", "phase", metrics...}`; non-finite values become null.
    pub fn write(&mut self, step: u64, phase: &str, metrics: &BTreeMap<String, f64>) -> Result<()> {
        let mut obj = serde_json::Map::new();
        obj.insert("step".into(), step.into());
        obj.insert("phase".into(), phase.into());
        for (k, v) in metrics {
            let val = serde_json::Number::from_f64(*v)
                .map(serde_json::Value::Number)
                .unwrap_or(serde_json::Value::Null);
            obj.insert(k.clone(), val);
        }
        writeln!(self.file, "{}", serde_json::Value::Object(obj))?;
        self.file.sync_data()?;
        Ok(())
    }
}

fn say(quiet: bool, msg: impl AsRef<str>) {
    if !quiet {
        println!("{}", msg.as_ref());
    }
}

fn eval_line(name: &str, r: &EvalResult) -> String {
    let hops: Vec<String> = r
        .em_by_hops
        .iter()
        .map(|(h, (e, n))| format!("{h}-hop {:.1}% (n={n})", e * 100.0))
        .collect();
    format!(
        "{name:<16} EM {:5.1}% ± {:.1} | F1 {:5.1}% | answered {:5.1}% | {:.2} searches, {:.2} turns, {:.0} tokens | {}",
        r.em * 100.0,
        r.em_se * 100.0,
        r.f1 * 100.0,
        r.answered * 100.0,
        r.tool_calls,
        r.turns,
        r.agent_tokens,
        hops.join(", ")
    )
}

/// Runs the whole pipeline of `cfg` in `opts.dir`.
pub fn run(cfg: TrainConfig, opts: &RunOptions) -> Result<RunSummary> {
    let t_start = Instant::now();
    std::fs::create_dir_all(&opts.dir)
        .with_context(|| format!("creating the run directory {}", opts.dir.display()))?;
    std::fs::write(opts.dir.join("config.toml"), cfg.to_toml()).context("writing config.toml")?;
    let mut log = MetricsLog::open(&opts.dir.join("metrics.jsonl"))?;
    let quiet = opts.quiet;
    say(quiet, format!("run directory: {}", opts.dir.display()));
    let mut trainer = Trainer::new(cfg.clone())?;
    say(
        quiet,
        format!(
            "model: {} parameters, vocabulary {}",
            trainer.model_config.num_parameters(),
            trainer.tokenizer.vocab_size()
        ),
    );

    // Warm start.
    let t_sft = Instant::now();
    let total = cfg.sft.steps;
    let every = (total / 20).max(1);
    let mut recent = Vec::new();
    trainer.warm_start(&mut |step, loss, lr| {
        recent.push(loss);
        if step % every == 0 || step == total {
            let mean = recent.iter().sum::<f64>() / recent.len() as f64;
            recent.clear();
            let m = BTreeMap::from([("sft/loss".to_string(), mean), ("sft/lr".to_string(), lr)]);
            if let Err(e) = log.write(step, "sft", &m) {
                tracing::error!(error = %e, "cannot write a metrics line");
            }
            say(
                quiet,
                format!(
                    "sft {step:>5}/{total} loss {mean:.4} lr {lr:.2e} ({:.0} s)",
                    t_sft.elapsed().as_secs_f64()
                ),
            );
        }
    })?;
    let sft_seconds = t_sft.elapsed().as_secs_f64();
    if cfg.sft.steps > 0 {
        trainer.export(&opts.dir.join("sft-model"))?;
    }
    trainer.freeze_reference()?;

    let heldout = [Split::Validation, Split::Test];
    let evaluate = |t: &Trainer,
                    when: &str,
                    log: &mut MetricsLog|
     -> Result<(Option<EvalResult>, Option<EvalResult>)> {
        let mut g = None;
        let mut s = None;
        if cfg.eval.greedy {
            let r = t.evaluate(&heldout, cfg.eval.questions, 0.0, cfg.seed ^ 0xe)?;
            say(quiet, eval_line(&format!("{when} greedy"), &r));
            log.write(t.step, "eval", &r.to_metrics("eval/greedy"))?;
            g = Some(r);
        }
        if cfg.eval.sampled {
            let r = t.evaluate(
                &heldout,
                cfg.eval.questions,
                cfg.rollout.temperature,
                cfg.seed ^ 0xf,
            )?;
            say(quiet, eval_line(&format!("{when} sampled"), &r));
            log.write(t.step, "eval", &r.to_metrics("eval/sampled"))?;
            s = Some(r);
        }
        Ok((g, s))
    };
    let (before_greedy, before_sampled) = evaluate(&trainer, "before RL", &mut log)?;

    let t_rl = Instant::now();
    let ckpt_dir = opts.dir.join("checkpoints");
    let samples_dir = opts.dir.join("samples");
    std::fs::create_dir_all(&samples_dir)?;
    for _ in 0..cfg.run.steps {
        let out = trainer.rl_step()?;
        let step = trainer.step;
        log.write(step, "train", &out.metrics)?;
        let traj: Vec<_> = out
            .episodes
            .iter()
            .take(cfg.run.samples_per_step)
            .map(|e| e.trajectory.clone())
            .collect();
        let path = samples_dir.join(format!("step-{step:05}.jsonl"));
        let file =
            std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let mut w = std::io::BufWriter::new(file);
        turnwise_core::trajectory::jsonl::write_jsonl(&mut w, &traj)?;
        w.flush()?;
        let g = |k: &str| out.metrics.get(k).copied().unwrap_or(f64::NAN);
        say(
            quiet,
            format!(
                "rl {step:>4}/{} score {:.3} em {:.3} kept {:>3} pg_loss {:+.4} clipfrac {:.3} entropy {:.3} grad {:.3} len {:.0} ({:.1} s: gen {:.1}, update {:.1})",
                cfg.run.steps,
                g("critic/score/mean"),
                g("train/em"),
                g("batch/kept_rollouts"),
                g("actor/pg_loss"),
                g("actor/pg_clipfrac"),
                g("actor/entropy"),
                g("actor/grad_norm"),
                g("response_length/mean"),
                g("timing_s/step"),
                g("timing_s/gen"),
                g("timing_s/update"),
            ),
        );
        if cfg.run.save_every > 0 && step % cfg.run.save_every == 0 || step == cfg.run.steps {
            trainer.save(&ckpt_dir.join(format!("step-{step:05}")))?;
        }
        if cfg.eval.every > 0 && step % cfg.eval.every == 0 && step != cfg.run.steps {
            evaluate(&trainer, &format!("step {step}"), &mut log)?;
        }
    }
    let rl_seconds = t_rl.elapsed().as_secs_f64();
    let (after_greedy, after_sampled) = evaluate(&trainer, "after RL", &mut log)?;
    let summary = RunSummary {
        before_greedy,
        before_sampled,
        after_greedy,
        after_sampled,
        sft_seconds,
        rl_seconds,
        total_seconds: t_start.elapsed().as_secs_f64(),
    };
    std::fs::write(
        opts.dir.join("summary.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    Ok(summary)
}
