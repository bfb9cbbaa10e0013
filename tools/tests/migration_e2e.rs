//! Migration end to end on loopback (issue 42): a `PrefillHop` over a memory store, a mock
//! prefill worker and two mock decode workers serving over TCP. A long generation's decode
//! worker is killed mid-stream (its server closes every connection, as a SIGKILL does, and its
//! record stays in discovery); the client's tokens equal an uninterrupted run's.
//!
//! The mock decode's token at position `i` after a prompt of `n` tokens is `n + i`, a function
//! of the position alone, so a continuation (prompt plus the tokens so far) produces exactly the
//! tokens the dead worker would have.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use prefill_router::advert::{DecodeDefaults, ModelCard, SelectionMode};
use prefill_router::decode::DecodeError;
use prefill_router::discovery::{
    Discovery, EndpointId, Instance, InstanceId, MemoryConfig, MemoryDiscovery, Registration,
};
use prefill_router::migration::{BreakReason, MigrationConfig};
use prefill_router::push::PushConfig;
use prefill_router::request::{FinishReason, GenerateRequest, GenerateResponse};
use prefill_router::transport::{serve, ServerConfig, ServerHandle};
use prefill_router::{PrefillHop, PrefillHopConfig};
use prefill_router_tools::mock::{
    spawn_registered, MockConfig, MockDecode, MockPrefill, MockStats,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Bound on anything the test waits for (a busy 2-core box).
const WAIT: Duration = Duration::from_secs(20);
/// Tokens of the long generation.
const MAX_TOKENS: u32 = 150;
/// Tokens the client reads before the kill.
const BEFORE_KILL: usize = 40;
/// A prefill block's time when the continuation's prefill (3 uncached blocks) must outlast the
/// decode breaker's first probe (at most 250 ms after the break: `BackoffPolicy::default()`).
const SLOW_PREFILL_BLOCK: Duration = Duration::from_millis(250);

fn mock() -> MockConfig {
    MockConfig {
        block_size: 16,
        block_cost: Duration::from_micros(100),
        token_interval: Duration::from_millis(2),
        cache_blocks: 1024,
    }
}

struct DecodeWorker {
    server: ServerHandle,
    stats: Arc<MockStats>,
    _registration: Registration,
}

struct Setup {
    hop: PrefillHop,
    decodes: Vec<DecodeWorker>,
    prefill_stats: Arc<MockStats>,
    _prefill: (ServerHandle, Registration),
}

async fn setup(limit: u32) -> Setup {
    setup_with(limit, SelectionMode::RoundRobin, &[], mock().block_cost).await
}

/// [`setup`] with the decode dispatcher picking by `decode_mode`, the first decode worker
/// registered behind `proxies` (decode worker `i` behind `proxies[i]`, whose address is what
/// discovery says; none: registered at their own), and the prefill
/// worker computing a block in `prefill_block_cost`.
async fn setup_with(
    limit: u32,
    decode_mode: SelectionMode,
    proxies: &[CuttingProxy],
    prefill_block_cost: Duration,
) -> Setup {
    let decode_card = ModelCard::named("m");
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new(MemoryConfig::default()));
    let prefill_engine = MockPrefill::new(
        1,
        MockConfig {
            block_cost: prefill_block_cost,
            ..mock()
        },
    );
    let prefill_stats = prefill_engine.stats();
    let prefill = spawn_registered(
        &discovery,
        EndpointId::new("mig", "prefill", "generate"),
        1,
        prefill_engine,
        ModelCard::routed("m", SelectionMode::RoundRobin, 16),
        ServerConfig::default(),
    )
    .await
    .unwrap();
    let mut decodes = Vec::new();
    for (index, id) in [100 as InstanceId, 101].into_iter().enumerate() {
        let engine = MockDecode::new(id, mock());
        let stats = engine.stats();
        let endpoint = EndpointId::new("mig", "decode", "generate");
        let (server, registration) = match proxies.get(index) {
            None => spawn_registered(
                &discovery,
                endpoint,
                id,
                engine,
                decode_card.clone(),
                ServerConfig::default(),
            )
            .await
            .unwrap(),
            Some(proxy) => {
                let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
                let server = serve(listener, engine, ServerConfig::default()).unwrap();
                proxy.forward_to(server.local_addr());
                let instance = Instance {
                    endpoint,
                    instance_id: id,
                    address: proxy.address,
                };
                let registration = discovery
                    .register(instance, decode_card.clone())
                    .await
                    .unwrap();
                (server, registration)
            }
        };
        decodes.push(DecodeWorker {
            server,
            stats,
            _registration: registration,
        });
    }
    let config = PrefillHopConfig {
        push: PushConfig {
            request_timeout: Some(Duration::from_secs(30)),
            ..PushConfig::default()
        },
        migration: MigrationConfig { limit },
        decode: DecodeDefaults {
            router_mode: decode_mode,
            block_size: 16,
            ..DecodeDefaults::default()
        },
        ..PrefillHopConfig::default()
    };
    let hop = PrefillHop::start(discovery, "mig", config).await.unwrap();
    tokio::time::timeout(WAIT, async {
        while hop.decode().routable() < 2 || !hop.ready().is_ready() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("both decode workers are routable and the hop is ready");
    Setup {
        hop,
        decodes,
        prefill_stats,
        _prefill: prefill,
    }
}

fn request() -> GenerateRequest {
    GenerateRequest::new((0..40).collect(), MAX_TOKENS)
}

/// Every item of a stream, bounded.
async fn collect(
    stream: &mut prefill_router::decode::DecodeStream,
) -> Vec<Result<GenerateResponse, DecodeError>> {
    tokio::time::timeout(WAIT, stream.collect::<Vec<_>>())
        .await
        .expect("the stream ends")
}

fn tokens(items: &[Result<GenerateResponse, DecodeError>]) -> Vec<u32> {
    items
        .iter()
        .filter_map(|i| i.as_ref().ok())
        .flat_map(|r| r.token_ids.iter().copied())
        .collect()
}

/// Reads until `n` tokens arrived; the responses read.
async fn read_tokens(
    stream: &mut prefill_router::decode::DecodeStream,
    n: usize,
) -> Vec<Result<GenerateResponse, DecodeError>> {
    let mut read = Vec::new();
    while tokens(&read).len() < n {
        let item = tokio::time::timeout(WAIT, stream.next())
            .await
            .expect("a token arrives")
            .expect("the stream goes on");
        read.push(item);
    }
    read
}

/// Kills the decode worker serving the one request in flight (the one whose request count
/// went up since `before`): its connections close with no final frame.
fn kill_serving(setup: &Setup, before: &[u64]) -> usize {
    let serving = setup
        .decodes
        .iter()
        .zip(before)
        .position(|(d, &b)| d.stats.requests.load(Ordering::Relaxed) > b)
        .expect("a decode worker serves the request");
    setup.decodes[serving].server.shutdown();
    serving
}

fn requests(setup: &Setup) -> Vec<u64> {
    setup
        .decodes
        .iter()
        .map(|d| d.stats.requests.load(Ordering::Relaxed))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_decode_worker_dies_continues_token_for_token() {
    let setup = setup(MigrationConfig::DEFAULT_LIMIT).await;
    let mut reference = setup.hop.generate(request()).await.unwrap();
    let reference = collect(&mut reference).await;
    assert!(reference.iter().all(Result::is_ok), "{reference:?}");
    let want = tokens(&reference);
    assert_eq!(want.len(), MAX_TOKENS as usize);

    let before = requests(&setup);
    let mut stream = setup.hop.generate(request()).await.unwrap();
    let mut items = read_tokens(&mut stream, BEFORE_KILL).await;
    let prefills_before_kill = setup.prefill_stats.requests.load(Ordering::Relaxed);
    let killed = kill_serving(&setup, &before);
    // The cost of the migration: the gap the client sees from the kill to the next token.
    let killed_at = Instant::now();
    let next = tokio::time::timeout(WAIT, stream.next())
        .await
        .expect("the stream goes on after the kill")
        .expect("an item after the kill");
    let gap = killed_at.elapsed();
    items.push(next);
    items.extend(collect(&mut stream).await);
    eprintln!(
        "migration gap: {:.1} ms from the kill to the next token (token interval {:?})",
        gap.as_secs_f64() * 1e3,
        mock().token_interval
    );

    assert!(items.iter().all(Result::is_ok), "{items:?}");
    assert_eq!(
        tokens(&items),
        want,
        "the client's text equals the uninterrupted run's"
    );
    let finishes: Vec<FinishReason> = items
        .iter()
        .filter_map(|i| i.as_ref().ok().and_then(|r| r.finish))
        .collect();
    assert_eq!(finishes, [FinishReason::Length], "one finish_reason");
    let usage = items
        .iter()
        .filter_map(|i| i.as_ref().ok().and_then(|r| r.usage))
        .next_back()
        .expect("a migrated stream reports its usage");
    assert_eq!(usage.prompt_tokens, 40);
    assert_eq!(usage.completion_tokens, MAX_TOKENS);
    let counts = setup.hop.migrating().counts();
    let migrations: u64 = BreakReason::ALL.iter().map(|&r| counts.migrations(r)).sum();
    assert_eq!(migrations, 1);
    // The continuation ran on the other worker, prefilled first on the Active prefill pool.
    let other = 1 - killed;
    assert!(setup.decodes[other].stats.requests.load(Ordering::Relaxed) > before[other]);
    assert_eq!(counts.prefilled(), 1);
    assert_eq!(
        setup.prefill_stats.requests.load(Ordering::Relaxed),
        prefills_before_kill + 1,
        "the continuation was prefilled on the prefill pool"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_limit_of_zero_the_error_reaches_the_client() {
    let setup = setup(0).await;
    let before = requests(&setup);
    let mut stream = setup.hop.generate(request()).await.unwrap();
    let mut items = read_tokens(&mut stream, BEFORE_KILL).await;
    kill_serving(&setup, &before);
    items.extend(collect(&mut stream).await);
    assert!(tokens(&items).len() < MAX_TOKENS as usize);
    assert!(
        items.last().is_some_and(Result::is_err)
            || items
                .iter()
                .all(|i| i.as_ref().is_ok_and(|r| r.finish.is_none())),
        "the stream fails or ends unfinished, as without migration: {items:?}"
    );
    let counts = setup.hop.migrating().counts();
    assert_eq!(counts.migrations(BreakReason::ConnectionDropped), 0);
}

/// A loopback TCP proxy in front of one worker: it forwards every connection until [`cut`],
/// which closes the connections open then and keeps accepting new ones. The worker behind it
/// looks like one whose stream broke but that still takes connections (a cut stream, a restart
/// under the same id): neither a refused connection nor an open breaker keeps a pick off it.
///
/// [`cut`]: CuttingProxy::cut
struct CuttingProxy {
    address: SocketAddr,
    upstream: Arc<OnceLock<SocketAddr>>,
    cuts: watch::Sender<u32>,
    accepted: Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl CuttingProxy {
    async fn start() -> Self {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let address = listener.local_addr().unwrap();
        let upstream: Arc<OnceLock<SocketAddr>> = Arc::default();
        let accepted: Arc<std::sync::atomic::AtomicU64> = Arc::default();
        let (cuts, watch_cuts) = watch::channel(0u32);
        let task = tokio::spawn({
            let (upstream, accepted) = (Arc::clone(&upstream), Arc::clone(&accepted));
            async move {
                while let Ok((mut inbound, _)) = listener.accept().await {
                    accepted.fetch_add(1, Ordering::Relaxed);
                    let mut cut = watch_cuts.clone();
                    cut.mark_unchanged();
                    let Some(&to) = upstream.get() else { continue };
                    tokio::spawn(async move {
                        let Ok(mut outbound) = TcpStream::connect(to).await else {
                            return;
                        };
                        // Either end: both sockets drop, so the frontend's read sees the
                        // connection close mid-stream.
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                            _ = cut.changed() => {}
                        }
                    });
                }
            }
        });
        CuttingProxy {
            address,
            upstream,
            cuts,
            accepted,
            task,
        }
    }

    fn forward_to(&self, upstream: SocketAddr) {
        self.upstream.set(upstream).expect("forwarded once");
    }

    /// Close every connection open now; later ones are forwarded as before.
    fn cut(&self) {
        self.cuts.send_modify(|n| *n += 1);
    }
}

impl Drop for CuttingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Decode in KV mode: the continuation's prompt extends the original's, whose blocks the
/// decode pick attributed to the worker that served it, so that worker is the KV pick's first
/// choice for the continuation too. Its stream is cut while it still takes connections. The
/// cut opens its breaker, but the continuation is prefilled first, on a prefill worker slow
/// enough (as an engine re-prefilling a long context is) that the breaker's probe reconnects
/// and closes it before the continuation's decode is picked: only `Continuation::avoid` keeps
/// that pick off the broken worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuation_avoids_the_worker_whose_stream_broke_though_it_still_accepts() {
    let proxies = [CuttingProxy::start().await, CuttingProxy::start().await];
    let setup = setup_with(
        MigrationConfig::DEFAULT_LIMIT,
        SelectionMode::KV,
        &proxies,
        SLOW_PREFILL_BLOCK,
    )
    .await;
    let mut reference = setup.hop.generate(request()).await.unwrap();
    let want = tokens(&collect(&mut reference).await);
    assert_eq!(want.len(), MAX_TOKENS as usize);
    // The KV pick keeps the prompt on the worker that served it first (a tie between idle
    // workers decided that one).
    let home = requests(&setup)
        .iter()
        .position(|&n| n == 1)
        .expect("one decode worker served the reference");
    let mut expected = [0, 0];
    expected[home] = 2;

    let mut stream = setup.hop.generate(request()).await.unwrap();
    let mut items = read_tokens(&mut stream, BEFORE_KILL).await;
    assert_eq!(
        requests(&setup),
        expected,
        "the same prompt stays on its worker"
    );
    proxies[home].cut();
    items.extend(collect(&mut stream).await);
    assert!(items.iter().all(Result::is_ok), "{items:?}");
    assert_eq!(tokens(&items), want, "token for token");
    let counts = setup.hop.migrating().counts();
    let migrations: u64 = BreakReason::ALL.iter().map(|&r| counts.migrations(r)).sum();
    assert_eq!(migrations, 1);
    assert_eq!(
        counts.prefilled(),
        1,
        "prefilled first, on the slow prefill worker"
    );
    // The broken worker still takes connections (its breaker's probe reconnected through the
    // proxy while the continuation was prefilled), but the continuation went to the other.
    expected[1 - home] = 1;
    assert_eq!(
        requests(&setup),
        expected,
        "the continuation avoided the broken worker"
    );
    assert!(proxies[home].accepted.load(Ordering::Relaxed) >= 2);
}
