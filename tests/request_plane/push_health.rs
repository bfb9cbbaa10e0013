//! Worker breakers under the dispatcher: a worker whose listener blips comes back on its own
//! (no re-registration), failures that are not the worker's never make it unroutable, and a
//! removed or dropped view stops probing.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support::*;
use futures_util::StreamExt;
use prefill_router::health::{BackoffPolicy, FailureClass};
use prefill_router::push::{Dispatcher, InstanceStatus, PushConfig, PushError, PushMode};
use prefill_router::request::GenerateRequest;
use prefill_router::transport::{serve, ServerConfig};
use tokio::net::TcpListener;
use tokio::time::{timeout, Instant};

const SMALL: BackoffPolicy = BackoffPolicy {
    initial: Duration::from_millis(20),
    max: Duration::from_millis(200),
};

/// Slack on top of the probe cap for a loaded machine (a probe's connect, the scheduler).
const SLACK: Duration = Duration::from_secs(1);

/// Bind `addr` again (the port was just released; bounded retries).
async fn rebind(addr: SocketAddr) -> TcpListener {
    for _ in 0..100 {
        if let Ok(l) = TcpListener::bind(addr).await {
            return l;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("cannot rebind {addr}");
}

/// Accepts connections at a loopback port and counts them (each probe is one connect).
async fn counting_listener() -> (SocketAddr, Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let count = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&count);
    let task = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            drop(stream);
        }
    });
    (addr, count, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blipped_worker_gets_a_fair_share_again_within_the_probe_cap() {
    let discovery = Discovery::with_health(None, SMALL);
    let w1 = start_worker(PrefillEngine::new(1, 4)).await;
    let w2 = start_worker(PrefillEngine::new(2, 4)).await;
    let addr2 = w2.local_addr();
    discovery.add(1, w1.local_addr()).await;
    discovery.add(2, addr2).await;
    discovery.wait_routable(&[1, 2]).await;
    let router = Dispatcher::new(
        discovery.view.clone(),
        PushMode::RoundRobin,
        // The breaker alone: no retry on worker 1 hides the failure.
        PushConfig {
            retry_budget: 0,
            ..PushConfig::default()
        },
    );
    for _ in 0..4 {
        served_by(&router).await.expect("both workers up");
    }
    // Worker 2's listener stops; its registration stays as it is. A request already racing
    // the stop may still be served by it; the first one that meets the stopped worker fails.
    w2.stop().await;
    let mut failed = 0;
    for _ in 0..20 {
        if let Err(e) = served_by(&router).await {
            assert!(
                matches!(e, PushError::Transport { instance: 2, .. }),
                "{e:?}"
            );
            failed += 1;
            break;
        }
    }
    assert_eq!(failed, 1, "a request fails on the stopped worker 2");
    assert!(matches!(
        discovery.view.status(2),
        InstanceStatus::Unhealthy(_)
    ));
    // Its breaker is open: every request goes to worker 1 while worker 2 is down.
    for _ in 0..4 {
        let worker = served_by(&router).await.expect("worker 1 serves");
        assert_eq!(worker, 1, "only worker 1 is routable");
    }
    // It comes back at the same address.
    let w2 = serve(
        rebind(addr2).await,
        PrefillEngine::new(2, 4),
        ServerConfig::default(),
    )
    .expect("serve");
    let back = Instant::now();
    discovery.wait_routable(&[1, 2]).await;
    let recovered = back.elapsed();
    assert!(
        recovered <= SMALL.max + SLACK,
        "routable again after {recovered:?}"
    );
    assert_eq!(discovery.view.open_breakers(), 0);
    let mut to_2 = 0;
    for _ in 0..60 {
        if served_by(&router).await.expect("both workers up") == 2 {
            to_2 += 1;
        }
    }
    assert_eq!(to_2, 30, "round robin over two healthy workers");
    drop(w2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_that_are_not_the_workers_never_make_it_unroutable() {
    let discovery = Discovery::with_health(None, SMALL);
    let (a1, _c1, t1) = counting_listener().await;
    let (a2, _c2, t2) = counting_listener().await;
    discovery.add(1, a1).await;
    discovery.add(2, a2).await;
    discovery.wait_routable(&[1, 2]).await;
    // A poisoned request replayed over every worker, a deadline and overload, many times.
    for round in 0..200 {
        for class in FailureClass::ALL {
            if !class.counts_against_health() {
                discovery.view.report_failure(1 + round % 2, class);
            }
        }
    }
    assert_eq!(discovery.view.open_breakers(), 0);
    assert_eq!(discovery.view.routable().len(), 2);
    // The same through the dispatcher: a client deadline on a silent worker.
    let live = Arc::new(AtomicUsize::new(0));
    let silent = start_worker(Arc::new(SilentEngine { live })).await;
    discovery.add(3, silent.local_addr()).await;
    discovery.wait_routable(&[1, 2, 3]).await;
    let router = Dispatcher::new(
        discovery.view.clone(),
        PushMode::Direct(3),
        PushConfig {
            request_timeout: Some(Duration::from_millis(50)),
            ..PushConfig::default()
        },
    );
    for _ in 0..3 {
        let mut s = router
            .generate(GenerateRequest::new(vec![1], 1))
            .await
            .expect("routed");
        let item = timeout(WAIT, s.next()).await.expect("no hang");
        assert_eq!(item, Some(Err(PushError::Timeout { instance: 3 })));
    }
    assert!(matches!(
        discovery.view.status(3),
        InstanceStatus::Routable(_)
    ));
    // A counting failure does open (the check above is not vacuous).
    discovery
        .view
        .report_failure(1, FailureClass::ConnectionReset);
    assert!(matches!(
        discovery.view.status(1),
        InstanceStatus::Unhealthy(_)
    ));
    t1.abort();
    t2.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_instance_stops_being_probed() {
    // A first delay of at least 50 ms, so the removal below surely lands before the timer.
    let policy = BackoffPolicy {
        initial: Duration::from_millis(100),
        max: Duration::from_millis(200),
    };
    let discovery = Discovery::with_health(None, policy);
    let (addr, probes, task) = counting_listener().await;
    discovery.add(1, addr).await;
    discovery.wait_routable(&[1]).await;
    // An open breaker is probed, and the probe (a connect) closes it.
    discovery
        .view
        .report_failure(1, FailureClass::ConnectionRefused);
    assert_eq!(discovery.view.open_breakers(), 1);
    assert!(wait_count(&probes, 1).await, "probed once");
    discovery.wait_routable(&[1]).await;
    // Opened again, then removed before its timer fires: no probe follows.
    discovery
        .view
        .report_failure(1, FailureClass::ConnectionRefused);
    discovery.remove(1).await;
    // The routable set is already empty (open breaker): wait for the removal itself.
    timeout(WAIT, async {
        while discovery.view.is_discovered(1) {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .expect("removal applied");
    assert_eq!(discovery.view.health(1), None);
    assert_eq!(discovery.view.open_breakers(), 0);
    tokio::time::sleep(policy.max * 3).await;
    assert_eq!(probes.load(Ordering::SeqCst), 1, "no probe after removal");
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_view_stops_probing() {
    let (addr, probes, task) = counting_listener().await;
    let discovery = Discovery::with_health(None, SMALL);
    discovery.add(1, addr).await;
    discovery.wait_routable(&[1]).await;
    discovery
        .view
        .report_failure(1, FailureClass::ConnectionRefused);
    // Dropping the feed (its token) and the last clone of the view stops the pending timer.
    drop(discovery);
    tokio::time::sleep(SMALL.max * 3).await;
    assert_eq!(probes.load(Ordering::SeqCst), 0, "no probe after the drop");
    task.abort();
}
