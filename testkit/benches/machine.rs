//! Throughput of `Machine::handle` over a realistic input mix (inputs per second).
//!
//! Run: `cargo bench -p prefill-router-testkit --bench machine`. The allocation side is guarded by
//! the test `testkit/tests/machine_no_alloc.rs` (a counting allocator), not timed here.

#![allow(missing_docs)] // criterion_group! generates undocumented public items

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use prefill_router::lifecycle::{Machine, RetryPolicy};
use prefill_router_testkit::realistic_mix;

fn handle_mix(c: &mut Criterion) {
    let trace = realistic_mix(4096, 3);
    let mut group = c.benchmark_group("machine");
    group.throughput(Throughput::Elements(trace.len() as u64));
    group.bench_function("handle_realistic_mix_4096", |b| {
        b.iter(|| {
            let mut m = Machine::new(RetryPolicy::default());
            let mut n = 0usize;
            for input in &trace {
                n += m.handle(black_box(input.clone())).len();
            }
            black_box(n)
        })
    });
    // The same inputs with the batch consumed by value, as a driver does.
    group.bench_function("handle_and_drain_realistic_mix_4096", |b| {
        b.iter(|| {
            let mut m = Machine::new(RetryPolicy::default());
            let mut n = 0u64;
            for input in &trace {
                for action in m.handle(black_box(input.clone())) {
                    black_box(action);
                    n += 1;
                }
            }
            black_box(n)
        })
    });
    group.finish();
}

criterion_group!(benches, handle_mix);
criterion_main!(benches);
