//! Session affinity: a session's worker is the first routable one in its rendezvous order
//! ([`rendezvous`]), the same on every frontend that sees the same routable set; the table
//! remembers, for a TTL, where this frontend last sent each session, to tell a continuing
//! session (hit or re-pick) from a new one (miss).
//!
//! The table does not choose: a live entry never overrides the rendezvous order. When a worker
//! joins and ranks first for a session, the session moves to it at once on every frontend (its
//! cache is recomputed once there) rather than staying on the old worker until the entry
//! expires on some frontends and not others, which would split the session between two
//! workers for as long as it stays active (the TTL slides). Likewise a spill (the first worker
//! over the busy threshold) lasts only while that worker stays over it. See docs/router.md,
//! "Session affinity across frontends".
//!
//! One [`AffinityTable`] per dispatcher (so per binding: a rebuilt binding starts empty, a
//! reused one keeps it, a retired one drops it with its last request). Entries expire a TTL
//! after the session's last request (sliding) and at most `capacity` are kept, oldest evicted.
//! Both are checked lazily on the request path in amortized O(1): entries sit in a queue in
//! the order they were last touched, so the expired and the oldest are at its front. No task
//! sweeps the table.

mod rendezvous;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use crate::discovery::Instance;
pub(crate) use rendezvous::first_index;
pub use rendezvous::{rendezvous_first, rendezvous_order, rendezvous_weight, session_key};

/// Default cap on remembered sessions per dispatcher ([`super::PushConfig::affinity_capacity`]).
pub const DEFAULT_AFFINITY_CAPACITY: usize = 65_536;

/// How session affinity decided one pick. The pick itself is always the session's first
/// usable worker in its rendezvous order; the outcome compares it with where this frontend
/// sent the session last.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AffinityOutcome {
    /// The session's live entry names the worker that got the request: it stayed put.
    Hit,
    /// Nothing (live) remembered for the session: a new session, or one idle for the TTL (or
    /// last seen by another frontend); it went to its rendezvous worker, now remembered.
    Miss,
    /// The live entry names another worker: that one is no longer usable for this request
    /// (left admission or discovery, breaker open, already failed this request, or over the
    /// busy threshold), or no longer first in the session's order (a worker joined, or the
    /// worker a spill left has room again). The entry moved to the new worker.
    Repick,
}

/// Affinity counters since the dispatcher (or the factory sharing them) was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AffinityStats {
    /// Requests sent to the worker their session's live entry names.
    pub hits: u64,
    /// Requests of a session with no live entry.
    pub misses: u64,
    /// Requests of a session with a live entry that went to another worker (the entry moved).
    pub repicks: u64,
    /// Entries dropped to keep the table within its capacity.
    pub evictions: u64,
    /// Entries dropped because they outlived the TTL.
    pub expired: u64,
}

/// Lock-free affinity counters, shareable between dispatchers (as the default factory's
/// bindings share theirs).
#[derive(Debug, Default)]
pub struct AffinityCounts {
    hits: AtomicU64,
    misses: AtomicU64,
    repicks: AtomicU64,
    evictions: AtomicU64,
    expired: AtomicU64,
}

impl AffinityCounts {
    /// The counters now.
    pub fn snapshot(&self) -> AffinityStats {
        AffinityStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            repicks: self.repicks.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            expired: self.expired.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn record(&self, outcome: AffinityOutcome) {
        let counter = match outcome {
            AffinityOutcome::Hit => &self.hits,
            AffinityOutcome::Miss => &self.misses,
            AffinityOutcome::Repick => &self.repicks,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn dropped(&self, dropped: Dropped) {
        self.evictions.fetch_add(dropped.evicted, Ordering::Relaxed);
        self.expired.fetch_add(dropped.expired, Ordering::Relaxed);
    }
}

struct Entry {
    instance: Arc<Instance>,
    touched: Instant,
    /// The queue slot that is this entry's current one (older slots of the key are stale).
    slot: u64,
}

#[derive(Default)]
struct State {
    entries: HashMap<u64, Entry>,
    /// `(key, slot)` in the order entries were last touched; a slot whose number differs
    /// from its entry's is stale and skipped.
    order: VecDeque<(u64, u64)>,
    next_slot: u64,
}

#[derive(Clone, Copy, Default)]
struct Dropped {
    evicted: u64,
    expired: u64,
}

/// The session → worker table of one dispatcher (where each session last went, to count hits,
/// misses and re-picks; the choice is the rendezvous order's): entries kept for a TTL after their last use,
/// at most a capacity of them, with the hits, misses and repicks counted in its
/// [`AffinityCounts`]. [`Dispatcher::with_session_affinity`] makes a fresh one;
/// [`Dispatcher::with_affinity_table`] takes one made here (the simulator shares one between
/// bindings to show its oracle catches a table that outlives its binding).
///
/// [`Dispatcher::with_session_affinity`]: crate::push::Dispatcher::with_session_affinity
/// [`Dispatcher::with_affinity_table`]: crate::push::Dispatcher::with_affinity_table
pub struct AffinityTable {
    ttl: Duration,
    capacity: usize,
    state: Mutex<State>,
    counts: Arc<AffinityCounts>,
}

impl std::fmt::Debug for AffinityTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AffinityTable")
            .field("ttl", &self.ttl)
            .field("capacity", &self.capacity)
            .field("len", &self.len())
            .finish()
    }
}

impl AffinityTable {
    /// A table keeping entries `ttl` after their last use, at most `capacity` of them.
    pub fn new(ttl: Duration, capacity: usize, counts: Arc<AffinityCounts>) -> Self {
        AffinityTable {
            ttl,
            capacity: capacity.max(1),
            state: Mutex::default(),
            counts,
        }
    }

    pub(crate) fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The counters this table's lookups record into.
    pub fn counts(&self) -> &Arc<AffinityCounts> {
        &self.counts
    }

    /// Live and not-yet-collected entries (at most the capacity).
    pub(crate) fn len(&self) -> usize {
        self.state.lock().entries.len()
    }

    /// The worker remembered for `key`, if its entry is younger than the TTL at `now`.
    pub(crate) fn remembered(&self, key: u64, now: Instant) -> Option<Arc<Instance>> {
        let mut state = self.state.lock();
        let dropped = self.collect(&mut state, now);
        let found = state.entries.get(&key).and_then(|e| {
            (now.saturating_duration_since(e.touched) < self.ttl).then(|| Arc::clone(&e.instance))
        });
        drop(state);
        self.counts.dropped(dropped);
        found
    }

    /// Remember (or refresh) `key` → `instance` as of `now`, evicting the oldest entries over
    /// the capacity.
    pub(crate) fn remember(&self, key: u64, instance: Arc<Instance>, now: Instant) {
        let mut state = self.state.lock();
        let slot = state.next_slot;
        state.next_slot += 1;
        state.order.push_back((key, slot));
        state.entries.insert(
            key,
            Entry {
                instance,
                touched: now,
                slot,
            },
        );
        let mut dropped = self.collect(&mut state, now);
        while state.entries.len() > self.capacity {
            match state.order.pop_front() {
                Some((k, s)) => {
                    if state.entries.get(&k).is_some_and(|e| e.slot == s) {
                        state.entries.remove(&k);
                        dropped.evicted += 1;
                    }
                }
                None => break,
            }
        }
        // Stale slots (keys touched again) pile up in the queue; compact it when they
        // outnumber the entries, so the queue stays within twice the capacity (amortized O(1)).
        if state.order.len() > 2 * self.capacity + 16 {
            let State { entries, order, .. } = &mut *state;
            order.retain(|(k, s)| entries.get(k).is_some_and(|e| e.slot == *s));
        }
        drop(state);
        self.counts.dropped(dropped);
    }

    /// Pop expired entries (and stale slots) off the front of the queue: the front holds the
    /// least recently touched, so this stops at the first live one.
    fn collect(&self, state: &mut State, now: Instant) -> Dropped {
        let mut dropped = Dropped::default();
        while let Some(&(k, s)) = state.order.front() {
            match state.entries.get(&k) {
                Some(e) if e.slot == s => {
                    if now.saturating_duration_since(e.touched) < self.ttl {
                        break;
                    }
                    state.entries.remove(&k);
                    dropped.expired += 1;
                }
                _ => {}
            }
            state.order.pop_front();
        }
        dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::EndpointId;
    use std::net::{Ipv4Addr, SocketAddr};

    fn instance(id: u64) -> Arc<Instance> {
        Arc::new(Instance {
            endpoint: EndpointId::new("t", "prefill", "generate"),
            instance_id: id,
            address: SocketAddr::from((Ipv4Addr::LOCALHOST, 1)),
        })
    }

    fn table(ttl_ms: u64, capacity: usize) -> AffinityTable {
        AffinityTable::new(
            Duration::from_millis(ttl_ms),
            capacity,
            Arc::new(AffinityCounts::default()),
        )
    }

    #[test]
    fn an_entry_lives_exactly_until_its_ttl_after_the_last_touch() {
        let t = table(100, 8);
        let t0 = Instant::now();
        t.remember(1, instance(7), t0);
        let at = |ms| t0 + Duration::from_millis(ms);
        assert_eq!(t.remembered(1, at(99)).map(|i| i.instance_id), Some(7));
        // Touched again at 99: lives until 199.
        t.remember(1, instance(7), at(99));
        assert!(t.remembered(1, at(198)).is_some());
        assert!(t.remembered(1, at(199)).is_none(), "expired at the TTL");
        assert_eq!(t.len(), 0, "the lookup collected it");
        assert_eq!(t.counts().snapshot().expired, 1);
    }

    #[test]
    fn the_capacity_holds_and_the_least_recently_touched_goes_first() {
        let t = table(10_000, 3);
        let t0 = Instant::now();
        for key in 0..3 {
            t.remember(key, instance(key), t0);
        }
        // Key 0 touched again: key 1 is now the oldest.
        t.remember(0, instance(0), t0);
        t.remember(9, instance(9), t0);
        assert_eq!(t.len(), 3);
        assert!(t.remembered(1, t0).is_none(), "the oldest was evicted");
        assert!(t.remembered(0, t0).is_some());
        assert!(t.remembered(2, t0).is_some());
        assert!(t.remembered(9, t0).is_some());
        assert_eq!(t.counts().snapshot().evictions, 1);
    }

    #[test]
    fn refreshing_one_key_forever_keeps_the_queue_bounded() {
        let t = table(10_000, 4);
        let t0 = Instant::now();
        for _ in 0..10_000 {
            t.remember(5, instance(1), t0);
        }
        let queue = t.state.lock().order.len();
        assert!(queue <= 2 * 4 + 17, "queue grew to {queue}");
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn a_moved_entry_points_at_the_new_worker() {
        let t = table(1000, 4);
        let t0 = Instant::now();
        t.remember(3, instance(1), t0);
        t.remember(3, instance(2), t0);
        assert_eq!(t.remembered(3, t0).map(|i| i.instance_id), Some(2));
        assert_eq!(t.len(), 1);
    }
}
