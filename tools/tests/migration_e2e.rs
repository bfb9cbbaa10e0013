//! Migration end to end on loopback (issue 42): a `PrefillHop` over a memory store, a mock
//! prefill worker and two mock decode workers serving over TCP. A long generation's decode
//! worker is killed mid-stream (its server closes every connection, as a SIGKILL does, and its
//! record stays in discovery); the client's tokens equal an uninterrupted run's.
//!
//! The mock decode's token at position `i` after a prompt of `n` tokens is `n + i`, a function
//! of the position alone, so a continuation (prompt plus the tokens so far) produces exactly the
//! tokens the dead worker would have.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use prefill_router::advert::{ModelCard, SelectionMode};
use prefill_router::decode::DecodeError;
use prefill_router::discovery::{
    Discovery, EndpointId, InstanceId, MemoryConfig, MemoryDiscovery, Registration,
};
use prefill_router::migration::{BreakReason, MigrationConfig};
use prefill_router::push::PushConfig;
use prefill_router::request::{FinishReason, GenerateRequest, GenerateResponse};
use prefill_router::transport::{ServerConfig, ServerHandle};
use prefill_router::{PrefillHop, PrefillHopConfig};
use prefill_router_tools::mock::{
    spawn_registered, MockConfig, MockDecode, MockPrefill, MockStats,
};

/// Bound on anything the test waits for (a busy 2-core box).
const WAIT: Duration = Duration::from_secs(20);
/// Tokens of the long generation.
const MAX_TOKENS: u32 = 150;
/// Tokens the client reads before the kill.
const BEFORE_KILL: usize = 40;

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
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new(MemoryConfig::default()));
    let prefill_engine = MockPrefill::new(1, mock());
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
    for id in [100 as InstanceId, 101] {
        let engine = MockDecode::new(id, mock());
        let stats = engine.stats();
        let (server, registration) = spawn_registered(
            &discovery,
            EndpointId::new("mig", "decode", "generate"),
            id,
            engine,
            ModelCard::named("m"),
            ServerConfig::default(),
        )
        .await
        .unwrap();
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
