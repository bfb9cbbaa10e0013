//! The encoder: the shapes vLLM writes, tagged or positional.

use super::msgpack::Writer;
use super::{EngineBatch, EngineEncoding, EngineEvent};

/// Encode `batch` as an engine would: `[ts, events, dp_rank or nil]`, events as tagged maps
/// (`"type"` first, required fields always present, `group_idx` and `kv_cache_spec_kind` written)
/// or as the older positional arrays (which drop `group_idx` and `spec_kind`).
/// [`EngineEvent::Invalid`] events carry no fields to write and are left out; `skipped` is not
/// written.
pub fn encode_engine_batch(batch: &EngineBatch, encoding: EngineEncoding) -> Vec<u8> {
    let mut w = Writer(Vec::new());
    w.array(3);
    w.f64(batch.ts);
    let valid = |e: &&EngineEvent| !matches!(e, EngineEvent::Invalid { .. });
    w.array(batch.events.iter().filter(valid).count());
    for event in batch.events.iter().filter(valid) {
        match encoding {
            EngineEncoding::Tagged => tagged(&mut w, event),
            EngineEncoding::Positional => positional(&mut w, event),
        }
    }
    match batch.dp_rank {
        Some(r) => w.uint(u64::from(r)),
        None => w.nil(),
    }
    w.0
}

fn write_hashes(w: &mut Writer, hashes: &[u64]) {
    w.array(hashes.len());
    hashes.iter().for_each(|&h| w.uint(h));
}

fn write_parent(w: &mut Writer, parent: Option<u64>) {
    match parent {
        Some(p) => w.uint(p),
        None => w.nil(),
    }
}

fn write_tokens(w: &mut Writer, tokens: &[u32]) {
    w.array(tokens.len());
    tokens.iter().for_each(|&t| w.uint(u64::from(t)));
}

fn write_lora(w: &mut Writer, lora_id: Option<i64>) {
    match lora_id {
        Some(l) => w.int(l),
        None => w.nil(),
    }
}

fn tagged(w: &mut Writer, event: &EngineEvent) {
    match event {
        EngineEvent::Stored(s) => {
            w.map(9);
            w.str("type");
            w.str("BlockStored");
            w.str("block_hashes");
            write_hashes(w, &s.hashes);
            w.str("parent_block_hash");
            write_parent(w, s.parent);
            w.str("token_ids");
            write_tokens(w, &s.token_ids);
            w.str("block_size");
            w.uint(u64::from(s.block_size));
            w.str("lora_id");
            write_lora(w, s.lora_id);
            w.str("medium");
            w.opt_str(s.medium.as_deref());
            w.str("group_idx");
            w.uint(u64::from(s.group_idx));
            w.str("kv_cache_spec_kind");
            w.opt_str(s.spec_kind.as_deref());
        }
        EngineEvent::Removed {
            hashes,
            group_idx,
            medium,
        } => {
            w.map(4);
            w.str("type");
            w.str("BlockRemoved");
            w.str("block_hashes");
            write_hashes(w, hashes);
            w.str("medium");
            w.opt_str(medium.as_deref());
            w.str("group_idx");
            w.uint(u64::from(*group_idx));
        }
        EngineEvent::Cleared => {
            w.map(1);
            w.str("type");
            w.str("AllBlocksCleared");
        }
        EngineEvent::Invalid { .. } => {}
    }
}

fn positional(w: &mut Writer, event: &EngineEvent) {
    match event {
        EngineEvent::Stored(s) => {
            w.array(7);
            w.str("BlockStored");
            write_hashes(w, &s.hashes);
            write_parent(w, s.parent);
            write_tokens(w, &s.token_ids);
            w.uint(u64::from(s.block_size));
            write_lora(w, s.lora_id);
            w.opt_str(s.medium.as_deref());
        }
        EngineEvent::Removed { hashes, medium, .. } => {
            w.array(3);
            w.str("BlockRemoved");
            write_hashes(w, hashes);
            w.opt_str(medium.as_deref());
        }
        EngineEvent::Cleared => {
            w.array(1);
            w.str("AllBlocksCleared");
        }
        EngineEvent::Invalid { .. } => {}
    }
}
