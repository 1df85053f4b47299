//! Batched autoregressive sampling with a KV cache.
//!
//! Rows of different lengths are left-padded and given per-row positions, so every row sees
//! exactly what it would see alone. Each row draws from its own seeded [`TurnRng`], so a row's
//! sample does not depend on which other rows share its batch. Finished rows are dropped from
//! the batch (and the cache) as they finish. For each sampled token the engine reports its
//! log-probability and the entropy of the distribution it was drawn from (the
//! temperature-scaled softmax, before top-k / top-p truncation — the distribution the policy
//! loss recomputes).
//!
//! Use a model built with `Transformer::detached_from_varmap` (or from plain tensors): sampling
//! on `Var`-backed weights records a useless autograd graph.
//!
//! [`generate`] is one turn of the multi-turn, continuously batched [`SamplingEngine`]
//! ([`engine`]), which also appends environment tokens to paused sequences, forks them, forces
//! tokens and reports each token's top-j confidence.

use candle_core::{Device, Tensor};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};
use crate::model::Transformer;
use crate::rng::TurnRng;
use crate::tokenizer::TextTokenizer;

pub mod choice;
pub mod engine;

pub use choice::{ChoiceConstraint, TokenPieces};
pub use engine::{
    DEFAULT_BLOCK_TOKENS, DEFAULT_CONFIDENCE_TOP_J, DEFAULT_PREFILL_CHUNK, EngineConfig,
    EngineStats, PrefixCache, PrefixCacheConfig, PrefixCacheStats, PrefixKv, SamplingEngine, SeqId,
    SeqStatus, Sequence, SequenceParams, SpeculativeConfig, StopReason, TokenHook, TokenOrigin,
    TurnEnd, top_j_confidence,
};

/// How tokens are drawn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Softmax temperature; `0` means greedy (arg-max, log-probs at temperature 1).
    pub temperature: f64,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose mass reaches `top_p`
    /// (`1` disables).
    pub top_p: f64,
    /// Keep only the `top_k` most likely tokens (`0` disables).
    pub top_k: usize,
    /// Most tokens generated per row.
    pub max_new_tokens: usize,
    /// Token ids that end a row (the token is kept in the output).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end a row once the decoded completion contains one (needs a tokenizer; the
    /// token that completes the string is kept).
    pub stop_strings: Vec<String>,
    /// Number of most likely tokens (id, log-prob) to report per step (`0`: none). Their
    /// log-probabilities are those of the sampling distribution, like `Completion::logprobs`.
    #[serde(default)]
    pub top_logprobs: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_new_tokens: 64,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            top_logprobs: 0,
        }
    }
}

impl SamplingParams {
    /// Checks the values.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(ModelError::invalid_input(
                "temperature",
                "must be >= 0 and finite",
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ModelError::invalid_input("top_p", "must be in (0, 1]"));
        }
        Ok(())
    }
}

/// Why a row stopped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinishReason {
    /// A stop token was sampled.
    StopToken(u32),
    /// The decoded completion contains `stop_strings[i]`.
    StopString(usize),
    /// `max_new_tokens` was reached.
    Length,
    /// The row reached the model's `max_position_embeddings`.
    ContextFull,
    /// The output equals one of the row's `guided_choice` strings ([`choice`]).
    ChoiceComplete,
}

/// One sampled completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    /// Sampled token ids (stop token included).
    pub tokens: Vec<u32>,
    /// Log-probability of each sampled token.
    pub logprobs: Vec<f32>,
    /// Entropy of each step's sampling distribution.
    pub entropies: Vec<f32>,
    /// Per step, the `top_logprobs` most likely `(token, log-prob)` pairs, most likely first
    /// (empty vectors when `top_logprobs` is 0).
    #[serde(default)]
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// Why the row stopped.
    pub finish: FinishReason,
}

impl Completion {
    /// No tokens, finished by length (what a row with no room to generate returns).
    fn empty() -> Self {
        Self {
            tokens: Vec::new(),
            logprobs: Vec::new(),
            entropies: Vec::new(),
            top_logprobs: Vec::new(),
            finish: FinishReason::Length,
        }
    }
}

/// Edits next-token logits before sampling (constrained decoding, banned tokens, biases).
///
/// The reported log-probabilities and entropies are those of the edited distribution; a policy
/// loss that recomputes log-probs from the model alone will differ wherever the hook changed
/// something.
pub trait LogitsProcessor {
    /// Edits `logits` (length `vocab_size`) of prompt `prompt_index`, which has generated
    /// `generated` so far. Setting an entry to `f32::NEG_INFINITY` forbids that token.
    fn process(&mut self, prompt_index: usize, generated: &[u32], logits: &mut [f32]);
}

/// Samples one completion per prompt. `seeds[i]` seeds row `i`'s generator; `tokenizer` is
/// needed only for stop strings.
pub fn generate(
    model: &Transformer,
    prompts: &[Vec<u32>],
    seeds: &[u64],
    params: &SamplingParams,
    tokenizer: Option<&TextTokenizer>,
) -> Result<Vec<Completion>> {
    generate_with_processor(model, prompts, seeds, params, tokenizer, None)
}

/// [`generate`] with a [`LogitsProcessor`] applied to every row's logits before sampling.
pub fn generate_with_processor(
    model: &Transformer,
    prompts: &[Vec<u32>],
    seeds: &[u64],
    params: &SamplingParams,
    tokenizer: Option<&TextTokenizer>,
    processor: Option<&mut dyn LogitsProcessor>,
) -> Result<Vec<Completion>> {
    generate_rows(model, prompts, seeds, params, None, tokenizer, processor)
}

/// [`generate`] with a token budget per row: row `i` generates at most
/// `min(params.max_new_tokens, budgets[i])` tokens, so no row's budget limits another row's
/// (the episodes of a multi-turn rollout batch each have their own response room left).
pub fn generate_with_budgets(
    model: &Transformer,
    prompts: &[Vec<u32>],
    seeds: &[u64],
    params: &SamplingParams,
    budgets: &[usize],
    tokenizer: Option<&TextTokenizer>,
) -> Result<Vec<Completion>> {
    generate_rows(
        model,
        prompts,
        seeds,
        params,
        Some(budgets),
        tokenizer,
        None,
    )
}

/// [`generate_with_budgets`] over contexts whose first tokens may already have keys and values
/// (a multi-turn episode's context after its last turn): row `i` starts from `prefixes[i]`
/// where it matches the row's prompt (the longest common prefix is used; a prefix that does not
/// match costs nothing but its check) and prefills only the rest. Returns each row's completion
/// with the keys and values of its whole context after the turn (prompt and generated tokens
/// but the last), for the next turn. Tokens and log-probs equal a fresh prefill's to float
/// rounding (about 1e-6).
pub fn generate_with_prefixes(
    model: &Transformer,
    prompts: &[Vec<u32>],
    prefixes: &[Option<PrefixKv>],
    seeds: &[u64],
    params: &SamplingParams,
    budgets: &[usize],
    tokenizer: Option<&TextTokenizer>,
) -> Result<Vec<(Completion, Option<PrefixKv>)>> {
    if prefixes.len() != prompts.len() {
        return Err(ModelError::invalid_input(
            "prefixes",
            format!("{} prefixes for {} prompts", prefixes.len(), prompts.len()),
        ));
    }
    generate_rows_kv(
        model,
        prompts,
        Some(prefixes),
        seeds,
        params,
        Some(budgets),
        tokenizer,
        None,
    )
}

/// The keys and values of `tokens` under `model` (e.g. the prompt a group's episodes share),
/// computed once, to start several sequences from ([`generate_with_prefixes`]); `None` when
/// the model's context has no room to run them (`tokens` fill it).
pub fn prefill_prefix(model: &Transformer, tokens: &[u32]) -> Result<Option<PrefixKv>> {
    if tokens.is_empty() {
        return Err(ModelError::invalid_input("tokens", "is empty"));
    }
    let mut engine = SamplingEngine::new(model, None, EngineConfig::with_max_batch_size(1));
    let params = SequenceParams {
        sampling: SamplingParams {
            temperature: 0.0,
            max_new_tokens: 1,
            ..Default::default()
        },
        confidence_top_j: 0,
        ..Default::default()
    };
    let id = engine.add_sequence(tokens.to_vec(), params, 0)?;
    engine.run_until_stop(None)?;
    Ok(engine.prefix_of(id).filter(|p| p.len() == tokens.len()))
}

/// [`generate_with_processor`], with an optional per-row token budget (see
/// [`generate_with_budgets`]).
fn generate_rows(
    model: &Transformer,
    prompts: &[Vec<u32>],
    seeds: &[u64],
    params: &SamplingParams,
    budgets: Option<&[usize]>,
    tokenizer: Option<&TextTokenizer>,
    processor: Option<&mut dyn LogitsProcessor>,
) -> Result<Vec<Completion>> {
    Ok(generate_rows_kv(
        model, prompts, None, seeds, params, budgets, tokenizer, processor,
    )?
    .into_iter()
    .map(|(c, _)| c)
    .collect())
}

/// [`generate_rows`] with optional per-row prefixes; returns each row's context cache when
/// `prefixes` is given (see [`generate_with_prefixes`]).
#[allow(clippy::too_many_arguments)]
fn generate_rows_kv(
    model: &Transformer,
    prompts: &[Vec<u32>],
    prefixes: Option<&[Option<PrefixKv>]>,
    seeds: &[u64],
    params: &SamplingParams,
    budgets: Option<&[usize]>,
    tokenizer: Option<&TextTokenizer>,
    processor: Option<&mut dyn LogitsProcessor>,
) -> Result<Vec<(Completion, Option<PrefixKv>)>> {
    params.validate()?;
    if prompts.len() != seeds.len() {
        return Err(ModelError::invalid_input(
            "seeds",
            format!("{} seeds for {} prompts", seeds.len(), prompts.len()),
        ));
    }
    if let Some(b) = budgets.filter(|b| b.len() != prompts.len()) {
        return Err(ModelError::invalid_input(
            "budgets",
            format!("{} token budgets for {} prompts", b.len(), prompts.len()),
        ));
    }
    if let Some((i, _)) = prompts.iter().enumerate().find(|(_, p)| p.is_empty()) {
        return Err(ModelError::invalid_input(
            "prompts",
            format!("prompt {i} is empty"),
        ));
    }
    if !params.stop_strings.is_empty() && tokenizer.is_none() {
        return Err(ModelError::invalid_input(
            "tokenizer",
            "stop strings need a tokenizer",
        ));
    }
    let vocab = model.config().vocab_size as u32;
    if let Some(bad) = prompts.iter().flatten().find(|&&t| t >= vocab) {
        return Err(ModelError::invalid_input(
            "prompts",
            format!("token id {bad} >= vocab_size {vocab}"),
        ));
    }
    if prompts.is_empty() || params.max_new_tokens == 0 {
        return Ok(prompts
            .iter()
            .map(|_| (Completion::empty(), None))
            .collect());
    }
    // On the CPU, a small model's decode step is mostly single-threaded per-op work: rows cut
    // into one shard per core, each on its own engine and thread, run side by side. Every row
    // keeps its own seed, so a row's draws do not depend on the shard it lands in beyond the
    // rounding of batched matmuls (a left-padded row matches the same row alone to ~1e-6).
    let shards = generation_shards(model, prompts.len());
    if processor.is_none() && shards > 1 {
        return sharded(prompts.len(), shards, |rows| {
            let p: Vec<Vec<u32>> = rows.iter().map(|&i| prompts[i].clone()).collect();
            let sd: Vec<u64> = rows.iter().map(|&i| seeds[i]).collect();
            let b: Option<Vec<usize>> = budgets.map(|b| rows.iter().map(|&i| b[i]).collect());
            let pre: Option<Vec<Option<PrefixKv>>> =
                prefixes.map(|x| rows.iter().map(|&i| x[i].clone()).collect());
            run_engine(
                model,
                &p,
                pre.as_deref(),
                &sd,
                params,
                b.as_deref(),
                tokenizer,
                None,
            )
        });
    }
    run_engine(
        model, prompts, prefixes, seeds, params, budgets, tokenizer, processor,
    )
}

/// The batch of [`generate_rows_kv`] (inputs already checked) on one engine.
#[allow(clippy::too_many_arguments)]
fn run_engine(
    model: &Transformer,
    prompts: &[Vec<u32>],
    prefixes: Option<&[Option<PrefixKv>]>,
    seeds: &[u64],
    params: &SamplingParams,
    budgets: Option<&[usize]>,
    tokenizer: Option<&TextTokenizer>,
    processor: Option<&mut dyn LogitsProcessor>,
) -> Result<Vec<(Completion, Option<PrefixKv>)>> {
    let mut out: Vec<(Completion, Option<PrefixKv>)> = prompts
        .iter()
        .map(|_| (Completion::empty(), None))
        .collect();
    let mut engine = SamplingEngine::new(model, tokenizer, EngineConfig::with_max_batch_size(0));
    let seq_params = SequenceParams {
        sampling: params.clone(),
        max_generated_tokens: None,
        max_len: None,
        confidence_top_j: 0,
        guided_choice: None,
        single_turn: false,
    };
    for (i, (p, &seed)) in prompts.iter().zip(seeds).enumerate() {
        let mut sp = seq_params.clone();
        if let Some(b) = budgets {
            sp.sampling.max_new_tokens = sp.sampling.max_new_tokens.min(b[i]);
        }
        let prefix = prefixes.and_then(|x| x[i].as_ref());
        engine.add_sequence_with_prefix(p.clone(), sp, seed, prefix)?;
    }
    let mut adapter = processor.map(|inner| ProcessorHook { inner });
    engine.run_until_stop(adapter.as_mut().map(|h| h as &mut dyn TokenHook))?;
    for (i, (c, kv)) in out.iter_mut().enumerate() {
        if prefixes.is_some() {
            *kv = engine.prefix_of(SeqId(i as u64));
        }
        let seq = engine.remove(SeqId(i as u64))?;
        let start = seq.prompt_len;
        c.tokens = seq.tokens[start..].to_vec();
        c.logprobs = seq.logprobs[start..].to_vec();
        c.entropies = seq.entropies[start..].to_vec();
        c.top_logprobs = seq.top_logprobs[start..].to_vec();
        if let SeqStatus::Paused(reason) = &seq.status {
            c.finish = reason.finish_reason();
        }
    }
    Ok(out)
}

/// Rows per shard below which [`generate`] keeps a batch on one thread.
const MIN_ROWS_PER_SHARD: usize = 4;

/// How many shards [`generate`] cuts `rows` prompts into: one per thread of rayon's pool on
/// the CPU (at least [`MIN_ROWS_PER_SHARD`] rows each), one on an accelerator. Callers that run
/// their own [`SamplingEngine`]s (the T2PO rollout control) shard their rows by the same rule.
pub fn generation_shards(model: &Transformer, rows: usize) -> usize {
    if !model.device().is_cpu() {
        return 1;
    }
    rayon::current_num_threads()
        .min(rows / MIN_ROWS_PER_SHARD)
        .max(1)
}

/// Runs `f` on `shards` interleaved subsets of the rows `0..rows` (shard `s` holds the rows
/// `s, s + shards, …`) side by side on rayon's pool, and puts each shard's outputs (one per
/// row, in the order of its rows) back in row order. The first error of any shard is returned.
pub fn sharded<T, E, F>(rows: usize, shards: usize, f: F) -> std::result::Result<Vec<T>, E>
where
    T: Send,
    E: Send,
    F: Fn(&[usize]) -> std::result::Result<Vec<T>, E> + Sync,
{
    let shards = shards.max(1);
    let parts: Vec<Vec<usize>> = (0..shards)
        .map(|s| (s..rows).step_by(shards).collect())
        .collect();
    let done = parts
        .par_iter()
        .map(|part| f(part))
        .collect::<std::result::Result<Vec<_>, E>>()?;
    let mut out: Vec<Option<T>> = (0..rows).map(|_| None).collect();
    for (part, outputs) in parts.iter().zip(done) {
        assert_eq!(
            outputs.len(),
            part.len(),
            "a shard returned {} outputs for {} rows",
            outputs.len(),
            part.len()
        );
        for (&i, o) in part.iter().zip(outputs) {
            out[i] = Some(o);
        }
    }
    Ok(out.into_iter().flatten().collect())
}

/// Adapts a [`LogitsProcessor`] (indexed by prompt) to a [`TokenHook`] of an engine whose
/// sequence ids are the prompt indices.
struct ProcessorHook<'p> {
    inner: &'p mut dyn LogitsProcessor,
}

impl TokenHook for ProcessorHook<'_> {
    fn process(&mut self, seq: &Sequence, logits: &mut [f32]) -> Option<u32> {
        self.inner
            .process(seq.id.0 as usize, seq.turn_tokens(), logits);
        None
    }
}

fn mask_tensor(mask: &[Vec<u8>], device: &Device) -> Result<Tensor> {
    let t = mask.first().map_or(0, Vec::len);
    let flat: Vec<u8> = mask.iter().flatten().copied().collect();
    Ok(Tensor::from_vec(flat, (mask.len(), t), device)?)
}

fn stop_string_hit(
    tokenizer: Option<&TextTokenizer>,
    stops: &[String],
    tokens: &[u32],
) -> Result<Option<usize>> {
    let Some(tok) = tokenizer else {
        return Ok(None);
    };
    if stops.is_empty() {
        return Ok(None);
    }
    // Every token is at least one byte, so a stop string of L bytes that ends with the newest
    // token lies within the last L tokens (+2 for a UTF-8 sequence split across tokens); earlier
    // occurrences were caught at earlier steps. Decoding only that tail keeps each check O(L).
    let longest = stops.iter().map(String::len).max().unwrap_or(0);
    let tail = &tokens[tokens.len().saturating_sub(longest + 2)..];
    let text = tok.decode(tail, false)?;
    Ok(stops.iter().position(|s| text.contains(s.as_str())))
}

/// One sampled token with its statistics.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenDraw {
    /// The token id.
    pub token: u32,
    /// Its log-probability under the temperature-scaled softmax.
    pub logprob: f32,
    /// Entropy of that distribution.
    pub entropy: f32,
    /// The `top_logprobs` most likely `(token, log-prob)` pairs, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// Draws one token from a row of logits (which must contain a finite entry).
///
/// Plain temperature sampling (`top_k == 0`, `top_p >= 1`) draws by inverse CDF over the
/// vocabulary in index order, in one pass and without sorting. Top-k and top-p sort only the
/// candidates they may keep (the `top_k` best found by partial selection; for top-p alone, the
/// tokens of the log-probability histogram buckets needed to reach `top_p`), and draw in that
/// most-likely-first order, as a full sort would. Tokens of probability 0 are never drawn.
pub fn sample_row(logits: &[f32], params: &SamplingParams, rng: &mut TurnRng) -> TokenDraw {
    let dist = Dist::new(logits, params.temperature);
    // Most likely first (ties by index), exactly a prefix of the fully sorted vocabulary.
    let mut prefix: Option<Vec<usize>> = None;
    let token = if params.temperature == 0.0 {
        argmax(&dist.logp)
    } else if params.top_k == 0 && params.top_p >= 1.0 {
        dist.draw_in_index_order(rng)
    } else {
        let cand = prefix.insert(dist.truncated_candidates(params.top_k, params.top_p));
        let mut k = cand.len();
        if params.top_p < 1.0 {
            let mut mass = 0.0;
            for (n, &i) in cand.iter().enumerate() {
                mass += dist.probs[i];
                if mass >= params.top_p {
                    k = n + 1;
                    break;
                }
            }
        }
        dist.draw_from(&cand[..k.max(1)], rng)
    };
    let n = params.top_logprobs;
    let top = match &prefix {
        _ if n == 0 => Vec::new(),
        Some(p) if p.len() >= n.min(dist.logp.len()) => top_pairs(&dist.logp, p, n),
        _ => top_pairs(&dist.logp, &top_n_desc(&dist.logp, n), n),
    };
    TokenDraw {
        token: token as u32,
        logprob: dist.logp[token] as f32,
        entropy: dist.entropy as f32,
        top,
    }
}

/// The temperature-scaled distribution of one row, in f64.
struct Dist {
    /// Log-softmax of `logits / temperature` (temperature 0 counts as 1).
    logp: Vec<f64>,
    /// `exp(logp)`, entry by entry (0 for forbidden tokens).
    probs: Vec<f64>,
    /// Sum of `probs` in index order.
    total: f64,
    /// Entropy of the distribution.
    entropy: f64,
}

impl Dist {
    fn new(logits: &[f32], temperature: f64) -> Self {
        let temp = if temperature > 0.0 { temperature } else { 1.0 };
        let mut logp: Vec<f64> = logits.iter().map(|&x| x as f64 / temp).collect();
        let max = logp.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        // One exp per token: e = exp(x − max), then p = e / Σe and log p = (x − max) − ln Σe.
        let mut probs: Vec<f64> = logp.iter().map(|x| (x - max).exp()).collect();
        let sum: f64 = probs.iter().sum();
        let (log_sum, inv_sum) = (sum.ln(), 1.0 / sum);
        let (mut total, mut plogp) = (0.0, 0.0);
        for (l, p) in logp.iter_mut().zip(probs.iter_mut()) {
            *l = (*l - max) - log_sum;
            *p *= inv_sum;
            total += *p;
            plogp += if l.is_finite() { *p * *l } else { 0.0 };
        }
        Self {
            logp,
            probs,
            total,
            entropy: -plogp,
        }
    }

    /// Inverse-CDF draw over the whole vocabulary in index order.
    fn draw_in_index_order(&self, rng: &mut TurnRng) -> usize {
        self.draw_inverse_cdf(0..self.probs.len(), self.total, rng)
    }

    /// Inverse-CDF draw among `kept` (in that order), proportionally to their probabilities.
    fn draw_from(&self, kept: &[usize], rng: &mut TurnRng) -> usize {
        let total: f64 = kept.iter().map(|&i| self.probs[i]).sum();
        self.draw_inverse_cdf(kept.iter().copied(), total, rng)
    }

    /// Inverse-CDF draw over `order`, whose probabilities sum to `total`; tokens of
    /// probability 0 are skipped.
    fn draw_inverse_cdf(
        &self,
        order: impl IntoIterator<Item = usize>,
        total: f64,
        rng: &mut TurnRng,
    ) -> usize {
        let mut u = rng.next_f64() * total;
        let mut order = order.into_iter().peekable();
        let mut last = order.peek().copied().unwrap_or(0);
        for i in order {
            let p = self.probs[i];
            if p > 0.0 {
                if u < p {
                    return i;
                }
                u -= p;
                last = i;
            }
        }
        // Only reached through rounding: the last token that can be drawn.
        last
    }

    /// The most likely tokens, most likely first (ties by index), that top-k and top-p may keep:
    /// the `top_k` best when `top_k > 0`; otherwise every token whose log-probability lies in
    /// the same or a higher bucket (of [`TOP_P_BUCKETS_PER_NAT`] per nat below the most likely
    /// token) as the token where the mass reaches `top_p`. Both are exact prefixes of the fully
    /// sorted vocabulary; only the candidates are sorted.
    fn truncated_candidates(&self, top_k: usize, top_p: f64) -> Vec<usize> {
        let v = self.logp.len();
        if top_k > 0 {
            return top_n_desc(&self.logp, top_k);
        }
        let max = self.logp.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        if self.total.is_nan() || !max.is_finite() {
            return top_n_desc(&self.logp, v);
        }
        // Monotone in the log-probability (IEEE rounding is), so a set of leading buckets is a
        // prefix of the sorted order, ties included; -inf lands in the last bucket.
        let bucket = |l: f64| (((max - l) * TOP_P_BUCKETS_PER_NAT) as usize).min(TOP_P_BUCKETS - 1);
        let mut mass = vec![0.0f64; TOP_P_BUCKETS];
        for (&l, &p) in self.logp.iter().zip(&self.probs) {
            mass[bucket(l)] += p;
        }
        let mut acc = 0.0;
        let Some(cut) = mass.iter().position(|&m| {
            acc += m;
            acc >= top_p
        }) else {
            return top_n_desc(&self.logp, v);
        };
        if cut == TOP_P_BUCKETS - 1 {
            return top_n_desc(&self.logp, v);
        }
        let cmp = |a: &usize, b: &usize| self.logp[*b].total_cmp(&self.logp[*a]).then(a.cmp(b));
        let mut cand: Vec<usize> = (0..v).filter(|&i| bucket(self.logp[i]) <= cut).collect();
        cand.sort_unstable_by(cmp);
        // The caller accumulates in sorted order; rounding may leave that sum just short of the
        // per-bucket one, and then only the whole vocabulary is sure to reach `top_p`.
        let sorted_mass: f64 = cand.iter().map(|&i| self.probs[i]).sum();
        if sorted_mass >= top_p {
            cand
        } else {
            top_n_desc(&self.logp, v)
        }
    }
}

/// Resolution of the log-probability histogram that finds the top-p candidates.
const TOP_P_BUCKETS_PER_NAT: f64 = 32.0;
/// Histogram buckets: 32 nats below the most likely token, the last one holding everything lower.
const TOP_P_BUCKETS: usize = 1024;

/// Indices of the `n` most likely entries of `logp`, most likely first (ties by index), without
/// sorting the whole vector: for small `n` one pass keeping a sorted buffer of the best so far,
/// otherwise partial selection (`select_nth_unstable_by`) then a sort of the `n` selected.
fn top_n_desc(logp: &[f64], n: usize) -> Vec<usize> {
    let cmp = |a: &usize, b: &usize| logp[*b].total_cmp(&logp[*a]).then(a.cmp(b));
    let len = logp.len();
    let n = n.min(len);
    if n == 0 {
        return Vec::new();
    }
    if n * 32 <= len {
        let mut best: Vec<usize> = Vec::with_capacity(n + 1);
        for i in 0..len {
            // Indices come in increasing order, so a tie with the current worst loses.
            if best.len() == n && logp[i].total_cmp(&logp[best[n - 1]]).is_le() {
                continue;
            }
            let at = best.partition_point(|j| cmp(j, &i).is_lt());
            best.insert(at, i);
            best.truncate(n);
        }
        return best;
    }
    let mut idx: Vec<usize> = (0..len).collect();
    if n < len {
        idx.select_nth_unstable_by(n, cmp);
        idx.truncate(n);
    }
    idx.sort_by(cmp);
    idx
}

fn top_pairs(logp: &[f64], order: &[usize], n: usize) -> Vec<(u32, f32)> {
    order
        .iter()
        .take(n)
        .map(|&i| (i as u32, logp[i] as f32))
        .collect()
}

/// The statistics [`sample_row`] would report for `token` (forced rather than drawn; no random
/// number is used).
pub fn forced_row(logits: &[f32], params: &SamplingParams, token: u32) -> TokenDraw {
    let dist = Dist::new(logits, params.temperature);
    let top = if params.top_logprobs > 0 {
        top_pairs(
            &dist.logp,
            &top_n_desc(&dist.logp, params.top_logprobs),
            params.top_logprobs,
        )
    } else {
        Vec::new()
    };
    TokenDraw {
        token,
        logprob: dist.logp[token as usize] as f32,
        entropy: dist.entropy as f32,
        top,
    }
}

fn argmax(v: &[f64]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests;
