//! Readable traces: each step as the world's input, the machine's actions and what readers see.

use std::fmt::Write as _;

use prefill_router::lifecycle::Action;

use crate::step::Step;
use crate::subject::{Subject, Target};
use crate::world::{Request, State};

/// The step in words. Requests are kept as a sorted multiset, so a slot number means nothing to
/// a reader: name the request by what it holds instead.
fn step_text<S: Subject>(before: &State<S>, step: Step, after: &State<S>) -> String {
    let slot = |i: usize| before.requests.get(i).copied();
    match step {
        Step::Load(_) => {
            let snap = before.snapshot();
            match snap.binding {
                Some(b) => format!("a request loads the snapshot: {} on {b}", snap.lifecycle),
                None => format!(
                    "a request loads the snapshot: {}, no binding",
                    snap.lifecycle
                ),
            }
        }
        Step::Dispatch(i) => match slot(i) {
            Some(Request::Loaded {
                binding: Some(b),
                desired,
            }) => {
                let wanted = desired.map_or("None".to_string(), |t| t.to_string());
                if before.emptied & crate::world::bit(b.build) != 0 && S::DISPATCH_CHECKS_ADMISSION
                {
                    format!("the request that loaded {b} fails: its admission is empty")
                } else {
                    format!("the request that loaded {b} (target then {wanted}) dispatches on it")
                }
            }
            _ => step.to_string(),
        },
        Step::Bypass(_) => "a request with no binding bypasses prefill".to_string(),
        Step::Finish(i) => match slot(i) {
            Some(Request::Running(b)) => {
                let retired = if after.retired & crate::world::bit(b.build) != 0 {
                    " (retired meanwhile)"
                } else {
                    ""
                };
                format!("the request on {b} finishes{retired}")
            }
            _ => step.to_string(),
        },
        other => other.to_string(),
    }
}

/// One line: the step, the actions it produced, and the snapshot afterwards.
pub fn describe<S: Subject>(
    before: &State<S>,
    step: Step,
    actions: &[Action<Target>],
    after: &State<S>,
) -> String {
    let mut line = step_text(before, step, after);
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
