//! Recorded sessions: what `turnwise serve` keeps of the requests that name a session, and how
//! a session's requests become trajectories again.
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

/// Longest session id.
pub const MAX_SESSION_ID_LEN: usize = 128;

/// Default [`SessionStore`] capacity (`turnwise serve --max-sessions`).
pub const DEFAULT_MAX_SESSIONS: usize = 4096;

/// Checks a session id: 1 to [`MAX_SESSION_ID_LEN`] characters of `[A-Za-z0-9._:-]` (it names a
/// file under `--record-dir`, so nothing else is allowed).
pub fn check_session_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > MAX_SESSION_ID_LEN {
        return Err(format!(
            "a session id is 1 to {MAX_SESSION_ID_LEN} characters, got {}",
            id.len()
        ));
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-')))
    {
        return Err(format!(
            "{c:?} is not allowed in a session id (letters, digits, '.', '_', ':', '-')"
        ));
    }
    if id == "." || id == ".." {
        return Err(format!("{id:?} is not a session id"));
    }
    Ok(())
}

/// One open session of a [`SessionStore`].
#[derive(Debug, Clone)]
struct Session {
    /// Its records, in the order they were answered.
    records: Vec<SessionRecord>,
    /// The index the next request gets.
    next_request: usize,
    /// The seed registered with `POST /v1/sessions`.
    seed: Option<u64>,
    /// The reward the agent program reported (`POST /v1/sessions/{id}/reward`).
    reward: Option<f64>,
    /// When it was last used.
    last_used: std::time::Instant,
    /// Logical time of its last use (orders eviction).
    tick: u64,
}

/// What a request of a session starts from ([`SessionStore::begin`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionTurn {
    /// The request's index in the session.
    pub request: usize,
    /// The seed of its choice 0 when the session was registered with one:
    /// `turn_seed(seed, request)`.
    pub seed: Option<u64>,
}

/// Counters of a [`SessionStore`] (`/get_server_info`'s `sessions`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionCounters {
    /// Sessions held in memory.
    pub open: usize,
    /// Requests recorded (each with one record per choice).
    pub recorded_requests: u64,
    /// Records recorded.
    pub records: u64,
    /// Records whose prompt was spliced onto the session's last prompt and completion.
    pub spliced: u64,
    /// Records whose plain re-tokenisation differs from the ids used.
    pub retokenization_differs: u64,
    /// Sessions dropped to stay within `--max-sessions` (least recently used first).
    pub evicted: u64,
    /// Records that could not be appended under `--record-dir`.
    pub write_failures: u64,
}

/// The server's recorded sessions, in memory: per session its records in order, the next
/// request index, an optional registered seed and when it was last used. At most `max_sessions`
/// are kept; a new one beyond evicts the least recently used. With a record directory, every
/// record is also appended as a JSON line to `DIR/<session>.jsonl` (flushed per line); a write
/// failure is logged once and counted, never fails the request.
#[derive(Debug)]
pub struct SessionStore {
    sessions: std::collections::HashMap<String, Session>,
    max_sessions: usize,
    record_dir: Option<std::path::PathBuf>,
    tick: u64,
    counters: SessionCounters,
    warned: bool,
}

/// Why a session could not be registered ([`SessionStore::register`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegisterError {
    /// The session already has records.
    HasRecords(usize),
}

impl SessionStore {
    /// An empty store keeping at most `max_sessions` sessions (at least 1), appending records
    /// under `record_dir` when given (created on the first record).
    pub fn new(max_sessions: usize, record_dir: Option<std::path::PathBuf>) -> Self {
        Self {
            sessions: std::collections::HashMap::new(),
            max_sessions: max_sessions.max(1),
            record_dir,
            tick: 0,
            counters: SessionCounters::default(),
            warned: false,
        }
    }

    /// The session `id`, created (evicting the least recently used beyond capacity) when new,
    /// marked as used now.
    fn touch(&mut self, id: &str) -> &mut Session {
        self.tick += 1;
        let tick = self.tick;
        if !self.sessions.contains_key(id) {
            while self.sessions.len() >= self.max_sessions {
                let Some(oldest) = self
                    .sessions
                    .iter()
                    .min_by_key(|(_, s)| s.tick)
                    .map(|(k, _)| k.clone())
                else {
                    break;
                };
                self.sessions.remove(&oldest);
                self.counters.evicted += 1;
            }
            self.sessions.insert(
                id.to_string(),
                Session {
                    records: Vec::new(),
                    next_request: 0,
                    seed: None,
                    reward: None,
                    last_used: std::time::Instant::now(),
                    tick,
                },
            );
        }
        let s = self.sessions.get_mut(id).expect("inserted above");
        s.tick = tick;
        s.last_used = std::time::Instant::now();
        s
    }

    /// Registers `id` with `seed` (`POST /v1/sessions`): a session that already has records
    /// is refused; an empty one takes the new seed.
    pub fn register(&mut self, id: &str, seed: Option<u64>) -> Result<(), RegisterError> {
        if let Some(s) = self.sessions.get(id)
            && !s.records.is_empty()
        {
            return Err(RegisterError::HasRecords(s.records.len()));
        }
        self.touch(id).seed = seed;
        Ok(())
    }

    /// The ids the next request of `id` extends when its rendered text does: the last
    /// request's choice 0, prompt and completion. `None` for a new or empty session.
    pub fn last_context(&self, id: &str) -> Option<Vec<u32>> {
        let s = self.sessions.get(id)?;
        let last = s.records.iter().rev().find(|r| r.choice == 0)?;
        let mut ids = last.prompt_ids.clone();
        ids.extend_from_slice(&last.output_ids);
        Some(ids)
    }

    /// Starts a request of `id`: its index (the session's next) and, when the session was
    /// registered with a seed, `turn_seed(seed, index)`.
    pub fn begin(&mut self, id: &str) -> SessionTurn {
        let s = self.touch(id);
        let request = s.next_request;
        s.next_request += 1;
        SessionTurn {
            request,
            seed: s.seed.map(|seed| crate::rollout::turn_seed(seed, request)),
        }
    }

    /// Gives back the index of a request that failed before anything was recorded, when no
    /// later request took one (so that a retried request draws with the same seed).
    pub fn abandon(&mut self, id: &str, request: usize) {
        if let Some(s) = self.sessions.get_mut(id)
            && s.next_request == request + 1
        {
            s.next_request = request;
        }
    }

    /// Records a request's choices (in choice order), appending them under the record
    /// directory when there is one.
    pub fn record(&mut self, records: Vec<SessionRecord>) {
        let Some(first) = records.first() else {
            return;
        };
        let id = first.session.clone();
        self.counters.recorded_requests += 1;
        for r in &records {
            self.counters.records += 1;
            if let Some(t) = r.retokenization {
                self.counters.spliced += u64::from(t.spliced);
                self.counters.retokenization_differs += u64::from(t.differs);
            }
        }
        if let Some(dir) = self.record_dir.clone()
            && let Err(e) = append_records(&dir, &id, &records)
        {
            self.counters.write_failures += 1;
            if !self.warned {
                self.warned = true;
                tracing::warn!(
                    error = %format!("{e:#}"),
                    dir = %dir.display(),
                    "cannot append session records under --record-dir (further failures are \
                     only counted: /get_server_info sessions.write_failures)"
                );
            }
        }
        self.touch(&id).records.extend(records);
    }

    /// The records of `id`, if it is open.
    pub fn records(&self, id: &str) -> Option<&[SessionRecord]> {
        self.sessions.get(id).map(|s| s.records.as_slice())
    }

    /// Sets the reward of `id` (the session is created when new): what an agent program
    /// reports of its episode, read back with its records.
    pub fn set_reward(&mut self, id: &str, reward: f64) {
        self.touch(id).reward = Some(reward);
    }

    /// The reward reported for `id`, if any.
    pub fn reward(&self, id: &str) -> Option<f64> {
        self.sessions.get(id).and_then(|s| s.reward)
    }

    /// Forgets `id`, returning its records.
    pub fn remove(&mut self, id: &str) -> Option<Vec<SessionRecord>> {
        self.sessions.remove(id).map(|s| s.records)
    }

    /// The counters, `open` included.
    pub fn counters(&self) -> SessionCounters {
        SessionCounters {
            open: self.sessions.len(),
            ..self.counters
        }
    }
}

/// Appends `records` to `dir/<id>.jsonl`, one JSON line each, flushed.
fn append_records(
    dir: &std::path::Path,
    id: &str,
    records: &[SessionRecord],
) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::io::Write;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(format!("{id}.jsonl"));
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    for r in records {
        let mut line = serde_json::to_string(r)?;
        line.push('\n');
        f.write_all(line.as_bytes())
            .and_then(|()| f.flush())
            .with_context(|| format!("appending to {}", path.display()))?;
    }
    Ok(())
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

    #[test]
    fn session_ids_are_checked() {
        assert!(check_session_id("ep-12.turn:3_a").is_ok());
        assert!(check_session_id("").is_err());
        assert!(check_session_id("a/b").is_err());
        assert!(check_session_id("..").is_err());
        assert!(check_session_id(&"x".repeat(129)).is_err());
        assert!(check_session_id(&"x".repeat(128)).is_ok());
    }

    #[test]
    fn the_store_numbers_requests_seeds_them_and_evicts_the_least_recently_used() {
        let mut store = SessionStore::new(2, None);
        store.register("a", Some(7)).unwrap();
        let t0 = store.begin("a");
        assert_eq!(t0.request, 0);
        assert_eq!(t0.seed, Some(crate::rollout::turn_seed(7, 0)));
        store.abandon("a", 0);
        assert_eq!(store.begin("a").request, 0);
        let mut r = rec(0, &[1, 2], &[3]);
        r.session = "a".into();
        store.record(vec![r]);
        assert_eq!(store.last_context("a"), Some(vec![1, 2, 3]));
        assert_eq!(
            store.register("a", Some(1)),
            Err(RegisterError::HasRecords(1))
        );
        assert_eq!(store.begin("a").seed, Some(crate::rollout::turn_seed(7, 1)));
        store.begin("b");
        store.begin("a");
        store.begin("c"); // evicts b, the least recently used
        assert!(store.records("b").is_none());
        assert!(store.records("a").is_some());
        let c = store.counters();
        assert_eq!((c.open, c.evicted, c.recorded_requests), (2, 1, 1));
        assert_eq!(store.remove("a").map(|r| r.len()), Some(1));
        assert_eq!(store.counters().open, 1);
    }
}
