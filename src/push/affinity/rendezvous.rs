//! Rendezvous (highest-random-weight) hashing of session keys over workers: the choice every
//! frontend makes alike, with no communication, for the same routable set.
//!
//! A session's key ([`session_key`]) ranks every worker by [`rendezvous_weight`]`(key, id)`;
//! the session goes to the first worker in that order that can take the request. Both hashes
//! are fixed here (SplitMix64's finaliser, [`crate::rng::finalize`], over the key's bytes and
//! the worker's [`InstanceId`]), not std's `RandomState` or `DefaultHasher`, whose keys or
//! algorithm may differ between processes or releases. Changing either function is a protocol
//! change: during a rolling upgrade, frontends on the old and the new function would disagree
//! on every session, so the test vectors below pin them.
//!
//! The consequences that make it the right tool (Thaler and Ravishankar, 1998):
//! - a pure function of the key and the set, so equal sets give equal choices everywhere;
//! - removing a worker moves only the sessions that ranked it first (to their second);
//! - adding one moves only the sessions that now rank it first (about 1/N of them), all to it.
//!
//! A client can name any session id, so it can pick ids that land on one worker; no unkeyed
//! hash prevents that, and a keyed one would need the key shared by every frontend. The busy
//! threshold (KV mode) bounds what such a client can pile on one worker.

use crate::discovery::InstanceId;
use crate::rng::{finalize, GAMMA};

/// The key of a session id: its UTF-8 bytes in 8-byte little-endian words (the last padded
/// with zeros), chained through SplitMix64's finaliser from a seed that holds the length (so
/// ids differing only by trailing zero bytes differ). The same in every process, build and
/// platform.
pub fn session_key(session: &str) -> u64 {
    let bytes = session.as_bytes();
    let mut h = finalize(GAMMA ^ bytes.len() as u64);
    for chunk in bytes.chunks(8) {
        let mut word = [0u8; 8];
        word[..chunk.len()].copy_from_slice(chunk);
        h = finalize(h.wrapping_add(GAMMA) ^ u64::from_le_bytes(word));
    }
    h
}

/// The weight of `worker` for the session `key`: the session's rendezvous order is the
/// workers by weight, highest first. Distinct ids never tie (every step is a bijection of the
/// id); equal ids order by id only so that the order is total.
pub fn rendezvous_weight(key: u64, worker: InstanceId) -> u64 {
    // The id is mixed on its own first, so sequential ids are as far apart as random ones.
    finalize(key ^ finalize(worker.wrapping_add(GAMMA)))
}

/// Whether `a` ranks before `b` in the rendezvous order of `key`.
fn before(key: u64, a: InstanceId, b: InstanceId) -> bool {
    (rendezvous_weight(key, a), std::cmp::Reverse(a))
        > (rendezvous_weight(key, b), std::cmp::Reverse(b))
}

/// The index in `workers` of the first worker of `key`'s rendezvous order (`None`: empty).
/// O(n): one weight per worker.
pub(crate) fn first_index(
    key: u64,
    workers: impl IntoIterator<Item = InstanceId>,
) -> Option<usize> {
    let mut best: Option<(usize, InstanceId)> = None;
    for (at, id) in workers.into_iter().enumerate() {
        if best.is_none_or(|(_, b)| before(key, id, b)) {
            best = Some((at, id));
        }
    }
    best.map(|(at, _)| at)
}

/// The first worker of `key`'s rendezvous order among `workers` (`None`: empty).
pub fn rendezvous_first(key: u64, workers: &[InstanceId]) -> Option<InstanceId> {
    first_index(key, workers.iter().copied()).map(|at| workers[at])
}

/// `workers` in `key`'s rendezvous order, first choice first.
pub fn rendezvous_order(key: u64, workers: &[InstanceId]) -> Vec<InstanceId> {
    let mut order = workers.to_vec();
    order.sort_by_cached_key(|&id| {
        std::cmp::Reverse((rendezvous_weight(key, id), std::cmp::Reverse(id)))
    });
    order
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_hashes_are_pinned_so_every_frontend_and_release_agrees() {
        // A change here re-homes every session (see the module docs).
        let pinned = [
            (session_key(""), PINNED[0]),
            (session_key("conv-7"), PINNED[1]),
            (
                session_key("a longer session id, over several words"),
                PINNED[2],
            ),
            (rendezvous_weight(session_key("conv-7"), 1), PINNED[3]),
            (
                rendezvous_weight(session_key("conv-7"), 0x0123_4567_89ab_cdef),
                PINNED[4],
            ),
        ];
        for (at, (got, want)) in pinned.into_iter().enumerate() {
            assert_eq!(got, want, "pinned value {at}: {got:#018x}");
        }
    }

    /// From an independent reimplementation of the two functions (docs/router.md spells them
    /// out); the first is SplitMix64's first output from state 0, as the length seed of "" is
    /// `GAMMA`.
    const PINNED: [u64; 5] = [
        0xe220_a839_7b1d_cdaf,
        0xad7a_128b_3f0d_b329,
        0x1038_c1a2_e436_8dba,
        0x2391_b16b_6b37_d015,
        0x94d7_a767_f63c_642d,
    ];

    #[test]
    fn trailing_zero_bytes_and_word_boundaries_change_the_key() {
        assert_ne!(session_key("a"), session_key("a\0"));
        assert_ne!(session_key("abcdefgh"), session_key("abcdefgh\0"));
        assert_ne!(session_key("alice"), session_key("bob"));
        assert_eq!(session_key("alice"), session_key("alice"));
    }

    #[test]
    fn sessions_spread_evenly_over_sequential_ids() {
        // 40,000 sessions over workers 1..=4: each gets its quarter within 1.5 points (the
        // binomial standard deviation is 0.2 points; a biased weight is far outside).
        let workers = [1, 2, 3, 4];
        let mut counts = [0u32; 4];
        for s in 0..40_000 {
            let first = rendezvous_first(session_key(&format!("session-{s}")), &workers);
            counts[(first.unwrap_or(1) - 1) as usize] += 1;
        }
        for c in counts {
            assert!((9_400..=10_600).contains(&c), "{counts:?}");
        }
    }

    fn pool() -> impl Strategy<Value = Vec<InstanceId>> {
        proptest::collection::btree_set(any::<u64>(), 1..12).prop_map(|s| s.into_iter().collect())
    }

    proptest! {
        #[test]
        fn the_order_is_a_permutation_headed_by_the_first(key in any::<u64>(), workers in pool()) {
            let order = rendezvous_order(key, &workers);
            let mut sorted = order.clone();
            sorted.sort_unstable();
            prop_assert_eq!(&sorted, &workers);
            prop_assert_eq!(order.first().copied(), rendezvous_first(key, &workers));
        }
    }
}
