//! The HTTP server (axum, HTTP/1.1), its small endpoints, and starting and stopping an engine.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use prefill_router::http::Tokenizer;
use serde_json::{json, Value};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::app::App;
use super::completions::{chat, completions};
use super::config::MockVllmConfig;
use super::engine::Engine;
use super::events::{EventPorts, EventsError, Publisher, BUFFER_STEPS};
use super::request::ApiError;

/// Request bodies above this are refused (413) before they are read whole.
pub const BODY_LIMIT: usize = 4 * 1024 * 1024;

/// Why an engine did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The HTTP or side-channel listener could not bind.
    #[error("cannot listen on {addr}: {error}")]
    Listen {
        /// The address.
        addr: String,
        /// The OS's reason.
        error: std::io::Error,
    },
    /// The event sockets could not bind.
    #[error(transparent)]
    Events(#[from] EventsError),
    /// The tokenizer folder could not be loaded.
    #[error("--tokenizer: {0}")]
    Tokenizer(#[from] prefill_router::http::LoadError),
}

/// A running engine; stopped by [`MockVllm::shutdown`] or when dropped.
#[derive(Debug)]
pub struct MockVllm {
    /// The HTTP address it listens on.
    pub addr: SocketAddr,
    /// Its shared state (engine, counters, ports).
    pub app: Arc<App>,
    cancel: CancellationToken,
    server: Option<JoinHandle<()>>,
}

impl MockVllm {
    /// Start an engine of `config` on the current tokio runtime.
    pub async fn start(config: MockVllmConfig) -> Result<MockVllm, StartError> {
        let tokenizer = match &config.tokenizer {
            Some(dir) => Tokenizer::Model(Arc::new(
                prefill_router::http::ModelTokenizer::from_dir(dir)?,
            )),
            None => Tokenizer::Words,
        };
        let cancel = CancellationToken::new();
        let listen = |port: u16| {
            let addr = format!("{}:{port}", config.host);
            async move {
                tokio::net::TcpListener::bind(&addr)
                    .await
                    .map_err(|error| StartError::Listen { addr, error })
            }
        };
        let listener = listen(config.port).await?;
        let addr = listener.local_addr().map_err(|error| StartError::Listen {
            addr: config.host.clone(),
            error,
        })?;
        // The NIXL side channel: a decode engine's handshake dials it (and finds it closed
        // once this engine is gone, as with a real one).
        let side = listen(0).await?;
        let side_port = side.local_addr().map_or(0, |a| a.port());
        let side_cancel = cancel.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = side_cancel.cancelled() => return,
                    _ = side.accept() => {}
                }
            }
        });
        let (publisher, events) = match config.kv_events_port {
            Some(port) => {
                let (p, ports) = Publisher::start(
                    &config.host,
                    port,
                    config.kv_replay_port,
                    config.kv_topic.clone(),
                    config.block_size,
                    cancel.clone(),
                )
                .await?;
                (Some(p), Some(ports))
            }
            None => (None, None),
        };
        let mut app = App {
            engine_id: String::new(),
            side_port,
            events,
            tokenizer,
            ids: AtomicU64::new(0),
            // Engines started with one seed still get ids of their own.
            salt: config.seed ^ (u64::from(addr.port()) << 32),
            engine: Arc::new(Engine::new(config, publisher)),
        };
        let h = app.random_hex(32);
        app.engine_id = format!(
            "{}-{}-4{}-8{}-{}",
            &h[..8],
            &h[8..12],
            &h[13..16],
            &h[17..20],
            &h[20..32]
        );
        let app = Arc::new(app);
        let router = router(Arc::clone(&app));
        let stop = cancel.clone();
        let server = tokio::spawn(async move {
            let served = axum::serve(listener, router)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await;
            if let Err(error) = served {
                tracing::warn!(%error, "mock vLLM server stopped");
            }
        });
        tracing::info!(%addr, "mock vLLM engine listening");
        Ok(MockVllm {
            addr,
            app,
            cancel,
            server: Some(server),
        })
    }

    /// The engine.
    pub fn engine(&self) -> &Arc<Engine> {
        &self.app.engine
    }

    /// The event sockets' ports, if it publishes.
    pub fn events(&self) -> Option<&EventPorts> {
        self.app.events.as_ref()
    }

    /// Stop serving (open streams end) and wait for the server to finish.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        if let Some(server) = self.server.take() {
            let _ = server.await;
        }
    }
}

impl Drop for MockVllm {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/v1/completions/render", post(render_completion))
        .route("/detokenize", post(detokenize))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/kv_event_sources", get(kv_event_sources))
        .fallback(|| async {
            (
                StatusCode::NOT_FOUND,
                axum::Json(json!({"detail": "Not Found"})),
            )
        })
        .layer(axum::extract::DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(app)
}

async fn models(State(app): State<Arc<App>>) -> Response {
    let c = &app.engine.config;
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let root = c
        .tokenizer
        .as_ref()
        .map_or_else(|| c.model.clone(), |d| d.display().to_string());
    axum::Json(json!({"object": "list", "data": [{
        "id": c.model, "object": "model", "created": created, "owned_by": "vllm", "root": root,
        "parent": null, "max_model_len": c.max_model_len,
        "permission": [{"id": format!("modelperm-{}", app.random_hex(16)), "object": "model_permission",
            "created": created, "allow_create_engine": false, "allow_sampling": true,
            "allow_logprobs": true, "allow_search_indices": false, "allow_view": true,
            "allow_fine_tuning": false, "organization": "*", "group": null, "is_blocking": false}]
    }]}))
    .into_response()
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let text = app.engine.metrics.render(&app.engine.labels());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

fn json_body(body: &[u8]) -> Result<serde_json::Map<String, Value>, ApiError> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(m)) => Ok(m),
        _ => Err(ApiError::validation(
            "1 validation error: JSON decode error",
            "body.0",
        )),
    }
}

/// `POST /tokenize`: `prompt` (text) or `messages` (chat template) -> `{count, max_model_len,
/// tokens, token_strs}`.
async fn tokenize(State(app): State<Arc<App>>, body: Bytes) -> Response {
    let run = || -> Result<Value, ApiError> {
        let body = json_body(&body)?;
        let mut body_bytes = body.clone();
        // One parser for both: the prompt or messages as a completion or chat request would
        // give them (no output tokens asked).
        body_bytes.insert("max_tokens".into(), json!(1));
        let chat = body.contains_key("messages");
        let limits = super::request::Limits {
            model: &app.engine.config.model,
            max_model_len: usize::MAX,
            vocab_size: app.engine.config.vocab_size,
        };
        let text = serde_json::to_vec(&body_bytes).unwrap_or_default();
        let parsed = super::request::parse(&text, chat, &app.tokenizer, &limits)?;
        Ok(
            json!({"count": parsed.prompt.len(), "max_model_len": app.engine.config.max_model_len,
                  "tokens": parsed.prompt, "token_strs": null}),
        )
    };
    match run() {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/completions/render` (vLLM's render API, which vllm-router's KV-aware policy asks
/// for token ids: an HTTP pool is not tokenized in that router): the completion request as
/// the list of one `GenerateRequest` vLLM would run, `token_ids` being what KV routing needs.
async fn render_completion(State(app): State<Arc<App>>, body: Bytes) -> Response {
    let limits = super::request::Limits {
        model: &app.engine.config.model,
        max_model_len: app.engine.config.max_model_len,
        vocab_size: app.engine.config.vocab_size,
    };
    match super::request::parse(&body, false, &app.tokenizer, &limits) {
        Ok(parsed) => axum::Json(json!([{
            "request_id": app.random_hex(32),
            "token_ids": parsed.prompt,
            "sampling_params": {"max_tokens": parsed.max_tokens},
            "model": app.engine.config.model,
            "stream": parsed.stream,
        }]))
        .into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /detokenize`: `tokens` -> `{prompt}`.
async fn detokenize(State(app): State<Arc<App>>, body: Bytes) -> Response {
    let body = match json_body(&body) {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let tokens: Option<Vec<u32>> = body
        .get("tokens")
        .and_then(Value::as_array)
        .and_then(|a| a.iter().map(|v| u32::try_from(v.as_u64()?).ok()).collect());
    match tokens {
        Some(tokens) => {
            let text = app.tokenizer.detokenizer(&[]).whole(&tokens);
            axum::Json(json!({ "prompt": text })).into_response()
        }
        None => ApiError::validation("1 validation error: tokens: Field required", "body.tokens")
            .into_response(),
    }
}

/// `POST /reset_prefix_cache` (vLLM's dev-mode endpoint; vLLM 0.32 answers `{"success": bool}`).
async fn reset_prefix_cache(State(app): State<Arc<App>>) -> Response {
    app.engine.reset_prefix_cache();
    axum::Json(json!({"success": true})).into_response()
}

/// `GET /kv_event_sources`: the publisher config per data-parallel rank, as vLLM resolves it
/// (`{}` without events).
async fn kv_event_sources(State(app): State<Arc<App>>) -> Response {
    let Some(ports) = &app.events else {
        return axum::Json(json!({})).into_response();
    };
    axum::Json(json!({"0": {
        "enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": format!("tcp://*:{}", ports.events),
        "replay_endpoint": ports.replay.map(|p| format!("tcp://*:{p}")),
        "buffer_steps": BUFFER_STEPS, "hwm": 100_000, "max_queue_size": 100_000,
        "topic": app.engine.config.kv_topic,
    }}))
    .into_response()
}
