//! A stopping worker drains (issue #27 item 2): it tells every connection ([`Frame::Draining`]),
//! serves what was sent before the client's acknowledgement to the end, refuses nothing a client
//! did not know about, and closes once idle; the frontend routes new work elsewhere without a
//! failure, a retry or a breaker.

use std::time::Duration;

use crate::support::*;
use futures_util::{SinkExt, StreamExt};
use prefill_router::health::Breaker;
use prefill_router::push::{Dispatcher, PushConfig, PushMode};
use prefill_router::request::GenerateRequest;
use prefill_router::transport::{
    decode_frame, encode_frame, ClientConfig, Connection, Frame, RemoteError, TransportError,
};
use tokio::net::TcpStream;
use tokio::time::timeout;
use tokio_util::codec::{Framed, LengthDelimitedCodec};

const TOKENS: u32 = 20;
const TICK: Duration = Duration::from_millis(20);

/// Read a stream to its end: the tokens it delivered, and whether it finished cleanly.
async fn finish(
    mut stream: impl futures_util::Stream<
            Item = Result<prefill_router::request::GenerateResponse, TransportError>,
        > + Unpin,
) -> (usize, bool) {
    let mut tokens = 0;
    loop {
        match timeout(WAIT, stream.next()).await.expect("stream in time") {
            Some(Ok(response)) => {
                tokens += response.token_ids.len();
                if response.finish.is_some() {
                    return (tokens, true);
                }
            }
            Some(Err(_)) => return (tokens, false),
            None => return (tokens, false),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_streams_finish_after_the_drain_frame_and_new_requests_are_refused_typed() {
    let engine = TickEngine::new(TICK);
    let live = std::sync::Arc::clone(&engine.live);
    let worker = start_worker(engine).await;
    let conn = Connection::connect(worker.local_addr(), ClientConfig::default())
        .await
        .expect("connect");
    let mut streams = Vec::new();
    for _ in 0..3 {
        let mut s = conn
            .generate(GenerateRequest::new(vec![1, 2, 3], TOKENS), None)
            .await
            .expect("send");
        // Running: its first token is out.
        timeout(WAIT, s.next())
            .await
            .expect("first token")
            .expect("item")
            .expect("ok");
        streams.push(s);
    }
    let notice = conn.drain_notice();
    let drain = tokio::spawn(worker.drain(WAIT));
    assert!(timeout(WAIT, notice).await.expect("drain notice in time"));
    assert!(conn.is_draining() && !conn.is_closed());
    let refused = conn
        .generate(GenerateRequest::new(vec![4], TOKENS), None)
        .await
        .expect_err("a draining connection takes no new request");
    assert_eq!(refused, TransportError::Draining);
    for s in streams {
        assert_eq!(
            finish(s).await,
            (TOKENS as usize - 1, true),
            "an in-flight stream finishes"
        );
    }
    let report = timeout(WAIT, drain)
        .await
        .expect("drain in time")
        .expect("drain task");
    assert!(report.complete(), "{report:?}");
    assert!(
        report.elapsed >= TICK * (TOKENS - 2),
        "the drain waited for the streams: {report:?}"
    );
    assert!(wait_count(&live, 0).await, "no engine stream left");
    timeout(WAIT, async {
        while !conn.is_closed() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the worker closes the drained connection");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_that_outlasts_its_timeout_cuts_what_is_left_and_says_so() {
    let worker = start_worker(TickEngine::new(Duration::from_millis(50))).await;
    let conn = Connection::connect(worker.local_addr(), ClientConfig::default())
        .await
        .expect("connect");
    let s = conn
        .generate(GenerateRequest::new(vec![1], 1000), None)
        .await
        .expect("send");
    let report = timeout(WAIT, worker.drain(Duration::from_millis(200)))
        .await
        .expect("bounded by the drain timeout");
    assert_eq!(report.cut_connections, 1, "{report:?}");
    assert!(!report.complete());
    let (_, clean) = finish(s).await;
    assert!(!clean, "the cut stream ends with an error");
}

/// The wire order of the handshake, from a raw client: a request sent after `Draining` but
/// before `DrainAck` is served; one after `DrainAck` is refused with `RemoteError::Draining`;
/// the worker closes once the served ones finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_before_the_acknowledgement_are_served_and_after_it_refused() {
    let worker = start_worker(TickEngine::new(Duration::from_millis(10))).await;
    let tcp = TcpStream::connect(worker.local_addr())
        .await
        .expect("connect");
    let mut raw = Framed::new(
        tcp,
        LengthDelimitedCodec::builder()
            .length_field_type::<u32>()
            .new_codec(),
    );
    let request = |id| Frame::Request {
        id,
        timeout_ms: None,
        request: GenerateRequest::new(vec![1, 2], 3),
    };
    let send = |frame: Frame| bytes::Bytes::from(encode_frame(&frame));
    raw.send(send(request(1))).await.expect("send 1");
    // Wait for request 1 to be running, so the drain starts with it in flight.
    let first = timeout(WAIT, raw.next())
        .await
        .expect("in time")
        .expect("frame")
        .expect("io");
    assert!(matches!(
        decode_frame(&first),
        Ok(Frame::Data { id: 1, .. })
    ));
    let drain = tokio::spawn(worker.drain(WAIT));
    let mut finished = Vec::new();
    let mut refused = Vec::new();
    let mut told = false;
    let mut acked = false;
    while let Some(frame) = timeout(WAIT, raw.next()).await.expect("in time") {
        let frame = decode_frame(&frame.expect("io")).expect("a valid frame");
        match frame {
            Frame::Draining => {
                assert!(!told, "told once");
                told = true;
                // Sent before the acknowledgement: served.
                raw.send(send(request(2))).await.expect("send 2");
                raw.send(send(Frame::DrainAck)).await.expect("ack");
                acked = true;
                // Sent after it: refused, untouched.
                raw.send(send(request(3))).await.expect("send 3");
            }
            Frame::Data { id, response } if response.finish.is_some() => finished.push(id),
            Frame::Data { .. } => {}
            Frame::Error { id, error } => refused.push((id, error)),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(told && acked);
    finished.sort_unstable();
    assert_eq!(
        finished,
        [1, 2],
        "everything sent before the ack was served"
    );
    assert_eq!(refused, [(3, RemoteError::Draining)]);
    let report = timeout(WAIT, drain).await.expect("in time").expect("task");
    assert!(report.complete(), "{report:?}");
}

/// Through the dispatcher: a worker that drains (still in discovery, as if its removal were
/// not seen yet) gets no new request, nothing counts as a failure, and its streams finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatcher_routes_around_a_draining_worker_without_a_failure() {
    let w1 = start_worker(TickEngine::new(TICK)).await;
    let w2 = start_worker(TickEngine::new(Duration::from_millis(1))).await;
    let discovery = Discovery::new(None);
    discovery.add(1, w1.local_addr()).await;
    discovery.add(2, w2.local_addr()).await;
    discovery.wait_routable(&[1, 2]).await;
    let router = Dispatcher::new(
        discovery.view.clone(),
        PushMode::RoundRobin,
        PushConfig::default(),
    );
    // Two long streams on each worker (round robin).
    let mut on_w1 = Vec::new();
    for _ in 0..4 {
        let s = router
            .generate(GenerateRequest::new(vec![1, 2, 3], TOKENS))
            .await
            .expect("routed");
        if s.instance_id() == 1 {
            on_w1.push(s);
        }
    }
    assert_eq!(on_w1.len(), 2);
    let drain = tokio::spawn(w1.drain(WAIT));
    timeout(WAIT, async {
        while !discovery.view.is_draining(1) {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .expect("the view hears of the drain");
    discovery.wait_routable(&[2]).await;
    for _ in 0..20 {
        let s = router
            .generate(GenerateRequest::new(vec![4, 5], 2))
            .await
            .expect("routed elsewhere");
        assert_eq!(s.instance_id(), 2);
    }
    for s in on_w1 {
        let mut s = s;
        let mut tokens = 0;
        let mut clean = false;
        while let Some(item) = timeout(WAIT, s.next()).await.expect("in time") {
            let response = item.expect("an in-flight stream on the draining worker continues");
            tokens += response.token_ids.len();
            clean |= response.finish.is_some();
        }
        assert!(clean && tokens >= TOKENS as usize - 1, "{tokens} tokens");
    }
    assert!(timeout(WAIT, drain)
        .await
        .expect("in time")
        .expect("task")
        .complete());
    assert_eq!(router.retry_counts().total(), 0, "no retry");
    assert_eq!(discovery.view.open_breakers(), 0, "no breaker opened");
    assert_eq!(discovery.view.health(1), Some(Breaker::Closed));
    // Removal clears the mark; the same id back at another address is routable again.
    discovery.remove(1).await;
    discovery.wait_routable(&[2]).await;
    let w1b = start_worker(TickEngine::new(Duration::from_millis(1))).await;
    discovery.add(1, w1b.local_addr()).await;
    discovery.wait_routable(&[1, 2]).await;
    assert!(!discovery.view.is_draining(1));
}
