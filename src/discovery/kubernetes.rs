//! `KubernetesDiscovery` (feature `kubernetes`): the read side of discovery on a Kubernetes
//! cluster, through kube's client. Not yet tried on a real cluster: the tests run against an
//! in-test API server (`tests/discovery_conformance/k8s_server.rs`); see `docs/kubernetes.md`.
//!
//! - Membership and readiness: EndpointSlices labelled `prefill-router/namespace`,
//!   `/component`, `/endpoint`; a ready endpoint whose `targetRef` is a pod is an instance
//!   (id: the pod UID hashed, address: the endpoint's IP and the slice's request-plane port).
//!   The kubelet's readiness probe is the lease: a not-ready or deleted endpoint is gone.
//! - The card: the pod's `prefill-router/card` annotation (JSON). Pods are read by the label
//!   `prefill-router/namespace` (worker pods carry it as their Service's slices do).
//! - Watch: list slices and pods (paged with `limit` and `continue`) at a resourceVersion, then
//!   watch each from its version, with bookmarks; a watch that ends is reopened from the last
//!   version seen. `410 Gone` (the version was compacted) lists again, and the shared
//!   level-triggered diff emits exactly the missed changes. After each object event the
//!   records are recomputed and only the ones that changed are emitted (an address or port
//!   change under the same key is a `Put`, an upsert to the watcher).
//! - Registration: a worker registers by being a ready pod with the card annotation;
//!   [`Discovery::register`](super::Discovery::register) cannot create a record here and
//!   fails with [`DiscoveryError::RegisterUnsupported`] (after validating the instance).
//! - Every call is bounded by [`KubernetesConfig::request_timeout`]; failures and recoveries
//!   are reported through [`Discovery::store_status`](super::Discovery::store_status).
//! - Memory: what the watch keeps is the selected slices' ready members and the selected
//!   pods' cards, proportional to the workers of the namespace.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{BoxStream, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use kube::Resource;
use serde::de::DeserializeOwned;

use super::known::RawEvent;
use super::reach::Reachability;
use super::store::{Backend, Gap, Leased, Listing};
use super::{DiscoveryError, Instance};
use crate::advert::ModelCard;

mod config;
mod objects;

pub use config::{ClusterSource, KubernetesConfig};
use objects::{card_of, members_of, namespace_of_prefix, records, Member};
pub use objects::{
    instance_id_of, CARD_ANNOTATION, COMPONENT_LABEL, ENDPOINT_LABEL, NAMESPACE_LABEL,
};

/// Discovery on a Kubernetes cluster (read side). Clones share the client.
#[derive(Clone)]
pub struct KubernetesDiscovery {
    client: kube::Client,
    config: Arc<KubernetesConfig>,
    reach: Arc<Reachability>,
}

impl Debug for KubernetesDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubernetesDiscovery")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn k8s_err(error: impl std::fmt::Display) -> DiscoveryError {
    DiscoveryError::Kubernetes(error.to_string())
}

impl KubernetesDiscovery {
    /// Build the client for `config.source` (reading the kubeconfig or the service account);
    /// no call is made yet. Fails on a bad URL, kubeconfig or in-cluster environment.
    pub async fn connect(config: KubernetesConfig) -> Result<Self, DiscoveryError> {
        let mut kube_config = match &config.source {
            ClusterSource::InCluster => kube::Config::incluster().map_err(k8s_err)?,
            ClusterSource::Kubeconfig(path) => {
                let file = kube::config::Kubeconfig::read_from(path).map_err(k8s_err)?;
                let options = kube::config::KubeConfigOptions::default();
                kube::Config::from_custom_kubeconfig(file, &options)
                    .await
                    .map_err(k8s_err)?
            }
            ClusterSource::Url(url) => kube::Config::new(url.parse().map_err(k8s_err)?),
        };
        kube_config.connect_timeout = Some(config.request_timeout);
        // A watch is silent between events: its read bound is the server-side timeout.
        kube_config.read_timeout = Some(config.watch_timeout + config.request_timeout);
        kube_config.write_timeout = Some(config.request_timeout);
        let client = kube::Client::try_from(kube_config).map_err(k8s_err)?;
        Ok(KubernetesDiscovery {
            client,
            config: Arc::new(config),
            reach: Arc::default(),
        })
    }

    fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        K::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.config.namespace)
    }

    async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, DiscoveryError> {
        match tokio::time::timeout(self.config.request_timeout, call).await {
            Ok(result) => result.map_err(k8s_err),
            Err(_) => Err(DiscoveryError::Kubernetes(format!(
                "no answer within {:?}",
                self.config.request_timeout
            ))),
        }
    }

    /// Every object of `api` matching `selector`, page by page, and the list's version.
    async fn list_all<K>(
        &self,
        api: &Api<K>,
        selector: &str,
    ) -> Result<(Vec<K>, String), DiscoveryError>
    where
        K: Clone + DeserializeOwned + Debug,
    {
        let mut items = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut params = ListParams::default()
                .labels(selector)
                .limit(self.config.page_size);
            if let Some(token) = &token {
                params = params.continue_token(token);
            }
            let page = self.bounded(api.list(&params)).await?;
            items.extend(page.items);
            match page.metadata.continue_ {
                Some(next) if !next.is_empty() => token = Some(next),
                // Every page of a chunked list is of the first page's snapshot.
                _ => return Ok((items, page.metadata.resource_version.unwrap_or_default())),
            }
        }
    }

    /// A watch of `api` from `version` (bookmarks asked for).
    async fn open<K>(
        &self,
        api: &Api<K>,
        selector: &str,
        version: &str,
    ) -> Result<Events<K>, DiscoveryError>
    where
        K: Clone + DeserializeOwned + Debug + Send + 'static,
    {
        // kube refuses a watch timeout of 295 s or more (its client's own read timeout).
        let seconds = u32::try_from(self.config.watch_timeout.as_secs()).unwrap_or(290);
        let params = WatchParams::default()
            .labels(selector)
            .timeout(seconds.clamp(1, 290));
        Ok(self.bounded(api.watch(&params, version)).await?.boxed())
    }

    /// A full read of the cursor's namespace into it, and the records it makes.
    async fn read(&self, cursor: &mut KubeCursor) -> Result<Listing, DiscoveryError> {
        let Some(selector) = cursor.selector.clone() else {
            return Ok(Vec::new());
        };
        let (slices, slice_version) = self
            .list_all(&self.api::<EndpointSlice>(), &selector)
            .await?;
        let (pods, pod_version) = self.list_all(&self.api::<Pod>(), &selector).await?;
        cursor.slices = slices
            .iter()
            .map(|s| (slice_name(s), members_of(s, &self.config.port_name)))
            .collect();
        cursor.cards = pods.iter().filter_map(card_of).collect();
        cursor.slice_version = slice_version;
        cursor.pod_version = pod_version;
        cursor.emitted = records(&cursor.prefix, &cursor.slices, &cursor.cards);
        Ok(cursor.emitted.clone().into_iter().collect())
    }
}

type Events<K> = BoxStream<'static, Result<WatchEvent<K>, kube::Error>>;

fn slice_name(slice: &EndpointSlice) -> String {
    slice.metadata.name.clone().unwrap_or_default()
}

/// `value` can be a label value (so an object can carry it).
fn is_label_value(value: &str) -> bool {
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    value.len() <= 63
        && value.chars().all(ok)
        && value.starts_with(|c: char| c.is_ascii_alphanumeric())
        && value.ends_with(|c: char| c.is_ascii_alphanumeric())
}

/// One watch of a key prefix: the objects read so far, both watches, and the records last
/// reported.
pub(crate) struct KubeCursor {
    prefix: String,
    /// `prefill-router/namespace=<ns>`, or `None` if the namespace cannot be a label value
    /// (then nothing can be listed under it).
    selector: Option<String>,
    slices: BTreeMap<String, Vec<Member>>,
    /// Cards by pod UID.
    cards: BTreeMap<String, ModelCard>,
    slice_version: String,
    pod_version: String,
    slice_watch: Option<Events<EndpointSlice>>,
    pod_watch: Option<Events<Pod>>,
    emitted: BTreeMap<String, Vec<u8>>,
    /// `410 Gone`s since the last object event: from the second in a row on, a relist waits
    /// [`KubernetesConfig::retry_interval`] first (no relisting in a tight loop against a
    /// server that expires every fresh version).
    expired: u32,
}

/// What one watch item means for the cursor.
enum Seen<K> {
    Upsert(K),
    Delete(K),
    Nothing,
    Ended,
}

fn seen<K: Resource>(
    item: Option<Result<WatchEvent<K>, kube::Error>>,
    version: &mut String,
) -> Result<Seen<K>, Gap> {
    let event = match item {
        None => return Ok(Seen::Ended),
        Some(Err(error)) => return Err(Gap::Broken(k8s_err(error))),
        Some(Ok(event)) => event,
    };
    let (object, upsert) = match event {
        WatchEvent::Bookmark(mark) => {
            *version = mark.metadata.resource_version;
            return Ok(Seen::Nothing);
        }
        WatchEvent::Error(error) if error.code == 410 => {
            tracing::debug!(message = %error.message, "kubernetes watch expired; relisting");
            return Err(Gap::Missed);
        }
        WatchEvent::Error(error) => {
            return Err(Gap::Broken(DiscoveryError::Kubernetes(format!(
                "watch failed ({}): {}",
                error.code, error.message
            ))))
        }
        WatchEvent::Added(object) | WatchEvent::Modified(object) => (object, true),
        WatchEvent::Deleted(object) => (object, false),
    };
    if let Some(v) = object.meta().resource_version.as_ref() {
        v.clone_into(version);
    }
    Ok(if upsert {
        Seen::Upsert(object)
    } else {
        Seen::Delete(object)
    })
}

impl KubeCursor {
    /// Append the records that changed since the last report to `out`.
    fn emit(&mut self, out: &mut Vec<RawEvent>) {
        let now = records(&self.prefix, &self.slices, &self.cards);
        for key in self.emitted.keys().filter(|k| !now.contains_key(*k)) {
            out.push(RawEvent::Delete(key.clone()));
        }
        for (key, bytes) in &now {
            if self.emitted.get(key) != Some(bytes) {
                out.push(RawEvent::Put(key.clone(), bytes.clone()));
            }
        }
        self.emitted = now;
    }
}

/// The next item of one of a cursor's two watches.
#[allow(clippy::large_enum_variant)] // one short-lived value per watch event, not stored
enum Next {
    Slice(Option<Result<WatchEvent<EndpointSlice>, kube::Error>>),
    Pod(Option<Result<WatchEvent<Pod>, kube::Error>>),
}

impl KubernetesDiscovery {
    /// Apply a slice watch item; true if an object changed.
    async fn on_slice(
        &self,
        cursor: &mut KubeCursor,
        selector: &str,
        item: Option<Result<WatchEvent<EndpointSlice>, kube::Error>>,
    ) -> Result<bool, Gap> {
        match seen(item, &mut cursor.slice_version)? {
            Seen::Upsert(slice) => {
                let members = members_of(&slice, &self.config.port_name);
                cursor.slices.insert(slice_name(&slice), members);
            }
            Seen::Delete(slice) => {
                cursor.slices.remove(&slice_name(&slice));
            }
            Seen::Nothing => return Ok(false),
            Seen::Ended => {
                let api = self.api::<EndpointSlice>();
                let reopened = self.open(&api, selector, &cursor.slice_version).await;
                cursor.slice_watch = Some(reopened.map_err(Gap::Broken)?);
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Apply a pod watch item; true if an object changed.
    async fn on_pod(
        &self,
        cursor: &mut KubeCursor,
        selector: &str,
        item: Option<Result<WatchEvent<Pod>, kube::Error>>,
    ) -> Result<bool, Gap> {
        match seen(item, &mut cursor.pod_version)? {
            Seen::Upsert(pod) => {
                let uid = pod.metadata.uid.clone().unwrap_or_default();
                match card_of(&pod) {
                    Some((uid, card)) => cursor.cards.insert(uid, card),
                    None => cursor.cards.remove(&uid),
                };
            }
            Seen::Delete(pod) => {
                if let Some(uid) = &pod.metadata.uid {
                    cursor.cards.remove(uid);
                }
            }
            Seen::Nothing => return Ok(false),
            Seen::Ended => {
                let api = self.api::<Pod>();
                let reopened = self.open(&api, selector, &cursor.pod_version).await;
                cursor.pod_watch = Some(reopened.map_err(Gap::Broken)?);
                return Ok(false);
            }
        }
        Ok(true)
    }
}

impl Backend for KubernetesDiscovery {
    type Cursor = KubeCursor;

    async fn list(&self, prefix: &str) -> Result<Listing, DiscoveryError> {
        let mut cursor = self.subscribe(prefix.to_owned());
        self.read(&mut cursor).await
    }

    fn subscribe(&self, prefix: String) -> KubeCursor {
        let selector = namespace_of_prefix(&prefix)
            .filter(|ns| is_label_value(ns))
            .map(|ns| format!("{NAMESPACE_LABEL}={ns}"));
        KubeCursor {
            prefix,
            selector,
            slices: BTreeMap::new(),
            cards: BTreeMap::new(),
            slice_version: String::new(),
            pod_version: String::new(),
            slice_watch: None,
            pod_watch: None,
            emitted: BTreeMap::new(),
            expired: 0,
        }
    }

    async fn resync(&self, cursor: &mut KubeCursor) -> Result<Listing, DiscoveryError> {
        cursor.slice_watch = None;
        cursor.pod_watch = None;
        if cursor.expired > 1 {
            tokio::time::sleep(self.config.retry_interval).await;
        }
        let listing = self.read(cursor).await?;
        if let Some(selector) = cursor.selector.as_deref() {
            let slices = self.api::<EndpointSlice>();
            cursor.slice_watch = Some(self.open(&slices, selector, &cursor.slice_version).await?);
            let pods = self.api::<Pod>();
            cursor.pod_watch = Some(self.open(&pods, selector, &cursor.pod_version).await?);
        }
        Ok(listing)
    }

    async fn changes(&self, cursor: &mut KubeCursor, out: &mut Vec<RawEvent>) -> Result<(), Gap> {
        let Some(selector) = cursor.selector.clone() else {
            // Nothing can ever be listed under this prefix.
            return std::future::pending().await;
        };
        let (Some(slices), Some(pods)) = (cursor.slice_watch.as_mut(), cursor.pod_watch.as_mut())
        else {
            return Err(Gap::Missed);
        };
        // Both arms are cancel-safe: a stream keeps what it has buffered.
        let next = tokio::select! {
            item = slices.next() => Next::Slice(item),
            item = pods.next() => Next::Pod(item),
        };
        let applied = match next {
            Next::Slice(item) => self.on_slice(cursor, &selector, item).await,
            Next::Pod(item) => self.on_pod(cursor, &selector, item).await,
        };
        match applied {
            Ok(true) => {
                cursor.expired = 0;
                cursor.emit(out);
                Ok(())
            }
            Ok(false) => Ok(()),
            Err(Gap::Missed) => {
                cursor.expired += 1;
                Err(Gap::Missed)
            }
            Err(gap) => Err(gap),
        }
    }

    fn retry_interval(&self) -> Duration {
        self.config.retry_interval
    }

    fn reachability(&self) -> Option<&Reachability> {
        Some(&self.reach)
    }

    async fn put_leased(&self, _key: String, _instance: &Instance, _card: &ModelCard) -> Leased {
        Err(DiscoveryError::RegisterUnsupported(
            "on Kubernetes a worker is registered by being a ready pod with the \
             prefill-router/card annotation behind a labelled Service",
        ))
    }
}
