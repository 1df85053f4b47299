//! The records a policy server keeps of a session's requests, and how a session's requests
//! become trajectories again: data the harness rollout backend reads back from `turnwise serve`
//! (which records them, [`crate::serve::session`]) and a pure function over it.
//!
//! A request names its session with the `X-Session-Id` header (or, on the OpenAI routes, the
//! `user` field). Each of its choices is recorded token-exactly as a [`SessionRecord`]: the ids
//! of the rendered prompt, the sampled ids and their log-probs, and the weight version that
//! sampled them. [`reconstruct`] turns a session's records into [`TraceSegment`]s: a request
//! whose prompt extends the previous prompt and completion exactly continues the segment (the
//! tokens in between are the observation, trained with mask 0); any other request (a history
//! that was re-rendered, summarised or edited, a second choice of one request) starts a segment
//! of its own, which trains as its own sample. Nothing is ever stitched across a mismatch.

use serde::{Deserialize, Serialize};

/// How a request's prompt was tokenised (chat and text-completion routes of a session).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Retokenization {
    /// The rendered text extended the session's last prompt and completion, and the prompt's
    /// ids are those ids plus the encoding of the new text only (no drift).
    pub spliced: bool,
    /// Plain encoding of the whole rendered text would have given other ids than the spliced
    /// ones (the drift that splicing avoided).
    pub differs: bool,
}

/// What the tool-call parser found in one completion (chat requests that offered `tools`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCallParse {
    /// The call format looked for (`hermes`).
    pub format: String,
    /// Tool-call blocks the completion opened.
    pub blocks: usize,
    /// Blocks that parsed into a call (a JSON object with a `name`).
    pub parsed: usize,
}

/// One recorded generation: one choice of one request of a session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionRecord {
    /// The session id.
    pub session: String,
    /// The request's position in the session (0-based); a request's choices share it.
    pub request: usize,
    /// The choice's index within its request.
    #[serde(default)]
    pub choice: usize,
    /// The route that answered (`/v1/chat/completions`, `/v1/completions`, `/generate`).
    pub route: String,
    /// The prompt's token ids, as the engine prefilled them.
    pub prompt_ids: Vec<u32>,
    /// The sampled token ids (a stop token included).
    pub output_ids: Vec<u32>,
    /// Each sampled token's log-prob under the distribution it was drawn from.
    pub logprobs: Vec<f32>,
    /// The weight version that sampled it.
    pub weight_version: String,
    /// Why generation ended (`stop`, `length`, `abort`).
    pub finish: String,
    /// How the prompt was tokenised, for rendered (text) prompts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retokenization: Option<Retokenization>,
    /// What the tool-call parser found, when the request offered tools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<ToolCallParse>,
}

/// One piece of a reconstructed trajectory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TracePiece {
    /// Tokens the policy sampled (one request's completion): trained on.
    Agent {
        /// Sampled ids.
        ids: Vec<u32>,
        /// Their log-probs.
        logprobs: Vec<f32>,
        /// The weight version that sampled them.
        weight_version: String,
        /// The record it came from (its position in the session's records).
        record: usize,
    },
    /// Tokens between a completion and the next request's prompt end (a tool's answer, the
    /// chat template's turn markers): never trained on.
    Observation {
        /// Inserted ids.
        ids: Vec<u32>,
    },
}

impl TracePiece {
    /// The piece's token ids.
    pub fn ids(&self) -> &[u32] {
        match self {
            TracePiece::Agent { ids, .. } | TracePiece::Observation { ids } => ids,
        }
    }
}

/// A run of a session's requests each of which extends the one before exactly: one trajectory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceSegment {
    /// The session id.
    pub session: String,
    /// The first request's prompt.
    pub prompt_ids: Vec<u32>,
    /// Completions and the observations between them, in order (starting with a completion).
    pub pieces: Vec<TracePiece>,
}

impl TraceSegment {
    /// The segment's whole context: the prompt and every piece.
    pub fn context(&self) -> Vec<u32> {
        let mut all = self.prompt_ids.clone();
        for p in &self.pieces {
            all.extend_from_slice(p.ids());
        }
        all
    }

    /// Number of completions (agent turns).
    pub fn turns(&self) -> usize {
        self.pieces
            .iter()
            .filter(|p| matches!(p, TracePiece::Agent { .. }))
            .count()
    }
}

/// A session's records as trajectories: a record whose prompt starts with the previous record's
/// prompt and completion, token for token, continues its segment (what lies between is an
/// observation); any other record starts a new segment. Records are taken in the order given
/// (the order the server answered them).
pub fn reconstruct(records: &[SessionRecord]) -> Vec<TraceSegment> {
    let mut out: Vec<TraceSegment> = Vec::new();
    // The context the open segment ends with (prompt and every piece so far).
    let mut context: Vec<u32> = Vec::new();
    for (i, r) in records.iter().enumerate() {
        let extends = !out.is_empty()
            && out.last().is_some_and(|s| s.session == r.session)
            && r.prompt_ids.len() >= context.len()
            && r.prompt_ids[..context.len()] == context[..];
        let agent = TracePiece::Agent {
            ids: r.output_ids.clone(),
            logprobs: r.logprobs.clone(),
            weight_version: r.weight_version.clone(),
            record: i,
        };
        if extends {
            let seg = out.last_mut().expect("checked non-empty");
            let between = &r.prompt_ids[context.len()..];
            if !between.is_empty() {
                seg.pieces.push(TracePiece::Observation {
                    ids: between.to_vec(),
                });
            }
            seg.pieces.push(agent);
        } else {
            out.push(TraceSegment {
                session: r.session.clone(),
                prompt_ids: r.prompt_ids.clone(),
                pieces: vec![agent],
            });
        }
        context.clear();
        context.extend_from_slice(&r.prompt_ids);
        context.extend_from_slice(&r.output_ids);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(request: usize, prompt: &[u32], out: &[u32]) -> SessionRecord {
        SessionRecord {
            session: "s".into(),
            request,
            choice: 0,
            route: "/generate".into(),
            prompt_ids: prompt.to_vec(),
            output_ids: out.to_vec(),
            logprobs: out.iter().map(|&t| -(t as f32) / 10.0).collect(),
            weight_version: "3".into(),
            finish: "stop".into(),
            retokenization: None,
            tool_calls: None,
        }
    }

    #[test]
    fn an_append_only_session_is_one_trajectory_with_observations_between_turns() {
        let records = [
            rec(0, &[1, 2, 3], &[4, 5]),
            rec(1, &[1, 2, 3, 4, 5, 6, 7], &[8]),
            rec(2, &[1, 2, 3, 4, 5, 6, 7, 8], &[9, 10]),
        ];
        let segs = reconstruct(&records);
        assert_eq!(segs.len(), 1);
        let s = &segs[0];
        assert_eq!(s.prompt_ids, vec![1, 2, 3]);
        assert_eq!(s.turns(), 3);
        assert_eq!(s.context(), vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
        let obs: Vec<&[u32]> = s
            .pieces
            .iter()
            .filter(|p| matches!(p, TracePiece::Observation { .. }))
            .map(TracePiece::ids)
            .collect();
        assert_eq!(obs, vec![&[6u32, 7][..]]);
        let TracePiece::Agent { logprobs, .. } = &s.pieces[0] else {
            panic!("first piece is the first completion")
        };
        assert_eq!(logprobs, &vec![-0.4, -0.5]);
    }

    #[test]
    fn a_re_rendered_history_starts_a_new_segment() {
        // The third request edits the second turn's completion (8 → 80): it does not extend.
        let records = [
            rec(0, &[1, 2, 3], &[4, 5]),
            rec(1, &[1, 2, 3, 4, 5, 6], &[8]),
            rec(2, &[1, 2, 3, 4, 5, 6, 80, 7], &[9]),
            rec(3, &[1, 2, 3, 4, 5, 6, 80, 7, 9, 11], &[12]),
        ];
        let segs = reconstruct(&records);
        assert_eq!(segs.len(), 2);
        assert_eq!(segs[0].turns(), 2);
        assert_eq!(segs[1].prompt_ids, vec![1, 2, 3, 4, 5, 6, 80, 7]);
        assert_eq!(segs[1].turns(), 2);
        // Every sampled token is in exactly one segment, under its own log-prob.
        let agent: usize = segs
            .iter()
            .flat_map(|s| &s.pieces)
            .filter_map(|p| match p {
                TracePiece::Agent { ids, .. } => Some(ids.len()),
                _ => None,
            })
            .sum();
        assert_eq!(agent, 5);
    }

    #[test]
    fn a_second_choice_of_one_request_is_its_own_segment() {
        let mut second = rec(0, &[1, 2], &[7]);
        second.choice = 1;
        let records = [rec(0, &[1, 2], &[3]), second, rec(1, &[1, 2, 7, 5], &[6])];
        let segs = reconstruct(&records);
        assert_eq!(segs.len(), 2);
        assert_eq!(segs[0].turns(), 1);
        assert_eq!(segs[1].context(), vec![1, 2, 7, 5, 6]);
    }
}
