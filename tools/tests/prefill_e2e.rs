//! End to end on loopback: real discovery (file store; etcd with feature `etcd` and
//! `PREFILL_ETCD_ENDPOINT`), mock workers serving over TCP, the default binding factory, the
//! prefill router and the topology watcher; in `hop`, the `PrefillHop` an embedder holds.

mod e2e;
#[path = "prefill_e2e/hop.rs"]
mod hop;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e::*;
use prefill_router::advert::SelectionMode;
use prefill_router::binding::{Binding, PrefillError, WorkerSetTarget, WorkerSetTargetId};
use prefill_router::discovery::Discovery;
use prefill_router::lifecycle::Lifecycle;
use prefill_router::push::PushMode;
use prefill_router::request::GenerateRequest;
use prefill_router::topology::TopologySnapshot;
use tokio::sync::watch;

const GROUP: &str = "e2e/prefill/generate";
const COMMITTED: &str = "e2e/committed/generate";

fn active_on(router: &Router, generation: u64) -> bool {
    let status = router.status();
    status.lifecycle == Lifecycle::Active
        && status
            .held
            .as_ref()
            .is_some_and(|id| id.generation == generation)
}

/// Wait (bounded) until the hop's topology view satisfies `check`. The watcher publishes its
/// view right after it retargets the router, so a router already retargeted may briefly sit
/// next to the previous view.
async fn view_reaches(
    view: &mut watch::Receiver<TopologySnapshot>,
    what: &str,
    check: impl FnMut(&TopologySnapshot) -> bool,
) {
    tokio::time::timeout(WAIT, view.wait_for(check))
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
        .expect("the topology watcher is running");
}

/// Upstream's integration scenario for committed targets: a committed KV card at block size 64
/// overrides the workers' raw round-robin cards; admission {w1} -> {w1,w2} -> {w2} is followed
/// without a rebuild and never routes to an unadmitted worker; generation 2 at block size 32
/// rebuilds; the retired binding fails promptly once its admission set empties. The workers sit
/// on an endpoint the hop's topology watcher ignores, so the test is the only controller.
async fn committed_targets_scenario(discovery: Arc<dyn Discovery>) {
    let _decode = start_decode(&discovery).await;
    let _w1 = start_committed(&discovery, 1, card(SelectionMode::RoundRobin, 16)).await;
    let _w2 = start_committed(&discovery, 2, card(SelectionMode::RoundRobin, 16)).await;
    let fe = frontend(&discovery).await;

    let (admit1, admitted1) = watch::channel(BTreeSet::from([1]));
    let gen1 = WorkerSetTargetId::new(COMMITTED, 1);
    fe.router.set_target(Some(WorkerSetTarget::new(
        gen1.clone(),
        committed_ep(),
        Arc::new(card(SelectionMode::KV, 64)),
        admitted1,
    )));
    fe.router.wait_active(WAIT).await.unwrap();
    let binding1 = fe.router.route().binding().cloned().unwrap();
    assert_eq!(binding1.id(), &gen1);
    assert_eq!(
        binding1.resolved().router_mode,
        SelectionMode::KV,
        "the committed card wins"
    );
    assert!(matches!(
        binding1.dispatcher().mode(),
        PushMode::Kv { block_size: 64, .. }
    ));

    for seed in 0..10 {
        assert_eq!(fe.request(seed).await.unwrap(), Some(1));
    }
    admit1.send_replace(BTreeSet::from([1, 2]));
    for seed in 10..40 {
        let worker = fe.request(seed).await.unwrap();
        assert!(matches!(worker, Some(1 | 2)), "routed to {worker:?}");
    }
    admit1.send_replace(BTreeSet::from([2]));
    for seed in 40..50 {
        assert_eq!(fe.request(seed).await.unwrap(), Some(2));
    }
    assert_eq!(fe.built(), 1, "admission changes never rebuild");

    // Generation 2: a successor on the same endpoint at block size 32.
    let _w3 = start_committed(&discovery, 3, card(SelectionMode::RoundRobin, 32)).await;
    let (_admit2, admitted2) = watch::channel(BTreeSet::from([3]));
    fe.router.set_target(Some(WorkerSetTarget::new(
        WorkerSetTargetId::new(COMMITTED, 2),
        committed_ep(),
        Arc::new(card(SelectionMode::KV, 32)),
        admitted2,
    )));
    fe.until("generation 2 active", |r| active_on(r, 2)).await;
    assert_eq!(fe.built(), 2, "a new generation rebuilds");
    let binding2 = fe.router.route().binding().cloned().unwrap();
    assert!(matches!(
        binding2.dispatcher().mode(),
        PushMode::Kv { block_size: 32, .. }
    ));
    for seed in 50..60 {
        assert_eq!(fe.request(seed).await.unwrap(), Some(3));
    }

    // The retired binding still follows its own admission: emptied, it fails at once.
    admit1.send_replace(BTreeSet::new());
    drop(admit1);
    let start = Instant::now();
    let error = binding1
        .prefill(GenerateRequest::new(prompt(99), 1))
        .await
        .unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(5), "failed promptly");
    assert_eq!(error, PrefillError::NoRoutableWorker);
    assert_eq!(fe.outside_admission(), 0);
    fe.hop.shutdown().await;
}

/// The watcher's first-wins admission: an instance with another card is never routed to while
/// the selected card is live; when the selected card's instances leave, the other card is
/// selected as a new generation and the router rebuilds.
async fn first_wins_scenario(discovery: Arc<dyn Discovery>) {
    let _decode = start_decode(&discovery).await;
    let fe = frontend(&discovery).await;
    let mut topology = fe.hop.topology();
    let mut w1 = start_prefill(&discovery, 1, card(SelectionMode::KV, 16)).await;
    fe.until("generation 1 active", |r| active_on(r, 1)).await;
    let _w2 = start_prefill(&discovery, 2, card(SelectionMode::KV, 32)).await;
    for seed in 0..20 {
        assert_eq!(fe.request(seed).await.unwrap(), Some(1), "2 is rejected");
    }
    w1.deregister().await;
    fe.until("generation 2 active", |r| active_on(r, 2)).await;
    // The view is published just after the router is retargeted: wait for it, bounded.
    let gen2 = Some(WorkerSetTargetId::new(GROUP, 2));
    view_reaches(&mut topology, "the view follows set_target", |t| {
        t.target == gen2
    })
    .await;
    for seed in 20..30 {
        assert_eq!(fe.request(seed).await.unwrap(), Some(2));
    }
    assert_eq!(fe.built(), 2);
    assert_eq!(fe.outside_admission(), 0);
    fe.hop.shutdown().await;
}

/// The pool vanishes (the hop goes Unavailable, requests bypass to decode) and returns with
/// the same card: same generation, the retained binding is reused without a rebuild.
async fn pool_removal_and_return_scenario(discovery: Arc<dyn Discovery>) {
    let _decode = start_decode(&discovery).await;
    let fe = frontend(&discovery).await;
    let mut topology = fe.hop.topology();
    assert_eq!(fe.request(0).await.unwrap(), None, "no pool: bypass");
    let mut w1 = start_prefill(&discovery, 1, card(SelectionMode::KV, 16)).await;
    let mut w2 = start_prefill(&discovery, 2, card(SelectionMode::KV, 16)).await;
    fe.until("active", |r| active_on(r, 1)).await;
    for seed in 1..10 {
        assert!(matches!(fe.request(seed).await.unwrap(), Some(1 | 2)));
    }
    w1.deregister().await;
    w2.deregister().await;
    fe.until("unavailable", |r| {
        r.status().lifecycle == Lifecycle::Unavailable
    })
    .await;
    view_reaches(&mut topology, "the view drops the target", |t| {
        t.target.is_none()
    })
    .await;
    assert_eq!(fe.request(10).await.unwrap(), None, "pool gone: bypass");

    let _w1 = start_prefill(&discovery, 1, card(SelectionMode::KV, 16)).await;
    fe.until("active again", |r| active_on(r, 1)).await;
    assert_eq!(
        fe.built(),
        1,
        "the returning pool reuses the retained binding"
    );
    for seed in 11..20 {
        assert_eq!(fe.request(seed).await.unwrap(), Some(1));
    }
    assert_eq!(fe.outside_admission(), 0);
    fe.hop.shutdown().await;
}

const TTL: Duration = Duration::from_secs(3);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store_committed_targets_follow_admission_and_rebuild_per_generation() {
    let (discovery, _dir) = file_store(TTL);
    committed_targets_scenario(discovery).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store_first_wins_admission_never_routes_to_rejected_instances() {
    let (discovery, _dir) = file_store(TTL);
    first_wins_scenario(discovery).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store_pool_removal_bypasses_and_return_reuses_the_binding() {
    let (discovery, _dir) = file_store(TTL);
    pool_removal_and_return_scenario(discovery).await;
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_committed_targets_follow_admission_and_rebuild_per_generation() {
    if let Some(discovery) = etcd_store(TTL).await {
        committed_targets_scenario(discovery).await;
    }
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_first_wins_admission_never_routes_to_rejected_instances() {
    if let Some(discovery) = etcd_store(TTL).await {
        first_wins_scenario(discovery).await;
    }
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_pool_removal_bypasses_and_return_reuses_the_binding() {
    if let Some(discovery) = etcd_store(TTL).await {
        pool_removal_and_return_scenario(discovery).await;
    }
}
