//! A lost connection drops its worker's KV index entries, and the check catches the mutant that
//! keeps them (stale credit for a cache the router no longer hears about).

use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::advert::KvRouterConfig;
use crate::discovery::{EndpointId, Instance, InstanceEvent};
use crate::health::BackoffPolicy;
use crate::push::{DispatchMutant, Dispatcher, PushConfig, PushMode, RoutableView};
use crate::request::GenerateRequest;
use crate::test_engine::TestPrefill;
use crate::transport::{serve_with_kv_events, ServerConfig};

const WAIT: Duration = Duration::from_secs(10);

/// Index a worker's events over TCP, stop the worker's server, and report whether the router
/// dropped the worker's entries within two seconds of that.
async fn entries_dropped_after_disconnect(mutant: bool) -> bool {
    let engine = TestPrefill::with_kv_events(4, 4, 1);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let server = serve_with_kv_events(listener, engine.clone(), ServerConfig::default(), engine)
        .expect("serve");
    let (tx, mut rx) = mpsc::channel::<InstanceEvent>(4);
    let cancel = CancellationToken::new();
    let view = RoutableView::spawn_with(
        futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)),
        None,
        cancel.clone(),
        BackoffPolicy::default(),
    );
    tx.send(InstanceEvent::Added(Instance {
        endpoint: EndpointId::new("t", "prefill", "generate"),
        instance_id: 4,
        address: server.local_addr(),
    }))
    .await
    .expect("view alive");
    tokio::time::timeout(WAIT, view.wait_for(|r| r.len() == 1))
        .await
        .expect("routable");
    let mode = PushMode::Kv {
        block_size: 4,
        config: KvRouterConfig::default(),
    };
    let mut router = Dispatcher::new(view, mode, PushConfig::default());
    if mutant {
        router = router.with_mutant(DispatchMutant::KeepKvOnReconnect);
    }
    let mut s = router
        .generate_direct(4, GenerateRequest::new((0..16).collect(), 1))
        .await
        .expect("sent");
    assert!(matches!(
        tokio::time::timeout(WAIT, s.next()).await,
        Ok(Some(Ok(_)))
    ));
    let indexed = tokio::time::timeout(WAIT, async {
        while !router.kv_indexed(4) {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
    assert!(indexed.is_ok(), "the worker's events reached the index");
    server.stop().await;
    let dropped = tokio::time::timeout(Duration::from_secs(2), async {
        while router.kv_indexed(4) {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .is_ok();
    cancel.cancel();
    dropped
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnect_drops_the_workers_kv_entries() {
    assert!(entries_dropped_after_disconnect(false).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_check_catches_the_mutant_that_keeps_kv_entries_across_a_reconnect() {
    assert!(!entries_dropped_after_disconnect(true).await);
}

/// Only the worker's pooled connection applies batches or, by closing, resets it: a replaced
/// connection's late batches and close change nothing, and adopting a new one drops the old
/// one's credit.
#[tokio::test(flavor = "current_thread")]
async fn only_the_workers_current_connection_feeds_or_resets_its_entries() {
    use std::sync::Arc;

    use parking_lot::Mutex;

    use crate::hooks::Seam;
    use crate::kv_events::{EventBatch, KvEvent};
    use crate::push::kv::KvSelector;
    use crate::push::kv_feed::KvFeed;

    let (_tx, mut rx) = mpsc::channel::<InstanceEvent>(1);
    let cancel = CancellationToken::new();
    let view = RoutableView::spawn_with(
        futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)),
        None,
        cancel.clone(),
        BackoffPolicy::default(),
    );
    view.apply(InstanceEvent::Added(Instance {
        endpoint: EndpointId::new("t", "prefill", "generate"),
        instance_id: 4,
        address: "127.0.0.1:9".parse().expect("addr"),
    }));
    let kv = Arc::new(Mutex::new(KvSelector::new(
        4,
        &KvRouterConfig::default(),
        1024,
    )));
    let board = Arc::default();
    let feed = Arc::new(KvFeed::new(
        Arc::clone(&kv),
        view,
        Seam::off(),
        (board, Box::new(|| {})),
    ));
    let indexed = || kv.lock().index().publishes(4);
    let batch = |seq| EventBatch {
        epoch: 1,
        seq,
        events: vec![KvEvent::Stored {
            parent: None,
            blocks: vec![11, 12],
        }],
    };

    let (old, g1) = feed.sink(4);
    feed.adopt(4, g1);
    old.batch(batch(0));
    assert!(indexed());
    let (new, g2) = feed.sink(4);
    new.batch(batch(1));
    assert_eq!(feed.counts().stale(), 1, "not pooled yet: ignored");
    feed.adopt(4, g2);
    assert!(!indexed(), "a replaced connection's credit is dropped");
    new.batch(batch(0));
    assert!(indexed());
    old.batch(batch(1));
    old.closed();
    assert!(
        indexed(),
        "the old connection's late batch and close change nothing"
    );
    assert_eq!(feed.counts().stale(), 2);
    new.closed();
    assert!(!indexed());
    cancel.cancel();
}
