//! The library's own test engine: a prefill worker that answers one token with the
//! [`PrefillInfo`] naming it and, if asked, publishes the prompt's blocks as KV events. The
//! full mock engines (bounded caches, timing, decode) are `prefill_router_tools::mock`, which
//! unit tests here cannot use: that crate links its own copy of this library.

use std::sync::Arc;

use futures_util::stream;
use parking_lot::Mutex;

use crate::discovery::InstanceId;
use crate::kv_events::block_hashes;
use crate::kv_events::{EventBatch, EventPublisher};
use crate::request::{FinishReason, GenerateRequest, GenerateResponse, PrefillInfo};
use crate::transport::{Engine, EngineStream, KvEventSource};

/// A prefill worker known to discovery as its id.
pub(crate) struct TestPrefill {
    id: InstanceId,
    block_size: u32,
    /// Where the prompts' blocks are announced, for a worker built with events.
    events: Option<Mutex<EventPublisher>>,
}

impl TestPrefill {
    /// A prefill worker `id` over 16-token blocks.
    pub(crate) fn new(id: InstanceId) -> Arc<Self> {
        Arc::new(TestPrefill {
            id,
            block_size: 16,
            events: None,
        })
    }

    /// A prefill worker `id` over `block_size`-token blocks announcing every prompt's blocks
    /// as stored (incarnation `epoch`); serve it with `serve_with_kv_events`.
    pub(crate) fn with_kv_events(id: InstanceId, block_size: u32, epoch: u64) -> Arc<Self> {
        Arc::new(TestPrefill {
            id,
            block_size,
            events: Some(Mutex::new(EventPublisher::new(epoch))),
        })
    }
}

impl KvEventSource for TestPrefill {
    fn take_kv_events(&self) -> Vec<EventBatch> {
        self.events
            .as_ref()
            .map(|e| e.lock().take_batches())
            .unwrap_or_default()
    }
}

impl Engine for TestPrefill {
    fn generate(&self, request: GenerateRequest) -> EngineStream {
        if let Some(events) = &self.events {
            let mut events = events.lock();
            let mut parent = None;
            for hash in block_hashes(&request.token_ids, self.block_size) {
                events.stored(parent, hash);
                parent = Some(hash);
            }
        }
        let response = GenerateResponse {
            text: None,
            usage: None,
            token_ids: vec![0],
            finish: Some(FinishReason::Length),
            prefill: Some(PrefillInfo {
                engine_params: None,
                worker: self.id,
                prompt_tokens: u32::try_from(request.token_ids.len()).unwrap_or(u32::MAX),
                cached_blocks: 0,
                block_size: self.block_size,
            }),
        };
        Box::pin(stream::iter([Ok(response)]))
    }
}
