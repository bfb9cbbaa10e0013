//! Hostile peers: garbage and oversized frames close that one connection with a typed error;
//! the worker keeps serving everyone else.

use std::time::Duration;

use crate::support::*;
use futures_util::StreamExt;
use prefill_router::request::{GenerateRequest, GenerateResponse};
use prefill_router::transport::{
    decode_frame, encode_frame, ClientConfig, Connection, Frame, FrameError, TransportError,
    DEFAULT_MAX_FRAME_LEN,
};
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

/// Send `bytes` raw and report whether the worker closed the connection (EOF) in time.
async fn worker_closes_after(addr: std::net::SocketAddr, bytes: &[u8]) -> bool {
    let mut raw = TcpStream::connect(addr).await.expect("connect");
    raw.write_all(bytes).await.expect("write");
    let mut buf = [0u8; 256];
    matches!(
        timeout(WAIT, raw.read(&mut buf)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

fn framed(payload: &[u8]) -> Vec<u8> {
    let mut out = (payload.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(payload);
    out
}

async fn one_request_works(addr: std::net::SocketAddr) {
    let conn = Connection::connect(addr, ClientConfig::default())
        .await
        .expect("connect");
    let mut s = conn
        .generate(GenerateRequest::new(vec![1, 2, 3], 1), None)
        .await
        .expect("send");
    let r = timeout(WAIT, s.next())
        .await
        .expect("in time")
        .expect("item");
    assert!(r.is_ok(), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_client_cannot_crash_a_worker() {
    let worker = start_worker(PrefillEngine::new(1, 4)).await;
    let addr = worker.local_addr();
    // A healthy client connected before the attacks must keep working throughout.
    let healthy = Connection::connect(addr, ClientConfig::default())
        .await
        .expect("connect");

    let attacks: Vec<Vec<u8>> = vec![
        framed(&[0xff; 32]),                                         // not a frame
        framed(&[]),                                                 // empty payload
        (u32::MAX).to_be_bytes().to_vec(),                           // oversized length prefix
        ((DEFAULT_MAX_FRAME_LEN as u32) + 1).to_be_bytes().to_vec(), // just over the limit
        framed(&encode_frame(&Frame::End { id: 1 })),                // a worker-only frame
        {
            let mut trailing = encode_frame(&Frame::Cancel { id: 1 });
            trailing.push(0);
            framed(&trailing)
        },
    ];
    for (i, attack) in attacks.iter().enumerate() {
        assert!(
            worker_closes_after(addr, attack).await,
            "attack {i} did not close its connection"
        );
        one_request_works(addr).await;
    }
    let mut s = healthy
        .generate(GenerateRequest::new(vec![9], 1), None)
        .await
        .expect("healthy connection still open");
    assert!(timeout(WAIT, s.next())
        .await
        .expect("in time")
        .expect("item")
        .is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_request_id_closes_the_connection() {
    // A silent engine keeps the first request in flight, so the second id is a duplicate.
    let live = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let worker = start_worker(std::sync::Arc::new(SilentEngine { live: live.clone() })).await;
    let mut twice = framed(&encode_frame(&Frame::Request {
        id: 5,
        timeout_ms: None,
        request: GenerateRequest::new(vec![1], 1),
    }));
    twice.extend(twice.clone());
    assert!(worker_closes_after(worker.local_addr(), &twice).await);
    // Closing the connection also stopped the request it carried.
    assert!(wait_count(&live, 0).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_from_a_worker_fails_the_clients_streams_with_a_frame_error() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let fake = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.expect("accept");
        let mut buf = [0u8; 1024];
        let _ = sock.read(&mut buf).await;
        sock.write_all(&framed(&[0xde, 0xad, 0xbe, 0xef]))
            .await
            .expect("write garbage");
        tokio::time::sleep(Duration::from_secs(5)).await;
    });
    let conn = Connection::connect(addr, ClientConfig::default())
        .await
        .expect("connect");
    let mut s = conn
        .generate(GenerateRequest::new(vec![1], 1), None)
        .await
        .expect("send");
    let item = timeout(WAIT, s.next())
        .await
        .expect("no hang")
        .expect("item");
    assert!(
        matches!(
            item,
            Err(TransportError::Frame(FrameError::Malformed { .. }))
        ),
        "{item:?}"
    );
    assert!(conn.is_closed());
    fake.abort();
}

/// Panics on every request, either when starting or on the first poll.
struct PanickingEngine {
    on_start: bool,
}

impl prefill_router::transport::Engine for PanickingEngine {
    fn generate(&self, _request: GenerateRequest) -> prefill_router::transport::EngineStream {
        if self.on_start {
            panic!("engine bug at start");
        }
        Box::pin(futures_util::stream::poll_fn(
            |_| -> std::task::Poll<Option<_>> { panic!("engine bug while generating") },
        ))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_engine_fails_only_its_request() {
    for on_start in [true, false] {
        let worker = start_worker(std::sync::Arc::new(PanickingEngine { on_start })).await;
        let conn = Connection::connect(worker.local_addr(), ClientConfig::default())
            .await
            .expect("connect");
        for _ in 0..3 {
            let mut s = conn
                .generate(GenerateRequest::new(vec![1], 1), None)
                .await
                .expect("send");
            let item = timeout(WAIT, s.next())
                .await
                .expect("no hang")
                .expect("item");
            assert_eq!(
                item,
                Err(TransportError::Remote(
                    prefill_router::transport::RemoteError::Engine {
                        message: "engine panicked".into()
                    }
                ))
            );
        }
        assert!(
            !conn.is_closed(),
            "the connection survives the engine's panics"
        );
        assert_eq!(worker.open_connections(), 1);
    }
}

#[test]
fn decode_rejects_trailing_bytes_and_truncation() {
    let good = encode_frame(&Frame::Data {
        id: 3,
        response: GenerateResponse {
            token_ids: vec![1, 2, 3],
            ..GenerateResponse::default()
        },
    });
    assert!(decode_frame(&good).is_ok());
    let mut long = good.clone();
    long.push(1);
    assert!(matches!(
        decode_frame(&long),
        Err(FrameError::Malformed { .. })
    ));
    assert!(matches!(
        decode_frame(&good[..good.len() - 1]),
        Err(FrameError::Malformed { .. })
    ));
}

fn arb_request() -> impl Strategy<Value = GenerateRequest> {
    (
        proptest::collection::vec(any::<u32>(), 0..64),
        any::<u32>(),
        proptest::option::of("[a-z]{0,8}"),
    )
        .prop_map(|(token_ids, max_tokens, session)| GenerateRequest {
            token_ids,
            max_tokens,
            session,
            ..GenerateRequest::default()
        })
}

proptest! {
    #[test]
    fn decode_frame_never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_frame(&bytes);
    }

    #[test]
    fn encoded_frames_decode_to_themselves(id in any::<u64>(), timeout_ms in proptest::option::of(any::<u64>()), request in arb_request()) {
        let frame = Frame::Request { id, timeout_ms, request };
        prop_assert_eq!(decode_frame(&encode_frame(&frame)), Ok(frame));
    }
}
