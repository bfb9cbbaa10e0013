//! What the machine reports about itself: its policy, and its labels in traces.

use super::*;

#[test]
fn display_renders_traces() {
    let a: Action<&str> = ScheduleRetry {
        after: BuildId(3),
        delay: Duration::from_secs(2),
        attempt: 2,
    };
    assert_eq!(a.to_string(), "retry after #3 in 2s (attempt 2)");
    assert_eq!(Lifecycle::Active.to_string(), "active");
}

#[test]
fn policy_returns_the_policy_the_machine_was_built_with() {
    let policy = RetryPolicy {
        initial: Duration::from_millis(3),
        max: Duration::from_millis(70),
    };
    assert_ne!(policy, RetryPolicy::default());
    assert_eq!(Machine::<&str>::new(policy).policy(), policy);
    assert_eq!(machine().policy(), RetryPolicy::default());
}

#[test]
fn lifecycles_and_build_ids_render_as_trace_labels() {
    assert_eq!(Lifecycle::Pending.to_string(), "pending");
    assert_eq!(Lifecycle::Active.to_string(), "active");
    assert_eq!(Lifecycle::Unavailable.to_string(), "unavailable");
    assert_eq!(BuildId(42).to_string(), "#42");
}
