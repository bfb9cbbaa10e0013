//! The send seam: a dispatcher built `with_link` runs its own pick, booking, retry elsewhere and
//! release around whatever the link does, and tells the link each attempt's number and the
//! workers the request already failed on.

use std::net::SocketAddr;
use std::sync::Arc;

use futures_util::StreamExt;
use parking_lot::Mutex;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::advert::KvRouterConfig;
use crate::discovery::{EndpointId, Instance, InstanceEvent, InstanceId};
use crate::health::{BackoffPolicy, FailureClass};
use crate::push::{
    Dispatch, Dispatcher, PushConfig, PushError, PushMode, RoutableView, WorkerLink,
};
use crate::request::{GenerateRequest, GenerateResponse};
use crate::transport::TransportError;

/// Refuses the connection on the workers in `down`, answers on the others; records every
/// attempt as (instance, attempt number, failed so far).
#[derive(Default)]
struct Recording {
    down: Mutex<Vec<InstanceId>>,
    seen: Mutex<Vec<(InstanceId, u32, Vec<InstanceId>)>>,
}

type Responses =
    futures_util::stream::Iter<std::vec::IntoIter<Result<GenerateResponse, TransportError>>>;

impl WorkerLink for Arc<Recording> {
    type Stream = Responses;

    async fn open(
        &self,
        dispatch: Dispatch<'_>,
        _request: GenerateRequest,
        _deadline: Option<Instant>,
    ) -> Result<Responses, TransportError> {
        let id = dispatch.instance.instance_id;
        let failed = dispatch.failed.to_vec();
        self.seen.lock().push((id, dispatch.attempt, failed));
        if self.down.lock().contains(&id) {
            return Err(TransportError::Connect {
                addr: dispatch.instance.address,
                reason: "refused".into(),
            });
        }
        let response = GenerateResponse {
            token_ids: vec![u32::try_from(id).unwrap_or(0)],
            ..GenerateResponse::default()
        };
        Ok(futures_util::stream::iter(vec![Ok(response)]))
    }
}

fn view(ids: &[InstanceId]) -> RoutableView {
    let view = RoutableView::spawn_with(
        futures_util::stream::pending(),
        None,
        CancellationToken::new(),
        BackoffPolicy::default(),
    );
    for &id in ids {
        view.apply(InstanceEvent::Added(Instance {
            endpoint: EndpointId::new("t", "prefill", "generate"),
            instance_id: id,
            address: SocketAddr::from(([127, 0, 0, 1], 1)),
        }));
    }
    view
}

#[tokio::test]
async fn a_refused_attempt_is_retried_elsewhere_through_the_same_link() {
    let link = Arc::new(Recording {
        down: Mutex::new(vec![1, 3]),
        ..Recording::default()
    });
    let view = view(&[1, 2, 3]);
    let push = Dispatcher::with_link(
        view.clone(),
        PushMode::RoundRobin,
        PushConfig::default(),
        Arc::clone(&link),
    );
    let mut stream = push
        .generate(GenerateRequest::new(vec![1, 2, 3], 1))
        .await
        .expect("worker 2 answers");
    assert_eq!(stream.instance_id(), 2);
    let first = stream.next().await.expect("one response").expect("ok");
    assert_eq!(first.token_ids, vec![2]);
    // Round robin over what is left: 1 of {1, 2, 3}, then 3 of {2, 3}, then 2.
    assert_eq!(
        *link.seen.lock(),
        vec![(1, 0, vec![]), (3, 1, vec![1]), (2, 2, vec![1, 3])]
    );
    // The dispatcher, not the link, reported the refusals (breakers open) and counted retries.
    assert_eq!(push.retry_counts().get(FailureClass::ConnectionRefused), 2);
    let routable: Vec<InstanceId> = view.routable().iter().map(|i| i.instance_id).collect();
    assert_eq!(routable, vec![2]);
}

#[tokio::test]
async fn a_kv_booking_lives_in_the_stream_and_a_failed_attempt_releases_its_own() {
    let link = Arc::new(Recording::default());
    // Overlap against booked work alone, so that the prefix alone draws the second request.
    let mode = PushMode::Kv {
        block_size: 4,
        config: KvRouterConfig::load_only(),
    };
    let push = Dispatcher::with_link(
        view(&[1, 2]),
        mode,
        PushConfig::default(),
        Arc::clone(&link),
    );
    let request = GenerateRequest::new((0..32).collect(), 1);
    let Ok(stream) = push.generate(request.clone()).await else {
        panic!("both workers answer");
    };
    // The prompt is now credited to `best`, which then goes down: the same prompt goes there
    // first (its whole prefix), is refused, and is retried on the other worker.
    let best = stream.instance_id();
    drop(stream);
    assert_eq!(push.total_booked_work(), 0);
    link.down.lock().push(best);
    let Ok(stream) = push.generate(request).await else {
        panic!("the other worker answers");
    };
    let other = stream.instance_id();
    assert_ne!(other, best);
    let seen: Vec<InstanceId> = link.seen.lock().iter().map(|s| s.0).collect();
    assert_eq!(seen, vec![best, best, other]);
    // Only the serving attempt's booking is left, on the worker that serves, until the end.
    assert!(push.booked_work(other) > 0);
    assert_eq!(push.total_booked_work(), push.booked_work(other));
    drop(stream);
    assert_eq!(push.total_booked_work(), 0);
}

#[tokio::test]
async fn a_request_failed_everywhere_lists_its_attempts() {
    let link = Arc::new(Recording {
        down: Mutex::new(vec![1, 2]),
        ..Recording::default()
    });
    let push = Dispatcher::with_link(
        view(&[1, 2]),
        PushMode::RoundRobin,
        PushConfig::default(),
        link,
    );
    match push.generate(GenerateRequest::new(vec![1], 1)).await {
        Err(PushError::Exhausted { attempts }) => {
            let tried: Vec<InstanceId> = attempts.iter().map(|a| a.instance).collect();
            assert_eq!(tried, vec![1, 2]);
        }
        other => panic!("expected both attempts listed, got {other:?}"),
    }
}

#[tokio::test]
async fn a_held_selection_is_sent_through_the_link_with_its_booking_in_the_stream() {
    let link = Arc::new(Recording::default());
    let view = view(&[1, 2]);
    let push = Dispatcher::with_link(
        view.clone(),
        PushMode::Kv {
            block_size: 4,
            config: KvRouterConfig::default(),
        },
        PushConfig::default(),
        Arc::clone(&link),
    );
    let request = GenerateRequest::new((0..32).collect(), 1);
    let selection = push.select_held(&request).expect("a worker");
    let picked = selection.instance().instance_id;
    let booked = selection.booked_work().expect("KV mode books");
    let overlap = selection.expected_overlap_blocks();
    let stream = push
        .dispatch_held(selection, request.clone())
        .await
        .expect("the picked worker answers");
    // The very pick, sent once as a first attempt; the booking moved into the stream.
    assert_eq!(stream.instance_id(), picked);
    assert_eq!(stream.expected_overlap_blocks(), overlap);
    assert_eq!(*link.seen.lock(), vec![(picked, 0, vec![])]);
    assert_eq!(push.booked_work(picked), booked);
    drop(stream);
    assert_eq!(push.total_booked_work(), 0);
    // A pick whose worker is no longer routable is not sent, and its booking goes.
    let selection = push.select_held(&request).expect("a worker");
    let gone = selection.instance().instance_id;
    view.apply(InstanceEvent::Removed(gone));
    match push.dispatch_held(selection, request).await {
        Err(PushError::InstanceGone(id)) => assert_eq!(id, gone),
        other => panic!("expected the worker gone, got {other:?}"),
    }
    assert_eq!(link.seen.lock().len(), 1);
    assert_eq!(push.total_booked_work(), 0);
}
