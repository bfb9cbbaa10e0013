//! A frontend that joins late (issue #29's warm start): with the workers' KV snapshots its
//! index knows every cache before its first request; cold, it learns only from the live events
//! published after it joined. The replay runs in paused virtual time, so each configuration
//! gives the same numbers on every run.

use std::time::Duration;

use prefill_router_tools::replay::{
    run, ClosedLoop, Join, JoinError, JoinReport, Policy, PoolEvent, ReplayConfig, ReplayError,
    TraceRecord, Workload,
};

/// 20 tenants' system prompts (Zipf popularity) and 1-8-turn sessions, about 10 req/s.
fn multi_tenant() -> Vec<TraceRecord> {
    Workload::parse("multi-tenant:rate=10,requests=1600,tenants=20")
        .expect("workload spec")
        .generate()
}

const JOIN_AT: Duration = Duration::from_secs(100);

fn config(policy: Policy, snapshot: bool) -> ReplayConfig {
    ReplayConfig {
        frontends: 4,
        join: Some(Join {
            at: JOIN_AT,
            snapshot,
        }),
        ..ReplayConfig::new(policy)
    }
}

fn joined(trace: &[TraceRecord], snapshot: bool) -> JoinReport {
    let report = run(&config(Policy::KvEvents, snapshot), trace).expect("replay");
    assert_eq!(report.lost, 0, "{report}");
    report.join.expect("a join report")
}

/// The joiner's windows cover exactly its requests, start at the join, and it got a quarter of
/// the requests that arrived after it (round robin over 4 frontends).
#[test]
fn the_joiner_gets_its_share_from_the_join_on_and_its_windows_cover_it() {
    let trace = multi_tenant();
    let join = joined(&trace, true);
    let after = trace
        .iter()
        .filter(|r| Duration::from_millis(r.timestamp) >= JOIN_AT)
        .count() as u64;
    assert!(
        join.requests.abs_diff(after / 4) <= 1,
        "{} of {after} requests after the join",
        join.requests
    );
    assert_eq!(join.windows[0].first, 1);
    assert_eq!(join.windows.last().map(|w| w.last), Some(join.requests));
    for pair in join.windows.windows(2) {
        assert_eq!(pair[1].first, pair[0].last + 1, "{join:?}");
    }
    assert!(join.windows[0].from_s >= JOIN_AT.as_secs_f64(), "{join:?}");
    assert!(join.windows.iter().all(|w| w.long_running_requests > 0));
}

/// With the snapshot the joiner's first 25 requests already get the long-running frontends'
/// hit rate (within 2 points); cold, they get at least 10 points less: it does not know the
/// prefixes the workers held before it joined.
#[test]
fn with_the_snapshot_the_first_requests_get_cache_credit_and_cold_they_do_not() {
    let trace = multi_tenant();
    let warm = joined(&trace, true);
    let cold = joined(&trace, false);
    let (w, c) = (&warm.windows[0], &cold.windows[0]);
    assert!(
        w.joined_hit_rate >= w.long_running_hit_rate - 0.02,
        "with the snapshot, first window: {w:?}"
    );
    assert_eq!(warm.requests_to_match, Some(25), "{warm:?}");
    assert!(
        c.joined_hit_rate <= c.long_running_hit_rate - 0.10,
        "cold, first window: {c:?}"
    );
    assert!(
        c.joined_hit_rate <= w.joined_hit_rate - 0.10,
        "first window cold {c:?}, with the snapshot {w:?}"
    );
    assert!(warm.snapshot && !cold.snapshot);
}

/// A join the trace cannot have is refused with a typed error before anything runs.
#[test]
fn bad_joins_are_typed_errors() {
    let trace = multi_tenant();
    let join_error = |config: &ReplayConfig| match run(config, &trace) {
        Err(ReplayError::Join(error)) => error,
        Err(other) => panic!("not a join error: {other}"),
        Ok(report) => panic!("accepted: {report}"),
    };
    let one = ReplayConfig {
        frontends: 1,
        ..config(Policy::KvEvents, true)
    };
    assert_eq!(
        join_error(&one),
        JoinError::NeedsTwoFrontends { frontends: 1 }
    );
    let last = trace.iter().map(|r| r.timestamp).max().unwrap_or(0);
    let late = ReplayConfig {
        join: Some(Join {
            at: Duration::from_millis(last),
            snapshot: true,
        }),
        ..config(Policy::KvEvents, true)
    };
    assert!(matches!(join_error(&late), JoinError::AfterTrace { .. }));
    // A limit shortens the trace the join must fall in.
    let limited = ReplayConfig {
        limit: Some(10),
        ..config(Policy::KvEvents, true)
    };
    assert!(matches!(join_error(&limited), JoinError::AfterTrace { .. }));
    assert_eq!(
        join_error(&config(Policy::Kv, true)),
        JoinError::SnapshotNeedsKvEvents { policy: "kv" }
    );
    let closed = ReplayConfig {
        closed_loop: Some(ClosedLoop {
            users: 4,
            think: Duration::from_secs(1),
        }),
        ..config(Policy::KvEvents, false)
    };
    assert_eq!(join_error(&closed), JoinError::ClosedLoop);
    let event = ReplayConfig {
        event: Some(PoolEvent::Retarget {
            at: Duration::from_secs(10),
        }),
        ..config(Policy::KvEvents, false)
    };
    assert_eq!(join_error(&event), JoinError::PoolEvent);
    // The error names what to change.
    assert!(join_error(&one)
        .to_string()
        .contains("at least 2 frontends"));
}

/// A cold join under a policy without KV events runs (there is nothing to snapshot), and a
/// replay without a join reports none.
#[test]
fn a_cold_join_runs_under_any_policy_and_no_join_reports_none() {
    let trace: Vec<TraceRecord> = multi_tenant().into_iter().take(600).collect();
    let report = run(&config(Policy::RoundRobin, false), &trace).expect("replay");
    assert_eq!(report.lost, 0, "{report}");
    assert!(report.join.is_some_and(|j| j.requests > 0 && !j.snapshot));
    let plain = run(
        &ReplayConfig {
            frontends: 4,
            ..ReplayConfig::new(Policy::KvEvents)
        },
        &trace,
    )
    .expect("replay");
    assert!(plain.join.is_none());
}
