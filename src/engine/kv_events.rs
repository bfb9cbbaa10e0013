//! Engine KV events (feature `engine`): each engine's published cache changes (ZMQ, vLLM's
//! and SGLang's msgpack batches) kept exact by an [`EngineMirror`](crate::kv_events::EngineMirror) per engine and fed into the
//! dispatcher's KV index, so a KV-mode engine pool is scored by what each engine really caches
//! (docs/kv_events.md, "Engine events").
//!
//! - `sources.rs`: where an engine publishes (`GET /kv_event_sources`);
//! - `subscriber.rs`: one engine's feed, the driver loop around its mirror;
//! - `board.rs`: the [`EngineKvBoard`] the feeds write and the operator reads;
//! - `load_scraper.rs`: beside each feed, the engine's load from its `/metrics` when
//!   configured ([`crate::engine::load`]);
//! - here: `KvFeeds`, what the dispatcher's side (`push/dispatcher/engine_feeds.rs`, which
//!   keeps one feed per engine of the routable view) starts each engine's feed with.

mod board;
mod load_scraper;
pub(crate) mod metrics;
mod sources;
mod subscriber;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

pub use board::{EngineKvBoard, EngineKvStatus, FeedState, Freshness, LoadStatus};
pub use sources::{parse_sources, KvEventSource, SourceError};

use super::client::HttpClient;
use crate::discovery::Instance;
use crate::transport::KvEventSink;
pub(crate) use load_scraper::LoadSink;
use load_scraper::Scraper;

/// What starts one engine's feed: the link's HTTP client (to ask where the engine publishes),
/// its block size, and the board to report on. Cheap to clone.
#[derive(Clone)]
pub(crate) struct KvFeeds {
    pub(super) client: Arc<HttpClient>,
    pub(super) block_size: u32,
    pub(super) board: Arc<EngineKvBoard>,
}

impl KvFeeds {
    /// Run `instance`'s feed into `sink` until `cancel`, or until its events go stale (then the
    /// caller starts a new one); `epoch` numbers the feed's stream to the index (larger than
    /// any earlier feed's for the same worker). With a load interval configured, the engine's
    /// load scraper runs beside it into `load`.
    pub(crate) async fn run(
        self,
        instance: Arc<Instance>,
        epoch: u64,
        sink: Arc<dyn KvEventSink>,
        load: LoadSink,
        cancel: CancellationToken,
    ) {
        let scraper = self.client.config().load_interval.map(|interval| Scraper {
            instance: Arc::clone(&instance),
            interval,
            client: Arc::clone(&self.client),
            board: Arc::clone(&self.board),
            sink: load,
        });
        let feed = subscriber::Feed {
            instance,
            block_size: self.block_size,
            epoch,
            sink,
            board: self.board,
            client: self.client,
        };
        // The feed may end by itself (its events went stale): the scraper stops with it, and
        // the caller starts both afresh.
        let pair = cancel.child_token();
        let feed = async {
            feed.run(pair.clone()).await;
            pair.cancel();
        };
        match scraper {
            Some(scraper) => {
                tokio::join!(feed, scraper.run(pair.clone()));
            }
            None => feed.await,
        }
    }

    /// The engine left: its status goes from the board.
    pub(crate) fn forget(&self, engine: crate::discovery::InstanceId) {
        self.board.remove(engine);
    }
}
