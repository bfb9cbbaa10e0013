#!/usr/bin/env bash
# Deterministic simulation beyond the test suite's 300 seeds (docs/simulation.md): 2,000 more
# seeds x 300 steps, about 0.9 M simulated requests, ~10 s after the build. Any oracle
# violation prints its one-line reproduction and fails the script. SIM_SEED_BASE / SIM_SEEDS /
# SIM_STEPS explore other ranges (e.g. a date-derived base for a nightly VOPR-style sweep).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo run --release --quiet -- simulate \
  --seed "${SIM_SEED_BASE:-100000}" --seeds "${SIM_SEEDS:-2000}" --steps "${SIM_STEPS:-300}" \
  --quiet
