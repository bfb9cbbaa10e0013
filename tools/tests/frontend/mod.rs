//! Shared parts of the process tests: `prefill-router worker` / `serve` processes on a file
//! store, their stdout events, and a tiny blocking HTTP/1.1 client (loopback only).
#![allow(dead_code)] // each test binary uses a different subset

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Bound on anything a test waits for (release builds on a busy 2-core box).
pub const WAIT: Duration = Duration::from_secs(20);

/// A process whose stdout lines are collected on a thread; killed when dropped.
pub struct Proc {
    pub name: String,
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    /// Its stderr lines, when spawned with [`Proc::spawn_with`] capturing them.
    stderr: Arc<Mutex<Vec<String>>>,
}

/// Collect `from`'s lines into a shared list on a thread.
fn collect_lines(from: impl Read + Send + 'static) -> Arc<Mutex<Vec<String>>> {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&lines);
    std::thread::spawn(move || {
        for line in BufReader::new(from).lines() {
            let Ok(line) = line else { break };
            sink.lock().unwrap().push(line);
        }
    });
    lines
}

impl Proc {
    pub fn spawn(name: &str, args: &[&str]) -> Proc {
        Proc::spawn_with(name, args, &[], false)
    }

    /// [`Proc::spawn`] with extra environment variables, its stderr collected (see
    /// [`Proc::stderr`]) instead of inherited when `capture_stderr`.
    pub fn spawn_with(
        name: &str,
        args: &[&str],
        env: &[(&str, &str)],
        capture_stderr: bool,
    ) -> Proc {
        // `PREFILL_ROUTER_BIN` runs the tests against another build (e.g. the previous
        // commit's, to see a test fail before its fix).
        let bin = std::env::var_os("PREFILL_ROUTER_BIN")
            .unwrap_or_else(|| env!("CARGO_BIN_EXE_prefill-router").into());
        let mut child = Command::new(bin)
            .args(args)
            // Hermetic: a key file named in the developer's environment would lock every
            // other test out of serve.
            .env_remove("PREFILL_ROUTER_API_KEYS_FILE")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(if capture_stderr {
                Stdio::piped()
            } else {
                Stdio::inherit()
            })
            .spawn()
            .unwrap_or_else(|e| panic!("{name} starts: {e}"));
        let lines = collect_lines(child.stdout.take().unwrap());
        let stderr = match child.stderr.take() {
            Some(err) => collect_lines(err),
            None => Arc::default(),
        };
        Proc {
            name: name.to_owned(),
            child,
            lines,
            stderr,
        }
    }

    /// The stderr lines collected so far (empty unless spawned capturing them).
    pub fn stderr(&self) -> Vec<String> {
        self.stderr.lock().unwrap().clone()
    }

    /// The first stdout line that parses as JSON with `event` = `event`, waiting at most WAIT.
    pub fn wait_event(&self, event: &str) -> serde_json::Value {
        self.wait_event_where(event, |_| true)
    }

    pub fn wait_event_where(
        &self,
        event: &str,
        mut pred: impl FnMut(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let deadline = Instant::now() + WAIT;
        loop {
            for line in self.lines.lock().unwrap().iter() {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(line) {
                    if v["event"] == event && pred(&v) {
                        return v;
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "{}: no `{event}` event within {WAIT:?}; stdout: {:?}",
                self.name,
                self.lines.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// How many `event` lines were printed so far.
    pub fn count_events(&self, event: &str) -> usize {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["event"] == event)
            .count()
    }

    /// Whether the process has exited (reaping it if so).
    pub fn has_exited(&mut self) -> bool {
        self.child.try_wait().unwrap().is_some()
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn signal(&self, signal: i32) {
        let pid = i32::try_from(self.child.id()).unwrap();
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(pid, signal);
        }
    }

    /// SIGTERM, then wait for the exit (bounded); the exit status.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        self.signal(libc::SIGTERM);
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "{} ignored SIGTERM", self.name);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, wait (bounded) for its `stopped` event and its exit: the exit status and that
    /// event.
    pub fn stop(mut self) -> (std::process::ExitStatus, serde_json::Value) {
        self.signal(libc::SIGTERM);
        let deadline = Instant::now() + WAIT;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "{} ignored SIGTERM", self.name);
            std::thread::sleep(Duration::from_millis(10));
        };
        (status, self.wait_event("stopped"))
    }

    /// SIGTERM, then wait for the exit (bounded by WAIT); the exit status and every stdout line
    /// printed (the reader thread is given a moment to catch up with the last ones).
    pub fn terminate_keeping_output(mut self) -> (std::process::ExitStatus, Vec<String>) {
        self.signal(libc::SIGTERM);
        let deadline = Instant::now() + WAIT;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "{} ignored SIGTERM", self.name);
            std::thread::sleep(Duration::from_millis(20));
        };
        std::thread::sleep(Duration::from_millis(200));
        let lines = self.lines.lock().unwrap().clone();
        (status, lines)
    }

    /// Wait for the process to exit on its own (bounded by WAIT); the exit status.
    pub fn wait_exit(mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "{} did not exit", self.name);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL and reap.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A discovery store (a file store in a fresh temporary directory, or a fresh key root on
/// etcd) and the processes started on it.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub namespace: String,
    /// `etcd://HOST:PORT` and a key root, when on etcd.
    etcd: Option<(String, String)>,
}

impl Cluster {
    pub fn new() -> Cluster {
        Cluster {
            dir: tempfile::tempdir().unwrap(),
            namespace: "procs".to_owned(),
            etcd: None,
        }
    }

    /// On etcd at `PREFILL_ETCD_ENDPOINT` (e.g. `http://127.0.0.1:2379`) under a fresh key
    /// root, or `None` (with a notice) when it is unset outside CI; in CI unset fails.
    pub fn on_etcd() -> Option<Cluster> {
        let endpoint = match std::env::var("PREFILL_ETCD_ENDPOINT") {
            Ok(e) if !e.is_empty() => e,
            _ => {
                assert!(
                    std::env::var_os("CI").is_none(),
                    "PREFILL_ETCD_ENDPOINT is not set in CI: source .ci/etcd.sh in .ci/run"
                );
                eprintln!("NOTICE: PREFILL_ETCD_ENDPOINT unset; skipping the etcd process test");
                return None;
            }
        };
        let host = endpoint
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_owned();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let root = format!("prefill-procs/{}-{nanos}/", std::process::id());
        Some(Cluster {
            etcd: Some((format!("etcd://{host}"), root)),
            ..Cluster::new()
        })
    }

    /// On the etcd cluster whose client URLs are `urls` (`http://HOST:PORT` each), every
    /// process given all of them (`etcd://H1:P1,H2:P2,...`), under a fresh key root.
    pub fn on_etcd_members(urls: &[String]) -> Cluster {
        let hosts: Vec<&str> = urls
            .iter()
            .map(|u| u.trim_start_matches("http://").trim_end_matches('/'))
            .collect();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let root = format!("prefill-procs/{}-{nanos}/", std::process::id());
        Cluster {
            etcd: Some((format!("etcd://{}", hosts.join(",")), root)),
            ..Cluster::new()
        }
    }

    /// The etcd key root, when on etcd.
    pub fn etcd_root(&self) -> Option<&str> {
        self.etcd.as_ref().map(|(_, root)| root.as_str())
    }

    pub fn store(&self) -> String {
        match &self.etcd {
            Some((spec, _)) => spec.clone(),
            None => format!("file://{}", self.dir.path().join("store").display()),
        }
    }

    fn store_args(&self) -> Vec<String> {
        let mut args = vec!["--discovery".to_owned(), self.store()];
        if let Some((_, root)) = &self.etcd {
            args.extend(["--etcd-root".to_owned(), root.clone()]);
        }
        args
    }

    /// A worker (`role` prefill or decode) with id `id`, waiting until it is ready.
    pub fn worker(&self, role: &str, id: u64, extra: &[&str]) -> Proc {
        let store = self.store_args();
        let id = id.to_string();
        let mut args = vec!["worker", "--role", role];
        args.extend(store.iter().map(String::as_str));
        args.extend([
            "--namespace",
            &self.namespace,
            "--id",
            &id,
            "--ttl-ms",
            "2000",
        ]);
        args.extend_from_slice(extra);
        let proc = Proc::spawn(&format!("{role} worker {id}"), &args);
        proc.wait_event("ready");
        proc
    }

    /// A frontend on a free loopback port; its address once it listens.
    pub fn serve(&self, extra: &[&str]) -> (Proc, SocketAddr) {
        self.serve_with(extra, &[], false)
    }

    /// The `serve` command line [`Cluster::serve`] runs, with `extra` after it.
    pub fn serve_args(&self, extra: &[&str]) -> Vec<String> {
        let mut args: Vec<String> = vec!["serve".to_owned()];
        args.extend(self.store_args());
        for a in [
            "--namespace",
            &self.namespace,
            "--listen",
            "127.0.0.1:0",
            "--ttl-ms",
            "2000",
            "--request-timeout-ms",
            "10000",
        ] {
            args.push(a.to_owned());
        }
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        args
    }

    /// [`Cluster::serve`] with extra environment variables, capturing its stderr if asked.
    pub fn serve_with(
        &self,
        extra: &[&str],
        env: &[(&str, &str)],
        capture_stderr: bool,
    ) -> (Proc, SocketAddr) {
        let args = self.serve_args(extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let proc = Proc::spawn_with("serve", &args, env, capture_stderr);
        let addr = proc.wait_event("listening")["addr"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        (proc, addr)
    }
}

/// One HTTP response.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    /// The `data:` payloads of an SSE body.
    pub fn events(&self) -> Vec<String> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(str::to_owned)
            .collect()
    }

    /// A streamed chat answer's content chunks, and whether it ended with `[DONE]`.
    pub fn chat_stream(&self) -> (usize, bool) {
        let events = self.events();
        let tokens = events
            .iter()
            .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
            .filter(|c| c["choices"][0]["delta"]["content"].is_string())
            .count();
        (tokens, events.last().map(String::as_str) == Some("[DONE]"))
    }
}

/// `clients` threads, each calling `one(client, n)` for its n-th request (from 1) until `stop`
/// is set; each thread's results in order.
pub fn clients_until<T: Send + 'static>(
    clients: usize,
    stop: &std::sync::Arc<std::sync::atomic::AtomicBool>,
    one: impl Fn(usize, usize) -> T + Clone + Send + 'static,
) -> Vec<std::thread::JoinHandle<Vec<T>>> {
    (0..clients)
        .map(|c| {
            let (stop, one) = (std::sync::Arc::clone(stop), one.clone());
            std::thread::spawn(move || {
                let mut outcomes = Vec::new();
                let mut n = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    n += 1;
                    outcomes.push(one(c, n));
                }
                outcomes
            })
        })
        .collect()
}

fn dechunk(raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = raw;
    while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
        let size_text = std::str::from_utf8(&rest[..eol]).unwrap_or("0");
        let size =
            usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16).unwrap_or(0);
        rest = &rest[eol + 2..];
        if size == 0 || rest.len() < size {
            out.extend_from_slice(&rest[..size.min(rest.len())]);
            break;
        }
        out.extend_from_slice(&rest[..size]);
        rest = rest.get(size + 2..).unwrap_or_default();
    }
    out
}

/// Send one request (`Connection: close`) and read the whole response, within WAIT.
pub fn request(addr: SocketAddr, method: &str, path: &str, body: Option<&[u8]>) -> Response {
    request_with(addr, method, path, body, &[])
}

/// [`request`] with extra request headers.
pub fn request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    headers: &[(&str, &str)],
) -> Response {
    let mut stream = TcpStream::connect_timeout(&addr, WAIT).expect("connect");
    stream.set_read_timeout(Some(WAIT)).unwrap();
    let body = body.unwrap_or_default();
    stream
        .write_all(request_head(addr, method, path, body.len(), headers).as_bytes())
        .unwrap();
    // A body over the server's limit may be refused before it is all sent.
    let _ = stream.write_all(body);
    let mut raw = Vec::new();
    stream
        .read_to_end(&mut raw)
        .unwrap_or_else(|e| panic!("{method} {path}: reading the response: {e}"));
    parse(&raw)
}

/// The head of a `Connection: close` request with a JSON body of `len` bytes.
pub fn request_head(
    addr: SocketAddr,
    method: &str,
    path: &str,
    len: usize,
    headers: &[(&str, &str)],
) -> String {
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n{extra}Connection: close\r\n\r\n"
    )
}

/// A response parsed from its raw bytes, or `None` when they hold no complete head.
pub fn try_parse(raw: &[u8]) -> Option<Response> {
    raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    Some(parse(raw))
}

fn parse(raw: &[u8]) -> Response {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no header end in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let rest = &raw[split + 4..];
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_vec()
    };
    Response {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

pub fn post(addr: SocketAddr, path: &str, body: &serde_json::Value) -> Response {
    request(addr, "POST", path, Some(body.to_string().as_bytes()))
}

pub fn get(addr: SocketAddr, path: &str) -> Response {
    request(addr, "GET", path, None)
}

/// Start a streaming request, read until `events` SSE events arrived, then drop the
/// connection (the client goes away mid-stream). Returns the events read.
pub fn stream_then_disconnect(
    addr: SocketAddr,
    path: &str,
    body: &serde_json::Value,
    events: usize,
) -> usize {
    let mut stream = TcpStream::connect_timeout(&addr, WAIT).expect("connect");
    stream.set_read_timeout(Some(WAIT)).unwrap();
    let body = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while count(&seen, b"data: ") < events {
        let n = stream.read(&mut buf).expect("reading the stream");
        assert!(
            n > 0,
            "stream ended early: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
    count(&seen, b"data: ")
}

fn count(haystack: &[u8], needle: &[u8]) -> usize {
    haystack
        .windows(needle.len())
        .filter(|w| *w == needle)
        .count()
}

/// Poll `check` until it holds, at most WAIT.
pub fn until(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// The sum of a counter's series (every label set) in a Prometheus text body.
pub fn counter_sum(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
