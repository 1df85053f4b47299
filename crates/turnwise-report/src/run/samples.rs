//! The lines of `samples/step-N.jsonl`: each a trajectory of the step, token-exact, with what
//! the step computed for it (decoded text, advantages, information gain, clip state, group),
//! which the trajectory viewer ([`super::view`]) shows.
//!
//! Every annotation is optional and the trajectory's own fields stay at the top level of the
//! line, so the files of runs written before the annotations existed read as records with the
//! annotations absent.

use serde::{Deserialize, Serialize};
use turnwise_core::advantage::ChannelValues;
use turnwise_core::trajectory::Trajectory;

use super::{RunDir, RunError, RunResult};

/// One line of `samples/step-N.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleRecord {
    /// The token-exact trajectory (its fields are the line's top-level fields).
    #[serde(flatten)]
    pub trajectory: Trajectory,
    /// The decoded prompt, special tokens kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_text: Option<String>,
    /// Per agent turn: the generated text and the observation after it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub turn_texts: Vec<TurnText>,
    /// Per agent token, in response order: the text it adds to the decoded response
    /// (`TextTokenizer::decode_pieces` of each agent segment).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub token_texts: Vec<String>,
    /// Per agent token, in response order: the advantage the update trained it with. Absent
    /// for an episode that was not trained on (DAPO's group filter dropped its group).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advantages: Option<Vec<f64>>,
    /// Per agent turn: the estimator's advantage of the turn (for GAE and IGPO's code form,
    /// whose advantages vary within a turn, the one at its first token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn_advantages: Option<Vec<f64>>,
    /// Per process turn (IGPO, A2TGPO): the information gain of the turn's observation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub info_gain: Option<Vec<f64>>,
    /// The channels the estimator emitted for the episode, each under its own key, one value
    /// per turn ([`Channel`](turnwise_core::advantage::Channel): A2TGPO's
    /// `normalized_info_gain` per process turn and `clip_scale` per agent turn).
    #[serde(flatten)]
    pub channels: ChannelValues<Vec<f64>>,
    /// Per agent token: the share of the update's mini-batch passes over it in which its PPO
    /// clip was active (what `actor/pg_clipfrac` counts); absent when nothing was trained.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clipped: Option<Vec<f64>>,
    /// The episode's score as the estimator read it (the reward's score with DAPO's overlong
    /// penalty, minus the KL of KL in the reward).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub score: Option<f64>,
    /// Exact match of the episode's answer (a game's success).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub em: Option<f64>,
    /// Whether the episode's format was valid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format_ok: Option<bool>,
    /// The extracted final answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    /// The gold answers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gold: Vec<String>,
    /// Whether the update trained on the episode (false: DAPO's group filter dropped it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trained: Option<bool>,
    /// The prompt group the episode's advantage was normalised in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<SampleGroup>,
    /// Per agent turn (GiGPO, T2PO): the step's anchor group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_groups: Option<Vec<StepGroup>>,
}

impl SampleRecord {
    /// A record of `trajectory` without annotations (what an old line reads as).
    pub fn new(trajectory: Trajectory) -> Self {
        Self {
            trajectory,
            prompt_text: None,
            turn_texts: Vec::new(),
            token_texts: Vec::new(),
            advantages: None,
            turn_advantages: None,
            info_gain: None,
            channels: ChannelValues::default(),
            clipped: None,
            score: None,
            em: None,
            format_ok: None,
            answer: None,
            gold: Vec::new(),
            trained: None,
            group: None,
            step_groups: None,
        }
    }
}

/// One agent turn's decoded text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnText {
    /// What the agent generated.
    pub agent: String,
    /// The observation the environment returned after it, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observation: Option<String>,
}

/// A prompt group of one step: the rollouts of one prompt, whose scores the group-relative
/// estimators normalise together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleGroup {
    /// The group's id in the step (unique over its generation rounds).
    pub id: usize,
    /// Its rollouts (in the trained batch; all generated ones for a dropped group).
    pub size: usize,
    /// Mean of the scores the estimator normalised in the group: its rollouts' scores, or for
    /// GiGPO's and T2PO's episode term over step samples (their default) its step samples'
    /// episode scores (each step's penalty taken off).
    pub mean: f64,
    /// Sample (unbiased) standard deviation of the same scores; 0 for one score.
    pub std: f64,
}

/// GiGPO's anchor group of one step (agent turn).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepGroup {
    /// The group's id in the step's batch.
    pub id: usize,
    /// Step samples in the group (1: no peer, a step term of 0).
    pub size: usize,
}

impl RunDir {
    /// Reads `samples/step-N.jsonl` (or its gzipped copy) back; `None` when the step has no
    /// samples file.
    pub fn read_samples(&self, step: u64) -> RunResult<Option<Vec<SampleRecord>>> {
        super::dir::read_json_lines(&self.samples_path(step), "not a sample line: ")
    }

    /// The steps with a samples file (`step-N.jsonl`, or gzipped), in increasing order.
    pub fn sample_steps(&self) -> RunResult<Vec<u64>> {
        let dir = self.samples_dir();
        if !dir.is_dir() {
            return Ok(Vec::new());
        }
        let mut steps = Vec::new();
        for entry in std::fs::read_dir(&dir).map_err(RunError::io("list", &dir))? {
            let path = entry.map_err(RunError::io("list", &dir))?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if let Some(s) = super::dir::parse_jsonl_step(name) {
                steps.push(s);
            }
        }
        steps.sort_unstable();
        steps.dedup();
        Ok(steps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use turnwise_core::trajectory::{AgentSegment, Segment, TurnAction, TurnRecord};

    fn trajectory() -> Trajectory {
        let mut t = Trajectory::new("ep-0", "q-0", vec![1, 2]);
        t.push(Segment::Agent(AgentSegment::new(
            0,
            vec![5, 6],
            vec![-0.1, -0.2],
        )));
        t.turns.push(TurnRecord {
            index: 0,
            action: TurnAction::Answer { text: "x".into() },
            format_ok: true,
            observation: None,
            searches_so_far: 0,
            env_reward: None,
            anchor: None,
        });
        t.outcome_reward = Some(1.0);
        t
    }

    /// A line written before the annotations existed (a bare trajectory) reads back with
    /// none; an annotated line keeps the trajectory's fields at the top level and round-trips.
    #[test]
    fn old_and_annotated_lines_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::create(dir.path(), false).unwrap();
        let t = trajectory();
        let mut rec = SampleRecord::new(t.clone());
        rec.advantages = Some(vec![0.5, 0.5]);
        rec.group = Some(SampleGroup {
            id: 3,
            size: 4,
            mean: 0.25,
            std: 0.5,
        });
        run.write_samples(1, std::slice::from_ref(&t)).unwrap();
        run.write_samples(2, std::slice::from_ref(&rec)).unwrap();
        assert_eq!(
            run.read_samples(1).unwrap().unwrap(),
            vec![SampleRecord::new(t.clone())]
        );
        assert_eq!(run.read_samples(2).unwrap().unwrap(), vec![rec]);
        let line: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(run.samples_path(2)).unwrap()).unwrap();
        assert_eq!(line["id"], "ep-0");
        assert_eq!(line["group"]["size"], 4);
        assert_eq!(run.sample_steps().unwrap(), vec![1, 2]);
        assert!(run.read_samples(3).unwrap().is_none());
        std::fs::write(run.samples_path(4), "{\"id\": 1}\n").unwrap();
        let err = run.read_samples(4).unwrap_err().to_string();
        assert!(err.contains("step-00004.jsonl:1"), "{err}");
    }
}
