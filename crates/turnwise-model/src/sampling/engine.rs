//! A multi-turn, continuously batched sampling engine.
//!
//! [`SamplingEngine`] owns the key/value cache of a set of live sequences. Sequences join at any
//! time ([`SamplingEngine::add_sequence`]): at the next [`SamplingEngine::step`] they are
//! prefilled together (left-padded, per-row positions and key masks) and merged into the running
//! batch, while the rows already there keep decoding. A row leaves the batch when its turn ends
//! (a stop token, a stop string, a per-turn or per-trajectory token limit, the context length);
//! it is then *paused*: its cache rows are moved into a compact per-sequence cache, so that the
//! environment's observation can be appended ([`SamplingEngine::append_tokens`]) and the next
//! turn started ([`SamplingEngine::resume`]) with a prefill of only the new tokens. A paused
//! sequence forks cheaply into `k` sequences with their own seeds
//! ([`SamplingEngine::fork`], [`SamplingEngine::fork_prefix`]): candle tensors are immutable, so
//! the children share the parent's cache storage until they next join the batch.
//!
//! Every token records where it came from ([`TokenOrigin`]); every sampled or forced token records
//! its log-probability, the entropy of the distribution it came from, its top-j confidence
//! ([`top_j_confidence`], T2PO §6.2) and optionally the top log-probs. A [`TokenHook`] sees each
//! sequence before its token is drawn: it may edit the logits or force a token (T2PO thinking
//! intervention), which is then marked [`TokenOrigin::Forced`].
//!
//! Determinism: each sequence draws from its own [`TurnRng`], and the cache layout only adds
//! masked columns whose attention weight is exactly zero, so a sequence's tokens do not depend on
//! which other sequences share its batch, nor on whether its prefix came from the cache or from a
//! fresh prefill (logits agree to float rounding, about 1e-6).
//!
//! The engine borrows the model: build it with `Transformer::detached_from_varmap` so rollouts
//! see the latest optimizer step without copying weights and record no autograd graph.
//!
//! A search-agent loop:
//!
//! ```
//! use candle_core::{DType, Device};
//! use turnwise_model::model::weights::init_varmap;
//! use turnwise_model::sampling::{
//!     EngineConfig, SamplingEngine, SamplingParams, SequenceParams, StopReason,
//! };
//! use turnwise_model::{ModelConfig, Transformer};
//!
//! # fn main() -> turnwise_model::Result<()> {
//! let cfg = ModelConfig::tiny_qwen2(64);
//! let varmap = init_varmap(&cfg, DType::F32, &Device::Cpu, 0)?;
//! let model = Transformer::detached_from_varmap(&cfg, &varmap)?;
//! let mut engine = SamplingEngine::new(&model, None, EngineConfig::default());
//! let params = SequenceParams {
//!     sampling: SamplingParams { max_new_tokens: 8, stop_token_ids: vec![6], ..Default::default() },
//!     max_generated_tokens: Some(20),
//!     ..Default::default()
//! };
//! let ids: Vec<_> = (0..4u64)
//!     .map(|seed| engine.add_sequence(vec![1, 2, 3], params.clone(), seed))
//!     .collect::<Result<_, _>>()?;
//! while !engine.is_idle() {
//!     for end in engine.step(None)? {
//!         // e.g. `</search>` (id 6): append the observation and continue from the cache.
//!         if matches!(end.reason, StopReason::StopToken(6)) {
//!             engine.append_tokens(end.id, &[7, 40, 41, 8])?;
//!             engine.resume(end.id)?;
//!         }
//!     }
//! }
//! for id in ids {
//!     let seq = engine.sequence(id).unwrap();
//!     assert!(seq.num_generated() <= 20);
//!     assert_eq!(seq.logprobs.len(), seq.tokens.len());
//! }
//! # Ok(())
//! # }
//! ```

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use super::choice::{ChoiceConstraint, TokenPieces};
use super::{FinishReason, SamplingParams, TokenDraw, forced_row, sample_row, stop_string_hit};
use crate::error::{ModelError, Result};
use crate::model::cache::{LayerKv, SharedPrefixKv};
use crate::model::{KvCache, Transformer};
use crate::rng::TurnRng;
use crate::tokenizer::TextTokenizer;

mod prefix_cache;
pub use prefix_cache::{DEFAULT_BLOCK_TOKENS, PrefixCache, PrefixCacheConfig, PrefixCacheStats};
pub use speculative::SpeculativeConfig;

/// One layer's cached keys and values of one sequence, `[1, kv_heads, cols, head_dim]` each.
type SeqKv = (Tensor, Tensor);

/// Spare key/value columns the running batch keeps per layer: decoding writes into them in
/// place, and the cache is copied once every this many steps instead of on every step.
const KV_RESERVE: usize = 32;

/// Below this many logits in a step (rows × vocabulary), rows are drawn on the calling thread.
const PARALLEL_DRAW_MIN_ENTRIES: usize = 1 << 16;

/// One row's draw: its generator, sampling parameters, logits and the token it takes without
/// a draw (forced, or carried over from draft verification) with that token's origin.
type RowDraw<'a> = (
    &'a mut TurnRng,
    &'a SamplingParams,
    &'a [f32],
    Option<(u32, TokenOrigin)>,
);

/// A prefilled group: its cache layers, key masks and next-token logits, and the keys and
/// values every row of it sees before its own columns (one storage, when the group's rows
/// start from one shared prompt under [`EngineConfig::shared_prefix_attention`]).
type Prefilled = (
    Vec<LayerKv>,
    Vec<Vec<u8>>,
    Vec<Vec<f32>>,
    Option<(ShareKey, Vec<SeqKv>)>,
);

/// Keys and values of a context's first tokens, kept between engines (a multi-turn episode's
/// context between its turns): [`SamplingEngine::add_sequence_with_prefix`] starts a sequence
/// whose prompt begins with these tokens from them and prefills only the rest. Cloning shares
/// the tensors (candle tensors are immutable), so forks of an episode share its prefix.
#[derive(Clone)]
pub struct PrefixKv {
    tokens: Vec<u32>,
    layers: Vec<SeqKv>,
    /// Identifies the storage: every sequence started from this prefix (or a clone of it)
    /// holds views of the same tensors, which a memory budget counts once.
    share: ShareKey,
}

/// Identity of key/value storage several sequences hold views of (compared by address).
type ShareKey = Arc<()>;

impl PrefixKv {
    /// The tokens whose keys and values these are.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether it holds no token.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

impl std::fmt::Debug for PrefixKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixKv")
            .field("tokens", &self.tokens.len())
            .field("layers", &self.layers.len())
            .finish()
    }
}

/// Identifies a sequence of a [`SamplingEngine`] (allocated in increasing order from 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SeqId(pub u64);

impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// The spec's recommended top-j for the confidence of T2PO (§6.2).
pub const DEFAULT_CONFIDENCE_TOP_J: usize = 20;

fn default_top_j() -> usize {
    DEFAULT_CONFIDENCE_TOP_J
}

/// How one sequence is sampled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SequenceParams {
    /// Temperature, top-p, top-k, stop tokens and strings, top log-probs; `max_new_tokens` is
    /// the per-turn limit.
    pub sampling: SamplingParams,
    /// Most tokens generated (sampled or forced) over the whole trajectory, all turns together
    /// (`None`: no limit).
    #[serde(default)]
    pub max_generated_tokens: Option<usize>,
    /// Most tokens in the sequence, prompt and appended tokens included (`None`: only the
    /// model's `max_position_embeddings`).
    #[serde(default)]
    pub max_len: Option<usize>,
    /// `j` of the top-j confidence reported for every generated token (`0`: not computed,
    /// reported as 0).
    #[serde(default = "default_top_j")]
    pub confidence_top_j: usize,
    /// Constrained decoding by choice (vLLM's `guided_choice`, [`super::choice`]): each turn's
    /// output must be exactly one of these strings (`None`: unconstrained). Needs the engine's
    /// tokenizer. The reported log-probs are those of the constrained distribution (the
    /// temperature-scaled softmax over the allowed tokens only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guided_choice: Option<Vec<String>>,
    /// The sequence ends with its first turn (a server's request): the turn's end keeps no
    /// copy of its keys and values out of the batch (the prefix cache, if any, still gets
    /// them), so a resumed sequence would prefill its whole context again. Saves copying every
    /// finished sequence's cache, a shared prompt's included.
    #[serde(default)]
    pub single_turn: bool,
}

impl Default for SequenceParams {
    fn default() -> Self {
        Self {
            sampling: SamplingParams::default(),
            max_generated_tokens: None,
            max_len: None,
            confidence_top_j: DEFAULT_CONFIDENCE_TOP_J,
            guided_choice: None,
            single_turn: false,
        }
    }
}

impl From<SamplingParams> for SequenceParams {
    fn from(sampling: SamplingParams) -> Self {
        Self {
            sampling,
            ..Default::default()
        }
    }
}

impl SequenceParams {
    /// Checks the values.
    pub fn validate(&self) -> Result<()> {
        self.sampling.validate()
    }

    /// The parameters handed to [`sample_row`]: enough top log-probs for the confidence.
    fn draw_params(&self) -> SamplingParams {
        let mut p = self.sampling.clone();
        p.top_logprobs = p.top_logprobs.max(self.confidence_top_j);
        p
    }
}

/// Where a token of a sequence came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TokenOrigin {
    /// Part of the prompt given to [`SamplingEngine::add_sequence`].
    Prompt,
    /// Drawn from the policy.
    Sampled,
    /// Forced by a [`TokenHook`] (not drawn from the policy).
    Forced,
    /// Appended by the caller between turns (an environment observation).
    Appended,
}

/// Why a sequence's turn ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StopReason {
    /// A stop token was generated (kept in the sequence).
    StopToken(u32),
    /// The turn's decoded text contains `stop_strings[i]`.
    StopString(usize),
    /// The turn generated `max_new_tokens` tokens.
    TurnLimit,
    /// The trajectory generated `max_generated_tokens` tokens.
    TrajectoryLimit,
    /// The sequence reached `max_len` tokens.
    SequenceLimit,
    /// The sequence reached the model's `max_position_embeddings`.
    ContextFull,
    /// The turn's text equals one of its `guided_choice` strings and no longer choice extends
    /// it.
    ChoiceComplete,
}

impl StopReason {
    /// The single-turn [`FinishReason`] this maps to (every limit but the context is `Length`).
    pub fn finish_reason(&self) -> FinishReason {
        match self {
            Self::StopToken(t) => FinishReason::StopToken(*t),
            Self::StopString(i) => FinishReason::StopString(*i),
            Self::TurnLimit | Self::TrajectoryLimit | Self::SequenceLimit => FinishReason::Length,
            Self::ContextFull => FinishReason::ContextFull,
            Self::ChoiceComplete => FinishReason::ChoiceComplete,
        }
    }

    /// Whether the sequence cannot generate any further (a trajectory or length limit).
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            Self::TrajectoryLimit | Self::SequenceLimit | Self::ContextFull
        )
    }
}

/// Where a sequence is in its life.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SeqStatus {
    /// Queued: joins the batch at the next step with free room.
    Waiting,
    /// In the batch, generating.
    Running,
    /// Its last turn ended for this reason; it keeps its cache until removed.
    Paused(StopReason),
}

/// A sequence: every token (prompt, generated, appended) with per-token records aligned to
/// `tokens` (non-generated tokens have log-prob, entropy and confidence 0 and no top log-probs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sequence {
    /// The sequence's id.
    pub id: SeqId,
    /// All tokens, in order.
    pub tokens: Vec<u32>,
    /// Where each token came from.
    pub origins: Vec<TokenOrigin>,
    /// Log-probability of each generated token under its (temperature-scaled, hook-edited)
    /// distribution.
    pub logprobs: Vec<f32>,
    /// Entropy of the distribution each generated token came from.
    pub entropies: Vec<f32>,
    /// Top-j confidence ([`top_j_confidence`]) of that distribution.
    pub confidences: Vec<f32>,
    /// The `top_logprobs` most likely `(token, log-prob)` pairs of that distribution.
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// Length of the prompt.
    pub prompt_len: usize,
    /// Index of the first token of the current (or last) turn.
    pub turn_start: usize,
    /// Number of turns started.
    pub turns: usize,
    /// Where the sequence is.
    pub status: SeqStatus,
    /// How it is sampled.
    pub params: SequenceParams,
}

impl Sequence {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the sequence has no tokens (never true for an engine's sequence).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The tokens of the current (or last) turn.
    pub fn turn_tokens(&self) -> &[u32] {
        &self.tokens[self.turn_start..]
    }

    /// Number of generated (sampled or forced) tokens over all turns.
    pub fn num_generated(&self) -> usize {
        self.origins
            .iter()
            .filter(|o| matches!(o, TokenOrigin::Sampled | TokenOrigin::Forced))
            .count()
    }

    /// Number of forced tokens.
    pub fn num_forced(&self) -> usize {
        self.origins
            .iter()
            .filter(|o| **o == TokenOrigin::Forced)
            .count()
    }

    fn push(&mut self, token: u32, origin: TokenOrigin, draw: Option<(&TokenDraw, f32)>) {
        self.tokens.push(token);
        self.origins.push(origin);
        match draw {
            Some((d, conf)) => {
                self.logprobs.push(d.logprob);
                self.entropies.push(d.entropy);
                self.confidences.push(conf);
                self.top_logprobs.push(d.top.clone());
            }
            None => {
                self.logprobs.push(0.0);
                self.entropies.push(0.0);
                self.confidences.push(0.0);
                self.top_logprobs.push(Vec::new());
            }
        }
    }

    fn truncate(&mut self, len: usize) {
        self.tokens.truncate(len);
        self.origins.truncate(len);
        self.logprobs.truncate(len);
        self.entropies.truncate(len);
        self.confidences.truncate(len);
        self.top_logprobs.truncate(len);
        self.turn_start = self.turn_start.min(len);
        self.prompt_len = self.prompt_len.min(len);
    }
}

/// A turn that ended during a [`SamplingEngine::step`]: `tokens[start..end]` of sequence `id`
/// were generated in it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TurnEnd {
    /// The sequence.
    pub id: SeqId,
    /// Why the turn ended.
    pub reason: StopReason,
    /// Index of the turn's first token.
    pub start: usize,
    /// One past its last token (the sequence's length).
    pub end: usize,
}

/// Sees every running sequence before its next token is drawn.
pub trait TokenHook {
    /// May edit `logits` (length `vocab_size`; `f32::NEG_INFINITY` forbids a token) and may
    /// return a token to force instead of sampling (no random number is drawn then). The
    /// reported statistics are those of the edited distribution.
    fn process(&mut self, seq: &Sequence, logits: &mut [f32]) -> Option<u32>;
}

impl<F: FnMut(&Sequence, &mut [f32]) -> Option<u32>> TokenHook for F {
    fn process(&mut self, seq: &Sequence, logits: &mut [f32]) -> Option<u32> {
        self(seq, logits)
    }
}

/// Top-j confidence (T2PO §6.2, DeepConf): `C = −(1/j) Σ_{i≤j} log p⁽ⁱ⁾` over the `j` largest
/// log-probabilities in `top` (sorted, most likely first); only finite entries count, so a
/// distribution with fewer than `j` allowed tokens averages over those. `0` when `j == 0` or
/// nothing is finite. Larger means more peaked.
pub fn top_j_confidence(top: &[(u32, f32)], j: usize) -> f32 {
    let vals: Vec<f64> = top
        .iter()
        .take(j)
        .map(|p| p.1 as f64)
        .filter(|x| x.is_finite())
        .collect();
    if vals.is_empty() {
        return 0.0;
    }
    (-vals.iter().sum::<f64>() / vals.len() as f64) as f32
}

/// Tokens of one sequence prefilled per step by default ([`EngineConfig::prefill_chunk`]).
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

/// Engine-wide settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineConfig {
    /// Most sequences decoding at once (`0`: unlimited); the others wait in arrival order.
    pub max_batch_size: usize,
    /// Bytes the key/value cache and the prefill's activations may take together (`None`:
    /// unlimited). Waiting sequences join the batch while the estimate
    /// ([`SamplingEngine::memory_estimate`]) stays within it and wait otherwise; a sequence that
    /// alone could never fit is refused by [`SamplingEngine::add_sequence`] with an error naming
    /// `memory_budget`.
    #[serde(default)]
    pub memory_budget: Option<u64>,
    /// Most uncached tokens of one sequence run through the model in one step (`0`: all at
    /// once). A longer prompt is prefilled a chunk per step, on its own, while the batch keeps
    /// decoding: its attention scores are `chunk × context` instead of `context²`, and a
    /// sequence removed between steps (its client gone) stops at the next chunk.
    #[serde(default = "default_prefill_chunk")]
    pub prefill_chunk: usize,
    /// Prefill a prompt that several waiting sequences share once: when the sequence first in
    /// line has uncached tokens and other waiting sequences hold the same tokens (the `n`
    /// samples of one prompt), all but its last token are prefilled for it alone (a chunk per
    /// step), and the others start from views of those keys and values
    /// ([`SamplingEngine::add_sequence_with_prefix`]'s mechanism), so each prefills only the
    /// last token. The memory budget counts the shared columns once while they wait. `false`:
    /// every sequence prefills its own prompt (callers that share prompts themselves, as the
    /// trainer's rollouts do with [`super::prefill_prefix`]).
    #[serde(default)]
    pub share_prompts: bool,
    /// Keep prompts' and turns' keys and values across sequences in a [`PrefixCache`] (`None`:
    /// none). A sequence that joins with nothing cached starts from the longest run of cached
    /// whole blocks its tokens begin with; every prefill and every ended turn caches its whole
    /// blocks. The cache's bytes count in [`EngineConfig::memory_budget`], and its least
    /// recently used blocks are evicted when the budget needs the room.
    #[serde(default)]
    pub prefix_cache: Option<PrefixCacheConfig>,
    /// Lossless speculative decoding by prompt lookup ([`SpeculativeConfig`]): a step with no
    /// [`TokenHook`] drafts each row's next tokens from its own earlier tokens and verifies
    /// them in the same forward as the row's new token. Greedy output is identical to plain
    /// decoding and sampled output is drawn from exactly the policy's distribution, with the
    /// policy's own log-probs. `None`: one token per row per step.
    #[serde(default)]
    pub speculative: Option<SpeculativeConfig>,
    /// Cascade attention over a shared prompt: when a group of sequences that start from one
    /// prompt's keys and values (the `n` samples of a request under
    /// [`EngineConfig::share_prompts`], or sequences started from one [`PrefixKv`]) joins the
    /// batch, the batch keeps those keys and values once instead of a copy per row, and every
    /// step's attention reads them once for all the rows that share them
    /// ([`crate::model::ops::attention::attention_with_shared`]). Same results up to float
    /// rounding (the attention's sums are split differently). The batch holds any number of
    /// shared prompts, each read for its own rows; a waiting sequence that begins with one of
    /// them starts from it and joins its rows, and an admission group holds one prompt's
    /// sequences (a mixed group would copy every prompt per row).
    #[serde(default)]
    pub shared_prefix_attention: bool,
    /// Batch-invariant inference ([`crate::model::ops::with_batch_invariant`]) for every
    /// forward the engine runs: a sequence's logits and keys and values are the same bits
    /// whatever else the batch holds, however its prompt is split into chunks, whether its
    /// prefix comes from the [`PrefixCache`], a shared prompt (cascade) or its own prefill, and
    /// whether its tokens are decoded one per step or verified as drafts. Costs prefill speed:
    /// every linear layer runs the few-row kernel instead of `gemm` above
    /// [`crate::model::ops::infer::LINEAR_MAX_ROWS`] rows, and attention the invariant
    /// kernel. `false`: the fastest kernels, whose sums depend on those shapes (1e-6).
    #[serde(default)]
    pub batch_invariant: bool,
}

fn default_prefill_chunk() -> usize {
    DEFAULT_PREFILL_CHUNK
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_batch_size: 64,
            memory_budget: None,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            share_prompts: false,
            prefix_cache: None,
            speculative: None,
            shared_prefix_attention: false,
            batch_invariant: false,
        }
    }
}

impl EngineConfig {
    /// The default settings with at most `max_batch_size` sequences decoding at once (`0`:
    /// unlimited).
    pub fn with_max_batch_size(max_batch_size: usize) -> Self {
        Self {
            max_batch_size,
            ..Self::default()
        }
    }

    /// Checks the values (errors name the key, e.g. `speculative.max_draft`).
    pub fn validate(&self) -> Result<()> {
        if self
            .prefix_cache
            .as_ref()
            .is_some_and(|c| c.block_tokens == 0)
        {
            return Err(ModelError::invalid_input(
                "prefix_cache.block_tokens",
                "must be at least 1",
            ));
        }
        match &self.speculative {
            Some(s) => s.validate(),
            None => Ok(()),
        }
    }
}

/// Running totals of the work an engine has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineStats {
    /// Calls to [`SamplingEngine::step`] that ran the model.
    pub steps: u64,
    /// Real (non-padding) tokens run through the model by prefills.
    pub prefill_tokens: u64,
    /// Tokens run through the model one position per row (decoding).
    pub decode_tokens: u64,
    /// Tokens drawn from the policy.
    pub sampled_tokens: u64,
    /// Tokens forced by a hook.
    pub forced_tokens: u64,
    /// Draft tokens proposed by speculative decoding and run through the model for
    /// verification ([`EngineConfig::speculative`]).
    #[serde(default)]
    pub drafted_tokens: u64,
    /// Draft tokens the verification accepted (also counted in `sampled_tokens`);
    /// `accepted_tokens / drafted_tokens` is the acceptance rate.
    #[serde(default)]
    pub accepted_tokens: u64,
}

struct SeqState {
    seq: Sequence,
    rng: TurnRng,
    draw: SamplingParams,
    /// Compact cache `[1, kv, cached, d]` per layer of `tokens[..cached]` while not running.
    cache: Option<Vec<SeqKv>>,
    cached: usize,
    /// While a long prompt is prefilled a chunk per step: the buffers `cache` views, with room
    /// for the whole prompt and [`KV_RESERVE`] decoding steps, so that each chunk, the last
    /// one and the first decoding steps write into them in place instead of copying the cache
    /// (which would hold two copies of a long prompt's cache at once). Held by no one else.
    room: Option<Vec<LayerKv>>,
    /// Generated (sampled or forced) tokens over all turns.
    generated: usize,
    /// The compiled `guided_choice` of its parameters.
    choice: Option<ChoiceConstraint>,
    /// The leading columns of `cache` whose storage other sequences hold views of too (a
    /// shared prompt, a fork's parent), and its identity: the memory budget counts them once.
    shared: Option<(ShareKey, usize)>,
    /// Whether the prefix cache was asked for its tokens (once, when it first comes up to join
    /// the batch with nothing cached).
    looked_up: bool,
}

/// The running rows: row `r` is sequence `rows[r]`, its cache row `r` and key mask `mask[r]`,
/// and `logits[r]` its next-token logits.
#[derive(Default)]
struct Batch {
    rows: Vec<SeqId>,
    layers: Option<Vec<LayerKv>>,
    mask: Vec<Vec<u8>>,
    logits: Vec<Vec<f32>>,
    /// Keys and values some rows see before their own columns, one entry per shared prompt
    /// ([`EngineConfig::shared_prefix_attention`]; a row in one at most).
    shared: Vec<BatchShared>,
}

/// A shared prompt's keys and values `[1, kv, len, d]` per layer, held once by the batch, and
/// which rows start from them (row `r`'s cache is these columns followed by its own).
struct BatchShared {
    /// The storage's identity (the sequences' [`SeqState::shared`] key).
    key: ShareKey,
    /// The tokens whose keys and values these are.
    tokens: Vec<u32>,
    layers: Vec<SeqKv>,
    rows: Vec<bool>,
}

impl BatchShared {
    /// The shared prompt's length.
    fn len(&self) -> usize {
        self.tokens.len()
    }
}

impl Batch {
    fn width(&self) -> usize {
        self.mask.first().map_or(0, Vec::len)
    }
}

/// A continuously batched, multi-turn sampler over a caller-chosen model; see the module docs.
pub struct SamplingEngine<'a> {
    model: &'a Transformer,
    tokenizer: Option<&'a TextTokenizer>,
    config: EngineConfig,
    seqs: BTreeMap<SeqId, SeqState>,
    waiting: VecDeque<SeqId>,
    batch: Batch,
    next_id: u64,
    poisoned: bool,
    stats: EngineStats,
    /// The tokens' texts for `guided_choice`, built from the tokenizer when first needed.
    pieces: Option<Arc<TokenPieces>>,
    /// Keys and values kept across sequences ([`EngineConfig::prefix_cache`]).
    prefix_cache: Option<PrefixCache>,
    /// Running rows whose next token the last step's draft verification already drew (the
    /// draw that rejected a draft, [`speculative`]); their next step takes it without a draw.
    carried: BTreeMap<SeqId, u32>,
}

impl<'a> SamplingEngine<'a> {
    /// An empty engine. `tokenizer` is needed only for stop strings.
    pub fn new(
        model: &'a Transformer,
        tokenizer: Option<&'a TextTokenizer>,
        config: EngineConfig,
    ) -> Self {
        if model.tracks_gradients() {
            tracing::warn!(
                "sampling with a gradient-tracking model records a useless autograd graph \
                 (several times the memory, slower); build it with \
                 Transformer::detached_from_varmap"
            );
        }
        // A block of no tokens is refused by `EngineConfig::validate` at the first sequence.
        let prefix_cache = config.prefix_cache.clone().map(|mut c| {
            c.block_tokens = c.block_tokens.max(1);
            PrefixCache::new(c).expect("a block of at least one token")
        });
        Self {
            model,
            tokenizer,
            config,
            prefix_cache,
            seqs: BTreeMap::new(),
            waiting: VecDeque::new(),
            batch: Batch::default(),
            next_id: 0,
            poisoned: false,
            stats: EngineStats::default(),
            pieces: None,
            carried: BTreeMap::new(),
        }
    }

    /// Uses `pieces` (built from this engine's tokenizer, e.g. by an earlier engine over the
    /// same tokenizer) for `guided_choice` instead of building them again.
    pub fn with_token_pieces(mut self, pieces: Option<Arc<TokenPieces>>) -> Self {
        if self.pieces.is_none() {
            self.pieces = pieces;
        }
        self
    }

    /// Uses `cache` as this engine's prefix cache (e.g. one kept by a server across engines: it
    /// must hold keys and values of this engine's weights; see [`PrefixCache::for_weights`]).
    pub fn with_prefix_cache(mut self, cache: Option<PrefixCache>) -> Self {
        if cache.is_some() {
            self.prefix_cache = cache;
        }
        self
    }

    /// Takes the prefix cache out of the engine (which then caches nothing).
    pub fn take_prefix_cache(&mut self) -> Option<PrefixCache> {
        self.prefix_cache.take()
    }

    /// What the prefix cache has done and holds, if the engine has one.
    pub fn prefix_cache_stats(&self) -> Option<PrefixCacheStats> {
        self.prefix_cache.as_ref().map(PrefixCache::stats)
    }

    /// The tokens' texts used by `guided_choice`, if built yet.
    pub fn token_pieces(&self) -> Option<Arc<TokenPieces>> {
        self.pieces.clone()
    }

    /// Compiles the `guided_choice` of `params`, if any.
    fn compile_choice(&mut self, params: &SequenceParams) -> Result<Option<ChoiceConstraint>> {
        let Some(choices) = &params.guided_choice else {
            return Ok(None);
        };
        let Some(tokenizer) = self.tokenizer else {
            return Err(ModelError::invalid_input(
                "guided_choice",
                "constrained decoding needs the engine's tokenizer",
            ));
        };
        let vocab = self.model.config().vocab_size;
        let pieces = self
            .pieces
            .get_or_insert_with(|| Arc::new(TokenPieces::from_tokenizer(tokenizer, vocab)));
        ChoiceConstraint::new(choices, Arc::clone(pieces)).map(Some)
    }

    /// The model sampled from.
    pub fn model(&self) -> &Transformer {
        self.model
    }

    /// Queues a new sequence with prompt `prompt`, drawing from a generator seeded with `seed`.
    pub fn add_sequence(
        &mut self,
        prompt: Vec<u32>,
        params: SequenceParams,
        seed: u64,
    ) -> Result<SeqId> {
        self.add_sequence_with_rng(prompt, params, TurnRng::seed_from_u64(seed))
    }

    /// [`SamplingEngine::add_sequence`] with an explicit generator state.
    pub fn add_sequence_with_rng(
        &mut self,
        prompt: Vec<u32>,
        params: SequenceParams,
        rng: TurnRng,
    ) -> Result<SeqId> {
        self.config.validate()?;
        params.validate()?;
        if prompt.is_empty() {
            return Err(ModelError::invalid_input("prompt", "is empty"));
        }
        self.check_ids("prompt", &prompt)?;
        if !params.sampling.stop_strings.is_empty() && self.tokenizer.is_none() {
            return Err(ModelError::invalid_input(
                "tokenizer",
                "stop strings need a tokenizer",
            ));
        }
        self.check_alone_fits(prompt.len(), &params)?;
        let choice = self.compile_choice(&params)?;
        let id = SeqId(self.next_id);
        self.next_id += 1;
        let n = prompt.len();
        let seq = Sequence {
            id,
            origins: vec![TokenOrigin::Prompt; n],
            logprobs: vec![0.0; n],
            entropies: vec![0.0; n],
            confidences: vec![0.0; n],
            top_logprobs: vec![Vec::new(); n],
            tokens: prompt,
            prompt_len: n,
            turn_start: n,
            turns: 1,
            status: SeqStatus::Waiting,
            params,
        };
        self.seqs.insert(
            id,
            SeqState {
                draw: seq.params.draw_params(),
                seq,
                rng,
                cache: None,
                cached: 0,
                room: None,
                generated: 0,
                choice,
                shared: None,
                looked_up: false,
            },
        );
        self.waiting.push_back(id);
        Ok(id)
    }

    /// [`SamplingEngine::add_sequence`], starting from `prefix`'s keys and values for the
    /// longest common prefix of its tokens and `prompt` (all but the prompt's last token at
    /// most: that one is run to give the first logits). A prefix of another model shape is an
    /// error naming `prefix`.
    pub fn add_sequence_with_prefix(
        &mut self,
        prompt: Vec<u32>,
        params: SequenceParams,
        seed: u64,
        prefix: Option<&PrefixKv>,
    ) -> Result<SeqId> {
        let id = self.add_sequence(prompt, params, seed)?;
        if let Some(p) = prefix
            && let Err(e) = self.attach_prefix(id, p)
        {
            let _ = self.remove(id);
            return Err(e);
        }
        Ok(id)
    }

    fn attach_prefix(&mut self, id: SeqId, p: &PrefixKv) -> Result<()> {
        let cfg = self.model.config();
        let (layers, kv, hd) = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim);
        let st = self.seqs.get_mut(&id).expect("just added");
        let n = p
            .tokens
            .iter()
            .zip(&st.seq.tokens)
            .take_while(|(a, b)| a == b)
            .count()
            .min(st.seq.tokens.len() - 1);
        if n == 0 {
            return Ok(());
        }
        if p.layers.len() != layers {
            return Err(ModelError::invalid_input(
                "prefix",
                format!("{} layers, the model has {layers}", p.layers.len()),
            ));
        }
        let mut cache = Vec::with_capacity(layers);
        for (k, v) in &p.layers {
            let (b, h, cols, d) = k.dims4()?;
            if (b, h, d) != (1, kv, hd) || cols != p.tokens.len() || v.dims4()? != k.dims4()? {
                return Err(ModelError::invalid_input(
                    "prefix",
                    format!(
                        "keys {:?} do not fit the model's [1, {kv}, {}, {hd}]",
                        k.dims(),
                        p.tokens.len()
                    ),
                ));
            }
            cache.push(if n == cols {
                (k.clone(), v.clone())
            } else {
                (k.narrow(2, 0, n)?, v.narrow(2, 0, n)?)
            });
        }
        st.cache = Some(cache);
        st.cached = n;
        st.room = None;
        st.shared = Some((Arc::clone(&p.share), n));
        Ok(())
    }

    /// The keys and values a paused or waiting sequence has cached (its first
    /// [`SamplingEngine::cached_len`] tokens), to start a later sequence from
    /// ([`SamplingEngine::add_sequence_with_prefix`]); `None` while it runs or caches nothing.
    pub fn prefix_of(&self, id: SeqId) -> Option<PrefixKv> {
        let st = self.seqs.get(&id)?;
        if st.seq.status == SeqStatus::Running || st.cached == 0 {
            return None;
        }
        Some(PrefixKv {
            tokens: st.seq.tokens[..st.cached].to_vec(),
            layers: st.cache.clone()?,
            share: st
                .shared
                .as_ref()
                .filter(|(_, cols)| *cols == st.cached)
                .map_or_else(|| Arc::new(()), |(key, _)| Arc::clone(key)),
        })
    }

    /// Appends `tokens` (e.g. an environment observation) to a paused or waiting sequence,
    /// marked [`TokenOrigin::Appended`]. Its cache is kept: only these tokens are prefilled when
    /// it next runs.
    pub fn append_tokens(&mut self, id: SeqId, tokens: &[u32]) -> Result<()> {
        self.check_ids("tokens", tokens)?;
        let st = self.state_mut(id)?;
        if st.seq.status == SeqStatus::Running {
            return Err(ModelError::invalid_input(
                "id",
                format!("sequence {id} is running; append once its turn ends"),
            ));
        }
        for &t in tokens {
            st.seq.push(t, TokenOrigin::Appended, None);
        }
        Ok(())
    }

    /// Starts a new turn of a paused sequence: it waits for room in the batch, then generates
    /// until its next stop.
    pub fn resume(&mut self, id: SeqId) -> Result<()> {
        let st = self.state_mut(id)?;
        if !matches!(st.seq.status, SeqStatus::Paused(_)) {
            return Err(ModelError::invalid_input(
                "id",
                format!("sequence {id} is not paused ({:?})", st.seq.status),
            ));
        }
        st.seq.status = SeqStatus::Waiting;
        st.seq.turn_start = st.seq.tokens.len();
        st.seq.turns += 1;
        self.waiting.push_back(id);
        Ok(())
    }

    /// Replaces the sampling parameters of a sequence that is not running.
    pub fn set_params(&mut self, id: SeqId, params: SequenceParams) -> Result<()> {
        params.validate()?;
        if !params.sampling.stop_strings.is_empty() && self.tokenizer.is_none() {
            return Err(ModelError::invalid_input(
                "tokenizer",
                "stop strings need a tokenizer",
            ));
        }
        if self.state(id)?.seq.status == SeqStatus::Running {
            return Err(ModelError::invalid_input(
                "id",
                format!("sequence {id} is running"),
            ));
        }
        let choice = self.compile_choice(&params)?;
        let st = self.state_mut(id)?;
        st.choice = choice;
        st.draw = params.draw_params();
        st.seq.params = params;
        Ok(())
    }

    /// Forks a paused sequence into one child per seed: same tokens, records, status and
    /// parameters, a shared (copy-on-join) cache, and a generator seeded from its seed.
    pub fn fork(&mut self, id: SeqId, seeds: &[u64]) -> Result<Vec<SeqId>> {
        let len = self.state(id)?.seq.tokens.len();
        self.fork_prefix(id, len, seeds)
    }

    /// Forks the first `len` tokens of a paused sequence into one child per seed (e.g. to
    /// re-sample its last turn: `len = seq.turn_start`). The children's status is the parent's.
    pub fn fork_prefix(&mut self, id: SeqId, len: usize, seeds: &[u64]) -> Result<Vec<SeqId>> {
        let parent = self.state(id)?;
        if !matches!(parent.seq.status, SeqStatus::Paused(_)) {
            return Err(ModelError::invalid_input(
                "id",
                format!(
                    "sequence {id} must be paused to fork ({:?})",
                    parent.seq.status
                ),
            ));
        }
        if len == 0 || len > parent.seq.tokens.len() {
            return Err(ModelError::invalid_input(
                "len",
                format!(
                    "prefix length {len} outside 1..={}",
                    parent.seq.tokens.len()
                ),
            ));
        }
        let cached = parent.cached.min(len - 1);
        let cache = match (&parent.cache, cached) {
            (Some(layers), c) if c > 0 => Some(
                layers
                    .iter()
                    .map(|(k, v)| Ok((k.narrow(2, 0, c)?, v.narrow(2, 0, c)?)))
                    .collect::<Result<Vec<_>>>()?,
            ),
            _ => None,
        };
        // The children hold views of the parent's first `cached` columns: one storage, which
        // the budget counts once (under the parent's key when it already shares them).
        let shared = match (&cache, &parent.shared) {
            (None, _) => None,
            (Some(_), Some((key, cols))) => Some((Arc::clone(key), (*cols).min(cached))),
            (Some(_), None) => Some((Arc::new(()), cached)),
        };
        let mut seq = parent.seq.clone();
        seq.truncate(len);
        let generated = seq.num_generated();
        let draw = parent.draw.clone();
        let choice = parent.choice.clone();
        if let Some((key, cols)) = &shared
            && self.seqs[&id].shared.is_none()
        {
            self.state_mut(id)?.shared = Some((Arc::clone(key), *cols));
        }
        let mut ids = Vec::with_capacity(seeds.len());
        for &seed in seeds {
            let child = SeqId(self.next_id);
            self.next_id += 1;
            let mut s = seq.clone();
            s.id = child;
            self.seqs.insert(
                child,
                SeqState {
                    seq: s,
                    rng: TurnRng::seed_from_u64(seed),
                    draw: draw.clone(),
                    cache: cache.clone(),
                    cached: if cache.is_some() { cached } else { 0 },
                    room: None,
                    generated,
                    choice: choice.clone(),
                    shared: shared.clone(),
                    looked_up: false,
                },
            );
            ids.push(child);
        }
        Ok(ids)
    }

    /// Removes a sequence (stopping it if running) and returns it.
    pub fn remove(&mut self, id: SeqId) -> Result<Sequence> {
        let status = self.state(id)?.seq.status.clone();
        match status {
            SeqStatus::Running => {
                let r = self.row_of(id)?;
                let keep: Vec<usize> = (0..self.batch.rows.len()).filter(|&x| x != r).collect();
                self.keep_rows(&keep)?;
            }
            SeqStatus::Waiting => self.waiting.retain(|&w| w != id),
            SeqStatus::Paused(_) => {}
        }
        self.carried.remove(&id);
        Ok(self.seqs.remove(&id).map(|s| s.seq).expect("checked above"))
    }

    /// The sequence `id`, if it exists.
    pub fn sequence(&self, id: SeqId) -> Option<&Sequence> {
        self.seqs.get(&id).map(|s| &s.seq)
    }

    /// The generator state of sequence `id`.
    pub fn rng(&self, id: SeqId) -> Option<&TurnRng> {
        self.seqs.get(&id).map(|s| &s.rng)
    }

    /// Number of leading tokens of a non-running sequence whose keys and values are cached.
    pub fn cached_len(&self, id: SeqId) -> Option<usize> {
        self.seqs.get(&id).map(|s| s.cached)
    }

    /// Every sequence id, in increasing order.
    pub fn ids(&self) -> Vec<SeqId> {
        self.seqs.keys().copied().collect()
    }

    /// Ids of the running sequences, in batch-row order.
    pub fn running(&self) -> &[SeqId] {
        &self.batch.rows
    }

    /// Number of sequences waiting to join the batch.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether no sequence is running or waiting.
    pub fn is_idle(&self) -> bool {
        self.batch.rows.is_empty() && self.waiting.is_empty()
    }

    /// Work done so far.
    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// Number of key/value columns of the running batch (real tokens plus padding).
    pub fn batch_width(&self) -> usize {
        self.batch.width()
    }

    /// One decoding step: admits waiting sequences while there is room (prefilling their
    /// uncached tokens), draws one token for every running sequence (asking `hook` first),
    /// moves the sequences whose turn ended out of the batch and runs the others' new tokens
    /// through the model. Returns the turns that ended, in id order.
    ///
    /// After an error the engine refuses further steps.
    pub fn step(&mut self, hook: Option<&mut dyn TokenHook>) -> Result<Vec<TurnEnd>> {
        if self.poisoned {
            return Err(ModelError::invalid_input(
                "engine",
                "a previous step failed; the engine's state is inconsistent",
            ));
        }
        let invariant = self.config.batch_invariant;
        let r = crate::model::ops::with_batch_invariant(invariant, || self.step_inner(hook));
        if r.is_err() {
            self.poisoned = true;
        }
        r
    }

    /// Steps until no sequence is running or waiting; returns every turn that ended.
    pub fn run_until_stop(&mut self, mut hook: Option<&mut dyn TokenHook>) -> Result<Vec<TurnEnd>> {
        let mut ends = Vec::new();
        while !self.is_idle() {
            let h: Option<&mut dyn TokenHook> = match hook {
                Some(ref mut h) => Some(&mut **h),
                None => None,
            };
            ends.extend(self.step(h)?);
        }
        Ok(ends)
    }

    fn step_inner(&mut self, mut hook: Option<&mut dyn TokenHook>) -> Result<Vec<TurnEnd>> {
        let mut ends = Vec::new();
        let ran = self.admit(&mut ends)?;
        if self.batch.rows.is_empty() {
            if ran {
                self.stats.steps += 1;
            }
            ends.sort_by_key(|e| e.id);
            return Ok(ends);
        }
        self.stats.steps += 1;
        let max_pos = self.model.config().max_position_embeddings;
        let vocab = self.model.config().vocab_size as u32;
        let mut all_logits = std::mem::take(&mut self.batch.logits);
        let n = all_logits.len();
        // 1. The hook sees every row in row order (it may keep state across rows).
        let mut forced = Vec::with_capacity(n);
        for (r, logits) in all_logits.iter_mut().enumerate() {
            let id = self.batch.rows[r];
            let st = &self.seqs[&id];
            let carried = speculative::take_carried(&mut self.carried, id, hook.is_some(), logits);
            let f = match hook.as_deref_mut() {
                Some(h) => h.process(&st.seq, logits),
                None => None,
            };
            // `guided_choice`: forbid what cannot continue a choice, before any sampling rule.
            if let Some(c) = &st.choice {
                let text = c.text_of(st.seq.turn_tokens());
                c.mask(&text, &st.seq.params.sampling.stop_token_ids, logits);
            }
            if !logits.iter().any(|x| x.is_finite()) {
                return Err(ModelError::invalid_input(
                    "processor",
                    format!(
                        "the logits processor forbade every token of sequence {}",
                        id.0
                    ),
                ));
            }
            if let Some(t) = f
                && t >= vocab
            {
                return Err(ModelError::invalid_input(
                    "hook",
                    format!("forced token {t} >= vocab_size {vocab}"),
                ));
            }
            forced.push(match f {
                Some(t) => Some((t, TokenOrigin::Forced)),
                None => carried.and_then(|c| c.token_if_unchanged(logits)),
            });
        }
        // 2. Draws: each row reads only its own logits and generator, so rows run in parallel
        // with the same results as in sequence.
        let draws = self.draw_rows(&all_logits, &forced);
        // 3. Bookkeeping and stop checks, in row order.
        let mut keep = Vec::with_capacity(n);
        let mut stopped: Vec<(usize, StopReason)> = Vec::new();
        for (r, (draw, origin)) in draws.into_iter().enumerate() {
            let id = self.batch.rows[r];
            let st = self.seqs.get_mut(&id).expect("running row has a state");
            let j = st.seq.params.confidence_top_j;
            let conf = top_j_confidence(&draw.top, j);
            let mut draw = draw;
            draw.top.truncate(st.seq.params.sampling.top_logprobs);
            let tok = draw.token;
            match origin {
                TokenOrigin::Forced => self.stats.forced_tokens += 1,
                _ => self.stats.sampled_tokens += 1,
            }
            st.seq.push(tok, origin, Some((&draw, conf)));
            st.generated += 1;
            match turn_stop(self.tokenizer, st, max_pos)? {
                Some(reason) => stopped.push((r, reason)),
                None => keep.push(r),
            }
        }
        for (r, reason) in stopped {
            self.end_turn(r, reason, &mut ends)?;
        }
        self.keep_rows(&keep)?;
        match self.config.speculative.clone() {
            Some(spec) if hook.is_none() => self.decode_speculative(&spec, &mut ends)?,
            _ => self.decode_running()?,
        }
        ends.sort_by_key(|e| e.id);
        Ok(ends)
    }

    /// Ends the turn of batch row `r` (its newest token not yet run through the model): the
    /// sequence leaves the batch with a compact copy of its cache rows (the caller drops the
    /// row with [`SamplingEngine::keep_rows`]).
    fn end_turn(&mut self, r: usize, reason: StopReason, ends: &mut Vec<TurnEnd>) -> Result<()> {
        let id = self.batch.rows[r];
        let keep = !self.seqs[&id].seq.params.single_turn;
        let cols = real_columns(&self.batch.mask[r]);
        let shared = self
            .batch
            .shared
            .iter()
            .find(|s| s.rows[r])
            .map(|s| s.layers.as_slice());
        let cached = cols.len() + shared.map_or(0, |l| l[0].0.dims()[2]);
        debug_assert_eq!(cached + 1, self.seqs[&id].seq.tokens.len());
        if let (Some(pc), Some(layers)) = (self.prefix_cache.as_mut(), &self.batch.layers) {
            let device = self.model.device();
            let tokens = &self.seqs[&id].seq.tokens;
            pc.insert(tokens, cached, |a, n| {
                row_span(layers, shared, r, &cols, a, n, device)
            })?;
        }
        let cache = if keep { self.extract_row(r)? } else { None };
        let st = self.seqs.get_mut(&id).expect("running row has a state");
        st.cached = if cache.is_some() { cached } else { 0 };
        // Without a cache of its own, a resumed sequence asks the prefix cache again.
        st.looked_up &= cache.is_some();
        st.cache = cache;
        st.shared = None;
        ends.push(pause(st, reason));
        Ok(())
    }

    /// Moves waiting sequences into the batch while there is room (the batch size and the
    /// memory budget), prefilling them together. A sequence with more than
    /// [`EngineConfig::prefill_chunk`] uncached tokens is instead prefilled one chunk on its
    /// own and stays first in line; nothing behind it joins this step. Returns whether the
    /// model ran.
    fn admit(&mut self, ends: &mut Vec<TurnEnd>) -> Result<bool> {
        let cap = match self.config.max_batch_size {
            0 => usize::MAX,
            n => n,
        };
        let chunk = match self.config.prefill_chunk {
            0 => usize::MAX,
            n => n,
        };
        let max_pos = self.model.config().max_position_embeddings;
        // What the budget must hold besides the batch: the caches of sequences not running
        // (counted only under a budget: nothing reads it otherwise).
        let mut parked: u64 = match self.config.memory_budget {
            None => 0,
            Some(_) => {
                self.parked_columns() * self.kv_column_bytes()
                    + self.prefix_cache.as_ref().map_or(0, PrefixCache::bytes)
                    + self
                        .batch
                        .shared
                        .iter()
                        .map(|s| s.len() as u64 * self.kv_column_bytes())
                        .sum::<u64>()
            }
        };
        let running_left = self
            .batch
            .rows
            .iter()
            .map(|id| turn_left(&self.seqs[id], max_pos))
            .max()
            .unwrap_or(0);
        let mut group: Vec<SeqId> = Vec::new();
        let (mut c_max, mut n_max, mut left_max) = (0usize, 0usize, running_left);
        while self.batch.rows.len() + group.len() < cap {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            self.cache_lookup(id)?;
            let st = self.seqs.get_mut(&id).expect("waiting id has a state");
            let turn_full =
                st.seq.tokens.len() - st.seq.turn_start >= st.seq.params.sampling.max_new_tokens;
            let reason = if turn_full {
                Some(StopReason::TurnLimit)
            } else {
                limit_reached(&st.seq, st.generated, max_pos)
            };
            if let Some(reason) = reason {
                self.waiting.pop_front();
                ends.push(pause(st, reason));
                continue;
            }
            let (cached, len) = (st.cached, st.seq.tokens.len());
            let left = turn_left(st, max_pos);
            let first = self.batch.rows.is_empty() && group.is_empty();
            let sharers = if self.config.share_prompts && len - cached > 1 {
                self.same_prompt_waiting(id)
            } else {
                Vec::new()
            };
            if !sharers.is_empty() {
                // A prompt other waiting sequences share: all but its last token are prefilled
                // once, for this one alone (a chunk a step), then shared with them.
                if !group.is_empty() {
                    break;
                }
                let n = chunk.min(len - 1 - cached);
                let need = self.memory_need(
                    self.batch.rows.len() + 1,
                    self.batch.width().max(len) + left_max.max(left),
                    1,
                    n,
                    cached + n,
                ) + parked;
                if self.over_budget_evicting(need, &mut parked) && !first {
                    break;
                }
                self.prefill_chunk_of(id, n)?;
                self.cache_chunk(id)?;
                if self.seqs[&id].cached == len - 1 {
                    self.share_prompt(id, &sharers)?;
                }
                return Ok(true);
            }
            if len - cached > chunk {
                // A long prefill runs a chunk a step, alone.
                if !group.is_empty() {
                    break;
                }
                let width = cached + chunk;
                let need = self.memory_need(
                    self.batch.rows.len() + 1,
                    self.batch.width().max(len) + left_max.max(left),
                    1,
                    chunk,
                    width,
                ) + parked;
                if self.over_budget_evicting(need, &mut parked) && !first {
                    break;
                }
                self.prefill_chunk_of(id, chunk)?;
                self.cache_chunk(id)?;
                return Ok(true);
            }
            // Under cascade attention a group holds one shared prompt's sequences or none: a
            // sequence of another waits for the next step, where its own group reads its
            // prompt once (a mixed group would copy every prompt per row).
            if self.config.shared_prefix_attention
                && let Some(&g0) = group.first()
                && !same_share(&self.seqs[&g0], &self.seqs[&id])
            {
                break;
            }
            let (c, n) = (c_max.max(cached), n_max.max(len - cached));
            let need = self.memory_need(
                self.batch.rows.len() + group.len() + 1,
                self.batch.width().max(c + n) + left_max.max(left),
                group.len() + 1,
                n,
                c + n,
            ) + parked;
            if self.over_budget_evicting(need, &mut parked) && !first {
                break;
            }
            (c_max, n_max, left_max) = (c, n, left_max.max(left));
            self.waiting.pop_front();
            let st = self.seqs.get_mut(&id).expect("waiting id has a state");
            st.seq.status = SeqStatus::Running;
            group.push(id);
        }
        if group.is_empty() {
            return Ok(false);
        }
        let (layers, mask, logits, shared) = self.prefill(&group)?;
        let shared_layers = shared.as_ref().map(|(_, l)| l.as_slice());
        self.cache_prefilled(&group, &layers, &mask, shared_layers)?;
        self.stats.prefill_tokens += group
            .iter()
            .map(|id| (self.seqs[id].seq.tokens.len() - self.seqs[id].cached) as u64)
            .sum::<u64>();
        for &id in &group {
            let st = self.seqs.get_mut(&id).expect("admitted id has a state");
            st.cache = None;
            st.cached = 0;
            st.room = None;
            st.shared = None;
        }
        self.merge(group, layers, mask, logits, shared)?;
        Ok(true)
    }

    /// Runs the next `chunk` uncached tokens of waiting sequence `id` through the model on top
    /// of its own cache, alone, and keeps their keys and values in its cache.
    fn prefill_chunk_of(&mut self, id: SeqId, chunk: usize) -> Result<()> {
        let cfg = self.model.config();
        let device = self.model.device();
        let st = self.seqs.get_mut(&id).expect("waiting id has a state");
        let c = st.cached;
        let total = st.seq.tokens.len();
        let n = chunk.min(total - c);
        // The first chunk allocates room for the whole prompt and the first decoding steps;
        // the later ones write into it (see `SeqState::room`).
        let mut cache = KvCache::with_reserve(cfg.num_hidden_layers, total - c - n + KV_RESERVE);
        match st.room.take() {
            Some(room) => {
                for (layer, l) in room.into_iter().enumerate() {
                    *cache.slot_mut(layer) = Some(l);
                }
            }
            None => {
                if let Some(layers) = st.cache.as_ref().filter(|_| c > 0) {
                    for (layer, (k, v)) in layers.iter().enumerate() {
                        *cache.slot_mut(layer) = Some(LayerKv::exact(k.clone(), v.clone())?);
                    }
                }
            }
        }
        let ids = Tensor::from_vec(st.seq.tokens[c..c + n].to_vec(), (1, n), device)?;
        let pos = Tensor::from_vec((c as u32..(c + n) as u32).collect(), (1, n), device)?;
        let mask = mask_tensor(&[vec![1u8; c + n]], device)?;
        self.model
            .forward_hidden(&ids, &pos, &mask, Some(&mut cache))?;
        let room = take_layers(&mut cache)?;
        let views = room
            .iter()
            .map(|l| Ok((l.k()?, l.v()?)))
            .collect::<Result<Vec<_>>>()?;
        st.cache = Some(views);
        st.room = Some(room);
        st.cached = c + n;
        st.shared = None;
        self.stats.prefill_tokens += n as u64;
        Ok(())
    }

    /// The other waiting sequences whose tokens equal those of waiting sequence `id` and that
    /// have cached no more of them ([`EngineConfig::share_prompts`]).
    fn same_prompt_waiting(&self, id: SeqId) -> Vec<SeqId> {
        let st = &self.seqs[&id];
        self.waiting
            .iter()
            .filter(|&&w| w != id)
            .filter(|w| {
                let o = &self.seqs[w];
                o.cached <= st.cached && o.seq.tokens == st.seq.tokens
            })
            .copied()
            .collect()
    }

    /// Starts `sharers` from the keys and values waiting sequence `id` has cached (views of
    /// one storage, as [`SamplingEngine::add_sequence_with_prefix`] does): each then prefills
    /// only what follows them.
    fn share_prompt(&mut self, id: SeqId, sharers: &[SeqId]) -> Result<()> {
        let prefix = self.prefix_of(id).ok_or_else(|| {
            ModelError::invalid_input("id", format!("{id} has no cache to share"))
        })?;
        for &s in sharers {
            self.attach_prefix(s, &prefix)?;
        }
        let st = self.state_mut(id)?;
        st.shared = Some((Arc::clone(&prefix.share), prefix.len()));
        Ok(())
    }

    /// Starts waiting sequence `id` from the prefix cache's longest run of whole blocks its
    /// tokens begin with (all but its last token at most), once, if it has nothing cached.
    fn cache_lookup(&mut self, id: SeqId) -> Result<()> {
        let st = &self.seqs[&id];
        if st.looked_up || st.cached > 0 || st.room.is_some() {
            return Ok(());
        }
        // The prompt the batch's rows share, when this sequence begins with it: started from
        // that storage, it joins them (read once per step) instead of copying it.
        if let Some(prefix) = self.batch_shared_prefix(&st.seq.tokens) {
            self.state_mut(id)?.looked_up = true;
            return self.attach_prefix(id, &prefix);
        }
        let Some(pc) = self.prefix_cache.as_mut() else {
            return Ok(());
        };
        let st = self.seqs.get_mut(&id).expect("waiting id has a state");
        st.looked_up = true;
        let limit = st.seq.tokens.len() - 1;
        if let Some(prefix) = pc.lookup(&st.seq.tokens, limit)? {
            self.attach_prefix(id, &prefix)?;
        }
        Ok(())
    }

    /// Caches the whole blocks waiting sequence `id` has prefilled so far (a chunk at a time).
    fn cache_chunk(&mut self, id: SeqId) -> Result<()> {
        let Some(pc) = self.prefix_cache.as_mut() else {
            return Ok(());
        };
        let st = &self.seqs[&id];
        if let Some(layers) = &st.cache {
            pc.insert(&st.seq.tokens, st.cached, |a, n| columns_of(layers, a, n))?;
        }
        Ok(())
    }

    /// Caches the whole blocks of each sequence of a prefilled group: row `i` of `layers` is
    /// `group[i]`, its real columns those where `mask[i]` is set, in token order.
    fn cache_prefilled(
        &mut self,
        group: &[SeqId],
        layers: &[LayerKv],
        mask: &[Vec<u8>],
        shared: Option<&[SeqKv]>,
    ) -> Result<()> {
        let Some(pc) = self.prefix_cache.as_mut() else {
            return Ok(());
        };
        let device = self.model.device();
        let s = shared.map_or(0, |l| l[0].0.dims()[2]);
        for (i, id) in group.iter().enumerate() {
            let cols = real_columns(&mask[i]);
            let tokens = &self.seqs[id].seq.tokens;
            pc.insert(tokens, s + cols.len(), |a, n| {
                row_span(layers, shared, i, &cols, a, n, device)
            })?;
        }
        Ok(())
    }

    /// Whether `need` bytes (`parked` among them, which counts the prefix cache) exceed the
    /// memory budget once the prefix cache has evicted its least recently used blocks for the
    /// room; `parked` loses what was evicted.
    fn over_budget_evicting(&mut self, need: u64, parked: &mut u64) -> bool {
        let Some(budget) = self.config.memory_budget else {
            return false;
        };
        if need <= budget {
            return false;
        }
        let freed = self
            .prefix_cache
            .as_mut()
            .map_or(0, |pc| pc.evict(need - budget))
            .min(need);
        *parked = parked.saturating_sub(freed);
        need - freed > budget
    }

    /// Key/value columns cached by sequences not running, columns that several sequences hold
    /// views of counted once.
    fn parked_columns(&self) -> u64 {
        let mut own = 0u64;
        let mut shared: BTreeMap<usize, usize> = BTreeMap::new();
        for s in self.seqs.values() {
            if s.seq.status == SeqStatus::Running {
                continue;
            }
            let cols = match &s.shared {
                Some((key, cols)) => {
                    let cols = (*cols).min(s.cached);
                    let e = shared.entry(Arc::as_ptr(key) as usize).or_default();
                    *e = (*e).max(cols);
                    cols
                }
                None => 0,
            };
            own += (s.cached - cols) as u64;
        }
        own + shared.values().map(|&c| c as u64).sum::<u64>()
    }

    /// Bytes one cached position of one sequence takes over all layers (keys and values).
    fn kv_column_bytes(&self) -> u64 {
        let cfg = self.model.config();
        (cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim) as u64
            * self.model.dtype().size_in_bytes() as u64
    }

    /// The memory a batch of `rows` rows `width` columns wide needs while `prefill_rows` of
    /// them run `prefill_tokens` new tokens each over `prefill_width` columns: the key/value
    /// cache (with its spare columns), twice, as it exists while rows join the batch
    /// (concatenation) and while its buffers grow, plus the largest layer's transient
    /// activations (the attention scores and their softmax, the MLP's hidden states) counted in
    /// f32.
    fn memory_need(
        &self,
        rows: usize,
        width: usize,
        prefill_rows: usize,
        prefill_tokens: usize,
        prefill_width: usize,
    ) -> u64 {
        let cfg = self.model.config();
        let kv = 2 * rows as u64 * (width + KV_RESERVE) as u64 * self.kv_column_bytes();
        let per_token = 3 * cfg.num_attention_heads * prefill_width
            + 4 * (cfg.hidden_size + cfg.intermediate_size);
        let act = (prefill_rows * prefill_tokens) as u64 * per_token as u64 * 4;
        // The prefill's new columns exist twice while the cache is joined.
        let joined = (prefill_rows * prefill_width) as u64 * self.kv_column_bytes();
        kv + act + joined
    }

    /// The memory a sequence of `len` tokens sampled by `params` needs alone:
    /// its whole turn's cache and its prefill's activations.
    pub fn memory_estimate(&self, len: usize, params: &SequenceParams) -> u64 {
        let max_pos = self.model.config().max_position_embeddings;
        let left = seq_turn_left(len, 0, 0, params, max_pos);
        let chunk = match self.config.prefill_chunk {
            0 => len,
            n => n.min(len),
        };
        self.memory_need(1, len + left, 1, chunk, len)
    }

    /// Refuses a sequence of `len` tokens that could never fit the memory budget, even alone.
    fn check_alone_fits(&self, len: usize, params: &SequenceParams) -> Result<()> {
        let Some(budget) = self.config.memory_budget else {
            return Ok(());
        };
        let need = self.memory_estimate(len, params);
        if need <= budget {
            return Ok(());
        }
        let mib = |b: u64| b.div_ceil(1 << 20);
        Err(ModelError::invalid_input(
            "memory_budget",
            format!(
                "a sequence of {len} tokens that may generate {} more needs about {} MiB of \
                 key/value cache and activations, beyond the budget of {} MiB",
                seq_turn_left(
                    len,
                    0,
                    0,
                    params,
                    self.model.config().max_position_embeddings
                ),
                mib(need),
                mib(budget)
            ),
        ))
    }

    /// Runs the uncached tokens of `group` (left-padded) on top of their own caches
    /// (left-padded to a common width). Returns the group's cache, key mask and last logits.
    fn prefill(&mut self, group: &[SeqId]) -> Result<Prefilled> {
        let cfg = self.model.config();
        let device = self.model.device();
        let dtype = self.model.dtype();
        let (kv, hd) = (cfg.num_key_value_heads, cfg.head_dim);
        // The rest of a prompt prefilled in chunks, alone: it runs on top of the chunks'
        // buffers, which have room for it (`SeqState::room`), instead of a copy of them.
        let room = match group {
            [id] => self.seqs.get_mut(id).and_then(|st| st.room.take()),
            _ => None,
        };
        let states: Vec<&SeqState> = group.iter().map(|id| &self.seqs[id]).collect();
        let shared = match room {
            Some(_) => None,
            None => self.shared_prompt_of(&states),
        };
        // Under a shared prompt the rows' own caches start empty: the prompt's keys stay one
        // storage, which the attention reads beside each row's own columns.
        let own_cached = |s: &SeqState| if shared.is_some() { 0 } else { s.cached };
        let c_max = states.iter().map(|s| own_cached(s)).max().unwrap_or(0);
        let n_max = states
            .iter()
            .map(|s| s.seq.tokens.len() - s.cached)
            .max()
            .unwrap_or(0);
        let b = states.len();
        let mut cache = KvCache::with_reserve(cfg.num_hidden_layers, KV_RESERVE);
        if let Some(room) = room {
            for (layer, l) in room.into_iter().enumerate() {
                *cache.slot_mut(layer) = Some(l);
            }
        } else if c_max > 0 {
            for layer in 0..cfg.num_hidden_layers {
                let mut ks = Vec::with_capacity(b);
                let mut vs = Vec::with_capacity(b);
                for s in &states {
                    let pad = c_max - s.cached;
                    let zeros = || Tensor::zeros((1, kv, pad, hd), dtype, device);
                    match &s.cache {
                        Some(layers) if s.cached > 0 => {
                            let (k, v) = &layers[layer];
                            if pad == 0 {
                                ks.push(k.clone());
                                vs.push(v.clone());
                            } else {
                                ks.push(Tensor::cat(&[&zeros()?, k], 2)?);
                                vs.push(Tensor::cat(&[&zeros()?, v], 2)?);
                            }
                        }
                        _ => {
                            ks.push(zeros()?);
                            vs.push(zeros()?);
                        }
                    }
                }
                *cache.slot_mut(layer) =
                    Some(LayerKv::exact(Tensor::cat(&ks, 0)?, Tensor::cat(&vs, 0)?)?);
            }
        }
        let width = c_max + n_max;
        let mut ids = Vec::with_capacity(b * n_max);
        let mut pos = Vec::with_capacity(b * n_max);
        let mut mask = Vec::with_capacity(b);
        for s in &states {
            let c = s.cached;
            let new = &s.seq.tokens[c..];
            let pad = n_max - new.len();
            ids.extend(std::iter::repeat_n(0u32, pad).chain(new.iter().copied()));
            pos.extend(std::iter::repeat_n(0u32, pad).chain(c as u32..(c + new.len()) as u32));
            let c = own_cached(s);
            let mut m = Vec::with_capacity(width);
            m.extend(std::iter::repeat_n(0u8, c_max - c));
            m.extend(std::iter::repeat_n(1u8, c));
            m.extend(std::iter::repeat_n(0u8, pad));
            m.extend(std::iter::repeat_n(1u8, new.len()));
            mask.push(m);
        }
        let ids = Tensor::from_vec(ids, (b, n_max), device)?;
        let pos = Tensor::from_vec(pos, (b, n_max), device)?;
        if let Some((_, layers)) = &shared {
            cache.set_shared(vec![SharedPrefixKv {
                layers: layers.clone(),
                rows: vec![true; b].into(),
            }]);
        }
        let hidden = self.model.forward_hidden(
            &ids,
            &pos,
            &mask_tensor(&mask, device)?,
            Some(&mut cache),
        )?;
        let logits = self
            .model
            .logits(&hidden.narrow(1, n_max - 1, 1)?)?
            .squeeze(1)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        Ok((take_layers(&mut cache)?, mask, logits, shared))
    }

    /// The keys and values every sequence of a group about to be prefilled starts from, when
    /// they are one storage ([`EngineConfig::shared_prefix_attention`]), and its key: each
    /// sequence's whole cache shared under one key, and either that key one of the batch's
    /// shared prompts (the group joins its rows), or two or more sequences (a new one).
    fn shared_prompt_of(&self, states: &[&SeqState]) -> Option<(ShareKey, Vec<SeqKv>)> {
        if !self.config.shared_prefix_attention {
            return None;
        }
        let (key, len) = states[0].shared.as_ref()?;
        let same = states.iter().all(|s| {
            s.cached == *len
                && s.cache.is_some()
                && s.shared
                    .as_ref()
                    .is_some_and(|(k, n)| Arc::ptr_eq(k, key) && n == len)
        });
        if !same || *len == 0 {
            return None;
        }
        match self.batch.shared.iter().find(|b| Arc::ptr_eq(&b.key, key)) {
            Some(b) => (b.len() == *len).then(|| (Arc::clone(key), b.layers.clone())),
            None if states.len() >= 2 => Some((Arc::clone(key), states[0].cache.clone()?)),
            None => None,
        }
    }

    /// The longest of the batch's shared prompts as a [`PrefixKv`], for a waiting sequence
    /// whose tokens begin with all of it and go on: started from it, the sequence joins the
    /// rows that read it ([`SamplingEngine::shared_prompt_of`]).
    fn batch_shared_prefix(&self, tokens: &[u32]) -> Option<PrefixKv> {
        let b = self
            .batch
            .shared
            .iter()
            .filter(|b| tokens.len() > b.len() && tokens.starts_with(&b.tokens))
            .max_by_key(|b| b.len())?;
        Some(PrefixKv {
            tokens: b.tokens.clone(),
            layers: b.layers.clone(),
            share: Arc::clone(&b.key),
        })
    }

    /// Appends prefilled rows to the batch, left-padding whichever side is narrower.
    fn merge(
        &mut self,
        rows: Vec<SeqId>,
        layers: Vec<LayerKv>,
        mut mask: Vec<Vec<u8>>,
        logits: Vec<Vec<f32>>,
        shared: Option<(ShareKey, Vec<SeqKv>)>,
    ) -> Result<()> {
        let (old, new) = (self.batch.rows.len(), rows.len());
        // The new rows read the group whose key they share (joining it, or a new one); every
        // other group's flags grow by `new` unset ones.
        let joined = match shared {
            Some((key, shared_layers)) => {
                match self
                    .batch
                    .shared
                    .iter()
                    .position(|s| Arc::ptr_eq(&s.key, &key))
                {
                    Some(g) => Some(g),
                    None => {
                        let len = shared_layers[0].0.dims()[2];
                        let tokens = self.seqs[&rows[0]].seq.tokens[..len].to_vec();
                        self.batch.shared.push(BatchShared {
                            key,
                            tokens,
                            layers: shared_layers,
                            rows: vec![false; old],
                        });
                        Some(self.batch.shared.len() - 1)
                    }
                }
            }
            None => None,
        };
        let batch = &mut self.batch;
        for (g, s) in batch.shared.iter_mut().enumerate() {
            s.rows.extend(std::iter::repeat_n(joined == Some(g), new));
        }
        match batch.layers.take() {
            None => {
                batch.layers = Some(layers);
                batch.mask = mask;
            }
            Some(old) => {
                let (w_old, w_new) = (batch.width(), mask.first().map_or(0, Vec::len));
                let w = w_old.max(w_new);
                let merged = old
                    .iter()
                    .zip(&layers)
                    .map(|(o, n)| {
                        let join = |a: Tensor, b: Tensor| -> Result<Tensor> {
                            Ok(Tensor::cat(
                                &[&left_pad(&a, w - w_old)?, &left_pad(&b, w - w_new)?],
                                0,
                            )?)
                        };
                        LayerKv::exact(join(o.k()?, n.k()?)?, join(o.v()?, n.v()?)?)
                    })
                    .collect::<Result<Vec<_>>>()?;
                batch.layers = Some(merged);
                for m in batch.mask.iter_mut() {
                    m.splice(0..0, std::iter::repeat_n(0u8, w - w_old));
                }
                for m in mask.iter_mut() {
                    m.splice(0..0, std::iter::repeat_n(0u8, w - w_new));
                }
                batch.mask.extend(mask);
            }
        }
        batch.rows.extend(rows);
        batch.logits.extend(logits);
        Ok(())
    }

    /// A compact `[1, kv, real, d]` copy of row `r`'s real cache columns.
    fn extract_row(&self, r: usize) -> Result<Option<Vec<SeqKv>>> {
        let own = self.extract_own(r)?;
        match (self.batch.shared.iter().find(|s| s.rows[r]), own) {
            (Some(s), own) => Ok(Some(match own {
                Some(own) => cat_columns(&s.layers, &own)?,
                None => s.layers.clone(),
            })),
            (None, own) => Ok(own),
        }
    }

    /// A compact `[1, kv, real, d]` copy of row `r`'s own real cache columns (after the shared
    /// prompt's, if it starts from one).
    fn extract_own(&self, r: usize) -> Result<Option<Vec<SeqKv>>> {
        let Some(layers) = &self.batch.layers else {
            return Ok(None);
        };
        let cols = real_columns(&self.batch.mask[r]);
        if cols.is_empty() {
            return Ok(None);
        }
        let n = cols.len();
        // The batch's only row, its columns one run (a sequence alone in the engine, e.g. a
        // prompt prefilled for later turns): views of the buffers, which the batch is about to
        // drop, instead of a copy of a cache that may be long.
        if self.batch.rows.len() == 1 && cols[n - 1] as usize + 1 - cols[0] as usize == n {
            let start = cols[0] as usize;
            let out = layers
                .iter()
                .map(|l| {
                    let (k, v) = l.buffers();
                    Ok((k.narrow(2, start, n)?, v.narrow(2, start, n)?))
                })
                .collect::<Result<Vec<_>>>()?;
            return Ok(Some(out));
        }
        let idx = Tensor::from_vec(cols, n, self.model.device())?;
        Ok(Some(row_columns(layers, r, &idx)?))
    }

    /// Keeps only batch rows `keep` (in that order) and drops cache columns no kept row uses.
    fn keep_rows(&mut self, keep: &[usize]) -> Result<()> {
        let batch = &mut self.batch;
        if keep.len() == batch.rows.len() {
            return Ok(());
        }
        if keep.is_empty() {
            *batch = Batch::default();
            return Ok(());
        }
        let device = self.model.device();
        let row_idx = Tensor::from_vec(
            keep.iter().map(|&r| r as u32).collect::<Vec<_>>(),
            keep.len(),
            device,
        )?;
        let width = batch.width();
        let cols: Vec<usize> = (0..width)
            .filter(|&j| keep.iter().any(|&r| batch.mask[r][j] != 0))
            .collect();
        let col_idx = if cols.len() < width {
            Some(Tensor::from_vec(
                cols.iter().map(|&j| j as u32).collect::<Vec<_>>(),
                cols.len(),
                device,
            )?)
        } else {
            None
        };
        if let Some(layers) = batch.layers.take() {
            batch.layers = Some(
                layers
                    .iter()
                    .map(|l| {
                        // Row selection keeps the spare columns; dropping columns compacts.
                        let (k, v) = l.buffers();
                        let (k, v) = (k.index_select(&row_idx, 0)?, v.index_select(&row_idx, 0)?);
                        Ok(match &col_idx {
                            Some(ci) => {
                                LayerKv::exact(k.index_select(ci, 2)?, v.index_select(ci, 2)?)?
                            }
                            None => LayerKv::from_buffers(k, v, l.len()),
                        })
                    })
                    .collect::<Result<Vec<_>>>()?,
            );
        }
        for s in &mut batch.shared {
            s.rows = keep.iter().map(|&r| s.rows[r]).collect();
        }
        batch.shared.retain(|s| s.rows.iter().any(|&f| f));
        let old_mask = std::mem::take(&mut batch.mask);
        batch.mask = keep
            .iter()
            .map(|&r| cols.iter().map(|&j| old_mask[r][j]).collect())
            .collect();
        batch.rows = keep.iter().map(|&r| batch.rows[r]).collect();
        let mut old_logits = std::mem::take(&mut batch.logits);
        if old_logits.len() == old_mask.len() {
            batch.logits = keep
                .iter()
                .map(|&r| std::mem::take(&mut old_logits[r]))
                .collect();
        }
        Ok(())
    }

    /// Draws (or scores the forced token of) every running row: row `r` from `logits[r]` with
    /// its own generator. Rows are spread over the rayon pool when the batch's vocabulary
    /// entries are many enough to pay for it ([`PARALLEL_DRAW_MIN_ENTRIES`]); each row's draw
    /// is the same either way.
    fn draw_rows(
        &mut self,
        logits: &[Vec<f32>],
        forced: &[Option<(u32, TokenOrigin)>],
    ) -> Vec<(TokenDraw, TokenOrigin)> {
        let row_of = self.row_index();
        let mut slots: Vec<Option<RowDraw<'_>>> = (0..logits.len()).map(|_| None).collect();
        for (id, st) in self.seqs.iter_mut() {
            if let Some(&r) = row_of.get(id) {
                slots[r] = Some((&mut st.rng, &st.draw, &logits[r], forced[r]));
            }
        }
        let mut work: Vec<RowDraw<'_>> = slots
            .into_iter()
            .map(|w| w.expect("every running row has a state"))
            .collect();
        let one = |(rng, params, l, f): &mut RowDraw<'_>| match *f {
            Some((t, origin)) => (forced_row(l, params, t), origin),
            None => (sample_row(l, params, rng), TokenOrigin::Sampled),
        };
        let entries: usize = logits.iter().map(Vec::len).sum();
        if work.len() > 1
            && entries >= PARALLEL_DRAW_MIN_ENTRIES
            && rayon::current_num_threads() > 1
        {
            use rayon::prelude::*;
            work.par_iter_mut().map(one).collect()
        } else {
            work.iter_mut().map(one).collect()
        }
    }

    /// Runs every running row's newest token through the model (one position per row).
    fn decode_running(&mut self) -> Result<()> {
        let n = self.batch.rows.len();
        if n == 0 {
            return Ok(());
        }
        let device = self.model.device();
        let mut ids = Vec::with_capacity(n);
        let mut pos = Vec::with_capacity(n);
        for id in &self.batch.rows {
            let toks = &self.seqs[id].seq.tokens;
            ids.push(*toks.last().expect("sequences are never empty"));
            pos.push((toks.len() - 1) as u32);
        }
        for m in self.batch.mask.iter_mut() {
            m.push(1);
        }
        self.stats.decode_tokens += n as u64;
        let hidden = self.forward_on_batch(
            Tensor::from_vec(ids, (n, 1), device)?,
            Tensor::from_vec(pos, (n, 1), device)?,
        )?;
        self.batch.logits = self
            .model
            .logits(&hidden)?
            .squeeze(1)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        Ok(())
    }

    /// Runs `ids` at positions `pos` (`[rows, t]`) on top of the running batch's cache, whose
    /// key mask already holds their `t` new columns; the cache keeps their keys and values.
    /// Returns the hidden states `[rows, t, hidden]`.
    fn forward_on_batch(&mut self, ids: Tensor, pos: Tensor) -> Result<Tensor> {
        let mut cache = KvCache::with_reserve(self.model.config().num_hidden_layers, KV_RESERVE);
        if let Some(layers) = self.batch.layers.take() {
            for (i, kv) in layers.into_iter().enumerate() {
                *cache.slot_mut(i) = Some(kv);
            }
        }
        cache.set_shared(
            self.batch
                .shared
                .iter()
                .map(|s| SharedPrefixKv {
                    layers: s.layers.clone(),
                    rows: s.rows.clone().into(),
                })
                .collect(),
        );
        let mask = mask_tensor(&self.batch.mask, self.model.device())?;
        let hidden = self
            .model
            .forward_hidden(&ids, &pos, &mask, Some(&mut cache))?;
        self.batch.layers = Some(take_layers(&mut cache)?);
        Ok(hidden)
    }

    fn check_ids(&self, what: &str, ids: &[u32]) -> Result<()> {
        let vocab = self.model.config().vocab_size as u32;
        match ids.iter().find(|&&t| t >= vocab) {
            Some(bad) => Err(ModelError::invalid_input(
                what,
                format!("token id {bad} >= vocab_size {vocab}"),
            )),
            None => Ok(()),
        }
    }

    fn state(&self, id: SeqId) -> Result<&SeqState> {
        self.seqs
            .get(&id)
            .ok_or_else(|| ModelError::invalid_input("id", format!("no sequence {id}")))
    }

    fn state_mut(&mut self, id: SeqId) -> Result<&mut SeqState> {
        self.seqs
            .get_mut(&id)
            .ok_or_else(|| ModelError::invalid_input("id", format!("no sequence {id}")))
    }

    /// Each running sequence's batch row.
    fn row_index(&self) -> BTreeMap<SeqId, usize> {
        self.batch
            .rows
            .iter()
            .enumerate()
            .map(|(r, &id)| (id, r))
            .collect()
    }

    fn row_of(&self, id: SeqId) -> Result<usize> {
        self.batch
            .rows
            .iter()
            .position(|&r| r == id)
            .ok_or_else(|| ModelError::invalid_input("id", format!("sequence {id} not in batch")))
    }
}

/// Why the turn of running sequence `st` ends with its newest token, if it does: a stop token,
/// a stop string, a completed choice, then a token limit, in that order.
fn turn_stop(
    tokenizer: Option<&TextTokenizer>,
    st: &SeqState,
    max_pos: usize,
) -> Result<Option<StopReason>> {
    let seq = &st.seq;
    let p = &seq.params;
    let tok = *seq.tokens.last().expect("sequences are never empty");
    Ok(if p.sampling.stop_token_ids.contains(&tok) {
        Some(StopReason::StopToken(tok))
    } else if let Some(s) = stop_string_hit(tokenizer, &p.sampling.stop_strings, seq.turn_tokens())?
    {
        Some(StopReason::StopString(s))
    } else if st
        .choice
        .as_ref()
        .is_some_and(|c| c.is_complete(&c.text_of(seq.turn_tokens())))
    {
        Some(StopReason::ChoiceComplete)
    } else {
        limit_reached(seq, st.generated, max_pos)
    })
}

/// Pauses `st`'s sequence for `reason`: the turn that ended.
fn pause(st: &mut SeqState, reason: StopReason) -> TurnEnd {
    let end = TurnEnd {
        id: st.seq.id,
        reason: reason.clone(),
        start: st.seq.turn_start,
        end: st.seq.tokens.len(),
    };
    st.seq.status = SeqStatus::Paused(reason);
    end
}

/// The token limit that keeps `seq` (which has generated `generated` tokens) from generating
/// another token, if any.
fn limit_reached(seq: &Sequence, generated: usize, max_pos: usize) -> Option<StopReason> {
    let p = &seq.params;
    if seq.tokens.len() - seq.turn_start >= p.sampling.max_new_tokens {
        Some(StopReason::TurnLimit)
    } else if p.max_generated_tokens.is_some_and(|m| generated >= m) {
        Some(StopReason::TrajectoryLimit)
    } else if p.max_len.is_some_and(|m| seq.tokens.len() >= m) {
        Some(StopReason::SequenceLimit)
    } else if seq.tokens.len() >= max_pos {
        Some(StopReason::ContextFull)
    } else {
        None
    }
}

/// Tokens the current turn of `st` may still add to it (its per-turn, trajectory, sequence and
/// context limits).
fn turn_left(st: &SeqState, max_pos: usize) -> usize {
    let seq = &st.seq;
    seq_turn_left(
        seq.tokens.len(),
        seq.tokens.len() - seq.turn_start,
        st.generated,
        &seq.params,
        max_pos,
    )
}

/// [`turn_left`] of a sequence of `len` tokens whose turn has generated `in_turn` tokens and
/// whose trajectory `generated`.
fn seq_turn_left(
    len: usize,
    in_turn: usize,
    generated: usize,
    p: &SequenceParams,
    max_pos: usize,
) -> usize {
    let mut left = p.sampling.max_new_tokens.saturating_sub(in_turn);
    if let Some(m) = p.max_generated_tokens {
        left = left.min(m.saturating_sub(generated));
    }
    if let Some(m) = p.max_len {
        left = left.min(m.saturating_sub(len));
    }
    left.min(max_pos.saturating_sub(len))
}

/// A key-mask row's set entries: the row's real cache columns, in token order.
fn real_columns(mask: &[u8]) -> Vec<u32> {
    mask.iter()
        .enumerate()
        .filter(|(_, m)| **m != 0)
        .map(|(j, _)| j as u32)
        .collect()
}

/// Each layer's keys and values of batch row `r` at columns `idx`, `[1, kv, idx.len(), d]`, in
/// storage of their own. The buffers are contiguous, so one row's block is too.
fn row_columns(layers: &[LayerKv], r: usize, idx: &Tensor) -> Result<Vec<SeqKv>> {
    layers
        .iter()
        .map(|l| {
            let (k, v) = l.buffers();
            Ok((
                k.narrow(0, r, 1)?.index_select(idx, 2)?,
                v.narrow(0, r, 1)?.index_select(idx, 2)?,
            ))
        })
        .collect()
}

/// Each layer's keys and values of columns `start..start + n` of a compact one-sequence cache,
/// in storage of their own.
fn columns_of(layers: &[SeqKv], start: usize, n: usize) -> Result<Vec<SeqKv>> {
    let own = |t: &Tensor| -> Result<Tensor> {
        let t = t.narrow(2, start, n)?;
        if !t.is_contiguous() {
            return Ok(t.contiguous()?);
        }
        // A contiguous view still shares the whole cache's storage: copy it out.
        let out = Tensor::zeros(t.dims(), t.dtype(), t.device())?;
        out.slice_set(&t, 2, 0)?;
        Ok(out)
    };
    layers.iter().map(|(k, v)| Ok((own(k)?, own(v)?))).collect()
}

/// Each layer's keys and values of columns `a..a + n` of batch row `r` whose cache is
/// `shared`'s columns (if any) followed by its own real columns `cols` of `layers`, in storage
/// of their own.
fn row_span(
    layers: &[LayerKv],
    shared: Option<&[SeqKv]>,
    r: usize,
    cols: &[u32],
    a: usize,
    n: usize,
    device: &candle_core::Device,
) -> Result<Vec<SeqKv>> {
    let s = shared.map_or(0, |l| l[0].0.dims()[2]);
    let (a_own, n_own) = (a.max(s) - s, (a + n).max(s) - a.max(s));
    let own = || {
        let idx = cols[a_own..a_own + n_own].to_vec();
        row_columns(layers, r, &Tensor::from_vec(idx, n_own, device)?)
    };
    match shared.filter(|_| a < s) {
        None => own(),
        Some(sh) => {
            let head = columns_of(sh, a, s.min(a + n) - a)?;
            if n_own == 0 {
                return Ok(head);
            }
            cat_columns(&head, &own()?)
        }
    }
}

/// Whether two sequences start from the same shared storage (or neither from any).
fn same_share(a: &SeqState, b: &SeqState) -> bool {
    match (&a.shared, &b.shared) {
        (Some((ka, na)), Some((kb, nb))) => Arc::ptr_eq(ka, kb) && na == nb,
        (None, None) => true,
        _ => false,
    }
}

/// Each layer's keys and values `a` followed by `b`'s (along the columns), in new storage.
fn cat_columns(a: &[SeqKv], b: &[SeqKv]) -> Result<Vec<SeqKv>> {
    a.iter()
        .zip(b)
        .map(|((ak, av), (bk, bv))| Ok((Tensor::cat(&[ak, bk], 2)?, Tensor::cat(&[av, bv], 2)?)))
        .collect()
}

fn take_layers(cache: &mut KvCache) -> Result<Vec<LayerKv>> {
    (0..cache.num_layers())
        .map(|i| {
            cache.slot_mut(i).take().ok_or_else(|| {
                ModelError::invalid_input("cache", format!("layer {i} was not filled"))
            })
        })
        .collect()
}

fn left_pad(t: &Tensor, pad: usize) -> Result<Tensor> {
    if pad == 0 {
        return Ok(t.clone());
    }
    let (b, h, _, d) = t.dims4()?;
    let z = Tensor::zeros((b, h, pad, d), t.dtype(), t.device())?;
    Ok(Tensor::cat(&[&z, t], 2)?)
}

fn mask_tensor(mask: &[Vec<u8>], device: &candle_core::Device) -> Result<Tensor> {
    super::mask_tensor(mask, device)
}

mod speculative;

#[cfg(test)]
mod tests;
