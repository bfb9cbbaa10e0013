//! The work a conversation placed on a worker itself: the part of that worker's recent work
//! the KV cost does not hold against the conversation's next turn.
//!
//! A worker's recent work ([`super::LoadBoard::recent`]) tells the workers that took the last
//! sessions from those that idled, so new sessions spread. Held against a conversation's own
//! home it also counts that conversation's earlier turns, and a short chat (a few hundred
//! tokens of history against 4,096 tokens of overhead per turn) then leaves the worker holding
//! its history within a few turns (issue #40). Discounting the home's recent work by how cold
//! the history is fixed that, but also discounted *other* users' work there: in closed loops a
//! conversation stayed behind other sessions' work (docs/performance.md, "KV cost at every
//! block size"). This table takes out exactly the conversation's own share.
//!
//! Each pick leaves an entry at the last block of its prompt: the worker it went to and that
//! worker's own work for the chain so far, the own work found at the block the pick was
//! credited with (the end of the previous turn's prompt, when the worker held it) plus this
//! pick's booking. The next turn's prompt extends this one, so the worker holding its history
//! is credited with that block and finds the chain's own work there in one lookup. A prompt
//! that ends a block many requests share (a system prompt alone) is no one conversation's:
//! the selector reads own work only at narrowly held blocks (`KvSelector`, `push/kv.rs`).
//!
//! Clock-free, like the rest of the selection: own work decays by half every
//! [`RECENT_WORK_HALF_LIFE`] picks, as recent work does, so it stays a part of it. Memory is
//! bounded: past [`capacity_for`] entries the oldest are dropped.

use std::collections::HashMap;

use super::load_board::RECENT_WORK_HALF_LIFE;
use crate::discovery::InstanceId;
use crate::kv_events::MixState;

/// An entry this many half-lives old holds under 1/256 of what it held: dropped first when
/// the table is full.
const FORGET_AFTER_HALF_LIVES: u64 = 8;

/// The capacity for blocks of `block_size` tokens: as many entries as the heat table keeps
/// ([`super::heat::capacity_for`]), so what is forgotten does not depend on the block size.
pub fn capacity_for(block_size: u32) -> usize {
    super::heat::capacity_for(block_size)
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    worker: InstanceId,
    /// Own work at `at` (tokens).
    own: f64,
    /// The pick that wrote it.
    at: u64,
}

/// Own work per chain end (see the module docs).
#[derive(Debug, Clone)]
pub struct OwnWork {
    /// Picks so far: the clock of the decay.
    picks: u64,
    entries: HashMap<u64, Entry, MixState>,
    capacity: usize,
}

impl Default for OwnWork {
    fn default() -> Self {
        OwnWork::new(capacity_for(512))
    }
}

impl OwnWork {
    /// A table keeping at most `capacity` entries (at least 2).
    pub fn new(capacity: usize) -> Self {
        OwnWork {
            picks: 0,
            entries: HashMap::default(),
            capacity: capacity.max(2),
        }
    }

    fn decayed(&self, entry: &Entry) -> f64 {
        #[allow(clippy::cast_precision_loss)] // pick counts far below 2^52
        let age = self.picks.saturating_sub(entry.at) as f64;
        entry.own * (-age / f64::from(RECENT_WORK_HALF_LIFE)).exp2()
    }

    /// The own work on `worker` of the conversation whose earlier prompt ended at `block`
    /// (tokens, decayed; 0 when that prompt went to another worker or is forgotten).
    pub fn own(&self, block: u64, worker: InstanceId) -> f64 {
        match self.entries.get(&block) {
            Some(entry) if entry.worker == worker => self.decayed(entry),
            _ => 0.0,
        }
    }

    /// Count one pick: a prompt ending at block `last` (`None`: shorter than a block, nothing
    /// to continue from), credited on `worker` with the prefix ending at `credited`, booked
    /// `amount` tokens there.
    pub fn record(
        &mut self,
        last: Option<u64>,
        credited: Option<u64>,
        worker: InstanceId,
        amount: u64,
    ) {
        let prior = credited.map_or(0.0, |block| self.own(block, worker));
        self.picks += 1;
        let Some(last) = last else { return };
        if !self.entries.contains_key(&last) && self.entries.len() >= self.capacity {
            self.sweep();
        }
        #[allow(clippy::cast_precision_loss)] // token counts far below 2^52
        let own = prior + amount as f64;
        let at = self.picks;
        self.entries.insert(last, Entry { worker, own, at });
    }

    /// Drop the entries older than [`FORGET_AFTER_HALF_LIVES`]; if that frees less than a
    /// quarter, the older half.
    fn sweep(&mut self) {
        let horizon = u64::from(RECENT_WORK_HALF_LIFE) * FORGET_AFTER_HALF_LIVES;
        let oldest_kept = self.picks.saturating_sub(horizon);
        self.entries.retain(|_, e| e.at > oldest_kept);
        if self.entries.len() * 4 > self.capacity * 3 {
            let mut ages: Vec<u64> = self.entries.values().map(|e| e.at).collect();
            let mid = ages.len() / 2;
            let (_, median, _) = ages.select_nth_unstable(mid);
            let median = *median;
            self.entries.retain(|_, e| e.at > median);
        }
    }

    /// How many chain ends are tracked.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_conversations_turns_on_one_worker_add_up_and_count_only_there() {
        let mut own = OwnWork::new(64);
        // Turn 1 ends at block 10 on worker 1; turn 2 is credited with it there and ends at 20.
        own.record(Some(10), None, 1, 1_000);
        own.record(Some(20), Some(10), 1, 500);
        let decay = (-1.0 / f64::from(RECENT_WORK_HALF_LIFE)).exp2();
        assert!((own.own(20, 1) - 1_500.0).abs() < 1e-9);
        assert!((own.own(10, 1) - 1_000.0 * decay).abs() < 1e-9);
        // Not another worker's own, and not a chain nobody ended.
        assert_eq!(own.own(20, 2), 0.0);
        assert_eq!(own.own(30, 1), 0.0);
        // A turn that moved starts its own work afresh on the new worker.
        own.record(Some(30), Some(20), 2, 700);
        assert!((own.own(30, 2) - 700.0).abs() < 1e-9);
    }

    #[test]
    fn own_work_halves_every_half_life_of_picks() {
        let mut own = OwnWork::new(64);
        own.record(Some(7), None, 1, 1_024);
        for _ in 0..RECENT_WORK_HALF_LIFE {
            own.record(None, None, 2, 1);
        }
        assert!((own.own(7, 1) - 512.0).abs() < 1e-6, "{}", own.own(7, 1));
    }

    #[test]
    fn the_table_stays_bounded_and_keeps_the_newest_entries() {
        let mut own = OwnWork::new(64);
        for pick in 0..10_000u64 {
            own.record(Some(pick), pick.checked_sub(1), 1, 10);
            assert!(own.len() <= 64);
        }
        assert!(own.own(9_999, 1) > 0.0);
        assert_eq!(own.own(0, 1), 0.0);
    }
}
