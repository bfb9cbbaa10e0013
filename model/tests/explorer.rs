//! The model as the Explorer shows it: its page names the `check` command that prints the
//! shortest counterexample, in the property names and at the step that violates a property.

use prefill_router::lifecycle::BuildId;
use prefill_router_model::mutants::NoStalenessCheck;
use prefill_router_model::properties::{SOMETIMES_ACTIVE, STALE_BUILD_NEVER_PUBLISHED};
use prefill_router_model::{Config, RouterModel, Step, Target};
use stateright::{Expectation, Model};

const COMMAND: &str = "prefill-router-model check --mutant no-staleness-check";

fn explorer_model() -> RouterModel<NoStalenessCheck> {
    RouterModel::for_explorer(Config::STANDARD, COMMAND.to_string())
}

#[test]
fn explorer_property_names_point_at_the_shortest_counterexample() {
    let model = explorer_model();
    assert_eq!(model.check_command(), Some(COMMAND));
    let properties = model.properties();
    let plain = RouterModel::<NoStalenessCheck>::new(Config::STANDARD).properties();
    assert_eq!(properties.len(), plain.len());
    for (shown, plain) in properties.iter().zip(&plain) {
        if plain.expectation == Expectation::Sometimes {
            // Examples need no pointer; their names stay as `check` reports them.
            assert_eq!(shown.name, plain.name);
        } else {
            assert_eq!(
                shown.name,
                format!("{} (shortest counterexample: {COMMAND})", plain.name)
            );
        }
    }
    assert!(properties.iter().any(|p| p.name == SOMETIMES_ACTIVE));
    // `check` and the tests keep the plain names.
    assert!(plain.iter().any(|p| p.name == STALE_BUILD_NEVER_PUBLISHED));
}

#[test]
fn the_violating_step_says_so_in_the_explorer_only() {
    // The shortest M2 counterexample: build for A, retarget to B (cancels it), it succeeds.
    let steps = [
        Step::SetTarget(Some(Target(0))),
        Step::SetTarget(Some(Target(1))),
        Step::BuildSucceeds(BuildId(1)),
    ];
    for (model, marked) in [
        (explorer_model(), true),
        (RouterModel::new(Config::STANDARD), false),
    ] {
        let mut state = model.init_states().remove(0);
        for (i, step) in steps.iter().enumerate() {
            let outcome = model.format_step(&state, *step).expect("an outcome");
            let says = outcome.contains(&format!(
                "this step violates \"{STALE_BUILD_NEVER_PUBLISHED}\"; the shortest \
                 counterexample: {COMMAND}"
            ));
            assert_eq!(says, marked && i == 2, "step {i}: {outcome}");
            state = model.next_state(&state, *step).expect("a next state");
        }
    }
}
