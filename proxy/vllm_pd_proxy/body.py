"""Client request bodies: read them under memory caps, parse them, refuse what P/D cannot do.

Role: :meth:`~vllm_pd_proxy.forward.Forwarder.handle` calls, once per request,
:func:`read_body` (the bytes, counted against the request's
:class:`BodyReservation`), :func:`parse_body` (a JSON object or 400) and
:func:`reject_unsupported` (400 for parameters the P/D handoff cannot serve),
all before any leg is dispatched.

Memory: each request may hold up to ``--max-request-bytes`` (413 above, as
aiohttp answers), and all requests together up to ``--max-total-body-bytes``
(:class:`BodyBudget`; 503 above). Bytes are counted as they arrive, so a
chunked or compressed body is capped like one with a ``Content-Length``; a
declared length is reserved up front, so a request that cannot fit is refused
before its body is read. Lifecycle of a reservation: created empty per request
(:meth:`BodyBudget.reservation`), grown while the body is read, released once
when the request ends (the parsed body and the legs built from it live until
then). Everything runs on the event loop thread: plain ints, no locks.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from . import errors


class BodyBudget:
    """Bytes of client request bodies the proxy holds at once, at most ``capacity``."""

    __slots__ = ("capacity", "used")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0

    def reservation(self) -> BodyReservation:
        return BodyReservation(self)


class BodyReservation:
    """One request's share of a :class:`BodyBudget`."""

    __slots__ = ("_budget", "size")

    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget
        self.size = 0

    def grow_to(self, size: int) -> None:
        """Hold ``size`` bytes in all; 503 ProxyError if the budget cannot give them."""
        extra = size - self.size
        if extra <= 0:
            return
        budget = self._budget
        if budget.used + extra > budget.capacity:
            raise errors.overloaded(
                f"the proxy already holds {budget.used} bytes of request bodies and this "
                f"request needs {size}; the limit is --max-total-body-bytes "
                f"{budget.capacity}. Retry shortly."
            )
        budget.used += extra
        self.size = size

    def release(self) -> None:
        """Give everything back; idempotent."""
        self._budget.used -= self.size
        self.size = 0


async def read_body(request: web.Request, held: BodyReservation, max_bytes: int) -> bytes:
    """The whole request body, counted against ``held`` as it arrives.

    Raises ``HTTPRequestEntityTooLarge`` (413) above ``max_bytes`` and a 503
    ProxyError when the total budget is exhausted.
    """
    declared = request.content_length
    if declared:
        # Refuse without reading when the declared size cannot be served. A
        # compressed body inflates beyond its Content-Length: counted below.
        if declared > max_bytes and "Content-Encoding" not in request.headers:
            raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=declared)
        held.grow_to(min(declared, max_bytes))
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > max_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=size)
        held.grow_to(size)
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def parse_body(raw: bytes) -> dict[str, Any]:
    """The client's JSON object, or a 400 ProxyError saying what is wrong."""
    if not raw:
        raise errors.bad_request("request body is empty; expected a JSON object")
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise errors.bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise errors.bad_request("request body must be a JSON object")
    return body


# Parameters asking one request for several samples. A P/D handoff moves one
# prompt's KV from one prefill to one decode request; several samples would
# need the KV fanned out to several decode sequences, which neither connector
# does yet.
_FAN_OUT_PARAMS = ("n", "best_of")


def reject_unsupported(body: dict[str, Any]) -> None:
    """400 (naming the parameter) for ``n > 1`` or ``best_of > 1``.

    Refused in every mode, local prefill included, so whether a request works
    never depends on its prompt length. Non-numeric values are left to the
    engine, which rejects them with its own message.
    """
    for name in _FAN_OUT_PARAMS:
        value = body.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 1:
            raise errors.bad_request(
                f"{name}={value!r} is not supported by the P/D proxy: a prefill hands its KV "
                f"cache to exactly one decode request, so several samples per request "
                f"({name} > 1) cannot be served; send separate requests instead",
                param=name,
            )
