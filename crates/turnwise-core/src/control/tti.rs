//! T2PO Token-level Thinking Intervention (TTI), spec §6.2 (t2po.md §4.1–4.2, eq. 3–6, Alg. 1).
//!
//! Per sampled token the engine computes the full-vocabulary entropy `H_t` and the top-j
//! confidence `C_t` ([`token_stats_from_logits`], [`entropy_from_probs`], [`top_j_confidence`]),
//! feeds them to a [`TtiController`], and asks it before each step whether a token is forced.
//!
//! - Signal (eq. 3): `M_t = α·H̃_t + (1 − α)(1 − C̃_t)` with H̃, C̃ min–max normalised by a
//!   **causal running** min/max over the current turn's tokens so far (\[REC\]; `max == min` → 0).
//! - Variation `Δ_t = |M_t − M_{t−1}|`; stop rule (eq. 4/6): the first `t > L_min` whose trailing
//!   window mean `(1/(N+1)) Σ_{i=0..N} Δ_{t−i} < ε`, or `t ≥ L_max`.
//! - One-time activation (`I_stop`), only while inside the reasoning span.
//! - On trigger at `t*`, the forced queue (`</think>` + `\n` for search, \[REC\]) is emitted from
//!   step `t* + 1` without sampling.
//!
//! Token positions `t` are 1-based within the reasoning span of the current turn, as in the paper.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::ControlError;

/// Floor applied to log-probabilities that are `−∞` or below it (a zero probability among the
/// top-j), so `C_t` stays finite. \[REC\]: vLLM reports such entries as very negative numbers.
pub const MIN_LOGPROB: f64 = -100.0;

/// TTI settings (§6.2). Every default except α is \[UNVERIFIED\] (T2PO Table 5 is lost).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TtiSettings {
    /// Turn TTI on.
    pub enabled: bool,
    /// Signal weight α of eq. 3 (paper App. D.3: 0.4).
    pub alpha: f64,
    /// Number j of top log-probs in the confidence `C_t` (\[UNVERIFIED\], REC 20).
    pub top_j: usize,
    /// Trailing window size N: the window holds N + 1 variations (\[UNVERIFIED\], default 2).
    pub window: usize,
    /// Tolerance ε on the window mean of Δ (\[UNVERIFIED\], default 0.05).
    pub epsilon: f64,
    /// Minimum prefix length L_min: checks start at `t > L_min` (\[UNVERIFIED\], default 32).
    pub min_len: usize,
    /// Thinking budget L_max: trigger at `t ≥ L_max` (T2PO WebShop/ALFWorld: 450; search: none).
    pub max_len: Option<usize>,
    /// Forced token queue as text (tokenised by the engine). \[REC\] for search: `</think>` + `\n`
    /// (the paper's `<action>` is for WebShop/ALFWorld).
    pub forced_queue: Vec<String>,
    /// Give forced tokens loss mask 1 (\[REC\] false: they were not sampled from π_θold).
    pub train_on_forced_tokens: bool,
}

impl Default for TtiSettings {
    fn default() -> Self {
        Self {
            enabled: false,
            alpha: 0.4,
            top_j: 20,
            window: 2,
            epsilon: 0.05,
            min_len: 32,
            max_len: None,
            forced_queue: vec!["</think>".to_string(), "\n".to_string()],
            train_on_forced_tokens: false,
        }
    }
}

impl TtiSettings {
    /// Checks ranges: α ∈ [0, 1], j ≥ 1, ε ≥ 0, `L_max ≥ 1`.
    pub fn validate(&self) -> Result<(), ControlError> {
        if !(0.0..=1.0).contains(&self.alpha) {
            return Err(ControlError::InvalidSetting {
                name: "alpha",
                reason: "must lie in [0, 1]",
            });
        }
        if self.top_j == 0 {
            return Err(ControlError::InvalidSetting {
                name: "top_j",
                reason: "must be at least 1",
            });
        }
        if self.epsilon.is_nan() || self.epsilon < 0.0 {
            return Err(ControlError::InvalidSetting {
                name: "epsilon",
                reason: "must be a non-negative number",
            });
        }
        if self.max_len == Some(0) {
            return Err(ControlError::InvalidSetting {
                name: "max_len",
                reason: "must be at least 1 when set",
            });
        }
        Ok(())
    }
}

/// Entropy and confidence of one sampling step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenStats {
    /// Full-vocabulary entropy `H_t = −Σ_v p(v) log p(v)`.
    pub entropy: f64,
    /// Top-j confidence `C_t = −(1/j) Σ_{i≤j} log p^{(i)}` (larger = more peaked).
    pub confidence: f64,
}

/// Entropy `−Σ p log p` of a probability vector (zero entries contribute 0).
pub fn entropy_from_probs(probs: &[f64]) -> f64 {
    probs
        .iter()
        .filter(|&&p| p > 0.0)
        .map(|&p| -p * p.ln())
        .sum()
}

/// Top-j confidence from the sampler's top-j log-probs: `−(1/j) Σ log p^{(i)}` where `j` is the
/// slice length (the sampler returns exactly j). Log-probs below [`MIN_LOGPROB`] are floored.
/// Returns 0 for an empty slice.
pub fn top_j_confidence(top_logprobs: &[f64]) -> f64 {
    if top_logprobs.is_empty() {
        return 0.0;
    }
    let s: f64 = top_logprobs.iter().map(|&l| floor_logprob(l)).sum();
    -s / top_logprobs.len() as f64
}

fn floor_logprob(l: f64) -> f64 {
    if l.is_nan() || l < MIN_LOGPROB {
        MIN_LOGPROB
    } else {
        l
    }
}

/// Inserts `x` into the descending top-`j` buffer `top`.
fn push_top(top: &mut Vec<f64>, j: usize, x: f64) {
    if top.len() == j {
        match top.last() {
            Some(&last) if x > last => {
                top.pop();
            }
            _ => return,
        }
    }
    let pos = top.partition_point(|&y| y >= x);
    top.insert(pos, x);
}

/// Entropy and top-j confidence of a full probability vector; `scratch` is reused to hold the
/// top-j values (no allocation once it has capacity j).
pub fn token_stats_from_probs(probs: &[f64], j: usize, scratch: &mut Vec<f64>) -> TokenStats {
    scratch.clear();
    let mut h = 0.0;
    for &p in probs {
        if p > 0.0 {
            h -= p * p.ln();
        }
        if j > 0 {
            push_top(scratch, j, p);
        }
    }
    let conf = if scratch.is_empty() {
        0.0
    } else {
        -scratch
            .iter()
            .map(|&p| floor_logprob(if p > 0.0 { p.ln() } else { f64::NEG_INFINITY }))
            .sum::<f64>()
            / scratch.len() as f64
    };
    TokenStats {
        entropy: h,
        confidence: conf,
    }
}

/// Entropy and top-j confidence from raw logits (numerically stable log-softmax, two passes);
/// `scratch` holds the top-j logits. Temperature, if any, must already be applied.
pub fn token_stats_from_logits(logits: &[f32], j: usize, scratch: &mut Vec<f64>) -> TokenStats {
    scratch.clear();
    let max = logits
        .iter()
        .fold(f64::NEG_INFINITY, |m, &z| m.max(z as f64));
    if !max.is_finite() {
        return TokenStats {
            entropy: 0.0,
            confidence: 0.0,
        };
    }
    // Σ e^{z−max} and Σ (z−max) e^{z−max}.
    let (mut s, mut sz) = (0.0f64, 0.0f64);
    for &z in logits {
        let d = z as f64 - max;
        let e = d.exp();
        s += e;
        sz += d * e;
        if j > 0 {
            push_top(scratch, j, z as f64);
        }
    }
    let log_z = s.ln();
    // H = −Σ p (d − log Z) = log Z − Σ p d.
    let entropy = log_z - sz / s;
    let conf = -scratch
        .iter()
        .map(|&z| floor_logprob(z - max - log_z))
        .sum::<f64>()
        / scratch.len().max(1) as f64;
    TokenStats {
        entropy,
        confidence: conf,
    }
}

/// Causal running min–max normaliser: `(x − min)/(max − min)` over the values seen so far
/// (including `x`), 0 when `max == min`. Always in `[0, 1]` for finite inputs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RunningMinMax {
    min: f64,
    max: f64,
}

impl Default for RunningMinMax {
    fn default() -> Self {
        Self {
            min: f64::INFINITY,
            max: f64::NEG_INFINITY,
        }
    }
}

impl RunningMinMax {
    /// Adds `x` and returns its normalised value.
    pub fn push(&mut self, x: f64) -> f64 {
        self.min = self.min.min(x);
        self.max = self.max.max(x);
        let span = self.max - self.min;
        if span > 0.0 {
            ((x - self.min) / span).clamp(0.0, 1.0)
        } else {
            0.0
        }
    }
}

/// The online self-calibrated signal `M_t` of eq. 3.
#[derive(Debug, Clone, PartialEq)]
pub struct OnlineSignal {
    alpha: f64,
    h: RunningMinMax,
    c: RunningMinMax,
}

impl OnlineSignal {
    /// A fresh signal for one turn with weight α.
    pub fn new(alpha: f64) -> Self {
        Self {
            alpha,
            h: RunningMinMax::default(),
            c: RunningMinMax::default(),
        }
    }

    /// Adds token `t`'s entropy and confidence, returns `M_t = α H̃_t + (1 − α)(1 − C̃_t)`.
    pub fn push(&mut self, entropy: f64, confidence: f64) -> f64 {
        let h = self.h.push(entropy);
        let c = self.c.push(confidence);
        self.alpha * h + (1.0 - self.alpha) * (1.0 - c)
    }
}

/// The controller's report for one observed token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TtiStep {
    /// 1-based token position in the reasoning span.
    pub t: usize,
    /// Signal `M_t`.
    pub m: f64,
    /// `Δ_t = |M_t − M_{t−1}|` (`None` at t = 1).
    pub delta: Option<f64>,
    /// Trailing window mean of Δ, once N + 1 variations exist.
    pub window_mean: Option<f64>,
    /// The stop rule fired at this token (`t* = t`); forced tokens follow.
    pub triggered: bool,
}

/// Online TTI stop rule and forced-token queue for one generation (one turn).
///
/// Usage per step: call [`Self::next_forced`] first; if it yields a token, emit it without
/// sampling (and do not call `observe`). Otherwise sample, then call [`Self::observe`] with the
/// token's entropy and confidence while in the reasoning span, or [`Self::end_reasoning`] when the
/// model closed the span itself.
#[derive(Debug, Clone)]
pub struct TtiController {
    settings: TtiSettings,
    forced_ids: Vec<u32>,
    signal: OnlineSignal,
    last_m: Option<f64>,
    deltas: VecDeque<f64>,
    t: usize,
    fired: bool,
    active: bool,
    queue: VecDeque<u32>,
    forced_count: usize,
    triggered_at: Option<usize>,
}

impl TtiController {
    /// A controller; `forced_ids` is the tokenised `settings.forced_queue`.
    pub fn new(settings: TtiSettings, forced_ids: Vec<u32>) -> Result<Self, ControlError> {
        settings.validate()?;
        let signal = OnlineSignal::new(settings.alpha);
        let cap = settings.window + 1;
        let active = settings.enabled;
        Ok(Self {
            settings,
            forced_ids,
            signal,
            last_m: None,
            deltas: VecDeque::with_capacity(cap),
            t: 0,
            fired: false,
            active,
            queue: VecDeque::new(),
            forced_count: 0,
            triggered_at: None,
        })
    }

    /// Resets for the next turn (new running min/max, `I_stop = 0`).
    pub fn reset(&mut self) {
        self.signal = OnlineSignal::new(self.settings.alpha);
        self.last_m = None;
        self.deltas.clear();
        self.t = 0;
        self.fired = false;
        self.active = self.settings.enabled;
        self.queue.clear();
        self.forced_count = 0;
        self.triggered_at = None;
    }

    /// The settings.
    pub fn settings(&self) -> &TtiSettings {
        &self.settings
    }

    /// The model emitted the end of the reasoning span itself: stop monitoring.
    pub fn end_reasoning(&mut self) {
        self.active = false;
    }

    /// Whether the rule already fired in this generation (`I_stop`).
    pub fn fired(&self) -> bool {
        self.fired
    }

    /// The trigger position `t*`, if it fired.
    pub fn triggered_at(&self) -> Option<usize> {
        self.triggered_at
    }

    /// Tokens forced so far (for the "tokens forced" metric).
    pub fn forced_count(&self) -> usize {
        self.forced_count
    }

    /// The next forced token, if the queue is non-empty (call before sampling each step).
    pub fn next_forced(&mut self) -> Option<u32> {
        let tok = self.queue.pop_front();
        if tok.is_some() {
            self.forced_count += 1;
        }
        tok
    }

    /// Observes the sampled token at the next position of the reasoning span.
    ///
    /// Outside the reasoning span, after firing, or when disabled, it still reports `M_t` but
    /// never triggers.
    pub fn observe(&mut self, entropy: f64, confidence: f64) -> TtiStep {
        self.t += 1;
        let t = self.t;
        let m = self.signal.push(entropy, confidence);
        let delta = self.last_m.map(|prev| (m - prev).abs());
        self.last_m = Some(m);
        let cap = self.settings.window + 1;
        if let Some(d) = delta {
            if self.deltas.len() == cap {
                self.deltas.pop_front();
            }
            self.deltas.push_back(d);
        }
        let window_mean =
            (self.deltas.len() == cap).then(|| self.deltas.iter().sum::<f64>() / cap as f64);
        let mut triggered = false;
        if self.active && !self.fired {
            let budget = self.settings.max_len.is_some_and(|l| t >= l);
            // [REC] the window must be full (N + 1 variations) before the ε test applies.
            let calm =
                t > self.settings.min_len && window_mean.is_some_and(|w| w < self.settings.epsilon);
            if budget || calm {
                triggered = true;
                self.fired = true;
                self.active = false;
                self.triggered_at = Some(t);
                self.queue.extend(self.forced_ids.iter().copied());
            }
        }
        TtiStep {
            t,
            m,
            delta,
            window_mean,
            triggered,
        }
    }
}

/// Runs the stop rule offline over per-token `(H, C)` series; returns the trigger position `t*`
/// (1-based) if it fires within the series. Useful for analysis and tests.
pub fn tti_trigger_step(
    settings: &TtiSettings,
    entropy: &[f64],
    confidence: &[f64],
) -> Result<Option<usize>, ControlError> {
    if entropy.len() != confidence.len() {
        return Err(ControlError::LengthMismatch {
            what: "confidence",
            got: confidence.len(),
            expected: entropy.len(),
        });
    }
    let mut s = settings.clone();
    s.enabled = true;
    let mut c = TtiController::new(s, Vec::new())?;
    for (&h, &cf) in entropy.iter().zip(confidence) {
        if c.observe(h, cf).triggered {
            return Ok(c.triggered_at());
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{TOL, assert_all_close, assert_close};
    use proptest::prelude::*;

    const H: [f64; 8] = [1.2, 2.0, 1.6, 1.7, 1.65, 1.66, 1.66, 1.67];
    const C: [f64; 8] = [5.0, 3.0, 4.0, 3.8, 3.9, 3.88, 3.87, 3.87];

    fn example_settings() -> TtiSettings {
        TtiSettings {
            enabled: true,
            alpha: 0.4,
            window: 2,
            epsilon: 0.05,
            min_len: 3,
            max_len: None,
            ..TtiSettings::default()
        }
    }

    #[test]
    fn spec_6_2_worked_example() {
        let mut c = TtiController::new(example_settings(), vec![151668, 198]).unwrap();
        let mut m = Vec::new();
        let mut d = Vec::new();
        let mut w = Vec::new();
        let mut fired_at = None;
        for t in 0..8 {
            if fired_at.is_some() {
                // Token 8 is forced: the queue yields </think> then \n.
                assert_eq!(c.next_forced(), Some(151668));
                break;
            }
            assert_eq!(c.next_forced(), None);
            let s = c.observe(H[t], C[t]);
            m.push(s.m);
            if let Some(x) = s.delta {
                d.push(x);
            }
            if s.t >= 4 {
                w.push(s.window_mean.unwrap());
            }
            if s.triggered {
                fired_at = Some(s.t);
            }
        }
        assert_eq!(fired_at, Some(7));
        assert_all_close(&m, &[0.6, 1.0, 0.5, 0.61, 0.555, 0.566, 0.569], TOL, "M");
        assert_all_close(&d, &[0.4, 0.5, 0.11, 0.055, 0.011, 0.003], TOL, "delta");
        assert_all_close(
            &w,
            &[0.336667, 0.221667, 0.058667, 0.023],
            TOL,
            "window means",
        );
        assert_eq!(c.next_forced(), Some(198));
        assert_eq!(c.next_forced(), None);
        assert_eq!(c.forced_count(), 2);
    }

    #[test]
    fn spec_6_2_full_signal_and_last_window() {
        // Without the trigger, the 8th token's M and window mean follow the spec too.
        let mut s = example_settings();
        s.enabled = false;
        let mut c = TtiController::new(s, vec![]).unwrap();
        let steps: Vec<TtiStep> = H.iter().zip(C).map(|(&h, cf)| c.observe(h, cf)).collect();
        assert_close(steps[7].m, 0.574, TOL, "M_8");
        assert_close(steps[7].delta.unwrap(), 0.005, TOL, "delta_8");
        assert_close(
            steps[7].window_mean.unwrap(),
            0.006333,
            TOL,
            "window mean t=8",
        );
        assert!(steps.iter().all(|s| !s.triggered));
        assert_eq!(
            tti_trigger_step(&example_settings(), &H, &C).unwrap(),
            Some(7)
        );
    }

    #[test]
    fn spec_6_2_confidence_and_entropy() {
        let lp = |p: &[f64]| p.iter().map(|x| x.ln()).collect::<Vec<_>>();
        assert_close(
            top_j_confidence(&lp(&[0.7, 0.2, 0.05])),
            1.653948,
            TOL,
            "C1",
        );
        assert_close(
            top_j_confidence(&lp(&[0.97, 0.01, 0.005])),
            3.311316,
            TOL,
            "C2",
        );
        assert_close(
            entropy_from_probs(&[0.7, 0.2, 0.05, 0.05]),
            0.871133,
            TOL,
            "H",
        );
        let mut scratch = Vec::new();
        let s = token_stats_from_probs(&[0.05, 0.7, 0.05, 0.2], 3, &mut scratch);
        assert_close(s.entropy, 0.871133, TOL, "H from probs");
        // Top-3 of [0.7, 0.2, 0.05, 0.05] = [0.7, 0.2, 0.05].
        assert_close(s.confidence, 1.653948, TOL, "C from probs");
        let logits: Vec<f32> = [0.7f64, 0.2, 0.05, 0.05]
            .iter()
            .map(|p| p.ln() as f32 + 3.0)
            .collect();
        let s = token_stats_from_logits(&logits, 3, &mut scratch);
        assert_close(s.entropy, 0.871133, 1e-5, "H from logits");
        assert_close(s.confidence, 1.653948, 1e-5, "C from logits");
    }

    #[test]
    fn offline_min_max_would_differ() {
        // Whole-turn min–max gives M_1 = 0 (H_1 is the min, C_1 the max): the causal rule gives 0.6.
        let mut sig = OnlineSignal::new(0.4);
        assert_close(sig.push(H[0], C[0]), 0.6, TOL, "online M_1");
    }

    #[test]
    fn budget_fires_at_l_max_and_only_once() {
        let s = TtiSettings {
            enabled: true,
            min_len: 100,
            max_len: Some(5),
            ..TtiSettings::default()
        };
        let mut c = TtiController::new(s, vec![1]).unwrap();
        let fired: Vec<bool> = (0..8).map(|i| c.observe(i as f64, 1.0).triggered).collect();
        assert_eq!(
            fired,
            vec![false, false, false, false, true, false, false, false]
        );
        c.reset();
        c.end_reasoning();
        assert!((0..8).all(|_| !c.observe(1.0, 1.0).triggered));
    }

    #[test]
    fn settings_serde() {
        let s: TtiSettings = serde_json::from_str(r#"{"enabled": true, "max_len": 450}"#).unwrap();
        assert_eq!(s.max_len, Some(450));
        assert_eq!(s.alpha, 0.4);
        assert_eq!(
            s.forced_queue,
            vec!["</think>".to_string(), "\n".to_string()]
        );
        assert!(serde_json::from_str::<TtiSettings>(r#"{"alpah": 0.4}"#).is_err());
        assert!(
            TtiSettings {
                alpha: 1.5,
                ..TtiSettings::default()
            }
            .validate()
            .is_err()
        );
    }

    proptest! {
        #[test]
        fn running_minmax_in_unit_interval(xs in prop::collection::vec(-1e6f64..1e6, 1..64)) {
            let mut r = RunningMinMax::default();
            for x in xs {
                let v = r.push(x);
                prop_assert!((0.0..=1.0).contains(&v));
            }
        }

        #[test]
        fn tti_respects_l_min_and_l_max(
            hc in prop::collection::vec((0.0f64..5.0, 0.0f64..10.0), 1..80),
            min_len in 0usize..30, extra in 1usize..30, window in 0usize..5, eps in 0.0f64..0.5,
        ) {
            let max_len = min_len + extra;
            let s = TtiSettings { enabled: true, min_len, max_len: Some(max_len), window, epsilon: eps, ..TtiSettings::default() };
            let h: Vec<f64> = hc.iter().map(|p| p.0).collect();
            let c: Vec<f64> = hc.iter().map(|p| p.1).collect();
            match tti_trigger_step(&s, &h, &c).unwrap() {
                Some(t) => prop_assert!(t > min_len && t <= max_len, "fired at {t}"),
                None => prop_assert!(h.len() < max_len, "did not fire by L_max"),
            }
        }
    }
}
