//! What every part of the HTTP frontend shares: its settings, the application state behind
//! every handler (the hop, counters, registry, shutdown flags), and the guards one request
//! holds while it is answered (its deadline, the in-flight gauge, disconnect counting).
//!
//! A leaf of the module: the handlers (`completion`, `reply`, `server`) and the connection
//! layer (`conn`) import it, it imports none of them.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::Response;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::time::Instant;

use super::auth::ApiKeys;
use super::tokenizer::Tokenizer;
use crate::hop::PrefillHop;

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
    /// What turns prompts into token ids and output tokens into text: the built-in word
    /// tokenizer by default (mock engines), or a real model's (feature `model-tokenizer`).
    pub tokenizer: Tokenizer,
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
            tokenizer: Tokenizer::Words,
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

/// Why the connection layer closed a connection on its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum DropReason {
    /// The request's headers did not arrive within the header timeout.
    HeaderTimeout,
    /// A keep-alive connection stayed idle past the idle timeout.
    IdleTimeout,
    /// A request outlived its deadline (plus a grace for the handler's own answer): the client
    /// stopped reading its response.
    RequestTimeout,
    /// Still open at the end of the shutdown bound.
    Shutdown,
}

impl DropReason {
    /// The metric label.
    pub(super) fn label(self) -> &'static str {
        match self {
            DropReason::HeaderTimeout => "header_timeout",
            DropReason::IdleTimeout => "idle_timeout",
            DropReason::RequestTimeout => "request_timeout",
            DropReason::Shutdown => "shutdown",
        }
    }
}

/// Which endpoint a request came in on (the response shapes differ).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Completion,
    Chat,
}

impl Kind {
    pub(super) fn route(self) -> &'static str {
        match self {
            Kind::Completion => "completions",
            Kind::Chat => "chat_completions",
        }
    }
}

/// A generation request not answered yet: dropped so (its handler future dropped because the
/// connection closed), it is counted with status 499 and, unless serve itself is closing it
/// at the end of the shutdown bound, as a client disconnect. Dropping the request future
/// cancelled whichever leg was running at its worker.
pub(super) struct Unanswered {
    pub(super) app: Arc<Inner>,
    pub(super) route: &'static str,
    pub(super) answered: bool,
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
pub(super) struct Limits {
    pub(super) deadline: Instant,
    pub(super) timeout: Duration,
}

/// One in-flight request in the gauge (until dropped; a stream carries it to its end).
pub(super) struct InFlight(Gauge);

impl InFlight {
    pub(super) fn new(gauge: &Gauge) -> Self {
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
pub(super) struct Disconnect {
    pub(super) app: Arc<Inner>,
    pub(super) finished: bool,
    pub(super) _in_flight: InFlight,
}

impl Disconnect {
    pub(super) fn new(app: Arc<Inner>, in_flight: InFlight) -> Self {
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
