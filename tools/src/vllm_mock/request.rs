//! Reading a completion or chat request as vLLM 0.32 does, and its errors in vLLM's shape
//! (`{"error": {"message", "type", "param", "code"}}`, with vLLM's messages). Unknown fields are
//! ignored; nothing in a body can panic.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

use super::engine::Transfer;
use prefill_router::http::tokenizer::Turn;
use prefill_router::http::Tokenizer;

/// An error answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// `error.message`.
    pub message: String,
    /// `error.type`.
    pub kind: &'static str,
    /// `error.param`.
    pub param: Option<String>,
}

impl ApiError {
    /// A 400 `BadRequestError`.
    pub fn bad(message: impl Into<String>, param: Option<&str>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "BadRequestError",
            param: param.map(str::to_owned),
        }
    }

    /// A 400 from request validation (vLLM's pydantic errors: type `Bad Request`).
    pub fn validation(message: impl Into<String>, param: &str) -> Self {
        ApiError {
            kind: "Bad Request",
            ..ApiError::bad(message, Some(param))
        }
    }

    /// The body.
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status.as_u16()}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// A request's fields the engine uses.
#[derive(Debug, Clone)]
pub struct Parsed {
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate (capped to the context left).
    pub max_tokens: usize,
    /// `stream`.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// `return_token_ids`.
    pub return_token_ids: bool,
    /// `stop_token_ids`.
    pub stop_token_ids: Vec<u32>,
    /// The request's `kv_transfer_params`, if an object.
    pub kv_params: Option<Map<String, Value>>,
}

/// The limits a request is checked against.
pub struct Limits<'a> {
    /// The served model name.
    pub model: &'a str,
    /// The context length.
    pub max_model_len: usize,
    /// Token ids must be below this.
    pub vocab_size: u32,
}

fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::validation(
            "1 validation error: Input should be a valid dictionary",
            "body",
        )),
        Err(_) => Err(ApiError::validation(
            "1 validation error: JSON decode error",
            "body.0",
        )),
    }
}

fn ids(value: &Value, vocab: u32) -> Result<Option<Vec<u32>>, ApiError> {
    let Value::Array(items) = value else {
        return Ok(None);
    };
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        let Some(id) = item.as_u64() else {
            return Ok(None);
        };
        if id >= u64::from(vocab) {
            return Err(ApiError::bad(
                format!("Token id {id} is out of vocabulary"),
                None,
            ));
        }
        out.push(id as u32);
    }
    Ok(Some(out))
}

/// The completion prompt: a string, token ids, or a list of one of them.
fn prompt(body: &Map<String, Value>, tok: &Tokenizer, vocab: u32) -> Result<Vec<u32>, ApiError> {
    let missing = || {
        ApiError::bad(
            "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
            Some("prompt"),
        )
    };
    let value = match body.get("prompt") {
        None | Some(Value::Null) => return Err(missing()),
        Some(v) => v,
    };
    let encode = |text: &str| {
        tok.encode_prompt(text)
            .map_err(|e| ApiError::bad(e.to_string(), Some("prompt")))
    };
    if let Value::String(text) = value {
        if text.is_empty() {
            return Err(missing());
        }
        return encode(text);
    }
    if let Value::Array(items) = value {
        if items.is_empty() {
            return Err(ApiError::bad("You must pass at least one prompt", None));
        }
        if let Some(ids) = ids(value, vocab)? {
            return Ok(ids);
        }
        if items.len() > 1 {
            return Err(ApiError::bad(
                "the mock engine serves one prompt per request",
                Some("prompt"),
            ));
        }
        match &items[0] {
            Value::String(text) => return encode(text),
            one => {
                if let Some(ids) = ids(one, vocab)? {
                    if ids.is_empty() {
                        return Err(ApiError::bad("You must pass at least one prompt", None));
                    }
                    return Ok(ids);
                }
            }
        }
    }
    Err(ApiError::validation(
        "1 validation error: Input should be a valid string or list",
        "body.prompt",
    ))
}

/// The chat prompt: `messages` through the chat template (or the built-in join).
fn chat_prompt(body: &Map<String, Value>, tok: &Tokenizer) -> Result<Vec<u32>, ApiError> {
    let Some(Value::Array(messages)) = body.get("messages") else {
        return Err(ApiError::validation(
            "1 validation error: messages: Field required",
            "body.messages",
        ));
    };
    let mut texts = Vec::with_capacity(messages.len());
    for m in messages {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n"),
            _ => String::new(),
        };
        texts.push((role.to_owned(), content));
    }
    let turns: Vec<Turn<'_>> = texts
        .iter()
        .map(|(role, content)| Turn { role, content })
        .collect();
    tok.encode_chat(&turns)
        .map_err(|e| ApiError::bad(e.to_string(), Some("messages")))
}

/// Read a completion (`chat` false) or chat request.
pub fn parse(
    body: &[u8],
    chat: bool,
    tok: &Tokenizer,
    limits: &Limits<'_>,
) -> Result<Parsed, ApiError> {
    let body = object(body)?;
    if let Some(model) = body.get("model").and_then(Value::as_str) {
        if model != limits.model {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!(
                    "The model `{model}` does not exist. Valid aliases: {}.",
                    limits.model
                ),
                kind: "NotFoundError",
                param: Some("model".into()),
            });
        }
    }
    let prompt = if chat {
        chat_prompt(&body, tok)?
    } else {
        prompt(&body, tok, limits.vocab_size)?
    };
    let len = limits.max_model_len;
    if prompt.len() >= len {
        return Err(ApiError::bad(
            format!("This model's maximum context length is {len} tokens. However, your request has {} input tokens. Please reduce the length of the input messages.", prompt.len()),
            Some("input_tokens"),
        ));
    }
    let key = if chat && body.contains_key("max_completion_tokens") {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let max_tokens = match body.get(key) {
        None | Some(Value::Null) => len - prompt.len(),
        Some(v) => {
            let n = v.as_i64().ok_or_else(|| {
                ApiError::validation(
                    "1 validation error: Input should be a valid integer",
                    &format!("body.{key}"),
                )
            })?;
            if n < 1 {
                return Err(ApiError::bad(
                    format!("{key} must be at least 1, got {n}. (parameter={key}, value={n})"),
                    Some(key),
                ));
            }
            if n as u64 > len as u64 {
                return Err(ApiError::bad(
                    format!("{key}={n} cannot be greater than max_model_len={len}. Please request fewer output tokens. (parameter={key}, value={n})"),
                    Some(key),
                ));
            }
            (n as usize).min(len - prompt.len())
        }
    };
    let flag = |k: &str| body.get(k).and_then(Value::as_bool).unwrap_or(false);
    let stream = flag("stream");
    let options = body.get("stream_options").filter(|v| !v.is_null());
    if options.is_some() && !stream {
        return Err(ApiError::bad(
            "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
            Some("stream_options"),
        ));
    }
    let include_usage = options
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let stop_token_ids = body
        .get("stop_token_ids")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|v| u32::try_from(v.as_u64()?).ok())
                .collect()
        })
        .unwrap_or_default();
    Ok(Parsed {
        prompt,
        max_tokens: max_tokens.max(1),
        stream,
        include_usage,
        return_token_ids: flag("return_token_ids"),
        stop_token_ids,
        kv_params: match body.get("kv_transfer_params") {
            Some(Value::Object(m)) => Some(m.clone()),
            _ => None,
        },
    })
}

/// A decode leg's params as vLLM's NixlConnector takes them: a pull only if
/// `do_remote_prefill` and `remote_block_ids` non-empty, `remote_engine_id`,
/// `remote_request_id`, `remote_host`, `remote_port` all present; the side channel to dial.
pub fn pull_of(params: &Map<String, Value>, prompt_len: usize) -> Option<(Transfer, String)> {
    if params.get("do_remote_prefill").and_then(Value::as_bool) != Some(true) {
        return None;
    }
    let blocks = params.get("remote_block_ids")?.as_array()?;
    let any_block = blocks
        .iter()
        .any(|g| g.as_array().is_some_and(|g| !g.is_empty()));
    params.get("remote_engine_id")?.as_str()?;
    params.get("remote_request_id")?.as_str()?;
    let host = params.get("remote_host")?.as_str()?;
    let port = params.get("remote_port")?.as_u64()?;
    if !any_block {
        return None;
    }
    let num = |k: &str| params.get(k).and_then(Value::as_u64).map(|n| n as usize);
    let tokens = num("remote_num_tokens")
        .unwrap_or(prompt_len)
        .min(prompt_len);
    let cached_tokens = num("remote_prefill_cached_tokens").unwrap_or(0);
    let side = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    Some((
        Transfer::Pull {
            tokens,
            cached_tokens,
        },
        side,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits<'static> {
        Limits {
            model: "m",
            max_model_len: 100,
            vocab_size: 1024,
        }
    }

    #[test]
    fn prompts_of_every_shape_and_their_errors() {
        let tok = Tokenizer::Words;
        let p = |b: &str| parse(b.as_bytes(), false, &tok, &limits());
        assert_eq!(
            p(r#"{"prompt":[5,6],"max_tokens":3}"#).unwrap().prompt,
            [5, 6]
        );
        assert_eq!(
            p(r#"{"prompt":[[5,6]],"max_tokens":3}"#).unwrap().prompt,
            [5, 6]
        );
        assert!(!p(r#"{"prompt":"hi there"}"#).unwrap().prompt.is_empty());
        assert_eq!(
            p(r#"{"prompt":[5],"extra":{"x":1}}"#).unwrap().max_tokens,
            99
        );
        for (body, status, param) in [
            ("nope", 400, Some("body.0")),
            (r#"{"prompt":[5],"model":"x"}"#, 404, Some("model")),
            (r#"{"max_tokens":2}"#, 400, Some("prompt")),
            (r#"{"prompt":[]}"#, 400, None),
            (r#"{"prompt":[5,99999]}"#, 400, None),
            (r#"{"prompt":[5],"max_tokens":0}"#, 400, Some("max_tokens")),
            (
                r#"{"prompt":[5],"max_tokens":"x"}"#,
                400,
                Some("body.max_tokens"),
            ),
            (
                r#"{"prompt":[5],"max_tokens":101}"#,
                400,
                Some("max_tokens"),
            ),
            (
                r#"{"prompt":[5],"stream_options":{}}"#,
                400,
                Some("stream_options"),
            ),
            (r#"{"prompt":{"a":1}}"#, 400, Some("body.prompt")),
        ] {
            let e = p(body).unwrap_err();
            assert_eq!(
                (e.status.as_u16(), e.param.as_deref()),
                (status, param),
                "{body}"
            );
        }
    }

    #[test]
    fn a_pull_needs_every_field_vllm_needs() {
        let full: Map<String, Value> = serde_json::from_str(r#"{"do_remote_prefill":true,"remote_block_ids":[[1,2]],"remote_engine_id":"e","remote_request_id":"r","remote_host":"127.0.0.1","remote_port":9,"remote_num_tokens":70,"remote_prefill_cached_tokens":32}"#).unwrap();
        let (t, side) = pull_of(&full, 64).unwrap();
        assert_eq!(
            t,
            Transfer::Pull {
                tokens: 64,
                cached_tokens: 32
            }
        );
        assert_eq!(side, "127.0.0.1:9");
        for drop in [
            "remote_engine_id",
            "remote_host",
            "remote_port",
            "do_remote_prefill",
        ] {
            let mut m = full.clone();
            m.remove(drop);
            assert!(pull_of(&m, 64).is_none(), "{drop}");
        }
        let mut empty = full.clone();
        empty.insert("remote_block_ids".into(), json!([[]]));
        assert!(pull_of(&empty, 64).is_none());
    }
}
