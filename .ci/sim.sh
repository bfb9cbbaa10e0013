#!/usr/bin/env bash
# Deterministic simulation beyond the test suite's seeds (docs/simulation.md): 2,000 more
# seeds x 300 steps, about 0.9 M simulated requests, ~10 s after the build; then 2,000 seeds
# x 300 steps with several frontends per binding sharing the workers, which publish load
# reports under the no-leak and no-double-count oracles (another ~0.9 M requests, ~15 s).
# Any oracle violation prints its one-line reproduction and fails the script. SIM_SEED_BASE /
# SIM_SEEDS / SIM_STEPS explore other ranges (e.g. a date-derived base for a nightly
# VOPR-style sweep); SIM_FRONTENDS sets the multi-frontend sweep's frontends (2..=4, default 3).
set -euo pipefail
cd "$(dirname "$0")/.."
base="${SIM_SEED_BASE:-100000}"
seeds="${SIM_SEEDS:-2000}"
steps="${SIM_STEPS:-300}"
cargo run --release --quiet -- simulate --seed "$base" --seeds "$seeds" --steps "$steps" --quiet
# Another seed range, so the two sweeps draw different worlds.
cargo run --release --quiet -- simulate \
  --seed "$((base + 1000000))" --seeds "$seeds" --steps "$steps" \
  --frontends "${SIM_FRONTENDS:-3}" --quiet
