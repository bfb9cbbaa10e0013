//! A rollout on Kubernetes, end to end (issue #30): `prefill-router serve --discovery
//! k8s://...` as a process, reading the in-test API server (`tests/discovery_conformance/
//! k8s_server.rs`: no cluster can run here), `worker --discovery k8s://` processes as the pods,
//! and this test as the kubelet (it waits for each pod's readiness probe) and the EndpointSlice
//! controller.
//!
//! A Deployment's rolling update with `maxSurge: 1, maxUnavailable: 0` replaces the pods one
//! by one: the new pod starts and turns ready, then the old one is deleted, which the
//! EndpointSlice controller shows at once as `ready: false, terminating: true` while the
//! kubelet sends SIGTERM; once the container exits the pod and its endpoint are gone. Under
//! steady streaming traffic through `serve`, a rollout of every prefill and decode pod must
//! fail no request, send none to a pod that is gone (no retry on another worker is needed),
//! never leave the prefill set empty (nothing is bypassed), and cut no stream. Half the old
//! pods drain on SIGTERM; the other half are killed without a word some time after their
//! endpoint turned terminating, so only discovery keeps requests away from them (a backend
//! that missed the readiness change fails the test: requests reach a dead address).

#[path = "frontend/mod.rs"]
mod frontend;
// The in-test API server, shared with the library's discovery tests; this test uses a part.
#[allow(dead_code)]
#[path = "../../tests/discovery_conformance/k8s_server.rs"]
mod k8s_server;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use frontend::*;
use k8s_server::{K8sServer, Kind};
use prefill_router::advert::{ModelCard, SelectionMode};
use prefill_router::discovery::{
    instance_id_of, CARD_ANNOTATION, COMPONENT_LABEL, ENDPOINT_LABEL, NAMESPACE_LABEL,
};
use serde_json::json;

/// The Kubernetes namespace the pods live in.
const K8S_NS: &str = "serving";

/// Tokens per streamed answer, and the mock's pace: streams of ~120 ms, so every pod's
/// termination lands on streams in flight.
const TOKENS: u32 = 30;
const DECODE_ARGS: [&str; 2] = ["--token-interval-us", "4000"];
const PREFILL_ARGS: [&str; 2] = ["--block-cost-us", "2000"];

/// A worker pod: its process, and what the API server says about it.
struct Pod {
    name: String,
    role: &'static str,
    addr: SocketAddr,
    proc: Proc,
}

impl Pod {
    fn uid(&self) -> String {
        pod_uid(&self.name)
    }
}

/// The UID the test's "API server" gives the pod `name`.
fn pod_uid(name: &str) -> String {
    format!("uid-{name}")
}

/// The cluster's control plane as far as this test needs it: the API server, the kubelet's
/// view of the pods, and the EndpointSlice controller (one slice per pod: the controller
/// groups endpoints by port, and every worker process here has its own port).
struct K8sCluster {
    server: K8sServer,
    /// The deployment's namespace (`prefill-router/namespace`).
    namespace: String,
    /// A broken controller that never shows a terminating endpoint (the mutant the rollout
    /// test must catch: a frontend blind to readiness changes behaves the same).
    hide_terminating: bool,
}

impl K8sCluster {
    fn card(role: &str) -> ModelCard {
        match role {
            "prefill" => ModelCard::routed("mock-llm", SelectionMode::KV, 16),
            _ => ModelCard {
                kv_cache_block_size: 16,
                ..ModelCard::named("mock-llm")
            },
        }
    }

    /// Start a worker process as a pod (`worker --discovery k8s://`, its UID in `POD_UID` as
    /// the downward API gives it) and, once its readiness probe answers 200, publish it ready.
    fn run(&self, role: &'static str, name: String) -> Pod {
        let uid = pod_uid(&name);
        let mut args = vec![
            "worker",
            "--role",
            role,
            "--discovery",
            "k8s://serving",
            "--namespace",
            &self.namespace,
            "--listen",
            "127.0.0.1:0",
            "--health-listen",
            "127.0.0.1:0",
            "--unready-delay-ms",
            "300",
        ];
        args.extend(if role == "decode" {
            DECODE_ARGS
        } else {
            PREFILL_ARGS
        });
        let proc = Proc::spawn_with(&name, &args, &[("POD_UID", &uid)], false);
        let ready = proc.wait_event("ready");
        // The worker names itself as frontends name its pod.
        assert_eq!(ready["id"], instance_id_of(&uid), "{ready}");
        let addr = ready["addr"].as_str().unwrap().parse().unwrap();
        let health: SocketAddr = ready["health_addr"].as_str().unwrap().parse().unwrap();
        until("the readiness probe passes", || {
            get(health, "/ready").status == 200
        });
        let pod = Pod {
            name,
            role,
            addr,
            proc,
        };
        let card = serde_json::to_string(&Self::card(role)).unwrap();
        self.server.put(
            Kind::Pod,
            json!({"metadata": {"name": pod.name, "namespace": K8S_NS, "uid": pod.uid(),
                "labels": {NAMESPACE_LABEL: self.namespace, "app": role},
                "annotations": {CARD_ANNOTATION: card}}}),
        );
        self.slice(
            &pod,
            json!({"ready": true, "serving": true, "terminating": false}),
        );
        pod
    }

    fn slice(&self, pod: &Pod, conditions: serde_json::Value) {
        self.server.put(
            Kind::Slice,
            json!({"metadata": {"name": format!("{}-{}", pod.role, pod.name),
                    "namespace": K8S_NS, "labels": {
                    NAMESPACE_LABEL: self.namespace, COMPONENT_LABEL: pod.role,
                    ENDPOINT_LABEL: "generate"}},
                "addressType": "IPv4",
                "endpoints": [{"addresses": [pod.addr.ip().to_string()], "conditions": conditions,
                    "targetRef": {"kind": "Pod", "name": pod.name, "uid": pod.uid()}}],
                "ports": [{"name": "request-plane", "port": pod.addr.port(), "protocol": "TCP"}]}),
        );
    }

    /// Delete a pod the Kubernetes way: its endpoint turns terminating (not ready) as the
    /// kubelet signals the container; once the process has exited the pod and its slice are
    /// deleted. The worker's `stopped` event, if it drained.
    fn delete(&self, pod: Pod, exit: Exit) -> Option<serde_json::Value> {
        if !self.hide_terminating {
            self.slice(
                &pod,
                json!({"ready": false, "serving": true, "terminating": true}),
            );
        }
        let stopped = match exit {
            Exit::Drain => {
                let (status, stopped) = pod.proc.stop();
                assert!(status.success(), "{} exits 0: {stopped}", pod.name);
                Some(stopped)
            }
            Exit::Kill => {
                // Longer than any stream: only discovery keeps new work away meanwhile.
                std::thread::sleep(Duration::from_millis(800));
                pod.proc.kill();
                None
            }
        };
        self.server
            .delete(Kind::Slice, &format!("{}-{}", pod.role, pod.name));
        self.server.delete(Kind::Pod, &pod.name);
        stopped
    }
}

/// How a terminated pod's process ends.
#[derive(Clone, Copy, Debug)]
enum Exit {
    /// SIGTERM: the worker answers 503 to its readiness probe for a moment, then drains (tells
    /// its frontends, finishes its streams) and exits.
    Drain,
    /// No graceful shutdown at all (the process dies at once when signalled, or the grace
    /// period ran out): SIGKILL, some time after its endpoint turned terminating.
    Kill,
}

fn chat(content: &str) -> serde_json::Value {
    json!({
        "model": "mock-llm",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": TOKENS,
        "stream": true,
    })
}

/// One streamed answer: status, content tokens, whether it ended with `[DONE]`, the prefill
/// worker's id.
type Outcome = (u16, usize, bool, Option<u64>, String);

fn stream_once(addr: SocketAddr, prompt: &str) -> Outcome {
    let r = post(addr, "/v1/chat/completions", &chat(prompt));
    let (tokens, done) = r.chat_stream();
    let worker = r.header("x-prefill-worker").and_then(|v| v.parse().ok());
    (r.status, tokens, done, worker, r.body)
}

/// What a rollout under traffic came to.
struct Rollout {
    /// Streams answered.
    total: usize,
    /// Streams that failed or were cut.
    failed: Vec<Outcome>,
    /// `prefill_router_prefill_retries_total`: prefill requests retried on another worker.
    retries: f64,
    /// `prefill_router_bypassed_total`: requests decoded without prefill.
    bypassed: f64,
    /// `prefill_router_migrations_total`: decode streams that broke and were continued on
    /// another decode worker (a stream sent to a pod that is gone is rescued this way, so the
    /// client sees no failure: the count is what shows the misroute).
    migrations: f64,
    /// The `stopped` events of the pods that drained.
    stopped: Vec<serde_json::Value>,
    /// Each client's last prefill worker, and the new generation's prefill ids.
    last_workers: Vec<u64>,
    new_prefill: Vec<u64>,
}

/// Two prefill and two decode pods behind `serve`, six streaming clients, and a rollout of
/// every pod (see the module doc).
fn rollout(hide_terminating: bool) -> Rollout {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let cluster = K8sCluster {
        server: runtime.block_on(K8sServer::start()),
        namespace: "procs".to_owned(),
        hide_terminating,
    };
    let mut pods: Vec<Pod> = vec![
        cluster.run("prefill", "prefill-a-1".into()),
        cluster.run("prefill", "prefill-a-2".into()),
        cluster.run("decode", "decode-a-1".into()),
        cluster.run("decode", "decode-a-2".into()),
    ];
    let discovery = format!("k8s://{K8S_NS}?url={}", cluster.server.url);
    let serve = Proc::spawn(
        "serve",
        &[
            "serve",
            "--discovery",
            &discovery,
            "--namespace",
            &cluster.namespace,
            "--listen",
            "127.0.0.1:0",
            "--request-timeout-ms",
            "10000",
        ],
    );
    let addr: SocketAddr = serve.wait_event("listening")["addr"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    until("active", || {
        get(addr, "/ready").json()["lifecycle"] == "active"
    });
    // The frontend names a pod's worker by the hash of its UID, on every frontend alike.
    let first = stream_once(addr, "before the rollout");
    assert_eq!(first.0, 200, "{first:?}");
    let prefill_ids: Vec<u64> = pods[..2].iter().map(|p| instance_id_of(&p.uid())).collect();
    assert!(
        first.3.is_some_and(|id| prefill_ids.contains(&id)),
        "x-prefill-worker {:?} is one of the pods' {prefill_ids:?}",
        first.3
    );

    let stop = Arc::new(AtomicBool::new(false));
    let clients = clients_until(6, &stop, move |c, n| {
        stream_once(addr, &format!("client {c} request {n}: words"))
    });
    std::thread::sleep(Duration::from_millis(500));
    let mut stopped = Vec::new();
    for (slot, pod) in pods.iter_mut().enumerate() {
        let role = pod.role;
        let surge = cluster.run(role, pod.name.replace("-a-", "-b-"));
        // The new pod turns ready and takes some traffic before the old one goes.
        std::thread::sleep(Duration::from_millis(400));
        let old = std::mem::replace(pod, surge);
        // The first pod of each role drains; the second dies without a word, so the
        // endpoint's readiness is all that keeps requests away from it.
        let exit = if slot % 2 == 0 {
            Exit::Drain
        } else {
            Exit::Kill
        };
        stopped.extend(cluster.delete(old, exit));
        std::thread::sleep(Duration::from_millis(300));
    }
    // Traffic on the new generation alone.
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);

    let new_prefill: Vec<u64> = pods
        .iter()
        .filter(|p| p.role == "prefill")
        .map(|p| instance_id_of(&p.uid()))
        .collect();
    let mut total = 0;
    let mut failed = Vec::new();
    let mut last_workers = Vec::new();
    for client in clients {
        let outcomes = client.join().unwrap();
        last_workers.extend(outcomes.last().and_then(|o| o.3));
        for outcome in outcomes {
            total += 1;
            let (status, tokens, done, _, _) = &outcome;
            if *status != 200 || *tokens != TOKENS as usize || !done {
                failed.push(outcome);
            }
        }
    }
    let metrics = get(addr, "/metrics").body;
    let outcome = Rollout {
        total,
        failed,
        retries: counter_sum(&metrics, "prefill_router_prefill_retries_total"),
        bypassed: counter_sum(&metrics, "prefill_router_bypassed_total"),
        migrations: counter_sum(&metrics, "prefill_router_migrations_total"),
        stopped,
        last_workers,
        new_prefill,
    };
    eprintln!(
        "k8s rollout (terminating {}): {} streams, {} failed, {} prefill retries, {} bypassed, \
         {} migrations",
        if hide_terminating { "hidden" } else { "shown" },
        outcome.total,
        outcome.failed.len(),
        outcome.retries,
        outcome.bypassed,
        outcome.migrations
    );
    outcome
}

#[test]
fn a_rollout_of_every_pod_under_streaming_traffic_fails_and_misroutes_nothing() {
    let Rollout {
        total,
        failed,
        retries,
        bypassed,
        migrations,
        stopped,
        last_workers,
        new_prefill,
    } = rollout(false);
    assert!(total >= 50, "steady traffic throughout ({total} streams)");
    assert!(failed.is_empty(), "failed streams: {failed:?}");
    assert_eq!(retries, 0.0, "a request went to a pod that was gone");
    assert_eq!(bypassed, 0.0, "the prefill set was empty at some point");
    assert_eq!(migrations, 0.0, "a decode stream broke and had to move");
    for event in &stopped {
        assert_eq!(event["drained"], true, "every pod drained in time: {event}");
        assert_eq!(event["cut_connections"], 0, "{event}");
        assert_eq!(event["cancelled"], 0, "no stream was cut: {event}");
    }
    assert!(
        last_workers.iter().all(|id| new_prefill.contains(id)),
        "after the rollout, prefill runs on the new pods {new_prefill:?} only: {last_workers:?}"
    );
}

/// The test bites: with terminating endpoints hidden from discovery, the frontend keeps
/// routing to the pods that are killed without draining, and streams fail, are retried, or
/// (decode streams, since migration) move to another decode worker mid-way.
#[test]
fn a_rollout_whose_terminating_endpoints_are_hidden_is_caught() {
    let outcome = rollout(true);
    assert!(
        !outcome.failed.is_empty() || outcome.retries > 0.0 || outcome.migrations > 0.0,
        "hiding terminating endpoints went unnoticed ({} streams)",
        outcome.total
    );
}
