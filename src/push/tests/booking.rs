//! Booked work: it returns exactly to zero over any interleaving of picks, ends, failures,
//! retries and worker removals; the overload queue admits a waiter as soon as room opens and
//! never outlives the pressure (paused clock).

use std::time::Duration;

use proptest::prelude::*;
use tokio_util::sync::CancellationToken;

use crate::advert::KvRouterConfig;
use crate::discovery::{EndpointId, Instance, InstanceEvent, InstanceId};
use crate::push::load_board::BoardMutant;
use crate::push::select::CostMutant;
use crate::push::{
    Dispatch, HeldPick, LoadBoard, PushConfig, PushError, PushMode, RoutableView, WorkerLink,
};
use crate::request::{GenerateRequest, GenerateResponse};
use crate::transport::TransportError;

/// A link that reaches nobody. These tests only pick and hold: the workers' addresses are
/// fake, and a TCP link in KV mode would dial them eagerly and open their breakers.
pub(super) struct Unreached;

impl WorkerLink for Unreached {
    type Stream = futures_util::stream::Empty<Result<GenerateResponse, TransportError>>;

    async fn open(
        &self,
        _dispatch: Dispatch<'_>,
        _request: GenerateRequest,
        _deadline: Option<tokio::time::Instant>,
    ) -> Result<Self::Stream, TransportError> {
        Err(TransportError::Timeout)
    }
}

pub(super) type Dispatcher = crate::push::Dispatcher<Unreached>;

pub(super) fn instance(id: InstanceId) -> Instance {
    Instance {
        endpoint: EndpointId::new("t", "prefill", "generate"),
        instance_id: id,
        address: std::net::SocketAddr::from(([127, 0, 0, 1], 1)),
    }
}

/// Run `f` inside a tokio runtime (the routable view spawns its event task).
pub(super) fn in_runtime<T>(f: impl FnOnce() -> T) -> T {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let _enter = runtime.enter();
    f()
}

fn kv_dispatcher(workers: &[InstanceId], kv: KvRouterConfig, config: PushConfig) -> Dispatcher {
    let view = RoutableView::spawn(
        futures_util::stream::pending(),
        None,
        CancellationToken::new(),
    );
    for &id in workers {
        view.apply(InstanceEvent::Added(instance(id)));
    }
    let mode = PushMode::Kv {
        block_size: 4,
        config: kv,
    };
    Dispatcher::with_link(view, mode, config, Unreached)
}

/// A prompt of `blocks` blocks of 4 tokens; chains `c < 3` share their first two blocks.
fn prompt(chain: u32, blocks: u32) -> GenerateRequest {
    let tokens = (0..blocks * 4)
        .map(|t| {
            if chain < 3 && t < 8 {
                t
            } else {
                chain << 16 | t
            }
        })
        .collect();
    GenerateRequest::new(tokens, 1)
}

#[derive(Clone, Debug)]
enum Op {
    /// Pick and hold (a prefill starts).
    Pick {
        chain: u32,
        blocks: u32,
    },
    /// The held pick at this position ends: success, failure or cancel (all drop it).
    End(usize),
    /// The held pick at this position fails and is retried elsewhere: its booking goes, a new
    /// pick excluding its worker takes its place.
    Retry(usize),
    /// A worker leaves discovery (its held picks stay held) or comes back.
    Remove(InstanceId),
    Add(InstanceId),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..6u32, 1..6u32).prop_map(|(chain, blocks)| Op::Pick { chain, blocks }),
        2 => (0..16usize).prop_map(Op::End),
        1 => (0..16usize).prop_map(Op::Retry),
        1 => (1..5u64).prop_map(Op::Remove),
        1 => (1..5u64).prop_map(Op::Add),
    ]
}

/// Run `ops`, then end every held pick; the booked work left over (0 when nothing leaks), and
/// whether the board ever disagreed with the sum of the held bookings along the way.
fn run(dispatcher: &Dispatcher, ops: &[Op]) -> (u64, Option<String>) {
    let mut held: Vec<(HeldPick, GenerateRequest)> = Vec::new();
    let mut disagreement = None;
    for op in ops {
        match op {
            Op::Pick { chain, blocks } => {
                let request = prompt(*chain, *blocks);
                if let Ok(pick) = dispatcher.select_held(&request) {
                    held.push((pick, request));
                }
            }
            Op::End(i) if *i < held.len() => drop(held.swap_remove(*i)),
            Op::Retry(i) if *i < held.len() => {
                let (pick, request) = held.swap_remove(*i);
                let failed = pick.instance().instance_id;
                drop(pick);
                if let Ok(next) = dispatcher.select_held_excluding(&request, &[failed]) {
                    held.push((next, request));
                }
            }
            Op::Remove(id) => dispatcher.view().apply(InstanceEvent::Removed(*id)),
            Op::Add(id) => dispatcher.view().apply(InstanceEvent::Added(instance(*id))),
            _ => {}
        }
        let booked: u64 = held.iter().filter_map(|h| h.0.booked_work()).sum();
        if disagreement.is_none() && booked != dispatcher.total_booked_work() {
            disagreement = Some(format!(
                "after {op:?}: held {booked}, board {}",
                dispatcher.total_booked_work()
            ));
        }
    }
    drop(held);
    (dispatcher.total_booked_work(), disagreement)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn booked_work_returns_exactly_to_zero_over_any_interleaving(
        ops in proptest::collection::vec(op(), 0..60),
    ) {
        let (left, disagreement, per_worker) = in_runtime(|| {
            let dispatcher =
                kv_dispatcher(&[1, 2, 3, 4], KvRouterConfig::default(), PushConfig::default());
            let (left, disagreement) = run(&dispatcher, &ops);
            let per_worker: Vec<u64> = (1..5).map(|id| dispatcher.booked_work(id)).collect();
            (left, disagreement, per_worker)
        });
        prop_assert_eq!(disagreement, None);
        prop_assert_eq!(left, 0);
        prop_assert_eq!(per_worker, vec![0; 4]);
    }
}

/// The property bites: a board that loses the release of a worker which left the routable set
/// while its prefill ran leaks that booking.
#[test]
fn the_mutant_that_loses_releases_of_departed_workers_is_caught() {
    in_runtime(mutant_that_loses_releases);
}

fn mutant_that_loses_releases() {
    let ops = [
        Op::Pick {
            chain: 4,
            blocks: 3,
        },
        Op::Remove(1),
        Op::Remove(2),
        Op::Remove(3),
        Op::Remove(4),
        // A new worker: the next pick re-syncs the board, whose first worker is gone.
        Op::Add(5),
        Op::Pick {
            chain: 5,
            blocks: 3,
        },
    ];
    let sound = kv_dispatcher(
        &[1, 2, 3, 4],
        KvRouterConfig::default(),
        PushConfig::default(),
    );
    assert_eq!(run(&sound, &ops).0, 0);
    let mutant = kv_dispatcher(
        &[1, 2, 3, 4],
        KvRouterConfig::default(),
        PushConfig::default(),
    )
    .with_board(LoadBoard::with_mutant(BoardMutant::LeaksNonMembers));
    let (left, _) = run(&mutant, &ops);
    assert!(left > 0, "the leaking board was not caught");
}

/// Every shared-prefix request on a pool that holds the prefix everywhere goes to a worker
/// with the least booked work (the load decides), and the selector-level mutant that ignores
/// load piles them up.
#[test]
fn a_prefix_every_worker_holds_is_spread_by_booked_work() {
    in_runtime(prefix_everywhere_is_spread);
}

fn prefix_everywhere_is_spread() {
    let spread = |dispatcher: Dispatcher| {
        // Every worker reports that it holds the shared prefix (the first two blocks).
        let prefix = crate::push::block_hashes(&prompt(1, 2).token_ids, 4);
        for id in 1..=4 {
            let mut publisher = crate::kv_events::EventPublisher::new(1);
            publisher.stored(None, prefix[0]);
            publisher.stored(Some(prefix[0]), prefix[1]);
            for batch in publisher.take_batches() {
                dispatcher.apply_kv_events(id, &batch);
            }
        }
        let mut held = Vec::new();
        let mut worst = 0u64;
        for _ in 0..8 {
            let loads: Vec<u64> = (1..=4).map(|id| dispatcher.booked_work(id)).collect();
            let least = loads.iter().copied().min().unwrap_or(0);
            let pick = dispatcher.select_held(&prompt(1, 4)).expect("a pick");
            let id = pick.instance().instance_id;
            worst = worst.max(loads[(id - 1) as usize] - least);
            held.push(pick);
        }
        worst
    };
    let sound = kv_dispatcher(
        &[1, 2, 3, 4],
        KvRouterConfig::default(),
        PushConfig::default(),
    );
    assert_eq!(
        spread(sound),
        0,
        "a pick had more booked work than the least loaded"
    );
    let mutant = kv_dispatcher(
        &[1, 2, 3, 4],
        KvRouterConfig::default(),
        PushConfig::default(),
    )
    .map_kv(|kv| kv.with_cost_mutant(CostMutant::IgnoresLoad));
    assert!(
        spread(mutant) > 0,
        "the mutant that ignores load was not caught"
    );
}

fn tight(threshold: u64, wait: Duration) -> Dispatcher {
    kv_dispatcher(
        &[1],
        KvRouterConfig {
            busy_threshold_tokens: Some(threshold),
            ..KvRouterConfig::default()
        },
        PushConfig {
            overload_wait: wait,
            overload_queue: 4,
            ..PushConfig::default()
        },
    )
}

#[tokio::test(start_paused = true)]
async fn a_waiting_request_is_admitted_as_soon_as_the_pressure_ends() {
    let dispatcher = std::sync::Arc::new(tight(1, Duration::from_secs(5)));
    let busy = dispatcher.select_held(&prompt(1, 2)).expect("first pick");
    assert!(matches!(
        dispatcher.select_held(&prompt(2, 2)),
        Err(PushError::Overloaded { threshold: 1, .. })
    ));
    let waiter = {
        let dispatcher = std::sync::Arc::clone(&dispatcher);
        tokio::spawn(async move { dispatcher.select_held_waiting(&prompt(2, 2)).await.is_ok() })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(dispatcher.overload_waiting(), 1);
    let before = tokio::time::Instant::now();
    drop(busy);
    assert!(waiter.await.expect("waiter"), "admitted after the release");
    assert!(
        before.elapsed() < Duration::from_millis(1),
        "woken by the release, not a timer"
    );
    assert_eq!(
        dispatcher
            .overload_counts()
            .queued
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    assert_eq!(
        dispatcher
            .overload_counts()
            .shed
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}

#[tokio::test(start_paused = true)]
async fn overload_is_shed_after_the_wait_and_does_not_outlive_the_pressure() {
    let dispatcher = tight(1, Duration::from_secs(2));
    let busy = dispatcher.select_held(&prompt(1, 2)).expect("first pick");
    let start = tokio::time::Instant::now();
    let shed = dispatcher.select_held_waiting(&prompt(2, 2)).await;
    assert!(
        matches!(shed, Err(PushError::Overloaded { .. })),
        "{shed:?}"
    );
    assert!(start.elapsed() >= Duration::from_secs(2));
    assert_eq!(
        dispatcher
            .overload_counts()
            .shed
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    assert_eq!(dispatcher.overload_waiting(), 0, "no waiter left behind");
    drop(busy);
    // The next request after the pressure is admitted at once: no stuck overload state.
    assert!(dispatcher.select_held(&prompt(2, 2)).is_ok());
}

#[tokio::test(start_paused = true)]
async fn raising_the_threshold_at_runtime_admits_the_waiters() {
    let dispatcher = std::sync::Arc::new(tight(1, Duration::from_secs(30)));
    let _busy = dispatcher.select_held(&prompt(1, 2)).expect("first pick");
    let waiter = {
        let dispatcher = std::sync::Arc::clone(&dispatcher);
        tokio::spawn(async move { dispatcher.select_held_waiting(&prompt(2, 2)).await.is_ok() })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    dispatcher.set_busy_threshold(None);
    assert_eq!(dispatcher.busy_threshold(), None);
    assert!(waiter.await.expect("waiter"));
}

#[tokio::test(start_paused = true)]
async fn a_full_overload_queue_sheds_at_once() {
    let dispatcher = std::sync::Arc::new(tight(1, Duration::from_secs(30)));
    let _busy = dispatcher.select_held(&prompt(1, 2)).expect("first pick");
    let waiters: Vec<_> = (0..4)
        .map(|_| {
            let dispatcher = std::sync::Arc::clone(&dispatcher);
            tokio::spawn(async move { dispatcher.select_held_waiting(&prompt(2, 2)).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(dispatcher.overload_waiting(), 4);
    let start = tokio::time::Instant::now();
    let fifth = dispatcher.select_held_waiting(&prompt(2, 2)).await;
    assert!(matches!(fifth, Err(PushError::Overloaded { .. })));
    assert!(
        start.elapsed() < Duration::from_millis(150),
        "shed without the full wait"
    );
    for w in waiters {
        w.abort();
    }
}

/// A link whose every request gets one response and then ends, or, for a request of more
/// than one token, fails after it (its connection cut).
struct Answers;

impl WorkerLink for Answers {
    type Stream =
        futures_util::stream::Iter<std::vec::IntoIter<Result<GenerateResponse, TransportError>>>;

    async fn open(
        &self,
        _dispatch: Dispatch<'_>,
        request: GenerateRequest,
        _deadline: Option<tokio::time::Instant>,
    ) -> Result<Self::Stream, TransportError> {
        let mut items = vec![Ok(GenerateResponse::default())];
        if request.max_tokens > 1 {
            items.push(Err(TransportError::Disconnected {
                reason: "cut".into(),
            }));
        }
        Ok(futures_util::stream::iter(items))
    }
}

#[tokio::test]
async fn a_stream_that_ended_or_failed_releases_its_booking_before_it_drops() {
    use futures_util::StreamExt;
    let view = RoutableView::spawn(
        futures_util::stream::pending(),
        None,
        CancellationToken::new(),
    );
    view.apply(InstanceEvent::Added(instance(1)));
    let mode = PushMode::Kv {
        block_size: 4,
        config: KvRouterConfig::default(),
    };
    let dispatcher = crate::push::Dispatcher::with_link(view, mode, PushConfig::default(), Answers);
    for max_tokens in [1, 2] {
        let request = GenerateRequest {
            max_tokens,
            ..prompt(max_tokens, 4)
        };
        let mut stream = dispatcher.generate(request).await.expect("routed");
        assert!(dispatcher.booked_work(1) > 0, "booked while it runs");
        let items: Vec<_> = (&mut stream).collect().await;
        assert_eq!(items.last().is_some_and(Result::is_err), max_tokens > 1);
        // The caller still holds the stream: the request is over all the same.
        assert_eq!(dispatcher.booked_work(1), 0, "max_tokens {max_tokens}");
        drop(stream);
        assert_eq!(dispatcher.booked_work(1), 0);
    }
}
