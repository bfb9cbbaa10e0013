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
        let mut rng = SplitMix::new(7);
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
    fn zero_jitter_keeps_the_machines_delay_exactly() {
        let mut rng = SplitMix::new(1);
        let d = Duration::from_millis(1234);
        assert_eq!(jittered(d, 0.0, &mut rng), d);
        assert_eq!(jittered(Duration::MAX, 1.0, &mut rng), Duration::MAX);
        assert_eq!(jittered(Duration::ZERO, 1.0, &mut rng), Duration::ZERO);
    }
}
