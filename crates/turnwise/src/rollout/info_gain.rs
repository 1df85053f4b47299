//! Information-gain probes (spec §4): after a rollout, one batched teacher-forced pass with the
//! rollout weights scores the ground truth after every observation; `ig_t = p_t − p_{t−1}`.
//! The probe suffix is tokenised in three parts so the ground-truth span is exact.

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use turnwise_core::info_gain::{ProbeSuffix, TruncatedRolloutRule, build_probe_ids, info_gains};
use turnwise_core::trajectory::{FinishReason, Segment, Trajectory};
use turnwise_model::Transformer;
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
        AgentFormatName::Verifiers => (
            "<reasoning>I have found the answer.</reasoning>\n<answer>",
            "</answer>",
        ),
    }
}

/// Information gains that do not line up with their episode's turns. An episode has exactly one
/// gain per process turn (every agent turn but the last), measured after the observation that
/// follows that turn; anything else is an error rather than a gain of 0, which the turn groups
/// of A2TGPO and IGPO's pool would rank as a real value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InfoGainMismatch {
    /// The episode's observation spans are not its trajectory's environment segments.
    #[error(
        "episode {index} ({id}): {spans} observation spans for {segments} environment segments \
         in its trajectory"
    )]
    Spans {
        /// Index of the episode in its batch.
        index: usize,
        /// Trajectory id.
        id: String,
        /// `Episode::observation_spans.len()`.
        spans: usize,
        /// Environment segments of the trajectory.
        segments: usize,
    },
    /// Observation `observation` does not follow agent turn `observation`.
    #[error(
        "episode {index} ({id}): observation {observation} follows {} instead of agent turn \
         {observation}, so its information gain would be credited to another turn",
        after_turn.map_or("no agent turn".to_string(), |t| format!("agent turn {t}"))
    )]
    MisplacedObservation {
        /// Index of the episode in its batch.
        index: usize,
        /// Trajectory id.
        id: String,
        /// The observation (0-based).
        observation: usize,
        /// The agent turn it follows (`None`: none before it).
        after_turn: Option<usize>,
    },
    /// A process turn (not the last) has no observation after it, hence no probe.
    #[error(
        "episode {index} ({id}): agent turn {turn} of {turns} has no observation after it, so \
         it has no information gain (every turn but the last needs one)"
    )]
    MissingObservation {
        /// Index of the episode in its batch.
        index: usize,
        /// Trajectory id.
        id: String,
        /// The first process turn without an observation (0-based).
        turn: usize,
        /// Agent turns of the episode.
        turns: usize,
    },
    /// The episode has another number of gains than process turns.
    #[error(
        "episode {index} ({id}): {gains} information gains for {turns} agent turns ({expected} \
         process turns)"
    )]
    Count {
        /// Index of the episode in its batch.
        index: usize,
        /// Trajectory id.
        id: String,
        /// Gains given.
        gains: usize,
        /// Agent turns of the episode.
        turns: usize,
        /// Gains expected: `turns − 1`.
        expected: usize,
    },
}

/// Per environment segment of `traj`, in order, the agent turn of the last agent segment
/// before it (`None`: none).
fn turns_before_observations(traj: &Trajectory) -> Vec<Option<usize>> {
    let mut last = None;
    let mut out = Vec::new();
    for seg in &traj.segments {
        match seg {
            Segment::Agent(a) => last = Some(a.turn),
            Segment::Env(_) => out.push(last),
        }
    }
    out
}

/// The process-turn gains of episode `index` from its probes' gains (`gains[k]`: the gain of
/// the observation after agent turn `k`, one per observation).
///
/// Every observation must follow the agent turn of its own index, and every turn but the last
/// must have one. The final turn takes no gain (spec §3.5: outcome only): when it was followed by
/// an observation too (a rollout cut by the response length right after a tool turn), that
/// observation's gain is dropped. Any other shape is an [`InfoGainMismatch`].
pub fn process_turn_gains(
    index: usize,
    ep: &Episode,
    mut gains: Vec<f64>,
) -> Result<Vec<f64>, InfoGainMismatch> {
    let id = || ep.trajectory.id.clone();
    let after = turns_before_observations(&ep.trajectory);
    let observations = ep.observation_spans.len();
    if after.len() != observations {
        return Err(InfoGainMismatch::Spans {
            index,
            id: id(),
            spans: observations,
            segments: after.len(),
        });
    }
    if let Some((k, &t)) = after.iter().enumerate().find(|&(k, t)| *t != Some(k)) {
        return Err(InfoGainMismatch::MisplacedObservation {
            index,
            id: id(),
            observation: k,
            after_turn: t,
        });
    }
    let turns = ep.trajectory.num_turns();
    let expected = turns.saturating_sub(1);
    if gains.len() != observations {
        return Err(InfoGainMismatch::Count {
            index,
            id: id(),
            gains: gains.len(),
            turns,
            expected,
        });
    }
    if observations < expected {
        return Err(InfoGainMismatch::MissingObservation {
            index,
            id: id(),
            turn: observations,
            turns,
        });
    }
    // Observations follow distinct turns in order, so at most one (after the final turn) is
    // left over.
    gains.truncate(expected);
    Ok(gains)
}

/// Checks that `gains`, the information gains of episode `index` of a batch, are one per process
/// turn of `ep`.
pub fn check_episode_gains(
    index: usize,
    ep: &Episode,
    gains: &[f64],
) -> Result<(), InfoGainMismatch> {
    let turns = ep.trajectory.num_turns();
    let expected = turns.saturating_sub(1);
    if gains.len() != expected {
        return Err(InfoGainMismatch::Count {
            index,
            id: ep.trajectory.id.clone(),
            gains: gains.len(),
            turns,
            expected,
        });
    }
    Ok(())
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
/// first golden answer of episode `i`. An episode whose observations do not line up with its
/// process turns is an error naming it ([`InfoGainMismatch`], see [`process_turn_gains`]).
pub fn probe(
    model: &Transformer,
    tokenizer: &TextTokenizer,
    format: AgentFormatName,
    episodes: &[Episode],
    golds: &[String],
) -> Result<ProbeResult> {
    if golds.len() != episodes.len() {
        anyhow::bail!(
            "{} golden answers for {} episodes to probe",
            golds.len(),
            episodes.len()
        );
    }
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
    // Rows in token order share a forward pass: one episode's probes (its prompt and earlier
    // turns) and one group's (its prompt) are neighbours, and each chunk runs what they share
    // once ([`span_logprobs`]); results go back in order.
    let mut by_len: Vec<usize> = (0..rows.len()).collect();
    by_len.sort_by(|&a, &b| rows[a].2.cmp(&rows[b].2));
    // Chunks run side by side on the CPU's cores.
    let k = crate::shard::training_shard_count(model, rows.len());
    let chunk = PROBE_CHUNK.min(rows.len().div_ceil(k).max(1));
    let chunks: Vec<&[usize]> = by_len.chunks(chunk).collect();
    let parts = crate::shard::map_chunks(k, &chunks, |c| {
        span_logprobs(
            model,
            &c.iter()
                .map(|&i| (rows[i].2.as_slice(), rows[i].1.clone()))
                .collect::<Vec<_>>(),
        )
    })?;
    let mut gt_logprobs: Vec<Vec<f64>> = vec![Vec::new(); rows.len()];
    for (c, lps) in chunks.iter().zip(parts) {
        for (&i, lp) in c.iter().zip(lps) {
            gt_logprobs[i] = lp;
        }
    }
    let mut gains = Vec::with_capacity(episodes.len());
    let mut failures = 0;
    let mut next = 0;
    for (e, (ep, n)) in episodes.iter().zip(per_episode_probes).enumerate() {
        let ig = info_gains(&gt_logprobs[next..next + n]);
        next += n;
        failures += ig.probe_failures;
        gains.push(process_turn_gains(e, ep, ig.gains)?);
    }
    Ok(ProbeResult {
        gains,
        failures,
        probes: rows.len(),
    })
}

/// Per row `(ids, span)`, the log-prob of each token `ids[k]`, `k` in `span`, given the
/// tokens before it (every `k` must be at least 1). Rows that share a prefix of at least
/// [`crate::shard::MIN_SHARED_PREFIX`] tokens (the probes of one episode share its
/// prompt and earlier turns) run it once
/// ([`turnwise_model::logprobs::shared_prefix_logprobs_entropy`]); the others in one padded
/// pass. The LM head and the softmax run only at the positions that predict a span token.
pub fn span_logprobs(
    model: &Transformer,
    rows: &[(&[u32], std::ops::Range<usize>)],
) -> Result<Vec<Vec<f64>>> {
    for (i, (r, span)) in rows.iter().enumerate() {
        if !span.is_empty() && (span.start == 0 || span.end > r.len()) {
            anyhow::bail!(
                "probe row {i}: span {span:?} must lie within 1..={} ",
                r.len()
            );
        }
    }
    let seqs: Vec<&[u32]> = rows.iter().map(|r| r.0).collect();
    let groups = crate::shard::prefix_groups(&seqs, crate::shard::MIN_SHARED_PREFIX);
    if groups.is_empty() {
        return padded_span_logprobs(model, rows);
    }
    let mut out = vec![Vec::new(); rows.len()];
    let mut in_group = vec![false; rows.len()];
    let mut shared = Vec::new();
    let mut order = Vec::new();
    for (g, group) in groups.iter().enumerate() {
        for &i in &group.rows {
            let (seq, span) = &rows[i];
            in_group[i] = true;
            order.push(i);
            shared.push(turnwise_model::logprobs::SharedRow {
                seq,
                group: g,
                from: span.start.saturating_sub(1),
                len: span.len(),
                scored: None,
            });
        }
    }
    let lens: Vec<usize> = groups.iter().map(|g| g.len).collect();
    let width = shared.iter().map(|r| r.len).max().unwrap_or(1).max(1);
    let (lp, _) = turnwise_model::logprobs::shared_prefix_logprobs_entropy(
        model, &lens, &shared, width, 1.0,
    )?;
    let lp = lp.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?;
    for ((&i, r), v) in order.iter().zip(&shared).zip(lp) {
        out[i] = v[..r.len].iter().map(|&x| f64::from(x)).collect();
    }
    let rest: Vec<usize> = (0..rows.len()).filter(|&i| !in_group[i]).collect();
    let rest_rows: Vec<(&[u32], std::ops::Range<usize>)> =
        rest.iter().map(|&i| rows[i].clone()).collect();
    for (&i, v) in rest.iter().zip(padded_span_logprobs(model, &rest_rows)?) {
        out[i] = v;
    }
    Ok(out)
}

/// [`span_logprobs`] in one padded pass over every row (spans already checked).
fn padded_span_logprobs(
    model: &Transformer,
    rows: &[(&[u32], std::ops::Range<usize>)],
) -> Result<Vec<Vec<f64>>> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let device = model.device().clone();
    let width = rows.iter().map(|r| r.0.len()).max().unwrap_or(1).max(1);
    let b = rows.len();
    let mut ids = vec![0u32; b * width];
    let mut pos = vec![0u32; b * width];
    let mut mask = vec![0u8; b * width];
    // Flat index (row * width + position) of the state that predicts each span token.
    let mut at = Vec::new();
    let mut targets = Vec::new();
    for (i, (r, span)) in rows.iter().enumerate() {
        for (k, &t) in r.iter().enumerate() {
            ids[i * width + k] = t;
            pos[i * width + k] = k as u32;
            mask[i * width + k] = 1;
        }
        for k in span.clone() {
            at.push((i * width + k - 1) as u32);
            targets.push(r[k]);
        }
    }
    let n = at.len();
    let t = |v: Vec<u32>| Tensor::from_vec(v, (b, width), &device);
    let hidden = model.forward_hidden(
        &t(ids)?,
        &t(pos)?,
        &Tensor::from_vec(mask, (b, width), &Device::Cpu)?.to_device(&device)?,
        None,
    )?;
    let h = hidden.dims3()?.2;
    let picked = hidden
        .reshape((b * width, h))?
        .index_select(&Tensor::from_vec(at, n, &device)?, 0)?;
    let logits = model.logits(&picked.unsqueeze(0)?)?;
    let (lp, _) = turnwise_model::logprobs::token_logprobs_and_entropy(
        &logits,
        &Tensor::from_vec(targets, (1, n), &device)?,
    )?;
    let lp = lp
        .squeeze(0)?
        .to_dtype(candle_core::DType::F32)?
        .to_vec1::<f32>()?;
    let mut out = Vec::with_capacity(b);
    let mut next = 0;
    for (_, span) in rows {
        out.push(
            lp[next..next + span.len()]
                .iter()
                .map(|&v| f64::from(v))
                .collect(),
        );
        next += span.len();
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};
    use turnwise_model::ModelConfig;
    use turnwise_model::Transformer;
    use turnwise_model::model::weights::init_varmap;

    use anyhow::Result;
    use candle_core::Tensor;
    use turnwise_model::logprobs::logprobs_and_entropy;

    use super::span_logprobs;

    /// The reference: per row, `lp[k]` = log-prob of token `k` given the tokens before it
    /// (`lp[0]` = 0), from the full teacher-forced pass (LM head at every position).
    fn teacher_forced_logprobs<'a>(
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

    /// The span-only pass (LM head at the span positions) equals the full teacher-forced
    /// pass at those positions, for rows of different lengths batched together (padding),
    /// an empty span, and a span that ends the row.
    #[test]
    fn span_logprobs_match_the_full_teacher_forced_pass() {
        let mut cfg = ModelConfig::tiny_qwen2(64);
        cfg.initializer_range = 0.2;
        let vm = init_varmap(&cfg, DType::F32, &Device::Cpu, 7).unwrap();
        let model = Transformer::detached_from_varmap(&cfg, &vm).unwrap();
        let rows: Vec<Vec<u32>> = vec![
            (1..12).collect(),
            vec![5, 9, 2, 40, 41, 42],
            (3..30).map(|i| (i * 7 % 60) as u32).collect(),
            vec![8, 8, 8],
        ];
        let spans = [4..7, 3..6, 20..27, 2..2];
        let full = teacher_forced_logprobs(&model, rows.iter().map(|r| r.as_slice())).unwrap();
        let input: Vec<(&[u32], std::ops::Range<usize>)> = rows
            .iter()
            .zip(spans.iter())
            .map(|(r, s)| (r.as_slice(), s.clone()))
            .collect();
        let got = span_logprobs(&model, &input).unwrap();
        for ((f, g), s) in full.iter().zip(&got).zip(spans.iter()) {
            assert_eq!(g.len(), s.len());
            for (k, v) in s.clone().zip(g) {
                assert!((f[k] - v).abs() < 1e-5, "position {k}: {} vs {v}", f[k]);
                assert!(*v < 0.0);
            }
        }
        // Probes of one episode: a shared context, then each turn's continuation and the
        // answer span; run shared, they equal the padded pass.
        let context: Vec<u32> = (1..21).collect();
        let probes: Vec<Vec<u32>> = [&[30u32, 31, 32][..], &[30, 33], &[40, 41, 42, 43]]
            .iter()
            .map(|t| [&context[..], t].concat())
            .collect();
        let spans = [21..23, 20..22, 19..24];
        let input: Vec<(&[u32], std::ops::Range<usize>)> = probes
            .iter()
            .zip(spans.iter())
            .map(|(r, s)| (r.as_slice(), s.clone()))
            .collect();
        let seqs: Vec<&[u32]> = probes.iter().map(Vec::as_slice).collect();
        assert_eq!(crate::shard::prefix_groups(&seqs, 8).len(), 1);
        let full = teacher_forced_logprobs(&model, seqs.iter().copied()).unwrap();
        let got = span_logprobs(&model, &input).unwrap();
        for ((f, g), s) in full.iter().zip(&got).zip(spans.iter()) {
            assert_eq!(g.len(), s.len());
            for (k, v) in s.clone().zip(g) {
                assert!(
                    (f[k] - v).abs() < 1e-5,
                    "shared, position {k}: {} vs {v}",
                    f[k]
                );
            }
        }
        let bad: Vec<(&[u32], std::ops::Range<usize>)> = vec![(&rows[0][..], 0..2)];
        let err = span_logprobs(&model, &bad).unwrap_err().to_string();
        assert!(err.contains("probe row 0"), "{err}");
    }
}
