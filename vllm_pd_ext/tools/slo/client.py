"""The open-loop HTTP client: sends one rate point's trace and times it.

Who calls it: the ``vllm-pd-bench`` driver, once per rate point and
deployment, with the proxy's URL (disaggregated) or every replica's URL
(aggregated, no proxy). Lifecycle of one :func:`run_point`:

1. one ``ClientSession`` with an unlimited connector (the client never
   queues a request itself) and a trace hook that stamps when each
   request's headers leave (``sent_s``);
2. one task per trace request, created at ``start + at_s`` without waiting
   for earlier ones (open loop: a slow server shows up as latency and, if
   the generator itself lags, as dispatch delay, never as a lower rate);
3. each task picks the URL with the fewest requests in flight (ties: round
   robin), POSTs ``/v1/completions`` with ``stream: true``, parses the SSE
   stream as bytes arrive (``tools/sse.py``, :class:`StreamRecorder`) and
   returns a ``RequestResult``; every failure (HTTP status, timeout,
   connection, malformed or truncated stream) becomes that request's result;
4. after the last task ends: the results in trace order and the measured
   duration (first non-warm-up scheduled send to the last completion).

Times are ``loop.time()`` (monotonic) relative to the point's start. TTFT and
E2E are measured from the moment the task starts the request (before the
connection is made), as ``vllm bench serve`` does.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import sys
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, TextIO

import aiohttp
import msgspec

from vllm_pd_ext.tools import sse
from vllm_pd_ext.tools.slo.metrics import RequestResult
from vllm_pd_ext.tools.slo.trace import TraceRequest


class StreamRecorder:
    """Turns parsed chunks and their arrival times into one request's
    timings: the first chunk whose choices carry non-empty text is the first
    token, later content chunks give the ITL gaps; the usage chunk gives the
    token counts; a top-level ``pd_telemetry`` dict is kept; an ``error``
    object ends the request as failed; ``[DONE]`` stamps ``done_at``."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.first: float | None = None
        self.last: float | None = None
        self.itl_s: list[float] = []
        self.content_chunks = 0
        self.completion_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.telemetry: dict[str, Any] | None = None
        self.error = ""
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.done_at: float | None = None

    def on_event(self, event: sse.Event, now: float) -> None:
        """One parsed event, ``now`` being when the bytes that ended it arrived."""
        if event.kind is sse.Kind.DONE:
            self.done_at = now
        else:
            self.on_chunk(event.data, now)

    def on_chunk(self, chunk: dict[str, Any], now: float) -> None:
        telemetry = chunk.get("pd_telemetry")
        if isinstance(telemetry, dict):
            self.telemetry = telemetry
        if chunk.get("error") and not self.error:
            self.error = f"stream error: {sse.error_message(chunk)[:200]}"
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("completion_tokens"), int):
                self.completion_tokens = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                self.prompt_tokens = usage["prompt_tokens"]
        self.token_ids.extend(sse.token_ids_of(chunk))
        text = sse.text_of(chunk)
        if text:
            self.text_parts.append(text)
            if self.last is None:
                self.first = now
            else:
                self.itl_s.append(now - self.last)
            self.last = now
            self.content_chunks += 1

    @property
    def ttft_s(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def output_tokens(self) -> int:
        return self.content_chunks if self.completion_tokens is None else self.completion_tokens


class LeastInFlight:
    """Picks the URL with the fewest requests in flight; ties go round robin."""

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("urls: at least one URL is needed")
        self.urls = [u.rstrip("/") for u in urls]
        self.in_flight = [0] * len(self.urls)
        self._next = 0

    def acquire(self) -> int:
        low, n = min(self.in_flight), len(self.urls)
        pick = next(i for k in range(n) if self.in_flight[i := (self._next + k) % n] == low)
        self._next = (pick + 1) % n
        self.in_flight[pick] += 1
        return pick

    def release(self, pick: int) -> None:
        self.in_flight[pick] -= 1


class Progress:
    """One ``\\r``-updated line on a TTY, else a line per 10% at most."""

    def __init__(self, label: str, total: int, enabled: bool,
                 stream: TextIO | None = None) -> None:
        self.label, self.total, self.enabled = label, total, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = enabled and self.stream.isatty()
        self.done = self.errors = self.in_flight = 0
        self._decile = 0

    def started(self) -> None:
        self.in_flight += 1
        if self.tty:
            self._show("\r")

    def finished(self, ok: bool) -> None:
        self.in_flight -= 1
        self.done += 1
        self.errors += not ok
        if self.tty:
            self._show("\r")
        elif self.enabled and self.total and (d := self.done * 10 // self.total) > self._decile:
            self._decile = d
            self._show("", "\n")

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _show(self, head: str, tail: str = "") -> None:
        self.stream.write(f"{head}{self.label}: {self.done}/{self.total}, errors {self.errors},"
                          f" in flight {self.in_flight}{tail}")
        self.stream.flush()


class _Sent:
    """Filled by the trace hook when the request headers leave."""

    at: float | None = None


async def _on_headers_sent(session: aiohttp.ClientSession, ctx: SimpleNamespace,
                           params: aiohttp.TraceRequestHeadersSentParams) -> None:
    sent = ctx.trace_request_ctx
    if isinstance(sent, _Sent) and sent.at is None:
        sent.at = asyncio.get_running_loop().time()


def _body(model: str, req: TraceRequest, extra_body: dict[str, Any] | None) -> bytes:
    body: dict[str, Any] = {
        "model": model, "prompt": req.prompt, "max_tokens": req.output_tokens,
        "min_tokens": req.output_tokens, "ignore_eos": True, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}, **(extra_body or {}),
    }
    return msgspec.json.encode(body)


async def _send(session: aiohttp.ClientSession, url: str, body: bytes, req: TraceRequest,
                t0: float, timeout_s: float) -> tuple[RequestResult, float]:
    """One request, start to end; never raises (but for cancellation).
    Returns the result and the end time (``t0`` time base)."""
    loop = asyncio.get_running_loop()
    sent = _Sent()
    started = loop.time()
    rec = StreamRecorder(started)
    headers = {"Content-Type": "application/json",
               "X-Request-Id": f"slo-{req.index}-{secrets.token_hex(8)}"}
    error, end = "", started
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(f"{url}/v1/completions", data=body, headers=headers,
                                    trace_request_ctx=sent) as resp:
                if resp.status != 200:
                    text = (await resp.read()).decode("utf-8", "replace")
                    error = f"http {resp.status}: {text[:200]}"
                else:
                    # The parser, not iter_events: every event of one read is
                    # stamped with that read's arrival time.
                    parser = sse.SSEParser()
                    async for data in resp.content.iter_any():
                        now = loop.time()
                        for event in parser.feed(data):
                            rec.on_event(event, now)
                    for event in parser.close():
                        rec.on_event(event, loop.time())
                    if rec.done_at is not None:
                        end = rec.done_at
                    if rec.error:
                        error = rec.error
                    elif rec.done_at is None:
                        error = "stream ended without [DONE]"
                    elif rec.first is None:
                        error = "stream carried no content"
    except TimeoutError:
        error = "timeout"
    except sse.SSEError as exc:
        error = f"stream: {exc}"
    except aiohttp.ClientConnectionError as exc:
        error = f"connection: {type(exc).__name__}: {exc}"[:300]
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        error = f"client: {type(exc).__name__}: {exc}"[:300]
    if error:
        end = loop.time()
    ok = not error
    result = RequestResult(
        index=req.index, scheduled_s=req.at_s,
        sent_s=(sent.at if sent.at is not None else started) - t0,
        prompt_tokens=rec.prompt_tokens if rec.prompt_tokens is not None else len(req.prompt),
        output_tokens=rec.output_tokens, ok=ok, error=error, ttft_s=rec.ttft_s,
        e2e_s=end - started if ok else None, itl_s=rec.itl_s, telemetry=rec.telemetry,
        warmup=req.warmup, text="".join(rec.text_parts),
        token_ids=rec.token_ids)
    return result, end - t0


async def run_point(urls: list[str], model: str, trace: list[TraceRequest], *, timeout_s: float,
                    progress: bool = True, extra_body: dict[str, Any] | None = None,
                    rate: float | None = None) -> tuple[list[RequestResult], float]:
    """Send ``trace`` open loop; return the results in trace order and the
    measured duration (first non-warm-up scheduled send to the last end of a
    non-warm-up request; 0.0 without one). ``rate`` only labels progress."""
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
    dispatch = LeastInFlight(urls)
    order = sorted(trace, key=lambda r: r.at_s)
    bar = Progress("point" if rate is None else f"rate {rate:g}", len(order), progress)
    hooks = aiohttp.TraceConfig()
    hooks.on_request_headers_sent.append(_on_headers_sent)
    loop = asyncio.get_running_loop()

    async def one(req: TraceRequest, session: aiohttp.ClientSession,
                  t0: float) -> tuple[RequestResult, float]:
        pick = dispatch.acquire()
        bar.started()
        try:
            outcome = await _send(session, dispatch.urls[pick], _body(model, req, extra_body),
                                  req, t0, timeout_s)
        finally:
            dispatch.release(pick)
        bar.finished(outcome[0].ok)
        return outcome

    tasks: list[asyncio.Task[tuple[RequestResult, float]]] = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=None, sock_read=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     trace_configs=[hooks]) as session:
        try:
            t0 = loop.time()
            for req in order:
                if (delay := t0 + req.at_s - loop.time()) > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(req, session, t0)))
            outcomes = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            bar.close()
    results = sorted((r for r, _ in outcomes), key=lambda r: r.index)
    measured = [(r, end) for r, end in outcomes if not r.warmup]
    if not measured:
        return results, 0.0
    start = min(r.scheduled_s for r, _ in measured)
    return results, max(end for _, end in measured) - start
