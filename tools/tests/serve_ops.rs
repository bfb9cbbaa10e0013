//! `prefill-router serve` in production operations, as a process on a file store with worker
//! processes, over raw loopback sockets (issue #27): stalled clients (slowloris) are closed at
//! their timeouts and never hold the process past SIGTERM's bound; the drain delay keeps
//! serving while `/ready` says 503; a disconnect before the first token is counted; a wrong
//! method is an OpenAI 405 with `Allow`; the OpenAI details (`stream_options.include_usage`,
//! token-list prompts, `max_tokens` out of range); the session-affinity TTL from the worker's
//! command line; API keys (`serve_ops/keys.rs`).
//!
//! Timing: every timeout under test is short (hundreds of milliseconds) and every assertion
//! on it is a generous liveness bound (seconds), so a loaded 2-core box does not flake them.

mod frontend;
#[path = "serve_ops/keys.rs"]
mod keys;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use frontend::*;
use serde_json::json;

const DECODE: u64 = 100;

/// How long a test waits for serve to close a stalled connection whose timeout is well under
/// a second.
const CLOSE_BOUND: Duration = Duration::from_secs(10);

fn chat(content: &str, max_tokens: u32, stream: bool) -> serde_json::Value {
    json!({
        "model": "mock-llm",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
}

/// A raw connection that sent `bytes` and then stalls.
fn stalled(addr: SocketAddr, bytes: &[u8]) -> TcpStream {
    let mut stream = TcpStream::connect_timeout(&addr, WAIT).expect("connect");
    stream.write_all(bytes).expect("send");
    stream
}

/// Read until serve closes `stream` (EOF or reset), at most `bound`; what was read, or a
/// panic naming `what` if the connection stayed open.
fn closed_within(mut stream: TcpStream, bound: Duration, what: &str) -> (Vec<u8>, Duration) {
    let started = Instant::now();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = bound.saturating_sub(started.elapsed());
        assert!(
            !left.is_zero(),
            "{what}: serve kept the connection open for {bound:?}; read so far: {:?}",
            String::from_utf8_lossy(&seen)
        );
        stream.set_read_timeout(Some(left)).unwrap();
        match stream.read(&mut buf) {
            Ok(0) => return (seen, started.elapsed()),
            Ok(n) => seen.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            // A reset is a close too.
            Err(_) => return (seen, started.elapsed()),
        }
    }
}

/// The value of the first metric line starting with `name` (exactly, then a space or `{`).
fn metric(addr: SocketAddr, line_prefix: &str) -> Option<f64> {
    get(addr, "/metrics")
        .body
        .lines()
        .find(|l| l.starts_with(line_prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

fn in_flight(addr: SocketAddr) -> Option<f64> {
    metric(addr, "prefill_router_http_in_flight ")
}

fn basic_cluster() -> (Cluster, Vec<Proc>) {
    let cluster = Cluster::new();
    let procs = vec![
        cluster.worker("prefill", 1, &[]),
        cluster.worker("decode", DECODE, &[]),
    ];
    (cluster, procs)
}

/// Slowloris: a client that sends part of its headers, one that sends its headers and part of
/// its body, one that connects and says nothing, and an idle keep-alive connection are each
/// closed at their timeout; the half-body request is answered 408 first; the in-flight gauge
/// returns to 0 and serve keeps answering others meanwhile.
#[test]
fn stalled_clients_are_closed_at_their_timeouts_and_in_flight_returns_to_zero() {
    let (cluster, _workers) = basic_cluster();
    let (_serve, addr) = cluster.serve(&[
        "--header-timeout-ms",
        "500",
        "--body-timeout-ms",
        "500",
        "--idle-timeout-ms",
        "500",
    ]);
    until("ready", || get(addr, "/ready").status == 200);

    let half_head = stalled(
        addr,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl",
    );
    let body = br#"{"model": "m", "prompt": "hello", "max_tokens": 2}"#;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let mut half_body = stalled(addr, head.as_bytes());
    half_body.write_all(&body[..10]).unwrap();
    let silent = stalled(addr, b"");
    let mut keep_alive = stalled(addr, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n");

    // While they stall, others are served.
    let served = post(
        addr,
        "/v1/completions",
        &json!({"model": "m", "prompt": "hi", "max_tokens": 2}),
    );
    assert_eq!(served.status, 200, "{served:?}");

    // The keep-alive connection got its answer, then idles until it is closed.
    let mut answer = Vec::new();
    let mut buf = [0u8; 1024];
    keep_alive.set_read_timeout(Some(CLOSE_BOUND)).unwrap();
    while !String::from_utf8_lossy(&answer).contains("\"ok\"") {
        let n = keep_alive.read(&mut buf).expect("the health answer");
        assert!(n > 0, "closed before answering");
        answer.extend_from_slice(&buf[..n]);
    }
    assert!(String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 200"));
    closed_within(keep_alive, CLOSE_BOUND, "idle keep-alive connection");

    closed_within(half_head, CLOSE_BOUND, "half the headers");
    closed_within(silent, CLOSE_BOUND, "a connection that sends nothing");
    let (answer, _) = closed_within(half_body, CLOSE_BOUND, "half the body");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"body_timeout\""), "{answer}");

    until("in flight back to 0", || in_flight(addr) == Some(0.0));
    let metrics = get(addr, "/metrics").body;
    for reason in ["header_timeout", "idle_timeout"] {
        assert!(
            metrics.lines().any(|l| l.starts_with(&format!(
                "prefill_router_http_connections_dropped_total{{reason=\"{reason}\"}}"
            ))),
            "{reason} counted: {metrics}"
        );
    }
    assert!(
        metrics
            .contains(r#"prefill_router_http_requests_total{route="completions",status="408"} 1"#),
        "{metrics}"
    );
}

/// The connection cap: with two connections open (stalled), a third waits in the listen
/// backlog, unanswered, until the header timeout closes a stalled one; then it is served.
#[test]
fn over_the_connection_cap_a_new_connection_waits_for_a_free_slot() {
    let (cluster, _workers) = basic_cluster();
    let (_serve, addr) = cluster.serve(&["--max-connections", "2", "--header-timeout-ms", "1500"]);
    until("ready", || get(addr, "/ready").status == 200);
    let started = Instant::now();
    let first = stalled(addr, b"GET /health HTTP/1.1\r\n");
    let second = stalled(addr, b"");
    let waiting = std::thread::spawn(move || {
        let response = get(addr, "/health");
        (response, started.elapsed())
    });
    let (response, took) = waiting.join().unwrap();
    assert_eq!(response.status, 200, "{response:?}");
    // Lower bound only (a loaded box is slower, never faster): the stalled connections held
    // both slots until the header timeout (1.5 s after they were accepted) closed them.
    assert!(
        took >= Duration::from_millis(1400),
        "answered after {took:?}: the cap did not hold"
    );
    closed_within(first, CLOSE_BOUND, "stalled connection 1");
    closed_within(second, CLOSE_BOUND, "stalled connection 2");
    until("connections gauge back to 1 (this scrape)", || {
        metric(addr, "prefill_router_http_connections ") == Some(1.0)
    });
}

/// The request deadline covers the whole request from its first byte: a body that trickles in
/// byte by byte (each byte within the body timeout) still ends at the deadline.
#[test]
fn the_request_deadline_covers_a_trickling_body() {
    let (cluster, _workers) = basic_cluster();
    let (_serve, addr) = cluster.serve(&[
        "--request-timeout-ms",
        "1000",
        "--body-timeout-ms",
        "60000",
        "--header-timeout-ms",
        "60000",
    ]);
    until("ready", || get(addr, "/ready").status == 200);
    let body = format!(
        r#"{{"model": "m", "prompt": "{}", "max_tokens": 2}}"#,
        "x".repeat(200)
    );
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let mut stream = stalled(addr, head.as_bytes());
    let started = Instant::now();
    let mut closed = false;
    for byte in body.as_bytes() {
        if stream.write_all(&[*byte]).is_err() {
            closed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
        if started.elapsed() > CLOSE_BOUND {
            break;
        }
    }
    assert!(
        closed || started.elapsed() < CLOSE_BOUND,
        "still reading the body after {CLOSE_BOUND:?}"
    );
    let (answer, _) = closed_within(stream, CLOSE_BOUND, "a trickling body");
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 408"),
        "{answer}"
    );
    until("in flight back to 0", || in_flight(addr) == Some(0.0));
}

/// SIGTERM with stalled clients (whose own timeouts are a minute away) and a long stream:
/// serve exits within its drain delay plus shutdown bound, closing the stragglers and saying
/// how many it closed.
#[test]
fn sigterm_exits_within_its_bound_even_with_stalled_clients() {
    let cluster = Cluster::new();
    let _p = cluster.worker("prefill", 1, &[]);
    let _d = cluster.worker("decode", DECODE, &["--token-interval-us", "5000"]);
    let (serve, addr) = cluster.serve(&[
        "--header-timeout-ms",
        "60000",
        "--body-timeout-ms",
        "60000",
        "--idle-timeout-ms",
        "60000",
        "--request-timeout-ms",
        "60000",
        "--drain-delay-ms",
        "200",
        "--shutdown-timeout-ms",
        "1000",
    ]);
    until("active", || {
        get(addr, "/ready").json()["lifecycle"] == "active"
    });
    let _half_head = stalled(addr, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n");
    let _half_body = stalled(
        addr,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\"",
    );
    // A stream of 4000 tokens at 5 ms: 20 s if nothing ends it.
    let long = stalled(addr, {
        let body = chat("long", 4000, true).to_string();
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .leak()
        .as_bytes()
    });
    until("two requests in flight", || in_flight(addr) == Some(2.0));
    let started = Instant::now();
    let status = serve.terminate_keeping_output();
    let took = started.elapsed();
    assert!(status.0.success(), "exit status {:?}", status.0);
    assert!(
        took < Duration::from_secs(10),
        "serve took {took:?} to exit (bound: 0.2 s delay + 1 s drain)"
    );
    let stopped = status
        .1
        .iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["event"] == "stopped")
        .expect("a stopped event");
    assert!(
        stopped["closed_at_bound"].as_u64().is_some_and(|n| n >= 2),
        "{stopped}"
    );
    closed_within(long, CLOSE_BOUND, "the long stream");
}

/// SIGTERM starts the drain delay: `/ready` answers 503 (reason: shutting down) while requests
/// are still served; then serve stops and exits.
#[test]
fn during_the_drain_delay_ready_is_503_and_requests_are_still_served() {
    let (cluster, _workers) = basic_cluster();
    // Long enough for the checks below on a loaded box: after it the listener closes.
    let (serve, addr) = cluster.serve(&["--drain-delay-ms", "8000"]);
    until("active", || {
        get(addr, "/ready").json()["lifecycle"] == "active"
    });
    let started = Instant::now();
    serve.signal(libc::SIGTERM);
    until("ready turns 503", || get(addr, "/ready").status == 503);
    let ready = get(addr, "/ready").json();
    assert_eq!(ready["ready"], false);
    assert!(
        ready["reason"]
            .as_str()
            .is_some_and(|r| r.contains("draining")),
        "{ready}"
    );
    let served = post(addr, "/v1/chat/completions", &chat("still here", 2, false));
    assert_eq!(
        served.status, 200,
        "served during the drain delay: {served:?}"
    );
    // Then it stops on its own (a second signal would exit at once instead).
    let status = serve.wait_exit();
    assert!(status.success(), "{status:?}");
    assert!(
        started.elapsed() >= Duration::from_millis(7500),
        "it kept serving for the drain delay (exited after {:?})",
        started.elapsed()
    );
}

/// A second SIGTERM during the drain exits at once (status 130), however long the drain delay.
#[test]
fn a_second_stop_signal_exits_at_once() {
    let (cluster, _workers) = basic_cluster();
    let (serve, addr) = cluster.serve(&["--drain-delay-ms", "60000"]);
    until("ready", || get(addr, "/ready").status == 200);
    serve.signal(libc::SIGTERM);
    until("draining", || get(addr, "/ready").status == 503);
    let started = Instant::now();
    let status = serve.terminate();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "exited after {:?}",
        started.elapsed()
    );
    assert_eq!(status.code(), Some(130), "{status:?}");
}

/// A client that gives up before the first token (a slow prefill) is counted as a disconnect
/// and as a request with status 499, and the worker sees the cancel.
#[test]
fn a_disconnect_before_the_first_token_is_counted() {
    let cluster = Cluster::new();
    // One second per uncached block: the prefill of a long prompt takes seconds.
    let prefill = cluster.worker(
        "prefill",
        1,
        &["--block-cost-us", "1000000", "--print-requests"],
    );
    let _d = cluster.worker("decode", DECODE, &[]);
    let (_serve, addr) = cluster.serve(&[]);
    until("active", || {
        get(addr, "/ready").json()["lifecycle"] == "active"
    });
    let body = chat(&"a long prompt of many words ".repeat(20), 4, true).to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let stream = stalled(addr, head.as_bytes());
    prefill.wait_event("request");
    drop(stream);
    prefill.wait_event("cancelled");
    until("the disconnect counted", || {
        metric(addr, "prefill_router_http_client_disconnects_total") == Some(1.0)
    });
    assert_eq!(
        metric(
            addr,
            r#"prefill_router_http_requests_total{route="chat_completions",status="499"}"#
        ),
        Some(1.0)
    );
    until("in flight back to 0", || in_flight(addr) == Some(0.0));
}

/// A wrong method on a known route: 405 with an OpenAI body and `Allow`, counted; OPTIONS is
/// answered 204 with `Allow`.
#[test]
fn a_wrong_method_is_an_openai_405_with_allow() {
    let (cluster, _workers) = basic_cluster();
    let (_serve, addr) = cluster.serve(&[]);
    for (method, path, allow) in [
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/completions", "POST"),
        ("POST", "/health", "GET"),
        ("DELETE", "/v1/models", "GET"),
    ] {
        let response = request(addr, method, path, None);
        assert_eq!(response.status, 405, "{method} {path}: {response:?}");
        assert!(
            response.header("allow").is_some_and(|a| a.contains(allow)),
            "{method} {path}: {response:?}"
        );
        let error = response.json();
        assert_eq!(error["error"]["code"], "method_not_allowed", "{error}");
        assert_eq!(error["error"]["type"], "invalid_request_error");
        assert!(error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains(method)));
    }
    let options = request(addr, "OPTIONS", "/v1/chat/completions", None);
    assert_eq!(options.status, 204, "{options:?}");
    assert!(options.header("allow").is_some_and(|a| a.contains("POST")));
    assert_eq!(
        metric(
            addr,
            r#"prefill_router_http_requests_total{route="chat_completions",status="405"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(
            addr,
            r#"prefill_router_http_requests_total{route="health",status="405"}"#
        ),
        Some(1.0)
    );
}

/// `stream_options.include_usage` adds a final chunk with `usage` and empty `choices`; token
/// prompts (a list, or a list holding one list) are accepted; several prompts are a clear 400;
/// `max_tokens` out of range is `invalid_max_tokens` with a human message.
#[test]
fn openai_details_usage_chunk_token_prompts_and_max_tokens_range() {
    let (cluster, _workers) = basic_cluster();
    let (_serve, addr) = cluster.serve(&[]);
    until("ready", || get(addr, "/ready").status == 200);

    for path in ["/v1/chat/completions", "/v1/completions"] {
        let mut body = if path.contains("chat") {
            chat("count with me", 3, true)
        } else {
            json!({"model": "m", "prompt": "count with me", "max_tokens": 3, "stream": true})
        };
        body["stream_options"] = json!({"include_usage": true});
        let response = post(addr, path, &body);
        assert_eq!(response.status, 200, "{response:?}");
        let events = response.events();
        assert_eq!(
            events.last().map(String::as_str),
            Some("[DONE]"),
            "{events:?}"
        );
        let chunks: Vec<serde_json::Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        assert_eq!(
            chunks.len(),
            4,
            "3 token chunks and a usage chunk: {chunks:?}"
        );
        let usage = &chunks[3];
        assert_eq!(usage["choices"], json!([]), "{usage}");
        assert_eq!(usage["usage"]["completion_tokens"], 3, "{usage}");
        let prompt = usage["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(prompt > 0);
        assert_eq!(usage["usage"]["total_tokens"], prompt + 3);
        for chunk in &chunks[..3] {
            assert!(chunk["usage"].is_null(), "{chunk}");
        }
        // Without the option there is no usage chunk.
        body["stream_options"] = json!({"include_usage": false});
        let plain = post(addr, path, &body).events();
        assert_eq!(plain.len(), 4, "{plain:?}");
    }

    for prompt in [json!([[1, 2, 3]]), json!([1, 2, 3])] {
        let r = post(
            addr,
            "/v1/completions",
            &json!({"model": "m", "prompt": prompt, "max_tokens": 2}),
        );
        assert_eq!(r.status, 200, "{prompt}: {r:?}");
        assert_eq!(r.json()["usage"]["prompt_tokens"], 3);
    }
    let several = post(
        addr,
        "/v1/completions",
        &json!({"model": "m", "prompt": [[1, 2], [3, 4]], "max_tokens": 2}),
    );
    assert_eq!(several.status, 400);
    assert_eq!(several.json()["error"]["code"], "unsupported_prompt");
    let bad_token = post(
        addr,
        "/v1/completions",
        &json!({"model": "m", "prompt": [1, -2], "max_tokens": 2}),
    );
    assert_eq!(bad_token.status, 400);
    assert_eq!(bad_token.json()["error"]["code"], "invalid_prompt");

    for (path, field, value) in [
        ("/v1/completions", "max_tokens", json!(5_000_000_000u64)),
        ("/v1/completions", "max_tokens", json!(-1)),
        ("/v1/completions", "max_tokens", json!(2.5)),
        (
            "/v1/chat/completions",
            "max_completion_tokens",
            json!(1u64 << 40),
        ),
        ("/v1/chat/completions", "max_tokens", json!("ten")),
    ] {
        let mut body = if path.contains("chat") {
            chat("hi", 1, false)
        } else {
            json!({"model": "m", "prompt": "hi"})
        };
        body.as_object_mut().unwrap().remove("max_tokens");
        body[field] = value.clone();
        let r = post(addr, path, &body);
        assert_eq!(r.status, 400, "{field}={value}: {r:?}");
        let error = r.json();
        assert_eq!(error["error"]["code"], "invalid_max_tokens", "{error}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains(field), "{message}");
        assert!(!message.contains("u32"), "no Rust type names: {message}");
    }
}

/// `worker --session-affinity-ttl-secs` puts the TTL in the card it advertises: sessions stick
/// to their prefill worker (counted as affinity hits) without a card file.
#[test]
fn the_session_affinity_ttl_is_set_from_the_worker_command_line() {
    let cluster = Cluster::new();
    let ttl = ["--session-affinity-ttl-secs", "600"];
    let _p: Vec<Proc> = (1..=3)
        .map(|id| cluster.worker("prefill", id, &ttl))
        .collect();
    let _d = cluster.worker("decode", DECODE, &[]);
    let (_serve, addr) = cluster.serve(&[]);
    until("active", || {
        get(addr, "/ready").json()["lifecycle"] == "active"
    });
    let send = |session: &str, n: u32| {
        let body = chat(
            &format!("turn {n}: {}", "fresh words ".repeat(n as usize)),
            1,
            false,
        )
        .to_string();
        let r = request_with(
            addr,
            "POST",
            "/v1/chat/completions",
            Some(body.as_bytes()),
            &[("x-session-id", session)],
        );
        assert_eq!(r.status, 200, "{r:?}");
        r.header("x-prefill-worker").unwrap().to_owned()
    };
    let first = send("alice", 0);
    for n in 1..6 {
        assert_eq!(
            send("alice", n),
            first,
            "turn {n} left the session's worker"
        );
    }
    let hits: f64 = get(addr, "/metrics")
        .body
        .lines()
        .filter(|l| l.starts_with("prefill_router_affinity_total{") && l.contains("\"hit\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(hits >= 5.0, "affinity hits: {hits}");
}

/// The whole prefill pool dies (SIGKILL, their records stay until the lease expires): under
/// `--fallback decode` every request is still served (through decode: the prefill leg found no
/// reachable worker and follows the policy) and `/ready` stays 200, truthfully; under
/// `--fallback reject` requests get 503 (not 502) and `/ready` turns 503, saying no prefill
/// worker is reachable.
#[test]
fn when_the_whole_prefill_pool_dies_requests_follow_the_fallback_policy() {
    let cluster = Cluster::new();
    // A long lease (the workers' and the frontends' view of it): the dead workers stay in
    // discovery for the whole test, so the hop stays Active over a pool that is all dead.
    let lease = ["--ttl-ms", "60000"];
    let p1 = cluster.worker("prefill", 1, &lease);
    let p2 = cluster.worker("prefill", 2, &lease);
    // Every process reaps records expired by its own TTL: the decode worker's is long too.
    let _d = cluster.worker("decode", DECODE, &lease);
    let (_bypass, bypass) = cluster.serve(&["--fallback", "decode", "--ttl-ms", "60000"]);
    let (_strict, strict) = cluster.serve(&["--fallback", "reject", "--ttl-ms", "60000"]);
    for addr in [bypass, strict] {
        until("active", || {
            get(addr, "/ready").json()["lifecycle"] == "active"
        });
        let r = post(addr, "/v1/chat/completions", &chat("warm up", 2, false));
        assert_eq!(r.status, 200, "{r:?}");
    }
    p1.kill();
    p2.kill();
    for n in 0..8 {
        let r = post(
            bypass,
            "/v1/chat/completions",
            &chat(&format!("after the pool died {n}"), 2, false),
        );
        assert_eq!(r.status, 200, "request {n} under policy decode: {r:?}");
        assert_eq!(
            r.header("x-prefill-worker"),
            Some(DECODE.to_string().as_str()),
            "decode ran the whole request"
        );
        let ready = get(bypass, "/ready");
        assert_eq!(ready.status, 200, "policy decode serves: {ready:?}");
    }
    for n in 0..4 {
        let r = post(
            strict,
            "/v1/chat/completions",
            &chat(&format!("strict after the pool died {n}"), 2, false),
        );
        assert_eq!(r.status, 503, "request {n} under policy reject: {r:?}");
    }
    let ready = get(strict, "/ready");
    assert_eq!(ready.status, 503, "{ready:?}");
    assert_eq!(
        ready.json()["lifecycle"],
        "active",
        "the dead records stay: {ready:?}"
    );
    assert!(
        ready.json()["reason"]
            .as_str()
            .is_some_and(|r| r.contains("no reachable prefill worker")),
        "{ready:?}"
    );
    let metrics = get(bypass, "/metrics").body;
    assert!(
        metrics.lines().any(|l| l
            .starts_with("prefill_router_unreachable_bypassed_total{router=\"prefill\"} ")
            && !l.ends_with(" 0")),
        "{metrics}"
    );
}
