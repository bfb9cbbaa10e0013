//! KV cache events on the request plane: delivery latency (a prefill changes the worker's
//! cache → the batch is applied in the router's KV index, over loopback TCP) and the cost per
//! routed request with a worker that publishes events vs one that does not (interleaved rounds,
//! same process, same prompts).
//!
//! `cargo run --release -p prefill-router-tools --example kv_events_wire [-- ROUNDS]`

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use parking_lot::Mutex;
use prefill_router::advert::KvRouterConfig;
use prefill_router::discovery::{EndpointId, Instance, InstanceEvent, InstanceId};
use prefill_router::health::BackoffPolicy;
use prefill_router::kv_events::EventBatch;
use prefill_router::push::{Dispatcher, PushConfig, PushMode, RoutableView};
use prefill_router::request::GenerateRequest;
use prefill_router::transport::{
    serve, serve_with_kv_events, ClientConfig, Connection, Engine, EngineStream, KvEventSink,
    KvEventSource, KvStreamError, ServerConfig, ServerHandle,
};
use prefill_router_tools::mock::{MockConfig, MockPrefill};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

const BLOCK: u32 = 16;
/// The default coalescing window, compared with none.
const COALESCED: Duration = prefill_router::transport::KV_COALESCE;
const WORKER: InstanceId = 1;

fn config() -> MockConfig {
    MockConfig {
        block_size: BLOCK,
        block_cost: Duration::ZERO,
        token_interval: Duration::ZERO,
        cache_blocks: 4096,
    }
}

/// A mock prefill that notes when each request changed its cache (the batch exists from then).
struct Timed {
    inner: Arc<MockPrefill>,
    changed: Mutex<VecDeque<Instant>>,
}

impl Engine for Timed {
    fn generate(&self, request: GenerateRequest) -> EngineStream {
        let stream = self.inner.generate(request);
        self.changed.lock().push_back(Instant::now());
        stream
    }
}

impl KvEventSource for Timed {
    fn take_kv_events(&self) -> Vec<EventBatch> {
        self.inner.take_kv_events()
    }
}

/// Applies batches to the dispatcher's index, as a KV-mode dispatcher's own connections do,
/// and notes when.
struct Applier {
    router: Arc<Dispatcher>,
    applied: mpsc::UnboundedSender<Instant>,
}

impl KvEventSink for Applier {
    fn batch(&self, batch: EventBatch) {
        self.router.apply_kv_events(WORKER, &batch);
        let _ = self.applied.send(Instant::now());
    }
    fn error(&self, error: KvStreamError) {
        eprintln!("stream error: {error}");
    }
    fn closed(&self) {}
}

fn prompt(i: u32) -> Vec<u32> {
    (0..8 * BLOCK)
        .map(|t| i.wrapping_mul(7919).wrapping_add(t))
        .collect()
}

async fn listener() -> tokio::net::TcpListener {
    tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind")
}

async fn router_over(server: &ServerHandle, cancel: &CancellationToken) -> Arc<Dispatcher> {
    let (tx, mut rx) = mpsc::channel::<InstanceEvent>(4);
    let view = RoutableView::spawn_with(
        futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)),
        None,
        cancel.clone(),
        BackoffPolicy::default(),
    );
    tx.send(InstanceEvent::Added(Instance {
        endpoint: EndpointId::new("bench", "prefill", "generate"),
        instance_id: WORKER,
        address: server.local_addr(),
    }))
    .await
    .expect("view");
    view.wait_for(|r| r.len() == 1).await;
    let mode = PushMode::Kv {
        block_size: BLOCK,
        config: KvRouterConfig::default(),
    };
    Arc::new(Dispatcher::new(view, mode, PushConfig::default()))
}

async fn one(router: &Dispatcher, tokens: Vec<u32>) {
    let mut s = router
        .generate(GenerateRequest::new(tokens, 1))
        .await
        .expect("sent");
    while let Some(r) = s.next().await {
        r.expect("response");
    }
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let rounds: u32 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5);
    let cancel = CancellationToken::new();

    for coalesce in [Duration::ZERO, COALESCED] {
        latency(coalesce, &cancel).await;
    }
    cost(rounds, &cancel).await;
    cancel.cancel();
}

/// One request at a time, so each request's cache change is one batch.
async fn latency(coalesce: Duration, cancel: &CancellationToken) {
    let timed = Arc::new(Timed {
        inner: MockPrefill::with_kv_events(WORKER, config(), 1),
        changed: Mutex::new(VecDeque::new()),
    });
    let server = serve_with_kv_events(
        listener().await,
        timed.clone(),
        ServerConfig {
            kv_coalesce: coalesce,
            ..ServerConfig::default()
        },
        timed.clone(),
    )
    .expect("serve");
    let router = router_over(&server, cancel).await;
    let (applied_tx, mut applied_rx) = mpsc::unbounded_channel();
    let sink = Arc::new(Applier {
        router: Arc::clone(&router),
        applied: applied_tx,
    });
    let conn =
        Connection::connect_with_kv_events(server.local_addr(), ClientConfig::default(), sink)
            .await
            .expect("connect");
    // The publisher's opening batch (Cleared alone) goes out before any request: let it pass,
    // so that each later batch pairs with its own request.
    tokio::time::sleep(Duration::from_millis(50)).await;
    while applied_rx.try_recv().is_ok() {}
    timed.changed.lock().clear();
    let mut latencies = Vec::new();
    for i in 0..2_000u32 {
        let mut s = conn
            .generate(GenerateRequest::new(prompt(i), 1), None)
            .await
            .expect("sent");
        while s.next().await.is_some() {}
        let applied = tokio::time::timeout(Duration::from_secs(5), applied_rx.recv())
            .await
            .expect("a batch per request")
            .expect("sink alive");
        let changed = timed.changed.lock().pop_front().expect("noted");
        if i >= 10 {
            latencies.push(applied.saturating_duration_since(changed));
        }
    }
    latencies.sort();
    println!(
        "delivery latency (kv_coalesce {:?}), cache change -> applied in the index ({} batches): p50 {:?}, p99 {:?}, max {:?}",
        coalesce,
        latencies.len(),
        pct(&latencies, 0.50),
        pct(&latencies, 0.99),
        latencies[latencies.len() - 1]
    );
    drop(conn);
    server.stop().await;
}

/// The same KV dispatcher path to a worker without events, with events one batch per request
/// (`kv_coalesce` 0), and with the default 1 ms coalescing window.
async fn cost(rounds: u32, cancel: &CancellationToken) {
    let off = serve(
        listener().await,
        MockPrefill::new(WORKER, config()),
        ServerConfig::default(),
    )
    .expect("serve");
    let mut servers = vec![off];
    for coalesce in [Duration::ZERO, COALESCED] {
        let engine = MockPrefill::with_kv_events(WORKER, config(), 1);
        let server = serve_with_kv_events(
            listener().await,
            engine.clone(),
            ServerConfig {
                kv_coalesce: coalesce,
                ..ServerConfig::default()
            },
            engine,
        )
        .expect("serve");
        servers.push(server);
    }
    let mut routers = Vec::new();
    for server in &servers {
        routers.push(router_over(server, cancel).await);
    }
    const PER_ROUND: u32 = 4_000;
    let mut totals = [Duration::ZERO; 3];
    for round in 0..=rounds {
        for (router, total) in routers.iter().zip(totals.iter_mut()) {
            let start = Instant::now();
            for i in 0..PER_ROUND {
                one(router, prompt(round * PER_ROUND + i)).await;
            }
            // Round 0 warms up connections and caches.
            if round > 0 {
                *total += start.elapsed();
            }
        }
    }
    let n = f64::from(rounds * PER_ROUND);
    let us = |t: Duration| t.as_secs_f64() * 1e6 / n;
    println!(
        "per routed request (KV mode, sequential, {} requests each, interleaved rounds):",
        rounds * PER_ROUND
    );
    println!("  events off                  {:.1} µs", us(totals[0]));
    for (i, label) in ["events on, kv_coalesce 0   ", "events on, kv_coalesce 1 ms"]
        .iter()
        .enumerate()
    {
        let counts = routers[i + 1].kv_event_counts().expect("KV mode");
        println!(
            "  {label} {:.1} µs (x{:.2}); batches applied {}, lagged {}",
            us(totals[i + 1]),
            us(totals[i + 1]) / us(totals[0]),
            counts.applied(),
            counts.lagged()
        );
    }
}
