"""Request migration, the orchestration: a prompt's flow again elsewhere.

Role: with ``--max-migrations`` > 0 the :class:`~vllm_pd_proxy.forward.Forwarder`
serves every prompt through :meth:`Failover.serve`, which runs the flow
(pull, push or local, the forwarder's ``run_flow``) and, when an engine
fails it, decides with the pure core :mod:`vllm_pd_proxy.migration` whether
and how it goes on: the whole flow again on other engines while the client
has seen nothing, or a continuation of the client's stream on another D
(:mod:`vllm_pd_proxy.stream_track` splices it in). One instance per proxy,
stateless between requests; every request's state lives in its
:class:`~vllm_pd_proxy.context.RequestContext` (``migration``, ``track``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from . import errors
from .backends import Backend
from .config import ProxyConfig
from .context import RequestContext, log_safe
from .conversations import Turn
from .errors import Outcome
from .metrics import Metrics
from .migration import (
    CONTINUATION_ENDPOINT,
    Cause,
    Ending,
    Migration,
    continuation_body,
    engine_failure,
    mid_stream_unsupported,
    no_prefill_left,
)
from .relay import MidStreamFailure, StreamSink
from .stream_track import StreamTracker
from .upstream import Upstream

# The logger of the request path (docs/proxy.md names it).
logger = logging.getLogger("vllm_pd_proxy.forward")

_encode = msgspec.json.encode


@dataclass(slots=True)
class Plan:
    """Where one prompt goes: prefilled on D (``local``) or by a P, the D
    chosen beforehand, the chunk keys to remember on it, the kept turn to
    read back. A migration drops the last three (and may set ``local``)."""

    local: bool
    decode: Backend | None
    prefix: tuple[int, ...] | None
    turn: Turn | None


RunFlow = Callable[..., Awaitable[web.StreamResponse]]


class Failover:
    """Serves prompts through their flow, migrating them on engine failures."""

    def __init__(self, config: ProxyConfig, up: Upstream, metrics: Metrics,
                 run_flow: RunFlow) -> None:
        self._config = config
        self._up = up
        self._metrics = metrics
        # (sink, ctx, body, headers, plan, avoid_p, avoid_d) -> the answer.
        self._run_flow = run_flow

    async def serve(self, sink: StreamSink, ctx: RequestContext, body: dict[str, Any],
                    headers: dict[str, str], plan: Plan) -> web.StreamResponse:
        """One prompt, migrated as often as it needs and may; its migrations
        are counted when it ends."""
        mig = self._migration(ctx, body)
        ending = Ending.FAILED
        try:
            out = await self._serve_migrating(sink, ctx, body, headers, plan)
            if ctx.outcome == Outcome.CANCELLED:
                ending = Ending.CANCELLED
            elif ctx.outcome == Outcome.OK and out.status < 400:
                ending = Ending.OK
            return out
        except asyncio.CancelledError:
            ending = Ending.CANCELLED
            raise
        finally:
            self._record_migrations(mig, ending)

    def _migration(self, ctx: RequestContext, body: dict[str, Any]) -> Migration:
        """The prompt's migration state and, for a stream, its tracker."""
        config = self._config
        deadline = ctx.started + config.request_deadline if config.request_deadline else None
        mig = ctx.migration = Migration(config.max_migrations, deadline)
        if ctx.stream and not ctx.responses:
            # The Responses API's events are no completion chunks: its
            # streams fail over before their first byte only.
            unsupported = mid_stream_unsupported(body, ctx.chat)
            track_ids = unsupported is None
            wants_ids = bool(body.get("return_token_ids"))
            if track_ids and not wants_ids:
                ctx.decode_extra = {"return_token_ids": True}
            ctx.track = StreamTracker(ctx.chat, blank_ids=track_ids and not wants_ids,
                                      track_ids=track_ids)
            ctx.unsupported = unsupported
        return mig

    async def _serve_migrating(
        self,
        sink: StreamSink,
        ctx: RequestContext,
        body: dict[str, Any],
        headers: dict[str, str],
        plan: Plan,
    ) -> web.StreamResponse:
        """The flow, again elsewhere after an engine failure the client has not
        seen (:mod:`vllm_pd_proxy.migration`); a stream that fails after it
        started goes on as a continuation (:meth:`_continue`)."""
        mig = ctx.migration
        assert mig is not None
        loop = asyncio.get_running_loop()
        avoid_p: list[Backend] = []
        avoid_d: list[Backend] = []
        while True:
            attempt_started = loop.time()
            try:
                return await self._run_flow(sink, ctx, body, headers, plan, avoid_p, avoid_d)
            except MidStreamFailure as failure:
                return await self._continue(sink, ctx, body, headers, failure, avoid_d)
            except errors.ProxyError as exc:
                cause = _before_first_byte_cause(exc)
                if cause is None or ctx.stream_started:
                    raise
                if not mig.allow(cause, loop.time(), attempt_started):
                    raise
                if cause is Cause.NO_PREFILL:
                    plan.local = True
                elif exc.backend is not None and not exc.stale_identity:
                    # (A P that only restarted, whose new identity is known
                    # now, stays a candidate: it is not the sick engine.)
                    avoid = avoid_p if exc.backend.role == "prefill" else avoid_d
                    if exc.backend not in avoid:
                        avoid.append(exc.backend)
                if len(avoid_d) >= len(self._up.decode.backends):
                    avoid_d.clear()  # every D failed once: any may serve again
                logger.warning("request %s: %s; migrating (%s, %d of %d)", ctx.request_id,
                               log_safe(exc.message), cause, len(mig.causes), mig.limit)
                # Again from scratch: a fresh P leg (a new lease) unless no P is
                # left, another D; a kept turn is not read back a second time.
                plan.decode = plan.prefix = plan.turn = None

    async def _continue(
        self,
        sink: StreamSink,
        ctx: RequestContext,
        body: dict[str, Any],
        headers: dict[str, str],
        failure: MidStreamFailure,
        avoid_d: list[Backend],
    ) -> web.StreamResponse:
        """A stream that failed after it started: continued on another D from the
        token ids the client has, or ended with the error event."""
        mig, track = ctx.migration, ctx.track
        assert mig is not None and track is not None
        loop = asyncio.get_running_loop()
        error, since = failure.error, failure.since
        ctx.capture_kv = False  # the turn D would keep is gone with that D
        while True:
            if ctx.decode is not None and ctx.decode not in avoid_d:
                avoid_d.append(ctx.decode)
            if len(avoid_d) >= len(self._up.decode.backends):
                avoid_d.clear()
            if not engine_failure(error) or not track.can_continue:
                if ctx.unsupported is not None and engine_failure(error):
                    mig.refuse_unsupported(Cause.MID_STREAM)
                    logger.warning("request %s: not continued on another decode engine: %s "
                                   "is not supported mid-stream", ctx.request_id,
                                   ctx.unsupported)
                return await self._end_stream(sink, ctx, error)
            if not mig.allow(Cause.MID_STREAM, loop.time(), since):
                return await self._end_stream(sink, ctx, error)
            assert track.prompt_ids is not None
            cont = continuation_body(body, track.prompt_ids, track.sent_ids, ctx.chat)
            track.begin_continuation()
            logger.warning("request %s: %s after %d tokens; continuing on another decode "
                           "engine (%d of %d)", ctx.request_id, log_safe(error.message),
                           len(track.sent_ids), len(mig.causes), mig.limit)
            if cont is None:  # every token was sent, only the finish was lost
                await sink.write(ctx, track.finish_length(_include_usage(body)))
                mig.resumed(loop.time())
                await sink.end(None)
                ctx.outcome, ctx.error = errors.Outcome.OK, None
                assert sink.response is not None
                return sink.response
            ctx.outcome, ctx.error = errors.Outcome.OK, None
            try:
                return await self._up.decode_leg(
                    sink, ctx, None, _encode(cont), headers, None, exclude=avoid_d,
                    endpoint=CONTINUATION_ENDPOINT, continuing=True)
            except MidStreamFailure as again:
                error, since = again.error, again.since
            except errors.ProxyError as exc:  # the continuation failed before its first byte
                error, since = exc, loop.time()

    async def _end_stream(self, sink: StreamSink, ctx: RequestContext,
                          error: errors.ProxyError) -> web.StreamResponse:
        """End a started stream with ``error`` as an error event, as before migration."""
        ctx.outcome, ctx.error = errors.Outcome.STREAM_ERROR, error.message
        try:
            await sink.end(error)
        except ConnectionResetError:
            ctx.status, ctx.outcome = 499, errors.Outcome.CANCELLED
        assert sink.response is not None
        return sink.response

    def _record_migrations(self, mig: Migration, ending: Ending) -> None:
        """The prompt's migrations into the metrics: each by cause and how the
        request ended; a failure that could not migrate, once."""
        metrics = self._metrics
        for cause in mig.causes:
            metrics.migrations.labels(cause, ending).inc()
        if mig.causes and ending is Ending.OK:
            metrics.migration_added.observe(mig.added)
        if mig.refused is not None and ending is not Ending.OK:
            metrics.migrations.labels(mig.refused_cause, mig.refused).inc()


def _before_first_byte_cause(exc: errors.ProxyError) -> Cause | None:
    """Why a failure the client has not seen may migrate (None: it may not)."""
    if no_prefill_left(exc):
        return Cause.NO_PREFILL
    if not engine_failure(exc):
        return None
    return Cause.PREFILL if exc.role == "prefill" else Cause.DECODE


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))
