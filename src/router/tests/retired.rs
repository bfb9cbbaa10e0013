//! Retired bindings: usable by the requests that hold them; failing fast once their
//! admission set empties; counted while alive.

use std::collections::BTreeSet;
use std::time::Duration;

use tokio::sync::watch;

use super::fakes::{target, target_with, ScriptFactory};
use crate::binding::{Binding, PrefillError};
use crate::request::GenerateRequest;
use crate::router::{PrefillRouter, PrefillRouterConfig};
use crate::snapshot::Route;

#[tokio::test]
async fn retired_binding_serves_its_holders_and_fails_fast_once_admission_empties() {
    let (factory, log) = ScriptFactory::instant();
    let router = PrefillRouter::new(factory, PrefillRouterConfig::default());
    let (admit, admitted) = watch::channel(BTreeSet::from([3, 4]));
    router.set_target(Some(target_with(1, admitted)));
    router.wait_active(Duration::from_secs(5)).await.unwrap();
    let Route::Prefill(held) = router.route() else {
        panic!("not active")
    };

    // Generation 2 replaces it; the request holding generation 1 keeps a usable binding.
    router.set_target(Some(target(2)));
    router.wait_active(Duration::from_secs(5)).await.unwrap();
    assert_eq!(router.status().counters.retired_alive, 1);
    let one = GenerateRequest::new(vec![1], 1);
    assert_eq!(held.prefill(one.clone()).await.unwrap().worker, 3);

    // Its workers leave the admission set: new prefills on it fail at once, not at a timeout.
    admit.send_replace(BTreeSet::from([4]));
    assert_eq!(held.prefill(one.clone()).await.unwrap().worker, 4);
    admit.send_replace(BTreeSet::new());
    let failed = tokio::time::timeout(Duration::from_millis(100), held.prefill(one))
        .await
        .expect("fails promptly");
    assert_eq!(failed.unwrap_err(), PrefillError::NoRoutableWorker);

    drop(held);
    assert_eq!(router.status().counters.retired_alive, 0);
    assert_eq!(
        log.bindings_live.get(),
        1,
        "only generation 2's binding remains"
    );
}
