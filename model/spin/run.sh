#!/usr/bin/env bash
# Runs SPIN on the Promela twin of the stateright model (router.pml) for one configuration and,
# unless --no-compare, runs the stateright checker on the same configuration and fails when
# the two state counts differ. Prints both rates side by side.
#
# usage: model/spin/run.sh [--retargets N] [--failures F] [--requests R] [--targets T]
#                          [--admission-changes A] [--no-shutdown] [--buggy]
#                          [--buggy-admission] [--no-compare]
#                          [--threads N]
# env:   PAN_W (hash table bits, default: sized from the expected count), CARGO_PROFILE_FLAG
set -euo pipefail
cd "$(dirname "$0")/../.."

retargets=4 failures=2 requests=2 targets=2 admission=1 shutdown=1 buggy=0 compare=1 threads=1
while [ $# -gt 0 ]; do
  case "$1" in
    --retargets) retargets=$2; shift 2 ;;
    --failures) failures=$2; shift 2 ;;
    --requests) requests=$2; shift 2 ;;
    --targets) targets=$2; shift 2 ;;
    --admission-changes) admission=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --no-shutdown) shutdown=0; shift ;;
    --buggy) buggy=1; shift ;;
    --buggy-admission) buggy=2; shift ;;
    --no-compare) compare=0; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
if [ $((retargets + failures)) -gt 16 ] || [ "$requests" -gt 4 ] || [ "$targets" -gt 3 ]; then
  echo "router.pml supports retargets+failures <= 16, requests <= 4, targets <= 3" >&2
  exit 2
fi

command -v spin >/dev/null || { apt-get install -y spin >/dev/null || { apt-get update >/dev/null && apt-get install -y spin >/dev/null; }; }
command -v gcc >/dev/null || apt-get install -y gcc >/dev/null

# CPU seconds (user+sys) when /usr/bin/time exists: steadier than wall time on a shared box.
cpu_file=$(mktemp)
trap 'rm -f "$cpu_file"' EXIT
timer=""
[ -x /usr/bin/time ] && timer="/usr/bin/time -o $cpu_file -f %U+%S"
cpu_note() {
  [ -n "$timer" ] && [ -s "$cpu_file" ] || return 0
  local cpu; cpu=$(awk -F+ '{ print $1 + $2 }' "$cpu_file")
  awk -v c="$cpu" -v n="$1" 'BEGIN { if (c > 0) printf " cpu=%.2fs (%.0f states/cpu-s)", c, n / c; else printf " cpu=%.2fs", c }'
}

sr_flags=(--retargets "$retargets" --failures "$failures" --requests "$requests" --targets "$targets"
  --admission-changes "$admission")
[ "$shutdown" = 1 ] || sr_flags+=(--no-shutdown)

sr_unique=""
if [ "$compare" = 1 ] && [ "$buggy" = 0 ]; then
  cargo build --release -q -p prefill-router-model
  sr_out=$($timer ./target/release/prefill-router-model check "${sr_flags[@]}" --threads "$threads" 2>/dev/null) || {
    echo "$sr_out"; echo "stateright check failed" >&2; exit 1; }
  sr_line=$(echo "$sr_out" | grep '^done:')
  sr_unique=$(echo "$sr_line" | sed -E 's/.*unique=([0-9]+).*/\1/')
  echo "stateright ($threads thread): ${sr_line#done: }$(cpu_note "$sr_unique")"
fi

work=$(mktemp -d)
trap 'rm -rf "$work" "$cpu_file"' EXIT
cp model/spin/router.pml "$work/"
defs=(-DTARGETS="$targets" -DRETARGETS="$retargets" -DFAILURES="$failures" -DNREQ="$requests" -DSHUTDOWN="$shutdown" -DADMISSION="$admission")
[ "$buggy" != 1 ] || defs+=(-DBUGGY)
[ "$buggy" != 2 ] || defs+=(-DBUGGY_ADMISSION)
# Hash table: ceil(log2(expected states)) + 1 bits, at least 16 (a 2^24 default table costs
# ~85 ms of page faults on small models, which would swamp the comparison).
if [ -z "${PAN_W:-}" ]; then
  n=${sr_unique:-1000000}; w=1
  while [ $((1 << w)) -lt "$n" ]; do w=$((w + 1)); done
  PAN_W=$((w + 1)); [ "$PAN_W" -ge 16 ] || PAN_W=16
fi
(
  cd "$work"
  # -o2: keep write-only variables in the state vector, as stateright keeps every field.
  spin -o2 "${defs[@]}" -a router.pml >/dev/null
  gcc -O2 -DSAFETY -o pan pan.c
)
start=$(date +%s.%N)
set +e
: > "$cpu_file"
# From inside $work: pan writes its error trail (router.pml.trail) to the current directory.
(cd "$work" && $timer ./pan -m1000000 -w"$PAN_W" > pan.out 2>&1)
set -e
end=$(date +%s.%N)
stored=$(sed -nE 's/^ *([0-9.e+]+) states, stored.*/\1/p' "$work/pan.out")
elapsed=$(sed -nE 's/^pan: elapsed time ([0-9.e+-]+) seconds.*/\1/p' "$work/pan.out")
errors=$(sed -nE 's/.*errors: ([0-9]+).*/\1/p' "$work/pan.out")
wall=$(awk -v a="$start" -v b="$end" 'BEGIN { print b - a }')
printf 'spin: stored=%s errors=%s pan-elapsed=%ss wall=%.3fs (-w%s)' "$stored" "$errors" "$elapsed" "$wall" "$PAN_W"
if [ -n "$elapsed" ] && awk -v e="$elapsed" 'BEGIN { exit !(e > 0) }'; then
  printf ' rate=%.0f states/s' "$(awk -v s="$stored" -v e="$elapsed" 'BEGIN { print s / e }')"
fi
cpu_note "${stored%%.*}"
echo

if [ "$buggy" = 2 ]; then
  grep -q 'assertion violated.*emptied' "$work/pan.out" || { echo "SPIN missed the admission twin's M10 violation" >&2; exit 1; }
  grep 'assertion violated' "$work/pan.out" | head -1
  exit 0
fi
if [ "$buggy" = 1 ]; then
  grep -q 'assertion violated' "$work/pan.out" || { echo "SPIN missed the buggy twin's violation" >&2; exit 1; }
  grep 'assertion violated' "$work/pan.out" | head -1
  exit 0
fi
[ "$errors" = 0 ] || { cat "$work/pan.out"; echo "SPIN found a violation" >&2; exit 1; }
if [ -n "$sr_unique" ]; then
  if [ "$stored" != "$sr_unique" ]; then
    echo "state counts differ: stateright $sr_unique, spin $stored" >&2
    exit 1
  fi
  echo "state counts agree: $stored"
fi
