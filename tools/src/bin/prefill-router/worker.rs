//! `prefill-router worker`: a mock engine in its own process, registered in discovery (or, on
//! Kubernetes, found as a ready pod).

mod options;
mod watched;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prefill_router::advert::{ModelCard, RouterConfig, SelectionMode};
use prefill_router::discovery::{EndpointId, Instance, InstanceId, Registration};
use prefill_router::transport::{serve, serve_with_kv_events, Engine, KvEventSource, ServerConfig};
use prefill_router_tools::mock::{MockConfig, MockDecode, MockPrefill};
use tokio::net::TcpListener;

use crate::health::{HealthServer, Readiness};
use crate::store::{terminated, StoreSpec};
use crate::tls::TlsFlags;
use watched::Watched;

/// `worker` usage.
pub const USAGE: &str = "\
usage: prefill-router worker --role prefill|decode --discovery file://DIR|etcd://HOST:PORT[,...]|k8s://NS
                             --namespace NS [--card FILE] [--id N] [--listen 127.0.0.1:0]
                             [--health-listen ADDR (k8s:// only, required there)]

Runs a mock engine (no model, the timing shape of one) serving the request plane, registered
in discovery as endpoint NS/prefill/generate or NS/decode/generate (lease with heartbeats).
SIGTERM (or Ctrl-C) deregisters it, then drains: frontends are told on every connection to
send nothing new (they route new work to other workers, without counting a failure), the
requests in flight finish, and the worker exits once they have or --drain-timeout-ms passed
(a second signal stops at once). Prints one JSON line per event on stdout:
{\"event\":\"ready\",...} once serving and registered, {\"event\":\"cancelled\",...} each time a
request is cancelled before its end (the caller dropped it), {\"event\":\"stopped\",...} at exit;
with --print-requests also {\"event\":\"request\",...} as each request starts.

On Kubernetes (--discovery k8s://NS, feature `kubernetes`) the worker does not register and
never calls the API server (it needs no RBAC): frontends find it as a ready endpoint of a
Service labelled prefill-router/namespace=NS, prefill-router/component=prefill|decode and
prefill-router/endpoint=generate, with a port named request-plane, in a pod labelled
prefill-router/namespace=NS whose annotation prefill-router/card holds the card (JSON; give
the same file as --card through a downward-API volume). It serves GET /ready and GET /live on
--health-listen for the kubelet's probes. SIGTERM turns /ready to 503, waits
--unready-delay-ms, then drains as above. Its id defaults to the frontends' name for the pod,
the hash of $POD_UID (set it from metadata.uid). Manifests: deploy/kubernetes/, docs/kubernetes.md.

options:
  --role R               prefill or decode
  --discovery SPEC       file://DIR (a directory shared on this host) or
                         etcd://HOST:PORT[,HOST:PORT...] (the members of one etcd cluster)
                         or k8s://NAMESPACE (the Kubernetes namespace of the pod)
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
  --id N                 the instance id (default: the process id; on k8s:// the hash of
                         $POD_UID when set, as frontends name the pod)
  --listen ADDR          the request plane's address (default 127.0.0.1:0, any free port)
  --health-listen ADDR   k8s:// only (required there): GET /ready (200 while serving, 503
                         once stopping) and GET /live (200 until exit) for the kubelet
  --unready-delay-ms N   k8s:// only: on SIGTERM, how long /ready answers 503 before the
                         drain starts, for the probe and the EndpointSlice to reach every
                         frontend (default 5000)
  --block-size N         the mock's KV block size when no card is given (default 16)
  --block-cost-us N      prefill time per uncached block, microseconds (default 500)
  --token-interval-us N  decode time per token, microseconds (default 2000)
  --ttl-ms N             discovery lease TTL in milliseconds (default 10000; not k8s://)
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

/// Parsed `worker` options (parsed in `worker/options.rs`).
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    role: Role,
    discovery: StoreSpec,
    namespace: String,
    card: Option<std::path::PathBuf>,
    id: Option<InstanceId>,
    listen: SocketAddr,
    /// The readiness and liveness endpoint (k8s:// only, required there).
    health_listen: Option<SocketAddr>,
    /// On Kubernetes, how long readiness is withdrawn before the drain starts.
    unready_delay: Duration,
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

/// How long a stopping worker on Kubernetes answers 503 to readiness before draining, by
/// default: a few probe periods plus the EndpointSlice's way to every frontend's watch.
pub const DEFAULT_UNREADY_DELAY: Duration = Duration::from_secs(5);

/// The environment variable holding the pod's UID on Kubernetes (the manifests set it from
/// the downward API's `metadata.uid`).
pub const POD_UID_ENV: &str = "POD_UID";

impl WorkerOptions {
    /// Whether the worker runs on Kubernetes (found as a ready pod, not registered).
    fn on_kubernetes(&self) -> bool {
        matches!(self.discovery, StoreSpec::Kubernetes { .. })
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

/// The instance id a worker on Kubernetes takes when `--id` is not given: the id frontends
/// derive from its pod's UID (so `x-prefill-worker` and the logs name it the same on both
/// sides), or the process id without one. Fails in a binary built without `kubernetes`.
#[cfg(feature = "kubernetes")]
fn pod_id(pod_uid: Option<&str>) -> Result<InstanceId, String> {
    match pod_uid.filter(|uid| !uid.is_empty()) {
        Some(uid) => Ok(prefill_router::discovery::instance_id_of(uid)),
        None => {
            tracing::warn!(
                "${POD_UID_ENV} is not set: the worker's id is its process id, not the id \
                 frontends give its pod"
            );
            Ok(u64::from(std::process::id()))
        }
    }
}

#[cfg(not(feature = "kubernetes"))]
fn pod_id(_pod_uid: Option<&str>) -> Result<InstanceId, String> {
    Err("this binary was built without the `kubernetes` feature (cargo build -p prefill-router-tools --features kubernetes)".into())
}

/// Where the worker will be found, before it serves: a store to register in, or (Kubernetes)
/// the listener of the probes that make its pod ready.
enum Venue {
    Store(Arc<dyn prefill_router::discovery::Discovery>),
    Pod(TcpListener),
}

/// How frontends find the worker, and how it leaves.
enum Presence {
    /// A record in the store, held by a lease: deregistered on SIGTERM.
    Registered(Registration),
    /// Kubernetes: the pod's readiness, withdrawn on SIGTERM (the server answers the
    /// kubelet's probes until the process exits).
    Pod {
        readiness: Readiness,
        health: HealthServer,
    },
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
    let id = if options.on_kubernetes() {
        let derived = pod_id(std::env::var(POD_UID_ENV).ok().as_deref())?;
        options.id.unwrap_or(derived)
    } else {
        options.id.unwrap_or_else(|| u64::from(std::process::id()))
    };
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
    // On Kubernetes there is no store to open: the pod's readiness is the registration.
    let venue = match options.health_listen {
        Some(addr) if options.on_kubernetes() => Venue::Pod(
            TcpListener::bind(addr)
                .await
                .map_err(|e| format!("health endpoint: listening on {addr}: {e}"))?,
        ),
        // Parsing requires --health-listen with k8s:// (and refuses it elsewhere).
        _ => Venue::Store(
            options
                .discovery
                .open(options.ttl, &options.etcd_root)
                .await?,
        ),
    };
    let listener = TcpListener::bind(options.listen)
        .await
        .map_err(|e| format!("listening on {}: {e}", options.listen))?;
    let server = match events {
        Some(events) => serve_with_kv_events(listener, engine, server_config, events),
        None => serve(listener, engine, server_config),
    }
    .map_err(|e| format!("serving: {e}"))?;
    let endpoint = EndpointId::new(&options.namespace, options.role.component(), "generate");
    // Ready only once the request plane serves: the probe's first 200 puts the pod in its
    // Service's EndpointSlice.
    let presence = match venue {
        Venue::Store(discovery) => {
            let instance = Instance {
                endpoint: endpoint.clone(),
                instance_id: id,
                address: server.local_addr(),
            };
            let registration = discovery
                .register(instance, card)
                .await
                .map_err(|e| format!("registering: {e}"))?;
            Presence::Registered(registration)
        }
        Venue::Pod(listener) => {
            let readiness = Readiness::ready();
            let health = HealthServer::start(listener, readiness.clone())
                .map_err(|e| format!("health endpoint: {e}"))?;
            Presence::Pod { readiness, health }
        }
    };
    let health_addr = match &presence {
        Presence::Pod { health, .. } => Some(health.local_addr().to_string()),
        Presence::Registered(_) => None,
    };
    let discovery_kind = match options.discovery {
        StoreSpec::File(_) => "file",
        StoreSpec::Etcd(_) => "etcd",
        StoreSpec::Kubernetes { .. } => "kubernetes",
    };
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
            "discovery": discovery_kind,
            "health_addr": health_addr,
        })
    );
    terminated().await;
    // Leave first (frontends stop routing here), then drain: every connection is told, the
    // requests in flight finish, and a second signal cuts the wait short.
    let (left, _health, cut_short) = match presence {
        Presence::Registered(registration) => {
            let deregistered = registration.deregister().await;
            if let Err(error) = &deregistered {
                tracing::warn!(%error, "deregistering failed; draining anyway");
            }
            (
                deregistered.map_err(|e| format!("deregistering: {e}")),
                None,
                false,
            )
        }
        Presence::Pod { readiness, health } => {
            // Since Kubernetes 1.26 a terminating pod's endpoint is already `ready: false` in
            // its slice; the 503 covers older clusters and the probe's own view, and the delay
            // lets the change reach every frontend's watch before the drain frames do.
            readiness.withdraw();
            tracing::info!(delay = ?options.unready_delay, "readiness withdrawn");
            let cut = tokio::select! {
                () = tokio::time::sleep(options.unready_delay) => false,
                () = terminated() => true,
            };
            (Ok(()), Some(health), cut)
        }
    };
    let open = server.open_connections();
    let (report, interrupted) = if cut_short {
        (None, true)
    } else {
        tracing::info!(timeout = ?options.drain_timeout, "draining");
        let drain = server.drain(options.drain_timeout);
        tokio::pin!(drain);
        tokio::select! {
            report = &mut drain => (Some(report), false),
            () = terminated() => (None, true),
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
            // On Kubernetes: readiness withdrawn.
            "deregistered": left.is_ok(),
            "discovery": discovery_kind,
            "cancelled": cancelled.load(Ordering::Relaxed),
            "connections_at_stop": open,
            "drained": report.is_some_and(|r| r.complete()),
            "drain_ms": report.map_or(0, |r| u64::try_from(r.elapsed.as_millis()).unwrap_or(u64::MAX)),
            "cut_connections": report.map_or(open, |r| r.cut_connections),
        })
    );
    left
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::CliError;

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(String::from).collect()
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

    #[cfg(feature = "kubernetes")]
    #[test]
    fn a_k8s_worker_is_named_as_frontends_name_its_pod() {
        let uid = "0f3c2a9e-5b1d-4c7e-9a2f-6d8e1b4c3a57";
        assert_eq!(
            pod_id(Some(uid)),
            Ok(prefill_router::discovery::instance_id_of(uid))
        );
        let pid = u64::from(std::process::id());
        assert_eq!(pod_id(None), Ok(pid), "no POD_UID: the process id");
        assert_eq!(pod_id(Some("")), Ok(pid));
    }

    #[cfg(not(feature = "kubernetes"))]
    #[test]
    fn a_k8s_worker_needs_the_kubernetes_feature() {
        assert!(pod_id(Some("uid")).is_err_and(|e| e.contains("--features kubernetes")));
    }
}
