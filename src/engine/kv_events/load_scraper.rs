//! One engine's load scraper: `GET /metrics` every interval, the reading handed to the
//! dispatcher's side (which turns it into the engine's reported others on its load board) and
//! shown on the engine's board entry. It decides nothing but staleness.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::board::EngineKvBoard;
use crate::discovery::Instance;
use crate::engine::client::HttpClient;
use crate::engine::load::{parse_load, LoadReading};

/// Where one engine's readings go (the dispatcher's KV feed: `KvFeed::engine_load`).
pub(crate) type LoadSink = Arc<dyn Fn(LoadReading) + Send + Sync>;

/// Everything one engine's scraper needs.
pub(super) struct Scraper {
    pub(super) instance: Arc<Instance>,
    pub(super) interval: Duration,
    pub(super) client: Arc<HttpClient>,
    pub(super) board: Arc<EngineKvBoard>,
    pub(super) sink: LoadSink,
}

/// Readings older than this many intervals are stale (a scrape that fails now and then is not).
const STALE_INTERVALS: u32 = 3;

impl Scraper {
    /// Scrape until `cancel`.
    pub(super) async fn run(self, cancel: CancellationToken) {
        let id = self.instance.instance_id;
        let addr = self.instance.address;
        let stale_after = self.interval.saturating_mul(STALE_INTERVALS);
        // Counted from the start: an engine whose metrics never answer turns stale too.
        let mut last_good = Instant::now();
        let mut stale = false;
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            // A scrape may take an interval at most (at least half a second): a hung `/metrics`
            // must not hold the readings back for the link's first-byte timeout.
            let bound = self.interval.max(Duration::from_millis(500));
            let answer = tokio::select! {
                () = cancel.cancelled() => return,
                answer = tokio::time::timeout(bound, self.client.get(addr, "/metrics")) => {
                    answer.map_err(|_| format!("no answer within {bound:?}")).and_then(|a| a.map_err(|e| e.to_string()))
                }
            };
            let reading = match answer {
                Ok(body) => {
                    last_good = Instant::now();
                    stale = false;
                    match parse_load(&String::from_utf8_lossy(&body)) {
                        Ok(load) => Some(LoadReading::Known(load)),
                        Err(error) => Some(LoadReading::Unknown(error.to_string())),
                    }
                }
                Err(error) => {
                    self.board.update(id, |s| s.load.failures += 1);
                    if !stale && last_good.elapsed() >= stale_after {
                        stale = true;
                        tracing::warn!(engine = id, %addr, %error, "engine load is stale: scored as saturated until its metrics answer");
                        Some(LoadReading::Stale)
                    } else {
                        tracing::debug!(engine = id, %addr, %error, "engine load scrape failed");
                        None
                    }
                }
            };
            if let Some(reading) = reading {
                (self.sink)(reading.clone());
                self.board.update(id, |s| {
                    s.load.scrapes += 1;
                    s.load.reading = Some(reading);
                    s.load.at = Some(Instant::now());
                });
            }
        }
    }
}
