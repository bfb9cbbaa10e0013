//! Load reports on the wire: report frames per second and bytes per request next to the KV
//! event frames, at the Mooncake replay's rate (3.4 requests/s) and at 10x, with reports off
//! (KV events alone) and on. Two KV-mode frontends (each its own dispatcher and connections)
//! send a shared-prefix stream, alternating, to two mock prefill workers; a counting proxy in
//! front of each worker classifies every worker → frontend frame.
//!
//! `cargo run --release -p prefill-router-tools --example load_reports_wire [-- SECONDS]`

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use prefill_router::advert::KvRouterConfig;
use prefill_router::discovery::{EndpointId, Instance, InstanceEvent, InstanceId};
use prefill_router::health::BackoffPolicy;
use prefill_router::push::{Dispatcher, PushConfig, PushMode, RoutableView};
use prefill_router::request::GenerateRequest;
use prefill_router::transport::{decode_frame, serve_with_kv_events, Frame, ServerConfig};
use prefill_router_tools::mock::{MockConfig, MockPrefill};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

const BLOCK: u32 = 16;
const WORKERS: u64 = 2;
const FRONTENDS: usize = 2;
/// The replay's mean arrival rate (docs/replay.md: 3.4 requests/s).
const REPLAY_RATE: f64 = 3.4;

/// Worker → frontend frames and bytes (length prefix included), by kind.
#[derive(Default)]
struct Counts {
    kv_frames: AtomicU64,
    kv_bytes: AtomicU64,
    report_frames: AtomicU64,
    report_bytes: AtomicU64,
    other_frames: AtomicU64,
    other_bytes: AtomicU64,
}

/// Forward `client` ↔ `worker`, counting the worker's frames.
async fn proxy_one(mut client: TcpStream, worker: SocketAddr, counts: Arc<Counts>) {
    let Ok(upstream) = TcpStream::connect(worker).await else {
        return;
    };
    let _ = upstream.set_nodelay(true);
    let _ = client.set_nodelay(true);
    let (mut up_rd, mut up_wr) = upstream.into_split();
    let (mut cl_rd, mut cl_wr) = client.split();
    let to_worker = async {
        let _ = tokio::io::copy(&mut cl_rd, &mut up_wr).await;
    };
    let to_client = async {
        loop {
            let mut len = [0u8; 4];
            if up_rd.read_exact(&mut len).await.is_err() {
                break;
            }
            let mut payload = vec![0u8; u32::from_be_bytes(len) as usize];
            if up_rd.read_exact(&mut payload).await.is_err() {
                break;
            }
            let bytes = payload.len() as u64 + 4;
            let (frames, total) = match decode_frame(&payload) {
                Ok(Frame::KvEvents { .. }) => (&counts.kv_frames, &counts.kv_bytes),
                Ok(Frame::LoadReport { .. }) => (&counts.report_frames, &counts.report_bytes),
                _ => (&counts.other_frames, &counts.other_bytes),
            };
            frames.fetch_add(1, Ordering::Relaxed);
            total.fetch_add(bytes, Ordering::Relaxed);
            if cl_wr.write_all(&len).await.is_err() || cl_wr.write_all(&payload).await.is_err() {
                break;
            }
        }
    };
    tokio::select! {
        _ = to_worker => {}
        _ = to_client => {}
    }
}

async fn proxy(worker: SocketAddr, counts: Arc<Counts>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            tokio::spawn(proxy_one(client, worker, Arc::clone(&counts)));
        }
    });
    addr
}

/// A shared 32-block system prompt, then 16 blocks of the request's own.
fn prompt(i: u64) -> Vec<u32> {
    let hot = (0..32 * BLOCK).map(|t| 9_000_000 + t);
    let own = (0..16 * BLOCK).map(move |t| (i as u32).wrapping_mul(7919).wrapping_add(t));
    hot.chain(own).collect()
}

struct Run {
    requests: u64,
    elapsed: Duration,
    counts: Arc<Counts>,
}

async fn run(rate: f64, seconds: f64, load_reports: bool) -> Run {
    let cancel = CancellationToken::new();
    let counts = Arc::new(Counts::default());
    let (tx, mut rx) = mpsc::channel::<InstanceEvent>(8);
    let view = RoutableView::spawn_with(
        futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)),
        None,
        cancel.clone(),
        BackoffPolicy::default(),
    );
    let mut servers = Vec::new();
    for id in 1..=WORKERS {
        let config = MockConfig {
            block_size: BLOCK,
            // ~100 ms for a request's 16 uncached blocks: work overlaps at 10x.
            block_cost: Duration::from_micros(6_000),
            token_interval: Duration::ZERO,
            cache_blocks: 1 << 16,
        };
        let engine = MockPrefill::with_kv_events(id, config, 1);
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let server_config = ServerConfig {
            load_reports,
            ..ServerConfig::default()
        };
        let server =
            serve_with_kv_events(listener, engine.clone(), server_config, engine).expect("serve");
        let address = proxy(server.local_addr(), Arc::clone(&counts)).await;
        tx.send(InstanceEvent::Added(Instance {
            endpoint: EndpointId::new("bench", "prefill", "generate"),
            instance_id: id as InstanceId,
            address,
        }))
        .await
        .expect("view");
        servers.push(server);
    }
    view.wait_for(|r| r.len() == WORKERS as usize).await;
    let mode = PushMode::Kv {
        block_size: BLOCK,
        config: KvRouterConfig::default(),
    };
    let frontends: Vec<Arc<Dispatcher>> = (0..FRONTENDS)
        .map(|_| {
            Arc::new(Dispatcher::new(
                view.clone(),
                mode.clone(),
                PushConfig::default(),
            ))
        })
        .collect();
    let interval = Duration::from_secs_f64(1.0 / rate);
    let n = (rate * seconds).round() as u64;
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..n {
        tokio::time::sleep_until((start + interval * i as u32).into()).await;
        let f = Arc::clone(&frontends[i as usize % FRONTENDS]);
        tasks.push(tokio::spawn(async move {
            let mut s = f
                .generate(GenerateRequest::new(prompt(i), 1))
                .await
                .expect("sent");
            while let Some(r) = s.next().await {
                r.expect("response");
            }
        }));
    }
    for t in tasks {
        t.await.expect("request task");
    }
    let elapsed = start.elapsed();
    drop(frontends);
    cancel.cancel();
    for s in servers {
        s.stop().await;
    }
    Run {
        requests: n,
        elapsed,
        counts,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let seconds: f64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(30.0);
    println!(
        "{FRONTENDS} frontends, {WORKERS} workers, {seconds} s per run; worker -> frontend frames"
    );
    println!("| rate | reports | requests | KV frames/s | KV bytes/req | report frames/s | report bytes/req | response bytes/req |");
    println!("|---|---|---|---|---|---|---|---|");
    for rate in [REPLAY_RATE, 10.0 * REPLAY_RATE] {
        for load_reports in [false, true] {
            let r = run(rate, seconds, load_reports).await;
            let c = &r.counts;
            let secs = r.elapsed.as_secs_f64();
            let req = r.requests as f64;
            let get = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
            println!(
                "| {rate:.1}/s | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
                if load_reports { "on" } else { "off" },
                r.requests,
                get(&c.kv_frames) / secs,
                get(&c.kv_bytes) / req,
                get(&c.report_frames) / secs,
                get(&c.report_bytes) / req,
                get(&c.other_bytes) / req,
            );
        }
    }
}
