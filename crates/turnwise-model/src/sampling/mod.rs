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
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};
use crate::model::Transformer;
use crate::rng::TurnRng;
use crate::tokenizer::TextTokenizer;

pub mod engine;

pub use engine::{
    DEFAULT_CONFIDENCE_TOP_J, EngineConfig, EngineStats, SamplingEngine, SeqId, SeqStatus,
    Sequence, SequenceParams, StopReason, TokenHook, TokenOrigin, TurnEnd, top_j_confidence,
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
    params.validate()?;
    if prompts.len() != seeds.len() {
        return Err(ModelError::invalid_input(
            "seeds",
            format!("{} seeds for {} prompts", seeds.len(), prompts.len()),
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
    let mut out: Vec<Completion> = prompts
        .iter()
        .map(|_| Completion {
            tokens: Vec::new(),
            logprobs: Vec::new(),
            entropies: Vec::new(),
            top_logprobs: Vec::new(),
            finish: FinishReason::Length,
        })
        .collect();
    if prompts.is_empty() || params.max_new_tokens == 0 {
        return Ok(out);
    }
    let mut engine = SamplingEngine::new(model, tokenizer, EngineConfig { max_batch_size: 0 });
    let seq_params = SequenceParams {
        sampling: params.clone(),
        max_generated_tokens: None,
        max_len: None,
        confidence_top_j: 0,
    };
    for (p, &seed) in prompts.iter().zip(seeds) {
        engine.add_sequence(p.clone(), seq_params.clone(), seed)?;
    }
    let mut adapter = processor.map(|inner| ProcessorHook { inner });
    engine.run_until_stop(adapter.as_mut().map(|h| h as &mut dyn TokenHook))?;
    for (i, c) in out.iter_mut().enumerate() {
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
pub fn sample_row(logits: &[f32], params: &SamplingParams, rng: &mut TurnRng) -> TokenDraw {
    let (logp, entropy) = log_softmax_entropy(logits, params.temperature);
    let mut order: Option<Vec<usize>> = None;
    let token = if params.temperature == 0.0 {
        argmax(&logp)
    } else {
        let order = order.insert(sorted_desc(&logp));
        let mut k = order.len();
        if params.top_k > 0 {
            k = k.min(params.top_k);
        }
        if params.top_p < 1.0 {
            let mut mass = 0.0;
            for (n, &i) in order.iter().enumerate().take(k) {
                mass += logp[i].exp();
                if mass >= params.top_p {
                    k = n + 1;
                    break;
                }
            }
        }
        let kept = &order[..k.max(1)];
        let total: f64 = kept.iter().map(|&i| logp[i].exp()).sum();
        let mut u = rng.next_f64() * total;
        let mut pick = kept[kept.len() - 1];
        for &i in kept {
            let p = logp[i].exp();
            if u < p {
                pick = i;
                break;
            }
            u -= p;
        }
        pick
    };
    let top = match (&order, params.top_logprobs) {
        (_, 0) => Vec::new(),
        (Some(order), n) => top_pairs(&logp, order, n),
        (None, n) => top_pairs(&logp, &top_n_desc(&logp, n), n),
    };
    TokenDraw {
        token: token as u32,
        logprob: logp[token] as f32,
        entropy: entropy as f32,
        top,
    }
}

/// Log-softmax of `logits / temperature` (temperature 0 counts as 1) and its entropy, in f64.
fn log_softmax_entropy(logits: &[f32], temperature: f64) -> (Vec<f64>, f64) {
    let temp = if temperature > 0.0 { temperature } else { 1.0 };
    let scaled: Vec<f64> = logits.iter().map(|&x| x as f64 / temp).collect();
    let max = scaled.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + scaled.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
    let logp: Vec<f64> = scaled.iter().map(|x| x - lse).collect();
    let entropy = -logp
        .iter()
        .map(|&l| if l.is_finite() { l.exp() * l } else { 0.0 })
        .sum::<f64>();
    (logp, entropy)
}

/// Indices of `logp` from most to least likely (ties by index).
fn sorted_desc(logp: &[f64]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..logp.len()).collect();
    order.sort_by(|&a, &b| logp[b].total_cmp(&logp[a]).then(a.cmp(&b)));
    order
}

/// Indices of the `n` most likely entries of `logp`, most likely first (ties by index), by
/// partial selection: O(V) rather than a full sort.
fn top_n_desc(logp: &[f64], n: usize) -> Vec<usize> {
    let cmp = |a: &usize, b: &usize| logp[*b].total_cmp(&logp[*a]).then(a.cmp(b));
    let mut idx: Vec<usize> = (0..logp.len()).collect();
    if n < idx.len() {
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
    let (logp, entropy) = log_softmax_entropy(logits, params.temperature);
    let top = if params.top_logprobs > 0 {
        top_pairs(
            &logp,
            &top_n_desc(&logp, params.top_logprobs),
            params.top_logprobs,
        )
    } else {
        Vec::new()
    };
    TokenDraw {
        token,
        logprob: logp[token as usize] as f32,
        entropy: entropy as f32,
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
