//! A registration's lease: kept alive through etcd outages, restored with a new lease when
//! it was lost, revoked (or abandoned) at the end.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use etcd_client::PutOptions;

use super::config::EtcdConfig;
use super::members::Members;
use crate::discovery::api::Lease;
use crate::discovery::DiscoveryError;

/// What the keep-alive task needs to restore a record after its lease was lost.
pub(super) struct Owned {
    pub(super) key: String,
    pub(super) bytes: Vec<u8>,
    pub(super) lease: Arc<AtomicI64>,
}

/// How a registration ends its keep-alive task.
pub(super) enum Stop {
    /// Revoke the lease (deleting the record); reply with the outcome if asked.
    Revoke(Option<oneshot::Sender<Result<(), DiscoveryError>>>),
    /// Leave the lease to expire, as a killed process would.
    Abandon,
}

/// What one renewal found.
enum Renewal {
    Alive,
    /// The server no longer knows the lease (it expired during an outage).
    Lost,
    /// The keep-alive stream broke: reopen it.
    Broken,
}

async fn renew(
    keeper: &mut etcd_client::LeaseKeeper,
    stream: &mut etcd_client::LeaseKeepAliveStream,
    limit: Duration,
) -> Renewal {
    if keeper.keep_alive().await.is_err() {
        return Renewal::Broken;
    }
    match tokio::time::timeout(limit, stream.message()).await {
        Ok(Ok(Some(resp))) if resp.ttl() > 0 => Renewal::Alive,
        Ok(Ok(Some(_))) => Renewal::Lost,
        _ => Renewal::Broken,
    }
}

/// Close a keep-alive stream politely: half-close our side and let the server finish the
/// call. Dropping an open stream would reset it, and h2 closes a connection that has reset
/// 1024 streams (`too_many_internal_resets`), failing every call on it.
async fn close_keepalive(
    keeper: etcd_client::LeaseKeeper,
    mut stream: etcd_client::LeaseKeepAliveStream,
) {
    drop(keeper);
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        while let Ok(Some(_)) = stream.message().await {}
    })
    .await;
}

/// Keep the lease alive until told to stop, surviving etcd outages; then revoke or abandon.
pub(super) async fn keep_alive(
    members: Arc<Members>,
    config: Arc<EtcdConfig>,
    owned: Owned,
    mut stop: oneshot::Receiver<Stop>,
) {
    // A dropped sender means the registration is gone without a word: revoke.
    let order = 'outer: loop {
        let lease = owned.lease.load(Ordering::Acquire);
        // Each (re)opening goes to the pinned member; a stream that breaks moves the pin.
        let (member, mut client) = members.pick();
        let opened = tokio::select! {
            order = &mut stop => break order.unwrap_or(Stop::Revoke(None)),
            opened = tokio::time::timeout(
                config.request_timeout,
                client.lease_keep_alive(lease),
            ) => opened,
        };
        let lost = match opened {
            Ok(Ok((mut keeper, mut stream))) => {
                // Some(order) to stop; None with `lost` to restore or reopen.
                let mut lost = false;
                let ending = loop {
                    let renewal = tokio::select! {
                        order = &mut stop => break Some(order.unwrap_or(Stop::Revoke(None))),
                        renewal = renew(&mut keeper, &mut stream, config.request_timeout) => renewal,
                    };
                    match renewal {
                        Renewal::Alive => {}
                        Renewal::Lost => {
                            lost = true;
                            break None;
                        }
                        Renewal::Broken => {
                            members.failed(member);
                            tracing::debug!(
                                key = owned.key,
                                "etcd keep-alive stream broke; reopening"
                            );
                            break None;
                        }
                    }
                    tokio::select! {
                        order = &mut stop => break Some(order.unwrap_or(Stop::Revoke(None))),
                        _ = tokio::time::sleep(config.keepalive_interval) => {}
                    }
                };
                close_keepalive(keeper, stream).await;
                if let Some(order) = ending {
                    break 'outer order;
                }
                lost
            }
            // Opening renews once: etcd answers TTL 0 for a lease it no longer has (it
            // expired during an outage, or a stalled leader let it lapse).
            Ok(Err(etcd_client::Error::LeaseKeepAliveError(message)))
                if message == "lease not found" =>
            {
                true
            }
            Ok(Err(error)) => {
                members.failed(member);
                tracing::debug!(key = owned.key, %error, "etcd keep-alive unavailable");
                false
            }
            Err(_) => {
                members.failed(member);
                tracing::debug!(key = owned.key, "etcd keep-alive timed out opening");
                false
            }
        };
        if lost {
            tracing::warn!(
                key = owned.key,
                lease,
                "etcd lease expired while alive; re-registering"
            );
            match restore(&members, &config, &owned, lease).await {
                // Renew the new lease at once.
                Ok(true) => continue,
                Ok(false) => {
                    tracing::debug!(key = owned.key, "registration superseded; keep-alive stops");
                    return;
                }
                Err(error) => tracing::warn!(key = owned.key, %error, "cannot re-register"),
            }
        }
        tokio::select! {
            order = &mut stop => break order.unwrap_or(Stop::Revoke(None)),
            _ = tokio::time::sleep(config.retry_interval) => {}
        }
    };
    if let Stop::Revoke(reply) = order {
        let lease = owned.lease.load(Ordering::Acquire);
        let result = members
            .call(config.request_timeout, |mut c| async move {
                c.lease_revoke(lease).await
            })
            .await
            .map(|_| ());
        match reply {
            Some(reply) => {
                let _ = reply.send(result);
            }
            None => {
                if let Err(error) = result {
                    tracing::debug!(lease, %error, "etcd lease revoke failed; it will expire");
                }
            }
        }
    }
}

/// Grant a new lease and re-put the record; false if another registration owns the key.
async fn restore(
    members: &Members,
    config: &EtcdConfig,
    owned: &Owned,
    old_lease: i64,
) -> Result<bool, DiscoveryError> {
    let limit = config.request_timeout;
    let key = owned.key.as_str();
    let current = members
        .call(limit, |mut c| async move { c.get(key, None).await })
        .await?;
    if let Some(kv) = current.kvs().first() {
        if kv.lease() != old_lease {
            return Ok(false);
        }
    }
    let ttl = config.ttl_secs();
    let lease = members
        .call(limit, |mut c| async move { c.lease_grant(ttl, None).await })
        .await?
        .id();
    members
        .call(limit, |mut c| {
            let bytes = owned.bytes.clone();
            async move {
                c.put(key, bytes, Some(PutOptions::new().with_lease(lease)))
                    .await
            }
        })
        .await?;
    owned.lease.store(lease, Ordering::Release);
    Ok(true)
}

/// A registration's end of its keep-alive task, which does the revoking itself: no runtime
/// handle is needed on drop, and the lease is revoked only once the keep-alive stopped (so it
/// cannot re-grant behind the revoke).
pub(super) struct EtcdLease {
    pub(super) stop: Option<oneshot::Sender<Stop>>,
    pub(super) timeout: Duration,
}

impl EtcdLease {
    fn order(&mut self, order: Stop) {
        if let Some(stop) = self.stop.take() {
            // The task is gone only if the runtime is: then the lease just expires.
            let _ = stop.send(order);
        }
    }
}

#[async_trait::async_trait]
impl Lease for EtcdLease {
    async fn revoke(mut self: Box<Self>) -> Result<(), DiscoveryError> {
        let (reply, outcome) = oneshot::channel();
        self.order(Stop::Revoke(Some(reply)));
        match tokio::time::timeout(self.timeout * 2, outcome).await {
            Ok(Ok(result)) => result,
            // The task ended on its own: superseded by a newer registration, whose record
            // is not ours to delete.
            Ok(Err(_)) => Ok(()),
            Err(_) => Err(DiscoveryError::Etcd("lease revoke timed out".into())),
        }
    }

    fn abandon(mut self: Box<Self>) {
        self.order(Stop::Abandon);
    }

    fn release(mut self: Box<Self>) {
        self.order(Stop::Revoke(None));
    }
}
