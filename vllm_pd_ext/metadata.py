"""Scheduler -> worker payload for one engine step (pickled by vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_pd_ext.compat import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm_pd_ext.wire.protocol import AgentInfo
from vllm_pd_ext.wire.telemetry import TransferRecord


@dataclass(frozen=True)
class RecvSpec:
    """One D request whose prompt KV must be read from P."""

    request_id: str
    local_block_ids: list[int]
    #: P's block ids matching ``local_block_ids`` one to one (D's prefix-cache
    #: hit already cut off the front).
    remote_block_ids: list[int]
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_tp_size: int
    num_tokens: int
    #: Bidirectional: P reads a previous turn's KV back from D (same READ,
    #: counted apart in the metrics).
    readback: bool = False


@dataclass(frozen=True)
class PushRecvSpec:
    """One D request whose prompt KV P will write into ``local_block_ids``."""

    request_id: str
    pd_request_id: str
    local_block_ids: list[int]
    num_tokens: int
    #: The registration's ``notif_token``: only P's notification carries it.
    notif_token: str = ""


@dataclass(frozen=True)
class LayoutProblem:
    """Why D's blocks cannot take P's KV (scheduler half, either mode); the
    load fails with ``layout_mismatch``."""

    why: str


@dataclass
class PDConnectorMetadata(KVConnectorMetadata):
    reqs_to_recv: list[RecvSpec] = field(default_factory=list)
    #: D: requests whose load fails before any transfer: id -> (FailureReason value, why).
    reqs_to_fail: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: D, push: requests whose blocks P will write.
    push_recv: list[PushRecvSpec] = field(default_factory=list)
    #: D, push: waits that ended without the KV; no WRITE can land any more.
    push_fail: dict[str, tuple[str, str]] = field(default_factory=dict)


@dataclass
class PDHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at startup: what the side channel serves."""

    agent: AgentInfo
    #: Push producers: the worker's write-order socket (tcp://127.0.0.1:port).
    order_endpoint: str | None = None
    #: Push consumers: the worker's wake socket for the scheduler's idle wait
    #: (``idle_wait.Waker``).
    wake_endpoint: str | None = None


@dataclass
class PDWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: the telemetry of the loads that ended
    (``telemetry.py``). vLLM aggregates the ranks' objects with ``aggregate``."""

    records: list[TransferRecord] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, PDWorkerMetadata):
            return PDWorkerMetadata(self.records + other.records)
        return self
