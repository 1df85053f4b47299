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
}

impl Row {
    /// The training row of a trajectory: its prompt, its flattened response, the loss mask
    /// (forced tokens trained on only with `train_on_forced`) and the turn ids.
    pub fn from_trajectory(
        t: &turnwise_core::trajectory::Trajectory,
        train_on_forced: bool,
    ) -> Self {
        let f = t.flatten(train_on_forced);
        Self::new(t.prompt_ids.clone(), f.ids, f.loss_mask, f.turn_id)
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
        }
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
