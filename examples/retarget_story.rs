//! Drives the pure lifecycle machine through a retarget story and prints the trace:
//! the prefill pool appears, a build fails and retries with backoff, a new generation rolls
//! out while a stale build finishes late, the pool vanishes and returns (binding reuse), and
//! the router shuts down.
//!
//! Run: `cargo run --release --example retarget_story`

use prefill_router::lifecycle::{BuildId, Input, Machine, RetryPolicy};

fn main() {
    let mut m: Machine<&str> = Machine::new(RetryPolicy::default());
    let story: Vec<(&str, Input<&str>)> = vec![
        (
            "the prefill pool appears (generation 1)",
            Input::SetTarget(Some("prefill/gen1")),
        ),
        (
            "the first build fails (workers not ready)",
            Input::BuildFailed(BuildId(1)),
        ),
        ("the retry timer fires", Input::RetryElapsed(BuildId(1))),
        ("the rebuild succeeds", Input::BuildSucceeded(BuildId(2))),
        (
            "generation 2 rolls out",
            Input::SetTarget(Some("prefill/gen2")),
        ),
        (
            "operator rolls back to generation 1 before gen2 is built",
            Input::SetTarget(Some("prefill/gen1")),
        ),
        (
            "the abandoned gen2 build finishes late",
            Input::BuildSucceeded(BuildId(3)),
        ),
        (
            "the gen1 rebuild succeeds",
            Input::BuildSucceeded(BuildId(4)),
        ),
        ("the prefill pool vanishes", Input::SetTarget(None)),
        (
            "the same pool returns",
            Input::SetTarget(Some("prefill/gen1")),
        ),
        ("the frontend shuts down", Input::Shutdown),
        (
            "a straggling result arrives after shutdown",
            Input::BuildSucceeded(BuildId(4)),
        ),
    ];
    println!("{:<58} {:<12} actions", "event", "lifecycle");
    println!("{}", "-".repeat(100));
    for (what, input) in story {
        let actions: Vec<String> = m.handle(input).iter().map(|a| a.to_string()).collect();
        let actions = if actions.is_empty() {
            "-".to_string()
        } else {
            actions.join("; ")
        };
        println!("{what:<58} {:<12} {actions}", m.lifecycle().to_string());
    }
}
