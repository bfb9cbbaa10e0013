//! Tests of the default binding factory (and, in `affinity`, of session affinity across
//! rebuilds).

mod affinity;

use super::*;
use crate::advert::{ModelCard, SelectionMode};
use crate::discovery::{Instance, MemoryConfig, MemoryDiscovery, Registration};
use crate::test_engine::TestPrefill;
use crate::transport::{serve, ServerConfig, ServerHandle};
use std::time::Duration;

fn rr_card() -> ModelCard {
    ModelCard::routed("m", SelectionMode::RoundRobin, 16)
}

async fn prefill_worker(
    discovery: &Arc<dyn Discovery>,
    endpoint: &EndpointId,
    id: InstanceId,
) -> (ServerHandle, Registration) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = serve(listener, TestPrefill::new(id), ServerConfig::default()).unwrap();
    let instance = Instance {
        endpoint: endpoint.clone(),
        instance_id: id,
        address: server.local_addr(),
    };
    let registration = discovery.register(instance, rr_card()).await.unwrap();
    (server, registration)
}

/// Prefills through a binding built for admission {1} while workers 1 and 2 both serve;
/// returns the stats of the factory.
async fn prefill_with(mutant: bool) -> Arc<BindingStats> {
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new(MemoryConfig::default()));
    let endpoint = EndpointId::new("t", "prefill", "generate");
    let _w1 = prefill_worker(&discovery, &endpoint, 1).await;
    let _w2 = prefill_worker(&discovery, &endpoint, 2).await;
    let mut factory = DefaultBindingFactory::new(Arc::clone(&discovery), FactoryConfig::default());
    if mutant {
        factory = factory.with_mutant(FactoryMutant::IgnoreAdmission);
    }
    let (_admit, admitted) = watch::channel(BTreeSet::from([1]));
    let target = WorkerSetTarget::new(
        WorkerSetTargetId::new("t/prefill/generate", 1),
        endpoint,
        Arc::new(rr_card()),
        admitted,
    );
    let binding = tokio::time::timeout(
        Duration::from_secs(10),
        factory.build(target, CancellationToken::new()),
    )
    .await
    .unwrap()
    .unwrap();
    // Both workers discovered, so a view that ignored admission would round-robin to 2.
    tokio::time::timeout(Duration::from_secs(10), discovery_settled(&binding, mutant))
        .await
        .unwrap();
    for i in 0..10u32 {
        binding
            .prefill(GenerateRequest::new(vec![i; 20], 1))
            .await
            .unwrap();
    }
    factory.stats()
}

async fn discovery_settled(binding: &PrefillBinding, mutant: bool) {
    let expected = if mutant { 2 } else { 1 };
    binding
        .dispatcher()
        .view()
        .wait_for(|routable| routable.len() == expected)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binding_health_reports_the_open_breaker_and_the_retry_it_caused() {
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new(MemoryConfig::default()));
    let endpoint = EndpointId::new("t", "prefill", "generate");
    let (w1, _r1) = prefill_worker(&discovery, &endpoint, 1).await;
    let _w2 = prefill_worker(&discovery, &endpoint, 2).await;
    let factory = DefaultBindingFactory::new(Arc::clone(&discovery), FactoryConfig::default());
    let (_admit, admitted) = watch::channel(BTreeSet::from([1, 2]));
    let target = WorkerSetTarget::new(
        WorkerSetTargetId::new("t/prefill/generate", 1),
        endpoint,
        Arc::new(rr_card()),
        admitted,
    );
    let binding = tokio::time::timeout(
        Duration::from_secs(10),
        factory.build(target, CancellationToken::new()),
    )
    .await
    .unwrap()
    .unwrap();
    tokio::time::timeout(
        Duration::from_secs(10),
        binding.dispatcher().view().wait_for(|r| r.len() == 2),
    )
    .await
    .unwrap();
    assert_eq!(
        binding.health(),
        BindingHealth::default()
            .with_zero_retries()
            .with_routable(2)
    );
    // Worker 1 stops (its registration stays): the next prefills all succeed on worker 2,
    // one of them after a retry that opened worker 1's breaker.
    w1.stop().await;
    for i in 0..6u32 {
        let outcome = binding
            .prefill(GenerateRequest::new(vec![i; 20], 1))
            .await
            .unwrap();
        assert_eq!(outcome.worker, 2);
    }
    let health = binding.health();
    assert_eq!(health.open_breakers, 1);
    let refused = health.retries[&crate::health::FailureClass::ConnectionRefused];
    let reset = health.retries[&crate::health::FailureClass::ConnectionReset];
    assert_eq!(refused + reset, 1, "{health:?}");
    assert_eq!(factory.stats().retries.total(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefills_stay_inside_the_admission_set() {
    let stats = prefill_with(false).await;
    assert_eq!(stats.dispatched.load(Ordering::Relaxed), 10);
    assert_eq!(stats.outside_admission.load(Ordering::Relaxed), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_check_catches_a_view_that_ignores_admission() {
    let stats = prefill_with(true).await;
    assert!(
        stats.outside_admission.load(Ordering::Relaxed) > 0,
        "the mutant routed to worker 2 and the check must count it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_picked_prefill_runs_on_the_picked_worker_and_releases_its_load() {
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new(MemoryConfig::default()));
    let endpoint = EndpointId::new("t", "prefill", "generate");
    let _w1 = prefill_worker(&discovery, &endpoint, 1).await;
    let _w2 = prefill_worker(&discovery, &endpoint, 2).await;
    let factory = DefaultBindingFactory::new(Arc::clone(&discovery), FactoryConfig::default());
    let (_admit, admitted) = watch::channel(BTreeSet::from([1, 2]));
    let target = WorkerSetTarget::new(
        WorkerSetTargetId::new("t/prefill/generate", 1),
        endpoint,
        Arc::new(rr_card()),
        admitted,
    );
    let binding = tokio::time::timeout(
        Duration::from_secs(10),
        factory.build(target, CancellationToken::new()),
    )
    .await
    .unwrap()
    .unwrap();
    tokio::time::timeout(
        Duration::from_secs(10),
        binding.dispatcher().view().wait_for(|r| r.len() == 2),
    )
    .await
    .unwrap();
    for i in 0..4u32 {
        let request = GenerateRequest::new(vec![i; 20], 1);
        let pick = binding.pick(&request).unwrap();
        // Round robin: nothing cached; this pick's tokens are the pool's only load.
        assert_eq!(pick.estimate().cached_tokens, 0);
        assert_eq!(pick.estimate().pool_tokens_per_worker, 0);
        assert_eq!(binding.inflight_tokens.load(Ordering::Relaxed), 20);
        // Round robin in id order: pick i went to worker i % 2 + 1; a dispatch that picked
        // again would take the rotation's next worker instead.
        let outcome = binding.prefill_picked(pick, request).await.unwrap();
        assert_eq!(outcome.worker, u64::from(i % 2) + 1);
        assert_eq!(binding.inflight_tokens.load(Ordering::Relaxed), 0);
    }
}
