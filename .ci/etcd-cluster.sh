#!/usr/bin/env bash
# A three-member etcd cluster on loopback, for the fault suite (`--test etcd_cluster_faults`).
#
# Meant to be SOURCED by .ci/run (from the repo root):  source .ci/etcd-cluster.sh
#   - installs etcd-server and etcd-client if missing (via .ci/etcd.sh's installer);
#   - starts three members on 127.0.0.1, on free ports distinct from .ci/etcd.sh's, with
#     throwaway data dirs and fast heartbeats (10 ms, election timeout 100 ms);
#   - waits until every member is healthy and exports
#       PREFILL_ETCD_CLUSTER       comma-separated client URLs, member 0 first;
#       PREFILL_ETCD_CLUSTER_PIDS  comma-separated pids, same order;
#       PREFILL_ETCD_CLUSTER_DIR   the cluster's directory: `start-N.sh` restarts member N
#                                  (same data dir, same ports) and `pid-N` holds its pid, so a
#                                  test that kills a member can bring it back;
#   - stops every member (SIGCONT first, for a stopped one) and removes the dir at exit.
#
# It can also be executed, to run one command with the cluster up:
#   bash .ci/etcd-cluster.sh cargo test --release --features etcd --test etcd_cluster_faults
set -euo pipefail

prefill_cluster_install() {
  if ! command -v etcd >/dev/null || ! command -v etcdctl >/dev/null; then
    echo "== installing etcd (apt)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      etcd-server etcd-client >/dev/null
  fi
}

prefill_cluster_port_free() {
  ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

prefill_cluster_healthy() {
  ETCDCTL_API=3 etcdctl --endpoints="$1" --command-timeout=2s endpoint health >/dev/null 2>&1
}

prefill_cluster_stop() {
  local dir=${PREFILL_ETCD_CLUSTER_DIR:-}
  [[ -n "$dir" && -d "$dir" ]] || return 0
  local f pid
  for f in "$dir"/pid-*; do
    [[ -f "$f" ]] || continue
    pid=$(cat "$f")
    kill -CONT "$pid" 2>/dev/null || true
    kill "$pid" 2>/dev/null || true
  done
  for f in "$dir"/pid-*; do
    [[ -f "$f" ]] || continue
    pid=$(cat "$f")
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
  rm -rf "$dir"
  PREFILL_ETCD_CLUSTER_DIR=""
}

prefill_cluster_start() {
  if [[ -n "${PREFILL_ETCD_CLUSTER:-}" ]] && prefill_cluster_healthy "$PREFILL_ETCD_CLUSTER"; then
    return 0
  fi
  prefill_cluster_install
  # Six consecutive free ports: client and peer for each member.
  local base=${PREFILL_ETCD_CLUSTER_PORT:-23900} tries=0 ok p
  while :; do
    ok=1
    for p in $(seq "$base" $((base + 5))); do
      prefill_cluster_port_free "$p" || { ok=0; break; }
    done
    (( ok )) && break
    base=$((base + 6)); tries=$((tries + 1))
    if (( tries > 50 )); then echo "no six free ports near ${PREFILL_ETCD_CLUSTER_PORT:-23900}" >&2; return 1; fi
  done
  local dir
  dir=$(mktemp -d -t prefill-etcd-cluster.XXXXXX)
  PREFILL_ETCD_CLUSTER_DIR=$dir
  local initial="" urls="" i
  for i in 0 1 2; do
    initial+="${initial:+,}m$i=http://127.0.0.1:$((base + 2 * i + 1))"
    urls+="${urls:+,}http://127.0.0.1:$((base + 2 * i))"
  done
  for i in 0 1 2; do
    local client=$((base + 2 * i)) peer=$((base + 2 * i + 1))
    # The restart script: same name, data dir and ports; `existing` once the data dir exists.
    cat >"$dir/start-$i.sh" <<SCRIPT
#!/usr/bin/env bash
state=new
[[ -d "$dir/m$i" ]] && state=existing
etcd --name m$i --data-dir "$dir/m$i" \\
  --listen-client-urls http://127.0.0.1:$client --advertise-client-urls http://127.0.0.1:$client \\
  --listen-peer-urls http://127.0.0.1:$peer --initial-advertise-peer-urls http://127.0.0.1:$peer \\
  --initial-cluster "$initial" --initial-cluster-state "\$state" \\
  --initial-cluster-token prefill-ci-cluster \\
  --heartbeat-interval 10 --election-timeout 100 \\
  --log-level warn --logger zap >>"$dir/m$i.log" 2>&1 &
echo \$! >"$dir/pid-$i"
SCRIPT
    chmod +x "$dir/start-$i.sh"
  done
  local existing
  existing=$(trap -p EXIT | sed -E "s/^trap -- '(.*)' EXIT$/\1/")
  # shellcheck disable=SC2064 # expand the previous trap now, on purpose
  trap "prefill_cluster_stop${existing:+; $existing}" EXIT
  for i in 0 1 2; do bash "$dir/start-$i.sh"; done
  local healthy=0
  for _ in $(seq 1 200); do
    if prefill_cluster_healthy "$urls"; then healthy=1; break; fi
    for i in 0 1 2; do
      if ! kill -0 "$(cat "$dir/pid-$i")" 2>/dev/null; then
        echo "etcd member $i exited:" >&2; cat "$dir/m$i.log" >&2; return 1
      fi
    done
    sleep 0.1
  done
  if (( ! healthy )); then
    echo "etcd cluster not healthy after 20 s:" >&2; cat "$dir"/m*.log >&2; return 1
  fi
  export PREFILL_ETCD_CLUSTER="$urls"
  export PREFILL_ETCD_CLUSTER_PIDS="$(cat "$dir/pid-0"),$(cat "$dir/pid-1"),$(cat "$dir/pid-2")"
  export PREFILL_ETCD_CLUSTER_DIR="$dir"
  echo "== etcd cluster up at $PREFILL_ETCD_CLUSTER (pids $PREFILL_ETCD_CLUSTER_PIDS)"
}

prefill_cluster_start

if [[ "${BASH_SOURCE[0]}" == "$0" && $# -gt 0 ]]; then
  "$@"
fi
