//! The KV retry takes the next-best worker, and the check catches the mutant whose retries
//! reuse the failed worker (an overloaded worker stays routable, so only the exclusion keeps a
//! retry away from it).

use std::collections::BTreeSet;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::advert::KvRouterConfig;
use crate::discovery::{EndpointId, Instance, InstanceEvent, InstanceId};
use crate::health::{BackoffPolicy, FailureClass};
use crate::push::{DispatchMutant, Dispatcher, PushConfig, PushError, PushMode, RoutableView};
use crate::request::GenerateRequest;
use crate::test_engine::TestPrefill;
use crate::transport::{serve, ServerConfig, ServerHandle};

const WAIT: Duration = Duration::from_secs(10);

/// A test worker on loopback, serving at most `max_in_flight` requests at once (0: it answers
/// every request "overloaded").
pub(super) async fn worker(id: InstanceId, max_in_flight: usize) -> ServerHandle {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    serve(
        listener,
        TestPrefill::new(id),
        ServerConfig {
            max_in_flight,
            ..ServerConfig::default()
        },
    )
    .expect("serve")
}

/// `server` discovered as instance `id`.
pub(super) fn added(id: InstanceId, server: &ServerHandle) -> InstanceEvent {
    InstanceEvent::Added(Instance {
        endpoint: EndpointId::new("t", "prefill", "generate"),
        instance_id: id,
        address: server.local_addr(),
    })
}

/// Wait (bounded) until `view` routes `n` instances.
pub(super) async fn wait_routable(view: &RoutableView, n: usize) {
    tokio::time::timeout(WAIT, view.wait_for(|r| r.len() == n))
        .await
        .expect("view caught up");
}

/// Worker 1 answers every request "overloaded"; workers 2 and 3 serve. A prompt whose blocks
/// the KV selector attributes to worker 1 is routed there first, then retried. Returns the
/// result of that request and the dispatcher.
async fn overloaded_best_worker(mutant: bool) -> (Result<InstanceId, PushError>, Dispatcher) {
    let (tx, mut rx) = mpsc::channel::<InstanceEvent>(16);
    let cancel = CancellationToken::new();
    let view = RoutableView::spawn_with(
        futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)),
        None,
        cancel.clone(),
        BackoffPolicy::default(),
    );
    let w1 = worker(1, 0).await;
    let w2 = worker(2, 1024).await;
    let w3 = worker(3, 1024).await;
    let mut dispatcher = Dispatcher::new(
        view.clone(),
        PushMode::Kv {
            block_size: 16,
            // Overlap against load alone (no keep credit, no recent work): a retry on the
            // failed worker would pick it again, which is what the mutant check needs.
            config: KvRouterConfig::load_only(),
        },
        PushConfig::default(),
    );
    if mutant {
        dispatcher = dispatcher.with_mutant(DispatchMutant::ReuseFailed);
    }
    let prompt: Vec<u32> = (0..64).collect();
    // Only worker 1 discovered: the selector attributes the prompt's blocks to it.
    tx.send(added(1, &w1)).await.expect("view alive");
    wait_routable(&view, 1).await;
    let first = dispatcher
        .select(&GenerateRequest::new(prompt.clone(), 1))
        .expect("picked");
    assert_eq!(first.instance_id, 1);
    tx.send(added(2, &w2)).await.expect("view alive");
    tx.send(added(3, &w3)).await.expect("view alive");
    wait_routable(&view, 3).await;
    let result = async {
        let mut s = tokio::time::timeout(
            WAIT,
            dispatcher.generate(GenerateRequest::new(prompt.clone(), 1)),
        )
        .await
        .expect("in time")?;
        let response = s.next().await.expect("a response")?;
        let worker = response.prefill.expect("handoff").worker;
        assert_eq!(worker, s.instance_id());
        Ok(worker)
    }
    .await;
    cancel.cancel();
    (result, dispatcher)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_kv_a_retry_takes_the_next_best_worker_never_the_failed_one() {
    let (result, dispatcher) = overloaded_best_worker(false).await;
    let worker = result.expect("retried on the next best");
    assert!(BTreeSet::from([2, 3]).contains(&worker), "{worker}");
    assert_eq!(dispatcher.retry_counts().get(FailureClass::Overloaded), 1);
    assert_eq!(
        dispatcher.view().open_breakers(),
        0,
        "overload opens nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_check_catches_retries_that_reuse_the_failed_worker() {
    let (result, _) = overloaded_best_worker(true).await;
    let Err(PushError::Exhausted { attempts }) = result else {
        panic!("the mutant must fail every attempt on worker 1: {result:?}");
    };
    assert!(attempts.iter().all(|a| a.instance == 1), "{attempts:?}");
}
