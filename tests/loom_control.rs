//! loom models of the control core and the published-route cell.
//!
//! Run by `.ci/loom.sh`:
//! `RUSTFLAGS="--cfg prefill_loom" LOOM_MAX_PREEMPTIONS=2 CARGO_TARGET_DIR=target/loom \
//!  cargo test --release --no-default-features --test loom_control`
//!
//! Each scenario runs request readers against concurrent control calls. Readers check what a
//! request may observe; the main thread checks the final state and that every binding was
//! dropped exactly once. Two mutants of the publication protocol (see `Mutant`) are run
//! through the same scenarios to show the checks catch them.
#![cfg(prefill_loom)]

use std::panic::{catch_unwind, AssertUnwindSafe};

use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use loom::sync::Arc;
use loom::thread;
use prefill_router::control::{Control, Effect, Effects, Mutant};
use prefill_router::lifecycle::{BuildId, Lifecycle, RetryPolicy};
use prefill_router::snapshot::{BypassReason, Route, Snapshot};

/// A binding that counts its drops and remembers what it was built for.
#[derive(Debug)]
struct Bind {
    target: u8,
    build: BuildId,
    drops: Arc<AtomicUsize>,
}

impl Drop for Bind {
    fn drop(&mut self) {
        self.drops.fetch_add(1, SeqCst);
    }
}

/// One drop counter per binding a scenario builds.
struct Drops(Arc<AtomicUsize>);

impl Drops {
    fn new() -> Self {
        Drops(Arc::new(AtomicUsize::new(0)))
    }

    fn bind(&self, target: u8, build: BuildId) -> Bind {
        Bind {
            target,
            build,
            drops: Arc::clone(&self.0),
        }
    }

    fn count(&self) -> usize {
        self.0.load(SeqCst)
    }
}

type Ctl = Control<u8, Bind>;

fn new_control(mutant: Mutant) -> Arc<Ctl> {
    Arc::new(Control::with_mutant(RetryPolicy::default(), mutant))
}

/// The build a batch of effects starts (the scenarios always expect one).
fn started(effects: Effects<u8>) -> BuildId {
    effects
        .into_iter()
        .find_map(|e| match e {
            Effect::StartBuild { build, .. } => Some(build),
            _ => None,
        })
        .expect("a build was started")
}

/// What any request may rely on in any snapshot it loads.
fn assert_consistent(s: &Snapshot<u8, Bind>) {
    let active = s.lifecycle() == Lifecycle::Active;
    assert_eq!(
        active,
        s.binding().is_some(),
        "lifecycle {:?} published with binding {:?}",
        s.lifecycle(),
        s.binding()
    );
    assert_eq!(active, s.bypass().is_none());
    if let Some(b) = s.binding() {
        assert_eq!(
            Some(&b.target),
            s.target(),
            "binding for {} served while the target is {:?}",
            b.target,
            s.target()
        );
        assert_eq!(Some(b.build), s.build());
    }
}

/// Drive `ctl` to Active on `target`; returns the build id.
fn activate(ctl: &Ctl, drops: &Drops, target: u8) -> BuildId {
    let build = started(ctl.set_target(Some(target)));
    let _ = ctl.build_succeeded(build, drops.bind(target, build));
    build
}

/// Retarget C -> B racing a late completion of a cancelled build for A and a reader.
fn retarget_scenario(mutant: Mutant) {
    let (da, db, dc) = (Drops::new(), Drops::new(), Drops::new());
    let ctl = new_control(mutant);
    let b1 = started(ctl.set_target(Some(b'A')));
    let _c2 = activate(&ctl, &dc, b'C'); // cancels #1

    let w1 = {
        let ctl = Arc::clone(&ctl);
        let bind = db.bind(b'B', BuildId(3));
        thread::spawn(move || {
            let b3 = started(ctl.set_target(Some(b'B')));
            assert_eq!(b3, BuildId(3));
            let _ = ctl.build_succeeded(b3, bind);
        })
    };
    let w2 = {
        let ctl = Arc::clone(&ctl);
        let bind = da.bind(b'A', b1);
        thread::spawn(move || {
            let e = ctl.build_succeeded(b1, bind);
            assert!(e.is_empty());
        })
    };
    let r = {
        let ctl = Arc::clone(&ctl);
        thread::spawn(move || {
            let first = ctl.load();
            assert_consistent(&first);
            let second = ctl.load();
            assert_consistent(&second);
            assert!(first.epoch() <= second.epoch(), "epochs went backwards");
        })
    };
    w1.join().unwrap();
    w2.join().unwrap();
    r.join().unwrap();

    let st = ctl.status();
    assert_eq!(st.lifecycle, Lifecycle::Active);
    assert_eq!(st.held, Some((BuildId(3), b'B')));
    assert_eq!(st.counters.discarded, 1);
    assert_eq!(st.counters.retired, 1);
    assert_eq!(st.counters.retired_alive, 0);
    match ctl.route() {
        Route::Prefill(b) => assert_eq!((b.target, b.build), (b'B', BuildId(3))),
        other => panic!("expected prefill on B, got {other:?}"),
    }
    assert_eq!(da.count(), 1, "stale binding dropped exactly once");
    assert_eq!(dc.count(), 1, "retired binding dropped exactly once");
    assert_eq!(db.count(), 0, "published binding alive while held");
    drop(ctl);
    assert_eq!(db.count(), 1);
}

#[test]
fn retarget_vs_stale_completion_vs_reader_is_consistent() {
    loom::model(|| retarget_scenario(Mutant::None));
}

/// Run `model` under loom and require that loom finds a failure whose message contains one of
/// `expected` (so a mutant is caught by the intended check, not by an unrelated panic).
fn assert_loom_finds(expected: &[&str], model: fn()) {
    let found = catch_unwind(AssertUnwindSafe(|| loom::model(model)));
    let payload = found.expect_err("loom explored every interleaving and found nothing");
    let message = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(
        expected.iter().any(|e| message.contains(e)),
        "loom failed for another reason: {message}"
    );
}

#[test]
fn loom_catches_two_cell_publication_on_retarget() {
    assert_loom_finds(
        &["published with binding", "served while the target is"],
        || retarget_scenario(Mutant::TwoCells),
    );
}

/// Clear racing a reader, from Active on A.
fn clear_scenario(mutant: Mutant) {
    let da = Drops::new();
    let ctl = new_control(mutant);
    activate(&ctl, &da, b'A');
    let cleared = Arc::new(AtomicBool::new(false));
    let w = {
        let (ctl, cleared) = (Arc::clone(&ctl), Arc::clone(&cleared));
        thread::spawn(move || {
            let e = ctl.set_target(None);
            assert!(e.is_empty());
            cleared.store(true, SeqCst);
        })
    };
    let r = {
        let (ctl, cleared) = (Arc::clone(&ctl), Arc::clone(&cleared));
        thread::spawn(move || {
            for _ in 0..2 {
                let after_clear = cleared.load(SeqCst);
                let s = ctl.load();
                assert_consistent(&s);
                if after_clear {
                    assert_eq!(s.route().bypass(), Some(BypassReason::NoTarget));
                }
            }
        })
    };
    w.join().unwrap();
    r.join().unwrap();
    assert_eq!(ctl.route().bypass(), Some(BypassReason::NoTarget));
    // The binding is kept for reuse, not retired.
    assert_eq!(da.count(), 0);
    drop(ctl);
    assert_eq!(da.count(), 1);
}

#[test]
fn load_after_clear_returned_never_prefills() {
    loom::model(|| clear_scenario(Mutant::None));
}

/// Clear racing the completion of the build in flight, plus a reader.
fn clear_vs_completion_scenario(mutant: Mutant) {
    let da = Drops::new();
    let ctl = new_control(mutant);
    let b1 = started(ctl.set_target(Some(b'A')));
    let cleared = Arc::new(AtomicBool::new(false));
    let w1 = {
        let ctl = Arc::clone(&ctl);
        let bind = da.bind(b'A', b1);
        thread::spawn(move || {
            let _ = ctl.build_succeeded(b1, bind);
        })
    };
    let w2 = {
        let (ctl, cleared) = (Arc::clone(&ctl), Arc::clone(&cleared));
        thread::spawn(move || {
            let _ = ctl.set_target(None);
            cleared.store(true, SeqCst);
        })
    };
    let r = {
        let (ctl, cleared) = (Arc::clone(&ctl), Arc::clone(&cleared));
        thread::spawn(move || {
            let after_clear = cleared.load(SeqCst);
            let s = ctl.load();
            assert_consistent(&s);
            if after_clear {
                assert!(!s.route().is_prefill(), "prefill after the clear returned");
            }
        })
    };
    w1.join().unwrap();
    w2.join().unwrap();
    r.join().unwrap();
    let st = ctl.status();
    assert_eq!(st.lifecycle, Lifecycle::Unavailable);
    let s = ctl.load();
    assert_eq!(
        s.lifecycle(),
        st.lifecycle,
        "published snapshot disagrees with the machine"
    );
    assert_eq!(s.epoch(), st.epoch);
    assert_eq!(s.route().bypass(), Some(BypassReason::NoTarget));
    drop(s);
    drop(ctl);
    assert_eq!(da.count(), 1);
}

#[test]
fn clear_vs_completion_publishes_in_machine_order() {
    loom::model(|| clear_vs_completion_scenario(Mutant::None));
}

#[test]
fn loom_catches_publication_outside_the_lock() {
    assert_loom_finds(
        &[
            "prefill after the clear returned",
            "published snapshot disagrees with the machine",
        ],
        || clear_vs_completion_scenario(Mutant::PublishOutsideLock),
    );
}

/// Reuse of the kept binding racing the late completion of a cancelled build, plus a reader.
fn reuse_scenario(mutant: Mutant) {
    let (da, db) = (Drops::new(), Drops::new());
    let ctl = new_control(mutant);
    let b1 = started(ctl.set_target(Some(b'A')));
    let b2 = activate(&ctl, &db, b'B'); // cancels #1
    let _ = ctl.set_target(None); // keeps B's binding for reuse
    let reused = Arc::new(AtomicBool::new(false));
    let w1 = {
        let (ctl, reused) = (Arc::clone(&ctl), Arc::clone(&reused));
        thread::spawn(move || {
            let e = ctl.set_target(Some(b'B'));
            assert!(e.is_empty(), "reuse starts no build");
            reused.store(true, SeqCst);
        })
    };
    let w2 = {
        let ctl = Arc::clone(&ctl);
        let bind = da.bind(b'A', b1);
        thread::spawn(move || {
            let _ = ctl.build_succeeded(b1, bind);
        })
    };
    let r = {
        let (ctl, reused) = (Arc::clone(&ctl), Arc::clone(&reused));
        thread::spawn(move || {
            let after_reuse = reused.load(SeqCst);
            let s = ctl.load();
            assert_consistent(&s);
            if after_reuse {
                let b = s.binding().expect("prefill after reuse returned");
                assert_eq!((b.target, b.build), (b'B', b2));
            }
        })
    };
    w1.join().unwrap();
    w2.join().unwrap();
    r.join().unwrap();
    let st = ctl.status();
    assert_eq!(st.held, Some((b2, b'B')));
    assert_eq!(st.counters.published, 1);
    assert_eq!(st.counters.discarded, 1);
    assert_eq!(da.count(), 1, "stale binding dropped exactly once");
    assert_eq!(db.count(), 0);
    drop(ctl);
    assert_eq!(db.count(), 1);
}

#[test]
fn reuse_vs_stale_completion_never_serves_the_stale_binding() {
    loom::model(|| reuse_scenario(Mutant::None));
}

/// Shutdown racing the completion of the build in flight, plus a reader.
fn shutdown_scenario(mutant: Mutant) {
    let da = Drops::new();
    let ctl = new_control(mutant);
    let b1 = started(ctl.set_target(Some(b'A')));
    let down = Arc::new(AtomicBool::new(false));
    let w1 = {
        let (ctl, down) = (Arc::clone(&ctl), Arc::clone(&down));
        thread::spawn(move || {
            let _ = ctl.shutdown();
            down.store(true, SeqCst);
        })
    };
    let w2 = {
        let ctl = Arc::clone(&ctl);
        let bind = da.bind(b'A', b1);
        thread::spawn(move || {
            let e = ctl.build_succeeded(b1, bind);
            assert!(e.is_empty());
        })
    };
    let r = {
        let (ctl, down) = (Arc::clone(&ctl), Arc::clone(&down));
        thread::spawn(move || {
            let after = down.load(SeqCst);
            let s = ctl.load();
            assert_consistent(&s);
            if after {
                assert_eq!(s.route().bypass(), Some(BypassReason::ShutDown));
            }
        })
    };
    w1.join().unwrap();
    w2.join().unwrap();
    r.join().unwrap();
    let st = ctl.status();
    assert!(st.shut_down);
    assert_eq!(st.held, None);
    assert_eq!(st.counters.retired_alive, 0);
    assert_eq!(ctl.route().bypass(), Some(BypassReason::ShutDown));
    // Published then retired, or discarded: either way gone exactly once, and not by the
    // final drop of the core.
    assert_eq!(da.count(), 1);
    drop(ctl);
    assert_eq!(da.count(), 1);
}

#[test]
fn shutdown_vs_completion_ends_shut_down_with_binding_released() {
    loom::model(|| shutdown_scenario(Mutant::None));
}

/// A request holding the binding while it is retired.
fn retire_scenario(mutant: Mutant) {
    let da = Drops::new();
    let ctl = new_control(mutant);
    activate(&ctl, &da, b'A');
    let drops = Arc::clone(&da.0);
    let r = {
        let ctl = Arc::clone(&ctl);
        thread::spawn(move || {
            if let Route::Prefill(b) = ctl.route() {
                // The request runs on its binding: it must stay alive until dropped here.
                thread::yield_now();
                assert_eq!(b.target, b'A');
                assert_eq!(
                    drops.load(SeqCst),
                    0,
                    "binding dropped under a live request"
                );
            }
        })
    };
    let w = {
        let ctl = Arc::clone(&ctl);
        thread::spawn(move || {
            let _ = ctl.set_target(Some(b'B'));
            let alive = ctl.status().counters.retired_alive;
            assert!(alive <= 1);
        })
    };
    r.join().unwrap();
    w.join().unwrap();
    let st = ctl.status();
    assert_eq!(st.counters.retired, 1);
    assert_eq!(st.counters.retired_alive, 0);
    assert_eq!(
        da.count(),
        1,
        "retired binding dropped exactly once, after its reader"
    );
    drop(ctl);
    assert_eq!(da.count(), 1);
}

#[test]
fn retired_binding_dropped_once_after_last_reader() {
    loom::model(|| retire_scenario(Mutant::None));
}
