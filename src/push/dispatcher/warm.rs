//! Eager connections in KV-events mode: a worker entering the routable view is connected (and
//! so subscribed to, and asked for its KV snapshot) in the background, before any request is
//! routed to it. Without this a new frontend's first pick per worker is scored cold: the
//! connection, hence the snapshot, would come only with the first request sent there.

use std::collections::HashSet;
use std::future::Future;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::discovery::{Instance, InstanceId};
use crate::push::health::failure_class;
use crate::push::RoutableView;
use crate::transport::TransportError;

/// What the warmer needs from a link's connection pool.
pub(super) trait Warm: Send + Sync + 'static {
    /// Whether `instance` has a pooled connection that takes new requests.
    fn is_connected(&self, instance: &Instance) -> bool;

    /// Open and adopt a connection to `instance`, exactly as a request's send would.
    fn connect(
        self: &Arc<Self>,
        instance: &Instance,
    ) -> impl Future<Output = Result<(), TransportError>> + Send;
}

/// Watch `view` and connect every routable worker without a connection, through `pool`, one
/// attempt in flight per worker. Runs on the current tokio runtime until the returned guard
/// drops (with its link, hence its dispatcher) or `pool` is gone; `None` outside a runtime
/// (then connections stay lazy).
pub(super) fn spawn<W: Warm>(pool: &Arc<W>, view: RoutableView) -> Option<DropGuard> {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        tracing::debug!("no tokio runtime: workers are connected by their first request");
        return None;
    };
    let cancel = CancellationToken::new();
    let token = cancel.clone();
    let pool = Arc::downgrade(pool);
    runtime.spawn(async move {
        tokio::select! {
            () = token.cancelled() => {}
            () = watch(pool, view, token.clone()) => {}
        }
    });
    Some(cancel.drop_guard())
}

/// On every change of the routable set, start a connect to each member not connected and not
/// already being connected.
async fn watch<W: Warm>(pool: Weak<W>, view: RoutableView, cancel: CancellationToken) {
    let in_flight: Arc<Mutex<HashSet<InstanceId>>> = Arc::default();
    loop {
        let set = view.routable();
        {
            let Some(strong) = pool.upgrade() else {
                return;
            };
            for instance in set.iter() {
                if strong.is_connected(instance) || !in_flight.lock().insert(instance.instance_id) {
                    continue;
                }
                let attempt = Attempt {
                    id: instance.instance_id,
                    in_flight: Arc::clone(&in_flight),
                };
                let (pool, view, cancel) = (pool.clone(), view.clone(), cancel.clone());
                let instance = Arc::clone(instance);
                tokio::spawn(async move {
                    let _attempt = attempt;
                    let Some(pool) = pool.upgrade() else {
                        return;
                    };
                    let result = tokio::select! {
                        () = cancel.cancelled() => return,
                        result = pool.connect(&instance) => result,
                    };
                    if let Err(error) = result {
                        // The request path's rule: the failure's class goes to the breaker,
                        // which opens on a connection-level failure (refused, timed out, TLS)
                        // only. The worker then rejoins the set after a probe, and is tried
                        // again then: the breaker's backoff paces the retries.
                        let class = failure_class(&error);
                        tracing::debug!(instance = instance.instance_id, %error, %class, "eager connect failed");
                        view.report_failure(instance.instance_id, class);
                    }
                });
            }
        }
        // The view hands out the same `Arc` until the set changes: wait for another one.
        view.wait_for(|now| !std::ptr::addr_eq(now, &*set)).await;
    }
}

/// One worker's connect in flight; it leaves the set when the attempt ends, however it ends.
struct Attempt {
    id: InstanceId,
    in_flight: Arc<Mutex<HashSet<InstanceId>>>,
}

impl Drop for Attempt {
    fn drop(&mut self) {
        self.in_flight.lock().remove(&self.id);
    }
}
