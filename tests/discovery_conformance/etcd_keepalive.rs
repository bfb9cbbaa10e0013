//! Keep-alive pings within etcd's defaults (issue #27 item 9): etcd's default
//! `--grpc-keepalive-min-time` is 5 s, and it answers a client that pings more often (or at
//! all without an open stream) with GOAWAY `too_many_pings`, dropping the connection and every
//! watch on it. Against the CI etcd (started with the default keep-alive settings), a
//! frontend's quiet watch and a worker's lease must live through a quiet period with no
//! reconnect and no "unreachable" report.

use super::*;
use prefill_router::discovery::{EtcdConfig, EtcdDiscovery};

/// Watch and register for `quiet`, then check the store never looked unreachable and the
/// watch saw nothing but the first registration (no resync, no removal).
async fn quiet_period(quiet: Duration) {
    let Some(url) = etcd_harness::endpoint() else {
        return;
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let config = EtcdConfig::new([url])
        .with_root(format!("keepalive-{}-{nanos}/", std::process::id()))
        .with_ttl(Duration::from_secs(10));
    // Two clients, as two processes would have: the frontend only watches (its connection
    // carries a quiet stream: the case GOAWAY hit), the worker only keeps its lease alive.
    let frontend = EtcdDiscovery::connect(config.clone()).await.unwrap();
    let worker = EtcdDiscovery::connect(config).await.unwrap();
    let ep = endpoint("ns", "prefill");
    let a = instance(&ep, 1);
    let _registration = worker
        .register(a.clone(), card("m", SelectionMode::KV))
        .await
        .unwrap();
    let mut watch = frontend.watch(&ep).await.unwrap();
    let first = tokio::time::timeout(EVENT_WAIT, watch.next())
        .await
        .expect("the registration in time");
    assert_eq!(first, Some(InstanceEvent::Added(a.clone())));
    let statuses = [frontend.store_status(), worker.store_status()];
    let started = Instant::now();
    // Anything on the watch during the quiet period is a resync's doing (or a lost lease).
    match tokio::time::timeout(quiet, watch.next()).await {
        Err(_) => {}
        Ok(event) => panic!(
            "the watch saw {event:?} after {:?} of a quiet period",
            started.elapsed()
        ),
    }
    for (who, status) in ["frontend", "worker"].iter().zip(&statuses) {
        let status = status.borrow().clone();
        assert!(
            status.reachable && status.outages == 0,
            "{who}: the store looked unreachable during a quiet {quiet:?}: {status:?}"
        );
    }
    assert_eq!(frontend.list_instances(&ep).await.unwrap(), vec![a]);
}

/// 20 s: more than two of the old 2 s pinger's GOAWAY cycles (one every ~6-8 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_keepalive_a_quiet_watch_and_lease_keep_their_connection() {
    quiet_period(Duration::from_secs(20)).await;
}

/// The quiet minute the issue asks for (too slow for every CI run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a quiet minute; run with --ignored against PREFILL_ETCD_ENDPOINT"]
async fn etcd_keepalive_a_quiet_minute() {
    quiet_period(Duration::from_secs(60)).await;
}
