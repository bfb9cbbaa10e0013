//! Readable traces: each step as the world's input, the machine's actions and what readers see.

use std::fmt::Write as _;

use prefill_router::lifecycle::Action;
use stateright::Model;

use crate::model::{RouterModel, Step};
use crate::subject::{Subject, Target};
use crate::world::State;

/// One line: the step, the actions it produced, and the snapshot afterwards.
pub fn describe<S: Subject>(step: Step, actions: &[Action<Target>], after: &State<S>) -> String {
    let mut line = step.to_string();
    if !actions.is_empty() {
        line.push_str(" -> ");
        let names: Vec<String> = actions.iter().map(|a| a.to_string()).collect();
        line.push_str(&names.join(", "));
    }
    let snap = after.snapshot();
    let _ = write!(line, "  [{}", snap.lifecycle);
    if let Some(b) = snap.binding {
        let _ = write!(line, " on {b}");
    }
    line.push(']');
    line
}

/// The whole path from the initial state, one numbered line per step, replayed through the
/// model so the printed actions are the ones the checker saw.
pub fn render<S: Subject>(model: &RouterModel<S>, steps: &[Step]) -> String {
    let mut out = String::new();
    let Some(mut state) = model.init_states().into_iter().next() else {
        return out;
    };
    for (i, step) in steps.iter().enumerate() {
        let (next, actions) = model.apply(&state, *step);
        let _ = writeln!(out, "  {:>2}. {}", i + 1, describe(*step, &actions, &next));
        state = next;
    }
    out
}
