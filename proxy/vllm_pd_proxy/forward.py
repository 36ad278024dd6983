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
from .context import RequestContext, member_request_id, sanitize_request_id
from .conversations import Turn, conversation_key
from .decision import ALWAYS_REMOTE, PROMPT_PASS, Decision, decide, needs_prompt_pass
from .errors import Outcome
from .failover import Failover, Plan
from .health import HealthMonitor
from .legs import decode_body
from .metrics import Metrics
from .prompt import inspect_prompt, responses_as_chat
from .pull import run_pull
from .push import run_push
from .relay import ClientSink, StreamSink
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
        self._failover = (Failover(config, self._up, metrics, self._run_flow)
                          if config.max_migrations > 0 else None)

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
            if ctx.client_done:
                # Gone after [DONE] (the proxy was still reading D's tail):
                # answered in full, as far as the client is concerned.
                ctx.status = ctx.status or 200
            else:
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
        plan = Plan(decision.is_local, decode, prefix, turn)
        if self._failover is None:
            return await self._run_flow(sink, ctx, body, headers, plan)
        return await self._failover.serve(sink, ctx, body, headers, plan)

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
        plan: Plan,
        avoid_p: list[Backend] | None = None,
        avoid_d: list[Backend] | None = None,
    ) -> web.StreamResponse:
        decode, prefix, turn = plan.decode, plan.prefix, plan.turn
        if plan.local:
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
