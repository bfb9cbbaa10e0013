//! Booked prefill work and the overload queue.
//!
//! A KV pick books the request's uncached tokens on the chosen worker under the same lock
//! that chose it (no selection-to-booking race); the [`Booking`] releases them when dropped:
//! when the prefill's stream ends, fails or is cancelled, when a retry moves the request
//! elsewhere, or when a held selection is dropped. Requests that find every worker over the
//! busy threshold queue here, earliest deadline first, and each release wakes the first waiter
//! (the wait itself is in `wait.rs`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::discovery::InstanceId;
use crate::push::LoadBoard;

/// Overload counters of one dispatcher.
#[derive(Debug, Default)]
pub struct OverloadCounts {
    /// Requests that found every routable worker over the busy threshold and queued.
    pub queued: AtomicU64,
    /// Requests that failed with [`PushError::Overloaded`](crate::push::PushError::Overloaded) (queue full, or waited too long).
    pub shed: AtomicU64,
}

/// A snapshot of a dispatcher's booked work and overload counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OverloadStats {
    /// Prefill work (tokens) booked over every worker now.
    pub booked_tokens: u64,
    /// Requests waiting for room now.
    pub waiting: u64,
    /// Requests that queued because every routable worker was busy (shared count).
    pub queued: u64,
    /// Requests shed with [`PushError::Overloaded`](crate::push::PushError::Overloaded) (shared count).
    pub shed: u64,
}

/// The dispatcher's booked work per worker, and the requests waiting for room.
#[derive(Debug, Default)]
pub(crate) struct Bookings {
    /// Shared with the KV feed, which sets the workers' reported others on it.
    board: Arc<Mutex<LoadBoard>>,
    /// Waiters by (deadline, arrival): the earliest deadline is woken first.
    waiters: Mutex<BTreeMap<(Instant, u64), oneshot::Sender<()>>>,
    arrivals: AtomicU64,
}

impl Bookings {
    /// The board, shared (the KV feed applies load reports to it).
    pub(crate) fn shared_board(&self) -> Arc<Mutex<LoadBoard>> {
        Arc::clone(&self.board)
    }

    /// The board, locked.
    pub(crate) fn board(&self) -> MutexGuard<'_, LoadBoard> {
        self.board.lock()
    }

    /// Book `amount` on `id` in the locked `board` (the pick's own lock), released when the
    /// returned booking drops; it also counts as work recently placed there
    /// ([`LoadBoard::note_work`]), which stays after the release and decays by picks.
    pub(crate) fn book(
        self: &Arc<Self>,
        board: &mut LoadBoard,
        id: InstanceId,
        amount: u64,
    ) -> Booking {
        board.acquire(id, amount);
        board.note_work(id, amount);
        Booking {
            bookings: Arc::clone(self),
            id,
            amount,
        }
    }

    /// Requests waiting for room now.
    pub(crate) fn waiting(&self) -> usize {
        self.waiters.lock().len()
    }

    /// Queue a waiter with `deadline`, unless `capacity` are already waiting (`None`: full).
    pub(crate) fn enqueue(
        &self,
        deadline: Instant,
        capacity: usize,
    ) -> Option<(u64, oneshot::Receiver<()>)> {
        let mut waiters = self.waiters.lock();
        if waiters.len() >= capacity {
            return None;
        }
        let seq = self.arrivals.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        waiters.insert((deadline, seq), tx);
        Some((seq, rx))
    }

    /// Take a waiter out of the queue (it gave up or was admitted).
    pub(crate) fn dequeue(&self, deadline: Instant, seq: u64) {
        self.waiters.lock().remove(&(deadline, seq));
    }

    /// Wake the waiter with the earliest deadline that is still listening.
    pub(crate) fn wake_one(&self) {
        let mut waiters = self.waiters.lock();
        while let Some((_, tx)) = waiters.pop_first() {
            if tx.send(()).is_ok() {
                return;
            }
        }
    }

    /// Wake every waiter (the busy threshold changed: each re-checks).
    pub(crate) fn wake_all(&self) {
        let waiters = std::mem::take(&mut *self.waiters.lock());
        for (_, tx) in waiters {
            let _ = tx.send(());
        }
    }
}

/// Work booked on one worker until dropped.
#[derive(Debug)]
pub(crate) struct Booking {
    bookings: Arc<Bookings>,
    id: InstanceId,
    amount: u64,
}

impl Booking {
    /// The booked tokens.
    pub(crate) fn amount(&self) -> u64 {
        self.amount
    }
}

impl Drop for Booking {
    fn drop(&mut self) {
        self.bookings.board.lock().release(self.id, self.amount);
        self.bookings.wake_one();
    }
}
