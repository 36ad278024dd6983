"""Per-request telemetry at the proxy (``--transfer-telemetry``, ``--otel``).

Role: with ``--transfer-telemetry`` the proxy times each request's legs
(:class:`LegMarks`, milliseconds since the proxy received the request) and
puts them, together with the transfer record D sends in its final
``kv_transfer_params`` (``pd_transfer``, engines run with
``transfer_telemetry_in_response``), into the answer as one top-level field::

    "pd_telemetry": {"request_id": ..., "proxy": {"mode": "pull",
        "prefill_sent_ms": ..., "prefill_done_ms": ..., "decode_sent_ms": ...,
        "decode_first_byte_ms": ...}, "transfer": {D's record}}

in the body of a non-streamed answer, or in the stream's finishing chunk
(the one with ``finish_reason``). D's other ``kv_transfer_params`` name
engine addresses and never reach the client (multi-turn keeps them, as
before). ``--otel`` exports the same as OpenTelemetry spans
(:class:`SpanExporter`); without that flag nothing imports OpenTelemetry.

Lifecycle: one :class:`LegMarks` per request (``RequestContext.marks``),
written by the request path (:mod:`vllm_pd_proxy.forward`,
:mod:`vllm_pd_proxy.upstream`) on the event loop; :func:`annotate`
runs on each relayed piece until the finishing one; the exporter, if any,
is called once per request when it ends.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FIELD = "pd_telemetry"
_KV = b'"kv_transfer_params"'
# vLLM writes compact JSON: a finished choice reads "finish_reason":"<reason>".
_FINISHED = b'"finish_reason":"'


@dataclass(slots=True)
class LegMarks:
    """When each leg event happened, in ms since the proxy got the request."""

    started: float  # the event loop's clock at the request's arrival
    #: --transfer-telemetry: the answer gets ``pd_telemetry`` (--otel alone:
    #: only D's record is taken out of its params, for the spans).
    in_answer: bool = True
    mode: str = "none"
    #: Where token #1 came from (``seeded``, ``prefill``, ``fallback:<why>``;
    #: None: no P leg).
    first_token: str | None = None
    marks: dict[str, float] = field(default_factory=dict)
    #: D's transfer record, once seen in its answer.
    transfer: dict[str, Any] | None = None
    #: The telemetry went into the answer (once per request).
    done: bool = False

    def mark(self, name: str, now: float) -> None:
        self.marks[name] = round((now - self.started) * 1e3, 3)

    def as_field(self, request_id: str) -> dict[str, Any]:
        proxy: dict[str, Any] = {"mode": self.mode, **self.marks}
        if self.first_token is not None:
            proxy["first_token"] = self.first_token
        return {"request_id": request_id, "proxy": proxy, "transfer": self.transfer}


def _rewrite(body: dict[str, Any], marks: LegMarks, request_id: str, keep_kv: bool
             ) -> dict[str, Any] | None:
    """Move D's transfer record into ``pd_telemetry``; returns D's remaining
    kv_transfer_params when ``keep_kv`` (multi-turn files them), else drops them."""
    params = body.pop("kv_transfer_params", None)
    rest: dict[str, Any] | None = None
    if isinstance(params, dict):
        transfer = params.pop("pd_transfer", None)
        if isinstance(transfer, dict):
            marks.transfer = transfer
        rest = params or None
        if (keep_kv or not marks.in_answer) and rest is not None:
            body["kv_transfer_params"] = rest
    if marks.in_answer:
        body[FIELD] = marks.as_field(request_id)
    marks.done = True
    return rest


def annotate(payload: bytes, sse: bool, marks: LegMarks, request_id: str,
             keep_kv: bool = False) -> bytes:
    """Add ``pd_telemetry`` to a D answer's body, or to the finishing event
    among complete SSE events; other bytes pass through unparsed. D's other
    ``kv_transfer_params`` are dropped, unless kept for multi-turn
    (``keep_kv``) or the answer gets no telemetry (``--otel`` alone)."""
    if marks.done:
        return payload
    if not sse:
        try:
            body = json.loads(payload)
        except ValueError:
            return payload
        if not isinstance(body, dict):
            return payload
        _rewrite(body, marks, request_id, keep_kv)
        return json.dumps(body, separators=(",", ":")).encode()
    if _FINISHED not in payload and _KV not in payload:
        return payload
    out: list[bytes] = []
    for event in payload.split(b"\n\n"):
        if (not marks.done and event.startswith(b"data: {")
                and (_FINISHED in event or _KV in event)):
            try:
                body = json.loads(event[6:])
            except ValueError:
                body = None
            if isinstance(body, dict):
                _rewrite(body, marks, request_id, keep_kv)
                event = b"data: " + json.dumps(body, separators=(",", ":")).encode()
        out.append(event)
    return b"\n\n".join(out)


class SpanExporter:
    """Exports one request's legs as OpenTelemetry spans (``--otel``).

    Uses the process's tracer provider when one is set (an application or
    ``opentelemetry-instrument`` configured it), else sets up the SDK with
    an OTLP/HTTP exporter configured by the standard ``OTEL_*`` variables.
    Spans: ``pd.request`` with children ``pd.prefill_leg``, ``pd.decode_leg``
    and ``pd.kv_transfer`` (D's arrival to its KV ready, from D's record),
    attributes ``pd.*``. Imports OpenTelemetry only when constructed.
    """

    def __init__(self, service_name: str = "vllm-pd-proxy") -> None:
        try:
            from opentelemetry import trace
        except ImportError as exc:
            raise RuntimeError("--otel needs OpenTelemetry: pip install opentelemetry-sdk "
                               "opentelemetry-exporter-otlp-proto-http") from exc
        provider = trace.get_tracer_provider()
        if type(provider).__name__ in ("ProxyTracerProvider", "NoOpTracerProvider"):
            provider = _sdk_provider(service_name)
            trace.set_tracer_provider(provider)
        self._tracer = trace.get_tracer("vllm_pd_proxy")
        self._trace = trace

    def export(self, request_id: str, marks: LegMarks, end_loop_time: float,
               attrs: dict[str, Any]) -> None:
        # Span times are wall-clock nanoseconds; marks are relative to arrival.
        wall_end = time.time_ns()
        t0 = wall_end - int((end_loop_time - marks.started) * 1e9)

        def at(name: str) -> int | None:
            ms = marks.marks.get(name)
            return None if ms is None else t0 + int(ms * 1e6)

        root = self._tracer.start_span("pd.request", start_time=t0, attributes={
            "pd.request_id": request_id, "pd.mode": marks.mode,
            **{f"pd.{k}": v for k, v in attrs.items() if v is not None}})
        ctx = self._trace.set_span_in_context(root)
        child: Callable[..., Any] = self._tracer.start_span
        p0, p1 = at("prefill_sent_ms"), at("prefill_done_ms")
        if p0 is not None and p1 is not None:
            child("pd.prefill_leg", context=ctx, start_time=p0).end(end_time=p1)
        d0 = at("decode_sent_ms")
        if d0 is not None:
            child("pd.decode_leg", context=ctx, start_time=d0).end(end_time=wall_end)
            ready = (marks.transfer or {}).get("kv_ready_ms")
            if isinstance(ready, int | float):
                span = child("pd.kv_transfer", context=ctx, start_time=d0, attributes={
                    f"pd.transfer.{k}": v for k, v in (marks.transfer or {}).items()
                    if isinstance(v, str | int | float) and not isinstance(v, bool)})
                span.end(end_time=d0 + int(ready * 1e6))
        root.end(end_time=wall_end)


def _sdk_provider(service_name: str) -> Any:
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError("--otel needs the OpenTelemetry SDK: pip install opentelemetry-sdk "
                           "opentelemetry-exporter-otlp-proto-http") from exc
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise RuntimeError("--otel needs an OTLP exporter: pip install "
                           "opentelemetry-exporter-otlp-proto-http") from exc
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider
