//! Token-exact trajectories (spec §1).
//!
//! A [`Trajectory`] keeps the prompt ids and, in order, the segments of the response: the ids the
//! policy sampled in each agent turn ([`AgentSegment`], loss mask 1, with sampling log-probs and
//! optional per-token entropy and top-j confidence) and the ids the environment inserted
//! ([`EnvSegment`], loss mask 0). Nothing is decoded and re-encoded on the way to the loss
//! (spec §1.1, "token-in-token-out").
//!
//! Every agent segment carries an explicit turn index (spec §1.2 [REC]); the maximal-run-of-mask
//! rule is only a fallback ([`mask_run_turns`]). Per-turn records ([`TurnRecord`]) hold what
//! rewards and diagnostics need: the action, the query, the observation text and the number of
//! searches so far.
//!
//! Groups of G rollouts per prompt are [`Group`]s; rollout trees are in [`tree`]. Trajectories
//! round-trip through JSON lines ([`jsonl`]) so they can be saved and replayed.

pub mod jsonl;
pub mod mismatch;
pub mod tree;

use serde::{Deserialize, Serialize};

pub use tree::{RolloutTree, TreeNode};

/// A token id of the policy's vocabulary.
pub type TokenId = u32;

/// Errors raised when a trajectory, group or tree is inconsistent.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TrajectoryError {
    /// Per-token arrays of one segment have different lengths.
    #[error(
        "trajectory {trajectory}: segment {segment}: {field} has {got} entries but the segment has {expected} tokens"
    )]
    LengthMismatch {
        /// Trajectory id.
        trajectory: String,
        /// Segment position in the trajectory.
        segment: usize,
        /// The per-token field whose length is wrong.
        field: &'static str,
        /// Its length.
        got: usize,
        /// The number of token ids in the segment.
        expected: usize,
    },
    /// Agent turn indices are not 0, 1, 2, … in order (a turn may span several segments when
    /// the environment injects text inside it, but indices never decrease or skip).
    #[error(
        "trajectory {trajectory}: segment {segment} has turn index {got}, expected {expected_lo} or {expected_hi}"
    )]
    TurnOrder {
        /// Trajectory id.
        trajectory: String,
        /// Segment position in the trajectory.
        segment: usize,
        /// The turn index found.
        got: usize,
        /// The current turn index (continuing a turn).
        expected_lo: usize,
        /// The next turn index (starting a turn).
        expected_hi: usize,
    },
    /// The per-turn records do not match the agent turns.
    #[error("trajectory {trajectory}: {turns} agent turns but {records} turn records")]
    RecordCount {
        /// Trajectory id.
        trajectory: String,
        /// Number of agent turns in the segments.
        turns: usize,
        /// Number of [`TurnRecord`]s.
        records: usize,
    },
    /// A turn record's index does not equal its position.
    #[error("trajectory {trajectory}: turn record at position {position} has index {index}")]
    RecordIndex {
        /// Trajectory id.
        trajectory: String,
        /// Position in `turns`.
        position: usize,
        /// The index stored in the record.
        index: usize,
    },
    /// A log-prob, entropy or confidence value is NaN or infinite.
    #[error("trajectory {trajectory}: segment {segment}: {field}[{token}] is not finite ({value})")]
    NonFinite {
        /// Trajectory id.
        trajectory: String,
        /// Segment position in the trajectory.
        segment: usize,
        /// The per-token field.
        field: &'static str,
        /// Token position inside the segment.
        token: usize,
        /// The offending value.
        value: f32,
    },
    /// A group mixes trajectories of different prompts.
    #[error("group {group}: trajectory {trajectory} belongs to prompt {found}")]
    ForeignTrajectory {
        /// The group's prompt uid.
        group: String,
        /// The trajectory id.
        trajectory: String,
        /// The trajectory's prompt uid.
        found: String,
    },
    /// A tree is malformed (dangling parent or child link, cycle, bad root).
    #[error("tree {tree}: node {node}: {message}")]
    Tree {
        /// Tree id.
        tree: String,
        /// Node index.
        node: usize,
        /// What is wrong.
        message: String,
    },
}

/// Tokens the policy sampled in one agent turn (loss mask 1).
///
/// A turn that the environment interrupts (for example the tool-call-limit notice of spec §1.2
/// injected inside a turn) is stored as two agent segments with the same `turn` index around an
/// [`EnvSegment`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentSegment {
    /// Agent turn index (0-based) this segment belongs to.
    pub turn: usize,
    /// Sampled token ids, exactly as the sampler produced them.
    pub ids: Vec<TokenId>,
    /// Sampling log-probability of each token under the rollout policy.
    pub logprobs: Vec<f32>,
    /// Full-vocabulary entropy at each sampled position, when the sampler computed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entropy: Option<Vec<f32>>,
    /// Top-j confidence `C_t = −(1/j) Σ log p^(i)` at each position (spec §6.2), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_confidence: Option<Vec<f32>>,
    /// Per-token flag: the token was forced by a logits hook (T2PO thinking intervention), not
    /// sampled. Empty means no token was forced.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub forced: Vec<bool>,
    /// The weight version (optimizer step) of the policy that generated the turn, when an
    /// inference server reported it (remote rollouts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<u64>,
}

impl AgentSegment {
    /// A segment of sampled tokens with their log-probs and no other statistics.
    pub fn new(turn: usize, ids: Vec<TokenId>, logprobs: Vec<f32>) -> Self {
        Self {
            turn,
            ids,
            logprobs,
            entropy: None,
            top_confidence: None,
            forced: Vec::new(),
            weight_version: None,
        }
    }

    /// Whether token `k` of the segment was forced.
    pub fn is_forced(&self, k: usize) -> bool {
        self.forced.get(k).copied().unwrap_or(false)
    }

    /// Number of forced tokens in the segment.
    pub fn forced_count(&self) -> usize {
        self.forced.iter().filter(|f| **f).count()
    }

    /// Monte-Carlo entropy estimate of the segment, `−(1/|y|) Σ log π(y_t)` over its sampled
    /// tokens (AT2PO node entropy, spec §6.1). Zero for an empty segment.
    pub fn mean_nll(&self) -> f64 {
        if self.logprobs.is_empty() {
            return 0.0;
        }
        -self.logprobs.iter().map(|&l| f64::from(l)).sum::<f64>() / self.logprobs.len() as f64
    }
}

/// Tokens the environment or harness inserted (loss mask 0): observations, feedback, notices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EnvSegment {
    /// Inserted token ids.
    pub ids: Vec<TokenId>,
}

/// One piece of the response, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Segment {
    /// Sampled by the policy (trained on).
    Agent(AgentSegment),
    /// Inserted by the environment (never trained on).
    Env(EnvSegment),
}

impl Segment {
    /// The segment's token ids.
    pub fn ids(&self) -> &[TokenId] {
        match self {
            Segment::Agent(a) => &a.ids,
            Segment::Env(e) => &e.ids,
        }
    }
}

/// What an agent turn did, as parsed by the tag grammar.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TurnAction {
    /// A tool call: a search with this query.
    Search {
        /// The search query.
        query: String,
    },
    /// A final answer.
    Answer {
        /// The extracted answer text.
        text: String,
    },
    /// A move in a game environment (e.g. `up`), parsed and applied by the environment.
    Move {
        /// The action word.
        action: String,
    },
    /// Output that breaks the grammar.
    Invalid {
        /// Why the output was rejected.
        reason: String,
    },
}

/// Per-turn bookkeeping needed downstream (spec §1.2): rewards, IG probes, GiGPO anchors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnRecord {
    /// Turn index (0-based), equal to the record's position.
    pub index: usize,
    /// The parsed action.
    pub action: TurnAction,
    /// Whether the turn satisfied its format rule.
    #[serde(default = "default_true")]
    pub format_ok: bool,
    /// Observation text the environment returned after this turn, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observation: Option<String>,
    /// Number of searches from the first turn through this one.
    pub searches_so_far: usize,
    /// Environment reward of this step (text games, per-step envs), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env_reward: Option<f64>,
    /// The state the agent acted in, for anchor-state grouping (GiGPO, spec §3.7): the
    /// observation before this turn (for the first turn the environment's first observation,
    /// e.g. a game's starting board); `None` when unrecorded, or for a first turn whose state is
    /// the task's question itself, which the prompt stands for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub anchor: Option<String>,
}

fn default_true() -> bool {
    true
}

impl TurnRecord {
    /// Whether this turn called a tool.
    pub fn is_tool_call(&self) -> bool {
        matches!(self.action, TurnAction::Search { .. })
    }
}

/// Why a rollout ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The agent answered.
    #[default]
    Answered,
    /// The turn or tool-call limit was reached.
    TurnLimit,
    /// The response length limit was reached (the last turn is partial).
    Length,
    /// The environment ended the episode (game won/lost, tool failure).
    EnvDone,
}

/// One rollout for one prompt, token-exact.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trajectory {
    /// Unique id of this rollout.
    pub id: String,
    /// Id of the prompt (task); rollouts of one prompt form a [`Group`].
    pub prompt_uid: String,
    /// Chat-templated prompt ids (never trained on).
    pub prompt_ids: Vec<TokenId>,
    /// The response: agent and environment segments in order.
    pub segments: Vec<Segment>,
    /// One record per agent turn.
    pub turns: Vec<TurnRecord>,
    /// Why the rollout ended.
    #[serde(default)]
    pub finish: FinishReason,
    /// Outcome reward, once scored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome_reward: Option<f64>,
    /// Per-turn rewards, once scored (turn-level reward methods).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub turn_rewards: Vec<f64>,
}

/// The flat token layout of one rollout (spec §1.1).
#[derive(Debug, Clone, PartialEq)]
pub struct FlatResponse {
    /// Concatenated response ids (agent and environment tokens in order).
    pub ids: Vec<TokenId>,
    /// 1 for tokens to train on, 0 otherwise.
    pub loss_mask: Vec<u8>,
    /// Agent turn index per token; −1 for environment tokens.
    pub turn_id: Vec<i32>,
    /// Sampling log-prob per token; 0 for environment tokens.
    pub logprobs: Vec<f32>,
}

impl Trajectory {
    /// An empty trajectory for a prompt.
    pub fn new(
        id: impl Into<String>,
        prompt_uid: impl Into<String>,
        prompt_ids: Vec<TokenId>,
    ) -> Self {
        Self {
            id: id.into(),
            prompt_uid: prompt_uid.into(),
            prompt_ids,
            segments: Vec::new(),
            turns: Vec::new(),
            finish: FinishReason::default(),
            outcome_reward: None,
            turn_rewards: Vec::new(),
        }
    }

    /// Number of agent turns (distinct turn indices).
    pub fn num_turns(&self) -> usize {
        self.segments
            .iter()
            .filter_map(|s| match s {
                Segment::Agent(a) => Some(a.turn + 1),
                Segment::Env(_) => None,
            })
            .max()
            .unwrap_or(0)
    }

    /// Total number of response tokens.
    pub fn response_len(&self) -> usize {
        self.segments.iter().map(|s| s.ids().len()).sum()
    }

    /// Number of tokens sampled by the policy (forced tokens included).
    pub fn agent_token_count(&self) -> usize {
        self.agent_segments().map(|a| a.ids.len()).sum()
    }

    /// Iterates over the agent segments in order.
    pub fn agent_segments(&self) -> impl Iterator<Item = &AgentSegment> {
        self.segments.iter().filter_map(|s| match s {
            Segment::Agent(a) => Some(a),
            Segment::Env(_) => None,
        })
    }

    /// Number of searches the rollout made.
    pub fn search_count(&self) -> usize {
        self.turns.iter().filter(|t| t.is_tool_call()).count()
    }

    /// Appends a segment.
    pub fn push(&mut self, segment: Segment) {
        self.segments.push(segment);
    }

    /// Flattens the response into ids, loss mask, turn ids and log-probs (spec §1.1).
    ///
    /// Forced tokens get loss mask 0 unless `train_on_forced` (spec §6.2 [REC]: they were not
    /// sampled from the rollout policy, so their PPO ratio is not a valid importance weight).
    /// Their turn id is kept so per-turn statistics still see them.
    pub fn flatten(&self, train_on_forced: bool) -> FlatResponse {
        let n = self.response_len();
        let mut out = FlatResponse {
            ids: Vec::with_capacity(n),
            loss_mask: Vec::with_capacity(n),
            turn_id: Vec::with_capacity(n),
            logprobs: Vec::with_capacity(n),
        };
        for seg in &self.segments {
            match seg {
                Segment::Agent(a) => {
                    for (k, &id) in a.ids.iter().enumerate() {
                        out.ids.push(id);
                        let forced = a.is_forced(k);
                        out.loss_mask.push(u8::from(!forced || train_on_forced));
                        out.turn_id.push(a.turn as i32);
                        out.logprobs.push(a.logprobs.get(k).copied().unwrap_or(0.0));
                    }
                }
                Segment::Env(e) => {
                    out.ids.extend_from_slice(&e.ids);
                    out.loss_mask.extend(std::iter::repeat_n(0u8, e.ids.len()));
                    out.turn_id.extend(std::iter::repeat_n(-1i32, e.ids.len()));
                    out.logprobs.extend(std::iter::repeat_n(0f32, e.ids.len()));
                }
            }
        }
        out
    }

    /// Token spans `[start, end)` of each agent turn in the flat response, by explicit turn
    /// index. A turn interrupted by an injected environment segment yields one span from its
    /// first to its last agent token (the injected tokens inside have turn id −1).
    pub fn turn_spans(&self) -> Vec<(usize, usize)> {
        let mut spans: Vec<(usize, usize)> = Vec::new();
        let mut pos = 0usize;
        for seg in &self.segments {
            let len = seg.ids().len();
            if let Segment::Agent(a) = seg
                && len > 0
            {
                if a.turn < spans.len() {
                    spans[a.turn].1 = pos + len;
                } else {
                    while spans.len() < a.turn {
                        spans.push((pos, pos));
                    }
                    spans.push((pos, pos + len));
                }
            }
            pos += len;
        }
        spans
    }

    /// Checks the invariants: per-token arrays as long as the ids, finite statistics, turn
    /// indices in order without gaps, one record per turn with matching indices.
    pub fn validate(&self) -> Result<(), TrajectoryError> {
        let mut current: Option<usize> = None;
        for (s, seg) in self.segments.iter().enumerate() {
            let Segment::Agent(a) = seg else { continue };
            let n = a.ids.len();
            let check_len = |field: &'static str, got: usize| {
                if got == n {
                    Ok(())
                } else {
                    Err(TrajectoryError::LengthMismatch {
                        trajectory: self.id.clone(),
                        segment: s,
                        field,
                        got,
                        expected: n,
                    })
                }
            };
            check_len("logprobs", a.logprobs.len())?;
            if let Some(e) = &a.entropy {
                check_len("entropy", e.len())?;
            }
            if let Some(c) = &a.top_confidence {
                check_len("top_confidence", c.len())?;
            }
            if !a.forced.is_empty() {
                check_len("forced", a.forced.len())?;
            }
            let fields: [(&'static str, Option<&Vec<f32>>); 3] = [
                ("logprobs", Some(&a.logprobs)),
                ("entropy", a.entropy.as_ref()),
                ("top_confidence", a.top_confidence.as_ref()),
            ];
            for (field, values) in fields {
                if let Some(values) = values
                    && let Some((token, &value)) =
                        values.iter().enumerate().find(|(_, v)| !v.is_finite())
                {
                    return Err(TrajectoryError::NonFinite {
                        trajectory: self.id.clone(),
                        segment: s,
                        field,
                        token,
                        value,
                    });
                }
            }
            let (lo, hi) = match current {
                None => (0, 0),
                Some(t) => (t, t + 1),
            };
            if a.turn != lo && a.turn != hi {
                return Err(TrajectoryError::TurnOrder {
                    trajectory: self.id.clone(),
                    segment: s,
                    got: a.turn,
                    expected_lo: lo,
                    expected_hi: hi,
                });
            }
            current = Some(a.turn);
        }
        let turns = current.map_or(0, |t| t + 1);
        if self.turns.len() != turns {
            return Err(TrajectoryError::RecordCount {
                trajectory: self.id.clone(),
                turns,
                records: self.turns.len(),
            });
        }
        if let Some((position, r)) = self.turns.iter().enumerate().find(|(i, r)| r.index != *i) {
            return Err(TrajectoryError::RecordIndex {
                trajectory: self.id.clone(),
                position,
                index: r.index,
            });
        }
        Ok(())
    }
}

/// Turn spans by the fallback rule of spec §1.2: a turn is a maximal run of consecutive
/// `loss_mask == 1` tokens. Returns `[start, end)` pairs.
pub fn mask_run_turns(loss_mask: &[u8]) -> Vec<(usize, usize)> {
    let mut spans = Vec::new();
    let mut start = None;
    for (i, &m) in loss_mask.iter().enumerate() {
        match (m != 0, start) {
            (true, None) => start = Some(i),
            (false, Some(s)) => {
                spans.push((s, i));
                start = None;
            }
            _ => {}
        }
    }
    if let Some(s) = start {
        spans.push((s, loss_mask.len()));
    }
    spans
}

/// The G rollouts sampled for one prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Group {
    /// The prompt's uid.
    pub prompt_uid: String,
    /// Golden answers of the task, when known (rewards, IG probes).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub golden_answers: Vec<String>,
    /// The rollouts.
    pub trajectories: Vec<Trajectory>,
}

impl Group {
    /// Checks that every trajectory is valid and belongs to this prompt.
    pub fn validate(&self) -> Result<(), TrajectoryError> {
        for t in &self.trajectories {
            if t.prompt_uid != self.prompt_uid {
                return Err(TrajectoryError::ForeignTrajectory {
                    group: self.prompt_uid.clone(),
                    trajectory: t.id.clone(),
                    found: t.prompt_uid.clone(),
                });
            }
            t.validate()?;
        }
        Ok(())
    }

    /// Outcome rewards of the rollouts, in order (`None` where not yet scored).
    pub fn outcomes(&self) -> Vec<Option<f64>> {
        self.trajectories.iter().map(|t| t.outcome_reward).collect()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A three-turn Search-R1-like rollout: search, search, answer.
    pub(crate) fn sample_trajectory() -> Trajectory {
        let mut t = Trajectory::new("p0-r0", "p0", vec![1, 2, 3]);
        t.push(Segment::Agent(AgentSegment::new(
            0,
            vec![10, 11],
            vec![-0.1, -0.2],
        )));
        t.push(Segment::Env(EnvSegment {
            ids: vec![50, 51, 52],
        }));
        t.push(Segment::Agent(AgentSegment::new(1, vec![12], vec![-0.3])));
        t.push(Segment::Env(EnvSegment { ids: vec![53] }));
        let mut last = AgentSegment::new(2, vec![13, 14, 15], vec![-0.4, 0.0, -0.5]);
        last.forced = vec![false, true, false];
        last.entropy = Some(vec![1.0, 0.0, 0.5]);
        t.push(Segment::Agent(last));
        for (i, action) in [
            TurnAction::Search { query: "a".into() },
            TurnAction::Search { query: "b".into() },
            TurnAction::Answer { text: "c".into() },
        ]
        .into_iter()
        .enumerate()
        {
            t.turns.push(TurnRecord {
                index: i,
                action,
                format_ok: true,
                observation: (i < 2).then(|| format!("obs {i}")),
                searches_so_far: (i + 1).min(2),
                env_reward: None,
                anchor: None,
            });
        }
        t.outcome_reward = Some(1.0);
        t
    }

    #[test]
    fn flatten_layout_matches_spec_1_1() {
        let t = sample_trajectory();
        t.validate().unwrap();
        let f = t.flatten(false);
        assert_eq!(f.ids, vec![10, 11, 50, 51, 52, 12, 53, 13, 14, 15]);
        assert_eq!(f.loss_mask, vec![1, 1, 0, 0, 0, 1, 0, 1, 0, 1]);
        assert_eq!(f.turn_id, vec![0, 0, -1, -1, -1, 1, -1, 2, 2, 2]);
        assert_eq!(f.logprobs[5], -0.3);
        assert_eq!(
            t.flatten(true).loss_mask[8],
            1,
            "train_on_forced keeps forced tokens"
        );
        assert_eq!(t.num_turns(), 3);
        assert_eq!(t.turn_spans(), vec![(0, 2), (5, 6), (7, 10)]);
        assert_eq!(t.search_count(), 2);
    }

    #[test]
    fn mask_runs_follow_the_padded_diff_rule() {
        assert_eq!(mask_run_turns(&[1, 1, 1, 0, 0, 1, 1]), vec![(0, 3), (5, 7)]);
        assert_eq!(mask_run_turns(&[0, 0]), Vec::<(usize, usize)>::new());
        assert_eq!(mask_run_turns(&[1]), vec![(0, 1)]);
    }

    #[test]
    fn injected_notice_inside_a_turn_keeps_one_turn() {
        // Spec §1.2: the tool-call-limit notice splits one logical turn into two mask runs;
        // the explicit turn index keeps it one turn.
        let mut t = Trajectory::new("x", "p", vec![]);
        t.push(Segment::Agent(AgentSegment::new(
            0,
            vec![1, 2],
            vec![-1.0, -1.0],
        )));
        t.push(Segment::Env(EnvSegment { ids: vec![9, 9] }));
        t.push(Segment::Agent(AgentSegment::new(0, vec![3], vec![-1.0])));
        t.turns.push(TurnRecord {
            index: 0,
            action: TurnAction::Answer { text: "a".into() },
            format_ok: true,
            observation: None,
            searches_so_far: 6,
            env_reward: None,
            anchor: None,
        });
        t.validate().unwrap();
        assert_eq!(t.num_turns(), 1);
        assert_eq!(t.turn_spans(), vec![(0, 5)]);
        assert_eq!(mask_run_turns(&t.flatten(false).loss_mask).len(), 2);
    }

    #[test]
    fn validate_names_what_is_wrong() {
        let mut t = sample_trajectory();
        if let Segment::Agent(a) = &mut t.segments[2] {
            a.logprobs.push(0.0);
        }
        let e = t.validate().unwrap_err();
        assert!(
            e.to_string().contains("segment 2: logprobs has 2 entries"),
            "{e}"
        );

        let mut t = sample_trajectory();
        if let Segment::Agent(a) = &mut t.segments[2] {
            a.turn = 3;
        }
        assert!(matches!(
            t.validate(),
            Err(TrajectoryError::TurnOrder { got: 3, .. })
        ));

        let mut t = sample_trajectory();
        t.turns.pop();
        assert!(matches!(
            t.validate(),
            Err(TrajectoryError::RecordCount {
                turns: 3,
                records: 2,
                ..
            })
        ));

        let mut t = sample_trajectory();
        if let Segment::Agent(a) = &mut t.segments[0] {
            a.logprobs[1] = f32::NAN;
        }
        let e = t.validate().unwrap_err();
        assert!(e.to_string().contains("logprobs[1] is not finite"), "{e}");

        let mut g = Group {
            prompt_uid: "p1".into(),
            golden_answers: vec![],
            trajectories: vec![sample_trajectory()],
        };
        assert!(matches!(
            g.validate(),
            Err(TrajectoryError::ForeignTrajectory { .. })
        ));
        g.prompt_uid = "p0".into();
        g.validate().unwrap();
        assert_eq!(g.outcomes(), vec![Some(1.0)]);
    }

    #[test]
    fn mean_nll_is_the_at2po_node_entropy() {
        let a = AgentSegment::new(0, vec![1, 2], vec![-0.5, -1.5]);
        assert!((a.mean_nll() - 1.0).abs() < 1e-12);
        assert_eq!(AgentSegment::new(0, vec![], vec![]).mean_nll(), 0.0);
    }
}
