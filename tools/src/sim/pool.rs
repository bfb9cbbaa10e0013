//! The "discovery" world: simulated workers register in a real in-memory discovery store and
//! the real [`TopologyWatcher`](prefill_router::topology::TopologyWatcher) derives the router's target
//! from a faulty watch of it ([`FaultyDiscovery`](super::discovery::FaultyDiscovery)).
//!
//! Steps change registrations: a pool-wide card change (a rolling re-registration, which
//! first-wins admission turns into a new generation once the old card's instances have all
//! left), a worker registering with a foreign card (rejected by admission), the decode set or
//! the whole prefill set leaving and returning, crashes that deregister at once or leave the
//! record to expire.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::world::{instance, World};
use prefill_router::advert::{ModelCard, SelectionMode};
use prefill_router::discovery::{Discovery, EndpointId, Instance, InstanceId, Registration};

/// Most prefill workers a world has (ids `1..=MAX_WORKERS`).
pub(crate) const MAX_WORKERS: u64 = 5;

/// Record TTL of the store: an abandoned (crashed) worker's record lingers this long.
pub(crate) const TTL: Duration = Duration::from_millis(300);

/// The decode endpoint of the simulated namespace.
pub(crate) fn decode_endpoint() -> EndpointId {
    EndpointId::new("sim", "decode", "generate")
}

/// The pool card of card generation `k` (cards differ in block size or router mode).
fn pool_card(k: u64) -> ModelCard {
    let mode = [
        SelectionMode::RoundRobin,
        SelectionMode::KV,
        SelectionMode::Random,
    ][(k % 3) as usize];
    ModelCard::routed("sim-model", mode, [16, 32, 64][((k / 3) % 3) as usize])
}

/// A card no pool card equals: first-wins admission must reject its instance.
fn foreign_card() -> ModelCard {
    ModelCard::named("other-model")
}

struct PoolState {
    card: u64,
    prefill: BTreeMap<InstanceId, Registration>,
    decode: Option<Registration>,
}

/// The registrations of the simulated workers.
pub(crate) struct Pool {
    world: Arc<World>,
    store: Arc<dyn Discovery>,
    state: Mutex<PoolState>,
}

impl Pool {
    pub(crate) fn new(world: Arc<World>, store: Arc<dyn Discovery>) -> Arc<Self> {
        Arc::new(Pool {
            world,
            store,
            state: Mutex::new(PoolState {
                card: 0,
                prefill: BTreeMap::new(),
                decode: None,
            }),
        })
    }

    async fn register(&self, instance: Instance, card: ModelCard) -> Option<Registration> {
        match self.store.register(instance, card).await {
            Ok(registration) => Some(registration),
            Err(error) => {
                // The in-memory store does not fail; if it did, the worker just stays away.
                tracing::warn!(%error, "simulated registration failed");
                None
            }
        }
    }

    async fn register_prefill(&self, id: InstanceId, card: ModelCard) {
        if let Some(registration) = self.register(instance(id), card).await {
            // The replaced registration drops after the lock; a superseded registration
            // never deletes its successor's record.
            let old = self.state.lock().prefill.insert(id, registration);
            drop(old);
        }
    }

    fn up_workers(&self) -> Vec<InstanceId> {
        self.world.with(|s| {
            s.workers
                .iter()
                .filter(|(_, up)| **up)
                .map(|(id, _)| *id)
                .collect()
        })
    }

    /// The whole pool comes up with the current card, and the decode worker registers.
    pub(crate) async fn restore(&self) {
        let card = pool_card(self.state.lock().card);
        for id in self.up_workers() {
            self.register_prefill(id, card.clone()).await;
        }
        let decode = Instance {
            endpoint: decode_endpoint(),
            instance_id: 1,
            address: instance(1).address,
        };
        if self.state.lock().decode.is_none() {
            if let Some(registration) = self.register(decode, pool_card(0)).await {
                self.state.lock().decode = Some(registration);
            }
        }
        self.world.trace(&[30]);
    }

    /// Rolling card change: every registered worker re-registers with the next card, in a
    /// seeded order, with seeded pauses between.
    pub(crate) async fn roll(&self, order: &mut super::rng::SimRng) {
        let (card, mut ids) = {
            let mut state = self.state.lock();
            state.card += 1;
            (
                state.card,
                state.prefill.keys().copied().collect::<Vec<_>>(),
            )
        };
        for i in (1..ids.len()).rev() {
            let j = order.below(i as u64 + 1) as usize;
            ids.swap(i, j);
        }
        self.world.trace(&[31, card]);
        for id in ids {
            self.register_prefill(id, pool_card(card)).await;
            tokio::time::sleep(Duration::from_millis(order.below(3))).await;
        }
    }

    /// The pool disappears: the decode set leaves, or every prefill worker does.
    pub(crate) fn clear(&self, decode_leaves: bool) {
        let gone: Vec<Registration> = {
            let mut state = self.state.lock();
            if decode_leaves {
                state.decode.take().into_iter().collect()
            } else {
                std::mem::take(&mut state.prefill).into_values().collect()
            }
        };
        self.world.trace(&[32, u64::from(decode_leaves)]);
        drop(gone);
    }

    /// One worker changes its registration: leaves, comes back, or re-registers with a foreign
    /// card.
    pub(crate) async fn churn(&self, rng: &mut super::rng::SimRng) {
        let up = self.up_workers();
        if up.is_empty() {
            return;
        }
        let id = up[rng.below(up.len() as u64) as usize];
        let card = pool_card(self.state.lock().card);
        match rng.below(3) {
            0 => {
                let gone = self.state.lock().prefill.remove(&id);
                drop(gone);
            }
            1 => self.register_prefill(id, foreign_card()).await,
            _ => self.register_prefill(id, card).await,
        }
        self.world.trace(&[33, id]);
    }

    /// Worker `id` crashes: down at once; its record goes at once (the process closed its
    /// session) or lingers until the TTL (killed).
    pub(crate) fn crash(self: &Arc<Self>, id: InstanceId, killed: bool) {
        self.world.crash(id);
        let registration = self.state.lock().prefill.remove(&id);
        match (registration, killed) {
            (Some(r), true) => r.abandon(),
            (other, _) => drop(other),
        }
    }

    /// Worker `id` restarts and registers with the current card.
    pub(crate) async fn restart(&self, id: InstanceId) {
        self.world.set_worker(id, true);
        let card = pool_card(self.state.lock().card);
        self.register_prefill(id, card).await;
    }

    /// Drop every registration (end of run).
    pub(crate) fn clear_all(&self) {
        let (prefill, decode) = {
            let mut state = self.state.lock();
            (std::mem::take(&mut state.prefill), state.decode.take())
        };
        drop(prefill);
        drop(decode);
    }
}
