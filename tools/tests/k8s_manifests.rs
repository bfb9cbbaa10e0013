//! The manifests of `deploy/kubernetes/`, parsed with k8s-openapi's types (feature `kubernetes`),
//! checked against what the Kubernetes backend reads and what the binary accepts:
//!
//! - every document is one of the kinds expected, parses into its type, and says nothing the
//!   type does not know (it serializes back to the same tree: a misspelt field fails);
//! - one Kubernetes namespace everywhere, the one `serve --discovery k8s://NS` reads;
//! - the Role grants exactly list and watch on EndpointSlices and pods, bound to serve's
//!   ServiceAccount;
//! - each worker Deployment is selected by a Service carrying the three labels the backend
//!   reads, with the values of the worker's `--namespace` and `--role`, and a port named
//!   `request-plane` targeting its `--listen` port; its pods carry the namespace label, a card
//!   annotation that is a `ModelCard` (prefill's advertising KV routing), probes on its
//!   `--health-listen` port, `POD_UID` from `metadata.uid`, the card file from the annotation;
//! - every container's flags are the binary's: each is in its subcommand's usage, and the
//!   binary's own parser accepts their values (`ARGS --help` exits 0 only when every flag
//!   before `--help` parsed; the cross-flag checks after the loop are checked here by hand).

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Container, PodSpec, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use prefill_router::advert::{ModelCard, SelectionMode};
use prefill_router::discovery::{
    CARD_ANNOTATION, COMPONENT_LABEL, ENDPOINT_LABEL, NAMESPACE_LABEL,
};
use serde::Deserialize;

/// One object of the manifests (the large ones boxed).
enum Object {
    ServiceAccount(ServiceAccount),
    Role(Role),
    RoleBinding(RoleBinding),
    Service(Box<Service>),
    Deployment(Box<Deployment>),
}

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes")
}

/// `value` as a `T`, which must serialize back to the same tree (k8s-openapi ignores fields
/// it does not know; a manifest must not have any).
fn strict<T>(value: &serde_yaml::Value, at: &str) -> T
where
    T: serde::de::DeserializeOwned + serde::Serialize,
{
    let typed: T = serde_yaml::from_value(value.clone()).unwrap_or_else(|e| panic!("{at}: {e}"));
    let back = serde_json::to_value(&typed).unwrap();
    let given = serde_json::to_value(value).unwrap();
    assert_eq!(
        back, given,
        "{at}: fields the type does not know, or a misspelling"
    );
    typed
}

/// Every object of every `*.yaml` in deploy/kubernetes, with where it came from.
fn load() -> Vec<(String, Object)> {
    let mut files: Vec<_> = std::fs::read_dir(deploy_dir())
        .expect("deploy/kubernetes")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .collect();
    files.sort();
    assert!(files.len() >= 4, "rbac, prefill, decode, serve: {files:?}");
    let mut objects = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        for (i, document) in serde_yaml::Deserializer::from_str(&text).enumerate() {
            let at = format!("{name} document {}", i + 1);
            let value =
                serde_yaml::Value::deserialize(document).unwrap_or_else(|e| panic!("{at}: {e}"));
            if value.is_null() {
                continue; // an empty document (a trailing `---`)
            }
            let kind = value["kind"]
                .as_str()
                .unwrap_or_else(|| panic!("{at}: no kind"));
            let object = match kind {
                "ServiceAccount" => Object::ServiceAccount(strict(&value, &at)),
                "Role" => Object::Role(strict(&value, &at)),
                "RoleBinding" => Object::RoleBinding(strict(&value, &at)),
                "Service" => Object::Service(Box::new(strict(&value, &at))),
                "Deployment" => Object::Deployment(Box::new(strict(&value, &at))),
                other => panic!("{at}: unexpected kind {other}"),
            };
            objects.push((at, object));
        }
    }
    objects
}

/// A container's `--flag value` pairs (a flag followed by another flag or nothing: "").
fn flags(args: &[String]) -> BTreeMap<&str, &str> {
    let mut out = BTreeMap::new();
    let mut i = 1; // args[0] is the subcommand
    while i < args.len() {
        let flag = args[i].as_str();
        assert!(flag.starts_with("--"), "not a flag: {flag} in {args:?}");
        match args.get(i + 1).filter(|v| !v.starts_with("--")) {
            Some(value) => {
                out.insert(flag, value.as_str());
                i += 2;
            }
            None => {
                out.insert(flag, "");
                i += 1;
            }
        }
    }
    out
}

/// The binary's usage of `subcommand`, and whether it accepts `args` up to `--help`.
fn check_with_binary(args: &[String]) {
    let bin = env!("CARGO_BIN_EXE_prefill-router");
    let usage = Command::new(bin)
        .args([&args[0], "--help"])
        .output()
        .unwrap();
    let usage = String::from_utf8(usage.stdout).unwrap();
    assert!(usage.starts_with(&format!("usage: prefill-router {}", args[0])));
    for flag in flags(args).keys() {
        assert!(
            usage.contains(&format!("  {flag} ")),
            "{flag} is not a `{}` flag",
            args[0]
        );
    }
    let parsed = Command::new(bin).args(args).arg("--help").output().unwrap();
    assert!(
        parsed.status.success(),
        "the binary's parser refuses {args:?}: {}",
        String::from_utf8_lossy(&parsed.stderr)
    );
}

fn port_of(addr: &str) -> i32 {
    let addr: SocketAddr = addr
        .parse()
        .unwrap_or_else(|_| panic!("not ADDR:PORT: {addr}"));
    i32::from(addr.port())
}

/// The container port `port` names (a number, or a named container port).
fn resolve(port: &IntOrString, container: &Container) -> i32 {
    match port {
        IntOrString::Int(n) => *n,
        IntOrString::String(name) => {
            container
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some(name))
                .unwrap_or_else(|| panic!("no container port named {name}"))
                .container_port
        }
    }
}

fn pod_spec(deployment: &Deployment) -> &PodSpec {
    deployment
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
}

fn template_labels(deployment: &Deployment) -> BTreeMap<String, String> {
    let spec = deployment.spec.as_ref().unwrap();
    let labels = spec
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap_or_default();
    let selector = spec.selector.match_labels.clone().unwrap_or_default();
    assert!(!selector.is_empty(), "a Deployment selects by labels");
    for (k, v) in &selector {
        assert_eq!(
            labels.get(k),
            Some(v),
            "the selector matches the pod template"
        );
    }
    labels
}

/// The Service whose selector picks `deployment`'s pods (exactly one).
fn service_of<'a>(services: &[&'a Service], deployment: &Deployment) -> &'a Service {
    let labels = template_labels(deployment);
    let matching: Vec<_> = services
        .iter()
        .filter(|s| {
            let selector = s.spec.as_ref().and_then(|s| s.selector.as_ref());
            selector.is_some_and(|sel| {
                !sel.is_empty() && sel.iter().all(|(k, v)| labels.get(k) == Some(v))
            })
        })
        .collect();
    assert_eq!(
        matching.len(),
        1,
        "one Service selects {:?}",
        deployment.metadata.name
    );
    matching[0]
}

#[test]
fn the_manifests_give_the_backend_what_it_reads_and_nothing_more() {
    let objects = load();
    let of = |pick: fn(&Object) -> bool| objects.iter().filter(move |(_, o)| pick(o));
    let deployments: Vec<&Deployment> = objects
        .iter()
        .filter_map(|(_, o)| match o {
            Object::Deployment(d) => Some(&**d),
            _ => None,
        })
        .collect();
    let services: Vec<&Service> = objects
        .iter()
        .filter_map(|(_, o)| match o {
            Object::Service(s) => Some(&**s),
            _ => None,
        })
        .collect();
    let container = |d: &Deployment| -> Container {
        let spec = pod_spec(d);
        assert_eq!(spec.containers.len(), 1, "one container");
        spec.containers[0].clone()
    };
    let args = |d: &Deployment| container(d).args.unwrap_or_default();

    // serve: which Kubernetes namespace and which ServiceAccount.
    let serves: Vec<_> = deployments
        .iter()
        .filter(|d| args(d)[0] == "serve")
        .collect();
    assert_eq!(serves.len(), 1, "one serve Deployment");
    let serve = serves[0];
    let serve_args = args(serve);
    let serve_flags = flags(&serve_args);
    let k8s_namespace = serve_flags["--discovery"]
        .strip_prefix("k8s://")
        .expect("serve reads Kubernetes");
    let deployment_namespace = serve_flags["--namespace"];
    for (at, object) in &objects {
        let meta = match object {
            Object::ServiceAccount(o) => &o.metadata,
            Object::Role(o) => &o.metadata,
            Object::RoleBinding(o) => &o.metadata,
            Object::Service(o) => &o.metadata,
            Object::Deployment(o) => &o.metadata,
        };
        assert_eq!(
            meta.namespace.as_deref(),
            Some(k8s_namespace),
            "{at}: the namespace serve reads"
        );
    }
    check_with_binary(&serve_args);
    let account = pod_spec(serve)
        .service_account_name
        .clone()
        .expect("serve's ServiceAccount");
    assert_eq!(
        of(|o| matches!(o, Object::ServiceAccount(s) if s.metadata.name.as_deref() == Some("prefill-router")))
            .count(),
        1
    );
    assert_eq!(account, "prefill-router");
    let serve_service = service_of(&services, serve);
    let http = serve_service.spec.as_ref().unwrap().ports.as_ref().unwrap();
    assert!(http.iter().any(|p| p
        .target_port
        .as_ref()
        .map(|t| resolve(t, &container(serve)))
        == Some(port_of(serve_flags["--listen"]))));

    // RBAC: exactly list and watch on EndpointSlices and pods, bound to serve's account.
    let roles: Vec<&Role> = objects
        .iter()
        .filter_map(|(_, o)| match o {
            Object::Role(r) => Some(r),
            _ => None,
        })
        .collect();
    assert_eq!(roles.len(), 1);
    let role = roles[0];
    let mut granted = BTreeSet::new();
    for rule in role.rules.iter().flatten() {
        assert!(rule.resource_names.is_none() && rule.non_resource_urls.is_none());
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    granted.insert((group.as_str(), resource.as_str(), verb.as_str()));
                }
            }
        }
    }
    let needed = BTreeSet::from([
        ("discovery.k8s.io", "endpointslices", "list"),
        ("discovery.k8s.io", "endpointslices", "watch"),
        ("", "pods", "list"),
        ("", "pods", "watch"),
    ]);
    assert_eq!(granted, needed, "exactly what the backend calls");
    let bindings: Vec<&RoleBinding> = objects
        .iter()
        .filter_map(|(_, o)| match o {
            Object::RoleBinding(b) => Some(b),
            _ => None,
        })
        .collect();
    assert_eq!(bindings.len(), 1);
    let binding = bindings[0];
    assert_eq!(binding.role_ref.kind, "Role");
    assert_eq!(binding.role_ref.api_group, "rbac.authorization.k8s.io");
    assert_eq!(Some(&binding.role_ref.name), role.metadata.name.as_ref());
    assert!(binding
        .subjects
        .iter()
        .flatten()
        .any(|s| s.kind == "ServiceAccount"
            && s.name == account
            && s.namespace.as_deref() == Some(k8s_namespace)));

    // Workers.
    let mut roles_seen = BTreeSet::new();
    for worker in deployments.iter().filter(|d| args(d)[0] == "worker") {
        let name = worker.metadata.name.clone().unwrap_or_default();
        let worker_args = args(worker);
        check_with_binary(&worker_args);
        let f = flags(&worker_args);
        let role = f["--role"];
        roles_seen.insert(role.to_owned());
        assert_eq!(f["--discovery"], format!("k8s://{k8s_namespace}"), "{name}");
        assert_eq!(
            f["--namespace"], deployment_namespace,
            "{name}: serve's deployment namespace"
        );
        let c = container(worker);
        let spec = pod_spec(worker);
        let template = worker
            .spec
            .as_ref()
            .unwrap()
            .template
            .metadata
            .as_ref()
            .unwrap();

        // The Service the backend reads (its labels land on its EndpointSlices).
        let service = service_of(&services, worker);
        let labels = service.metadata.labels.clone().unwrap_or_default();
        assert_eq!(
            labels.get(NAMESPACE_LABEL).map(String::as_str),
            Some(f["--namespace"]),
            "{name}"
        );
        assert_eq!(
            labels.get(COMPONENT_LABEL).map(String::as_str),
            Some(role),
            "{name}"
        );
        assert_eq!(
            labels.get(ENDPOINT_LABEL).map(String::as_str),
            Some("generate"),
            "{name}"
        );
        let ports = service
            .spec
            .as_ref()
            .unwrap()
            .ports
            .clone()
            .unwrap_or_default();
        let plane = ports
            .iter()
            .find(|p| p.name.as_deref() == Some("request-plane"))
            .unwrap_or_else(|| panic!("{name}: a Service port named request-plane"));
        let target = plane
            .target_port
            .clone()
            .unwrap_or(IntOrString::Int(plane.port));
        assert_eq!(
            resolve(&target, &c),
            port_of(f["--listen"]),
            "{name}: the port serves --listen"
        );

        // The pod: the namespace label, the card, probes, its UID, the card file.
        let pod_labels = template.labels.clone().unwrap_or_default();
        assert_eq!(
            pod_labels.get(NAMESPACE_LABEL).map(String::as_str),
            Some(f["--namespace"]),
            "{name}"
        );
        let card = template
            .annotations
            .as_ref()
            .and_then(|a| a.get(CARD_ANNOTATION))
            .unwrap_or_else(|| panic!("{name}: the card annotation"));
        let card =
            ModelCard::from_json(card.as_bytes()).unwrap_or_else(|e| panic!("{name}: card: {e}"));
        if role == "prefill" {
            let mode = card.router_config.as_ref().map(|r| r.router_mode);
            assert_eq!(
                mode,
                Some(SelectionMode::KV),
                "the prefill card advertises KV routing"
            );
        }
        let health = port_of(f["--health-listen"]);
        let probe = |p: Option<&k8s_openapi::api::core::v1::Probe>, path: &str| {
            let get = p
                .and_then(|p| p.http_get.as_ref())
                .unwrap_or_else(|| panic!("{name}: {path} probe"));
            assert_eq!(get.path.as_deref(), Some(path));
            assert_eq!(
                resolve(&get.port, &c),
                health,
                "{name}: {path} on --health-listen"
            );
        };
        probe(c.readiness_probe.as_ref(), "/ready");
        probe(c.liveness_probe.as_ref(), "/live");
        let uid = c
            .env
            .iter()
            .flatten()
            .find(|e| e.name == "POD_UID")
            .expect("POD_UID");
        let field = uid
            .value_from
            .as_ref()
            .and_then(|v| v.field_ref.as_ref())
            .expect("from a fieldRef");
        assert_eq!(field.field_path, "metadata.uid");
        // --card is the file the downward API writes from the annotation.
        let card_path = Path::new(f["--card"]);
        let mount = c
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| card_path.starts_with(&m.mount_path))
            .unwrap_or_else(|| panic!("{name}: --card is on a mounted volume"));
        let volume = spec
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == mount.name)
            .unwrap();
        let item = volume
            .downward_api
            .as_ref()
            .and_then(|d| d.items.as_ref())
            .and_then(|items| {
                items
                    .iter()
                    .find(|i| Path::new(&mount.mount_path).join(&i.path) == card_path)
            })
            .unwrap_or_else(|| panic!("{name}: --card is a downward-API item"));
        let from = &item.field_ref.as_ref().expect("a fieldRef").field_path;
        assert_eq!(*from, format!("metadata.annotations['{CARD_ANNOTATION}']"));
        // No API access, and time to withdraw readiness and drain before SIGKILL.
        assert_eq!(spec.automount_service_account_token, Some(false), "{name}");
        let ms = |flag: &str, default: i64| f.get(flag).map_or(default, |v| v.parse().unwrap());
        let needed = ms("--unready-delay-ms", 5000) + ms("--drain-timeout-ms", 25000);
        let grace = spec
            .termination_grace_period_seconds
            .expect("a grace period");
        assert!(
            grace * 1000 > needed,
            "{name}: grace {grace} s vs {needed} ms"
        );
    }
    assert_eq!(
        roles_seen,
        BTreeSet::from(["decode".to_owned(), "prefill".to_owned()])
    );
}
