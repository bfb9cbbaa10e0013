//! What happens to one message a simulated worker sends (a KV event batch, a load report)
//! while faults are on: delivered now, lost, or late (arriving after newer ones).

use std::time::Duration;

use super::rng::SimRng;

/// The fate of one message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fate {
    Now,
    Lost,
    Late(Duration),
}

impl Fate {
    /// Lost with `loss_percent`, else late by 1 to `delay_max_ms` ms with `delay_percent`,
    /// else now: the draws in that order, so a seed replays the same fates.
    pub(crate) fn draw(
        rng: &mut SimRng,
        loss_percent: u64,
        delay_percent: u64,
        delay_max_ms: u64,
    ) -> Fate {
        if rng.percent(loss_percent) {
            Fate::Lost
        } else if rng.percent(delay_percent) {
            Fate::Late(Duration::from_millis(rng.between(1, delay_max_ms)))
        } else {
            Fate::Now
        }
    }
}
