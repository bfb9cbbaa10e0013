//! `POST /v1/completions` and `POST /v1/chat/completions`: the request run by the engine and
//! answered in vLLM 0.32's shapes (captured from the real server: the keys, the nulls, where
//! `system_fingerprint` and `usage` go in a stream, `data: [DONE]`).

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::app::App;
use super::engine::{Job, Outcome, Step, Transfer};
use super::request::{parse, pull_of, ApiError, Limits, Parsed};

/// `system_fingerprint`, as vLLM writes it (`vllm-<version>-<hash>`).
pub const FINGERPRINT: &str = "vllm-0.32.0-mockvllm";

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `usage` of a non-streamed answer.
fn usage(prompt: usize, out: &Outcome, chat: bool) -> Value {
    json!({
        "prompt_tokens": prompt,
        "total_tokens": prompt + out.tokens.len(),
        "completion_tokens": out.tokens.len(),
        "prompt_tokens_details": {
            "cached_tokens": out.cached_tokens,
            "created_cache_tokens": if chat { json!(0) } else { Value::Null },
            "multimodal_tokens": null
        },
        "completion_tokens_details": null
    })
}

/// `usage` of a stream's last chunk (vLLM leaves the nulls out there).
fn stream_usage(prompt: usize, out: &Outcome, chat: bool) -> Value {
    let mut details = json!({"cached_tokens": out.cached_tokens});
    if chat {
        details["created_cache_tokens"] = json!(0);
    }
    json!({
        "prompt_tokens": prompt,
        "total_tokens": prompt + out.tokens.len(),
        "completion_tokens": out.tokens.len(),
        "prompt_tokens_details": details
    })
}

/// What one request needs to write its answer.
struct Reply {
    app: Arc<App>,
    id: String,
    created: u64,
    chat: bool,
    parsed: Parsed,
    /// The prefill leg's `kv_transfer_params` comes from the outcome.
    produce: Option<String>,
}

impl Reply {
    fn kv_params(&self, out: &Outcome) -> Value {
        let Some(request_id) = &self.produce else {
            return Value::Null;
        };
        let app = &self.app;
        json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_block_ids": [out.block_ids],
            "remote_engine_id": app.engine_id,
            "remote_request_id": request_id,
            "remote_host": app.engine.config.host,
            "remote_port": app.side_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": self.parsed.prompt.len(),
            "remote_blocks_expiry_time": null,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": out.cached_tokens
        })
    }

    fn whole(&self, out: &Outcome) -> Value {
        let text = self
            .app
            .tokenizer
            .detokenizer(&self.parsed.prompt)
            .whole(&out.tokens);
        let ids = |v: &[u32]| {
            if self.parsed.return_token_ids {
                json!(v)
            } else {
                Value::Null
            }
        };
        let stop = out.stop_reason.map_or(Value::Null, |t| json!(t));
        let model = &self.app.engine.config.model;
        if self.chat {
            return json!({
                "id": self.id, "object": "chat.completion", "created": self.created, "model": model,
                "choices": [{"index": 0,
                    "message": {"role": "assistant", "content": text, "refusal": null, "annotations": null,
                                "audio": null, "function_call": null, "reasoning": null},
                    "logprobs": null, "finish_reason": out.finish_reason, "stop_reason": stop,
                    "token_ids": ids(&out.tokens), "routed_experts": null}],
                "service_tier": null, "system_fingerprint": FINGERPRINT,
                "usage": usage(self.parsed.prompt.len(), out, true),
                "prompt_logprobs": null, "prompt_token_ids": ids(&self.parsed.prompt), "prompt_text": null,
                "kv_transfer_params": self.kv_params(out), "ec_transfer_params": null, "metrics": null
            });
        }
        json!({
            "id": self.id, "object": "text_completion", "created": self.created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": null,
                "finish_reason": out.finish_reason, "stop_reason": stop,
                "token_ids": ids(&out.tokens), "prompt_logprobs": null,
                "prompt_token_ids": ids(&self.parsed.prompt), "routed_experts": null}],
            "service_tier": null, "system_fingerprint": FINGERPRINT,
            "usage": usage(self.parsed.prompt.len(), out, false),
            "kv_transfer_params": self.kv_params(out), "ec_transfer_params": null, "metrics": null
        })
    }

    /// One streamed chunk of `token` (`finish`: the last one).
    fn chunk(&self, text: String, token: u32, first: bool, finish: Option<&Outcome>) -> Value {
        let model = &self.app.engine.config.model;
        let tokens = if self.parsed.return_token_ids {
            json!([token])
        } else {
            Value::Null
        };
        let finish_reason = finish.map_or(Value::Null, |o| json!(o.finish_reason));
        let stop = finish
            .and_then(|o| o.stop_reason)
            .map_or(Value::Null, |t| json!(t));
        let mut chunk = if self.chat {
            let mut choice = json!({"index": 0, "delta": {"content": text}, "logprobs": null,
                                    "finish_reason": finish_reason});
            if finish.is_some() {
                choice["stop_reason"] = stop;
            }
            choice["token_ids"] = tokens;
            json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                   "model": model, "choices": [choice]})
        } else {
            let prompt_ids = if first && self.parsed.return_token_ids {
                json!(self.parsed.prompt)
            } else {
                Value::Null
            };
            json!({"id": self.id, "object": "text_completion", "created": self.created, "model": model,
                   "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason,
                                "stop_reason": stop, "prompt_token_ids": prompt_ids, "token_ids": tokens}]})
        };
        if finish.is_some() && !self.parsed.include_usage {
            chunk["system_fingerprint"] = json!(FINGERPRINT);
        }
        chunk
    }

    /// The chat stream's opening chunk (the assistant role).
    fn chat_head(&self) -> Value {
        json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
               "model": self.app.engine.config.model,
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null,
                            "finish_reason": null}],
               "prompt_token_ids": null, "prompt_text": null})
    }

    fn usage_chunk(&self, out: &Outcome) -> Value {
        let object = if self.chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        json!({"id": self.id, "object": object, "created": self.created,
               "model": self.app.engine.config.model, "choices": [],
               "usage": stream_usage(self.parsed.prompt.len(), out, self.chat),
               "system_fingerprint": FINGERPRINT})
    }
}

fn sse(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

/// The request id vLLM uses: the `X-Request-Id` header if any, else random hex.
fn request_id(app: &App, headers: &HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 256)
        .map_or_else(|| app.random_hex(16), str::to_owned)
}

/// `POST /v1/completions`.
pub async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    answer(app, headers, body, false).await
}

/// `POST /v1/chat/completions`.
pub async fn chat(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    answer(app, headers, body, true).await
}

async fn answer(app: Arc<App>, headers: HeaderMap, body: Bytes, chat: bool) -> Response {
    let arrived = Instant::now();
    let config = &app.engine.config;
    let limits = Limits {
        model: &config.model,
        max_model_len: config.max_model_len,
        vocab_size: config.vocab_size,
    };
    let parsed = match parse(&body, chat, &app.tokenizer, &limits) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let rid = request_id(&app, &headers);
    let mut transfer = Transfer::None;
    let mut produce = None;
    let params = parsed.kv_params.clone().unwrap_or_else(Map::new);
    if params.get("do_remote_decode").and_then(Value::as_bool) == Some(true)
        && config.kv_role.produces()
    {
        transfer = Transfer::Produce;
        produce = Some(format!("cmpl-{rid}-0-{}", app.random_hex(8)));
    } else if config.kv_role.consumes() {
        if let Some((pull, side)) = pull_of(&params, parsed.prompt.len()) {
            // The NIXL handshake: the prefill engine's side channel must answer.
            let dial = tokio::net::TcpStream::connect(side.as_str());
            match tokio::time::timeout(std::time::Duration::from_secs(5), dial).await {
                Ok(Ok(_)) => transfer = pull,
                _ => {
                    tracing::warn!(%side, "KV load failure: the prefill engine's side channel does not answer");
                    return ApiError {
                        status: StatusCode::INTERNAL_SERVER_ERROR,
                        message: "Internal server error".into(),
                        kind: "InternalServerError",
                        param: None,
                    }
                    .into_response();
                }
            }
        } else if params.get("do_remote_prefill").and_then(Value::as_bool) == Some(true) {
            tracing::warn!("Got invalid KVTransferParams: the prompt is recomputed");
        }
    }
    let prefix = if chat { "chatcmpl" } else { "cmpl" };
    let reply = Reply {
        id: format!("{prefix}-{rid}"),
        created: now_secs(),
        chat,
        produce,
        app: Arc::clone(&app),
        parsed,
    };
    let job = Job {
        prompt: reply.parsed.prompt.clone(),
        max_tokens: reply.parsed.max_tokens,
        stop_token_ids: reply.parsed.stop_token_ids.clone(),
        transfer,
    };
    if !reply.parsed.stream {
        return match app.engine.run(job, arrived, None).await {
            Some(out) => axum::Json(reply.whole(&out)).into_response(),
            None => StatusCode::SERVICE_UNAVAILABLE.into_response(),
        };
    }
    let (tx, rx) = mpsc::channel::<Step>(16);
    let engine = Arc::clone(&app.engine);
    tokio::spawn(async move {
        if let Some(out) = engine.run(job, arrived, Some(&tx)).await {
            let _ = tx.send(Step::Done(out)).await;
        }
    });
    stream_body(reply, rx)
}

/// The SSE body: a chunk per token, the last one held until the outcome says how it finished.
fn stream_body(reply: Reply, rx: mpsc::Receiver<Step>) -> Response {
    let decoder = reply.app.tokenizer.detokenizer(&reply.parsed.prompt);
    struct S {
        reply: Reply,
        rx: mpsc::Receiver<Step>,
        decoder: prefill_router::http::tokenizer::Detokenizer,
        held: Option<u32>,
        sent: usize,
        over: bool,
    }
    let state = S {
        reply,
        rx,
        decoder,
        held: None,
        sent: 0,
        over: false,
    };
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        if s.over {
            return None;
        }
        let mut out = Vec::new();
        if s.sent == 0 && s.held.is_none() && s.reply.chat {
            out.extend_from_slice(&sse(&s.reply.chat_head()));
        }
        match s.rx.recv().await {
            Some(Step::Token(t)) => {
                if let Some(prev) = s.held.replace(t) {
                    let text = s.decoder.push(&[prev], false);
                    out.extend_from_slice(&sse(&s.reply.chunk(text, prev, s.sent == 0, None)));
                    s.sent += 1;
                }
            }
            Some(Step::Done(outcome)) => {
                if let Some(last) = s.held.take() {
                    let text = s.decoder.push(&[last], true);
                    let chunk = s.reply.chunk(text, last, s.sent == 0, Some(&outcome));
                    out.extend_from_slice(&sse(&chunk));
                }
                if s.reply.parsed.include_usage {
                    out.extend_from_slice(&sse(&s.reply.usage_chunk(&outcome)));
                }
                out.extend_from_slice(b"data: [DONE]\n\n");
                s.over = true;
            }
            // The engine stopped without an outcome (shut down): the stream ends.
            None => return None,
        }
        Some((Ok::<_, std::convert::Infallible>(Bytes::from(out)), s))
    });
    (
        [(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")],
        Body::from_stream(stream),
    )
        .into_response()
}
