//! Worker health figures on loopback (docs/performance.md, "Worker health"): three mock
//! prefill workers behind the prefill router (default binding factory, round robin, the
//! default backoff 250 ms doubling to 10 s, retry budget 2), four callers in a steady loop.
//! Worker 2's listener stops for `DOWN` and comes back at the same address, 20 times (its
//! registration stays: a blip). Prints, per run: the time from each return to the first
//! request routed to it again (median, max), the requests served and failed while it was down,
//! and the retries by class; and writes the return-to-first-route times as an SVG.
//!
//! `cargo run --release -p prefill-router-tools --example health_blips [-- --svg docs/health_blips.svg]`

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use parking_lot::Mutex;
use prefill_router::advert::{ModelCard, SelectionMode};
use prefill_router::binding::{DefaultBindingFactory, FactoryConfig};
use prefill_router::binding::{PrefillOutcome, WorkerSetTarget, WorkerSetTargetId};
use prefill_router::decode::{Decode, DecodeError, DecodeStream};
use prefill_router::discovery::{Discovery, EndpointId, InstanceId, MemoryConfig, MemoryDiscovery};
use prefill_router::request::{FinishReason, GenerateRequest, GenerateResponse};
use prefill_router::router::{PrefillRouter, PrefillRouterConfig};
use prefill_router::transport::{serve, ServerConfig, ServerHandle};
use prefill_router_tools::mock::{spawn_registered, MockConfig, MockPrefill};
use tokio::net::TcpListener;
use tokio::sync::watch;

const BLIPS: usize = 20;
const DOWN: Duration = Duration::from_millis(400);
const CALLERS: u32 = 4;

/// Records which prefill worker ran each request, and when.
#[derive(Default)]
struct Recorder {
    served: Mutex<Vec<(Instant, InstanceId)>>,
}

impl Decode for Recorder {
    fn decode(
        &self,
        _request: GenerateRequest,
        prefill: Option<PrefillOutcome>,
    ) -> BoxFuture<'_, Result<DecodeStream, DecodeError>> {
        if let Some(p) = prefill {
            self.served.lock().push((Instant::now(), p.worker));
        }
        let response = GenerateResponse {
            text: None,
            usage: None,
            token_ids: vec![1],
            finish: Some(FinishReason::Length),
            prefill: None,
        };
        async move { Ok(Box::pin(futures_util::stream::iter([Ok(response)])) as DecodeStream) }
            .boxed()
    }
}

fn card() -> ModelCard {
    ModelCard::routed("m", SelectionMode::RoundRobin, 16)
}

fn mock() -> MockConfig {
    MockConfig {
        block_size: 16,
        block_cost: Duration::from_micros(200),
        token_interval: Duration::from_micros(100),
        cache_blocks: 0,
    }
}

async fn serve_on(listener: TcpListener, id: InstanceId) -> ServerHandle {
    serve(
        listener,
        MockPrefill::new(id, mock()),
        ServerConfig::default(),
    )
    .expect("serve")
}

async fn rebind(addr: SocketAddr) -> TcpListener {
    for _ in 0..500 {
        if let Ok(l) = TcpListener::bind(addr).await {
            return l;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("cannot rebind {addr}");
}

fn svg(times: &[Duration], cap: Duration) -> String {
    let (w, h, pad) = (640.0, 240.0, 40.0);
    let cap_ms = cap.as_secs_f64() * 1000.0;
    // The axis ends at the slowest blip rounded up to 100 ms (the cap is far above).
    let slowest = times
        .iter()
        .map(|t| t.as_secs_f64() * 1000.0)
        .fold(0.0, f64::max);
    let max_ms = ((slowest / 100.0).ceil() * 100.0).max(100.0);
    let bar = (w - 2.0 * pad) / times.len().max(1) as f64;
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <text x=\"{pad}\" y=\"16\">time from a worker's return to its first routed request, per blip (ms; probe cap {cap_ms:.0} ms)</text>\n\
         <line x1=\"{pad}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n",
        h - pad,
        w - pad,
        h - pad
    );
    for (i, t) in times.iter().enumerate() {
        let ms = t.as_secs_f64() * 1000.0;
        let bh = (ms / max_ms).min(1.0) * (h - 2.0 * pad - 10.0);
        let x = pad + i as f64 * bar;
        out.push_str(&format!(
            "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{bh:.1}\" fill=\"steelblue\"><title>blip {}: {ms:.1} ms</title></rect>\n",
            h - pad - bh,
            bar * 0.8,
            i + 1
        ));
    }
    out.push_str(&format!(
        "<text x=\"{pad}\" y=\"{}\">blips 1..{}</text>\n<text x=\"4\" y=\"{}\">0</text>\n<text x=\"4\" y=\"{}\">{max_ms:.0}</text>\n</svg>\n",
        h - pad + 16.0,
        times.len(),
        h - pad,
        pad + 10.0
    ));
    out
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let svg_path = std::env::args().skip_while(|a| a != "--svg").nth(1);
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new(MemoryConfig::default()));
    let endpoint = EndpointId::new("blips", "prefill", "generate");
    let mut servers = Vec::new();
    let mut regs = Vec::new();
    for id in 1..=3 {
        let (server, registration) = spawn_registered(
            &discovery,
            endpoint.clone(),
            id,
            MockPrefill::new(id, mock()),
            card(),
            ServerConfig::default(),
        )
        .await
        .expect("worker");
        regs.push(registration);
        servers.push(Some(server));
    }
    let factory = DefaultBindingFactory::new(Arc::clone(&discovery), FactoryConfig::default());
    let stats = factory.stats();
    let cap = prefill_router::push::PushConfig::default().health.max;
    let router = Arc::new(PrefillRouter::new(factory, PrefillRouterConfig::default()));
    let (_admit, admitted) = watch::channel(BTreeSet::from([1, 2, 3]));
    router.set_target(Some(WorkerSetTarget::new(
        WorkerSetTargetId::new("blips/prefill", 1),
        endpoint,
        Arc::new(card()),
        admitted,
    )));
    router
        .wait_active(Duration::from_secs(10))
        .await
        .expect("active");
    let recorder = Arc::new(Recorder::default());
    let stop = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(AtomicUsize::new(0));
    let callers: Vec<_> = (0..CALLERS)
        .map(|c| {
            let (router, recorder, stop, failed) = (
                Arc::clone(&router),
                Arc::clone(&recorder),
                Arc::clone(&stop),
                Arc::clone(&failed),
            );
            tokio::spawn(async move {
                let mut i = 0u32;
                while !stop.load(Ordering::SeqCst) {
                    let prompt: Vec<u32> = (0..64).map(|t| t + (c * 1_000_000 + i) * 64).collect();
                    if router
                        .generate(GenerateRequest::new(prompt, 2), &*recorder)
                        .await
                        .is_err()
                    {
                        failed.fetch_add(1, Ordering::SeqCst);
                    }
                    i = i.wrapping_add(1);
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let addr2 = servers[1].as_ref().expect("up").local_addr();
    let mut recoveries = Vec::new();
    let (mut down_served, mut down_failed) = (0usize, 0usize);
    for _ in 0..BLIPS {
        let failed_before = failed.load(Ordering::SeqCst);
        let served_before = recorder.served.lock().len();
        if let Some(server) = servers[1].take() {
            server.stop().await;
        }
        tokio::time::sleep(DOWN).await;
        down_served += recorder.served.lock().len() - served_before;
        down_failed += failed.load(Ordering::SeqCst) - failed_before;
        servers[1] = Some(serve_on(rebind(addr2).await, 2).await);
        let back = Instant::now();
        let first = loop {
            let seen = recorder
                .served
                .lock()
                .iter()
                .rev()
                .take_while(|(t, _)| *t >= back)
                .find(|(_, w)| *w == 2)
                .map(|(t, _)| *t);
            if let Some(t) = seen {
                break t;
            }
            assert!(back.elapsed() < cap * 3, "worker 2 never routed again");
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        recoveries.push(first - back);
        // Let the breaker's history settle into steady state between blips.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, Ordering::SeqCst);
    for c in callers {
        c.await.expect("caller");
    }
    let mut sorted = recoveries.clone();
    sorted.sort();
    let median = sorted[sorted.len() / 2];
    let max = sorted[sorted.len() - 1];
    let retries = stats.retries.snapshot();
    println!(
        "### Worker health: {BLIPS} blips of {DOWN:?} of 1 of 3 prefill workers, {CALLERS} callers"
    );
    println!("| figure | value |");
    println!("|---|---|");
    println!(
        "| return to first routed request, median | {:.1} ms |",
        median.as_secs_f64() * 1e3
    );
    println!(
        "| return to first routed request, max | {:.1} ms (probe cap {cap:?}) |",
        max.as_secs_f64() * 1e3
    );
    println!("| requests served while the worker was down | {down_served} |");
    println!("| requests failed while the worker was down | {down_failed} |");
    println!(
        "| requests failed in the whole run | {} of {} |",
        failed.load(Ordering::SeqCst),
        recorder.served.lock().len() + failed.load(Ordering::SeqCst)
    );
    let shown: Vec<String> = retries
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(c, n)| format!("{c}: {n}"))
        .collect();
    println!("| prefill retries by class | {} |", shown.join(", "));
    if let Some(path) = svg_path {
        std::fs::write(&path, svg(&recoveries, cap)).expect("write svg");
        println!("(wrote {path})");
    }
    drop(regs);
}
