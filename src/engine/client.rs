//! The engine link's HTTP/1.1 client: hyper's pooled keep-alive client with the three
//! timeouts an engine needs (connect, first byte, idle), and bounded bodies.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;

use crate::transport::{HttpError, TransportError};

/// The default connect timeout of an engine link.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Timeouts and limits of an engine link.
#[derive(Clone, Debug)]
pub struct EngineLinkConfig {
    /// Connecting to an engine (a failure here is a refused connection: nothing was sent).
    pub connect_timeout: Duration,
    /// From sending a request to the engine's response head. A prefill answers once it ran,
    /// so this bounds a prefill; a stream's head comes at once.
    pub first_byte_timeout: Duration,
    /// Longest silence within a body (between two chunks of a stream).
    pub idle_timeout: Duration,
    /// How long an idle pooled connection is kept.
    pub pool_idle_timeout: Duration,
    /// Largest body read whole (a prefill's answer, an error's body) and longest line of a
    /// stream, in bytes.
    pub max_body_bytes: usize,
    /// How often a KV-mode link reads each engine's load from its `/metrics` (`None`, the
    /// default: never; the bookings alone score load). See [`crate::engine::load`] and
    /// docs/engines.md for what it measured.
    pub load_interval: Option<Duration>,
    /// How long a KV-mode link waits for an engine's KV event after a prefill that stored new
    /// blocks there before it calls the engine's events stale: the engine's entries are dropped
    /// (it is scored by prediction and load meanwhile) and its feed subscribes afresh.
    pub events_stale_after: Duration,
}

impl Default for EngineLinkConfig {
    fn default() -> Self {
        EngineLinkConfig {
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            first_byte_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(30),
            pool_idle_timeout: Duration::from_secs(60),
            max_body_bytes: 16 << 20,
            load_interval: None,
            events_stale_after: Duration::from_secs(10),
        }
    }
}

/// The pooled client.
pub(super) struct HttpClient {
    client: Client<HttpConnector, Full<Bytes>>,
    config: EngineLinkConfig,
}

fn http(addr: SocketAddr, error: HttpError) -> TransportError {
    TransportError::Http { addr, error }
}

/// The earlier of `now + timeout` and the request's deadline, and whether the deadline is it.
fn bound(timeout: Duration, deadline: Option<Instant>) -> (Instant, bool) {
    let limit = Instant::now() + timeout;
    match deadline {
        Some(d) if d <= limit => (d, true),
        _ => (limit, false),
    }
}

impl HttpClient {
    pub(super) fn new(config: EngineLinkConfig) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(config.connect_timeout));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(config.pool_idle_timeout)
            .build(connector);
        HttpClient { client, config }
    }

    /// The link's settings.
    pub(super) fn config(&self) -> &EngineLinkConfig {
        &self.config
    }

    /// GET `http://addr{path}` within the first-byte timeout; the body of a 2xx answer.
    pub(super) async fn get(
        &self,
        addr: SocketAddr,
        path: &str,
    ) -> Result<Vec<u8>, TransportError> {
        let request = hyper::Request::get(format!("http://{addr}{path}"))
            .body(Full::new(Bytes::new()))
            .map_err(|e| {
                http(
                    addr,
                    HttpError::Malformed {
                        reason: format!("building the request: {e}"),
                    },
                )
            })?;
        let response =
            tokio::time::timeout(self.config.first_byte_timeout, self.client.request(request))
                .await
                .map_err(|_| {
                    http(
                        addr,
                        HttpError::FirstByteTimeout {
                            millis: millis(self.config.first_byte_timeout),
                        },
                    )
                })?
                .map_err(|e| TransportError::Connect {
                    addr,
                    reason: error_chain(&e),
                })?;
        let status = response.status();
        let answer = Answer {
            body: response.into_body(),
            idle: self.config.idle_timeout,
            max: self.config.max_body_bytes,
        };
        let body = answer.collect(addr, None).await?;
        if !status.is_success() {
            return Err(http(
                addr,
                HttpError::Status {
                    status: status.as_u16(),
                    message: error_message(&body),
                },
            ));
        }
        Ok(body)
    }

    /// POST `body` (JSON) to `http://addr{path}` with `X-Request-Id: id`; the answer of a 2xx
    /// status, or the typed error (a non-2xx carries the engine's own message).
    pub(super) async fn post_json(
        &self,
        addr: SocketAddr,
        path: &str,
        id: &str,
        body: Vec<u8>,
        deadline: Option<Instant>,
    ) -> Result<Answer, TransportError> {
        let request = hyper::Request::post(format!("http://{addr}{path}"))
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header("x-request-id", id)
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| {
                http(
                    addr,
                    HttpError::Malformed {
                        reason: format!("building the request: {e}"),
                    },
                )
            })?;
        let (until, is_deadline) = bound(self.config.first_byte_timeout, deadline);
        let response = match tokio::time::timeout_at(until, self.client.request(request)).await {
            Err(_) if is_deadline => return Err(TransportError::Timeout),
            Err(_) => {
                return Err(http(
                    addr,
                    HttpError::FirstByteTimeout {
                        millis: millis(self.config.first_byte_timeout),
                    },
                ))
            }
            // A connect failure sent nothing (the dispatcher may give a handoff to another
            // worker); anything later may have reached the engine.
            Ok(Err(e)) if e.is_connect() => {
                return Err(TransportError::Connect {
                    addr,
                    reason: error_chain(&e),
                })
            }
            Ok(Err(e)) => {
                return Err(TransportError::Disconnected {
                    reason: format!("engine at {addr}: {}", error_chain(&e)),
                })
            }
            Ok(Ok(response)) => response,
        };
        let status = response.status();
        let answer = Answer {
            body: response.into_body(),
            idle: self.config.idle_timeout,
            max: self.config.max_body_bytes,
        };
        if status.is_success() {
            return Ok(answer);
        }
        // The engine's own words, read within the same bounds (a cut body still says the
        // status).
        let text = answer.collect(addr, deadline).await.unwrap_or_default();
        Err(http(
            addr,
            HttpError::Status {
                status: status.as_u16(),
                message: error_message(&text),
            },
        ))
    }
}

/// A response body being read.
pub(super) struct Answer {
    body: Incoming,
    idle: Duration,
    max: usize,
}

impl Answer {
    /// The next data chunk (`None` at the body's end), within the idle timeout and the deadline.
    pub(super) async fn next_chunk(
        &mut self,
        addr: SocketAddr,
        deadline: Option<Instant>,
    ) -> Result<Option<Bytes>, TransportError> {
        loop {
            let (until, is_deadline) = bound(self.idle, deadline);
            let frame = match tokio::time::timeout_at(until, self.body.frame()).await {
                Err(_) if is_deadline => return Err(TransportError::Timeout),
                Err(_) => {
                    return Err(http(
                        addr,
                        HttpError::IdleTimeout {
                            millis: millis(self.idle),
                        },
                    ))
                }
                Ok(None) => return Ok(None),
                Ok(Some(Err(e))) => {
                    return Err(http(
                        addr,
                        HttpError::Truncated {
                            reason: error_chain(&e),
                        },
                    ))
                }
                Ok(Some(Ok(frame))) => frame,
            };
            // Trailers carry nothing we use.
            if let Ok(data) = frame.into_data() {
                return Ok(Some(data));
            }
        }
    }

    /// The largest body or line read whole.
    pub(super) fn max(&self) -> usize {
        self.max
    }

    /// The whole body, bounded by the size limit.
    pub(super) async fn collect(
        mut self,
        addr: SocketAddr,
        deadline: Option<Instant>,
    ) -> Result<Vec<u8>, TransportError> {
        let mut out = Vec::new();
        while let Some(chunk) = self.next_chunk(addr, deadline).await? {
            if out.len() + chunk.len() > self.max {
                return Err(http(
                    addr,
                    HttpError::Malformed {
                        reason: format!("body larger than {} bytes", self.max),
                    },
                ));
            }
            out.extend_from_slice(&chunk);
        }
        Ok(out)
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// An error and its sources, as one line.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// The message of an error body: OpenAI's `{"error": {"message": ...}}`, FastAPI's
/// `{"detail": ...}`, `{"message": ...}`, else the body's start.
pub(super) fn error_message(body: &[u8]) -> String {
    const MAX: usize = 512;
    if let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) {
        let found = value
            .pointer("/error/message")
            .or_else(|| value.get("message"))
            .or_else(|| value.get("detail"));
        match found {
            Some(serde_json::Value::String(s)) => return truncate(s, MAX),
            Some(other) => return truncate(&other.to_string(), MAX),
            None => {}
        }
    }
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    if text.is_empty() {
        "(empty body)".to_owned()
    } else {
        truncate(text, MAX)
    }
}

fn truncate(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_messages_are_the_engines_own() {
        assert_eq!(
            error_message(br#"{"error":{"message":"max_tokens too big","code":400}}"#),
            "max_tokens too big"
        );
        assert_eq!(error_message(br#"{"detail":"Not Found"}"#), "Not Found");
        assert_eq!(
            error_message(b"Internal Server Error"),
            "Internal Server Error"
        );
        assert_eq!(error_message(b""), "(empty body)");
        let long = "é".repeat(600);
        assert!(error_message(long.as_bytes()).len() <= 512 + "…".len());
    }
}
