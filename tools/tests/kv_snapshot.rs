//! KV snapshots over the request plane: a frontend that joins late, or loses a batch, gets the
//! worker's whole cache from a snapshot instead of waiting for the cache to turn over; a
//! snapshot larger than one chunk reassembles across frames; a worker without snapshots still
//! feeds the index from its live events.

// The request-plane tests' loopback support (shared with the library's `tests/request_plane`).
#[path = "../../tests/request_plane/support.rs"]
#[allow(dead_code)]
mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support::*;
use futures_util::StreamExt;
use prefill_router::advert::KvRouterConfig;
use prefill_router::discovery::InstanceId;
use prefill_router::kv_events::{EventBatch, KvSnapshot, SNAPSHOT_CHUNK_BLOCKS};
use prefill_router::push::{Dispatcher, PushConfig, PushMode};
use prefill_router::request::GenerateRequest;
use prefill_router::transport::{serve_with_kv_events, KvEventSource, ServerConfig, ServerHandle};
use prefill_router_tools::mock::{MockConfig, MockPrefill};
use tokio::net::TcpListener;

const BLOCK: u32 = 4;

fn mock_config(cache_blocks: usize) -> MockConfig {
    MockConfig {
        block_size: BLOCK,
        block_cost: Duration::ZERO,
        token_interval: Duration::ZERO,
        cache_blocks,
    }
}

async fn serve_source(engine: Arc<MockPrefill>, source: Arc<dyn KvEventSource>) -> ServerHandle {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    serve_with_kv_events(listener, engine, ServerConfig::default(), source).expect("serve")
}

fn kv_dispatcher(d: &Discovery) -> Dispatcher {
    let mode = PushMode::Kv {
        block_size: BLOCK,
        config: KvRouterConfig::default(),
    };
    Dispatcher::new(d.view.clone(), mode, PushConfig::default())
}

/// A prompt of `blocks` whole blocks, distinct per seed.
fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK).map(|i| seed * 1_000_000 + i).collect()
}

/// Run one request on `worker` (direct: the router's prediction learns nothing from it).
async fn prefill_on(router: &Dispatcher, worker: InstanceId, tokens: Vec<u32>) {
    let mut s = tokio::time::timeout(
        WAIT,
        router.generate_direct(worker, GenerateRequest::new(tokens, 1)),
    )
    .await
    .expect("in time")
    .expect("sent");
    let r = tokio::time::timeout(WAIT, s.next())
        .await
        .expect("in time")
        .expect("item")
        .expect("ok");
    assert_eq!(r.prefill.expect("info").worker, worker);
}

/// The router's KV pick for `tokens` and the overlap it expects there.
fn pick(router: &Dispatcher, tokens: &[u32]) -> (InstanceId, usize) {
    let s = router
        .select_held(&GenerateRequest::new(tokens.to_vec(), 1))
        .expect("a pick");
    (
        s.instance().instance_id,
        s.expected_overlap_blocks().expect("KV mode"),
    )
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

/// A worker's event source with faults: it can skip one batch (a lost batch the router sees
/// as a gap), and can refuse snapshots (a worker that predates them).
struct Faulty {
    inner: Arc<MockPrefill>,
    skip_next: AtomicBool,
    snapshots: bool,
}

impl Faulty {
    fn new(inner: Arc<MockPrefill>, snapshots: bool) -> Arc<Self> {
        Arc::new(Faulty {
            inner,
            skip_next: AtomicBool::new(false),
            snapshots,
        })
    }
}

impl KvEventSource for Faulty {
    fn take_kv_events(&self) -> Vec<EventBatch> {
        let mut batches = self.inner.take_kv_events();
        // The whole take: under load one take may hold an earlier prompt's late batch before
        // this one's, and losing only the first would leave nothing for the gap to show.
        if !batches.is_empty() && self.skip_next.swap(false, Ordering::AcqRel) {
            batches.clear();
        }
        batches
    }

    fn kv_snapshot(&self) -> Option<KvSnapshot> {
        if self.snapshots {
            KvEventSource::kv_snapshot(self.inner.as_ref())
        } else {
            None
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frontend_started_after_traffic_scores_like_a_long_running_one() {
    let (w1, w2) = (
        MockPrefill::with_kv_events(1, mock_config(64), 1),
        MockPrefill::with_kv_events(2, mock_config(64), 1),
    );
    let s1 = serve_source(w1.clone(), w1.clone()).await;
    let s2 = serve_source(w2.clone(), w2.clone()).await;
    let d = Discovery::new(None);
    d.add(1, s1.local_addr()).await;
    d.add(2, s2.local_addr()).await;
    d.wait_routable(&[1, 2]).await;

    // The long-running frontend serves traffic: three prompts, spread over both workers.
    let old = kv_dispatcher(&d);
    let served = [(1, prompt(1, 4)), (2, prompt(2, 6)), (1, prompt(3, 3))];
    for (worker, tokens) in &served {
        prefill_on(&old, *worker, tokens.clone()).await;
    }
    eventually("the long-running frontend indexes the traffic", || {
        served
            .iter()
            .all(|(w, t)| pick(&old, t) == (*w, t.len() / BLOCK as usize))
    })
    .await;

    // A frontend starts now. It connects to both workers as they enter its view (they are in
    // it already), which subscribes and asks for their snapshots: no request is sent first.
    let new = kv_dispatcher(&d);
    let counts = Arc::clone(new.kv_event_counts().expect("KV mode"));
    eventually("both workers' snapshots applied", || {
        counts.snapshots_applied() >= 2
    })
    .await;
    // Its very first request is routed as the long-running frontend would route it: the same
    // worker, credited with the same overlap.
    let (worker, tokens) = &served[1];
    let expected = pick(&old, tokens);
    assert_eq!(expected, (*worker, tokens.len() / BLOCK as usize));
    let mut first =
        tokio::time::timeout(WAIT, new.generate(GenerateRequest::new(tokens.clone(), 1)))
            .await
            .expect("in time")
            .expect("routed");
    assert_eq!(
        (first.instance_id(), first.expected_overlap_blocks()),
        (expected.0, Some(expected.1))
    );
    let r = tokio::time::timeout(WAIT, first.next())
        .await
        .expect("in time")
        .expect("item")
        .expect("ok");
    assert_eq!(r.prefill.expect("info").worker, *worker);
    drop(first);
    // And so are the others.
    for (worker, tokens) in &served {
        assert_eq!(pick(&new, tokens), pick(&old, tokens));
        assert_eq!(pick(&new, tokens), (*worker, tokens.len() / BLOCK as usize));
    }
    assert_eq!(counts.snapshots_failed(), 0);
    assert_eq!(counts.snapshots_requested(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_gap_the_workers_entries_come_back_from_a_snapshot() {
    let w = MockPrefill::with_kv_events(7, mock_config(64), 1);
    let source = Faulty::new(w.clone(), true);
    let server = serve_source(w.clone(), source.clone()).await;
    let d = Discovery::new(None);
    d.add(7, server.local_addr()).await;
    d.wait_routable(&[7]).await;
    let router = kv_dispatcher(&d);
    let counts = Arc::clone(router.kv_event_counts().expect("KV mode"));

    let (a, b, c) = (prompt(1, 4), prompt(2, 4), prompt(3, 4));
    prefill_on(&router, 7, a.clone()).await;
    eventually(
        "A credited, the connection's first snapshot applied",
        || pick(&router, &a).1 == 4 && counts.snapshots_applied() >= 1,
    )
    .await;
    // Counted from here: a second connection's snapshot (an eager connect racing the
    // request's, under load) must not pass for the one the gap asks for.
    let before = counts.snapshots_applied();

    // B's batch is lost; C's batch shows the gap.
    source.skip_next.store(true, Ordering::Release);
    prefill_on(&router, 7, b.clone()).await;
    eventually("B's batch skipped", || {
        !source.skip_next.load(Ordering::Acquire)
    })
    .await;
    prefill_on(&router, 7, c.clone()).await;
    eventually("the gap seen", || counts.gaps() >= 1).await;
    // Without a snapshot the index would now hold C only, until A and B were used again.
    let state = || {
        format!(
            "snapshots requested {} applied {} (before {before}) failed {}, gaps {}, credits A {} B {} C {}",
            counts.snapshots_requested(),
            counts.snapshots_applied(),
            counts.snapshots_failed(),
            counts.gaps(),
            pick(&router, &a).1,
            pick(&router, &b).1,
            pick(&router, &c).1
        )
    };
    let ok = tokio::time::timeout(WAIT, async {
        while !(counts.snapshots_applied() > before
            && pick(&router, &a).1 == 4
            && pick(&router, &b).1 == 4
            && pick(&router, &c).1 == 4)
        {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .is_ok();
    assert!(
        ok,
        "never: A, B and C credited again from a snapshot: {}",
        state()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_larger_than_one_chunk_reassembles_across_frames() {
    let blocks = 2 * SNAPSHOT_CHUNK_BLOCKS as u32 + 500;
    let w = MockPrefill::with_kv_events(3, mock_config(blocks as usize + 16), 1);
    let server = serve_source(w.clone(), w.clone()).await;
    let d = Discovery::new(None);
    d.add(3, server.local_addr()).await;
    d.wait_routable(&[3]).await;
    let long = prompt(1, blocks);
    let old = kv_dispatcher(&d);
    prefill_on(&old, 3, long.clone()).await;
    eventually("the long prompt indexed from live events", || {
        pick(&old, &long).1 == blocks as usize
    })
    .await;

    // No request needed: the new frontend connects to the worker, and asks, on its own.
    let new = kv_dispatcher(&d);
    let counts = Arc::clone(new.kv_event_counts().expect("KV mode"));
    eventually("the three-chunk snapshot applied", || {
        counts.snapshots_applied() == 1
    })
    .await;
    assert_eq!(pick(&new, &long), (3, blocks as usize));
    assert_eq!(counts.snapshots_failed(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_without_snapshots_still_feeds_the_index_from_live_events() {
    let w = MockPrefill::with_kv_events(5, mock_config(64), 1);
    let source = Faulty::new(w.clone(), false);
    let server = serve_source(w.clone(), source).await;
    let d = Discovery::new(None);
    d.add(5, server.local_addr()).await;
    d.wait_routable(&[5]).await;
    let router = kv_dispatcher(&d);
    let counts = Arc::clone(router.kv_event_counts().expect("KV mode"));
    let (a, b) = (prompt(1, 4), prompt(2, 4));
    prefill_on(&router, 5, a.clone()).await;
    eventually("A credited; the snapshot answered as unsupported", || {
        pick(&router, &a).1 == 4 && counts.snapshots_failed() == 1
    })
    .await;
    prefill_on(&router, 5, b.clone()).await;
    eventually("B credited", || pick(&router, &b).1 == 4).await;
    assert_eq!(counts.snapshots_applied(), 0);
    assert_eq!(counts.snapshots_requested(), 1, "not asked again");
}
