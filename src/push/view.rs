//! The routable-instance view.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use futures_core::Stream;
use futures_util::StreamExt;
use parking_lot::RwLock;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::discovery::{Instance, InstanceEvent, InstanceId};

/// Where one instance stands in the view.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InstanceStatus {
    /// Requests may go to it.
    Routable(Arc<Instance>),
    /// Discovered, but not in the admission set.
    NotAdmitted,
    /// Discovered, but its connection failed; routable again after discovery re-adds it.
    Inhibited,
    /// Not in discovery.
    Unknown,
}

#[derive(Default)]
struct State {
    discovered: BTreeMap<InstanceId, Arc<Instance>>,
    inhibited: BTreeSet<InstanceId>,
    /// `discovered` minus `inhibited`, by id, rebuilt on each change so reads only copy it.
    usable: Arc<[Arc<Instance>]>,
}

impl State {
    fn rebuild(&mut self) {
        self.usable = self
            .discovered
            .iter()
            .filter(|(id, _)| !self.inhibited.contains(id))
            .map(|(_, i)| Arc::clone(i))
            .collect();
    }
}

struct Inner {
    state: RwLock<State>,
    admission: Option<watch::Receiver<BTreeSet<InstanceId>>>,
    /// Bumped on every change of `state`, so waiters can re-check.
    epoch: watch::Sender<u64>,
}

/// Instances from discovery, intersected with an optional admission set, minus instances whose
/// connection failed. Cheap to clone (all clones share one view).
#[derive(Clone)]
pub struct RoutableView {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RoutableView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.inner.state.read();
        f.debug_struct("RoutableView")
            .field("discovered", &state.discovered.keys().collect::<Vec<_>>())
            .field("inhibited", &state.inhibited)
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
    pub fn spawn<S>(
        events: S,
        admission: Option<watch::Receiver<BTreeSet<InstanceId>>>,
        cancel: CancellationToken,
    ) -> Self
    where
        S: Stream<Item = InstanceEvent> + Send + 'static,
    {
        let view = RoutableView {
            inner: Arc::new(Inner {
                state: RwLock::new(State::default()),
                admission,
                epoch: watch::Sender::new(0),
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
                    // A new Added is discovery showing the instance again: lift inhibition.
                    state.inhibited.remove(&id);
                    state.discovered.insert(id, Arc::new(instance));
                }
                InstanceEvent::Removed(id) => {
                    state.discovered.remove(&id);
                    state.inhibited.remove(&id);
                }
            }
            state.rebuild();
        }
        self.inner.epoch.send_modify(|e| *e += 1);
    }

    /// Mark an instance as failed: not routable until discovery re-adds it.
    pub fn inhibit(&self, id: InstanceId) {
        {
            let mut state = self.inner.state.write();
            if !state.discovered.contains_key(&id) || !state.inhibited.insert(id) {
                return;
            }
            state.rebuild();
        }
        tracing::info!(
            instance = id,
            "instance inhibited after a connection failure"
        );
        self.inner.epoch.send_modify(|e| *e += 1);
    }

    /// The routable instances, by ascending id. Without an admission set this is a shared
    /// snapshot (one reference-count increment, no copy).
    pub fn routable(&self) -> Arc<[Arc<Instance>]> {
        let usable = Arc::clone(&self.inner.state.read().usable);
        match &self.inner.admission {
            None => usable,
            Some(admission) => {
                let admitted = admission.borrow();
                usable
                    .iter()
                    .filter(|i| admitted.contains(&i.instance_id))
                    .cloned()
                    .collect()
            }
        }
    }

    /// Where `id` stands.
    pub fn status(&self, id: InstanceId) -> InstanceStatus {
        let state = self.inner.state.read();
        let Some(instance) = state.discovered.get(&id) else {
            return InstanceStatus::Unknown;
        };
        if state.inhibited.contains(&id) {
            return InstanceStatus::Inhibited;
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

    /// Wait until `ready` holds for the routable set (re-checked on every discovery, inhibition
    /// or admission change). Callers bound the wait with a timeout.
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
