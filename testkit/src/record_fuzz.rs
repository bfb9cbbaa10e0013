//! Fuzz target `discovery_record`: arbitrary bytes, under arbitrary or matching keys, read as a
//! discovery record (the JSON document the file store and etcd keep per instance) through
//! [`decode_record`].
//!
//! Checked on every input: no panic; a failure is a typed `RecordError` (`Malformed`, or
//! `KeyMismatch` naming the key it was found under and a different expected key), so the
//! backends skip the record with an error; a record read under `key` describes the instance whose
//! key is `key`, and writing it again reads back the same; a record written by `encode_record`
//! (or built by hand from a well-formed instance and card) reads back exactly under its own key
//! and is refused under any other; record keys use only the key alphabet.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};

use arbitrary::{Arbitrary, Unstructured};
use serde_json::{json, Value};

use crate::card_fuzz::{CardSeed, Junk};
use prefill_router::advert::ModelCard;
use prefill_router::discovery::{
    decode_record, encode_record, record_key, EndpointId, Instance, RecordError,
};

/// An instance, field by field.
#[derive(Arbitrary, Clone, Debug)]
pub struct InstanceSeed {
    namespace: String,
    component: String,
    endpoint: String,
    id: u64,
    v6: bool,
    ip: [u8; 16],
    port: u16,
}

impl InstanceSeed {
    /// The instance this seed stands for.
    pub fn instance(&self) -> Instance {
        let ip = if self.v6 {
            Ipv6Addr::from(self.ip).into()
        } else {
            Ipv4Addr::new(self.ip[0], self.ip[1], self.ip[2], self.ip[3]).into()
        };
        Instance {
            endpoint: EndpointId::new(&self.namespace, &self.component, &self.endpoint),
            instance_id: self.id,
            address: SocketAddr::new(ip, self.port),
        }
    }
}

/// Which key the record is read under.
#[derive(Arbitrary, Clone, Debug)]
pub enum KeySeed {
    /// The key of the instance in the document (when the document has one).
    Own,
    /// The key of the same endpoint with another instance id.
    OtherId(u64),
    /// Any string.
    Raw(String),
}

/// The record document.
#[derive(Arbitrary, Clone, Debug)]
pub enum RecordDoc {
    /// Arbitrary bytes.
    Raw(Vec<u8>),
    /// Written by `encode_record` (a card that does not parse is replaced by a named card).
    Encoded {
        /// The instance.
        instance: InstanceSeed,
        /// The card.
        card: CardSeed,
    },
    /// Written by hand: `{"instance": …, "card": …, "owner": …}` plus extra fields.
    Built {
        /// The instance.
        instance: InstanceSeed,
        /// The card document.
        card: CardSeed,
        /// The owner field, if written.
        owner: Option<u64>,
        /// Extra top-level fields (prefixed, so they never collide).
        extra: Vec<(String, Junk)>,
    },
    /// An encoded record cut to `keep` bytes with the byte at `at` xored with `flip`.
    Mangled {
        /// The instance.
        instance: InstanceSeed,
        /// How many bytes to keep.
        keep: u16,
        /// Which byte to flip.
        at: u16,
        /// The xor mask.
        flip: u8,
    },
}

/// A whole structure-aware input.
#[derive(Arbitrary, Clone, Debug)]
pub struct RecordScript {
    /// The key.
    pub key: KeySeed,
    /// The document.
    pub doc: RecordDoc,
}

/// Equal cards, floats compared to within rounding (JSON text may not round-trip an `f64`
/// to the last bit with serde_json's default float parser).
fn same_card(a: &ModelCard, b: &ModelCard) -> bool {
    let close = |x: f64, y: f64| x == y || (x - y).abs() <= 1e-12 * x.abs().max(y.abs());
    match (&a.router_config, &b.router_config) {
        (Some(x), Some(y)) => {
            let (kx, ky) = (&x.kv_router_config, &y.kv_router_config);
            x.router_mode == y.router_mode
                && x.session_affinity_ttl_secs == y.session_affinity_ttl_secs
                && close(kx.overlap_score_weight, ky.overlap_score_weight)
                && close(kx.router_temperature, ky.router_temperature)
                && kx.use_kv_events == ky.use_kv_events
                && kx.router_track_active_blocks == ky.router_track_active_blocks
                && a.name == b.name
                && a.kv_cache_block_size == b.kv_cache_block_size
                && a.runtime_config == b.runtime_config
        }
        (None, None) => a == b,
        _ => false,
    }
}

/// Key alphabet: percent-encoded segments, `/` separators, a 16-hex-digit id.
fn check_key(key: &str) -> Result<(), String> {
    let ok_chars = key
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'%' | b'/'));
    let parts: Vec<&str> = key.split('/').collect();
    let id_ok = parts
        .last()
        .is_some_and(|id| id.len() == 16 && id.bytes().all(|b| b.is_ascii_hexdigit()));
    if ok_chars && parts.len() == 4 && id_ok {
        Ok(())
    } else {
        Err(format!(
            "record key {key:?} outside the key alphabet or layout"
        ))
    }
}

/// A record reader: [`decode_record`], or a mutant of it.
pub type Reader = fn(&str, &[u8]) -> Result<(Instance, ModelCard), RecordError>;

/// Read `bytes` under `key` with `reader`; `expected` is the instance and card it must read as
/// under its own key (when the document was built well-formed). Returns what broke.
pub fn check_record(
    reader: Reader,
    key: &str,
    bytes: &[u8],
    expected: Option<&(Instance, ModelCard)>,
) -> Result<(), String> {
    let read = reader(key, bytes);
    match &read {
        Ok((instance, card)) => {
            let own = record_key(&instance.endpoint, instance.instance_id);
            check_key(&own)?;
            if own != key {
                return Err(format!(
                    "record under {key:?} read as {instance:?} (key {own:?})"
                ));
            }
            let again = reader(key, &encode_record(instance, card));
            match &again {
                Ok((i, c)) if i == instance && same_card(c, card) => {}
                _ => return Err(format!("{instance:?} written again reads {again:?}")),
            }
        }
        Err(RecordError::KeyMismatch {
            key: found,
            expected,
        }) => {
            if found != key || expected == key {
                return Err(format!(
                    "key mismatch {found:?} vs {expected:?} under {key:?}"
                ));
            }
            check_key(expected)?;
        }
        // Any other error must be the "unreadable record" one.
        Err(other) => {
            if !matches!(other, RecordError::Malformed(_)) {
                return Err(format!("record under {key:?} failed with {other:?}"));
            }
        }
    }
    if let Some((instance, card)) = expected {
        let own = record_key(&instance.endpoint, instance.instance_id);
        let fine = match &read {
            Ok((i, c)) => key == own && i == instance && same_card(c, card),
            Err(RecordError::KeyMismatch { .. }) => key != own,
            Err(_) => false,
        };
        if !fine {
            return Err(format!(
                "well-formed record of {instance:?} under {key:?} (own key {own:?}) read {read:?}"
            ));
        }
    }
    Ok(())
}

/// Check one structure-aware script against `reader`.
pub fn check_record_script(script: &RecordScript, reader: Reader) -> Result<(), String> {
    let (instance, bytes, expected) = match &script.doc {
        RecordDoc::Raw(bytes) => (None, bytes.clone(), None),
        RecordDoc::Encoded { instance, card } => {
            let instance = instance.instance();
            let card = card.document().1.unwrap_or_else(|| ModelCard::named("m"));
            let bytes = encode_record(&instance, &card);
            (Some(instance.clone()), bytes, Some((instance, card)))
        }
        RecordDoc::Built {
            instance,
            card,
            owner,
            extra,
        } => {
            let instance = instance.instance();
            let (card_doc, card) = card.document();
            let mut doc = json!({
                "instance": serde_json::to_value(&instance).unwrap_or(Value::Null),
                "card": card_doc,
            });
            if let Value::Object(o) = &mut doc {
                if let Some(owner) = owner {
                    o.insert("owner".to_owned(), json!(owner));
                }
                for (k, v) in extra {
                    o.insert(format!("x-{k}"), v.to_value());
                }
            }
            let bytes = serde_json::to_vec(&doc).unwrap_or_default();
            let expected = card.map(|c| (instance.clone(), c));
            (Some(instance), bytes, expected)
        }
        RecordDoc::Mangled {
            instance,
            keep,
            at,
            flip,
        } => {
            let instance = instance.instance();
            let mut bytes = encode_record(&instance, &ModelCard::named("m"));
            bytes.truncate(usize::from(*keep));
            if let Some(b) = bytes.get_mut(usize::from(*at)) {
                *b ^= flip;
            }
            (Some(instance), bytes, None)
        }
    };
    let key = match (&script.key, &instance) {
        (KeySeed::Own, Some(i)) => record_key(&i.endpoint, i.instance_id),
        (KeySeed::OtherId(id), Some(i)) => record_key(&i.endpoint, *id),
        (KeySeed::Raw(s), _) => s.clone(),
        (_, None) => String::new(),
    };
    check_record(reader, &key, &bytes, expected.as_ref())
}

/// Decode raw fuzz bytes as a structure-aware script.
pub fn decode(bytes: &[u8]) -> Option<RecordScript> {
    RecordScript::arbitrary_take_rest(Unstructured::new(bytes)).ok()
}

/// The `discovery_record` harness: the raw bytes as a record under a fixed key, then as a
/// structure-aware script.
pub fn discovery_record(bytes: &[u8]) {
    let key = "ns/prefill/generate/0000000000000001";
    if let Err(e) = check_record(decode_record, key, bytes, None) {
        panic!("discovery_record (raw bytes): {e}");
    }
    if let Some(script) = decode(bytes) {
        if let Err(e) = check_record_script(&script, decode_record) {
            panic!("discovery_record: {e}\nscript: {script:?}");
        }
    }
}
