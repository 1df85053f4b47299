//! Packing rows (prompt + response) into padded tensors. Prompts are left-padded to a common
//! width so every response starts at the same column; the log-prob of response token `k` is
//! then column `P − 1 + k` of the teacher-forced pass.

use anyhow::{Result, bail};
use candle_core::{DType, Device, Tensor};
use turnwise_model::Transformer;
use turnwise_model::logprobs::logprobs_and_entropy_with_temperature;

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
    /// Per response token: A2TGPO clip scale (1 elsewhere).
    pub clip_scale: Vec<f32>,
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
            clip_scale: vec![1.0; n],
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
                    clip_scale: self.clip_scale[start..end].to_vec(),
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
    /// Clip scales [B, L].
    pub clip_scale: Tensor,
    /// Value targets [B, L].
    pub returns: Tensor,
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
            || r.clip_scale.len() != n
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
    let mut clip = vec![1f32; b * l];
    let mut ret = vec![0f32; b * l];
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
            clip[i * l + k] = r.clip_scale[k];
            ret[i * l + k] = r.returns[k];
        }
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
        clip_scale: f(clip)?,
        returns: f(ret)?,
    })
}

/// Log-probs and entropies of the response tokens, [B, L] each (differentiable when `model`
/// tracks gradients), at sampling temperature `temperature`.
pub fn response_logprobs(
    model: &Transformer,
    packed: &Packed,
    temperature: f64,
) -> Result<(Tensor, Tensor)> {
    let (logp, ent) = logprobs_and_entropy_with_temperature(
        model,
        &packed.ids,
        &packed.positions,
        &packed.key_mask,
        &packed.targets,
        temperature,
    )?;
    let start = packed.prompt_width - 1;
    let l = packed.response_width;
    Ok((
        logp.narrow(1, start, l)?.to_dtype(DType::F32)?,
        ent.narrow(1, start, l)?.to_dtype(DType::F32)?,
    ))
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
