//! The stored form of a registration: one JSON record per instance, under a key derived from
//! the instance's endpoint and id. Pure: shared by every backend.
//!
//! Key layout: `<ns>/<component>/<endpoint>/<id as 16 hex digits>`, each name segment
//! percent-encoded so that it holds only `[A-Za-z0-9_-]` and `%`. Encoding keeps path
//! boundaries exact (the prefix of `ns/comp/` never matches `ns/comp2/…`) and lets the file
//! store swap `/` for `.` to get a flat, reversible file name.

use serde::{Deserialize, Serialize};

use super::{EndpointId, Instance, InstanceId, RecordError};
use crate::advert::ModelCard;

/// Percent-encode a name segment: keep `[A-Za-z0-9_-]`, encode every other byte as `%XX`.
pub(crate) fn encode_segment(segment: &str) -> String {
    let mut out = String::with_capacity(segment.len());
    for byte in segment.bytes() {
        if byte.is_ascii_alphanumeric() || byte == b'_' || byte == b'-' {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// The key prefix of every record in a namespace (ends with `/`).
pub(crate) fn namespace_prefix(namespace: &str) -> String {
    format!("{}/", encode_segment(namespace))
}

/// The key prefix of every record of an endpoint (ends with `/`).
pub(crate) fn endpoint_prefix(endpoint: &EndpointId) -> String {
    format!(
        "{}/{}/{}/",
        encode_segment(&endpoint.namespace),
        encode_segment(&endpoint.component),
        encode_segment(&endpoint.endpoint)
    )
}

/// The key under which the record of `instance_id` at `endpoint` is stored (relative to the
/// backend's root).
pub fn record_key(endpoint: &EndpointId, instance_id: InstanceId) -> String {
    format!("{}{instance_id:016x}", endpoint_prefix(endpoint))
}

/// The document stored per instance.
#[derive(Serialize)]
struct RecordOut<'a> {
    instance: &'a Instance,
    card: &'a ModelCard,
    /// Which registration wrote the record; lets a superseded registration leave its
    /// successor's record alone (file store; 0 elsewhere).
    #[serde(skip_serializing_if = "is_zero")]
    owner: u64,
}

#[derive(Deserialize)]
struct RecordIn {
    instance: Instance,
    card: ModelCard,
    #[serde(default)]
    owner: u64,
}

fn is_zero(owner: &u64) -> bool {
    *owner == 0
}

/// Serialize a record document.
pub fn encode_record(instance: &Instance, card: &ModelCard) -> Vec<u8> {
    encode_owned_record(instance, card, 0)
}

pub(crate) fn encode_owned_record(instance: &Instance, card: &ModelCard, owner: u64) -> Vec<u8> {
    // Strings, numbers, bools and a socket address only: serialization cannot fail.
    serde_json::to_vec(&RecordOut {
        instance,
        card,
        owner,
    })
    .unwrap_or_default()
}

/// Read the record stored under `key`: the instance and its card. Fails (never panics) on
/// unreadable bytes, an unreadable card, or a record that belongs under another key.
pub fn decode_record(key: &str, bytes: &[u8]) -> Result<(Instance, ModelCard), RecordError> {
    decode_owned_record(key, bytes).map(|(instance, card, _)| (instance, card))
}

pub(crate) fn decode_owned_record(
    key: &str,
    bytes: &[u8],
) -> Result<(Instance, ModelCard, u64), RecordError> {
    let record: RecordIn = serde_json::from_slice(bytes)?;
    let expected = record_key(&record.instance.endpoint, record.instance.instance_id);
    if expected != key {
        return Err(RecordError::KeyMismatch {
            key: key.to_owned(),
            expected,
        });
    }
    Ok((record.instance, record.card, record.owner))
}

/// Reject instances whose record could not be keyed or found again.
pub(crate) fn validate(instance: &Instance) -> Result<(), super::DiscoveryError> {
    let ep = &instance.endpoint;
    for (what, name) in [
        ("namespace", &ep.namespace),
        ("component", &ep.component),
        ("endpoint", &ep.endpoint),
    ] {
        if name.is_empty() {
            return Err(super::DiscoveryError::InvalidInstance(format!(
                "empty {what} in {ep}"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn instance(ns: &str, comp: &str, id: u64) -> Instance {
        Instance {
            endpoint: EndpointId::new(ns, comp, "generate"),
            instance_id: id,
            address: "127.0.0.1:9000".parse().unwrap(),
        }
    }

    #[test]
    fn prefixes_respect_path_boundaries() {
        let comp = endpoint_prefix(&EndpointId::new("ns", "comp", "generate"));
        let key2 = record_key(&EndpointId::new("ns", "comp2", "generate"), 1);
        assert!(!key2.starts_with(&comp));
        // A slash inside a name must not forge a boundary.
        let forged = record_key(&EndpointId::new("ns/comp", "generate", "x"), 1);
        assert!(!forged.starts_with(&comp));
        assert!(!forged.starts_with(&namespace_prefix("ns")));
    }

    #[test]
    fn encoded_keys_never_hold_dots_or_leading_dots() {
        let key = record_key(&EndpointId::new(".hidden", "a.b", "ü"), 7);
        assert!(!key.contains('.'));
        assert_eq!(key, "%2Ehidden/a%2Eb/%C3%BC/0000000000000007");
    }

    #[test]
    fn record_round_trips_with_its_owner() {
        let inst = instance("ns", "prefill", 42);
        let card = ModelCard::named("m");
        let key = record_key(&inst.endpoint, 42);
        let bytes = encode_owned_record(&inst, &card, 9);
        let (i, c, owner) = decode_owned_record(&key, &bytes).unwrap();
        assert_eq!((i, c, owner), (inst, card, 9));
    }

    #[test]
    fn record_under_a_foreign_key_is_rejected() {
        let inst = instance("ns", "prefill", 42);
        let bytes = encode_record(&inst, &ModelCard::named("m"));
        let other = record_key(&inst.endpoint, 43);
        assert!(matches!(
            decode_record(&other, &bytes),
            Err(RecordError::KeyMismatch { .. })
        ));
    }

    #[test]
    fn malformed_documents_are_errors_not_panics() {
        let inst = instance("ns", "prefill", 1);
        let key = record_key(&inst.endpoint, 1);
        let bad_card = format!(
            "{{\"instance\":{},\"card\":42}}",
            serde_json::to_string(&inst).unwrap()
        );
        for doc in [&b"not json"[..], b"{}", b"", bad_card.as_bytes()] {
            assert!(matches!(
                decode_record(&key, doc),
                Err(RecordError::Malformed(_))
            ));
        }
    }

    #[test]
    fn empty_names_are_invalid() {
        assert!(validate(&instance("", "prefill", 1)).is_err());
        assert!(validate(&instance("ns", "prefill", 1)).is_ok());
    }
}
