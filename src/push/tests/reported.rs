//! Load reports on the dispatcher's side: the board orders and checks workers by booked plus
//! reported work, and a worker connection's reports apply only while it is the current one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::advert::KvRouterConfig;
use crate::discovery::{EndpointId, Instance, InstanceEvent, InstanceId};
use crate::health::BackoffPolicy;
use crate::hooks::Seam;
use crate::load_report::{Load, LoadReport, LoadReportError};
use crate::push::kv::KvSelector;
use crate::push::kv_feed::KvFeed;
use crate::push::{LoadBoard, RoutableView};

fn members(ids: &[InstanceId]) -> Arc<[Arc<Instance>]> {
    ids.iter()
        .map(|&id| {
            Arc::new(Instance {
                endpoint: EndpointId::new("t", "prefill", "generate"),
                instance_id: id,
                address: std::net::SocketAddr::from(([127, 0, 0, 1], 1)),
            })
        })
        .collect()
}

/// A report of `tokens` of others' work and no request (so no request overhead is added).
fn report(seq: u64, tokens: u64) -> LoadReport {
    LoadReport {
        seq,
        others: Load {
            tokens,
            requests: 0,
        },
    }
}

#[test]
fn reported_others_move_a_worker_between_loads_and_never_touch_its_bookings() {
    let mut board = LoadBoard::default();
    board.set_members(members(&[1, 2]));
    board.acquire(1, 100);
    assert_eq!(board.least_loaded(0, &[]), Some((2, 0)));
    board.set_others(2, 300);
    assert_eq!(board.least_loaded(0, &[]), Some((1, 100)));
    assert_eq!(
        (board.load(2), board.others(2), board.combined(2)),
        (0, 300, 300)
    );
    // Own bookings and the total stay this board's own: releases still return them to zero.
    assert_eq!(board.total(), 100);
    board.release(1, 100);
    assert_eq!(board.total(), 0);
    let mut walked = Vec::new();
    board.walk_by_load(0, &[], |id, load, _| {
        walked.push((id, load));
        crate::push::Walk::Next
    });
    assert_eq!(walked, vec![(1, 0), (2, 300)]);
    board.set_others(2, 0);
    assert_eq!(board.combined(2), 0);
}

#[test]
fn a_departed_workers_report_is_kept_until_cleared_then_forgotten() {
    let mut board = LoadBoard::default();
    board.set_members(members(&[1, 2]));
    board.set_others(2, 50);
    board.set_members(members(&[1]));
    assert_eq!(board.others(2), 50, "not a member, still reported");
    board.set_others(2, 0);
    assert_eq!(board.combined(2), 0);
    board.set_members(members(&[1, 2]));
    assert_eq!(board.least_loaded(7, &[1]), Some((2, 0)));
}

/// A feed over worker 4 (discovered), its board and its wake-up count.
fn feed() -> (
    Arc<KvFeed>,
    Arc<Mutex<LoadBoard>>,
    Arc<AtomicU64>,
    CancellationToken,
) {
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
    let board: Arc<Mutex<LoadBoard>> = Arc::default();
    let wakes = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&wakes);
    let wake = Box::new(move || {
        counted.fetch_add(1, Ordering::Relaxed);
    });
    let feed = Arc::new(KvFeed::new(
        kv,
        view,
        Seam::off(),
        (Arc::clone(&board), wake),
    ));
    (feed, board, wakes, cancel)
}

#[tokio::test]
async fn only_the_current_connections_newest_report_counts_and_a_close_resets_it() {
    let (feed, board, wakes, cancel) = feed();
    let others = || board.lock().others(4);
    let (old, g1) = feed.sink(4);
    old.load_report(Ok(report(1, 30)));
    assert_eq!(others(), 0, "not pooled yet: kept aside");
    feed.adopt(4, g1);
    assert_eq!(others(), 30, "counted from the adoption");
    old.load_report(Ok(report(2, 40)));
    assert_eq!(others(), 40);
    old.load_report(Ok(report(1, 99)));
    assert_eq!(others(), 40, "a late report is ignored");
    old.load_report(Err(LoadReportError::Length(3)));
    assert_eq!(others(), 40, "a bad report is counted and ignored");
    // A reconnect starts the worker's reports afresh: its first report (seq 1) applies.
    let (new, g2) = feed.sink(4);
    feed.adopt(4, g2);
    assert_eq!(others(), 0);
    assert_eq!(
        wakes.load(Ordering::Relaxed),
        1,
        "a lower load wakes the waiters"
    );
    old.load_report(Ok(report(3, 70)));
    assert_eq!(
        others(),
        0,
        "the replaced connection's reports change nothing"
    );
    new.load_report(Ok(report(1, 25)));
    assert_eq!(others(), 25);
    assert_eq!(feed.reported(4).map(|r| r.others().tokens), Some(25));
    // Each reported request costs the request overhead, as the dispatcher's own bookings do.
    let overhead = KvRouterConfig::default().prefill_request_tokens;
    let mut two = report(2, 25);
    two.others.requests = 2;
    new.load_report(Ok(two));
    assert_eq!(others(), 25 + 2 * overhead);
    old.closed();
    assert_eq!(
        others(),
        25 + 2 * overhead,
        "the replaced connection's close changes nothing"
    );
    new.closed();
    assert_eq!(others(), 0, "reports stopped: others back to zero");
    // A connection that lost a connect race: its reports never count, and its close clears
    // what it kept aside.
    let (loser, _) = feed.sink(4);
    loser.load_report(Ok(report(1, 80)));
    loser.closed();
    assert_eq!(others(), 0);
    assert_eq!(feed.pending_len(), 0);
    assert_eq!(feed.reported(4), None);
    let counts = feed.counts();
    assert_eq!(
        (
            counts.reports_applied(),
            counts.reports_stale(),
            counts.reports_refused()
        ),
        (5, 2, 1)
    );
    cancel.cancel();
}
