//! Session affinity across frontends: independent dispatchers (each its own view, table, seed,
//! counters and history) agree on every session's worker when they see the same routable set;
//! a worker leaving moves only its own sessions, one joining takes only the sessions that now
//! rank it first; a busy or failed worker's sessions go to their next rendezvous worker and
//! come back when it has room.

use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use tokio_util::sync::CancellationToken;

use crate::advert::KvRouterConfig;
use crate::discovery::{EndpointId, Instance, InstanceEvent, InstanceId};
use crate::push::{
    rendezvous_first, rendezvous_order, session_key, AffinityOutcome, Dispatcher, PushConfig,
    PushMode, RoutableView,
};
use crate::request::GenerateRequest;

fn instance(id: InstanceId) -> Instance {
    Instance {
        endpoint: EndpointId::new("t", "prefill", "generate"),
        instance_id: id,
        address: std::net::SocketAddr::from(([127, 0, 0, 1], 1)),
    }
}

/// Run `f` inside a tokio runtime (the routable view spawns its event task).
fn in_runtime<T>(f: impl FnOnce() -> T) -> T {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let _enter = runtime.enter();
    f()
}

/// The modes affinity applies in (`Direct` ignores it).
#[derive(Clone, Copy, Debug)]
enum Mode {
    RoundRobin,
    Random,
    Kv,
}

fn mode() -> impl Strategy<Value = Mode> {
    prop_oneof![Just(Mode::RoundRobin), Just(Mode::Random), Just(Mode::Kv)]
}

/// One frontend: a dispatcher over its own view of `workers`, with its own affinity table,
/// counters and seed.
fn frontend(mode: Mode, workers: &[InstanceId], seed: u64, threshold: Option<u64>) -> Dispatcher {
    let view = RoutableView::spawn(
        futures_util::stream::pending(),
        None,
        CancellationToken::new(),
    );
    for &id in workers {
        view.apply(InstanceEvent::Added(instance(id)));
    }
    let mode = match mode {
        Mode::RoundRobin => PushMode::RoundRobin,
        Mode::Random => PushMode::Random,
        Mode::Kv => PushMode::Kv {
            block_size: 4,
            config: KvRouterConfig {
                busy_threshold_tokens: threshold,
                ..KvRouterConfig::default()
            },
        },
    };
    let config = PushConfig {
        seed,
        ..PushConfig::default()
    };
    Dispatcher::new(view, mode, config)
        .with_session_affinity(Some(Duration::from_secs(600)), Arc::default())
}

fn request(session: Option<&str>, tokens: usize) -> GenerateRequest {
    let mut request = GenerateRequest::new((0..tokens as u32).collect(), 1);
    request.session = session.map(str::to_owned);
    request
}

/// Where `d` sends `session` now (the pick's booking released at once).
fn worker_of(d: &Dispatcher, session: &str) -> Result<InstanceId, String> {
    d.select_held(&request(Some(session), 16))
        .map(|p| p.instance().instance_id)
        .map_err(|e| e.to_string())
}

fn pool() -> impl Strategy<Value = Vec<InstanceId>> {
    proptest::collection::btree_set(1..10_000u64, 2..9).prop_map(|s| s.into_iter().collect())
}

fn sessions() -> impl Strategy<Value = Vec<String>> {
    proptest::collection::vec(
        any::<String>().prop_filter("a key", |s| !s.is_empty()),
        1..24,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn two_frontends_with_the_same_routable_set_pick_the_same_worker_for_any_session(
        mode in mode(),
        workers in pool(),
        sessions in sessions(),
        history in proptest::collection::vec((proptest::option::of(0u8..4), 1usize..64), 0..24),
        seeds in (any::<u64>(), any::<u64>()),
    ) {
        in_runtime(|| -> Result<(), TestCaseError> {
            let a = frontend(mode, &workers, seeds.0, None);
            let b = frontend(mode, &workers, seeds.1, None);
            // B has served other traffic first: its counters, index and table differ from A's.
            for (session, tokens) in &history {
                let key = session.map(|s| format!("other-{s}"));
                let _ = b.select_held(&request(key.as_deref(), *tokens));
            }
            for s in &sessions {
                let on_a = worker_of(&a, s).map_err(TestCaseError::fail)?;
                let on_b = worker_of(&b, s).map_err(TestCaseError::fail)?;
                prop_assert_eq!(on_a, on_b, "session {:?}", s);
                prop_assert_eq!(Some(on_a), rendezvous_first(session_key(s), &workers));
            }
            Ok(())
        })?;
    }

    #[test]
    fn removing_a_worker_moves_only_the_sessions_that_were_on_it(
        mode in mode(),
        workers in pool(),
        sessions in sessions(),
        gone in any::<prop::sample::Index>(),
    ) {
        in_runtime(|| -> Result<(), TestCaseError> {
            let d = frontend(mode, &workers, 7, None);
            let gone = workers[gone.index(workers.len())];
            let before: Vec<InstanceId> =
                sessions.iter().map(|s| worker_of(&d, s)).collect::<Result<_, _>>().map_err(TestCaseError::fail)?;
            d.view().apply(InstanceEvent::Removed(gone));
            for (s, &was) in sessions.iter().zip(&before) {
                let now = worker_of(&d, s).map_err(TestCaseError::fail)?;
                if was == gone {
                    // To its second choice, which is where every other frontend sends it too.
                    let order = rendezvous_order(session_key(s), &workers);
                    prop_assert_eq!(now, order[1], "session {:?}", s);
                } else {
                    prop_assert_eq!(now, was, "session {:?} moved off a worker that stayed", s);
                }
            }
            Ok(())
        })?;
    }

    #[test]
    fn adding_a_worker_moves_only_the_sessions_that_now_rank_it_first(
        mode in mode(),
        workers in pool(),
        sessions in sessions(),
        joined in 10_000..20_000u64,
    ) {
        in_runtime(|| -> Result<(), TestCaseError> {
            let d = frontend(mode, &workers, 7, None);
            let before: Vec<InstanceId> =
                sessions.iter().map(|s| worker_of(&d, s)).collect::<Result<_, _>>().map_err(TestCaseError::fail)?;
            d.view().apply(InstanceEvent::Added(instance(joined)));
            let mut grown = workers.clone();
            grown.push(joined);
            for (s, &was) in sessions.iter().zip(&before) {
                let now = worker_of(&d, s).map_err(TestCaseError::fail)?;
                let first = rendezvous_first(session_key(s), &grown);
                if first == Some(joined) {
                    prop_assert_eq!(now, joined, "session {:?}", s);
                } else {
                    prop_assert_eq!(now, was, "session {:?} moved, not to the new worker", s);
                }
            }
            Ok(())
        })?;
    }
}

#[test]
fn about_one_session_in_n_moves_to_a_joining_worker() {
    in_runtime(|| {
        let d = frontend(Mode::RoundRobin, &[1, 2, 3, 4], 7, None);
        let sessions: Vec<String> = (0..2_000).map(|s| format!("conv-{s}")).collect();
        let before: Vec<InstanceId> = sessions.iter().map(|s| worker_of(&d, s).unwrap()).collect();
        d.view().apply(InstanceEvent::Added(instance(5)));
        let moved = sessions
            .iter()
            .zip(&before)
            .filter(|&(s, &was)| worker_of(&d, s).unwrap() != was)
            .count();
        // 1/5 of 2,000 is 400 (binomial standard deviation 18).
        assert!((320..=480).contains(&moved), "{moved} of 2000 moved");
    });
}

#[test]
fn a_busy_worker_spills_its_session_to_the_next_in_order_until_it_has_room() {
    in_runtime(|| {
        let workers = [1, 2, 3];
        let d = frontend(Mode::Kv, &workers, 7, Some(64));
        let order = rendezvous_order(session_key("conv"), &workers);
        // A long prompt of the session books 256 tokens on its worker: over the threshold.
        let held = d.select_held(&request(Some("conv"), 256)).unwrap();
        assert_eq!(held.instance().instance_id, order[0]);
        assert_eq!(held.affinity(), Some(AffinityOutcome::Miss));
        let spilled = d.select_held(&request(Some("conv"), 16)).unwrap();
        assert_eq!(
            spilled.instance().instance_id,
            order[1],
            "the next in its order"
        );
        assert_eq!(spilled.affinity(), Some(AffinityOutcome::Repick));
        drop(spilled);
        drop(held);
        // Room again: back to the first choice, where every other frontend sends it.
        let back = d.select_held(&request(Some("conv"), 16)).unwrap();
        assert_eq!(back.instance().instance_id, order[0]);
        assert_eq!(back.affinity(), Some(AffinityOutcome::Repick));
        drop(back);
        let again = d.select_held(&request(Some("conv"), 16)).unwrap();
        assert_eq!(again.affinity(), Some(AffinityOutcome::Hit));
        let stats = d.affinity_stats();
        assert_eq!((stats.hits, stats.misses, stats.repicks), (1, 1, 2));
    });
}

#[test]
fn a_worker_the_request_failed_on_sends_it_to_the_next_in_order() {
    in_runtime(|| {
        let workers = [11, 12, 13, 14];
        for mode in [Mode::RoundRobin, Mode::Random, Mode::Kv] {
            let d = frontend(mode, &workers, 7, None);
            let order = rendezvous_order(session_key("conv"), &workers);
            let request = request(Some("conv"), 16);
            let retry = d.select_held_excluding(&request, &order[..2]).unwrap();
            assert_eq!(retry.instance().instance_id, order[2], "{mode:?}");
        }
    });
}
