use std::path::{Path, PathBuf};

use proptest::prelude::*;
use serde_json::Value as Json;

use super::msgpack::Writer;
use super::*;

// ---------------------------------------------------------------------------------------------
// A test-side msgpack value, to write what the encoder never writes (unknown events and keys,
// shuffled keys, signed and bin hashes, broken fields).

#[derive(Clone, Debug)]
enum V {
    Nil,
    Bool(bool),
    U(u64),
    I(i64),
    F(f64),
    S(String),
    Bin(Vec<u8>),
    A(Vec<V>),
    M(Vec<(V, V)>),
}

fn s(x: &str) -> V {
    V::S(x.to_owned())
}

fn write(w: &mut Writer, v: &V) {
    match v {
        V::Nil => w.nil(),
        V::Bool(b) => w.0.push(if *b { 0xc3 } else { 0xc2 }),
        V::U(u) => w.uint(*u),
        V::I(i) => w.int(*i),
        V::F(f) => w.f64(*f),
        V::S(x) => w.str(x),
        V::Bin(b) => w.bin(b),
        V::A(items) => {
            w.array(items.len());
            items.iter().for_each(|i| write(w, i));
        }
        V::M(entries) => {
            w.map(entries.len());
            for (k, v) in entries {
                write(w, k);
                write(w, v);
            }
        }
    }
}

fn bytes(v: &V) -> Vec<u8> {
    let mut w = Writer(Vec::new());
    write(&mut w, v);
    w.0
}

fn batch_v(events: Vec<V>) -> V {
    V::A(vec![V::F(1.5), V::A(events), V::U(0)])
}

fn opt<T>(x: Option<T>, f: impl FnOnce(T) -> V) -> V {
    x.map_or(V::Nil, f)
}

/// An event's tagged map entries, in vLLM's key order.
fn tagged_fields(e: &EngineEvent) -> Vec<(V, V)> {
    let hashes = |h: &[u64]| V::A(h.iter().map(|&x| V::U(x)).collect());
    let str_opt = |m: &Option<String>| opt(m.clone(), V::S);
    match e {
        EngineEvent::Stored(b) => vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), hashes(&b.hashes)),
            (s("parent_block_hash"), opt(b.parent, V::U)),
            (
                s("token_ids"),
                V::A(b.token_ids.iter().map(|&t| V::U(t.into())).collect()),
            ),
            (s("block_size"), V::U(b.block_size.into())),
            (s("lora_id"), opt(b.lora_id, V::I)),
            (s("medium"), str_opt(&b.medium)),
            (s("group_idx"), V::U(b.group_idx.into())),
            (s("kv_cache_spec_kind"), str_opt(&b.spec_kind)),
        ],
        EngineEvent::Removed {
            hashes: h,
            group_idx,
            medium,
        } => vec![
            (s("type"), s("BlockRemoved")),
            (s("block_hashes"), hashes(h)),
            (s("medium"), str_opt(medium)),
            (s("group_idx"), V::U((*group_idx).into())),
        ],
        EngineEvent::Cleared => vec![(s("type"), s("AllBlocksCleared"))],
        EngineEvent::Invalid { .. } => unreachable!("not generated"),
    }
}

// ---------------------------------------------------------------------------------------------
// Real vLLM 0.32.0 payloads.

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vllm_kv_events")
}

/// (name, payload, decoded form) of every captured payload.
fn fixtures() -> Vec<(String, Vec<u8>, Json)> {
    let mut names: Vec<PathBuf> = std::fs::read_dir(fixture_dir())
        .expect("fixture dir")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "bin"))
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|bin| {
            let json = std::fs::read_to_string(bin.with_extension("json")).expect("json");
            let name = bin
                .file_name()
                .expect("name")
                .to_string_lossy()
                .into_owned();
            let payload = std::fs::read(&bin).expect("bin");
            (
                name,
                payload,
                serde_json::from_str(&json).expect("valid json"),
            )
        })
        .collect()
}

/// Every key vLLM 0.32 may write (`protocols.md` section 3): the decoder must know them all.
const VLLM_032_KEYS: &[&str] = &[
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
];

fn json_u64s(j: &Json) -> Vec<u64> {
    let arr = j.as_array().expect("array");
    arr.iter().map(|x| x.as_u64().expect("u64")).collect()
}

fn json_opt_str(j: Option<&Json>) -> Option<String> {
    j.and_then(Json::as_str).map(str::to_owned)
}

#[test]
fn real_vllm_payloads_decode_exactly() {
    let all = fixtures();
    assert_eq!(all.len(), 5, "the five captured payloads");
    for (name, payload, json) in &all {
        let batch = decode_engine_batch(payload).unwrap_or_else(|e| panic!("{name}: {e}"));
        let want_ts = json[0].as_f64().expect("ts");
        // serde_json's default float parsing may be one ulp off msgspec's exact float64.
        assert!(
            (batch.ts - want_ts).abs() <= want_ts.abs() * 1e-15,
            "{name}"
        );
        assert_eq!(batch.dp_rank, json[2].as_u64().map(|r| r as u32), "{name}");
        assert_eq!(batch.skipped, Skipped::default(), "{name}");
        let want = json[1].as_array().expect("events");
        assert_eq!(batch.events.len(), want.len(), "{name}");
        for (got, want) in batch.events.iter().zip(want) {
            let map = want.as_object().expect("tagged map");
            for key in map.keys() {
                assert!(VLLM_032_KEYS.contains(&key.as_str()), "{name}: key {key}");
            }
            let group = map
                .get("group_idx")
                .map_or(0, |g| g.as_u64().expect("group"));
            match (map["type"].as_str().expect("type"), got) {
                ("BlockStored", EngineEvent::Stored(b)) => {
                    assert_eq!(b.hashes, json_u64s(&map["block_hashes"]), "{name}");
                    assert_eq!(b.parent, map["parent_block_hash"].as_u64(), "{name}");
                    let tokens: Vec<u32> = json_u64s(&map["token_ids"])
                        .into_iter()
                        .map(|t| u32::try_from(t).expect("token"))
                        .collect();
                    assert_eq!(b.token_ids, tokens, "{name}");
                    assert_eq!(Some(u64::from(b.block_size)), map["block_size"].as_u64());
                    assert_eq!(b.lora_id, map["lora_id"].as_i64(), "{name}");
                    assert_eq!(b.medium, json_opt_str(map.get("medium")), "{name}");
                    assert_eq!(u64::from(b.group_idx), group, "{name}");
                    let kind = json_opt_str(map.get("kv_cache_spec_kind"));
                    assert_eq!(b.spec_kind, kind, "{name}");
                    assert_eq!(b.token_ids.len(), b.hashes.len() * b.block_size as usize);
                }
                (
                    "BlockRemoved",
                    EngineEvent::Removed {
                        hashes,
                        group_idx,
                        medium,
                    },
                ) => {
                    assert_eq!(*hashes, json_u64s(&map["block_hashes"]), "{name}");
                    assert_eq!(*medium, json_opt_str(map.get("medium")), "{name}");
                    assert_eq!(u64::from(*group_idx), group, "{name}");
                }
                ("AllBlocksCleared", EngineEvent::Cleared) => {}
                (ty, got) => panic!("{name}: json {ty}, decoded {got:?}"),
            }
        }
    }
}

#[test]
fn real_vllm_payloads_reencode_to_the_same_batch() {
    for (name, payload, _) in fixtures() {
        let batch = decode_engine_batch(&payload).expect("decodes");
        let again = encode_engine_batch(&batch, EngineEncoding::Tagged);
        assert_eq!(decode_engine_batch(&again), Ok(batch), "{name}");
    }
}

#[test]
fn truncated_payloads_are_typed_errors() {
    for (name, payload, _) in fixtures() {
        for cut in 0..payload.len() {
            let got = decode_engine_batch(&payload[..cut]);
            assert!(
                matches!(got, Err(EngineDecodeError::Truncated { .. })),
                "{name} cut at {cut}: {got:?}"
            );
        }
        let mut longer = payload.clone();
        longer.push(0);
        assert_eq!(
            decode_engine_batch(&longer),
            Err(EngineDecodeError::TrailingBytes { at: payload.len() })
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Hand-written payloads.

fn stored_v(hashes: V, tokens: V) -> V {
    V::M(vec![
        (s("block_size"), V::U(2)),
        (s("token_ids"), tokens),
        (s("block_hashes"), hashes),
        (s("type"), s("BlockStored")), // the tag need not come first
    ])
}

fn only_event(v: V) -> EngineEvent {
    let batch = decode_engine_batch(&bytes(&batch_v(vec![v]))).expect("batch");
    assert_eq!(batch.events.len(), 1);
    batch.events.into_iter().next().expect("one event")
}

#[test]
fn sglang_negative_hashes_map_to_u64() {
    let event = only_event(stored_v(
        V::A(vec![V::I(-1), V::I(i64::MIN), V::U(u64::MAX)]),
        V::A(vec![V::U(1), V::U(2)]),
    ));
    let EngineEvent::Stored(b) = event else {
        panic!("{event:?}")
    };
    assert_eq!(b.hashes, vec![u64::MAX, 1 << 63, u64::MAX]);
    assert_eq!((b.parent, b.group_idx, b.spec_kind), (None, 0, None));
}

#[test]
fn bin_digest_hashes_fold_to_their_last_eight_bytes() {
    let digest: Vec<u8> = (1..=32).collect();
    let event = only_event(stored_v(
        V::A(vec![
            V::Bin(digest),
            V::Bin(vec![0xab, 0xcd]),
            V::Bin(vec![]),
        ]),
        V::A(vec![]),
    ));
    let EngineEvent::Stored(b) = event else {
        panic!("{event:?}")
    };
    assert_eq!(b.hashes, vec![0x191a_1b1c_1d1e_1f20, 0xabcd, 0]);
}

#[test]
fn unusable_fields_keep_the_event_in_place_as_invalid() {
    let ok_tokens = || V::A(vec![V::U(1), V::U(2)]);
    let ok_hashes = || V::A(vec![V::U(7)]);
    let cases = [
        (
            stored_v(ok_hashes(), V::A(vec![V::I(-1)])),
            InvalidEvent::TokenOutOfRange,
        ),
        (
            stored_v(ok_hashes(), V::A(vec![V::U(1 << 32)])),
            InvalidEvent::TokenOutOfRange,
        ),
        (
            stored_v(ok_hashes(), V::A(vec![V::A(vec![V::U(1), V::U(2)])])),
            InvalidEvent::WrongType { field: "token_ids" },
        ),
        (
            stored_v(s("nope"), ok_tokens()),
            InvalidEvent::WrongType {
                field: "block_hashes",
            },
        ),
        (
            V::M(vec![
                (s("type"), s("BlockStored")),
                (s("token_ids"), ok_tokens()),
            ]),
            InvalidEvent::MissingField("block_hashes"),
        ),
    ];
    for (event, reason) in cases {
        let cleared = V::M(vec![(s("type"), s("AllBlocksCleared"))]);
        let batch = decode_engine_batch(&bytes(&batch_v(vec![event, cleared]))).expect("batch");
        let kind = EngineEventKind::Stored;
        assert_eq!(
            batch.events,
            vec![EngineEvent::Invalid { kind, reason }, EngineEvent::Cleared]
        );
    }
    let removed = V::A(vec![s("BlockRemoved"), V::A(vec![V::F(1.0)])]);
    let field = "block_hashes";
    assert_eq!(
        only_event(removed),
        EngineEvent::Invalid {
            kind: EngineEventKind::Removed,
            reason: InvalidEvent::WrongType { field }
        }
    );
}

#[test]
fn positional_events_accept_missing_and_extra_trailing_fields() {
    let stored = V::A(vec![
        s("BlockStored"),
        V::A(vec![V::U(5)]),
        V::U(4),
        V::A(vec![V::U(9)]),
        V::U(1),
    ]);
    let removed = V::A(vec![
        s("BlockRemoved"),
        V::A(vec![V::U(5)]),
        s("GPU"),
        V::U(3),
        V::Nil,
    ]);
    let batch = decode_engine_batch(&bytes(&V::A(vec![V::U(7), V::A(vec![stored, removed])])))
        .expect("batch");
    let want_stored = EngineEvent::Stored(StoredBlocks {
        hashes: vec![5],
        parent: Some(4),
        token_ids: vec![9],
        block_size: 1,
        lora_id: None,
        medium: None,
        group_idx: 0,
        spec_kind: None,
    });
    let medium = Some("GPU".to_owned());
    let want_removed = EngineEvent::Removed {
        hashes: vec![5],
        group_idx: 0,
        medium,
    };
    assert_eq!(batch.events, vec![want_stored, want_removed]);
    assert_eq!((batch.ts, batch.dp_rank), (7.0, None));
    assert_eq!(batch.skipped, Skipped::default());
}

#[test]
fn broken_outer_structure_fails_the_batch() {
    let not = |v: V| decode_engine_batch(&bytes(&v));
    assert!(matches!(
        not(V::M(vec![])),
        Err(EngineDecodeError::NotABatch(_))
    ));
    assert!(matches!(
        not(V::A(vec![V::U(1)])),
        Err(EngineDecodeError::NotABatch(_))
    ));
    let ts_str = V::A(vec![s("x"), V::A(vec![])]);
    assert!(matches!(not(ts_str), Err(EngineDecodeError::NotABatch(_))));
    let bad_rank = V::A(vec![V::U(1), V::A(vec![]), V::I(-1)]);
    assert!(matches!(
        not(bad_rank),
        Err(EngineDecodeError::NotABatch(_))
    ));
    assert_eq!(
        decode_engine_batch(&[0x92, 0xc1, 0x90]),
        Err(EngineDecodeError::BadMarker { at: 1, byte: 0xc1 })
    );
    let big = vec![0u8; MAX_ENGINE_BATCH_BYTES + 1];
    assert!(matches!(
        decode_engine_batch(&big),
        Err(EngineDecodeError::Oversize { .. })
    ));
    // A length prefix beyond the input is refused before anything is reserved.
    let huge_array = [0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff];
    assert_eq!(
        decode_engine_batch(&huge_array),
        Err(EngineDecodeError::Truncated { at: 7 })
    );
}

#[test]
fn batch_limits_are_enforced() {
    let nils = V::A(vec![V::Nil; MAX_ENGINE_EVENTS + 1]);
    let got = decode_engine_batch(&bytes(&V::A(vec![V::U(0), nils])));
    let count = MAX_ENGINE_EVENTS + 1;
    assert_eq!(got, Err(EngineDecodeError::TooManyEvents { count }));

    let removed = |n| V::A(vec![s("BlockRemoved"), V::A(vec![V::U(1); n])]);
    let ok = batch_v(vec![
        removed(MAX_ENGINE_HASHES / 2),
        removed(MAX_ENGINE_HASHES / 2),
    ]);
    assert!(decode_engine_batch(&bytes(&ok)).is_ok());
    let over = batch_v(vec![
        removed(MAX_ENGINE_HASHES / 2),
        removed(MAX_ENGINE_HASHES / 2 + 1),
    ]);
    let got = decode_engine_batch(&bytes(&over));
    assert_eq!(got, Err(EngineDecodeError::TooManyHashes));

    let tokens = V::A(vec![V::U(1); MAX_ENGINE_TOKENS + 1]);
    let got = decode_engine_batch(&bytes(&batch_v(vec![stored_v(V::A(vec![]), tokens)])));
    assert_eq!(got, Err(EngineDecodeError::TooManyTokens));

    let mut deep = V::Nil;
    for _ in 0..MAX_DEPTH {
        deep = V::A(vec![deep]);
    }
    let event = V::M(vec![(s("type"), s("AllBlocksCleared")), (s("x"), deep)]);
    let got = decode_engine_batch(&bytes(&batch_v(vec![event])));
    assert!(
        matches!(got, Err(EngineDecodeError::TooDeep { .. })),
        "{got:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Properties.

fn arb_str() -> impl Strategy<Value = String> {
    "[a-zA-Zé_]{0,40}"
}

fn arb_event(positional: bool) -> impl Strategy<Value = EngineEvent> {
    let group = if positional {
        Just(0u32).boxed()
    } else {
        any::<u32>().boxed()
    };
    let kind = if positional {
        Just(None).boxed()
    } else {
        proptest::option::of(arb_str()).boxed()
    };
    let stored = (
        (
            proptest::collection::vec(any::<u64>(), 0..6),
            proptest::option::of(any::<u64>()),
            proptest::collection::vec(any::<u32>(), 0..40),
            any::<u32>(),
        ),
        (
            proptest::option::of(any::<i64>()),
            proptest::option::of(arb_str()),
            group.clone(),
            kind,
        ),
    )
        .prop_map(
            |((hashes, parent, token_ids, block_size), (lora_id, medium, group_idx, spec_kind))| {
                EngineEvent::Stored(StoredBlocks {
                    hashes,
                    parent,
                    token_ids,
                    block_size,
                    lora_id,
                    medium,
                    group_idx,
                    spec_kind,
                })
            },
        );
    let removed = (
        proptest::collection::vec(any::<u64>(), 0..6),
        group,
        proptest::option::of(arb_str()),
    )
        .prop_map(|(hashes, group_idx, medium)| EngineEvent::Removed {
            hashes,
            group_idx,
            medium,
        });
    prop_oneof![stored, removed, Just(EngineEvent::Cleared)]
}

fn arb_batch(positional: bool) -> impl Strategy<Value = EngineBatch> {
    (
        any::<f64>().prop_filter("NaN is not equal to itself", |f| !f.is_nan()),
        proptest::collection::vec(arb_event(positional), 0..12),
        proptest::option::of(any::<u32>()),
    )
        .prop_map(|(ts, events, dp_rank)| EngineBatch {
            ts,
            events,
            dp_rank,
            skipped: Skipped::default(),
        })
}

/// Any msgpack value, a few levels deep.
fn arb_value() -> impl Strategy<Value = V> {
    let leaf = prop_oneof![
        Just(V::Nil),
        any::<bool>().prop_map(V::Bool),
        any::<u64>().prop_map(V::U),
        any::<i64>().prop_map(V::I),
        any::<f64>().prop_map(V::F),
        arb_str().prop_map(V::S),
        proptest::collection::vec(any::<u8>(), 0..40).prop_map(V::Bin),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(V::A),
            proptest::collection::vec((inner.clone(), inner), 0..4).prop_map(V::M),
        ]
    })
}

/// An event no decoder knows: another type, a map without type, a scalar, an empty array.
fn arb_unknown_event() -> impl Strategy<Value = V> {
    let name = "X[a-zA-Z]{0,12}";
    prop_oneof![
        (
            name,
            proptest::collection::vec((arb_str(), arb_value()), 0..4)
        )
            .prop_map(|(n, f)| {
                let mut fields: Vec<(V, V)> = f.into_iter().map(|(k, v)| (V::S(k), v)).collect();
                fields.push((s("type"), V::S(n)));
                V::M(fields)
            }),
        (name, proptest::collection::vec(arb_value(), 0..4)).prop_map(|(n, mut items)| {
            items.insert(0, V::S(n));
            V::A(items)
        }),
        proptest::collection::vec(("x_[a-z]{0,6}", arb_value()), 0..3)
            .prop_map(|f| V::M(f.into_iter().map(|(k, v)| (V::S(k), v)).collect())),
        arb_value().prop_filter("containers may be events", |v| {
            !matches!(v, V::A(_) | V::M(_))
        }),
        Just(V::A(vec![])),
    ]
}

proptest! {
    #[test]
    fn encoded_batches_decode_to_themselves(
        tagged in arb_batch(false),
        positional in arb_batch(true),
    ) {
        let bytes = encode_engine_batch(&tagged, EngineEncoding::Tagged);
        prop_assert_eq!(decode_engine_batch(&bytes), Ok(tagged));
        let bytes = encode_engine_batch(&positional, EngineEncoding::Positional);
        prop_assert_eq!(decode_engine_batch(&bytes), Ok(positional));
    }

    #[test]
    fn unknown_event_types_and_fields_are_skipped_and_counted(
        batch in arb_batch(false),
        unknown_events in proptest::collection::vec((any::<usize>(), arb_unknown_event()), 0..5),
        unknown_fields in proptest::collection::vec(
            (any::<usize>(), any::<usize>(), "x_[a-z]{0,8}", arb_value()), 0..8),
        rotations in proptest::collection::vec(any::<usize>(), 12),
    ) {
        let mut events: Vec<Vec<(V, V)>> = batch.events.iter().map(tagged_fields).collect();
        let mut injected_fields = 0;
        for (at_event, at_key, key, value) in unknown_fields {
            if let Some(len) = std::num::NonZeroUsize::new(events.len()) {
                let fields = &mut events[at_event % len.get()];
                fields.insert(at_key % (fields.len() + 1), (V::S(key), value));
                injected_fields += 1;
            }
        }
        // Keys in any order: the tag need not come first.
        for (fields, r) in events.iter_mut().zip(rotations) {
            let len = fields.len();
            fields.rotate_left(r % len);
        }
        let mut wire: Vec<V> = events.into_iter().map(V::M).collect();
        for (at, event) in &unknown_events {
            wire.insert(at % (wire.len() + 1), event.clone());
        }
        let payload = bytes(&V::A(vec![
            V::F(batch.ts),
            V::A(wire),
            opt(batch.dp_rank, |r| V::U(r.into())),
        ]));
        let decoded = decode_engine_batch(&payload).expect("well-formed");
        prop_assert_eq!(&decoded.events, &batch.events);
        let want = Skipped {
            unknown_events: unknown_events.len() as u32,
            unknown_fields: injected_fields,
        };
        prop_assert_eq!(decoded.skipped, want);
    }

    #[test]
    fn sglang_signed_hashes_are_bit_cast(hashes in proptest::collection::vec(any::<i64>(), 0..8)) {
        let event = only_event(V::M(vec![
            (s("type"), s("BlockRemoved")),
            (s("block_hashes"), V::A(hashes.iter().map(|&h| V::I(h)).collect())),
        ]));
        let want: Vec<u64> = hashes.iter().map(|&h| h as u64).collect();
        let EngineEvent::Removed { hashes: got, .. } = event else { panic!("{event:?}") };
        prop_assert_eq!(got, want);
    }

    #[test]
    fn arbitrary_bytes_never_panic(payload in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_engine_batch(&payload);
    }

    #[test]
    fn mutated_real_payloads_never_panic_and_reencode_when_valid(
        which in any::<usize>(),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
        keep in any::<usize>(),
    ) {
        let all = fixtures();
        let mut payload = all[which % all.len()].1.clone();
        for (at, mask) in flips {
            let len = payload.len();
            payload[at % len] ^= mask;
        }
        payload.truncate(keep % (payload.len() + 1) + payload.len() / 2);
        if let Ok(batch) = decode_engine_batch(&payload) {
            let valid: Vec<EngineEvent> = batch
                .events
                .iter()
                .filter(|e| !matches!(e, EngineEvent::Invalid { .. }))
                .cloned()
                .collect();
            let again = decode_engine_batch(&encode_engine_batch(&batch, EngineEncoding::Tagged))
                .expect("re-encoded batch decodes");
            prop_assert_eq!(again.events, valid);
            prop_assert_eq!(again.ts.to_bits(), batch.ts.to_bits());
            prop_assert_eq!(again.dp_rank, batch.dp_rank);
        }
    }
}

#[test]
fn known_optional_fields_are_not_counted_and_foreign_ones_are() {
    let stored = V::M(vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), V::A(vec![V::U(3)])),
        (s("token_ids"), V::A(vec![V::U(1)])),
        (s("block_size"), V::U(1)),
        (s("lora_name"), V::Nil),
        (s("extra_keys"), V::A(vec![V::A(vec![s("salt")])])),
        (s("kv_cache_spec_sliding_window"), V::U(4096)),
        (s("locality"), s("local")),
        (s("ownership"), s("owned")),
        (s("session_id"), s("abc")),
        (s("cache_salt"), s("pepper")),
    ]);
    // BlockStored's own keys are foreign to a BlockRemoved (2 here), as is a non-string key.
    let removed = V::M(vec![
        (s("token_ids"), V::A(vec![V::I(-5)])),
        (s("type"), s("BlockRemoved")),
        (s("block_hashes"), V::A(vec![V::U(3)])),
        (s("lora_name"), V::Nil),
        (s("locality"), s("local")),
        (V::U(1), V::Nil),
    ]);
    let batch = decode_engine_batch(&bytes(&batch_v(vec![stored, removed]))).expect("batch");
    assert!(matches!(batch.events[0], EngineEvent::Stored(_)));
    assert!(matches!(batch.events[1], EngineEvent::Removed { .. }));
    let want = Skipped {
        unknown_events: 0,
        unknown_fields: 3,
    };
    assert_eq!(batch.skipped, want);
}

#[test]
fn long_strings_and_collections_round_trip() {
    let long = "m".repeat(70_000);
    let batch = EngineBatch {
        ts: 0.0,
        events: vec![
            EngineEvent::Removed {
                // With the stored hash below, exactly the per-batch limit (array16).
                hashes: (0..MAX_ENGINE_HASHES as u64 - 1).collect(),
                group_idx: 1,
                medium: Some("x".repeat(300)),
            };
            1
        ]
        .into_iter()
        .chain([EngineEvent::Stored(StoredBlocks {
            hashes: vec![u64::MAX],
            parent: Some(0),
            token_ids: (0..70_000).collect(), // array32
            block_size: 70_000,
            lora_id: Some(i64::MIN),
            medium: Some(long),
            group_idx: 0,
            spec_kind: Some("sliding_window".to_owned()),
        })])
        .collect(),
        dp_rank: Some(u32::MAX),
        skipped: Skipped::default(),
    };
    for encoding in [EngineEncoding::Tagged, EngineEncoding::Positional] {
        let mut want = batch.clone();
        if encoding == EngineEncoding::Positional {
            // The positional form carries neither group nor spec kind.
            if let EngineEvent::Removed { group_idx, .. } = &mut want.events[0] {
                *group_idx = 0;
            }
            if let EngineEvent::Stored(b) = &mut want.events[1] {
                b.spec_kind = None;
            }
        }
        let bytes = encode_engine_batch(&batch, encoding);
        assert!(decode_engine_batch(&bytes) == Ok(want), "{encoding:?}");
    }
}
