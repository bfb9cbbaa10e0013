//! Prefix-aware worker selection.
//!
//! A worker that publishes KV cache events ([`crate::kv_events`]) is scored from the index of
//! its real cache: its overlap with a request is the number of leading blocks of the request it
//! holds now. A worker that publishes nothing is scored by prediction: the selector remembers,
//! in a bounded LRU, which workers it sent which block chains to, and assumes they still hold
//! them. Both kinds mix in one pool (docs/kv_events.md).

use std::collections::{HashMap, VecDeque};

use super::heat::PrefixHeat;
use super::load_board::{LoadBoard, Walk};
use super::own_work::OwnWork;
use super::select::{self, is_busy, Candidate, Choice, KvCost};
use crate::advert::KvRouterConfig;
use crate::discovery::InstanceId;
use crate::hooks::Seam;
use crate::kv_events::{Applied, EventBatch, KvIndex, KvSnapshot, MixState};

/// A block chain is remembered for at most this many workers (the most recent ones); a shared
/// system prompt routed everywhere would otherwise grow one entry without bound.
const MAX_WORKERS_PER_BLOCK: usize = 8;

pub use crate::kv_events::block_hashes;
pub(crate) use crate::kv_events::mix;

/// The salt that breaks ties between equal costs: per call, so that equal workers (idle ones
/// at a low rate, with a prefix all of them hold) share the stream instead of one of them
/// taking every request (a per-prefix salt did that: work max/mean 2.97 on a shared prompt).
/// From the call's random draw alone, not the request's block hashes: those differ with the
/// block size, and the same workload must route the same way at every block size (#40).
fn tie_salt(random: u64) -> u64 {
    mix(random)
}

struct Entry {
    workers: Vec<InstanceId>,
    tick: u64,
}

/// The KV selector: the index of the publishing workers' real caches, a bounded LRU of
/// predicted block chains for the others, and the cost of [`super::select`].
pub struct KvSelector {
    cost: KvCost,
    capacity: usize,
    entries: HashMap<u64, Entry, MixState>,
    /// `(tick, block hash)` in the order of use, oldest first. An entry whose tick no longer
    /// matches its block's is stale (the block was used again later) and is skipped: O(1)
    /// per use instead of an ordered-map update; compacted when stale entries dominate.
    order: VecDeque<(u64, u64)>,
    tick: u64,
    /// The real caches of the workers that publish events.
    index: KvIndex,
    /// How many recent picks were credited with each prefix: scales the keep credit.
    heat: PrefixHeat,
    /// The work each conversation placed on its worker (not held against its next turn).
    own: OwnWork,
    /// [`select_on`](Self::select_on) lists the holders of a request's blocks from the first
    /// block held by at most this many workers (see [`KvIndex::deep_overlaps`]).
    deep_limit: usize,
    /// Where the selector's mutants break the walk and the keep credit (see [`KvMutant`]);
    /// zero-sized in normal builds.
    mutant: Seam<KvMutant>,
}

/// Deliberately broken variants of the selector's walk, keep credit, heat and recent work,
/// each caught by a test (docs/properties.md, "Mutants"; see `crate::hooks`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KvMutant {
    /// The load-order walk credits no shallow blocks (as if the widely held prefix were held
    /// by nobody).
    IgnoresShallow,
    /// The walk's floor forgets the keep credit: it stops before a cold shallow holder.
    FloorIgnoresKeep,
    /// A load whose recent work cannot win ends the whole walk, not just that load.
    RecentStopsWalk,
    /// Every prefix counts as cold: heat never fades the keep credit.
    IgnoresHeat,
}

/// The default of [`KvSelector`]'s deep limit: holders of a block held more widely (a system
/// prompt every worker caches) are not listed one by one; the load order bounds them.
pub const DEEP_HOLDERS_LIMIT: usize = 32;

impl std::fmt::Debug for KvSelector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvSelector")
            .field("cost", &self.cost)
            .field("entries", &self.entries.len())
            .field("capacity", &self.capacity)
            .field("indexed_blocks", &self.index.len())
            .finish()
    }
}

impl KvSelector {
    /// A selector hashing blocks of `block_size` tokens, remembering at most `capacity` block
    /// chains, costing with `config.overlap_score_weight` and `config.prefill_load_scale` and
    /// sampling with `config.router_temperature` (0 = always the cheapest).
    pub fn new(block_size: u32, config: &KvRouterConfig, capacity: usize) -> Self {
        KvSelector {
            cost: KvCost::from_config(block_size, config),
            capacity: capacity.max(1),
            entries: HashMap::default(),
            order: VecDeque::new(),
            tick: 0,
            index: KvIndex::default(),
            heat: PrefixHeat::new(config.prefill_heat_half_life)
                .with_capacity(super::heat::capacity_for(block_size)),
            deep_limit: DEEP_HOLDERS_LIMIT,
            own: OwnWork::new(super::own_work::capacity_for(block_size)),
            mutant: Seam::off(),
        }
    }

    /// The selector running `mutant` (see [`KvMutant`]).
    #[cfg(test)]
    pub(crate) fn with_mutant(mut self, mutant: KvMutant) -> Self {
        self.mutant = Seam::on(mutant);
        self
    }

    /// The selector whose cost runs `mutant` (see [`select::CostMutant`]).
    #[cfg(test)]
    pub(crate) fn with_cost_mutant(mut self, mutant: select::CostMutant) -> Self {
        self.cost = self.cost.with_mutant(mutant);
        self
    }

    /// The same selector listing holders one by one only for blocks held by at most `limit`
    /// workers (default [`DEEP_HOLDERS_LIMIT`]; the tests vary it to exercise both paths).
    #[must_use]
    pub fn with_deep_limit(mut self, limit: usize) -> Self {
        self.deep_limit = limit;
        self
    }

    /// The cost terms this selector picks by.
    pub fn cost(&self) -> &KvCost {
        &self.cost
    }

    /// The index of the publishing workers' caches.
    pub fn index(&self) -> &KvIndex {
        &self.index
    }

    /// The heat of the prefixes recent picks were credited with.
    pub fn heat(&self) -> &PrefixHeat {
        &self.heat
    }

    /// The coldness of the deepest of the `overlap` leading blocks of `hashes` (1 for none).
    fn coldness(&self, hashes: &[u64], overlap: usize) -> f64 {
        if self.mutant.is(KvMutant::IgnoresHeat) {
            return 1.0;
        }
        match overlap.checked_sub(1).and_then(|i| hashes.get(i)) {
            Some(&deepest) if self.cost.keep_credit > 0.0 => self.heat.coldness(deepest),
            _ => 1.0,
        }
    }

    /// `worker` as a candidate for the request `hashes` with `booked` tokens booked: its
    /// overlap as [`overlap`](Self::overlap) credits it, the coldness of that prefix and the
    /// request's own work on it.
    pub fn candidate(&self, hashes: &[u64], worker: InstanceId, booked: u64) -> Candidate {
        let overlap = self.overlap(hashes, worker);
        let candidate =
            Candidate::new(worker, overlap, booked).with_coldness(self.coldness(hashes, overlap));
        self.with_own(hashes, candidate)
    }

    /// The most keep credit (coldness × overlap) any worker holding at most the first `k`
    /// blocks of `hashes` can get: the bound behind the load-order walk's early stop. Walks
    /// from block `k` down and stops once no shallower block can beat the best (a cold deepest
    /// block ends it at once), so it costs a lookup or two in the usual shapes.
    #[allow(clippy::cast_precision_loss)] // block counts far below 2^52
    fn max_kept(&self, hashes: &[u64], k: usize) -> f64 {
        if self.cost.keep_credit <= 0.0 {
            return 0.0;
        }
        if self.mutant.is(KvMutant::FloorIgnoresKeep) {
            return 0.0;
        }
        let mut best = 0.0f64;
        for overlap in (1..=k.min(hashes.len())).rev() {
            if overlap as f64 <= best {
                break;
            }
            best = best.max(self.coldness(hashes, overlap) * overlap as f64);
        }
        best
    }

    /// `candidate` with its own work: what the request's conversation placed on it, found at
    /// the deepest block it is credited with, counted only where that block is narrowly held
    /// (by at most the deep limit of workers). A prefix held across the pool (a system prompt
    /// every worker caches) is nobody's own conversation, and it keeps the load-order walk
    /// exact: the workers it walks hold only such a prefix, so their own work is 0.
    fn with_own(&self, hashes: &[u64], candidate: Candidate) -> Candidate {
        if self.cost.recent_weight <= 0.0 {
            // Own work only discounts recent work: with none weighed there is nothing to look up.
            return candidate;
        }
        let own = match candidate.overlap.checked_sub(1).and_then(|i| hashes.get(i)) {
            Some(&block) if self.index.held_by(block) <= self.deep_limit => {
                self.own.own(block, candidate.id)
            }
            _ => 0.0,
        };
        candidate.with_own(own)
    }

    /// Count a pick of `worker` for the request `hashes`, credited with its first `overlap`
    /// blocks and booked `booked` tokens there: those blocks get hotter (see [`super::heat`];
    /// without a keep credit there is nothing to weigh, so no heat is counted), and the
    /// request's chain end records the work its conversation placed on `worker`
    /// ([`super::own_work`]; without a recent-work weight nothing reads it, so nothing is
    /// recorded).
    pub fn record_pick(&mut self, hashes: &[u64], overlap: usize, worker: InstanceId, booked: u64) {
        self.record_credit(hashes, overlap);
        if self.cost.recent_weight <= 0.0 {
            // Nothing weighs recent work, so nothing reads own work: keep no table.
            return;
        }
        let credited = overlap.checked_sub(1).and_then(|i| hashes.get(i)).copied();
        self.own
            .record(hashes.last().copied(), credited, worker, booked);
    }

    /// Count a pick credited with the first `overlap` blocks of `hashes` in the heat table
    /// only: those blocks get hotter (see [`super::heat`]); a pick credited with nothing only
    /// ages the table. Without a keep credit there is nothing to weigh, so nothing is counted.
    pub fn record_credit(&mut self, hashes: &[u64], overlap: usize) {
        if self.cost.keep_credit > 0.0 {
            self.heat.record(&hashes[..overlap.min(hashes.len())]);
        }
    }

    /// Apply one batch of `worker`'s KV events to the index (see [`KvIndex::apply`]); from
    /// then on the worker is scored by the index, not by prediction.
    pub fn apply_events(&mut self, worker: InstanceId, batch: &EventBatch) -> Applied {
        self.index.apply(worker, batch)
    }

    /// Replace what the index knows of `worker` with a snapshot of its cache (see
    /// [`KvIndex::apply_snapshot`]); from then on the worker is scored by the index.
    pub fn apply_snapshot(&mut self, worker: InstanceId, snapshot: &KvSnapshot) -> Applied {
        self.index.apply_snapshot(worker, snapshot)
    }

    /// Drop what the index knows of `worker` (its event stream reconnected): its next batch
    /// starts it afresh, and until then it is scored by prediction.
    pub fn reset_events(&mut self, worker: InstanceId) {
        self.index.remove_worker(worker);
    }

    /// Keep in the index only the workers `keep` accepts (the others left admission).
    pub fn retain_indexed(&mut self, keep: impl FnMut(InstanceId) -> bool) {
        self.index.retain_workers(keep);
    }

    /// The block size in tokens.
    pub fn block_size(&self) -> u32 {
        self.cost.block_size
    }

    /// How many block chains are remembered.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Leading blocks of `hashes` credited to `worker`: held per its events if it publishes,
    /// else remembered from routing.
    pub fn overlap(&self, hashes: &[u64], worker: InstanceId) -> usize {
        if self.index.publishes(worker) {
            return self.index.overlap(hashes, worker);
        }
        hashes
            .iter()
            .take_while(|h| {
                self.entries
                    .get(h)
                    .is_some_and(|e| e.workers.contains(&worker))
            })
            .count()
    }

    /// Pick among `candidates` (`(id, booked work in tokens)`) for a prompt of `tokens` tokens
    /// whose block hashes are `hashes`: the cheapest by [`KvCost::cost`] among those not busy
    /// (see [`select::choose`]), the overlap from the index for a worker that publishes events
    /// and from prediction for the others.
    ///
    /// Costs O(B + workers holding the request's first block + candidates) for a request of B
    /// blocks: the walks visit holder sets, and each candidate is one hash lookup.
    pub fn select(
        &self,
        hashes: &[u64],
        tokens: u64,
        candidates: &[(InstanceId, u64)],
        busy_threshold: Option<u64>,
        random: u64,
    ) -> Choice {
        let base = candidates
            .iter()
            .map(|&(id, booked)| Candidate::new(id, 0, booked));
        self.select_among(hashes, tokens, base, busy_threshold, random)
    }

    /// [`select`](Self::select) over `base` candidates (id, booked and recent work; their
    /// overlap and coldness are filled in here).
    fn select_among(
        &self,
        hashes: &[u64],
        tokens: u64,
        base: impl Iterator<Item = Candidate> + Clone,
        busy_threshold: Option<u64>,
        random: u64,
    ) -> Choice {
        // Sparse overlaps from the index, sorted by worker; predicted ones (at most
        // MAX_WORKERS_PER_BLOCK) for the workers that publish nothing.
        let mut indexed = Vec::new();
        self.index.overlaps(hashes, &mut indexed);
        let mut predicted = self.predicted(hashes);
        predicted.retain(|&(w, _)| !self.index.publishes(w));
        // Candidates usually come by ascending id (the routable view's order): a cursor over
        // `indexed` then finds each in amortised O(1); out of order, a binary search.
        let mut cursor = 0;
        // The least booked work matters only to the balance slack.
        let least = self
            .cost
            .balance_slack
            .and_then(|_| base.clone().map(|c| c.booked).min());
        let scored = base.map(|c| {
            let id = c.id;
            if cursor > 0 && indexed[cursor - 1].0 >= id {
                cursor = indexed.partition_point(|o| o.0 < id);
            } else {
                while cursor < indexed.len() && indexed[cursor].0 < id {
                    cursor += 1;
                }
            }
            let overlap = match indexed.get(cursor) {
                Some(&(w, n)) if w == id => {
                    cursor += 1;
                    n
                }
                _ => predicted.iter().find(|p| p.0 == id).map_or(0, |p| p.1),
            };
            self.with_own(
                hashes,
                Candidate {
                    overlap,
                    ..c.with_coldness(self.coldness(hashes, overlap))
                },
            )
        });
        let limit = self.cost.limit(busy_threshold, least);
        self.choose(tokens, scored, limit, random)
    }

    /// [`select`](Self::select) over the members of `board` (their booked and recent work its
    /// own) minus `excluded`, without a pass over the pool: with a positive overlap weight and
    /// temperature 0, a worker's cost is at least [`KvCost::floor`] of its load and the most
    /// overlap and keep credit it can have, so this costs (1) the workers holding the request's
    /// blocks from its first *narrowly* held block `k` on (held by at most the deep limit of
    /// workers; [`KvIndex::deep_overlaps`]), exactly, (2) the prediction's workers, and (3) the
    /// members in ascending load order ([`LoadBoard::walk_by_load`]; within a load, ascending
    /// recent work) with overlaps up to `k`, skipping the rest of a load as soon as the floor
    /// with the recent work reached cannot beat the best so far, and stopping as soon as the
    /// floor of a load cannot, or the load reaches the busy threshold. Every unlisted worker
    /// holds at most `k` leading blocks, so the stops are exact. Without a widely held prefix
    /// (`k = 0`) the walk stops after one least-loaded member: O(B + holders + |excluded|); a
    /// prefix the whole pool holds costs O(B + k × (members walked)), typically a handful.
    /// Otherwise (a sampling temperature, or a weight that does not reward overlap) it costs
    /// every member, as [`select`](Self::select) does.
    ///
    /// The pick's cost equals the best cost over the usable members; among equal costs the
    /// candidates differ from [`select`](Self::select)'s (ties between non-holders go to the
    /// board's pick).
    pub fn select_on(
        &self,
        hashes: &[u64],
        tokens: u64,
        board: &LoadBoard,
        excluded: &[InstanceId],
        busy_threshold: Option<u64>,
        random: u64,
    ) -> Choice {
        if self.cost.temperature > 0.0 || self.cost.overlap_weight <= 0.0 {
            let base = board
                .members()
                .iter()
                .map(|i| i.instance_id)
                .filter(|id| !excluded.contains(id))
                .map(|id| Candidate::new(id, 0, board.combined(id)).with_recent(board.recent(id)));
            return self.select_among(hashes, tokens, base, busy_threshold, random);
        }
        let salt = tie_salt(random);
        // The least booked work matters only to the balance slack: no lookup without it.
        let least = self
            .cost
            .balance_slack
            .and_then(|_| board.least_loaded(salt, excluded))
            .map(|l| l.1);
        let busy_threshold = self.cost.limit(busy_threshold, least);
        let mut holders = Vec::new();
        let k = self
            .index
            .deep_overlaps(hashes, self.deep_limit, &mut holders);
        let indexed = holders.len();
        let mut predicted = self.predicted(hashes);
        predicted.retain(|&(w, _)| !self.index.publishes(w));
        holders.extend(predicted);
        let mut scored = Vec::with_capacity(holders.len() + 1);
        board.members_of(&holders, indexed, excluded, &mut scored);
        for c in &mut scored {
            c.coldness = self.coldness(hashes, c.overlap);
            *c = self.with_own(hashes, *c);
        }
        let mut any = !scored.is_empty();
        let max_kept = self.max_kept(hashes, k);
        let mut best = scored
            .iter()
            .filter(|c| !is_busy(c.booked, busy_threshold))
            .map(|c| self.cost.cost(tokens, c))
            .reduce(f64::min);
        // The shallow part: every member's credit up to `k` blocks, least loaded first.
        let shallow = &hashes[..k];
        let mut walked: Option<Candidate> = None;
        board.walk_by_load(salt, excluded, |id, load, recent| {
            any = true;
            if is_busy(load, busy_threshold) {
                return Walk::Stop;
            }
            if let Some(b) = best {
                if self.cost.floor(tokens, k, max_kept, load, 0.0) >= b {
                    return Walk::Stop;
                }
                if self.cost.floor(tokens, k, max_kept, load, recent) >= b {
                    if self.mutant.is(KvMutant::RecentStopsWalk) {
                        return Walk::Stop;
                    }
                    return Walk::NextLoad;
                }
            }
            let overlap = self.index.overlap(shallow, id);
            let overlap = if self.mutant.is(KvMutant::IgnoresShallow) {
                0
            } else {
                overlap
            };
            let c = Candidate::new(id, overlap, load)
                .with_recent(recent)
                .with_coldness(self.coldness(hashes, overlap));
            let cost = self.cost.cost(tokens, &c);
            if best.is_none_or(|b| cost < b) {
                best = Some(cost);
                walked = Some(c);
            }
            Walk::Next
        });
        if let Some(w) = walked {
            if !scored.iter().any(|s| s.id == w.id) {
                scored.push(w);
            }
        }
        match self.choose(tokens, scored.into_iter(), busy_threshold, random) {
            Choice::Empty if any => Choice::Overloaded,
            choice => choice,
        }
    }

    /// The cost rule of [`select`](Self::select) over candidates whose overlap (and booked
    /// and recent work) the caller supplies, their coldness from this selector's heat: for
    /// baselines that read the caches some other way (the trace replay's oracle).
    pub fn select_scored(
        &self,
        hashes: &[u64],
        tokens: u64,
        candidates: &[Candidate],
        random: u64,
    ) -> Choice {
        let candidates = candidates
            .iter()
            .map(|c| self.with_own(hashes, c.with_coldness(self.coldness(hashes, c.overlap))));
        self.choose(tokens, candidates, None, random)
    }

    fn choose(
        &self,
        tokens: u64,
        candidates: impl Iterator<Item = Candidate>,
        busy_threshold: Option<u64>,
        random: u64,
    ) -> Choice {
        let salt = tie_salt(random);
        select::choose(&self.cost, tokens, candidates, busy_threshold, salt, random)
    }

    /// Predicted overlaps: walk the chain once, advancing each worker that still matches
    /// contiguously (at most [`MAX_WORKERS_PER_BLOCK`] per block).
    fn predicted(&self, hashes: &[u64]) -> Vec<(InstanceId, usize)> {
        let mut matched: Vec<(InstanceId, usize)> = Vec::new();
        for (i, h) in hashes.iter().enumerate() {
            let Some(entry) = self.entries.get(h) else {
                break;
            };
            let mut advanced = false;
            for &w in &entry.workers {
                if i == 0 {
                    matched.push((w, 1));
                    advanced = true;
                } else if let Some(m) = matched.iter_mut().find(|m| m.0 == w && m.1 == i) {
                    m.1 += 1;
                    advanced = true;
                }
            }
            if !advanced {
                break;
            }
        }
        matched
    }

    /// Remember that `worker` prefilled the chain `hashes` (marks them most recently used and
    /// evicts the least recently used chains beyond capacity).
    pub fn record(&mut self, hashes: &[u64], worker: InstanceId) {
        for &h in hashes {
            self.tick += 1;
            let tick = self.tick;
            match self.entries.get_mut(&h) {
                Some(entry) => {
                    entry.tick = tick;
                    if let Some(pos) = entry.workers.iter().position(|&w| w == worker) {
                        entry.workers.remove(pos);
                    } else if entry.workers.len() >= MAX_WORKERS_PER_BLOCK {
                        entry.workers.remove(0);
                    }
                    entry.workers.push(worker);
                }
                None => {
                    self.entries.insert(
                        h,
                        Entry {
                            workers: vec![worker],
                            tick,
                        },
                    );
                }
            }
            self.order.push_back((tick, h));
        }
        while self.entries.len() > self.capacity {
            let Some((tick, oldest)) = self.order.pop_front() else {
                break;
            };
            if self.entries.get(&oldest).is_some_and(|e| e.tick == tick) {
                self.entries.remove(&oldest);
            }
        }
        if self.order.len() > 2 * self.entries.len() + 64 {
            self.compact();
        }
    }

    /// Drop stale entries of the use order (keeps it within twice the index size).
    fn compact(&mut self) {
        let entries = &self.entries;
        self.order
            .retain(|(tick, h)| entries.get(h).is_some_and(|e| e.tick == *tick));
    }

    /// Forget a worker (it left discovery): its chains and its indexed cache no longer
    /// attract requests.
    pub fn forget(&mut self, worker: InstanceId) {
        self.index.remove_worker(worker);
        self.entries.retain(|_, e| {
            e.workers.retain(|&w| w != worker);
            !e.workers.is_empty()
        });
        self.compact();
    }
}

#[cfg(test)]
mod tests;
