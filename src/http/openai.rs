//! The OpenAI wire shapes the frontend reads and writes, and its error bodies.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use crate::push::PushError;
use crate::router::{DecodeError, GenerateError, PrefillError};

/// `prompt` of `/v1/completions`: a string, a one-element array of strings, or token ids.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text, tokenized by the built-in tokenizer.
    Text(String),
    /// An array of texts (exactly one is supported).
    Texts(Vec<String>),
    /// Token ids, sent as they are.
    Tokens(Vec<u32>),
}

/// The body of `POST /v1/completions` (fields not listed are ignored).
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    /// The model name (echoed back).
    pub model: String,
    /// The prompt.
    pub prompt: Prompt,
    /// Tokens to generate.
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Session id for affinity (OpenAI's `user`).
    #[serde(default)]
    pub user: Option<String>,
}

/// A chat message's `content`: a string or an array of parts (text parts are joined).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content parts; only `{"type": "text", "text": ...}` parts carry text.
    Parts(Vec<ContentPart>),
}

/// One part of an array `content`.
#[derive(Clone, Debug, Deserialize)]
pub struct ContentPart {
    /// The part's type (`text`; others are refused).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
}

/// One chat message.
#[derive(Clone, Debug, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The message text (may be null for assistant tool calls: then empty).
    #[serde(default)]
    pub content: Option<Content>,
}

/// The body of `POST /v1/chat/completions` (fields not listed are ignored).
#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    /// The model name (echoed back).
    pub model: String,
    /// The conversation so far.
    pub messages: Vec<Message>,
    /// Tokens to generate (the newer name).
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    /// Tokens to generate.
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Session id for affinity.
    #[serde(default)]
    pub user: Option<String>,
}

/// Token counts of a response.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
}

/// An error answered as OpenAI does: a status and `{"error": {message, type, param, code}}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// `error.type`.
    pub kind: &'static str,
    /// `error.code`.
    pub code: &'static str,
    /// `error.message`.
    pub message: String,
}

impl ApiError {
    /// 400 `invalid_request_error`.
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            code,
            message: message.into(),
        }
    }

    /// 413 for a body over the limit.
    pub fn too_large(limit: usize) -> Self {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            kind: "invalid_request_error",
            code: "body_too_large",
            message: format!("request body exceeds {limit} bytes"),
        }
    }

    /// 504 when the request deadline passed.
    pub fn deadline(after: std::time::Duration) -> Self {
        ApiError {
            status: StatusCode::GATEWAY_TIMEOUT,
            kind: "timeout_error",
            code: "deadline_exceeded",
            message: format!("request not finished within {} ms", after.as_millis()),
        }
    }

    /// 404 for an unknown route.
    pub fn not_found(path: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            code: "unknown_route",
            message: format!("no route {path}"),
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": null,
                "code": self.code,
            }
        })
    }
}

impl ApiError {
    /// The `Retry-After` seconds a client is told: only an overload (every worker over its
    /// busy threshold) is worth retrying on a timer; pressure passes within a prefill or two.
    pub fn retry_after(&self) -> Option<u64> {
        (self.code == OVERLOADED).then_some(1)
    }
}

/// `error.code` of an overload answer (503 with `Retry-After`).
pub const OVERLOADED: &str = "overloaded";

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let retry = self.retry_after();
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(seconds) = retry {
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, seconds.into());
        }
        response
    }
}

fn push_error(error: &PushError, message: String) -> ApiError {
    match error {
        PushError::NoRoutableInstances | PushError::DirectTargetNotRoutable(_) => ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "service_unavailable",
            code: "no_routable_instances",
            message,
        },
        // 503, not 429: the client did nothing wrong, and load balancers and the openai client
        // retry a 503 (with its Retry-After) on another replica or after the pause.
        PushError::Overloaded { .. } => ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "service_unavailable",
            code: OVERLOADED,
            message,
        },
        PushError::Timeout { .. } => ApiError {
            status: StatusCode::GATEWAY_TIMEOUT,
            kind: "timeout_error",
            code: "deadline_exceeded",
            message,
        },
        _ => ApiError {
            status: StatusCode::BAD_GATEWAY,
            kind: "upstream_error",
            code: "worker_failed",
            message,
        },
    }
}

impl From<&GenerateError> for ApiError {
    fn from(error: &GenerateError) -> Self {
        let message = error.to_string();
        match error {
            GenerateError::NotActivated { .. } => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                kind: "service_unavailable",
                code: "prefill_not_active",
                message,
            },
            GenerateError::Prefill(PrefillError::Push(e))
            | GenerateError::Decode(DecodeError::Push(e)) => push_error(e, message),
            _ => ApiError {
                status: StatusCode::BAD_GATEWAY,
                kind: "upstream_error",
                code: "worker_failed",
                message,
            },
        }
    }
}

impl From<&DecodeError> for ApiError {
    fn from(error: &DecodeError) -> Self {
        let message = error.to_string();
        match error {
            DecodeError::Push(e) => push_error(e, message),
            _ => ApiError {
                status: StatusCode::BAD_GATEWAY,
                kind: "upstream_error",
                code: "worker_failed",
                message,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_overload_is_a_503_with_retry_after_and_an_openai_body() {
        let error = PushError::Overloaded {
            threshold: 4096,
            waited: std::time::Duration::from_secs(2),
        };
        let api = ApiError::from(&DecodeError::Push(error));
        assert_eq!(api.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(api.code, OVERLOADED);
        assert_eq!(api.retry_after(), Some(1));
        assert_eq!(api.body()["error"]["code"], "overloaded");
        let response = api.into_response();
        assert_eq!(response.headers()[axum::http::header::RETRY_AFTER], "1");
        // Other failures carry no Retry-After.
        let other = ApiError::from(&DecodeError::Push(PushError::NoRoutableInstances));
        assert_eq!(other.retry_after(), None);
        assert!(other
            .into_response()
            .headers()
            .get(axum::http::header::RETRY_AFTER)
            .is_none());
    }
}
