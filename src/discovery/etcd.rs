//! `EtcdDiscovery` (feature `etcd`): the distributed backend, on etcd leases and watches.
//!
//! - Records live under `<root><record key>` (default root `prefill-router/v1/instances/`),
//!   each attached to the registering process's lease; etcd deletes them when the lease
//!   expires, so a killed worker disappears within its TTL.
//! - Keep-alive: a task renews the lease every `keepalive_interval` over etcd's keep-alive
//!   stream, reopening the stream after an outage. If the lease expired meanwhile (the server
//!   was down longer than the TTL), the task grants a new lease and re-puts the record, unless
//!   a newer registration for the same instance owns the key. The same task revokes the
//!   lease when the registration is deregistered or dropped.
//! - Watch: list the prefix (revision R), then watch from R+1: no gap between the two. A
//!   broken stream (server restart, network), a cancelled watch or a compacted revision make
//!   the watch list again and watch from the new revision; the level-triggered diff of the new
//!   listing against what the watcher knows emits exactly the missed changes.
//! - Streams are half-closed and drained, never dropped open: see `close_keepalive`.
//! - Several endpoints: every call goes to one *pinned* member; a call that fails or times out
//!   moves the pin to the next member (see [`Members`]). A balanced channel over all members
//!   would keep sending a share of calls, and whole lease and watch streams, to a member that
//!   is stalled (a stopped or partitioned process still accepts TCP connections), until HTTP/2
//!   pings notice: long enough to lose a lease (the cluster fault suite showed it).
//! - Liveness within etcd's default keep-alive policy (`--grpc-keepalive-min-time` 5 s, no
//!   pings without an open stream): HTTP/2 pings only while a stream is open and at most every
//!   [`HTTP2_PING_INTERVAL`] (a faster pinger gets GOAWAY `too_many_pings`, which drops the
//!   connection and every watch on it). A stalled member is noticed by the streams themselves:
//!   a watch asks for a progress report ([`WATCH_PROBE_INTERVAL`] after it last heard
//!   anything; an application message, not a ping) and takes two unanswered asks as a broken
//!   stream; a lease renewal has a deadline.

use std::sync::atomic::{AtomicI64, AtomicUsize};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions};
use tokio::sync::oneshot;

use super::known::RawEvent;
use super::reach::Reachability;
use super::record::encode_record;
use super::store::{Backend, Gap, Leased, Listing};
use super::{DiscoveryError, Instance};
use crate::advert::ModelCard;

mod config;
mod lease;
mod members;

pub use config::EtcdConfig;
use lease::{keep_alive, EtcdLease, Owned};
use members::{bounded, etcd_err, Members};

/// The least time between two HTTP/2 pings on a connection to etcd, which pings only while a
/// stream (a watch, a lease keep-alive) is open. etcd's `--grpc-keepalive-min-time` (default
/// 5 s) must not exceed it: etcd answers pings faster than that with GOAWAY `too_many_pings`.
pub const HTTP2_PING_INTERVAL: Duration = Duration::from_secs(10);

/// How long a watch waits, after it last heard from etcd, before it asks for a progress report
/// (at most: a shorter [`EtcdConfig::request_timeout`] shortens it). Two unanswered asks in a
/// row break the stream, and it is reopened on the next member. Needs etcd 3.4 or later.
pub const WATCH_PROBE_INTERVAL: Duration = Duration::from_secs(2);

/// Discovery on etcd. Clones share the members' client connections.
#[derive(Clone)]
pub struct EtcdDiscovery {
    members: Arc<Members>,
    config: Arc<EtcdConfig>,
    reach: Arc<Reachability>,
}

impl std::fmt::Debug for EtcdDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdDiscovery")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl EtcdDiscovery {
    /// Connect to etcd: one lazily connected client per endpoint (a member that is down
    /// now is tried when the pin reaches it). Fails on an empty or malformed endpoint list.
    pub async fn connect(config: EtcdConfig) -> Result<Self, DiscoveryError> {
        let options = ConnectOptions::new()
            .with_connect_timeout(config.request_timeout)
            // HTTP/2 pings notice a silently dead connection, within etcd's keep-alive policy:
            // no faster than its default minimum (5 s) and never on a connection without an
            // open stream (etcd allows none there). Stalled members are found by the watches'
            // progress probes and the renewals' deadlines instead (module docs).
            .with_keep_alive(HTTP2_PING_INTERVAL, config.request_timeout)
            .with_keep_alive_while_idle(false)
            // A member cut off from the quorum refuses, rather than serving a stale view.
            .with_require_leader(true);
        if config.endpoints.is_empty() {
            return Err(DiscoveryError::Etcd("no etcd endpoints".into()));
        }
        let mut clients = Vec::with_capacity(config.endpoints.len());
        for endpoint in &config.endpoints {
            let connect = Client::connect([endpoint.as_str()], Some(options.clone()));
            clients.push(bounded(config.request_timeout, connect).await?);
        }
        Ok(EtcdDiscovery {
            members: Arc::new(Members {
                clients,
                pinned: AtomicUsize::new(0),
            }),
            config: Arc::new(config),
            reach: Arc::default(),
        })
    }

    /// The client of the member calls go to now (for tooling and tests).
    pub fn client(&self) -> Client {
        self.members.pick().1
    }
}

/// Keys relative to `root` with their values; keys outside it or not UTF-8 are skipped.
fn relative_kvs(root: &str, kvs: &[etcd_client::KeyValue]) -> Listing {
    kvs.iter()
        .filter_map(|kv| relative_key(root, kv.key()).map(|k| (k, kv.value().to_vec())))
        .collect()
}

fn relative_key(root: &str, key: &[u8]) -> Option<String> {
    match std::str::from_utf8(key)
        .ok()
        .and_then(|k| k.strip_prefix(root))
    {
        Some(rel) => Some(rel.to_owned()),
        None => {
            tracing::warn!(key = %String::from_utf8_lossy(key), "skipping foreign etcd key");
            None
        }
    }
}

/// One watch of a key prefix: after each listing at revision R, a watch stream from R + 1
/// (no gap between the two).
pub(crate) struct EtcdCursor {
    /// The full prefix, root included.
    prefix: String,
    stream: Option<etcd_client::WatchStream>,
    /// The member the stream is on.
    member: usize,
    /// When the stream last delivered anything (events or a progress report).
    heard: Instant,
    /// Progress reports asked for since then.
    asked: u32,
}

impl EtcdCursor {
    /// When to ask for the next progress report, or give up on the stream (`asked` ≥ 2).
    fn probe_at(&self, interval: Duration) -> Instant {
        self.heard + interval * (self.asked + 1)
    }
}

impl EtcdDiscovery {
    fn full_key(&self, key: &str) -> String {
        format!("{}{key}", self.config.root)
    }
}

impl Backend for EtcdDiscovery {
    type Cursor = EtcdCursor;

    async fn list(&self, prefix: &str) -> Result<Listing, DiscoveryError> {
        let key = self.full_key(prefix);
        let key = key.as_str();
        let resp = self
            .members
            .call(self.config.request_timeout, |mut c| async move {
                c.get(key, Some(GetOptions::new().with_prefix())).await
            })
            .await?;
        Ok(relative_kvs(&self.config.root, resp.kvs()))
    }

    fn subscribe(&self, prefix: String) -> EtcdCursor {
        EtcdCursor {
            prefix: self.full_key(&prefix),
            stream: None,
            member: 0,
            heard: Instant::now(),
            asked: 0,
        }
    }

    async fn resync(&self, cursor: &mut EtcdCursor) -> Result<Listing, DiscoveryError> {
        // A broken or cancelled stream is not worth closing politely: it is over already.
        cursor.stream = None;
        let limit = self.config.request_timeout;
        // Listing and watch on the same member, so the watch starts where the listing ended.
        let (member, mut client) = self.members.pick();
        let prefix = cursor.prefix.as_str();
        let listed = bounded(
            limit,
            client.get(prefix, Some(GetOptions::new().with_prefix())),
        )
        .await;
        let resp = listed.inspect_err(|_| self.members.failed(member))?;
        let revision = resp.header().map_or(0, |h| h.revision());
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        let stream = bounded(limit, client.watch(prefix, Some(options)))
            .await
            .inspect_err(|_| self.members.failed(member))?;
        cursor.stream = Some(stream);
        cursor.member = member;
        cursor.heard = Instant::now();
        cursor.asked = 0;
        Ok(relative_kvs(&self.config.root, resp.kvs()))
    }

    async fn changes(&self, cursor: &mut EtcdCursor, out: &mut Vec<RawEvent>) -> Result<(), Gap> {
        let interval = self.config.request_timeout.min(WATCH_PROBE_INTERVAL);
        let limit = self.config.request_timeout;
        let received = loop {
            let probe_at = cursor.probe_at(interval);
            let Some(stream) = cursor.stream.as_mut() else {
                return Err(Gap::Missed);
            };
            tokio::select! {
                // Cancel-safe: the stream keeps what it buffered.
                received = stream.message() => break received,
                _ = tokio::time::sleep_until(probe_at) => {}
            }
            if cursor.asked >= 2 {
                // A stalled member accepts the asks but answers nothing: move the pin on.
                self.members.failed(cursor.member);
                return Err(Gap::Broken(DiscoveryError::Etcd(format!(
                    "watch stalled: no progress report in {:?}",
                    cursor.heard.elapsed()
                ))));
            }
            cursor.asked += 1;
            let asked = tokio::time::timeout(limit, stream.request_progress()).await;
            if !matches!(asked, Ok(Ok(()))) {
                self.members.failed(cursor.member);
                return Err(Gap::Broken(DiscoveryError::Etcd(
                    "watch stream cannot take a progress request".into(),
                )));
            }
        };
        cursor.heard = Instant::now();
        cursor.asked = 0;
        let resp = match received {
            Ok(Some(resp)) => resp,
            Ok(None) => {
                return Err(Gap::Broken(DiscoveryError::Etcd(
                    "watch stream ended".into(),
                )))
            }
            Err(error) => return Err(Gap::Broken(etcd_err(error))),
        };
        if resp.canceled() || resp.compact_revision() > 0 {
            return Err(Gap::Broken(DiscoveryError::Etcd(format!(
                "watch cancelled (compacted at {}): {}",
                resp.compact_revision(),
                resp.cancel_reason()
            ))));
        }
        for event in resp.events() {
            let Some(kv) = event.kv() else { continue };
            let Some(key) = relative_key(&self.config.root, kv.key()) else {
                continue;
            };
            out.push(match event.event_type() {
                EventType::Put => RawEvent::Put(key, kv.value().to_vec()),
                EventType::Delete => RawEvent::Delete(key),
            });
        }
        Ok(())
    }

    async fn close(&self, cursor: EtcdCursor) {
        let Some(stream) = cursor.stream else { return };
        // Half-close so etcd ends the call; dropping it open would reset the stream (see
        // `close_keepalive`).
        let (requests, mut responses) = stream.split();
        drop(requests);
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            while let Ok(Some(_)) = responses.message().await {}
        })
        .await;
    }

    fn retry_interval(&self) -> Duration {
        self.config.retry_interval
    }

    fn reachability(&self) -> Option<&Reachability> {
        Some(&self.reach)
    }

    async fn put_leased(&self, key: String, instance: &Instance, card: &ModelCard) -> Leased {
        let config = &self.config;
        let members = &self.members;
        let limit = config.request_timeout;
        let key = self.full_key(&key);
        let bytes = encode_record(instance, card);
        let ttl = config.ttl_secs();
        let lease = members
            .call(limit, |mut c| async move { c.lease_grant(ttl, None).await })
            .await?
            .id();
        let put = members
            .call(limit, |mut c| {
                let (key, bytes) = (key.clone(), bytes.clone());
                async move {
                    c.put(key, bytes, Some(PutOptions::new().with_lease(lease)))
                        .await
                }
            })
            .await;
        if let Err(error) = put {
            // Best effort: the lease would expire on its own anyway.
            let _ = members
                .call(limit, |mut c| async move { c.lease_revoke(lease).await })
                .await;
            return Err(error);
        }
        let (stop, stop_rx) = oneshot::channel();
        tokio::spawn(keep_alive(
            Arc::clone(members),
            Arc::clone(config),
            Owned {
                key,
                bytes,
                lease: Arc::new(AtomicI64::new(lease)),
            },
            stop_rx,
        ));
        Ok(Box::new(EtcdLease {
            stop: Some(stop),
            // A revoke may try every member.
            timeout: limit * u32::try_from(members.clients.len()).unwrap_or(u32::MAX),
        }))
    }
}
