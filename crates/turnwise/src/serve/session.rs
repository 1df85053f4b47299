//! Recorded sessions: what `turnwise serve` keeps of the requests that name a session
//! ([`SessionStore`]).
//!
//! A request names its session with the `X-Session-Id` header (or, on the OpenAI routes, the
//! `user` field). Each of its choices is recorded token-exactly as a [`SessionRecord`]. The
//! records and their reconstruction into trajectories ([`reconstruct`]) are data and a pure
//! function that the harness rollout backend reads too: they live in
//! [`crate::rollout::session`] and are re-exported here.

pub use crate::rollout::session::{
    Retokenization, SessionRecord, ToolCallParse, TracePiece, TraceSegment, reconstruct,
};
use serde::{Deserialize, Serialize};

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
        store.record(vec![SessionRecord {
            session: "a".into(),
            request: 0,
            choice: 0,
            route: "/generate".into(),
            prompt_ids: vec![1, 2],
            output_ids: vec![3],
            logprobs: vec![-0.3],
            weight_version: "3".into(),
            finish: "stop".into(),
            retokenization: None,
            tool_calls: None,
        }]);
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
