#!/usr/bin/env python3
"""Real-client checks of `prefill-router serve` with the `openai` package (run by .ci/clients.sh).

Each check prints PASS or FAIL; the exit status is non-zero if any failed. Phases:
  basic   streaming chat, non-streaming completion, models, a client disconnect mid-stream
  kill    traffic while prefill worker --kill-pid is SIGKILLed: in-flight requests end with a
          typed error, none hangs, later requests go to --survivor
  keys    --base needs an API key: with --api-key the client is served (streaming too), without
          it (or with a wrong one) every call raises openai.AuthenticationError
  bypass  no prefill worker left: --base (policy decode) serves through decode (--decode-id),
          --strict-base (policy reject) answers 503
  migrate a long streaming generation whose decode worker is SIGKILLed mid-way (of
          --decode-pids / --decode-logs, the one whose log shows the request) completes, its
          text equal to an uninterrupted run's, one finish_reason, usage counting each token once
"""
import argparse
import os
import signal
import sys
import threading
import time

import openai

FAILED = []


def check(name, ok, detail=""):
    print(("PASS " if ok else "FAIL ") + name + (f": {detail}" if detail and not ok else ""))
    if not ok:
        FAILED.append(name)


def client(base, timeout=10.0):
    return openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=timeout, max_retries=0)


def prefill_worker(raw):
    value = raw.headers.get("x-prefill-worker")
    return int(value) if value is not None else None


def basic(args):
    c = client(args.base)
    models = c.models.list()
    check("models lists mock-llm", [m.id for m in models.data] == ["mock-llm"], models)

    done = c.completions.create(model="mock-llm", prompt="Say hello", max_tokens=5)
    check(
        "non-streaming completion",
        done.object == "text_completion"
        and done.usage.completion_tokens == 5
        and done.choices[0].finish_reason == "length"
        and len(done.choices[0].text.split()) == 5,
        done,
    )

    messages = [{"role": "user", "content": "What is a prefill hop?"}]
    stream = c.chat.completions.create(
        model="mock-llm", messages=messages, max_tokens=6, stream=True
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    check(
        "streaming chat completion",
        len(chunks) == 6
        and chunks[0].choices[0].delta.role == "assistant"
        and chunks[-1].choices[0].finish_reason == "length"
        and len(text.split()) == 6,
        chunks,
    )

    # stream_options.include_usage: a last chunk with usage and no choices, as OpenAI sends.
    stream = c.chat.completions.create(
        model="mock-llm",
        messages=messages,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    last = chunks[-1] if chunks else None
    check(
        "streaming chat with include_usage ends with a usage chunk",
        len(chunks) == 5
        and last.choices == []
        and last.usage is not None
        and last.usage.completion_tokens == 4
        and last.usage.total_tokens == last.usage.prompt_tokens + 4
        and all(ch.usage is None for ch in chunks[:-1]),
        chunks,
    )
    done = c.completions.create(model="mock-llm", prompt=[[1, 2, 3]], max_tokens=2)
    check(
        "completion of a token-list prompt",
        done.usage.prompt_tokens == 3 and done.usage.completion_tokens == 2,
        done,
    )

    # A second turn extends the first: its prompt shares the first's prefix blocks.
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "More?"}]
    raw = c.chat.completions.with_raw_response.create(
        model="mock-llm", messages=messages, max_tokens=3
    )
    reply = raw.parse()
    check(
        "second chat turn through a prefill worker",
        reply.choices[0].message.content.strip() != ""
        and prefill_worker(raw) in args.prefill_ids,
        (raw.headers, reply),
    )

    # Client disconnect mid-stream: read a few chunks, close the response.
    stream = c.chat.completions.create(
        model="mock-llm",
        messages=[{"role": "user", "content": "a long answer please"}],
        max_tokens=2000,
        stream=True,
    )
    got = 0
    for _ in stream:
        got += 1
        if got == 3:
            break
    stream.close()
    check("disconnect after 3 chunks", got == 3)


def kill(args):
    c = client(args.base, timeout=15.0)
    results = []
    lock = threading.Lock()

    def one(n):
        prompt = " ".join(f"w{n}x{i}" for i in range(64))
        start = time.monotonic()
        try:
            raw = c.completions.with_raw_response.create(
                model="mock-llm", prompt=prompt, max_tokens=2
            )
            outcome = ("ok", prefill_worker(raw))
        except openai.APIStatusError as e:
            outcome = ("error", e.status_code, e.body)
        except Exception as e:  # a hang (timeout) or a broken connection: both fail the check
            outcome = ("broken", repr(e))
        with lock:
            results.append((outcome, time.monotonic() - start))

    threads = [threading.Thread(target=one, args=(n,)) for n in range(8)]
    def requests_seen():
        with open(args.kill_log) as log:
            return log.read().count('"event":"request"')

    before = requests_seen()
    for t in threads:
        t.start()
    # Kill the worker once a request of this traffic runs on it (its log says so), at most 10 s.
    deadline = time.monotonic() + 10
    while requests_seen() == before and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(args.kill_pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=20)
    check("no request hangs", all(not t.is_alive() for t in threads) and len(results) == 8, results)
    typed = [o for o, _ in results if o[0] == "error"]
    broken = [o for o, _ in results if o[0] == "broken"]
    check("every request ends with a response or a typed error", not broken, results)
    print(f"NOTE {len(typed)} of 8 requests were in flight on the killed worker and failed (typed)")
    check(
        "typed errors are 502/503 with an OpenAI error body",
        all(o[1] in (502, 503) and isinstance(o[2], dict) and "code" in o[2] for o in typed),
        typed,
    )
    later = []
    for n in range(100, 110):
        raw = c.completions.with_raw_response.create(
            model="mock-llm", prompt=f"later request {n}", max_tokens=2
        )
        later.append(prefill_worker(raw))
    check("later requests route to the survivor", later == [args.survivor] * 10, later)


def bypass(args):
    c = client(args.base)
    raw = c.chat.completions.with_raw_response.create(
        model="mock-llm", messages=[{"role": "user", "content": "hello"}], max_tokens=2
    )
    check(
        "policy decode bypasses to decode",
        prefill_worker(raw) == args.decode_id and raw.parse().usage.completion_tokens == 2,
        raw.headers,
    )
    strict = client(args.strict_base)
    try:
        strict.chat.completions.create(
            model="mock-llm", messages=[{"role": "user", "content": "hello"}], max_tokens=2
        )
        check("policy reject answers 503", False, "the request succeeded")
    except openai.APIStatusError as e:
        check(
            "policy reject answers 503",
            e.status_code == 503 and e.body.get("code") == "prefill_not_active",
            (e.status_code, e.body),
        )


def keys(args):
    messages = [{"role": "user", "content": "hello"}]
    good = openai.OpenAI(
        base_url=args.base + "/v1", api_key=args.api_key, timeout=10.0, max_retries=0
    )
    done = good.chat.completions.create(model="mock-llm", messages=messages, max_tokens=3)
    check("keys: the right api_key is served", done.usage.completion_tokens == 3, done)
    chunks = list(
        good.chat.completions.create(
            model="mock-llm", messages=messages, max_tokens=3, stream=True
        )
    )
    check("keys: streaming with the right api_key", len(chunks) == 3, chunks)
    for name, bad in [("no api_key", client(args.base)), ("a wrong api_key", openai.OpenAI(
        base_url=args.base + "/v1", api_key=args.api_key + "x", timeout=10.0, max_retries=0
    ))]:
        for call in ["chat", "models"]:
            try:
                if call == "chat":
                    bad.chat.completions.create(model="mock-llm", messages=messages, max_tokens=3)
                else:
                    bad.models.list()
                check(f"keys: {name} is refused ({call})", False, "it was served")
            except openai.AuthenticationError as error:
                check(
                    f"keys: {name} raises openai.AuthenticationError ({call})",
                    error.status_code == 401
                    and error.code == "invalid_api_key"
                    and args.api_key not in str(error),
                    error,
                )


def migrate(args):
    c = client(args.base, timeout=30.0)
    messages = [{"role": "user", "content": "Tell a long story about a prefill hop."}]
    tokens = 300  # 1.5 s at the decode workers' 5 ms a token

    def run(kill_after=None):
        logs = [open(path).read().count('"event":"request"') for path in args.decode_logs]
        stream = c.chat.completions.create(
            model="mock-llm", messages=messages, max_tokens=tokens, stream=True,
            stream_options={"include_usage": True},
        )
        text, finishes, usage, chunks, killed = "", [], None, 0, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    text += choice.delta.content
                    chunks += 1
                if choice.finish_reason is not None:
                    finishes.append(choice.finish_reason)
            if kill_after is not None and killed is None and chunks >= kill_after:
                # The decode worker serving this stream: the one whose log gained a request.
                now = [open(path).read().count('"event":"request"') for path in args.decode_logs]
                serving = [k for k, (a, b) in enumerate(zip(logs, now)) if b > a]
                killed = serving[0] if len(serving) == 1 else -1
                if killed >= 0:
                    os.kill(args.decode_pids[killed], signal.SIGKILL)
        return text, finishes, usage, chunks, killed

    reference = run()
    check(
        "migrate: an uninterrupted long generation",
        reference[3] == tokens and reference[1] == ["length"]
        and reference[2].completion_tokens == tokens,
        reference[1:],
    )
    text, finishes, usage, chunks, killed = run(kill_after=60)
    check("migrate: the serving decode worker was found and SIGKILLed mid-stream", killed >= 0, killed)
    check(
        "migrate: the stream completes with every token once",
        chunks == tokens and finishes == ["length"],
        (chunks, finishes),
    )
    check("migrate: its text equals the uninterrupted run's", text == reference[0],
          (text[:80], reference[0][:80]))
    check(
        "migrate: usage counts the prompt and each token once",
        usage is not None and usage.completion_tokens == tokens
        and usage.prompt_tokens == reference[2].prompt_tokens,
        (usage, reference[2]),
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["basic", "kill", "keys", "bypass", "migrate"])
    parser.add_argument("--base", required=True)
    parser.add_argument("--strict-base")
    parser.add_argument("--prefill-ids", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    parser.add_argument("--kill-pid", type=int)
    parser.add_argument("--kill-log", help="the killed worker's stdout (run with --print-requests)")
    parser.add_argument("--survivor", type=int)
    parser.add_argument("--decode-id", type=int)
    parser.add_argument("--api-key", help="the key serve accepts (phase keys)")
    parser.add_argument("--decode-pids", type=lambda s: [int(x) for x in s.split(",")], default=[])
    parser.add_argument("--decode-logs", type=lambda s: s.split(","), default=[],
                        help="the decode workers' stdout, in --decode-pids' order (--print-requests)")
    args = parser.parse_args()
    {"basic": basic, "kill": kill, "keys": keys, "bypass": bypass, "migrate": migrate}[args.phase](args)
    if FAILED:
        print(f"{len(FAILED)} check(s) failed: {FAILED}")
        sys.exit(1)


if __name__ == "__main__":
    main()
