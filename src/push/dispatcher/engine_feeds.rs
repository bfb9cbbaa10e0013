//! Engine KV events in KV mode (feature `engine`): one feed per engine of the routable view,
//! started as the engine joins, stopped as it leaves discovery, each feeding the dispatcher's
//! index through a sink of its own (`engine::kv_events` does the subscribing and mirroring),
//! and, when the link scrapes engine load, its readings onto the dispatcher's load board.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::{CancellationToken, DropGuard};

use crate::discovery::{Instance, InstanceId};
use crate::engine::kv_events::{KvFeeds, LoadSink};
use crate::push::{KvFeed, RoutableView};

/// Epochs of the feeds' output streams: each new feed for a worker starts above every earlier
/// one, so the index drops what a previous feed said.
static EPOCHS: AtomicU64 = AtomicU64::new(1);

/// A feed that ended by itself (its events went stale) is started afresh after this long.
const RESTART_AFTER: Duration = Duration::from_millis(500);

/// Run `instance`'s feed until `token`, a new one (a new epoch and sink: the index drops what
/// the old one said) each time one ends by itself.
async fn keep_feeding(
    instance: Arc<Instance>,
    feed: Arc<KvFeed>,
    feeds: KvFeeds,
    token: CancellationToken,
) {
    let id = instance.instance_id;
    loop {
        let epoch = EPOCHS.fetch_add(1, Ordering::Relaxed);
        let sink = feed.engine_sink(id);
        let loads = Arc::clone(&feed);
        let load: LoadSink = Arc::new(move |reading| loads.engine_load(id, &reading));
        feeds
            .clone()
            .run(Arc::clone(&instance), epoch, sink, load, token.clone())
            .await;
        tokio::select! {
            () = token.cancelled() => return,
            () = tokio::time::sleep(RESTART_AFTER) => {}
        }
    }
}

/// Keep one feed per engine of `view` running into `feed`, until the returned guard drops
/// (with the link); `None` outside a tokio runtime.
pub(super) fn spawn(view: RoutableView, feed: Arc<KvFeed>, feeds: KvFeeds) -> Option<DropGuard> {
    let runtime = tokio::runtime::Handle::try_current().ok()?;
    let cancel = CancellationToken::new();
    let stop = cancel.clone();
    runtime.spawn(async move {
        let mut running: HashMap<InstanceId, CancellationToken> = HashMap::new();
        loop {
            let set = view.routable();
            for instance in set.iter() {
                let id = instance.instance_id;
                if running.contains_key(&id) {
                    continue;
                }
                let token = stop.child_token();
                running.insert(id, token.clone());
                tokio::spawn(keep_feeding(
                    Arc::clone(instance),
                    Arc::clone(&feed),
                    feeds.clone(),
                    token,
                ));
            }
            running.retain(|id, token| {
                let keep = view.is_discovered(*id);
                if !keep {
                    token.cancel();
                    feeds.forget(*id);
                }
                keep
            });
            tokio::select! {
                () = stop.cancelled() => break,
                () = view.wait_for(|now| !std::ptr::addr_eq(now, &*set)) => {}
            }
        }
    });
    Some(cancel.drop_guard())
}
