//! What the HTTP frontend adds: requests/s and latency of six sides, interleaved in rounds
//! in one process, with zero-cost loopback mock workers (2 prefill, 1 decode):
//!
//! - `in-process`: `PrefillHop::generate` called directly (the request drained);
//! - `serve`: the same hop behind `prefill_router::http` (what `prefill-router serve` runs),
//!   non-streaming `POST /v1/completions` over loopback HTTP/1.1 keep-alive connections;
//! - `serve+keys`: the same, on a second listener of the same hop with API keys on (three
//!   keys, each request with `Authorization: Bearer` of the last one): what the key check adds;
//! - `floor`: a minimal axum server on the same HTTP stack answering a fixed completion;
//! - `in-process+tls` and `serve+tls`: the first two over a second set of the same workers
//!   that require mutual TLS on the request plane (`ServerTls::mutual`; their own discovery),
//!   through a second hop whose push config dials with `ClientTls::mutual` (certificates made
//!   with rcgen at start): what request-plane TLS adds in and through the frontend.
//!
//! Two passes, each interleaved in rounds: throughput with C concurrent callers (each with its
//! own keep-alive connection), then latency with one caller (no queueing: what each side adds
//! to one request on an idle box).
//!
//! `cargo bench --bench serve --features http,tls -- [--secs S] [--rounds N] [--concurrency C]
//! [--svg PATH]` (defaults: 1 s per side per round, 5 rounds, 16 connections/callers; about
//! 2 × (rounds + 1) × 6 × S seconds in all).

#[path = "../../tests/request_plane/certs.rs"]
mod certs;

#[path = "support/args.rs"]
mod args;
use args::{arg, num};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use prefill_router::advert::{ModelCard, SelectionMode};
use prefill_router::discovery::{Discovery, EndpointId, MemoryConfig, MemoryDiscovery};
use prefill_router::http::{ApiKeys, HttpConfig};
use prefill_router::push::PushConfig;
use prefill_router::request::GenerateRequest;
use prefill_router::transport::{
    ClientConfig, ClientTls, ServerConfig, ServerTls, TlsIdentity, TlsRoots,
};
use prefill_router::{PrefillHop, PrefillHopConfig};
use prefill_router_tools::mock::{spawn_registered, MockConfig, MockDecode, MockPrefill};
use tokio::net::{TcpListener, TcpStream};

const MAX_TOKENS: u32 = 4;
const PROMPT: &str = "the prefill hop routes one request to one worker";

/// The latencies of one side in one round, and its request rate.
struct Run {
    rate: f64,
    latencies: Vec<Duration>,
}

/// `concurrency` loops calling `call` for `secs`; each call's latency recorded.
async fn saturate<F, Fut>(concurrency: u64, secs: Duration, call: F) -> Run
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let call = Arc::new(call);
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    let start = Instant::now();
    for c in 0..concurrency {
        let (call, stop) = (Arc::clone(&call), Arc::clone(&stop));
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                call(c).await;
                latencies.push(t.elapsed());
            }
            latencies
        }));
    }
    tokio::time::sleep(secs).await;
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await.unwrap());
    }
    let elapsed = start.elapsed();
    Run {
        rate: latencies.len() as f64 / elapsed.as_secs_f64(),
        latencies,
    }
}

/// One keep-alive HTTP/1.1 connection per caller.
async fn connections(
    addr: SocketAddr,
    n: u64,
) -> Vec<tokio::sync::Mutex<hyper::client::conn::http1::SendRequest<Full<Bytes>>>> {
    let mut out = Vec::new();
    for _ in 0..n {
        let stream = TcpStream::connect(addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        out.push(tokio::sync::Mutex::new(sender));
    }
    out
}

/// The keys of the `serve+keys` side (OpenAI-like lengths); requests present the last.
const KEYS: [&str; 3] = [
    "sk-bench-0000000000000000000000000000000000000000000000",
    "sk-bench-1111111111111111111111111111111111111111111111",
    "sk-bench-2222222222222222222222222222222222222222222222",
];

async fn http_side(
    addr: SocketAddr,
    concurrency: u64,
    secs: Duration,
    key: Option<&'static str>,
) -> Run {
    let conns = Arc::new(connections(addr, concurrency).await);
    let authorization = key.map(|k| format!("Bearer {k}"));
    let body = Bytes::from(
        serde_json::json!({"model": "mock-llm", "prompt": PROMPT, "max_tokens": MAX_TOKENS})
            .to_string(),
    );
    saturate(concurrency, secs, move |c| {
        let (conns, body, authorization) =
            (Arc::clone(&conns), body.clone(), authorization.clone());
        async move {
            let mut sender = conns[c as usize].lock().await;
            sender.ready().await.unwrap();
            let mut request = hyper::Request::post("/v1/completions")
                .header("host", "bench")
                .header("content-type", "application/json");
            if let Some(value) = authorization {
                request = request.header("authorization", value);
            }
            let request = request.body(Full::new(body)).unwrap();
            let response = sender.send_request(request).await.unwrap();
            assert_eq!(response.status(), 200);
            let bytes = response.into_body().collect().await.unwrap().to_bytes();
            assert!(bytes.len() > 50);
        }
    })
    .await
}

async fn in_process_side(hop: &Arc<PrefillHop>, concurrency: u64, secs: Duration) -> Run {
    let hop = Arc::clone(hop);
    let prompt = prefill_router::http::tokenizer::tokenize(PROMPT);
    saturate(concurrency, secs, move |_| {
        let (hop, prompt) = (Arc::clone(&hop), prompt.clone());
        async move {
            let stream = hop
                .generate(GenerateRequest::new(prompt, MAX_TOKENS))
                .await
                .unwrap();
            assert_eq!(stream.count().await, MAX_TOKENS as usize);
        }
    })
    .await
}

/// The floor: the same HTTP stack answering a fixed completion, no routing at all.
async fn floor_server() -> SocketAddr {
    async fn fixed(body: Bytes) -> axum::Json<serde_json::Value> {
        let _: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        axum::Json(serde_json::json!({
            "id": "cmpl-0", "object": "text_completion", "created": 0, "model": "mock-llm",
            "choices": [{"index": 0, "text": " the prefill hop routes", "logprobs": null,
                         "finish_reason": "length"}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13},
        }))
    }
    let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().route("/v1/completions", axum::routing::post(fixed));
    use axum::serve::ListenerExt;
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Number of sides.
const N: usize = 6;
const SIDES: [&str; N] = [
    "in-process",
    "serve",
    "serve+keys",
    "floor",
    "in-process+tls",
    "serve+tls",
];
const COLORS: [&str; N] = [
    "#2ca02c", "#1f77b4", "#d62728", "#7f7f7f", "#98df8a", "#9467bd",
];
/// Index of `serve+keys` in [`SIDES`].
const KEYED: usize = 2;
/// Index of the floor in [`SIDES`].
const FLOOR: usize = 3;
/// Index of `in-process+tls` in [`SIDES`].
const INPROC_TLS: usize = 4;
/// Index of `serve+tls` in [`SIDES`].
const SERVE_TLS: usize = 5;

/// Latency CDFs (log time axis) of the sides, as SVG text.
fn svg(latencies: &[Vec<Duration>; N], concurrency: u64) -> String {
    use std::fmt::Write;
    let (w, h, pad) = (520.0, 300.0, 60.0);
    let lo = latencies
        .iter()
        .filter_map(|l| l.first())
        .min()
        .map_or(1.0, |d| us(*d).max(1.0))
        .log10()
        .floor();
    let hi = latencies
        .iter()
        .filter_map(|l| l.last())
        .max()
        .map_or(10.0, |d| us(*d).max(10.0))
        .log10()
        .ceil();
    let x = |v: f64| pad + (v.max(1.0).log10() - lo) / (hi - lo) * w;
    let y = |p: f64| pad + (1.0 - p) * h;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0}\" height=\"{:.0}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{pad}\" y=\"25\" font-size=\"14\">Request latency CDF, {concurrency} caller(s), zero-cost mock workers (benches/serve.rs)</text>",
        w + 2.0 * pad,
        h + 2.0 * pad + 70.0
    );
    let _ = writeln!(
        out,
        "<rect x=\"{pad}\" y=\"{pad}\" width=\"{w}\" height=\"{h}\" fill=\"none\" stroke=\"#999\"/>"
    );
    let mut decade = lo;
    while decade <= hi {
        let xv = x(10f64.powf(decade));
        let _ = writeln!(
            out,
            "<line x1=\"{xv:.1}\" y1=\"{pad}\" x2=\"{xv:.1}\" y2=\"{:.1}\" stroke=\"#eee\"/><text x=\"{xv:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{} us</text>",
            pad + h,
            pad + h + 15.0,
            10f64.powf(decade)
        );
        decade += 1.0;
    }
    for p in [0.0, 0.5, 0.99, 1.0] {
        let _ = writeln!(
            out,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{p}</text>",
            pad - 5.0,
            y(p) + 4.0
        );
    }
    for (i, l) in latencies.iter().enumerate() {
        if l.is_empty() {
            continue;
        }
        let step = (l.len() / 400).max(1);
        let mut points = String::new();
        for (k, d) in l.iter().enumerate().step_by(step) {
            let _ = write!(
                points,
                "{:.1},{:.1} ",
                x(us(*d)),
                y(k as f64 / l.len() as f64)
            );
        }
        let last = l[l.len() - 1];
        let _ = write!(points, "{:.1},{:.1}", x(us(last)), y(1.0));
        let _ = writeln!(
            out,
            "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\" points=\"{points}\"/>",
            COLORS[i]
        );
        let ly = pad + h + 35.0 + 15.0 * i as f64;
        let _ = writeln!(
            out,
            "<rect x=\"{pad}\" y=\"{:.0}\" width=\"10\" height=\"10\" fill=\"{}\"/><text x=\"{:.0}\" y=\"{:.0}\">{}: p50 {:.0} us, p99 {:.0} us</text>",
            ly - 9.0,
            COLORS[i],
            pad + 15.0,
            ly,
            SIDES[i],
            us(quantile(l, 0.5)),
            us(quantile(l, 0.99))
        );
    }
    out.push_str("</svg>\n");
    out
}

/// The listeners of the HTTP sides.
#[derive(Clone, Copy)]
struct Addrs {
    serve: SocketAddr,
    keyed: SocketAddr,
    floor: SocketAddr,
    /// `serve` over the TLS hop.
    tls: SocketAddr,
}

/// The hops: plain request plane, and mutual TLS to the second set of workers.
struct Hops {
    plain: Arc<PrefillHop>,
    tls: Arc<PrefillHop>,
}

/// One pass: `rounds` rounds (after a warm-up) of the sides, order rotating per round;
/// per side the rate of every round and every latency.
async fn pass(
    hops: &Hops,
    addrs: Addrs,
    concurrency: u64,
    secs: Duration,
    rounds: u64,
) -> ([Vec<f64>; N], [Vec<Duration>; N]) {
    println!();
    println!("{concurrency} caller(s):");
    println!(
        "{:<8} {:>13} {:>9} {:>9} {:>9} {:>13} {:>9} {:>11} {:>12} {:>10} {:>10} {:>10}",
        "round",
        "in-process/s",
        "serve/s",
        "keys/s",
        "floor/s",
        "inproc+tls/s",
        "serve+tls/s",
        "serve/floor",
        "serve/inproc",
        "keys/serve",
        "tls/inproc",
        "tls/serve"
    );
    let mut all: [Vec<Duration>; N] = Default::default();
    let mut rates: [Vec<f64>; N] = Default::default();
    for round in 0..=rounds {
        let mut got: [f64; N] = [0.0; N];
        // Rotate the order so drift within a round favours no side.
        for k in 0..SIDES.len() {
            let side = (k + round as usize) % SIDES.len();
            let run = match side {
                0 => in_process_side(&hops.plain, concurrency, secs).await,
                1 => http_side(addrs.serve, concurrency, secs, None).await,
                KEYED => http_side(addrs.keyed, concurrency, secs, Some(KEYS[2])).await,
                FLOOR => http_side(addrs.floor, concurrency, secs, None).await,
                INPROC_TLS => in_process_side(&hops.tls, concurrency, secs).await,
                _ => http_side(addrs.tls, concurrency, secs, None).await,
            };
            got[side] = run.rate;
            if round > 0 {
                all[side].extend(run.latencies);
                rates[side].push(run.rate);
            }
        }
        let label = if round == 0 {
            "warm-up".to_owned()
        } else {
            round.to_string()
        };
        println!(
            "{label:<8} {:>13.0} {:>9.0} {:>9.0} {:>9.0} {:>13.0} {:>9.0} {:>11.3} {:>12.3} {:>10.3} {:>10.3} {:>10.3}",
            got[0],
            got[1],
            got[KEYED],
            got[FLOOR],
            got[INPROC_TLS],
            got[SERVE_TLS],
            got[1] / got[FLOOR],
            got[1] / got[0],
            got[KEYED] / got[1],
            got[INPROC_TLS] / got[0],
            got[SERVE_TLS] / got[1]
        );
    }
    (rates, all)
}

/// The zero-cost mock workers (2 prefill, 1 decode) on their own discovery, served with
/// `server`, and a ready hop over them dialing with `client`.
async fn hop_over_workers(
    server: ServerConfig,
    client: ClientConfig,
) -> (Arc<PrefillHop>, Vec<impl Sized>) {
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new(MemoryConfig::default()));
    let mock = MockConfig {
        block_size: 16,
        block_cost: Duration::ZERO,
        token_interval: Duration::ZERO,
        cache_blocks: 4096,
    };
    let card = ModelCard::routed("mock-llm", SelectionMode::RoundRobin, 16);
    let mut held = Vec::new();
    for id in 1..=2 {
        let ep = EndpointId::new("bench", "prefill", "generate");
        held.push(
            spawn_registered(
                &discovery,
                ep,
                id,
                MockPrefill::new(id, mock.clone()),
                card.clone(),
                server.clone(),
            )
            .await
            .unwrap(),
        );
    }
    let ep = EndpointId::new("bench", "decode", "generate");
    held.push(
        spawn_registered(
            &discovery,
            ep,
            100,
            MockDecode::new(100, mock.clone()),
            card.clone(),
            server,
        )
        .await
        .unwrap(),
    );

    // Both legs, prefill and decode, dial workers with the same client config.
    let push = PushConfig {
        client,
        ..PushConfig::default()
    };
    let config = PrefillHopConfig {
        push,
        ..PrefillHopConfig::default()
    };
    let hop = Arc::new(
        PrefillHop::start(Arc::clone(&discovery), "bench", config)
            .await
            .unwrap(),
    );
    let mut status = hop.subscribe();
    tokio::time::timeout(
        Duration::from_secs(10),
        status.wait_for(|s| s.readiness.is_ready() && s.lifecycle.to_string() == "active"),
    )
    .await
    .unwrap()
    .unwrap();
    (hop, held)
}

/// `prefill_router::http::serve` over `hop` on a new loopback listener.
async fn frontend(hop: &Arc<PrefillHop>, config: HttpConfig) -> SocketAddr {
    let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let hop = Arc::clone(hop);
    tokio::spawn(async move {
        prefill_router::http::serve(listener, hop, config, std::future::pending()).await
    });
    addr
}

async fn run(secs: Duration, rounds: u64, concurrency: u64, svg_path: Option<String>) {
    let (plain, held) = hop_over_workers(ServerConfig::default(), ClientConfig::default()).await;
    // Mutual TLS: workers present a leaf of one CA and require a client leaf of another.
    let (workers_ca, frontends_ca) = (certs::Ca::new("workers"), certs::Ca::new("frontends"));
    let identity = |leaf: certs::Leaf| {
        TlsIdentity::from_pem(leaf.cert_pem.as_bytes(), leaf.key_pem.as_bytes()).unwrap()
    };
    let roots = |ca: &certs::Ca| TlsRoots::from_pem(ca.pem().as_bytes()).unwrap();
    let worker_id = identity(workers_ca.leaf(&["127.0.0.1"], certs::Validity::Current));
    let frontend_id = identity(frontends_ca.leaf(&["frontend"], certs::Validity::Current));
    let (tls, held_tls) = hop_over_workers(
        ServerConfig {
            tls: Some(ServerTls::mutual(worker_id, roots(&frontends_ca)).unwrap()),
            ..ServerConfig::default()
        },
        ClientConfig {
            tls: Some(ClientTls::mutual(roots(&workers_ca), frontend_id).unwrap()),
            ..ClientConfig::default()
        },
    )
    .await;
    let hops = Hops { plain, tls };
    let keyed_config = HttpConfig {
        api_keys: Some(ApiKeys::new(KEYS).unwrap()),
        ..HttpConfig::default()
    };
    let addrs = Addrs {
        serve: frontend(&hops.plain, HttpConfig::default()).await,
        keyed: frontend(&hops.plain, keyed_config).await,
        floor: floor_server().await,
        tls: frontend(&hops.tls, HttpConfig::default()).await,
    };

    println!(
        "serve overhead, 2 prefill + 1 decode zero-cost loopback mock workers, {MAX_TOKENS} tokens per request, {secs:?} per side per round"
    );
    let (rates, _) = pass(&hops, addrs, concurrency, secs, rounds).await;
    let (_, mut one) = pass(&hops, addrs, 1, secs, rounds).await;
    for l in &mut one {
        l.sort();
    }
    let ratio =
        |a: usize, b: usize| median(rates[a].iter().zip(&rates[b]).map(|(x, y)| x / y).collect());
    println!();
    println!(
        "{:<15} {:>14} {:>14} {:>14}",
        "side",
        format!("req/s ({concurrency})"),
        "p50 us (1)",
        "p99 us (1)"
    );
    for (i, name) in SIDES.iter().enumerate() {
        println!(
            "{name:<15} {:>14.0} {:>14.0} {:>14.0}",
            median(rates[i].clone()),
            us(quantile(&one[i], 0.5)),
            us(quantile(&one[i], 0.99))
        );
    }
    let added50 = us(quantile(&one[1], 0.5)) - us(quantile(&one[0], 0.5));
    let added99 = us(quantile(&one[1], 0.99)) - us(quantile(&one[0], 0.99));
    println!(
        "requests/s, median of per-round ratios: serve/floor {:.3} (goal >= 0.7), serve/in-process {:.3}, in-process/floor {:.3}",
        ratio(1, FLOOR),
        ratio(1, 0),
        ratio(0, FLOOR)
    );
    println!(
        "API keys: serve+keys/serve requests/s {:.3} (median of per-round ratios); one caller p50 {:+.0} us, p99 {:+.0} us",
        ratio(KEYED, 1),
        us(quantile(&one[KEYED], 0.5)) - us(quantile(&one[1], 0.5)),
        us(quantile(&one[KEYED], 0.99)) - us(quantile(&one[1], 0.99))
    );
    println!(
        "added latency of serve over in-process, one caller: p50 {added50:.0} us (goal < 100), p99 {added99:.0} us; floor p50 {:.0} us",
        us(quantile(&one[FLOOR], 0.5))
    );
    for (plain, tls, what) in [(0, INPROC_TLS, "in-process"), (1, SERVE_TLS, "serve")] {
        println!(
            "mutual TLS, {what}: requests/s tls/plain {:.3} (median of per-round ratios); one caller p50 {:+.0} us, p99 {:+.0} us",
            ratio(tls, plain),
            us(quantile(&one[tls], 0.5)) - us(quantile(&one[plain], 0.5)),
            us(quantile(&one[tls], 0.99)) - us(quantile(&one[plain], 0.99))
        );
    }
    if let Some(path) = svg_path {
        std::fs::write(&path, svg(&one, 1)).unwrap();
        println!("wrote {path}");
    }
    hops.plain.shutdown().await;
    hops.tls.shutdown().await;
    drop(held);
    drop(held_tls);
}

fn main() {
    let secs = Duration::from_millis(num("--secs", 1) * 1000);
    let rounds = num("--rounds", 5).max(1);
    let concurrency = num("--concurrency", 16).max(1);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run(secs, rounds, concurrency, arg("--svg")));
}
