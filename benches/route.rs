//! Request-path and control-core costs, side by side with upstream's layout (see
//! docs/performance.md, "Request path and control core").
//!
//! Groups: `decision` and `admission` (one thread); `decision_contended` and
//! `admission_contended` (a second reader runs the same read while a writer retargets every
//! 100 µs; stderr shows the second reader's rate and the writer's achieved rate);
//! `control_write` (set_target and retarget cycles against upstream's stores).
//!
//! Short runs: `cargo bench --bench route -- --warm-up-time 1 --measurement-time 3`.

// criterion_group!/criterion_main! generate undocumented items.
#![allow(missing_docs)]

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};

#[path = "support/hot_paths.rs"]
mod hot_paths;
use hot_paths::{binding, control_retarget, Fixture};

type Read = fn(&Fixture) -> u64;
type Write = fn(&Fixture, u64);

fn decision(c: &mut Criterion) {
    let fx = Fixture::new();
    let mut g = c.benchmark_group("decision");
    let variants: [(&str, Read); 6] = [
        ("ours_guard_no_clone", Fixture::ours_decision),
        ("bare_arcswap_guard", Fixture::bare_guard),
        ("upstream_u8_then_load_full", Fixture::upstream),
        ("std_rwlock_read_clone", Fixture::rwlock_clone),
        ("parking_lot_mutex_clone", Fixture::mutex_clone),
        ("floor_bare_atomic_u8", Fixture::floor),
    ];
    for (name, read) in variants {
        g.bench_function(name, |b| b.iter(|| read(black_box(&fx))));
    }
    g.finish();
}

fn admission(c: &mut Criterion) {
    let fx = Fixture::new();
    let mut g = c.benchmark_group("admission");
    let variants: [(&str, Read); 2] = [
        ("ours_route_clone", Fixture::ours_admission),
        ("upstream_u8_then_load_full", Fixture::upstream),
    ];
    for (name, read) in variants {
        g.bench_function(name, |b| b.iter(|| read(black_box(&fx))));
    }
    g.finish();
}

/// A second reader and a 10 kHz writer, running while criterion measures the first reader.
struct Background {
    stop: Arc<AtomicBool>,
    reader: JoinHandle<(u64, Duration)>,
    writer: JoinHandle<(u64, Duration)>,
}

impl Background {
    fn start(fx: &Arc<Fixture>, read: Read, write: Write) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let reader = {
            let (fx, stop) = (Arc::clone(fx), Arc::clone(&stop));
            std::thread::spawn(move || {
                let start = Instant::now();
                let mut ops = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..1024 {
                        black_box(read(black_box(&fx)));
                    }
                    ops += 1024;
                }
                (ops, start.elapsed())
            })
        };
        let writer = {
            let (fx, stop) = (Arc::clone(fx), Arc::clone(&stop));
            std::thread::spawn(move || {
                let start = Instant::now();
                let mut next = start;
                let mut swaps = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    // Sleep to a deadline so the rate stays 10 kHz whatever a write costs.
                    next += Duration::from_micros(100);
                    if let Some(wait) = next.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                    swaps += 1;
                    write(&fx, 2 + swaps % 2);
                }
                (swaps, start.elapsed())
            })
        };
        Background {
            stop,
            reader,
            writer,
        }
    }

    fn stop(self, name: &str) {
        self.stop.store(true, Ordering::Relaxed);
        let (ops, rt) = self.reader.join().expect("background reader");
        let (swaps, wt) = self.writer.join().expect("background writer");
        eprintln!(
            "BG {name}: second reader {:.2} ns/op, writer {:.0} writes/s",
            rt.as_nanos() as f64 / ops.max(1) as f64,
            swaps as f64 / wt.as_secs_f64()
        );
    }
}

fn write_ours(fx: &Fixture, target: u64) {
    control_retarget(&fx.control, target);
}

fn write_upstream(fx: &Fixture, target: u64) {
    fx.upstream.retarget(target);
    fx.upstream.publish(Arc::new(binding(target)));
}

fn write_bare(fx: &Fixture, target: u64) {
    fx.bare.store(Arc::new(binding(target)));
}

fn contended(c: &mut Criterion, group: &str, variants: &[(&str, Read, Write)]) {
    let mut g = c.benchmark_group(group);
    for &(name, read, write) in variants {
        let fx = Arc::new(Fixture::new());
        let bg = Background::start(&fx, read, write);
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    black_box(read(black_box(&fx)));
                }
                start.elapsed()
            })
        });
        bg.stop(&format!("{group}/{name}"));
    }
    g.finish();
}

fn decision_contended(c: &mut Criterion) {
    contended(
        c,
        "decision_contended",
        &[
            ("ours_guard_no_clone", Fixture::ours_decision, write_ours),
            ("bare_arcswap_guard", Fixture::bare_guard, write_bare),
            (
                "upstream_u8_then_load_full",
                Fixture::upstream,
                write_upstream,
            ),
        ],
    );
}

fn admission_contended(c: &mut Criterion) {
    contended(
        c,
        "admission_contended",
        &[
            ("ours_route_clone", Fixture::ours_admission, write_ours),
            (
                "upstream_u8_then_load_full",
                Fixture::upstream,
                write_upstream,
            ),
        ],
    );
}

fn control_write(c: &mut Criterion) {
    let mut g = c.benchmark_group("control_write");
    // Ours: one set_target (lock, machine step, new snapshot, swap, old snapshot dropped after
    // the lock). Alternating clear and reuse, so every call publishes.
    let fx = Fixture::new();
    let mut on = true;
    g.bench_function("ours_set_target_clear_or_reuse", |b| {
        b.iter(|| {
            on = !on;
            fx.control
                .set_target(black_box(if on { Some(1) } else { None }))
        })
    });
    // Upstream's store pair: lock, binding store, lifecycle store (its publish, D8).
    let up = Fixture::new();
    let prebuilt = Arc::new(binding(1));
    g.bench_function("upstream_store_pair", |b| {
        b.iter(|| up.upstream.publish(Arc::clone(black_box(&prebuilt))))
    });
    // A whole retarget with a completed build: ours (two publishes) against upstream's S3 + D8.
    let mut t = 1u64;
    g.bench_function("ours_retarget_and_publish", |b| {
        b.iter_batched(
            || {
                t += 1;
                (t, binding(t))
            },
            |(t, bind)| {
                for e in fx.control.set_target(Some(t)) {
                    if let prefill_router::control::Effect::StartBuild { build, .. } = e {
                        let _ = fx.control.build_succeeded(build, bind);
                        break;
                    }
                }
            },
            BatchSize::SmallInput,
        )
    });
    g.bench_function("upstream_retarget_and_publish", |b| {
        b.iter_batched(
            || {
                t += 1;
                (t, Arc::new(binding(t)))
            },
            |(t, bind)| {
                up.upstream.retarget(t);
                up.upstream.publish(bind);
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion_group!(
    benches,
    decision,
    admission,
    decision_contended,
    admission_contended,
    control_write
);
criterion_main!(benches);
