//! The step's sample lines (`samples/step-N.jsonl`, [`SampleRecord`]): the first
//! `run.samples_per_step` episodes of a step with their decoded text and what the step computed
//! for them (advantages, information gain, clip scales and clipped tokens, groups). Only those
//! episodes are decoded and copied, so the cost stays that of a few episodes.

use std::collections::HashMap;

use anyhow::{Context, Result};
use turnwise_core::advantage::{Channel, ChannelValues, Channels};
use turnwise_core::trajectory::Segment;
use turnwise_model::tokenizer::TextTokenizer;

use super::advantage::{EpisodeAdvantage, mean_std};
use super::sampling::{ScoredEpisode, StepBatch};
use crate::run::{SampleGroup, SampleRecord, StepGroup, TurnText};
use crate::update::{Row, RowClips};

/// What the update did with one sample episode that it trained on.
#[derive(Debug, Clone)]
pub struct TrainedSample {
    /// Its trajectory row's advantages, one per response token.
    pub advantages: Vec<f32>,
    /// Its trajectory row's turn ids (−1 on observation tokens).
    pub turn_id: Vec<i32>,
    /// What the estimator computed for it.
    pub detail: EpisodeAdvantage,
    /// Per response token: the applied mini-batch passes over it.
    pub passes: Vec<u32>,
    /// Per response token: the passes in which its PPO clip was active.
    pub clipped: Vec<u32>,
}

impl TrainedSample {
    /// The sample of trajectory row `row` with the estimator's `detail`, before the update.
    pub fn new(row: &Row, detail: &EpisodeAdvantage) -> Self {
        let n = row.response.len();
        Self {
            advantages: row.advantages.clone(),
            turn_id: row.turn_id.clone(),
            detail: detail.clone(),
            passes: vec![0; n],
            clipped: vec![0; n],
        }
    }

    /// Adds the clip counts of a training row that holds this trajectory row's tokens from
    /// `offset` on (the row itself at 0, or one of its step samples).
    pub fn add_clips(&mut self, offset: usize, clips: &RowClips) {
        let end = (offset + clips.clipped.len()).min(self.passes.len());
        for (k, &c) in (offset..end).zip(&clips.clipped) {
            self.passes[k] += clips.passes;
            self.clipped[k] += c;
        }
    }
}

/// For each of `samples` (episodes), the index of its trajectory row among the trained rows,
/// one per episode of `trained` in order; `None` for an episode the update does not train on.
pub fn trained_rows(samples: &[ScoredEpisode], trained: &[ScoredEpisode]) -> Vec<Option<usize>> {
    let row_of: HashMap<&str, usize> = trained
        .iter()
        .enumerate()
        .map(|(j, e)| (e.episode.trajectory.id.as_str(), j))
        .collect();
    samples
        .iter()
        .map(|e| row_of.get(e.episode.trajectory.id.as_str()).copied())
        .collect()
}

/// Where each of [`Row::step_samples`]' rows starts in the trajectory row with turn ids
/// `turn_id`: the first token of each agent turn.
pub fn step_sample_offsets(turn_id: &[i32]) -> Vec<usize> {
    let mut starts = Vec::new();
    let mut current = None;
    for (p, &t) in turn_id.iter().enumerate() {
        if t >= 0 && current != Some(t) {
            starts.push(p);
            current = Some(t);
        }
    }
    starts
}

/// The sample lines of the first `trained.len()` episodes of `all`; `trained[i]` is what the
/// update did with episode `i` (`None`: not trained on).
pub fn sample_records(
    tokenizer: &TextTokenizer,
    all: &StepBatch,
    trained: Vec<Option<TrainedSample>>,
) -> Result<Vec<SampleRecord>> {
    let mut scores_of: HashMap<usize, Vec<f64>> = HashMap::new();
    for e in &all.episodes {
        scores_of.entry(e.group).or_default().push(e.score);
    }
    trained
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let scored = &all.episodes[i];
            let ep = &scored.episode;
            let traj = &ep.trajectory;
            let mut rec = SampleRecord::new(traj.clone());
            rec.prompt_text = Some(
                tokenizer
                    .decode(&traj.prompt_ids, false)
                    .with_context(|| format!("decoding the prompt of {}", traj.id))?,
            );
            rec.turn_texts = ep
                .turn_texts
                .iter()
                .map(|(g, o)| TurnText {
                    agent: g.clone(),
                    observation: o.clone(),
                })
                .collect();
            for seg in &traj.segments {
                if let Segment::Agent(a) = seg {
                    rec.token_texts.extend(
                        tokenizer
                            .decode_pieces(&a.ids)
                            .with_context(|| format!("decoding the tokens of {}", traj.id))?,
                    );
                }
            }
            rec.em = Some(scored.em);
            rec.format_ok = Some(scored.format_ok);
            rec.answer = ep.answer.clone();
            rec.gold = scored.golds.clone();
            rec.info_gain = scored.info_gain.clone();
            rec.trained = Some(t.is_some());
            match t {
                Some(t) => {
                    let agent: Vec<usize> = (0..t.turn_id.len())
                        .filter(|&k| t.turn_id[k] >= 0)
                        .collect();
                    rec.advantages =
                        Some(agent.iter().map(|&k| f64::from(t.advantages[k])).collect());
                    if agent.iter().any(|&k| t.passes[k] > 0) {
                        rec.clipped = Some(
                            agent
                                .iter()
                                .map(|&k| match t.passes[k] {
                                    0 => 0.0,
                                    p => f64::from(t.clipped[k]) / f64::from(p),
                                })
                                .collect(),
                        );
                    }
                    let d = t.detail;
                    rec.turn_advantages = Some(d.turns);
                    let mut channels = d.channels;
                    rec.step_groups = step_groups(&mut channels);
                    rec.channels = ChannelValues(channels);
                    rec.score = Some(d.score);
                    rec.group = Some(SampleGroup {
                        id: d.group,
                        size: d.group_size,
                        mean: d.group_mean,
                        std: d.group_std,
                    });
                }
                None => {
                    rec.score = Some(scored.score);
                    let (size, mean, std) = mean_std(&scores_of[&scored.group]);
                    rec.group = Some(SampleGroup {
                        id: scored.group,
                        size,
                        mean,
                        std,
                    });
                }
            }
            Ok(rec)
        })
        .collect()
}

/// The anchor groups of the step-group channels ([`Channel::StepGroup`] and
/// [`Channel::StepGroupSize`], which GiGPO's and T2PO's estimators emit), taken out of
/// `channels`: a sample writes them as one `step_groups` list of `{id, size}` per agent turn,
/// as it did before channels existed (the viewer and the compat fixtures read that form).
fn step_groups(channels: &mut Channels) -> Option<Vec<StepGroup>> {
    let ids = channels.remove(&Channel::StepGroup);
    let sizes = channels.remove(&Channel::StepGroupSize);
    Some(
        ids?.iter()
            .zip(sizes?)
            .map(|(&id, size)| StepGroup {
                id: id as usize,
                size: size as usize,
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The offsets are where `Row::step_samples` cuts: each turn's first token, an observation
    /// injected inside a turn staying in it.
    #[test]
    fn step_sample_offsets_match_the_step_samples() {
        let turn_id = vec![0, 0, -1, 1, -1, 1, -1, -1, 2];
        let offsets = step_sample_offsets(&turn_id);
        assert_eq!(offsets, vec![0, 3, 8]);
        let row = Row::new(vec![1], (10..19).collect(), vec![1; 9], turn_id);
        let steps = row.step_samples(None);
        assert_eq!(steps.len(), offsets.len());
        for (s, &o) in steps.iter().zip(&offsets) {
            assert_eq!(s.response[..], row.response[o..o + s.response.len()]);
        }
        let detail = EpisodeAdvantage {
            turns: vec![0.0; 3],
            channels: Default::default(),
            score: 0.0,
            group: 0,
            group_size: 1,
            group_mean: 0.0,
            group_std: 0.0,
        };
        let mut t = TrainedSample::new(&row, &detail);
        t.add_clips(
            3,
            &RowClips {
                passes: 2,
                clipped: vec![1, 0, 2],
            },
        );
        assert_eq!(t.passes, vec![0, 0, 0, 2, 2, 2, 0, 0, 0]);
        assert_eq!(t.clipped, vec![0, 0, 0, 1, 0, 2, 0, 0, 0]);
    }
}
