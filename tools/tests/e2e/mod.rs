//! Shared parts of the end-to-end tests: discovery backends, loopback workers, a frontend.
#![allow(dead_code)] // each test binary uses a different subset

use std::sync::Arc;
use std::time::Duration;

use prefill_router::advert::{DecodeDefaults, ModelCard, SelectionMode};
use prefill_router::binding::DefaultBindingFactory;
use prefill_router::discovery::{
    Discovery, EndpointId, FileConfig, FileDiscovery, InstanceId, Registration,
};
use prefill_router::push::PushConfig;
use prefill_router::router::{PrefillRouter, PrefillRouterConfig};
use prefill_router::transport::{Engine, ServerConfig, ServerHandle};
use prefill_router::{PrefillHop, PrefillHopConfig};
use prefill_router_tools::mock::{spawn_registered, MockConfig, MockDecode, MockPrefill};

pub mod storm;

/// Bound on anything a test waits for (debug builds on a busy 2-core box).
pub const WAIT: Duration = Duration::from_secs(15);

pub const DECODE_ID: InstanceId = 100;

pub fn prefill_ep() -> EndpointId {
    EndpointId::new("e2e", "prefill", "generate")
}

/// A prefill endpoint the topology ignores (component `committed` is no worker kind): the
/// committed-targets scenario points the router at it itself, as an external controller.
pub fn committed_ep() -> EndpointId {
    EndpointId::new("e2e", "committed", "generate")
}

pub fn decode_ep() -> EndpointId {
    EndpointId::new("e2e", "decode", "generate")
}

pub fn card(mode: SelectionMode, block_size: u32) -> ModelCard {
    ModelCard::routed("m", mode, block_size)
}

pub fn mock(block_size: u32) -> MockConfig {
    MockConfig {
        block_size,
        block_cost: Duration::from_micros(100),
        token_interval: Duration::from_micros(100),
        cache_blocks: 1024,
    }
}

/// A file store in a fresh temporary directory.
pub fn file_store(ttl: Duration) -> (Arc<dyn Discovery>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let discovery = FileDiscovery::new(FileConfig::with_ttl(dir.path(), ttl));
    (Arc::new(discovery), dir)
}

/// An etcd store under a fresh key root, or `None` (with a notice) when
/// `PREFILL_ETCD_ENDPOINT` is unset outside CI; in CI a missing endpoint fails the test.
#[cfg(feature = "etcd")]
pub async fn etcd_store(ttl: Duration) -> Option<Arc<dyn Discovery>> {
    use prefill_router::discovery::{EtcdConfig, EtcdDiscovery};
    let endpoint = match std::env::var("PREFILL_ETCD_ENDPOINT") {
        Ok(e) if !e.is_empty() => e,
        _ => {
            assert!(
                std::env::var_os("CI").is_none(),
                "PREFILL_ETCD_ENDPOINT is not set in CI: source .ci/etcd.sh in .ci/run"
            );
            eprintln!("NOTICE: PREFILL_ETCD_ENDPOINT unset; skipping the etcd end-to-end test");
            return None;
        }
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let root = format!("prefill-e2e/{}-{nanos}/", std::process::id());
    let config = EtcdConfig::new([endpoint]).with_root(root).with_ttl(ttl);
    Some(Arc::new(EtcdDiscovery::connect(config).await.unwrap()))
}

/// A worker serving on loopback and registered in discovery.
pub struct Worker {
    pub server: ServerHandle,
    pub registration: Option<Registration>,
}

impl Worker {
    pub async fn deregister(&mut self) {
        if let Some(r) = self.registration.take() {
            r.deregister().await.unwrap();
        }
    }
}

pub async fn start_worker(
    discovery: &Arc<dyn Discovery>,
    endpoint: EndpointId,
    id: InstanceId,
    engine: Arc<dyn Engine>,
    card: ModelCard,
) -> Worker {
    let (server, registration) = spawn_registered(
        discovery,
        endpoint,
        id,
        engine,
        card,
        ServerConfig::default(),
    )
    .await
    .unwrap();
    Worker {
        server,
        registration: Some(registration),
    }
}

/// A prefill worker whose mock block size is the card's.
pub async fn start_prefill(
    discovery: &Arc<dyn Discovery>,
    id: InstanceId,
    card: ModelCard,
) -> Worker {
    let engine = MockPrefill::new(id, mock(card.kv_cache_block_size));
    start_worker(discovery, prefill_ep(), id, engine, card).await
}

/// A prefill worker on [`committed_ep`] (outside the watcher's topology).
pub async fn start_committed(
    discovery: &Arc<dyn Discovery>,
    id: InstanceId,
    card: ModelCard,
) -> Worker {
    let engine = MockPrefill::new(id, mock(card.kv_cache_block_size));
    start_worker(discovery, committed_ep(), id, engine, card).await
}

pub async fn start_decode(discovery: &Arc<dyn Discovery>) -> Worker {
    let engine = MockDecode::new(DECODE_ID, mock(16));
    start_worker(
        discovery,
        decode_ep(),
        DECODE_ID,
        engine,
        ModelCard::named("m"),
    )
    .await
}

pub type Router = PrefillRouter<DefaultBindingFactory>;

/// The frontend: a [`PrefillHop`] on namespace `e2e` (its watcher, router and decode hop).
pub struct Frontend {
    pub hop: PrefillHop,
    pub router: Arc<Router>,
}

pub fn hop_config() -> PrefillHopConfig {
    PrefillHopConfig {
        router: PrefillRouterConfig {
            name: "e2e".to_owned(),
            build_timeout: Duration::from_secs(5),
            ..PrefillRouterConfig::default()
        },
        decode: DecodeDefaults {
            router_mode: SelectionMode::RoundRobin,
            kv_router_config: None,
            block_size: 16,
            session_affinity_ttl: None,
        },
        push: PushConfig {
            request_timeout: Some(Duration::from_secs(5)),
            ..PushConfig::default()
        },
        ..PrefillHopConfig::default()
    }
}

pub async fn frontend(discovery: &Arc<dyn Discovery>) -> Frontend {
    let hop = PrefillHop::start(Arc::clone(discovery), "e2e", hop_config())
        .await
        .unwrap();
    // The decode worker is registered before the frontend starts: wait until the hop has it.
    let mut status = hop.subscribe();
    tokio::time::timeout(WAIT, status.wait_for(|s| s.decode.is_some()))
        .await
        .expect("the decode set is discovered")
        .unwrap();
    let router = Arc::clone(hop.router());
    Frontend { hop, router }
}

/// A prompt unlike any other (no shared prefix between calls).
pub fn prompt(seed: u32) -> Vec<u32> {
    (0..40)
        .map(|i| seed.wrapping_mul(7919).wrapping_add(i))
        .collect()
}

impl Frontend {
    /// One request through both hops; the prefill worker that served it (`None`: bypassed).
    pub async fn request(&self, seed: u32) -> Result<Option<InstanceId>, String> {
        use futures_util::StreamExt;
        let request = prefill_router::request::GenerateRequest::new(prompt(seed), 2);
        let mut stream = tokio::time::timeout(WAIT, self.hop.generate(request))
            .await
            .map_err(|_| "generate timed out".to_owned())?
            .map_err(|e| e.to_string())?;
        let first = tokio::time::timeout(WAIT, stream.next())
            .await
            .map_err(|_| "stream timed out".to_owned())?
            .ok_or("empty stream")?
            .map_err(|e| e.to_string())?;
        let worker = first.prefill.ok_or("no prefill info")?.worker;
        Ok((worker != DECODE_ID).then_some(worker))
    }

    /// Wait until `check` holds for the router, polling.
    pub async fn until(&self, what: &str, mut check: impl FnMut(&Router) -> bool) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while !check(&self.router) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub fn built(&self) -> u64 {
        self.hop
            .binding_stats()
            .built
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn outside_admission(&self) -> u64 {
        self.hop
            .binding_stats()
            .outside_admission
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}
