//! The audit's outputs: `audit.md` (the tables), `audit.json` (everything, every turn's
//! returns included) and `spearman_by_depth.svg` (each estimator's rank correlation with the
//! replay per turn depth, its bootstrap interval shaded).

use std::fmt::Write;
use std::path::Path;

use anyhow::{Context, Result};

use super::AuditReport;
use super::score::Estimate;
use crate::run::{LineChart, Series};

/// The files [`write`] creates in its folder.
pub const FILES: [&str; 3] = ["audit.md", "audit.json", "spearman_by_depth.svg"];

fn fmt_estimate(e: &Estimate) -> String {
    match (e.value, e.low, e.high) {
        (Some(v), Some(lo), Some(hi)) => format!("{v:+.2} [{lo:+.2}, {hi:+.2}]"),
        (Some(v), _, _) => format!("{v:+.2}"),
        _ => "–".into(),
    }
}

/// The markdown report.
pub fn markdown(r: &AuditReport) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# Credit audit of {}\n", r.source);
    let _ = writeln!(
        s,
        "{} episodes of the {} split (groups of {}), K = {} alternatives and M = {} \
         continuations per turn at temperature {}, seed {}: {} turns, {} replay rollouts (bound \
         turns × (K + 1) × M = {}). Mean return of the audited episodes {:.3}. Seconds: {}.\n",
        r.episodes,
        r.split,
        r.group,
        r.alternatives,
        r.rollouts,
        r.temperature,
        r.seed,
        r.turns,
        r.replay_rollouts,
        r.cost_bound,
        r.mean_return,
        r.seconds
            .iter()
            .map(|(k, v)| format!("{k} {v:.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let stated = match r.stated_density {
        Some(rho) => format!(" The world states ρ = {rho} (`task.world.decision_density`)."),
        None => String::new(),
    };
    let _ = writeln!(
        s,
        "**Realised decision density ρ = {:.2}**: the share of turns whose replay advantage is \
         non-zero beyond twice its standard error.{stated}\n",
        r.realised_density
    );
    let _ = writeln!(s, "## The replay by turn depth\n");
    let _ = writeln!(
        s,
        "| depth | turns | decisive | realised ρ | mean abs(Â) | mean SE |\n|---:|---:|---:|---:|---:|---:|"
    );
    for d in &r.depths {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.2} | {:.3} | {:.3} |",
            d.depth,
            d.turns,
            d.decisive,
            d.decisive as f64 / d.turns.max(1) as f64,
            d.mean_abs_advantage,
            d.mean_se
        );
    }
    let _ = writeln!(s, "\n## Estimators against the replay\n");
    let _ = writeln!(
        s,
        "Spearman: rank correlation of the estimator's turn advantage with the replay advantage \
         over all audited turns; sign: share of the decisive turns whose advantage has the \
         replay's sign. Brackets: 95 % bootstrap intervals over episodes; – where undefined (a \
         constant side, or no decisive turn). Chance: the 95 % range of Spearman's ρ with the \
         estimator's advantages shuffled over the turns ({} shuffles), and p the share of \
         shuffles reaching the observed ρ (one-sided): an estimator whose ρ is inside the \
         chance range ranks the turns no better than a shuffle of its own values.\n",
        r.bootstrap
    );
    let _ = writeln!(
        s,
        "| estimator | turns | Spearman [95 %] | chance [95 %] | p | decisive | sign agreement [95 %] |\n|---|---:|---|---|---:|---:|---|"
    );
    for e in &r.estimators {
        let (chance, p) = match &e.overall.spearman_null {
            Some(n) => (
                format!("[{:+.2}, {:+.2}]", n.low, n.high),
                format!("{:.3}", n.p_value),
            ),
            None => ("–".into(), "–".into()),
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {chance} | {p} | {} | {} |",
            e.name,
            e.overall.turns,
            fmt_estimate(&e.overall.spearman),
            e.overall.decisive,
            fmt_estimate(&e.overall.sign_agreement)
        );
    }
    let _ = writeln!(s, "\n### By turn depth\n");
    let _ = writeln!(
        s,
        "| estimator | depth | turns | Spearman [95 %] | decisive | sign agreement [95 %] |\n|---|---:|---:|---|---:|---|"
    );
    for e in &r.estimators {
        for (d, a) in e.by_depth.iter().enumerate() {
            let _ = writeln!(
                s,
                "| {} | {d} | {} | {} | {} | {} |",
                e.name,
                a.turns,
                fmt_estimate(&a.spearman),
                a.decisive,
                fmt_estimate(&a.sign_agreement)
            );
        }
    }
    if !r.skipped.is_empty() {
        let _ = writeln!(s, "\nLeft out:\n");
        for (name, why) in &r.skipped {
            let _ = writeln!(s, "- {name}: {why}");
        }
    }
    s
}

/// The plot: per estimator, Spearman's ρ with the replay at each turn depth.
pub fn plot(r: &AuditReport) -> LineChart {
    let mut chart =
        LineChart::new("Turn credit vs replay advantage, by turn depth").with_y_label("Spearman ρ");
    for e in &r.estimators {
        let mut points = Vec::new();
        let mut band = Vec::new();
        for (d, a) in e.by_depth.iter().enumerate() {
            let x = d as f64;
            points.push((x, a.spearman.value.unwrap_or(f64::NAN)));
            if let (Some(lo), Some(hi)) = (a.spearman.low, a.spearman.high) {
                band.push((x, lo, hi));
            }
        }
        chart = chart.with_series(Series::new(e.name.clone(), points).with_band(band));
    }
    chart
}

/// Writes [`FILES`] into `dir` (created if absent).
pub fn write(r: &AuditReport, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let put = |name: &str, text: String| {
        let path = dir.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
    };
    put(FILES[0], markdown(r))?;
    put(FILES[1], serde_json::to_string_pretty(r)? + "\n")?;
    put(FILES[2], plot(r).to_svg())?;
    Ok(())
}
