//! Workers' load reports over the request plane (docs/scale-out.md, "Load reports"): two
//! frontends that never talk to each other (two KV dispatchers in one process, each with its
//! own connections) see each other's work on a shared pool through the workers' reports, never
//! count their own twice, forget a worker's report when its connection ends, and fall back to
//! their own bookings with a worker that does not report.

// The request-plane tests' loopback support (shared with the library's `tests/request_plane`).
#[path = "../../tests/request_plane/support.rs"]
#[allow(dead_code)]
mod support;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::support::*;
use futures_util::StreamExt;
use prefill_router::advert::KvRouterConfig;
use prefill_router::discovery::InstanceId;
use prefill_router::kv_events::EventBatch;
use prefill_router::load_report::{Load, LoadReport};
use prefill_router::push::{Dispatcher, PushConfig, PushMode, RoutedStream};
use prefill_router::request::{GenerateRequest, GenerateResponse};
use prefill_router::transport::{
    decode_frame, encode_frame, serve_with_kv_events, Engine, EngineStream, Frame, KvEventSource,
    ServerConfig, ServerHandle,
};
use prefill_router_tools::mock::{MockConfig, MockPrefill};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

const BLOCK: u32 = 4;
/// Blocks of the prefix every request shares, and of each request's own suffix.
const HOT_BLOCKS: u32 = 8;
const OWN_BLOCKS: u32 = 8;
/// A request's prefill work once the hot prefix is cached (its own suffix), as its frontend
/// books it and as the other frontends count it from the reports: the uncached tokens plus
/// the per-request overhead (`KvRouterConfig::prefill_request_tokens`, default 4,096).
const WORK: u64 = (OWN_BLOCKS * BLOCK) as u64 + 4096;

/// A mock prefill worker whose prefills wait for a gate: work stays in flight until the test
/// opens it (no timing in the assertions).
struct Gated {
    inner: Arc<MockPrefill>,
    gate: watch::Receiver<bool>,
}

impl Engine for Gated {
    fn prefill_work(&self, request: &GenerateRequest) -> u64 {
        self.inner.prefill_work(request)
    }

    fn generate(&self, request: GenerateRequest) -> EngineStream {
        let inner = self.inner.generate(request);
        let mut gate = self.gate.clone();
        Box::pin(
            futures_util::stream::once(async move {
                let _ = gate.wait_for(|open| *open).await;
                inner
            })
            .flatten(),
        )
    }
}

impl KvEventSource for Gated {
    fn take_kv_events(&self) -> Vec<EventBatch> {
        self.inner.take_kv_events()
    }
}

/// A pool of gated workers 1..=n (reports on or off) in one view.
struct Pool {
    d: Discovery,
    workers: Vec<(Arc<MockPrefill>, ServerHandle)>,
    gate: watch::Sender<bool>,
}

impl Pool {
    async fn start(n: InstanceId, load_reports: bool) -> Pool {
        let (gate, rx) = watch::channel(true);
        let d = Discovery::new(None);
        let mut workers = Vec::new();
        for id in 1..=n {
            let config = MockConfig {
                block_size: BLOCK,
                block_cost: Duration::ZERO,
                token_interval: Duration::ZERO,
                cache_blocks: 4096,
            };
            let mock = MockPrefill::with_kv_events(id, config, 1);
            let engine = Arc::new(Gated {
                inner: Arc::clone(&mock),
                gate: rx.clone(),
            });
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let server_config = ServerConfig {
                load_reports,
                ..ServerConfig::default()
            };
            let server = serve_with_kv_events(listener, engine.clone(), server_config, engine)
                .expect("serve");
            d.add(id, server.local_addr()).await;
            workers.push((mock, server));
        }
        let ids: Vec<InstanceId> = (1..=n).collect();
        d.wait_routable(&ids).await;
        Pool { d, workers, gate }
    }

    fn ids(&self) -> Vec<InstanceId> {
        (1..=self.workers.len() as InstanceId).collect()
    }

    /// A frontend: its own KV dispatcher and connections.
    fn frontend(&self) -> Arc<Dispatcher> {
        let mode = PushMode::Kv {
            block_size: BLOCK,
            config: KvRouterConfig::default(),
        };
        Arc::new(Dispatcher::new(
            self.d.view.clone(),
            mode,
            PushConfig::default(),
        ))
    }

    /// Requests the worker started (its engine saw them).
    fn started(&self, id: InstanceId) -> u64 {
        self.workers[id as usize - 1]
            .0
            .stats()
            .requests
            .load(Ordering::Relaxed)
    }
}

fn prompt(seed: u32) -> Vec<u32> {
    let hot = (0..HOT_BLOCKS * BLOCK).map(|t| 7_000_000 + t);
    let own = (0..OWN_BLOCKS * BLOCK).map(|t| seed * 1000 + t);
    hot.chain(own).collect()
}

/// Run one request to its end.
async fn finish(mut s: RoutedStream) -> GenerateResponse {
    tokio::time::timeout(WAIT, s.next())
        .await
        .expect("in time")
        .expect("item")
        .expect("ok")
}

/// Warm up: every frontend connects to every worker (reports flow per connection) and every
/// worker caches the hot prefix, which every frontend indexes from the events; then the gate
/// closes.
async fn warm_up(pool: &Pool, frontends: &[&Arc<Dispatcher>]) {
    let mut seed = 1;
    for f in frontends {
        for id in pool.ids() {
            let s = f
                .generate_direct(id, GenerateRequest::new(prompt(seed), 1))
                .await
                .expect("sent");
            seed += 1;
            finish(s).await;
        }
    }
    for f in frontends {
        eventually("every frontend indexes every worker", || {
            pool.ids().iter().all(|&id| f.kv_indexed(id))
        })
        .await;
    }
    pool.gate.send_replace(false);
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

/// [`eventually`], telling what the frontends counted if it never comes.
async fn eventually_seen(
    pool: &Pool,
    frontends: &[&Arc<Dispatcher>],
    what: &str,
    mut cond: impl FnMut() -> bool,
) {
    let ok = tokio::time::timeout(WAIT, async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .is_ok();
    assert!(ok, "never: {what}: {}", seen(pool, frontends));
}

/// What each frontend counts per worker: (booked, reported others), for failure messages.
fn seen(pool: &Pool, frontends: &[&Arc<Dispatcher>]) -> String {
    let mut out = String::new();
    for (i, f) in frontends.iter().enumerate() {
        for id in pool.ids() {
            let others = f.reported_load(id).map(|r| r.others().tokens);
            out += &format!(
                "frontend {i} worker {id}: booked {} others {others:?}; ",
                f.booked_work(id)
            );
        }
    }
    out
}

/// Send `seed`'s request through `frontend` (on a task: `generate` returns with the first
/// response) and wait until its worker started it; it stays in flight while the gate is
/// closed. Returns the worker.
async fn in_flight(
    pool: &Pool,
    frontend: &Arc<Dispatcher>,
    seed: u32,
    held: &mut Vec<JoinHandle<()>>,
) -> InstanceId {
    let before: Vec<u64> = pool.ids().iter().map(|&id| pool.started(id)).collect();
    let f = Arc::clone(frontend);
    held.push(tokio::spawn(async move {
        let s = f
            .generate(GenerateRequest::new(prompt(seed), 1))
            .await
            .expect("sent");
        finish(s).await;
    }));
    let mut on = None;
    eventually("the request reached a worker", || {
        on = pool
            .ids()
            .into_iter()
            .find(|&id| pool.started(id) > before[id as usize - 1]);
        on.is_some()
    })
    .await;
    on.expect("found")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_frontends_on_one_hot_prefix_see_each_others_work_and_stay_balanced() {
    let pool = Pool::start(2, true).await;
    let (a, b) = (pool.frontend(), pool.frontend());
    warm_up(&pool, &[&a, &b]).await;
    let mut held = Vec::new();
    let mut on = [0u64; 3];
    for i in 0..8u32 {
        let sender = if i % 2 == 0 { &a } else { &b };
        let worker = in_flight(&pool, sender, 100 + i, &mut held).await;
        on[worker as usize] += 1;
        // Both frontends see every worker's whole load (booked + reported) before the next
        // pick, whoever sent the work.
        for f in [&a, &b] {
            let what = format!("a frontend sees the other's work: {on:?}");
            eventually_seen(&pool, &[&a, &b], &what, || {
                pool.ids()
                    .iter()
                    .all(|&id| f.combined_work(id) == on[id as usize] * WORK)
            })
            .await;
        }
        // Each pick sees the whole load, so the pool never drifts apart by more than one
        // request (equal work each, the hot prefix cached on both).
        assert!(
            on[1].abs_diff(on[2]) <= 1,
            "after {} requests: {on:?}",
            i + 1
        );
    }
    assert_eq!(on[1], 4);
    // Each frontend booked only what it sent; the rest of what it counts came from reports.
    for f in [&a, &b] {
        let booked: u64 = pool.ids().iter().map(|&id| f.booked_work(id)).sum();
        assert_eq!(booked, 4 * WORK);
        for id in pool.ids() {
            assert!(f.reported_load(id).expect("connected").reporting());
        }
    }
    let counts = a.kv_event_counts().expect("KV mode");
    assert!(counts.reports_applied() > 0);
    assert_eq!(counts.reports_refused(), 0);
    pool.gate.send_replace(true);
    for task in held {
        tokio::time::timeout(WAIT, task)
            .await
            .expect("in time")
            .expect("request task");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frontend_counts_the_true_load_never_its_own_work_twice() {
    let pool = Pool::start(1, true).await;
    let (a, b) = (pool.frontend(), pool.frontend());
    warm_up(&pool, &[&a, &b]).await;
    let mut held = Vec::new();
    // Two of A's requests and one of B's on the one worker.
    for (f, seed) in [(&a, 200), (&a, 201), (&b, 202)] {
        in_flight(&pool, f, seed, &mut held).await;
    }
    for (f, own) in [(&a, 2 * WORK), (&b, WORK)] {
        eventually_seen(
            &pool,
            &[&a, &b],
            "the combined load is the true load",
            || f.booked_work(1) == own && f.combined_work(1) == 3 * WORK,
        )
        .await;
    }
    // Once quiet, every frontend counts zero: nothing booked, nothing reported.
    pool.gate.send_replace(true);
    for task in held {
        tokio::time::timeout(WAIT, task)
            .await
            .expect("in time")
            .expect("request task");
    }
    for f in [&a, &b] {
        eventually("a quiet pool counts zero", || f.combined_work(1) == 0).await;
        assert_eq!(f.total_booked_work(), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_reported_others_return_to_zero_when_its_connection_ends() {
    let pool = Pool::start(1, true).await;
    let (a, b) = (pool.frontend(), pool.frontend());
    warm_up(&pool, &[&a, &b]).await;
    let mut held = Vec::new();
    in_flight(&pool, &a, 300, &mut held).await;
    eventually("B sees A's work", || b.combined_work(1) == WORK).await;
    // The worker dies: B's reports stop, and what they said is forgotten.
    pool.workers[0].1.shutdown();
    eventually("B forgets the worker's report", || {
        b.combined_work(1) == 0 && b.reported_load(1).is_none()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_reports_off_leaves_frontends_on_their_own_bookings() {
    let pool = Pool::start(1, false).await;
    let (a, b) = (pool.frontend(), pool.frontend());
    warm_up(&pool, &[&a, &b]).await;
    let mut held = Vec::new();
    in_flight(&pool, &a, 400, &mut held).await;
    // A full round trip of B's on the same connection after A's work started.
    pool.gate.send_replace(true);
    let s = b
        .generate_direct(1, GenerateRequest::new(prompt(401), 1))
        .await
        .expect("sent");
    finish(s).await;
    assert_eq!(b.combined_work(1), 0, "B counts only its own bookings");
    let reported = b.reported_load(1).expect("connected");
    assert!(!reported.reporting());
    let counts = b.kv_event_counts().expect("KV mode");
    assert_eq!(counts.reports_applied() + counts.reports_stale(), 0);
    assert!(
        counts.applied() > 0,
        "the same connection carries KV events"
    );
    for task in held {
        tokio::time::timeout(WAIT, task)
            .await
            .expect("in time")
            .expect("request task");
    }
}

/// A worker that answers every request, and on `LoadSubscribe` sends a truncated report, then
/// a valid one of `others` tokens.
async fn fake_reporting_worker(others: u64) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let Ok((stream, _)) = listener.accept().await else {
            return;
        };
        let (mut rd, mut wr) = stream.into_split();
        let write = |frame: Frame| {
            let payload = encode_frame(&frame);
            let mut bytes = (payload.len() as u32).to_be_bytes().to_vec();
            bytes.extend_from_slice(&payload);
            bytes
        };
        loop {
            let mut len = [0u8; 4];
            if rd.read_exact(&mut len).await.is_err() {
                break;
            }
            let mut payload = vec![0u8; u32::from_be_bytes(len) as usize];
            if rd.read_exact(&mut payload).await.is_err() {
                break;
            }
            let out = match decode_frame(&payload) {
                Ok(Frame::LoadSubscribe) => {
                    let good = LoadReport {
                        seq: 1,
                        others: Load {
                            tokens: others,
                            requests: 1,
                        },
                    };
                    let mut out = write(Frame::LoadReport {
                        payload: vec![1, 2, 3],
                    });
                    out.extend(write(Frame::LoadReport {
                        payload: good.encode().to_vec(),
                    }));
                    out
                }
                Ok(Frame::Request { id, .. }) => write(Frame::Data {
                    id,
                    response: GenerateResponse {
                        text: None,
                        usage: None,
                        token_ids: vec![1],
                        finish: Some(prefill_router::request::FinishReason::Length),
                        prefill: None,
                    },
                }),
                _ => continue,
            };
            if wr.write_all(&out).await.is_err() {
                break;
            }
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_report_is_counted_and_ignored_and_the_connection_stays() {
    let addr = fake_reporting_worker(500).await;
    let d = Discovery::new(None);
    d.add(9, addr).await;
    d.wait_routable(&[9]).await;
    let mode = PushMode::Kv {
        block_size: BLOCK,
        config: KvRouterConfig::default(),
    };
    let f = Dispatcher::new(d.view.clone(), mode, PushConfig::default());
    let s = f
        .generate(GenerateRequest::new(prompt(1), 1))
        .await
        .expect("sent");
    finish(s).await;
    let counts = Arc::clone(f.kv_event_counts().expect("KV mode"));
    eventually("the bad report is refused, the good one applied", || {
        counts.reports_refused() == 1 && counts.reports_applied() == 1
    })
    .await;
    // 500 tokens and one request: the request overhead on top, as a booking.
    let overhead = KvRouterConfig::default().prefill_request_tokens;
    assert_eq!(f.combined_work(9), 500 + overhead);
    // The same connection still serves.
    let s = f
        .generate(GenerateRequest::new(prompt(2), 1))
        .await
        .expect("sent");
    finish(s).await;
    assert_eq!(counts.reports_applied(), 1, "one connection all along");
}

/// Write one frame on a raw connection.
async fn write_frame(wr: &mut tokio::net::tcp::OwnedWriteHalf, frame: &Frame) {
    let payload = encode_frame(frame);
    let mut bytes = (payload.len() as u32).to_be_bytes().to_vec();
    bytes.extend_from_slice(&payload);
    wr.write_all(&bytes).await.expect("write");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_asks_for_reports_never_receives_one() {
    let pool = Pool::start(1, true).await;
    let a = pool.frontend();
    warm_up(&pool, &[&a]).await;
    // Another connection's work is on the worker's ledger: a subscribed peer would be told.
    let mut held = Vec::new();
    in_flight(&pool, &a, 500, &mut held).await;
    // A client from before load reports: it subscribes to KV events only.
    let stream = tokio::net::TcpStream::connect(pool.workers[0].1.local_addr())
        .await
        .expect("connect");
    let (mut rd, mut wr) = stream.into_split();
    write_frame(&mut wr, &Frame::KvSubscribe).await;
    let request = GenerateRequest::new(prompt(501), 1);
    write_frame(
        &mut wr,
        &Frame::Request {
            id: 1,
            timeout_ms: None,
            request,
        },
    )
    .await;
    pool.gate.send_replace(true);
    let mut kinds = Vec::new();
    let done = tokio::time::timeout(WAIT, async {
        loop {
            let mut len = [0u8; 4];
            rd.read_exact(&mut len).await.expect("read");
            let mut payload = vec![0u8; u32::from_be_bytes(len) as usize];
            rd.read_exact(&mut payload).await.expect("read");
            let frame = decode_frame(&payload).expect("a frame this client knows");
            let last =
                matches!(&frame, Frame::Data { id: 1, response } if response.finish.is_some());
            kinds.push(format!("{frame:?}").chars().take(12).collect::<String>());
            assert!(
                !matches!(frame, Frame::LoadReport { .. }),
                "an unasked-for report: {kinds:?}"
            );
            if last {
                break;
            }
        }
    })
    .await;
    assert!(done.is_ok(), "the request was served: {kinds:?}");
    for task in held {
        tokio::time::timeout(WAIT, task)
            .await
            .expect("in time")
            .expect("request task");
    }
}
