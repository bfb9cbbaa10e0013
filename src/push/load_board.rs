//! Prefill work booked per worker, kept ordered by load.
//!
//! The KV cost ([`super::select`]) grows with a worker's booked work and falls with its overlap.
//! Among the workers that hold none of a request's blocks, the best is simply the least loaded
//! one, so a selection only needs the holders (from the index) plus a walk of the members in
//! ascending load that stops as soon as no later member can win. The board keeps that order:
//! members sit in buckets by load (an ordered map of loads, one vector each), and a change of
//! load moves one worker between two buckets, O(log distinct loads).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Bound;
use std::sync::Arc;

use super::select::Candidate;
use crate::discovery::{Instance, InstanceId};
use crate::hooks::Seam;
use crate::kv_events::{mix, MixState};

/// Half-life of a worker's recent work, in picks noted on the board.
pub const RECENT_WORK_HALF_LIFE: u32 = 256;

/// The window of [`LoadBoard::mean_booking`]'s moving average, in bookings.
const MEAN_BOOKING_WINDOW: f64 = 32.0;

/// Once the scale of stored recent work passes `2^RESCALE_EXP`, every value is rescaled.
const RESCALE_EXP: f64 = 256.0;

#[derive(Clone, Copy, Debug)]
struct Slot {
    /// Work this board booked.
    load: u64,
    /// Work of other frontends, per the worker's newest load report (see
    /// [`LoadBoard::set_others`]).
    others: u64,
    /// Recent work, scaled by `2^((tick − base) / half-life)` at the time it was added (so
    /// that the decay, the same for every worker, never reorders them); see
    /// [`LoadBoard::recent`].
    scaled: f64,
    /// Index in `members`; `None` for a worker that is not a member but still has work booked
    /// (it left the routable set mid-request).
    member: Option<usize>,
}

/// What a [`LoadBoard::walk_by_load`] visitor asks for next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Walk {
    /// The next member.
    Next,
    /// Skip the rest of this load (every later member of it has at least as much recent
    /// work), go on with the next load.
    NextLoad,
    /// Stop the walk.
    Stop,
}

/// Prefill work booked per worker (tokens, or requests for callers that book 1 each), the
/// work recently placed on each, and the routable members bucketed by combined load.
///
/// *Combined load* is the booked work plus the work other frontends hold on the worker per its
/// newest load report ([`set_others`](Self::set_others); zero for a worker that reports
/// nothing), the rule of [`crate::load_report`]: the walk, the candidates' load and the busy
/// threshold go by it, while [`load`](Self::load) and [`total`](Self::total) stay this
/// board's own bookings (what its releases must return to zero).
///
/// Loads are kept for every worker with work booked; only members (the routable set last given
/// to [`set_members`](Self::set_members)) are candidates for
/// [`least_loaded`](Self::least_loaded).
///
/// *Recent work* ([`note_work`](Self::note_work)) is the work placed on a worker, decaying by
/// half every [`RECENT_WORK_HALF_LIFE`] picks: it stays after the prefill ended, so at a low
/// request rate, where bookings are empty almost all the time, it still tells the workers
/// that sessions (and their later turns) were placed on from those that idled. Within a load,
/// members are ordered by it.
#[derive(Default)]
pub struct LoadBoard {
    slots: HashMap<InstanceId, Slot, MixState>,
    /// `buckets[l]`: the members with load `l`, by ascending (scaled recent work bits, id);
    /// never an empty set.
    buckets: BTreeMap<u64, BTreeSet<(u64, InstanceId)>>,
    members: Option<Arc<[Arc<Instance>]>>,
    /// `member_ids[i]`, `member_loads[i]`: the id and load of `members[i]` (dense copies, so a
    /// merge walk touches no `Instance`).
    member_ids: Vec<InstanceId>,
    member_loads: Vec<u64>,
    /// Whether `members` is sorted by ascending id (the routable view's order).
    sorted: bool,
    /// Booked work over every worker, members or not.
    total: u64,
    /// Picks noted, and the pick at which the recent-work scale was 1.
    tick: u64,
    base: u64,
    /// The moving average of a booking's amount (0 before the first).
    mean_booking: f64,
    /// Where the board's mutant breaks releases (see [`BoardMutant`]); zero-sized in normal
    /// builds.
    mutant: Seam<BoardMutant>,
}

/// A deliberately broken variant of the board, caught by the booking properties
/// (docs/properties.md, "Mutants"; see `crate::hooks`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BoardMutant {
    /// A release on a worker that is no longer a member is lost (its work stays booked
    /// forever).
    LeaksNonMembers,
}

impl std::fmt::Debug for LoadBoard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadBoard")
            .field("members", &self.members.as_ref().map_or(0, |m| m.len()))
            .field("tracked", &self.slots.len())
            .field("total", &self.total)
            .finish()
    }
}

impl Slot {
    const EMPTY: Slot = Slot {
        load: 0,
        others: 0,
        scaled: 0.0,
        member: None,
    };

    /// The load the order and the busy threshold go by: booked plus reported.
    fn combined(&self) -> u64 {
        self.load.saturating_add(self.others)
    }

    /// A non-member slot with nothing booked or reported is forgotten.
    fn idle(&self) -> bool {
        self.member.is_none() && self.load == 0 && self.others == 0
    }
}

/// The bucket key of a member: its scaled recent work (non-negative, so its bits order as
/// the value does) and its id.
fn key(slot: &Slot, id: InstanceId) -> (u64, InstanceId) {
    (slot.scaled.to_bits(), id)
}

impl LoadBoard {
    /// The board running `mutant`.
    #[cfg(test)]
    pub(crate) fn with_mutant(mutant: BoardMutant) -> Self {
        LoadBoard {
            mutant: Seam::on(mutant),
            ..LoadBoard::default()
        }
    }

    /// Whether `members` is the set the board was last given (the same shared snapshot): the
    /// dispatcher re-syncs only when the routable view published a new one.
    pub fn has_members(&self, members: &Arc<[Arc<Instance>]>) -> bool {
        self.members
            .as_ref()
            .is_some_and(|m| Arc::ptr_eq(m, members))
    }

    /// Make `members` the candidates, keeping every worker's load (and a remaining member's
    /// recent work). O(members).
    pub fn set_members(&mut self, members: Arc<[Arc<Instance>]>) {
        for slot in self.slots.values_mut() {
            slot.member = None;
        }
        self.buckets.clear();
        self.member_loads.clear();
        self.member_loads.resize(members.len(), 0);
        self.member_ids.clear();
        self.member_ids
            .extend(members.iter().map(|i| i.instance_id));
        self.sorted = members
            .windows(2)
            .all(|w| w[0].instance_id < w[1].instance_id);
        for (i, instance) in members.iter().enumerate() {
            let id = instance.instance_id;
            let slot = self.slots.entry(id).or_insert(Slot::EMPTY);
            if slot.member.is_some() {
                continue; // a duplicate id: the first entry stands
            }
            slot.member = Some(i);
            self.member_loads[i] = slot.combined();
            self.buckets
                .entry(slot.combined())
                .or_default()
                .insert(key(slot, id));
        }
        // A worker that left keeps only what it has booked or reported (its recent work goes
        // with it).
        self.slots.retain(|_, s| !s.idle());
        self.members = Some(members);
    }

    /// The members last set (none before the first [`set_members`](Self::set_members)).
    pub fn members(&self) -> &[Arc<Instance>] {
        self.members.as_deref().unwrap_or(&[])
    }

    /// The member `id`, if it is one. O(1).
    pub fn member(&self, id: InstanceId) -> Option<&Arc<Instance>> {
        let i = self.slots.get(&id)?.member?;
        self.members.as_ref()?.get(i)
    }

    /// Work booked on `id` (by this board).
    pub fn load(&self, id: InstanceId) -> u64 {
        self.slots.get(&id).map_or(0, |s| s.load)
    }

    /// Work other frontends hold on `id`, per its newest load report (0 without one).
    pub fn others(&self, id: InstanceId) -> u64 {
        self.slots.get(&id).map_or(0, |s| s.others)
    }

    /// The load the board orders `id` by and checks against the busy threshold: booked plus
    /// reported ([`load`](Self::load) + [`others`](Self::others)).
    pub fn combined(&self, id: InstanceId) -> u64 {
        self.slots.get(&id).map_or(0, Slot::combined)
    }

    /// `id`'s worker reported that other frontends hold `tokens` of work there (0: none, or
    /// its report stream ended). Moves a member between load buckets. O(log members).
    pub fn set_others(&mut self, id: InstanceId, tokens: u64) {
        if tokens == 0 && !self.slots.contains_key(&id) {
            return;
        }
        let slot = self.slots.entry(id).or_insert(Slot::EMPTY);
        let from = slot.combined();
        slot.others = tokens;
        let to = slot.combined();
        if slot.idle() {
            self.slots.remove(&id);
        } else {
            self.shift(id, from, to);
        }
    }

    /// Work booked over every worker, members or not (zero once every booking was released).
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The scale of stored recent work now.
    #[allow(clippy::cast_precision_loss)] // pick counts far below 2^52
    fn scale(&self) -> f64 {
        ((self.tick - self.base) as f64 / f64::from(RECENT_WORK_HALF_LIFE)).exp2()
    }

    /// The recent work of `id` now (tokens, decayed; see the type's docs).
    pub fn recent(&self, id: InstanceId) -> f64 {
        self.slots.get(&id).map_or(0.0, |s| s.scaled / self.scale())
    }

    /// Note one pick that placed `amount` of work on `id`: its recent work grows by `amount`
    /// and everyone's decays by one pick. O(log members).
    #[allow(clippy::cast_precision_loss)] // token counts far below 2^52
    pub fn note_work(&mut self, id: InstanceId, amount: u64) {
        self.tick += 1;
        let scale = self.scale();
        if scale.log2() > RESCALE_EXP {
            self.rescale();
        }
        let scale = self.scale();
        let Some(slot) = self.slots.get_mut(&id) else {
            return; // not a member and nothing booked: nothing to order
        };
        let before = key(slot, id);
        slot.scaled += amount as f64 * scale;
        let (after, load, member) = (key(slot, id), slot.combined(), slot.member.is_some());
        if member {
            if let Some(bucket) = self.buckets.get_mut(&load) {
                bucket.remove(&before);
                bucket.insert(after);
            }
        }
    }

    /// Bring the scale back to 1 (every stored value divided by it; the order is unchanged).
    fn rescale(&mut self) {
        let scale = self.scale();
        self.base = self.tick;
        for slot in self.slots.values_mut() {
            slot.scaled /= scale;
        }
        for bucket in self.buckets.values_mut() {
            let ids: Vec<InstanceId> = bucket.iter().map(|k| k.1).collect();
            bucket.clear();
            for id in ids {
                if let Some(slot) = self.slots.get(&id) {
                    bucket.insert(key(slot, id));
                }
            }
        }
    }

    /// The mean amount of a booking, a moving average over the last few dozen (`None` before
    /// the first): what one request of a worker's own count weighs (engine load,
    /// `crate::engine::load`).
    pub fn mean_booking(&self) -> Option<u64> {
        // Whole units: the bookings are.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        (self.mean_booking > 0.0).then(|| self.mean_booking.round() as u64)
    }

    /// Book `amount` more work on `id`. O(log members).
    pub fn acquire(&mut self, id: InstanceId, amount: u64) {
        #[allow(clippy::cast_precision_loss)] // bookings far below 2^52
        let amount_f = amount as f64;
        self.mean_booking = if self.mean_booking > 0.0 {
            self.mean_booking + (amount_f - self.mean_booking) / MEAN_BOOKING_WINDOW
        } else {
            amount_f
        };
        let slot = self.slots.entry(id).or_insert(Slot::EMPTY);
        let (own, from) = (slot.load, slot.combined());
        slot.load = own.saturating_add(amount);
        let to = slot.combined();
        self.total = self.total.saturating_add(slot.load - own);
        self.shift(id, from, to);
    }

    /// Release `amount` of the work booked on `id` (never below zero). O(log members).
    pub fn release(&mut self, id: InstanceId, amount: u64) {
        let Some(slot) = self.slots.get_mut(&id) else {
            return;
        };
        if self.mutant.is(BoardMutant::LeaksNonMembers) && slot.member.is_none() {
            return;
        }
        let (own, from) = (slot.load, slot.combined());
        slot.load = own.saturating_sub(amount);
        let to = slot.combined();
        self.total = self.total.saturating_sub(own - slot.load);
        if slot.member.is_some() {
            self.shift(id, from, to);
        } else if slot.idle() {
            self.slots.remove(&id);
        }
    }

    /// Move member `id` from bucket `from` to bucket `to` (nothing for a non-member).
    fn shift(&mut self, id: InstanceId, from: u64, to: u64) {
        if from == to {
            return;
        }
        let Some(slot) = self.slots.get(&id) else {
            return;
        };
        let Some(index) = slot.member else {
            return;
        };
        let k = key(slot, id);
        if let Some(l) = self.member_loads.get_mut(index) {
            *l = to;
        }
        if let Some(bucket) = self.buckets.get_mut(&from) {
            bucket.remove(&k);
            if bucket.is_empty() {
                self.buckets.remove(&from);
            }
        }
        self.buckets.entry(to).or_default().insert(k);
    }

    /// For `holders` (`(id, overlap)`, the first `sorted_prefix` of them by ascending id), append
    /// a [`Candidate`] (load, recent work, overlap; coldness left at 1) to `out` for each that
    /// is a member not in `excluded`. A long sorted run against sorted members is a merge walk
    /// over the dense loads; otherwise one hash lookup per holder.
    pub fn members_of(
        &self,
        holders: &[(InstanceId, usize)],
        sorted_prefix: usize,
        excluded: &[InstanceId],
        out: &mut Vec<Candidate>,
    ) {
        let ids = &self.member_ids;
        let (run, rest) = holders.split_at(sorted_prefix.min(holders.len()));
        let lookups = if self.sorted && run.len() * 4 >= ids.len() {
            let mut j = 0;
            for &(id, overlap) in run {
                while j < ids.len() && ids[j] < id {
                    j += 1;
                }
                if j < ids.len() && ids[j] == id && !excluded.contains(&id) {
                    out.push(
                        Candidate::new(id, overlap, self.member_loads[j])
                            .with_recent(self.recent(id)),
                    );
                }
            }
            rest
        } else {
            holders
        };
        let scale = self.scale();
        for &(id, overlap) in lookups {
            if let Some(slot) = self.slots.get(&id) {
                if slot.member.is_some() && !excluded.contains(&id) {
                    out.push(
                        Candidate::new(id, overlap, slot.combined())
                            .with_recent(slot.scaled / scale),
                    );
                }
            }
        }
    }

    /// Visit the members not in `excluded` (`visit(id, load, recent work)`) by ascending load,
    /// and within a load by ascending recent work, until `visit` says [`Walk::Stop`];
    /// [`Walk::NextLoad`] skips to the next load. The members tied for the least recent work
    /// of a load are visited from a position chosen by `salt` (as
    /// [`least_loaded`](Self::least_loaded), whose member is visited first), so equal workers
    /// share a stream. A visit that stops at once costs O(log members + |excluded|).
    pub fn walk_by_load(
        &self,
        salt: u64,
        excluded: &[InstanceId],
        mut visit: impl FnMut(InstanceId, u64, f64) -> Walk,
    ) {
        let scale = self.scale();
        // A member's id as the pivot: ids are sparse, so a random number would nearly always
        // fall past every id and start at the lowest.
        #[allow(clippy::cast_possible_truncation)] // reduced modulo a usize
        let pivot = match self.member_ids.len() {
            0 => 0,
            n => self.member_ids[(mix(salt) % n as u64) as usize],
        };
        for (&load, bucket) in &self.buckets {
            let Some(&(front, _)) = bucket.first() else {
                continue;
            };
            // The tied front from the salted pivot round, then everything after it.
            let tied = bucket
                .range((front, pivot)..=(front, InstanceId::MAX))
                .chain(bucket.range((front, 0)..(front, pivot)));
            let rest = bucket.range((Bound::Excluded((front, InstanceId::MAX)), Bound::Unbounded));
            for &(bits, id) in tied.chain(rest) {
                if excluded.contains(&id) {
                    continue;
                }
                match visit(id, load, f64::from_bits(bits) / scale) {
                    Walk::Next => {}
                    Walk::NextLoad => break,
                    Walk::Stop => return,
                }
            }
        }
    }

    /// A least-loaded member not in `excluded`, with its load: within the lowest load, one
    /// with the least recent work (among ties, the one at a position chosen by `salt`:
    /// deterministic for a request, spread across requests). O(log members + |excluded|)
    /// when the lowest loads are not all excluded.
    pub fn least_loaded(&self, salt: u64, excluded: &[InstanceId]) -> Option<(InstanceId, u64)> {
        let mut first = None;
        self.walk_by_load(salt, excluded, |id, load, _| {
            first = Some((id, load));
            Walk::Stop
        });
        first
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::EndpointId;

    fn members(ids: &[InstanceId]) -> Arc<[Arc<Instance>]> {
        ids.iter()
            .map(|&id| {
                Arc::new(Instance {
                    endpoint: EndpointId::new("t", "prefill", "generate"),
                    instance_id: id,
                    address: std::net::SocketAddr::from(([127, 0, 0, 1], 1)),
                })
            })
            .collect()
    }

    /// The slow answer: the smallest load over the members not excluded.
    fn min_load(board: &LoadBoard, excluded: &[InstanceId]) -> Option<u64> {
        board
            .members()
            .iter()
            .map(|i| i.instance_id)
            .filter(|id| !excluded.contains(id))
            .map(|id| board.combined(id))
            .min()
    }

    #[test]
    fn least_loaded_is_a_member_with_the_smallest_load_through_any_history() {
        let mut board = LoadBoard::default();
        board.set_members(members(&[1, 2, 3, 4, 5]));
        let mut rng = 7u64;
        for step in 0..5_000u64 {
            rng = mix(rng);
            let id = rng % 7; // 0 and 6 are not members
            if rng >> 32 & 1 == 0 {
                board.acquire(id, 1 + (rng >> 40) % 700);
            } else {
                board.release(id, 1 + (rng >> 20) % 700);
            }
            if step % 997 == 0 {
                let ids: Vec<_> = (1..=5).filter(|i| (rng >> i) & 1 == 1).collect();
                board.set_members(members(&ids));
            }
            let excluded = [rng % 6, (rng >> 8) % 6];
            let got = board.least_loaded(rng, &excluded);
            assert_eq!(got.map(|g| g.1), min_load(&board, &excluded), "step {step}");
            if let Some((id, load)) = got {
                assert!(board.member(id).is_some());
                assert!(!excluded.contains(&id));
                assert_eq!(board.combined(id), load);
            }
            // The walk: every usable member once, by ascending load, the least loaded first.
            let mut walked = Vec::new();
            board.walk_by_load(rng, &excluded, |id, load, _| {
                walked.push((id, load));
                Walk::Next
            });
            assert_eq!(walked.first().copied(), got, "step {step}");
            assert!(walked.windows(2).all(|w| w[0].1 <= w[1].1), "step {step}");
            let mut ids: Vec<_> = walked.iter().map(|w| w.0).collect();
            ids.sort_unstable();
            let mut usable: Vec<_> = board
                .members()
                .iter()
                .map(|i| i.instance_id)
                .filter(|id| !excluded.contains(id))
                .collect();
            usable.sort_unstable();
            assert_eq!(ids, usable, "step {step}");
            assert!(walked.iter().all(|&(id, load)| board.combined(id) == load));
        }
    }

    #[test]
    fn loads_survive_a_change_of_members_and_non_members_are_forgotten_at_zero() {
        let mut board = LoadBoard::default();
        board.set_members(members(&[1, 2]));
        board.acquire(1, 1);
        board.acquire(1, 1);
        board.acquire(9, 1);
        board.set_members(members(&[2]));
        assert_eq!(board.load(1), 2);
        assert!(board.member(1).is_none());
        assert_eq!(board.least_loaded(0, &[]), Some((2, 0)));
        board.set_members(members(&[1]));
        assert_eq!(board.least_loaded(0, &[]), Some((1, 2)));
        board.release(9, 1);
        assert_eq!(board.load(9), 0);
        assert!(!board.slots.contains_key(&9));
        board.release(9, 1); // never below zero, never a panic
        assert_eq!(board.load(9), 0);
    }

    #[test]
    fn an_all_excluded_pool_has_no_least_loaded_worker() {
        let mut board = LoadBoard::default();
        assert_eq!(board.least_loaded(1, &[]), None);
        let set = members(&[1, 2]);
        board.set_members(Arc::clone(&set));
        assert!(board.has_members(&set));
        assert!(!board.has_members(&members(&[1, 2])));
        assert_eq!(board.least_loaded(1, &[1, 2]), None);
    }
}
