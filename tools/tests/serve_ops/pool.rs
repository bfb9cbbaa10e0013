//! The prefill pool as the frontend sees it: the session-affinity TTL from the worker's command
//! line, and the whole pool dying under each fallback policy.

use super::*;

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
