//! Tests of the adapter (fake factories and bindings; paused time where timing matters).

mod conditional;
mod driver;
mod drop_safety;
mod fakes;
mod fallback;
mod lifecycle;
mod metrics;
mod race;
mod retired;
mod timing;

mod jitter {
    use std::time::Duration;

    use crate::router::driver::{jittered, SplitMix};

    #[test]
    fn jitter_stays_within_delay_and_delay_times_one_plus_fraction() {
        let mut rng = SplitMix::seeded(7);
        let d = Duration::from_millis(1000);
        let (mut lo, mut hi) = (Duration::MAX, Duration::ZERO);
        for _ in 0..10_000 {
            let j = jittered(d, 0.25, &mut rng);
            assert!(j >= d && j <= d.mul_f64(1.25), "{j:?}");
            lo = lo.min(j);
            hi = hi.max(j);
        }
        // The extra is actually spread over the range, not a constant.
        assert!(
            lo < d.mul_f64(1.01) && hi > d.mul_f64(1.24),
            "{lo:?} {hi:?}"
        );
    }

    #[test]
    fn splitmix_matches_the_reference_splitmix64_sequence() {
        // SplitMix64 (Steele, Lea, Flood 2014) from state 0: 0xe220a8397b1dcdaf,
        // 0x6e789e6aa1b965f4, 0x06c45d188009454f; `unit` keeps the top 53 bits of each.
        let mut rng = SplitMix::seeded(0);
        let expected = [
            0.8833108082136426,
            0.43152799704850997,
            0.026433771592597743,
        ];
        for want in expected {
            assert_eq!(rng.unit(), want);
        }
    }

    #[test]
    fn zero_jitter_keeps_the_machines_delay_exactly() {
        let mut rng = SplitMix::seeded(1);
        let d = Duration::from_millis(1234);
        assert_eq!(jittered(d, 0.0, &mut rng), d);
        assert_eq!(jittered(Duration::MAX, 1.0, &mut rng), Duration::MAX);
        assert_eq!(jittered(Duration::ZERO, 1.0, &mut rng), Duration::ZERO);
    }
}
