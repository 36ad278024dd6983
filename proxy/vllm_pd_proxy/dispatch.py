"""A dispatch of a request's pair of legs, and the concurrent flow both modes share.

Role: what :mod:`vllm_pd_proxy.push` and :mod:`vllm_pd_proxy.pull` both do
once D's leg goes out with P's identity before P has answered: admit the
request on a prefill engine whose identity is known (:func:`pick_prefill`),
run P's leg checking that the engine that answered is the one D was told
about, and, with token #1 from P and ``--concurrent-dispatch``, send both
legs at once (:func:`run_concurrent`). The modes differ only in the two
legs' ``kv_transfer_params`` (:class:`ConcurrentLegs`): push's D waits for
P's WRITE, which carries token #1; pull's D asks P over the side channel to
name its blocks and token #1 once the prefill is done, then reads the KV.

Stateless between requests; a flow makes one :class:`Dispatch` per try of
the pair (a redispatch makes another, on another prefill slot), and
:class:`Tries` carries what the tries of one request left behind.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from . import errors, first_token, first_token_flow
from .admission import PrefillSlot
from .backends import Backend, PrefillIdentity
from .context import RequestContext
from .errors import Outcome
from .health import ProbeError
from .legs import decode_body, prefill_body
from .relay import MidStreamFailure, StreamSink
from .upstream import Upstream

_encode = msgspec.json.encode


class Unseeded(Exception):
    """P's answer could not seed D's concurrent leg, which was cancelled: the
    flow serves the request again, unseeded (see :func:`run_concurrent`)."""


@dataclass(frozen=True, slots=True)
class ConcurrentLegs:
    """The ``kv_transfer_params`` of a concurrent dispatch's legs, per mode
    (:mod:`vllm_pd_proxy.legs`); both are given the dispatch's ``pd_id``."""

    #: P's params: token #1 asked for (``pd_first_token``), filed under pd_id.
    prefill: Callable[[str], dict[str, Any]]
    #: D's params: P's identity, pd_id, and token #1 still to come
    #: (``pd_seed_pending``); D keeps no turn (``pd_bidirectional`` False).
    decode: Callable[[PrefillIdentity, str], dict[str, Any]]


@dataclass(slots=True)
class Dispatch:
    """One dispatch of a request's pair of legs: what every flow needs.

    Made per try of the pair (a redispatch makes another, on another
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
        """The key both engines file the handoff under: unique per dispatch
        even when clients reuse an X-Request-Id (a duplicate is refused)."""
        return f"{self.ctx.request_id}-{uuid.uuid4().hex[:8]}"

    def prefill_leg(self, body: bytes) -> asyncio.Future[dict[str, Any]]:
        """P's leg, started (see :func:`_prefill_leg`)."""
        return asyncio.ensure_future(_prefill_leg(self.up, self.ctx, self.slot, self.identity,
                                                  body, self.headers))


@dataclass(slots=True)
class Tries:
    """The engines one request's dispatches left, and the rule for another.

    ``first_p``/``first_d``: how many of ``tried_p``/``tried_d`` an earlier
    attempt of the request (a migration) left, which count against no
    retry budget of this one.
    """

    tried_p: list[Backend]
    tried_d: list[Backend]
    first_p: int
    first_d: int

    @classmethod
    def avoiding(cls, avoid_p: list[Backend] | None, avoid_d: list[Backend] | None) -> Tries:
        tried_p, tried_d = list(avoid_p or ()), list(avoid_d or ())
        return cls(tried_p, tried_d, len(tried_p), len(tried_d))

    def again(self, up: Upstream, ctx: RequestContext, exc: errors.ProxyError) -> bool:
        """Whether the pair goes again after ``exc``, avoiding its engine.

        Only when one engine refused its leg unrun (draining, or never
        reached) before D's first byte: both legs were cancelled, so the
        pair goes again, under a new pd_request_id, elsewhere.
        """
        role = exc.backend.role if exc.backend is not None else ""
        if role == "prefill":
            return up.redispatch(ctx, exc, role, self.tried_p, self.first_p)
        return up.redispatch(ctx, exc, role, self.tried_d, self.first_d)


def concurrent(up: Upstream, ctx: RequestContext, body: dict[str, Any]) -> bool:
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


async def run_concurrent(go: Dispatch, legs: ConcurrentLegs) -> web.StreamResponse:
    """Token #1 from P with both legs at once (issue 29, item 2).

    D's leg leaves with P's, before token #1 exists (``pd_seed_pending``):
    D's API server, its queue and its registration overlap P's prefill,
    and token #1 reaches D from P (push: P's WRITE notification; pull: P's
    message naming its blocks), which D appends to its prompt before its
    first step. The client's answer is P's token #1 (as soon as P answers,
    whether or not D has answered), then D's tokens: nothing of D's is
    relayed before token #1 went out (``before_relay``).
    When P's answer cannot seed D
    (its token ended the answer, or cannot be continued exactly) D's leg is
    cancelled (D aborts it; P's WRITE, if posted, settles first) and the
    answer is P's, or the pair's again, unseeded (:class:`Unseeded`). A D
    that fails after token #1 is a mid-stream failure (a continuation
    elsewhere, or the error event)."""
    up, sink, ctx, body, headers = go.up, go.sink, go.ctx, go.body, go.headers
    loop = asyncio.get_running_loop()
    pd_id = go.pd_id()
    p_leg = up.sign(legs.prefill(pd_id), ctx, body)
    p_body = _encode(prefill_body(body, p_leg, ctx.responses, seeding=True))
    pending = first_token.pending_body(body, ctx.stream, ctx.chat)
    assert pending is not None  # concurrent()
    d_leg = legs.decode(go.identity, pd_id)
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
                await cancel(d_task)
                first_token_flow.record(up, ctx, first_token_flow.PREFILL)
                return await first_token_flow.answer_from_p(sink, ctx, body, answer, seed,
                                                            wants_ids)
            why = ("no_token_ids" if seed is None
                   else first_token.seed_refusal(answer, seed, ctx.chat))
            if why is not None or seed is None:
                # Not to be continued exactly. D's leg is cancelled, and the
                # blocks P's WRITE (push) or D's READ (pull) filled go with it
                # (D aborts before it reports the load, so its prefix cache
                # keeps none of them).
                # The request goes again, unseeded: P's prefix cache still
                # holds the prompt (freed blocks keep their hashes), so P
                # recomputes only the last partial block and hands the KV to
                # a new D leg, which computes token #1 itself. Not D's own
                # prefill of the whole prompt: that doubled TTFT (seen on
                # 1 request in 30 at 300 tokens, a token #1 inside a
                # character) and put a prefill in D's decode batch.
                await cancel(d_task)
                first_token_flow.record(up, ctx, first_token_flow.FALLBACK, why or "")
                raise Unseeded
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
        await cancel(d_task)
        await cancel(p_task)


async def cancel(task: asyncio.Future[Any]) -> None:
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
    """A P leg whose answer must come from the engine D was told about.

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


async def pick_prefill(
    up: Upstream, ctx: RequestContext, tried: list[Backend]
) -> tuple[PrefillSlot, PrefillIdentity]:
    """A slot on a prefill engine whose identity is known; nothing is sent to D yet.

    ``tried``: engines this request already left (appended to here).
    """
    first = len(tried)
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
