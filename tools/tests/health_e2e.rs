//! Worker health end to end on loopback (issue #16): the prefill router over the default
//! binding factory, a memory discovery store and mock prefill workers serving over TCP.
//!
//! - leg coupling: a request dropped mid-prefill cancels the prefill at the worker, and a
//!   failed prefill never calls decode (a dead pool follows the fallback policy: under
//!   `Decode`, decode runs the request whole);
//! - the drain cap: a prefill on a retired binding is cut off after the cap (and without a cap
//!   runs to completion);
//! - a prefill worker killed under steady traffic fails no request and gets traffic again
//!   within the probe cap after it comes back.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use parking_lot::Mutex;
use prefill_router::advert::{ModelCard, SelectionMode};
use prefill_router::binding::{DefaultBindingFactory, FactoryConfig};
use prefill_router::binding::{PrefillOutcome, WorkerSetTarget, WorkerSetTargetId};
use prefill_router::decode::{Decode, DecodeError, DecodeStream};
use prefill_router::discovery::{
    Discovery, EndpointId, InstanceId, MemoryConfig, MemoryDiscovery, Registration,
};
use prefill_router::health::BackoffPolicy;
use prefill_router::push::PushConfig;
use prefill_router::request::{FinishReason, GenerateRequest, GenerateResponse};
use prefill_router::router::{FallbackPolicy, GenerateError, PrefillRouter, PrefillRouterConfig};
use prefill_router::transport::{serve, ServerConfig, ServerHandle};
use prefill_router_tools::mock::{spawn_registered, MockConfig, MockPrefill, MockStats};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::time::{timeout, Instant};

/// Bound on anything a test waits for (a busy 2-core box).
const WAIT: Duration = Duration::from_secs(15);

/// Breakers that probe fast: first probe after 10-20 ms, at most 200 ms apart.
const SMALL: BackoffPolicy = BackoffPolicy {
    initial: Duration::from_millis(20),
    max: Duration::from_millis(200),
};

/// Slack on top of the probe cap for a loaded machine (probe connects, the scheduler).
const SLACK: Duration = Duration::from_secs(2);

fn endpoint() -> EndpointId {
    EndpointId::new("health", "prefill", "generate")
}

fn card() -> ModelCard {
    ModelCard::routed("m", SelectionMode::RoundRobin, 16)
}

/// Prefill time: `per_block` for each of a prompt's 16-token blocks.
fn mock(per_block: Duration) -> MockConfig {
    MockConfig {
        block_size: 16,
        block_cost: per_block,
        token_interval: Duration::from_micros(100),
        cache_blocks: 0,
    }
}

/// A mock prefill worker serving on `listener`.
fn worker_on(
    listener: TcpListener,
    id: InstanceId,
    config: MockConfig,
) -> (ServerHandle, Arc<MockStats>) {
    let engine = MockPrefill::new(id, config);
    let stats = engine.stats();
    let server = serve(listener, engine, ServerConfig::default()).expect("serve");
    (server, stats)
}

/// A mock prefill worker on a fresh loopback port, registered in `discovery`.
async fn worker(
    discovery: &Arc<dyn Discovery>,
    id: InstanceId,
    config: MockConfig,
) -> (ServerHandle, Registration, Arc<MockStats>) {
    let engine = MockPrefill::new(id, config);
    let stats = engine.stats();
    let (server, registration) = spawn_registered(
        discovery,
        endpoint(),
        id,
        engine,
        card(),
        ServerConfig::default(),
    )
    .await
    .expect("worker");
    (server, registration, stats)
}

/// Bind `addr` again (the port was just released; bounded retries).
async fn rebind(addr: SocketAddr) -> TcpListener {
    for _ in 0..200 {
        if let Ok(l) = TcpListener::bind(addr).await {
            return l;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("cannot rebind {addr}");
}

/// A decode hop that serves one token in process and records which prefill worker ran each
/// request (so a test sees where prefills went without reading the worker).
#[derive(Default)]
struct RecordingDecode {
    calls: AtomicUsize,
    workers: Mutex<Vec<InstanceId>>,
}

impl Decode for RecordingDecode {
    fn decode(
        &self,
        _request: GenerateRequest,
        prefill: Option<PrefillOutcome>,
    ) -> BoxFuture<'_, Result<DecodeStream, DecodeError>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if let Some(p) = &prefill {
            self.workers.lock().push(p.worker);
        }
        let response = GenerateResponse {
            text: None,
            usage: None,
            token_ids: vec![1],
            finish: Some(FinishReason::Length),
            prefill: None,
        };
        async move { Ok(Box::pin(futures_util::stream::iter([Ok(response)])) as DecodeStream) }
            .boxed()
    }
}

struct Hop {
    router: PrefillRouter<DefaultBindingFactory>,
    _admit: watch::Sender<BTreeSet<InstanceId>>,
}

/// A router targeted at `admitted`, Active.
async fn hop(
    discovery: &Arc<dyn Discovery>,
    admitted: &[InstanceId],
    drain_cap: Option<Duration>,
) -> Hop {
    hop_with(discovery, admitted, drain_cap, FallbackPolicy::default()).await
}

async fn hop_with(
    discovery: &Arc<dyn Discovery>,
    admitted: &[InstanceId],
    drain_cap: Option<Duration>,
    fallback: FallbackPolicy,
) -> Hop {
    let factory = DefaultBindingFactory::new(
        Arc::clone(discovery),
        FactoryConfig {
            push: PushConfig {
                request_timeout: Some(Duration::from_secs(10)),
                health: SMALL,
                ..PushConfig::default()
            },
            ..FactoryConfig::default()
        },
    );
    let router = PrefillRouter::new(
        factory,
        PrefillRouterConfig {
            drain_cap,
            fallback,
            ..PrefillRouterConfig::default()
        },
    );
    let (admit, rx) = watch::channel(admitted.iter().copied().collect::<BTreeSet<_>>());
    router.set_target(Some(WorkerSetTarget::new(
        WorkerSetTargetId::new("health/prefill", 1),
        endpoint(),
        Arc::new(card()),
        rx,
    )));
    router.wait_active(WAIT).await.expect("active");
    Hop {
        router,
        _admit: admit,
    }
}

/// Wait (bounded) until `read` returns true.
async fn until(mut read: impl FnMut() -> bool) -> bool {
    timeout(WAIT, async {
        while !read() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .is_ok()
}

fn prompt(i: u32) -> Vec<u32> {
    (0..64).map(|t| t + i * 64).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_dropped_mid_prefill_cancels_the_prefill_at_the_worker() {
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new(MemoryConfig::default()));
    // 4 blocks of 2 s: the prefill is still running when the caller gives up.
    let (_server, _reg, stats) = worker(&discovery, 1, mock(Duration::from_secs(2))).await;
    let hop = Arc::new(hop(&discovery, &[1], None).await);
    let decode = Arc::new(RecordingDecode::default());
    let request = {
        let (hop, decode) = (Arc::clone(&hop), Arc::clone(&decode));
        tokio::spawn(async move {
            let _ = hop
                .router
                .generate(GenerateRequest::new(prompt(0), 8), &*decode)
                .await;
        })
    };
    assert!(
        until(|| stats.requests.load(Ordering::SeqCst) == 1).await,
        "prefill reached the worker"
    );
    // The caller drops the request (its future) while the prefill is in flight.
    request.abort();
    assert!(
        until(|| stats.cancelled.load(Ordering::SeqCst) == 1).await,
        "the worker saw the cancellation"
    );
    assert_eq!(
        decode.calls.load(Ordering::SeqCst),
        0,
        "decode never started"
    );
}

/// The only prefill worker dies (its registration stays). Under policy `Reject` its prefills
/// fail and decode is never called; under `Decode` (the default) a prefill that finds no
/// reachable worker follows the policy: decode runs the whole request (no prefill outcome is
/// ever handed to it from a failed prefill).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_prefill_never_calls_decode_unless_the_policy_bypasses_a_dead_pool() {
    for fallback in [FallbackPolicy::Reject, FallbackPolicy::Decode] {
        let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new(MemoryConfig::default()));
        let (server, _reg, _stats) = worker(&discovery, 1, mock(Duration::from_micros(100))).await;
        let hop = hop_with(&discovery, &[1], None, fallback).await;
        let decode = RecordingDecode::default();
        let _served = hop
            .router
            .generate(GenerateRequest::new(prompt(0), 4), &decode)
            .await
            .expect("served");
        assert_eq!(decode.calls.load(Ordering::SeqCst), 1);
        server.stop().await;
        for i in 1..=5 {
            let result = timeout(
                WAIT,
                hop.router
                    .generate(GenerateRequest::new(prompt(i), 4), &decode),
            )
            .await
            .expect("in time");
            match fallback {
                FallbackPolicy::Reject => assert!(
                    matches!(&result, Err(GenerateError::Prefill(e)) if e.no_reachable_worker()),
                    "{:?}",
                    result.err()
                ),
                _ => assert!(result.is_ok(), "{:?}", result.err()),
            }
        }
        let counters = hop.router.status().counters;
        match fallback {
            FallbackPolicy::Reject => {
                assert_eq!(
                    decode.calls.load(Ordering::SeqCst),
                    1,
                    "decode after a failed prefill"
                );
                assert_eq!(counters.prefill_errors, 5);
            }
            _ => {
                assert_eq!(
                    decode.calls.load(Ordering::SeqCst),
                    6,
                    "decode ran them whole"
                );
                assert_eq!(counters.unreachable_bypassed, 5);
                assert_eq!(counters.prefill_errors, 0);
            }
        }
        assert_eq!(
            *decode.workers.lock(),
            vec![1],
            "only the served request handed decode a prefill outcome"
        );
    }
}

/// Starts one slow prefill on a one-worker hop, retires the binding (the router shuts down)
/// while it runs; returns the request's result, the worker's counters and the router.
async fn retire_mid_prefill(
    per_block: Duration,
    drain_cap: Option<Duration>,
) -> (
    Result<usize, GenerateError>,
    Arc<MockStats>,
    Arc<Hop>,
    Arc<RecordingDecode>,
) {
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new(MemoryConfig::default()));
    let (server, _reg, stats) = worker(&discovery, 1, mock(per_block)).await;
    let hop = Arc::new(hop(&discovery, &[1], drain_cap).await);
    let decode = Arc::new(RecordingDecode::default());
    let request = {
        let (hop, decode) = (Arc::clone(&hop), Arc::clone(&decode));
        tokio::spawn(async move {
            let stream = hop
                .router
                .generate(GenerateRequest::new(prompt(0), 4), &*decode)
                .await?;
            Ok(futures_util::StreamExt::count(stream).await)
        })
    };
    assert!(
        until(|| stats.requests.load(Ordering::SeqCst) == 1).await,
        "prefill reached the worker"
    );
    // Shutdown retires the held binding under the request (a clear keeps it for reuse).
    hop.router.shutdown();
    assert_eq!(hop.router.status().counters.retired, 1);
    let result = timeout(WAIT, request)
        .await
        .expect("request ended")
        .expect("no panic");
    drop(server);
    (result, stats, hop, decode)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_cap_cuts_off_a_prefill_on_a_retired_binding_and_releases_it() {
    let cap = Duration::from_millis(200);
    // 4 blocks of 5 s: far past the cap.
    let (result, stats, hop, decode) = retire_mid_prefill(Duration::from_secs(5), Some(cap)).await;
    assert_eq!(result, Err(GenerateError::Drained { after: cap }));
    assert!(
        until(|| stats.cancelled.load(Ordering::SeqCst) == 1).await,
        "the worker saw the cut-off"
    );
    assert_eq!(decode.calls.load(Ordering::SeqCst), 0);
    let status = hop.router.status();
    assert_eq!(status.counters.drained, 1);
    assert!(
        until(|| hop.router.status().counters.retired_alive == 0).await,
        "binding released"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_drain_cap_a_retired_binding_serves_its_prefill_to_completion() {
    // 4 blocks of 100 ms.
    let (result, stats, hop, decode) = retire_mid_prefill(Duration::from_millis(100), None).await;
    assert_eq!(result, Ok(1), "the prefill finished and decode served");
    assert_eq!(stats.cancelled.load(Ordering::SeqCst), 0);
    assert_eq!(decode.calls.load(Ordering::SeqCst), 1);
    assert_eq!(hop.router.status().counters.drained, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_one_of_three_prefill_workers_under_steady_traffic_fails_no_request() {
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new(MemoryConfig::default()));
    let config = mock(Duration::from_micros(200));
    let (w1, _r1, _) = worker(&discovery, 1, config.clone()).await;
    let (w2, _r2, _) = worker(&discovery, 2, config.clone()).await;
    let (w3, _r3, _) = worker(&discovery, 3, config.clone()).await;
    let addr2 = w2.local_addr();
    let hop = Arc::new(hop(&discovery, &[1, 2, 3], None).await);
    let decode = Arc::new(RecordingDecode::default());
    let stop = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(AtomicUsize::new(0));
    let served = Arc::new(AtomicUsize::new(0));
    // Four callers in a loop, a few ms apart, until told to stop (bounded by WAIT).
    let callers: Vec<_> = (0..4u32)
        .map(|c| {
            let (hop, decode, stop, failed, served) = (
                Arc::clone(&hop),
                Arc::clone(&decode),
                Arc::clone(&stop),
                Arc::clone(&failed),
                Arc::clone(&served),
            );
            tokio::spawn(async move {
                let end = Instant::now() + WAIT;
                let mut i = 0;
                while !stop.load(Ordering::SeqCst) && Instant::now() < end {
                    let request = GenerateRequest::new(prompt(c * 100_000 + i), 2);
                    match hop.router.generate(request, &*decode).await {
                        Ok(_) => served.fetch_add(1, Ordering::SeqCst),
                        Err(e) => {
                            eprintln!("request failed: {e}");
                            failed.fetch_add(1, Ordering::SeqCst)
                        }
                    };
                    i += 1;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            })
        })
        .collect();
    let served_by = |id: InstanceId, from: usize| {
        decode.workers.lock()[from..]
            .iter()
            .filter(|w| **w == id)
            .count()
    };
    assert!(
        until(|| served.load(Ordering::SeqCst) >= 40).await,
        "traffic flows"
    );
    // Kill worker 2; its registration stays (a blip: the lease outlives the outage).
    w2.stop().await;
    let down_from = decode.workers.lock().len();
    let target = served.load(Ordering::SeqCst) + 100;
    assert!(
        until(|| served.load(Ordering::SeqCst) >= target).await,
        "traffic flows while 2 is down"
    );
    // A request racing the stop may still have been served by 2; after that none.
    let while_down = decode.workers.lock().len();
    assert!(served_by(2, down_from) <= 4, "worker 2 served while down");
    // It comes back at the same address.
    let (w2, _) = worker_on(rebind(addr2).await, 2, config);
    let back = Instant::now();
    assert!(
        until(|| served_by(2, while_down) > 0).await,
        "worker 2 gets traffic again"
    );
    let recovered = back.elapsed();
    stop.store(true, Ordering::SeqCst);
    for c in callers {
        c.await.expect("caller");
    }
    assert_eq!(failed.load(Ordering::SeqCst), 0, "no request failed");
    assert!(
        recovered <= SMALL.max + SLACK,
        "worker 2 routed again after {recovered:?}, cap {:?}",
        SMALL.max
    );
    drop((w1, w2, w3));
}
