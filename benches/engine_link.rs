//! The engine link's added latency: a prefill through `Dispatcher` + `EngineLink` (pick, body,
//! hyper's pooled client, parsing, the handoff kept verbatim) vs the raw HTTP round trip to the
//! same engine (hyper's pooled client, the same body, the answer read whole), interleaved in one
//! run against a stub engine on loopback that answers vLLM's prefill JSON at once.
//!
//! `cargo bench --features engine --bench engine_link -- --warm-up-time 1 --measurement-time 3`
//! (prints a table of p50/p99 per side first, then criterion's timings.)

use std::hint::black_box;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::Criterion;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use prefill_router::discovery::{EndpointId, Instance, InstanceEvent};
use prefill_router::engine::{EngineLink, EngineLinkConfig, EngineRole};
use prefill_router::push::{Dispatcher, PushConfig, PushMode, RoutableView};
use prefill_router::request::GenerateRequest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const ANSWER: &str = r#"{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"pe","finish_reason":"length","token_ids":[343]}],"usage":{"prompt_tokens":256,"total_tokens":257,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":0}},"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2,3,4,5,6,7,8]],"remote_engine_id":"d71bd04f-d4d0-4d6b-85e8-c7d6781e8499","remote_request_id":"cmpl-t1-0-90692388","remote_host":"127.0.0.1","remote_port":5600,"tp_size":1,"dcp_size":1,"pp_size":1,"remote_num_tokens":256,"remote_blocks_expiry_time":null,"transfer_mode":"pull","remote_prefill_cached_tokens":0}}"#;

/// A keep-alive HTTP/1.1 stub answering every request with [`ANSWER`].
async fn stub() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            socket.set_nodelay(true).unwrap();
            tokio::spawn(async move {
                let response = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{ANSWER}",
                    ANSWER.len()
                );
                let mut buffer = Vec::new();
                loop {
                    let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") else {
                        let mut chunk = [0u8; 8192];
                        match socket.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buffer.extend_from_slice(&chunk[..n]),
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&buffer[..end]).to_lowercase();
                    let length: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    while buffer.len() < end + 4 + length {
                        let mut chunk = [0u8; 8192];
                        match socket.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buffer.extend_from_slice(&chunk[..n]),
                        }
                    }
                    buffer.drain(..end + 4 + length);
                    if socket.write_all(response.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

fn request() -> GenerateRequest {
    let mut request = GenerateRequest::new((4..260).collect(), 16);
    request.engine_fields = Some(r#"{"temperature":0}"#.into());
    request
}

struct Sides {
    dispatcher: Dispatcher,
    raw: Client<HttpConnector, Full<Bytes>>,
    addr: SocketAddr,
    body: Bytes,
}

impl Sides {
    async fn through_link(&self) {
        let mut stream = self.dispatcher.generate(request()).await.unwrap();
        while let Some(item) = stream.next().await {
            black_box(item.unwrap());
        }
    }

    async fn raw(&self) {
        let req = hyper::Request::post(format!("http://{}/v1/completions", self.addr))
            .header("content-type", "application/json")
            .body(Full::new(self.body.clone()))
            .unwrap();
        let response = self.raw.request(req).await.unwrap();
        black_box(response.into_body().collect().await.unwrap().to_bytes());
    }
}

fn quantile(samples: &mut [Duration], q: f64) -> Duration {
    samples.sort();
    samples[((samples.len() - 1) as f64 * q) as usize]
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let sides = runtime.block_on(async {
        let addr = stub().await;
        let view = RoutableView::spawn_with(
            futures_util::stream::pending(),
            None,
            CancellationToken::new(),
            Default::default(),
        );
        view.apply(InstanceEvent::Added(Instance {
            endpoint: EndpointId::new("bench", "prefill", "generate"),
            instance_id: 1,
            address: addr,
        }));
        let link = EngineLink::new(EngineRole::Prefill, 32, EngineLinkConfig::default());
        let dispatcher =
            Dispatcher::with_engine(view, PushMode::RoundRobin, PushConfig::default(), link);
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let raw = Client::builder(TokioExecutor::new()).build(connector);
        // The body the link sends, so both sides move the same bytes.
        let body = Bytes::from(
            serde_json::json!({
                "temperature": 0, "prompt": (4..260).collect::<Vec<u32>>(), "max_tokens": 1,
                "stream": false, "return_token_ids": true,
                "kv_transfer_params": {"do_remote_decode": true}
            })
            .to_string(),
        );
        Sides {
            dispatcher,
            raw,
            addr,
            body,
        }
    });
    // The side-by-side table: interleaved, alternating which side goes first.
    let rounds = 4000;
    let (mut link, mut raw) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
    runtime.block_on(async {
        for _ in 0..200 {
            sides.through_link().await;
            sides.raw().await;
        }
        for i in 0..rounds {
            let time_link = || async {
                let t = Instant::now();
                sides.through_link().await;
                t.elapsed()
            };
            if i % 2 == 0 {
                link.push(time_link().await);
                let t = Instant::now();
                sides.raw().await;
                raw.push(t.elapsed());
            } else {
                let t = Instant::now();
                sides.raw().await;
                raw.push(t.elapsed());
                link.push(time_link().await);
            }
        }
    });
    let (l50, l99) = (quantile(&mut link, 0.5), quantile(&mut link, 0.99));
    let (r50, r99) = (quantile(&mut raw, 0.5), quantile(&mut raw, 0.99));
    println!("engine link vs raw HTTP round trip ({rounds} prefills each, interleaved):");
    println!("| side | p50 µs | p99 µs |");
    println!("|---|---|---|");
    println!(
        "| raw hyper POST + body | {:.1} | {:.1} |",
        r50.as_secs_f64() * 1e6,
        r99.as_secs_f64() * 1e6
    );
    println!(
        "| Dispatcher + EngineLink | {:.1} | {:.1} |",
        l50.as_secs_f64() * 1e6,
        l99.as_secs_f64() * 1e6
    );
    println!(
        "added p50: {:.1} µs ({:.2}x)",
        (l50.as_secs_f64() - r50.as_secs_f64()) * 1e6,
        l50.as_secs_f64() / r50.as_secs_f64()
    );
    let mut c = Criterion::default().configure_from_args();
    c.bench_function("engine_link/prefill_through_dispatcher", |b| {
        b.iter(|| runtime.block_on(sides.through_link()))
    });
    c.bench_function("engine_link/raw_http_round_trip", |b| {
        b.iter(|| runtime.block_on(sides.raw()))
    });
    c.final_summary();
}
