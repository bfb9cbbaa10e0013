//! The wait for room: a request that finds every routable worker over the busy threshold
//! queues in the bookings (earliest deadline first) and picks again on each release, until its
//! wait ends and it is shed.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use super::picked::Pick;
use super::{Dispatcher, WorkerLink};
use crate::discovery::InstanceId;
use crate::push::PushError;
use crate::request::GenerateRequest;

/// How often a waiting request re-checks for room even without a release (a worker may join).
const OVERLOAD_RECHECK: Duration = Duration::from_millis(100);

impl<L: WorkerLink> Dispatcher<L> {
    /// A pick as [`select_with_overlap`](Self::select_with_overlap), waiting for room while
    /// every routable worker is over the busy threshold (earliest deadline first, up to
    /// [`PushConfig::overload_wait`] and never past `deadline`), then failing with
    /// [`PushError::Overloaded`].
    pub(super) async fn select_or_wait(
        &self,
        request: &GenerateRequest,
        excluded: &[InstanceId],
        deadline: Option<Instant>,
    ) -> Result<Pick, PushError> {
        let first = match self.select_with_overlap(request, excluded) {
            Err(PushError::Overloaded { .. }) => Instant::now(),
            other => return other,
        };
        let mut until = first + self.config.overload_wait;
        if let Some(d) = deadline {
            until = until.min(d);
        }
        self.overload.queued.fetch_add(1, Ordering::Relaxed);
        loop {
            let now = Instant::now();
            let Some((seq, woken)) = (now < until)
                .then(|| self.loads.enqueue(until, self.config.overload_queue))
                .flatten()
            else {
                return Err(self.shed(first));
            };
            let _ = tokio::time::timeout_at(until.min(now + OVERLOAD_RECHECK), woken).await;
            self.loads.dequeue(until, seq);
            match self.select_with_overlap(request, excluded) {
                Err(PushError::Overloaded { .. }) => {}
                other => return other,
            }
        }
    }

    /// Count a request shed after waiting since `since`, and its error.
    fn shed(&self, since: Instant) -> PushError {
        self.overload.shed.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(waited = ?since.elapsed(), "request shed: every routable worker is busy");
        PushError::Overloaded {
            threshold: self.busy_threshold().unwrap_or(0),
            waited: since.elapsed(),
        }
    }
}
