//! `report.md`: a Markdown summary of a run from its metrics and resolved configuration.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;
use std::path::{Path, PathBuf};

use super::dir::{RunDir, write_atomic};
use super::metrics::{MetricsLog, PairedGain, read_metrics};
use super::plots::{PlotFile, default_plot_specs, write_plots};
use super::{RunError, RunResult};
use turnwise_core::advantage::{AdvantageConfig, ESTIMATORS, Estimator};
use turnwise_core::metric_keys as mk;

/// Which way a metric improves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Better {
    Higher,
    Lower,
    Neither,
}

/// The main metrics of the summary table: a label, candidate names (first with data wins) and
/// the better direction.
const MAIN: &[(&str, &[&str], Better)] = &[
    (
        "reward",
        &[
            mk::critic::SCORE_MEAN,
            mk::critic::REWARDS_MEAN,
            mk::train::REWARD,
        ],
        Better::Higher,
    ),
    (
        "train EM",
        &[mk::train::EM, mk::critic::EM_MEAN],
        Better::Higher,
    ),
    (
        "train invalid actions",
        &[mk::train::INVALID_ACTIONS],
        Better::Lower,
    ),
    ("train format ok", &[mk::train::FORMAT_OK], Better::Higher),
    ("entropy", &[mk::actor::ENTROPY], Better::Neither),
    ("KL (old‖new)", &[mk::actor::PPO_KL], Better::Neither),
    ("KL loss (ref)", &[mk::actor::KL_LOSS], Better::Neither),
    ("clip fraction", &[mk::actor::PG_CLIPFRAC], Better::Neither),
    ("policy loss", &[mk::actor::PG_LOSS], Better::Neither),
    ("grad norm", &[mk::actor::GRAD_NORM], Better::Neither),
    (
        "explained variance",
        &[mk::critic::VF_EXPLAINED_VAR],
        Better::Higher,
    ),
    (
        "response length",
        &[mk::length::RESPONSE_MEAN],
        Better::Neither,
    ),
    (
        "turns",
        &[mk::env::TURNS_MEAN, mk::env::NUM_TURNS_MEAN],
        Better::Neither,
    ),
    (
        "tool calls",
        &[mk::env::TOOL_CALLS_MEAN, mk::env::TOOL_CALL_COUNTS_MEAN],
        Better::Neither,
    ),
    ("warm-start loss", &[mk::sft::LOSS], Better::Lower),
    (
        "rejection-sampling loss",
        &[mk::sft::RSFT_LOSS],
        Better::Lower,
    ),
    (
        "rejection-sampling kept",
        &[mk::sft::RSFT_KEPT_FRACTION],
        Better::Neither,
    ),
];

/// Evaluation metrics shown first, in this order; the others follow by name.
const EVAL_ORDER: &[&str] = &[
    "n",
    "em",
    "em_se",
    "steps_to_success",
    "invalid_actions",
    "f1",
    "sub_em",
    "answered",
    "format_ok",
    "turns",
    "tool_calls",
    "agent_tokens",
];

/// Evaluation metrics that are fractions, shown as percentages.
const RATES: &[&str] = &[
    "em",
    "em_se",
    "f1",
    "sub_em",
    "answered",
    "format_ok",
    "invalid_actions",
];

/// What [`render_report`] summarizes.
#[derive(Debug, Clone, Copy)]
pub struct ReportInput<'a> {
    /// The report title (usually the run directory name).
    pub title: &'a str,
    /// The metrics.
    pub log: &'a MetricsLog,
    /// The resolved configuration (TOML), if there is one.
    pub config: Option<&'a str>,
    /// The charts to link.
    pub plots: &'a [PlotFile],
    /// The directory the report is written in: plot links are relative to it.
    pub base: &'a Path,
}

/// A number for a table: about four significant digits, scientific for tiny or huge magnitudes.
fn num(v: f64) -> String {
    let a = v.abs();
    if v == 0.0 {
        "0".into()
    } else if !(1e-3..1e6).contains(&a) {
        format!("{v:.3e}")
    } else if a >= 1000.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.3}")
    } else {
        format!("{v:.4}")
    }
}

fn pct(v: f64) -> String {
    format!("{:.1}%", v * 100.0)
}

/// `1h 02m 03s`, `4m 05s` or `12.3 s`.
fn duration(secs: f64) -> String {
    if !secs.is_finite() || secs < 0.0 {
        return "?".into();
    }
    if secs < 60.0 {
        return format!("{secs:.1} s");
    }
    let s = secs.round() as u64;
    if s < 3600 {
        format!("{}m {:02}s", s / 60, s % 60)
    } else {
        format!("{}h {:02}m {:02}s", s / 3600, (s % 3600) / 60, s % 60)
    }
}

/// Table cells must not break the row.
fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

/// `eval/<mode>/<name>` → `(mode, Name(name))`, `eval/<mode>/em/hop<N>` → `(mode, Hop(N))`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum EvalKey {
    Name(String),
    Hop(u32),
}

fn parse_eval_key(key: &str) -> Option<(String, EvalKey)> {
    let parts: Vec<&str> = key.strip_prefix(mk::eval::PREFIX)?.split('/').collect();
    let (&last, head) = parts.split_last()?;
    if last.is_empty() {
        return None;
    }
    // `eval/<mode>/n/hop<N>`: the question count behind a per-hop EM, not a column of its own.
    if head.last() == Some(&"n") && last.starts_with("hop") {
        return None;
    }
    if let (Some((&"em", mode)), Some(Ok(hop))) = (
        head.split_last(),
        last.strip_prefix("hop").map(str::parse::<u32>),
    ) {
        return Some((mode.join("/"), EvalKey::Hop(hop)));
    }
    Some((head.join("/"), EvalKey::Name(last.to_string())))
}

/// The loss's mechanisms (the clips, the clipping-bias correction, KL in the reward), shown
/// first in the "Mechanism at work" table; a row appears only when the run logged it.
const LOSS_MECHANISM: &[(&str, &[&str], Better)] = &[
    (
        "clipped at the upper bound",
        &[mk::actor::PG_CLIPFRAC_HIGH],
        Better::Neither,
    ),
    (
        "clipped at the lower bound",
        &[mk::actor::PG_CLIPFRAC_LOW],
        Better::Neither,
    ),
    (
        "dual-clipped",
        &[mk::actor::PG_CLIPFRAC_LOWER],
        Better::Neither,
    ),
    (
        "clipping-bias scale",
        &[mk::actor::CLIP_BIAS_SCALE],
        Better::Neither,
    ),
    (
        "clipping-bias mean weight, off-policy mini-batches",
        &[mk::actor::CLIP_BIAS_SCALE_OFFPOLICY],
        Better::Neither,
    ),
    (
        "clipping-bias clipped tokens",
        &[mk::actor::CLIP_BIAS_NUM_CLIPPED],
        Better::Neither,
    ),
    (
        "KL in the reward",
        &[mk::actor::REWARD_KL_PENALTY],
        Better::Neither,
    ),
    (
        "KL-in-reward coefficient",
        &[mk::actor::REWARD_KL_PENALTY_COEFF],
        Better::Neither,
    ),
];

/// The rollout's and the reward's mechanisms, shown after the estimator's (whose metrics each
/// estimator declares, [`Estimator::metric_docs`]).
const ROLLOUT_MECHANISM: &[(&str, &[&str], Better)] = &[
    (
        "tree leaves per prompt",
        &[mk::tree::LEAVES],
        Better::Neither,
    ),
    ("tree depth", &[mk::tree::DEPTH_MEAN], Better::Neither),
    (
        "fork entropy",
        &[mk::tree::FORK_ENTROPY_MEAN],
        Better::Neither,
    ),
    (
        "trees per group",
        &[mk::tree::LABELS_PER_GROUP],
        Better::Neither,
    ),
    (
        "two-turn: tool executed",
        &[mk::reward::TOOL_EXECUTION],
        Better::Higher,
    ),
    (
        "two-turn: gold in the result",
        &[mk::reward::SEARCH_RESULT_PRESENCE],
        Better::Higher,
    ),
    (
        "two-turn: exact match",
        &[mk::reward::EXACT_MATCH],
        Better::Higher,
    ),
    (
        "penalised steps",
        &[mk::gigpo::PENALISED_STEPS],
        Better::Neither,
    ),
    (
        "thinking interventions",
        &[mk::rollout::TTI_TRIGGERED],
        Better::Neither,
    ),
    (
        "turn regenerations",
        &[mk::rollout::TDS_REGENERATIONS],
        Better::Neither,
    ),
    (
        "turns accepted on the first draw (TDS)",
        &[mk::rollout::TDS_ACCEPTED_FIRST_SHARE],
        Better::Neither,
    ),
    (
        "turns that spent the resampling budget (TDS)",
        &[mk::rollout::TDS_BUDGET_EXHAUSTED_SHARE],
        Better::Neither,
    ),
    (
        "first-draw turn gap Γ, median (TDS)",
        &[mk::rollout::TDS_GAP_P50],
        Better::Neither,
    ),
    (
        "filtered groups",
        &[mk::batch::FILTERED_GROUPS],
        Better::Neither,
    ),
    (
        "refill rounds",
        &[mk::batch::REFILL_ROUNDS],
        Better::Neither,
    ),
    (
        "overlong penalty",
        &[mk::reward::OVERLONG_PENALTY_MEAN],
        Better::Neither,
    ),
];

/// The metrics that show each method's defining mechanism at work (spec §7): the loss's, every
/// registered estimator's as it declares them (each key once), the rollout's and the
/// reward's. A row appears only when the run logged it.
fn mechanism_rows() -> Vec<(&'static str, &'static [&'static str], Better)> {
    let mut rows: Vec<(&str, &[&str], Better)> = LOSS_MECHANISM.to_vec();
    for (name, _) in ESTIMATORS {
        let Ok(est) = AdvantageConfig::default_for(name) else {
            continue;
        };
        for doc in est.metric_docs() {
            if !rows.iter().any(|(_, keys, _)| keys.contains(&doc.key)) {
                rows.push((doc.label, std::slice::from_ref(&doc.key), Better::Neither));
            }
        }
    }
    rows.extend_from_slice(ROLLOUT_MECHANISM);
    rows
}

/// Whether the run played a game (its evaluations have an invalid-action rate): its EM is the
/// success rate, and is labelled so.
fn is_game(log: &MetricsLog) -> bool {
    log.keys()
        .iter()
        .any(|k| k.starts_with(mk::eval::PREFIX) && k.ends_with("/invalid_actions"))
}

/// The label of an evaluation column: a game's `em` is its success rate.
fn eval_label(name: &str, game: bool) -> &str {
    match name {
        "em" if game => "success",
        "em_se" if game => "success_se",
        _ => name,
    }
}

/// Whether the run's config (`config`: the resolved `config.toml`) turns on the mechanism whose
/// metric is `key`. Some mechanisms' metrics are logged by every run (verl logs them whatever
/// the recipe: the clipping-bias statistics, DAPO's dynamic-sampling counts, the KL in the
/// reward, the overlong penalty): they are shown only when the run uses the mechanism. Without a
/// config (or for any other metric, which only its mechanism logs) the metric decides.
fn mechanism_on(key: &str, config: Option<&toml::Table>) -> bool {
    let Some(config) = config else {
        return true;
    };
    let get = |path: &str| {
        let mut parts = path.split('.');
        let first = config.get(parts.next()?)?;
        parts.try_fold(first, |at, part| at.get(part))
    };
    let flag = |path: &str| get(path).and_then(toml::Value::as_bool) == Some(true);
    if key.starts_with(mk::actor::CLIP_BIAS_PREFIX) {
        get("actor.policy.clip_bias").is_some()
    } else if key.starts_with(mk::batch::FILTERED_GROUPS)
        || key.starts_with(mk::batch::REFILL_ROUNDS)
    {
        flag("rollout.filter_zero_variance_groups")
    } else if key.starts_with(mk::actor::REWARD_KL_PENALTY) {
        flag("algorithm.use_kl_in_reward")
    } else if key.starts_with(mk::reward::OVERLONG_PENALTY) {
        flag("overlong_buffer.enable")
    } else {
        true
    }
}

fn write_main_table(out: &mut String, log: &MetricsLog, config: Option<&str>) {
    let main: Vec<(&str, &[&str], Better)> = MAIN
        .iter()
        .map(|&(label, keys, better)| match label {
            "train EM" if is_game(log) => ("train success", keys, better),
            _ => (label, keys, better),
        })
        .collect();
    write_metric_table(
        out,
        log,
        "Main metrics",
        &main,
        Some("No training metrics were logged."),
    );
    let config = config.and_then(|c| c.parse::<toml::Table>().ok());
    let mechanism: Vec<(&str, &[&str], Better)> = mechanism_rows()
        .into_iter()
        .filter(|(_, keys, _)| keys.iter().all(|k| mechanism_on(k, config.as_ref())))
        .collect();
    write_metric_table(out, log, "Mechanism at work", &mechanism, None);
}

fn write_metric_table(
    out: &mut String,
    log: &MetricsLog,
    heading: &str,
    table: &[(&str, &[&str], Better)],
    empty: Option<&str>,
) {
    let mut rows = Vec::new();
    for (label, keys, better) in table {
        let Some(key) = keys.iter().find(|k| log.has(k)) else {
            continue;
        };
        let pts = log.series(key);
        let (first, last) = (pts[0], pts[pts.len() - 1]);
        let min = pts
            .iter()
            .copied()
            .fold(first, |a, b| if b.1 < a.1 { b } else { a });
        let max = pts
            .iter()
            .copied()
            .fold(first, |a, b| if b.1 > a.1 { b } else { a });
        let best = match better {
            Better::Higher => format!("{} (step {})", num(max.1), max.0),
            Better::Lower => format!("{} (step {})", num(min.1), min.0),
            Better::Neither => "—".into(),
        };
        rows.push(format!(
            "| {} | `{}` | {} (step {}) | {} (step {}) | {} | {} | {} | {} |",
            cell(label),
            cell(key),
            num(first.1),
            first.0,
            num(last.1),
            last.0,
            best,
            num(min.1),
            num(max.1),
            pts.len()
        ));
    }
    if rows.is_empty() {
        if let Some(msg) = empty {
            let _ = writeln!(out, "## {heading}\n\n{msg}\n");
        }
        return;
    }
    let _ = writeln!(out, "## {heading}\n");
    let _ = writeln!(
        out,
        "| metric | key | first | last | best | min | max | points |\n|---|---|---|---|---|---|---|---|"
    );
    for r in rows {
        let _ = writeln!(out, "{r}");
    }
    let _ = writeln!(out);
}

/// One evaluation line of a mode: the step, its metrics by name and its EM by hop.
type EvalRow = (u64, BTreeMap<String, f64>, BTreeMap<u32, f64>);

fn write_eval(out: &mut String, log: &MetricsLog) {
    let modes = eval_rows(log);
    if modes.is_empty() {
        return;
    }
    let _ = writeln!(out, "## Evaluation\n");
    for (mode, rows) in &modes {
        write_eval_mode(out, mode, rows);
    }
}

/// The evaluation lines of `log` by mode (`parse_eval_key`), non-finite values left out.
fn eval_rows(log: &MetricsLog) -> BTreeMap<String, Vec<EvalRow>> {
    // mode → rows of (step, name → value, hop → value)
    let mut modes: BTreeMap<String, Vec<EvalRow>> = BTreeMap::new();
    for r in &log.records {
        let mut per_mode: BTreeMap<String, EvalRow> = BTreeMap::new();
        for (key, v) in &r.values {
            let Some(v) = v.filter(|v| v.is_finite()) else {
                continue;
            };
            let Some((mode, k)) = parse_eval_key(key) else {
                continue;
            };
            let row = per_mode
                .entry(mode)
                .or_insert_with(|| (r.step, BTreeMap::new(), BTreeMap::new()));
            match k {
                EvalKey::Name(n) => {
                    row.1.insert(n, v);
                }
                EvalKey::Hop(h) => {
                    row.2.insert(h, v);
                }
            }
        }
        for (mode, row) in per_mode {
            modes.entry(mode).or_default().push(row);
        }
    }
    modes
}

/// The section of one evaluation mode: what it is, the EM change from first to last, and a
/// table of every evaluation's metrics and per-hop EM.
fn write_eval_mode(out: &mut String, mode: &str, rows: &[EvalRow]) {
    let title = if mode.is_empty() {
        "eval".to_string()
    } else {
        format!("eval/{mode}")
    };
    let _ = writeln!(out, "### {}\n", cell(&title));
    let names: BTreeSet<&str> = rows
        .iter()
        .flat_map(|r| r.1.keys().map(String::as_str))
        .collect();
    let game = names.contains("invalid_actions");
    if let Some((split, decoding)) = mode.split_once('/')
        && matches!(split, "train" | "validation" | "test")
    {
        let _ = writeln!(
            out,
            "The {split} split, {} decoding; `n` is the number of {} evaluated.\n",
            cell(decoding),
            if game { "maps" } else { "questions" }
        );
    }
    let mut cols: Vec<&str> = EVAL_ORDER
        .iter()
        .copied()
        .filter(|n| names.contains(n))
        .collect();
    cols.extend(names.iter().copied().filter(|n| !EVAL_ORDER.contains(n)));
    let hops: BTreeSet<u32> = rows.iter().flat_map(|r| r.2.keys().copied()).collect();
    if let (Some(first), Some(last)) = (rows.first(), rows.last())
        && rows.len() > 1
        && let (Some(a), Some(b)) = (first.1.get("em"), last.1.get("em"))
    {
        let _ = writeln!(
            out,
            "{} {} (step {}) → {} (step {}): {:+.1} points.\n",
            if game { "Success" } else { "EM" },
            pct(*a),
            first.0,
            pct(*b),
            last.0,
            (b - a) * 100.0
        );
    }
    let mut header = String::from("| step |");
    let mut rule = String::from("|---|");
    for c in &cols {
        let _ = write!(header, " {} |", cell(eval_label(c, game)));
        rule.push_str("---|");
    }
    for h in &hops {
        let _ = write!(header, " EM {h}-hop |");
        rule.push_str("---|");
    }
    let _ = writeln!(out, "{header}\n{rule}");
    for (step, vals, hop_vals) in rows {
        let mut line = format!("| {step} |");
        for c in &cols {
            let s = match vals.get(*c) {
                Some(v) if *c == "n" => format!("{v}"),
                Some(v) if RATES.contains(c) && (0.0..=1.0).contains(v) => pct(*v),
                Some(v) => num(*v),
                None => "".into(),
            };
            let _ = write!(line, " {s} |");
        }
        for h in &hops {
            let s = hop_vals.get(h).map(|v| pct(*v)).unwrap_or_default();
            let _ = write!(line, " {s} |");
        }
        let _ = writeln!(out, "{line}");
    }
    let _ = writeln!(out);
}

fn write_plots_section(out: &mut String, plots: &[PlotFile], base: &Path) {
    if plots.is_empty() {
        return;
    }
    let _ = writeln!(out, "## Plots\n");
    for p in plots {
        let rel = p.path.strip_prefix(base).unwrap_or(&p.path);
        let link = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().replace(' ', "%20"))
            .collect::<Vec<_>>()
            .join("/");
        let _ = writeln!(
            out,
            "- [{}]({link}) ({})\n\n  ![{}]({link})\n",
            p.title,
            p.keys
                .iter()
                .map(|k| format!("`{k}`"))
                .collect::<Vec<_>>()
                .join(", "),
            p.title
        );
    }
}

fn write_timing(out: &mut String, log: &MetricsLog) {
    let keys: Vec<&str> = log
        .keys()
        .into_iter()
        .filter(|k| k.starts_with(mk::timing::PREFIX))
        .collect();
    let times: Vec<f64> = log.records.iter().filter_map(|r| r.time).collect();
    if keys.is_empty() && times.len() < 2 {
        return;
    }
    let _ = writeln!(out, "## Timing\n");
    if let (Some(first), Some(last)) = (
        times.iter().copied().reduce(f64::min),
        times.iter().copied().reduce(f64::max),
    ) && last > first
    {
        let _ = writeln!(
            out,
            "Wall clock from the first to the last metrics line: {}.",
            duration(last - first)
        );
        let train: BTreeSet<u64> = log.phase("train").map(|r| r.step).collect();
        if train.len() > 1 {
            let _ = writeln!(out, "{} training steps logged.", train.len());
        }
        let _ = writeln!(out);
    }
    if keys.is_empty() {
        return;
    }
    let total_step: f64 = log.series(mk::timing::STEP).iter().map(|p| p.1).sum();
    let _ = writeln!(
        out,
        "| phase | mean per step | total | share of step time |\n|---|---|---|---|"
    );
    for k in keys {
        let pts = log.series(k);
        let total: f64 = pts.iter().map(|p| p.1).sum();
        let share = if total_step > 0.0 {
            pct(total / total_step)
        } else {
            "".into()
        };
        let _ = writeln!(
            out,
            "| `{}` | {} | {} | {} |",
            cell(k),
            duration(total / pts.len() as f64),
            duration(total),
            share
        );
    }
    let _ = writeln!(out);
}

fn write_config(out: &mut String, config: &str) {
    let _ = writeln!(out, "## Configuration\n");
    if let Ok(table) = config.parse::<toml::Table>() {
        let scalars: Vec<String> = table
            .iter()
            .filter(|(_, v)| !v.is_table() && !v.is_array())
            .map(|(k, v)| format!("- {}: {}", cell(k), cell(&v.to_string())))
            .collect();
        if !scalars.is_empty() {
            let _ = writeln!(out, "{}\n", scalars.join("\n"));
        }
    }
    let fence = if config.contains("```") {
        "~~~~"
    } else {
        "```"
    };
    let _ = writeln!(
        out,
        "<details><summary>Resolved configuration (config.toml)</summary>\n\n{fence}toml\n{}\n{fence}\n\n</details>\n",
        config.trim_end()
    );
}

/// The gains from before to after RL (`gain/<split>/<mode>/…`, the last `gain` line): one row
/// per split and decoding with the change, its paired standard error, how many standard errors
/// that is, and the questions that went up and down.
fn write_gains(out: &mut String, log: &MetricsLog) {
    let Some(rec) = log.records.iter().rfind(|r| r.phase == "gain") else {
        return;
    };
    let prefixes: BTreeSet<&str> = rec
        .values
        .keys()
        .filter_map(|k| k.strip_suffix("/em"))
        .filter(|p| p.starts_with("gain/"))
        .collect();
    if prefixes.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "## Gain from RL

EM after RL minus EM before (step {}), on the same questions; the \
         standard error is paired (the spread of the per-question changes over √n), so only the \
         questions whose outcome changed add to it.

\
         | split / decoding | n | gain (points) | paired SE | gain / SE | questions up | questions down |\n\
         |---|---|---|---|---|---|---|",
        rec.step
    );
    for p in prefixes {
        let Some(g) = PairedGain::from_metrics(p, f64::NAN, |k| rec.get(k)) else {
            continue;
        };
        let ratio = if g.se > 0.0 {
            format!("{:.1}", g.gain / g.se)
        } else {
            "—".into()
        };
        let _ = writeln!(
            out,
            "| {} | {} | {:+.1} | {:.1} | {ratio} | {} | {} |",
            cell(p.strip_prefix("gain/").unwrap_or(p)),
            g.n,
            g.gain * 100.0,
            g.se * 100.0,
            g.improved,
            g.regressed,
        );
    }
    let _ = writeln!(out);
}

/// Renders `report.md`: the run's lines and phases, a table of the first, last and best values
/// of the main metrics, the evaluations (one table per split and mode, `eval/<split>/<mode>/…`,
/// with the number of questions `n`, EM by hop when `eval/<split>/<mode>/em/hopN` keys exist), the plots, a timing summary and the configuration.
pub fn render_report(input: &ReportInput<'_>) -> String {
    let log = input.log;
    let mut out = String::new();
    let _ = writeln!(out, "# Run report: {}\n", input.title);
    let mut phases: BTreeMap<&str, usize> = BTreeMap::new();
    for r in &log.records {
        *phases.entry(r.phase.as_str()).or_default() += 1;
    }
    let phases: Vec<String> = phases.iter().map(|(p, n)| format!("{p} ×{n}")).collect();
    let _ = writeln!(
        out,
        "{} metrics lines ({}).",
        log.records.len(),
        if phases.is_empty() {
            "none".to_string()
        } else {
            phases.join(", ")
        }
    );
    if let Some(last) = log.phase("train").map(|r| r.step).max() {
        let _ = writeln!(out, "Last training step: {last}.");
    }
    if let Some(n) = log.torn_last_line {
        let _ = writeln!(
            out,
            "\n> The last line ({n}) of the metrics was torn (the run was killed while writing it) and is left out."
        );
    }
    let _ = writeln!(out);
    write_main_table(&mut out, log, input.config);
    write_eval(&mut out, log);
    write_gains(&mut out, log);
    write_plots_section(&mut out, input.plots, input.base);
    write_timing(&mut out, log);
    if let Some(config) = input.config {
        write_config(&mut out, config);
    }
    out
}

/// Reads the metrics and configuration of `run`, writes the default charts into `plots/`, then
/// `report.md`; returns the report's path. A run without a `config.toml` gets a report without
/// the configuration.
pub fn write_report(run: &RunDir) -> RunResult<PathBuf> {
    let log = read_metrics(run.metrics_path())?;
    let config = match std::fs::read_to_string(run.config_path()) {
        Ok(c) => Some(c),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(RunError::io("read", &run.config_path())(e)),
    };
    let plots = write_plots(&log, &run.plots_dir(), &default_plot_specs())?;
    let title = run
        .root()
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| run.root().display().to_string());
    let text = render_report(&ReportInput {
        title: &title,
        log: &log,
        config: config.as_deref(),
        plots: &plots,
        base: run.root(),
    });
    let path = run.report_path();
    write_atomic(&path, text.as_bytes())?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eval_keys_parse() {
        let n = |m: &str, k: &str| Some((m.to_string(), EvalKey::Name(k.to_string())));
        let h = |m: &str, k: u32| Some((m.to_string(), EvalKey::Hop(k)));
        assert_eq!(parse_eval_key("eval/greedy/em"), n("greedy", "em"));
        assert_eq!(parse_eval_key("eval/greedy/em/hop2"), h("greedy", 2));
        assert_eq!(parse_eval_key("eval/em/hop3"), h("", 3));
        assert_eq!(parse_eval_key("eval/em"), n("", "em"));
        assert_eq!(parse_eval_key("eval/a/b/f1"), n("a/b", "f1"));
        assert_eq!(
            parse_eval_key("eval/greedy/f1/hop2"),
            n("greedy/f1", "hop2")
        );
        assert_eq!(parse_eval_key("train/em"), None);
        assert_eq!(parse_eval_key("eval/"), None);
    }

    #[test]
    fn numbers_and_durations() {
        assert_eq!(num(0.0), "0");
        assert_eq!(num(0.12345), "0.1235");
        assert_eq!(num(12.3456), "12.346");
        assert_eq!(num(12345.0), "12345.0");
        assert_eq!(num(1e-5), "1.000e-5");
        assert_eq!(duration(12.34), "12.3 s");
        assert_eq!(duration(125.0), "2m 05s");
        assert_eq!(duration(3723.0), "1h 02m 03s");
        assert_eq!(duration(f64::NAN), "?");
    }

    fn sample_run(root: &Path) -> RunDir {
        let run = RunDir::create(root, false).unwrap();
        run.write_config(
            "preset = \"a2tgpo\"\nseed = 7\n\n[optim]\nlr = 1e-6\n\n[run]\nsteps = 6\n",
        )
        .unwrap();
        let mut w = run.metrics_writer().unwrap();
        let t0 = 1_700_000_000.0;
        for s in [50u64, 100] {
            w.write_at(s, "sft", t0 + s as f64, [("sft/loss", 100.0 / s as f64)])
                .unwrap();
        }
        for s in [1u64, 2] {
            w.write_at(
                s,
                "rsft",
                t0 + 150.0 + s as f64,
                [("rsft/loss", 0.5 / s as f64)],
            )
            .unwrap();
        }
        w.write_at(2, "rsft", t0 + 153.0, [("rsft/kept_fraction", 0.625)])
            .unwrap();
        let eval = |w: &mut super::super::MetricsWriter, step: u64, em: f64| {
            w.write_at(
                step,
                "eval",
                t0 + 200.0 + step as f64 * 60.0,
                [
                    ("eval/greedy/em", em),
                    ("eval/greedy/f1", em + 0.05),
                    ("eval/greedy/turns", 2.5),
                    ("eval/greedy/em/hop1", em + 0.1),
                    ("eval/greedy/em/hop2", em - 0.1),
                    ("eval/sampled/em", em - 0.02),
                ],
            )
            .unwrap();
        };
        eval(&mut w, 0, 0.2);
        for step in 1..=6u64 {
            let s = step as f64;
            w.write_at(
                step,
                "train",
                t0 + 200.0 + s * 60.0,
                [
                    ("critic/score/mean", 0.1 * s),
                    ("train/em", if step == 4 { 0.9 } else { 0.05 * s }),
                    ("actor/entropy", 1.0 / s),
                    ("actor/pg_clipfrac", f64::NAN),
                    ("a2tgpo/clip_scale/max", 1.0 + 0.02 * s),
                    ("timing_s/step", 60.0),
                    ("timing_s/gen", 45.0),
                    ("timing_s/update", 15.0),
                ],
            )
            .unwrap();
        }
        eval(&mut w, 6, 0.35);
        run
    }

    #[test]
    fn report_summarizes_a_run() {
        let tmp = tempfile::tempdir().unwrap();
        let run = sample_run(&tmp.path().join("my run"));
        let path = write_report(&run).unwrap();
        assert_eq!(path, run.report_path());
        let md = std::fs::read_to_string(&path).unwrap();
        assert!(md.starts_with("# Run report: my run\n"), "{md}");
        // The mechanism table shows the logged mechanism metrics only.
        assert!(md.contains("## Mechanism at work"), "{md}");
        assert!(
            md.contains("| A2TGPO clip scale, max | `a2tgpo/clip_scale/max` | 1.020 (step 1) | 1.120 (step 6)"),
            "{md}"
        );
        assert!(!md.contains("tree leaves per prompt"), "{md}");
        assert!(
            md.contains("13 metrics lines (eval ×2, rsft ×3, sft ×2, train ×6)."),
            "{md}"
        );
        assert!(md.contains("Last training step: 6."), "{md}");
        // Main table: first/last/best (train EM peaks at step 4).
        let em_row = md.lines().find(|l| l.starts_with("| train EM |")).unwrap();
        assert_eq!(
            em_row,
            "| train EM | `train/em` | 0.0500 (step 1) | 0.3000 (step 6) | 0.9000 (step 4) | 0.0500 | 0.9000 | 6 |"
        );
        let sft_row = md
            .lines()
            .find(|l| l.starts_with("| warm-start loss |"))
            .unwrap();
        assert!(sft_row.contains("| 1.000 (step 100) |"), "{sft_row}");
        let rsft_row = md
            .lines()
            .find(|l| l.starts_with("| rejection-sampling loss |"))
            .unwrap();
        assert!(rsft_row.contains("| 0.2500 (step 2) |"), "{rsft_row}");
        assert!(md.contains("| rejection-sampling kept | `rsft/kept_fraction` | 0.6250"));
        assert!(md.contains("| entropy | `actor/entropy` |"));
        assert!(!md.contains("clip fraction"), "all-null metric left out");
        // Evaluation by mode and by hop.
        assert!(md.contains("### eval/greedy\n"));
        assert!(md.contains("### eval/sampled\n"));
        assert!(
            md.contains("EM 20.0% (step 0) → 35.0% (step 6): +15.0 points."),
            "{md}"
        );
        assert!(
            md.contains("| step | em | f1 | turns | EM 1-hop | EM 2-hop |\n|---|---|---|---|---|---|\n| 0 | 20.0% | 25.0% | 2.500 | 30.0% | 10.0% |"),
            "{md}"
        );
        // Plots exist and are linked relative to the report.
        for name in [
            "reward",
            "em",
            "entropy",
            "sft_loss",
            "rsft_loss",
            "turns",
            "step_time",
        ] {
            assert!(
                run.plots_dir().join(format!("{name}.svg")).is_file(),
                "{name}"
            );
            assert!(md.contains(&format!("](plots/{name}.svg)")), "{name}");
        }
        assert!(!run.plots_dir().join("kl.svg").exists());
        // Timing.
        assert!(
            md.contains("| `timing_s/gen` | 45.0 s | 4m 30s | 75.0% |"),
            "{md}"
        );
        assert!(
            md.contains("Wall clock from the first to the last metrics line: 8m 30s."),
            "{md}"
        );
        // Configuration.
        assert!(md.contains("- preset: \"a2tgpo\"\n- seed: 7\n"), "{md}");
        assert!(md.contains("```toml\npreset = \"a2tgpo\""), "{md}");
    }

    #[test]
    fn report_of_an_empty_run_without_config() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir::create(tmp.path(), false).unwrap();
        std::fs::write(run.metrics_path(), "{\"step\":1,\"phase\":\"train\",\"r\"").unwrap();
        let md = std::fs::read_to_string(write_report(&run).unwrap()).unwrap();
        assert!(md.contains("0 metrics lines (none)."), "{md}");
        assert!(md.contains("No training metrics were logged."), "{md}");
        assert!(md.contains("line (1) of the metrics was torn"), "{md}");
        assert!(!md.contains("## Configuration"));
        // No metrics file at all is an error naming it.
        std::fs::remove_file(run.metrics_path()).unwrap();
        let err = write_report(&run).unwrap_err();
        assert!(err.to_string().contains("metrics.jsonl"), "{err}");
    }
}
