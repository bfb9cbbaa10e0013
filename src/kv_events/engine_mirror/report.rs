//! What the mirror tells its operator: how far its picture can be trusted, why events could
//! not be indexed, and what it counted.

/// How far the router's picture of one rank (or engine) can be trusted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Picture {
    /// Nothing seen yet: the engine is scored by load, not by its cache.
    #[default]
    Unknown,
    /// Every block the engine holds is indexed (up to the last batch applied).
    Exact,
    /// A subset of what the engine holds (history was lost); never a block it does not hold.
    Partial,
}

/// Why an engine's events could not all be indexed (counted in [`MirrorCounts`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MirrorError {
    /// The engine's blocks have another size than its card says: the router hashes prompts at
    /// the card's size, so no block of this engine could ever match.
    #[error("engine block size {engine} differs from the card's {card}")]
    BlockSizeMismatch {
        /// The card's block size.
        card: u32,
        /// The size in the engine's events.
        engine: u32,
    },
    /// A stored chain's token count is not its blocks times the block size.
    #[error("{tokens} tokens for {blocks} blocks of {block_size}")]
    TokenCount {
        /// Tokens in the event.
        tokens: usize,
        /// Blocks in the event.
        blocks: usize,
        /// The event's block size.
        block_size: u32,
    },
    /// A stored chain extends a block the mirror does not know (its store was lost).
    #[error("stored chain extends unknown block {0:#x}")]
    UnknownParent(u64),
}

/// What one mirror counted (plain numbers: the subscriber exports them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MirrorCounts {
    /// Engine batches applied (live or replayed).
    pub batches: u64,
    /// Events applied.
    pub events: u64,
    /// Batches that arrived through a replay and were applied.
    pub replayed: u64,
    /// Gaps seen (a sequence number skipped on the live stream).
    pub gaps: u64,
    /// Gaps a replay could not fill: the rank was dropped and rebuilt.
    pub rebuilds: u64,
    /// Restarts seen (a rank's sequence number went back).
    pub restarts: u64,
    /// Duplicate batches ignored (already applied, e.g. both replayed and live).
    pub duplicates: u64,
    /// Events not indexed: unknown types, other attention groups, LoRA blocks, invalid ones.
    pub skipped_events: u64,
    /// Unknown fields the decoder skipped.
    pub skipped_fields: u64,
    /// Stored chains refused for a block size that is not the card's.
    pub block_size_mismatches: u64,
    /// Stored chains refused for a token count that does not fit their blocks.
    pub token_mismatches: u64,
    /// Stored chains refused because their parent was unknown.
    pub unknown_parents: u64,
    /// Removals of blocks the mirror did not hold (harmless: never credited).
    pub unknown_removals: u64,
}
