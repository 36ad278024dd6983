"""Token #1 from P: the D leg after P's answer (``--first-token-from-prefill``).

Role: the pull and push flows call :func:`decide` before the P leg (whether
this request may take the seeded path; P's leg then returns the token ids
and, for a one-token request, no KV at all) and :func:`serve` with P's
answer. :func:`serve` either answers the request or returns None, after
which the flow sends D today's leg (D computes token #1 itself). The pure
decisions are :mod:`vllm_pd_proxy.first_token`'s. Per request:

* P's token ended the answer (``stop``, or the client's limit is 1): the
  client's answer is P's, streamed or not; no D leg (P kept no lease:
  ``pd_first_token`` on its leg);
* a stream: the client's stream starts with token #1 at once, through the
  request's :class:`~vllm_pd_proxy.stream_track.StreamTracker`; D's leg is
  the continuation after it (prompt ids + token #1, ``pd_seeded_tokens``
  1, P's ``kv_transfer_params``), spliced into the stream. A D that fails
  from here on is a mid-stream failure: another D continues after the
  tokens sent (issue 28's migration), or the stream ends with the error
  event; never a token twice or a token missing;
* not streamed: D's answer is merged after token #1.

Every request that had a P leg is counted once in
``pd_proxy_first_token_total{path,reason}`` and its telemetry record names
the path (``pd_telemetry.proxy.first_token``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
from aiohttp import web

from vllm_pd_ext.wire.auth import sign_leg

from . import errors, first_token
from .backends import Backend
from .context import RequestContext
from .migration import CONTINUATION_ENDPOINT
from .relay import ClientSink, MidStreamFailure, StreamSink
from .stream_track import StreamTracker
from .upstream import Upstream

logger = logging.getLogger("vllm_pd_proxy.forward")

_encode = msgspec.json.encode
_decode = msgspec.json.decode

SEEDED = "seeded"
PREFILL = "prefill"
FALLBACK = "fallback"


def decide(up: Upstream, sink: StreamSink, ctx: RequestContext, body: dict[str, Any],
           readback: bool = False) -> bool:
    """Whether this prompt's P leg asks for token #1 (a refusal is counted).
    ``readback``: P's leg reads a kept turn back from D (multi-turn)."""
    if not up.config.first_token_from_prefill:
        return False
    why = first_token.refusal(body, ctx.chat, responses=ctx.responses,
                              batch=not isinstance(sink, ClientSink),
                              multi_turn=ctx.capture_kv or readback)
    if why is not None:
        record(up, ctx, FALLBACK, why)
        return False
    return True


def prefill_only(body: dict[str, Any], ctx: RequestContext) -> bool:
    """P's answer is certainly the whole answer (the client asked for one
    token): its leg carries no KV handoff at all."""
    return first_token.limit_of(body, ctx.chat) == 1


def no_token_ids(ctx: RequestContext) -> errors.ProxyError:
    """A one-token leg (no handoff) whose answer named no token ids."""
    assert ctx.prefill is not None
    return errors.protocol_error(
        "prefill", ctx.prefill, "answer to a one-token request has no token ids "
        "(return_token_ids), so the proxy cannot tell what it answered; is the engine "
        "vLLM 0.32 or later?")


def record(up: Upstream, ctx: RequestContext, path: str, reason: str = "") -> None:
    up.metrics.first_token.labels(path, reason).inc()
    if ctx.marks is not None:
        ctx.marks.first_token = f"{path}:{reason}" if reason else path


async def serve(
    up: Upstream,
    sink: StreamSink,
    ctx: RequestContext,
    body: dict[str, Any],
    headers: dict[str, str],
    answer: dict[str, Any],
    d_params: dict[str, Any] | None,
    decode: Backend | None,
    prefix: tuple[int, ...] | None,
    exclude: list[Backend],
) -> web.StreamResponse | None:
    """Answer with P's token #1 and D's rest; None: D's usual leg instead.

    ``d_params``: the ``kv_transfer_params`` D's leg carries (P's answer's
    in (sequential) pull mode, the push registration in push mode; None when P's answer
    has none, which only a final answer can do without).
    """
    chat = ctx.chat
    seed = first_token.seed_of(answer, chat)
    if seed is None:
        record(up, ctx, FALLBACK, "no_token_ids")
        return None
    wants_ids = bool(body.get("return_token_ids"))
    if first_token.is_final(seed, first_token.limit_of(body, chat)):
        record(up, ctx, PREFILL)
        return await answer_from_p(sink, ctx, body, answer, seed, wants_ids)
    why = first_token.seed_refusal(answer, seed, chat)
    if why is None and d_params is not None and not d_params.get("remote_prompt_digest") \
            and not d_params.get("pd_request_id"):
        # Not a vllm_pd_ext prefill (vLLM's NixlConnector answers without a
        # prompt digest): its decode engines would not know pd_seeded_tokens.
        why = "not_pd_ext"
    d_body = first_token.decode_body(body, seed, chat, ctx.stream)
    if why is None and (d_body is None or d_params is None):
        why = "no_kv_params"
    if why is not None or d_body is None or d_params is None:
        record(up, ctx, FALLBACK, why or "no_kv_params")
        return None
    params = dict(d_params, pd_seeded_tokens=1)
    keyring = up.config.auth
    if keyring is not None:
        # Signed over D's own body: its prompt is the continuation's ids.
        params = sign_leg(keyring, params, ctx.request_id, d_body)
    d_body["kv_transfer_params"] = params
    record(up, ctx, SEEDED)
    leg = _encode(d_body)
    if not ctx.stream:
        return await _merged(up, sink, ctx, headers, answer, seed, leg, decode, prefix,
                             exclude, wants_ids)
    return await _seeded_stream(up, sink, ctx, headers, answer, seed, leg, decode, prefix,
                                exclude, wants_ids)


def _tracker(ctx: RequestContext, wants_ids: bool) -> StreamTracker:
    """The prompt's tracker (the migration's, or one of its own)."""
    if ctx.track is None:
        ctx.track = StreamTracker(ctx.chat, blank_ids=not wants_ids, track_ids=True)
    return ctx.track


async def start_stream(sink: StreamSink, ctx: RequestContext, events: bytes,
                       wants_ids: bool) -> StreamTracker:
    """Start the client's stream with ``events`` (token #1's)."""
    assert isinstance(sink, ClientSink)  # decide() refused every other sink
    track = _tracker(ctx, wants_ids)
    out, _ = track.feed(events)
    await sink.start_events(ctx)
    ctx.stream_started = True
    await sink.write(ctx, out)
    loop = asyncio.get_running_loop()
    ctx.progress = loop.time()
    ctx.ttft = ctx.progress - ctx.started
    ctx.mark("first_token_ms")
    return track


async def answer_from_p(sink: StreamSink, ctx: RequestContext, body: dict[str, Any],
                         answer: dict[str, Any], seed: first_token.Seed, wants_ids: bool
                         ) -> web.StreamResponse:
    """P's answer is the whole answer."""
    if not ctx.stream:
        ctx.ttft = asyncio.get_running_loop().time() - ctx.started
        out = first_token.final_answer(answer, ctx.chat, wants_ids)
        return web.json_response(out, headers={"X-Request-Id": ctx.request_id},
                                 dumps=lambda o: _encode(o).decode())
    options = body.get("stream_options")
    usage = isinstance(options, dict) and bool(options.get("include_usage"))
    await start_stream(sink, ctx, first_token.final_events(answer, seed, ctx.chat, usage),
                       wants_ids)
    await sink.end(None)
    assert sink.response is not None
    return sink.response


async def _d_leg(up: Upstream, sink: StreamSink, ctx: RequestContext, headers: dict[str, str],
                 leg: bytes, decode: Backend | None, prefix: tuple[int, ...] | None,
                 exclude: list[Backend], continuing: bool) -> web.StreamResponse:
    """The continuation leg; again on another D if one refused it unrun
    (draining, never reached: it touched nothing of P's lease)."""
    tried = list(exclude)
    while True:
        try:
            return await up.decode_leg(sink, ctx, decode, leg, headers, prefix, exclude=tried,
                                       endpoint=CONTINUATION_ENDPOINT, continuing=continuing)
        except errors.ProxyError as exc:
            if not up.redispatch(ctx, exc, "decode", tried, len(exclude)):
                raise
            decode = None


async def _seeded_stream(up: Upstream, sink: StreamSink, ctx: RequestContext,
                         headers: dict[str, str], answer: dict[str, Any],
                         seed: first_token.Seed, leg: bytes, decode: Backend | None,
                         prefix: tuple[int, ...] | None, exclude: list[Backend],
                         wants_ids: bool) -> web.StreamResponse:
    track = await start_stream(sink, ctx, first_token.first_events(answer, seed, ctx.chat, False),
                         wants_ids)
    track.begin_continuation()
    try:
        try:
            return await _d_leg(up, sink, ctx, headers, leg, decode, prefix, exclude, True)
        except errors.ProxyError as exc:
            # Token #1 is the client's already: whatever D did, this is a
            # failure mid-stream (a continuation, or the error event).
            ctx.outcome, ctx.error = errors.Outcome.STREAM_ERROR, exc.message
            raise MidStreamFailure(exc, ctx.progress) from None
    except MidStreamFailure as failure:
        return await end_mid_stream(sink, ctx, failure)


async def end_mid_stream(sink: StreamSink, ctx: RequestContext,
                         failure: MidStreamFailure) -> web.StreamResponse:
    """D failed after token #1 reached the client: the failover continues
    the stream on another D (re-raised), or the stream ends with the error."""
    if ctx.migration is not None:
        raise failure  # the failover continues the stream on another D
    ctx.outcome, ctx.error = errors.Outcome.STREAM_ERROR, failure.error.message
    try:
        await sink.end(failure.error)
    except ConnectionResetError:
        ctx.status, ctx.outcome = 499, errors.Outcome.CANCELLED
    assert sink.response is not None
    return sink.response


async def _merged(up: Upstream, sink: StreamSink, ctx: RequestContext,
                  headers: dict[str, str], answer: dict[str, Any], seed: first_token.Seed,
                  leg: bytes, decode: Backend | None, prefix: tuple[int, ...] | None,
                  exclude: list[Backend], wants_ids: bool) -> web.StreamResponse:
    """Not streamed: D's answer to the continuation, merged after token #1."""
    out = await _d_leg(up, sink, ctx, headers, leg, decode, prefix, exclude, False)
    return merged_response(ctx, answer, seed, out, wants_ids)


def merged_response(ctx: RequestContext, answer: dict[str, Any], seed: first_token.Seed,
                    out: web.StreamResponse, wants_ids: bool) -> web.StreamResponse:
    """The client's non-streamed answer: P's token #1, then D's ``out``
    (a completions answer); D's error answers go through as they are."""
    if out.status >= 400 or not isinstance(out, web.Response) or out.body is None:
        return out
    try:
        rest = _decode(out.body)  # type: ignore[arg-type]
    except msgspec.DecodeError:
        rest = None
    merged = (first_token.merge(answer, rest, seed, ctx.chat, wants_ids)
              if isinstance(rest, dict) else None)
    if merged is None:
        assert ctx.decode is not None
        raise errors.protocol_error("decode", ctx.decode,
                                    "the continuation's answer is not one completion choice")
    return web.Response(status=out.status, body=_encode(merged),
                        headers={"Content-Type": "application/json",
                                 "X-Request-Id": ctx.request_id})
