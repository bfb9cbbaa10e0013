//! Operations: a rolling restart of every worker under streaming traffic, and mutual TLS on
//! the request plane between the processes.

use super::*;

/// Issue #27 item 2: a rolling restart of every worker (two prefill, two decode) under steady
/// streaming traffic through `serve` fails no request. Each worker gets a replacement, then
/// SIGTERM: it deregisters, tells its frontends it is draining (they route new work to the
/// others without counting a failure), finishes its in-flight streams and exits.
#[test]
fn a_rolling_restart_of_every_worker_under_streaming_traffic_fails_nothing() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let cluster = Cluster::new();
    // 30 tokens at 4 ms: streams of ~120 ms, so every SIGTERM lands on streams in flight.
    let decode = ["--token-interval-us", "4000"];
    let prefill = ["--block-cost-us", "2000"];
    let mut workers = [
        ("prefill", cluster.worker("prefill", 1, &prefill)),
        ("prefill", cluster.worker("prefill", 2, &prefill)),
        ("decode", cluster.worker("decode", DECODE, &decode)),
        ("decode", cluster.worker("decode", DECODE + 1, &decode)),
    ];
    let (_serve, addr) = cluster.serve(&[]);
    until("active", || {
        get(addr, "/ready").json()["lifecycle"] == "active"
    });
    let stop = Arc::new(AtomicBool::new(false));
    let clients = clients_until(6, &stop, move |c, n| {
        let prompt = format!("client {c} request {n}: a prompt of a few words");
        let r = post(addr, "/v1/chat/completions", &chat(&prompt, 30, true));
        let (tokens, done) = r.chat_stream();
        (r.status, tokens, done, r.body)
    });
    std::thread::sleep(Duration::from_millis(500));
    let mut stopped = Vec::new();
    for (next_id, (role, worker)) in (10..).zip(workers.iter_mut()) {
        let role: &str = role;
        let id = if role == "decode" {
            DECODE + next_id
        } else {
            next_id
        };
        let args: &[&str] = if role == "decode" { &decode } else { &prefill };
        let replacement = cluster.worker(role, id, args);
        // Let the frontend see the replacement and send it some traffic.
        std::thread::sleep(Duration::from_millis(400));
        let old = std::mem::replace(worker, replacement);
        let (status, event) = old.stop();
        assert!(status.success(), "{role} worker exits 0: {event}");
        stopped.push(event);
        std::thread::sleep(Duration::from_millis(400));
    }
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    let mut total = 0;
    let mut failed = Vec::new();
    for client in clients {
        for (status, tokens, done, body) in client.join().unwrap() {
            total += 1;
            if status != 200 || tokens != 30 || !done {
                failed.push((status, tokens, done, body));
            }
        }
    }
    eprintln!(
        "rolling restart: {total} streams, {} failed; stops: {stopped:?}",
        failed.len()
    );
    assert!(total >= 50, "steady traffic throughout ({total} streams)");
    assert!(failed.is_empty(), "failed streams: {failed:?}");
    for event in &stopped {
        assert_eq!(
            event["drained"], true,
            "every worker drained in time: {event}"
        );
        assert_eq!(event["cut_connections"], 0, "{event}");
        assert_eq!(event["cancelled"], 0, "no stream was cut: {event}");
    }
    let metrics = get(addr, "/metrics").body;
    eprintln!(
        "{}",
        metrics
            .lines()
            .filter(|l| l.contains("retr") || l.contains("breaker") || l.contains("requests_total"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Mutual TLS on the request plane between processes: workers with `--tls-cert/--tls-key
/// --tls-client-ca`, a frontend with `--tls-ca` and a client certificate answers a chat
/// completion end to end (prefilled on the prefill worker, decoded on the decode worker); a
/// frontend with the right CA but no client certificate, and one without TLS at all, get no
/// work done by any worker and answer an error promptly (their fallback, decode, is refused
/// too), not a hang until the request timeout.
#[test]
fn serve_with_mutual_tls_is_served_and_frontends_without_a_client_certificate_are_not() {
    use certs::{Ca, Validity};
    let cluster = Cluster::new();
    let dir = cluster.dir.path();
    let (worker_ca, frontend_ca) = (Ca::new("workers"), Ca::new("frontends"));
    let worker_ca_file = worker_ca.write(dir, "workers-ca.crt");
    let frontend_ca_file = frontend_ca.write(dir, "frontends-ca.crt");
    let (worker_cert, worker_key) = worker_ca
        .leaf(&["127.0.0.1"], Validity::Current)
        .write(dir, "worker");
    let (frontend_cert, frontend_key) = frontend_ca
        .leaf(&["frontend"], Validity::Current)
        .write(dir, "frontend");
    let path = |p: &std::path::Path| p.to_str().unwrap().to_owned();
    let (worker_ca_file, frontend_ca_file) = (path(&worker_ca_file), path(&frontend_ca_file));
    let (worker_cert, worker_key) = (path(&worker_cert), path(&worker_key));
    let (frontend_cert, frontend_key) = (path(&frontend_cert), path(&frontend_key));
    let worker_tls = [
        "--tls-cert",
        worker_cert.as_str(),
        "--tls-key",
        worker_key.as_str(),
        "--tls-client-ca",
        frontend_ca_file.as_str(),
        "--print-requests",
    ];
    let prefill = cluster.worker("prefill", 1, &worker_tls);
    let decode = cluster.worker("decode", DECODE, &worker_tls);
    assert_eq!(prefill.wait_event("ready")["tls"], true);

    let (_mutual, mutual) = cluster.serve(&[
        "--tls-ca",
        worker_ca_file.as_str(),
        "--tls-cert",
        frontend_cert.as_str(),
        "--tls-key",
        frontend_key.as_str(),
    ]);
    until("active over TLS", || {
        get(mutual, "/ready").json()["lifecycle"] == "active"
    });
    let answered = post(
        mutual,
        "/v1/chat/completions",
        &chat("hello over TLS", 3, true),
    );
    assert_eq!(answered.status, 200, "{answered:?}");
    assert_eq!(
        prefill_worker(&answered),
        1,
        "prefilled on the TLS prefill worker"
    );
    let events = answered.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    assert_eq!(events.len(), 4, "three tokens, then [DONE]: {events:?}");
    let served = (
        prefill.count_events("request"),
        decode.count_events("request"),
    );
    assert_eq!(served, (1, 1), "one prefill and one decode request");

    let (_server_auth_only, no_client_cert) = cluster.serve(&["--tls-ca", worker_ca_file.as_str()]);
    let (_plain, plain) = cluster.serve(&[]);
    for (what, addr) in [("no client certificate", no_client_cert), ("no TLS", plain)] {
        // Discovery shows both workers; only the request plane refuses this frontend.
        until("discovered", || get(addr, "/ready").status == 200);
        let started = Instant::now();
        let refused = post(addr, "/v1/chat/completions", &chat("let me in", 3, false));
        let took = started.elapsed();
        assert!(
            matches!(refused.status, 502 | 503),
            "{what}: {} {:?}",
            refused.status,
            refused.body
        );
        assert!(
            refused.json()["error"]["message"].is_string(),
            "{what}: an OpenAI error body: {refused:?}"
        );
        assert!(
            took < Duration::from_secs(8),
            "{what}: failed only after {took:?} (the request timeout is 10 s)"
        );
    }
    // Neither frontend got any work done by a worker.
    assert_eq!(
        (
            prefill.count_events("request"),
            decode.count_events("request")
        ),
        served
    );
}
