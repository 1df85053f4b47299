//! The statistics of a study report: means with 95 % Student-t intervals over seeds, and a
//! paired bootstrap over seeds × panel questions for the difference between two arms.

/// An estimate with a 95 % interval (`lo`, `hi` are NaN when there is too little data for one).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Interval {
    /// The point estimate.
    pub mean: f64,
    /// Lower end.
    pub lo: f64,
    /// Upper end.
    pub hi: f64,
    /// How many values (seeds) it rests on.
    pub n: usize,
}

impl Interval {
    /// Whether the interval lies above 0, below it, or covers it: `Some(true)` above, `Some(false)`
    /// below, `None` otherwise (or without an interval).
    pub fn sign(&self) -> Option<bool> {
        if self.lo > 0.0 {
            Some(true)
        } else if self.hi < 0.0 {
            Some(false)
        } else {
            None
        }
    }
}

/// The two-sided 95 % quantile of Student's t with `df` degrees of freedom (`t_{0.975, df}`):
/// tabulated to 3 decimals for df 1–30, then the Cornish–Fisher expansion about the normal
/// quantile (within 2e-4 of the exact value from df 31 on). NaN for df 0.
pub fn t975(df: usize) -> f64 {
    const TABLE: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    match df {
        0 => f64::NAN,
        1..=30 => TABLE[df - 1],
        _ => {
            let z: f64 = 1.959_963_984_540_054;
            let n = df as f64;
            let g1 = (z.powi(3) + z) / 4.0;
            let g2 = (5.0 * z.powi(5) + 16.0 * z.powi(3) + 3.0 * z) / 96.0;
            let g3 = (3.0 * z.powi(7) + 19.0 * z.powi(5) + 17.0 * z.powi(3) - 15.0 * z) / 384.0;
            z + g1 / n + g2 / n.powi(2) + g3 / n.powi(3)
        }
    }
}

/// The mean of `xs` (NaN when empty).
pub fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len() as f64
}

/// The mean of `xs` with its 95 % t-interval, `mean ± t975(n − 1) · s / √n` (`s` the sample
/// standard deviation); with one value the ends are NaN. `None` when `xs` is empty.
pub fn t_interval(xs: &[f64]) -> Option<Interval> {
    let n = xs.len();
    if n == 0 {
        return None;
    }
    let m = mean(xs);
    if n == 1 {
        return Some(Interval {
            mean: m,
            lo: f64::NAN,
            hi: f64::NAN,
            n,
        });
    }
    let var = xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1) as f64;
    let half = t975(n - 1) * (var / n as f64).sqrt();
    Some(Interval {
        mean: m,
        lo: m - half,
        hi: m + half,
        n,
    })
}

/// The `q`-quantile of sorted values (type 7); it lives in `turnwise-core`, where the rollout's
/// TDS metrics also read it.
pub use turnwise_core::control::quantile;

/// SplitMix64: a small, fixed pseudo-random generator, so that a report's intervals never change
/// with a dependency's version.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform index in `0..n` (`n` > 0; Lemire's multiply-shift, bias below 2^-32 for the
    /// sizes used here).
    pub fn below(&mut self, n: usize) -> usize {
        (((self.next_u64() >> 32) * n as u64) >> 32) as usize
    }
}

/// Resamples of [`paired_bootstrap`] in a report.
pub const BOOTSTRAP_RESAMPLES: usize = 2000;
/// The bootstrap's generator seed in a report.
pub const BOOTSTRAP_SEED: u64 = 2000;

/// The paired difference of two arms with a 95 % percentile-bootstrap interval over seeds ×
/// questions. `diff[s][q]` is arm A's outcome minus arm B's for seed `s` (both arms' runs of
/// that seed) on panel question `q`; every row has the same questions. Each of `resamples`
/// resamples draws the seeds with replacement and, independently, the questions with
/// replacement, and takes the mean difference over the drawn seed × question grid; the
/// interval is the 2.5 and 97.5 % quantiles ([`quantile`]) of those means. The estimate is the
/// mean of `diff`. `None` when there is no seed or no question.
pub fn paired_bootstrap(diff: &[Vec<f64>], resamples: usize, seed: u64) -> Option<Interval> {
    let ns = diff.len();
    let nq = diff.first().map_or(0, Vec::len);
    if ns == 0 || nq == 0 || diff.iter().any(|r| r.len() != nq) || resamples == 0 {
        return None;
    }
    let estimate = diff.iter().flatten().sum::<f64>() / (ns * nq) as f64;
    let mut rng = SplitMix64::new(seed);
    let mut seed_w = vec![0u32; ns];
    let mut q_w = vec![0u32; nq];
    let mut stats = Vec::with_capacity(resamples);
    for _ in 0..resamples {
        seed_w.iter_mut().for_each(|w| *w = 0);
        q_w.iter_mut().for_each(|w| *w = 0);
        for _ in 0..ns {
            seed_w[rng.below(ns)] += 1;
        }
        for _ in 0..nq {
            q_w[rng.below(nq)] += 1;
        }
        let mut total = 0.0;
        for (row, &ws) in diff.iter().zip(&seed_w) {
            if ws == 0 {
                continue;
            }
            let r: f64 = row.iter().zip(&q_w).map(|(d, &wq)| d * f64::from(wq)).sum();
            total += f64::from(ws) * r;
        }
        stats.push(total / (ns * nq) as f64);
    }
    stats.sort_by(f64::total_cmp);
    Some(Interval {
        mean: estimate,
        lo: quantile(&stats, 0.025),
        hi: quantile(&stats, 0.975),
        n: ns,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn t_quantiles_match_the_table_and_the_expansion() {
        assert_eq!(t975(1), 12.706);
        assert_eq!(t975(2), 4.303);
        assert_eq!(t975(30), 2.042);
        // Exact values (R: qt(0.975, df)): 40 → 2.021075, 60 → 2.000298, 120 → 1.979930.
        assert!((t975(40) - 2.021075).abs() < 2e-4, "{}", t975(40));
        assert!((t975(60) - 2.000298).abs() < 1e-4, "{}", t975(60));
        assert!((t975(120) - 1.979930).abs() < 1e-4, "{}", t975(120));
        assert!(t975(0).is_nan());
    }

    #[test]
    fn a_t_interval_by_hand() {
        // 0.50, 0.54, 0.58: mean 0.54, s = 0.04, s/√3 = 0.0230940, × 4.303 = 0.0993735.
        let i = t_interval(&[0.50, 0.54, 0.58]).unwrap();
        assert!((i.mean - 0.54).abs() < 1e-12);
        assert!((i.lo - (0.54 - 0.099_373_5)).abs() < 1e-6, "{i:?}");
        assert!((i.hi - (0.54 + 0.099_373_5)).abs() < 1e-6, "{i:?}");
        assert_eq!(i.n, 3);
        assert_eq!(i.sign(), Some(true));
        // Two values 1 and 3: mean 2, s = √2, s/√2 = 1, × 12.706.
        let i = t_interval(&[1.0, 3.0]).unwrap();
        assert!((i.lo - (2.0 - 12.706)).abs() < 1e-12 && (i.hi - 14.706).abs() < 1e-12);
        assert_eq!(i.sign(), None);
        let one = t_interval(&[0.3]).unwrap();
        assert_eq!(one.mean, 0.3);
        assert!(one.lo.is_nan() && one.hi.is_nan() && one.sign().is_none());
        assert!(t_interval(&[]).is_none());
    }

    #[test]
    fn quantiles_interpolate_like_type_7() {
        let xs = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(quantile(&xs, 0.0), 1.0);
        assert_eq!(quantile(&xs, 1.0), 4.0);
        assert_eq!(quantile(&xs, 0.5), 2.5);
        // 0.025 · 3 = 0.075 → 1 + 0.075; 0.975 · 3 = 2.925 → 3 + 0.925.
        assert!((quantile(&xs, 0.025) - 1.075).abs() < 1e-12);
        assert!((quantile(&xs, 0.975) - 3.925).abs() < 1e-12);
        assert!(quantile(&[], 0.5).is_nan());
    }

    #[test]
    fn the_bootstrap_by_hand() {
        // A constant difference: every resample's mean is that constant.
        let d = vec![vec![0.25; 5]; 3];
        let i = paired_bootstrap(&d, 500, 1).unwrap();
        assert_eq!((i.mean, i.lo, i.hi, i.n), (0.25, 0.25, 0.25, 3));
        // Two seeds, one question, differences 0 and 1: a resample's mean is 0, 0.5 or 1 with
        // probabilities 1/4, 1/2, 1/4, so the 2.5 % and 97.5 % quantiles of 2,000 resamples
        // are 0 and 1, and about half the resamples give 0.5.
        let d = vec![vec![0.0], vec![1.0]];
        let i = paired_bootstrap(&d, 2000, 7).unwrap();
        assert_eq!((i.mean, i.lo, i.hi), (0.5, 0.0, 1.0));
        // One seed, questions 1, 0, 0, 0 (mean 0.25): the resampled mean is k/4 with k ~
        // Binomial(4, 1/4); P(k = 0) = 0.316 > 2.5 %, P(k ≥ 3) = 0.051 > 2.5 %,
        // P(k = 4) = 0.004 < 2.5 %: the interval is [0, 0.75].
        let d = vec![vec![1.0, 0.0, 0.0, 0.0]];
        let i = paired_bootstrap(&d, 2000, 11).unwrap();
        assert_eq!((i.mean, i.lo, i.hi), (0.25, 0.0, 0.75));
        // The same inputs and seed give the same interval; rows of other lengths give none.
        assert_eq!(paired_bootstrap(&d, 2000, 11), Some(i));
        assert!(paired_bootstrap(&[vec![1.0], vec![1.0, 2.0]], 10, 0).is_none());
        assert!(paired_bootstrap(&[], 10, 0).is_none());
    }

    #[test]
    fn split_mix_indices_cover_their_range_evenly() {
        let mut r = SplitMix64::new(0);
        let mut counts = [0usize; 4];
        for _ in 0..40_000 {
            counts[r.below(4)] += 1;
        }
        assert!(
            counts.iter().all(|&c| (9_500..10_500).contains(&c)),
            "{counts:?}"
        );
    }
}
