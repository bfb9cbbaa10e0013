//! How hot a cached prefix is: how many recent picks were credited with it.
//!
//! The KV cost keeps a request on the worker that holds its prefix with an extra credit (the
//! keep credit, [`super::select::KvCost::keep_credit`]) while that prefix is *cold*: a
//! conversation's history is credited once per turn, so moving the turn elsewhere recomputes
//! work that nobody else will reuse. A prefix that many picks are credited with in a short
//! span (a system prompt every request carries) is *hot*: replicating it on every worker is
//! cheap against the stream that needs it, so its keep credit fades and that stream spreads by
//! load. The measurement behind it is in docs/performance.md ("KV cost").
//!
//! Clock-free, like the rest of the selection: time is counted in picks. A block's heat is the
//! number of picks credited with it (with it or any deeper block of the same chain), each
//! decaying by half every `half_life` picks since; its coldness is `2^−heat` (1 for a block no
//! recent pick credited, halving with each one). A conversation's newest history block is
//! credited for the first time by its next turn, so that turn finds it cold; a tenant's
//! prompt is credited by every turn of every session of that tenant, so it runs hot.
//! Memory is bounded: entries that cooled below [`FORGET_BELOW`] are dropped when the table
//! fills, which changes no coldness by more than that fraction. The bound is in tokens
//! ([`capacity_for`]: as many tokens of prefix at every block size), so what is forgotten does
//! not depend on the block size either (#40).

use std::collections::HashMap;

use crate::kv_events::MixState;

/// Heat below which an entry is forgotten when the table is full (coldness 0.99 or more).
pub const FORGET_BELOW: f64 = 1.0 / 64.0;

/// Entries kept before a sweep of the cooled ones.
const DEFAULT_CAPACITY: usize = 16_384;

/// Tokens of prefix the table holds before a sweep: [`DEFAULT_CAPACITY`] blocks of 512.
const CAPACITY_TOKENS: usize = DEFAULT_CAPACITY * 512;

/// The capacity for blocks of `block_size` tokens: 16,384 × 512 tokens worth of blocks (16,384
/// at 512 tokens per block, 524,288 at 16; a sweep happens only when hot entries fill it), so
/// a table at a small block size forgets no sooner than one at a large size.
pub fn capacity_for(block_size: u32) -> usize {
    let block = usize::try_from(block_size.max(1)).unwrap_or(usize::MAX);
    (CAPACITY_TOKENS / block).max(DEFAULT_CAPACITY / 8)
}

/// Pick-counted heat of the blocks recent picks were credited with (see the module docs).
#[derive(Debug, Clone)]
pub struct PrefixHeat {
    half_life: f64,
    /// Picks so far: the clock of the decay.
    picks: u64,
    /// Block hash → (heat at `at`, `at`).
    entries: HashMap<u64, (f64, u64), MixState>,
    capacity: usize,
}

impl PrefixHeat {
    /// A table whose heat halves every `half_life` picks (at least 1).
    pub fn new(half_life: u32) -> Self {
        PrefixHeat {
            half_life: f64::from(half_life.max(1)),
            picks: 0,
            entries: HashMap::default(),
            capacity: DEFAULT_CAPACITY,
        }
    }

    /// The same table, sweeping cooled entries once it holds `capacity` of them.
    #[must_use]
    pub fn with_capacity(mut self, capacity: usize) -> Self {
        self.capacity = capacity.max(1);
        self
    }

    fn decayed(&self, heat: f64, at: u64) -> f64 {
        #[allow(clippy::cast_precision_loss)] // pick counts far below 2^52
        let age = self.picks.saturating_sub(at) as f64;
        heat * (-age / self.half_life).exp2()
    }

    /// The heat of `block` now: picks credited with it, decayed by their age.
    pub fn heat(&self, block: u64) -> f64 {
        self.entries
            .get(&block)
            .map_or(0.0, |&(heat, at)| self.decayed(heat, at))
    }

    /// `2^−heat`: 1 for a block no recent pick was credited with, halving with each.
    pub fn coldness(&self, block: u64) -> f64 {
        (-self.heat(block)).exp2()
    }

    /// Count one pick, credited with `blocks` (none: the pick was credited with nothing; it
    /// still ages every entry).
    pub fn record(&mut self, blocks: &[u64]) {
        self.picks += 1;
        for &block in blocks {
            let now = self.heat(block) + 1.0;
            if !self.entries.contains_key(&block) && self.entries.len() >= self.capacity {
                self.sweep();
            }
            self.entries.insert(block, (now, self.picks));
        }
    }

    /// Drop the entries that cooled below [`FORGET_BELOW`]; if that frees nothing (more hot
    /// entries than the capacity), the coldest half.
    fn sweep(&mut self) {
        let (picks, half_life) = (self.picks, self.half_life);
        #[allow(clippy::cast_precision_loss)] // pick counts far below 2^52
        let now = |&(heat, at): &(f64, u64)| {
            heat * (-(picks.saturating_sub(at) as f64) / half_life).exp2()
        };
        self.entries.retain(|_, e| now(e) >= FORGET_BELOW);
        if self.entries.len() >= self.capacity {
            let mut heats: Vec<f64> = self.entries.values().map(now).collect();
            let mid = heats.len() / 2;
            let (_, median, _) = heats.select_nth_unstable_by(mid, f64::total_cmp);
            let median = *median;
            self.entries.retain(|_, e| now(e) > median);
        }
    }

    /// How many blocks are tracked.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no block is tracked.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_never_credited_is_cold_and_each_credit_halves_its_coldness() {
        let mut heat = PrefixHeat::new(1_000_000);
        assert_eq!(heat.coldness(7), 1.0);
        heat.record(&[7]);
        assert!((heat.coldness(7) - 0.5).abs() < 1e-4);
        heat.record(&[7]);
        assert!((heat.coldness(7) - 0.25).abs() < 1e-4);
        assert_eq!(heat.coldness(8), 1.0);
    }

    #[test]
    fn heat_halves_every_half_life_of_picks() {
        let mut heat = PrefixHeat::new(10);
        heat.record(&[7]);
        for _ in 0..10 {
            heat.record(&[]);
        }
        assert!((heat.heat(7) - 0.5).abs() < 1e-9, "{}", heat.heat(7));
        for _ in 0..10 {
            heat.record(&[8]);
        }
        assert!((heat.heat(7) - 0.25).abs() < 1e-9);
    }

    #[test]
    fn the_table_stays_bounded_and_keeps_the_hot_blocks() {
        let mut heat = PrefixHeat::new(8).with_capacity(64);
        for pick in 0..10_000u64 {
            // Block 1 is credited by every other pick; the rest once each.
            heat.record(&[if pick % 2 == 0 { 1 } else { 1_000 + pick }]);
            assert!(heat.len() <= 64);
        }
        assert!(heat.heat(1) > 4.0, "{}", heat.heat(1));
        // A block forgotten cold differs from its true coldness by under FORGET_BELOW.
        assert!(heat.coldness(1_001) > 1.0 - FORGET_BELOW);
    }
}
