//! Charts of the main curves of a run: which metrics to plot ([`PlotSpec`], with fallback names
//! since estimators log different keys) and writing them as SVG files ([`write_plots`]).

use std::path::{Path, PathBuf};

use super::dir::write_atomic;
use super::metrics::MetricsLog;
use super::svg::{LineChart, Series};
use super::{RunError, RunResult};

use turnwise_core::metric_keys as mk;

/// One curve of a [`PlotSpec`]: the first of `keys` with data is drawn.
#[derive(Debug, Clone, PartialEq)]
pub struct SeriesSpec {
    /// The legend label.
    pub label: String,
    /// Candidate metric names, in order of preference.
    pub keys: Vec<String>,
}

/// One chart: a file name, a title and its curves. Curves without data are left out, and a
/// chart without any curve is not written.
#[derive(Debug, Clone, PartialEq)]
pub struct PlotSpec {
    /// The file stem (`reward` → `plots/reward.svg`).
    pub name: String,
    /// The chart title.
    pub title: String,
    /// The curves.
    pub series: Vec<SeriesSpec>,
}

impl PlotSpec {
    /// A chart without curves yet.
    pub fn new(name: impl Into<String>, title: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            title: title.into(),
            series: Vec::new(),
        }
    }

    /// Adds a curve drawn from the first of `keys` that has data.
    pub fn series(mut self, label: impl Into<String>, keys: &[&str]) -> Self {
        self.series.push(SeriesSpec {
            label: label.into(),
            keys: keys.iter().map(|k| k.to_string()).collect(),
        });
        self
    }
}

/// A chart written by [`write_plots`].
#[derive(Debug, Clone, PartialEq)]
pub struct PlotFile {
    /// The chart title.
    pub title: String,
    /// The SVG file.
    pub path: PathBuf,
    /// The metric drawn for each curve.
    pub keys: Vec<String>,
    /// How many points were drawn, over all curves.
    pub points: usize,
}

/// The main curves of a run (verl names first, then the names turnwise's trainer logs):
/// reward, exact match (train and evaluation), F1, entropy, KL, clip fraction, response length,
/// turns, tool calls, gradient norm, policy loss, advantages, warm-start loss and step time.
pub fn default_plot_specs() -> Vec<PlotSpec> {
    vec![
        PlotSpec::new("reward", "Reward").series(
            "train",
            &[
                mk::critic::SCORE_MEAN,
                mk::critic::REWARDS_MEAN,
                mk::train::REWARD,
                mk::reward::MEAN,
            ],
        ),
        PlotSpec::new("em", "Exact match")
            .series(
                "train",
                &[mk::train::EM, mk::critic::EM_MEAN, mk::reward::EM],
            )
            .series("validation (greedy)", &[mk::eval::VALIDATION_GREEDY_EM])
            .series(
                "test (greedy)",
                &[mk::eval::TEST_GREEDY_EM, mk::eval::GREEDY_EM, mk::eval::EM],
            )
            .series(
                "test (sampled)",
                &[mk::eval::TEST_SAMPLED_EM, mk::eval::SAMPLED_EM],
            ),
        PlotSpec::new("f1", "F1")
            .series("train", &[mk::train::F1])
            .series("validation (greedy)", &[mk::eval::VALIDATION_GREEDY_F1])
            .series(
                "test (greedy)",
                &[mk::eval::TEST_GREEDY_F1, mk::eval::GREEDY_F1, mk::eval::F1],
            )
            .series(
                "test (sampled)",
                &[mk::eval::TEST_SAMPLED_F1, mk::eval::SAMPLED_F1],
            ),
        PlotSpec::new("entropy", "Policy entropy").series("entropy", &[mk::actor::ENTROPY]),
        PlotSpec::new("kl", "KL divergence")
            .series("ppo_kl (old‖new)", &[mk::actor::PPO_KL])
            .series("kl_loss (ref)", &[mk::actor::KL_LOSS]),
        PlotSpec::new("clipfrac", "Clip fraction")
            .series("clipped", &[mk::actor::PG_CLIPFRAC])
            .series("dual clip (A<0)", &[mk::actor::PG_CLIPFRAC_LOWER]),
        PlotSpec::new("response_length", "Response length (tokens)")
            .series("mean", &[mk::length::RESPONSE_MEAN])
            .series("agent tokens", &[mk::length::RESPONSE_AGENT_MEAN]),
        PlotSpec::new("turns", "Turns per trajectory")
            .series("train", &[mk::env::TURNS_MEAN, mk::env::NUM_TURNS_MEAN])
            .series(
                "validation (greedy)",
                &[
                    mk::eval::VALIDATION_GREEDY_TURNS,
                    mk::eval::GREEDY_TURNS,
                    mk::eval::TURNS,
                ],
            ),
        PlotSpec::new("tool_calls", "Tool calls per trajectory")
            .series(
                "train",
                &[mk::env::TOOL_CALLS_MEAN, mk::env::TOOL_CALL_COUNTS_MEAN],
            )
            .series(
                "validation (greedy)",
                &[
                    mk::eval::VALIDATION_GREEDY_TOOL_CALLS,
                    mk::eval::GREEDY_TOOL_CALLS,
                    mk::eval::TOOL_CALLS,
                ],
            ),
        PlotSpec::new("grad_norm", "Gradient norm (before clipping)")
            .series("grad_norm", &[mk::actor::GRAD_NORM]),
        PlotSpec::new("pg_loss", "Policy loss").series("pg_loss", &[mk::actor::PG_LOSS]),
        PlotSpec::new("advantages", "Advantages (loss-masked tokens)")
            .series("max", &[mk::critic::ADVANTAGES_MAX])
            .series("mean", &[mk::critic::ADVANTAGES_MEAN])
            .series("min", &[mk::critic::ADVANTAGES_MIN]),
        PlotSpec::new("sft_loss", "Warm-start loss").series("loss", &[mk::sft::LOSS]),
        PlotSpec::new("rsft_loss", "Rejection-sampling fine-tuning loss")
            .series("loss", &[mk::sft::RSFT_LOSS]),
        PlotSpec::new("step_time", "Seconds per step")
            .series("step", &[mk::timing::STEP])
            .series("generation", &[mk::timing::GEN])
            .series("update", &[mk::timing::UPDATE]),
    ]
}

/// The chart of `spec` over `log` with the metric used for each curve, or `None` when no curve
/// has data. Null and missing values are skipped.
pub fn plot_records(log: &MetricsLog, spec: &PlotSpec) -> Option<(LineChart, Vec<String>)> {
    let mut chart = LineChart::new(spec.title.clone());
    let mut keys = Vec::new();
    for s in &spec.series {
        let Some(key) = s.keys.iter().find(|k| log.has(k)) else {
            continue;
        };
        let points = log
            .series(key)
            .into_iter()
            .map(|(step, v)| (step as f64, v))
            .collect();
        let label = if s.label.is_empty() {
            key.clone()
        } else {
            s.label.clone()
        };
        chart = chart.with_series(Series::new(label, points));
        keys.push(key.clone());
    }
    if chart.series.is_empty() {
        return None;
    }
    if let [key] = keys.as_slice() {
        chart = chart.with_y_label(key.clone());
    }
    Some((chart, keys))
}

/// Writes `dir/<name>.svg` for every spec with data (creating `dir`) and returns what was
/// written, in the order of `specs`.
pub fn write_plots(log: &MetricsLog, dir: &Path, specs: &[PlotSpec]) -> RunResult<Vec<PlotFile>> {
    std::fs::create_dir_all(dir).map_err(RunError::io("create the directory", dir))?;
    let mut out = Vec::new();
    for spec in specs {
        let Some((chart, keys)) = plot_records(log, spec) else {
            continue;
        };
        let path = dir.join(format!("{}.svg", spec.name));
        write_atomic(&path, chart.to_svg().as_bytes())?;
        out.push(PlotFile {
            title: spec.title.clone(),
            path,
            keys,
            points: chart.point_count(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::metrics::MetricsWriter;
    use super::super::read_metrics;
    use super::super::svg::tests::polylines;
    use super::*;

    #[test]
    fn writes_one_chart_per_curve_with_data_and_train_vs_eval() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("metrics.jsonl");
        let mut w = MetricsWriter::open(&path).unwrap();
        for step in 1..=12u64 {
            let s = step as f64;
            let entropy = if step == 5 { f64::NAN } else { 1.0 / s };
            w.write(
                step,
                "train",
                [
                    ("critic/rewards/mean", s / 12.0),
                    ("train/em", s / 24.0),
                    ("actor/entropy", entropy),
                    ("actor/ppo_kl", 1e-3 * s),
                    ("env/turns/mean", 2.0 + s / 10.0),
                ],
            )
            .unwrap();
            if step % 4 == 0 {
                w.write(
                    step,
                    "eval",
                    [
                        ("eval/test/greedy/em", s / 20.0),
                        ("eval/validation/greedy/em", s / 25.0),
                        ("eval/validation/greedy/turns", 2.5),
                    ],
                )
                .unwrap();
            }
        }
        let log = read_metrics(&path).unwrap();
        let plots = write_plots(&log, &tmp.path().join("plots"), &default_plot_specs()).unwrap();
        let names: Vec<&str> = plots
            .iter()
            .map(|p| p.path.file_name().unwrap().to_str().unwrap())
            .collect();
        assert_eq!(
            names,
            vec!["reward.svg", "em.svg", "entropy.svg", "kl.svg", "turns.svg"]
        );
        // Fallback key for the reward.
        assert_eq!(plots[0].keys, vec!["critic/rewards/mean"]);
        let reward = std::fs::read_to_string(&plots[0].path).unwrap();
        assert_eq!(polylines(&reward), vec![("train".to_string(), 12)]);
        assert!(reward.contains("critic/rewards/mean"), "y label");
        // Train vs eval on one chart.
        let em = std::fs::read_to_string(&plots[1].path).unwrap();
        assert_eq!(
            polylines(&em),
            vec![
                ("train".to_string(), 12),
                ("validation (greedy)".to_string(), 3),
                ("test (greedy)".to_string(), 3)
            ]
        );
        assert_eq!(plots[1].points, 18);
        // The NaN entropy is skipped.
        let entropy = std::fs::read_to_string(&plots[2].path).unwrap();
        assert_eq!(polylines(&entropy), vec![("entropy".to_string(), 11)]);
        assert_eq!(
            plots[4].keys,
            vec!["env/turns/mean", "eval/validation/greedy/turns"]
        );
    }

    #[test]
    fn a_spec_without_data_writes_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let log = MetricsLog::default();
        let plots = write_plots(&log, tmp.path(), &default_plot_specs()).unwrap();
        assert!(plots.is_empty());
        let custom = PlotSpec::new("x", "X").series("", &["missing", "also/missing"]);
        assert!(plot_records(&log, &custom).is_none());
    }
}
