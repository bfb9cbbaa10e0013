//! A stub engine on loopback: `/health`, `/v1/models` and `/metrics` answered as the test
//! says, changeable while it runs (an engine going unhealthy, silent, or talking junk).
//!
//! Blocking threads, one per connection, so the same stub serves the in-process loop tests
//! (on their own tokio runtime) and the sidecar process tests.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How the stub answers one path.
#[derive(Clone, Debug)]
pub enum Reply {
    /// 200 with this body and a Content-Length; the connection is then held open for a
    /// while, so a client must stop at the Content-Length rather than wait for the close.
    Ok(Vec<u8>),
    /// 200 with this body in chunked encoding, then close.
    Chunked(Vec<u8>),
    /// This status with an empty body, then close.
    Status(u16),
    /// Read the request and answer nothing (the connection held open for a while).
    Silent,
    /// These bytes as the whole answer, then close.
    Raw(Vec<u8>),
}

/// How long `Ok` and `Silent` keep a connection open after answering (or not).
const HOLD: Duration = Duration::from_secs(2);

/// vLLM 0.32's model listing for `model`.
pub fn models_body(model: &str) -> Vec<u8> {
    serde_json::json!({
        "object": "list",
        "data": [{"id": model, "object": "model", "owned_by": "vllm", "max_model_len": 1024}],
    })
    .to_string()
    .into_bytes()
}

/// A `/metrics` page with vLLM 0.32's cache config line for `block_size` (look-alike labels
/// around the real one, as vLLM has them).
pub fn metrics_body(block_size: u32) -> Vec<u8> {
    format!(
        "# HELP vllm:num_requests_running Number of requests.\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"stub\"}} 0.0\n\
         # HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
         # TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{{_block_size_resolved=\"True\",mamba_block_size=\"None\",block_size=\"{block_size}\",cache_dtype=\"auto\",hash_block_size=\"None\",effective_attention_block_size=\"16\"}} 1.0\n"
    )
    .into_bytes()
}

/// A running stub engine; stops accepting when dropped.
pub struct StubEngine {
    addr: SocketAddr,
    replies: Arc<Mutex<HashMap<&'static str, Reply>>>,
    hits: Arc<Mutex<HashMap<String, usize>>>,
    stopped: Arc<AtomicBool>,
}

impl StubEngine {
    /// A healthy engine serving `model` with KV blocks of `block_size` tokens.
    pub fn start(model: &str, block_size: u32) -> StubEngine {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let replies = Arc::new(Mutex::new(HashMap::from([
            ("/health", Reply::Status(200)),
            ("/v1/models", Reply::Chunked(models_body(model))),
            ("/metrics", Reply::Ok(metrics_body(block_size))),
        ])));
        let hits = Arc::new(Mutex::new(HashMap::new()));
        let stopped = Arc::new(AtomicBool::new(false));
        let (r, h, s) = (replies.clone(), hits.clone(), stopped.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                if s.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                let (r, h) = (r.clone(), h.clone());
                std::thread::spawn(move || answer(stream, &r, &h));
            }
        });
        StubEngine {
            addr,
            replies,
            hits,
            stopped,
        }
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Answer `path` with `reply` from now on.
    pub fn set(&self, path: &'static str, reply: Reply) {
        self.replies.lock().unwrap().insert(path, reply);
    }

    /// How many requests for `path` arrived.
    pub fn hits(&self, path: &str) -> usize {
        self.hits.lock().unwrap().get(path).copied().unwrap_or(0)
    }
}

impl Drop for StubEngine {
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::Relaxed);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

/// Read one request's head (bounded) and answer it as configured.
fn answer(
    mut stream: TcpStream,
    replies: &Mutex<HashMap<&'static str, Reply>>,
    hits: &Mutex<HashMap<String, usize>>,
) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let mut head = Vec::new();
    let mut byte = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
        match stream.read(&mut byte) {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&byte[..n]),
        }
    }
    let text = String::from_utf8_lossy(&head);
    let path = text.split_whitespace().nth(1).unwrap_or("").to_owned();
    *hits.lock().unwrap().entry(path.clone()).or_default() += 1;
    let reply = replies
        .lock()
        .unwrap()
        .get(path.as_str())
        .cloned()
        .unwrap_or(Reply::Status(404));
    match reply {
        Reply::Ok(body) => {
            let _ = stream.write_all(
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n",
                    body.len()
                )
                .as_bytes(),
            );
            let _ = stream.write_all(&body);
            let _ = stream.flush();
            std::thread::sleep(HOLD);
        }
        Reply::Chunked(body) => {
            let mut out =
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
                    .to_vec();
            for piece in body.chunks(7) {
                out.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
                out.extend_from_slice(piece);
                out.extend_from_slice(b"\r\n");
            }
            out.extend_from_slice(b"0\r\n\r\n");
            let _ = stream.write_all(&out);
        }
        Reply::Status(status) => {
            let _ = stream.write_all(
                format!("HTTP/1.1 {status} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    .as_bytes(),
            );
        }
        Reply::Silent => std::thread::sleep(HOLD),
        Reply::Raw(bytes) => {
            let _ = stream.write_all(&bytes);
        }
    }
}
