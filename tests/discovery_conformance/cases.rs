//! The cases: each a generic async fn over a [`Harness`], instantiated per backend in
//! `main.rs`.

use super::*;

pub(crate) async fn register_list_and_watch_agree<H: Harness>(h: &H) {
    let store = h.client().await;
    let ns = unique("ns");
    let ep = endpoint(&ns, "prefill");
    let (a, b) = (instance(&ep, 1), instance(&ep, 2));
    let (card_a, card_b) = (
        card("m", SelectionMode::KV),
        card("m", SelectionMode::RoundRobin),
    );
    let mut watch = store.watch(&ep).await.unwrap();
    let _ra = store.register(a.clone(), card_a.clone()).await.unwrap();
    let _rb = store.register(b.clone(), card_b.clone()).await.unwrap();
    let mut view = View::default();
    view.until(&mut watch, &[&a, &b]).await;
    assert_quiet(&mut watch).await;
    assert_eq!(
        store.list_instances(&ep).await.unwrap(),
        vec![a.clone(), b.clone()]
    );
    assert_eq!(
        store.list_cards(&ep).await.unwrap(),
        vec![(1, card_a.clone()), (2, card_b.clone())]
    );
    assert_eq!(
        store.list_namespace(&ns).await.unwrap(),
        vec![(a, card_a), (b, card_b)]
    );
}

pub(crate) async fn watcher_started_after_registrations_sees_them<H: Harness>(h: &H) {
    let worker = h.client().await;
    let frontend = h.client().await;
    let ns = unique("ns");
    let ep = endpoint(&ns, "prefill");
    let (a, b) = (instance(&ep, 10), instance(&ep, 11));
    let _ra = worker
        .register(a.clone(), card("m", SelectionMode::KV))
        .await
        .unwrap();
    let _rb = worker
        .register(b.clone(), card("m", SelectionMode::KV))
        .await
        .unwrap();
    let mut watch = frontend.watch(&ep).await.unwrap();
    let mut view = View::default();
    view.until(&mut watch, &[&a, &b]).await;
    assert_quiet(&mut watch).await;
    let mut ns_watch = frontend.watch_namespace(&ns).await.unwrap();
    let mut ns_view = NsView::default();
    let c = card("m", SelectionMode::KV);
    ns_view.until(&mut ns_watch, &[(&a, &c), (&b, &c)]).await;
}

pub(crate) async fn deregister_is_seen_promptly<H: Harness>(h: &H) {
    let worker = h.client().await;
    let frontend = h.client().await;
    let ep = endpoint(&unique("ns"), "prefill");
    let (a, b) = (instance(&ep, 20), instance(&ep, 21));
    let ra = worker
        .register(a.clone(), card("m", SelectionMode::KV))
        .await
        .unwrap();
    let _rb = worker
        .register(b.clone(), card("m", SelectionMode::KV))
        .await
        .unwrap();
    let mut watch = frontend.watch(&ep).await.unwrap();
    let mut view = View::default();
    view.until(&mut watch, &[&a, &b]).await;
    let started = Instant::now();
    ra.deregister().await.unwrap();
    assert_eq!(next(&mut watch).await, InstanceEvent::Removed(20));
    // Well before the TTL: a polite deregistration, not an expiry.
    assert!(
        started.elapsed() < h.ttl(),
        "deregistration took {:?}",
        started.elapsed()
    );
    assert_eq!(frontend.list_instances(&ep).await.unwrap(), vec![b]);
}

pub(crate) async fn dropped_registration_is_removed<H: Harness>(h: &H) {
    let worker = h.client().await;
    let ep = endpoint(&unique("ns"), "prefill");
    let a = instance(&ep, 30);
    let ra = worker
        .register(a.clone(), card("m", SelectionMode::KV))
        .await
        .unwrap();
    let mut watch = worker.watch(&ep).await.unwrap();
    assert_eq!(next(&mut watch).await, InstanceEvent::Added(a));
    drop(ra);
    assert_eq!(next(&mut watch).await, InstanceEvent::Removed(30));
}

pub(crate) async fn killed_worker_lease_expires<H: Harness>(h: &H) {
    let frontend = h.client().await;
    let ep = endpoint(&unique("ns"), "prefill");
    let (dead, alive) = (instance(&ep, 40), instance(&ep, 41));
    let _ralive = frontend
        .register(alive.clone(), card("m", SelectionMode::KV))
        .await
        .unwrap();
    let mut watch = frontend.watch(&ep).await.unwrap();
    let mut view = View::default();
    view.until(&mut watch, &[&alive]).await;
    h.register_then_kill(
        dead.clone(),
        card("m", SelectionMode::KV),
        frontend.as_ref(),
    )
    .await;
    let killed = Instant::now();
    // The dead worker was seen, then expires within its TTL plus detection slack.
    view.until(&mut watch, &[&alive, &dead]).await;
    view.until(&mut watch, &[&alive]).await;
    assert_eq!(view.removals, 1, "exactly the dead worker was removed");
    let took = killed.elapsed();
    assert!(
        took < h.ttl() * 3 + Duration::from_secs(3),
        "expiry took {took:?}"
    );
    assert_eq!(frontend.list_instances(&ep).await.unwrap(), vec![alive]);
}

pub(crate) async fn reregister_with_changed_card_is_an_upsert<H: Harness>(h: &H) {
    let worker = h.client().await;
    let frontend = h.client().await;
    let ns = unique("ns");
    let ep = endpoint(&ns, "prefill");
    let a = instance(&ep, 50);
    let (v1, v2) = (
        card("m", SelectionMode::RoundRobin),
        card("m", SelectionMode::KV),
    );
    let mut watch = frontend.watch(&ep).await.unwrap();
    let mut ns_watch = frontend.watch_namespace(&ns).await.unwrap();
    let first = worker.register(a.clone(), v1.clone()).await.unwrap();
    assert_eq!(
        next(&mut ns_watch).await,
        NamespaceEvent::Upserted(a.clone(), v1)
    );
    let second = worker.register(a.clone(), v2.clone()).await.unwrap();
    assert_eq!(
        next(&mut ns_watch).await,
        NamespaceEvent::Upserted(a.clone(), v2.clone())
    );
    assert_eq!(
        frontend.list_cards(&ep).await.unwrap(),
        vec![(50, v2.clone())]
    );
    // The instance itself did not change: one Added, no duplicate.
    assert_eq!(next(&mut watch).await, InstanceEvent::Added(a.clone()));
    assert_quiet(&mut watch).await;
    // The superseded registration must not take its successor's record with it.
    drop(first);
    tokio::time::sleep(h.ttl() + h.ttl() / 2).await;
    assert_eq!(frontend.list_cards(&ep).await.unwrap(), vec![(50, v2)]);
    assert_quiet(&mut watch).await;
    second.deregister().await.unwrap();
    assert_eq!(next(&mut watch).await, InstanceEvent::Removed(50));
}

pub(crate) async fn two_watchers_agree<H: Harness>(h: &H) {
    let worker = h.client().await;
    let (f1, f2) = (h.client().await, h.client().await);
    let ep = endpoint(&unique("ns"), "prefill");
    let mut w1 = f1.watch(&ep).await.unwrap();
    let mut w2 = f2.watch(&ep).await.unwrap();
    let instances: Vec<Instance> = (60..64).map(|id| instance(&ep, id)).collect();
    let mut registrations = Vec::new();
    for i in &instances {
        registrations.push(
            worker
                .register(i.clone(), card("m", SelectionMode::KV))
                .await
                .unwrap(),
        );
    }
    let gone = registrations.remove(1);
    gone.deregister().await.unwrap();
    let expected: Vec<&Instance> = instances.iter().filter(|i| i.instance_id != 61).collect();
    let (mut v1, mut v2) = (View::default(), View::default());
    v1.until(&mut w1, &expected).await;
    v2.until(&mut w2, &expected).await;
    assert_quiet(&mut w1).await;
    assert_quiet(&mut w2).await;
    assert_eq!(v1.instances, v2.instances);
}

pub(crate) async fn malformed_records_are_skipped_and_never_stop_the_watch<H: Harness>(h: &H) {
    let worker = h.client().await;
    let frontend = h.client().await;
    let ns = unique("ns");
    let ep = endpoint(&ns, "prefill");
    let mut watch = frontend.watch(&ep).await.unwrap();
    let mut ns_watch = frontend.watch_namespace(&ns).await.unwrap();
    let good_before = instance(&ep, 70);
    let _r0 = worker
        .register(good_before.clone(), card("m", SelectionMode::KV))
        .await
        .unwrap();
    assert_eq!(
        next(&mut watch).await,
        InstanceEvent::Added(good_before.clone())
    );
    // Not JSON; a good instance with an unreadable card; a record under another's key.
    h.write_raw(&record_key(&ep, 71), b"{not json".to_vec())
        .await;
    let bad_card = format!(
        "{{\"instance\":{},\"card\":{{\"name\":7}}}}",
        serde_json::to_string(&instance(&ep, 72)).unwrap()
    );
    h.write_raw(&record_key(&ep, 72), bad_card.into_bytes())
        .await;
    let misplaced =
        prefill_router::discovery::encode_record(&instance(&ep, 73), &card("m", SelectionMode::KV));
    h.write_raw(&record_key(&ep, 74), misplaced).await;
    let good_after = instance(&ep, 75);
    let _r1 = worker
        .register(good_after.clone(), card("m", SelectionMode::KV))
        .await
        .unwrap();
    // The watch goes on past the junk and reports only the good record.
    assert_eq!(
        next(&mut watch).await,
        InstanceEvent::Added(good_after.clone())
    );
    let c = card("m", SelectionMode::KV);
    let mut ns_view = NsView::default();
    ns_view
        .until(&mut ns_watch, &[(&good_before, &c), (&good_after, &c)])
        .await;
    assert_quiet(&mut watch).await;
    assert_eq!(
        frontend.list_instances(&ep).await.unwrap(),
        vec![good_before.clone(), good_after.clone()]
    );
    assert_eq!(
        frontend.list_cards(&ep).await.unwrap(),
        vec![(70, c.clone()), (75, c.clone())]
    );
    assert_eq!(frontend.list_namespace(&ns).await.unwrap().len(), 2);
    // A watcher started now, with the junk in place, sees only the good records.
    let mut late = frontend.watch(&ep).await.unwrap();
    let mut view = View::default();
    view.until(&mut late, &[&good_before, &good_after]).await;
    assert_quiet(&mut late).await;
}

pub(crate) async fn endpoints_and_namespaces_are_isolated<H: Harness>(h: &H) {
    let store = h.client().await;
    let ns = unique("ns");
    let ep = endpoint(&ns, "comp");
    let near = [
        endpoint(&ns, "comp2"),
        EndpointId::new(&ns, "comp", "generate2"),
        EndpointId::new(format!("{ns}/comp"), "generate", "x"),
        endpoint(&format!("{ns}2"), "comp"),
    ];
    let mut watch = store.watch(&ep).await.unwrap();
    let mut ns_watch = store.watch_namespace(&ns).await.unwrap();
    let mut held = Vec::new();
    for (n, other) in near.iter().enumerate() {
        held.push(
            store
                .register(instance(other, 80 + n as u64), card("m", SelectionMode::KV))
                .await
                .unwrap(),
        );
    }
    let mine = instance(&ep, 90);
    held.push(
        store
            .register(mine.clone(), card("m", SelectionMode::KV))
            .await
            .unwrap(),
    );
    assert_eq!(next(&mut watch).await, InstanceEvent::Added(mine.clone()));
    assert_quiet(&mut watch).await;
    assert_eq!(store.list_instances(&ep).await.unwrap(), vec![mine.clone()]);
    // The namespace holds its own three endpoints, not `{ns}/comp` nor `{ns}2`.
    let in_ns = store.list_namespace(&ns).await.unwrap();
    assert_eq!(in_ns.len(), 3, "{in_ns:?}");
    assert!(in_ns.iter().all(|(i, _)| i.endpoint.namespace == ns));
    let mut ns_view = NsView::default();
    let c = card("m", SelectionMode::KV);
    let (i80, i81) = (instance(&near[0], 80), instance(&near[1], 81));
    ns_view
        .until(&mut ns_watch, &[(&i80, &c), (&i81, &c), (&mine, &c)])
        .await;
    assert_quiet(&mut ns_watch).await;
}

pub(crate) async fn lagging_watcher_catches_up_without_loss_or_duplicates<H: Harness>(h: &H) {
    let worker = h.client().await;
    let frontend = h.client().await;
    let ep = endpoint(&unique("ns"), "prefill");
    let mut watch = frontend.watch(&ep).await.unwrap();
    let mut ns_watch = frontend.watch_namespace(&ep.namespace).await.unwrap();
    // Nobody reads the watches while a burst lands: their buffers overflow.
    let mut held = Vec::new();
    let instances: Vec<Instance> = (0..h.burst()).map(|id| instance(&ep, 1000 + id)).collect();
    for i in &instances {
        held.push(
            worker
                .register(i.clone(), card("m", SelectionMode::KV))
                .await
                .unwrap(),
        );
    }
    // Half of them leave again before anyone looks.
    let mut survivors = Vec::new();
    for (n, registration) in held.into_iter().enumerate() {
        if n % 2 == 0 {
            registration.deregister().await.unwrap();
        } else {
            survivors.push(registration);
        }
    }
    let expected: Vec<&Instance> = instances.iter().skip(1).step_by(2).collect();
    let mut view = View::default();
    view.until(&mut watch, &expected).await;
    assert_quiet(&mut watch).await;
    let c = card("m", SelectionMode::KV);
    let expected_ns: Vec<(&Instance, &ModelCard)> = expected.iter().map(|i| (*i, &c)).collect();
    let mut ns_view = NsView::default();
    ns_view.until(&mut ns_watch, &expected_ns).await;
}

pub(crate) async fn invalid_instance_is_rejected<H: Harness>(h: &H) {
    let store = h.client().await;
    let bad = instance(&EndpointId::new("", "prefill", "generate"), 1);
    let result = store.register(bad, ModelCard::named("m")).await;
    assert!(matches!(result, Err(DiscoveryError::InvalidInstance(_))));
}
