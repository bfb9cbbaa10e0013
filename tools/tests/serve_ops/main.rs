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

#[path = "../frontend/mod.rs"]
mod frontend;
mod keys;
mod openai;
mod pool;
mod shutdown;

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
