//! Tests of the control core in normal builds (arc-swap, parking_lot). The interleavings are
//! loom's job (`tests/loom_control.rs`); these check the mapping from machine to snapshot and
//! effects, the counters, and where bindings drop.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, OnceLock, Weak};

use proptest::prelude::*;

use super::*;
use crate::lifecycle::Input;

#[derive(Debug)]
struct Bind {
    target: u8,
    build: BuildId,
}

fn started(effects: &Effects<u8>) -> BuildId {
    effects
        .iter()
        .find_map(|e| match e {
            Effect::StartBuild { build, .. } => Some(*build),
            _ => None,
        })
        .expect("a build was started")
}

fn check_snapshot(ctl: &Control<u8, Bind>) {
    let s = ctl.load();
    let st = ctl.status();
    assert_eq!(s.lifecycle(), st.lifecycle);
    assert_eq!(s.epoch(), st.epoch);
    assert_eq!(s.target(), st.desired.as_ref());
    assert_eq!(s.binding().is_some(), s.lifecycle() == Lifecycle::Active);
    assert_eq!(s.bypass().is_none(), s.lifecycle() == Lifecycle::Active);
    if let Some(b) = s.binding() {
        assert_eq!(st.held, Some((b.build, b.target)));
        assert_eq!(s.build(), Some(b.build));
    }
}

#[test]
fn control_is_send_and_sync() {
    fn assert_send_sync<X: Send + Sync>() {}
    assert_send_sync::<Control<String, Vec<u8>>>();
    assert_send_sync::<Route<Vec<u8>>>();
}

#[test]
fn bypass_reason_tracks_the_machine() {
    let ctl: Control<u8, Bind> = Control::new(RetryPolicy::default());
    assert_eq!(ctl.route().bypass(), Some(BypassReason::NotYetTargeted));
    let e = ctl.set_target(Some(1));
    let b1 = started(&e);
    assert_eq!(ctl.route().bypass(), Some(BypassReason::Building));
    assert_eq!(ctl.load().build(), Some(b1));
    let e = ctl.build_failed(b1, "connection refused");
    assert!(
        matches!(e.to_vec()[..], [Effect::ScheduleRetry { after, attempt: 1, .. }] if after == b1)
    );
    assert_eq!(
        ctl.route().bypass(),
        Some(BypassReason::RetryingAfterFailure)
    );
    assert_eq!(
        ctl.status().last_error.as_deref(),
        Some("connection refused")
    );
    let b2 = started(&ctl.retry_elapsed(b1));
    assert_eq!(ctl.route().bypass(), Some(BypassReason::Building));
    let e = ctl.build_succeeded(
        b2,
        Bind {
            target: 1,
            build: b2,
        },
    );
    assert!(e.is_empty());
    assert!(ctl.route().is_prefill());
    assert_eq!(
        ctl.status().last_error,
        None,
        "a publish clears the last error"
    );
    let _ = ctl.set_target(None);
    assert_eq!(ctl.route().bypass(), Some(BypassReason::NoTarget));
    let _ = ctl.shutdown();
    assert_eq!(ctl.route().bypass(), Some(BypassReason::ShutDown));
    check_snapshot(&ctl);
}

#[test]
fn stale_failure_leaves_last_error_alone() {
    let ctl: Control<u8, Bind> = Control::new(RetryPolicy::default());
    let b1 = started(&ctl.set_target(Some(1)));
    let _ = ctl.set_target(Some(2));
    let e = ctl.build_failed(b1, "late failure of a cancelled build");
    assert!(e.is_empty());
    assert_eq!(ctl.status().last_error, None);
}

#[test]
fn unchanged_view_is_not_republished() {
    let ctl: Control<u8, Bind> = Control::new(RetryPolicy::default());
    let b1 = started(&ctl.set_target(Some(1)));
    let _ = ctl.build_succeeded(
        b1,
        Bind {
            target: 1,
            build: b1,
        },
    );
    let epoch = ctl.load().epoch();
    let before = ctl.load();
    // Same target again, a late duplicate result, an unknown retry: nothing for requests.
    assert!(ctl.set_target(Some(1)).is_empty());
    assert!(ctl
        .build_succeeded(
            b1,
            Bind {
                target: 1,
                build: b1
            }
        )
        .is_empty());
    assert!(ctl.retry_elapsed(BuildId(99)).is_empty());
    assert_eq!(ctl.load().epoch(), epoch);
    assert!(SnapshotGuard::same_snapshot(&before, &ctl.load()));
    assert_eq!(ctl.status().counters.discarded, 1);
}

#[test]
fn reuse_publishes_the_kept_binding() {
    let ctl: Control<u8, Bind> = Control::new(RetryPolicy::default());
    let b1 = started(&ctl.set_target(Some(1)));
    let _ = ctl.build_succeeded(
        b1,
        Bind {
            target: 1,
            build: b1,
        },
    );
    let first = ctl.route();
    let _ = ctl.set_target(None);
    assert!(!ctl.route().is_prefill());
    assert!(ctl.set_target(Some(1)).is_empty(), "reuse builds nothing");
    let again = ctl.route();
    assert!(Arc::ptr_eq(
        first.binding().expect("active"),
        again.binding().expect("active")
    ));
}

#[test]
fn retired_binding_counted_alive_until_its_request_ends() {
    let ctl: Control<u8, Bind> = Control::new(RetryPolicy::default());
    let b1 = started(&ctl.set_target(Some(1)));
    let _ = ctl.build_succeeded(
        b1,
        Bind {
            target: 1,
            build: b1,
        },
    );
    let request = ctl.route();
    let _ = ctl.set_target(Some(2));
    let c = ctl.status().counters;
    assert_eq!((c.retired, c.retired_alive), (1, 1));
    drop(request);
    assert_eq!(ctl.status().counters.retired_alive, 0);
}

#[test]
fn a_binding_is_held_until_a_retarget_retires_it_and_a_clear_keeps_it() {
    let ctl: Control<u8, Bind> = Control::new(RetryPolicy::default());
    let b1 = started(&ctl.set_target(Some(1)));
    let _ = ctl.build_succeeded(
        b1,
        Bind {
            target: 1,
            build: b1,
        },
    );
    let first = Arc::clone(ctl.route().binding().expect("active"));
    assert!(ctl.holds(&first));
    assert_eq!(ctl.retired_count(), 0);
    let stranger = Arc::new(Bind {
        target: 1,
        build: b1,
    });
    assert!(!ctl.holds(&stranger), "holds compares identity, not value");
    // A clear keeps the binding for reuse: still held, nothing retired.
    let _ = ctl.set_target(None);
    assert!(ctl.holds(&first));
    assert_eq!(ctl.retired_count(), 0);
    // A retarget retires it.
    let _ = ctl.set_target(Some(2));
    assert!(!ctl.holds(&first));
    assert_eq!(ctl.retired_count(), 1);
    assert_eq!(ctl.retired_count(), ctl.status().counters.retired);
}

#[test]
fn retired_tracking_is_bounded() {
    let ctl: Control<u8, Bind> = Control::new(RetryPolicy::default());
    let mut requests = Vec::new();
    let total = retired::TRACK_CAP + 5;
    for i in 0..total {
        let target = (i % 2) as u8;
        let b = started(&ctl.set_target(Some(target)));
        let _ = ctl.build_succeeded(b, Bind { target, build: b });
        requests.push(ctl.route());
    }
    // Every binding but the current one is retired and still held by a request.
    let c = ctl.status().counters;
    assert_eq!(c.retired as usize, total - 1);
    assert_eq!(c.retired_alive, retired::TRACK_CAP);
    assert_eq!(c.retired_untracked as usize, total - 1 - retired::TRACK_CAP);
}

#[test]
fn stray_results_before_the_first_decision_leave_it_not_yet_targeted() {
    // A late result or timer from a previous process life must not make requests see
    // "building" before the controller has decided anything.
    let ctl: Control<u8, Bind> = Control::new(RetryPolicy::default());
    let before = ctl.load();
    let _ = ctl.build_failed(BuildId(4), "late");
    let _ = ctl.retry_elapsed(BuildId(4));
    let _ = ctl.build_succeeded(
        BuildId(5),
        Bind {
            target: 1,
            build: BuildId(5),
        },
    );
    assert_eq!(ctl.route().bypass(), Some(BypassReason::NotYetTargeted));
    assert!(SnapshotGuard::same_snapshot(&before, &ctl.load()));
    assert_eq!(ctl.status().epoch, 0);
}

#[test]
fn every_published_change_advances_the_epoch_by_one() {
    let ctl: Control<u8, Bind> = Control::new(RetryPolicy::default());
    assert_eq!(ctl.load().epoch(), 0);
    let b = started(&ctl.set_target(Some(1)));
    assert_eq!(ctl.load().epoch(), 1);
    let _ = ctl.build_succeeded(
        b,
        Bind {
            target: 1,
            build: b,
        },
    );
    assert_eq!(ctl.load().epoch(), 2);
    let _ = ctl.set_target(None);
    assert_eq!(ctl.load().epoch(), 3);
    let _ = ctl.shutdown();
    let s = ctl.load();
    assert_eq!((s.epoch(), s.bypass()), (4, Some(BypassReason::ShutDown)));
    assert_eq!(ctl.status().counters.snapshots, 4);
}

#[test]
fn dead_retired_bindings_are_pruned_not_counted_as_untracked() {
    // Retirements whose requests have ended must not fill the list: only a caller that keeps
    // retired bindings alive past the cap makes the core lose track of them.
    let ctl: Control<u8, Bind> = Control::new(RetryPolicy::default());
    let total = retired::TRACK_CAP + 5;
    for i in 0..total {
        let target = (i % 2) as u8;
        let b = started(&ctl.set_target(Some(target)));
        let _ = ctl.build_succeeded(b, Bind { target, build: b });
    }
    let c = ctl.status().counters;
    assert_eq!(c.retired as usize, total - 1);
    assert_eq!((c.retired_alive, c.retired_untracked), (0, 0));
}

#[test]
fn debug_output_shows_the_status() {
    let ctl: Control<u8, Bind> = Control::new(RetryPolicy::default());
    let b = started(&ctl.set_target(Some(9)));
    let text = format!("{ctl:?}");
    assert!(text.starts_with("Control"), "{text}");
    assert!(text.contains("lifecycle: Pending"), "{text}");
    assert!(
        text.contains(&format!("in_flight: Some(({b:?}, 9))")),
        "{text}"
    );
}

/// A binding that records whether the control lock was held when it dropped.
struct Probe {
    ctl: Arc<OnceLock<Weak<Control<u8, Probe>>>>,
    dropped_under_lock: Arc<AtomicBool>,
    drops: Arc<AtomicUsize>,
}

impl Drop for Probe {
    fn drop(&mut self) {
        self.drops.fetch_add(1, SeqCst);
        if let Some(ctl) = self.ctl.get().and_then(Weak::upgrade) {
            if ctl.lock_is_held() {
                self.dropped_under_lock.store(true, SeqCst);
            }
        }
    }
}

/// Drive a core through a stale discard, two retirements and a late result; returns (drops,
/// whether any binding dropped while the lock was held).
fn drops_under_lock(drop_under_lock: bool) -> (usize, bool) {
    let slot = Arc::new(OnceLock::new());
    let under = Arc::new(AtomicBool::new(false));
    let drops = Arc::new(AtomicUsize::new(0));
    let probe = || Probe {
        ctl: Arc::clone(&slot),
        dropped_under_lock: Arc::clone(&under),
        drops: Arc::clone(&drops),
    };
    let mutant = if drop_under_lock {
        Mutant::DropUnderLock
    } else {
        Mutant::None
    };
    let ctl = Arc::new(Control::<u8, Probe>::with_mutant(
        RetryPolicy::default(),
        mutant,
    ));
    assert!(slot.set(Arc::downgrade(&ctl)).is_ok(), "set once");
    // Stale build: discarded.
    let b1 = started(&ctl.set_target(Some(1)));
    let b2 = started(&ctl.set_target(Some(2)));
    let _ = ctl.build_succeeded(b1, probe());
    assert_eq!(drops.load(SeqCst), 1);
    // Published then retired by a retarget (the old snapshot held the last reference).
    let _ = ctl.build_succeeded(b2, probe());
    let b3 = started(&ctl.set_target(Some(3)));
    assert_eq!(drops.load(SeqCst), 2);
    // Published then retired by shutdown.
    let _ = ctl.build_succeeded(b3, probe());
    let _ = ctl.shutdown();
    assert_eq!(drops.load(SeqCst), 3);
    // Late result after shutdown.
    let _ = ctl.build_succeeded(BuildId(7), probe());
    (drops.load(SeqCst), under.load(SeqCst))
}

#[test]
fn bindings_never_drop_under_the_lock() {
    assert_eq!(drops_under_lock(false), (4, false));
}

#[test]
fn drop_under_lock_mutant_is_caught() {
    assert_eq!(drops_under_lock(true), (4, true));
}

/// Control inputs for the property test: targets 0..3, build ids near the ones in use.
fn input() -> impl Strategy<Value = Input<u8>> {
    prop_oneof![
        3 => proptest::option::of(0u8..3).prop_map(Input::SetTarget),
        3 => (1u64..8).prop_map(|b| Input::BuildSucceeded(BuildId(b))),
        2 => (1u64..8).prop_map(|b| Input::BuildFailed(BuildId(b))),
        2 => (1u64..8).prop_map(|b| Input::RetryElapsed(BuildId(b))),
        1 => Just(Input::Shutdown),
    ]
}

proptest! {
    /// Control applies exactly the machine's actions: its effects are the machine's async-side
    /// actions, its snapshot is the machine's view, and its counters count the in-memory ones.
    #[test]
    fn control_mirrors_the_machine(inputs in proptest::collection::vec(input(), 0..40)) {
        let ctl: Control<u8, Bind> = Control::new(RetryPolicy::default());
        let mut model = Machine::new(RetryPolicy::default());
        let (mut published, mut discarded, mut retired) = (0u64, 0u64, 0u64);
        let mut last_epoch = ctl.load().epoch();
        for input in inputs {
            let expected = model.handle(input.clone());
            for a in &expected {
                match a {
                    Action::Publish { .. } => published += 1,
                    Action::Discard { .. } => discarded += 1,
                    Action::Retire { .. } => retired += 1,
                    _ => {}
                }
            }
            let expected: Vec<Effect<u8>> =
                expected.into_iter().filter_map(Effect::from_action).collect();
            let got = match input {
                Input::SetTarget(t) => ctl.set_target(t),
                Input::BuildSucceeded(b) => {
                    let target = model.held().filter(|(id, _)| *id == b).map_or(255, |(_, t)| *t);
                    ctl.build_succeeded(b, Bind { target, build: b })
                }
                Input::BuildFailed(b) => ctl.build_failed(b, "boom"),
                Input::RetryElapsed(b) => ctl.retry_elapsed(b),
                Input::Shutdown => ctl.shutdown(),
            };
            prop_assert_eq!(got.to_vec(), expected);
            check_snapshot(&ctl);
            let s = ctl.load();
            prop_assert_eq!(s.lifecycle(), model.lifecycle());
            prop_assert!(s.epoch() >= last_epoch);
            last_epoch = s.epoch();
            let c = ctl.status().counters;
            prop_assert_eq!((c.published, c.discarded, c.retired), (published, discarded, retired));
            prop_assert_eq!(c.snapshots, s.epoch());
        }
    }
}

/// Real threads on the real arc-swap cell: readers never see an inconsistent snapshot or a
/// binding for another target while a writer retargets, clears and completes builds. Bounded.
#[test]
fn readers_see_consistent_snapshots_under_real_threads() {
    let ctl = Arc::new(Control::<u8, Bind>::new(RetryPolicy::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (ctl, stop) = (Arc::clone(&ctl), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut last = 0;
                let mut seen = 0u64;
                for _ in 0..2_000_000 {
                    if stop.load(SeqCst) {
                        break;
                    }
                    let s = ctl.load();
                    assert!(s.epoch() >= last, "epoch went backwards");
                    last = s.epoch();
                    assert_eq!(s.binding().is_some(), s.lifecycle() == Lifecycle::Active);
                    if let Some(b) = s.binding() {
                        assert_eq!(Some(&b.target), s.target());
                        seen += 1;
                    }
                }
                seen
            })
        })
        .collect();
    for i in 0..2_000u32 {
        let target = (i % 3) as u8;
        if i % 7 == 0 {
            let _ = ctl.set_target(None);
            assert!(!ctl.route().is_prefill(), "clear is synchronous");
        }
        let e = ctl.set_target(Some(target));
        if let Some(Effect::StartBuild { build, target }) = e
            .into_iter()
            .find(|e| matches!(e, Effect::StartBuild { .. }))
        {
            let _ = ctl.build_succeeded(build, Bind { target, build });
        }
        assert_eq!(ctl.load().target(), Some(&target));
        assert!(ctl.route().is_prefill());
    }
    stop.store(true, SeqCst);
    for r in readers {
        r.join().expect("reader panicked");
    }
    assert_eq!(ctl.status().counters.retired_alive, 0);
}
