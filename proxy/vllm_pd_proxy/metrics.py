"""Prometheus metrics of one proxy instance, served at GET /metrics.

Lifecycle: ``create_app`` builds one :class:`Metrics` with its own
``CollectorRegistry`` (never the process-global default registry, so several
apps, e.g. in tests, do not collide). The request path updates counters and
histograms; per-backend gauges (in flight, outstanding tokens, health) are not
updated per request at all: :class:`_BackendCollector` reads them from the
pools at scrape time, which keeps the hot path cheaper.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .backends import Pool

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# From sub-millisecond proxy overhead up to the longest leg timeout.
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)


class _BackendCollector(Collector):
    """Per-backend gauges computed from the live pool state on each scrape."""

    def __init__(self, pools: Sequence[Pool]) -> None:
        self._pools = pools

    def collect(self) -> Iterator[Metric]:
        labels = ["role", "backend"]
        in_flight = GaugeMetricFamily(
            "pd_proxy_backend_in_flight", "Legs currently running on the backend", labels=labels
        )
        tokens = GaugeMetricFamily(
            "pd_proxy_backend_outstanding_tokens",
            "Estimated prompt tokens of the legs running on the backend",
            labels=labels,
        )
        healthy = GaugeMetricFamily(
            "pd_proxy_backend_healthy",
            "1 if the last health probe succeeded, 0 if it failed, -1 if not probed yet",
            labels=labels,
        )
        total = CounterMetricFamily(
            "pd_proxy_backend_legs", "Legs sent to the backend", labels=labels
        )
        for pool in self._pools:
            for b in pool.backends:
                key = [pool.role, b.url]
                in_flight.add_metric(key, b.in_flight)
                tokens.add_metric(key, b.outstanding_tokens)
                state = {"healthy": 1, "unhealthy": 0}.get(b.state, -1)
                healthy.add_metric(key, state)
                total.add_metric(key, b.requests_total)
        yield from (in_flight, tokens, healthy, total)


class Metrics:
    """The proxy's metric objects, all bound to a private registry."""

    def __init__(self, pools: Sequence[Pool]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        # Back-pressure rejections are outcomes too: queue_full, queue_timeout.
        self.requests = Counter(
            "pd_proxy_requests",
            "Client requests by outcome and mode (pull, push, local; none if rejected early)",
            ["outcome", "mode"],
            registry=reg,
        )
        self.queue_depth = Gauge(
            "pd_proxy_queue_depth",
            "Requests waiting for a prefill slot (--max-inflight-per-prefill)",
            registry=reg,
        )
        self.queue_wait = Histogram(
            "pd_proxy_queue_wait_seconds",
            "Time a request waited in the queue for a prefill slot, however the wait ended",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.retries = Counter(
            "pd_proxy_retries", "Legs retried on another backend", ["role"], registry=reg
        )
        self.migrations = Counter(
            "pd_proxy_migrations",
            "Requests that went on elsewhere after an engine failed them, counted once "
            "per migration when the request ended: cause (prefill_failed, no_prefill, "
            "decode_failed, mid_stream) and outcome (ok, failed); a failure that could "
            "not migrate counts once with outcome exhausted or unsupported",
            ["cause", "outcome"],
            registry=reg,
        )
        self.migration_added = Histogram(
            "pd_proxy_migration_added_seconds",
            "Per migrated request that ended well: the client's extra wait, from each "
            "failure's last progress to the replacement's first byte, summed",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.first_token = Counter(
            "pd_proxy_first_token",
            "Where a disaggregated request's first token came from: path seeded (P's "
            "token sent at once, D continued from the second), prefill (P's answer was the "
            "whole answer) or fallback (D computed it, as without "
            "--first-token-from-prefill), and why it fell back",
            ["path", "reason"],
            registry=reg,
        )
        self.decisions = Counter(
            "pd_proxy_prefill_decisions",
            "Where the prompt was prefilled: remote (P engine) or local (D engine), and why",
            ["decision", "reason"],
            registry=reg,
        )
        self.probes = Counter(
            "pd_proxy_identity_probes",
            "Push-mode identity probes of prefill engines by result",
            ["result"],
            registry=reg,
        )
        self.prefill_leg = Histogram(
            "pd_proxy_prefill_leg_seconds",
            "Prefill leg latency (request sent to response read)",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.decode_leg = Histogram(
            "pd_proxy_decode_leg_seconds",
            "Decode leg latency (request sent to last byte relayed)",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.ttft = Histogram(
            "pd_proxy_ttft_seconds",
            "Time from client request to first response byte sent to the client",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "pd_proxy_e2e_seconds",
            "Time from client request to the end of the response",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.multi_turn = Counter(
            "pd_proxy_multi_turn",
            "Multi-turn: how each turn's lookup ended (hit: P reads the history back "
            "from D; miss, expired, d_unavailable, readback_failed: P prefills it all)",
            ["outcome"],
            registry=reg,
        )
        self.affinity = Counter(
            "pd_proxy_multi_turn_decode",
            "Multi-turn: whether a next turn's D leg went to the D that kept the last "
            "turn (same) or elsewhere (other: unhealthy, busy)",
            ["placement"],
            registry=reg,
        )
        reg.register(_BackendCollector(pools))

    def render(self) -> bytes:
        return generate_latest(self.registry)
