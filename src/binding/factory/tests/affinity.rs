//! Session affinity over event sequences, through the factory's own dispatcher construction:
//! requests with sessions, admission changes, worker failures (breakers), time past the TTL,
//! retargets that reuse or rebuild the binding, and retiring it. Properties: a pick is always
//! routable (admitted, discovered, breaker closed) and the session's first routable worker in
//! its rendezvous order; a hit is only on the binding that remembered
//! the session, within the TTL, on the remembered worker; the table stays within its cap; a
//! retired binding frees its table.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Weak};
use std::time::Duration;

use proptest::prelude::*;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::advert::{PrefillConfig, SelectionMode};
use crate::binding::factory::FactoryMutant;
use crate::binding::{DefaultBindingFactory, FactoryConfig};
use crate::discovery::{
    EndpointId, Instance, InstanceEvent, InstanceId, MemoryConfig, MemoryDiscovery,
};
use crate::health::{BackoffPolicy, FailureClass};
use crate::push::{
    rendezvous_first, session_key, AffinityOutcome, DispatchMutant, Dispatcher, Prober, PushConfig,
    RoutableView,
};
use crate::request::GenerateRequest;

const WORKERS: u64 = 4;
const CAP: usize = 3;
const TTL_MS: u64 = 100;

#[derive(Clone, Debug)]
enum Event {
    /// A request of session `0`, prompt seed `1`.
    Request(u8, u8),
    /// The admission set becomes the workers whose bit is set.
    Admit(u8),
    /// A connection to this worker failed: its breaker opens.
    Fail(u64),
    /// Time passes (ms).
    Advance(u64),
    /// A retarget back to the same target: the router keeps the binding.
    Reuse,
    /// A retarget to a new target: a new binding from the factory.
    Rebuild,
    /// The binding is retired and its last request ends: it drops.
    Retire,
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        8 => (0u8..6, 0u8..3).prop_map(|(s, p)| Event::Request(s, p)),
        2 => (0u8..16).prop_map(Event::Admit),
        1 => (1..=WORKERS).prop_map(Event::Fail),
        2 => prop_oneof![Just(10u64), Just(60), Just(TTL_MS), Just(250)].prop_map(Event::Advance),
        1 => Just(Event::Reuse),
        1 => Just(Event::Rebuild),
        1 => Just(Event::Retire),
    ]
}

fn mode() -> impl Strategy<Value = SelectionMode> {
    prop_oneof![
        Just(SelectionMode::RoundRobin),
        Just(SelectionMode::Random),
        Just(SelectionMode::KV)
    ]
}

/// Which deliberate defect a run plants.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Plant {
    None,
    /// The dispatcher's affinity trusts the remembered worker without checking it is routable.
    IgnoresRoutable,
    /// The dispatcher keeps a session on its live entry's worker while that one is routable.
    KeepsEntry,
    /// The factory hands the first binding's table to every later one.
    InheritsTable,
}

fn instance(id: InstanceId) -> Instance {
    Instance {
        endpoint: EndpointId::new("t", "prefill", "generate"),
        instance_id: id,
        address: std::net::SocketAddr::from(([127, 0, 0, 1], 9)),
    }
}

/// The live binding and what the checker knows it remembered: session -> (worker, last use).
struct Live {
    dispatcher: Dispatcher,
    remembered: HashMap<u8, (InstanceId, Instant)>,
}

/// Run `events` under `mode`; `Err` names the first property that failed.
fn run(mode: SelectionMode, events: &[Event], plant: Plant) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async move {
        let mut factory = DefaultBindingFactory::new(
            Arc::new(MemoryDiscovery::new(MemoryConfig::default())),
            FactoryConfig {
                push: PushConfig {
                    affinity_capacity: CAP,
                    ..PushConfig::default()
                },
                ..FactoryConfig::default()
            },
        );
        if plant == Plant::InheritsTable {
            factory = factory.with_mutant(FactoryMutant::InheritAffinity);
        }
        let resolved = PrefillConfig {
            router_mode: mode,
            kv_router_config: None,
            block_size: 4,
            session_affinity_ttl: Some(Duration::from_millis(TTL_MS)),
            enable_eagle: false,
            advertised: true,
            disagreeing_cards: 0,
            total_cards: 1,
        };
        let (admit, admitted) = watch::channel((1..=WORKERS).collect::<BTreeSet<_>>());
        let cancel = CancellationToken::new();
        // Probes always fail: an opened breaker stays open for the run.
        let view = RoutableView::spawn_with_prober(
            futures_util::stream::pending(),
            Some(admitted),
            cancel.clone(),
            BackoffPolicy::default(),
            Prober::new(|_, _| std::future::ready(false)),
        );
        for id in 1..=WORKERS {
            view.apply(InstanceEvent::Added(instance(id)));
        }
        let build = |factory: &DefaultBindingFactory| {
            let d = factory.dispatcher(view.clone(), &resolved);
            let d = match plant {
                Plant::IgnoresRoutable => d.with_mutant(DispatchMutant::AffinityIgnoresRoutable),
                Plant::KeepsEntry => d.with_mutant(DispatchMutant::AffinityKeepsLiveEntry),
                Plant::None | Plant::InheritsTable => d,
            };
            Live {
                dispatcher: d,
                remembered: HashMap::new(),
            }
        };
        let mut live = Some(build(&factory));
        let mut retired: Vec<Weak<crate::push::AffinityTable>> = Vec::new();
        for (step, event) in events.iter().enumerate() {
            match event {
                Event::Request(session, seed) => {
                    let Some(binding) = live.as_mut() else { continue };
                    let mut request =
                        GenerateRequest::new((0..12).map(|t| u32::from(*seed) * 100 + t).collect(), 1);
                    request.session = Some(format!("s{session}"));
                    let routable: Vec<InstanceId> =
                        view.routable().iter().map(|i| i.instance_id).collect();
                    let Ok(pick) = binding.dispatcher.select_held(&request) else {
                        if routable.is_empty() {
                            continue;
                        }
                        return Err(format!("step {step}: no pick with {routable:?} routable"));
                    };
                    let worker = pick.instance().instance_id;
                    let now = Instant::now();
                    if !routable.contains(&worker) {
                        return Err(format!(
                            "step {step}: dispatched to {worker} outside routable {routable:?}"
                        ));
                    }
                    // No busy threshold here: always the first routable of the order.
                    let first = rendezvous_first(session_key(&format!("s{session}")), &routable);
                    if plant != Plant::IgnoresRoutable && Some(worker) != first {
                        return Err(format!(
                            "step {step}: session {session} on {worker}, its rendezvous worker is {first:?}"
                        ));
                    }
                    if pick.affinity() == Some(AffinityOutcome::Hit) {
                        match binding.remembered.get(session) {
                            Some(&(w, at)) if w == worker && now - at < Duration::from_millis(TTL_MS) => {}
                            other => {
                                return Err(format!(
                                    "step {step}: hit on {worker} for session {session}, but this binding remembered {other:?}"
                                ))
                            }
                        }
                    }
                    if pick.affinity().is_none() {
                        return Err(format!("step {step}: a session request got no affinity outcome"));
                    }
                    binding.remembered.insert(*session, (worker, now));
                    let len = binding.dispatcher.affinity_len();
                    if len > CAP {
                        return Err(format!("step {step}: {len} entries over the cap {CAP}"));
                    }
                }
                Event::Admit(mask) => {
                    let set = (1..=WORKERS).filter(|w| mask & (1 << (w - 1)) != 0).collect();
                    admit.send_replace(set);
                }
                Event::Fail(worker) => view.report_failure(*worker, FailureClass::ConnectionRefused),
                Event::Advance(ms) => tokio::time::advance(Duration::from_millis(*ms)).await,
                Event::Reuse => {}
                Event::Rebuild => {
                    live = Some(build(&factory));
                }
                Event::Retire => {
                    if let Some(binding) = live.take() {
                        if let Some(table) = binding.dispatcher.affinity_table() {
                            retired.push(Arc::downgrade(table));
                        }
                    }
                    live = Some(build(&factory));
                }
            }
            if retired.iter().any(|t| t.strong_count() > 0) {
                return Err(format!("step {step}: a retired binding's table is still alive"));
            }
        }
        cancel.cancel();
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn affinity_never_dispatches_outside_admission_nor_survives_a_rebuild_and_keeps_its_cap(
        mode in mode(),
        events in proptest::collection::vec(event(), 1..60),
    ) {
        prop_assert_eq!(run(mode, &events, Plant::None), Ok(()));
    }
}

/// The remembered worker leaves admission, then the session's next request.
fn leaves_admission() -> Vec<Event> {
    vec![
        Event::Request(0, 0),
        Event::Admit(0b0001),
        Event::Request(0, 0),
        Event::Admit(0b0010),
        Event::Request(0, 0),
        Event::Admit(0b0100),
        Event::Request(0, 0),
    ]
}

#[test]
fn the_admission_check_catches_affinity_that_ignores_routability() {
    for mode in [SelectionMode::RoundRobin, SelectionMode::KV] {
        assert_eq!(run(mode, &leaves_admission(), Plant::None), Ok(()));
        let caught = run(mode, &leaves_admission(), Plant::IgnoresRoutable);
        assert!(caught.is_err_and(|e| e.contains("outside routable")));
    }
}

#[test]
fn the_rendezvous_check_catches_affinity_that_keeps_a_live_entry() {
    // Session 0 pinned on each worker alone in turn, then all four back: on at least three of
    // the four its entry names a worker that is routable but not its rendezvous first.
    let events: Vec<Event> = (0..4)
        .flat_map(|w| {
            [
                Event::Admit(1 << w),
                Event::Request(0, 0),
                Event::Admit(0b1111),
                Event::Request(0, 0),
            ]
        })
        .collect();
    for mode in [SelectionMode::RoundRobin, SelectionMode::KV] {
        assert_eq!(run(mode, &events, Plant::None), Ok(()));
        let caught = run(mode, &events, Plant::KeepsEntry);
        assert!(caught.is_err_and(|e| e.contains("its rendezvous worker")));
    }
}

#[test]
fn the_rebuild_check_catches_a_binding_that_inherits_the_old_table() {
    let rebuilt = vec![Event::Request(0, 0), Event::Rebuild, Event::Request(0, 0)];
    assert_eq!(
        run(SelectionMode::RoundRobin, &rebuilt, Plant::None),
        Ok(())
    );
    let caught = run(SelectionMode::RoundRobin, &rebuilt, Plant::InheritsTable);
    assert!(caught.is_err_and(|e| e.contains("hit on")));
    let retired = vec![Event::Request(0, 0), Event::Retire];
    assert_eq!(run(SelectionMode::KV, &retired, Plant::None), Ok(()));
    let caught = run(SelectionMode::KV, &retired, Plant::InheritsTable);
    assert!(caught.is_err_and(|e| e.contains("still alive")));
}

#[test]
fn a_session_stays_on_its_worker_and_counts_a_miss_after_the_ttl() {
    // Round robin would rotate; affinity keeps the session on its rendezvous worker.
    let events: Vec<Event> = (0..6).map(|_| Event::Request(1, 0)).collect();
    assert_eq!(run(SelectionMode::RoundRobin, &events, Plant::None), Ok(()));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let factory = DefaultBindingFactory::new(
            Arc::new(MemoryDiscovery::new(MemoryConfig::default())),
            FactoryConfig::default(),
        );
        let view = RoutableView::spawn(
            futures_util::stream::pending(),
            None,
            CancellationToken::new(),
        );
        for id in 1..=3 {
            view.apply(InstanceEvent::Added(instance(id)));
        }
        let resolved = PrefillConfig {
            router_mode: SelectionMode::RoundRobin,
            kv_router_config: None,
            block_size: 4,
            session_affinity_ttl: Some(Duration::from_millis(TTL_MS)),
            enable_eagle: false,
            advertised: true,
            disagreeing_cards: 0,
            total_cards: 1,
        };
        let d = factory.dispatcher(view.clone(), &resolved);
        let mut request = GenerateRequest::new(vec![1; 8], 1);
        request.session = Some("conv".into());
        let first = d.select_held(&request).unwrap().instance().instance_id;
        for _ in 0..5 {
            tokio::time::advance(Duration::from_millis(TTL_MS - 1)).await;
            let pick = d.select_held(&request).unwrap();
            assert_eq!(pick.instance().instance_id, first);
            assert_eq!(pick.affinity(), Some(AffinityOutcome::Hit));
        }
        tokio::time::advance(Duration::from_millis(TTL_MS)).await;
        // The entry expired, not the choice: the same worker, counted as a new session.
        let after = d.select_held(&request).unwrap();
        assert_eq!(after.affinity(), Some(AffinityOutcome::Miss));
        assert_eq!(after.instance().instance_id, first);
        drop(after);
        let stats = d.affinity_stats();
        assert_eq!((stats.hits, stats.misses, stats.expired), (5, 2, 1));
        // TTL None: no affinity at all.
        let off = PrefillConfig {
            session_affinity_ttl: None,
            ..resolved
        };
        let d = factory.dispatcher(view, &off);
        assert_eq!(d.select_held(&request).unwrap().affinity(), None);
    });
}
