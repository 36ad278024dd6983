"""The scheduler half's counters that other objects keep as running totals.

The lease owner, the side channel, the push halves and the read-back
consumer count since start (each on its own thread); vLLM wants what
happened since the last ``get_kv_connector_stats``. ``collect`` turns the
totals into increments of the step's ``PDStats``, on the scheduler thread.
"""

from __future__ import annotations

from typing import Any

from vllm_pd_ext.leases.service import LeaseService
from vllm_pd_ext.stats import PDStats


class SchedulerCounters:
    def __init__(self) -> None:
        #: The totals already reported, by PDStats key.
        self._reported: dict[str, int] = {}

    def _add(self, stats: PDStats, key: str, total: int) -> None:
        stats.inc(key, total - self._reported.get(key, 0))
        self._reported[key] = total

    def collect(self, stats: PDStats, leases: LeaseService, server: Any, producer: Any,
                consumer: Any, readback: Any) -> None:
        """Add to ``stats`` what changed since the last call."""
        if producer is not None:
            for wait in producer.take_registration_waits():
                stats.data["registration_wait_seconds"].append(wait)
            expired = producer.num_expired_registrations
            stats.inc("num_registration_expiries", expired)
            producer.num_expired_registrations -= expired
        counters = leases.counters()
        self._add(stats, "num_heartbeats", counters.num_heartbeats)
        self._add(stats, "num_late_messages", counters.num_late_messages)
        if server is not None:
            self._add(stats, "num_unauthenticated", server.num_unauthenticated)
        wrong = counters.num_wrong_sender + sum(
            half.num_wrong_sender for half in (producer, consumer) if half is not None)
        self._add(stats, "num_wrong_sender", wrong)
        self._add(stats, "readback_tokens", readback.num_tokens)
        self._add(stats, "num_readbacks", readback.num_loads)
