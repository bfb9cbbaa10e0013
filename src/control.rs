//! The synchronous, thread-safe control core: the retarget [`Machine`] behind a lock, the
//! binding store, and the published [`RouteCell`].
//!
//! Every method takes the lock, feeds one input to the machine, applies the actions that touch
//! only memory (`Publish`, `Retire`, `Discard`), publishes the new [`Snapshot`] if what it
//! shows requests changed, releases the lock, and only then drops whatever bindings and
//! snapshots it took out. It returns the [`Effects`] the async side must carry out (start or cancel a build, arm
//! or disarm a retry timer).
//!
//! Why publish under the lock: two concurrent calls must publish in the order the machine
//! handled them. Publishing after unlocking lets a slower call store an older snapshot over a
//! newer one (a late `Active` over a clear); the loom suite keeps a mutant that does exactly
//! that and shows it caught. Why drop after unlocking: a binding's `Drop` may do real work
//! (cancel tasks, close channels) and must not extend the critical section or re-enter.
//!
//! Clearing is synchronous: once `set_target(None)` returns, every later
//! [`load`](Control::load) or [`snapshot`](Control::route) sees the cleared state.
//!
//! ```
//! use prefill_router::control::{Control, Effect};
//! use prefill_router::lifecycle::RetryPolicy;
//! use prefill_router::snapshot::{BypassReason, Route};
//!
//! let control: Control<&str, String> = Control::new(RetryPolicy::default());
//! assert_eq!(control.route(), Route::Bypass(BypassReason::NotYetTargeted));
//!
//! // The controller picks a target; the async side carries out the effects.
//! for effect in control.set_target(Some("gen-1")) {
//!     if let Effect::StartBuild { build, target } = effect {
//!         // ... build the router for `target`, then report it under `build`:
//!         let _ = control.build_succeeded(build, format!("router for {target}"));
//!     }
//! }
//!
//! // Request path, the decision: one guard load, no refcount traffic.
//! let snapshot = control.load();
//! assert_eq!(snapshot.binding().map(|b| b.as_str()), Some("router for gen-1"));
//! drop(snapshot);
//! // Admission: an owned binding for the dispatch.
//! let Route::Prefill(binding) = control.route() else { unreachable!() };
//!
//! // Clearing is visible to every load after the call returns; the request holding
//! // `binding` finishes on it.
//! let _ = control.set_target(None);
//! assert_eq!(control.route(), Route::Bypass(BypassReason::NoTarget));
//! assert_eq!(*binding, "router for gen-1");
//! ```

use std::fmt;
use std::sync::Arc;

use crate::lifecycle::{Action, BuildId, Input, Lifecycle, Machine, RetryPolicy};
use crate::snapshot::{BypassReason, Route, RouteCell, Snapshot, SnapshotGuard};
use crate::sync::Mutex;

mod effects;
mod mutant;
mod retired;

pub use effects::{Effect, Effects, EffectsIntoIter};
// The deliberate mutants of the core, for the loom suite (an integration test) and the unit
// tests; the type stays private to normal builds, where nothing arms it.
use mutant::ControlSeam;
#[cfg(any(test, prefill_loom))]
pub use mutant::Mutant;

use retired::Retired;

/// Counters since creation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Counters {
    /// Bindings published (successful current builds).
    pub published: u64,
    /// Bindings from stale builds dropped unpublished.
    pub discarded: u64,
    /// Held bindings retired (retarget or shutdown).
    pub retired: u64,
    /// Retired bindings still referenced (in-flight requests), among those tracked.
    pub retired_alive: usize,
    /// Retired bindings no longer tracked because too many were alive at once.
    pub retired_untracked: u64,
    /// Snapshots published into the cell (equals the current epoch).
    pub snapshots: u64,
}

/// A consistent picture of the control core, taken under its lock (for status pages, tests).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ControlStatus<T> {
    /// The machine's lifecycle.
    pub lifecycle: Lifecycle,
    /// Whether the controller has decided anything yet.
    pub targeted: bool,
    /// The desired target.
    pub desired: Option<T>,
    /// The held binding's build and target (serving when Active, kept for reuse otherwise).
    pub held: Option<(BuildId, T)>,
    /// The build under way.
    pub in_flight: Option<(BuildId, T)>,
    /// The armed retry timer, named by the failed build it follows.
    pub retry_armed: Option<BuildId>,
    /// Consecutive failed builds for the desired target.
    pub failures: u32,
    /// The error text of the last accepted build failure; cleared by the next publish.
    pub last_error: Option<String>,
    /// The epoch of the published snapshot.
    pub epoch: u64,
    /// Whether `shutdown` was called.
    pub shut_down: bool,
    /// Counters since creation.
    pub counters: Counters,
}

/// State guarded by the lock.
struct Inner<T, B> {
    machine: Machine<T>,
    /// The binding of `machine.held()`, same build id.
    held: Option<(BuildId, Arc<B>)>,
    /// What the last published snapshot shows requests, kept to skip no-op publishes. A key,
    /// not an `Arc` of the snapshot: holding one would cost two more atomic refcount updates
    /// per publish.
    shown: SnapshotKey<T>,
    /// The epoch of the last published snapshot.
    epoch: u64,
    last_error: Option<String>,
    counters: Counters,
    retired: Retired<B>,
}

/// Things taken out under the lock and dropped after it is released.
struct Trash<T, B> {
    last_error: Option<String>,
    discarded: Option<Arc<B>>,
    retired: Option<Arc<B>>,
    old_snapshot: Option<Arc<Snapshot<T, B>>>,
}

impl<T, B> Default for Trash<T, B> {
    fn default() -> Self {
        Trash {
            last_error: None,
            discarded: None,
            retired: None,
            old_snapshot: None,
        }
    }
}

/// What one step did, for logging after the lock is released.
#[derive(Default)]
struct Report {
    published: Option<BuildId>,
    discarded: Option<BuildId>,
    retired: Option<BuildId>,
    /// An accepted failure: the retry it scheduled and the error text (a copy made before the
    /// lock, so logging needs no allocation under it).
    retry: Option<(BuildId, std::time::Duration, u32, String)>,
    epoch: Option<(u64, Lifecycle)>,
}

/// The control core for one prefill hop. `Send + Sync` when `T` and `B` are.
///
/// `T` names a target (e.g. a worker-set generation); `B` is the binding built for it (the
/// router and clients a request dispatches through).
pub struct Control<T, B> {
    inner: Mutex<Inner<T, B>>,
    cell: RouteCell<T, B>,
    /// Where the deliberate mutants break the publication protocol; zero-sized in normal builds.
    seam: ControlSeam<T, B>,
}

impl<T, B> Control<T, B>
where
    T: Clone + Eq + fmt::Debug,
{
    /// A fresh core: Pending, not yet targeted, epoch 0.
    pub fn new(policy: RetryPolicy) -> Self {
        let initial = Arc::new(Snapshot::initial());
        Control {
            inner: Mutex::new(Inner {
                machine: Machine::new(policy),
                held: None,
                shown: SnapshotKey::of(&initial),
                epoch: initial.epoch(),
                last_error: None,
                counters: Counters::default(),
                retired: Retired::new(),
            }),
            cell: RouteCell::new(initial),
            seam: ControlSeam::default(),
        }
    }

    /// A core running a deliberate mutant of its protocol (the loom suite and the unit tests
    /// show that their checks catch each).
    #[cfg(any(test, prefill_loom))]
    pub fn with_mutant(policy: RetryPolicy, mutant: Mutant) -> Self {
        let mut control = Control::new(policy);
        control.seam = ControlSeam::on(mutant);
        control
    }

    /// The controller's decision: route prefill to `target`, or to nothing (`None`).
    pub fn set_target(&self, target: Option<T>) -> Effects<T> {
        self.step(Input::SetTarget(target), None, None)
    }

    /// Build `build` produced `binding`: published if `build` is the current build, dropped
    /// (after the lock is released) if it is stale.
    pub fn build_succeeded(&self, build: BuildId, binding: B) -> Effects<T> {
        // Allocate outside the lock.
        let binding = Arc::new(binding);
        self.step(Input::BuildSucceeded(build), Some((build, binding)), None)
    }

    /// Build `build` failed (a timeout counts): a retry is scheduled if it was current.
    pub fn build_failed(&self, build: BuildId, err: impl fmt::Display) -> Effects<T> {
        // Format outside the lock; the text is kept only if the failure is accepted.
        let text = err.to_string();
        let copy = text.clone();
        self.step(Input::BuildFailed(build), None, Some((text, copy)))
    }

    /// The retry timer armed after `after` fired.
    pub fn retry_elapsed(&self, after: BuildId) -> Effects<T> {
        self.step(Input::RetryElapsed(after), None, None)
    }

    /// Stop for good: cancels the build and the timer, retires the binding, publishes ShutDown.
    pub fn shutdown(&self) -> Effects<T> {
        self.step(Input::Shutdown, None, None)
    }

    /// Whether `binding` is the held binding (serving when Active, kept for reuse otherwise).
    /// A binding that was published and is no longer held was retired. Takes the lock.
    pub fn holds(&self, binding: &Arc<B>) -> bool {
        self.inner
            .lock()
            .held
            .as_ref()
            .is_some_and(|(_, held)| Arc::ptr_eq(held, binding))
    }

    /// Held bindings retired so far (the `retired` counter). Takes the lock.
    pub fn retired_count(&self) -> u64 {
        self.inner.lock().counters.retired
    }

    /// The current snapshot, pinned by a guard: one lock-free load, no `Arc` clone. Use it for
    /// the routing decision; do not hold it across an `.await`.
    #[inline]
    pub fn load(&self) -> SnapshotGuard<T, B> {
        self.seam.load(&self.cell)
    }

    /// The route for one request: one lock-free load, plus one `Arc` clone when prefilling.
    #[inline]
    pub fn route(&self) -> Route<B> {
        self.load().route()
    }

    /// A consistent status picture (takes the lock briefly).
    pub fn status(&self) -> ControlStatus<T> {
        let inner = self.inner.lock();
        let m = &inner.machine;
        let mut counters = inner.counters;
        counters.retired_alive = inner.retired.alive();
        counters.retired_untracked = inner.retired.untracked();
        ControlStatus {
            lifecycle: m.lifecycle(),
            targeted: m.is_targeted(),
            desired: m.desired().cloned(),
            held: m.held().map(|(b, t)| (b, t.clone())),
            in_flight: m.in_flight().map(|(b, t)| (b, t.clone())),
            retry_armed: m.retry_armed(),
            failures: m.failures(),
            last_error: inner.last_error.clone(),
            epoch: inner.epoch,
            shut_down: m.is_shut_down(),
            counters,
        }
    }

    /// Whether the control lock is held right now (tests use it from a binding's `Drop` to show
    /// that bindings are never dropped under the lock).
    #[cfg(all(test, not(prefill_loom)))]
    pub(crate) fn lock_is_held(&self) -> bool {
        self.inner.is_locked()
    }

    /// One input: machine step, in-memory actions, publish, all under the lock; drops and logs
    /// after it.
    fn step(
        &self,
        input: Input<T>,
        built: Option<(BuildId, Arc<B>)>,
        mut error: Option<(String, String)>,
    ) -> Effects<T> {
        let mut effects = Effects::default();
        let mut trash = Trash::default();
        let mut report = Report::default();
        let mut built = built;
        {
            let mut guard = self.inner.lock();
            let inner = &mut *guard;
            let actions = inner.machine.handle(input);
            for action in actions {
                match action {
                    Action::Publish { build, .. } => {
                        if let Some((id, binding)) = built.take_if(|(id, _)| *id == build) {
                            inner.held = Some((id, binding));
                            inner.counters.published += 1;
                            trash.last_error = inner.last_error.take();
                            report.published = Some(build);
                        }
                    }
                    Action::Discard { build } => {
                        if let Some((_, binding)) = built.take_if(|(id, _)| *id == build) {
                            trash.discarded = Some(binding);
                            inner.counters.discarded += 1;
                            report.discarded = Some(build);
                        }
                    }
                    Action::Retire { build } => {
                        if let Some((_, binding)) = inner.held.take_if(|(id, _)| *id == build) {
                            inner.retired.track(&binding);
                            trash.retired = Some(binding);
                            inner.counters.retired += 1;
                            report.retired = Some(build);
                        }
                    }
                    other => {
                        if let Action::ScheduleRetry {
                            after,
                            delay,
                            attempt,
                        } = &other
                        {
                            if let Some((text, copy)) = error.take() {
                                // The replaced text drops after the lock, with the trash.
                                trash.last_error = inner.last_error.replace(text);
                                report.retry = Some((*after, *delay, *attempt, copy));
                            }
                        }
                        if let Some(effect) = Effect::from_action(other) {
                            effects.push(effect);
                        }
                    }
                }
            }
            let next = next_snapshot(inner);
            if let Some(next) = &next {
                report.epoch = Some((next.epoch(), next.lifecycle()));
                inner.counters.snapshots = next.epoch();
            }
            self.seam.before_unlock(&mut trash, &mut built);
            // Publish while the lock is held, so snapshots land in step order; the replaced
            // one drops after the lock, with the rest of the trash.
            trash.old_snapshot = self.seam.publish_and_unlock(&self.cell, next, guard);
        }
        self.finish(effects, trash, report, built)
    }

    /// After the lock: drop what was taken out, log what happened.
    #[inline]
    fn finish(
        &self,
        effects: Effects<T>,
        trash: Trash<T, B>,
        report: Report,
        built: Option<(BuildId, Arc<B>)>,
    ) -> Effects<T> {
        drop(trash);
        // A success always yields Publish or Discard, so nothing is left; if a future machine
        // answered neither, the binding still drops here, outside the lock.
        drop(built);
        if let Some(build) = report.published {
            tracing::debug!(%build, "prefill binding published");
        }
        if let Some(build) = report.discarded {
            tracing::debug!(%build, "stale prefill build discarded");
        }
        if let Some(build) = report.retired {
            tracing::debug!(%build, "prefill binding retired");
        }
        if let Some((after, delay, attempt, error)) = report.retry {
            tracing::warn!(build = %after, ?delay, attempt, %error, "prefill build failed; retry scheduled");
        }
        if let Some((epoch, lifecycle)) = report.epoch {
            tracing::trace!(epoch, %lifecycle, "prefill route snapshot published");
        }
        effects
    }
}

/// What a snapshot shows requests, epoch aside. The binding is identified by its build id:
/// Control holds exactly one binding per held build.
#[derive(Debug, PartialEq, Eq)]
struct SnapshotKey<T> {
    lifecycle: Lifecycle,
    bypass: Option<BypassReason>,
    target: Option<T>,
    build: Option<BuildId>,
}

impl<T: Clone> SnapshotKey<T> {
    fn of<B>(s: &Snapshot<T, B>) -> Self {
        SnapshotKey {
            lifecycle: s.lifecycle(),
            bypass: s.bypass(),
            target: s.target().cloned(),
            build: s.build(),
        }
    }
}

/// The snapshot the machine's state calls for, or `None` if it shows requests nothing new.
/// Updates the snapshot key and the epoch when it returns a snapshot.
fn next_snapshot<T, B>(inner: &mut Inner<T, B>) -> Option<Arc<Snapshot<T, B>>>
where
    T: Clone + Eq + fmt::Debug,
{
    let m = &inner.machine;
    let lifecycle = m.lifecycle();
    let (bypass, build) = match lifecycle {
        Lifecycle::Active => match &inner.held {
            Some((id, _)) => (None, Some(*id)),
            // Active means the machine holds a binding, and Control stores every binding the
            // machine holds; bypass rather than panic if that ever broke.
            None => (Some(BypassReason::Building), None),
        },
        Lifecycle::Unavailable if m.is_shut_down() => (Some(BypassReason::ShutDown), None),
        Lifecycle::Unavailable => (Some(BypassReason::NoTarget), None),
        Lifecycle::Pending if !m.is_targeted() => (Some(BypassReason::NotYetTargeted), None),
        Lifecycle::Pending => match (m.in_flight(), m.retry_armed()) {
            (_, Some(after)) => (Some(BypassReason::RetryingAfterFailure), Some(after)),
            (Some((id, _)), None) => (Some(BypassReason::Building), Some(id)),
            (None, None) => (Some(BypassReason::Building), None),
        },
    };
    let shown = &inner.shown;
    if shown.lifecycle == lifecycle
        && shown.bypass == bypass
        && shown.build == build
        && shown.target.as_ref() == m.desired()
    {
        return None;
    }
    let route = match (bypass, &inner.held) {
        (None, Some((_, binding))) => Route::Prefill(Arc::clone(binding)),
        (Some(reason), _) => Route::Bypass(reason),
        (None, None) => Route::Bypass(BypassReason::Building),
    };
    let target = m.desired().cloned();
    inner.epoch += 1;
    inner.shown = SnapshotKey {
        lifecycle,
        bypass,
        target: target.clone(),
        build,
    };
    Some(Arc::new(Snapshot {
        lifecycle,
        route,
        target,
        build,
        epoch: inner.epoch,
    }))
}

impl<T, B> fmt::Debug for Control<T, B>
where
    T: Clone + Eq + fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Control")
            .field("status", &self.status())
            .finish()
    }
}

#[cfg(all(test, not(prefill_loom)))]
mod tests;
