"""The connector's payloads inside vLLM's step and startup messages.

These subclass vLLM's (abstract) connector metadata types, so they live on
the facade's side; what they carry is pure (``wire.specs``, ``protocol``,
``telemetry``). vLLM pickles them between the EngineCore and the workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_pd_ext.compat import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm_pd_ext.wire.protocol import AgentInfo
from vllm_pd_ext.wire.specs import PushRecvSpec, RecvSpec
from vllm_pd_ext.wire.telemetry import TransferRecord


@dataclass
class PDConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, every step."""

    reqs_to_recv: list[RecvSpec] = field(default_factory=list)
    #: D: requests whose load fails before any transfer: id -> (FailureReason value, why).
    reqs_to_fail: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: D, push: requests whose blocks P will write.
    push_recv: list[PushRecvSpec] = field(default_factory=list)
    #: D, push: waits that ended without the KV; no WRITE can land any more.
    push_fail: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: The step computes nothing: D's workers may wait (``pull_report_wait_ms``)
    #: for the loads they just started, to report them in this step.
    idle: bool = False


@dataclass
class PDHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at startup: what the side channel serves."""

    agent: AgentInfo
    #: Push producers: the worker's write-order socket (tcp://127.0.0.1:port).
    order_endpoint: str | None = None
    #: Push consumers: the worker's wake socket for the scheduler's idle wait
    #: (``wire.wakeup.Waker``).
    wake_endpoint: str | None = None
    #: Transfer targets: the bell of the worker's progress pump, rung by the
    #: scheduler half when a peer starts working with us (``wire.pump_bell``).
    pump_endpoint: str | None = None


@dataclass
class PDWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: the telemetry of the loads that ended
    (``telemetry.py``) and the token #1 each push that carried one brought
    (``pd_seed_pending``). vLLM aggregates the ranks' objects with
    ``aggregate``; ranks report the same seed for a request."""

    records: list[TransferRecord] = field(default_factory=list)
    seeds: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, PDWorkerMetadata):
            return PDWorkerMetadata(self.records + other.records, {**self.seeds, **other.seeds})
        return self
