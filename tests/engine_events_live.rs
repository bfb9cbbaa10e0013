//! Engine KV events against real vLLM (`.ci/vllm.sh`; each test skips, saying so, when its
//! engine is not named): the index credits exactly what the engine reports cached, a late
//! joiner rebuilds it from the replay, a wrong block size is reported, an engine that evicts is
//! followed, and (by hand) an engine restarted under the subscriber is noticed. The fake-engine
//! versions run in the README's test command (`tests/engine_events.rs`).

use std::net::SocketAddr;
use std::time::Duration;

use prefill_router::advert::ModelCard;
use prefill_router::discovery::{
    Discovery, EndpointId, Instance, MemoryConfig, MemoryDiscovery, Registration,
};
use prefill_router::request::GenerateRequest;
use prefill_router::PrefillHop;

#[path = "support/engine_cards.rs"]
mod engine_cards;
use engine_cards::{card, live_hop, register};

/// Against a real vLLM prefill engine publishing its KV events when `PREFILL_VLLM_EVENTS`
/// names its `HOST:PORT` (`.ci/vllm.sh`; skipped, saying so, otherwise): after prompts with
/// shared prefixes, the blocks the router's index credits the engine with for the next prompt
/// equal the cached tokens the engine reports for it (to the block); a second router that joins
/// late rebuilds the same picture from the engine's replay; a router whose card says another
/// block size reports the mismatch instead of routing around it silently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_vllm_events_index_what_the_engine_caches() {
    use prefill_router::binding::Binding;
    use prefill_router::engine::FeedState;
    use prefill_router::kv_events::{MirrorError, Picture};

    let Ok(e) = std::env::var("PREFILL_VLLM_EVENTS") else {
        eprintln!("skipped: set PREFILL_VLLM_EVENTS to a vLLM prefill engine with KV events on");
        return;
    };
    let addr: SocketAddr = e.parse().unwrap();
    let start = |block_size| events_hop(addr, block_size);
    let (hop, _r) = start(32).await;
    // A fresh subscriber learns the engine's whole history (a replay from 0) before its first
    // picture.
    let waited = wait_events_ready(&hop).await;
    println!("live events: first picture after {waited:?}");
    let status = hop.binding_stats().engine_kv.status(1).unwrap();
    assert_eq!(status.state, FeedState::Subscribed, "{status:?}");

    // A family of prompts sharing a 160-token prefix (5 blocks of 32), salted per run so the
    // engine's cache from earlier tests does not answer.
    let salt = (std::process::id() % 500) * 2;
    let shared: Vec<u32> = (0..160u32).map(|i| 5 + (salt + i * 13) % 900).collect();
    let prompt = |n: u32, len: usize| -> Vec<u32> {
        let mut p = shared.clone();
        p.extend((0..len as u32).map(|i| 7 + (n * 31 + i * 7) % 900));
        p
    };
    let binding = hop.router().route().binding().cloned().unwrap();
    let mut compared = 0;
    for n in 0..6u32 {
        let tokens = prompt(n, 40 + 8 * n as usize);
        // What the index says the engine holds of this prompt, once the events of every earlier
        // prefill are in (bounded wait for them to settle).
        let mut predicted = None;
        for _ in 0..50 {
            predicted = binding.dispatcher().kv_indexed_overlap(&tokens, 1);
            if n == 0 || predicted.unwrap_or(0) >= 5 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let info = binding
            .prefill(GenerateRequest::new(tokens.clone(), 1))
            .await
            .unwrap();
        let reported = info
            .handoff
            .as_ref()
            .map_or(0, |h| h.cached_blocks as usize);
        println!("live events: prompt {n}: index {predicted:?} blocks, engine reports {reported} cached blocks");
        assert_eq!(
            predicted.unwrap_or(0),
            reported,
            "prompt {n}: index vs engine"
        );
        if n > 0 {
            assert!(reported >= 5, "the shared prefix was cached");
            compared += 1;
        }
    }
    assert_eq!(compared, 5);
    let status = hop.binding_stats().engine_kv.status(1).unwrap();
    println!("live events: {status:?}");
    assert_eq!(status.picture, Picture::Exact, "{status:?}");
    assert_eq!(status.undecodable, 0);
    assert_eq!(hop.warnings(), Vec::<String>::new());
    let mut registry = prometheus_client::registry::Registry::default();
    hop.register_metrics(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains("prefill_router_engine_kv_exact{engine=\"1\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("prefill_router_kv_overlap_decisions_total 5"),
        "{text}"
    );
    assert!(
        text.contains("prefill_router_kv_zero_overlap_decisions_total 1"),
        "{text}"
    );
    // Forty more distinct prompts (three new blocks each, one batch each) time the freshness.
    for n in 0..40u32 {
        let tokens: Vec<u32> = (0..100u32)
            .map(|i| 3 + (salt + n * 211 + i * 17) % 950)
            .collect();
        binding
            .prefill(GenerateRequest::new(tokens, 1))
            .await
            .unwrap();
    }
    for _ in 0..100 {
        let received = hop
            .binding_stats()
            .engine_kv
            .status(1)
            .map_or(0, |s| s.received);
        if received >= 45 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let status = hop.binding_stats().engine_kv.status(1).unwrap();
    let fresh = &status.freshness;
    println!(
        "FIGURE engine_kv_freshness_ms samples={} p50={:.2} p99={:.2} max={:.2}",
        fresh.len(),
        fresh.quantile(0.5).unwrap_or(f64::NAN),
        fresh.quantile(0.99).unwrap_or(f64::NAN),
        fresh.quantile(1.0).unwrap_or(f64::NAN)
    );
    assert!(!fresh.is_empty(), "live batches were timed");

    // A second router joining late: its subscriber replays the engine's history and credits
    // the same prefix (stored again first: a small cache may have evicted it since).
    binding
        .prefill(GenerateRequest::new(prompt(98, 8), 1))
        .await
        .unwrap();
    let (late, _r2) = start(32).await;
    wait_events_ready(&late).await;
    let late_binding = late.router().route().binding().cloned().unwrap();
    let probe = prompt(99, 8);
    let ours = binding.dispatcher().kv_indexed_overlap(&probe, 1);
    let theirs = late_binding.dispatcher().kv_indexed_overlap(&probe, 1);
    println!("live events: late joiner credits {theirs:?}, first router {ours:?}");
    println!(
        "live events: late joiner {:?}",
        late.binding_stats().engine_kv.status(1)
    );
    assert_eq!(theirs, ours);
    assert!(ours.unwrap_or(0) >= 5);
    late.shutdown().await;

    // A card with another block size: reported, nothing credited.
    let (wrong, _r3) = start(16).await;
    let wrong_binding = wrong.router().route().binding().cloned().unwrap();
    let _ = wrong_binding
        .prefill(GenerateRequest::new(prompt(7, 300), 1))
        .await
        .unwrap();
    let mut status = None;
    for _ in 0..100 {
        status = wrong.binding_stats().engine_kv.status(1);
        if status.as_ref().is_some_and(|s| s.last_error.is_some()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = status.unwrap();
    println!("live events: card at 16 over an engine at 32: {status:?}");
    assert_eq!(
        status.last_error,
        Some(MirrorError::BlockSizeMismatch {
            card: 16,
            engine: 32
        })
    );
    assert!(status.counts.block_size_mismatches >= 1);
    let warnings = wrong.warnings();
    assert!(
        warnings.iter().any(|w| w.contains("the card says 16")),
        "{warnings:?}"
    );
    wrong.shutdown().await;
    hop.shutdown().await;
}

/// A hop whose prefill set is the vLLM engine at `addr` (instance 1), its card in KV mode at
/// `block_size` tokens per block, waiting until it is Active.
async fn events_hop(addr: SocketAddr, block_size: u32) -> (PrefillHop, [Registration; 2]) {
    use prefill_router::advert::{RouterConfig, SelectionMode};
    let card = ModelCard {
        kv_cache_block_size: block_size,
        router_config: Some(RouterConfig {
            router_mode: SelectionMode::KV,
            ..RouterConfig::default()
        }),
        ..card()
    };
    let discovery = MemoryDiscovery::new(MemoryConfig::with_ttl(Duration::from_secs(30)));
    let instance = Instance {
        endpoint: EndpointId::new("engines", "prefill", "generate"),
        instance_id: 1,
        address: addr,
    };
    // The topology needs a decode set to name a prefill one; only prefills are sent here.
    let registration = [
        discovery.register(instance, card).await.unwrap(),
        register(&discovery, "decode", 100, addr).await,
    ];
    (live_hop(discovery).await, registration)
}

/// Wait (at most 30 s) until the hop's feed of engine 1 is subscribed with a picture; how long
/// that took. The callers' assertions say what a feed that never got there means.
async fn wait_events_ready(hop: &PrefillHop) -> Duration {
    use prefill_router::engine::FeedState;
    use prefill_router::kv_events::Picture;
    let began = std::time::Instant::now();
    for _ in 0..3000 {
        let ready = hop
            .binding_stats()
            .engine_kv
            .status(1)
            .is_some_and(|s| s.state == FeedState::Subscribed && s.picture != Picture::Unknown);
        if ready {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    began.elapsed()
}

/// An engine with a small cache (`PREFILL_VLLM_EVICTING` = its address,
/// `PREFILL_VLLM_EVICTING_BLOCKS` = its `--num-gpu-blocks-override`) evicts, and the index
/// follows its removals: more distinct prompts than it holds, then the first of them (evicted)
/// and the last (still there) are each credited exactly what the engine then reports cached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_vllm_events_follow_an_engine_that_evicts() {
    use prefill_router::binding::Binding;
    use prefill_router::kv_events::Picture;
    let (Ok(addr), Some(capacity)) = (
        std::env::var("PREFILL_VLLM_EVICTING"),
        std::env::var("PREFILL_VLLM_EVICTING_BLOCKS")
            .ok()
            .and_then(|b| b.parse::<u32>().ok()),
    ) else {
        eprintln!("skipped: set PREFILL_VLLM_EVICTING and PREFILL_VLLM_EVICTING_BLOCKS to a vLLM engine with a small cache and KV events on");
        return;
    };
    let (hop, _r) = events_hop(addr.parse().unwrap(), 32).await;
    wait_events_ready(&hop).await;
    let binding = hop.router().route().binding().cloned().unwrap();
    let salt = std::process::id() % 500;
    let evicting = |n: u32| -> Vec<u32> {
        // Eight full blocks and a few tokens: a prompt that is whole blocks is never reported
        // fully cached (the engine recomputes its last token).
        (0..260u32)
            .map(|i| 3 + (salt * 7 + n * 389 + i * 23) % 990)
            .collect()
    };
    let count = capacity / 8 + 6;
    for n in 0..count {
        binding
            .prefill(GenerateRequest::new(evicting(n), 1))
            .await
            .unwrap();
    }
    // The last batches settle (bounded).
    let received = |hop: &PrefillHop| {
        hop.binding_stats()
            .engine_kv
            .status(1)
            .map_or(0, |s| s.received)
    };
    let mut last = received(&hop);
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = received(&hop);
        if now == last {
            break;
        }
        last = now;
    }
    for n in [0, count - 1] {
        let tokens = evicting(n);
        let predicted = binding
            .dispatcher()
            .kv_indexed_overlap(&tokens, 1)
            .unwrap_or(0);
        let info = binding
            .prefill(GenerateRequest::new(tokens, 1))
            .await
            .unwrap();
        let reported = info
            .handoff
            .as_ref()
            .map_or(0, |h| h.cached_blocks as usize);
        println!("live events: eviction, prompt {n} of {count}: index {predicted} blocks, engine reports {reported}");
        assert_eq!(predicted, reported, "prompt {n} after evictions");
    }
    let status = hop.binding_stats().engine_kv.status(1).unwrap();
    assert_eq!(status.picture, Picture::Exact, "{status:?}");
    assert_eq!(status.stale_restarts, 0, "{status:?}");
    hop.shutdown().await;
}

/// An engine restarted under the subscriber (`PREFILL_VLLM_RESTART_ENGINE` = its address with
/// KV events on, `PREFILL_VLLM_RESTART_CMD` = a shell command that restarts it on the same
/// ports and returns once it is healthy): the feed reconnects, notices the restart (numbers
/// going back, or a replay that cannot reach back) and rebuilds, so a prompt cached before the
/// restart is credited nothing, as the new process reports. Run by hand (an engine start costs
/// the CI stage about 100 s): docs/engines.md.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_vllm_events_follow_an_engine_restart() {
    use prefill_router::binding::Binding;
    use prefill_router::kv_events::Picture;
    let (Ok(addr), Ok(restart)) = (
        std::env::var("PREFILL_VLLM_RESTART_ENGINE"),
        std::env::var("PREFILL_VLLM_RESTART_CMD"),
    ) else {
        eprintln!("skipped: set PREFILL_VLLM_RESTART_ENGINE and PREFILL_VLLM_RESTART_CMD");
        return;
    };
    let (hop, _r) = events_hop(addr.parse().unwrap(), 32).await;
    wait_events_ready(&hop).await;
    let binding = hop.router().route().binding().cloned().unwrap();
    let salt = std::process::id() % 500;
    let prompt = |n: u32| -> Vec<u32> {
        (0..200u32)
            .map(|i| 5 + (salt * 11 + n * 131 + i * 29) % 990)
            .collect()
    };
    binding
        .prefill(GenerateRequest::new(prompt(1), 1))
        .await
        .unwrap();
    let mut credited = None;
    for _ in 0..100 {
        credited = binding.dispatcher().kv_indexed_overlap(&prompt(1), 1);
        if credited == Some(6) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(credited, Some(6), "prompt 1 indexed before the restart");

    let began = std::time::Instant::now();
    let status = tokio::task::spawn_blocking(move || {
        std::process::Command::new("sh")
            .args(["-c", &restart])
            .status()
    })
    .await
    .unwrap()
    .unwrap();
    assert!(status.success(), "the restart command failed: {status}");
    println!("live events: engine restarted in {:?}", began.elapsed());
    // The new process stores something: its first batch numbers from 0 again.
    let mut sent = false;
    for _ in 0..60 {
        if binding
            .prefill(GenerateRequest::new(prompt(2), 1))
            .await
            .is_ok()
        {
            sent = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(sent, "the restarted engine answers");
    let mut noticed = None;
    for _ in 0..900 {
        let s = hop.binding_stats().engine_kv.status(1).unwrap();
        if (s.counts.restarts >= 1 || s.counts.rebuilds >= 1) && s.picture != Picture::Unknown {
            noticed = Some(s);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = noticed.expect("the restart noticed within 90 s");
    println!(
        "live events: restart noticed {:?} after the engine was back: {status:?}",
        began.elapsed()
    );
    let predicted = binding
        .dispatcher()
        .kv_indexed_overlap(&prompt(1), 1)
        .unwrap_or(0);
    let info = binding
        .prefill(GenerateRequest::new(prompt(1), 1))
        .await
        .unwrap();
    let reported = info
        .handoff
        .as_ref()
        .map_or(0, |h| h.cached_blocks as usize);
    println!("live events: after the restart, prompt 1: index {predicted}, engine {reported}");
    assert_eq!((predicted, reported), (0, 0));
    hop.shutdown().await;
}
