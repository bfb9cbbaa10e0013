//! The completion handlers: parse, prefill and decode through the hop, answer as JSON or
//! server-sent events, counting what happened.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::sse::Sse;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tokio::time::Instant;

use super::conn::RequestStart;
use super::openai::{max_tokens_field, ApiError, ChatRequest, CompletionRequest, Content};
use super::reply::*;
use super::state::*;
use super::tokenizer::Turn;
use crate::request::GenerateRequest;

/// A parsed request.
pub(super) struct Parsed {
    pub(super) model: String,
    pub(super) token_ids: Vec<u32>,
    pub(super) max_tokens: u32,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    pub(super) session: Option<String>,
}

pub(super) async fn completions(State(app): State<App>, request: Request) -> Response {
    app.answered(Kind::Completion, request).await
}

pub(super) async fn chat_completions(State(app): State<App>, request: Request) -> Response {
    app.answered(Kind::Chat, request).await
}

pub(super) fn json_error(error: &serde_json::Error) -> ApiError {
    use serde_json::error::Category;
    let code = match error.classify() {
        Category::Data => "invalid_field",
        Category::Syntax | Category::Eof | Category::Io => "invalid_json",
    };
    ApiError::bad_request(code, format!("invalid request body: {error}"))
}

impl App {
    /// Read the body within `by` (the body timeout or the request deadline, whichever is
    /// first): 408 `body_timeout` past it.
    pub(super) async fn body(
        &self,
        request: Request,
        by: Instant,
    ) -> Result<axum::body::Bytes, ApiError> {
        let limit = self.0.config.body_limit;
        let declared = request
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(ApiError::too_large(limit));
        }
        let read = Limited::new(request.into_body(), limit).collect();
        match tokio::time::timeout_at(by, read).await {
            Err(_) => Err(ApiError {
                status: StatusCode::REQUEST_TIMEOUT,
                kind: "invalid_request_error",
                code: "body_timeout",
                message: format!(
                    "the request body did not arrive in time (body timeout {} ms, request deadline {} ms)",
                    self.0.config.body_timeout.as_millis(),
                    self.0.config.request_timeout.as_millis()
                ),
            }),
            Ok(Ok(collected)) => Ok(collected.to_bytes()),
            Ok(Err(error)) if error.downcast_ref::<LengthLimitError>().is_some() => {
                Err(ApiError::too_large(limit))
            }
            Ok(Err(error)) => Err(ApiError::bad_request(
                "body_unreadable",
                format!("reading the request body: {error}"),
            )),
        }
    }

    pub(super) fn max_tokens(&self, asked: Option<u32>) -> u32 {
        asked.unwrap_or(self.0.config.default_max_tokens)
    }

    pub(super) fn parse(&self, kind: Kind, body: &[u8]) -> Result<Parsed, ApiError> {
        let limit = self.0.config.max_tokens_limit;
        match kind {
            Kind::Completion => {
                let request: CompletionRequest =
                    serde_json::from_slice(body).map_err(|e| json_error(&e))?;
                let max_tokens =
                    max_tokens_field("max_tokens", request.max_tokens.as_ref(), limit)?;
                let token_ids =
                    super::openai::prompt_tokens(&request.prompt, &self.0.config.tokenizer)?;
                Ok(Parsed {
                    model: request.model,
                    token_ids,
                    max_tokens: self.max_tokens(max_tokens),
                    stream: request.stream,
                    include_usage: request.stream_options.is_some_and(|o| o.include_usage),
                    session: request.user,
                })
            }
            Kind::Chat => {
                let request: ChatRequest =
                    serde_json::from_slice(body).map_err(|e| json_error(&e))?;
                if request.messages.is_empty() {
                    return Err(ApiError::bad_request(
                        "invalid_field",
                        "messages must not be empty",
                    ));
                }
                let max_tokens = match &request.max_completion_tokens {
                    Some(value) if !value.is_null() => {
                        max_tokens_field("max_completion_tokens", Some(value), limit)?
                    }
                    _ => max_tokens_field("max_tokens", request.max_tokens.as_ref(), limit)?,
                };
                let mut texts = Vec::with_capacity(request.messages.len());
                for message in &request.messages {
                    texts.push(match &message.content {
                        None => String::new(),
                        Some(Content::Text(text)) => text.clone(),
                        Some(Content::Parts(parts)) => {
                            let mut joined = String::new();
                            for part in parts {
                                match (&*part.kind, &part.text) {
                                    ("text", Some(text)) => joined.push_str(text),
                                    (other, _) => {
                                        return Err(ApiError::bad_request(
                                            "unsupported_content",
                                            format!(
                                                "content part of type `{other}` is not supported"
                                            ),
                                        ))
                                    }
                                }
                            }
                            joined
                        }
                    });
                }
                let turns: Vec<Turn<'_>> = request
                    .messages
                    .iter()
                    .zip(&texts)
                    .map(|(m, t)| Turn {
                        role: &m.role,
                        content: t,
                    })
                    .collect();
                Ok(Parsed {
                    token_ids: self.0.config.tokenizer.encode_chat(&turns)?,
                    model: request.model,
                    max_tokens: self.max_tokens(max_tokens),
                    stream: request.stream,
                    include_usage: request.stream_options.is_some_and(|o| o.include_usage),
                    session: request.user,
                })
            }
        }
    }

    /// Answer a generation request and count it; a request dropped before its answer (the
    /// client went away, or the connection was closed) is counted too (status 499).
    pub(super) async fn answered(&self, kind: Kind, request: Request) -> Response {
        let mut pending = Unanswered {
            app: Arc::clone(&self.0),
            route: kind.route(),
            answered: false,
        };
        let response = self.generate(kind, request).await;
        pending.answered = true;
        self.answer(kind.route(), response)
    }

    pub(super) async fn generate(&self, kind: Kind, request: Request) -> Response {
        let in_flight = InFlight::new(&self.0.metrics.in_flight);
        let timeout = self.0.config.request_timeout;
        // The deadline runs from the request's first byte when the connection layer saw it.
        let start = request
            .extensions()
            .get::<RequestStart>()
            .map_or_else(Instant::now, |s| s.0);
        let deadline = start + timeout;
        let body_by = deadline.min(Instant::now() + self.0.config.body_timeout);
        let headers = request.headers().clone();
        let parsed = match self.body(request, body_by).await.and_then(|b| {
            self.parse(kind, &b)
                .map(|parsed| (parsed, super::openai::engine_fields(&b)))
        }) {
            Ok(parsed) => parsed,
            Err(error) => {
                // A body that did not arrive will not arrive: close the connection after the
                // answer rather than wait for the rest of it.
                let close = error.code == "body_timeout";
                let mut response = error.into_response();
                if close {
                    response
                        .headers_mut()
                        .insert(header::CONNECTION, HeaderValue::from_static("close"));
                }
                return response;
            }
        };
        let (parsed, engine_fields) = parsed;
        let session = match super::session::session_key(&headers, parsed.session) {
            Ok(session) => session,
            Err(error) => return error.into_response(),
        };
        let prompt_tokens = parsed.token_ids.len();
        let text = self.0.config.tokenizer.detokenizer(&parsed.token_ids);
        let mut request = GenerateRequest::new(parsed.token_ids, parsed.max_tokens);
        request.session = session;
        request.engine_fields = engine_fields;
        let mut stream = match tokio::time::timeout_at(deadline, self.0.hop.generate(request)).await
        {
            Err(_) => return ApiError::deadline(timeout).into_response(),
            Ok(Err(error)) => return ApiError::from(&error).into_response(),
            Ok(Ok(stream)) => stream,
        };
        let first = match tokio::time::timeout_at(deadline, stream.next()).await {
            Err(_) => return ApiError::deadline(timeout).into_response(),
            Ok(None) => {
                return ApiError {
                    status: StatusCode::BAD_GATEWAY,
                    kind: "upstream_error",
                    code: "empty_response",
                    message: "the worker answered nothing".to_owned(),
                }
                .into_response()
            }
            Ok(Some(Err(error))) => return ApiError::from(&error).into_response(),
            Ok(Some(Ok(first))) => first,
        };
        let id = self.0.next_id.fetch_add(1, Ordering::Relaxed);
        let reply = Reply {
            kind,
            id: match kind {
                Kind::Completion => format!("cmpl-{id}"),
                Kind::Chat => format!("chatcmpl-{id}"),
            },
            model: parsed.model,
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            include_usage: parsed.include_usage,
            text,
        };
        let worker = first.prefill.as_ref().map(|p| p.worker);
        let mut response = if parsed.stream {
            let events = sse_events(
                reply,
                first,
                stream,
                Limits { deadline, timeout },
                prompt_tokens,
                Disconnect::new(Arc::clone(&self.0), in_flight),
            );
            Sse::new(events).into_response()
        } else {
            collect(reply, first, stream, deadline, timeout, prompt_tokens).await
        };
        if let Some(worker) = worker {
            if let Ok(value) = HeaderValue::from_str(&worker.to_string()) {
                response.headers_mut().insert("x-prefill-worker", value);
            }
        }
        response
    }
}
