//! Shared helpers of the request-plane and dispatcher tests: engines and loopback workers.

use std::collections::{BTreeSet, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::{stream, Stream, StreamExt};
use parking_lot::Mutex;
use prefill_router::discovery::{EndpointId, Instance, InstanceEvent, InstanceId};
use prefill_router::health::BackoffPolicy;
use prefill_router::push::{block_hashes, RoutableView};
use prefill_router::request::{FinishReason, GenerateRequest, GenerateResponse, PrefillInfo};
use prefill_router::transport::{
    serve, Engine, EngineError, EngineStream, ServerConfig, ServerHandle,
};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

/// Generous bound for anything a test waits on (debug builds on a busy 2-core box).
pub const WAIT: Duration = Duration::from_secs(10);

/// A prefill-like engine: one response naming this worker, with the cached-block count from a
/// per-worker set of block hashes it has seen (an exact cache, no eviction).
pub struct PrefillEngine {
    pub worker: InstanceId,
    pub block_size: u32,
    pub cache: Mutex<HashSet<u64>>,
}

impl PrefillEngine {
    pub fn new(worker: InstanceId, block_size: u32) -> Arc<Self> {
        Arc::new(PrefillEngine {
            worker,
            block_size,
            cache: Mutex::new(HashSet::new()),
        })
    }
}

impl Engine for PrefillEngine {
    fn generate(&self, request: GenerateRequest) -> EngineStream {
        let hashes = block_hashes(&request.token_ids, self.block_size);
        let cached = {
            let mut cache = self.cache.lock();
            let cached = hashes.iter().take_while(|h| cache.contains(h)).count();
            cache.extend(hashes.iter().copied());
            cached
        };
        let response = GenerateResponse {
            text: None,
            usage: None,
            token_ids: vec![request.token_ids.len() as u32],
            finish: Some(FinishReason::Length),
            prefill: Some(PrefillInfo {
                engine_params: None,
                worker: self.worker,
                prompt_tokens: request.token_ids.len() as u32,
                cached_blocks: cached as u32,
                block_size: self.block_size,
            }),
        };
        Box::pin(stream::iter([Ok(response)]))
    }
}

/// Decrements a live-stream counter when the engine's stream is dropped.
pub struct LiveGuard(pub Arc<AtomicUsize>);

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A decode-like engine: emits token `i` every `interval`, up to `max_tokens`, and counts its
/// live streams (so tests can see generation stop).
pub struct TickEngine {
    pub interval: Duration,
    pub live: Arc<AtomicUsize>,
    pub fail_after: Option<u32>,
}

impl TickEngine {
    pub fn new(interval: Duration) -> Arc<Self> {
        Arc::new(TickEngine {
            interval,
            live: Arc::new(AtomicUsize::new(0)),
            fail_after: None,
        })
    }
}

impl Engine for TickEngine {
    fn generate(&self, request: GenerateRequest) -> EngineStream {
        self.live.fetch_add(1, Ordering::SeqCst);
        let guard = LiveGuard(Arc::clone(&self.live));
        let interval = self.interval;
        let fail_after = self.fail_after;
        let max = request.max_tokens;
        Box::pin(stream::unfold(
            (0u32, guard),
            move |(i, guard)| async move {
                if i >= max {
                    return None;
                }
                if fail_after == Some(i) {
                    return Some((
                        Err(EngineError::new("simulated engine failure")),
                        (max, guard),
                    ));
                }
                tokio::time::sleep(interval).await;
                let finish = (i + 1 == max).then_some(FinishReason::Length);
                let response = GenerateResponse {
                    text: None,
                    usage: None,
                    token_ids: vec![i],
                    finish,
                    prefill: None,
                };
                Some((Ok(response), (i + 1, guard)))
            },
        ))
    }
}

/// A worker whose generation outlives the caller: it detaches the work onto its own task, so
/// dropping the stream does not stop it. The mutant the cancellation check must catch.
pub struct DetachedEngine {
    pub live: Arc<AtomicUsize>,
    pub run_for: Duration,
}

impl Engine for DetachedEngine {
    fn generate(&self, _request: GenerateRequest) -> EngineStream {
        self.live.fetch_add(1, Ordering::SeqCst);
        let guard = LiveGuard(Arc::clone(&self.live));
        let run_for = self.run_for;
        let (tx, rx) = mpsc::channel(1);
        tokio::spawn(async move {
            let _guard = guard;
            let mut i = 0;
            let end = tokio::time::Instant::now() + run_for;
            while tokio::time::Instant::now() < end {
                let _ = tx
                    .send(Ok(GenerateResponse {
                        text: None,
                        usage: None,
                        token_ids: vec![i],
                        finish: None,
                        prefill: None,
                    }))
                    .await;
                i += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        Box::pin(receiver_stream(rx))
    }
}

/// An engine that never answers.
pub struct SilentEngine {
    pub live: Arc<AtomicUsize>,
}

impl Engine for SilentEngine {
    fn generate(&self, _request: GenerateRequest) -> EngineStream {
        self.live.fetch_add(1, Ordering::SeqCst);
        let guard = LiveGuard(Arc::clone(&self.live));
        Box::pin(stream::unfold(guard, |guard| async move {
            std::future::pending::<()>().await;
            Some((Ok(GenerateResponse::default()), guard))
        }))
    }
}

pub fn receiver_stream<T: Send + 'static>(
    mut rx: mpsc::Receiver<T>,
) -> impl futures_util::Stream<Item = T> + Send + 'static {
    stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// Serve `engine` on a fresh loopback port.
pub async fn start_worker(engine: Arc<dyn Engine>) -> ServerHandle {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    serve(listener, engine, ServerConfig::default()).expect("serve")
}

pub fn instance(id: InstanceId, address: SocketAddr) -> Instance {
    Instance {
        endpoint: EndpointId::new("test", "prefill", "generate"),
        instance_id: id,
        address,
    }
}

/// A view fed by a channel the test controls.
pub struct Discovery {
    pub events: mpsc::Sender<InstanceEvent>,
    pub view: RoutableView,
    pub cancel: CancellationToken,
}

impl Discovery {
    pub fn new(admission: Option<watch::Receiver<BTreeSet<InstanceId>>>) -> Self {
        Self::with_health(admission, BackoffPolicy::default())
    }

    /// A view whose breakers back off per `health`.
    pub fn with_health(
        admission: Option<watch::Receiver<BTreeSet<InstanceId>>>,
        health: BackoffPolicy,
    ) -> Self {
        let (events, rx) = mpsc::channel(64);
        let cancel = CancellationToken::new();
        let view = RoutableView::spawn_with(receiver_stream(rx), admission, cancel.clone(), health);
        Discovery {
            events,
            view,
            cancel,
        }
    }

    pub async fn add(&self, id: InstanceId, address: SocketAddr) {
        self.events
            .send(InstanceEvent::Added(instance(id, address)))
            .await
            .expect("view task alive");
    }

    pub async fn remove(&self, id: InstanceId) {
        self.events
            .send(InstanceEvent::Removed(id))
            .await
            .expect("view task alive");
    }

    /// Wait (bounded) until exactly `ids` are routable.
    pub async fn wait_routable(&self, ids: &[InstanceId]) {
        let want: Vec<InstanceId> = ids.to_vec();
        tokio::time::timeout(
            WAIT,
            self.view
                .wait_for(|r| r.iter().map(|i| i.instance_id).collect::<Vec<_>>() == want),
        )
        .await
        .unwrap_or_else(|_| panic!("view never showed {want:?}: {:?}", self.view));
    }
}

impl Drop for Discovery {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Wait (bounded) until `counter` reads `value`.
pub async fn wait_count(counter: &AtomicUsize, value: usize) -> bool {
    tokio::time::timeout(WAIT, async {
        while counter.load(Ordering::SeqCst) != value {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .is_ok()
}

/// Skip the items a stream still yields and return how it ends: its first error, or `None` if
/// it just ends. Bounded by `deadline`: `None` from this function means it hung.
pub async fn end_of<S, T, E>(stream: &mut S, deadline: Duration) -> Option<Option<Result<T, E>>>
where
    S: Stream<Item = Result<T, E>> + Unpin,
{
    tokio::time::timeout(deadline, async {
        loop {
            match stream.next().await {
                Some(Ok(_)) => continue,
                other => break other,
            }
        }
    })
    .await
    .ok()
}

/// Which worker prefilled one small request (checked against the stream's own instance id).
pub async fn served_by(
    router: &prefill_router::push::Dispatcher,
) -> Result<InstanceId, prefill_router::push::PushError> {
    let mut s = tokio::time::timeout(
        WAIT,
        router.generate(GenerateRequest::new(vec![1, 2, 3, 4], 1)),
    )
    .await
    .expect("in time")?;
    let r = tokio::time::timeout(WAIT, s.next())
        .await
        .expect("in time")
        .expect("item")?;
    let worker = r.prefill.expect("info").worker;
    assert_eq!(worker, s.instance_id());
    Ok(worker)
}
