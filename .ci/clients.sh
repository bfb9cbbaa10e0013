#!/usr/bin/env bash
# Real clients against real processes: one `serve` (policy decode), one `serve` (policy reject),
# two prefill workers and one decode worker on a temporary file store; the `openai` Python
# package (in a fresh venv) and curl run the checks in tools/tests/clients/openai_client.py and
# below. Every check prints PASS or FAIL; any FAIL exits non-zero. Every process started here
# is killed at exit; every wait is bounded. Needs python3 (with venv and pip) and curl; no root.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

cargo build --release
bin="$PWD/target/release/prefill-router"
work="$(mktemp -d)"
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
    # Processes started inside $(...) (serve) could not add to `pids`: they left a pid file.
    for file in "$work"/*.pid; do
        [[ -e "$file" ]] && kill -9 "$(cat "$file")" 2>/dev/null || true
    done
    rm -rf "$work"
}
trap cleanup EXIT
failures=0
pass() { echo "PASS $1"; }
fail() { echo "FAIL $1"; failures=$((failures + 1)); }
store="file://$work/store"
ns=clients

# wait_event LOG EVENT: the first JSON line of LOG with that event, within 30 s.
wait_event() {
    local i
    for i in $(seq 1 300); do
        if grep -q "\"event\":\"$2\"" "$1" 2>/dev/null; then
            grep -m1 "\"event\":\"$2\"" "$1"
            return 0
        fi
        sleep 0.1
    done
    echo "timed out waiting for $2 in $1:" >&2
    cat "$1" >&2 || true
    return 1
}

# start NAME ARGS...: run the binary in the background, stdout to $work/NAME.log.
start() {
    local name="$1"
    shift
    "$bin" "$@" >"$work/$name.log" 2>"$work/$name.err" &
    pids+=("$!")
    echo "$!" >"$work/$name.pid"
    eval "pid_$name=$!"
}

worker() { # NAME ROLE ID EXTRA...
    local name="$1" role="$2" id="$3"
    shift 3
    start "$name" worker --role "$role" --discovery "$store" --namespace "$ns" --id "$id" --ttl-ms 2000 "$@"
    wait_event "$work/$name.log" ready >/dev/null
}

serve() { # NAME EXTRA...
    local name="$1"
    shift
    start "$name" serve --discovery "$store" --namespace "$ns" --listen 127.0.0.1:0 --ttl-ms 2000 \
        --request-timeout-ms 10000 "$@"
    wait_event "$work/$name.log" listening | sed 's/.*"addr":"\([^"]*\)".*/\1/'
}

# until_ready URL STATUS LIFECYCLE: wait (30 s) until GET URL/ready answers STATUS with LIFECYCLE.
until_ready() {
    local i
    for i in $(seq 1 300); do
        local out
        out="$(curl -s -m 2 -w ' %{http_code}' "$1/ready" || true)"
        if [[ "$out" == *"\"lifecycle\":\"$3\""*" $2" ]]; then return 0; fi
        sleep 0.1
    done
    echo "last /ready: $out" >&2
    return 1
}

# Slow prefills (150 ms per uncached block): requests are in flight when a worker is killed.
worker p1 prefill 1 --block-cost-us 150000 --print-requests
worker p2 prefill 2 --block-cost-us 150000
worker d decode 100 --token-interval-us 5000 --print-requests
addr="$(serve frontend --fallback decode)"
strict="$(serve strict --fallback reject)"
base="http://$addr"
strict_base="http://$strict"
until_ready "$base" 200 active && pass "serve (policy decode) ready and active" || fail "serve ready"
until_ready "$strict_base" 200 active && pass "serve (policy reject) ready and active" || fail "strict serve ready"

python3 -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet --disable-pip-version-check openai
py="$work/venv/bin/python"

# curl: a streaming chat completion ends with [DONE]; a completion; models; a malformed body.
out="$(curl -sN -m 20 "$base/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"mock-llm","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true}')"
[[ "$(grep -c '^data: {' <<<"$out")" == 3 && "$(tail -n1 <<<"$out" | tr -d '\r')" == "data: [DONE]" ]] \
    && pass "curl: streaming chat, 3 chunks then [DONE]" || fail "curl: streaming chat: $out"
out="$(curl -s -m 20 "$base/v1/completions" -d '{"model":"mock-llm","prompt":"hello","max_tokens":4}')"
[[ "$out" == *'"completion_tokens":4'* ]] && pass "curl: completion" || fail "curl: completion: $out"
out="$(curl -s -m 5 "$base/v1/models")"
[[ "$out" == *'"id":"mock-llm"'* ]] && pass "curl: /v1/models" || fail "curl: models: $out"
code="$(curl -s -m 5 -o "$work/bad.json" -w '%{http_code}' "$base/v1/chat/completions" -d '{"model": ')"
[[ "$code" == 400 ]] && grep -q '"type":"invalid_request_error"' "$work/bad.json" \
    && pass "curl: malformed body is a 400 with an OpenAI error" || fail "curl: malformed: $code $(cat "$work/bad.json")"
out="$(curl -sN -m 20 "$base/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"mock-llm","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true,"stream_options":{"include_usage":true}}')"
[[ "$(grep -c '^data: {' <<<"$out")" == 4 && "$(grep '^data: {' <<<"$out" | tail -n1)" == *'"choices":[]'*'"completion_tokens":3'* ]] \
    && pass "curl: include_usage adds a usage chunk" || fail "curl: include_usage: $out"
code="$(curl -s -m 5 -o "$work/405.json" -D "$work/405.head" -w '%{http_code}' "$base/v1/chat/completions")"
[[ "$code" == 405 ]] && grep -qi '^allow: POST' "$work/405.head" && grep -q '"code":"method_not_allowed"' "$work/405.json" \
    && pass "curl: GET on a POST route is a 405 with Allow and an OpenAI error" || fail "curl: 405: $code $(cat "$work/405.json")"
# A client that sends half its headers and stalls is closed at the header timeout (10 s).
if python3 - "$addr" <<'PY'
import socket, sys, time
host, port = sys.argv[1].rsplit(":", 1)
s = socket.create_connection((host, int(port)))
s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
s.settimeout(30)
start = time.time()
try:
    data = s.recv(100)
except OSError:
    data = b""
sys.exit(0 if data == b"" and time.time() - start < 30 else 1)
PY
then pass "a stalled client is closed at the header timeout"; else fail "stalled client kept open"; fi
code="$(curl -s -m 5 -o /dev/null -w '%{http_code}' "$base/health")"
[[ "$code" == 200 ]] && pass "curl: /health" || fail "curl: health $code"

# curl: a client that disconnects mid-stream (curl -m) cancels the request at the decode worker.
before="$(grep -c '"event":"cancelled"' "$work/d.log" || true)"
curl -sN -m 1 "$base/v1/chat/completions" \
    -d '{"model":"mock-llm","messages":[{"role":"user","content":"long"}],"max_tokens":2000,"stream":true}' \
    >/dev/null || true
ok=0
for _ in $(seq 1 100); do
    if (( $(grep -c '"event":"cancelled"' "$work/d.log" || true) > before )); then ok=1; break; fi
    sleep 0.1
done
(( ok )) && pass "curl: disconnect mid-stream cancels at the decode worker" || fail "curl: disconnect"

# The openai package: streaming chat, completion, models, a second turn, a disconnect.
before="$(grep -c '"event":"cancelled"' "$work/d.log" || true)"
"$py" tools/tests/clients/openai_client.py basic --base "$base" --prefill-ids 1,2 || failures=$((failures + 1))
ok=0
for _ in $(seq 1 100); do
    if (( $(grep -c '"event":"cancelled"' "$work/d.log" || true) > before )); then ok=1; break; fi
    sleep 0.1
done
(( ok )) && pass "openai: closing a stream cancels at the decode worker" || fail "openai: disconnect not seen by the worker"
metrics="$(curl -s -m 5 "$base/metrics")"
grep -q '^prefill_router_http_client_disconnects_total [1-9]' <<<"$metrics" \
    && pass "/metrics counts client disconnects" || fail "/metrics: no disconnects counted"
grep -q '^prefill_router_prefilled_total{router="prefill"} [1-9]' <<<"$metrics" \
    && pass "/metrics has the router's metrics" || fail "/metrics: no router metrics"

# API keys: a third frontend with a key file (two keys). curl without a key gets the OpenAI
# 401 with WWW-Authenticate, with either key it is served; /health stays open; the openai
# client with api_key set works and without it raises openai.AuthenticationError; serve's
# stderr names the key count, never a key.
key_one="sk-clients-$RANDOM$RANDOM"
key_two="$key_one-second"
printf '# clients.sh keys\n%s\n\n  %s  \n' "$key_one" "$key_two" >"$work/api-keys"
chmod 600 "$work/api-keys"
keyed="http://$(serve keyed --api-key-file "$work/api-keys")"
until_ready "$keyed" 200 active && pass "serve with a key file ready" || fail "keyed serve ready"
code="$(curl -s -m 5 -o "$work/401.json" -D "$work/401.head" -w '%{http_code}' "$keyed/v1/chat/completions" \
    -d '{"model":"mock-llm","messages":[{"role":"user","content":"hi"}],"max_tokens":2}')"
[[ "$code" == 401 ]] && grep -qi '^www-authenticate: Bearer' "$work/401.head" \
    && grep -q '"code":"invalid_api_key"' "$work/401.json" && grep -q '"type":"invalid_request_error"' "$work/401.json" \
    && grep -q '"param":null' "$work/401.json" \
    && pass "curl: no key is a 401 with WWW-Authenticate and an OpenAI error" || fail "curl: no key: $code $(cat "$work/401.json")"
code="$(curl -s -m 5 -o /dev/null -w '%{http_code}' -H "Authorization: Bearer ${key_one}x" "$keyed/v1/models")"
[[ "$code" == 401 ]] && pass "curl: a wrong key is a 401" || fail "curl: wrong key: $code"
for key in "$key_one" "$key_two"; do
    out="$(curl -sN -m 20 -H "Authorization: Bearer $key" "$keyed/v1/chat/completions" \
        -d '{"model":"mock-llm","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true}')"
    [[ "$(grep -c '^data: {' <<<"$out")" == 3 ]] && pass "curl: a key of the file is served" || fail "curl: with a key: $out"
done
code="$(curl -s -m 5 -o /dev/null -w '%{http_code}' "$keyed/health")"
[[ "$code" == 200 ]] && pass "curl: /health needs no key" || fail "curl: keyed health $code"
"$py" tools/tests/clients/openai_client.py keys --base "$keyed" --api-key "$key_two" || failures=$((failures + 1))
if grep -q '2 API key(s) loaded' "$work/keyed.err" && ! grep -q -e "$key_one" "$work/keyed.err" "$work/keyed.log"; then
    pass "serve logs the key count, never a key"
else
    fail "serve's key logging: $(cat "$work/keyed.err")"
fi

# SIGKILL prefill worker 1 under traffic (the Python script sends the signal).
"$py" tools/tests/clients/openai_client.py kill --base "$base" --kill-pid "$pid_p1" --kill-log "$work/p1.log" --survivor 2 \
    || failures=$((failures + 1))

# Every prefill worker leaves: policy decode bypasses, policy reject answers 503; /ready follows.
kill -TERM "$pid_p2"
wait "$pid_p2" && pass "prefill worker exits 0 on SIGTERM" || fail "prefill worker exit status"
grep -q '"deregistered":true' "$work/p2.log" && pass "prefill worker deregistered" || fail "deregistration"
until_ready "$strict_base" 503 unavailable && pass "/ready is 503 under policy reject without prefill" \
    || fail "strict /ready did not turn 503"
until_ready "$base" 200 unavailable && pass "/ready stays 200 under policy decode without prefill" \
    || fail "bypass /ready"
"$py" tools/tests/clients/openai_client.py bypass --base "$base" --strict-base "$strict_base" --decode-id 100 \
    || failures=$((failures + 1))
code="$(curl -s -m 5 -o "$work/ready.json" -w '%{http_code}' "$strict_base/ready")"
[[ "$code" == 503 ]] && grep -q 'prefill not active' "$work/ready.json" \
    && pass "curl: /ready 503 says why" || fail "curl: /ready $code $(cat "$work/ready.json")"

# A decode worker SIGKILLed mid-stream (issue #42): a second decode worker and a new prefill
# worker join; the script kills whichever decode worker serves its long generation, and the
# stream continues on the other one, text identical to an uninterrupted run's.
worker p3 prefill 3
worker d2 decode 101 --token-interval-us 5000 --print-requests
until_ready "$base" 200 active && pass "a new prefill worker makes the pool active again" || fail "p3 ready"
"$py" tools/tests/clients/openai_client.py migrate --base "$base" --decode-pids "$pid_d,$pid_d2" \
    --decode-logs "$work/d.log,$work/d2.log" || failures=$((failures + 1))
grep -q '^prefill_router_migrations_total{reason="connection_dropped"} 1' <<<"$(curl -s -m 5 "$base/metrics")" \
    && pass "/metrics counts the migration" || fail "/metrics: no migration counted"

if (( failures > 0 )); then
    echo "clients: $failures failure(s)"
    exit 1
fi
echo "clients: every check passed"
