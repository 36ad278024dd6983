"""What a request's first step costs when its context is already there.

D's first step after a KV load computes one token over a context it did
not compute (the prompt's KV came from P). On one plain vLLM engine (no
connector, core 0), the same case is a prompt that is all in the prefix
cache but its last token (prompt length ``k * block_size + 1``, sent twice:
the second time only one token is computed; vLLM caches whole blocks only,
so the block size is read from the engine's ``vllm:cache_config_info``:
128 on vLLM's CPU build, 16 on a GPU). This prints, side by side in one
run, the TTFT of:

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

    python benchmarks/bench_cached_first_step.py --blocks 0,2,4 --rounds 12

A first version of this probe took the lengths 33, 289 and 577 for
``k * 16 + 1``: with 128-token blocks its "cached" requests computed 33 to
65 tokens, not one, and it reported a 20 ms first-step premium that does
not exist (docs/slo.md).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import statistics
import time
import urllib.request
from pathlib import Path

from vllm_pd_ext.tools.launch import Engine

#: vLLM's per-request histograms (their ``_sum``, seconds): engine-side
#: prefill (first scheduled to first token), then queue (arrival to first
#: scheduled).
HISTOGRAMS = ("vllm:request_prefill_time_seconds_sum", "vllm:request_queue_time_seconds_sum")
HITS = "vllm:prefix_cache_hits_total"


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


def block_size(url: str) -> int:
    """The engine's KV block size, from its ``vllm:cache_config_info`` gauge."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r'^vllm:cache_config_info\{[^}]*block_size="(\d+)"', text, re.M)
    if m is None:
        raise RuntimeError("the engine's /metrics has no vllm:cache_config_info block_size")
    return int(m.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=".models/tiny")
    p.add_argument("--blocks", default="0,2,4",
                   help="prompt lengths in whole blocks k (prompt: k * block size + 1 "
                        "tokens, all but the last one cached the second time)")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--out-dir", default=".runs/cached-first-step")
    args = p.parse_args()
    model = str(Path(args.model).resolve())
    engine = Engine("plain", model, Path(args.out_dir), connector=None, role=None,
                    cpu_bind="0", kv_bytes=1 << 30, max_model_len=4096, taskset=True).start()
    rng = random.Random(33)
    res: dict[str, list[float]] = {}
    steps: list[float] = []
    parts: dict[str, list[tuple[float, float]]] = {}
    #: Tokens each request computed: its prompt less the engine's prefix
    #: cache hits (the check that "cached" computed one token).
    computed: dict[str, list[float]] = {}

    def one(name: str, prompt: list[int]) -> None:
        before = engine.metrics()
        ttft, gaps = stream(engine.url, model, prompt)
        after = engine.metrics()
        res.setdefault(name, []).append(ttft)
        if name.startswith("fresh"):
            steps.extend(gaps)
        parts.setdefault(name, []).append(tuple(  # type: ignore[arg-type]
            1000 * (after.get(k, 0.0) - before.get(k, 0.0)) for k in HISTOGRAMS))
        hits = after.get(HITS, 0.0) - before.get(HITS, 0.0)
        computed.setdefault(name, []).append(len(prompt) - hits)
        time.sleep(1.2)

    try:
        engine.wait_ready(timeout=900)
        block = block_size(engine.url)
        lengths = [k * block + 1 for k in (int(x) for x in args.blocks.split(","))]
        print(f"block size {block}: prompt lengths {lengths}", flush=True)
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
    print(f"  {'request':>12}  {'computed':>8}  {'TTFT ms':>8}  {'prefill ms':>10}  "
          f"{'queue ms':>8}  {'request path ms':>15}")
    for name, values in res.items():
        prefill = statistics.median(p for p, _ in parts[name])
        queue = statistics.median(q for _, q in parts[name])
        ttft = statistics.median(values)
        tokens = statistics.median(computed[name])
        print(f"  {name:>12}  {tokens:8.0f}  {ttft:8.1f}  {prefill:10.1f}  {queue:8.1f}  "
              f"{ttft - prefill - queue:15.1f}")


if __name__ == "__main__":
    main()
