//! The axum application: routes, request handling, SSE, metrics.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode, Uri};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use futures_util::StreamExt;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::time::Instant;

use super::auth::ApiKeys;
use super::conn::{DropReason, RequestStart, ServeSummary};
use super::openai::{max_tokens_field, ApiError, ChatRequest, CompletionRequest, Content, Usage};
use super::tokenizer::{chat_prompt, render, tokenize, Turn};
use crate::hop::{PrefillHop, Readiness};
use crate::router::DecodeStream;
use crate::transport::{FinishReason, GenerateRequest, GenerateResponse};

/// Settings of the HTTP frontend.
#[derive(Clone, Debug)]
pub struct HttpConfig {
    /// The model name `/v1/models` lists (requests may name any model; it is echoed back).
    pub model: String,
    /// Largest request body accepted, in bytes; larger ones get 413.
    pub body_limit: usize,
    /// Deadline of one request, from its arrival to its last token; past it the answer is 504
    /// (or, once streaming, an error event) and both legs are cancelled.
    pub request_timeout: Duration,
    /// `max_tokens` when the request does not say.
    pub default_max_tokens: u32,
    /// Largest `max_tokens` accepted; more is a 400.
    pub max_tokens_limit: u32,
    /// A request's headers must arrive within this, from its first byte (or, on a new
    /// connection, from the accept); past it the connection is closed.
    pub header_timeout: Duration,
    /// A request's body must arrive within this once its headers did; past it the answer is
    /// 408 `body_timeout` and the connection is closed.
    pub body_timeout: Duration,
    /// A keep-alive connection with no request for this long is closed.
    pub idle_timeout: Duration,
    /// Most connections open at once; over it new connections wait in the listen backlog (not
    /// accepted) until one closes.
    pub max_connections: usize,
    /// After the shutdown signal: `/ready` answers 503 and requests are still served for this
    /// long (so load balancers see it and stop sending) before the listener closes.
    pub drain_delay: Duration,
    /// After the drain delay: how long in-flight requests may take to finish; then the
    /// connections still open are closed (and the log says how many).
    pub shutdown_timeout: Duration,
    /// The API keys a request must present as `Authorization: Bearer KEY`: every route but
    /// `/health`, `/ready` and (unless [`HttpConfig::metrics_need_key`]) `/metrics` answers
    /// 401 `invalid_api_key` without one. `None`: no key is asked for.
    pub api_keys: Option<ApiKeys>,
    /// With [`HttpConfig::api_keys`]: `/metrics` asks for a key too.
    pub metrics_need_key: bool,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            model: "mock-llm".to_owned(),
            body_limit: 1 << 20,
            request_timeout: Duration::from_secs(30),
            default_max_tokens: 16,
            max_tokens_limit: 4096,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(75),
            max_connections: 1024,
            drain_delay: Duration::from_secs(2),
            shutdown_timeout: Duration::from_secs(20),
            api_keys: None,
            metrics_need_key: false,
        }
    }
}

type Labels = Vec<(&'static str, String)>;

/// The frontend's own counters (exported next to the router's).
#[derive(Debug, Default)]
pub(super) struct HttpMetrics {
    requests: Family<Labels, Counter>,
    in_flight: Gauge,
    disconnects: Counter,
    /// Open connections.
    pub(super) connections: Gauge,
    dropped: Family<Labels, Counter>,
}

impl HttpMetrics {
    /// Count a connection the server closed on its own.
    pub(super) fn dropped(&self, reason: DropReason) {
        self.dropped
            .get_or_create(&vec![("reason", reason.label().to_owned())])
            .inc();
    }
}

struct Inner {
    hop: Arc<PrefillHop>,
    config: HttpConfig,
    metrics: HttpMetrics,
    registry: Registry,
    next_id: AtomicU64,
    /// The shutdown signal came: `/ready` answers 503.
    draining: AtomicBool,
    /// The shutdown bound passed: requests cut off now are not clients going away.
    closing: AtomicBool,
}

#[derive(Clone)]
pub(super) struct App(Arc<Inner>);

/// The OpenAI-compatible application over `hop` (see `docs/frontend.md` for the surface).
///
/// Served by another server than [`serve`], it has no connection timeouts, cap or drain of its
/// own, and its request deadline starts when a handler starts.
pub fn router(hop: Arc<PrefillHop>, config: HttpConfig) -> axum::Router {
    App::new(hop, config).router()
}

impl App {
    fn new(hop: Arc<PrefillHop>, config: HttpConfig) -> App {
        let metrics = HttpMetrics::default();
        let mut registry = Registry::default();
        hop.register_metrics(&mut registry);
        {
            let http = registry.sub_registry_with_prefix("prefill_router_http");
            http.register(
                "requests",
                "HTTP requests answered, by route and status",
                metrics.requests.clone(),
            );
            http.register(
                "in_flight",
                "HTTP requests being answered (streams included)",
                metrics.in_flight.clone(),
            );
            http.register(
                "client_disconnects",
                "requests whose client went away before their end (cancelled at their worker)",
                metrics.disconnects.clone(),
            );
            http.register(
                "connections",
                "open HTTP connections",
                metrics.connections.clone(),
            );
            http.register(
                "connections_dropped",
                "connections the server closed on its own (timeouts, shutdown bound), by reason",
                metrics.dropped.clone(),
            );
        }
        App(Arc::new(Inner {
            hop,
            config,
            metrics,
            registry,
            next_id: AtomicU64::new(0),
            draining: AtomicBool::new(false),
            closing: AtomicBool::new(false),
        }))
    }

    fn router(&self) -> axum::Router {
        let router = axum::Router::new()
            .route(
                "/v1/completions",
                post(completions).fallback(wrong_method_on("completions", "POST")),
            )
            .route(
                "/v1/chat/completions",
                post(chat_completions).fallback(wrong_method_on("chat_completions", "POST")),
            )
            .route(
                "/v1/models",
                get(models).fallback(wrong_method_on("models", "GET, HEAD")),
            )
            .route(
                "/health",
                get(health).fallback(wrong_method_on("health", "GET, HEAD")),
            )
            .route(
                "/ready",
                get(ready).fallback(wrong_method_on("ready", "GET, HEAD")),
            )
            .route(
                "/metrics",
                get(metrics_text).fallback(wrong_method_on("metrics", "GET, HEAD")),
            )
            .fallback(not_found);
        let router = if self.0.config.api_keys.is_some() {
            // Outermost, so it runs before routing decides on a 404 or a 405: without a key a
            // client learns nothing about the routes (as OpenAI answers).
            router.layer(axum::middleware::from_fn_with_state(
                self.clone(),
                require_key,
            ))
        } else {
            router
        };
        router.with_state(self.clone())
    }

    pub(super) fn metrics(&self) -> &HttpMetrics {
        &self.0.metrics
    }

    pub(super) fn config(&self) -> &HttpConfig {
        &self.0.config
    }

    /// The shutdown signal came: `/ready` turns 503.
    pub(super) fn start_draining(&self) {
        self.0.draining.store(true, Ordering::Relaxed);
    }

    /// The shutdown bound passed: what is cut off now is not counted as a client going away.
    pub(super) fn start_closing(&self) {
        self.0.closing.store(true, Ordering::Relaxed);
    }
}

/// The handler for a method `route` does not serve: OPTIONS is answered 204 with `Allow`,
/// anything else 405 with `Allow` and an OpenAI error body; both are counted.
fn wrong_method_on(
    route: &'static str,
    allow: &'static str,
) -> impl Fn(State<App>, Method) -> std::future::Ready<Response> + Clone + Send + Sync + 'static {
    move |State(app): State<App>, method: Method| {
        let allowed = format!("{allow}, OPTIONS");
        let mut response = if method == Method::OPTIONS {
            StatusCode::NO_CONTENT.into_response()
        } else {
            ApiError {
                status: StatusCode::METHOD_NOT_ALLOWED,
                kind: "invalid_request_error",
                code: "method_not_allowed",
                message: format!("{method} is not allowed here; use {allow}"),
            }
            .into_response()
        };
        if let Ok(value) = HeaderValue::from_str(&allowed) {
            response.headers_mut().insert(header::ALLOW, value);
        }
        std::future::ready(app.answer(route, response))
    }
}

/// Serve [`router`] on `listener` (HTTP/1.1) until `shutdown` completes, then stop in order:
/// `/ready` answers 503 while requests are still served for [`HttpConfig::drain_delay`]; the
/// listener closes and in-flight requests may finish for [`HttpConfig::shutdown_timeout`];
/// connections still open then are closed. Meanwhile each connection is held to the header,
/// body, idle and request timeouts of `config`, and at most [`HttpConfig::max_connections`]
/// are open at once. Connections get `TCP_NODELAY` (tokens are small writes).
pub async fn serve(
    listener: TcpListener,
    hop: Arc<PrefillHop>,
    config: HttpConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> ServeSummary {
    let app = App::new(hop, config);
    let router = app.router();
    super::conn::run(listener, app, router, shutdown).await
}

impl Inner {
    fn count(&self, route: &'static str, status: &str) {
        self.metrics
            .requests
            .get_or_create(&vec![
                ("route", route.to_owned()),
                ("status", status.to_owned()),
            ])
            .inc();
    }
}

impl App {
    fn count(&self, route: &'static str, status: StatusCode) {
        self.0.count(route, status.as_str());
    }

    fn answer(&self, route: &'static str, response: Response) -> Response {
        self.count(route, response.status());
        response
    }
}

/// The route label of `path` in the request counter.
fn route_of(path: &str) -> &'static str {
    match path {
        "/v1/completions" => "completions",
        "/v1/chat/completions" => "chat_completions",
        "/v1/models" => "models",
        "/health" => "health",
        "/ready" => "ready",
        "/metrics" => "metrics",
        _ => "other",
    }
}

/// The key check in front of every route: deny by default, so a route added later is
/// protected unless it is named here. Probes stay open (orchestrators carry no key), and so
/// does `/metrics` unless the config says otherwise. A refusal is counted with its route.
async fn require_key(
    State(app): State<App>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    let config = &app.0.config;
    let path = request.uri().path();
    let open = match path {
        "/health" | "/ready" => true,
        "/metrics" => !config.metrics_need_key,
        _ => false,
    };
    if !open {
        if let Some(keys) = &config.api_keys {
            if let Err(refused) = keys.authorizes(request.headers()) {
                return app.answer(route_of(path), refused.into_response());
            }
        }
    }
    next.run(request).await
}

async fn not_found(State(app): State<App>, uri: Uri) -> Response {
    app.answer("other", ApiError::not_found(uri.path()).into_response())
}

async fn health(State(app): State<App>) -> Response {
    app.answer(
        "health",
        Json(serde_json::json!({"status": "ok"})).into_response(),
    )
}

async fn ready(State(app): State<App>) -> Response {
    let status = app.0.hop.status();
    let body = |ready: bool, reason: Option<String>| {
        serde_json::json!({
            "ready": ready,
            "reason": reason,
            "lifecycle": status.lifecycle.to_string(),
            "decode": status.decode.as_ref().map(ToString::to_string),
            "target": status.target.as_ref().map(ToString::to_string),
        })
    };
    let response = match status.readiness {
        _ if app.0.draining.load(Ordering::Relaxed) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(body(
                false,
                Some("draining: serve is shutting down".to_owned()),
            )),
        )
            .into_response(),
        Readiness::Ready => (StatusCode::OK, Json(body(true, None))).into_response(),
        Readiness::NotReady(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(body(false, Some(why.to_string()))),
        )
            .into_response(),
    };
    app.answer("ready", response)
}

async fn models(State(app): State<App>) -> Response {
    let body = serde_json::json!({
        "object": "list",
        "data": [{
            "id": app.0.config.model,
            "object": "model",
            "created": 0,
            "owned_by": "prefill-router",
        }],
    });
    app.answer("models", Json(body).into_response())
}

async fn metrics_text(State(app): State<App>) -> Response {
    let mut text = String::new();
    let response = match prometheus_client::encoding::text::encode(&mut text, &app.0.registry) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    };
    app.answer("metrics", response)
}

/// Which endpoint a request came in on (the response shapes differ).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

impl Kind {
    fn route(self) -> &'static str {
        match self {
            Kind::Completion => "completions",
            Kind::Chat => "chat_completions",
        }
    }
}

/// A parsed request.
struct Parsed {
    model: String,
    token_ids: Vec<u32>,
    max_tokens: u32,
    stream: bool,
    include_usage: bool,
    session: Option<String>,
}

async fn completions(State(app): State<App>, request: Request) -> Response {
    app.answered(Kind::Completion, request).await
}

async fn chat_completions(State(app): State<App>, request: Request) -> Response {
    app.answered(Kind::Chat, request).await
}

fn json_error(error: &serde_json::Error) -> ApiError {
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
    async fn body(&self, request: Request, by: Instant) -> Result<axum::body::Bytes, ApiError> {
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

    fn max_tokens(&self, asked: Option<u32>) -> u32 {
        asked.unwrap_or(self.0.config.default_max_tokens)
    }

    fn parse(&self, kind: Kind, body: &[u8]) -> Result<Parsed, ApiError> {
        let limit = self.0.config.max_tokens_limit;
        match kind {
            Kind::Completion => {
                let request: CompletionRequest =
                    serde_json::from_slice(body).map_err(|e| json_error(&e))?;
                let max_tokens =
                    max_tokens_field("max_tokens", request.max_tokens.as_ref(), limit)?;
                let token_ids = super::openai::prompt_tokens(&request.prompt)?;
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
                let prompt = chat_prompt(request.messages.iter().zip(&texts).map(|(m, t)| Turn {
                    role: &m.role,
                    content: t,
                }));
                Ok(Parsed {
                    model: request.model,
                    token_ids: tokenize(&prompt),
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
    async fn answered(&self, kind: Kind, request: Request) -> Response {
        let mut pending = Unanswered {
            app: Arc::clone(&self.0),
            route: kind.route(),
            answered: false,
        };
        let response = self.generate(kind, request).await;
        pending.answered = true;
        self.answer(kind.route(), response)
    }

    async fn generate(&self, kind: Kind, request: Request) -> Response {
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
        let parsed = match self
            .body(request, body_by)
            .await
            .and_then(|b| self.parse(kind, &b))
        {
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
        let session = match super::session::session_key(&headers, parsed.session) {
            Ok(session) => session,
            Err(error) => return error.into_response(),
        };
        let prompt_tokens = parsed.token_ids.len();
        let mut request = GenerateRequest::new(parsed.token_ids, parsed.max_tokens);
        request.session = session;
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

/// A generation request not answered yet: dropped so (its handler future dropped because the
/// connection closed), it is counted with status 499 and, unless serve itself is closing it
/// at the end of the shutdown bound, as a client disconnect. Dropping the request future
/// cancelled whichever leg was running at its worker.
struct Unanswered {
    app: Arc<Inner>,
    route: &'static str,
    answered: bool,
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        self.app.count(self.route, "499");
        if !self.app.closing.load(Ordering::Relaxed) {
            self.app.metrics.disconnects.inc();
            tracing::info!(
                route = self.route,
                "client went away before the answer; request cancelled"
            );
        }
    }
}

/// A request's deadline, and its length (for the error message).
struct Limits {
    deadline: Instant,
    timeout: Duration,
}

/// One in-flight request in the gauge (until dropped; a stream carries it to its end).
struct InFlight(Gauge);

impl InFlight {
    fn new(gauge: &Gauge) -> Self {
        gauge.inc();
        InFlight(gauge.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Counts a stream dropped before its end (the client went away): dropping the decode stream
/// sends the worker a Cancel.
struct Disconnect {
    app: Arc<Inner>,
    finished: bool,
    _in_flight: InFlight,
}

impl Disconnect {
    fn new(app: Arc<Inner>, in_flight: InFlight) -> Self {
        Disconnect {
            app,
            finished: false,
            _in_flight: in_flight,
        }
    }
}

impl Drop for Disconnect {
    fn drop(&mut self) {
        if !self.finished && !self.app.closing.load(Ordering::Relaxed) {
            self.app.metrics.disconnects.inc();
            tracing::info!("client went away mid-stream; request cancelled");
        }
    }
}

/// What every chunk of one reply repeats.
struct Reply {
    kind: Kind,
    id: String,
    model: String,
    created: u64,
    /// `stream_options.include_usage`: every chunk has `"usage": null`, and a last chunk
    /// with empty `choices` carries the usage.
    include_usage: bool,
}

fn finish_reason(finish: Option<FinishReason>) -> Option<&'static str> {
    finish.map(|f| match f {
        FinishReason::Length => "length",
        FinishReason::Stop | FinishReason::Cancelled => "stop",
    })
}

fn text_of(tokens: &[u32]) -> String {
    tokens.iter().map(|&t| render(t)).collect()
}

impl Reply {
    fn chunk(&self, text: &str, first: bool, finish: Option<&'static str>) -> serde_json::Value {
        let mut chunk = self.bare_chunk(text, first, finish);
        if self.include_usage {
            chunk["usage"] = serde_json::Value::Null;
        }
        chunk
    }

    /// The final chunk of `stream_options.include_usage`: no choices, the usage.
    fn usage_chunk(&self, usage: Usage) -> serde_json::Value {
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

    fn bare_chunk(
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

    fn whole(&self, text: String, finish: &'static str, usage: Usage) -> serde_json::Value {
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

async fn collect(
    reply: Reply,
    first: GenerateResponse,
    mut stream: DecodeStream,
    deadline: Instant,
    timeout: Duration,
    prompt_tokens: usize,
) -> Response {
    let mut tokens = first.token_ids;
    let mut finish = first.finish;
    while finish.is_none() {
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Err(_) => return ApiError::deadline(timeout).into_response(),
            Ok(None) => break,
            Ok(Some(Err(error))) => return ApiError::from(&error).into_response(),
            Ok(Some(Ok(response))) => {
                tokens.extend_from_slice(&response.token_ids);
                finish = response.finish;
            }
        }
    }
    let usage = Usage {
        prompt_tokens,
        completion_tokens: tokens.len(),
        total_tokens: prompt_tokens + tokens.len(),
    };
    let body = reply.whole(
        text_of(&tokens),
        finish_reason(finish).unwrap_or("stop"),
        usage,
    );
    Json(body).into_response()
}

/// Where an SSE reply is.
struct SseState {
    reply: Reply,
    first: Option<GenerateResponse>,
    stream: DecodeStream,
    limits: Limits,
    prompt_tokens: usize,
    completion_tokens: usize,
    sent_any: bool,
    usage_sent: bool,
    finished: bool,
    disconnect: Disconnect,
}

fn event(value: &serde_json::Value) -> Event {
    Event::default().data(value.to_string())
}

/// The SSE events of one reply: a chunk per response, a final chunk, with
/// `stream_options.include_usage` a usage chunk, then `data: [DONE]`. An error or the deadline
/// mid-stream sends one `{"error": ...}` event and ends the stream (dropping the decode stream
/// cancels the request at the worker).
fn sse_events(
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
                let text = text_of(&response.token_ids);
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
                let usage = Usage {
                    prompt_tokens: s.prompt_tokens,
                    completion_tokens: s.completion_tokens,
                    total_tokens: s.prompt_tokens + s.completion_tokens,
                };
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
