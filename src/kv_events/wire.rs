//! The KV event wire format (version 1) and its pure decoder.
//!
//! A batch is one worker's cache changes, in the order they happened, with the worker's
//! sequence number. Layout, all integers little-endian:
//!
//! ```text
//! u8  version (= 1)
//! u64 epoch       the worker's incarnation: a restarted worker picks a new one
//! u64 seq         per worker and epoch, +1 per batch
//! u16 events      at most MAX_EVENTS_PER_BATCH
//! per event:
//!   u8 tag        0 = Stored, 1 = Removed, 2 = Cleared
//!   Stored:  u8 has_parent (0 or 1), [u64 parent], u16 n, n x u64 block hash
//!   Removed: u16 n, n x u64 block hash
//! ```
//!
//! A batch carries at most [`MAX_BLOCKS_PER_BATCH`] block hashes in all, so a batch is at most
//! about 33 KiB and decoding one allocates at most that (the counts are checked against the
//! remaining input before anything is reserved). Trailing bytes are an error: one payload is
//! exactly one batch.

use crate::kv_events::{EventBatch, KvEvent};

/// The wire format version this code writes and reads.
pub const WIRE_VERSION: u8 = 1;

/// Events in one batch, at most.
pub const MAX_EVENTS_PER_BATCH: usize = 1024;

/// Block hashes in one batch (over all its events), at most.
pub const MAX_BLOCKS_PER_BATCH: usize = 4096;

/// Why a payload is not a KV event batch.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EventDecodeError {
    /// The payload ended inside a field.
    #[error("truncated at byte {at}: {field} needs {need} more bytes")]
    Truncated {
        /// Offset where the field starts.
        at: usize,
        /// The field being read.
        field: &'static str,
        /// Bytes the field needs.
        need: usize,
    },
    /// A version this code does not read.
    #[error("unsupported KV event wire version {0} (this build reads {WIRE_VERSION})")]
    UnsupportedVersion(u8),
    /// More events than [`MAX_EVENTS_PER_BATCH`].
    #[error("{0} events in one batch (at most {MAX_EVENTS_PER_BATCH})")]
    TooManyEvents(usize),
    /// More block hashes than [`MAX_BLOCKS_PER_BATCH`].
    #[error("more than {MAX_BLOCKS_PER_BATCH} block hashes in one batch")]
    TooManyBlocks,
    /// An event tag that is not Stored, Removed or Cleared.
    #[error("unknown event tag {tag} at byte {at}")]
    UnknownTag {
        /// The tag.
        tag: u8,
        /// Its offset.
        at: usize,
    },
    /// A has-parent flag other than 0 or 1.
    #[error("bad parent flag {flag} at byte {at}")]
    BadParentFlag {
        /// The flag.
        flag: u8,
        /// Its offset.
        at: usize,
    },
    /// A Stored event without blocks.
    #[error("stored event without blocks at byte {at}")]
    EmptyStored {
        /// Offset of its tag.
        at: usize,
    },
    /// Bytes after the last event.
    #[error("{0} trailing bytes after the batch")]
    Trailing(usize),
}

/// Why a batch cannot be encoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EventEncodeError {
    /// More events than [`MAX_EVENTS_PER_BATCH`].
    #[error("{0} events in one batch (at most {MAX_EVENTS_PER_BATCH})")]
    TooManyEvents(usize),
    /// More block hashes than [`MAX_BLOCKS_PER_BATCH`].
    #[error("{0} block hashes in one batch (at most {MAX_BLOCKS_PER_BATCH})")]
    TooManyBlocks(usize),
    /// A Stored event without blocks.
    #[error("stored event without blocks")]
    EmptyStored,
}

const TAG_STORED: u8 = 0;
const TAG_REMOVED: u8 = 1;
const TAG_CLEARED: u8 = 2;

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], EventDecodeError> {
        let rest = &self.bytes[self.at..];
        if rest.len() < n {
            return Err(EventDecodeError::Truncated {
                at: self.at,
                field,
                need: n - rest.len(),
            });
        }
        self.at += n;
        Ok(&rest[..n])
    }

    fn u8(&mut self, field: &'static str) -> Result<u8, EventDecodeError> {
        Ok(self.take(1, field)?[0])
    }

    fn u16(&mut self, field: &'static str) -> Result<u16, EventDecodeError> {
        let b = self.take(2, field)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u64(&mut self, field: &'static str) -> Result<u64, EventDecodeError> {
        let b = self.take(8, field)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// `n` block hashes, checked against the remaining input before allocating.
    fn hashes(&mut self, n: usize) -> Result<Vec<u64>, EventDecodeError> {
        let bytes = self.take(n * 8, "block hashes")?;
        Ok(bytes
            .chunks_exact(8)
            .map(|c| {
                let mut a = [0u8; 8];
                a.copy_from_slice(c);
                u64::from_le_bytes(a)
            })
            .collect())
    }
}

/// Decode one KV event batch payload.
///
/// Pure and panic-free on any input; allocates at most a small multiple of the payload length
/// (every hash is read from 8 input bytes).
///
/// # Errors
/// [`EventDecodeError`] when the payload is not one well-formed version-1 batch within the
/// bounds.
pub fn decode_events(payload: &[u8]) -> Result<EventBatch, EventDecodeError> {
    let mut r = Reader {
        bytes: payload,
        at: 0,
    };
    let version = r.u8("version")?;
    if version != WIRE_VERSION {
        return Err(EventDecodeError::UnsupportedVersion(version));
    }
    let epoch = r.u64("epoch")?;
    let seq = r.u64("seq")?;
    let count = usize::from(r.u16("event count")?);
    if count > MAX_EVENTS_PER_BATCH {
        return Err(EventDecodeError::TooManyEvents(count));
    }
    let mut events = Vec::with_capacity(count.min(payload.len()));
    let mut blocks = 0usize;
    let mut budget = |n: usize| {
        blocks += n;
        if blocks > MAX_BLOCKS_PER_BATCH {
            Err(EventDecodeError::TooManyBlocks)
        } else {
            Ok(())
        }
    };
    for _ in 0..count {
        let at = r.at;
        let tag = r.u8("event tag")?;
        match tag {
            TAG_STORED => {
                let flag_at = r.at;
                let parent = match r.u8("parent flag")? {
                    0 => None,
                    1 => Some(r.u64("parent")?),
                    flag => return Err(EventDecodeError::BadParentFlag { flag, at: flag_at }),
                };
                let n = usize::from(r.u16("block count")?);
                if n == 0 {
                    return Err(EventDecodeError::EmptyStored { at });
                }
                budget(n)?;
                events.push(KvEvent::Stored {
                    parent,
                    blocks: r.hashes(n)?,
                });
            }
            TAG_REMOVED => {
                let n = usize::from(r.u16("block count")?);
                budget(n)?;
                events.push(KvEvent::Removed {
                    blocks: r.hashes(n)?,
                });
            }
            TAG_CLEARED => events.push(KvEvent::Cleared),
            tag => return Err(EventDecodeError::UnknownTag { tag, at }),
        }
    }
    let trailing = payload.len() - r.at;
    if trailing > 0 {
        return Err(EventDecodeError::Trailing(trailing));
    }
    Ok(EventBatch { epoch, seq, events })
}

/// Encode one batch (the inverse of [`decode_events`]).
///
/// # Errors
/// [`EventEncodeError`] when the batch exceeds the bounds or holds an empty Stored event (a
/// publisher splits its changes into batches within the bounds, see
/// [`EventBatch::split`](crate::kv_events::EventBatch)).
pub fn encode_events(batch: &EventBatch) -> Result<Vec<u8>, EventEncodeError> {
    if batch.events.len() > MAX_EVENTS_PER_BATCH {
        return Err(EventEncodeError::TooManyEvents(batch.events.len()));
    }
    let blocks = batch.block_count();
    if blocks > MAX_BLOCKS_PER_BATCH {
        return Err(EventEncodeError::TooManyBlocks(blocks));
    }
    let mut out = Vec::with_capacity(19 + batch.events.len() * 12 + blocks * 8);
    out.push(WIRE_VERSION);
    out.extend_from_slice(&batch.epoch.to_le_bytes());
    out.extend_from_slice(&batch.seq.to_le_bytes());
    // Both counts are within u16 by the bounds checked above.
    let count = |n: usize| u16::try_from(n).unwrap_or(u16::MAX).to_le_bytes();
    out.extend_from_slice(&count(batch.events.len()));
    for event in &batch.events {
        match event {
            KvEvent::Stored { parent, blocks } => {
                if blocks.is_empty() {
                    return Err(EventEncodeError::EmptyStored);
                }
                out.push(TAG_STORED);
                match parent {
                    Some(p) => {
                        out.push(1);
                        out.extend_from_slice(&p.to_le_bytes());
                    }
                    None => out.push(0),
                }
                out.extend_from_slice(&count(blocks.len()));
                for h in blocks {
                    out.extend_from_slice(&h.to_le_bytes());
                }
            }
            KvEvent::Removed { blocks } => {
                out.push(TAG_REMOVED);
                out.extend_from_slice(&count(blocks.len()));
                for h in blocks {
                    out.extend_from_slice(&h.to_le_bytes());
                }
            }
            KvEvent::Cleared => out.push(TAG_CLEARED),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> EventBatch {
        EventBatch {
            epoch: 7,
            seq: 3,
            events: vec![
                KvEvent::Stored {
                    parent: None,
                    blocks: vec![1, 2, 3],
                },
                KvEvent::Stored {
                    parent: Some(3),
                    blocks: vec![4],
                },
                KvEvent::Removed { blocks: vec![1] },
                KvEvent::Cleared,
            ],
        }
    }

    #[test]
    fn a_batch_round_trips_through_the_wire() {
        let batch = sample();
        let bytes = encode_events(&batch).unwrap();
        assert_eq!(decode_events(&bytes), Ok(batch));
    }

    #[test]
    fn every_truncation_of_a_batch_is_a_typed_error() {
        let bytes = encode_events(&sample()).unwrap();
        for cut in 0..bytes.len() {
            assert!(
                matches!(
                    decode_events(&bytes[..cut]),
                    Err(EventDecodeError::Truncated { .. })
                ),
                "cut at {cut}"
            );
        }
        let mut longer = bytes;
        longer.push(0);
        assert_eq!(decode_events(&longer), Err(EventDecodeError::Trailing(1)));
    }

    #[test]
    fn oversized_batches_are_refused_on_both_sides() {
        let big = EventBatch {
            epoch: 0,
            seq: 0,
            events: vec![KvEvent::Removed {
                blocks: vec![0; MAX_BLOCKS_PER_BATCH + 1],
            }],
        };
        assert!(matches!(
            encode_events(&big),
            Err(EventEncodeError::TooManyBlocks(_))
        ));
        // Hand-built: two Removed events of 4000 blocks each.
        let mut bytes = vec![WIRE_VERSION];
        bytes.extend_from_slice(&[0; 16]);
        bytes.extend_from_slice(&2u16.to_le_bytes());
        for _ in 0..2 {
            bytes.push(TAG_REMOVED);
            bytes.extend_from_slice(&4000u16.to_le_bytes());
            bytes.extend(std::iter::repeat_n(0u8, 4000 * 8));
        }
        assert_eq!(decode_events(&bytes), Err(EventDecodeError::TooManyBlocks));
        let mut many = vec![WIRE_VERSION];
        many.extend_from_slice(&[0; 16]);
        many.extend_from_slice(&u16::MAX.to_le_bytes());
        assert_eq!(
            decode_events(&many),
            Err(EventDecodeError::TooManyEvents(usize::from(u16::MAX)))
        );
    }

    #[test]
    fn other_versions_and_tags_are_refused() {
        let mut bytes = encode_events(&sample()).unwrap();
        bytes[0] = 2;
        assert_eq!(
            decode_events(&bytes),
            Err(EventDecodeError::UnsupportedVersion(2))
        );
        let mut bytes = encode_events(&sample()).unwrap();
        bytes[19] = 9; // the first event's tag
        assert!(matches!(
            decode_events(&bytes),
            Err(EventDecodeError::UnknownTag { tag: 9, at: 19 })
        ));
    }
}
