//! `KubernetesDiscovery` against the in-test API server (`k8s_server.rs`).
//!
//! The shared cases run against this backend through `k8s_harness.rs`; here are the
//! Kubernetes specifics, with the worker side written directly as the cluster holds it (pods
//! with their card annotation, slices of several pods as the EndpointSlice controller writes
//! them): list and watch agree (with paged lists), upserts of card and address, readiness as
//! the lease, isolation, register refused with a typed error, relist on `410 Gone` emitting
//! exactly the missed changes, a dropped watch connection, 401/403/500 answers, malformed
//! objects, watch requests timing out. Fault tests (restart, compaction while lagging, a
//! flapping pod) are in `kubernetes/faults.rs`.

use std::net::IpAddr;

use prefill_router::discovery::{
    instance_id_of, ClusterSource, KubernetesConfig, KubernetesDiscovery, CARD_ANNOTATION,
    COMPONENT_LABEL, ENDPOINT_LABEL, NAMESPACE_LABEL,
};
use serde_json::json;

use super::k8s_server::{K8sServer, Kind};
use super::*;

mod faults;

const K8S_NS: &str = "serving";

/// One worker pod as the test's "cluster" runs it.
#[derive(Clone)]
struct Pod {
    name: String,
    endpoint: EndpointId,
    ip: IpAddr,
    port: u16,
    card: ModelCard,
    ready: bool,
}

impl Pod {
    fn new(n: u8, endpoint: &EndpointId) -> Pod {
        Pod {
            name: format!("worker-{n}"),
            endpoint: endpoint.clone(),
            ip: IpAddr::from([10, 0, 0, n]),
            port: 9000,
            card: card("m", SelectionMode::KV),
            ready: true,
        }
    }
    fn uid(&self) -> String {
        format!("uid-{}", self.name)
    }
    fn instance(&self) -> Instance {
        Instance {
            endpoint: self.endpoint.clone(),
            instance_id: instance_id_of(&self.uid()),
            address: SocketAddr::new(self.ip, self.port),
        }
    }
}

/// Publish a pod (its card annotation).
fn put_pod(server: &K8sServer, pod: &Pod) {
    server.put(
        Kind::Pod,
        json!({"metadata": {"name": pod.name, "namespace": K8S_NS, "uid": pod.uid(),
            "labels": {NAMESPACE_LABEL: pod.endpoint.namespace},
            "annotations": {CARD_ANNOTATION: serde_json::to_string(&pod.card).unwrap()}}}),
    );
}

/// Publish the slice of `pods`' endpoint, as the EndpointSlice controller would.
fn put_slice(server: &K8sServer, name: &str, endpoint: &EndpointId, pods: &[&Pod]) {
    let endpoints: Vec<_> = pods
        .iter()
        .map(|p| {
            json!({"addresses": [p.ip.to_string()], "conditions": {"ready": p.ready},
                "targetRef": {"kind": "Pod", "name": p.name, "uid": p.uid()}})
        })
        .collect();
    let port = pods.first().map_or(9000, |p| p.port);
    server.put(
        Kind::Slice,
        json!({"metadata": {"name": name, "namespace": K8S_NS, "labels": {
                NAMESPACE_LABEL: endpoint.namespace, COMPONENT_LABEL: endpoint.component,
                ENDPOINT_LABEL: endpoint.endpoint}},
            "addressType": "IPv4", "endpoints": endpoints,
            "ports": [{"name": "request-plane", "port": port, "protocol": "TCP"}]}),
    );
}

async fn client(server: &K8sServer) -> KubernetesDiscovery {
    let config = KubernetesConfig::new(K8S_NS, ClusterSource::Url(server.url.clone()))
        .with_retry_interval(Duration::from_millis(100))
        .with_page_size(1)
        .with_watch_timeout(Duration::from_secs(3));
    KubernetesDiscovery::connect(config).await.unwrap()
}

async fn within<F: std::future::Future>(test: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(90), test)
        .await
        .expect("kubernetes case timed out")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k8s_list_and_watch_follow_pods_and_slices() {
    within(async {
        let server = K8sServer::start().await;
        let ep = endpoint("dyn", "prefill");
        let other = endpoint("other", "prefill");
        let (mut a, b, c) = (Pod::new(1, &ep), Pod::new(2, &ep), Pod::new(3, &other));
        for pod in [&a, &b, &c] {
            put_pod(&server, pod);
        }
        put_slice(&server, "dyn-prefill-1", &ep, &[&a, &b]);
        put_slice(&server, "other-prefill-1", &other, &[&c]);
        let store = client(&server).await;
        // Pages of one object each: the list follows `continue` tokens.
        let mut listed = vec![a.instance(), b.instance()];
        listed.sort_by_key(|i| i.instance_id);
        assert_eq!(store.list_instances(&ep).await.unwrap(), listed);
        assert_eq!(store.list_namespace("other").await.unwrap().len(), 1);
        let mut watch = store.watch(&ep).await.unwrap();
        let mut ns_watch = store.watch_namespace("dyn").await.unwrap();
        let mut view = View::default();
        view.until(&mut watch, &[&a.instance(), &b.instance()])
            .await;
        let mut ns_view = NsView::default();
        let (ia, ib) = (a.instance(), b.instance());
        ns_view
            .until(&mut ns_watch, &[(&ia, &a.card), (&ib, &b.card)])
            .await;

        // A card change is a pod annotation patch: one upsert.
        a.card = card("m2", SelectionMode::KV);
        put_pod(&server, &a);
        ns_view
            .until(&mut ns_watch, &[(&ia, &a.card), (&ib, &b.card)])
            .await;
        // An address change under the same key is an upsert the watcher sees.
        a.ip = IpAddr::from([10, 0, 1, 1]);
        put_slice(&server, "dyn-prefill-1", &ep, &[&a, &b]);
        assert_eq!(next(&mut watch).await, InstanceEvent::Added(a.instance()));
        // Readiness is the lease: a not-ready endpoint is removed.
        let mut b_down = b.clone();
        b_down.ready = false;
        put_slice(&server, "dyn-prefill-1", &ep, &[&a, &b_down]);
        assert_eq!(
            next(&mut watch).await,
            InstanceEvent::Removed(ib.instance_id)
        );
        // Another component of the namespace shows in the namespace watch only, and the other
        // namespace's changes in neither.
        let sibling = Pod::new(5, &endpoint("dyn", "prefill2"));
        put_pod(&server, &sibling);
        put_slice(&server, "dyn-prefill2-1", &sibling.endpoint, &[&sibling]);
        let (ia, is) = (a.instance(), sibling.instance());
        ns_view
            .until(&mut ns_watch, &[(&ia, &a.card), (&is, &sibling.card)])
            .await;
        server.delete(Kind::Slice, "other-prefill-1");
        assert_quiet(&mut watch).await;
        assert_quiet(&mut ns_watch).await;
        assert!(store.list_namespace("other").await.unwrap().is_empty());
        // A pod leaving the label selection is a DELETED to the pod watch: its card is gone.
        server.put(
            Kind::Pod,
            json!({"metadata": {"name": a.name, "namespace": K8S_NS, "uid": a.uid()}}),
        );
        assert_eq!(
            next(&mut watch).await,
            InstanceEvent::Removed(a.instance().instance_id)
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k8s_register_is_refused_with_a_typed_error() {
    within(async {
        let server = K8sServer::start().await;
        let store = client(&server).await;
        let ep = endpoint("dyn", "prefill");
        let result = store
            .register(instance(&ep, 1), ModelCard::named("m"))
            .await;
        assert!(matches!(
            result,
            Err(DiscoveryError::RegisterUnsupported(_))
        ));
        let bad = instance(&EndpointId::new("", "c", "e"), 1);
        let result = store.register(bad, ModelCard::named("m")).await;
        assert!(matches!(result, Err(DiscoveryError::InvalidInstance(_))));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k8s_relist_after_410_emits_exactly_the_missed_changes() {
    within(async {
        let server = K8sServer::start().await;
        let ep = endpoint("dyn", "prefill");
        let (a, b, mut c, d) = (
            Pod::new(1, &ep),
            Pod::new(2, &ep),
            Pod::new(3, &ep),
            Pod::new(4, &ep),
        );
        for pod in [&a, &b, &c, &d] {
            put_pod(&server, pod);
        }
        put_slice(&server, "s", &ep, &[&a, &b, &c]);
        let store = client(&server).await;
        let mut watch = store.watch(&ep).await.unwrap();
        let mut view = View::default();
        view.until(&mut watch, &[&a.instance(), &b.instance(), &c.instance()])
            .await;
        // The watch misses these: held, then the history is compacted and the watch expires.
        server.hold_watches();
        c.ip = IpAddr::from([10, 0, 1, 3]);
        put_slice(&server, "s", &ep, &[&a, &c, &d]);
        server.compact();
        server.expire_watches();
        // Exactly: b removed, c upserted at its new address, d added (View rejects duplicates).
        let expected = [&a.instance(), &c.instance(), &d.instance()];
        view.until(&mut watch, &expected).await;
        assert_eq!(view.removals, 1);
        assert_quiet(&mut watch).await;
        assert!(store.store_status().borrow().reachable);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k8s_dropped_watch_connection_heals() {
    within(async {
        let server = K8sServer::start().await;
        let ep = endpoint("dyn", "prefill");
        let (a, b) = (Pod::new(1, &ep), Pod::new(2, &ep));
        put_pod(&server, &a);
        put_pod(&server, &b);
        put_slice(&server, "s", &ep, &[&a]);
        let store = client(&server).await;
        let mut watch = store.watch(&ep).await.unwrap();
        let mut view = View::default();
        view.until(&mut watch, &[&a.instance()]).await;
        let mut status = store.store_status();
        server.drop_watches();
        status.wait_for(|s| s.outages == 1).await.unwrap();
        put_slice(&server, "s", &ep, &[&a, &b]);
        view.until(&mut watch, &[&a.instance(), &b.instance()])
            .await;
        status.wait_for(|s| s.reachable).await.unwrap();
        assert_quiet(&mut watch).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k8s_refusals_and_server_errors_are_typed_and_healed() {
    within(async {
        let server = K8sServer::start().await;
        let ep = endpoint("dyn", "prefill");
        let a = Pod::new(1, &ep);
        put_pod(&server, &a);
        put_slice(&server, "s", &ep, &[&a]);
        let store = client(&server).await;
        for code in [401, 403, 500] {
            server.fail_next(&[code]);
            match store.list_instances(&ep).await {
                Err(DiscoveryError::Kubernetes(message)) => {
                    assert!(message.contains(&code.to_string()), "{code}: {message}")
                }
                other => panic!("{code}: expected a Kubernetes error, got {other:?}"),
            }
        }
        // A namespace no object can carry as a label value is empty without asking the server
        // (the queued failure would otherwise answer it).
        server.fail_next(&[500]);
        assert!(store
            .list_namespace("not a label!")
            .await
            .unwrap()
            .is_empty());
        assert!(store.list_namespace("dyn").await.is_err());
        // A watch whose first listings fail reports the outage, retries, and recovers.
        server.fail_next(&[500, 500]);
        let mut status = store.store_status();
        let mut watch = store.watch(&ep).await.unwrap();
        assert_eq!(next(&mut watch).await, InstanceEvent::Added(a.instance()));
        status
            .wait_for(|s| s.reachable && s.outages == 1)
            .await
            .unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k8s_malformed_objects_are_skipped_and_never_stop_the_watch() {
    within(async {
        let server = K8sServer::start().await;
        let ep = endpoint("dyn", "prefill");
        let (good, mut bad_card) = (Pod::new(1, &ep), Pod::new(2, &ep));
        put_pod(&server, &good);
        // A pod whose card annotation is not a card.
        server.put(
            Kind::Pod,
            json!({"metadata": {"name": bad_card.name, "namespace": K8S_NS, "uid": bad_card.uid(),
                "labels": {NAMESPACE_LABEL: "dyn"}, "annotations": {CARD_ANNOTATION: "{not json"}}}),
        );
        // A slice of ours without its component and endpoint labels, and one without a port.
        server.put(
            Kind::Slice,
            json!({"metadata": {"name": "unlabelled", "namespace": K8S_NS,
                    "labels": {NAMESPACE_LABEL: "dyn"}},
                "addressType": "IPv4", "endpoints": [{"addresses": ["10.0.9.9"],
                    "targetRef": {"kind": "Pod", "uid": good.uid()}}], "ports": []}),
        );
        // An endpoint that is not a pod, beside the two pods.
        server.put(
            Kind::Slice,
            json!({"metadata": {"name": "s", "namespace": K8S_NS, "labels": {
                    NAMESPACE_LABEL: "dyn", COMPONENT_LABEL: "prefill", ENDPOINT_LABEL: "generate"}},
                "addressType": "IPv4",
                "endpoints": [
                    {"addresses": ["10.0.0.1"], "targetRef": {"kind": "Pod", "uid": good.uid()}},
                    {"addresses": ["10.0.0.2"], "targetRef": {"kind": "Pod", "uid": bad_card.uid()}},
                    {"addresses": ["10.0.0.7"], "targetRef": {"kind": "Node", "uid": "n"}}],
                "ports": [{"name": "request-plane", "port": 9000}]}),
        );
        let store = client(&server).await;
        assert_eq!(store.list_instances(&ep).await.unwrap(), vec![good.instance()]);
        let mut watch = store.watch(&ep).await.unwrap();
        assert_eq!(next(&mut watch).await, InstanceEvent::Added(good.instance()));
        assert_quiet(&mut watch).await;
        // Fixing the card makes the pod a worker: the watch went on past the bad objects.
        bad_card.card = card("m", SelectionMode::KV);
        put_pod(&server, &bad_card);
        assert_eq!(next(&mut watch).await, InstanceEvent::Added(bad_card.instance()));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k8s_two_watchers_agree_and_a_lagging_one_catches_up() {
    within(async {
        let server = K8sServer::start().await;
        let ep = endpoint("dyn", "prefill");
        let pods: Vec<Pod> = (1..=60).map(|n| Pod::new(n, &ep)).collect();
        let (first, second) = (client(&server).await, client(&server).await);
        let mut reading = first.watch(&ep).await.unwrap();
        // Not read until the end: it must catch up without loss or duplicates.
        let mut lagging = second.watch(&ep).await.unwrap();
        let mut view = View::default();
        for n in 1..=pods.len() {
            put_pod(&server, &pods[n - 1]);
            put_slice(&server, "s", &ep, &pods.iter().take(n).collect::<Vec<_>>());
        }
        // Half of them go (deleted pods leave the slice).
        let kept: Vec<&Pod> = pods.iter().skip(30).collect();
        for pod in pods.iter().take(30) {
            server.delete(Kind::Pod, &pod.name);
        }
        put_slice(&server, "s", &ep, &kept);
        let expected: Vec<Instance> = kept.iter().map(|p| p.instance()).collect();
        let expected: Vec<&Instance> = expected.iter().collect();
        view.until(&mut reading, &expected).await;
        let mut late = View::default();
        late.until(&mut lagging, &expected).await;
        assert_eq!(view.instances, late.instances);
        assert_quiet(&mut reading).await;
        assert_quiet(&mut lagging).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k8s_watch_requests_that_time_out_resume_from_their_version() {
    within(async {
        let server = K8sServer::start().await;
        let ep = endpoint("dyn", "prefill");
        let (a, b) = (Pod::new(1, &ep), Pod::new(2, &ep));
        put_pod(&server, &a);
        put_pod(&server, &b);
        put_slice(&server, "s", &ep, &[&a]);
        let config = KubernetesConfig::new(K8S_NS, ClusterSource::Url(server.url.clone()))
            .with_retry_interval(Duration::from_millis(100))
            .with_watch_timeout(Duration::from_secs(1));
        let store = KubernetesDiscovery::connect(config).await.unwrap();
        let mut watch = store.watch(&ep).await.unwrap();
        let mut view = View::default();
        view.until(&mut watch, &[&a.instance()]).await;
        // Two server-side timeouts pass; the watches are reopened from their versions (bumped
        // by bookmarks and by other objects' changes): no replay, no relist, no outage.
        put_pod(&server, &Pod::new(9, &endpoint("other", "x")));
        tokio::time::sleep(Duration::from_millis(2500)).await;
        put_slice(&server, "s", &ep, &[&a, &b]);
        view.until(&mut watch, &[&a.instance(), &b.instance()])
            .await;
        assert_quiet(&mut watch).await;
        assert_eq!(store.store_status().borrow().outages, 0);
    })
    .await;
}
