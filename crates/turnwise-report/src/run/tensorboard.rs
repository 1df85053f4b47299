//! TensorBoard event files beside `metrics.jsonl`: every metrics line becomes one scalar
//! `Event` in `<run>/tensorboard/events.out.tfevents.<secs>.<hostname>`, which TensorBoard
//! (`tensorboard --logdir <run>/tensorboard`) and `wandb sync --sync-tensorboard` read.
//!
//! The file is a TFRecord stream: per record a little-endian `u64` length, the masked CRC32C
//! of those 8 bytes, the data, and the masked CRC32C of the data. Each record's data is a
//! serialized `tensorboard.Event` protobuf, encoded here by hand: `wall_time` (double, field 1),
//! `step` (int64, field 2), `file_version` (`"brain.Event:2"`, field 3, first event only) and
//! `summary` (field 5) with one `Summary.Value` per metric: `tag` (field 1) and `simple_value`
//! (float, field 2).
//!
//! **Tags** ([`metric_tags`]): a `train` line's metrics keep their names (`actor/pg_loss`,
//! `critic/score/mean`, as in verl); a metric of another phase keeps its name when it starts
//! with the phase (`eval/test/greedy/em`, `sft/loss`, `gain/test/greedy/se`), and is otherwise
//! put under the line's own prefix: the longest folder that all the line's phase-prefixed names
//! share, or the phase when none does. The evaluation seconds of the test split's greedy line
//! (`timing_s/eval` beside `eval/test/greedy/*`) are `eval/test/greedy/timing_s/eval`, and the
//! step-0 `timing` line's `model/parameters` is `timing/model/parameters`, so no two lines
//! write the same tag at the same step. Values that are not finite (null in `metrics.jsonl`) are
//! left out, and values are stored as 32-bit floats (TensorBoard's `simple_value`).
//!
//! **Resuming**: the folder is a view of `metrics.jsonl`. [`TensorBoardWriter::rewrite`] (which
//! a run calls once `metrics.jsonl` is truncated to its checkpoint) writes one new event file
//! holding every line of `metrics.jsonl`, with its step and time, and deletes the earlier event
//! files, so that the steps a resumed run computes again appear once, with the resumed run's
//! values. A TensorBoard that was watching the folder keeps what it had read of the deleted
//! file until it is restarted.

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::metrics::MetricsRecord;
use super::{RunError, RunResult};

/// The `file_version` of the first event of every file (what TensorBoard's readers expect).
pub const FILE_VERSION: &str = "brain.Event:2";

/// The prefix of an event file's name; TensorBoard reads the files whose name contains
/// `tfevents`.
const FILE_PREFIX: &str = "events.out.tfevents.";

/// CRC-32C (Castagnoli, reflected polynomial `0x82F63B78`), the checksum of TFRecord.
pub fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0x82F6_3B78
                } else {
                    c >> 1
                };
                k += 1;
            }
            table[i] = c;
            i += 1;
        }
        table
    };
    let mut crc = !0u32;
    for &b in data {
        crc = TABLE[((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// TFRecord's masked CRC32C: `((crc >> 15) | (crc << 17)) + 0xa282ead8` (wrapping).
pub fn masked_crc32c(data: &[u8]) -> u32 {
    crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One TFRecord: length, its masked CRC, the data, its masked CRC.
pub fn tfrecord(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited field (wire type 2).
fn bytes_field(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    varint(out, (field << 3) | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// What an event carries besides its time and step.
#[derive(Debug, Clone, PartialEq)]
pub enum EventPayload {
    /// The first event of a file: its format version.
    FileVersion(String),
    /// Scalars: `(tag, value)`.
    Scalars(Vec<(String, f32)>),
}

/// One event of an event file.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Unix seconds.
    pub wall_time: f64,
    /// The step.
    pub step: i64,
    /// The file version or the scalars.
    pub payload: EventPayload,
}

impl Event {
    /// The serialized `tensorboard.Event` protobuf (fields at their default value are left out,
    /// as proto3 does).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        if self.wall_time.to_bits() != 0 {
            varint(&mut out, (1 << 3) | 1);
            out.extend_from_slice(&self.wall_time.to_le_bytes());
        }
        if self.step != 0 {
            varint(&mut out, 2 << 3);
            varint(&mut out, self.step as u64);
        }
        match &self.payload {
            EventPayload::FileVersion(v) => bytes_field(&mut out, 3, v.as_bytes()),
            EventPayload::Scalars(values) => {
                let mut summary = Vec::new();
                for (tag, value) in values {
                    let mut v = Vec::new();
                    bytes_field(&mut v, 1, tag.as_bytes());
                    varint(&mut v, (2 << 3) | 5);
                    v.extend_from_slice(&value.to_le_bytes());
                    bytes_field(&mut summary, 1, &v);
                }
                bytes_field(&mut out, 5, &summary);
            }
        }
        out
    }

    /// Parses a serialized `Event`; fields other than the four written here are skipped, and a
    /// summary value that is not a `simple_value` is left out.
    pub fn decode(data: &[u8]) -> Result<Self, String> {
        let mut event = Event {
            wall_time: 0.0,
            step: 0,
            payload: EventPayload::Scalars(Vec::new()),
        };
        let mut p = Proto::new(data);
        while let Some((field, value)) = p.next_field()? {
            match (field, value) {
                (1, Wire::Fixed64(b)) => event.wall_time = f64::from_le_bytes(b),
                (2, Wire::Varint(v)) => event.step = v as i64,
                (3, Wire::Bytes(b)) => {
                    event.payload = EventPayload::FileVersion(
                        String::from_utf8(b.to_vec()).map_err(|e| e.to_string())?,
                    )
                }
                (5, Wire::Bytes(b)) => event.payload = EventPayload::Scalars(decode_summary(b)?),
                _ => {}
            }
        }
        Ok(event)
    }
}

fn decode_summary(data: &[u8]) -> Result<Vec<(String, f32)>, String> {
    let mut out = Vec::new();
    let mut p = Proto::new(data);
    while let Some((field, value)) = p.next_field()? {
        let (1, Wire::Bytes(b)) = (field, value) else {
            continue;
        };
        let (mut tag, mut simple) = (String::new(), None);
        let mut v = Proto::new(b);
        while let Some((field, value)) = v.next_field()? {
            match (field, value) {
                (1, Wire::Bytes(t)) => {
                    tag = String::from_utf8(t.to_vec()).map_err(|e| e.to_string())?
                }
                (2, Wire::Fixed32(f)) => simple = Some(f32::from_le_bytes(f)),
                _ => {}
            }
        }
        if let Some(s) = simple {
            out.push((tag, s));
        }
    }
    Ok(out)
}

/// A protobuf field's value by wire type.
enum Wire<'a> {
    Varint(u64),
    Fixed64([u8; 8]),
    Bytes(&'a [u8]),
    Fixed32([u8; 4]),
}

/// A reader of protobuf fields.
struct Proto<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Proto<'a> {
    fn new(data: &'a [u8]) -> Self {
        Self { data, pos: 0 }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or_else(|| {
                format!(
                    "a field runs past the end of its message at byte {}",
                    self.pos
                )
            })?;
        let b = &self.data[self.pos..end];
        self.pos = end;
        Ok(b)
    }

    fn varint(&mut self) -> Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.take(1)?[0];
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(format!(
            "a varint longer than 10 bytes at byte {}",
            self.pos
        ))
    }

    fn next_field(&mut self) -> Result<Option<(u64, Wire<'a>)>, String> {
        if self.pos == self.data.len() {
            return Ok(None);
        }
        let key = self.varint()?;
        let value = match key & 7 {
            0 => Wire::Varint(self.varint()?),
            1 => Wire::Fixed64(self.take(8)?.try_into().expect("8 bytes")),
            2 => {
                let n = self.varint()? as usize;
                Wire::Bytes(self.take(n)?)
            }
            5 => Wire::Fixed32(self.take(4)?.try_into().expect("4 bytes")),
            t => return Err(format!("unsupported protobuf wire type {t}")),
        };
        Ok(Some((key >> 3, value)))
    }
}

/// Reads every event of an event file, checking both CRCs of every record.
pub fn read_event_file(path: impl AsRef<Path>) -> RunResult<Vec<Event>> {
    let path = path.as_ref();
    let bytes = fs::read(path).map_err(RunError::io("read", path))?;
    let bad = |record: usize, message: String| RunError::BadLine {
        path: path.to_path_buf(),
        line: record,
        message,
    };
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < bytes.len() {
        let record = out.len() + 1;
        let header = bytes
            .get(pos..pos + 12)
            .ok_or_else(|| bad(record, "a record header is cut short".into()))?;
        let (len, crc) = header.split_at(8);
        if masked_crc32c(len) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            return Err(bad(record, "the length's CRC does not match".into()));
        }
        let n = u64::from_le_bytes(len.try_into().expect("8 bytes")) as usize;
        let data = bytes
            .get(pos + 12..pos + 12 + n)
            .ok_or_else(|| bad(record, "a record's data is cut short".into()))?;
        let crc = bytes
            .get(pos + 12 + n..pos + 16 + n)
            .ok_or_else(|| bad(record, "a record's CRC is cut short".into()))?;
        if masked_crc32c(data) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            return Err(bad(record, "the data's CRC does not match".into()));
        }
        out.push(Event::decode(data).map_err(|m| bad(record, m))?);
        pos += 16 + n;
    }
    Ok(out)
}

/// The event files of `dir` (names holding `tfevents`, as TensorBoard picks them), sorted by
/// name; none when `dir` does not exist.
pub fn event_files(dir: impl AsRef<Path>) -> RunResult<Vec<PathBuf>> {
    let dir = dir.as_ref();
    if !dir.is_dir() {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).map_err(RunError::io("list", dir))? {
        let entry = entry.map_err(RunError::io("list", dir))?;
        if entry.file_name().to_string_lossy().contains("tfevents") {
            out.push(entry.path());
        }
    }
    out.sort();
    Ok(out)
}

/// The TensorBoard tags of one metrics line's finite values (see the [module
/// documentation](self) for the scheme), in name order.
pub fn metric_tags(phase: &str, values: &BTreeMap<String, f64>) -> Vec<(String, f64)> {
    let finite = values.iter().filter(|(_, v)| v.is_finite());
    if phase == "train" {
        return finite.map(|(k, v)| (k.clone(), *v)).collect();
    }
    let own = format!("{phase}/");
    // The folder all the line's phase-prefixed names share (by whole path components).
    let mut prefix: Option<Vec<&str>> = None;
    for name in values.keys().filter(|k| k.starts_with(&own)) {
        let parent: Vec<&str> = name.split('/').collect();
        let parent = &parent[..parent.len() - 1];
        prefix = Some(match prefix {
            None => parent.to_vec(),
            Some(p) => p
                .iter()
                .zip(parent)
                .take_while(|(a, b)| a == b)
                .map(|(a, _)| *a)
                .collect(),
        });
    }
    let prefix = prefix
        .filter(|p| !p.is_empty())
        .map_or_else(|| phase.to_string(), |p| p.join("/"));
    finite
        .map(|(k, v)| {
            let tag = if k.starts_with(&own) {
                k.clone()
            } else {
                format!("{prefix}/{k}")
            };
            (tag, *v)
        })
        .collect()
}

/// This machine's name for event file names (`/proc/sys/kernel/hostname`, `/etc/hostname`,
/// `$HOSTNAME`, else `localhost`), with characters other than letters, digits, `.`, `_` and
/// `-` replaced by `_`.
fn hostname() -> String {
    let name = ["/proc/sys/kernel/hostname", "/etc/hostname"]
        .iter()
        .filter_map(|p| fs::read_to_string(p).ok())
        .chain(std::env::var("HOSTNAME").ok())
        .map(|s| s.trim().to_string())
        .find(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into());
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Appends scalar events to one event file, flushing each to the operating system before
/// [`TensorBoardWriter::write`] returns, so that a killed run loses nothing it logged.
#[derive(Debug)]
pub struct TensorBoardWriter {
    path: PathBuf,
    file: BufWriter<fs::File>,
}

impl TensorBoardWriter {
    /// Makes `dir` hold one new event file with every line of `records` (a run's
    /// `metrics.jsonl`, read after any truncation for a resume), each at its step and time,
    /// and deletes the event files that were there before; returns the writer appending to the
    /// new file. The file is written under a temporary name and renamed into place before the
    /// old ones are deleted, so a kill leaves either the old files or the new one.
    pub fn rewrite(dir: impl AsRef<Path>, records: &[MetricsRecord]) -> RunResult<Self> {
        let dir = dir.as_ref();
        fs::create_dir_all(dir).map_err(RunError::io("create the directory", dir))?;
        let now = unix_now();
        let path = dir.join(format!("{FILE_PREFIX}{:010}.{}", now as u64, hostname()));
        // A file of the same second (a rewrite right after another) is replaced in place.
        let old = event_files(dir)?;
        let tmp = dir.join("rewrite.tmp");
        let file = fs::File::create(&tmp).map_err(RunError::io("create", &tmp))?;
        let mut w = Self {
            path: tmp.clone(),
            file: BufWriter::new(file),
        };
        w.append(&Event {
            wall_time: now,
            step: 0,
            payload: EventPayload::FileVersion(FILE_VERSION.into()),
        })?;
        for r in records {
            let values: BTreeMap<String, f64> = r
                .values
                .iter()
                .filter_map(|(k, v)| v.map(|v| (k.clone(), v)))
                .collect();
            w.append_scalars(r.step, &r.phase, r.time.unwrap_or(now), &values)?;
        }
        w.file
            .flush()
            .and_then(|_| w.file.get_ref().sync_all())
            .map_err(RunError::io("write", &tmp))?;
        crate::ownership::may_write(&path)?;
        fs::rename(&tmp, &path).map_err(RunError::io("rename into place", &tmp))?;
        crate::ownership::wrote_growing(&path)?;
        for p in old.into_iter().filter(|p| *p != path) {
            crate::ownership::may_remove(&p)?;
            fs::remove_file(&p).map_err(RunError::io("remove", &p))?;
            crate::ownership::removed(&p)?;
        }
        if !records.is_empty() {
            tracing::debug!(file = %path.display(), lines = records.len(), "TensorBoard events rewritten from the metrics");
        }
        w.path = path;
        Ok(w)
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn append(&mut self, event: &Event) -> RunResult<()> {
        self.file
            .write_all(&tfrecord(&event.encode()))
            .map_err(RunError::io("append to", &self.path))
    }

    fn append_scalars(
        &mut self,
        step: u64,
        phase: &str,
        time: f64,
        values: &BTreeMap<String, f64>,
    ) -> RunResult<()> {
        let scalars: Vec<(String, f32)> = metric_tags(phase, values)
            .into_iter()
            .map(|(t, v)| (t, v as f32))
            .collect();
        if scalars.is_empty() {
            return Ok(());
        }
        self.append(&Event {
            wall_time: time,
            step: i64::try_from(step).unwrap_or(i64::MAX),
            payload: EventPayload::Scalars(scalars),
        })
    }

    /// Appends one metrics line (its finite values, tagged by [`metric_tags`]) as one event and
    /// flushes it; a line with no finite value writes nothing.
    pub fn write(
        &mut self,
        step: u64,
        phase: &str,
        time: f64,
        values: &BTreeMap<String, f64>,
    ) -> RunResult<()> {
        self.append_scalars(step, phase, time, values)?;
        self.file
            .flush()
            .map_err(RunError::io("append to", &self.path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(pairs: &[(&str, f64)]) -> BTreeMap<String, f64> {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn crc32c_and_its_mask_match_known_values() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
        // RFC 3720 (iSCSI) B.4.
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62A8_AB43);
        let up: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c(&up), 0x46DD_794E);
        let down: Vec<u8> = (0..32).rev().collect();
        assert_eq!(crc32c(&down), 0x113F_DB5C);
        // The mask, spelled as TFRecord's documentation does.
        let crc = 0xE306_9283u32;
        #[allow(clippy::manual_rotate)] // the formula as documented, not as implemented
        let masked = ((crc >> 15) | (crc << 17)).wrapping_add(0xa282_ead8);
        assert_eq!(masked, 0xC78A_B0E5);
        assert_eq!(masked_crc32c(b"123456789"), masked);
        assert_eq!(masked_crc32c(b""), 0xa282_ead8);
    }

    #[test]
    fn framing_and_events_match_tensorboards_own_bytes() {
        // The bytes below were written by tensorboard 2.21's Python code:
        // struct.pack("<Q", 5) + masked_crc32c(...) + b"hello" + masked_crc32c(b"hello")
        // (tensorboard.compat.tensorflow_stub.pywrap_tensorflow), and
        // event_pb2.Event(...).SerializeToString().
        assert_eq!(
            tfrecord(b"hello"),
            [
                5, 0, 0, 0, 0, 0, 0, 0, 234, 178, 4, 62, 104, 101, 108, 108, 111, 187, 31, 28, 25
            ]
        );
        let scalars = Event {
            wall_time: 1.5,
            step: 7,
            payload: EventPayload::Scalars(vec![("a/b".into(), 0.25), ("c".into(), -2.0)]),
        };
        let bytes = [
            9, 0, 0, 0, 0, 0, 0, 248, 63, 16, 7, 42, 22, 10, 10, 10, 3, 97, 47, 98, 21, 0, 0, 128,
            62, 10, 8, 10, 1, 99, 21, 0, 0, 0, 192,
        ];
        assert_eq!(scalars.encode(), bytes);
        assert_eq!(Event::decode(&bytes).unwrap(), scalars);
        let version = Event {
            wall_time: 1_700_000_000.25,
            step: 0,
            payload: EventPayload::FileVersion(FILE_VERSION.into()),
        };
        let bytes = [
            9, 0, 0, 16, 64, 252, 84, 217, 65, 26, 13, 98, 114, 97, 105, 110, 46, 69, 118, 101,
            110, 116, 58, 50,
        ];
        assert_eq!(version.encode(), bytes);
        assert_eq!(Event::decode(&bytes).unwrap(), version);
        // A multi-byte varint step.
        let e = Event {
            wall_time: 0.0,
            step: 300,
            payload: EventPayload::Scalars(Vec::new()),
        };
        assert_eq!(&e.encode()[..3], [16, 172, 2]);
        assert!(Event::decode(&[9, 0, 0]).is_err());
    }

    #[test]
    fn tags_keep_phases_and_lines_apart() {
        let train = m(&[
            ("actor/pg_loss", 0.5),
            ("timing_s/step", 2.0),
            ("x", f64::NAN),
        ]);
        assert_eq!(
            metric_tags("train", &train),
            vec![
                ("actor/pg_loss".to_string(), 0.5),
                ("timing_s/step".to_string(), 2.0)
            ]
        );
        let eval = m(&[
            ("eval/test/greedy/em", 0.5),
            ("eval/test/greedy/em/hop2", 0.25),
            ("timing_s/eval", 3.0),
        ]);
        let tags: Vec<String> = metric_tags("eval", &eval)
            .into_iter()
            .map(|(t, _)| t)
            .collect();
        assert_eq!(
            tags,
            [
                "eval/test/greedy/em",
                "eval/test/greedy/em/hop2",
                "eval/test/greedy/timing_s/eval"
            ]
        );
        let timing = m(&[("model/parameters", 10.0), ("timing_s/setup", 1.0)]);
        let tags: Vec<String> = metric_tags("timing", &timing)
            .into_iter()
            .map(|(t, _)| t)
            .collect();
        assert_eq!(tags, ["timing/model/parameters", "timing/timing_s/setup"]);
        // Two lines of one phase with different folders.
        let mixed = m(&[("eval/a/x", 1.0), ("eval/b/y", 2.0), ("t", 3.0)]);
        assert_eq!(metric_tags("eval", &mixed)[2].0, "eval/t");
    }

    #[test]
    fn a_rewrite_replaces_the_old_files_with_the_metrics_lines() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("tensorboard");
        let mut w = TensorBoardWriter::rewrite(&dir, &[]).unwrap();
        w.write(1, "train", 100.0, &m(&[("r", 1.0)])).unwrap();
        w.write(1, "eval", 100.5, &m(&[("n", f64::NAN)])).unwrap();
        let first = w.path().to_path_buf();
        let name = first.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        // Flushed: read while the writer is open.
        let events = read_event_file(&first).unwrap();
        assert_eq!(events.len(), 2, "the NaN-only line writes nothing");
        assert_eq!(
            events[0].payload,
            EventPayload::FileVersion(FILE_VERSION.into())
        );
        assert_eq!(
            (events[1].step, events[1].wall_time),
            (1, 100.0),
            "{events:?}"
        );
        drop(w);
        // A stray event file from elsewhere goes too.
        fs::write(dir.join("events.out.tfevents.1.other"), b"").unwrap();
        let records = vec![MetricsRecord {
            step: 1,
            phase: "train".into(),
            time: Some(200.0),
            values: [("r".to_string(), Some(2.0)), ("z".to_string(), None)].into(),
        }];
        let w = TensorBoardWriter::rewrite(&dir, &records).unwrap();
        assert_eq!(event_files(&dir).unwrap(), vec![w.path().to_path_buf()]);
        assert!(!dir.join("rewrite.tmp").exists());
        let events = read_event_file(w.path()).unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(
            events[1],
            Event {
                wall_time: 200.0,
                step: 1,
                payload: EventPayload::Scalars(vec![("r".into(), 2.0)])
            }
        );
        // A flipped byte is caught by the CRC.
        let mut bytes = fs::read(w.path()).unwrap();
        let last = bytes.len() - 6;
        bytes[last] ^= 1;
        fs::write(w.path(), &bytes).unwrap();
        let err = read_event_file(w.path()).unwrap_err();
        assert!(err.to_string().contains("CRC"), "{err}");
    }

    /// Reads `dir` with TensorBoard's own `EventAccumulator`: `{tag: [[step, value, wall_time]]}`.
    fn tensorboard_scalars(dir: &Path) -> BTreeMap<String, Vec<(i64, f32, f64)>> {
        let python = std::env::var("TURNWISE_PYTHON").unwrap_or_else(|_| "python3".into());
        let script = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
acc.Reload()
print(json.dumps({t: [[e.step, e.value, e.wall_time] for e in acc.Scalars(t)]
                  for t in acc.Tags()["scalars"]}))
"#;
        let out = std::process::Command::new(&python)
            .args(["-c", script])
            .arg(dir)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {python}: {e}"));
        assert!(
            out.status.success(),
            "{python} could not read the event files with the tensorboard package (install it: \
             `{python} -m pip install tensorboard`, as .ci/run does): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    #[test]
    fn tensorboards_reader_reads_back_what_the_metrics_writer_logged_across_a_resume() {
        use super::super::metrics::MetricsWriter;
        let tmp = tempfile::tempdir().unwrap();
        let metrics = tmp.path().join("metrics.jsonl");
        let tb = tmp.path().join("tensorboard");
        let mut w = MetricsWriter::open(&metrics).unwrap();
        w.attach_tensorboard(&tb).unwrap();
        let t0 = 1_700_000_000.0;
        for s in [50, 100] {
            w.write_at(s, "sft", t0, [("sft/loss", 1.0 / s as f64)])
                .unwrap();
        }
        for s in 1..=4u64 {
            let t = t0 + s as f64;
            w.write_at(
                s,
                "train",
                t,
                [
                    ("actor/pg_loss", s as f64 * 0.1),
                    ("critic/score/mean", -(s as f64)),
                    ("actor/entropy", f64::NAN),
                ],
            )
            .unwrap();
            w.write_at(
                s,
                "eval",
                t + 0.5,
                [
                    ("eval/test/greedy/em", s as f64 / 8.0),
                    ("timing_s/eval", 2.5),
                ],
            )
            .unwrap();
            w.write_at(
                s,
                "eval",
                t + 0.75,
                [
                    ("eval/test/sampled/em", s as f64 / 16.0),
                    ("timing_s/eval", 3.5),
                ],
            )
            .unwrap();
        }
        drop(w);
        // Killed after step 4, resumed from the checkpoint of step 2: steps 3 and 4 run again
        // with other values.
        let mut w = MetricsWriter::open(&metrics).unwrap();
        w.truncate_phases_after(2, &["train", "eval"]).unwrap();
        w.attach_tensorboard(&tb).unwrap();
        for s in 3..=4u64 {
            w.write_at(
                s,
                "train",
                t0 + 10.0 + s as f64,
                [("actor/pg_loss", s as f64), ("critic/score/mean", 0.5)],
            )
            .unwrap();
        }
        drop(w);
        assert_eq!(event_files(&tb).unwrap().len(), 1);

        let got = tensorboard_scalars(&tb);
        // What metrics.jsonl holds, tag by tag, as TensorBoard should show it.
        let log = super::super::read_metrics(&metrics).unwrap();
        let mut want: BTreeMap<String, Vec<(i64, f32, f64)>> = BTreeMap::new();
        for r in &log.records {
            let values = r
                .values
                .iter()
                .filter_map(|(k, v)| v.map(|v| (k.clone(), v)))
                .collect();
            for (tag, v) in metric_tags(&r.phase, &values) {
                want.entry(tag)
                    .or_default()
                    .push((r.step as i64, v as f32, r.time.unwrap()));
            }
        }
        assert_eq!(got, want);
        // Spelled out for a few tags.
        assert_eq!(
            got["actor/pg_loss"]
                .iter()
                .map(|p| (p.0, p.1))
                .collect::<Vec<_>>(),
            [(1, 0.1), (2, 0.2), (3, 3.0), (4, 4.0)]
        );
        assert_eq!(
            got["sft/loss"].iter().map(|p| p.0).collect::<Vec<_>>(),
            [50, 100]
        );
        assert_eq!(got["eval/test/greedy/timing_s/eval"].len(), 2);
        assert_eq!(got["eval/test/sampled/timing_s/eval"][0].1, 3.5);
        assert!(
            !got.contains_key("actor/entropy"),
            "a NaN-only series is left out"
        );
        assert_eq!(got["critic/score/mean"][3].2, t0 + 14.0);
    }
}
