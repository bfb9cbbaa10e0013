//! The machine's unit tests: one per transition row (`rules.rs`, rules 1-8 of docs/design.md),
//! one per invariant (`invariants.rs`, I1-I6), and what it reports (`accessors.rs`).

use super::*;
use Action::*;
use Input::*;

mod accessors;
mod invariants;
mod rules;

const A: &str = "a";
const B: &str = "b";

fn machine() -> Machine<&'static str> {
    Machine::new(RetryPolicy::default())
}

fn step(m: &mut Machine<&'static str>, input: Input<&'static str>) -> Vec<Action<&'static str>> {
    m.handle(input).into_iter().collect()
}

/// A machine that built and published `A` with build 1.
fn active_on_a() -> Machine<&'static str> {
    let mut m = machine();
    let _ = m.handle(SetTarget(Some(A)));
    let _ = m.handle(BuildSucceeded(BuildId(1)));
    assert_eq!(m.lifecycle(), Lifecycle::Active);
    m
}

// ---- derived lifecycle ----

#[test]
fn fresh_machine_is_pending_with_nothing_held() {
    let m = machine();
    assert_eq!(m.lifecycle(), Lifecycle::Pending);
    assert_eq!(m.desired(), None);
    assert!(!m.is_targeted());
    assert_eq!(m.held(), None);
    assert_eq!(m.in_flight(), None);
    assert_eq!(m.failures(), 0);
    assert_eq!(m.next_build_id(), BuildId(1));
}
