//! The topology machine's driver: a namespace watch in, admission channels, `set_target`
//! calls and a published view out.
//!
//! The [`Machine`] decides; this file owns what it cannot (it is pure): one `watch` channel
//! of admitted instances per generation, the [`TargetSink`], and the published
//! [`TopologySnapshot`]. It carries out each batch in order, so a grow is published before the
//! target moves and a shrink after it (the machine's ordering rule).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use futures_util::StreamExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::machine::{Action, GenerationId, Machine, TargetSpec};
use crate::advert::SetLink;
use crate::binding::{BindingFactory, WorkerSetTarget, WorkerSetTargetId};
use crate::discovery::{Discovery, DiscoveryError, EndpointId, InstanceId, NamespaceEvent};
use crate::router::PrefillRouter;

/// The topology as the watcher publishes it after every change.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TopologySnapshot {
    /// The prefill target's identity, if the rule gives one.
    pub target: Option<WorkerSetTargetId>,
    /// Prefill sets with at least one admitted instance.
    pub prefill_sets: Vec<EndpointId>,
    /// Decode sets with at least one instance.
    pub decode_sets: Vec<EndpointId>,
    /// The decode endpoint when there is exactly one decode set.
    pub decode: Option<EndpointId>,
    /// How that decode set's instances are reached (their cards' protocol).
    pub decode_link: Option<SetLink>,
    /// Target changes so far (`set_target` calls the watcher made).
    pub retargets: u64,
}

impl TopologySnapshot {
    /// The view of a topology machine.
    pub fn of(machine: &Machine) -> Self {
        let decode_sets = machine.decode_sets();
        TopologySnapshot {
            target: machine.target().map(|t| target_id(&t.id)),
            prefill_sets: machine.prefill_sets(),
            decode: (decode_sets.len() == 1).then(|| decode_sets[0].clone()),
            decode_link: (decode_sets.len() == 1)
                .then(|| machine.set_link(&decode_sets[0]))
                .flatten(),
            decode_sets,
            retargets: machine.retargets(),
        }
    }
}

/// The router's name for a generation.
fn target_id(id: &GenerationId) -> WorkerSetTargetId {
    WorkerSetTargetId::new(id.endpoint.to_string(), id.generation)
}

/// Carries out the machine's actions: the admission channels and the sink.
struct Driver<S> {
    namespace: String,
    machine: Machine,
    /// One admission channel per generation the machine has named and not yet retired or
    /// forgotten.
    admissions: BTreeMap<GenerationId, watch::Sender<BTreeSet<InstanceId>>>,
    sink: S,
}

impl<S: TargetSink> Driver<S> {
    fn new(namespace: String, sink: S) -> Self {
        Driver {
            namespace,
            machine: Machine::new(),
            admissions: BTreeMap::new(),
            sink,
        }
    }

    /// The admission channel of a generation, created empty at its first mention.
    fn admission(&mut self, id: &GenerationId) -> &watch::Sender<BTreeSet<InstanceId>> {
        self.admissions
            .entry(id.clone())
            .or_insert_with(|| watch::channel(BTreeSet::new()).0)
    }

    /// Feed one event and carry out its actions, in order.
    fn handle(&mut self, event: NamespaceEvent) {
        for action in self.machine.handle(event) {
            match action {
                Action::Admission { id, set, .. } => {
                    self.admission(&id).send_replace(set);
                }
                Action::SetTarget(spec) => {
                    let target = spec.map(|TargetSpec { id, card }| {
                        let admitted = self.admission(&id).subscribe();
                        WorkerSetTarget::new(target_id(&id), id.endpoint, card, admitted)
                    });
                    let id = target.as_ref().map(|t| t.id.clone());
                    tracing::info!(namespace = self.namespace, target = ?id, "prefill target changed");
                    self.sink.set_target(target);
                }
                // An empty set (the retired bindings fail fast on new requests), then the
                // sender drops.
                Action::Retire(id) => {
                    if let Some(sender) = self.admissions.remove(&id) {
                        sender.send_replace(BTreeSet::new());
                    }
                }
                Action::Forget(id) => {
                    self.admissions.remove(&id);
                }
            }
        }
    }
}

/// Whatever takes the watcher's targets: a [`PrefillRouter`], or a test double.
pub trait TargetSink: Send + Sync + 'static {
    /// Set (or clear) the prefill target. Must not block: the watcher calls it on its task.
    fn set_target(&self, target: Option<WorkerSetTarget>);
}

impl<F: BindingFactory> TargetSink for PrefillRouter<F> {
    fn set_target(&self, target: Option<WorkerSetTarget>) {
        PrefillRouter::set_target(self, target);
    }
}

impl<S: TargetSink + ?Sized> TargetSink for Arc<S> {
    fn set_target(&self, target: Option<WorkerSetTarget>) {
        (**self).set_target(target);
    }
}

/// Watches one namespace and keeps a [`TargetSink`] pointed at its prefill set. Dropping it
/// (or [`shutdown`](TopologyWatcher::shutdown)) stops its task; the sink keeps its last target.
#[derive(Debug)]
pub struct TopologyWatcher {
    view: watch::Receiver<TopologySnapshot>,
    cancel: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl TopologyWatcher {
    /// Start watching `namespace` in `discovery`, feeding `sink`. Fails if the watch cannot be
    /// opened; later store outages are healed inside the discovery stream.
    ///
    /// The task owns `sink` (e.g. an `Arc<PrefillRouter<_>>`) until it stops: stop the watcher
    /// before expecting the router's last reference to drop.
    pub async fn start<S: TargetSink>(
        discovery: Arc<dyn Discovery>,
        namespace: &str,
        sink: S,
    ) -> Result<Self, DiscoveryError> {
        let mut events = discovery.watch_namespace(namespace).await?;
        let (view_tx, view) = watch::channel(TopologySnapshot::default());
        let cancel = CancellationToken::new();
        let stop = cancel.clone();
        let namespace = namespace.to_owned();
        let task = tokio::spawn(async move {
            let mut driver = Driver::new(namespace, sink);
            loop {
                let event = tokio::select! {
                    biased;
                    () = stop.cancelled() => break,
                    event = events.next() => event,
                };
                let Some(event) = event else {
                    tracing::warn!(
                        namespace = driver.namespace,
                        "namespace watch ended; topology frozen"
                    );
                    break;
                };
                driver.handle(event);
                // The view last: whoever reads it sees a router already retargeted.
                view_tx.send_if_modified(|v| {
                    let next = TopologySnapshot::of(&driver.machine);
                    let changed = *v != next;
                    *v = next;
                    changed
                });
            }
        });
        Ok(TopologyWatcher {
            view,
            cancel,
            task: Some(task),
        })
    }

    /// The topology as last published (after the matching `set_target`).
    pub fn view(&self) -> watch::Receiver<TopologySnapshot> {
        self.view.clone()
    }

    /// Stop the task (idempotent).
    pub fn shutdown(&self) {
        self.cancel.cancel();
    }

    /// Stop the task and wait for it to end.
    pub async fn stopped(mut self) {
        self.cancel.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for TopologyWatcher {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}
