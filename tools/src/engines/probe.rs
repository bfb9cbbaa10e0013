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

async fn get(addr: SocketAddr, path: &str) -> Result<(u16, Vec<u8>), ProbeError> {
    let io = |e: std::io::Error| ProbeError::Io(e.to_string());
    let mut socket = TcpStream::connect(addr).await.map_err(io)?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    socket.write_all(request.as_bytes()).await.map_err(io)?;
    let mut answer = Vec::new();
    let mut chunk = [0u8; 16384];
    // Read until the body is complete by its own framing (a server may keep the connection
    // open despite `Connection: close`), or to the end of the connection.
    loop {
        if let Some(done) = complete(&answer) {
            answer.truncate(done);
            break;
        }
        let n = socket.read(&mut chunk).await.map_err(io)?;
        if n == 0 {
            break;
        }
        if answer.len() + n > MAX_BODY {
            return Err(ProbeError::Malformed("answer too large".into()));
        }
        answer.extend_from_slice(&chunk[..n]);
    }
    let head_end = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| ProbeError::Malformed("no end of headers".into()))?;
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

/// The length of a complete response in `answer`, when its framing says it is complete: a
/// `Content-Length` body read whole, or a chunked body's last chunk seen.
fn complete(answer: &[u8]) -> Option<usize> {
    let head_end = answer.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = String::from_utf8_lossy(&answer[..head_end]).to_ascii_lowercase();
    if let Some(length) = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
    {
        return (answer.len() >= head_end + length).then_some(head_end + length);
    }
    if head.contains("transfer-encoding: chunked") {
        let body = &answer[head_end..];
        return body
            .windows(5)
            .position(|w| w == b"0\r\n\r\n")
            .filter(|&i| i == 0 || body[..i].ends_with(b"\r\n"))
            .map(|i| head_end + i + 5);
    }
    None
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
        if body.len() < size + 2 {
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
        .filter(|l| l.starts_with("vllm:cache_config_info{"))
        .find_map(|l| {
            let rest = &l[l.find("block_size=\"")? + "block_size=\"".len()..];
            rest[..rest.find('"')?].parse().ok()
        })
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
    }

    #[test]
    fn chunked_bodies_are_joined_and_junk_is_an_error() {
        assert_eq!(
            unchunk(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n").unwrap(),
            b"abcde"
        );
        assert!(unchunk(b"zz\r\nabc").is_err());
        assert!(unchunk(b"10\r\nabc").is_err());
    }
}
