//! `serve --engine vllm` in front of misbehaving engines, as processes (a stub engine per role in
//! the test, loopback, bounded waits): every failure is a typed HTTP error with the engine's
//! words, counted; nothing hangs past the request's deadline; `serve` stays healthy and serves
//! the next request; a prefill without a handoff makes decode recompute.

#[path = "frontend/mod.rs"]
mod frontend;
#[path = "../../tests/support/http_request.rs"]
mod http_request;

use http_request::next_request;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use frontend::{get, post, Proc};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

/// How a stub answers `POST /v1/completions`.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Act {
    /// A prefill's JSON answer with a handoff.
    Prefill,
    /// A prefill's JSON answer without one.
    PrefillNoHandoff,
    /// Three streamed tokens, usage, `[DONE]`.
    Stream,
    /// One chunk, then the connection closes.
    Cut,
    /// One chunk, then silence.
    Stall,
    /// 500 with an OpenAI error body.
    Error500,
    /// 200 with a body that is not JSON.
    Junk,
}

const HANDLE: &str = r#"{"do_remote_prefill":true,"remote_block_ids":[[1]],"remote_engine_id":"e","remote_request_id":"r","remote_host":"127.0.0.1","remote_port":1}"#;

/// A stub engine: its act (changed by the test) and the completion bodies it got.
struct Stub {
    addr: SocketAddr,
    act: Arc<Mutex<Act>>,
    bodies: Arc<Mutex<Vec<String>>>,
}

async fn stub(act: Act) -> Stub {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let act = Arc::new(Mutex::new(act));
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let (a, b) = (Arc::clone(&act), Arc::clone(&bodies));
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(connection(socket, Arc::clone(&a), Arc::clone(&b)));
        }
    });
    Stub { addr, act, bodies }
}

async fn connection(mut socket: TcpStream, act: Arc<Mutex<Act>>, bodies: Arc<Mutex<Vec<String>>>) {
    let mut buffer = Vec::new();
    while let Some((head, body)) = next_request(&mut socket, &mut buffer).await {
        let path = head.split_whitespace().nth(1).unwrap_or("").to_owned();
        let json = |code: u16, body: &str| {
            format!(
                "HTTP/1.1 {code} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
        };
        let answer = match path.as_str() {
            "/health" => json(200, ""),
            "/v1/models" => json(200, r#"{"data":[{"id":"stub"}]}"#),
            "/metrics" => json(200, "vllm:cache_config_info{block_size=\"32\"} 1\n"),
            _ => {
                bodies.lock().unwrap().push(body);
                let act = *act.lock().unwrap();
                let chunk = |t: u32, finish: &str| {
                    format!("data: {{\"choices\":[{{\"text\":\" t{t}\",\"token_ids\":[{t}],\"finish_reason\":{finish}}}]}}\n\n")
                };
                let sse = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
                match act {
                    Act::Prefill | Act::PrefillNoHandoff => {
                        let params = if act == Act::Prefill { HANDLE } else { "null" };
                        json(200, &format!(r#"{{"choices":[{{"text":"p","token_ids":[9],"finish_reason":"length"}}],"usage":{{"prompt_tokens":3,"completion_tokens":1}},"kv_transfer_params":{params}}}"#))
                    }
                    Act::Stream => format!(
                        "{sse}{}{}{}data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":3,\"completion_tokens\":3,\"prompt_tokens_details\":{{\"cached_tokens\":0}}}}}}\n\ndata: [DONE]\n\n",
                        chunk(11, "null"),
                        chunk(12, "null"),
                        chunk(13, "\"length\"")
                    ),
                    Act::Cut => {
                        let _ = socket.write_all(format!("{sse}{}", chunk(11, "null")).as_bytes()).await;
                        return;
                    }
                    Act::Stall => {
                        let _ = socket.write_all(format!("{sse}{}", chunk(11, "null")).as_bytes()).await;
                        tokio::time::sleep(Duration::from_secs(60)).await;
                        return;
                    }
                    Act::Error500 => json(500, r#"{"error":{"message":"KV load failure","code":500}}"#),
                    Act::Junk => json(200, "<html>"),
                }
            }
        };
        if socket.write_all(answer.as_bytes()).await.is_err() || answer.contains("event-stream") {
            return;
        }
    }
}

fn metric(addr: SocketAddr, name: &str, label: &str) -> f64 {
    get(addr, "/metrics")
        .body
        .lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn completion(addr: SocketAddr, stream: bool) -> frontend::Response {
    post(
        addr,
        "/v1/completions",
        &serde_json::json!({"model": "stub", "prompt": [5, 6, 7], "max_tokens": 3, "stream": stream, "temperature": 0}),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_stays_healthy_in_front_of_misbehaving_engines() {
    let prefill = stub(Act::Prefill).await;
    let decode = stub(Act::Stream).await;
    let (p, d) = (
        format!("http://{}", prefill.addr),
        format!("http://{}", decode.addr),
    );
    let serve = Proc::spawn(
        "serve",
        &[
            "serve",
            "--engine",
            "vllm",
            "--prefill-url",
            &p,
            "--decode-url",
            &d,
            "--listen",
            "127.0.0.1:0",
            "--request-timeout-ms",
            "3000",
        ],
    );
    let addr: SocketAddr = serve.wait_event("listening")["addr"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let ready = move || get(addr, "/ready").status == 200;
    tokio::task::spawn_blocking(move || frontend::until("serve ready", ready))
        .await
        .unwrap();
    let run = move |stream: bool| tokio::task::spawn_blocking(move || completion(addr, stream));

    // Healthy engines: the engine's text, its usage, the handoff verbatim to decode.
    let ok = run(false).await.unwrap();
    assert_eq!(ok.status, 200, "{ok:?}");
    assert_eq!(ok.json()["choices"][0]["text"], " t11 t12 t13");
    assert_eq!(ok.json()["usage"]["completion_tokens"], 3);
    assert!(
        decode.bodies.lock().unwrap()[0].ends_with(&format!("\"kv_transfer_params\":{HANDLE}}}"))
    );
    let models = get(addr, "/v1/models").json();
    assert_eq!(models["data"][0]["id"], "stub", "the engines' model");

    // Decode failures after the handoff: typed, with the engine's words, never resent.
    for (act, stream) in [
        (Act::Error500, false),
        (Act::Junk, false),
        (Act::Stall, false),
        (Act::Cut, true),
    ] {
        *decode.act.lock().unwrap() = act;
        let sent_before = decode.bodies.lock().unwrap().len();
        let started = std::time::Instant::now();
        let answer = run(stream).await.unwrap();
        assert!(started.elapsed() < Duration::from_secs(10), "{act:?} hung");
        if stream && answer.status == 200 {
            let events = answer.events();
            assert!(
                events.iter().any(|e| e.contains("error")),
                "{act:?}: the stream says it failed: {events:?}"
            );
        } else {
            assert!(answer.status >= 500, "{act:?}: {answer:?}");
        }
        if act == Act::Error500 {
            assert!(answer.body.contains("KV load failure"), "{answer:?}");
        }
        assert_eq!(
            decode.bodies.lock().unwrap().len(),
            sent_before + 1,
            "{act:?}: one decode request"
        );
        assert_eq!(
            get(addr, "/health").status,
            200,
            "{act:?}: serve stays healthy"
        );
        // And serves again once the engine behaves (a dead stream opened the engine's breaker
        // until its probe closes it).
        *decode.act.lock().unwrap() = Act::Stream;
        let recovered = move || completion(addr, false).status == 200;
        tokio::task::spawn_blocking(move || frontend::until("a request answered again", recovered))
            .await
            .unwrap();
    }

    // A prefill without a handoff: decode recomputes (no kv_transfer_params), the request works.
    *decode.act.lock().unwrap() = Act::Stream;
    *prefill.act.lock().unwrap() = Act::PrefillNoHandoff;
    let ok = run(false).await.unwrap();
    assert_eq!(ok.status, 200, "{ok:?}");
    assert!(!decode
        .bodies
        .lock()
        .unwrap()
        .last()
        .unwrap()
        .contains("kv_transfer_params"));

    // A prefill that answers junk: a dead stream, so the default fallback bypasses to decode.
    *prefill.act.lock().unwrap() = Act::Junk;
    let ok = run(true).await.unwrap();
    assert_eq!(ok.status, 200, "{ok:?}");

    // Every handoff ended once, counted.
    let issued = metric(addr, "prefill_router_handoffs_total", "ending=\"issued\"");
    let ended: f64 = [
        "delivered",
        "carried_then_failed",
        "prefill_finished",
        "decode_unreachable",
        "client_gone",
    ]
    .iter()
    .map(|e| {
        metric(
            addr,
            "prefill_router_handoffs_total",
            &format!("ending=\"{e}\""),
        )
    })
    .sum();
    assert!(issued >= 6.0, "one per request with a handoff: {issued}");
    assert_eq!(ended, issued);
    let (status, _) = tokio::task::spawn_blocking(move || serve.stop())
        .await
        .unwrap();
    assert!(status.success());
}
