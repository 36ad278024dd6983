"""Proxy overhead benchmark: direct calls vs vllm-pd-proxy vs vLLM's toy proxy.

One fake engine process answers both legs instantly (P leg: JSON with
``kv_transfer_params``; D leg: a short SSE stream or a JSON completion). The
same workload then runs against three targets:

* ``direct``: the load generator does the P leg then the D leg itself, i.e.
  exactly the backend work a proxy does, without the proxy hop;
* ``ours``: ``vllm-pd-proxy`` (pull mode) in front of the fake;
* ``toy``: vLLM's reference ``toy_proxy_server.py`` (FastAPI + uvicorn +
  httpx), whose path is given with ``--toy-proxy`` (not vendored here).

Reported: latency p50/p90/p99 of sequential requests (added latency = target
minus direct) and the sustained request rate of a closed loop of
``--concurrency`` clients over a bounded number of requests. Everything binds
127.0.0.1; the script only kills the processes it started.

    python benchmarks/bench_proxy.py --toy-proxy /tmp/toy_proxy_server.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------
# Fake engine: a minimal keep-alive HTTP/1.1 server (asyncio.Protocol), so the
# backend costs far less CPU than either proxy and does not cap throughput.
# --------------------------------------------------------------------------

P_ANSWER = json.dumps(
    {
        "id": "cmpl-p",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "bench-engine",
            "remote_block_ids": list(range(16)),
            "remote_host": HOST,
            "remote_port": 5600,
            "tp_size": 1,
        },
    }
).encode()
D_ANSWER = json.dumps(
    {
        "id": "cmpl-d",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "tok " * 8, "finish_reason": "length"}],
    }
).encode()
D_EVENTS = [
    b"data: " + json.dumps({"choices": [{"index": 0, "text": f"tok{i} "}]}).encode() + b"\n\n"
    for i in range(8)
] + [b"data: [DONE]\n\n"]
MODELS = json.dumps({"object": "list", "data": [{"id": "bench-model"}]}).encode()


def _response(status: str, ctype: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 "
        + status.encode()
        + b"\r\nContent-Type: "
        + ctype
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


def _chunked_sse() -> bytes:
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in D_EVENTS)
    return head + chunks + b"0\r\n\r\n"


class FakeEngineProtocol(asyncio.Protocol):
    SSE = _chunked_sse()
    P_RESP = _response("200 OK", b"application/json", P_ANSWER)
    D_RESP = _response("200 OK", b"application/json", D_ANSWER)
    OK = _response("200 OK", b"text/plain", b"")
    MODELS_RESP = _response("200 OK", b"application/json", MODELS)

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            self.transport.write(self._answer(head.split(" ", 2)[1], body))

    def _answer(self, path: str, body: bytes) -> bytes:
        if path == "/health":
            return self.OK
        if path == "/v1/models":
            return self.MODELS_RESP
        req = json.loads(body)
        kv = req.get("kv_transfer_params") or {}
        if kv.get("do_remote_decode") is True:
            return self.P_RESP
        return self.SSE if req.get("stream") else self.D_RESP


def serve_fake(ports: list[int]) -> None:
    """Entry point of the fake engine subprocess (``--serve-fake``)."""
    loop = _new_loop()

    async def main() -> None:
        servers = [
            await loop.create_server(FakeEngineProtocol, HOST, port, backlog=1024) for port in ports
        ]
        print("ready", flush=True)
        await asyncio.gather(*(s.serve_forever() for s in servers))

    loop.run_until_complete(main())


# --------------------------------------------------------------------------
# Load generation
# --------------------------------------------------------------------------


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


REQUEST = {"model": "bench-model", "prompt": "Hello " * 64, "max_tokens": 8}
P_LEG = {
    **REQUEST,
    "max_tokens": 1,
    "stream": False,
    "kv_transfer_params": {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    },
}


class Target:
    """How one request is made against a target (direct does both legs)."""

    def __init__(self, name: str, base: str, stream: bool, p_base: str = "") -> None:
        self.name, self.base, self.p_base, self.stream = name, base, p_base, stream
        self.body = json.dumps({**REQUEST, "stream": stream}).encode()
        self.p_body = json.dumps(P_LEG).encode()
        self.headers = {"Content-Type": "application/json"}

    async def one(self, session: aiohttp.ClientSession) -> None:
        url = "/v1/completions"
        if self.p_base:  # direct: the P leg the proxy would send, then D
            async with session.post(self.p_base + url, data=self.p_body, headers=self.headers) as r:
                kv = (await r.json())["kv_transfer_params"]
            body = json.dumps({**REQUEST, "stream": self.stream, "kv_transfer_params": kv})
            body = body.encode()
        else:
            body = self.body
        async with session.post(self.base + url, data=body, headers=self.headers) as r:
            data = await r.read()
            if r.status != 200 or not data:
                raise RuntimeError(f"{self.name}: HTTP {r.status} {data[:200]!r}")


async def latency(target: Target, n: int, warmup: int, deadline_s: float) -> list[float]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        for _ in range(warmup):
            await target.one(session)
        out: list[float] = []
        stop = time.perf_counter() + deadline_s
        for _ in range(n):
            t = time.perf_counter()
            await target.one(session)
            out.append(time.perf_counter() - t)
            if t > stop:
                break
        return out


async def throughput(target: Target, n: int, concurrency: int, deadline_s: float) -> float:
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:
        for _ in range(50):
            await target.one(session)
        remaining = n
        done = 0
        stop = time.perf_counter() + deadline_s

        async def worker() -> None:
            nonlocal remaining, done
            while remaining > 0 and time.perf_counter() < stop:
                remaining -= 1
                await target.one(session)
                done += 1

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - t)


async def wait_ready(url: str, timeout: float = 30.0) -> None:
    async with aiohttp.ClientSession() as session:
        stop = time.monotonic() + timeout
        while time.monotonic() < stop:
            try:
                async with session.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def pct(samples: list[float], q: float) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[int(q) - 1] * 1000


# --------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------


def start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # by PID: only what we started
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    p_port, d_port, ours_port, toy_port = (free_port() for _ in range(4))
    logdir = Path(args.log_dir)
    logdir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        fake = start(
            [sys.executable, __file__, "--serve-fake", str(p_port), str(d_port)],
            logdir / "fake.log",
        )
        procs.append(fake)
        p_url, d_url = f"http://{HOST}:{p_port}", f"http://{HOST}:{d_port}"
        await wait_ready(p_url + "/health")
        procs.append(
            start(
                [
                    sys.executable,
                    "-m",
                    "vllm_pd_proxy.cli",
                    "--host",
                    HOST,
                    "--port",
                    str(ours_port),
                    "--prefill",
                    p_url,
                    "--decode",
                    d_url,
                    "--local-prefill-threshold",
                    "0",
                    "--log-level",
                    args.proxy_log_level,
                ],
                logdir / "ours.log",
            )
        )
        targets = [Target("direct", d_url, args.stream, p_base=p_url)]
        await wait_ready(f"http://{HOST}:{ours_port}/health")
        targets.append(Target("ours", f"http://{HOST}:{ours_port}", args.stream))
        if args.compare_migration:
            # The same proxy without request migration: no stream tracking
            # (no per-event parse of D's answer), the cost of migration.
            m0_port = free_port()
            procs.append(start(
                [sys.executable, "-m", "vllm_pd_proxy.cli", "--host", HOST, "--port",
                 str(m0_port), "--prefill", p_url, "--decode", d_url,
                 "--local-prefill-threshold", "0", "--log-level", args.proxy_log_level,
                 "--max-migrations", "0"],
                logdir / "ours_m0.log"))
            await wait_ready(f"http://{HOST}:{m0_port}/health")
            targets.append(Target("ours_m0", f"http://{HOST}:{m0_port}", args.stream))
        if args.toy_proxy:
            procs.append(
                start(
                    [
                        sys.executable,
                        args.toy_proxy,
                        "--host",
                        HOST,
                        "--port",
                        str(toy_port),
                        "--prefiller-hosts",
                        HOST,
                        "--prefiller-ports",
                        str(p_port),
                        "--decoder-hosts",
                        HOST,
                        "--decoder-ports",
                        str(d_port),
                    ],
                    logdir / "toy.log",
                )
            )
            await wait_ready(f"http://{HOST}:{toy_port}/healthcheck")
            targets.append(Target("toy", f"http://{HOST}:{toy_port}", args.stream))
        results: dict[str, Any] = {}
        for target in targets:
            lat = await latency(target, args.requests, args.warmup, args.deadline)
            rps = await throughput(target, args.load_requests, args.concurrency, args.deadline)
            results[target.name] = {
                "p50_ms": pct(lat, 50),
                "p90_ms": pct(lat, 90),
                "p99_ms": pct(lat, 99),
                "rps": rps,
                "n_latency": len(lat),
            }
        return results
    finally:
        for proc in reversed(procs):
            stop(proc)


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\nstream={args.stream} sequential n={args.requests} "
        f"closed loop c={args.concurrency} n={args.load_requests} cpus={os.cpu_count()}"
    )
    print(
        f"{'target':8} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'added p50':>10} "
        f"{'added p99':>10} {'req/s':>8}"
    )
    base = results["direct"]
    for name, r in results.items():
        added50 = r["p50_ms"] - base["p50_ms"] if name != "direct" else 0.0
        added99 = r["p99_ms"] - base["p99_ms"] if name != "direct" else 0.0
        print(
            f"{name:8} {r['p50_ms']:8.3f} {r['p90_ms']:8.3f} {r['p99_ms']:8.3f} "
            f"{added50:10.3f} {added99:10.3f} {r['rps']:8.0f}"
        )
    if "ours_m0" in results:
        ours, m0 = results["ours"], results["ours_m0"]
        print(f"\nmigration on vs off: added p50 {ours['p50_ms'] - m0['p50_ms']:+.3f} ms, "
              f"req/s {ours['rps'] / m0['rps']:.2f}x")
    if "toy" in results:
        ours, toy = results["ours"], results["toy"]
        print(
            f"\nours/toy req/s: {ours['rps'] / toy['rps']:.2f}x   "
            f"toy/ours added p50: "
            f"{(toy['p50_ms'] - base['p50_ms']) / max(ours['p50_ms'] - base['p50_ms'], 1e-6):.1f}x"
        )
    ours_added = results["ours"]["p50_ms"] - base["p50_ms"]
    print(
        f"target added p50 <= 1 ms: {'PASS' if ours_added <= 1.0 else 'FAIL'} ({ours_added:.3f} ms)"
    )
    if "toy" in results:
        ratio = results["ours"]["rps"] / results["toy"]["rps"]
        print(f"target req/s >= 2x toy: {'PASS' if ratio >= 2 else 'FAIL'} ({ratio:.2f}x)")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-fake":
        serve_fake([int(p) for p in sys.argv[2:]])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--toy-proxy", help="path to vLLM's toy_proxy_server.py (optional)")
    ap.add_argument("--requests", type=int, default=2000, help="sequential requests")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--load-requests", type=int, default=4000, help="closed-loop requests")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--deadline", type=float, default=60.0, help="max seconds per phase")
    ap.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--proxy-log-level",
        default="info",
        help="our proxy's --log-level (info = access log on, like uvicorn's)",
    )
    ap.add_argument("--compare-migration", action="store_true",
                    help="also run our proxy with --max-migrations 0 (ours_m0)")
    ap.add_argument("--log-dir", default="/tmp/bench_proxy_logs")
    ap.add_argument("--json-out", help="also write the results as JSON here")
    args = ap.parse_args()
    loop = _new_loop()
    results = loop.run_until_complete(bench(args))
    loop.close()
    report(results, args)
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps({"args": vars(args), "results": results}, indent=2)
        )


if __name__ == "__main__":
    main()
