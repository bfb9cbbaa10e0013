//! Fuzz target `card_json`: raw bytes and structure-aware JSON through [`parse_cards`] and
//! [`resolve`].
//!
//! Checked on every input: nothing panics; every document is either a card or counted as
//! skipped; a well-formed card document parses to exactly the card it was built from; resolution
//! fails (with the typed [`AdvertError::NoReadableCard`]) iff no card is readable; the
//! configuration obeys the rules that can be stated without re-implementing them (first card
//! wins, block size fallback, active-block tracking off when advertised); resolution does not
//! depend on the order of the cards after the first; the same card spelled differently (pretty
//! or compact, another accepted mode name, defaults written out) parses identically, and any
//! number of identical cards resolve as one; a parsed card serializes to a readable card.

mod seeds;

use arbitrary::{Arbitrary, Unstructured};

use prefill_router::advert::{
    parse_cards, resolve, resolve_raw, AdvertError, DecodeDefaults, ModelCard, PrefillConfig,
};

use seeds::*;
pub use seeds::{
    CardScript, CardSeed, DecodeSeed, DocSeed, Field, Junk, KvSeed, ModeName, RouterConfigSeed,
    MAX_DOCS,
};

/// Resolve `cards` and check what holds for every resolution; returns the result.
fn resolve_checked(
    resolver: Resolver,
    cards: &[ModelCard],
    decode: &DecodeDefaults,
) -> Result<Result<PrefillConfig, AdvertError>, String> {
    let resolved = resolver(cards, decode);
    let Some(first) = cards.first() else {
        return match resolved {
            Err(AdvertError::NoReadableCard) => Ok(resolved),
            other => Err(format!("no card resolved to {other:?}")),
        };
    };
    let cfg = resolved
        .as_ref()
        .map_err(|e| format!("{} cards failed to resolve: {e}", cards.len()))?;
    let advertised = first.router_config.is_some();
    let expected_block = match first.kv_cache_block_size {
        0 => decode.block_size,
        n => n,
    };
    if cfg.total_cards != cards.len()
        || cfg.disagreeing_cards >= cards.len()
        || cfg.advertised != advertised
        || cfg.block_size != expected_block
        || cfg.enable_eagle != first.runtime_config.enable_eagle
        || (advertised
            && cfg
                .kv_router_config
                .as_ref()
                .is_none_or(|kv| kv.router_track_active_blocks))
    {
        return Err(format!("{cfg:?} breaks a rule for first card {first:?}"));
    }
    Ok(resolved)
}

/// A card resolution function: [`resolve`], or a mutant of it.
pub type Resolver = fn(&[ModelCard], &DecodeDefaults) -> Result<PrefillConfig, AdvertError>;

/// What one script exercised (to judge a corpus).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CardStats {
    /// Documents built to parse to a predicted card, and did.
    pub predicted_cards: usize,
    /// Documents built to be rejected, and were.
    pub predicted_rejections: usize,
    /// Documents whose verdict was not predicted (raw bytes, junk-typed fields).
    pub unpredicted: usize,
    /// Resolutions of more than two cards (order independence checked).
    pub multi_card_resolutions: usize,
    /// Respelled documents that parsed as their originals did.
    pub respellings: usize,
    /// Card lists of several identical cards, resolved as one.
    pub identical_lists: usize,
    /// Card lists with no readable card.
    pub empty_resolutions: usize,
}

impl CardStats {
    /// Add another script's counts.
    pub fn add(&mut self, o: CardStats) {
        self.predicted_cards += o.predicted_cards;
        self.predicted_rejections += o.predicted_rejections;
        self.unpredicted += o.unpredicted;
        self.multi_card_resolutions += o.multi_card_resolutions;
        self.respellings += o.respellings;
        self.identical_lists += o.identical_lists;
        self.empty_resolutions += o.empty_resolutions;
    }
}

/// Check one script against the real [`resolve`]; returns what broke.
pub fn check_cards(script: &CardScript) -> Result<CardStats, String> {
    check_cards_with(script, resolve)
}

/// Check one script against `resolver`; returns what the script exercised, or what broke.
pub fn check_cards_with(script: &CardScript, resolver: Resolver) -> Result<CardStats, String> {
    let mut stats = CardStats::default();
    let decode = script.decode.defaults();
    let docs = documents(&script.docs);
    let parsed = parse_cards(docs.iter().map(|d| &d.bytes));
    if parsed.cards.len() + parsed.skipped != docs.len() {
        return Err(format!(
            "{} documents gave {} cards and {} skipped",
            docs.len(),
            parsed.cards.len(),
            parsed.skipped
        ));
    }
    let mut readable = Vec::new();
    let mut each = Vec::with_capacity(docs.len());
    for (index, doc) in docs.iter().enumerate() {
        let one = ModelCard::from_json(&doc.bytes);
        if let Some(original) = doc.respells {
            let same = match (&each[original], &one) {
                (Ok(a), Ok(b)) => a == b,
                (Err(_), Err(_)) => true,
                _ => false,
            };
            if !same {
                return Err(format!(
                    "document {index} respells document {original} but reads {one:?}, not {:?}",
                    each[original]
                ));
            }
            stats.respellings += 1;
        }
        match (&doc.predict, &one) {
            (Predict::Known(card), Ok(got)) if got != card => {
                return Err(format!(
                    "document {index} parsed to {got:?}, built from {card:?}"
                ))
            }
            (Predict::Known(card), Err(e)) => {
                return Err(format!(
                    "document {index} built from {card:?} rejected: {e}"
                ))
            }
            (Predict::Rejected, Ok(got)) => {
                return Err(format!(
                    "document {index} must be rejected, parsed to {got:?}"
                ))
            }
            (Predict::Known(_), Ok(_)) => stats.predicted_cards += 1,
            (Predict::Rejected, Err(_)) => stats.predicted_rejections += 1,
            (Predict::Unknown, _) => stats.unpredicted += 1,
        }
        if let Ok(card) = &one {
            readable.push(card.clone());
        }
        each.push(one);
    }
    if readable != parsed.cards {
        return Err("parse_cards disagrees with parsing documents one by one".to_owned());
    }

    let resolved = resolve_checked(resolver, &parsed.cards, &decode)?;
    let raw = resolve_raw(docs.iter().map(|d| &d.bytes), &decode);
    if raw != resolved {
        return Err(format!(
            "resolve_raw gave {raw:?}, resolve gave {resolved:?}"
        ));
    }

    // Order independence: the cards after the first only count disagreements.
    let cards = &parsed.cards;
    if cards.is_empty() {
        stats.empty_resolutions += 1;
    }
    if cards.len() > 2 {
        stats.multi_card_resolutions += 1;
        let mut reordered = cards.clone();
        reordered[1..].reverse();
        let r = resolve_checked(resolver, &reordered, &decode)?;
        if r != resolved {
            return Err(format!(
                "reversing cards[1..] changed {resolved:?} into {r:?}"
            ));
        }
        reordered[1..].rotate_left(1);
        let r = resolve_checked(resolver, &reordered, &decode)?;
        if r != resolved {
            return Err(format!(
                "rotating cards[1..] changed {resolved:?} into {r:?}"
            ));
        }
    }
    // Identical cards (however spelled) resolve as one card would, none disagreeing.
    if cards.len() > 1 && cards.iter().all(|c| *c == cards[0]) {
        stats.identical_lists += 1;
        let one = resolve_checked(resolver, &cards[..1], &decode)?;
        let same = match (&resolved, &one) {
            (Ok(many), Ok(one)) => {
                many.disagreeing_cards == 0
                    && PrefillConfig {
                        total_cards: 1,
                        ..many.clone()
                    } == *one
            }
            _ => false,
        };
        if !same {
            return Err(format!(
                "{} identical cards resolved to {resolved:?}, one to {one:?}",
                cards.len()
            ));
        }
    }

    // What the library writes, it can read back.
    for card in cards {
        let again = ModelCard::from_json(&card.to_json())
            .map_err(|e| format!("{card:?} serialized to an unreadable card: {e}"))?;
        if again.name != card.name
            || again.kv_cache_block_size != card.kv_cache_block_size
            || again.router_config.is_some() != card.router_config.is_some()
            || again.runtime_config != card.runtime_config
        {
            return Err(format!("{card:?} read back as {again:?}"));
        }
    }
    Ok(stats)
}

/// Decode raw fuzz bytes the way libfuzzer-sys does for a typed target.
pub fn decode(bytes: &[u8]) -> Option<CardScript> {
    CardScript::arbitrary_take_rest(Unstructured::new(bytes)).ok()
}

/// The `card_json` harness: the raw bytes as one document, then the decoded script; panics when
/// a check fails.
pub fn card_json(bytes: &[u8]) {
    // The bytes themselves are a document too: the fuzzer mutates them as JSON text directly.
    let raw = CardScript {
        decode: DecodeSeed {
            mode: 0,
            kv: None,
            block_size: 16,
            ttl_secs: None,
        },
        docs: vec![DocSeed::Raw(bytes.to_vec())],
    };
    if let Err(e) = check_cards(&raw) {
        panic!("card_json (raw bytes): {e}");
    }
    if let Some(script) = decode(bytes) {
        if let Err(e) = check_cards(&script) {
            panic!("card_json: {e}\nscript: {script:?}");
        }
    }
}
