//! A prefill's share of a binding's in-flight token load.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Counts `tokens` in a binding's in-flight prefill tokens until dropped: the pool load a
/// pick's estimate reports (`PrefillEstimate::pool_tokens_per_worker`). Every binding that
/// implements `Binding::pick` holds one per picked request: the default factory's, the
/// simulator's and the replay's; a binding of an embedder's own that picks holds one too.
#[derive(Debug)]
pub struct TokenLoad {
    counter: Arc<AtomicU64>,
    tokens: u64,
}

impl TokenLoad {
    /// Add `tokens` to `counter` until the returned load drops.
    pub fn new(counter: &Arc<AtomicU64>, tokens: u64) -> Self {
        counter.fetch_add(tokens, Ordering::Relaxed);
        TokenLoad {
            counter: Arc::clone(counter),
            tokens,
        }
    }
}

impl Drop for TokenLoad {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.tokens, Ordering::Relaxed);
    }
}
