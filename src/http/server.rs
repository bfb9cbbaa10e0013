//! The axum application: routes, request handling, SSE, metrics.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode, Uri};
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

use super::openai::{ApiError, ChatRequest, CompletionRequest, Content, Prompt, Usage};
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
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            model: "mock-llm".to_owned(),
            body_limit: 1 << 20,
            request_timeout: Duration::from_secs(30),
            default_max_tokens: 16,
            max_tokens_limit: 4096,
        }
    }
}

type Labels = Vec<(&'static str, String)>;

/// The frontend's own counters (exported next to the router's).
#[derive(Debug, Default)]
struct HttpMetrics {
    requests: Family<Labels, Counter>,
    in_flight: Gauge,
    disconnects: Counter,
}

struct Inner {
    hop: Arc<PrefillHop>,
    config: HttpConfig,
    metrics: HttpMetrics,
    registry: Registry,
    next_id: AtomicU64,
}

#[derive(Clone)]
struct App(Arc<Inner>);

/// The OpenAI-compatible application over `hop` (see `docs/frontend.md` for the surface).
pub fn router(hop: Arc<PrefillHop>, config: HttpConfig) -> axum::Router {
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
            "streams whose client went away before the end (the request is cancelled at its worker)",
            metrics.disconnects.clone(),
        );
    }
    let app = App(Arc::new(Inner {
        hop,
        config,
        metrics,
        registry,
        next_id: AtomicU64::new(0),
    }));
    axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .with_state(app)
}

/// Serve [`router`] on `listener` until `shutdown` completes (then in-flight requests finish
/// and the call returns). Connections get `TCP_NODELAY` (tokens are small writes).
pub async fn serve(
    listener: TcpListener,
    hop: Arc<PrefillHop>,
    config: HttpConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt;
    let listener = listener.tap_io(|tcp| {
        if let Err(error) = tcp.set_nodelay(true) {
            tracing::debug!(%error, "setting TCP_NODELAY");
        }
    });
    axum::serve(listener, router(hop, config))
        .with_graceful_shutdown(shutdown)
        .await
}

impl App {
    fn count(&self, route: &'static str, status: StatusCode) {
        self.0
            .metrics
            .requests
            .get_or_create(&vec![
                ("route", route.to_owned()),
                ("status", status.as_u16().to_string()),
            ])
            .inc();
    }

    fn answer(&self, route: &'static str, response: Response) -> Response {
        self.count(route, response.status());
        response
    }
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
    session: Option<String>,
}

async fn completions(State(app): State<App>, request: Request) -> Response {
    let response = app.generate(Kind::Completion, request).await;
    app.answer(Kind::Completion.route(), response)
}

async fn chat_completions(State(app): State<App>, request: Request) -> Response {
    let response = app.generate(Kind::Chat, request).await;
    app.answer(Kind::Chat.route(), response)
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
    async fn body(&self, request: Request) -> Result<axum::body::Bytes, ApiError> {
        let limit = self.0.config.body_limit;
        let declared = request
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(ApiError::too_large(limit));
        }
        match Limited::new(request.into_body(), limit).collect().await {
            Ok(collected) => Ok(collected.to_bytes()),
            Err(error) if error.downcast_ref::<LengthLimitError>().is_some() => {
                Err(ApiError::too_large(limit))
            }
            Err(error) => Err(ApiError::bad_request(
                "body_unreadable",
                format!("reading the request body: {error}"),
            )),
        }
    }

    fn max_tokens(&self, asked: Option<u32>) -> Result<u32, ApiError> {
        let n = asked.unwrap_or(self.0.config.default_max_tokens);
        if n == 0 || n > self.0.config.max_tokens_limit {
            return Err(ApiError::bad_request(
                "invalid_max_tokens",
                format!(
                    "max_tokens must be between 1 and {}, got {n}",
                    self.0.config.max_tokens_limit
                ),
            ));
        }
        Ok(n)
    }

    fn parse(&self, kind: Kind, body: &[u8]) -> Result<Parsed, ApiError> {
        match kind {
            Kind::Completion => {
                let request: CompletionRequest =
                    serde_json::from_slice(body).map_err(|e| json_error(&e))?;
                let token_ids = match request.prompt {
                    Prompt::Text(text) => tokenize(&text),
                    Prompt::Tokens(ids) => ids,
                    Prompt::Texts(texts) => match <[String; 1]>::try_from(texts) {
                        Ok([text]) => tokenize(&text),
                        Err(_) => {
                            return Err(ApiError::bad_request(
                                "unsupported_prompt",
                                "exactly one prompt per request is supported",
                            ))
                        }
                    },
                };
                Ok(Parsed {
                    model: request.model,
                    token_ids,
                    max_tokens: self.max_tokens(request.max_tokens)?,
                    stream: request.stream,
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
                    max_tokens: self
                        .max_tokens(request.max_completion_tokens.or(request.max_tokens))?,
                    stream: request.stream,
                    session: request.user,
                })
            }
        }
    }

    async fn generate(&self, kind: Kind, request: Request) -> Response {
        let in_flight = InFlight::new(&self.0.metrics.in_flight);
        let timeout = self.0.config.request_timeout;
        let deadline = Instant::now() + timeout;
        let headers = request.headers().clone();
        let parsed = match self.body(request).await.and_then(|b| self.parse(kind, &b)) {
            Ok(parsed) => parsed,
            Err(error) => return error.into_response(),
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
        };
        let worker = first.prefill.as_ref().map(|p| p.worker);
        let mut response = if parsed.stream {
            let events = sse_events(
                reply,
                first,
                stream,
                deadline,
                timeout,
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
        if !self.finished {
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
    deadline: Instant,
    timeout: Duration,
    sent_any: bool,
    finished: bool,
    disconnect: Disconnect,
}

fn event(value: &serde_json::Value) -> Event {
    Event::default().data(value.to_string())
}

/// The SSE events of one reply: a chunk per response, a final chunk, `data: [DONE]`. An error
/// or the deadline mid-stream sends one `{"error": ...}` event and ends the stream (dropping the
/// decode stream cancels the request at the worker).
fn sse_events(
    reply: Reply,
    first: GenerateResponse,
    stream: DecodeStream,
    deadline: Instant,
    timeout: Duration,
    disconnect: Disconnect,
) -> impl futures_core::Stream<Item = Result<Event, std::convert::Infallible>> + Send {
    let state = SseState {
        reply,
        first: Some(first),
        stream,
        deadline,
        timeout,
        sent_any: false,
        finished: false,
        disconnect,
    };
    futures_util::stream::unfold(state, |mut s| async move {
        if s.finished {
            return None;
        }
        let item = match s.first.take() {
            Some(first) => Some(Ok(first)),
            None => match tokio::time::timeout_at(s.deadline, s.stream.next()).await {
                Ok(item) => item,
                Err(_) => {
                    s.finished = true;
                    s.disconnect.finished = true;
                    let error = ApiError::deadline(s.timeout).body();
                    return Some((Ok(event(&error)), s));
                }
            },
        };
        let out = match item {
            Some(Ok(response)) => {
                let text = text_of(&response.token_ids);
                let finish = finish_reason(response.finish);
                let chunk = s.reply.chunk(&text, !s.sent_any, finish);
                s.sent_any = true;
                if finish.is_some() {
                    // The next poll sends [DONE].
                    s.first = None;
                    s.stream = Box::pin(futures_util::stream::empty());
                }
                event(&chunk)
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
