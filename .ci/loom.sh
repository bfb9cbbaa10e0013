#!/usr/bin/env bash
# loom models of the control core and the published-route cell (docs/concurrency.md).
# Crate-specific cfg so no dependency (tokio) reacts; own target dir so normal builds are not
# invalidated; release because loom explores thousands of interleavings.
set -euo pipefail
cd "$(dirname "$0")/.."
# No LOOM_MAX_PREEMPTIONS by default: the scenarios are small enough to explore every
# interleaving (about 20 s on 2 cores). Set it (e.g. 2) to bound the search for a quick run.
# `-p prefill-router`: the workspace's default members include the tools package, whose
# dependency on the library would switch its runtime back on.
RUSTFLAGS="--cfg prefill_loom" CARGO_TARGET_DIR=target/loom \
  cargo test --release -p prefill-router --no-default-features --test loom_control
