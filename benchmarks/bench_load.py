"""Load benchmark: 2P2D and 1P1D vs collocated engines at equal cores (issue 11).

One invocation measures, one deployment after the other on the same two
cores and the same seeded prompts (every process of an engine confined to
its core with ``taskset``):

* ``collocated``: two plain engines (no connector), one per core; clients
  alternate between them: the aggregated baseline;
* ``1p1d``: one PDConnector P (core 0) and D (core 1) behind ``vllm-pd-proxy``;
* ``2p2d``: P0 and D0 on core 0, P1 and D1 on core 1 (the soak's topology)
  behind one proxy with both pools.

``--netns`` runs every P/D engine in its own network namespace with UCX over
TCP on its veth (the multi-host topology of ``vllm_pd_ext/testing/netns.py``).

For each closed-loop client count (default 1, 4, 16, 64), ``--requests``
streamed completions (``max_tokens`` 16, temperature 0, ``ignore_eos``,
prompts of 40-1,000 random tokens, distinct per request). Reported per level:
completed req/s, TTFT p50/p99 and max, ITL p50/p99, D's KV wait p50/p99
(``vllm:pd_ext_kv_wait_seconds`` summed over the Ds, interpolated in its
buckets), the fraction of handoffs whose KV wait exceeded 1 s (the bucket
boundary at 1 s makes it exact), the bucket that bounds the slowest handoff,
errors, and how many outputs equal the collocated engines' token for token.
A handoff stuck near ``lease_duration`` (30 s) would show as a KV wait bound
of 30 s or more and a TTFT max near it: the table prints both.

    python benchmarks/bench_load.py --out-json .runs/bench/load.json \\
        --plot docs/img/load.png
    python benchmarks/bench_load.py --mode push --clients 16 --requests 64
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import benchstats
from bench_concurrency import PANELS as CONCURRENCY_PANELS
from bench_concurrency import (
    Collocated,
    buckets,
    hist_pct,
    plot,
    run_level,
    say,
    summarize,
)

from vllm_pd_ext.testing import netns
from vllm_pd_ext.testing.engines import REPO, Engine, Proxy

sys.path.insert(0, str(REPO))
from tests.e2e.helpers import build_model, token_prompt

LEASE_S = 30.0  # PDConnector's default lease_duration


class Pools:
    """``n`` P/D pairs behind one proxy: n=1 is P on core 0 and D on core 1;
    n=2 is P0 and D0 on core 0, P1 and D1 on core 1 (the soak's topology).
    With ``hosts`` (``--netns``) each engine runs in its own network
    namespace, UCX over TCP on its veth (vllm_pd_ext/testing/netns.py)."""

    def __init__(self, n: int, mode: str, model: str, args: argparse.Namespace, log_dir: Path,
                 hosts: list[netns.Host] | None = None) -> None:
        logs = log_dir / f"{n}p{n}d-{mode}"
        common: dict[str, Any] = dict(connector="PDConnector", kv_bytes=args.kv_bytes,
                                      max_model_len=args.max_model_len,
                                      extra_config={"transfer_mode": mode})
        p_cores, d_cores = (["0"], ["1"]) if n == 1 else (["0", "1"], ["0", "1"])

        def host(i: int) -> netns.Host | None:
            return hosts[i] if hosts is not None else None

        self.ps = [Engine(f"p{i}", model, logs, role="kv_producer", cpu_bind=p_cores[i],
                          host=host(i), taskset=True, **common) for i in range(n)]
        self.ds = [Engine(f"d{i}", model, logs, role="kv_consumer", cpu_bind=d_cores[i],
                          host=host(n + i), taskset=True, **common) for i in range(n)]
        self.proxy = Proxy([p.url for p in self.ps], [d.url for d in self.ds], logs,
                           args=["--transfer-mode", mode])

    def urls(self) -> list[str]:
        return [self.proxy.url]

    def d_urls(self) -> list[str]:
        return [d.url for d in self.ds]

    def start(self) -> None:
        for e in (*self.ps, *self.ds):
            e.start()
        for e in (*self.ps, *self.ds):
            e.wait_ready(timeout=600)
        self.proxy.start().wait_ready(timeout=60)

    def stop(self) -> None:
        self.proxy.stop()
        for e in (*self.ds, *self.ps):
            e.stop()


def waits(before: list[dict[float, float]], after: list[dict[float, float]]
          ) -> dict[str, float]:
    """KV-wait figures of the handoffs between two snapshots of every D's histogram."""
    b: dict[float, float] = {}
    a: dict[float, float] = {}
    for snap, out in ((before, b), (after, a)):
        for one in snap:
            for le, n in one.items():
                out[le] = out.get(le, 0.0) + n
    if not a:
        return {"kv_wait_p50_ms": math.nan, "kv_wait_p99_ms": math.nan,
                "over_1s": math.nan, "kv_wait_max_le_s": math.nan, "handoffs": 0}
    les = sorted(a)
    counts = {le: a[le] - b.get(le, 0.0) for le in les}
    total = counts[les[-1]]
    bound = next((le for le in les if counts[le] >= total), math.inf)
    return {"kv_wait_p50_ms": hist_pct(b, a, 50) * 1e3, "kv_wait_p99_ms": hist_pct(b, a, 99) * 1e3,
            "over_1s": (total - counts.get(1.0, 0.0)) / total if total else math.nan,
            "kv_wait_max_le_s": bound, "handoffs": int(total)}


def measure(name: str, model: str, args: argparse.Namespace, log_dir: Path,
            warm: list[list[int]], prompts: dict[int, list[list[int]]],
            summary: dict[str, dict[int, dict[str, Any]]],
            outputs: dict[str, dict[int, list[list[int] | None]]]) -> None:
    ns = argparse.Namespace(**vars(args), pin="taskset")
    dep: Any
    topo = contextlib.nullcontext(None) if name == "collocated" or not args.netns else (
        netns.Topology(2 if name == "1p1d" else 4))
    with topo as t:
        hosts = t.hosts if t is not None else None
        if name == "collocated":
            dep = Collocated(model, ns, log_dir)
        else:
            dep = Pools(1 if name == "1p1d" else 2, args.mode, model, ns, log_dir, hosts)
        run_deployment(name, dep, model, ns, warm, prompts, summary, outputs)


def run_deployment(name: str, dep: Any, model: str, ns: argparse.Namespace,
                   warm: list[list[int]], prompts: dict[int, list[list[int]]],
                   summary: dict[str, dict[int, dict[str, Any]]],
                   outputs: dict[str, dict[int, list[list[int] | None]]]) -> None:
    d_urls: list[str] = dep.d_urls() if name != "collocated" else []
    say(f"{name}: starting")
    try:
        dep.start()
        run_level(dep, model, 2, warm, ns, f"{name}-warm")
        for c in ns.clients:
            b0 = [buckets(u) for u in d_urls]
            res, wall = run_level(dep, model, c, prompts[c], ns, f"{name}-c{c}")
            b1 = [buckets(u) for u in d_urls]
            w = waits(b0, b1) if d_urls else {}
            s = summarize(res, wall, (math.nan, math.nan))
            s.update(w)
            ttfts = [r["ttft_ms"] for r in res if "error" not in r]
            s["ttft_max_ms"] = max(ttfts) if ttfts else math.nan
            summary.setdefault(name, {})[c] = s
            outputs.setdefault(name, {})[c] = [r.get("tokens") for r in res]
            say(f"{name} c={c}: {benchstats.fmt(s['req_per_s'])} req/s, TTFT p99 "
                f"{benchstats.fmt(s['ttft_p99_ms'], 0)} ms, errors {s['errors']}")
    finally:
        dep.stop()
        say(f"{name}: stopped")


def table(summary: dict[str, dict[int, dict[str, Any]]], clients: list[int]) -> str:
    f = benchstats.fmt
    lines = ["| deployment | clients | req/s | TTFT p50 / p99 / max (ms) | ITL p50 / p99 (ms) | "
             "D KV wait p50 / p99 (ms) | handoffs > 1 s | slowest handoff | errors | "
             "equal to collocated |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, levels in summary.items():
        for c in clients:
            s = levels.get(c)
            if s is None:
                continue
            over = s.get("over_1s", math.nan)
            bound = s.get("kv_wait_max_le_s", math.nan)
            lines.append(
                f"| {name} | {c} | {f(s['req_per_s'])} | {f(s['ttft_p50_ms'], 0)} / "
                f"{f(s['ttft_p99_ms'], 0)} / {f(s['ttft_max_ms'], 0)} | "
                f"{f(s['itl_p50_ms'], 1)} / {f(s['itl_p99_ms'], 1)} | "
                f"{f(s.get('kv_wait_p50_ms', math.nan), 0)} / "
                f"{f(s.get('kv_wait_p99_ms', math.nan), 0)} | "
                f"{'-' if math.isnan(over) else f'{100 * over:.1f}%'} | "
                f"{'-' if math.isnan(bound) else f'<= {bound:g} s'} | "
                f"{s['errors']}/{s['requests']} | {s.get('equal', '-')} |")
    return "\n".join(lines)


PANELS = (*CONCURRENCY_PANELS, ("kv_wait_p99_ms", "D KV wait p99 (ms)"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deployments", nargs="+", default=["collocated", "1p1d", "2p2d"],
                    choices=("collocated", "1p1d", "2p2d"))
    ap.add_argument("--mode", choices=("pull", "push"), default="pull")
    ap.add_argument("--netns", action="store_true",
                    help="P/D engines each in their own network namespace, UCX over TCP on "
                         "the veths (needs root, ip netns, cc); collocated stays on 127.0.0.1")
    ap.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=int, default=64, help="per client level")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=40)
    ap.add_argument("--max-len", type=int, default=1000)
    ap.add_argument("--kv-bytes", type=int, default=512 << 20)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--out-json", default=None)
    ap.add_argument("--plot", default=None, help="PNG path")
    ap.add_argument("--replot", default=None, metavar="JSON",
                    help="only redraw --plot from an earlier --out-json")
    args = ap.parse_args(argv)
    if args.replot:
        rep = json.loads(Path(args.replot).read_text())
        old = {k: {int(c): v for c, v in lv.items()} for k, lv in rep["summary"].items()}
        plot(old, rep["args"]["clients"], args.plot, rep.get("title", "load"), PANELS)
        return 0
    if args.netns:
        reason = netns.engines_unavailable()
        if reason:
            raise SystemExit(f"--netns: {reason}")
        netns.remove_stale()
    model = build_model("tiny")
    log_dir = Path(args.log_dir or REPO / ".runs" / "bench" / time.strftime("load-%Y%m%d-%H%M%S"))
    say(f"logs under {log_dir}; mode={args.mode}")
    rng = random.Random(args.seed)
    prompts = {c: [token_prompt(rng.randrange(args.min_len, args.max_len), 20_000 * k + i)
                   for i in range(args.requests)] for k, c in enumerate(args.clients, 1)}
    warm = [token_prompt(64, 998_000 + i) for i in range(4)]
    summary: dict[str, dict[int, dict[str, Any]]] = {}
    outputs: dict[str, dict[int, list[list[int] | None]]] = {}
    for name in args.deployments:
        measure(name, model, args, log_dir, warm, prompts, summary, outputs)
    if "collocated" in outputs:
        for name, levels in outputs.items():
            for c, outs in levels.items():
                ref = outputs["collocated"][c]
                summary[name][c]["equal"] = (
                    f"{sum(1 for a, b in zip(outs, ref, strict=True) if a and a == b)}/"
                    f"{len(outs)}")
    where = "across namespaces, UCX over TCP" if args.netns else "on 127.0.0.1"
    title = (f"tiny model on 2 cores: collocated (2 engines) vs 1P1D vs 2P2D ({where}), "
             f"{args.mode}, lease {LEASE_S:g} s")
    print("\n" + title + "\n\n" + table(summary, args.clients))
    if "collocated" in summary:
        for name in summary:
            if name == "collocated":
                continue
            ratios = [summary[name][c]["req_per_s"] / summary["collocated"][c]["req_per_s"]
                      for c in args.clients if c in summary[name]]
            print(f"{name} / collocated throughput at {args.clients} clients: "
                  + " ".join(f"{r:.2f}" for r in ratios))
    stalls = [(name, c) for name, lv in summary.items() for c, s in lv.items()
              if s.get("kv_wait_max_le_s", 0) >= LEASE_S or s.get("ttft_max_ms", 0) >= LEASE_S * 1e3
              * 0.5]
    print("stalls near a lease duration: " + (", ".join(f"{n} at {c} clients"
                                                         for n, c in stalls) or "none"))
    if args.plot:
        plot(summary, args.clients, args.plot, title, PANELS)
    if args.out_json:
        Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out_json).write_text(json.dumps(
            {"args": vars(args), "summary": {k: {str(c): v for c, v in lv.items()}
                                             for k, lv in summary.items()},
             "stalls": stalls, "title": title}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
