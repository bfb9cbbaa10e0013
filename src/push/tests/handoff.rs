//! The handoff rules held by the dispatcher's own retry loop ([`crate::handoff`]): over any
//! interleaving of refused connections, resets, dead streams, engine errors, overload and
//! answers across the decode workers, a request carrying a single-use handoff reaches at most
//! one worker with it; and the `ResendHandoff` mutant, which retries a used handle, is caught.

use std::net::SocketAddr;
use std::sync::Arc;

use parking_lot::Mutex;
use proptest::prelude::*;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::discovery::{EndpointId, Instance, InstanceEvent};
use crate::health::BackoffPolicy;
use crate::push::mutant::DispatchMutant;
use crate::push::{Dispatch, Dispatcher, PushConfig, PushMode, RoutableView, WorkerLink};
use crate::request::{GenerateRequest, GenerateResponse, PrefillInfo};
use crate::transport::{HttpError, TransportError};

/// How one attempt ends, as the worker it reached plays it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// The connection is refused: nothing was sent.
    Refused,
    /// The connection drops after the request was written.
    Reset,
    /// The stream opens and its first item is an error (the worker died mid-request).
    DeadStream,
    /// The engine answers 500 (a failed KV pull).
    EngineError,
    /// The engine answers 503 (busy).
    Busy,
    /// The engine answers.
    Answered,
}

/// Plays the scripted outcomes in order, one per attempt; records which attempts carried the
/// handle to a worker (every one but a refused connection).
#[derive(Default)]
struct Scripted {
    script: Mutex<Vec<Outcome>>,
    reached_with_handle: Mutex<u32>,
}

type Responses =
    futures_util::stream::Iter<std::vec::IntoIter<Result<GenerateResponse, TransportError>>>;

impl WorkerLink for Arc<Scripted> {
    type Stream = Responses;

    async fn open(
        &self,
        dispatch: Dispatch<'_>,
        request: GenerateRequest,
        _deadline: Option<Instant>,
    ) -> Result<Responses, TransportError> {
        let addr = dispatch.instance.address;
        let outcome = {
            let mut script = self.script.lock();
            if script.is_empty() {
                Outcome::Answered
            } else {
                script.remove(0)
            }
        };
        let carries = request.handoff.as_ref().is_some_and(|h| h.is_single_use());
        if carries && outcome != Outcome::Refused {
            *self.reached_with_handle.lock() += 1;
        }
        let item = |r| futures_util::stream::iter(vec![r]);
        match outcome {
            Outcome::Refused => Err(TransportError::Connect {
                addr,
                reason: "refused".into(),
            }),
            Outcome::Reset => Err(TransportError::Disconnected {
                reason: "reset".into(),
            }),
            Outcome::DeadStream => Ok(item(Err(TransportError::Http {
                addr,
                error: HttpError::Truncated {
                    reason: "cut".into(),
                },
            }))),
            Outcome::EngineError => Err(TransportError::Http {
                addr,
                error: HttpError::Status {
                    status: 500,
                    message: "KV load failure".into(),
                },
            }),
            Outcome::Busy => Err(TransportError::Http {
                addr,
                error: HttpError::Status {
                    status: 503,
                    message: "busy".into(),
                },
            }),
            Outcome::Answered => Ok(item(Ok(GenerateResponse {
                token_ids: vec![1],
                ..GenerateResponse::default()
            }))),
        }
    }
}

fn view(workers: u64) -> RoutableView {
    let view = RoutableView::spawn_with(
        futures_util::stream::pending(),
        None,
        CancellationToken::new(),
        BackoffPolicy::default(),
    );
    for id in 1..=workers {
        view.apply(InstanceEvent::Added(Instance {
            endpoint: EndpointId::new("t", "decode", "generate"),
            instance_id: id,
            address: SocketAddr::from(([127, 0, 0, 1], 1)),
        }));
    }
    view
}

fn carrying(single_use: bool) -> GenerateRequest {
    let mut request = GenerateRequest::new(vec![1, 2, 3], 4);
    request.handoff = Some(PrefillInfo {
        engine_params: single_use.then(|| r#"{"remote_block_ids":[[1]]}"#.to_owned()),
        ..PrefillInfo::default()
    });
    request
}

/// Run one request over `workers` decode workers playing `script`; how many workers the handle
/// reached, and whether the request was answered.
fn play(
    script: &[Outcome],
    workers: u64,
    budget: u32,
    single_use: bool,
    mutant: Option<DispatchMutant>,
) -> (u32, bool) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let link = Arc::new(Scripted {
            script: Mutex::new(script.to_vec()),
            ..Scripted::default()
        });
        let config = PushConfig {
            retry_budget: budget,
            ..PushConfig::default()
        };
        let mut push = Dispatcher::with_link(
            view(workers),
            PushMode::RoundRobin,
            config,
            Arc::clone(&link),
        );
        if let Some(mutant) = mutant {
            push = push.with_send_mutant(mutant);
        }
        let answered = match push.generate(carrying(single_use)).await {
            Ok(mut stream) => matches!(
                futures_util::StreamExt::next(&mut stream).await,
                Some(Ok(_))
            ),
            Err(_) => false,
        };
        let reached = *link.reached_with_handle.lock();
        (reached, answered)
    })
}

fn outcome() -> impl Strategy<Value = Outcome> {
    prop_oneof![
        Just(Outcome::Refused),
        Just(Outcome::Reset),
        Just(Outcome::DeadStream),
        Just(Outcome::EngineError),
        Just(Outcome::Busy),
        Just(Outcome::Answered),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn a_single_use_handoff_reaches_at_most_one_decode_worker(
        script in proptest::collection::vec(outcome(), 0..6),
        workers in 1u64..5,
        budget in 0u32..4,
    ) {
        let (reached, answered) = play(&script, workers, budget, true, None);
        prop_assert!(reached <= 1, "the handle reached {} workers: {:?}", reached, script);
        // Only refused connections come before the attempt that carried it; the first
        // non-refused outcome decides the request.
        let first_sent = script.iter().find(|o| **o != Outcome::Refused);
        if answered {
            prop_assert!(matches!(first_sent, Some(Outcome::Answered) | None));
        }
    }
}

#[test]
fn a_handoff_that_holds_nothing_is_still_retried_after_a_reset() {
    // Our own workers' handoff is a description, not a handle: retries stay as they were.
    let (_, answered) = play(&[Outcome::Reset, Outcome::Answered], 2, 2, false, None);
    assert!(answered);
}

#[test]
fn an_unsent_attempt_gives_the_handle_to_the_next_worker() {
    let (reached, answered) = play(&[Outcome::Refused, Outcome::Answered], 2, 2, true, None);
    assert_eq!((reached, answered), (1, true));
}

#[test]
fn the_resend_handoff_mutant_is_caught() {
    // The mutant retries after a reset with the used handle: two workers got it.
    let (reached, _) = play(
        &[Outcome::Reset, Outcome::Answered],
        2,
        2,
        true,
        Some(DispatchMutant::ResendHandoff),
    );
    assert_eq!(reached, 2, "the mutant resends the handle");
    let (reached, _) = play(&[Outcome::Reset, Outcome::Answered], 2, 2, true, None);
    assert_eq!(reached, 1, "the real dispatcher does not");
}
