//! Load reports on the request plane, worker side: the server's [`LoadLedger`] (the prefill
//! work in flight per connection) and, per connection that sent [`Frame::LoadSubscribe`], a
//! task that sends [`Frame::LoadReport`] when what that connection would be told changed.
//!
//! - *On change, coalesced, bounded rate*: a change bumps a watch (a latest-value slot, not a
//!   queue); a connection's task wakes, builds the report from the ledger as it is then, sends
//!   it, and waits at least [`ServerConfig::load_report_interval`] before the next one. So
//!   a burst of request starts costs one report per connection, and memory is one task and one
//!   slot per subscribed connection whatever the request rate.
//! - *Refresh*: a connection that heard nothing for [`ServerConfig::load_report_refresh`] is
//!   sent its current report again ([`LoadLedger::refresh_for`]), so a report the frontend
//!   dropped or refused cannot leave a stale value for long.
//!
//! [`ServerConfig::load_report_interval`]: super::ServerConfig::load_report_interval
//! [`ServerConfig::load_report_refresh`]: super::ServerConfig::load_report_refresh

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::wire::{self, Frame};
use super::writer::Writer;
use crate::load_report::{Load, LoadLedger};

/// The default [`ServerConfig::load_report_interval`](super::ServerConfig::load_report_interval):
/// at most one report per connection per 2 ms (about the KV events' coalescing delay, so a
/// report and the batch of the same request starts reach the frontend together).
pub const LOAD_REPORT_INTERVAL: Duration = Duration::from_millis(2);

/// The default [`ServerConfig::load_report_refresh`](super::ServerConfig::load_report_refresh):
/// an unchanged report is sent again every second.
pub const LOAD_REPORT_REFRESH: Duration = Duration::from_secs(1);

/// The server's ledger and the wake-up of its connections' report tasks.
#[derive(Debug)]
pub(crate) struct Reports {
    ledger: Mutex<LoadLedger>,
    /// Bumped on every change of the ledger's total.
    changed: watch::Sender<u64>,
    next_conn: AtomicU64,
    interval: Duration,
    refresh: Duration,
}

impl Reports {
    pub(crate) fn new(interval: Duration, refresh: Duration) -> Arc<Self> {
        Arc::new(Reports {
            ledger: Mutex::new(LoadLedger::new()),
            changed: watch::channel(0).0,
            next_conn: AtomicU64::new(1),
            interval,
            // A zero refresh would spin: at least the interval.
            refresh: refresh.max(interval).max(Duration::from_millis(1)),
        })
    }

    /// A new connection's id in the ledger.
    pub(crate) fn open(&self) -> u64 {
        let conn = self.next_conn.fetch_add(1, Ordering::Relaxed);
        self.ledger.lock().open(conn);
        conn
    }

    /// Apply `f` to the ledger; wake the report tasks if the total changed (a change of the
    /// total is the only kind that changes what some connection is told).
    fn update(&self, f: impl FnOnce(&mut LoadLedger)) {
        let changed = {
            let mut ledger = self.ledger.lock();
            let before: Load = ledger.total();
            f(&mut ledger);
            ledger.total() != before
        };
        if changed {
            self.changed.send_modify(|v| *v = v.wrapping_add(1));
        }
    }

    /// Request `request` on `conn` holds `work` prefill tokens until the returned guard drops.
    pub(crate) fn start(self: &Arc<Self>, conn: u64, request: u64, work: u64) -> PrefillWork {
        self.update(|ledger| {
            if let Err(e) = ledger.start(conn, request, work) {
                // The connection refuses duplicate ids before this; never expected.
                tracing::debug!(error = %e, "load ledger refused a request start");
            }
        });
        PrefillWork {
            reports: Arc::clone(self),
            conn,
            request,
        }
    }

    /// Connection `conn` closed: its work leaves every other connection's report.
    pub(crate) fn close(&self, conn: u64) {
        self.update(|ledger| ledger.close(conn));
    }

    /// Send `conn`'s reports on `writer` until `closed`.
    pub(crate) fn subscribe(
        self: &Arc<Self>,
        conn: u64,
        writer: Writer,
        closed: CancellationToken,
        max_frame_len: usize,
    ) {
        let reports = Arc::clone(self);
        let mut changed = self.changed.subscribe();
        tokio::spawn(async move {
            let mut refresh_at = Instant::now();
            loop {
                let report = {
                    let mut ledger = reports.ledger.lock();
                    if Instant::now() >= refresh_at {
                        ledger.refresh_for(conn)
                    } else {
                        ledger.report_for(conn)
                    }
                };
                if let Some(report) = report {
                    let frame = Frame::LoadReport {
                        payload: report.encode().to_vec(),
                    };
                    let Some(bytes) = wire::encode_bounded(&frame, max_frame_len) else {
                        tracing::warn!("load report over the frame limit; reports stopped");
                        break;
                    };
                    if !writer.send(bytes).await {
                        break;
                    }
                    refresh_at = Instant::now() + reports.refresh;
                }
                // The rate bound: changes meanwhile mark `changed`, and are sent together.
                tokio::select! {
                    _ = closed.cancelled() => break,
                    _ = tokio::time::sleep(reports.interval) => {}
                }
                tokio::select! {
                    _ = closed.cancelled() => break,
                    seen = changed.changed() => if seen.is_err() { break },
                    _ = tokio::time::sleep_until(refresh_at) => {}
                }
            }
        });
    }
}

/// A request's prefill work in the ledger; dropping it (the first response, an error, a
/// cancel, a deadline or a closed connection) finishes the request there.
pub(crate) struct PrefillWork {
    reports: Arc<Reports>,
    conn: u64,
    request: u64,
}

impl Drop for PrefillWork {
    fn drop(&mut self) {
        let (conn, request) = (self.conn, self.request);
        self.reports.update(|ledger| ledger.finish(conn, request));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guard_finishes_its_request_once_and_only_changes_wake_the_reporters() {
        let reports = Reports::new(LOAD_REPORT_INTERVAL, LOAD_REPORT_REFRESH);
        let mut seen = reports.changed.subscribe();
        let a = reports.open();
        let b = reports.open();
        let work = reports.start(a, 1, 100);
        assert!(seen.has_changed().unwrap());
        seen.mark_unchanged();
        assert_eq!(
            reports.ledger.lock().report_for(b).unwrap().others.tokens,
            100
        );
        drop(work);
        assert!(seen.has_changed().unwrap());
        seen.mark_unchanged();
        // A close with no work in flight changes no one's report: no wake-up.
        reports.close(b);
        assert!(!seen.has_changed().unwrap());
        assert_eq!(reports.ledger.lock().total(), Load::ZERO);
    }
}
