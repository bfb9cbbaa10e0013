//! The seam for a routing policy that lives outside this package ([`Policy::External`]): a
//! router another crate implements (`peers/dynamo-replay` runs Dynamo's own KV router behind
//! it), fed what the `kv-events` policy is fed and asked to pick, with the replay's workers,
//! cost model and report unchanged.
//!
//! Per binding (one per frontend and pool generation) the replay asks the
//! [`ExternalPolicy`] for an [`ExternalRouter`], then:
//! - delivers every worker's KV cache changes as [`ExternalKvEvent`]s, the moment (and with the
//!   losses and delay) the `kv-events` policy gets them: the blocks' chained hashes (the
//!   workers' cache keys) and each stored block's tokens, as an engine's events carry them;
//! - asks [`ExternalRouter::select`] for each request's worker among the routable ones; the
//!   router books the request itself (its own load terms) and the replay sends the prefill to
//!   that worker through the same in-process link as every other policy;
//! - calls [`ExternalRouter::release`] once the prefill ended (on a prefill worker that is the
//!   end of the request), whether it succeeded or not.
//!
//! [`Policy::External`]: super::Policy::External

use std::fmt;
use std::sync::Arc;

use futures_util::future::BoxFuture;
use prefill_router::discovery::InstanceId;

/// One change of a worker's KV cache, as an external router receives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExternalKvEvent {
    /// Blocks now held, a chain in prompt order: `blocks[0]` extends the block hashed `parent`
    /// (`None`: the chain starts at the prompt's first block), `blocks[i]` extends
    /// `blocks[i - 1]`. A block already held is announced again when a prefill reuses it.
    Stored {
        /// The chained hash of the block the chain extends.
        parent: Option<u64>,
        /// The blocks, each with its tokens.
        blocks: Vec<ExternalBlock>,
    },
    /// Blocks no longer held (evicted), by chained hash.
    Removed {
        /// The chained hashes.
        blocks: Vec<u64>,
    },
    /// Every block of the worker dropped.
    Cleared,
}

/// A stored block: the worker's key for it and the tokens it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExternalBlock {
    /// The block's chained hash (`prefill_router::push::block_hashes` of the prompt at the run's
    /// block size): equal hashes mean equal prefixes.
    pub hash: u64,
    /// The block's own tokens (exactly the run's block size), from which a router computes its
    /// own per-block hash.
    pub tokens: Vec<u32>,
}

/// What the replay knows of a request when it asks an external router to pick.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExternalRequest {
    /// The request's id in this run (its trace index): unique per run, the key of
    /// [`ExternalRouter::release`].
    pub id: u64,
    /// The prompt's tokens, padded to whole trace units: the tokens the workers' cache keys
    /// are computed from (whole blocks of them hash alike on both sides).
    pub tokens: Vec<u32>,
    /// The prompt's true length in tokens (what the prefill computes).
    pub prompt_tokens: u32,
    /// Tokens the request will generate.
    pub output_tokens: u32,
}

/// What a binding tells its policy when it asks for a router.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExternalSetup {
    /// Tokens per KV block of the run (the card's block size).
    pub block_tokens: u32,
    /// The workers the binding admits (every one of them may later be routable).
    pub workers: Vec<InstanceId>,
    /// The frontend building the binding (0 with a single frontend).
    pub frontend: u64,
}

/// Why an external policy could not route.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ExternalError {
    /// `Policy::External` without an [`ExternalPolicy`] in the configuration.
    #[error("policy external needs an external policy in ReplayConfig::external")]
    Missing,
    /// The external policy picks asynchronously, so it cannot answer conditional
    /// disaggregation's synchronous probe.
    #[error("an external policy does not combine with conditional disaggregation")]
    Conditional,
    /// No routable worker.
    #[error("no routable worker")]
    NoWorker,
    /// The router picked a worker outside the routable set.
    #[error("the external router picked worker {0}, which is not routable")]
    NotRoutable(InstanceId),
    /// The router failed (its own error, as text).
    #[error("the external router failed: {0}")]
    Router(String),
}

/// A router of one binding: fed KV events, asked to pick, told when a prefill ended.
///
/// Calls come from the replay's single-threaded runtime; a router may await inside
/// [`select`](Self::select) and [`release`](Self::release) (on tokio's paused clock: a timer
/// there advances virtual time).
pub trait ExternalRouter: Send + Sync {
    /// Worker `worker`'s cache changes, in the order they happened.
    fn apply_events(&self, worker: InstanceId, events: &[ExternalKvEvent]);

    /// The worker for `request`, among `routable` (never empty); the router books the request
    /// as its own load until [`release`](Self::release).
    fn select(
        &self,
        request: ExternalRequest,
        routable: Vec<InstanceId>,
    ) -> BoxFuture<'_, Result<InstanceId, ExternalError>>;

    /// The prefill of request `id` ended (its first token came back, or it failed): the router
    /// frees what it booked for it.
    fn release(&self, id: u64) -> BoxFuture<'_, Result<(), ExternalError>>;
}

/// A routing policy implemented outside the replay: it builds one [`ExternalRouter`] per
/// binding (each frontend's binding is independent, as separate router processes would be).
pub trait ExternalPolicy: Send + Sync {
    /// The policy's name in reports (`dynamo-crate`).
    fn name(&self) -> &str;

    /// A router for a new binding.
    ///
    /// # Errors
    /// The policy's own [`ExternalError`] if it cannot route this pool.
    fn router(&self, setup: &ExternalSetup) -> Result<Arc<dyn ExternalRouter>, ExternalError>;
}

/// An [`ExternalPolicy`] in a [`ReplayConfig`](super::ReplayConfig): compared by identity, shown
/// by name.
#[derive(Clone)]
pub struct External(pub Arc<dyn ExternalPolicy>);

impl External {
    /// Wraps `policy`.
    pub fn new(policy: impl ExternalPolicy + 'static) -> Self {
        External(Arc::new(policy))
    }
}

impl fmt::Debug for External {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("External").field(&self.0.name()).finish()
    }
}

impl PartialEq for External {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// The external events of one cache batch: `events` (chained hashes) with each stored block's
/// tokens, found by the block's position in the prefilled prompt (`keys`, whose block *i* is
/// `tokens[i * block .. (i + 1) * block]`). A prefill stores only blocks of its own prompt, so
/// every stored block is found; one that is not (a broken caller) ends its chain there.
pub(crate) fn convert(
    events: &[prefill_router::kv_events::KvEvent],
    keys: &[u64],
    tokens: &[u32],
    block: usize,
) -> Vec<ExternalKvEvent> {
    use prefill_router::kv_events::KvEvent;
    events
        .iter()
        .map(|event| match event {
            KvEvent::Stored { parent, blocks } => {
                let blocks = blocks
                    .iter()
                    .map_while(|&hash| {
                        let at = keys.iter().position(|&k| k == hash)?;
                        let tokens = tokens.get(at * block..(at + 1) * block)?.to_vec();
                        Some(ExternalBlock { hash, tokens })
                    })
                    .collect();
                ExternalKvEvent::Stored {
                    parent: *parent,
                    blocks,
                }
            }
            KvEvent::Removed { blocks } => ExternalKvEvent::Removed {
                blocks: blocks.clone(),
            },
            KvEvent::Cleared => ExternalKvEvent::Cleared,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use prefill_router::kv_events::KvEvent;

    #[test]
    fn stored_blocks_carry_the_tokens_at_their_prompt_position() {
        let tokens: Vec<u32> = (0..8).collect();
        let keys = prefill_router::push::block_hashes(&tokens, 2);
        let events = [
            KvEvent::Stored {
                parent: Some(keys[1]),
                blocks: vec![keys[2], keys[3]],
            },
            KvEvent::Removed {
                blocks: vec![keys[0]],
            },
        ];
        let converted = convert(&events, &keys, &tokens, 2);
        assert_eq!(
            converted[0],
            ExternalKvEvent::Stored {
                parent: Some(keys[1]),
                blocks: vec![
                    ExternalBlock {
                        hash: keys[2],
                        tokens: vec![4, 5]
                    },
                    ExternalBlock {
                        hash: keys[3],
                        tokens: vec![6, 7]
                    },
                ],
            }
        );
        assert_eq!(
            converted[1],
            ExternalKvEvent::Removed {
                blocks: vec![keys[0]]
            }
        );
    }
}
