//! The shared conformance suite against `KubernetesDiscovery`: the worker side played by the
//! in-test cluster (`k8s_server.rs`).
//!
//! The cases register through `Discovery::register` with instance ids of their choosing; on
//! Kubernetes a worker registers by being a ready pod behind a labelled Service, and the
//! backend names it `instance_id_of(pod uid)`. So each client is a [`Relabelled`] wrapper:
//!
//! - **Reads** (`list_*`, `watch`, `watch_namespace`, `store_status`) go to a real
//!   `KubernetesDiscovery` connected to the in-test API server, with one-object pages, a short
//!   retry and short server-side watch timeouts (so paging and watch resumption are exercised
//!   by every case).
//! - **`register`** first asks the real backend (so an invalid instance gets the backend's own
//!   `InvalidInstance`, and any error other than `RegisterUnsupported` is returned), then plays
//!   kubelet and EndpointSlice controller ([`Cluster`]): a pod with a UID fixed by the record
//!   key (endpoint, case id), the `prefill-router/namespace` label and the card annotation; and
//!   one EndpointSlice for the instance with the three labels, a ready endpoint at the
//!   instance's IP whose `targetRef` is the pod, and the port named `request-plane`. One slice
//!   per instance is faithful: the slice controller groups endpoints by port set, and the
//!   cases give every instance its own port. Registering the same instance again patches the
//!   pod's annotation (an upsert).
//! - **Ids**: the cluster records `instance_id_of(uid) -> case id` before it writes the pod, and
//!   the wrapper translates the ids of every list result and watch event. The relabelling is a
//!   bijection fixed at registration (one UID per record key, checked on insert), so it can
//!   neither hide nor invent an event; an id the cluster never wrote panics. Lists are checked
//!   to be in the backend's own id order before they are re-sorted by case id.
//!   `instance_id_of` itself is checked by its unit tests (FNV-1a vectors) in `objects.rs`.
//! - **The lease is readiness**. `deregister` and drop remove the endpoint now (the pod fails
//!   its readiness on SIGTERM and is deleted); `abandon` (a killed worker) leaves it until the
//!   "kubelet" notices: after the harness TTL, modelling the readiness probe's period ×
//!   failure threshold, the endpoint turns not-ready. A superseded registration never touches
//!   its successor's objects (a generation per record key).
//! - **`write_raw`** is a foreign or buggy worker: a pod whose card annotation is the bytes
//!   verbatim, with a ready endpoint. The suite's three junk records (`{not json`, a record with
//!   a bad card, a whole record where a card belongs) are none of them JSON of a `ModelCard`
//!   (a record has no top-level `name`); that is asserted, so the mapping cannot turn junk
//!   into a readable card. A well-formed record under its own key becomes a worker with its
//!   card, as it is a readable record on every other backend.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use prefill_router::discovery::{
    decode_record, instance_id_of, ClusterSource, KubernetesConfig, KubernetesDiscovery, Lease,
    Registration, StoreStatus, CARD_ANNOTATION, COMPONENT_LABEL, ENDPOINT_LABEL, NAMESPACE_LABEL,
};
use serde_json::{json, Value};

use super::k8s_server::{K8sServer, Kind};
use super::*;

/// The Kubernetes namespace the in-test cluster runs its workers in.
const K8S_NS: &str = "serving";

/// FNV-1a 64 of a string: names derived from a record key.
fn fnv(text: &str) -> u64 {
    instance_id_of(text)
}

/// The pod name and UID of the worker under a record key (fixed by the key).
fn pod_names(key: &str) -> (String, String) {
    let hash = fnv(key);
    (format!("worker-{hash:016x}"), format!("uid-{hash:016x}"))
}

/// The worker side of the in-test cluster: kubelet and EndpointSlice controller.
pub(crate) struct Cluster {
    server: K8sServer,
    /// The case id of each backend id (`instance_id_of(pod uid)`).
    ids: Mutex<HashMap<InstanceId, InstanceId>>,
    /// The generation of the registration that owns each record key's objects.
    owners: Mutex<HashMap<String, u64>>,
    generations: AtomicU64,
}

impl Cluster {
    /// Record that the pod `uid` is case id `id`; one UID is one id for the whole run.
    fn learn(&self, uid: &str, id: InstanceId) {
        let backend_id = instance_id_of(uid);
        let previous = self.ids.lock().unwrap().insert(backend_id, id);
        assert!(
            previous.is_none_or(|p| p == id),
            "pod {uid} relabelled twice: {previous:?} and {id}"
        );
    }

    /// The case id of a backend id.
    fn case_id(&self, backend_id: InstanceId) -> InstanceId {
        match self.ids.lock().unwrap().get(&backend_id) {
            Some(id) => *id,
            None => panic!("instance id {backend_id:016x} names no pod the cluster wrote"),
        }
    }

    fn relabel(&self, instance: Instance) -> Instance {
        Instance {
            instance_id: self.case_id(instance.instance_id),
            ..instance
        }
    }

    /// Write the pod (its card annotation, verbatim) and its slice.
    fn publish(&self, key: &str, instance: &Instance, annotation: &str, ready: bool) {
        let (name, uid) = pod_names(key);
        self.learn(&uid, instance.instance_id);
        self.server.put(
            Kind::Pod,
            json!({"metadata": {"name": name, "namespace": K8S_NS, "uid": uid,
                "labels": {NAMESPACE_LABEL: instance.endpoint.namespace},
                "annotations": {CARD_ANNOTATION: annotation}}}),
        );
        self.put_slice(key, instance, ready);
    }

    /// The EndpointSlice controller's slice of one worker.
    fn put_slice(&self, key: &str, instance: &Instance, ready: bool) {
        let (name, uid) = pod_names(key);
        let ep = &instance.endpoint;
        let family = if instance.address.is_ipv4() {
            "IPv4"
        } else {
            "IPv6"
        };
        self.server.put(
            Kind::Slice,
            slice_object(&name, ep, family, instance, ready, &uid),
        );
    }

    /// Drop the worker's objects if `generation` still owns them.
    fn remove(&self, key: &str, generation: u64) {
        let mut owners = self.owners.lock().unwrap();
        if owners.get(key) == Some(&generation) {
            owners.remove(key);
            let (name, _) = pod_names(key);
            self.server.delete(Kind::Slice, &name);
            self.server.delete(Kind::Pod, &name);
        }
    }
}

fn slice_object(
    name: &str,
    ep: &EndpointId,
    family: &str,
    instance: &Instance,
    ready: bool,
    uid: &str,
) -> Value {
    json!({"metadata": {"name": name, "namespace": K8S_NS, "labels": {
            NAMESPACE_LABEL: ep.namespace, COMPONENT_LABEL: ep.component,
            ENDPOINT_LABEL: ep.endpoint}},
        "addressType": family,
        "endpoints": [{"addresses": [instance.address.ip().to_string()],
            "conditions": {"ready": ready},
            "targetRef": {"kind": "Pod", "name": name, "uid": uid}}],
        "ports": [{"name": "request-plane", "port": instance.address.port(), "protocol": "TCP"}]})
}

/// One registration's hold: its readiness in the cluster.
struct PodLease {
    cluster: Arc<Cluster>,
    key: String,
    instance: Instance,
    generation: u64,
    ttl: Duration,
}

#[async_trait::async_trait]
impl Lease for PodLease {
    async fn revoke(self: Box<Self>) -> Result<(), DiscoveryError> {
        // SIGTERM: the pod fails its readiness and is deleted; its endpoint leaves the slice.
        self.cluster.remove(&self.key, self.generation);
        Ok(())
    }

    fn abandon(self: Box<Self>) {
        // A killed container: the pod stays, and the readiness probe fails after its period ×
        // failure threshold (the TTL); then the slice controller marks the endpoint not-ready.
        tokio::spawn(async move {
            tokio::time::sleep(self.ttl).await;
            let owners = self.cluster.owners.lock().unwrap();
            if owners.get(&self.key) == Some(&self.generation) {
                self.cluster.put_slice(&self.key, &self.instance, false);
            }
        });
    }

    fn release(self: Box<Self>) {
        self.cluster.remove(&self.key, self.generation);
    }
}

/// A client: reads from the real backend, registrations played by the cluster, ids relabelled.
struct Relabelled {
    backend: KubernetesDiscovery,
    cluster: Arc<Cluster>,
}

/// The backend lists an endpoint in its own id order; check it, then order by case id.
fn in_backend_order<T>(items: &[T], id: impl Fn(&T) -> InstanceId) {
    assert!(
        items.windows(2).all(|w| id(&w[0]) < id(&w[1])),
        "the backend's list is not ordered by instance id"
    );
}

#[async_trait::async_trait]
impl Discovery for Relabelled {
    async fn register(
        &self,
        instance: Instance,
        card: ModelCard,
    ) -> Result<Registration, DiscoveryError> {
        match self.backend.register(instance.clone(), card.clone()).await {
            Err(DiscoveryError::RegisterUnsupported(_)) => {}
            Err(other) => return Err(other),
            Ok(_) => panic!("KubernetesDiscovery accepted a registration it cannot make"),
        }
        let key = record_key(&instance.endpoint, instance.instance_id);
        let generation = self.cluster.generations.fetch_add(1, Ordering::Relaxed) + 1;
        {
            // Held across the writes: a predecessor's release cannot interleave.
            let mut owners = self.cluster.owners.lock().unwrap();
            owners.insert(key.clone(), generation);
            let annotation = serde_json::to_string(&card).unwrap();
            self.cluster.publish(&key, &instance, &annotation, true);
        }
        let lease = PodLease {
            cluster: Arc::clone(&self.cluster),
            key,
            instance: instance.clone(),
            generation,
            ttl: TTL,
        };
        Ok(Registration::new(instance, Box::new(lease)))
    }

    async fn list_instances(&self, ep: &EndpointId) -> Result<Vec<Instance>, DiscoveryError> {
        let listed = self.backend.list_instances(ep).await?;
        in_backend_order(&listed, |i| i.instance_id);
        let mut out: Vec<Instance> = listed
            .into_iter()
            .map(|i| self.cluster.relabel(i))
            .collect();
        out.sort_by_key(|i| i.instance_id);
        Ok(out)
    }

    async fn list_cards(
        &self,
        ep: &EndpointId,
    ) -> Result<Vec<(InstanceId, ModelCard)>, DiscoveryError> {
        let listed = self.backend.list_cards(ep).await?;
        in_backend_order(&listed, |(id, _)| *id);
        let mut out: Vec<(InstanceId, ModelCard)> = listed
            .into_iter()
            .map(|(id, card)| (self.cluster.case_id(id), card))
            .collect();
        out.sort_by_key(|(id, _)| *id);
        Ok(out)
    }

    async fn list_namespace(&self, ns: &str) -> Result<Vec<(Instance, ModelCard)>, DiscoveryError> {
        let listed = self.backend.list_namespace(ns).await?;
        let mut out: Vec<(Instance, ModelCard)> = listed
            .into_iter()
            .map(|(i, card)| (self.cluster.relabel(i), card))
            .collect();
        // The contract's order (endpoint, then id) is record-key order, as every backend sorts.
        out.sort_by_key(|(i, _)| record_key(&i.endpoint, i.instance_id));
        Ok(out)
    }

    async fn watch(&self, ep: &EndpointId) -> Result<InstanceStream, DiscoveryError> {
        let cluster = Arc::clone(&self.cluster);
        let inner = self.backend.watch(ep).await?;
        Ok(Box::pin(inner.map(move |event| match event {
            InstanceEvent::Added(i) => InstanceEvent::Added(cluster.relabel(i)),
            InstanceEvent::Removed(id) => InstanceEvent::Removed(cluster.case_id(id)),
        })))
    }

    async fn watch_namespace(&self, ns: &str) -> Result<NamespaceStream, DiscoveryError> {
        let cluster = Arc::clone(&self.cluster);
        let inner = self.backend.watch_namespace(ns).await?;
        Ok(Box::pin(inner.map(move |event| match event {
            NamespaceEvent::Upserted(i, card) => NamespaceEvent::Upserted(cluster.relabel(i), card),
            NamespaceEvent::Removed(ep, id) => NamespaceEvent::Removed(ep, cluster.case_id(id)),
        })))
    }

    fn store_status(&self) -> tokio::sync::watch::Receiver<StoreStatus> {
        self.backend.store_status()
    }
}

/// The readiness probe's period × failure threshold in the in-test cluster.
const TTL: Duration = Duration::from_secs(2);

/// Decode one percent-encoded key segment (`record_key`'s encoding).
fn decode_segment(segment: &str) -> String {
    let mut out = Vec::new();
    let mut bytes = segment.bytes();
    while let Some(b) = bytes.next() {
        if b == b'%' {
            let hex = [bytes.next().unwrap(), bytes.next().unwrap()];
            out.push(u8::from_str_radix(std::str::from_utf8(&hex).unwrap(), 16).unwrap());
        } else {
            out.push(b);
        }
    }
    String::from_utf8(out).unwrap()
}

/// The endpoint and instance id a record key names.
fn parse_key(key: &str) -> (EndpointId, InstanceId) {
    let parts: Vec<&str> = key.split('/').collect();
    let [ns, component, ep, id] = parts.as_slice() else {
        panic!("not a record key: {key}");
    };
    let endpoint = EndpointId::new(
        decode_segment(ns),
        decode_segment(component),
        decode_segment(ep),
    );
    (endpoint, InstanceId::from_str_radix(id, 16).unwrap())
}

pub(crate) struct K8sHarness {
    cluster: Arc<Cluster>,
}

#[async_trait::async_trait]
impl Harness for K8sHarness {
    async fn start() -> Option<Self> {
        let cluster = Cluster {
            server: K8sServer::start().await,
            ids: Mutex::default(),
            owners: Mutex::default(),
            generations: AtomicU64::new(0),
        };
        Some(K8sHarness {
            cluster: Arc::new(cluster),
        })
    }

    async fn client(&self) -> Arc<dyn Discovery> {
        let url = self.cluster.server.url.clone();
        let config = KubernetesConfig::new(K8S_NS, ClusterSource::Url(url))
            .with_retry_interval(Duration::from_millis(100))
            .with_page_size(1)
            .with_watch_timeout(Duration::from_secs(3));
        Arc::new(Relabelled {
            backend: KubernetesDiscovery::connect(config).await.unwrap(),
            cluster: Arc::clone(&self.cluster),
        })
    }

    async fn write_raw(&self, key: &str, bytes: Vec<u8>) {
        let (endpoint, id) = parse_key(key);
        match decode_record(key, &bytes) {
            // A readable record under its own key: a worker with that card.
            Ok((instance, card)) => {
                let annotation = serde_json::to_string(&card).unwrap();
                self.cluster.publish(key, &instance, &annotation, true);
            }
            Err(_) => {
                assert!(
                    serde_json::from_slice::<ModelCard>(&bytes).is_err(),
                    "junk written verbatim would be a readable card: map it differently"
                );
                let annotation = String::from_utf8(bytes).expect("an annotation is text");
                self.cluster
                    .publish(key, &instance(&endpoint, id), &annotation, true);
            }
        }
    }

    fn ttl(&self) -> Duration {
        TTL
    }

    fn burst(&self) -> u64 {
        // More than a watch's channel holds (`FEED_CAPACITY`, 256): the feed must block.
        400
    }
}
