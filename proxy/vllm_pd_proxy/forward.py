"""Request orchestration: parse, decide local vs P/D, run the legs, answer.

Lifecycle: the app's cleanup context builds one :class:`Forwarder` around the
shared ClientSession; ``POST /v1/completions`` and ``/v1/chat/completions``
call :meth:`Forwarder.handle` once per client request. Flow:

1. read the body under the memory caps (413/503, :mod:`vllm_pd_proxy.body`),
   parse it (400 on bad JSON or ``n``/``best_of`` > 1), estimate prompt
   tokens, pick the mode: ``local`` (conditional disaggregation: D prefills
   itself), ``pull`` or ``push`` (``--transfer-mode``);
2. pull and push: take a prefill slot from the
   :class:`~vllm_pd_proxy.admission.PrefillGate` (queued while every P is at
   ``--max-inflight-per-prefill``, 503 if it cannot be had); the slot is
   released when that P leg's response has ended;
3. pull: P leg (retried on another P, through the gate again, for
   502/503/504 or a connection that failed before the request left), then
   the D leg with P's ``kv_transfer_params``; push: P and D legs at once, D
   cancelled if P fails (or answers from another engine than D was told)
   before D's first byte;
4. relay D's answer (:mod:`vllm_pd_proxy.relay`), then metrics + access log.

Multi-turn (``--multi-turn``, :mod:`vllm_pd_proxy.conversations`): a turn's
P leg carries the blocks D kept from the conversation's previous turn (P reads
back what matches its prompt), the D leg asks D to keep this turn
(``pd_bidirectional``) and goes to the same D while it can take it, and D's
answer is filed for the next turn. A P leg that fails with a read-back in it
is sent once more without (P then prefills everything).

Client disconnects cancel the handler (aiohttp ``handler_cancellation``); the
``finally`` blocks close the upstream responses and cancel the P task, which
closes their connections so the engines abort the request and free its KV.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from vllm_pd_ext.wire.auth import body_prompt_digest, sign_leg

from . import errors
from .admission import PrefillGate, PrefillSlot
from .backends import Backend, Pool, PrefillIdentity
from .body import BodyBudget, parse_body, read_body, reject_unsupported
from .config import ProxyConfig
from .context import RequestContext, log_safe, sanitize_request_id
from .conversations import ConversationStore, Turn, conversation_key, readback_params
from .health import HealthMonitor, ProbeError
from .legs import (
    decode_body,
    prefill_body,
    pull_prefill_params,
    push_decode_params,
    push_prefill_params,
)
from .metrics import Metrics
from .prompt import inspect_prompt
from .relay import (
    OpenedDecode,
    complete_response,
    open_decode,
    open_decode_guarded,
    relay_stream,
)
from .telemetry import LegMarks, SpanExporter

logger = logging.getLogger("vllm_pd_proxy.forward")

_encode = msgspec.json.encode

# D-leg outcomes that a stale push identity can cause (P refused D's registration).
_D_FAILURES = frozenset({"upstream_5xx", "upstream_unreachable", "timeout"})


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
        self._gate = gate
        self._telemetry = config.transfer_telemetry or config.otel
        self._spans = SpanExporter() if config.otel else None
        self._decode = decode
        self._session = session
        self._monitor = monitor
        self._metrics = metrics
        self._push = config.transfer_mode == "push"
        self._bodies = BodyBudget(config.max_total_body_bytes)
        self._turns = ConversationStore(
            config.multi_turn_store_size, config.multi_turn_ttl, time.monotonic,
            max_bytes=config.multi_turn_store_mib << 20)

    async def handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        # The one place the client's id enters: everything after (logs, legs,
        # push ids, the response header) sees the sanitized form.
        rid = sanitize_request_id(request.headers.get("X-Request-Id")) or uuid.uuid4().hex
        ctx = RequestContext(rid, request.path, loop.time(), chat=chat)
        if self._telemetry:
            ctx.marks = LegMarks(ctx.started, in_answer=self._config.transfer_telemetry)
        held = self._bodies.reservation()
        try:
            raw = await read_body(request, held, self._config.max_request_bytes)
            body = parse_body(raw)
            del raw  # the parsed body replaces it; do not keep both alive
            reject_unsupported(body)
            ctx.stream = bool(body.get("stream"))
            # The chunk keys only matter to conditional disaggregation.
            config = self._config
            chunks = config.prefix_chunk_tokens if config.local_prefill_threshold else None
            ctx.tokens, ctx.chunk_keys = inspect_prompt(body, chat, chunks)
            headers = {"Content-Type": "application/json", "X-Request-Id": rid}
            auth = request.headers.get("Authorization")
            if auth:
                headers["Authorization"] = auth
            out = await self._route(request, ctx, body, headers)
            if ctx.outcome != "cancelled":
                ctx.status = out.status
            return out
        except errors.ProxyError as exc:
            ctx.status, ctx.outcome, ctx.error = exc.status, exc.outcome, exc.message
            return exc.response(rid)
        except asyncio.CancelledError:
            ctx.status, ctx.outcome = 499, "cancelled"
            raise
        except web.HTTPException as exc:  # e.g. 413 from request.read()
            ctx.status, ctx.outcome, ctx.error = exc.status, "bad_request", exc.reason
            raise
        except Exception as exc:
            logger.exception("request %s failed unexpectedly", rid)
            err = errors.ProxyError(
                500,
                f"proxy internal error: {exc!r}",
                err_type="internal_error",
                outcome="internal_error",
            )
            ctx.status, ctx.outcome, ctx.error = 500, err.outcome, err.message
            return err.response(rid)
        finally:
            held.release()
            ctx.finish(loop.time(), self._metrics)
            if self._spans is not None and ctx.marks is not None:
                self._export_spans(ctx, loop.time())

    def _export_spans(self, ctx: RequestContext, now: float) -> None:
        assert self._spans is not None and ctx.marks is not None
        ctx.marks.mode = ctx.mode
        try:
            self._spans.export(ctx.request_id, ctx.marks, now, {
                "status": ctx.status, "outcome": ctx.outcome, "retries": ctx.retries,
                "prefill": ctx.prefill.url if ctx.prefill else None,
                "decode": ctx.decode.url if ctx.decode else None})
        except Exception:  # telemetry must never fail a request
            logger.exception("request %s: exporting its spans failed", ctx.request_id)

    def _sign(self, params: dict[str, Any], ctx: RequestContext, body: dict[str, Any]
              ) -> dict[str, Any]:
        """``params`` signed for this request and prompt (a shared secret is set),
        so an engine with the secret can tell our legs from anyone else's."""
        keyring = self._config.auth
        if keyring is None:
            return params
        if ctx.prompt_digest is None:  # once per request, for all its legs
            ctx.prompt_digest = body_prompt_digest(body)
        return sign_leg(keyring, params, ctx.request_id, body,
                        prompt_digest=ctx.prompt_digest)

    # -- decisions -----------------------------------------------------------

    async def _route(
        self,
        request: web.Request,
        ctx: RequestContext,
        body: dict[str, Any],
        headers: dict[str, str],
    ) -> web.StreamResponse:
        # The proxy owns kv_transfer_params: a client's own would corrupt the
        # handshake (or make a local-prefill request wait for a remote KV).
        body.pop("kv_transfer_params", None)
        key = turn = None
        if self._config.multi_turn:
            key = conversation_key(request.headers, body, ctx.chat, self._config.session_header)
            ctx.capture_kv = key is not None
            turn = self._take_turn(key) if key is not None else None
        affine = self._affine_decode(turn) if turn is not None else None
        local, reason, decode, prefix = self._decide(ctx, affine, turn is not None)
        self._metrics.decisions.labels("local" if local else "remote", reason).inc()
        try:
            return await self._run_flow(request, ctx, body, headers, local, decode, prefix, turn)
        finally:
            # Also when the client went away after the stream's last chunk
            # (the handler is cancelled then).
            if key is not None:
                self._file_turn(ctx, key)

    async def _run_flow(
        self,
        request: web.Request,
        ctx: RequestContext,
        body: dict[str, Any],
        headers: dict[str, str],
        local: bool,
        decode: Backend | None,
        prefix: tuple[int, ...] | None,
        turn: Turn | None,
    ) -> web.StreamResponse:
        if local:
            ctx.mode = "local"
            keep = self._sign({"pd_bidirectional": True}, ctx, body) if ctx.capture_kv else None
            return await self._decode_leg(
                request, ctx, decode, _encode(decode_body(body, keep)), headers, prefix)
        if self._push:
            ctx.mode = "push"
            return await self._push_flow(request, ctx, body, headers, decode, prefix, turn)
        ctx.mode = "pull"
        if decode is None and not self._decode.any_routable():
            # D is picked after P (its load changes meanwhile), but a prefill
            # whose KV no decode engine can take would be wasted work.
            raise errors.no_backend(self._decode.describe_unavailable())
        return await self._pull_flow(request, ctx, body, headers, decode, prefix, turn)

    # -- multi-turn ------------------------------------------------------------

    def _take_turn(self, key: str) -> Turn | None:
        """The conversation's last turn, if P can still read it back from its D."""
        turn, outcome = self._turns.take(key)
        if turn is not None and not self._decode_by_url(turn.decode_url):
            turn, outcome = None, "d_unavailable"
        self._metrics.multi_turn.labels(outcome).inc()
        return turn

    def _decode_by_url(self, url: str) -> Backend | None:
        for backend in self._decode.backends:
            if backend.url == url and backend.routable:
                return backend
        return None

    def _affine_decode(self, turn: Turn) -> Backend | None:
        """The D that kept the last turn, while it is not much busier than the
        least loaded routable D (its prefix cache holds the history)."""
        same = self._decode_by_url(turn.decode_url)
        usable = self._decode.usable()
        if same is not None and usable:
            least = min(b.in_flight for b in usable)
            if same.in_flight <= least + self._config.multi_turn_affinity_slack:
                self._metrics.affinity.labels("same").inc()
                return same
        self._metrics.affinity.labels("other").inc()
        return None

    def _file_turn(self, ctx: RequestContext, key: str) -> None:
        # D sends its params only with a request that ended well (in a stream's
        # finishing chunk), so having them is enough, even if the client then
        # closed the connection before the stream's very end.
        params, decode = ctx.kept_turn, ctx.decode
        if params is None or decode is None:
            self._turns.drop(key)  # the previous turn's blocks were read or are gone
            return
        self._turns.put(key, decode.url, params, time.time())

    def _with_readback(self, params: dict[str, Any], turn: Turn | None) -> dict[str, Any]:
        return params if turn is None else readback_params(turn.params, params)

    def _readback_failed(
        self, ctx: RequestContext, exc: errors.ProxyError, turn: Turn | None
    ) -> bool:
        """A P leg with a read-back failed on P (D gone, lease lost, with P's
        kv_load_failure_policy=fail): worth one more try without it."""
        failed = (turn is not None and exc.backend is not None and exc.backend.role == "prefill"
                  and exc.outcome == "upstream_5xx" and not exc.draining)
        if failed:
            self._metrics.multi_turn.labels("readback_failed").inc()
            logger.warning("request %s: prefill with read-back failed (%s); prefilling the "
                           "whole prompt", ctx.request_id, log_safe(exc.message))
        return failed

    def _decide(
        self, ctx: RequestContext, affine: Backend | None = None, has_turn: bool = False,
    ) -> tuple[bool, str, Backend | None, tuple[int, ...] | None]:
        """(local?, reason, preselected D, chunk keys to remember on that D).

        Decides on the *uncached* prompt tokens: the estimate minus what the
        chosen D probably holds in its prefix cache (the chunks of prompts the
        proxy sent it, :class:`PrefixChunks`), as llm-d's decider and Dynamo's
        ``eff_isl`` do. D is therefore chosen first: the conversation's D
        (``affine``) when it has one, else by load. A turn that D kept for
        this request is read back through P, never skipped: that read
        releases D's kept blocks.
        """
        config = self._config
        threshold = config.local_prefill_threshold
        if not threshold:
            return False, "always_remote", affine, None
        decode = affine or self._pick_decode(ctx)
        keys = ctx.chunk_keys
        cached = 0
        if decode.prefixes is not None and keys:
            cached = decode.prefixes.cached_chunks(keys) * config.prefix_chunk_tokens
        ctx.uncached_tokens = max(0, ctx.tokens - cached)
        if has_turn:
            return False, "multi_turn", decode, keys
        if ctx.uncached_tokens < threshold:
            return True, "prefix_hit" if ctx.tokens >= threshold else "short_prompt", decode, keys
        if config.max_prefill_queue and self._prefill_saturated(config.max_prefill_queue):
            return True, "prefill_busy", decode, keys
        return False, "long_prompt", decode, keys

    def _prefill_saturated(self, limit: int) -> bool:
        """Every usable P already has ``limit`` P legs in flight."""
        usable = self._prefill.usable()
        return bool(usable) and min(b.in_flight for b in usable) >= limit

    def _pick_decode(self, ctx: RequestContext, exclude: list[Backend] | None = None) -> Backend:
        decode = self._decode.pick(ctx.tokens, exclude or ())
        if decode is None:
            raise errors.no_backend(self._decode.describe_unavailable())
        return decode

    def _redispatch(
        self, ctx: RequestContext, exc: errors.ProxyError, role: str, tried: list[Backend]
    ) -> bool:
        """Whether a failed leg may go to another engine of ``role``; records it.

        Only when the engine certainly ran nothing of it: it said it is
        draining, or the connection failed before the request left. Bounded
        by ``--prefill-retries`` per role and request.
        """
        backend = exc.backend
        if backend is None or backend.role != role:
            return False
        unsent = exc.outcome == "upstream_unreachable" and exc.retryable
        if not (exc.draining or unsent) or len(tried) >= self._config.prefill_retries:
            return False
        if exc.draining:
            self._monitor.mark_draining(backend)
        tried.append(backend)
        ctx.retries += 1
        self._metrics.retries.labels(role).inc()
        logger.info(
            "request %s: %s leg to %s again elsewhere after: %s",
            ctx.request_id,
            role,
            backend.url,
            log_safe(exc.message),
        )
        return True

    # -- flows ---------------------------------------------------------------

    async def _pull_flow(
        self,
        request: web.Request,
        ctx: RequestContext,
        body: dict[str, Any],
        headers: dict[str, str],
        decode: Backend | None,
        prefix: tuple[int, ...] | None,
        turn: Turn | None = None,
    ) -> web.StreamResponse:
        leg = self._with_readback(pull_prefill_params(), turn)
        p_body = _encode(prefill_body(body, self._sign(leg, ctx, body)))
        try:
            answer = await self._prefill_with_retry(ctx, p_body, headers)
        except errors.ProxyError as exc:
            if not self._readback_failed(ctx, exc, turn):
                raise
            p_body = _encode(prefill_body(body, self._sign(pull_prefill_params(), ctx, body)))
            answer = await self._prefill_with_retry(ctx, p_body, headers)
        params = answer.get("kv_transfer_params")
        if not isinstance(params, dict) or not params:
            assert ctx.prefill is not None
            raise errors.protocol_error(
                "prefill",
                ctx.prefill,
                "answer has no kv_transfer_params, so the decode leg cannot fetch the KV "
                "cache; is the engine running a KV connector with kv_role kv_producer or "
                "kv_both?",
            )
        if ctx.capture_kv:
            params = dict(params, pd_bidirectional=True)
        d_body = _encode(decode_body(body, self._sign(params, ctx, body)))
        tried: list[Backend] = []
        while True:
            try:
                return await self._decode_leg(
                    request, ctx, decode, d_body, headers, prefix, exclude=tried
                )
            except errors.ProxyError as exc:
                # Any D can take P's lease, and a D that refused the leg unrun
                # (draining) or was never reached holds nothing of it.
                if not self._redispatch(ctx, exc, "decode", tried):
                    raise
                decode = None

    async def _prefill_with_retry(
        self, ctx: RequestContext, body: bytes, headers: dict[str, str]
    ) -> dict[str, Any]:
        """Pull-mode P leg; nothing has reached D or the client, so retry is safe."""
        tried: list[Backend] = []
        last: errors.ProxyError | None = None
        while True:
            slot = await self._admit(ctx, tried, last)
            prefill = slot.backend
            if last is not None:
                ctx.retries += 1
                self._metrics.retries.labels("prefill").inc()
                logger.info(
                    "request %s: retrying prefill on %s after: %s",
                    ctx.request_id,
                    prefill.url,
                    log_safe(last.message),
                )
            ctx.prefill = prefill
            try:
                return await self._prefill_leg(ctx, prefill, body, headers)
            except errors.ProxyError as exc:
                if not exc.retryable or len(tried) >= self._config.prefill_retries:
                    raise
                tried.append(prefill)
                last = exc
            finally:
                slot.release()  # before a retry queues for another engine

    async def _push_flow(
        self,
        request: web.Request,
        ctx: RequestContext,
        body: dict[str, Any],
        headers: dict[str, str],
        decode: Backend | None,
        prefix: tuple[int, ...] | None,
        turn: Turn | None = None,
    ) -> web.StreamResponse:
        if decode is None and not self._decode.any_routable():
            # Not worth a place in the prefill queue: no D could take the KV.
            raise errors.no_backend(self._decode.describe_unavailable())
        tried_p: list[Backend] = []
        tried_d: list[Backend] = []
        while True:
            # Admitted (a P slot held) before either leg goes out: a queued
            # request has nothing on D yet, so D holds blocks only for admitted ones.
            slot, identity = await self._pick_push_prefill(ctx, tried_p)
            try:
                return await self._push_legs(
                    request, ctx, body, headers, decode, prefix, slot, identity, tried_d, turn
                )
            except errors.ProxyError as exc:
                if self._readback_failed(ctx, exc, turn):
                    turn = None  # both legs again, P prefills everything
                    continue
                # One engine refused its leg unrun (draining, or never reached)
                # before D's first byte: both legs were cancelled, so send the
                # pair again, under a new pd_request_id, avoiding that engine.
                role = exc.backend.role if exc.backend is not None else ""
                if not self._redispatch(ctx, exc, role, tried_p if role == "prefill" else tried_d):
                    raise
                if exc.backend is decode:
                    decode = None
            finally:
                slot.release()  # usually done already, when P's answer ended

    async def _push_legs(
        self,
        request: web.Request,
        ctx: RequestContext,
        body: dict[str, Any],
        headers: dict[str, str],
        decode: Backend | None,
        prefix: tuple[int, ...] | None,
        slot: PrefillSlot,
        identity: PrefillIdentity,
        tried_d: list[Backend],
        turn: Turn | None = None,
    ) -> web.StreamResponse:
        prefill = slot.backend
        decode = decode or self._pick_decode(ctx, tried_d)
        rid = ctx.request_id
        # The key both engines file the push under: unique per dispatch even
        # when clients reuse an X-Request-Id (a duplicate key is refused).
        pd_id = f"{rid}-{uuid.uuid4().hex[:8]}"
        p_leg = self._with_readback(push_prefill_params(pd_id), turn)
        p_body = _encode(prefill_body(body, self._sign(p_leg, ctx, body)))
        d_leg = push_decode_params(identity, pd_id)
        if ctx.capture_kv:
            d_leg["pd_bidirectional"] = True
        d_body = _encode(decode_body(body, self._sign(d_leg, ctx, body)))
        # Both legs go out now: P pushes the KV while D is already waiting for it.
        p_task = asyncio.ensure_future(self._push_prefill_leg(ctx, slot, identity, p_body, headers))
        answered = False
        try:
            out = await self._decode_leg(request, ctx, decode, d_body, headers, prefix, p_task)
            answered = True
            return out
        except errors.ProxyError as exc:
            d_failed = exc.backend is decode and exc.outcome in _D_FAILURES
            if d_failed and not p_task.done():
                # D failed while P was still prefilling. A P restarted at the
                # same URL refuses D's registration (stale engine id) at once,
                # so this is how a restart often shows first; P's answer, which
                # would name its new identity, is about to be cancelled.
                self._monitor.check_soon(prefill, reprobe=True)
            raise
        finally:
            if not p_task.done():
                p_task.cancel()  # closes P's connection: the engine aborts
            results: list[Any] = await asyncio.gather(p_task, return_exceptions=True)
            if answered and isinstance(results[0], errors.ProxyError) and ctx.outcome == "ok":
                logger.warning(
                    "request %s: prefill leg failed after decode answered: %s",
                    rid,
                    log_safe(results[0].message),
                )

    async def _push_prefill_leg(
        self,
        ctx: RequestContext,
        slot: PrefillSlot,
        identity: PrefillIdentity,
        body: bytes,
        headers: dict[str, str],
    ) -> dict[str, Any]:
        """A push P leg whose answer must come from the engine D was told about.

        A mismatch means P restarted since it was probed: D was sent the old
        identity and cannot receive this KV, so it is a P-leg failure (D is
        cancelled if it has not answered yet). Not retried: D already had its
        leg, P already ran the prefill, and the refreshed identity serves the
        client's next attempt.
        """
        prefill = slot.backend
        try:
            answer = await self._prefill_leg(ctx, prefill, body, headers)
        finally:
            slot.release()  # P's response has ended; D may still be streaming
        params = answer.get("kv_transfer_params")
        changed = self._monitor.check_answer_identity(prefill, identity, params)
        if changed is not None:
            raise errors.protocol_error(
                "prefill",
                prefill,
                f"engine identity changed since it was probed: {changed}; the KV cannot "
                "reach the decode engine, request not retried (the identity is refreshed, "
                "a new request uses it)",
            )
        return answer

    async def _pick_push_prefill(
        self, ctx: RequestContext, tried: list[Backend]
    ) -> tuple[PrefillSlot, PrefillIdentity]:
        """A slot on a prefill engine whose identity is known; nothing is sent to D yet.

        ``tried``: engines this request already left (appended to here).
        """
        last: errors.ProxyError | None = None
        while True:
            slot = await self._admit(ctx, tried, last)
            prefill = slot.backend
            if last is not None:
                ctx.retries += 1
                self._metrics.retries.labels("prefill").inc()
            ctx.prefill = prefill
            try:
                return slot, await self._monitor.ensure_identity(prefill)
            except ProbeError as exc:
                slot.release()
                last = errors.protocol_error("prefill", prefill, f"identity probe failed: {exc}")
                if len(tried) >= self._config.prefill_retries:
                    raise last from None
                tried.append(prefill)
            except BaseException:
                slot.release()
                raise

    async def _admit(
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
            raise last or errors.no_backend(self._prefill.describe_unavailable())
        return slot

    # -- legs ----------------------------------------------------------------

    async def _prefill_leg(
        self, ctx: RequestContext, prefill: Backend, body: bytes, headers: dict[str, str]
    ) -> dict[str, Any]:
        """Run one P leg to completion; its parsed JSON answer or ProxyError."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        timeout = self._config.prefill_timeout
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
            self._monitor.check_soon(prefill, reprobe=True)
            raise errors.upstream_unreachable("prefill", prefill, exc) from exc
        except TimeoutError:
            self._monitor.check_soon(prefill, reprobe=True)
            raise errors.upstream_timeout("prefill", prefill, timeout, "its answer") from None
        finally:
            prefill.release(ctx.tokens)
            self._metrics.prefill_leg.observe(loop.time() - started)
        if status >= 400:
            if draining:
                self._monitor.mark_draining(prefill)
            elif status >= 500:
                self._monitor.check_soon(prefill, reprobe=True)
            raise errors.upstream_status("prefill", prefill, status, data, ctype, draining)
        try:
            answer = msgspec.json.decode(data)
        except msgspec.DecodeError:
            raise errors.protocol_error("prefill", prefill, "answer is not valid JSON") from None
        if not isinstance(answer, dict):
            raise errors.protocol_error("prefill", prefill, "answer is not a JSON object")
        return answer

    async def _decode_leg(
        self,
        request: web.Request,
        ctx: RequestContext,
        decode: Backend | None,
        body: bytes,
        headers: dict[str, str],
        prefix: tuple[int, ...] | None,
        guard: asyncio.Future[Any] | None = None,
        exclude: list[Backend] | None = None,
    ) -> web.StreamResponse:
        """Run the D leg and relay it; ``guard`` is a concurrent push P leg."""
        decode = decode or self._pick_decode(ctx, exclude)
        ctx.decode = decode
        config = self._config
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
                    self._session, ctx, decode, body, headers, config.decode_timeout, max_event
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
            if not opened.sse:
                ctx.ttft = loop.time() - ctx.started
                return complete_response(ctx, opened)
            out, error = await relay_stream(
                request, ctx, decode, opened, config.stream_idle_timeout, max_event
            )
            if error is not None:
                ctx.outcome, ctx.error = "stream_error", error.message
                self._monitor.check_soon(decode)
            return out
        except errors.ProxyError as exc:
            # (A push P-leg error also ends up here; D is not at fault then.)
            if exc.backend is decode and exc.draining:
                self._monitor.mark_draining(decode)
            elif exc.backend is decode and exc.outcome in ("upstream_unreachable", "timeout"):
                self._monitor.check_soon(decode)
            raise
        finally:
            decode.release(ctx.tokens)
            self._metrics.decode_leg.observe(loop.time() - started)
            if opened is not None:
                # After a clean EOF the connection is already back in the pool
                # and this is a no-op; otherwise it drops the connection, which
                # makes the engine abort the request.
                opened.resp.close()
