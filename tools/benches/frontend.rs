//! Frontend throughput at saturation: `PrefillHop::generate` (prefill hop on the active
//! binding, then decode; the hop's own topology watcher targets it) vs the same two calls made back to back on bare dispatchers, without
//! the router. Loopback mock workers with zero compute cost, so only the frontend's overhead
//! differs. The two paths run interleaved in rounds in one process (ratios side by side).
//!
//! `cargo bench -p prefill-router-tools --bench frontend -- [--secs S] [--rounds N] [--concurrency C]`
//! (defaults: 1 s per path per round, 5 rounds, 32 concurrent callers)

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use prefill_router::advert::{ModelCard, SelectionMode};
use prefill_router::binding::PrefillOutcome;
use prefill_router::decode::Decode;
use prefill_router::decode::DecodePool;
use prefill_router::discovery::{Discovery, EndpointId, MemoryConfig, MemoryDiscovery};
use prefill_router::push::{Dispatcher, PushConfig, PushMode, RoutableView};
use prefill_router::request::GenerateRequest;
use prefill_router::transport::ServerConfig;
use prefill_router::{PrefillHop, PrefillHopConfig};
use prefill_router_tools::mock::{spawn_registered, MockConfig, MockDecode, MockPrefill};
use tokio_util::sync::CancellationToken;

const MAX_TOKENS: u32 = 4;
const PREFILL_WORKERS: u64 = 2;

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One request's prompt: distinct per call, 64 tokens.
fn prompt(n: u64) -> Vec<u32> {
    (0..64u32)
        .map(|i| (n as u32).wrapping_mul(31).wrapping_add(i))
        .collect()
}

/// The baseline: prefill on a bare dispatcher, collect, then decode; no PrefillRouter.
struct Bare {
    prefill: Dispatcher,
    decode: DecodePool,
}

impl Bare {
    async fn call(&self, request: GenerateRequest) -> usize {
        let prefill_request = GenerateRequest {
            max_tokens: 1,
            ..request.clone()
        };
        let stream = self.prefill.generate(prefill_request).await.unwrap();
        let worker = stream.instance_id();
        let outcome = PrefillOutcome::collect(worker, stream).await.unwrap();
        let decode_request = GenerateRequest {
            handoff: outcome.handoff.clone(),
            ..request
        };
        let stream = self
            .decode
            .decode(decode_request, Some(outcome))
            .await
            .unwrap();
        stream.count().await
    }
}

async fn saturate<F, Fut>(concurrency: u64, secs: Duration, call: F) -> f64
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = usize> + Send,
{
    let call = Arc::new(call);
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for c in 0..concurrency {
        let (call, stop, done) = (Arc::clone(&call), Arc::clone(&stop), Arc::clone(&done));
        tasks.push(tokio::spawn(async move {
            let mut n = c << 32;
            while !stop.load(Ordering::Relaxed) {
                let tokens = call(n).await;
                assert_eq!(tokens, MAX_TOKENS as usize);
                done.fetch_add(1, Ordering::Relaxed);
                n += 1;
            }
        }));
    }
    let start = Instant::now();
    tokio::time::sleep(secs).await;
    let count = done.load(Ordering::Relaxed);
    let elapsed = start.elapsed();
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    count as f64 / elapsed.as_secs_f64()
}

fn main() {
    let secs = Duration::from_millis(arg("--secs", 1) * 1000);
    let rounds = arg("--rounds", 5);
    let concurrency = arg("--concurrency", 32);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run(secs, rounds, concurrency));
}

async fn router_leg(hop: &Arc<PrefillHop>, concurrency: u64, secs: Duration) -> f64 {
    let h = Arc::clone(hop);
    saturate(concurrency, secs, move |n| {
        let h = Arc::clone(&h);
        async move {
            let stream = h
                .generate(GenerateRequest::new(prompt(n), MAX_TOKENS))
                .await
                .unwrap();
            stream.count().await
        }
    })
    .await
}

async fn bare_leg(bare: &Arc<Bare>, concurrency: u64, secs: Duration) -> f64 {
    let b = Arc::clone(bare);
    saturate(concurrency, secs, move |n| {
        let b = Arc::clone(&b);
        async move { b.call(GenerateRequest::new(prompt(n), MAX_TOKENS)).await }
    })
    .await
}

async fn run(secs: Duration, rounds: u64, concurrency: u64) {
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new(MemoryConfig::default()));
    let prefill_ep = EndpointId::new("bench", "prefill", "generate");
    let decode_ep = EndpointId::new("bench", "decode", "generate");
    let mock = MockConfig {
        block_size: 16,
        block_cost: Duration::ZERO,
        token_interval: Duration::ZERO,
        cache_blocks: 4096,
    };
    let card = ModelCard::routed("bench", SelectionMode::RoundRobin, 16);
    let mut held = Vec::new();
    for id in 0..PREFILL_WORKERS {
        held.push(
            spawn_registered(
                &discovery,
                prefill_ep.clone(),
                id,
                MockPrefill::new(id, mock.clone()),
                card.clone(),
                ServerConfig::default(),
            )
            .await
            .unwrap(),
        );
    }
    held.push(
        spawn_registered(
            &discovery,
            decode_ep.clone(),
            100,
            MockDecode::new(100, mock.clone()),
            card.clone(),
            ServerConfig::default(),
        )
        .await
        .unwrap(),
    );

    let feeds = CancellationToken::new();
    let decode_view = || async {
        let view = RoutableView::spawn(
            discovery.watch(&decode_ep).await.unwrap(),
            None,
            feeds.clone(),
        );
        view.wait_for(|r| !r.is_empty()).await;
        DecodePool::new(Dispatcher::new(
            view,
            PushMode::RoundRobin,
            PushConfig::default(),
        ))
    };

    // The router path: the facade a frontend embeds (watcher, router, decode hop).
    let hop = Arc::new(
        PrefillHop::start(Arc::clone(&discovery), "bench", PrefillHopConfig::default())
            .await
            .unwrap(),
    );
    hop.router()
        .wait_active(Duration::from_secs(10))
        .await
        .unwrap();
    let mut status = hop.subscribe();
    tokio::time::timeout(
        Duration::from_secs(10),
        status.wait_for(|s| s.readiness.is_ready()),
    )
    .await
    .unwrap()
    .unwrap();
    let binding = hop.router().route().binding().cloned().unwrap();
    tokio::time::timeout(
        Duration::from_secs(10),
        binding
            .dispatcher()
            .view()
            .wait_for(|r| r.len() == PREFILL_WORKERS as usize),
    )
    .await
    .unwrap();
    drop(binding);

    // The bare path: the same dispatchers, no PrefillRouter.
    let prefill_view = RoutableView::spawn(
        discovery.watch(&prefill_ep).await.unwrap(),
        None,
        feeds.clone(),
    );
    prefill_view
        .wait_for(|r| r.len() == PREFILL_WORKERS as usize)
        .await;
    let bare = Arc::new(Bare {
        prefill: Dispatcher::new(prefill_view, PushMode::RoundRobin, PushConfig::default()),
        decode: decode_view().await,
    });

    println!(
        "frontend throughput, {concurrency} concurrent callers, {} prefill + 1 decode loopback mock workers, {MAX_TOKENS} tokens per request",
        PREFILL_WORKERS
    );
    println!(
        "{:<7} {:>16} {:>16} {:>7}",
        "round", "router req/s", "bare req/s", "ratio"
    );
    let mut ratios = Vec::new();
    for round in 0..=rounds {
        // Alternate which path runs first, so drift within a round does not favour one.
        let router_first = round % 2 == 0;
        let mut via_router = 0.0;
        let mut without = 0.0;
        for leg in 0..2 {
            if (leg == 0) == router_first {
                via_router = router_leg(&hop, concurrency, secs).await;
            } else {
                without = bare_leg(&bare, concurrency, secs).await;
            }
        }
        if round == 0 {
            println!(
                "{:<7} {via_router:>16.0} {without:>16.0} {:>7.3}",
                "warm-up",
                via_router / without
            );
            continue;
        }
        ratios.push(via_router / without);
        println!(
            "{round:<7} {via_router:>16.0} {without:>16.0} {:>7.3}",
            via_router / without
        );
    }
    ratios.sort_by(f64::total_cmp);
    let median = ratios[ratios.len() / 2];
    println!(
        "median ratio router/bare: {median:.3} (min {:.3}, max {:.3}); goal >= 0.9",
        ratios[0],
        ratios[ratios.len() - 1]
    );
    assert!(
        hop.router().status().counters.prefilled > 0,
        "the router path prefilled"
    );
    hop.shutdown().await;
    feeds.cancel();
    drop(held);
}
