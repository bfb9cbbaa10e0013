//! Slowloris against `prefill-router serve` (issue #27): normal streaming clients with and
//! without 1,000 connections that stall mid-request, side by side in one run.
//!
//! One `serve` process and four worker processes (2 prefill, 2 decode) on a file store. Rounds
//! alternate two phases of equal length, so drift on a shared box hits both alike:
//!
//! - `calm`: `--clients` normal clients, each in a loop: a streaming chat completion
//!   (`max_tokens` 24) on a new connection, read to `[DONE]`; time to first token and to the end
//!   recorded;
//! - `stalled`: the same clients while `--stalled` more connections stall mid-request, half
//!   after part of their headers, half after their headers and part of their body. Each stalled
//!   connection that serve closes is opened again at once (a persistent attacker), so the count
//!   stays at `--stalled` for the whole phase.
//!
//! Reported: the normal clients' TTFT and total p50/p99 per phase (and the p99 ratio, stalled
//! over calm), failures (status not 200 or no `[DONE]`), how long after its last byte each
//! stalled connection was closed (against serve's header/body timeout), and serve's resident
//! memory: the peak of each phase (sampled every 50 ms) and the kernel's high-water mark.
//!
//! `cargo bench -p prefill-router-tools --bench slow_clients -- [--secs S] [--rounds N] [--clients C]
//! [--stalled K] [--timeout-ms T] [--svg PATH]` (defaults: 6 s phases, 3 rounds, 16 clients,
//! 1,000 stalled, 2,000 ms header and body timeouts).

#[path = "support/args.rs"]
mod args;
#[path = "../tests/frontend/mod.rs"]
mod frontend;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use args::{arg, num};
use frontend::{Cluster, Proc, WAIT};

/// One normal request's outcome.
#[derive(Clone, Copy)]
struct Sample {
    ttft: Duration,
    total: Duration,
}

/// A streaming chat completion on a new connection, read to `[DONE]`; `None` on any failure.
fn stream_once(addr: SocketAddr, n: u64) -> Option<Sample> {
    let body = format!(
        r#"{{"model":"mock-llm","messages":[{{"role":"user","content":"client {n}: tell me about the prefill hop"}}],"max_tokens":24,"stream":true}}"#
    );
    let started = Instant::now();
    let mut stream = TcpStream::connect_timeout(&addr, WAIT).ok()?;
    stream.set_read_timeout(Some(WAIT)).ok()?;
    stream.set_nodelay(true).ok()?;
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(head.as_bytes()).ok()?;
    let mut seen = Vec::new();
    let mut buf = [0u8; 8192];
    let mut ttft = None;
    loop {
        let read = stream.read(&mut buf).ok()?;
        if read == 0 {
            break;
        }
        seen.extend_from_slice(&buf[..read]);
        if ttft.is_none() && contains(&seen, b"\"content\"") {
            ttft = Some(started.elapsed());
        }
        if contains(&seen, b"data: [DONE]") {
            break;
        }
    }
    let ok = seen.starts_with(b"HTTP/1.1 200") && contains(&seen, b"data: [DONE]");
    ok.then(|| Sample {
        ttft: ttft.unwrap_or_else(|| started.elapsed()),
        total: started.elapsed(),
    })
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// A connection that sent part of a request and then says nothing more.
struct Stalled {
    stream: TcpStream,
    last_byte: Instant,
}

fn open_stalled(addr: SocketAddr, k: usize) -> Option<Stalled> {
    let mut stream = TcpStream::connect_timeout(&addr, WAIT).ok()?;
    // Alternate the two shapes: part of the headers; the headers and part of the body.
    let bytes: &[u8] = if k % 2 == 0 {
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty"
    } else {
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n{\"model\":\"mock-llm\",\"mess"
    };
    stream.write_all(bytes).ok()?;
    stream.set_nonblocking(true).ok()?;
    Some(Stalled {
        stream,
        last_byte: Instant::now(),
    })
}

/// Whether serve has closed `stalled` (EOF or reset), draining whatever it said first (a 408).
fn closed_by_server(stalled: &mut Stalled) -> bool {
    let mut buf = [0u8; 1024];
    loop {
        match stalled.stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}

/// The attacker: keeps `count` stalled connections open until `stop`, reopening each one serve
/// closes; how long after its last byte each was closed.
fn attack(addr: SocketAddr, count: usize, stop: Arc<AtomicBool>) -> (Vec<Duration>, usize) {
    let mut open: Vec<Stalled> = Vec::with_capacity(count);
    let mut closed_after = Vec::new();
    let mut failed_opens = 0;
    let mut k = 0;
    while !stop.load(Ordering::Relaxed) {
        while open.len() < count && !stop.load(Ordering::Relaxed) {
            k += 1;
            match open_stalled(addr, k) {
                Some(s) => open.push(s),
                None => {
                    failed_opens += 1;
                    break;
                }
            }
        }
        // poll(2) over every stalled socket: readable means a 408 or a close has arrived.
        let mut fds: Vec<libc::pollfd> = open
            .iter()
            .map(|s| libc::pollfd {
                fd: s.stream.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        // SAFETY: `fds` is a valid, exclusively borrowed array of `fds.len()` pollfds.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 50) };
        if ready <= 0 {
            continue;
        }
        let now = Instant::now();
        let mut index = 0;
        open.retain_mut(|s| {
            let signalled = fds[index].revents != 0;
            index += 1;
            if signalled && closed_by_server(s) {
                closed_after.push(now - s.last_byte);
                false
            } else {
                true
            }
        });
    }
    (closed_after, failed_opens)
}

/// Resident memory of `pid` in KiB (`VmRSS`, or `VmHWM` for the peak since it started).
fn memory_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with(field))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// What one phase saw.
#[derive(Default)]
struct Phase {
    samples: Vec<Sample>,
    failures: u64,
    closed_after: Vec<Duration>,
    failed_opens: usize,
    peak_rss_kib: u64,
}

fn run_phase(addr: SocketAddr, pid: u32, clients: u64, stalled: usize, secs: Duration) -> Phase {
    let stop = Arc::new(AtomicBool::new(false));
    let attacker = (stalled > 0).then(|| {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || attack(addr, stalled, stop))
    });
    // Let the attacker reach its count before the clients are measured.
    if stalled > 0 {
        std::thread::sleep(Duration::from_millis(500));
    }
    let results = Arc::new(Mutex::new((Vec::new(), 0u64)));
    let measuring = Arc::new(AtomicBool::new(true));
    let workers: Vec<_> = (0..clients)
        .map(|c| {
            let (results, measuring) = (Arc::clone(&results), Arc::clone(&measuring));
            std::thread::spawn(move || {
                let mut n = c * 1_000_000;
                while measuring.load(Ordering::Relaxed) {
                    n += 1;
                    let got = stream_once(addr, n);
                    let mut r = results.lock().unwrap();
                    match got {
                        Some(s) => r.0.push(s),
                        None => r.1 += 1,
                    }
                }
            })
        })
        .collect();
    let mut peak = 0;
    let until = Instant::now() + secs;
    while Instant::now() < until {
        peak = peak.max(memory_kib(pid, "VmRSS:").unwrap_or(0));
        std::thread::sleep(Duration::from_millis(50));
    }
    measuring.store(false, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let (closed_after, failed_opens) = attacker.map_or((Vec::new(), 0), |a| a.join().unwrap());
    // The attacker's last connections close with it: let serve settle so that work is not
    // billed to the next phase.
    if stalled > 0 {
        std::thread::sleep(Duration::from_secs(1));
    }
    let (samples, failures) = std::mem::take(&mut *results.lock().unwrap());
    Phase {
        samples,
        failures,
        closed_after,
        failed_opens,
        peak_rss_kib: peak,
    }
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Raise the soft open-files limit to the hard one: 1,000 stalled sockets on each side of
/// loopback exceed the common default of 1,024 (children inherit the limit).
fn raise_fd_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: get/setrlimit with a valid, exclusively borrowed struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

/// Latency CDFs (total time of the normal clients' requests), calm vs stalled.
fn svg(calm: &[Duration], stalled: &[Duration], clients: u64, count: usize) -> String {
    use std::fmt::Write;
    let (w, h, pad) = (520.0, 300.0, 60.0);
    let hi = calm
        .last()
        .into_iter()
        .chain(stalled.last())
        .map(|d| ms(*d))
        .fold(1.0, f64::max)
        * 1.05;
    let x = |v: f64| pad + v / hi * w;
    let y = |p: f64| pad + (1.0 - p) * h;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0}\" height=\"{:.0}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{pad}\" y=\"25\" font-size=\"14\">Streaming request time, {clients} normal clients, with and without {count} stalled connections</text>",
        w + 2.0 * pad,
        h + 2.0 * pad + 50.0
    );
    let _ = writeln!(
        out,
        "<rect x=\"{pad}\" y=\"{pad}\" width=\"{w}\" height=\"{h}\" fill=\"none\" stroke=\"#999\"/>"
    );
    let step = (hi / 5.0).max(1.0).round();
    let mut tick = 0.0;
    while tick <= hi {
        let xv = x(tick);
        let _ = writeln!(
            out,
            "<line x1=\"{xv:.1}\" y1=\"{pad}\" x2=\"{xv:.1}\" y2=\"{:.1}\" stroke=\"#eee\"/><text x=\"{xv:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{tick:.0} ms</text>",
            pad + h,
            pad + h + 15.0
        );
        tick += step;
    }
    for p in [0.0, 0.5, 0.9, 0.99, 1.0] {
        let _ = writeln!(
            out,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{p}</text>",
            pad - 5.0,
            y(p) + 4.0
        );
    }
    for (i, (label, data, colour)) in [
        ("calm", calm, "#1f77b4"),
        ("stalled connections open", stalled, "#d62728"),
    ]
    .iter()
    .enumerate()
    {
        let points: String = data
            .iter()
            .enumerate()
            .step_by((data.len() / 400).max(1))
            .map(|(k, d)| {
                format!(
                    "{:.1},{:.1} ",
                    x(ms(*d)),
                    y((k + 1) as f64 / data.len() as f64)
                )
            })
            .collect();
        let _ = writeln!(
            out,
            "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"2\" points=\"{points}\"/>"
        );
        let ly = pad + h + 35.0 + 15.0 * i as f64;
        let _ = writeln!(
            out,
            "<line x1=\"{pad}\" y1=\"{ly}\" x2=\"{:.0}\" y2=\"{ly}\" stroke=\"{colour}\" stroke-width=\"2\"/><text x=\"{:.0}\" y=\"{:.0}\">{label} (p99 {:.0} ms)</text>",
            pad + 25.0,
            pad + 30.0,
            ly + 4.0,
            ms(quantile(data, 0.99))
        );
    }
    out.push_str("</svg>\n");
    out
}

fn main() {
    let secs = Duration::from_secs(num("--secs", 6));
    let rounds = num("--rounds", 3);
    let clients = num("--clients", 16);
    let stalled = num("--stalled", 1000) as usize;
    let timeout = num("--timeout-ms", 2000).to_string();
    raise_fd_limit();

    let cluster = Cluster::new();
    let _workers: Vec<Proc> = vec![
        cluster.worker("prefill", 1, &[]),
        cluster.worker("prefill", 2, &[]),
        cluster.worker("decode", 101, &[]),
        cluster.worker("decode", 102, &[]),
    ];
    let (serve, addr) = cluster.serve(&[
        "--header-timeout-ms",
        &timeout,
        "--body-timeout-ms",
        &timeout,
        "--max-connections",
        "1100",
    ]);
    let pid = serve.pid();
    frontend::until("a first answer", || stream_once(addr, 0).is_some());

    println!(
        "slow clients: {clients} normal streaming clients; {stalled} stalled connections in the \
         stalled phase; header/body timeout {timeout} ms; {rounds} rounds of 2 x {} s",
        secs.as_secs()
    );
    println!(
        "{:<8} {:<8} {:>9} {:>6} {:>10} {:>10} {:>10} {:>10} {:>8} {:>10}",
        "round",
        "phase",
        "requests",
        "fail",
        "ttft p50",
        "ttft p99",
        "total p50",
        "total p99",
        "closed",
        "rss peak"
    );
    let mut calm = Phase::default();
    let mut attacked = Phase::default();
    // Round 0 warms up and is not counted.
    for round in 0..=rounds {
        // Alternate which phase goes first, so drift within a round favours neither.
        let order: [usize; 2] = if round % 2 == 0 {
            [0, stalled]
        } else {
            [stalled, 0]
        };
        for count in order {
            let mut phase = run_phase(addr, pid, clients, count, secs);
            let mut ttft: Vec<_> = phase.samples.iter().map(|s| s.ttft).collect();
            let mut total: Vec<_> = phase.samples.iter().map(|s| s.total).collect();
            ttft.sort();
            total.sort();
            let label = if round == 0 {
                "warm-up".to_owned()
            } else {
                round.to_string()
            };
            println!(
                "{label:<8} {:<8} {:>9} {:>6} {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>8} {:>7}MiB",
                if count == 0 { "calm" } else { "stalled" },
                phase.samples.len(),
                phase.failures,
                ms(quantile(&ttft, 0.5)),
                ms(quantile(&ttft, 0.99)),
                ms(quantile(&total, 0.5)),
                ms(quantile(&total, 0.99)),
                phase.closed_after.len(),
                phase.peak_rss_kib / 1024
            );
            if round == 0 {
                continue;
            }
            let into = if count == 0 { &mut calm } else { &mut attacked };
            into.samples.append(&mut phase.samples);
            into.failures += phase.failures;
            into.closed_after.append(&mut phase.closed_after);
            into.failed_opens += phase.failed_opens;
            into.peak_rss_kib = into.peak_rss_kib.max(phase.peak_rss_kib);
        }
    }

    let sorted = |phase: &Phase, f: fn(&Sample) -> Duration| {
        let mut v: Vec<_> = phase.samples.iter().map(f).collect();
        v.sort();
        v
    };
    let (calm_ttft, calm_total) = (sorted(&calm, |s| s.ttft), sorted(&calm, |s| s.total));
    let (att_ttft, att_total) = (
        sorted(&attacked, |s| s.ttft),
        sorted(&attacked, |s| s.total),
    );
    let mut closed = attacked.closed_after.clone();
    closed.sort();
    println!();
    println!(
        "normal clients, all rounds: calm {} requests ({} failed), stalled {} requests ({} failed)",
        calm.samples.len(),
        calm.failures,
        attacked.samples.len(),
        attacked.failures
    );
    println!(
        "p99 stalled/calm: ttft {:.2}x ({:.1} vs {:.1} ms), total {:.2}x ({:.1} vs {:.1} ms)",
        ms(quantile(&att_ttft, 0.99)) / ms(quantile(&calm_ttft, 0.99)),
        ms(quantile(&att_ttft, 0.99)),
        ms(quantile(&calm_ttft, 0.99)),
        ms(quantile(&att_total, 0.99)) / ms(quantile(&calm_total, 0.99)),
        ms(quantile(&att_total, 0.99)),
        ms(quantile(&calm_total, 0.99)),
    );
    println!(
        "stalled connections closed by serve: {} (after their last byte: p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms; timeout {timeout} ms); opens refused: {}",
        closed.len(),
        ms(quantile(&closed, 0.5)),
        ms(quantile(&closed, 0.99)),
        ms(closed.last().copied().unwrap_or_default()),
        attacked.failed_opens
    );
    println!(
        "serve resident memory: calm peak {} MiB, stalled peak {} MiB, high-water mark {} MiB",
        calm.peak_rss_kib / 1024,
        attacked.peak_rss_kib / 1024,
        memory_kib(pid, "VmHWM:").unwrap_or(0) / 1024
    );
    if let Some(path) = arg("--svg") {
        std::fs::write(&path, svg(&calm_total, &att_total, clients, stalled)).expect("write svg");
        println!("wrote {path}");
    }
}
