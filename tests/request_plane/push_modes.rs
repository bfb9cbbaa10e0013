//! Dispatcher modes on loopback workers: round robin, random, direct, KV.

use std::collections::BTreeMap;

use crate::support::*;
use futures_util::StreamExt;
use prefill_router::advert::KvRouterConfig;
use prefill_router::discovery::InstanceId;
use prefill_router::push::{Dispatcher, PushConfig, PushError, PushMode};
use prefill_router::request::{GenerateRequest, PrefillInfo};
use prefill_router::transport::ServerHandle;
use tokio::time::timeout;

const BLOCK: u32 = 4;

/// Start `n` prefill workers with ids 1..=n, announce them, and build a router.
async fn cluster(n: u64, mode: PushMode) -> (Vec<ServerHandle>, Discovery, Dispatcher) {
    let discovery = Discovery::new(None);
    let mut workers = Vec::new();
    for id in 1..=n {
        let w = start_worker(PrefillEngine::new(id, BLOCK)).await;
        discovery.add(id, w.local_addr()).await;
        workers.push(w);
    }
    let ids: Vec<InstanceId> = (1..=n).collect();
    discovery.wait_routable(&ids).await;
    let router = Dispatcher::new(discovery.view.clone(), mode, PushConfig::default());
    (workers, discovery, router)
}

/// Send one request; return (picked instance, what the worker reported).
async fn call(router: &Dispatcher, request: GenerateRequest) -> (InstanceId, PrefillInfo) {
    let mut s = timeout(WAIT, router.generate(request))
        .await
        .expect("in time")
        .expect("routed");
    let picked = s.instance_id();
    let r = timeout(WAIT, s.next())
        .await
        .expect("in time")
        .expect("item")
        .expect("ok");
    (picked, r.prefill.expect("prefill info"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_visits_workers_in_exact_rotation() {
    let (_workers, _d, router) = cluster(3, PushMode::RoundRobin).await;
    let mut served = Vec::new();
    for _ in 0..9 {
        let (picked, info) = call(&router, GenerateRequest::new(vec![1, 2, 3], 1)).await;
        assert_eq!(
            picked, info.worker,
            "the picked worker is the one that served"
        );
        served.push(info.worker);
    }
    assert_eq!(served, vec![1, 2, 3, 1, 2, 3, 1, 2, 3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_reaches_every_worker() {
    let (_workers, _d, router) = cluster(3, PushMode::Random).await;
    let mut counts: BTreeMap<InstanceId, usize> = BTreeMap::new();
    for _ in 0..60 {
        let (_, info) = call(&router, GenerateRequest::new(vec![1], 1)).await;
        *counts.entry(info.worker).or_default() += 1;
    }
    // With a fixed seed this is deterministic; each worker gets a fair share of 60 picks.
    assert_eq!(counts.keys().copied().collect::<Vec<_>>(), vec![1, 2, 3]);
    assert!(counts.values().all(|&c| c >= 8), "{counts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_hits_the_named_worker() {
    let (_workers, _d, router) = cluster(3, PushMode::Direct(2)).await;
    for _ in 0..5 {
        let (picked, info) = call(&router, GenerateRequest::new(vec![5], 1)).await;
        assert_eq!((picked, info.worker), (2, 2));
    }
    let mut s = router
        .generate_direct(3, GenerateRequest::new(vec![5], 1))
        .await
        .expect("routed");
    assert_eq!(s.instance_id(), 3);
    let r = timeout(WAIT, s.next())
        .await
        .expect("in time")
        .expect("item")
        .expect("ok");
    assert_eq!(r.prefill.expect("info").worker, 3);
    let gone = router
        .generate_direct(9, GenerateRequest::new(vec![5], 1))
        .await;
    assert!(matches!(gone, Err(PushError::InstanceGone(9))), "{gone:?}");
}

/// A conversation's turn `n`: a shared system prompt, then the session's own history.
fn turn(system: u32, session: u32, n: u32) -> Vec<u32> {
    let mut tokens: Vec<u32> = (0..16).map(|i| system * 1000 + i).collect();
    for t in 0..=n {
        tokens.extend((0..10).map(|i| 1_000_000 + session * 1000 + t * 10 + i));
    }
    tokens
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_sends_the_second_turn_to_the_worker_that_served_the_first() {
    let mode = PushMode::Kv {
        block_size: BLOCK,
        config: KvRouterConfig::default(),
    };
    let (_workers, _d, router) = cluster(4, mode).await;
    let mut first = BTreeMap::new();
    for session in 0..12 {
        let (w, info) = call(
            &router,
            GenerateRequest::new(turn(session % 2, session, 0), 1),
        )
        .await;
        assert_eq!(w, info.worker);
        first.insert(session, w);
    }
    for session in 0..12 {
        let (w, info) = call(
            &router,
            GenerateRequest::new(turn(session % 2, session, 1), 1),
        )
        .await;
        assert_eq!(w, first[&session], "session {session} moved");
        // The worker really had the first turn cached: all 6 full blocks of turn 0.
        assert!(info.cached_blocks >= 6, "session {session}: {info:?}");
    }
}

/// The same conversations under round robin move between workers: the KV check above is not
/// passing by accident of the rotation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_does_not_keep_sessions_on_their_worker() {
    let (_workers, _d, router) = cluster(4, PushMode::RoundRobin).await;
    let mut first = BTreeMap::new();
    for session in 0..3 {
        let (w, _) = call(&router, GenerateRequest::new(turn(0, session, 0), 1)).await;
        first.insert(session, w);
    }
    let mut moved = 0;
    for session in 0..3 {
        let (w, _) = call(&router, GenerateRequest::new(turn(0, session, 1), 1)).await;
        moved += usize::from(w != first[&session]);
    }
    assert!(moved > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_instances_is_a_typed_error() {
    let discovery = Discovery::new(None);
    let router = Dispatcher::new(
        discovery.view.clone(),
        PushMode::RoundRobin,
        PushConfig::default(),
    );
    let err = router.generate(GenerateRequest::new(vec![1], 1)).await;
    assert!(matches!(err, Err(PushError::NoRoutableInstances)));
}
