//! Request plane and dispatchers: round trip through `Dispatcher` vs a bare tokio echo with the
//! same framing (req/s, p50/p99), KV selector hit rate vs round robin and random on a synthetic
//! multi-turn workload, and selection cost with 64 workers.
//!
//! `cargo bench --bench push -- --warm-up-time 1 --measurement-time 3`
//! (`--features tls` adds TLS and mutual-TLS rows to both round-trip tables, same workload.)
//! The two tables print first; criterion then times the selection paths and the health
//! overhead (`health_overhead/*`: a loopback round trip with retries on, the default, and off;
//! `select_64_workers/round_robin_8_open`: a pick with 8 breakers open).

use std::hint::black_box;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::Criterion;
use futures_util::{stream, SinkExt, StreamExt};
use prefill_router::advert::KvRouterConfig;
use prefill_router::discovery::{EndpointId, Instance, InstanceEvent, InstanceId};
use prefill_router::push::{
    block_hashes, Dispatcher, KvSelector, PushConfig, PushMode, RoutableView,
};
use prefill_router::request::{FinishReason, GenerateRequest, GenerateResponse};
use prefill_router::transport::{
    decode_frame, encode_frame, serve, ClientConfig, Engine, EngineStream, Frame, ServerConfig,
};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::codec::{Framed, LengthDelimitedCodec};
use tokio_util::sync::CancellationToken;

// Certificates made at start for the TLS rows (the request-plane tests' helper).
#[cfg(feature = "tls")]
#[path = "../tests/request_plane/certs.rs"]
mod certs;
#[path = "support/hit_rate.rs"]
mod hit_rate;

/// One response carrying the prompt length, like a prefill with max_tokens 1.
struct OneShot;

impl Engine for OneShot {
    fn generate(&self, request: GenerateRequest) -> EngineStream {
        Box::pin(stream::iter([Ok(reply(&request))]))
    }
}

fn reply(request: &GenerateRequest) -> GenerateResponse {
    GenerateResponse {
        text: None,
        usage: None,
        token_ids: vec![request.token_ids.len() as u32],
        finish: Some(FinishReason::Length),
        prefill: None,
    }
}

fn codec() -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder()
        .length_field_type::<u32>()
        .new_codec()
}

/// The baseline: a bare tokio server answering each request frame with one data frame.
async fn bare_echo_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            sock.set_nodelay(true).expect("nodelay");
            tokio::spawn(async move {
                let mut framed = Framed::new(sock, codec());
                while let Some(Ok(bytes)) = framed.next().await {
                    let Ok(Frame::Request { id, request, .. }) = decode_frame(&bytes) else {
                        break;
                    };
                    let out = encode_frame(&Frame::Data {
                        id,
                        response: reply(&request),
                    });
                    if framed.send(Bytes::from(out)).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

fn instance(id: InstanceId, address: SocketAddr) -> Instance {
    Instance {
        endpoint: EndpointId::new("bench", "prefill", "generate"),
        instance_id: id,
        address,
    }
}

fn request() -> GenerateRequest {
    // 64 tokens: a 256-byte-class payload, as in the reference measurements.
    GenerateRequest::new((0..64).collect(), 1)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// A dispatcher (RoundRobin) to one fresh `OneShot` worker serving with `server`, connecting
/// with `client`.
async fn router_to(server: ServerConfig, client: ClientConfig) -> Arc<Dispatcher> {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let worker = serve(listener, Arc::new(OneShot), server).expect("serve");
    let addr = worker.local_addr();
    std::mem::forget(worker); // lives for the whole bench process
    let view = RoutableView::spawn(stream::pending(), None, CancellationToken::new());
    view.apply(InstanceEvent::Added(instance(1, addr)));
    let config = PushConfig {
        client,
        ..PushConfig::default()
    };
    Arc::new(Dispatcher::new(view, PushMode::RoundRobin, config))
}

/// The dispatchers of the tables: plain TCP, and (feature `tls`) TLS with server
/// authentication and mutual TLS.
async fn routers() -> Vec<(&'static str, Arc<Dispatcher>)> {
    let plain = router_to(ServerConfig::default(), ClientConfig::default()).await;
    std::iter::once(("Dispatcher (RoundRobin, 1 worker)", plain))
        .chain(tls_routers().await)
        .collect()
}

/// Dispatchers over TLS and mutual TLS, with certificates made at start (ECDSA P-256).
#[cfg(feature = "tls")]
async fn tls_routers() -> Vec<(&'static str, Arc<Dispatcher>)> {
    use prefill_router::transport::{ClientTls, ServerTls, TlsIdentity, TlsRoots};
    let (workers, frontends) = (certs::Ca::new("workers"), certs::Ca::new("frontends"));
    let identity = |leaf: certs::Leaf| {
        TlsIdentity::from_pem(leaf.cert_pem.as_bytes(), leaf.key_pem.as_bytes()).unwrap()
    };
    let worker_id = || identity(workers.leaf(&["127.0.0.1"], certs::Validity::Current));
    let roots = |ca: &certs::Ca| TlsRoots::from_pem(ca.pem().as_bytes()).unwrap();
    let tls = router_to(
        ServerConfig {
            tls: Some(ServerTls::new(worker_id()).unwrap()),
            ..ServerConfig::default()
        },
        ClientConfig {
            tls: Some(ClientTls::new(roots(&workers)).unwrap()),
            ..ClientConfig::default()
        },
    )
    .await;
    let frontend = identity(frontends.leaf(&["frontend"], certs::Validity::Current));
    let mutual = router_to(
        ServerConfig {
            tls: Some(ServerTls::mutual(worker_id(), roots(&frontends)).unwrap()),
            ..ServerConfig::default()
        },
        ClientConfig {
            tls: Some(ClientTls::mutual(roots(&workers), frontend).unwrap()),
            ..ClientConfig::default()
        },
    )
    .await;
    vec![
        ("Dispatcher over TLS", tls),
        ("Dispatcher over mutual TLS", mutual),
    ]
}

/// Without feature `tls`: no TLS rows.
#[cfg(not(feature = "tls"))]
async fn tls_routers() -> Vec<(&'static str, Arc<Dispatcher>)> {
    Vec::new()
}

fn round_trip_table(rt: &tokio::runtime::Runtime) {
    let (routers, echo_addr) = rt.block_on(async { (routers().await, bare_echo_server().await) });
    let rounds = 6;
    let per_round = 4000;
    let (router_lat, router_time, echo_lat, echo_time) = rt.block_on(async {
        let mut echo = Framed::new(
            TcpStream::connect(echo_addr).await.expect("connect"),
            codec(),
        );
        echo.get_ref().set_nodelay(true).expect("nodelay");
        let mut rl = vec![Vec::new(); routers.len()];
        let mut rtime = vec![Duration::ZERO; routers.len()];
        let mut el = Vec::new();
        let mut etime = Duration::ZERO;
        for round in 0..=rounds {
            // Round 0 warms up every path (connection, handshake, allocator) and is discarded;
            // the paths then alternate within each round, so load swings hit them alike.
            for (n, (_, router)) in routers.iter().enumerate() {
                let started = Instant::now();
                for _ in 0..per_round {
                    let t = Instant::now();
                    let mut s = router.generate(request()).await.expect("routed");
                    let r = s.next().await.expect("item").expect("ok");
                    black_box(r);
                    if round > 0 {
                        rl[n].push(t.elapsed());
                    }
                }
                if round > 0 {
                    rtime[n] += started.elapsed();
                }
            }
            let started = Instant::now();
            for id in 0..per_round {
                let t = Instant::now();
                let frame = Frame::Request {
                    id,
                    timeout_ms: Some(30_000),
                    request: request(),
                };
                echo.send(Bytes::from(encode_frame(&frame)))
                    .await
                    .expect("send");
                let bytes = echo.next().await.expect("frame").expect("ok");
                black_box(decode_frame(&bytes).expect("frame"));
                if round > 0 {
                    el.push(t.elapsed());
                }
            }
            if round > 0 {
                etime += started.elapsed();
            }
        }
        (rl, rtime, el, etime)
    });
    let show = |name: &str, mut lat: Vec<Duration>, time: Duration| {
        lat.sort();
        let rps = lat.len() as f64 / time.as_secs_f64();
        let (p50, p99) = (percentile(&lat, 0.5), percentile(&lat, 0.99));
        println!(
            "| {name} | {rps:.0} | {:.1} | {:.1} |",
            p50.as_secs_f64() * 1e6,
            p99.as_secs_f64() * 1e6
        );
        (rps, p50, p99)
    };
    println!(
        "\n### Round trip, 1 request / 1 response, sequential, loopback ({} requests each)",
        rounds * per_round
    );
    println!("| path | req/s | p50 µs | p99 µs |\n|---|---|---|---|");
    let shown: Vec<_> = routers
        .iter()
        .zip(router_lat.into_iter().zip(router_time))
        .map(|((name, _), (lat, time))| show(name, lat, time))
        .collect();
    let (er, ep50, ep99) = show("bare tokio echo, same framing", echo_lat, echo_time);
    let (rr, rp50, rp99) = shown[0];
    println!(
        "\nthroughput ratio router/echo: {:.2}x; added latency p50 {:+.1} µs, p99 {:+.1} µs",
        rr / er,
        (rp50.as_secs_f64() - ep50.as_secs_f64()) * 1e6,
        (rp99.as_secs_f64() - ep99.as_secs_f64()) * 1e6
    );
    for ((name, _), (r, p50, p99)) in routers.iter().zip(&shown).skip(1) {
        println!(
            "{name} / plain Dispatcher: {:.2}x; added latency p50 {:+.1} µs, p99 {:+.1} µs",
            r / rr,
            (p50.as_secs_f64() - rp50.as_secs_f64()) * 1e6,
            (p99.as_secs_f64() - rp99.as_secs_f64()) * 1e6
        );
    }
    concurrent_table(rt, &routers, echo_addr);
}

/// 16 callers at once: through the router they share one multiplexed connection; the bare
/// echo gets one connection per caller (it cannot multiplex).
fn concurrent_table(
    rt: &tokio::runtime::Runtime,
    routers: &[(&'static str, Arc<Dispatcher>)],
    echo_addr: SocketAddr,
) {
    const CALLERS: usize = 16;
    const PER_CALLER: usize = 2000;
    let (router_rates, echo_rate) = rt.block_on(async {
        let mut router_rates = Vec::new();
        for (_, router) in routers {
            let started = Instant::now();
            let calls: Vec<_> = (0..CALLERS)
                .map(|_| {
                    let router = Arc::clone(router);
                    tokio::spawn(async move {
                        for _ in 0..PER_CALLER {
                            let mut s = router.generate(request()).await.expect("routed");
                            black_box(s.next().await.expect("item").expect("ok"));
                        }
                    })
                })
                .collect();
            for c in calls {
                c.await.expect("caller");
            }
            router_rates.push((CALLERS * PER_CALLER) as f64 / started.elapsed().as_secs_f64());
        }
        let echo_rate = {
            let mut conns = Vec::new();
            for _ in 0..CALLERS {
                let sock = TcpStream::connect(echo_addr).await.expect("connect");
                sock.set_nodelay(true).expect("nodelay");
                conns.push(Framed::new(sock, codec()));
            }
            let started = Instant::now();
            let tasks: Vec<_> = conns
                .into_iter()
                .map(|mut echo| {
                    tokio::spawn(async move {
                        for id in 0..PER_CALLER as u64 {
                            let frame = Frame::Request {
                                id,
                                timeout_ms: Some(30_000),
                                request: request(),
                            };
                            echo.send(Bytes::from(encode_frame(&frame)))
                                .await
                                .expect("send");
                            let bytes = echo.next().await.expect("frame").expect("ok");
                            black_box(decode_frame(&bytes).expect("frame"));
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.expect("caller");
            }
            (CALLERS * PER_CALLER) as f64 / started.elapsed().as_secs_f64()
        };
        (router_rates, echo_rate)
    });
    println!("\n### {CALLERS} concurrent callers, {PER_CALLER} requests each");
    println!("| path | req/s |\n|---|---|");
    for ((name, _), rate) in routers.iter().zip(&router_rates) {
        println!("| {name}, one multiplexed connection | {rate:.0} |");
    }
    println!("| bare tokio echo, one connection per caller | {echo_rate:.0} |");
    println!("\nratio router/echo: {:.2}x", router_rates[0] / echo_rate);
    for ((name, _), rate) in routers.iter().zip(&router_rates).skip(1) {
        println!("{name} / plain Dispatcher: {:.2}x", rate / router_rates[0]);
    }
}

fn selection(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let _guard = rt.enter();
    let view = RoutableView::spawn(stream::pending(), None, CancellationToken::new());
    for id in 0..64 {
        let addr: SocketAddr = ([127, 0, 0, 1], 10_000 + id as u16).into();
        view.apply(InstanceEvent::Added(instance(id, addr)));
    }
    let kv_mode = PushMode::Kv {
        block_size: 16,
        config: KvRouterConfig::default(),
    };
    let kv_router = Dispatcher::new(view.clone(), kv_mode, PushConfig::default());
    let rr_router = Dispatcher::new(view.clone(), PushMode::RoundRobin, PushConfig::default());
    // Warm the KV index with a realistic history.
    let prompts = hit_rate::workload(400, 8, 8, 7);
    for p in &prompts {
        let _ = kv_router.select(&GenerateRequest::new(p.clone(), 1));
    }
    let requests: Vec<GenerateRequest> = hit_rate::workload(64, 4, 8, 99)
        .into_iter()
        .map(|p| GenerateRequest::new(p, 1))
        .collect();
    let mut group = c.benchmark_group("select_64_workers");
    let mut i = 0;
    group.bench_function("kv", |b| {
        b.iter(|| {
            i = (i + 1) % requests.len();
            black_box(kv_router.select(&requests[i]).expect("pick"))
        })
    });
    group.bench_function("round_robin", |b| {
        b.iter(|| black_box(rr_router.select(&requests[0]).expect("pick")))
    });
    // The same pick with 8 of the 64 breakers open (nothing listens at those addresses, so
    // their probes keep failing): the breakers are consulted when the routable set is rebuilt,
    // not per request.
    let open_view = RoutableView::spawn(stream::pending(), None, CancellationToken::new());
    for id in 0..64 {
        let addr: SocketAddr = ([127, 0, 0, 1], 10_000 + id as u16).into();
        open_view.apply(InstanceEvent::Added(instance(id, addr)));
    }
    for id in 0..8 {
        open_view.report_failure(id, prefill_router::health::FailureClass::ConnectionRefused);
    }
    assert_eq!(open_view.routable().len(), 56);
    let open_router = Dispatcher::new(open_view, PushMode::RoundRobin, PushConfig::default());
    group.bench_function("round_robin_8_open", |b| {
        b.iter(|| black_box(open_router.select(&requests[0]).expect("pick")))
    });
    let mut selector = KvSelector::new(16, &KvRouterConfig::default(), 1 << 20);
    for (n, p) in prompts.iter().enumerate() {
        selector.record(&block_hashes(p, 16), n as u64 % 64);
    }
    let cands: Vec<(InstanceId, u64)> = (0..64).map(|w| (w, w % 3 * 2048)).collect();
    let hashed: Vec<Vec<u64>> = requests
        .iter()
        .map(|r| block_hashes(&r.token_ids, 16))
        .collect();
    group.bench_function("kv_selector_score_only", |b| {
        b.iter(|| {
            i = (i + 1) % hashed.len();
            black_box(selector.select(&hashed[i], 512, &cands, None, 0))
        })
    });
    group.finish();
    let mean_blocks = hashed.iter().map(Vec::len).sum::<usize>() as f64 / hashed.len() as f64;
    println!("(selection requests average {mean_blocks:.0} blocks of 16 tokens)");
}

/// A loopback round trip through `Dispatcher::generate` with the default retry budget (2: the
/// call reads the first response ahead and keeps a copy of the request) and with retries off,
/// timed side by side.
fn health_overhead(c: &mut Criterion, rt: &tokio::runtime::Runtime) {
    let (with_retry, without) = rt.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let worker = serve(listener, Arc::new(OneShot), ServerConfig::default()).expect("serve");
        let addr = worker.local_addr();
        std::mem::forget(worker); // lives for the whole bench process
        let view = RoutableView::spawn(stream::pending(), None, CancellationToken::new());
        view.apply(InstanceEvent::Added(instance(1, addr)));
        let with_retry = Dispatcher::new(view.clone(), PushMode::RoundRobin, PushConfig::default());
        let without = Dispatcher::new(
            view,
            PushMode::RoundRobin,
            PushConfig {
                retry_budget: 0,
                ..PushConfig::default()
            },
        );
        (with_retry, without)
    });
    let mut group = c.benchmark_group("health_overhead");
    for (name, router) in [
        ("retry_budget_2", &with_retry),
        ("retry_budget_0", &without),
    ] {
        group.bench_function(name, |b| {
            b.iter(|| {
                rt.block_on(async {
                    let mut s = router.generate(request()).await.expect("routed");
                    black_box(s.next().await.expect("item").expect("ok"))
                })
            })
        });
    }
    group.finish();
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    round_trip_table(&rt);
    hit_rate::hit_rate_table();
    let mut c = Criterion::default().configure_from_args();
    selection(&mut c);
    health_overhead(&mut c, &rt);
    c.final_summary();
}
