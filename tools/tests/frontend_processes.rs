//! `prefill-router serve` and `worker` as separate processes on a file store, checked over
//! HTTP: the OpenAI surface, a client disconnect mid-stream, a SIGKILLed prefill worker under
//! traffic, the fallback policies when every prefill worker leaves, and mutual TLS on the
//! request plane between them.

// Certificates made at test time, shared with the library's request-plane tests.
#[path = "../../tests/request_plane/certs.rs"]
mod certs;
mod frontend;

use std::time::{Duration, Instant};

use frontend::*;
use serde_json::json;

const DECODE: u64 = 100;

fn chat(content: &str, max_tokens: u32, stream: bool) -> serde_json::Value {
    json!({
        "model": "mock-llm",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
}

/// Write a prefill card (`mock-llm`, 16-token blocks) with `router_config` into the cluster's
/// directory; its path, for `worker --card`.
fn prefill_card(cluster: &Cluster, router_config: serde_json::Value) -> String {
    let card = cluster.dir.path().join("prefill-card.json");
    let body =
        json!({"name": "mock-llm", "kv_cache_block_size": 16, "router_config": router_config});
    std::fs::write(&card, body.to_string()).unwrap();
    card.to_str().unwrap().to_owned()
}

fn prefill_worker(response: &Response) -> u64 {
    response
        .header("x-prefill-worker")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no x-prefill-worker header: {response:?}"))
}

#[test]
fn serve_answers_openai_requests_through_worker_processes() {
    let cluster = Cluster::new();
    let _p1 = cluster.worker("prefill", 1, &[]);
    let _p2 = cluster.worker("prefill", 2, &[]);
    let _d = cluster.worker("decode", DECODE, &[]);
    let (_serve, addr) = cluster.serve(&["--body-limit", "4096"]);
    until("ready", || get(addr, "/ready").status == 200);
    assert_eq!(get(addr, "/health").status, 200);

    let models = get(addr, "/v1/models").json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "mock-llm");

    let completion = post(
        addr,
        "/v1/completions",
        &json!({"model": "mock-llm", "prompt": "Say hello", "max_tokens": 5}),
    );
    assert_eq!(completion.status, 200, "{completion:?}");
    assert!(matches!(prefill_worker(&completion), 1 | 2), "prefilled");
    let body = completion.json();
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["usage"]["completion_tokens"], 5);
    assert_eq!(body["choices"][0]["finish_reason"], "length");

    let streamed = post(addr, "/v1/chat/completions", &chat("Hi there", 4, true));
    assert_eq!(streamed.status, 200);
    assert!(streamed
        .header("content-type")
        .is_some_and(|v| v.starts_with("text/event-stream")));
    let events = streamed.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let chunks: Vec<serde_json::Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks.len(), 4, "one chunk per token");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], "length");

    // Malformed bodies are 400s with OpenAI error JSON, never a dropped connection.
    for (path, bad) in [
        ("/v1/chat/completions", &b"{\"model\": "[..]),
        ("/v1/chat/completions", &b"{\"model\": \"m\"}"[..]),
        ("/v1/completions", &b"[1, 2]"[..]),
        ("/v1/completions", &b"{\"model\": \"m\", \"prompt\": 7}"[..]),
        (
            "/v1/completions",
            &b"{\"model\": \"m\", \"prompt\": \"x\", \"max_tokens\": 0}"[..],
        ),
    ] {
        let response = request(addr, "POST", path, Some(bad));
        assert_eq!(
            response.status,
            400,
            "{path} {:?}",
            String::from_utf8_lossy(bad)
        );
        assert_eq!(response.json()["error"]["type"], "invalid_request_error");
    }
    let huge = json!({"model": "m", "prompt": "word ".repeat(2000)});
    let response = post(addr, "/v1/completions", &huge);
    assert_eq!(response.status, 413, "{response:?}");
    assert_eq!(response.json()["error"]["code"], "body_too_large");
    assert_eq!(get(addr, "/nowhere").status, 404);

    let metrics = get(addr, "/metrics").body;
    assert!(
        metrics.contains("prefill_router_prefilled_total"),
        "{metrics}"
    );
    assert!(
        metrics
            .contains(r#"prefill_router_http_requests_total{route="completions",status="413"} 1"#),
        "{metrics}"
    );
}

#[test]
fn a_client_disconnect_mid_stream_cancels_the_request_at_the_decode_worker() {
    let cluster = Cluster::new();
    let _p1 = cluster.worker("prefill", 1, &[]);
    let decode = cluster.worker("decode", DECODE, &["--token-interval-us", "5000"]);
    let (_serve, addr) = cluster.serve(&[]);
    until("ready and active", || {
        get(addr, "/ready").json()["lifecycle"] == "active"
    });
    assert_eq!(decode.count_events("cancelled"), 0);
    // 2000 tokens at 5 ms: 10 s if nobody cancels it.
    let read = stream_then_disconnect(addr, "/v1/chat/completions", &chat("long", 2000, true), 3);
    assert!(read >= 3);
    let cancelled = decode.wait_event("cancelled");
    assert_eq!(cancelled["id"], DECODE);
    until("the disconnect counted", || {
        get(addr, "/metrics")
            .body
            .contains("prefill_router_http_client_disconnects_total 1")
    });
}

#[test]
fn a_killed_prefill_worker_fails_its_requests_typed_and_later_ones_use_the_survivor() {
    let cluster = Cluster::new();
    // Slow prefills (150 ms per uncached block) so requests are in flight when worker 1 dies.
    let slow = ["--block-cost-us", "150000", "--print-requests"];
    let p1 = cluster.worker("prefill", 1, &slow);
    let _p2 = cluster.worker("prefill", 2, &slow);
    let _d = cluster.worker("decode", DECODE, &[]);
    let (_serve, addr) = cluster.serve(&["--request-timeout-ms", "8000"]);
    until("active", || {
        get(addr, "/ready").json()["lifecycle"] == "active"
    });

    // Distinct prompts of 64 words (4 uncached blocks: 600 ms per prefill).
    let prompt = |n: usize| {
        (0..64)
            .map(|i| format!("w{n}x{i}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let started = Instant::now();
    let traffic: Vec<_> = (0..8)
        .map(|n| {
            let body = json!({"model": "m", "prompt": prompt(n), "max_tokens": 2});
            std::thread::spawn(move || {
                let t = Instant::now();
                let r = post(addr, "/v1/completions", &body);
                (r, t.elapsed())
            })
        })
        .collect();
    // Kill worker 1 once a request of the traffic is running on it.
    p1.wait_event("request");
    p1.kill();
    // The 8 requests spread over both workers (KV routing balances load on cold caches).
    let mut failed = 0;
    let mut seen = Vec::new();
    for handle in traffic {
        let (response, took) = handle.join().unwrap();
        seen.push((
            response.status,
            response.header("x-prefill-worker").map(str::to_owned),
            took,
        ));
        assert!(took < Duration::from_secs(9), "no request hangs ({took:?})");
        match response.status {
            200 => {
                eprintln!("200 from {} in {took:?}", prefill_worker(&response));
                assert!(matches!(prefill_worker(&response), 1 | 2));
            }
            502 | 503 => {
                failed += 1;
                let error = response.json();
                assert!(error["error"]["code"].is_string(), "typed error: {error}");
            }
            other => panic!("unexpected status {other}: {response:?}"),
        }
    }
    assert!(started.elapsed() < Duration::from_secs(15));
    // After the failure, requests go to the survivor (its breaker or its lease took 1 out).
    for n in 100..110 {
        let response = post(
            addr,
            "/v1/completions",
            &json!({"model": "m", "prompt": prompt(n), "max_tokens": 2}),
        );
        assert_eq!(response.status, 200, "after the kill: {response:?}");
        assert_eq!(prefill_worker(&response), 2, "routed to the survivor");
    }
    // Typically some requests were in flight on worker 1 and failed above (typed); how many
    // depends on scheduling, so it is reported, not asserted.
    eprintln!("requests failed by the kill: {failed} of 8: {seen:?}");
}

#[test]
fn without_prefill_workers_requests_bypass_or_get_503_per_policy_and_ready_follows() {
    let cluster = Cluster::new();
    let p1 = cluster.worker("prefill", 1, &[]);
    let _d = cluster.worker("decode", DECODE, &[]);
    let (_bypass, bypass) = cluster.serve(&["--fallback", "decode"]);
    let (_strict, strict) = cluster.serve(&["--fallback", "reject"]);
    for addr in [bypass, strict] {
        until("active", || {
            get(addr, "/ready").json()["lifecycle"] == "active"
        });
        let r = post(addr, "/v1/chat/completions", &chat("hello", 2, false));
        assert_eq!((r.status, prefill_worker(&r)), (200, 1));
    }

    let status = p1.terminate();
    assert!(
        status.success(),
        "the worker deregisters and exits 0 on SIGTERM"
    );
    until("strict frontend not ready", || {
        get(strict, "/ready").status == 503
    });
    let not_ready = get(strict, "/ready").json();
    assert_eq!(not_ready["ready"], false);
    assert!(not_ready["reason"]
        .as_str()
        .is_some_and(|r| r.contains("prefill not active")));
    let rejected = post(strict, "/v1/chat/completions", &chat("hello", 2, false));
    assert_eq!(rejected.status, 503);
    assert_eq!(rejected.json()["error"]["code"], "prefill_not_active");

    until("bypass frontend unavailable", || {
        get(bypass, "/ready").json()["lifecycle"] == "unavailable"
    });
    assert_eq!(get(bypass, "/ready").status, 200, "bypass keeps serving");
    let bypassed = post(bypass, "/v1/chat/completions", &chat("hello", 2, false));
    assert_eq!(bypassed.status, 200);
    assert_eq!(
        prefill_worker(&bypassed),
        DECODE,
        "decode prefilled locally"
    );

    // A prefill worker returns: both frontends route through it again.
    let _p3 = cluster.worker("prefill", 3, &[]);
    for addr in [bypass, strict] {
        until("ready again", || {
            get(addr, "/ready").json()["lifecycle"] == "active"
        });
        let r = post(addr, "/v1/chat/completions", &chat("hello", 2, false));
        assert_eq!((r.status, prefill_worker(&r)), (200, 3));
    }
}

/// Scale-out on a real distributed store: two frontends on one etcd reach Active on the same
/// generation; one is SIGKILLed, the other keeps serving without an error.
#[cfg(feature = "etcd")]
#[test]
fn etcd_two_serves_share_a_generation_and_one_survives_the_others_kill() {
    let Some(cluster) = Cluster::on_etcd() else {
        return;
    };
    let _p1 = cluster.worker("prefill", 1, &[]);
    let _p2 = cluster.worker("prefill", 2, &[]);
    let _d = cluster.worker("decode", DECODE, &[]);
    let (a, a_addr) = cluster.serve(&[]);
    let (_b, b_addr) = cluster.serve(&[]);
    let mut targets = Vec::new();
    for addr in [a_addr, b_addr] {
        until("active", || {
            get(addr, "/ready").json()["lifecycle"] == "active"
        });
        targets.push(get(addr, "/ready").json()["target"].clone());
    }
    assert!(targets[0].is_string(), "{targets:?}");
    assert_eq!(
        targets[0], targets[1],
        "both frontends on the same generation"
    );
    for addr in [a_addr, b_addr] {
        let r = post(
            addr,
            "/v1/completions",
            &json!({"model": "m", "prompt": "hi", "max_tokens": 2}),
        );
        assert_eq!(r.status, 200);
    }
    a.kill();
    for n in 0..20 {
        let r = post(
            b_addr,
            "/v1/completions",
            &json!({"model": "m", "prompt": format!("after the kill {n}"), "max_tokens": 2}),
        );
        assert_eq!(r.status, 200, "the survivor serves: {r:?}");
        assert!(matches!(prefill_worker(&r), 1 | 2));
    }
    assert_eq!(get(b_addr, "/ready").json()["target"], targets[0]);
}

/// Session affinity end to end: prefill workers whose card asks for round-robin routing with a
/// 600 s session TTL; requests carrying `x-session-id` stay on their session's worker while
/// requests without one rotate; when that worker leaves, the session's next request re-picks
/// among the others and sticks to its new worker. The frontend's metrics count it all.
#[test]
fn sessions_stay_on_their_prefill_worker_until_it_leaves() {
    let cluster = Cluster::new();
    let card = prefill_card(
        &cluster,
        json!({"router_mode": "round-robin", "session_affinity_ttl_secs": 600}),
    );
    let mut prefill: Vec<(u64, Proc)> = (1..=3)
        .map(|id| (id, cluster.worker("prefill", id, &["--card", &card])))
        .collect();
    let _d = cluster.worker("decode", DECODE, &[]);
    let (_serve, addr) = cluster.serve(&[]);
    until("three prefill workers routable", || {
        let mut seen: Vec<u64> = (0..6)
            .filter_map(|_| {
                let r = post(addr, "/v1/chat/completions", &chat("warm up", 1, false));
                (r.status == 200).then(|| prefill_worker(&r))
            })
            .collect();
        seen.sort_unstable();
        seen.dedup();
        seen == [1, 2, 3]
    });
    let send = |session: &str, n: u32| {
        let body = chat(&format!("turn {n} of {session}"), 2, false).to_string();
        let r = request_with(
            addr,
            "POST",
            "/v1/chat/completions",
            Some(body.as_bytes()),
            &[("x-session-id", session)],
        );
        assert_eq!(r.status, 200, "{session} turn {n}: {r:?}");
        prefill_worker(&r)
    };
    let sessions = ["alice", "bob", "carol", "dave"];
    let first: Vec<u64> = sessions.iter().map(|s| send(s, 0)).collect();
    for n in 1..6 {
        for (s, &w) in sessions.iter().zip(&first) {
            assert_eq!(send(s, n), w, "{s} turn {n} left its worker");
        }
    }
    // Without a session, round robin still rotates.
    let mut anonymous: Vec<u64> = (0..6)
        .map(|n| {
            let r = post(
                addr,
                "/v1/chat/completions",
                &chat(&format!("anon {n}"), 1, false),
            );
            assert_eq!(r.status, 200);
            prefill_worker(&r)
        })
        .collect();
    anonymous.sort_unstable();
    anonymous.dedup();
    assert_eq!(anonymous, [1, 2, 3], "requests without a session rotate");

    // Alice's worker leaves (SIGTERM: it deregisters); her next turn moves and then sticks.
    let gone = first[0];
    let at = prefill.iter().position(|(id, _)| *id == gone).unwrap();
    let (_, proc) = prefill.remove(at);
    assert!(proc.terminate().success());
    let mut moved = None;
    until("alice re-picked off the departed worker", || {
        let w = send("alice", 100);
        moved = Some(w);
        w != gone
    });
    let moved = moved.unwrap();
    for n in 101..105 {
        assert_eq!(send("alice", n), moved, "alice sticks to her new worker");
    }
    let metrics = get(addr, "/metrics").body;
    let value = |outcome: &str| -> u64 {
        metrics
            .lines()
            .filter(|l| {
                l.starts_with("prefill_router_affinity_total{")
                    && l.contains(&format!("outcome=\"{outcome}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    assert!(value("miss") >= 4, "one miss per new session: {metrics}");
    assert!(
        value("hit") >= 4 * 5 + 4,
        "every later turn a hit: {metrics}"
    );
    assert!(value("repick") >= 1, "alice's move is a re-pick: {metrics}");
}

/// Overload end to end: one prefill worker whose card asks for KV routing with a busy
/// threshold of one token, and a slow prefill (1 s per block). While a long prompt is
/// prefilling, a second request finds every worker busy, waits the dispatcher's overload wait
/// (2 s) and gets 503 with `Retry-After` and an OpenAI error body; once the first prefill
/// ended, the next request is served (no overload state outlives the pressure).
#[test]
fn an_overloaded_prefill_pool_answers_503_with_retry_after_and_recovers() {
    let cluster = Cluster::new();
    let card = prefill_card(
        &cluster,
        json!({"router_mode": "kv", "kv_router_config": {"busy_threshold_tokens": 1}}),
    );
    let _p = cluster.worker(
        "prefill",
        1,
        &["--card", &card, "--block-cost-us", "1000000"],
    );
    let _d = cluster.worker("decode", DECODE, &[]);
    let (_serve, addr) = cluster.serve(&[]);
    until("ready", || get(addr, "/ready").status == 200);
    let long = "a long prompt that fills several blocks of sixteen tokens each ".repeat(4);
    let first =
        std::thread::spawn(move || post(addr, "/v1/chat/completions", &chat(&long, 1, false)));
    // Let the first request reach its (slow) prefill.
    std::thread::sleep(Duration::from_millis(500));
    let started = Instant::now();
    let shed = post(
        addr,
        "/v1/chat/completions",
        &chat("a second request", 1, false),
    );
    assert_eq!(shed.status, 503, "{shed:?}");
    assert_eq!(shed.header("retry-after"), Some("1"), "{shed:?}");
    let body = shed.json();
    assert_eq!(body["error"]["code"], "overloaded", "{body}");
    assert_eq!(body["error"]["type"], "service_unavailable");
    assert!(
        started.elapsed() >= Duration::from_millis(1_500),
        "it waited for room first"
    );
    let first = first.join().expect("first request");
    assert_eq!(first.status, 200, "the long request was served: {first:?}");
    let after = post(
        addr,
        "/v1/chat/completions",
        &chat("after the pressure", 1, false),
    );
    assert_eq!(
        after.status, 200,
        "served once the pool has room: {after:?}"
    );
    // The frontend's metrics count the overload, and nothing stays booked.
    let metrics = get(addr, "/metrics").body;
    let value = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .map(str::to_owned)
    };
    assert_eq!(
        value("prefill_router_overload_shed_total").as_deref(),
        Some("1"),
        "{metrics}"
    );
    assert_eq!(
        value("prefill_router_overload_queued_total").as_deref(),
        Some("1"),
        "{metrics}"
    );
    assert_eq!(
        value("prefill_router_prefill_booked_tokens").as_deref(),
        Some("0"),
        "{metrics}"
    );
    assert_eq!(
        value("prefill_router_overload_waiting").as_deref(),
        Some("0"),
        "{metrics}"
    );
}

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
    let clients: Vec<_> = (0..6)
        .map(|c| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut outcomes = Vec::new();
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let prompt = format!("client {c} request {n}: a prompt of a few words");
                    let r = post(addr, "/v1/chat/completions", &chat(&prompt, 30, true));
                    let events = r.events();
                    let tokens = events
                        .iter()
                        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
                        .filter(|c| c["choices"][0]["delta"]["content"].is_string())
                        .count();
                    let done = events.last().map(String::as_str) == Some("[DONE]");
                    outcomes.push((r.status, tokens, done, r.body.clone()));
                }
                outcomes
            })
        })
        .collect();
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

/// Issue #27 item 8: every process is given the whole three-member etcd cluster
/// (`--discovery etcd://a:1,b:2,c:3`). The member they all start on is killed for good under
/// streaming traffic: no request fails, and no worker's lease is lost (a watcher on the other
/// members sees no worker removed). Needs `.ci/etcd-cluster.sh` (`PREFILL_ETCD_CLUSTER`,
/// `PREFILL_ETCD_CLUSTER_DIR`); the member is started again at the end.
#[cfg(feature = "etcd")]
#[test]
fn three_member_store_a_member_lost_for_good_fails_no_request_and_loses_no_lease() {
    use prefill_router::discovery::{
        Discovery, EndpointId, EtcdConfig, EtcdDiscovery, InstanceEvent,
    };
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let urls = std::env::var("PREFILL_ETCD_CLUSTER").unwrap_or_default();
    let dir = std::env::var("PREFILL_ETCD_CLUSTER_DIR").unwrap_or_default();
    if urls.is_empty() || dir.is_empty() {
        assert!(
            std::env::var_os("CI").is_none(),
            "PREFILL_ETCD_CLUSTER is not set in CI: source .ci/etcd-cluster.sh in .ci/run"
        );
        eprintln!("NOTICE: PREFILL_ETCD_CLUSTER unset; skipping the member-list process test");
        return;
    }
    let urls: Vec<String> = urls.split(',').map(str::to_owned).collect();
    assert_eq!(urls.len(), 3);
    let dir = std::path::PathBuf::from(dir);
    let cluster = Cluster::on_etcd_members(&urls);
    let root = cluster.etcd_root().unwrap().to_owned();

    // A watcher on the members that survive: a lost lease deletes the worker's record.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let removed = Arc::new(std::sync::Mutex::new(Vec::new()));
    let watcher = runtime.block_on(async {
        let config = EtcdConfig::new(urls[1..].to_vec()).with_root(root.clone());
        EtcdDiscovery::connect(config).await.unwrap()
    });
    for component in ["prefill", "decode"] {
        let endpoint = EndpointId::new(&cluster.namespace, component, "generate");
        let mut watch = runtime.block_on(watcher.watch(&endpoint)).unwrap();
        let removed = Arc::clone(&removed);
        runtime.spawn(async move {
            use futures::StreamExt;
            while let Some(event) = watch.next().await {
                if let InstanceEvent::Removed(id) = event {
                    removed.lock().unwrap().push(id);
                }
            }
        });
    }

    let _p1 = cluster.worker("prefill", 1, &[]);
    let _p2 = cluster.worker("prefill", 2, &[]);
    let _d = cluster.worker("decode", DECODE, &["--token-interval-us", "4000"]);
    let (_serve, addr) = cluster.serve(&[]);
    until("active", || {
        get(addr, "/ready").json()["lifecycle"] == "active"
    });
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..4)
        .map(|c| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut outcomes = Vec::new();
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let prompt = format!("client {c} request {n}");
                    let r = post(addr, "/v1/chat/completions", &chat(&prompt, 20, true));
                    let done = r.events().last().map(String::as_str) == Some("[DONE]");
                    outcomes.push((r.status, done, r.body));
                }
                outcomes
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(800));
    // Member 0: first in every process's list, so the one they all use.
    let pid: i32 = std::fs::read_to_string(dir.join("pid-0"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // SAFETY: kill(2) on the member process the cluster script started.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
    let killed = Instant::now();
    // Three lease TTLs (2 s each) without the member.
    std::thread::sleep(Duration::from_secs(6));
    stop.store(true, Ordering::Relaxed);
    let mut total = 0;
    let mut failed = Vec::new();
    for client in clients {
        for (status, done, body) in client.join().unwrap() {
            total += 1;
            if status != 200 || !done {
                failed.push((status, body));
            }
        }
    }
    let removed = removed.lock().unwrap().clone();
    // Bring the member back for whatever runs next on this cluster.
    let restarted = std::process::Command::new("bash")
        .arg(dir.join("start-0.sh"))
        .status()
        .is_ok_and(|s| s.success());
    eprintln!(
        "member lost for good: {total} streams, {} failed, {:?} without it; removed: {removed:?}",
        failed.len(),
        killed.elapsed()
    );
    assert!(restarted, "member 0 restarts");
    assert!(total >= 20, "steady traffic ({total} streams)");
    assert!(failed.is_empty(), "failed: {failed:?}");
    assert!(removed.is_empty(), "a lease was lost: {removed:?}");
    // Every worker is still listed, on the surviving members.
    for (component, count) in [("prefill", 2), ("decode", 1)] {
        let endpoint = EndpointId::new(&cluster.namespace, component, "generate");
        let listed = runtime.block_on(watcher.list_instances(&endpoint)).unwrap();
        assert_eq!(listed.len(), count, "{component}: {listed:?}");
    }
}

/// #27 item 11, seen end to end: with one shared system prompt, KV routing over worker
/// processes once sent none of ~9,800 requests to one of three prefill workers (a long cached
/// prefix outweighed any queue). The prompt is hot, so its requests spread by load and by the
/// work recently placed: every worker serves a fair part of them, one request at a time (the
/// low rate at which bookings are always empty) and in concurrent bursts. (A sticky cost,
/// overlap weight 8 with neither heat nor recent work, fails it: one worker takes them all.)
#[test]
fn a_shared_system_prompt_under_kv_routing_reaches_every_prefill_worker() {
    let cluster = Cluster::new();
    let card = prefill_card(&cluster, json!({"router_mode": "kv"}));
    let _prefill: Vec<Proc> = (1..=3)
        .map(|id| cluster.worker("prefill", id, &["--card", &card]))
        .collect();
    let _d = cluster.worker("decode", DECODE, &[]);
    let (_serve, addr) = cluster.serve(&[]);
    let system = "You are a careful assistant for a large company. ".repeat(40);
    let ask = |n: usize| {
        let body = json!({
            "model": "mock-llm",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": format!("question number {n}")},
            ],
            "max_tokens": 1,
        });
        let r = post(addr, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "request {n}: {r:?}");
        prefill_worker(&r)
    };
    until("three prefill workers routable", || {
        let mut seen: Vec<u64> = (0..12).map(|n| ask(10_000 + n)).collect();
        seen.sort_unstable();
        seen.dedup();
        seen == [1, 2, 3]
    });
    let mut served = [0usize; 4];
    for n in 0..60 {
        served[usize::try_from(ask(n)).unwrap_or(0).min(3)] += 1;
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|t| {
                s.spawn(move || {
                    (0..15)
                        .map(|n| ask(1_000 * (t + 1) + n))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for h in handles {
            for w in h.join().unwrap() {
                served[usize::try_from(w).unwrap_or(0).min(3)] += 1;
            }
        }
    });
    // 120 requests over 3 workers: a fair share is 40; none may be starved.
    assert_eq!(served[0], 0, "{served:?}");
    for w in 1..=3 {
        assert!(
            served[w] >= 20,
            "worker {w} served {} of 120: {served:?}",
            served[w]
        );
    }
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
