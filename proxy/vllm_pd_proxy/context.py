"""Per-request record: what the proxy decided and what happened.

Lifecycle: :mod:`vllm_pd_proxy.forward` creates one :class:`RequestContext`
when a client request arrives, the legs fill it in (chosen backends, first
byte time, outcome), and at the end it feeds the metrics and produces the one
structured INFO access-log line per request. A batched request also gets one
context per prompt (``members``, ids from :func:`member_request_id`), which
its legs fill in; only the request's own context is logged and counted.

Everything a client controls is made safe before it reaches a log line:
:func:`sanitize_request_id` for the ``X-Request-Id`` the proxy adopts (and
builds push ids from), :func:`log_safe` for free text such as error messages,
which may quote a backend body that echoes the client's input.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import Outcome
from .telemetry import LegMarks

if TYPE_CHECKING:
    from .backends import Backend
    from .metrics import Metrics
    from .migration import Migration
    from .stream_track import StreamTracker

access_log = logging.getLogger("vllm_pd_proxy.access")

# Longer client ids are cut: uuids, prefixed uuids and trace ids fit easily.
MAX_REQUEST_ID_LEN = 128
# Everything else (spaces, "=", quotes, tabs, control and non-ASCII characters)
# becomes "_": a request id must stay one value of the key=value access line,
# so "x status=200 outcome=ok" cannot forge fields and no newline can forge lines.
_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9._:/+@~-]")


def sanitize_request_id(raw: str | None) -> str | None:
    """The client's ``X-Request-Id`` made safe to log and to build ids from.

    At most :data:`MAX_REQUEST_ID_LEN` characters of ``[A-Za-z0-9._:/+@~-]``;
    None when nothing usable is left (the caller then makes a fresh id).
    """
    if not raw:
        return None
    return _UNSAFE_ID_CHARS.sub("_", raw[:MAX_REQUEST_ID_LEN]) or None


def member_request_id(request_id: str, prompt: int) -> str:
    """The id of a batch's prompt ``prompt``: ``<request_id>-<prompt>``, the
    request id cut so that the whole stays within :data:`MAX_REQUEST_ID_LEN`
    (the suffix keeps the members' ids distinct)."""
    suffix = f"-{prompt}"
    return request_id[:MAX_REQUEST_ID_LEN - len(suffix)] + suffix


def log_safe(text: str) -> str:
    """``text`` as one quoted, escaped token: no newline, control character or bare quote."""
    return json.dumps(text)


@dataclass(slots=True)
class RequestContext:
    request_id: str
    endpoint: str
    started: float
    chat: bool = False
    #: A Responses API request (``/v1/responses``): its P leg differs.
    responses: bool = False
    stream: bool = False
    tokens: int = 0
    # With --local-prefill-threshold: tokens minus what the chosen D probably
    # caches (None: not estimated).
    uncached_tokens: int | None = None
    # With --local-prefill-threshold: the prompt's chunk keys (prompt.py).
    chunk_keys: tuple[int, ...] = ()
    mode: str = "none"
    prefill: Backend | None = None
    decode: Backend | None = None
    status: int = 0
    ttft: float | None = None
    outcome: Outcome = Outcome.OK
    retries: int = 0
    # Seconds spent waiting for a prefill slot, over all attempts.
    queued: float = 0.0
    error: str | None = None
    # The prompt's digest the legs are signed with (computed on first use).
    prompt_digest: str | None = None
    # Multi-turn: D keeps this turn (pd_bidirectional) and its answer's
    # kv_transfer_params, which no client sees anyway, are kept here.
    capture_kv: bool = False
    kept_turn: dict[str, Any] | None = None
    # --transfer-telemetry / --otel: the legs' timings (vllm_pd_proxy.telemetry).
    marks: LegMarks | None = None
    # A batched request: one context per prompt (vllm_pd_proxy.batch_flow);
    # only this one feeds the metrics and the access log.
    members: tuple[RequestContext, ...] = ()
    # --max-migrations > 0 (vllm_pd_proxy.migration): the prompt's
    # migrations, and for a stream what the client got (stream_track).
    migration: Migration | None = None
    track: StreamTracker | None = None
    # Why this stream cannot continue on another D (None: it can).
    unsupported: str | None = None
    # Fields the D legs get beyond the client's (return_token_ids).
    decode_extra: dict[str, Any] | None = None
    # The client's stream started (a later failure cannot be an HTTP error).
    stream_started: bool = False
    # The client's stream got ``data: [DONE]``: it has its whole answer, and
    # a disconnect from then on (SDKs close at once) is no cancellation.
    client_done: bool = False
    # Loop time of the last event relayed to the client.
    progress: float = 0.0

    def mark(self, name: str) -> None:
        """Record that leg event ``name`` happened now (telemetry on only)."""
        if self.marks is not None:
            self.marks.mark(name, asyncio.get_running_loop().time())

    def finish(self, now: float, metrics: Metrics) -> None:
        """Record metrics and write the access-log line."""
        e2e = now - self.started
        metrics.requests.labels(self.outcome, self.mode).inc()
        metrics.e2e.observe(e2e)
        if self.ttft is not None:
            metrics.ttft.observe(self.ttft)
        if access_log.isEnabledFor(logging.INFO):
            access_log.info(
                "request_id=%s endpoint=%s mode=%s prefill=%s decode=%s status=%d outcome=%s "
                "ttft_ms=%s e2e_ms=%.1f prompt_tokens_est=%d uncached_est=%s retries=%d "
                "queue_ms=%.1f%s%s%s",
                self.request_id,
                self.endpoint,
                self.mode,
                self.prefill.url if self.prefill else "-",
                self.decode.url if self.decode else "-",
                self.status,
                self.outcome,
                "-" if self.ttft is None else f"{self.ttft * 1000:.1f}",
                e2e * 1000,
                self.tokens,
                "-" if self.uncached_tokens is None else self.uncached_tokens,
                self.retries,
                self.queued * 1000,
                f" prompts={len(self.members)}" if self.members else "",
                (f" migrations={','.join(self.migration.causes)}"
                 if self.migration is not None and self.migration.causes else ""),
                f" error={log_safe(self.error)}" if self.error else "",
            )
