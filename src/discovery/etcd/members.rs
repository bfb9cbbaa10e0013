//! The etcd members and the pin: every call goes to one pinned member and moves the pin on
//! when it fails or times out (the module docs of `etcd.rs` say why not a balanced channel).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use etcd_client::Client;

use crate::discovery::DiscoveryError;

/// One client per member and the pin: the member every call goes to until one fails.
pub(super) struct Members {
    pub(super) clients: Vec<Client>,
    pub(super) pinned: AtomicUsize,
}

impl Members {
    /// The pinned member: its index (to report a failure with) and its client.
    pub(super) fn pick(&self) -> (usize, Client) {
        let i = self.pinned.load(Ordering::Acquire) % self.clients.len();
        (i, self.clients[i].clone())
    }

    /// A call to member `i` failed: move the pin on, unless another caller already did.
    pub(super) fn failed(&self, i: usize) {
        let n = self.clients.len();
        if n > 1
            && self
                .pinned
                .compare_exchange(i, (i + 1) % n, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            tracing::debug!(
                from = i,
                to = (i + 1) % n,
                "etcd call failed; trying the next member"
            );
        }
    }

    /// Run `call` on the pinned member under `limit`; on failure move the pin on and try
    /// the next, each member once at most (every call here is safe to repeat: a repeated
    /// lease grant only leaves a lease to expire). The last error if all fail.
    pub(super) async fn call<T, F, Fut>(
        &self,
        limit: Duration,
        call: F,
    ) -> Result<T, DiscoveryError>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        let mut attempts = self.clients.len();
        loop {
            let (i, client) = self.pick();
            match bounded(limit, call(client)).await {
                Ok(value) => return Ok(value),
                Err(error) => {
                    self.failed(i);
                    attempts -= 1;
                    if attempts == 0 {
                        return Err(error);
                    }
                }
            }
        }
    }
}

pub(super) fn etcd_err(error: etcd_client::Error) -> DiscoveryError {
    DiscoveryError::Etcd(error.to_string())
}

/// Run an etcd request under the configured timeout.
pub(super) async fn bounded<T>(
    limit: Duration,
    request: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, DiscoveryError> {
    match tokio::time::timeout(limit, request).await {
        Ok(result) => result.map_err(etcd_err),
        Err(_) => Err(DiscoveryError::Etcd(format!(
            "request timed out after {limit:?}"
        ))),
    }
}
