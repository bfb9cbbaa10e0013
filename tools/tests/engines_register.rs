//! Engines as workers (`prefill_router_tools::engines`, `prefill-router register`), against a
//! stub engine in the test (loopback, bounded waits): registered with the card the engine's
//! answers give, withdrawn when it stops answering, registered again when it answers; junk
//! answers never panic; the sidecar withdraws first on SIGTERM and exits 0.

#[path = "frontend/mod.rs"]
mod frontend;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::Arc;
use std::time::Duration;

use frontend::Proc;
use prefill_router::advert::{EngineProtocol, SelectionMode};
use prefill_router::discovery::{
    Discovery, EndpointId, FileConfig, FileDiscovery, MemoryConfig, MemoryDiscovery,
};
use prefill_router_tools::engines::{run_registrar, EngineUrl, RegistrarConfig, RegistrarEvent};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// A stub engine: `/health` answers `status` (0: closes the connection), `/v1/models` and
/// `/metrics` answer sense unless `junk`.
struct Stub {
    addr: SocketAddr,
    status: Arc<AtomicU16>,
    junk: Arc<AtomicBool>,
}

async fn stub() -> Stub {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let status = Arc::new(AtomicU16::new(200));
    let junk = Arc::new(AtomicBool::new(false));
    let (s, j) = (Arc::clone(&status), Arc::clone(&junk));
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let (status, junk) = (s.load(Ordering::Relaxed), j.load(Ordering::Relaxed));
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut chunk = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match socket.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&chunk[..n]),
                    }
                }
                let line = String::from_utf8_lossy(&head).into_owned();
                let path = line.split_whitespace().nth(1).unwrap_or("").to_owned();
                let (code, body) = match path.as_str() {
                    "/health" if status == 0 => return,
                    "/health" => (status, String::new()),
                    "/v1/models" if junk => (200, "{\"data\": 7".to_owned()),
                    "/v1/models" => (200, r#"{"object":"list","data":[{"id":"stub-model"}]}"#.to_owned()),
                    "/metrics" if junk => (200, "\u{0}\u{1} garbage".to_owned()),
                    "/metrics" => (
                        200,
                        "# HELP x\nvllm:cache_config_info{block_size=\"64\",cache_dtype=\"auto\"} 1.0\n"
                            .to_owned(),
                    ),
                    _ => (404, String::new()),
                };
                let answer = format!(
                    "HTTP/1.1 {code} X\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = socket.write_all(answer.as_bytes()).await;
            });
        }
    });
    Stub { addr, status, junk }
}

fn fast(component: &'static str, id: u64) -> RegistrarConfig {
    RegistrarConfig {
        interval: Duration::from_millis(50),
        timeout: Duration::from_millis(500),
        failures_to_withdraw: 2,
        ..RegistrarConfig::new(component, "ns", id)
    }
}

async fn until(what: &str, mut done: impl FnMut() -> bool) {
    tokio::time::timeout(Duration::from_secs(10), async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what} within 10 s"));
}

async fn listed(discovery: &dyn Discovery, component: &str) -> usize {
    let endpoint = EndpointId::new("ns", component, "generate");
    discovery.list_instances(&endpoint).await.unwrap().len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_is_registered_while_it_answers_and_withdrawn_when_it_does_not() {
    let engine = stub().await;
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new(MemoryConfig::with_ttl(
        Duration::from_secs(10),
    )));
    let events = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let seen = Arc::clone(&events);
    let cancel = CancellationToken::new();
    let url = EngineUrl::parse(&format!("http://{}", engine.addr)).unwrap();
    let task = tokio::spawn(run_registrar(
        Arc::clone(&discovery),
        url,
        fast("prefill", 1),
        cancel.clone(),
        move |e: &RegistrarEvent| seen.lock().push(e.clone()),
    ));
    until("registered", || events.lock().len() == 1).await;
    let cards = discovery
        .list_cards(&EndpointId::new("ns", "prefill", "generate"))
        .await
        .unwrap();
    let card = &cards[0].1;
    assert_eq!(card.name, "stub-model");
    assert_eq!(card.kv_cache_block_size, 64);
    assert_eq!(card.engine.as_ref().unwrap().protocol, EngineProtocol::Vllm);
    assert_eq!(
        card.router_config.as_ref().unwrap().router_mode,
        SelectionMode::RoundRobin,
        "engines publish no KV events to our routers: round robin unless asked"
    );
    // Stops answering: withdrawn after the failures; answers again: registered again.
    engine.status.store(503, Ordering::Relaxed);
    until("withdrawn", || events.lock().len() == 2).await;
    assert!(matches!(events.lock()[1], RegistrarEvent::Withdrawn { .. }));
    assert_eq!(listed(&*discovery, "prefill").await, 0);
    engine.status.store(0, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(events.lock().len(), 2, "a dead engine stays withdrawn");
    engine.status.store(200, Ordering::Relaxed);
    until("registered again", || events.lock().len() == 3).await;
    assert_eq!(listed(&*discovery, "prefill").await, 1);
    cancel.cancel();
    let held = task.await.unwrap();
    assert!(
        held.is_some(),
        "the caller gets the registration to withdraw"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn junk_answers_never_panic_and_what_was_told_wins() {
    let engine = stub().await;
    engine.junk.store(true, Ordering::Relaxed);
    let url = EngineUrl::parse(&format!("http://{}", engine.addr)).unwrap();
    // No made-up card: junk is a typed error and the engine stays unregistered.
    let error = prefill_router_tools::engines::engine_card(&url, &fast("decode", 100))
        .await
        .unwrap_err();
    assert!(
        matches!(error, prefill_router_tools::engines::CardError::Model(_)),
        "{error}"
    );
    let named = RegistrarConfig {
        model: Some("m".into()),
        ..fast("decode", 100)
    };
    let error = prefill_router_tools::engines::engine_card(&url, &named)
        .await
        .unwrap_err();
    assert!(
        matches!(
            error,
            prefill_router_tools::engines::CardError::BlockSize(_)
        ),
        "{error}"
    );
    let told = RegistrarConfig {
        model: Some("m".into()),
        block_size: Some(32),
        ..fast("decode", 100)
    };
    let card = prefill_router_tools::engines::engine_card(&url, &told)
        .await
        .unwrap();
    assert_eq!((card.name.as_str(), card.kv_cache_block_size), ("m", 32));
    assert!(
        card.router_config.is_none(),
        "decode cards carry no routing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_register_sidecar_withdraws_first_on_sigterm_and_exits_0() {
    let engine = stub().await;
    let dir = tempfile::tempdir().unwrap();
    let store = format!("file://{}", dir.path().display());
    let url = format!("http://{}", engine.addr);
    let sidecar = Proc::spawn(
        "register",
        &[
            "register",
            "--engine",
            "vllm",
            "--role",
            "decode",
            "--url",
            &url,
            "--discovery",
            &store,
            "--namespace",
            "ns",
            "--id",
            "7",
            "--drain-ms",
            "100",
        ],
    );
    let registered = sidecar.wait_event("registered");
    assert_eq!(registered["model"], "stub-model");
    assert_eq!(registered["block_size"], 64);
    let discovery = FileDiscovery::new(FileConfig::new(dir.path()));
    assert_eq!(listed(&discovery, "decode").await, 1);
    let (status, stopped) = tokio::task::spawn_blocking(move || sidecar.stop())
        .await
        .unwrap();
    assert!(status.success(), "{status:?}");
    assert_eq!(stopped["withdrawn"], true);
    assert_eq!(listed(&discovery, "decode").await, 0, "gone from the store");
}

#[test]
fn register_rejects_bad_flags_with_usage() {
    let bin = env!("CARGO_BIN_EXE_prefill-router");
    for args in [
        &[
            "register",
            "--engine",
            "sglang",
            "--role",
            "decode",
            "--url",
            "http://127.0.0.1:1",
            "--discovery",
            "file:///tmp/x",
            "--namespace",
            "ns",
        ][..],
        &[
            "register",
            "--engine",
            "vllm",
            "--role",
            "decode",
            "--url",
            "https://127.0.0.1:1",
            "--discovery",
            "file:///tmp/x",
            "--namespace",
            "ns",
        ],
        &[
            "register",
            "--engine",
            "vllm",
            "--url",
            "http://127.0.0.1:1",
            "--discovery",
            "file:///tmp/x",
            "--namespace",
            "ns",
        ],
        &[
            "serve",
            "--prefill-url",
            "http://127.0.0.1:1",
            "--decode-url",
            "http://127.0.0.1:2",
        ],
        &[
            "serve",
            "--engine",
            "vllm",
            "--prefill-url",
            "http://127.0.0.1:1",
        ],
    ] {
        let out = std::process::Command::new(bin).args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
    }
}
