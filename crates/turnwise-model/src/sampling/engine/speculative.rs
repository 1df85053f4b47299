//! Lossless speculative decoding by prompt lookup ([`super::EngineConfig::speculative`]).
//!
//! After a running row's token `t0` is drawn as usual, the row proposes up to `max_draft`
//! draft tokens `d1..dk`: what followed the most recent earlier occurrence of its last `n`
//! tokens (`n` from `ngram_max` down to `ngram_min`) in its own tokens (prompt, observations
//! and generated tokens), capped by what its turn may still generate. Drafts come from the
//! row's own tokens only, so a row's output never depends on its batch. One forward runs
//! `[t0, d1..dk]` for every row (a row with fewer drafts has masked padding columns), giving the
//! policy's logits `L0..Lk` after each prefix.
//!
//! Verification draws, for `j = 1..k` in order, `x_j` from `L_{j-1}` exactly as plain decoding
//! would ([`sample_row`] with the row's own parameters and generator), and accepts `d_j` while
//! `x_j == d_j`. This is standard speculative sampling with a point-mass draft (`q = δ_{d_j}`):
//! `d_j` is accepted with probability `p_j(d_j)`, and on rejection the next token `x_j` is
//! distributed as `p_j` without `d_j`, renormalised (the residual `max(0, p_j − q)`), so every
//! token's marginal is exactly `p_j` — the truncated, renormalised distribution `sample_row`
//! draws from (temperature, top-k, top-p). Greedy (temperature 0) is the special case
//! `x_j = argmax`. Each generated token uses one draw of the row's generator, as in plain
//! decoding, so a seed gives the same tokens with or without speculation (up to the rounding
//! of the logits, about 1e-6). The rejecting draw `x_j` is carried to the next step as the
//! row's next token (`SamplingEngine::carried`), drawn from the stored logits `L_{j-1}` with no
//! new random number; a hook that edits those logits or forces a token in that step replaces
//! it.
//!
//! Every accepted token is [`TokenOrigin::Sampled`] and records exactly what [`sample_row`]
//! records for it (its log-prob, entropy, top-j confidence and top log-probs under the policy's
//! distribution), and runs the same stop checks as a plain step, in order; the first stop ends
//! the turn and drops the rest. Rejected drafts' cache columns get mask 0 (trailing ones that no
//! row uses are dropped); the row's next logits are those after its last accepted token.

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::{
    BTreeMap, DType, KV_RESERVE, LayerKv, ModelError, PARALLEL_DRAW_MIN_ENTRIES, Result,
    SamplingEngine, SeqId, SeqState, StopReason, Tensor, TokenOrigin, TurnEnd, real_columns,
    sample_row, top_j_confidence, turn_left, turn_stop,
};
use crate::tokenizer::TextTokenizer;

/// Speculative decoding by prompt lookup (see [`EngineConfig::speculative`]).
///
/// [`EngineConfig::speculative`]: super::EngineConfig::speculative
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpeculativeConfig {
    /// Most draft tokens proposed and verified per row and step (at least 1).
    pub max_draft: usize,
    /// Longest suffix of a row's tokens looked up in its earlier tokens (at least
    /// `ngram_min`).
    pub ngram_max: usize,
    /// Shortest suffix looked up (at least 1).
    pub ngram_min: usize,
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        Self {
            max_draft: 4,
            ngram_max: 3,
            ngram_min: 1,
        }
    }
}

impl SpeculativeConfig {
    /// Checks the values (errors name the key, `speculative.<field>`).
    pub fn validate(&self) -> Result<()> {
        if self.max_draft == 0 {
            return Err(ModelError::invalid_input(
                "speculative.max_draft",
                "must be at least 1",
            ));
        }
        if self.ngram_min == 0 {
            return Err(ModelError::invalid_input(
                "speculative.ngram_min",
                "must be at least 1",
            ));
        }
        if self.ngram_max < self.ngram_min {
            return Err(ModelError::invalid_input(
                "speculative.ngram_max",
                format!(
                    "{} is below speculative.ngram_min = {}",
                    self.ngram_max, self.ngram_min
                ),
            ));
        }
        Ok(())
    }
}

/// Up to `cap` tokens that followed the most recent earlier occurrence of the last `n` tokens
/// of `tokens`, for the longest `n` in `ngram_max..=ngram_min` that occurs earlier.
pub(super) fn prompt_lookup(tokens: &[u32], cfg: &SpeculativeConfig, cap: usize) -> Vec<u32> {
    let len = tokens.len();
    let cap = cap.min(cfg.max_draft);
    if cap == 0 {
        return Vec::new();
    }
    for n in (cfg.ngram_min..=cfg.ngram_max).rev() {
        if n >= len {
            continue;
        }
        let suffix = &tokens[len - n..];
        if let Some(s) = (0..len - n).rev().find(|&s| &tokens[s..s + n] == suffix) {
            return tokens[s + n..(s + n + cap).min(len)].to_vec();
        }
    }
    Vec::new()
}

/// A token carried over from the last step's verification, with the row's logits as they were
/// before this step's hook (only kept when a hook is given).
pub(super) struct Carried {
    token: u32,
    before: Option<Vec<f32>>,
}

impl Carried {
    /// The carried token, unless this step's hook (or constraint) changed the logits it was
    /// drawn from: then the row draws afresh from the edited logits.
    pub(super) fn token_if_unchanged(self, logits: &[f32]) -> Option<(u32, TokenOrigin)> {
        match &self.before {
            Some(b) if b.as_slice() != logits => None,
            _ => Some((self.token, TokenOrigin::Sampled)),
        }
    }
}

/// Takes the token carried over for row `id`, if any (copying its logits when a hook will see
/// them, to tell whether it edits them).
pub(super) fn take_carried(
    carried: &mut BTreeMap<SeqId, u32>,
    id: SeqId,
    hooked: bool,
    logits: &[f32],
) -> Option<Carried> {
    carried.remove(&id).map(|token| Carried {
        token,
        before: hooked.then(|| logits.to_vec()),
    })
}

/// The outcome of one row's verification.
struct Verdict {
    /// Drafts accepted (pushed to the sequence).
    accepted: usize,
    /// Why the turn ended at the last accepted draft, if it did.
    stop: Option<StopReason>,
    /// The draw that rejected a draft: the row's next token.
    carried: Option<u32>,
}

/// Verifies `drafts` of running sequence `st` against `logits` (`logits[j]`: the policy's
/// logits after the row's newest token and `drafts[..j]`), pushing the accepted ones.
fn verify_row(
    st: &mut SeqState,
    drafts: &[u32],
    logits: &[Vec<f32>],
    tokenizer: Option<&TextTokenizer>,
    max_pos: usize,
) -> Result<Verdict> {
    let mut v = Verdict {
        accepted: 0,
        stop: None,
        carried: None,
    };
    for (&d, l) in drafts.iter().zip(logits) {
        // The draw plain decoding would make here: accepting `d` iff it equals the draw
        // accepts with probability p(d) and leaves the draw distributed as the residual.
        let mut draw = sample_row(l, &st.draw, &mut st.rng);
        if draw.token != d {
            v.carried = Some(draw.token);
            break;
        }
        let conf = top_j_confidence(&draw.top, st.seq.params.confidence_top_j);
        draw.top.truncate(st.seq.params.sampling.top_logprobs);
        st.seq.push(d, TokenOrigin::Sampled, Some((&draw, conf)));
        st.generated += 1;
        v.accepted += 1;
        if let Some(reason) = turn_stop(tokenizer, st, max_pos)? {
            v.stop = Some(reason);
            break;
        }
    }
    Ok(v)
}

impl SamplingEngine<'_> {
    /// [`SamplingEngine::decode_running`] with drafts: runs every running row's newest token
    /// and its drafts through the model in one forward, then verifies and accepts drafts row
    /// by row (see the module docs). Turns that end on an accepted draft are pushed to `ends`.
    pub(super) fn decode_speculative(
        &mut self,
        spec: &SpeculativeConfig,
        ends: &mut Vec<TurnEnd>,
    ) -> Result<()> {
        let n = self.batch.rows.len();
        if n == 0 {
            return Ok(());
        }
        let max_pos = self.model.config().max_position_embeddings;
        let drafts: Vec<Vec<u32>> = self
            .batch
            .rows
            .iter()
            .map(|id| {
                let st = &self.seqs[id];
                if st.choice.is_some() {
                    return Vec::new();
                }
                prompt_lookup(&st.seq.tokens, spec, turn_left(st, max_pos))
            })
            .collect();
        let t = 1 + drafts.iter().map(Vec::len).max().unwrap_or(0);
        if t == 1 {
            return self.decode_running();
        }
        // 1. One forward of `[t0, d1..dk]` per row, right-padded to `t` columns with mask 0.
        let device = self.model.device().clone();
        let mut ids = Vec::with_capacity(n * t);
        let mut pos = Vec::with_capacity(n * t);
        let mut real = Vec::new();
        for (r, (id, d)) in self.batch.rows.iter().zip(&drafts).enumerate() {
            let toks = &self.seqs[id].seq.tokens;
            let p0 = (toks.len() - 1) as u32;
            ids.push(*toks.last().expect("sequences are never empty"));
            ids.extend(d.iter().copied());
            ids.extend(std::iter::repeat_n(0u32, t - 1 - d.len()));
            pos.extend((0..=d.len() as u32).map(|i| p0 + i));
            pos.extend(std::iter::repeat_n(0u32, t - 1 - d.len()));
            real.extend((0..=d.len()).map(|i| (r * t + i) as u32));
            let m = &mut self.batch.mask[r];
            m.extend(std::iter::repeat_n(1u8, 1 + d.len()));
            m.extend(std::iter::repeat_n(0u8, t - 1 - d.len()));
        }
        let hidden = self.forward_on_batch(
            Tensor::from_vec(ids, (n, t), &device)?,
            Tensor::from_vec(pos, (n, t), &device)?,
        )?;
        let h = hidden.dim(2)?;
        let n_real = real.len();
        // Only the real positions go through the output projection.
        let hidden = hidden
            .reshape((n * t, h))?
            .index_select(&Tensor::from_vec(real, n_real, &device)?, 0)?;
        let mut logits = self
            .model
            .logits(&hidden)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        let drafted: usize = drafts.iter().map(Vec::len).sum();
        self.stats.decode_tokens += n_real as u64;
        self.stats.drafted_tokens += drafted as u64;
        // 2. Verification: each row reads only its own logits, generator and tokens.
        let mut per_row: Vec<Vec<Vec<f32>>> = Vec::with_capacity(n);
        for d in drafts.iter().rev() {
            per_row.push(logits.split_off(logits.len() - 1 - d.len()));
        }
        per_row.reverse();
        let row_of = self.row_index();
        let mut work: Vec<(usize, &mut SeqState)> = self
            .seqs
            .iter_mut()
            .filter_map(|(id, st)| row_of.get(id).map(|&r| (r, st)))
            .collect();
        work.sort_by_key(|w| w.0);
        let tokenizer = self.tokenizer;
        let one = |(r, st): &mut (usize, &mut SeqState)| {
            verify_row(st, &drafts[*r], &per_row[*r], tokenizer, max_pos)
        };
        let entries = drafted * per_row.first().map_or(0, |l| l[0].len());
        let verdicts: Vec<Verdict> =
            if n > 1 && entries >= PARALLEL_DRAW_MIN_ENTRIES && rayon::current_num_threads() > 1 {
                work.par_iter_mut().map(one).collect::<Result<_>>()?
            } else {
                work.iter_mut().map(one).collect::<Result<_>>()?
            };
        drop(work);
        // 3. Each row's columns after its last cached token get mask 0; its next logits are
        // those after its last accepted token.
        let width = self.batch.width();
        let mut used_max = 0;
        let mut keep = Vec::with_capacity(n);
        let mut stopped = Vec::new();
        let mut next = Vec::with_capacity(n);
        for (r, (v, mut l)) in verdicts.into_iter().zip(per_row).enumerate() {
            let id = self.batch.rows[r];
            self.stats.accepted_tokens += v.accepted as u64;
            self.stats.sampled_tokens += v.accepted as u64;
            // Cached: t0 and the accepted drafts, but a stopping token (not run, as in a
            // plain step).
            let used = 1 + v.accepted - usize::from(v.stop.is_some());
            used_max = used_max.max(used);
            for m in &mut self.batch.mask[r][width - t + used..] {
                *m = 0;
            }
            match v.stop {
                Some(reason) => {
                    stopped.push((r, reason));
                    next.push(Vec::new());
                }
                None => {
                    keep.push(r);
                    next.push(std::mem::take(&mut l[v.accepted]));
                    if let Some(x) = v.carried {
                        self.carried.insert(id, x);
                    }
                }
            }
        }
        self.batch.logits = next;
        // Trailing columns no row uses are dropped (no copy: the next step writes over them).
        let unused = t - used_max;
        if unused > 0 {
            if let Some(layers) = self.batch.layers.take() {
                self.batch.layers = Some(
                    layers
                        .into_iter()
                        .map(|l| {
                            let (k, v) = l.buffers();
                            LayerKv::from_buffers(k.clone(), v.clone(), l.len() - unused)
                        })
                        .collect(),
                );
            }
            for m in &mut self.batch.mask {
                m.truncate(width - unused);
            }
        }
        for (r, reason) in stopped {
            self.end_turn(r, reason, ends)?;
        }
        self.keep_rows(&keep)?;
        self.compact_columns()
    }

    /// Rows that accept fewer drafts than another row of their step keep masked columns; when
    /// these make the batch [`KV_RESERVE`] columns wider than its longest row, each row's real
    /// columns are moved (in order) to the right edge of a batch as wide as its longest row, so
    /// the cache stays within what plain decoding (and the memory budget's estimate) would use.
    /// Attention sees the same keys in the same order.
    fn compact_columns(&mut self) -> Result<()> {
        let width = self.batch.width();
        let real: Vec<usize> = self
            .batch
            .mask
            .iter()
            .map(|m| m.iter().filter(|&&x| x != 0).count())
            .collect();
        let w = real.iter().copied().max().unwrap_or(0);
        if width < w + KV_RESERVE {
            return Ok(());
        }
        let Some(layers) = self.batch.layers.take() else {
            return Ok(());
        };
        let device = self.model.device().clone();
        let n = real.len();
        let cap = layers.first().map_or(0, |l| l.buffers().0.dims()[2]);
        // Row r's real columns in order, left-padded (with its own first column, masked) to `w`.
        let mut idx = Vec::with_capacity(n * w);
        for (r, m) in self.batch.mask.iter().enumerate() {
            let base = (r * cap) as u32;
            idx.extend(std::iter::repeat_n(base, w - real[r]));
            idx.extend(real_columns(m).into_iter().map(|j| base + j));
        }
        let idx = Tensor::from_vec(idx, n * w, &device)?;
        let gather = |t: &Tensor| -> Result<Tensor> {
            let (b, h, c, d) = t.dims4()?;
            Ok(t.transpose(1, 2)?
                .contiguous()?
                .reshape((b * c, h * d))?
                .index_select(&idx, 0)?
                .reshape((b, w, h, d))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        self.batch.layers = Some(
            layers
                .iter()
                .map(|l| {
                    let (k, v) = l.buffers();
                    LayerKv::exact(gather(k)?, gather(v)?)
                })
                .collect::<Result<Vec<_>>>()?,
        );
        for (m, &c) in self.batch.mask.iter_mut().zip(&real) {
            *m = std::iter::repeat_n(0u8, w - c)
                .chain(std::iter::repeat_n(1u8, c))
                .collect();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
