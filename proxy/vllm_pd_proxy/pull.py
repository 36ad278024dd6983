"""The pull flow (``--transfer-mode pull``): P prefills, then D reads the KV.

Called by the :class:`~vllm_pd_proxy.forward.Forwarder` once per request it
sends to P in pull mode; stateless between requests. Per request:

1. 503 at once if no decode engine is routable: D is picked after P (its
   load changes meanwhile), but a prefill whose KV no D can take would be
   wasted work;
2. with token #1 from P and ``--concurrent-dispatch`` (a request
   :func:`~vllm_pd_proxy.dispatch.concurrent` takes), the concurrent pull:
   a prefill slot on a P whose identity is known (probed if need be), then
   both legs at once under a fresh ``pd_request_id``
   (:func:`~vllm_pd_proxy.dispatch.run_concurrent`, push's flow with pull's
   legs): D's leg names P and the id, no blocks; D parks it, asks P over
   the side channel, and reads the KV and appends token #1 once P names
   its blocks. The pair goes again elsewhere if one engine refused its leg
   unrun; a P answer that cannot seed D (D's leg cancelled) is served
   again by the sequential pull below, unseeded: P's leg again, D's with
   P's new answer (never the first answer's params, whose lease the
   cancelled D may hold or have released). A P that does not say it runs
   vllm_pd_ext's pull (vLLM's in-tree connector) gets the sequential pull;
3. otherwise the sequential pull: the P leg (a one-token, non-streaming
   copy of the request, with a conversation's kept turn to read back if
   there is one) under a prefill slot of the gate; retried on another P,
   through the gate again, for 502/503/504 or a connection that failed
   before the request left (``--prefill-retries``); a P leg that failed
   with a read-back in it is sent once more without;
4. P's answer must carry ``kv_transfer_params``: they go to D verbatim (D
   decodes and checks them), plus ``pd_bidirectional``: whether D keeps
   the turn (only a ``--multi-turn`` turn with a key and ``n`` = 1);
5. the D leg, re-dispatched to another D if the first refused it unrun
   (draining) or was never reached: any D can take P's lease.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from aiohttp import web

from . import errors, first_token_flow
from .affinity import Affinity
from .backends import Backend
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
from .health import concurrent_pull
from .legs import decode_body, prefill_body, pull_prefill_params, pull_wait_decode_params
from .relay import StreamSink
from .upstream import Upstream

# The logger of the request path (docs/proxy.md names it; log lines unchanged).
logger = logging.getLogger("vllm_pd_proxy.forward")

_encode = msgspec.json.encode


def _seeding_prefill_params(pd_id: str) -> dict[str, Any]:
    """P's concurrent pull leg: token #1 asked for, the blocks filed under
    ``pd_id`` for the D leg that asks for them."""
    return pull_prefill_params(True, pd_id)


#: The concurrent pull legs (:func:`~vllm_pd_proxy.dispatch.run_concurrent`).
_PULL_LEGS = ConcurrentLegs(_seeding_prefill_params, pull_wait_decode_params)


async def run_pull(
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
    """Serve one request in pull mode (see the module docstring).

    ``avoid_p``/``avoid_d``: engines an earlier attempt of this request
    failed on (a migration); neither is chosen again.
    """
    if decode is None and not up.decode.any_routable():
        # D is picked after P (its load changes meanwhile), but a prefill
        # whose KV no decode engine can take would be wasted work.
        raise errors.no_backend(up.decode.describe_unavailable(), "decode")
    seeding = first_token_flow.decide(up, sink, ctx, body, turn is not None)
    if seeding and concurrent(up, ctx, body):
        tries = Tries.avoiding(avoid_p, avoid_d)
        try:
            out = await _run_concurrent(up, sink, ctx, body, headers, decode, prefix, tries)
        except Unseeded:
            # D's leg was cancelled: D computes token #1 itself, from a new
            # P answer's KV (P's prefix cache still holds the prompt).
            out, seeding = None, False
        if out is not None:
            return out
        avoid_p, avoid_d = tries.tried_p, tries.tried_d
        if decode in avoid_d:
            decode = None  # it refused a leg unrun: another D
    return await _run_sequential(up, affinity, sink, ctx, body, headers, decode, prefix, turn,
                                 avoid_p, avoid_d, seeding)


async def _run_concurrent(
    up: Upstream,
    sink: StreamSink,
    ctx: RequestContext,
    body: dict[str, Any],
    headers: dict[str, str],
    decode: Backend | None,
    prefix: tuple[int, ...] | None,
    tries: Tries,
) -> web.StreamResponse | None:
    """The concurrent pull; None: the P admitted does not take one.

    Raises :class:`~vllm_pd_proxy.dispatch.Unseeded` when P's answer could
    not seed D (its leg cancelled).
    """
    while True:
        # Admitted (a P slot held) before either leg goes out: a queued
        # request has parked nothing on D yet.
        slot, identity = await pick_prefill(up, ctx, tries.tried_p)
        try:
            if not concurrent_pull(identity):
                return None  # not vllm_pd_ext's P: the sequential pull it knows
            go = Dispatch(up, sink, ctx, body, headers, decode, prefix, slot, identity,
                          tries.tried_d)
            return await run_concurrent(go, _PULL_LEGS)
        except errors.ProxyError as exc:
            # One engine refused its leg unrun (draining, or never reached)
            # before D's first byte: both legs were cancelled, so send the
            # pair again, under a new pd_request_id, avoiding that engine.
            if not tries.again(up, ctx, exc):
                raise
            if exc.backend is decode:
                decode = None
        finally:
            slot.release()  # usually done already, when P's answer ended


async def _run_sequential(
    up: Upstream,
    affinity: Affinity,
    sink: StreamSink,
    ctx: RequestContext,
    body: dict[str, Any],
    headers: dict[str, str],
    decode: Backend | None,
    prefix: tuple[int, ...] | None,
    turn: Turn | None,
    avoid_p: list[Backend] | None,
    avoid_d: list[Backend] | None,
    seeding: bool,
) -> web.StreamResponse:
    """P leg, then D leg with P's params (``seeding``: token #1 from P,
    D's leg continuing after it)."""
    only_p = seeding and first_token_flow.prefill_only(body, ctx)

    def p_leg(turn: Turn | None) -> bytes:
        leg = (None if only_p else
               up.sign(affinity.with_readback(pull_prefill_params(seeding), turn), ctx, body))
        return _encode(prefill_body(body, leg, ctx.responses, seeding=seeding))

    try:
        answer = await _prefill_with_retry(up, ctx, p_leg(turn), headers, avoid_p)
    except errors.ProxyError as exc:
        if not affinity.readback_failed(ctx, exc, turn):
            raise
        answer = await _prefill_with_retry(up, ctx, p_leg(None), headers, avoid_p)
    # Not decoded here: D gets P's params verbatim and decodes them itself
    # (a malformed field is D's 400, naming it); the proxy only needs some.
    params = answer.get("kv_transfer_params")
    if seeding:
        given = dict(params, pd_bidirectional=False) if isinstance(params, dict) else None
        out = await first_token_flow.serve(up, sink, ctx, body, headers, answer, given,
                                           decode, prefix, list(avoid_d or ()))
        if out is not None:
            return out
        if only_p:
            raise first_token_flow.no_token_ids(ctx)
    if not isinstance(params, dict) or not params:
        assert ctx.prefill is not None
        raise errors.protocol_error(
            "prefill",
            ctx.prefill,
            "answer has no kv_transfer_params, so the decode leg cannot fetch the KV "
            "cache; is the engine running a KV connector with kv_role kv_producer or "
            "kv_both?",
        )
    # Always said: a D with bidirectional_kv_xfer would otherwise keep every
    # turn (vLLM's multi-turn demo proxy relies on that) for nobody to read.
    params = dict(params, pd_bidirectional=ctx.capture_kv)
    d_body = _encode(decode_body(body, up.sign(params, ctx, body), ctx.decode_extra))
    tried: list[Backend] = list(avoid_d or ())
    while True:
        try:
            return await up.decode_leg(sink, ctx, decode, d_body, headers, prefix,
                                       exclude=tried)
        except errors.ProxyError as exc:
            # Any D can take P's lease, and a D that refused the leg unrun
            # (draining) or was never reached holds nothing of it.
            if not up.redispatch(ctx, exc, "decode", tried, len(avoid_d or ())):
                raise
            decode = None


async def _prefill_with_retry(
    up: Upstream, ctx: RequestContext, body: bytes, headers: dict[str, str],
    avoid: list[Backend] | None = None,
) -> dict[str, Any]:
    """Pull-mode P leg; nothing has reached D or the client, so retry is safe."""
    tried: list[Backend] = list(avoid or ())
    first = len(tried)
    last: errors.ProxyError | None = None
    while True:
        slot = await up.admit(ctx, tried, last)
        prefill = slot.backend
        if last is not None:
            ctx.retries += 1
            up.metrics.retries.labels("prefill").inc()
            logger.info(
                "request %s: retrying prefill on %s after: %s",
                ctx.request_id,
                prefill.url,
                log_safe(last.message),
            )
        ctx.prefill = prefill
        try:
            return await up.prefill_leg(ctx, prefill, body, headers)
        except errors.ProxyError as exc:
            if not exc.retryable or len(tried) - first >= up.config.prefill_retries:
                raise
            tried.append(prefill)
            last = exc
        finally:
            slot.release()  # before a retry queues for another engine
