#!/usr/bin/env bash
# Model checking extras (issue 3): the Promela twin of the stateright model must store exactly
# the states stateright counts, and SPIN must catch the twin's no-staleness-check mutant.
# The stateright tests themselves run in `cargo test --workspace --release`.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v spin >/dev/null; then
  apt-get install -y spin >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y spin >/dev/null; }
fi
model/spin/run.sh
model/spin/run.sh --buggy
model/spin/run.sh --buggy-admission
