//! Stopping: SIGTERM within its bound despite stalled clients, the drain delay (`/ready` 503
//! while requests are still served), and a second stop signal.

use super::*;

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
