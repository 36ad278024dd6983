"""KV handoff and tail benchmark: PDConnector vs memcpy vs vLLM's in-tree NixlConnector.

One invocation measures, on real vLLM CPU engines bound to 127.0.0.1:

1. ``handoff``: for each prompt length, ``--reps`` sequential requests with
   distinct random token prompts (no prefix-cache hit): P leg (max_tokens=1,
   ``do_remote_decode``), then D leg (max_tokens=1, P's ``kv_transfer_params``).
   Per request we take deltas of D's connector metrics: bytes, descriptors,
   blocks and transfer seconds (ours: READ post to completion; in-tree: NIXL
   telemetry of the READ) plus, for ours, the KV wait (worker receipt to KV
   ready), and the client-side latency of both legs. The baseline is a
   single-process numpy copy of the same number of bytes between two
   preallocated, pre-faulted buffers (median of ``--memcpy-reps``).
2. ``tail``: ``--requests`` prompts with lengths uniform over
   ``--tail-min..--tail-max`` tokens, driven P leg then D leg by ``--clients``
   concurrent clients; per request the latency of both legs, plus D's
   transfer/wait histograms (bucket deltas) and, for ours, the per-request
   transfer time from D's log. Requests whose leg took longer than
   ``--stall-s`` are listed with the P and D log lines that name them.

Pairs run one after the other (ours, then in-tree), each stopped before the
next starts, so they never share the two cores. Engines are stopped by PID in
``finally``; logs go to ``--log-dir`` (default ``.runs/bench/<time>``).

    python examples/make_tiny_model.py --out .models/bench --preset bench
    python benchmarks/bench_handoff.py --out-json .runs/bench/result.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import random
import re
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchstats import (
    fmt,
    median,
    pct,
)

from vllm_pd_ext.testing.engines import REPO, Engine

BLOCK_SIZE = 128  # vLLM's CPU default
CONNECTORS = {"ours": "PDConnector", "ours-thp": "PDConnector", "intree": "NixlConnector"}
#: Extra engine environment per variant. ``ours-thp`` asks PyTorch's CPU
#: allocator for transparent huge pages (so the KV cache is THP-backed).
VARIANT_ENV = {"ours-thp": {"THP_MEM_ALLOC_ENABLE": "1"}}

# Per-connector metric names on D (Engine.metrics() sums samples over labels).
KEYS = {
    "ours": dict(
        count="vllm:pd_ext_kv_transfer_seconds_count",
        xfer="vllm:pd_ext_kv_transfer_seconds_sum",
        bytes="vllm:pd_ext_kv_bytes_total",
        descs="vllm:pd_ext_kv_descriptors_total",
        blocks="vllm:pd_ext_kv_blocks_total",
        wait="vllm:pd_ext_kv_wait_seconds_sum",
        failures="vllm:pd_ext_kv_failures_total",
        hist="vllm:pd_ext_kv_transfer_seconds",
        wait_hist="vllm:pd_ext_kv_wait_seconds",
    ),
    "intree": dict(
        count="vllm:nixl_xfer_time_seconds_count",
        xfer="vllm:nixl_xfer_time_seconds_sum",
        bytes="vllm:nixl_bytes_transferred_sum",
        descs="vllm:nixl_num_descriptors_sum",
        blocks=None,
        wait=None,
        failures="vllm:nixl_num_failed_transfers_total",
        hist="vllm:nixl_xfer_time_seconds",
        wait_hist=None,
    ),
}
EXTERNAL = "vllm:prompt_tokens_by_source_total[external_kv_transfer]"
LOADED_RE = re.compile(r"PDConnector: request (\S+) loaded (\d+) tokens \((\d+) B, (\d+) "
                       r"descriptors\) from engine \S+ in ([\d.]+) ms")


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def token_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 3000) for _ in range(n)]


def blocks_for(n_tokens: int) -> int:
    return -(-n_tokens // BLOCK_SIZE)




# --------------------------------------------------------------------------
# model geometry and memcpy baseline
# --------------------------------------------------------------------------

@dataclass
class Geometry:
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @classmethod
    def of(cls, model: Path) -> Geometry:
        cfg = json.loads((model / "config.json").read_text())
        heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return cls(cfg["num_hidden_layers"], heads, head_dim)

    @property
    def block_bytes_per_layer(self) -> int:  # K and V of one 128-token block, one layer
        return 2 * self.kv_heads * self.head_dim * BLOCK_SIZE * self.dtype_bytes

    def kv_bytes(self, n_tokens: int) -> int:
        return blocks_for(n_tokens) * self.layers * self.block_bytes_per_layer


def page_buffer(nbytes: int, huge: bool) -> tuple[Any, Any]:
    """A touched anonymous buffer backed by 2 MiB (THP) or 4 KiB pages; keep both alive."""
    import mmap

    import numpy as np

    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    arr = np.frombuffer(mm, dtype=np.uint8)
    arr.fill(1)
    return arr, mm


def memcpy_gbps(nbytes: int, reps: int, huge: bool) -> float:
    import numpy as np

    src, _m1 = page_buffer(nbytes, huge)
    dst, _m2 = page_buffer(nbytes, huge)
    np.copyto(dst, src)
    secs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        secs.append(time.perf_counter() - t0)
    del src, dst
    return nbytes / median(secs) / 1e9


# --------------------------------------------------------------------------
# transport probe: our NixlTransport between two processes, engine layout
# --------------------------------------------------------------------------

def _probe_target(geo: Geometry, nblocks: int, huge: bool, conn: Any) -> None:
    from vllm_pd_ext.transport.nixl import NixlTransport

    slab, _mm = page_buffer(geo.layers * nblocks * geo.block_bytes_per_layer, huge)
    t = NixlTransport(f"probe-p-{os.getpid()}", ["UCX"], False)
    t.register([(slab.ctypes.data, slab.nbytes)], "DRAM", 0)
    t.start_progress_pump(0.001)  # as the producer worker does
    conn.send((t.metadata(), slab.ctypes.data))
    conn.poll(600)
    t.close()


def transport_probe(geo: Geometry, lengths: list[int], reps: int, huge: bool
                    ) -> dict[int, dict[str, float]]:
    """Time ``post_read`` alone and post -> DONE for the descriptors D would post.

    Two processes, P's and D's KV laid out as in the engines (one region per
    layer, ``nblocks`` blocks each), UCX on 127.0.0.1 (``UCX_NET_DEVICES=lo``),
    the same ``NixlTransport`` and ``build_descriptors`` as the worker. Both
    sides' memory is backed by huge pages (THP) or by 4 KiB pages (``huge``).
    """
    import multiprocessing as mp

    from vllm_pd_ext.transport import XferState
    from vllm_pd_ext.transport.coalesce import build_descriptors
    from vllm_pd_ext.transport.nixl import NixlTransport
    from vllm_pd_ext.wire.protocol import Region

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    need = max(blocks_for(n) for n in lengths)
    nblocks = 2 * need + 2
    blen = geo.block_bytes_per_layer
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_probe_target, args=(geo, nblocks, huge, there), daemon=True)
    proc.start()
    out: dict[int, dict[str, float]] = {}
    t = None
    try:
        if not here.poll(120):
            raise RuntimeError("probe target did not start")
        meta, raddr = here.recv()
        slab, _mm = page_buffer(geo.layers * nblocks * blen, huge)
        slab.fill(0)
        t = NixlTransport(f"probe-d-{os.getpid()}", ["UCX"], False)
        t.register([(slab.ctypes.data, slab.nbytes)], "DRAM", 0)
        peer = t.add_peer(meta, "DRAM")

        def regions(base: int) -> list[Region]:
            return [Region(base + i * nblocks * blen, blen, blen, nblocks)
                    for i in range(geo.layers)]

        local, remote = regions(slab.ctypes.data), regions(raddr)
        for n in [lengths[0], *lengths]:  # the first READ also wires UCX up: discarded
            nb = blocks_for(n)
            post, total = [], []
            for r in range(reps):
                lo, ro = (r % 2) * (need + 1), ((r + 1) % 2) * (need + 1)
                descs = build_descriptors(list(range(lo, lo + nb)), list(range(ro, ro + nb)),
                                          local, remote)
                t0 = time.perf_counter()
                h = t.post_read(peer, descs, 0)
                t1 = time.perf_counter()
                deadline = t1 + 30
                while t.poll(h) is XferState.PROC and time.perf_counter() < deadline:
                    pass
                t2 = time.perf_counter()
                t.release(h)
                post.append(t1 - t0)
                total.append(t2 - t0)
            nbytes = sum(d[2] for d in descs)
            out[n] = dict(bytes=nbytes, descs=len(descs), post_ms=median(post) * 1e3,
                          total_ms=median(total) * 1e3, gbps=nbytes / median(total) / 1e9)
        if slab[0] != 1:
            raise RuntimeError("probe READ did not move the data")
    finally:
        if t is not None:
            t.close()
        here.send("done")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return out


# --------------------------------------------------------------------------
# engines and requests
# --------------------------------------------------------------------------

def foreign_engines() -> list[str]:
    out = subprocess.run(["pgrep", "-af", "vllm.entrypoints.openai.api_server"],
                         capture_output=True, text=True, check=False).stdout
    me = str(os.getpid())
    return [ln for ln in out.splitlines() if ln and ln.split()[0] != me
            and "pgrep" not in ln]


def wait_idle(limit_s: float) -> str:
    deadline = time.monotonic() + limit_s
    others = foreign_engines()
    if others:
        say(f"{len(others)} other vLLM engine(s) running; waiting up to {limit_s:.0f} s")
    while others and time.monotonic() < deadline:
        time.sleep(10)
        others = foreign_engines()
    if others:
        note = f"ran with {len(others)} other vLLM engine(s) on the machine (contention)"
        say("WARNING: " + note)
        return note
    return "no other vLLM engine on the machine"


def metrics_text(e: Engine) -> str:
    with urllib.request.urlopen(e.url + "/metrics", timeout=10) as r:
        return r.read().decode()


def histogram(text: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts of one histogram, summed over labels."""
    out: dict[float, float] = {}
    for m in re.finditer(rf'^{re.escape(name)}_bucket\{{[^}}]*le="([^"]+)"[^}}]*\}}\s+(\S+)',
                         text, re.M):
        le = float(m.group(1))
        out[le] = out.get(le, 0.0) + float(m.group(2))
    return out


def hist_delta(before: dict[float, float], after: dict[float, float]) -> dict[float, float]:
    return {le: after[le] - before.get(le, 0.0) for le in sorted(after)}


def hist_quantile(h: dict[float, float], q: float) -> float:
    """Upper bucket edge holding the q-quantile (cumulative bucket counts)."""
    total = h.get(math.inf, max(h.values(), default=0.0))
    if total <= 0:
        return math.nan
    for le in sorted(h):
        if h[le] >= q * total:
            return le
    return math.inf


def hist_above(h: dict[float, float], edge: float) -> float:
    total = h.get(math.inf, 0.0)
    return total - h.get(edge, total)


class Pair:
    """One P engine and one D engine with the same connector."""

    def __init__(self, kind: str, model: str, args: argparse.Namespace, log_dir: Path,
                 tag: str) -> None:
        self.kind = kind
        self.model = model
        self.family = kind.split("-")[0]
        connector = CONNECTORS[kind]
        common: dict[str, Any] = dict(
            connector=connector, kv_bytes=args.kv_bytes, max_model_len=args.max_model_len,
            env=dict(VARIANT_ENV.get(kind, {})),
            extra_args=["--hf-overrides",
                        json.dumps({"max_position_embeddings": args.max_model_len})])
        self.inflight: dict[int, tuple[str, float]] = {}  # thread -> (leg, start)
        self.p = Engine(f"{tag}-p", model, log_dir, role="kv_producer", cpu_bind="0", **common)
        self.d = Engine(f"{tag}-d", model, log_dir, role="kv_consumer", cpu_bind="1", **common)

    def start(self) -> Pair:
        say(f"starting {self.kind} pair ({CONNECTORS[self.kind]}) on {self.model}")
        self.p.start()
        self.d.start()
        self.p.wait_ready(timeout=600)
        self.d.wait_ready(timeout=600)
        say(f"{self.kind} pair ready: P {self.p.url}, D {self.d.url}")
        return self

    def stop(self) -> None:
        for e in (self.d, self.p):
            try:
                e.stop()
            except Exception as exc:  # keep stopping the other one
                say(f"stopping {e.name}: {exc}")

    def body(self, prompt: list[int]) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}

    def one(self, prompt: list[int], timeout: float) -> dict[str, Any]:
        """P leg then D leg; client latencies and the ids needed to find logs."""
        body = self.body(prompt)
        me = threading.get_ident()
        t0 = time.perf_counter()
        self.inflight[me] = ("p", t0)
        status, resp = self.p.post("/v1/completions",
                                   dict(body, kv_transfer_params={"do_remote_decode": True}),
                                   timeout=timeout)
        t1 = time.perf_counter()
        self.inflight[me] = ("d", t1)
        if status != 200:
            self.inflight.pop(me, None)
            raise RuntimeError(f"P leg failed ({status}): {resp}")
        params = resp.get("kv_transfer_params")
        if not params or not params.get("do_remote_prefill"):
            self.inflight.pop(me, None)
            raise RuntimeError(f"P returned no kv_transfer_params: {resp}")
        status, dresp = self.d.post("/v1/completions", dict(body, kv_transfer_params=params),
                                    timeout=timeout)
        t2 = time.perf_counter()
        self.inflight.pop(me, None)
        if status != 200:
            raise RuntimeError(f"D leg failed ({status}): {dresp}")
        return dict(p_ms=(t1 - t0) * 1e3, d_ms=(t2 - t1) * 1e3, p_id=resp.get("id"),
                    remote_request_id=params.get("remote_request_id"), d_id=dresp.get("id"),
                    prompt_tokens=dresp.get("usage", {}).get("prompt_tokens"))


# --------------------------------------------------------------------------
# handoff
# --------------------------------------------------------------------------

def settled_metrics(d: Engine, key: str, want: float, limit_s: float = 10.0
                    ) -> dict[str, float]:
    """D's metrics once ``key`` reached ``want`` (stats reach /metrics with a step's lag)."""
    deadline = time.monotonic() + limit_s
    m = d.metrics()
    while m.get(key, 0.0) < want and time.monotonic() < deadline:
        time.sleep(0.05)
        m = d.metrics()
    return m


def run_handoff(pair: Pair, lengths: list[int], reps: int, geo: Geometry, timeout: float
                ) -> list[dict[str, Any]]:
    k = KEYS[pair.family]
    # Warm-up (not counted): first handshake/wire-up and first shapes.
    for i, n in enumerate(sorted({lengths[0], lengths[-1]})):
        say(f"{pair.kind}: warm-up {n} tokens")
        pair.one(token_prompt(n, seed=900_000 + i), timeout)
    rows = []
    for n in lengths:
        for r in range(reps):
            seed = 100_000 * (r + 1) + n  # same prompts for both connectors
            before = pair.d.metrics()
            res = pair.one(token_prompt(n, seed), timeout)
            after = settled_metrics(pair.d, k["count"], before.get(k["count"], 0.0) + 1)

            def dl(key: str | None, before: dict[str, float] = before,
                   after: dict[str, float] = after) -> float | None:
                return None if key is None else after.get(key, 0.0) - before.get(key, 0.0)

            xfer = dl(k["xfer"]) or 0.0
            nbytes = dl(k["bytes"]) or 0.0
            row = dict(res, kind=pair.kind, tokens=n, rep=r, xfer_ms=xfer * 1e3,
                       bytes=nbytes, expected_bytes=geo.kv_bytes(n), descs=dl(k["descs"]),
                       blocks=dl(k["blocks"]), transfers=dl(k["count"]),
                       wait_ms=None if k["wait"] is None else (dl(k["wait"]) or 0.0) * 1e3,
                       external_tokens=dl(EXTERNAL), failures=dl(k["failures"]),
                       gbps=nbytes / xfer / 1e9 if xfer > 0 else math.nan)
            rows.append(row)
            say(f"{pair.kind}: {n:5d} tok rep {r}: xfer {row['xfer_ms']:8.2f} ms "
                f"{row['gbps']:6.2f} GB/s, {row['bytes'] / 2**20:7.1f} MiB, "
                f"descs {row['descs']:.0f}, P {res['p_ms']:8.1f} ms, D {res['d_ms']:7.1f} ms, "
                f"external {row['external_tokens']:.0f}")
    return rows


# --------------------------------------------------------------------------
# tail
# --------------------------------------------------------------------------

@dataclass
class TailResult:
    rows: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def dump_stacks(engine: Engine, py_spy: str, out: Path) -> None:
    """py-spy dump of every process in the engine's own process group."""
    assert engine.proc is not None
    pids = subprocess.run(["pgrep", "-g", str(engine.proc.pid)], capture_output=True,
                          text=True, check=False).stdout.split()
    with open(out, "a") as f:
        for pid in pids[:8]:
            r = subprocess.run([py_spy, "dump", "--pid", pid], capture_output=True, text=True,
                               check=False, timeout=60)
            f.write(f"===== pid {pid} at {time.strftime('%H:%M:%S')}\n{r.stdout}{r.stderr}\n")
        # Per-thread CPU (lifetime average): shows native threads py-spy does not name.
        ps = subprocess.run(["ps", "-L", "-o", "pid,tid,pcpu,psr,comm", "-p", ",".join(pids)],
                            capture_output=True, text=True, check=False, timeout=30)
        f.write(f"===== threads\n{ps.stdout}\n")


def watchdog(pair: Pair, stall_s: float, py_spy: str | None, log_dir: Path,
             stop: threading.Event) -> list[str]:
    """Per leg kind, when a leg has been in flight for stall_s (and again at 2.5x), dump
    that engine's stacks (py-spy), to tell a slow step from a stalled one."""
    dumped: list[str] = []
    while not stop.wait(1.0):
        now = time.perf_counter()
        for leg, t0 in list(pair.inflight.values()):
            level = next((f"{leg}@{x:g}" for x in (2.5 * stall_s, stall_s) if now - t0 >= x),
                         None)
            if level is None or level in dumped:
                continue
            dumped.append(level)
            engine = pair.p if leg == "p" else pair.d
            out = log_dir / f"{engine.name}-stacks.txt"
            say(f"{pair.kind}: a {leg.upper()} leg is in flight for {now - t0:.0f} s"
                + (f"; py-spy dump -> {out}" if py_spy else ""))
            if py_spy:
                try:
                    dump_stacks(engine, py_spy, out)
                except (OSError, subprocess.SubprocessError) as exc:
                    say(f"py-spy failed: {exc}")
    return dumped


def run_tail(pair: Pair, lengths: list[int], clients: int, timeout: float, limit_s: float,
             seed0: int, stall_s: float = 10.0, py_spy: str | None = None,
             log_dir: Path | None = None) -> dict[str, Any]:
    k = KEYS[pair.family]
    d_log_start = pair.d.log_path.stat().st_size
    p_log_start = pair.p.log_path.stat().st_size
    text0 = metrics_text(pair.d)
    m0 = pair.d.metrics()
    work: queue.Queue[tuple[int, int]] = queue.Queue()
    for i, n in enumerate(lengths):
        work.put((i, n))
    out = TailResult()
    lock = threading.Lock()
    deadline = time.monotonic() + limit_s
    t_start = time.perf_counter()

    def client() -> None:
        while time.monotonic() < deadline:
            try:
                i, n = work.get_nowait()
            except queue.Empty:
                return
            try:
                res = pair.one(token_prompt(n, seed0 + i), timeout)
                res.update(i=i, tokens=n, t_end=time.perf_counter() - t_start)
                with lock:
                    out.rows.append(res)
                    done = len(out.rows)
                if done % 10 == 0:
                    say(f"{pair.kind} tail: {done}/{len(lengths)} done")
            except Exception as exc:
                with lock:
                    out.errors.append(f"request {i} ({n} tok): {exc}")
                say(f"{pair.kind} tail: request {i} failed: {exc}")

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    stop = threading.Event()
    dog = threading.Thread(target=watchdog, daemon=True,
                           args=(pair, stall_s, py_spy, log_dir or pair.p.log_dir, stop))
    dog.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(1.0, deadline - time.monotonic() + timeout + 5))
    stop.set()
    dog.join(timeout=120)
    wall = time.perf_counter() - t_start
    time.sleep(0.5)  # last step's stats
    text1 = metrics_text(pair.d)
    m1 = pair.d.metrics()
    xfer_hist = hist_delta(histogram(text0, k["hist"]), histogram(text1, k["hist"]))
    wait_hist = (hist_delta(histogram(text0, k["wait_hist"]), histogram(text1, k["wait_hist"]))
                 if k["wait_hist"] else {})
    # Per-request READ time from D's log (ours only).
    with open(pair.d.log_path, errors="replace") as f:
        f.seek(d_log_start)
        d_log = f.read()
    with open(pair.p.log_path, errors="replace") as f:
        f.seek(p_log_start)
        p_log = f.read()
    loaded_ms = [float(m.group(5)) for m in LOADED_RE.finditer(d_log)]
    summary: dict[str, Any] = dict(
        kind=pair.kind, requests=len(lengths), completed=len(out.rows), errors=out.errors,
        wall_s=wall, rows=out.rows,
        transfers=m1.get(k["count"], 0) - m0.get(k["count"], 0),
        xfer_mean_ms=_mean_ms(m0, m1, k["xfer"], k["count"]),
        xfer_hist={str(le): c for le, c in xfer_hist.items()},
        wait_hist={str(le): c for le, c in wait_hist.items()},
        wait_mean_ms=_mean_ms(m0, m1, k["wait"], k["count"]) if k["wait"] else None,
        loaded_ms=loaded_ms,
    )
    for leg in ("p_ms", "d_ms"):
        xs = [r[leg] for r in out.rows]
        summary[leg] = dict(p50=pct(xs, 50), p99=pct(xs, 99), max=max(xs, default=math.nan))
    if loaded_ms:
        summary["loaded"] = dict(p50=pct(loaded_ms, 50), p99=pct(loaded_ms, 99),
                                 max=max(loaded_ms))
    for name, h in (("xfer", xfer_hist), ("wait", wait_hist)):
        if h:
            summary[f"{name}_bucket"] = dict(p50=hist_quantile(h, 0.5),
                                             p99=hist_quantile(h, 0.99),
                                             above_1s=hist_above(h, 1.0),
                                             above_10s=hist_above(h, 10.0))
    return dict(summary, p_log=p_log, d_log=d_log)


def _mean_ms(m0: dict[str, float], m1: dict[str, float], s: str, c: str) -> float:
    n = m1.get(c, 0) - m0.get(c, 0)
    return (m1.get(s, 0) - m0.get(s, 0)) / n * 1e3 if n else math.nan


def stall_report(tail: dict[str, Any], stall_s: float, max_lines: int = 12) -> list[str]:
    """Requests with a leg longer than ``stall_s``, and the log lines that name them."""
    out = []
    for r in sorted(tail["rows"], key=lambda r: -max(r["p_ms"], r["d_ms"]))[:10]:
        if max(r["p_ms"], r["d_ms"]) < stall_s * 1e3:
            break
        leg = "P leg (P's answer)" if r["p_ms"] >= r["d_ms"] else "D leg (D's pickup)"
        out.append(f"request {r['i']} ({r['tokens']} tok): P {r['p_ms'] / 1e3:.1f} s, "
                   f"D {r['d_ms'] / 1e3:.1f} s -> stalled in the {leg}")
        ids = [x for x in (r.get("remote_request_id"), r.get("p_id"), r.get("d_id")) if x]
        for who in ("p_log", "d_log"):
            hits = [ln for ln in tail[who].splitlines() if any(x in ln for x in ids)]
            for ln in hits[:max_lines]:
                out.append(f"  {who[0].upper()}: {ln[:300]}")
    notable = [ln for who in ("p_log", "d_log") for ln in tail[who].splitlines()
               if re.search(r"\b(WARNING|ERROR)\b", ln)
               and re.search(r"nixl|PDConnector|expire|timeout|abort", ln, re.I)]
    if notable:
        out.append(f"{len(notable)} connector warning/error lines during the tail; first ones:")
        out.extend("  " + ln[:300] for ln in notable[:max_lines])
    return out


# --------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------

def handoff_tables(rows: list[dict[str, Any]], lengths: list[int], geo: Geometry,
                   memcpy: dict[str, dict[int, float]], probe: dict[str, dict[int, Any]]
                   ) -> tuple[str, str, dict[str, Any]]:
    def med(kind: str, n: int, key: str) -> float:
        return median([r[key] for r in rows if r["kind"] == kind and r["tokens"] == n
                       and r[key] is not None])

    kinds = {r["kind"] for r in rows}
    t1 = ["| tokens | MiB | memcpy GB/s (THP / 4K) | probe GB/s (THP / 4K) | ours ms | ours GB/s "
          "| ours/memcpy | ours-thp GB/s | ours-thp/memcpy | ours KV wait ms | ours D-leg ms "
          "| descs ours | descs 1/block |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    t2 = ["| tokens | in-tree xfer ms | in-tree GB/s | in-tree descs | in-tree D-leg ms "
          "| xfer ours/in-tree | xfer ours-thp/in-tree | ours KV wait / in-tree xfer "
          "| D-leg ours/in-tree | D-leg ours-thp/in-tree |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    summary: dict[str, Any] = {}
    for n in lengths:
        nb = geo.kv_bytes(n)
        mc, mc4 = memcpy["thp"].get(n, math.nan), memcpy["4k"].get(n, math.nan)
        pr = probe["thp"].get(n, {}).get("gbps", math.nan)
        pr4 = probe["4k"].get(n, {}).get("gbps", math.nan)
        o_x, o_g = med("ours", n, "xfer_ms"), med("ours", n, "gbps")
        o_w, o_d = med("ours", n, "wait_ms"), med("ours", n, "d_ms")
        t_g = med("ours-thp", n, "gbps") if "ours-thp" in kinds else math.nan
        o_desc = med("ours", n, "descs")
        per_block = blocks_for(n) * geo.layers
        s = dict(bytes=nb, blocks=blocks_for(n), memcpy_gbps=mc, memcpy_4k_gbps=mc4,
                 probe_gbps=pr, probe_4k_gbps=pr4, ours_xfer_ms=o_x, ours_gbps=o_g,
                 ours_over_memcpy=o_g / mc, ours_thp_gbps=t_g, ours_thp_over_memcpy=t_g / mc,
                 metric_plausible=bool(not o_g > 1.5 * mc), ours_wait_ms=o_w, ours_d_ms=o_d,
                 ours_descs=o_desc, per_block_descs=per_block,
                 ours_thp_xfer_ms=med("ours-thp", n, "xfer_ms") if "ours-thp" in kinds
                 else math.nan)
        flag = "" if s["metric_plausible"] else " (!)"
        t1.append(f"| {n} | {nb / 2**20:.0f} | {fmt(mc)} / {fmt(mc4)} | {fmt(pr)} / {fmt(pr4)} "
                  f"| {fmt(o_x)} | {fmt(o_g)}{flag} | {fmt(o_g / mc)} | {fmt(t_g)} "
                  f"| {fmt(t_g / mc)} | {fmt(o_w)} | {fmt(o_d, 1)} | {fmt(o_desc, 0)} "
                  f"| {per_block} |")
        if "intree" in kinds:
            i_x, i_g = med("intree", n, "xfer_ms"), med("intree", n, "gbps")
            i_desc, i_d = med("intree", n, "descs"), med("intree", n, "d_ms")
            t_x = s["ours_thp_xfer_ms"]
            t_d = med("ours-thp", n, "d_ms") if "ours-thp" in kinds else math.nan
            s.update(intree_xfer_ms=i_x, intree_gbps=i_g, intree_descs=i_desc, intree_d_ms=i_d,
                     xfer_ratio=o_x / i_x, thp_xfer_ratio=t_x / i_x, wait_ratio=o_w / i_x,
                     d_ratio=o_d / i_d, ours_thp_d_ms=t_d, thp_d_ratio=t_d / i_d)
            t2.append(f"| {n} | {fmt(i_x)} | {fmt(i_g)} | {fmt(i_desc, 0)} | {fmt(i_d, 1)} "
                      f"| {fmt(o_x / i_x)} | {fmt(t_x / i_x)} | {fmt(o_w / i_x)} "
                      f"| {fmt(o_d / i_d)} | {fmt(t_d / i_d)} |")
        summary[str(n)] = s
    return "\n".join(t1), "\n".join(t2) if "intree" in kinds else "", summary


def targets(summary: dict[str, Any], lengths: list[int]) -> list[str]:
    out = []
    big = summary[str(lengths[-1])]
    for key, what in (("ours_over_memcpy", "ours (engine metric)"),
                      ("ours_thp_over_memcpy", "ours-thp (engine metric)")):
        r = big[key]
        if math.isnan(r):
            continue
        verdict = "met" if r >= 0.9 else f"missed by {0.9 - r:.2f}"
        out.append(f"target >= 0.9 of memcpy at {lengths[-1]} tokens, {what}: {r:.2f} "
                   f"({verdict})")
    if not all(v["metric_plausible"] for v in summary.values()):
        out.append("(!) faster than memcpy: D's transfer timer misses the copy, which UCX's "
                   "shared-memory READ does inside post_read()")
    if "xfer_ratio" in big:
        for key, what in (("xfer_ratio", "transfer time ours / in-tree"),
                          ("thp_xfer_ratio", "transfer time ours-thp / in-tree"),
                          ("wait_ratio", "ours KV wait / in-tree transfer"),
                          ("d_ratio", "D-leg ours / in-tree"),
                          ("thp_d_ratio", "D-leg ours-thp / in-tree")):
            if math.isnan(big[key]):
                continue
            missed = [str(n) for n in lengths if not summary[str(n)][key] <= 0.5]
            worst = max(summary[str(n)][key] for n in lengths)
            verdict = f"missed at {','.join(missed)} tokens" if missed else "met at every length"
            out.append(f"target <= 0.5, {what}: {big[key]:.2f} at {lengths[-1]} tokens, "
                       f"worst {worst:.2f} ({verdict})")
    return out


def tail_table(tails: dict[str, dict[str, Any]]) -> str:
    lines = ["| connector | done | P-leg p50/p99/max ms | D-leg p50/p99/max ms "
             "| D xfer p50/p99 (bucket) | D KV wait p50/p99 (bucket) | waits > 1 s / > 10 s "
             "| legs > stall | wall s |",
             "|---|---:|---|---|---|---|---|---:|---:|"]
    for kind, t in tails.items():
        def trio(d: dict[str, float] | None) -> str:
            return "/".join(fmt(d[q], 0) for q in ("p50", "p99", "max")) if d else "n/a"

        def bucket(d: dict[str, float] | None) -> str:
            return f"<= {d['p50']:g} s / <= {d['p99']:g} s" if d else "n/a"

        wb = t.get("wait_bucket")
        above = f"{wb['above_1s']:.0f} / {wb['above_10s']:.0f}" if wb else "n/a"
        lines.append(
            f"| {kind} | {t['completed']}/{t['requests']} | {trio(t['p_ms'])} "
            f"| {trio(t['d_ms'])} | {bucket(t.get('xfer_bucket'))} "
            f"| {bucket(wb)} | {above} | {t['stalled']} | {t['wall_s']:.0f} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------

def ensure_model(path: Path, preset: str) -> None:
    subprocess.run([sys.executable, str(REPO / "examples/make_tiny_model.py"), "--out",
                    str(path), "--preset", preset], check=True, stdout=subprocess.DEVNULL)


def report(result: dict[str, Any]) -> None:
    """Print the tables (also from a saved ``--out-json`` with ``--from-json``)."""
    args = argparse.Namespace(**result["args"])
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    geo = Geometry(**result["geometry"])
    memcpy = {page: {int(n): v for n, v in d.items()}
              for page, d in result["memcpy_gbps"].items()}
    probe = {page: {int(n): v for n, v in d.items()} for page, d in result["probe"].items()}
    print()
    if result.get("handoff"):
        t1, t2, summary = handoff_tables(result["handoff"]["rows"], lengths, geo, memcpy, probe)
        result["handoff"]["summary"] = summary
        print(f"KV handoff, bench model ({geo.layers} layers x {geo.kv_heads} KV heads x "
              f"{geo.head_dim} dim, bf16), median of {args.reps} requests per length")
        print(t1)
        if t2:
            print()
            print(t2)
        print()
        print("\n".join(targets(summary, lengths)))
    tails = result.get("tail") or {}
    if tails:
        print()
        print(f"Tail: {args.requests} requests, prompts uniform {args.tail_min}..{args.tail_max} "
              f"tokens, {args.clients} clients, {args.tail_model} model, max_tokens=1")
        print(tail_table(tails))
        for kind, t in tails.items():
            if t["errors"]:
                print(f"\n{kind}: {len(t['errors'])} failed requests, first: {t['errors'][0]}")
            if t["stall_lines"]:
                print(f"\n{kind}: legs over {args.stall_s:g} s / connector warnings:")
                print("\n".join(t["stall_lines"][:60]))
    print()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="128,512,1024,2048,4096",
                    help="handoff prompt lengths in tokens (comma-separated)")
    ap.add_argument("--reps", type=int, default=3, help="requests per handoff length")
    ap.add_argument("--requests", type=int, default=100, help="tail requests")
    ap.add_argument("--clients", type=int, default=4, help="concurrent tail clients")
    ap.add_argument("--tail-min", type=int, default=64)
    ap.add_argument("--tail-max", type=int, default=2048)
    ap.add_argument("--tail-model", choices=("bench", "tiny"), default="bench",
                    help="bench reuses the handoff engines; tiny starts a second pair")
    ap.add_argument("--skip-intree", action="store_true", help="only PDConnector")
    ap.add_argument("--no-thp-variant", action="store_true",
                    help="skip the handoff rerun of ours with THP_MEM_ALLOC_ENABLE=1")
    ap.add_argument("--skip-handoff", action="store_true")
    ap.add_argument("--skip-tail", action="store_true")
    ap.add_argument("--kv-bytes", type=int, default=3 << 29, help="KV cache bytes per engine")
    ap.add_argument("--max-model-len", type=int, default=4200)
    ap.add_argument("--memcpy-reps", type=int, default=9)
    ap.add_argument("--timeout", type=float, default=300.0, help="per HTTP leg, seconds")
    ap.add_argument("--tail-limit", type=float, default=1800.0,
                    help="stop starting tail requests after this many seconds")
    ap.add_argument("--stall-s", type=float, default=10.0, help="a leg longer than this stalled")
    ap.add_argument("--wait-idle", type=float, default=900.0,
                    help="wait up to this long for other vLLM engines to exit first")
    ap.add_argument("--py-spy", default=None,
                    help="py-spy binary: dump the stalled engine's stacks (once per leg)")
    ap.add_argument("--log-dir", default=None, help="default .runs/bench/<time>")
    ap.add_argument("--out-json", default=None)
    ap.add_argument("--from-json", default=None,
                    help="only print the tables of a saved --out-json result")
    args = ap.parse_args(argv)
    if args.from_json:
        report(json.loads(Path(args.from_json).read_text()))
        return 0

    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    if max(lengths) + 1 > args.max_model_len:
        ap.error("--max-model-len must exceed the longest prompt")
    kinds = ["ours"]
    if not args.no_thp_variant and not args.skip_handoff:
        kinds.append("ours-thp")
    if not args.skip_intree:
        kinds.append("intree")
    log_dir = Path(args.log_dir or REPO / ".runs" / "bench" / time.strftime("%Y%m%d-%H%M%S"))
    bench = REPO / ".models" / "bench"
    ensure_model(bench, "bench")
    tiny = REPO / ".models" / "tiny"
    if args.tail_model == "tiny":
        ensure_model(tiny, "tiny")
    geo = Geometry.of(bench)
    rng = random.Random(20260101)
    tail_lengths = [rng.randint(args.tail_min, args.tail_max) for _ in range(args.requests)]

    result: dict[str, Any] = dict(
        command=" ".join([Path(sys.executable).name, *sys.argv]), args=vars(args),
        log_dir=str(log_dir), geometry=vars(geo), cpus=os.cpu_count())
    say(f"logs under {log_dir}")
    result["contention"] = wait_idle(args.wait_idle)

    memcpy: dict[str, dict[int, float]] = {"thp": {}, "4k": {}}
    probe: dict[str, dict[int, Any]] = {"thp": {}, "4k": {}}
    if not args.skip_handoff:
        for page in ("thp", "4k"):
            for n in lengths:
                memcpy[page][n] = memcpy_gbps(geo.kv_bytes(n), args.memcpy_reps, page == "thp")
                say(f"memcpy {page:3s} {geo.kv_bytes(n) / 2**20:7.1f} MiB: "
                    f"{memcpy[page][n]:.2f} GB/s")
            probe[page] = transport_probe(geo, lengths, args.memcpy_reps, page == "thp")
            for v in probe[page].values():
                say(f"probe  {page:3s} {v['bytes'] / 2**20:7.1f} MiB, {v['descs']} descs: post "
                    f"{v['post_ms']:.2f} ms, post->DONE {v['total_ms']:.2f} ms, "
                    f"{v['gbps']:.2f} GB/s")
    result["memcpy_gbps"] = memcpy
    result["probe"] = probe

    handoff_rows: list[dict[str, Any]] = []
    tails: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        do_tail = not args.skip_tail and kind in ("ours", "intree")
        pairs_needed = []
        if not args.skip_handoff or (do_tail and args.tail_model == "bench"):
            pairs_needed.append(("bench", str(bench)))
        if do_tail and args.tail_model == "tiny":
            pairs_needed.append(("tiny", str(tiny)))
        for mname, mpath in pairs_needed:
            pair = Pair(kind, mpath, args, log_dir, f"{kind}-{mname}")
            try:
                pair.start()
                if mname == "bench" and not args.skip_handoff:
                    handoff_rows += run_handoff(pair, lengths, args.reps, geo, args.timeout)
                if do_tail and args.tail_model == mname:
                    say(f"{kind}: tail, {args.requests} requests, {args.clients} clients")
                    tail = run_tail(pair, tail_lengths, args.clients, args.timeout,
                                    args.tail_limit, seed0=500_000, stall_s=args.stall_s,
                                    py_spy=args.py_spy, log_dir=log_dir)
                    tail["stall_lines"] = stall_report(tail, args.stall_s)
                    tail["stalled"] = sum(1 for r in tail["rows"]
                                          if max(r["p_ms"], r["d_ms"]) >= args.stall_s * 1e3)
                    tails[kind] = tail
            finally:
                pair.stop()
                say(f"{kind} pair ({mname}) stopped")

    if handoff_rows:
        result["handoff"] = dict(rows=handoff_rows)
    if tails:
        result["tail"] = {k: {kk: vv for kk, vv in t.items() if kk not in ("p_log", "d_log")}
                          for k, t in tails.items()}
    report(result)
    print(f"logs: {log_dir}; contention: {result['contention']}")
    if args.out_json:
        Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out_json).write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {args.out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
