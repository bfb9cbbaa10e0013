"""Two prefill engines and one decode engine behind `serve --engine vllm`, checked with the
`openai` client; one prefill engine is SIGKILLed mid-run. Run by `.ci/vllm.sh`:

    python vllm_two_prefill.py --bin BIN --prefill 127.0.0.1:P1,127.0.0.1:P2 --decode 127.0.0.1:D \
        --kill-pid PID_OF_P2 --model-dir DIR --work TMPDIR

Checks (PASS/FAIL lines; exit status = failures): requests reach both prefill engines; after
the SIGKILL of the second one no request fails (a refused prefill is retried on the other
engine, then the engine is withdrawn from the set); the dead engine leaves the routable set.
A FIGURE line says whether a growing conversation stayed on one prefill engine under
`--router-mode kv` (measured, not asserted: issue #40 is about exactly that).
"""
import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import openai

ap = argparse.ArgumentParser()
ap.add_argument("--bin", required=True)
ap.add_argument("--prefill", required=True, help="HOST:PORT,HOST:PORT")
ap.add_argument("--decode", required=True)
ap.add_argument("--kill-pid", type=int, required=True, help="the second prefill engine's pid")
ap.add_argument("--model-dir", required=True)
ap.add_argument("--model", default="tiny-llama")
ap.add_argument("--work", required=True)
args = ap.parse_args()

failures = 0
procs = []


def check(name, ok, detail=""):
    global failures
    print(("PASS " if ok else "FAIL ") + name + ("" if ok else ": " + str(detail)), flush=True)
    failures += 0 if ok else 1


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def serve(name, extra):
    port = free_port()
    prefill = ",".join("http://" + p for p in args.prefill.split(","))
    err = open(os.path.join(args.work, name + ".err"), "w")
    out = open(os.path.join(args.work, name + ".log"), "w")
    procs.append(subprocess.Popen(
        [args.bin, "serve", "--engine", "vllm", "--prefill-url", prefill,
         "--decode-url", "http://" + args.decode, "--listen", f"127.0.0.1:{port}",
         "--tokenizer", args.model_dir, "--model", args.model] + extra, stdout=out, stderr=err))
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        log = open(os.path.join(args.work, name + ".err")).read()
        if log.count("(prefill) registered") >= 2:
            break
        time.sleep(0.2)
    else:
        raise RuntimeError(f"{name}: the prefill engines did not register: {log[-2000:]}")
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(base + "/ready", timeout=2).status == 200:
                break
        except Exception:
            time.sleep(0.2)
    return base


def completion(client, ids, max_tokens=4):
    raw = client.completions.with_raw_response.create(
        model=args.model, prompt=ids, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True})
    return raw.headers.get("x-prefill-worker"), raw.parse()


rng = random.Random()
try:
    # A growing conversation under KV routing (measured).
    base = serve("serve-kv", ["--router-mode", "kv"])
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    history = [rng.randrange(4, 1000) for _ in range(256)]
    workers = []
    for turn in range(6):
        history += [rng.randrange(4, 1000) for _ in range(48)]
        worker, _ = completion(client, history)
        workers.append(worker)
    stayed = len(set(workers[1:])) == 1 and workers[1] == workers[0]
    print(f"FIGURE conversation_prefill_workers={','.join(map(str, workers))} stayed={stayed}",
          flush=True)
    procs.pop().kill()

    # Round robin over both engines, then one of them SIGKILLed: nothing fails.
    base = serve("serve-rr", [])
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    seen = set()
    for _ in range(6):
        worker, got = completion(client, [rng.randrange(4, 1000) for _ in range(100)])
        seen.add(worker)
    check("requests reach both prefill engines", len(seen) == 2, seen)
    os.kill(args.kill_pid, signal.SIGKILL)
    failed = 0
    workers_after = []
    for i in range(12):
        try:
            worker, got = completion(client, [rng.randrange(4, 1000) for _ in range(100)])
            workers_after.append(worker)
            failed += got.usage.completion_tokens != 4
        except Exception as e:
            failed += 1
            print("request failed:", repr(e), flush=True)
    check("no request fails after a prefill engine is SIGKILLed", failed == 0, failed)
    log = open(os.path.join(args.work, "serve-rr.err")).read()
    deadline = time.time() + 30
    while "(prefill) withdrawn" not in log and time.time() < deadline:
        time.sleep(0.5)
        log = open(os.path.join(args.work, "serve-rr.err")).read()
    check("the dead prefill engine is withdrawn from the set", "(prefill) withdrawn" in log,
          log[-1000:])
    print(f"FIGURE prefill_workers_after_kill={','.join(map(str, workers_after))}", flush=True)
except Exception as e:
    check("the run completed", False, repr(e))
finally:
    for p in procs:
        if p.poll() is None:
            p.kill()
print(f"{failures} failed", flush=True)
sys.exit(min(failures, 100))
