//! vLLM's and SGLang's KV cache event batches (msgpack), decoded and encoded without I/O.
//!
//! This is the engines' own format (`vllm/distributed/kv_events.py`, SGLang
//! `disaggregation/kv_events.py`), not this crate's [`wire`](super::wire) format. A batch is the
//! msgpack array `[ts, events, data_parallel_rank]` (older engines: `[ts, events]`). Each event is
//! either a map tagged by its `"type"` key (vLLM >= 0.32, SGLang; keys in any order, defaults
//! omitted) or a positional array `["BlockStored", block_hashes, parent_block_hash, token_ids,
//! block_size, lora_id, medium, ...]` (older vLLM). Real payloads
//! captured from vLLM 0.32.0, with their decoded form, are in `tests/fixtures/vllm_kv_events/`.
//!
//! Robustness rules: a batch fails as a whole only when its outer structure is broken
//! ([`EngineDecodeError`]). Unknown event types and unknown map keys are skipped and counted
//! ([`Skipped`]); a known event whose fields are unusable stays in place as
//! [`EngineEvent::Invalid`], so a consumer knows a cache change was lost. Decoding never
//! panics, checks every length prefix against the remaining input before reserving, bounds the
//! nesting it skips ([`MAX_DEPTH`]) and the batch's size and contents ([`MAX_ENGINE_BATCH_BYTES`],
//! [`MAX_ENGINE_EVENTS`], [`MAX_ENGINE_HASHES`], [`MAX_ENGINE_TOKENS`]): it holds at most a
//! small multiple of the payload length.

mod encode;
mod error;
mod limits;
mod msgpack;

pub use encode::encode_engine_batch;
pub use error::EngineDecodeError;
pub use limits::{
    MAX_DEPTH, MAX_ENGINE_BATCH_BYTES, MAX_ENGINE_EVENTS, MAX_ENGINE_HASHES, MAX_ENGINE_TOKENS,
};
use msgpack::{Head, Reader};

/// One decoded batch of an engine's KV cache events.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineBatch {
    /// The engine's timestamp (seconds since the epoch, as a float).
    pub ts: f64,
    /// The events, in wire order (unknown types left out, invalid ones kept in place).
    pub events: Vec<EngineEvent>,
    /// The data-parallel rank that published the batch (`None`: nil or absent).
    pub dp_rank: Option<u32>,
    /// What the decoder skipped (always zero for an encoded batch).
    pub skipped: Skipped,
}

/// Counts of what the decoder skipped in one batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Skipped {
    /// Events of a type this decoder does not know, or with no type at all.
    pub unknown_events: u32,
    /// Map keys of known events that this decoder does not know.
    pub unknown_fields: u32,
}

/// One KV cache event.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    /// `BlockStored`: blocks the engine now caches.
    Stored(StoredBlocks),
    /// `BlockRemoved`: blocks the engine evicted.
    Removed {
        /// The removed blocks' hashes.
        hashes: Vec<u64>,
        /// The KV cache group (0 for the main attention group).
        group_idx: u32,
        /// Where the blocks lived (`"GPU"`, ...), if said.
        medium: Option<String>,
    },
    /// `AllBlocksCleared`: the engine dropped its whole prefix cache.
    Cleared,
    /// A known event type whose fields are unusable (missing required field, wrong type, token
    /// id out of range...): kept in place so the consumer knows a change was lost.
    Invalid {
        /// The event's type.
        kind: EngineEventKind,
        /// Why its fields are unusable (the first problem found).
        reason: InvalidEvent,
    },
}

/// The fields of a `BlockStored` event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredBlocks {
    /// The stored blocks' hashes, in chain order.
    pub hashes: Vec<u64>,
    /// The hash of the block the first stored block extends (`None`: it starts a chain).
    pub parent: Option<u64>,
    /// The tokens of all stored blocks (vLLM: `block_size * hashes.len()` of them; not checked).
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// The LoRA adapter's id, if any.
    pub lora_id: Option<i64>,
    /// Where the blocks live (`"GPU"`, ...), if said.
    pub medium: Option<String>,
    /// The KV cache group (0 for the main attention group, also when absent).
    pub group_idx: u32,
    /// The group's KV cache spec (`"full_attention"`, `"sliding_window"`, ...), if said.
    pub spec_kind: Option<String>,
}

/// The type of a known event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineEventKind {
    /// `BlockStored`.
    Stored,
    /// `BlockRemoved`.
    Removed,
    /// `AllBlocksCleared`.
    Cleared,
}

/// Why a known event's fields are unusable.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InvalidEvent {
    /// A required field is absent.
    #[error("missing field {0}")]
    MissingField(&'static str),
    /// A field holds a value of the wrong msgpack type.
    #[error("field {field} has the wrong type")]
    WrongType {
        /// The field.
        field: &'static str,
    },
    /// An integer field does not fit its range (block size or group beyond u32, LoRA id
    /// beyond i64).
    #[error("field {field} is out of range")]
    OutOfRange {
        /// The field.
        field: &'static str,
    },
    /// A token id is negative or beyond u32.
    #[error("a token id is negative or beyond u32")]
    TokenOutOfRange,
    /// A string field is not UTF-8.
    #[error("field {field} is not UTF-8")]
    BadUtf8 {
        /// The field.
        field: &'static str,
    },
}

/// The event encoding [`encode_engine_batch`] writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineEncoding {
    /// Maps tagged by `"type"` (vLLM >= 0.32, SGLang).
    Tagged,
    /// Positional arrays (older vLLM): they cannot carry `group_idx` nor `spec_kind`.
    Positional,
}

type DecodeResult<T> = Result<T, EngineDecodeError>;
/// A field's value: outer `Err` breaks the batch, inner `Err` only the event.
type Field<T> = DecodeResult<Result<T, InvalidEvent>>;

// Nesting levels: the batch array is 0, the events array 1, an event 2, its values 3.
const EVENT_DEPTH: usize = 2;
const VALUE_DEPTH: usize = 3;

/// Decode one payload (the third ZMQ frame) into a batch.
pub fn decode_engine_batch(payload: &[u8]) -> Result<EngineBatch, EngineDecodeError> {
    if payload.len() > MAX_ENGINE_BATCH_BYTES {
        return Err(EngineDecodeError::Oversize {
            len: payload.len(),
            max: MAX_ENGINE_BATCH_BYTES,
        });
    }
    let mut d = Decoder {
        r: Reader::new(payload),
        hashes: 0,
        tokens: 0,
        skipped: Skipped::default(),
    };
    let Head::Array(fields @ 2..=3) = d.r.head()? else {
        return Err(EngineDecodeError::NotABatch(
            "not an array of 2 or 3 elements",
        ));
    };
    let ts = match d.r.head()? {
        Head::Float(f) => f,
        Head::Uint(u) => u as f64,
        Head::Neg(i) => i as f64,
        _ => return Err(EngineDecodeError::NotABatch("timestamp is not a number")),
    };
    let Head::Array(count) = d.r.head()? else {
        return Err(EngineDecodeError::NotABatch("events are not an array"));
    };
    if count > MAX_ENGINE_EVENTS {
        return Err(EngineDecodeError::TooManyEvents { count });
    }
    // Not reserved up front: most announced events may turn out unknown and small.
    let mut events = Vec::new();
    for _ in 0..count {
        if let Some(event) = d.event()? {
            events.push(event);
        }
    }
    let dp_rank =
        if fields == 3 {
            match d.r.head()? {
                Head::Nil => None,
                Head::Uint(u) => Some(u32::try_from(u).map_err(|_| {
                    EngineDecodeError::NotABatch("data_parallel_rank is beyond u32")
                })?),
                _ => {
                    return Err(EngineDecodeError::NotABatch(
                        "data_parallel_rank is not a u32",
                    ))
                }
            }
        } else {
            None
        };
    if d.r.remaining() > 0 {
        return Err(EngineDecodeError::TrailingBytes { at: d.r.pos() });
    }
    Ok(EngineBatch {
        ts,
        events,
        dp_rank,
        skipped: d.skipped,
    })
}

struct Decoder<'a> {
    r: Reader<'a>,
    hashes: usize,
    tokens: usize,
    skipped: Skipped,
}

/// The fields a map event may carry, collected in any order; the type decides at the end which
/// ones count.
#[derive(Default)]
struct Scratch {
    kind: Option<Option<EngineEventKind>>,
    hashes: Option<Result<Vec<u64>, InvalidEvent>>,
    parent: Option<Result<Option<u64>, InvalidEvent>>,
    tokens: Option<Result<Vec<u32>, InvalidEvent>>,
    block_size: Option<Result<u32, InvalidEvent>>,
    lora_id: Option<Result<Option<i64>, InvalidEvent>>,
    medium: Option<Result<Option<String>, InvalidEvent>>,
    group_idx: Option<Result<u32, InvalidEvent>>,
    spec_kind: Option<Result<Option<String>, InvalidEvent>>,
    /// Keys of `BlockStored` only (token_ids, parent_block_hash, ... and the ignored ones):
    /// unknown fields when the event is a `BlockRemoved`.
    stored_only: u32,
    /// Keys nobody knows.
    unknown: u32,
}

/// Keys only `BlockStored` carries: unknown fields in any other event.
const STORED_ONLY: [&[u8]; 10] = [
    b"parent_block_hash",
    b"token_ids",
    b"block_size",
    b"lora_id",
    b"kv_cache_spec_kind",
    b"lora_name",
    b"extra_keys",
    b"kv_cache_spec_sliding_window",
    b"session_id",
    b"cache_salt",
];

fn kind_of(name: &[u8]) -> Option<EngineEventKind> {
    match name {
        b"BlockStored" => Some(EngineEventKind::Stored),
        b"BlockRemoved" => Some(EngineEventKind::Removed),
        b"AllBlocksCleared" => Some(EngineEventKind::Cleared),
        _ => None,
    }
}

impl Decoder<'_> {
    /// One event: `None` when it is of an unknown type (counted).
    fn event(&mut self) -> DecodeResult<Option<EngineEvent>> {
        let event = match self.r.head()? {
            Head::Map(n) => self.map_event(n)?,
            Head::Array(n) => self.positional_event(n)?,
            other => {
                self.r.skip_rest(other, EVENT_DEPTH)?;
                None
            }
        };
        if event.is_none() {
            self.skipped.unknown_events += 1;
        }
        Ok(event)
    }

    fn map_event(&mut self, entries: usize) -> DecodeResult<Option<EngineEvent>> {
        let mut s = Scratch::default();
        for _ in 0..entries {
            let key = self.r.head()?;
            let Head::Str(key) = key else {
                self.r.skip_rest(key, VALUE_DEPTH)?;
                self.r.skip(VALUE_DEPTH)?;
                s.unknown += 1;
                continue;
            };
            // A repeated key: the last value wins.
            match key {
                b"type" => {
                    s.kind = Some(match self.r.head()? {
                        Head::Str(name) => kind_of(name),
                        other => {
                            self.r.skip_rest(other, VALUE_DEPTH)?;
                            None
                        }
                    })
                }
                b"block_hashes" => s.hashes = Some(self.hashes("block_hashes")?),
                b"medium" => s.medium = Some(self.opt_str("medium")?),
                b"group_idx" => s.group_idx = Some(self.u32("group_idx")?),
                b"locality" | b"ownership" => self.r.skip(VALUE_DEPTH)?,
                b"parent_block_hash" => s.parent = Some(self.opt_hash("parent_block_hash")?),
                b"token_ids" => s.tokens = Some(self.tokens()?),
                b"block_size" => s.block_size = Some(self.u32("block_size")?),
                b"lora_id" => s.lora_id = Some(self.opt_i64("lora_id")?),
                b"kv_cache_spec_kind" => s.spec_kind = Some(self.opt_str("kv_cache_spec_kind")?),
                // Known and deliberately ignored: LoRA name, per-block extra keys, window,
                // session and SGLang's cache salt.
                b"lora_name"
                | b"extra_keys"
                | b"kv_cache_spec_sliding_window"
                | b"session_id"
                | b"cache_salt" => self.r.skip(VALUE_DEPTH)?,
                _ => {
                    s.unknown += 1;
                    self.r.skip(VALUE_DEPTH)?;
                    continue;
                }
            }
            if STORED_ONLY.contains(&key) {
                s.stored_only += 1;
            }
        }
        let Some(Some(kind)) = s.kind else {
            return Ok(None);
        };
        let extra = match kind {
            EngineEventKind::Stored => 0,
            _ => s.stored_only,
        };
        self.skipped.unknown_fields = self
            .skipped
            .unknown_fields
            .saturating_add(s.unknown.saturating_add(extra));
        Ok(Some(match kind {
            EngineEventKind::Cleared => EngineEvent::Cleared,
            EngineEventKind::Removed => assemble(kind, || {
                Ok(EngineEvent::Removed {
                    hashes: required(s.hashes, "block_hashes")?,
                    medium: s.medium.unwrap_or(Ok(None))?,
                    group_idx: s.group_idx.unwrap_or(Ok(0))?,
                })
            }),
            EngineEventKind::Stored => assemble(kind, || {
                Ok(EngineEvent::Stored(StoredBlocks {
                    hashes: required(s.hashes, "block_hashes")?,
                    parent: s.parent.unwrap_or(Ok(None))?,
                    token_ids: required(s.tokens, "token_ids")?,
                    block_size: required(s.block_size, "block_size")?,
                    lora_id: s.lora_id.unwrap_or(Ok(None))?,
                    medium: s.medium.unwrap_or(Ok(None))?,
                    group_idx: s.group_idx.unwrap_or(Ok(0))?,
                    spec_kind: s.spec_kind.unwrap_or(Ok(None))?,
                }))
            }),
        }))
    }

    /// `[type, fields...]`; fields beyond the ones read here (newer positional versions) are
    /// skipped without being counted.
    fn positional_event(&mut self, n: usize) -> DecodeResult<Option<EngineEvent>> {
        let kind = if n == 0 {
            None
        } else {
            match self.r.head()? {
                Head::Str(name) => kind_of(name),
                other => {
                    self.r.skip_rest(other, VALUE_DEPTH)?;
                    None
                }
            }
        };
        let mut left = n.saturating_sub(1);
        let event = match kind {
            None => None,
            Some(EngineEventKind::Cleared) => Some(EngineEvent::Cleared),
            Some(EngineEventKind::Removed) => {
                let hashes = self.next(&mut left, "block_hashes", Self::hashes)?;
                let medium = self.next(&mut left, "medium", Self::opt_str)?;
                Some(assemble(EngineEventKind::Removed, || {
                    Ok(EngineEvent::Removed {
                        hashes: required(hashes, "block_hashes")?,
                        medium: medium.unwrap_or(Ok(None))?,
                        group_idx: 0,
                    })
                }))
            }
            Some(EngineEventKind::Stored) => {
                let hashes = self.next(&mut left, "block_hashes", Self::hashes)?;
                let parent = self.next(&mut left, "parent_block_hash", Self::opt_hash)?;
                let tokens = self.next(&mut left, "token_ids", |d, _| d.tokens())?;
                let block_size = self.next(&mut left, "block_size", Self::u32)?;
                let lora_id = self.next(&mut left, "lora_id", Self::opt_i64)?;
                let medium = self.next(&mut left, "medium", Self::opt_str)?;
                Some(assemble(EngineEventKind::Stored, || {
                    Ok(EngineEvent::Stored(StoredBlocks {
                        hashes: required(hashes, "block_hashes")?,
                        parent: required(parent, "parent_block_hash")?,
                        token_ids: required(tokens, "token_ids")?,
                        block_size: required(block_size, "block_size")?,
                        lora_id: lora_id.unwrap_or(Ok(None))?,
                        medium: medium.unwrap_or(Ok(None))?,
                        group_idx: 0,
                        spec_kind: None,
                    }))
                }))
            }
        };
        for _ in 0..left {
            self.r.skip(VALUE_DEPTH)?;
        }
        Ok(event)
    }

    /// The next positional field, if the array has one left.
    fn next<T>(
        &mut self,
        left: &mut usize,
        field: &'static str,
        read: impl FnOnce(&mut Self, &'static str) -> Field<T>,
    ) -> DecodeResult<Option<Result<T, InvalidEvent>>> {
        if *left == 0 {
            return Ok(None);
        }
        *left -= 1;
        read(self, field).map(Some)
    }

    /// A value of the wrong type: skip what is left of it.
    fn wrong<T>(&mut self, head: Head<'_>, field: &'static str) -> Field<T> {
        self.r.skip_rest(head, VALUE_DEPTH)?;
        Ok(Err(InvalidEvent::WrongType { field }))
    }

    fn hashes(&mut self, field: &'static str) -> Field<Vec<u64>> {
        let head = self.r.head()?;
        let Head::Array(n) = head else {
            return self.wrong(head, field);
        };
        self.hashes = self.hashes.saturating_add(n);
        if self.hashes > MAX_ENGINE_HASHES {
            return Err(EngineDecodeError::TooManyHashes);
        }
        // `n` <= remaining input bytes (checked by the reader), so this reserve is bounded.
        let mut out = Ok(Vec::with_capacity(n));
        for _ in 0..n {
            let h = self.r.head()?;
            match (hash_of(h), &mut out) {
                (Some(h), Ok(v)) => v.push(h),
                (Some(_), Err(_)) => {}
                (None, _) => {
                    self.r.skip_rest(h, VALUE_DEPTH + 1)?;
                    out = Err(InvalidEvent::WrongType { field });
                }
            }
        }
        Ok(out)
    }

    fn opt_hash(&mut self, field: &'static str) -> Field<Option<u64>> {
        match self.r.head()? {
            Head::Nil => Ok(Ok(None)),
            head => match hash_of(head) {
                Some(h) => Ok(Ok(Some(h))),
                None => self.wrong(head, field),
            },
        }
    }

    fn tokens(&mut self) -> Field<Vec<u32>> {
        let head = self.r.head()?;
        let Head::Array(n) = head else {
            return self.wrong(head, "token_ids");
        };
        self.tokens = self.tokens.saturating_add(n);
        if self.tokens > MAX_ENGINE_TOKENS {
            return Err(EngineDecodeError::TooManyTokens);
        }
        let mut out = Ok(Vec::with_capacity(n));
        for _ in 0..n {
            let t = match self.r.head()? {
                Head::Uint(u) => u32::try_from(u).map_err(|_| InvalidEvent::TokenOutOfRange),
                Head::Neg(_) => Err(InvalidEvent::TokenOutOfRange),
                other => {
                    // E.g. SGLang's `[t, t+1]` pairs under Eagle bigram hashing.
                    self.r.skip_rest(other, VALUE_DEPTH + 1)?;
                    Err(InvalidEvent::WrongType { field: "token_ids" })
                }
            };
            match (t, &mut out) {
                (Ok(t), Ok(v)) => v.push(t),
                (Err(e), Ok(_)) => out = Err(e),
                (_, Err(_)) => {}
            }
        }
        Ok(out)
    }

    fn u32(&mut self, field: &'static str) -> Field<u32> {
        match self.r.head()? {
            Head::Uint(u) => Ok(u32::try_from(u).map_err(|_| InvalidEvent::OutOfRange { field })),
            Head::Neg(_) => Ok(Err(InvalidEvent::OutOfRange { field })),
            other => self.wrong(other, field),
        }
    }

    fn opt_i64(&mut self, field: &'static str) -> Field<Option<i64>> {
        match self.r.head()? {
            Head::Nil => Ok(Ok(None)),
            Head::Neg(i) => Ok(Ok(Some(i))),
            Head::Uint(u) => Ok(i64::try_from(u)
                .map(Some)
                .map_err(|_| InvalidEvent::OutOfRange { field })),
            other => self.wrong(other, field),
        }
    }

    fn opt_str(&mut self, field: &'static str) -> Field<Option<String>> {
        match self.r.head()? {
            Head::Nil => Ok(Ok(None)),
            Head::Str(s) => Ok(std::str::from_utf8(s)
                .map(|s| Some(s.to_owned()))
                .map_err(|_| InvalidEvent::BadUtf8 { field })),
            other => self.wrong(other, field),
        }
    }
}

/// A block hash: vLLM's uint, SGLang's signed i64 (bit cast), or a digest as bin: its last
/// min(8, len) bytes read big-endian (vLLM's int form of a 32-byte digest is its last 8 bytes).
fn hash_of(head: Head<'_>) -> Option<u64> {
    match head {
        Head::Uint(u) => Some(u),
        Head::Neg(i) => Some(i as u64),
        Head::Bin(b) => Some(
            b[b.len().saturating_sub(8)..]
                .iter()
                .fold(0, |acc, &x| (acc << 8) | u64::from(x)),
        ),
        _ => None,
    }
}

fn required<T>(
    field: Option<Result<T, InvalidEvent>>,
    name: &'static str,
) -> Result<T, InvalidEvent> {
    field.unwrap_or(Err(InvalidEvent::MissingField(name)))
}

fn assemble(
    kind: EngineEventKind,
    build: impl FnOnce() -> Result<EngineEvent, InvalidEvent>,
) -> EngineEvent {
    build().unwrap_or_else(|reason| EngineEvent::Invalid { kind, reason })
}

#[cfg(test)]
mod tests;
