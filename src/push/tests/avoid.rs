//! A migrated stream's continuation steers away from the workers it broke on
//! ([`Dispatcher::generate_avoiding`]) while any other is routable, and falls back to them when
//! none is: the KV pick that would choose the avoided worker (it holds the prompt) takes the
//! next best, and nothing is counted as a failure.

use std::collections::BTreeSet;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::retry::{added, wait_routable, worker};
use crate::advert::KvRouterConfig;
use crate::discovery::{InstanceEvent, InstanceId};
use crate::health::BackoffPolicy;
use crate::push::{DispatchMutant, Dispatcher, PushConfig, PushError, PushMode, RoutableView};
use crate::request::GenerateRequest;
use crate::transport::{ServerConfig, ServerHandle};

const WAIT: Duration = Duration::from_secs(10);

/// The worker that served `request` sent while avoiding `avoid`.
async fn served_by(
    dispatcher: &Dispatcher,
    request: GenerateRequest,
    avoid: &[InstanceId],
) -> Result<InstanceId, PushError> {
    let mut stream = tokio::time::timeout(WAIT, dispatcher.generate_avoiding(request, avoid))
        .await
        .expect("in time")?;
    let response = stream.next().await.expect("a response")?;
    let worker = response
        .prefill
        .expect("the test worker says who it is")
        .worker;
    assert_eq!(worker, stream.instance_id());
    Ok(worker)
}

/// What a test holds for its life: the workers and the discovery feed.
type Held = (Vec<ServerHandle>, mpsc::Sender<InstanceEvent>);

/// Three workers under the KV mode; worker 1 holds the prompt (it was the only one when the
/// prompt was first routed), so every plain pick of it chooses worker 1.
async fn kv_pool_where_worker_1_holds_the_prompt(
    cancel: &CancellationToken,
    mutant: Option<DispatchMutant>,
) -> (Dispatcher, Vec<u32>, Held) {
    let (tx, mut rx) = mpsc::channel::<InstanceEvent>(16);
    let view = RoutableView::spawn_with(
        futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)),
        None,
        cancel.clone(),
        BackoffPolicy::default(),
    );
    let mut servers = Vec::new();
    for id in 1..=3 {
        servers.push(worker(id, ServerConfig::default().max_in_flight).await);
    }
    let mut dispatcher = Dispatcher::new(
        view.clone(),
        PushMode::Kv {
            block_size: 16,
            // Overlap against load alone: the holder wins every plain pick.
            config: KvRouterConfig::load_only(),
        },
        PushConfig::default(),
    );
    if let Some(mutant) = mutant {
        dispatcher = dispatcher.with_mutant(mutant);
    }
    let prompt: Vec<u32> = (0..64).collect();
    tx.send(added(1, &servers[0])).await.expect("view alive");
    wait_routable(&view, 1).await;
    let first = served_by(&dispatcher, GenerateRequest::new(prompt.clone(), 1), &[]).await;
    assert_eq!(first, Ok(1));
    for (id, server) in [(2, &servers[1]), (3, &servers[2])] {
        tx.send(added(id, server)).await.expect("view alive");
    }
    wait_routable(&view, 3).await;
    (dispatcher, prompt, (servers, tx))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuation_never_lands_on_a_worker_it_avoids_while_another_is_routable() {
    let cancel = CancellationToken::new();
    let (dispatcher, prompt, _held) = kv_pool_where_worker_1_holds_the_prompt(&cancel, None).await;
    let request = || GenerateRequest::new(prompt.clone(), 1);
    // The control: without `avoid`, the holder takes it (so the avoidance below is the
    // steering, not chance).
    assert_eq!(served_by(&dispatcher, request(), &[]).await, Ok(1));
    for _ in 0..8 {
        let worker = served_by(&dispatcher, request(), &[1])
            .await
            .expect("served");
        assert!(BTreeSet::from([2, 3]).contains(&worker), "{worker}");
    }
    assert_eq!(served_by(&dispatcher, request(), &[1, 2]).await, Ok(3));
    // Avoiding is not failing: no retry, no breaker.
    assert_eq!(dispatcher.retry_counts().total(), 0);
    assert_eq!(dispatcher.view().open_breakers(), 0);
    cancel.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_only_avoided_workers_are_routable_one_of_them_takes_the_continuation() {
    let cancel = CancellationToken::new();
    let (dispatcher, prompt, _held) = kv_pool_where_worker_1_holds_the_prompt(&cancel, None).await;
    let worker = served_by(&dispatcher, GenerateRequest::new(prompt, 1), &[1, 2, 3])
        .await
        .expect("served by an avoided worker rather than refused");
    // Among the avoided workers the mode's own pick: the holder.
    assert_eq!(worker, 1);
    cancel.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_check_catches_picks_that_ignore_what_a_continuation_avoids() {
    let cancel = CancellationToken::new();
    let (dispatcher, prompt, _held) =
        kv_pool_where_worker_1_holds_the_prompt(&cancel, Some(DispatchMutant::IgnoresAvoid)).await;
    let worker = served_by(&dispatcher, GenerateRequest::new(prompt, 1), &[1]).await;
    assert_eq!(worker, Ok(1), "the mutant returns to the avoided holder");
    cancel.cancel();
}
