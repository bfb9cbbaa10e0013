//! The machine's invariants I1..I6 (docs/design.md), checked on each step of a history.
//!
//! I1 and I2 are judged on the state after a step; I3..I6 need the history, so the [`Ledger`]
//! keeps the builds started and not yet answered, and the bindings published and retired.

use std::collections::BTreeSet;
use std::fmt;

use crate::reference::MachineView;
use prefill_router::lifecycle::{Action, BuildId, Input, Lifecycle};

/// Bookkeeping of one history; feed it every step with [`Ledger::observe`].
#[derive(Clone, Debug)]
pub struct Ledger {
    open_builds: BTreeSet<BuildId>,
    published: BTreeSet<BuildId>,
    retired: BTreeSet<BuildId>,
    last_start: BuildId,
}

impl Default for Ledger {
    fn default() -> Self {
        Ledger::new()
    }
}

impl Ledger {
    /// An empty history.
    pub fn new() -> Self {
        Ledger {
            open_builds: BTreeSet::new(),
            published: BTreeSet::new(),
            retired: BTreeSet::new(),
            last_start: BuildId(0),
        }
    }

    /// Bindings published so far.
    pub fn published(&self) -> usize {
        self.published.len()
    }

    /// Check one step: `input` took the machine from `before` to `after` and produced `actions`.
    /// Returns which invariant broke, and how.
    pub fn observe<T: Clone + Eq + fmt::Debug>(
        &mut self,
        before: &MachineView<T>,
        input: &Input<T>,
        actions: &[Action<T>],
        after: &MachineView<T>,
    ) -> Result<(), String> {
        // I3: a result handled as current answers its build.
        if let Input::BuildSucceeded(b) | Input::BuildFailed(b) = input {
            if before.in_flight.as_ref().map(|(id, _)| id) == Some(b) {
                self.open_builds.remove(b);
            }
        }
        for action in actions {
            match action {
                Action::StartBuild { build, target } => {
                    if *build <= self.last_start {
                        return Err(format!("I6: {build} started after {}", self.last_start));
                    }
                    self.last_start = *build;
                    if after.desired.as_ref() != Some(target) {
                        return Err(format!(
                            "I2: build {build} for {target:?} while {:?} is desired",
                            after.desired
                        ));
                    }
                    self.open_builds.insert(*build);
                }
                Action::CancelBuild { build } => {
                    if !self.open_builds.remove(build) {
                        return Err(format!("I3: cancel of {build}, which is not open"));
                    }
                }
                Action::Publish { build, target } => {
                    let current = before.in_flight.as_ref() == Some(&(*build, target.clone()));
                    if !current || before.desired.as_ref() != Some(target) {
                        return Err(format!(
                            "I4: publish {build} for {target:?}, in flight {:?}, desired {:?}",
                            before.in_flight, before.desired
                        ));
                    }
                    if *input != Input::BuildSucceeded(*build) {
                        return Err(format!("I4: publish {build} on {input:?}"));
                    }
                    self.published.insert(*build);
                }
                Action::Retire { build } => {
                    if !self.published.contains(build) {
                        return Err(format!("I5: retired {build}, never published"));
                    }
                    if !self.retired.insert(*build) {
                        return Err(format!("I5: retired {build} twice"));
                    }
                }
                Action::Discard { .. }
                | Action::ScheduleRetry { .. }
                | Action::CancelRetry { .. } => {}
            }
        }
        self.check_state(after)
    }

    fn check_state<T: Clone + Eq + fmt::Debug>(&self, m: &MachineView<T>) -> Result<(), String> {
        if m.lifecycle == Lifecycle::Active
            && (m.desired.is_none() || m.held.as_ref().map(|(_, t)| t) != m.desired.as_ref())
        {
            return Err(format!(
                "I1: active with held {:?}, desired {:?}",
                m.held, m.desired
            ));
        }
        if let Some((_, t)) = &m.in_flight {
            if m.desired.as_ref() != Some(t) || m.held.is_some() || m.retry_armed.is_some() {
                return Err(format!(
                    "I2: in flight {:?} with desired {:?}, held {:?}, retry {:?}",
                    m.in_flight, m.desired, m.held, m.retry_armed
                ));
            }
        }
        if self.open_builds.len() > 1 {
            return Err(format!("I3: builds open at once: {:?}", self.open_builds));
        }
        if self.open_builds.first() != m.in_flight.as_ref().map(|(b, _)| b) {
            return Err(format!(
                "I3: open builds {:?}, machine in flight {:?}",
                self.open_builds, m.in_flight
            ));
        }
        // I5: what is published and not yet retired is exactly the held binding (a publish
        // happens only with nothing held, and the held binding is retired when replaced), so
        // after shutdown everything published has been retired.
        let live: Vec<_> = self.published.difference(&self.retired).collect();
        let held = m.held.as_ref().map(|(b, _)| b);
        if live.len() > 1 || live.first().copied() != held {
            return Err(format!(
                "I5: published and not retired {live:?}, held {held:?}"
            ));
        }
        if m.shut_down && !live.is_empty() {
            return Err(format!("I5: shut down with {live:?} not retired"));
        }
        Ok(())
    }
}
