//! What the router knows of each engine's KV events: the [`EngineKvBoard`] the feeds write and
//! the operator reads (`/ready`, metrics).

use std::collections::BTreeMap;

use parking_lot::Mutex;
use tokio::time::Instant;

use crate::discovery::InstanceId;
use crate::engine::load::LoadReading;
use crate::kv_events::{MirrorCounts, MirrorError, Picture};

/// Where one engine's feed is.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum FeedState {
    /// Starting: asking the engine where it publishes.
    #[default]
    Starting,
    /// The engine says it publishes nothing (or could not be asked): the reason.
    NoSources(String),
    /// Subscribed to every rank.
    Subscribed,
}

/// What the router knows of one engine's events (see [`EngineKvBoard`]).
#[derive(Clone, Debug, Default)]
pub struct EngineKvStatus {
    /// Where the feed is.
    pub state: FeedState,
    /// How far the index's picture of the engine can be trusted.
    pub picture: Picture,
    /// The mirror's counts: batches, events, replays, rebuilds, restarts, refusals.
    pub counts: MirrorCounts,
    /// When the last live batch arrived.
    pub last_event: Option<Instant>,
    /// Live batches that arrived and decoded.
    pub received: u64,
    /// From the engine's timestamp on a live batch to the index updated with it (the engine's
    /// wall clock against ours: meaningful on one machine or with synchronised clocks).
    pub freshness: Freshness,
    /// Batches (or messages) that could not be decoded.
    pub undecodable: u64,
    /// Times the live stream was lost.
    pub disconnects: u64,
    /// The last reason events could not be indexed (a block size other than the card's...).
    pub last_error: Option<MirrorError>,
    /// Whether the live stream is connected (false from a loss until it is back).
    pub connected: bool,
    /// The block size the engine's stored blocks said last (`None`: none seen yet).
    pub engine_block_size: Option<u32>,
    /// Since when a live batch is owed: the first prefill that stored new blocks on the engine
    /// after its last live batch (`None`: nothing owed).
    pub awaiting_event_since: Option<Instant>,
    /// How long a batch may be owed before the events are stale (the link's setting).
    pub stale_after: Option<std::time::Duration>,
    /// Times the events went stale and the feed started afresh.
    pub stale_restarts: u64,
    /// The engine's own load, when the link scrapes it ([`EngineLinkConfig::load_interval`]).
    ///
    /// [`EngineLinkConfig::load_interval`]: crate::engine::EngineLinkConfig::load_interval
    pub load: LoadStatus,
}

/// What the router learnt of one engine's load from its `/metrics` (see
/// [`crate::engine::load`]).
#[derive(Clone, Debug, Default)]
pub struct LoadStatus {
    /// The last reading (`None`: not scraped yet, or scraping is off).
    pub reading: Option<LoadReading>,
    /// When it was taken.
    pub at: Option<Instant>,
    /// Scrapes that gave a reading.
    pub scrapes: u64,
    /// Scrapes that failed (no answer, or not 2xx).
    pub failures: u64,
}

impl EngineKvStatus {
    /// What an operator should hear about this engine's events, if anything: they never
    /// started, the stream is lost, the picture is partial, or the block size is wrong. Until
    /// it clears, the router's picture of the engine is incomplete (an engine without events
    /// is scored by load and prediction).
    pub fn warning(&self) -> Option<String> {
        if let Some(waited) = self.owed_for() {
            return Some(format!(
                "no KV event for {} ms after a prefill that stored blocks: its events are stale",
                waited.as_millis()
            ));
        }
        if let Some(MirrorError::BlockSizeMismatch { card, engine }) = &self.last_error {
            return Some(format!(
                "its blocks hold {engine} tokens, the card says {card}: no block can match"
            ));
        }
        if self.load.reading == Some(LoadReading::Stale) {
            return Some(
                "its /metrics stopped answering: scored as saturated until they answer".to_owned(),
            );
        }
        match &self.state {
            FeedState::Starting if self.stale_restarts > 0 => Some(
                "its KV events went stale (no batch after a prefill that stored blocks): subscribing afresh"
                    .to_owned(),
            ),
            FeedState::Starting => Some("KV events not started yet".to_owned()),
            FeedState::NoSources(reason) => Some(format!("no KV events: {reason}")),
            FeedState::Subscribed if !self.connected => {
                Some("KV event stream lost; reconnecting".to_owned())
            }
            FeedState::Subscribed => match self.picture {
                Picture::Unknown => Some("KV events subscribed, no picture yet".to_owned()),
                Picture::Partial => Some(
                    "KV event history lost: the index holds part of the engine's cache".to_owned(),
                ),
                Picture::Exact => None,
            },
        }
    }
}

/// The last [`Freshness::CAPACITY`] freshness samples of one engine, in milliseconds.
#[derive(Clone, Debug, Default)]
pub struct Freshness {
    samples: std::collections::VecDeque<f64>,
}

impl Freshness {
    /// Samples kept, at most (the oldest go first).
    pub const CAPACITY: usize = 1024;

    pub(super) fn record(&mut self, ms: f64) {
        if self.samples.len() == Self::CAPACITY {
            self.samples.pop_front();
        }
        self.samples.push_back(ms);
    }

    /// Samples kept.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// The `q` quantile (0 to 1) of the kept samples, in milliseconds; `None` without samples.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let mut sorted: Vec<f64> = self.samples.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        let last = sorted.len().checked_sub(1)?;
        // Nearest rank: the smallest sample at or above the quantile.
        let rank = (q.clamp(0.0, 1.0) * last as f64).round() as usize;
        sorted.get(rank.min(last)).copied()
    }
}

impl EngineKvStatus {
    pub(super) fn live(&mut self, now: Instant) {
        self.received += 1;
        self.last_event = Some(now);
        self.awaiting_event_since = None;
    }

    /// How long a live batch has been owed past the staleness bound (`None`: it is not).
    pub fn owed_for(&self) -> Option<std::time::Duration> {
        let since = self.awaiting_event_since?;
        let waited = since.elapsed();
        (waited >= self.stale_after?).then_some(waited)
    }
}

/// Every engine feed's status, by engine (shared by the feeds and whoever reports them:
/// `/ready`, metrics, `serve --check-events`).
#[derive(Debug, Default)]
pub struct EngineKvBoard {
    engines: Mutex<BTreeMap<InstanceId, EngineKvStatus>>,
}

impl EngineKvBoard {
    /// The status of every engine with a feed.
    pub fn statuses(&self) -> BTreeMap<InstanceId, EngineKvStatus> {
        self.engines.lock().clone()
    }

    /// One engine's status.
    pub fn status(&self, engine: InstanceId) -> Option<EngineKvStatus> {
        self.engines.lock().get(&engine).cloned()
    }

    pub(crate) fn update(&self, engine: InstanceId, change: impl FnOnce(&mut EngineKvStatus)) {
        change(self.engines.lock().entry(engine).or_default());
    }

    /// How long a live batch has been owed by `engine` past the staleness bound (`None`: it is
    /// not): [`EngineKvStatus::owed_for`] without copying the status.
    pub(crate) fn owed_for(&self, engine: InstanceId) -> Option<std::time::Duration> {
        self.engines.lock().get(&engine)?.owed_for()
    }

    /// A prefill sent at `sent` stored new blocks on `engine`: a live batch is owed from now
    /// on, unless one already is, or one arrived since `sent` (the engine publishes as it
    /// stores, often before its answer is back). Only a subscribed feed is owed anything.
    pub(crate) fn expect_event(&self, engine: InstanceId, sent: Instant) {
        if let Some(status) = self.engines.lock().get_mut(&engine) {
            let came = status.last_event.is_some_and(|t| t >= sent);
            if status.state == FeedState::Subscribed
                && status.awaiting_event_since.is_none()
                && !came
            {
                status.awaiting_event_since = Some(Instant::now());
            }
        }
    }

    pub(crate) fn remove(&self, engine: InstanceId) {
        self.engines.lock().remove(&engine);
    }
}
