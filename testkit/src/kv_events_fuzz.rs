//! Fuzz target `kv_events`: arbitrary bytes, and encodings of well-formed KV event batches cut,
//! flipped or extended, through the pure decoder
//! [`decode_events`], then into a
//! [`KvIndex`].
//!
//! Checked on every input: no panic; a decoded batch is within the wire bounds and re-encodes
//! to a payload that decodes to the same batch; a well-formed batch's encoding decodes to
//! exactly that batch; decoding never holds more than [`proportional_bound`] of the payload
//! length at once (measured by the [`CountingAllocator`]); and after applying the batch the
//! index's scoring walk agrees with its per-worker count.
//!
//! [`CountingAllocator`]: crate::alloc_probe::CountingAllocator

use arbitrary::{Arbitrary, Unstructured};

use crate::alloc_probe::peak_bytes;
use prefill_router::kv_events::{
    decode_events, encode_events, EventBatch, EventDecodeError, KvEvent, KvIndex,
    MAX_BLOCKS_PER_BATCH, MAX_EVENTS_PER_BATCH,
};

/// One event, field by field (block hashes from a small domain so that batches overlap).
#[derive(Arbitrary, Clone, Debug)]
pub enum EventSeed {
    /// `KvEvent::Stored` (an empty chain becomes one block).
    Stored(Option<u64>, Vec<u8>),
    /// `KvEvent::Removed`.
    Removed(Vec<u8>),
    /// `KvEvent::Cleared`.
    Cleared,
}

/// A structure-aware `kv_events` input: a batch, and what to do to its encoding.
#[derive(Arbitrary, Clone, Debug)]
pub struct EventScript {
    /// The batch's epoch.
    pub epoch: u64,
    /// The batch's sequence number.
    pub seq: u64,
    /// Its events.
    pub events: Vec<EventSeed>,
    /// Keep only this many bytes of the encoding.
    pub keep: Option<u16>,
    /// Xor the byte at `.0` with `.1`.
    pub flip: Option<(u16, u8)>,
    /// Bytes appended after the (possibly cut) encoding.
    pub append: Vec<u8>,
}

impl EventScript {
    /// The batch this script stands for.
    pub fn batch(&self) -> EventBatch {
        let hashes = |b: &[u8]| b.iter().map(|&x| u64::from(x) * 0x9e37).collect::<Vec<_>>();
        EventBatch {
            epoch: self.epoch,
            seq: self.seq,
            events: self
                .events
                .iter()
                .take(MAX_EVENTS_PER_BATCH)
                .map(|e| match e {
                    EventSeed::Stored(parent, blocks) => KvEvent::Stored {
                        parent: *parent,
                        blocks: if blocks.is_empty() {
                            vec![1]
                        } else {
                            hashes(blocks)
                        },
                    },
                    EventSeed::Removed(blocks) => KvEvent::Removed {
                        blocks: hashes(blocks),
                    },
                    EventSeed::Cleared => KvEvent::Cleared,
                })
                .collect(),
        }
    }
}

/// The memory a decode may hold for a payload of `len` bytes: every hash is read from 8 input
/// bytes into 8 bytes of a `Vec` (events are at most 40 bytes from at least 1 input byte, and
/// `Vec` growth doubles), plus 4 KiB for fixed-size parts.
pub fn proportional_bound(len: usize) -> usize {
    80 * len + 4096
}

/// A payload decoder: [`decode_events`], or a mutant of it.
pub type Decoder = fn(&[u8]) -> Result<EventBatch, EventDecodeError>;

/// Decode one payload with `decoder` and check everything that must hold for any payload.
pub fn check_payload_with(payload: &[u8], decoder: Decoder) -> Result<Option<EventBatch>, String> {
    let (decoded, peak) = peak_bytes(|| decoder(payload));
    let Some(peak) = peak else {
        return Err(
            "kv_events needs testkit::alloc_probe::CountingAllocator as the global allocator"
                .to_owned(),
        );
    };
    if peak > proportional_bound(payload.len()) {
        return Err(format!(
            "decoding {} bytes held {peak} bytes at once, above {}",
            payload.len(),
            proportional_bound(payload.len())
        ));
    }
    let Ok(batch) = decoded else {
        return Ok(None);
    };
    if batch.events.len() > MAX_EVENTS_PER_BATCH || batch.block_count() > MAX_BLOCKS_PER_BATCH {
        return Err(format!("decoded a batch beyond the bounds: {batch:?}"));
    }
    let again = encode_events(&batch).map_err(|e| format!("{batch:?} does not re-encode: {e}"))?;
    let redecoded = decoder(&again);
    if redecoded.as_ref() != Ok(&batch) {
        return Err(format!("{batch:?} re-encoded decodes to {redecoded:?}"));
    }
    check_index(&batch)?;
    Ok(Some(batch))
}

/// Apply `batch` to an index as two workers (the second after a gap) and check that the
/// scoring walk agrees with each worker's leading count over the batch's stored blocks.
fn check_index(batch: &EventBatch) -> Result<(), String> {
    let mut index = KvIndex::new(MAX_BLOCKS_PER_BATCH);
    index.apply(1, batch);
    let mut later = batch.clone();
    later.seq = later.seq.wrapping_add(2);
    index.apply(2, batch);
    index.apply(2, &later);
    let request: Vec<u64> = batch
        .events
        .iter()
        .filter_map(|e| match e {
            KvEvent::Stored { blocks, .. } => Some(blocks.iter().copied()),
            _ => None,
        })
        .flatten()
        .take(64)
        .collect();
    let mut out = Vec::new();
    index.overlaps(&request, &mut out);
    for w in [1, 2] {
        let walked = out.iter().find(|o| o.0 == w).map_or(0, |o| o.1);
        if walked != index.overlap(&request, w) {
            return Err(format!(
                "worker {w}: walk says {walked}, count says {}",
                index.overlap(&request, w)
            ));
        }
    }
    Ok(())
}

/// Check one structure-aware script against `decoder`.
pub fn check_event_script_with(script: &EventScript, decoder: Decoder) -> Result<(), String> {
    let batch = script.batch();
    let Ok(mut bytes) = encode_events(&batch) else {
        // Beyond the bounds (too many blocks): the encoder refuses, nothing to decode.
        return Ok(());
    };
    match check_payload_with(&bytes, decoder)? {
        Some(decoded) if decoded == batch => {}
        other => return Err(format!("{batch:?} encoded decodes to {other:?}")),
    }
    if let Some(keep) = script.keep {
        bytes.truncate(usize::from(keep));
    }
    if let Some((at, mask)) = script.flip {
        if let Some(b) = bytes.get_mut(usize::from(at)) {
            *b ^= mask;
        }
    }
    bytes.extend_from_slice(&script.append);
    check_payload_with(&bytes, decoder).map(|_| ())
}

/// The `kv_events` harness: the raw bytes as a payload, then as a structure-aware script.
pub fn kv_events(bytes: &[u8]) {
    if let Err(e) = check_payload_with(bytes, decode_events) {
        panic!("kv_events (raw payload): {e}");
    }
    if let Ok(script) = EventScript::arbitrary_take_rest(Unstructured::new(bytes)) {
        if let Err(e) = check_event_script_with(&script, decode_events) {
            panic!("kv_events: {e}\nscript: {script:?}");
        }
    }
}

/// A mutant decoder that loses every Stored event's parent: the round-trip check must catch it
/// on a batch with a parent.
pub fn decode_events_dropping_parents(payload: &[u8]) -> Result<EventBatch, EventDecodeError> {
    let mut batch = decode_events(payload)?;
    for e in &mut batch.events {
        if let KvEvent::Stored { parent, .. } = e {
            *parent = None;
        }
    }
    Ok(batch)
}
