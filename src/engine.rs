//! Engines behind the hop over HTTP (feature `engine`): [`EngineLink`], which carries a
//! dispatcher's attempts (it is a [`WorkerLink`](crate::push::WorkerLink)) to
//! OpenAI-compatible engines in their disaggregated protocol (today vLLM's, docs/engines.md).
//!
//! An engine is one more worker behind the seams the hop already has: discovery finds it (its
//! card says [`EngineProtocol`](crate::advert::EngineProtocol)), the dispatcher picks it, and
//! this link only translates one attempt into HTTP and the engine's answer into
//! [`GenerateResponse`]s. It decides nothing: no retry, no
//! pick, no breaker (the dispatcher does all three from the error's class).
//!
//! - `client.rs`: the pooled keep-alive HTTP/1.1 client and its connect, first-byte and idle
//!   timeouts;
//! - `load.rs`: the engines' own load, scraped from `/metrics` (off by default);
//! - `vllm.rs`: the request bodies of both legs and the parsing of vLLM's answers (the prefill's
//!   JSON, the decode's server-sent events).

mod client;
pub mod kv_events;
pub mod load;
mod stream;
mod vllm;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::time::Instant;

use crate::discovery::{Instance, InstanceId};
use crate::request::GenerateRequest;
#[cfg(doc)]
use crate::request::GenerateResponse;
use crate::transport::TransportError;

pub use client::{EngineLinkConfig, DEFAULT_CONNECT_TIMEOUT};
pub use kv_events::{EngineKvBoard, EngineKvStatus, FeedState, LoadStatus};
pub use load::{parse_load, EngineLoad, LoadError, LoadReading};
pub use stream::EngineStream;

/// Which leg of the disaggregated protocol a link carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EngineRole {
    /// Prefill: the prompt with `max_tokens` 1, not streamed, asking for a handoff
    /// (`kv_transfer_params.do_remote_decode`); the answer's handoff kept opaque.
    Prefill,
    /// Decode: the request with its handoff verbatim (or none: the engine prefills itself),
    /// streamed.
    Decode,
}

/// What the engine links counted (shared by every link of one frontend, or per link).
#[derive(Debug, Default)]
pub struct EngineCounts {
    /// Requests sent to an engine.
    pub requests: AtomicU64,
    /// Prefills answered 200 without `kv_transfer_params`: decode recomputes the prompt.
    pub prefill_without_handoff: AtomicU64,
    /// Answers that could not be used (non-2xx, malformed, cut short, timed out).
    pub failed: AtomicU64,
}

impl EngineCounts {
    fn bump(counter: &AtomicU64) {
        // Relaxed: independent statistics.
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// A [`WorkerLink`](crate::push::WorkerLink) to engines over HTTP for one leg (see the module docs).
pub struct EngineLink {
    client: Arc<client::HttpClient>,
    role: EngineRole,
    /// The engines' KV block size in tokens (the card's), to report cached blocks.
    block_size: u32,
    counts: Arc<EngineCounts>,
    /// Request ids sent as `X-Request-Id` (the engine logs them; unique per process).
    next_id: AtomicU64,
    /// The engines' KV event feeds, as the operator reads them.
    kv_board: Arc<EngineKvBoard>,
    /// Stops the feeds when the link (its dispatcher) drops (KV mode only).
    _feeds: Option<tokio_util::sync::DropGuard>,
}

impl std::fmt::Debug for EngineLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineLink")
            .field("role", &self.role)
            .field("block_size", &self.block_size)
            .finish_non_exhaustive()
    }
}

impl EngineLink {
    /// A link for `role` to engines whose KV blocks hold `block_size` tokens.
    pub fn new(role: EngineRole, block_size: u32, config: EngineLinkConfig) -> Self {
        EngineLink {
            client: Arc::new(client::HttpClient::new(config)),
            role,
            block_size,
            counts: Arc::default(),
            next_id: AtomicU64::new(0),
            kv_board: Arc::default(),
            _feeds: None,
        }
    }

    /// Report the engines' KV event feeds on `board` (shared, e.g. by every link of one
    /// frontend) instead of the link's own.
    #[must_use]
    pub fn with_kv_board(mut self, board: Arc<EngineKvBoard>) -> Self {
        self.kv_board = board;
        self
    }

    /// The engines' KV event feeds (KV mode only; empty otherwise).
    pub fn kv_board(&self) -> &Arc<EngineKvBoard> {
        &self.kv_board
    }

    /// What starts each engine's KV event feed (the dispatcher keeps one per engine of its
    /// view in KV mode: `push/dispatcher/engine_feeds.rs`).
    pub(crate) fn kv_feeds(&self) -> kv_events::KvFeeds {
        kv_events::KvFeeds {
            client: Arc::clone(&self.client),
            block_size: self.block_size,
            board: Arc::clone(&self.kv_board),
        }
    }

    /// Keep the feeds' supervisor running as long as the link: it stops when `guard` drops.
    pub(crate) fn keep_feeds(&mut self, guard: Option<tokio_util::sync::DropGuard>) {
        self._feeds = guard;
    }

    /// Count in `counts` (shared, e.g. by every link of one frontend) instead of its own.
    #[must_use]
    pub fn with_counts(mut self, counts: Arc<EngineCounts>) -> Self {
        self.counts = counts;
        self
    }

    /// The link's counters.
    pub fn counts(&self) -> &Arc<EngineCounts> {
        &self.counts
    }

    /// The leg it carries.
    pub fn role(&self) -> EngineRole {
        self.role
    }

    fn request_id(&self) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("pr-{:x}-{n}", std::process::id())
    }

    async fn send(
        &self,
        worker: InstanceId,
        addr: SocketAddr,
        request: GenerateRequest,
        deadline: Option<Instant>,
    ) -> Result<EngineStream, TransportError> {
        EngineCounts::bump(&self.counts.requests);
        let id = self.request_id();
        match self.role {
            EngineRole::Prefill => {
                let body = vllm::prefill_body(&request)?;
                let sent = Instant::now();
                let answer = self
                    .client
                    .post_json(addr, "/v1/completions", &id, body, deadline)
                    .await?;
                let bytes = answer.collect(addr, deadline).await?;
                let response = vllm::prefill_answer(addr, worker, self.block_size, &bytes)?;
                // Full prompt blocks the engine did not have: it stored them, and its KV events
                // owe the router a batch saying so (the staleness check's evidence).
                let full = request.token_ids.len() / self.block_size.max(1) as usize;
                let cached = response
                    .prefill
                    .as_ref()
                    .map_or(0, |p| p.cached_blocks as usize);
                if full > cached {
                    self.kv_board.expect_event(worker, sent);
                }
                let has_handoff = response
                    .prefill
                    .as_ref()
                    .is_some_and(|p| p.engine_params.is_some());
                if !has_handoff {
                    EngineCounts::bump(&self.counts.prefill_without_handoff);
                    tracing::warn!(%addr, "prefill answered without kv_transfer_params: decode recomputes the prompt");
                }
                Ok(Box::pin(futures_util::stream::iter([Ok(response)])))
            }
            EngineRole::Decode => {
                let body = vllm::decode_body(&request)?;
                let answer = self
                    .client
                    .post_json(addr, "/v1/completions", &id, body, deadline)
                    .await?;
                Ok(vllm::decode_stream(answer, addr, deadline))
            }
        }
    }
}

impl EngineLink {
    /// The link's half of [`WorkerLink::open`](crate::push::WorkerLink::open) (the
    /// dispatcher's seam is implemented with it): send `request` to `instance` and return its
    /// responses, or the typed reason it could not be sent. A failure to connect sent nothing;
    /// every other failure may have reached the engine.
    pub async fn send_to(
        &self,
        instance: &Instance,
        request: GenerateRequest,
        deadline: Option<Instant>,
    ) -> Result<EngineStream, TransportError> {
        let sent = self
            .send(instance.instance_id, instance.address, request, deadline)
            .await;
        if sent.is_err() {
            EngineCounts::bump(&self.counts.failed);
        }
        sent
    }
}
