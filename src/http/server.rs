//! The axum application: routes, request handling, SSE, metrics.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, MethodRouter};
use axum::Json;
use tokio::net::TcpListener;

use super::completion::*;
use super::conn::ServeSummary;
use super::openai::ApiError;
use super::state::*;
use crate::hop::{PrefillHop, Readiness};

/// The OpenAI-compatible application over `hop` (see `docs/frontend.md` for the surface).
///
/// Served by another server than [`serve`], it has no connection timeouts, cap or drain of its
/// own, and its request deadline starts when a handler starts.
pub fn app(hop: Arc<PrefillHop>, config: HttpConfig) -> axum::Router {
    App::new(hop, config).routes()
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

impl App {
    pub(super) fn routes(&self) -> axum::Router {
        // One row per route: its path, its handler, its name (in errors and metrics) and the
        // methods it takes; any other method gets a 405 naming them.
        let table: [(&str, MethodRouter<App>, &'static str, &'static str); 6] = [
            ("/v1/completions", post(completions), "completions", "POST"),
            (
                "/v1/chat/completions",
                post(chat_completions),
                "chat_completions",
                "POST",
            ),
            ("/v1/models", get(models), "models", "GET, HEAD"),
            ("/health", get(health), "health", "GET, HEAD"),
            ("/ready", get(ready), "ready", "GET, HEAD"),
            ("/metrics", get(metrics_text), "metrics", "GET, HEAD"),
        ];
        let router = table
            .into_iter()
            .fold(
                axum::Router::new(),
                |router, (path, handler, name, allow)| {
                    router.route(path, handler.fallback(wrong_method_on(name, allow)))
                },
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
    let warnings = app.0.hop.warnings();
    let body = |ready: bool, reason: Option<String>| {
        serde_json::json!({
            "ready": ready,
            "reason": reason,
            "warnings": warnings,
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
