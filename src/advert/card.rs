//! The model card a worker advertises in discovery, and its parsing.

use serde::{Deserialize, Serialize};

/// How a dispatcher picks a worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SelectionMode {
    /// Rotate over the routable instances.
    #[default]
    #[serde(alias = "round_robin", alias = "round-robin", alias = "roundrobin")]
    RoundRobin,
    /// Pick uniformly at random.
    #[serde(alias = "random")]
    Random,
    /// Prefix-aware: prefer the worker that already holds the request's KV blocks.
    #[serde(alias = "kv", alias = "Kv")]
    KV,
    /// The caller names the worker.
    #[serde(alias = "direct")]
    Direct,
}

impl std::fmt::Display for SelectionMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SelectionMode::RoundRobin => "round-robin",
            SelectionMode::Random => "random",
            SelectionMode::KV => "kv",
            SelectionMode::Direct => "direct",
        })
    }
}

/// Tuning of the KV (prefix-aware) router. Defaults follow upstream Dynamo where it has the
/// term, except the overlap weight; the terms Dynamo lacks (keep credit, recent work) come
/// from the replay (docs/router.md, "KV cost").
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct KvRouterConfig {
    /// Weight of a request's uncached tokens on a worker in the KV cost (default 0.25, upstream
    /// 1.0): the credit a *hot* prefix keeps, `cost = overlap_score_weight × uncached tokens +
    /// prefill_load_scale × (booked + recent work) tokens − keep credit`, lowest wins
    /// (docs/router.md, "KV cost"). Every term is in tokens, so the decisions do not depend on
    /// `kv_cache_block_size` (issue #40; the cost used to be counted in blocks).
    pub overlap_score_weight: f64,
    /// Weight of the prefill work already booked on a worker in the KV cost (default 1.0: the
    /// cost is then the expected prefill work ahead of the request's first token).
    pub prefill_load_scale: f64,
    /// Tokens each routed request books on its worker on top of its uncached prompt tokens:
    /// the fixed cost of one more concurrent prefill there (default 4096, chosen by the
    /// replay: docs/performance.md, "KV cost").
    pub prefill_request_tokens: u64,
    /// Balance slack: a worker with more than this many tokens booked beyond the least loaded
    /// routable worker is skipped, however much of the prompt it holds (default `None`: no
    /// slack rule; the replay found it costs the conversation trace its reuse).
    pub balance_slack_tokens: Option<u64>,
    /// Keep credit: extra credit, in tokens, per cached token of a *cold* prefix (one few
    /// recent picks were credited with), fading by half with each recent pick credited with
    /// the same prefix. It keeps a conversation on the worker holding its history and lets a
    /// hot system prompt spread by load (docs/router.md, "KV cost"; 0: off). (The same number
    /// as the former "blocks per cached block": one unit over the other.)
    pub prefill_keep_credit: f64,
    /// Half-life of a prefix's heat, in picks (the selection has no clock): how soon a prefix
    /// no pick is credited with counts as cold again.
    pub prefill_heat_half_life: u32,
    /// Weight of a worker's recent work (the work placed on it, decaying by half every 256
    /// picks) next to its booked work: at a low request rate bookings are nearly always empty,
    /// and this is what still spreads new sessions over the pool (0: off). The work the
    /// request's own conversation placed on a worker is not counted against it, only other
    /// sessions' (issue #40; `push::own_work`).
    pub prefill_recent_work_weight: f64,
    /// Busy threshold: a worker with at least this many uncached prompt tokens booked is
    /// skipped; when every routable worker is, the request waits for room up to the router's
    /// overload wait and then fails as overloaded (default `None`: no threshold). Overridable
    /// at runtime with `Dispatcher::set_busy_threshold`.
    pub busy_threshold_tokens: Option<u64>,
    /// Softmax temperature for sampling among workers, over costs in tokens of work (so the
    /// same at every block size; it was over blocks before issue #40); 0 picks the best
    /// (upstream default 0.0).
    pub router_temperature: f64,
    /// Whether workers publish KV cache events (upstream default true).
    pub use_kv_events: bool,
    /// Whether the router tracks active blocks per worker (upstream default true; forced off
    /// for an advertised prefill configuration).
    pub router_track_active_blocks: bool,
}

impl Default for KvRouterConfig {
    fn default() -> Self {
        KvRouterConfig {
            overlap_score_weight: 0.25,
            prefill_load_scale: 1.0,
            prefill_request_tokens: 4096,
            balance_slack_tokens: None,
            prefill_keep_credit: 31.0,
            prefill_heat_half_life: 32,
            prefill_recent_work_weight: 0.25,
            busy_threshold_tokens: None,
            router_temperature: 0.0,
            use_kv_events: true,
            router_track_active_blocks: true,
        }
    }
}

impl KvRouterConfig {
    /// The defaults without keep credit or recent work, and with upstream's overlap weight
    /// (1.0): overlap against booked work alone, the cost before those terms (what the
    /// side-by-side rows of docs/performance.md compare against).
    pub fn load_only() -> Self {
        KvRouterConfig {
            overlap_score_weight: 1.0,
            prefill_keep_credit: 0.0,
            prefill_recent_work_weight: 0.0,
            ..KvRouterConfig::default()
        }
    }
}

/// The routing configuration a card may advertise.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RouterConfig {
    /// The mode the prefill hop should use.
    #[serde(default)]
    pub router_mode: SelectionMode,
    /// KV tuning; a card that names a mode without tuning gets the defaults.
    #[serde(default)]
    pub kv_router_config: KvRouterConfig,
    /// Session-affinity TTL in seconds; `None` means no affinity.
    #[serde(default)]
    pub session_affinity_ttl_secs: Option<u64>,
}

/// Runtime facts a card carries.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeConfig {
    /// Whether the engine runs EAGLE speculative decoding.
    #[serde(default)]
    pub enable_eagle: bool,
}

/// The protocol an engine worker speaks ([`EngineCard::protocol`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum EngineProtocol {
    /// vLLM's OpenAI-compatible server with its disaggregated (P/D) protocol:
    /// `POST /v1/completions` carrying `kv_transfer_params` (docs/engines.md).
    #[serde(rename = "vllm")]
    Vllm,
}

impl std::fmt::Display for EngineProtocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EngineProtocol::Vllm => "vllm",
        })
    }
}

impl std::str::FromStr for EngineProtocol {
    type Err = UnknownProtocol;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "vllm" => Ok(EngineProtocol::Vllm),
            other => Err(UnknownProtocol(other.to_owned())),
        }
    }
}

/// An engine protocol name this build does not know.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown engine protocol {0:?} (known: vllm)")]
pub struct UnknownProtocol(pub String);

/// What a card says about the engine behind an instance that is not one of our own workers:
/// the instance is reached over HTTP at its discovered address (`http://ADDRESS`), in this
/// protocol. The card's `name` is the engine's model and `kv_cache_block_size` its block size.
///
/// The engine's URL is the instance's address, not a card field: instances of one generation
/// must carry equal cards to be admitted together (first-wins admission compares cards).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EngineCard {
    /// The protocol the engine speaks.
    pub protocol: EngineProtocol,
}

/// How one worker set is reached, as its instances' cards say (`topology::Machine::set_link`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SetLink {
    /// Our request plane (no card names an engine).
    RequestPlane,
    /// Engines speaking `protocol`, with KV blocks of `block_size` tokens (the first card's).
    Engine {
        /// The protocol every card names.
        protocol: EngineProtocol,
        /// The cards' KV block size in tokens (0: not declared).
        block_size: u32,
    },
    /// Cards disagree on the protocol: the set is not routed to.
    Mixed,
}

impl SetLink {
    /// How an instance with `card` is reached.
    pub fn of(card: &ModelCard) -> SetLink {
        match &card.engine {
            None => SetLink::RequestPlane,
            Some(engine) => SetLink::Engine {
                protocol: engine.protocol,
                block_size: card.kv_cache_block_size,
            },
        }
    }
}

/// A worker's model deployment card, as stored in discovery (JSON).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelCard {
    /// The served model's name.
    pub name: String,
    /// KV cache block size in tokens; 0 means not declared.
    #[serde(default)]
    pub kv_cache_block_size: u32,
    /// The routing configuration the worker advertises, if any.
    #[serde(default)]
    pub router_config: Option<RouterConfig>,
    /// Runtime facts.
    #[serde(default)]
    pub runtime_config: RuntimeConfig,
    /// The engine behind the instance, when it is not one of our own request-plane workers
    /// (`None`: our request plane). A set never mixes protocols (docs/engines.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<EngineCard>,
}

impl ModelCard {
    /// A card with a name and nothing else declared.
    pub fn named(name: impl Into<String>) -> Self {
        ModelCard {
            name: name.into(),
            ..ModelCard::default()
        }
    }

    /// A card named `name` advertising routing `mode` over KV blocks of `kv_cache_block_size`
    /// tokens, the rest of its router config at the defaults: the card a worker of a demo, a
    /// test or a benchmark registers.
    ///
    /// ```
    /// use prefill_router::advert::{ModelCard, SelectionMode};
    ///
    /// let card = ModelCard::routed("m", SelectionMode::RoundRobin, 16);
    /// assert_eq!(card.router_config.unwrap().router_mode, SelectionMode::RoundRobin);
    /// ```
    pub fn routed(name: impl Into<String>, mode: SelectionMode, kv_cache_block_size: u32) -> Self {
        ModelCard {
            kv_cache_block_size,
            router_config: Some(RouterConfig {
                router_mode: mode,
                ..RouterConfig::default()
            }),
            ..ModelCard::named(name)
        }
    }

    /// Parse one card from JSON bytes.
    pub fn from_json(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }

    /// Serialize to JSON bytes.
    pub fn to_json(&self) -> Vec<u8> {
        // A card holds only strings, numbers and bools: serialization cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// Cards read from raw documents, with the number of unreadable ones skipped.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ParsedCards {
    /// The readable cards, in input order.
    pub cards: Vec<ModelCard>,
    /// How many documents could not be read as a card.
    pub skipped: usize,
}

/// Parse raw card JSON documents, skipping (and counting) unreadable ones. Never panics.
pub fn parse_cards<I, D>(docs: I) -> ParsedCards
where
    I: IntoIterator<Item = D>,
    D: AsRef<[u8]>,
{
    let mut parsed = ParsedCards::default();
    for (index, doc) in docs.into_iter().enumerate() {
        match ModelCard::from_json(doc.as_ref()) {
            Ok(card) => parsed.cards.push(card),
            Err(error) => {
                parsed.skipped += 1;
                tracing::debug!(index, %error, "skipping unreadable model card");
            }
        }
    }
    parsed
}
