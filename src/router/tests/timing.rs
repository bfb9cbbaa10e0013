//! Backoff, jitter and the build timeout, in paused tokio time (no real sleeps).

use std::time::Duration;

use tokio::time::Instant;

use super::fakes::{target, ScriptFactory, Step};
use crate::lifecycle::{Lifecycle, RetryPolicy};
use crate::router::driver::deadline_after;
use crate::router::{PrefillRouter, PrefillRouterConfig, WaitError};

fn config(retry: RetryPolicy, jitter: f64) -> PrefillRouterConfig {
    PrefillRouterConfig {
        retry,
        retry_jitter: jitter,
        build_timeout: Duration::from_secs(5),
        name: "m".into(),
        ..PrefillRouterConfig::default()
    }
}

fn gaps(times: &[tokio::time::Instant]) -> Vec<Duration> {
    times.windows(2).map(|w| w[1] - w[0]).collect()
}

#[tokio::test(start_paused = true)]
async fn builds_that_fail_n_times_then_succeed_activate_after_doubling_backoff() {
    let policy = RetryPolicy {
        initial: Duration::from_secs(1),
        max: Duration::from_secs(4),
    };
    for n in [0usize, 1, 4] {
        let (factory, log) = ScriptFactory::new(vec![Step::Fail("boom"); n]);
        let router = PrefillRouter::new(factory, config(policy, 0.0));
        router.set_target(Some(target(1)));
        router.wait_active(Duration::from_secs(60)).await.unwrap();
        let status = router.status();
        assert_eq!(log.calls(), n + 1);
        assert_eq!(status.counters.build_failures, n as u64);
        assert_eq!(status.counters.activations, 1);
        assert_eq!(status.consecutive_failures, 0);
        assert_eq!(
            status.last_error, None,
            "an activation clears the last error"
        );
        let expected: Vec<Duration> = [1, 2, 4, 4][..n]
            .iter()
            .map(|s| Duration::from_secs(*s))
            .collect();
        assert_eq!(gaps(&log.call_times()), expected, "n = {n}");
    }
}

#[tokio::test(start_paused = true)]
async fn failing_builds_report_the_error_and_keep_the_hop_pending() {
    let (factory, log) = ScriptFactory::new(vec![Step::Fail("no card"); 3]);
    let router = PrefillRouter::new(
        factory,
        config(RetryPolicy::fixed(Duration::from_secs(10)), 0.0),
    );
    router.set_target(Some(target(1)));
    tokio::time::sleep(Duration::from_secs(15)).await;
    let status = router.status();
    assert_eq!(log.calls(), 2);
    assert_eq!(status.lifecycle, Lifecycle::Pending);
    assert_eq!(status.consecutive_failures, 2);
    assert!(status.retry_armed);
    assert!(status.last_error.unwrap().contains("no card"));
}

#[tokio::test(start_paused = true)]
async fn retry_jitter_stays_within_delay_and_delay_times_one_plus_jitter() {
    let (factory, log) = ScriptFactory::new(vec![Step::Fail("boom"); 40]);
    let router = PrefillRouter::new(
        factory,
        config(RetryPolicy::fixed(Duration::from_secs(1)), 0.5),
    );
    router.set_target(Some(target(1)));
    router.wait_active(Duration::from_secs(600)).await.unwrap();
    let gaps = gaps(&log.call_times());
    assert_eq!(gaps.len(), 40);
    for gap in &gaps {
        assert!(
            *gap >= Duration::from_secs(1) && *gap <= Duration::from_millis(1500),
            "{gap:?}"
        );
    }
    let distinct: std::collections::BTreeSet<_> = gaps.iter().collect();
    assert!(distinct.len() > 30, "jitter must actually vary: {gaps:?}");
}

/// Retry gaps of a router whose jitter is seeded with `seed`, over 10 failed builds.
async fn seeded_gaps(seed: u64) -> Vec<Duration> {
    let (factory, log) = ScriptFactory::new(vec![Step::Fail("boom"); 10]);
    let router = PrefillRouter::new(
        factory,
        PrefillRouterConfig {
            jitter_seed: Some(seed),
            ..config(RetryPolicy::fixed(Duration::from_secs(1)), 0.5)
        },
    );
    router.set_target(Some(target(1)));
    router.wait_active(Duration::from_secs(600)).await.unwrap();
    gaps(&log.call_times())
}

#[tokio::test(start_paused = true)]
async fn seeded_jitter_replays_the_same_retry_times() {
    let first = seeded_gaps(7).await;
    assert_eq!(first.len(), 10);
    assert_eq!(first, seeded_gaps(7).await, "same seed, same retry times");
    assert_ne!(
        first,
        seeded_gaps(8).await,
        "another seed, other retry times"
    );
}

#[tokio::test(start_paused = true)]
async fn hanging_build_fails_at_the_build_timeout_and_is_retried() {
    let (factory, log) = ScriptFactory::new([Step::Hang]);
    let router = PrefillRouter::new(
        factory,
        config(RetryPolicy::fixed(Duration::from_secs(1)), 0.0),
    );
    router.set_target(Some(target(1)));
    tokio::time::sleep(Duration::from_millis(4_900)).await;
    let status = router.status();
    assert_eq!(status.consecutive_failures, 0, "not yet timed out");
    assert!(status.build_in_flight.is_some());
    assert_eq!(log.builds_live.get(), 1);

    tokio::time::sleep(Duration::from_millis(200)).await;
    let status = router.status();
    assert_eq!(status.consecutive_failures, 1);
    assert_eq!(status.counters.build_timeouts, 1);
    assert!(status.last_error.unwrap().contains("timed out after 5s"));
    assert_eq!(
        log.builds_live.get(),
        0,
        "the hung build future was dropped"
    );
    assert!(
        log.tokens.lock()[0].is_cancelled(),
        "its token was cancelled"
    );

    router.wait_active(Duration::from_secs(10)).await.unwrap();
    let times = log.call_times();
    assert_eq!(
        gaps(&times),
        vec![Duration::from_secs(6)],
        "timeout 5 s + retry 1 s"
    );
    assert!(
        !log.tokens.lock()[1].is_cancelled(),
        "a built binding keeps its token"
    );
}

#[tokio::test(start_paused = true)]
async fn retarget_during_backoff_builds_at_once_without_waiting_for_the_timer() {
    let (factory, log) = ScriptFactory::new([Step::Fail("boom")]);
    let router = PrefillRouter::new(
        factory,
        config(RetryPolicy::fixed(Duration::from_secs(30)), 0.0),
    );
    router.set_target(Some(target(1)));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(router.status().retry_armed);
    router.set_target(Some(target(2)));
    router.wait_active(Duration::from_millis(1)).await.unwrap();
    assert_eq!(log.calls(), 2);
    // The cancelled timer never fires a third build.
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(log.calls(), 2);
}

#[tokio::test(start_paused = true)]
async fn panicking_factory_counts_as_a_failed_build_and_is_retried() {
    let (factory, log) = ScriptFactory::new([Step::PanicInBuild, Step::PanicInFuture]);
    let router = PrefillRouter::new(
        factory,
        config(RetryPolicy::fixed(Duration::from_secs(1)), 0.0),
    );
    router.set_target(Some(target(1)));
    router.wait_active(Duration::from_secs(10)).await.unwrap();
    let status = router.status();
    assert_eq!(log.calls(), 3);
    assert_eq!(status.counters.build_failures, 2);
    assert_eq!(status.counters.activations, 1);
}

#[tokio::test(start_paused = true)]
async fn unbounded_delays_and_waits_do_not_overflow_the_clock() {
    let (factory, log) = ScriptFactory::new([Step::Fail("boom")]);
    let router = PrefillRouter::new(factory, config(RetryPolicy::fixed(Duration::MAX), 1.0));
    router.set_target(Some(target(1)));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(router.status().retry_armed);
    let waiter = router.wait_active(Duration::MAX);
    let retarget = async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        router.set_target(Some(target(2)));
    };
    let (waited, ()) = tokio::join!(waiter, retarget);
    assert_eq!(waited, Ok(()));
    assert_eq!(log.calls(), 2);
}

/// The cap `deadline_after` saturates at.
const YEAR: Duration = Duration::from_secs(365 * 24 * 3600);
const DAY: Duration = Duration::from_secs(24 * 3600);

#[tokio::test(start_paused = true)]
async fn deadlines_are_exact_up_to_a_year_and_capped_at_a_year_beyond() {
    // The clock is paused and nothing awaits: `now` is the instant `deadline_after` reads.
    let now = Instant::now();
    for delay in [30 * DAY, YEAR - Duration::from_secs(1), YEAR] {
        assert_eq!(
            deadline_after(delay) - now,
            delay,
            "{delay:?} is under the cap"
        );
    }
    for delay in [YEAR + Duration::from_secs(1), 2 * YEAR, Duration::MAX] {
        assert_eq!(deadline_after(delay) - now, YEAR, "{delay:?} is capped");
    }
}

#[tokio::test(start_paused = true)]
async fn a_thirty_day_retry_fires_exactly_thirty_days_after_the_failure() {
    let (factory, log) = ScriptFactory::new([Step::Fail("boom")]);
    let router = PrefillRouter::new(factory, config(RetryPolicy::fixed(30 * DAY), 0.0));
    router.set_target(Some(target(1)));
    router.wait_active(31 * DAY).await.unwrap();
    assert_eq!(gaps(&log.call_times()), vec![30 * DAY]);
}

#[tokio::test(start_paused = true)]
async fn a_wait_after_shutdown_returns_at_once_with_shut_down() {
    let (factory, _log) = ScriptFactory::new([Step::Hang]);
    let router = PrefillRouter::new(factory, config(RetryPolicy::default(), 0.0));
    router.set_target(Some(target(1)));
    router.shutdown();
    let start = Instant::now();
    assert_eq!(
        router.wait_active(Duration::from_secs(3600)).await,
        Err(WaitError::ShutDown)
    );
    assert_eq!(start.elapsed(), Duration::ZERO, "no virtual time passed");
}

#[tokio::test(start_paused = true)]
async fn a_wait_ends_when_the_router_shuts_down_not_at_its_timeout() {
    let (factory, _log) = ScriptFactory::new([Step::Hang]);
    let router = PrefillRouter::new(factory, config(RetryPolicy::default(), 0.0));
    router.set_target(Some(target(1)));
    let start = Instant::now();
    let waiter = router.wait_active(Duration::from_secs(3600));
    let stop = async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        router.shutdown();
    };
    let (waited, ()) = tokio::join!(waiter, stop);
    assert_eq!(waited, Err(WaitError::ShutDown));
    assert_eq!(
        start.elapsed(),
        Duration::from_secs(1),
        "ended at the shutdown"
    );
}
