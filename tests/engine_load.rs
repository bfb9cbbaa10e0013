//! Engine load (feature `engine`, `EngineLinkConfig::load_interval`) against fake engines in the
//! test (loopback, bounded waits): each answers `GET /metrics` with what the test sets, and
//! publishes no KV events. Work an engine queues that the router did not send turns it away;
//! metrics that stop answering make it saturated; metrics without the gauges leave it scored
//! by the bookings alone.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use prefill_router::advert::{EngineCard, EngineProtocol, ModelCard, RouterConfig, SelectionMode};
use prefill_router::discovery::{
    Discovery, EndpointId, Instance, InstanceId, MemoryConfig, MemoryDiscovery, Registration,
};
use prefill_router::engine::LoadReading;
use prefill_router::request::GenerateRequest;
use prefill_router::{PrefillHop, PrefillHopConfig};

#[path = "support/fake_http.rs"]
mod fake_http;

/// What a fake engine's `/metrics` answers: `Some(text)` with 200, `None` with 503.
type Metrics = Arc<Mutex<Option<String>>>;

fn vllm_metrics(running: u32, waiting: u32) -> Option<String> {
    Some(format!(
        "# TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"tiny\"}} {running}.0\n\
         vllm:num_requests_waiting{{engine=\"0\",model_name=\"tiny\"}} {waiting}.0\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"tiny\"}} 0.1\n"
    ))
}

async fn fake_engine(metrics: Metrics) -> SocketAddr {
    fake_http::serve(move |head| {
        if !head.starts_with("get /metrics") {
            return ("404 Not Found", "{}".to_owned());
        }
        match metrics.lock().clone() {
            Some(text) => ("200 OK", text),
            None => ("503 Service Unavailable", String::new()),
        }
    })
    .await
}

/// A hop over prefill engines 1 and 2 (KV mode) scraping their load every 50 ms when `scrape`.
async fn hop_over(engines: [SocketAddr; 2], scrape: bool) -> (PrefillHop, Vec<Registration>) {
    let discovery = MemoryDiscovery::new(MemoryConfig::with_ttl(Duration::from_secs(30)));
    let card = ModelCard {
        kv_cache_block_size: 16,
        router_config: Some(RouterConfig {
            router_mode: SelectionMode::KV,
            ..RouterConfig::default()
        }),
        engine: Some(EngineCard {
            protocol: EngineProtocol::Vllm,
        }),
        ..ModelCard::named("tiny")
    };
    let instance = |component: &str, id, address| Instance {
        endpoint: EndpointId::new("engines", component, "generate"),
        instance_id: id,
        address,
    };
    let mut keep = Vec::new();
    for (id, address) in [(1, engines[0]), (2, engines[1])] {
        let registered = discovery.register(instance("prefill", id, address), card.clone());
        keep.push(registered.await.unwrap());
    }
    // The topology needs a decode set to name a prefill one; nothing is sent to it.
    let decode = discovery.register(instance("decode", 100, engines[0]), card);
    keep.push(decode.await.unwrap());
    let mut config = PrefillHopConfig::default();
    config.engine.load_interval = scrape.then_some(Duration::from_millis(50));
    let discovery: Arc<dyn Discovery> = Arc::new(discovery);
    let hop = PrefillHop::start(discovery, "engines", config)
        .await
        .unwrap();
    hop.router()
        .wait_active(Duration::from_secs(10))
        .await
        .unwrap();
    (hop, keep)
}

async fn until(what: &str, mut check: impl FnMut() -> bool) {
    for _ in 0..300 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting for {what}");
}

/// Prompts drawn so far: each call's are new (a prompt picked before is predicted cached on
/// the engine it went to, which would pull it back there).
static DRAWN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// The engines `n` distinct prompts (no shared blocks, none seen before) would be sent to,
/// picked one after the other.
fn picks(hop: &PrefillHop, n: u32) -> Vec<InstanceId> {
    let binding = hop.router().route().binding().cloned().unwrap();
    let first = DRAWN.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    (first..first + n)
        .map(|p| {
            let tokens: Vec<u32> = (0..64).map(|i| 1000 * (p + 1) + i).collect();
            let request = GenerateRequest::new(tokens, 1);
            binding.dispatcher().select(&request).unwrap().instance_id
        })
        .collect()
}

fn reading(hop: &PrefillHop, engine: InstanceId) -> Option<LoadReading> {
    hop.binding_stats()
        .engine_kv
        .status(engine)
        .and_then(|s| s.load.reading)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_busy_with_work_the_router_did_not_send_is_avoided() {
    let busy: Metrics = Arc::new(Mutex::new(vllm_metrics(2, 6)));
    let idle: Metrics = Arc::new(Mutex::new(vllm_metrics(0, 0)));
    let engines = [
        fake_engine(Arc::clone(&busy)).await,
        fake_engine(Arc::clone(&idle)).await,
    ];

    // Without scraping, the bookings alone: the queue on engine 1 is invisible.
    let (blind, _keep) = hop_over(engines, false).await;
    let seen = picks(&blind, 4);
    assert!(seen.contains(&1), "{seen:?}");
    blind.shutdown().await;

    let (hop, _keep) = hop_over(engines, true).await;
    until(
        "engine 1's load read",
        || matches!(reading(&hop, 1), Some(LoadReading::Known(l)) if l.waiting == 6.0),
    )
    .await;
    until("engine 2's load read", || reading(&hop, 2).is_some()).await;
    let binding = hop.router().route().binding().cloned().unwrap();
    assert!(binding.dispatcher().combined_work(1) > 0);
    assert_eq!(binding.dispatcher().combined_work(2), 0);
    let seen = picks(&hop, 4);
    assert_eq!(
        seen,
        vec![2; 4],
        "engine 1 holds 8 requests the router did not send"
    );

    // Its queue drains: it is a candidate again.
    *busy.lock() = vllm_metrics(0, 0);
    until(
        "engine 1's queue drained",
        || matches!(reading(&hop, 1), Some(LoadReading::Known(l)) if l.requests() == 0),
    )
    .await;
    assert_eq!(binding.dispatcher().combined_work(1), 0);
    assert!(picks(&hop, 4).contains(&1));
    // The engines publish no KV events (a warning each); nothing about their load.
    let warnings = hop.warnings();
    assert!(
        !warnings.iter().any(|w| w.contains("/metrics")),
        "{warnings:?}"
    );
    hop.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_load_is_saturated_and_missing_load_is_unknown() {
    let failing: Metrics = Arc::new(Mutex::new(None));
    let bare: Metrics = Arc::new(Mutex::new(Some("process_cpu_seconds_total 1\n".into())));
    let engines = [
        fake_engine(Arc::clone(&failing)).await,
        fake_engine(Arc::clone(&bare)).await,
    ];
    let (hop, _keep) = hop_over(engines, true).await;
    until("engine 1 stale", || {
        reading(&hop, 1) == Some(LoadReading::Stale)
    })
    .await;
    until("engine 2 unknown", || {
        matches!(reading(&hop, 2), Some(LoadReading::Unknown(_)))
    })
    .await;
    let binding = hop.router().route().binding().cloned().unwrap();
    // Unknown is not idle, but not busy either: the bookings alone.
    assert_eq!(binding.dispatcher().combined_work(2), 0);
    assert_eq!(picks(&hop, 6), vec![2; 6], "stale means saturated");
    let warnings = hop.warnings();
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("/metrics stopped answering")),
        "{warnings:?}"
    );
    let status = hop.binding_stats().engine_kv.status(1).unwrap();
    assert!(status.load.failures >= 3, "{status:?}");
    let mut registry = prometheus_client::registry::Registry::default();
    hop.register_metrics(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    for line in [
        "prefill_router_engine_load_stale{engine=\"1\"} 1",
        "prefill_router_engine_load_requests{engine=\"1\"} -1",
        "prefill_router_engine_load_stale{engine=\"2\"} 0",
    ] {
        assert!(text.contains(line), "{line} in {text}");
    }

    // Its metrics answer again: no longer saturated.
    *failing.lock() = vllm_metrics(0, 0);
    until("engine 1 known again", || {
        matches!(reading(&hop, 1), Some(LoadReading::Known(_)))
    })
    .await;
    assert_eq!(binding.dispatcher().combined_work(1), 0);
    assert!(picks(&hop, 6).contains(&1));
    hop.shutdown().await;
}
