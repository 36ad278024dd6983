"""The legs: one call to a prefill (P) or decode (D) engine, and what the
flows share around them (admission, choosing a D, re-dispatch, signing).

One :class:`Upstream` per proxy, built by the
:class:`~vllm_pd_proxy.forward.Forwarder` around the shared ClientSession,
the pools, the health monitor, the metrics and the prefill gate; the flows
(:mod:`~vllm_pd_proxy.pull`, :mod:`~vllm_pd_proxy.push`, and the local
flow, a D leg alone) call it per request, on the event loop only. Each leg:

1. is bracketed by :meth:`Backend.acquire` / :meth:`Backend.release` (the
   routing policy sees outstanding work) and timed into
   ``pd_proxy_{prefill,decode}_leg_seconds``;
2. turns every failure into a :class:`~vllm_pd_proxy.errors.ProxyError`
   and tells the health monitor about the engine (a check soon, or
   ``draining`` at once);
3. a D leg relays D's answer to the client, or into a batch's merged
   answer (:mod:`vllm_pd_proxy.relay`), and
   closes D's response whatever happens, which makes the engine abort a
   request the client no longer wants.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from vllm_pd_ext.wire.auth import body_prompt_digest, sign_leg

from . import errors
from .admission import PrefillGate, PrefillSlot
from .backends import Backend, Pool
from .config import ProxyConfig
from .context import RequestContext, log_safe
from .errors import Outcome
from .health import HealthMonitor
from .metrics import Metrics
from .relay import (
    MidStreamFailure,
    OpenedDecode,
    StreamSink,
    complete_response,
    open_decode,
    open_decode_guarded,
    relay_stream,
)

# The logger of the request path (docs/proxy.md names it; log lines unchanged).
logger = logging.getLogger("vllm_pd_proxy.forward")


class Upstream:
    """Runs the legs of a request against the engine pools."""

    def __init__(
        self,
        config: ProxyConfig,
        prefill: Pool,
        decode: Pool,
        session: aiohttp.ClientSession,
        monitor: HealthMonitor,
        metrics: Metrics,
        gate: PrefillGate,
    ) -> None:
        self.config = config
        self.prefill = prefill
        self.decode = decode
        self.monitor = monitor
        self.metrics = metrics
        self._session = session
        self._gate = gate

    def sign(self, params: dict[str, Any], ctx: RequestContext, body: dict[str, Any]
             ) -> dict[str, Any]:
        """``params`` signed for this request and prompt (a shared secret is set),
        so an engine with the secret can tell our legs from anyone else's."""
        keyring = self.config.auth
        if keyring is None:
            return params
        if ctx.prompt_digest is None:  # once per request, for all its legs
            ctx.prompt_digest = body_prompt_digest(body)
        return sign_leg(keyring, params, ctx.request_id, body,
                        prompt_digest=ctx.prompt_digest)

    def pick_decode(self, ctx: RequestContext, exclude: list[Backend] | None = None) -> Backend:
        """A decode engine by the routing policy; 503 ``no_backend`` if none is routable."""
        decode = self.decode.pick(ctx.tokens, exclude or ())
        if decode is None:
            raise errors.no_backend(self.decode.describe_unavailable(), "decode")
        return decode

    def redispatch(
        self, ctx: RequestContext, exc: errors.ProxyError, role: str, tried: list[Backend],
        avoided: int = 0,
    ) -> bool:
        """Whether a failed leg may go to another engine of ``role``; records it.

        Only when the engine certainly ran nothing of it: it said it is
        draining, or the connection failed before the request left. Bounded
        by ``--prefill-retries`` per role and request (``avoided``: how many
        of ``tried`` an earlier attempt put there, not counted).
        """
        backend = exc.backend
        if backend is None or backend.role != role:
            return False
        unsent = exc.outcome == Outcome.UPSTREAM_UNREACHABLE and exc.retryable
        if not (exc.draining or unsent) or len(tried) - avoided >= self.config.prefill_retries:
            return False
        if exc.draining:
            self.monitor.mark_draining(backend)
        tried.append(backend)
        ctx.retries += 1
        self.metrics.retries.labels(role).inc()
        logger.info(
            "request %s: %s leg to %s again elsewhere after: %s",
            ctx.request_id,
            role,
            backend.url,
            log_safe(exc.message),
        )
        return True

    async def admit(
        self, ctx: RequestContext, tried: list[Backend], last: errors.ProxyError | None
    ) -> PrefillSlot:
        """A prefill slot, queued if need be; raises ``last`` (or 503) if none is usable."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            slot = await self._gate.acquire(ctx.tokens, tried, ctx.queued)
        finally:
            ctx.queued += loop.time() - started
        if slot is None:
            raise last or errors.no_backend(self.prefill.describe_unavailable(), "prefill")
        return slot

    async def prefill_leg(
        self, ctx: RequestContext, prefill: Backend, body: bytes, headers: dict[str, str]
    ) -> dict[str, Any]:
        """Run one P leg to completion; its parsed JSON answer or ProxyError."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        timeout = self.config.prefill_timeout
        prefill.acquire(ctx.tokens)
        ctx.mark("prefill_sent_ms")
        try:
            async with asyncio.timeout(timeout):
                url = prefill.url + ctx.endpoint
                async with self._session.post(url, data=body, headers=headers) as resp:
                    data = await resp.read()
                    ctx.mark("prefill_done_ms")
                    status = resp.status
                    ctype = resp.headers.get("Content-Type")
                    draining = errors.says_draining(status, resp.headers)
        except aiohttp.ClientError as exc:
            self.monitor.check_soon(prefill, reprobe=True)
            raise errors.upstream_unreachable("prefill", prefill, exc) from exc
        except TimeoutError:
            self.monitor.check_soon(prefill, reprobe=True)
            raise errors.upstream_timeout("prefill", prefill, timeout, "its answer") from None
        finally:
            prefill.release(ctx.tokens)
            self.metrics.prefill_leg.observe(loop.time() - started)
        if status >= 400:
            if draining:
                self.monitor.mark_draining(prefill)
            elif status >= 500:
                self.monitor.check_soon(prefill, reprobe=True)
            raise errors.upstream_status("prefill", prefill, status, data, ctype, draining)
        try:
            answer = msgspec.json.decode(data)
        except msgspec.DecodeError:
            raise errors.protocol_error("prefill", prefill, "answer is not valid JSON") from None
        if not isinstance(answer, dict):
            raise errors.protocol_error("prefill", prefill, "answer is not a JSON object")
        return answer

    async def decode_leg(
        self,
        sink: StreamSink,
        ctx: RequestContext,
        decode: Backend | None,
        body: bytes,
        headers: dict[str, str],
        prefix: tuple[int, ...] | None,
        guard: asyncio.Future[Any] | None = None,
        exclude: list[Backend] | None = None,
        endpoint: str | None = None,
        continuing: bool = False,
        before_relay: Callable[[], Awaitable[None]] | None = None,
    ) -> web.StreamResponse:
        """Run the D leg and relay it; ``guard`` is the P leg sent with it
        (push, concurrent pull).

        A non-streamed answer is returned as a response; a stream goes into
        ``sink`` (:class:`~vllm_pd_proxy.relay.ClientSink`: to the client).

        ``decode``: the D chosen beforehand (None: one is picked now, not in
        ``exclude``); ``prefix``: the prompt's chunk keys, remembered as
        cached on D once D answers; ``endpoint``: where the leg goes (default
        the client's); ``continuing``: a migration's continuation of a stream
        already started (:mod:`vllm_pd_proxy.migration`); ``before_relay``:
        awaited once D's first byte is in, before anything of D's reaches
        the client (a concurrent leg's token #1, P's, goes out first).

        Raises :class:`~vllm_pd_proxy.relay.MidStreamFailure` when a tracked
        stream (``ctx.track``) fails after it started.
        """
        decode = decode or self.pick_decode(ctx, exclude)
        ctx.decode = decode
        config = self.config
        max_event = config.max_sse_event_bytes
        loop = asyncio.get_running_loop()
        started = loop.time()
        decode.acquire(ctx.tokens)
        opened: OpenedDecode | None = None
        if ctx.marks is not None:
            ctx.marks.mode = ctx.mode
        ctx.mark("decode_sent_ms")
        try:
            if guard is None:
                opened = await open_decode(
                    self._session, ctx, decode, body, headers, config.decode_timeout, max_event,
                    endpoint,
                )
            else:
                opened = await open_decode_guarded(
                    self._session,
                    ctx,
                    decode,
                    body,
                    headers,
                    config.decode_timeout,
                    max_event,
                    guard,
                )
            ctx.mark("decode_first_byte_ms")
            if prefix is not None and decode.prefixes is not None:
                # D prefills (or receives) this prompt now: from here on its
                # prefix cache holds the prompt's whole blocks.
                decode.prefixes.add(prefix)
            if before_relay is not None:
                await before_relay()
            if not opened.sse:
                ctx.ttft = loop.time() - ctx.started
                if ctx.migration is not None:
                    ctx.migration.resumed(loop.time())
                return complete_response(ctx, opened)
            if ctx.migration is not None:
                ctx.migration.resumed(loop.time())
            out, error = await relay_stream(
                sink, ctx, decode, opened, config.stream_idle_timeout, max_event, continuing
            )
            if error is not None:
                ctx.outcome, ctx.error = Outcome.STREAM_ERROR, error.message
                self.monitor.check_soon(decode)
                if ctx.track is not None:
                    raise MidStreamFailure(error, ctx.progress)
            return out
        except errors.ProxyError as exc:
            # (A guarding P leg's error also ends up here; D is not at fault then.)
            if exc.backend is decode and exc.draining:
                self.monitor.mark_draining(decode)
            elif exc.backend is decode and exc.outcome in (
                Outcome.UPSTREAM_UNREACHABLE, Outcome.TIMEOUT
            ):
                self.monitor.check_soon(decode)
            raise
        finally:
            decode.release(ctx.tokens)
            self.metrics.decode_leg.observe(loop.time() - started)
            if opened is not None:
                # After a clean EOF the connection is already back in the pool
                # and this is a no-op; otherwise it drops the connection, which
                # makes the engine abort the request.
                opened.resp.close()
