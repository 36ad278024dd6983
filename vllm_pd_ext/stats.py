"""Connector stats: worker and scheduler counters -> logs and ``/metrics``.

``PDStats`` travels worker -> scheduler -> front end inside vLLM's
``KVConnectorOutput`` (a plain dict payload), is aggregated across workers and
steps, logged by vLLM's periodic "KV Transfer metrics" line, and recorded by
``PDPromMetrics`` as ``vllm:pd_ext_*`` Prometheus series.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_pd_ext.compat import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    create_metric_per_engine,
)
from vllm_pd_ext.scheduler.bidir import FALLBACK_LABELS

COUNTERS = (
    "num_transfers",
    "bytes_transferred",
    "num_descriptors",
    "num_blocks",
    "num_failures",
    "num_lease_expiries",
    "num_heartbeats",
    "num_leases_granted",
    "num_late_messages",
    "num_writes",
    "bytes_written",
    "num_registration_expiries",
    "num_unauthenticated",
    "num_wrong_sender",
    "num_seed_failures",
    "num_landed_before_step",
    # Multi-turn (scheduler/bidir.py): D keeps, P reads back.
    "num_turns_kept",
    "kept_blocks",
    "num_turns_not_kept",
    "num_turns_expired",
    "num_turns_evicted",
    "num_readbacks",
    "readback_tokens",
    "readback_bytes",
    *(f"readback_fallback_{label}" for label in FALLBACK_LABELS),
)
SERIES = ("transfer_seconds", "wait_seconds", "write_seconds", "descriptors_per_write",
          "registration_wait_seconds")


def _empty() -> dict[str, Any]:
    data: dict[str, Any] = {k: 0 for k in COUNTERS}
    data.update({k: [] for k in SERIES})
    return data


@dataclass
class PDStats(KVConnectorStats):
    def __post_init__(self) -> None:
        base = _empty()
        base.update(self.data or {})
        self.data = base

    def reset(self) -> None:
        self.data = _empty()

    def record_transfer(self, nbytes: int, ndescs: int, nblocks: int, seconds: float,
                        wait_seconds: float) -> None:
        self.data["num_transfers"] += 1
        self.data["bytes_transferred"] += nbytes
        self.data["num_descriptors"] += ndescs
        self.data["num_blocks"] += nblocks
        self.data["transfer_seconds"].append(seconds)
        self.data["wait_seconds"].append(wait_seconds)

    def record_readback(self, nbytes: int, seconds: float) -> None:
        """P: a previous turn's KV read back from D (bidirectional)."""
        self.data["readback_bytes"] += nbytes
        self.data["transfer_seconds"].append(seconds)

    def record_landed(self, nbytes: int, nblocks: int, wait_seconds: float) -> None:
        """D, push: a WRITE's notification arrived."""
        self.data["num_transfers"] += 1
        self.data["bytes_transferred"] += nbytes
        self.data["num_blocks"] += nblocks
        self.data["wait_seconds"].append(wait_seconds)

    def record_write(self, nbytes: int, ndescs: int, nblocks: int, seconds: float) -> None:
        """P, push: one WRITE completed."""
        self.data["num_writes"] += 1
        self.data["bytes_written"] += nbytes
        self.data["num_descriptors"] += ndescs
        self.data["write_seconds"].append(seconds)
        self.data["descriptors_per_write"].append(ndescs)

    def inc(self, key: str, n: int = 1) -> None:
        self.data[key] += n

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in COUNTERS:
            self.data[k] += other.data.get(k, 0)
        for k in SERIES:
            self.data[k] = list(self.data[k]) + list(other.data.get(k, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data[k] for k in COUNTERS if self.data[k]}
        secs = sorted(self.data["transfer_seconds"] or self.data["write_seconds"])
        if secs:
            out["transfer_p50_ms"] = round(secs[len(secs) // 2] * 1e3, 3)
            out["transfer_max_ms"] = round(secs[-1] * 1e3, 3)
            total = sum(secs)
            if total > 0:
                moved = self.data["bytes_transferred"] or self.data["bytes_written"]
                out["throughput_GBps"] = round(moved / total / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in COUNTERS) and not any(self.data[k] for k in SERIES)

    def take(self) -> PDStats | None:
        """Hand the accumulated stats to vLLM and start afresh."""
        if self.is_empty():
            return None
        out = PDStats(data=self.data)
        self.reset()
        return out


_TIME_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                 5, 10, 30, 60]

_COUNT_BUCKETS = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0]


class PDPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        def counter(key: str, doc: str) -> Any:
            metric = self._counter_cls(name=f"vllm:pd_ext_{key}", documentation=doc,
                                       labelnames=labelnames)
            return create_metric_per_engine(metric, per_engine_labelvalues)

        def histogram(key: str, doc: str, buckets: list[float] = _TIME_BUCKETS) -> Any:
            metric = self._histogram_cls(  # type: ignore[call-arg]
                name=f"vllm:pd_ext_{key}", documentation=doc, buckets=buckets,
                labelnames=labelnames)
            return create_metric_per_engine(metric, per_engine_labelvalues)

        self.counters = {
            "num_transfers": counter("kv_transfers", "KV reads completed (D)."),
            "bytes_transferred": counter("kv_bytes", "KV bytes read from prefill engines (D)."),
            "num_descriptors": counter("kv_descriptors", "Transfer descriptors posted (D)."),
            "num_blocks": counter("kv_blocks", "KV blocks read (D)."),
            "num_failures": counter("kv_failures", "Failed KV loads, any reason (D)."),
            "num_lease_expiries": counter("lease_expiries", "Leases that expired (P)."),
            "num_heartbeats": counter("heartbeats", "Lease heartbeats received (P)."),
            "num_leases_granted": counter("leases_granted", "Leases granted (P)."),
            "num_late_messages": counter("late_messages",
                                         "Renew/release for unknown or expired leases (P)."),
            "num_writes": counter("kv_writes", "Push: KV WRITEs completed (P)."),
            "bytes_written": counter("kv_bytes_written", "Push: KV bytes written to D (P)."),
            "num_registration_expiries": counter(
                "push_registration_expiries",
                "Push: D registrations whose prefill never finished in time (P)."),
            "num_unauthenticated": counter(
                "unauthenticated",
                "Side-channel frames and kv_transfer_params refused by authentication."),
            "num_wrong_sender": counter(
                "wrong_sender",
                "Lease and push messages refused: not from the engine holding that lease "
                "or registration."),
            "num_seed_failures": counter(
                "seed_failures",
                "Push legs sent before token #1 (pd_seed_pending) that ended with an error: "
                "no token #1 came with the KV, or the load failed (D)."),
            "num_landed_before_step": counter(
                "landed_before_step",
                "Push: loads D's scheduler saw land from its workers' forwarded "
                "notifications and scheduled at once, a step before the workers' report (D)."),
        }
        self.counters.update({
            "num_turns_kept": counter(
                "turns_kept", "Multi-turn: finished turns whose blocks D kept for the next (D)."),
            "kept_blocks": counter("kept_blocks", "Multi-turn: blocks D kept (D)."),
            "num_turns_not_kept": counter(
                "turns_not_kept",
                "Multi-turn: turns not kept, decoder_kv_blocks_budget full of read turns "
                "or the engine shutting down (D)."),
            "num_turns_expired": counter(
                "turns_expired",
                "Multi-turn: kept turns whose next turn never read them in time (D)."),
            "num_turns_evicted": counter(
                "turns_evicted",
                "Multi-turn: unread kept turns ended early because vLLM ran short of KV "
                "blocks (D)."),
            "num_readbacks": counter(
                "readback_transfers", "Multi-turn: previous turns read back from D (P)."),
            "readback_tokens": counter(
                "readback_tokens",
                "Multi-turn: prompt tokens P read back from D instead of computing (P)."),
            "readback_bytes": counter("readback_bytes",
                                      "Multi-turn: KV bytes read back from D (P)."),
        })
        fallback: Any = self._counter_cls(
            name="vllm:pd_ext_readback_fallbacks",
            documentation="Multi-turn: next turns P prefilled without reading back from D, "
                          "by reason (P).",
            labelnames=[*labelnames, "reason"])
        self.fallbacks: dict[int, dict[str, Any]] = {
            idx: {label: fallback.labels(*values, label) for label in FALLBACK_LABELS}
            for idx, values in per_engine_labelvalues.items()}
        self.histograms = {
            "transfer_seconds": histogram("kv_transfer_seconds", "READ post to completion (D)."),
            "wait_seconds": histogram("kv_wait_seconds",
                                      "Worker receipt of a request to its KV being ready (D)."),
            "write_seconds": histogram("kv_write_seconds", "Push: WRITE post to completion (P)."),
            "registration_wait_seconds": histogram(
                "push_registration_wait_seconds",
                "Push: how long the first of D's registration and P's finished prefill "
                "waited for the other (P)."),
            "descriptors_per_write": histogram(
                "push_descriptors_per_write",
                "Push: descriptors (contiguous runs) per request's WRITE (P).",
                buckets=_COUNT_BUCKETS),
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, metric in self.counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                metric[engine_idx].inc(value)
        for label, metric in self.fallbacks.get(engine_idx, {}).items():
            value = transfer_stats_data.get(f"readback_fallback_{label}", 0)
            if value:
                metric.inc(value)
        for key, metric in self.histograms.items():
            for value in transfer_stats_data.get(key, []):
                metric[engine_idx].observe(value)
