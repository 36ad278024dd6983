"""Token #1 from P (issue 29) at idle: disaggregated against aggregated,
request by request, interleaved on one set of engines.

``bench_first_token.py`` runs each deployment after the other (equal
budget: both cores each), minutes apart; on a shared 2-core VM the host's
own speed drifts by 10% over that time, more than the effect being
measured. This benchmark removes the drift: it starts, once,

* ``aggregated``: a plain vLLM engine (no connector) on core 0;
* P on core 0 and D on core 1 (PDConnector, ``--transfer-mode``), behind
  ``vllm-pd-proxy`` (token #1 from P; in push, D's leg sent with P's:
  ``--concurrent-dispatch``, the default, both modes);
* ``push-seq`` / ``pull-seq``: a second proxy in front of the same P and D
  with ``--no-concurrent-dispatch`` (D's leg after P's answer; the main
  arm sends it with P's: in pull since protocol 9, D parks it until P's
  answer reaches it);

and sends one request at a time, every arm in turn (the order rotates each
round), with ``--pause`` seconds of quiet after each: the machine is idle
when each request starts, and aggregated's prefill and P's run on the same
core. The pause is over 1 s because a plain vLLM engine's workers spin on
their step queue for 1 s after every step (P and D do not: our connector
quiets them, ``compat/engine.py``); on P's core that spin halved P's
speed. Every request has its own random prompt of exactly ``--length``
tokens (text, decoded from random ids as ``vllm-pd-bench --text-prompts``
does), so no prefix cache hits.

Printed per arm: TTFT p50 / p99 and its ratio to aggregated (the target:
<= 1.05 on an idle machine), the gap between token #1 and token #2 (for
aggregated: its first inter-token gap, the same decode step without a
handoff), and for the disaggregated arms the handoff's figures from each
request's ``pd_telemetry`` (``tools/slo/breakdown.handoff_of``): gap /
(transfer + decode step), orchestration. Also the paired ratio: each
round's disaggregated TTFT over the same round's aggregated one, p50.
In push, also each request's gap against P's own WRITE time (P's log,
``write_times``) + its decode step: D's record cannot time a concurrent
push's bytes, which it waits for through P's prefill, so the table above
counts them 0 there (an upper bound).

    python benchmarks/bench_idle_ab.py --transfer-mode push --length 300 --rounds 30
    python benchmarks/bench_idle_ab.py --transfer-mode pull --length 128 --rounds 30
    python benchmarks/bench_idle_ab.py --transfer-mode push --ab-landing --rounds 30

``--prefix-hit`` adds two arms on a third engine, a plain vLLM engine
like aggregated (core 0): ``hit-as-d`` and ``hit-warm``. Each sends a
prompt of ``hit_length(--length)`` token ids (a whole number of 128-token
blocks, vLLM's CPU default, plus one) twice: once to fill the engine's
prefix cache (one output token, not measured), then the measured request,
whose first step computes one token over a cached context: D's first step
after a KV load, with the KV from the engine's own cache instead of P.
``hit-as-d`` waits between the two as long as D idled in the latest
disaggregated request (its TTFT: D waits through P's queue and prefill
with nothing to compute), ``hit-warm`` does not. Their TTFT is vLLM's own
cost of a request's first step over cached KV, the part of the
disaggregated gap #1 -> #2 that is not the handoff. On this host an
engine's first step grows with the time it idled before, whether or not
vLLM's queue readers spin (``bench_idle_cost.py``): the two arms tell that
host cost apart from vLLM's admission. With ``--step-trace`` the engine's
split sits beside D's.

``--ab-landing`` replaces the -seq arm with ``push-no-landing`` (or
``pull-no-landing``): a second D on D's core with ``same_step_landing:
false``, behind its own proxy, while the main D runs with it on, so the two
D's are compared request by request in one run (``--no-same-step-landing``
with it: the A/A run). In pull the key moves a concurrent pull D's idle
wait for P's answer before ``schedule()``.

Engines and proxies are started and ended by PID; logs and a JSON of every
request stay under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import msgspec

from vllm_pd_ext import STEP_TRACE_ENV
from vllm_pd_ext.tools import step_split
from vllm_pd_ext.tools.launch import Engine, Proxy
from vllm_pd_ext.tools.slo.breakdown import summarize_handoffs
from vllm_pd_ext.tools.slo.client import run_point
from vllm_pd_ext.tools.slo.deploy import Deployment
from vllm_pd_ext.tools.slo.metrics import RequestResult, percentile
from vllm_pd_ext.tools.slo.trace import TraceRequest, as_text, make_prompt

#: Seed of the prompts (vllm-pd-bench's ``make_prompt``: one per round and arm).
SEED = 29
#: (arm, wall-clock send time, TTFT s) of every request, for result.json.
STAMPS: list[tuple[str, float, float | None]] = []
#: D's own time for its first step of each disaggregated request, from D's
#: ``/metrics`` around it (one request at a time): vLLM's
#: ``request_prefill_time`` (first scheduled, after the KV arrived, to its
#: first output: token #2 when token #1 came from P), ms, per arm.
D_FIRST_STEP: dict[str, list[float]] = {}
PREFILL_SUM = "vllm:request_prefill_time_seconds_sum"
#: Push: D legs whose load D's scheduler saw land before its workers'
#: report (``same_step_landing``), per arm, of the measured ones.
D_LANDED: dict[str, list[bool]] = {}
LANDED = "vllm:pd_ext_landed_before_step_total"
#: P's worker logs each WRITE it completed (``worker/p_push.py``,
#: ``_finish_ok``): ``pushed <pd_request_id> ... , <ms> ms``. The one place
#: a concurrent push's bytes are timed: D's record cannot tell the WRITE
#: from P's prefill (it waits through both), so its gap ratio counts them 0.
#: Prefix-cache hits (tokens) of each measured ``--prefix-hit`` request,
#: from the hit engine's ``/metrics`` around it, per arm.
HIT_TOKENS: dict[str, list[float]] = {}
PREFIX_HITS = "vllm:prefix_cache_hits_total"
#: vLLM's default KV block size on CPU (``platforms/cpu.py``): prefix
#: caching hits whole blocks only.
CPU_BLOCK = 128
HIT_ARMS = ("hit-as-d", "hit-warm")
#: ``hit-as-d``'s idle before its first request, until a disaggregated
#: request has measured D's (s).
HIT_IDLE_DEFAULT_S = 0.1
PUSHED = re.compile(r"PDConnector: pushed (\S+) to engine .*, ([0-9.]+) ms$")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=".models/tiny")
    p.add_argument("--transfer-mode", choices=("pull", "push"), default="push")
    p.add_argument("--length", type=int, default=300, help="prompt tokens")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=2, help="rounds left out of the figures")
    # Over 1 s: a plain vLLM engine's shared-memory queue readers spin for 1 s
    # after every message (compat/engine.py's quiet_shm_spin, which our
    # connector turns off in P and D only); aggregated shares core 0 with P.
    p.add_argument("--pause", type=float, default=1.5,
                   help="seconds of quiet after each request (over 1 s: see the code)")
    p.add_argument("--out-dir", default=".runs/idle-ab")
    p.add_argument("--ab-landing", action="store_true",
                   help="instead of the -seq arm, a second D (same core as D, "
                        "same_step_landing false) behind its own proxy: the arm "
                        "push-no-landing (pull-no-landing), interleaved with the main "
                        "arm request by request")
    p.add_argument("--same-step-landing", choices=("on", "off"), default=None,
                   help="the main D's same_step_landing (default: on with "
                        "--ab-landing, the A/B; else the connector's default, off)")
    p.add_argument("--no-same-step-landing", dest="same_step_landing", action="store_const",
                   const="off", help="the same as --same-step-landing off (with "
                                     "--ab-landing: the A/A run, both D's without it)")
    p.add_argument("--step-trace", action="store_true",
                   help="time each step's phases in the aggregated engine, P and the D's "
                        "(VLLM_PD_EXT_STEP_TRACE) and print the split "
                        "(tools/step_split.py); in push without --ab-landing, D's rows "
                        "hold both push arms' requests")
    p.add_argument("--prefix-hit", action="store_true",
                   help="add the arms hit-as-d and hit-warm on a third, plain engine: a "
                        "request whose first step computes one token over a prefix-cache "
                        "hit (D's first step without a handoff); see the module's text")
    p.add_argument("--no-pin-client", dest="pin_client", action="store_false",
                   help="leave the client and the proxies where the OS puts them (by "
                        "default they run on the core that does not compute the arm's "
                        "token #2: see pin_client)")
    return p.parse_args()


def main_d_landing(args: argparse.Namespace) -> bool:
    """The main D's ``same_step_landing``: as asked, else on for the A/B
    (``--ab-landing``: against a second D without it) and the connector's
    default (off) otherwise. Always given explicitly, so the arms do not
    change meaning when that default does (it did once: ``--ab-landing``
    then compared two D's without it)."""
    if args.same_step_landing is not None:
        return bool(args.same_step_landing == "on")
    return bool(args.ab_landing)


def hit_length(length: int, block: int = CPU_BLOCK) -> int:
    """The ``--prefix-hit`` arms' prompt length nearest ``length`` whose
    first step computes exactly one token: whole blocks hit, the last token
    is computed (vLLM never serves a whole prompt from its cache)."""
    return max(1, round(length / block)) * block + 1


def client_core(name: str, cores: tuple[str, ...]) -> int:
    """Where the benchmark client runs for arm ``name``: on the core that does
    not compute the arm's tokens. Aggregated computes on ``cores[0]``; P and D
    on ``cores[0]`` and ``cores[1]``, and D computes token #2 while token #1
    goes through the proxy to the client, so those two run beside P, which is
    idle by then. Left unpinned, the OS put them on D's core often enough to
    slow D's first step by 1 to 3 ms (issue 29's gap), and on aggregated's core
    during its step 2; on a GPU host neither shares a core with the model."""
    return int(cores[1] if name == "aggregated" or name in HIT_ARMS else cores[0])


def pin_process(pid: int, core: int) -> None:
    """Every thread of ``pid`` (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), {core})


def arms(dep: Deployment, agg: Engine, seq: Proxy | None, seq_name: str) -> dict[str, str]:
    assert dep.proxy is not None
    out = {"aggregated": agg.url, dep.transfer_mode: dep.proxy.url}
    if seq is not None:
        out[seq_name] = seq.url
    return out


def prompts(args: argparse.Namespace, names: list[str], tokenizer: Any) -> list[TraceRequest]:
    """One prompt per (round, arm), ``--length`` tokens each, as text (the
    ``--prefix-hit`` arms replace theirs: ``interleave``)."""
    count = (args.warmup + args.rounds) * len(names)
    trace = [TraceRequest(index=i, at_s=0.0,
                          prompt=make_prompt(SEED, args.length, i, args.length),
                          output_tokens=args.output_tokens,
                          warmup=i < args.warmup * len(names))
             for i in range(count)]
    return as_text(trace, tokenizer)


async def interleave(urls: dict[str, str], model: str, trace: list[TraceRequest],
                     pause: float, ds: dict[str, Engine], cores: tuple[str, ...] | None,
                     hit: Engine | None = None, hit_len: int = 0, main_arm: str = ""
                     ) -> dict[str, list[RequestResult]]:
    """One request at a time, every arm in turn; ``ds``: each disaggregated
    arm's D; ``cores``: pin this process per arm (``client_core``), else
    leave it where it is; ``hit``: the engine of the ``--prefix-hit`` arms,
    whose prompts are ``hit_len`` token ids, each sent first to fill its
    prefix cache (``hit-as-d`` idles as long as ``main_arm``'s D last did)."""
    names = list(urls)
    d_idle_s = HIT_IDLE_DEFAULT_S
    out: dict[str, list[RequestResult]] = {n: [] for n in names}
    rounds = len(trace) // len(names)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for k, name in enumerate(order):
            req = trace[r * len(names) + k]
            if cores is not None:
                os.sched_setaffinity(0, {client_core(name, cores)})
            if hit is not None and name in HIT_ARMS:
                req = dataclasses.replace(
                    req, prompt=make_prompt(SEED, hit_len, req.index, hit_len))
                await run_point([urls[name]], model,
                                [dataclasses.replace(req, output_tokens=1, warmup=True)],
                                timeout_s=600, progress=False)
                if name == "hit-as-d":
                    await asyncio.sleep(d_idle_s)
                hits = hit.metrics().get(PREFIX_HITS, 0.0)
            at = time.time()
            d = ds.get(name)
            seen = d.metrics() if d is not None else {}
            got, _ = await run_point([urls[name]], model, [req], timeout_s=600,
                                     progress=False)
            out[name].append(got[0])
            if name == main_arm and got[0].ok and got[0].ttft_s:
                d_idle_s = got[0].ttft_s
            if hit is not None and name in HIT_ARMS and not req.warmup:
                HIT_TOKENS.setdefault(name, []).append(
                    hit.metrics().get(PREFIX_HITS, 0.0) - hits)
            if d is not None and not req.warmup:
                now = d.metrics()
                D_FIRST_STEP.setdefault(name, []).append(
                    1000 * (now.get(PREFILL_SUM, 0.0) - seen.get(PREFILL_SUM, 0.0)))
                D_LANDED.setdefault(name, []).append(
                    now.get(LANDED, 0.0) > seen.get(LANDED, 0.0))
            STAMPS.append((name, at, got[0].ttft_s))
            if not got[0].ok:
                print(f"  {name} round {r}: {got[0].error}", flush=True)
            await asyncio.sleep(pause)
        done = {n: [x.ttft_s for x in out[n] if x.ok and x.ttft_s] for n in names}
        print(f"round {r + 1}/{rounds}: " + ", ".join(
            f"{n} {1000 * v[-1]:.0f} ms" for n, v in done.items() if v), flush=True)
    return out


def gap_table(results: dict[str, list[RequestResult]]) -> list[str]:
    """Where each disaggregated arm's gap #1 -> #2 goes, beside the same
    gap of the aggregated engine (its first inter-token gap: step 2 right
    after the prefill, no handoff), measured in the same rounds."""
    lines = ["| arm | gap #1 -> #2 | D's first step (engine) | D's decode step | "
             "gap - D's first step | aggregated's gap #1 -> #2 | gap / aggregated's, "
             "paired p50 |", "|---|---:|---:|---:|---:|---:|---:|"]
    agg = [r for r in results.get("aggregated", []) if not r.warmup]
    agg_gap = percentile([1000 * r.itl_s[0] for r in agg if r.ok and r.itl_s], 50)
    for name, rs in results.items():
        if name == "aggregated" or name not in D_FIRST_STEP:
            continue
        measured = [r for r in rs if not r.warmup]
        ok = [r for r in measured if r.ok and len(r.itl_s) > 1]
        gap = percentile([1000 * r.itl_s[0] for r in ok], 50)
        step = percentile([1000 * statistics.median(r.itl_s[1:]) for r in ok], 50)
        first = percentile(D_FIRST_STEP[name], 50)
        rest = gap - first if gap is not None and first is not None else None
        paired = percentile([d.itl_s[0] / a.itl_s[0] for d, a in zip(measured, agg, strict=True)
                             if d.ok and a.ok and d.itl_s and a.itl_s and a.itl_s[0] > 0], 50)
        lines.append(f"| {name} | {fmt(gap)} | {fmt(first)} | {fmt(step)} | {fmt(rest)} "
                     f"| {fmt(agg_gap)} | {fmt(paired, 2)} |")
    return lines


def hit_table(results: dict[str, list[RequestResult]]) -> list[str]:
    """The ``--prefix-hit`` arms beside the disaggregated arms' gap #1 -> #2
    and aggregated's, p50 ms: each hit arm's TTFT, its decode step, and
    the prefix-cache hits each measured request got (all but one token, or
    the arm did not measure what it says)."""
    lines = ["| arm | requests ok | TTFT (first step over cached KV) p50 / p99 ms "
             "| decode step p50 ms | TTFT / decode step p50 | cached tokens per request p50 |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in HIT_ARMS:
        rs = [r for r in results.get(name, []) if not r.warmup]
        ok = [r for r in rs if r.ok and r.ttft_s is not None]
        ttft = [1000 * r.ttft_s for r in ok if r.ttft_s is not None]
        step = [1000 * statistics.median(r.itl_s) for r in ok if r.itl_s]
        ratio = [r.ttft_s / statistics.median(r.itl_s) for r in ok
                 if r.ttft_s is not None and r.itl_s and statistics.median(r.itl_s) > 0]
        lines.append(f"| {name} | {len(ok)}/{len(rs)} | {fmt(percentile(ttft, 50))} / "
                     f"{fmt(percentile(ttft, 99))} | {fmt(percentile(step, 50))} "
                     f"| {fmt(percentile(ratio, 50), 2)} "
                     f"| {fmt(percentile(HIT_TOKENS.get(name, []), 50), 0)} |")
    for name, rs in results.items():
        if name in HIT_ARMS:
            continue
        ok = [r for r in rs if not r.warmup and r.ok and len(r.itl_s) > 1]
        gap = [1000 * r.itl_s[0] for r in ok]
        step = [1000 * statistics.median(r.itl_s[1:]) for r in ok]
        per_step = [g / t for g, t in zip(gap, step, strict=True) if t]
        lines.append(f"| {name}: gap #1 -> #2 | {len(ok)} | {fmt(percentile(gap, 50))} / "
                     f"{fmt(percentile(gap, 99))} | {fmt(percentile(step, 50))} "
                     f"| {fmt(percentile(per_step, 50), 2)} | |")
    return lines


def write_times(p_log: Path) -> dict[str, float]:
    """P's WRITE time (ms) by ``pd_request_id``, from P's log."""
    out: dict[str, float] = {}
    if p_log.exists():
        for line in p_log.read_text(errors="replace").splitlines():
            m = PUSHED.search(line)
            if m:
                out[m[1]] = float(m[2])
    return out


def write_table(results: dict[str, list[RequestResult]], writes: dict[str, float]
                ) -> list[str]:
    """Push arms: the gap against P's own WRITE time (from P's log) + the
    request's decode step, request by request: the gap ratio with the bytes
    measured where they move, instead of counted 0 (concurrent) or timed
    from D's wait (sequential)."""
    lines = ["| arm | requests | P's WRITE p50 / p99 ms | gap #1 -> #2 p50 ms "
             "| gap / (P's WRITE + step) p50 / p99 |", "|---|---:|---:|---:|---:|"]
    for name, rs in results.items():
        ratios, ms, gaps = [], [], []
        for r in rs:
            tele = r.telemetry if isinstance(r.telemetry, dict) else {}
            transfer = tele.get("transfer") if isinstance(tele.get("transfer"), dict) else {}
            w = writes.get(str(transfer.get("remote_request_id")))
            if r.warmup or not r.ok or len(r.itl_s) < 2 or w is None:
                continue
            gap, step = 1000 * r.itl_s[0], 1000 * statistics.median(r.itl_s[1:])
            ratios.append(gap / (w + step))
            ms.append(w)
            gaps.append(gap)
        if ratios:
            lines.append(f"| {name} | {len(ratios)} | {fmt(percentile(ms, 50), 2)} / "
                         f"{fmt(percentile(ms, 99), 2)} | {fmt(percentile(gaps, 50))} "
                         f"| {fmt(percentile(ratios, 50), 2)} / {fmt(percentile(ratios, 99), 2)} |")
    return lines


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def table(results: dict[str, list[RequestResult]]) -> list[str]:
    measured = {n: [r for r in rs if not r.warmup] for n, rs in results.items()}
    ttft = {n: [1000 * r.ttft_s for r in rs if r.ok and r.ttft_s is not None]
            for n, rs in measured.items()}
    base = ttft["aggregated"]
    b50, b99 = percentile(base, 50), percentile(base, 99)
    lines = ["| arm | requests ok | TTFT p50 / p99 ms | TTFT / aggregated p50 / p99 "
             "| paired ratio p50 | gap #1 -> #2 p50 ms | decode step p50 ms "
             "| gap / (transfer + step) p50 / p99 | orchestration p50 / p99 ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, rs in measured.items():
        t50, t99 = percentile(ttft[name], 50), percentile(ttft[name], 99)
        ok = [r for r in rs if r.ok]
        first = [1000 * r.itl_s[0] for r in ok if r.itl_s]
        step = [1000 * statistics.median(r.itl_s[1:]) for r in ok if len(r.itl_s) > 1]
        if name == "aggregated":
            lines.append(f"| {name} | {len(ok)}/{len(rs)} | {fmt(t50)} / {fmt(t99)} | 1 | 1 "
                         f"| {fmt(percentile(first, 50))} | {fmt(percentile(step, 50))} "
                         "| | |")
            continue
        paired = [1000 * d.ttft_s / (1000 * a.ttft_s)
                  for d, a in zip(rs, measured["aggregated"], strict=True)
                  if d.ok and a.ok and d.ttft_s and a.ttft_s]
        h = summarize_handoffs(rs)
        ratio = (f"{fmt(t50 / b50, 2)} / {fmt(t99 / b99, 2)}"
                 if t50 and t99 and b50 and b99 else "-")
        lines.append(
            f"| {name} | {len(ok)}/{len(rs)} | {fmt(t50)} / {fmt(t99)} | {ratio} "
            f"| {fmt(percentile(paired, 50), 2)} "
            f"| {fmt(h['first_gap_ms']['p50'])} | {fmt(h['decode_step_ms']['p50'])} "
            f"| {fmt(h['gap_ratio']['p50'], 2)} / {fmt(h['gap_ratio']['p99'], 2)} "
            f"| {fmt(h['orchestration_ms']['p50'], 2)} / {fmt(h['orchestration_ms']['p99'], 2)} |")
    return lines


def main() -> None:
    args = parse_args()
    from transformers import AutoTokenizer  # heavy; after argparse

    out = Path(args.out_dir) / f"{Path(args.model).name}-{args.length}-{args.transfer_mode}"
    model = str(Path(args.model).resolve())
    tokenizer = AutoTokenizer.from_pretrained(model)
    dep = Deployment("disaggregated", model, out / "logs", transfer_mode=args.transfer_mode,
                     d_extra={"same_step_landing": main_d_landing(args)})
    agg = Engine("agg", model, out / "logs" / "aggregated", connector=None, role=None,
                 cpu_bind=dep.cores[0], kv_bytes=dep.kv_bytes,
                 max_model_len=dep.max_model_len, taskset=True)
    seq: Proxy | None = None
    d2: Engine | None = None
    hit: Engine | None = None
    if args.prefix_hit:
        hit = Engine("agg-hit", model, out / "logs" / "prefix-hit", connector=None, role=None,
                     cpu_bind=dep.cores[0], kv_bytes=dep.kv_bytes,
                     max_model_len=dep.max_model_len, taskset=True)
    traced: dict[str, Path] = {}
    if args.step_trace:
        shutil.rmtree(out / "steps", ignore_errors=True)  # the files are appended to
        traced = {"aggregated": out / "steps" / "aggregated", "P": out / "steps" / "p",
                  "D": out / "steps" / "d"}
        agg.env[STEP_TRACE_ENV] = str(traced["aggregated"])
        dep.engines[0].env[STEP_TRACE_ENV] = str(traced["P"])
        dep.engines[1].env[STEP_TRACE_ENV] = str(traced["D"])
        if hit is not None:
            traced["aggregated, prefix hit"] = out / "steps" / "prefix-hit"
            hit.env[STEP_TRACE_ENV] = str(traced["aggregated, prefix hit"])
    started = time.monotonic()
    try:
        agg.start()
        if hit is not None:
            hit.start()
        dep.start()
        p, d = dep.engines
        if args.ab_landing:
            # The same D (its extra config, its core), but for the landing.
            d2 = Engine("d-no-landing", model,
                        out / "logs" / f"{args.transfer_mode}-no-landing",
                        role="kv_consumer", cpu_bind=d.cpu_bind, kv_bytes=dep.kv_bytes,
                        max_model_len=dep.max_model_len, taskset=True,
                        extra_config={**d.extra_config, "same_step_landing": False},
                        env=dict(d.env))
            if args.step_trace:
                traced["D without the landing"] = out / "steps" / "d-no-landing"
                d2.env[STEP_TRACE_ENV] = str(traced["D without the landing"])
            d2.start()
        agg.wait_ready(timeout=900)
        if hit is not None:
            hit.wait_ready(timeout=900)
        ds = {dep.transfer_mode: d}
        if d2 is not None:
            d2.wait_ready(timeout=900)
            seq = Proxy([p.url], [d2.url], out / "logs" / f"{args.transfer_mode}-no-landing",
                        args=["--transfer-mode", args.transfer_mode, "--transfer-telemetry",
                              "--queue-timeout", "3600", "--local-prefill-threshold", "0"]
                        ).start().wait_ready(60)
            ds[f"{args.transfer_mode}-no-landing"] = d2
        else:
            seq_name = f"{args.transfer_mode}-seq"
            seq = Proxy([p.url], [d.url], out / "logs" / seq_name, args=[
                "--transfer-mode", args.transfer_mode, "--transfer-telemetry",
                "--no-concurrent-dispatch", "--queue-timeout", "3600"]).start().wait_ready(60)
            ds[seq_name] = d
        urls = arms(dep, agg, seq, f"{args.transfer_mode}-no-landing" if d2 is not None
                    else f"{args.transfer_mode}-seq")
        if hit is not None:
            urls.update({name: hit.url for name in HIT_ARMS})
        if args.pin_client:
            for proxy in (dep.proxy, seq):
                if proxy is not None and proxy.proc is not None:
                    pin_process(proxy.proc.pid, client_core(dep.transfer_mode, dep.cores))
        print(f"engines up in {time.monotonic() - started:.0f} s; arms: {', '.join(urls)}",
              flush=True)
        trace = prompts(args, list(urls), tokenizer)
        results = asyncio.run(interleave(urls, model, trace, args.pause, ds,
                                         dep.cores if args.pin_client else None,
                                         hit, hit_length(args.length), dep.transfer_mode))
    finally:
        if seq is not None:
            seq.stop()
        if d2 is not None:
            d2.stop()
        dep.stop()
        agg.stop()
        if hit is not None:
            hit.stop()
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_bytes(msgspec.json.encode(
        {"config": vars(args), "results": results, "stamps": STAMPS,
         "d_first_step_ms": D_FIRST_STEP, "d_landed_before_step": D_LANDED,
         "prefix_hit_tokens": HIT_TOKENS}))
    print(f"\n{Path(args.model).name}, {args.length} tokens, {args.transfer_mode}, "
          f"{args.rounds} rounds after {args.warmup} warm-up, one request at a time "
          f"({json.dumps(str(out / 'result.json'))}):\n")
    print("\n".join(table({n: rs for n, rs in results.items() if n not in HIT_ARMS})))
    if hit is not None:
        print(f"\nA request's first step over a prefix-cache hit ({hit_length(args.length)} "
              "token ids, all but the last cached), on a plain engine: its TTFT is "
              "D's gap #1 -> #2 without a handoff (admission + a one-token step + the "
              "output path)\n")
        print("\n".join(hit_table(results)))
    print("\nWhere the gap #1 -> #2 goes (p50, ms): D's first step is vLLM's own "
          "request_prefill_time on D (scheduled after the KV arrived, to token #2 "
          "leaving its engine core); the rest is the KV's arrival after P's answer, "
          "D's output path against P's, and the host\n")
    print("\n".join(gap_table(results)))
    for name, rs in results.items():
        h = summarize_handoffs([r for r in rs if not r.warmup])
        after, read = h["after_p_ms"], h["transfer_ms"]
        if after["p50"] is not None:
            # Concurrent pull: P's answer reached D -> D's KV ready (D's clock).
            print(f"\n{name}: P's answer at D to D's KV ready p50 / p99 "
                  f"{fmt(after['p50'], 2)} / {fmt(after['p99'], 2)} ms (the READ "
                  f"{fmt(read['p50'], 2)} / {fmt(read['p99'], 2)} ms; "
                  f"{h['count']} handoffs)")
    if args.transfer_mode == "push":
        writes = write_times(dep.engines[0].log_path)
        print(f"\nPush: the gap against P's WRITE time ({len(writes)} WRITEs in P's log)\n")
        print("\n".join(write_table(results, writes)))
    for name, landed in D_LANDED.items() if args.transfer_mode == "push" else ():
        print(f"{name}: {sum(landed)} of {len(landed)} loads seen landing by D's scheduler "
              "before its workers' report (same_step_landing)")
    for name, folder in traced.items():
        # Warm-up rounds included. Aggregated's token #2 is its "second"
        # step; D's is its "first, 1 token" (token #1 came from P). P's
        # "first, prefill" beside aggregated's: the same prefill, one core.
        rows, note = step_split.split_folder(folder)
        print(f"\nWhere a step's time goes, {name} ({note}; {folder}), medians in ms:\n")
        print(step_split.table(rows))


if __name__ == "__main__":
    main()
