//! Migration on real vLLM (issue #42): a decode stream cut mid-way continues, and greedy output
//! through the migration equals the uninterrupted output. `.ci/vllm.sh` names the engines
//! (`PREFILL_VLLM_PREFILL`, `PREFILL_VLLM_DECODE`); skipped, saying so, otherwise.
//!
//! The decode engine is registered twice: directly, and behind a loopback proxy that cuts
//! one armed stream after a few events (both connections closed, as a SIGKILLed engine's
//! would be). The stage's engines are shared with later tests, so the death is the proxy's,
//! not the engine's: what the router sees is the same (a stream that ends without a finish),
//! and the continuation (the prompt plus the tokens already streamed, prefilled first on the
//! prefill engine with a new handoff) runs on the real pair.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use prefill_router::discovery::{MemoryConfig, MemoryDiscovery};
use prefill_router::migration::BreakReason;
use prefill_router::request::GenerateRequest;
use prefill_router::PrefillHop;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[path = "support/engine_cards.rs"]
mod engine_cards;
use engine_cards::{live_hop, register};

/// SSE events the proxy lets through before it cuts an armed stream.
const CUT_AFTER_EVENTS: usize = 8;
/// Tokens of the generation.
const MAX_TOKENS: u32 = 40;

/// A loopback TCP proxy to `upstream`; while `armed`, the first response that carries
/// CUT_AFTER_EVENTS `data: ` events is cut there (and the proxy disarms). Counted per response
/// (a connection carries several).
struct CuttingProxy {
    addr: SocketAddr,
    armed: Arc<AtomicBool>,
    cuts: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for CuttingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl CuttingProxy {
    async fn start(upstream: SocketAddr) -> CuttingProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let armed = Arc::new(AtomicBool::new(false));
        let cuts = Arc::new(AtomicUsize::new(0));
        let (a, c) = (Arc::clone(&armed), Arc::clone(&cuts));
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (a, c) = (Arc::clone(&a), Arc::clone(&c));
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(upstream).await {
                        relay(client, server, a, c).await;
                    }
                });
            }
        });
        CuttingProxy {
            addr,
            armed,
            cuts,
            task,
        }
    }
}

/// Bytes both ways until either side closes; an armed proxy closes both once the response
/// carried CUT_AFTER_EVENTS events.
async fn relay(
    client: TcpStream,
    server: TcpStream,
    armed: Arc<AtomicBool>,
    cuts: Arc<AtomicUsize>,
) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upstream = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
    });
    let mut buf = vec![0u8; 16 * 1024];
    let mut events = 0;
    while let Ok(n) = server_read.read(&mut buf).await {
        if n == 0 {
            break;
        }
        let chunk = &buf[..n];
        // Counted per response: the link keeps its connections alive, so a new response head
        // starts the count again.
        let head = chunk.windows(9).rposition(|w| w == b"HTTP/1.1 ");
        if head.is_some() {
            events = 0;
        }
        let from = head.unwrap_or(0);
        // Where this response's CUT_AFTER_EVENTS-th event starts in the chunk, if it does (a
        // response already past it is not cut: the tail of one the client has finished may
        // still be in flight when the proxy is armed).
        let cut_at = CUT_AFTER_EVENTS.checked_sub(events + 1).and_then(|k| {
            chunk[from..]
                .windows(6)
                .enumerate()
                .filter(|(_, w)| *w == b"data: ")
                .map(|(i, _)| from + i)
                .nth(k)
        });
        events += chunk[from..].windows(6).filter(|w| w == b"data: ").count();
        let cut = cut_at.is_some()
            && armed
                .compare_exchange(true, false, Ordering::AcqRel, Ordering::Acquire)
                .is_ok();
        if let (true, Some(at)) = (cut, cut_at) {
            // The head and the events before the cut reach the client (a response that came
            // in one read is cut inside it); then both connections close.
            let _ = client_write.write_all(&chunk[..at]).await;
            cuts.fetch_add(1, Ordering::Relaxed);
            break;
        }
        if client_write.write_all(chunk).await.is_err() {
            break;
        }
    }
    upstream.abort();
}

/// Every token of one generation through the hop, bounded.
async fn generate(hop: &PrefillHop, request: GenerateRequest) -> Vec<u32> {
    let mut stream = tokio::time::timeout(Duration::from_secs(120), hop.generate(request))
        .await
        .expect("generate answers")
        .expect("generate succeeds");
    let mut tokens = Vec::new();
    while let Some(item) = tokio::time::timeout(Duration::from_secs(120), stream.next())
        .await
        .expect("the stream goes on")
    {
        tokens.extend(item.expect("no error reaches the client").token_ids);
    }
    tokens
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_vllm_migration_continues_greedy_output_token_for_token() {
    let (Ok(p), Ok(d)) = (
        std::env::var("PREFILL_VLLM_PREFILL"),
        std::env::var("PREFILL_VLLM_DECODE"),
    ) else {
        eprintln!("skipped: set PREFILL_VLLM_PREFILL and PREFILL_VLLM_DECODE to a vLLM P/D pair");
        return;
    };
    let (p, d): (SocketAddr, SocketAddr) = (p.parse().unwrap(), d.parse().unwrap());
    let proxy = CuttingProxy::start(d).await;
    let discovery = MemoryDiscovery::new(MemoryConfig::with_ttl(Duration::from_secs(10)));
    let _keep = [
        register(&discovery, "prefill", 1, p).await,
        register(&discovery, "decode", 100, proxy.addr).await,
        register(&discovery, "decode", 101, d).await,
    ];
    let hop = live_hop(discovery).await;
    tokio::time::timeout(Duration::from_secs(10), async {
        while hop.decode().routable() < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("both decode routes are routable");

    let prompt: Vec<u32> = (0..120u32).map(|i| 7 + (i * 53) % 900).collect();
    let mut request = GenerateRequest::new(prompt, MAX_TOKENS);
    request.engine_fields = Some(r#"{"temperature":0,"ignore_eos":true}"#.into());
    let uninterrupted = generate(&hop, request.clone()).await;
    assert_eq!(uninterrupted.len(), MAX_TOKENS as usize);

    // Armed, requests go out until one is cut (round robin: the first or the second).
    proxy.armed.store(true, Ordering::Release);
    let mut runs = 0;
    while proxy.cuts.load(Ordering::Relaxed) == 0 && runs < 4 {
        runs += 1;
        let tokens = generate(&hop, request.clone()).await;
        let agree = tokens
            .iter()
            .zip(&uninterrupted)
            .take_while(|(a, b)| a == b)
            .count();
        println!(
            "live: run {runs}: {} tokens, {agree} agree with the uninterrupted run, cuts {}",
            tokens.len(),
            proxy.cuts.load(Ordering::Relaxed)
        );
        assert_eq!(
            tokens, uninterrupted,
            "greedy output through a migration equals the uninterrupted output"
        );
    }
    let counts = hop.migrating().counts();
    let migrations: u64 = BreakReason::ALL.iter().map(|&r| counts.migrations(r)).sum();
    println!(
        "live: cuts {}, migrations {migrations} ({} prefilled first), router {:?}",
        proxy.cuts.load(Ordering::Relaxed),
        counts.prefilled(),
        hop.router().status().counters
    );
    assert_eq!(proxy.cuts.load(Ordering::Relaxed), 1, "a stream was cut");
    assert_eq!(migrations, 1, "the cut stream migrated");
    assert_eq!(
        counts.prefilled(),
        1,
        "its continuation was prefilled on the prefill engine"
    );
}
