//! What an engine link hands back: the responses of one engine request.

use futures_util::stream::BoxStream;

use crate::request::GenerateResponse;
use crate::transport::TransportError;

/// The responses of one engine request.
pub type EngineStream = BoxStream<'static, Result<GenerateResponse, TransportError>>;
