//! A deterministic, realistic input mix for benchmarks and allocation tests.

use prefill_router::lifecycle::{BuildId, Input, Machine, RetryPolicy};

/// Generate `len` inputs that a real driver could feed: retargets among `targets` targets (and
/// `None`), successes and failures of the build in flight, retry firings, plus a share of stale,
/// repeated and unknown completions. Deterministic (a fixed xorshift seed), allocation only for
/// the returned vector.
pub fn realistic_mix(len: usize, targets: u32) -> Vec<Input<u32>> {
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut m = Machine::new(RetryPolicy::default());
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        let roll = next() % 100;
        let input = if let Some((b, _)) = m.in_flight() {
            match roll {
                0..=59 => Input::BuildSucceeded(b),
                60..=79 => Input::BuildFailed(b),
                80..=89 => Input::SetTarget(Some((next() % targets as u64) as u32)),
                _ => Input::BuildSucceeded(BuildId(b.0.saturating_sub(1))), // stale
            }
        } else if let Some(after) = m.retry_armed() {
            match roll {
                0..=69 => Input::RetryElapsed(after),
                _ => Input::SetTarget(Some((next() % targets as u64) as u32)),
            }
        } else {
            match roll {
                0..=79 => Input::SetTarget(Some((next() % targets as u64) as u32)),
                80..=89 => Input::SetTarget(None),
                _ => Input::BuildSucceeded(BuildId(next() % 64)), // unknown / repeated
            }
        };
        let _ = m.handle(input.clone());
        out.push(input);
    }
    out
}
