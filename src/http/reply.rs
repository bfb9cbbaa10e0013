//! A completion's reply: the decoded tokens collected into one JSON body, or streamed as
//! OpenAI server-sent events.

use std::time::Duration;

use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use tokio::time::Instant;

use super::openai::{ApiError, Usage};
use super::state::{Disconnect, Kind, Limits};
use super::tokenizer::Detokenizer;
use crate::decode::DecodeStream;
use crate::request::{FinishReason, GenerateResponse};

/// What every chunk of one reply repeats.
pub(super) struct Reply {
    pub(super) kind: Kind,
    pub(super) id: String,
    pub(super) model: String,
    pub(super) created: u64,
    /// `stream_options.include_usage`: every chunk has `"usage": null`, and a last chunk
    /// with empty `choices` carries the usage.
    pub(super) include_usage: bool,
    /// Output tokens to text (the configured tokenizer's; a model's holds back incomplete
    /// characters between chunks).
    pub(super) text: Detokenizer,
}

pub(super) fn finish_reason(finish: Option<FinishReason>) -> Option<&'static str> {
    finish.map(|f| match f {
        FinishReason::Length => "length",
        FinishReason::Stop | FinishReason::Cancelled => "stop",
    })
}

/// An engine's own rendering of a response, gathered over a reply: when an engine says what
/// its tokens read as, that text is the answer (the configured tokenizer renders the rest).
#[derive(Default)]
struct EngineText(Option<String>);

impl EngineText {
    fn add(&mut self, response: &GenerateResponse) {
        if let Some(text) = &response.text {
            self.0.get_or_insert_with(String::new).push_str(text);
        }
    }
}

impl Reply {
    pub(super) fn chunk(
        &self,
        text: &str,
        first: bool,
        finish: Option<&'static str>,
    ) -> serde_json::Value {
        let mut chunk = self.bare_chunk(text, first, finish);
        if self.include_usage {
            chunk["usage"] = serde_json::Value::Null;
        }
        chunk
    }

    /// The final chunk of `stream_options.include_usage`: no choices, the usage.
    pub(super) fn usage_chunk(&self, usage: Usage) -> serde_json::Value {
        serde_json::json!({
            "id": self.id,
            "object": match self.kind {
                Kind::Completion => "text_completion",
                Kind::Chat => "chat.completion.chunk",
            },
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
        })
    }

    pub(super) fn bare_chunk(
        &self,
        text: &str,
        first: bool,
        finish: Option<&'static str>,
    ) -> serde_json::Value {
        match self.kind {
            Kind::Completion => serde_json::json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
            }),
            Kind::Chat => {
                let delta = if first {
                    serde_json::json!({"role": "assistant", "content": text})
                } else if text.is_empty() {
                    serde_json::json!({})
                } else {
                    serde_json::json!({"content": text})
                };
                serde_json::json!({
                    "id": self.id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
                })
            }
        }
    }

    pub(super) fn whole(
        &self,
        text: String,
        finish: &'static str,
        usage: Usage,
    ) -> serde_json::Value {
        let choice = match self.kind {
            Kind::Completion => {
                serde_json::json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
            }
            Kind::Chat => serde_json::json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": finish,
            }),
        };
        serde_json::json!({
            "id": self.id,
            "object": match self.kind {
                Kind::Completion => "text_completion",
                Kind::Chat => "chat.completion",
            },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        })
    }
}

pub(super) async fn collect(
    reply: Reply,
    first: GenerateResponse,
    mut stream: DecodeStream,
    deadline: Instant,
    timeout: Duration,
    prompt_tokens: usize,
) -> Response {
    let mut text = EngineText::default();
    text.add(&first);
    let mut engine_usage = first.usage;
    let mut tokens = first.token_ids;
    let mut finish = first.finish;
    while finish.is_none() {
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Err(_) => return ApiError::deadline(timeout).into_response(),
            Ok(None) => break,
            Ok(Some(Err(error))) => return ApiError::from(&error).into_response(),
            Ok(Some(Ok(response))) => {
                text.add(&response);
                engine_usage = response.usage.or(engine_usage);
                tokens.extend_from_slice(&response.token_ids);
                finish = response.finish;
            }
        }
    }
    let usage = Usage::of(engine_usage, prompt_tokens, tokens.len());
    let text = text.0.unwrap_or_else(|| reply.text.whole(&tokens));
    let body = reply.whole(text, finish_reason(finish).unwrap_or("stop"), usage);
    Json(body).into_response()
}

/// Where an SSE reply is.
pub(super) struct SseState {
    pub(super) reply: Reply,
    pub(super) first: Option<GenerateResponse>,
    pub(super) stream: DecodeStream,
    pub(super) limits: Limits,
    pub(super) prompt_tokens: usize,
    pub(super) completion_tokens: usize,
    pub(super) sent_any: bool,
    pub(super) usage_sent: bool,
    /// The usage an engine reported, if any (it wins over our count).
    pub(super) engine_usage: Option<crate::request::EngineUsage>,
    pub(super) finished: bool,
    pub(super) disconnect: Disconnect,
}

pub(super) fn event(value: &serde_json::Value) -> Event {
    Event::default().data(value.to_string())
}

/// The SSE events of one reply: a chunk per response, a final chunk, with
/// `stream_options.include_usage` a usage chunk, then `data: [DONE]`. An error or the deadline
/// mid-stream sends one `{"error": ...}` event and ends the stream (dropping the decode stream
/// cancels the request at the worker).
pub(super) fn sse_events(
    reply: Reply,
    first: GenerateResponse,
    stream: DecodeStream,
    limits: Limits,
    prompt_tokens: usize,
    disconnect: Disconnect,
) -> impl futures_core::Stream<Item = Result<Event, std::convert::Infallible>> + Send {
    let state = SseState {
        reply,
        first: Some(first),
        stream,
        limits,
        prompt_tokens,
        completion_tokens: 0,
        sent_any: false,
        usage_sent: false,
        engine_usage: None,
        finished: false,
        disconnect,
    };
    futures_util::stream::unfold(state, |mut s| async move {
        if s.finished {
            return None;
        }
        let item = match s.first.take() {
            Some(first) => Some(Ok(first)),
            None => match tokio::time::timeout_at(s.limits.deadline, s.stream.next()).await {
                Ok(item) => item,
                Err(_) => {
                    s.finished = true;
                    s.disconnect.finished = true;
                    let error = ApiError::deadline(s.limits.timeout).body();
                    return Some((Ok(event(&error)), s));
                }
            },
        };
        let out = match item {
            Some(Ok(response)) => {
                let text = match &response.text {
                    Some(text) => text.clone(),
                    None => s
                        .reply
                        .text
                        .push(&response.token_ids, response.finish.is_some()),
                };
                s.engine_usage = response.usage.or(s.engine_usage);
                s.completion_tokens += response.token_ids.len();
                let finish = finish_reason(response.finish);
                let chunk = s.reply.chunk(&text, !s.sent_any, finish);
                s.sent_any = true;
                if finish.is_some() {
                    // The next poll sends the usage chunk (if asked for), then [DONE].
                    s.stream = Box::pin(futures_util::stream::empty());
                }
                event(&chunk)
            }
            None if s.reply.include_usage && !s.usage_sent => {
                s.usage_sent = true;
                s.stream = Box::pin(futures_util::stream::empty());
                let usage = Usage::of(s.engine_usage, s.prompt_tokens, s.completion_tokens);
                event(&s.reply.usage_chunk(usage))
            }
            None => {
                s.finished = true;
                s.disconnect.finished = true;
                Event::default().data("[DONE]")
            }
            Some(Err(error)) => {
                s.finished = true;
                s.disconnect.finished = true;
                event(&ApiError::from(&error).body())
            }
        };
        Some((Ok(out), s))
    })
}
