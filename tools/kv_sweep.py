#!/usr/bin/env python3
"""Count the #40 goal misses of the KV cost under a `--kv-config` (docs/performance.md, "KV cost
at every block size": the sweep that re-derived the recent-work weight).

Runs every table of that section with `prefill-router replay` (release build, deterministic:
virtual time), the baselines (dynamo, dynamo-blocks, round-robin) once and the KV policy once per
config given, and prints each line that misses a goal: TTFT p99 over the better baseline, hit
rate under the Dynamo-style costs', work max/mean over 1.10, the conversation trace under 99% of
its ceiling.

    cargo build --release -p prefill-router-tools --bin prefill-router
    python3 tools/kv_sweep.py '{}' '{"prefill_recent_work_weight":0.3}'
    python3 tools/kv_sweep.py --seed 2 --closed-requests 3000 '{}'

The generated workloads' closed loops run 12,000 requests (`--closed-requests N`): with 3,000,
64 users starting at once are 2% of the run, so its TTFT p99 is the start's cold burst, not the
routing under load (docs/performance.md, "Closed loop over a grid"). `--seed S` runs the
generated workloads' closed loops from workload seed S (default 1).

Results are cached in target/kv-sweep/ by command line (delete it after rebuilding).
"""
import argparse
import hashlib
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release", "prefill-router")
TRACE = os.path.join(ROOT, "..", "shared", "traces", "mooncake_conversation_trace.jsonl")
CACHE = os.path.join(ROOT, "target", "kv-sweep")
GRID = "8:500,8:2000,32:500,32:2000,32:8000,64:2000"
SIZES = "16,32,128,512"
SUITE = [
    ("shared-prefix 5/s", ["--workload", "shared-prefix:rate=5"]),
    ("shared-prefix 15/s", ["--workload", "shared-prefix:rate=15"]),
    ("shared-prefix 25/s", ["--workload", "shared-prefix:rate=25"]),
    ("multi-tenant", ["--workload", "multi-tenant:rate=8"]),
    ("multi-tenant 500 blocks", ["--workload", "multi-tenant:rate=8", "--cache-blocks", "500"]),
    ("mooncake", ["--trace", TRACE]),
    ("mooncake 1000 blocks", ["--trace", TRACE, "--cache-blocks", "1000"]),
    ("conversation 10/s", ["--workload", "conversation:rate=10", "--block-tokens", SIZES]),
    ("conversation 20/s", ["--workload", "conversation:rate=20", "--block-tokens", SIZES]),
    ("conversation 40/s", ["--workload", "conversation:rate=40", "--block-tokens", SIZES]),
    ("shared-prefix closed", ["--workload", "shared-prefix:rate=5", "--closed-loop", GRID]),
    ("multi-tenant closed", ["--workload", "multi-tenant:rate=8", "--closed-loop", GRID]),
    ("conversation closed, 16", ["--workload", "conversation:rate=40", "--block-tokens", "16", "--closed-loop", GRID]),
    ("conversation closed, 512", ["--workload", "conversation:rate=40", "--block-tokens", "512", "--closed-loop", GRID]),
    ("mooncake closed", ["--trace", TRACE, "--closed-loop", GRID]),
]
BASELINES = "dynamo,dynamo-blocks,round-robin"
GENERATED = ("shared-prefix:", "multi-tenant:", "conversation:")
CLOSED = {"requests": 12000, "seed": 1}


def closed_args(args):
    """A generated workload's closed loop with the run's request count and seed."""
    if "--closed-loop" not in args:
        return args
    extra = f",requests={CLOSED['requests']},seed={CLOSED['seed']}"
    return [a + extra if a.startswith(GENERATED) else a for a in args]


def replay(args, policies, kv_config):
    cmd = [BIN, "replay", *closed_args(args), "--policy", policies, "--quiet"]
    if kv_config:
        cmd += ["--kv-config", json.dumps(kv_config)]
    key = hashlib.sha1(json.dumps(cmd).encode()).hexdigest()[:16]
    path = os.path.join(CACHE, key + ".json")
    if not os.path.exists(path):
        subprocess.run(cmd + ["--json", path], check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        return json.load(f)["runs"]


def point(run):
    return (tuple(run["closed_loop"]) if run.get("closed_loop") else None, run["block_tokens"])


def misses(kv_config, policy="kv-events"):
    out, lines = [], 0
    for name, args in SUITE:
        base = replay(args, BASELINES, {})
        for ours in replay(args, policy, kv_config):
            lines += 1
            same = [b for b in base if point(b) == point(ours)]
            best = min(b["ttft_ms"]["p99"] for b in same)
            dynamo_hit = max(b["prefix_hit_rate"] for b in same if b["policy"].startswith("dynamo"))
            p99, hit, imbalance = ours["ttft_ms"]["p99"], ours["prefix_hit_rate"], ours["work_imbalance"]
            where = f"{name} {point(ours)}"
            if p99 > best:
                out.append(f"{where}: TTFT p99 {p99:.0f} ms over the best baseline's {best:.0f} ({p99 / best - 1:+.1%})")
            if hit < dynamo_hit - 1e-9:
                out.append(f"{where}: hit rate {hit:.4f} under the Dynamo-style {dynamo_hit:.4f}")
            if imbalance > 1.10 + 5e-4:
                out.append(f"{where}: work max/mean {imbalance:.3f}")
            if name.startswith("mooncake") and ours["cache_blocks"] is None and ours["of_ceiling"] < 0.99:
                out.append(f"{where}: {ours['of_ceiling']:.1%} of the ceiling")
    return lines, out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="*", default=["{}"], help="--kv-config JSON, one sweep each")
    parser.add_argument("--closed-requests", type=int, default=CLOSED["requests"],
                        help="requests of each generated workload's closed loops (default 12000)")
    parser.add_argument("--seed", type=int, default=CLOSED["seed"],
                        help="workload seed of the generated workloads' closed loops (default 1)")
    options = parser.parse_args()
    CLOSED.update(requests=options.closed_requests, seed=options.seed)
    os.makedirs(CACHE, exist_ok=True)
    for raw in options.configs:
        lines, found = misses(json.loads(raw))
        print(f"--kv-config {raw}: {lines} lines, {len(found)} goal misses")
        for miss in found:
            print("  " + miss)


if __name__ == "__main__":
    main()
