//! One test per resolution rule (see the module docs), plus JSON round trips.

use super::*;

fn decode_rr() -> DecodeDefaults {
    DecodeDefaults {
        router_mode: SelectionMode::RoundRobin,
        kv_router_config: None,
        block_size: 16,
        session_affinity_ttl: Some(Duration::from_secs(300)),
    }
}

fn advertised(mode: SelectionMode) -> ModelCard {
    ModelCard {
        router_config: Some(RouterConfig {
            router_mode: mode,
            ..RouterConfig::default()
        }),
        ..ModelCard::named("llama")
    }
}

#[test]
fn rule1_empty_card_list_is_an_error_naming_the_cause() {
    let err = resolve(&[], &decode_rr()).unwrap_err();
    assert_eq!(err, AdvertError::NoReadableCard);
    assert!(err.to_string().contains("no readable prefill model card"));
}

#[test]
fn rule2_unreadable_cards_are_skipped_and_counted() {
    let good = ModelCard::named("llama").to_json();
    let docs: Vec<&[u8]> = vec![b"{not json", &good, b"", b"[1,2]", b"{\"name\": 7}"];
    let parsed = parse_cards(docs);
    assert_eq!(parsed.cards, vec![ModelCard::named("llama")]);
    assert_eq!(parsed.skipped, 4);
}

#[test]
fn rule2_all_unreadable_falls_back_to_rule1() {
    let docs: Vec<&[u8]> = vec![b"garbage", b"\xff\xfe"];
    assert_eq!(
        resolve_raw(docs, &decode_rr()).unwrap_err(),
        AdvertError::NoReadableCard
    );
}

#[test]
fn rule3_silent_card_inherits_the_decode_mode_without_tuning() {
    let cfg = resolve(&[ModelCard::named("llama")], &decode_rr()).unwrap();
    assert_eq!(cfg.router_mode, SelectionMode::RoundRobin);
    assert_eq!(cfg.kv_router_config, None);
    assert!(!cfg.advertised);
}

#[test]
fn rule3_advertised_mode_overrides_the_decode_mode() {
    let cfg = resolve(&[advertised(SelectionMode::KV)], &decode_rr()).unwrap();
    assert_eq!(cfg.router_mode, SelectionMode::KV);
    assert!(cfg.advertised);
}

#[test]
fn rule4_first_card_wins_and_disagreements_are_counted() {
    let cards = vec![
        advertised(SelectionMode::KV),
        ModelCard::named("llama"), // inherits RoundRobin: disagrees
        advertised(SelectionMode::KV),
        advertised(SelectionMode::Random), // disagrees
    ];
    let cfg = resolve(&cards, &decode_rr()).unwrap();
    assert_eq!(cfg.router_mode, SelectionMode::KV);
    assert_eq!(cfg.disagreeing_cards, 2);
    assert_eq!(cfg.total_cards, 4);
}

/// Counts the warnings logged while `f` runs on this thread.
fn warnings_during(f: impl FnOnce()) -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use tracing::span::{Attributes, Id, Record};
    use tracing::{Event, Level, Metadata};

    struct CountWarnings(Arc<AtomicUsize>);
    impl tracing::Subscriber for CountWarnings {
        fn enabled(&self, _: &Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &Attributes<'_>) -> Id {
            Id::from_u64(1)
        }
        fn record(&self, _: &Id, _: &Record<'_>) {}
        fn record_follows_from(&self, _: &Id, _: &Id) {}
        fn event(&self, event: &Event<'_>) {
            if *event.metadata().level() == Level::WARN {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        fn enter(&self, _: &Id) {}
        fn exit(&self, _: &Id) {}
    }

    let count = Arc::new(AtomicUsize::new(0));
    tracing::subscriber::with_default(CountWarnings(Arc::clone(&count)), f);
    count.load(Ordering::SeqCst)
}

#[test]
fn rule4_disagreement_is_logged_once_and_agreement_not_at_all() {
    let one_disagrees = [advertised(SelectionMode::KV), ModelCard::named("llama")];
    let all_agree = [advertised(SelectionMode::KV), advertised(SelectionMode::KV)];
    let alone = [advertised(SelectionMode::KV)];
    let warned = |cards: &[ModelCard]| {
        warnings_during(|| {
            resolve(cards, &decode_rr()).unwrap();
        })
    };
    // Hit the warning's callsite on this thread before any subscriber is installed. Its first
    // hit registers it, and tracing-core computes a registering callsite's interest outside
    // the rebuild that installing the counting subscriber triggers: a first hit on another
    // test's thread, racing that rebuild, could cache the callsite as disabled, and the warning
    // would go uncounted (seen once in a full run). Registered here, the rebuild covers it.
    resolve(&one_disagrees, &decode_rr()).unwrap();
    assert_eq!(warned(&one_disagrees), 1);
    assert_eq!(warned(&all_agree), 0);
    assert_eq!(warned(&alone), 0);
}

#[test]
fn rule5_advertised_tuning_replaces_decode_tuning_whole() {
    let mut decode = decode_rr();
    decode.kv_router_config = Some(KvRouterConfig {
        overlap_score_weight: 9.0,
        router_temperature: 0.7,
        use_kv_events: false,
        router_track_active_blocks: false,
        ..KvRouterConfig::default()
    });
    // The card names a mode without restating tuning: it gets the defaults, not a merge.
    let cfg = resolve(&[advertised(SelectionMode::KV)], &decode).unwrap();
    let kv = cfg.kv_router_config.unwrap();
    assert_eq!(
        kv.overlap_score_weight,
        KvRouterConfig::default().overlap_score_weight
    );
    assert_eq!(kv.router_temperature, 0.0);
    assert!(kv.use_kv_events);
}

#[test]
fn rule5_silent_card_uses_the_decode_tuning() {
    let mut decode = decode_rr();
    let tuning = KvRouterConfig {
        overlap_score_weight: 2.0,
        ..KvRouterConfig::default()
    };
    decode.kv_router_config = Some(tuning.clone());
    let cfg = resolve(&[ModelCard::named("llama")], &decode).unwrap();
    assert_eq!(cfg.kv_router_config, Some(tuning));
}

#[test]
fn rule6_advertised_config_has_active_block_tracking_forced_off() {
    let mut card = advertised(SelectionMode::KV);
    card.router_config
        .as_mut()
        .unwrap()
        .kv_router_config
        .router_track_active_blocks = true;
    let cfg = resolve(&[card], &decode_rr()).unwrap();
    assert!(!cfg.kv_router_config.unwrap().router_track_active_blocks);
}

#[test]
fn rule7_block_size_zero_falls_back_to_the_decode_block_size() {
    let cfg = resolve(&[ModelCard::named("llama")], &decode_rr()).unwrap();
    assert_eq!(cfg.block_size, 16);
    let card = ModelCard {
        kv_cache_block_size: 64,
        ..ModelCard::named("llama")
    };
    assert_eq!(resolve(&[card], &decode_rr()).unwrap().block_size, 64);
}

#[test]
fn rule8_advertised_config_without_ttl_means_no_affinity() {
    let cfg = resolve(&[advertised(SelectionMode::RoundRobin)], &decode_rr()).unwrap();
    assert_eq!(cfg.session_affinity_ttl, None);
}

#[test]
fn rule8_advertised_ttl_is_taken_whole() {
    let mut card = advertised(SelectionMode::KV);
    card.router_config
        .as_mut()
        .unwrap()
        .session_affinity_ttl_secs = Some(42);
    let cfg = resolve(&[card], &decode_rr()).unwrap();
    assert_eq!(cfg.session_affinity_ttl, Some(Duration::from_secs(42)));
}

#[test]
fn rule8_silent_card_inherits_the_frontend_ttl() {
    let cfg = resolve(&[ModelCard::named("llama")], &decode_rr()).unwrap();
    assert_eq!(cfg.session_affinity_ttl, Some(Duration::from_secs(300)));
}

#[test]
fn rule9_eagle_flag_comes_from_the_first_card() {
    let eagle = ModelCard {
        runtime_config: RuntimeConfig { enable_eagle: true },
        ..ModelCard::named("llama")
    };
    let plain = ModelCard::named("llama");
    assert!(
        resolve(&[eagle.clone(), plain.clone()], &decode_rr())
            .unwrap()
            .enable_eagle
    );
    assert!(!resolve(&[plain, eagle], &decode_rr()).unwrap().enable_eagle);
}

#[test]
fn committed_kv_card_at_block_64_overrides_round_robin_cards() {
    // Upstream's integration scenario, resolution half: the selected KV card (block 64) first.
    let kv = ModelCard {
        kv_cache_block_size: 64,
        ..advertised(SelectionMode::KV)
    };
    let rr = ModelCard {
        kv_cache_block_size: 16,
        ..advertised(SelectionMode::RoundRobin)
    };
    let cfg = resolve(&[kv, rr], &decode_rr()).unwrap();
    assert_eq!((cfg.router_mode, cfg.block_size), (SelectionMode::KV, 64));
}

#[test]
fn real_looking_card_round_trips_through_json() {
    let json = br#"{
        "name": "meta-llama/Llama-3.1-8B-Instruct",
        "kv_cache_block_size": 32,
        "router_config": {
            "router_mode": "KV",
            "kv_router_config": {
                "overlap_score_weight": 1.5,
                "router_temperature": 0.2,
                "use_kv_events": false,
                "router_track_active_blocks": true
            },
            "session_affinity_ttl_secs": 600
        },
        "runtime_config": { "enable_eagle": true }
    }"#;
    let card = ModelCard::from_json(json).unwrap();
    assert_eq!(card.kv_cache_block_size, 32);
    let rc = card.router_config.as_ref().unwrap();
    assert_eq!(rc.router_mode, SelectionMode::KV);
    assert_eq!(rc.kv_router_config.overlap_score_weight, 1.5);
    assert_eq!(rc.session_affinity_ttl_secs, Some(600));
    assert!(card.runtime_config.enable_eagle);
    assert_eq!(ModelCard::from_json(&card.to_json()).unwrap(), card);
}

#[test]
fn minimal_card_round_trips_and_defaults_apply() {
    let card = ModelCard::from_json(br#"{"name":"m"}"#).unwrap();
    assert_eq!(card, ModelCard::named("m"));
    assert_eq!(ModelCard::from_json(&card.to_json()).unwrap(), card);
    let partial =
        ModelCard::from_json(br#"{"name":"m","router_config":{"router_mode":"round_robin"}}"#)
            .unwrap();
    let rc = partial.router_config.unwrap();
    assert_eq!(rc.router_mode, SelectionMode::RoundRobin);
    assert_eq!(rc.kv_router_config, KvRouterConfig::default());
}

#[test]
fn kv_router_config_defaults_match_upstream_where_the_replay_did_not_say_otherwise() {
    let d = KvRouterConfig::default();
    // Upstream's overlap weight is 1.0; ours is the credit a hot prefix keeps, 0.25, with the
    // keep credit and recent work beside it (docs/router.md, "KV cost").
    assert_eq!(d.overlap_score_weight, 0.25);
    assert_eq!(d.prefill_keep_credit, 31.0);
    assert_eq!(d.prefill_recent_work_weight, 0.25);
    assert_eq!(d.router_temperature, 0.0);
    assert!(d.use_kv_events);
    assert!(d.router_track_active_blocks);
}

#[test]
fn resolution_is_independent_of_the_order_of_identical_cards() {
    let card = advertised(SelectionMode::KV);
    let one = resolve(std::slice::from_ref(&card), &decode_rr()).unwrap();
    let three = resolve(&[card.clone(), card.clone(), card], &decode_rr()).unwrap();
    assert_eq!(
        PrefillConfig {
            total_cards: 1,
            ..three
        },
        one
    );
}

mod never_panics {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn parsing_any_bytes_never_panics(docs in proptest::collection::vec(
            proptest::collection::vec(any::<u8>(), 0..64), 0..8)) {
            let parsed = parse_cards(&docs);
            prop_assert_eq!(parsed.cards.len() + parsed.skipped, docs.len());
        }

        #[test]
        fn card_like_json_never_panics(name in ".{0,8}", bs in any::<i64>(), mode in "[A-Za-z_-]{0,12}",
                                       ttl in proptest::option::of(any::<i64>())) {
            let ttl = ttl.map_or("null".to_string(), |t| t.to_string());
            let doc = format!(r#"{{"name":{name:?},"kv_cache_block_size":{bs},
                "router_config":{{"router_mode":{mode:?},"session_affinity_ttl_secs":{ttl}}}}}"#);
            let _ = resolve_raw([doc.as_bytes()], &DecodeDefaults::default());
        }
    }
}

#[test]
fn router_modes_display_as_names_a_card_accepts() {
    // Logs show the mode in the spelling an operator would write in a card.
    let modes = [
        (SelectionMode::RoundRobin, "round-robin"),
        (SelectionMode::Random, "random"),
        (SelectionMode::KV, "kv"),
        (SelectionMode::Direct, "direct"),
    ];
    for (mode, name) in modes {
        assert_eq!(mode.to_string(), name);
        let parsed: SelectionMode = serde_json::from_str(&format!("\"{name}\"")).unwrap();
        assert_eq!(parsed, mode);
    }
}

#[test]
fn load_only_is_the_default_without_keep_credit_or_recent_work() {
    let plain = KvRouterConfig::load_only();
    assert_eq!(plain.overlap_score_weight, 1.0);
    assert_eq!(plain.prefill_keep_credit, 0.0);
    assert_eq!(plain.prefill_recent_work_weight, 0.0);
    assert_ne!(plain, KvRouterConfig::default());
    assert_eq!(
        KvRouterConfig {
            overlap_score_weight: 0.25,
            prefill_keep_credit: 31.0,
            prefill_recent_work_weight: 0.25,
            ..plain
        },
        KvRouterConfig::default()
    );
}

#[test]
fn a_routed_card_carries_its_name_mode_and_block_size() {
    let card = ModelCard::routed("m", SelectionMode::KV, 32);
    assert_eq!(card.name, "m");
    assert_eq!(card.kv_cache_block_size, 32);
    let config = card
        .router_config
        .expect("a routed card advertises a router config");
    assert_eq!(config.router_mode, SelectionMode::KV);
}

#[test]
fn an_engine_card_round_trips_and_names_its_protocol() {
    use std::str::FromStr;
    assert_eq!(EngineProtocol::from_str("vllm"), Ok(EngineProtocol::Vllm));
    assert_eq!(
        EngineProtocol::from_str("sglang"),
        Err(UnknownProtocol("sglang".into()))
    );
    assert_eq!(EngineProtocol::Vllm.to_string(), "vllm");
    let card = ModelCard {
        engine: Some(EngineCard {
            protocol: EngineProtocol::Vllm,
        }),
        ..ModelCard::named("m")
    };
    let json = String::from_utf8(card.to_json()).unwrap();
    assert!(json.contains(r#""engine":{"protocol":"vllm"}"#), "{json}");
    assert_eq!(ModelCard::from_json(json.as_bytes()).unwrap(), card);
    // A card of our own workers says nothing of engines, and an unknown protocol is no card.
    let plain = String::from_utf8(ModelCard::named("m").to_json()).unwrap();
    assert!(!plain.contains("engine"), "{plain}");
    assert!(ModelCard::from_json(br#"{"name":"m","engine":{"protocol":"x"}}"#).is_err());
}
