//! The OpenAI wire shapes the frontend reads and writes, and its error bodies.

use super::tokenizer::PromptError;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use super::tokenizer::Tokenizer;
use crate::binding::PrefillError;
use crate::decode::DecodeError;
use crate::migration::MigrationError;
use crate::push::PushError;
use crate::router::GenerateError;

/// `prompt` of `/v1/completions`, as OpenAI accepts it: a string, an array of strings, an
/// array of token ids, or an array of token-id arrays. One prompt per request is served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// Text, tokenized by the configured tokenizer.
    Text(String),
    /// An array of texts (exactly one is supported).
    Texts(Vec<String>),
    /// Token ids, sent as they are.
    Tokens(Vec<u32>),
    /// An array of token-id arrays (exactly one is supported).
    TokenLists(Vec<Vec<u32>>),
}

fn invalid_prompt(message: impl Into<String>) -> ApiError {
    ApiError::bad_request("invalid_prompt", message)
}

fn token_ids(items: &[serde_json::Value]) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .map(|item| {
            item.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| {
                    invalid_prompt(format!(
                        "token ids must be integers from 0 to {}, got {item}",
                        u32::MAX
                    ))
                })
        })
        .collect()
}

impl Prompt {
    /// Read `prompt` from its JSON value, with a message naming what is wrong.
    pub fn from_json(value: &serde_json::Value) -> Result<Prompt, ApiError> {
        use serde_json::Value;
        let shape = || {
            invalid_prompt(
                "prompt must be a string, an array of strings, an array of token ids, or an array of token-id arrays",
            )
        };
        match value {
            Value::String(text) => Ok(Prompt::Text(text.clone())),
            Value::Array(items) => match items.first() {
                None => Err(ApiError::bad_request(
                    "unsupported_prompt",
                    "prompt must not be empty",
                )),
                Some(Value::String(_)) => items
                    .iter()
                    .map(|item| item.as_str().map(str::to_owned).ok_or_else(shape))
                    .collect::<Result<_, _>>()
                    .map(Prompt::Texts),
                Some(Value::Array(_)) => items
                    .iter()
                    .map(|item| match item {
                        Value::Array(ids) => token_ids(ids),
                        _ => Err(shape()),
                    })
                    .collect::<Result<_, _>>()
                    .map(Prompt::TokenLists),
                Some(_) => token_ids(items).map(Prompt::Tokens),
            },
            _ => Err(shape()),
        }
    }

    /// The one prompt's token ids (text through `tokenizer`); several prompts are
    /// `unsupported_prompt`.
    pub fn into_tokens(self, tokenizer: &Tokenizer) -> Result<Vec<u32>, ApiError> {
        let several = |n: usize| {
            ApiError::bad_request(
                "unsupported_prompt",
                format!("exactly one prompt per request is supported, got {n}"),
            )
        };
        match self {
            Prompt::Text(text) => Ok(tokenizer.encode_prompt(&text)?),
            Prompt::Tokens(ids) => Ok(ids),
            Prompt::Texts(texts) => match <[String; 1]>::try_from(texts) {
                Ok([text]) => Ok(tokenizer.encode_prompt(&text)?),
                Err(texts) => Err(several(texts.len())),
            },
            Prompt::TokenLists(lists) => match <[Vec<u32>; 1]>::try_from(lists) {
                Ok([ids]) => Ok(ids),
                Err(lists) => Err(several(lists.len())),
            },
        }
    }
}

/// The token ids of a completion request's `prompt` (see [`Prompt`]).
pub(crate) fn prompt_tokens(
    value: &serde_json::Value,
    tokenizer: &Tokenizer,
) -> Result<Vec<u32>, ApiError> {
    Prompt::from_json(value)?.into_tokens(tokenizer)
}

/// A `max_tokens`-like field (`name`): absent or null is `None`; an integer from 1 to `limit`
/// is taken; anything else is 400 `invalid_max_tokens` with a message naming the field.
pub(crate) fn max_tokens_field(
    name: &str,
    value: Option<&serde_json::Value>,
    limit: u32,
) -> Result<Option<u32>, ApiError> {
    let Some(value) = value.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    match value.as_u64().and_then(|n| u32::try_from(n).ok()) {
        Some(n) if (1..=limit).contains(&n) => Ok(Some(n)),
        _ => Err(ApiError::bad_request(
            "invalid_max_tokens",
            format!("{name} must be an integer between 1 and {limit}, got {value}"),
        )),
    }
}

/// `stream_options` of a streaming request.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` and empty `choices` before `[DONE]`.
    #[serde(default)]
    pub include_usage: bool,
}

/// The body of `POST /v1/completions` (fields not listed are ignored).
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    /// The model name (echoed back).
    pub model: String,
    /// The prompt (read by [`Prompt::from_json`]).
    pub prompt: serde_json::Value,
    /// Tokens to generate (checked by the handler: an integer from 1 to the limit).
    #[serde(default)]
    pub max_tokens: Option<serde_json::Value>,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Options of a stream.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
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
    /// Tokens to generate (the newer name; checked by the handler).
    #[serde(default)]
    pub max_completion_tokens: Option<serde_json::Value>,
    /// Tokens to generate (checked by the handler).
    #[serde(default)]
    pub max_tokens: Option<serde_json::Value>,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Options of a stream.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
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
    /// Prompt tokens served from a prefix cache, when an engine reported them (OpenAI's
    /// `prompt_tokens_details.cached_tokens`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

/// The details of a response's prompt tokens.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from a prefix cache.
    pub cached_tokens: usize,
}

impl Usage {
    /// The usage of a response: the engine's own count when it reported one, else ours.
    pub(crate) fn of(
        engine: Option<crate::request::EngineUsage>,
        prompt_tokens: usize,
        completion_tokens: usize,
    ) -> Self {
        let (prompt, completion, cached) = match engine {
            Some(u) => (
                u.prompt_tokens as usize,
                u.completion_tokens as usize,
                u.cached_tokens.map(|c| c as usize),
            ),
            None => (prompt_tokens, completion_tokens, None),
        };
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: cached
                .map(|cached_tokens| PromptTokensDetails { cached_tokens }),
        }
    }
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

/// A decode stream that broke and could not be continued (docs/health.md, "Migration").
fn migration_error(error: &MigrationError, message: String) -> ApiError {
    match error {
        MigrationError::LimitUsedUp { .. } => ApiError {
            status: StatusCode::BAD_GATEWAY,
            kind: "upstream_error",
            code: "migration_limit_used_up",
            message,
        },
        MigrationError::DeadlinePassed { .. } => ApiError {
            status: StatusCode::GATEWAY_TIMEOUT,
            kind: "timeout_error",
            code: "deadline_exceeded",
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
            // No prefill worker could be reached (and the policy does not bypass): the pool is
            // unavailable, not a worker failing this request.
            GenerateError::Prefill(e) if e.no_reachable_worker() => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                kind: "service_unavailable",
                code: "no_routable_instances",
                message,
            },
            GenerateError::Prefill(PrefillError::Push(e))
            | GenerateError::Decode(DecodeError::Push(e)) => push_error(e, message),
            GenerateError::Decode(DecodeError::Migration(e)) => migration_error(e, message),
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
            DecodeError::Migration(e) => migration_error(e, message),
            _ => ApiError {
                status: StatusCode::BAD_GATEWAY,
                kind: "upstream_error",
                code: "worker_failed",
                message,
            },
        }
    }
}

/// Sampling fields of a client's request that an engine honours, forwarded to it verbatim
/// ([`GenerateRequest::engine_fields`](crate::request::GenerateRequest::engine_fields)); the
/// built-in mock workers ignore them.
const ENGINE_FIELDS: [&str; 14] = [
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "ignore_eos",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "logit_bias",
];

/// The engine fields of a request body, as the JSON text of one object (`None`: none given).
pub(crate) fn engine_fields(body: &[u8]) -> Option<String> {
    let serde_json::Value::Object(all) = serde_json::from_slice(body).ok()? else {
        return None;
    };
    let kept: serde_json::Map<String, serde_json::Value> = all
        .into_iter()
        .filter(|(k, v)| ENGINE_FIELDS.contains(&k.as_str()) && !v.is_null())
        .collect();
    (!kept.is_empty()).then(|| serde_json::Value::Object(kept).to_string())
}

/// A prompt the tokenizer refused is the request's fault: 400, with the template's or the
/// tokenizer's own words.
impl From<PromptError> for ApiError {
    fn from(error: PromptError) -> Self {
        let code = match error {
            PromptError::Template { .. } | PromptError::NoTemplate { .. } => "chat_template_error",
            PromptError::Encode { .. } => "invalid_prompt",
        };
        ApiError::bad_request(code, error.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_openai_prompt_form_is_read_and_several_prompts_are_refused() {
        use serde_json::json;
        let tokens = |v: serde_json::Value| prompt_tokens(&v, &Tokenizer::Words);
        assert_eq!(tokens(json!([1, 2, 3])).unwrap(), vec![1, 2, 3]);
        assert_eq!(tokens(json!([[1, 2, 3]])).unwrap(), vec![1, 2, 3]);
        assert_eq!(
            tokens(json!("hello world")).unwrap(),
            tokens(json!(["hello world"])).unwrap()
        );
        for (bad, code) in [
            (json!([[1], [2]]), "unsupported_prompt"),
            (json!(["a", "b"]), "unsupported_prompt"),
            (json!([]), "unsupported_prompt"),
            (json!([1, -2]), "invalid_prompt"),
            (json!([1, 4_294_967_296u64]), "invalid_prompt"),
            (json!([[1], "a"]), "invalid_prompt"),
            (json!(["a", 1]), "invalid_prompt"),
            (json!(7), "invalid_prompt"),
            (json!({"text": "a"}), "invalid_prompt"),
        ] {
            let error = tokens(bad.clone()).unwrap_err();
            assert_eq!(
                (error.status, error.code),
                (StatusCode::BAD_REQUEST, code),
                "{bad}"
            );
        }
    }

    #[test]
    fn max_tokens_out_of_range_is_invalid_max_tokens_in_words() {
        use serde_json::json;
        assert_eq!(max_tokens_field("max_tokens", None, 10).unwrap(), None);
        assert_eq!(
            max_tokens_field("max_tokens", Some(&json!(null)), 10).unwrap(),
            None
        );
        assert_eq!(
            max_tokens_field("max_tokens", Some(&json!(10)), 10).unwrap(),
            Some(10)
        );
        for bad in [
            json!(0),
            json!(11),
            json!(-1),
            json!(5_000_000_000u64),
            json!(1.5),
            json!("3"),
        ] {
            let error = max_tokens_field("max_completion_tokens", Some(&bad), 10).unwrap_err();
            assert_eq!(error.code, "invalid_max_tokens", "{bad}");
            assert!(
                error
                    .message
                    .starts_with("max_completion_tokens must be an integer between 1 and 10"),
                "{}",
                error.message
            );
        }
    }

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

    #[test]
    fn a_stream_that_could_not_migrate_is_a_typed_502_or_504() {
        use crate::migration::BreakReason;
        let used_up = DecodeError::Migration(MigrationError::LimitUsedUp {
            limit: 3,
            migrations: 3,
            reason: BreakReason::ConnectionDropped,
        });
        let api = ApiError::from(&used_up);
        assert_eq!(api.status, StatusCode::BAD_GATEWAY);
        assert_eq!(api.body()["error"]["code"], "migration_limit_used_up");
        let late = GenerateError::Decode(DecodeError::Migration(MigrationError::DeadlinePassed {
            emitted: 5,
            migrations: 1,
        }));
        let api = ApiError::from(&late);
        assert_eq!(api.status, StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(api.body()["error"]["code"], "deadline_exceeded");
    }
}
