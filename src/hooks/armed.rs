//! Test and loom builds: the hooks of `off.rs` (same API), each able to run a mutant.

// Under loom only the control core's mutants are exercised.
#![cfg_attr(prefill_loom, allow(dead_code))]

use std::marker::PhantomData;
use std::sync::Arc;

#[cfg(feature = "runtime")]
use crate::snapshot::{BypassReason, Route};
use crate::snapshot::{RouteCell, Snapshot, SnapshotGuard};

#[cfg(prefill_loom)]
mod two_cells;

/// Which deliberate mutant a [`Control`](crate::control::Control) runs (see
/// `Control::with_mutant`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutant {
    /// The correct protocol.
    None,
    /// Upstream's layout: the lifecycle (with target and bypass reason) and the binding live in
    /// two cells, written in upstream's order (publish: binding then lifecycle; retarget:
    /// clear binding then lifecycle; clear: lifecycle only, binding retained) and read as
    /// lifecycle gate then binding. Loom only (its reads hand out loom's cell guard).
    #[cfg(prefill_loom)]
    TwoCells,
    /// The machine steps under the lock but the snapshot is stored after the lock is released.
    PublishOutsideLock,
    /// Bindings taken out by a step are dropped while the lock is still held.
    DropUnderLock,
}

/// The control core's hooks, with the mutant it runs.
pub(crate) struct ControlHooks<T, B> {
    mutant: Mutant,
    #[cfg(prefill_loom)]
    two_cells: two_cells::TwoCells<T, B>,
    _types: PhantomData<fn() -> (T, B)>,
}

impl<T: Clone, B> Default for ControlHooks<T, B> {
    fn default() -> Self {
        ControlHooks::new(Mutant::None)
    }
}

impl<T: Clone, B> ControlHooks<T, B> {
    /// Hooks running `mutant`.
    pub(crate) fn new(mutant: Mutant) -> Self {
        ControlHooks {
            mutant,
            #[cfg(prefill_loom)]
            two_cells: two_cells::TwoCells::new(),
            _types: PhantomData,
        }
    }
}

impl<T: Clone, B> ControlHooks<T, B> {
    /// A request's load of the published snapshot (`TwoCells`: the upstream two-cell read).
    #[inline]
    pub(crate) fn load(&self, cell: &RouteCell<T, B>) -> SnapshotGuard<T, B> {
        #[cfg(prefill_loom)]
        if self.mutant == Mutant::TwoCells {
            return SnapshotGuard::detached(self.two_cells.load());
        }
        cell.load()
    }

    /// The end of a step's critical section (`DropUnderLock`: drop what it took out, here).
    pub(crate) fn before_unlock<X: Default, Y>(&self, trash: &mut X, built: &mut Option<Y>) {
        if self.mutant == Mutant::DropUnderLock {
            drop(std::mem::take(trash));
            drop(built.take());
        }
    }

    /// Publish `next` (if any) under the lock `guard` holds, then release it
    /// (`PublishOutsideLock`: release first; `TwoCells`: also mirror into the two cells).
    pub(crate) fn publish_and_unlock<G>(
        &self,
        cell: &RouteCell<T, B>,
        next: Option<Arc<Snapshot<T, B>>>,
        guard: G,
    ) -> Option<Arc<Snapshot<T, B>>> {
        let Some(next) = next else {
            drop(guard);
            return None;
        };
        if self.mutant == Mutant::PublishOutsideLock {
            drop(guard);
            return Some(cell.swap(next));
        }
        #[cfg(prefill_loom)]
        if self.mutant == Mutant::TwoCells {
            self.two_cells.publish(&next);
        }
        let old = cell.swap(next);
        drop(guard);
        Some(old)
    }
}

/// The prefill router's hooks. The mutant (`lagging_route`): requests read a route the driver
/// refreshes when a build finishes, not the cell `set_target` publishes into (upstream's
/// asynchronous binding store); the request-path race test must catch it.
#[cfg(feature = "runtime")]
///
/// Conditional disaggregation adds a test hook (`after_probe`: awaited between the probe and
/// the dispatch, where a test retargets) and a mutant (`reload_for_dispatch`: the dispatch
/// loads the route again instead of using the probed binding, upstream's W10).
pub(crate) struct RouterHooks<B> {
    lagging: Option<std::sync::Mutex<Route<B>>>,
    after_probe: Option<ProbeHook>,
    reload_for_dispatch: bool,
}

/// What a test runs between a request's conditional probe and its dispatch.
#[cfg(feature = "runtime")]
pub(crate) type ProbeHook =
    Arc<dyn Fn() -> futures_util::future::BoxFuture<'static, ()> + Send + Sync>;

#[cfg(feature = "runtime")]
impl<B> Default for RouterHooks<B> {
    fn default() -> Self {
        RouterHooks {
            lagging: None,
            after_probe: None,
            reload_for_dispatch: false,
        }
    }
}

#[cfg(feature = "runtime")]
impl<B> RouterHooks<B> {
    /// Hooks running the lagging-route mutant.
    pub(crate) fn lagging_route() -> Self {
        RouterHooks {
            lagging: Some(std::sync::Mutex::new(Route::Bypass(
                BypassReason::NotYetTargeted,
            ))),
            ..RouterHooks::default()
        }
    }

    /// Hooks running `hook` between each conditional probe and its dispatch; with `reload`,
    /// also the mutant that dispatches on a freshly loaded binding.
    pub(crate) fn probe_hook(hook: ProbeHook, reload: bool) -> Self {
        RouterHooks {
            after_probe: Some(hook),
            reload_for_dispatch: reload,
            ..RouterHooks::default()
        }
    }

    /// Between the conditional probe and the dispatch: the test's hook, if any.
    pub(crate) fn after_probe(&self) -> futures_util::future::BoxFuture<'static, ()> {
        match &self.after_probe {
            Some(hook) => hook(),
            None => Box::pin(std::future::ready(())),
        }
    }

    /// The binding a probed request dispatches on: the probed one, or (the mutant) whatever
    /// the route says now.
    pub(crate) fn dispatch_binding(
        &self,
        probed: Arc<B>,
        reload: impl FnOnce() -> Route<B>,
    ) -> Arc<B> {
        if !self.reload_for_dispatch {
            return probed;
        }
        match reload() {
            Route::Prefill(now) => now,
            Route::Bypass(_) => probed,
        }
    }

    fn lagging(&self) -> Option<std::sync::MutexGuard<'_, Route<B>>> {
        let lagging = self.lagging.as_ref()?;
        Some(lagging.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The route for one request: the real one, or the lagging copy.
    #[inline]
    pub(crate) fn route(&self, real: impl FnOnce() -> Route<B>) -> Route<B> {
        match self.lagging() {
            Some(lagging) => lagging.clone(),
            None => real(),
        }
    }

    /// A build finished: the lagging copy catches up with `route`.
    pub(crate) fn build_finished(&self, route: impl FnOnce() -> Route<B>) {
        if let Some(mut lagging) = self.lagging() {
            *lagging = route();
        }
    }
}

/// The binding factory's hooks. The mutant: views ignore the admission set (the admission
/// check must catch it).
///
/// Second mutant: every binding the factory builds shares the first one's session-affinity
/// table, so a rebuilt binding inherits the old entries (the affinity checks must catch it).
#[cfg(feature = "runtime")]
#[derive(Clone, Debug, Default)]
pub(crate) struct FactoryHooks {
    ignore_admission: bool,
    inherited_affinity: Option<Arc<parking_lot::Mutex<Option<Arc<crate::push::AffinityTable>>>>>,
}

#[cfg(feature = "runtime")]
impl FactoryHooks {
    /// Hooks running the mutant that ignores the admission set.
    pub(crate) fn ignore_admission() -> Self {
        FactoryHooks {
            ignore_admission: true,
            inherited_affinity: None,
        }
    }

    /// Hooks running the mutant whose rebuilt bindings inherit the affinity table.
    pub(crate) fn inherit_affinity() -> Self {
        FactoryHooks {
            ignore_admission: false,
            inherited_affinity: Some(Arc::default()),
        }
    }

    /// The session-affinity table of a new binding's dispatcher (the mutant: the first table
    /// the factory ever made).
    pub(crate) fn affinity_table(
        &self,
        fresh: Option<Arc<crate::push::AffinityTable>>,
    ) -> Option<Arc<crate::push::AffinityTable>> {
        let Some(shared) = &self.inherited_affinity else {
            return fresh;
        };
        let mut shared = shared.lock();
        if shared.is_none() {
            *shared = fresh;
        }
        shared.clone()
    }

    /// Whether views ignore the admission set.
    pub(crate) fn ignores_admission(&self) -> bool {
        self.ignore_admission
    }
}

/// The dispatcher's hooks. The mutant: a retry may pick the worker that just failed (the retry
/// tests must catch it).
#[cfg(feature = "runtime")]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct DispatchHooks {
    reuse_failed: bool,
    affinity_ignores_routable: bool,
    keep_kv_on_reconnect: bool,
}

#[cfg(feature = "runtime")]
impl DispatchHooks {
    /// Hooks running the mutant whose retries reuse the failed worker.
    pub(crate) fn reuse_failed() -> Self {
        DispatchHooks {
            reuse_failed: true,
            affinity_ignores_routable: false,
            keep_kv_on_reconnect: false,
        }
    }

    /// Hooks running the mutant whose session affinity sends a session to its remembered
    /// worker whether or not it is still routable (outside admission, breaker open).
    pub(crate) fn affinity_ignores_routable() -> Self {
        DispatchHooks {
            affinity_ignores_routable: true,
            ..DispatchHooks::default()
        }
    }

    /// Whether a session's remembered worker must be routable to get the request.
    pub(crate) fn affinity_checks_routable(&self) -> bool {
        !self.affinity_ignores_routable
    }

    /// Hooks running the mutant that keeps a worker's KV index entries when its connection
    /// (and so its event stream) ends or is replaced.
    pub(crate) fn keep_kv_on_reconnect() -> Self {
        DispatchHooks {
            keep_kv_on_reconnect: true,
            ..DispatchHooks::default()
        }
    }

    /// Whether a reconnect or a closed connection drops the worker's KV index entries.
    pub(crate) fn resets_kv_on_reconnect(&self) -> bool {
        !self.keep_kv_on_reconnect
    }

    /// Whether a failed worker is excluded from the request's later attempts.
    pub(crate) fn excludes_failed(&self) -> bool {
        !self.reuse_failed
    }
}

/// The discovery watchers' known-set hooks. The mutant: a resync replaces the known set without
/// diffing it (the resync test must catch it).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct KnownHooks {
    blind_resync: bool,
}

impl KnownHooks {
    /// Hooks running the blind-resync mutant.
    pub(crate) fn blind_resync() -> Self {
        KnownHooks { blind_resync: true }
    }

    /// Whether a resync forgets what is known before diffing.
    pub(crate) fn is_blind_resync(&self) -> bool {
        self.blind_resync
    }
}
