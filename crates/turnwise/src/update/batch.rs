//! Packing rows (prompt + response) into padded tensors. Prompts are left-padded to a common
//! width so every response starts at the same column; the log-prob of response token `k` is
//! then column `P − 1 + k` of the teacher-forced pass.

use std::collections::BTreeMap;

use anyhow::{Result, bail};
use candle_core::{DType, Device, Tensor};
use turnwise_core::advantage::Channel;
use turnwise_model::Transformer;
use turnwise_model::logprobs::{SharedRow, shared_prefix_logprobs_entropy};
use turnwise_model::model::critic::Critic;

use crate::shard::{MIN_SHARED_PREFIX, PrefixGroup, prefix_groups};

/// One training row.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// Prompt ids.
    pub prompt: Vec<u32>,
    /// Response ids (agent and observation tokens).
    pub response: Vec<u32>,
    /// Per response token: trained on (agent, not forced unless asked).
    pub loss_mask: Vec<u8>,
    /// Per response token: agent turn index or −1.
    pub turn_id: Vec<i32>,
    /// Per response token: advantage.
    pub advantages: Vec<f32>,
    /// Per response token, per channel the estimator emitted ([`Channel`], e.g. A2TGPO's clip
    /// scale): the value of the token's turn (the channel's [`Channel::fill`] elsewhere).
    pub channels: BTreeMap<Channel, Vec<f32>>,
    /// Per response token: value target (critic), if any.
    pub returns: Vec<f32>,
    /// Per response token: the log-prob recorded when the rollout sampled it (0 on
    /// observation tokens); empty for a row not built from a trajectory.
    pub sampled_logprobs: Vec<f32>,
}

impl Row {
    /// The training row of a trajectory: its prompt, its flattened response, the loss mask
    /// (forced tokens trained on only with `train_on_forced`) and the turn ids.
    pub fn from_trajectory(
        t: &turnwise_core::trajectory::Trajectory,
        train_on_forced: bool,
    ) -> Self {
        let f = t.flatten(train_on_forced);
        let mut row = Self::new(t.prompt_ids.clone(), f.ids, f.loss_mask, f.turn_id);
        row.sampled_logprobs = f.logprobs;
        row
    }

    /// A row with every per-token field zero / unit except the mask and turn ids.
    pub fn new(
        prompt: Vec<u32>,
        response: Vec<u32>,
        loss_mask: Vec<u8>,
        turn_id: Vec<i32>,
    ) -> Self {
        let n = response.len();
        Self {
            prompt,
            response,
            loss_mask,
            turn_id,
            advantages: vec![0.0; n],
            channels: BTreeMap::new(),
            returns: vec![0.0; n],
            sampled_logprobs: Vec::new(),
        }
    }

    /// verl-agent's step samples of this trajectory row: one row per agent turn (environment
    /// step), whose prompt is the context the turn was sampled from and whose response is the
    /// turn's own tokens with their loss mask, turn id, advantages, clip scales and returns.
    ///
    /// The context is the prompt plus the response before the turn, or, under memory window
    /// `window` = P, plus only the last P turns before it with the observations after them: the
    /// slice the rollout's `context_window` generated the turn from (a turn with more than P
    /// turns before it starts its context at the start of the P-th last one). A turn spans its
    /// first to its last token of that turn id (an environment segment injected inside it
    /// stays, with loss mask 0). Rows without agent turns give no samples.
    pub fn step_samples(&self, window: Option<usize>) -> Vec<Row> {
        // [start, end) of each turn, in order (turn ids run in order without gaps, so a token
        // either extends the last turn or starts the next).
        let mut spans: Vec<(i32, usize, usize)> = Vec::new();
        for (p, &t) in self.turn_id.iter().enumerate() {
            if t < 0 {
                continue;
            }
            match spans.last_mut() {
                Some((k, _, end)) if *k == t => *end = p + 1,
                _ => spans.push((t, p, p + 1)),
            }
        }
        spans
            .iter()
            .enumerate()
            .map(|(j, &(_, start, end))| {
                let from = match window {
                    Some(p) if j > p => spans[j - p].1,
                    _ => 0,
                };
                let mut prompt = self.prompt.clone();
                prompt.extend_from_slice(&self.response[from..start]);
                Row {
                    prompt,
                    response: self.response[start..end].to_vec(),
                    loss_mask: self.loss_mask[start..end].to_vec(),
                    turn_id: self.turn_id[start..end].to_vec(),
                    advantages: self.advantages[start..end].to_vec(),
                    channels: self
                        .channels
                        .iter()
                        .map(|(&c, v)| (c, v[start..end].to_vec()))
                        .collect(),
                    returns: self.returns[start..end].to_vec(),
                    sampled_logprobs: self
                        .sampled_logprobs
                        .get(start..end)
                        .map(<[f32]>::to_vec)
                        .unwrap_or_default(),
                }
            })
            .collect()
    }
}

/// Padded tensors of a set of rows.
pub struct Packed {
    /// Input ids [B, T].
    pub ids: Tensor,
    /// Positions [B, T] (0 at each row's first real token).
    pub positions: Tensor,
    /// Key mask [B, T] (1 = real token).
    pub key_mask: Tensor,
    /// Next-token targets [B, T].
    pub targets: Tensor,
    /// Width of the padded prompt block.
    pub prompt_width: usize,
    /// Width of the response block L.
    pub response_width: usize,
    /// Loss mask [B, L] (f32).
    pub loss_mask: Tensor,
    /// Turn ids [B, L] (f32; −1 on observation and padding).
    pub turn_id: Tensor,
    /// Advantages [B, L].
    pub advantages: Tensor,
    /// Per channel of the rows ([`Row::channels`]): its values [B, L] (padding: the
    /// channel's [`Channel::fill`]).
    pub channels: BTreeMap<Channel, Tensor>,
    /// Value targets [B, L].
    pub returns: Tensor,
    /// Each row's tokens (prompt then response) and prompt length.
    pub seqs: Vec<(Vec<u32>, usize)>,
    /// Per row, per response token: whether the passes want its log-prob and entropy (an agent
    /// token, or one the loss trains on). The output head runs there only; observation tokens
    /// get 0, which nothing reads (their loss mask is 0 and they have no sampled log-prob).
    pub scored: Vec<Vec<bool>>,
    /// Rows that share a prefix, which [`response_logprobs`] runs once per group (empty: every
    /// row runs whole).
    pub groups: Vec<PrefixGroup>,
}

impl Packed {
    /// The same batch with every row run whole (no shared-prefix groups): the reference the
    /// shared pass is exact against, and `optim.share_prefix = false`.
    pub fn unshared(mut self) -> Self {
        self.groups.clear();
        self
    }

    /// Tokens a padded pass over the batch would run that the shared-prefix groups run once
    /// only: `Σ_groups (rows − 1) · len`.
    pub fn shared_tokens(&self) -> usize {
        self.groups.iter().map(|g| (g.rows.len() - 1) * g.len).sum()
    }
}

/// Packs `rows` on `device`.
pub fn pack(rows: &[&Row], device: &Device) -> Result<Packed> {
    if rows.is_empty() {
        bail!("cannot pack an empty batch");
    }
    for (i, r) in rows.iter().enumerate() {
        let n = r.response.len();
        if r.prompt.is_empty()
            || r.loss_mask.len() != n
            || r.turn_id.len() != n
            || r.advantages.len() != n
            || r.channels.values().any(|v| v.len() != n)
            || r.returns.len() != n
        {
            bail!(
                "row {i}: prompt must be non-empty and every per-token field must have {n} entries"
            );
        }
    }
    let p = rows.iter().map(|r| r.prompt.len()).max().unwrap_or(1);
    let l = rows
        .iter()
        .map(|r| r.response.len())
        .max()
        .unwrap_or(0)
        .max(1);
    let t = p + l;
    let b = rows.len();
    let mut ids = vec![0u32; b * t];
    let mut pos = vec![0u32; b * t];
    let mut key = vec![0u8; b * t];
    let mut targets = vec![0u32; b * t];
    let mut mask = vec![0f32; b * l];
    let mut turn = vec![-1f32; b * l];
    let mut adv = vec![0f32; b * l];
    let first = rows[0].channels.keys();
    if let Some((i, _)) = rows
        .iter()
        .enumerate()
        .find(|(_, r)| !r.channels.keys().eq(first.clone()))
    {
        bail!(
            "row {i} carries the channels {:?} and row 0 {:?}: a batch's rows come from one estimator",
            rows[i].channels.keys().collect::<Vec<_>>(),
            rows[0].channels.keys().collect::<Vec<_>>()
        );
    }
    let mut channels: BTreeMap<Channel, Vec<f32>> = rows[0]
        .channels
        .keys()
        .map(|&c| (c, vec![c.fill() as f32; b * l]))
        .collect();
    let mut ret = vec![0f32; b * l];
    let mut seqs = Vec::with_capacity(b);
    let mut scored = Vec::with_capacity(b);
    for (i, r) in rows.iter().enumerate() {
        let pad = p - r.prompt.len();
        let seq: Vec<u32> = r.prompt.iter().chain(&r.response).copied().collect();
        for (k, &tok) in seq.iter().enumerate() {
            let col = pad + k;
            ids[i * t + col] = tok;
            pos[i * t + col] = k as u32;
            key[i * t + col] = 1;
            if col > 0 {
                targets[i * t + col - 1] = tok;
            }
        }
        for k in 0..r.response.len() {
            mask[i * l + k] = f32::from(r.loss_mask[k]);
            turn[i * l + k] = r.turn_id[k] as f32;
            adv[i * l + k] = r.advantages[k];
            ret[i * l + k] = r.returns[k];
        }
        for (c, v) in &mut channels {
            let src = &r.channels[c];
            v[i * l..i * l + src.len()].copy_from_slice(src);
        }
        seqs.push((seq, r.prompt.len()));
        scored.push(
            r.loss_mask
                .iter()
                .zip(&r.turn_id)
                .map(|(&m, &t)| m != 0 || t >= 0)
                .collect(),
        );
    }
    let u = |v: Vec<u32>| Tensor::from_vec(v, (b, t), device);
    let f = |v: Vec<f32>| Tensor::from_vec(v, (b, l), device);
    Ok(Packed {
        ids: u(ids)?,
        positions: u(pos)?,
        key_mask: Tensor::from_vec(key, (b, t), device)?,
        targets: u(targets)?,
        prompt_width: p,
        response_width: l,
        loss_mask: f(mask)?,
        turn_id: f(turn)?,
        advantages: f(adv)?,
        channels: channels
            .into_iter()
            .map(|(c, v)| Ok((c, f(v)?)))
            .collect::<Result<_>>()?,
        returns: f(ret)?,
        groups: {
            let seqs: Vec<&[u32]> = seqs.iter().map(|(s, _)| s.as_slice()).collect();
            prefix_groups(&seqs, MIN_SHARED_PREFIX)
        },
        seqs,
        scored,
    })
}

/// Log-probs and entropies of the response tokens, [B, L] each (differentiable when `model`
/// tracks gradients), at sampling temperature `temperature`. The rows of each of
/// `packed.groups` run their shared prefix once ([`shared_prefix_logprobs_entropy`]), the
/// others in one padded pass; the output head runs on the response positions only. Equal to
/// the padded pass over every row to rounding. A model that draws LoRA dropout masks runs
/// every row whole (one mask per row and position, as the padded pass draws them).
pub fn response_logprobs(
    model: &Transformer,
    packed: &Packed,
    temperature: f64,
) -> Result<(Tensor, Tensor)> {
    if !(temperature > 0.0 && temperature.is_finite()) {
        bail!("temperature {temperature} is not a positive number");
    }
    let b = packed.seqs.len();
    let l = packed.response_width;
    // LoRA dropout draws a mask per row and position: a prefix run once would share one mask
    // among its rows, another computation than the padded pass's, so such a model runs whole.
    if packed.groups.is_empty() || model.draws_dropout() {
        let all: Vec<usize> = (0..b).collect();
        let (lp, ent) = padded_logprobs(model, packed, &all, temperature)?;
        return Ok((lp.to_dtype(DType::F32)?, ent.to_dtype(DType::F32)?));
    }
    let layout = SharedLayout::of(packed);
    let (lp, ent) =
        shared_prefix_logprobs_entropy(model, &layout.prefix_lens, &layout.rows, l, temperature)?;
    let (mut lps, mut ents) = (vec![lp], vec![ent]);
    if !layout.rest.is_empty() {
        let (lp, ent) = padded_logprobs(model, packed, &layout.rest, temperature)?;
        lps.push(lp);
        ents.push(ent);
    }
    Ok((layout.gather(lps)?, layout.gather(ents)?))
}

/// Values `[B, L]` (f32) of the critic at the states before each response token of the rows
/// of `packed` (entries past a row's response are finite and meaningless, as the loss mask
/// says; differentiable when the critic tracks gradients):
/// the rows of each of `packed.groups` run their shared prefix through the trunk once
/// ([`Critic::shared_prefix_values`]), the others in one padded pass. Equal to the padded pass
/// over every row to rounding.
pub fn response_values(critic: &Critic, packed: &Packed) -> Result<Tensor> {
    let b = packed.seqs.len();
    if packed.groups.is_empty() || critic.trunk().draws_dropout() {
        let all: Vec<usize> = (0..b).collect();
        return Ok(padded_values(critic, packed, &all)?.to_dtype(DType::F32)?);
    }
    let layout = SharedLayout::of(packed);
    let mut parts = vec![critic.shared_prefix_values(
        &layout.prefix_lens,
        &layout.rows,
        packed.response_width,
    )?];
    if !layout.rest.is_empty() {
        parts.push(padded_values(critic, packed, &layout.rest)?);
    }
    layout.gather(parts)
}

/// The rows of a [`Packed`] batch laid out for a pass that runs each of its prefix groups'
/// shared tokens once: the groups' prefix lengths and rows (from each row's last prompt
/// token, over its response), the rows in no group, and the order the outputs come in.
struct SharedLayout<'a> {
    prefix_lens: Vec<usize>,
    rows: Vec<SharedRow<'a>>,
    rest: Vec<usize>,
    /// Batch row of each output row: the groups' rows, then `rest`.
    order: Vec<usize>,
    device: Device,
}

impl<'a> SharedLayout<'a> {
    fn of(packed: &'a Packed) -> Self {
        let b = packed.seqs.len();
        let mut in_group = vec![false; b];
        let mut order = Vec::with_capacity(b);
        let mut rows = Vec::new();
        let mut prefix_lens = Vec::with_capacity(packed.groups.len());
        for (g, group) in packed.groups.iter().enumerate() {
            prefix_lens.push(group.len);
            for &i in &group.rows {
                let (seq, prompt) = &packed.seqs[i];
                in_group[i] = true;
                order.push(i);
                rows.push(SharedRow {
                    seq,
                    group: g,
                    from: prompt - 1,
                    len: seq.len() - prompt,
                    scored: Some(&packed.scored[i]),
                });
            }
        }
        let rest: Vec<usize> = (0..b).filter(|&i| !in_group[i]).collect();
        order.extend(&rest);
        Self {
            prefix_lens,
            rows,
            rest,
            order,
            device: packed.ids.device().clone(),
        }
    }

    /// The outputs of the groups' rows and of `rest` (concatenated in that order), back in the
    /// batch's row order, in f32.
    fn gather(&self, parts: Vec<Tensor>) -> Result<Tensor> {
        let mut inverse = vec![0u32; self.order.len()];
        for (k, &i) in self.order.iter().enumerate() {
            inverse[i] = k as u32;
        }
        let inverse = Tensor::from_vec(inverse, self.order.len(), &self.device)?;
        Ok(Tensor::cat(&parts, 0)?
            .index_select(&inverse, 0)?
            .to_dtype(DType::F32)?)
    }
}

/// The rows `idx` of `packed`, trimmed to the columns they need (none of another row's extra
/// left padding): ids, positions, key mask, next tokens, their widest prompt and widest
/// response.
struct Trimmed {
    ids: Tensor,
    positions: Tensor,
    key_mask: Tensor,
    targets: Tensor,
    prompt: usize,
    response: usize,
}

impl Trimmed {
    fn of(packed: &Packed, idx: &[usize]) -> Result<Self> {
        let p = packed.prompt_width;
        let prompt = idx.iter().map(|&i| packed.seqs[i].1).max().unwrap_or(1);
        let response = idx
            .iter()
            .map(|&i| packed.seqs[i].0.len() - packed.seqs[i].1)
            .max()
            .unwrap_or(0)
            .max(1);
        let (from, width) = (p - prompt, prompt + response);
        let select = |t: &Tensor| -> Result<Tensor> {
            let t = if idx.len() == packed.seqs.len() {
                t.clone()
            } else {
                let rows: Vec<u32> = idx.iter().map(|&i| i as u32).collect();
                t.index_select(&Tensor::from_vec(rows, idx.len(), t.device())?, 0)?
            };
            Ok(t.narrow(1, from, width)?)
        };
        Ok(Self {
            ids: select(&packed.ids)?,
            positions: select(&packed.positions)?,
            key_mask: select(&packed.key_mask)?,
            targets: select(&packed.targets)?,
            prompt,
            response,
        })
    }

    /// `t: [rows, response]` right-padded with zeros to `l` columns.
    fn pad_to(&self, t: Tensor, l: usize) -> Result<Tensor> {
        if self.response == l {
            return Ok(t);
        }
        Ok(t.pad_with_zeros(1, 0, l - self.response)?)
    }
}

/// The padded teacher-forced pass over the rows `idx` of `packed`: their response tokens'
/// log-probs and entropies, `[idx.len(), L]`, in the model's dtype. Only the columns those
/// rows need run, and the output head only on the response columns.
fn padded_logprobs(
    model: &Transformer,
    packed: &Packed,
    idx: &[usize],
    temperature: f64,
) -> Result<(Tensor, Tensor)> {
    let t = Trimmed::of(packed, idx)?;
    let hidden = model.forward_hidden(&t.ids, &t.positions, &t.key_mask, None)?;
    // Column `prompt − 1 + k` predicts response token k.
    let hidden = hidden.narrow(1, t.prompt - 1, t.response)?;
    let targets = t.targets.narrow(1, t.prompt - 1, t.response)?;
    // The head on the scored positions only (not on observation tokens nor padding).
    let mut keep = vec![false; idx.len() * t.response];
    for (r, &i) in idx.iter().enumerate() {
        let s = &packed.scored[i];
        keep[r * t.response..r * t.response + s.len()].copy_from_slice(s);
    }
    let (lp, ent) = model.head_logprobs_entropy_at(&hidden, &targets, 1.0 / temperature, &keep)?;
    let l = packed.response_width;
    Ok((t.pad_to(lp, l)?, t.pad_to(ent, l)?))
}

/// The critic's padded pass over the rows `idx` of `packed`: values `[idx.len(), L]` at the
/// states before each response token, in the critic's dtype.
fn padded_values(critic: &Critic, packed: &Packed, idx: &[usize]) -> Result<Tensor> {
    let t = Trimmed::of(packed, idx)?;
    let v =
        critic
            .values(&t.ids, &t.positions, &t.key_mask)?
            .narrow(1, t.prompt - 1, t.response)?;
    t.pad_to(v, packed.response_width)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Turns 0, 1, 2 with observations after the first two: each step's prompt is the context
    /// its turn was generated from; under a window of 1 the third turn sees only the second.
    #[test]
    fn step_samples_cut_a_row_at_its_turns() {
        let mut row = Row::new(
            vec![1, 2],
            vec![10, 11, 20, 12, 13, 21, 22, 14],
            vec![1, 1, 0, 1, 0, 0, 0, 1],
            vec![0, 0, -1, 1, 1, -1, -1, 2],
        );
        row.advantages = vec![0.5, 0.5, 0.0, -1.0, -1.0, 0.0, 0.0, 2.0];
        let full = row.step_samples(None);
        assert_eq!(full.len(), 3);
        assert_eq!(
            (full[0].prompt.clone(), full[0].response.clone()),
            (vec![1, 2], vec![10, 11])
        );
        assert_eq!(full[1].prompt, vec![1, 2, 10, 11, 20]);
        assert_eq!(
            (full[1].response.clone(), full[1].loss_mask.clone()),
            (vec![12, 13], vec![1, 0])
        );
        assert_eq!(full[1].advantages, vec![-1.0, -1.0]);
        assert_eq!(full[2].prompt, vec![1, 2, 10, 11, 20, 12, 13, 21, 22]);
        assert_eq!(
            (full[2].response.clone(), full[2].turn_id.clone()),
            (vec![14], vec![2])
        );
        let windowed = row.step_samples(Some(1));
        assert_eq!(windowed[1].prompt, full[1].prompt);
        assert_eq!(windowed[2].prompt, vec![1, 2, 12, 13, 21, 22]);
        assert_eq!(windowed[2].advantages, vec![2.0]);
        let none = Row::new(vec![1], vec![20, 21], vec![0, 0], vec![-1, -1]);
        assert!(none.step_samples(None).is_empty());
    }

    /// Rows of two prompts (left padding differs per row), one row alone, responses of
    /// different lengths.
    fn sharing_rows() -> Vec<Row> {
        let p: Vec<u32> = (10..22).collect();
        let q: Vec<u32> = (30..39).collect();
        vec![
            Row::new(p.clone(), vec![1, 2, 3, 4], vec![1; 4], vec![0; 4]),
            Row::new(q.clone(), vec![5, 6], vec![1; 2], vec![0; 2]),
            Row::new(vec![40, 41, 42], vec![7, 8, 9], vec![1; 3], vec![0; 3]),
            Row::new(
                p.clone(),
                vec![1, 2, 60, 61, 62, 63],
                vec![1; 6],
                vec![0; 6],
            ),
            Row::new(q, vec![5, 7, 7], vec![1; 3], vec![0; 3]),
            Row::new(p, vec![9], vec![1], vec![0]),
        ]
    }

    /// The tiny model of the shared-pass tests (weights large enough for differences to show).
    fn sharing_config() -> turnwise_model::ModelConfig {
        let mut cfg = turnwise_model::ModelConfig::tiny_qwen2(64);
        cfg.initializer_range = 0.2;
        cfg
    }

    /// [`sharing_rows`] packed with their two prefix groups shared, and padded without sharing.
    fn shared_and_padded() -> (Packed, Packed) {
        let rows = sharing_rows();
        let refs: Vec<&Row> = rows.iter().collect();
        let shared = pack(&refs, &Device::Cpu).unwrap();
        assert_eq!(shared.groups.len(), 2);
        let whole = pack(&refs, &Device::Cpu).unwrap().unshared();
        (shared, whole)
    }

    /// Largest absolute difference of `a` and `b` (f32) where `mask` is 1.
    fn masked_diff(a: &Tensor, b: &Tensor, mask: &Tensor) -> f32 {
        ((a - b).unwrap() * mask)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// Weights for a `[6, 6]` objective, 0 where `mask` is.
    fn masked_weights(mask: &Tensor) -> Tensor {
        (mask
            * Tensor::arange(0f32, 36.0, &Device::Cpu)
                .unwrap()
                .reshape((6, 6))
                .unwrap()
                .affine(0.1, -1.0)
                .unwrap())
        .unwrap()
    }

    /// Every weight of `vm` has the same gradient (f64, within 1e-10) in `g` and `g0`.
    fn assert_same_gradients(
        vm: &candle_nn::VarMap,
        g: &candle_core::backprop::GradStore,
        g0: &candle_core::backprop::GradStore,
    ) {
        for (name, var) in turnwise_model::model::weights::sorted_vars(vm) {
            let (a, b) = (
                g.get(var.as_tensor()).unwrap(),
                g0.get(var.as_tensor()).unwrap(),
            );
            let d = (a - b)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap();
            assert!(d < 1e-10, "{name}: {d}");
        }
    }

    /// The critic's shared pass against its padded one (the rows of [`sharing_rows`], a tiny
    /// f64 critic): values and every weight's gradient of a weighted sum, over each row's
    /// response.
    #[test]
    fn shared_critic_values_equal_the_padded_pass() {
        use candle_core::DType;
        use turnwise_model::model::critic::init_critic_varmap;
        let cfg = sharing_config();
        let vm = init_critic_varmap(&cfg, DType::F64, &Device::Cpu, 5).unwrap();
        let critic = Critic::from_varmap(&cfg, &vm).unwrap();
        let (shared, whole) = shared_and_padded();
        let v = response_values(&critic, &shared).unwrap();
        let v0 = response_values(&critic, &whole).unwrap();
        let d = masked_diff(&v, &v0, &shared.loss_mask);
        assert!(d < 1e-6, "values differ by {d}");
        let w = masked_weights(&shared.loss_mask);
        let obj = |v: &Tensor| (v * &w).unwrap().sum_all().unwrap();
        let g = obj(&v).backward().unwrap();
        let g0 = obj(&v0).backward().unwrap();
        assert_same_gradients(&vm, &g, &g0);
    }

    /// The shared pass against the padded one on a tiny model (the rows of [`sharing_rows`]):
    /// log-probs, entropies and every weight's gradient of a weighted sum.
    #[test]
    fn shared_pass_equals_the_padded_pass() {
        use candle_core::DType;
        use turnwise_model::model::weights::init_varmap;
        let cfg = sharing_config();
        let vm = init_varmap(&cfg, DType::F64, &Device::Cpu, 4).unwrap();
        let model = Transformer::from_varmap(&cfg, &vm).unwrap();
        let (shared, whole) = shared_and_padded();
        // p: 3 rows share its 12 tokens; q: 2 rows share its 9 and their first response token.
        assert_eq!(shared.shared_tokens(), 2 * 12 + 10);
        let (lp, ent) = response_logprobs(&model, &shared, 0.8).unwrap();
        let (lp0, ent0) = response_logprobs(&model, &whole, 0.8).unwrap();
        let w = masked_weights(&shared.loss_mask);
        let mask = &shared.loss_mask;
        assert!(masked_diff(&lp, &lp0, mask) < 1e-6 && masked_diff(&ent, &ent0, mask) < 1e-6);
        let obj =
            |lp: &Tensor, ent: &Tensor| ((lp + ent).unwrap() * &w).unwrap().sum_all().unwrap();
        let g = obj(&lp, &ent).backward().unwrap();
        let g0 = obj(&lp0, &ent0).backward().unwrap();
        assert_same_gradients(&vm, &g, &g0);
    }

    /// The output head runs on the scored positions only (agent tokens): observation tokens
    /// come out 0, and the scored positions' log-probs, entropies and every weight's gradient
    /// equal those of the head over every position, in the shared pass and the padded one.
    #[test]
    fn the_head_skips_observation_tokens_exactly() {
        use candle_core::DType;
        use turnwise_model::model::weights::init_varmap;
        let cfg = sharing_config();
        let vm = init_varmap(&cfg, DType::F64, &Device::Cpu, 4).unwrap();
        let model = Transformer::from_varmap(&cfg, &vm).unwrap();
        let mut rows = sharing_rows();
        // Observations inside rows 0, 3 and 4 (loss mask 0, turn id −1).
        for (r, k) in [(0, 1), (0, 2), (3, 2), (3, 3), (3, 4), (4, 0)] {
            rows[r].loss_mask[k] = 0;
            rows[r].turn_id[k] = -1;
        }
        let refs: Vec<&Row> = rows.iter().collect();
        for share in [true, false] {
            let mut packed = pack(&refs, &Device::Cpu).unwrap();
            if !share {
                packed = packed.unshared();
            }
            let scored = packed.scored.clone();
            let (lp, ent) = response_logprobs(&model, &packed, 0.8).unwrap();
            packed.scored = scored.iter().map(|s| vec![true; s.len()]).collect();
            let (lp0, ent0) = response_logprobs(&model, &packed, 0.8).unwrap();
            let mut keep = vec![0f32; 36];
            for (i, s) in scored.iter().enumerate() {
                for (k, &x) in s.iter().enumerate() {
                    keep[i * 6 + k] = f32::from(u8::from(x));
                }
            }
            let keep = Tensor::from_vec(keep, (6, 6), &Device::Cpu).unwrap();
            assert!(masked_diff(&lp, &lp0, &keep) < 1e-6 && masked_diff(&ent, &ent0, &keep) < 1e-6);
            let lp_rows = lp.to_vec2::<f32>().unwrap();
            let lp0_rows = lp0.to_vec2::<f32>().unwrap();
            for (i, s) in scored.iter().enumerate() {
                for (k, &x) in s.iter().enumerate() {
                    assert_eq!(
                        lp_rows[i][k] == 0.0,
                        !x,
                        "row {i} token {k} (share {share})"
                    );
                    assert!(lp0_rows[i][k] < 0.0);
                }
            }
            let w = masked_weights(&keep);
            let obj =
                |lp: &Tensor, ent: &Tensor| ((lp + ent).unwrap() * &w).unwrap().sum_all().unwrap();
            let g = obj(&lp, &ent).backward().unwrap();
            let g0 = obj(&lp0, &ent0).backward().unwrap();
            assert_same_gradients(&vm, &g, &g0);
        }
    }

    #[test]
    fn responses_start_at_the_same_column() {
        let a = Row::new(vec![1, 2, 3], vec![4, 5], vec![1, 1], vec![0, 0]);
        let b = Row::new(vec![7], vec![8, 9, 10], vec![1, 0, 1], vec![0, -1, 1]);
        let p = pack(&[&a, &b], &Device::Cpu).unwrap();
        assert_eq!(p.prompt_width, 3);
        assert_eq!(p.response_width, 3);
        let ids = p.ids.to_vec2::<u32>().unwrap();
        assert_eq!(ids[0], vec![1, 2, 3, 4, 5, 0]);
        assert_eq!(ids[1], vec![0, 0, 7, 8, 9, 10]);
        let tg = p.targets.to_vec2::<u32>().unwrap();
        // Column P−1+k predicts response token k.
        assert_eq!(tg[0][2], 4);
        assert_eq!(tg[1][2], 8);
        assert_eq!(tg[1][4], 10);
        let pos = p.positions.to_vec2::<u32>().unwrap();
        assert_eq!(pos[1], vec![0, 0, 0, 1, 2, 3]);
        let m = p.loss_mask.to_vec2::<f32>().unwrap();
        assert_eq!(m, vec![vec![1.0, 1.0, 0.0], vec![1.0, 0.0, 1.0]]);
    }
}
