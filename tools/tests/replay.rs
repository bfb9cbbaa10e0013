//! Trace replay: a tiny synthetic trace (always) and the first requests of the Mooncake
//! conversation trace (when the file is there; required when `PREFILL_REQUIRE_TRACE` is set).

use std::path::PathBuf;

use std::time::Duration;

use prefill_router_tools::replay::{
    ceiling, parse_trace, read_trace, run, svg, ClosedLoop, Policy, ReplayConfig, TraceError,
    TraceRecord, Workload,
};

const TRACE: &str = "mooncake_conversation_trace.jsonl";

fn fixture() -> Vec<TraceRecord> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny_trace.jsonl");
    read_trace(&path).expect("fixture parses")
}

/// The real trace: `PREFILL_TRACE`, else `../shared/traces/` beside the repository, else the
/// machine-wide copy. `None` (with a notice) when absent, unless `PREFILL_REQUIRE_TRACE` is set.
fn real_trace() -> Option<Vec<TraceRecord>> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut candidates: Vec<PathBuf> = std::env::var_os("PREFILL_TRACE")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    candidates.push(root.join("../shared/traces").join(TRACE));
    candidates.push(root.join("../../shared/traces").join(TRACE));
    candidates.push(PathBuf::from("/work/shared/traces").join(TRACE));
    match candidates.iter().find(|p| p.is_file()) {
        Some(path) => Some(read_trace(path).expect("the trace parses")),
        None => {
            // The trace is not part of the repository: a clone without it skips this test
            // (the synthetic fixture's tests still run); PREFILL_REQUIRE_TRACE makes it a failure.
            assert!(
                std::env::var_os("PREFILL_REQUIRE_TRACE").is_none(),
                "PREFILL_REQUIRE_TRACE is set but the trace is missing (looked at {candidates:?})"
            );
            eprintln!("NOTICE: {TRACE} not found (set PREFILL_TRACE); skipping the real replay");
            None
        }
    }
}

#[test]
fn tiny_trace_replays_every_policy_without_loss() {
    let trace = fixture();
    assert_eq!(trace.len(), 8);
    let ceiling = ceiling(&trace);
    // 22 blocks; one shared cache hits 0 (x6 after the first), 1, 2 (line 3), 3 (line 4),
    // 1 (line 6), 3, 4, 5 (line 7) and 6 (line 8): 13 of 22.
    assert!((ceiling - 13.0 / 22.0).abs() < 1e-12, "ceiling {ceiling}");
    let mut reports = Vec::new();
    for policy in Policy::ALL {
        let report = run(&ReplayConfig::new(policy), &trace).expect("runtime");
        assert_eq!(report.ttft_cdf_ms.len(), 100, "{report}");
        assert_eq!((report.requests, report.lost), (8, 0), "{report}");
        assert_eq!(report.prompt_blocks, 22, "{report}");
        assert!(report.prefix_hit_rate <= report.ceiling + 1e-12, "{report}");
        assert!(report.ttft_ms.p50 > 0.0, "{report}");
        let json = serde_json::to_value(&report).unwrap();
        for field in [
            "policy",
            "requests",
            "lost",
            "prefix_hit_rate",
            "ceiling",
            "ttft_ms",
        ] {
            assert!(json.get(field).is_some(), "{field} missing in {json}");
        }
        for p in ["p50", "p90", "p99"] {
            assert!(json["ttft_ms"].get(p).is_some());
        }
        for field in ["work_imbalance", "wall_s", "queue_ms", "requests_per_s"] {
            assert!(json.get(field).is_some(), "{field} missing in {json}");
        }
        reports.push(report);
    }
    let picture = svg("tiny <trace>", &reports);
    assert!(picture.starts_with("<svg") && picture.trim_end().ends_with("</svg>"));
    // Per policy one CDF and one hit-rate line, plus the ceiling.
    assert_eq!(picture.matches("<polyline").count(), 2 * reports.len() + 1);
    assert!(picture.contains("tiny &lt;trace&gt;"));
    // One worker with an unbounded cache is the shared cache: it reaches the ceiling.
    let one = ReplayConfig {
        workers: 1,
        ..ReplayConfig::new(Policy::RoundRobin)
    };
    let report = run(&one, &trace).unwrap();
    assert!((report.prefix_hit_rate - ceiling).abs() < 1e-12, "{report}");
}

#[test]
fn trace_errors_name_the_line() {
    let text = "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [0]}\n\
                {\"timestamp\": 1, \"input_length\": \"many\"}\n";
    let error = parse_trace(text.as_bytes()).unwrap_err();
    assert!(matches!(error, TraceError::Parse { line: 2, .. }));
    assert!(error.to_string().contains("line 2"), "{error}");
}

#[test]
fn real_trace_kv_beats_round_robin_below_the_ceiling() {
    let Some(trace) = real_trace() else {
        return;
    };
    let limit = 1_500;
    let kv = run(
        &ReplayConfig {
            limit: Some(limit),
            ..ReplayConfig::new(Policy::Kv)
        },
        &trace,
    )
    .unwrap();
    let rr = run(
        &ReplayConfig {
            limit: Some(limit),
            ..ReplayConfig::new(Policy::RoundRobin)
        },
        &trace,
    )
    .unwrap();
    eprintln!("{kv}\n{rr}");
    for report in [&kv, &rr] {
        assert_eq!(report.requests, limit as u64);
        assert_eq!(report.lost, 0, "{report}");
        assert!(report.prefix_hit_rate <= report.ceiling + 1e-12, "{report}");
    }
    assert!(
        kv.prefix_hit_rate > rr.prefix_hit_rate,
        "kv {kv}\nround robin {rr}"
    );
}

#[test]
fn pool_events_reuse_or_rebuild_the_binding_and_lose_nothing() {
    use prefill_router_tools::replay::PoolEvent;
    use std::time::Duration;

    let trace = fixture();
    let at = Duration::from_millis(25);
    for (event, builds) in [
        (PoolEvent::Retarget { at }, 2),
        (PoolEvent::Flap { at, rebuild: false }, 1),
        (PoolEvent::Flap { at, rebuild: true }, 2),
    ] {
        let config = ReplayConfig {
            event: Some(event),
            ..ReplayConfig::new(Policy::Kv)
        };
        let report = run(&config, &trace).unwrap();
        assert_eq!(report.lost, 0, "{event:?}: {report}");
        assert_eq!(report.bindings_built, builds, "{event:?}: {report}");
        let around = report.event.expect("event window");
        assert_eq!(around.before.requests + around.after.requests, 8);
    }
}

/// With caches small enough that eviction matters, the KV dispatcher fed the workers' events
/// hits within a point of the oracle that reads the caches directly, and no policy beats the
/// oracle by more than noise.
#[test]
fn real_trace_events_hit_within_a_point_of_the_oracle_with_bounded_caches() {
    let Some(trace) = real_trace() else {
        return;
    };
    let report = |policy| {
        run(
            &ReplayConfig {
                limit: Some(3_000),
                cache_blocks: Some(1_000),
                ..ReplayConfig::new(policy)
            },
            &trace,
        )
        .unwrap()
    };
    let (prediction, events, oracle) = (
        report(Policy::Kv),
        report(Policy::KvEvents),
        report(Policy::KvOracle),
    );
    eprintln!("{prediction}\n{events}\n{oracle}");
    for r in [&prediction, &events, &oracle] {
        assert_eq!(r.lost, 0, "{r}");
    }
    assert!(
        (oracle.prefix_hit_rate - events.prefix_hit_rate).abs() <= 0.01,
        "events {events}\noracle {oracle}"
    );
    assert!(prediction.prefix_hit_rate <= oracle.prefix_hit_rate + 0.01);
}

/// The stale-credit oracle of `kv-events`: with every batch delivered at once the index never
/// credits a pick with a block its cache does not hold; with batches late it does, and the
/// oracle sees it (the check bites). A lost batch is noticed at the worker's next batch (the gap
/// rule then drops its entries): hit rate falls, nothing is lost.
#[test]
fn real_trace_events_give_stale_credit_only_when_batches_are_lost_or_late() {
    use std::time::Duration;

    let Some(trace) = real_trace() else {
        return;
    };
    let report = |loss: u64, delay: Duration| {
        run(
            &ReplayConfig {
                limit: Some(2_000),
                cache_blocks: Some(1_000),
                event_loss_every: loss,
                event_delay: delay,
                ..ReplayConfig::new(Policy::KvEvents)
            },
            &trace,
        )
        .unwrap()
    };
    let clean = report(0, Duration::ZERO);
    let late = report(0, Duration::from_secs(20));
    let lossy = report(3, Duration::ZERO);
    eprintln!(
        "clean {clean} stale {}\nlate {late} stale {}\nlossy {lossy} stale {}",
        clean.stale_credit, late.stale_credit, lossy.stale_credit
    );
    assert_eq!(clean.stale_credit, 0, "{clean}");
    assert!(
        late.stale_credit > 0,
        "the oracle sees late batches: {late}"
    );
    for r in [&clean, &late, &lossy] {
        assert_eq!(r.lost, 0, "{r}");
    }
    assert!(
        lossy.prefix_hit_rate <= clean.prefix_hit_rate + 0.01,
        "{lossy}"
    );
}

/// Four conversations of four turns, interleaved, ten seconds apart: turn *t* of
/// conversation *c* repeats the conversation's earlier blocks and adds one. Three round-robin
/// workers scatter the turns; session affinity keeps each conversation on one worker (its
/// rendezvous worker, whatever the TTL).
fn conversations() -> Vec<TraceRecord> {
    let mut lines = String::new();
    for turn in 0..4u64 {
        for conv in 0..4u64 {
            let mut ids = vec![0, 100 * (conv + 1)];
            ids.extend((1..=turn).map(|t| 100 * (conv + 1) + t));
            let at = (turn * 4 + conv) * 10_000;
            lines.push_str(&format!(
                "{{\"timestamp\": {at}, \"input_length\": {}, \"output_length\": 4, \"hash_ids\": {ids:?}}}\n",
                ids.len() * 512
            ));
        }
    }
    parse_trace(lines.as_bytes()).expect("synthetic trace parses")
}

#[test]
fn session_affinity_keeps_every_later_turn_on_its_conversations_worker() {
    use std::time::Duration;

    let trace = conversations();
    let with_ttl = |ttl: Option<Duration>| {
        run(
            &ReplayConfig {
                workers: 3,
                session_affinity: ttl,
                ..ReplayConfig::new(Policy::RoundRobin)
            },
            &trace,
        )
        .unwrap()
    };
    let off = with_ttl(None);
    let on = with_ttl(Some(Duration::from_secs(60)));
    let expired = with_ttl(Some(Duration::from_secs(5)));
    eprintln!("{off}\n{on}\n{expired}");
    for r in [&off, &on, &expired] {
        assert_eq!((r.requests, r.lost), (16, 0), "{r}");
    }
    assert!(off.affinity.is_none());
    let stats = on.affinity.clone().expect("affinity report");
    // The first turn of each conversation is a miss, every later one a hit.
    assert_eq!(
        (stats.hits, stats.misses, stats.repicks),
        (12, 4, 0),
        "{on}"
    );
    // Turn t (t >= 1) then finds its t + 1 earlier blocks; only block 0 can miss.
    assert!(
        on.cached_blocks >= 4 * (2 + 3 + 4),
        "every later turn hits its whole history: {on}"
    );
    assert!(on.prefix_hit_rate > off.prefix_hit_rate, "{on}\n{off}");
    // Turns 40 s apart outlive a 5 s TTL: no hits, every turn a miss, yet every turn goes
    // where it would with a live entry (the session's rendezvous worker), with the same reuse.
    let stats = expired.affinity.clone().expect("affinity report");
    assert_eq!((stats.hits, stats.misses), (0, 16), "{expired}");
    assert_eq!(expired.cached_blocks, on.cached_blocks, "{expired}\n{on}");
    assert!(on.label().ends_with("affinity 60 s"), "{}", on.label());
}

/// On the real trace (a session per conversation), affinity lifts round-robin's hit rate.
#[test]
fn real_trace_affinity_lifts_round_robins_hit_rate() {
    use std::time::Duration;

    let Some(trace) = real_trace() else {
        return;
    };
    let report = |ttl| {
        run(
            &ReplayConfig {
                limit: Some(3_000),
                session_affinity: ttl,
                ..ReplayConfig::new(Policy::RoundRobin)
            },
            &trace,
        )
        .unwrap()
    };
    let (off, on) = (report(None), report(Some(Duration::from_secs(600))));
    eprintln!("{off}\n{on}");
    assert_eq!((off.lost, on.lost), (0, 0));
    let stats = on.affinity.clone().expect("affinity report");
    assert!(stats.hits > 0, "{on}");
    assert_eq!(stats.hits + stats.misses + stats.repicks, 3_000, "{on}");
    assert!(on.prefix_hit_rate > off.prefix_hit_rate, "{on}\n{off}");
}

/// The KV cost on a shared system prompt: never behind round robin on TTFT p99, balanced
/// work, nothing lost (the old `overlap − requests` score sent every request to one worker).
/// The workload of docs/performance.md (3,000 requests): a new prompt's first few requests stay
/// on its first holder while its heat builds (docs/router.md, "KV cost"), a start-up cost that
/// reaches the p99 of a run of a few hundred requests but not of this one.
#[test]
fn a_shared_prompt_is_spread_by_booked_work_and_never_loses_to_round_robin() {
    use prefill_router_tools::replay::Workload;
    for rate in [5.0, 25.0] {
        let trace = Workload::SharedPrefix {
            rate,
            requests: 3_000,
            prefix: 30,
            seed: 3,
        }
        .generate();
        let kv = run(&ReplayConfig::new(Policy::Kv), &trace).expect("runtime");
        let rr = run(&ReplayConfig::new(Policy::RoundRobin), &trace).expect("runtime");
        assert_eq!((kv.lost, kv.shed), (0, 0));
        assert!(
            kv.ttft_ms.p99 <= rr.ttft_ms.p99,
            "{rate}: kv {kv} vs rr {rr}"
        );
        assert!(kv.work_imbalance < 1.2, "{rate}: {kv}");
        assert!(
            kv.prefix_hit_rate >= rr.prefix_hit_rate,
            "{rate}: {kv} vs {rr}"
        );
    }
}

/// Overload (arrivals at about twice the pool's capacity): with a busy threshold every request
/// is either served with a TTFT near the unloaded one or refused with the typed error; without
/// one, everything queues and TTFT grows with the run.
#[test]
fn under_overload_a_busy_threshold_sheds_typed_and_keeps_admitted_ttft_low() {
    use prefill_router_tools::replay::Workload;
    let trace = Workload::SharedPrefix {
        rate: 60.0,
        requests: 1_200,
        prefix: 30,
        seed: 5,
    }
    .generate();
    let mut config = ReplayConfig::new(Policy::KvEvents);
    config.kv.busy_threshold_tokens = Some(8192);
    config.overload_wait = std::time::Duration::from_millis(250);
    let on = run(&config, &trace).expect("runtime");
    let off = run(&ReplayConfig::new(Policy::KvEvents), &trace).expect("runtime");
    assert_eq!(on.lost, 0, "{on}");
    assert!(on.shed > 0, "{on}");
    assert_eq!((off.lost, off.shed), (0, 0), "{off}");
    assert!(on.ttft_ms.p99 * 3.0 < off.ttft_ms.p99, "on {on} off {off}");
}

#[test]
fn a_closed_loop_replay_serves_every_turn_in_order_without_loss() {
    let trace = Workload::parse("multi-tenant:rate=8,requests=400,seed=4")
        .unwrap()
        .generate();
    let mut config = ReplayConfig::new(Policy::Kv);
    config.closed_loop = Some(ClosedLoop {
        users: 8,
        think: Duration::from_millis(500),
    });
    let report = run(&config, &trace).unwrap();
    assert_eq!((report.requests, report.lost, report.shed), (400, 0, 0));
    // Eight users one turn at a time: the run takes longer than the open loop's arrivals.
    assert!(report.virtual_s > 10.0, "{report}");
}

/// Issue #40 end to end in the replay: the same 512-token workload at 16 and at 512 tokens per
/// block (open loop and closed loop, through the real dispatcher with KV events) gives the
/// same report, line for line; the conversation workload keeps its whole ceiling at both.
#[test]
fn the_same_workload_replays_the_same_at_every_block_size() {
    let trace = Workload::parse("multi-tenant:rate=8,requests=600,seed=6")
        .unwrap()
        .generate();
    let at = |block: u32, closed: Option<ClosedLoop>| {
        let mut config = ReplayConfig::new(Policy::KvEvents);
        config.block_tokens = block;
        config.closed_loop = closed;
        let mut report = run(&config, &trace).expect("runtime");
        (report.wall_s, report.requests_per_s, report.block_tokens) = (0.0, 0.0, 0);
        // Block counts in tokens: the same prompts, counted in blocks of another size.
        report.prompt_blocks *= u64::from(block);
        report.cached_blocks *= u64::from(block);
        report
    };
    let closed = Some(ClosedLoop {
        users: 16,
        think: Duration::from_millis(1_000),
    });
    for arrivals in [None, closed] {
        assert_eq!(at(16, arrivals), at(512, arrivals), "{arrivals:?}");
    }
    let chat = Workload::parse("conversation:rate=20,requests=600,seed=6").unwrap();
    for block in [16, 512] {
        let mut config = ReplayConfig::new(Policy::KvEvents);
        (config.block_tokens, config.unit_tokens) = (block, chat.unit_tokens());
        let report = run(&config, &chat.generate()).expect("runtime");
        assert_eq!((report.lost, report.shed), (0, 0), "{report}");
        assert!(report.of_ceiling > 0.99, "block {block}: {report}");
    }
}
