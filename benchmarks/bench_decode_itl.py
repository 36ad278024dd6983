"""What our connector costs a decode step: ITL of a D engine against a
plain vLLM engine on the same core.

Starts, one after the other on ``--core`` (every process of the engine
confined there with taskset, as ``bench_idle_ab.py`` runs D), each arm's
engine and streams ``--requests`` plain requests through it (a random
``--prompt``-token prompt, ``--tokens`` output tokens, greedy, 1.2 s of
quiet between them), then stops it; ``--reps`` times round the arms, so
the host's drift spreads over all of them. Arms:

* ``plain``: vLLM with no connector (its queue readers spin for 1 s after
  every message);
* ``d``: PDConnector as ``kv_consumer``, defaults (``quiet_shm_spin``:
  the readers sleep on the queue's notification);
* ``d-spin-computing``: with ``spin_while_computing: true`` (they spin as
  vLLM's do while the engine's steps compute, else sleep);
* ``d-spin``: with ``quiet_shm_spin: false`` (vLLM's spin always).

Printed: each run's ITL p50 and p90 (the first inter-token gap and the
first ``--skip`` requests left out), then per arm the median of the runs'
p50 and its ratio to ``plain``'s.

    python benchmarks/bench_decode_itl.py --reps 3
    python benchmarks/bench_decode_itl.py --arms plain,d,d-spin-computing --reps 2
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

# One streamed request's TTFT and inter-token gaps (a sibling benchmark's).
from bench_cached_first_step import stream

from vllm_pd_ext.tools.launch import Engine

ARMS: dict[str, tuple[str | None, dict[str, Any]]] = {
    "plain": (None, {}),
    "d": ("PDConnector", {}),
    "d-spin-computing": ("PDConnector", {"spin_while_computing": True}),
    "d-spin": ("PDConnector", {"quiet_shm_spin": False}),
}


def run_arm(name: str, args: argparse.Namespace, model: str, out: Path) -> tuple[float, float]:
    connector, extra = ARMS[name]
    engine = Engine(name, model, out, connector=connector,
                    role="kv_consumer" if connector else None, extra_config=extra,
                    cpu_bind=args.core, kv_bytes=1 << 30, taskset=True).start()
    try:
        engine.wait_ready(timeout=900)
        rng = random.Random(5)
        measured: list[float] = []
        for i in range(args.skip + args.requests):
            prompt = [rng.randrange(10, 3000) for _ in range(args.prompt)]
            _, got = stream(engine.url, model, prompt, args.tokens)
            if i >= args.skip:
                measured.extend(got[1:])
            time.sleep(1.2)
    finally:
        engine.stop()
    ordered = sorted(measured)
    return statistics.median(ordered), ordered[int(0.9 * len(ordered))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=".models/tiny")
    p.add_argument("--core", default="1")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--skip", type=int, default=2, help="warm-up requests per run")
    p.add_argument("--prompt", type=int, default=300)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--out-dir", default=".runs/decode-itl")
    args = p.parse_args()
    model = str(Path(args.model).resolve())
    names = args.arms.split(",")
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        p.error(f"unknown arm(s) {unknown}; known: {list(ARMS)}")
    p50s: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(args.reps):
        for name in names:
            p50, p90 = run_arm(name, args, model, Path(args.out_dir))
            p50s[name].append(p50)
            print(f"rep {rep + 1}: {name:16s} ITL p50 {p50:.2f} ms, p90 {p90:.2f} ms", flush=True)
    base = statistics.median(p50s["plain"]) if "plain" in p50s else None
    print(f"\n{Path(args.model).name}, core {args.core}, {args.prompt}-token prompts, "
          f"{args.tokens} tokens, {args.requests} requests x {args.reps} runs per arm:")
    for name, values in p50s.items():
        med = statistics.median(values)
        ratio = f"  {med / base:.2f}x plain" if base else ""
        runs = ", ".join(f"{v:.2f}" for v in values)
        print(f"  {name:16s} ITL p50 (median of runs) {med:.2f} ms{ratio}   runs: {runs}")


if __name__ == "__main__":
    main()
