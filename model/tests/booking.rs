//! The booking model: the real load-report code satisfies every property in each configuration
//! (state counts pinned, so a truncated or changed search fails), and each mutant yields a
//! counterexample of the property it breaks (the "caught mutant" column of docs/properties.md).

use std::collections::BTreeSet;

use prefill_router_model::booking::mutants::{
    AppliesAnyReport, DropsOwnOnReport, KeepsViewOnReconnect, NoFinishOnCancel, ReportsOwnWork,
};
use prefill_router_model::booking::properties::*;
use prefill_router_model::booking::{Booking, BookingConfig, BookingModel, RealBooking};
use stateright::{Checker, Expectation, HasDiscoveries, Model};

/// Checks the real code exhaustively: no `always` property fails, every `sometimes` is reached
/// but those in `unreachable` (which the configuration's bounds rule out, pinned too), and the
/// state count is `states`.
fn check_real(config: BookingConfig, states: usize, unreachable: &[&str]) {
    let checker = BookingModel::<RealBooking>::new(config)
        .checker()
        .spawn_bfs()
        .join();
    assert!(checker.is_done());
    assert_eq!(checker.unique_state_count(), states, "{config:?}");
    if unreachable.is_empty() {
        checker.assert_properties();
        return;
    }
    for p in checker.model().properties() {
        let found = checker.discovery(p.name).is_some();
        match p.expectation {
            Expectation::Sometimes => {
                assert_eq!(found, !unreachable.contains(&p.name), "{}", p.name)
            }
            _ => assert!(!found, "{} fails: {:?}", p.name, checker.discovery(p.name)),
        }
    }
}

#[test]
fn the_real_code_holds_every_property_in_the_standard_configuration() {
    check_real(BookingConfig::STANDARD, 280_608, &[]);
}

#[test]
fn the_real_code_holds_with_work_of_one_or_two_tokens() {
    // One request per frontend: its own cancelled work cannot be re-booked on top (BV6).
    check_real(BookingConfig::WORK_SIZES, 92_416, &[SOMETIMES_CANCEL_SLACK]);
}

#[test]
fn the_real_code_holds_with_three_frontends() {
    // One report per connection (none stale), one request per frontend (no re-booking).
    check_real(
        BookingConfig::THREE_FRONTENDS,
        157_456,
        &[SOMETIMES_STALE, SOMETIMES_CANCEL_SLACK],
    );
}

#[test]
fn the_real_code_holds_with_two_workers() {
    check_real(
        BookingConfig::TWO_WORKERS,
        92_416,
        &[SOMETIMES_STALE, SOMETIMES_CANCEL_SLACK],
    );
}

/// Runs BFS on mutant `B` in the standard configuration until `property` has a discovery, and
/// returns its steps, one per line.
fn counterexample<B: Booking>(property: &'static str) -> String {
    let checker = BookingModel::<B>::new(BookingConfig::STANDARD)
        .checker()
        .finish_when(HasDiscoveries::AnyOf(BTreeSet::from([property])))
        .spawn_bfs()
        .join();
    let path = checker.discovery(property).unwrap_or_else(|| {
        panic!(
            "mutant {} escaped property {property:?} after {} states",
            B::NAME,
            checker.unique_state_count()
        )
    });
    path.into_actions()
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn a_report_holding_the_connections_own_work_breaks_dc1() {
    let t = counterexample::<ReportsOwnWork>(NO_DOUBLE_COUNT);
    assert!(t.contains("arrives") && t.contains("reports"), "{t}");
}

#[test]
fn applying_a_late_report_breaks_bl2() {
    let t = counterexample::<AppliesAnyReport>(FRESH_REPORT_CLEARS);
    // A late report, delivered after the newest, resurrects ended work.
    assert!(t.matches("delivers").count() >= 2, "{t}");
}

#[test]
fn dropping_own_bookings_on_a_report_breaks_s1() {
    let t = counterexample::<DropsOwnOnReport>(BOOKED_WITHIN_SLACK);
    assert!(
        t.contains("delivers") && t.matches("admits").count() >= 2,
        "{t}"
    );
}

#[test]
fn dropping_own_bookings_on_a_report_breaks_s2() {
    counterexample::<DropsOwnOnReport>(EXACT_VIEW_NO_OVERSHOOT);
}

#[test]
fn never_finishing_a_cancelled_request_breaks_bl1() {
    let t = counterexample::<NoFinishOnCancel>(NO_LEAK);
    assert!(t.contains("cancelled"), "{t}");
}

#[test]
fn keeping_the_view_across_a_reconnect_breaks_bl2() {
    let t = counterexample::<KeepsViewOnReconnect>(FRESH_REPORT_CLEARS);
    assert!(t.contains("closes"), "{t}");
}

#[test]
fn every_safety_property_is_broken_by_some_mutant() {
    // The mapping the tests above exercise: a new always-property without a mutant fails here.
    let caught: BTreeSet<&str> = [
        NO_LEAK,
        FRESH_REPORT_CLEARS,
        NO_DOUBLE_COUNT,
        BOOKED_WITHIN_SLACK,
        EXACT_VIEW_NO_OVERSHOOT,
    ]
    .into();
    for p in BookingModel::<RealBooking>::new(BookingConfig::STANDARD).properties() {
        assert!(
            p.expectation == Expectation::Sometimes || caught.contains(p.name),
            "property {:?} has no mutant that breaks it",
            p.name
        );
    }
}
