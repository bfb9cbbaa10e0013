//! SplitMix64, the crate's one small generator (Steele, Lea and Flood, 2014): the seeded
//! sequence and its finaliser, which also serves as a cheap, well-mixed 64-bit hash step.
//!
//! Local rather than a crate so that a seed names the same run on every platform and every
//! future version of the dependency tree: simulator seeds, jitter seeds and block hashes stay
//! reproducible. Not for cryptography.

/// The generator's increment (the golden ratio in 64 bits); also a fixed, non-zero seed for
/// hash chains.
pub const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// The finaliser: a bijection on `u64` that spreads every input bit over the output.
#[inline]
pub const fn finalize(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A seeded SplitMix64 sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator whose whole output is determined by `seed`.
    pub const fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// The next 64 bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
        finalize(self.0)
    }

    /// Uniform in `[0, 1)`: the top 53 bits of the next output.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sequence_from_zero_is_the_reference_splitmix64() {
        // The published sequence from state 0.
        let mut rng = SplitMix64::new(0);
        assert_eq!(rng.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(rng.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(rng.next_u64(), 0x06c4_5d18_8009_454f);
    }

    #[test]
    fn unit_keeps_the_top_53_bits() {
        let mut rng = SplitMix64::new(0);
        let expected = [
            0.8833108082136426,
            0.43152799704850997,
            0.026433771592597743,
        ];
        for want in expected {
            assert_eq!(rng.unit(), want);
        }
    }
}
