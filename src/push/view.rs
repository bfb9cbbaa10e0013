//! The routable-instance view.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Weak};

use futures_core::Stream;
use futures_util::StreamExt;
use parking_lot::{Mutex, RwLock};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::health::{Feed, Prober, Tasks};
use crate::discovery::{Instance, InstanceEvent, InstanceId};
use crate::health::{Action, BackoffPolicy, Breaker, FailureClass, Input, Machine};

/// Seed of the breakers' jitter. Fixed: the jitter also mixes in each timer's fresh id, so
/// instances that failed together still probe at different moments.
const HEALTH_SEED: u64 = 0x6865_616c_7468;

/// Where one instance stands in the view.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InstanceStatus {
    /// Requests may go to it.
    Routable(Arc<Instance>),
    /// Discovered, but not in the admission set.
    NotAdmitted,
    /// Discovered, but its breaker is not closed (a connection failed): routable again once
    /// a probe connects, or when discovery removes and re-adds it.
    Unhealthy(Breaker),
    /// Not in discovery.
    Unknown,
}

struct State {
    discovered: BTreeMap<InstanceId, Arc<Instance>>,
    /// One breaker per discovered instance (fed the same Added/Removed as `discovered`).
    health: Machine<InstanceId>,
    /// The machine's pending timers and probes.
    tasks: Tasks,
    /// `discovered` with a closed breaker, by id, rebuilt on each change so reads only copy it.
    usable: Arc<[Arc<Instance>]>,
    /// Instances that announced a drain on a connection to this address: left out of
    /// `usable` (no failure, no breaker) until discovery removes them or lists them at
    /// another address.
    draining: BTreeMap<InstanceId, SocketAddr>,
}

impl State {
    fn rebuild(&mut self) {
        self.usable = self
            .discovered
            .iter()
            .filter(|(id, i)| {
                self.health.is_routable(id) && self.draining.get(id) != Some(&i.address)
            })
            .map(|(_, i)| Arc::clone(i))
            .collect();
    }
}

/// The last admission-filtered routable set, reused while neither `usable` nor the admission
/// set changed: a pick then costs one reference-count increment instead of a filtered copy of
/// the pool, and callers can tell a new set by pointer (the KV load board re-syncs on it).
struct Filtered {
    /// A receiver of its own, so `has_changed` tracks what this cache has seen.
    admission: watch::Receiver<BTreeSet<InstanceId>>,
    usable: Arc<[Arc<Instance>]>,
    routable: Arc<[Arc<Instance>]>,
    /// The admission sender was gone when this was computed: its last value is final.
    closed: bool,
}

struct Inner {
    state: RwLock<State>,
    admission: Option<watch::Receiver<BTreeSet<InstanceId>>>,
    filtered: Mutex<Option<Filtered>>,
    /// Bumped on every change of `state`, so waiters can re-check.
    epoch: watch::Sender<u64>,
    /// Parent of every timer and probe task; cancelled when the last clone of the view drops.
    tasks: CancellationToken,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.tasks.cancel();
    }
}

/// Timers and probes hold the view weakly, so a pending probe never keeps a dropped view alive.
struct WeakFeed(Weak<Inner>);

impl Feed for WeakFeed {
    fn feed(&self, input: Input<InstanceId>) {
        if let Some(inner) = self.0.upgrade() {
            RoutableView { inner }.health_input(input);
        }
    }
}

/// Instances from discovery, intersected with an optional admission set, minus instances whose
/// health breaker is open (docs/health.md). Cheap to clone (all clones share one view).
///
/// The view owns a [`health::Machine`](crate::health::Machine): a counting failure reported
/// with [`RoutableView::report_failure`] opens the instance's breaker, the view probes it (a
/// TCP connect) after a capped, jittered backoff, and a probe that connects closes it. Timers
/// and probes stop when the view is dropped, when the `cancel` token given at construction
/// fires, or when discovery removes the instance.
#[derive(Clone)]
pub struct RoutableView {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RoutableView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.inner.state.read();
        f.debug_struct("RoutableView")
            .field("discovered", &state.discovered.keys().collect::<Vec<_>>())
            .field("open_breakers", &state.health.open_count())
            .field("admission", &self.inner.admission.is_some())
            .finish()
    }
}

impl RoutableView {
    /// Build a view fed by `events` on a task (spawned on the current tokio runtime, so call it
    /// within one) that runs until `cancel` fires or the stream ends.
    ///
    /// `admission`: `None` means every discovered instance is admitted; `Some` restricts to the
    /// ids in the current set (an empty set admits nothing). Admission is read at each pick, so
    /// a change takes effect on the next request.
    ///
    /// Breakers use the default [`BackoffPolicy`]; see [`RoutableView::spawn_with`].
    pub fn spawn<S>(
        events: S,
        admission: Option<watch::Receiver<BTreeSet<InstanceId>>>,
        cancel: CancellationToken,
    ) -> Self
    where
        S: Stream<Item = InstanceEvent> + Send + 'static,
    {
        Self::spawn_with(events, admission, cancel, BackoffPolicy::default())
    }

    /// [`RoutableView::spawn`] with the breakers' backoff between probes of a failed instance.
    pub fn spawn_with<S>(
        events: S,
        admission: Option<watch::Receiver<BTreeSet<InstanceId>>>,
        cancel: CancellationToken,
        health: BackoffPolicy,
    ) -> Self
    where
        S: Stream<Item = InstanceEvent> + Send + 'static,
    {
        Self::spawn_with_prober(events, admission, cancel, health, Prober::tcp())
    }

    /// [`RoutableView::spawn_with`] with a custom probe of open instances (default: a TCP
    /// connect, [`Prober::tcp`]).
    pub fn spawn_with_prober<S>(
        events: S,
        admission: Option<watch::Receiver<BTreeSet<InstanceId>>>,
        cancel: CancellationToken,
        health: BackoffPolicy,
        prober: Prober,
    ) -> Self
    where
        S: Stream<Item = InstanceEvent> + Send + 'static,
    {
        let tasks = cancel.child_token();
        let view = RoutableView {
            inner: Arc::new(Inner {
                state: RwLock::new(State {
                    discovered: BTreeMap::new(),
                    health: Machine::new(health, HEALTH_SEED),
                    tasks: Tasks::new(tasks.clone(), prober),
                    usable: Arc::default(),
                    draining: BTreeMap::new(),
                }),
                admission,
                filtered: Mutex::new(None),
                epoch: watch::Sender::new(0),
                tasks,
            }),
        };
        let fed = view.clone();
        tokio::spawn(async move {
            let mut events = std::pin::pin!(events);
            loop {
                let event = tokio::select! {
                    _ = cancel.cancelled() => break,
                    event = events.next() => event,
                };
                match event {
                    Some(event) => fed.apply(event),
                    None => {
                        tracing::warn!("discovery event stream ended; routable view is frozen");
                        break;
                    }
                }
            }
        });
        view
    }

    /// Apply one discovery event (the view's task does this; exposed for callers that drive
    /// the view themselves, and for tests).
    pub fn apply(&self, event: InstanceEvent) {
        {
            let mut state = self.inner.state.write();
            match event {
                InstanceEvent::Added(instance) => {
                    let id = instance.instance_id;
                    // A repeated Added (a lease refresh) keeps the breaker: only the probe, or a
                    // removal, clears what the machine learned. Added yields no action.
                    let _ = state.health.handle(Input::Added(id));
                    // A drain mark names an address: the instance back elsewhere is new.
                    if state
                        .draining
                        .get(&id)
                        .is_some_and(|addr| *addr != instance.address)
                    {
                        state.draining.remove(&id);
                    }
                    state.discovered.insert(id, Arc::new(instance));
                }
                InstanceEvent::Removed(id) => {
                    state.discovered.remove(&id);
                    state.draining.remove(&id);
                    // Removed yields at most a CancelTimer; a probe in flight is stopped too.
                    let _ = state.health.handle(Input::Removed(id));
                    state.tasks.forget(id);
                }
            }
            state.rebuild();
        }
        self.inner.epoch.send_modify(|e| *e += 1);
    }

    /// Report a failed request to `id`: a failure whose class
    /// [counts against health](FailureClass::counts_against_health) opens the instance's
    /// breaker (it stops being routable until a probe connects); any other class is ignored.
    /// Call within a tokio runtime (the breaker's timer and probe are tokio tasks).
    pub fn report_failure(&self, id: InstanceId, class: FailureClass) {
        self.health_input(Input::Failed {
            instance: id,
            class,
        });
    }

    /// Feed the machine and carry out its actions; the routable set changes only on an open or
    /// a close.
    fn health_input(&self, input: Input<InstanceId>) {
        let changed = {
            let mut state = self.inner.state.write();
            let actions = state.health.handle(input);
            let mut changed = false;
            for action in actions {
                changed |= matches!(action, Action::Open { .. } | Action::Close { .. });
                let address = match &action {
                    Action::StartProbe { instance, .. } => {
                        state.discovered.get(instance).map(|i| i.address)
                    }
                    _ => None,
                };
                let feed = WeakFeed(Arc::downgrade(&self.inner));
                state.tasks.run(action, address, feed);
            }
            if changed {
                state.rebuild();
            }
            changed
        };
        if changed {
            self.inner.epoch.send_modify(|e| *e += 1);
        }
    }

    /// The instance `id` at `address` announced it is draining (it is stopping and finishes
    /// the requests it has): leave it out of the routable set without counting a failure or
    /// opening its breaker, until discovery removes it or lists it at another address.
    /// Ignored when discovery does not list `id` at `address` (it left already, or this is an
    /// old incarnation's connection). [`status`](Self::status) still reports it `Routable`:
    /// a direct send reaches it and is refused by the connection, typed.
    pub fn mark_draining(&self, id: InstanceId, address: SocketAddr) {
        let changed = {
            let mut state = self.inner.state.write();
            let listed = state
                .discovered
                .get(&id)
                .is_some_and(|i| i.address == address);
            if listed && state.draining.insert(id, address) != Some(address) {
                state.rebuild();
                true
            } else {
                false
            }
        };
        if changed {
            tracing::info!(instance = id, %address, "worker draining: no new requests go to it");
            self.inner.epoch.send_modify(|e| *e += 1);
        }
    }

    /// Whether `id` announced a drain (see [`mark_draining`](Self::mark_draining)) and is
    /// still listed at that address.
    pub fn is_draining(&self, id: InstanceId) -> bool {
        let state = self.inner.state.read();
        match (state.draining.get(&id), state.discovered.get(&id)) {
            (Some(addr), Some(instance)) => *addr == instance.address,
            _ => false,
        }
    }

    /// Mark `id` at `address` draining once `notice` resolves to `true` (a connection's
    /// [`drain_notice`](crate::transport::Connection::drain_notice)), on a task that holds the
    /// view weakly and ends with the connection.
    pub(crate) fn mark_draining_on(
        &self,
        id: InstanceId,
        address: SocketAddr,
        notice: impl Future<Output = bool> + Send + 'static,
    ) {
        let view = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            if notice.await {
                if let Some(inner) = view.upgrade() {
                    RoutableView { inner }.mark_draining(id, address);
                }
            }
        });
    }

    /// The breaker of `id`; `None` when discovery does not list it.
    pub fn health(&self, id: InstanceId) -> Option<Breaker> {
        self.inner.state.read().health.breaker(&id)
    }

    /// Breakers not closed (open or probing), over the discovered instances. O(1).
    pub fn open_breakers(&self) -> usize {
        self.inner.state.read().health.open_count()
    }

    /// The routable instances, by ascending id: a shared snapshot (one reference-count
    /// increment, no copy) that stays the same `Arc` until discovery, health or the admission
    /// set changes it.
    pub fn routable(&self) -> Arc<[Arc<Instance>]> {
        let usable = Arc::clone(&self.inner.state.read().usable);
        let Some(admission) = &self.inner.admission else {
            return usable;
        };
        let mut filtered = self.inner.filtered.lock();
        if let Some(f) = filtered.as_ref() {
            // `has_changed` fails once the sender is gone, even if its last value is unseen
            // (an admission set emptied and then dropped): filter once more after the close,
            // then the cache stands for good.
            let unchanged = match f.admission.has_changed() {
                Ok(changed) => !changed,
                Err(_) => f.closed,
            };
            if unchanged && Arc::ptr_eq(&f.usable, &usable) {
                return Arc::clone(&f.routable);
            }
        }
        let mut receiver = filtered
            .take()
            .map_or_else(|| admission.clone(), |f| f.admission);
        let routable: Arc<[Arc<Instance>]> = {
            let admitted = receiver.borrow_and_update();
            usable
                .iter()
                .filter(|i| admitted.contains(&i.instance_id))
                .cloned()
                .collect()
        };
        let closed = receiver.has_changed().is_err();
        *filtered = Some(Filtered {
            admission: receiver,
            usable,
            routable: Arc::clone(&routable),
            closed,
        });
        routable
    }

    /// Where `id` stands.
    pub fn status(&self, id: InstanceId) -> InstanceStatus {
        let state = self.inner.state.read();
        let Some(instance) = state.discovered.get(&id) else {
            return InstanceStatus::Unknown;
        };
        match state.health.breaker(&id) {
            Some(Breaker::Closed) | None => {}
            Some(breaker) => return InstanceStatus::Unhealthy(breaker),
        }
        if let Some(admission) = &self.inner.admission {
            if !admission.borrow().contains(&id) {
                return InstanceStatus::NotAdmitted;
            }
        }
        InstanceStatus::Routable(Arc::clone(instance))
    }

    /// Whether discovery currently lists `id` (routable or not).
    pub fn is_discovered(&self, id: InstanceId) -> bool {
        self.inner.state.read().discovered.contains_key(&id)
    }

    /// Wait until `ready` holds for the routable set (re-checked on every discovery, breaker or
    /// admission change). Callers bound the wait with a timeout.
    pub async fn wait_for<F>(&self, mut ready: F)
    where
        F: FnMut(&[Arc<Instance>]) -> bool,
    {
        let mut epoch = self.inner.epoch.subscribe();
        let mut admission = self.inner.admission.clone();
        loop {
            epoch.borrow_and_update();
            if let Some(a) = admission.as_mut() {
                a.borrow_and_update();
            }
            if ready(&self.routable()) {
                return;
            }
            match admission.as_mut() {
                Some(a) => {
                    tokio::select! {
                        _ = epoch.changed() => {}
                        changed = a.changed() => if changed.is_err() { admission = None },
                    }
                }
                // The sender lives in `self`, so this cannot fail while we wait.
                None => {
                    let _ = epoch.changed().await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::EndpointId;

    fn added(id: InstanceId) -> InstanceEvent {
        InstanceEvent::Added(Instance {
            endpoint: EndpointId::new("t", "prefill", "generate"),
            instance_id: id,
            address: std::net::SocketAddr::from(([127, 0, 0, 1], 1)),
        })
    }

    fn ids(set: &[Arc<Instance>]) -> Vec<InstanceId> {
        set.iter().map(|i| i.instance_id).collect()
    }

    #[tokio::test]
    async fn the_admitted_set_is_shared_until_admission_or_discovery_changes_it() {
        let (admit, admitted) = watch::channel(BTreeSet::from([1, 2]));
        let view = RoutableView::spawn(
            futures_util::stream::pending(),
            Some(admitted),
            CancellationToken::new(),
        );
        for id in [1, 2, 3] {
            view.apply(added(id));
        }
        let first = view.routable();
        assert_eq!(ids(&first), [1, 2]);
        assert!(Arc::ptr_eq(&first, &view.routable()), "no change, same set");
        admit.send_replace(BTreeSet::from([2, 3]));
        let second = view.routable();
        assert_eq!(
            ids(&second),
            [2, 3],
            "an admission change shows at the next pick"
        );
        assert!(!Arc::ptr_eq(&first, &second));
        view.apply(InstanceEvent::Removed(3));
        assert_eq!(ids(&view.routable()), [2], "a discovery change too");
        drop(admit);
        assert_eq!(
            ids(&view.routable()),
            [2],
            "a closed admission keeps its last set"
        );
    }

    /// Found by the simulator (3 of 3,000 seeds): an admission set emptied and its sender
    /// dropped before the next pick. The receiver's `has_changed` then fails instead of saying
    /// "changed", and a cache trusting that kept dispatching to the old set.
    #[tokio::test]
    async fn an_admission_change_followed_by_the_senders_drop_still_shows() {
        let (admit, admitted) = watch::channel(BTreeSet::from([1, 2]));
        let view = RoutableView::spawn(
            futures_util::stream::pending(),
            Some(admitted),
            CancellationToken::new(),
        );
        for id in [1, 2] {
            view.apply(added(id));
        }
        assert_eq!(ids(&view.routable()), [1, 2]);
        admit.send_replace(BTreeSet::new());
        drop(admit);
        assert!(
            view.routable().is_empty(),
            "the last admission set (empty) applies"
        );
        let closed = view.routable();
        assert!(
            Arc::ptr_eq(&closed, &view.routable()),
            "then the cache stands"
        );
        view.apply(added(3));
        assert!(view.routable().is_empty(), "nothing is admitted any more");
    }
}
