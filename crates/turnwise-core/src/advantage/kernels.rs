//! Plain numeric kernels shared by the estimators (each testable on its own).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::AdvantageError;

/// Which standard deviation a normalization divides by (§0.3).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StdKind {
    /// `std_u`: Bessel-corrected (n − 1), torch's default; used by VERL GRPO.
    #[default]
    Unbiased,
    /// `std_p`: population (n), numpy's default; used by AT2PO leaves and A2TGPO eq. 21.
    Population,
}

impl StdKind {
    /// Standard deviation of `xs` of this kind (0 for fewer than 2 values).
    pub fn std(self, xs: &[f64]) -> f64 {
        match self {
            StdKind::Unbiased => std_unbiased(xs),
            StdKind::Population => std_population(xs),
        }
    }
}

/// Arithmetic mean (0 for an empty slice).
pub fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        0.0
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}

fn sum_sq_dev(xs: &[f64]) -> f64 {
    let m = mean(xs);
    xs.iter().map(|x| (x - m) * (x - m)).sum()
}

/// Unbiased (n − 1) standard deviation; 0 for fewer than 2 values.
pub fn std_unbiased(xs: &[f64]) -> f64 {
    if xs.len() < 2 {
        0.0
    } else {
        (sum_sq_dev(xs) / (xs.len() - 1) as f64).sqrt()
    }
}

/// Population (n) standard deviation; 0 for an empty slice.
pub fn std_population(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        0.0
    } else {
        (sum_sq_dev(xs) / xs.len() as f64).sqrt()
    }
}

/// What a normalization does with a group of one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Singleton {
    /// VERL GRPO rule: mean := 0, std := 1, so `A = s / (1 + ε)` (≈ `s`, §3.1).
    MeanZeroStdOne,
    /// Advantage 0 (GiGPO step groups: mean := own value, std := 1; A2TGPO turn groups).
    Zero,
}

/// One group normalization: `(s − mean) / (std + ε)`, or `s − mean` when `std` is `None`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupNorm {
    /// Standard deviation to divide by; `None` = mean-centering only.
    pub std: Option<StdKind>,
    /// ε added to the standard deviation.
    pub epsilon: f64,
    /// Rule for groups of one.
    pub singleton: Singleton,
}

impl GroupNorm {
    /// VERL GRPO normalization (§3.1): `std`, `ε`, singleton mean 0 std 1.
    pub fn grpo(std: StdKind, epsilon: f64) -> Self {
        Self {
            std: Some(std),
            epsilon,
            singleton: Singleton::MeanZeroStdOne,
        }
    }

    /// The `(mean, std)` this normalization uses for a group `pool` (after the singleton rule;
    /// `std` is 0 for mean-centering).
    pub fn stats(&self, pool: &[f64]) -> (f64, f64) {
        match (pool.len(), self.singleton) {
            (0, _) => (0.0, 1.0),
            (1, Singleton::MeanZeroStdOne) => (0.0, 1.0),
            (1, Singleton::Zero) => (pool[0], 1.0),
            _ => (mean(pool), self.std.map_or(0.0, |k| k.std(pool))),
        }
    }

    /// Normalizes one value with given group statistics.
    pub fn normalize_with(&self, x: f64, (m, s): (f64, f64)) -> f64 {
        match self.std {
            Some(_) => (x - m) / (s + self.epsilon),
            None => x - m,
        }
    }

    /// Normalizes one group of scores.
    pub fn apply(&self, scores: &[f64]) -> Vec<f64> {
        let st = self.stats(scores);
        scores.iter().map(|&x| self.normalize_with(x, st)).collect()
    }
}

/// GRPO advantage of one group (§3.1): `(s − mean) / (std + ε)`; a group of one gives
/// `s / (1 + ε)` (VERL: mean 0, std 1).
pub fn grpo_normalize(scores: &[f64], std: StdKind, epsilon: f64) -> Vec<f64> {
    GroupNorm::grpo(std, epsilon).apply(scores)
}

/// Dr.GRPO advantage of one group (§3.1): `s − mean` (a group of one keeps `s`).
pub fn dr_grpo_center(scores: &[f64]) -> Vec<f64> {
    if scores.len() == 1 {
        return scores.to_vec();
    }
    let m = mean(scores);
    scores.iter().map(|x| x - m).collect()
}

/// RLOO advantage of one group (§3.1): `s_i − mean_{j≠i} s_j = G/(G−1)·(s_i − mean)`; a group
/// of one keeps `s` (no baseline).
pub fn rloo(scores: &[f64]) -> Vec<f64> {
    let g = scores.len();
    if g <= 1 {
        return scores.to_vec();
    }
    let m = mean(scores);
    let f = g as f64 / (g - 1) as f64;
    scores.iter().map(|x| f * (x - m)).collect()
}

/// Applies `norm` to every group of `scores` defined by equal `keys`, returning the results in
/// the original order.
pub fn normalize_by_key<K: Ord + Clone>(
    scores: &[f64],
    keys: &[K],
    norm: impl Fn(&[f64]) -> Vec<f64>,
) -> Vec<f64> {
    debug_assert_eq!(scores.len(), keys.len());
    let mut out = vec![0.0; scores.len()];
    for idx in group_indices(keys).into_values() {
        let vals: Vec<f64> = idx.iter().map(|&i| scores[i]).collect();
        for (i, v) in idx.into_iter().zip(norm(&vals)) {
            out[i] = v;
        }
    }
    out
}

/// Indices of equal keys, grouped (ascending index order inside every group).
pub fn group_indices<K: Ord + Clone>(keys: &[K]) -> BTreeMap<K, Vec<usize>> {
    let mut map: BTreeMap<K, Vec<usize>> = BTreeMap::new();
    for (i, k) in keys.iter().enumerate() {
        map.entry(k.clone()).or_default().push(i);
    }
    map
}

/// VERL `masked_whiten` (§3.3): `(x − mean_m) · rsqrt(var_m + 1e-8)` applied to **every**
/// position, with mean and Bessel-corrected variance over the masked positions. Errors when fewer
/// than two positions are masked.
pub fn masked_whiten(values: &[f64], mask: &[bool]) -> Result<Vec<f64>, AdvantageError> {
    let sel: Vec<f64> = values
        .iter()
        .zip(mask)
        .filter(|&(_, &m)| m)
        .map(|(&v, _)| v)
        .collect();
    if sel.len() < 2 {
        return Err(AdvantageError::WhitenTooFew { count: sel.len() });
    }
    let m = mean(&sel);
    let var = sum_sq_dev(&sel) / (sel.len() - 1) as f64;
    let scale = 1.0 / (var + 1e-8).sqrt();
    Ok(values.iter().map(|v| (v - m) * scale).collect())
}

/// Discounted suffix sums `out[t] = Σ_{k≥t} γ^{k−t} xs[k]`.
pub fn discounted_suffix_sums(xs: &[f64], gamma: f64) -> Vec<f64> {
    let mut out = vec![0.0; xs.len()];
    let mut acc = 0.0;
    for t in (0..xs.len()).rev() {
        acc = xs[t] + gamma * acc;
        out[t] = acc;
    }
    out
}

/// Logistic function `σ(x) = 1 / (1 + e^{−x})`.
pub fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// Numerically stable softmax.
pub fn softmax(xs: &[f64]) -> Vec<f64> {
    let mx = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = xs.iter().map(|x| (x - mx).exp()).collect();
    let z: f64 = e.iter().sum();
    e.into_iter().map(|v| v / z).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{TOL, assert_all_close, assert_close};

    #[test]
    fn std_kinds() {
        let xs = [1.0, 0.0, 0.0, 1.0];
        assert_close(std_unbiased(&xs), (1.0f64 / 3.0).sqrt(), 1e-12, "std_u");
        assert_close(std_population(&xs), 0.5, 1e-12, "std_p");
        assert_eq!(std_unbiased(&[3.0]), 0.0);
    }

    #[test]
    fn softmax_and_sigmoid() {
        assert_all_close(&softmax(&[0.7, 0.5]), &[0.549834, 0.450166], TOL, "softmax");
        assert_close(sigmoid(0.0), 0.5, 1e-15, "sigmoid(0)");
        assert_close(
            sigmoid(-40.0) + sigmoid(40.0),
            1.0,
            1e-15,
            "sigmoid symmetry",
        );
    }

    #[test]
    fn discounted_sums() {
        assert_all_close(
            &discounted_suffix_sums(&[0.0, 0.0, 1.0], 0.95),
            &[0.9025, 0.95, 1.0],
            1e-12,
            "returns",
        );
    }

    #[test]
    fn masked_whiten_needs_two() {
        assert_eq!(
            masked_whiten(&[1.0, 2.0], &[true, false]),
            Err(AdvantageError::WhitenTooFew { count: 1 })
        );
    }

    #[test]
    fn singleton_rules() {
        let z = GroupNorm {
            std: Some(StdKind::Unbiased),
            epsilon: 1e-6,
            singleton: Singleton::Zero,
        };
        assert_eq!(z.apply(&[0.9]), vec![0.0]);
        assert_all_close(
            &grpo_normalize(&[0.7], StdKind::Unbiased, 1e-6),
            &[0.7],
            TOL,
            "grpo",
        );
    }
}
