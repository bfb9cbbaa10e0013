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
use prefill_router::advert::{EngineCard, EngineProtocol, ModelCard};
use prefill_router::discovery::{
    Discovery, EndpointId, Instance, MemoryConfig, MemoryDiscovery, Registration,
};
use prefill_router::engine::EngineLinkConfig;
use prefill_router::handoff::AbandonReason;
use prefill_router::request::{FinishReason, GenerateRequest, GenerateResponse};
use prefill_router::router::HandoffCounts;
use prefill_router::{PrefillHop, PrefillHopConfig};
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

fn card() -> ModelCard {
    ModelCard {
        kv_cache_block_size: 32,
        engine: Some(EngineCard {
            protocol: EngineProtocol::Vllm,
        }),
        ..ModelCard::named("tiny")
    }
}

async fn register(
    discovery: &MemoryDiscovery,
    component: &str,
    id: u64,
    addr: SocketAddr,
) -> Registration {
    let instance = Instance {
        endpoint: EndpointId::new("engines", component, "generate"),
        instance_id: id,
        address: addr,
    };
    discovery.register(instance, card()).await.unwrap()
}

/// A hop over one prefill and one decode stub; the registrations live as long as it.
async fn hop(prefill: &Stub, decode: &Stub) -> (PrefillHop, Vec<Registration>) {
    let discovery = MemoryDiscovery::new(MemoryConfig::with_ttl(Duration::from_secs(10)));
    let registrations = vec![
        register(&discovery, "prefill", 1, prefill.addr).await,
        register(&discovery, "decode", 100, decode.addr).await,
    ];
    let mut config = PrefillHopConfig::default();
    config.push.request_timeout = Some(Duration::from_secs(5));
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
    for act in [
        Act::Status(500, "KV load failure"),
        Act::Status(400, "max_tokens too large"),
        Act::Junk,
        Act::CutStream,
        Act::StallStream,
    ] {
        let prefill = stub(Act::Prefill(Some(HANDLE))).await;
        let decode = stub(act.clone()).await;
        let (hop, _keep) = hop(&prefill, &decode).await;
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
    let mut config = PrefillHopConfig::default();
    config.push.request_timeout = Some(Duration::from_secs(120));
    let discovery: Arc<dyn Discovery> = Arc::new(discovery);
    let hop = PrefillHop::start(discovery, "engines", config)
        .await
        .unwrap();
    hop.router()
        .wait_active(Duration::from_secs(10))
        .await
        .unwrap();
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

/// Against a real vLLM prefill engine publishing its KV events when `PREFILL_VLLM_EVENTS`
/// names its `HOST:PORT` (`.ci/vllm.sh`; skipped, saying so, otherwise): after prompts with
/// shared prefixes, the blocks the router's index credits the engine with for the next prompt
/// equal the cached tokens the engine reports for it (to the block); a second router that joins
/// late rebuilds the same picture from the engine's replay; a router whose card says another
/// block size reports the mismatch instead of routing around it silently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_vllm_events_index_what_the_engine_caches() {
    use prefill_router::binding::Binding;
    use prefill_router::engine::FeedState;
    use prefill_router::kv_events::{MirrorError, Picture};

    let Ok(e) = std::env::var("PREFILL_VLLM_EVENTS") else {
        eprintln!("skipped: set PREFILL_VLLM_EVENTS to a vLLM prefill engine with KV events on");
        return;
    };
    let addr: SocketAddr = e.parse().unwrap();
    let start = |block_size| events_hop(addr, block_size);
    let subscribed = |hop: &PrefillHop| events_ready(hop);
    let (hop, _r) = start(32).await;
    // A fresh subscriber learns the engine's whole history (a replay from 0) before its first
    // picture; bounded wait.
    let began = std::time::Instant::now();
    for _ in 0..3000 {
        if subscribed(&hop) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    println!("live events: first picture after {:?}", began.elapsed());
    let status = hop.binding_stats().engine_kv.status(1).unwrap();
    assert_eq!(status.state, FeedState::Subscribed, "{status:?}");

    // A family of prompts sharing a 160-token prefix (5 blocks of 32), salted per run so the
    // engine's cache from earlier tests does not answer.
    let salt = (std::process::id() % 500) * 2;
    let shared: Vec<u32> = (0..160u32).map(|i| 5 + (salt + i * 13) % 900).collect();
    let prompt = |n: u32, len: usize| -> Vec<u32> {
        let mut p = shared.clone();
        p.extend((0..len as u32).map(|i| 7 + (n * 31 + i * 7) % 900));
        p
    };
    let binding = hop.router().route().binding().cloned().unwrap();
    let mut compared = 0;
    for n in 0..6u32 {
        let tokens = prompt(n, 40 + 8 * n as usize);
        // What the index says the engine holds of this prompt, once the events of every earlier
        // prefill are in (bounded wait for them to settle).
        let mut predicted = None;
        for _ in 0..50 {
            predicted = binding.dispatcher().kv_indexed_overlap(&tokens, 1);
            if n == 0 || predicted.unwrap_or(0) >= 5 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let info = binding
            .prefill(GenerateRequest::new(tokens.clone(), 1))
            .await
            .unwrap();
        let reported = info
            .handoff
            .as_ref()
            .map_or(0, |h| h.cached_blocks as usize);
        println!("live events: prompt {n}: index {predicted:?} blocks, engine reports {reported} cached blocks");
        assert_eq!(
            predicted.unwrap_or(0),
            reported,
            "prompt {n}: index vs engine"
        );
        if n > 0 {
            assert!(reported >= 5, "the shared prefix was cached");
            compared += 1;
        }
    }
    assert_eq!(compared, 5);
    let status = hop.binding_stats().engine_kv.status(1).unwrap();
    println!("live events: {status:?}");
    assert_eq!(status.picture, Picture::Exact, "{status:?}");
    assert_eq!(status.undecodable, 0);
    assert_eq!(hop.warnings(), Vec::<String>::new());
    let mut registry = prometheus_client::registry::Registry::default();
    hop.register_metrics(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains("prefill_router_engine_kv_exact{engine=\"1\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("prefill_router_kv_overlap_decisions_total 5"),
        "{text}"
    );
    assert!(
        text.contains("prefill_router_kv_zero_overlap_decisions_total 1"),
        "{text}"
    );
    // Forty more distinct prompts (three new blocks each, one batch each) time the freshness.
    for n in 0..40u32 {
        let tokens: Vec<u32> = (0..100u32)
            .map(|i| 3 + (salt + n * 211 + i * 17) % 950)
            .collect();
        binding
            .prefill(GenerateRequest::new(tokens, 1))
            .await
            .unwrap();
    }
    for _ in 0..100 {
        let received = hop
            .binding_stats()
            .engine_kv
            .status(1)
            .map_or(0, |s| s.received);
        if received >= 45 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let status = hop.binding_stats().engine_kv.status(1).unwrap();
    let fresh = &status.freshness;
    println!(
        "FIGURE engine_kv_freshness_ms samples={} p50={:.2} p99={:.2} max={:.2}",
        fresh.len(),
        fresh.quantile(0.5).unwrap_or(f64::NAN),
        fresh.quantile(0.99).unwrap_or(f64::NAN),
        fresh.quantile(1.0).unwrap_or(f64::NAN)
    );
    assert!(!fresh.is_empty(), "live batches were timed");

    // A second router joining late: its subscriber replays the engine's history and credits
    // the same prefix (stored again first: a small cache may have evicted it since).
    binding
        .prefill(GenerateRequest::new(prompt(98, 8), 1))
        .await
        .unwrap();
    let (late, _r2) = start(32).await;
    for _ in 0..300 {
        if subscribed(&late) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let late_binding = late.router().route().binding().cloned().unwrap();
    let probe = prompt(99, 8);
    let ours = binding.dispatcher().kv_indexed_overlap(&probe, 1);
    let theirs = late_binding.dispatcher().kv_indexed_overlap(&probe, 1);
    println!("live events: late joiner credits {theirs:?}, first router {ours:?}");
    println!(
        "live events: late joiner {:?}",
        late.binding_stats().engine_kv.status(1)
    );
    assert_eq!(theirs, ours);
    assert!(ours.unwrap_or(0) >= 5);
    late.shutdown().await;

    // A card with another block size: reported, nothing credited.
    let (wrong, _r3) = start(16).await;
    let wrong_binding = wrong.router().route().binding().cloned().unwrap();
    let _ = wrong_binding
        .prefill(GenerateRequest::new(prompt(7, 300), 1))
        .await
        .unwrap();
    let mut status = None;
    for _ in 0..100 {
        status = wrong.binding_stats().engine_kv.status(1);
        if status.as_ref().is_some_and(|s| s.last_error.is_some()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = status.unwrap();
    println!("live events: card at 16 over an engine at 32: {status:?}");
    assert_eq!(
        status.last_error,
        Some(MirrorError::BlockSizeMismatch {
            card: 16,
            engine: 32
        })
    );
    assert!(status.counts.block_size_mismatches >= 1);
    let warnings = wrong.warnings();
    assert!(
        warnings.iter().any(|w| w.contains("the card says 16")),
        "{warnings:?}"
    );
    wrong.shutdown().await;
    hop.shutdown().await;
}

/// A hop whose prefill set is the vLLM engine at `addr` (instance 1), its card in KV mode at
/// `block_size` tokens per block, waiting until it is Active.
async fn events_hop(addr: SocketAddr, block_size: u32) -> (PrefillHop, [Registration; 2]) {
    use prefill_router::advert::{RouterConfig, SelectionMode};
    let card = ModelCard {
        kv_cache_block_size: block_size,
        router_config: Some(RouterConfig {
            router_mode: SelectionMode::KV,
            ..RouterConfig::default()
        }),
        ..card()
    };
    let discovery = MemoryDiscovery::new(MemoryConfig::with_ttl(Duration::from_secs(30)));
    let instance = Instance {
        endpoint: EndpointId::new("engines", "prefill", "generate"),
        instance_id: 1,
        address: addr,
    };
    // The topology needs a decode set to name a prefill one; only prefills are sent here.
    let registration = [
        discovery.register(instance, card).await.unwrap(),
        register(&discovery, "decode", 100, addr).await,
    ];
    let mut config = PrefillHopConfig::default();
    config.push.request_timeout = Some(Duration::from_secs(120));
    let discovery: Arc<dyn Discovery> = Arc::new(discovery);
    let hop = PrefillHop::start(discovery, "engines", config)
        .await
        .unwrap();
    hop.router()
        .wait_active(Duration::from_secs(10))
        .await
        .map_err(|e| format!("{e:?} {:?}", hop.router().status()))
        .unwrap();
    (hop, registration)
}

/// Whether the hop's feed of engine 1 is subscribed with a picture.
fn events_ready(hop: &PrefillHop) -> bool {
    use prefill_router::engine::FeedState;
    use prefill_router::kv_events::Picture;
    hop.binding_stats()
        .engine_kv
        .status(1)
        .is_some_and(|s| s.state == FeedState::Subscribed && s.picture != Picture::Unknown)
}

/// An engine with a small cache (`PREFILL_VLLM_EVICTING` = its address,
/// `PREFILL_VLLM_EVICTING_BLOCKS` = its `--num-gpu-blocks-override`) evicts, and the index
/// follows its removals: more distinct prompts than it holds, then the first of them (evicted)
/// and the last (still there) are each credited exactly what the engine then reports cached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_vllm_events_follow_an_engine_that_evicts() {
    use prefill_router::binding::Binding;
    use prefill_router::kv_events::Picture;
    let (Ok(addr), Some(capacity)) = (
        std::env::var("PREFILL_VLLM_EVICTING"),
        std::env::var("PREFILL_VLLM_EVICTING_BLOCKS")
            .ok()
            .and_then(|b| b.parse::<u32>().ok()),
    ) else {
        eprintln!("skipped: set PREFILL_VLLM_EVICTING and PREFILL_VLLM_EVICTING_BLOCKS to a vLLM engine with a small cache and KV events on");
        return;
    };
    let (hop, _r) = events_hop(addr.parse().unwrap(), 32).await;
    for _ in 0..3000 {
        if events_ready(&hop) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let binding = hop.router().route().binding().cloned().unwrap();
    let salt = std::process::id() % 500;
    let evicting = |n: u32| -> Vec<u32> {
        // Eight full blocks and a few tokens: a prompt that is whole blocks is never reported
        // fully cached (the engine recomputes its last token).
        (0..260u32)
            .map(|i| 3 + (salt * 7 + n * 389 + i * 23) % 990)
            .collect()
    };
    let count = capacity / 8 + 6;
    for n in 0..count {
        binding
            .prefill(GenerateRequest::new(evicting(n), 1))
            .await
            .unwrap();
    }
    // The last batches settle (bounded).
    let received = |hop: &PrefillHop| {
        hop.binding_stats()
            .engine_kv
            .status(1)
            .map_or(0, |s| s.received)
    };
    let mut last = received(&hop);
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = received(&hop);
        if now == last {
            break;
        }
        last = now;
    }
    for n in [0, count - 1] {
        let tokens = evicting(n);
        let predicted = binding
            .dispatcher()
            .kv_indexed_overlap(&tokens, 1)
            .unwrap_or(0);
        let info = binding
            .prefill(GenerateRequest::new(tokens, 1))
            .await
            .unwrap();
        let reported = info
            .handoff
            .as_ref()
            .map_or(0, |h| h.cached_blocks as usize);
        println!("live events: eviction, prompt {n} of {count}: index {predicted} blocks, engine reports {reported}");
        assert_eq!(predicted, reported, "prompt {n} after evictions");
    }
    let status = hop.binding_stats().engine_kv.status(1).unwrap();
    assert_eq!(status.picture, Picture::Exact, "{status:?}");
    assert_eq!(status.stale_restarts, 0, "{status:?}");
    hop.shutdown().await;
}

/// An engine restarted under the subscriber (`PREFILL_VLLM_RESTART_ENGINE` = its address with
/// KV events on, `PREFILL_VLLM_RESTART_CMD` = a shell command that restarts it on the same
/// ports and returns once it is healthy): the feed reconnects, notices the restart (numbers
/// going back, or a replay that cannot reach back) and rebuilds, so a prompt cached before the
/// restart is credited nothing, as the new process reports. Run by hand (an engine start costs
/// the CI stage about 100 s): docs/engines.md.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_vllm_events_follow_an_engine_restart() {
    use prefill_router::binding::Binding;
    use prefill_router::kv_events::Picture;
    let (Ok(addr), Ok(restart)) = (
        std::env::var("PREFILL_VLLM_RESTART_ENGINE"),
        std::env::var("PREFILL_VLLM_RESTART_CMD"),
    ) else {
        eprintln!("skipped: set PREFILL_VLLM_RESTART_ENGINE and PREFILL_VLLM_RESTART_CMD");
        return;
    };
    let (hop, _r) = events_hop(addr.parse().unwrap(), 32).await;
    for _ in 0..3000 {
        if events_ready(&hop) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let binding = hop.router().route().binding().cloned().unwrap();
    let salt = std::process::id() % 500;
    let prompt = |n: u32| -> Vec<u32> {
        (0..200u32)
            .map(|i| 5 + (salt * 11 + n * 131 + i * 29) % 990)
            .collect()
    };
    binding
        .prefill(GenerateRequest::new(prompt(1), 1))
        .await
        .unwrap();
    let mut credited = None;
    for _ in 0..100 {
        credited = binding.dispatcher().kv_indexed_overlap(&prompt(1), 1);
        if credited == Some(6) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(credited, Some(6), "prompt 1 indexed before the restart");

    let began = std::time::Instant::now();
    let status = tokio::task::spawn_blocking(move || {
        std::process::Command::new("sh")
            .args(["-c", &restart])
            .status()
    })
    .await
    .unwrap()
    .unwrap();
    assert!(status.success(), "the restart command failed: {status}");
    println!("live events: engine restarted in {:?}", began.elapsed());
    // The new process stores something: its first batch numbers from 0 again.
    let mut sent = false;
    for _ in 0..60 {
        if binding
            .prefill(GenerateRequest::new(prompt(2), 1))
            .await
            .is_ok()
        {
            sent = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(sent, "the restarted engine answers");
    let mut noticed = None;
    for _ in 0..900 {
        let s = hop.binding_stats().engine_kv.status(1).unwrap();
        if (s.counts.restarts >= 1 || s.counts.rebuilds >= 1) && s.picture != Picture::Unknown {
            noticed = Some(s);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = noticed.expect("the restart noticed within 90 s");
    println!(
        "live events: restart noticed {:?} after the engine was back: {status:?}",
        began.elapsed()
    );
    let predicted = binding
        .dispatcher()
        .kv_indexed_overlap(&prompt(1), 1)
        .unwrap_or(0);
    let info = binding
        .prefill(GenerateRequest::new(prompt(1), 1))
        .await
        .unwrap();
    let reported = info
        .handoff
        .as_ref()
        .map_or(0, |h| h.cached_blocks as usize);
    println!("live events: after the restart, prompt 1: index {predicted}, engine {reported}");
    assert_eq!((predicted, reported), (0, 0));
    hop.shutdown().await;
}
