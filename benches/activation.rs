//! Activation latency: `set_target` (a new generation each time) until the router reports
//! Active, with an instant factory, against a bare tokio oneshot round trip (spawn a task that
//! answers on a oneshot, await the answer). Samples of the two paths are interleaved in one run
//! on one 2-worker runtime; median and p99 of each and their ratios are printed.
//!
//! `cargo bench --bench activation` (env `SAMPLES`, default 20000 per path)

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use prefill_router::advert::ModelCard;
use prefill_router::binding::{
    Binding, BindingFactory, BuildError, PrefillError, PrefillOutcome, WorkerSetTarget,
    WorkerSetTargetId,
};
use prefill_router::discovery::EndpointId;
use prefill_router::lifecycle::Lifecycle;
use prefill_router::request::GenerateRequest;
use prefill_router::router::{PrefillRouter, PrefillRouterConfig};
use tokio::sync::{oneshot, watch};
use tokio_util::sync::CancellationToken;

/// A binding that does nothing (only activation is measured).
struct Noop;

impl Binding for Noop {
    fn prefill(&self, _: GenerateRequest) -> BoxFuture<'_, Result<PrefillOutcome, PrefillError>> {
        Box::pin(async { Ok(PrefillOutcome::default()) })
    }
}

/// Builds at once.
struct Instant0;

impl BindingFactory for Instant0 {
    type Binding = Noop;

    fn build(
        &self,
        _: WorkerSetTarget,
        _: CancellationToken,
    ) -> BoxFuture<'static, Result<Noop, BuildError>> {
        Box::pin(async { Ok(Noop) })
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn main() {
    // Criterion-style flags (e.g. `--bench`) are accepted and ignored.
    let samples: usize = std::env::var("SAMPLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000);
    let warmup = samples / 10;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (activation, oneshot_rt) = runtime.block_on(async {
        let router = PrefillRouter::new(Instant0, PrefillRouterConfig::default());
        let mut lifecycle = router.subscribe();
        let endpoint = EndpointId::new("ns", "prefill", "generate");
        let card = Arc::new(ModelCard::named("m"));
        let (_admit, admitted) = watch::channel(BTreeSet::from([1u64]));
        let mut activation = Vec::with_capacity(samples);
        let mut oneshot_rt = Vec::with_capacity(samples);
        for i in 0..(warmup + samples) as u64 {
            // The router: a new generation each time, so every sample is a full build.
            let target = WorkerSetTarget::new(
                WorkerSetTargetId::new("ns/prefill", i + 1),
                endpoint.clone(),
                card.clone(),
                admitted.clone(),
            );
            let t0 = Instant::now();
            router.set_target(Some(target));
            lifecycle
                .wait_for(|l| *l == Lifecycle::Active)
                .await
                .expect("router alive");
            let a = t0.elapsed();

            // The baseline: one task spawned, one oneshot answered.
            let t0 = Instant::now();
            let (tx, rx) = oneshot::channel::<()>();
            tokio::spawn(async move {
                let _ = tx.send(());
            });
            rx.await.expect("answered");
            let b = t0.elapsed();

            if i as usize >= warmup {
                activation.push(a);
                oneshot_rt.push(b);
            }
        }
        let done = router.terminated();
        drop(router);
        done.await;
        (activation, oneshot_rt)
    });
    let mut activation = activation;
    let mut oneshot_rt = oneshot_rt;
    activation.sort();
    oneshot_rt.sort();
    let (a50, a99) = (percentile(&activation, 0.5), percentile(&activation, 0.99));
    let (b50, b99) = (percentile(&oneshot_rt, 0.5), percentile(&oneshot_rt, 0.99));
    println!("activation latency, {samples} interleaved samples per path (2-worker runtime)");
    println!("| path | median | p99 |");
    println!("|---|---|---|");
    println!("| set_target -> Active (instant factory) | {a50:?} | {a99:?} |");
    println!("| bare tokio oneshot round trip (spawn + answer) | {b50:?} | {b99:?} |");
    println!(
        "| **ratio** | **{:.2}x** | **{:.2}x** |",
        a50.as_secs_f64() / b50.as_secs_f64(),
        a99.as_secs_f64() / b99.as_secs_f64()
    );
}
