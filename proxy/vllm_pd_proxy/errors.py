"""Errors the request path raises and how each reaches the client.

Role: every failure of a leg becomes a :class:`ProxyError` carrying the HTTP
status for the client, an OpenAI-style JSON body (or, for a backend's own
error answer, that backend's body verbatim), a metrics ``outcome`` label and
whether the prefill leg may be retried elsewhere. The forwarding code raises
them; the handler renders them as a response before the first byte, or as an
SSE error event after it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from .backends import Backend

# Backend statuses after which the prefill leg may go to another engine:
# the engine (or something in front of it) was overloaded or unreachable.
RETRYABLE_STATUSES = frozenset({502, 503, 504})


def error_json(status: int, message: str, err_type: str) -> bytes:
    """The body vLLM's OpenAI server uses for errors."""
    body = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return json.dumps(body).encode()


class ProxyError(Exception):
    """A request failure with everything needed to answer the client."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        err_type: str,
        outcome: str,
        retryable: bool = False,
        body: bytes | None = None,
        content_type: str = "application/json",
        backend: Backend | None = None,
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

    def response(self, request_id: str) -> web.Response:
        # Content-Type as a header: a backend's may carry a charset parameter.
        headers = {"Content-Type": self.content_type, "X-Request-Id": request_id}
        return web.Response(status=self.status, body=self.body, headers=headers)

    def sse_event(self) -> bytes:
        """Error event ending a stream that has already started, as vLLM does."""
        payload = error_json(self.status, self.message, self.err_type)
        return b"data: " + payload + b"\n\ndata: [DONE]\n\n"


def bad_request(message: str) -> ProxyError:
    return ProxyError(400, message, err_type="invalid_request_error", outcome="bad_request")


def no_backend(detail: str) -> ProxyError:
    return ProxyError(503, detail, err_type="service_unavailable", outcome="no_backend")


def upstream_status(
    leg: str, backend: Backend, status: int, body: bytes, content_type: str | None
) -> ProxyError:
    """A backend answered with an error status: relay status and body verbatim."""
    text = body[:200].decode("utf-8", "replace")
    message = f"{leg} backend {backend.url} answered HTTP {status}: {text}"
    return ProxyError(
        status,
        message,
        err_type="upstream_error",
        outcome="upstream_4xx" if status < 500 else "upstream_5xx",
        retryable=status in RETRYABLE_STATUSES,
        body=body or error_json(status, message, "upstream_error"),
        content_type=content_type or "application/json",
        backend=backend,
    )


def upstream_unreachable(leg: str, backend: Backend, exc: BaseException) -> ProxyError:
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return ProxyError(
        502,
        f"{leg} backend {backend.url} failed: {detail}",
        err_type="upstream_error",
        outcome="upstream_unreachable",
        retryable=True,
        backend=backend,
    )


def upstream_timeout(leg: str, backend: Backend, seconds: float, what: str) -> ProxyError:
    return ProxyError(
        504,
        f"{leg} backend {backend.url} timed out after {seconds:g} s waiting for {what}",
        err_type="timeout_error",
        outcome="timeout",
        backend=backend,
    )


def protocol_error(leg: str, backend: Backend, problem: str) -> ProxyError:
    return ProxyError(
        502,
        f"{leg} backend {backend.url}: {problem}",
        err_type="upstream_error",
        outcome="protocol_error",
        backend=backend,
    )
