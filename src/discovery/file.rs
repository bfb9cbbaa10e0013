//! `FileDiscovery`: the embedded default. A directory shared by every process on one host.
//!
//! Layout: `<root>/v1/instances/<file name>`, one JSON record per instance; the file name is
//! the record key with `/` replaced by `.` (key segments are percent-encoded and never hold a
//! `.`, so the mapping is reversible and names never start with a dot). Temp files start with
//! `.tmp-` and are ignored by readers.
//!
//! - Publish: write a temp file in the same directory, then `rename` over the name (atomic: a
//!   reader sees the old record or the new one, never a torn one). Re-registering overwrites.
//! - Lease: the file's mtime is its heartbeat; the registration's own OS thread touches it
//!   every `keepalive_interval` (a thread, not a task: a busy runtime cannot starve it). A file whose mtime is older than `ttl` is expired: readers ignore
//!   it, and every process's reaper deletes it (so a survivor reaps a killed worker's record).
//! - Watch: one inotify watcher (via `notify`) per store per process, fanned out to every
//!   watch; a changed name is re-read, so the event kind never has to be trusted. Keep-alive
//!   touches (data/metadata modifications) are ignored. A lagging subscriber, an inotify
//!   overflow, and a periodic timer (`resync_interval`, the safety net) all trigger a full
//!   resync, which the level-triggered diff turns into exactly the missed changes. If inotify
//!   is unavailable, the watch falls back to polling at `resync_interval`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use notify::event::ModifyKind;
use notify::{EventKind, RecursiveMode, Watcher};
use tokio::sync::broadcast;

use super::api::{fresh_owner, Lease, StopFlag};
use super::known::RawEvent;
use super::reach::Reachability;
use super::record::{decode_owned_record, encode_owned_record};
use super::store::{Backend, Gap, Leased, Listing, Reaper};
use super::{DiscoveryError, Instance};
use crate::advert::ModelCard;

/// Where a [`FileDiscovery`] keeps its records, and its lease timing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileConfig {
    /// The store's root directory (created if missing).
    pub root: PathBuf,
    /// How long a record outlives its last heartbeat.
    pub ttl: Duration,
    /// How often a registration touches its file (must be well under `ttl`).
    pub keepalive_interval: Duration,
    /// How often this process deletes expired records.
    pub reap_interval: Duration,
    /// How often a watch re-lists the directory as a safety net (and notices expiries).
    pub resync_interval: Duration,
}

impl FileConfig {
    /// A store at `root` with a 10 s TTL (Dynamo's), heartbeats and reaping every third of it,
    /// and a resync every 5 s.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        FileConfig::with_ttl(root, Duration::from_secs(10))
    }

    /// A store at `root` with the given TTL; heartbeats and reaping every third of it, and a
    /// resync every half of it.
    pub fn with_ttl(root: impl Into<PathBuf>, ttl: Duration) -> Self {
        FileConfig {
            root: root.into(),
            ttl,
            keepalive_interval: ttl / 3,
            reap_interval: ttl / 3,
            resync_interval: ttl / 2,
        }
    }

    /// The default root: `$PREFILL_DISCOVERY_DIR`, else `<temp dir>/prefill-router-discovery`.
    pub fn default_root() -> PathBuf {
        std::env::var_os("PREFILL_DISCOVERY_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| std::env::temp_dir().join("prefill-router-discovery"))
    }
}

impl Default for FileConfig {
    fn default() -> Self {
        FileConfig::new(FileConfig::default_root())
    }
}

/// A directory-backed discovery store shared by the processes of one host. Clones share
/// one inotify watcher and one reaper.
#[derive(Clone, Debug)]
pub struct FileDiscovery {
    inner: Arc<Inner>,
}

/// A change the inotify thread reports to watches.
#[derive(Clone, Debug)]
enum FsSignal {
    /// These record files may have changed: re-read them.
    Changed(Vec<String>),
    /// Events were lost (queue overflow or watcher error): re-list everything.
    Rescan,
}

/// How many inotify signals a slow watch may fall behind before it resyncs.
const SIGNAL_CAPACITY: usize = 1024;

struct Inner {
    config: FileConfig,
    dir: PathBuf,
    /// The shared watcher, created by the first watch. `None` inside once creation failed.
    watcher: Mutex<Option<WatcherSlot>>,
    reaper: Reaper,
    reach: Reachability,
}

enum WatcherSlot {
    Live {
        // Held only to keep the inotify watch alive.
        _watcher: notify::RecommendedWatcher,
        signals: broadcast::Sender<FsSignal>,
    },
    Unavailable,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileDiscovery")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn key_to_name(key: &str) -> String {
    key.replace('/', ".")
}

fn name_to_key(name: &str) -> String {
    name.replace('.', "/")
}

fn is_record_name(name: &str) -> bool {
    !name.is_empty() && !name.starts_with('.')
}

fn is_fresh(modified: SystemTime, ttl: Duration, now: SystemTime) -> bool {
    // An mtime in the future (clock step) counts as fresh rather than expired.
    now.duration_since(modified).map_or(true, |age| age <= ttl)
}

/// Read one record file if it exists and is fresh.
fn read_fresh(path: &Path, ttl: Duration) -> std::io::Result<Option<Vec<u8>>> {
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    if !is_fresh(meta.modified()?, ttl, SystemTime::now()) {
        return Ok(None);
    }
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// List the fresh records whose file names start with `name_prefix`, as (key, bytes).
fn scan(dir: &Path, name_prefix: &str, ttl: Duration) -> std::io::Result<Vec<(String, Vec<u8>)>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry?;
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue; // not ours: our names are ASCII
        };
        if !is_record_name(&name) || !name.starts_with(name_prefix) {
            continue;
        }
        if let Some(bytes) = read_fresh(&entry.path(), ttl)? {
            out.push((name_to_key(&name), bytes));
        }
    }
    Ok(out)
}

/// Atomically publish `bytes` as `dir/name`: temp file in the same directory, then rename.
fn publish(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut tmp = tempfile::Builder::new().prefix(".tmp-").tempfile_in(dir)?;
    tmp.write_all(bytes)?;
    tmp.persist(dir.join(name)).map_err(|e| e.error)?;
    Ok(())
}

/// What a heartbeat found.
enum Beat {
    /// Our record, touched.
    Renewed,
    /// No record (reaped while we were stalled): republish.
    Missing,
    /// Another registration owns the record now.
    Superseded,
}

fn heartbeat(path: &Path, key: &str, owner: u64) -> std::io::Result<Beat> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Beat::Missing),
        Err(e) => return Err(e),
    };
    match decode_owned_record(key, &bytes) {
        Ok((_, _, found)) if found == owner => {
            let file = std::fs::OpenOptions::new().write(true).open(path)?;
            file.set_modified(SystemTime::now())?;
            Ok(Beat::Renewed)
        }
        _ => Ok(Beat::Superseded),
    }
}

/// Delete `path` if its record still belongs to `owner`.
fn remove_owned(path: &Path, key: &str, owner: u64) {
    let owned = std::fs::read(path)
        .ok()
        .and_then(|bytes| decode_owned_record(key, &bytes).ok())
        .is_some_and(|(_, _, found)| found == owner);
    if owned {
        if let Err(error) = std::fs::remove_file(path) {
            if error.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %path.display(), %error, "cannot remove discovery record");
            }
        }
    }
}

/// Delete every expired file (records and abandoned temp files).
fn reap(dir: &Path, ttl: Duration) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let now = SystemTime::now();
    for entry in entries.flatten() {
        let expired = entry
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|modified| !is_fresh(modified, ttl, now));
        if expired {
            tracing::debug!(path = %entry.path().display(), "file discovery: reaping expired record");
            // Another process may reap it first.
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, DiscoveryError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|_| DiscoveryError::Closed)
}

impl Inner {
    /// Subscribe to the shared watcher, creating it on first use. `None`: poll only.
    fn subscribe(self: &Arc<Self>) -> Option<broadcast::Receiver<FsSignal>> {
        let mut slot = self.watcher.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            *slot = Some(match self.start_watcher() {
                Ok(live) => live,
                Err(error) => {
                    tracing::warn!(dir = %self.dir.display(), %error,
                        "inotify unavailable; file discovery watches fall back to polling");
                    WatcherSlot::Unavailable
                }
            });
        }
        match slot.as_ref() {
            Some(WatcherSlot::Live { signals, .. }) => Some(signals.subscribe()),
            _ => None,
        }
    }

    fn start_watcher(&self) -> Result<WatcherSlot, DiscoveryError> {
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| DiscoveryError::io("creating the discovery directory", e))?;
        let (signals, _) = broadcast::channel(SIGNAL_CAPACITY);
        let tx = signals.clone();
        let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            let signal = match res {
                Err(error) => {
                    tracing::warn!(%error, "file discovery watcher error; resyncing");
                    FsSignal::Rescan
                }
                Ok(event) if event.need_rescan() => FsSignal::Rescan,
                Ok(event) => match event.kind {
                    // Opens, closes and heartbeat touches change no record.
                    EventKind::Access(_)
                    | EventKind::Modify(ModifyKind::Data(_))
                    | EventKind::Modify(ModifyKind::Metadata(_)) => return,
                    _ => {
                        let names: Vec<String> = event
                            .paths
                            .iter()
                            .filter_map(|p| p.file_name()?.to_str().map(str::to_owned))
                            .filter(|n| is_record_name(n))
                            .collect();
                        if names.is_empty() {
                            return;
                        }
                        FsSignal::Changed(names)
                    }
                },
            };
            // No subscriber is fine.
            let _ = tx.send(signal);
        })
        .map_err(|e| DiscoveryError::Watch(e.to_string()))?;
        watcher
            .watch(&self.dir, RecursiveMode::NonRecursive)
            .map_err(|e| DiscoveryError::Watch(e.to_string()))?;
        Ok(WatcherSlot::Live {
            _watcher: watcher,
            signals,
        })
    }

    async fn list(&self, key_prefix: &str) -> Result<Listing, DiscoveryError> {
        let dir = self.dir.clone();
        let prefix = key_to_name(key_prefix);
        let ttl = self.config.ttl;
        blocking(move || scan(&dir, &prefix, ttl))
            .await?
            .map_err(|e| DiscoveryError::io("listing the discovery directory", e))
    }
}

impl FileDiscovery {
    /// A store with the given configuration. Nothing touches the disk until the first call;
    /// background tasks start with the first async call, so this needs no runtime.
    pub fn new(config: FileConfig) -> Self {
        let dir = config.root.join("v1").join("instances");
        FileDiscovery {
            inner: Arc::new(Inner {
                config,
                dir,
                watcher: Mutex::new(None),
                reaper: Reaper::default(),
                reach: Reachability::default(),
            }),
        }
    }

    /// The directory holding the record files.
    pub fn records_dir(&self) -> &Path {
        &self.inner.dir
    }
}

/// Re-read each changed record: its current state, whatever the event said, becomes a `Put`
/// (fresh record) or a `Delete` (gone or expired). A failed read is a gap: only a full listing
/// can tell what is there now.
async fn reread(
    inner: &Arc<Inner>,
    names: Vec<String>,
    out: &mut Vec<RawEvent>,
) -> Result<(), Gap> {
    for name in names {
        let (path, ttl) = (inner.dir.join(&name), inner.config.ttl);
        match blocking(move || read_fresh(&path, ttl)).await {
            Ok(Ok(Some(bytes))) => out.push(RawEvent::Put(name_to_key(&name), bytes)),
            Ok(Ok(None)) => out.push(RawEvent::Delete(name_to_key(&name))),
            Ok(Err(error)) => {
                tracing::warn!(name, %error, "cannot read discovery record; resyncing");
                return Err(Gap::Missed);
            }
            Err(_) => return Err(Gap::Closed),
        }
    }
    Ok(())
}

/// The next inotify signal, or never if this watch polls.
async fn next_signal(
    signals: &mut Option<broadcast::Receiver<FsSignal>>,
) -> Result<FsSignal, broadcast::error::RecvError> {
    match signals {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

struct FileLease {
    path: PathBuf,
    key: String,
    owner: u64,
    /// Shared with the heartbeat thread, which exits as soon as it is set.
    stop: Arc<StopFlag>,
}

#[async_trait::async_trait]
impl Lease for FileLease {
    async fn revoke(self: Box<Self>) -> Result<(), DiscoveryError> {
        blocking(move || self.release()).await
    }

    fn abandon(self: Box<Self>) {
        self.stop.stop_then(|| ());
    }

    fn release(self: Box<Self>) {
        self.stop
            .stop_then(|| remove_owned(&self.path, &self.key, self.owner));
    }
}

/// One watch's share of the inotify watcher, and its safety-net timer.
pub(crate) struct FileCursor {
    key_prefix: String,
    name_prefix: String,
    /// `None`: inotify is unavailable or gone; the timer alone drives resyncs (polling).
    signals: Option<broadcast::Receiver<FsSignal>>,
    tick: tokio::time::Interval,
}

impl Backend for FileDiscovery {
    type Cursor = FileCursor;

    async fn list(&self, prefix: &str) -> Result<Listing, DiscoveryError> {
        // Lists start the reaper too: a frontend that only lists still clears dead workers.
        self.ensure_reaper();
        self.inner.list(prefix).await
    }

    fn subscribe(&self, key_prefix: String) -> FileCursor {
        // Subscribed before the first listing: no change in between is missed (and a change
        // replayed after it is re-read, so it reports the current state, never a stale one).
        let signals = self.inner.subscribe();
        let period = self
            .inner
            .config
            .resync_interval
            .max(Duration::from_millis(10));
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        FileCursor {
            name_prefix: key_to_name(&key_prefix),
            key_prefix,
            signals,
            tick,
        }
    }

    async fn resync(&self, cursor: &mut FileCursor) -> Result<Listing, DiscoveryError> {
        self.list(&cursor.key_prefix).await
    }

    async fn changes(&self, cursor: &mut FileCursor, out: &mut Vec<RawEvent>) -> Result<(), Gap> {
        loop {
            tokio::select! {
                _ = cursor.tick.tick() => return Err(Gap::Missed),
                signal = next_signal(&mut cursor.signals) => match signal {
                    Ok(FsSignal::Changed(names)) => {
                        let relevant: Vec<String> = names
                            .into_iter()
                            .filter(|n| n.starts_with(&cursor.name_prefix))
                            .collect();
                        if !relevant.is_empty() {
                            return reread(&self.inner, relevant, out).await;
                        }
                    }
                    Ok(FsSignal::Rescan) => return Err(Gap::Missed),
                    Err(broadcast::error::RecvError::Lagged(missed)) => {
                        tracing::debug!(missed, "file discovery watch lagged; resyncing");
                        return Err(Gap::Missed);
                    }
                    // The watcher is gone (store dropped mid-flight): keep polling.
                    Err(broadcast::error::RecvError::Closed) => cursor.signals = None,
                },
            }
        }
    }

    fn retry_interval(&self) -> Duration {
        // A failed listing is retried at the safety net's pace.
        self.inner
            .config
            .resync_interval
            .max(Duration::from_millis(10))
    }

    fn reachability(&self) -> Option<&Reachability> {
        Some(&self.inner.reach)
    }

    async fn put_leased(&self, key: String, instance: &Instance, card: &ModelCard) -> Leased {
        let name = key_to_name(&key);
        let path = self.inner.dir.join(&name);
        let owner = fresh_owner();
        let bytes: Arc<[u8]> = encode_owned_record(instance, card, owner).into();
        let dir = self.inner.dir.clone();
        {
            let (dir, name, bytes) = (dir.clone(), name.clone(), Arc::clone(&bytes));
            blocking(move || publish(&dir, &name, &bytes))
                .await?
                .map_err(|e| DiscoveryError::io("publishing a discovery record", e))?;
        }
        let stop = Arc::new(StopFlag::default());
        let period = self
            .inner
            .config
            .keepalive_interval
            .max(Duration::from_millis(1));
        // The heartbeat runs on its own OS thread, as upstream's does: a tokio runtime busy
        // with model work cannot starve it into a false expiry. It is a read and a touch of
        // one small file per tick, under the stop flag so it cannot race a release.
        {
            let (path_for_error, key_for_error) = (path.clone(), key.clone());
            let (path, key, stop) = (path.clone(), key.clone(), Arc::clone(&stop));
            std::thread::Builder::new()
                .name("prefill-discovery-heartbeat".into())
                .spawn(move || {
                    while !stop.sleep(period) {
                        let mut go_on = true;
                        stop.unless_stopped(|| match heartbeat(&path, &key, owner) {
                            Ok(Beat::Renewed) => {}
                            Ok(Beat::Missing) => {
                                tracing::warn!(key, "discovery record vanished while alive; republishing");
                                if let Err(error) = publish(&dir, &name, &bytes) {
                                    tracing::warn!(key, %error, "cannot republish discovery record");
                                }
                            }
                            Ok(Beat::Superseded) => {
                                tracing::debug!(key, "registration superseded; keep-alive stops");
                                go_on = false;
                            }
                            Err(error) => tracing::warn!(key, %error, "discovery heartbeat failed"),
                        });
                        if !go_on {
                            return;
                        }
                    }
                })
                .map_err(|e| {
                    // Without a heartbeat the record would linger for a TTL: take it back.
                    remove_owned(&path_for_error, &key_for_error, owner);
                    DiscoveryError::io("starting the heartbeat thread", e)
                })?;
        }
        Ok(Box::new(FileLease {
            path,
            key,
            owner,
            stop,
        }))
    }

    /// This process's reaper. It also sweeps right away, so stale files left by processes
    /// that died while nobody was running are cleared at start-up.
    fn ensure_reaper(&self) {
        let period = self.inner.config.reap_interval;
        self.inner.reaper.start(&self.inner, period, |inner| {
            let (dir, ttl) = (inner.dir.clone(), inner.config.ttl);
            // Not held across the sweep: the store may be dropped meanwhile.
            drop(inner);
            async move { blocking(move || reap(&dir, ttl)).await.is_ok() }
        });
    }
}
