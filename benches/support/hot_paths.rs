//! The request-path reads compared in `benches/route.rs` and `examples/route_callgrind.rs`:
//! this crate's snapshot cell against upstream's layout and the obvious alternatives. Each read
//! returns what a request routes on, folded into a `u64` so nothing is optimised away.
#![allow(dead_code)] // each includer uses a subset

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, RwLock};

use arc_swap::{ArcSwap, ArcSwapOption};
use prefill_router::control::{Control, Effect};
use prefill_router::lifecycle::{Lifecycle, RetryPolicy};
use prefill_router::snapshot::Route;

/// Stand-in for a binding: what a request reads before dispatching.
#[derive(Debug)]
pub struct Binding {
    pub target: u64,
    pub endpoint_id: u64,
    pub name: String,
}

pub fn binding(target: u64) -> Binding {
    Binding {
        target,
        endpoint_id: target * 7,
        name: format!("prefill-{target}"),
    }
}

/// A snapshot for the lock-based alternatives.
pub struct LockedSnap {
    pub lifecycle: Lifecycle,
    pub binding: Option<Arc<Binding>>,
}

const PENDING: u8 = 0;
const ACTIVE: u8 = 1;

/// Upstream Dynamo's layout: lifecycle gate in an `AtomicU8`, binding in an `ArcSwapOption`,
/// both written under a mutex.
pub struct Upstream {
    pub lock: parking_lot::Mutex<u64>,
    pub life: AtomicU8,
    pub bind: ArcSwapOption<Binding>,
}

impl Upstream {
    pub fn active(target: u64) -> Self {
        Upstream {
            lock: parking_lot::Mutex::new(target),
            life: AtomicU8::new(ACTIVE),
            bind: ArcSwapOption::new(Some(Arc::new(binding(target)))),
        }
    }

    /// Upstream's publish (D8): binding first, then Active, under the lock.
    pub fn publish(&self, b: Arc<Binding>) {
        let mut t = self.lock.lock();
        *t = b.target;
        self.bind.store(Some(b));
        self.life.store(ACTIVE, Ordering::Release);
    }

    /// Upstream's retarget (S3): clear the binding, then Pending, under the lock.
    pub fn retarget(&self, target: u64) {
        let mut t = self.lock.lock();
        *t = target;
        self.bind.store(None);
        self.life.store(PENDING, Ordering::Release);
    }

    /// The request path: gate, then `load_full` of the binding.
    #[inline]
    pub fn read(&self) -> u64 {
        if self.life.load(Ordering::Acquire) == ACTIVE {
            self.bind.load_full().map_or(0, |b| b.endpoint_id)
        } else {
            0
        }
    }
}

/// Every representation, pre-loaded Active on target 1.
pub struct Fixture {
    pub control: Control<u64, Binding>,
    pub upstream: Upstream,
    pub bare: ArcSwap<Binding>,
    pub rw: RwLock<Arc<LockedSnap>>,
    pub mx: parking_lot::Mutex<Arc<LockedSnap>>,
    pub floor: AtomicU8,
    /// A binding built ahead, for write benchmarks that should not count building one.
    pub prebuilt: Arc<Binding>,
}

/// Retarget `control` to `target` and complete the build: two publishes, like upstream's S3+D8.
pub fn control_retarget(control: &Control<u64, Binding>, target: u64) {
    let effects = control.set_target(Some(target));
    for e in effects {
        if let Effect::StartBuild { build, target } = e {
            let _ = control.build_succeeded(build, binding(target));
        }
    }
}

impl Fixture {
    pub fn new() -> Self {
        let control = Control::new(RetryPolicy::default());
        control_retarget(&control, 1);
        let snap = || {
            Arc::new(LockedSnap {
                lifecycle: Lifecycle::Active,
                binding: Some(Arc::new(binding(1))),
            })
        };
        Fixture {
            control,
            upstream: Upstream::active(1),
            bare: ArcSwap::new(Arc::new(binding(1))),
            rw: RwLock::new(snap()),
            mx: parking_lot::Mutex::new(snap()),
            floor: AtomicU8::new(ACTIVE),
            prebuilt: Arc::new(binding(1)),
        }
    }

    /// Ours, the decision: one guard load, read lifecycle and binding, no `Arc` clone.
    #[inline]
    pub fn ours_decision(&self) -> u64 {
        let s = self.control.load();
        match (s.lifecycle(), s.binding()) {
            (Lifecycle::Active, Some(b)) => b.endpoint_id,
            _ => 0,
        }
    }

    /// Ours, admission: the decision plus an owned binding for the dispatch.
    #[inline]
    pub fn ours_admission(&self) -> u64 {
        match self.control.route() {
            Route::Prefill(b) => b.endpoint_id,
            Route::Bypass(_) => 0,
        }
    }

    /// Upstream's gate + `load_full` (its decision and admission are the same code).
    #[inline]
    pub fn upstream(&self) -> u64 {
        self.upstream.read()
    }

    /// A bare arc-swap guard load of a binding (the reference for the decision).
    #[inline]
    pub fn bare_guard(&self) -> u64 {
        self.bare.load().endpoint_id
    }

    /// `std::sync::RwLock<Arc<_>>` read + clone of the binding.
    #[inline]
    pub fn rwlock_clone(&self) -> u64 {
        let b = match self.rw.read() {
            Ok(g) if g.lifecycle == Lifecycle::Active => g.binding.clone(),
            _ => None,
        };
        b.map_or(0, |b| b.endpoint_id)
    }

    /// `parking_lot::Mutex<Arc<_>>` lock + clone of the binding.
    #[inline]
    pub fn mutex_clone(&self) -> u64 {
        let b = {
            let g = self.mx.lock();
            if g.lifecycle == Lifecycle::Active {
                g.binding.clone()
            } else {
                None
            }
        };
        b.map_or(0, |b| b.endpoint_id)
    }

    /// The floor: one bare atomic load.
    #[inline]
    pub fn floor(&self) -> u64 {
        self.floor.load(Ordering::Acquire) as u64
    }
}

/// Control-plane writes, one call each; `state` varies the target between calls.
pub type WriteOp = fn(&Fixture, &mut u64);

/// Ours: one `set_target`, alternating clear and reuse so every call publishes.
pub fn ours_set_target(fx: &Fixture, state: &mut u64) {
    *state += 1;
    let _ = fx.control.set_target((*state % 2 == 0).then_some(1));
}

/// Upstream's store pair (its publish, D8): lock, binding store, lifecycle store.
pub fn upstream_store_pair(fx: &Fixture, _state: &mut u64) {
    fx.upstream.publish(Arc::clone(&fx.prebuilt));
}

/// Ours: retarget to a new target and complete its build (two publishes, one retirement).
pub fn ours_retarget_cycle(fx: &Fixture, state: &mut u64) {
    *state += 1;
    control_retarget(&fx.control, *state);
}

/// Upstream: retarget (S3) and publish the new binding (D8).
pub fn upstream_retarget_cycle(fx: &Fixture, state: &mut u64) {
    *state += 1;
    fx.upstream.retarget(*state);
    fx.upstream.publish(Arc::new(binding(*state)));
}

impl Default for Fixture {
    fn default() -> Self {
        Fixture::new()
    }
}
