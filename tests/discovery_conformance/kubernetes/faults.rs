//! Faults of the cluster the Kubernetes backend must heal: the API server restarting, the
//! history compacted while a watcher lags, a pod flapping between ready and not ready.
//!
//! Every watcher's events go through `View`/`NsView`, which reject a duplicate `Added` and a
//! removal of an instance never seen: "exactly the changes" is checked event by event, not
//! only on the final set. Loopback only; each test is bounded by `within`.

use super::*;

/// A client whose watch requests outlive the test: a held watch cannot time out and reopen
/// (which would deliver the held changes without the `410` the test is about).
async fn patient_client(server: &K8sServer) -> KubernetesDiscovery {
    let config = KubernetesConfig::new(K8S_NS, ClusterSource::Url(server.url.clone()))
        .with_retry_interval(Duration::from_millis(100))
        .with_page_size(1)
        .with_watch_timeout(Duration::from_secs(120));
    KubernetesDiscovery::connect(config).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k8s_api_server_restart_resumes_watches_with_exactly_the_changes() {
    within(async {
        let server = K8sServer::start().await;
        let ep = endpoint("dyn", "prefill");
        let (a, b, mut c, d) = (
            Pod::new(1, &ep),
            Pod::new(2, &ep),
            Pod::new(3, &ep),
            Pod::new(4, &ep),
        );
        for pod in [&a, &b, &c] {
            put_pod(&server, pod);
        }
        put_slice(&server, "s", &ep, &[&a, &b, &c]);
        let store = client(&server).await;
        let mut watch = store.watch(&ep).await.unwrap();
        let mut ns_watch = store.watch_namespace("dyn").await.unwrap();
        let mut view = View::default();
        view.until(&mut watch, &[&a.instance(), &b.instance(), &c.instance()])
            .await;
        let mut ns_view = NsView::default();
        let (ia, ib, ic) = (a.instance(), b.instance(), c.instance());
        ns_view
            .until(
                &mut ns_watch,
                &[(&ia, &a.card), (&ib, &b.card), (&ic, &c.card)],
            )
            .await;
        let mut status = store.store_status();
        // The server goes away: listener closed, both watches' connections cut.
        server.stop().await;
        status.wait_for(|s| !s.reachable).await.unwrap();
        // Meanwhile the cluster goes on (another replica over the same etcd): b is deleted, c's
        // card changes, d joins. Versions continue from where they were.
        server.delete(Kind::Pod, &b.name);
        c.card = card("m2", SelectionMode::KV);
        put_pod(&server, &c);
        put_pod(&server, &d);
        put_slice(&server, "s", &ep, &[&a, &c, &d]);
        // Back on the same port with its state, without its watches.
        server.resume().await;
        status
            .wait_for(|s| s.reachable && s.outages == 1)
            .await
            .unwrap();
        let (ic, id) = (c.instance(), d.instance());
        view.until(&mut watch, &[&ia, &ic, &id]).await;
        assert_eq!(view.removals, 1, "exactly b was removed");
        ns_view
            .until(
                &mut ns_watch,
                &[(&ia, &a.card), (&ic, &c.card), (&id, &d.card)],
            )
            .await;
        // The reopened watches follow live changes after the restart.
        let e = Pod::new(5, &ep);
        put_pod(&server, &e);
        put_slice(&server, "s", &ep, &[&a, &c, &d, &e]);
        assert_eq!(next(&mut watch).await, InstanceEvent::Added(e.instance()));
        assert_quiet(&mut watch).await;
        let ie = e.instance();
        ns_view
            .until(
                &mut ns_watch,
                &[
                    (&ia, &a.card),
                    (&ic, &c.card),
                    (&id, &d.card),
                    (&ie, &e.card),
                ],
            )
            .await;
        assert_quiet(&mut ns_watch).await;
        assert_eq!(store.store_status().borrow().outages, 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k8s_compaction_while_a_watcher_lags_relists_to_exactly_the_current_set() {
    within(async {
        let server = K8sServer::start().await;
        let ep = endpoint("dyn", "prefill");
        let mut pods: Vec<Pod> = (1..=13).map(|n| Pod::new(n, &ep)).collect();
        let first: Vec<&Pod> = pods.iter().take(6).collect();
        for pod in &first {
            put_pod(&server, pod);
        }
        put_slice(&server, "s", &ep, &first);
        let store = patient_client(&server).await;
        let mut watch = store.watch(&ep).await.unwrap();
        let mut ns_watch = store.watch_namespace("dyn").await.unwrap();
        let initial: Vec<Instance> = first.iter().map(|p| p.instance()).collect();
        let mut view = View::default();
        view.until(&mut watch, &initial.iter().collect::<Vec<_>>())
            .await;
        let mut ns_view = NsView::default();
        let cards: Vec<(Instance, ModelCard)> = first
            .iter()
            .map(|p| (p.instance(), p.card.clone()))
            .collect();
        let expected: Vec<(&Instance, &ModelCard)> = cards.iter().map(|(i, c)| (i, c)).collect();
        ns_view.until(&mut ns_watch, &expected).await;

        // The watches lag (the server delivers nothing) while much happens.
        server.hold_watches();
        // 7..=12 join, one at a time, as a rollout would add them.
        for n in 7..=12 {
            put_pod(&server, &pods[n - 1]);
            put_slice(&server, "s", &ep, &pods.iter().take(n).collect::<Vec<_>>());
        }
        // 13 comes and goes: the watcher never saw it, so it must not hear of its removal.
        put_pod(&server, &pods[12]);
        put_slice(&server, "s", &ep, &pods.iter().collect::<Vec<_>>());
        server.delete(Kind::Pod, &pods[12].name);
        // 1 and 2 leave; 3's card changes; 4 moves to another address.
        server.delete(Kind::Pod, &pods[0].name);
        server.delete(Kind::Pod, &pods[1].name);
        pods[2].card = card("m2", SelectionMode::RoundRobin);
        put_pod(&server, &pods[2]);
        pods[3].ip = IpAddr::from([10, 0, 1, 4]);
        let current: Vec<&Pod> = pods[2..12].iter().collect();
        put_slice(&server, "s", &ep, &current);
        // The history the watches would resume from is gone: they get `410` and relist.
        server.compact();
        server.release_watches();

        let now: Vec<Instance> = current.iter().map(|p| p.instance()).collect();
        view.until(&mut watch, &now.iter().collect::<Vec<_>>())
            .await;
        assert_eq!(view.removals, 2, "exactly 1 and 2 were removed");
        assert_quiet(&mut watch).await;
        let cards: Vec<(Instance, ModelCard)> = current
            .iter()
            .map(|p| (p.instance(), p.card.clone()))
            .collect();
        let expected: Vec<(&Instance, &ModelCard)> = cards.iter().map(|(i, c)| (i, c)).collect();
        ns_view.until(&mut ns_watch, &expected).await;
        assert_quiet(&mut ns_watch).await;
        assert_eq!(store.list_instances(&ep).await.unwrap().len(), 10);
        // A `410` is a gap, not an outage.
        assert_eq!(store.store_status().borrow().outages, 0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k8s_a_flapping_pod_leaves_every_watcher_in_its_final_state() {
    within(async {
        let server = K8sServer::start().await;
        let ep = endpoint("dyn", "prefill");
        let (mut a, mut b, mut c) = (Pod::new(1, &ep), Pod::new(2, &ep), Pod::new(3, &ep));
        for pod in [&a, &b, &c] {
            put_pod(&server, pod);
        }
        put_slice(&server, "s", &ep, &[&a, &b, &c]);
        let (first, second) = (client(&server).await, client(&server).await);
        let mut w1 = first.watch(&ep).await.unwrap();
        let mut w2 = second.watch(&ep).await.unwrap();
        let mut ns_watch = first.watch_namespace("dyn").await.unwrap();
        // Read only at the end: it catches up on the flapping in one go.
        let mut lagging = second.watch(&ep).await.unwrap();
        let all = [a.instance(), b.instance(), c.instance()];
        let (mut v1, mut v2) = (View::default(), View::default());
        v1.until(&mut w1, &all.iter().collect::<Vec<_>>()).await;
        v2.until(&mut w2, &all.iter().collect::<Vec<_>>()).await;
        // a's readiness probe flaps 51 times (ending not ready), b's 50 times (ending ready),
        // interleaved, one endpoint change per slice update as the controller writes them.
        // The watchers read meanwhile, so their events interleave with the flips.
        let reading = async {
            loop {
                tokio::select! {
                    event = w1.next() => v1.apply(event.expect("watch ended")),
                    event = w2.next() => v2.apply(event.expect("watch ended")),
                }
            }
        };
        let flapping = async {
            for n in 1..=51 {
                a.ready = n % 2 == 0;
                put_slice(&server, "s", &ep, &[&a, &b, &c]);
                if n <= 50 {
                    b.ready = n % 2 == 0;
                    put_slice(&server, "s", &ep, &[&a, &b, &c]);
                }
                if n % 10 == 0 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        };
        tokio::select! {
            _ = reading => unreachable!(),
            () = flapping => {}
        }
        // The last write: c moves. The flapping passes through the final set (a down, b up)
        // many times; a view holding c's new address has seen every flip before it.
        c.ip = IpAddr::from([10, 0, 1, 3]);
        put_slice(&server, "s", &ep, &[&a, &b, &c]);
        let settled = [b.instance(), c.instance()];
        let settled: Vec<&Instance> = settled.iter().collect();
        v1.until(&mut w1, &settled).await;
        v2.until(&mut w2, &settled).await;
        let mut late = View::default();
        late.until(&mut lagging, &settled).await;
        let mut ns_view = NsView::default();
        let (ib, ic) = (b.instance(), c.instance());
        ns_view
            .until(&mut ns_watch, &[(&ib, &b.card), (&ic, &c.card)])
            .await;
        for watch in [&mut w1, &mut w2, &mut lagging] {
            assert_quiet(watch).await;
        }
        assert_quiet(&mut ns_watch).await;
        assert_eq!(v1.instances, v2.instances);
        assert_eq!(v1.instances, late.instances);
        assert_eq!(first.list_instances(&ep).await.unwrap(), {
            let mut listed = vec![ib, ic];
            listed.sort_by_key(|i| i.instance_id);
            listed
        });
    })
    .await;
}
