//! The engine wrapper that reports requests cancelled before their end (and, with
//! `--print-requests`, each request as it starts).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use prefill_router::discovery::InstanceId;
use prefill_router::request::{GenerateRequest, GenerateResponse};
use prefill_router::transport::{Engine, EngineError, EngineStream};

/// An engine whose streams report being dropped before their end (a Cancel from the caller,
/// a deadline, or the connection closing).
pub struct Watched {
    /// The engine watched.
    pub inner: Arc<dyn Engine>,
    /// The worker's id, in the printed events.
    pub id: InstanceId,
    /// Requests cancelled so far.
    pub cancelled: Arc<AtomicU64>,
    /// Requests started, when each is printed (`--print-requests`).
    pub started: Option<Arc<AtomicU64>>,
}

impl Engine for Watched {
    fn prefill_work(&self, request: &GenerateRequest) -> u64 {
        self.inner.prefill_work(request)
    }

    fn generate(&self, request: GenerateRequest) -> EngineStream {
        if let Some(started) = &self.started {
            let total = started.fetch_add(1, Ordering::Relaxed) + 1;
            println!(
                "{}",
                serde_json::json!({"event": "request", "id": self.id, "total": total})
            );
        }
        Box::pin(WatchedStream {
            inner: self.inner.generate(request),
            id: self.id,
            ended: false,
            cancelled: Arc::clone(&self.cancelled),
        })
    }
}

struct WatchedStream {
    inner: EngineStream,
    id: InstanceId,
    ended: bool,
    cancelled: Arc<AtomicU64>,
}

impl futures_core::Stream for WatchedStream {
    type Item = Result<GenerateResponse, EngineError>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let polled = self.inner.as_mut().poll_next(cx);
        if let std::task::Poll::Ready(item) = &polled {
            match item {
                None | Some(Err(_)) => self.ended = true,
                Some(Ok(response)) if response.finish.is_some() => self.ended = true,
                Some(Ok(_)) => {}
            }
        }
        polled
    }
}

impl Drop for WatchedStream {
    fn drop(&mut self) {
        if !self.ended {
            let total = self.cancelled.fetch_add(1, Ordering::Relaxed) + 1;
            println!(
                "{}",
                serde_json::json!({"event": "cancelled", "id": self.id, "total": total})
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures_util::StreamExt;
    use prefill_router_tools::mock::{MockConfig, MockDecode};

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_stream_dropped_before_its_end_counts_as_cancelled() {
        let mock = MockConfig {
            token_interval: Duration::from_millis(1),
            ..MockConfig::default()
        };
        let cancelled = Arc::new(AtomicU64::new(0));
        let engine = Watched {
            inner: MockDecode::new(1, mock),
            id: 1,
            cancelled: Arc::clone(&cancelled),
            started: None,
        };
        let whole: Vec<_> = engine
            .generate(GenerateRequest::new(vec![1, 2, 3], 3))
            .collect()
            .await;
        assert_eq!(whole.len(), 3);
        assert_eq!(
            cancelled.load(Ordering::Relaxed),
            0,
            "finished streams are not"
        );
        let mut partial = engine.generate(GenerateRequest::new(vec![1, 2, 3], 10));
        partial.next().await.unwrap().unwrap();
        drop(partial);
        assert_eq!(cancelled.load(Ordering::Relaxed), 1);
    }
}
