"""The batch flow: one P/D handoff per prompt of a batched completion
request, their answers merged into the client's one answer.

Called by the :class:`~vllm_pd_proxy.forward.Forwarder` once per request
whose ``prompt`` is a batch (:func:`~vllm_pd_proxy.batch.split_prompts`),
with one :class:`Member` per prompt: its own request id (``<id>-<i>``), body,
headers and :class:`~vllm_pd_proxy.context.RequestContext`. Each member is
served as a request of its own (decision, then the local, pull or push
flow: P legs go out together, each through the prefill gate), but only the
batch's context feeds the metrics and the access log. Per batch:

1. every member starts at once, as a task;
2. non-streamed: once all answered, their bodies are merged
   (:func:`~vllm_pd_proxy.batch.merge_answers`); streamed: every member's
   D stream goes into a :class:`MemberSink`, which holds it until every
   member's stream has opened (so a failure before that is still an HTTP
   error), then the client's response starts and each member's events are
   re-indexed (:class:`~vllm_pd_proxy.batch.StreamMerge`) and written as
   they arrive; the summed usage chunk and one ``[DONE]`` end it;
3. a member that fails before the client's response began fails the batch
   with its error (the first by prompt order); after, the stream ends with
   an error event and ``[DONE]``, as one request's would;
4. whatever happens, the members still running are cancelled and awaited:
   their upstream connections close, so the engines abort them and free
   their KV.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from . import errors
from .batch import StreamMerge, merge_answers
from .context import RequestContext
from .errors import Outcome
from .relay import SSE_CONTENT_TYPE, OpenedDecode, StreamSink, client_events


@dataclass(slots=True)
class Member:
    """One prompt of a batch, served as a request of its own."""

    ctx: RequestContext
    body: dict[str, Any]
    headers: dict[str, str]


#: Serves one member: ``Forwarder.serve`` (decision, then its flow).
Serve = Callable[
    [StreamSink, RequestContext, dict[str, Any], dict[str, str]], Awaitable[web.StreamResponse]
]


async def run_batch(
    serve: Serve,
    request: web.Request,
    ctx: RequestContext,
    members: Sequence[Member],
    n: int,
) -> web.StreamResponse:
    """Serve a batch (see the module docstring); ``n``: choices per prompt."""
    ctx.members = tuple(m.ctx for m in members)
    try:
        if ctx.stream:
            return await _streamed(serve, request, ctx, members, n)
        return await _complete(serve, ctx, members)
    finally:
        _sum_up(ctx)


async def _complete(serve: Serve, ctx: RequestContext, members: Sequence[Member]
                    ) -> web.Response:
    tasks = [_start(serve, _NO_STREAM, m) for m in members]
    try:
        pending: set[asyncio.Future[Any]] = set(tasks)
        while pending:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            _raise_first_failure(tasks)
    finally:
        await _cancel(tasks)
    answers = [_answer(m, t.result()) for m, t in zip(members, tasks, strict=True)]
    body = msgspec.json.encode(merge_answers(answers))
    ctx.ttft = asyncio.get_running_loop().time() - ctx.started
    headers = {"Content-Type": "application/json", "X-Request-Id": ctx.request_id}
    return web.Response(status=200, body=body, headers=headers)


def _answer(member: Member, resp: web.StreamResponse) -> dict[str, Any]:
    """A member's non-streamed answer as JSON; 502 naming its D if it is not."""
    body = resp.body if isinstance(resp, web.Response) else None
    try:
        answer = msgspec.json.decode(body) if isinstance(body, bytes) else None
    except msgspec.DecodeError:
        answer = None
    if not isinstance(answer, dict):
        assert member.ctx.decode is not None
        raise errors.protocol_error(
            "decode", member.ctx.decode,
            f"answer to batch member {member.ctx.request_id} is not a JSON object")
    return answer


async def _streamed(serve: Serve, request: web.Request, ctx: RequestContext,
                    members: Sequence[Member], n: int) -> web.StreamResponse:
    merged = MergedStream(ctx, len(members), n)
    tasks = [_start(serve, MemberSink(merged, i), m) for i, m in enumerate(members)]
    try:
        # 1. Until every member's stream opened: a failure is the batch's error.
        pending: set[asyncio.Future[Any]] = set(tasks)
        while not merged.all_open.done():
            done, pending = await asyncio.wait(
                pending | {merged.all_open}, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(merged.all_open)
            _raise_first_failure(tasks)
            for i, task in enumerate(tasks):
                if task in done and task.result() is not merged.response:
                    # D answered a streamed request with a whole body.
                    decode = members[i].ctx.decode
                    assert decode is not None
                    raise errors.protocol_error(
                        "decode", decode, "answered a streamed batch member without SSE")
        try:
            await merged.begin(request)
        except ConnectionResetError:
            ctx.status, ctx.outcome = 499, Outcome.CANCELLED
            return merged.response
        # 2. Relay until every stream ended, or one failed, or the client left.
        while pending and not merged.stopped.done():
            done, pending = await asyncio.wait(
                pending | {merged.stopped}, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(merged.stopped)
            for ended in done - {merged.stopped}:
                if not ended.cancelled() and (exc := ended.exception()) is not None:
                    await merged.fail(exc if isinstance(exc, errors.ProxyError)
                                      else _internal(exc))
        await merged.finish()
        return merged.response
    finally:
        await _cancel(tasks)


def _start(serve: Serve, sink: StreamSink, member: Member) -> asyncio.Task[web.StreamResponse]:
    return asyncio.ensure_future(serve(sink, member.ctx, member.body, member.headers))


def _raise_first_failure(tasks: list[asyncio.Task[web.StreamResponse]]) -> None:
    """Raise the error of the first member (by prompt order) that failed."""
    for task in tasks:
        if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
            raise exc


async def _cancel(tasks: list[asyncio.Task[web.StreamResponse]]) -> None:
    """Cancel the members still running (closing their upstream connections
    makes the engines abort them) and wait until they have."""
    for task in tasks:
        if not task.done():
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _internal(exc: BaseException) -> errors.ProxyError:
    return errors.ProxyError(500, f"proxy internal error: {exc!r}", err_type="internal_error",
                             outcome=Outcome.INTERNAL_ERROR)


def _sum_up(ctx: RequestContext) -> None:
    """The batch's access-log fields from its members': prompt 0's engines,
    the summed estimates and retries, the longest wait; mode ``pull`` or
    ``push`` if any prompt was disaggregated, else ``local``."""
    members = ctx.members
    ctx.prefill, ctx.decode = members[0].prefill, members[0].decode
    ctx.tokens = sum(m.tokens for m in members)
    uncached = [m.uncached_tokens for m in members]
    if None not in uncached:
        ctx.uncached_tokens = sum(u for u in uncached if u is not None)
    ctx.retries = sum(m.retries for m in members)
    ctx.queued = max(m.queued for m in members)
    modes = {m.mode for m in members} - {"none"}
    remote = sorted(modes - {"local"})
    ctx.mode = remote[0] if remote else ("local" if modes else "none")


class MergedStream:
    """The client's one SSE response to a streamed batch.

    Lifecycle: built before the members start; each member's sink reports
    its opened stream (:meth:`opened`, waiting there); once all have,
    ``all_open`` is set and the flow calls :meth:`begin` (headers to the
    client, members released); members :meth:`write` their events; the
    stream ends once: :meth:`fail` (an error event), D's own error event, the
    client leaving (``stopped`` set for each), or :meth:`finish`. Writes are
    serialized by a lock; after the end they are dropped.
    """

    def __init__(self, ctx: RequestContext, num_prompts: int, n: int) -> None:
        loop = asyncio.get_running_loop()
        self._ctx = ctx
        self._num_prompts = num_prompts
        self._num_open = 0
        self._merge = StreamMerge(num_prompts, n)
        self._go = asyncio.Event()
        self._lock = asyncio.Lock()
        self._ended = False
        self._content_type = SSE_CONTENT_TYPE
        self.response = web.StreamResponse(status=200)
        self.all_open: asyncio.Future[None] = loop.create_future()
        self.stopped: asyncio.Future[None] = loop.create_future()

    async def opened(self, prompt: int, opened: OpenedDecode) -> None:
        """Member ``prompt``'s D stream opened: wait until the client's has begun."""
        if prompt == 0:
            self._merge.set_head(opened.first)
            self._content_type = opened.resp.headers.get("Content-Type", SSE_CONTENT_TYPE)
        self._num_open += 1
        if self._num_open == self._num_prompts:
            self.all_open.set_result(None)
        await self._go.wait()

    async def begin(self, request: web.Request) -> None:
        """Send the client's headers; the members may write from now on."""
        self.response.headers.update({"Content-Type": self._content_type,
                                      "Cache-Control": "no-cache",
                                      "X-Request-Id": self._ctx.request_id})
        await self.response.prepare(request)
        self._go.set()

    async def write(self, prompt: int, events: bytes) -> None:
        if self._ended:
            return
        data, failed = self._merge.rewrite(prompt, events)
        async with self._lock:
            if self._ended:
                return
            if self._ctx.ttft is None:
                self._ctx.ttft = asyncio.get_running_loop().time() - self._ctx.started
            if failed:  # D's own error event (in data): the batch ends with it
                text = data.decode("utf-8", "replace").strip()[:300]
                self._record(Outcome.STREAM_ERROR, f"prompt {prompt}'s decode stream: {text}")
                await self._end(data + b"data: [DONE]\n\n")
            elif data:
                await self._send(data)

    async def fail(self, error: errors.ProxyError) -> None:
        """A member failed mid-stream: the error event ends the batch's stream."""
        async with self._lock:
            if not self._ended:
                self._record(Outcome.STREAM_ERROR, error.message)
                await self._end(error.sse_event())

    async def finish(self) -> None:
        """Every member ended well: the summed usage chunk, then ``[DONE]``."""
        async with self._lock:
            if not self._ended:
                await self._end((self._merge.usage_event() or b"") + b"data: [DONE]\n\n")

    def _record(self, outcome: Outcome, message: str) -> None:
        self._ctx.outcome, self._ctx.error = outcome, message

    async def _send(self, data: bytes) -> None:
        try:
            await self.response.write(data)
        except ConnectionResetError:
            self._ended = True
            self._ctx.status, self._ctx.outcome = 499, Outcome.CANCELLED
            if not self.stopped.done():
                self.stopped.set_result(None)
            raise

    async def _end(self, tail: bytes) -> None:
        try:
            await self._send(tail)
            await self.response.write_eof()
        finally:
            self._ended = True
            if not self.stopped.done():
                self.stopped.set_result(None)


class MemberSink:
    """A member's D stream into the batch's :class:`MergedStream`."""

    __slots__ = ("_merged", "_prompt")

    def __init__(self, merged: MergedStream, prompt: int) -> None:
        self._merged = merged
        self._prompt = prompt

    @property
    def response(self) -> web.StreamResponse:
        return self._merged.response

    async def start(self, ctx: RequestContext, opened: OpenedDecode) -> None:
        await self._merged.opened(self._prompt, opened)

    async def write(self, ctx: RequestContext, events: bytes) -> None:
        # Telemetry's pd_telemetry goes into the member's finishing chunk.
        await self._merged.write(self._prompt, client_events(ctx, events))

    async def end(self, error: errors.ProxyError | None) -> None:
        if error is not None:
            await self._merged.fail(error)


class _NoStream:
    """The sink of a non-streamed member: its answer is read whole
    (:func:`~vllm_pd_proxy.relay.open_decode`), so nothing is ever streamed."""

    response: web.StreamResponse | None = None

    async def start(self, ctx: RequestContext, opened: OpenedDecode) -> None:
        raise AssertionError("a non-streamed batch member has no stream")

    async def write(self, ctx: RequestContext, events: bytes) -> None:
        raise AssertionError("a non-streamed batch member has no stream")

    async def end(self, error: errors.ProxyError | None) -> None:
        raise AssertionError("a non-streamed batch member has no stream")


_NO_STREAM = _NoStream()
