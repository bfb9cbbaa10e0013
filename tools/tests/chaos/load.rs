//! The steady streaming load of the chaos run, and the load balancer in front of the two
//! frontends: clients send only to a frontend whose `/ready` said 200 at the last poll (every
//! 50 ms), like a load balancer with a readiness probe. A connection refused (a frontend
//! between its exit and its restart) is re-sent to another frontend: nothing was sent, so it
//! is not a failed request. Anything else that is not a whole 200 stream is a failure: a
//! non-200, a stream cut after its headers, a reset after the request was sent, a missing
//! `[DONE]`, fewer tokens than asked for.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::frontend::{request_head, try_parse};

/// Tokens each streaming request asks for.
pub const TOKENS: u32 = 20;
/// Tokens of the long generations (about 1 s at the decode workers' 10 ms a token), which
/// the first LONG_CLIENTS clients ask for: a decode worker killed mid-stream holds several.
pub const LONG_TOKENS: u32 = 100;
/// How many of the clients send long generations.
pub const LONG_CLIENTS: usize = 2;
/// How often the balancer asks each frontend's `/ready`.
const PROBE_EVERY: Duration = Duration::from_millis(50);
/// Bound on one request (connect to last byte); serve's own deadline is shorter.
const REQUEST_BOUND: Duration = Duration::from_secs(40);

/// One frontend behind the balancer: its address while it runs, and its last `/ready`.
#[derive(Clone, Copy, Default)]
struct Slot {
    addr: Option<SocketAddr>,
    ready: bool,
}

/// The frontends the balancer sends to.
#[derive(Default)]
pub struct Balancer {
    slots: Mutex<Vec<Slot>>,
}

impl Balancer {
    pub fn new(frontends: usize) -> Balancer {
        Balancer {
            slots: Mutex::new(vec![Slot::default(); frontends]),
        }
    }

    /// Frontend `i` listens at `addr` (a restart takes a new port); it gets traffic once its
    /// `/ready` says 200.
    pub fn set(&self, i: usize, addr: Option<SocketAddr>) {
        self.slots.lock().unwrap()[i] = Slot { addr, ready: false };
    }

    /// Frontend `i`'s address, while it runs.
    pub fn addr(&self, i: usize) -> Option<SocketAddr> {
        self.slots.lock().unwrap()[i].addr
    }

    /// Whether frontend `i` gets traffic now.
    pub fn ready(&self, i: usize) -> bool {
        self.slots.lock().unwrap()[i].ready
    }

    /// A ready frontend other than `avoid`, round robin from `start`.
    fn pick(&self, start: usize, avoid: Option<usize>) -> Option<(usize, SocketAddr)> {
        let slots = self.slots.lock().unwrap();
        (0..slots.len())
            .map(|k| (start + k) % slots.len())
            .filter(|&i| Some(i) != avoid)
            .find_map(|i| slots[i].ready.then_some(i).zip(slots[i].addr))
    }

    fn mark_down(&self, i: usize, addr: SocketAddr) {
        let mut slots = self.slots.lock().unwrap();
        if slots[i].addr == Some(addr) {
            slots[i].ready = false;
        }
    }

    /// Probe every frontend's `/ready` once.
    fn probe(&self) {
        let addrs: Vec<Option<SocketAddr>> =
            self.slots.lock().unwrap().iter().map(|s| s.addr).collect();
        for (i, addr) in addrs.into_iter().enumerate() {
            let Some(addr) = addr else { continue };
            let ready = is_ready(addr);
            let mut slots = self.slots.lock().unwrap();
            if slots[i].addr == Some(addr) {
                slots[i].ready = ready;
            }
        }
    }
}

/// When a response's SSE events arrived: the first one (from the request's start), and the
/// longest wait between two (a stream that moved to another decode worker shows it there).
#[derive(Clone, Copy, Default)]
struct Timing {
    first_event: Option<Duration>,
    longest_gap: Duration,
}

/// Why a request went wrong.
enum Attempt {
    /// The connection was refused or never made: nothing was sent, re-send elsewhere.
    NotSent,
    /// Sent, and the response (status, SSE events) came back whole, with when its events came.
    Answered(crate::frontend::Response, Timing),
    /// Sent, and the exchange broke (reset, timeout, a head that never came).
    Broken(String),
}

/// Send one `Connection: close` request on `stream` and read to its end (bounded by
/// `bound`): the raw response and when its SSE events came.
fn exchange(
    mut stream: TcpStream,
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
    bound: Duration,
) -> std::io::Result<(Vec<u8>, Timing)> {
    let started = Instant::now();
    let mut timing = Timing::default();
    let (mut events, mut last_event) = (0, None::<Instant>);
    stream.set_read_timeout(Some(bound))?;
    stream.write_all(request_head(addr, method, path, body.len(), &[]).as_bytes())?;
    stream.write_all(body)?;
    let mut raw = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            return Ok((raw, timing));
        }
        raw.extend_from_slice(&buf[..n]);
        // Events so far (a read may end inside one: counted once whole, at the next read).
        let now_events = raw.windows(6).filter(|w| w == b"data: ").count();
        if now_events > events {
            let now = Instant::now();
            match last_event {
                None => timing.first_event = Some(started.elapsed()),
                Some(last) => timing.longest_gap = timing.longest_gap.max(now - last),
            }
            (events, last_event) = (now_events, Some(now));
        }
        if started.elapsed() > bound {
            return Err(std::io::Error::new(ErrorKind::TimedOut, "request bound"));
        }
    }
}

fn connect(addr: SocketAddr) -> std::io::Result<TcpStream> {
    TcpStream::connect_timeout(&addr, Duration::from_secs(2))
}

/// Whether `addr` answers `/ready` with 200.
fn is_ready(addr: SocketAddr) -> bool {
    connect(addr)
        .and_then(|s| exchange(s, addr, "GET", "/ready", b"", Duration::from_secs(2)))
        .is_ok_and(|(raw, _)| try_parse(&raw).is_some_and(|r| r.status == 200))
}

fn attempt(addr: SocketAddr, body: &[u8]) -> Attempt {
    // Refused (or no answer to the SYN): nothing of the request left this client.
    let Ok(stream) = connect(addr) else {
        return Attempt::NotSent;
    };
    match exchange(
        stream,
        addr,
        "POST",
        "/v1/chat/completions",
        body,
        REQUEST_BOUND,
    ) {
        Ok((raw, timing)) => match try_parse(&raw) {
            Some(response) => Attempt::Answered(response, timing),
            None => Attempt::Broken(format!(
                "no response head ({} bytes: {:?})",
                raw.len(),
                String::from_utf8_lossy(&raw)
            )),
        },
        Err(e) => Attempt::Broken(format!("{:?}: {e}", e.kind())),
    }
}

/// A completed request.
#[derive(Clone, Copy)]
pub struct Done {
    /// When it ended, from the start of the run.
    pub at: Duration,
    pub ttft: Duration,
    pub total: Duration,
    /// The longest wait between two of its events.
    pub longest_gap: Duration,
    /// A long generation (LONG_TOKENS).
    pub long: bool,
}

impl Done {
    /// Whether it was in flight at `t` (from the start of the run).
    pub fn spans(&self, t: Duration) -> bool {
        self.at
            .checked_sub(self.total)
            .is_some_and(|start| start <= t)
            && t <= self.at
    }
}

/// A failed request.
#[derive(Clone, Debug)]
#[allow(dead_code)] // read through Debug, in the assertion's message
pub struct Failure {
    pub at: Duration,
    pub frontend: usize,
    pub what: String,
}

/// Everything the clients saw.
#[derive(Default)]
pub struct Tally {
    pub done: Vec<Done>,
    pub failed: Vec<Failure>,
    /// Requests re-sent to the other frontend after a refused connection.
    pub resent: u64,
}

/// The clients and the prober; stopped (and joined) when dropped, so a panicking driver
/// does not leave them sending.
pub struct Load {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
    pub tally: Arc<Mutex<Tally>>,
    pub sent: Arc<AtomicU64>,
}

impl Load {
    /// `clients` streaming clients through `balancer`, times measured from `epoch`.
    pub fn start(balancer: Arc<Balancer>, clients: usize, epoch: Instant) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let tally = Arc::new(Mutex::new(Tally::default()));
        let sent = Arc::new(AtomicU64::new(0));
        let mut threads = Vec::new();
        {
            let (stop, balancer) = (Arc::clone(&stop), Arc::clone(&balancer));
            threads.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    balancer.probe();
                    std::thread::sleep(PROBE_EVERY);
                }
            }));
        }
        for c in 0..clients {
            let (stop, balancer) = (Arc::clone(&stop), Arc::clone(&balancer));
            let (tally, sent) = (Arc::clone(&tally), Arc::clone(&sent));
            threads.push(std::thread::spawn(move || {
                client(c, &stop, &balancer, &tally, &sent, epoch)
            }));
        }
        Load {
            stop,
            threads,
            tally,
            sent,
        }
    }

    /// Stop the clients after their current request; what they saw.
    pub fn finish(mut self) -> Tally {
        self.halt();
        std::mem::take(&mut *self.tally.lock().unwrap())
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }

    /// Requests completed so far.
    pub fn completed(&self) -> usize {
        self.tally.lock().unwrap().done.len()
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.halt();
    }
}

fn client(
    c: usize,
    stop: &AtomicBool,
    balancer: &Balancer,
    tally: &Mutex<Tally>,
    sent: &AtomicU64,
    epoch: Instant,
) {
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let content = format!("client {c} request {n}: a prompt of a few words");
        let long = c < LONG_CLIENTS;
        let max_tokens = if long { LONG_TOKENS } else { TOKENS };
        let body = serde_json::json!({
            "model": "mock-llm",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "stream": true,
        })
        .to_string();
        let expected = expected_text(&content, max_tokens);
        let started = Instant::now();
        let mut avoid = None;
        // Bounded: a request that finds no frontend for REQUEST_BOUND is a failure.
        let outcome = loop {
            if started.elapsed() > REQUEST_BOUND {
                break Err((usize::MAX, "no ready frontend".to_owned()));
            }
            let Some((i, addr)) = balancer
                .pick(c + n as usize, avoid)
                .or_else(|| balancer.pick(c, None))
            else {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            };
            sent.fetch_add(1, Ordering::Relaxed);
            match attempt(addr, body.as_bytes()) {
                Attempt::NotSent => {
                    balancer.mark_down(i, addr);
                    avoid = Some(i);
                    tally.lock().unwrap().resent += 1;
                }
                Attempt::Answered(r, timing) => {
                    break check(&r, max_tokens, &expected)
                        .map(|()| timing)
                        .map_err(|e| (i, e))
                }
                Attempt::Broken(e) => break Err((i, e)),
            }
        };
        let at = epoch.elapsed();
        let mut tally = tally.lock().unwrap();
        match outcome {
            Ok(timing) => tally.done.push(Done {
                at,
                ttft: timing.first_event.unwrap_or_default(),
                total: started.elapsed(),
                longest_gap: timing.longest_gap,
                long,
            }),
            Err((frontend, what)) => {
                eprintln!(
                    "FAILED t={:.1}s client {c} frontend {frontend}: {what}",
                    at.as_secs_f64()
                );
                tally.failed.push(Failure { at, frontend, what });
            }
        }
    }
}

/// The text of an uninterrupted answer to the chat message `content`: serve's word tokenizer
/// gives the prompt's length, the mock decode workers' tokens are a function of the position
/// (`mock::output_token`), and serve renders each as a word. A stream that moved to another
/// decode worker mid-way must come out exactly so: no token missing, none twice.
fn expected_text(content: &str, max_tokens: u32) -> String {
    use prefill_router::http::tokenizer::{chat_prompt, render, tokenize, Turn};
    let prompt = tokenize(&chat_prompt([Turn {
        role: "user",
        content,
    }]));
    (0..max_tokens)
        .map(|i| render(prefill_router_tools::mock::output_token(prompt.len(), i)))
        .collect()
}

/// A whole stream: 200, `max_tokens` content chunks whose text is `expected`, `[DONE]` last.
fn check(r: &crate::frontend::Response, max_tokens: u32, expected: &str) -> Result<(), String> {
    if r.status != 200 {
        return Err(format!("status {}: {}", r.status, r.body));
    }
    let (tokens, done) = r.chat_stream();
    if !done || tokens != max_tokens as usize {
        return Err(format!(
            "stream cut: {tokens} tokens, last event {:?}",
            r.events().last()
        ));
    }
    let text: String = r
        .events()
        .iter()
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    if text != expected {
        return Err(format!(
            "text differs from an uninterrupted run's: {text:?}"
        ));
    }
    Ok(())
}

/// `q` quantile of `xs` (sorted here), in milliseconds.
pub fn quantile_ms(xs: &mut [Duration], q: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_unstable();
    let k = ((xs.len() - 1) as f64 * q).round() as usize;
    xs[k].as_secs_f64() * 1e3
}
