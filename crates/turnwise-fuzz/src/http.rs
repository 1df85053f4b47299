//! A minimal HTTP/1.1 client over a fresh TCP connection (`Connection: close`): the servers are
//! fuzzed through their real network stack, with the body bytes exactly as fuzzed.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// A response: status code and body.
#[derive(Debug)]
pub struct Reply {
    /// The status code.
    pub status: u16,
    /// The body (de-chunked).
    pub body: Vec<u8>,
}

impl Reply {
    /// The body as JSON; panics (a finding) when it is not.
    pub fn json(&self, what: &str) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "{what}: status {} with a body that is not JSON ({e}): {:?}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }
}

/// `POST path` with `body` as `application/json`.
pub fn post(addr: SocketAddr, path: &str, body: &[u8]) -> Reply {
    let mut stream = TcpStream::connect(addr).expect("connect to the server");
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .expect("a read timeout");
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).expect("send the head");
    // The server may answer (413) and close before reading the whole body.
    let _ = stream.write_all(body);
    let mut raw = Vec::new();
    if let Err(e) = stream.read_to_end(&mut raw) {
        assert!(!raw.is_empty(), "POST {path}: no answer: {e}");
    }
    parse_reply(&raw).unwrap_or_else(|| {
        panic!(
            "POST {path}: not an HTTP answer: {:?}",
            String::from_utf8_lossy(&raw)
        )
    })
}

/// Status and body of a raw HTTP/1.1 answer.
fn parse_reply(raw: &[u8]) -> Option<Reply> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..end]).ok()?;
    let mut lines = head.split("\r\n");
    let status: u16 = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let chunked = lines.any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let rest = &raw[end + 4..];
    let body = if chunked {
        dechunk(rest)?
    } else {
        rest.to_vec()
    };
    Some(Reply { status, body })
}

fn dechunk(mut rest: &[u8]) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let eol = rest.windows(2).position(|w| w == b"\r\n")?;
        let size = std::str::from_utf8(&rest[..eol]).ok()?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        rest = &rest[eol + 2..];
        if size == 0 {
            return Some(body);
        }
        body.extend_from_slice(rest.get(..size)?);
        rest = rest.get(size + 2..)?;
    }
}

/// `POST path` with `body` ([`post`]), checked as every fuzzed server must answer: never a 500
/// (nor a code beyond 599), always a JSON body, and an error answer with its message
/// ([`error_message`]). The JSON of a 200; `None` for a checked error answer.
pub fn post_checked(addr: SocketAddr, path: &str, body: &[u8]) -> Option<serde_json::Value> {
    let reply = post(addr, path, body);
    let what = format!("POST {path}");
    assert!(
        reply.status != 500 && reply.status < 600,
        "{what}: status {}: {}",
        reply.status,
        String::from_utf8_lossy(&reply.body)
    );
    let v = reply.json(&what);
    if reply.status != 200 {
        error_message(&v, &what);
        return None;
    }
    Some(v)
}

/// An error answer in OpenAI's shape (`{"error": {"message": …}}`) or FastAPI's
/// (`{"detail": …}`): its message, or a panic (a finding).
pub fn error_message(v: &serde_json::Value, what: &str) -> String {
    let m = v
        .pointer("/error/message")
        .or_else(|| v.get("detail"))
        .and_then(|m| match m {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Null => None,
            other => Some(other.to_string()),
        });
    match m {
        Some(m) if !m.is_empty() => m,
        _ => panic!("{what}: an error answer without a message: {v}"),
    }
}
