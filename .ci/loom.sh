#!/usr/bin/env bash
# loom models of the control core and the published-route cell (docs/concurrency.md).
# Crate-specific cfg so no dependency (tokio) reacts; own target dir so normal builds are not
# invalidated; release because loom explores thousands of interleavings.
set -euo pipefail
cd "$(dirname "$0")/.."
RUSTFLAGS="--cfg prefill_loom" LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-3}" \
  CARGO_TARGET_DIR=target/loom \
  cargo test --release --no-default-features --test loom_control
