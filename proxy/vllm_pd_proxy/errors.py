"""Errors the request path raises and how each reaches the client.

Role: every failure of a leg becomes a :class:`ProxyError` carrying the HTTP
status for the client, an OpenAI-style JSON body (or, for a backend's own
error answer, that backend's body verbatim), a metrics ``outcome`` label and
whether the prefill leg may be retried elsewhere. The forwarding code raises
them; the handler renders them as a response before the first byte, or as an
SSE error event after it. :class:`Outcome` is the one list of outcomes (the
access log's ``outcome=`` and the ``pd_proxy_requests_total`` label).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

import aiohttp
from aiohttp import web

if TYPE_CHECKING:
    from .backends import Backend


class Outcome(enum.StrEnum):
    """How a request ended; the value is the metric label and the log word."""

    OK = "ok"
    BAD_REQUEST = "bad_request"
    #: --max-total-body-bytes
    OVERLOADED = "overloaded"
    #: --max-queued, --queue-timeout
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    UPSTREAM_4XX = "upstream_4xx"
    UPSTREAM_5XX = "upstream_5xx"
    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    PROTOCOL_ERROR = "protocol_error"
    TIMEOUT = "timeout"
    NO_BACKEND = "no_backend"
    STREAM_ERROR = "stream_error"
    #: The client went away (status 499).
    CANCELLED = "cancelled"
    INTERNAL_ERROR = "internal_error"


# Backend statuses after which the prefill leg may go to another engine:
# the engine (or something in front of it) was overloaded or unreachable.
RETRYABLE_STATUSES = frozenset({502, 503, 504})
# A draining vllm_pd_ext engine marks its 503s (and its /health) with this.
DRAINING_HEADER = "X-PD-Draining"


def says_draining(status: int, headers: Mapping[str, str]) -> bool:
    """An engine's answer says it is draining (it refused the leg unrun)."""
    return status in (200, 503) and headers.get(DRAINING_HEADER) == "1"


def error_json(status: int, message: str, err_type: str, param: str | None = None) -> bytes:
    """The body vLLM's OpenAI server uses for errors (``param``: the field at fault)."""
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return json.dumps(body).encode()


def failed_before_send(exc: BaseException) -> bool:
    """Whether a client error certainly happened before the backend got the request.

    Only a failed connect qualifies (refused, unresolvable, TLS, connect
    timeout): no byte of the request left. Any later failure (reset, server
    disconnected, truncated answer) may come after the engine ran it, even
    finished it (a pull P then holds the KV under a lease for D).
    """
    return isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))


class ProxyError(Exception):
    """A request failure with everything needed to answer the client."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        err_type: str,
        outcome: Outcome,
        retryable: bool = False,
        body: bytes | None = None,
        content_type: str = "application/json",
        backend: Backend | None = None,
        headers: Mapping[str, str] | None = None,
        draining: bool = False,
        role: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.outcome = outcome
        self.retryable = retryable
        self.body = body if body is not None else error_json(status, message, err_type)
        self.content_type = content_type
        self.backend = backend  # the backend at fault, if any
        self.headers = dict(headers or {})  # extra response headers (Retry-After)
        # The backend refused the leg because it is draining: it ran nothing,
        # so the leg (push: both legs) may go to another engine.
        self.draining = draining
        # The pool at fault ("prefill", "decode"): the backend's, or the
        # pool that had no engine for the leg.
        self.role = role if role is not None else (backend.role if backend else None)
        # An error event a backend sent, relayed as it is when it ends a stream.
        self.event_data: bytes | None = None
        # Push: the leg failed only because the backend's identity changed
        # (restarted at its URL) and is refreshed now: it is not a sick
        # engine, and the same one may serve the prompt again.
        self.stale_identity = False

    def response(self, request_id: str) -> web.Response:
        # Content-Type as a header: a backend's may carry a charset parameter.
        headers = {**self.headers, "Content-Type": self.content_type, "X-Request-Id": request_id}
        return web.Response(status=self.status, body=self.body, headers=headers)

    def sse_event(self) -> bytes:
        """Error event ending a stream that has already started, as vLLM does."""
        payload = self.event_data or error_json(self.status, self.message, self.err_type)
        return b"data: " + payload + b"\n\ndata: [DONE]\n\n"


def bad_request(message: str, param: str | None = None) -> ProxyError:
    err_type = "invalid_request_error"
    return ProxyError(
        400,
        message,
        err_type=err_type,
        outcome=Outcome.BAD_REQUEST,
        body=error_json(400, message, err_type, param),
    )


def overloaded(message: str) -> ProxyError:
    """The proxy itself is at a capacity limit; the client may retry shortly."""
    return ProxyError(
        503,
        message,
        err_type="service_unavailable",
        outcome=Outcome.OVERLOADED,
        headers={"Retry-After": "1"},
    )


def queue_rejected(
    reason: Literal[Outcome.QUEUE_FULL, Outcome.QUEUE_TIMEOUT], message: str, retry_after: int
) -> ProxyError:
    """Back-pressure: every usable prefill engine is at its in-flight cap and the
    request could not wait (queue full) or waited too long (queue timeout)."""
    return ProxyError(
        503,
        message,
        err_type="service_unavailable",
        outcome=reason,
        headers={"Retry-After": str(max(1, retry_after))},
    )


def no_backend(detail: str, role: str | None = None) -> ProxyError:
    """No engine of pool ``role`` can take the leg."""
    return ProxyError(503, detail, err_type="service_unavailable", outcome=Outcome.NO_BACKEND,
                      role=role)


def upstream_status(
    leg: str,
    backend: Backend,
    status: int,
    body: bytes,
    content_type: str | None,
    draining: bool = False,
) -> ProxyError:
    """A backend answered with an error status: relay status and body verbatim."""
    text = body[:200].decode("utf-8", "replace")
    message = f"{leg} backend {backend.url} answered HTTP {status}: {text}"
    if draining:
        message = f"{leg} backend {backend.url} is draining (refused the request unrun)"
    return ProxyError(
        status,
        message,
        err_type="upstream_error",
        outcome=Outcome.UPSTREAM_4XX if status < 500 else Outcome.UPSTREAM_5XX,
        retryable=status in RETRYABLE_STATUSES,
        body=body or error_json(status, message, "upstream_error"),
        content_type=content_type or "application/json",
        backend=backend,
        draining=draining,
    )


def upstream_unreachable(leg: str, backend: Backend, exc: BaseException) -> ProxyError:
    """A connection failure; retryable only if the request certainly never left."""
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    before = failed_before_send(exc)
    message = f"{leg} backend {backend.url} failed: {detail}"
    if leg == "prefill" and not before:
        # Not re-sent as it is (--prefill-retries): the engine may hold its
        # KV under a lease. A migration runs a new handoff instead.
        message += " (after the request was sent, so the engine may have run it)"
    return ProxyError(
        502,
        message,
        err_type="upstream_error",
        outcome=Outcome.UPSTREAM_UNREACHABLE,
        retryable=before,
        backend=backend,
    )


def upstream_timeout(leg: str, backend: Backend, seconds: float, what: str) -> ProxyError:
    return ProxyError(
        504,
        f"{leg} backend {backend.url} timed out after {seconds:g} s waiting for {what}",
        err_type="timeout_error",
        outcome=Outcome.TIMEOUT,
        backend=backend,
    )


def protocol_error(leg: str, backend: Backend, problem: str) -> ProxyError:
    return ProxyError(
        502,
        f"{leg} backend {backend.url}: {problem}",
        err_type="upstream_error",
        outcome=Outcome.PROTOCOL_ERROR,
        backend=backend,
    )
