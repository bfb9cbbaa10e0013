//! KV cache events over the request plane: a worker's real cache reaches the router's index on
//! the same connection as its requests, a lost connection drops the credit, and a bad event
//! frame costs that worker's entries, never its requests.

// The request-plane tests' loopback support (shared with the library's `tests/request_plane`).
#[path = "../../tests/request_plane/support.rs"]
#[allow(dead_code)]
mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::support::*;
use futures_util::StreamExt;
use prefill_router::advert::KvRouterConfig;
use prefill_router::discovery::InstanceId;
use prefill_router::kv_events::{encode_events, EventBatch, KvEvent};
use prefill_router::push::{block_hashes, Dispatcher, PushConfig, PushMode};
use prefill_router::request::{GenerateRequest, GenerateResponse};
use prefill_router::transport::{
    decode_frame, encode_frame, serve_with_kv_events, Frame, ServerConfig, ServerHandle,
    MAX_KV_BATCH_BYTES,
};
use prefill_router_tools::mock::{MockConfig, MockPrefill};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

const BLOCK: u32 = 4;

fn mock_config() -> MockConfig {
    MockConfig {
        block_size: BLOCK,
        block_cost: Duration::ZERO,
        token_interval: Duration::ZERO,
        // Two 4-block prompts fill it: a third evicts the oldest.
        cache_blocks: 8,
    }
}

async fn serve_events(listener: TcpListener, engine: Arc<MockPrefill>) -> ServerHandle {
    serve_with_kv_events(listener, engine.clone(), ServerConfig::default(), engine).expect("serve")
}

async fn bind(addr: &str) -> TcpListener {
    TcpListener::bind(addr).await.expect("bind loopback")
}

fn kv_dispatcher(d: &Discovery) -> Dispatcher {
    let mode = PushMode::Kv {
        block_size: BLOCK,
        config: KvRouterConfig::default(),
    };
    Dispatcher::new(d.view.clone(), mode, PushConfig::default())
}

fn prompt(seed: u32) -> Vec<u32> {
    (0..4 * BLOCK).map(|i| seed * 1000 + i).collect()
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_routers_kv_pick_follows_the_workers_real_cache_over_tcp() {
    let w1 = MockPrefill::with_kv_events(1, mock_config(), 1);
    let w2 = MockPrefill::with_kv_events(2, mock_config(), 1);
    let s1 = serve_events(bind("127.0.0.1:0").await, Arc::clone(&w1)).await;
    let s2 = serve_events(bind("127.0.0.1:0").await, Arc::clone(&w2)).await;
    let d = Discovery::new(None);
    d.add(1, s1.local_addr()).await;
    d.add(2, s2.local_addr()).await;
    d.wait_routable(&[1, 2]).await;
    let router = kv_dispatcher(&d);

    // Prompts sent direct: only the workers' events can tell the router where they are.
    let (a, b) = (prompt(1), prompt(2));
    prefill_on(&router, 2, a.clone()).await;
    prefill_on(&router, 1, b.clone()).await;
    eventually("A credited to worker 2, B to worker 1", || {
        router.kv_indexed(1)
            && router.kv_indexed(2)
            && pick(&router, &a) == (2, 4)
            && pick(&router, &b) == (1, 4)
    })
    .await;
    let counts = router.kv_event_counts().expect("KV mode");
    // Each worker's entries come from its batches or its connection's snapshot (which may
    // cover every batch, leaving them stale).
    assert!(
        counts.applied() + counts.snapshots_applied() >= 2,
        "batches or snapshots of both workers applied"
    );

    // Worker 2 prefills two other prompts: its LRU (8 blocks) evicts A.
    prefill_on(&router, 2, prompt(3)).await;
    prefill_on(&router, 2, prompt(4)).await;
    // The eviction and the new prompt's blocks may arrive in separate batches: wait for both.
    eventually(
        "A no longer credited anywhere once worker 2 evicted it, the new prompt credited to 2",
        || pick(&router, &a).1 == 0 && pick(&router, &prompt(4)) == (2, 4),
    )
    .await;
    assert_eq!(counts.refused(), 0);
    assert_eq!(block_hashes(&a, BLOCK).len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_connection_drops_the_workers_entries_until_it_publishes_again() {
    let w = MockPrefill::with_kv_events(7, mock_config(), 1);
    let server = serve_events(bind("127.0.0.1:0").await, Arc::clone(&w)).await;
    let addr = server.local_addr();
    let d = Discovery::new(None);
    d.add(7, addr).await;
    d.wait_routable(&[7]).await;
    let router = kv_dispatcher(&d);
    let a = prompt(1);
    prefill_on(&router, 7, a.clone()).await;
    eventually("A credited", || {
        router.kv_indexed(7) && pick(&router, &a).1 == 4
    })
    .await;

    // The worker restarts its server (same cache, same address): the connection ends.
    server.stop().await;
    eventually("no credit once the connection is gone", || {
        !router.kv_indexed(7)
    })
    .await;
    let server = serve_events(bind(&addr.to_string()).await, Arc::clone(&w)).await;
    // Requests flow over the new connection and its events index the worker afresh.
    let b = prompt(2);
    let mut served = false;
    for _ in 0..100 {
        let sent = router
            .generate_direct(7, GenerateRequest::new(b.clone(), 1))
            .await;
        if let Ok(mut s) = sent {
            if matches!(tokio::time::timeout(WAIT, s.next()).await, Ok(Some(Ok(_)))) {
                served = true;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(served, "the restarted worker serves");
    eventually("B credited over the new connection", || {
        router.kv_indexed(7) && pick(&router, &b).1 == 4
    })
    .await;
    drop(server);
}

/// A hand-written worker: answers every request with one finishing response and, when told,
/// writes the given raw KV event payloads on the connection.
async fn fake_worker(mut inject: mpsc::Receiver<Vec<u8>>) -> SocketAddr {
    let listener = bind("127.0.0.1:0").await;
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let (sock, _) = listener.accept().await.expect("accept");
        let (mut rd, mut wr) = sock.into_split();
        let (out_tx, mut out_rx) = mpsc::channel::<Frame>(64);
        tokio::spawn(async move {
            while let Some(frame) = out_rx.recv().await {
                let payload = encode_frame(&frame);
                let mut bytes = (payload.len() as u32).to_be_bytes().to_vec();
                bytes.extend_from_slice(&payload);
                if wr.write_all(&bytes).await.is_err() {
                    break;
                }
            }
        });
        let out = out_tx.clone();
        tokio::spawn(async move {
            while let Some(payload) = inject.recv().await {
                if out.send(Frame::KvEvents { payload }).await.is_err() {
                    break;
                }
            }
        });
        loop {
            let mut len = [0u8; 4];
            if rd.read_exact(&mut len).await.is_err() {
                break;
            }
            let mut payload = vec![0u8; u32::from_be_bytes(len) as usize];
            if rd.read_exact(&mut payload).await.is_err() {
                break;
            }
            if let Ok(Frame::Request { id, .. }) = decode_frame(&payload) {
                let response = GenerateResponse {
                    text: None,
                    usage: None,
                    token_ids: vec![1],
                    finish: Some(prefill_router::request::FinishReason::Length),
                    prefill: None,
                };
                if out_tx.send(Frame::Data { id, response }).await.is_err() {
                    break;
                }
            }
        }
    });
    addr
}

async fn request_flows(router: &Dispatcher) {
    let mut s = tokio::time::timeout(
        WAIT,
        router.generate_direct(9, GenerateRequest::new(vec![1, 2, 3], 1)),
    )
    .await
    .expect("in time")
    .expect("sent on the same connection");
    let r = tokio::time::timeout(WAIT, s.next()).await.expect("in time");
    assert!(matches!(r, Some(Ok(_))), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbage_or_oversize_event_frame_is_a_gap_and_requests_keep_flowing() {
    let (inject, rx) = mpsc::channel(8);
    let addr = fake_worker(rx).await;
    let d = Discovery::new(None);
    d.add(9, addr).await;
    d.wait_routable(&[9]).await;
    let router = kv_dispatcher(&d);
    request_flows(&router).await;
    let counts = Arc::clone(router.kv_event_counts().expect("KV mode"));

    let a = prompt(1);
    let stored = |seq| EventBatch {
        epoch: 1,
        seq,
        events: vec![KvEvent::Stored {
            parent: None,
            blocks: block_hashes(&a, BLOCK),
        }],
    };
    let garbage: [Vec<u8>; 2] = [vec![0xff; 64], vec![1; MAX_KV_BATCH_BYTES + 1]];
    for (i, bad) in garbage.into_iter().enumerate() {
        inject
            .send(encode_events(&stored(10 * i as u64)).expect("valid batch"))
            .await
            .expect("worker alive");
        eventually("the valid batch is credited", || {
            pick(&router, &a) == (9, 4)
        })
        .await;
        inject.send(bad).await.expect("worker alive");
        eventually("the bad batch is refused", || {
            counts.refused() == i as u64 + 1
        })
        .await;
        // Scored by prediction again until its next batch (which starts it afresh).
        assert!(
            !router.kv_indexed(9),
            "a refused batch drops the worker's entries"
        );
        request_flows(&router).await;
    }
}
