//! The structure-aware inputs of `card_json`: seeds that build card documents (well-formed,
//! respelled, junk), each with the outcome predicted for it.

use std::time::Duration;

use arbitrary::Arbitrary;
use serde_json::{json, Map, Value};

use prefill_router::advert::{
    DecodeDefaults, KvRouterConfig, ModelCard, RouterConfig, RuntimeConfig, SelectionMode,
};

/// Spellings of the router modes the card format accepts, with the mode each means.
const MODE_NAMES: &[(&str, SelectionMode)] = &[
    ("RoundRobin", SelectionMode::RoundRobin),
    ("round_robin", SelectionMode::RoundRobin),
    ("round-robin", SelectionMode::RoundRobin),
    ("roundrobin", SelectionMode::RoundRobin),
    ("Random", SelectionMode::Random),
    ("random", SelectionMode::Random),
    ("KV", SelectionMode::KV),
    ("kv", SelectionMode::KV),
    ("Kv", SelectionMode::KV),
    ("Direct", SelectionMode::Direct),
    ("direct", SelectionMode::Direct),
];

/// A JSON value of any shape, to put where a field's type is wrong or unknown.
#[derive(Arbitrary, Clone, Debug)]
pub enum Junk {
    /// `true` / `false`.
    Bool(bool),
    /// An integer (possibly negative or beyond `u32`).
    Int(i64),
    /// A float, `n / 8` (exact in binary and in decimal).
    Float(i16),
    /// A string.
    Str(String),
    /// An array of junk.
    Array(Vec<Junk>),
    /// An object of junk.
    Object(Vec<(String, Junk)>),
    /// Arrays nested `n % 160` deep (either side of the parser's recursion limit of 128).
    Deep(u8),
}

impl Junk {
    /// The JSON value.
    pub fn to_value(&self) -> Value {
        match self {
            Junk::Bool(b) => json!(b),
            Junk::Int(i) => json!(i),
            Junk::Float(n) => json!(f64::from(*n) / 8.0),
            Junk::Str(s) => json!(s),
            Junk::Array(items) => Value::Array(items.iter().map(Junk::to_value).collect()),
            Junk::Object(fields) => Value::Object(
                fields
                    .iter()
                    .map(|(k, v)| (k.clone(), v.to_value()))
                    .collect(),
            ),
            // `json!([inner])` would re-serialize `inner` at every level (quadratic).
            Junk::Deep(depth) => (0..*depth % 160).fold(Value::Array(Vec::new()), |inner, _| {
                Value::Array(vec![inner])
            }),
        }
    }
}

/// One field of a card document.
#[derive(Arbitrary, Clone, Debug)]
pub enum Field<T> {
    /// Left out.
    Absent,
    /// A well-typed value.
    Valid(T),
    /// `null`.
    Null,
    /// A value of arbitrary, probably wrong, type.
    Wrong(Junk),
}

/// A router mode as written in a card.
#[derive(Arbitrary, Clone, Debug)]
pub enum ModeName {
    /// One of the accepted spellings.
    Known(u8),
    /// Any string (almost always rejected).
    Other(String),
}

/// `kv_router_config` of a card.
#[derive(Arbitrary, Clone, Debug)]
pub struct KvSeed {
    pub(crate) overlap_score_weight: Field<i16>,
    pub(crate) router_temperature: Field<i16>,
    pub(crate) use_kv_events: Field<bool>,
    pub(crate) router_track_active_blocks: Field<bool>,
}

/// `router_config` of a card.
#[derive(Arbitrary, Clone, Debug)]
pub struct RouterConfigSeed {
    pub(crate) router_mode: Field<ModeName>,
    pub(crate) kv_router_config: Field<KvSeed>,
    pub(crate) session_affinity_ttl_secs: Field<u64>,
}

/// A card document, field by field.
#[derive(Arbitrary, Clone, Debug)]
pub struct CardSeed {
    pub(crate) name: Field<String>,
    pub(crate) kv_cache_block_size: Field<u32>,
    pub(crate) router_config: Field<RouterConfigSeed>,
    pub(crate) enable_eagle: Field<bool>,
    /// Unknown fields a newer worker might add (must be ignored).
    pub(crate) extra: Vec<(String, Junk)>,
}

/// One document of a discovery listing.
#[derive(Arbitrary, Clone, Debug)]
pub enum DocSeed {
    /// Arbitrary bytes.
    Raw(Vec<u8>),
    /// A card document built field by field.
    Card(CardSeed),
    /// A card document truncated to `keep` bytes, with the byte at `at` xored with `flip`.
    Mangled {
        /// The card.
        card: CardSeed,
        /// How many bytes to keep.
        keep: u16,
        /// Which byte to flip.
        at: u16,
        /// The xor mask.
        flip: u8,
    },
    /// A byte-identical copy of an earlier document (identical cards from a generation's workers).
    CopyOf(u8),
    /// An earlier document built from a [`CardSeed`], spelled differently but meaning the same:
    /// pretty-printed or not, the router mode under another accepted name, omitted defaults
    /// written out. It must parse exactly as the original does.
    Respelled {
        /// Which earlier document (modulo the count so far).
        of: u8,
        /// Pretty-print.
        pretty: bool,
        /// Which accepted spelling of the same router mode.
        alias: u8,
        /// Write out omitted fields that have defaults.
        explicit_defaults: bool,
    },
}

/// What the decode side contributes.
#[derive(Arbitrary, Clone, Debug)]
pub struct DecodeSeed {
    pub(crate) mode: u8,
    pub(crate) kv: Option<(i16, i16, bool, bool)>,
    pub(crate) block_size: u32,
    pub(crate) ttl_secs: Option<u32>,
}

/// A whole `card_json` input.
#[derive(Arbitrary, Clone, Debug)]
pub struct CardScript {
    /// The decode defaults.
    pub decode: DecodeSeed,
    /// The documents, in listing order.
    pub docs: Vec<DocSeed>,
}

pub(crate) fn mode_at(index: u8) -> SelectionMode {
    MODE_NAMES[usize::from(index) % MODE_NAMES.len()].1
}

pub(crate) fn eighths(n: i16) -> f64 {
    f64::from(n) / 8.0
}

/// What a document (or a part of one) must parse to, when that can be predicted.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Predict<T> {
    /// It parses to this value.
    Known(T),
    /// It is rejected.
    Rejected,
    /// Not predicted: a value of arbitrary type, serde's verdict is not modelled here.
    Unknown,
}

impl<T> Predict<T> {
    /// Both parts of one object: any rejected field rejects the object, whatever the others.
    pub(crate) fn and<U>(self, other: Predict<U>) -> Predict<(T, U)> {
        match (self, other) {
            (Predict::Rejected, _) | (_, Predict::Rejected) => Predict::Rejected,
            (Predict::Known(a), Predict::Known(b)) => Predict::Known((a, b)),
            _ => Predict::Unknown,
        }
    }

    pub(crate) fn map<U>(self, f: impl FnOnce(T) -> U) -> Predict<U> {
        match self {
            Predict::Known(v) => Predict::Known(f(v)),
            Predict::Rejected => Predict::Rejected,
            Predict::Unknown => Predict::Unknown,
        }
    }
}

/// Write `field` into `object` under `key` and predict the value serde reads for it: `absent`
/// when left out, `null` for JSON `null`, whatever `valid` says for a well-typed value.
pub(crate) fn put<S, T>(
    object: &mut Map<String, Value>,
    key: &str,
    field: &Field<S>,
    valid: impl FnOnce(&S) -> (Value, Predict<T>),
    absent: Predict<T>,
    null: Predict<T>,
) -> Predict<T> {
    let (value, predicted) = match field {
        Field::Absent => return absent,
        Field::Valid(v) => valid(v),
        Field::Null => (Value::Null, null),
        Field::Wrong(junk) => (junk.to_value(), Predict::Unknown),
    };
    object.insert(key.to_owned(), value);
    predicted
}

pub(crate) fn float(n: &i16) -> (Value, Predict<f64>) {
    (json!(eighths(*n)), Predict::Known(eighths(*n)))
}

pub(crate) fn boolean(b: &bool) -> (Value, Predict<bool>) {
    (json!(b), Predict::Known(*b))
}

impl KvSeed {
    pub(crate) fn build(&self) -> (Value, Predict<KvRouterConfig>) {
        let d = KvRouterConfig::default();
        let mut o = Map::new();
        let weight = put(
            &mut o,
            "overlap_score_weight",
            &self.overlap_score_weight,
            float,
            Predict::Known(d.overlap_score_weight),
            Predict::Rejected,
        );
        let temperature = put(
            &mut o,
            "router_temperature",
            &self.router_temperature,
            float,
            Predict::Known(d.router_temperature),
            Predict::Rejected,
        );
        let events = put(
            &mut o,
            "use_kv_events",
            &self.use_kv_events,
            boolean,
            Predict::Known(d.use_kv_events),
            Predict::Rejected,
        );
        let track = put(
            &mut o,
            "router_track_active_blocks",
            &self.router_track_active_blocks,
            boolean,
            Predict::Known(d.router_track_active_blocks),
            Predict::Rejected,
        );
        let kv = weight
            .and(temperature)
            .and(events)
            .and(track)
            .map(|(((w, t), e), a)| KvRouterConfig {
                overlap_score_weight: w,
                router_temperature: t,
                use_kv_events: e,
                router_track_active_blocks: a,
                ..KvRouterConfig::default()
            });
        (Value::Object(o), kv)
    }
}

impl RouterConfigSeed {
    pub(crate) fn build(&self) -> (Value, Predict<RouterConfig>) {
        let mut o = Map::new();
        let mode = put(
            &mut o,
            "router_mode",
            &self.router_mode,
            |m| match m {
                ModeName::Known(i) => {
                    let (name, mode) = MODE_NAMES[usize::from(*i) % MODE_NAMES.len()];
                    (json!(name), Predict::Known(mode))
                }
                ModeName::Other(s) => (
                    json!(s),
                    MODE_NAMES
                        .iter()
                        .find(|(n, _)| n == s)
                        .map_or(Predict::Rejected, |(_, m)| Predict::Known(*m)),
                ),
            },
            Predict::Known(SelectionMode::default()),
            Predict::Rejected,
        );
        let kv = put(
            &mut o,
            "kv_router_config",
            &self.kv_router_config,
            KvSeed::build,
            Predict::Known(KvRouterConfig::default()),
            Predict::Rejected,
        );
        let ttl = put(
            &mut o,
            "session_affinity_ttl_secs",
            &self.session_affinity_ttl_secs,
            |n| (json!(n), Predict::Known(Some(*n))),
            Predict::Known(None),
            Predict::Known(None),
        );
        let rc = mode
            .and(kv)
            .and(ttl)
            .map(|((router_mode, kv_router_config), ttl)| RouterConfig {
                router_mode,
                kv_router_config,
                session_affinity_ttl_secs: ttl,
            });
        (Value::Object(o), rc)
    }
}

impl CardSeed {
    /// The card document this seed builds, and the card it must parse to (`None` when it must
    /// be rejected, or when its verdict is not predicted).
    pub fn document(&self) -> (Value, Option<ModelCard>) {
        let (value, predict) = self.build();
        match predict {
            Predict::Known(card) => (value, Some(card)),
            Predict::Rejected | Predict::Unknown => (value, None),
        }
    }

    /// The JSON document and the card it must parse to.
    pub(crate) fn build(&self) -> (Value, Predict<ModelCard>) {
        let mut o = Map::new();
        let name = put(
            &mut o,
            "name",
            &self.name,
            |s| (json!(s), Predict::Known(s.clone())),
            Predict::Rejected,
            Predict::Rejected,
        );
        let block = put(
            &mut o,
            "kv_cache_block_size",
            &self.kv_cache_block_size,
            |n| (json!(n), Predict::Known(*n)),
            Predict::Known(0),
            Predict::Rejected,
        );
        let rc = put(
            &mut o,
            "router_config",
            &self.router_config,
            |seed| {
                let (value, rc) = seed.build();
                (value, rc.map(Some))
            },
            Predict::Known(None),
            Predict::Known(None),
        );
        let mut runtime = Map::new();
        let eagle = put(
            &mut runtime,
            "enable_eagle",
            &self.enable_eagle,
            boolean,
            Predict::Known(false),
            Predict::Rejected,
        );
        o.insert("runtime_config".to_owned(), Value::Object(runtime));
        for (key, junk) in &self.extra {
            // Prefixed so that an extra key never collides with a card field.
            o.insert(format!("x-{key}"), junk.to_value());
        }
        let card = name
            .and(block)
            .and(rc)
            .and(eagle)
            .map(|(((name, block), rc), eagle)| ModelCard {
                name,
                kv_cache_block_size: block,
                router_config: rc,
                runtime_config: RuntimeConfig {
                    enable_eagle: eagle,
                },
                engine: None,
            });
        (Value::Object(o), card)
    }
}

impl DecodeSeed {
    pub(crate) fn defaults(&self) -> DecodeDefaults {
        DecodeDefaults {
            router_mode: mode_at(self.mode),
            kv_router_config: self.kv.map(|(w, t, e, a)| KvRouterConfig {
                overlap_score_weight: eighths(w),
                router_temperature: eighths(t),
                use_kv_events: e,
                router_track_active_blocks: a,
                ..KvRouterConfig::default()
            }),
            block_size: self.block_size,
            session_affinity_ttl: self.ttl_secs.map(|s| Duration::from_secs(s.into())),
        }
    }
}

/// One document of a script.
#[derive(Clone, Debug)]
pub(crate) struct Doc {
    pub(crate) bytes: Vec<u8>,
    pub(crate) predict: Predict<ModelCard>,
    /// The JSON value it was built from, when built from a [`CardSeed`].
    pub(crate) value: Option<Value>,
    /// The document it respells, if any.
    pub(crate) respells: Option<usize>,
}

/// The same card, spelled differently (see [`DocSeed::Respelled`]).
pub(crate) fn respell(value: &Value, pretty: bool, alias: u8, explicit_defaults: bool) -> Vec<u8> {
    let mut value = value.clone();
    if let Value::Object(card) = &mut value {
        if let Some(Value::Object(rc)) = card.get_mut("router_config") {
            if let Some(Value::String(name)) = rc.get_mut("router_mode") {
                if let Some((_, mode)) = MODE_NAMES.iter().find(|(n, _)| n == name) {
                    let same: Vec<&str> = MODE_NAMES
                        .iter()
                        .filter(|(_, m)| m == mode)
                        .map(|(n, _)| *n)
                        .collect();
                    *name = same[usize::from(alias) % same.len()].to_owned();
                }
            }
        }
        if explicit_defaults {
            card.entry("kv_cache_block_size").or_insert(json!(0));
            if let Some(Value::Object(rt)) = card.get_mut("runtime_config") {
                rt.entry("enable_eagle").or_insert(json!(false));
            }
        }
    }
    let bytes = if pretty {
        serde_json::to_vec_pretty(&value)
    } else {
        serde_json::to_vec(&value)
    };
    bytes.unwrap_or_default()
}

/// At most this many documents per script: a discovery listing of a few dozen cards already
/// exercises every rule, and long scripts of deep documents would slow the fuzzer down a
/// hundredfold for nothing.
pub const MAX_DOCS: usize = 48;

/// The documents of a script, with the outcome predicted for each.
pub(crate) fn documents(seeds: &[DocSeed]) -> Vec<Doc> {
    let mut out: Vec<Doc> = Vec::with_capacity(seeds.len().min(MAX_DOCS));
    for seed in seeds.iter().take(MAX_DOCS) {
        let plain = |bytes: Vec<u8>, predict| Doc {
            bytes,
            predict,
            value: None,
            respells: None,
        };
        let next = match seed {
            DocSeed::Raw(bytes) => plain(bytes.clone(), Predict::Unknown),
            DocSeed::Card(card) => {
                let (value, predict) = card.build();
                Doc {
                    bytes: serde_json::to_vec(&value).unwrap_or_default(),
                    predict,
                    value: Some(value),
                    respells: None,
                }
            }
            DocSeed::Mangled {
                card,
                keep,
                at,
                flip,
            } => {
                let (value, _) = card.build();
                let mut bytes = serde_json::to_vec(&value).unwrap_or_default();
                bytes.truncate(usize::from(*keep));
                if let Some(b) = bytes.get_mut(usize::from(*at)) {
                    *b ^= flip;
                }
                plain(bytes, Predict::Unknown)
            }
            DocSeed::CopyOf(i) if !out.is_empty() => out[usize::from(*i) % out.len()].clone(),
            DocSeed::Respelled {
                of,
                pretty,
                alias,
                explicit_defaults,
            } if !out.is_empty() => {
                let index = usize::from(*of) % out.len();
                let original = &out[index];
                match &original.value {
                    Some(value) => Doc {
                        bytes: respell(value, *pretty, *alias, *explicit_defaults),
                        predict: original.predict.clone(),
                        value: None,
                        respells: Some(index),
                    },
                    None => original.clone(),
                }
            }
            DocSeed::CopyOf(_) | DocSeed::Respelled { .. } => plain(Vec::new(), Predict::Rejected),
        };
        out.push(next);
    }
    out
}
