//! The request plane on loopback: streaming, multiplexing, cancellation, deadlines, errors.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support::*;
use futures_util::StreamExt;
use prefill_router::request::GenerateRequest;
use prefill_router::transport::{ClientConfig, Connection, RemoteError, TransportError};
use tokio::time::{timeout, Instant};

async fn connect(handle: &prefill_router::transport::ServerHandle) -> Connection {
    Connection::connect(handle.local_addr(), ClientConfig::default())
        .await
        .expect("connect")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_arrive_in_order_and_the_stream_ends_after_finish() {
    let engine = TickEngine::new(Duration::from_millis(1));
    let worker = start_worker(engine.clone()).await;
    let conn = connect(&worker).await;
    let stream = conn
        .generate(GenerateRequest::new(vec![1, 2, 3], 5), None)
        .await
        .expect("send");
    let items: Vec<_> = timeout(WAIT, stream.collect::<Vec<_>>())
        .await
        .expect("in time");
    let tokens: Vec<u32> = items
        .into_iter()
        .flat_map(|r| r.expect("ok").token_ids)
        .collect();
    assert_eq!(tokens, vec![0, 1, 2, 3, 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_on_one_connection_get_their_own_responses() {
    let worker = start_worker(PrefillEngine::new(7, 4)).await;
    let conn = connect(&worker).await;
    let mut tasks = Vec::new();
    for n in 1..=64u32 {
        let conn = conn.clone();
        tasks.push(tokio::spawn(async move {
            let prompt: Vec<u32> = (0..n).collect();
            let mut s = conn
                .generate(GenerateRequest::new(prompt, 1), None)
                .await
                .expect("send");
            let r = s.next().await.expect("one item").expect("ok");
            assert!(
                s.next().await.is_none(),
                "stream ends after the finishing response"
            );
            (n, r.token_ids)
        }));
    }
    for t in tasks {
        let (n, tokens) = timeout(WAIT, t).await.expect("in time").expect("task");
        // The engine answers with the prompt length: a mixed-up id would show here.
        assert_eq!(tokens, vec![n]);
    }
    assert_eq!(worker.open_connections(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_stream_stops_generation_at_the_worker() {
    let engine = TickEngine::new(Duration::from_millis(5));
    let live = Arc::clone(&engine.live);
    let worker = start_worker(engine).await;
    let conn = connect(&worker).await;
    let mut s = conn
        .generate(GenerateRequest::new(vec![1], 1_000_000), None)
        .await
        .expect("send");
    timeout(WAIT, s.next())
        .await
        .expect("first token")
        .expect("item")
        .expect("ok");
    assert_eq!(live.load(Ordering::SeqCst), 1);
    drop(s);
    assert!(
        wait_count(&live, 0).await,
        "worker kept generating after the caller dropped the stream"
    );
}

/// The cancellation check above must be able to fail: against an engine that detaches its work
/// from the stream (a worker that ignores cancellation), the live count stays up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancellation_check_catches_a_worker_that_ignores_cancel() {
    let live = Arc::new(AtomicUsize::new(0));
    let engine = Arc::new(DetachedEngine {
        live: Arc::clone(&live),
        run_for: Duration::from_secs(3),
    });
    let worker = start_worker(engine).await;
    let conn = connect(&worker).await;
    let mut s = conn
        .generate(GenerateRequest::new(vec![1], 1_000_000), None)
        .await
        .expect("send");
    timeout(WAIT, s.next())
        .await
        .expect("first token")
        .expect("item")
        .expect("ok");
    drop(s);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        live.load(Ordering::SeqCst),
        1,
        "the mutant keeps generating"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadline_yields_timeout_and_the_worker_stops() {
    let live = Arc::new(AtomicUsize::new(0));
    let worker = start_worker(Arc::new(SilentEngine {
        live: Arc::clone(&live),
    }))
    .await;
    let conn = connect(&worker).await;
    let started = Instant::now();
    let mut s = conn
        .generate(
            GenerateRequest::new(vec![1], 1),
            Some(Instant::now() + Duration::from_millis(300)),
        )
        .await
        .expect("send");
    let item = timeout(WAIT, s.next())
        .await
        .expect("no hang")
        .expect("an item");
    assert_eq!(item, Err(TransportError::Timeout));
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert!(s.next().await.is_none());
    assert!(
        wait_count(&live, 0).await,
        "worker still generating after the deadline"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_failure_reaches_the_caller_as_a_remote_error() {
    let mut engine = TickEngine::new(Duration::from_millis(1));
    Arc::get_mut(&mut engine).expect("unique").fail_after = Some(2);
    let worker = start_worker(engine).await;
    let conn = connect(&worker).await;
    let s = conn
        .generate(GenerateRequest::new(vec![1], 10), None)
        .await
        .expect("send");
    let items: Vec<_> = timeout(WAIT, s.collect::<Vec<_>>()).await.expect("in time");
    assert_eq!(items.len(), 3);
    assert!(items[0].is_ok() && items[1].is_ok());
    assert_eq!(
        items[2],
        Err(TransportError::Remote(RemoteError::Engine {
            message: "simulated engine failure".into()
        }))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_request_is_refused_locally_and_the_connection_survives() {
    let worker = start_worker(PrefillEngine::new(1, 4)).await;
    let config = ClientConfig {
        max_frame_len: 1024,
        ..ClientConfig::default()
    };
    let conn = Connection::connect(worker.local_addr(), config)
        .await
        .expect("connect");
    let err = conn
        .generate(GenerateRequest::new(vec![u32::MAX; 1024], 1), None)
        .await
        .expect_err("too large");
    assert_eq!(err, TransportError::RequestTooLarge { max: 1024 });
    let mut s = conn
        .generate(GenerateRequest::new(vec![1, 2], 1), None)
        .await
        .expect("small request still goes");
    assert!(timeout(WAIT, s.next())
        .await
        .expect("in time")
        .expect("item")
        .is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_killed_mid_stream_fails_pending_streams_promptly() {
    let engine = TickEngine::new(Duration::from_millis(5));
    let worker = start_worker(engine).await;
    let conn = connect(&worker).await;
    let mut streams = Vec::new();
    for _ in 0..4 {
        let mut s = conn
            .generate(GenerateRequest::new(vec![1], 1_000_000), None)
            .await
            .expect("send");
        timeout(WAIT, s.next())
            .await
            .expect("first")
            .expect("item")
            .expect("ok");
        streams.push(s);
    }
    worker.shutdown();
    for mut s in streams {
        // Drain what was already in flight; the stream must then fail, not hang.
        let failure = end_of(&mut s, WAIT).await.expect("no hang");
        assert!(
            matches!(failure, Some(Err(TransportError::Disconnected { .. }))),
            "{failure:?}"
        );
    }
    assert!(conn.is_closed());
    let refused = conn.generate(GenerateRequest::new(vec![1], 1), None).await;
    assert!(matches!(refused, Err(TransportError::Disconnected { .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadline_cuts_a_stream_that_never_pauses() {
    let engine = TickEngine::new(Duration::ZERO);
    let live = Arc::clone(&engine.live);
    let worker = start_worker(engine).await;
    let conn = connect(&worker).await;
    let mut s = conn
        .generate(
            GenerateRequest::new(vec![1], u32::MAX),
            Some(Instant::now() + Duration::from_millis(300)),
        )
        .await
        .expect("send");
    let end = timeout(WAIT, async {
        let mut items = 0u64;
        loop {
            match s.next().await {
                Some(Ok(_)) => items += 1,
                other => break (items, other),
            }
        }
    })
    .await
    .expect("the deadline ends the stream");
    assert!(end.0 > 0, "tokens flowed before the deadline");
    assert_eq!(end.1, Some(Err(TransportError::Timeout)));
    assert!(wait_count(&live, 0).await);
}
