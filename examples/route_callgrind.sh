#!/usr/bin/env bash
# Instructions per request-path read under callgrind: Ir(2N) - Ir(N), divided by N.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --example route_callgrind
bin=target/release/examples/route_callgrind
n=${N:-1000000}
ir() {
  valgrind --tool=callgrind --callgrind-out-file=/dev/null "$bin" "$1" "$2" 2>&1 \
    | sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
}
printf '| variant | Ir per call |\n|---|---|\n'
for v in ${VARIANTS:-ours_decision ours_admission upstream bare_guard rwlock mutex floor none ours_set_target upstream_store_pair ours_retarget upstream_retarget}; do
  a=$(ir "$v" "$n"); b=$(ir "$v" $((2 * n)))
  awk -v v="$v" -v a="$a" -v b="$b" -v n="$n" 'BEGIN { printf "| %s | %.2f |\n", v, (b - a) / n }'
done
