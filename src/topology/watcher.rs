//! The watcher task: a namespace watch in, `set_target` calls and a topology snapshot out.

use std::sync::Arc;

use futures_util::StreamExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::sets::{Topology, TopologySnapshot};
use crate::binding::{BindingFactory, WorkerSetTarget, WorkerSetTargetId};
use crate::discovery::{Discovery, DiscoveryError};
use crate::router::PrefillRouter;

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
            let mut topology = Topology::new();
            let mut current: Option<WorkerSetTargetId> = None;
            let mut retargets = 0u64;
            loop {
                let event = tokio::select! {
                    biased;
                    () = stop.cancelled() => break,
                    event = events.next() => event,
                };
                let Some(event) = event else {
                    tracing::warn!(namespace, "namespace watch ended; topology frozen");
                    break;
                };
                let changes = topology.apply(event);
                // Grows first: a returning pool is admitted before the router reuses its
                // binding, a new instance before any request could be routed to it.
                let (grows, shrinks): (Vec<_>, Vec<_>) =
                    changes.admissions.into_iter().partition(|a| a.grows());
                for change in grows {
                    change.apply();
                }
                let target = topology.target();
                let id = target.as_ref().map(|t| t.id.clone());
                if id != current {
                    tracing::info!(namespace, target = ?id, "prefill target changed");
                    sink.set_target(target);
                    current = id;
                    retargets += 1;
                }
                // Shrinks after: requests already see the new target when instances leave it.
                for change in shrinks {
                    change.apply();
                }
                // Retired generations: an empty set (their bindings fail fast on new
                // requests), then the sender drops.
                for retired in changes.retired {
                    retired.send_replace(Default::default());
                }
                // The view last: whoever reads it sees a router already retargeted.
                view_tx.send_if_modified(|v| {
                    let next = TopologySnapshot {
                        retargets,
                        ..topology.view()
                    };
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
