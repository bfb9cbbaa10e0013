#!/usr/bin/env bash
# etcd for the discovery tests.
#
# Meant to be SOURCED by .ci/run (from the repo root):  source .ci/etcd.sh
#   - installs etcd-server, etcd-client, protobuf-compiler and libprotobuf-dev if missing
#     (protoc and the well-known .proto files are needed to build etcd-client, feature `etcd`);
#   - starts etcd on 127.0.0.1 on a free non-default port, with a throwaway data dir and fast
#     heartbeats (so 1-2 s lease TTLs are honoured);
#   - waits until it is healthy and exports PREFILL_ETCD_ENDPOINT;
#   - stops it and removes the data dir at exit (an EXIT trap that keeps any existing one).
# Idempotent: sourcing it again while its etcd is healthy does nothing.
#
# It can also be executed, to run one command with etcd up:  bash .ci/etcd.sh cargo test ...
set -euo pipefail

prefill_etcd_install() {
  if ! command -v etcd >/dev/null || ! command -v etcdctl >/dev/null \
     || ! command -v protoc >/dev/null || ! dpkg -s libprotobuf-dev >/dev/null 2>&1; then
    echo "== installing etcd and protoc (apt)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      etcd-server etcd-client protobuf-compiler libprotobuf-dev >/dev/null
  fi
}

prefill_etcd_healthy() {
  ETCDCTL_API=3 etcdctl --endpoints="$1" --command-timeout=2s endpoint health >/dev/null 2>&1
}

prefill_port_free() {
  # A refused connection means nobody listens there.
  ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

prefill_etcd_stop() {
  if [[ -n "${PREFILL_ETCD_PID:-}" ]]; then
    kill "$PREFILL_ETCD_PID" 2>/dev/null || true
    wait "$PREFILL_ETCD_PID" 2>/dev/null || true
    PREFILL_ETCD_PID=""
  fi
  if [[ -n "${PREFILL_ETCD_DIR:-}" ]]; then
    rm -rf "$PREFILL_ETCD_DIR"
    PREFILL_ETCD_DIR=""
  fi
}

prefill_etcd_start() {
  if [[ -n "${PREFILL_ETCD_PID:-}" && -n "${PREFILL_ETCD_ENDPOINT:-}" ]] \
     && prefill_etcd_healthy "$PREFILL_ETCD_ENDPOINT"; then
    return 0
  fi
  prefill_etcd_install
  local port=${PREFILL_ETCD_PORT:-23790} tries=0
  while ! prefill_port_free "$port" || ! prefill_port_free "$((port + 1))"; do
    port=$((port + 2)); tries=$((tries + 1))
    if (( tries > 50 )); then echo "no free port pair for etcd near ${PREFILL_ETCD_PORT:-23790}" >&2; return 1; fi
  done
  PREFILL_ETCD_DIR=$(mktemp -d -t prefill-etcd.XXXXXX)
  etcd --name prefill-ci --data-dir "$PREFILL_ETCD_DIR/data" \
    --listen-client-urls "http://127.0.0.1:$port" --advertise-client-urls "http://127.0.0.1:$port" \
    --listen-peer-urls "http://127.0.0.1:$((port + 1))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((port + 1))" \
    --initial-cluster "prefill-ci=http://127.0.0.1:$((port + 1))" --initial-cluster-state new \
    --heartbeat-interval 10 --election-timeout 100 \
    --log-level warn --logger zap >"$PREFILL_ETCD_DIR/etcd.log" 2>&1 &
  PREFILL_ETCD_PID=$!
  local existing
  existing=$(trap -p EXIT | sed -E "s/^trap -- '(.*)' EXIT$/\1/")
  # shellcheck disable=SC2064 # expand the previous trap now, on purpose
  trap "prefill_etcd_stop${existing:+; $existing}" EXIT
  local endpoint="http://127.0.0.1:$port"
  for _ in $(seq 1 100); do
    if prefill_etcd_healthy "$endpoint"; then break; fi
    if ! kill -0 "$PREFILL_ETCD_PID" 2>/dev/null; then
      echo "etcd exited:" >&2; cat "$PREFILL_ETCD_DIR/etcd.log" >&2; return 1
    fi
    sleep 0.1
  done
  if ! prefill_etcd_healthy "$endpoint"; then
    echo "etcd not healthy after 10 s:" >&2; cat "$PREFILL_ETCD_DIR/etcd.log" >&2; return 1
  fi
  export PREFILL_ETCD_ENDPOINT="$endpoint"
  echo "== etcd up at $PREFILL_ETCD_ENDPOINT (pid $PREFILL_ETCD_PID)"
}

prefill_etcd_start

if [[ "${BASH_SOURCE[0]}" == "$0" && $# -gt 0 ]]; then
  "$@"
fi
