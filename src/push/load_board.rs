//! Prefill work booked per worker, kept ordered by load.
//!
//! The KV cost ([`super::select`]) grows with a worker's booked work and falls with its overlap.
//! Among the workers that hold none of a request's blocks, the best is simply the least loaded
//! one, so a selection only needs the holders (from the index) plus a walk of the members in
//! ascending load that stops as soon as no later member can win. The board keeps that order:
//! members sit in buckets by load (an ordered map of loads, one vector each), and a change of
//! load moves one worker between two buckets, O(log distinct loads).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::discovery::{Instance, InstanceId};
use crate::kv_events::{mix, MixState};

#[derive(Clone, Copy, Debug)]
struct Slot {
    load: u64,
    /// Index in `members` and position in `buckets[load]`; `None` for a worker that is not a
    /// member but still has work booked (it left the routable set mid-request).
    member: Option<(usize, usize)>,
}

/// Prefill work booked per worker (tokens, or requests for callers that book 1 each), and the
/// routable members bucketed by that load.
///
/// Loads are kept for every worker with work booked; only members (the routable set last given
/// to [`set_members`](Self::set_members)) are candidates for
/// [`least_loaded`](Self::least_loaded).
#[derive(Default)]
pub struct LoadBoard {
    slots: HashMap<InstanceId, Slot, MixState>,
    /// `buckets[l]`: the members with load `l`, in no particular order; never an empty vector.
    buckets: BTreeMap<u64, Vec<InstanceId>>,
    members: Option<Arc<[Arc<Instance>]>>,
    /// `member_ids[i]`, `member_loads[i]`: the id and load of `members[i]` (dense copies, so a
    /// merge walk touches no `Instance`).
    member_ids: Vec<InstanceId>,
    member_loads: Vec<u64>,
    /// Whether `members` is sorted by ascending id (the routable view's order).
    sorted: bool,
    /// Booked work over every worker, members or not.
    total: u64,
    /// The mutant of the booking properties: a release on a worker that is no longer a member
    /// is lost (its work stays booked forever).
    #[cfg(test)]
    leak_non_members: bool,
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

impl LoadBoard {
    /// The board with the mutant whose releases on departed workers are lost.
    #[cfg(test)]
    pub(crate) fn leaking_non_members() -> Self {
        LoadBoard {
            leak_non_members: true,
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

    /// Make `members` the candidates, keeping every worker's load. O(members).
    pub fn set_members(&mut self, members: Arc<[Arc<Instance>]>) {
        self.slots.retain(|_, s| {
            s.member = None;
            s.load > 0
        });
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
            let slot = self.slots.entry(id).or_insert(Slot {
                load: 0,
                member: None,
            });
            if slot.member.is_some() {
                continue; // a duplicate id: the first entry stands
            }
            let bucket = self.buckets.entry(slot.load).or_default();
            slot.member = Some((i, bucket.len()));
            self.member_loads[i] = slot.load;
            bucket.push(id);
        }
        self.members = Some(members);
    }

    /// The members last set (none before the first [`set_members`](Self::set_members)).
    pub fn members(&self) -> &[Arc<Instance>] {
        self.members.as_deref().unwrap_or(&[])
    }

    /// The member `id`, if it is one. O(1).
    pub fn member(&self, id: InstanceId) -> Option<&Arc<Instance>> {
        let (i, _) = self.slots.get(&id)?.member?;
        self.members.as_ref()?.get(i)
    }

    /// Work booked on `id`.
    pub fn load(&self, id: InstanceId) -> u64 {
        self.slots.get(&id).map_or(0, |s| s.load)
    }

    /// Work booked over every worker, members or not (zero once every booking was released).
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Book `amount` more work on `id`. O(log distinct loads).
    pub fn acquire(&mut self, id: InstanceId, amount: u64) {
        let slot = self.slots.entry(id).or_insert(Slot {
            load: 0,
            member: None,
        });
        let from = slot.load;
        slot.load = from.saturating_add(amount);
        let (to, member) = (slot.load, slot.member.is_some());
        self.total = self.total.saturating_add(to - from);
        if member {
            self.shift(id, from, to);
        }
    }

    /// Release `amount` of the work booked on `id` (never below zero). O(log distinct loads).
    pub fn release(&mut self, id: InstanceId, amount: u64) {
        let Some(slot) = self.slots.get_mut(&id) else {
            return;
        };
        #[cfg(test)]
        if self.leak_non_members && slot.member.is_none() {
            return;
        }
        let from = slot.load;
        slot.load = from.saturating_sub(amount);
        let to = slot.load;
        self.total = self.total.saturating_sub(from - to);
        if slot.member.is_some() {
            self.shift(id, from, to);
        } else if to == 0 {
            self.slots.remove(&id);
        }
    }

    /// Move member `id` from bucket `from` to bucket `to`.
    fn shift(&mut self, id: InstanceId, from: u64, to: u64) {
        if from == to {
            return;
        }
        let Some((index, pos)) = self.slots.get(&id).and_then(|s| s.member) else {
            return;
        };
        if let Some(l) = self.member_loads.get_mut(index) {
            *l = to;
        }
        if let Some(bucket) = self.buckets.get_mut(&from) {
            bucket.swap_remove(pos);
            if let Some(&moved) = bucket.get(pos) {
                if let Some(Slot {
                    member: Some((_, p)),
                    ..
                }) = self.slots.get_mut(&moved)
                {
                    *p = pos;
                }
            }
            if bucket.is_empty() {
                self.buckets.remove(&from);
            }
        }
        let bucket = self.buckets.entry(to).or_default();
        let at = bucket.len();
        bucket.push(id);
        if let Some(Slot {
            member: Some((_, p)),
            ..
        }) = self.slots.get_mut(&id)
        {
            *p = at;
        }
    }

    /// For `holders` (`(id, overlap)`, the first `sorted_prefix` of them by ascending id), append
    /// `(id, load, overlap)` to `out` for each that is a member not in `excluded`. A long sorted
    /// run against sorted members is a merge walk over the dense loads (no hashing per holder);
    /// otherwise one hash lookup per holder.
    pub fn members_of(
        &self,
        holders: &[(InstanceId, usize)],
        sorted_prefix: usize,
        excluded: &[InstanceId],
        out: &mut Vec<(InstanceId, u64, usize)>,
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
                    out.push((id, self.member_loads[j], overlap));
                }
            }
            rest
        } else {
            holders
        };
        for &(id, overlap) in lookups {
            if let Some(Slot {
                load,
                member: Some(_),
            }) = self.slots.get(&id)
            {
                if !excluded.contains(&id) {
                    out.push((id, *load, overlap));
                }
            }
        }
    }

    /// Visit the members not in `excluded` in order of ascending load, until `visit` returns
    /// false; within a load, from a position chosen by `salt` (as
    /// [`least_loaded`](Self::least_loaded), whose member is visited first). A visit that stops
    /// at once costs O(1 + |excluded|).
    pub fn walk_by_load(
        &self,
        salt: u64,
        excluded: &[InstanceId],
        mut visit: impl FnMut(InstanceId, u64) -> bool,
    ) {
        for (&load, bucket) in &self.buckets {
            #[allow(clippy::cast_possible_truncation)] // reduced modulo a usize
            let start = (mix(salt) % bucket.len() as u64) as usize;
            for k in 0..bucket.len() {
                let id = bucket[(start + k) % bucket.len()];
                if !excluded.contains(&id) && !visit(id, load) {
                    return;
                }
            }
        }
    }

    /// A least-loaded member not in `excluded`, with its load: within the lowest bucket, the
    /// one at a position chosen by `salt` (deterministic for a request, spread across
    /// requests). O(1 + |excluded|) when the lowest buckets are not all excluded.
    pub fn least_loaded(&self, salt: u64, excluded: &[InstanceId]) -> Option<(InstanceId, u64)> {
        let mut first = None;
        self.walk_by_load(salt, excluded, |id, load| {
            first = Some((id, load));
            false
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
            .map(|id| board.load(id))
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
                assert_eq!(board.load(id), load);
            }
            // The walk: every usable member once, by ascending load, the least loaded first.
            let mut walked = Vec::new();
            board.walk_by_load(rng, &excluded, |id, load| {
                walked.push((id, load));
                true
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
            assert!(walked.iter().all(|&(id, load)| board.load(id) == load));
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
