//! The decoder's bounds: what one batch may hold, at most.

/// Largest payload `decode_engine_batch` reads.
pub const MAX_ENGINE_BATCH_BYTES: usize = 8 << 20;
/// Events (of any type, unknown ones included) in one batch, at most.
pub const MAX_ENGINE_EVENTS: usize = 4096;
/// Block hashes in one batch, over all its events, at most.
pub const MAX_ENGINE_HASHES: usize = 65_536;
/// Token ids in one batch, over all its events, at most.
pub const MAX_ENGINE_TOKENS: usize = 1 << 22;
/// Deepest nesting of a value the decoder skips (the batch array is level 0).
pub const MAX_DEPTH: usize = 32;
