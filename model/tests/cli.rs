//! The command line: parsing, verdicts, counterexample traces, loopback-only Explorer.

use prefill_router_model::cli::{parse, run, CliError, Verb};

fn args(s: &str) -> Vec<String> {
    s.split_whitespace().map(String::from).collect()
}

fn check(s: &str) -> (i32, String) {
    let cmd = parse(&args(s)).expect("arguments parse");
    let mut out = Vec::new();
    let code = run(&cmd, &mut out).expect("check runs");
    (code, String::from_utf8(out).expect("utf-8 report"))
}

#[test]
fn check_reports_every_property_as_holding_for_the_real_machine() {
    let (code, report) = check("check --retargets 3 --failures 1 --requests 1");
    assert_eq!(code, 0, "{report}");
    assert_eq!(report.matches(": holds").count(), 10, "{report}");
    assert!(
        report.contains("16 of 16 properties as expected"),
        "{report}"
    );
}

#[test]
fn dispatch_ignoring_admission_gets_a_shortest_trace_through_an_emptied_admission() {
    let (code, report) = check("check --mutant ignore-admission --retargets 2 --requests 1");
    assert_eq!(code, 1);
    let failing = report
        .split("M10 no dispatch on a binding whose admission is empty: FAILS, counterexample:\n")
        .nth(1)
        .expect("M10 fails with a trace");
    let steps: Vec<&str> = failing
        .lines()
        .take_while(|l| l.starts_with("   "))
        .collect();
    // Build, publish, load, retire (the second controller call), empty, dispatch.
    assert_eq!(steps.len(), 6, "{report}");
    assert!(
        steps[4].contains("admission of binding #1 empties"),
        "{report}"
    );
    assert!(steps[5].contains("dispatches on it"), "{report}");
}

#[test]
fn zero_admission_changes_leave_the_admission_witness_unreached() {
    // Without admission changes the model is the pre-admission one: V6 must be reported
    // vacuous, so a budget that silently stopped applying would be noticed.
    let (code, report) =
        check("check --retargets 2 --failures 1 --requests 1 --admission-changes 0");
    assert_eq!(code, 1, "{report}");
    assert!(
        report.contains("V6 sometimes a retired binding's request fails after its admission emptied: NEVER REACHED"),
        "{report}"
    );
}

#[test]
fn check_prints_a_readable_shortest_counterexample_for_a_mutant() {
    let (code, report) = check("check --mutant no-staleness-check --retargets 3 --requests 1");
    assert_eq!(code, 1);
    let failing = report
        .split("M2 stale build never published: FAILS, counterexample:\n")
        .nth(1)
        .expect("M2 fails with a trace");
    // Shortest: start, cancel by retarget, then the cancelled build succeeds and is published.
    let steps: Vec<&str> = failing
        .lines()
        .take_while(|l| l.starts_with("   "))
        .collect();
    assert_eq!(steps.len(), 3, "{report}");
    assert!(steps[2].contains("succeeds -> publish #1"), "{report}");
}

#[test]
fn unknown_options_and_mutants_are_usage_errors() {
    assert!(matches!(
        parse(&args("check --bogus")),
        Err(CliError::Usage(_))
    ));
    assert!(matches!(
        parse(&args("frobnicate")),
        Err(CliError::Usage(_))
    ));
    assert!(matches!(
        parse(&args("check --retargets x")),
        Err(CliError::Usage(_))
    ));
    let cmd = parse(&args("check --mutant nope")).expect("parses");
    assert!(matches!(
        run(&cmd, &mut Vec::new()),
        Err(CliError::Usage(_))
    ));
}

#[test]
fn configurations_past_the_build_id_masks_are_refused() {
    assert!(matches!(
        parse(&args("check --retargets 60 --failures 10")),
        Err(CliError::Config(_))
    ));
}

#[test]
fn explorer_refuses_non_loopback_addresses() {
    let cmd = parse(&args("explore --addr 0.0.0.0:3000")).expect("parses");
    assert_eq!(cmd.verb, Verb::Explore);
    assert!(matches!(
        run(&cmd, &mut Vec::new()),
        Err(CliError::NotLoopback(_))
    ));
}
