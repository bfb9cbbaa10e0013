//! The booking model's properties, one named function each. Ids and statements are listed in
//! docs/properties.md ("Booking rule"); the names below are the ones the checker reports.

use prefill_router::load_report::Load;
use stateright::Property;

use super::world::{fault, ledger, Stage, State};
use super::{Booking, BookingModel};

/// BL1: when no request is in flight anywhere, every worker's ledger holds no work and no
/// frontend books any.
pub const NO_LEAK: &str = "BL1 no booking leaks when every request has ended";
/// BL2: when no request is in flight and a frontend has received the worker's latest report
/// (delivered, nothing newer made or in flight, the worker's view unchanged since), the
/// frontend's combined load on that worker is zero.
pub const FRESH_REPORT_CLEARS: &str = "BL2 a fresh report brings the combined load back to zero";
/// DC1: every report a worker sends says exactly the work the other frontends' requests hold
/// at the worker when it is made, so a frontend's `others` (always some report's) never holds
/// its own work: nothing is counted twice.
pub const NO_DOUBLE_COUNT: &str = "DC1 a report holds exactly the other frontends' work";
/// S1: a frontend's booked work on a worker (sent or held, not released) is at most the
/// threshold, so a worker's booked work is at most frontends × threshold.
pub const BOOKED_WITHIN_SLACK: &str = "S1 booked work per worker is at most frontends x threshold";
/// S2: an admission made on an exact view (`others` equal to the other frontends' work held
/// now, none of theirs on the way, none of the frontend's own cancelled work still at the
/// worker) never takes the worker's true load past the threshold.
pub const EXACT_VIEW_NO_OVERSHOOT: &str =
    "S2 an admission on an exact view never overshoots the threshold";
/// BV1: a frontend has applied a report that holds others' work.
pub const SOMETIMES_APPLIED: &str = "BV1 sometimes a report of others' work is applied";
/// BV2: a report in flight is stale (no newer than the one its frontend applied): delivered,
/// it is ignored.
pub const SOMETIMES_STALE: &str = "BV2 sometimes a late report is ignored as stale";
/// BV3: two frontends book requests on one worker at once.
pub const SOMETIMES_SHARED: &str = "BV3 sometimes two frontends book on one worker at once";
/// BV4: a frontend refuses a 1-token request only because of others' reported work.
pub const SOMETIMES_REFUSED: &str = "BV4 sometimes the reported load refuses an admission";
/// BV5: a worker's true load exceeds the threshold (stale views overshoot: the slack is real).
pub const SOMETIMES_OVER_THRESHOLD: &str =
    "BV5 sometimes a worker's true load exceeds the threshold";
/// BV6: a worker's true load exceeds frontends × threshold, through work cancelled at its
/// frontend but still held or on its way (the slack S1 does not cover).
pub const SOMETIMES_CANCEL_SLACK: &str =
    "BV6 sometimes cancelled work takes a worker past frontends x threshold";
/// BV7: BL2's premise holds at a frontend that has applied a report (BL2 is not vacuous).
pub const SOMETIMES_FRESH_AND_QUIET: &str = "BV7 sometimes a frontend is fresh and all is quiet";

/// Every property, in report order.
pub fn all<B: Booking>() -> Vec<Property<BookingModel<B>>> {
    vec![
        Property::always(NO_LEAK, |_: &BookingModel<B>, s: &State| no_leak(s)),
        Property::always(FRESH_REPORT_CLEARS, |_: &BookingModel<B>, s: &State| {
            fresh_report_clears(s)
        }),
        Property::always(NO_DOUBLE_COUNT, |_: &BookingModel<B>, s: &State| {
            s.faults & fault::WRONG_OTHERS == 0
        }),
        Property::always(BOOKED_WITHIN_SLACK, |m: &BookingModel<B>, s: &State| {
            booked_within_slack(s, m.config.threshold)
        }),
        Property::always(EXACT_VIEW_NO_OVERSHOOT, |_: &BookingModel<B>, s: &State| {
            s.faults & fault::FRESH_OVERSHOOT == 0
        }),
        Property::sometimes(SOMETIMES_APPLIED, |_: &BookingModel<B>, s: &State| {
            s.links
                .iter()
                .flatten()
                .any(|l| l.applied.is_some_and(|r| r.others.tokens > 0))
        }),
        Property::sometimes(SOMETIMES_STALE, |_: &BookingModel<B>, s: &State| {
            s.links.iter().flatten().any(|l| {
                let newest = l.applied.map_or(0, |r| r.seq);
                l.channel.iter().any(|w| w.report.seq <= newest)
            })
        }),
        Property::sometimes(SOMETIMES_SHARED, |_: &BookingModel<B>, s: &State| shared(s)),
        Property::sometimes(SOMETIMES_REFUSED, |m: &BookingModel<B>, s: &State| {
            refused(s, m.config.threshold)
        }),
        Property::sometimes(
            SOMETIMES_OVER_THRESHOLD,
            |m: &BookingModel<B>, s: &State| max_true_load(s) > u64::from(m.config.threshold),
        ),
        Property::sometimes(SOMETIMES_CANCEL_SLACK, |m: &BookingModel<B>, s: &State| {
            max_true_load(s) > u64::from(m.config.threshold) * u64::from(m.config.frontends())
        }),
        Property::sometimes(
            SOMETIMES_FRESH_AND_QUIET,
            |_: &BookingModel<B>, s: &State| {
                fresh_and_quiet(s).any(|(w, f)| s.links[w][f].applied.is_some())
            },
        ),
    ]
}

/// BL1: quiescent ⇒ every ledger total and every booking is zero.
pub fn no_leak(s: &State) -> bool {
    !s.quiescent()
        || s.links.iter().all(|links| {
            ledger(links).total() == Load::ZERO && links.iter().all(|l| l.own == Load::ZERO)
        })
}

/// The (worker, frontend) pairs where all is quiet and the frontend has the worker's latest
/// report: delivered, none in flight, and the worker would report nothing new.
pub fn fresh_and_quiet(s: &State) -> impl Iterator<Item = (usize, usize)> + '_ {
    let quiet = s.quiescent();
    s.links.iter().enumerate().flat_map(move |(w, links)| {
        let mut now = quiet.then(|| ledger(links));
        links.iter().enumerate().filter_map(move |(f, l)| {
            let now = now.as_mut()?;
            let fresh =
                l.channel.is_empty() && l.last_delivered && now.report_for(f as u64).is_none();
            fresh.then_some((w, f))
        })
    })
}

/// BL2: a fresh frontend in a quiet world counts no load on the worker.
pub fn fresh_report_clears(s: &State) -> bool {
    fresh_and_quiet(s).all(|(w, f)| {
        let l = &s.links[w][f];
        l.reported_load().combined(l.own) == Load::ZERO
    })
}

/// S1: each frontend's booked work at or on its way to a worker is at most `threshold`.
pub fn booked_within_slack(s: &State, threshold: u8) -> bool {
    let frontends = s.links.first().map_or(0, Vec::len) as u8;
    (0..s.links.len() as u8).all(|w| {
        (0..frontends).all(|f| {
            let all = s.work(w, None, live);
            let others = s.work(w, Some(f), live);
            all.tokens - others.tokens <= u64::from(threshold)
        })
    })
}

/// Booked and not yet ended at the worker: the work a frontend's bookings stand for.
fn live(stage: Stage) -> bool {
    matches!(stage, Stage::Sent | Stage::Running)
}

/// The largest true load (held or on its way) over the workers.
pub fn max_true_load(s: &State) -> u64 {
    (0..s.links.len() as u8)
        .map(|w| s.work(w, None, Stage::at_worker).tokens)
        .max()
        .unwrap_or(0)
}

/// BV3: some worker has booked requests of two frontends.
pub fn shared(s: &State) -> bool {
    s.links
        .iter()
        .any(|links| links.iter().filter(|l| l.own.requests > 0).take(2).count() == 2)
}

/// BV4: a frontend with a request left would admit 1 token on its own bookings but not with
/// the others' reported work.
pub fn refused(s: &State, threshold: u8) -> bool {
    let threshold = u64::from(threshold);
    s.links.iter().any(|links| {
        links.iter().enumerate().any(|(f, l)| {
            let idle = s
                .requests
                .iter()
                .any(|r| usize::from(r.frontend) == f && r.stage == Stage::Idle);
            idle && l.own.tokens < threshold
                && l.reported_load().combined(l.own).tokens >= threshold
        })
    })
}
