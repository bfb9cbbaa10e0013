//! Deliberately broken booking drivers, to show that each property of the booking model can
//! fail. Each wraps the real `LoadLedger` / `ReportedLoad` and alters only an input or an
//! output ([`Booking`]'s hooks), so `src/load_report.rs` carries no mutation hooks.
//! `model/tests/booking.rs` asserts that the checker finds each counterexample; the mapping is
//! the booking mutant table of docs/properties.md.

use prefill_router::load_report::{Applied, Load, LoadReport, ReportedLoad};

use super::Booking;

/// A worker whose report also holds the receiving connection's own work: the frontend counts
/// its own requests twice (once booked, once reported). Breaks DC1.
#[derive(Clone, Copy, Debug)]
pub struct ReportsOwnWork;

impl Booking for ReportsOwnWork {
    const NAME: &'static str = "reports-own-work";

    fn send(report: LoadReport, own: Load) -> LoadReport {
        LoadReport {
            seq: report.seq,
            others: Load {
                tokens: report.others.tokens + own.tokens,
                requests: report.others.requests + own.requests,
            },
        }
    }
}

/// A frontend that applies every delivered report, whatever its seq: a late report resurrects
/// work that has ended since. Breaks BL2.
#[derive(Clone, Copy, Debug)]
pub struct AppliesAnyReport;

impl Booking for AppliesAnyReport {
    const NAME: &'static str = "applies-any-report";

    fn apply(seen: &mut ReportedLoad, report: LoadReport) -> Applied {
        // A fresh view accepts any report: the newest-seq rule is bypassed.
        *seen = ReportedLoad::new();
        seen.apply(report)
    }
}

/// A frontend that drops its own bookings on a worker once a report arrives, as if the report
/// covered them (it never does: a report leaves the receiving connection's own work out). It
/// under-counts and admits past the threshold. Breaks S1 and S2.
#[derive(Clone, Copy, Debug)]
pub struct DropsOwnOnReport;

impl Booking for DropsOwnOnReport {
    const NAME: &'static str = "drops-own-on-report";
    const DROP_OWN_ON_REPORT: bool = true;
}

/// A worker whose driver never tells the ledger that a cancelled request ended (only
/// finished ones): the cancelled work stays in the ledger for good. Breaks BL1.
#[derive(Clone, Copy, Debug)]
pub struct NoFinishOnCancel;

impl Booking for NoFinishOnCancel {
    const NAME: &'static str = "no-finish-on-cancel";
    const FINISH_ON_CANCEL: bool = false;
}

/// A frontend that keeps its [`ReportedLoad`] across a reconnect: the new connection's reports
/// start again at seq 1 and are ignored as stale until they pass the old seq, so the old
/// connection's `others` stays counted. Breaks BL2 (the obligation is the transport's: a new
/// connection gets a new view).
#[derive(Clone, Copy, Debug)]
pub struct KeepsViewOnReconnect;

impl Booking for KeepsViewOnReconnect {
    const NAME: &'static str = "keeps-view-on-reconnect";
    const FRESH_VIEW_ON_RECONNECT: bool = false;
}
