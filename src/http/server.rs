//! The axum application: routes, request handling, SSE, metrics.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

use super::auth::ApiKeys;
use super::completion::*;
use super::conn::{DropReason, ServeSummary};
use super::openai::ApiError;
use crate::hop::{PrefillHop, Readiness};

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
    pub(super) requests: Family<Labels, Counter>,
    pub(super) in_flight: Gauge,
    pub(super) disconnects: Counter,
    /// Open connections.
    pub(super) connections: Gauge,
    pub(super) dropped: Family<Labels, Counter>,
}

impl HttpMetrics {
    /// Count a connection the server closed on its own.
    pub(super) fn dropped(&self, reason: DropReason) {
        self.dropped
            .get_or_create(&vec![("reason", reason.label().to_owned())])
            .inc();
    }
}

pub(super) struct Inner {
    pub(super) hop: Arc<PrefillHop>,
    pub(super) config: HttpConfig,
    pub(super) metrics: HttpMetrics,
    pub(super) registry: Registry,
    pub(super) next_id: AtomicU64,
    /// The shutdown signal came: `/ready` answers 503.
    pub(super) draining: AtomicBool,
    /// The shutdown bound passed: requests cut off now are not clients going away.
    pub(super) closing: AtomicBool,
}

#[derive(Clone)]
pub(super) struct App(pub(super) Arc<Inner>);

/// The OpenAI-compatible application over `hop` (see `docs/frontend.md` for the surface).
///
/// Served by another server than [`serve`], it has no connection timeouts, cap or drain of its
/// own, and its request deadline starts when a handler starts.
pub fn app(hop: Arc<PrefillHop>, config: HttpConfig) -> axum::Router {
    App::new(hop, config).routes()
}

impl App {
    pub(super) fn new(hop: Arc<PrefillHop>, config: HttpConfig) -> App {
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

    pub(super) fn routes(&self) -> axum::Router {
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
pub(super) fn wrong_method_on(
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

/// Serve [`app`] on `listener` (HTTP/1.1) until `shutdown` completes, then stop in order:
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
    let router = app.routes();
    super::conn::run(listener, app, router, shutdown).await
}

impl Inner {
    pub(super) fn count(&self, route: &'static str, status: &str) {
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
    pub(super) fn count(&self, route: &'static str, status: StatusCode) {
        self.0.count(route, status.as_str());
    }

    pub(super) fn answer(&self, route: &'static str, response: Response) -> Response {
        self.count(route, response.status());
        response
    }
}

/// The route label of `path` in the request counter.
pub(super) fn route_of(path: &str) -> &'static str {
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
pub(super) async fn require_key(
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

pub(super) async fn not_found(State(app): State<App>, uri: Uri) -> Response {
    app.answer("other", ApiError::not_found(uri.path()).into_response())
}

pub(super) async fn health(State(app): State<App>) -> Response {
    app.answer(
        "health",
        Json(serde_json::json!({"status": "ok"})).into_response(),
    )
}

pub(super) async fn ready(State(app): State<App>) -> Response {
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

pub(super) async fn models(State(app): State<App>) -> Response {
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

pub(super) async fn metrics_text(State(app): State<App>) -> Response {
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
