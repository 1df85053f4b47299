//! `turnwise traces check DIR`: an audit of the session records `turnwise serve --record-dir DIR`
//! wrote (`DIR/<session>.jsonl`, one [`SessionRecord`] a line).
//!
//! Each file is one session: its records are reconstructed into segments ([`reconstruct`]) and
//! counted. The append rate is the share of a session's records after its first that continued
//! a segment (their prompt extended the previous prompt and completion token for token); a rate
//! below 1 means some requests re-rendered, summarised or edited their history, or asked for more
//! than one choice, and those start segments that train as samples of their own. The splice
//! counts say how many prompts the server spliced onto the session's ids and how many of those
//! a plain re-tokenisation of the rendered text would have changed (the drift splicing avoided).
//! The tool-call parse rate is given per turn position within a segment (the completion's index
//! among the segment's agent turns), over the records whose request offered tools.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::Serialize;

use super::session::{SessionRecord, TracePiece, reconstruct};

/// One session's figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SessionSummary {
    /// The session id (the file's name without `.jsonl`).
    pub session: String,
    /// Requests (records of choice 0).
    pub requests: usize,
    /// Records (one per choice of each request).
    pub records: usize,
    /// Reconstructed segments.
    pub segments: usize,
    /// Records that continued a segment.
    pub appended: usize,
    /// Records whose prompt the server spliced.
    pub spliced: usize,
    /// Records whose plain re-tokenisation differs from the ids used.
    pub retokenization_differs: usize,
}

/// Tool-call parsing at one turn position within a segment.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ToolCallRate {
    /// The completion's index among its segment's agent turns (0: the segment's first).
    pub position: usize,
    /// Records at this position whose request offered tools.
    pub records: usize,
    /// Tool-call blocks their completions opened.
    pub blocks: usize,
    /// Blocks that parsed into a call.
    pub parsed: usize,
    /// `parsed / blocks` (`None` without blocks).
    pub rate: Option<f64>,
}

/// Totals over every session of a directory.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TraceTotals {
    /// Sessions (files).
    pub sessions: usize,
    /// Requests.
    pub requests: usize,
    /// Records.
    pub records: usize,
    /// Segments.
    pub segments: usize,
    /// Records that continued a segment.
    pub appended: usize,
    /// Records that were not their session's first.
    pub after_first: usize,
    /// `appended / after_first` (`None` when no session has more than one record).
    pub append_rate: Option<f64>,
    /// Records whose prompt was spliced.
    pub spliced: usize,
    /// Records whose plain re-tokenisation differs.
    pub retokenization_differs: usize,
    /// `retokenization_differs / records`.
    pub differs_share: Option<f64>,
}

/// What `turnwise traces check` reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TraceReport {
    /// The directory read.
    pub dir: PathBuf,
    /// Per session, by id.
    pub sessions: Vec<SessionSummary>,
    /// Totals.
    pub totals: TraceTotals,
    /// Tool-call parse rate per turn position (empty: no request offered tools).
    pub tool_calls: Vec<ToolCallRate>,
}

fn ratio(a: usize, b: usize) -> Option<f64> {
    (b > 0).then(|| a as f64 / b as f64)
}

/// Reads one session file; a malformed line is an error naming `file:line`.
pub fn read_session_file(path: &Path) -> Result<Vec<SessionRecord>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let r: SessionRecord = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not a session record", path.display(), i + 1))?;
        out.push(r);
    }
    Ok(out)
}

/// Reads every `*.jsonl` of `dir` (sorted by name), reconstructs each session and counts.
pub fn check_dir(dir: &Path) -> Result<TraceReport> {
    if !dir.is_dir() {
        bail!("{} is not a directory", dir.display());
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "jsonl"))
        .collect();
    files.sort();
    let mut sessions = Vec::new();
    let mut tools: BTreeMap<usize, ToolCallRate> = BTreeMap::new();
    for path in &files {
        let records = read_session_file(path)?;
        let segments = reconstruct(&records);
        for seg in &segments {
            let agents = seg.pieces.iter().filter_map(|p| match p {
                TracePiece::Agent { record, .. } => Some(*record),
                TracePiece::Observation { .. } => None,
            });
            for (position, record) in agents.enumerate() {
                if let Some(t) = &records[record].tool_calls {
                    let e = tools.entry(position).or_insert(ToolCallRate {
                        position,
                        records: 0,
                        blocks: 0,
                        parsed: 0,
                        rate: None,
                    });
                    e.records += 1;
                    e.blocks += t.blocks;
                    e.parsed += t.parsed;
                }
            }
        }
        let session = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        sessions.push(SessionSummary {
            session,
            requests: records.iter().filter(|r| r.choice == 0).count(),
            records: records.len(),
            segments: segments.len(),
            appended: records.len() - segments.len(),
            spliced: records
                .iter()
                .filter(|r| r.retokenization.is_some_and(|t| t.spliced))
                .count(),
            retokenization_differs: records
                .iter()
                .filter(|r| r.retokenization.is_some_and(|t| t.differs))
                .count(),
        });
    }
    let sum = |f: fn(&SessionSummary) -> usize| sessions.iter().map(f).sum::<usize>();
    let records = sum(|s| s.records);
    let appended = sum(|s| s.appended);
    let after_first = sum(|s| s.records.saturating_sub(1));
    let differs = sum(|s| s.retokenization_differs);
    let totals = TraceTotals {
        sessions: sessions.len(),
        requests: sum(|s| s.requests),
        records,
        segments: sum(|s| s.segments),
        appended,
        after_first,
        append_rate: ratio(appended, after_first),
        spliced: sum(|s| s.spliced),
        retokenization_differs: differs,
        differs_share: ratio(differs, records),
    };
    let tool_calls = tools
        .into_values()
        .map(|mut t| {
            t.rate = ratio(t.parsed, t.blocks);
            t
        })
        .collect();
    Ok(TraceReport {
        dir: dir.to_path_buf(),
        sessions,
        totals,
        tool_calls,
    })
}

fn percent(x: Option<f64>) -> String {
    x.map_or_else(|| "-".into(), |x| format!("{:.1} %", 100.0 * x))
}

impl TraceReport {
    /// The human table: one row per session, the totals, the tool-call parse rate.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let width = self
            .sessions
            .iter()
            .map(|s| s.session.len())
            .max()
            .unwrap_or(0)
            .max(7);
        let _ = writeln!(
            out,
            "{:<width$}  {:>8}  {:>7}  {:>8}  {:>11}  {:>7}  {:>7}",
            "session", "requests", "records", "segments", "append rate", "spliced", "differs"
        );
        for s in &self.sessions {
            let _ = writeln!(
                out,
                "{:<width$}  {:>8}  {:>7}  {:>8}  {:>11}  {:>7}  {:>7}",
                s.session,
                s.requests,
                s.records,
                s.segments,
                percent(ratio(s.appended, s.records.saturating_sub(1))),
                s.spliced,
                s.retokenization_differs
            );
        }
        let t = &self.totals;
        let _ = writeln!(
            out,
            "\n{} sessions, {} requests, {} records, {} segments",
            t.sessions, t.requests, t.records, t.segments
        );
        let _ = writeln!(
            out,
            "append rate: {} ({} of {} records after a session's first continued a segment)",
            percent(t.append_rate),
            t.appended,
            t.after_first
        );
        let _ = writeln!(
            out,
            "spliced: {} records; plain re-tokenisation differs: {} records ({} of all)",
            t.spliced,
            t.retokenization_differs,
            percent(t.differs_share)
        );
        if self.tool_calls.is_empty() {
            let _ = writeln!(out, "tool calls: no tool calls offered");
        } else {
            let _ = writeln!(
                out,
                "tool-call parse rate by turn position within a segment:"
            );
            let _ = writeln!(
                out,
                "  {:>8}  {:>7}  {:>6}  {:>6}  {:>7}",
                "position", "records", "blocks", "parsed", "rate"
            );
            for r in &self.tool_calls {
                let _ = writeln!(
                    out,
                    "  {:>8}  {:>7}  {:>6}  {:>6}  {:>7}",
                    r.position,
                    r.records,
                    r.blocks,
                    r.parsed,
                    percent(r.rate)
                );
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::session::{Retokenization, ToolCallParse};
    use super::*;

    fn rec(session: &str, request: usize, prompt: &[u32], out: &[u32]) -> SessionRecord {
        SessionRecord {
            session: session.into(),
            request,
            choice: 0,
            route: "/v1/chat/completions".into(),
            prompt_ids: prompt.to_vec(),
            output_ids: out.to_vec(),
            logprobs: vec![-0.5; out.len()],
            weight_version: "0".into(),
            finish: "stop".into(),
            retokenization: Some(Retokenization {
                spliced: request > 0,
                differs: request == 2,
            }),
            tool_calls: None,
        }
    }

    fn write(dir: &Path, name: &str, records: &[SessionRecord]) {
        let text: String = records
            .iter()
            .map(|r| serde_json::to_string(r).unwrap() + "\n")
            .collect();
        std::fs::write(dir.join(name), text).unwrap();
    }

    #[test]
    fn counts_segments_append_rate_splices_and_tool_call_positions() {
        let tmp = tempfile::tempdir().unwrap();
        let mut a = vec![
            rec("a", 0, &[1, 2], &[3]),
            rec("a", 1, &[1, 2, 3, 4], &[5]),
            rec("a", 2, &[1, 9], &[6]),
        ];
        a[0].tool_calls = Some(ToolCallParse {
            format: "hermes".into(),
            blocks: 2,
            parsed: 1,
        });
        a[1].tool_calls = Some(ToolCallParse {
            format: "hermes".into(),
            blocks: 1,
            parsed: 1,
        });
        a[2].tool_calls = a[1].tool_calls.clone();
        write(tmp.path(), "a.jsonl", &a);
        write(tmp.path(), "b.jsonl", &[rec("b", 0, &[7], &[8])]);
        std::fs::write(tmp.path().join("notes.txt"), "ignored").unwrap();
        let r = check_dir(tmp.path()).unwrap();
        let t = &r.totals;
        assert_eq!(
            (t.sessions, t.requests, t.records, t.segments),
            (2, 4, 4, 3)
        );
        assert_eq!((t.appended, t.after_first), (1, 2));
        assert_eq!(t.append_rate, Some(0.5));
        assert_eq!((t.spliced, t.retokenization_differs), (2, 1));
        assert_eq!(r.tool_calls.len(), 2);
        // Position 0: a's first record and the first of its second segment.
        assert_eq!(
            (
                r.tool_calls[0].records,
                r.tool_calls[0].blocks,
                r.tool_calls[0].parsed
            ),
            (2, 3, 2)
        );
        assert_eq!(r.tool_calls[1].rate, Some(1.0));
        assert!(r.table().contains("append rate: 50.0 %"), "{}", r.table());
    }

    #[test]
    fn a_malformed_line_names_its_file_and_line() {
        let tmp = tempfile::tempdir().unwrap();
        write(tmp.path(), "a.jsonl", &[rec("a", 0, &[1], &[2])]);
        let mut f = std::fs::read_to_string(tmp.path().join("a.jsonl")).unwrap();
        f.push_str("{\"session\": 1}\n");
        std::fs::write(tmp.path().join("a.jsonl"), f).unwrap();
        let e = format!("{:#}", check_dir(tmp.path()).unwrap_err());
        assert!(e.contains("a.jsonl:2"), "{e}");
        let r = check_dir(&tmp.path().join("missing"));
        assert!(r.is_err());
    }

    #[test]
    fn without_tools_the_table_says_so() {
        let tmp = tempfile::tempdir().unwrap();
        write(tmp.path(), "a.jsonl", &[rec("a", 0, &[1], &[2])]);
        let r = check_dir(tmp.path()).unwrap();
        assert_eq!(r.totals.append_rate, None);
        assert!(r.table().contains("no tool calls offered"));
    }
}
