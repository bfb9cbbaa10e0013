#!/usr/bin/env python3
"""CPU and memory of N `mock-vllm` engines, idle and under an open-loop load (docs/engines.md,
"The mock vLLM engine"). Standard library only.

    python3 tools/tests/engines/mock_vllm_load.py --bin target/release/mock-vllm \
        --engines 8 --rate 20 --seconds 30

Starts the engines (half with KV events and replay, as a prefill pool would run), measures
their CPU seconds (utime + stime from /proc) and RSS over an idle window, then sends
`--rate` requests per second spread round robin over them for `--seconds` (token-id prompts of
512 tokens sharing a 256-token prefix per group of 8, `max_tokens` 32, every other request
streamed) and measures again. Prints one FIGURE line per window and stops the engines with
SIGTERM (checking they exit cleanly).
"""
import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def start(binary, n):
    procs, ports = [], []
    for i in range(n):
        args = [binary, "--port", "0", "--seed", str(i)]
        if i % 2 == 0:
            args += ["--kv-events-port", "0", "--kv-replay-port", "0"]
        p = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        ready = json.loads(p.stdout.readline())
        assert ready["event"] == "ready", ready
        procs.append(p)
        ports.append(ready["port"])
    return procs, ports


def request(port, n, stream):
    group = n % 8
    prompt = [4 + (group * 131 + i * 17) % 1000 for i in range(256)]
    prompt += [4 + (n * 7919 + i * 31) % 1000 for i in range(256)]
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 32, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    r.read()
    conn.close()
    return r.status


def window(procs, seconds, label, extra=""):
    before = [cpu_seconds(p.pid) for p in procs]
    time.sleep(seconds)
    after = [cpu_seconds(p.pid) for p in procs]
    cpu = sum(a - b for a, b in zip(after, before))
    rss = [rss_mib(p.pid) for p in procs]
    print(f"FIGURE mock-vllm {label}: {len(procs)} engines, {seconds} s: CPU {cpu:.2f} s "
          f"({100 * cpu / seconds:.1f}% of one core), RSS {min(rss):.1f} to {max(rss):.1f} MiB "
          f"per engine ({sum(rss):.0f} MiB total){extra}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--seconds", type=int, default=30)
    a = ap.parse_args()
    procs, ports = start(a.bin, a.engines)
    try:
        time.sleep(1)
        window(procs, a.seconds, "idle")
        statuses, lock, threads = [], threading.Lock(), []

        def one(n):
            s = request(ports[n % len(ports)], n, n % 2 == 1)
            with lock:
                statuses.append(s)

        def load():
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.seconds:
                due = t0 + n / a.rate
                time.sleep(max(0.0, due - time.time()))
                t = threading.Thread(target=one, args=(n,))
                t.start()
                threads.append(t)
                n += 1

        driver = threading.Thread(target=load)
        driver.start()
        window(procs, a.seconds, f"{a.rate:g} req/s", "")
        driver.join()
        for t in threads:
            t.join()
        ok = sum(1 for s in statuses if s == 200)
        print(f"FIGURE mock-vllm load: {ok} of {len(statuses)} requests answered 200", flush=True)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=10) for p in procs]
        print(f"FIGURE mock-vllm SIGTERM: exit codes {sorted(set(codes))}", flush=True)
        if any(codes):
            sys.exit(1)


if __name__ == "__main__":
    main()
