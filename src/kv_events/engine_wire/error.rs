//! Why a payload is not an engine KV event batch (the reader and the decoder share it).

#[cfg(doc)]
use super::limits::MAX_ENGINE_BATCH_BYTES;
use super::limits::{MAX_DEPTH, MAX_ENGINE_EVENTS, MAX_ENGINE_HASHES, MAX_ENGINE_TOKENS};

/// Why a payload is not an engine KV event batch.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EngineDecodeError {
    /// The payload is larger than [`MAX_ENGINE_BATCH_BYTES`].
    #[error("payload of {len} bytes (at most {max})")]
    Oversize {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The payload ended inside a value (or a length prefix exceeds the remaining input).
    #[error("truncated at byte {at}")]
    Truncated {
        /// Offset of the value that does not fit.
        at: usize,
    },
    /// The outer structure is not a batch.
    #[error("not a KV event batch: {0}")]
    NotABatch(&'static str),
    /// A skipped value nests deeper than [`MAX_DEPTH`].
    #[error("value nested deeper than {MAX_DEPTH} at byte {at}")]
    TooDeep {
        /// Offset where the limit was reached.
        at: usize,
    },
    /// More events than [`MAX_ENGINE_EVENTS`].
    #[error("{count} events in one batch (at most {MAX_ENGINE_EVENTS})")]
    TooManyEvents {
        /// The announced count.
        count: usize,
    },
    /// More block hashes than [`MAX_ENGINE_HASHES`] in one batch.
    #[error("more than {MAX_ENGINE_HASHES} block hashes in one batch")]
    TooManyHashes,
    /// More token ids than [`MAX_ENGINE_TOKENS`] in one batch.
    #[error("more than {MAX_ENGINE_TOKENS} token ids in one batch")]
    TooManyTokens,
    /// Bytes after the batch.
    #[error("trailing bytes from byte {at}")]
    TrailingBytes {
        /// Offset of the first trailing byte.
        at: usize,
    },
    /// The reserved marker byte 0xc1.
    #[error("bad msgpack marker {byte:#04x} at byte {at}")]
    BadMarker {
        /// Its offset.
        at: usize,
        /// The byte.
        byte: u8,
    },
}
