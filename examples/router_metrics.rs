//! Serve a `PrefillRouter`'s Prometheus metrics over HTTP on 127.0.0.1.
//!
//! A router with a stand-in factory (builds take 50 ms, every fifth build fails) is retargeted
//! every second and takes a trickle of requests, so every metric moves. Scrape it with
//! `curl http://127.0.0.1:9464/metrics`.
//!
//! `cargo run --example router_metrics -- [--port 9464] [--seconds N]` (N = 0: run until
//! killed; default 0)

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use prefill_router::advert::ModelCard;
use prefill_router::binding::{
    Binding, BindingFactory, BuildError, PrefillError, PrefillOutcome, WorkerSetTarget,
    WorkerSetTargetId,
};
use prefill_router::decode::{Decode, DecodeError, DecodeStream};
use prefill_router::discovery::EndpointId;
use prefill_router::request::{FinishReason, GenerateRequest, GenerateResponse};
use prefill_router::router::{PrefillRouter, PrefillRouterConfig};
use prometheus_client::encoding::text::encode;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// A binding that answers every prefill from instance 1.
struct StandIn;

impl Binding for StandIn {
    fn prefill(&self, _: GenerateRequest) -> BoxFuture<'_, Result<PrefillOutcome, PrefillError>> {
        Box::pin(async {
            Ok(PrefillOutcome {
                worker: 1,
                tokens: vec![0],
                finish: Some(FinishReason::Length),
                handoff: None,
            })
        })
    }
}

/// Builds take 50 ms; every fifth fails.
#[derive(Default)]
struct Flaky {
    builds: AtomicU64,
}

impl BindingFactory for Flaky {
    type Binding = StandIn;

    fn build(
        &self,
        _: WorkerSetTarget,
        _: CancellationToken,
    ) -> BoxFuture<'static, Result<StandIn, BuildError>> {
        let n = self.builds.fetch_add(1, Ordering::Relaxed);
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if n % 5 == 4 {
                Err(BuildError::new("stand-in failure"))
            } else {
                Ok(StandIn)
            }
        })
    }
}

/// A decode hop that answers one token.
struct Echo;

impl Decode for Echo {
    fn decode(
        &self,
        _: GenerateRequest,
        _: Option<PrefillOutcome>,
    ) -> BoxFuture<'_, Result<DecodeStream, DecodeError>> {
        Box::pin(async {
            let response = GenerateResponse {
                text: None,
                usage: None,
                token_ids: vec![1],
                finish: Some(FinishReason::Length),
                prefill: None,
            };
            let stream: DecodeStream = Box::pin(futures_util::stream::iter([Ok(response)]));
            Ok(stream)
        })
    }
}

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn serve_metrics(listener: TcpListener, registry: Arc<Registry>) {
    loop {
        let Ok((mut socket, _)) = listener.accept().await else {
            continue;
        };
        let registry = registry.clone();
        tokio::spawn(async move {
            // One request per connection; the request itself is not parsed beyond reading it.
            let mut buf = [0u8; 1024];
            let _ = tokio::time::timeout(Duration::from_secs(1), socket.read(&mut buf)).await;
            let mut body = String::new();
            let status = match encode(&mut body, &registry) {
                Ok(()) => "200 OK",
                Err(_) => "500 Internal Server Error",
            };
            let head = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = socket.write_all(head.as_bytes()).await;
            let _ = socket.write_all(body.as_bytes()).await;
        });
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> std::io::Result<()> {
    let port = arg("--port", 9464) as u16;
    let seconds = arg("--seconds", 0);
    let config = PrefillRouterConfig {
        name: "demo-model".into(),
        retry: prefill_router::lifecycle::RetryPolicy::fixed(Duration::from_millis(200)),
        ..PrefillRouterConfig::default()
    };
    let router = Arc::new(PrefillRouter::new(Flaky::default(), config));
    let mut registry = Registry::default();
    router.register_metrics(&mut registry);
    let listener = TcpListener::bind(("127.0.0.1", port)).await?;
    println!(
        "serving metrics on http://{}/metrics",
        listener.local_addr()?
    );
    tokio::spawn(serve_metrics(listener, Arc::new(registry)));

    // Traffic: a request every 10 ms.
    let traffic = router.clone();
    tokio::spawn(async move {
        loop {
            let _ = traffic
                .generate(GenerateRequest::new(vec![1, 2, 3], 4), &Echo)
                .await;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });

    // The controller: a new generation every second, a clear every fourth.
    let (_admit, admitted) = watch::channel(BTreeSet::from([1u64]));
    let started = tokio::time::Instant::now();
    for generation in 1u64.. {
        if seconds > 0 && started.elapsed() >= Duration::from_secs(seconds) {
            break;
        }
        let target = (generation % 4 != 0).then(|| {
            WorkerSetTarget::new(
                WorkerSetTargetId::new("demo/prefill", generation),
                EndpointId::new("demo", "prefill", "generate"),
                Arc::new(ModelCard::named("demo-model")),
                admitted.clone(),
            )
        });
        router.set_target(target);
        tokio::time::sleep(Duration::from_secs(1)).await;
        println!("{:?}", router.status().lifecycle);
    }
    router.shutdown();
    Ok(())
}
