"""What a step costs after the engine idled (issue 29: D's first step).

At idle, D's core has nothing to do while P prefills; D's first step (token
#2) then runs on an engine that idled for the length of P's prefill, while
the collocated engine computes token #2 right after its own prefill. This
probe measures that cost on one plain vLLM engine (no connector, its own
core): the same short prefill (``--prompt-tokens`` tokens, a fresh prompt
each time, one output token) sent after pauses of increasing length, the
engine's own time for it (vLLM's ``request_prefill_time``, scheduled to
first token) and the request's, p50 of ``--rounds`` per pause.

    python benchmarks/bench_idle_cost.py --pauses 0,0.02,0.2,1.5 --rounds 10
    python benchmarks/bench_idle_cost.py --quiet ...   # readers asleep, as in P and D

vLLM's own shared-memory queue readers spin for 1 s after every message;
``--quiet`` starts the engine with ``VLLM_PD_EXT_QUIET_SHM_SPIN=1``, so they
sleep on the queue's notification at once, as PDConnector makes P's and
D's on CPU (``quiet_shm_spin``): whether the idle cost is the vCPU halting
while nothing spins (then only ``--quiet`` pays it) or the engine's working
set leaving the caches (then both do).

The engine is started and ended by PID; its log stays under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from pathlib import Path

from vllm_pd_ext import QUIET_SPIN_ENV
from vllm_pd_ext.tools.launch import Engine

PREFILL_SUM = "vllm:request_prefill_time_seconds_sum"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=".models/tiny")
    p.add_argument("--pauses", default="0,0.02,0.2,1.5", help="seconds, comma-separated")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--core", default="1")
    p.add_argument("--quiet", action="store_true",
                   help="the engine's queue readers sleep instead of spinning 1 s "
                        "(VLLM_PD_EXT_QUIET_SHM_SPIN=1, as in P and D on CPU)")
    p.add_argument("--out-dir", default=".runs/idle-cost")
    return p.parse_args()


def post(url: str, body: dict[str, object]) -> float:
    """One completion; its latency in seconds."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()
    return time.monotonic() - t0


def main() -> None:
    args = parse_args()
    model = str(Path(args.model).resolve())
    engine = Engine("plain", model, Path(args.out_dir) / "logs", connector=None, role=None,
                    cpu_bind=args.core, taskset=True, kv_bytes=1 << 30, max_model_len=4096,
                    env={QUIET_SPIN_ENV: "1"} if args.quiet else {})
    n = args.prompt_tokens

    def body(i: int) -> dict[str, object]:
        # A fresh prompt each time: no prefix-cache hit.
        return {"model": model, "prompt": [11 + (i * 7 + k) % 900 for k in range(n)],
                "max_tokens": 1, "temperature": 0}

    rows = []
    try:
        engine.start()
        engine.wait_ready(600)
        for i in range(3):
            post(engine.url, body(10_000 + i))
        count = 0
        for pause in [float(x) for x in args.pauses.split(",")]:
            steps, latency = [], []
            for _ in range(args.rounds):
                count += 1
                time.sleep(pause)
                before = engine.metrics().get(PREFILL_SUM, 0.0)
                latency.append(1000 * post(engine.url, body(count)))
                steps.append(1000 * (engine.metrics().get(PREFILL_SUM, 0.0) - before))
            rows.append((pause, statistics.median(steps), statistics.median(latency)))
            print(f"pause {pause:5.2f} s: engine {statistics.median(steps):6.1f} ms, "
                  f"request {statistics.median(latency):6.1f} ms", flush=True)
    finally:
        engine.stop()
    base = rows[0][1]
    readers = "asleep (--quiet)" if args.quiet else "spinning 1 s (vLLM's)"
    print(f"\n{Path(args.model).name}, {n}-token prefill, one request at a time after a "
          f"pause, {args.rounds} rounds, queue readers {readers}, p50:\n")
    print("| pause before it, s | engine's time (request_prefill_time) ms | over no pause "
          "| request ms |")
    print("|---:|---:|---:|---:|")
    for pause, step, lat in rows:
        print(f"| {pause:g} | {step:.1f} | {step / base:.2f} | {lat:.1f} |")


if __name__ == "__main__":
    main()
