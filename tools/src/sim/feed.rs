//! The faulty discovery feed: every change is delivered late, twice, out of order, or not at
//! all (while faults are on), and a periodic level-triggered resync heals what was lost, as a
//! real watch does after a gap.

use std::sync::Arc;
use std::time::Duration;

use super::config::timing;
use super::world::{instance, World};
use prefill_router::discovery::{InstanceEvent, InstanceId};

/// Key part of instance-event deliveries.
const FEED_INSTANCES: u64 = 1;
/// Key part of topology-event deliveries.
pub(crate) const FEED_TOPOLOGY: u64 = 2;

/// How one delivery goes.
pub(crate) struct Delivery {
    /// Delays of the copies to deliver (empty: lost; two: duplicated). `None` means at once,
    /// synchronously.
    pub(crate) copies: Vec<Option<Duration>>,
}

/// Draw how one event is delivered; `key` names the event (see [`World::keyed`]).
pub(crate) fn plan(world: &World, key: &[u64]) -> Delivery {
    let mut key = key.to_vec();
    key.push(world.now_ms());
    let mut rng = world.keyed(&key);
    world.with(|s| {
        if !s.faults {
            return Delivery { copies: vec![None] };
        }
        if rng.percent(8) {
            s.stats.events_lost += 1;
            return Delivery { copies: Vec::new() };
        }
        let first = Some(Duration::from_millis(
            rng.below(timing::FEED_DELAY_MAX_MS + 1),
        ));
        let copies = if rng.percent(8) {
            let second = Some(Duration::from_millis(
                rng.below(timing::FEED_DELAY_MAX_MS + 1),
            ));
            s.stats.events_duplicated += 1;
            vec![first, second]
        } else {
            vec![first]
        };
        Delivery { copies }
    })
}

/// Run `apply` per the delivery plan: at once, or on a task after each copy's delay.
pub(crate) fn deliver<F>(delivery: Delivery, apply: F)
where
    F: Fn() + Send + Sync + 'static,
{
    let apply = Arc::new(apply);
    for copy in delivery.copies {
        match copy {
            None => apply(),
            Some(delay) => {
                let apply = Arc::clone(&apply);
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    apply();
                });
            }
        }
    }
}

/// A worker appeared or went: every live binding's view hears of it through the feed.
pub(crate) fn publish_instance_event(world: &Arc<World>, event: InstanceEvent, key: &[u64]) {
    for (serial, view) in world.live_views() {
        let mut key = key.to_vec();
        key.extend([FEED_INSTANCES, serial]);
        let delivery = plan(world, &key);
        let event = event.clone();
        deliver(delivery, move || view.apply(event.clone()));
    }
}

/// The level-triggered resync of every live view: heals lost and reordered events.
pub(crate) fn resync_instances(world: &World) {
    let events = world.resync_events();
    for (_, view) in world.live_views() {
        for event in &events {
            view.apply(event.clone());
        }
    }
}

// Worker liveness lives here rather than in `world.rs` because every change of it goes out
// through the faulty feed; the world itself only records it.
impl World {
    /// Worker `id` crashed: down at once; discovery learns it through the faulty feed.
    pub(crate) fn crash(self: &Arc<Self>, id: InstanceId) {
        self.set_worker(id, false);
    }

    /// Bring worker `id` up or down, and tell discovery.
    pub(crate) fn set_worker(self: &Arc<Self>, id: InstanceId, up: bool) {
        let now = tokio::time::Instant::now();
        let changed = self.with(|s| {
            let changed = s.workers.insert(id, up) != Some(up);
            if up {
                if changed && !s.blipped.contains(&id) {
                    s.reachable_since.insert(id, now);
                }
            } else {
                // A crash ends a blip: the worker is down, not just unreachable.
                s.blipped.remove(&id);
                s.reachable_since.remove(&id);
            }
            changed
        });
        if changed {
            self.trace(&[4, id, u64::from(up)]);
            let event = if up {
                InstanceEvent::Added(instance(id))
            } else {
                InstanceEvent::Removed(id)
            };
            publish_instance_event(self, event, &[id, u64::from(up)]);
        }
    }
}
