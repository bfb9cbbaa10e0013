//! The worker's readiness and liveness endpoint on Kubernetes (`worker --health-listen`): the
//! kubelet's probes are how a worker there registers and deregisters (docs/kubernetes.md,
//! "Workers on Kubernetes").
//!
//! Deliberately tiny, not an HTTP server: read the request line, write a fixed response, close.
//! `GET /ready` is 200 while serving and 503 once stopping, `GET /live` is 200 until exit,
//! anything else 404 (400 for a line that is not a request). Every read is bounded in size
//! ([`MAX_REQUEST_LINE`]) and time ([`READ_TIMEOUT`]), and at most [`MAX_CONNECTIONS`] are
//! served at once (more are closed unanswered), so a stalled or hostile client holds nothing
//! for long.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

/// Longest request line (and headers read with it) looked at; a client that sends more
/// without a line end is answered 400.
pub const MAX_REQUEST_LINE: usize = 1024;

/// How long a client may take to send its request line.
pub const READ_TIMEOUT: Duration = Duration::from_secs(2);

/// Most connections served at once (the kubelet makes one per probe).
pub const MAX_CONNECTIONS: usize = 64;

/// Whether the worker is ready: shared by the worker, which withdraws it on SIGTERM, and the
/// endpoint, which reports it.
#[derive(Clone, Debug)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    /// Ready.
    pub fn ready() -> Self {
        Readiness(Arc::new(AtomicBool::new(true)))
    }

    /// From now on `GET /ready` answers 503.
    pub fn withdraw(&self) {
        self.0.store(false, Ordering::SeqCst);
    }

    /// Whether `GET /ready` answers 200.
    pub fn is_ready(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// The endpoint, serving until dropped (its task is aborted then).
pub struct HealthServer {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl HealthServer {
    /// Serve `readiness` on `listener`.
    pub fn start(listener: TcpListener, readiness: Readiness) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let task = tokio::spawn(accept_loop(listener, readiness));
        Ok(HealthServer { addr, task })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for HealthServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept_loop(listener: TcpListener, readiness: Readiness) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                // E.g. out of file descriptors: pause rather than spin.
                tracing::warn!(%error, "health endpoint: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // Over the bound the connection is dropped unanswered: a probe then fails once,
        // which is better than a queue a flood could grow.
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            tracing::debug!("health endpoint: too many connections, one closed");
            continue;
        };
        let readiness = readiness.clone();
        tokio::spawn(async move {
            answer(stream, &readiness).await;
            drop(slot);
        });
    }
}

/// Read one request line (bounded) and write the fixed response; errors just close.
async fn answer(mut stream: TcpStream, readiness: &Readiness) {
    let mut buffer = [0u8; MAX_REQUEST_LINE];
    let mut filled = 0;
    let line_end = tokio::time::timeout(READ_TIMEOUT, async {
        while filled < buffer.len() {
            match stream.read(&mut buffer[filled..]).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => filled += n,
            }
            if let Some(end) = buffer[..filled].iter().position(|&b| b == b'\n') {
                return Some(end);
            }
        }
        None
    })
    .await;
    let response = match line_end {
        Err(_) => return, // stalled: close without a word
        Ok(None) if filled == 0 => return,
        Ok(None) => BAD_REQUEST,
        Ok(Some(end)) => respond(&buffer[..end], readiness),
    };
    let _ = tokio::time::timeout(READ_TIMEOUT, stream.write_all(response.as_bytes())).await;
    let _ = stream.shutdown().await;
}

/// The response to a request line (without its line end).
fn respond(line: &[u8], readiness: &Readiness) -> &'static str {
    let Ok(line) = std::str::from_utf8(line) else {
        return BAD_REQUEST;
    };
    let mut parts = line.trim_end_matches('\r').split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return BAD_REQUEST;
    };
    if !version.starts_with("HTTP/") {
        return BAD_REQUEST;
    }
    let path = target.split_once('?').map_or(target, |(path, _)| path);
    match (method, path) {
        ("GET", "/ready") if readiness.is_ready() => OK,
        ("GET", "/ready") => STOPPING,
        ("GET", "/live") => OK,
        _ => NOT_FOUND,
    }
}

const OK: &str = "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 3\r\nconnection: close\r\n\r\nok\n";
const STOPPING: &str = "HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 9\r\nconnection: close\r\n\r\nstopping\n";
const NOT_FOUND: &str = "HTTP/1.1 404 Not Found\r\ncontent-type: text/plain\r\ncontent-length: 10\r\nconnection: close\r\n\r\nnot found\n";
const BAD_REQUEST: &str = "HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\ncontent-length: 12\r\nconnection: close\r\n\r\nbad request\n";

#[cfg(test)]
mod tests {
    use super::*;

    async fn server() -> (HealthServer, Readiness) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let readiness = Readiness::ready();
        (
            HealthServer::start(listener, readiness.clone()).unwrap(),
            readiness,
        )
    }

    /// The response's status code to `request`, sent whole.
    async fn status(addr: SocketAddr, request: &[u8]) -> u16 {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(request).await.unwrap();
        let mut response = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut response))
            .await
            .expect("answered in time")
            .unwrap();
        let text = String::from_utf8(response).unwrap();
        assert!(text.contains("connection: close"), "{text}");
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(length, body.len(), "{text}");
        text[9..12].parse().unwrap()
    }

    fn get(path: &str) -> Vec<u8> {
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nUser-Agent: kube-probe/1.30\r\n\r\n")
            .into_bytes()
    }

    #[tokio::test]
    async fn readiness_flips_to_503_on_stop_while_liveness_stays_200() {
        let (server, readiness) = server().await;
        let addr = server.local_addr();
        assert_eq!(status(addr, &get("/ready")).await, 200);
        assert_eq!(status(addr, &get("/live")).await, 200);
        readiness.withdraw();
        assert_eq!(status(addr, &get("/ready")).await, 503);
        assert_eq!(status(addr, &get("/ready?verbose=1")).await, 503);
        assert_eq!(status(addr, &get("/live")).await, 200);
    }

    #[tokio::test]
    async fn other_paths_and_methods_are_404_and_garbage_is_400() {
        let (server, _readiness) = server().await;
        let addr = server.local_addr();
        for path in ["/", "/readyz", "/ready/", "/metrics"] {
            assert_eq!(status(addr, &get(path)).await, 404, "{path}");
        }
        assert_eq!(status(addr, b"POST /ready HTTP/1.1\r\n\r\n").await, 404);
        assert_eq!(status(addr, b"\x00\xff garbage\n").await, 400);
        assert_eq!(status(addr, b"GET /ready\r\n").await, 400);
        // Exactly the bound, so the server has read it all when it answers (a close with
        // unread bytes would reset the connection under the response).
        let long = vec![b'a'; MAX_REQUEST_LINE];
        assert_eq!(
            status(addr, &long).await,
            400,
            "a line longer than the bound"
        );
    }

    #[tokio::test]
    async fn the_endpoint_survives_a_stalled_client() {
        let (server, _readiness) = server().await;
        let addr = server.local_addr();
        // A client that sends half a line and stalls, and one that sends nothing.
        let mut stalled = TcpStream::connect(addr).await.unwrap();
        stalled.write_all(b"GET /rea").await.unwrap();
        let silent = TcpStream::connect(addr).await.unwrap();
        assert_eq!(
            status(addr, &get("/ready")).await,
            200,
            "others are answered meanwhile"
        );
        // The stalled one is closed after the read timeout, unanswered.
        let mut rest = Vec::new();
        let read = tokio::time::timeout(READ_TIMEOUT * 3, stalled.read_to_end(&mut rest)).await;
        assert!(
            matches!(read, Ok(Ok(0)) | Ok(Err(_))),
            "closed: {read:?} {rest:?}"
        );
        drop(silent);
        assert_eq!(status(addr, &get("/live")).await, 200);
    }
}
