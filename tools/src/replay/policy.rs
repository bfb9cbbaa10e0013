//! The routing policies a replay compares: ours, Dynamo's cost as baselines, round robin and
//! random.

use prefill_router::advert::SelectionMode;

/// How the prefill hop picks a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Policy {
    /// Our KV dispatcher by prediction ([`prefill_router::push::KvSelector`]: overlap remembered from
    /// past routing, minus load).
    Kv,
    /// Our KV dispatcher fed the workers' KV cache events ([`prefill_router::kv_events`]): overlap the
    /// worker holds now per its events, minus load.
    KvEvents,
    /// The KV dispatcher's scoring rule over overlaps read from the workers' caches directly:
    /// the upper bound of what events can give.
    KvOracle,
    /// The round-robin dispatcher.
    RoundRobin,
    /// The random dispatcher.
    Random,
    /// Dynamo's KV-router cost as its docs give it today (prefill load scale × the request's
    /// uncredited blocks and the worker's pending prefill blocks, plus active blocks), as a
    /// baseline.
    Dynamo,
    /// The earlier reading of Dynamo's cost (the request's uncredited blocks plus active
    /// blocks, no pending prefill term), kept as a second baseline: it is the stronger of the
    /// two on every workload measured.
    DynamoBlocks,
    /// A policy implemented outside this package ([`ReplayConfig::external`](super::ReplayConfig::external),
    /// the seam of [`super::ExternalPolicy`]): it is fed the workers' KV events as `kv-events`
    /// is, picks itself and books its own load; the dispatcher only sends. Not in
    /// [`ALL`](Self::ALL) and not parsed by name: it needs an implementation.
    External,
}

impl Policy {
    /// Every policy, in report order.
    pub const ALL: [Policy; 7] = [
        Policy::Kv,
        Policy::KvEvents,
        Policy::KvOracle,
        Policy::Dynamo,
        Policy::DynamoBlocks,
        Policy::RoundRobin,
        Policy::Random,
    ];

    /// The policy's name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Kv => "kv",
            Policy::KvEvents => "kv-events",
            Policy::KvOracle => "kv-oracle",
            Policy::RoundRobin => "round-robin",
            Policy::Random => "random",
            Policy::Dynamo => "dynamo",
            Policy::DynamoBlocks => "dynamo-blocks",
            Policy::External => "external",
        }
    }

    /// The policy named `name` (see [`name`](Self::name)).
    pub fn parse(name: &str) -> Option<Self> {
        Policy::ALL.into_iter().find(|p| p.name() == name)
    }

    /// Whether the policy scores KV overlap on the router's chained block hashes (the workers
    /// then key their caches by those hashes, so events and the oracle speak the router's
    /// language).
    pub(crate) fn chained(self) -> bool {
        matches!(self, Policy::Kv | Policy::KvEvents | Policy::KvOracle)
    }

    /// Whether the workers' caches publish KV events under the policy (`kv-events`, and an
    /// external policy, fed the same events).
    pub(crate) fn publishes(self) -> bool {
        matches!(self, Policy::KvEvents | Policy::External)
    }

    /// The router mode the pool's card advertises: the binding's dispatcher resolves it as
    /// in production. Dynamo's baseline and an external policy score workers themselves and
    /// ignore their dispatcher.
    pub(crate) fn router_mode(self) -> SelectionMode {
        match self {
            Policy::Kv | Policy::KvEvents | Policy::KvOracle => SelectionMode::KV,
            Policy::RoundRobin | Policy::Dynamo | Policy::DynamoBlocks | Policy::External => {
                SelectionMode::RoundRobin
            }
            Policy::Random => SelectionMode::Random,
        }
    }
}
