//! What the registrar asks an engine: `GET /health`, `/v1/models`, `/metrics`, each one
//! request on its own connection (`Connection: close`), bounded in time and size.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest body read (vLLM's `/metrics` is some tens of KiB).
const MAX_BODY: usize = 4 << 20;

/// Why a probe failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    /// Connecting or reading failed.
    #[error("{0}")]
    Io(String),
    /// No complete answer within the timeout.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// An answer that is not HTTP, or too large.
    #[error("malformed answer: {0}")]
    Malformed(String),
    /// A status other than 200.
    #[error("HTTP {0}")]
    Status(u16),
    /// A 200 whose body lacks what was asked for.
    #[error("{0}")]
    Missing(String),
}

/// `GET path` at `addr`: the status and the body.
pub async fn http_get(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<(u16, Vec<u8>), ProbeError> {
    tokio::time::timeout(timeout, get(addr, path))
        .await
        .map_err(|_| ProbeError::Timeout(timeout))?
}

/// `POST path` at `addr` with a JSON `body`: the status and the answer's body.
pub async fn http_post_json(
    addr: SocketAddr,
    path: &str,
    body: &serde_json::Value,
    timeout: Duration,
) -> Result<(u16, Vec<u8>), ProbeError> {
    let body = body.to_string();
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    tokio::time::timeout(timeout, exchange(addr, &request))
        .await
        .map_err(|_| ProbeError::Timeout(timeout))?
}

async fn get(addr: SocketAddr, path: &str) -> Result<(u16, Vec<u8>), ProbeError> {
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    exchange(addr, &request).await
}

/// Send `request` on a new connection and read the answer: its status and body.
async fn exchange(addr: SocketAddr, request: &str) -> Result<(u16, Vec<u8>), ProbeError> {
    let io = |e: std::io::Error| ProbeError::Io(e.to_string());
    let mut socket = TcpStream::connect(addr).await.map_err(io)?;
    socket.write_all(request.as_bytes()).await.map_err(io)?;
    let mut answer = Vec::new();
    let mut chunk = [0u8; 16384];
    loop {
        let n = socket.read(&mut chunk).await.map_err(io)?;
        if n == 0 {
            break;
        }
        if answer.len() + n > MAX_BODY {
            return Err(ProbeError::Malformed("answer too large".into()));
        }
        answer.extend_from_slice(&chunk[..n]);
        // A server that keeps the connection open despite `Connection: close` is done once
        // its Content-Length is in: waiting for the close would turn a good answer into a
        // timeout.
        if complete_by_length(&answer) {
            break;
        }
    }
    let head_end =
        head_end(&answer).ok_or_else(|| ProbeError::Malformed("no end of headers".into()))?;
    let head = String::from_utf8_lossy(&answer[..head_end]).into_owned();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| ProbeError::Malformed("no status line".into()))?;
    let mut body = answer.split_off(head_end + 4);
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = unchunk(&body)?;
    }
    Ok((status, body))
}

/// Where the head of `answer` ends (the blank line), if it has arrived.
fn head_end(answer: &[u8]) -> Option<usize> {
    answer.windows(4).position(|w| w == b"\r\n\r\n")
}

/// Whether `answer` holds a head with a Content-Length and that many body bytes.
fn complete_by_length(answer: &[u8]) -> bool {
    let Some(end) = head_end(answer) else {
        return false;
    };
    let head = String::from_utf8_lossy(&answer[..end]).to_ascii_lowercase();
    let length = head.lines().find_map(|line| {
        let value = line.strip_prefix("content-length:")?;
        value.trim().parse::<usize>().ok()
    });
    length.is_some_and(|n| answer.len() - (end + 4) >= n)
}

/// A chunked body, joined.
fn unchunk(mut body: &[u8]) -> Result<Vec<u8>, ProbeError> {
    let bad = || ProbeError::Malformed("bad chunked body".into());
    let mut out = Vec::new();
    loop {
        let line_end = body.windows(2).position(|w| w == b"\r\n").ok_or_else(bad)?;
        let size = std::str::from_utf8(&body[..line_end])
            .ok()
            .and_then(|s| usize::from_str_radix(s.split(';').next()?.trim(), 16).ok())
            .ok_or_else(bad)?;
        body = &body[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        // A chunk size is the peer's word: checked, never trusted to add without overflow.
        if size.checked_add(2).is_none_or(|needed| body.len() < needed) {
            return Err(bad());
        }
        out.extend_from_slice(&body[..size]);
        body = &body[size + 2..];
    }
}

async fn ok_body(addr: SocketAddr, path: &str, timeout: Duration) -> Result<Vec<u8>, ProbeError> {
    match http_get(addr, path, timeout).await? {
        (200, body) => Ok(body),
        (status, _) => Err(ProbeError::Status(status)),
    }
}

/// Whether the engine answers `GET /health` with 200.
pub(super) async fn health(addr: SocketAddr, timeout: Duration) -> Result<(), ProbeError> {
    ok_body(addr, "/health", timeout).await.map(drop)
}

/// The engine's model: `data[0].id` of `GET /v1/models`.
pub(super) async fn model_name(addr: SocketAddr, timeout: Duration) -> Result<String, ProbeError> {
    let body = ok_body(addr, "/v1/models", timeout).await?;
    let value: serde_json::Value = serde_json::from_slice(&body)
        .map_err(|e| ProbeError::Malformed(format!("/v1/models: {e}")))?;
    value
        .pointer("/data/0/id")
        .and_then(serde_json::Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .ok_or_else(|| ProbeError::Missing("/v1/models lists no model".into()))
}

/// The engine's KV block size: the `block_size` label of `vllm:cache_config_info`.
pub(super) async fn block_size(addr: SocketAddr, timeout: Duration) -> Result<u32, ProbeError> {
    let body = ok_body(addr, "/metrics", timeout).await?;
    block_size_of(&String::from_utf8_lossy(&body))
        .ok_or_else(|| ProbeError::Missing("no vllm:cache_config_info block_size".into()))
}

fn block_size_of(metrics: &str) -> Option<u32> {
    metrics
        .lines()
        .filter_map(|line| line.strip_prefix("vllm:cache_config_info{"))
        .find_map(|labels| label(labels, "block_size")?.parse().ok())
}

/// The value of label `name` in a Prometheus label list (`a="1",b="x\"y"} 1.0`, after the
/// `{`). Names are matched whole: vLLM's line also carries `mamba_block_size`,
/// `hash_block_size` and `effective_attention_block_size`, in an order it does not promise.
fn label(mut labels: &str, name: &str) -> Option<String> {
    loop {
        labels = labels.trim_start_matches([',', ' ']);
        let (key, rest) = labels.split_once("=\"")?;
        if key.contains(['}', '"']) {
            return None;
        }
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next()? {
                (_, '\\') => value.push(chars.next()?.1),
                (i, '"') => break i,
                (_, c) => value.push(c),
            }
        };
        if key.trim() == name {
            return Some(value);
        }
        labels = &rest[end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_block_size_is_read_from_the_cache_config_metric() {
        let metrics = "# HELP vllm:cache_config_info x\nvllm:cache_config_info{block_size=\"32\",cache_dtype=\"auto\"} 1.0\n";
        assert_eq!(block_size_of(metrics), Some(32));
        assert_eq!(
            block_size_of("vllm:cache_config_info{block_size=\"x\"} 1"),
            None
        );
        assert_eq!(block_size_of("garbage\n\u{0}"), None);
        // vLLM 0.32's line: look-alike labels before and after the real one, in any order.
        let real = "vllm:cache_config_info{_block_size_resolved=\"True\",mamba_block_size=\"None\",block_size=\"32\",hash_block_size=\"None\",effective_attention_block_size=\"16\"} 1.0";
        assert_eq!(block_size_of(real), Some(32));
        let escaped = "vllm:cache_config_info{note=\"a \\\"block_size=\\\"9\",block_size=\"64\"} 1";
        assert_eq!(block_size_of(escaped), Some(64));
        for junk in [
            "vllm:cache_config_info{block_size=\"32",
            "vllm:cache_config_info{block_size=32} 1",
            "vllm:cache_config_info{} 1",
            "vllm:cache_config_info{",
            "vllm:cache_config_info{block_size=\"99999999999\"} 1",
            "vllm:cache_config_info{a=\"\\",
        ] {
            assert_eq!(block_size_of(junk), None, "{junk}");
        }
    }

    #[test]
    fn an_answer_is_complete_once_its_content_length_is_in() {
        assert!(complete_by_length(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        ));
        assert!(!complete_by_length(
            b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nok"
        ));
        assert!(!complete_by_length(b"HTTP/1.1 200 OK\r\n\r\nok"));
        assert!(!complete_by_length(b"HTTP/1.1 200 OK\r\nContent-Length: 2"));
    }

    #[test]
    fn chunked_bodies_are_joined_and_junk_is_an_error() {
        assert_eq!(
            unchunk(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n").unwrap(),
            b"abcde"
        );
        assert!(unchunk(b"zz\r\nabc").is_err());
        assert!(unchunk(b"10\r\nabc").is_err());
        assert!(unchunk(b"ffffffffffffffff\r\nabc").is_err(), "no overflow");
        assert!(unchunk(b"").is_err());
    }
}
