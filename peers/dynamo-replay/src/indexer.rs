//! The crate's radix tree (`dynamo_kv_router::RadixTree`, the tree its `KvIndexer` runs) on a
//! thread of its own, as `KvIndexer` keeps it: the tree is single-threaded (`Rc` nodes), so it
//! cannot live in a `Send` router. Unlike `KvIndexer`, events and lookups share one FIFO
//! channel, so a lookup sees every event sent before it: the replay stays deterministic (in
//! production the two race; here the replay's own `--event-delay-ms` models lateness).

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;

use dynamo_kv_router::indexer::MatchDetails;
use dynamo_kv_router::protocols::{KvCacheEventData, LocalBlockHash, RouterEvent};
use parking_lot::Mutex;

/// What the tree's thread is asked to do.
enum Task {
    Apply(RouterEvent),
    Match(Vec<LocalBlockHash>, mpsc::Sender<MatchDetails>),
}

/// Why the indexer could not answer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IndexerError {
    /// The tree's thread is gone (it panicked, or could not be started).
    #[error("the radix tree's thread is gone")]
    Gone,
}

/// A handle to the crate's radix tree on its own thread; the thread ends when the handle
/// drops.
pub struct Indexer {
    tasks: Mutex<mpsc::Sender<Task>>,
    /// Events the tree refused (`apply_event` errors), by event kind and error.
    refused: Arc<Mutex<BTreeMap<String, u64>>>,
}

impl Indexer {
    /// Starts the tree's thread.
    ///
    /// # Errors
    /// [`IndexerError::Gone`] if the OS refuses a thread.
    pub fn start() -> Result<Self, IndexerError> {
        let (tx, rx) = mpsc::channel::<Task>();
        let refused = Arc::new(Mutex::new(BTreeMap::new()));
        let counter = Arc::clone(&refused);
        thread::Builder::new()
            .name("dynamo-radix-tree".to_owned())
            .spawn(move || {
                let mut tree = dynamo_kv_router::RadixTree::new();
                for task in rx {
                    match task {
                        Task::Apply(event) => {
                            let kind = match &event.event.data {
                                KvCacheEventData::Stored(_) => "stored",
                                KvCacheEventData::Removed(_) => "removed",
                                KvCacheEventData::Cleared => "cleared",
                            };
                            if let Err(error) = tree.apply_event(event) {
                                *counter
                                    .lock()
                                    .entry(format!("{kind}: {error:?}"))
                                    .or_insert(0) += 1;
                            }
                        }
                        // The router's lookup: every worker's overlap, no early exit.
                        Task::Match(sequence, reply) => {
                            let _ = reply.send(tree.find_match_details(sequence, false));
                        }
                    }
                }
            })
            .map_err(|_| IndexerError::Gone)?;
        Ok(Indexer {
            tasks: Mutex::new(tx),
            refused,
        })
    }

    /// Queues `event` for the tree (applied before any later lookup).
    pub fn apply(&self, event: RouterEvent) {
        // A gone thread shows at the next lookup.
        let _ = self.tasks.lock().send(Task::Apply(event));
    }

    /// The tree's match of `sequence`: each worker's leading blocks held.
    ///
    /// # Errors
    /// [`IndexerError::Gone`] if the tree's thread is gone.
    pub fn find(&self, sequence: Vec<LocalBlockHash>) -> Result<MatchDetails, IndexerError> {
        let (reply, answer) = mpsc::channel();
        self.tasks
            .lock()
            .send(Task::Match(sequence, reply))
            .map_err(|_| IndexerError::Gone)?;
        // The thread answers every lookup it receives, after the events queued before it.
        answer.recv().map_err(|_| IndexerError::Gone)
    }

    /// Events the tree refused so far, by event kind and the tree's error
    /// (`removed: BlockNotFound`, ...). Applied events are counted at their turn on the tree's
    /// thread: call after a lookup to see every event sent before it.
    pub fn refused(&self) -> BTreeMap<String, u64> {
        self.refused.lock().clone()
    }
}
