//! Policy-gradient losses and their registry (spec §5.1–§5.6).
//!
//! All losses share one shape (verl `compute_policy_loss_*`): a ratio `r` (token, sequence or
//! turn level), clip bounds `[lo, hi]`, and
//!
//! ```text
//! l1 = −A·r ;  l2 = −A·clip(r, lo, hi) ;  l_clip = max(l1, l2)                  (§5.1)
//! dual clip (token losses only): loss_t = min(l_clip, −A·c) if A < 0 else l_clip
//! loss = scale · Σ_{i,t} W_i·m_{i,t}·loss_t                                      (§5.7, §5.6)
//! ```
//!
//! | name | ratio `r` | bounds (defaults) | dual clip | aggregation (default) | clip-bias §5.6 |
//! |---|---|---|---|---|---|
//! | `vanilla` | token `w = exp(clamp(logr, ±20))` | 1 − 0.2, 1 + 0.2 | c = 3 | token-mean | option |
//! | `dapo` (`decoupled_clip`) | token | 1 − 0.2, 1 + 0.28 (§5.2) | c = 3 | token-mean | option |
//! | `gspo` | sequence, stop-gradient form (§5.3) | 1 − 3e-4, 1 + 4e-4 | no | seq-mean-token-mean (forced) | option |
//! | `turn` | turn, plain form (ST-PPO eq. 3, §5.4) | 1 − 0.2, 1 + 0.2 | no | seq-mean-token-mean | option |
//! | `gspo_turn` | turn, stop-gradient form (ATPO eq. 4–5) | 1 − 3e-3, 1 + 4e-3 | no | seq-mean-token-mean (forced) | option |
//! | `a2tgpo` | turn, stop-gradient form | 1 − c·3e-3, 1 + c·4e-3 (§5.5) | no | seq-mean-token-mean | option |
//! | `s_ppo` | token | 1 ∓ 0.2 | c = 3 | token-mean | on (token ratio) |
//! | `st_ppo` | turn, plain form | 1 ∓ 0.2 | no | seq-mean-token-mean | on (turn ratio) |
//! | `s_grpo` | token | 1 ∓ 0.2 | c = 3 | token-mean | on (token ratio) |
//!
//! Every default can be overridden in [`PolicyLossConfig`] (except the forced aggregations).
//! Segment (sequence/turn) ratios are geometric means of token ratios over the segment's loss
//! tokens, clamped at ≤ 10 in log space:
//!
//! ```text
//! log s_k = (1/|y_k|) Σ_{t∈k} logr_t
//! plain form:          log s_{k,t} = log s_k                              (gradient spread over the turn)
//! stop-gradient form:  log s_{k,t} = logp_t − sg[logp_t] + sg[log s_k]   (value s_k, ∂/∂logp_t = s_k)
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Device, Tensor, Var};
use serde::{Deserialize, Serialize};
use turnwise_core::advantage::Channel;
use turnwise_core::metric_keys as mk;

use super::agg::{AggDenominators, AggOptions, LossAggMode, agg_row_weights, weighted_sum};
use super::clip_bias::{
    ClipBiasConfig, ClipBiasRatio, ClipBiasResult, ClipBiasRule, ClipBiasScope, ClipBiasSpace,
    clip_bias, clip_bias_grad_norm,
};
use super::turns::{TurnRule, TurnSegments, turn_kl_entropy};
use super::{LossError, Result, check_finite_values, finite_rows, finite_scalar, masked_mean_rows};

/// Which turn/sequence ratio form a segment-level loss uses (§5.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RatioForm {
    /// `s_k` used directly: every token of the turn gets `s_k · mean_turn(A)/|y_k|`-style gradient
    /// (ST-PPO eq. 3, Lemma 4.1).
    Plain,
    /// `logp − sg[logp] + sg[log s_k]`: token t gets `s_k · A_t` (GSPO / ATPO code).
    StopGradient,
}

/// The level at which a loss takes its importance ratio.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RatioLevel {
    Token,
    Sequence,
    Turn,
}

/// The registered policy losses (§5, §10); each one's properties are its row of [`LOSSES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicyLossKind {
    /// Token PPO clip + dual clip (§5.1).
    Vanilla,
    /// DAPO decoupled clip, ε_high = 0.28 (§5.2).
    Dapo,
    /// GSPO sequence ratio, stop-gradient token form (§5.3).
    Gspo,
    /// Plain turn ratio (ST-PPO eq. 3, Turn-PPO) (§5.4).
    Turn,
    /// Stop-gradient turn ratio (ATPO `gspo_turn`) (§5.4).
    GspoTurn,
    /// Turn ratio with A2TGPO's adaptive per-turn bounds (§5.5).
    A2tgpo,
    /// Token PPO with clipping-bias correction (§5.6).
    SPpo,
    /// Plain turn-ratio PPO with turn-ratio clipping-bias correction (§5.6).
    StPpo,
    /// GRPO token loss with clipping-bias correction (§5.6).
    SGrpo,
}

/// One registered policy loss: its name and every property the shared body ([`run`]), the
/// config and the trainer read. A new loss is a variant and a row.
#[derive(Debug, Clone, Copy)]
pub struct LossSpec {
    /// The loss.
    pub kind: PolicyLossKind,
    /// Its registry name.
    pub name: &'static str,
    /// The level its importance ratio is taken at.
    level: RatioLevel,
    /// Default `(ε_low, ε_high)` (§5.1–§5.5, §8).
    pub default_clip: (f64, f64),
    /// Aggregation hard-coded by the reference code (GSPO, ATPO `gspo_turn`).
    pub forced_agg: Option<LossAggMode>,
    /// Default ratio form of segment losses (\[REC\] §5.4: plain for ST-PPO, sg for ATPO/A2TGPO).
    pub ratio_form: RatioForm,
    /// Whether the clipping-bias correction is part of the method (§5.6).
    pub implies_clip_bias: bool,
    /// The channels of per-method data it reads (from the estimator's output; the config
    /// refuses an estimator that does not emit them). A loss that reads
    /// [`Channel::ClipScale`] scales its clip bounds by it per token (§5.5).
    pub reads: &'static [Channel],
    /// Whether its defining mechanism is a clip on the ratio (token, sequence or turn) or the
    /// clipping-bias correction: it is then inert in an on-policy update, where every ratio is
    /// exactly 1 (the config refuses that combination).
    pub defined_by_clip: bool,
}

/// The row of a token-ratio PPO loss with the symmetric clip 0.2; the rows below change what
/// differs.
const TOKEN_PPO: LossSpec = LossSpec {
    kind: PolicyLossKind::Vanilla,
    name: "vanilla",
    level: RatioLevel::Token,
    default_clip: (0.2, 0.2),
    forced_agg: None,
    ratio_form: RatioForm::StopGradient,
    implies_clip_bias: false,
    reads: &[],
    defined_by_clip: true,
};

/// The loss registry, in [`PolicyLossKind`] order.
pub const LOSSES: [LossSpec; 9] = [
    LossSpec {
        defined_by_clip: false,
        ..TOKEN_PPO
    },
    LossSpec {
        kind: PolicyLossKind::Dapo,
        name: "dapo",
        default_clip: (0.2, 0.28),
        ..TOKEN_PPO
    },
    LossSpec {
        kind: PolicyLossKind::Gspo,
        name: "gspo",
        level: RatioLevel::Sequence,
        default_clip: (3e-4, 4e-4),
        forced_agg: Some(LossAggMode::SeqMeanTokenMean),
        ..TOKEN_PPO
    },
    LossSpec {
        kind: PolicyLossKind::Turn,
        name: "turn",
        level: RatioLevel::Turn,
        ratio_form: RatioForm::Plain,
        defined_by_clip: false,
        ..TOKEN_PPO
    },
    // [DIFF] §5.5: A2TGPO App. B.4 vs B.5; [REC] 3e-3 / 4e-3 as in the AT2PO code.
    LossSpec {
        kind: PolicyLossKind::GspoTurn,
        name: "gspo_turn",
        level: RatioLevel::Turn,
        default_clip: (3e-3, 4e-3),
        forced_agg: Some(LossAggMode::SeqMeanTokenMean),
        ..TOKEN_PPO
    },
    LossSpec {
        kind: PolicyLossKind::A2tgpo,
        name: "a2tgpo",
        level: RatioLevel::Turn,
        default_clip: (3e-3, 4e-3),
        reads: &[Channel::ClipScale],
        ..TOKEN_PPO
    },
    LossSpec {
        kind: PolicyLossKind::SPpo,
        name: "s_ppo",
        implies_clip_bias: true,
        ..TOKEN_PPO
    },
    LossSpec {
        kind: PolicyLossKind::StPpo,
        name: "st_ppo",
        level: RatioLevel::Turn,
        ratio_form: RatioForm::Plain,
        implies_clip_bias: true,
        ..TOKEN_PPO
    },
    LossSpec {
        kind: PolicyLossKind::SGrpo,
        name: "s_grpo",
        implies_clip_bias: true,
        ..TOKEN_PPO
    },
];

/// Every name the registry answers to (`decoupled_clip` is an alias of `dapo`).
pub const POLICY_LOSS_NAMES: &[&str] = &[
    "vanilla",
    "dapo",
    "decoupled_clip",
    "gspo",
    "turn",
    "gspo_turn",
    "a2tgpo",
    "s_ppo",
    "st_ppo",
    "s_grpo",
];

impl PolicyLossKind {
    /// All kinds.
    pub const ALL: [Self; 9] = [
        Self::Vanilla,
        Self::Dapo,
        Self::Gspo,
        Self::Turn,
        Self::GspoTurn,
        Self::A2tgpo,
        Self::SPpo,
        Self::StPpo,
        Self::SGrpo,
    ];

    /// Its row of [`LOSSES`].
    pub fn spec(self) -> &'static LossSpec {
        &LOSSES[self as usize]
    }

    /// The registry name.
    pub fn name(self) -> &'static str {
        self.spec().name
    }

    fn level(self) -> RatioLevel {
        self.spec().level
    }

    /// Default `(ε_low, ε_high)` (§5.1–§5.5, §8).
    pub fn default_clip(self) -> (f64, f64) {
        self.spec().default_clip
    }

    /// Whether the dual clip (§5.1) applies: token-ratio losses only (GSPO/ATPO have none).
    pub fn has_dual_clip(self) -> bool {
        self.level() == RatioLevel::Token
    }

    /// Default aggregation (§5.7 "which mode each method uses").
    pub fn default_agg(self) -> LossAggMode {
        match self.level() {
            RatioLevel::Token => LossAggMode::TokenMean,
            RatioLevel::Sequence | RatioLevel::Turn => LossAggMode::SeqMeanTokenMean,
        }
    }

    /// Aggregation hard-coded by the reference code (GSPO, ATPO `gspo_turn`).
    pub fn forced_agg(self) -> Option<LossAggMode> {
        self.spec().forced_agg
    }

    /// Default ratio form of segment losses (\[REC\] §5.4: plain for ST-PPO, sg for ATPO/A2TGPO).
    pub fn default_ratio_form(self) -> RatioForm {
        self.spec().ratio_form
    }

    /// Whether the clipping-bias correction is part of the method (§5.6).
    pub fn implies_clip_bias(self) -> bool {
        self.spec().implies_clip_bias
    }

    /// The channels of per-method data the loss reads ([`LossSpec::reads`]).
    pub fn reads(self) -> &'static [Channel] {
        self.spec().reads
    }

    /// Whether the loss's defining mechanism is a clip on the ratio (token, sequence or turn)
    /// or the clipping-bias correction ([`LossSpec::defined_by_clip`]).
    pub fn defined_by_clip(self) -> bool {
        self.spec().defined_by_clip
    }

    /// Runs this loss on `input` (`cfg.policy_loss` is ignored).
    pub fn compute(
        self,
        input: &PolicyLossInput<'_>,
        cfg: &PolicyLossConfig,
    ) -> Result<PolicyLossOutput> {
        run(self, input, cfg)
    }
}

impl fmt::Display for PolicyLossKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyLossKind {
    type Err = LossError;

    fn from_str(s: &str) -> Result<Self> {
        if s == "decoupled_clip" {
            return Ok(Self::Dapo);
        }
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| LossError::UnknownPolicyLoss {
                name: s.to_string(),
                known: POLICY_LOSS_NAMES.join(", "),
            })
    }
}

/// Configuration of a policy loss (verl `actor.policy_loss` + clip keys). Unset options take the
/// per-loss defaults of [`PolicyLossKind`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyLossConfig {
    /// Registry name (see [`POLICY_LOSS_NAMES`]); default `vanilla`.
    pub policy_loss: String,
    /// Symmetric ε used for both sides when `clip_ratio_low`/`clip_ratio_high` are unset.
    pub clip_ratio: Option<f64>,
    /// ε_low (lower bound 1 − ε_low).
    pub clip_ratio_low: Option<f64>,
    /// ε_high (upper bound 1 + ε_high).
    pub clip_ratio_high: Option<f64>,
    /// Dual-clip constant c (> 1) for token losses; default 3.0; `null` disables the dual clip.
    pub clip_ratio_c: Option<f64>,
    /// Aggregation; unset = per-loss default; GSPO and `gspo_turn` force seq-mean-token-mean.
    pub loss_agg_mode: Option<LossAggMode>,
    /// K of `seq-mean-token-sum-norm`; unset = mask width.
    pub loss_scale_factor: Option<f64>,
    /// Ratio form of sequence/turn losses; unset = per-loss default (ignored by token losses).
    pub ratio_form: Option<RatioForm>,
    /// Clipping-bias correction (§5.6); on by default for `s_ppo`, `st_ppo`, `s_grpo`, where this
    /// only tunes it; setting it turns it on for any other loss.
    pub clip_bias: Option<ClipBiasConfig>,
    /// Clamp of the token log-ratio for token losses (verl: 20).
    pub log_ratio_clamp: f64,
}

impl Default for PolicyLossConfig {
    fn default() -> Self {
        Self {
            policy_loss: "vanilla".to_string(),
            clip_ratio: None,
            clip_ratio_low: None,
            clip_ratio_high: None,
            clip_ratio_c: Some(3.0),
            loss_agg_mode: None,
            loss_scale_factor: None,
            ratio_form: None,
            clip_bias: None,
            log_ratio_clamp: 20.0,
        }
    }
}

/// A [`PolicyLossConfig`] with every default filled in for one loss kind.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedPolicyLoss {
    /// The loss.
    pub kind: PolicyLossKind,
    /// ε_low.
    pub clip_low: f64,
    /// ε_high.
    pub clip_high: f64,
    /// Dual-clip constant (token losses only).
    pub clip_ratio_c: Option<f64>,
    /// Aggregation mode.
    pub agg_mode: LossAggMode,
    /// K of `seq-mean-token-sum-norm`.
    pub loss_scale_factor: Option<f64>,
    /// Ratio form (segment losses).
    pub ratio_form: RatioForm,
    /// Clipping-bias correction, when on.
    pub clip_bias: Option<ClipBiasConfig>,
    /// Token log-ratio clamp.
    pub log_ratio_clamp: f64,
}

impl PolicyLossConfig {
    /// A default config for the named loss.
    pub fn named(name: &str) -> Self {
        Self {
            policy_loss: name.to_string(),
            ..Self::default()
        }
    }

    /// Resolves the config for the loss named in `policy_loss`.
    pub fn resolve(&self) -> Result<ResolvedPolicyLoss> {
        self.resolve_as(self.policy_loss.parse()?)
    }

    /// Resolves the config for `kind` (ignoring `policy_loss`), validating every value.
    pub fn resolve_as(&self, kind: PolicyLossKind) -> Result<ResolvedPolicyLoss> {
        let (d_low, d_high) = kind.default_clip();
        let clip_low = self.clip_ratio_low.or(self.clip_ratio).unwrap_or(d_low);
        let clip_high = self.clip_ratio_high.or(self.clip_ratio).unwrap_or(d_high);
        if !(clip_low.is_finite() && (0.0..1.0).contains(&clip_low)) {
            return Err(LossError::InvalidConfig(format!(
                "{kind}: clip_ratio_low must be in [0, 1), got {clip_low}"
            )));
        }
        if !(clip_high.is_finite() && clip_high >= 0.0) {
            return Err(LossError::InvalidConfig(format!(
                "{kind}: clip_ratio_high must be finite and ≥ 0, got {clip_high}"
            )));
        }
        let clip_ratio_c = if kind.has_dual_clip() {
            self.clip_ratio_c
        } else {
            None
        };
        if let Some(c) = clip_ratio_c
            && !(c > 1.0 && c.is_finite())
        {
            return Err(LossError::InvalidConfig(format!(
                "{kind}: clip_ratio_c must be finite and > 1, got {c}"
            )));
        }
        let agg_mode = match (kind.forced_agg(), self.loss_agg_mode) {
            (Some(forced), Some(asked)) if forced != asked => {
                return Err(LossError::InvalidConfig(format!(
                    "{kind} forces loss_agg_mode {forced} (reference code), but {asked} was configured"
                )));
            }
            (Some(forced), _) => forced,
            (None, asked) => asked.unwrap_or(kind.default_agg()),
        };
        if !(self.log_ratio_clamp.is_finite() && self.log_ratio_clamp > 0.0) {
            return Err(LossError::InvalidConfig(format!(
                "log_ratio_clamp must be > 0, got {}",
                self.log_ratio_clamp
            )));
        }
        let clip_bias = match (kind.implies_clip_bias(), self.clip_bias) {
            (_, Some(c)) => Some(c),
            (true, None) => Some(ClipBiasConfig::default()),
            (false, None) => None,
        };
        if let Some(c) = &clip_bias {
            c.validate()?;
        }
        Ok(ResolvedPolicyLoss {
            kind,
            clip_low,
            clip_high,
            clip_ratio_c,
            agg_mode,
            loss_scale_factor: self.loss_scale_factor,
            ratio_form: self.ratio_form.unwrap_or(kind.default_ratio_form()),
            clip_bias,
            log_ratio_clamp: self.log_ratio_clamp,
        })
    }
}

/// The tensors of one mini-batch (or micro-batch) for a policy loss. All are [B, L].
#[derive(Debug, Clone, Copy)]
pub struct PolicyLossInput<'a> {
    /// Current-policy log-probs of the sampled tokens (differentiable).
    pub logp: &'a Tensor,
    /// Behaviour (old) log-probs; treated as constants.
    pub old_logp: &'a Tensor,
    /// Per-token advantages; constants.
    pub advantages: &'a Tensor,
    /// 1 = trained token, 0 = prompt/observation/padding.
    pub loss_mask: &'a Tensor,
    /// Explicit agent-turn index per token (−1 on observations), any numeric dtype (§1.2);
    /// `None` = mask runs.
    pub turn_id: Option<&'a Tensor>,
    /// Per-token values of the channels the estimator emitted ([`Channel`], constants),
    /// indexed by channel: a loss requires the ones it reads ([`PolicyLossKind::reads`]) and
    /// ignores the others. Set with [`Self::with_channel`].
    pub channels: [Option<&'a Tensor>; Channel::ALL.len()],
    /// Mini-batch totals when this is one micro-batch of a mini-batch.
    pub denominators: Option<AggDenominators>,
    /// Model parameters for the §5.6 `grad`-space clipping-bias norm (one extra backward).
    pub params: Option<&'a [Var]>,
    /// A mini-batch clip-bias scale computed beforehand over the whole mini-batch (use when this
    /// call sees one micro-batch only); replaces the scale computed here (`minibatch` scope).
    pub clip_bias_scale: Option<f64>,
    /// Per-token importance weights (constants, ≥ 0) that multiply each token's loss before
    /// aggregation: truncated importance sampling over the sampler–trainer mismatch, `w =
    /// min(π_old(y_t) / π_sampler(y_t), C)` (verl's `rollout_is_weights`; Yao et al., 2025).
    /// `None` = 1 everywhere.
    pub is_weights: Option<&'a Tensor>,
}

impl<'a> PolicyLossInput<'a> {
    /// The four mandatory tensors.
    pub fn new(
        logp: &'a Tensor,
        old_logp: &'a Tensor,
        advantages: &'a Tensor,
        loss_mask: &'a Tensor,
    ) -> Self {
        Self {
            logp,
            old_logp,
            advantages,
            loss_mask,
            turn_id: None,
            channels: [None; Channel::ALL.len()],
            denominators: None,
            params: None,
            clip_bias_scale: None,
            is_weights: None,
        }
    }

    /// Adds explicit turn ids.
    pub fn with_turn_id(mut self, turn_id: &'a Tensor) -> Self {
        self.turn_id = Some(turn_id);
        self
    }

    /// Adds the per-token values of `channel` (e.g. A2TGPO's clip scales, §5.5).
    pub fn with_channel(mut self, channel: Channel, values: &'a Tensor) -> Self {
        self.channels[channel as usize] = Some(values);
        self
    }

    /// The per-token values of `channel`, if given.
    pub fn channel(&self, channel: Channel) -> Option<&'a Tensor> {
        self.channels[channel as usize]
    }

    /// Adds the parameters for the `grad`-space clipping-bias norm (§5.6).
    pub fn with_params(mut self, params: &'a [Var]) -> Self {
        self.params = Some(params);
        self
    }

    /// Uses a precomputed mini-batch clip-bias scale (§5.6, micro-batching).
    pub fn with_clip_bias_scale(mut self, scale: f64) -> Self {
        self.clip_bias_scale = Some(scale);
        self
    }

    /// Adds per-token importance weights (truncated importance sampling, [`Self::is_weights`]).
    pub fn with_is_weights(mut self, weights: &'a Tensor) -> Self {
        self.is_weights = Some(weights);
        self
    }

    /// Adds mini-batch denominators (micro-batching).
    pub fn with_denominators(mut self, denominators: AggDenominators) -> Self {
        self.denominators = Some(denominators);
        self
    }
}

/// Plain-number diagnostics of a policy loss (§7), named as verl names them in [`Self::to_map`].
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyLossMetrics {
    /// The loss kind.
    pub loss_name: &'static str,
    /// Value of the (scaled) policy loss.
    pub pg_loss: f64,
    /// `actor/pg_clipfrac`: masked mean of `l2 > l1`.
    pub pg_clipfrac: f64,
    /// `actor/pg_clipfrac_lower`: masked mean of dual clip active (A < 0); 0 without dual clip.
    pub pg_clipfrac_lower: f64,
    /// `actor/pg_clipfrac_high`: masked mean of tokens clipped at the upper bound (A > 0 and
    /// ratio > 1 + ε_high, or A2TGPO's 1 + c·ε_high).
    pub pg_clipfrac_high: f64,
    /// `actor/pg_clipfrac_low`: masked mean of tokens clipped at the lower bound (A < 0 and
    /// ratio < 1 − ε_low, or A2TGPO's 1 − c·ε_low).
    pub pg_clipfrac_low: f64,
    /// `actor/ppo_kl`: masked mean of `−logr` (k1 of old‖new).
    pub ppo_kl: f64,
    /// Clipping-bias norm ‖C‖₂ (§5.6) with the loss's own ratio and bounds (logged always).
    pub clip_bias_norm: f64,
    /// ‖∇_θ S‖₂ of the clipped-token surrogate when the `grad` space is configured.
    pub clip_bias_grad_norm: Option<f64>,
    /// `actor/clip_bias_scale`: 1 without correction; `inverse_norm`: the loss scale (mean
    /// sample scale for `per_sample`); `downweight`: the mean sample weight `s̄` of this call's
    /// rows with a non-zero surrogate (weighted by each row's share of the aggregated loss; 1
    /// when there is none). A diagnostic: `downweight` scales no step by it (§5.6).
    pub clip_bias_scale: f64,
    /// `downweight`: `Σ_i share_i·s_i` over this call's rows with a non-zero surrogate `G_i`,
    /// where `share_i` is row i's share of the aggregated loss before weighting (`W_i·|y_i|`)
    /// and `s_i` its weight; 0 otherwise. Summed over the pieces of a mini-batch and divided by
    /// [`Self::clip_bias_share_sum`], it gives the mini-batch's mean weight `s̄`.
    pub clip_bias_weight_sum: f64,
    /// `downweight`: `Σ_i share_i` over the same rows; 0 otherwise.
    pub clip_bias_share_sum: f64,
    /// Number of loss tokens in the clipped set of §5.6 (non-zero advantage).
    pub clip_bias_num_clipped: usize,
    /// Turn rule used for turn ratios and turn diagnostics.
    pub turn_rule: TurnRule,
    /// Number of turns with ≥ 1 loss token.
    pub num_turns: usize,
    /// `actor/turn_kl_entropy` (§7); `None` when no sample could be scored.
    pub turn_kl_entropy: Option<f64>,
    /// `actor/single_turn_count`: samples with ≤ 1 turn.
    pub single_turn_count: usize,
}

impl PolicyLossMetrics {
    /// Metrics keyed by their logged names (`actor/pg_clipfrac`, …).
    pub fn to_map(&self) -> BTreeMap<String, f64> {
        let mut m = BTreeMap::new();
        m.insert(mk::actor::PG_LOSS.to_string(), self.pg_loss);
        m.insert(mk::actor::PG_CLIPFRAC.to_string(), self.pg_clipfrac);
        m.insert(
            mk::actor::PG_CLIPFRAC_LOWER.to_string(),
            self.pg_clipfrac_lower,
        );
        m.insert(
            mk::actor::PG_CLIPFRAC_HIGH.to_string(),
            self.pg_clipfrac_high,
        );
        m.insert(mk::actor::PG_CLIPFRAC_LOW.to_string(), self.pg_clipfrac_low);
        m.insert(mk::actor::PPO_KL.to_string(), self.ppo_kl);
        m.insert(mk::actor::CLIP_BIAS_NORM.to_string(), self.clip_bias_norm);
        m.insert(mk::actor::CLIP_BIAS_SCALE.to_string(), self.clip_bias_scale);
        if let Some(g) = self.clip_bias_grad_norm {
            m.insert(mk::actor::CLIP_BIAS_GRAD_NORM.to_string(), g);
        }
        m.insert(
            mk::actor::CLIP_BIAS_NUM_CLIPPED.to_string(),
            self.clip_bias_num_clipped as f64,
        );
        m.insert(mk::actor::NUM_TURNS.to_string(), self.num_turns as f64);
        m.insert(
            mk::actor::TURN_RULE_EXPLICIT.to_string(),
            f64::from(u8::from(self.turn_rule == TurnRule::ExplicitTurnId)),
        );
        if let Some(h) = self.turn_kl_entropy {
            m.insert(mk::actor::TURN_KL_ENTROPY.to_string(), h);
        }
        m.insert(
            mk::actor::SINGLE_TURN_COUNT.to_string(),
            self.single_turn_count as f64,
        );
        m
    }
}

/// Result of a policy loss.
#[derive(Debug, Clone)]
pub struct PolicyLossOutput {
    /// Scalar loss (differentiable w.r.t. `logp`), clip-bias scale included.
    pub loss: Tensor,
    /// Per-token losses [B, L] before aggregation and scaling (differentiable).
    pub per_token_loss: Tensor,
    /// The ratio that was clipped, per token (token `w` or segment `s_{i,t}` value), detached.
    pub ratio: Tensor,
    /// Per row and token: the PPO clip was active (`l2 > l1`, what `actor/pg_clipfrac`
    /// counts) on a loss-mask token; `[B][L]`.
    pub clipped: Vec<Vec<bool>>,
    /// Diagnostics.
    pub metrics: PolicyLossMetrics,
}

/// Runs the loss named in `cfg.policy_loss`; unknown names give
/// [`LossError::UnknownPolicyLoss`].
pub fn compute_policy_loss(
    input: &PolicyLossInput<'_>,
    cfg: &PolicyLossConfig,
) -> Result<PolicyLossOutput> {
    cfg.policy_loss
        .parse::<PolicyLossKind>()?
        .compute(input, cfg)
}

fn rows_of(t: &Tensor) -> Result<Vec<Vec<f64>>> {
    Ok(t.to_dtype(DType::F64)?.to_vec2::<f64>()?)
}

/// Segment ratio `s_{i,t}` (§5.3, §5.4) for the segments of `seg`, in `form`, clamped ≤ 10 in log
/// space. Differentiable w.r.t. `logp`.
fn segment_ratio(
    logp: &Tensor,
    old_logp: &Tensor,
    mask: &Tensor,
    seg: &TurnSegments,
    form: RatioForm,
    device: &Device,
) -> Result<Tensor> {
    let (b, l) = (seg.batch, seg.len);
    let dummy = seg.turns.len(); // non-loss tokens go to a throw-away segment
    let idx: Vec<u32> = seg
        .token_turn
        .iter()
        .map(|o| o.unwrap_or(dummy) as u32)
        .collect();
    let idx = Tensor::from_vec(idx, b * l, device)?;
    let mut counts: Vec<f64> = seg.turns.iter().map(|t| t.positions.len() as f64).collect();
    counts.push(1.0);
    let counts = Tensor::from_vec(counts, dummy + 1, device)?.to_dtype(logp.dtype())?;
    // log s_k = (1/|y_k|) Σ_{t∈k} logr_t
    let logr = logp.sub(old_logp)?.mul(mask)?.flatten_all()?;
    let sums = Tensor::zeros(dummy + 1, logp.dtype(), device)?.index_add(&idx, &logr, 0)?;
    let log_s = sums.div(&counts)?.index_select(&idx, 0)?.reshape((b, l))?;
    let log_s = match form {
        RatioForm::Plain => log_s,
        // log s_{k,t} = logp_t − sg[logp_t] + sg[log s_k]
        RatioForm::StopGradient => logp.sub(&logp.detach())?.add(&log_s.detach())?,
    };
    Ok(log_s.minimum(10.0)?.exp()?)
}

/// The shared body of every policy loss (§5.1–§5.6), read top to bottom: checked inputs, the
/// ratio, the channels it reads, the clip bounds, the clipped per-token loss, the diagnostics,
/// the clipping-bias correction and the aggregate.
fn run(
    kind: PolicyLossKind,
    input: &PolicyLossInput<'_>,
    cfg: &PolicyLossConfig,
) -> Result<PolicyLossOutput> {
    let r = cfg.resolve_as(kind)?;
    let name = kind.name();
    let body = LossBody {
        kind,
        name,
        r: &r,
        input,
        device: input.logp.device().clone(),
        x: CheckedInput::new(name, input)?,
    };
    let ratio = body.ratio()?;
    body.check_channels()?;
    let bounds = body.clip_bounds()?;
    let clipped = body.clipped_loss(&ratio, &bounds)?;
    // The ratio and its bounds on the host, once for the diagnostics and the clipping bias.
    let ratio_rows = rows_of(&ratio)?;
    let (lo_rows, hi_rows) = (rows_of(&bounds.lo)?, rows_of(&bounds.hi)?);
    let diag = body.diagnostics(&ratio_rows, (&lo_rows, &hi_rows), &clipped)?;
    let cb = body.clip_bias(&ratio_rows, (&lo_rows, &hi_rows))?;
    let agg = body.aggregate(&clipped.loss_mat, &ratio, &ratio_rows, &cb)?;
    let turns = &body.x.turns;

    Ok(PolicyLossOutput {
        loss: agg.loss,
        per_token_loss: clipped.loss_mat,
        ratio: ratio.detach(),
        clipped: diag.clipped,
        metrics: PolicyLossMetrics {
            loss_name: name,
            pg_loss: agg.pg_loss,
            pg_clipfrac: diag.pg_clipfrac,
            pg_clipfrac_lower: diag.pg_clipfrac_lower,
            pg_clipfrac_high: diag.pg_clipfrac_high,
            pg_clipfrac_low: diag.pg_clipfrac_low,
            ppo_kl: diag.ppo_kl,
            clip_bias_norm: cb.norm,
            clip_bias_grad_norm: agg.grad_norm,
            clip_bias_scale: agg.reported_scale,
            clip_bias_weight_sum: agg.cb_weight_sum,
            clip_bias_share_sum: agg.cb_share_sum,
            clip_bias_num_clipped: cb.n_clipped,
            turn_rule: turns.rule,
            num_turns: turns.turns.len(),
            turn_kl_entropy: diag.turn_kl_entropy,
            single_turn_count: diag.single_turn_count,
        },
    })
}

/// A policy loss's inputs after the checks: shapes and NaN/inf verified, the constants detached
/// and cast to `logp`'s dtype, and the plain-number rows the diagnostics read.
struct CheckedInput<'a> {
    /// Current-policy log-probs (differentiable).
    logp: &'a Tensor,
    /// Behaviour log-probs, detached, in `logp`'s dtype.
    old: Tensor,
    /// Advantages, detached, in `logp`'s dtype.
    adv: Tensor,
    /// Loss mask, detached, in `logp`'s dtype.
    mask: Tensor,
    /// `(B, L)`.
    dims: (usize, usize),
    /// Advantages per row and token.
    adv_rows: Vec<Vec<f64>>,
    /// Loss mask per row and token.
    mask_rows: Vec<Vec<f64>>,
    /// `logp − old_logp` per row and token.
    logr_rows: Vec<Vec<f64>>,
    /// The batch's turns (explicit turn ids, or runs of the mask).
    turns: TurnSegments,
}

impl<'a> CheckedInput<'a> {
    /// Inputs: shapes, NaN/inf, constants detached and cast to logp's dtype.
    fn new(name: &str, input: &PolicyLossInput<'a>) -> Result<Self> {
        let dtype = input.logp.dtype();
        let logp_rows = finite_rows(name, "logp", input.logp, None)?;
        let dims = (logp_rows.len(), logp_rows.first().map_or(0, Vec::len));
        let old_rows = finite_rows(name, "old_logp", input.old_logp, Some(dims))?;
        let adv_rows = finite_rows(name, "advantages", input.advantages, Some(dims))?;
        let mask_rows = finite_rows(name, "loss_mask", input.loss_mask, Some(dims))?;
        let turn_rows = match input.turn_id {
            Some(t) => Some(finite_rows(name, "turn_id", t, Some(dims))?),
            None => None,
        };
        let logp = input.logp;
        let old = input.old_logp.detach().to_dtype(dtype)?;
        let adv = input.advantages.detach().to_dtype(dtype)?;
        let mask = input.loss_mask.detach().to_dtype(dtype)?;
        let logr_rows: Vec<Vec<f64>> = logp_rows
            .iter()
            .zip(&old_rows)
            .map(|(p, o)| p.iter().zip(o).map(|(p, o)| p - o).collect())
            .collect();
        let turns = TurnSegments::from_rows(name, &mask_rows, turn_rows.as_deref())?;
        Ok(Self {
            logp,
            old,
            adv,
            mask,
            dims,
            adv_rows,
            mask_rows,
            logr_rows,
            turns,
        })
    }
}

/// Clip bounds `[lo, hi]` per token.
struct ClipBounds {
    /// Lower bound.
    lo: Tensor,
    /// Upper bound.
    hi: Tensor,
}

/// The per-token PPO losses of §5.1.
struct ClippedLoss {
    /// `l1 = −A·r`.
    l1: Tensor,
    /// `l2 = −A·clip(r, lo, hi)`.
    l2: Tensor,
    /// `l_clip = max(l1, l2)`.
    l_clip: Tensor,
    /// `l3 = −A·c` when the dual clip is on.
    l3: Option<Tensor>,
    /// The per-token loss after the dual clip and the importance weights, [B, L].
    loss_mat: Tensor,
}

/// The §7 diagnostics of a policy loss, on detached values.
struct Diagnostics {
    /// Per row and token: the PPO clip was active on a loss-mask token.
    clipped: Vec<Vec<bool>>,
    /// Masked mean of `l2 > l1`.
    pg_clipfrac: f64,
    /// Masked mean of the dual clip active (0 without dual clip).
    pg_clipfrac_lower: f64,
    /// Masked mean of tokens clipped at the upper bound.
    pg_clipfrac_high: f64,
    /// Masked mean of tokens clipped at the lower bound.
    pg_clipfrac_low: f64,
    /// Masked mean of `−logr`.
    ppo_kl: f64,
    /// Turn KL entropy, when a sample could be scored.
    turn_kl_entropy: Option<f64>,
    /// Samples with ≤ 1 turn.
    single_turn_count: usize,
}

/// The aggregated loss (§5.7) and the clip-bias figures the aggregation produced.
struct Aggregated {
    /// Scalar loss, clip-bias scale included.
    loss: Tensor,
    /// Its value.
    pg_loss: f64,
    /// ‖∇_θ S‖₂ when the `grad` space is configured.
    grad_norm: Option<f64>,
    /// The clip-bias scale reported as `actor/clip_bias_scale`.
    reported_scale: f64,
    /// `downweight`: `Σ_i share_i·s_i`; 0 otherwise.
    cb_weight_sum: f64,
    /// `downweight`: `Σ_i share_i`; 0 otherwise.
    cb_share_sum: f64,
}

/// One call of a policy loss: what every section of [`run`] reads.
struct LossBody<'a, 'b> {
    kind: PolicyLossKind,
    name: &'static str,
    r: &'b ResolvedPolicyLoss,
    input: &'b PolicyLossInput<'a>,
    device: Device,
    x: CheckedInput<'a>,
}

impl LossBody<'_, '_> {
    /// Ratio r: token (§5.1), sequence (§5.3) or turn (§5.4).
    fn ratio(&self) -> Result<Tensor> {
        let (r, x) = (self.r, &self.x);
        Ok(match self.kind.level() {
            RatioLevel::Token => {
                // w = exp(clamp(logp − old_logp, ±20))
                let c = r.log_ratio_clamp;
                x.logp.sub(&x.old)?.clamp(-c, c)?.exp()?
            }
            RatioLevel::Sequence => {
                let seq = TurnSegments::whole_sequences(&x.mask_rows);
                segment_ratio(x.logp, &x.old, &x.mask, &seq, r.ratio_form, &self.device)?
            }
            RatioLevel::Turn => segment_ratio(
                x.logp,
                &x.old,
                &x.mask,
                &x.turns,
                r.ratio_form,
                &self.device,
            )?,
        })
    }

    /// Channels: every one the loss reads must be given (the config checks that the
    /// estimator emits them).
    fn check_channels(&self) -> Result<()> {
        let name = self.name;
        for &ch in self.kind.reads() {
            if self.input.channel(ch).is_none() {
                return Err(LossError::MissingInput {
                    loss: name.to_string(),
                    input: ch.key().to_string(),
                    why: format!(
                        "the {name} loss reads the estimator's `{ch}` channel per token, and it was \
                         not given (an estimator that emits it must run before this loss)"
                    ),
                });
            }
        }
        Ok(())
    }

    /// Clip bounds [lo, hi]: constants, or scaled per token by the clip-scale channel,
    /// [1 − c·ε_low, 1 + c·ε_high] (A2TGPO, §5.5).
    fn clip_bounds(&self) -> Result<ClipBounds> {
        let (name, r, x) = (self.name, self.r, &self.x);
        let dtype = x.logp.dtype();
        let clip_scale = self
            .kind
            .reads()
            .contains(&Channel::ClipScale)
            .then(|| self.input.channel(Channel::ClipScale))
            .flatten();
        let (lo, hi) = if let Some(c) = clip_scale {
            let c_rows = finite_rows(name, "clip_scale", c, Some(x.dims))?;
            if c_rows.iter().flatten().any(|&v| v < 0.0) {
                return Err(LossError::InvalidInput {
                    loss: name.to_string(),
                    msg: "clip_scale must be ≥ 0".to_string(),
                });
            }
            let c = c.detach().to_dtype(dtype)?;
            (c.affine(-r.clip_low, 1.0)?, c.affine(r.clip_high, 1.0)?)
        } else {
            let ones = x.mask.ones_like()?;
            (
                ones.affine(0.0, 1.0 - r.clip_low)?,
                ones.affine(0.0, 1.0 + r.clip_high)?,
            )
        };
        Ok(ClipBounds { lo, hi })
    }

    /// PPO clip: l1 = −A·r, l2 = −A·clip(r, lo, hi), l_clip = max(l1, l2) (§5.1); the dual
    /// clip; then truncated importance sampling.
    fn clipped_loss(&self, ratio: &Tensor, bounds: &ClipBounds) -> Result<ClippedLoss> {
        let (name, r, x) = (self.name, self.r, &self.x);
        let neg_adv = x.adv.neg()?;
        let l1 = neg_adv.mul(ratio)?;
        let l2 = neg_adv.mul(&ratio.maximum(&bounds.lo)?.minimum(&bounds.hi)?)?;
        let l_clip = l1.maximum(&l2)?;

        // --- Dual clip: for A < 0, loss_t = min(l_clip, −A·c) (§5.1, token losses only).
        let (loss_mat, l3) = match r.clip_ratio_c {
            Some(c) => {
                let l3 = neg_adv.affine(c, 0.0)?;
                let dual = l_clip.minimum(&l3)?;
                (x.adv.lt(0.0)?.where_cond(&dual, &l_clip)?, Some(l3))
            }
            None => (l_clip.clone(), None),
        };
        // --- Truncated importance sampling: each token's loss times its constant weight.
        let loss_mat = match self.input.is_weights {
            Some(w) => {
                let w_rows = finite_rows(name, "is_weights", w, Some(x.dims))?;
                if w_rows.iter().flatten().any(|&v| v < 0.0) {
                    return Err(LossError::InvalidInput {
                        loss: name.to_string(),
                        msg: "is_weights must be ≥ 0".to_string(),
                    });
                }
                loss_mat.mul(&w.detach().to_dtype(x.logp.dtype())?)?
            }
            None => loss_mat,
        };
        Ok(ClippedLoss {
            l1,
            l2,
            l_clip,
            l3,
            loss_mat,
        })
    }

    /// Diagnostics (§7) on detached values.
    fn diagnostics(
        &self,
        ratio_rows_d: &[Vec<f64>],
        (lo_rows, hi_rows): (&[Vec<f64>], &[Vec<f64>]),
        pieces: &ClippedLoss,
    ) -> Result<Diagnostics> {
        let (r, x) = (self.r, &self.x);
        let (dims, adv_rows, mask_rows) = (x.dims, &x.adv_rows, &x.mask_rows);
        let (l1_rows, l2_rows, lc_rows) = (
            rows_of(&pieces.l1)?,
            rows_of(&pieces.l2)?,
            rows_of(&pieces.l_clip)?,
        );
        let indicator = |f: &dyn Fn(usize, usize) -> bool| -> Vec<Vec<f64>> {
            (0..dims.0)
                .map(|i| (0..dims.1).map(|t| f64::from(u8::from(f(i, t)))).collect())
                .collect()
        };
        let clipped: Vec<Vec<bool>> = (0..dims.0)
            .map(|i| {
                (0..dims.1)
                    .map(|t| mask_rows[i][t] > 0.0 && l2_rows[i][t] > l1_rows[i][t])
                    .collect()
            })
            .collect();
        let pg_clipfrac =
            masked_mean_rows(&indicator(&|i, t| l2_rows[i][t] > l1_rows[i][t]), mask_rows);
        let pg_clipfrac_high = masked_mean_rows(
            &indicator(&|i, t| adv_rows[i][t] > 0.0 && ratio_rows_d[i][t] > hi_rows[i][t]),
            mask_rows,
        );
        let pg_clipfrac_low = masked_mean_rows(
            &indicator(&|i, t| adv_rows[i][t] < 0.0 && ratio_rows_d[i][t] < lo_rows[i][t]),
            mask_rows,
        );
        let pg_clipfrac_lower = match &pieces.l3 {
            Some(l3) => {
                let l3_rows = rows_of(l3)?;
                masked_mean_rows(
                    &indicator(&|i, t| lc_rows[i][t] > l3_rows[i][t] && adv_rows[i][t] < 0.0),
                    mask_rows,
                )
            }
            None => 0.0,
        };
        let kl_rows: Vec<Vec<f64>> = x
            .logr_rows
            .iter()
            .map(|row| {
                row.iter()
                    .map(|v| -v.clamp(-r.log_ratio_clamp, r.log_ratio_clamp))
                    .collect()
            })
            .collect();
        let ppo_kl = masked_mean_rows(&kl_rows, mask_rows);
        let (turn_kl_entropy, single_turn_count) = turn_kl_entropy(&x.logr_rows, &x.turns);
        Ok(Diagnostics {
            clipped,
            pg_clipfrac,
            pg_clipfrac_lower,
            pg_clipfrac_high,
            pg_clipfrac_low,
            ppo_kl,
            turn_kl_entropy,
            single_turn_count,
        })
    }

    /// Clipping-bias correction (§5.6): C from the token ratio (Alg. 1) or the clipped one.
    fn clip_bias(
        &self,
        ratio_rows: &[Vec<f64>],
        (lo_rows, hi_rows): (&[Vec<f64>], &[Vec<f64>]),
    ) -> Result<ClipBiasResult> {
        let (r, x) = (self.r, &self.x);
        let cb_cfg = r.clip_bias.unwrap_or_default();
        Ok(
            if cb_cfg.ratio == ClipBiasRatio::Token && self.kind.level() != RatioLevel::Token {
                let c = r.log_ratio_clamp;
                let token_ratio: Vec<Vec<f64>> = x
                    .logr_rows
                    .iter()
                    .map(|row| row.iter().map(|v| v.clamp(-c, c).exp()).collect())
                    .collect();
                let bound = |b: f64| vec![vec![b; x.dims.1]; x.dims.0];
                clip_bias(
                    &token_ratio,
                    &x.adv_rows,
                    &x.mask_rows,
                    &bound(1.0 - r.clip_low),
                    &bound(1.0 + r.clip_high),
                    &cb_cfg,
                )
            } else {
                clip_bias(
                    ratio_rows,
                    &x.adv_rows,
                    &x.mask_rows,
                    lo_rows,
                    hi_rows,
                    &cb_cfg,
                )
            },
        )
    }

    /// Aggregate (§5.7) with the per-sequence weights, times the clip-bias scale.
    fn aggregate(
        &self,
        loss_mat: &Tensor,
        ratio: &Tensor,
        ratio_rows: &[Vec<f64>],
        cb: &ClipBiasResult,
    ) -> Result<Aggregated> {
        let (name, r, input, mask_rows) = (self.name, self.r, self.input, &self.x.mask_rows);
        let agg_opts = AggOptions {
            norm_constant: r.loss_scale_factor,
            denominators: input.denominators,
        };
        let mut weights = agg_row_weights(mask_rows, r.agg_mode, &agg_opts)?;
        let grad_norm = match r.clip_bias {
            Some(c) if c.norm_space == ClipBiasSpace::Grad => {
                let params = input.params.ok_or_else(|| LossError::MissingInput {
                    loss: name.to_string(),
                    input: "params".to_string(),
                    why: "clip_bias.norm_space = grad needs the model parameters".to_string(),
                })?;
                let g = clip_bias_grad_norm(ratio, ratio_rows, cb, params)?;
                check_finite_values(name, "clip_bias_grad_norm", std::iter::once(g))?;
                Some(g)
            }
            _ => None,
        };
        let (mut cb_weight_sum, mut cb_share_sum) = (0.0, 0.0);
        let (scale, reported_scale) = match r.clip_bias {
            None => (1.0, 1.0),
            Some(c) if c.rule == ClipBiasRule::Downweight => {
                // The loss rows carry the weights; nothing else is scaled (§5.6: the mix of the
                // samples' gradients is what survives AdamW). s̄ is a diagnostic over the rows
                // that have a gradient to weight (G_i ≠ 0): a row whose advantages are all 0 (an
                // uninformative GRPO group) has weight 1 and would otherwise dilute it.
                let signal = cb.sample_signal.iter();
                for (i, ((w, s), &has)) in weights
                    .iter_mut()
                    .zip(cb.sample_weights())
                    .zip(signal)
                    .enumerate()
                {
                    if has {
                        let share = *w * mask_rows[i].iter().sum::<f64>();
                        cb_share_sum += share;
                        cb_weight_sum += share * s;
                    }
                    *w *= s;
                }
                let mean = if cb_share_sum > 0.0 {
                    cb_weight_sum / cb_share_sum
                } else {
                    1.0
                };
                (1.0, mean)
            }
            Some(c) if c.norm_scope == ClipBiasScope::Minibatch => {
                let s = match (input.clip_bias_scale, grad_norm) {
                    (Some(s), _) => s,
                    (None, Some(g)) => c.scale_of(g),
                    (None, None) => cb.scale,
                };
                check_finite_values(name, "clip_bias_scale", std::iter::once(s))?;
                (s, s)
            }
            Some(_) => {
                for (w, s) in weights.iter_mut().zip(&cb.sample_scales) {
                    *w *= s;
                }
                let n = cb.sample_scales.len().max(1) as f64;
                (1.0, cb.sample_scales.iter().sum::<f64>() / n)
            }
        };
        let loss =
            weighted_sum(loss_mat, &self.x.mask, &weights, &self.device)?.affine(scale, 0.0)?;
        let pg_loss = finite_scalar(name, "loss", &loss)?;
        Ok(Aggregated {
            loss,
            pg_loss,
            grad_norm,
            reported_scale,
            cb_weight_sum,
            cb_share_sum,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::test_util::{assert_close, grad_rows, rows, scalar, t2, var2};
    use turnwise_core::advantage::a2tgpo_clip_scale;

    const MASK: [f64; 7] = [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0];
    const LOGR: [f64; 7] = [0.10, -0.05, 0.02, 0.0, 0.0, 0.01, 0.00];

    /// The §5.1 trajectory: old_logp = −1, logp = old + logr, A = 0.5.
    fn spec_traj() -> (Tensor, Tensor, Tensor, Tensor) {
        let old = [-1.0; 7];
        let logp: Vec<f64> = LOGR.iter().map(|r| r - 1.0).collect();
        (t2(&[&logp]), t2(&[&old]), t2(&[&[0.5; 7]]), t2(&[&MASK]))
    }

    fn masked(row: &[f64]) -> Vec<f64> {
        row.iter()
            .zip(MASK)
            .filter(|(_, m)| *m > 0.0)
            .map(|(v, _)| *v)
            .collect()
    }

    fn cfg(name: &str) -> PolicyLossConfig {
        PolicyLossConfig::named(name)
    }

    /// One token with A and w = exp(logr).
    fn one(a: f64, w: f64, name: &str, c: &PolicyLossConfig) -> PolicyLossOutput {
        let (lp, old, adv, m) = (t2(&[&[w.ln()]]), t2(&[&[0.0]]), t2(&[&[a]]), t2(&[&[1.0]]));
        name.parse::<PolicyLossKind>()
            .unwrap()
            .compute(&PolicyLossInput::new(&lp, &old, &adv, &m), c)
            .unwrap()
    }

    /// The loss table's declarations that the config and the trainer read.
    #[test]
    fn declared_properties() {
        let names = |f: fn(PolicyLossKind) -> bool| {
            PolicyLossKind::ALL
                .into_iter()
                .filter(|&k| f(k))
                .map(PolicyLossKind::name)
                .collect::<Vec<_>>()
        };
        assert_eq!(names(|k| !k.reads().is_empty()), ["a2tgpo"]);
        assert_eq!(PolicyLossKind::A2tgpo.reads(), [Channel::ClipScale]);
        assert_eq!(
            names(PolicyLossKind::defined_by_clip),
            [
                "dapo",
                "gspo",
                "gspo_turn",
                "a2tgpo",
                "s_ppo",
                "st_ppo",
                "s_grpo"
            ]
        );
    }

    /// Truncated importance sampling: a token's positive weight multiplies its whole loss, clip
    /// included, so the weighted loss equals the unweighted one on advantages times the
    /// weights (loss and gradient), for every loss whose clip bounds do not read `A`'s scale.
    #[test]
    fn is_weights_scale_each_token_loss() {
        let logp = [-0.9, -1.4, -0.2, -2.0, -0.7, -1.1];
        let old = [-1.0, -1.0, -0.5, -2.0, -0.3, -1.0];
        let adv = [0.8, -1.2, 0.5, 0.0, -0.6, 1.1];
        let mask = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0];
        let turn = [0.0, 0.0, 0.0, -1.0, 1.0, 1.0];
        let w = [0.5, 2.0, 1.3, 7.0, 0.0, 0.9];
        let weighted_adv: Vec<f64> = adv.iter().zip(w).map(|(a, w)| a * w).collect();
        for name in ["vanilla", "dapo", "gspo", "turn", "gspo_turn"] {
            let c = cfg(name);
            let run_with = |a: &[f64], weights: Option<&Tensor>| {
                let v = var2(&[&logp]);
                let (o, am, m, t) = (t2(&[&old]), t2(&[a]), t2(&[&mask]), t2(&[&turn]));
                let mut inp = PolicyLossInput::new(v.as_tensor(), &o, &am, &m).with_turn_id(&t);
                if let Some(wt) = weights {
                    inp = inp.with_is_weights(wt);
                }
                let out = compute_policy_loss(&inp, &c).unwrap();
                (scalar(&out.loss), grad_rows(&out.loss, &v)[0].clone())
            };
            let wt = t2(&[&w]);
            let (got, got_g) = run_with(&adv, Some(&wt));
            let (want, want_g) = run_with(&weighted_adv, None);
            let (plain, _) = run_with(&adv, None);
            assert!((got - want).abs() < 1e-9, "{name}: {got} vs {want}");
            assert_close(&got_g, &want_g, 1e-9);
            assert!(
                (got - plain).abs() > 1e-3,
                "{name}: the weights changed nothing"
            );
        }
        // Negative or non-finite weights are refused.
        let v = var2(&[&logp]);
        let (o, a, m) = (t2(&[&old]), t2(&[&adv]), t2(&[&mask]));
        for bad in [-0.1, f64::NAN] {
            let wt = t2(&[&[1.0, bad, 1.0, 1.0, 1.0, 1.0]]);
            let inp = PolicyLossInput::new(v.as_tensor(), &o, &a, &m).with_is_weights(&wt);
            assert!(compute_policy_loss(&inp, &cfg("vanilla")).is_err());
        }
    }

    #[test]
    fn spec_5_1_dual_clip_scalar_cases() {
        // A = −1, w = 4: l1 = 4, l2 = 1.2, l_clip = 4, dual → 3.0.
        let o = one(-1.0, 4.0, "vanilla", &cfg("vanilla"));
        assert!((scalar(&o.loss) - 3.0).abs() < 1e-6);
        assert_eq!(o.metrics.pg_clipfrac, 0.0); // l2 = 1.2 < l1 = 4: PPO clip not active
        assert_eq!(o.clipped, vec![vec![false]]);
        assert_eq!(o.metrics.pg_clipfrac_lower, 1.0);
        // A = −1, w = 1.5: 1.5, no clip, dual not active.
        let o = one(-1.0, 1.5, "vanilla", &cfg("vanilla"));
        assert!((scalar(&o.loss) - 1.5).abs() < 1e-6);
        assert_eq!(o.metrics.pg_clipfrac_lower, 0.0);
        // A = +1, w = 1.5: clipped to 1.2.
        let o = one(1.0, 1.5, "vanilla", &cfg("vanilla"));
        assert!((scalar(&o.loss) + 1.2).abs() < 1e-6);
        assert_eq!(o.metrics.pg_clipfrac, 1.0);
        assert_eq!(o.clipped, vec![vec![true]]);
        // The dual clip can be turned off.
        let no_dual = PolicyLossConfig {
            clip_ratio_c: None,
            ..cfg("vanilla")
        };
        assert!((scalar(&one(-1.0, 4.0, "vanilla", &no_dual).loss) - 4.0).abs() < 1e-6);
    }

    #[test]
    fn dual_clip_gradients() {
        // Dual clip active (A = −1, w = 4): constant loss 3 → zero gradient; inactive (w = 1.5):
        // ∂(−A·w)/∂logp = −A·w = 1.5; PPO-clipped (A = +1, w = 1.5): zero gradient.
        for (a, w, want) in [(-1.0, 4.0f64, 0.0), (-1.0, 1.5, 1.5), (1.0, 1.5, 0.0)] {
            let v = var2(&[&[w.ln()]]);
            let (old, adv, m) = (t2(&[&[0.0]]), t2(&[&[a]]), t2(&[&[1.0]]));
            let o = PolicyLossKind::Vanilla
                .compute(
                    &PolicyLossInput::new(v.as_tensor(), &old, &adv, &m),
                    &cfg("vanilla"),
                )
                .unwrap();
            assert!(
                (grad_rows(&o.loss, &v)[0][0] - want).abs() < 1e-9,
                "{a} {w}"
            );
        }
    }

    #[test]
    fn spec_5_1_trajectory_token_mean() {
        let (lp, old, adv, m) = spec_traj();
        let o = PolicyLossKind::Vanilla
            .compute(&PolicyLossInput::new(&lp, &old, &adv, &m), &cfg("vanilla"))
            .unwrap();
        let per_tok = masked(&rows(&o.per_token_loss)[0]);
        assert_close(
            &per_tok,
            &[-0.552585, -0.475615, -0.510101, -0.505025, -0.5],
            1e-6,
        );
        assert!((scalar(&o.loss) + 0.508665).abs() < 1e-6);
        assert!((o.metrics.pg_loss + 0.508665).abs() < 1e-6);
        assert_eq!(o.metrics.pg_clipfrac, 0.0);
        assert!((o.metrics.ppo_kl + 0.016).abs() < 1e-9); // −mean(logr) = −0.08/5
    }

    #[test]
    fn spec_5_2_decoupled_clip() {
        // A = +1, w = 1.25: −1.25 with ε_high = 0.28 vs −1.2 with symmetric 0.2.
        assert!((scalar(&one(1.0, 1.25, "dapo", &cfg("dapo")).loss) + 1.25).abs() < 1e-6);
        assert!((scalar(&one(1.0, 1.25, "decoupled_clip", &cfg("dapo")).loss) + 1.25).abs() < 1e-6);
        assert!((scalar(&one(1.0, 1.25, "vanilla", &cfg("vanilla")).loss) + 1.2).abs() < 1e-6);
        let explicit = PolicyLossConfig {
            clip_ratio_high: Some(0.28),
            ..cfg("vanilla")
        };
        assert!((scalar(&one(1.0, 1.25, "vanilla", &explicit).loss) + 1.25).abs() < 1e-6);
    }

    #[test]
    fn spec_5_3_gspo_ratio_value_and_gradient() {
        let (lp, old, adv, m) = spec_traj();
        let o = PolicyLossKind::Gspo
            .compute(&PolicyLossInput::new(&lp, &old, &adv, &m), &cfg("gspo"))
            .unwrap();
        let s = masked(&rows(&o.ratio)[0]);
        assert_close(&s, &[1.016129; 5], 1e-6);
        // s > 1 + 4e-4 → clipped: −0.5 · 1.0004 on every token, seq-mean-token-mean.
        assert!((scalar(&o.loss) + 0.5 * 1.0004).abs() < 1e-6);
        assert_eq!(o.metrics.pg_clipfrac, 1.0);
        // Unclipped (ε = 0.2): value s_i and ∂loss/∂logp_t = −A·s_i/|y| (seq-mean-token-mean).
        let v = Var::from_tensor(&lp).unwrap();
        let wide = PolicyLossConfig {
            clip_ratio: Some(0.2),
            ..cfg("gspo")
        };
        let o = PolicyLossKind::Gspo
            .compute(&PolicyLossInput::new(v.as_tensor(), &old, &adv, &m), &wide)
            .unwrap();
        assert!((scalar(&o.loss) + 0.5 * 1.016129).abs() < 1e-6);
        let g = grad_rows(&o.loss, &v);
        assert_close(&masked(&g[0]), &[-0.5 * 1.016129 / 5.0; 5], 1e-6);
        assert_eq!(g[0][3], 0.0);
    }

    #[test]
    fn spec_5_4_turn_ratios_and_clipped_loss() {
        let (lp, old, adv, m) = spec_traj();
        let input = PolicyLossInput::new(&lp, &old, &adv, &m);
        for name in ["gspo_turn", "turn"] {
            let c = PolicyLossConfig {
                clip_ratio_low: Some(3e-3),
                clip_ratio_high: Some(4e-3),
                ..cfg(name)
            };
            let o = compute_policy_loss(&input, &c).unwrap();
            let s = masked(&rows(&o.ratio)[0]);
            assert_close(
                &s,
                &[1.023608, 1.023608, 1.023608, 1.005013, 1.005013],
                1e-6,
            );
            assert_close(&masked(&rows(&o.per_token_loss)[0]), &[-0.502; 5], 1e-6);
            assert!((scalar(&o.loss) + 0.502).abs() < 1e-6, "{name}");
            assert_eq!(o.metrics.pg_clipfrac, 1.0);
            assert_eq!(o.metrics.num_turns, 2);
            assert_eq!(o.metrics.turn_rule, TurnRule::MaskRuns);
            assert!((o.metrics.turn_kl_entropy.unwrap() - 0.905272).abs() < 1e-6);
        }
    }

    /// §5.4 gradient vector: plain form spreads mean(A) over the turn, sg form keeps A_t.
    #[test]
    fn spec_5_4_plain_vs_stop_gradient_gradients() {
        let old = t2(&[&[-1.0, -2.0, -0.5]]);
        let adv = t2(&[&[1.0, 0.2, -0.4]]);
        let m = t2(&[&[1.0, 1.0, 1.0]]);
        let cases = [
            (RatioForm::Plain, [-0.271148, -0.271148, -0.271148]),
            (RatioForm::StopGradient, [-1.016806, -0.203361, 0.406723]),
        ];
        for (form, want) in cases {
            let v = var2(&[&[-0.9, -2.1, -0.45]]);
            let c = PolicyLossConfig {
                ratio_form: Some(form),
                loss_agg_mode: Some(LossAggMode::SeqMeanTokenSum),
                ..cfg("turn")
            };
            let o = PolicyLossKind::Turn
                .compute(&PolicyLossInput::new(v.as_tensor(), &old, &adv, &m), &c)
                .unwrap();
            assert_close(&rows(&o.ratio)[0], &[1.016806; 3], 1e-6);
            assert_close(&grad_rows(&o.loss, &v)[0], &want, 1e-6);
        }
    }

    #[test]
    fn zero_token_turns_are_skipped_with_explicit_turn_id() {
        let (lp, old, adv, m) = spec_traj();
        // Turn 1 lies on the observation (no loss token); turns 0 and 2 carry the loss tokens.
        let ids = t2(&[&[0.0, 0.0, 0.0, 1.0, 1.0, 2.0, 2.0]]);
        let c = cfg("gspo_turn");
        let explicit = PolicyLossKind::GspoTurn
            .compute(
                &PolicyLossInput::new(&lp, &old, &adv, &m).with_turn_id(&ids),
                &c,
            )
            .unwrap();
        let runs = PolicyLossKind::GspoTurn
            .compute(&PolicyLossInput::new(&lp, &old, &adv, &m), &c)
            .unwrap();
        assert_eq!(explicit.metrics.num_turns, 2);
        assert_eq!(explicit.metrics.turn_rule, TurnRule::ExplicitTurnId);
        assert!((scalar(&explicit.loss) - scalar(&runs.loss)).abs() < 1e-12);
        // One id over both runs → one turn with the GSPO sequence ratio.
        let one_id = t2(&[&[4.0, 4.0, 4.0, -1.0, -1.0, 4.0, 4.0]]);
        let o = PolicyLossKind::GspoTurn
            .compute(
                &PolicyLossInput::new(&lp, &old, &adv, &m).with_turn_id(&one_id),
                &c,
            )
            .unwrap();
        assert_close(&masked(&rows(&o.ratio)[0]), &[1.016129; 5], 1e-6);
    }

    /// §5.5's bounds `[1 − c·ε_low, 1 + c·ε_high]` from the estimator's clip scale (the one
    /// formula of `c`, in turnwise-core): the loss clips a one-token turn exactly there.
    #[test]
    fn spec_5_5_adaptive_bounds() {
        let cases = [
            (-2.0, 0.771522, (0.997685, 1.003086)),
            (0.0, 1.0, (0.997, 1.004)),
            (2.0, 1.228478, (0.996315, 1.004914)),
        ];
        for (ig, c_want, (lo, hi)) in cases {
            let c = a2tgpo_clip_scale(ig, 0.3);
            assert!((c - c_want).abs() < 1e-6);
            let scale = t2(&[&[c]]);
            // A > 0 and a ratio far above the bound: the loss is −A·hi; A < 0 and far below: A·lo.
            for (a, w, want) in [(1.0, 1.1, -hi), (-1.0, 0.9, lo)] {
                let (lp, old, adv, m) = (
                    t2(&[&[f64::ln(w)]]),
                    t2(&[&[0.0]]),
                    t2(&[&[a]]),
                    t2(&[&[1.0]]),
                );
                let input = PolicyLossInput::new(&lp, &old, &adv, &m)
                    .with_channel(Channel::ClipScale, &scale);
                let o = PolicyLossKind::A2tgpo
                    .compute(&input, &cfg("a2tgpo"))
                    .unwrap();
                assert!((scalar(&o.loss) - want).abs() < 1e-6, "îg {ig}, A {a}");
            }
        }
    }

    /// §5.5 on the §3.5 example: c per turn from îg (final turns îg = 0 → c = 1).
    #[test]
    fn spec_5_5_clip_scales_of_section_3_5_example() {
        let cases: [(&[f64], &[f64]); 3] = [
            (&[0.980569, 0.999992, 0.0], &[1.136333, 1.138634, 1.0]),
            (&[-1.372797, 0.0], &[0.821301, 1.0]),
            (
                &[0.392228, -0.999992, 0.0, 0.0],
                &[1.058091, 0.861366, 1.0, 1.0],
            ),
        ];
        for (ig, want) in cases {
            let c: Vec<f64> = ig.iter().map(|&x| a2tgpo_clip_scale(x, 0.3)).collect();
            assert_close(&c, want, 1e-6);
        }
    }

    #[test]
    fn a2tgpo_uses_per_token_bounds() {
        let (lp, old, adv, m) = spec_traj();
        let c1 = t2(&[&[1.0; 7]]);
        let input = PolicyLossInput::new(&lp, &old, &adv, &m);
        // c = 1 everywhere → the gspo_turn loss −0.502.
        let o = PolicyLossKind::A2tgpo
            .compute(&input.with_channel(Channel::ClipScale, &c1), &cfg("a2tgpo"))
            .unwrap();
        assert!((scalar(&o.loss) + 0.502).abs() < 1e-6);
        // îg = 2 on the second turn widens its upper bound to 1.004914 (ratio 1.005013 still clipped).
        let c2 = t2(&[&[1.0, 1.0, 1.0, 1.0, 1.0, 1.228478, 1.228478]]);
        let o = PolicyLossKind::A2tgpo
            .compute(&input.with_channel(Channel::ClipScale, &c2), &cfg("a2tgpo"))
            .unwrap();
        let want = (3.0 * -0.502 + 2.0 * (-0.5 * 1.004914)) / 5.0;
        assert!((scalar(&o.loss) - want).abs() < 1e-6);
        // β large enough that the second turn is inside its bound → its loss is −0.5·s.
        let c3 = t2(&[&[1.0, 1.0, 1.0, 1.0, 1.0, 1.3, 1.3]]);
        let o = PolicyLossKind::A2tgpo
            .compute(&input.with_channel(Channel::ClipScale, &c3), &cfg("a2tgpo"))
            .unwrap();
        assert!((scalar(&o.loss) - (3.0 * -0.502 + 2.0 * (-0.5 * 1.005013)) / 5.0).abs() < 1e-6);
        let err = PolicyLossKind::A2tgpo
            .compute(&input, &cfg("a2tgpo"))
            .unwrap_err();
        assert!(matches!(err, LossError::MissingInput { ref input, .. } if input == "clip_scale"));
    }

    /// A config of `name` with the clipping-bias correction `clip_bias`.
    fn with_clip_bias(name: &str, clip_bias: ClipBiasConfig) -> PolicyLossConfig {
        PolicyLossConfig {
            clip_bias: Some(clip_bias),
            ..cfg(name)
        }
    }

    /// The literal eq. 7/8 rule.
    fn inverse_norm() -> ClipBiasConfig {
        ClipBiasConfig {
            rule: ClipBiasRule::InverseNorm,
            ..ClipBiasConfig::default()
        }
    }

    /// `downweight` (the default): the §5.6 row has clipping error 0.661217, so its loss weight
    /// is 0.338783 (never above 1), its share of the step the same; on-policy it is 1.
    #[test]
    fn downweight_weights_each_sample_by_its_clipping_error() {
        let old = t2(&[&[0.0; 7]]);
        let lp = t2(&[&[0.3, 0.0, -0.1, 0.0, 0.0, -0.4, 0.05]]);
        let adv = t2(&[&[1.0, 1.0, 1.0, 0.0, 0.0, -1.0, -1.0]]);
        let m = t2(&[&MASK]);
        let input = PolicyLossInput::new(&lp, &old, &adv, &m);
        let base = PolicyLossKind::Vanilla
            .compute(&input, &cfg("vanilla"))
            .unwrap();
        for name in ["s_ppo", "s_grpo"] {
            let o = compute_policy_loss(&input, &cfg(name)).unwrap();
            assert!((o.metrics.clip_bias_scale - 0.338783).abs() < 1e-6);
            assert!((scalar(&o.loss) - 0.338783 * scalar(&base.loss)).abs() < 1e-6);
            let (w, sh) = (
                o.metrics.clip_bias_weight_sum,
                o.metrics.clip_bias_share_sum,
            );
            assert!(
                (sh - 1.0).abs() < 1e-9 && (w - 0.338783).abs() < 1e-6,
                "{w} {sh}"
            );
        }
        // Two rows, token-mean: the unclipped row keeps weight 1 and the step scale is the
        // rows' loss-share-weighted mean weight (5 loss tokens each: (0.338783 + 1)/2).
        let old2 = t2(&[&[0.0; 7], &[0.0; 7]]);
        let lp2 = t2(&[&[0.3, 0.0, -0.1, 0.0, 0.0, -0.4, 0.05], &[0.0; 7]]);
        let adv2 = t2(&[&[1.0, 1.0, 1.0, 0.0, 0.0, -1.0, -1.0], &[1.0; 7]]);
        let m2 = t2(&[&MASK, &MASK]);
        let o = PolicyLossKind::SPpo
            .compute(
                &PolicyLossInput::new(&lp2, &old2, &adv2, &m2),
                &cfg("s_ppo"),
            )
            .unwrap();
        assert!((o.metrics.clip_bias_scale - (0.338783 + 1.0) / 2.0).abs() < 1e-6);
        let per = rows(&o.per_token_loss);
        let want = (0.338783 * masked(&per[0]).iter().sum::<f64>()
            + masked(&per[1]).iter().sum::<f64>())
            / 10.0;
        assert!((scalar(&o.loss) - want).abs() < 1e-6);
        // On-policy: nothing clipped, weight 1.
        let o = PolicyLossKind::SPpo
            .compute(&PolicyLossInput::new(&old, &old, &adv, &m), &cfg("s_ppo"))
            .unwrap();
        assert_eq!(
            (o.metrics.clip_bias_scale, o.metrics.clip_bias_num_clipped),
            (1.0, 0)
        );
    }

    /// Review F m7: a row whose advantages are all 0 (an uninformative GRPO group) has no
    /// gradient to weight, so it does not count in s̄: the §5.6 row next to such a row keeps
    /// s̄ = 0.338783, not (0.338783 + 1)/2; and the loss is the same with or without it.
    #[test]
    fn zero_advantage_rows_do_not_dilute_the_mean_weight() {
        let old2 = t2(&[&[0.0; 7], &[0.0; 7]]);
        let lp2 = t2(&[&[0.3, 0.0, -0.1, 0.0, 0.0, -0.4, 0.05], &[0.2; 7]]);
        let adv2 = t2(&[&[1.0, 1.0, 1.0, 0.0, 0.0, -1.0, -1.0], &[0.0; 7]]);
        let m2 = t2(&[&MASK, &MASK]);
        let input = PolicyLossInput::new(&lp2, &old2, &adv2, &m2);
        for name in ["s_ppo", "s_grpo", "st_ppo"] {
            let o = compute_policy_loss(&input, &cfg(name)).unwrap();
            assert!(
                (o.metrics.clip_bias_scale - 0.338783).abs() < 1e-6,
                "{name}: s̄ {}",
                o.metrics.clip_bias_scale
            );
            assert!((o.metrics.clip_bias_share_sum - 0.5).abs() < 1e-9);
        }
        // Only zero-advantage rows: nothing to weight, s̄ reported as 1.
        let zero = t2(&[&[0.0; 7], &[0.0; 7]]);
        let o = PolicyLossKind::SGrpo
            .compute(
                &PolicyLossInput::new(&lp2, &old2, &zero, &m2),
                &cfg("s_grpo"),
            )
            .unwrap();
        assert_eq!(
            (o.metrics.clip_bias_scale, o.metrics.clip_bias_share_sum),
            (1.0, 0.0)
        );
    }

    #[test]
    fn spec_5_6_inverse_norm_scales_the_loss() {
        let old = t2(&[&[0.0; 7]]);
        let lp = t2(&[&[0.3, 0.0, -0.1, 0.0, 0.0, -0.4, 0.05]]);
        let adv = t2(&[&[1.0, 1.0, 1.0, 0.0, 0.0, -1.0, -1.0]]);
        let m = t2(&[&MASK]);
        let input = PolicyLossInput::new(&lp, &old, &adv, &m);
        let base = PolicyLossKind::Vanilla
            .compute(&input, &cfg("vanilla"))
            .unwrap();
        for name in ["s_ppo", "s_grpo"] {
            let o = compute_policy_loss(&input, &with_clip_bias(name, inverse_norm())).unwrap();
            assert!((o.metrics.clip_bias_norm - 0.301426).abs() < 1e-6);
            assert!((o.metrics.clip_bias_scale - 3.317559).abs() < 1e-6);
            assert_eq!(o.metrics.clip_bias_num_clipped, 2);
            assert!((scalar(&o.loss) - 3.317559 * scalar(&base.loss)).abs() < 1e-5);
        }
        // The diagnostic norm is logged even without the correction; the scale stays 1.
        assert!((base.metrics.clip_bias_norm - 0.301426).abs() < 1e-6);
        assert_eq!(base.metrics.clip_bias_scale, 1.0);
        // On-policy (w ≡ 1): nothing clipped → guard gives scale 1.
        let o = PolicyLossKind::SPpo
            .compute(
                &PolicyLossInput::new(&old, &old, &adv, &m),
                &with_clip_bias("s_ppo", inverse_norm()),
            )
            .unwrap();
        assert_eq!(
            (o.metrics.clip_bias_scale, o.metrics.clip_bias_num_clipped),
            (1.0, 0)
        );
    }

    #[test]
    fn grad_space_norm_and_precomputed_scale() {
        // Parameters θ with logp = k·θ: ‖∇_θ S‖ = k·‖C_token‖ (∂S/∂logp_t = c_{i,t}).
        let old = t2(&[&[0.0; 7]]);
        let adv = t2(&[&[1.0, 1.0, 1.0, 0.0, 0.0, -1.0, -1.0]]);
        let m = t2(&[&MASK]);
        let c = PolicyLossConfig {
            clip_bias: Some(ClipBiasConfig {
                norm_space: ClipBiasSpace::Grad,
                ..inverse_norm()
            }),
            ..cfg("s_ppo")
        };
        for k in [1.0, 2.0] {
            let theta = var2(&[&[0.3 / k, 0.0, -0.1 / k, 0.0, 0.0, -0.4 / k, 0.05 / k]]);
            let lp = theta.as_tensor().affine(k, 0.0).unwrap();
            let params = [theta.clone()];
            let input = PolicyLossInput::new(&lp, &old, &adv, &m).with_params(&params);
            let o = PolicyLossKind::SPpo.compute(&input, &c).unwrap();
            let g = o.metrics.clip_bias_grad_norm.unwrap();
            assert!((g - k * 0.301426).abs() < 1e-6, "{k}: {g}");
            assert!((o.metrics.clip_bias_scale - 1.0 / g).abs() < 1e-9);
        }
        let lp = t2(&[&[0.3, 0.0, -0.1, 0.0, 0.0, -0.4, 0.05]]);
        let err = PolicyLossKind::SPpo
            .compute(&PolicyLossInput::new(&lp, &old, &adv, &m), &c)
            .unwrap_err();
        assert!(matches!(err, LossError::MissingInput { ref input, .. } if input == "params"));
        // A precomputed mini-batch scale replaces the local one.
        let input = PolicyLossInput::new(&lp, &old, &adv, &m).with_clip_bias_scale(2.0);
        let o = PolicyLossKind::SPpo
            .compute(&input, &with_clip_bias("s_ppo", inverse_norm()))
            .unwrap();
        let base = PolicyLossKind::Vanilla
            .compute(&input, &cfg("vanilla"))
            .unwrap();
        assert_eq!(o.metrics.clip_bias_scale, 2.0);
        assert!((scalar(&o.loss) - 2.0 * scalar(&base.loss)).abs() < 1e-12);
    }

    #[test]
    fn st_ppo_uses_turn_ratio_for_the_clipped_set() {
        // Turn 1 ratio exp(0.3) > 1.2 with A ≥ 0 → its 3 tokens are clipped; turn 2 is not.
        let old = t2(&[&[0.0; 7]]);
        let lp = t2(&[&[0.3, 0.3, 0.3, 0.0, 0.0, 0.0, 0.0]]);
        let adv = t2(&[&[1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]]);
        let m = t2(&[&MASK]);
        let literal = with_clip_bias(
            "st_ppo",
            ClipBiasConfig {
                ratio: ClipBiasRatio::Loss,
                ..inverse_norm()
            },
        );
        let o = PolicyLossKind::StPpo
            .compute(&PolicyLossInput::new(&lp, &old, &adv, &m), &literal)
            .unwrap();
        assert_eq!(o.metrics.clip_bias_num_clipped, 3);
        let w = 0.3f64.exp();
        let norm = (3.0 * (w / 5.0).powi(2)).sqrt();
        assert!((o.metrics.clip_bias_norm - norm).abs() < 1e-9);
        let plain = PolicyLossKind::Turn
            .compute(&PolicyLossInput::new(&lp, &old, &adv, &m), &cfg("turn"))
            .unwrap();
        assert!((scalar(&o.loss) - scalar(&plain.loss) / norm).abs() < 1e-9);
    }

    /// ST-PPO's default clipping error uses token ratios (Alg. 1): a turn whose ratio is 1
    /// (token log-ratios 0.3 and −0.3 cancel) is not clipped by the turn ratio, but its first
    /// token (ratio 1.35 > 1.2, Â > 0) is clipped by the token ratio and down-weights the sample.
    #[test]
    fn st_ppo_takes_its_clipping_error_from_token_ratios() {
        let old = t2(&[&[0.0; 7]]);
        let lp = t2(&[&[0.3, -0.3, 0.0, 0.0, 0.0, 0.0, 0.0]]);
        let adv = t2(&[&[1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]]);
        let m = t2(&[&MASK]);
        let input = PolicyLossInput::new(&lp, &old, &adv, &m);
        let o = PolicyLossKind::StPpo
            .compute(&input, &cfg("st_ppo"))
            .unwrap();
        assert_eq!(o.metrics.clip_bias_num_clipped, 1);
        let (w0, w1) = (0.3f64.exp(), (-0.3f64).exp());
        let rho = w0 / (w0 * w0 + w1 * w1 + 3.0).sqrt();
        assert!((o.metrics.clip_bias_scale - (1.0 - rho)).abs() < 1e-9);
        let plain = PolicyLossKind::Turn.compute(&input, &cfg("turn")).unwrap();
        assert!((scalar(&o.loss) - (1.0 - rho) * scalar(&plain.loss)).abs() < 1e-9);
        let by_turn = with_clip_bias(
            "st_ppo",
            ClipBiasConfig {
                ratio: ClipBiasRatio::Loss,
                ..ClipBiasConfig::default()
            },
        );
        let o = PolicyLossKind::StPpo.compute(&input, &by_turn).unwrap();
        assert_eq!(
            (o.metrics.clip_bias_num_clipped, o.metrics.clip_bias_scale),
            (0, 1.0)
        );
    }

    #[test]
    fn per_sample_clip_bias_scales_rows() {
        let old = t2(&[&[0.0; 7], &[0.0; 7]]);
        let lp = t2(&[&[0.3, 0.0, -0.1, 0.0, 0.0, -0.4, 0.05], &[0.0; 7]]);
        let adv = t2(&[&[1.0, 1.0, 1.0, 0.0, 0.0, -1.0, -1.0], &[1.0; 7]]);
        let m = t2(&[&MASK, &MASK]);
        let c = PolicyLossConfig {
            clip_bias: Some(ClipBiasConfig {
                norm_scope: ClipBiasScope::PerSample,
                ..inverse_norm()
            }),
            loss_agg_mode: Some(LossAggMode::SeqMeanTokenMean),
            ..cfg("vanilla")
        };
        let input = PolicyLossInput::new(&lp, &old, &adv, &m);
        let o = PolicyLossKind::Vanilla.compute(&input, &c).unwrap();
        let per = rows(&o.per_token_loss);
        let mean = |r: &[f64]| masked(r).iter().sum::<f64>() / 5.0;
        let want = 0.5 * (3.317559 * mean(&per[0]) + mean(&per[1]));
        assert!((scalar(&o.loss) - want).abs() < 1e-5);
        assert!((o.metrics.clip_bias_scale - (3.317559 + 1.0) / 2.0).abs() < 1e-6);
    }

    #[test]
    fn registry_names_and_unknown_error() {
        for name in POLICY_LOSS_NAMES {
            assert!(name.parse::<PolicyLossKind>().is_ok(), "{name}");
        }
        for (i, kind) in PolicyLossKind::ALL.into_iter().enumerate() {
            assert_eq!(LOSSES[i].kind, kind, "row {i} of LOSSES");
            assert_eq!(kind.name().parse::<PolicyLossKind>().unwrap(), kind);
        }
        let err = "ppo2".parse::<PolicyLossKind>().err().unwrap();
        let msg = err.to_string();
        assert!(msg.contains("ppo2") && msg.contains("gspo_turn"), "{msg}");
        let (lp, old, adv, m) = spec_traj();
        assert!(
            compute_policy_loss(&PolicyLossInput::new(&lp, &old, &adv, &m), &cfg("nope")).is_err()
        );
    }

    #[test]
    fn config_serde_defaults_and_validation() {
        let c: PolicyLossConfig = serde_json::from_str(
            r#"{"policy_loss":"st_ppo","clip_ratio":0.1,"loss_agg_mode":"token-mean","clip_bias":{"rule":"inverse_norm","max_scale":5.0}}"#,
        )
        .unwrap();
        let r = c.resolve().unwrap();
        assert_eq!(
            (r.kind, r.clip_low, r.clip_high),
            (PolicyLossKind::StPpo, 0.1, 0.1)
        );
        assert_eq!(r.agg_mode, LossAggMode::TokenMean);
        assert_eq!(r.ratio_form, RatioForm::Plain);
        assert_eq!(r.clip_bias.unwrap().max_scale, Some(5.0));
        assert!(serde_json::from_str::<PolicyLossConfig>(r#"{"clip_ratoi":0.2}"#).is_err());
        let g = cfg("gspo").resolve().unwrap();
        assert_eq!(
            (g.clip_low, g.clip_high, g.clip_ratio_c),
            (3e-4, 4e-4, None)
        );
        assert_eq!(g.agg_mode, LossAggMode::SeqMeanTokenMean);
        let bad = PolicyLossConfig {
            loss_agg_mode: Some(LossAggMode::TokenMean),
            ..cfg("gspo")
        };
        assert!(matches!(bad.resolve(), Err(LossError::InvalidConfig(_))));
        let bad_c = PolicyLossConfig {
            clip_ratio_c: Some(0.5),
            ..cfg("vanilla")
        };
        assert!(bad_c.resolve().is_err());
        assert_eq!(
            cfg("a2tgpo").resolve().unwrap().ratio_form,
            RatioForm::StopGradient
        );
        assert!(cfg("s_grpo").resolve().unwrap().clip_bias.is_some());
        let no_dual: PolicyLossConfig = serde_json::from_str(r#"{"clip_ratio_c":null}"#).unwrap();
        assert_eq!(no_dual.resolve().unwrap().clip_ratio_c, None);
        let js = serde_json::to_string(&c).unwrap();
        assert_eq!(serde_json::from_str::<PolicyLossConfig>(&js).unwrap(), c);
        assert!(cfg("dapo").resolve().unwrap().clip_bias.is_none());
    }

    #[test]
    fn non_finite_inputs_are_named() {
        let (lp, _, adv, m) = spec_traj();
        let old = t2(&[&[-1.0, f64::NAN, -1.0, -1.0, -1.0, -1.0, -1.0]]);
        let err = PolicyLossKind::Vanilla
            .compute(&PolicyLossInput::new(&lp, &old, &adv, &m), &cfg("vanilla"))
            .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("vanilla") && msg.contains("old_logp"), "{msg}");
        let inf_adv = t2(&[&[f64::INFINITY; 7]]);
        let err = PolicyLossKind::GspoTurn
            .compute(
                &PolicyLossInput::new(&lp, &lp, &inf_adv, &m),
                &cfg("gspo_turn"),
            )
            .unwrap_err();
        assert!(matches!(err, LossError::NonFinite { ref tensor, .. } if tensor == "advantages"));
        let short = t2(&[&[0.0; 3]]);
        let err = PolicyLossKind::Vanilla
            .compute(
                &PolicyLossInput::new(&lp, &short, &adv, &m),
                &cfg("vanilla"),
            )
            .unwrap_err();
        assert!(matches!(err, LossError::Shape { .. }));
    }

    #[test]
    fn f32_inputs_and_mixed_mask_dtype_work() {
        let (lp, old, adv, m) = spec_traj();
        let lp32 = lp.to_dtype(DType::F32).unwrap();
        let old32 = old.to_dtype(DType::F32).unwrap();
        let m32 = m.to_dtype(DType::F32).unwrap();
        let o = PolicyLossKind::Vanilla
            .compute(
                &PolicyLossInput::new(&lp32, &old32, &adv, &m32),
                &cfg("vanilla"),
            )
            .unwrap();
        assert_eq!(o.loss.dtype(), DType::F32);
        assert!((scalar(&o.loss) + 0.508665).abs() < 1e-5);
        let metrics = o.metrics.to_map();
        for k in [
            "actor/pg_clipfrac",
            "actor/pg_clipfrac_lower",
            "actor/ppo_kl",
            "actor/clip_bias_norm",
        ] {
            assert!(metrics.contains_key(k), "{k}");
        }
    }
}
