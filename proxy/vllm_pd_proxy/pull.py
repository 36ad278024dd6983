"""The pull flow (``--transfer-mode pull``): P prefills, then D reads the KV.

Called by the :class:`~vllm_pd_proxy.forward.Forwarder` once per request it
sends to P in pull mode; stateless between requests. Per request:

1. 503 at once if no decode engine is routable: D is picked after P (its
   load changes meanwhile), but a prefill whose KV no D can take would be
   wasted work;
2. the P leg (a one-token, non-streaming copy of the request, with a
   conversation's kept turn to read back if there is one) under a prefill
   slot of the gate; retried on another P, through the gate again, for
   502/503/504 or a connection that failed before the request left
   (``--prefill-retries``); a P leg that failed with a read-back in it is
   sent once more without;
3. P's answer must carry ``kv_transfer_params``: they go to D verbatim (D
   decodes and checks them), plus ``pd_bidirectional``: whether D keeps
   the turn (only a ``--multi-turn`` turn with a key and ``n`` = 1);
4. the D leg, re-dispatched to another D if the first refused it unrun
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
from .legs import decode_body, prefill_body, pull_prefill_params
from .relay import StreamSink
from .upstream import Upstream

# The logger of the request path (docs/proxy.md names it; log lines unchanged).
logger = logging.getLogger("vllm_pd_proxy.forward")

_encode = msgspec.json.encode


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
    """Serve one request in pull mode: P leg, then D leg with P's params.

    ``avoid_p``/``avoid_d``: engines an earlier attempt of this request
    failed on (a migration); neither is chosen again.
    """
    if decode is None and not up.decode.any_routable():
        # D is picked after P (its load changes meanwhile), but a prefill
        # whose KV no decode engine can take would be wasted work.
        raise errors.no_backend(up.decode.describe_unavailable(), "decode")
    seeding = first_token_flow.decide(up, sink, ctx, body, turn is not None)
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
