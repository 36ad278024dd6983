"""Client request bodies: read them under memory caps, parse them, check ``n``.

Role: :meth:`~vllm_pd_proxy.forward.Forwarder.handle` calls, once per request,
:func:`read_body` (the bytes, counted against the request's
:class:`BodyReservation`), :func:`parse_body` (a JSON object or 400) and
:func:`num_choices` (400 for an ``n`` D would refuse after P prefilled),
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


# vLLM samples greedily below this temperature (sampling_params._SAMPLING_EPS).
_GREEDY_BELOW = 1e-5


def num_choices(body: dict[str, Any]) -> int:
    """The choices each prompt asks for (``n``, 1 when absent); 400 naming
    ``n`` when D would refuse it.

    The P leg drops ``n`` (P prefills once, for one token) and D fans out,
    so an ``n`` D would refuse must be refused here, before P leases a
    prefill for nothing: one that is not a positive integer, or above 1 with
    a greedy ``temperature`` (below 1e-5, beam search aside). A greedy
    default temperature from the model's generation config is not known
    here; D refuses that itself. ``best_of`` (no field of vLLM 0.32's
    completion or chat request: ignored there) goes to D as the client sent it.
    """
    n = body.get("n")
    if n is None:
        return 1
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
        raise errors.bad_request(f"n={n!r} must be a positive integer", param="n")
    temperature = body.get("temperature")
    if (n > 1 and isinstance(temperature, int | float) and not isinstance(temperature, bool)
            and temperature < _GREEDY_BELOW and not body.get("use_beam_search")):
        # vLLM's own words (SamplingParams), which D would answer after P's prefill.
        raise errors.bad_request(f"n must be 1 when using greedy sampling, got {n}.",
                                 param="n")
    return n


# Responses API fields that need one engine to hold state across requests.
_RESPONSES_STATEFUL = {
    "previous_response_id": "a stored response lives on the one engine that generated it "
                            "(vLLM's VLLM_ENABLE_RESPONSES_API_STORE), and no engine here "
                            "generated it whole; send the conversation in `input` instead",
    "background": "a background response is polled later on the engine that runs it, "
                  "which the proxy does not route to; send it without `background`",
}


def check_responses(body: dict[str, Any]) -> None:
    """400 naming the field for a Responses API request P/D cannot serve:
    one that refers to, or leaves, state on one engine. Before any leg."""
    for name, why in _RESPONSES_STATEFUL.items():
        value = body.get(name)
        if value is not None and value is not False:
            raise errors.bad_request(
                f"{name} is not supported through the P/D proxy: {why}", param=name)
