//! `MemoryDiscovery`: an in-process store with leases, for single-process deployments and tests.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::broadcast;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::api::{fresh_owner, Lease, StopFlag};
use super::known::RawEvent;
use super::record::encode_record;
use super::store::{Backend, Gap, Leased, Listing, Reaper};
use super::{DiscoveryError, Instance};
use crate::advert::ModelCard;

/// Lease timing of a [`MemoryDiscovery`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryConfig {
    /// How long a record outlives its last keep-alive.
    pub ttl: Duration,
    /// How often a registration renews its lease (must be well under `ttl`).
    pub keepalive_interval: Duration,
    /// How often expired records are removed (and reported to watchers).
    pub reap_interval: Duration,
}

impl MemoryConfig {
    /// A TTL, with keep-alive and reaping every third of it.
    pub fn with_ttl(ttl: Duration) -> Self {
        MemoryConfig {
            ttl,
            keepalive_interval: ttl / 3,
            reap_interval: ttl / 3,
        }
    }
}

impl Default for MemoryConfig {
    /// A 10 s TTL, as Dynamo's leases.
    fn default() -> Self {
        MemoryConfig::with_ttl(Duration::from_secs(10))
    }
}

/// How many raw events a slow watcher may fall behind before it resyncs from a listing.
const BROADCAST_CAPACITY: usize = 1024;

/// An in-process discovery store. Clones share the store (as clients of one server would).
///
/// Leases behave as on the other backends: a registration's task renews them, and a record
/// whose registration stopped renewing
/// ([`Registration::abandon`](crate::discovery::Registration::abandon)) expires after the TTL.
#[derive(Clone, Debug)]
pub struct MemoryDiscovery {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: MemoryConfig,
    records: Mutex<BTreeMap<String, Slot>>,
    /// Every put and delete, sent while holding `records` so that order is the store's order.
    events: broadcast::Sender<RawEvent>,
    reaper: Reaper,
}

#[derive(Debug)]
struct Slot {
    bytes: Vec<u8>,
    owner: u64,
    /// `None`: never expires (a raw record written by [`MemoryDiscovery::insert_raw`]).
    expires: Option<Instant>,
}

impl Slot {
    fn live(&self, now: Instant) -> bool {
        self.expires.is_none_or(|at| at > now)
    }
}

impl Default for MemoryDiscovery {
    fn default() -> Self {
        MemoryDiscovery::new(MemoryConfig::default())
    }
}

/// The live records under `prefix`.
fn listing(records: &BTreeMap<String, Slot>, prefix: &str) -> Vec<(String, Vec<u8>)> {
    let now = Instant::now();
    records
        .range(prefix.to_owned()..)
        .take_while(|(k, _)| k.starts_with(prefix))
        .filter(|(_, slot)| slot.live(now))
        .map(|(k, slot)| (k.clone(), slot.bytes.clone()))
        .collect()
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Slot>> {
        // A panic while holding the lock cannot leave the map half-updated (each critical
        // section is one insert or remove), so a poisoned lock is still consistent.
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn snapshot(&self, prefix: &str) -> Vec<(String, Vec<u8>)> {
        listing(&self.lock(), prefix)
    }

    /// Subscribe and list under the store lock (events are sent under it too), so the
    /// subscription carries exactly the changes after the listing: none missed, none
    /// replayed (a replayed put-then-delete would flash a dead instance to the watcher).
    fn subscribe_with_snapshot(
        &self,
        prefix: &str,
    ) -> (broadcast::Receiver<RawEvent>, Vec<(String, Vec<u8>)>) {
        let records = self.lock();
        (self.events.subscribe(), listing(&records, prefix))
    }

    fn put(&self, key: String, slot: Slot) {
        let mut records = self.lock();
        let event = RawEvent::Put(key.clone(), slot.bytes.clone());
        records.insert(key, slot);
        // No receiver is fine: nobody watches.
        let _ = self.events.send(event);
    }

    /// Remove `key` if `owner` still owns it (0 removes whatever is there).
    fn remove_owned(&self, key: &str, owner: u64) {
        let mut records = self.lock();
        if records
            .get(key)
            .is_some_and(|slot| owner == 0 || slot.owner == owner)
        {
            records.remove(key);
            let _ = self.events.send(RawEvent::Delete(key.to_owned()));
        }
    }

    fn reap(&self) {
        let now = Instant::now();
        let mut records = self.lock();
        let expired: Vec<String> = records
            .iter()
            .filter(|(_, slot)| !slot.live(now))
            .map(|(k, _)| k.clone())
            .collect();
        for key in expired {
            records.remove(&key);
            tracing::debug!(key, "memory discovery: lease expired");
            let _ = self.events.send(RawEvent::Delete(key));
        }
    }

    /// Renew `owner`'s lease on `key`. Returns false once superseded by another registration.
    fn renew(&self, key: &str, owner: u64, bytes: &[u8]) -> bool {
        let mut records = self.lock();
        let expires = Some(Instant::now() + self.config.ttl);
        match records.get_mut(key) {
            Some(slot) if slot.owner == owner => {
                slot.expires = expires;
                true
            }
            Some(_) => false,
            None => {
                // Reaped while this task was starved: a live worker restores its record.
                records.insert(
                    key.to_owned(),
                    Slot {
                        bytes: bytes.to_vec(),
                        owner,
                        expires,
                    },
                );
                let _ = self
                    .events
                    .send(RawEvent::Put(key.to_owned(), bytes.to_vec()));
                true
            }
        }
    }
}

impl MemoryDiscovery {
    /// An empty store. Background tasks start with the first async call, so this needs no
    /// runtime.
    pub fn new(config: MemoryConfig) -> Self {
        let (events, _) = broadcast::channel(BROADCAST_CAPACITY);
        MemoryDiscovery {
            inner: Arc::new(Inner {
                config,
                records: Mutex::new(BTreeMap::new()),
                events,
                reaper: Reaper::default(),
            }),
        }
    }

    /// Store raw bytes under a record key, as a foreign or faulty writer would (no lease,
    /// never expires). For tests of malformed-record handling.
    pub fn insert_raw(&self, key: &str, bytes: Vec<u8>) {
        self.inner.put(
            key.to_owned(),
            Slot {
                bytes,
                owner: 0,
                expires: None,
            },
        );
    }
}

struct MemoryLease {
    inner: Arc<Inner>,
    key: String,
    owner: u64,
    stop: Arc<StopFlag>,
    keepalive: JoinHandle<()>,
}

#[async_trait::async_trait]
impl Lease for MemoryLease {
    async fn revoke(self: Box<Self>) -> Result<(), DiscoveryError> {
        self.release();
        Ok(())
    }

    fn abandon(self: Box<Self>) {
        self.stop.stop_then(|| ());
        self.keepalive.abort();
    }

    fn release(self: Box<Self>) {
        self.stop
            .stop_then(|| self.inner.remove_owned(&self.key, self.owner));
        self.keepalive.abort();
    }
}

/// One watch's subscription to the store's broadcast of puts and deletes.
pub(crate) struct MemoryCursor {
    prefix: String,
    events: broadcast::Receiver<RawEvent>,
    /// The listing taken together with `events`, not yet sent.
    first: Option<Listing>,
}

impl Backend for MemoryDiscovery {
    type Cursor = MemoryCursor;

    async fn list(&self, prefix: &str) -> Result<Listing, DiscoveryError> {
        Ok(self.inner.snapshot(prefix))
    }

    fn subscribe(&self, prefix: String) -> MemoryCursor {
        let (events, first) = self.inner.subscribe_with_snapshot(&prefix);
        MemoryCursor {
            prefix,
            events,
            first: Some(first),
        }
    }

    async fn resync(&self, cursor: &mut MemoryCursor) -> Result<Listing, DiscoveryError> {
        if let Some(first) = cursor.first.take() {
            return Ok(first);
        }
        // Start over from a fresh subscription: the old one would replay events older than
        // the new listing.
        let (fresh, listing) = self.inner.subscribe_with_snapshot(&cursor.prefix);
        cursor.events = fresh;
        Ok(listing)
    }

    async fn changes(&self, cursor: &mut MemoryCursor, out: &mut Vec<RawEvent>) -> Result<(), Gap> {
        loop {
            match cursor.events.recv().await {
                Ok(RawEvent::Put(key, bytes)) if key.starts_with(&cursor.prefix) => {
                    out.push(RawEvent::Put(key, bytes));
                    return Ok(());
                }
                Ok(RawEvent::Delete(key)) if key.starts_with(&cursor.prefix) => {
                    out.push(RawEvent::Delete(key));
                    return Ok(());
                }
                Ok(_) => continue,
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    tracing::debug!(missed, "memory discovery watch lagged; resyncing");
                    return Err(Gap::Missed);
                }
                Err(broadcast::error::RecvError::Closed) => return Err(Gap::Closed),
            }
        }
    }

    fn retry_interval(&self) -> Duration {
        // Listing a map cannot fail; a resync is never retried.
        Duration::ZERO
    }

    async fn put_leased(&self, key: String, instance: &Instance, card: &ModelCard) -> Leased {
        let bytes = encode_record(instance, card);
        let owner = fresh_owner();
        let ttl = self.inner.config.ttl;
        self.inner.put(
            key.clone(),
            Slot {
                bytes: bytes.clone(),
                owner,
                expires: Some(Instant::now() + ttl),
            },
        );
        let weak = Arc::downgrade(&self.inner);
        let period = self
            .inner
            .config
            .keepalive_interval
            .max(Duration::from_millis(1));
        let task_key = key.clone();
        let stop = Arc::new(StopFlag::default());
        let task_stop = Arc::clone(&stop);
        let keepalive = tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.tick().await; // the first tick is immediate; the record is fresh
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { return };
                let mut current = true;
                if !task_stop.unless_stopped(|| current = inner.renew(&task_key, owner, &bytes)) {
                    return;
                }
                if !current {
                    tracing::debug!(key = task_key, "registration superseded; keep-alive stops");
                    return;
                }
            }
        });
        Ok(Box::new(MemoryLease {
            inner: Arc::clone(&self.inner),
            key,
            owner,
            stop,
            keepalive,
        }))
    }

    fn ensure_reaper(&self) {
        let period = self.inner.config.reap_interval;
        self.inner
            .reaper
            .start(&self.inner, period, |inner| async move {
                inner.reap();
                true
            });
    }
}
