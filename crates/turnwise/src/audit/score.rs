//! Scoring an estimator's per-turn credit against the replay advantage: Spearman's rank
//! correlation over the audited turns, the share of decisive turns whose sign it gets right,
//! both overall and per turn depth, with percentile intervals from a bootstrap over episodes
//! (an episode's turns are resampled together: they share a question and a trajectory).

use serde::Serialize;
use turnwise_core::control::SplitMix64;

/// One audited turn as the scores read it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoredTurn {
    /// The episode (its index in the panel).
    pub episode: usize,
    /// The turn's depth.
    pub turn: usize,
    /// The replay advantage.
    pub replay: f64,
    /// Whether the replay advantage is non-zero beyond its error.
    pub decisive: bool,
    /// The estimator's advantage of the turn.
    pub estimate: f64,
}

/// A statistic with its bootstrap interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Estimate {
    /// The statistic on the panel (`None` when undefined: too few turns, or one side
    /// constant).
    pub value: Option<f64>,
    /// 2.5 % percentile over the bootstrap resamples where it is defined.
    pub low: Option<f64>,
    /// 97.5 % percentile.
    pub high: Option<f64>,
}

/// A permutation test of Spearman's ρ: the estimates shuffled over the turns `resamples`
/// times (which keeps their ties and the replay's), giving the ρ that chance alone reaches.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct NullTest {
    /// One-sided p-value of the observed ρ: `(1 + #{shuffled ρ ≥ observed}) / (1 + resamples)`.
    pub p_value: f64,
    /// 2.5 % percentile of the shuffled ρ.
    pub low: f64,
    /// 97.5 % percentile.
    pub high: f64,
}

/// [`NullTest`] of Spearman's ρ between `x` (estimates) and `y` (replay advantages), with
/// `resamples` shuffles of `x` seeded by `seed`; `None` where ρ is undefined.
pub fn spearman_null(x: &[f64], y: &[f64], resamples: usize, seed: u64) -> Option<NullTest> {
    let observed = spearman(x, y)?;
    let ry = ranks(y);
    let mut rx = ranks(x);
    let mut rng = SplitMix64::new(seed ^ 0x7065_726d_7574_6521);
    let mut null = Vec::with_capacity(resamples);
    for _ in 0..resamples {
        for i in (1..rx.len()).rev() {
            rx.swap(i, rng.below(i + 1));
        }
        null.extend(pearson(&rx, &ry));
    }
    let at_least = null.iter().filter(|&&r| r >= observed - 1e-12).count();
    null.sort_by(f64::total_cmp);
    Some(NullTest {
        p_value: (1 + at_least) as f64 / (1 + null.len()) as f64,
        low: percentile(&null, 0.025)?,
        high: percentile(&null, 0.975)?,
    })
}

/// How an estimator's credit agrees with the replay over some turns.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Agreement {
    /// Turns scored.
    pub turns: usize,
    /// Decisive turns among them.
    pub decisive: usize,
    /// Spearman's rank correlation of the estimate with the replay advantage (average ranks
    /// for ties).
    pub spearman: Estimate,
    /// Share of the decisive turns whose estimate has the replay advantage's sign (an
    /// estimate of 0 agrees with neither).
    pub sign_agreement: Estimate,
    /// What chance reaches: Spearman's ρ with the estimates shuffled over the turns.
    pub spearman_null: Option<NullTest>,
}

/// Average ranks (1-based) of `xs`, ties sharing their mean rank.
pub fn ranks(xs: &[f64]) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..xs.len()).collect();
    idx.sort_by(|&a, &b| xs[a].total_cmp(&xs[b]));
    let mut r = vec![0.0; xs.len()];
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && xs[idx[j + 1]] == xs[idx[i]] {
            j += 1;
        }
        let rank = (i + j) as f64 / 2.0 + 1.0;
        for &k in &idx[i..=j] {
            r[k] = rank;
        }
        i = j + 1;
    }
    r
}

/// Pearson's correlation; `None` below two points or when either side is constant.
pub fn pearson(x: &[f64], y: &[f64]) -> Option<f64> {
    let n = x.len();
    if n < 2 || y.len() != n {
        return None;
    }
    let mx = x.iter().sum::<f64>() / n as f64;
    let my = y.iter().sum::<f64>() / n as f64;
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for (a, b) in x.iter().zip(y) {
        sxy += (a - mx) * (b - my);
        sxx += (a - mx).powi(2);
        syy += (b - my).powi(2);
    }
    (sxx > 0.0 && syy > 0.0).then(|| sxy / (sxx * syy).sqrt())
}

/// Spearman's rank correlation (Pearson's over average ranks).
pub fn spearman(x: &[f64], y: &[f64]) -> Option<f64> {
    pearson(&ranks(x), &ranks(y))
}

/// Share of the decisive turns whose estimate's sign is the replay advantage's.
pub fn sign_agreement(turns: &[&ScoredTurn]) -> Option<f64> {
    let decisive: Vec<_> = turns.iter().filter(|t| t.decisive).collect();
    if decisive.is_empty() {
        return None;
    }
    let agree = decisive
        .iter()
        .filter(|t| t.estimate != 0.0 && (t.estimate > 0.0) == (t.replay > 0.0))
        .count();
    Some(agree as f64 / decisive.len() as f64)
}

fn stats(turns: &[&ScoredTurn]) -> (Option<f64>, Option<f64>) {
    let x: Vec<f64> = turns.iter().map(|t| t.estimate).collect();
    let y: Vec<f64> = turns.iter().map(|t| t.replay).collect();
    (spearman(&x, &y), sign_agreement(turns))
}

fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let pos = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64))
}

/// The agreement of the turns that `select` keeps, with `resamples` bootstrap resamples of
/// the episodes (seeded by `seed`).
pub fn agreement(
    turns: &[ScoredTurn],
    select: &dyn Fn(&ScoredTurn) -> bool,
    resamples: usize,
    seed: u64,
) -> Agreement {
    let kept: Vec<&ScoredTurn> = turns.iter().filter(|t| select(t)).collect();
    let (rho, sign) = stats(&kept);
    let spearman_null = spearman_null(
        &kept.iter().map(|t| t.estimate).collect::<Vec<_>>(),
        &kept.iter().map(|t| t.replay).collect::<Vec<_>>(),
        resamples,
        seed,
    );
    let mut episodes: Vec<usize> = turns.iter().map(|t| t.episode).collect();
    episodes.sort_unstable();
    episodes.dedup();
    let by_episode: Vec<Vec<&ScoredTurn>> = episodes
        .iter()
        .map(|&e| kept.iter().copied().filter(|t| t.episode == e).collect())
        .collect();
    let mut rng = SplitMix64::new(seed);
    let (mut rhos, mut signs) = (Vec::new(), Vec::new());
    for _ in 0..resamples {
        let mut sample: Vec<&ScoredTurn> = Vec::with_capacity(kept.len());
        for _ in 0..by_episode.len() {
            sample.extend(by_episode[rng.below(by_episode.len())].iter().copied());
        }
        let (r, s) = stats(&sample);
        rhos.extend(r);
        signs.extend(s);
    }
    rhos.sort_by(f64::total_cmp);
    signs.sort_by(f64::total_cmp);
    let estimate = |value: Option<f64>, boot: &[f64]| Estimate {
        value,
        low: value.and(percentile(boot, 0.025)),
        high: value.and(percentile(boot, 0.975)),
    };
    Agreement {
        turns: kept.len(),
        decisive: kept.iter().filter(|t| t.decisive).count(),
        spearman: estimate(rho, &rhos),
        sign_agreement: estimate(sign, &signs),
        spearman_null,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_average_ties() {
        assert_eq!(ranks(&[3.0, 1.0, 3.0, 2.0]), vec![3.5, 1.0, 3.5, 2.0]);
    }

    #[test]
    fn spearman_is_one_for_a_monotone_map_and_undefined_for_a_constant() {
        let x = [0.1, 0.5, -2.0, 3.0];
        let y: Vec<f64> = x.iter().map(|v: &f64| v.powi(3) + 1.0).collect();
        assert!((spearman(&x, &y).unwrap() - 1.0).abs() < 1e-12);
        let rev: Vec<f64> = y.iter().map(|v| -v).collect();
        assert!((spearman(&x, &rev).unwrap() + 1.0).abs() < 1e-12);
        assert_eq!(spearman(&x, &[1.0; 4]), None);
    }

    #[test]
    fn sign_agreement_reads_only_decisive_turns() {
        let t = |replay: f64, decisive: bool, estimate: f64| ScoredTurn {
            episode: 0,
            turn: 0,
            replay,
            decisive,
            estimate,
        };
        let turns = [
            t(0.5, true, 1.0),
            t(-0.5, true, 1.0),
            t(0.01, false, -1.0),
            t(0.4, true, 0.0),
        ];
        let refs: Vec<&ScoredTurn> = turns.iter().collect();
        assert_eq!(sign_agreement(&refs), Some(1.0 / 3.0));
    }

    #[test]
    fn the_bootstrap_interval_holds_the_value() {
        let turns: Vec<ScoredTurn> = (0..40)
            .map(|i| ScoredTurn {
                episode: i / 2,
                turn: i % 2,
                replay: (i as f64 * 0.37).sin(),
                decisive: i % 3 != 0,
                estimate: (i as f64 * 0.37).sin() + 0.3 * (i as f64 * 1.7).cos(),
            })
            .collect();
        let a = agreement(&turns, &|_| true, 300, 1);
        let (v, lo, hi) = (
            a.spearman.value.unwrap(),
            a.spearman.low.unwrap(),
            a.spearman.high.unwrap(),
        );
        assert!(lo <= v && v <= hi && hi - lo > 0.0, "{lo} {v} {hi}");
        assert_eq!(a.turns, 40);
    }

    /// The permutation test finds a real association and not an absent one: an estimate that
    /// is the replay plus small noise has p at the floor and ρ above the chance band; an
    /// independent one has ρ inside it and p well above 0.05 (fixed seeds).
    #[test]
    fn the_permutation_test_separates_signal_from_chance() {
        let y: Vec<f64> = (0..60).map(|i| (i as f64 * 0.91).sin()).collect();
        let close: Vec<f64> = y
            .iter()
            .enumerate()
            .map(|(i, v)| v + 0.1 * (i as f64 * 2.3).cos())
            .collect();
        let t = spearman_null(&close, &y, 999, 3).unwrap();
        assert!((t.p_value - 1.0 / 1000.0).abs() < 1e-12, "{t:?}");
        assert!(spearman(&close, &y).unwrap() > t.high, "{t:?}");
        assert!(t.low < 0.0 && t.high > 0.0 && t.high < 0.4, "{t:?}");
        let unrelated: Vec<f64> = (0..60).map(|i| ((i * 37 % 61) as f64).ln()).collect();
        let rho = spearman(&unrelated, &y).unwrap();
        let u = spearman_null(&unrelated, &y, 999, 3).unwrap();
        assert!(u.low <= rho && rho <= u.high, "{rho} {u:?}");
        assert!(u.p_value > 0.05, "{rho} {u:?}");
        assert_eq!(spearman_null(&[1.0; 5], &y[..5], 10, 0), None);
    }
}
