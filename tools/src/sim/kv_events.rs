//! KV cache events in the simulated world: lost and delayed batches, and the stale-credit
//! oracle.
//!
//! A run with [`SimConfig::kv_events`](super::SimConfig::kv_events) runs every binding's
//! dispatcher in KV mode and gives every simulated worker a small LRU block cache
//! ([`CACHE_BLOCKS`]) that publishes its changes as KV event batches. A prefill that succeeds
//! fills the worker's cache; its batches go to every live binding's dispatcher
//! (`Dispatcher::apply_kv_events`), while faults are on each one lost with
//! [`LOSS_PERCENT`] and delayed by up to [`DELAY_MAX_MS`] with [`DELAY_PERCENT`] (arriving
//! after newer ones). The oracle, at every KV pick:
//!
//! - `kv_stale_credit`: the dispatcher never credits the picked worker (from its events) with
//!   more leading blocks of the request than the worker's cache holds at that instant, unless
//!   a batch of that worker is delayed and not yet delivered, or was lost or delivered late
//!   and no batch of it has arrived on time since: the window in which an index may lag the
//!   cache (a late batch can also be the first a new binding's index sees, which then starts
//!   from it and credits blocks a newer batch already removed).
//!
//! The mutant `kv-ignores-removals` publishes batches without their removals: evicted blocks
//! stay credited with no batch lost or late.

use std::sync::{Arc, Weak};

use super::config::Mutant;
use super::fate::Fate;
use super::oracle::Violation;
use super::world::{KvSubscriber, World};
use crate::mock::BlockCache;
use prefill_router::discovery::InstanceId;
use prefill_router::kv_events::{EventBatch, KvEvent};
use prefill_router::push::{Dispatcher, WorkerLink};

/// Blocks each simulated worker's cache holds: small, so evictions (removals) are frequent.
pub const CACHE_BLOCKS: usize = 8;
/// Percent of batches lost while faults are on.
pub const LOSS_PERCENT: u64 = 8;
/// Percent of batches delayed while faults are on.
pub const DELAY_PERCENT: u64 = 12;
/// Longest delay of a delayed batch.
pub const DELAY_MAX_MS: u64 = 30;

/// The key of the batch-fate draws.
const STREAM_KV: u64 = 6;

/// A new binding's dispatcher receives the workers' batches from now on (no snapshot: its
/// index starts empty, as after a rebuild in production).
pub(crate) fn subscribe<L: WorkerLink>(world: &World, dispatcher: &Arc<Dispatcher<L>>) {
    let dispatcher: Arc<dyn KvSubscriber> = Arc::clone(dispatcher) as _;
    world.with(|s| {
        s.kv.subscribers.retain(|d| d.strong_count() > 0);
        s.kv.subscribers.push(Arc::downgrade(&dispatcher));
    });
}

/// Worker `worker` prefilled the chain `hashes`: fill its cache and publish the batches.
pub(crate) fn prefilled(world: &Arc<World>, worker: InstanceId, hashes: &[u64]) {
    let strip_removals = world.mutant == Some(Mutant::KvIgnoresRemovals);
    let plans: Vec<(EventBatch, Fate)> = world.with(|s| {
        if !s.kv.on {
            return Vec::new();
        }
        let cache =
            s.kv.caches
                .entry(worker)
                .or_insert_with(|| BlockCache::with_events(CACHE_BLOCKS, 1));
        cache.prefill(hashes);
        let batches = cache.take_event_batches();
        let faults = s.faults;
        batches
            .into_iter()
            .map(|mut batch| {
                s.kv.published += 1;
                let mut rng = world.keyed(&[STREAM_KV, s.kv.published]);
                if strip_removals {
                    batch
                        .events
                        .retain(|e| !matches!(e, KvEvent::Removed { .. }));
                }
                let lag = s.kv.lag.entry(worker).or_default();
                let fate = if faults {
                    Fate::draw(&mut rng, LOSS_PERCENT, DELAY_PERCENT, DELAY_MAX_MS)
                } else {
                    Fate::Now
                };
                match fate {
                    Fate::Lost => {
                        lag.unsettled = true;
                        s.stats.kv_batches_lost += 1;
                    }
                    Fate::Late(_) => {
                        lag.delayed += 1;
                        s.stats.kv_batches_delayed += 1;
                    }
                    Fate::Now => {}
                }
                (batch, fate)
            })
            .collect()
    });
    for (batch, fate) in plans {
        match fate {
            Fate::Lost => {}
            Fate::Now => deliver(world, worker, &batch, false),
            Fate::Late(delay) => {
                let world = Arc::clone(world);
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    deliver(&world, worker, &batch, true);
                });
            }
        }
    }
}

/// Apply `batch` to every live subscriber, then close the lag window it ends.
fn deliver(world: &World, worker: InstanceId, batch: &EventBatch, late: bool) {
    let subscribers: Vec<Arc<dyn KvSubscriber>> =
        world.with(|s| s.kv.subscribers.iter().filter_map(Weak::upgrade).collect());
    // Outside the world's lock: the dispatcher takes its own.
    for d in &subscribers {
        d.apply(worker, batch);
    }
    world.with(|s| {
        let lag = s.kv.lag.entry(worker).or_default();
        if late {
            lag.delayed = lag.delayed.saturating_sub(1);
            lag.unsettled = true;
        } else {
            // A batch on time shows any gap to every index that had the worker (its entries
            // are dropped and rebuilt from this batch on); an index that started from a late
            // batch sees the jump in sequence numbers too.
            lag.unsettled = false;
        }
    });
}

/// Oracle at a KV pick: `credited` leading blocks of `hashes` for `worker`, by `dispatcher`.
pub(crate) fn picked<L: WorkerLink>(
    world: &World,
    request: u64,
    dispatcher: &Dispatcher<L>,
    worker: InstanceId,
    hashes: &[u64],
    credited: Option<usize>,
) {
    let Some(credited) = credited.filter(|&c| c > 0) else {
        return;
    };
    if !dispatcher.kv_indexed(worker) {
        return;
    }
    let (held, lagging) = world.with(|s| {
        let held =
            s.kv.caches
                .get(&worker)
                .map_or(0, |c| c.leading_hits(hashes));
        let lagging =
            s.kv.lag
                .get(&worker)
                .is_some_and(|l| l.unsettled || l.delayed > 0);
        (held, lagging)
    });
    if credited > held && !lagging {
        world.violate(Violation::KvStaleCredit {
            request,
            worker,
            credited,
            held,
        });
    }
    if credited > held {
        world.with(|s| s.stats.kv_stale_while_lagging += u64::from(lagging));
    }
}
