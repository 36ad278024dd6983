"""What a request's first step costs when its context is already there.

D's first step after a KV load computes one token over a context it did
not compute (the prompt's KV came from P). On one plain vLLM engine (no
connector, core 0), the same case is a prompt that is all in the prefix
cache but its last token (prompt length ``k * block_size + 1``, sent twice:
the second time only one token is computed). This prints, side by side in
one run, the TTFT of:

* ``one_token``: a 1-token prompt (the request path and one small step);
* ``fresh_N``: an N-token prompt computed from scratch;
* ``cached_N``: the same prompt again (N - 1 tokens from the prefix cache);

and the decode step (inter-token gap) of the fresh requests. Beside each
TTFT, from the engine's own histograms (one request at a time, so each
delta is one request's): ``prefill`` (vLLM's
``request_prefill_time``: first scheduled to first token, the engine's
step or steps) and ``queue`` (``request_queue_time``: arrival at the engine
core to first scheduled); the rest of the TTFT is the request path (API
server, input processing, the trip to the engine core and back). Requests
go one at a time with 1.2 s of quiet between them (a plain engine's
workers spin for 1 s after every step); medians.

    python benchmarks/bench_cached_first_step.py --lengths 33,289,577 --rounds 12
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
import urllib.request
from pathlib import Path

from vllm_pd_ext.tools.launch import Engine

#: vLLM's per-request histograms (their ``_sum``, seconds): engine-side
#: prefill (first scheduled to first token), then queue (arrival to first
#: scheduled).
HISTOGRAMS = ("vllm:request_prefill_time_seconds_sum", "vllm:request_queue_time_seconds_sum")


def stream(url: str, model: str, prompt: list[int], n: int = 8) -> tuple[float, list[float]]:
    """TTFT (ms) and the inter-token gaps (ms) of one streamed request."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "stream": True, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    stamps: list[float] = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter() - t0)
    return 1000 * stamps[0], [1000 * (b - a) for a, b in itertools.pairwise(stamps)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=".models/tiny")
    p.add_argument("--lengths", default="33,289,577",
                   help="prompt lengths (k * block size + 1: all but one token cached)")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--out-dir", default=".runs/cached-first-step")
    args = p.parse_args()
    model = str(Path(args.model).resolve())
    lengths = [int(x) for x in args.lengths.split(",")]
    engine = Engine("plain", model, Path(args.out_dir), connector=None, role=None,
                    cpu_bind="0", kv_bytes=1 << 30, max_model_len=4096, taskset=True).start()
    rng = random.Random(33)
    res: dict[str, list[float]] = {}
    steps: list[float] = []
    parts: dict[str, list[tuple[float, float]]] = {}

    def one(name: str, prompt: list[int]) -> None:
        before = engine.metrics()
        ttft, gaps = stream(engine.url, model, prompt)
        after = engine.metrics()
        res.setdefault(name, []).append(ttft)
        if name.startswith("fresh"):
            steps.extend(gaps)
        parts.setdefault(name, []).append(tuple(  # type: ignore[arg-type]
            1000 * (after.get(k, 0.0) - before.get(k, 0.0)) for k in HISTOGRAMS))
        time.sleep(1.2)

    try:
        engine.wait_ready(timeout=900)
        for _ in range(args.rounds):
            one("one_token", [rng.randrange(10, 3000)])
            for n in lengths:
                prompt = [rng.randrange(10, 3000) for _ in range(n)]
                one(f"fresh_{n}", prompt)
                one(f"cached_{n}", prompt)
    finally:
        engine.stop()
    print(f"{Path(args.model).name}, one request at a time, {args.rounds} rounds, medians "
          f"(decode step {statistics.median(steps):.1f} ms):")
    print(f"  {'request':>12}  {'TTFT ms':>8}  {'prefill ms':>10}  {'queue ms':>8}  "
          f"{'request path ms':>15}")
    for name, values in res.items():
        prefill = statistics.median(p for p, _ in parts[name])
        queue = statistics.median(q for _, q in parts[name])
        ttft = statistics.median(values)
        print(f"  {name:>12}  {ttft:8.1f}  {prefill:10.1f}  {queue:8.1f}  "
              f"{ttft - prefill - queue:15.1f}")


if __name__ == "__main__":
    main()
