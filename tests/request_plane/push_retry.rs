//! Retrying a failed request on another worker (issue #16 item 3): a failure before any output
//! that is not the request's own fault moves to a different routable worker, within the
//! budget; the caller sees success or one error listing the attempts.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support::*;
use futures_util::{stream, StreamExt};
use prefill_router::health::{BackoffPolicy, FailureClass};
use prefill_router::push::{Dispatcher, PushConfig, PushError, PushMode};
use prefill_router::request::GenerateRequest;
use prefill_router::transport::{serve, Engine, EngineError, EngineStream, ServerConfig};
use tokio::net::TcpListener;
use tokio::time::timeout;

/// Breakers stay open for the whole test (no probe closes them mid-test).
const SLOW: BackoffPolicy = BackoffPolicy {
    initial: Duration::from_secs(60),
    max: Duration::from_secs(60),
};

/// A loopback address nobody listens on (bound, then released).
async fn dead_address() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    l.local_addr().expect("addr")
}

/// An engine that rejects every request (an engine error: the request's fault), counting them.
struct RejectingEngine {
    seen: Arc<AtomicUsize>,
}

impl Engine for RejectingEngine {
    fn generate(&self, _request: GenerateRequest) -> EngineStream {
        self.seen.fetch_add(1, Ordering::SeqCst);
        Box::pin(stream::iter([Err(EngineError::new("malformed request"))]))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_to_a_dead_worker_is_retried_on_a_live_one() {
    let discovery = Discovery::with_health(None, SLOW);
    let w2 = start_worker(PrefillEngine::new(2, 4)).await;
    let w3 = start_worker(PrefillEngine::new(3, 4)).await;
    discovery.add(1, dead_address().await).await;
    discovery.add(2, w2.local_addr()).await;
    discovery.add(3, w3.local_addr()).await;
    discovery.wait_routable(&[1, 2, 3]).await;
    let router = Dispatcher::new(
        discovery.view.clone(),
        PushMode::RoundRobin,
        PushConfig::default(),
    );
    for _ in 0..30 {
        let worker = served_by(&router).await.expect("retried elsewhere");
        assert_ne!(worker, 1);
    }
    // One refused connection opened worker 1's breaker; that one request was retried.
    let retries = router.retry_counts();
    assert_eq!(retries.get(FailureClass::ConnectionRefused), 1);
    assert_eq!(retries.total(), 1);
    assert_eq!(discovery.view.open_breakers(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_every_attempt_fails_the_error_lists_each_distinct_worker() {
    let discovery = Discovery::with_health(None, SLOW);
    for id in 1..=4 {
        discovery.add(id, dead_address().await).await;
    }
    discovery.wait_routable(&[1, 2, 3, 4]).await;
    let router = Dispatcher::new(
        discovery.view.clone(),
        PushMode::Random,
        PushConfig::default(),
    );
    let err = timeout(WAIT, router.generate(GenerateRequest::new(vec![1, 2], 1)))
        .await
        .expect("in time")
        .expect_err("every worker is dead");
    let PushError::Exhausted { attempts } = err else {
        panic!("expected Exhausted, got {err:?}");
    };
    // The budget is 2 retries: 3 attempts, each on a different worker, each refused.
    assert_eq!(attempts.len(), 3, "{attempts:?}");
    let mut ids: Vec<_> = attempts.iter().map(|a| a.instance).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 3, "a retry reused a failed worker: {attempts:?}");
    for a in &attempts {
        assert_eq!(a.class, FailureClass::ConnectionRefused);
        assert!(matches!(a.error, PushError::Transport { .. }), "{a:?}");
    }
    assert_eq!(router.retry_counts().total(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_budget_of_zero_tries_once() {
    let discovery = Discovery::with_health(None, SLOW);
    let w2 = start_worker(PrefillEngine::new(2, 4)).await;
    discovery.add(1, dead_address().await).await;
    discovery.add(2, w2.local_addr()).await;
    discovery.wait_routable(&[1, 2]).await;
    let router = Dispatcher::new(
        discovery.view.clone(),
        PushMode::Direct(1),
        PushConfig::default(),
    );
    // Direct mode never retries: the named worker's own error.
    let err = served_by(&router).await.expect_err("worker 1 is dead");
    assert!(
        matches!(err, PushError::Transport { instance: 1, .. }),
        "{err:?}"
    );
    let router = Dispatcher::new(
        discovery.view.clone(),
        PushMode::RoundRobin,
        PushConfig {
            retry_budget: 0,
            ..PushConfig::default()
        },
    );
    // Worker 1's breaker is open now; worker 2 serves, nothing is retried.
    assert_eq!(served_by(&router).await, Ok(2));
    assert_eq!(router.retry_counts().total(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_worker_rejected_is_not_retried_elsewhere() {
    let discovery = Discovery::with_health(None, SLOW);
    let seen1 = Arc::new(AtomicUsize::new(0));
    let seen2 = Arc::new(AtomicUsize::new(0));
    let w1 = start_worker(Arc::new(RejectingEngine {
        seen: Arc::clone(&seen1),
    }))
    .await;
    let w2 = start_worker(Arc::new(RejectingEngine {
        seen: Arc::clone(&seen2),
    }))
    .await;
    discovery.add(1, w1.local_addr()).await;
    discovery.add(2, w2.local_addr()).await;
    discovery.wait_routable(&[1, 2]).await;
    let router = Dispatcher::new(
        discovery.view.clone(),
        PushMode::RoundRobin,
        PushConfig::default(),
    );
    for _ in 0..6 {
        let err = served_by(&router).await.expect_err("rejected");
        assert!(matches!(err, PushError::Transport { .. }), "{err:?}");
    }
    // Six requests, six attempts in all: a poisoned request is not replayed on other workers.
    assert_eq!(
        seen1.load(Ordering::SeqCst) + seen2.load(Ordering::SeqCst),
        6
    );
    assert_eq!(router.retry_counts().total(), 0);
    assert_eq!(discovery.view.open_breakers(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_worker_is_retried_elsewhere_and_stays_routable() {
    let discovery = Discovery::with_health(None, SLOW);
    // Worker 1 refuses every request as overloaded (no request slot at all).
    let busy = serve(
        TcpListener::bind("127.0.0.1:0").await.expect("bind"),
        PrefillEngine::new(1, 4),
        ServerConfig {
            max_in_flight: 0,
            ..ServerConfig::default()
        },
    )
    .expect("serve");
    let w2 = start_worker(PrefillEngine::new(2, 4)).await;
    discovery.add(1, busy.local_addr()).await;
    discovery.add(2, w2.local_addr()).await;
    discovery.wait_routable(&[1, 2]).await;
    let router = Dispatcher::new(
        discovery.view.clone(),
        PushMode::RoundRobin,
        PushConfig::default(),
    );
    for _ in 0..10 {
        assert_eq!(served_by(&router).await, Ok(2));
    }
    // The rotation advances per pick, so each request met worker 1 first (picks alternate
    // 1, 2, 1, 2, ...) and was retried once; overload never opens its breaker.
    assert_eq!(router.retry_counts().get(FailureClass::Overloaded), 10);
    assert_eq!(discovery.view.open_breakers(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_retried_after_the_worker_produced_output() {
    let discovery = Discovery::with_health(None, SLOW);
    let ticks = start_worker(TickEngine::new(Duration::from_millis(5))).await;
    let w2 = start_worker(PrefillEngine::new(2, 4)).await;
    discovery.add(1, ticks.local_addr()).await;
    discovery.add(2, w2.local_addr()).await;
    discovery.wait_routable(&[1, 2]).await;
    let router = Dispatcher::new(
        discovery.view.clone(),
        PushMode::RoundRobin,
        PushConfig::default(),
    );
    // Round robin starts at worker 1: a stream of ticks.
    let mut s = timeout(
        WAIT,
        router.generate(GenerateRequest::new(vec![1], 1_000_000)),
    )
    .await
    .expect("in time")
    .expect("routed");
    assert_eq!(s.instance_id(), 1);
    let first = timeout(WAIT, s.next()).await.expect("in time");
    assert!(matches!(first, Some(Ok(_))), "{first:?}");
    // The worker dies mid-stream: the error reaches the caller, no retry happens.
    drop(ticks);
    let end = end_of(&mut s, WAIT).await.expect("stream ends in time");
    assert!(
        matches!(end, Some(Err(PushError::Transport { instance: 1, .. }))),
        "{end:?}"
    );
    assert_eq!(router.retry_counts().total(), 0);
}
