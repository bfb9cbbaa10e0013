//! The probe-and-register loop in process, on an in-memory store, against the stub engine.

use std::sync::Arc;
use std::time::Duration;

use prefill_router::advert::{EngineProtocol, SelectionMode};
use prefill_router::discovery::{Discovery, EndpointId, MemoryDiscovery};
use prefill_router_tools::engines::{
    http_get, run_registrar, EngineUrl, ProbeError, RegistrarConfig, RegistrarEvent,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::stub::{metrics_body, models_body, Reply, StubEngine};

/// Bound on anything a test waits for.
const WAIT: Duration = Duration::from_secs(15);

/// A fast loop: probes every 50 ms, each within 500 ms, withdrawn after 3 failures.
fn fast(component: &'static str, id: u64) -> RegistrarConfig {
    let mut config = RegistrarConfig::new(component, "engines", id);
    config.interval = Duration::from_millis(50);
    config.timeout = Duration::from_millis(500);
    // More than failures_to_withdraw (3): a slow engine is given longer than a refusing one.
    config.timeouts_to_withdraw = 5;
    config
}

/// A loop running against `stub`, its events on a channel.
struct Running {
    store: Arc<dyn Discovery>,
    events: mpsc::UnboundedReceiver<RegistrarEvent>,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<Option<prefill_router::discovery::Registration>>,
    endpoint: EndpointId,
}

fn start(stub: &StubEngine, config: RegistrarConfig) -> Running {
    let store: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::default());
    let (tx, events) = mpsc::unbounded_channel();
    let cancel = CancellationToken::new();
    let endpoint = EndpointId::new(&config.namespace, config.component, "generate");
    let task = tokio::spawn(run_registrar(
        Arc::clone(&store),
        EngineUrl::parse(&stub.url()).unwrap(),
        config,
        cancel.clone(),
        move |event| {
            let _ = tx.send(event.clone());
        },
    ));
    Running {
        store,
        events,
        cancel,
        task,
        endpoint,
    }
}

impl Running {
    async fn next_event(&mut self) -> RegistrarEvent {
        tokio::time::timeout(WAIT, self.events.recv())
            .await
            .expect("an event in time")
            .expect("the loop is running")
    }

    async fn registered_ids(&self) -> Vec<u64> {
        let cards = self.store.list_cards(&self.endpoint).await.unwrap();
        cards.into_iter().map(|(id, _)| id).collect()
    }

    /// Stop the loop; it must not have panicked. What it held is deregistered.
    async fn stop(self) {
        self.cancel.cancel();
        let held = tokio::time::timeout(WAIT, self.task)
            .await
            .expect("the loop stops promptly on cancel")
            .expect("the loop did not panic");
        if let Some(registration) = held {
            registration.deregister().await.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_is_registered_withdrawn_after_failures_and_registered_again() {
    let stub = StubEngine::start("stub-llm", 32);
    let mut run = start(&stub, fast("prefill", 1));

    let RegistrarEvent::Registered(card) = run.next_event().await else {
        panic!("first event: registered")
    };
    assert_eq!(card.name, "stub-llm", "from /v1/models (chunked)");
    assert_eq!(
        card.kv_cache_block_size, 32,
        "from /metrics, the block_size label"
    );
    let engine = card.engine.clone().expect("an engine card");
    assert_eq!(engine.protocol, EngineProtocol::Vllm);
    let routing = card.router_config.clone().expect("a prefill card routes");
    assert_eq!(
        routing.router_mode,
        SelectionMode::RoundRobin,
        "the default"
    );
    let instances = run.store.list_instances(&run.endpoint).await.unwrap();
    assert_eq!(instances.len(), 1);
    assert_eq!(
        (instances[0].instance_id, instances[0].address),
        (1, stub.addr())
    );
    assert_eq!(
        run.store.list_cards(&run.endpoint).await.unwrap(),
        vec![(1, card.clone())]
    );

    // 503: withdrawn after three failed probes in a row, not before.
    stub.set("/health", Reply::Status(503));
    let event = run.next_event().await;
    assert_eq!(
        event,
        RegistrarEvent::Withdrawn {
            failures: 3,
            error: ProbeError::Status(503)
        }
    );
    assert!(run.registered_ids().await.is_empty(), "gone from the store");

    // Healthy again: registered again, with the card read again.
    stub.set("/health", Reply::Status(200));
    assert_eq!(run.next_event().await, RegistrarEvent::Registered(card));
    assert_eq!(run.registered_ids().await, vec![1]);

    // Silent: each probe times out; a busy engine answers late, so it is withdrawn after
    // timeouts_to_withdraw (5) of them, not failures_to_withdraw (3).
    stub.set("/health", Reply::Silent);
    match run.next_event().await {
        RegistrarEvent::Withdrawn {
            failures: 5,
            error: ProbeError::Timeout(_),
        } => {}
        other => panic!("withdrawn after five timeouts, got {other:?}"),
    }
    assert!(run.registered_ids().await.is_empty());
    stub.set("/health", Reply::Status(200));
    assert!(matches!(
        run.next_event().await,
        RegistrarEvent::Registered(_)
    ));
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_or_two_failures_do_not_withdraw() {
    let stub = StubEngine::start("stub-llm", 16);
    let mut config = fast("decode", 100);
    config.failures_to_withdraw = 1000;
    let mut run = start(&stub, config);
    let RegistrarEvent::Registered(card) = run.next_event().await else {
        panic!("registered")
    };
    assert!(
        card.router_config.is_none(),
        "decode cards carry no routing"
    );
    assert_eq!(card.kv_cache_block_size, 16);
    stub.set("/health", Reply::Status(500));
    let before = stub.hits("/health");
    tokio::time::timeout(WAIT, async {
        while stub.hits("/health") < before + 5 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("probes go on");
    assert_eq!(run.registered_ids().await, vec![100], "still registered");
    assert!(run.events.try_recv().is_err(), "no event");
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn junk_from_the_engine_keeps_it_unregistered_and_never_panics() {
    let stub = StubEngine::start("stub-llm", 32);
    let junk_models: Vec<Reply> = vec![
        Reply::Ok(b"not json".to_vec()),
        Reply::Ok(b"{\"data\": []}".to_vec()),
        Reply::Ok(b"{\"data\": [{\"id\": 7}]}".to_vec()),
        Reply::Ok(b"{\"data\": [{\"id\": \"\"}]}".to_vec()),
        Reply::Ok(b"[1,2,3]".to_vec()),
        Reply::Ok(vec![0xff, 0xfe, 0x00, 0x80]),
        Reply::Status(500),
        Reply::Raw(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nffffffffffffffff\r\nab".to_vec(),
        ),
        Reply::Raw(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n".to_vec()),
        Reply::Raw(b"garbage without a head".to_vec()),
        Reply::Raw(b"HTTP/1.1 abc\r\n\r\n".to_vec()),
        Reply::Raw(Vec::new()),
        // Over the probe's bound (4 MiB): refused, not buffered.
        Reply::Ok(vec![b'x'; 5 << 20]),
    ];
    let junk_metrics: Vec<Reply> = vec![
        Reply::Ok(b"vllm:cache_config_info{block_size=\"abc\"} 1.0\n".to_vec()),
        Reply::Ok(b"vllm:cache_config_info{block_size=\"32} 1.0\n".to_vec()),
        Reply::Ok(b"vllm:cache_config_info{mamba_block_size=\"32\"} 1.0\n".to_vec()),
        Reply::Ok(b"vllm:cache_config_info{block_size=\"-1\"} 1.0\n".to_vec()),
        Reply::Ok(vec![0xff; 1000]),
        Reply::Ok(Vec::new()),
        Reply::Status(404),
    ];
    // Junk models with good metrics, then junk metrics with a good model: never registered
    // (junk from the first probe on, so no good answer slips in before).
    stub.set("/v1/models", Reply::Status(503));
    let mut run = start(&stub, fast("prefill", 2));
    for junk in junk_models {
        let asked = stub.hits("/v1/models");
        stub.set("/v1/models", junk);
        wait_for_hits(&stub, "/v1/models", asked + 2).await;
        assert!(run.registered_ids().await.is_empty());
    }
    stub.set("/v1/models", Reply::Ok(models_body("stub-llm")));
    for junk in junk_metrics {
        let asked = stub.hits("/metrics");
        stub.set("/metrics", junk);
        wait_for_hits(&stub, "/metrics", asked + 2).await;
        assert!(run.registered_ids().await.is_empty());
    }
    assert!(run.events.try_recv().is_err(), "nothing registered on junk");
    // Junk /health is a failed probe like any other.
    for junk in [
        Reply::Raw(b"HELLO\r\n\r\n".to_vec()),
        Reply::Raw(vec![0; 64]),
    ] {
        let asked = stub.hits("/health");
        stub.set("/health", junk);
        wait_for_hits(&stub, "/health", asked + 2).await;
    }
    // Good answers again: registered with what the engine says.
    stub.set("/health", Reply::Status(200));
    stub.set("/metrics", Reply::Ok(metrics_body(64)));
    let RegistrarEvent::Registered(card) = run.next_event().await else {
        panic!("registered once the answers make sense")
    };
    assert_eq!(
        (card.name.as_str(), card.kv_cache_block_size),
        ("stub-llm", 64)
    );
    run.stop().await;

    // Told the model and block size, the loop needs neither answer.
    stub.set("/v1/models", Reply::Ok(b"{".to_vec()));
    stub.set("/metrics", Reply::Raw(b"junk".to_vec()));
    let mut config = fast("prefill", 3);
    config.model = Some("given".into());
    config.block_size = Some(8);
    config.router_mode = SelectionMode::KV;
    let mut run = start(&stub, config);
    let RegistrarEvent::Registered(card) = run.next_event().await else {
        panic!("registered")
    };
    assert_eq!((card.name.as_str(), card.kv_cache_block_size), ("given", 8));
    assert_eq!(card.router_config.unwrap().router_mode, SelectionMode::KV);
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_interrupts_a_probe_in_flight() {
    let stub = StubEngine::start("stub-llm", 32);
    stub.set("/health", Reply::Silent);
    let mut config = fast("prefill", 4);
    config.timeout = Duration::from_secs(30);
    let run = start(&stub, config);
    wait_for_hits(&stub, "/health", 1).await;
    let started = std::time::Instant::now();
    run.stop().await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "not the probe's 30 s"
    );
}

#[tokio::test]
async fn the_probe_client_bounds_what_it_reads() {
    let stub = StubEngine::start("stub-llm", 32);
    stub.set("/metrics", Reply::Ok(vec![b'x'; 5 << 20]));
    let error = http_get(stub.addr(), "/metrics", Duration::from_secs(10))
        .await
        .unwrap_err();
    assert!(matches!(error, ProbeError::Malformed(_)), "{error:?}");
    let (status, body) = http_get(stub.addr(), "/v1/models", Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!((status, body), (200, models_body("stub-llm")), "dechunked");
}

async fn wait_for_hits(stub: &StubEngine, path: &str, count: usize) {
    tokio::time::timeout(WAIT, async {
        while stub.hits(path) < count {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{path} asked {count} times"));
}
