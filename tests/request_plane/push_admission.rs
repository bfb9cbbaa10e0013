//! The routable view under the router: admission changes, discovery changes, an open breaker
//! after a failed connection, and a worker killed mid-stream.

use std::collections::BTreeSet;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

use crate::support::*;
use futures_util::StreamExt;
use prefill_router::health::BackoffPolicy;
use prefill_router::push::{Dispatcher, InstanceStatus, PushConfig, PushError, PushMode};
use prefill_router::request::GenerateRequest;
use prefill_router::transport::TransportError;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::time::{timeout, Instant};

/// A short backoff so probes run within the test's time.
const SMALL: BackoffPolicy = BackoffPolicy {
    initial: Duration::from_millis(20),
    max: Duration::from_millis(200),
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_changes_take_effect_without_rebuilding_the_router() {
    let (admit, admission) = watch::channel(BTreeSet::from([1]));
    let discovery = Discovery::new(Some(admission));
    let w1 = start_worker(PrefillEngine::new(1, 4)).await;
    let w2 = start_worker(PrefillEngine::new(2, 4)).await;
    discovery.add(1, w1.local_addr()).await;
    discovery.add(2, w2.local_addr()).await;
    discovery.wait_routable(&[1]).await;
    let router = Dispatcher::new(
        discovery.view.clone(),
        PushMode::RoundRobin,
        PushConfig::default(),
    );
    for _ in 0..4 {
        assert_eq!(served_by(&router).await, Ok(1));
    }
    admit.send_replace(BTreeSet::from([2]));
    for _ in 0..4 {
        assert_eq!(served_by(&router).await, Ok(2));
    }
    assert_eq!(
        discovery.view.status(1),
        InstanceStatus::NotAdmitted,
        "discovered but not admitted"
    );
    let not_routable = router
        .generate_direct(1, GenerateRequest::new(vec![1], 1))
        .await;
    assert!(matches!(
        not_routable,
        Err(PushError::DirectTargetNotRoutable(1))
    ));
    admit.send_replace(BTreeSet::new());
    assert!(matches!(
        served_by(&router).await,
        Err(PushError::NoRoutableInstances)
    ));
    // Admitting an id discovery does not know routes nothing either.
    admit.send_replace(BTreeSet::from([7]));
    assert!(matches!(
        served_by(&router).await,
        Err(PushError::NoRoutableInstances)
    ));
    admit.send_replace(BTreeSet::from([1, 2]));
    let mut seen = BTreeSet::new();
    for _ in 0..4 {
        seen.insert(served_by(&router).await.expect("routed"));
    }
    assert_eq!(seen, BTreeSet::from([1, 2]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removed_instances_stop_receiving_requests() {
    let discovery = Discovery::new(None);
    let w1 = start_worker(PrefillEngine::new(1, 4)).await;
    let w2 = start_worker(PrefillEngine::new(2, 4)).await;
    discovery.add(1, w1.local_addr()).await;
    discovery.add(2, w2.local_addr()).await;
    discovery.wait_routable(&[1, 2]).await;
    let router = Dispatcher::new(
        discovery.view.clone(),
        PushMode::RoundRobin,
        PushConfig::default(),
    );
    served_by(&router).await.expect("routed");
    discovery.remove(1).await;
    discovery.wait_routable(&[2]).await;
    for _ in 0..4 {
        assert_eq!(served_by(&router).await, Ok(2));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_instance_is_unroutable_until_its_probe_connects() {
    let discovery = Discovery::with_health(None, SMALL);
    // Instance 1 points at a port nobody listens on (bound, then released).
    let dead = {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        l.local_addr().expect("addr")
    };
    let w2 = start_worker(PrefillEngine::new(2, 4)).await;
    discovery.add(1, dead).await;
    discovery.add(2, w2.local_addr()).await;
    discovery.wait_routable(&[1, 2]).await;
    let router = Dispatcher::new(
        discovery.view.clone(),
        PushMode::RoundRobin,
        // The breaker alone: no retry on the other worker hides the failure.
        PushConfig {
            retry_budget: 0,
            ..PushConfig::default()
        },
    );
    let first = served_by(&router).await;
    assert!(
        matches!(
            first,
            Err(PushError::Transport {
                instance: 1,
                source: TransportError::Connect { .. }
            })
        ),
        "{first:?}"
    );
    assert!(
        matches!(discovery.view.status(1), InstanceStatus::Unhealthy(_)),
        "{:?}",
        discovery.view.status(1)
    );
    assert_eq!(discovery.view.open_breakers(), 1);
    for _ in 0..4 {
        assert_eq!(
            served_by(&router).await,
            Ok(2),
            "instance with an open breaker skipped"
        );
    }
    // Probes of the dead address keep failing: still unroutable after several backoff rounds.
    tokio::time::sleep(SMALL.max * 2).await;
    assert!(matches!(
        discovery.view.status(1),
        InstanceStatus::Unhealthy(_)
    ));
    // The worker comes back (at a live address) and discovery lists it there: the breaker is
    // kept across the repeated Added, and the next probe (of the new address) closes it.
    let w1 = start_worker(PrefillEngine::new(1, 4)).await;
    discovery.add(1, w1.local_addr()).await;
    discovery.wait_routable(&[1, 2]).await;
    let mut seen = BTreeSet::new();
    for _ in 0..4 {
        seen.insert(served_by(&router).await.expect("routed"));
    }
    assert_eq!(seen, BTreeSet::from([1, 2]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_stream_yields_a_typed_error_within_the_deadline() {
    let discovery = Discovery::new(None);
    let engine = TickEngine::new(Duration::from_millis(5));
    let worker = start_worker(engine).await;
    discovery.add(1, worker.local_addr()).await;
    discovery.wait_routable(&[1]).await;
    let deadline = Duration::from_secs(5);
    let router = Dispatcher::new(
        discovery.view.clone(),
        PushMode::RoundRobin,
        PushConfig {
            request_timeout: Some(deadline),
            ..PushConfig::default()
        },
    );
    let mut s = router
        .generate(GenerateRequest::new(vec![1], 1_000_000))
        .await
        .expect("routed");
    timeout(WAIT, s.next())
        .await
        .expect("first")
        .expect("item")
        .expect("ok");
    let killed = Instant::now();
    worker.shutdown();
    let failure = end_of(&mut s, deadline)
        .await
        .expect("a typed error before the deadline, not a hang");
    assert!(
        matches!(
            failure,
            Some(Err(PushError::Transport {
                instance: 1,
                source: TransportError::Disconnected { .. }
            }))
        ),
        "{failure:?}"
    );
    assert!(killed.elapsed() < deadline);
    assert!(matches!(
        discovery.view.status(1),
        InstanceStatus::Unhealthy(_)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_worker_yields_timeout_at_the_deadline() {
    let discovery = Discovery::new(None);
    let live = Arc::new(AtomicUsize::new(0));
    let worker = start_worker(Arc::new(SilentEngine { live: live.clone() })).await;
    discovery.add(1, worker.local_addr()).await;
    discovery.wait_routable(&[1]).await;
    let router = Dispatcher::new(
        discovery.view.clone(),
        PushMode::RoundRobin,
        PushConfig {
            request_timeout: Some(Duration::from_millis(300)),
            // The stream's own timeout item (a retrying call would read it ahead).
            retry_budget: 0,
            ..PushConfig::default()
        },
    );
    let mut s = router
        .generate(GenerateRequest::new(vec![1], 1))
        .await
        .expect("routed");
    let item = timeout(WAIT, s.next())
        .await
        .expect("no hang")
        .expect("item");
    assert_eq!(item, Err(PushError::Timeout { instance: 1 }));
    assert!(wait_count(&live, 0).await, "worker stopped at the deadline");
    // A timeout is not a connection failure: the instance stays routable.
    assert!(matches!(
        discovery.view.status(1),
        InstanceStatus::Routable(_)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_after_its_instance_left_discovery_reports_instance_gone() {
    let discovery = Discovery::new(None);
    let worker = start_worker(TickEngine::new(Duration::from_millis(5))).await;
    discovery.add(1, worker.local_addr()).await;
    discovery.wait_routable(&[1]).await;
    let router = Dispatcher::new(
        discovery.view.clone(),
        PushMode::RoundRobin,
        PushConfig::default(),
    );
    let mut s = router
        .generate(GenerateRequest::new(vec![1], 1_000_000))
        .await
        .expect("routed");
    timeout(WAIT, s.next())
        .await
        .expect("first")
        .expect("item")
        .expect("ok");
    // Deregistered first (its stream keeps running: graceful drain), then the process dies.
    discovery.remove(1).await;
    discovery.wait_routable(&[]).await;
    timeout(WAIT, s.next())
        .await
        .expect("drain")
        .expect("item")
        .expect("still streaming");
    worker.shutdown();
    let failure = end_of(&mut s, WAIT).await.expect("no hang");
    assert_eq!(failure, Some(Err(PushError::InstanceGone(1))));
}
