//! Card resolution: turn the prefill workers' model cards into the prefill hop's configuration.
//!
//! Pure functions, upstream Dynamo's rules (`resolve_advertisement_from_cards`):
//!
//! 1. an empty card list is an error ([`AdvertError::NoReadableCard`]): one transient discovery
//!    miss must not lock in the wrong strategy until the next rebuild;
//! 2. unreadable cards are skipped ([`parse_cards`]);
//! 3. a card's mode is its `router_config.router_mode`, else the decode set's mode;
//! 4. the first card wins; disagreeing cards are counted and logged;
//! 5. an advertised `router_config` replaces the decode set's KV tuning whole (never merged),
//! 6. with `router_track_active_blocks` forced off;
//! 7. block size 0 means "not declared" and falls back to the decode set's;
//! 8. the session-affinity TTL is taken whole from an advertised config (`None` there means no
//!    affinity), else inherited;
//! 9. the EAGLE flag comes from the first card.

use std::time::Duration;

mod card;
pub use card::{
    parse_cards, EngineCard, EngineProtocol, KvRouterConfig, ModelCard, ParsedCards, RouterConfig,
    RuntimeConfig, SelectionMode, SetLink, UnknownProtocol,
};

/// What the decode side contributes when the prefill card is silent.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DecodeDefaults {
    /// The decode set's router mode, inherited by cards without a `router_config`.
    pub router_mode: SelectionMode,
    /// The decode set's KV tuning, used when no card advertises a `router_config`.
    pub kv_router_config: Option<KvRouterConfig>,
    /// The decode set's block size, used when the prefill card declares 0.
    pub block_size: u32,
    /// The frontend's session-affinity TTL, inherited when no card advertises a `router_config`.
    pub session_affinity_ttl: Option<Duration>,
}

/// The resolved configuration of the prefill hop.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefillConfig {
    /// The mode the prefill dispatcher uses.
    pub router_mode: SelectionMode,
    /// KV tuning (advertised, with active-block tracking off; or the decode set's; or none).
    pub kv_router_config: Option<KvRouterConfig>,
    /// KV block size in tokens.
    pub block_size: u32,
    /// Session-affinity TTL; `None` means no affinity.
    pub session_affinity_ttl: Option<Duration>,
    /// Whether the first card runs EAGLE.
    pub enable_eagle: bool,
    /// Whether the first card advertised a `router_config`.
    pub advertised: bool,
    /// How many cards' effective mode differs from the resolved one.
    pub disagreeing_cards: usize,
    /// How many cards were considered.
    pub total_cards: usize,
}

/// Why resolution failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AdvertError {
    /// No card to resolve from (none listed, or none readable).
    #[error("no readable prefill model card; cannot resolve prefill routing")]
    NoReadableCard,
}

/// The effective mode of one card: its advertised mode, else the decode set's.
fn mode_of(card: &ModelCard, decode: &DecodeDefaults) -> SelectionMode {
    card.router_config
        .as_ref()
        .map_or(decode.router_mode, |rc| rc.router_mode)
}

/// Resolve the prefill hop's configuration from the prefill workers' cards.
pub fn resolve(cards: &[ModelCard], decode: &DecodeDefaults) -> Result<PrefillConfig, AdvertError> {
    let first = cards.first().ok_or(AdvertError::NoReadableCard)?;
    let router_mode = mode_of(first, decode);
    let disagreeing_cards = cards[1..]
        .iter()
        .filter(|c| mode_of(c, decode) != router_mode)
        .count();
    if disagreeing_cards > 0 {
        tracing::warn!(
            resolved = %router_mode,
            disagreeing = disagreeing_cards,
            total = cards.len(),
            "prefill cards disagree on the router mode; the first card wins"
        );
    }
    let (kv_router_config, session_affinity_ttl) = match &first.router_config {
        Some(rc) => {
            let mut kv = rc.kv_router_config.clone();
            kv.router_track_active_blocks = false;
            (
                Some(kv),
                rc.session_affinity_ttl_secs.map(Duration::from_secs),
            )
        }
        None => (decode.kv_router_config.clone(), decode.session_affinity_ttl),
    };
    let block_size = match first.kv_cache_block_size {
        0 => decode.block_size,
        declared => declared,
    };
    Ok(PrefillConfig {
        router_mode,
        kv_router_config,
        block_size,
        session_affinity_ttl,
        enable_eagle: first.runtime_config.enable_eagle,
        advertised: first.router_config.is_some(),
        disagreeing_cards,
        total_cards: cards.len(),
    })
}

/// Parse raw card documents (skipping unreadable ones) and resolve them.
pub fn resolve_raw<I, D>(docs: I, decode: &DecodeDefaults) -> Result<PrefillConfig, AdvertError>
where
    I: IntoIterator<Item = D>,
    D: AsRef<[u8]>,
{
    resolve(&parse_cards(docs).cards, decode)
}

#[cfg(test)]
mod tests;
