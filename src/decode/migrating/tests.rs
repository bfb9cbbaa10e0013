//! The driver over a scripted decode hop: each attempt streams tokens of a position-based
//! engine (token `n + i` after a prompt of `n`, as the mock workers do), then ends as scripted.

use std::collections::VecDeque;
use std::time::Duration;

use futures_util::stream;
use parking_lot::Mutex;

use super::*;
use crate::migration::MigrationError;
use crate::request::{FinishReason, PrefillInfo};
use crate::transport::{RemoteError, TransportError};

/// How a scripted attempt ends after its tokens.
#[derive(Clone)]
enum End {
    Finish,
    Error(DecodeError),
    /// The stream ends without a finish.
    Close,
    /// The worker stalls.
    Hang,
}

/// A decode hop whose attempts follow a script: (tokens it streams, how it ends).
struct Scripted {
    script: Mutex<VecDeque<(u32, End)>>,
    requests: Mutex<Vec<GenerateRequest>>,
    /// What each attempt was asked to avoid, in order.
    avoided: Mutex<Vec<Vec<InstanceId>>>,
}

impl Scripted {
    fn new(script: Vec<(u32, End)>) -> Arc<Self> {
        Arc::new(Scripted {
            script: Mutex::new(script.into()),
            requests: Mutex::new(Vec::new()),
            avoided: Mutex::new(Vec::new()),
        })
    }
}

impl Decode for Scripted {
    fn decode_avoiding<'a>(
        &'a self,
        request: GenerateRequest,
        prefill: Option<PrefillOutcome>,
        avoid: &'a [InstanceId],
    ) -> BoxFuture<'a, Result<DecodeStream, DecodeError>> {
        self.avoided.lock().push(avoid.to_vec());
        self.attempt(request, prefill)
    }

    fn decode(
        &self,
        request: GenerateRequest,
        prefill: Option<PrefillOutcome>,
    ) -> BoxFuture<'_, Result<DecodeStream, DecodeError>> {
        self.avoided.lock().push(Vec::new());
        self.attempt(request, prefill)
    }
}

impl Scripted {
    /// The next scripted attempt.
    fn attempt(
        &self,
        request: GenerateRequest,
        prefill: Option<PrefillOutcome>,
    ) -> BoxFuture<'_, Result<DecodeStream, DecodeError>> {
        let mut request = request;
        if let Some(p) = prefill {
            request.handoff = p.handoff;
        }
        self.requests.lock().push(request.clone());
        let (count, end) = self.script.lock().pop_front().expect("an attempt scripted");
        let n = u32::try_from(request.token_ids.len()).unwrap();
        let count = count.min(request.max_tokens);
        let finished = matches!(end, End::Finish);
        let items: Vec<Result<GenerateResponse, DecodeError>> = (0..count)
            .map(|i| {
                Ok(GenerateResponse {
                    token_ids: vec![n + i],
                    finish: (finished && i + 1 == count).then_some(FinishReason::Length),
                    ..GenerateResponse::default()
                })
            })
            .collect();
        let tail: DecodeStream = match end {
            End::Finish | End::Close => Box::pin(stream::empty()),
            End::Error(e) => Box::pin(stream::iter([Err(e)])),
            End::Hang => Box::pin(stream::pending()),
        };
        let stream: DecodeStream = Box::pin(stream::iter(items).chain(tail));
        async move { Ok(stream) }.boxed()
    }
}

fn reset() -> DecodeError {
    reset_by(100)
}

/// A reset from `worker` (the driver learns which worker broke from the error).
fn reset_by(worker: InstanceId) -> DecodeError {
    DecodeError::Push(PushError::Transport {
        instance: worker,
        source: TransportError::Disconnected {
            reason: "reset by peer".into(),
        },
    })
}

fn original() -> (GenerateRequest, PrefillOutcome) {
    let handoff = PrefillInfo {
        worker: 1,
        prompt_tokens: 4,
        engine_params: Some("{}".into()),
        ..PrefillInfo::default()
    };
    let outcome = PrefillOutcome {
        worker: 1,
        tokens: vec![4],
        finish: None,
        handoff: Some(handoff),
    };
    (GenerateRequest::new(vec![0, 1, 2, 3], 10), outcome)
}

async fn run(
    inner: Arc<Scripted>,
    limit: u32,
    deadline: Option<Duration>,
) -> (Vec<Result<GenerateResponse, DecodeError>>, MigratingDecode) {
    let hop = MigratingDecode::new(inner, MigrationConfig { limit }, deadline);
    let (request, outcome) = original();
    let stream = hop.decode(request, Some(outcome)).await.unwrap();
    let items = stream.collect::<Vec<_>>().await;
    (items, hop)
}

fn tokens(items: &[Result<GenerateResponse, DecodeError>]) -> Vec<u32> {
    items
        .iter()
        .filter_map(|i| i.as_ref().ok())
        .flat_map(|r| r.token_ids.clone())
        .collect()
}

#[tokio::test]
async fn a_broken_stream_continues_and_the_client_sees_every_token_once() {
    let inner = Scripted::new(vec![
        (3, End::Error(reset())),
        (2, End::Close),
        (10, End::Finish),
    ]);
    let (items, hop) = run(Arc::clone(&inner), 3, None).await;
    assert!(items.iter().all(Result::is_ok));
    assert_eq!(tokens(&items), (4..14).collect::<Vec<u32>>());
    let finishes: Vec<_> = items
        .iter()
        .filter_map(|i| i.as_ref().unwrap().finish)
        .collect();
    assert_eq!(finishes, [FinishReason::Length]);
    let usage = items.last().unwrap().as_ref().unwrap().usage.unwrap();
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (4, 10));
    let requests = inner.requests.lock();
    assert!(requests[0].handoff.is_some());
    assert_eq!(requests[1].token_ids, (0..7).collect::<Vec<u32>>());
    assert_eq!(requests[1].max_tokens, 7);
    assert_eq!(requests[2].token_ids, (0..9).collect::<Vec<u32>>());
    assert!(requests[1..].iter().all(|r| r.handoff.is_none()));
    assert_eq!(hop.counts().migrations(BreakReason::ConnectionDropped), 2);
}

#[tokio::test]
async fn an_error_the_worker_answered_is_not_migrated() {
    let rejected = DecodeError::Push(PushError::Transport {
        instance: 100,
        source: TransportError::Remote(RemoteError::Engine {
            message: "bad request".into(),
        }),
    });
    let inner = Scripted::new(vec![(2, End::Error(rejected.clone()))]);
    let (items, hop) = run(Arc::clone(&inner), 3, None).await;
    assert_eq!(items.last().unwrap().as_ref().unwrap_err(), &rejected);
    assert_eq!(inner.requests.lock().len(), 1);
    assert_eq!(hop.counts().exhausted(), 0);
}

#[tokio::test]
async fn past_the_limit_the_client_gets_a_typed_error() {
    let inner = Scripted::new(vec![(1, End::Close), (1, End::Error(reset()))]);
    let (items, hop) = run(inner, 1, None).await;
    assert_eq!(tokens(&items), vec![4, 5]);
    assert!(matches!(
        items.last().unwrap(),
        Err(DecodeError::Migration(MigrationError::LimitUsedUp {
            limit: 1,
            migrations: 1,
            reason: BreakReason::ConnectionDropped
        }))
    ));
    assert_eq!(hop.counts().exhausted(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_deadline_bounds_a_migrated_stream() {
    let inner = Scripted::new(vec![(2, End::Close), (1, End::Hang)]);
    let (items, _) = run(inner, 3, Some(Duration::from_secs(1))).await;
    assert_eq!(tokens(&items), vec![4, 5, 6]);
    assert!(matches!(
        items.last().unwrap(),
        Err(DecodeError::Migration(MigrationError::DeadlinePassed {
            emitted: 3,
            migrations: 1
        }))
    ));
}

#[tokio::test]
async fn a_limit_of_zero_leaves_the_inner_hop_unchanged() {
    let inner = Scripted::new(vec![(2, End::Error(reset()))]);
    let (items, _) = run(Arc::clone(&inner), 0, None).await;
    assert_eq!(items.last().unwrap().as_ref().unwrap_err(), &reset());
    assert_eq!(inner.requests.lock().len(), 1);
}

#[test]
fn break_reasons_come_from_how_the_worker_failed() {
    assert_eq!(
        break_reason(&reset()),
        Some((BreakReason::ConnectionDropped, Some(100)))
    );
    assert_eq!(
        break_reason(&DecodeError::Push(PushError::InstanceGone(7))),
        Some((BreakReason::WorkerVanished, Some(7)))
    );
    let draining = DecodeError::Push(PushError::Transport {
        instance: 8,
        source: TransportError::Remote(RemoteError::Draining),
    });
    assert_eq!(
        break_reason(&draining),
        Some((BreakReason::WorkerGone, Some(8)))
    );
    assert_eq!(
        break_reason(&DecodeError::Push(PushError::Timeout { instance: 1 })),
        None
    );
    assert_eq!(
        break_reason(&DecodeError::Failed {
            message: "x".into()
        }),
        None
    );
}

/// A prefill pool for continuations: Active or not per continuation, as scripted; when
/// Active it "prefills" on worker 2 and decodes with that fresh handoff.
struct Pool {
    active: Mutex<VecDeque<bool>>,
    prefilled: Mutex<Vec<GenerateRequest>>,
}

impl ContinuationPrefill for Pool {
    fn prefill_then_decode<'a>(
        &'a self,
        request: GenerateRequest,
        decode: &'a dyn Decode,
    ) -> BoxFuture<'a, Option<Result<DecodeStream, DecodeError>>> {
        async move {
            if !self.active.lock().pop_front().unwrap_or(false) {
                return None;
            }
            self.prefilled.lock().push(request.clone());
            let handoff = PrefillInfo {
                worker: 2,
                prompt_tokens: u32::try_from(request.token_ids.len()).unwrap(),
                engine_params: Some("fresh".into()),
                ..PrefillInfo::default()
            };
            let outcome = PrefillOutcome {
                worker: 2,
                tokens: vec![],
                finish: None,
                handoff: Some(handoff),
            };
            Some(decode.decode(request, Some(outcome)).await)
        }
        .boxed()
    }
}

/// The original through a migrating hop over `inner` (limit 3) whose continuations go through
/// a [`Pool`] that is Active per continuation as `active` says: the client's items, the pool
/// and the hop.
async fn run_with_pool(
    inner: &Arc<Scripted>,
    active: &[bool],
) -> (
    Vec<Result<GenerateResponse, DecodeError>>,
    Arc<Pool>,
    MigratingDecode,
) {
    let pool = Arc::new(Pool {
        active: Mutex::new(active.iter().copied().collect()),
        prefilled: Mutex::new(Vec::new()),
    });
    let hop = MigratingDecode::new(
        Arc::clone(inner) as Arc<dyn Decode>,
        MigrationConfig { limit: 3 },
        None,
    )
    .with_prefill(Arc::clone(&pool) as Arc<dyn ContinuationPrefill>);
    let (request, outcome) = original();
    let stream = hop.decode(request, Some(outcome)).await.unwrap();
    let items = stream.collect::<Vec<_>>().await;
    (items, pool, hop)
}

#[tokio::test]
async fn a_continuation_is_prefilled_on_an_active_pool_first_and_by_decode_otherwise() {
    let inner = Scripted::new(vec![
        (3, End::Error(reset())),
        (2, End::Close),
        (10, End::Finish),
    ]);
    let (items, pool, hop) = run_with_pool(&inner, &[true, false]).await;
    assert_eq!(tokens(&items), (4..14).collect::<Vec<u32>>());
    // The first continuation went through the pool: prompt plus the 3 tokens, decoded with the
    // pool's new handoff (never the first prefill's); the second, with the pool not Active,
    // went to decode without a handoff.
    let prefilled = pool.prefilled.lock();
    assert_eq!(prefilled.len(), 1);
    assert_eq!(prefilled[0].token_ids, (0..7).collect::<Vec<u32>>());
    assert!(prefilled[0].handoff.is_none());
    let requests = inner.requests.lock();
    let fresh = |r: &GenerateRequest| r.handoff.as_ref().and_then(|h| h.engine_params.clone());
    assert_eq!(fresh(&requests[0]).as_deref(), Some("{}"));
    assert_eq!(fresh(&requests[1]).as_deref(), Some("fresh"));
    assert!(requests[2].handoff.is_none());
    assert_eq!(hop.counts().prefilled(), 1);
    assert_eq!(hop.counts().migrations(BreakReason::ConnectionDropped), 2);
}

#[tokio::test]
async fn a_continuation_avoids_every_worker_its_stream_broke_on_through_the_pool_and_straight_to_decode(
) {
    let inner = Scripted::new(vec![
        (3, End::Error(reset_by(100))),
        (2, End::Error(reset_by(200))),
        (1, End::Close),
        (10, End::Finish),
    ]);
    // The first continuation goes through the prefill pool (Active), the others straight to
    // decode.
    let (items, pool, _) = run_with_pool(&inner, &[true, false, false]).await;
    assert_eq!(tokens(&items), (4..14).collect::<Vec<u32>>());
    // The first attempt avoids nothing; each continuation avoids the workers broken so far
    // (a stream that ended without a finish names no worker, so nothing is added for it).
    assert_eq!(
        *inner.avoided.lock(),
        vec![vec![], vec![100], vec![100, 200], vec![100, 200]]
    );
    assert_eq!(pool.prefilled.lock().len(), 1);
}
