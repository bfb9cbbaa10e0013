//! The simulator's only source of randomness: the crate's seeded splitmix64 generator
//! ([`prefill_router::rng`]), with the draws the simulator needs (a failing seed must stay
//! reproducible).

/// A seeded pseudo-random generator (splitmix64). Not for cryptography.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimRng(prefill_router::rng::SplitMix64);

impl SimRng {
    /// A generator whose whole output is determined by `seed`.
    pub fn new(seed: u64) -> Self {
        SimRng(prefill_router::rng::SplitMix64::new(seed))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in `0..n`; 0 when `n` is 0.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        // Multiply-shift: unbiased enough for fault schedules, and branch-free.
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in `lo..=hi` (`lo` when `hi < lo`).
    pub fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo).saturating_add(1))
    }

    /// True with probability `percent`/100.
    pub fn percent(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// An independent generator for a sub-component, so that adding draws in one place does
    /// not shift every later draw elsewhere.
    pub fn fork(&mut self) -> SimRng {
        SimRng::new(self.next_u64())
    }
}

#[cfg(test)]
mod tests {
    use super::SimRng;

    #[test]
    fn same_seed_same_sequence() {
        let mut a = SimRng::new(42);
        let mut b = SimRng::new(42);
        let xs: Vec<u64> = (0..16).map(|_| a.next_u64()).collect();
        let ys: Vec<u64> = (0..16).map(|_| b.next_u64()).collect();
        assert_eq!(xs, ys);
        assert_ne!(SimRng::new(43).next_u64(), xs[0]);
    }

    #[test]
    fn below_stays_in_range_and_covers_it() {
        let mut rng = SimRng::new(7);
        let mut seen = [false; 5];
        for _ in 0..1000 {
            let x = rng.below(5);
            assert!(x < 5);
            seen[x as usize] = true;
        }
        assert!(seen.iter().all(|s| *s));
        assert_eq!(rng.below(0), 0);
        assert_eq!(rng.between(3, 3), 3);
    }
}
