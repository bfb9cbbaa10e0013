//! The hop as an embedder holds it: `PrefillHop` over memory discovery and mock workers (the
//! decode hop following the topology, readiness under policy `Reject`, shutdown).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use prefill_router::advert::ModelCard;
use prefill_router::discovery::{
    Discovery, EndpointId, InstanceId, MemoryConfig, MemoryDiscovery, Registration,
};
use prefill_router::lifecycle::Lifecycle;
use prefill_router::request::GenerateRequest;
use prefill_router::router::{FallbackPolicy, GenerateError, PrefillRouterConfig};
use prefill_router::snapshot::BypassReason;
use prefill_router::transport::{Engine, ServerConfig, ServerHandle};
use prefill_router::{HopStatus, NotReady, PrefillHop, PrefillHopConfig, Readiness};
use prefill_router_tools::mock::{spawn_registered, MockConfig, MockDecode, MockPrefill};

const WAIT: Duration = Duration::from_secs(15);

fn mock() -> MockConfig {
    MockConfig {
        block_size: 16,
        block_cost: Duration::ZERO,
        token_interval: Duration::ZERO,
        cache_blocks: 64,
    }
}

async fn worker(
    discovery: &Arc<dyn Discovery>,
    endpoint: EndpointId,
    id: InstanceId,
    engine: Arc<dyn Engine>,
) -> (ServerHandle, Registration) {
    let card = ModelCard::named("m");
    spawn_registered(
        discovery,
        endpoint,
        id,
        engine,
        card,
        ServerConfig::default(),
    )
    .await
    .unwrap()
}

fn memory() -> Arc<dyn Discovery> {
    Arc::new(MemoryDiscovery::new(MemoryConfig::default()))
}

/// The worker that decoded one request (the last response's prefill info names the prefill
/// worker; the decode worker's tokens are what we check here).
async fn one(hop: &PrefillHop) -> Result<Vec<u32>, GenerateError> {
    let stream = hop
        .generate(GenerateRequest::new((0..40).collect(), 3))
        .await?;
    let items: Vec<_> = stream.collect().await;
    Ok(items
        .into_iter()
        .flat_map(|r| r.unwrap().token_ids)
        .collect())
}

async fn until(hop: &PrefillHop, what: &str, mut check: impl FnMut(&HopStatus) -> bool) {
    let mut rx = hop.subscribe();
    tokio::time::timeout(WAIT, rx.wait_for(|s| check(s)))
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}: {:?}", hop.status()))
        .unwrap();
}

#[tokio::test]
async fn the_decode_hop_follows_the_topologys_decode_endpoint() {
    let discovery = memory();
    let hop = PrefillHop::start(Arc::clone(&discovery), "ns", PrefillHopConfig::default())
        .await
        .unwrap();
    assert_eq!(
        hop.ready(),
        Readiness::NotReady(NotReady::NoDecodeSet),
        "nothing registered yet"
    );
    assert!(matches!(one(&hop).await, Err(GenerateError::Decode(_)),));
    let a = EndpointId::new("ns", "decode-a", "generate");
    let decode_a = MockDecode::new(100, mock());
    let (server_a, reg_a) = worker(&discovery, a.clone(), 100, decode_a.clone()).await;
    until(&hop, "decode a", |s| s.decode.as_ref() == Some(&a)).await;
    assert_eq!(hop.ready(), Readiness::Ready, "policy Decode bypasses");
    assert_eq!(one(&hop).await.unwrap().len(), 3);
    assert_eq!(decode_a.stats().requests.load(Ordering::Relaxed), 1);

    // The decode set moves to another endpoint: the decode hop follows without a restart.
    reg_a.deregister().await.unwrap();
    let b = EndpointId::new("ns", "decode-b", "generate");
    let decode_b = MockDecode::new(200, mock());
    let (_server_b, _reg_b) = worker(&discovery, b.clone(), 200, decode_b.clone()).await;
    until(&hop, "decode b", |s| s.decode.as_ref() == Some(&b)).await;
    assert_eq!(one(&hop).await.unwrap().len(), 3);
    assert_eq!(decode_b.stats().requests.load(Ordering::Relaxed), 1);
    assert_eq!(decode_a.stats().requests.load(Ordering::Relaxed), 1);
    drop(server_a);
    hop.shutdown().await;
}

#[tokio::test]
async fn readiness_follows_the_prefill_lifecycle_under_policy_reject() {
    let discovery = memory();
    let config = PrefillHopConfig {
        router: PrefillRouterConfig {
            fallback: FallbackPolicy::Reject,
            build_timeout: Duration::from_secs(5),
            ..PrefillRouterConfig::default()
        },
        ..PrefillHopConfig::default()
    };
    let hop = PrefillHop::start(Arc::clone(&discovery), "ns", config)
        .await
        .unwrap();
    let decode_ep = EndpointId::new("ns", "decode", "generate");
    let _decode = worker(&discovery, decode_ep, 100, MockDecode::new(100, mock())).await;
    until(&hop, "a decode set", |s| s.decode.is_some()).await;
    assert!(matches!(
        hop.ready(),
        Readiness::NotReady(NotReady::PrefillNotActive { .. })
    ));
    assert!(matches!(
        one(&hop).await,
        Err(GenerateError::NotActivated { .. })
    ));

    let prefill_ep = EndpointId::new("ns", "prefill", "generate");
    let prefill = MockPrefill::new(1, mock());
    let (server, registration) = worker(&discovery, prefill_ep, 1, prefill.clone()).await;
    until(&hop, "ready", |s| s.readiness.is_ready()).await;
    assert_eq!(hop.status().lifecycle, Lifecycle::Active);
    assert_eq!(one(&hop).await.unwrap().len(), 3);
    assert_eq!(prefill.stats().requests.load(Ordering::Relaxed), 1);

    registration.deregister().await.unwrap();
    until(&hop, "not ready again", |s| !s.readiness.is_ready()).await;
    drop(server);
    hop.shutdown().await;
}

#[tokio::test]
async fn shutdown_stops_every_task_and_later_requests_fail_typed() {
    let discovery = memory();
    let hop = PrefillHop::start(Arc::clone(&discovery), "ns", PrefillHopConfig::default())
        .await
        .unwrap();
    let decode_ep = EndpointId::new("ns", "decode", "generate");
    let _decode = worker(&discovery, decode_ep, 100, MockDecode::new(100, mock())).await;
    until(&hop, "ready", |s| s.readiness.is_ready()).await;
    let mut rx = hop.subscribe();
    tokio::time::timeout(WAIT, hop.shutdown()).await.unwrap();
    assert_eq!(hop.router().tasks_alive(), 0);
    assert_eq!(hop.ready(), Readiness::NotReady(NotReady::ShutDown));
    assert!(
        rx.borrow_and_update().shut_down,
        "subscribers see the shutdown"
    );
    assert_eq!(
        one(&hop).await.unwrap_err(),
        GenerateError::NotActivated {
            reason: BypassReason::ShutDown
        }
    );
    assert_eq!(hop.decode().endpoint(), None, "decode feed released");
    // Idempotent.
    tokio::time::timeout(WAIT, hop.shutdown()).await.unwrap();
}
