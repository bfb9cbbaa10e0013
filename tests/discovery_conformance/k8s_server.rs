//! A small in-test Kubernetes API server: the parts `KubernetesDiscovery` uses, no more.
//!
//! No cluster exists where these tests run, so this server is what the backend has been tried
//! against (hence "not yet tried on a real cluster" in `docs/kubernetes.md`). It serves, over
//! plain HTTP/1.1 (`Connection: close`), EndpointSlices (`discovery.k8s.io/v1`) and pods
//! (`v1`) of any namespace, with the API's semantics for:
//!
//! - list: `labelSelector` (equality terms), `limit` and `continue` (every page is of the
//!   first page's snapshot; a token whose snapshot is no longer current is `410 Expired`, as a
//!   real server answers once the snapshot is compacted), `metadata.resourceVersion`;
//! - watch (`watch=true`) from `resourceVersion`: the events after it in order (`ADDED`,
//!   `MODIFIED`, `DELETED`, one global version counter; an object entering or leaving the
//!   label selection is `ADDED` or `DELETED`), then live ones, `BOOKMARK`s when
//!   asked for (`allowWatchBookmarks`), ending after `timeoutSeconds`; a version older than
//!   the compacted history gets an `ERROR` event with a `410` status, as Kubernetes sends it;
//! - faults: the next requests answered with 401/403/500 `Status` bodies, open watches
//!   dropped without ending their chunked body (a lost connection), or sent a `410` error;
//!   a restart ([`K8sServer::stop`], then [`K8sServer::resume`] on the same port): every
//!   connection cut, the objects and versions kept (they live in etcd, not in the server).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// The two kinds the backend reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Kind {
    Slice,
    Pod,
}

impl Kind {
    fn meta(self) -> (&'static str, &'static str) {
        match self {
            Kind::Slice => ("discovery.k8s.io/v1", "EndpointSlice"),
            Kind::Pod => ("v1", "Pod"),
        }
    }
}

/// One change: its version, the object after it (before it, for a deletion) and before it.
struct Change {
    version: u64,
    kind: Kind,
    deleted: bool,
    object: Value,
    previous: Option<Value>,
}

#[derive(Default)]
struct State {
    version: u64,
    objects: BTreeMap<(Kind, String), Value>,
    /// Every change after `compacted`.
    history: Vec<Change>,
    compacted: u64,
    /// Statuses the next requests are answered with.
    failures: VecDeque<u16>,
}

/// What open watches are told to do, beyond following the history.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Order {
    Run,
    /// Deliver nothing new for now (a slow server; changes pile up in the history).
    Hold,
    /// Drop the connection without ending the body.
    Drop,
    /// Send a 410 `ERROR` event and end.
    Gone,
}

/// The server; dropping it stops accepting and cuts every open connection.
pub(crate) struct K8sServer {
    pub(crate) url: String,
    addr: std::net::SocketAddr,
    state: Arc<Mutex<State>>,
    changed: watch::Sender<u64>,
    orders: watch::Sender<(u64, Order)>,
    /// The accept loop, which owns the listener and every connection's task (`None` while
    /// stopped).
    accept: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for K8sServer {
    fn drop(&mut self) {
        if let Some(accept) = self.accept.lock().unwrap().take() {
            accept.abort();
        }
    }
}

/// Accept on `listener` until aborted; the connections' tasks live in a `JoinSet` owned by
/// this loop, so aborting it closes the listener and cuts every connection at once.
fn accept_loop(listener: TcpListener, server: Shared) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut connections = tokio::task::JoinSet::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((socket, _)) => {
                        connections.spawn(server.clone().serve(socket));
                    }
                    Err(_) => return,
                },
                Some(_) = connections.join_next() => {}
            }
        }
    })
}

impl K8sServer {
    pub(crate) async fn start() -> K8sServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = K8sServer {
            url: format!("http://{addr}"),
            addr,
            state: Arc::default(),
            changed: watch::channel(0).0,
            orders: watch::channel((0, Order::Run)).0,
            accept: Mutex::new(None),
        };
        server.listen(listener);
        server
    }

    /// Serve on `listener` (the accept loop shares the server's state and orders).
    fn listen(&self, listener: TcpListener) {
        let shared = Shared {
            state: Arc::clone(&self.state),
            changed: self.changed.clone(),
            orders: self.orders.clone(),
        };
        *self.accept.lock().unwrap() = Some(accept_loop(listener, shared));
    }

    /// The server process goes away: the listener closes and every open connection (watches
    /// mid-body included) is cut. The objects, versions and history stay, as they do in etcd;
    /// `put` and `delete` still work meanwhile (another replica writing to the same etcd).
    pub(crate) async fn stop(&self) {
        let accept = self.accept.lock().unwrap().take();
        if let Some(accept) = accept {
            accept.abort();
            // Aborting is asynchronous: wait until the listener and connections are dropped.
            let _ = accept.await;
        }
    }

    /// The server comes back on the same address with the state it had: clients reconnect to
    /// the URL they know; watches are gone and must be reopened.
    pub(crate) async fn resume(&self) {
        // tokio's listener sets SO_REUSEADDR, so the port is free again at once.
        self.listen(TcpListener::bind(self.addr).await.unwrap());
    }

    /// Create or replace an object (`metadata.name` names it); `ADDED` or `MODIFIED`.
    pub(crate) fn put(&self, kind: Kind, mut object: Value) {
        let (api_version, kind_name) = kind.meta();
        let name = object["metadata"]["name"].as_str().unwrap().to_owned();
        let mut state = self.state.lock().unwrap();
        state.version += 1;
        let version = state.version;
        object["apiVersion"] = json!(api_version);
        object["kind"] = json!(kind_name);
        object["metadata"]["resourceVersion"] = json!(version.to_string());
        let previous = state.objects.insert((kind, name), object.clone());
        state.history.push(Change {
            version,
            kind,
            deleted: false,
            object,
            previous,
        });
        drop(state);
        self.changed.send_replace(version);
    }

    /// Delete an object if present; `DELETED` with its last state.
    pub(crate) fn delete(&self, kind: Kind, name: &str) {
        let mut state = self.state.lock().unwrap();
        let Some(mut object) = state.objects.remove(&(kind, name.to_owned())) else {
            return;
        };
        state.version += 1;
        let version = state.version;
        object["metadata"]["resourceVersion"] = json!(version.to_string());
        state.history.push(Change {
            version,
            kind,
            deleted: true,
            previous: Some(object.clone()),
            object,
        });
        drop(state);
        self.changed.send_replace(version);
    }

    /// Forget the history up to now: watches from older versions get `410`.
    pub(crate) fn compact(&self) {
        let mut state = self.state.lock().unwrap();
        state.compacted = state.version;
        state.history.clear();
    }

    /// Answer the next requests with these HTTP statuses.
    pub(crate) fn fail_next(&self, statuses: &[u16]) {
        self.state.lock().unwrap().failures.extend(statuses);
    }

    fn order(&self, order: Order) {
        self.orders.send_modify(|(n, o)| {
            *n += 1;
            *o = order;
        });
    }

    /// Open watches deliver nothing new until the next order (later watches run normally).
    pub(crate) fn hold_watches(&self) {
        self.order(Order::Hold);
    }

    /// Held watches deliver again (from where they were, or a `410` if that was compacted).
    pub(crate) fn release_watches(&self) {
        self.order(Order::Run);
    }

    /// Cut every open watch's connection mid-body; later watches run normally.
    pub(crate) fn drop_watches(&self) {
        self.order(Order::Drop);
    }

    /// Send every open watch a `410 Gone` error event; later watches run normally.
    pub(crate) fn expire_watches(&self) {
        self.order(Order::Gone);
    }
}

#[derive(Clone)]
struct Shared {
    state: Arc<Mutex<State>>,
    changed: watch::Sender<u64>,
    orders: watch::Sender<(u64, Order)>,
}

/// A parsed request target.
struct Query {
    kind: Kind,
    namespace: String,
    params: BTreeMap<String, String>,
}

fn parse_target(target: &str) -> Option<Query> {
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (namespace, kind) = match parts.as_slice() {
        ["api", "v1", "namespaces", ns, "pods"] => (ns, Kind::Pod),
        ["apis", "discovery.k8s.io", "v1", "namespaces", ns, "endpointslices"] => (ns, Kind::Slice),
        _ => return None,
    };
    let params = query
        .split('&')
        .filter_map(|p| p.split_once('='))
        .map(|(k, v)| (k.to_owned(), decode(v)))
        .collect();
    Some(Query {
        kind,
        namespace: (*namespace).to_owned(),
        params,
    })
}

fn decode(value: &str) -> String {
    let mut out = Vec::new();
    let mut bytes = value.bytes();
    while let Some(b) = bytes.next() {
        match b {
            b'%' => {
                let hex = [bytes.next().unwrap_or(b'0'), bytes.next().unwrap_or(b'0')];
                let hex = std::str::from_utf8(&hex).unwrap_or("00");
                out.push(u8::from_str_radix(hex, 16).unwrap_or(b'?'));
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl Query {
    /// Equality terms of `labelSelector` and the namespace.
    fn selects(&self, object: &Value) -> bool {
        if object["metadata"]["namespace"].as_str() != Some(self.namespace.as_str()) {
            return false;
        }
        let selector = self.params.get("labelSelector").map_or("", String::as_str);
        selector.split(',').filter(|t| !t.is_empty()).all(|term| {
            let (key, value) = term.split_once('=').unwrap_or((term, ""));
            object["metadata"]["labels"][key].as_str() == Some(value.trim_start_matches('='))
        })
    }
}

impl Query {
    /// What a watch with this selector sees of a change: an object entering the selection is
    /// `ADDED`, one leaving it `DELETED`, as Kubernetes reports them.
    fn event(&self, change: &Change) -> Option<(&'static str, Value)> {
        let now = !change.deleted && self.selects(&change.object);
        let before = change.previous.as_ref().is_some_and(|p| self.selects(p));
        let type_ = match (before, now) {
            (false, false) => return None,
            (false, true) => "ADDED",
            (true, true) => "MODIFIED",
            (true, false) => "DELETED",
        };
        Some((type_, change.object.clone()))
    }
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

impl Shared {
    async fn serve(self, mut socket: TcpStream) {
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match socket.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        let head = String::from_utf8_lossy(&head).into_owned();
        let target = head.split(' ').nth(1).unwrap_or("/").to_owned();
        let failure = self.state.lock().unwrap().failures.pop_front();
        if let Some(code) = failure {
            let reason = match code {
                401 => "Unauthorized",
                403 => "Forbidden",
                _ => "InternalError",
            };
            let body = status(code, reason, "injected by the test");
            return respond(&mut socket, code, &body).await;
        }
        let Some(query) = parse_target(&target) else {
            return respond(&mut socket, 404, &status(404, "NotFound", "no such path")).await;
        };
        if query.params.get("watch").map(String::as_str) == Some("true") {
            self.watch(socket, query).await;
        } else {
            let (code, body) = self.list(&query);
            respond(&mut socket, code, &body).await;
        }
    }

    fn list(&self, query: &Query) -> (u16, Value) {
        let state = self.state.lock().unwrap();
        let (snapshot, after) = match query.params.get("continue") {
            Some(token) => {
                let (version, last) = token.split_once(':').unwrap_or(("0", ""));
                if version != state.version.to_string() {
                    let message = "The provided continue parameter is too old";
                    return (410, status(410, "Expired", message));
                }
                (state.version, Some(last.to_owned()))
            }
            None => (state.version, None),
        };
        let limit: usize = query
            .params
            .get("limit")
            .and_then(|l| l.parse().ok())
            .unwrap_or(usize::MAX);
        let mut items: Vec<(&String, &Value)> = state
            .objects
            .iter()
            .filter(|((kind, name), object)| {
                *kind == query.kind
                    && after.as_ref().is_none_or(|after| name > after)
                    && query.selects(object)
            })
            .map(|((_, name), object)| (name, object))
            .collect();
        let more = items.len() > limit;
        items.truncate(limit);
        let mut metadata = json!({"resourceVersion": snapshot.to_string()});
        if more {
            let last = items.last().map_or("", |(name, _)| name.as_str());
            metadata["continue"] = json!(format!("{snapshot}:{last}"));
        }
        let (api_version, kind) = query.kind.meta();
        let items: Vec<Value> = items.into_iter().map(|(_, o)| o.clone()).collect();
        let body = json!({"apiVersion": api_version, "kind": format!("{kind}List"),
                          "metadata": metadata, "items": items});
        (200, body)
    }

    async fn watch(self, mut socket: TcpStream, query: Query) {
        let from: u64 = query
            .params
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let bookmarks = query.params.get("allowWatchBookmarks").map(String::as_str) == Some("true");
        let timeout: u64 = query
            .params
            .get("timeoutSeconds")
            .and_then(|t| t.parse().ok())
            .unwrap_or(300);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout);
        let head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\
                    Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
        if socket.write_all(head.as_bytes()).await.is_err() {
            return;
        }
        let mut changed = self.changed.subscribe();
        let mut orders = self.orders.subscribe();
        let seen_order = orders.borrow_and_update().0;
        let mut order = Order::Run;
        let mut sent = from;
        let (api_version, kind) = query.kind.meta();
        loop {
            // Seen before reading, so a change made after the read wakes the loop.
            changed.borrow_and_update();
            if order == Order::Run {
                let (events, newest, compacted) = {
                    let state = self.state.lock().unwrap();
                    let events: Vec<(&'static str, Value)> = state
                        .history
                        .iter()
                        .filter(|c| c.version > sent && c.kind == query.kind)
                        .filter_map(|c| query.event(c))
                        .collect();
                    (events, state.version, sent < state.compacted)
                };
                if compacted {
                    let message = format!("too old resource version: {sent}");
                    let event =
                        json!({"type": "ERROR", "object": status(410, "Expired", &message)});
                    let _ = chunk(&mut socket, &event).await;
                    return end(socket).await;
                }
                for (type_, object) in events {
                    if chunk(&mut socket, &json!({"type": type_, "object": object}))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                // Versions of other kinds or objects advance the watch too.
                sent = newest;
            }
            tokio::select! {
                _ = changed.changed() => {}
                _ = orders.changed() => {
                    let (n, new) = *orders.borrow_and_update();
                    if n > seen_order {
                        order = new;
                    }
                    match order {
                        Order::Drop => return, // no final chunk: the body is cut short
                        Order::Gone => {
                            let event = json!({"type": "ERROR",
                                "object": status(410, "Expired", "too old resource version")});
                            let _ = chunk(&mut socket, &event).await;
                            return end(socket).await;
                        }
                        Order::Run | Order::Hold => {}
                    }
                }
                _ = tokio::time::sleep(Duration::from_millis(200)), if bookmarks && order == Order::Run => {
                    let mark = json!({"type": "BOOKMARK", "object": {"apiVersion": api_version,
                        "kind": kind, "metadata": {"resourceVersion": sent.to_string()}}});
                    if chunk(&mut socket, &mark).await.is_err() {
                        return;
                    }
                }
                _ = tokio::time::sleep_until(deadline) => return end(socket).await,
            }
        }
    }
}

async fn chunk(socket: &mut TcpStream, event: &Value) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(event).unwrap();
    line.push(b'\n');
    socket
        .write_all(format!("{:x}\r\n", line.len()).as_bytes())
        .await?;
    socket.write_all(&line).await?;
    socket.write_all(b"\r\n").await
}

async fn end(mut socket: TcpStream) {
    let _ = socket.write_all(b"0\r\n\r\n").await;
    let _ = socket.shutdown().await;
}

async fn respond(socket: &mut TcpStream, code: u16, body: &Value) {
    let body = serde_json::to_vec(body).unwrap();
    let head = format!(
        "HTTP/1.1 {code} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    let _ = socket.write_all(head.as_bytes()).await;
    let _ = socket.write_all(&body).await;
    let _ = socket.shutdown().await;
}
