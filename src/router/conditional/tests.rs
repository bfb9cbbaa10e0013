//! The policy's decision is exactly its documented function, and off means off.

use proptest::prelude::*;

use super::*;

/// The router's decision: no policy configured is off.
fn decide(policy: Option<&ConditionalPolicy>, probe: &PrefillEstimate) -> Option<ConditionalSkip> {
    policy.and_then(|p| p.decide(probe))
}

type DecideFn = fn(Option<&ConditionalPolicy>, &PrefillEstimate) -> Option<ConditionalSkip>;

/// The documented function, written out independently of `decide`.
fn spec(policy: Option<&ConditionalPolicy>, probe: &PrefillEstimate) -> Option<ConditionalSkip> {
    let policy = policy?;
    let uncached = probe.prompt_tokens.saturating_sub(probe.cached_tokens);
    match (
        policy.min_uncached_tokens,
        policy.max_pool_tokens_per_worker,
    ) {
        (Some(min), _) if uncached < min => Some(ConditionalSkip::Short),
        (_, Some(max)) if probe.pool_tokens_per_worker > max => Some(ConditionalSkip::Busy),
        _ => None,
    }
}

/// The check: `decide` agrees with the spec on `case`, and never skips with the policy off.
fn check(
    decide: DecideFn,
    policy: Option<ConditionalPolicy>,
    probe: PrefillEstimate,
) -> Result<(), String> {
    let got = decide(policy.as_ref(), &probe);
    if got != spec(policy.as_ref(), &probe) {
        return Err(format!("{policy:?} {probe:?}: decided {got:?}"));
    }
    if policy.is_none() && got.is_some() {
        return Err(format!("policy off but {probe:?} skipped"));
    }
    Ok(())
}

/// Small ranges (so values land on the thresholds exactly, where off-by-ones live) and large
/// ones.
fn policies() -> impl Strategy<Value = Option<ConditionalPolicy>> {
    let thresholds = prop_oneof![
        (
            proptest::option::of(0u32..48),
            proptest::option::of(0u64..48)
        ),
        (
            proptest::option::of(0u32..4096),
            proptest::option::of(0u64..20_000)
        ),
    ];
    proptest::option::weighted(
        0.8,
        thresholds.prop_map(|(min, max)| ConditionalPolicy {
            min_uncached_tokens: min,
            max_pool_tokens_per_worker: max,
        }),
    )
}

fn probes() -> impl Strategy<Value = PrefillEstimate> {
    prop_oneof![
        (0u32..64, 0u32..16, 0u64..48),
        (0u32..8192, 0u32..8192, 0u64..40_000),
    ]
    .prop_map(|(prompt, cached, load)| PrefillEstimate {
        prompt_tokens: prompt,
        cached_tokens: cached,
        pool_tokens_per_worker: load,
    })
}

/// Whether the check finds a disagreement for `decide` over a fixed seed's cases.
fn check_bites(decide: DecideFn) -> bool {
    let config = ProptestConfig {
        cases: 2048,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let mut runner = proptest::test_runner::TestRunner::new_with_rng(
        config,
        proptest::test_runner::TestRng::deterministic_rng(
            proptest::test_runner::RngAlgorithm::ChaCha,
        ),
    );
    runner
        .run(&(policies(), probes()), |(policy, probe)| {
            check(decide, policy, probe).map_err(TestCaseError::fail)
        })
        .is_err()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn decision_is_exactly_the_documented_function_and_off_never_skips(
        policy in policies(),
        probe in probes(),
    ) {
        check(decide, policy, probe).map_err(TestCaseError::fail)?;
    }
}

#[test]
fn the_check_catches_a_policy_that_ignores_the_cache() {
    // Mutant: the uncached part is the whole prompt (upstream's probe without overlap).
    fn mutant(p: Option<&ConditionalPolicy>, probe: &PrefillEstimate) -> Option<ConditionalSkip> {
        let whole = PrefillEstimate {
            cached_tokens: 0,
            ..*probe
        };
        decide(p, &whole)
    }
    assert!(check_bites(mutant));
}

#[test]
fn the_check_catches_an_inclusive_threshold() {
    // Mutant: `<=` instead of `<` on the short threshold.
    fn mutant(p: Option<&ConditionalPolicy>, probe: &PrefillEstimate) -> Option<ConditionalSkip> {
        let p = p.map(|p| ConditionalPolicy {
            min_uncached_tokens: p.min_uncached_tokens.map(|m| m.saturating_add(1)),
            ..*p
        });
        decide(p.as_ref(), probe)
    }
    assert!(check_bites(mutant));
}

#[test]
fn the_check_catches_a_busy_test_that_ignores_its_threshold() {
    // Mutant: busy whenever the pool has any load.
    fn mutant(p: Option<&ConditionalPolicy>, probe: &PrefillEstimate) -> Option<ConditionalSkip> {
        let p = p.map(|p| ConditionalPolicy {
            max_pool_tokens_per_worker: p.max_pool_tokens_per_worker.map(|_| 0),
            ..*p
        });
        decide(p.as_ref(), probe)
    }
    assert!(check_bites(mutant));
}

#[test]
fn the_check_catches_a_policy_that_skips_while_off() {
    // Mutant: an unset policy behaves as a default one with a short threshold.
    fn mutant(p: Option<&ConditionalPolicy>, probe: &PrefillEstimate) -> Option<ConditionalSkip> {
        let fallback = ConditionalPolicy {
            min_uncached_tokens: Some(512),
            max_pool_tokens_per_worker: None,
        };
        decide(Some(p.unwrap_or(&fallback)), probe)
    }
    assert!(check_bites(mutant));
}

#[test]
fn labels_are_the_documented_reasons() {
    let labels: Vec<&str> = ConditionalSkip::ALL.iter().map(|s| s.as_str()).collect();
    assert_eq!(labels, ["conditional_short", "conditional_busy"]);
    assert_eq!(ConditionalSkip::Busy.to_string(), "conditional_busy");
}
