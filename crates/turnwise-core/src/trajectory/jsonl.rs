//! JSON-lines persistence: one record per line, so trajectories can be appended while a run
//! goes on, saved and replayed.

use std::io::{BufRead, Write};

use serde::Serialize;
use serde::de::DeserializeOwned;

/// Errors reading or writing JSON lines.
#[derive(Debug, thiserror::Error)]
pub enum JsonlError {
    /// The underlying reader or writer failed.
    #[error("I/O error at line {line}: {cause}")]
    Io {
        /// 1-based line number where it happened (0 when writing).
        line: usize,
        /// The I/O error.
        cause: std::io::Error,
    },
    /// A line is not valid JSON for the expected record type.
    #[error("line {line}, column {column}: {message}")]
    Parse {
        /// 1-based line number.
        line: usize,
        /// 1-based column inside the line.
        column: usize,
        /// What serde reported.
        message: String,
    },
    /// A record could not be serialised.
    #[error("cannot serialise record {index}: {message}")]
    Serialize {
        /// 0-based record index.
        index: usize,
        /// What serde reported.
        message: String,
    },
}

/// Writes each item as one compact JSON line.
pub fn write_jsonl<T: Serialize, W: Write>(mut writer: W, items: &[T]) -> Result<(), JsonlError> {
    for (index, item) in items.iter().enumerate() {
        let line = serde_json::to_string(item).map_err(|e| JsonlError::Serialize {
            index,
            message: e.to_string(),
        })?;
        writer
            .write_all(line.as_bytes())
            .and_then(|()| writer.write_all(b"\n"))
            .map_err(|cause| JsonlError::Io { line: 0, cause })?;
    }
    writer
        .flush()
        .map_err(|cause| JsonlError::Io { line: 0, cause })
}

/// Reads every non-blank line as one record, naming the line and column of the first error.
pub fn read_jsonl<T: DeserializeOwned, R: BufRead>(reader: R) -> Result<Vec<T>, JsonlError> {
    let mut out = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line.map_err(|cause| JsonlError::Io { line: i + 1, cause })?;
        if line.trim().is_empty() {
            continue;
        }
        let item = serde_json::from_str(&line).map_err(|e| JsonlError::Parse {
            line: i + 1,
            column: e.column(),
            message: e.to_string(),
        })?;
        out.push(item);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trajectory::tests::sample_trajectory;
    use crate::trajectory::{
        AgentSegment, EnvSegment, Group, Segment, Trajectory, TurnAction, TurnRecord,
    };
    use proptest::prelude::*;

    #[test]
    fn group_round_trips_through_jsonl() {
        let g = Group {
            prompt_uid: "p0".into(),
            golden_answers: vec!["Paris".into()],
            trajectories: vec![sample_trajectory(), sample_trajectory()],
        };
        let mut buf = Vec::new();
        write_jsonl(&mut buf, std::slice::from_ref(&g)).unwrap();
        assert_eq!(buf.iter().filter(|&&b| b == b'\n').count(), 1);
        let back: Vec<Group> = read_jsonl(buf.as_slice()).unwrap();
        assert_eq!(back, vec![g]);
    }

    #[test]
    fn parse_errors_name_the_line() {
        let text = "{\"ids\": [1]}\n\n{\"ids\": [1,}\n";
        let e = read_jsonl::<EnvSegment, _>(text.as_bytes()).unwrap_err();
        let msg = e.to_string();
        assert!(msg.starts_with("line 3, column"), "{msg}");
    }

    fn arb_trajectory() -> impl Strategy<Value = Trajectory> {
        let seg = (
            prop::collection::vec(0u32..50_000, 1..6),
            prop::collection::vec(0u32..50_000, 0..6),
            prop::bool::ANY,
        );
        prop::collection::vec(seg, 0..5).prop_map(|turns| {
            let mut t = Trajectory::new("id", "p", vec![1, 2]);
            for (i, (agent, env, search)) in turns.into_iter().enumerate() {
                let lp: Vec<f32> = agent.iter().map(|&x| -((x % 97) as f32) / 7.0).collect();
                let mut a = AgentSegment::new(i, agent, lp);
                a.entropy = Some(a.logprobs.iter().map(|l| -l).collect());
                t.push(Segment::Agent(a));
                if !env.is_empty() {
                    t.push(Segment::Env(EnvSegment { ids: env }));
                }
                let action = if search {
                    TurnAction::Search {
                        query: format!("q{i} \"é\"\n"),
                    }
                } else {
                    TurnAction::Answer {
                        text: format!("a{i}"),
                    }
                };
                t.turns.push(TurnRecord {
                    index: i,
                    action,
                    format_ok: search,
                    observation: search.then(|| "doc".to_string()),
                    searches_so_far: i,
                    env_reward: None,
                    anchor: None,
                });
            }
            t
        })
    }

    proptest! {
        #[test]
        fn any_valid_trajectory_round_trips(t in arb_trajectory()) {
            t.validate().unwrap();
            let mut buf = Vec::new();
            write_jsonl(&mut buf, std::slice::from_ref(&t)).unwrap();
            let back: Vec<Trajectory> = read_jsonl(buf.as_slice()).unwrap();
            prop_assert_eq!(&back[0], &t);
            let f = t.flatten(false);
            prop_assert_eq!(f.ids.len(), t.response_len());
            prop_assert_eq!(f.loss_mask.iter().map(|&m| m as usize).sum::<usize>(), t.agent_token_count());
            // Mask runs merge turns that no observation separates: never more runs than turns.
            prop_assert!(crate::trajectory::mask_run_turns(&f.loss_mask).len() <= t.num_turns());
        }
    }
}
