#!/usr/bin/env bash
# Fuzz gate: build every cargo-fuzz target and run each for a bounded time on the stable
# toolchain (no sanitizer: the library is safe Rust, and ASan would cost ~10x throughput; see
# docs/fuzzing.md for the deeper AddressSanitizer run). A crash fails the script and leaves its
# input in fuzz/artifacts/<target>/; keep it there (commit it) once fixed, and
# testkit/tests/fuzz_corpus_replay.rs replays it on every `cargo test`.
#
# Cost on 2 shared cores: cargo-fuzz install ~50 s (skipped when installed), build 1-2.5 min,
# then FUZZ_SECONDS (default 30) per target: 9 targets (kv_events, topology_events and engine_batch included), about 8 min in all
# from clean.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export CARGO_TERM_COLOR=never RUST_BACKTRACE=0
seconds="${FUZZ_SECONDS:-30}"

command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked --version 0.13.2

cargo fuzz build --sanitizer none

# New corpus entries go to a scratch directory: fuzz/corpus/ holds the small reviewed seeds
# only, and the work tree stays clean.
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

failed=()
for target in $(cargo fuzz list); do
    mkdir -p "$scratch/$target" "fuzz/corpus/$target"
    echo "=== fuzz $target for ${seconds}s"
    if ! cargo fuzz run --sanitizer none "$target" "$scratch/$target" "fuzz/corpus/$target" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1; then
        failed+=("$target")
    fi
done

if ((${#failed[@]})); then
    echo "fuzz targets crashed: ${failed[*]} (inputs in fuzz/artifacts/<target>/)" >&2
    exit 1
fi
echo "fuzz: all targets ran ${seconds}s without a crash"
