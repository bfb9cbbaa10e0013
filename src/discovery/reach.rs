//! Whether the store answers, as this process's watches find it.
//!
//! A watch heals store outages inside its stream (it lists again and diffs), so a frontend
//! keeps routing on its last view while the store is gone; this cell is how it can still
//! *say* that the store is gone (status, metrics, logs). Only transitions are logged: an
//! outage is one warning and one recovery line, not one line per retry.

use std::time::Instant;

use tokio::sync::watch;

use super::DiscoveryError;

/// How this process last found its discovery store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreStatus {
    /// False from the first failed listing or broken watch until the next listing succeeds.
    pub reachable: bool,
    /// Outages seen so far (reachable -> unreachable transitions).
    pub outages: u64,
    /// The error that began the current outage (the last one, if reachable again).
    pub last_error: Option<String>,
}

impl Default for StoreStatus {
    fn default() -> Self {
        StoreStatus {
            reachable: true,
            outages: 0,
            last_error: None,
        }
    }
}

/// The cell a backend shares between its watches.
#[derive(Debug)]
pub(crate) struct Reachability {
    tx: watch::Sender<StoreStatus>,
    /// When the current outage began (for the recovery log line).
    since: parking_lot::Mutex<Option<Instant>>,
}

impl Default for Reachability {
    fn default() -> Self {
        Reachability {
            tx: watch::Sender::new(StoreStatus::default()),
            since: parking_lot::Mutex::new(None),
        }
    }
}

impl Reachability {
    /// A listing or a watch failed.
    pub(crate) fn failed(&self, error: &DiscoveryError) {
        let began = self.tx.send_if_modified(|s| {
            if !s.reachable {
                return false;
            }
            s.reachable = false;
            s.outages += 1;
            s.last_error = Some(error.to_string());
            true
        });
        if began {
            *self.since.lock() = Some(Instant::now());
            tracing::warn!(%error, "discovery store unreachable; routing on the last view");
        }
    }

    /// A listing succeeded.
    pub(crate) fn answered(&self) {
        let ended = self.tx.send_if_modified(|s| {
            let was_down = !s.reachable;
            s.reachable = true;
            was_down
        });
        if ended {
            let down_for = self.since.lock().take().map(|t| t.elapsed());
            tracing::info!(
                ?down_for,
                "discovery store reachable again; watches resynced"
            );
        }
    }

    /// A receiver of the status.
    pub(crate) fn subscribe(&self) -> watch::Receiver<StoreStatus> {
        self.tx.subscribe()
    }
}

/// The status of a store that does not track reachability: always reachable, never changes.
pub(crate) fn always_reachable() -> watch::Receiver<StoreStatus> {
    watch::channel(StoreStatus::default()).1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_is_counted_once_and_ends_with_a_listing() {
        let reach = Reachability::default();
        let rx = reach.subscribe();
        assert!(rx.borrow().reachable);
        let error = DiscoveryError::Etcd("connection refused".into());
        reach.failed(&error);
        reach.failed(&error);
        assert_eq!(
            *rx.borrow(),
            StoreStatus {
                reachable: false,
                outages: 1,
                last_error: Some(error.to_string()),
            }
        );
        reach.answered();
        assert!(rx.borrow().reachable);
        assert_eq!(rx.borrow().outages, 1);
        reach.failed(&error);
        assert_eq!(rx.borrow().outages, 2);
    }

    #[test]
    fn a_store_without_tracking_reads_reachable() {
        assert!(always_reachable().borrow().reachable);
    }
}
