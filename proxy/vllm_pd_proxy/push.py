"""The push flow (``--transfer-mode push``): P and D legs at once, P writes the KV.

Called by the :class:`~vllm_pd_proxy.forward.Forwarder` once per request it
sends to P in push mode; stateless between requests. Per request:

1. 503 at once if no decode engine is routable (not worth a place in the
   prefill queue);
2. a prefill slot from the gate on a P whose identity is known (probed if
   need be; another P if the probe fails, ``--prefill-retries``); nothing
   has gone to D yet, so D holds blocks only for admitted requests;
3. both legs go out under a fresh ``pd_request_id``: P's (with a
   conversation's kept turn to read back) and D's (P's identity, so D
   registers its blocks with that P); D's leg is guarded by P's, so D is
   cancelled if P fails (or answers from another engine than D was told,
   :meth:`~vllm_pd_proxy.health.HealthMonitor.check_answer_identity`)
   before D's first byte;
4. a failure before D's first byte: the pair again without the read-back
   if the read-back failed on P, or on other engines if one refused its leg
   unrun (draining, never reached); otherwise the error is the answer;
5. whatever happens, P's leg is cancelled if still running (its connection
   closes, so P aborts the request) and awaited.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from . import errors, first_token, first_token_flow
from .admission import PrefillSlot
from .affinity import Affinity
from .backends import Backend, PrefillIdentity
from .context import RequestContext, log_safe
from .conversations import Turn
from .errors import Outcome
from .health import ProbeError
from .legs import decode_body, prefill_body, push_decode_params, push_prefill_params
from .relay import MidStreamFailure, StreamSink
from .upstream import Upstream

# The logger of the request path (docs/proxy.md names it; log lines unchanged).
logger = logging.getLogger("vllm_pd_proxy.forward")

_encode = msgspec.json.encode

# D-leg outcomes that a stale push identity can cause (P refused D's registration).
_D_FAILURES = frozenset({Outcome.UPSTREAM_5XX, Outcome.UPSTREAM_UNREACHABLE, Outcome.TIMEOUT})


class _Unseeded(Exception):
    """P's answer could not seed D's concurrent leg, which was cancelled:
    :func:`run_push` sends the pair again, unseeded (see :func:`_run_concurrent`)."""


@dataclass(slots=True)
class _Dispatch:
    """One dispatch of a request's pair of legs: what every flow below needs.

    Made per try of :func:`run_push` (a redispatch makes another, on another
    prefill slot); ``decode`` None: D is picked when its leg goes out.
    """

    up: Upstream
    sink: StreamSink
    ctx: RequestContext
    body: dict[str, Any]
    headers: dict[str, str]
    decode: Backend | None
    prefix: tuple[int, ...] | None
    slot: PrefillSlot
    identity: PrefillIdentity
    #: D engines this request left (appended to by a redispatch).
    tried_d: list[Backend]

    def pd_id(self) -> str:
        """The key both engines file the push under: unique per dispatch
        even when clients reuse an X-Request-Id (a duplicate is refused)."""
        return f"{self.ctx.request_id}-{uuid.uuid4().hex[:8]}"

    def prefill_leg(self, body: bytes) -> asyncio.Future[dict[str, Any]]:
        """P's leg, started (see :func:`_prefill_leg`)."""
        return asyncio.ensure_future(_prefill_leg(self.up, self.ctx, self.slot, self.identity,
                                                  body, self.headers))


async def run_push(
    up: Upstream,
    affinity: Affinity,
    sink: StreamSink,
    ctx: RequestContext,
    body: dict[str, Any],
    headers: dict[str, str],
    decode: Backend | None,
    prefix: tuple[int, ...] | None,
    turn: Turn | None = None,
    avoid_p: list[Backend] | None = None,
    avoid_d: list[Backend] | None = None,
) -> web.StreamResponse:
    """Serve one request in push mode (see the module docstring).

    ``avoid_p``/``avoid_d``: engines an earlier attempt of this request
    failed on (a migration); neither is chosen again.
    """
    if decode is None and not up.decode.any_routable():
        # Not worth a place in the prefill queue: no D could take the KV.
        raise errors.no_backend(up.decode.describe_unavailable(), "decode")
    tried_p: list[Backend] = list(avoid_p or ())
    tried_d: list[Backend] = list(avoid_d or ())
    first_p, first_d = len(tried_p), len(tried_d)
    seeding = first_token_flow.decide(up, sink, ctx, body, turn is not None)
    while True:
        # Admitted (a P slot held) before either leg goes out: a queued
        # request has nothing on D yet, so D holds blocks only for admitted ones.
        slot, identity = await _pick_prefill(up, ctx, tried_p)
        go = _Dispatch(up, sink, ctx, body, headers, decode, prefix, slot, identity, tried_d)
        try:
            if seeding and _concurrent(up, ctx, body):
                return await _run_concurrent(go)
            if seeding:
                return await _run_seeded(go)
            return await _run_legs(go, affinity, turn)
        except _Unseeded:
            seeding = False  # D computes token #1 from the KV P pushes again
        except errors.ProxyError as exc:
            if affinity.readback_failed(ctx, exc, turn):
                turn = None  # both legs again, P prefills everything
                continue
            # One engine refused its leg unrun (draining, or never reached)
            # before D's first byte: both legs were cancelled, so send the
            # pair again, under a new pd_request_id, avoiding that engine.
            role = exc.backend.role if exc.backend is not None else ""
            tried = tried_p if role == "prefill" else tried_d
            if not up.redispatch(ctx, exc, role, tried,
                                 first_p if role == "prefill" else first_d):
                raise
            if exc.backend is decode:
                decode = None
        finally:
            slot.release()  # usually done already, when P's answer ended


async def _run_legs(go: _Dispatch, affinity: Affinity, turn: Turn | None = None
                    ) -> web.StreamResponse:
    """One dispatch of the pair: P's leg in the background, D's relayed."""
    up, ctx, body = go.up, go.ctx, go.body
    prefill = go.slot.backend
    decode = go.decode or up.pick_decode(ctx, go.tried_d)
    rid = ctx.request_id
    pd_id = go.pd_id()
    p_leg = affinity.with_readback(push_prefill_params(pd_id), turn)
    p_body = _encode(prefill_body(body, up.sign(p_leg, ctx, body), ctx.responses))
    d_leg = push_decode_params(go.identity, pd_id)
    # Always said, as in pull: D keeps the turn only for --multi-turn.
    d_leg["pd_bidirectional"] = ctx.capture_kv
    d_body = _encode(decode_body(body, up.sign(d_leg, ctx, body), ctx.decode_extra))
    # Both legs go out now: P pushes the KV while D is already waiting for it.
    p_task = go.prefill_leg(p_body)
    answered = False
    try:
        out = await up.decode_leg(go.sink, ctx, decode, d_body, go.headers, go.prefix, p_task)
        answered = True
        return out
    except errors.ProxyError as exc:
        d_failed = exc.backend is decode and exc.outcome in _D_FAILURES
        if d_failed and not p_task.done():
            # D failed while P was still prefilling. A P restarted at the
            # same URL refuses D's registration (stale engine id) at once,
            # so this is how a restart often shows first; P's answer, which
            # would name its new identity, is about to be cancelled: forget
            # the identity, so that the next dispatch to P probes it first.
            prefill.identity = None
            up.monitor.check_soon(prefill, reprobe=True)
        raise
    finally:
        if not p_task.done():
            p_task.cancel()  # closes P's connection: the engine aborts
        results: list[Any] = await asyncio.gather(p_task, return_exceptions=True)
        if (answered and isinstance(results[0], errors.ProxyError)
                and ctx.outcome == Outcome.OK):
            logger.warning(
                "request %s: prefill leg failed after decode answered: %s",
                rid,
                log_safe(results[0].message),
            )


async def _run_seeded(go: _Dispatch) -> web.StreamResponse:
    """Token #1 from P (:mod:`vllm_pd_proxy.first_token_flow`): P's leg
    first, D's after P's answer (it needs token #1). P holds the prefill
    until D registers, so the lost overlap is one registration round trip;
    D never waits on a prefill that may still fail."""
    up, ctx, body = go.up, go.ctx, go.body
    pd_id = go.pd_id()
    only_p = first_token_flow.prefill_only(body, ctx)
    p_leg = None if only_p else up.sign(push_prefill_params(pd_id, True), ctx, body)
    p_body = _encode(prefill_body(body, p_leg, ctx.responses, seeding=True))
    answer = await go.prefill_leg(p_body)
    d_leg = push_decode_params(go.identity, pd_id)
    d_leg["pd_bidirectional"] = False
    out = await first_token_flow.serve(up, go.sink, ctx, body, go.headers, answer,
                                       None if only_p else d_leg, go.decode, go.prefix,
                                       go.tried_d)
    if out is not None:
        return out
    if only_p:
        raise first_token_flow.no_token_ids(ctx)
    d_body = _encode(decode_body(body, up.sign(d_leg, ctx, body), ctx.decode_extra))
    return await up.decode_leg(go.sink, ctx, go.decode, d_body, go.headers, go.prefix,
                               exclude=go.tried_d)


def _concurrent(up: Upstream, ctx: RequestContext, body: dict[str, Any]) -> bool:
    """Whether a seeded request's D leg goes beside P's (``--concurrent-dispatch``):
    completions and chat (not the Responses API, whose events are no
    completion chunks), and not when P's token is the whole answer (no D
    leg at all).

    And only a prompt that ends on a whole character: D's API server
    detokenizes token #2 after the prompt, never having seen token #1. A
    text prompt or a chat's rendered template ends on a whole character,
    so token #2's text is the same after either (token #1's own text is
    whole, or the request falls back); a prompt of token ids may end inside
    a character, which token #1 completes, and then D's text for token #2
    would differ (seen in the e2e tier with random token prompts)."""
    if not up.config.concurrent_dispatch or ctx.responses:
        return False
    if not ctx.chat and not isinstance(body.get("prompt"), str):
        return False
    return first_token.pending_body(body, ctx.stream, ctx.chat) is not None


async def _run_concurrent(go: _Dispatch) -> web.StreamResponse:
    """Token #1 from P with both legs at once (issue 29, item 2).

    D's leg leaves with P's, before token #1 exists (``pd_seed_pending``):
    D's API server, its queue and its registration overlap P's prefill,
    and P's WRITE notification carries token #1, which D appends to its
    prompt before its first step. The client's answer is P's token #1 (as
    soon as P answers, whether or not D has answered), then D's tokens:
    nothing of D's is relayed before token #1 went out (``before_relay``).
    When P's answer cannot seed D
    (its token ended the answer, or cannot be continued exactly) D's leg is
    cancelled (D aborts it; P's WRITE, if posted, settles first) and the
    answer is P's, or the pair's again, unseeded (:class:`_Unseeded`). A D
    that fails after token #1 is a mid-stream failure (a continuation
    elsewhere, or the error event)."""
    up, sink, ctx, body, headers = go.up, go.sink, go.ctx, go.body, go.headers
    loop = asyncio.get_running_loop()
    pd_id = go.pd_id()
    p_leg = up.sign(push_prefill_params(pd_id, True), ctx, body)
    p_body = _encode(prefill_body(body, p_leg, ctx.responses, seeding=True))
    pending = first_token.pending_body(body, ctx.stream, ctx.chat)
    assert pending is not None  # _concurrent()
    d_leg = push_decode_params(go.identity, pd_id)
    d_leg["pd_bidirectional"] = False
    d_leg["pd_seed_pending"] = True
    d_body = _encode(decode_body(pending, up.sign(d_leg, ctx, pending), ctx.decode_extra))
    wants_ids = bool(body.get("return_token_ids"))
    ready: asyncio.Future[tuple[dict[str, Any], first_token.Seed]] = loop.create_future()

    async def token_one_first() -> None:
        # D's first byte may beat P's answer (its KV can be ready first):
        # nothing of D's goes out before token #1 has.
        await ready

    p_task = go.prefill_leg(p_body)
    d_task = asyncio.ensure_future(up.decode_leg(
        sink, ctx, go.decode, d_body, headers, go.prefix, p_task, exclude=go.tried_d,
        continuing=ctx.stream, before_relay=token_one_first))
    try:
        await asyncio.wait((p_task, d_task), return_when=asyncio.FIRST_COMPLETED)
        if p_task.done():
            answer = p_task.result()  # P's failure: D's leg is cancelled below
            seed = first_token.seed_of(answer, ctx.chat)
            if seed is not None and first_token.is_final(seed,
                                                         first_token.limit_of(body, ctx.chat)):
                await _cancel(d_task)
                first_token_flow.record(up, ctx, first_token_flow.PREFILL)
                return await first_token_flow.answer_from_p(sink, ctx, body, answer, seed,
                                                            wants_ids)
            why = ("no_token_ids" if seed is None
                   else first_token.seed_refusal(answer, seed, ctx.chat))
            if why is not None or seed is None:
                # Not to be continued exactly. D's leg is cancelled, and the
                # blocks P's WRITE filled go with it (D aborts before it
                # reports the load, so its prefix cache keeps none of them).
                # The pair goes again, unseeded: P's prefix cache still holds
                # the prompt (freed blocks keep their hashes), so P
                # recomputes only the last partial block and pushes the KV to
                # a new D leg, which computes token #1 itself. Not D's own
                # prefill of the whole prompt: that doubled TTFT (seen on
                # 1 request in 30 at 300 tokens, a token #1 inside a
                # character) and put a prefill in D's decode batch.
                await _cancel(d_task)
                first_token_flow.record(up, ctx, first_token_flow.FALLBACK, why or "")
                raise _Unseeded
            first_token_flow.record(up, ctx, first_token_flow.SEEDED, "concurrent")
            if ctx.stream:
                # Token #1 goes out now, whatever D is doing.
                track = await first_token_flow.start_stream(
                    sink, ctx, first_token.first_events(answer, seed, ctx.chat, False),
                    wants_ids)
                track.begin_continuation()
            ready.set_result((answer, seed))
        try:
            out = await d_task
        except errors.ProxyError as exc:
            if not ctx.stream_started:
                raise  # nothing reached the client: the handoff may go again
            # Token #1 is the client's already: this is a failure mid-stream.
            ctx.outcome, ctx.error = Outcome.STREAM_ERROR, exc.message
            raise MidStreamFailure(exc, ctx.progress) from None
        if ctx.stream:
            return out
        answer, seed = ready.result()
        return first_token_flow.merged_response(ctx, answer, seed, out, wants_ids)
    except MidStreamFailure as failure:
        return await first_token_flow.end_mid_stream(sink, ctx, failure)
    finally:
        await _cancel(d_task)
        await _cancel(p_task)


async def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` if it still runs (a leg: its connection closes, and the
    engine aborts the request) and wait for it to end."""
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _prefill_leg(
    up: Upstream,
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
        answer = await up.prefill_leg(ctx, prefill, body, headers)
    finally:
        slot.release()  # P's response has ended; D may still be streaming
    params = answer.get("kv_transfer_params")
    changed = up.monitor.check_answer_identity(prefill, identity, params)
    if changed is not None:
        exc = errors.protocol_error(
            "prefill",
            prefill,
            f"engine identity changed since it was probed: {changed}; the KV cannot "
            "reach the decode engine (the identity is refreshed: a migration or a new "
            "request uses it)",
        )
        exc.stale_identity = True
        raise exc
    return answer


async def _pick_prefill(
    up: Upstream, ctx: RequestContext, tried: list[Backend]
) -> tuple[PrefillSlot, PrefillIdentity]:
    first = len(tried)
    """A slot on a prefill engine whose identity is known; nothing is sent to D yet.

    ``tried``: engines this request already left (appended to here).
    """
    last: errors.ProxyError | None = None
    while True:
        slot = await up.admit(ctx, tried, last)
        prefill = slot.backend
        if last is not None:
            ctx.retries += 1
            up.metrics.retries.labels("prefill").inc()
        ctx.prefill = prefill
        try:
            return slot, await up.monitor.ensure_identity(prefill)
        except ProbeError as exc:
            slot.release()
            last = errors.protocol_error("prefill", prefill, f"identity probe failed: {exc}")
            if len(tried) - first >= up.config.prefill_retries:
                raise last from None
            tried.append(prefill)
        except BaseException:
            slot.release()
            raise
