//! `prefill-router worker`: a mock engine in its own process, registered in discovery.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prefill_router::advert::{ModelCard, RouterConfig, SelectionMode};
use prefill_router::discovery::{EndpointId, Instance, InstanceId};
use prefill_router::request::{GenerateRequest, GenerateResponse};
use prefill_router::transport::{
    serve, serve_with_kv_events, Engine, EngineError, EngineStream, KvEventSource, ServerConfig,
};
use prefill_router_tools::mock::{MockConfig, MockDecode, MockPrefill};
use tokio::net::TcpListener;

use crate::args::{CliError, Flags};
use crate::store::{terminated, StoreSpec, DEFAULT_ETCD_ROOT};
use crate::tls::TlsFlags;

/// `worker` usage.
pub const USAGE: &str = "\
usage: prefill-router worker --role prefill|decode --discovery file://DIR|etcd://HOST:PORT[,...]
                             --namespace NS [--card FILE] [--id N] [--listen 127.0.0.1:0]

Runs a mock engine (no model, the timing shape of one) serving the request plane, registered
in discovery as endpoint NS/prefill/generate or NS/decode/generate (lease with heartbeats).
SIGTERM (or Ctrl-C) deregisters it, then drains: frontends are told on every connection to
send nothing new (they route new work to other workers, without counting a failure), the
requests in flight finish, and the worker exits once they have or --drain-timeout-ms passed
(a second signal stops at once). Prints one JSON line per event on stdout:
{\"event\":\"ready\",...} once serving and registered, {\"event\":\"cancelled\",...} each time a
request is cancelled before its end (the caller dropped it), {\"event\":\"stopped\",...} at exit;
with --print-requests also {\"event\":\"request\",...} as each request starts.

options:
  --role R               prefill or decode
  --discovery SPEC       file://DIR (a directory shared on this host) or
                         etcd://HOST:PORT[,HOST:PORT...] (the members of one etcd cluster)
  --namespace NS         the deployment's namespace
  --card FILE            the model card to advertise (JSON); default: model `mock-llm`,
                         block size --block-size, prefill cards advertise KV routing; its
                         router_config (mode, KV tuning, session_affinity_ttl_secs) is how a
                         prefill worker tells routers how to route to it
  --session-affinity-ttl-secs N
                         prefill only: advertise session affinity with this TTL (requests
                         with an x-session-id header or a `user` go to their session's
                         rendezvous worker, the same on every frontend; a session idle
                         less than N s counts as continuing); overrides the card's
                         router_config.session_affinity_ttl_secs (a card without a
                         router_config gets the default one with this TTL)
  --id N                 the instance id (default: the process id)
  --listen ADDR          the request plane's address (default 127.0.0.1:0, any free port)
  --block-size N         the mock's KV block size when no card is given (default 16)
  --block-cost-us N      prefill time per uncached block, microseconds (default 500)
  --token-interval-us N  decode time per token, microseconds (default 2000)
  --ttl-ms N             discovery lease TTL in milliseconds (default 10000)
  --drain-timeout-ms N   on SIGTERM, how long in-flight requests may take to finish before
                         their connections are closed (default 25000, under the 30 s grace
                         period orchestrators usually give)
  --etcd-root PREFIX     etcd key root (default prefill-router/v1/instances/)
  --print-requests       print a `request` event as each request starts
  --no-kv-events         a prefill worker does not publish its KV cache events (by default
                         it does, to the routers in KV mode, which then score it by what its
                         cache really holds: see docs/kv_events.md)
  --no-load-reports      do not publish load reports (by default the worker tells each KV-mode
                         router the prefill work the other routers hold here: see
                         docs/scale-out.md); its routers then count their own bookings only
  --tls-cert FILE        serve the request plane over TLS with this certificate chain (PEM,
                         leaf first; frontends dial the worker's IP address, so the leaf
                         needs that IP as a SAN unless they pass --tls-server-name)
  --tls-key FILE         the certificate's private key (PEM); with --tls-cert
  --tls-client-ca FILE   mutual TLS: accept only frontends presenting a certificate that
                         chains to this CA (PEM); others are closed at the handshake
                         (docs/transport.md, \"TLS\")";

/// The worker's role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A prefill worker.
    Prefill,
    /// A decode worker.
    Decode,
}

impl Role {
    fn component(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// Parsed `worker` options.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    role: Role,
    discovery: StoreSpec,
    namespace: String,
    card: Option<std::path::PathBuf>,
    id: Option<InstanceId>,
    listen: SocketAddr,
    block_size: u32,
    block_cost: Duration,
    token_interval: Duration,
    ttl: Duration,
    drain_timeout: Duration,
    etcd_root: String,
    print_requests: bool,
    kv_events: bool,
    load_reports: bool,
    session_affinity_ttl_secs: Option<u64>,
    tls: TlsFlags,
}

/// How long a stopping worker lets its in-flight requests finish, by default.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(25);

impl WorkerOptions {
    /// Parse the arguments after `worker`.
    pub fn parse(args: &[String]) -> Result<Self, CliError> {
        let mut role = None;
        let mut discovery = None;
        let mut namespace = None;
        let mut options = WorkerOptions {
            role: Role::Prefill,
            discovery: StoreSpec::File(std::path::PathBuf::new()),
            namespace: String::new(),
            card: None,
            id: None,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            block_size: 16,
            block_cost: Duration::from_micros(500),
            token_interval: Duration::from_micros(2000),
            ttl: Duration::from_secs(10),
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
            etcd_root: DEFAULT_ETCD_ROOT.to_owned(),
            print_requests: false,
            kv_events: true,
            load_reports: true,
            session_affinity_ttl_secs: None,
            tls: TlsFlags::default(),
        };
        let mut flags = Flags::new(args);
        while let Some(flag) = flags.next_flag() {
            match flag {
                "--role" => {
                    role = Some(match flags.value(flag)? {
                        "prefill" => Role::Prefill,
                        "decode" => Role::Decode,
                        other => {
                            return Err(CliError::Usage(format!(
                                "--role: expected prefill or decode, got `{other}`"
                            )))
                        }
                    })
                }
                "--discovery" => {
                    let spec = StoreSpec::parse(flag, flags.value(flag)?)?;
                    // On Kubernetes a worker does not register: it is found as a ready pod of
                    // its Service's EndpointSlice (docs/kubernetes.md).
                    if matches!(spec, StoreSpec::Kubernetes { .. }) {
                        return Err(CliError::Usage(
                            "--discovery: a worker on Kubernetes registers by being a ready pod \
                             (labels and the card annotation: docs/kubernetes.md); k8s:// is for \
                             serve"
                                .to_owned(),
                        ));
                    }
                    discovery = Some(spec);
                }
                "--namespace" => namespace = Some(flags.value(flag)?.to_owned()),
                "--card" => options.card = Some(flags.value(flag)?.into()),
                "--id" => options.id = Some(flags.parsed(flag)?),
                "--listen" => options.listen = flags.parsed(flag)?,
                "--block-size" => options.block_size = flags.parsed(flag)?,
                "--block-cost-us" => {
                    options.block_cost = Duration::from_micros(flags.parsed(flag)?)
                }
                "--token-interval-us" => {
                    options.token_interval = Duration::from_micros(flags.parsed(flag)?)
                }
                "--ttl-ms" => options.ttl = Duration::from_millis(flags.parsed(flag)?),
                "--drain-timeout-ms" => {
                    options.drain_timeout = Duration::from_millis(flags.parsed(flag)?)
                }
                "--etcd-root" => options.etcd_root = flags.value(flag)?.to_owned(),
                "--print-requests" => options.print_requests = true,
                "--no-kv-events" => options.kv_events = false,
                "--no-load-reports" => options.load_reports = false,
                "--session-affinity-ttl-secs" => {
                    options.session_affinity_ttl_secs = Some(flags.parsed(flag)?)
                }
                "--help" | "-h" => return Err(CliError::Help(USAGE.to_owned())),
                other if options.tls.take(other, &mut flags, false)? => {}
                other => return Err(CliError::Usage(format!("unknown worker option `{other}`"))),
            }
        }
        options.role = role.ok_or_else(|| CliError::Usage("worker needs --role".into()))?;
        options.tls.check_server()?;
        options.discovery =
            discovery.ok_or_else(|| CliError::Usage("worker needs --discovery".into()))?;
        options.namespace =
            namespace.ok_or_else(|| CliError::Usage("worker needs --namespace".into()))?;
        if options.namespace.is_empty() || options.namespace.contains('/') {
            return Err(CliError::Usage(
                "--namespace must be non-empty, without `/`".into(),
            ));
        }
        if options.ttl < Duration::from_millis(300) {
            return Err(CliError::Usage("--ttl-ms must be at least 300".into()));
        }
        if options.session_affinity_ttl_secs.is_some() && options.role != Role::Prefill {
            return Err(CliError::Usage(
                "--session-affinity-ttl-secs is for prefill workers (their card carries the routing)"
                    .into(),
            ));
        }
        Ok(options)
    }
}

/// Run the worker until SIGTERM.
pub async fn run(options: WorkerOptions) -> ExitCode {
    match worker(options).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("worker failed: {error}");
            ExitCode::FAILURE
        }
    }
}

fn default_card(role: Role, block_size: u32) -> ModelCard {
    ModelCard {
        kv_cache_block_size: block_size,
        router_config: (role == Role::Prefill).then(|| RouterConfig {
            router_mode: SelectionMode::KV,
            ..RouterConfig::default()
        }),
        ..ModelCard::named("mock-llm")
    }
}

/// `card` with its session-affinity TTL set to `ttl_secs` (when given), adding a default
/// router configuration if it has none.
fn with_session_ttl(mut card: ModelCard, ttl_secs: Option<u64>) -> ModelCard {
    if let Some(ttl) = ttl_secs {
        card.router_config
            .get_or_insert_with(RouterConfig::default)
            .session_affinity_ttl_secs = Some(ttl);
    }
    card
}

async fn worker(options: WorkerOptions) -> Result<(), String> {
    let card = match &options.card {
        Some(path) => {
            let bytes =
                std::fs::read(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
            ModelCard::from_json(&bytes).map_err(|e| format!("parsing {}: {e}", path.display()))?
        }
        None => default_card(options.role, options.block_size),
    };
    let card = with_session_ttl(card, options.session_affinity_ttl_secs);
    let id = options.id.unwrap_or_else(|| u64::from(std::process::id()));
    let mock = MockConfig {
        block_size: if card.kv_cache_block_size == 0 {
            options.block_size
        } else {
            card.kv_cache_block_size
        },
        block_cost: options.block_cost,
        token_interval: options.token_interval,
        cache_blocks: 8192,
    };
    // A prefill worker publishes its LRU's events (only routers in KV mode subscribe); the
    // incarnation is the start time, so a restarted process is recognised as cold.
    let mut events: Option<Arc<dyn KvEventSource>> = None;
    let engine: Arc<dyn Engine> = match options.role {
        Role::Prefill if options.kv_events => {
            let epoch = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
            let prefill = MockPrefill::with_kv_events(id, mock, epoch);
            events = Some(prefill.clone());
            prefill
        }
        Role::Prefill => MockPrefill::new(id, mock),
        Role::Decode => MockDecode::new(id, mock),
    };
    let cancelled = Arc::new(AtomicU64::new(0));
    let engine: Arc<dyn Engine> = Arc::new(Watched {
        inner: engine,
        id,
        cancelled: Arc::clone(&cancelled),
        started: options.print_requests.then(Arc::default),
    });
    // Read before registering: a bad certificate file fails the start, not every request.
    let server_config = ServerConfig {
        tls: options.tls.server().map_err(|e| format!("TLS: {e}"))?,
        load_reports: options.load_reports,
        ..ServerConfig::default()
    };
    let discovery = options
        .discovery
        .open(options.ttl, &options.etcd_root)
        .await?;
    let listener = TcpListener::bind(options.listen)
        .await
        .map_err(|e| format!("listening on {}: {e}", options.listen))?;
    let server = match events {
        Some(events) => serve_with_kv_events(listener, engine, server_config, events),
        None => serve(listener, engine, server_config),
    }
    .map_err(|e| format!("serving: {e}"))?;
    let endpoint = EndpointId::new(&options.namespace, options.role.component(), "generate");
    let instance = Instance {
        endpoint: endpoint.clone(),
        instance_id: id,
        address: server.local_addr(),
    };
    let registration = discovery
        .register(instance, card)
        .await
        .map_err(|e| format!("registering: {e}"))?;
    println!(
        "{}",
        serde_json::json!({
            "event": "ready",
            "role": options.role.component(),
            "id": id,
            "addr": server.local_addr().to_string(),
            "endpoint": endpoint.to_string(),
            "pid": std::process::id(),
            "tls": options.tls.enabled(false),
        })
    );
    terminated().await;
    // Deregister first (frontends stop routing here), then drain: every connection is told,
    // the requests in flight finish, and a second signal cuts the wait short.
    let deregistered = registration.deregister().await;
    if let Err(error) = &deregistered {
        tracing::warn!(%error, "deregistering failed; draining anyway");
    }
    tracing::info!(timeout = ?options.drain_timeout, "draining");
    let open = server.open_connections();
    let (report, interrupted) = {
        let drain = server.drain(options.drain_timeout);
        tokio::pin!(drain);
        tokio::select! {
            report = &mut drain => (Some(report), false),
            _ = terminated() => (None, true),
        }
    };
    if interrupted {
        tracing::warn!("second signal: stopping without finishing the drain");
    }
    println!(
        "{}",
        serde_json::json!({
            "event": "stopped",
            "id": id,
            "deregistered": deregistered.is_ok(),
            "cancelled": cancelled.load(Ordering::Relaxed),
            "connections_at_stop": open,
            "drained": report.is_some_and(|r| r.complete()),
            "drain_ms": report.map_or(0, |r| u64::try_from(r.elapsed.as_millis()).unwrap_or(u64::MAX)),
            "cut_connections": report.map_or(open, |r| r.cut_connections),
        })
    );
    deregistered.map_err(|e| format!("deregistering: {e}"))
}

/// An engine whose streams report being dropped before their end (a Cancel from the caller,
/// a deadline, or the connection closing).
struct Watched {
    inner: Arc<dyn Engine>,
    id: InstanceId,
    cancelled: Arc<AtomicU64>,
    /// Requests started, when each is printed (`--print-requests`).
    started: Option<Arc<AtomicU64>>,
}

impl Engine for Watched {
    fn prefill_work(&self, request: &GenerateRequest) -> u64 {
        self.inner.prefill_work(request)
    }

    fn generate(&self, request: GenerateRequest) -> EngineStream {
        if let Some(started) = &self.started {
            let total = started.fetch_add(1, Ordering::Relaxed) + 1;
            println!(
                "{}",
                serde_json::json!({"event": "request", "id": self.id, "total": total})
            );
        }
        Box::pin(WatchedStream {
            inner: self.inner.generate(request),
            id: self.id,
            ended: false,
            cancelled: Arc::clone(&self.cancelled),
        })
    }
}

struct WatchedStream {
    inner: EngineStream,
    id: InstanceId,
    ended: bool,
    cancelled: Arc<AtomicU64>,
}

impl futures_core::Stream for WatchedStream {
    type Item = Result<GenerateResponse, EngineError>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let polled = self.inner.as_mut().poll_next(cx);
        if let std::task::Poll::Ready(item) = &polled {
            match item {
                None | Some(Err(_)) => self.ended = true,
                Some(Ok(response)) if response.finish.is_some() => self.ended = true,
                Some(Ok(_)) => {}
            }
        }
        polled
    }
}

impl Drop for WatchedStream {
    fn drop(&mut self) {
        if !self.ended {
            let total = self.cancelled.fetch_add(1, Ordering::Relaxed) + 1;
            println!(
                "{}",
                serde_json::json!({"event": "cancelled", "id": self.id, "total": total})
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn a_worker_publishes_load_reports_unless_told_not_to() {
        let base = "--role prefill --discovery file:///tmp/x --namespace ns";
        let on = WorkerOptions::parse(&args(base));
        assert!(matches!(
            on,
            Ok(WorkerOptions {
                load_reports: true,
                ..
            })
        ));
        let off = WorkerOptions::parse(&args(&format!("{base} --no-load-reports")));
        assert!(matches!(
            off,
            Ok(WorkerOptions {
                load_reports: false,
                ..
            })
        ));
    }

    #[test]
    fn a_prefill_worker_publishes_kv_events_unless_told_not_to() {
        let base = "--role prefill --discovery file:///tmp/x --namespace ns";
        let on = WorkerOptions::parse(&args(base));
        assert!(matches!(
            on,
            Ok(WorkerOptions {
                kv_events: true,
                ..
            })
        ));
        let off = WorkerOptions::parse(&args(&format!("{base} --no-kv-events")));
        assert!(matches!(
            off,
            Ok(WorkerOptions {
                kv_events: false,
                ..
            })
        ));
    }

    #[test]
    fn worker_needs_role_discovery_and_namespace() {
        for line in [
            "--discovery file:///tmp/x --namespace ns",
            "--role prefill --namespace ns",
            "--role prefill --discovery file:///tmp/x",
            "--role both --discovery file:///tmp/x --namespace ns",
            "--role decode --discovery http://x --namespace ns",
            "--role decode --discovery file:///tmp/x --namespace ns --tls-cert c.pem",
            "--role decode --discovery file:///tmp/x --namespace ns --tls-client-ca ca.pem",
            "--role decode --discovery file:///tmp/x --namespace ns --tls-ca ca.pem",
        ] {
            assert!(
                matches!(WorkerOptions::parse(&args(line)), Err(CliError::Usage(_))),
                "{line}"
            );
        }
        let ok = WorkerOptions::parse(&args(
            "--role decode --discovery file:///tmp/x --namespace ns --id 7 --listen 127.0.0.1:0",
        ))
        .ok()
        .unwrap();
        assert_eq!((ok.role, ok.id), (Role::Decode, Some(7)));
    }

    #[test]
    fn the_session_affinity_ttl_flag_goes_into_the_prefill_card() {
        let base = "--role prefill --discovery file:///tmp/x --namespace ns";
        let parsed =
            WorkerOptions::parse(&args(&format!("{base} --session-affinity-ttl-secs 600")))
                .ok()
                .unwrap();
        assert_eq!(parsed.session_affinity_ttl_secs, Some(600));
        let card = with_session_ttl(default_card(Role::Prefill, 16), Some(600));
        let config = card.router_config.unwrap();
        assert_eq!(config.session_affinity_ttl_secs, Some(600));
        assert_eq!(config.router_mode, SelectionMode::KV, "the rest kept");
        let bare = with_session_ttl(ModelCard::named("m"), Some(5));
        assert_eq!(
            bare.router_config.unwrap().session_affinity_ttl_secs,
            Some(5)
        );
        assert!(with_session_ttl(ModelCard::named("m"), None)
            .router_config
            .is_none());
        let decode = "--role decode --discovery file:///tmp/x --namespace ns";
        assert!(matches!(
            WorkerOptions::parse(&args(&format!("{decode} --session-affinity-ttl-secs 5"))),
            Err(CliError::Usage(_))
        ));
        assert!(USAGE.contains("--session-affinity-ttl-secs"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_dropped_before_its_end_counts_as_cancelled() {
        let mock = MockConfig {
            token_interval: Duration::from_millis(1),
            ..MockConfig::default()
        };
        let cancelled = Arc::new(AtomicU64::new(0));
        let engine = Watched {
            inner: MockDecode::new(1, mock),
            id: 1,
            cancelled: Arc::clone(&cancelled),
            started: None,
        };
        let whole: Vec<_> = engine
            .generate(GenerateRequest::new(vec![1, 2, 3], 3))
            .collect()
            .await;
        assert_eq!(whole.len(), 3);
        assert_eq!(
            cancelled.load(Ordering::Relaxed),
            0,
            "finished streams are not"
        );
        let mut partial = engine.generate(GenerateRequest::new(vec![1, 2, 3], 10));
        partial.next().await.unwrap().unwrap();
        drop(partial);
        assert_eq!(cancelled.load(Ordering::Relaxed), 1);
    }
}
