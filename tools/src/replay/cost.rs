//! The timing model of the replay's workers (constants explained in `docs/replay.md`).

use std::time::Duration;

/// How long the replay's workers take. Simple on purpose: prefill is compute-bound, so its
/// time is proportional to the prompt tokens *not* found in the worker's KV cache, and
/// concurrent prefills on one worker share its compute; decode is a steady per-token rate.
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    /// Fixed cost of one prefill (scheduling, kernel launches, the first token's sampling).
    pub prefill_overhead: Duration,
    /// Compute time per uncached prompt token with the worker otherwise idle.
    pub prefill_per_token: Duration,
    /// Slowdown per prefill already running on the worker when one starts: its duration is
    /// multiplied by `1 + batch_slowdown * running`. 1.0 models a compute-bound GPU shared
    /// fairly (k prefills at once each run k times slower).
    pub batch_slowdown: f64,
    /// Prefills a worker runs at once; the rest wait in its queue (FIFO).
    pub max_batch: usize,
    /// Decode time per output token after the first (the first comes from prefill).
    pub decode_per_token: Duration,
}

impl Default for CostModel {
    /// A 32B dense model on one H100-class GPU (see `docs/replay.md`): 100 µs per prompt
    /// token (~10k tokens/s), 5 ms per prefill, up to 4 prefills at once, 25 ms per token.
    fn default() -> Self {
        CostModel {
            prefill_overhead: Duration::from_millis(5),
            prefill_per_token: Duration::from_micros(100),
            batch_slowdown: 1.0,
            max_batch: 4,
            decode_per_token: Duration::from_millis(25),
        }
    }
}

impl CostModel {
    /// Prefill time of `uncached_tokens` on a worker already running `running` prefills.
    pub fn prefill_time(&self, uncached_tokens: u32, running: usize) -> Duration {
        #[allow(clippy::cast_precision_loss)] // a handful of prefills
        let factor = 1.0 + self.batch_slowdown.max(0.0) * running as f64;
        self.prefill_overhead
            + self
                .prefill_per_token
                .saturating_mul(uncached_tokens)
                .mul_f64(factor)
    }

    /// Decode time of a request generating `output_tokens` (the first token is prefill's).
    pub fn decode_time(&self, output_tokens: u32) -> Duration {
        self.decode_per_token
            .saturating_mul(output_tokens.saturating_sub(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_grows_with_uncached_tokens_and_the_running_batch() {
        let cost = CostModel::default();
        assert_eq!(cost.prefill_time(0, 0), Duration::from_millis(5));
        assert_eq!(cost.prefill_time(1000, 0), Duration::from_millis(105));
        assert_eq!(cost.prefill_time(1000, 1), Duration::from_millis(205));
        assert_eq!(cost.decode_time(11), Duration::from_millis(250));
    }
}
