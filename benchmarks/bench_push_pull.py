"""Pull vs push KV transfer through ``vllm-pd-proxy``: TTFT and D's KV wait, same prompts.

One invocation starts, per transfer mode, one PDConnector P/D pair on real vLLM
CPU engines bound to 127.0.0.1 (P on core 0, D on core 1) and one proxy in
front of them (``--transfer-mode pull|push``; the engines get
``kv_connector_extra_config.transfer_mode`` to match). Pairs run one after the
other (pull, stop, push), or all at once with ``--interleave`` (requests
alternate between the modes, so drift from other load on the machine hits
both alike; the idle pair still shares the cores).

For each prompt length, ``--reps`` sequential streamed completions
(``stream=true``, ``max_tokens`` small, temperature 0, ``ignore_eos``,
``return_token_ids``) go through the proxy, after ``--warmup`` uncounted
ones. Prompts are random token ids from a seeded RNG, distinct per request
(no prefix-cache hit) and the same in both modes. Per request:

* client TTFT: request sent to the proxy -> first streamed token at the
  client, i.e. request arrival to D's first token, seen from outside; also
  the proxy's own ttft_ms (receipt -> first event relayed) from its access log;
* D's KV wait: delta of D's ``vllm:pd_ext_kv_wait_seconds`` (sum / count).
  Pull: D's worker receiving the request spec -> KV READ done. Push: D's
  worker receiving the push spec (D registered its blocks, while P is still
  prefilling) -> P's WRITE notification, so it contains P's prefill;
* pull: D's ``vllm:pd_ext_kv_transfer_seconds`` (READ post -> done);
  push: P's WRITE post -> done, from P's "pushed" log line (the same figure as
  its ``vllm:pd_ext_kv_write_seconds``, which reaches /metrics only with P's
  next step);
* CPU seconds (user + system, every thread) that P's and D's processes used
  while the request ran: in push mode D steps for the whole of P's prefill
  while it waits, and by default (only the workers' OpenMP threads bound, as in
  ``bench_handoff.py``) its engine core and API server then run on P's core;
  ``--taskset`` confines each engine's processes to its core;
* checks: D's ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``
  grew by the prompt length (every token's KV came over the wire), and the
  output is a single engine's by the tests' equality oracle (docs/testing.md):
  after the timed requests of a mode, its P serves each prompt alone (no KV
  transfer, a fresh ``cache_salt``) and scores the P/D output on a mismatch.
  Token ids identical across modes are reported too, as information: near
  ties may legitimately resolve differently.

Engines and proxies are stopped by PID in ``finally``; logs go to
``--log-dir`` (default ``.runs/bench/push-pull-<time>/<mode>/``), and the
warnings/errors the engines and proxies logged while measured are printed at
the end.

    python benchmarks/bench_push_pull.py --out-json .runs/bench/push_pull.json
    python benchmarks/bench_push_pull.py --lengths 128 1024 --reps 3
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import re
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

import benchstats
from benchstats import median, pct

from vllm_pd_ext.testing.engines import REPO, Engine, Proxy
from vllm_pd_ext.testing.oracle import OracleError, compare, near_tie_nats, output_of
from vllm_pd_ext.tools import sse

sys.path.insert(0, str(REPO))
from tests.e2e.helpers import build_model, token_prompt

EXTERNAL = "vllm:prompt_tokens_by_source_total[external_kv_transfer]"
# Engine.metrics() keys (samples summed over labels; histograms as _sum/_count).
WAIT_SUM, WAIT_COUNT = "vllm:pd_ext_kv_wait_seconds_sum", "vllm:pd_ext_kv_wait_seconds_count"
XFER_SUM, XFER_COUNT = ("vllm:pd_ext_kv_transfer_seconds_sum",
                        "vllm:pd_ext_kv_transfer_seconds_count")
WRITE_SUM, WRITE_COUNT = "vllm:pd_ext_kv_write_seconds_sum", "vllm:pd_ext_kv_write_seconds_count"
KV_BYTES, KV_WRITTEN = "vllm:pd_ext_kv_bytes_total", "vllm:pd_ext_kv_bytes_written_total"
FAILURES = "vllm:pd_ext_kv_failures_total"
ACCESS_RE = re.compile(r"request_id=(\S+) .*?mode=(\S+) .*?status=(\d+) outcome=(\S+) "
                       r"ttft_ms=(\S+) e2e_ms=(\S+)")
#: Above this a same-host copy is not plausible (memcpy here: ~20-60 GB/s).
IMPLAUSIBLE_GBPS = 100
PUSHED_RE = re.compile(r"PDConnector: pushed (\S+) to engine \S+ \(request \S+\): (\d+) B, "
                       r"(\d+) descriptors, ([\d.]+) ms")
NOTABLE_RE = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback")
NOISE_RE = re.compile(r"LD_PRELOAD|ulimit|DeprecationWarning|FutureWarning")


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fmt(x: float | None, nd: int = 1) -> str:
    return benchstats.fmt(x, nd)


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system, all threads) of the processes in one process group."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        f = stat[stat.rfind(")") + 2:].split()
        if int(f[2]) == pgid:  # pgrp; utime and stime are f[11], f[12]
            total += int(f[11]) + int(f[12])
    return total / os.sysconf("SC_CLK_TCK")


def foreign_engines(mine: set[int]) -> list[str]:
    """vLLM API servers on this machine that this script did not start."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) in mine:
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "vllm.entrypoints.openai.api_server" in cmd:
            out.append(f"{pid} {cmd[:160]}")
    return out


def wait_idle(limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    others = foreign_engines(set())
    if others and limit_s > 0:
        say(f"{len(others)} other vLLM engine(s) running; waiting up to {limit_s:.0f} s")
    while others and time.monotonic() < deadline:
        time.sleep(5)
        others = foreign_engines(set())


# --------------------------------------------------------------------------
# one P/D pair + proxy per transfer mode
# --------------------------------------------------------------------------

class Stack:
    def __init__(self, mode: str, model: str, args: argparse.Namespace, log_dir: Path) -> None:
        self.mode = mode
        self.model = model
        self.log_dir = log_dir / mode
        extra = {"transfer_mode": "push"} if mode == "push" else {}
        overrides = (["--hf-overrides", json.dumps({"max_position_embeddings": args.max_model_len})]
                     if args.max_model_len > 4096 else [])
        common: dict[str, Any] = dict(connector="PDConnector", kv_bytes=args.kv_bytes,
                                      max_model_len=args.max_model_len, extra_config=extra,
                                      extra_args=overrides,
                                      taskset=getattr(args, "taskset", False))
        self.p = Engine(f"{mode}-p", model, self.log_dir, role="kv_producer", cpu_bind="0",
                     **common)
        self.d = Engine(f"{mode}-d", model, self.log_dir, role="kv_consumer", cpu_bind="1",
                     **common)
        self.proxy = Proxy([self.p.url], [self.d.url], self.log_dir,
                           args=["--transfer-mode", mode])
        self.rows: list[dict[str, Any]] = []
        self.errors: list[str] = []
        #: log path -> (offset when serving, offset when measuring ended)
        self.window: dict[Path, list[int]] = {}

    def mark(self, end: bool = False) -> None:
        """Remember where the logs are, to scan only what the measurement wrote."""
        for x in (self.p, self.d, self.proxy):
            try:
                size = x.log_path.stat().st_size
            except FileNotFoundError:
                continue
            if end:
                self.window.setdefault(x.log_path, [0, 0])[1] = size
            else:
                self.window[x.log_path] = [size, size]

    def pids(self) -> set[int]:
        return {x.proc.pid for x in (self.p, self.d, self.proxy) if x.proc is not None}

    def start(self) -> None:
        self.p.start()
        self.d.start()

    def wait_ready(self) -> None:
        self.p.wait_ready(timeout=600)
        self.d.wait_ready(timeout=600)
        self.proxy.start().wait_ready(timeout=60)
        self.mark()
        say(f"{self.mode}: P {self.p.url}, D {self.d.url}, proxy {self.proxy.url}")

    def stop(self) -> None:
        for x in (self.proxy, self.d, self.p):
            try:
                x.stop()
            except Exception as exc:  # keep stopping the others
                say(f"{self.mode}: stopping {x}: {exc}")

    def stream(self, rid: str, prompt: list[int], max_tokens: int, timeout: float
               ) -> dict[str, Any]:
        """One streamed completion through the proxy, timed at the client."""
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "ignore_eos": True, "stream": True,
                           "return_token_ids": True}).encode()
        url = urllib.parse.urlsplit(self.proxy.url)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
        tokens: list[int] = []
        prompt_ids: int | None = None
        first: float | None = None
        done = False
        t0 = time.perf_counter()
        try:
            conn.request("POST", "/v1/completions", body,
                         {"Content-Type": "application/json", "X-Request-Id": rid})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
            for event in sse.response_events(resp):
                if event.kind is sse.Kind.DONE:
                    done = True
                    break
                if event.kind is sse.Kind.ERROR:
                    raise RuntimeError(f"stream error: {event.data['error']}")
                for ch in event.data.get("choices", []):
                    if ch.get("prompt_token_ids") is not None:
                        prompt_ids = len(ch["prompt_token_ids"])
                    ids = ch.get("token_ids") or []
                    if ids and first is None:
                        first = time.perf_counter()
                    tokens += ids
        finally:
            conn.close()
        t1 = time.perf_counter()
        if not done:
            raise RuntimeError("stream ended without [DONE]")
        return dict(ttft_ms=(first - t0) * 1e3 if first else math.nan, e2e_ms=(t1 - t0) * 1e3,
                    token_ids=tokens, prompt_ids=prompt_ids)


def settled(e: Engine, key: str, want: float, limit_s: float) -> tuple[dict[str, float], bool]:
    """``e``'s metrics once ``key`` reached ``want`` (stats reach /metrics a step late)."""
    deadline = time.monotonic() + limit_s
    m = e.metrics()
    while m.get(key, 0.0) < want and time.monotonic() < deadline:
        time.sleep(0.05)
        m = e.metrics()
    return m, m.get(key, 0.0) >= want


def measure(st: Stack, n: int, rep: int, prompt: list[int], args: argparse.Namespace
            ) -> dict[str, Any]:
    rid = f"bench-{st.mode}-{n}-{rep}-{os.getpid()}"
    d0, p0 = st.d.metrics(), st.p.metrics()
    assert st.p.proc is not None and st.d.proc is not None
    cpu0 = group_cpu_s(st.p.proc.pid), group_cpu_s(st.d.proc.pid)
    res = st.stream(rid, prompt, args.max_tokens, args.timeout)
    # CPU the engines burnt for this request (from send to [DONE], plus the scrapes).
    cpu1 = group_cpu_s(st.p.proc.pid), group_cpu_s(st.d.proc.pid)
    d1, d_ok = settled(st.d, WAIT_COUNT, d0.get(WAIT_COUNT, 0.0) + 1, args.settle_s)
    d1, ext_ok = settled(st.d, EXTERNAL, d0.get(EXTERNAL, 0.0) + n, args.settle_s)
    if st.mode == "push":
        # P ships its worker's stats with its next step: an idle P may report this
        # WRITE only with the next request, so do not wait long for it.
        p1, p_ok = settled(st.p, WRITE_COUNT, p0.get(WRITE_COUNT, 0.0) + 1,
                           min(args.settle_s, 0.5))
    else:
        p1, p_ok = st.p.metrics(), True

    def dl(m0: dict[str, float], m1: dict[str, float], key: str) -> float:
        return m1.get(key, 0.0) - m0.get(key, 0.0)

    def per(m0: dict[str, float], m1: dict[str, float], s: str, c: str) -> float | None:
        cnt = dl(m0, m1, c)
        return dl(m0, m1, s) / cnt * 1e3 if cnt > 0 else None

    row = dict(res, mode=st.mode, tokens=n, rep=rep, request_id=rid, prompt=prompt,
               p_cpu_ms=(cpu1[0] - cpu0[0]) * 1e3, d_cpu_ms=(cpu1[1] - cpu0[1]) * 1e3,
               wait_ms=per(d0, d1, WAIT_SUM, WAIT_COUNT), waits=dl(d0, d1, WAIT_COUNT),
               xfer_ms=per(d0, d1, XFER_SUM, XFER_COUNT),
               write_ms=per(p0, p1, WRITE_SUM, WRITE_COUNT), writes=dl(p0, p1, WRITE_COUNT),
               external=dl(d0, d1, EXTERNAL), d_bytes=dl(d0, d1, KV_BYTES),
               p_bytes_written=dl(p0, p1, KV_WRITTEN), failures=dl(d0, d1, FAILURES),
               settled=d_ok and ext_ok, p_settled=p_ok)
    xfer_s = dl(d0, d1, XFER_SUM) if st.mode == "pull" else dl(p0, p1, WRITE_SUM)
    moved = row["d_bytes"] if st.mode == "pull" else row["p_bytes_written"]
    row["xfer_gbps"] = moved / xfer_s / 1e9 if xfer_s > 0 else None
    row["kv_ok"] = (row["external"] == n and row["failures"] == 0
                    and row["prompt_ids"] in (None, n)
                    and len(res["token_ids"]) == args.max_tokens)
    extra = (f"write {fmt(row['write_ms'], 2)} ms" if st.mode == "push"
             else f"xfer {fmt(row['xfer_ms'], 2)} ms")
    say(f"{st.mode}: {n:5d} tok rep {rep}: TTFT {row['ttft_ms']:8.1f} ms, "
        f"KV wait {fmt(row['wait_ms'], 2)} ms, {extra}, external {row['external']:.0f}"
        + ("" if row["kv_ok"] else "  <-- KV CHECK FAILED")
        + ("" if d_ok and ext_ok else "  (D metrics not settled)")
        + ("" if p_ok else "  (P write not reported yet)"))
    return row


def run(stacks: list[Stack], lengths: list[int], args: argparse.Namespace,
        interleave: bool) -> None:
    def one(st: Stack, n: int, rep: int, seed: int, warm: bool) -> None:
        try:
            row = measure(st, n, rep, token_prompt(n, seed), args)
            if not warm:
                st.rows.append(row)
        except Exception as exc:  # record and go on: one bad request should not lose the run
            msg = f"{n} tok rep {rep}{' (warm-up)' if warm else ''}: {exc}"
            st.errors.append(msg)
            say(f"{st.mode}: FAILED {msg}")

    warm = [lengths[0], lengths[-1]][: args.warmup] + [lengths[-1]] * max(0, args.warmup - 2)
    groups = [stacks] if interleave else [[st] for st in stacks]
    for group in groups:
        for i, n in enumerate(warm):
            for st in group:
                one(st, n, -1 - i, 900_000 + 1000 * i + n, warm=True)
        for n in lengths:
            for rep in range(args.reps):
                # Same prompt in every mode; never a warm-up's (those are < 1e6).
                seed = 1_000_000 * (rep + 1) + n
                order = group if rep % 2 == 0 else group[::-1]
                for st in order:
                    one(st, n, rep, seed, warm=False)


# --------------------------------------------------------------------------
# logs and report
# --------------------------------------------------------------------------

def judge_rows(st: Stack, args: argparse.Namespace) -> None:
    """The tests' equality oracle for each measured request, with ``st``'s P
    serving the prompt alone as the single engine (untimed, after the run)."""
    eps = near_tie_nats(st.p.dtype)
    for r in st.rows:
        try:
            status, alone = st.p.post("/v1/completions", {
                "model": st.model, "prompt": r["prompt"], "max_tokens": args.max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                "cache_salt": f"oracle-{r['request_id']}"}, timeout=args.timeout)
            if status != 200:
                raise OracleError(f"single-engine request: HTTP {status}: {alone}")
            v = compare(st.p.url, st.model, r["prompt"], r["token_ids"],
                        output_of(alone).tokens, eps, timeout=args.timeout)
            r["oracle"] = "exact" if v.exact else "near_tie" if v.same else "different"
            if not v.same:
                say(f"{st.mode}: {r['tokens']} tok rep {r['rep']}: DIFFERENT from a single "
                    f"engine: {v.detail}")
        except (OracleError, OSError) as exc:
            r["oracle"] = "error"
            say(f"{st.mode}: {r['tokens']} tok rep {r['rep']}: oracle failed: {exc}")


def proxy_ttfts(st: Stack) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    try:
        text = st.proxy.log_path.read_text(errors="replace")
    except FileNotFoundError:
        return out
    for m in ACCESS_RE.finditer(text):
        out[m.group(1)] = dict(mode=m.group(2), status=m.group(3), outcome=m.group(4),
                               ttft_ms=m.group(5), e2e_ms=m.group(6))
    return out


def pushed_writes(st: Stack) -> dict[str, tuple[int, int, float]]:
    """P's log, push: client request id -> (bytes, descriptors, WRITE ms); the proxy
    files the push under ``<X-Request-Id>-<8 hex>``."""
    out: dict[str, tuple[int, int, float]] = {}
    try:
        text = st.p.log_path.read_text(errors="replace")
    except FileNotFoundError:
        return out
    for m in PUSHED_RE.finditer(text):
        out[m.group(1).rsplit("-", 1)[0]] = (int(m.group(2)), int(m.group(3)),
                                             float(m.group(4)))
    return out


def notable_lines(st: Stack, limit: int = 15) -> tuple[int, list[str]]:
    """Warning/error lines the engines and the proxy logged while being measured
    (startup noise and the shutdown's EngineDeadError are outside that window)."""
    lines: list[str] = []
    for path, (lo, hi) in st.window.items():
        with open(path, "rb") as f:
            f.seek(lo)
            text = f.read(max(0, hi - lo)).decode(errors="replace")
        for ln in text.splitlines():
            if NOTABLE_RE.search(ln) and not NOISE_RE.search(ln):
                lines.append(f"{path.name}: {ln.strip()[:300]}")
    return len(lines), lines[:limit]


def summarize(rows: list[dict[str, Any]], modes: list[str], lengths: list[int]
              ) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for n in lengths:
        s: dict[str, Any] = {}
        for mode in modes:
            rs = [r for r in rows if r["mode"] == mode and r["tokens"] == n]

            def col(key: str, rs: list[dict[str, Any]] = rs) -> list[float]:
                return [r[key] for r in rs if r.get(key) is not None
                        and not (isinstance(r[key], float) and math.isnan(r[key]))]

            xfer_key = "write_ms" if mode == "push" else "xfer_ms"
            s[mode] = dict(
                n=len(rs), kv_ok=sum(1 for r in rs if r["kv_ok"]),
                ttft_p50=median(col("ttft_ms")), ttft_p90=pct(col("ttft_ms"), 90),
                proxy_ttft_p50=median(col("proxy_ttft_ms")),
                wait_p50=median(col("wait_ms")), wait_p90=pct(col("wait_ms"), 90),
                xfer_p50=median(col(xfer_key)), xfer_p90=pct(col(xfer_key), 90),
                xfer_gbps_p50=median(col("xfer_gbps")),
                xfer_kind="P write" if mode == "push" else "D read",
                e2e_p50=median(col("e2e_ms")),
                p_cpu_p50=median(col("p_cpu_ms")), d_cpu_p50=median(col("d_cpu_ms")))
        if "pull" in s and "push" in s:
            for key in ("ttft_p50", "ttft_p90", "wait_p50"):
                a, b = s["push"][key], s["pull"][key]
                s[f"push_over_pull_{key}"] = b and a / b
        summary[str(n)] = s
    return summary


def tables(summary: dict[str, Any], modes: list[str], lengths: list[int]) -> str:
    t = ["| tokens | mode | ok | TTFT p50 ms | TTFT p90 ms | proxy TTFT p50 ms | D KV wait p50 ms "
         "| D KV wait p90 ms | xfer p50 ms (pull: D READ, push: P WRITE) | xfer p90 ms "
         "| xfer GB/s p50 | P CPU ms p50 | D CPU ms p50 |",
         "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in lengths:
        for mode in modes:
            m = summary[str(n)][mode]
            t.append(f"| {n} | {mode} | {m['kv_ok']}/{m['n']} | {fmt(m['ttft_p50'])} "
                     f"| {fmt(m['ttft_p90'])} | {fmt(m['proxy_ttft_p50'])} "
                     f"| {fmt(m['wait_p50'], 2)} | {fmt(m['wait_p90'], 2)} "
                     f"| {fmt(m['xfer_p50'], 2)} | {fmt(m['xfer_p90'], 2)} "
                     f"| {fmt(m['xfer_gbps_p50'])} | {fmt(m['p_cpu_p50'], 0)} "
                     f"| {fmt(m['d_cpu_p50'], 0)} |")
    if "pull" in modes and "push" in modes:
        t += ["", "| tokens | TTFT push/pull (p50) | TTFT push/pull (p90) | TTFT saved p50 ms "
              "| D KV wait push/pull (p50) |", "|---:|---:|---:|---:|---:|"]
        for n in lengths:
            s = summary[str(n)]
            saved = s["pull"]["ttft_p50"] - s["push"]["ttft_p50"]
            t.append(f"| {n} | {fmt(s['push_over_pull_ttft_p50'], 3)} "
                     f"| {fmt(s['push_over_pull_ttft_p90'], 3)} | {fmt(saved)} "
                     f"| {fmt(s['push_over_pull_wait_p50'], 2)} |")
    return "\n".join(t)


def clean(x: Any) -> Any:
    """JSON-friendly: NaN -> None, floats rounded."""
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, float):
        return None if math.isnan(x) else round(x, 3)
    return x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", nargs="+", default=["128", "512", "1024", "2048"],
                    help="prompt lengths in tokens (space- or comma-separated)")
    ap.add_argument("--reps", type=int, default=10, help="measured requests per length and mode")
    ap.add_argument("--warmup", type=int, default=2,
                    help="uncounted requests per mode first (shortest, then longest length)")
    ap.add_argument("--modes", nargs="+", default=["pull", "push"], choices=("pull", "push"))
    ap.add_argument("--interleave", action="store_true",
                    help="run every mode's engines at once and alternate requests between "
                         "them (default: one mode after the other)")
    ap.add_argument("--taskset", action="store_true",
                    help="confine all of P's processes to core 0 and all of D's to core 1 "
                         "(default, as bench_handoff.py: only the workers' OpenMP threads are "
                         "bound; API servers and engine cores float)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--kv-bytes", type=int, default=3 << 29, help="KV cache bytes per engine")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: longest prompt + max_tokens, at least 2048")
    ap.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    ap.add_argument("--settle-s", type=float, default=3.0,
                    help="how long to wait for a request's metrics to appear in /metrics")
    ap.add_argument("--wait-idle", type=float, default=0.0,
                    help="first wait up to this long for other vLLM engines to exit")
    ap.add_argument("--log-dir", default=None, help="default .runs/bench/push-pull-<time>")
    ap.add_argument("--out-json", default=None, help="write rows and summary here")
    args = ap.parse_args(argv)
    lengths = [int(x) for v in args.lengths for x in v.split(",") if x.strip()]
    modes = list(dict.fromkeys(args.modes))
    if args.max_model_len is None:
        args.max_model_len = max(2048, max(lengths) + args.max_tokens + 1)
    if max(lengths) + args.max_tokens > args.max_model_len:
        ap.error("--max-model-len must exceed the longest prompt + --max-tokens")

    log_dir = Path(args.log_dir or REPO / ".runs" / "bench" /
                   time.strftime("push-pull-%Y%m%d-%H%M%S"))
    model = build_model("bench", preset="bench")
    say(f"logs under {log_dir}")
    wait_idle(args.wait_idle)
    t_start = time.monotonic()
    stacks = [Stack(mode, model, args, log_dir) for mode in modes]
    contention: list[str] = []

    def note_contention(when: str) -> None:
        mine = {pid for st in stacks for pid in st.pids()}
        others = foreign_engines(mine)
        if others:
            contention.append(f"{when}: {len(others)} other vLLM engine(s)")
            say(f"WARNING: {when}: {len(others)} other vLLM engine(s) on the machine")

    groups = [stacks] if args.interleave else [[st] for st in stacks]
    try:
        for group in groups:
            try:
                for st in group:
                    say(f"{st.mode}: starting P (cpu 0), D (cpu 1) and proxy")
                    st.start()
                for st in group:
                    st.wait_ready()
                note_contention(f"before {'+'.join(st.mode for st in group)}")
                run(group, lengths, args, interleave=len(group) > 1)
                for st in group:
                    judge_rows(st, args)
                for st in group:
                    st.mark(end=True)
                note_contention(f"after {'+'.join(st.mode for st in group)}")
            finally:
                for st in group:
                    st.stop()
                    say(f"{st.mode}: stopped")
    finally:
        for st in stacks:  # whatever happened, nothing of ours keeps running
            st.stop()

    rows: list[dict[str, Any]] = []
    for st in stacks:
        access = proxy_ttfts(st)
        pushed = pushed_writes(st) if st.mode == "push" else {}
        for r in st.rows:
            if r["request_id"] in pushed:
                # Exact per request: P's metric reaches /metrics only with P's next step.
                nbytes, _, ms = pushed[r["request_id"]]
                r.update(write_ms=ms, write_bytes=nbytes,
                         xfer_gbps=nbytes / ms / 1e6 if ms > 0 else None)
            a = access.get(r["request_id"], {})
            try:
                r["proxy_ttft_ms"] = float(a["ttft_ms"])
            except (KeyError, ValueError):
                r["proxy_ttft_ms"] = None
            r["proxy_mode"] = a.get("mode")
        rows += st.rows

    # Same prompt -> same tokens in every mode (temperature 0).
    by_prompt: dict[tuple[int, int], dict[str, list[int]]] = {}
    for r in rows:
        by_prompt.setdefault((r["tokens"], r["rep"]), {})[r["mode"]] = r["token_ids"]
    mismatches = [f"{n} tok rep {rep}: " + ", ".join(f"{m}={ids}" for m, ids in got.items())
                  for (n, rep), got in sorted(by_prompt.items())
                  if len({tuple(ids) for ids in got.values()}) > 1]
    compared = sum(1 for got in by_prompt.values() if len(got) == len(modes))
    wrong_mode = [r["request_id"] for r in rows if r.get("proxy_mode") not in (None, r["mode"])]

    summary = summarize(rows, modes, lengths)
    wall = time.monotonic() - t_start
    print()
    print(f"Pull vs push through vllm-pd-proxy, bench model, {args.reps} sequential streamed "
          f"requests per length and mode (max_tokens={args.max_tokens}), "
          f"{'interleaved' if args.interleave else 'one mode after the other'}, "
          + ("all engine processes pinned (--taskset)" if args.taskset
             else "worker threads pinned") + "; medians / p90")
    print(tables(summary, modes, lengths))
    print()
    print("TTFT: client sends to the proxy -> first streamed token. proxy TTFT: the proxy's "
          "access log (receipt -> first event relayed).")
    print("D KV wait: D's vllm:pd_ext_kv_wait_seconds; pull: D worker gets the request -> READ "
          "done (after P answered); push: D worker registers (in parallel with P's prefill) -> "
          "P's WRITE notification, so it includes P's prefill.")
    print("xfer: pull: D's vllm:pd_ext_kv_transfer_seconds (READ post -> done); push: P's "
          "WRITE post -> done, from P's 'pushed' log line (its kv_write_seconds metric reaches "
          "/metrics only with P's next step). CPU: user+system time of each engine's "
          "processes over the request.")
    fast = sorted({mode for s in summary.values() for mode in modes
                   if (s[mode]["xfer_gbps_p50"] or 0) > IMPLAUSIBLE_GBPS})
    if fast:
        print(f"(!) {', '.join(fast)}: the xfer timer implies > {IMPLAUSIBLE_GBPS} GB/s, faster "
              "than memcpy on this host: it misses the copy, which UCX's shared-memory "
              "transport does inside the post call.")
    ok = sum(1 for r in rows if r["kv_ok"])
    verdicts = {k: sum(1 for r in rows if r.get("oracle") == k)
                for k in ("exact", "near_tie", "different", "error")}
    print(f"KV check (external_kv_transfer tokens == prompt length, no failures, "
          f"{args.max_tokens} tokens): {ok}/{len(rows)} requests ok")
    print(f"Outputs vs a single engine (oracle, eps {near_tie_nats(stacks[0].p.dtype)} nats): "
          f"{verdicts['exact']} exact, {verdicts['near_tie']} same up to near ties, "
          f"{verdicts['different']} DIFFERENT, {verdicts['error']} not judged, of {len(rows)}; "
          f"token ids identical across modes: {compared - len(mismatches)}/{compared} prompts")
    for m in mismatches[:5]:
        print(f"  across modes: {m}")
    if wrong_mode:
        print(f"  proxy access log names another mode for {len(wrong_mode)} requests")
    notes: dict[str, Any] = {}
    for st in stacks:
        count, first = notable_lines(st)
        notes[st.mode] = dict(errors=st.errors, notable_lines=count, first_notable=first)
        if st.errors:
            print(f"{st.mode}: {len(st.errors)} failed requests; first: {st.errors[0]}")
        if count:
            print(f"{st.mode}: {count} warning/error lines in {st.log_dir}; first ones:")
            for ln in first[:8]:
                print(f"  {ln}")
    print(f"logs: {log_dir}; wall {wall:.0f} s; contention: "
          f"{'; '.join(contention) or 'no other vLLM engine seen'}")

    short: dict[str, Any] = {}
    for n, s in summary.items():
        short[n] = {mode: {k: s[mode][k] for k in ("ttft_p50", "ttft_p90", "wait_p50",
                                                   "xfer_p50")} for mode in modes}
        if "push_over_pull_ttft_p50" in s:
            short[n]["push_over_pull_ttft_p50"] = s["push_over_pull_ttft_p50"]
            short[n]["push_over_pull_ttft_p90"] = s["push_over_pull_ttft_p90"]
    compact = {"bench": "push_pull", "lengths": lengths, "reps": args.reps, "modes": modes,
               "interleave": args.interleave, "taskset": args.taskset,
               "kv_ok": f"{ok}/{len(rows)}", "oracle": verdicts,
               "identical_across_modes": not mismatches,
               "failed": sum(len(st.errors) for st in stacks),
               "contention": bool(contention), "ms": clean(short)}
    print("RESULT " + json.dumps(compact, separators=(",", ":")))
    if args.out_json:
        out = Path(args.out_json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(compact, summary=clean(summary), contention=contention,
                                       args=vars(args), log_dir=str(log_dir),
                                       wall_s=wall, rows=rows, mismatches=mismatches,
                                       notes=notes), indent=1, default=str))
        print(f"wrote {out}")
    judged_same = verdicts["exact"] + verdicts["near_tie"] == len(rows)
    return 0 if ok == len(rows) and judged_same and rows else 1


if __name__ == "__main__":
    sys.exit(main())
