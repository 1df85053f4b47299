//! T2PO Turn-level Dynamical Sampling (TDS), spec §6.3 (t2po.md §4.3, Alg. 2; T2PO code
//! `T2PO_multi_turn_loop`).
//!
//! - Turn score `Φ^k = (Π_t M_t^k)^{1/T_k}`, computed in log space with a floor
//!   (\[REC\]: `Φ = exp(mean(log(max(M_t, 1e-8))))`), see [`turn_score`].
//! - \[turnwise\] The `M_t` that Φ averages normalise `H_t` and `C_t` by a causal running
//!   min/max carried **across the episode's turns** (the paper's "across the decoding
//!   trajectory", eq. 2): each attempt of turn k starts from the min/max of the kept turns
//!   1..k−1, and the kept attempt's min/max carries on to turn k+1 ([`TdsTracker::score`],
//!   [`TdsTracker::finish_turn`]). A min/max reset for every turn (TTI's, §6.2) makes Φ invariant
//!   to an affine change of a turn's entropy or confidence, so Γ could not see a change of
//!   uncertainty level between turns, which is what it is meant to compare (spec §6.3).
//! - Gap `Γ^k = |Φ^k − Φ^{k−1}|`, `Γ^1 = +∞` (no previous turn), see [`turn_gap`].
//! - Paper rule: regenerate turn k while `Γ^k < η`, at most `B_max` times; when the budget runs
//!   out the last draw is kept (Alg. 2: the `repeat … until Γ ≥ η or b ≥ B_max` loop ends on the
//!   last generation, which is the one executed).
//! - Code rule: regenerate rows with `0 < Γ < η` (η = 0.3), up to `max_try = 2` extra attempts,
//!   batch-wise (all flagged rows at once), comparing with the previous turn's **final** score and
//!   keeping the last regenerated sample even if it is still below η.

use serde::{Deserialize, Serialize};

use super::ControlError;
use super::tti::OnlineSignal;

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

/// The score of one attempt of a turn: `Φ` over the attempt's sampled tokens, and the
/// episode's normaliser state after them (what the next turn starts from if this attempt is
/// kept). Built by [`TdsTracker::score`].
#[derive(Debug, Clone, PartialEq)]
pub struct AttemptScore {
    /// `Φ` of the attempt.
    pub phi: f64,
    state: OnlineSignal,
}

/// Batch-wise TDS bookkeeping across the turns of a batch of environments (one row per
/// episode).
///
/// Per turn: the engine samples all rows, scores each row's attempt with [`Self::score`] (from
/// the attempt's per-token entropies and confidences, normalised by the row's episode-causal
/// min/max at the turn's start), calls [`Self::flag`] with the scores, regenerates the flagged
/// rows, calls [`Self::record_attempt`], and repeats until `flag` returns no row (it stops by
/// itself after `max_try` attempts). Then [`Self::finish_turn`] stores the kept attempts' scores,
/// which the next turn compares against, and their normaliser states, which it starts from.
#[derive(Debug, Clone)]
pub struct TdsTracker {
    settings: TdsSettings,
    previous: Vec<Option<f64>>,
    /// Per row: the episode-causal running min/max of H and C over the kept turns so far.
    signals: Vec<OnlineSignal>,
    attempt: usize,
    current: usize,
    regenerations: Vec<usize>,
}

impl TdsTracker {
    /// A tracker for `rows` environments; `alpha` is the weight α of `M_t` (eq. 3, the TTI
    /// setting `rollout.tti.alpha`).
    pub fn new(settings: TdsSettings, alpha: f64, rows: usize) -> Self {
        Self {
            settings,
            previous: vec![None; rows],
            signals: vec![OnlineSignal::new(alpha); rows],
            attempt: 0,
            current: 0,
            regenerations: Vec::new(),
        }
    }

    /// Scores an attempt of the current turn of row `row` from its sampled tokens' entropies
    /// `H_t` and top-j confidences `C_t` (forced tokens left out): `M_t` normalised by the row's
    /// episode-causal min/max at the turn's start, then `Φ` ([`turn_score`]). `None` for an
    /// attempt without sampled tokens. Every attempt of a turn starts from the same state.
    pub fn score(
        &self,
        row: usize,
        tokens: impl IntoIterator<Item = (f64, f64)>,
    ) -> Result<Option<AttemptScore>, ControlError> {
        let Some(start) = self.signals.get(row) else {
            return Err(ControlError::UnknownRow {
                row,
                rows: self.signals.len(),
            });
        };
        let mut state = start.clone();
        let m: Vec<f64> = tokens.into_iter().map(|(h, c)| state.push(h, c)).collect();
        Ok(turn_score(&m).map(|phi| AttemptScore { phi, state }))
    }

    /// `Γ` of a score `phi` of row `row`'s current turn against its previous turn's kept score
    /// (`+∞` on the first turn or for an unknown row).
    pub fn gap(&self, row: usize, phi: f64) -> f64 {
        turn_gap(self.previous.get(row).copied().flatten(), phi)
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

    /// Ends the turn: the kept attempts' scores (after any regeneration; `None` keeps the row's
    /// previous score and normaliser) become the comparison point of the next turn, and their
    /// normaliser states its starting point.
    pub fn finish_turn(&mut self, kept: &[Option<AttemptScore>]) -> Result<(), ControlError> {
        if kept.len() != self.previous.len() {
            return Err(ControlError::LengthMismatch {
                what: "kept",
                got: kept.len(),
                expected: self.previous.len(),
            });
        }
        for ((p, sig), k) in self.previous.iter_mut().zip(&mut self.signals).zip(kept) {
            if let Some(k) = k {
                *p = Some(k.phi);
                *sig = k.state.clone();
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

    /// A kept attempt with score `phi` (and a fresh normaliser).
    fn kept(phi: f64) -> Option<AttemptScore> {
        Some(AttemptScore {
            phi,
            state: OnlineSignal::new(0.4),
        })
    }

    #[test]
    fn tracker_batch_flow() {
        let mut tr = TdsTracker::new(on(), 0.4, 3);
        // Turn 1: nothing to compare with.
        assert_eq!(
            tr.flag(&[Some(0.5), Some(0.2), None]).unwrap(),
            vec![false; 3]
        );
        tr.finish_turn(&[kept(0.5), kept(0.2), None]).unwrap();
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
        tr.finish_turn(&[kept(0.52), kept(0.6), None]).unwrap();
        assert_eq!(tr.regenerations_per_turn(), &[0, 2]);
        assert_close(tr.gap(0, 0.62), 0.1, TOL, "gap to the kept score");
        assert_eq!(tr.gap(2, 0.5), f64::INFINITY, "row 2 never had a turn");
        assert!(tr.flag(&[Some(0.1)]).is_err());
        assert!(tr.finish_turn(&[None]).is_err());
        assert!(matches!(
            tr.score(3, [(1.0, 1.0)]),
            Err(ControlError::UnknownRow { row: 3, rows: 3 })
        ));
        assert_eq!(tr.score(0, []).unwrap(), None, "no sampled token");
        let s: TdsSettings = serde_json::from_str(r#"{"rule": "paper", "max_try": 3}"#).unwrap();
        assert_eq!((s.rule, s.max_try, s.eta), (TdsRule::Paper, 3, 0.3));
        assert!(!s.should_regenerate(0.1, 0), "disabled by default");
        assert!(serde_json::from_str::<TdsSettings>(r#"{"max_tries": 3}"#).is_err());
    }

    /// `(H_t, C_t)` of a turn whose entropy is `scale` times a fixed shape and whose confidence
    /// falls as the entropy grows (an affine image of the same trace).
    fn trace(scale: f64) -> Vec<(f64, f64)> {
        [0.3, 0.9, 0.5, 0.7, 0.4, 0.8, 0.6]
            .iter()
            .map(|&u| (scale * u, 6.0 - scale * u))
            .collect()
    }

    /// Φ sees a change of uncertainty level between turns. After two turns at one level (the
    /// normaliser has seen that level's range), a third turn whose trace is the same shape scaled
    /// 4× (more entropy, less confidence) gives a large Γ, and the same trace at the old level a
    /// far smaller one. Per-turn min/max normalisation (a fresh normaliser for every turn, TTI's)
    /// is blind to the change: both give the same Φ, Γ = 0, and the turn would be regenerated.
    #[test]
    fn phi_sees_a_change_of_level_between_turns() {
        let mut tr = TdsTracker::new(on(), 0.4, 1);
        for _ in 0..2 {
            let a = tr.score(0, trace(0.5)).unwrap();
            tr.finish_turn(&[a]).unwrap();
        }
        let higher = tr.score(0, trace(2.0)).unwrap().unwrap();
        let same = tr.score(0, trace(0.5)).unwrap().unwrap();
        let (g_higher, g_same) = (tr.gap(0, higher.phi), tr.gap(0, same.phi));
        assert!(g_higher > 0.15, "Γ = {g_higher} after a change of level");
        assert!(g_same < g_higher / 3.0, "Γ = {g_same} at the same level");
        let at = |eta: f64| TdsTracker {
            settings: TdsSettings {
                eta,
                rule: TdsRule::Paper,
                ..on()
            },
            ..tr.clone()
        };
        let eta = (g_same + g_higher) / 2.0;
        assert_eq!(
            at(eta).flag(&[Some(higher.phi)]).unwrap(),
            vec![false],
            "kept"
        );
        assert_eq!(
            at(eta).flag(&[Some(same.phi)]).unwrap(),
            vec![true],
            "regenerated"
        );
        // Per-turn normalisation: both levels normalise to the same M_t, Γ = 0.
        let per_turn = |scale: f64| {
            let mut sig = OnlineSignal::new(0.4);
            let m: Vec<f64> = trace(scale).iter().map(|&(h, c)| sig.push(h, c)).collect();
            turn_score(&m).unwrap()
        };
        assert!((per_turn(0.5) - per_turn(2.0)).abs() < 1e-12);
        // Every attempt of a turn starts from the state at the turn's start: scoring is pure.
        assert_eq!(tr.score(0, trace(2.0)).unwrap().unwrap(), higher);
    }

    /// The selection rule over synthetic episodes whose per-attempt uncertainty level varies:
    /// at η = 0.3 (the t2po preset's), some eligible turns are accepted on their first draw,
    /// some after a regeneration before the budget, and the kept attempts' Γ is well above the
    /// first attempts' Γ (TDS selects).
    #[test]
    fn the_rule_keeps_attempts_with_larger_gaps() {
        let settings = TdsSettings {
            enabled: true,
            eta: 0.3,
            max_try: 2,
            rule: TdsRule::Paper,
        };
        let mut rng = crate::control::SplitMix64::new(7);
        let (episodes, turns) = (200, 4);
        let mut tr = TdsTracker::new(settings.clone(), 0.4, episodes);
        let (mut first_gaps, mut kept_gaps) = (Vec::new(), Vec::new());
        let (mut accepted_first, mut accepted_later, mut exhausted) = (0, 0, 0);
        let draw = |rng: &mut crate::control::SplitMix64| {
            let scale = 0.3 + 2.7 * rng.next_f64();
            let tokens: Vec<(f64, f64)> = (0..12)
                .map(|_| {
                    let u = rng.next_f64();
                    (scale * (0.5 + u), 6.0 - scale * (0.5 + 0.5 * u))
                })
                .collect();
            tokens
        };
        for k in 0..turns {
            let mut attempts: Vec<AttemptScore> = (0..episodes)
                .map(|i| tr.score(i, draw(&mut rng)).unwrap().unwrap())
                .collect();
            let first: Vec<f64> = (0..episodes).map(|i| tr.gap(i, attempts[i].phi)).collect();
            let mut regens = vec![0usize; episodes];
            loop {
                let scores: Vec<Option<f64>> = attempts.iter().map(|a| Some(a.phi)).collect();
                let flags = tr.flag(&scores).unwrap();
                if !flags.iter().any(|&f| f) {
                    break;
                }
                for i in (0..episodes).filter(|&i| flags[i]) {
                    attempts[i] = tr.score(i, draw(&mut rng)).unwrap().unwrap();
                    regens[i] += 1;
                }
                tr.record_attempt(&flags);
            }
            if k > 0 {
                for i in 0..episodes {
                    let g = tr.gap(i, attempts[i].phi);
                    first_gaps.push(first[i]);
                    kept_gaps.push(g);
                    match regens[i] {
                        0 => accepted_first += 1,
                        r if r < settings.max_try => {
                            assert!(g >= settings.eta);
                            accepted_later += 1;
                        }
                        _ => exhausted += 1,
                    }
                }
            }
            let kept: Vec<Option<AttemptScore>> = attempts.into_iter().map(Some).collect();
            tr.finish_turn(&kept).unwrap();
        }
        let n = first_gaps.len();
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let (first_mean, kept_mean) = (mean(&first_gaps), mean(&kept_gaps));
        assert!(
            accepted_first > n / 10 && accepted_first < n,
            "accepted on the first draw: {accepted_first} of {n}"
        );
        assert!(accepted_later > 0, "none accepted after a regeneration");
        assert!(exhausted < n / 2, "{exhausted} of {n} exhausted the budget");
        assert!(
            kept_mean > first_mean + 0.05,
            "kept Γ {kept_mean} vs first-draw Γ {first_mean}"
        );
    }
}
