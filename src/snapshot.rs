//! The published state of the hop that requests read: one immutable [`Snapshot`] per change,
//! held in one cell, so a single lock-free load gives a consistent lifecycle/binding pair.
//!
//! Upstream keeps the lifecycle in an `AtomicU8` and the binding in a separate
//! `ArcSwapOption`: a request can pass the gate as Active and then load a binding that was
//! already withdrawn, or a binding for a different target. Here the pair is
//! published together, so it can only be observed together.
//!
//! The hot path reads through a guard ([`RouteCell::load`]) without touching any reference
//! count; [`Snapshot::route`] clones the binding `Arc` only when the request dispatches on it.

use std::fmt;
use std::sync::Arc;

use crate::lifecycle::{BuildId, Lifecycle};
use crate::sync::{ArcCell, CellGuard};

/// Why a request does not prefill on the hop (it goes to the decode pool directly).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BypassReason {
    /// The controller has not chosen a target yet.
    NotYetTargeted,
    /// A binding for the desired target is being built.
    Building,
    /// The last build for the desired target failed; a retry is scheduled.
    RetryingAfterFailure,
    /// The controller said there is no prefill target.
    NoTarget,
    /// The hop was shut down for good.
    ShutDown,
}

impl BypassReason {
    /// A short, stable, lower-case label (for metrics and logs).
    pub fn as_str(self) -> &'static str {
        match self {
            BypassReason::NotYetTargeted => "not_yet_targeted",
            BypassReason::Building => "building",
            BypassReason::RetryingAfterFailure => "retrying_after_failure",
            BypassReason::NoTarget => "no_target",
            BypassReason::ShutDown => "shut_down",
        }
    }
}

impl fmt::Display for BypassReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The answer for one request: prefill on this binding, or bypass the hop for this reason.
#[derive(Debug, PartialEq, Eq)]
pub enum Route<B> {
    /// Prefill on this binding; holding the `Arc` keeps a retired binding alive until the
    /// request finishes.
    Prefill(Arc<B>),
    /// Skip the prefill hop.
    Bypass(BypassReason),
}

// Manual impl: cloning a route clones the `Arc`, it needs no `B: Clone`.
impl<B> Clone for Route<B> {
    fn clone(&self) -> Self {
        match self {
            Route::Prefill(b) => Route::Prefill(Arc::clone(b)),
            Route::Bypass(r) => Route::Bypass(*r),
        }
    }
}

impl<B> Route<B> {
    /// Whether the request prefills.
    pub fn is_prefill(&self) -> bool {
        matches!(self, Route::Prefill(_))
    }

    /// The binding to prefill on, if any.
    pub fn binding(&self) -> Option<&Arc<B>> {
        match self {
            Route::Prefill(b) => Some(b),
            Route::Bypass(_) => None,
        }
    }

    /// The bypass reason, if the request bypasses.
    pub fn bypass(&self) -> Option<BypassReason> {
        match self {
            Route::Prefill(_) => None,
            Route::Bypass(r) => Some(*r),
        }
    }
}

/// One immutable published state of the hop.
///
/// Invariant (by construction in [`Control`](crate::control::Control)): a binding is present
/// exactly when the lifecycle is [`Lifecycle::Active`], and then it was built for
/// [`Snapshot::target`]; otherwise [`Snapshot::bypass`] says why not.
#[derive(Debug)]
pub struct Snapshot<T, B> {
    pub(crate) lifecycle: Lifecycle,
    pub(crate) route: Route<B>,
    pub(crate) target: Option<T>,
    pub(crate) build: Option<BuildId>,
    pub(crate) epoch: u64,
}

impl<T, B> Snapshot<T, B> {
    /// The state before anything was decided: Pending, bypass `NotYetTargeted`, epoch 0.
    pub fn initial() -> Self {
        Snapshot {
            lifecycle: Lifecycle::Pending,
            route: Route::Bypass(BypassReason::NotYetTargeted),
            target: None,
            build: None,
            epoch: 0,
        }
    }

    /// The lifecycle published with this snapshot.
    #[inline]
    pub fn lifecycle(&self) -> Lifecycle {
        self.lifecycle
    }

    /// The binding requests prefill on; `Some` only when Active. Borrowed: no refcount traffic.
    #[inline]
    pub fn binding(&self) -> Option<&Arc<B>> {
        self.route.binding()
    }

    /// Why requests bypass the hop; `None` only when Active.
    #[inline]
    pub fn bypass(&self) -> Option<BypassReason> {
        self.route.bypass()
    }

    /// The route for a request, borrowed (the decision, no `Arc` clone).
    #[inline]
    pub fn route_ref(&self) -> &Route<B> {
        &self.route
    }

    /// The route for a request, owned: clones the binding `Arc` for the dispatch (admission).
    #[inline]
    pub fn route(&self) -> Route<B> {
        self.route.clone()
    }

    /// The desired target (`None` before the first decision, after a clear and after shutdown).
    pub fn target(&self) -> Option<&T> {
        self.target.as_ref()
    }

    /// The build this snapshot is about: when Active the build that produced the binding, when
    /// Building the build in flight, when retrying the failed build the retry follows.
    pub fn build(&self) -> Option<BuildId> {
        self.build
    }

    /// Publication counter: 0 for the initial snapshot, +1 per published change. Strictly
    /// increases along the sequence of snapshots a cell holds.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
}

/// A read guard pinning one [`Snapshot`]; derefs to it. Keep it short-lived: a guard held
/// across an `.await` pins the snapshot and its binding.
///
/// A newtype, so the cell behind it (arc-swap today: a guard with no reference-count traffic on
/// the shared snapshot; a cloned `Arc` under the loom cfg) is not part of the public API.
pub struct SnapshotGuard<T, B>(CellGuard<Snapshot<T, B>>);

impl<T, B> SnapshotGuard<T, B> {
    /// A guard over a snapshot that is not in any cell (the loom suite's `TwoCells` mutant).
    #[cfg(prefill_loom)]
    pub(crate) fn detached(snapshot: Arc<Snapshot<T, B>>) -> Self {
        SnapshotGuard(snapshot)
    }

    /// The pinned snapshot as an owned `Arc` (one reference-count increment), for a caller
    /// that must keep it beyond the guard's short life.
    pub fn to_arc(&self) -> Arc<Snapshot<T, B>> {
        Arc::clone(&self.0)
    }

    /// Whether two guards pin the very same published snapshot (not merely equal ones).
    pub fn same_snapshot(a: &Self, b: &Self) -> bool {
        Arc::ptr_eq(&a.0, &b.0)
    }
}

impl<T, B> std::ops::Deref for SnapshotGuard<T, B> {
    type Target = Snapshot<T, B>;

    #[inline]
    fn deref(&self) -> &Snapshot<T, B> {
        &self.0
    }
}

impl<T: fmt::Debug, B: fmt::Debug> fmt::Debug for SnapshotGuard<T, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("SnapshotGuard").field(&**self).finish()
    }
}

/// The cell holding the current `Arc<Snapshot>`: lock-free loads, whole-snapshot stores.
///
/// Only [`Control`](crate::control::Control) stores into it (under its lock); any number of
/// request threads read it.
pub struct RouteCell<T, B> {
    cell: ArcCell<Snapshot<T, B>>,
}

impl<T, B> RouteCell<T, B> {
    /// A cell holding `snapshot`.
    pub fn new(snapshot: Arc<Snapshot<T, B>>) -> Self {
        RouteCell {
            cell: ArcCell::new(snapshot),
        }
    }

    /// The current snapshot, pinned by a guard (one lock-free load; the decision hot path).
    #[inline]
    pub fn load(&self) -> SnapshotGuard<T, B> {
        SnapshotGuard(self.cell.load())
    }

    /// The current route, owned (one load plus one `Arc` clone when Active; admission).
    #[inline]
    pub fn route(&self) -> Route<B> {
        self.cell.load().route()
    }

    /// Publish `snapshot`; returns the previous one so the caller decides where it drops (a
    /// snapshot may hold the last reference to a retired binding).
    pub(crate) fn swap(&self, snapshot: Arc<Snapshot<T, B>>) -> Arc<Snapshot<T, B>> {
        self.cell.swap(snapshot)
    }
}

impl<T, B> fmt::Debug for RouteCell<T, B>
where
    T: fmt::Debug,
    B: fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let guard = self.load();
        let snapshot: &Snapshot<T, B> = &guard;
        f.debug_tuple("RouteCell").field(snapshot).finish()
    }
}

#[cfg(test)]
mod tests;
