//! `turnwise study report`: aggregates the finished runs of a study into `report.md`,
//! `report.json` (the same numbers, for tools and tests) and `plots/*.svg`.
//!
//! Every figure comes from the runs' own files: the panel outcomes after RL
//! (`evals/test-<mode>-step-<budget>.jsonl`, checked against `panel.json`), `summary.json` and
//! `metrics.jsonl`. Only finished runs (with a `summary.json`) count.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::Serialize;
use turnwise_core::metric_keys as mk;

use super::stats::{
    BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, Interval, mean, paired_bootstrap, t_interval,
};
use super::{Audit, Metric, Panels, RunId, Study, StudyFile, is_finished, read_panels};
use crate::run::{LineChart, MetricsLog, RunDir, Series, read_metrics};
use crate::trainer::eval::QuestionOutcome;

/// One finished run's data.
#[derive(Debug, Clone)]
pub struct RunData {
    /// The RL seed.
    pub seed: u64,
    /// Per mode (`greedy`, `sampled`): the panel outcomes after RL.
    pub after: BTreeMap<&'static str, Vec<QuestionOutcome>>,
    /// `summary.json`.
    pub summary: serde_json::Value,
    /// `metrics.jsonl`.
    pub metrics: MetricsLog,
}

impl RunData {
    /// The panel mean of `metric` after RL (`None` when that mode was not evaluated).
    pub fn value(&self, metric: Metric) -> Option<f64> {
        let qs = self.after.get(metric.mode())?;
        let xs: Vec<f64> = qs
            .iter()
            .map(|q| if metric.is_f1() { q.f1 } else { q.em })
            .collect();
        Some(mean(&xs))
    }

    /// The per-question outcomes of `metric` after RL, in panel order.
    fn outcomes(&self, metric: Metric) -> Option<Vec<f64>> {
        let qs = self.after.get(metric.mode())?;
        Some(
            qs.iter()
                .map(|q| if metric.is_f1() { q.f1 } else { q.em })
                .collect(),
        )
    }

    /// A number of `summary.json` at `path` (`["after_greedy", "em"]`); a game's `success`
    /// stands for `em`.
    fn summary_num(&self, path: &[&str]) -> Option<f64> {
        let mut v = &self.summary;
        for (i, k) in path.iter().enumerate() {
            v = match v.get(*k) {
                Some(x) => x,
                None if i + 1 == path.len() && *k == "em" => v.get("success")?,
                None => return None,
            };
        }
        v.as_f64()
    }
}

/// One arm's finished runs.
#[derive(Debug, Clone)]
pub struct ArmData {
    /// The arm's name.
    pub name: String,
    /// Its preset.
    pub preset: String,
    /// Its warm start.
    pub warm_start: String,
    /// Its baseline.
    pub baseline: String,
    /// The finished runs, in seed order.
    pub runs: Vec<RunData>,
    /// Runs of the study's seeds not finished yet.
    pub unfinished: Vec<u64>,
}

/// An interval as report.json writes it (`null` for a missing end).
#[derive(Debug, Clone, Serialize)]
pub struct JsonInterval {
    /// The estimate.
    pub mean: f64,
    /// 95 % lower end.
    pub lo: Option<f64>,
    /// 95 % upper end.
    pub hi: Option<f64>,
    /// Seeds it rests on.
    pub n: usize,
}

impl From<Interval> for JsonInterval {
    fn from(i: Interval) -> Self {
        let f = |v: f64| v.is_finite().then_some(v);
        Self {
            mean: i.mean,
            lo: f(i.lo),
            hi: f(i.hi),
            n: i.n,
        }
    }
}

/// The numbers of a report (`report.json`).
#[derive(Debug, Clone, Serialize)]
pub struct ReportNumbers {
    /// The study's name.
    pub study: String,
    /// Runs finished, of all.
    pub finished: usize,
    /// Every run of the study.
    pub runs: usize,
    /// Bootstrap resamples and generator seed.
    pub bootstrap: (usize, u64),
    /// Per arm and metric name: the mean over seeds with its 95 % t-interval.
    pub arms: BTreeMap<String, BTreeMap<String, JsonInterval>>,
    /// Per arm (not the baseline) and metric: the paired difference arm − baseline with its
    /// 95 % bootstrap interval.
    pub vs_baseline: BTreeMap<String, BTreeMap<String, JsonInterval>>,
    /// Per claim: the difference better − than, its interval and the verdict.
    pub claims: BTreeMap<String, ClaimResult>,
    /// Per finished audit (`[[audit]]`): what it read and each estimator's agreement with the
    /// replay (`audit/<name>/audit.json` has every turn).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub audits: BTreeMap<String, AuditNumbers>,
}

/// A finished audit's numbers in the study's report.
#[derive(Debug, Clone, Serialize)]
pub struct AuditNumbers {
    /// The run it read (`warm/<name>` or `<arm>/seed-<s>`).
    pub run: String,
    /// The decision density the world states (`task.world.decision_density`).
    pub stated_density: Option<f64>,
    /// The share of audited turns whose replay advantage is non-zero beyond twice its error.
    pub realised_density: f64,
    /// Turns audited.
    pub turns: usize,
    /// Mean return of the audited episodes.
    pub mean_return: f64,
    /// Per estimator: Spearman's ρ with the replay advantage and the sign agreement on
    /// decisive turns, each `[value, 2.5 %, 97.5 %]` (`null` where undefined).
    pub estimators: BTreeMap<String, AuditScores>,
    /// Estimators the audit left out, with why.
    pub skipped: BTreeMap<String, String>,
}

/// An estimator's agreement with the replay in one audit.
#[derive(Debug, Clone, Serialize)]
pub struct AuditScores {
    /// Spearman's ρ `[value, low, high]`.
    pub spearman: [Option<f64>; 3],
    /// Sign agreement on decisive turns `[value, low, high]`.
    pub sign_agreement: [Option<f64>; 3],
    /// Decisive turns scored.
    pub decisive: usize,
    /// The permutation test of Spearman's ρ (the estimates shuffled over the audited turns as
    /// the audit's own test shuffles them), from the audit's turns.
    pub spearman_null: Option<crate::audit::score::NullTest>,
}

/// Reads the finished audit `name` of the study directory `out` (`None` when not finished).
fn read_audit(out: &Path, name: &str, run: &str) -> Result<Option<AuditNumbers>> {
    let path = RunId::Audit(name.into()).dir(out).join("audit.json");
    let Ok(bytes) = std::fs::read(&path) else {
        return Ok(None);
    };
    let v: serde_json::Value = serde_json::from_slice(&bytes)
        .with_context(|| format!("{} does not parse", path.display()))?;
    let triple =
        |e: &serde_json::Value| [e["value"].as_f64(), e["low"].as_f64(), e["high"].as_f64()];
    let turns = v["audited"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    // The audit's own permutation settings (its `--bootstrap` and seed), so that the test
    // here is the one its audit.md shows; audits written before the test had none.
    let shuffles = v["bootstrap"].as_u64().unwrap_or(1000) as usize;
    let seed = v["seed"].as_u64().unwrap_or(0);
    let replay: Vec<f64> = turns
        .iter()
        .map(|t| t["replay"]["advantage"].as_f64().unwrap_or(0.0))
        .collect();
    let estimators = v["estimators"]
        .as_array()
        .with_context(|| format!("{} has no estimators", path.display()))?
        .iter()
        .map(|e| {
            let o = &e["overall"];
            let name = e["name"].as_str().unwrap_or("?").to_string();
            let credit: Vec<f64> = turns
                .iter()
                .map(|t| t["credit"][&name].as_f64().unwrap_or(0.0))
                .collect();
            (
                name,
                AuditScores {
                    spearman: triple(&o["spearman"]),
                    sign_agreement: triple(&o["sign_agreement"]),
                    decisive: o["decisive"].as_u64().unwrap_or(0) as usize,
                    spearman_null: crate::audit::score::spearman_null(
                        &credit, &replay, shuffles, seed,
                    ),
                },
            )
        })
        .collect();
    let skipped = v["skipped"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|s| {
                    (
                        s[0].as_str().unwrap_or("?").to_string(),
                        s[1].as_str().unwrap_or("").to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(Some(AuditNumbers {
        run: run.to_string(),
        stated_density: v["stated_density"].as_f64(),
        realised_density: v["realised_density"].as_f64().unwrap_or(0.0),
        turns: v["turns"].as_u64().unwrap_or(0) as usize,
        mean_return: v["mean_return"].as_f64().unwrap_or(0.0),
        estimators,
        skipped,
    }))
}

/// `0.41 [0.12, 0.66]`, or `–` where undefined.
fn triple_cell(t: &[Option<f64>; 3], digits: usize) -> String {
    match t {
        [Some(v), Some(lo), Some(hi)] => format!("{v:.digits$} [{lo:.digits$}, {hi:.digits$}]"),
        [Some(v), _, _] => format!("{v:.digits$}"),
        _ => "–".into(),
    }
}

/// The report's section on the study's audits (empty when it declares none).
fn audit_section(study: &Study, out: &Path, numbers: &mut ReportNumbers) -> Result<String> {
    let file = &study.file;
    if file.audits.is_empty() {
        return Ok(String::new());
    }
    let mut md = String::new();
    let _ = writeln!(
        md,
        "\n## Turn credit against the replay oracle\n\nEach audit (`turnwise credit-audit`, \
         docs/credit-audit.md) resamples K alternatives at every turn of its episodes from the \
         exact state and rolls each forward M times with the audited run's policy: the replay \
         advantage of the taken turn is its mean return minus the alternatives'. A turn is \
         decisive when that is non-zero beyond twice its standard error; the realised density \
         is the share of decisive turns. Each estimator's per-turn advantage, computed in its \
         own groups as in training, is scored by Spearman's ρ with the replay advantage over all \
         audited turns and by the share of decisive turns whose sign it gets; brackets: 95 % \
         bootstrap over episodes. `random` is a seeded uniform draw per turn, the floor. Every \
         turn is in `audit/<name>/audit.json`.\n"
    );
    let mut found = Vec::new();
    for a in &file.audits {
        match read_audit(out, &a.name, &a.run)? {
            Some(n) => found.push((a, n)),
            None => {
                let _ = writeln!(md, "- `{}` (of `{}`): not finished yet.", a.name, a.run);
            }
        }
    }
    if found.is_empty() {
        return Ok(md);
    }
    let _ = writeln!(
        md,
        "| audit | run | K × M | episodes | turns | mean return | stated ρ | realised ρ |\n\
         |---|---|---|---:|---:|---:|---:|---:|"
    );
    for (a, n) in &found {
        let _ = writeln!(
            md,
            "| `{}` | `{}` | {} × {} | {} | {} | {:.3} | {} | {:.2} |",
            a.name,
            a.run,
            a.alternatives,
            a.rollouts,
            a.episodes,
            n.turns,
            n.mean_return,
            n.stated_density.map_or("–".into(), |d| format!("{d}")),
            n.realised_density
        );
    }
    write_estimator_scores(&mut md, &found);
    for (a, n) in found {
        numbers.audits.insert(a.name.clone(), n);
    }
    Ok(md)
}

/// The audits' tables of each estimator's scores against the replay (Spearman's ρ with its
/// p-value, sign agreement on decisive turns), the random floor last, and why an estimator was
/// left out.
fn write_estimator_scores(md: &mut String, found: &[(&Audit, AuditNumbers)]) {
    let mut names: Vec<String> = Vec::new();
    for (_, n) in found {
        for k in n.estimators.keys() {
            if !names.contains(k) {
                names.push(k.clone());
            }
        }
    }
    // The random floor last, as the audits list it.
    names.sort_by_key(|k| (k == crate::audit::RANDOM, k.clone()));
    for (title, pick, with_p) in [
        (
            "Spearman's ρ of each estimator's turn advantage with the replay advantage \
             [bootstrap 95 %], and p: the share of shuffles of the estimator's advantages over \
             the turns that reach it (what chance reaches with the same ties)",
            (|s: &AuditScores| s.spearman) as fn(&AuditScores) -> [Option<f64>; 3],
            true,
        ),
        (
            "Sign agreement on the decisive turns",
            |s: &AuditScores| s.sign_agreement,
            false,
        ),
    ] {
        let _ = writeln!(md, "\n{title}:\n");
        let header: Vec<String> = found.iter().map(|(a, _)| format!("`{}`", a.name)).collect();
        let _ = writeln!(
            md,
            "| estimator | {} |\n|---|{}",
            header.join(" | "),
            "---|".repeat(found.len())
        );
        for name in &names {
            let cells: Vec<String> = found
                .iter()
                .map(
                    |(_, n)| match (n.estimators.get(name), n.skipped.get(name)) {
                        (Some(s), _) => match (with_p, s.spearman_null) {
                            (true, Some(n)) => {
                                format!("{}, p {:.3}", triple_cell(&pick(s), 2), n.p_value)
                            }
                            _ => triple_cell(&pick(s), 2),
                        },
                        (None, Some(_)) => "left out".into(),
                        (None, None) => "–".into(),
                    },
                )
                .collect();
            let _ = writeln!(md, "| {name} | {} |", cells.join(" | "));
        }
    }
    let mut why: BTreeMap<&str, &str> = BTreeMap::new();
    for (_, n) in found {
        for (k, v) in &n.skipped {
            why.entry(k.as_str()).or_insert(v.as_str());
        }
    }
    if !why.is_empty() {
        let _ = writeln!(md);
        for (k, v) in why {
            let _ = writeln!(md, "- {k} left out: {v}.");
        }
    }
}

/// A claim's result.
#[derive(Debug, Clone, Serialize)]
pub struct ClaimResult {
    /// The difference `better − than` with its interval (`None` until both arms have a
    /// finished run of a common seed).
    pub ours: Option<JsonInterval>,
    /// `reproduced`, `reversed`, `inconclusive` or `pending`.
    pub verdict: String,
}

/// Reads the finished runs of every arm, checking each run's panel outcomes against
/// `panel.json`.
pub fn collect(study: &Study, out: &Path, panels: &Panels) -> Result<Vec<ArmData>> {
    let steps = study.file.budget.steps;
    let mut arms = Vec::new();
    for arm in &study.file.arms {
        let ws = study.file.warm_start_of(arm).to_string();
        let panel = panels
            .panels
            .get(&ws)
            .with_context(|| format!("{} has no panel for the warm start {ws:?}", out.display()))?;
        let mut runs = Vec::new();
        let mut unfinished = Vec::new();
        for &seed in &study.file.seeds {
            let id = RunId::Arm(arm.name.clone(), seed);
            let dir = id.dir(out);
            if !is_finished(&dir) {
                unfinished.push(seed);
                continue;
            }
            let run = RunDir::open(&dir)?;
            let mut after = BTreeMap::new();
            for (mode, on) in [
                ("greedy", study.file.panel.greedy),
                ("sampled", study.file.panel.sampled),
            ] {
                if !on {
                    continue;
                }
                let path = run.eval_path("test", mode, steps);
                let qs: Vec<QuestionOutcome> = run
                    .read_eval("test", mode, steps)?
                    .with_context(|| format!("{} is missing", path.display()))?;
                let ids: Vec<&str> = qs.iter().map(|q| q.question_id.as_str()).collect();
                let want: Vec<&str> = panel.questions.iter().map(String::as_str).collect();
                if ids != want {
                    bail!(
                        "{} evaluated other questions than the panel of {} ({} questions, first \
                         {:?}; the panel has {}, first {:?})",
                        path.display(),
                        out.join(super::PANEL_FILE).display(),
                        ids.len(),
                        ids.first(),
                        want.len(),
                        want.first()
                    );
                }
                after.insert(mode, qs);
            }
            let summary_path = dir.join("summary.json");
            let summary = serde_json::from_str(
                &std::fs::read_to_string(&summary_path)
                    .with_context(|| format!("reading {}", summary_path.display()))?,
            )
            .with_context(|| format!("parsing {}", summary_path.display()))?;
            let metrics = read_metrics(run.metrics_path())?;
            runs.push(RunData {
                seed,
                after,
                summary,
                metrics,
            });
        }
        arms.push(ArmData {
            name: arm.name.clone(),
            preset: arm.preset.clone(),
            baseline: study.file.baseline_of(arm).to_string(),
            warm_start: ws,
            runs,
            unfinished,
        });
    }
    Ok(arms)
}

/// The paired difference `a − b` on `metric` over the seeds both have finished, with its
/// bootstrap interval ([`paired_bootstrap`]).
pub fn paired_difference(a: &ArmData, b: &ArmData, metric: Metric) -> Option<Interval> {
    let mut rows = Vec::new();
    for ra in &a.runs {
        let Some(rb) = b.runs.iter().find(|r| r.seed == ra.seed) else {
            continue;
        };
        let (Some(xa), Some(xb)) = (ra.outcomes(metric), rb.outcomes(metric)) else {
            continue;
        };
        rows.push(xa.iter().zip(&xb).map(|(x, y)| x - y).collect::<Vec<_>>());
    }
    paired_bootstrap(&rows, BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED)
}

/// The mean over seeds of `metric` with its t-interval.
pub fn arm_interval(arm: &ArmData, metric: Metric) -> Option<Interval> {
    let xs: Vec<f64> = arm.runs.iter().filter_map(|r| r.value(metric)).collect();
    t_interval(&xs)
}

fn pct(v: f64) -> String {
    if v.is_finite() {
        format!("{:.1}", v * 100.0)
    } else {
        "–".into()
    }
}

/// `54.0 [44.1, 63.9]` (percent), or the mean alone without an interval.
fn pct_interval(i: Option<Interval>, signed: bool) -> String {
    let Some(i) = i else {
        return "–".into();
    };
    let m = if signed {
        format!("{:+.1}", i.mean * 100.0)
    } else {
        pct(i.mean)
    };
    if i.lo.is_finite() && i.hi.is_finite() {
        format!(
            "{m} [{}, {}]",
            signed_pct(i.lo, signed),
            signed_pct(i.hi, signed)
        )
    } else {
        m
    }
}

/// An arm's cell: the mean over seeds with its Student-t interval clipped to the metric's range
/// [0, 100] % and marked `*` when clipped (two or three seeds give wide intervals that reach
/// past it); `(n seeds, all equal)` when the seeds agree, since a zero spread is not a
/// certainty; the mean alone with one seed.
fn arm_cell(i: Option<Interval>) -> String {
    let Some(i) = i else {
        return "–".into();
    };
    if i.n >= 2 && (i.hi - i.lo).abs() < 1e-12 {
        return format!("{} ({} seeds, all equal)", pct(i.mean), i.n);
    }
    if !(i.lo.is_finite() && i.hi.is_finite()) {
        return pct_interval(Some(i), false);
    }
    let (lo, hi) = (i.lo.clamp(0.0, 1.0), i.hi.clamp(0.0, 1.0));
    let clipped = if lo != i.lo || hi != i.hi { "*" } else { "" };
    format!("{} [{}, {}]{clipped}", pct(i.mean), pct(lo), pct(hi))
}

fn signed_pct(v: f64, signed: bool) -> String {
    if signed {
        format!("{:+.1}", v * 100.0)
    } else {
        pct(v)
    }
}

/// The verdict of a claim's interval: above 0 reproduced, below reversed, else inconclusive;
/// pending until it rests on two paired seeds (with one, the bootstrap over questions holds the
/// panel's noise but none of the seeds', and would call a verdict a second seed can undo).
pub fn verdict(i: Option<Interval>) -> &'static str {
    match i.filter(|i| i.n >= 2).map(|i| i.sign()) {
        None => "pending",
        Some(Some(true)) => "reproduced",
        Some(Some(false)) => "reversed",
        Some(None) => "inconclusive",
    }
}

/// A metrics key's mean over a run's `train` lines.
fn train_mean(log: &MetricsLog, key: &str) -> Option<f64> {
    let xs: Vec<f64> = log.phase("train").filter_map(|r| r.get(key)).collect();
    (!xs.is_empty()).then(|| mean(&xs))
}

/// Mean over `xs`, `–` when empty, with `digits` decimals.
fn mean_cell(xs: &[f64], digits: usize) -> String {
    if xs.is_empty() {
        "–".into()
    } else {
        format!("{:.digits$}", mean(xs))
    }
}

/// The curves a report draws: a metrics key, its title and file stem.
const CURVES: &[(&str, &str, &str)] = &[
    (
        mk::critic::SCORE_MEAN,
        "reward (mean score of a step's rollouts)",
        "reward",
    ),
    (mk::train::EM, "training EM (a step's rollouts)", "train-em"),
    (
        mk::eval::VALIDATION_GREEDY_EM,
        "validation EM, greedy (eval.every)",
        "validation-em",
    ),
];

/// Per step over a group's runs: the mean and the min–max band of `key`.
/// A curve's mean points and its `(x, low, high)` band.
type Curve = (Vec<(f64, f64)>, Vec<(f64, f64, f64)>);

fn seed_band(runs: &[RunData], key: &str) -> Curve {
    let mut by_step: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
    for r in runs {
        let phase = if key.starts_with(mk::eval::PREFIX) {
            "eval"
        } else {
            "train"
        };
        for rec in r.metrics.phase(phase) {
            if let Some(v) = rec.get(key) {
                by_step.entry(rec.step).or_default().push(v);
            }
        }
    }
    let mut line = Vec::new();
    let mut band = Vec::new();
    for (step, xs) in by_step {
        let lo = xs.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        line.push((step as f64, mean(&xs)));
        band.push((step as f64, lo, hi));
    }
    (line, band)
}

/// Counts of one turn position over sampled episodes ([`turn_health`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TurnHealth {
    /// Turns seen at this position.
    pub turns: usize,
    /// Turns whose format broke (`format_ok` false, or an invalid action).
    pub broken: usize,
    /// Searches with an empty query.
    pub empty_searches: usize,
    /// Searches repeating a query the episode already searched (case and spaces ignored).
    pub repeated_searches: usize,
}

/// Adds the turns of one sampled episode (a line of `samples/step-N.jsonl`) to `by_turn`, by
/// turn position (the last position holds that one and every later turn).
pub fn turn_health(episode: &serde_json::Value, by_turn: &mut [TurnHealth]) {
    let Some(turns) = episode.get("turns").and_then(serde_json::Value::as_array) else {
        return;
    };
    let mut seen = std::collections::BTreeSet::new();
    for (i, t) in turns.iter().enumerate() {
        let Some(h) = by_turn.get_mut(i.min(by_turn.len().saturating_sub(1))) else {
            return;
        };
        h.turns += 1;
        let action = t.get("action");
        let kind = action
            .and_then(|a| a.get("type"))
            .and_then(serde_json::Value::as_str)
            .unwrap_or("");
        if t.get("format_ok") == Some(&serde_json::Value::Bool(false)) || kind == "invalid" {
            h.broken += 1;
        }
        if kind == "search" {
            let q = action
                .and_then(|a| a.get("query"))
                .and_then(serde_json::Value::as_str)
                .unwrap_or("");
            let norm = q
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
                .to_lowercase();
            if norm.is_empty() {
                h.empty_searches += 1;
            } else if !seen.insert(norm) {
                h.repeated_searches += 1;
            }
        }
    }
}

/// Turn positions the health table shows (the last: that turn and every later one).
const HEALTH_TURNS: usize = 4;

/// The turn health of a run's sampled episodes (`samples/step-N.jsonl`), split into the first
/// and the second half of its RL steps.
fn run_turn_health(dir: &Path, steps: u64) -> [[TurnHealth; HEALTH_TURNS]; 2] {
    let mut out = [[TurnHealth::default(); HEALTH_TURNS]; 2];
    let Ok(run) = RunDir::open(dir) else {
        return out;
    };
    for step in run.sample_steps().unwrap_or_default() {
        let half = usize::from(step * 2 > steps);
        let path = run.samples_path(step);
        let Ok(Some(lines)) = crate::run::read_json_lines::<serde_json::Value>(&path, "") else {
            continue;
        };
        for v in &lines {
            turn_health(v, &mut out[half]);
        }
    }
    out
}

/// Whether `out/report.json` is a report of at least one finished run.
fn reports_finished_runs(out: &Path) -> bool {
    std::fs::read_to_string(out.join("report.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v.get("finished").and_then(serde_json::Value::as_u64))
        .is_some_and(|n| n > 0)
}

/// Refuses a study directory that holds none of the study's runs (a committed study keeps its
/// file, panel and report, not its runs: `studies/paper-claims/README.md`) when its report
/// is one of finished runs, rather than overwriting it with one of none; names the missing
/// runs and the command that reproduces them.
fn require_some_run(study: &Study, out: &Path) -> Result<()> {
    let missing: Vec<String> = study
        .runs()
        .iter()
        .filter(|r| !matches!(r, RunId::Audit(_)))
        .filter(|r| !r.dir(out).exists())
        .map(RunId::label)
        .collect();
    let all = study
        .runs()
        .iter()
        .filter(|r| !matches!(r, RunId::Audit(_)))
        .count();
    // A study planned but not run yet reports its progress (0 finished); only a report of
    // finished runs is kept from being replaced by one of none.
    if missing.len() < all || !reports_finished_runs(out) {
        return Ok(());
    }
    let shown = missing
        .iter()
        .take(3)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    let more = match missing.len().saturating_sub(3) {
        0 => String::new(),
        n => format!(" and {n} more"),
    };
    bail!(
        "{} holds none of study {:?}'s {} runs ({shown}{more}: no run directory under {} or {}), \
         so its report is left as it is; reproduce the runs with `turnwise study run {} --out {}` \
         (resumable; `turnwise study plan` lists them for a scheduler), then run `turnwise study \
         report {}` again",
        out.display(),
        study.file.name,
        all,
        out.join("warm").display(),
        out.join("runs").display(),
        study.path.display(),
        out.display(),
        out.display(),
    )
}

/// Writes `report.md`, `report.json` and `plots/*.svg` of the study directory `out`; returns
/// the report's path. A directory holding none of the study's runs is refused
/// ([`require_some_run`]). Each section of the report is written by a function of its own, in
/// the order the report shows them; those with numbers in `report.json` return them too.
pub fn write_study_report(study: &Study, out: &Path) -> Result<PathBuf> {
    require_some_run(study, out)?;
    let panels = read_panels(out)?;
    // The report's files are recorded in the study's manifest while it is written.
    let _owner = crate::ownership::Owner::load(out, crate::ownership::Kind::Study)?;
    let arms = collect(study, out, &panels)?;
    let by_name: BTreeMap<&str, &ArmData> = arms.iter().map(|a| (a.name.as_str(), a)).collect();
    let file = &study.file;
    let metrics: Vec<Metric> = Metric::ALL
        .into_iter()
        .filter(|m| match m.mode() {
            "greedy" => file.panel.greedy,
            _ => file.panel.sampled,
        })
        .collect();
    let trained: Vec<RunId> = study
        .runs()
        .into_iter()
        .filter(|r| !matches!(r, RunId::Audit(_)))
        .collect();
    let total_runs = trained.len();
    let finished = trained.iter().filter(|r| is_finished(&r.dir(out))).count();
    let mut numbers = ReportNumbers {
        study: file.name.clone(),
        finished,
        runs: total_runs,
        bootstrap: (BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED),
        arms: BTreeMap::new(),
        vs_baseline: BTreeMap::new(),
        claims: BTreeMap::new(),
        audits: BTreeMap::new(),
    };
    let mut md = intro_section(study, finished, total_runs);
    md.push_str(&warm_starts_section(file, out, &panels));
    let (section, per_arm) = arms_section(file, &arms, &metrics);
    md.push_str(&section);
    numbers.arms = per_arm;
    let (section, vs_baseline) = baseline_section(&arms, &by_name, &metrics);
    md.push_str(&section);
    numbers.vs_baseline = vs_baseline;
    let (section, claims) = claims_section(file, &by_name);
    md.push_str(&section);
    numbers.claims = claims;
    md.push_str(&curves_section(file, &arms, out)?);
    md.push_str(&costs_section(&arms));
    md.push_str(&stability_section(&arms));

    let audits = audit_section(study, out, &mut numbers)?;
    md.push_str(&audits);

    md.push_str(&health_section(file, &arms, out));
    md.push_str(&pending_section(&arms));

    let path = out.join("report.md");
    write_owned(&path, md.as_bytes())?;
    let json = out.join("report.json");
    write_owned(
        &json,
        (serde_json::to_string_pretty(&numbers).expect("numbers serialize") + "\n").as_bytes(),
    )?;
    Ok(path)
}

/// The report's title, what it covers (runs finished, arms, seeds, budget, panel) and how to
/// read its figures.
fn intro_section(study: &Study, finished: usize, total_runs: usize) -> String {
    let file = &study.file;
    let mut md = String::new();
    let _ = writeln!(md, "# Study `{}`\n", file.name);
    let _ = writeln!(
        md,
        "{finished} of {total_runs} runs finished ({}, {} arms × {} seeds: {:?}). \
         Study file: `{}`. Budget: {} RL steps{}{}. Panel: the first {} test questions of each \
         warm start's task{}{}, the same for every run of it (`panel.json`).\n",
        crate::pipeline::count(file.warm_start.len() as u64, "warm start", "warm starts"),
        file.arms.len(),
        file.seeds.len(),
        file.seeds,
        study.path.display(),
        file.budget.steps,
        file.budget
            .prompts_per_step
            .map(|p| format!(" of {p} prompts"))
            .unwrap_or_default(),
        file.budget
            .group_size
            .map(|g| format!(" × {g} rollouts"))
            .unwrap_or_default(),
        file.panel.questions,
        if file.panel.greedy { ", greedy" } else { "" },
        if file.panel.sampled {
            format!(
                " and sampled at the rollout temperature ({} episode{} a question)",
                file.panel.samples,
                if file.panel.samples == 1 { "" } else { "s" }
            )
        } else {
            String::new()
        },
    );
    let _ = writeln!(
        md,
        "Figures are percentages on the panel after RL. Per arm: the mean over its finished \
         seeds with a 95 % Student-t interval (`[lo, hi]`, none with one seed), clipped to \
         [0, 100] and marked `*` where clipped (two or three seeds give intervals that reach \
         past the range); an arm whose seeds all scored the same shows `(n seeds, all equal)`: \
         its spread is 0, which is not a certainty. The seeds of an arm share one warm start, so \
         the spread over seeds leaves out the warm start's own variance. Differences \
         between arms are paired: the same seeds and the same questions; their 95 % interval is \
         a percentile bootstrap over seeds × questions ({BOOTSTRAP_RESAMPLES} resamples drawing \
         seeds and questions with replacement, SplitMix64 generator seed {BOOTSTRAP_SEED}). A \
         claim is *reproduced* when its interval lies above 0 in the claimed direction, \
         *reversed* when below, *inconclusive* otherwise; it stays *pending* until two paired \
         seeds have finished (one seed's interval holds the questions' noise, not the seeds').\n"
    );
    md
}

/// The warm starts: preset, environment, panel and their EM before RL.
fn warm_starts_section(file: &StudyFile, out: &Path, panels: &Panels) -> String {
    let mut md = String::new();
    // Warm starts.
    let _ = writeln!(
        md,
        "## Warm starts\n\n| warm start | preset | environment | panel questions | greedy EM before RL | sampled EM before RL | status |\n|---|---|---|---|---|---|---|"
    );
    for (name, w) in &file.warm_start {
        let dir = RunId::Warm(name.clone()).dir(out);
        let summary: Option<serde_json::Value> = std::fs::read_to_string(dir.join("summary.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok());
        let get = |k: &str| {
            summary
                .as_ref()
                .and_then(|s| s.get(k))
                .and_then(|e| e.get("em").or_else(|| e.get("success")))
                .and_then(serde_json::Value::as_f64)
                .map_or("–".into(), pct)
        };
        let p = &panels.panels[name];
        let _ = writeln!(
            md,
            "| `{name}` | `{}` | {} | {} | {} | {} | {} |",
            w.preset,
            p.environment,
            p.questions.len(),
            get("before_greedy"),
            get("before_sampled"),
            if summary.is_some() {
                "finished"
            } else {
                "not finished"
            }
        );
    }
    md
}

/// Per arm and metric: the mean over seeds after RL with its interval; the numbers by arm
/// and metric name for `report.json`.
fn arms_section(
    file: &StudyFile,
    arms: &[ArmData],
    metrics: &[Metric],
) -> (String, BTreeMap<String, BTreeMap<String, JsonInterval>>) {
    let mut md = String::new();
    let mut numbers = BTreeMap::new();
    // Per arm.
    let _ = writeln!(md, "\n## Results per arm (after RL)\n");
    let mut head = "| arm | preset | warm start | seeds finished |".to_string();
    for m in metrics {
        let _ = write!(head, " {} |", m.name());
    }
    let _ = writeln!(
        md,
        "{head} greedy EM before RL |\n|{}",
        "---|".repeat(5 + metrics.len())
    );
    for a in arms {
        let mut row = format!(
            "| `{}` | `{}` | `{}` | {} of {} |",
            a.name,
            a.preset,
            a.warm_start,
            a.runs.len(),
            file.seeds.len()
        );
        let mut per = BTreeMap::new();
        for &m in metrics {
            let i = arm_interval(a, m);
            let _ = write!(row, " {} |", arm_cell(i));
            if let Some(i) = i {
                per.insert(m.name().to_string(), JsonInterval::from(i));
            }
        }
        let before: Vec<f64> = a
            .runs
            .iter()
            .filter_map(|r| r.summary_num(&["before_greedy", "em"]))
            .collect();
        let _ = writeln!(
            md,
            "{row} {} |",
            if before.is_empty() {
                "–".into()
            } else {
                pct(mean(&before))
            }
        );
        numbers.insert(a.name.clone(), per);
    }
    (md, numbers)
}

/// Per arm (not a baseline) and metric: the paired difference against its baseline; the
/// numbers by arm and metric name for `report.json`.
fn baseline_section(
    arms: &[ArmData],
    by_name: &BTreeMap<&str, &ArmData>,
    metrics: &[Metric],
) -> (String, BTreeMap<String, BTreeMap<String, JsonInterval>>) {
    let mut md = String::new();
    let mut numbers = BTreeMap::new();
    // Against the baseline.
    let _ = writeln!(
        md,
        "\n## Paired differences against the baseline (points, arm − baseline)\n"
    );
    let mut head = "| arm | baseline | seeds paired |".to_string();
    for m in metrics {
        let _ = write!(head, " {} |", m.name());
    }
    let _ = writeln!(md, "{head}\n|{}", "---|".repeat(3 + metrics.len()));
    for a in arms {
        if a.name == a.baseline {
            continue;
        }
        let Some(b) = by_name.get(a.baseline.as_str()) else {
            continue;
        };
        let paired = a
            .runs
            .iter()
            .filter(|r| b.runs.iter().any(|x| x.seed == r.seed))
            .count();
        let mut row = format!("| `{}` | `{}` | {paired} |", a.name, b.name);
        let mut per = BTreeMap::new();
        for &m in metrics {
            let i = paired_difference(a, b, m);
            let _ = write!(row, " {} |", pct_interval(i, true));
            if let Some(i) = i {
                per.insert(m.name().to_string(), JsonInterval::from(i));
            }
        }
        let _ = writeln!(md, "{row}");
        numbers.insert(a.name.clone(), per);
    }
    (md, numbers)
}

/// The study file's claims, each with our paired difference and its verdict; the results by
/// claim name for `report.json`.
fn claims_section(
    file: &StudyFile,
    by_name: &BTreeMap<&str, &ArmData>,
) -> (String, BTreeMap<String, ClaimResult>) {
    let mut md = String::new();
    let mut numbers = BTreeMap::new();
    // Claims.
    if !file.claims.is_empty() {
        let _ = writeln!(
            md,
            "\n## Claims\n\n| claim | paper | paper's effect | comparison (environment) | metric | ours, points [95 %] | seeds | verdict |\n|---|---|---|---|---|---|---|---|"
        );
        for c in &file.claims {
            let (b, t) = (by_name[c.better.as_str()], by_name[c.than.as_str()]);
            let i = paired_difference(b, t, c.metric);
            let v = verdict(i);
            let _ = writeln!(
                md,
                "| {} | {} | {} | `{}` > `{}` ({}) | {} | {} | {} | **{v}** |",
                c.name,
                c.paper,
                c.effect,
                c.better,
                c.than,
                c.environment,
                c.metric.name(),
                pct_interval(i, true),
                i.map_or(0, |i| i.n)
            );
            numbers.insert(
                c.name.clone(),
                ClaimResult {
                    ours: i.map(JsonInterval::from),
                    verdict: v.to_string(),
                },
            );
        }
    }
    (md, numbers)
}

/// The learning curves per warm start, written to `plots/*.svg`, and the section showing them.
fn curves_section(file: &StudyFile, arms: &[ArmData], out: &Path) -> Result<String> {
    let mut md = String::new();
    // Learning curves.
    let plots = out.join("plots");
    std::fs::create_dir_all(&plots).with_context(|| format!("creating {}", plots.display()))?;
    let _ = writeln!(
        md,
        "\n## Learning curves\n\nPer warm start (arms on the same task and reward scale): the mean \
         over seeds, shaded from the lowest to the highest seed.\n"
    );
    for ws in file.warm_start.keys() {
        let group: Vec<&ArmData> = arms.iter().filter(|a| &a.warm_start == ws).collect();
        for (key, title, stem) in CURVES {
            let mut chart = LineChart::new(format!("{title}, warm start {ws}")).with_y_label(*key);
            for a in &group {
                let (line, band) = seed_band(&a.runs, key);
                if !line.is_empty() {
                    chart = chart.with_series(Series::new(a.name.clone(), line).with_band(band));
                }
            }
            if chart.point_count() == 0 {
                continue;
            }
            let name = format!("{ws}-{stem}.svg");
            let path = plots.join(&name);
            write_owned(&path, chart.to_svg().as_bytes())?;
            let _ = writeln!(md, "![{title}, warm start {ws}](plots/{name})\n");
        }
    }
    Ok(md)
}

/// Per arm: agent tokens, turns and tool calls per episode, training response tokens and
/// wall time.
fn costs_section(arms: &[ArmData]) -> String {
    let mut md = String::new();
    // Episode costs and wall time.
    let _ = writeln!(
        md,
        "## Cost per episode and wall time (means over finished seeds)\n\n| arm | agent tokens (greedy / sampled) | turns (greedy / sampled) | tool calls (greedy / sampled) | training response tokens per step | RL wall time, s (min–max) | total, s |\n|---|---|---|---|---|---|---|"
    );
    for a in arms {
        let both = |k: &str| {
            let g: Vec<f64> = a
                .runs
                .iter()
                .filter_map(|r| r.summary_num(&["after_greedy", k]))
                .collect();
            let s: Vec<f64> = a
                .runs
                .iter()
                .filter_map(|r| r.summary_num(&["after_sampled", k]))
                .collect();
            format!("{} / {}", mean_cell(&g, 2), mean_cell(&s, 2))
        };
        let train_tokens: Vec<f64> = a
            .runs
            .iter()
            .filter_map(|r| train_mean(&r.metrics, mk::length::RESPONSE_AGENT_MEAN))
            .collect();
        let rl: Vec<f64> = a
            .runs
            .iter()
            .filter_map(|r| r.summary_num(&["rl_seconds"]))
            .collect();
        let total: Vec<f64> = a
            .runs
            .iter()
            .filter_map(|r| r.summary_num(&["total_seconds"]))
            .collect();
        let range = if rl.is_empty() {
            String::new()
        } else {
            format!(
                " ({:.0}–{:.0})",
                rl.iter().copied().fold(f64::INFINITY, f64::min),
                rl.iter().copied().fold(f64::NEG_INFINITY, f64::max)
            )
        };
        let _ = writeln!(
            md,
            "| `{}` | {} | {} | {} | {} | {}{range} | {} |",
            a.name,
            both("agent_tokens"),
            both("turns"),
            both("tool_calls"),
            mean_cell(&train_tokens, 1),
            mean_cell(&rl, 0),
            mean_cell(&total, 0)
        );
    }
    md
}

/// Per arm: runs that ended below their warm start, skipped updates, clip fraction, entropy
/// and the largest KL.
fn stability_section(arms: &[ArmData]) -> String {
    let mut md = String::new();
    // Stability.
    let _ = writeln!(
        md,
        "\n## Stability\n\nBelow the warm start: runs whose greedy panel EM after RL is below \
         their own evaluation of the warm-started model before RL; significantly: by more than \
         two paired standard errors. The training metrics are means over a run's steps, then \
         over seeds (– when the method logs none).\n\n| arm | below the warm start | \
         significantly | skipped updates per run | clip fraction | entropy, first → last step | \
         largest KL (old‖new) |\n|---|---|---|---|---|---|---|"
    );
    for a in arms {
        let mut below = 0;
        let mut significant = 0;
        for r in &a.runs {
            let (Some(before), Some(after)) = (
                r.summary_num(&["before_greedy", "em"]),
                r.summary_num(&["after_greedy", "em"]),
            ) else {
                continue;
            };
            if after < before {
                below += 1;
            }
            let se = r
                .summary
                .pointer("/gains/gain~1test~1greedy/se")
                .and_then(serde_json::Value::as_f64);
            if se.is_some_and(|se| after - before < -2.0 * se) {
                significant += 1;
            }
        }
        let skipped: Vec<f64> = a
            .runs
            .iter()
            .filter(|r| r.metrics.has(mk::actor::SKIPPED_UPDATES))
            .map(|r| {
                r.metrics
                    .phase("train")
                    .filter_map(|x| x.get(mk::actor::SKIPPED_UPDATES))
                    .sum()
            })
            .collect();
        let clip: Vec<f64> = a
            .runs
            .iter()
            .filter_map(|r| train_mean(&r.metrics, mk::actor::PG_CLIPFRAC))
            .collect();
        let ends = |first: bool| -> Vec<f64> {
            a.runs
                .iter()
                .filter_map(|r| {
                    let s = r.metrics.series(mk::actor::ENTROPY);
                    if first { s.first() } else { s.last() }.map(|p| p.1)
                })
                .collect()
        };
        let kl: Vec<f64> = a
            .runs
            .iter()
            .filter_map(|r| {
                r.metrics
                    .series(mk::actor::PPO_KL)
                    .into_iter()
                    .map(|p| p.1)
                    .reduce(f64::max)
            })
            .collect();
        let n = a.runs.len();
        let _ = writeln!(
            md,
            "| `{}` | {below} of {n} | {significant} of {n} | {} | {} | {} → {} | {} |",
            a.name,
            mean_cell(&skipped, 1),
            mean_cell(&clip, 4),
            mean_cell(&ends(true), 3),
            mean_cell(&ends(false), 3),
            kl.iter()
                .copied()
                .reduce(f64::max)
                .map_or("–".into(), |v| format!("{v:.4}"))
        );
    }
    md
}

/// Per arm and turn position: broken formats, empty and repeated searches in the first and
/// the second half of the RL steps.
fn health_section(file: &StudyFile, arms: &[ArmData], out: &Path) -> String {
    let mut md = String::new();
    // Reasoning health per turn, from the runs' sampled training episodes.
    let _ = writeln!(
        md,
        "\n## Reasoning health per turn\n\nFrom the training episodes each run saved \
         (`samples/step-N.jsonl`, `run.samples_per_step` a step), all seeds pooled, in the first \
         → the second half of the RL steps: turns whose format broke (an invalid action, or a \
         tag out of place), searches with an empty query, searches repeating one of the \
         episode's earlier queries. Turn {HEALTH_TURNS} counts every later turn too.\n\n| arm | \
         turn | turns seen | format broken, % | empty searches, % | repeated searches, % \
         |\n|---|---|---|---|---|---|"
    );
    for a in arms {
        let mut pooled = [[TurnHealth::default(); HEALTH_TURNS]; 2];
        for r in &a.runs {
            let dir = RunId::Arm(a.name.clone(), r.seed).dir(out);
            let h = run_turn_health(&dir, file.budget.steps);
            for (p, x) in pooled.iter_mut().zip(h) {
                for (p, x) in p.iter_mut().zip(x) {
                    p.turns += x.turns;
                    p.broken += x.broken;
                    p.empty_searches += x.empty_searches;
                    p.repeated_searches += x.repeated_searches;
                }
            }
        }
        for (t, (&e, &l)) in pooled[0].iter().zip(&pooled[1]).enumerate() {
            if e.turns + l.turns == 0 {
                continue;
            }
            let share = |k: usize, n: usize| {
                if n == 0 {
                    "–".to_string()
                } else {
                    format!("{:.1}", 100.0 * k as f64 / n as f64)
                }
            };
            let _ = writeln!(
                md,
                "| `{}` | {}{} | {} → {} | {} → {} | {} → {} | {} → {} |",
                a.name,
                t + 1,
                if t + 1 == HEALTH_TURNS { "+" } else { "" },
                e.turns,
                l.turns,
                share(e.broken, e.turns),
                share(l.broken, l.turns),
                share(e.empty_searches, e.turns),
                share(l.empty_searches, l.turns),
                share(e.repeated_searches, e.turns),
                share(l.repeated_searches, l.turns)
            );
        }
    }
    md
}

/// The runs not finished yet, if any.
fn pending_section(arms: &[ArmData]) -> String {
    let mut md = String::new();
    let pending: Vec<String> = arms
        .iter()
        .flat_map(|a| {
            a.unfinished
                .iter()
                .map(move |s| RunId::Arm(a.name.clone(), *s).label())
        })
        .collect();
    if !pending.is_empty() {
        let _ = writeln!(
            md,
            "\n## Not finished yet\n\n{}: {}.",
            crate::pipeline::count(pending.len() as u64, "run", "runs"),
            pending.join(", ")
        );
    }
    md
}

/// Writes a file of the study's report, when the study's manifest (if it has one: studies of
/// an earlier turnwise have none) says turnwise wrote what is there, and records it.
fn write_owned(path: &Path, bytes: &[u8]) -> Result<()> {
    crate::ownership::may_write(path)?;
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))?;
    crate::ownership::wrote(path, bytes)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An interval of `n` seeds.
    fn iv(mean: f64, lo: f64, hi: f64, n: usize) -> Interval {
        Interval { mean, lo, hi, n }
    }

    #[test]
    fn verdicts_follow_the_interval() {
        let i = |lo, hi| {
            Some(Interval {
                mean: (lo + hi) / 2.0,
                lo,
                hi,
                n: 3,
            })
        };
        assert_eq!(verdict(i(0.01, 0.05)), "reproduced");
        assert_eq!(verdict(i(-0.05, -0.01)), "reversed");
        assert_eq!(verdict(i(-0.01, 0.05)), "inconclusive");
        assert_eq!(verdict(i(f64::NAN, f64::NAN)), "inconclusive");
        assert_eq!(verdict(None), "pending");
        let one_seed = i(-0.05, -0.01).map(|i| Interval { n: 1, ..i });
        assert_eq!(verdict(one_seed), "pending");
    }

    #[test]
    fn turn_health_counts_broken_turns_and_empty_and_repeated_searches() {
        let ep = serde_json::json!({"turns": [
            {"action": {"type": "search", "query": "Xiso Penost"}, "format_ok": true},
            {"action": {"type": "search", "query": " xiso  penost "}, "format_ok": true},
            {"action": {"type": "search", "query": "  "}, "format_ok": false},
            {"action": {"type": "invalid"}, "format_ok": true},
            {"action": {"type": "answer", "text": "Ektha"}, "format_ok": true},
        ]});
        let mut h = [TurnHealth::default(); 4];
        turn_health(&ep, &mut h);
        let t = |turns, broken, empty_searches, repeated_searches| TurnHealth {
            turns,
            broken,
            empty_searches,
            repeated_searches,
        };
        // Turn 4 holds the fourth and the fifth turn.
        assert_eq!(
            h,
            [t(1, 0, 0, 0), t(1, 0, 0, 1), t(1, 1, 1, 0), t(2, 1, 0, 0)]
        );
        turn_health(&serde_json::json!({"id": "no turns"}), &mut h);
        assert_eq!(h[0].turns, 1);
    }

    #[test]
    fn interval_cells() {
        let i = iv(0.54, 0.441, 0.639, 3);
        assert_eq!(pct_interval(Some(i), false), "54.0 [44.1, 63.9]");
        let d = iv(0.012, -0.004, 0.03, 3);
        assert_eq!(pct_interval(Some(d), true), "+1.2 [-0.4, +3.0]");
        let one = iv(0.5, f64::NAN, f64::NAN, 1);
        assert_eq!(pct_interval(Some(one), false), "50.0");
        assert_eq!(pct_interval(None, false), "–");
    }

    #[test]
    fn arm_cells_are_clipped_to_the_range_and_name_equal_seeds() {
        // cli-as-a-user-3 m13: `8.3 [-55.2, 71.9]` with two seeds, `0.0 [0.0, 0.0]` when both
        // seeds scored 0.
        let wide = iv(0.083, -0.552, 0.719, 2);
        assert_eq!(arm_cell(Some(wide)), "8.3 [0.0, 71.9]*");
        let high = iv(0.95, 0.8, 1.1, 2);
        assert_eq!(arm_cell(Some(high)), "95.0 [80.0, 100.0]*");
        let inside = iv(0.54, 0.441, 0.639, 3);
        assert_eq!(arm_cell(Some(inside)), "54.0 [44.1, 63.9]");
        let zero = iv(0.0, 0.0, 0.0, 2);
        assert_eq!(arm_cell(Some(zero)), "0.0 (2 seeds, all equal)");
        let one = iv(0.5, f64::NAN, f64::NAN, 1);
        assert_eq!(arm_cell(Some(one)), "50.0");
        assert_eq!(arm_cell(None), "–");
    }
}
