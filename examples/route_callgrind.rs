//! N request-path reads of one variant, for instruction counts under callgrind:
//!
//! ```sh
//! cargo build --release --example route_callgrind
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!     target/release/examples/route_callgrind ours_decision 1000000
//! ```
//!
//! Run each variant at N and 2N and difference the totals: start-up cancels, and the result is
//! instructions per read (including about 10 of call and loop overhead, see `none`).
//! Read variants: ours_decision, ours_admission, upstream, bare_guard, rwlock, mutex, floor,
//! none. Write variants (one call each): ours_set_target, upstream_store_pair, ours_retarget,
//! upstream_retarget.

use std::hint::black_box;

#[path = "../benches/support/hot_paths.rs"]
mod hot_paths;
use hot_paths::Fixture;

#[inline(never)]
fn ours_decision(f: &Fixture) -> u64 {
    f.ours_decision()
}
#[inline(never)]
fn ours_admission(f: &Fixture) -> u64 {
    f.ours_admission()
}
#[inline(never)]
fn upstream(f: &Fixture) -> u64 {
    f.upstream()
}
#[inline(never)]
fn bare_guard(f: &Fixture) -> u64 {
    f.bare_guard()
}
#[inline(never)]
fn rwlock(f: &Fixture) -> u64 {
    f.rwlock_clone()
}
#[inline(never)]
fn mutex(f: &Fixture) -> u64 {
    f.mutex_clone()
}
#[inline(never)]
fn floor(f: &Fixture) -> u64 {
    f.floor()
}
#[inline(never)]
fn none(f: &Fixture) -> u64 {
    black_box(f) as *const Fixture as usize as u64
}

fn main() {
    let mut args = std::env::args().skip(1);
    let variant = args.next().unwrap_or_default();
    let n: u64 = args
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000_000);
    let write: Option<hot_paths::WriteOp> = match variant.as_str() {
        "ours_set_target" => Some(hot_paths::ours_set_target),
        "upstream_store_pair" => Some(hot_paths::upstream_store_pair),
        "ours_retarget" => Some(hot_paths::ours_retarget_cycle),
        "upstream_retarget" => Some(hot_paths::upstream_retarget_cycle),
        _ => None,
    };
    if let Some(op) = write {
        let fixture = Fixture::new();
        let mut state = 0u64;
        for _ in 0..n {
            op(black_box(&fixture), &mut state);
        }
        println!("{state}");
        return;
    }
    let read: fn(&Fixture) -> u64 = match variant.as_str() {
        "ours_decision" => ours_decision,
        "ours_admission" => ours_admission,
        "upstream" => upstream,
        "bare_guard" => bare_guard,
        "rwlock" => rwlock,
        "mutex" => mutex,
        "floor" => floor,
        "none" => none,
        other => {
            eprintln!("unknown variant {other:?}");
            std::process::exit(2);
        }
    };
    let fixture = Fixture::new();
    let mut acc = 0u64;
    for _ in 0..n {
        acc = acc.wrapping_add(read(black_box(&fixture)));
    }
    println!("{acc}");
}
