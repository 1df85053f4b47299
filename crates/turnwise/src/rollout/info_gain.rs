//! Information-gain probes (spec §4): after a rollout, one batched teacher-forced pass with the
//! rollout weights scores the ground truth after every observation; `ig_t = p_t − p_{t−1}`.
//! The probe suffix is tokenised in three parts so the ground-truth span is exact.

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use turnwise_core::info_gain::{ProbeSuffix, TruncatedRolloutRule, build_probe_ids, info_gains};
use turnwise_core::trajectory::FinishReason;
use turnwise_model::Transformer;
use turnwise_model::logprobs::logprobs_and_entropy;
use turnwise_model::tokenizer::TextTokenizer;

use super::Episode;
use crate::config::AgentFormatName;

/// Probe rows per forward pass.
const PROBE_CHUNK: usize = 64;

/// The text around the ground truth in a probe, per format: the answer turn as the
/// demonstrations write it.
pub fn probe_suffix_text(format: AgentFormatName) -> (&'static str, &'static str) {
    match format {
        AgentFormatName::SearchR1 => (
            "<think>I have found the answer.</think>\n<answer>",
            "</answer>",
        ),
        AgentFormatName::Boxed => (
            "<think>I have found the answer.</think>\n<answer>\\boxed{",
            "}</answer>",
        ),
        AgentFormatName::T2po => (
            "<think>I have found the answer.</think><action><answer>",
            "</answer></action>",
        ),
    }
}

/// Result of the probes of a batch.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbeResult {
    /// Per episode: `ig` per process turn (`num_turns − 1` entries).
    pub gains: Vec<Vec<f64>>,
    /// Probes whose ground-truth span was empty.
    pub failures: usize,
    /// Probes run.
    pub probes: usize,
}

/// Computes the information gain of every process turn of every episode; `golds[i]` is the
/// first golden answer of episode `i`.
pub fn probe(
    model: &Transformer,
    tokenizer: &TextTokenizer,
    format: AgentFormatName,
    episodes: &[Episode],
    golds: &[String],
) -> Result<ProbeResult> {
    let (before, after) = probe_suffix_text(format);
    let before_ids = tokenizer.encode(before)?;
    let after_ids = tokenizer.encode(after)?;
    // (episode, probe index, ids, gt span)
    let mut rows: Vec<(usize, std::ops::Range<usize>, Vec<u32>)> = Vec::new();
    let mut per_episode_probes = Vec::with_capacity(episodes.len());
    for (e, (ep, gold)) in episodes.iter().zip(golds).enumerate() {
        let gt_ids = tokenizer.encode(gold)?;
        let suffix = ProbeSuffix {
            before_gt: &before_ids,
            gt: &gt_ids,
            after_gt: &after_ids,
        };
        let flat = ep.trajectory.flatten(true);
        let plans = build_probe_ids(
            &ep.trajectory.prompt_ids,
            &flat.ids,
            &ep.observation_spans,
            &suffix,
            ep.trajectory.finish == FinishReason::TurnLimit,
            TruncatedRolloutRule::ProbeLastObservation,
        )
        .with_context(|| format!("planning the probes of {}", ep.trajectory.id))?;
        per_episode_probes.push(plans.len());
        for (plan, ids) in plans {
            rows.push((e, plan.gt_span, ids));
        }
    }
    let mut gt_logprobs: Vec<Vec<f64>> = vec![Vec::new(); rows.len()];
    for (c, chunk) in rows.chunks(PROBE_CHUNK).enumerate() {
        let lps = teacher_forced_logprobs(model, chunk.iter().map(|r| r.2.as_slice()))?;
        for (k, (row, lp)) in chunk.iter().zip(lps).enumerate() {
            gt_logprobs[c * PROBE_CHUNK + k] = row.1.clone().map(|p| lp[p]).collect();
        }
    }
    let mut gains = Vec::with_capacity(episodes.len());
    let mut failures = 0;
    let mut next = 0;
    for (ep, n) in episodes.iter().zip(per_episode_probes) {
        let ig = info_gains(&gt_logprobs[next..next + n]);
        next += n;
        failures += ig.probe_failures;
        let want = ep.trajectory.num_turns().saturating_sub(1);
        let mut g = ig.gains;
        g.resize(want, 0.0);
        gains.push(g);
    }
    Ok(ProbeResult {
        gains,
        failures,
        probes: rows.len(),
    })
}

/// Per row, `lp[k]` = log-prob of token `k` given the tokens before it (`lp[0]` = 0).
pub fn teacher_forced_logprobs<'a>(
    model: &Transformer,
    rows: impl Iterator<Item = &'a [u32]>,
) -> Result<Vec<Vec<f64>>> {
    let rows: Vec<&[u32]> = rows.collect();
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let device = model.device().clone();
    let width = rows.iter().map(|r| r.len()).max().unwrap_or(1).max(2);
    let b = rows.len();
    let mut ids = vec![0u32; b * width];
    let mut pos = vec![0u32; b * width];
    let mut mask = vec![0u8; b * width];
    let mut targets = vec![0u32; b * width];
    for (i, r) in rows.iter().enumerate() {
        for (k, &t) in r.iter().enumerate() {
            ids[i * width + k] = t;
            pos[i * width + k] = k as u32;
            mask[i * width + k] = 1;
            if k > 0 {
                targets[i * width + k - 1] = t;
            }
        }
    }
    let t = |v: Vec<u32>| Tensor::from_vec(v, (b, width), &device);
    let (logp, _) = logprobs_and_entropy(
        model,
        &t(ids)?,
        &t(pos)?,
        &Tensor::from_vec(mask, (b, width), &Device::Cpu)?.to_device(&device)?,
        &t(targets)?,
    )?;
    let logp = logp.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?;
    Ok(rows
        .iter()
        .zip(logp)
        .map(|(r, lp)| {
            let mut out = vec![0.0; r.len()];
            for k in 1..r.len() {
                out[k] = f64::from(lp[k - 1]);
            }
            out
        })
        .collect())
}
