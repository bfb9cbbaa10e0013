//! Interleaved, CPU-time-based measurement of the request path and the control writes, robust
//! on a busy shared machine (criterion's wall time counts time a reader spends descheduled).
//!
//! `cargo run --release --example route_contend -- ROUNDS MILLIS` (default 7 rounds of 200 ms).
//!
//! Every round runs each read variant alone (1r) and as two readers while a writer retargets
//! every 100 µs (2r+w), then each write variant alone; variants interleave within a round.
//! Figures are medians over rounds (and readers) of ns/op in thread CPU time
//! (`CLOCK_THREAD_CPUTIME_ID`). "overlap" is reader CPU seconds over wall seconds in 2r+w
//! (2.0 = both readers always on a core); a contended figure means little when it is near 1.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

#[path = "../benches/support/hot_paths.rs"]
mod hot_paths;
use hot_paths::{binding, control_retarget, Fixture, WriteOp};

fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant the kernel knows.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

type Read = fn(&Fixture) -> u64;
type Write = fn(&Fixture, u64);

struct ReadVariant {
    name: &'static str,
    read: Read,
    write: Write,
}

fn write_ours(fx: &Fixture, t: u64) {
    control_retarget(&fx.control, t);
}
fn write_upstream(fx: &Fixture, t: u64) {
    fx.upstream.retarget(t);
    fx.upstream.publish(Arc::new(binding(t)));
}
fn write_bare(fx: &Fixture, t: u64) {
    fx.bare.store(Arc::new(binding(t)));
}

/// One reader's loop: (ops, thread CPU time).
fn read_loop(fx: &Fixture, read: Read, stop: &AtomicBool) -> (u64, Duration) {
    let c0 = thread_cpu();
    let mut ops = 0u64;
    while !stop.load(Ordering::Relaxed) {
        for _ in 0..1024 {
            black_box(read(black_box(fx)));
        }
        ops += 1024;
    }
    (ops, thread_cpu() - c0)
}

/// Run `readers` readers (and the writer if `with_writer`) for `dur`; per-reader ns/op and the
/// readers' overlap.
fn run(v: &ReadVariant, readers: usize, with_writer: bool, dur: Duration) -> (Vec<f64>, f64) {
    let fx = Arc::new(Fixture::new());
    let stop = Arc::new(AtomicBool::new(false));
    let barrier = Arc::new(Barrier::new(readers + 1));
    let writer = with_writer.then(|| {
        let (fx, stop, write) = (Arc::clone(&fx), Arc::clone(&stop), v.write);
        std::thread::spawn(move || {
            let mut next = Instant::now();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                next += Duration::from_micros(100);
                if let Some(w) = next.checked_duration_since(Instant::now()) {
                    std::thread::sleep(w);
                }
                i += 1;
                write(&fx, 2 + i % 2);
            }
        })
    });
    let handles: Vec<_> = (0..readers)
        .map(|_| {
            let (fx, stop, barrier, read) = (
                Arc::clone(&fx),
                Arc::clone(&stop),
                Arc::clone(&barrier),
                v.read,
            );
            std::thread::spawn(move || {
                barrier.wait();
                read_loop(&fx, read, &stop)
            })
        })
        .collect();
    barrier.wait();
    let wall = Instant::now();
    std::thread::sleep(dur);
    stop.store(true, Ordering::Relaxed);
    let wall = wall.elapsed();
    let mut per_op = Vec::new();
    let mut cpu = 0.0;
    for h in handles {
        let (ops, t) = h.join().expect("reader");
        per_op.push(t.as_nanos() as f64 / ops.max(1) as f64);
        cpu += t.as_secs_f64();
    }
    if let Some(w) = writer {
        w.join().expect("writer");
    }
    (per_op, cpu / wall.as_secs_f64())
}

/// A single-threaded write loop: ns/op in thread CPU time.
fn run_write(write: WriteOp, dur: Duration) -> f64 {
    let fx = Fixture::new();
    let mut state = 1u64;
    let end = Instant::now() + dur;
    let c0 = thread_cpu();
    let mut ops = 0u64;
    while Instant::now() < end {
        for _ in 0..256 {
            write(&fx, &mut state);
        }
        ops += 256;
    }
    (thread_cpu() - c0).as_nanos() as f64 / ops as f64
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let rounds: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(7);
    let millis: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(200);
    let dur = Duration::from_millis(millis);
    let reads = [
        ReadVariant {
            name: "decision: ours (guard, no clone)",
            read: Fixture::ours_decision,
            write: write_ours,
        },
        ReadVariant {
            name: "decision: bare arc-swap guard",
            read: Fixture::bare_guard,
            write: write_bare,
        },
        ReadVariant {
            name: "admission: ours (route, Arc clone)",
            read: Fixture::ours_admission,
            write: write_ours,
        },
        ReadVariant {
            name: "upstream: AtomicU8 + load_full",
            read: Fixture::upstream,
            write: write_upstream,
        },
    ];
    let writes: [(&str, WriteOp); 4] = [
        (
            "ours set_target (clear or reuse)",
            hot_paths::ours_set_target,
        ),
        (
            "upstream store pair (lock, binding, lifecycle)",
            hot_paths::upstream_store_pair,
        ),
        (
            "ours retarget + build_succeeded",
            hot_paths::ours_retarget_cycle,
        ),
        (
            "upstream retarget + publish",
            hot_paths::upstream_retarget_cycle,
        ),
    ];
    let mut alone = vec![Vec::new(); reads.len()];
    let mut contended = vec![Vec::new(); reads.len()];
    let mut overlap = vec![Vec::new(); reads.len()];
    let mut write_ns = vec![Vec::new(); writes.len()];
    for _ in 0..rounds {
        for (i, v) in reads.iter().enumerate() {
            let (a, _) = run(v, 1, false, dur);
            alone[i].extend(a);
            let (c, o) = run(v, 2, true, dur);
            contended[i].extend(c);
            overlap[i].push(o);
        }
        for (i, (_, w)) in writes.iter().enumerate() {
            write_ns[i].push(run_write(*w, dur));
        }
    }
    let up = reads.len() - 1;
    let up_alone = median(&mut alone[up].clone());
    let up_cont = median(&mut contended[up].clone());
    println!("rounds {rounds} x {millis} ms, medians of thread CPU ns/op");
    println!("| read | 1 reader | 2 readers + writer 10 kHz | contended / alone | vs upstream alone | vs upstream contended | overlap |");
    println!("|---|---|---|---|---|---|---|");
    for (i, v) in reads.iter().enumerate() {
        let a = median(&mut alone[i]);
        let c = median(&mut contended[i]);
        let o = median(&mut overlap[i]);
        println!(
            "| {} | {a:.2} | {c:.2} | {:.2}x | {:.2}x | {:.2}x | {o:.2} |",
            v.name,
            c / a,
            a / up_alone,
            c / up_cont
        );
    }
    println!();
    println!("| write (one thread) | ns/op |");
    println!("|---|---|");
    for (i, (name, _)) in writes.iter().enumerate() {
        println!("| {name} | {:.1} |", median(&mut write_ns[i]));
    }
}
