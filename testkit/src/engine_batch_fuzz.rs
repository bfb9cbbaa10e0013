//! Fuzz target `engine_batch`: arbitrary bytes (and the captured vLLM payloads of the seed
//! corpus, mutated by the fuzzer) through the pure decoder of the engines' own msgpack KV event
//! batches, [`decode_engine_batch`].
//!
//! Checked on every input: no panic; decoding never holds more than [`proportional_bound`] of
//! the payload length at once (measured by the [`CountingAllocator`]); a decoded batch is within
//! the batch limits; its valid events re-encode, tagged and positional, to payloads that decode
//! to exactly those events (positional: without group and spec kind), the same timestamp bits
//! and rank, and nothing skipped.
//!
//! [`CountingAllocator`]: crate::alloc_probe::CountingAllocator

use crate::alloc_probe::peak_bytes;
use prefill_router::kv_events::{
    decode_engine_batch, encode_engine_batch, EngineBatch, EngineDecodeError, EngineEncoding,
    EngineEvent, MAX_ENGINE_EVENTS, MAX_ENGINE_HASHES, MAX_ENGINE_TOKENS,
};

/// The memory a decode may hold for a payload of `len` bytes: a hash or token is at most 8
/// bytes per input byte (reserved from a count checked against the input), an event at most
/// ~200 bytes (doubled by `Vec` growth) from at least 14 input bytes, plus 4 KiB.
pub fn proportional_bound(len: usize) -> usize {
    80 * len + 4096
}

/// A payload decoder: [`decode_engine_batch`], or a mutant of it.
pub type Decoder = fn(&[u8]) -> Result<EngineBatch, EngineDecodeError>;

fn valid(events: &[EngineEvent]) -> Vec<EngineEvent> {
    events
        .iter()
        .filter(|e| !matches!(e, EngineEvent::Invalid { .. }))
        .cloned()
        .collect()
}

/// What the positional form keeps of an event.
fn positional(event: &EngineEvent) -> EngineEvent {
    let mut event = event.clone();
    match &mut event {
        EngineEvent::Stored(b) => {
            b.group_idx = 0;
            b.spec_kind = None;
        }
        EngineEvent::Removed { group_idx, .. } => *group_idx = 0,
        EngineEvent::Cleared | EngineEvent::Invalid { .. } => {}
    }
    event
}

/// Decode one payload with `decoder` and check everything that must hold for any payload.
pub fn check_payload_with(payload: &[u8], decoder: Decoder) -> Result<Option<EngineBatch>, String> {
    let (decoded, peak) = peak_bytes(|| decoder(payload));
    let Some(peak) = peak else {
        return Err(
            "engine_batch needs testkit::alloc_probe::CountingAllocator as the global allocator"
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
    let (mut hashes, mut tokens) = (0, 0);
    for e in &batch.events {
        match e {
            EngineEvent::Stored(b) => {
                hashes += b.hashes.len();
                tokens += b.token_ids.len();
            }
            EngineEvent::Removed { hashes: h, .. } => hashes += h.len(),
            EngineEvent::Cleared | EngineEvent::Invalid { .. } => {}
        }
    }
    if batch.events.len() > MAX_ENGINE_EVENTS
        || hashes > MAX_ENGINE_HASHES
        || tokens > MAX_ENGINE_TOKENS
    {
        return Err(format!("decoded a batch beyond the limits: {batch:?}"));
    }
    let kept = valid(&batch.events);
    for encoding in [EngineEncoding::Tagged, EngineEncoding::Positional] {
        let want: Vec<EngineEvent> = match encoding {
            EngineEncoding::Tagged => kept.clone(),
            EngineEncoding::Positional => kept.iter().map(positional).collect(),
        };
        let again = decoder(&encode_engine_batch(&batch, encoding))
            .map_err(|e| format!("{batch:?} re-encoded {encoding:?} does not decode: {e}"))?;
        if again.events != want
            || again.ts.to_bits() != batch.ts.to_bits()
            || again.dp_rank != batch.dp_rank
            || again.skipped != Default::default()
        {
            return Err(format!(
                "{batch:?} re-encoded {encoding:?} decodes to {again:?}"
            ));
        }
    }
    Ok(Some(batch))
}

/// The `engine_batch` harness: the raw bytes as a payload.
pub fn engine_batch(bytes: &[u8]) {
    if let Err(e) = check_payload_with(bytes, decode_engine_batch) {
        panic!("engine_batch: {e}");
    }
}
