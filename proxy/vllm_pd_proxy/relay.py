"""The decode leg: open it, check it, then relay its answer to the client.

Role: :func:`open_decode` sends the D leg and waits until its status is known
and the first complete piece of the answer has arrived (the whole body when
not streaming), all under ``--decode-timeout``; nothing has reached the
client yet, so any failure can still become a proper HTTP error status.
:func:`relay_stream` then relays the SSE events, in order, into a
:class:`StreamSink`: :class:`ClientSink` sends the headers and the events to
the client as they are (every request but a batched one), a batch member's
sink (:mod:`vllm_pd_proxy.batch_flow`) re-indexes them into the batch's
merged stream.

SSE relaying is event-aligned: bytes are forwarded up to the last complete
event (``\\n\\n``) and a partial event is held back, so when the backend dies
mid-stream the proxy can end the stream with a well-formed error event
(``data: {"error": ...}`` then ``data: [DONE]``, as vLLM itself does) instead of
a truncated line. The held-back part is capped (``--max-sse-event-bytes``): a
backend that never ends its event fails the request (502 before the first
byte, an error event after it) instead of growing the proxy's memory without
bound. Called once per request by :mod:`vllm_pd_proxy.upstream`,
which owns the upstream response and closes it (aborting the engine request)
whatever happens.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from . import errors
from .backends import Backend
from .context import RequestContext
from .conversations import extract_kv_params
from .stream_track import UpstreamError
from .telemetry import annotate

SSE_CONTENT_TYPE = "text/event-stream"


@dataclass(slots=True)
class OpenedDecode:
    """A D leg whose status is 2xx and whose first bytes are in hand."""

    resp: aiohttp.ClientResponse
    first: bytes  # first complete SSE events, or the whole body when not SSE
    pending: bytes  # a partial SSE event held back
    eof: bool
    sse: bool


def split_events(buf: bytes) -> tuple[bytes, bytes]:
    """Split ``buf`` into (complete SSE events, trailing partial event)."""
    if buf.endswith(b"\n\n"):  # the common case: one or more whole events
        return buf, b""
    cut = buf.rfind(b"\n\n")
    cut = cut + 2 if cut >= 0 else 0
    crlf = buf.rfind(b"\r\n\r\n")
    if crlf >= 0:
        cut = max(cut, crlf + 4)
    return buf[:cut], buf[cut:]


class OversizedEvent(Exception):
    """The backend sent more than the cap without ending its SSE event."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            f"sent {size} bytes of one SSE event without an event boundary "
            f"(limit --max-sse-event-bytes {limit})"
        )


async def read_events(
    resp: aiohttp.ClientResponse, pending: bytes, max_event_bytes: int
) -> tuple[bytes, bytes, bool]:
    """Read until at least one complete event: (events, partial rest, eof).

    Raises :class:`OversizedEvent` once the partial event exceeds ``max_event_bytes``.
    """
    buf = bytearray(pending)
    while True:
        chunk = await resp.content.readany()
        if not chunk:
            # Clean end of the body: flush what is left as it is.
            return bytes(buf), b"", True
        if not buf:  # the common case: nothing held back, no copy
            events, rest = split_events(chunk)
            if events:
                return events, rest, False
            buf += chunk
        else:
            # Only the new bytes, and the 3 before them (a boundary split across
            # chunks), can hold the first boundary: no rescan of what is held.
            start = max(len(buf) - 3, 0)
            buf += chunk
            if buf.find(b"\n\n", start) >= 0 or buf.find(b"\r\n\r\n", start) >= 0:
                events, rest = split_events(bytes(buf))
                return events, rest, False
        if len(buf) > max_event_bytes:
            raise OversizedEvent(len(buf), max_event_bytes)


async def open_decode(
    session: aiohttp.ClientSession,
    ctx: RequestContext,
    backend: Backend,
    body: bytes,
    headers: dict[str, str],
    timeout: float,
    max_event_bytes: int,
    endpoint: str | None = None,
) -> OpenedDecode:
    """Send the D leg; return once the first bytes of a 2xx answer arrived.

    Raises ProxyError: the backend's own status and body for an error answer,
    502 if it cannot be reached or its first SSE event exceeds
    ``max_event_bytes``, 504 after ``timeout`` seconds.
    """
    try:
        async with asyncio.timeout(timeout):
            url = backend.url + (endpoint or ctx.endpoint)
            resp = await session.post(url, data=body, headers=headers)
            try:
                if resp.status >= 400:
                    data = await resp.read()
                    ctype = resp.headers.get("Content-Type")
                    draining = errors.says_draining(resp.status, resp.headers)
                    raise errors.upstream_status(
                        "decode", backend, resp.status, data, ctype, draining
                    )
                if ctx.stream and resp.content_type == SSE_CONTENT_TYPE:
                    try:
                        first, pending, eof = await read_events(resp, b"", max_event_bytes)
                    except OversizedEvent as exc:
                        raise errors.protocol_error("decode", backend, str(exc)) from None
                    return OpenedDecode(resp, first, pending, eof, True)
                return OpenedDecode(resp, await resp.read(), b"", True, False)
            except BaseException:
                resp.close()
                raise
    except aiohttp.ClientError as exc:
        raise errors.upstream_unreachable("decode", backend, exc) from exc
    except TimeoutError:
        raise errors.upstream_timeout(
            "decode", backend, timeout, "the first response bytes"
        ) from None


async def open_decode_guarded(
    session: aiohttp.ClientSession,
    ctx: RequestContext,
    backend: Backend,
    body: bytes,
    headers: dict[str, str],
    timeout: float,
    max_event_bytes: int,
    guard: asyncio.Future[Any],
    endpoint: str | None = None,
) -> OpenedDecode:
    """:func:`open_decode`, abandoned if ``guard`` (the P leg sent with it) fails first.

    Raises the guard's error in that case: the client gets P's failure and the
    D leg is cancelled, closing its connection so D frees what it reserved.
    """
    task = asyncio.ensure_future(
        open_decode(session, ctx, backend, body, headers, timeout, max_event_bytes, endpoint)
    )
    try:
        done, _ = await asyncio.wait((task, guard), return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            exc = guard.exception()
            if exc is not None:
                raise exc
        return await task
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _client_headers(ctx: RequestContext, resp: aiohttp.ClientResponse) -> dict[str, str]:
    return {
        "Content-Type": resp.headers.get("Content-Type", "application/json"),
        "X-Request-Id": ctx.request_id,
    }


def complete_response(ctx: RequestContext, opened: OpenedDecode) -> web.Response:
    """A non-streaming answer: D's status, content type and body, verbatim,
    less D's ``kv_transfer_params`` (engine addresses and block ids never
    reach a client; multi-turn keeps them in ``ctx``)."""
    body = opened.first
    if ctx.marks is not None:
        body = annotate(body, False, ctx.marks, ctx.request_id, keep_kv=ctx.capture_kv)
    body, params = extract_kv_params(body, sse=False)
    if ctx.capture_kv:
        ctx.kept_turn = params
    return web.Response(
        status=opened.resp.status, body=body, headers=_client_headers(ctx, opened.resp)
    )


#: The stream's last event: the client has its whole answer.
_DONE_EVENT = b"data: [DONE]"


def client_events(ctx: RequestContext, events: bytes) -> bytes:
    """Complete SSE events as the client gets them: D's kv_transfer_params
    taken out (multi-turn keeps them in ``ctx``); telemetry puts
    ``pd_telemetry`` into the finishing one."""
    if ctx.marks is not None:
        events = annotate(events, True, ctx.marks, ctx.request_id, keep_kv=ctx.capture_kv)
    events, params = extract_kv_params(events, sse=True)
    if params is not None and ctx.capture_kv:
        ctx.kept_turn = params
    return events


class StreamSink(Protocol):
    """Where :func:`relay_stream` puts one D stream.

    Called in this order, from the D leg's task: :meth:`start` once (D's
    answer is 2xx and its first events are in hand), :meth:`write` for each
    run of complete events (the first ones included), :meth:`end` once
    unless the client went away (``ConnectionResetError`` from any of them).
    ``response`` is the client's response, valid once :meth:`start` was called.
    """

    @property
    def response(self) -> web.StreamResponse | None: ...

    async def start(self, ctx: RequestContext, opened: OpenedDecode) -> None: ...

    async def write(self, ctx: RequestContext, events: bytes) -> None: ...

    async def end(self, error: errors.ProxyError | None) -> None: ...


class ClientSink:
    """A D stream straight to the client: D's status and content type, its
    events as they come (:func:`client_events`), the proxy's error event
    after a mid-stream failure.

    A client that closes its connection once it has ``data: [DONE]`` (as
    SDKs do) has its whole answer: a reset after that is no cancellation,
    and is not reported as one (the request's outcome stays ``ok``).
    """

    __slots__ = ("_request", "done", "response")

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response: web.StreamResponse | None = None
        #: ``data: [DONE]`` reached the client's connection.
        self.done = False

    async def start(self, ctx: RequestContext, opened: OpenedDecode) -> None:
        headers = _client_headers(ctx, opened.resp)
        headers["Cache-Control"] = "no-cache"
        self.response = web.StreamResponse(status=opened.resp.status, headers=headers)
        await self.response.prepare(self._request)

    async def start_events(self, ctx: RequestContext) -> None:
        """Start the client's stream before any D answered (token #1 from P,
        :mod:`vllm_pd_proxy.first_token_flow`): 200 and vLLM's content type."""
        headers = {"Content-Type": SSE_CONTENT_TYPE + "; charset=utf-8",
                   "X-Request-Id": ctx.request_id, "Cache-Control": "no-cache"}
        self.response = web.StreamResponse(status=200, headers=headers)
        await self.response.prepare(self._request)

    async def write(self, ctx: RequestContext, events: bytes) -> None:
        assert self.response is not None
        try:
            await self.response.write(client_events(ctx, events))
        except ConnectionResetError:
            if not self.done:
                raise
        if _DONE_EVENT in events:
            self.done = ctx.client_done = True

    async def end(self, error: errors.ProxyError | None) -> None:
        assert self.response is not None
        try:
            if error is not None:
                await self.response.write(error.sse_event())
            await self.response.write_eof()
        except ConnectionResetError:
            if not self.done:
                raise


class MidStreamFailure(Exception):
    """D failed after the client's stream started (tracked streams only).

    Raised by the D leg instead of ending the client's stream: the caller
    either continues the request on another D (:mod:`vllm_pd_proxy.migration`)
    or ends the stream with ``error``. ``since``: the loop time of the last
    event D sent (where the client's wait began).
    """

    def __init__(self, error: errors.ProxyError, since: float) -> None:
        super().__init__(error.message)
        self.error = error
        self.since = since


def event_error(backend: Backend, sent: UpstreamError) -> errors.ProxyError:
    """D's error event as a ProxyError (its code, 500 when it names none); a
    stream it ends gets D's event verbatim."""
    text = f"decode backend {backend.url} sent an error event: {sent.message}"
    status = sent.status
    err = errors.ProxyError(
        status, text, err_type="upstream_error",
        outcome=errors.Outcome.STREAM_ERROR if status >= 500 else errors.Outcome.UPSTREAM_4XX,
        backend=backend, body=sent.raw or None)
    err.event_data = sent.raw or None
    return err


async def relay_stream(
    sink: StreamSink,
    ctx: RequestContext,
    backend: Backend,
    opened: OpenedDecode,
    idle_timeout: float,
    max_event_bytes: int,
    continuing: bool = False,
) -> tuple[web.StreamResponse, errors.ProxyError | None]:
    """Relay an opened SSE answer into ``sink``; returns the client's response
    and a mid-stream error.

    With a tracker (``ctx.track``, ``--max-migrations`` > 0) the events pass
    through it first: an engine's error event (5xx) D sends before anything
    reached the client is raised as a ProxyError (the sink not started: the
    request can go elsewhere), and a failure after that is returned without ending the
    sink (the caller continues the stream or ends it). ``continuing``: a
    continuation of a stream whose sink already started.

    A client disconnect shows up as CancelledError (handler cancellation) or,
    while writing, ConnectionResetError, recorded as outcome "cancelled".
    """
    resp = opened.resp
    track = ctx.track
    loop = asyncio.get_running_loop()
    error: errors.ProxyError | None = None
    first = opened.first
    if track is not None:
        first, sent = track.feed(first)
        if sent is not None:
            error = event_error(backend, sent)
            if not first and not continuing and sent.status >= 500:
                # Nothing reached the client: the request may still go elsewhere.
                raise error
    try:
        if not continuing:
            await sink.start(ctx, opened)
            ctx.stream_started = True
        if first:
            await sink.write(ctx, first)
        ctx.progress = loop.time()
        if not continuing:
            ctx.ttft = ctx.progress - ctx.started
        pending, eof = opened.pending, opened.eof
        while not eof and error is None:
            try:
                async with asyncio.timeout(idle_timeout):
                    events, pending, eof = await read_events(resp, pending, max_event_bytes)
            except OversizedEvent as exc:
                error = errors.protocol_error("decode", backend, str(exc))
                break
            except aiohttp.ClientError as exc:
                error = errors.upstream_unreachable("decode", backend, exc)
                break
            except TimeoutError:
                error = errors.upstream_timeout("decode", backend, idle_timeout, "the next chunk")
                break
            if track is not None and events:
                events, sent = track.feed(events)
                if sent is not None:
                    error = event_error(backend, sent)
            if events:
                await sink.write(ctx, events)
                ctx.progress = loop.time()
        if error is None and track is not None and not track.done:
            error = errors.protocol_error(
                "decode", backend, "the stream ended without its last event (data: [DONE])")
        if error is not None and track is not None:
            assert sink.response is not None
            return sink.response, error
        await sink.end(error)
    except ConnectionResetError:
        # The client went away while we were writing; the caller closes the
        # upstream response, which aborts the request on the engine.
        ctx.status, ctx.outcome = 499, errors.Outcome.CANCELLED
    assert sink.response is not None  # made before anything could reset
    return sink.response, error
