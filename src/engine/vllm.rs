//! vLLM's disaggregated protocol over its OpenAI server (as observed on vLLM 0.32.0,
//! docs/engines.md): both legs are `POST /v1/completions` with the prompt as token ids.
//!
//! - Prefill: `max_tokens` 1, not streamed, `kv_transfer_params` asking for a remote decode.
//!   The answer's `kv_transfer_params` is the handoff, kept as the exact JSON text the engine
//!   sent (never rebuilt from fields we know: a newer vLLM adds fields).
//! - Decode: the client's `max_tokens`, streamed with `return_token_ids` and usage, carrying the
//!   handoff verbatim; without one the engine prefills itself.
//!
//! Nothing the engine sends can panic here: every answer that does not parse is a typed
//! [`HttpError`].

use std::net::SocketAddr;

use futures_util::stream;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use tokio::time::Instant;

use super::client::Answer;
use super::stream::EngineStream;
use crate::discovery::InstanceId;
use crate::request::{EngineUsage, FinishReason, GenerateRequest, GenerateResponse, PrefillInfo};
use crate::transport::{HttpError, TransportError};

/// What a prefill asks for: a remote decode will pull the KV blocks (the other fields as
/// vLLM's own proxy sends them).
const PREFILL_PARAMS: &str = r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

fn malformed(addr: SocketAddr, reason: impl Into<String>) -> TransportError {
    TransportError::Http {
        addr,
        error: HttpError::Malformed {
            reason: reason.into(),
        },
    }
}

/// The JSON body: the request's engine fields, then the fields the hop owns (they win), then
/// `kv_transfer_params` spliced in as raw text (verbatim: a `Value` round trip could reformat
/// numbers a newer engine relies on).
fn body(request: &GenerateRequest, max_tokens: u32, stream: bool, params: Option<&str>) -> Vec<u8> {
    let mut fields = match request.engine_fields.as_deref().map(serde_json::from_str) {
        Some(Ok(Value::Object(map))) => map,
        Some(_) => {
            tracing::warn!("engine_fields is not a JSON object: ignored");
            Map::new()
        }
        None => Map::new(),
    };
    // Only the hop hands out a handle.
    fields.remove("kv_transfer_params");
    fields.insert("prompt".into(), Value::from(request.token_ids.clone()));
    fields.insert("max_tokens".into(), Value::from(max_tokens));
    fields.insert("stream".into(), Value::Bool(stream));
    fields.insert("return_token_ids".into(), Value::Bool(true));
    if stream {
        fields.insert(
            "stream_options".into(),
            serde_json::json!({"include_usage": true}),
        );
    }
    if !request.stop_token_ids.is_empty() {
        fields.insert(
            "stop_token_ids".into(),
            Value::from(request.stop_token_ids.clone()),
        );
    }
    // A map of strings and numbers always serializes.
    let mut text = serde_json::to_string(&fields).unwrap_or_else(|_| "{}".to_owned());
    if let Some(raw) = params {
        text.pop(); // the closing brace; `fields` is never empty (it has `prompt`)
        text.push_str(",\"kv_transfer_params\":");
        text.push_str(raw);
        text.push('}');
    }
    text.into_bytes()
}

/// The prefill leg's body.
pub(super) fn prefill_body(request: &GenerateRequest) -> Result<Vec<u8>, TransportError> {
    Ok(body(request, 1, false, Some(PREFILL_PARAMS)))
}

/// The decode leg's body: the handoff verbatim when there is one.
pub(super) fn decode_body(request: &GenerateRequest) -> Result<Vec<u8>, TransportError> {
    let params = request
        .handoff
        .as_ref()
        .and_then(|h| h.engine_params.as_deref());
    if let Some(raw) = params {
        // It came from an engine's answer through `prefill_answer`, so it is JSON; checked
        // anyway, since a handoff may have crossed a process boundary.
        if serde_json::from_str::<&RawValue>(raw).is_err() {
            return Err(TransportError::Remote(
                crate::transport::RemoteError::Engine {
                    message: "the request's handoff is not JSON".into(),
                },
            ));
        }
    }
    Ok(body(request, request.max_tokens, true, params))
}

#[derive(Deserialize)]
struct Completion<'a> {
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(borrow, default)]
    kv_transfer_params: Option<&'a RawValue>,
    #[serde(default)]
    error: Option<Value>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: u32,
    #[serde(default)]
    completion_tokens: u32,
    #[serde(default)]
    prompt_tokens_details: Option<Details>,
}

#[derive(Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: Option<u32>,
}

impl From<Usage> for EngineUsage {
    fn from(u: Usage) -> Self {
        EngineUsage {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            cached_tokens: u.prompt_tokens_details.and_then(|d| d.cached_tokens),
        }
    }
}

fn finish(reason: Option<&str>) -> Option<FinishReason> {
    match reason? {
        "length" => Some(FinishReason::Length),
        "abort" | "cancelled" => Some(FinishReason::Cancelled),
        // "stop", and anything a newer engine says ends the request.
        _ => Some(FinishReason::Stop),
    }
}

fn parse<'a>(addr: SocketAddr, bytes: &'a [u8]) -> Result<Completion<'a>, TransportError> {
    let completion: Completion<'a> = serde_json::from_slice(bytes)
        .map_err(|e| malformed(addr, format!("not a completion: {e}")))?;
    if let Some(error) = &completion.error {
        // An error object inside a 200 (vLLM streams them that way).
        let message = error
            .get("message")
            .and_then(Value::as_str)
            .map_or_else(|| error.to_string(), str::to_owned);
        let status = error
            .get("code")
            .and_then(Value::as_u64)
            .and_then(|c| u16::try_from(c).ok())
            .unwrap_or(500);
        return Err(TransportError::Http {
            addr,
            error: HttpError::Status { status, message },
        });
    }
    Ok(completion)
}

/// The prefill's answer as the one response of the prefill leg, its handoff kept opaque.
pub(super) fn prefill_answer(
    addr: SocketAddr,
    worker: InstanceId,
    block_size: u32,
    bytes: &[u8],
) -> Result<GenerateResponse, TransportError> {
    let completion = parse(addr, bytes)?;
    let Some(choice) = completion.choices.into_iter().next() else {
        return Err(malformed(addr, "a completion without choices"));
    };
    let usage = completion.usage.map(EngineUsage::from);
    let cached_tokens = usage.and_then(|u| u.cached_tokens).unwrap_or(0);
    let prefill = PrefillInfo {
        worker,
        prompt_tokens: usage.map_or(0, |u| u.prompt_tokens),
        cached_blocks: cached_tokens.checked_div(block_size).unwrap_or(0),
        block_size,
        engine_params: completion
            .kv_transfer_params
            .map(|raw| raw.get().to_owned()),
    };
    Ok(GenerateResponse {
        token_ids: choice.token_ids.unwrap_or_default(),
        finish: finish(choice.finish_reason.as_deref()).or(Some(FinishReason::Length)),
        prefill: Some(prefill),
        text: choice.text,
        usage,
    })
}

/// The decode's server-sent events as responses: one per chunk with tokens, the finishing
/// chunk held back until the usage chunk (vLLM sends usage after the finish, and a response
/// with `finish` must be the stream's last), the end at `data: [DONE]`.
pub(super) fn decode_stream(
    answer: Answer,
    addr: SocketAddr,
    deadline: Option<Instant>,
) -> EngineStream {
    let events = Events {
        answer,
        addr,
        deadline,
        buffer: Vec::new(),
        finished: None,
        over: false,
    };
    Box::pin(stream::unfold(events, |mut events| async move {
        if events.over {
            return None;
        }
        let item = events.next().await;
        match item {
            Some(Ok(response)) => {
                events.over = response.finish.is_some();
                Some((Ok(response), events))
            }
            Some(Err(e)) => {
                events.over = true;
                Some((Err(e), events))
            }
            None => None,
        }
    }))
}

/// The reader of one decode stream.
struct Events {
    answer: Answer,
    addr: SocketAddr,
    deadline: Option<Instant>,
    buffer: Vec<u8>,
    /// The finishing response, waiting for the usage chunk.
    finished: Option<GenerateResponse>,
    over: bool,
}

impl Events {
    async fn next(&mut self) -> Option<Result<GenerateResponse, TransportError>> {
        loop {
            while let Some(line) = self.line() {
                match self.event(&line) {
                    Ok(Some(response)) => return Some(Ok(response)),
                    Ok(None) => {}
                    Err(e) => return Some(Err(e)),
                }
                if self.over {
                    return self.finished.take().map(Ok);
                }
            }
            if self.buffer.len() > self.answer.max() {
                return Some(Err(malformed(
                    self.addr,
                    "an event line over the size limit",
                )));
            }
            match self.answer.next_chunk(self.addr, self.deadline).await {
                Ok(Some(chunk)) => self.buffer.extend_from_slice(&chunk),
                // The body ended without `[DONE]`: complete if the finish came.
                Ok(None) => {
                    return Some(self.finished.take().ok_or_else(|| TransportError::Http {
                        addr: self.addr,
                        error: HttpError::Truncated {
                            reason: "the stream ended before its finish".into(),
                        },
                    }))
                }
                Err(e) => return Some(Err(e)),
            }
        }
    }

    /// The next complete line, without its end.
    fn line(&mut self) -> Option<Vec<u8>> {
        let end = self.buffer.iter().position(|&b| b == b'\n')?;
        let mut line: Vec<u8> = self.buffer.drain(..=end).collect();
        line.pop();
        if line.last() == Some(&b'\r') {
            line.pop();
        }
        Some(line)
    }

    /// One line of the stream: a response to hand out, or nothing yet.
    fn event(&mut self, line: &[u8]) -> Result<Option<GenerateResponse>, TransportError> {
        // Comments, `event:`, `id:` and blank separators carry nothing here.
        let Some(data) = line.strip_prefix(b"data:") else {
            return Ok(None);
        };
        let data = data.trim_ascii();
        if data == b"[DONE]" {
            self.over = true;
            if self.finished.is_none() {
                return Err(TransportError::Http {
                    addr: self.addr,
                    error: HttpError::Truncated {
                        reason: "[DONE] before a finish".into(),
                    },
                });
            }
            return Ok(None);
        }
        let chunk = parse(self.addr, data)?;
        let usage = chunk.usage.map(EngineUsage::from);
        let Some(choice) = chunk.choices.into_iter().next() else {
            // The usage chunk: it completes the finishing response.
            return Ok(match self.finished.take() {
                Some(mut last) => {
                    last.usage = usage.or(last.usage);
                    Some(last)
                }
                None => usage.map(|u| GenerateResponse {
                    usage: Some(u),
                    ..GenerateResponse::default()
                }),
            });
        };
        let response = GenerateResponse {
            token_ids: choice.token_ids.unwrap_or_default(),
            finish: finish(choice.finish_reason.as_deref()),
            prefill: None,
            text: choice.text,
            usage,
        };
        if response.finish.is_some() {
            if self.finished.is_some() {
                return Err(malformed(self.addr, "a second finish in one stream"));
            }
            self.finished = Some(response);
            return Ok(None);
        }
        Ok(Some(response))
    }
}

#[cfg(test)]
mod tests;
