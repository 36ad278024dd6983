"""Request orchestration: parse, decide local vs P/D, run the flow, answer.

Lifecycle: the app's cleanup context builds one :class:`Forwarder` around the
shared ClientSession; ``POST /v1/completions``, ``/v1/chat/completions`` and
``/v1/responses`` call :meth:`Forwarder.handle` once per client request
(a Responses API request: :func:`~vllm_pd_proxy.body.check_responses`
first, no batch, no multi-turn). Flow:

1. read the body under the memory caps (413/503, :mod:`vllm_pd_proxy.body`),
   parse it (400 on bad JSON or an ``n`` that D would refuse), estimate
   prompt tokens; a batch of prompts (``"prompt": [p0, p1, ...]``,
   :mod:`vllm_pd_proxy.batch`) goes to :mod:`vllm_pd_proxy.batch_flow`,
   which serves each prompt through steps 3 to 5 and merges the answers;
2. multi-turn (``--multi-turn``): the conversation's last turn and its D
   (:mod:`vllm_pd_proxy.affinity`);
3. decide (:mod:`vllm_pd_proxy.decision`): ``local`` (conditional
   disaggregation: D prefills itself, one D leg) or remote, then ``pull``
   or ``push`` (``--transfer-mode``);
4. run the flow: local here, :mod:`vllm_pd_proxy.pull` or
   :mod:`vllm_pd_proxy.push`, over the legs of :mod:`vllm_pd_proxy.upstream`
   (a P leg takes a prefill slot from the
   :class:`~vllm_pd_proxy.admission.PrefillGate` first);
5. D's answer is relayed (:mod:`vllm_pd_proxy.relay`); multi-turn files it
   for the next turn; then metrics, spans and the access log.

Client disconnects cancel the handler (aiohttp ``handler_cancellation``); the
``finally`` blocks close the upstream responses and cancel the P task, which
closes their connections so the engines abort the request and free its KV.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from . import errors
from .admission import PrefillGate
from .affinity import Affinity
from .backends import Backend, Pool
from .batch import split_prompts
from .batch_flow import Member, run_batch
from .body import BodyBudget, check_responses, num_choices, parse_body, read_body
from .config import ProxyConfig, TransferMode
from .context import RequestContext, log_safe, member_request_id, sanitize_request_id
from .conversations import Turn, conversation_key
from .decision import ALWAYS_REMOTE, PROMPT_PASS, Decision, decide, needs_prompt_pass
from .errors import Outcome
from .health import HealthMonitor
from .legs import decode_body
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
from .prompt import inspect_prompt, responses_as_chat
from .pull import run_pull
from .push import run_push
from .relay import ClientSink, MidStreamFailure, StreamSink
from .stream_track import StreamTracker
from .telemetry import LegMarks, SpanExporter
from .upstream import Upstream

logger = logging.getLogger("vllm_pd_proxy.forward")

_encode = msgspec.json.encode


class Forwarder:
    """Serves completion requests across the prefill and decode pools."""

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
        self._config = config
        self._prefill = prefill
        self._telemetry = config.transfer_telemetry or config.otel
        self._spans = SpanExporter() if config.otel else None
        self._metrics = metrics
        self._push = config.transfer_mode == TransferMode.PUSH
        self._bodies = BodyBudget(config.max_total_body_bytes)
        self._up = Upstream(config, prefill, decode, session, monitor, metrics, gate)
        self._affinity = Affinity(config, decode, metrics)
        # The chunk keys only matter to conditional disaggregation.
        self._chunks = config.prefix_chunk_tokens if config.local_prefill_threshold else None

    async def handle(self, request: web.Request, chat: bool, responses: bool = False
                     ) -> web.StreamResponse:
        """One client request: ``chat`` for ``/v1/chat/completions`` and
        ``/v1/responses`` (``responses`` too), else ``/v1/completions``."""
        loop = asyncio.get_running_loop()
        # The one place the client's id enters: everything after (logs, legs,
        # push ids, the response header) sees the sanitized form.
        rid = sanitize_request_id(request.headers.get("X-Request-Id")) or uuid.uuid4().hex
        ctx = RequestContext(rid, request.path, loop.time(), chat=chat, responses=responses)
        if self._telemetry:
            ctx.marks = LegMarks(ctx.started, in_answer=self._config.transfer_telemetry)
        held = self._bodies.reservation()
        try:
            raw = await read_body(request, held, self._config.max_request_bytes)
            body = parse_body(raw)
            del raw  # the parsed body replaces it; do not keep both alive
            n = num_choices(body)
            ctx.stream = bool(body.get("stream"))
            # The proxy owns kv_transfer_params: a client's own would corrupt the
            # handshake (or make a local-prefill request wait for a remote KV).
            body.pop("kv_transfer_params", None)
            headers = {"Content-Type": "application/json", "X-Request-Id": rid}
            auth = request.headers.get("Authorization")
            if auth:
                headers["Authorization"] = auth
            prompts = None if chat else split_prompts(body, self._config.max_batch_prompts)
            if prompts is not None:
                out = await run_batch(self.serve, request, ctx,
                                      self._members(ctx, body, prompts, headers), n)
            elif responses:
                check_responses(body)
                ctx.tokens, ctx.chunk_keys = inspect_prompt(
                    responses_as_chat(body), True, self._chunks)
                # No multi-turn capture: a response is no turn the proxy can key.
                out = await self.serve(ClientSink(request), ctx, body, headers)
            else:
                ctx.tokens, ctx.chunk_keys = inspect_prompt(body, chat, self._chunks)
                out = await self._route(request, ctx, body, headers, n)
            if ctx.outcome != Outcome.CANCELLED:
                ctx.status = out.status
            return out
        except errors.ProxyError as exc:
            ctx.status, ctx.outcome, ctx.error = exc.status, exc.outcome, exc.message
            return exc.response(rid)
        except asyncio.CancelledError:
            ctx.status, ctx.outcome = 499, Outcome.CANCELLED
            raise
        except web.HTTPException as exc:  # e.g. 413 from request.read()
            ctx.status, ctx.outcome, ctx.error = exc.status, Outcome.BAD_REQUEST, exc.reason
            raise
        except Exception as exc:
            logger.exception("request %s failed unexpectedly", rid)
            err = errors.ProxyError(
                500,
                f"proxy internal error: {exc!r}",
                err_type="internal_error",
                outcome=Outcome.INTERNAL_ERROR,
            )
            ctx.status, ctx.outcome, ctx.error = 500, err.outcome, err.message
            return err.response(rid)
        finally:
            held.release()
            ctx.finish(loop.time(), self._metrics)
            if self._spans is not None and ctx.marks is not None:
                # A batch: one trace per prompt (each is a handoff of its own).
                for one in ctx.members or (ctx,):
                    self._export_spans(one, ctx, loop.time())

    def _export_spans(self, one: RequestContext, ctx: RequestContext, now: float) -> None:
        """Export the spans of ``one`` (``ctx`` or a member of it)."""
        assert self._spans is not None
        if one.marks is None:
            return
        one.marks.mode = one.mode
        try:
            self._spans.export(one.request_id, one.marks, now, {
                "status": ctx.status, "outcome": ctx.outcome, "retries": one.retries,
                "prefill": one.prefill.url if one.prefill else None,
                "decode": one.decode.url if one.decode else None})
        except Exception:  # telemetry must never fail a request
            logger.exception("request %s: exporting its spans failed", one.request_id)

    def _members(self, ctx: RequestContext, body: dict[str, Any], prompts: list[Any],
                 headers: dict[str, str]) -> list[Member]:
        """One request per prompt of a batch: its own id, body and estimates.

        Multi-turn does not apply (a batch is no turn of one conversation),
        so its ``conversation_id`` is taken out as a turn's would be.
        """
        if self._config.multi_turn:
            body.pop("conversation_id", None)
        members = []
        for i, prompt in enumerate(prompts):
            one = {**body, "prompt": prompt}
            m_ctx = RequestContext(member_request_id(ctx.request_id, i), ctx.endpoint,
                                   ctx.started, stream=ctx.stream)
            if ctx.marks is not None:
                m_ctx.marks = LegMarks(ctx.started, in_answer=ctx.marks.in_answer)
            m_ctx.tokens, m_ctx.chunk_keys = inspect_prompt(one, False, self._chunks)
            members.append(Member(m_ctx, one, {**headers, "X-Request-Id": m_ctx.request_id}))
        return members

    async def _route(
        self,
        request: web.Request,
        ctx: RequestContext,
        body: dict[str, Any],
        headers: dict[str, str],
        n: int,
    ) -> web.StreamResponse:
        key = turn = None
        if self._config.multi_turn:
            key = conversation_key(request.headers, body, ctx.chat, self._config.session_header)
            # Only one answer can be the conversation's next turn: with n > 1
            # D keeps nothing (the history is still read back, if kept).
            ctx.capture_kv = key is not None and n == 1
            turn = self._affinity.take_turn(key) if key is not None else None
        try:
            return await self.serve(ClientSink(request), ctx, body, headers, turn)
        finally:
            # Also when the client went away after the stream's last chunk
            # (the handler is cancelled then).
            if key is not None:
                self._affinity.file_turn(ctx, key)

    async def serve(
        self,
        sink: StreamSink,
        ctx: RequestContext,
        body: dict[str, Any],
        headers: dict[str, str],
        turn: Turn | None = None,
    ) -> web.StreamResponse:
        """One prompt: decide where it is prefilled, run that flow; a streamed
        answer goes into ``sink`` (the client, or a batch's merged stream)."""
        affine = self._affinity.affine_decode(turn) if turn is not None else None
        if turn is None and needs_prompt_pass(body):
            # (A kept turn still goes through P: only P's read-back frees it.)
            decision, decode, prefix = PROMPT_PASS, None, None
        else:
            decision, decode, prefix = self._decide(ctx, affine, turn is not None)
        self._metrics.decisions.labels(decision.label, decision.reason).inc()
        if self._config.max_migrations <= 0:
            return await self._run_flow(
                sink, ctx, body, headers, decision.is_local, decode, prefix, turn)
        mig = self._migration(ctx, body)
        ending = Ending.FAILED
        try:
            out = await self._serve_migrating(
                sink, ctx, body, headers, decision.is_local, decode, prefix, turn)
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
        local: bool,
        decode: Backend | None,
        prefix: tuple[int, ...] | None,
        turn: Turn | None,
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
                return await self._run_flow(sink, ctx, body, headers, local, decode, prefix,
                                            turn, avoid_p, avoid_d)
            except MidStreamFailure as failure:
                return await self._continue(sink, ctx, body, headers, failure, avoid_d)
            except errors.ProxyError as exc:
                cause = _before_first_byte_cause(exc)
                if cause is None or ctx.stream_started:
                    raise
                if not mig.allow(cause, loop.time(), attempt_started):
                    raise
                if cause is Cause.NO_PREFILL:
                    local = True
                elif exc.backend is not None:
                    avoid = avoid_p if exc.backend.role == "prefill" else avoid_d
                    if exc.backend not in avoid:
                        avoid.append(exc.backend)
                if len(avoid_d) >= len(self._up.decode.backends):
                    avoid_d.clear()  # every D failed once: any may serve again
                logger.warning("request %s: %s; migrating (%s, %d of %d)", ctx.request_id,
                               log_safe(exc.message), cause, len(mig.causes), mig.limit)
                # Again from scratch: a fresh P leg (a new lease) unless no P is
                # left, another D; a kept turn is not read back a second time.
                decode, prefix, turn = None, None, None

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

    def _decide(
        self, ctx: RequestContext, affine: Backend | None, has_turn: bool
    ) -> tuple[Decision, Backend | None, tuple[int, ...] | None]:
        """The decision, the preselected D and the chunk keys to remember on it.

        Decides on the *uncached* prompt tokens: the estimate minus what the
        chosen D probably holds in its prefix cache (the chunks of prompts the
        proxy sent it, :class:`~vllm_pd_proxy.prompt.PrefixChunks`), as
        llm-d's decider and Dynamo's ``eff_isl`` do. D is therefore chosen
        first: the conversation's D (``affine``) when it has one, else by load.
        """
        config = self._config
        threshold = config.local_prefill_threshold
        if not threshold:  # what decide() answers then, without the call
            return ALWAYS_REMOTE, affine, None
        decode = affine or self._up.pick_decode(ctx)
        keys = ctx.chunk_keys
        cached = 0
        if decode.prefixes is not None and keys:
            cached = decode.prefixes.cached_chunks(keys) * config.prefix_chunk_tokens
        loads = ([b.in_flight for b in self._prefill.usable()] if config.max_prefill_queue
                 else ())
        decision = decide(ctx.tokens, cached, threshold=threshold, has_turn=has_turn,
                          max_prefill_queue=config.max_prefill_queue, prefill_loads=loads)
        ctx.uncached_tokens = decision.uncached_tokens
        return decision, decode, keys

    async def _run_flow(
        self,
        sink: StreamSink,
        ctx: RequestContext,
        body: dict[str, Any],
        headers: dict[str, str],
        local: bool,
        decode: Backend | None,
        prefix: tuple[int, ...] | None,
        turn: Turn | None,
        avoid_p: list[Backend] | None = None,
        avoid_d: list[Backend] | None = None,
    ) -> web.StreamResponse:
        if local:
            # The local flow is one D leg: D prefills the prompt itself.
            ctx.mode = "local"
            up = self._up
            keep = up.sign({"pd_bidirectional": True}, ctx, body) if ctx.capture_kv else None
            return await up.decode_leg(
                sink, ctx, decode, _encode(decode_body(body, keep, ctx.decode_extra)), headers,
                prefix, exclude=avoid_d)
        if self._push:
            ctx.mode = "push"
            return await run_push(self._up, self._affinity, sink, ctx, body, headers, decode,
                                  prefix, turn, avoid_p, avoid_d)
        ctx.mode = "pull"
        return await run_pull(self._up, self._affinity, sink, ctx, body, headers, decode,
                              prefix, turn, avoid_p, avoid_d)


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
