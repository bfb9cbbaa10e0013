//! The published snapshot's accessors: what a request reads must be exactly what was published.

use super::*;

const REASONS: [BypassReason; 5] = [
    BypassReason::NotYetTargeted,
    BypassReason::Building,
    BypassReason::RetryingAfterFailure,
    BypassReason::NoTarget,
    BypassReason::ShutDown,
];

/// An Active snapshot with every field distinct from the initial one's.
fn active(binding: &Arc<String>, epoch: u64) -> Snapshot<u32, String> {
    Snapshot {
        lifecycle: Lifecycle::Active,
        route: Route::Prefill(Arc::clone(binding)),
        target: Some(7),
        build: Some(BuildId(3)),
        epoch,
    }
}

#[test]
fn bypass_labels_are_the_stable_metric_names_and_display_as_such() {
    // Dashboards and alerts key on these strings: they are part of the interface.
    let labels: Vec<&str> = REASONS.iter().map(|r| r.as_str()).collect();
    assert_eq!(
        labels,
        [
            "not_yet_targeted",
            "building",
            "retrying_after_failure",
            "no_target",
            "shut_down"
        ]
    );
    for reason in REASONS {
        assert_eq!(reason.to_string(), reason.as_str());
    }
}

#[test]
fn route_accessors_tell_prefill_from_bypass() {
    let binding = Arc::new("b".to_string());
    let prefill: Route<String> = Route::Prefill(Arc::clone(&binding));
    assert!(prefill.is_prefill());
    assert!(Arc::ptr_eq(prefill.binding().expect("a binding"), &binding));
    assert_eq!(prefill.bypass(), None);
    for reason in REASONS {
        let bypass: Route<String> = Route::Bypass(reason);
        assert!(!bypass.is_prefill());
        assert!(bypass.binding().is_none());
        assert_eq!(bypass.bypass(), Some(reason));
    }
}

#[test]
fn cloning_a_route_shares_the_binding_and_keeps_the_reason() {
    let binding = Arc::new("b".to_string());
    let prefill: Route<String> = Route::Prefill(Arc::clone(&binding));
    let copy = prefill.clone();
    assert!(Arc::ptr_eq(copy.binding().expect("a binding"), &binding));
    // The clone holds its own reference: it keeps a retired binding alive on its own.
    assert_eq!(Arc::strong_count(&binding), 3);
    for reason in REASONS {
        assert_eq!(
            Route::<String>::Bypass(reason).clone(),
            Route::Bypass(reason)
        );
    }
}

#[test]
fn initial_snapshot_is_pending_not_yet_targeted_at_epoch_zero() {
    let s: Snapshot<u32, String> = Snapshot::initial();
    assert_eq!(s.lifecycle(), Lifecycle::Pending);
    assert_eq!(s.bypass(), Some(BypassReason::NotYetTargeted));
    assert!(s.binding().is_none());
    assert_eq!(s.route(), Route::Bypass(BypassReason::NotYetTargeted));
    assert_eq!(s.target(), None);
    assert_eq!(s.build(), None);
    assert_eq!(s.epoch(), 0);
}

#[test]
fn snapshot_accessors_return_what_was_published() {
    let binding = Arc::new("b".to_string());
    let s = active(&binding, 7);
    assert_eq!(s.lifecycle(), Lifecycle::Active);
    assert!(Arc::ptr_eq(s.binding().expect("a binding"), &binding));
    assert_eq!(s.bypass(), None);
    assert!(Arc::ptr_eq(
        s.route_ref().binding().expect("a binding"),
        &binding
    ));
    let owned = s.route();
    assert!(Arc::ptr_eq(owned.binding().expect("a binding"), &binding));
    assert_eq!(s.target(), Some(&7));
    assert_eq!(s.build(), Some(BuildId(3)));
    assert_eq!(s.epoch(), 7);
}

#[test]
fn cell_loads_what_was_last_swapped_in_and_hands_back_the_previous() {
    let binding = Arc::new("b".to_string());
    let cell: RouteCell<u32, String> = RouteCell::new(Arc::new(Snapshot::initial()));
    let before = cell.load();
    assert_eq!(before.epoch(), 0);
    assert_eq!(cell.route(), Route::Bypass(BypassReason::NotYetTargeted));

    let next = Arc::new(active(&binding, 1));
    let old = cell.swap(Arc::clone(&next));
    assert_eq!(old.epoch(), 0);
    assert!(Arc::ptr_eq(&old, &before.to_arc()));

    let after = cell.load();
    assert!(Arc::ptr_eq(&after.to_arc(), &next));
    assert_eq!(after.epoch(), 1);
    assert_eq!(after.target(), Some(&7));
    let route = cell.route();
    assert!(Arc::ptr_eq(route.binding().expect("a binding"), &binding));
}

#[test]
fn guards_are_the_same_snapshot_only_when_they_pin_one_publication() {
    let cell: RouteCell<u32, String> = RouteCell::new(Arc::new(Snapshot::initial()));
    let a = cell.load();
    let b = cell.load();
    assert!(SnapshotGuard::same_snapshot(&a, &b));
    // An equal snapshot published anew is a different publication.
    let _ = cell.swap(Arc::new(Snapshot::initial()));
    let c = cell.load();
    assert!(!SnapshotGuard::same_snapshot(&a, &c));
    assert!(SnapshotGuard::same_snapshot(&c, &c));
}

#[test]
fn debug_output_shows_the_pinned_snapshot() {
    let binding = Arc::new("the-binding".to_string());
    let cell: RouteCell<u32, String> = RouteCell::new(Arc::new(active(&binding, 5)));
    let guard = format!("{:?}", cell.load());
    let whole = format!("{cell:?}");
    for text in [&guard, &whole] {
        assert!(text.contains("Active"), "{text}");
        assert!(text.contains("the-binding"), "{text}");
        assert!(text.contains("epoch: 5"), "{text}");
    }
    assert!(guard.starts_with("SnapshotGuard"), "{guard}");
    assert!(whole.starts_with("RouteCell"), "{whole}");
}
