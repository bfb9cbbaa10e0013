//! The dispatcher's KV index follows admission (a worker that leaves it loses its indexed
//! entries and its events are ignored until it is back), and takes a snapshot in-process.

use std::collections::BTreeSet;

use crate::advert::KvRouterConfig;
use crate::discovery::{EndpointId, Instance, InstanceEvent, InstanceId};
use crate::kv_events::{Applied, EventBatch, EventPublisher, KvEvent, KvSnapshot};
use crate::push::{block_hashes, Dispatcher, PushConfig, PushMode, RoutableView};
use crate::request::GenerateRequest;

fn stored(seq: u64, blocks: &[u64]) -> EventBatch {
    EventBatch {
        epoch: 1,
        seq,
        events: vec![KvEvent::Stored {
            parent: None,
            blocks: blocks.to_vec(),
        }],
    }
}

fn instance(id: InstanceId) -> Instance {
    Instance {
        endpoint: EndpointId::new("t", "prefill", "generate"),
        instance_id: id,
        address: std::net::SocketAddr::from(([127, 0, 0, 1], 1)),
    }
}

/// A view of workers 1 and 2, both admitted, and the sender that changes admission.
fn admitted_view() -> (
    tokio::sync::watch::Sender<BTreeSet<InstanceId>>,
    RoutableView,
) {
    let (admit, admitted) = tokio::sync::watch::channel(BTreeSet::from([1, 2]));
    let cancel = tokio_util::sync::CancellationToken::new();
    let view = RoutableView::spawn(futures_util::stream::pending(), Some(admitted), cancel);
    view.apply(InstanceEvent::Added(instance(1)));
    view.apply(InstanceEvent::Added(instance(2)));
    (admit, view)
}

/// A KV dispatcher over `view` (blocks of 4 tokens).
fn kv_dispatcher(view: RoutableView) -> Dispatcher {
    let mode = PushMode::Kv {
        block_size: 4,
        config: KvRouterConfig::default(),
    };
    Dispatcher::new(view, mode, PushConfig::default())
}

#[tokio::test]
async fn a_worker_leaving_admission_drops_its_indexed_entries() {
    let (admit, view) = admitted_view();
    let dispatcher = kv_dispatcher(view);
    let tokens: Vec<u32> = (0..12).collect();
    let hashes = block_hashes(&tokens, 4);
    let mut publisher = EventPublisher::new(1);
    let mut parent = None;
    for &h in &hashes {
        publisher.stored(parent, h);
        parent = Some(h);
    }
    for batch in publisher.take_batches() {
        assert_eq!(
            dispatcher.apply_kv_events(2, &batch),
            Some(Applied::Started)
        );
    }
    let request = GenerateRequest::new(tokens, 1);
    assert_eq!(dispatcher.select(&request).unwrap().instance_id, 2);
    // Worker 2 leaves admission: the next selection prunes it, and its later events are
    // ignored while it is out.
    admit.send_replace(BTreeSet::from([1]));
    assert_eq!(dispatcher.select(&request).unwrap().instance_id, 1);
    assert!(!dispatcher.kv_indexed(2));
    assert_eq!(dispatcher.apply_kv_events(2, &stored(1, &hashes)), None);
    assert!(!dispatcher.kv_indexed(2));
    // Back in admission, it starts afresh from its next batch.
    admit.send_replace(BTreeSet::from([1, 2]));
    assert_eq!(
        dispatcher.apply_kv_events(2, &stored(2, &hashes)),
        Some(Applied::Started)
    );
}

/// An in-process snapshot (a late-joining frontend's, with no connection to ask on) gives the
/// dispatcher a worker's whole cache before any batch: the next pick credits it, and live
/// batches then follow the sequence rule from the snapshot's `seq`.
#[tokio::test]
async fn an_in_process_snapshot_credits_the_worker_before_any_batch() {
    let (_admit, view) = admitted_view();
    let dispatcher = kv_dispatcher(view.clone());
    let tokens: Vec<u32> = (0..12).collect();
    let hashes = block_hashes(&tokens, 4);
    let snapshot = KvSnapshot {
        epoch: 1,
        seq: Some(4),
        chains: vec![KvEvent::Stored {
            parent: None,
            blocks: hashes.clone(),
        }],
    };
    assert!(!dispatcher.kv_indexed(2));
    assert_eq!(
        dispatcher.apply_kv_snapshot(2, &snapshot),
        Some(Applied::Started)
    );
    assert!(dispatcher.kv_indexed(2));
    let counts = dispatcher.kv_event_counts().expect("KV mode counts events");
    assert_eq!(
        (counts.snapshots_applied(), counts.snapshots_failed()),
        (1, 0)
    );
    let request = GenerateRequest::new(tokens, 1);
    assert_eq!(dispatcher.select(&request).unwrap().instance_id, 2);
    // Batches the snapshot covers are stale; the next one is in order.
    assert_eq!(
        dispatcher.apply_kv_events(2, &stored(4, &hashes)),
        Some(Applied::Stale)
    );
    assert_eq!(
        dispatcher.apply_kv_events(2, &stored(5, &hashes)),
        Some(Applied::InOrder)
    );
    // A worker outside admission gets nothing from a snapshot.
    assert_eq!(
        dispatcher.apply_kv_snapshot(3, &snapshot),
        Some(Applied::Overflowed)
    );
    assert!(!dispatcher.kv_indexed(3));
    assert_eq!(counts.snapshots_failed(), 1);
    // Outside KV mode there is no index to apply it to.
    let plain = Dispatcher::new(view, PushMode::RoundRobin, PushConfig::default());
    assert_eq!(plain.apply_kv_snapshot(2, &snapshot), None);
}
