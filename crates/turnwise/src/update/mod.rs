//! Loss → optimizer: supervised steps on demonstrations and PPO-style actor updates over
//! rollout batches (mini-batches, micro-batch accumulation, a guard against non-finite
//! updates).

pub mod batch;
pub(crate) mod critic;

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use turnwise_core::metric_keys as mk;
use turnwise_model::Transformer;
use turnwise_model::loss::actor::{ActorLossConfig, ActorLossInput, compute_actor_loss};
use turnwise_model::loss::agg::AggDenominators;
use turnwise_model::loss::clip_bias::{ClipBiasRule, ClipBiasScope, ClipBiasSpace};
use turnwise_model::loss::policy::{PolicyLossInput, compute_policy_loss};
use turnwise_model::optim::{AdamW, GradAccumulator, Gradients};

use crate::shard;

pub use batch::{Packed, Row, pack, response_logprobs, response_values};

/// Result of one optimizer update.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UpdateStats {
    /// Metrics averaged over the mini-batches (verl names).
    pub metrics: BTreeMap<String, f64>,
    /// Updates skipped because the loss or gradient was not finite.
    pub skipped: usize,
    /// Updates applied.
    pub applied: usize,
    /// Per row (in the order given): how the PPO clip treated its tokens over the applied
    /// mini-batches (0 passes for a row no applied mini-batch held).
    pub row_clips: Vec<RowClips>,
    /// On-policy updates only (no behaviour log-probs given): per row, the log-probs of its
    /// response tokens under the weights before the update, from the update's own forward
    /// pass (`None` for a row whose mini-batch was skipped, and for every row of an
    /// off-policy update).
    pub forward_logp: Vec<Option<Vec<f32>>>,
}

/// How often the PPO clip was active on one row's tokens during an update.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RowClips {
    /// Applied mini-batches (over every epoch) the row was in.
    pub passes: u32,
    /// Per response token: in how many of those passes its clip was active (`l2 > l1` on a
    /// loss token, what `actor/pg_clipfrac` counts).
    pub clipped: Vec<u32>,
}

/// One supervised step: mean negative log-likelihood of the masked response tokens of `rows`.
/// Returns `(loss, grad_norm)`; a non-finite loss or gradient skips the update and returns
/// `None`.
pub fn sft_step(
    policy: &Transformer,
    opt: &mut AdamW,
    rows: &[&Row],
    lr: f64,
    grad_clip: f64,
) -> Result<Option<(f64, f64)>> {
    let n: f32 = rows
        .iter()
        .map(|r| r.loss_mask.iter().map(|&m| f32::from(m)).sum::<f32>())
        .sum::<f32>()
        .max(1.0);
    // Rows in token order, cut into contiguous shards: demonstrations that share a prefix (a
    // prompt template, one question's) meet in a shard, which runs it once.
    let mut idx: Vec<usize> = (0..rows.len()).collect();
    idx.sort_by(|&a, &b| token_order(rows[a], rows[b]));
    let vars = opt.vars();
    let k = shard::training_shard_count(policy, rows.len());
    let shards = shard::shards_in_order(&idx, k, |i| row_len(rows[i]));
    let parts = shard::map_chunks(k, &shards, |shard: &Vec<usize>| {
        let refs: Vec<&Row> = shard.iter().map(|&i| rows[i]).collect();
        let packed = pack(&refs, policy.device())?;
        let (logp, _) = response_logprobs(policy, &packed, 1.0)?;
        let loss = (logp * &packed.loss_mask)?
            .sum_all()?
            .neg()?
            .affine(1.0 / f64::from(n), 0.0)?;
        let value = f64::from(loss.to_scalar::<f32>()?);
        if !value.is_finite() {
            return Ok((None, value));
        }
        let mut acc = GradAccumulator::new();
        acc.add(&loss.backward()?, vars, 1.0)?;
        Ok((Some(acc.take()), value))
    })?;
    let mut acc = GradAccumulator::new();
    let mut value = 0.0;
    for (grads, v) in parts {
        let Some(grads) = grads else {
            return Ok(None);
        };
        value += v;
        acc.add_gradients(grads)?;
    }
    let grads = acc.take();
    let norm = grads.global_norm()?;
    if !norm.is_finite() {
        return Ok(None);
    }
    // The clip is applied as the update reads the gradients (the same bits as clipping first).
    opt.step_scaled(&grads, lr, Gradients::clip_factor(norm, grad_clip))
        .with_context(|| format!("the supervised update at lr {lr} (sft.lr or rsft.lr)"))?;
    Ok(Some((value, norm)))
}

/// Log-probs of the response tokens of `rows` under `model` without a graph, in chunks of
/// rows run side by side, shared prefixes computed once ([`logprobs_no_grad_with`]); the
/// result is in the order of `rows`.
pub fn logprobs_no_grad(
    model: &Transformer,
    rows: &[Row],
    temperature: f64,
    chunk: usize,
) -> Result<Vec<Vec<f32>>> {
    logprobs_no_grad_with(model, rows, temperature, chunk, true)
}

/// [`logprobs_no_grad`], sharing prefixes or not (`optim.share_prefix`; see
/// [`per_row_no_grad`]).
pub fn logprobs_no_grad_with(
    model: &Transformer,
    rows: &[Row],
    temperature: f64,
    chunk: usize,
    share_prefix: bool,
) -> Result<Vec<Vec<f32>>> {
    per_row_no_grad(model, rows, chunk, share_prefix, |packed| {
        Ok(response_logprobs(model, packed, temperature)?.0)
    })
}

/// The per-response-token outputs `[B, L]` of `pass` over `rows` (no graph), in chunks of at
/// most `chunk` rows run side by side on `model`'s shards; each row's cut to its response, in
/// the order of `rows`. Sharing prefixes, the chunks are runs of the rows in token order (rows
/// that share a prefix meet, and each chunk runs its shared prefixes once); otherwise runs of
/// rows of similar length (less padding), packed without prefix groups.
pub(crate) fn per_row_no_grad(
    model: &Transformer,
    rows: &[Row],
    chunk: usize,
    share_prefix: bool,
    pass: impl Fn(&Packed) -> Result<Tensor> + Sync,
) -> Result<Vec<Vec<f32>>> {
    let mut order: Vec<usize> = (0..rows.len()).collect();
    sort_rows(rows, &mut order, share_prefix);
    // At least one chunk per core, so that the chunks run side by side.
    let k = shard::training_shard_count(model, rows.len());
    let chunk = chunk.max(1).min(rows.len().div_ceil(k).max(1));
    let chunks: Vec<&[usize]> = order.chunks(chunk).collect();
    let parts = shard::map_chunks(k, &chunks, |c| {
        let refs: Vec<&Row> = c.iter().map(|&i| &rows[i]).collect();
        let mut packed = pack(&refs, model.device())?;
        if !share_prefix {
            packed = packed.unshared();
        }
        Ok(pass(&packed)?.detach().to_vec2::<f32>()?)
    })?;
    let mut out = vec![Vec::new(); rows.len()];
    for (c, v) in chunks.iter().zip(parts) {
        for (&i, row) in c.iter().zip(v) {
            out[i] = row[..rows[i].response.len()].to_vec();
        }
    }
    Ok(out)
}

/// Sorts the rows `idx` before they are cut into chunks, micro-batches and shards: sharing
/// prefixes, in token order, so that rows sharing a prefix are neighbours and meet in a piece;
/// otherwise by length (stable: rows of equal length keep their order), so that a piece pads
/// little.
pub(crate) fn sort_rows(rows: &[Row], idx: &mut [usize], share_prefix: bool) {
    if share_prefix {
        idx.sort_by(|&a, &b| token_order(&rows[a], &rows[b]));
    } else {
        idx.sort_by_key(|&i| row_len(&rows[i]));
    }
}

/// The rows `idx` (sorted by [`sort_rows`]) cut into at most `k` shards that run side by
/// side: sharing prefixes, contiguous runs in that order (rows sharing a prefix meet in a
/// shard, which runs it once); otherwise balanced by length ([`shard::shards_by_len`]).
pub(crate) fn row_shards(
    rows: &[Row],
    idx: &[usize],
    k: usize,
    share_prefix: bool,
) -> Vec<Vec<usize>> {
    if share_prefix {
        shard::shards_in_order(idx, k, |i| row_len(&rows[i]))
    } else {
        shard::shards_by_len(idx, k, |i| row_len(&rows[i]))
    }
}

/// Rows in lexicographic order of their tokens (prompt, then response): rows that share a
/// prefix are neighbours.
fn token_order(a: &Row, b: &Row) -> std::cmp::Ordering {
    a.prompt
        .iter()
        .chain(&a.response)
        .cmp(b.prompt.iter().chain(&b.response))
}

/// Settings of one actor update.
pub struct ActorUpdate<'a> {
    /// The objective.
    pub loss: &'a ActorLossConfig,
    /// Sampling temperature of the rollouts (log-probs are recomputed at it).
    pub temperature: f64,
    /// Passes over the batch.
    pub epochs: usize,
    /// Rows per optimizer step (0: all).
    pub mini_batch: usize,
    /// Rows per forward/backward (0: the mini-batch).
    pub micro_batch: usize,
    /// Learning rate.
    pub lr: f64,
    /// Gradient-norm bound.
    pub grad_clip: f64,
    /// Truncated importance sampling's cap `C` (`optim.rollout_is_cap`): each trained token's
    /// loss is weighted by `min(exp(old − sampled), C)`, the behaviour log-prob over the one
    /// the rollout recorded; `None`: off.
    pub rollout_is_cap: Option<f64>,
    /// Run the prefixes rows share once (`optim.share_prefix`): mini-batches are cut into
    /// pieces in token order so that such rows meet, and each piece's shared prefixes run once.
    pub share_prefix: bool,
}

/// Rows `idx` of the per-row values `v`, right-padded with zeros: `[idx.len(), width]`.
fn tensor_rows(v: &[Vec<f32>], idx: &[usize], width: usize, device: &Device) -> Result<Tensor> {
    let mut flat = vec![0f32; idx.len() * width];
    for (k, &i) in idx.iter().enumerate() {
        flat[k * width..k * width + v[i].len()].copy_from_slice(&v[i]);
    }
    Ok(Tensor::from_vec(flat, (idx.len(), width), device)?)
}

/// Tokens of a row (prompt and response): what a forward pass over it costs, and the key that
/// groups rows of similar length into one pass.
pub(crate) fn row_len(r: &Row) -> usize {
    r.prompt.len() + r.response.len()
}

/// Whether an update of `n` rows under `cfg` is on-policy: one epoch and one mini-batch, so
/// the only optimizer step follows the only forward pass and the behaviour log-probs equal
/// that forward's (verl's `on_policy` case). [`actor_update`] then takes them from the
/// forward itself (detached) and the trainer skips the separate pass.
pub fn is_on_policy(cfg: &ActorUpdate<'_>, n: usize) -> bool {
    cfg.epochs == 1 && (cfg.mini_batch == 0 || cfg.mini_batch >= n)
}

/// Metrics that are a piece's share of its mini-batch's value (the loss denominators span the
/// mini-batch), or counts: summed over the pieces (micro-batches and their shards) of a
/// mini-batch, then averaged over mini-batches like the others. The other metrics are means
/// over tokens, averaged over the pieces weighted by their loss tokens.
const ADDITIVE: [&str; 7] = [
    mk::actor::SHARED_PREFIX_TOKENS,
    mk::actor::PG_LOSS,
    mk::actor::KL_LOSS,
    mk::actor::ENTROPY_AGG,
    mk::actor::LOSS,
    mk::actor::NUM_TURNS,
    mk::actor::SINGLE_TURN_COUNT,
];

/// The gradient of one mini-batch and its metrics ([`minibatch_gradient`]).
pub struct MiniBatchGradient {
    /// Gradients of the mini-batch's loss, summed over its micro-batches (not clipped).
    pub grads: Gradients,
    /// The mini-batch's metrics (verl names); the clip-bias ones (`actor/clip_bias_norm`,
    /// `actor/clip_bias_scale`, `actor/clip_bias_num_clipped`) are over the whole mini-batch.
    pub metrics: BTreeMap<String, f64>,
    /// The `downweight` rule's mean sample weight `s̄ ≤ 1` over the mini-batch's rows with a
    /// gradient to weight (§5.6), `None` without that rule or without such rows. A diagnostic
    /// only: the weights `s_i` are in the loss, hence in [`Self::grads`], and nothing rescales
    /// the gradient or the learning rate by `s̄` (AdamW's moments would undo such a factor).
    pub clip_bias_mean_weight: Option<f64>,
    /// Per row of the mini-batch (row index, per response token): the PPO clip was active.
    pub clipped: Vec<(usize, Vec<bool>)>,
    /// Without behaviour log-probs (on-policy): per row of the mini-batch (row index, per
    /// response token), the forward pass's log-probs; empty otherwise.
    pub forward_logp: Vec<(usize, Vec<f32>)>,
}

/// Loss inputs of the rows `micro_idx` of a mini-batch, after the forward pass `logp`.
struct MicroInput {
    packed: Packed,
    old: Tensor,
    reference: Option<Tensor>,
}

fn micro_input(
    policy: &Transformer,
    share_prefix: bool,
    rows: &[Row],
    micro_idx: &[usize],
    old_logp: Option<&[Vec<f32>]>,
    ref_logp: Option<&[Vec<f32>]>,
    logp: impl FnOnce(&Packed) -> Result<(Tensor, Tensor)>,
) -> Result<(MicroInput, Tensor, Tensor)> {
    let refs: Vec<&Row> = micro_idx.iter().map(|&i| &rows[i]).collect();
    let mut packed = pack(&refs, policy.device())?;
    if !share_prefix {
        packed = packed.unshared();
    }
    let l = packed.response_width;
    let pick = |v: &[Vec<f32>]| tensor_rows(v, micro_idx, l, policy.device());
    let reference = ref_logp.map(pick).transpose()?;
    let (lp, entropy) = logp(&packed)?;
    let old = match old_logp {
        Some(o) => pick(o)?,
        None => lp.detach(),
    };
    Ok((
        MicroInput {
            packed,
            old,
            reference,
        },
        lp,
        entropy,
    ))
}

/// Truncated importance sampling's weights `[B, L]` for the rows `idx` (`optim.rollout_is_cap`):
/// `min(exp(old − sampled), cap)` per response token, `old` the behaviour log-probs the loss
/// uses and `sampled` those the rollout recorded; with their metrics, token means over
/// `loss_mask`: `actor/tis_weight_mean` and `actor/tis_capped_frac` (the share of tokens whose
/// ratio exceeded the cap).
fn truncated_is_weights(
    rows: &[Row],
    idx: &[usize],
    old: &Tensor,
    loss_mask: &Tensor,
    cap: f64,
) -> Result<(Tensor, BTreeMap<String, f64>)> {
    let old_rows = old.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let mask_rows = loss_mask.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let width = old_rows.first().map_or(0, Vec::len);
    let mut w = vec![1f32; idx.len() * width];
    let (mut sum, mut capped, mut n) = (0.0f64, 0.0f64, 0.0f64);
    for (k, &i) in idx.iter().enumerate() {
        let row = &rows[i];
        let sampled = &row.sampled_logprobs;
        if sampled.len() != row.response.len() {
            anyhow::bail!(
                "optim.rollout_is_cap: row {i} has {} recorded log-probs for {} response tokens \
                 (truncated importance sampling needs the log-prob the engine sampled each \
                 token with)",
                sampled.len(),
                row.response.len()
            );
        }
        for (t, &s) in sampled.iter().enumerate() {
            let ratio = f64::from(old_rows[k][t] - s).exp();
            let wt = ratio.min(cap);
            w[k * width + t] = wt as f32;
            let m = f64::from(mask_rows[k][t]);
            sum += m * wt;
            capped += m * f64::from(u8::from(ratio > cap));
            n += m;
        }
    }
    let metrics = if n > 0.0 {
        BTreeMap::from([
            (mk::actor::TIS_WEIGHT_MEAN.to_string(), sum / n),
            (mk::actor::TIS_CAPPED_FRAC.to_string(), capped / n),
        ])
    } else {
        BTreeMap::new()
    };
    let w = Tensor::from_vec(w, (idx.len(), width), old.device())?;
    Ok((w, metrics))
}

/// The §5.6 clip-bias scale of a mini-batch cut into several pieces (micro-batches, and the
/// shards of each that run side by side): `C` over the whole mini-batch (its 1/B over the
/// mini-batch's sequences), from one extra forward pass over each piece first (its log-probs
/// detached; skipped on-policy, where `C = 0`). `None` when the loss has no mini-batch
/// clip-bias correction or the mini-batch is one piece (the loss then computes `C` itself).
fn minibatch_clip_bias_scale(
    policy: &Transformer,
    rows: &[Row],
    pieces: &[Vec<usize>],
    old_logp: Option<&[Vec<f32>]>,
    cfg: &ActorUpdate<'_>,
    denominators: AggDenominators,
) -> Result<Option<f64>> {
    let resolved = cfg.loss.policy.resolve()?;
    let cb = match resolved.clip_bias {
        Some(c)
            if c.rule == ClipBiasRule::InverseNorm
                && c.norm_scope == ClipBiasScope::Minibatch
                && pieces.len() > 1 =>
        {
            c
        }
        _ => return Ok(None),
    };
    if old_logp.is_none() {
        // On-policy: the ratio is exactly 1, no token is clipped, ‖C‖ = 0.
        return Ok(Some(cb.scale_of(0.0)));
    }
    if cb.norm_space == ClipBiasSpace::Grad {
        anyhow::bail!(
            "clip_bias.norm_space = grad is not supported by the trainer's update; use token"
        );
    }
    // ‖C_mb‖² = Σ_piece (B_piece · ‖C_piece‖)² / B_mb², since c = (1/B)(1/|y|)·1·w·Â.
    let k = shard::training_shard_count(policy, pieces.len());
    let parts = shard::map_chunks(k, pieces, |piece| {
        let (inp, lp, _) =
            micro_input(policy, cfg.share_prefix, rows, piece, old_logp, None, |p| {
                response_logprobs(policy, p, cfg.temperature)
            })?;
        let lp = lp.detach();
        let pin = loss_input(&lp, &inp.old, &inp.packed, denominators);
        let out = compute_policy_loss(&pin, &cfg.loss.policy)?;
        Ok((out.metrics.clip_bias_norm * sequences_with_loss(rows, piece)).powi(2))
    })?;
    let sq: f64 = parts.iter().sum();
    Ok(Some(cb.scale_of(sq.sqrt() / denominators.sequences)))
}

/// The policy loss's input over `packed`: the current and old log-probs, the advantages, mask
/// and turn ids, every channel the rows carry (the loss reads those it declares) and the
/// mini-batch's denominators.
fn loss_input<'a>(
    logp: &'a Tensor,
    old: &'a Tensor,
    packed: &'a Packed,
    denominators: AggDenominators,
) -> PolicyLossInput<'a> {
    let mut pin = PolicyLossInput::new(logp, old, &packed.advantages, &packed.loss_mask)
        .with_denominators(denominators)
        .with_turn_id(&packed.turn_id);
    for (&c, values) in &packed.channels {
        pin = pin.with_channel(c, values);
    }
    pin
}

/// Rows of `idx` with at least one loss token (at least 1).
fn sequences_with_loss(rows: &[Row], idx: &[usize]) -> f64 {
    idx.iter()
        .filter(|&&i| rows[i].loss_mask.iter().any(|&m| m > 0))
        .count()
        .max(1) as f64
}

/// Loss tokens of the rows `idx`.
pub(crate) fn loss_tokens(rows: &[Row], idx: &[usize]) -> f64 {
    idx.iter()
        .map(|&i| rows[i].loss_mask.iter().map(|&m| f64::from(m)).sum::<f64>())
        .sum()
}

/// The loss denominators of the mini-batch `idx` of `rows` (each at least 1), which every piece
/// of it divides by.
pub(crate) fn minibatch_denominators(rows: &[Row], idx: &[usize]) -> AggDenominators {
    AggDenominators {
        tokens: loss_tokens(rows, idx).max(1.0),
        sequences: sequences_with_loss(rows, idx),
    }
}

/// What one piece of a mini-batch contributes ([`minibatch_gradient`]).
enum PieceOutcome {
    /// Its gradient, metrics and clip-bias figures.
    Done(PieceGradient),
    /// Its loss could not be computed, or was not finite: the mini-batch is skipped.
    Failed,
}

/// The contribution of one piece of a mini-batch whose loss was finite.
struct PieceGradient {
    /// Its gradient (the mini-batch loss's share).
    grads: Gradients,
    /// Its metrics (verl names).
    metrics: BTreeMap<String, f64>,
    /// `(‖C_piece‖ · B_piece)²` (§5.6).
    clip_bias_sq: f64,
    /// Its clipped tokens of §5.6.
    clip_bias_clipped: f64,
    /// Its `downweight` sums `Σ share_i·s_i` and `Σ share_i` (§5.6).
    clip_bias_weights: (f64, f64),
    /// Its loss tokens (the weight of its token-mean metrics).
    tokens: f64,
    /// Its samples with a loss token (the weight of its sample-mean metrics).
    seqs: f64,
    /// Per row of the piece (row index, per response token): the PPO clip was active.
    clipped: Vec<(usize, Vec<bool>)>,
    /// On-policy: per row of the piece, the forward pass's log-probs.
    forward_logp: Vec<(usize, Vec<f32>)>,
}

/// What every piece of one mini-batch reads ([`minibatch_gradient`]).
struct PieceContext<'a, 'c> {
    policy: &'a Transformer,
    vars: &'a [(String, Var)],
    rows: &'a [Row],
    old_logp: Option<&'a [Vec<f32>]>,
    ref_logp: Option<&'a [Vec<f32>]>,
    cfg: &'a ActorUpdate<'c>,
    /// The mini-batch's loss denominators.
    denominators: AggDenominators,
    /// The mini-batch's §5.6 clip-bias scale, when computed beforehand.
    cb_scale: Option<f64>,
}

impl PieceContext<'_, '_> {
    /// The forward and backward pass of the piece `piece_idx` (row indices): its share of the
    /// mini-batch loss's gradient, its metrics, clip-bias figures and per-row clips.
    fn gradient(&self, piece_idx: &[usize]) -> Result<PieceOutcome> {
        let (policy, rows, cfg) = (self.policy, self.rows, self.cfg);
        let (inp, logp, entropy) = micro_input(
            policy,
            cfg.share_prefix,
            rows,
            piece_idx,
            self.old_logp,
            self.ref_logp,
            |p| response_logprobs(policy, p, cfg.temperature),
        )?;
        let shared_tokens = if policy.draws_dropout() {
            0.0
        } else {
            inp.packed.shared_tokens() as f64
        };
        let packed = &inp.packed;
        let mut pin = loss_input(&logp, &inp.old, packed, self.denominators);
        if let Some(scale) = self.cb_scale {
            pin = pin.with_clip_bias_scale(scale);
        }
        let tis = cfg
            .rollout_is_cap
            .map(|cap| truncated_is_weights(rows, piece_idx, &inp.old, &packed.loss_mask, cap))
            .transpose()?;
        if let Some((w, _)) = &tis {
            pin = pin.with_is_weights(w);
        }
        let input = ActorLossInput {
            policy: pin,
            ref_logp: inp.reference.as_ref(),
            entropy: Some(&entropy),
        };
        let out = match compute_actor_loss(&input, cfg.loss) {
            Ok(o) => o,
            Err(e) => {
                tracing::warn!(error = %e, "skipping a mini-batch whose loss failed");
                return Ok(PieceOutcome::Failed);
            }
        };
        let value = f64::from(out.loss.to_dtype(DType::F32)?.to_scalar::<f32>()?);
        if !value.is_finite() {
            tracing::warn!(loss = value, "non-finite loss: skipping this update");
            return Ok(PieceOutcome::Failed);
        }
        let seqs = sequences_with_loss(rows, piece_idx);
        let tokens = loss_tokens(rows, piece_idx);
        let mut acc = GradAccumulator::new();
        acc.add(&out.loss.backward()?, self.vars, 1.0)
            .context("accumulating gradients")?;
        let clipped = per_response(rows, piece_idx, out.clipped);
        // On-policy the forward pass ran with the weights the rollout sampled from: what the
        // sampler–trainer mismatch compares against the recorded log-probs.
        let forward_logp = match self.old_logp {
            Some(_) => Vec::new(),
            None => per_response(
                rows,
                piece_idx,
                inp.old.to_dtype(DType::F32)?.to_vec2::<f32>()?,
            ),
        };
        let mut metrics = out.metrics.to_map();
        if let Some((_, m)) = tis {
            metrics.extend(m);
        }
        metrics.insert(mk::actor::SHARED_PREFIX_TOKENS.into(), shared_tokens);
        Ok(PieceOutcome::Done(PieceGradient {
            grads: acc.take(),
            metrics,
            clip_bias_sq: (out.metrics.policy.clip_bias_norm * seqs).powi(2),
            clip_bias_clipped: out.metrics.policy.clip_bias_num_clipped as f64,
            clip_bias_weights: (
                out.metrics.policy.clip_bias_weight_sum,
                out.metrics.policy.clip_bias_share_sum,
            ),
            tokens,
            seqs,
            clipped,
            forward_logp,
        }))
    }
}

/// Per row of `idx` (row index, values): its padded per-token `values` cut to the row's
/// response length.
fn per_response<T>(rows: &[Row], idx: &[usize], values: Vec<Vec<T>>) -> Vec<(usize, Vec<T>)> {
    idx.iter()
        .zip(values)
        .map(|(&i, mut v)| {
            v.truncate(rows[i].response.len());
            (i, v)
        })
        .collect()
}

/// The running sums of a mini-batch's pieces ([`minibatch_gradient`]).
struct MiniBatchSums {
    /// The summed gradient.
    acc: GradAccumulator,
    /// Per metric: the sum (additive ones) or the token-weighted sum, and the weights.
    sums: BTreeMap<String, (f64, f64)>,
    /// `Σ (‖C_piece‖ · B_piece)²`.
    cb_sq: f64,
    /// Clipped tokens of §5.6.
    cb_clipped: f64,
    /// `downweight`: `Σ share_i·s_i`.
    cb_weight: f64,
    /// `downweight`: `Σ share_i`.
    cb_share: f64,
    /// Per row: the PPO clip was active.
    clipped_rows: Vec<(usize, Vec<bool>)>,
    /// On-policy: per row, the forward pass's log-probs.
    forward_rows: Vec<(usize, Vec<f32>)>,
}

impl MiniBatchSums {
    fn new(rows: usize) -> Self {
        Self {
            acc: GradAccumulator::new(),
            sums: BTreeMap::new(),
            cb_sq: 0.0,
            cb_clipped: 0.0,
            cb_weight: 0.0,
            cb_share: 0.0,
            clipped_rows: Vec::with_capacity(rows),
            forward_rows: Vec::new(),
        }
    }

    /// Adds one piece's gradient, metrics and clip-bias figures.
    fn add(&mut self, piece: PieceGradient) -> Result<()> {
        let PieceGradient {
            grads,
            metrics,
            clip_bias_sq,
            clip_bias_clipped,
            clip_bias_weights,
            tokens,
            seqs,
            clipped,
            forward_logp,
        } = piece;
        self.clipped_rows.extend(clipped);
        self.forward_rows.extend(forward_logp);
        self.cb_sq += clip_bias_sq;
        self.cb_clipped += clip_bias_clipped;
        self.cb_weight += clip_bias_weights.0;
        self.cb_share += clip_bias_weights.1;
        for (k, v) in metrics {
            if k == mk::actor::CLIP_BIAS_NORM || k == mk::actor::CLIP_BIAS_NUM_CLIPPED {
                continue;
            }
            let e = self.sums.entry(k.clone()).or_insert((0.0, 0.0));
            if v.is_finite() {
                if ADDITIVE.contains(&k.as_str()) {
                    e.0 += v;
                } else {
                    // A mean over samples, or over tokens.
                    let w = if k == mk::actor::TURN_KL_ENTROPY {
                        seqs
                    } else {
                        tokens.max(1e-9)
                    };
                    e.0 += v * w;
                    e.1 += w;
                }
            }
        }
        self.acc.add_gradients(grads)?;
        Ok(())
    }

    /// The mini-batch's gradient and metrics: the sums' means, and the clip-bias figures over
    /// the whole mini-batch `mb` of `rows`.
    fn finish(
        mut self,
        rows: &[Row],
        mb: &[usize],
        denominators: AggDenominators,
    ) -> MiniBatchGradient {
        let mut metrics: BTreeMap<String, f64> = self
            .sums
            .into_iter()
            .map(|(k, (s, c))| {
                (
                    k.clone(),
                    if ADDITIVE.contains(&k.as_str()) {
                        s
                    } else if c > 0.0 {
                        s / c
                    } else {
                        f64::NAN
                    },
                )
            })
            .collect();
        metrics.insert(
            mk::actor::CLIP_BIAS_NORM.into(),
            self.cb_sq.sqrt() / denominators.sequences,
        );
        metrics.insert(mk::actor::CLIP_BIAS_NUM_CLIPPED.into(), self.cb_clipped);
        // The share of the mini-batch's tokens whose forward and backward a shared prefix saved.
        if let Some(&shared) = metrics.get(mk::actor::SHARED_PREFIX_TOKENS) {
            let total: usize = mb.iter().map(|&i| row_len(&rows[i])).sum();
            metrics.insert(
                mk::actor::SHARED_PREFIX_FRAC.into(),
                shared / total.max(1) as f64,
            );
        }
        let (cb_weight, cb_share) = (self.cb_weight, self.cb_share);
        let mean_weight = (cb_share > 0.0).then(|| (cb_weight / cb_share).clamp(0.0, 1.0));
        if let Some(s) = mean_weight {
            metrics.insert(mk::actor::CLIP_BIAS_SCALE.into(), s);
        }
        MiniBatchGradient {
            grads: self.acc.take(),
            metrics,
            clip_bias_mean_weight: mean_weight,
            clipped: self.clipped_rows,
            forward_logp: self.forward_rows,
        }
    }
}

/// The gradient of the mini-batch `mb` (row indices) of `rows`: micro-batches of
/// `cfg.micro_batch` rows of similar length, each cut into one shard per core whose
/// forward/backward passes run side by side ([`shard`]), each adding its share of the
/// mini-batch loss (the loss denominators span the mini-batch, so the gradient does not depend
/// on the grouping; with a clip-bias loss, the §5.6 scale is computed over the whole
/// mini-batch first). `None` (with a warning) when a loss is not finite.
pub fn minibatch_gradient(
    policy: &Transformer,
    vars: &[(String, Var)],
    rows: &[Row],
    mb: &[usize],
    old_logp: Option<&[Vec<f32>]>,
    ref_logp: Option<&[Vec<f32>]>,
    cfg: &ActorUpdate<'_>,
) -> Result<Option<MiniBatchGradient>> {
    let mut mb = mb.to_vec();
    // Micro-batches and shards of rows that share prefixes, or of similar length. The grouping
    // does not change the gradient.
    sort_rows(rows, &mut mb, cfg.share_prefix);
    let micro = if cfg.micro_batch == 0 {
        mb.len()
    } else {
        cfg.micro_batch.min(mb.len())
    }
    .max(1);
    let denominators = minibatch_denominators(rows, &mb);
    let k = shard::training_shard_count(policy, micro);
    let micro_batches: Vec<Vec<Vec<usize>>> = mb
        .chunks(micro)
        .map(|m| row_shards(rows, m, k, cfg.share_prefix))
        .collect();
    let pieces: Vec<Vec<usize>> = micro_batches.iter().flatten().cloned().collect();
    let cb_scale = minibatch_clip_bias_scale(policy, rows, &pieces, old_logp, cfg, denominators)?;
    let ctx = PieceContext {
        policy,
        vars,
        rows,
        old_logp,
        ref_logp,
        cfg,
        denominators,
        cb_scale,
    };
    let mut sums = MiniBatchSums::new(mb.len());
    // One micro-batch at a time (its shards side by side), so that at most one micro-batch of
    // activations is alive.
    for shards in &micro_batches {
        for outcome in shard::map_chunks(shards.len(), shards, |s| ctx.gradient(s))? {
            let PieceOutcome::Done(piece) = outcome else {
                return Ok(None);
            };
            sums.add(piece)?;
        }
    }
    Ok(Some(sums.finish(rows, &mb, denominators)))
}

/// PPO epochs over `rows` with behaviour log-probs `old_logp` (and reference log-probs
/// `ref_logp` when the KL term is on). `order` permutes rows per epoch (seeded by the caller).
/// `old_logp` may be `None` only for an on-policy update ([`is_on_policy`]): the ratio's
/// denominator is then the current forward's log-probs, detached. Each mini-batch's gradient
/// comes from [`minibatch_gradient`] and is applied as it is (norm clip, AdamW at `cfg.lr`);
/// metrics are averaged over the mini-batches, and some are also logged per mini-batch
/// position `k` (0-based, counted over the epochs: the k-th optimizer step of the update):
/// `actor/pg_clipfrac_mb{k}` and, with the §5.6 `downweight` correction,
/// `actor/clip_bias_scale_mb{k}`; `actor/clip_bias_scale_offpolicy` is `s̄` averaged over the
/// mini-batches that follow an applied optimizer step (the off-policy ones), without the first
/// mini-batch's exact 1. `actor/grad_norm` is the norm of the gradient the optimizer reads,
/// before the norm clip.
pub fn actor_update(
    policy: &Transformer,
    opt: &mut AdamW,
    rows: &[Row],
    old_logp: Option<&[Vec<f32>]>,
    ref_logp: Option<&[Vec<f32>]>,
    cfg: &ActorUpdate<'_>,
    order: &mut dyn FnMut(usize) -> Vec<usize>,
) -> Result<UpdateStats> {
    let mut stats = UpdateStats::default();
    let mut sums: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    let n = rows.len();
    if n == 0 {
        return Ok(stats);
    }
    let mini = if cfg.mini_batch == 0 {
        n
    } else {
        cfg.mini_batch.min(n)
    };
    if old_logp.is_none() && !is_on_policy(cfg, n) {
        anyhow::bail!(
            "behaviour log-probs are needed: {} epochs over mini-batches of {mini} of {n} rows",
            cfg.epochs
        );
    }
    stats.row_clips = rows
        .iter()
        .map(|r| RowClips {
            passes: 0,
            clipped: vec![0; r.response.len()],
        })
        .collect();
    stats.forward_logp = vec![None; n];
    let mut position = 0usize;
    for _ in 0..cfg.epochs {
        let perm = order(n);
        for mb in perm.chunks(mini) {
            let mb_index = position;
            position += 1;
            let Some(g) =
                minibatch_gradient(policy, opt.vars(), rows, mb, old_logp, ref_logp, cfg)?
            else {
                stats.skipped += 1;
                continue;
            };
            // §5.6 `downweight`: the loss weighted each sample by s_i ≤ 1, which sets the mix
            // of the samples' gradients within this mini-batch; that is what survives AdamW.
            // The gradient and the learning rate are not rescaled by s̄: with β1 > 0 a step-size
            // factor acts on one step while the moments carry the gradient into later ones at
            // full lr, and Adam cancels a factor that is constant over time.
            let grads = g.grads;
            let norm = grads.global_norm()?;
            if !norm.is_finite() {
                tracing::warn!(
                    grad_norm = norm,
                    "non-finite gradient: skipping this update"
                );
                stats.skipped += 1;
                continue;
            }
            let pg_clipfrac = g.metrics.get(mk::actor::PG_CLIPFRAC).copied();
            for (k, v) in g.metrics {
                let e = sums.entry(k).or_insert((0.0, 0));
                if v.is_finite() {
                    e.0 += v;
                    e.1 += 1;
                }
            }
            let mut per_position = vec![(mk::actor::GRAD_NORM.to_string(), norm)];
            if let Some(f) = pg_clipfrac {
                per_position.push((format!("actor/pg_clipfrac_mb{mb_index}"), f));
            }
            if let Some(s) = g.clip_bias_mean_weight {
                per_position.push((format!("actor/clip_bias_scale_mb{mb_index}"), s));
                if stats.applied > 0 {
                    per_position.push((mk::actor::CLIP_BIAS_SCALE_OFFPOLICY.to_string(), s));
                }
            }
            for (key, v) in per_position {
                let e = sums.entry(key).or_insert((0.0, 0));
                if v.is_finite() {
                    e.0 += v;
                    e.1 += 1;
                }
            }
            // The clip is applied as the update reads the gradients (the same bits).
            let clip = Gradients::clip_factor(norm, cfg.grad_clip);
            opt.step_scaled(&grads, cfg.lr, clip)
                .with_context(|| format!("the policy update (optim.lr = {})", cfg.lr))?;
            stats.applied += 1;
            for (i, lp) in g.forward_logp {
                stats.forward_logp[i].get_or_insert(lp);
            }
            for (i, clipped) in g.clipped {
                let rc = &mut stats.row_clips[i];
                rc.passes += 1;
                for (count, c) in rc.clipped.iter_mut().zip(clipped) {
                    *count += u32::from(c);
                }
            }
        }
    }
    stats.metrics = sums
        .into_iter()
        .map(|(k, (s, c))| (k, if c > 0 { s / c as f64 } else { f64::NAN }))
        .collect();
    stats.metrics.insert(mk::actor::LR.into(), cfg.lr);
    Ok(stats)
}
