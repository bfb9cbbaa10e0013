use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::net::TcpListener;

use super::*;
use crate::advert::ModelCard;
use crate::discovery::{
    EndpointId, Instance, InstanceId, MemoryConfig, MemoryDiscovery, Registration,
};
use crate::lifecycle::Lifecycle;
use crate::mock::{MockConfig, MockDecode, MockPrefill};
use crate::router::FallbackPolicy;
use crate::transport::{serve, Engine, ServerConfig, ServerHandle};

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
    let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .unwrap();
    let server = serve(listener, engine, ServerConfig::default()).unwrap();
    let instance = Instance {
        endpoint,
        instance_id: id,
        address: server.local_addr(),
    };
    let registration = discovery
        .register(instance, ModelCard::named("m"))
        .await
        .unwrap();
    (server, registration)
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

#[test]
fn readiness_rule_matches_the_fallback_policy() {
    use status::readiness;
    let wait = |then| FallbackPolicy::WaitUpTo {
        timeout: Duration::from_millis(1),
        then,
    };
    for lifecycle in [Lifecycle::Pending, Lifecycle::Unavailable] {
        assert!(readiness(lifecycle, true, FallbackPolicy::Decode, false, None).is_ready());
        assert!(readiness(
            lifecycle,
            true,
            wait(crate::router::AfterWait::Decode),
            false,
            None
        )
        .is_ready());
        for policy in [
            FallbackPolicy::Reject,
            wait(crate::router::AfterWait::Reject),
        ] {
            assert_eq!(
                readiness(lifecycle, true, policy, false, None),
                Readiness::NotReady(NotReady::PrefillNotActive { lifecycle })
            );
        }
    }
    assert!(readiness(Lifecycle::Active, true, FallbackPolicy::Reject, false, None).is_ready());
    assert_eq!(
        readiness(
            Lifecycle::Active,
            false,
            FallbackPolicy::Decode,
            false,
            None
        ),
        Readiness::NotReady(NotReady::NoDecodeSet)
    );
    assert_eq!(
        readiness(Lifecycle::Active, true, FallbackPolicy::Decode, true, None),
        Readiness::NotReady(NotReady::ShutDown)
    ); // Active with no reachable worker: ready only when the policy bypasses.
    assert_eq!(
        readiness(
            Lifecycle::Active,
            true,
            FallbackPolicy::Reject,
            false,
            Some(0)
        ),
        Readiness::NotReady(NotReady::NoReachablePrefill)
    );
    assert!(readiness(
        Lifecycle::Active,
        true,
        FallbackPolicy::Reject,
        false,
        Some(1)
    )
    .is_ready());
    assert!(readiness(
        Lifecycle::Active,
        true,
        FallbackPolicy::Decode,
        false,
        Some(0)
    )
    .is_ready());
}
