//! What a worker serves: LLM-shaped requests in, a stream of responses out.

use std::pin::Pin;

use crate::request::{GenerateRequest, GenerateResponse};
use futures_core::Stream;

/// An engine's failure, sent to the caller as a remote error.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("engine error: {message}")]
pub struct EngineError {
    /// Human-readable cause.
    pub message: String,
}

impl EngineError {
    /// An engine error with this message.
    pub fn new(message: impl Into<String>) -> Self {
        EngineError {
            message: message.into(),
        }
    }
}

/// The stream an engine returns. Dropping it must stop generation.
pub type EngineStream = Pin<Box<dyn Stream<Item = Result<GenerateResponse, EngineError>> + Send>>;

/// A model engine, served by a worker with [`serve`](crate::transport::serve).
///
/// Object-safe so a worker can hold an `Arc<dyn Engine>`. The work happens while the returned
/// stream is polled; the server drops the stream when the caller cancels or its deadline passes.
pub trait Engine: Send + Sync + 'static {
    /// Start generating for `request`.
    fn generate(&self, request: GenerateRequest) -> EngineStream;

    /// The prefill work `request` will cost this engine, in the unit of the frontends'
    /// bookings (prompt tokens it has to compute): what the worker's load reports count
    /// until the request's first response. Called just before [`generate`](Self::generate),
    /// only when the server publishes load reports. Default: the whole prompt; an engine with
    /// a prefix cache should answer its uncached tokens, as the KV dispatcher books them.
    fn prefill_work(&self, request: &GenerateRequest) -> u64 {
        request.token_ids.len() as u64
    }
}
