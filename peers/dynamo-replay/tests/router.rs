//! Dynamo's crate behind the replay's external-policy seam: its picks follow its indexer and
//! its bookings, its bookings are freed, and a whole replay runs through it.

use dynamo_replay::{DynamoCrate, DynamoRouter, POLICY_NAME};
use prefill_router_tools::replay::{
    run, ExternalBlock, ExternalKvEvent, ExternalRequest, ExternalRouter, ExternalSetup, Policy,
    ReplayConfig, Workload,
};

const BLOCK: u32 = 16;

fn router(workers: u64) -> DynamoRouter {
    let setup = ExternalSetup {
        block_tokens: BLOCK,
        workers: (1..=workers).collect(),
        frontend: 0,
    };
    DynamoRouter::new(DynamoCrate::default().config, 7, &setup).expect("router")
}

/// A prompt of `blocks` whole blocks whose tokens all start from `seed`.
fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK).map(|t| seed * 10_000 + t).collect()
}

/// What a worker's cache publishes when it stores `tokens`: one chain, the replay's hashes.
fn stored(tokens: &[u32]) -> ExternalKvEvent {
    let keys = prefill_router::push::block_hashes(tokens, BLOCK);
    ExternalKvEvent::Stored {
        parent: None,
        blocks: keys
            .iter()
            .zip(tokens.chunks_exact(BLOCK as usize))
            .map(|(&hash, block)| ExternalBlock {
                hash,
                tokens: block.to_vec(),
            })
            .collect(),
    }
}

fn request(id: u64, tokens: Vec<u32>) -> ExternalRequest {
    let prompt_tokens = u32::try_from(tokens.len()).expect("small");
    ExternalRequest {
        id,
        tokens,
        prompt_tokens,
        output_tokens: 1,
    }
}

#[tokio::test(start_paused = true)]
async fn on_an_idle_pool_a_prefix_goes_to_the_worker_whose_events_hold_it() {
    let router = router(6);
    // Four prefixes, each cached (per its events) on a different worker.
    let holders = [(1, 2), (2, 5), (3, 6), (4, 1)];
    for (seed, worker) in holders {
        router.apply_events(worker, &[stored(&prompt(seed, 8))]);
    }
    for (n, (seed, worker)) in holders.into_iter().enumerate() {
        // The cached prefix plus one block of its own.
        let mut tokens = prompt(seed, 8);
        tokens.extend(prompt(100 + seed, 1));
        let picked = router
            .select(request(n as u64, tokens), (1..=6).collect())
            .await
            .expect("pick");
        assert_eq!(picked, worker, "prefix {seed}");
        router.release(n as u64).await.expect("release");
    }
    // Evicted: the events that removed it leave no holder to prefer.
    let keys = prefill_router::push::block_hashes(&prompt(1, 8), BLOCK);
    router.apply_events(2, &[ExternalKvEvent::Removed { blocks: keys }]);
    let picked = router
        .select(request(10, prompt(1, 8)), vec![2, 3])
        .await
        .expect("pick");
    router.release(10).await.expect("release");
    // Worker 3 is as cold as 2 now; with 2's blocks still credited it would always be 2.
    let mut picks = vec![picked];
    for id in 11..20 {
        picks.push(
            router
                .select(request(id, prompt(1, 8)), vec![2, 3])
                .await
                .expect("pick"),
        );
        router.release(id).await.expect("release");
    }
    assert!(picks.contains(&3), "after the eviction: {picks:?}");
    assert!(router.refused_events().is_empty());
}

#[tokio::test(start_paused = true)]
async fn booked_requests_count_as_load_and_every_release_frees_them() {
    let router = router(6);
    // Six cold prompts, none released: each booking weighs on its worker, so they spread.
    let mut picks = Vec::new();
    for id in 0..6 {
        picks.push(
            router
                .select(request(id, prompt(id as u32, 4)), (1..=6).collect())
                .await
                .expect("pick"),
        );
    }
    picks.sort_unstable();
    assert_eq!(picks, vec![1, 2, 3, 4, 5, 6]);
    assert_eq!(router.active_requests(), 6);
    assert!(router.active_blocks() > 0);
    for id in 0..6 {
        router.release(id).await.expect("release");
    }
    assert_eq!(router.active_requests(), 0);
    assert_eq!(router.active_blocks(), 0);
}

#[test]
fn a_replay_through_the_crate_loses_nothing_and_finds_the_shared_prefix() {
    let trace = Workload::parse("multi-tenant:rate=8,requests=300")
        .expect("spec")
        .generate();
    let crate_run = run(
        &ReplayConfig {
            external: Some(DynamoCrate::default().into_external()),
            ..ReplayConfig::new(Policy::External)
        },
        &trace,
    )
    .expect("replay");
    let round_robin = run(&ReplayConfig::new(Policy::RoundRobin), &trace).expect("replay");
    assert_eq!(crate_run.policy, POLICY_NAME);
    assert_eq!((crate_run.lost, crate_run.shed), (0, 0));
    assert!(
        crate_run.prefix_hit_rate > round_robin.prefix_hit_rate,
        "{} vs round robin {}",
        crate_run.prefix_hit_rate,
        round_robin.prefix_hit_rate
    );
    assert!(crate_run.prefix_hit_rate <= crate_run.ceiling);
}
