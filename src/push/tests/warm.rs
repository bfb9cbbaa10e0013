//! Eager connects in KV mode: a worker entering the routable view is connected, subscribed to
//! and asked for its snapshot before any request goes to it; a refused eager connect counts as
//! a refused request-path connect does; modes without KV events stay lazy.

use std::net::SocketAddr;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::advert::KvRouterConfig;
use crate::discovery::{EndpointId, Instance, InstanceEvent, InstanceId};
use crate::health::{BackoffPolicy, Breaker};
use crate::push::{Dispatcher, PushConfig, PushMode, RoutableView};
use crate::test_engine::TestPrefill;
use crate::transport::{serve_with_kv_events, ServerConfig, ServerHandle};

const WAIT: Duration = Duration::from_secs(10);

fn instance(id: InstanceId, address: SocketAddr) -> Instance {
    Instance {
        endpoint: EndpointId::new("t", "prefill", "generate"),
        instance_id: id,
        address,
    }
}

async fn worker(id: InstanceId) -> ServerHandle {
    let engine = TestPrefill::with_kv_events(id, 4, 1);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    serve_with_kv_events(listener, engine.clone(), ServerConfig::default(), engine).expect("serve")
}

fn kv_mode() -> PushMode {
    PushMode::Kv {
        block_size: 4,
        config: KvRouterConfig::default(),
    }
}

fn view() -> (RoutableView, CancellationToken) {
    let cancel = CancellationToken::new();
    let view = RoutableView::spawn_with(
        futures_util::stream::pending(),
        None,
        cancel.clone(),
        BackoffPolicy::default(),
    );
    (view, cancel)
}

/// Poll (bounded) until `cond` holds.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let ok = tokio::time::timeout(WAIT, async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .is_ok();
    assert!(ok, "never: {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_entering_the_view_is_connected_before_any_request() {
    let server = worker(4).await;
    let (view, cancel) = view();
    let router = Dispatcher::new(view.clone(), kv_mode(), PushConfig::default());
    let lazy = Dispatcher::new(view.clone(), PushMode::RoundRobin, PushConfig::default());
    let counts = router.kv_event_counts().expect("KV mode").clone();
    // The worker enters the view after the dispatcher was built; no request is sent.
    let w4 = instance(4, server.local_addr());
    view.apply(InstanceEvent::Added(w4.clone()));
    eventually("connected, subscribed and asked for a snapshot", || {
        router.link().is_connected(&w4) && counts.snapshots_requested() == 1
    })
    .await;
    // TestPrefill takes no snapshots: the answer arrived over the subscribed connection.
    eventually("the snapshot answered", || counts.snapshots_failed() == 1).await;
    assert!(
        !lazy.link().is_connected(&w4),
        "without KV events there is nothing to warm: connections stay lazy"
    );
    // One attempt per worker: later view changes do not dial a connected worker again.
    let other = worker(5).await;
    let w5 = instance(5, other.local_addr());
    view.apply(InstanceEvent::Added(w5.clone()));
    eventually("the second worker connected too", || {
        router.link().is_connected(&w5) && counts.snapshots_requested() == 2
    })
    .await;
    assert!(router.link().is_connected(&w4));
    cancel.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_eager_connect_opens_the_breaker_as_a_refused_request_does() {
    // An address nothing listens on.
    let refused = {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        listener.local_addr().expect("addr")
    };
    let (view, cancel) = view();
    let _router = Dispatcher::new(view.clone(), kv_mode(), PushConfig::default());
    view.apply(InstanceEvent::Added(instance(9, refused)));
    eventually("the breaker opened", || {
        !matches!(view.health(9), Some(Breaker::Closed) | None)
    })
    .await;
    assert!(view.routable().is_empty());
    cancel.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_dispatcher_connects_nothing_more() {
    let server = worker(6).await;
    let (view, cancel) = view();
    let router = Dispatcher::new(view.clone(), kv_mode(), PushConfig::default());
    let counts = router.kv_event_counts().expect("KV mode").clone();
    drop(router);
    view.apply(InstanceEvent::Added(instance(6, server.local_addr())));
    // A live dispatcher connects within milliseconds (the test above); give a dropped one's
    // task, were it still running, ample time to do so.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(counts.snapshots_requested(), 0);
    cancel.cancel();
}
