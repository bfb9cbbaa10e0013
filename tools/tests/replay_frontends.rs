//! Multi-frontend replay: N independent routers (each its own binding, dispatcher, KV index,
//! bookings and affinity table) over one pool of workers.

use std::time::Duration;

use prefill_router_tools::replay::{run, Policy, PoolEvent, ReplayConfig, Spread, Workload};

fn shared_prefix(requests: usize) -> Vec<prefill_router_tools::replay::TraceRecord> {
    Workload::parse(&format!("shared-prefix:rate=20,requests={requests}"))
        .expect("workload spec")
        .generate()
}

#[test]
fn every_frontend_builds_its_own_binding_and_no_request_is_lost() {
    let trace = shared_prefix(400);
    for frontends in [1, 2, 4] {
        for spread in [Spread::RoundRobin, Spread::Session] {
            let config = ReplayConfig {
                frontends,
                spread,
                ..ReplayConfig::new(Policy::KvEvents)
            };
            let report = run(&config, &trace).expect("runtime");
            assert_eq!((report.requests, report.lost), (400, 0), "{report}");
            assert_eq!(report.bindings_built, frontends as u64, "{report}");
            assert_eq!(report.frontends, frontends, "{report}");
            assert!(report.label().contains("frontends") == (frontends > 1));
        }
    }
}

#[test]
fn a_pool_event_rebuilds_every_frontends_binding_and_loses_nothing() {
    let trace = shared_prefix(300);
    let config = ReplayConfig {
        frontends: 3,
        event: Some(PoolEvent::Retarget {
            at: Duration::from_secs(5),
        }),
        ..ReplayConfig::new(Policy::Kv)
    };
    let report = run(&config, &trace).expect("runtime");
    assert_eq!(report.lost, 0, "{report}");
    assert_eq!(report.bindings_built, 6, "{report}");
}

/// With the workers' KV events, every frontend's index sees every cache: hit rate does not
/// depend on how many frontends share the pool. Without them each frontend knows only its own
/// picks, and the hit rate falls as the frontends multiply (why events exist).
#[test]
fn with_kv_events_the_hit_rate_holds_as_frontends_multiply() {
    let trace = shared_prefix(1_500);
    let hit = |policy, frontends| {
        let config = ReplayConfig {
            frontends,
            cache_blocks: Some(400),
            ..ReplayConfig::new(policy)
        };
        run(&config, &trace).expect("runtime").prefix_hit_rate
    };
    let one = hit(Policy::KvEvents, 1);
    let four = hit(Policy::KvEvents, 4);
    assert!(
        (one - four).abs() < 0.01,
        "kv-events: 1 frontend {one}, 4 frontends {four}"
    );
    let blind_one = hit(Policy::Kv, 1);
    let blind_four = hit(Policy::Kv, 4);
    assert!(
        blind_four <= blind_one + 1e-9,
        "kv: 1 frontend {blind_one}, 4 frontends {blind_four}"
    );
}

/// The workers' load reports let every frontend see the others' work: on a shared prompt,
/// four frontends placing requests independently keep the tail of one frontend; without the
/// reports each frontend sees only its own bookings and they pile onto the same workers.
#[test]
fn with_load_reports_four_frontends_keep_the_tail_of_one() {
    let trace = shared_prefix(3_000);
    let p99 = |frontends, load_reports| {
        let config = ReplayConfig {
            frontends,
            load_reports,
            ..ReplayConfig::new(Policy::KvEvents)
        };
        let report = run(&config, &trace).expect("runtime");
        assert_eq!(report.lost, 0, "{report}");
        report.ttft_ms.p99
    };
    let one = p99(1, true);
    let four = p99(4, true);
    let blind = p99(4, false);
    assert!(
        four <= one * 1.10,
        "1 frontend p99 {one} ms, 4 with reports {four} ms"
    );
    assert!(
        blind > four,
        "4 frontends: with reports {four} ms, without {blind} ms"
    );
}

/// Late reports still count: delayed by 50 ms they keep four frontends' queueing below what
/// the same frontends queue without reports (the rule takes absolute values, newest wins, so a
/// late report is only a slightly older view).
#[test]
fn late_load_reports_still_cut_the_queueing_of_blind_frontends() {
    let trace = shared_prefix(2_000);
    let run_with = |load_reports, delay_ms| {
        let config = ReplayConfig {
            frontends: 4,
            load_reports,
            report_delay: Duration::from_millis(delay_ms),
            ..ReplayConfig::new(Policy::KvEvents)
        };
        run(&config, &trace).expect("runtime")
    };
    let late = run_with(true, 50);
    let blind = run_with(false, 0);
    assert_eq!((late.lost, blind.lost), (0, 0));
    assert!(
        late.queue_ms.p99 < blind.queue_ms.p99 && late.ttft_ms.p99 <= blind.ttft_ms.p99,
        "reports 50 ms late {late}\nno reports {blind}"
    );
}
