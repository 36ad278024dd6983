"""The push flow (``--transfer-mode push``): P and D legs at once, P writes the KV.

Called by the :class:`~vllm_pd_proxy.forward.Forwarder` once per request it
sends to P in push mode; stateless between requests. Per request:

1. 503 at once if no decode engine is routable (not worth a place in the
   prefill queue);
2. a prefill slot from the gate on a P whose identity is known (probed if
   need be; another P if the probe fails, ``--prefill-retries``); nothing
   has gone to D yet, so D holds blocks only for admitted requests
   (:func:`~vllm_pd_proxy.dispatch.pick_prefill`, shared with concurrent
   pull);
3. both legs go out under a fresh ``pd_request_id``: P's (with a
   conversation's kept turn to read back) and D's (P's identity, so D
   registers its blocks with that P); D's leg is guarded by P's, so D is
   cancelled if P fails (or answers from another engine than D was told,
   :meth:`~vllm_pd_proxy.health.HealthMonitor.check_answer_identity`)
   before D's first byte. With token #1 from P, D's leg goes beside P's
   only with ``--concurrent-dispatch``
   (:func:`~vllm_pd_proxy.dispatch.run_concurrent`, the same flow as
   concurrent pull's, with push's legs), else after P's answer;
4. a failure before D's first byte: the pair again without the read-back
   if the read-back failed on P, or on other engines if one refused its leg
   unrun (draining, never reached); otherwise the error is the answer;
5. whatever happens, P's leg is cancelled if still running (its connection
   closes, so P aborts the request) and awaited.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
from aiohttp import web

from . import errors, first_token_flow
from .affinity import Affinity
from .backends import Backend, PrefillIdentity
from .context import RequestContext, log_safe
from .conversations import Turn
from .dispatch import (
    ConcurrentLegs,
    Dispatch,
    Tries,
    Unseeded,
    concurrent,
    pick_prefill,
    run_concurrent,
)
from .errors import Outcome
from .legs import decode_body, prefill_body, push_decode_params, push_prefill_params
from .relay import StreamSink
from .upstream import Upstream

# The logger of the request path (docs/proxy.md names it; log lines unchanged).
logger = logging.getLogger("vllm_pd_proxy.forward")

_encode = msgspec.json.encode

# D-leg outcomes that a stale push identity can cause (P refused D's registration).
_D_FAILURES = frozenset({Outcome.UPSTREAM_5XX, Outcome.UPSTREAM_UNREACHABLE, Outcome.TIMEOUT})


def _seeding_prefill_params(pd_id: str) -> dict[str, Any]:
    """P's concurrent push leg: token #1 asked for, the KV pushed for ``pd_id``."""
    return push_prefill_params(pd_id, True)


def _wait_decode_params(identity: PrefillIdentity, pd_id: str) -> dict[str, Any]:
    """D's concurrent push leg: the registration, token #1 to come with the KV."""
    d_leg = push_decode_params(identity, pd_id)
    d_leg["pd_bidirectional"] = False
    d_leg["pd_seed_pending"] = True
    return d_leg


#: The concurrent push legs (:func:`~vllm_pd_proxy.dispatch.run_concurrent`).
_PUSH_LEGS = ConcurrentLegs(_seeding_prefill_params, _wait_decode_params)


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
    tries = Tries.avoiding(avoid_p, avoid_d)
    seeding = first_token_flow.decide(up, sink, ctx, body, turn is not None)
    while True:
        # Admitted (a P slot held) before either leg goes out: a queued
        # request has nothing on D yet, so D holds blocks only for admitted ones.
        slot, identity = await pick_prefill(up, ctx, tries.tried_p)
        go = Dispatch(up, sink, ctx, body, headers, decode, prefix, slot, identity,
                      tries.tried_d)
        try:
            if seeding and concurrent(up, ctx, body):
                return await run_concurrent(go, _PUSH_LEGS)
            if seeding:
                return await _run_seeded(go)
            return await _run_legs(go, affinity, turn)
        except Unseeded:
            seeding = False  # D computes token #1 from the KV P pushes again
        except errors.ProxyError as exc:
            if affinity.readback_failed(ctx, exc, turn):
                turn = None  # both legs again, P prefills everything
                continue
            # One engine refused its leg unrun (draining, or never reached)
            # before D's first byte: both legs were cancelled, so send the
            # pair again, under a new pd_request_id, avoiding that engine.
            if not tries.again(up, ctx, exc):
                raise
            if exc.backend is decode:
                decode = None
        finally:
            slot.release()  # usually done already, when P's answer ended


async def _run_legs(go: Dispatch, affinity: Affinity, turn: Turn | None = None
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


async def _run_seeded(go: Dispatch) -> web.StreamResponse:
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
