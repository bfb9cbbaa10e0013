"""`serve` in front of a real vLLM P/D pair, checked as a user would: with the `openai` client.

Run by `.ci/vllm.sh` (which starts the engines) with the engine venv's python (it has `openai`):

    python vllm_e2e.py --bin target/release/prefill-router --prefill 127.0.0.1:P \
        --decode 127.0.0.1:D --model-dir DIR --work TMPDIR [--agreement N] [--figures N]

Every check prints PASS or FAIL; the exit status is the number of failures (0: all passed).
Every process it starts is killed at exit; every wait is bounded. Figures (`--figures N`) print
lines starting with FIGURE (docs/performance.md, "Real engines").
"""
import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import openai

ap = argparse.ArgumentParser()
ap.add_argument("--bin", required=True)
ap.add_argument("--prefill", required=True, help="HOST:PORT of the prefill engine")
ap.add_argument("--decode", required=True, help="HOST:PORT of the decode engine")
ap.add_argument("--model-dir", required=True)
ap.add_argument("--model", default="tiny-llama")
ap.add_argument("--work", required=True)
ap.add_argument("--agreement", type=int, default=20, help="greedy prompts compared (issue: 100)")
ap.add_argument("--figures", type=int, default=0, help="interleaved TTFT samples per side")
args = ap.parse_args()

failures = 0
procs = []


def check(name, ok, detail=""):
    global failures
    print(("PASS " if ok else "FAIL ") + name + ("" if ok else ": " + str(detail)), flush=True)
    if not ok:
        failures += 1


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start(name, argv):
    out = open(os.path.join(args.work, name + ".log"), "w")
    err = open(os.path.join(args.work, name + ".err"), "w")
    proc = subprocess.Popen(argv, stdout=out, stderr=err)
    procs.append(proc)
    return proc


def wait_event(name, event, timeout=60):
    path = os.path.join(args.work, name + ".log")
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            for line in open(path):
                if f'"event":"{event}"' in line:
                    return json.loads(line)
        except FileNotFoundError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{name}: no {event} event within {timeout} s; stderr: "
                       + open(os.path.join(args.work, name + ".err")).read()[-2000:])


def get(url, timeout=10):
    return urllib.request.urlopen(url, timeout=timeout).read().decode()


def wait_ready(base, timeout=60):
    """Ready with the prefill pool active: /ready answers 200 as soon as decode can serve
    (bypassing prefill), which is too early for checks of the disaggregated path."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            answer = urllib.request.urlopen(base + "/ready", timeout=2)
            if answer.status == 200 and json.loads(answer.read()).get("lifecycle") == "active":
                return True
        except Exception:
            pass
        time.sleep(0.2)
    return False


def metric(base, name, labels=""):
    total = 0.0
    for line in get(base + "/metrics").splitlines():
        if line.startswith(name) and labels in line and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def cleanup(*_):
    for p in procs:
        if p.poll() is None:
            p.kill()


signal.signal(signal.SIGTERM, lambda *a: (cleanup(), sys.exit(1)))
P = "http://" + args.prefill
D = "http://" + args.decode
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
rng = random.Random(7)


def prompt_ids(n):
    return [rng.randrange(4, 1000) for _ in range(n)]


def compare_with_decode_alone(client, alone, label):
    """Completions, chat, streaming and not: serve's greedy text equals the decode engine's."""
    ids = prompt_ids(120)
    ref = alone.completions.create(model=args.model, prompt=ids, max_tokens=16, **GREEDY)
    got = client.completions.create(model=args.model, prompt=ids, max_tokens=16, **GREEDY)
    check(f"{label}: completion (token ids) equals the decode engine alone",
          got.choices[0].text == ref.choices[0].text, (got.choices[0].text, ref.choices[0].text))
    check(f"{label}: usage is the engine's", got.usage.prompt_tokens == 120
          and got.usage.completion_tokens == 16, got.usage)
    text = "def route(request):\n    return pool.pick(request) if pool else None\n" * 3
    ref = alone.completions.create(model=args.model, prompt=text, max_tokens=16, **GREEDY)
    got = client.completions.create(model=args.model, prompt=text, max_tokens=16, **GREEDY)
    check(f"{label}: completion (text, the model's tokenizer) equals the decode engine alone",
          got.choices[0].text == ref.choices[0].text
          and got.usage.prompt_tokens == ref.usage.prompt_tokens,
          (got.choices[0].text, ref.choices[0].text, got.usage, ref.usage))
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=args.model, prompt=text, max_tokens=16, stream=True, **GREEDY) if c.choices)
    check(f"{label}: streamed completion equals the decode engine alone",
          streamed == ref.choices[0].text, (streamed, ref.choices[0].text))
    messages = [{"role": "system", "content": "You route requests."},
                {"role": "user", "content": "Which worker holds my prefix?"}]
    ref = alone.chat.completions.create(model=args.model, messages=messages, max_tokens=16, **GREEDY)
    got = client.chat.completions.create(model=args.model, messages=messages, max_tokens=16, **GREEDY)
    check(f"{label}: chat (the model's template) equals the decode engine alone",
          got.choices[0].message.content == ref.choices[0].message.content
          and got.usage.prompt_tokens == ref.usage.prompt_tokens,
          (got.choices[0].message.content, ref.choices[0].message.content, got.usage, ref.usage))
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=args.model, messages=messages, max_tokens=16, stream=True, **GREEDY) if c.choices)
    check(f"{label}: streamed chat equals the decode engine alone",
          streamed == ref.choices[0].message.content, (streamed, ref.choices[0].message.content))


def serve_static():
    port = free_port()
    start("serve-static", [args.bin, "serve", "--engine", "vllm", "--prefill-url", P,
                           "--decode-url", D, "--listen", f"127.0.0.1:{port}",
                           "--tokenizer", args.model_dir, "--model", args.model])
    wait_event("serve-static", "listening")
    return f"http://127.0.0.1:{port}"


def serve_registered():
    store = "file://" + os.path.join(args.work, "store")
    for name, role, url, iid in (("reg-p", "prefill", P, "1"), ("reg-d", "decode", D, "100")):
        start(name, [args.bin, "register", "--engine", "vllm", "--role", role, "--url", url,
                     "--discovery", store, "--namespace", "eng", "--id", iid])
        wait_event(name, "registered")
    port = free_port()
    start("serve-reg", [args.bin, "serve", "--discovery", store, "--namespace", "eng",
                        "--listen", f"127.0.0.1:{port}", "--tokenizer", args.model_dir,
                        "--model", args.model])
    wait_event("serve-reg", "listening")
    return f"http://127.0.0.1:{port}"


def agreement(client, alone, n):
    same = 0
    for i in range(n):
        ids = prompt_ids(rng.randrange(40, 400))
        ref = alone.completions.create(model=args.model, prompt=ids, max_tokens=16, **GREEDY)
        got = client.completions.create(model=args.model, prompt=ids, max_tokens=16, **GREEDY)
        same += got.choices[0].text == ref.choices[0].text
    print(f"FIGURE greedy_agreement={same}/{n}", flush=True)
    check(f"greedy output agrees on {n} prompts", same == n, f"{same}/{n}")


def ttft(client, ids):
    t = time.perf_counter()
    stream = client.completions.create(model=args.model, prompt=ids, max_tokens=32, stream=True,
                                       **GREEDY)
    first = None
    n = 0
    for c in stream:
        if c.choices and c.choices[0].text and first is None:
            first = time.perf_counter() - t
        n += 1 if c.choices else 0
    return first, time.perf_counter() - t


def figures(client, alone, n):
    hop, direct = [], []
    hop_total = direct_total = 0.0
    for i in range(n):
        ids = prompt_ids(256)
        # Interleaved, alternating which goes first, so load drifts hit both alike.
        order = [(client, hop), (alone, direct)] if i % 2 == 0 else [(alone, direct), (client, hop)]
        for c, out in order:
            first, total = ttft(c, ids)
            out.append(first)
            if out is hop:
                hop_total += total
            else:
                direct_total += total
    with open(os.path.join(args.work, "ttft.json"), "w") as f:
        json.dump({"hop": hop, "decode_alone": direct}, f)
    q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]
    print(f"FIGURE ttft_ms hop p50={q(hop, .5)*1e3:.1f} p99={q(hop, .99)*1e3:.1f} "
          f"decode_alone p50={q(direct, .5)*1e3:.1f} p99={q(direct, .99)*1e3:.1f} n={n}")
    print(f"FIGURE throughput_tok_s hop={32*n/hop_total:.1f} decode_alone={32*n/direct_total:.1f}")


try:
    alone = openai.OpenAI(base_url=D + "/v1", api_key="none", max_retries=0, timeout=120)
    hits_before = metric(D, "vllm:external_prefix_cache_hits_total")
    base = serve_static()
    check("static: serve is ready", wait_ready(base))
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    models = [m.id for m in client.models.list().data]
    check("static: /v1/models lists the engine's model", args.model in models, models)
    # A prompt the decode engine has never seen: its KV must come over the connector.
    fresh = [random.randrange(4, 1000) for _ in range(200)]  # unseeded: new on every run
    got = client.completions.create(model=args.model, prompt=fresh, max_tokens=4, **GREEDY)
    # The engine's counters follow its steps, not its answers: read until they show (bounded).
    for _ in range(50):
        hits = metric(D, "vllm:external_prefix_cache_hits_total") - hits_before
        if hits >= 200:
            break
        time.sleep(0.2)
    check("static: the decode engine pulled the prompt over the connector "
          "(external prefix cache hits)", hits >= 200, hits)
    check("static: usage of a pulled prompt", got.usage.prompt_tokens == 200
          and got.usage.completion_tokens == 4, got.usage)
    compare_with_decode_alone(client, alone, "static")
    issued = metric(base, "prefill_router_handoffs_total", 'ending="issued"')
    delivered = metric(base, "prefill_router_handoffs_total", 'ending="delivered"')
    check("static: every handoff delivered", issued >= 5 and issued == delivered,
          (issued, delivered))
    agreement(client, alone, args.agreement)
    if args.figures:
        figures(client, alone, args.figures)
    base = serve_registered()
    check("register: serve is ready", wait_ready(base))
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    compare_with_decode_alone(client, alone, "register")
    # SIGTERM on the prefill sidecar: the engine leaves the set first; requests then bypass
    # to the decode engine (the default fallback) and still answer.
    reg_p = procs[-3]
    reg_p.send_signal(signal.SIGTERM)
    check("register: the sidecar exits 0 on SIGTERM", reg_p.wait(timeout=30) == 0)
    got = client.completions.create(model=args.model, prompt=prompt_ids(50), max_tokens=4, **GREEDY)
    check("register: with the prefill engine withdrawn, requests still answer (bypass)",
          len(got.choices[0].text) > 0 or got.usage.completion_tokens == 4, got)
except Exception as e:  # a crash is a failure, with its reason
    check("the run completed", False, repr(e))
finally:
    cleanup()
print(f"{failures} failed", flush=True)
sys.exit(min(failures, 100))
