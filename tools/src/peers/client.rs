//! The harness's client: one streamed `POST /v1/completions` per request, timed as a user sees
//! it (time to the first token, to the last), on a connection of its own so no router's
//! connection handling favours another's.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// Largest stream read per request (a runaway answer is a failure, not memory).
const MAX_STREAM: usize = 4 << 20;

/// What one request saw.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// Time to the first non-empty text chunk (`None`: none came).
    pub ttft: Option<Duration>,
    /// Time to the end of the stream.
    pub e2e: Duration,
    /// The streamed text, concatenated.
    pub text: String,
    /// Why the request failed (`None`: a 200 stream that ended with `[DONE]`).
    pub error: Option<String>,
}

impl Outcome {
    /// Whether the request succeeded.
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }
}

/// Stream one completion of `prompt` through the router at `addr`, bounded by `timeout`.
pub async fn complete(
    addr: SocketAddr,
    model: &str,
    prompt: &str,
    max_tokens: u32,
    timeout: Duration,
) -> Outcome {
    let start = Instant::now();
    let mut outcome = Outcome {
        ttft: None,
        e2e: Duration::ZERO,
        text: String::new(),
        error: None,
    };
    let result = tokio::time::timeout(
        timeout,
        stream(addr, model, prompt, max_tokens, start, &mut outcome),
    )
    .await;
    outcome.error = match result {
        Ok(Ok(())) => None,
        Ok(Err(error)) => Some(error),
        Err(_) => Some(format!("no end within {timeout:?}")),
    };
    outcome.e2e = start.elapsed();
    outcome
}

async fn stream(
    addr: SocketAddr,
    model: &str,
    prompt: &str,
    max_tokens: u32,
    start: Instant,
    outcome: &mut Outcome,
) -> Result<(), String> {
    let body = serde_json::json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
    })
    .to_string();
    let socket = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(socket))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let driver = tokio::spawn(connection);
    let request = hyper::Request::post("/v1/completions")
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("send: {e}"))?;
    let status = response.status().as_u16();
    let mut body = response.into_body();
    let mut pending = Vec::new();
    let mut read = 0usize;
    let mut done = false;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("read: {e}"))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        read += data.len();
        if read > MAX_STREAM {
            return Err("stream too large".into());
        }
        pending.extend_from_slice(&data);
        if status != 200 {
            continue;
        }
        while let Some(end) = find(&pending, b"\n\n") {
            let event: Vec<u8> = pending.drain(..end + 2).collect();
            let event = String::from_utf8_lossy(&event);
            for line in event.lines() {
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim();
                if data == "[DONE]" {
                    done = true;
                    continue;
                }
                let text = chunk_text(data)?;
                if !text.is_empty() && outcome.ttft.is_none() {
                    outcome.ttft = Some(start.elapsed());
                }
                outcome.text.push_str(&text);
            }
        }
    }
    driver.abort();
    if status != 200 {
        let answer = String::from_utf8_lossy(&pending);
        return Err(format!(
            "HTTP {status}: {}",
            answer.chars().take(200).collect::<String>()
        ));
    }
    if !done {
        return Err("stream ended without [DONE]".into());
    }
    Ok(())
}

/// The text of one streamed completion chunk; an `error` object is a failure.
fn chunk_text(data: &str) -> Result<String, String> {
    let value: serde_json::Value =
        serde_json::from_str(data).map_err(|e| format!("chunk is not JSON: {e}"))?;
    if let Some(error) = value.get("error") {
        return Err(format!("error in stream: {error}"));
    }
    Ok(value
        .pointer("/choices/0/text")
        .and_then(serde_json::Value::as_str)
        .unwrap_or_default()
        .to_owned())
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_gives_its_text_and_an_error_chunk_fails() {
        assert_eq!(
            chunk_text(r#"{"choices":[{"index":0,"text":" hop"}]}"#).unwrap(),
            " hop"
        );
        assert_eq!(chunk_text(r#"{"choices":[]}"#).unwrap(), "");
        assert!(chunk_text(r#"{"error":{"message":"gone"}}"#).is_err());
        assert!(chunk_text("not json").is_err());
    }
}
