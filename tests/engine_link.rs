//! The hop in front of engines that speak vLLM's disaggregated protocol, played by a stub HTTP
//! engine in the test (loopback, bounded waits): the handoff travels verbatim, a prefill
//! without one makes decode recompute, and every way an engine misbehaves (500, 400, junk, a
//! stall, a stream cut short, a dead decode engine) ends in a typed error with the handoff
//! rules kept (counted, never resent). The real vLLM runs in `.ci/vllm.sh`'s stage.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use parking_lot::Mutex;
use prefill_router::discovery::{Discovery, MemoryConfig, MemoryDiscovery, Registration};
use prefill_router::engine::EngineLinkConfig;
use prefill_router::handoff::AbandonReason;
use prefill_router::migration::MigrationConfig;
use prefill_router::request::{FinishReason, GenerateRequest, GenerateResponse};
use prefill_router::router::HandoffCounts;
use prefill_router::{PrefillHop, PrefillHopConfig};

#[path = "support/engine_cards.rs"]
mod engine_cards;
use engine_cards::{live_hop, register};

#[path = "support/http_request.rs"]
mod http_request;

use http_request::next_request;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

/// What the stub answers on `/v1/completions`.
#[derive(Clone, Debug)]
enum Act {
    /// A prefill's JSON answer, with `kv_transfer_params` when given.
    Prefill(Option<&'static str>),
    /// A decode stream of these token ids, then usage and `[DONE]`.
    Stream(Vec<u32>),
    /// A stream that sends one chunk, then closes the connection.
    CutStream,
    /// A stream that sends one chunk, then nothing.
    StallStream,
    /// This status with an OpenAI error body.
    Status(u16, &'static str),
    /// 200 with a body that is not JSON.
    Junk,
    /// Reads the request and never answers.
    Silent,
}

/// A stub engine on loopback: answers each request with `act`, keeps every body it got.
struct Stub {
    addr: SocketAddr,
    bodies: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Stub {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn stub(act: Act) -> Stub {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&bodies);
    let task = tokio::spawn(async move {
        loop {
            let Ok((socket, _)) = listener.accept().await else {
                return;
            };
            let act = act.clone();
            let seen = Arc::clone(&seen);
            tokio::spawn(serve_one(socket, act, seen));
        }
    });
    Stub { addr, bodies, task }
}

/// One connection: requests until it closes (keep-alive), each answered per `act`.
async fn serve_one(mut socket: TcpStream, act: Act, seen: Arc<Mutex<Vec<String>>>) {
    let mut buffer = Vec::new();
    while let Some((_, body)) = next_request(&mut socket, &mut buffer).await {
        seen.lock().push(body);
        if !answer(&mut socket, &act).await {
            return;
        }
    }
}

fn json_response(status: u16, body: &str) -> String {
    format!(
        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

fn chunk(token: u32, finish: Option<&str>) -> String {
    let finish = finish.map_or("null".to_owned(), |f| format!("\"{f}\""));
    format!(
        "data: {{\"choices\":[{{\"index\":0,\"text\":\" t{token}\",\"token_ids\":[{token}],\"finish_reason\":{finish}}}]}}\n\n"
    )
}

/// Write the answer; whether the connection may serve another request.
async fn answer(socket: &mut TcpStream, act: &Act) -> bool {
    let sse_head =
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
    match act {
        Act::Prefill(params) => {
            let params = params.unwrap_or("null");
            let body = format!(
                r#"{{"choices":[{{"index":0,"text":"p","token_ids":[9],"finish_reason":"length"}}],"usage":{{"prompt_tokens":3,"completion_tokens":1,"prompt_tokens_details":{{"cached_tokens":0}}}},"kv_transfer_params":{params}}}"#
            );
            socket
                .write_all(json_response(200, &body).as_bytes())
                .await
                .is_ok()
        }
        Act::Stream(tokens) => {
            let mut out = sse_head.to_owned();
            for (i, t) in tokens.iter().enumerate() {
                let last = i + 1 == tokens.len();
                out.push_str(&chunk(*t, last.then_some("length")));
            }
            out.push_str(&format!(
                "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":3,\"completion_tokens\":{},\"prompt_tokens_details\":{{\"cached_tokens\":2}}}}}}\n\ndata: [DONE]\n\n",
                tokens.len()
            ));
            let _ = socket.write_all(out.as_bytes()).await;
            false
        }
        Act::CutStream => {
            let _ = socket
                .write_all(format!("{sse_head}{}", chunk(1, None)).as_bytes())
                .await;
            false
        }
        Act::StallStream => {
            let _ = socket
                .write_all(format!("{sse_head}{}", chunk(1, None)).as_bytes())
                .await;
            tokio::time::sleep(Duration::from_secs(30)).await;
            false
        }
        Act::Status(status, message) => {
            let body = format!(r#"{{"error":{{"message":"{message}","code":{status}}}}}"#);
            socket
                .write_all(json_response(*status, &body).as_bytes())
                .await
                .is_ok()
        }
        Act::Silent => {
            tokio::time::sleep(Duration::from_secs(30)).await;
            false
        }
        Act::Junk => socket
            .write_all(json_response(200, "<html>not json").as_bytes())
            .await
            .is_ok(),
    }
}

const HANDLE: &str = r#"{"do_remote_prefill":true,"remote_block_ids":[[1, 2]],"remote_engine_id":"e","remote_request_id":"r","remote_host":"127.0.0.1","remote_port":5600,"newer_field":{"x":1.50000000000000000001}}"#;

/// A hop over one prefill and one decode stub; the registrations live as long as it.
async fn hop(prefill: &Stub, decode: &Stub) -> (PrefillHop, Vec<Registration>) {
    hop_migrating(prefill, &[decode], MigrationConfig::DEFAULT_LIMIT).await
}

/// [`hop`] over `decodes` (ids 100, 101, ...) with a migration limit of `limit` (0: a broken
/// decode stream fails the request).
async fn hop_migrating(
    prefill: &Stub,
    decodes: &[&Stub],
    limit: u32,
) -> (PrefillHop, Vec<Registration>) {
    let discovery = MemoryDiscovery::new(MemoryConfig::with_ttl(Duration::from_secs(10)));
    let mut registrations = vec![register(&discovery, "prefill", 1, prefill.addr).await];
    for (id, decode) in (100..).zip(decodes) {
        registrations.push(register(&discovery, "decode", id, decode.addr).await);
    }
    let mut config = PrefillHopConfig::default();
    config.push.request_timeout = Some(Duration::from_secs(5));
    config.migration = MigrationConfig { limit };
    config.engine = EngineLinkConfig {
        first_byte_timeout: Duration::from_secs(2),
        idle_timeout: Duration::from_millis(500),
        ..EngineLinkConfig::default()
    };
    let discovery: Arc<dyn Discovery> = Arc::new(discovery);
    let hop = PrefillHop::start(discovery, "engines", config)
        .await
        .unwrap();
    hop.router()
        .wait_active(Duration::from_secs(5))
        .await
        .expect("the hop activates on the engine pool");
    tokio::time::timeout(Duration::from_secs(5), async {
        while hop.decode().routable() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the decode engine becomes routable");
    (hop, registrations)
}

async fn run(hop: &PrefillHop) -> Result<Vec<GenerateResponse>, String> {
    let request = GenerateRequest::new(vec![5, 6, 7], 3);
    let mut stream = tokio::time::timeout(Duration::from_secs(10), hop.generate(request))
        .await
        .expect("generate never hangs")
        .map_err(|e| format!("generate: {e}"))?;
    let mut out = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .expect("a stream never hangs")
        {
            None => return Ok(out),
            Some(Ok(r)) => out.push(r),
            Some(Err(e)) => return Err(format!("stream: {e}")),
        }
    }
}

fn handoffs(hop: &PrefillHop) -> HandoffCounts {
    hop.router().status().counters.handoffs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handoff_reaches_decode_verbatim_and_is_delivered_once() {
    let prefill = stub(Act::Prefill(Some(HANDLE))).await;
    let decode = stub(Act::Stream(vec![11, 12, 13])).await;
    let (hop, _keep) = hop(&prefill, &decode).await;
    let responses = run(&hop).await.unwrap();
    let tokens: Vec<u32> = responses.iter().flat_map(|r| r.token_ids.clone()).collect();
    assert_eq!(
        tokens,
        vec![11, 12, 13],
        "the decode engine's tokens, in order"
    );
    let last = responses.last().unwrap();
    assert_eq!(last.finish, Some(FinishReason::Length));
    assert_eq!(last.usage.unwrap().cached_tokens, Some(2));
    let text: String = responses.iter().filter_map(|r| r.text.clone()).collect();
    assert_eq!(text, " t11 t12 t13");
    let bodies = decode.bodies.lock().clone();
    assert_eq!(bodies.len(), 1, "one decode request");
    assert!(
        bodies[0].ends_with(&format!("\"kv_transfer_params\":{HANDLE}}}")),
        "the handle verbatim: {}",
        bodies[0]
    );
    let prefill_body: serde_json::Value = serde_json::from_str(&prefill.bodies.lock()[0]).unwrap();
    assert_eq!(prefill_body["max_tokens"], 1);
    assert_eq!(prefill_body["kv_transfer_params"]["do_remote_decode"], true);
    let counts = handoffs(&hop);
    assert_eq!((counts.issued, counts.delivered, counts.ended()), (1, 1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_without_a_handoff_makes_decode_recompute() {
    let prefill = stub(Act::Prefill(None)).await;
    let decode = stub(Act::Stream(vec![4, 5])).await;
    let (hop, _keep) = hop(&prefill, &decode).await;
    let responses = run(&hop).await.unwrap();
    assert_eq!(
        responses.iter().map(|r| r.token_ids.len()).sum::<usize>(),
        2
    );
    assert!(!decode.bodies.lock()[0].contains("kv_transfer_params"));
    assert_eq!(
        handoffs(&hop).issued,
        0,
        "nothing single-use to account for"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_failures_after_the_handoff_fail_typed_and_never_resend_it() {
    // One decode attempt's rules: migration off (a cut stream would continue after a new
    // prefill; `a_cut_stream_continues_after_a_new_prefill_each_time` checks that).
    for act in [
        Act::Status(500, "KV load failure"),
        Act::Status(400, "max_tokens too large"),
        Act::Junk,
        Act::CutStream,
        Act::StallStream,
    ] {
        let prefill = stub(Act::Prefill(Some(HANDLE))).await;
        let decode = stub(act.clone()).await;
        let (hop, _keep) = hop_migrating(&prefill, &[&decode], 0).await;
        let error = run(&hop).await.expect_err("the decode failed");
        assert!(!error.is_empty(), "{act:?}");
        assert_eq!(
            decode.bodies.lock().len(),
            1,
            "{act:?}: the handle went out once ({error})"
        );
        let counts = handoffs(&hop);
        assert_eq!(counts.issued, 1, "{act:?}");
        // A stream that failed after it opened was delivered; one that failed before its first
        // response was carried then failed. Either way: ended once, never abandoned.
        assert_eq!(
            counts.delivered + counts.carried_then_failed,
            1,
            "{act:?}: {counts:?}"
        );
        assert_eq!(counts.ended(), 1, "{act:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_errors_are_typed_with_the_engines_message() {
    for (act, expected) in [
        (Act::Status(400, "prompt too long"), "prompt too long"),
        (Act::Status(500, "engine crashed"), "engine crashed"),
        (Act::Junk, "malformed"),
    ] {
        let prefill = stub(act.clone()).await;
        let decode = stub(Act::Stream(vec![1])).await;
        let (hop, _keep) = hop(&prefill, &decode).await;
        let outcome = run(&hop).await;
        match outcome {
            Err(error) => assert!(error.contains(expected), "{act:?}: {error}"),
            // Junk is a dead stream: with the default fallback the request bypasses to decode.
            Ok(responses) => assert!(
                matches!(act, Act::Junk) && !responses.is_empty(),
                "{act:?}: {responses:?}"
            ),
        }
        assert_eq!(handoffs(&hop).issued, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_decode_engine_abandons_the_handoff_counted() {
    let prefill = stub(Act::Prefill(Some(HANDLE))).await;
    // A port nobody listens on: every decode connection is refused, nothing was sent.
    let addr = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let dead = Stub {
        addr,
        bodies: Arc::default(),
        task: tokio::spawn(async {}),
    };
    let (hop, _keep) = hop_with(&prefill, &dead).await;
    let error = run(&hop).await.expect_err("no decode engine answers");
    assert!(
        error.contains("connect") || error.contains("routable"),
        "{error}"
    );
    let counts = handoffs(&hop);
    assert_eq!(counts.issued, 1);
    assert_eq!(
        counts.abandoned.get(&AbandonReason::DecodeUnreachable),
        Some(&1),
        "{counts:?}"
    );
}

/// Two decode engines that cut every stream after one token: the break continues (migration
/// limit 1) as a new request, the prompt plus the token so far, prefilled again for a new
/// handoff (the first one is never sent twice), on the other engine (the cut one's breaker is
/// open); its break is past the limit and the client gets the typed error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_stream_continues_after_a_new_prefill() {
    let prefill = stub(Act::Prefill(Some(HANDLE))).await;
    let decodes = [stub(Act::CutStream).await, stub(Act::CutStream).await];
    let (hop, _keep) = hop_migrating(&prefill, &[&decodes[0], &decodes[1]], 1).await;
    let error = run(&hop).await.expect_err("every attempt is cut");
    assert!(error.contains("the limit is 1"), "{error}");
    let prompts = |stub: &Stub| -> Vec<usize> {
        stub.bodies
            .lock()
            .iter()
            .map(|b| {
                let body: serde_json::Value = serde_json::from_str(b).unwrap();
                body["prompt"].as_array().map_or(0, Vec::len)
            })
            .collect()
    };
    // The original (3 prompt tokens), then the continuation one token longer.
    assert_eq!(prompts(&prefill), [3, 4]);
    let mut decoded: Vec<usize> = decodes.iter().flat_map(prompts).collect();
    decoded.sort_unstable();
    assert_eq!(decoded, [3, 4], "one attempt on each engine");
    assert!(decodes
        .iter()
        .flat_map(|d| d.bodies.lock().clone())
        .all(|b| b.contains("kv_transfer_params")));
    let counts = handoffs(&hop);
    assert_eq!(counts.issued, 2, "one handoff per prefill: {counts:?}");
    assert_eq!(counts.delivered, 2, "each delivered once: {counts:?}");
    assert_eq!(hop.migrating().counts().prefilled(), 1);
}

/// [`hop`] without waiting for the decode engine to be routable (a dead one never is, once its
/// breaker opens).
async fn hop_with(prefill: &Stub, decode: &Stub) -> (PrefillHop, Vec<Registration>) {
    let discovery = MemoryDiscovery::new(MemoryConfig::with_ttl(Duration::from_secs(10)));
    let registrations = vec![
        register(&discovery, "prefill", 1, prefill.addr).await,
        register(&discovery, "decode", 100, decode.addr).await,
    ];
    let mut config = PrefillHopConfig::default();
    config.push.request_timeout = Some(Duration::from_secs(5));
    let discovery: Arc<dyn Discovery> = Arc::new(discovery);
    let hop = PrefillHop::start(discovery, "engines", config)
        .await
        .unwrap();
    hop.router()
        .wait_active(Duration::from_secs(5))
        .await
        .expect("active");
    (hop, registrations)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_after_the_prefill_answered_is_counted_not_silent() {
    let prefill = stub(Act::Prefill(Some(HANDLE))).await;
    let decode = stub(Act::Silent).await;
    let (hop, _keep) = hop(&prefill, &decode).await;
    // The client gives up while the decode request waits for its answer: the request's
    // future is dropped between the prefill's answer and the decode's verdict.
    let request = GenerateRequest::new(vec![5, 6, 7], 3);
    let _ = tokio::time::timeout(Duration::from_millis(100), hop.generate(request)).await;
    let counts = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let counts = handoffs(&hop);
            if counts.ended() == counts.issued && counts.issued == 1 {
                return counts;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the handoff ends, counted");
    assert_eq!(
        counts.abandoned.get(&AbandonReason::ClientGone),
        Some(&1),
        "{counts:?}"
    );
}

/// Against a real vLLM pair when `PREFILL_VLLM_PREFILL` and `PREFILL_VLLM_DECODE` name their
/// `HOST:PORT` (`.ci/vllm.sh` sets them; skipped, saying so, otherwise): the handoff is
/// delivered, the decode engine pulls the prompt's KV, and greedy output equals the decode
/// engine's own on the same prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_vllm_pair_delivers_the_handoff() {
    let (Ok(p), Ok(d)) = (
        std::env::var("PREFILL_VLLM_PREFILL"),
        std::env::var("PREFILL_VLLM_DECODE"),
    ) else {
        eprintln!("skipped: set PREFILL_VLLM_PREFILL and PREFILL_VLLM_DECODE to a vLLM P/D pair");
        return;
    };
    let (p, d): (SocketAddr, SocketAddr) = (p.parse().unwrap(), d.parse().unwrap());
    let discovery = MemoryDiscovery::new(MemoryConfig::with_ttl(Duration::from_secs(10)));
    let _keep = [
        register(&discovery, "prefill", 1, p).await,
        register(&discovery, "decode", 100, d).await,
    ];
    let hop = live_hop(discovery).await;
    let prompt: Vec<u32> = (0..100u32).map(|i| 4 + (i * 37) % 1000).collect();
    let mut request = GenerateRequest::new(prompt, 12);
    request.engine_fields = Some(r#"{"temperature":0,"ignore_eos":true}"#.into());
    let mut stream = hop.generate(request.clone()).await.unwrap();
    let mut through_hop = Vec::new();
    let mut usage = None;
    while let Some(item) = stream.next().await {
        let response = item.unwrap();
        through_hop.extend(response.token_ids);
        usage = response.usage.or(usage);
    }
    assert_eq!(through_hop.len(), 12);
    assert_eq!(usage.map(|u| u.completion_tokens), Some(12));
    let counts = handoffs(&hop);
    assert_eq!((counts.issued, counts.delivered), (1, 1), "{counts:?}");
    println!("live: tokens {through_hop:?}, usage {usage:?}, handoffs {counts:?}");
}
