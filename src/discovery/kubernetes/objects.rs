//! From Kubernetes objects to discovery records: pure, no I/O.
//!
//! An EndpointSlice labelled `prefill-router/namespace`, `/component` and `/endpoint` names
//! one of our endpoints; each of its ready endpoints whose `targetRef` is a pod becomes an
//! instance: id = FNV-1a 64 of the pod's UID, address = the endpoint's first address and the
//! slice's request-plane port. The card is the pod's `prefill-router/card` annotation (JSON).
//! Malformed objects are skipped with a warning, when they arrive (not on every recompute).

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::advert::ModelCard;
use crate::discovery::record::{encode_record, record_key, validate};
use crate::discovery::{EndpointId, Instance, InstanceId};

/// The label naming our namespace, on EndpointSlices and worker pods.
pub const NAMESPACE_LABEL: &str = "prefill-router/namespace";
/// The label naming our component, on EndpointSlices.
pub const COMPONENT_LABEL: &str = "prefill-router/component";
/// The label naming our endpoint, on EndpointSlices.
pub const ENDPOINT_LABEL: &str = "prefill-router/endpoint";
/// The pod annotation holding the worker's model card (JSON).
pub const CARD_ANNOTATION: &str = "prefill-router/card";

/// One ready endpoint of a slice: a pod serving one of our endpoints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Member {
    /// The pod's UID.
    pub(crate) pod_uid: String,
    pub(crate) instance: Instance,
}

/// The instance id of a pod: FNV-1a 64 of its UID (stable across processes and versions, so
/// every frontend derives the same id; new for a new pod).
pub fn instance_id_of(pod_uid: &str) -> InstanceId {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in pod_uid.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// The ready pod endpoints of a slice (empty, with a warning, if the slice is not ours or is
/// malformed). `port_name` picks the request-plane port; a slice with one port uses it.
pub(crate) fn members_of(slice: &EndpointSlice, port_name: &str) -> Vec<Member> {
    let name = slice.metadata.name.as_deref().unwrap_or("<unnamed>");
    let labels = slice.metadata.labels.clone().unwrap_or_default();
    let (Some(ns), Some(component), Some(ep)) = (
        labels.get(NAMESPACE_LABEL),
        labels.get(COMPONENT_LABEL),
        labels.get(ENDPOINT_LABEL),
    ) else {
        tracing::warn!(
            slice = name,
            "skipping EndpointSlice without the prefill-router labels"
        );
        return Vec::new();
    };
    let endpoint = EndpointId::new(ns.as_str(), component.as_str(), ep.as_str());
    let ports = slice.ports.as_deref().unwrap_or_default();
    let port = match ports {
        [only] => only.port,
        _ => ports
            .iter()
            .find(|p| p.name.as_deref() == Some(port_name))
            .and_then(|p| p.port),
    };
    let Some(port) = port.and_then(|p| u16::try_from(p).ok()).filter(|p| *p != 0) else {
        tracing::warn!(
            slice = name,
            port_name,
            "skipping EndpointSlice without a usable port"
        );
        return Vec::new();
    };
    let mut members = Vec::new();
    for item in &slice.endpoints {
        // Kubernetes: a missing `ready` is to be read as ready.
        let ready = item.conditions.as_ref().and_then(|c| c.ready);
        if ready == Some(false) {
            continue;
        }
        let Some(target) = item.target_ref.as_ref() else {
            tracing::warn!(slice = name, "skipping endpoint without a targetRef");
            continue;
        };
        let (Some("Pod"), Some(uid)) = (target.kind.as_deref(), target.uid.as_deref()) else {
            tracing::warn!(
                slice = name,
                "skipping endpoint whose targetRef is not a pod"
            );
            continue;
        };
        let Some(ip) = item
            .addresses
            .first()
            .and_then(|a| a.parse::<IpAddr>().ok())
        else {
            tracing::warn!(
                slice = name,
                pod = uid,
                "skipping endpoint without an IP address"
            );
            continue;
        };
        let instance = Instance {
            endpoint: endpoint.clone(),
            instance_id: instance_id_of(uid),
            address: SocketAddr::new(ip, port),
        };
        if let Err(error) = validate(&instance) {
            tracing::warn!(slice = name, %error, "skipping endpoint of an invalid instance");
            continue;
        }
        members.push(Member {
            pod_uid: uid.to_owned(),
            instance,
        });
    }
    members
}

/// A pod's UID and card, if it has both (a pod without a card is not a worker yet; a bad card
/// is warned about).
pub(crate) fn card_of(pod: &Pod) -> Option<(String, ModelCard)> {
    let uid = pod.metadata.uid.as_deref()?;
    let json = pod.metadata.annotations.as_ref()?.get(CARD_ANNOTATION)?;
    match serde_json::from_str::<ModelCard>(json) {
        Ok(card) => Some((uid.to_owned(), card)),
        Err(error) => {
            let pod = pod.metadata.name.as_deref().unwrap_or(uid);
            tracing::warn!(pod, %error, "skipping pod with an unreadable card annotation");
            None
        }
    }
}

/// The records under `prefix` that the slices and cards make: one per pod endpoint with a
/// card. A pod listed twice under one key (two slices, dual stack) counts once: the first
/// slice by name wins, so every frontend picks the same.
pub(crate) fn records(
    prefix: &str,
    slices: &BTreeMap<String, Vec<Member>>,
    cards: &BTreeMap<String, ModelCard>,
) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    for member in slices.values().flatten() {
        let Some(card) = cards.get(&member.pod_uid) else {
            continue;
        };
        let key = record_key(&member.instance.endpoint, member.instance.instance_id);
        if key.starts_with(prefix) && !out.contains_key(&key) {
            let bytes = encode_record(&member.instance, card);
            out.insert(key, bytes);
        }
    }
    out
}

/// Our namespace named by a key prefix (its first, percent-encoded segment), or `None` if it
/// cannot be a label value.
pub(crate) fn namespace_of_prefix(prefix: &str) -> Option<String> {
    let segment = prefix.split('/').next()?;
    let mut bytes = Vec::with_capacity(segment.len());
    let mut raw = segment.bytes();
    while let Some(byte) = raw.next() {
        if byte == b'%' {
            let hex = [raw.next()?, raw.next()?];
            let hex = std::str::from_utf8(&hex).ok()?;
            bytes.push(u8::from_str_radix(hex, 16).ok()?);
        } else {
            bytes.push(byte);
        }
    }
    String::from_utf8(bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ObjectReference;
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn slice(
        labels: &[(&str, &str)],
        ports: Vec<EndpointPort>,
        eps: Vec<Endpoint>,
    ) -> EndpointSlice {
        EndpointSlice {
            address_type: "IPv4".into(),
            endpoints: eps,
            ports: Some(ports),
            metadata: ObjectMeta {
                name: Some("s".into()),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                ..ObjectMeta::default()
            },
        }
    }

    fn port(name: &str, port: i32) -> EndpointPort {
        EndpointPort {
            name: Some(name.into()),
            port: Some(port),
            ..EndpointPort::default()
        }
    }

    fn ep(uid: &str, ip: &str, ready: Option<bool>, kind: &str) -> Endpoint {
        Endpoint {
            addresses: vec![ip.into()],
            conditions: Some(EndpointConditions {
                ready,
                ..EndpointConditions::default()
            }),
            target_ref: Some(ObjectReference {
                kind: Some(kind.into()),
                uid: Some(uid.into()),
                ..ObjectReference::default()
            }),
            ..Endpoint::default()
        }
    }

    const OURS: [(&str, &str); 3] = [
        (NAMESPACE_LABEL, "dyn"),
        (COMPONENT_LABEL, "prefill"),
        (ENDPOINT_LABEL, "generate"),
    ];

    #[test]
    fn ready_pod_endpoints_become_instances_and_the_rest_is_skipped() {
        let s = slice(
            &OURS,
            vec![port("metrics", 9100), port("request-plane", 9000)],
            vec![
                ep("u1", "10.0.0.1", Some(true), "Pod"),
                ep("u2", "10.0.0.2", None, "Pod"),
                ep("u3", "10.0.0.3", Some(false), "Pod"),
                ep("u4", "10.0.0.4", Some(true), "Node"),
                ep("u5", "not-an-ip", Some(true), "Pod"),
            ],
        );
        let members = members_of(&s, "request-plane");
        let uids: Vec<_> = members.iter().map(|m| m.pod_uid.as_str()).collect();
        assert_eq!(uids, ["u1", "u2"]);
        assert_eq!(
            members[0].instance.address,
            "10.0.0.1:9000".parse().unwrap()
        );
        assert_eq!(members[0].instance.instance_id, instance_id_of("u1"));
        assert_eq!(
            members[0].instance.endpoint,
            EndpointId::new("dyn", "prefill", "generate")
        );
    }

    #[test]
    fn slices_without_labels_or_port_are_skipped() {
        let eps = || vec![ep("u1", "10.0.0.1", Some(true), "Pod")];
        assert!(members_of(&slice(&OURS[..2], vec![port("x", 1)], eps()), "x").is_empty());
        let two = vec![port("a", 1), port("b", 2)];
        assert!(members_of(&slice(&OURS, two, eps()), "request-plane").is_empty());
        assert_eq!(
            members_of(&slice(&OURS, vec![port("any", 7)], eps()), "rp").len(),
            1
        );
    }

    #[test]
    fn instance_ids_are_fnv1a_and_differ_per_pod() {
        // FNV-1a 64 test vectors: frontends on any build derive the same ids.
        assert_eq!(instance_id_of(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(instance_id_of("a"), 0xaf63_dc4c_8601_ec8c);
        assert_ne!(instance_id_of("u1"), instance_id_of("u2"));
    }

    #[test]
    fn a_member_needs_a_card_and_the_first_slice_wins() {
        let s = slice(
            &OURS,
            vec![port("rp", 9000)],
            vec![ep("u1", "10.0.0.1", None, "Pod")],
        );
        let t = slice(
            &OURS,
            vec![port("rp", 9001)],
            vec![ep("u1", "10.0.0.1", None, "Pod")],
        );
        let slices = BTreeMap::from([
            ("a".to_owned(), members_of(&s, "rp")),
            ("b".to_owned(), members_of(&t, "rp")),
        ]);
        assert!(records("dyn/", &slices, &BTreeMap::new()).is_empty());
        let cards = BTreeMap::from([("u1".to_owned(), ModelCard::named("m"))]);
        let out = records("dyn/", &slices, &cards);
        assert_eq!(out.len(), 1);
        let first = &slices["a"][0].instance;
        let expected = encode_record(first, &ModelCard::named("m"));
        assert_eq!(out.values().next(), Some(&expected));
        assert!(records("other/", &slices, &cards).is_empty());
    }

    #[test]
    fn prefixes_decode_to_label_values() {
        assert_eq!(namespace_of_prefix("dyn/prefill/").as_deref(), Some("dyn"));
        assert_eq!(namespace_of_prefix("a%2Eb/").as_deref(), Some("a.b"));
        assert_eq!(namespace_of_prefix("a%2/"), None);
    }
}
