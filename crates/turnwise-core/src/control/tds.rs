//! T2PO Turn-level Dynamical Sampling (TDS), spec §6.3 (t2po.md §4.3, Alg. 2; T2PO code
//! `T2PO_multi_turn_loop`).
//!
//! - Turn score `Φ^k = (Π_t M_t^k)^{1/T_k}`, computed in log space with a floor
//!   (\[REC\]: `Φ = exp(mean(log(max(M_t, 1e-8))))`), see [`turn_score`].
//! - Gap `Γ^k = |Φ^k − Φ^{k−1}|`, `Γ^1 = +∞` (no previous turn), see [`turn_gap`].
//! - Paper rule: regenerate turn k while `Γ^k < η`, at most `B_max` times.
//! - Code rule: regenerate rows with `0 < Γ < η` (η = 0.3), up to `max_try = 2` extra attempts,
//!   batch-wise (all flagged rows at once), comparing with the previous turn's **final** score and
//!   keeping the last regenerated sample even if it is still below η.

use serde::{Deserialize, Serialize};

use super::ControlError;

/// Floor on `M_t` before taking logs in [`turn_score`] (\[REC\] §6.3: M can be 0).
pub const TURN_SCORE_FLOOR: f64 = 1e-8;

/// Which regeneration test to apply (§6.3, §9 item 8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TdsRule {
    /// Paper Alg. 2: regenerate while `Γ < η`.
    Paper,
    /// Official code: regenerate while `0 < Γ < η` (exact repeats are exempt).
    #[default]
    Code,
}

/// TDS settings (§6.3, §8.5).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TdsSettings {
    /// Turn TDS on (off by default; the T2PO preset enables it).
    pub enabled: bool,
    /// Threshold η (code default 0.3).
    pub eta: f64,
    /// Regeneration budget per turn: `B_max` / `algorithm.TDS.max_try` (2).
    pub max_try: usize,
    /// Paper or code test.
    pub rule: TdsRule,
}

impl Default for TdsSettings {
    fn default() -> Self {
        Self {
            enabled: false,
            eta: 0.3,
            max_try: 2,
            rule: TdsRule::Code,
        }
    }
}

/// `Φ = exp(mean(log(max(M_t, 1e-8))))`, the floored geometric mean of a turn's signals.
/// `None` for an empty turn.
pub fn turn_score(m: &[f64]) -> Option<f64> {
    if m.is_empty() {
        return None;
    }
    let s: f64 = m.iter().map(|&x| x.max(TURN_SCORE_FLOOR).ln()).sum();
    Some((s / m.len() as f64).exp())
}

/// `Γ^k = |Φ^k − Φ^{k−1}|`; `+∞` when there is no previous turn (`Φ^0 = null`).
pub fn turn_gap(previous: Option<f64>, current: f64) -> f64 {
    previous.map_or(f64::INFINITY, |p| (current - p).abs())
}

impl TdsSettings {
    /// Whether a turn with gap `gamma` that has already been regenerated `attempts` times is
    /// regenerated once more.
    pub fn should_regenerate(&self, gamma: f64, attempts: usize) -> bool {
        if !self.enabled || attempts >= self.max_try {
            return false;
        }
        match self.rule {
            TdsRule::Paper => gamma < self.eta,
            TdsRule::Code => gamma > 0.0 && gamma < self.eta,
        }
    }

    /// Checks η ≥ 0.
    pub fn validate(&self) -> Result<(), ControlError> {
        if self.eta.is_nan() || self.eta < 0.0 {
            return Err(ControlError::InvalidSetting {
                name: "eta",
                reason: "must be a non-negative number",
            });
        }
        Ok(())
    }
}

/// Batch-wise TDS bookkeeping across the turns of a batch of environments (code rule flow).
///
/// Per turn: the engine samples all rows, calls [`Self::flag`] with their scores, regenerates the
/// flagged rows, calls [`Self::record_attempt`], and repeats until `flag` returns no row (it stops
/// by itself after `max_try` attempts). Then [`Self::finish_turn`] stores the final scores that the
/// next turn compares against.
#[derive(Debug, Clone)]
pub struct TdsTracker {
    settings: TdsSettings,
    previous: Vec<Option<f64>>,
    attempt: usize,
    current: usize,
    regenerations: Vec<usize>,
}

impl TdsTracker {
    /// A tracker for `rows` environments.
    pub fn new(settings: TdsSettings, rows: usize) -> Self {
        Self {
            settings,
            previous: vec![None; rows],
            attempt: 0,
            current: 0,
            regenerations: Vec::new(),
        }
    }

    /// Rows of the current attempt to regenerate. `scores[i] = None` marks a row without a sample
    /// this turn (inactive environment), never flagged.
    pub fn flag(&self, scores: &[Option<f64>]) -> Result<Vec<bool>, ControlError> {
        if scores.len() != self.previous.len() {
            return Err(ControlError::LengthMismatch {
                what: "scores",
                got: scores.len(),
                expected: self.previous.len(),
            });
        }
        Ok(scores
            .iter()
            .zip(&self.previous)
            .map(|(s, p)| match s {
                Some(s) => self
                    .settings
                    .should_regenerate(turn_gap(*p, *s), self.attempt),
                None => false,
            })
            .collect())
    }

    /// Records that the flagged rows were regenerated (one attempt of the current turn).
    pub fn record_attempt(&mut self, flags: &[bool]) {
        self.current += flags.iter().filter(|&&f| f).count();
        self.attempt += 1;
    }

    /// Ends the turn: `final_scores` (after any regeneration; `None` keeps the row's previous
    /// score) become the comparison point of the next turn.
    pub fn finish_turn(&mut self, final_scores: &[Option<f64>]) -> Result<(), ControlError> {
        if final_scores.len() != self.previous.len() {
            return Err(ControlError::LengthMismatch {
                what: "final_scores",
                got: final_scores.len(),
                expected: self.previous.len(),
            });
        }
        for (p, s) in self.previous.iter_mut().zip(final_scores) {
            if s.is_some() {
                *p = *s;
            }
        }
        self.regenerations.push(self.current);
        self.current = 0;
        self.attempt = 0;
        Ok(())
    }

    /// Regenerated rows per finished turn (the "TDS regeneration count per turn" metric).
    pub fn regenerations_per_turn(&self) -> &[usize] {
        &self.regenerations
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{TOL, assert_close};

    fn on() -> TdsSettings {
        TdsSettings {
            enabled: true,
            ..TdsSettings::default()
        }
    }

    #[test]
    fn spec_6_3_vectors() {
        let prev = turn_score(&[0.4, 0.5, 0.6]).unwrap();
        let cur = turn_score(&[0.45, 0.5, 0.55]).unwrap();
        assert_close(prev, 0.493242, TOL, "phi prev");
        assert_close(cur, 0.498328, TOL, "phi cur");
        let g = turn_gap(Some(prev), cur);
        assert_close(g, 0.005085, TOL, "gamma");
        let s = on();
        assert!(s.should_regenerate(g, 0), "Γ < 0.3 → regenerate");
        let alt = turn_score(&[0.1, 0.2, 0.3]).unwrap();
        assert_close(alt, 0.181712, TOL, "phi alt");
        let g2 = turn_gap(Some(prev), alt);
        assert_close(g2, 0.31153, TOL, "gamma alt");
        assert!(!s.should_regenerate(g2, 0), "Γ ≥ 0.3 → keep");
    }

    #[test]
    fn rules_differ_on_exact_repeats_and_budget() {
        let code = on();
        let paper = TdsSettings {
            rule: TdsRule::Paper,
            ..on()
        };
        assert!(!code.should_regenerate(0.0, 0));
        assert!(paper.should_regenerate(0.0, 0));
        assert!(!code.should_regenerate(0.1, 2), "max_try reached");
        assert!(
            !code.should_regenerate(turn_gap(None, 0.5), 0),
            "first turn: Γ = ∞"
        );
        assert_eq!(turn_score(&[]), None);
        assert_close(turn_score(&[0.0, 1.0]).unwrap(), 1e-4, TOL, "floored");
    }

    #[test]
    fn tracker_batch_flow() {
        let mut tr = TdsTracker::new(on(), 3);
        // Turn 1: nothing to compare with.
        assert_eq!(
            tr.flag(&[Some(0.5), Some(0.2), None]).unwrap(),
            vec![false; 3]
        );
        tr.finish_turn(&[Some(0.5), Some(0.2), None]).unwrap();
        // Turn 2: row 0 too close (0.1), row 1 far (0.4), row 2 inactive.
        let f = tr.flag(&[Some(0.6), Some(0.6), None]).unwrap();
        assert_eq!(f, vec![true, false, false]);
        tr.record_attempt(&f);
        let f = tr.flag(&[Some(0.55), Some(0.6), None]).unwrap();
        assert_eq!(f, vec![true, false, false]);
        tr.record_attempt(&f);
        // Budget exhausted: keep the last sample even though it is still close.
        assert_eq!(
            tr.flag(&[Some(0.52), Some(0.6), None]).unwrap(),
            vec![false; 3]
        );
        tr.finish_turn(&[Some(0.52), Some(0.6), None]).unwrap();
        assert_eq!(tr.regenerations_per_turn(), &[0, 2]);
        assert!(tr.flag(&[Some(0.1)]).is_err());
        let s: TdsSettings = serde_json::from_str(r#"{"rule": "paper", "max_try": 3}"#).unwrap();
        assert_eq!((s.rule, s.max_try, s.eta), (TdsRule::Paper, 3, 0.3));
        assert!(!s.should_regenerate(0.1, 0), "disabled by default");
        assert!(serde_json::from_str::<TdsSettings>(r#"{"max_tries": 3}"#).is_err());
    }
}
