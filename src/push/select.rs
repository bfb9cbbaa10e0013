//! The KV cost and the pick: pure (no tokio, no I/O, no clock), so the dispatcher, the replay's
//! oracle and the property tests choose by the same rule.
//!
//! A worker's cost for a request is the work, in **tokens**, that stands between the request
//! and its first token on that worker:
//!
//! ```text
//! cost(w) = overlap_score_weight × uncached_tokens(w)
//!         + prefill_load_scale × (booked_tokens(w)
//!                                 + recent_work_weight × (recent_tokens(w) − own_tokens(w)))
//!         − prefill_keep_credit × coldness(w) × cached_tokens(w)
//! ```
//!
//! - `uncached_tokens(w)`: the request's prompt tokens that `w` does not hold (its overlap, in
//!   whole blocks, is the credit: each cached token is one token less to compute);
//! - `booked_tokens(w)`: the uncached prompt work of the requests already selected for `w` and
//!   not yet prefilled, plus the per-request overhead of each (booked at the pick, released
//!   when that prefill ends or fails);
//! - `cached_tokens(w)`: its overlap in tokens, credited once more (the keep credit, tokens of
//!   credit per cached token) in proportion to how *cold* the deepest of those blocks is
//!   ([`super::heat`]): moving a conversation's next turn away from the worker that holds its
//!   history recomputes work nobody else will reuse, while a hot prefix (a system prompt every
//!   request carries) is worth replicating, so its stream spreads by load;
//! - `recent_tokens(w)`: the work recently placed on `w` (its bookings, overhead included),
//!   kept after its prefill ended and decaying by picks ([`super::LoadBoard::recent`]): at a
//!   low request rate, where bookings are nearly always empty, the load signal that still
//!   spreads new sessions. It stands for the *other* sessions on `w`, so the request's own
//!   conversation's share of it, `own_tokens(w)`, is taken out ([`super::own_work`]): the work
//!   earlier turns of this conversation placed on `w`, decayed alike. A conversation's next
//!   turn does not count its own earlier turns against the worker that holds its history, but
//!   that worker's other sessions still count in full; a prompt many workers hold is nobody's
//!   own, so it still spreads by every request placed.
//!
//! **One unit at every block size** (issue #40). Every term, the busy threshold, the balance
//! slack and the softmax temperature are in tokens, so the same workload described at 16 and
//! at 512 tokens per block routes the same way: the block size only decides which tokens a
//! worker can hold (whole blocks), never how much a held token, a booked token or the
//! overhead weighs. (Before, the cost was in blocks and the temperature over blocks; and the
//! recent work was held in full against a conversation's home, so a short chat's own earlier
//! turns, 4,096 tokens of overhead each, outweighed the history it had cached within a few
//! turns: a history of a few hundred tokens is worth little next to that, at any block size,
//! and nothing at 512. A first fix discounted the home's recent work by the coldness of the
//! history, other sessions' work included; in closed loops that let a conversation stay
//! behind other users' work, docs/performance.md.)
//!
//! With both weights 1 and no keep credit this is the expected wait: the prefill work queued
//! on `w` plus this request's own. Overlap and load are in one unit, so a long shared prefix no
//! longer outweighs any queue (the old `overlap − requests in flight` score did:
//! docs/router.md).
//!
//! A busy threshold (tokens of booked work) removes a worker from the candidates; when every
//! candidate is over it the pick is [`Choice::Overloaded`], never a health failure.

use crate::discovery::InstanceId;
use crate::hooks::Seam;
use crate::kv_events::mix;

/// The terms of the KV cost (see the module docs), in tokens; `block_size` only says which
/// leading tokens an overlap of so many blocks covers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvCost {
    /// Tokens per KV block.
    pub block_size: u32,
    /// Weight of the request's uncached blocks on a worker (finite, ≥ 0; default 1).
    pub overlap_weight: f64,
    /// Weight of the work already booked on a worker (finite, ≥ 0; default 1).
    pub load_scale: f64,
    /// Softmax temperature over the negated costs, in tokens of work (0: always the cheapest).
    pub temperature: f64,
    /// Tokens every pick books on top of its uncached ones: the fixed cost of one more prefill
    /// on a worker (scheduling, and the slowdown of the prefills it runs beside).
    pub request_overhead: u64,
    /// Balance slack: a worker with more than this many tokens booked beyond the least loaded
    /// candidate is not a candidate (`None`: no slack rule). It bounds how far a cached prefix
    /// can pull a stream onto one worker, whatever the overlap weight.
    pub balance_slack: Option<u64>,
    /// Extra credit, in tokens, per cached token of a *cold* prefix (finite, ≥ 0; 0: none),
    /// scaled by the candidate's [`Candidate::coldness`].
    pub keep_credit: f64,
    /// Weight of a worker's recent work ([`Candidate::recent`]) next to its booked work
    /// (finite, ≥ 0; 0: none).
    pub recent_weight: f64,
    /// Where the cost's mutant breaks it (see [`CostMutant`]); zero-sized in normal builds.
    mutant: Seam<CostMutant>,
}

/// A deliberately broken variant of the cost, caught by a test (docs/properties.md,
/// "Mutants"; see `crate::hooks`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CostMutant {
    /// The cost ignores booked work (as the old score's load term did whenever requests
    /// rarely overlap in time).
    IgnoresLoad,
    /// The per-request overhead is read as tokens at small blocks and as blocks at large ones
    /// (64 tokens or more): a cost whose unit depends on the block size (issue #40).
    OverheadInBlocksAtLargeBlocks,
    /// Recent work counts in full against a worker holding the request's history, its own
    /// earlier turns included (the cost before issue #40): a short conversation's own earlier
    /// turns push it off the worker that holds its history.
    RecentAgainstColdHistory,
}

/// One candidate worker: its id, the leading blocks of the request it is credited with, the
/// prefill work booked on it (tokens) and how cold the deepest of those blocks is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    /// The worker.
    pub id: InstanceId,
    /// Leading blocks of the request it holds (or is predicted to hold).
    pub overlap: usize,
    /// Uncached prompt tokens booked on it and not yet prefilled.
    pub booked: u64,
    /// The coldness of its deepest credited block, in `[0, 1]` ([`super::heat::PrefixHeat`]:
    /// 1 when no recent pick was credited with it); it scales the keep credit.
    pub coldness: f64,
    /// Work recently placed on it (tokens, decayed by picks; [`super::LoadBoard::recent`]),
    /// finite and ≥ 0: the load a low request rate leaves no booking of.
    pub recent: f64,
    /// The part of that work the request's own conversation placed there (tokens, decayed
    /// alike; [`super::own_work`]), finite and ≥ 0: not held against it.
    pub own: f64,
}

impl Candidate {
    /// A candidate whose credited prefix counts as fully cold (no heat known).
    pub fn new(id: InstanceId, overlap: usize, booked: u64) -> Self {
        Candidate {
            id,
            overlap,
            booked,
            coldness: 1.0,
            recent: 0.0,
            own: 0.0,
        }
    }

    /// The same candidate with `recent` tokens of recent work (non-finite or negative: 0).
    #[must_use]
    pub fn with_recent(mut self, recent: f64) -> Self {
        self.recent = finite_or(recent, 0.0);
        self
    }

    /// The same candidate with `own` tokens of its recent work placed by the request's own
    /// conversation (non-finite or negative: 0).
    #[must_use]
    pub fn with_own(mut self, own: f64) -> Self {
        self.own = finite_or(own, 0.0);
        self
    }

    /// Its load in tokens: booked work plus `recent_weight` × the recent work *other* sessions
    /// placed on it (its recent work less the request's own, never below 0).
    pub fn load(&self, recent_weight: f64) -> f64 {
        #[allow(clippy::cast_precision_loss)] // token counts far below 2^52
        let booked = self.booked as f64;
        booked + recent_weight * (self.recent - self.own).max(0.0)
    }

    /// The same candidate with coldness `coldness` (clamped to `[0, 1]`; NaN counts as 0).
    #[must_use]
    pub fn with_coldness(mut self, coldness: f64) -> Self {
        self.coldness = if coldness.is_nan() {
            0.0
        } else {
            coldness.clamp(0.0, 1.0)
        };
        self
    }
}

/// The outcome of a pick.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Choice {
    /// The chosen worker, with the tokens it must compute for this request (what to book).
    Picked {
        /// The candidate chosen.
        candidate: Candidate,
        /// The request's tokens it does not hold: the work to book on it.
        uncached: u64,
    },
    /// Every candidate is at or over the busy threshold.
    Overloaded,
    /// There were no candidates.
    Empty,
}

fn finite_or(value: f64, default: f64) -> f64 {
    if value.is_finite() && value >= 0.0 {
        value
    } else {
        default
    }
}

impl KvCost {
    /// The cost a card's KV tuning names, for blocks of `block_size` tokens: its weights,
    /// temperature, request overhead, balance slack, keep credit and recent-work weight.
    pub fn from_config(block_size: u32, config: &crate::advert::KvRouterConfig) -> Self {
        KvCost::new(
            block_size,
            config.overlap_score_weight,
            config.prefill_load_scale,
            config.router_temperature,
        )
        .with_request_overhead(config.prefill_request_tokens)
        .with_balance_slack(config.balance_slack_tokens)
        .with_keep_credit(config.prefill_keep_credit)
        .with_recent_weight(config.prefill_recent_work_weight)
    }

    /// The cost terms for blocks of `block_size` tokens; non-finite or negative weights fall
    /// back to 1 and a bad temperature to 0.
    pub fn new(block_size: u32, overlap_weight: f64, load_scale: f64, temperature: f64) -> Self {
        KvCost {
            block_size: block_size.max(1),
            overlap_weight: finite_or(overlap_weight, 1.0),
            load_scale: finite_or(load_scale, 1.0),
            temperature: finite_or(temperature, 0.0),
            request_overhead: 0,
            balance_slack: None,
            keep_credit: 0.0,
            recent_weight: 0.0,
            mutant: Seam::off(),
        }
    }

    /// The same terms with `tokens` booked per pick on top of its uncached tokens.
    #[must_use]
    pub fn with_request_overhead(mut self, tokens: u64) -> Self {
        self.request_overhead = tokens;
        self
    }

    /// The same terms with a keep credit of `credit` tokens per cached token of a cold prefix
    /// (non-finite or negative: none).
    #[must_use]
    pub fn with_keep_credit(mut self, credit: f64) -> Self {
        self.keep_credit = finite_or(credit, 0.0);
        self
    }

    /// The same terms weighing recent work by `weight` next to booked work (non-finite or
    /// negative: 0).
    #[must_use]
    pub fn with_recent_weight(mut self, weight: f64) -> Self {
        self.recent_weight = finite_or(weight, 0.0);
        self
    }

    /// The same terms with the balance slack `tokens` (`None`: none).
    #[must_use]
    pub fn with_balance_slack(mut self, tokens: Option<u64>) -> Self {
        self.balance_slack = tokens;
        self
    }

    /// The booked work at which a candidate is skipped, given the busy threshold and the least
    /// booked work among the candidates: the threshold or the balance slack above the least
    /// loaded, whichever is lower (`None`: no limit). The least loaded candidate passes the
    /// slack rule by construction, so only the busy threshold can make a pick
    /// [`Choice::Overloaded`].
    pub fn limit(&self, busy_threshold: Option<u64>, least_booked: Option<u64>) -> Option<u64> {
        let slack = self
            .balance_slack
            .zip(least_booked)
            .map(|(s, least)| least.saturating_add(s).saturating_add(1));
        match (busy_threshold, slack) {
            (Some(t), Some(s)) => Some(t.min(s.max(1))),
            (t, s) => t.or(s),
        }
    }

    /// What a pick books on its worker: its uncached tokens plus the per-request overhead.
    pub fn booking(&self, uncached: u64) -> u64 {
        let overhead =
            if self.mutant.is(CostMutant::OverheadInBlocksAtLargeBlocks) && self.block_size >= 64 {
                self.request_overhead / u64::from(self.block_size)
            } else {
                self.request_overhead
            };
        uncached.saturating_add(overhead)
    }

    /// The tokens of a `request_tokens`-token prompt that a worker holding `overlap` leading
    /// blocks must compute.
    pub fn uncached(&self, request_tokens: u64, overlap: usize) -> u64 {
        let cached = u64::try_from(overlap)
            .unwrap_or(u64::MAX)
            .saturating_mul(u64::from(self.block_size));
        request_tokens.saturating_sub(cached)
    }

    /// The cost of `candidate` for a `request_tokens`-token prompt, in tokens of work.
    #[allow(clippy::cast_precision_loss)] // token counts far below 2^52
    pub fn cost(&self, request_tokens: u64, candidate: &Candidate) -> f64 {
        let uncached = self.uncached(request_tokens, candidate.overlap);
        let cached = request_tokens.saturating_sub(uncached) as f64;
        let load = if self.mutant.is(CostMutant::IgnoresLoad) {
            0.0
        } else if self.mutant.is(CostMutant::RecentAgainstColdHistory) {
            candidate.with_own(0.0).load(self.recent_weight)
        } else {
            candidate.load(self.recent_weight)
        };
        self.overlap_weight * uncached as f64 + self.load_scale * load
            - self.keep_credit * candidate.coldness * cached
    }

    /// A lower bound of the cost of any worker with `booked` tokens booked, at least `recent`
    /// recent work none of which is the request's own, and at most `max_overlap` leading
    /// blocks, whose coldness × overlap (in blocks) is at most `max_kept`: what lets the
    /// dispatcher stop its walk over the pool early (the workers it walks hold only a widely
    /// held prefix, which is nobody's own: [`super::own_work`]).
    #[allow(clippy::cast_precision_loss)] // token counts far below 2^52
    pub fn floor(
        &self,
        request_tokens: u64,
        max_overlap: usize,
        max_kept: f64,
        booked: u64,
        recent: f64,
    ) -> f64 {
        let bare = Candidate::new(0, max_overlap, booked)
            .with_recent(recent)
            .with_coldness(0.0);
        // The kept credit in tokens: at most the cached tokens of `max_overlap` blocks.
        let cached = request_tokens.saturating_sub(self.uncached(request_tokens, max_overlap));
        let kept = (max_kept * f64::from(self.block_size)).min(cached as f64);
        self.cost(request_tokens, &bare) - self.keep_credit * kept
    }

    /// The same cost running `mutant`.
    #[cfg(test)]
    pub(crate) fn with_mutant(mut self, mutant: CostMutant) -> Self {
        self.mutant = Seam::on(mutant);
        self
    }
}

/// Whether a worker with `booked` tokens is at or over `threshold` (none: never busy). A
/// worker with nothing booked is never busy, so a prompt larger than the threshold still runs.
pub fn is_busy(booked: u64, threshold: Option<u64>) -> bool {
    threshold.is_some_and(|t| booked > 0 && booked >= t)
}

/// Pick among `candidates` for a prompt of `request_tokens` tokens: skip the busy ones, then
/// the cheapest by [`KvCost::cost`]. With temperature 0 ties go to the smallest
/// `mix(salt ^ id)` (deterministic for a request, spread across requests); with a temperature,
/// sample with probability ∝ `exp(−(cost − best) / temperature)` from `random`.
pub fn choose(
    cost: &KvCost,
    request_tokens: u64,
    candidates: impl IntoIterator<Item = Candidate>,
    busy_threshold: Option<u64>,
    salt: u64,
    random: u64,
) -> Choice {
    let mut any = false;
    let usable = candidates.into_iter().filter(|c| {
        any = true;
        !is_busy(c.booked, busy_threshold)
    });
    let picked = if cost.temperature <= 0.0 {
        cheapest(cost, request_tokens, usable, salt)
    } else {
        sample(cost, request_tokens, usable, random)
    };
    match picked {
        Some(candidate) => Choice::Picked {
            candidate,
            uncached: cost.uncached(request_tokens, candidate.overlap),
        },
        None if any => Choice::Overloaded,
        None => Choice::Empty,
    }
}

fn cheapest(
    cost: &KvCost,
    request_tokens: u64,
    candidates: impl Iterator<Item = Candidate>,
    salt: u64,
) -> Option<Candidate> {
    let mut best: Option<(Candidate, f64, u64)> = None;
    for c in candidates {
        let (score, key) = (cost.cost(request_tokens, &c), mix(salt ^ c.id));
        let better = match &best {
            None => true,
            Some((_, s, k)) => match score.total_cmp(s) {
                std::cmp::Ordering::Less => true,
                std::cmp::Ordering::Greater => false,
                std::cmp::Ordering::Equal => key < *k,
            },
        };
        if better {
            best = Some((c, score, key));
        }
    }
    best.map(|b| b.0)
}

fn sample(
    cost: &KvCost,
    request_tokens: u64,
    candidates: impl Iterator<Item = Candidate>,
    random: u64,
) -> Option<Candidate> {
    let scored: Vec<(Candidate, f64)> = candidates
        .map(|c| (c, cost.cost(request_tokens, &c)))
        .collect();
    let best = scored.iter().map(|s| s.1).fold(f64::INFINITY, f64::min);
    let weights: Vec<f64> = scored
        .iter()
        .map(|s| (-(s.1 - best) / cost.temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    #[allow(clippy::cast_precision_loss)] // 53 random bits into [0, 1)
    let mut target = (random >> 11) as f64 / (1u64 << 53) as f64 * total;
    for (s, w) in scored.iter().zip(&weights) {
        if target < *w {
            return Some(s.0);
        }
        target -= w;
    }
    scored.last().map(|s| s.0)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn unit() -> KvCost {
        KvCost::new(16, 1.0, 1.0, 0.0)
    }

    fn candidates() -> impl Strategy<Value = Vec<Candidate>> {
        proptest::collection::vec((0..6usize, 0..5_000u64), 1..10).prop_map(|v| {
            v.into_iter()
                .enumerate()
                .map(|(i, (overlap, booked))| Candidate::new(i as u64, overlap, booked))
                .collect()
        })
    }

    fn picked(choice: Choice) -> Option<Candidate> {
        match choice {
            Choice::Picked { candidate, .. } => Some(candidate),
            _ => None,
        }
    }

    /// Equal overlaps, temperature 0: the pick never has strictly more booked work than
    /// another candidate. Returns the first violation.
    fn equal_overlaps_violation(cost: &KvCost, booked: &[u64], overlap: usize) -> Option<String> {
        let cs: Vec<Candidate> = booked
            .iter()
            .enumerate()
            .map(|(i, &b)| Candidate::new(i as u64, overlap, b))
            .collect();
        let pick = picked(choose(cost, 96, cs.iter().copied(), None, 7, 0))?;
        let least = cs.iter().map(|c| c.booked).min()?;
        (pick.booked > least).then(|| format!("picked {pick:?}, least booked {least}"))
    }

    proptest! {
        #[test]
        fn equal_overlaps_never_pick_a_worker_with_strictly_more_booked_work(
            booked in proptest::collection::vec(0..10_000u64, 1..12),
            overlap in 0..6usize,
        ) {
            prop_assert_eq!(equal_overlaps_violation(&unit(), &booked, overlap), None);
        }

        #[test]
        fn equal_overlaps_never_pick_a_worker_with_strictly_more_load(
            loads in proptest::collection::vec((0..10_000u64, 0.0..20_000.0f64), 1..12),
            overlap in 0..6usize,
            weight in 0.0..2.0f64,
            keep in 0.0..40.0f64,
        ) {
            // Load = booked + weight × recent work; the same deepest block, so the same
            // coldness and keep credit for all.
            let cost = unit().with_recent_weight(weight).with_keep_credit(keep);
            let cs: Vec<Candidate> = loads.iter().enumerate()
                .map(|(i, &(b, r))| Candidate::new(i as u64, overlap, b).with_recent(r).with_coldness(0.5))
                .collect();
            let pick = picked(choose(&cost, 96, cs.iter().copied(), None, 7, 0)).unwrap();
            let least = cs.iter().map(|c| c.load(weight)).fold(f64::INFINITY, f64::min);
            prop_assert!(pick.load(weight) <= least + 1e-6, "{:?} vs {}", pick, least);
        }

        #[test]
        fn a_prefix_every_worker_holds_is_decided_by_load(
            booked in proptest::collection::vec(0..10_000u64, 2..12),
            salt in any::<u64>(),
        ) {
            // Every worker holds the same 5-block prefix of a 6-block prompt.
            let cs = booked.iter().enumerate().map(|(i, &b)| Candidate::new(i as u64, 5, b));
            let pick = picked(choose(&unit(), 96, cs, None, salt, 0)).unwrap();
            prop_assert_eq!(pick.booked, *booked.iter().min().unwrap());
        }

        #[test]
        fn the_pick_is_a_cheapest_candidate_that_is_not_busy(
            cs in candidates(),
            threshold in proptest::option::of(1..6_000u64),
            salt in any::<u64>(),
        ) {
            let cost = unit();
            let usable: Vec<&Candidate> = cs.iter().filter(|c| !is_busy(c.booked, threshold)).collect();
            match choose(&cost, 96, cs.iter().copied(), threshold, salt, 0) {
                Choice::Picked { candidate, uncached } => {
                    prop_assert!(!is_busy(candidate.booked, threshold));
                    prop_assert_eq!(uncached, cost.uncached(96, candidate.overlap));
                    let best = usable.iter().map(|c| cost.cost(96, c)).fold(f64::INFINITY, f64::min);
                    prop_assert_eq!(cost.cost(96, &candidate), best);
                }
                Choice::Overloaded => prop_assert!(usable.is_empty()),
                Choice::Empty => prop_assert!(false, "candidates were given"),
            }
        }

        #[test]
        fn the_floor_bounds_every_worker_with_less_overlap_more_load_and_less_kept_credit(
            request in 0..200u64, k in 0..8usize, load in 0..1_000u64,
            overlap in 0..8usize, extra in 0..1_000u64,
            keep in 0.0..8.0f64, coldness in 0.0..=1.0f64, slack in 0.0..4.0f64,
            recent in 0.0..10_000.0f64, more in 0.0..10_000.0f64, weight in 0.0..2.0f64,
        ) {
            let cost = unit().with_keep_credit(keep);
            let c = Candidate::new(1, overlap.min(k), load + extra).with_coldness(coldness);
            let kept = coldness * overlap.min(k) as f64 + slack;
            prop_assert!(cost.cost(request, &c) >= cost.floor(request, k, kept, load, 0.0));
            let busy = c.with_recent(recent + more);
            let cost = cost.with_recent_weight(weight);
            prop_assert!(cost.cost(request, &busy) >= cost.floor(request, k, kept, load, recent));
        }
    }

    /// The properties bite: with the mutant that ignores booked work, equal overlaps pick a
    /// busier worker.
    #[test]
    fn the_mutant_that_ignores_load_is_caught() {
        let mutant = unit().with_mutant(CostMutant::IgnoresLoad);
        let caught = (0..64u64).any(|salt| {
            let booked = [salt * 100, 0, 5_000, 300];
            equal_overlaps_violation(&mutant, &booked, 3).is_some()
        });
        assert!(caught, "the mutant was not caught");
        assert_eq!(equal_overlaps_violation(&unit(), &[0, 100, 5_000], 3), None);
    }

    #[test]
    fn overlap_and_load_are_weighed_in_one_unit() {
        let cost = unit();
        // A 30-block shared prefix: the holder with 2 blocks' work booked beats an idle
        // worker that must compute all 32 blocks; with 40 blocks booked it no longer does.
        let holder = |booked| Candidate::new(1, 30, booked);
        let idle = Candidate::new(2, 0, 0);
        let pick = |h| picked(choose(&cost, 32 * 16, [h, idle], None, 0, 0)).map(|c| c.id);
        assert_eq!(pick(holder(2 * 16)), Some(1));
        assert_eq!(pick(holder(40 * 16)), Some(2));
    }

    #[test]
    fn every_candidate_busy_is_overloaded_and_an_idle_worker_never_is() {
        let cost = unit();
        let cs = [Candidate::new(1, 0, 500), Candidate::new(2, 0, 800)];
        assert_eq!(choose(&cost, 10, cs, Some(500), 0, 0), Choice::Overloaded);
        assert_eq!(choose(&cost, 10, [], Some(500), 0, 0), Choice::Empty);
        assert!(!is_busy(0, Some(0)));
        assert!(matches!(
            choose(&cost, 10, cs, Some(501), 0, 0),
            Choice::Picked { .. }
        ));
    }

    #[test]
    fn a_temperature_samples_every_candidate_and_prefers_the_cheap_one() {
        let cost = KvCost::new(16, 1.0, 1.0, 64.0); // tokens: 4 blocks of 16
        let cs = [Candidate::new(1, 0, 0), Candidate::new(2, 0, 64)];
        let mut counts = [0u32; 3];
        let mut r = 1u64;
        for _ in 0..2_000 {
            r = mix(r);
            if let Some(c) = picked(choose(&cost, 16, cs, None, 0, r)) {
                counts[c.id as usize] += 1;
            }
        }
        assert!(counts[1] > counts[2] && counts[2] > 0, "{counts:?}");
    }
}
